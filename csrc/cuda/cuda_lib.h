/* SPDX-License-Identifier: Apache-2.0
 *
 * cuda_lib.h - xccl's device layer for CUDA: the driver API loaded at run time, the process's
 * device and its primary context, xccl's stream, and an event pool. Used by the CUDA executor
 * (cuda_exec.c), the kernels' launcher and the cuda_ipc transport; nothing else includes it.
 * Built only when the CUDA headers are found (XCCL_HAVE_CUDA); libcuda.so.1 is opened with
 * dlopen, never linked, so the module imports on machines without a driver.
 *
 * Threading: xccl_cuda_load and xccl_cuda_bind are thread-safe (once). Every other call needs
 * the device's primary context current in the calling thread: xccl_cuda_enter makes it so (a
 * cheap check when it already is). The progress thread and callers' threads both call in.
 */
#ifndef XCCL_CUDA_LIB_H
#define XCCL_CUDA_LIB_H

#include <cuda.h>
#include <stddef.h>
#include <stdint.h>

#include "xccl/xccl.h"

/* The driver entry points xccl uses, resolved once by xccl_cuda_load (the versioned symbols
 * that the headers' macros name, e.g. cuMemAlloc_v2). */
typedef struct xccl_cu {
    CUresult (*Init)(unsigned int flags);
    CUresult (*DriverGetVersion)(int *version);
    CUresult (*GetErrorName)(CUresult err, const char **s);
    CUresult (*GetErrorString)(CUresult err, const char **s);
    CUresult (*DeviceGet)(CUdevice *dev, int ordinal);
    CUresult (*DeviceGetCount)(int *count);
    CUresult (*DeviceGetName)(char *name, int len, CUdevice dev);
    CUresult (*DeviceGetAttribute)(int *v, CUdevice_attribute attr, CUdevice dev);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *ctx, CUdevice dev);
    CUresult (*DevicePrimaryCtxRelease)(CUdevice dev);
    CUresult (*CtxGetCurrent)(CUcontext *ctx);
    CUresult (*CtxSetCurrent)(CUcontext ctx);
    CUresult (*StreamCreateWithPriority)(CUstream *s, unsigned int flags, int priority);
    CUresult (*StreamDestroy)(CUstream s);
    CUresult (*StreamWaitValue32)(CUstream s, CUdeviceptr addr, cuuint32_t value,
                                  unsigned int flags);
    CUresult (*StreamSynchronize)(CUstream s);
    CUresult (*EventCreate)(CUevent *ev, unsigned int flags);
    CUresult (*EventDestroy)(CUevent ev);
    CUresult (*EventRecord)(CUevent ev, CUstream s);
    CUresult (*EventQuery)(CUevent ev);
    CUresult (*EventSynchronize)(CUevent ev);
    CUresult (*MemAlloc)(CUdeviceptr *p, size_t nbytes);
    CUresult (*MemFree)(CUdeviceptr p);
    CUresult (*MemHostAlloc)(void **p, size_t nbytes, unsigned int flags);
    CUresult (*MemFreeHost)(void *p);
    CUresult (*MemHostGetDevicePointer)(CUdeviceptr *d, void *p, unsigned int flags);
    CUresult (*MemHostRegister)(void *p, size_t nbytes, unsigned int flags);
    CUresult (*MemHostUnregister)(void *p);
    CUresult (*MemcpyAsync)(CUdeviceptr dst, CUdeviceptr src, size_t nbytes, CUstream s);
    CUresult (*MemGetAddressRange)(CUdeviceptr *base, size_t *size, CUdeviceptr p);
    CUresult (*PointerGetAttribute)(void *data, CUpointer_attribute attr, CUdeviceptr p);
    CUresult (*PointerGetAttributes)(unsigned int n, CUpointer_attribute *attrs, void **data,
                                     CUdeviceptr p);
    CUresult (*IpcGetMemHandle)(CUipcMemHandle *h, CUdeviceptr p);
    CUresult (*IpcOpenMemHandle)(CUdeviceptr *p, CUipcMemHandle h, unsigned int flags);
    CUresult (*IpcCloseMemHandle)(CUdeviceptr p);
    CUresult (*ModuleLoadData)(CUmodule *m, const void *image);
    CUresult (*ModuleUnload)(CUmodule m);
    CUresult (*ModuleGetFunction)(CUfunction *f, CUmodule m, const char *name);
    CUresult (*LaunchKernel)(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                             unsigned int bx, unsigned int by, unsigned int bz,
                             unsigned int shmem, CUstream s, void **params, void **extra);
    /* optional (NULL when the driver lacks them): the stream-ordered allocator */
    CUresult (*MemAllocAsync)(CUdeviceptr *p, size_t nbytes, CUstream s);
    CUresult (*MemFreeAsync)(CUdeviceptr p, CUstream s);
} xccl_cu_t;

/* Valid after xccl_cuda_load() returned XCCL_OK. */
extern xccl_cu_t xccl_cu;

/* Opens libcuda.so.1, resolves xccl_cu and calls cuInit, once per process. XCCL_OK, or
 * XCCL_ERR_NOT_SUPPORTED with the reason (no library, cuInit failed: no device/driver) in the
 * thread's last error, every time it is called after failing. */
xccl_status_t xccl_cuda_load(void);
/* The reason xccl_cuda_load failed ("" before a call or when it succeeded). */
const char *xccl_cuda_load_error(void);

/* The process's device (-1 before xccl_cuda_set_device). */
int xccl_cuda_device(void);
/* Makes the chosen device's primary context current in this thread. XCCL_ERR_INVALID_USAGE when
 * no device was chosen; XCCL_ERR_CUDA when the driver fails. */
xccl_status_t xccl_cuda_enter(void);
/* xccl's stream on the chosen device (non-blocking: no implicit order with the legacy default
 * stream). The executor queues every copy and kernel on it; a transport that lets a peer read
 * or write device memory orders itself after the executor by recording an event on it. */
CUstream xccl_cuda_stream(void);

/* Formats a failed driver call as the thread's last error: "<what>: <CUDA_ERROR_NAME>: <text>",
 * and returns XCCL_ERR_CUDA (XCCL_ERR_NO_MEMORY for CUDA_ERROR_OUT_OF_MEMORY). */
xccl_status_t xccl_cuda_fail(CUresult rc, const char *what);
#define XCCL_CU_CHECK(call, what)                                                                 \
    do {                                                                                          \
        CUresult cu_rc_ = (call);                                                                 \
        if (cu_rc_ != CUDA_SUCCESS) return xccl_cuda_fail(cu_rc_, (what));                        \
    } while (0)

/* The allocation holding ptr: its range, its buffer id (never reused in a process) and whether
 * legacy IPC can export it (0: e.g. a cudaMallocAsync pool or a VMM allocation). XCCL_ERR_CUDA
 * (the error set, naming what the driver could not tell) for memory it cannot describe. Both
 * users of IPC handles ask it: the cuda_ipc transport and the executor's peer access. */
xccl_status_t xccl_cuda_alloc_info(const void *ptr, uint64_t *base, uint64_t *size,
                                   uint64_t *buf_id, int *ipc_ok);
/* Closes a mapping cuIpcOpenMemHandle made (a failure is logged: nothing else to do), now or,
 * while a stream waits for a closed gate, later (xccl_cuda_release). */
void xccl_cuda_ipc_close(void *mapped);

/* Implicit synchronisation. Some driver calls may wait until the device has run everything
 * queued before them on every stream of the context: allocating and freeing device or pinned
 * memory, registering host memory, opening and closing IPC mappings. A caller's stream that
 * waits for a closed completion gate (exec.h gate_wait) runs on only once xccl's progress opens
 * the gate, so such a call made by that progress would never return: a deadlock. Hence the
 * rule: every such call is made between xccl_cuda_sync_begin() returning 1 and
 * xccl_cuda_sync_end(), which hold off new gate waits meanwhile (one recursive mutex). When
 * begin returns 0 - some stream waits for a closed gate - the caller goes without the call
 * and never waits for it: it takes a way that needs none (messages instead of a peer's mapped
 * buffer, the buffer mapped later; cuMemAllocAsync; no pinning), or hands a release to
 * xccl_cuda_release, which makes it at
 * once or, deferred, when no stream waits any more (the next guarded call or device operation
 * posted). Every kernel is loaded when the device is chosen, before any operation, so that no
 * lazy loading (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2) happens later. */
int  xccl_cuda_sync_begin(void);
void xccl_cuda_sync_end(void);
typedef enum xccl_cuda_release_kind {
    XCCL_CUDA_FREE_DEVICE,   /* cuMemFree (after xccl's stream has run what it had queued) */
    XCCL_CUDA_FREE_HOST,     /* cuMemFreeHost                                              */
    XCCL_CUDA_UNPIN_FREE,    /* cuMemHostUnregister, then free()                          */
    XCCL_CUDA_IPC_CLOSE,     /* cuIpcCloseMemHandle                                        */
} xccl_cuda_release_kind_t;
void xccl_cuda_release(xccl_cuda_release_kind_t kind, void *p);
/* Makes the deferred releases once no stream waits (a guarded call does it too); called
 * when a device operation is posted, on the caller's thread. */
void xccl_cuda_release_deferred(void);
/* Frees the executor's device memory, from cuMemAlloc or cuMemAllocAsync (allocated while a
 * stream waited), whichever it came from. */
void xccl_cuda_free_any(void *p);

/* Events without timing, recycled: get returns one ready to record (NULL and the error set
 * when the driver fails); put gives it back (it may still be pending: it is only re-recorded). */
CUevent xccl_cuda_event_get(void);
void    xccl_cuda_event_put(CUevent ev);

#endif /* XCCL_CUDA_LIB_H */
