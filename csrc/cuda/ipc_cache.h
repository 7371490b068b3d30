/* SPDX-License-Identifier: Apache-2.0
 *
 * ipc_cache.h - CUDA IPC handle caches, pure bookkeeping (no CUDA), of the cuda_ipc transport and
 *   of the CUDA executor's peer access (cuda_peer.c):
 *   - the exporter's: allocation (buffer id) -> its IPC handle, so that a training loop sending
 *     the same tensors every step asks the driver for a handle once per allocation;
 *   - the importer's: (peer, the peer's buffer id) -> where that allocation is mapped here.
 * An allocation is known by its range in its owner's address space and its buffer id, which
 * the driver never reuses in a process: an entry of the same owner whose range overlaps a new
 * one but whose id differs describes memory that was freed (and the range reallocated), so it
 * is stale and goes (the importer closes its mapping). Both caches are bounded (least recently
 * used first out); an importer entry in use by a copy (refs > 0) is never closed under it: it
 * is closed when the last user lets go.
 * Not thread-safe: the transport calls it under the core's lock.
 */
#ifndef XCCL_IPC_CACHE_H
#define XCCL_IPC_CACHE_H

#include <stddef.h>
#include <stdint.h>

#define IPC_HANDLE_BYTES 64 /* CU_IPC_HANDLE_SIZE */

typedef struct ipc_entry {
    struct ipc_entry *next;
    int               peer;   /* owner's rank (-1 in the exporter's cache)                */
    uint64_t          buf_id; /* the owner's buffer id of the allocation                  */
    uint64_t          base;   /* range in the owner's address space                       */
    uint64_t          size;
    void             *mapped; /* importer: where it is mapped here                        */
    uint8_t           handle[IPC_HANDLE_BYTES]; /* exporter: its handle                   */
    int               refs;  /* importer: copies using the mapping                       */
    int               stale; /* out of the cache, closed once refs drops to 0            */
    uint64_t          used;  /* LRU clock                                                */
} ipc_entry_t;

typedef struct ipc_cache {
    ipc_entry_t *live;   /* findable entries                                              */
    ipc_entry_t *zombie; /* stale or evicted entries still referenced                     */
    int          n, cap; /* live entries, and the most kept unreferenced                  */
    uint64_t     clock;
    /* closes an importer's mapping (NULL for the exporter's cache) */
    void (*close)(void *arg, void *mapped);
    void *arg;
    /* statistics (tests) */
    uint64_t hits, misses, stale_dropped, evicted, closed;
} ipc_cache_t;

void ipc_cache_init(ipc_cache_t *c, int cap, void (*close)(void *, void *), void *arg);

/* The entry of (peer, buf_id) whose range is [base, base + size), taking a reference, or NULL.
 * Entries of `peer` whose range overlaps it with another buffer id are stale: dropped (closed
 * now, or when their last reference goes). */
ipc_entry_t *ipc_cache_get(ipc_cache_t *c, int peer, uint64_t buf_id, uint64_t base, uint64_t size);

/* 1 when a live entry of `peer` overlaps [base, base + size), whatever its buffer id; no side
 * effect (unlike ipc_cache_get, which takes the range as the newest allocation there). */
int ipc_cache_overlaps(const ipc_cache_t *c, int peer, uint64_t base, uint64_t size);

/* Adds an entry (with one reference); evicts least recently used unreferenced ones beyond the
 * cap. NULL when out of memory (the caller closes `mapped` itself then). */
ipc_entry_t *ipc_cache_add(ipc_cache_t *c, int peer, uint64_t buf_id, uint64_t base, uint64_t size,
                           void *mapped, const void *handle);

/* Drops a reference taken by get or add. */
void ipc_cache_put(ipc_cache_t *c, ipc_entry_t *e);

/* Closes and frees every entry of `peer` (-2: every entry). Entries still referenced are a
 * caller's bug: they are closed too (the caller waited for its copies first). */
void ipc_cache_drop(ipc_cache_t *c, int peer);

#endif /* XCCL_IPC_CACHE_H */
