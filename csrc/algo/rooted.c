/* SPDX-License-Identifier: Apache-2.0
 *
 * rooted.c - the rooted collectives: broadcast, reduce, gather, scatter, each as a binomial tree
 * and as a linear (root talks to everyone) schedule, plus van de Geijn's scatter + allgather
 * broadcast for large vectors.
 *
 * Trees are built over virtual ranks vr = (rank - root) mod n, so the root is vr 0 (patterns.h):
 * vr's parent is vr minus its lowest set bit, its children are vr + m for the powers of two m
 * below that bit, and its subtree is the virtual ranks [vr, vr + extent). The edge to child
 * vr + m is used in round log2(m), which is also its step number.
 *
 * Every progress function has the same shape: wait until everything posted so far has
 * completed, then run the next phase of its table (state word 0 counts phases). A phase only
 * posts messages and does local work, so progress never blocks and resumes at any
 * XCCL_INPROGRESS. Messages whose size both ends compute as 0 are not sent.
 */
#include "algo/algo.h"

#include <string.h>

#include "algo/patterns.h"
#include "core/check.h"

/* Per-peer chunk of the linear reduce: bounds its scratch to size * 1 MiB. */
#define LINEAR_REDUCE_CHUNK_BYTES ((size_t)1 << 20)
/* Steps of the ring phase of scatter_allgather start here (tree rounds use 0..31). */
#define RING_STEP_BASE 32u


/* Real rank of virtual rank vr. */
static int real(const xccl_coll_args_t *a, int vr, int size)
{
    return xccl_pat_unvrank(vr, a->root, size);
}

/* Ranks in the subtree of virtual rank vr: [vr, vr + extent) (with root 0, rank = vrank). */
static int extent(int vr, int size) { return xccl_pat_binomial_subtree(vr, 0, size); }

/* Round (and step number) of the tree edge between vr and vr + m, m a power of two. */
static uint32_t edge_step(int m) { return (uint32_t)xccl_pat_log2_floor(m); }

/* Gather and scatter keep blocks in real-rank order at the root, so virtual block j sits at
 * real position (j + root) mod n and a subtree range [c, c + extent) is contiguous there
 * unless it crosses virtual index n - root (real rank 0). At most one child of the root
 * crosses it: its offset m, or 0 if none does. */
static int root_wrap_child(int root, int size)
{
    int wrap = size - root;

    for (int m = 1; m < size; m *= 2) {
        if (m < wrap && m + extent(m, size) > wrap) return m;
    }
    return 0;
}

static void *scratch_or_fail(xccl_task_t *t, size_t nbytes, const char *what)
{
    void *p = xccl_task_scratch(t, nbytes);

    if (p == NULL)
        XCCL_ERROR(XCCL_ERR_NO_MEMORY, "%s: rank %d: cannot allocate %zu bytes of scratch", what,
                   xccl_task_rank(t), nbytes);
    return p;
}

/* Predicted cost helpers: L = ceil(log2 size) tree rounds. */
static double rounds(int size) { return (double)xccl_pat_log2_ceil(size); }

static void set_cost(xccl_cost_t *out, double steps, double bytes, double reduce_bytes)
{
    out->steps        = steps;
    out->bytes        = bytes;
    out->reduce_bytes = reduce_bytes;
}

/* =============================================================================================
 * BROADCAST
 * ============================================================================================= */

/* Broadcast, binomial tree. L = ceil(log2 n) rounds:
 *
 *   round k    vr < 2^k             sends the whole vector to vr + 2^k (if < n)
 *              2^k <= vr < 2^(k+1)  receives it from vr - 2^k
 *
 * Per rank: phase 0 receives from the parent, phase 1 sends to every child, largest subtree
 * first. Cost: L steps, L * nbytes through the root's link. */
static void bcast_binomial_cost(int size, size_t nbytes, xccl_cost_t *out)
{
    set_cost(out, rounds(size), rounds(size) * (double)nbytes, 0);
}

static xccl_status_t bcast_binomial_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a      = xccl_task_args(t);
    int                     n      = xccl_task_size(t);
    int                     vr     = xccl_pat_vrank(xccl_task_rank(t), a->root, n);
    uint64_t               *phase  = xccl_task_state(t);
    size_t                  nbytes = a->count * a->elsize;
    xccl_status_t           st;

    if (n == 1 || nbytes == 0) return XCCL_OK;
    for (;;) {
        st = xccl_task_test(t);
        if (st != XCCL_OK) return st;
        switch ((*phase)++) {
        case 0:
            if (vr != 0) {
                int m = vr & -vr;
                XCCL_CHECK(xccl_task_irecv(t, real(a, vr - m, n), a->rbuf, nbytes,
                                           edge_step(m)));
            }
            break;
        case 1:
            for (int m = xccl_pat_binomial_span(vr, n) / 2; m > 0; m /= 2) {
                if (vr + m < n)
                    XCCL_CHECK(xccl_task_isend(t, real(a, vr + m, n), a->rbuf, nbytes,
                                               edge_step(m)));
            }
            break;
        default: return XCCL_OK;
        }
    }
}

/* Broadcast, linear: the root posts n - 1 sends of the whole vector at once; every other rank
 * posts one receive. Cost: n - 1 steps and (n - 1) * nbytes on the root's link. */
static void bcast_linear_cost(int size, size_t nbytes, xccl_cost_t *out)
{
    set_cost(out, size - 1, (double)(size - 1) * (double)nbytes, 0);
}

static xccl_status_t bcast_linear_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a      = xccl_task_args(t);
    int                     n      = xccl_task_size(t);
    int                     rank   = xccl_task_rank(t);
    uint64_t               *phase  = xccl_task_state(t);
    size_t                  nbytes = a->count * a->elsize;

    if (n == 1 || nbytes == 0) return XCCL_OK;
    if ((*phase)++ == 0) {
        if (rank != a->root) {
            XCCL_CHECK(xccl_task_irecv(t, a->root, a->rbuf, nbytes, 0));
        } else {
            for (int peer = 0; peer < n; peer++) {
                if (peer != rank) XCCL_CHECK(xccl_task_isend(t, peer, a->rbuf, nbytes, 0));
            }
        }
    }
    return xccl_task_test(t);
}

/* Broadcast, scatter + ring allgather (van de Geijn). The vector is cut into n blocks in
 * virtual-rank order (xccl_pat_block_*: the first count % n blocks have one element more;
 * blocks may be empty when count < n); B = nbytes / n.
 *
 *   phase           what vr does                                      steps   bytes (root)
 *   0               receive blocks [vr, vr + extent) from the parent  L       (n-1) B
 *   1               send blocks [c, c + extent(c)) to each child c
 *   2 + s, s < n-1  ring: send block vr - s to vr + 1, receive block  n - 1   (n-1) B
 *                   vr - s - 1 from vr - 1 (all mod n)
 *
 * A ring message is skipped when its receiver already holds the block from the scatter (its
 * subtree range; the root holds everything) or when the block is empty; both ends know this.
 * Cost: L + n - 1 steps and 2 (n-1)/n nbytes, against L * nbytes for the binomial tree. */
static void bcast_sag_cost(int size, size_t nbytes, xccl_cost_t *out)
{
    double frac = (double)(size - 1) / (double)size;

    set_cost(out, rounds(size) + size - 1, 2.0 * frac * (double)nbytes, 0);
}

/* Does virtual rank vr hold block j after the scatter phase? */
static int sag_holds(int vr, int j, int size)
{
    return j >= vr && j < vr + extent(vr, size);
}

static xccl_status_t bcast_sag_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a     = xccl_task_args(t);
    int                     n     = xccl_task_size(t);
    int                     vr    = xccl_pat_vrank(xccl_task_rank(t), a->root, n);
    uint64_t               *phase = xccl_task_state(t);
    size_t                  count = a->count, el = a->elsize;
    char                   *buf   = a->rbuf;
    xccl_status_t           st;

    if (n == 1 || count == 0 || el == 0) return XCCL_OK;
    for (;;) {
        st = xccl_task_test(t);
        if (st != XCCL_OK) return st;
        uint64_t p = (*phase)++;
        if (p == 0 && vr != 0) {
            int    m  = vr & -vr;
            size_t lo = xccl_pat_block_off(count, n, vr);
            size_t hi = xccl_pat_block_off(count, n, vr + extent(vr, n));
            if (hi > lo)
                XCCL_CHECK(xccl_task_irecv(t, real(a, vr - m, n), buf + lo * el, (hi - lo) * el,
                                           edge_step(m)));
        } else if (p == 1) {
            for (int m = xccl_pat_binomial_span(vr, n) / 2; m > 0; m /= 2) {
                int c = vr + m;
                if (c >= n) continue;
                size_t lo = xccl_pat_block_off(count, n, c);
                size_t hi = xccl_pat_block_off(count, n, c + extent(c, n));
                if (hi > lo)
                    XCCL_CHECK(xccl_task_isend(t, real(a, c, n), buf + lo * el, (hi - lo) * el,
                                               edge_step(m)));
            }
        } else if (p >= 2) {
            int s = (int)(p - 2);
            if (s >= n - 1) return XCCL_OK;
            int      next = xccl_pat_ring_next(vr, n), prev = xccl_pat_ring_prev(vr, n);
            int      sblk = xccl_pat_ring_ag_send_block(vr, n, s);
            int      rblk = xccl_pat_ring_ag_recv_block(vr, n, s);
            size_t   slen = xccl_pat_block_count(count, n, sblk);
            size_t   rlen = xccl_pat_block_count(count, n, rblk);
            uint32_t step = xccl_pat_step_cap(t, RING_STEP_BASE + (uint64_t)s);
            if (rlen > 0 && !sag_holds(vr, rblk, n))
                XCCL_CHECK(xccl_task_irecv(t, real(a, prev, n),
                                           buf + xccl_pat_block_off(count, n, rblk) * el,
                                           rlen * el, step));
            if (slen > 0 && !sag_holds(next, sblk, n))
                XCCL_CHECK(xccl_task_isend(t, real(a, next, n),
                                           buf + xccl_pat_block_off(count, n, sblk) * el,
                                           slen * el, step));
        }
    }
}

/* Broadcast, pipelined chain: virtual ranks 0 -> 1 -> ... -> n-1, the vector cut into C
 * chunks of at most $XCCL_RING_CHUNK_BYTES (xccl_pat_ring_chunks_env; element boundaries by
 * xccl_pat_block_off). Phase k (step k):
 *
 *   vr = 0            sends chunk k to vr 1                           (k < C)
 *   0 < vr < n - 1    receives chunk k from vr - 1 (k < C) and forwards chunk k - 1 (k >= 1)
 *   vr = n - 1        receives chunk k
 *
 * so after n - 2 phases of filling every link carries one chunk at a time. Every link moves
 * the vector once (linear puts n - 1 copies on the root's, binomial log2 n, van de Geijn
 * 2 (n-1)/n), which decides large vectors where every message costs CPU time at both ends.
 * Cost: C + n - 2 steps of one chunk. */
static int chain_chunks(size_t nbytes, size_t elsize, uint32_t step_limit)
{
    return xccl_pat_ring_chunks_env(nbytes, elsize, 1, step_limit);
}

static void bcast_chain_cost(int size, size_t nbytes, xccl_cost_t *out)
{
    double c = (double)chain_chunks(nbytes, 1, XCCL_STEP_MAX + 1u);

    if (size < 2 || nbytes == 0) {
        set_cost(out, 0, 0, 0);
        return;
    }
    set_cost(out, c + size - 2, (double)nbytes * (c + size - 2) / c, 0);
}

static xccl_status_t bcast_chain_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a     = xccl_task_args(t);
    int                     n     = xccl_task_size(t);
    int                     vr    = xccl_pat_vrank(xccl_task_rank(t), a->root, n);
    uint64_t               *state = xccl_task_state(t); /* [0] phase, [1] C */
    size_t                  count = a->count, el = a->elsize;
    char                   *buf   = a->rbuf;
    xccl_status_t           st;

    if (n == 1 || count == 0 || el == 0) return XCCL_OK;
    if (state[1] == 0)
        state[1] = (uint64_t)chain_chunks(count * el, el, xccl_task_step_limit(t));
    for (;;) {
        uint64_t k, c = state[1];
        st = xccl_task_test(t);
        if (st != XCCL_OK) return st;
        k = state[0]++;
        if (k > c || (vr == 0 && k == c)) return XCCL_OK;
        if (vr > 0 && k < c) {
            size_t lo = xccl_pat_block_off(count, (int)c, (int)k);
            size_t hi = xccl_pat_block_off(count, (int)c, (int)k + 1);
            XCCL_CHECK(xccl_pat_recv_nz(t, real(a, vr - 1, n), buf + lo * el, (hi - lo) * el,
                                        (uint32_t)k));
        }
        if (vr < n - 1 && (vr == 0 || k >= 1)) {
            uint64_t j  = vr == 0 ? k : k - 1;
            size_t   lo = xccl_pat_block_off(count, (int)c, (int)j);
            size_t   hi = xccl_pat_block_off(count, (int)c, (int)j + 1);
            XCCL_CHECK(xccl_pat_send_nz(t, real(a, vr + 1, n), buf + lo * el, (hi - lo) * el,
                                        (uint32_t)j));
        }
    }
}

/* =============================================================================================
 * REDUCE
 * ============================================================================================= */

/* Reduce, binomial tree (the broadcast tree run backwards). L = ceil(log2 n) rounds:
 *
 *   round k    vr with bit k set, lower bits clear   sends its partial result to vr - 2^k
 *              vr with bits 0..k clear               receives from vr + 2^k (if < n) and
 *                                                    folds it in: acc = acc op received
 *
 * Per rank the rounds run one at a time (one receive buffer); the combination order is fixed
 * by (n, root), so results are reproducible. acc is rbuf at the root, scratch elsewhere; a
 * leaf sends sbuf as it is. Cost: L steps, L * nbytes received and reduced by the root. */
static void reduce_binomial_cost(int size, size_t nbytes, xccl_cost_t *out)
{
    set_cost(out, rounds(size), rounds(size) * (double)nbytes, rounds(size) * (double)nbytes);
}

enum { RB_ROUND = 0, RB_FOLD, RB_HAVE_ACC, RB_SENT };

static xccl_status_t reduce_binomial_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a      = xccl_task_args(t);
    int                     n      = xccl_task_size(t);
    int                     vr     = xccl_pat_vrank(xccl_task_rank(t), a->root, n);
    uint64_t               *s      = xccl_task_state(t);
    size_t                  nbytes = a->count * a->elsize;
    char                   *acc = NULL, *tmp = NULL;
    xccl_status_t           st;

    if (nbytes == 0) return XCCL_OK;
    if (n == 1) {
        return xccl_task_copy(t, a->rbuf, a->sbuf, nbytes);
    }
    if (vr == 0) {
        acc = a->rbuf;
        tmp = scratch_or_fail(t, nbytes, "reduce binomial");
        if (tmp == NULL) return XCCL_ERR_NO_MEMORY;
    } else if (extent(vr, n) > 1) {
        acc = scratch_or_fail(t, 2 * nbytes, "reduce binomial");
        if (acc == NULL) return XCCL_ERR_NO_MEMORY;
        tmp = acc + nbytes;
    }
    for (;;) {
        st = xccl_task_test(t);
        if (st != XCCL_OK) return st;
        if (s[RB_FOLD]) {
            XCCL_CHECK(xccl_task_reduce(t, acc, s[RB_HAVE_ACC] ? acc : a->sbuf, tmp, a->count));
            s[RB_FOLD]     = 0;
            s[RB_HAVE_ACC] = 1;
        }
        if (s[RB_SENT]) return XCCL_OK;
        int k = (int)s[RB_ROUND]++;
        int m = 1 << k;
        if (vr & m) {
            XCCL_CHECK(xccl_task_isend(t, real(a, vr - m, n), s[RB_HAVE_ACC] ? acc : a->sbuf,
                                       nbytes, (uint32_t)k));
            s[RB_SENT] = 1;
        } else if (m >= n) {
            return XCCL_OK; /* the root, with every child folded in */
        } else if (vr + m < n) {
            XCCL_CHECK(xccl_task_irecv(t, real(a, vr + m, n), tmp, nbytes, (uint32_t)k));
            s[RB_FOLD] = 1;
        }
    }
}

/* Reduce, linear: the root receives every other rank's vector and combines them in rank order,
 * ((x0 op x1) op x2) op ... , into rbuf. To bound memory the vector goes in chunks of
 * LINEAR_REDUCE_CHUNK_BYTES per peer:
 *
 *   phase 2c      root: post n - 1 receives of chunk c     others: send chunk c (phase c)
 *   phase 2c + 1  root: fold chunk c in rank order
 *
 * Cost: n - 1 steps, (n - 1) * nbytes received and reduced by the root. */
static void reduce_linear_cost(int size, size_t nbytes, xccl_cost_t *out)
{
    double b = (double)(size - 1) * (double)nbytes;

    set_cost(out, size - 1, b, b);
}

static xccl_status_t reduce_linear_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a     = xccl_task_args(t);
    int                     n     = xccl_task_size(t);
    int                     rank  = xccl_task_rank(t);
    uint64_t               *phase = xccl_task_state(t);
    size_t                  el    = a->elsize;
    size_t                  chunk, nchunks, slot;
    const char             *sbuf = a->sbuf;
    char                   *rbuf = a->rbuf, *scr = NULL;
    xccl_status_t           st;

    if (a->count == 0 || el == 0) return XCCL_OK;
    if (n == 1) {
        return xccl_task_copy(t, rbuf, sbuf, a->count * el);
    }
    chunk   = LINEAR_REDUCE_CHUNK_BYTES / el > 0 ? LINEAR_REDUCE_CHUNK_BYTES / el : 1;
    chunk   = xccl_pat_min(chunk, a->count);
    nchunks = (a->count + chunk - 1) / chunk;
    slot    = chunk * el;
    if (rank == a->root) {
        /* one slot per rank; the root's own slot is used only when rbuf aliases sbuf */
        scr = scratch_or_fail(t, (size_t)n * slot, "reduce linear");
        if (scr == NULL) return XCCL_ERR_NO_MEMORY;
    }
    for (;;) {
        st = xccl_task_test(t);
        if (st != XCCL_OK) return st;
        uint64_t p = (*phase)++;
        if (rank != a->root) {
            if (p >= nchunks) return XCCL_OK;
            size_t len = p + 1 < nchunks ? chunk : a->count - p * chunk;
            XCCL_CHECK(xccl_task_isend(t, a->root, sbuf + p * slot, len * el,
                                       xccl_pat_step_cap(t, p)));
            continue;
        }
        size_t c = p / 2, off = c * slot;
        if (c >= nchunks) return XCCL_OK;
        size_t len = c + 1 < nchunks ? chunk : a->count - c * chunk;
        if (p % 2 == 0) {
            for (int peer = 0; peer < n; peer++) {
                if (peer != rank)
                    XCCL_CHECK(xccl_task_irecv(t, peer, scr + (size_t)peer * slot, len * el,
                                               xccl_pat_step_cap(t, c)));
            }
            continue;
        }
        /* With rbuf == sbuf the root's input is overwritten by the first fold, before it is
         * read, unless the root is rank 0 or 1: keep a copy then. */
        const char *mine = sbuf + off;
        if (rbuf == sbuf && rank > 1) {
            XCCL_CHECK(xccl_task_copy(t, scr + (size_t)rank * slot, mine, len * el));
            mine = scr + (size_t)rank * slot;
        }
        const char *x0 = rank == 0 ? mine : scr; /* rank 0's chunk */
        for (int r = 1; r < n; r++) {
            const char *xr = r == rank ? mine : scr + (size_t)r * slot;
            XCCL_CHECK(xccl_task_reduce(t, rbuf + off, r == 1 ? x0 : rbuf + off, xr, len));
        }
    }
}

/* =============================================================================================
 * GATHER
 * ============================================================================================= */

/* Gather, binomial tree. Each rank collects its subtree's blocks, in virtual-rank order, and
 * passes them up in one message; L = ceil(log2 n) rounds:
 *
 *   phase 0   internal vr: copy its block into scratch[0]; receive child vr + m's extent
 *             blocks at scratch[m] (all children at once; the root receives straight into rbuf)
 *   phase 1   vr != 0: send its extent blocks to the parent (a leaf sends sbuf)
 *             root: the one child range that wraps past rank n - 1 went to scratch: copy its
 *             two pieces into rbuf
 *
 * Cost: L steps, (n-1)/n * nbytes into the root. */
static void gather_binomial_cost(int size, size_t nbytes, xccl_cost_t *out)
{
    set_cost(out, rounds(size), (double)nbytes * (size - 1) / size, 0);
}

static xccl_status_t gather_binomial_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a     = xccl_task_args(t);
    int                     n     = xccl_task_size(t);
    int                     vr    = xccl_pat_vrank(xccl_task_rank(t), a->root, n);
    int                     ext   = extent(vr, n);
    int                     span  = xccl_pat_binomial_span(vr, n);
    int                     wrap  = n - a->root; /* virtual index of real rank 0 */
    uint64_t               *phase = xccl_task_state(t);
    size_t                  blk   = a->count * a->elsize;
    char                   *rbuf = a->rbuf, *scr = NULL;
    int                     wrap_child = 0; /* root only: see root_wrap_child */
    xccl_status_t           st;

    if (n == 1 || blk == 0) return XCCL_OK;
    if (vr == 0) {
        wrap_child = root_wrap_child(a->root, n);
        if (wrap_child) {
            size_t sz = (size_t)extent(wrap_child, n) * blk;
            scr       = scratch_or_fail(t, sz, "gather binomial");
            if (scr == NULL) return XCCL_ERR_NO_MEMORY;
        }
    } else if (ext > 1) {
        scr = scratch_or_fail(t, (size_t)ext * blk, "gather binomial");
        if (scr == NULL) return XCCL_ERR_NO_MEMORY;
    }
    for (;;) {
        st = xccl_task_test(t);
        if (st != XCCL_OK) return st;
        switch ((*phase)++) {
        case 0:
            if (vr != 0 && ext > 1) XCCL_CHECK(xccl_task_copy(t, scr, a->sbuf, blk));
            for (int m = 1; m < span && vr + m < n; m *= 2) {
                int   c = vr + m;
                char *dst;
                if (vr != 0)
                    dst = scr + (size_t)m * blk;
                else
                    dst = m == wrap_child ? scr : rbuf + (size_t)real(a, c, n) * blk;
                XCCL_CHECK(xccl_task_irecv(t, real(a, c, n), dst, (size_t)extent(c, n) * blk,
                                           edge_step(m)));
            }
            break;
        case 1:
            if (vr != 0) {
                int m = vr & -vr;
                XCCL_CHECK(xccl_task_isend(t, real(a, vr - m, n), ext > 1 ? scr : a->sbuf,
                                           (size_t)ext * blk, edge_step(m)));
            } else if (wrap_child) {
                size_t head = (size_t)(wrap - wrap_child) * blk;
                size_t all  = (size_t)extent(wrap_child, n) * blk;
                XCCL_CHECK(
                    xccl_task_copy(t, rbuf + (size_t)real(a, wrap_child, n) * blk, scr, head));
                XCCL_CHECK(xccl_task_copy(t, rbuf, scr + head, all - head));
            }
            break;
        default: return XCCL_OK;
        }
    }
}

/* Gather, linear: the root posts n - 1 receives straight into rbuf, every other rank one send.
 * Cost: n - 1 steps, (n-1)/n * nbytes into the root. */
static void gather_linear_cost(int size, size_t nbytes, xccl_cost_t *out)
{
    set_cost(out, size - 1, (double)nbytes * (size - 1) / size, 0);
}

static xccl_status_t gather_linear_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a     = xccl_task_args(t);
    int                     n     = xccl_task_size(t);
    int                     rank  = xccl_task_rank(t);
    uint64_t               *phase = xccl_task_state(t);
    size_t                  blk   = a->count * a->elsize;

    if (n == 1 || blk == 0) return XCCL_OK;
    if ((*phase)++ == 0) {
        if (rank != a->root) {
            XCCL_CHECK(xccl_task_isend(t, a->root, a->sbuf, blk, 0));
        } else {
            for (int peer = 0; peer < n; peer++) {
                if (peer != rank)
                    XCCL_CHECK(xccl_task_irecv(t, peer, (char *)a->rbuf + (size_t)peer * blk, blk,
                                               0));
            }
        }
    }
    return xccl_task_test(t);
}

/* =============================================================================================
 * SCATTER
 * ============================================================================================= */

/* Scatter, binomial tree (gather run backwards); L = ceil(log2 n) rounds:
 *
 *   phase 0   root: send child m its extent blocks, largest subtree first, straight from sbuf
 *             (the range that wraps past rank n - 1 is packed into scratch first)
 *             vr != 0: receive its extent blocks from the parent (a leaf straight into rbuf)
 *   phase 1   internal vr != 0: copy its own block to rbuf, send child vr + m its blocks from
 *             scratch[m]
 *
 * Cost: L steps, (n-1)/n * nbytes out of the root. */
static void scatter_binomial_cost(int size, size_t nbytes, xccl_cost_t *out)
{
    set_cost(out, rounds(size), (double)nbytes * (size - 1) / size, 0);
}

static xccl_status_t scatter_binomial_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a     = xccl_task_args(t);
    int                     n     = xccl_task_size(t);
    int                     vr    = xccl_pat_vrank(xccl_task_rank(t), a->root, n);
    int                     ext   = extent(vr, n);
    int                     span  = xccl_pat_binomial_span(vr, n);
    int                     wrap  = n - a->root; /* virtual index of real rank 0 */
    uint64_t               *phase = xccl_task_state(t);
    size_t                  blk   = a->count * a->elsize;
    const char             *sbuf  = a->sbuf;
    char                   *scr   = NULL;
    int                     wrap_child = 0; /* root only: see root_wrap_child */
    xccl_status_t           st;

    if (n == 1 || blk == 0) return XCCL_OK;
    if (vr == 0) {
        wrap_child = root_wrap_child(a->root, n);
        if (wrap_child) {
            size_t sz = (size_t)extent(wrap_child, n) * blk;
            scr       = scratch_or_fail(t, sz, "scatter binomial");
            if (scr == NULL) return XCCL_ERR_NO_MEMORY;
        }
    } else if (ext > 1) {
        scr = scratch_or_fail(t, (size_t)ext * blk, "scatter binomial");
        if (scr == NULL) return XCCL_ERR_NO_MEMORY;
    }
    for (;;) {
        st = xccl_task_test(t);
        if (st != XCCL_OK) return st;
        uint64_t p = (*phase)++;
        if (p == 0 && vr != 0) {
            int m = vr & -vr;
            XCCL_CHECK(xccl_task_irecv(t, real(a, vr - m, n), ext > 1 ? scr : a->rbuf,
                                       (size_t)ext * blk, edge_step(m)));
        } else if ((p == 0 && vr == 0) || (p == 1 && vr != 0)) {
            if (vr != 0 && ext > 1) XCCL_CHECK(xccl_task_copy(t, a->rbuf, scr, blk));
            for (int m = span / 2; m > 0; m /= 2) {
                int         c = vr + m;
                size_t      len;
                const char *src;
                if (c >= n) continue;
                len = (size_t)extent(c, n) * blk;
                if (vr != 0) {
                    src = scr + (size_t)m * blk;
                } else if (m == wrap_child) {
                    size_t head = (size_t)(wrap - m) * blk;
                    XCCL_CHECK(xccl_task_copy(t, scr, sbuf + (size_t)real(a, c, n) * blk, head));
                    XCCL_CHECK(xccl_task_copy(t, scr + head, sbuf, len - head));
                    src = scr;
                } else {
                    src = sbuf + (size_t)real(a, c, n) * blk;
                }
                XCCL_CHECK(xccl_task_isend(t, real(a, c, n), src, len,
                                           edge_step(m)));
            }
        } else {
            return XCCL_OK;
        }
    }
}

/* Scatter, linear: the root posts n - 1 sends straight from sbuf, every other rank one
 * receive into rbuf. Cost: n - 1 steps, (n-1)/n * nbytes out of the root. */
static void scatter_linear_cost(int size, size_t nbytes, xccl_cost_t *out)
{
    set_cost(out, size - 1, (double)nbytes * (size - 1) / size, 0);
}

static xccl_status_t scatter_linear_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a     = xccl_task_args(t);
    int                     n     = xccl_task_size(t);
    int                     rank  = xccl_task_rank(t);
    uint64_t               *phase = xccl_task_state(t);
    size_t                  blk   = a->count * a->elsize;

    if (n == 1 || blk == 0) return XCCL_OK;
    if ((*phase)++ == 0) {
        if (rank != a->root) {
            XCCL_CHECK(xccl_task_irecv(t, a->root, a->rbuf, blk, 0));
        } else {
            for (int peer = 0; peer < n; peer++) {
                if (peer != rank)
                    XCCL_CHECK(xccl_task_isend(t, peer, (const char *)a->sbuf + (size_t)peer * blk,
                                               blk, 0));
            }
        }
    }
    return xccl_task_test(t);
}

/* =============================================================================================
 * The algorithm table entries (declared in registry.c).
 * ============================================================================================= */

const xccl_algo_t xccl_algo_broadcast_binomial = {
    .name     = "binomial",
    .coll     = XCCL_COLL_BROADCAST,
    .summary  = "binomial tree from the root: ceil(log2 n) steps, each forwarding the whole vector",
    .cost     = bcast_binomial_cost,
    .progress = bcast_binomial_progress,
};

const xccl_algo_t xccl_algo_broadcast_linear = {
    .name     = "linear",
    .coll     = XCCL_COLL_BROADCAST,
    .summary  = "the root sends the whole vector to every rank: n-1 messages from the root",
    .cost     = bcast_linear_cost,
    .progress = bcast_linear_progress,
};

const xccl_algo_t xccl_algo_broadcast_scatter_allgather = {
    .name     = "scatter_allgather",
    .coll     = XCCL_COLL_BROADCAST,
    .summary  = "binomial scatter of n blocks then ring allgather: log2 n + n-1 steps, "
                "2(n-1)/n of the vector per rank",
    .cost     = bcast_sag_cost,
    .progress = bcast_sag_progress,
};

const xccl_algo_t xccl_algo_broadcast_chain = {
    .name     = "chain",
    .coll     = XCCL_COLL_BROADCAST,
    .summary  = "pipelined chain from the root: C chunks forwarded rank to rank, C + n-2 steps, "
                "the vector once per link",
    .cost     = bcast_chain_cost,
    .progress = bcast_chain_progress,
};

const xccl_algo_t xccl_algo_reduce_binomial = {
    .name     = "binomial",
    .coll     = XCCL_COLL_REDUCE,
    .summary  = "binomial tree into the root: ceil(log2 n) steps, each moving and reducing the "
                "whole vector",
    .cost     = reduce_binomial_cost,
    .progress = reduce_binomial_progress,
};

const xccl_algo_t xccl_algo_reduce_linear = {
    .name     = "linear",
    .coll     = XCCL_COLL_REDUCE,
    .summary  = "every rank sends to the root, which reduces in rank order: n-1 vectors into "
                "the root",
    .cost     = reduce_linear_cost,
    .progress = reduce_linear_progress,
};

const xccl_algo_t xccl_algo_gather_binomial = {
    .name     = "binomial",
    .coll     = XCCL_COLL_GATHER,
    .summary  = "binomial tree, subtree blocks merged on the way up: ceil(log2 n) steps, "
                "(n-1)/n of the output into the root",
    .cost     = gather_binomial_cost,
    .progress = gather_binomial_progress,
};

const xccl_algo_t xccl_algo_gather_linear = {
    .name     = "linear",
    .coll     = XCCL_COLL_GATHER,
    .summary  = "every rank sends its block to the root: n-1 messages into the root",
    .cost     = gather_linear_cost,
    .progress = gather_linear_progress,
};

const xccl_algo_t xccl_algo_scatter_binomial = {
    .name     = "binomial",
    .coll     = XCCL_COLL_SCATTER,
    .summary  = "binomial tree, subtree blocks split on the way down: ceil(log2 n) steps, "
                "(n-1)/n of the input out of the root",
    .cost     = scatter_binomial_cost,
    .progress = scatter_binomial_progress,
};

const xccl_algo_t xccl_algo_scatter_linear = {
    .name     = "linear",
    .coll     = XCCL_COLL_SCATTER,
    .summary  = "the root sends every rank its block: n-1 messages out of the root",
    .cost     = scatter_linear_cost,
    .progress = scatter_linear_progress,
};
