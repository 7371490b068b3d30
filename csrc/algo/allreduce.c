/* SPDX-License-Identifier: Apache-2.0
 *
 * allreduce.c - XCCL_COLL_ALLREDUCE: ring (pipelined reduce-scatter + all-gather), recursive
 * doubling, Rabenseifner (recursive halving + doubling) and direct exchange.
 *
 * The vector is in place in rbuf (count elements, N = count * elsize bytes). Every rank ends
 * with bitwise the same result: each element is either combined once and then copied around
 * (ring, Rabenseifner) or combined by every rank in the same order (rd pairs combine
 * lower-rank data first; direct reduces in rank order). Costs below are per rank on the
 * critical path, with n ranks, p = 2^floor(log2 n) and [x] = 1 when n is not a power of two.
 */
#include "algo/algo.h"

#include <string.h>

#include "algo/patterns.h"
#include "algo/ring.h"
#include "core/check.h"

/* Largest scratch the direct algorithm may take (it holds n-1 incoming messages at once). */
#define DIRECT_MAX_SCRATCH ((size_t)256 << 20)

static void *scratch(xccl_task_t *t, size_t nbytes, const char *algo)
{
    void *p = xccl_task_scratch(t, nbytes);
    if (p == NULL)
        XCCL_ERROR(XCCL_ERR_NO_MEMORY, "all_reduce %s: rank %d: no memory for %zu B of scratch",
                   algo, xccl_task_rank(t), nbytes);
    return p;
}

/* ---------------------------------------------------------------------------------------------
 * ring: reduce-scatter then all-gather around the ring, 2(n-1) steps. The vector is cut into
 * n blocks (xccl_pat_block), every block into C chunks of at most $XCCL_RING_CHUNK_BYTES.
 * Steps 0 .. n-2 are the ring reduce-scatter of ring.h with its partial sums in place:
 *
 *   step s        send to r+1            receive from r-1       then
 *   0 .. n-2      block r-s-1            block r-s-2 -> stage   block r-s-2 = stage op it
 *   n-1 .. 2n-3   block r-(s-n+1)        block r-(s-n+1)-1      (in place)
 *
 * After step n-2 rank r holds the reduced block r. Both phases run in one pipe, so the
 * all-gather's first chunks leave while the reduce-scatter's last ones are still reduced.
 * Chunk c of step s travels as message s*C + c; the rounds of xccl_pat_pipe overlap the chunks
 * of successive steps and, when C > 1, the reduction of one round's chunks with the next
 * round's transfers.
 *
 * cost: 2(n-1) α (3n-4 + C rounds with C > 1 chunks), 2(n-1)/n N β, (n-1)/n N γ.
 * ------------------------------------------------------------------------------------------- */
static xccl_status_t ring_post(const void *arg, int k)
{
    const xccl_ring_rs_t *x = arg;
    int                   n = x->size, r = x->rank;

    for (int s = 0; s < x->pipe.nsteps; s++) {
        int      c = xccl_pat_pipe_chunk(&x->pipe, s, k), sb, rb;
        uint32_t step;
        size_t   soff, roff, scnt, rcnt;

        if (c < 0) continue;
        if (s < n - 1) {
            XCCL_CHECK(xccl_ring_rs_post(x, s, c));
            continue;
        }
        /* all-gather: the reduced blocks travel on, in place */
        step = xccl_pat_step_wrap(x->t, xccl_pat_pipe_step(&x->pipe, s, c));
        sb   = xccl_pat_ring_ag_send_block(r, n, s - (n - 1));
        rb   = xccl_pat_ring_ag_recv_block(r, n, s - (n - 1));
        scnt = xccl_ring_rs_chunk(x, sb, c, &soff);
        rcnt = xccl_ring_rs_chunk(x, rb, c, &roff);
        XCCL_CHECK(xccl_pat_recv_nz(x->t, xccl_pat_ring_prev(r, n), x->in + roff * x->es,
                                    rcnt * x->es, step));
        XCCL_CHECK(xccl_pat_send_nz(x->t, xccl_pat_ring_next(r, n), x->in + soff * x->es,
                                    scnt * x->es, step));
    }
    return XCCL_OK;
}

static xccl_status_t ring_reduce(const void *arg, int j, int urgent)
{
    return xccl_ring_rs_reduce(arg, j, urgent);
}

/* Chunks per block of a ring over n ranks (2 * (n - 1) steps). */
static int ring_nchunks(size_t block_bytes, size_t elsize, int n, uint32_t step_limit)
{
    return xccl_pat_ring_chunks_env(block_bytes, elsize, 2 * (n - 1), step_limit);
}

static xccl_status_t ring_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    uint64_t               *w = xccl_task_state(t); /* w[0]: next round, w[1]: chunks */
    xccl_ring_rs_t          x;

    memset(&x, 0, sizeof(x));
    x.t        = t;
    x.rank     = xccl_task_rank(t);
    x.size     = xccl_task_size(t);
    x.in       = a->rbuf;
    x.count    = a->count;
    x.es       = a->elsize;
    x.in_place = 1;
    if (x.size == 1 || x.count == 0) return XCCL_OK;
    if (w[1] == 0)
        w[1] = (uint64_t)ring_nchunks(xccl_pat_block_max(x.count, x.size) * x.es, x.es, x.size,
                                       xccl_task_step_limit(t));
    x.pipe  = xccl_pat_pipe(2 * (x.size - 1), x.size - 1, (int)w[1]);
    x.stage = scratch(t, xccl_ring_rs_stage_bytes(&x), "ring");
    if (x.stage == NULL) return XCCL_ERR_NO_MEMORY;

    return xccl_pat_pipe_run(t, &w[0], xccl_pat_pipe_rounds(&x.pipe), &x, ring_post, ring_reduce);
}

static void ring_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    double          f = n > 1 ? (double)(n - 1) / n : 0;
    xccl_pat_pipe_t p;

    memset(out, 0, sizeof(*out));
    if (n == 1) return;
    p = xccl_pat_pipe(2 * (n - 1), n - 1,
                      ring_nchunks(xccl_pat_block_max(nbytes, n), 1, n, XCCL_STEP_MAX + 1u));
    out->steps        = xccl_pat_pipe_rounds(&p);
    out->bytes        = 2 * f * (double)nbytes;
    out->reduce_bytes = f * (double)nbytes;
}

const xccl_algo_t xccl_algo_allreduce_ring = {
    .name     = "ring",
    .coll     = XCCL_COLL_ALLREDUCE,
    .summary  = "pipelined ring reduce-scatter + all-gather: 2(n-1) steps, 2(n-1)/n N bytes",
    .cost     = ring_cost,
    .progress = ring_progress,
};

/* ---------------------------------------------------------------------------------------------
 * rd: recursive doubling on the whole vector, folded for n != 2^k (xccl_pat_fold).
 *
 *   stage       who                       sends                  receives, then
 *   0           extra r >= p              N to r-p               -
 *               proxy r < n-p             -                      N from r+p; buf op= it
 *   1 .. L      r < p, round i = stage-1  N to r ^ 2^i           N from r ^ 2^i; buf op= it
 *   L+1         proxy                     N to r+p               -
 *               extra                     -                      N from r-p into buf
 *
 * (L = log2 p.) Both partners combine (lower rank's data) op (higher rank's data).
 * cost: L + 2[x] α, (L + 2[x]) N β, (L + [x]) N γ.
 * ------------------------------------------------------------------------------------------- */

/* buf = (data of the lower of rank/peer) op (data of the higher one). */
static xccl_status_t reduce_ordered(xccl_task_t *t, int peer, void *buf, const void *tmp,
                                    size_t count)
{
    if (peer < xccl_task_rank(t)) return xccl_pat_reduce_nz(t, buf, tmp, buf, count);
    return xccl_pat_reduce_nz(t, buf, buf, tmp, count);
}

static xccl_status_t rd_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    uint64_t               *w = xccl_task_state(t); /* w[0]: next stage */
    int                     r = xccl_task_rank(t), n = xccl_task_size(t);
    size_t                  nbytes = a->count * a->elsize;
    xccl_pat_fold_t         f = xccl_pat_fold(r, n);
    char                   *buf = a->rbuf, *tmp;
    xccl_status_t           st;

    if (n == 1 || nbytes == 0) return XCCL_OK;
    tmp = scratch(t, nbytes, "rd");
    if (tmp == NULL) return XCCL_ERR_NO_MEMORY;

    while ((st = xccl_task_test(t)) == XCCL_OK) {
        int k = (int)w[0];

        /* finish stage k-1 */
        if (k == 1 && f.role == XCCL_PAT_PROXY)
            XCCL_CHECK(reduce_ordered(t, f.peer, buf, tmp, a->count));
        if (k >= 2 && k <= f.log_p + 1 && f.role != XCCL_PAT_EXTRA)
            XCCL_CHECK(reduce_ordered(t, xccl_pat_rd_partner(r, k - 2), buf, tmp, a->count));
        if (k == f.log_p + 2) return XCCL_OK;

        /* post stage k */
        if (k == 0 && f.role == XCCL_PAT_EXTRA) {
            XCCL_CHECK(xccl_task_isend(t, f.peer, buf, nbytes, 0));
        } else if (k == 0 && f.role == XCCL_PAT_PROXY) {
            XCCL_CHECK(xccl_task_irecv(t, f.peer, tmp, nbytes, 0));
        } else if (k >= 1 && k <= f.log_p && f.role != XCCL_PAT_EXTRA) {
            int peer = xccl_pat_rd_partner(r, k - 1);
            XCCL_CHECK(xccl_task_irecv(t, peer, tmp, nbytes, (uint32_t)k));
            XCCL_CHECK(xccl_task_isend(t, peer, buf, nbytes, (uint32_t)k));
        } else if (k == f.log_p + 1 && f.role == XCCL_PAT_PROXY) {
            XCCL_CHECK(xccl_task_isend(t, f.peer, buf, nbytes, (uint32_t)k));
        } else if (k == f.log_p + 1 && f.role == XCCL_PAT_EXTRA) {
            XCCL_CHECK(xccl_task_irecv(t, f.peer, buf, nbytes, (uint32_t)k));
        }
        w[0] = (uint64_t)k + 1;
    }
    return st;
}

static void rd_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    int    L    = xccl_pat_log2_floor(n);
    double fold = xccl_pat_is_pow2(n) ? 0 : 1;

    out->steps        = L + 2 * fold;
    out->bytes        = (L + 2 * fold) * (double)nbytes;
    out->reduce_bytes = (L + fold) * (double)nbytes;
}

const xccl_algo_t xccl_algo_allreduce_rd = {
    .name     = "rd",
    .coll     = XCCL_COLL_ALLREDUCE,
    .summary  = "recursive doubling on the whole vector: log2(n) steps, log2(n) N bytes",
    .cost     = rd_cost,
    .progress = rd_progress,
};

/* ---------------------------------------------------------------------------------------------
 * rabenseifner: reduce-scatter by recursive halving, then all-gather by recursive doubling,
 * on the p ranks left after the fold; the vector is cut into p blocks (xccl_pat_block).
 *
 *   stage            who             exchanges with        sends / receives
 *   0                extra / proxy   r-p / r+p             fold-in: N, proxy buf op= it
 *   1 .. L           r < p           r ^ d, d = p/2^stage  the half of its 2d-block range it
 *                                                          gives up / the half it keeps,
 *                                                          then buf op= it (N/2, N/4, ...)
 *   L+1 .. 2L        r < p           r ^ d, d = 2^(s-L-1)  its d blocks / the partner's d
 *                                                          blocks into buf (N/p, 2N/p, ...)
 *   2L+1             proxy / extra   r+p / r-p             fold-out: N
 *
 * The rank with bit d clear keeps the lower half, so after halving rank v owns block v.
 * cost: 2L + 2[x] α, (2(p-1)/p + 2[x]) N β, ((p-1)/p + [x]) N γ.
 * ------------------------------------------------------------------------------------------- */

/* Elements of blocks [b0, b1) of the p-block split: offset and count. */
static size_t rab_range(size_t count, int p, int b0, int b1, size_t *off)
{
    *off = xccl_pat_block_off(count, p, b0);
    return xccl_pat_block_off(count, p, b1) - *off;
}

static xccl_status_t rab_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    uint64_t               *w = xccl_task_state(t); /* w[0]: next stage */
    int                     r = xccl_task_rank(t), n = xccl_task_size(t);
    size_t                  es = a->elsize, nbytes = a->count * es;
    xccl_pat_fold_t         f = xccl_pat_fold(r, n);
    int                     L = f.log_p, p = f.p;
    char                   *buf = a->rbuf, *tmp;
    xccl_status_t           st;

    if (n == 1 || nbytes == 0) return XCCL_OK;
    tmp = scratch(t, nbytes, "rabenseifner");
    if (tmp == NULL) return XCCL_ERR_NO_MEMORY;

    while ((st = xccl_task_test(t)) == XCCL_OK) {
        int    k = (int)w[0];
        size_t off, cnt;

        /* finish stage k-1: fold-in or a halving round reduces what arrived in tmp */
        if (k == 1 && f.role == XCCL_PAT_PROXY)
            XCCL_CHECK(reduce_ordered(t, f.peer, buf, tmp, a->count));
        if (k >= 2 && k <= L + 1 && f.role != XCCL_PAT_EXTRA) {
            int d = p >> (k - 1), lo = xccl_pat_rd_range_lo(r, 2 * d);
            int keep = (r & d) ? lo + d : lo;
            cnt      = rab_range(a->count, p, keep, keep + d, &off);
            XCCL_CHECK(reduce_ordered(t, r ^ d, buf + off * es, tmp, cnt));
        }
        if (k == 2 * L + 2) return XCCL_OK;

        /* post stage k */
        if (k == 0 && f.role == XCCL_PAT_EXTRA) {
            XCCL_CHECK(xccl_task_isend(t, f.peer, buf, nbytes, 0));
        } else if (k == 0 && f.role == XCCL_PAT_PROXY) {
            XCCL_CHECK(xccl_task_irecv(t, f.peer, tmp, nbytes, 0));
        } else if (k >= 1 && k <= L && f.role != XCCL_PAT_EXTRA) {
            int    d = p >> k, lo = xccl_pat_rd_range_lo(r, 2 * d);
            int    keep = (r & d) ? lo + d : lo, give = (r & d) ? lo : lo + d;
            size_t goff, gcnt;
            cnt  = rab_range(a->count, p, keep, keep + d, &off);
            gcnt = rab_range(a->count, p, give, give + d, &goff);
            XCCL_CHECK(xccl_pat_recv_nz(t, r ^ d, tmp, cnt * es, (uint32_t)k));
            XCCL_CHECK(xccl_pat_send_nz(t, r ^ d, buf + goff * es, gcnt * es, (uint32_t)k));
        } else if (k >= L + 1 && k <= 2 * L && f.role != XCCL_PAT_EXTRA) {
            int    d = 1 << (k - L - 1), peer = r ^ d;
            int    mine = xccl_pat_rd_range_lo(r, d), theirs = xccl_pat_rd_range_lo(peer, d);
            size_t poff, pcnt;
            cnt  = rab_range(a->count, p, mine, mine + d, &off);
            pcnt = rab_range(a->count, p, theirs, theirs + d, &poff);
            XCCL_CHECK(xccl_pat_recv_nz(t, peer, buf + poff * es, pcnt * es, (uint32_t)k));
            XCCL_CHECK(xccl_pat_send_nz(t, peer, buf + off * es, cnt * es, (uint32_t)k));
        } else if (k == 2 * L + 1 && f.role == XCCL_PAT_PROXY) {
            XCCL_CHECK(xccl_task_isend(t, f.peer, buf, nbytes, (uint32_t)k));
        } else if (k == 2 * L + 1 && f.role == XCCL_PAT_EXTRA) {
            XCCL_CHECK(xccl_task_irecv(t, f.peer, buf, nbytes, (uint32_t)k));
        }
        w[0] = (uint64_t)k + 1;
    }
    return st;
}

static void rab_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    int    L    = xccl_pat_log2_floor(n), p = 1 << L;
    double fold = xccl_pat_is_pow2(n) ? 0 : 1, f = (double)(p - 1) / p;

    out->steps        = 2 * L + 2 * fold;
    out->bytes        = (2 * f + 2 * fold) * (double)nbytes;
    out->reduce_bytes = (f + fold) * (double)nbytes;
}

const xccl_algo_t xccl_algo_allreduce_rabenseifner = {
    .name     = "rabenseifner",
    .coll     = XCCL_COLL_ALLREDUCE,
    .summary  = "recursive-halving reduce-scatter + recursive-doubling all-gather: "
                "2 log2(n) steps, 2(n-1)/n N bytes",
    .cost     = rab_cost,
    .progress = rab_progress,
};

/* ---------------------------------------------------------------------------------------------
 * direct: one step; every rank sends its vector to every other rank and reduces the n
 * vectors in rank order, ((x0 op x1) op x2) ..., accumulating in the scratch copy of x0 (or
 * of x1 on rank 0) so that its own x_r is read before buf is overwritten last.
 *
 *   stage   sends                      receives
 *   0       N to each of the n-1 peers N from each peer into scratch slot
 *   1       -                          -              buf = x0 op x1 op ... op x(n-1)
 *
 * cost: 1 + (n-2)/8 α (xccl_pat_direct_steps), (n-1) N β (they share the sender's link),
 * (n-1) N γ. Scratch: (n-1) N.
 * ------------------------------------------------------------------------------------------- */
/* Where rank j's vector is: buf for this rank, else its slot of the scratch. */
static char *slot(char *buf, char *tmp, int rank, int j, size_t nbytes)
{
    return j == rank ? buf : tmp + (size_t)(j < rank ? j : j - 1) * nbytes;
}

static xccl_status_t direct_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    uint64_t               *w = xccl_task_state(t); /* w[0]: 1 once posted */
    int                     r = xccl_task_rank(t), n = xccl_task_size(t);
    size_t                  nbytes = a->count * a->elsize;
    char                   *buf = a->rbuf, *tmp, *acc;
    xccl_status_t           st;

    if (n == 1 || nbytes == 0) return XCCL_OK;
    tmp = scratch(t, (size_t)(n - 1) * nbytes, "direct");
    if (tmp == NULL) return XCCL_ERR_NO_MEMORY;
    if (w[0] == 0) {
        for (int i = 1; i < n; i++) {
            int from = xccl_pat_mod(r - i, n);
            XCCL_CHECK(xccl_task_irecv(t, from, slot(buf, tmp, r, from, nbytes), nbytes, 0));
            XCCL_CHECK(xccl_task_isend(t, xccl_pat_mod(r + i, n), buf, nbytes, 0));
        }
        w[0] = 1;
    }
    st = xccl_task_test(t);
    if (st != XCCL_OK) return st;
    acc = slot(buf, tmp, r, r == 0 ? 1 : 0, nbytes);
    for (int j = 1; j < n; j++)
        XCCL_CHECK(xccl_task_reduce(t, j == n - 1 ? buf : acc,
                                    j == 1 ? slot(buf, tmp, r, 0, nbytes) : acc,
                                    slot(buf, tmp, r, j, nbytes), a->count));
    return XCCL_OK;
}

/* Only while the scratch ((n-1) N) stays below DIRECT_MAX_SCRATCH: meant for small vectors. */
static int direct_applicable(const xccl_coll_args_t *a, int size)
{
    return a->count == 0 || (size_t)(size - 1) * a->count * a->elsize <= DIRECT_MAX_SCRATCH;
}

static void direct_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    out->steps        = xccl_pat_direct_steps(n);
    out->bytes        = (double)(n - 1) * (double)nbytes;
    out->reduce_bytes = (double)(n - 1) * (double)nbytes;
}

const xccl_algo_t xccl_algo_allreduce_direct = {
    .name       = "direct",
    .coll       = XCCL_COLL_ALLREDUCE,
    .summary    = "every rank sends its vector to every other and reduces in rank order: "
                  "1 round of n-1 messages, (n-1) N bytes",
    .applicable = direct_applicable,
    .cost       = direct_cost,
    .progress   = direct_progress,
};
