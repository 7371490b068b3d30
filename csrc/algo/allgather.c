/* SPDX-License-Identifier: Apache-2.0
 *
 * allgather.c - XCCL_COLL_ALLGATHER: ring (pipelined), recursive doubling ("rd", folded for
 * n != 2^k), Bruck and direct exchange.
 *
 * rbuf holds n blocks of count elements, block r already in place on rank r; everything
 * moves straight between rbufs (no scratch, no reduction). N = n * count * elsize is the
 * whole output. Costs are per rank on the critical path; p = 2^floor(log2 n), [x] = 1 when
 * n != p.
 */
#include "algo/algo.h"

#include <string.h>

#include "algo/patterns.h"
#include "core/check.h"

/* Sends (or receives) blocks [b0, b1) of rbuf. */
static xccl_status_t xfer_blocks(xccl_task_t *t, int send, int peer, int b0, int b1,
                                 uint32_t step)
{
    const xccl_coll_args_t *a  = xccl_task_args(t);
    size_t                  bb = a->count * a->elsize;
    char                   *p  = (char *)a->rbuf + (size_t)b0 * bb;
    size_t                  nbytes = (size_t)(b1 - b0) * bb;

    return send ? xccl_pat_send_nz(t, peer, p, nbytes, step) : xccl_pat_recv_nz(t, peer, p, nbytes, step);
}

/* ---------------------------------------------------------------------------------------------
 * ring: n-1 steps; rank r sends block r-s to r+1 and receives block r-s-1 from r-1 (the
 * block it forwards next step). Blocks are cut into C chunks of at most
 * $XCCL_RING_CHUNK_BYTES; chunk c of step s is message s*C + c and goes out one round
 * after chunk c of step s-1 arrived (xccl_pat_pipe, lag 1).
 *
 *   step s       send to r+1       receive from r-1
 *   0 .. n-2     block r-s         block r-s-1
 *
 * cost: n-2 + C α, (n-1)/n N β.
 * ------------------------------------------------------------------------------------------- */
/* Chunks per block of a ring over n ranks (n - 1 steps). */
static int ring_nchunks(size_t block_bytes, size_t elsize, int n, uint32_t step_limit)
{
    return xccl_pat_ring_chunks_env(block_bytes, elsize, n - 1, step_limit);
}

static xccl_status_t ring_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    uint64_t               *w = xccl_task_state(t); /* w[0]: next round, w[1]: chunks */
    int                     r = xccl_task_rank(t), n = xccl_task_size(t);
    size_t                  es = a->elsize, count = a->count;
    char                   *buf = a->rbuf;
    xccl_pat_pipe_t         pipe;
    xccl_status_t           st;

    if (n == 1 || count == 0) return XCCL_OK;
    if (w[1] == 0)
        w[1] = (uint64_t)ring_nchunks(count * es, es, n, xccl_task_step_limit(t));
    pipe = xccl_pat_pipe(n - 1, 0, (int)w[1]);

    while ((st = xccl_task_test(t)) == XCCL_OK) {
        int k = (int)w[0];

        if (k >= xccl_pat_pipe_rounds(&pipe)) return XCCL_OK;
        for (int s = 0; s < pipe.nsteps; s++) {
            int      c = xccl_pat_pipe_chunk(&pipe, s, k);
            int      sb = xccl_pat_ring_ag_send_block(r, n, s);
            int      rb = xccl_pat_ring_ag_recv_block(r, n, s);
            size_t   off, cnt;
            uint32_t step;

            if (c < 0) continue;
            step = xccl_pat_step_wrap(t, xccl_pat_pipe_step(&pipe, s, c));
            off  = xccl_pat_block_off(count, pipe.nchunks, c);
            cnt  = xccl_pat_block_count(count, pipe.nchunks, c);
            XCCL_CHECK(xccl_pat_recv_nz(t, xccl_pat_ring_prev(r, n), buf + ((size_t)rb * count + off) * es,
                               cnt * es, step));
            XCCL_CHECK(xccl_pat_send_nz(t, xccl_pat_ring_next(r, n), buf + ((size_t)sb * count + off) * es,
                               cnt * es, step));
        }
        w[0] = (uint64_t)k + 1;
    }
    return st;
}

static void ring_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    xccl_pat_pipe_t p;

    memset(out, 0, sizeof(*out));
    if (n == 1) return;
    p          = xccl_pat_pipe(n - 1, 0,
                               ring_nchunks(nbytes / (size_t)n, 1, n, XCCL_STEP_MAX + 1u));
    out->steps = xccl_pat_pipe_rounds(&p);
    out->bytes = (double)(n - 1) / n * (double)nbytes;
}

const xccl_algo_t xccl_algo_allgather_ring = {
    .name     = "ring",
    .coll     = XCCL_COLL_ALLGATHER,
    .summary  = "pipelined ring: n-1 steps, (n-1)/n N bytes",
    .cost     = ring_cost,
    .progress = ring_progress,
};

/* ---------------------------------------------------------------------------------------------
 * rd: recursive doubling on the folded group (xccl_pat_fold): part v is block v plus, on a
 * proxy, block v+p of its extra rank (xccl_pat_fold_parts), so an exchange is at most two
 * runs of blocks, sent as two messages.
 *
 *   stage     who          with       sends                      receives
 *   0         extra        r-p        block r (N/n)              -
 *             proxy        r+p        -                          block r+p
 *   1 .. L    r < p        r ^ 2^i    its 2^i parts              the partner's 2^i parts
 *             i = stage-1
 *   L+1       proxy        r+p        every block but r+p        -
 *             extra        r-p        -                          every block but r
 *
 * Rank 0 is on the critical path: in the rounds it sends S = sum over d of (d + min(d, n-p))
 * blocks, p-1 when n = p.
 * cost: L + 2[x] α, (S + [x] n) N/n β (the fold adds one block in and n-1 out).
 * ------------------------------------------------------------------------------------------- */
static xccl_status_t rd_parts(xccl_task_t *t, int send, int peer, const xccl_pat_fold_t *f,
                              int lo, int d, uint32_t step)
{
    int run[4];

    xccl_pat_fold_parts(f->p, f->extra, lo, lo + d, &run[0], &run[1], &run[2], &run[3]);
    XCCL_CHECK(xfer_blocks(t, send, peer, run[0], run[1], step));
    return xfer_blocks(t, send, peer, run[2], run[3], step);
}

static xccl_status_t rd_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    uint64_t               *w = xccl_task_state(t); /* w[0]: next stage */
    int                     r = xccl_task_rank(t), n = xccl_task_size(t);
    xccl_pat_fold_t         f = xccl_pat_fold(r, n);
    xccl_status_t           st;

    if (n == 1 || a->count == 0) return XCCL_OK;
    while ((st = xccl_task_test(t)) == XCCL_OK) {
        int      k    = (int)w[0];
        uint32_t step = (uint32_t)k;

        if (k == f.log_p + 2) return XCCL_OK;
        if (k == 0 && f.role == XCCL_PAT_EXTRA) {
            XCCL_CHECK(xfer_blocks(t, 1, f.peer, r, r + 1, step));
        } else if (k == 0 && f.role == XCCL_PAT_PROXY) {
            XCCL_CHECK(xfer_blocks(t, 0, f.peer, f.peer, f.peer + 1, step));
        } else if (k >= 1 && k <= f.log_p && f.role != XCCL_PAT_EXTRA) {
            int d = 1 << (k - 1), peer = r ^ d;
            XCCL_CHECK(rd_parts(t, 0, peer, &f, xccl_pat_rd_range_lo(peer, d), d, step));
            XCCL_CHECK(rd_parts(t, 1, peer, &f, xccl_pat_rd_range_lo(r, d), d, step));
        } else if (k == f.log_p + 1 && f.role != XCCL_PAT_PLAIN) {
            /* the extra rank's block stays where it is: send the runs around it */
            int send = f.role == XCCL_PAT_PROXY, hole = send ? f.peer : r;
            XCCL_CHECK(xfer_blocks(t, send, f.peer, 0, hole, step));
            XCCL_CHECK(xfer_blocks(t, send, f.peer, hole + 1, n, step));
        }
        w[0] = (uint64_t)k + 1;
    }
    return st;
}

static void rd_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    xccl_pat_fold_t f    = xccl_pat_fold(0, n); /* rank 0 sends the most blocks */
    double          sent = 0;

    for (int d = 1; d < f.p; d *= 2) sent += d + (d < f.extra ? d : f.extra);
    if (f.extra > 0) sent += n; /* fold-in: 1 block, fold-out: n-1 blocks */
    out->steps        = f.log_p + (f.extra > 0 ? 2 : 0);
    out->bytes        = sent * (double)nbytes / n;
    out->reduce_bytes = 0;
}

const xccl_algo_t xccl_algo_allgather_rd = {
    .name     = "rd",
    .coll     = XCCL_COLL_ALLGATHER,
    .summary  = "recursive doubling: log2(n) steps, (n-1)/n N bytes (2 more steps and N more "
                "bytes when n is not a power of two)",
    .cost     = rd_cost,
    .progress = rd_progress,
};

/* ---------------------------------------------------------------------------------------------
 * bruck: ceil(log2 n) rounds for any n. Before round k rank r holds blocks r .. r+2^k-1
 * (mod n); it sends the first m = min(2^k, n-2^k) of them to r-2^k and receives blocks
 * r+2^k .. r+2^k+m-1 from r+2^k. Blocks stay at their place in rbuf, so no final rotation is
 * needed; a run that wraps past block n-1 goes as two messages (both sides split it alike).
 *
 *   round k    send to r-2^k               receive from r+2^k
 *   0          block r                     block r+1
 *   1          blocks r, r+1               blocks r+2, r+3
 *   k          blocks r .. r+m-1           blocks r+2^k .. r+2^k+m-1
 *
 * cost: ceil(log2 n) α, (n-1)/n N β.
 * ------------------------------------------------------------------------------------------- */

/* Blocks first .. first+m-1 (mod n): one run, or two when they wrap. */
static xccl_status_t xfer_wrapped(xccl_task_t *t, int send, int peer, int first, int m, int n,
                                  uint32_t step)
{
    int end = first + m;

    if (end <= n) return xfer_blocks(t, send, peer, first, end, step);
    XCCL_CHECK(xfer_blocks(t, send, peer, first, n, step));
    return xfer_blocks(t, send, peer, 0, end - n, step);
}

static xccl_status_t bruck_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    uint64_t               *w = xccl_task_state(t); /* w[0]: next round */
    int                     r = xccl_task_rank(t), n = xccl_task_size(t);
    xccl_status_t           st;

    if (n == 1 || a->count == 0) return XCCL_OK;
    while ((st = xccl_task_test(t)) == XCCL_OK) {
        int k = (int)w[0], m;

        if (k == xccl_pat_bruck_rounds(n)) return XCCL_OK;
        m = xccl_pat_bruck_nblocks(n, k);
        XCCL_CHECK(xfer_wrapped(t, 0, xccl_pat_bruck_recv_peer(r, n, k),
                                xccl_pat_mod(r + (1 << k), n), m, n, (uint32_t)k));
        XCCL_CHECK(xfer_wrapped(t, 1, xccl_pat_bruck_send_peer(r, n, k), r, m, n, (uint32_t)k));
        w[0] = (uint64_t)k + 1;
    }
    return st;
}

static void bruck_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    out->steps        = xccl_pat_log2_ceil(n);
    out->bytes        = (double)(n - 1) / n * (double)nbytes;
    out->reduce_bytes = 0;
}

const xccl_algo_t xccl_algo_allgather_bruck = {
    .name     = "bruck",
    .coll     = XCCL_COLL_ALLGATHER,
    .summary  = "Bruck: ceil(log2 n) steps for any n, (n-1)/n N bytes",
    .cost     = bruck_cost,
    .progress = bruck_progress,
};

/* ---------------------------------------------------------------------------------------------
 * direct: one round; rank r sends block r to every other rank and receives each rank's
 * block into place.
 *
 *   stage   sends                      receives
 *   0       block r (N/n) to each j    block j from each j
 *
 * cost: 1 + (n-2)/8 α (xccl_pat_direct_steps), (n-1)/n N β.
 * ------------------------------------------------------------------------------------------- */
static xccl_status_t direct_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    uint64_t               *w = xccl_task_state(t); /* w[0]: 1 once posted */
    int                     r = xccl_task_rank(t), n = xccl_task_size(t);

    if (n == 1 || a->count == 0) return XCCL_OK;
    if (w[0] == 0) {
        for (int i = 1; i < n; i++) {
            int to = xccl_pat_mod(r + i, n), from = xccl_pat_mod(r - i, n);
            XCCL_CHECK(xfer_blocks(t, 0, from, from, from + 1, 0));
            XCCL_CHECK(xfer_blocks(t, 1, to, r, r + 1, 0));
        }
        w[0] = 1;
    }
    return xccl_task_test(t);
}

static void direct_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    out->steps        = xccl_pat_direct_steps(n);
    out->bytes        = (double)(n - 1) / n * (double)nbytes;
    out->reduce_bytes = 0;
}

const xccl_algo_t xccl_algo_allgather_direct = {
    .name     = "direct",
    .coll     = XCCL_COLL_ALLGATHER,
    .summary  = "every rank sends its block to every other: 1 round of n-1 messages, "
                "(n-1)/n N bytes",
    .cost     = direct_cost,
    .progress = direct_progress,
};
