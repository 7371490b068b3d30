/* SPDX-License-Identifier: Apache-2.0
 *
 * ipc_dev_cuda.c - the cuda_ipc transport's device layer on the driver API (csrc/cuda/
 * cuda_lib.h): legacy IPC handles (cuIpcGetMemHandle / cuIpcOpenMemHandle), copies and events
 * on xccl's stream. Built only with XCCL_HAVE_CUDA. Every entry makes the device's primary
 * context current first (the progress thread calls in too) and checks every driver result.
 */
#ifdef XCCL_HAVE_CUDA

#include <stdlib.h>
#include <string.h>

/* the device layer is internal to xccl (csrc/cuda), not part of the transport API: named by
 * its path, so that this file builds with the public include path of the backends too */
#include "../../csrc/cuda/cuda_lib.h"
#include "ipc_dev.h"
#include "xccl/xccl_tp_support.h"

_Static_assert(sizeof(CUipcMemHandle) == IPC_HANDLE_BYTES, "an IPC handle is 64 bytes");

/* A driver that sees a device is enough: the process may choose its device after the
 * communicator is created (its first CUDA tensor usually does). Every entry below enters that
 * device and fails, cleanly, while none is chosen; a receiver without one cannot map a peer's
 * memory and has the bytes sent through host memory instead (IPC_T_RESEND). */
xccl_status_t ipc_dev_cuda_usable(void)
{
    if (xccl_cuda_load() != XCCL_OK)
        return xccl_error_set(XCCL_ERR_NOT_SUPPORTED, "no CUDA driver: %s", xccl_cuda_load_error());
    return XCCL_OK;
}

/* Never fails: what the driver cannot tell sends the data through host memory (slower,
 * never wrong: cuMemcpyAsync reaches any pointer with unified addressing). */
static xccl_status_t cu_ptr_info(const void *ptr, size_t n, uint64_t *base, uint64_t *size,
                                 uint64_t *buf_id, int *ipc_ok)
{
    if (xccl_cuda_alloc_info(ptr, base, size, buf_id, ipc_ok) != XCCL_OK) {
        XCCL_INFO("cuda_ipc: %p: %s: sent through host memory", ptr, xccl_last_error());
        *base   = (uint64_t)(uintptr_t)ptr;
        *size   = n;
        *buf_id = 0;
        *ipc_ok = 0;
    }
    return XCCL_OK;
}

static xccl_status_t cu_export(uint64_t base, uint64_t size, uint64_t buf_id,
                               uint8_t handle[IPC_HANDLE_BYTES])
{
    CUipcMemHandle h;

    (void)size, (void)buf_id;
    XCCL_CHECK(xccl_cuda_enter());
    XCCL_CU_CHECK(xccl_cu.IpcGetMemHandle(&h, (CUdeviceptr)base), "cuda_ipc: cuIpcGetMemHandle");
    memcpy(handle, &h, IPC_HANDLE_BYTES);
    return XCCL_OK;
}

static xccl_status_t cu_import(int32_t pid, const uint8_t handle[IPC_HANDLE_BYTES], void **mapped)
{
    CUipcMemHandle h;
    CUdeviceptr    p = 0;
    CUresult       rc;

    (void)pid;
    XCCL_CHECK(xccl_cuda_enter());
    memcpy(&h, handle, IPC_HANDLE_BYTES);
    if (!xccl_cuda_sync_begin()) return XCCL_INPROGRESS; /* cuda_lib.h: not while a stream waits */
    rc = xccl_cu.IpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    xccl_cuda_sync_end();
    if (rc != CUDA_SUCCESS) return xccl_cuda_fail(rc, "cuda_ipc: cuIpcOpenMemHandle of a peer's buffer");
    *mapped = (void *)(uintptr_t)p;
    return XCCL_OK;
}


static xccl_status_t cu_copy(void *dst, const void *src, size_t n, int32_t src_pid)
{
    (void)src_pid;
    XCCL_CHECK(xccl_cuda_enter());
    XCCL_CU_CHECK(xccl_cu.MemcpyAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, n,
                                      xccl_cuda_stream()),
                  "cuda_ipc: cuMemcpyAsync");
    return XCCL_OK;
}

static xccl_status_t cu_record(void **ev)
{
    CUevent  e;
    CUresult rc;

    XCCL_CHECK(xccl_cuda_enter());
    e = xccl_cuda_event_get();
    if (e == NULL) return XCCL_ERR_CUDA; /* the error is set */
    rc = xccl_cu.EventRecord(e, xccl_cuda_stream());
    if (rc != CUDA_SUCCESS) {
        xccl_cuda_event_put(e);
        return xccl_cuda_fail(rc, "cuda_ipc: cuEventRecord");
    }
    *ev = e;
    return XCCL_OK;
}

static xccl_status_t cu_test(void *ev)
{
    CUresult rc;

    XCCL_CHECK(xccl_cuda_enter());
    rc = xccl_cu.EventQuery((CUevent)ev);
    if (rc == CUDA_SUCCESS) return XCCL_OK;
    if (rc == CUDA_ERROR_NOT_READY) return XCCL_INPROGRESS;
    return xccl_cuda_fail(rc, "cuda_ipc: cuEventQuery");
}

static xccl_status_t cu_wait(void *ev)
{
    XCCL_CHECK(xccl_cuda_enter());
    XCCL_CU_CHECK(xccl_cu.EventSynchronize((CUevent)ev), "cuda_ipc: cuEventSynchronize");
    return XCCL_OK;
}

static void cu_free(void *ev)
{
    if (ev != NULL) xccl_cuda_event_put((CUevent)ev);
}

/* Bounce buffers: pinned (cuMemHostAlloc) unless a stream waits for a gate (cuda_lib.h), then
 * pageable (copies through them block the progress until xccl's stream gets there, which it
 * does: it never waits for a caller's stream). A header in front says which. */
#define HOST_HDR       64
#define HOST_PINNED    0x70696e6eu /* "pinn" */
#define HOST_PAGEABLE  0x70616765u /* "page" */

static void *cu_host_alloc(size_t n)
{
    void    *p = NULL;
    CUresult rc;
    uint32_t kind = HOST_PINNED;

    if (xccl_cuda_enter() != XCCL_OK) return NULL;
    if (xccl_cuda_sync_begin()) {
        rc = xccl_cu.MemHostAlloc(&p, n + HOST_HDR, CU_MEMHOSTALLOC_PORTABLE);
        xccl_cuda_sync_end();
        if (rc != CUDA_SUCCESS) {
            (void)xccl_cuda_fail(rc, "cuda_ipc: cuMemHostAlloc of a bounce buffer");
            return NULL;
        }
    } else {
        if (posix_memalign(&p, HOST_HDR, n + HOST_HDR) != 0) {
            (void)xccl_error_set(XCCL_ERR_NO_MEMORY, "cuda_ipc: no host memory to bounce %zu bytes",
                                 n);
            return NULL;
        }
        kind = HOST_PAGEABLE;
    }
    memcpy(p, &kind, sizeof kind);
    return (char *)p + HOST_HDR;
}

static int cu_host_pinned(const void *p)
{
    uint32_t kind;

    memcpy(&kind, (const char *)p - HOST_HDR, sizeof kind);
    return kind == HOST_PINNED;
}

static void cu_host_free(void *p)
{
    uint32_t kind;

    if (p == NULL) return;
    p = (char *)p - HOST_HDR;
    memcpy(&kind, p, sizeof kind);
    if (kind == HOST_PAGEABLE) free(p);
    else xccl_cuda_release(XCCL_CUDA_FREE_HOST, p);
}

const ipc_dev_ops_t ipc_dev_cuda = {
    .name          = "cuda",
    .ptr_info      = cu_ptr_info,
    .export_handle = cu_export,
    .import_handle = cu_import,
    .close_handle  = xccl_cuda_ipc_close,
    .copy          = cu_copy,
    .event_record  = cu_record,
    .event_test    = cu_test,
    .event_wait    = cu_wait,
    .event_free    = cu_free,
    .host_alloc    = cu_host_alloc,
    .host_free     = cu_host_free,
    .host_pinned   = cu_host_pinned,
};

#else
typedef int xccl_ipc_dev_cuda_unused; /* an empty translation unit is not ISO C */
#endif
