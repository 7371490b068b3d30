/* SPDX-License-Identifier: Apache-2.0
 *
 * owner.c - "owner" algorithms: XCCL_COLL_ALLREDUCE and XCCL_COLL_REDUCE_SCATTER as a direct
 * reduce-scatter (every block goes straight to the rank that owns it) followed, for
 * all_reduce, by a direct all-gather (every owner sends its reduced block straight to every
 * rank), both pipelined in chunks through a small scratch window.
 *
 * Why: on one host every message is a memory copy (with cross-memory attach, a single copy
 * made by the receiver from the sender's buffer). An algorithm that receives whole blocks into
 * a scratch as large as the vector sends that scratch to DRAM and reads it back to reduce it;
 * here a rank receives one chunk from each peer into a window of 2 (n-1) chunks that stays
 * in cache and reduces it from there at once, so a received byte costs one remote read.
 *
 * Rank r owns block r (xccl_pat_block: n nearly equal blocks of the vector for all_reduce,
 * block r of sbuf for reduce_scatter). Every block is cut into C chunks of at most
 * $XCCL_OWNER_CHUNK_BYTES (the same C for every block: xccl_pat_owner_nchunks). Round k:
 *
 *   round      with every peer q, in this order
 *   0 .. C-1   post: recv chunk k of block r from q into window k%2,
 *                    send chunk k of block q to q
 *   1 .. C     reduce chunk k-1 of block r from window (k-1)%2 (and the input's own chunk);
 *              all_reduce only, post: send chunk k-1 of block r to q,
 *                                     recv chunk k-1 of block q from q into place
 *   C+1        done (round C's messages have completed)
 *
 * Every round waits for all of its messages (xccl_task_test) before the next one is posted,
 * so a round is a synchronisation with every peer; the window needs only two sets of slots:
 * round k receives into one while the chunks of round k-1 are reduced from the other.
 * Phase-1 chunk c travels as step c, phase-2 chunk c as step C + c (C <= 1024).
 *
 * Reduction order: the n contributions to an element are combined in rank order,
 * ((x0 op x1) op x2) ... op x(n-1), through the window slot of x0 (of x1 on rank 0) so that
 * the last operation writes the result; an element is reduced once, by its owner, and then
 * copied, so every rank ends with the same bits whatever the arrival order.
 *
 * Buffer safety in place (all_reduce works on rbuf, which holds the input):
 *   - In phase 1 a rank's block q != r is only read (by q's receives); block r is written only
 *     by r's reductions, and no peer reads block r of r before phase 2.
 *   - Phase 2 overwrites chunk c of block q at r with q's result. r sent its own chunk c of
 *     block q to q in round c; the receive of the result is posted in round c+1, after round
 *     c completed, so that send is finished. Even without the rounds it would be safe: q sends
 *     the result of chunk c only after it received chunk c from every rank, r included.
 *   - r sends chunk c of block r in round c+1, after reducing it; it is never written again.
 * reduce_scatter reads sbuf (only the blocks q != r are sent) and writes rbuf, which may be
 * block r of sbuf: block r of the input is read only by the reduction that writes the same
 * chunk of rbuf.
 *
 * Cost (per rank): C+1 rounds of up to 2(n-1) messages (C rounds of n-1 for reduce_scatter),
 * each charged n-1 steps (a synchronisation with every peer, see owner_cost); all_reduce
 * 2(n-1)/n N β and (n-1)/n N γ, reduce_scatter (n-1)/n N β and (n-1)/n N γ. Scratch:
 * 2 (n-1) chunks. The α-β-γ model has no term for where bytes land (cache or DRAM), which is
 * what this algorithm saves: it predicts the same bytes as ring and Rabenseifner in more
 * rounds, yet on one host it is the fastest of them for large vectors.
 */
#include "algo/algo.h"

#include <string.h>

#include "algo/patterns.h"
#include "core/check.h"

typedef struct owner_ctx {
    xccl_task_t *t;
    const char  *in;  /* the input blocks: rbuf (all_reduce) or sbuf (reduce_scatter)     */
    char        *out; /* the whole vector (all_reduce) or the result block (reduce_scatter) */
    char        *win; /* 2 windows of n-1 slots of `slot` elements, slot q' for peer q     */
    size_t       count, es, slot;
    int          rank, size, nchunks;
    int          gather; /* all_reduce: phase 2 sends the owned block to every rank       */
} owner_ctx_t;

/* Block q of the input: its first element and element count. */
static size_t owner_block(const owner_ctx_t *x, int q, size_t *off)
{
    if (!x->gather) {
        *off = (size_t)q * x->count;
        return x->count;
    }
    *off = xccl_pat_block_off(x->count, x->size, q);
    return xccl_pat_block_count(x->count, x->size, q);
}

/* Chunk c of block q: *off (elements from the start of the input) and the element count. */
static size_t owner_chunk(const owner_ctx_t *x, int q, int c, size_t *off)
{
    size_t boff, bcnt = owner_block(x, q, &boff);

    *off = boff + xccl_pat_block_off(bcnt, x->nchunks, c);
    return xccl_pat_block_count(bcnt, x->nchunks, c);
}

/* The window slot that receives peer q's chunk c. */
static char *owner_slot(const owner_ctx_t *x, int q, int c)
{
    size_t i = (size_t)(c & 1) * (size_t)(x->size - 1) + (size_t)(q < x->rank ? q : q - 1);
    return x->win + i * x->slot * x->es;
}

/* Phase 1, chunk c: every peer's share of its block out, this rank's chunk in. */
static xccl_status_t owner_post_scatter(const owner_ctx_t *x, int c)
{
    int    n = x->size, r = x->rank;
    size_t roff, rcnt = owner_chunk(x, r, c, &roff);

    for (int i = 1; i < n; i++) {
        int    to = xccl_pat_mod(r + i, n), from = xccl_pat_mod(r - i, n);
        size_t soff, scnt = owner_chunk(x, to, c, &soff);

        XCCL_CHECK(xccl_pat_recv_nz(x->t, from, owner_slot(x, from, c), rcnt * x->es, (uint32_t)c));
        XCCL_CHECK(xccl_pat_send_nz(x->t, to, x->in + soff * x->es, scnt * x->es, (uint32_t)c));
    }
    return XCCL_OK;
}

/* Phase 2 (all_reduce), chunk c: the reduced chunk of block r out, every owner's chunk in. */
static xccl_status_t owner_post_gather(const owner_ctx_t *x, int c)
{
    int      n = x->size, r = x->rank;
    uint32_t step = (uint32_t)(x->nchunks + c);
    size_t   soff, scnt = owner_chunk(x, r, c, &soff);

    for (int i = 1; i < n; i++) {
        int    to = xccl_pat_mod(r + i, n), from = xccl_pat_mod(r - i, n);
        size_t roff, rcnt = owner_chunk(x, from, c, &roff);

        XCCL_CHECK(xccl_pat_recv_nz(x->t, from, x->out + roff * x->es, rcnt * x->es, step));
        XCCL_CHECK(xccl_pat_send_nz(x->t, to, x->out + soff * x->es, scnt * x->es, step));
    }
    return XCCL_OK;
}

/* Chunk c of block r = x0 op x1 op ... op x(n-1) in rank order; x_r is the input's chunk,
 * the others are in window c%2. The accumulator is the slot of x0 (x1 on rank 0). */
static xccl_status_t owner_reduce(const owner_ctx_t *x, int c)
{
    int         n = x->size, r = x->rank;
    size_t      off, cnt = owner_chunk(x, r, c, &off);
    const char *own = x->in + off * x->es;
    char       *dst, *acc = owner_slot(x, r == 0 ? 1 : 0, c);

    if (cnt == 0) return XCCL_OK;
    dst = x->gather ? x->out + off * x->es : x->out + (off - (size_t)r * x->count) * x->es;
    for (int j = 1; j < n; j++) {
        const char *a = j == 1 ? (r == 0 ? own : owner_slot(x, 0, c)) : acc;
        const char *b = j == r ? own : owner_slot(x, j, c);
        XCCL_CHECK(xccl_task_reduce(x->t, j == n - 1 ? dst : acc, a, b, cnt));
    }
    return XCCL_OK;
}

/* Chunks per block (the same on every rank: $XCCL_OWNER_CHUNK_BYTES). */
static int owner_nchunks(size_t block_bytes, size_t elsize)
{
    int64_t chunk = xccl_env_int(XCCL_PAT_OWNER_CHUNK_ENV, XCCL_PAT_OWNER_CHUNK_DEFAULT);

    if (chunk < (int64_t)elsize) chunk = (int64_t)elsize;
    return xccl_pat_owner_nchunks(block_bytes, (size_t)chunk);
}

/* Runs the rounds over blocks of at most block_max elements, reading `in`, writing `out`;
 * `gather`: all_reduce (phase 2 sends the owned block to every rank). */
static xccl_status_t owner_run(xccl_task_t *t, const void *in, void *out, int gather,
                               size_t block_max)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    uint64_t               *w = xccl_task_state(t); /* w[0]: next round, w[1]: chunks */
    owner_ctx_t             x = {.t      = t,
                                 .in     = in,
                                 .out    = out,
                                 .count  = a->count,
                                 .es     = a->elsize,
                                 .rank   = xccl_task_rank(t),
                                 .size   = xccl_task_size(t),
                                 .gather = gather};
    size_t                  nbytes;
    xccl_status_t           st;

    if (w[1] == 0) w[1] = (uint64_t)owner_nchunks(block_max * x.es, x.es);
    x.nchunks = (int)w[1];
    x.slot    = xccl_pat_block_max(block_max, x.nchunks);
    nbytes    = 2 * (size_t)(x.size - 1) * x.slot * x.es;
    x.win     = xccl_task_scratch(t, nbytes);
    if (x.win == NULL)
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "%s owner: rank %d: no memory for %zu B of scratch",
                          xccl_coll_name(a->coll), x.rank, nbytes);

    while ((st = xccl_task_test(t)) == XCCL_OK) {
        int k = (int)w[0];

        if (k > x.nchunks) return XCCL_OK;
        if (k < x.nchunks) XCCL_CHECK(owner_post_scatter(&x, k));
        if (k > 0) {
            XCCL_CHECK(owner_reduce(&x, k - 1));
            if (x.gather) XCCL_CHECK(owner_post_gather(&x, k - 1));
        }
        w[0] = (uint64_t)k + 1;
    }
    return st;
}

/* The rounds for blocks of block_bytes: C for reduce_scatter, C+1 for all_reduce, each
 * charged one step per peer. A round ends only when every one of its messages has completed,
 * a synchronisation with all n-1 peers that waits for the slowest of them to be scheduled and
 * to take its chunk, so it costs more than one direct round of as many messages (priced as a
 * direct round, the model chose it where it lost: docs/selection.md); large vectors take it by
 * a built-in rule (select.c). */
static void owner_cost(int n, size_t block_bytes, int gather, xccl_cost_t *out)
{
    int c = owner_nchunks(block_bytes, 1);

    out->steps = (double)(c + (gather ? 1 : 0)) * (n - 1);
}

/* ---------------------------------------------------------------------------------------------
 * all_reduce
 * ------------------------------------------------------------------------------------------- */
static xccl_status_t allreduce_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    int                     n = xccl_task_size(t);

    if (n == 1 || a->count == 0) return XCCL_OK;
    return owner_run(t, a->rbuf, a->rbuf, 1, xccl_pat_block_max(a->count, n));
}

static void allreduce_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    double f = n > 1 ? (double)(n - 1) / n : 0;

    memset(out, 0, sizeof(*out));
    if (n == 1) return;
    owner_cost(n, xccl_pat_block_max(nbytes, n), 1, out);
    out->bytes        = 2 * f * (double)nbytes;
    out->reduce_bytes = f * (double)nbytes;
}

const xccl_algo_t xccl_algo_allreduce_owner = {
    .name     = "owner",
    .coll     = XCCL_COLL_ALLREDUCE,
    .summary  = "direct reduce-scatter + direct all-gather, pipelined in chunks through a "
                "cache-sized window: chunks+1 rounds of 2(n-1) messages, 2(n-1)/n N bytes",
    .cost     = allreduce_cost,
    .progress = allreduce_progress,
};

/* ---------------------------------------------------------------------------------------------
 * reduce_scatter
 * ------------------------------------------------------------------------------------------- */
static xccl_status_t reduce_scatter_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);

    if (a->count == 0) return XCCL_OK;
    if (xccl_task_size(t) == 1) {
        return xccl_task_copy(t, a->rbuf, a->sbuf, a->count * a->elsize);
    }
    return owner_run(t, a->sbuf, a->rbuf, 0, a->count);
}

static void reduce_scatter_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    double f = n > 1 ? (double)(n - 1) / n : 0;

    memset(out, 0, sizeof(*out));
    if (n == 1) return;
    owner_cost(n, nbytes / (size_t)n, 0, out);
    out->bytes        = f * (double)nbytes;
    out->reduce_bytes = f * (double)nbytes;
}

const xccl_algo_t xccl_algo_reduce_scatter_owner = {
    .name     = "owner",
    .coll     = XCCL_COLL_REDUCE_SCATTER,
    .summary  = "direct reduce-scatter pipelined in chunks through a cache-sized window: "
                "chunks rounds of 2(n-1) messages, (n-1)/n N bytes",
    .cost     = reduce_scatter_cost,
    .progress = reduce_scatter_progress,
};
