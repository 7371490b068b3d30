/* SPDX-License-Identifier: Apache-2.0
 *
 * ipc_dev.h - every device call the cuda_ipc transport makes, behind one table: the real one
 * (ipc_dev_cuda.c, on csrc/cuda/cuda_lib.h, built with XCCL_HAVE_CUDA) and a fake one for
 * tests on machines without a GPU (ipc_dev_fake.c: "device memory" is host memory, a handle
 * names (pid, address, buffer id), a copy from a peer's memory is a process_vm_readv, and
 * copies and events run in order on a fake stream, an event completing after a few tests).
 * Every entry is called under the core's lock (one thread at a time per context).
 */
#ifndef XCCL_IPC_DEV_H
#define XCCL_IPC_DEV_H

#include <stddef.h>
#include <stdint.h>

#include "../../csrc/cuda/ipc_cache.h"
#include "xccl/xccl.h"

typedef struct ipc_dev_ops {
    const char *name;
    /* The allocation holding [ptr, ptr + n): its range, its buffer id (unique in this process
     * for the process's life) and whether legacy IPC can export it (0: e.g. a cudaMallocAsync
     * pool or a VMM allocation; the transport then copies through host memory). */
    xccl_status_t (*ptr_info)(const void *ptr, size_t n, uint64_t *base, uint64_t *size,
                              uint64_t *buf_id, int *ipc_ok);
    /* The IPC handle of the allocation starting at base. */
    xccl_status_t (*export_handle)(uint64_t base, uint64_t size, uint64_t buf_id,
                                   uint8_t handle[IPC_HANDLE_BYTES]);
    /* Maps a peer's allocation (its process id, for the fake) here; *mapped: its base here. */
    xccl_status_t (*import_handle)(int32_t pid, const uint8_t handle[IPC_HANDLE_BYTES],
                                   void **mapped);
    void (*close_handle)(void *mapped);
    /* Queues a copy of n bytes on the stream. src_pid: the process src belongs to when it lies
     * in an imported mapping (the fake reads it from there), 0 for this process's memory.
     * Either side may be host memory. */
    xccl_status_t (*copy)(void *dst, const void *src, size_t n, int32_t src_pid);
    /* Records an event on the stream: completes once everything queued before has. */
    xccl_status_t (*event_record)(void **ev);
    /* XCCL_OK once complete, XCCL_INPROGRESS, or an error; the event stays the caller's. */
    xccl_status_t (*event_test)(void *ev);
    /* Blocks until the event completed (teardown and failure paths only). */
    xccl_status_t (*event_wait)(void *ev);
    /* Gives the event back (it may still be pending: only re-recorded later). */
    void (*event_free)(void *ev);
    /* Host memory for bounce buffers (NULL: none, the error set): pinned, since a copy to or
     * from pageable memory blocks the calling thread until xccl's stream reaches it; pageable
     * only while pinning would have to wait for a stream held by a completion gate
     * (csrc/cuda/cuda_lib.h), which host_pinned tells (NULL: always pinned). Such a buffer
     * is not kept in the pool. */
    void *(*host_alloc)(size_t n);
    void (*host_free)(void *p);
    int (*host_pinned)(const void *p);
} ipc_dev_ops_t;

/* The fake device (tests): selected by the test-only XCCL_CUDA_IPC_FAKE (1: every buffer is
 * exportable, "nolegacy": none is, "noimport": no handle can be opened, "stuckcopy": copies
 * from a peer never complete until waited for). */
extern const ipc_dev_ops_t ipc_dev_fake;
int                        ipc_dev_fake_legacy(void);

#ifdef XCCL_HAVE_CUDA
/* The real one; init checks the driver and the device first. */
extern const ipc_dev_ops_t ipc_dev_cuda;
xccl_status_t              ipc_dev_cuda_usable(void);
#endif

#endif /* XCCL_IPC_DEV_H */
