/* SPDX-License-Identifier: Apache-2.0
 *
 * shm_cma.c - the one-host algorithms "cma" for large messages: one copy per byte, made by
 * the rank that needs it, straight from the peer's operation buffer (xccl_task_peer_read,
 * cross-memory attach: XCCL_SHARED_CMA), coordinated through the node-shared segment (flags,
 * addresses and progress counters, protocol in shm.h). Every rank copies its share in
 * parallel; no rank's memory or link carries more than its own data once where the collective
 * allows it. Without cross-memory reads these algorithms are not applicable (the selector
 * falls back to the message-based ones).
 *
 * Common frame, epoch e, rank r of n:
 *
 *   step  rank r
 *   1     wait until every rank's done >= e - 2 (shm.h, reuse rule)
 *   2     publish sbuf and rbuf (or scratch) addresses, signature, flag = e
 *   3     the collective's reads (below); prog = stamp(e, chunks of its own result ready)
 *   4     check every rank's signature; done = e; wait until every rank's done = e (nobody
 *         reads its buffers any more); complete
 *
 *   collective      step 3 of rank r
 *   all_gather      read block q of every peer's rbuf into its rbuf
 *   all_to_all      read block r of every peer's sbuf into block q of its rbuf
 *   gather          root: read every peer's sbuf into block q of its rbuf
 *   scatter         read block r of the root's sbuf
 *   broadcast       the vector is cut into n-1 slices, one per non-root rank: read its slice
 *                   from the root chunk by chunk, bumping prog; then read every other slice,
 *                   chunk by chunk as its holder's prog allows, from the holder's rbuf. The
 *                   root's memory is read once; all n-1 ranks copy in parallel.
 *   reduce_scatter  for each chunk of block r: read it from every peer's sbuf (into scratch),
 *                   reduce in rank order into rbuf
 *   all_reduce      reduce-scatter of slice r (n near-equal slices of rbuf) as above, written
 *                   into slice r of its own rbuf chunk by chunk, bumping prog; then read every
 *                   other slice q from q's rbuf, chunk c once q's prog passed c. A peer's input
 *                   slice q is overwritten by the result only after q has read that chunk from
 *                   everyone (its prog), so no input is overwritten while it is still needed.
 *   reduce          as all_reduce, slice r reduced into scratch (the root: into its rbuf);
 *                   only the root reads the other slices.
 *
 * Chunks: $XCCL_SHM_CHUNK_BYTES (256 KiB by default, identical on every rank). Reductions
 * read a peer's chunk into a 2-chunk scratch and combine the n contributions in rank order,
 * so results are the same bits whatever the timing, and each element is reduced once.
 *
 * Cost (per rank): 2 or 3 flag steps; copy_bytes = what it reads (all_gather and all_to_all
 * (n-1)/n N, broadcast N, all_reduce 2 (n-1)/n N, ...); reduce_bytes (n-1)/n N.
 */
#include "algo/shm.h"

#include "algo/patterns.h"
#include "core/check.h"

/* State words: st[0] phase, st[1] rank cursor, st[2] chunk cursor, st[3] chunk elements. */
enum { CMA_CHUNK = 2, CMA_CE = 3 };

enum { PH_START = 0, PH_PEERS, PH_OWN, PH_OTHERS, PH_DONE, PH_WAIT };

static int cma_applicable(const xccl_coll_args_t *a, int n)
{
    (void)n;
    return shm_usable(a, 1);
}

static const char *peer_addr(const shm_t *x, int q, int which, size_t off)
{
    return (const char *)(uintptr_t)shm_ctl(x, q)->addr[x->p][which] + off;
}

/* Copies elements [first, first + count) of `holder`'s rbuf into the same place of this rank's
 * rbuf, chunk by chunk as the holder's progress counter publishes them (chunk c once prog
 * passed c); cursor st[CMA_CHUNK], reset when done. XCCL_INPROGRESS while a chunk is not
 * there yet. */
static xccl_status_t pull_published(shm_t *x, int holder, size_t first, size_t count)
{
    size_t ce = (size_t)x->chunk, nch = (count + ce - 1) / ce;

    for (size_t c = (size_t)x->st[CMA_CHUNK]; c < nch; c++) {
        size_t off = (first + c * ce) * x->es, cnt = xccl_pat_min(ce, count - c * ce);
        if (!shm_prog_ready(x, holder, c + 1)) {
            x->st[CMA_CHUNK] = c;
            return XCCL_INPROGRESS;
        }
        XCCL_CHECK(xccl_task_peer_read(x->t, holder, (char *)x->a->rbuf + off,
                                       peer_addr(x, holder, 1, off), cnt * x->es));
    }
    x->st[CMA_CHUNK] = 0;
    return XCCL_OK;
}

/* Waits for every rank's publication (signature checked); cursor st[1]. */
static xccl_status_t all_ready(shm_t *x)
{
    for (int q = (int)x->st[SHM_CURSOR]; q < x->size; q++) {
        int rd = shm_ready(x, q);
        if (rd <= 0) {
            x->st[SHM_CURSOR] = (uint64_t)q;
            return rd < 0 ? rd : XCCL_INPROGRESS;
        }
    }
    x->st[SHM_CURSOR] = 0;
    return XCCL_OK;
}

/* dst (cnt elements) = x0 op x1 op ... op x(n-1) in rank order, where x_k is `own` for this
 * rank and the bytes at peer k's address `which` + off otherwise, read into the scratch
 * (A: the accumulator, B: the peer's chunk). dst may equal own: it is written last. */
static xccl_status_t reduce_chunk(shm_t *x, int which, size_t off, const char *own, char *dst,
                                  size_t cnt, char *A, char *B)
{
    size_t      nb  = cnt * x->es;
    const char *acc = NULL;

    for (int k = 0; k < x->size; k++) {
        const char *src = own;
        if (k != x->rank) {
            char *buf = k == 0 ? A : B;
            XCCL_CHECK(xccl_task_peer_read(x->t, k, buf, peer_addr(x, k, which, off), nb));
            src = buf;
        }
        if (k == 0) {
            acc = src;
            if (x->size == 1) XCCL_CHECK(xccl_task_copy(x->t, dst, src, nb));
            continue;
        }
        XCCL_CHECK(xccl_task_reduce(x->t, k == x->size - 1 ? dst : A, acc, src, cnt));
        acc = A;
    }
    return XCCL_OK;
}

/* Step 4: every rank's signature checked (before this rank's done: until then no peer can
 * publish e + 2 over e's words), done = e, then wait until every rank is done with e. */
static xccl_status_t cma_finish(shm_t *x)
{
    if (x->st[SHM_PHASE] == PH_DONE) {
        SHM_TRY(all_ready(x));
        shm_set_done(x);
        x->st[SHM_PHASE] = PH_WAIT;
    }
    return shm_wait_done(x, 0);
}

/* ---- all_gather, all_to_all, gather, scatter: one read per block ------------------------- */

static xccl_status_t pull_progress(xccl_task_t *t)
{
    shm_t                   x;
    xccl_status_t           st = shm_begin(t, SHM_ID_CMA + (int)xccl_task_args(t)->coll, &x);
    const xccl_coll_args_t *a;
    size_t                  blk;
    int                     n, r;

    if (st != XCCL_OK) return st;
    a = x.a, n = x.size, r = x.rank, blk = a->count * x.es;
    if (x.st[SHM_PHASE] == PH_START) {
        SHM_TRY(shm_wait_done(&x, 2));
        shm_publish(&x, (uint64_t)(uintptr_t)a->sbuf, (uint64_t)(uintptr_t)a->rbuf);
        x.st[SHM_PHASE]  = PH_OTHERS;
        x.st[SHM_CURSOR] = 1;
    }
    if (x.st[SHM_PHASE] == PH_OTHERS) {
        int from_root = a->coll == XCCL_COLL_SCATTER, to_root = a->coll == XCCL_COLL_GATHER;
        int nread = from_root ? (r == a->root ? 0 : 1) : to_root && r != a->root ? 0 : n - 1;
        for (int j = (int)x.st[SHM_CURSOR]; j <= nread; j++) {
            int         q = from_root ? a->root : (r + j) % n, rd;
            char       *dst;
            const char *src;

            rd = shm_ready(&x, q);
            if (rd <= 0) {
                x.st[SHM_CURSOR] = (uint64_t)j;
                return rd < 0 ? rd : XCCL_INPROGRESS;
            }
            switch (a->coll) {
            case XCCL_COLL_ALLGATHER:
                dst = (char *)a->rbuf + (size_t)q * blk;
                src = peer_addr(&x, q, 1, (size_t)q * blk);
                break;
            case XCCL_COLL_ALLTOALL:
                dst = (char *)a->rbuf + (size_t)q * blk;
                src = peer_addr(&x, q, 0, (size_t)r * blk);
                break;
            case XCCL_COLL_GATHER:
                dst = (char *)a->rbuf + (size_t)q * blk;
                src = peer_addr(&x, q, 0, 0);
                break;
            default: /* scatter */
                dst = a->rbuf;
                src = peer_addr(&x, q, 0, (size_t)r * blk);
                break;
            }
            XCCL_CHECK(xccl_task_peer_read(t, q, dst, src, blk));
        }
        x.st[SHM_CURSOR] = 0;
        x.st[SHM_PHASE]  = PH_DONE;
    }
    return cma_finish(&x);
}

/* ---- broadcast: slices pulled from the root once, then from their holders ----------------- */

static xccl_status_t bcast_progress(xccl_task_t *t)
{
    shm_t                   x;
    xccl_status_t           st = shm_begin(t, SHM_ID_CMA + XCCL_COLL_BROADCAST, &x);
    const xccl_coll_args_t *a;
    int                     n, r, R, m, i;
    size_t                  ce;

    if (st != XCCL_OK) return st;
    a = x.a, n = x.size, r = x.rank, R = a->root, m = n - 1;
    i = (r - R - 1 + n) % n; /* this rank's slice (non-roots) */
    if (x.st[SHM_PHASE] == PH_START) {
        SHM_TRY(shm_wait_done(&x, 2));
        x.st[CMA_CE] = shm_chunk_elems(a->count, x.es);
        x.chunk      = x.st[CMA_CE];
        shm_publish(&x, 0, (uint64_t)(uintptr_t)a->rbuf);
        x.st[SHM_PHASE] = r == R ? PH_DONE : PH_PEERS;
    }
    ce      = (size_t)x.st[CMA_CE];
    x.chunk = ce;
    if (x.st[SHM_PHASE] == PH_PEERS) {
        int rd = shm_ready(&x, R);
        if (rd <= 0) return rd < 0 ? rd : XCCL_INPROGRESS;
        x.st[SHM_PHASE] = PH_OWN;
    }
    if (x.st[SHM_PHASE] == PH_OWN) {
        size_t soff = xccl_pat_block_off(a->count, m, i),
               scnt = xccl_pat_block_count(a->count, m, i);
        size_t nch  = (scnt + ce - 1) / ce;
        for (size_t c = (size_t)x.st[CMA_CHUNK]; c < nch; c++) {
            size_t off = (soff + c * ce) * x.es, cnt = xccl_pat_min(ce, scnt - c * ce);
            XCCL_CHECK(xccl_task_peer_read(t, R, (char *)a->rbuf + off, peer_addr(&x, R, 1, off),
                                           cnt * x.es));
            shm_set_prog(&x, c + 1);
        }
        x.st[CMA_CHUNK]  = 0;
        x.st[SHM_CURSOR] = 1;
        x.st[SHM_PHASE]  = PH_OTHERS;
    }
    if (x.st[SHM_PHASE] == PH_OTHERS) {
        for (int j = (int)x.st[SHM_CURSOR]; j < m; j++) {
            int s = (i + j) % m, h = (R + 1 + s) % n, rd;

            x.st[SHM_CURSOR] = (uint64_t)j;
            rd               = shm_ready(&x, h);
            if (rd <= 0) return rd < 0 ? rd : XCCL_INPROGRESS;
            SHM_TRY(pull_published(&x, h, xccl_pat_block_off(a->count, m, s),
                                   xccl_pat_block_count(a->count, m, s)));
        }
        x.st[SHM_CURSOR] = 0;
        x.st[SHM_PHASE]  = PH_DONE;
    }
    return cma_finish(&x);
}

/* ---- reduce_scatter, all_reduce, reduce: reduce your block or slice from every peer ------- */

static xccl_status_t red_progress(xccl_task_t *t)
{
    shm_t                   x;
    xccl_status_t           st = shm_begin(t, SHM_ID_CMA + (int)xccl_task_args(t)->coll, &x);
    const xccl_coll_args_t *a;
    int                     n, r, rs, ar, root;
    size_t                  ce, soff, scnt, nch, in_off;
    char                   *scr, *A, *B, *mine;
    const char             *own;

    if (st != XCCL_OK) return st;
    a = x.a, n = x.size, r = x.rank;
    rs   = a->coll == XCCL_COLL_REDUCE_SCATTER;
    ar   = a->coll == XCCL_COLL_ALLREDUCE;
    root = a->coll == XCCL_COLL_REDUCE && r == a->root;
    if (x.st[SHM_PHASE] == PH_START) {
        SHM_TRY(shm_wait_done(&x, 2));
        x.st[CMA_CE] = shm_chunk_elems(rs ? a->count : xccl_pat_block_max(a->count, n), x.es);
    }
    ce      = (size_t)x.st[CMA_CE];
    x.chunk = ce;
    /* this rank's result: block r (reduce_scatter) or slice r of the vector */
    soff   = rs ? 0 : xccl_pat_block_off(a->count, n, r);
    scnt   = rs ? a->count : xccl_pat_block_count(a->count, n, r);
    nch    = (scnt + ce - 1) / ce;
    in_off = rs ? (size_t)r * a->count : 0; /* where block r starts in an input (elements) */
    /* scratch: A, B (one chunk each), then slice r of reduce at a non-root */
    scr = xccl_task_scratch(t, (2 * ce + (a->coll == XCCL_COLL_REDUCE ? scnt : 0)) * x.es);
    if (scr == NULL)
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "%s: no scratch for the cma algorithm",
                          xccl_coll_name(a->coll));
    A = scr, B = scr + ce * x.es;
    mine = rs || ar || root ? (char *)a->rbuf + (rs ? 0 : soff * x.es) : scr + 2 * ce * x.es;
    own  = (ar ? (const char *)a->rbuf : (const char *)a->sbuf) + (in_off + soff) * x.es;
    if (x.st[SHM_PHASE] == PH_START) {
        /* inputs: rbuf for all_reduce (in place), sbuf otherwise; results where `mine` is */
        shm_publish(&x, (uint64_t)(uintptr_t)(ar ? a->rbuf : a->sbuf),
                    (uint64_t)(uintptr_t)mine - soff * x.es);
        x.st[SHM_PHASE] = PH_PEERS;
    }
    if (x.st[SHM_PHASE] == PH_PEERS) {
        SHM_TRY(all_ready(&x));
        x.st[SHM_PHASE] = PH_OWN;
    }
    if (x.st[SHM_PHASE] == PH_OWN) {
        for (size_t c = (size_t)x.st[CMA_CHUNK]; c < nch; c++) {
            size_t e0 = c * ce, cnt = xccl_pat_min(ce, scnt - e0);
            XCCL_CHECK(reduce_chunk(&x, 0, (in_off + soff + e0) * x.es, own + e0 * x.es,
                                    mine + e0 * x.es, cnt, A, B));
            if (!rs) shm_set_prog(&x, c + 1);
        }
        x.st[CMA_CHUNK]  = 0;
        x.st[SHM_CURSOR] = ar || root ? 1 : 0; /* PH_OTHERS from j = 1, PH_WAIT from rank 0 */
        x.st[SHM_PHASE]  = ar || root ? PH_OTHERS : PH_DONE;
    }
    if (x.st[SHM_PHASE] == PH_OTHERS) {
        for (int j = (int)x.st[SHM_CURSOR]; j < n; j++) {
            int q = (r + j) % n;

            x.st[SHM_CURSOR] = (uint64_t)j;
            SHM_TRY(pull_published(&x, q, xccl_pat_block_off(a->count, n, q),
                                   xccl_pat_block_count(a->count, n, q)));
        }
        x.st[SHM_CURSOR] = 0;
        x.st[SHM_PHASE]  = PH_DONE;
    }
    return cma_finish(&x);
}

/* ---- costs -------------------------------------------------------------------------------- */

static void cma_cost(xccl_coll_t c, int n, size_t nbytes, xccl_cost_t *o)
{
    double N = (double)nbytes, f = n > 0 ? (double)(n - 1) / n : 0;

    *o = (xccl_cost_t){.steps = n > 1 ? 2 : 0};
    switch (c) {
    case XCCL_COLL_ALLREDUCE:
        o->steps += n > 1, o->copy_bytes = 2 * f * N, o->reduce_bytes = f * N;
        break;
    case XCCL_COLL_REDUCE:
        o->steps += n > 1, o->copy_bytes = 2 * f * N, o->reduce_bytes = f * N;
        break;
    case XCCL_COLL_BROADCAST:
        o->steps += n > 1, o->copy_bytes = N;
        break;
    case XCCL_COLL_REDUCE_SCATTER:
        o->copy_bytes = f * N, o->reduce_bytes = f * N;
        break;
    case XCCL_COLL_SCATTER:
        o->copy_bytes = N / (n > 0 ? n : 1);
        break;
    default:
        o->copy_bytes = f * N;
        break; /* all_gather, gather, all_to_all */
    }
}

#define CMA_COST(fn, coll)                                                                         \
    static void fn(int n, size_t nbytes, xccl_cost_t *o)                                           \
    {                                                                                              \
        cma_cost(coll, n, nbytes, o);                                                              \
    }
CMA_COST(cost_allreduce, XCCL_COLL_ALLREDUCE)
CMA_COST(cost_broadcast, XCCL_COLL_BROADCAST)
CMA_COST(cost_reduce, XCCL_COLL_REDUCE)
CMA_COST(cost_allgather, XCCL_COLL_ALLGATHER)
CMA_COST(cost_gather, XCCL_COLL_GATHER)
CMA_COST(cost_scatter, XCCL_COLL_SCATTER)
CMA_COST(cost_reduce_scatter, XCCL_COLL_REDUCE_SCATTER)
CMA_COST(cost_alltoall, XCCL_COLL_ALLTOALL)

#define CMA_ALGO(var, c, cost_fn, prog, text)                                                      \
    const xccl_algo_t var = {.name       = "cma",                                                  \
                             .coll       = c,                                                      \
                             .summary    = text,                                                   \
                             .applicable = cma_applicable,                                         \
                             .cost       = cost_fn,                                                \
                             .progress   = prog,                                                   \
                             .shared     = 1}

CMA_ALGO(xccl_algo_allreduce_cma, XCCL_COLL_ALLREDUCE, cost_allreduce, red_progress,
         "one host, cross-memory reads: every rank reduces its slice from all peers' buffers "
         "(rank order), then reads the other slices from their owners; 2(n-1)/n N copied per "
         "rank, no messages");
CMA_ALGO(xccl_algo_broadcast_cma, XCCL_COLL_BROADCAST, cost_broadcast, bcast_progress,
         "one host, cross-memory reads: each non-root reads its slice from the root, then the "
         "other slices from their holders, pipelined; the root is read once, N per rank");
CMA_ALGO(xccl_algo_reduce_cma, XCCL_COLL_REDUCE, cost_reduce, red_progress,
         "one host, cross-memory reads: every rank reduces its slice from all peers' inputs "
         "(rank order), the root reads the slices; no messages");
CMA_ALGO(xccl_algo_allgather_cma, XCCL_COLL_ALLGATHER, cost_allgather, pull_progress,
         "one host, cross-memory reads: every rank reads each peer's block from the peer's "
         "buffer; (n-1)/n N per rank, no messages");
CMA_ALGO(xccl_algo_gather_cma, XCCL_COLL_GATHER, cost_gather, pull_progress,
         "one host, cross-memory reads: the root reads each rank's block from its buffer");
CMA_ALGO(xccl_algo_scatter_cma, XCCL_COLL_SCATTER, cost_scatter, pull_progress,
         "one host, cross-memory reads: every rank reads its block from the root's buffer");
CMA_ALGO(xccl_algo_reduce_scatter_cma, XCCL_COLL_REDUCE_SCATTER, cost_reduce_scatter, red_progress,
         "one host, cross-memory reads: every rank reads its block of each peer's input in "
         "chunks and reduces it in rank order; (n-1)/n N per rank");
CMA_ALGO(xccl_algo_alltoall_cma, XCCL_COLL_ALLTOALL, cost_alltoall, pull_progress,
         "one host, cross-memory reads: every rank reads its block from each peer's send "
         "buffer; (n-1)/n N per rank, no messages");
