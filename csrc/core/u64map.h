/* SPDX-License-Identifier: Apache-2.0
 *
 * u64map.h - an open-addressing hash map from nonzero 64-bit keys to pointers: linear probing,
 * backward-shift deletion (no tombstones, so lookups never slow down with churn), grown at 3/4
 * load. Keys must be well mixed already or are mixed here (keys are communicator ids, hashes,
 * or sequence numbers). Not thread-safe: the owner's lock guards it.
 */
#ifndef XCCL_CORE_U64MAP_H
#define XCCL_CORE_U64MAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct xccl_u64map {
    uint64_t *keys; /* 0: empty slot */
    void    **vals;
    size_t    cap; /* power of two, 0 before the first insert */
    size_t    n;
} xccl_u64map_t;

/* The value stored under key, or NULL. key != 0. */
void *xccl_u64map_get(const xccl_u64map_t *m, uint64_t key);
/* Stores val under key (replacing any; a replacement never allocates). Returns 0, or -1 when
 * out of memory (map unchanged). */
int xccl_u64map_put(xccl_u64map_t *m, uint64_t key, void *val);
/* Removes key; returns its value or NULL. */
void *xccl_u64map_del(xccl_u64map_t *m, uint64_t key);
/* Frees the table (not the values). */
void xccl_u64map_free(xccl_u64map_t *m);

#endif /* XCCL_CORE_U64MAP_H */
