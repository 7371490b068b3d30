/* SPDX-License-Identifier: Apache-2.0
 *
 * cuda_lib.c - the device layer (cuda_lib.h): libcuda.so.1 opened with dlopen and its entry
 * points resolved by the versioned names the headers' macros map to; the process's device, its
 * primary context (retained once, for the life of the process: torch and CuPy share it), xccl's
 * stream, and the event pool. Also the public xccl_cuda_* functions of xccl.h.
 */
#include "cuda/cuda_lib.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/check.h"
#include "core/exec.h"
#include "cuda/cuda_exec.h"

xccl_cu_t xccl_cu;

/* ---------------------------------------------------------------------------------------------
 * Loading
 * ------------------------------------------------------------------------------------------- */

/* Each name is what cuda.h's macros turn the API's name into (cuMemAlloc -> "cuMemAlloc_v2",
 * cuStreamWaitValue32 -> "cuStreamWaitValue32_v2"): the versioned entry point whose signature
 * the header declares, so the pointer's type in xccl_cu_t is the one the driver implements. */
#define CU_SYMS(X)                                                                                 \
    X(Init, cuInit)                                                                                \
    X(DriverGetVersion, cuDriverGetVersion)                                                        \
    X(GetErrorName, cuGetErrorName)                                                                \
    X(GetErrorString, cuGetErrorString)                                                            \
    X(DeviceGet, cuDeviceGet)                                                                      \
    X(DeviceGetCount, cuDeviceGetCount)                                                            \
    X(DeviceGetName, cuDeviceGetName)                                                              \
    X(DeviceGetAttribute, cuDeviceGetAttribute)                                                    \
    X(DevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain)                                            \
    X(DevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease)                                          \
    X(CtxGetCurrent, cuCtxGetCurrent)                                                              \
    X(CtxSetCurrent, cuCtxSetCurrent)                                                              \
    X(StreamCreateWithPriority, cuStreamCreateWithPriority)                                        \
    X(StreamDestroy, cuStreamDestroy)                                                              \
    X(StreamWaitValue32, cuStreamWaitValue32)                                                      \
    X(StreamSynchronize, cuStreamSynchronize)                                                      \
    X(EventCreate, cuEventCreate)                                                                  \
    X(EventDestroy, cuEventDestroy)                                                                \
    X(EventRecord, cuEventRecord)                                                                  \
    X(EventQuery, cuEventQuery)                                                                    \
    X(EventSynchronize, cuEventSynchronize)                                                        \
    X(MemAlloc, cuMemAlloc)                                                                        \
    X(MemFree, cuMemFree)                                                                          \
    X(MemHostAlloc, cuMemHostAlloc)                                                                \
    X(MemFreeHost, cuMemFreeHost)                                                                  \
    X(MemHostGetDevicePointer, cuMemHostGetDevicePointer)                                          \
    X(MemHostRegister, cuMemHostRegister)                                                          \
    X(MemHostUnregister, cuMemHostUnregister)                                                      \
    X(MemcpyAsync, cuMemcpyAsync)                                                                  \
    X(MemGetAddressRange, cuMemGetAddressRange)                                                    \
    X(PointerGetAttribute, cuPointerGetAttribute)                                                  \
    X(PointerGetAttributes, cuPointerGetAttributes)                                                \
    X(IpcGetMemHandle, cuIpcGetMemHandle)                                                          \
    X(IpcOpenMemHandle, cuIpcOpenMemHandle)                                                        \
    X(IpcCloseMemHandle, cuIpcCloseMemHandle)                                                      \
    X(ModuleLoadData, cuModuleLoadData)                                                            \
    X(ModuleUnload, cuModuleUnload)                                                                \
    X(ModuleGetFunction, cuModuleGetFunction)                                                      \
    X(LaunchKernel, cuLaunchKernel)                                                                \
    /* end */
/* resolved when present: a driver without them still loads */
#define CU_SYMS_OPTIONAL(X)                                                                        \
    X(MemAllocAsync, cuMemAllocAsync)                                                              \
    X(MemFreeAsync, cuMemFreeAsync)                                                                \
    /* end */
#define SYM_STR_(x)     #x
#define SYM_STR(x)      SYM_STR_(x)
#define SYM(field, api) {offsetof(xccl_cu_t, field), SYM_STR(api)},
typedef struct cu_sym {
    size_t      off;
    const char *name;
} cu_sym_t;
static const cu_sym_t cu_syms[]          = {CU_SYMS(SYM)};
static const cu_sym_t cu_syms_optional[] = {CU_SYMS_OPTIONAL(SYM)};
/* each pointer in xccl_cu_t has the type of the function the header declares under that name */
#define SYM_TYPE(field, api)                                                                       \
    _Static_assert(__builtin_types_compatible_p(__typeof__(&api), __typeof__(xccl_cu.field)),      \
                   "xccl_cu_t." #field " does not match " SYM_STR(api));
CU_SYMS(SYM_TYPE)
CU_SYMS_OPTIONAL(SYM_TYPE)
#undef SYM_TYPE
#undef SYM

static pthread_once_t load_once   = PTHREAD_ONCE_INIT;
static xccl_status_t  load_status = XCCL_ERR_NOT_SUPPORTED;
static char           load_err[256];
static int            driver_version;
static int            device_count;

/* The library name, overridable for tests ($XCCL_CUDA_LIB: a path or "none"). */
static const char *lib_name(void)
{
    const char *env = getenv("XCCL_CUDA_LIB");

    return env != NULL && *env != '\0' ? env : "libcuda.so.1";
}

static void load_once_fn(void)
{
    const char *name = lib_name();
    void       *lib  = strcmp(name, "none") == 0 ? NULL : dlopen(name, RTLD_NOW | RTLD_LOCAL);
    CUresult    rc;

    if (lib == NULL) {
        const char *e = strcmp(name, "none") == 0 ? "disabled by XCCL_CUDA_LIB=none" : dlerror();
        snprintf(load_err, sizeof load_err, "cannot load the CUDA driver %s: %s", name,
                 e != NULL ? e : "unknown error");
        return;
    }
    for (size_t i = 0; i < sizeof cu_syms / sizeof cu_syms[0]; i++) {
        void *f = dlsym(lib, cu_syms[i].name);

        if (f == NULL) {
            snprintf(load_err, sizeof load_err,
                     "the CUDA driver %s lacks %s (a driver older than the CUDA %d.%d headers "
                     "xccl was built with)",
                     name, cu_syms[i].name, CUDA_VERSION / 1000, CUDA_VERSION % 1000 / 10);
            memset(&xccl_cu, 0, sizeof xccl_cu);
            dlclose(lib);
            return;
        }
        /* POSIX: a data pointer from dlsym converts to a function pointer */
        memcpy((char *)&xccl_cu + cu_syms[i].off, &f, sizeof f);
    }
    for (size_t i = 0; i < sizeof cu_syms_optional / sizeof cu_syms_optional[0]; i++) {
        void *f = dlsym(lib, cu_syms_optional[i].name);

        memcpy((char *)&xccl_cu + cu_syms_optional[i].off, &f, sizeof f);
    }
    rc = xccl_cu.Init(0);
    if (rc != CUDA_SUCCESS) {
        const char *en = NULL, *es = NULL;

        xccl_cu.GetErrorName(rc, &en);
        xccl_cu.GetErrorString(rc, &es);
        snprintf(load_err, sizeof load_err, "cuInit failed: %s: %s (no GPU or driver not usable)",
                 en ? en : "?", es ? es : "?");
        return; /* the library stays open: its static state may hold anything */
    }
    if (xccl_cu.DriverGetVersion(&driver_version) != CUDA_SUCCESS) driver_version = 0;
    if (xccl_cu.DeviceGetCount(&device_count) != CUDA_SUCCESS) device_count = 0;
    if (device_count <= 0) {
        snprintf(load_err, sizeof load_err, "the CUDA driver sees no device");
        return;
    }
    load_status = XCCL_OK;
}

xccl_status_t xccl_cuda_load(void)
{
    pthread_once(&load_once, load_once_fn);
    if (load_status != XCCL_OK) return xccl_error_set(XCCL_ERR_NOT_SUPPORTED, "%s", load_err);
    return XCCL_OK;
}

const char *xccl_cuda_load_error(void)
{
    return load_err;
}

xccl_status_t xccl_cuda_alloc_info(const void *ptr, uint64_t *base, uint64_t *size,
                                   uint64_t *buf_id, int *ipc_ok)
{
    CUdeviceptr        b = 0, p = (CUdeviceptr)(uintptr_t)ptr;
    size_t             sz = 0;
    unsigned long long id = 0;
    int                legacy = 0; /* the driver writes a one-byte bool: read != 0 */

    XCCL_CHECK(xccl_cuda_enter());
    XCCL_CU_CHECK(xccl_cu.MemGetAddressRange(&b, &sz, p), "cuMemGetAddressRange");
    XCCL_CU_CHECK(xccl_cu.PointerGetAttribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, p),
                  "the buffer id (cuPointerGetAttribute)");
    XCCL_CU_CHECK(xccl_cu.PointerGetAttribute(&legacy,
                                              CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p),
                  "the IPC capability (cuPointerGetAttribute)");
    *base   = (uint64_t)b;
    *size   = (uint64_t)sz;
    *buf_id = (uint64_t)id;
    *ipc_ok = legacy != 0;
    return XCCL_OK;
}

void xccl_cuda_ipc_close(void *mapped) { xccl_cuda_release(XCCL_CUDA_IPC_CLOSE, mapped); }

xccl_status_t xccl_cuda_fail(CUresult rc, const char *what)
{
    const char *en = NULL, *es = NULL;

    if (xccl_cu.GetErrorName != NULL) xccl_cu.GetErrorName(rc, &en);
    if (xccl_cu.GetErrorString != NULL) xccl_cu.GetErrorString(rc, &es);
    return XCCL_ERROR(rc == CUDA_ERROR_OUT_OF_MEMORY ? XCCL_ERR_NO_MEMORY : XCCL_ERR_CUDA,
                      "%s: %s: %s", what, en ? en : "CUDA error", es ? es : "?");
}

/* ---------------------------------------------------------------------------------------------
 * The device, its context, xccl's stream
 * ------------------------------------------------------------------------------------------- */

static pthread_mutex_t dev_mu      = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int     dev_ordinal = -1; /* set last, with release, once all below is ready */
static CUdevice        dev;
static CUcontext       dev_ctx;
static CUstream        dev_stream;
static char            dev_name[96];
static int             dev_cc_major, dev_cc_minor;

int xccl_cuda_device(void)
{
    return atomic_load_explicit(&dev_ordinal, memory_order_acquire);
}

xccl_status_t xccl_cuda_enter(void)
{
    CUcontext cur = NULL;

    if (xccl_cuda_device() < 0)
        return XCCL_ERROR(XCCL_ERR_INVALID_USAGE, "cuda: no device chosen (xccl_cuda_set_device)");
    XCCL_CU_CHECK(xccl_cu.CtxGetCurrent(&cur), "cuCtxGetCurrent");
    if (cur != dev_ctx) XCCL_CU_CHECK(xccl_cu.CtxSetCurrent(dev_ctx), "cuCtxSetCurrent");
    return XCCL_OK;
}

CUstream xccl_cuda_stream(void)
{
    return dev_stream;
}

/* Under dev_mu, with the driver loaded: retains the primary context, creates the stream,
 * prepares the executor (module, gates). Undoes everything on failure. */
static xccl_status_t device_open(int ordinal)
{
    CUdevice      d;
    CUcontext     ctx = NULL, prev = NULL;
    CUstream      s = NULL;
    CUresult      rc;
    xccl_status_t st;

    XCCL_CU_CHECK(xccl_cu.DeviceGet(&d, ordinal), "cuDeviceGet");
    XCCL_CU_CHECK(xccl_cu.DevicePrimaryCtxRetain(&ctx, d), "cuDevicePrimaryCtxRetain");
    rc = xccl_cu.CtxGetCurrent(&prev);
    if (rc == CUDA_SUCCESS) rc = xccl_cu.CtxSetCurrent(ctx);
    if (rc != CUDA_SUCCESS) {
        st = xccl_cuda_fail(rc, "cuCtxSetCurrent");
        goto fail;
    }
    rc = xccl_cu.DeviceGetAttribute(&dev_cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, d);
    if (rc == CUDA_SUCCESS)
        rc = xccl_cu.DeviceGetAttribute(&dev_cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                        d);
    if (rc == CUDA_SUCCESS) rc = xccl_cu.DeviceGetName(dev_name, (int)sizeof dev_name, d);
    if (rc != CUDA_SUCCESS) {
        st = xccl_cuda_fail(rc, "cuDeviceGetAttribute");
        goto fail;
    }
    dev_name[sizeof dev_name - 1] = '\0';
    /* lower numbers are higher priorities, and the driver clamps a priority to the device's
     * range: -1000 asks for the greatest one without cuCtxGetStreamPriorityRange */
    rc = xccl_cu.StreamCreateWithPriority(&s, CU_STREAM_NON_BLOCKING, -1000);
    if (rc != CUDA_SUCCESS) {
        st = xccl_cuda_fail(rc, "cuStreamCreateWithPriority");
        goto fail;
    }
    dev        = d;
    dev_ctx    = ctx;
    dev_stream = s;
    st         = xccl_cuda_exec_init(d);
    if (st != XCCL_OK) {
        xccl_cuda_exec_fini();
        goto fail;
    }
    if (prev != NULL && prev != ctx) (void)xccl_cu.CtxSetCurrent(prev);
    return XCCL_OK;

fail:
    if (s != NULL) (void)xccl_cu.StreamDestroy(s);
    dev_stream = NULL;
    dev_ctx    = NULL;
    if (prev != ctx) (void)xccl_cu.CtxSetCurrent(prev);
    (void)xccl_cu.DevicePrimaryCtxRelease(d);
    return st;
}

xccl_status_t xccl_cuda_set_device(int device)
{
    xccl_status_t st;
    int           cur;

    XCCL_CHECK(xccl_cuda_load());
    if (device < 0 || device >= device_count)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "cuda: no device %d (this process sees %d)", device,
                          device_count);
    pthread_mutex_lock(&dev_mu);
    cur = xccl_cuda_device();
    if (cur == device) {
        st = XCCL_OK;
    } else if (cur >= 0) {
        st = XCCL_ERROR(XCCL_ERR_INVALID_USAGE,
                        "cuda: this process uses device %d; it cannot switch to device %d "
                        "(one GPU per process)",
                        cur, device);
    } else {
        /* the ordinal is published (release) only once the context, the stream and the
         * executor's state are ready: a thread that reads it set (acquire) sees them */
        st = device_open(device);
        if (st == XCCL_OK) {
            atomic_store_explicit(&dev_ordinal, device, memory_order_release);
            st = xccl_exec_register(&xccl_exec_cuda);
            if (st != XCCL_OK)
                XCCL_WARN("cuda: device %d chosen but its executor could not be installed: %s",
                          device, xccl_last_error());
        }
    }
    pthread_mutex_unlock(&dev_mu);
    return st;
}

/* ---------------------------------------------------------------------------------------------
 * Event pool
 * ------------------------------------------------------------------------------------------- */

static pthread_mutex_t ev_mu = PTHREAD_MUTEX_INITIALIZER;
static CUevent        *ev_free;
static size_t          ev_nfree, ev_cap;

CUevent xccl_cuda_event_get(void)
{
    CUevent  ev = NULL;
    CUresult rc;

    pthread_mutex_lock(&ev_mu);
    if (ev_nfree > 0) ev = ev_free[--ev_nfree];
    pthread_mutex_unlock(&ev_mu);
    if (ev != NULL) return ev;
    rc = xccl_cu.EventCreate(&ev, CU_EVENT_DISABLE_TIMING);
    if (rc != CUDA_SUCCESS) {
        xccl_cuda_fail(rc, "cuEventCreate");
        return NULL;
    }
    return ev;
}

void xccl_cuda_event_put(CUevent ev)
{
    if (ev == NULL) return;
    pthread_mutex_lock(&ev_mu);
    if (ev_nfree == ev_cap) {
        size_t   cap = ev_cap ? 2 * ev_cap : 64;
        CUevent *n   = realloc(ev_free, cap * sizeof *n);

        if (n == NULL) { /* keep going without the pool: destroy it */
            pthread_mutex_unlock(&ev_mu);
            (void)xccl_cu.EventDestroy(ev);
            return;
        }
        ev_free = n;
        ev_cap  = cap;
    }
    ev_free[ev_nfree++] = ev;
    pthread_mutex_unlock(&ev_mu);
}

/* ---------------------------------------------------------------------------------------------
 * Public API
 * ------------------------------------------------------------------------------------------- */

void xccl_cuda_info(xccl_cuda_info_t *out)
{
    int d;

    if (out == NULL) return;
    memset(out, 0, sizeof *out);
    out->built          = 1;
    out->header_version = CUDA_VERSION;
    out->device         = -1;
    snprintf(out->archs, sizeof out->archs, "%s", xccl_cuda_kernel_archs());
    if (xccl_cuda_load() != XCCL_OK) {
        snprintf(out->why, sizeof out->why, "%s", load_err);
        return;
    }
    out->loaded         = 1;
    out->ndevices       = device_count;
    out->driver_version = driver_version;
    d                   = xccl_cuda_device();
    out->device         = d;
    if (d >= 0) {
        snprintf(out->device_name, sizeof out->device_name, "%s", dev_name);
        out->cc_major = dev_cc_major;
        out->cc_minor = dev_cc_minor;
    }
    snprintf(out->why, sizeof out->why, "%s", xccl_cuda_kernel_why());
}

static const char *mem_type_name(unsigned int t)
{
    switch (t) {
    case CU_MEMORYTYPE_HOST:
        return "host memory";
    case CU_MEMORYTYPE_DEVICE:
        return "device memory";
    case CU_MEMORYTYPE_ARRAY:
        return "a CUDA array";
    case CU_MEMORYTYPE_UNIFIED:
        return "unified memory";
    default:
        return "memory unknown to CUDA";
    }
}

xccl_status_t xccl_cuda_check_ptr(const void *ptr, size_t nbytes)
{
    CUpointer_attribute attrs[5] = {
        CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_IS_MANAGED,
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        CU_POINTER_ATTRIBUTE_RANGE_SIZE};
    unsigned int mtype = 0, managed = 0;
    int          ordinal = -1;
    CUdeviceptr  start   = 0;
    size_t       size    = 0;
    void        *data[5] = {&mtype, &managed, &ordinal, &start, &size};
    CUdeviceptr  p       = (CUdeviceptr)(uintptr_t)ptr;
    int          d       = xccl_cuda_device();
    CUresult     rc;

    if (d < 0)
        return XCCL_ERROR(XCCL_ERR_INVALID_USAGE,
                          "cuda: no device chosen (xccl_cuda_set_device) before checking a "
                          "device pointer");
    if (ptr == NULL) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "cuda: NULL device pointer");
    XCCL_CHECK(xccl_cuda_enter());
    rc = xccl_cu.PointerGetAttributes(5, attrs, data, p);
    if (rc == CUDA_ERROR_INVALID_VALUE || (rc == CUDA_SUCCESS && mtype == 0))
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                          "cuda: %p is not memory CUDA knows (host memory that is not "
                          "registered, or freed)",
                          ptr);
    if (rc != CUDA_SUCCESS) return xccl_cuda_fail(rc, "cuPointerGetAttributes");
    if (managed)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                          "cuda: %p is managed (unified) memory; xccl needs device memory "
                          "(cuMemAlloc, torch/CuPy allocations)",
                          ptr);
    if (mtype != CU_MEMORYTYPE_DEVICE)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "cuda: %p is %s, not device memory", ptr,
                          mem_type_name(mtype));
    if (ordinal != d)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                          "cuda: %p is memory of device %d; this process uses device %d", ptr,
                          ordinal, d);
    if (p < start || p - start > size || nbytes > size - (size_t)(p - start))
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                          "cuda: [%p, +%zu) is not inside one allocation (the allocation at "
                          "%p holds %zu bytes)",
                          ptr, nbytes, (void *)(uintptr_t)start, size);
    return XCCL_OK;
}
