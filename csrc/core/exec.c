/* SPDX-License-Identifier: Apache-2.0
 *
 * exec.c - the executor table (exec.h) and the CPU executor: memmove and the reduction kernels
 * of reduce.c, synchronous, with malloc'd scratch.
 */
#include "core/exec.h"

#include <stdlib.h>
#include <string.h>

#include "core/check.h"
#include "core/reduce.h"

static xccl_status_t cpu_copy(void *dst, const void *src, size_t nbytes, void **ev)
{
    *ev = NULL;
    if (dst != src && nbytes > 0) memmove(dst, src, nbytes);
    return XCCL_OK;
}

static xccl_status_t cpu_reduce(void *dst, const void *a, const void *b, size_t count,
                                xccl_dtype_t dtype, xccl_op_t op, void **ev)
{
    *ev = NULL;
    return xccl_reduce2(dst, a, b, count, dtype, op);
}

static xccl_status_t cpu_scale(void *dst, const void *src, size_t count, xccl_dtype_t dtype,
                               double factor, void **ev)
{
    *ev = NULL;
    return xccl_scale(dst, src, count, dtype, factor);
}

static xccl_status_t cpu_divide(void *dst, const void *src, size_t count, xccl_dtype_t dtype,
                                int n, void **ev)
{
    *ev = NULL;
    return xccl_divide(dst, src, count, dtype, n);
}

static void *cpu_alloc(size_t nbytes) { return malloc(nbytes ? nbytes : 1); }

const xccl_exec_ops_t xccl_exec_cpu = {
    .name   = "cpu",
    .mem    = XCCL_MEM_HOST,
    .copy   = cpu_copy,
    .reduce = cpu_reduce,
    .scale  = cpu_scale,
    .divide = cpu_divide,
    .test   = NULL,
    .alloc  = cpu_alloc,
    .free   = free,
};

/* Filled once at start-up (and by tests); read without a lock. */
static const xccl_exec_ops_t *exec_table[XCCL_MEM_TYPES] = {[XCCL_MEM_HOST] = &xccl_exec_cpu};

const xccl_exec_ops_t *xccl_exec_for(xccl_mem_type_t mem)
{
    return (unsigned)mem < XCCL_MEM_TYPES ? __atomic_load_n(&exec_table[mem], __ATOMIC_ACQUIRE)
                                          : NULL;
}

xccl_status_t xccl_exec_register(const xccl_exec_ops_t *ops)
{
    if (ops == NULL || (unsigned)ops->mem >= XCCL_MEM_TYPES || ops->mem == XCCL_MEM_HOST)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "exec: invalid executor to register");
    if (exec_table[ops->mem] == ops) return XCCL_OK;
    if (exec_table[ops->mem] != NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_USAGE,
                          "exec: an executor (%s) is already installed for this memory type",
                          exec_table[ops->mem]->name);
    /* readers (xccl_exec_for) may run in other threads: publish with release */
    __atomic_store_n(&exec_table[ops->mem], ops, __ATOMIC_RELEASE);
    return XCCL_OK;
}

const xccl_exec_ops_t *xccl_exec_set_for_test(xccl_mem_type_t mem, const xccl_exec_ops_t *ops)
{
    const xccl_exec_ops_t *old;

    if ((unsigned)mem >= XCCL_MEM_TYPES) return NULL;
    old             = exec_table[mem];
    exec_table[mem] = ops;
    return old;
}
