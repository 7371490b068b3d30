/* SPDX-License-Identifier: Apache-2.0
 *
 * cuda_exec.c - the CUDA executor (core/exec.h): copies with cuMemcpyAsync and reductions with
 * the kernels of kernels.cu, all queued on xccl's stream, each followed by an event the core
 * tests; scratch memory with cuMemAlloc (cuMemAllocAsync while a stream waits for a gate:
 * cuda_lib.h, "Implicit synchronisation"); stream ordering (order_after) with events; completion
 * gates in pinned, device-mapped host memory (gate.h) waited for with cuStreamWaitValue32.
 *
 * The kernels' fatbin is embedded by the build (csrc/cuda/build_fatbin.py: xccl_cuda_fatbin);
 * the references to it are weak, so a build without nvcc (and the C tests) links without it and
 * reports reductions as not supported. The module is loaded when the device is chosen.
 *
 * Gates when the device cannot wait on a value (stream memory operations unsupported): gate_wait
 * of a gate still closed fails with XCCL_ERR_NOT_SUPPORTED and says so; one already open needs
 * no wait. Nothing ever spins on the device beyond cuStreamWaitValue32.
 */
#include "cuda/cuda_exec.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/check.h"
#include "core/u64map.h"
#include "cuda/gate.h"

/* ---------------------------------------------------------------------------------------------
 * The embedded kernels (weak: absent when the build had no nvcc)
 * ------------------------------------------------------------------------------------------- */

extern const unsigned char xccl_cuda_fatbin[] __attribute__((weak));
extern const size_t        xccl_cuda_fatbin_size __attribute__((weak));
extern const char          xccl_cuda_archs[] __attribute__((weak));

#ifndef XCCL_CUDA_WHY
#define XCCL_CUDA_WHY "built without the GPU kernels (nvcc not found)"
#endif

static int have_kernels(void)
{
    return xccl_cuda_fatbin != NULL && &xccl_cuda_fatbin_size != NULL && xccl_cuda_fatbin_size > 0;
}

const char *xccl_cuda_kernel_archs(void)
{
    return have_kernels() && xccl_cuda_archs != NULL ? xccl_cuda_archs : "";
}

const char *xccl_cuda_kernel_why(void)
{
    return have_kernels() ? "" : XCCL_CUDA_WHY;
}

/* ---------------------------------------------------------------------------------------------
 * State (set once by xccl_cuda_exec_init, before the executor is registered)
 * ------------------------------------------------------------------------------------------- */

#define THREADS    256
#define GATE_WORDS 4096u
#define NOPS       7 /* base operators */

enum { K_REDUCE2, K_REDUCE_N, K_SCALE, K_DIVIDE, K_KINDS };

static CUmodule     module;
static unsigned int max_blocks = 1;
static xccl_gates_t gates;
static uint32_t    *gate_host;
static CUdeviceptr  gate_dev;
static int          gates_ready;

/* kernel cache: [kind][dtype][op] (scale/divide: op 0) */
static pthread_mutex_t fn_mu = PTHREAD_MUTEX_INITIALIZER;
static CUfunction      fn_cache[K_KINDS][XCCL_DTYPE_COUNT][NOPS];
static void            preload_kernels(void);

/* scratch for overlapping copies (memmove through it); grown under scratch_mu */
static pthread_mutex_t scratch_mu = PTHREAD_MUTEX_INITIALIZER;
static CUdeviceptr     scratch;
static size_t          scratch_len;

xccl_status_t xccl_cuda_exec_init(CUdevice dev)
{
    int      sms = 0;
    CUresult rc;
    void    *host = NULL;

    rc = xccl_cu.DeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
    if (rc != CUDA_SUCCESS) return xccl_cuda_fail(rc, "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)");
    max_blocks = sms > 0 ? 4u * (unsigned)sms : 64u;
    if (have_kernels() && module == NULL) {
        rc = xccl_cu.ModuleLoadData(&module, xccl_cuda_fatbin);
        if (rc != CUDA_SUCCESS) {
            const char *en = NULL;

            module = NULL;
            (void)xccl_cu.GetErrorName(rc, &en);
            return XCCL_ERROR(XCCL_ERR_CUDA,
                              "cuda: cannot load xccl's GPU kernels (compiled for %s) on this "
                              "device: cuModuleLoadData: %s (a driver older than the CUDA "
                              "compiler, or a GPU older than sm_75?)",
                              xccl_cuda_kernel_archs(), en != NULL ? en : "?");
        }
        preload_kernels();
    }
    if (!gates_ready) {
        CUdeviceptr   d = 0;
        xccl_status_t st;

        rc = xccl_cu.MemHostAlloc(&host, GATE_WORDS * sizeof(uint32_t),
                                  CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE);
        if (rc != CUDA_SUCCESS) return xccl_cuda_fail(rc, "cuMemHostAlloc (completion gates)");
        rc = xccl_cu.MemHostGetDevicePointer(&d, host, 0);
        if (rc != CUDA_SUCCESS) {
            (void)xccl_cu.MemFreeHost(host);
            return xccl_cuda_fail(rc, "cuMemHostGetDevicePointer (completion gates)");
        }
        st = xccl_gates_init(&gates, host, GATE_WORDS);
        if (st != XCCL_OK) {
            (void)xccl_cu.MemFreeHost(host);
            return st;
        }
        gate_host   = host;
        gate_dev    = d;
        gates_ready = 1;
    }
    return XCCL_OK;
}

void xccl_cuda_exec_fini(void)
{
    if (gates_ready) {
        xccl_gates_fini(&gates);
        (void)xccl_cu.MemFreeHost(gate_host);
        gate_host   = NULL;
        gate_dev    = 0;
        gates_ready = 0;
    }
    if (module != NULL) (void)xccl_cu.ModuleUnload(module);
    module = NULL;
    memset(fn_cache, 0, sizeof fn_cache);
}

/* ---------------------------------------------------------------------------------------------
 * Kernels: names, lookup, launch
 * ------------------------------------------------------------------------------------------- */

static const char *const dt_names[XCCL_DTYPE_COUNT] = {
    [XCCL_BOOL] = "bool",   [XCCL_UINT8] = "u8",      [XCCL_INT8] = "i8",
    [XCCL_INT16] = "i16",   [XCCL_INT32] = "i32",     [XCCL_INT64] = "i64",
    [XCCL_FLOAT16] = "f16", [XCCL_BFLOAT16] = "bf16", [XCCL_FLOAT32] = "f32",
    [XCCL_FLOAT64] = "f64", [XCCL_COMPLEX64] = "c64", [XCCL_COMPLEX128] = "c128",
};
static const char *const op_names[NOPS]      = {"sum", "prod", "min", "max", "and", "or", "xor"};
static const char *const kind_names[K_KINDS] = {"reduce2", "reduce_n", "scale", "divide"};

static int is_int(xccl_dtype_t dt)
{
    return dt == XCCL_UINT8 || dt == XCCL_INT8 || dt == XCCL_INT16 || dt == XCCL_INT32 ||
           dt == XCCL_INT64;
}

/* The alignment every element pointer needs (a misaligned access kills the CUDA context). */
static size_t elem_align(xccl_dtype_t dt)
{
    size_t s = xccl_dtype_size(dt);

    return dt == XCCL_COMPLEX64 || dt == XCCL_COMPLEX128 ? s / 2 : s;
}

/* Rewrites (dtype, op, count) to the kernel that computes it, as reduce.c's canonical(). */
static void canonical(xccl_dtype_t *dt, xccl_op_t *op, size_t *count)
{
    if (*op == XCCL_OP_SUM && (*dt == XCCL_COMPLEX64 || *dt == XCCL_COMPLEX128)) {
        *dt = *dt == XCCL_COMPLEX64 ? XCCL_FLOAT32 : XCCL_FLOAT64;
        *count *= 2;
    } else if ((*op == XCCL_OP_BAND || *op == XCCL_OP_BOR || *op == XCCL_OP_BXOR) && is_int(*dt)) {
        *count *= xccl_dtype_size(*dt);
        *dt = XCCL_UINT8;
    } else if (*dt == XCCL_BOOL) {
        switch (*op) {
        case XCCL_OP_SUM:
        case XCCL_OP_MAX:
        case XCCL_OP_BOR:
            *op = XCCL_OP_BOR;
            break;
        case XCCL_OP_PROD:
        case XCCL_OP_MIN:
        case XCCL_OP_BAND:
            *op = XCCL_OP_BAND;
            break;
        default:
            *op = XCCL_OP_BXOR;
            break;
        }
    }
}

/* The kernel for (kind, dtype, op) after canonical(): XCCL_OK and *out, or the error. */
static void kernel_name(char *name, size_t len, int kind, xccl_dtype_t dt, int o)
{
    if (kind == K_SCALE || kind == K_DIVIDE)
        snprintf(name, len, "xccl_%s_%s", kind_names[kind], dt_names[dt]);
    else
        snprintf(name, len, "xccl_%s_%s_%s", kind_names[kind], dt_names[dt], op_names[o]);
}

/* Looks every kernel up now, when the device is chosen: under lazy loading (the default since
 * CUDA 12.2) cuModuleGetFunction loads the kernel, and loading may synchronise the device, so
 * it must not happen in the progress path later (cuda_lib.h). Names the fatbin lacks (an
 * operator a type has no kernel for) are skipped: kernel() reports them when asked. */
static void preload_kernels(void)
{
    char       name[64];
    CUfunction f;

    for (int kind = 0; kind < K_KINDS; kind++)
        for (int dt = 0; dt < XCCL_DTYPE_COUNT; dt++)
            for (int o = 0; o < (kind == K_SCALE || kind == K_DIVIDE ? 1 : NOPS); o++) {
                kernel_name(name, sizeof name, kind, (xccl_dtype_t)dt, o);
                if (xccl_cu.ModuleGetFunction(&f, module, name) == CUDA_SUCCESS)
                    fn_cache[kind][dt][o] = f;
            }
}

static xccl_status_t kernel(int kind, xccl_dtype_t dt, xccl_op_t op, CUfunction *out)
{
    int        o = kind == K_SCALE || kind == K_DIVIDE ? 0 : (int)op;
    CUfunction f;
    char       name[64];
    CUresult   rc = CUDA_SUCCESS;

    if (module == NULL)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED, "cuda: no GPU kernels in this build (%s)",
                          xccl_cuda_kernel_why());
    pthread_mutex_lock(&fn_mu);
    f = fn_cache[kind][dt][o];
    if (f == NULL) {
        kernel_name(name, sizeof name, kind, dt, o);
        rc = xccl_cu.ModuleGetFunction(&f, module, name);
        if (rc == CUDA_SUCCESS) fn_cache[kind][dt][o] = f;
    }
    pthread_mutex_unlock(&fn_mu);
    if (rc != CUDA_SUCCESS) return xccl_cuda_fail(rc, "cuModuleGetFunction(xccl kernel)");
    *out = f;
    return XCCL_OK;
}

/* Blocks for `count` elements of `esize` bytes: one thread per 16 bytes, capped (grid-stride). */
static unsigned int blocks_for(size_t count, size_t esize)
{
    size_t per   = esize >= 16 ? 1 : 16 / esize;
    size_t units = (count + per - 1) / per;
    size_t b     = (units + THREADS - 1) / THREADS;

    if (b < 1) b = 1;
    return b > max_blocks ? max_blocks : (unsigned int)b;
}

static xccl_status_t launch(CUfunction f, size_t count, size_t esize, void **args, CUstream s,
                            const char *what)
{
    CUresult rc =
        xccl_cu.LaunchKernel(f, blocks_for(count, esize), 1, 1, THREADS, 1, 1, 0, s, args, NULL);

    return rc == CUDA_SUCCESS ? XCCL_OK : xccl_cuda_fail(rc, what);
}

/* The stream of executor queue q (exec.h): a communicator's, or xccl's own for NULL. */
static CUstream q_stream(void *q)
{
    return q != NULL ? (CUstream)q : xccl_cuda_stream();
}

/* Records an event after the work just queued on queue q: XCCL_INPROGRESS with *ev. When that
 * fails the work is still queued: wait for it, so the caller may free its buffers. */
static xccl_status_t finish(void *q, void **ev)
{
    CUstream s = q_stream(q);
    CUevent  e = xccl_cuda_event_get();
    CUresult rc;

    if (e == NULL) {
        (void)xccl_cu.StreamSynchronize(s);
        return XCCL_ERR_CUDA; /* the error was set by event_get */
    }
    rc = xccl_cu.EventRecord(e, s);
    if (rc != CUDA_SUCCESS) {
        xccl_status_t st = xccl_cuda_fail(rc, "cuEventRecord");

        xccl_cuda_event_put(e);
        (void)xccl_cu.StreamSynchronize(s);
        return st;
    }
    *ev = e;
    return XCCL_INPROGRESS;
}

static xccl_status_t check_ptrs(const char *what, const void *const *p, int n, xccl_dtype_t dt)
{
    size_t al = elem_align(dt);

    for (int i = 0; i < n; i++) {
        if (p[i] == NULL) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "cuda %s: NULL buffer", what);
        if ((uintptr_t)p[i] % al != 0)
            return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                              "cuda %s: buffer %p is not aligned to its %s elements (%zu bytes)",
                              what, p[i], xccl_dtype_name(dt), al);
    }
    return XCCL_OK;
}

static xccl_status_t check_base(const char *what, xccl_dtype_t dt, xccl_op_t op)
{
    XCCL_CHECK(xccl_op_check(op, dt));
    if ((int)op >= NOPS)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "cuda %s: op %s is not a base operator", what,
                          xccl_op_name(op));
    return XCCL_OK;
}

/* ---------------------------------------------------------------------------------------------
 * The executor
 * ------------------------------------------------------------------------------------------- */

static void *cu_alloc(size_t nbytes);

/* memmove of overlapping ranges through the scratch buffer (rare: in-place shifts) */
static xccl_status_t copy_overlap(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st)
{
    CUresult rc;

    pthread_mutex_lock(&scratch_mu);
    if (scratch_len < n) {
        void *p = cu_alloc(n);

        if (p == NULL) { /* the reason is the thread's last error */
            pthread_mutex_unlock(&scratch_mu);
            return XCCL_ERR_NO_MEMORY;
        }
        /* the old buffer may still be read by queued copies: freed after them */
        xccl_cuda_free_any((void *)(uintptr_t)scratch);
        scratch     = (CUdeviceptr)(uintptr_t)p;
        scratch_len = n;
    }
    rc = xccl_cu.MemcpyAsync(scratch, s, n, st);
    if (rc == CUDA_SUCCESS) rc = xccl_cu.MemcpyAsync(d, scratch, n, st);
    /* the scratch serves every queue: done with it before another queue's copy may use it
     * (a stream of xccl's never waits for a caller's, so this returns) */
    if (rc == CUDA_SUCCESS) rc = xccl_cu.StreamSynchronize(st);
    pthread_mutex_unlock(&scratch_mu);
    return rc == CUDA_SUCCESS ? XCCL_OK : xccl_cuda_fail(rc, "cuMemcpyAsync");
}

static xccl_status_t cu_copy(void *q, void *dst, const void *src, size_t nbytes, void **ev)
{
    CUdeviceptr d = (CUdeviceptr)(uintptr_t)dst, s = (CUdeviceptr)(uintptr_t)src;
    CUresult    rc;

    *ev = NULL;
    if (nbytes == 0 || dst == src) return XCCL_OK;
    if (dst == NULL || src == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "cuda copy: NULL buffer for %zu bytes", nbytes);
    XCCL_CHECK(xccl_cuda_enter());
    if (d < s + nbytes && s < d + nbytes) {
        XCCL_CHECK(copy_overlap(d, s, nbytes, q_stream(q)));
    } else {
        rc = xccl_cu.MemcpyAsync(d, s, nbytes, q_stream(q));
        if (rc != CUDA_SUCCESS) return xccl_cuda_fail(rc, "cuMemcpyAsync");
    }
    return finish(q, ev);
}

static xccl_status_t cu_reduce(void *q, void *dst, const void *a, const void *b, size_t count,
                               xccl_dtype_t dtype, xccl_op_t op, void **ev)
{
    const void *ptrs[3] = {dst, a, b};
    CUfunction  f;
    size_t      n = count;

    *ev = NULL;
    XCCL_CHECK(check_base("reduce", dtype, op));
    if (count == 0) return XCCL_OK;
    XCCL_CHECK(check_ptrs("reduce", ptrs, 3, dtype));
    XCCL_CHECK(xccl_cuda_enter());
    canonical(&dtype, &op, &n);
    XCCL_CHECK(kernel(K_REDUCE2, dtype, op, &f));
    {
        void *args[] = {&dst, &a, &b, &n};
        XCCL_CHECK(launch(f, n, xccl_dtype_size(dtype), args, q_stream(q),
                          "cuLaunchKernel(reduce)"));
    }
    return finish(q, ev);
}

/* scale (divide 0) or divide (1); complex maps to its float component type */
static xccl_status_t cu_map(int kind, void *q, void *dst, const void *src, size_t count,
                            xccl_dtype_t dtype, double factor, int dn, void **ev)
{
    const char *what    = kind == K_SCALE ? "scale" : "divide";
    const void *ptrs[2] = {dst, src};
    CUfunction  f;
    size_t      n = count;

    *ev = NULL;
    if ((unsigned)dtype >= XCCL_DTYPE_COUNT)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "cuda %s: invalid dtype %d", what, (int)dtype);
    if (dtype == XCCL_BOOL)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED, "cuda %s: not defined for dtype bool", what);
    if (kind == K_DIVIDE && dn <= 0)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "cuda divide: divisor %d (need > 0)", dn);
    if (count == 0) return XCCL_OK;
    XCCL_CHECK(check_ptrs(what, ptrs, 2, dtype));
    XCCL_CHECK(xccl_cuda_enter());
    if (dtype == XCCL_COMPLEX64 || dtype == XCCL_COMPLEX128) {
        dtype = dtype == XCCL_COMPLEX64 ? XCCL_FLOAT32 : XCCL_FLOAT64;
        n *= 2;
    }
    XCCL_CHECK(kernel(kind, dtype, XCCL_OP_SUM, &f));
    if (kind == K_SCALE) {
        void *args[] = {&dst, &src, &n, &factor};
        XCCL_CHECK(launch(f, n, xccl_dtype_size(dtype), args, q_stream(q),
                          "cuLaunchKernel(scale)"));
    } else {
        void *args[] = {&dst, &src, &n, &dn};
        XCCL_CHECK(launch(f, n, xccl_dtype_size(dtype), args, q_stream(q),
                          "cuLaunchKernel(divide)"));
    }
    return finish(q, ev);
}

static xccl_status_t cu_scale(void *q, void *dst, const void *src, size_t count,
                              xccl_dtype_t dtype, double factor, void **ev)
{
    return cu_map(K_SCALE, q, dst, src, count, dtype, factor, 1, ev);
}

static xccl_status_t cu_divide(void *q, void *dst, const void *src, size_t count,
                               xccl_dtype_t dtype, int n, void **ev)
{
    return cu_map(K_DIVIDE, q, dst, src, count, dtype, 0.0, n, ev);
}

static xccl_status_t cu_test(void *ev)
{
    CUresult rc;

    if (ev == NULL) return XCCL_OK;
    XCCL_CHECK(xccl_cuda_enter());
    rc = xccl_cu.EventQuery((CUevent)ev);
    if (rc == CUDA_ERROR_NOT_READY) return XCCL_INPROGRESS;
    xccl_cuda_event_put((CUevent)ev);
    return rc == CUDA_SUCCESS ? XCCL_OK : xccl_cuda_fail(rc, "cuda: a queued operation failed");
}

/* ---------------------------------------------------------------------------------------------
 * Implicit synchronisation (cuda_lib.h): the guard, deferred releases, allocation without it
 * ------------------------------------------------------------------------------------------- */

/* recursive, so that a guarded section may release (xccl_cuda_release takes it again) */
static pthread_mutex_t sync_mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;

typedef struct release {
    struct release          *next;
    xccl_cuda_release_kind_t kind;
    void                    *p;
} release_t;
static release_t  *releases;  /* deferred, under sync_mu */
static _Atomic int nreleases; /* a hint: releases is not empty */

/* The communicators' queues (exec.h queue_new): streams of their own, kept here so that a free
 * can wait for every queue that may still use the memory. Under queues_mu. */
static pthread_mutex_t queues_mu = PTHREAD_MUTEX_INITIALIZER;
static CUstream       *queues;
static size_t          nqueues, queues_cap;

/* Waits until xccl's own stream and every queue have run what they hold (none of them ever
 * waits for a caller's stream, so this returns). */
static CUresult sync_queues(void)
{
    CUresult rc = xccl_cu.StreamSynchronize(xccl_cuda_stream());

    pthread_mutex_lock(&queues_mu);
    for (size_t i = 0; i < nqueues && rc == CUDA_SUCCESS; i++)
        rc = xccl_cu.StreamSynchronize(queues[i]);
    pthread_mutex_unlock(&queues_mu);
    return rc;
}

static xccl_status_t cu_queue_new(void **q)
{
    CUstream s = NULL;
    CUresult rc;

    *q = NULL;
    XCCL_CHECK(xccl_cuda_enter());
    pthread_mutex_lock(&queues_mu);
    if (nqueues == queues_cap) {
        size_t    cap = queues_cap ? 2 * queues_cap : 8;
        CUstream *a   = realloc(queues, cap * sizeof *a);

        if (a == NULL) {
            pthread_mutex_unlock(&queues_mu);
            return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "cuda: out of host memory");
        }
        queues     = a;
        queues_cap = cap;
    }
    /* like xccl's own: no implicit order with the legacy default stream, highest priority */
    rc = xccl_cu.StreamCreateWithPriority(&s, CU_STREAM_NON_BLOCKING, -1000);
    if (rc == CUDA_SUCCESS) queues[nqueues++] = s;
    pthread_mutex_unlock(&queues_mu);
    if (rc != CUDA_SUCCESS) return xccl_cuda_fail(rc, "cuStreamCreateWithPriority (a queue)");
    *q = s;
    return XCCL_OK;
}

/* Once nothing is queued on it any more (its communicator is gone); the driver releases the
 * stream when what it holds has run. */
static void cu_queue_free(void *q)
{
    CUresult rc;

    if (q == NULL || xccl_cuda_enter() != XCCL_OK) return;
    pthread_mutex_lock(&queues_mu);
    for (size_t i = 0; i < nqueues; i++) {
        if (queues[i] == (CUstream)q) {
            queues[i] = queues[--nqueues];
            break;
        }
    }
    pthread_mutex_unlock(&queues_mu);
    rc = xccl_cu.StreamDestroy((CUstream)q);
    if (rc != CUDA_SUCCESS) {
        (void)xccl_cuda_fail(rc, "cuStreamDestroy (a queue)");
        XCCL_WARN("%s", xccl_last_error());
    }
}

/* memory from cuMemAllocAsync (freed with cuMemFreeAsync): address -> itself, under async_mu */
static pthread_mutex_t async_mu = PTHREAD_MUTEX_INITIALIZER;
static xccl_u64map_t   async_set;

static void release_now(xccl_cuda_release_kind_t kind, void *p)
{
    CUresult    rc = CUDA_SUCCESS;
    const char *what;

    switch (kind) {
    case XCCL_CUDA_FREE_DEVICE:
        /* a copy still queued may use it (an operation that failed or timed out before its
         * transfers into scratch finished): xccl's streams first. They always drain - they
         * never wait for a caller's stream */
        what = "cuStreamSynchronize (before cuMemFree)";
        rc   = sync_queues();
        if (rc == CUDA_SUCCESS) {
            what = "cuMemFree";
            rc   = xccl_cu.MemFree((CUdeviceptr)(uintptr_t)p);
        }
        break;
    case XCCL_CUDA_FREE_HOST:
        what = "cuMemFreeHost";
        rc   = xccl_cu.MemFreeHost(p);
        break;
    case XCCL_CUDA_UNPIN_FREE:
        what = "cuMemHostUnregister";
        rc   = xccl_cu.MemHostUnregister(p);
        if (rc == CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED) rc = CUDA_SUCCESS;
        free(p);
        break;
    default:
        what = "cuIpcCloseMemHandle";
        rc   = xccl_cu.IpcCloseMemHandle((CUdeviceptr)(uintptr_t)p);
        break;
    }
    if (rc != CUDA_SUCCESS) {
        (void)xccl_cuda_fail(rc, what);
        XCCL_WARN("%s", xccl_last_error());
    }
}

/* The deferred releases, once no stream waits. sync_mu held, nothing waited for. */
static void flush_releases(void)
{
    while (releases != NULL) {
        release_t *r = releases;

        releases = r->next;
        release_now(r->kind, r->p);
        free(r);
    }
    atomic_store_explicit(&nreleases, 0, memory_order_relaxed);
}

int xccl_cuda_sync_begin(void)
{
    pthread_mutex_lock(&sync_mu);
    if (gates_ready && xccl_gates_nwaited(&gates) > 0) {
        pthread_mutex_unlock(&sync_mu);
        return 0;
    }
    if (releases != NULL && xccl_cuda_enter() == XCCL_OK) flush_releases();
    return 1;
}

void xccl_cuda_sync_end(void) { pthread_mutex_unlock(&sync_mu); }

void xccl_cuda_release(xccl_cuda_release_kind_t kind, void *p)
{
    release_t *r;

    if (p == NULL || xccl_cuda_enter() != XCCL_OK) return;
    /* one critical section: a gate that opens meanwhile finds the release queued */
    pthread_mutex_lock(&sync_mu);
    if (xccl_cuda_sync_begin()) {
        release_now(kind, p);
        xccl_cuda_sync_end();
        pthread_mutex_unlock(&sync_mu);
        return;
    }
    r = malloc(sizeof *r);
    if (r == NULL) { /* leaked rather than released under a waiting stream: a hang */
        pthread_mutex_unlock(&sync_mu);
        XCCL_WARN("cuda: out of memory deferring a release; %p is leaked", p);
        return;
    }
    r->kind  = kind;
    r->p     = p;
    r->next  = releases;
    releases = r;
    atomic_store_explicit(&nreleases, 1, memory_order_relaxed);
    pthread_mutex_unlock(&sync_mu);
}

void xccl_cuda_release_deferred(void)
{
    if (atomic_load_explicit(&nreleases, memory_order_relaxed) == 0) return;
    if (xccl_cuda_sync_begin()) xccl_cuda_sync_end(); /* flushes */
}

static void *alloc_async(size_t nbytes)
{
    CUdeviceptr p = 0;
    CUresult    rc;

    if (xccl_cu.MemAllocAsync == NULL || xccl_cu.MemFreeAsync == NULL) {
        (void)XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                         "cuda: cannot allocate device memory now: a stream waits for an xccl "
                         "operation, and this driver has no stream-ordered allocator "
                         "(cuMemAllocAsync) to allocate without waiting for that stream");
        return NULL;
    }
    pthread_mutex_lock(&async_mu);
    rc = xccl_cu.MemAllocAsync(&p, nbytes ? nbytes : 1, xccl_cuda_stream());
    /* usable on a queue's stream once xccl's own has run the allocation */
    if (rc == CUDA_SUCCESS) rc = xccl_cu.StreamSynchronize(xccl_cuda_stream());
    if (rc == CUDA_SUCCESS && xccl_u64map_put(&async_set, (uint64_t)p, (void *)(uintptr_t)p)) {
        (void)xccl_cu.MemFreeAsync(p, xccl_cuda_stream());
        pthread_mutex_unlock(&async_mu);
        (void)XCCL_ERROR(XCCL_ERR_NO_MEMORY, "cuda: out of host memory");
        return NULL;
    }
    pthread_mutex_unlock(&async_mu);
    if (rc != CUDA_SUCCESS) {
        (void)xccl_cuda_fail(rc, "cuMemAllocAsync");
        return NULL;
    }
    return (void *)(uintptr_t)p;
}

void xccl_cuda_free_any(void *p)
{
    int async = 0;

    if (p == NULL || xccl_cuda_enter() != XCCL_OK) return;
    pthread_mutex_lock(&async_mu);
    async = xccl_u64map_del(&async_set, (uint64_t)(uintptr_t)p) != NULL;
    pthread_mutex_unlock(&async_mu);
    if (async) {
        /* after everything queued on the queues that may use it */
        CUresult rc = sync_queues();

        if (rc == CUDA_SUCCESS)
            rc = xccl_cu.MemFreeAsync((CUdeviceptr)(uintptr_t)p, xccl_cuda_stream());
        if (rc != CUDA_SUCCESS) {
            (void)xccl_cuda_fail(rc, "cuMemFreeAsync");
            XCCL_WARN("%s", xccl_last_error());
        }
        return;
    }
    xccl_cuda_release(XCCL_CUDA_FREE_DEVICE, p);
}

/* cuMemAlloc (legacy IPC can export it: peers map it) unless a stream waits for a gate; then
 * from the stream-ordered allocator, which needs no synchronisation */
static void *cu_alloc(size_t nbytes)
{
    CUdeviceptr p = 0;
    CUresult    rc;

    if (xccl_cuda_enter() != XCCL_OK) return NULL;
    if (!xccl_cuda_sync_begin()) return alloc_async(nbytes);
    rc = xccl_cu.MemAlloc(&p, nbytes ? nbytes : 1);
    xccl_cuda_sync_end();
    if (rc != CUDA_SUCCESS) {
        xccl_cuda_fail(rc, "cuMemAlloc");
        return NULL;
    }
    return (void *)(uintptr_t)p;
}

static void cu_free(void *p) { xccl_cuda_free_any(p); }

/* An event on the caller's stream, tested by the core's progress (exec.h: xccl's stream never
 * waits for a caller's stream on the device). xccl's own stream needs no mark: what it runs
 * is in order already. */
static xccl_status_t cu_order_after(void *stream, void **ev)
{
    CUstream s = (CUstream)stream, own = xccl_cuda_stream();
    CUevent  e;
    CUresult rc;

    *ev = NULL;
    /* the caller's thread, no lock of xccl held: a good time */
    xccl_cuda_release_deferred();
    xccl_cuda_peer_warm();
    if (s == own) return XCCL_OK;
    XCCL_CHECK(xccl_cuda_enter());
    e = xccl_cuda_event_get();
    if (e == NULL) return XCCL_ERR_CUDA;
    rc = xccl_cu.EventRecord(e, s);
    if (rc == CUDA_SUCCESS) rc = xccl_cu.EventQuery(e);
    if (rc == CUDA_ERROR_NOT_READY) {
        *ev = e;
        return XCCL_INPROGRESS;
    }
    xccl_cuda_event_put(e);
    return rc == CUDA_SUCCESS ? XCCL_OK
                              : xccl_cuda_fail(rc, "cuda: marking the caller's stream");
}

/* a pending event goes back to the pool: it is only recorded again by a later use */
static void cu_drop_event(void *ev) { xccl_cuda_event_put((CUevent)ev); }

/* gate_new and gate_open are host bookkeeping: no driver call, no context needed */
static xccl_status_t cu_gate_new(uint64_t *ticket)
{
    uint32_t      t = 0;
    xccl_status_t st;

    if (!gates_ready) return XCCL_ERROR(XCCL_ERR_INVALID_USAGE, "cuda: no device chosen");
    st = xccl_gates_new(&gates, &t);
    if (st == XCCL_OK) *ticket = t;
    return st;
}

static void cu_gate_open(uint64_t ticket)
{
    if (!gates_ready) return;
    /* the releases deferred meanwhile are made by the next guarded call or posted device
     * operation (xccl_cuda_release_deferred), not here: this runs where a Work finishes, with
     * the context's lock held, and freeing waits for every stream */
    xccl_gates_open(&gates, (uint32_t)ticket);
}

static xccl_status_t cu_gate_wait(uint64_t ticket, void *stream)
{
    uint32_t    t = (uint32_t)ticket;
    CUdeviceptr w;
    CUresult    rc;

    if (!gates_ready) return XCCL_ERROR(XCCL_ERR_INVALID_USAGE, "cuda: no device chosen");
    XCCL_CHECK(xccl_cuda_enter());
    /* marked under sync_mu: no implicitly synchronising call is under way, and none starts
     * until the gate opens (cuda_lib.h) */
    pthread_mutex_lock(&sync_mu);
    if (!xccl_gates_mark_waited(&gates, t)) { /* open: nothing to wait for */
        pthread_mutex_unlock(&sync_mu);
        return XCCL_OK;
    }
    w  = gate_dev + (CUdeviceptr)xccl_gates_word(&gates, t) * sizeof(uint32_t);
    rc = xccl_cu.StreamWaitValue32((CUstream)stream, w, t, CU_STREAM_WAIT_VALUE_GEQ);
    if (rc != CUDA_SUCCESS) xccl_gates_unmark(&gates, t); /* nothing waits after all */
    pthread_mutex_unlock(&sync_mu);
    if (rc == CUDA_ERROR_NOT_SUPPORTED)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                          "cuda: this device or driver cannot make a stream wait on a value "
                          "(cuStreamWaitValue32): wait for the Work on the CPU instead of "
                          "ordering a stream after it");
    return rc == CUDA_SUCCESS ? XCCL_OK : xccl_cuda_fail(rc, "cuStreamWaitValue32");
}

static xccl_status_t cu_host_register(void *p, size_t nbytes)
{
    CUresult rc;

    if (p == NULL || nbytes == 0)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "cuda: registering an empty host range");
    XCCL_CHECK(xccl_cuda_enter());
    if (!xccl_cuda_sync_begin()) return XCCL_INPROGRESS; /* not now: the buffer stays pageable */
    rc = xccl_cu.MemHostRegister(p, nbytes, CU_MEMHOSTREGISTER_PORTABLE);
    xccl_cuda_sync_end();
    if (rc == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) return XCCL_OK;
    return rc == CUDA_SUCCESS ? XCCL_OK : xccl_cuda_fail(rc, "cuMemHostRegister");
}

static void cu_host_release(void *p)
{
    if (p == NULL) return;
    if (xccl_cuda_enter() != XCCL_OK) { /* no device any more: nothing is pinned */
        free(p);
        return;
    }
    xccl_cuda_release(XCCL_CUDA_UNPIN_FREE, p);
}

static xccl_status_t cu_reduce_n(void *q, void *dst, const void *const *srcs, int k,
                                 size_t count, xccl_dtype_t dtype, xccl_op_t op, void **ev)
{
    *ev = NULL;
    if (count == 0) return XCCL_OK;
    XCCL_CHECK(xccl_cuda_reduce_n(dst, srcs, k, count, dtype, op, q_stream(q)));
    return finish(q, ev);
}

const xccl_exec_ops_t xccl_exec_cuda = {
    .name            = "cuda",
    .mem             = XCCL_MEM_CUDA,
    .copy            = cu_copy,
    .reduce          = cu_reduce,
    .scale           = cu_scale,
    .divide          = cu_divide,
    .test            = cu_test,
    .queue_new       = cu_queue_new,
    .queue_free      = cu_queue_free,
    .alloc           = cu_alloc,
    .free            = cu_free,
    .order_after     = cu_order_after,
    .drop_event      = cu_drop_event,
    .gate_new        = cu_gate_new,
    .gate_open       = cu_gate_open,
    .gate_wait       = cu_gate_wait,
    .host_register   = cu_host_register,
    .host_release    = cu_host_release,
    .export_mem      = xccl_cuda_export_mem,
    .import_mem      = xccl_cuda_import_mem,
    .reduce_n        = cu_reduce_n,
};

/* ---------------------------------------------------------------------------------------------
 * Multi-source reduction for GPU algorithms
 * ------------------------------------------------------------------------------------------- */

xccl_status_t xccl_cuda_reduce_n(void *dst, const void *const *srcs, int k, size_t count,
                                 xccl_dtype_t dtype, xccl_op_t op, CUstream stream)
{
    struct {
        const void *p[XCCL_CUDA_REDUCE_N_MAX];
    } s;
    const void *ptrs[XCCL_CUDA_REDUCE_N_MAX + 1];
    CUfunction  f;
    size_t      n = count;
    CUresult    rc;

    XCCL_CHECK(check_base("reduce_n", dtype, op));
    if (k < 1 || k > XCCL_CUDA_REDUCE_N_MAX || srcs == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "cuda reduce_n: %d sources (need 1..%d)", k,
                          XCCL_CUDA_REDUCE_N_MAX);
    if (count == 0) return XCCL_OK;
    ptrs[0] = dst;
    memset(&s, 0, sizeof s);
    for (int j = 0; j < k; j++)
        ptrs[j + 1] = s.p[j] = srcs[j];
    XCCL_CHECK(check_ptrs("reduce_n", ptrs, k + 1, dtype));
    XCCL_CHECK(xccl_cuda_enter());
    if (stream == NULL) stream = xccl_cuda_stream();
    if (k == 1 && dtype != XCCL_BOOL) {
        if (dst == srcs[0]) return XCCL_OK;
        rc = xccl_cu.MemcpyAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)srcs[0],
                                 count * xccl_dtype_size(dtype), stream);
        return rc == CUDA_SUCCESS ? XCCL_OK : xccl_cuda_fail(rc, "cuMemcpyAsync");
    }
    if (k == 1) { /* bool: normalised to 0/1 (s0 or s0), as xccl_reduce_n */
        const void *s0     = srcs[0];
        void       *args[] = {&dst, &s0, &s0, &n};

        XCCL_CHECK(kernel(K_REDUCE2, XCCL_BOOL, XCCL_OP_BOR, &f));
        return launch(f, n, 1, args, stream, "cuLaunchKernel(reduce_n)");
    }
    canonical(&dtype, &op, &n);
    XCCL_CHECK(kernel(K_REDUCE_N, dtype, op, &f));
    {
        void *args[] = {&dst, &s, &k, &n};
        return launch(f, n, xccl_dtype_size(dtype), args, stream, "cuLaunchKernel(reduce_n)");
    }
}
