/* SPDX-License-Identifier: Apache-2.0
 *
 * exec.h - executors: where an operation's local work runs, chosen by the memory type of its
 * buffers. A transport moves bytes and an algorithm decides which bytes; an executor performs
 * the local copies and reductions and owns scratch memory of its memory type. The CPU executor
 * serves XCCL_MEM_HOST; a device executor (CUDA) registers for XCCL_MEM_CUDA.
 *
 * Completion: copy and reduce either finish before they return (XCCL_OK, *ev left NULL) or are
 * queued (XCCL_INPROGRESS, *ev set) and finish later; `test` then reports XCCL_OK once (and
 * releases the event), XCCL_INPROGRESS while running, or an error. The core never blocks on an
 * event: it tests it in its progress pass, as it tests transport requests.
 *
 * Threading: called under the context lock (one thread at a time per context).
 */
#ifndef XCCL_CORE_EXEC_H
#define XCCL_CORE_EXEC_H

#include <stddef.h>

#include "xccl/xccl.h"

typedef struct xccl_exec_ops {
    const char     *name; /* "cpu", "cuda" */
    xccl_mem_type_t mem;
    /* dst = src over nbytes; either buffer may also be host memory (staging in and out). */
    xccl_status_t (*copy)(void *dst, const void *src, size_t nbytes, void **ev);
    /* dst = a op b over count elements (dst may alias a or b). */
    xccl_status_t (*reduce)(void *dst, const void *a, const void *b, size_t count,
                            xccl_dtype_t dtype, xccl_op_t op, void **ev);
    /* XCCL_OK (event released), XCCL_INPROGRESS, or an error (event released). NULL when
     * every operation of this executor finishes before it returns. */
    xccl_status_t (*test)(void *ev);
    /* Scratch memory of this memory type; NULL when out of memory. */
    void *(*alloc)(size_t nbytes);
    void (*free)(void *p);
} xccl_exec_ops_t;

/* The executor for buffers of memory type `mem`, or NULL when this process has none (e.g.
 * XCCL_MEM_CUDA without a CUDA runtime). */
const xccl_exec_ops_t *xccl_exec_for(xccl_mem_type_t mem);

#endif /* XCCL_CORE_EXEC_H */
