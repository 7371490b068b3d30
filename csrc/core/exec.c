/* SPDX-License-Identifier: Apache-2.0
 *
 * exec.c - the executor table (exec.h) and the CPU executor: memcpy and the reduction kernels
 * of reduce.c, synchronous, with malloc'd scratch.
 */
#include "core/exec.h"

#include <stdlib.h>
#include <string.h>

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

static void *cpu_alloc(size_t nbytes) { return malloc(nbytes ? nbytes : 1); }

static const xccl_exec_ops_t cpu_exec = {
    .name   = "cpu",
    .mem    = XCCL_MEM_HOST,
    .copy   = cpu_copy,
    .reduce = cpu_reduce,
    .test   = NULL,
    .alloc  = cpu_alloc,
    .free   = free,
};

const xccl_exec_ops_t *xccl_exec_for(xccl_mem_type_t mem)
{
    return mem == XCCL_MEM_HOST ? &cpu_exec : NULL;
}
