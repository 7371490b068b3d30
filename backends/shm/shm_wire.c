/* SPDX-License-Identifier: Apache-2.0
 *
 * shm_wire.c - the shared-memory transport's parsers of what other processes wrote
 * (shm_layout.h): the address blob read from the store and the header of a peer's segment. No
 * mapping and no context here, so that tests/fuzz drives exactly the code shm.c runs.
 */
#include <string.h>

#include "shm_layout.h"

uint64_t xccl_shm_hdr_bytes(int size)
{
    uint64_t n = sizeof(shm_seg_hdr_t) + 4 * (uint64_t)size;
    return (n + 4095) & ~(uint64_t)4095;
}

int xccl_shm_addr_decode(const void *blob, size_t len, shm_addr_t *a)
{
    if (blob == NULL || len != SHM_ADDR_LEN) return -1;
    memcpy(a, blob, sizeof(*a));
    if (memcmp(a->magic, SHM_ADDR_MAGIC, 4) != 0 || a->version != SHM_VERSION) return -1;
    a->name[SHM_NAME_MAX - 1] = '\0';
    return 0;
}

int xccl_shm_seg_check(const shm_seg_hdr_t *h, uint64_t seg_bytes, int32_t pid, int peer,
                       int rank, int size, uint64_t job_id, shm_ring_loc_t *loc)
{
    int idx = h->rank == peer && h->size == size && h->rank >= 0 ? h->ring_of[rank] : -1;

    if (h->magic != SHM_SEG_MAGIC || h->version != SHM_VERSION || h->job_id != job_id ||
        h->rank != peer || h->pid != pid || h->seg_bytes != seg_bytes || idx < 0 ||
        idx >= h->nrings || h->ring_bytes < SHM_RING_MIN / 2 ||
        (h->ring_bytes & (h->ring_bytes - 1)) != 0 ||
        xccl_shm_hdr_bytes(h->size) + (uint64_t)h->nrings * (SHM_CTL_BYTES + h->ring_bytes) >
            h->seg_bytes)
        return -1;
    loc->idx        = idx;
    loc->ring_bytes = h->ring_bytes;
    return 0;
}
