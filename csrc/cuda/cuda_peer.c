/* SPDX-License-Identifier: Apache-2.0
 *
 * cuda_peer.c - the CUDA executor's peer access (exec.h export_mem / import_mem): device
 * buffers shared between the processes of a host with legacy CUDA IPC handles, for the
 * algorithms that read and write peers' buffers (csrc/algo/shm_dev.c, "devmap").
 *
 * A blob names the allocation (its owner's pid, buffer id and range), the IPC handle and where
 * the exported pointer lies in it. Both sides cache (cuda/ipc_cache.h): the exporter asks the
 * driver for a handle once per allocation (buffer ids are never reused in a process), the
 * importer opens each allocation once and keeps it mapped; an entry of the same owner whose
 * range overlaps a new allocation with another buffer id is stale (the owner freed it) and its
 * mapping is closed. The importer's cache keeps IMPORT_CAP mappings, least recently used out:
 * an operation maps at most its peers' buffers, far fewer, and uses them right away, so the
 * entries an operation in flight uses are never the least recently used.
 *
 * Opening a handle may synchronise the device (cuda_lib.h): while a stream waits for a gate,
 * import_mem answers XCCL_INPROGRESS (the algorithm falls back to messages for that call) and
 * keeps the blob; the next device operation posted opens it, if no stream waits then
 * (xccl_cuda_peer_warm), so that a training loop whose first steps waited early maps its
 * buffers for the steps after. A kept blob may describe memory its owner has freed since: it
 * is forgotten once anything of that owner overlapping it is mapped (that is newer, or the
 * same), and never looked up in a way that would retire a newer mapping as stale. A process
 * whose streams always wait for some operation never gets to map: after REFUSALS_WARN
 * refusals in a row it says so, once.
 *
 * Memory legacy IPC cannot export (cudaMallocAsync pools, VMM allocations such as PyTorch's
 * expandable segments) answers XCCL_ERR_NOT_SUPPORTED: the algorithm then falls back to
 * messages. Thread-safe (one lock): contexts may call from their own threads.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "core/check.h"
#include "cuda/cuda_exec.h"
#include "cuda/ipc_cache.h"

#define BLOB_MAGIC  0x78636370u /* "xccp" */
#define EXPORT_CAP  1024
#define IMPORT_CAP  1024
#define PENDING_CAP    64  /* blobs refused for now, to open later (newest kept) */
#define REFUSALS_WARN  256 /* refusals in a row before the one warning           */

typedef struct peer_blob {
    uint32_t magic;
    int32_t  pid;
    uint64_t buf_id;
    uint64_t base, size; /* the allocation in the owner's address space */
    uint64_t offset;     /* of the exported pointer in it               */
    uint8_t  handle[IPC_HANDLE_BYTES];
} peer_blob_t;

_Static_assert(sizeof(peer_blob_t) <= XCCL_EXEC_BLOB_MAX, "peer_blob_t outgrew a blob");
_Static_assert(sizeof(CUipcMemHandle) == IPC_HANDLE_BYTES, "CUDA IPC handle size");

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static ipc_cache_t     exported, imported;
static int             caches_ready;
static peer_blob_t     pending[PENDING_CAP];
static int             npending;
static _Atomic int     any_pending; /* npending > 0, read without mu */
static unsigned        refusals;    /* in a row                      */
static int             warned;

static void close_mapping(void *arg, void *mapped)
{
    (void)arg;
    xccl_cuda_ipc_close(mapped);
}

static void caches_init(void)
{
    if (caches_ready) return;
    ipc_cache_init(&exported, EXPORT_CAP, NULL, NULL);
    ipc_cache_init(&imported, IMPORT_CAP, close_mapping, NULL);
    caches_ready = 1;
}

xccl_status_t xccl_cuda_export_mem(const void *ptr, size_t nbytes, void *blob, size_t *len)
{
    uint64_t     base = 0, size = 0, id = 0;
    int          ipc  = 0;
    peer_blob_t  b;
    ipc_entry_t *e;
    CUresult     rc;
    uintptr_t    p = (uintptr_t)ptr;

    /* memory the driver cannot describe, or legacy IPC cannot export: the caller falls back */
    if (xccl_cuda_alloc_info(ptr, &base, &size, &id, &ipc) != XCCL_OK || !ipc || size == 0 ||
        p < base || p + nbytes > base + size)
        return XCCL_ERR_NOT_SUPPORTED;
    memset(&b, 0, sizeof(b));
    b.magic  = BLOB_MAGIC;
    b.pid    = (int32_t)getpid();
    b.buf_id = id;
    b.base   = base;
    b.size   = size;
    b.offset = p - base;
    pthread_mutex_lock(&mu);
    caches_init();
    e = ipc_cache_get(&exported, -1, id, base, size);
    if (e == NULL) {
        CUipcMemHandle h;
        rc = xccl_cu.IpcGetMemHandle(&h, (CUdeviceptr)base);
        if (rc != CUDA_SUCCESS) {
            pthread_mutex_unlock(&mu);
            /* e.g. memory of a context without IPC: not shareable rather than an error */
            return rc == CUDA_ERROR_INVALID_VALUE || rc == CUDA_ERROR_NOT_SUPPORTED
                       ? XCCL_ERR_NOT_SUPPORTED
                       : xccl_cuda_fail(rc, "cuIpcGetMemHandle");
        }
        memcpy(b.handle, h.reserved, IPC_HANDLE_BYTES);
        e = ipc_cache_add(&exported, -1, id, base, size, NULL, b.handle);
    } else {
        memcpy(b.handle, e->handle, IPC_HANDLE_BYTES);
    }
    if (e != NULL) ipc_cache_put(&exported, e);
    pthread_mutex_unlock(&mu);
    memcpy(blob, &b, sizeof(b));
    *len = sizeof(b);
    return XCCL_OK;
}

/* Opens b's handle into the importer's cache (a reference taken). Under mu, between
 * xccl_cuda_sync_begin and _end. */
static xccl_status_t open_into_cache(const peer_blob_t *b, ipc_entry_t **out)
{
    CUipcMemHandle h;
    CUdeviceptr    m = 0;
    CUresult       rc;

    memcpy(h.reserved, b->handle, IPC_HANDLE_BYTES);
    rc = xccl_cu.IpcOpenMemHandle(&m, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (rc != CUDA_SUCCESS) return xccl_cuda_fail(rc, "cuIpcOpenMemHandle (a peer's buffer)");
    *out = ipc_cache_add(&imported, b->pid, b->buf_id, b->base, b->size, (void *)(uintptr_t)m,
                         NULL);
    if (*out == NULL) {
        close_mapping(NULL, (void *)(uintptr_t)m);
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "cuda import: out of memory");
    }
    return XCCL_OK;
}

/* Forgets the kept blobs of `pid` overlapping [base, base + size). Under mu. */
static void pending_drop(int32_t pid, uint64_t base, uint64_t size)
{
    int n = 0;

    for (int i = 0; i < npending; i++)
        if (pending[i].pid != pid || base >= pending[i].base + pending[i].size ||
            pending[i].base >= base + size)
            pending[n++] = pending[i];
    npending = n;
    if (n == 0) atomic_store_explicit(&any_pending, 0, memory_order_relaxed);
}

/* Keeps a refused blob for xccl_cuda_peer_warm, as the newest (the oldest goes). Under mu. */
static void pending_add(const peer_blob_t *b)
{
    pending_drop(b->pid, b->base, b->size); /* an older blob of that range, or this one */
    if (npending == PENDING_CAP) memmove(pending, pending + 1, --npending * sizeof(*pending));
    pending[npending++] = *b;
    atomic_store_explicit(&any_pending, 1, memory_order_relaxed);
    if (++refusals == REFUSALS_WARN && !warned) {
        warned = 1;
        XCCL_WARN("cuda: %u mappings of peers' buffers in a row were refused because a stream "
                  "always waited for an xccl operation: the one-host collectives run through "
                  "messages instead (slower). A synchronisation now and then, or "
                  "XCCL_CUDA_WAIT=cpu, lets them map their buffers.", refusals);
    }
}

void xccl_cuda_peer_warm(void)
{
    if (!atomic_load_explicit(&any_pending, memory_order_relaxed) ||
        xccl_cuda_enter() != XCCL_OK)
        return;
    pthread_mutex_lock(&mu);
    if (npending > 0 && xccl_cuda_sync_begin()) {
        for (int i = 0; i < npending; i++) {
            const peer_blob_t *b = &pending[i];
            ipc_entry_t       *e = NULL;
            /* mapped meanwhile, or something newer of that owner is: nothing to do (see top) */
            if (ipc_cache_overlaps(&imported, b->pid, b->base, b->size)) continue;
            /* a failure (the owner freed it meanwhile, say) only means no head start */
            if (open_into_cache(b, &e) != XCCL_OK)
                XCCL_TRACE("cuda import: opening a peer's buffer ahead: %s", xccl_last_error());
            else ipc_cache_put(&imported, e);
        }
        npending = 0;
        atomic_store_explicit(&any_pending, 0, memory_order_relaxed);
        xccl_cuda_sync_end();
    }
    pthread_mutex_unlock(&mu);
}

xccl_status_t xccl_cuda_import_mem(const void *blob, size_t len, void **ptr)
{
    peer_blob_t   b;
    ipc_entry_t  *e;
    xccl_status_t st;

    if (len != sizeof(b))
        return XCCL_ERROR(XCCL_ERR_INTERNAL, "cuda import: a blob of %zu bytes", len);
    memcpy(&b, blob, sizeof(b));
    if (b.magic != BLOB_MAGIC || b.offset > b.size)
        return XCCL_ERROR(XCCL_ERR_INTERNAL, "cuda import: not an export blob");
    XCCL_CHECK(xccl_cuda_enter());
    if (b.pid == (int32_t)getpid()) { /* our own memory */
        *ptr = (void *)(uintptr_t)(b.base + b.offset);
        return XCCL_OK;
    }
    pthread_mutex_lock(&mu);
    caches_init();
    e = ipc_cache_get(&imported, b.pid, b.buf_id, b.base, b.size);
    if (e == NULL) {
        if (!xccl_cuda_sync_begin()) { /* a stream waits for a gate: not now (see the top) */
            pending_add(&b);
            pthread_mutex_unlock(&mu);
            return XCCL_INPROGRESS;
        }
        st = open_into_cache(&b, &e);
        xccl_cuda_sync_end();
        if (st != XCCL_OK) {
            pthread_mutex_unlock(&mu);
            return st;
        }
    }
    *ptr = (char *)e->mapped + b.offset;
    ipc_cache_put(&imported, e); /* kept mapped by the cache (see the top) */
    refusals = 0;
    if (npending > 0) pending_drop(b.pid, b.base, b.size);
    pthread_mutex_unlock(&mu);
    return XCCL_OK;
}
