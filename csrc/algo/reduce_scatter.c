/* SPDX-License-Identifier: Apache-2.0
 *
 * reduce_scatter.c - XCCL_COLL_REDUCE_SCATTER: ring (pipelined), recursive halving ("rhd")
 * and direct exchange.
 *
 * sbuf holds n blocks of count elements (read-only); block j of every rank is reduced into
 * rbuf of rank j. N = n * count * elsize is the whole input. All three read block r of sbuf
 * only in their final reduction, which writes rbuf, so rbuf may even be that block.
 * Costs are per rank on the critical path; p = 2^floor(log2 n), [x] = 1 when n != p.
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
        XCCL_ERROR(XCCL_ERR_NO_MEMORY,
                   "reduce_scatter %s: rank %d: no memory for %zu B of scratch", algo,
                   xccl_task_rank(t), nbytes);
    return p;
}

/* Size 1 (or nothing to do): the result is the rank's own block. Returns 1 when done. */
static int trivial(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    size_t                  nbytes = a->count * a->elsize;

    if (a->count == 0) return 1;
    if (xccl_task_size(t) > 1) return 0;
    /* a failed copy fails the task's next test or its completion (algo.h) */
    (void)xccl_task_copy(t, a->rbuf, a->sbuf, nbytes);
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * The ring reduce-scatter (ring.h)
 * ------------------------------------------------------------------------------------------- */

/* Offset (elements) of block b in the input. */
static size_t rs_block_off(const xccl_ring_rs_t *x, int b)
{
    return x->equal ? (size_t)b * x->count : xccl_pat_block_off(x->count, x->size, b);
}

size_t xccl_ring_rs_chunk(const xccl_ring_rs_t *x, int b, int c, size_t *off)
{
    size_t bcnt = x->equal ? x->count : xccl_pat_block_count(x->count, x->size, b);

    *off = rs_block_off(x, b) + xccl_pat_block_off(bcnt, x->pipe.nchunks, c);
    return xccl_pat_block_count(bcnt, x->pipe.nchunks, c);
}

/* Elements of a stage slot: the largest chunk. */
static size_t rs_slot(const xccl_ring_rs_t *x)
{
    size_t bmax = x->equal ? x->count : xccl_pat_block_max(x->count, x->size);

    return xccl_pat_block_max(bmax, x->pipe.nchunks);
}

size_t xccl_ring_rs_stage_bytes(const xccl_ring_rs_t *x)
{
    return (x->in_place ? 1 : 2) * (size_t)x->pipe.nchunks * rs_slot(x) * x->es;
}

/* Where chunk c of step s is received. */
static char *rs_stage(const xccl_ring_rs_t *x, int s, int c)
{
    size_t set = x->in_place ? 0 : (size_t)(s & 1);

    return x->stage + (set * (size_t)x->pipe.nchunks + (size_t)c) * rs_slot(x) * x->es;
}

xccl_status_t xccl_ring_rs_post(const xccl_ring_rs_t *x, int s, int c)
{
    int         n = x->size, r = x->rank;
    int         sb = xccl_pat_ring_rs_send_block(r, n, s);
    int         rb = xccl_pat_ring_rs_recv_block(r, n, s);
    uint32_t    step = xccl_pat_step_wrap(x->t, xccl_pat_pipe_step(&x->pipe, s, c));
    size_t      soff, roff, scnt = xccl_ring_rs_chunk(x, sb, c, &soff);
    size_t      rcnt = xccl_ring_rs_chunk(x, rb, c, &roff);
    const char *src  = s == 0 || x->in_place ? x->in + soff * x->es : rs_stage(x, s - 1, c);

    XCCL_CHECK(xccl_pat_recv_nz(x->t, xccl_pat_ring_prev(r, n), rs_stage(x, s, c), rcnt * x->es,
                                step));
    return xccl_pat_send_nz(x->t, xccl_pat_ring_next(r, n), src, scnt * x->es, step);
}

xccl_status_t xccl_ring_rs_reduce(const xccl_ring_rs_t *x, int j, int urgent)
{
    for (int s = 0; s < x->size - 1; s++) {
        int    c = xccl_pat_pipe_chunk(&x->pipe, s, j), b;
        size_t off, cnt;
        char  *mine, *dst;

        if (c < 0) continue;
        if ((xccl_pat_pipe_chunk(&x->pipe, s + 1, j + 1) == c) != urgent) continue;
        b    = xccl_pat_ring_rs_recv_block(x->rank, x->size, s);
        cnt  = xccl_ring_rs_chunk(x, b, c, &off);
        mine = x->in + off * x->es;
        if (x->in_place) dst = mine;
        else if (s == x->size - 2) dst = x->out + (off - rs_block_off(x, b)) * x->es;
        else dst = rs_stage(x, s, c);
        XCCL_CHECK(xccl_pat_reduce_nz(x->t, dst, rs_stage(x, s, c), mine, cnt));
    }
    return XCCL_OK;
}

/* ---------------------------------------------------------------------------------------------
 * ring: the ring reduce-scatter of ring.h, partial sums in the stage, n-1 steps of chunks of at
 * most $XCCL_RING_CHUNK_BYTES. cost: n-1 α (2(n-2) + C rounds with C > 1 chunks),
 * (n-1)/n N β, (n-1)/n N γ.
 * ------------------------------------------------------------------------------------------- */
static xccl_status_t ring_post(const void *arg, int k)
{
    const xccl_ring_rs_t *x = arg;

    for (int s = 0; s < x->pipe.nsteps; s++) {
        int c = xccl_pat_pipe_chunk(&x->pipe, s, k);
        if (c >= 0) XCCL_CHECK(xccl_ring_rs_post(x, s, c));
    }
    return XCCL_OK;
}

static xccl_status_t ring_reduce(const void *arg, int j, int urgent)
{
    return xccl_ring_rs_reduce(arg, j, urgent);
}

/* Chunks per block of a ring over n ranks (n - 1 steps). */
static int ring_nchunks(size_t block_bytes, size_t elsize, int n, uint32_t step_limit)
{
    return xccl_pat_ring_chunks_env(block_bytes, elsize, n - 1, step_limit);
}

static xccl_status_t ring_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    uint64_t               *w = xccl_task_state(t); /* w[0]: next round, w[1]: chunks */
    xccl_ring_rs_t          x;

    if (trivial(t)) return XCCL_OK;
    memset(&x, 0, sizeof(x));
    x.t     = t;
    x.rank  = xccl_task_rank(t);
    x.size  = xccl_task_size(t);
    x.in    = (char *)a->sbuf; /* read only: not in place */
    x.out   = a->rbuf;
    x.count = a->count;
    x.es    = a->elsize;
    x.equal = 1;
    if (w[1] == 0)
        w[1] = (uint64_t)ring_nchunks(x.count * x.es, x.es, x.size, xccl_task_step_limit(t));
    x.pipe  = xccl_pat_pipe(x.size - 1, x.size - 1, (int)w[1]);
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
    p = xccl_pat_pipe(n - 1, n - 1, ring_nchunks(nbytes / (size_t)n, 1, n, XCCL_STEP_MAX + 1u));
    out->steps        = xccl_pat_pipe_rounds(&p);
    out->bytes        = f * (double)nbytes;
    out->reduce_bytes = f * (double)nbytes;
}

const xccl_algo_t xccl_algo_reduce_scatter_ring = {
    .name     = "ring",
    .coll     = XCCL_COLL_REDUCE_SCATTER,
    .summary  = "pipelined ring: n-1 steps, (n-1)/n N bytes",
    .cost     = ring_cost,
    .progress = ring_progress,
};

/* ---------------------------------------------------------------------------------------------
 * rhd: recursive halving on the folded group (xccl_pat_fold). An extra rank r >= p gives its
 * whole input to its proxy r-p, which then works for both ranks: part v of the halving is
 * block v plus, on a proxy, block v+p (xccl_pat_fold_parts), so a message is at most two
 * contiguous runs of blocks, sent as two messages.
 *
 *   stage     who            with      sends                 receives, then
 *   0         extra          r-p       N (all of sbuf)       -
 *             proxy          r+p       -                     N -> work; work = sbuf op work
 *   1 .. L    r < p          r ^ d     the parts it gives    the parts it keeps -> stage;
 *             d = p/2^stage            up (from sbuf in       work = (sbuf or work) op stage,
 *                                      stage 1 unless proxy)  block r into rbuf at stage L
 *   L+1       proxy          r+p       block r+p (N/n)       -
 *             extra          r-p       -                     N/n into rbuf
 *
 * Rank 0 is on the critical path: it keeps K = sum over d of (d + min(d, n-p)) blocks, which
 * is p-1 blocks when n = p (the proxies' parts are double, and all in the lower halves).
 * cost: L + 2[x] α, K N/n + [x](N + N/n) β, K N/n + [x] N γ. Scratch: N plus the largest
 * half (about N/2) on ranks < p.
 * ------------------------------------------------------------------------------------------- */
typedef struct rhd_ctx {
    xccl_task_t    *t;
    const char     *sbuf;
    char           *rbuf, *work, *stage;
    size_t          count, es;
    int             rank, size;
    xccl_pat_fold_t f;
} rhd_ctx_t;

/* Halving round with distance d: the parts this rank keeps and gives up, as [lo, lo + d). */
static void rhd_halves(int v, int d, int *keep, int *give)
{
    int lo = xccl_pat_rd_range_lo(v, 2 * d);
    *keep  = (v & d) ? lo + d : lo;
    *give  = (v & d) ? lo : lo + d;
}

/* Posts the two runs of parts [lo, lo + d): from `src` (send) or into `stage` (receive). */
static xccl_status_t rhd_xfer(const rhd_ctx_t *x, int send, int peer, const char *src, int lo,
                              int d, uint32_t step)
{
    int    run[4];
    size_t bb = x->count * x->es, at = 0;

    xccl_pat_fold_parts(x->f.p, x->f.extra, lo, lo + d, &run[0], &run[1], &run[2], &run[3]);
    for (int i = 0; i < 4; i += 2) {
        size_t nbytes = (size_t)(run[i + 1] - run[i]) * bb;
        if (send) {
            XCCL_CHECK(xccl_pat_send_nz(x->t, peer, src + (size_t)run[i] * bb, nbytes, step));
        } else {
            XCCL_CHECK(xccl_pat_recv_nz(x->t, peer, x->stage + at, nbytes, step));
            at += nbytes;
        }
    }
    return XCCL_OK;
}

/* After the halving round of distance d: work (or rbuf) = src op stage over the kept parts. */
static xccl_status_t rhd_reduce(const rhd_ctx_t *x, int d, const char *src)
{
    int    keep, give, run[4], peer = x->rank ^ d;
    size_t bb = x->count * x->es, at = 0;

    rhd_halves(x->rank, d, &keep, &give);
    xccl_pat_fold_parts(x->f.p, x->f.extra, keep, keep + d, &run[0], &run[1], &run[2], &run[3]);
    for (int i = 0; i < 4; i += 2) {
        for (int b = run[i]; b < run[i + 1]; b++) {
            char       *dst  = b == x->rank && d == 1 ? x->rbuf : x->work + (size_t)b * bb;
            const char *mine = src + (size_t)b * bb, *theirs = x->stage + at;
            if (peer < x->rank)
                XCCL_CHECK(xccl_pat_reduce_nz(x->t, dst, theirs, mine, x->count));
            else
                XCCL_CHECK(xccl_pat_reduce_nz(x->t, dst, mine, theirs, x->count));
            at += bb;
        }
    }
    return XCCL_OK;
}

static xccl_status_t rhd_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    uint64_t               *w = xccl_task_state(t); /* w[0]: next stage */
    rhd_ctx_t               x;
    xccl_status_t           st;
    size_t                  nbytes, bb;
    int                     L, p, d0;

    if (trivial(t)) return XCCL_OK;
    x.t     = t;
    x.rank  = xccl_task_rank(t);
    x.size  = xccl_task_size(t);
    x.sbuf  = a->sbuf;
    x.rbuf  = a->rbuf;
    x.count = a->count;
    x.es    = a->elsize;
    x.f     = xccl_pat_fold(x.rank, x.size);
    L       = x.f.log_p;
    p       = x.f.p;
    bb      = x.count * x.es;
    nbytes  = (size_t)x.size * bb;
    d0      = p / 2;
    x.work = x.stage = NULL;
    if (x.f.role != XCCL_PAT_EXTRA) {
        size_t half = (size_t)(d0 + (d0 < x.f.extra ? d0 : x.f.extra)) * bb;
        x.work      = scratch(t, nbytes + half, "rhd");
        if (x.work == NULL) return XCCL_ERR_NO_MEMORY;
        x.stage = x.work + nbytes;
    }

    while ((st = xccl_task_test(t)) == XCCL_OK) {
        int         k   = (int)w[0];
        const char *cur = x.f.role == XCCL_PAT_PROXY || k > 1 ? x.work : x.sbuf;

        /* finish stage k-1 */
        if (k == 1 && x.f.role == XCCL_PAT_PROXY)
            XCCL_CHECK(xccl_task_reduce(t, x.work, x.sbuf, x.work, (size_t)x.size * x.count));
        if (k >= 2 && k <= L + 1 && x.f.role != XCCL_PAT_EXTRA)
            XCCL_CHECK(rhd_reduce(&x, p >> (k - 1),
                                  k == 2 && x.f.role != XCCL_PAT_PROXY ? x.sbuf : x.work));
        if (k == L + 2) return XCCL_OK;

        /* post stage k */
        if (k == 0 && x.f.role == XCCL_PAT_EXTRA) {
            XCCL_CHECK(xccl_task_isend(t, x.f.peer, x.sbuf, nbytes, 0));
        } else if (k == 0 && x.f.role == XCCL_PAT_PROXY) {
            XCCL_CHECK(xccl_task_irecv(t, x.f.peer, x.work, nbytes, 0));
        } else if (k >= 1 && k <= L && x.f.role != XCCL_PAT_EXTRA) {
            int d = p >> k, keep, give;
            rhd_halves(x.rank, d, &keep, &give);
            XCCL_CHECK(rhd_xfer(&x, 0, x.rank ^ d, NULL, keep, d, (uint32_t)k));
            XCCL_CHECK(rhd_xfer(&x, 1, x.rank ^ d, cur, give, d, (uint32_t)k));
        } else if (k == L + 1 && x.f.role == XCCL_PAT_PROXY) {
            XCCL_CHECK(xccl_task_isend(t, x.f.peer, x.work + (size_t)x.f.peer * bb, bb,
                                       (uint32_t)k));
        } else if (k == L + 1 && x.f.role == XCCL_PAT_EXTRA) {
            XCCL_CHECK(xccl_task_irecv(t, x.f.peer, x.rbuf, bb, (uint32_t)k));
        }
        w[0] = (uint64_t)k + 1;
    }
    return st;
}

static void rhd_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    xccl_pat_fold_t f    = xccl_pat_fold(0, n); /* rank 0 keeps the most blocks */
    double          bb   = (double)nbytes / n, kept = 0;
    double          fold = f.extra > 0 ? 1 : 0;

    for (int d = f.p / 2; d >= 1; d /= 2) kept += d + (d < f.extra ? d : f.extra);
    out->steps        = f.log_p + 2 * fold;
    out->bytes        = kept * bb + fold * ((double)nbytes + bb);
    out->reduce_bytes = kept * bb + fold * (double)nbytes;
}

const xccl_algo_t xccl_algo_reduce_scatter_rhd = {
    .name     = "rhd",
    .coll     = XCCL_COLL_REDUCE_SCATTER,
    .summary  = "recursive halving: log2(n) steps, (n-1)/n N bytes (2 more steps and about "
                "N more bytes when n is not a power of two)",
    .cost     = rhd_cost,
    .progress = rhd_progress,
};

/* ---------------------------------------------------------------------------------------------
 * direct: one round; rank r sends block j of sbuf to every rank j != r, receives block r of
 * every other rank, and reduces the n blocks in rank order, x0[r] op x1[r] op ..., through
 * the scratch slot of rank 0 (rank 1 on rank 0); the last operation writes rbuf.
 *
 *   stage   sends                          receives
 *   0       block j (N/n) to each j != r   block r from each peer into scratch slot
 *   1       -                              -            rbuf = x0[r] op ... op x(n-1)[r]
 *
 * cost: 1 + (n-2)/8 α (xccl_pat_direct_steps), (n-1)/n N β, (n-1)/n N γ. Scratch: (n-1)/n N.
 * ------------------------------------------------------------------------------------------- */
/* Block `rank` of rank j's input: in sbuf for this rank, else in scratch slot j (j-1 above
 * this rank). The own block is only ever read. */
static char *direct_block(const xccl_coll_args_t *a, char *tmp, int rank, int j)
{
    size_t bb = a->count * a->elsize;

    if (j == rank) return (char *)a->sbuf + (size_t)rank * bb;
    return tmp + (size_t)(j < rank ? j : j - 1) * bb;
}

static xccl_status_t direct_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    uint64_t               *w = xccl_task_state(t); /* w[0]: 1 once posted */
    int                     r = xccl_task_rank(t), n = xccl_task_size(t);
    size_t                  bb   = a->count * a->elsize;
    const char             *sbuf = a->sbuf;
    char                   *tmp, *acc;
    xccl_status_t           st;

    if (trivial(t)) return XCCL_OK;
    tmp = scratch(t, (size_t)(n - 1) * bb, "direct");
    if (tmp == NULL) return XCCL_ERR_NO_MEMORY;
    if (w[0] == 0) {
        for (int i = 1; i < n; i++) {
            int to = xccl_pat_mod(r + i, n), from = xccl_pat_mod(r - i, n);
            XCCL_CHECK(xccl_task_irecv(t, from, direct_block(a, tmp, r, from), bb, 0));
            XCCL_CHECK(xccl_task_isend(t, to, sbuf + (size_t)to * bb, bb, 0));
        }
        w[0] = 1;
    }
    st = xccl_task_test(t);
    if (st != XCCL_OK) return st;
    acc = direct_block(a, tmp, r, r == 0 ? 1 : 0);
    for (int j = 1; j < n; j++)
        XCCL_CHECK(xccl_task_reduce(t, j == n - 1 ? a->rbuf : acc,
                                    j == 1 ? direct_block(a, tmp, r, 0) : acc,
                                    direct_block(a, tmp, r, j), a->count));
    return XCCL_OK;
}

/* Only while the scratch ((n-1)/n N) stays below DIRECT_MAX_SCRATCH: meant for small vectors. */
static int direct_applicable(const xccl_coll_args_t *a, int size)
{
    return a->count == 0 || (size_t)(size - 1) * a->count * a->elsize <= DIRECT_MAX_SCRATCH;
}

static void direct_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    double f = n > 1 ? (double)(n - 1) / n : 0;

    out->steps        = xccl_pat_direct_steps(n);
    out->bytes        = f * (double)nbytes;
    out->reduce_bytes = f * (double)nbytes;
}

const xccl_algo_t xccl_algo_reduce_scatter_direct = {
    .name       = "direct",
    .coll       = XCCL_COLL_REDUCE_SCATTER,
    .summary    = "block j straight to rank j, reduced there in rank order: 1 round of n-1 "
                  "messages, (n-1)/n N bytes",
    .applicable = direct_applicable,
    .cost       = direct_cost,
    .progress   = direct_progress,
};
