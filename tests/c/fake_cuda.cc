// SPDX-License-Identifier: Apache-2.0
//
// fake_cuda.cc - a fake CUDA driver (libcuda.so.1's entry points that xccl uses), built as a
// shared object and loaded by xccl through $XCCL_CUDA_LIB, so the CUDA device layer, the
// executor and the GPU kernels run on a machine without a GPU:
//   - "device memory" is host memory (cuMemAlloc: aligned_alloc), tracked so that
//     cuPointerGetAttributes answers like the driver (device, range; unknown memory: type 0);
//   - streams are queues run in order by a simulator: a kernel, copy or event record runs once
//     everything before it on its stream ran; cuStreamWaitEvent and cuStreamWaitValue32 (GEQ,
//     cyclic) hold a stream until the event completed or the word reached the value; work runs
//     only when a stream or event is queried or synchronised (so a result read before its
//     completion was waited for is stale, as it may be on a GPU). Synchronising a stream that can never advance
//     fails (CUDA_ERROR_LAUNCH_TIMEOUT) instead of hanging;
//   - kernels are those of csrc/cuda/kernels.cu compiled for the host (cuda_host_shim.h), run
//     by a loop over an emulated grid (blocks x threads, each with its own indices); the
//     module image must start with the fatbin magic (checks the embedding);
//   - one device, compute capability 9.0, 4 multiprocessors.
// Not a model of concurrency: everything runs under one lock in the calling thread.
#include "cuda_host_shim.h"

#include "../../csrc/cuda/kernels.cu"

#include <cuda.h>
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

thread_local dim3_t blockIdx, threadIdx, blockDim, gridDim;

namespace {

enum Kind { K_REDUCE2, K_REDUCE_N, K_SCALE, K_DIVIDE };

struct Func {
    std::string name;
    Kind        kind;
    void       *fn;
};

struct Event {
    unsigned long recorded = 0, done = 0;
};

struct Op {
    enum { COPY, KERNEL, RECORD, WAIT_EVENT, WAIT_VALUE } type;
    void       *dst = nullptr;
    const void *src = nullptr;
    size_t      n   = 0;
    Func       *f   = nullptr;
    unsigned    grid = 1, block = 1;
    // kernel arguments, copied at launch as the driver does
    void       *p0 = nullptr, *p1 = nullptr, *p2 = nullptr;
    xccl_srcs_t srcs{};
    int         k = 0;
    double      factor = 0;
    Event      *ev  = nullptr;
    unsigned long gen = 0;
    const uint32_t *word = nullptr;
    uint32_t    value = 0;
};

struct Stream {
    std::deque<Op> q;
};

std::recursive_mutex          mu;
Stream                        legacy;
std::vector<Stream *>         streams{&legacy};
std::map<uintptr_t, size_t>   allocs; // device allocations: start -> size
thread_local CUcontext        current;
CUcontext const               the_ctx = reinterpret_cast<CUcontext>(0x5ca1ab1e);

Stream *stream_of(CUstream s)
{
    uintptr_t v = reinterpret_cast<uintptr_t>(s);
    if (v == 0 || v == 1 || v == 2) return &legacy; // legacy / per-thread default streams
    return reinterpret_cast<Stream *>(s);
}

void run_kernel(Op &op)
{
    gridDim.x  = op.grid;
    blockDim.x = op.block;
    gridDim.y = gridDim.z = blockDim.y = blockDim.z = 1;
    for (unsigned b = 0; b < op.grid; b++) {
        for (unsigned t = 0; t < op.block; t++) {
            blockIdx.x  = b;
            threadIdx.x = t;
            switch (op.f->kind) {
            case K_REDUCE2:
                reinterpret_cast<void (*)(void *, const void *, const void *, size_t)>(op.f->fn)(
                    op.p0, op.p1, op.p2, op.n);
                break;
            case K_REDUCE_N:
                reinterpret_cast<void (*)(void *, xccl_srcs_t, int, size_t)>(op.f->fn)(
                    op.p0, op.srcs, op.k, op.n);
                break;
            case K_SCALE:
                reinterpret_cast<void (*)(void *, const void *, size_t, double)>(op.f->fn)(
                    op.p0, op.p1, op.n, op.factor);
                break;
            case K_DIVIDE:
                reinterpret_cast<void (*)(void *, const void *, size_t, int)>(op.f->fn)(
                    op.p0, op.p1, op.n, op.k);
                break;
            }
        }
    }
}

// Runs every op that can run, on every stream, until none can.
void advance()
{
    bool moved = true;
    while (moved) {
        moved = false;
        for (Stream *s : streams) {
            while (!s->q.empty()) {
                Op &op = s->q.front();
                if (op.type == Op::WAIT_EVENT && op.ev->done < op.gen) break;
                if (op.type == Op::WAIT_VALUE &&
                    static_cast<int32_t>(__atomic_load_n(op.word, __ATOMIC_ACQUIRE) - op.value) < 0)
                    break;
                if (op.type == Op::COPY) memmove(op.dst, op.src, op.n);
                if (op.type == Op::KERNEL) run_kernel(op);
                if (op.type == Op::RECORD) op.ev->done = op.gen;
                s->q.pop_front();
                moved = true;
            }
        }
    }
}

CUresult push(CUstream s, const Op &op)
{
    stream_of(s)->q.push_back(op); // runs when someone queries or synchronises
    return CUDA_SUCCESS;
}

#define LOCK std::lock_guard<std::recursive_mutex> lock_(mu)

} // namespace

extern "C" {
#define API __attribute__((visibility("default")))

API CUresult cuInit(unsigned int) { return CUDA_SUCCESS; }
API CUresult cuDriverGetVersion(int *v) { *v = 13000; return CUDA_SUCCESS; }
API CUresult cuGetErrorName(CUresult e, const char **s)
{
    *s = e == CUDA_SUCCESS ? "CUDA_SUCCESS" : e == CUDA_ERROR_NOT_READY ? "CUDA_ERROR_NOT_READY"
                                                                        : "CUDA_ERROR_FAKE";
    return CUDA_SUCCESS;
}
API CUresult cuGetErrorString(CUresult, const char **s) { *s = "fake driver error"; return CUDA_SUCCESS; }
API CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *d = 0;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetCount(int *n) { *n = 1; return CUDA_SUCCESS; }
API CUresult cuDeviceGetName(char *name, int len, CUdevice)
{
    snprintf(name, (size_t)len, "fake GPU");
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice)
{
    switch (a) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = 4; break;
    default: *v = 0; break;
    }
    return CUDA_SUCCESS;
}
API CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice) { *c = the_ctx; return CUDA_SUCCESS; }
API CUresult cuDevicePrimaryCtxRelease(CUdevice) { return CUDA_SUCCESS; }
API CUresult cuCtxGetCurrent(CUcontext *c) { *c = current; return CUDA_SUCCESS; }
API CUresult cuCtxSetCurrent(CUcontext c) { current = c; return CUDA_SUCCESS; }

#define NEED_CTX                                                                           \
    do {                                                                                   \
        if (current != the_ctx) return CUDA_ERROR_INVALID_CONTEXT;                         \
    } while (0)

API CUresult cuStreamCreateWithPriority(CUstream *s, unsigned int, int)
{
    LOCK;
    NEED_CTX;
    Stream *st = new Stream;
    streams.push_back(st);
    *s = reinterpret_cast<CUstream>(st);
    return CUDA_SUCCESS;
}
API CUresult cuStreamDestroy(CUstream s)
{
    LOCK;
    for (size_t i = 1; i < streams.size(); i++)
        if (streams[i] == stream_of(s)) {
            advance(); // a destroyed stream's work still runs; here: drop it only if done
            if (!streams[i]->q.empty()) return CUDA_ERROR_NOT_READY;
            delete streams[i];
            streams.erase(streams.begin() + (long)i);
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_HANDLE;
}
API CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int)
{
    LOCK;
    NEED_CTX;
    Op op;
    op.type = Op::WAIT_EVENT;
    op.ev   = reinterpret_cast<Event *>(e);
    op.gen  = op.ev->recorded;
    return push(s, op);
}
API CUresult cuStreamWaitValue32(CUstream s, CUdeviceptr addr, cuuint32_t value, unsigned int flags)
{
    LOCK;
    NEED_CTX;
    if (flags != CU_STREAM_WAIT_VALUE_GEQ || addr % 4 != 0) return CUDA_ERROR_INVALID_VALUE;
    Op op;
    op.type  = Op::WAIT_VALUE;
    op.word  = reinterpret_cast<const uint32_t *>(addr);
    op.value = value;
    return push(s, op);
}
API CUresult cuStreamSynchronize(CUstream s)
{
    LOCK;
    advance();
    return stream_of(s)->q.empty() ? CUDA_SUCCESS : CUDA_ERROR_LAUNCH_TIMEOUT;
}
API CUresult cuStreamQuery(CUstream s)
{
    LOCK;
    advance();
    return stream_of(s)->q.empty() ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
API CUresult cuEventCreate(CUevent *e, unsigned int)
{
    NEED_CTX;
    *e = reinterpret_cast<CUevent>(new Event);
    return CUDA_SUCCESS;
}
API CUresult cuEventDestroy(CUevent e)
{
    delete reinterpret_cast<Event *>(e);
    return CUDA_SUCCESS;
}
API CUresult cuEventRecord(CUevent e, CUstream s)
{
    LOCK;
    NEED_CTX;
    Op op;
    op.type = Op::RECORD;
    op.ev   = reinterpret_cast<Event *>(e);
    op.gen  = ++op.ev->recorded;
    return push(s, op);
}
API CUresult cuEventQuery(CUevent e)
{
    LOCK;
    advance();
    Event *ev = reinterpret_cast<Event *>(e);
    return ev->done >= ev->recorded ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
API CUresult cuEventSynchronize(CUevent e)
{
    CUresult rc = cuEventQuery(e);
    return rc == CUDA_ERROR_NOT_READY ? CUDA_ERROR_LAUNCH_TIMEOUT : rc;
}
API CUresult cuEventElapsedTime(float *ms, CUevent, CUevent) { *ms = 0; return CUDA_SUCCESS; }
API CUresult cuMemAlloc(CUdeviceptr *p, size_t n)
{
    LOCK;
    NEED_CTX;
    void *m = aligned_alloc(256, (n + 255) / 256 * 256);
    if (m == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    allocs[reinterpret_cast<uintptr_t>(m)] = n;
    *p = reinterpret_cast<CUdeviceptr>(m);
    return CUDA_SUCCESS;
}
API CUresult cuMemFree(CUdeviceptr p)
{
    LOCK;
    NEED_CTX;
    if (allocs.erase(static_cast<uintptr_t>(p)) != 1) return CUDA_ERROR_INVALID_VALUE;
    free(reinterpret_cast<void *>(p));
    return CUDA_SUCCESS;
}
API CUresult cuMemHostAlloc(void **p, size_t n, unsigned int)
{
    *p = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
API CUresult cuMemFreeHost(void *p) { free(p); return CUDA_SUCCESS; }
API CUresult cuMemHostGetDevicePointer(CUdeviceptr *d, void *p, unsigned int)
{
    *d = reinterpret_cast<CUdeviceptr>(p);
    return CUDA_SUCCESS;
}
API CUresult cuMemHostRegister(void *, size_t, unsigned int) { return CUDA_SUCCESS; }
API CUresult cuMemHostUnregister(void *) { return CUDA_SUCCESS; }
API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    LOCK;
    NEED_CTX;
    // the real driver's result is undefined for overlapping ranges: refuse them here
    if (dst < src + n && src < dst + n) return CUDA_ERROR_INVALID_VALUE;
    Op op;
    op.type = Op::COPY;
    op.dst  = reinterpret_cast<void *>(dst);
    op.src  = reinterpret_cast<const void *>(src);
    op.n    = n;
    return push(s, op);
}
API CUresult cuMemsetD8Async(CUdeviceptr, unsigned char, size_t, CUstream) { return CUDA_ERROR_NOT_SUPPORTED; }
API CUresult cuMemGetAddressRange(CUdeviceptr *, size_t *, CUdeviceptr) { return CUDA_ERROR_NOT_SUPPORTED; }
API CUresult cuPointerGetAttribute(void *, CUpointer_attribute, CUdeviceptr) { return CUDA_ERROR_NOT_SUPPORTED; }
API CUresult cuPointerGetAttributes(unsigned int n, CUpointer_attribute *attrs, void **data, CUdeviceptr p)
{
    LOCK;
    auto it = allocs.upper_bound(static_cast<uintptr_t>(p));
    bool dev = false;
    if (it != allocs.begin()) {
        --it;
        dev = p >= it->first && p < it->first + it->second;
    }
    for (unsigned i = 0; i < n; i++) {
        switch (attrs[i]) {
        case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
            *static_cast<unsigned *>(data[i]) = dev ? CU_MEMORYTYPE_DEVICE : 0;
            break;
        case CU_POINTER_ATTRIBUTE_IS_MANAGED: *static_cast<unsigned char *>(data[i]) = 0; break;
        case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *static_cast<int *>(data[i]) = dev ? 0 : -2; break;
        case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
            *static_cast<CUdeviceptr *>(data[i]) = dev ? it->first : 0;
            break;
        case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *static_cast<size_t *>(data[i]) = dev ? it->second : 0; break;
        default: return CUDA_ERROR_INVALID_VALUE;
        }
    }
    return CUDA_SUCCESS;
}
API CUresult cuIpcGetMemHandle(CUipcMemHandle *, CUdeviceptr) { return CUDA_ERROR_NOT_SUPPORTED; }
API CUresult cuIpcOpenMemHandle(CUdeviceptr *, CUipcMemHandle, unsigned int) { return CUDA_ERROR_NOT_SUPPORTED; }
API CUresult cuIpcCloseMemHandle(CUdeviceptr) { return CUDA_ERROR_NOT_SUPPORTED; }
API CUresult cuModuleLoadData(CUmodule *m, const void *image)
{
    uint32_t magic;
    NEED_CTX;
    memcpy(&magic, image, 4);
    if (magic != 0xBA55ED50u) return CUDA_ERROR_INVALID_IMAGE; // a fatbin starts so
    *m = reinterpret_cast<CUmodule>(new std::map<std::string, Func *>);
    return CUDA_SUCCESS;
}
API CUresult cuModuleUnload(CUmodule) { return CUDA_SUCCESS; }
API CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name)
{
    LOCK;
    auto   &tab = *reinterpret_cast<std::map<std::string, Func *> *>(m);
    Dl_info info;
    if (tab.count(name) == 0) {
        if (dladdr(reinterpret_cast<void *>(&cuInit), &info) == 0) return CUDA_ERROR_NOT_FOUND;
        void *self = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
        void *fn   = self ? dlsym(self, name) : nullptr;
        if (self) dlclose(self);
        if (fn == nullptr) return CUDA_ERROR_NOT_FOUND;
        Kind k = strncmp(name, "xccl_reduce2_", 13) == 0    ? K_REDUCE2
                 : strncmp(name, "xccl_reduce_n_", 14) == 0 ? K_REDUCE_N
                 : strncmp(name, "xccl_scale_", 11) == 0    ? K_SCALE
                                                            : K_DIVIDE;
        tab[name] = new Func{name, k, fn};
    }
    *f = reinterpret_cast<CUfunction>(tab[name]);
    return CUDA_SUCCESS;
}
API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                            unsigned by, unsigned bz, unsigned shmem, CUstream s, void **params,
                            void **extra)
{
    LOCK;
    NEED_CTX;
    if (gy != 1 || gz != 1 || by != 1 || bz != 1 || shmem != 0 || extra != nullptr || gx == 0 ||
        bx == 0 || bx > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    Op op;
    op.type  = Op::KERNEL;
    op.f     = reinterpret_cast<Func *>(f);
    // a smaller emulated grid than asked for would hide nothing: the kernels grid-stride
    op.grid  = gx < 3 ? gx : 3;
    op.block = bx < 32 ? bx : 32;
    op.p0    = *static_cast<void **>(params[0]);
    switch (op.f->kind) {
    case K_REDUCE2:
        op.p1 = *static_cast<void **>(params[1]);
        op.p2 = *static_cast<void **>(params[2]);
        op.n  = *static_cast<size_t *>(params[3]);
        break;
    case K_REDUCE_N:
        memcpy(&op.srcs, params[1], sizeof op.srcs);
        op.k = *static_cast<int *>(params[2]);
        op.n = *static_cast<size_t *>(params[3]);
        break;
    case K_SCALE:
        op.p1     = *static_cast<void **>(params[1]);
        op.n      = *static_cast<size_t *>(params[2]);
        op.factor = *static_cast<double *>(params[3]);
        break;
    case K_DIVIDE:
        op.p1 = *static_cast<void **>(params[1]);
        op.n  = *static_cast<size_t *>(params[2]);
        op.k  = *static_cast<int *>(params[3]);
        break;
    }
    return push(s, op);
}

} // extern "C"
