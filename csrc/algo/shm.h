/* SPDX-License-Identifier: Apache-2.0
 *
 * shm.h - the layout of the node-shared segment and the protocol the one-host algorithms
 * (shm.c: through slots in the segment; shm_cma.c: pulling from peers' buffers) share. The
 * contract with the core is "Node-shared memory" in core/task.h.
 *
 * Segment layout for n ranks (identical everywhere, every rank maps it at its own address, so
 * nothing in it is a pointer into the segment):
 *
 *   [ctl 0][ctl 1] ... [ctl n-1]                  n x SHM_CTL_BYTES, one per rank
 *   [slot 0 even][slot 0 odd] ... [slot n-1 odd]  n x 2 x SHM_SLOT_BYTES
 *
 * Only rank r writes ctl r and slot r. Epoch e (task.h) uses parity p = e & 1 of a rank's
 * double-buffered words (flag, sig, addr) and data slot; nothing is ever reset:
 *
 *   flag[p] = e   (release) rank r published epoch e: sig[p], addr[p] and its slot of parity
 *                 p hold epoch e's values
 *   done    = e   (release) rank r has finished reading every peer's slot and buffers of e
 *   prog    = stamp(e, v)   rank r's progress inside e (chunks ready), monotonic across
 *                 epochs because the epoch is in the high bits
 *
 * Reuse rule: before rank r writes parity p for epoch e it waits until every rank's done is at
 * least e - 2, i.e. nobody still reads what r wrote for epoch e - 2 (a rank may be granted e
 * while a peer finishes e - 1, task.h). Algorithms that expose their operation buffers to
 * cross-memory reads do not complete before every reader's done reached e.
 *
 * sig[p]: the call as this rank made it (collective, dtype, op, root, count, algorithm, and the
 * pipeline's chunk, which must agree for the progress counters to mean the same); every
 * rank compares the signature of each peer it reads with its own, so ranks that call different
 * collectives (or force different algorithms) fail with XCCL_ERR_MISMATCH naming both calls
 * instead of reading wrong data.
 *
 * Waiting: a rank whose flag, done or prog of interest is not there yet calls
 * xccl_task_shared_wait naming that rank and returns XCCL_INPROGRESS; every publication is
 * followed by xccl_task_shared_signal.
 */
#ifndef XCCL_ALGO_SHM_H
#define XCCL_ALGO_SHM_H

#include <stdatomic.h>
#include <stdint.h>

#include "algo/algo.h"

#define SHM_CTL_BYTES  128               /* two cache lines: no false sharing between ranks */
#define SHM_SLOT_BYTES ((size_t)8 << 10) /* data slot per rank and parity                 */
/* Pipelining unit of the cross-memory algorithms (every rank must see the same value). */
#define SHM_CHUNK_ENV     "XCCL_SHM_CHUNK_BYTES"
#define SHM_CHUNK_DEFAULT ((size_t)256 << 10)
#define SHM_STAMP_BITS    24 /* prog = epoch << 24 | value; values stay below 2^24 */

typedef struct shm_ctl {
    _Atomic uint64_t flag[2];
    _Atomic uint64_t done;
    _Atomic uint64_t prog;
    uint64_t         sig[2][3];  /* [parity][0: packed call, 1: count, 2: chunk]       */
    uint64_t         addr[2][2]; /* [parity][0: sbuf, 1: rbuf or scratch] in r's space */
} shm_ctl_t;

_Static_assert(sizeof(shm_ctl_t) <= SHM_CTL_BYTES, "shm_ctl_t outgrew its cache lines");

/* One progress call's view of the segment. */
typedef struct shm {
    xccl_task_t            *t;
    const xccl_coll_args_t *a;
    uint64_t               *st; /* the task's state words                                */
    unsigned char          *base;
    uint64_t                e;
    int                     p, rank, size, id;
    size_t                  es;
    uint64_t                chunk; /* elements per pipeline chunk (cma), 0 otherwise        */
} shm_t;

/* Returns the status of `call` unless it is XCCL_OK (XCCL_INPROGRESS included). */
#define SHM_TRY(call)                                                                              \
    do {                                                                                           \
        xccl_status_t shm_st_ = (call);                                                            \
        if (shm_st_ != XCCL_OK) return shm_st_;                                                    \
    } while (0)

/* State words shared by every algorithm: st[0] = phase, st[1] = a rank cursor. */
enum { SHM_PHASE = 0, SHM_CURSOR = 1 };

static inline shm_ctl_t *shm_ctl(const shm_t *x, int q)
{
    return (shm_ctl_t *)(void *)(x->base + (size_t)q * SHM_CTL_BYTES);
}

/* Rank q's data slot of this epoch's parity. */
static inline unsigned char *shm_slot(const shm_t *x, int q)
{
    return x->base + (size_t)x->size * SHM_CTL_BYTES +
           ((size_t)q * 2 + (size_t)x->p) * SHM_SLOT_BYTES;
}

static inline uint64_t shm_stamp(uint64_t e, uint64_t v)
{
    return e << SHM_STAMP_BITS | v;
}

/* Segment bytes for n ranks. */
size_t shm_segment_bytes(int n);

/* Whether the one-host algorithms can run these arguments: a segment (and cross-memory reads
 * with `cma`), host memory. */
int shm_usable(const xccl_coll_args_t *a, int cma);

/* Starts a progress call: XCCL_OK with *x filled once the segment is granted, XCCL_INPROGRESS
 * before. `id` identifies the algorithm in signatures. (Which memory an algorithm takes is its
 * `applicable`'s business: shm_usable for the host-memory ones.) */
xccl_status_t shm_begin(xccl_task_t *t, int id, shm_t *x);

/* Waits (cursor in st[SHM_CURSOR], reset to 0 when it returns XCCL_OK) until every rank's done
 * is at least e - min_lag: 2 before writing parity p (the reuse rule), 0 at completion. A peer
 * done with e may already have published e + 2 over e's words of parity p: signatures are
 * checked before this rank's own done (which holds every peer below e + 2), never here. */
xccl_status_t shm_wait_done(shm_t *x, uint64_t min_lag);

/* Publishes this rank's signature, addresses (a0, a1) and flag for the epoch, and signals. */
void shm_publish(shm_t *x, uint64_t a0, uint64_t a1);

/* 1 when rank q published the epoch (its signature checked: XCCL_ERR_MISMATCH otherwise), 0
 * after xccl_task_shared_wait(q) when not yet; negative on a mismatch. */
int shm_ready(shm_t *x, int q);

/* 1 when rank q's prog reached stamp(e, v), else 0 after xccl_task_shared_wait(q). */
int shm_prog_ready(shm_t *x, int q, uint64_t v);

/* This rank's prog = stamp(e, v), signalled. */
void shm_set_prog(shm_t *x, uint64_t v);

/* This rank has read everything of the epoch: done = e, signalled. */
void shm_set_done(shm_t *x);

/* Chunk elements of the cross-memory pipelines for `count` elements (at most 2^20 chunks). */
size_t shm_chunk_elems(size_t count, size_t es);

/* Algorithm identities in signatures (names in shm.c's table). */
enum {
    SHM_ID_SLOT = 0, /* + coll: the slot algorithms of shm.c                             */
    SHM_ID_CMA  = 16, /* + coll: the cross-memory algorithms of shm_cma.c                */
    SHM_ID_DEV  = 32  /* + coll: the device-memory algorithms of shm_dev.c                */
};


#endif /* XCCL_ALGO_SHM_H */
