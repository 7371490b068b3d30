// SPDX-License-Identifier: Apache-2.0
//
// fake_cuda.cc - a fake CUDA driver (libcuda.so.1's entry points that xccl uses), built as a
// shared object and loaded by xccl through $XCCL_CUDA_LIB, so the CUDA device layer, the
// executor and the GPU kernels run on a machine without a GPU:
//   - "device memory" is host memory: cuMemAlloc maps a memfd (MAP_SHARED, whole pages, the fd
//     open until cuMemFree), tracked so that cuPointerGetAttribute(s) and cuMemGetAddressRange
//     answer like the driver (device, range, buffer id; unknown memory: type 0);
//   - the stream-ordered allocator: cuMemAllocAsync allocates at once (plain heap memory, not
//     IPC-capable, device memory to the pointer queries); cuMemFreeAsync queues the free, which
//     happens when the stream gets there;
//   - streams are queues run in order by a simulator: a kernel, copy, event record or
//     stream-ordered free runs once everything before it on its stream ran; cuStreamWaitEvent
//     and cuStreamWaitValue32 (GEQ, cyclic) hold a stream until the event completed or the word
//     reached the value. Work runs only when the driver is called (a query, a synchronisation,
//     an implicitly synchronising call), so a result read before its completion was waited for
//     is stale, as it may be on a GPU;
//   - implicit synchronisation, conservatively: cuMemAlloc/Free, cuMemHostAlloc/FreeHost,
//     cuMemHostRegister/Unregister, cuIpcOpenMemHandle/CloseMemHandle and
//     cuModuleLoadData/Unload first wait until every stream ran all it held when the call
//     began (a real driver may); cuStreamSynchronize and cuEventSynchronize wait for their
//     stream or event. A wait polls with the lock released (another thread may open a gate: a
//     plain store to the word a stream waits on) and gives up after $FAKE_CUDA_SYNC_TIMEOUT_MS
//     (default 10000) with a line on stderr naming the stuck stream and
//     CUDA_ERROR_LAUNCH_TIMEOUT, where a GPU would hang;
//   - kernels are those of csrc/cuda/kernels.cu compiled for the host (cuda_host_shim.h), run
//     by a loop over an emulated grid (blocks x threads, each with its own indices); the
//     module image must start with the fatbin magic (checks the embedding);
//   - legacy IPC: a handle names (exporter pid, its memfd's fd number, size, buffer id);
//     opening one opens /proc/<pid>/fd/<fd> and maps it MAP_SHARED, so an imported pointer is
//     the exporter's memory for copies and kernels alike (a handle whose exporter is gone, or
//     whose fd now holds another allocation, fails to open);
//   - one device, compute capability 9.0, 4 multiprocessors;
//   - device time, for tests of what runs while the device is busy: with
//     $FAKE_CUDA_OP_DELAY_US, a copy or kernel runs no earlier than that long after it was
//     queued (its stream holds until then); fake_cuda_stream_waits() counts the
//     cuStreamWaitValue32 calls.
// Not a model of concurrency: every op runs under one lock in the calling thread.
#include "cuda_host_shim.h"

#include "../../csrc/cuda/kernels.cu"

#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
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
    enum { COPY, KERNEL, RECORD, WAIT_EVENT, WAIT_VALUE, FREE } type;
    void       *dst = nullptr; // COPY's destination, FREE's allocation
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
    std::chrono::steady_clock::time_point ready{}; // COPY, KERNEL: not before (op delay)
    const uint32_t *word = nullptr;
    uint32_t    value = 0;
};

struct Stream {
    std::deque<Op> q;
    // ops ever queued and ever run: a synchronising call waits until popped reaches the
    // pushed it saw on entry; the id survives the stream (the call finds it gone: done)
    unsigned long pushed = 0, popped = 0;
    unsigned long id;
};

// Not recursive: a wait drops the lock, which a nested hold would silently keep.
std::mutex                    mu;
unsigned long                 next_stream_id = 1;
Stream                        legacy{{}, 0, 0, 0};
std::vector<Stream *>         streams{&legacy};
struct Alloc {
    size_t             size;        // as asked for (the range the queries answer)
    size_t             mapped;      // whole pages mapped (memfd) or 0 (heap, cuMemAllocAsync)
    int                fd;          // the memfd, -1 for heap memory
    unsigned long long id;          // buffer id, unique per allocation
    bool               freeing;     // a cuMemFreeAsync of it is queued
};
std::map<uintptr_t, Alloc>    allocs; // device allocations by start
unsigned long long            next_buffer_id = 1;
// IPC: the handle names the exporter's memfd by pid and fd number; the memfd's name holds the
// buffer id, so a handle whose fd was closed and reused for another allocation is refused
struct IpcHandle {
    uint32_t           magic;
    int32_t            pid;
    int32_t            fd;
    uint32_t           pad;
    uint64_t           size;
    unsigned long long id;
};
static_assert(sizeof(IpcHandle) <= sizeof(CUipcMemHandle), "a handle fits");
constexpr uint32_t            IPC_MAGIC = 0x43504946u;
std::map<uintptr_t, size_t>   imports; // an opened handle's mapping: start -> length
thread_local CUcontext        current;
CUcontext const               the_ctx = reinterpret_cast<CUcontext>(0x5ca1ab1e);

Stream *stream_of(CUstream s)
{
    uintptr_t v = reinterpret_cast<uintptr_t>(s);
    if (v == 0 || v == 1 || v == 2) return &legacy; // legacy / per-thread default streams
    return reinterpret_cast<Stream *>(s);
}

size_t page_round(size_t n)
{
    size_t pg = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return (n + pg - 1) / pg * pg;
}

std::string memfd_name(unsigned long long id) { return "fake_cuda:" + std::to_string(id); }

// Releases an allocation's memory and forgets it.
void release(std::map<uintptr_t, Alloc>::iterator it)
{
    void *m = reinterpret_cast<void *>(it->first);
    if (it->second.fd >= 0) {
        munmap(m, it->second.mapped);
        close(it->second.fd);
    } else {
        free(m);
    }
    allocs.erase(it);
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
                if ((op.type == Op::COPY || op.type == Op::KERNEL) &&
                    op.ready != std::chrono::steady_clock::time_point{} &&
                    std::chrono::steady_clock::now() < op.ready)
                    break;
                if (op.type == Op::COPY) memmove(op.dst, op.src, op.n);
                if (op.type == Op::KERNEL) run_kernel(op);
                if (op.type == Op::RECORD) op.ev->done = op.gen;
                if (op.type == Op::FREE) {
                    auto it = allocs.find(reinterpret_cast<uintptr_t>(op.dst));
                    if (it != allocs.end()) release(it);
                }
                s->q.pop_front();
                s->popped++;
                moved = true;
            }
        }
    }
}

unsigned long n_wait_values; // cuStreamWaitValue32 calls (fake_cuda_stream_waits)

CUresult push(CUstream s, const Op &op)
{
    static const long delay_us = [] {
        const char *e = getenv("FAKE_CUDA_OP_DELAY_US");
        return e != nullptr ? atol(e) : 0L;
    }();
    Stream *st = stream_of(s);
    st->q.push_back(op); // runs when the driver is next called
    if (delay_us > 0 && (op.type == Op::COPY || op.type == Op::KERNEL))
        st->q.back().ready = std::chrono::steady_clock::now() + std::chrono::microseconds(delay_us);
    st->pushed++;
    return CUDA_SUCCESS;
}

Stream *stream_by_id(unsigned long id)
{
    for (Stream *s : streams)
        if (s->id == id) return s;
    return nullptr;
}

using Lock = std::unique_lock<std::mutex>;

// Polls (advance(), then done()) with the lock released between polls, so that another
// thread can call in or store to a word a stream waits on; false once
// $FAKE_CUDA_SYNC_TIMEOUT_MS (default 10 s) passed without done().
template <class Done> bool wait_until(Lock &lk, Done done)
{
    const char *env = getenv("FAKE_CUDA_SYNC_TIMEOUT_MS");
    long        ms  = env != nullptr && *env != '\0' ? strtol(env, nullptr, 10) : 10000;
    auto        end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    for (;;) {
        advance();
        if (done()) return true;
        if (std::chrono::steady_clock::now() >= end) return false;
        lk.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(150));
        lk.lock();
    }
}

// The line a GPU would not print: `call` would hang on stream `s`, whose first op cannot run.
void report_hang(const char *call, const Stream *s, const char *why)
{
    char head[160] = "";
    if (!s->q.empty() && s->q.front().type == Op::WAIT_VALUE)
        snprintf(head, sizeof head, "; it waits for the word at %p to reach %u, which holds %u",
                 static_cast<const void *>(s->q.front().word), s->q.front().value,
                 __atomic_load_n(s->q.front().word, __ATOMIC_ACQUIRE));
    else if (!s->q.empty() && s->q.front().type == Op::WAIT_EVENT)
        snprintf(head, sizeof head, "; it waits for event %p, recorded on a stream that is stuck",
                 static_cast<const void *>(s->q.front().ev));
    if (s == &legacy)
        fprintf(stderr, "fake_cuda: %s would hang: the legacy default stream cannot run what was "
                        "queued before the call (%s)%s\n", call, why, head);
    else
        fprintf(stderr, "fake_cuda: %s would hang: stream %p cannot run what was queued before "
                        "the call (%s)%s\n", call, static_cast<const void *>(s), why, head);
}

// What cuMemFree and the other implicitly synchronising calls do first: wait until every
// stream ran all the ops it held on entry (later ones are not waited for).
CUresult implicit_sync(Lock &lk, const char *call)
{
    std::vector<std::pair<unsigned long, unsigned long>> due; // stream id, ops pushed
    const Stream *stuck = nullptr;
    for (const Stream *s : streams)
        due.emplace_back(s->id, s->pushed);
    auto done = [&] {
        for (const auto &d : due) {
            const Stream *s = stream_by_id(d.first); // destroyed: it ran everything
            if (s != nullptr && s->popped < d.second) {
                stuck = s;
                return false;
            }
        }
        return true;
    };
    if (wait_until(lk, done)) return CUDA_SUCCESS;
    report_hang(call, stuck,
                "an implicitly synchronising call while a stream waits for something only the "
                "host can release");
    return CUDA_ERROR_LAUNCH_TIMEOUT;
}

#define LOCK Lock lk(mu)

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
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: *v = 1; break; // cuMemAllocAsync only
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
    st->id     = next_stream_id++;
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
    n_wait_values++;
    return push(s, op);
}
API CUresult cuStreamSynchronize(CUstream s)
{
    LOCK;
    const Stream       *st  = stream_of(s);
    const unsigned long id  = st->id, due = st->pushed;
    auto                done = [&] {
        st = stream_by_id(id);
        return st == nullptr || st->popped >= due;
    };
    if (wait_until(lk, done)) return CUDA_SUCCESS;
    report_hang("cuStreamSynchronize", st, "nothing released what it waits for");
    return CUDA_ERROR_LAUNCH_TIMEOUT;
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
    LOCK;
    const Event        *ev  = reinterpret_cast<Event *>(e);
    const unsigned long due = ev->recorded;
    if (wait_until(lk, [&] { return ev->done >= due; })) return CUDA_SUCCESS;
    for (const Stream *s : streams) // the stream holding the record
        for (const Op &op : s->q)
            if (op.type == Op::RECORD && op.ev == ev) {
                report_hang("cuEventSynchronize", s, "nothing released what it waits for");
                return CUDA_ERROR_LAUNCH_TIMEOUT;
            }
    return CUDA_ERROR_LAUNCH_TIMEOUT;
}
API CUresult cuEventElapsedTime(float *ms, CUevent, CUevent) { *ms = 0; return CUDA_SUCCESS; }
API CUresult cuMemAlloc(CUdeviceptr *p, size_t n)
{
    LOCK;
    NEED_CTX;
    if (n == 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = implicit_sync(lk, "cuMemAlloc");
    if (rc != CUDA_SUCCESS) return rc;
    unsigned long long id  = next_buffer_id++;
    size_t             len = page_round(n);
    int                fd  = memfd_create(memfd_name(id).c_str(), MFD_CLOEXEC);
    if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    void *m = ftruncate(fd, static_cast<off_t>(len)) == 0
                  ? mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                  : MAP_FAILED;
    if (m == MAP_FAILED) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    allocs[reinterpret_cast<uintptr_t>(m)] = Alloc{n, len, fd, id, false};
    *p = reinterpret_cast<CUdeviceptr>(m);
    return CUDA_SUCCESS;
}
API CUresult cuMemFree(CUdeviceptr p)
{
    LOCK;
    NEED_CTX;
    CUresult rc = implicit_sync(lk, "cuMemFree");
    if (rc != CUDA_SUCCESS) return rc;
    auto it = allocs.find(static_cast<uintptr_t>(p));
    if (it == allocs.end() || it->second.freeing) return CUDA_ERROR_INVALID_VALUE;
    release(it);
    return CUDA_SUCCESS;
}
// The stream-ordered allocator, which does not synchronise: heap memory, no IPC.
API CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream)
{
    LOCK;
    NEED_CTX;
    if (n == 0) return CUDA_ERROR_INVALID_VALUE;
    void *m = aligned_alloc(256, (n + 255) / 256 * 256);
    if (m == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    allocs[reinterpret_cast<uintptr_t>(m)] = Alloc{n, 0, -1, next_buffer_id++, false};
    *p = reinterpret_cast<CUdeviceptr>(m);
    return CUDA_SUCCESS;
}
API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
    LOCK;
    NEED_CTX;
    auto it = allocs.find(static_cast<uintptr_t>(p));
    if (it == allocs.end() || it->second.freeing) return CUDA_ERROR_INVALID_VALUE;
    it->second.freeing = true;
    Op op;
    op.type = Op::FREE;
    op.dst  = reinterpret_cast<void *>(p);
    return push(s, op);
}
API CUresult cuMemHostAlloc(void **p, size_t n, unsigned int)
{
    LOCK;
    CUresult rc = implicit_sync(lk, "cuMemHostAlloc");
    if (rc != CUDA_SUCCESS) return rc;
    *p = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
API CUresult cuMemFreeHost(void *p)
{
    LOCK;
    CUresult rc = implicit_sync(lk, "cuMemFreeHost");
    if (rc != CUDA_SUCCESS) return rc;
    free(p);
    return CUDA_SUCCESS;
}
API CUresult cuMemHostGetDevicePointer(CUdeviceptr *d, void *p, unsigned int)
{
    *d = reinterpret_cast<CUdeviceptr>(p);
    return CUDA_SUCCESS;
}
API CUresult cuMemHostRegister(void *, size_t, unsigned int)
{
    LOCK;
    return implicit_sync(lk, "cuMemHostRegister");
}
API CUresult cuMemHostUnregister(void *)
{
    LOCK;
    return implicit_sync(lk, "cuMemHostUnregister");
}
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
// The device allocation holding p, or allocs.end().
std::map<uintptr_t, Alloc>::iterator alloc_of(CUdeviceptr p)
{
    auto it = allocs.upper_bound(static_cast<uintptr_t>(p));
    if (it == allocs.begin()) return allocs.end();
    --it;
    return static_cast<uintptr_t>(p) < it->first + it->second.size ? it : allocs.end();
}
API CUresult cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
    LOCK;
    NEED_CTX;
    auto it = alloc_of(p);
    if (it == allocs.end()) return CUDA_ERROR_NOT_FOUND;
    *base = static_cast<CUdeviceptr>(it->first);
    *size = it->second.size;
    return CUDA_SUCCESS;
}
API CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attr, CUdeviceptr p)
{
    LOCK;
    auto it = alloc_of(p);
    if (it == allocs.end()) return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
        *static_cast<unsigned long long *>(data) = it->second.id;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
        *static_cast<unsigned char *>(data) = it->second.fd >= 0; // a bool, one byte
        return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}
API CUresult cuPointerGetAttributes(unsigned int n, CUpointer_attribute *attrs, void **data, CUdeviceptr p)
{
    LOCK;
    auto it  = alloc_of(p);
    bool dev = it != allocs.end();
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
        case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
            *static_cast<size_t *>(data[i]) = dev ? it->second.size : 0;
            break;
        default: return CUDA_ERROR_INVALID_VALUE;
        }
    }
    return CUDA_SUCCESS;
}
API CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p)
{
    LOCK;
    NEED_CTX;
    auto it = allocs.find(static_cast<uintptr_t>(p)); // the base of an allocation only
    if (it == allocs.end() || it->second.fd < 0) return CUDA_ERROR_INVALID_VALUE;
    IpcHandle v = {IPC_MAGIC, static_cast<int32_t>(getpid()), it->second.fd, 0, it->second.size,
                   it->second.id};
    memset(h, 0, sizeof *h);
    memcpy(h, &v, sizeof v);
    return CUDA_SUCCESS;
}
API CUresult cuIpcOpenMemHandle(CUdeviceptr *p, CUipcMemHandle h, unsigned int)
{
    LOCK;
    NEED_CTX;
    IpcHandle v;
    memcpy(&v, &h, sizeof v);
    if (v.magic != IPC_MAGIC || v.size == 0) return CUDA_ERROR_INVALID_VALUE;
    if (v.pid == static_cast<int32_t>(getpid())) return CUDA_ERROR_INVALID_CONTEXT;
    CUresult rc = implicit_sync(lk, "cuIpcOpenMemHandle");
    if (rc != CUDA_SUCCESS) return rc;
    char path[64], link[256];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", static_cast<int>(v.pid), static_cast<int>(v.fd));
    int fd = open(path, O_RDWR | O_CLOEXEC); // fails once the exporter is gone
    if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
    // what was opened, checked on our own descriptor: the exporter's fd may have been reused
    std::string want = "/memfd:" + memfd_name(v.id) + " ";
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t     k    = readlink(path, link, sizeof link - 1);
    struct stat st;
    size_t      len  = page_round(v.size);
    if (k < 0 || strncmp(link, want.c_str(), want.size()) != 0 || fstat(fd, &st) != 0 ||
        static_cast<size_t>(st.st_size) < len) {
        close(fd);
        return CUDA_ERROR_INVALID_VALUE;
    }
    void *m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd); // the mapping holds the memory
    if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    imports[reinterpret_cast<uintptr_t>(m)] = len;
    *p = reinterpret_cast<CUdeviceptr>(m);
    return CUDA_SUCCESS;
}
API CUresult cuIpcCloseMemHandle(CUdeviceptr p)
{
    LOCK;
    NEED_CTX;
    CUresult rc = implicit_sync(lk, "cuIpcCloseMemHandle");
    if (rc != CUDA_SUCCESS) return rc;
    auto it = imports.find(static_cast<uintptr_t>(p));
    if (it == imports.end()) return CUDA_ERROR_INVALID_VALUE;
    munmap(reinterpret_cast<void *>(it->first), it->second);
    imports.erase(it);
    return CUDA_SUCCESS;
}
API CUresult cuModuleLoadData(CUmodule *m, const void *image)
{
    uint32_t magic;
    LOCK;
    NEED_CTX;
    CUresult rc = implicit_sync(lk, "cuModuleLoadData");
    if (rc != CUDA_SUCCESS) return rc;
    memcpy(&magic, image, 4);
    if (magic != 0xBA55ED50u) return CUDA_ERROR_INVALID_IMAGE; // a fatbin starts so
    *m = reinterpret_cast<CUmodule>(new std::map<std::string, Func *>);
    return CUDA_SUCCESS;
}
API CUresult cuModuleUnload(CUmodule m)
{
    LOCK;
    CUresult rc = implicit_sync(lk, "cuModuleUnload");
    if (rc != CUDA_SUCCESS) return rc;
    auto *tab = reinterpret_cast<std::map<std::string, Func *> *>(m);
    for (auto &f : *tab)
        delete f.second;
    delete tab;
    return CUDA_SUCCESS;
}
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

// Not a driver entry point: how many times a stream was made to wait on a word.
API unsigned long fake_cuda_stream_waits(void)
{
    LOCK;
    return n_wait_values;
}

} // extern "C"
