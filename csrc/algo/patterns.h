/* SPDX-License-Identifier: Apache-2.0
 *
 * patterns.h - rank arithmetic shared by the collective algorithms: blocks of a vector, ring
 * neighbours and block indices, the fold of non-power-of-two groups onto a power of two,
 * recursive doubling / halving partners, binomial trees for any root, Bruck offsets, pairwise
 * exchange partners and the round schedule of a pipelined ring.
 *
 * Everything here is a pure function of its integer arguments (no communication, no state),
 * so it is unit-tested on its own (tests/c/test_algos.c). Ranks are ints in [0, n), n >= 1.
 */
#ifndef XCCL_ALGO_PATTERNS_H
#define XCCL_ALGO_PATTERNS_H

#include <stddef.h>
#include <stdint.h>

#include "algo/algo.h"
#include "core/check.h"

/* ---------------------------------------------------------------------------------------------
 * Integers
 * ------------------------------------------------------------------------------------------- */

/* a mod n in [0, n) for any sign of a. */
static inline int xccl_pat_mod(int a, int n)
{
    int m = a % n;
    return m < 0 ? m + n : m;
}

static inline int xccl_pat_is_pow2(int n) { return n > 0 && (n & (n - 1)) == 0; }

/* floor(log2 n) for n >= 1. */
static inline int xccl_pat_log2_floor(int n)
{
    int k = 0;
    while ((n >> (k + 1)) != 0) k++;
    return k;
}

/* ceil(log2 n) for n >= 1 (0 for n = 1). */
static inline int xccl_pat_log2_ceil(int n)
{
    int k = xccl_pat_log2_floor(n);
    return (1 << k) < n ? k + 1 : k;
}

/* Largest power of two <= n (n >= 1). */
static inline int xccl_pat_pow2_floor(int n) { return 1 << xccl_pat_log2_floor(n); }

static inline size_t xccl_pat_min(size_t a, size_t b) { return a < b ? a : b; }

/* ---------------------------------------------------------------------------------------------
 * Blocks: `count` elements split into n nearly equal blocks. The first count % n blocks hold
 * one element more than the others; blocks may be empty when count < n. Block i covers
 * [xccl_pat_block_off(count, n, i), xccl_pat_block_off(count, n, i + 1)).
 * ------------------------------------------------------------------------------------------- */
static inline size_t xccl_pat_block_off(size_t count, int n, int i)
{
    size_t q = count / (size_t)n, r = count % (size_t)n;
    return (size_t)i * q + xccl_pat_min((size_t)i, r);
}

static inline size_t xccl_pat_block_count(size_t count, int n, int i)
{
    return count / (size_t)n + ((size_t)i < count % (size_t)n ? 1 : 0);
}

/* Largest block: ceil(count / n). */
static inline size_t xccl_pat_block_max(size_t count, int n)
{
    return count / (size_t)n + (count % (size_t)n != 0 ? 1 : 0);
}

/* Latency, in α units, charged to one round in which a rank exchanges messages with all n-1
 * peers at once (the "direct" algorithms): the messages are in flight together, so the
 * latency is paid once, plus α/8 of per-message work for each further peer. (Measured on
 * loopback, such a round costs about one α for a handful of ranks; a one-port model's n-1
 * would rule the direct algorithms out everywhere.) */
static inline double xccl_pat_direct_steps(int n) { return n <= 1 ? 0 : 1 + (n - 2) / 8.0; }

/* ---------------------------------------------------------------------------------------------
 * Ring: rank r sends to r+1 and receives from r-1. Over n-1 steps s = 0..n-2,
 *
 *   reduce-scatter: send block (r-s-1), receive block (r-s-2) and reduce it into the local
 *                   copy; after step n-2 rank r holds the complete block r;
 *   all-gather:     send block (r-s), receive block (r-s-1); rank r starts with block r.
 *
 * The block received at step s is the one sent at step s+1, so a chain carries each block
 * around the ring (all indices mod n).
 * ------------------------------------------------------------------------------------------- */
static inline int xccl_pat_ring_next(int rank, int n) { return xccl_pat_mod(rank + 1, n); }
static inline int xccl_pat_ring_prev(int rank, int n) { return xccl_pat_mod(rank - 1, n); }

static inline int xccl_pat_ring_rs_send_block(int rank, int n, int s)
{
    return xccl_pat_mod(rank - s - 1, n);
}
static inline int xccl_pat_ring_rs_recv_block(int rank, int n, int s)
{
    return xccl_pat_mod(rank - s - 2, n);
}
static inline int xccl_pat_ring_ag_send_block(int rank, int n, int s)
{
    return xccl_pat_mod(rank - s, n);
}
static inline int xccl_pat_ring_ag_recv_block(int rank, int n, int s)
{
    return xccl_pat_mod(rank - s - 1, n);
}

/* ---------------------------------------------------------------------------------------------
 * Pipelined ring schedule. A ring collective is `nsteps` ring steps, each moving one block cut
 * into `nchunks` chunks. Chunk c of step s can be sent once chunk c of step s-1 has arrived
 * and, for the first `nred` steps (reduce-scatter steps), been reduced. The algorithm works
 * in rounds: in round k it posts every (step s, chunk c) with c = k - start(s), waits for
 * them all, then goes on. A reduction step is given two rounds (lag 2) when the block is
 * chunked: the chunks received in round k-1 are reduced in round k *after* round k's messages
 * are posted, overlapping the reduction with the transfer; other steps have lag 1.
 *
 *   start(s) = s * lag                       for s <= nred
 *            = nred * lag + (s - nred)       for s >  nred
 *   rounds   = start(nsteps - 1) + nchunks
 *
 * The message of (s, c) carries step number s * nchunks + c (see xccl_pat_ring_nchunks for
 * the bound that keeps it below 2^20). An all-reduce on 3 ranks (4 steps, the first 2 of
 * them reductions) with 3 chunks per block:
 *
 *   round    0   1   2   3   4   5   6   7
 *   step 0   c0  c1  c2
 *   step 1           c0  c1  c2
 *   step 2                   c0  c1  c2
 *   step 3                       c0  c1  c2
 * ------------------------------------------------------------------------------------------- */
typedef struct xccl_pat_pipe {
    int nsteps;  /* ring steps                                    */
    int nred;    /* the first nred steps reduce what they receive */
    int nchunks; /* chunks per block                              */
    int lag;     /* rounds between two reduction steps            */
} xccl_pat_pipe_t;

#define XCCL_PAT_RING_MAX_CHUNKS 1024
/* Chunk size of the pipelined rings, in bytes: $XCCL_RING_CHUNK_BYTES, 512 KiB by default.
 * Every rank must see the same value. */
#define XCCL_PAT_RING_CHUNK_ENV     "XCCL_RING_CHUNK_BYTES"
#define XCCL_PAT_RING_CHUNK_DEFAULT (512 * 1024)

/* Chunks per block: enough for chunks of at most chunk_bytes, at most XCCL_PAT_RING_MAX_CHUNKS
 * (bigger blocks get bigger chunks) and few enough that nsteps * nchunks <= step_limit. */
static inline int xccl_pat_ring_nchunks(size_t block_bytes, size_t chunk_bytes, int nsteps,
                                        uint32_t step_limit)
{
    size_t c = chunk_bytes == 0 ? 1 : (block_bytes + chunk_bytes - 1) / chunk_bytes;
    size_t cap = nsteps > 0 ? (size_t)step_limit / (size_t)nsteps : 1;

    if (c > XCCL_PAT_RING_MAX_CHUNKS) c = XCCL_PAT_RING_MAX_CHUNKS;
    if (c > cap) c = cap;
    return c < 1 ? 1 : (int)c;
}

/* `step` capped to the task's last step number (xccl_task_step_limit): for schedules whose
 * later rounds may share the last step, since messages of one step between two ranks are
 * matched in posting order. */
static inline uint32_t xccl_pat_step_cap(const xccl_task_t *t, uint64_t step)
{
    uint32_t last = xccl_task_step_limit(t) - 1u;

    return step < last ? (uint32_t)step : last;
}

/* `step` folded into the task's step range (xccl_task_step_limit). For ring schedules only: a
 * rank sends only to its successor and receives only from its predecessor, both sides post in
 * the same order, and messages of one step between two ranks match in posting order, so steps
 * may repeat. */
static inline uint32_t xccl_pat_step_wrap(const xccl_task_t *t, uint64_t step)
{
    return (uint32_t)(step % xccl_task_step_limit(t));
}

/* Posting and reducing that skip empty pieces: uneven blocks and chunks can be empty, and
 * both sides of a message skip it alike because both compute the same piece sizes. */
static inline xccl_status_t xccl_pat_send_nz(xccl_task_t *t, int peer, const void *buf,
                                             size_t nbytes, uint32_t step)
{
    return nbytes == 0 ? XCCL_OK : xccl_task_isend(t, peer, buf, nbytes, step);
}

static inline xccl_status_t xccl_pat_recv_nz(xccl_task_t *t, int peer, void *buf,
                                             size_t nbytes, uint32_t step)
{
    return nbytes == 0 ? XCCL_OK : xccl_task_irecv(t, peer, buf, nbytes, step);
}

static inline xccl_status_t xccl_pat_reduce_nz(xccl_task_t *t, void *dst, const void *a,
                                               const void *b, size_t count)
{
    return count == 0 ? XCCL_OK : xccl_task_reduce(t, dst, a, b, count);
}

/* Chunks per block of block_bytes for a ring of nsteps steps, with chunks of
 * $XCCL_RING_CHUNK_BYTES (at least one element of elsize bytes), with step numbers below
 * step_limit (xccl_task_step_limit); the same on every rank. */
static inline int xccl_pat_ring_chunks_env(size_t block_bytes, size_t elsize, int nsteps,
                                           uint32_t step_limit)
{
    int64_t chunk = xccl_env_int(XCCL_PAT_RING_CHUNK_ENV, XCCL_PAT_RING_CHUNK_DEFAULT);

    if (chunk < (int64_t)elsize) chunk = (int64_t)elsize;
    return xccl_pat_ring_nchunks(block_bytes, (size_t)chunk, nsteps, step_limit);
}

static inline xccl_pat_pipe_t xccl_pat_pipe(int nsteps, int nred, int nchunks)
{
    xccl_pat_pipe_t p = {nsteps, nred, nchunks, nchunks > 1 && nred > 0 ? 2 : 1};
    return p;
}

static inline int xccl_pat_pipe_start(const xccl_pat_pipe_t *p, int s)
{
    return s <= p->nred ? s * p->lag : p->nred * p->lag + (s - p->nred);
}

static inline int xccl_pat_pipe_rounds(const xccl_pat_pipe_t *p)
{
    return p->nsteps == 0 ? 0 : xccl_pat_pipe_start(p, p->nsteps - 1) + p->nchunks;
}

/* The chunk step s moves in round k, or -1 if step s is idle in that round. */
static inline int xccl_pat_pipe_chunk(const xccl_pat_pipe_t *p, int s, int k)
{
    int c = k - xccl_pat_pipe_start(p, s);
    return c >= 0 && c < p->nchunks ? c : -1;
}

static inline uint32_t xccl_pat_pipe_step(const xccl_pat_pipe_t *p, int s, int c)
{
    return (uint32_t)s * (uint32_t)p->nchunks + (uint32_t)c;
}

/* Drives a pipelined schedule of `rounds` rounds whose state is `x`; *round is the resume
 * point (task state). Once round k-1's messages are done: reduce what round k's sends need
 * (reduce(x, k-1, 1)), post round k, then reduce the rest of round k-1 (reduce(x, k-1, 0)).
 * One extra round only reduces. */
static inline xccl_status_t xccl_pat_pipe_run(xccl_task_t *t, uint64_t *round, int rounds,
                                              const void *x,
                                              xccl_status_t (*post)(const void *x, int k),
                                              xccl_status_t (*reduce)(const void *x, int j,
                                                                      int urgent))
{
    xccl_status_t st;

    while ((st = xccl_task_test(t)) == XCCL_OK) {
        int k = (int)*round;

        if (k > rounds) return XCCL_OK;
        if (k > 0) XCCL_CHECK(reduce(x, k - 1, 1));
        if (k < rounds) XCCL_CHECK(post(x, k));
        if (k > 0) XCCL_CHECK(reduce(x, k - 1, 0));
        *round = (uint64_t)k + 1;
    }
    return st;
}

/* ---------------------------------------------------------------------------------------------
 * Owner algorithms (owner.c): every block is cut into the same number C of chunks, and chunk
 * c travels as step c (reduce-scatter phase) and C + c (all-gather phase).
 * ------------------------------------------------------------------------------------------- */
/* Chunk size of the owner algorithms, in bytes: $XCCL_OWNER_CHUNK_BYTES, 256 KiB by default
 * (a window of 2 (n-1) chunks should stay in the cache). Every rank must see the same value. */
#define XCCL_PAT_OWNER_CHUNK_ENV     "XCCL_OWNER_CHUNK_BYTES"
#define XCCL_PAT_OWNER_CHUNK_DEFAULT (256 * 1024)

/* Chunks per block: at most chunk_bytes each, at most XCCL_PAT_RING_MAX_CHUNKS. */
static inline int xccl_pat_owner_nchunks(size_t block_bytes, size_t chunk_bytes)
{
    return xccl_pat_ring_nchunks(block_bytes, chunk_bytes, 2, 1u << 20);
}

/* ---------------------------------------------------------------------------------------------
 * Fold of a group of n ranks onto p = 2^floor(log2 n) for recursive doubling / halving.
 * The `extra` = n - p ranks r >= p pair with proxies r - p: an extra rank hands its data to
 * its proxy before the power-of-two phase and gets the result back afterwards; ranks < p run
 * the power-of-two algorithm with vrank = rank.
 *
 *   rank:  0 .. extra-1   extra .. p-1   p .. n-1
 *   role:  PROXY          PLAIN          EXTRA
 *   peer:  rank + p       -              rank - p
 * ------------------------------------------------------------------------------------------- */
typedef enum xccl_pat_role {
    XCCL_PAT_PLAIN = 0,
    XCCL_PAT_PROXY,
    XCCL_PAT_EXTRA,
} xccl_pat_role_t;

typedef struct xccl_pat_fold {
    int             p;     /* ranks in the power-of-two phase         */
    int             log_p; /* log2 p: rounds of recursive doubling    */
    int             extra; /* n - p                                   */
    xccl_pat_role_t role;
    int             peer;  /* the proxy's extra rank or the extra's proxy; -1 for PLAIN */
} xccl_pat_fold_t;

static inline xccl_pat_fold_t xccl_pat_fold(int rank, int n)
{
    xccl_pat_fold_t f;

    f.log_p = xccl_pat_log2_floor(n);
    f.p     = 1 << f.log_p;
    f.extra = n - f.p;
    if (rank >= f.p) {
        f.role = XCCL_PAT_EXTRA;
        f.peer = rank - f.p;
    } else if (rank < f.extra) {
        f.role = XCCL_PAT_PROXY;
        f.peer = rank + f.p;
    } else {
        f.role = XCCL_PAT_PLAIN;
        f.peer = -1;
    }
    return f;
}

/* Rank-indexed data (allgather, reduce-scatter) in a folded group: the power-of-two phase
 * moves "parts", part v being block v plus, for a proxy v < extra, the block v + p of its
 * extra rank. Parts [lo, hi) are then the blocks [lo, hi) and [p + lo, p + min(hi, extra)):
 * at most two contiguous runs, *b_lo == *b_hi when the second is empty. */
static inline void xccl_pat_fold_parts(int p, int extra, int lo, int hi, int *a_lo, int *a_hi,
                                       int *b_lo, int *b_hi)
{
    int top = hi < extra ? hi : extra;

    *a_lo = lo;
    *a_hi = hi;
    *b_lo = lo < top ? p + lo : 0;
    *b_hi = lo < top ? p + top : 0;
}

/* ---------------------------------------------------------------------------------------------
 * Recursive doubling / halving among p = 2^k ranks (vranks).
 *   doubling round i = 0..k-1: partner v ^ 2^i; both hold the 2^i parts of the aligned range
 *                              [v & ~(2^i - 1), + 2^i) and exchange them.
 *   halving  round i = 0..k-1: distance d = p >> (i+1), partner v ^ d; the range of 2d parts
 *                              [v & ~(2d - 1), + 2d) is split in halves, the rank with bit d
 *                              clear keeps the lower one. After k rounds vrank v holds part v.
 * ------------------------------------------------------------------------------------------- */
static inline int xccl_pat_rd_partner(int vrank, int round) { return vrank ^ (1 << round); }

/* The aligned range of `width` parts (a power of two) containing part v. */
static inline int xccl_pat_rd_range_lo(int v, int width) { return v & ~(width - 1); }

/* ---------------------------------------------------------------------------------------------
 * Binomial tree rooted at `root`, on vranks v = (rank - root) mod n. The parent of v != 0 is v
 * with its lowest set bit cleared; the children of v are v + 2^i for every 2^i below the lowest
 * set bit of v (every 2^i < n for the root) with v + 2^i < n. The subtree of v is the vrank
 * range [v, v + lowbit(v)) cut at n: ceil(log2 n) levels.
 *
 *   n = 6, root 0:   0 -> 1, 2, 4     2 -> 3     4 -> 5
 * ------------------------------------------------------------------------------------------- */
static inline int xccl_pat_vrank(int rank, int root, int n) { return xccl_pat_mod(rank - root, n); }
static inline int xccl_pat_unvrank(int v, int root, int n) { return xccl_pat_mod(v + root, n); }

/* Lowest set bit of v, or the first power of two >= n for the root (v = 0). */
static inline int xccl_pat_binomial_span(int v, int n)
{
    return v == 0 ? 1 << xccl_pat_log2_ceil(n) : v & -v;
}

/* Parent rank, or -1 at the root. */
static inline int xccl_pat_binomial_parent(int rank, int root, int n)
{
    int v = xccl_pat_vrank(rank, root, n);
    return v == 0 ? -1 : xccl_pat_unvrank(v & (v - 1), root, n);
}

static inline int xccl_pat_binomial_nchildren(int rank, int root, int n)
{
    int v = xccl_pat_vrank(rank, root, n), span = xccl_pat_binomial_span(v, n), k = 0;

    for (int d = 1; d < span && v + d < n; d <<= 1) k++;
    return k;
}

/* The i-th child (0 <= i < nchildren): the one at vrank distance 2^i, whose subtree holds
 * min(2^i, n - v - 2^i) ranks. Children far away root bigger subtrees. */
static inline int xccl_pat_binomial_child(int rank, int root, int n, int i)
{
    return xccl_pat_unvrank(xccl_pat_vrank(rank, root, n) + (1 << i), root, n);
}

/* Ranks in the subtree of `rank` (itself included): vranks [v, v + size). */
static inline int xccl_pat_binomial_subtree(int rank, int root, int n)
{
    int v = xccl_pat_vrank(rank, root, n), span = xccl_pat_binomial_span(v, n);
    return span < n - v ? span : n - v;
}

/* ---------------------------------------------------------------------------------------------
 * Bruck: ceil(log2 n) rounds; in round k rank r sends to r - 2^k and receives from r + 2^k
 * (mod n). In the allgather, rank r holds blocks r .. r + 2^k - 1 before round k and receives
 * the next min(2^k, n - 2^k) blocks.
 * ------------------------------------------------------------------------------------------- */
static inline int xccl_pat_bruck_rounds(int n) { return xccl_pat_log2_ceil(n); }
static inline int xccl_pat_bruck_send_peer(int rank, int n, int k)
{
    return xccl_pat_mod(rank - (1 << k), n);
}
static inline int xccl_pat_bruck_recv_peer(int rank, int n, int k)
{
    return xccl_pat_mod(rank + (1 << k), n);
}
static inline int xccl_pat_bruck_nblocks(int n, int k)
{
    int d = 1 << k;
    return d < n - d ? d : n - d;
}

/* ---------------------------------------------------------------------------------------------
 * Pairwise exchange: n-1 steps s = 1..n-1. For n a power of two the partners are symmetric
 * (r ^ s, send and receive with the same rank); otherwise rank r sends to r + s and receives
 * from r - s (mod n), which also meets every peer exactly once.
 * ------------------------------------------------------------------------------------------- */
static inline int xccl_pat_pairwise_send_peer(int rank, int n, int s)
{
    return xccl_pat_is_pow2(n) ? rank ^ s : xccl_pat_mod(rank + s, n);
}
static inline int xccl_pat_pairwise_recv_peer(int rank, int n, int s)
{
    return xccl_pat_is_pow2(n) ? rank ^ s : xccl_pat_mod(rank - s, n);
}

/* ---------------------------------------------------------------------------------------------
 * Added for the rooted / all-to-all algorithms (rooted.c, alltoall.c).
 *
 * Bruck all-to-all: after a local rotation, position i of rank r holds the block that travels
 * distance i; round k = 0 .. ceil(log2 n) - 1 sends every position i < n with bit k set to
 * r + 2^k. The number of such positions, at most n / 2:
 *
 *   n = 6:  k = 0: {1, 3, 5} -> 3    k = 1: {2, 3} -> 2    k = 2: {4, 5} -> 2
 * ------------------------------------------------------------------------------------------- */
static inline int xccl_pat_bruck_a2a_nblocks(int n, int k)
{
    int d = 1 << k, over = n % (2 * d) - d;

    return n / (2 * d) * d + (over > 0 ? over : 0);
}

#endif /* XCCL_ALGO_PATTERNS_H */
