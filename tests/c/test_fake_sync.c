/* SPDX-License-Identifier: Apache-2.0
 *
 * test_fake_sync.c - the fake CUDA driver itself (fake_cuda.cc), called directly:
 *   - implicit synchronisation: with a stream held by cuStreamWaitValue32 on a host word,
 *     cuMemFree of an unrelated allocation fails with CUDA_ERROR_LAUNCH_TIMEOUT after
 *     $FAKE_CUDA_SYNC_TIMEOUT_MS (and says so on stderr), and so do cuMemAlloc and
 *     cuStreamSynchronize; the allocation survives the failed free;
 *   - the wait releases the driver's lock: another thread calls the driver and then opens the
 *     word with a plain store, and cuMemFree, cuStreamSynchronize and cuEventSynchronize
 *     return success with the work queued before them done;
 *   - the stream-ordered allocator does not wait: cuMemAllocAsync/cuMemFreeAsync return at once
 *     while the stream is held; its memory is device memory to the queries but not
 *     IPC-capable; the free happens when the stream gets there;
 *   - legacy IPC across fork: the parent opens the child's handle, a copy and a kernel read
 *     the child's pattern through the imported pointer, a copy and a kernel write through it,
 *     and the child sees the writes; a handle of one's own process, of a freed allocation
 *     (its fd reused) and of an exited process fail to open.
 * Without the CUDA headers (no FAKE_CUDA_LIB) it only says it skipped.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ctest.h"

#if defined(XCCL_HAVE_CUDA) && defined(FAKE_CUDA_LIB)
#include <cuda.h>

/* the driver's entry points, by the names cuda.h gives them (cuMemAlloc is cuMemAlloc_v2) */
#define DRV(X)                                                                                     \
    X(cuInit) X(cuDevicePrimaryCtxRetain) X(cuCtxSetCurrent) X(cuDeviceGetAttribute)              \
    X(cuStreamCreateWithPriority) X(cuStreamDestroy) X(cuStreamWaitValue32)                       \
    X(cuStreamSynchronize) X(cuStreamQuery) X(cuEventCreate) X(cuEventDestroy) X(cuEventRecord)   \
    X(cuEventSynchronize) X(cuMemAlloc) X(cuMemFree) X(cuMemAllocAsync) X(cuMemFreeAsync)         \
    X(cuMemHostAlloc) X(cuMemFreeHost) X(cuMemcpyAsync) X(cuMemGetAddressRange)                   \
    X(cuPointerGetAttribute) X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle) X(cuIpcCloseMemHandle)    \
    X(cuModuleLoadData) X(cuModuleUnload) X(cuModuleGetFunction) X(cuLaunchKernel)
#define FIELD(f) __typeof__(&f) f;
static struct {
    DRV(FIELD)
} d;
#undef FIELD
#define STR_(x) #x
#define STR(x)  STR_(x)

static CUcontext ctx;

static int load(void)
{
    void *lib = dlopen(FAKE_CUDA_LIB, RTLD_NOW | RTLD_LOCAL);

    if (lib == NULL) {
        fprintf(stderr, "dlopen %s: %s\n", FAKE_CUDA_LIB, dlerror());
        return -1;
    }
#define SYM(f)                                                                                     \
    *(void **)&d.f = dlsym(lib, STR(f));                                                           \
    if (d.f == NULL) {                                                                             \
        fprintf(stderr, "the fake driver lacks %s\n", STR(f));                                     \
        return -1;                                                                                 \
    }
    DRV(SYM)
#undef SYM
    if (d.cuInit(0) != CUDA_SUCCESS || d.cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS ||
        d.cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
        return -1;
    return 0;
}

static double now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};

    nanosleep(&ts, NULL);
}

/* stderr goes to a file while `on`; the text written meanwhile is returned (static) */
static const char *capture_stderr(int on)
{
    static char  buf[4096];
    static int   saved = -1;
    static FILE *f;

    fflush(stderr);
    if (on) {
        f     = tmpfile();
        saved = dup(2);
        dup2(fileno(f), 2);
        return NULL;
    }
    dup2(saved, 2);
    close(saved);
    rewind(f);
    buf[fread(buf, 1, sizeof buf - 1, f)] = '\0';
    fclose(f);
    return buf;
}

/* a stream held by a wait on *word reaching 1, with a copy src -> dst queued behind it */
static CUstream held_stream(uint32_t *word, const int *src, int *dst, size_t n)
{
    CUstream s = NULL;

    __atomic_store_n(word, 0, __ATOMIC_RELEASE);
    CHECK(d.cuStreamCreateWithPriority(&s, 1, 0) == CUDA_SUCCESS);
    CHECK(d.cuStreamWaitValue32(s, (CUdeviceptr)(uintptr_t)word, 1, CU_STREAM_WAIT_VALUE_GEQ) ==
          CUDA_SUCCESS);
    CHECK(d.cuMemcpyAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src,
                          n * sizeof *src, s) == CUDA_SUCCESS);
    CHECK(d.cuStreamQuery(s) == CUDA_ERROR_NOT_READY); /* held */
    return s;
}

/* (a) nobody opens the word: the implicitly synchronising calls time out, loudly */
static void test_timeout(uint32_t *word)
{
    CUdeviceptr x = 0, y = 0, base = 0;
    size_t      size = 0;
    int         src[64], *dst = NULL;
    const char *err;
    double      t0, dt;
    CUresult    rc;
    CUstream    s;

    for (int i = 0; i < 64; i++)
        src[i] = 1000 + i;
    CHECK(d.cuMemAlloc(&x, 4096) == CUDA_SUCCESS);
    CHECK(d.cuMemAlloc((CUdeviceptr *)&dst, sizeof src) == CUDA_SUCCESS);
    memset(dst, 0, sizeof src);
    s = held_stream(word, src, dst, 64);
    setenv("FAKE_CUDA_SYNC_TIMEOUT_MS", "200", 1);
    capture_stderr(1);
    t0  = now_ms();
    rc  = d.cuMemFree(x);
    dt  = now_ms() - t0;
    err = capture_stderr(0);
    CHECK_MSG(rc == CUDA_ERROR_LAUNCH_TIMEOUT, "cuMemFree: %d", (int)rc);
    CHECK_MSG(dt >= 200.0 && dt < 5000.0, "cuMemFree gave up after %.1f ms", dt);
    CHECK_MSG(strstr(err, "fake_cuda: cuMemFree would hang: stream ") != NULL &&
                  strstr(err, "waits for the word at") != NULL,
              "stderr: %s", err);
    /* the allocation is still there; nothing behind the wait ran */
    CHECK(d.cuMemGetAddressRange(&base, &size, x) == CUDA_SUCCESS && base == x && size == 4096);
    CHECK(dst[0] == 0 && dst[63] == 0);
    /* cuMemAlloc and cuStreamSynchronize alike */
    capture_stderr(1);
    t0  = now_ms();
    rc  = d.cuMemAlloc(&y, 64);
    dt  = now_ms() - t0;
    err = capture_stderr(0);
    CHECK_MSG(rc == CUDA_ERROR_LAUNCH_TIMEOUT && dt >= 200.0, "cuMemAlloc: %d after %.1f ms",
              (int)rc, dt);
    CHECK_MSG(strstr(err, "cuMemAlloc would hang") != NULL, "stderr: %s", err);
    capture_stderr(1);
    t0  = now_ms();
    rc  = d.cuStreamSynchronize(s);
    dt  = now_ms() - t0;
    err = capture_stderr(0);
    CHECK_MSG(rc == CUDA_ERROR_LAUNCH_TIMEOUT && dt >= 200.0,
              "cuStreamSynchronize: %d after %.1f ms", (int)rc, dt);
    CHECK_MSG(strstr(err, "cuStreamSynchronize would hang") != NULL, "stderr: %s", err);
    /* opened: everything runs, the free succeeds */
    __atomic_store_n(word, 1, __ATOMIC_RELEASE);
    CHECK(d.cuMemFree(x) == CUDA_SUCCESS);
    CHECK(dst[0] == 1000 && dst[63] == 1063);
    CHECK(d.cuMemGetAddressRange(&base, &size, x) == CUDA_ERROR_NOT_FOUND);
    CHECK(d.cuMemFree((CUdeviceptr)(uintptr_t)dst) == CUDA_SUCCESS);
    CHECK(d.cuStreamDestroy(s) == CUDA_SUCCESS);
}

/* (b) another thread calls the driver, then opens the word with a store, after ~50 ms */
struct opener {
    uint32_t *word;
    CUstream  other;  /* queried by the opener: the driver's lock must be free */
    double    called; /* how long that call took, ms */
};

static void *open_later(void *arg)
{
    struct opener *o = arg;
    double         t0;

    d.cuCtxSetCurrent(ctx);
    sleep_ms(50);
    t0 = now_ms();
    (void)d.cuStreamQuery(o->other);
    o->called = now_ms() - t0;
    __atomic_store_n(o->word, 1, __ATOMIC_RELEASE);
    return NULL;
}

static void test_released(uint32_t *word, int which)
{
    static const char *name[] = {"cuMemFree", "cuStreamSynchronize", "cuEventSynchronize"};
    CUdeviceptr        x      = 0;
    CUstream           s, other = NULL;
    CUevent            ev = NULL;
    int                src[64], *dst = NULL;
    pthread_t          th;
    struct opener      o;
    double             t0, dt;
    CUresult           rc = CUDA_ERROR_UNKNOWN;

    for (int i = 0; i < 64; i++)
        src[i] = 7 * i + which;
    CHECK(d.cuMemAlloc(&x, 100) == CUDA_SUCCESS);
    CHECK(d.cuMemAlloc((CUdeviceptr *)&dst, sizeof src) == CUDA_SUCCESS);
    CHECK(d.cuEventCreate(&ev, 0) == CUDA_SUCCESS);
    CHECK(d.cuStreamCreateWithPriority(&other, 1, 0) == CUDA_SUCCESS);
    memset(dst, 0, sizeof src);
    s = held_stream(word, src, dst, 64);
    CHECK(d.cuEventRecord(ev, s) == CUDA_SUCCESS);
    setenv("FAKE_CUDA_SYNC_TIMEOUT_MS", "3000", 1);
    o.word   = word;
    o.other  = other;
    o.called = -1;
    CHECK(pthread_create(&th, NULL, open_later, &o) == 0);
    t0 = now_ms();
    switch (which) {
    case 0: rc = d.cuMemFree(x); break;
    case 1: rc = d.cuStreamSynchronize(s); break;
    case 2: rc = d.cuEventSynchronize(ev); break;
    }
    dt = now_ms() - t0;
    CHECK(pthread_join(th, NULL) == 0);
    CHECK_MSG(rc == CUDA_SUCCESS, "%s: %d", name[which], (int)rc);
    CHECK_MSG(dt >= 45.0 && dt < 2000.0, "%s returned after %.1f ms", name[which], dt);
    CHECK_MSG(o.called >= 0 && o.called < 100.0, "%s held the lock: the other call took %.1f ms",
              name[which], o.called);
    CHECK_MSG(dst[0] == which && dst[63] == 7 * 63 + which, "%s: the copy queued before it: %d %d",
              name[which], dst[0], dst[63]);
    if (which != 0) CHECK(d.cuMemFree(x) == CUDA_SUCCESS);
    CHECK(d.cuMemFree((CUdeviceptr)(uintptr_t)dst) == CUDA_SUCCESS);
    CHECK(d.cuStreamDestroy(s) == CUDA_SUCCESS && d.cuStreamDestroy(other) == CUDA_SUCCESS);
    CHECK(d.cuEventDestroy(ev) == CUDA_SUCCESS);
}

/* (c) the stream-ordered allocator does not synchronise */
static void test_async_alloc(uint32_t *word)
{
    CUdeviceptr   p = 0, base = 0, x = 0;
    size_t        size = 0;
    unsigned char ipc  = 7;
    int           src[4] = {1, 2, 3, 4}, dst[4] = {0}, pools = 0;
    CUipcMemHandle h;
    double        t0, dt;
    CUstream      s;

    CHECK(d.cuDeviceGetAttribute(&pools, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, 0) ==
              CUDA_SUCCESS &&
          pools == 1);
    s = held_stream(word, src, dst, 4);
    setenv("FAKE_CUDA_SYNC_TIMEOUT_MS", "200", 1);
    t0 = now_ms();
    CHECK(d.cuMemAllocAsync(&p, 1000, s) == CUDA_SUCCESS && p != 0);
    CHECK(d.cuMemGetAddressRange(&base, &size, p + 10) == CUDA_SUCCESS && base == p &&
          size == 1000);
    CHECK(d.cuPointerGetAttribute(&ipc, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p) ==
              CUDA_SUCCESS &&
          ipc == 0);
    CHECK(d.cuIpcGetMemHandle(&h, p) == CUDA_ERROR_INVALID_VALUE);
    memset((void *)(uintptr_t)p, 0x5a, 1000); /* usable at once */
    CHECK(d.cuMemFreeAsync(p, s) == CUDA_SUCCESS);
    CHECK(d.cuMemFreeAsync(p, s) == CUDA_ERROR_INVALID_VALUE); /* already being freed */
    dt = now_ms() - t0;
    CHECK_MSG(dt < 100.0, "the stream-ordered allocator waited %.1f ms", dt);
    /* the free waits its turn on the stream */
    CHECK(d.cuMemGetAddressRange(&base, &size, p) == CUDA_SUCCESS);
    capture_stderr(1);
    CHECK(d.cuMemAlloc(&x, 64) == CUDA_ERROR_LAUNCH_TIMEOUT); /* the contrast: this one waits */
    capture_stderr(0);
    __atomic_store_n(word, 1, __ATOMIC_RELEASE);
    CHECK(d.cuStreamSynchronize(s) == CUDA_SUCCESS);
    CHECK(d.cuMemGetAddressRange(&base, &size, p) == CUDA_ERROR_NOT_FOUND);
    CHECK(dst[3] == 4);
    CHECK(d.cuStreamDestroy(s) == CUDA_SUCCESS);
}

/* (d) IPC across fork: the child's allocation, read and written by the parent's copies and
 * kernels through the imported pointer */
#define NI 1000

static int xfer(int fd, void *buf, size_t n, int out)
{
    size_t k = 0;

    while (k < n) {
        ssize_t r = out ? write(fd, (char *)buf + k, n - k) : read(fd, (char *)buf + k, n - k);
        if (r <= 0) return -1;
        k += (size_t)r;
    }
    return 0;
}

static int ipc_child(int to_parent, int from_parent)
{
    CUdeviceptr    a = 0, b = 0;
    CUipcMemHandle h, hb;
    int32_t       *v;
    char           go;
    int            bad = 0;

    if (d.cuMemAlloc(&a, NI * sizeof(int32_t)) != CUDA_SUCCESS) return 10;
    v = (int32_t *)(uintptr_t)a;
    for (int i = 0; i < NI; i++)
        v[i] = 3 * i + 1;
    if (d.cuIpcGetMemHandle(&h, a) != CUDA_SUCCESS) return 11;
    if (xfer(to_parent, &h, sizeof h, 1) != 0 || xfer(from_parent, &go, 1, 0) != 0) return 12;
    /* the parent's kernel wrote v[i] = v[i] + 10 * i into the first half, its copy -i into the
     * second */
    for (int i = 0; i < NI; i++)
        bad += v[i] != (i < NI / 2 ? 3 * i + 1 + 10 * i : -i);
    if (bad) fprintf(stderr, "ipc child: %d elements not as the parent wrote them\n", bad);
    /* freed, and another allocation most likely on the same fd: the old handle must not open,
     * the new one must */
    if (d.cuMemFree(a) != CUDA_SUCCESS || d.cuMemAlloc(&b, NI * sizeof(int32_t)) != CUDA_SUCCESS ||
        d.cuIpcGetMemHandle(&hb, b) != CUDA_SUCCESS)
        return 13;
    ((int32_t *)(uintptr_t)b)[0] = 4242;
    if (xfer(to_parent, &hb, sizeof hb, 1) != 0 || xfer(from_parent, &go, 1, 0) != 0) return 14;
    return bad ? 1 : 0; /* exits with b exported */
}

static void test_ipc(void)
{
    int            up[2], down[2], status = -1;
    pid_t          pid;
    CUipcMemHandle h, hb, mine;
    CUdeviceptr    p = 0, q = 0, own = 0, local = 0, back = 0;
    CUmodule       mod  = NULL;
    CUfunction     fn   = NULL;
    const uint32_t fatbin[4] = {0xBA55ED50u, 0, 0, 0};
    int32_t       *lv, *bv;
    char           go = 1;
    size_t         n = NI / 2;
    int            bad = 0;

    setenv("FAKE_CUDA_SYNC_TIMEOUT_MS", "10000", 1);
    CHECK(pipe(up) == 0 && pipe(down) == 0);
    fflush(NULL);
    pid = fork();
    if (pid == 0) {
        close(up[0]);
        close(down[1]);
        _exit(ipc_child(up[1], down[0]));
    }
    close(up[1]);
    close(down[0]);
    CHECK(xfer(up[0], &h, sizeof h, 0) == 0);
    /* one's own handle: refused */
    CHECK(d.cuMemAlloc(&own, 64) == CUDA_SUCCESS);
    CHECK(d.cuIpcGetMemHandle(&mine, own) == CUDA_SUCCESS);
    CHECK(d.cuIpcOpenMemHandle(&q, mine, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) ==
          CUDA_ERROR_INVALID_CONTEXT);
    CHECK(d.cuMemFree(own) == CUDA_SUCCESS);
    CHECK(d.cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) == CUDA_SUCCESS);
    CHECK(d.cuMemAlloc(&local, NI * sizeof(int32_t)) == CUDA_SUCCESS);
    CHECK(d.cuMemAlloc(&back, NI * sizeof(int32_t)) == CUDA_SUCCESS);
    CHECK(d.cuModuleLoadData(&mod, fatbin) == CUDA_SUCCESS);
    CHECK(d.cuModuleGetFunction(&fn, mod, "xccl_reduce2_i32_sum") == CUDA_SUCCESS);
    if (p == 0 || local == 0 || back == 0 || fn == NULL) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        return;
    }
    lv = (int32_t *)(uintptr_t)local;
    bv = (int32_t *)(uintptr_t)back;
    for (int i = 0; i < NI; i++)
        lv[i] = i < NI / 2 ? 10 * i : -i;
    /* a copy reads the child's pattern */
    CHECK(d.cuMemcpyAsync(back, p, NI * sizeof(int32_t), NULL) == CUDA_SUCCESS);
    CHECK(d.cuStreamSynchronize(NULL) == CUDA_SUCCESS);
    for (int i = 0; i < NI; i++)
        bad += bv[i] != 3 * i + 1;
    CHECK_MSG(bad == 0, "ipc: a copy read %d elements wrong through the imported pointer", bad);
    /* a kernel reads and writes it: p[i] = p[i] + local[i] for the first half */
    {
        void *dstp = (void *)(uintptr_t)p, *ap = (void *)(uintptr_t)p,
             *bp = (void *)(uintptr_t)local;
        void *args[] = {&dstp, &ap, &bp, &n};
        CHECK(d.cuLaunchKernel(fn, 2, 1, 1, 64, 1, 1, 0, NULL, args, NULL) == CUDA_SUCCESS);
    }
    /* a copy writes the second half */
    CHECK(d.cuMemcpyAsync(p + n * sizeof(int32_t), local + n * sizeof(int32_t),
                          (NI - n) * sizeof(int32_t), NULL) == CUDA_SUCCESS);
    CHECK(d.cuStreamSynchronize(NULL) == CUDA_SUCCESS);
    /* the parent sees what it wrote too (the same memory) */
    CHECK(((int32_t *)(uintptr_t)p)[1] == 3 + 1 + 10 && ((int32_t *)(uintptr_t)p)[NI - 1] == -(NI - 1));
    CHECK(d.cuIpcCloseMemHandle(p) == CUDA_SUCCESS);
    CHECK(d.cuIpcCloseMemHandle(p) == CUDA_ERROR_INVALID_VALUE);
    CHECK(xfer(down[1], &go, 1, 1) == 0);
    /* the child freed it and allocated again: the old handle names memory that is gone, the
     * new one opens */
    CHECK(xfer(up[0], &hb, sizeof hb, 0) == 0);
    CHECK(d.cuIpcOpenMemHandle(&q, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) ==
          CUDA_ERROR_INVALID_VALUE);
    CHECK(d.cuIpcOpenMemHandle(&q, hb, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) == CUDA_SUCCESS);
    if (q != 0) {
        CHECK(((int32_t *)(uintptr_t)q)[0] == 4242);
        CHECK(d.cuIpcCloseMemHandle(q) == CUDA_SUCCESS);
    }
    CHECK(xfer(down[1], &go, 1, 1) == 0);
    waitpid(pid, &status, 0);
    CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "ipc child: status 0x%x", status);
    /* the exporter exited: its valid handle no longer opens */
    CHECK(d.cuIpcOpenMemHandle(&q, hb, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) ==
          CUDA_ERROR_INVALID_VALUE);
    close(up[0]);
    close(down[1]);
    CHECK(d.cuMemFree(local) == CUDA_SUCCESS && d.cuMemFree(back) == CUDA_SUCCESS);
    CHECK(d.cuModuleUnload(mod) == CUDA_SUCCESS);
}

int main(void)
{
    uint32_t *word = NULL;

    if (load() != 0) {
        CHECK(0);
        CTEST_MAIN_END("test_fake_sync");
    }
    CHECK(d.cuMemHostAlloc((void **)&word, sizeof *word, 0) == CUDA_SUCCESS);
    test_timeout(word);
    for (int which = 0; which < 3; which++)
        test_released(word, which);
    test_async_alloc(word);
    test_ipc();
    CHECK(d.cuMemFreeHost(word) == CUDA_SUCCESS);
    CTEST_MAIN_END("test_fake_sync");
}
#else
int main(void)
{
    printf("test_fake_sync: skipped (needs the CUDA headers and FAKE_CUDA_LIB)\n");
    CTEST_MAIN_END("test_fake_sync");
}
#endif
