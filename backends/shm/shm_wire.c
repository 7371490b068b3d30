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
    /* each field read once: the peer may write its header while we look */
    const volatile shm_seg_hdr_t *v          = h;
    uint64_t                      magic      = v->magic;
    uint32_t                      version    = v->version;
    int32_t                       h_rank     = v->rank;
    int32_t                       h_size     = v->size;
    int32_t                       h_pid      = v->pid;
    uint64_t                      h_job      = v->job_id;
    uint64_t                      h_seg      = v->seg_bytes;
    uint64_t                      ring_bytes = v->ring_bytes;
    int32_t                       nrings     = v->nrings;
    uint64_t                      hdr        = xccl_shm_hdr_bytes(size);
    int                           idx;

    if (magic != SHM_SEG_MAGIC || version != SHM_VERSION || h_job != job_id || h_rank != peer ||
        h_size != size || h_pid != pid || h_seg != seg_bytes || seg_bytes < hdr)
        return -1;
    idx = v->ring_of[rank];
    if (idx < 0 || idx >= nrings || ring_bytes < SHM_RING_MIN / 2 ||
        (ring_bytes & (ring_bytes - 1)) != 0 || ring_bytes > seg_bytes ||
        (uint64_t)nrings > (seg_bytes - hdr) / (SHM_CTL_BYTES + ring_bytes))
        return -1; /* every ring inside the segment, computed without overflow */
    loc->idx        = idx;
    loc->ring_bytes = ring_bytes;
    return 0;
}
