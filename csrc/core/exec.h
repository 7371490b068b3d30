/* SPDX-License-Identifier: Apache-2.0
 *
 * exec.h - executors: where an operation's local work runs, chosen by the memory type of its
 * buffers. A transport moves bytes and an algorithm decides which bytes; an executor performs
 * the local copies and reductions and owns scratch memory of its memory type. The CPU executor
 * serves XCCL_MEM_HOST; a device executor (CUDA) registers for XCCL_MEM_CUDA.
 *
 * Completion: copy, reduce, scale and divide either finish before they return (XCCL_OK, *ev
 * left NULL) or are queued (XCCL_INPROGRESS, *ev set) and finish later; `test` then reports
 * XCCL_OK once (and releases the event), XCCL_INPROGRESS while running, or an error (event
 * released). The core never blocks on an event while an operation succeeds: it tests events in
 * its progress pass, as it tests transport requests (a failed operation waits for its events
 * before it frees their buffers).
 *
 * Ordering: the operations of one queue run in the order they were issued, like work on one
 * stream, so a reduction may be issued on the result of one still queued. Each communicator
 * has a queue of its own (queue_new); nothing orders two queues but the core. What an
 * executor cannot order - the transports reading or writing its memory - the core orders
 * (algo.h: sends and receives wait for the events issued before them).
 *
 * Threading: called under the context lock (one thread at a time per context), or before the
 * operation is visible to other threads (the prologue of a collective).
 */
#ifndef XCCL_CORE_EXEC_H
#define XCCL_CORE_EXEC_H

#include <stddef.h>
#include <stdint.h>

#include "xccl/xccl.h"

typedef struct xccl_exec_ops {
    const char     *name; /* "cpu", "cuda" */
    xccl_mem_type_t mem;
    /* Every operation below runs on queue `q` (queue_new; NULL: the executor's default), in
     * order with the others of that queue.
     * dst = src over nbytes; either buffer may also be host memory (staging in and out). The
     * ranges may overlap (memmove semantics). */
    xccl_status_t (*copy)(void *q, void *dst, const void *src, size_t nbytes, void **ev);
    /* dst = a op b over count elements (dst may alias a or b), op a base operator. */
    xccl_status_t (*reduce)(void *q, void *dst, const void *a, const void *b, size_t count,
                            xccl_dtype_t dtype, xccl_op_t op, void **ev);
    /* dst = src * factor (PREMUL_SUM), semantics of xccl_scale (reduce.h). */
    xccl_status_t (*scale)(void *q, void *dst, const void *src, size_t count, xccl_dtype_t dtype,
                           double factor, void **ev);
    /* dst = src / n (AVG), semantics of xccl_divide (reduce.h). */
    xccl_status_t (*divide)(void *q, void *dst, const void *src, size_t count,
                            xccl_dtype_t dtype, int n, void **ev);
    /* XCCL_OK (event released), XCCL_INPROGRESS, or an error (event released). NULL when
     * every operation of this executor finishes before it returns. */
    xccl_status_t (*test)(void *ev);
    /* Queues (device executors; NULL elsewhere): a communicator's own (a CUDA stream), so that
     * the device work of different communicators may overlap. queue_free once nothing is
     * queued on it any more. */
    xccl_status_t (*queue_new)(void **q);
    void (*queue_free)(void *q);
    /* Scratch memory of this memory type; NULL when out of memory. free waits for the
     * operations of every queue that may still use it. */
    void *(*alloc)(size_t nbytes);
    void (*free)(void *p);

    /* ---- streams (device executors; all NULL on the CPU executor and fakes without them) ----
     * order_after: marks the point the caller's `stream` (NULL: the legacy default stream)
     * has reached: XCCL_OK when everything queued there before has finished already, else
     * XCCL_INPROGRESS with *ev, an event like the others (test). The core starts the
     * operation - its first copy, its first transfer - only once the event has completed: the
     * device never waits for a caller's stream on the executor's queue, because that stream
     * may itself wait (gate_wait) for an earlier operation whose remaining work would then
     * queue behind the wait. drop_event, required with order_after, gives up an event without
     * waiting for it (an operation that failed or timed out before its stream got there).
     * Called when an operation on this memory type is posted. */
    xccl_status_t (*order_after)(void *stream, void **ev);
    void (*drop_event)(void *ev);
    /* Completion gates: a device Work takes a gate when posted (gate_new: its ticket) and opens
     * it exactly once when it finishes, whatever the outcome (gate_open). gate_wait makes
     * `stream` wait, on the device, until the gate of `ticket` is open. A gate never stays
     * closed: a Work always finishes (completion, failure, timeout, abort, destroy). */
    xccl_status_t (*gate_new)(uint64_t *ticket);
    void (*gate_open)(uint64_t ticket);
    xccl_status_t (*gate_wait)(uint64_t ticket, void *stream);

    /* ---- host memory the device copies to and from (device executors; NULL elsewhere) ----
     * host_register pins [p, p + nbytes) for the device (cuMemHostRegister), so that copies
     * between it and device memory are asynchronous: CUDA copies a pageable host buffer
     * synchronously - the calling thread, the progress, waits until the device reaches the
     * copy. For buffers kept for reuse (staging bounce buffers). XCCL_OK, or anything else
     * (XCCL_INPROGRESS, with no error recorded, when pinning would have to wait for a stream
     * held by a completion gate): the buffer stays pageable, which only costs speed.
     * host_release unpins p and frees it (free()): p came from malloc or posix_memalign, was
     * pinned by host_register, and no queued copy uses it. The executor may do both later (it
     * must not wait for such a stream either), so the caller hands the memory over. */
    xccl_status_t (*host_register)(void *p, size_t nbytes);
    void (*host_release)(void *p);

    /* ---- peer access (device executors whose memory other processes of the host can map;
     * NULL elsewhere) ----
     * export_mem: describes [ptr, ptr + nbytes) in at most XCCL_EXEC_BLOB_MAX bytes (*len) so
     * that another process can map it; XCCL_ERR_NOT_SUPPORTED (no error recorded as a failure:
     * callers fall back) when this memory cannot be shared, e.g. not from the allocator IPC
     * works with. import_mem: maps what another process's export_mem described; *ptr is the
     * start of that range. Mappings are cached by the executor (importing the same allocation
     * again costs a lookup) and stay valid until the executor sees the exporter reuse the
     * address range for another allocation, so a caller uses *ptr only while the exporter
     * keeps the memory (its operation runs).
     * reduce_n: dst = srcs[0] op srcs[1] op ... srcs[k-1], applied left to right (2 <= k <=
     * XCCL_EXEC_REDUCE_MAX; dst may alias any source), asynchronous like reduce. */
    xccl_status_t (*export_mem)(const void *ptr, size_t nbytes, void *blob, size_t *len);
    xccl_status_t (*import_mem)(const void *blob, size_t len, void **ptr);
    xccl_status_t (*reduce_n)(void *q, void *dst, const void *const *srcs, int k, size_t count,
                              xccl_dtype_t dtype, xccl_op_t op, void **ev);
} xccl_exec_ops_t;

#define XCCL_EXEC_BLOB_MAX   128
#define XCCL_EXEC_REDUCE_MAX 8

/* The CPU executor (XCCL_MEM_HOST): synchronous. Callers may compare against it to take a
 * direct path (memcpy, the reduction kernels) without a call through the table. */
extern const xccl_exec_ops_t xccl_exec_cpu;

/* The executor for buffers of memory type `mem`, or NULL when this process has none (e.g.
 * XCCL_MEM_CUDA without a CUDA runtime) or mem is not a memory type. */
const xccl_exec_ops_t *xccl_exec_for(xccl_mem_type_t mem);

/* Installs the executor of its memory type (ops->mem), once per process (a device backend,
 * when the process chooses its device). XCCL_ERR_INVALID_USAGE if another is installed. */
xccl_status_t xccl_exec_register(const xccl_exec_ops_t *ops);

/* Tests only: installs `ops` (NULL: none) as the executor of `mem` and returns the previous
 * one. Not thread-safe: call while no operation runs. */
const xccl_exec_ops_t *xccl_exec_set_for_test(xccl_mem_type_t mem, const xccl_exec_ops_t *ops);

#endif /* XCCL_CORE_EXEC_H */
