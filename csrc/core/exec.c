/* SPDX-License-Identifier: Apache-2.0
 *
 * exec.c - the executor table (exec.h) and the CPU executor: memmove and the reduction kernels
 * of reduce.c, synchronous, with malloc'd scratch.
 */
#include "core/exec.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core/reduce.h"
#include "xccl/xccl_tp_support.h"

static xccl_status_t cpu_copy(void *q, void *dst, const void *src, size_t nbytes, void **ev)
{
    (void)q;
    *ev = NULL;
    if (dst != src && nbytes > 0) memmove(dst, src, nbytes);
    return XCCL_OK;
}

static xccl_status_t cpu_reduce(void *q, void *dst, const void *a, const void *b, size_t count,
                                xccl_dtype_t dtype, xccl_op_t op, void **ev)
{
    (void)q;
    *ev = NULL;
    return xccl_reduce2(dst, a, b, count, dtype, op);
}

static xccl_status_t cpu_scale(void *q, void *dst, const void *src, size_t count, xccl_dtype_t dtype,
                               double factor, void **ev)
{
    (void)q;
    *ev = NULL;
    return xccl_scale(dst, src, count, dtype, factor);
}

static xccl_status_t cpu_divide(void *q, void *dst, const void *src, size_t count, xccl_dtype_t dtype,
                                int n, void **ev)
{
    (void)q;
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

/* Filled at start-up, when a process chooses its device (xccl_exec_register) and by tests;
 * read without a lock (an entry, once set, stays). */
static const xccl_exec_ops_t *_Atomic exec_table[XCCL_MEM_TYPES] = {[XCCL_MEM_HOST] =
                                                                        &xccl_exec_cpu};

const xccl_exec_ops_t *xccl_exec_for(xccl_mem_type_t mem)
{
    return (unsigned)mem < XCCL_MEM_TYPES
               ? atomic_load_explicit(&exec_table[mem], memory_order_acquire)
               : NULL;
}

xccl_status_t xccl_exec_register(const xccl_exec_ops_t *ops)
{
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    xccl_status_t          st   = XCCL_OK;
    const xccl_exec_ops_t *old;

    if (ops == NULL || (unsigned)ops->mem >= XCCL_MEM_TYPES || ops->mem == XCCL_MEM_HOST)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "executor registration: not a device memory type");
    pthread_mutex_lock(&lock);
    old = atomic_load(&exec_table[ops->mem]);
    if (old == NULL) atomic_store_explicit(&exec_table[ops->mem], ops, memory_order_release);
    else if (old != ops)
        st = XCCL_ERROR(XCCL_ERR_INVALID_USAGE, "executor registration: memory type %d already "
                        "has the %s executor", (int)ops->mem, old->name);
    pthread_mutex_unlock(&lock);
    return st;
}

const xccl_exec_ops_t *xccl_exec_set_for_test(xccl_mem_type_t mem, const xccl_exec_ops_t *ops)
{
    const xccl_exec_ops_t *old;

    if ((unsigned)mem >= XCCL_MEM_TYPES) return NULL;
    old = atomic_exchange(&exec_table[mem], ops);
    return old;
}
