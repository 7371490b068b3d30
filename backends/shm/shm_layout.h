/* SPDX-License-Identifier: Apache-2.0
 *
 * shm_layout.h - what the shared-memory transport shares between processes: the address blob
 * published through the store, the segment every rank creates, the rings inside it and the
 * records inside a ring. Every field is in host byte order (all ranks run on one host).
 * Tests include it to check names and lifetimes.
 *
 * Segment of rank R (POSIX shm "/xccl-<job id, 16 hex>-<R>-<pid>", mode 0600, created at init,
 * unlinked as soon as every peer that uses it has mapped it):
 *
 *   offset                 size            what
 *   0                      SHM_HDR_BYTES   shm_seg_hdr_t + ring_of[size] (int32 per rank)
 *   hdr_bytes              ...             nrings x (shm_ring_ctl_t + ring_bytes of data)
 *
 *   The owner holds an OFD write lock on the whole segment file until it exits or finalizes:
 *   peers in another pid namespace test that lock to learn whether it is alive.
 *   hdr_bytes is sizeof(shm_seg_hdr_t) + 4 * size rounded up to 4 KiB. ring_of[s] is the index
 *   of the ring that rank s writes into (-1: s does not reach R through shm). Only R reads its
 *   rings; only s writes ring_of[s] (single producer, single consumer).
 *
 * Ring (byte ring of ring_bytes, a power of two, positions are monotonic uint64 byte counts):
 *   head      bytes published by the producer (always a multiple of SHM_SLOT)
 *   tail      bytes released by the consumer (any value <= head)
 *   cma_done  large messages the consumer has finished pulling with process_vm_readv
 *   A record starts on a SHM_SLOT boundary with one shm_slot_t (never split by the wrap); its
 *   payload, if it has one, follows and may wrap around the end. Kinds:
 *     INLINE  nbytes <= SHM_INLINE_MAX, payload inside the slot              64 bytes
 *     STREAM  slot, then nbytes of payload, padded to SHM_SLOT               64 + pad64(nbytes)
 *             (the producer may publish it in pieces as the consumer frees space)
 *     CMA     slot with the sender's address; the receiver pulls the payload 64 bytes
 *             straight from the sender with process_vm_readv, then bumps cma_done
 *
 * Ordering: the producer writes bytes, then stores head (release); the consumer loads head
 * (acquire), reads, then stores tail / cma_done (release).
 */
#ifndef XCCL_BACKENDS_SHM_LAYOUT_H
#define XCCL_BACKENDS_SHM_LAYOUT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "xccl/xccl_transport.h"

#define SHM_VERSION    3
#define SHM_SEG_MAGIC  0x324d48534c434358ull /* "XCCLSHM2" as a little-endian uint64 */
#define SHM_ADDR_MAGIC "XSHA"
#define SHM_NAME_MAX   64
#define SHM_LINE       64
#define SHM_SLOT       64  /* record alignment and slot size                              */
#define SHM_INLINE_MAX 24  /* payload bytes carried inside an INLINE slot                 */
#define SHM_CTL_BYTES  512 /* shm_ring_ctl_t, padded; the ring's data follows            */
#define SHM_WHY_LEN    320 /* shm_ring_ctl_t.why                                          */
#define SHM_NAME_PREFIX "xccl-"
#define SHM_RING_MIN   ((uint64_t)128 << 10) /* default ring size floor; peers' rings are at
                                                least half of it                          */

/* Address blob (SHM_ADDR_LEN bytes). */
typedef struct shm_addr {
    char     magic[4]; /* SHM_ADDR_MAGIC                                               */
    uint16_t version;  /* SHM_VERSION                                                  */
    uint16_t reserved; /* 0                                                            */
    uint64_t job_id;
    int32_t  rank;
    int32_t  pid;       /* as the owner sees itself (getpid)                           */
    uint64_t seg_bytes; /* size of its segment                                         */
    uint64_t pid_ns;    /* inode of its pid namespace (0: unknown)                     */
    char     name[SHM_NAME_MAX]; /* shm_open name, NUL-terminated                      */
} shm_addr_t;
#define SHM_ADDR_LEN sizeof(shm_addr_t)

/* shm_ring_ctl_t.closed: set by the producer when it finalizes or gives up on the consumer;
 * the consumer fails the pair when it sees it. */
enum {
    SHM_OPEN      = 0,
    SHM_FINALIZED = 1, /* the producer's context was finalized                             */
    SHM_DROPPED   = 2, /* the producer gave up on this peer (timeout, refused message)     */
};

/* shm_ring_ctl_t.cma: decided by the consumer at wire-up, before it sets `attached`. */
enum { SHM_CMA_UNKNOWN = 0, SHM_CMA_ON = 1, SHM_CMA_OFF = 2 };

/* Record kinds (shm_slot_t.kind). */
enum { SHM_REC_INLINE = 1, SHM_REC_STREAM = 2, SHM_REC_CMA = 3 };

typedef struct shm_ring_ctl {
    /* line 0, written by the producer */
    _Alignas(SHM_LINE) _Atomic uint64_t head;
    _Atomic uint32_t prod_wants; /* 1: the producer waits for tail or cma_done to move     */
    /* line 1, written by the consumer */
    _Alignas(SHM_LINE) _Atomic uint64_t tail;
    _Atomic uint64_t cma_done;
    /* line 2, rarely written */
    _Alignas(SHM_LINE) _Atomic uint32_t closed; /* SHM_OPEN / SHM_FINALIZED / SHM_DROPPED */
    _Atomic uint32_t cma;      /* SHM_CMA_*: may the producer send CMA records           */
    _Atomic uint32_t attached; /* the producer has mapped this segment                    */
    _Atomic uint32_t poke;     /* the producer reaches the consumer's wake socket: set
                                  before `attached`                                       */
    /* lines 3-7: why the producer dropped the pair (SHM_DROPPED), NUL-terminated; written
     * once, before `closed` is set (seq_cst), and read only after `closed` was seen (acquire),
     * so a rank that gives up on an operation because a third rank died can name that rank
     * to the peers it drops even while a record of theirs sits unread in the ring */
    _Alignas(SHM_LINE) char why[SHM_WHY_LEN];
} shm_ring_ctl_t;

typedef struct shm_seg_hdr {
    /* line 0: identity, written once by the owner before its address is published */
    uint64_t magic; /* SHM_SEG_MAGIC                                                    */
    uint32_t version;
    int32_t  rank;
    int32_t  size;
    int32_t  pid;
    uint64_t job_id;
    uint64_t seg_bytes;
    uint64_t ring_bytes;  /* data bytes of every ring in this segment (power of two)    */
    uint64_t probe_addr;  /* address, in the owner, of a word equal to probe_value      */
    uint64_t probe_value; /* (a peer's process_vm_readv of it proves CMA works)         */
    uint64_t pid_ns;      /* inode of the owner's pid namespace (0: unknown)           */
    /* line 1: waking the owner (the futex word, the number of its threads sleeping on it and
     * of those polling its wake socket instead; see shm.c, Waiting) */
    _Alignas(SHM_LINE) _Atomic uint32_t bell;
    _Atomic uint32_t sleepers;
    _Atomic uint32_t pollers; /* owner's threads in the core's poll over transports       */
    /* line 2 */
    _Alignas(SHM_LINE) int32_t nrings;
    _Alignas(SHM_LINE) int32_t ring_of[]; /* size entries                                */
} shm_seg_hdr_t;

typedef struct shm_slot {
    uint32_t       kind; /* SHM_REC_*                                                    */
    uint32_t       reserved;
    xccl_msg_hdr_t hdr;
    union {
        uint64_t      addr;                 /* CMA: payload address in the sender      */
        unsigned char data[SHM_INLINE_MAX]; /* INLINE: the payload                     */
    } u;
} shm_slot_t;

_Static_assert(sizeof(shm_slot_t) == SHM_SLOT, "a slot is one cache line");
_Static_assert(sizeof(shm_ring_ctl_t) <= SHM_CTL_BYTES, "ring control fits its area");
_Static_assert(sizeof(shm_addr_t) <= XCCL_TP_ADDR_MAX, "address blob fits");
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_INT_LOCK_FREE == 2,
               "atomics shared between processes must be lock-free");

/* The parsers of what other processes wrote (shm_wire.c; tests/fuzz drives them). */

/* Bytes of a segment's header area for `size` ranks (a multiple of 4 KiB). */
uint64_t xccl_shm_hdr_bytes(int size);

/* Decodes an address blob from the store into *a (name NUL-terminated): 0, or -1. */
int xccl_shm_addr_decode(const void *blob, size_t len, shm_addr_t *a);

/* Where the ring we write into lies in a peer's segment. */
typedef struct shm_ring_loc {
    int      idx;        /* ring index                                   */
    uint64_t ring_bytes; /* its data bytes (power of two)                 */
} shm_ring_loc_t;

/* Checks the header of the segment of rank `peer` (its owner, pid `pid` per the address blob)
 * as mapped by `rank` of `size` in job `job_id`: seg_bytes are mapped at h, at least
 * xccl_shm_hdr_bytes(size). 0 and *loc set when it is that rank's segment and the ring of
 * `rank` lies inside it; -1 otherwise. */
int xccl_shm_seg_check(const shm_seg_hdr_t *h, uint64_t seg_bytes, int32_t pid, int peer,
                       int rank, int size, uint64_t job_id, shm_ring_loc_t *loc);

#endif /* XCCL_BACKENDS_SHM_LAYOUT_H */
