/* SPDX-License-Identifier: Apache-2.0
 *
 * fuzz_shm_seg.c - the header of a peer's shared-memory segment (backends/shm/shm_wire.c,
 * xccl_shm_seg_check), which shm.c checks right after mapping the segment a peer named in its
 * address blob: every byte of it is the peer's. Input: [u8 size][u8 rank][u8 peer]
 * [u64 seg_bytes][i32 pid][u64 job id][header bytes...]; the header area (exactly
 * xccl_shm_hdr_bytes(size) bytes, as shm.c guarantees before the check) is filled from the
 * rest.
 *
 * Checked beyond "no crash": an accepted header names the peer, the job, the pid and the size
 * given; its ring size is a power of two of at least SHM_RING_MIN / 2; the ring we write into
 * (control block and data) lies entirely inside the mapped seg_bytes (computed here in 128
 * bits).
 */
#include "fuzz.h"

#include "../../backends/shm/shm_layout.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_in_t      in = {data, size};
    int            nranks, rank, peer;
    uint64_t       seg_bytes, job, hdr;
    int32_t        pid;
    shm_seg_hdr_t *h;
    shm_ring_loc_t loc = {-1, 0};

    nranks    = 1 + (int)(fuzz_take(&in, 1) % 64);
    rank      = (int)(fuzz_take(&in, 1) % (uint64_t)nranks);
    peer      = (int)(fuzz_take(&in, 1) % (uint64_t)nranks);
    seg_bytes = fuzz_take(&in, 8);
    pid       = (int32_t)fuzz_take(&in, 4);
    job       = fuzz_take(&in, 8);
    hdr       = xccl_shm_hdr_bytes(nranks);
    if (seg_bytes < hdr) seg_bytes = hdr; /* shm.c refuses smaller segments before mapping */
    h = calloc(1, (size_t)hdr);
    FUZZ_CHECK(h != NULL, "out of memory");
    memcpy(h, in.p, in.n < hdr ? in.n : (size_t)hdr);

    if (xccl_shm_seg_check(h, seg_bytes, pid, peer, rank, nranks, job, &loc) == 0) {
        unsigned __int128 end;
        FUZZ_CHECK(h->magic == SHM_SEG_MAGIC && h->version == SHM_VERSION && h->rank == peer &&
                       h->size == nranks && h->job_id == job && h->pid == pid &&
                       h->seg_bytes == seg_bytes,
                   "accepted a header that is not the peer's");
        FUZZ_CHECK(loc.idx >= 0 && loc.idx < h->nrings && loc.idx == h->ring_of[rank],
                   "ring index %d of %d", loc.idx, h->nrings);
        FUZZ_CHECK(loc.ring_bytes >= SHM_RING_MIN / 2 &&
                       (loc.ring_bytes & (loc.ring_bytes - 1)) == 0,
                   "ring of %llu bytes", (unsigned long long)loc.ring_bytes);
        end = (unsigned __int128)hdr +
              (unsigned __int128)(loc.idx + 1) * (SHM_CTL_BYTES + (unsigned __int128)loc.ring_bytes);
        FUZZ_CHECK(end <= seg_bytes,
                   "ring %d (%llu bytes, %d rings) ends past the %llu-byte segment", loc.idx,
                   (unsigned long long)loc.ring_bytes, h->nrings, (unsigned long long)seg_bytes);
    }
    free(h);
    return 0;
}
