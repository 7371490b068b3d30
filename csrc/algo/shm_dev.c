/* SPDX-License-Identifier: Apache-2.0
 *
 * shm_dev.c - "devmap": the one-host collectives on device memory. Every rank maps its peers'
 * operation buffers (task.h, "Device memory of peers": CUDA IPC for CUDA) and its executor
 * copies and reduces straight between them - the device's copy engines and kernels move every
 * byte once, and no byte goes through host memory or a message. The node-shared segment
 * (shm.h's protocol: epochs, flags, signatures, done counters) carries the buffers' export
 * blobs and the synchronisation.
 *
 * A collective at epoch e, rank r of n (parity p = e & 1):
 *
 *   step  rank r
 *   1     wait until every rank's done >= e - 2 (nobody reads r's slot of parity p any more)
 *         and until r's own queued work (the prologue's copy) has finished; export the buffer
 *         peers read or write, write the blob into its slot; publish (signature, flag = e)
 *   2     for every rank, as its flag reaches e (signature checked): import its blob, keep
 *         the mapped pointer in its own slot; prog = stamp(e, MAPPED), or stamp(e, REFUSED)
 *         when an import was refused for now (cuda_lib.h: a caller's stream waits for a gate,
 *         and mapping could synchronise the device)
 *   3     for every rank, as its prog reaches e: all MAPPED - issue the device work below on
 *         its executor and wait for it; any REFUSED - PH_FALLBACK (below)
 *   4     done = e; wait until every rank's done >= e (nobody reads or writes r's buffers any
 *         more), complete
 *
 *   collective      exports         device work of rank r (slice r: elements [lo_r, hi_r))
 *   all_reduce      rbuf (in place) slice r = reduce of every rank's slice r in rank order,
 *                                   then copied into every peer's slice r
 *   reduce_scatter  sbuf            rbuf = reduce of every rank's block r, rank order
 *   all_gather      rbuf            block q of rbuf <- block q of rank q's rbuf, every q != r
 *   broadcast       buf             not the root: buf <- the root's buf
 *   reduce          sbuf            the root: rbuf = reduce of every rank's sbuf, rank order
 *   gather          sbuf            the root: block q of rbuf <- rank q's sbuf
 *   scatter         sbuf (root)     rbuf <- block r of the root's sbuf
 *   all_to_all      sbuf            block q of rbuf <- block r of rank q's sbuf
 *
 * Why no hazards inside an epoch: a rank writes only its own slice or block of another rank's
 * buffer, which no other rank reads or writes in that epoch (all_reduce: rank q reads slice q
 * of every buffer and writes slice q of every buffer); reductions read all their sources for
 * an element before writing it (reduce_n), so a destination may alias its own source.
 * Reductions apply the operator in rank order, x0 op x1 op ... (chained through scratch beyond
 * XCCL_TASK_REDUCE_MAX sources), so every rank holds the same bits.
 *
 * Fallback: a rank whose buffer cannot be exported (memory the device cannot share, e.g. from
 * an allocator IPC does not serve) says so in its slot, and a rank that may not map a peer's
 * buffer now says so in its prog; every rank sees either (after step 2 or 3) and runs the
 * collective as a sub-task of a message-based algorithm (through whatever transport carries
 * device memory, or staging), still completing step 4. Step 3's round is what lets a rank
 * give up a mapping instead of trying again: nobody has touched a peer's buffer before it, so
 * every rank may still change its mind, together. That is why a caller's stream may wait for a
 * devmap collective on the device from the moment it is posted (xccl.h, Streams): the
 * collective never waits for the driver, which may be waiting for that stream.
 *
 * Cost (per rank, the critical path): three flag rounds as steps, the reductions as
 * reduce_bytes, the copies as copy_bytes; nothing on the wire.
 */
#include <stdio.h>
#include <string.h>

#include "algo/shm.h"
#include "core/check.h"

#define DEV_MAX_RANKS 256 /* pointers kept per rank (its slot, the stack) */

/* What a rank puts in its slot: whether it exported, and the blob of its buffer; and, for its
 * own use between steps 2 and 3, where it mapped every rank's buffer (only r writes slot r,
 * and nobody reads r's pointers, which mean nothing in other processes). */
typedef struct dev_slot {
    uint32_t      ok;  /* 1: exported (or nothing to export); 0: cannot share its buffer */
    uint32_t      len; /* blob bytes (0: nothing exported)                               */
    unsigned char blob[XCCL_TASK_BLOB_MAX];
    uint64_t      mapped[DEV_MAX_RANKS];
} dev_slot_t;

_Static_assert(sizeof(dev_slot_t) <= SHM_SLOT_BYTES, "dev_slot_t outgrew a slot");

/* State words: st[SHM_PHASE], st[SHM_CURSOR] (shm.h). */
enum { PH_PUBLISH = 0, PH_PEERS, PH_AGREE, PH_WORK, PH_FALLBACK, PH_DONE };

/* Step 2's outcome in prog (shm.h): every buffer mapped, or a mapping refused for now. */
enum { PROG_MAPPED = 1, PROG_REFUSED = 2 };

/* device memory its executor can share between processes, a segment */
static int dev_applicable(const xccl_coll_args_t *a, int size)
{
    (void)size;
    if (a->coll == XCCL_COLL_ALLTOALLV || a->coll == XCCL_COLL_BARRIER) return 0;
    return a->mem != XCCL_MEM_HOST && a->topo != NULL && (a->topo->shared & XCCL_SHARED_SEG) &&
           xccl_task_mem_shareable(a->mem);
}

/* The buffer this rank exports (NULL: none) and its bytes. */
static const void *export_buf(const shm_t *x, size_t *nbytes)
{
    const xccl_coll_args_t *a   = x->a;
    size_t                  blk = a->count * x->es, all = blk * (size_t)x->size;

    switch (a->coll) {
    case XCCL_COLL_ALLREDUCE: *nbytes = blk; return a->rbuf;
    case XCCL_COLL_BROADCAST: *nbytes = blk; return a->rbuf;
    case XCCL_COLL_ALLGATHER: *nbytes = all; return a->rbuf;
    case XCCL_COLL_REDUCE_SCATTER:
    case XCCL_COLL_ALLTOALL: *nbytes = all; return a->sbuf;
    case XCCL_COLL_REDUCE:
    case XCCL_COLL_GATHER: *nbytes = blk; return a->sbuf;
    case XCCL_COLL_SCATTER: *nbytes = all; return x->rank == a->root ? a->sbuf : NULL;
    default: *nbytes = 0; return NULL;
    }
}

/* Step 1: the blob into this rank's slot, then publish. */
static xccl_status_t dev_publish(shm_t *x)
{
    dev_slot_t   *s = (dev_slot_t *)(void *)shm_slot(x, x->rank);
    size_t        nbytes, len = 0;
    const void   *buf = export_buf(x, &nbytes);
    xccl_status_t st  = XCCL_OK;

    if (buf != NULL && nbytes > 0) st = xccl_task_mem_export(x->t, buf, nbytes, s->blob, &len);
    if (st < 0 && st != XCCL_ERR_NOT_SUPPORTED) return st;
    s->ok  = st == XCCL_OK;
    s->len = (uint32_t)len;
    shm_publish(x, 0, 0);
    return XCCL_OK;
}

/* dst = srcs[0] op ... op srcs[k-1] in rank order, any k >= 1: groups of
 * XCCL_TASK_REDUCE_MAX chained through scratch (dst may alias a source of the last group
 * only, which is why the earlier groups do not write it). */
static xccl_status_t reduce_all(shm_t *x, void *dst, const void **srcs, int k, size_t count)
{
    void *acc;
    int   done;

    if (count == 0) return XCCL_OK;
    if (k == 1) return xccl_task_copy(x->t, dst, srcs[0], count * x->es);
    if (k <= XCCL_TASK_REDUCE_MAX) return xccl_task_reduce_n(x->t, dst, srcs, k, count);
    acc = xccl_task_scratch(x->t, count * x->es);
    if (acc == NULL)
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "%s (devmap): no scratch for %zu elements",
                          xccl_coll_name(x->a->coll), count);
    SHM_TRY(xccl_task_reduce_n(x->t, acc, srcs, XCCL_TASK_REDUCE_MAX, count));
    for (done = XCCL_TASK_REDUCE_MAX; done < k;) {
        const void *g[XCCL_TASK_REDUCE_MAX];
        int         m = k - done < XCCL_TASK_REDUCE_MAX - 1 ? k - done : XCCL_TASK_REDUCE_MAX - 1;
        g[0]          = acc;
        memcpy(g + 1, srcs + done, (size_t)m * sizeof(*g));
        done += m;
        SHM_TRY(xccl_task_reduce_n(x->t, done == k ? dst : acc, g, m + 1, count));
    }
    return XCCL_OK;
}

/* Step 3: the device work of this rank, given every rank's mapped buffer (peer[r]: its own). */
static xccl_status_t dev_work(shm_t *x, unsigned char **peer, const void **srcs)
{
    const xccl_coll_args_t *a = x->a;
    int                     n = x->size, r = x->rank;
    size_t                  es = x->es, c = a->count, blk = c * es;
    unsigned char          *rb = a->rbuf;

    switch (a->coll) {
    case XCCL_COLL_ALLREDUCE: {
        size_t lo = c * (size_t)r / (size_t)n, hi = c * (size_t)(r + 1) / (size_t)n;
        for (int q = 0; q < n; q++)
            srcs[q] = peer[q] + lo * es;
        SHM_TRY(reduce_all(x, rb + lo * es, srcs, n, hi - lo));
        for (int q = 0; q < n && hi > lo; q++)
            if (q != r) SHM_TRY(xccl_task_copy(x->t, peer[q] + lo * es, rb + lo * es, (hi - lo) * es));
        return XCCL_OK;
    }
    case XCCL_COLL_REDUCE_SCATTER:
        for (int q = 0; q < n; q++)
            srcs[q] = peer[q] + (size_t)r * blk;
        return reduce_all(x, rb, srcs, n, c);
    case XCCL_COLL_REDUCE:
        if (r != a->root) return XCCL_OK;
        for (int q = 0; q < n; q++)
            srcs[q] = peer[q];
        return reduce_all(x, rb, srcs, n, c);
    case XCCL_COLL_ALLGATHER:
        for (int q = 0; q < n; q++)
            if (q != r) SHM_TRY(xccl_task_copy(x->t, rb + (size_t)q * blk, peer[q] + (size_t)q * blk, blk));
        return XCCL_OK;
    case XCCL_COLL_GATHER:
        for (int q = 0; q < n && r == a->root; q++)
            if (q != r) SHM_TRY(xccl_task_copy(x->t, rb + (size_t)q * blk, peer[q], blk));
        return XCCL_OK;
    case XCCL_COLL_BROADCAST:
        return r == a->root ? XCCL_OK : xccl_task_copy(x->t, rb, peer[a->root], blk);
    case XCCL_COLL_SCATTER:
        return r == a->root ? XCCL_OK
                            : xccl_task_copy(x->t, rb, peer[a->root] + (size_t)r * blk, blk);
    case XCCL_COLL_ALLTOALL:
        for (int q = 0; q < n; q++)
            if (q != r) SHM_TRY(xccl_task_copy(x->t, rb + (size_t)q * blk, peer[q] + (size_t)r * blk, blk));
        return XCCL_OK;
    default:
        return XCCL_ERROR(XCCL_ERR_INTERNAL, "devmap: %s is not one of its collectives",
                          xccl_coll_name(a->coll));
    }
}

static dev_slot_t *dev_slot(const shm_t *x, int q)
{
    return (dev_slot_t *)(void *)shm_slot(x, q);
}

/* Whether this rank's device work (dev_work) touches rank q's buffer: mapping no more than
 * that leaves fewer mappings to be refused. */
static int uses_peer(const shm_t *x, int q)
{
    const xccl_coll_args_t *a = x->a;

    switch (a->coll) {
    case XCCL_COLL_BROADCAST:
    case XCCL_COLL_SCATTER: return x->rank != a->root && q == a->root;
    case XCCL_COLL_REDUCE:
    case XCCL_COLL_GATHER: return x->rank == a->root;
    default: return 1;
    }
}

/* Step 2: every peer published (signature checked); one could not export: PH_FALLBACK; else map
 * the buffers this rank's work uses (none after a refusal) and say how that went. */
static xccl_status_t dev_peers(shm_t *x)
{
    dev_slot_t *mine = dev_slot(x, x->rank);
    size_t      nbytes;
    int         all_ok = 1, refused = 0;

    for (int q = (int)x->st[SHM_CURSOR]; q < x->size; q++) {
        int rc = shm_ready(x, q);
        if (rc < 0) return rc;
        if (rc == 0) {
            x->st[SHM_CURSOR] = (uint64_t)q;
            return XCCL_INPROGRESS;
        }
    }
    x->st[SHM_CURSOR] = 0;
    for (int q = 0; q < x->size; q++)
        all_ok &= dev_slot(x, q)->ok == 1;
    if (!all_ok) { /* every rank sees the same slots: no round needed */
        x->st[SHM_PHASE] = PH_FALLBACK;
        return XCCL_OK;
    }
    for (int q = 0; q < x->size && !refused; q++) {
        const dev_slot_t *s = dev_slot(x, q);
        void             *p = NULL;
        if (q == x->rank) {
            p = (void *)export_buf(x, &nbytes);
        } else if (s->len > 0 && uses_peer(x, q)) {
            xccl_status_t st = xccl_task_mem_import(x->t, s->blob, s->len, &p);
            if (st == XCCL_INPROGRESS) {
                refused = 1; /* not tried again: see the top */
            } else if (st != XCCL_OK) {
                shm_set_prog(x, PROG_REFUSED); /* the peers move on, to fail in the fallback */
                return st;
            }
        }
        mine->mapped[q] = (uint64_t)(uintptr_t)p;
    }
    shm_set_prog(x, refused ? PROG_REFUSED : PROG_MAPPED);
    x->st[SHM_PHASE] = PH_AGREE;
    return XCCL_OK;
}

/* Step 3: every rank said how its mapping went; all mapped: issue the work, else PH_FALLBACK. */
static xccl_status_t dev_agree(shm_t *x)
{
    unsigned char    *peer[DEV_MAX_RANKS];
    const void       *srcs[DEV_MAX_RANKS];
    const dev_slot_t *mine    = dev_slot(x, x->rank);
    int               refused = 0;

    for (int q = (int)x->st[SHM_CURSOR]; q < x->size; q++) {
        if (!shm_prog_ready(x, q, PROG_MAPPED)) {
            x->st[SHM_CURSOR] = (uint64_t)q;
            return XCCL_INPROGRESS;
        }
    }
    x->st[SHM_CURSOR] = 0;
    /* nobody passes step 4 of e before this rank's done = e: every prog still holds e's word */
    for (int q = 0; q < x->size; q++)
        refused |= atomic_load_explicit(&shm_ctl(x, q)->prog, memory_order_acquire) !=
                   shm_stamp(x->e, PROG_MAPPED);
    if (refused) {
        XCCL_INFO("devmap: %s epoch %llu: a rank could not map a peer's buffer now (a stream "
                  "waits for an operation): every rank falls back to messages",
                  xccl_coll_name(x->a->coll), (unsigned long long)x->e);
        x->st[SHM_PHASE] = PH_FALLBACK;
        return XCCL_OK;
    }
    for (int q = 0; q < x->size; q++)
        peer[q] = (unsigned char *)(uintptr_t)mine->mapped[q];
    SHM_TRY(dev_work(x, peer, srcs));
    x->st[SHM_PHASE] = PH_WORK;
    return XCCL_OK;
}

/* The message-based algorithm a fallback runs, by collective. */
static const xccl_algo_t *fallback_algo(xccl_coll_t c)
{
    static const char *const names[XCCL_COLL_COUNT] = {
        [XCCL_COLL_ALLREDUCE] = "ring",    [XCCL_COLL_REDUCE_SCATTER] = "ring",
        [XCCL_COLL_ALLGATHER] = "ring",    [XCCL_COLL_BROADCAST] = "binomial",
        [XCCL_COLL_REDUCE]    = "binomial", [XCCL_COLL_GATHER] = "linear",
        [XCCL_COLL_SCATTER]   = "linear",  [XCCL_COLL_ALLTOALL] = "pairwise",
    };
    return names[c] != NULL ? xccl_algo_find(c, names[c]) : NULL;
}

static xccl_status_t dev_progress(xccl_task_t *t)
{
    shm_t         x;
    xccl_status_t st;

    SHM_TRY(shm_begin(t, SHM_ID_DEV + (int)xccl_task_args(t)->coll, &x));
    if (x.size > DEV_MAX_RANKS)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED, "devmap: %d ranks (at most %d)", x.size,
                          DEV_MAX_RANKS);
    for (;;) {
        switch (x.st[SHM_PHASE]) {
        case PH_PUBLISH:
            SHM_TRY(shm_wait_done(&x, 2));
            SHM_TRY(xccl_task_test(t)); /* the prologue's copy has landed */
            SHM_TRY(dev_publish(&x));
            x.st[SHM_PHASE] = PH_PEERS;
            break;
        case PH_PEERS: SHM_TRY(dev_peers(&x)); break;
        case PH_AGREE: SHM_TRY(dev_agree(&x)); break;
        case PH_FALLBACK: {
            const xccl_algo_t *fb = fallback_algo(x.a->coll);
            int                map[DEV_MAX_RANKS];
            if (fb == NULL)
                return XCCL_ERROR(XCCL_ERR_INTERNAL, "devmap: no fallback for %s",
                                  xccl_coll_name(x.a->coll));
            for (int q = 0; q < x.size; q++)
                map[q] = q;
            st = xccl_task_sub(t, 0, fb, x.a, map, x.size, 0, xccl_task_step_limit(t));
            if (st != XCCL_OK) return st;
            x.st[SHM_PHASE] = PH_WORK;
            break;
        }
        case PH_WORK:
            SHM_TRY(xccl_task_test(t)); /* the device work has finished */
            shm_set_done(&x);
            x.st[SHM_PHASE] = PH_DONE;
            break;
        default: return shm_wait_done(&x, 0);
        }
    }
}

/* Costs: three flag rounds; all_reduce reduces its slice of n vectors and copies it to n - 1
 * peers; the others copy or reduce what the table above says. */
static void cost_dev(xccl_coll_t coll, int n, size_t nbytes, xccl_cost_t *out)
{
    double s = (double)nbytes, f = n > 1 ? (double)(n - 1) / n : 0;

    memset(out, 0, sizeof(*out));
    out->steps = n > 1 ? 3 : 0;
    switch (coll) {
    case XCCL_COLL_ALLREDUCE:
        out->reduce_bytes = n > 1 ? s / n * (n - 1) : 0;
        out->copy_bytes   = s * f;
        break;
    case XCCL_COLL_REDUCE_SCATTER: out->reduce_bytes = s / (n > 0 ? n : 1) * (n - 1); break;
    case XCCL_COLL_REDUCE: out->reduce_bytes = s * (n - 1); break;
    case XCCL_COLL_BROADCAST: out->copy_bytes = n > 1 ? s : 0; break;
    default: out->copy_bytes = s * f; break;
    }
}

#define DEV_COST(fn, coll)                                                                         \
    static void fn(int n, size_t nbytes, xccl_cost_t *out) { cost_dev(coll, n, nbytes, out); }
DEV_COST(cost_allreduce, XCCL_COLL_ALLREDUCE)
DEV_COST(cost_reduce_scatter, XCCL_COLL_REDUCE_SCATTER)
DEV_COST(cost_allgather, XCCL_COLL_ALLGATHER)
DEV_COST(cost_broadcast, XCCL_COLL_BROADCAST)
DEV_COST(cost_reduce, XCCL_COLL_REDUCE)
DEV_COST(cost_gather, XCCL_COLL_GATHER)
DEV_COST(cost_scatter, XCCL_COLL_SCATTER)
DEV_COST(cost_alltoall, XCCL_COLL_ALLTOALL)

#define DEV_ALGO(var, c, cost_fn, text)                                                            \
    const xccl_algo_t var = {.name       = "devmap",                                               \
                             .coll       = c,                                                      \
                             .summary    = text,                                                   \
                             .applicable = dev_applicable,                                         \
                             .cost       = cost_fn,                                                \
                             .progress   = dev_progress,                                           \
                             .shared     = 1}

DEV_ALGO(xccl_algo_allreduce_devmap, XCCL_COLL_ALLREDUCE, cost_allreduce,
         "one host, device memory: each rank reduces its slice from every rank's mapped buffer "
         "in rank order and writes it into every peer's; 3 flag steps, no messages");
DEV_ALGO(xccl_algo_reduce_scatter_devmap, XCCL_COLL_REDUCE_SCATTER, cost_reduce_scatter,
         "one host, device memory: each rank reduces its block from every rank's mapped send "
         "buffer in rank order; 3 flag steps, no messages");
DEV_ALGO(xccl_algo_allgather_devmap, XCCL_COLL_ALLGATHER, cost_allgather,
         "one host, device memory: each rank copies every peer's block from its mapped buffer; "
         "3 flag steps, no messages");
DEV_ALGO(xccl_algo_broadcast_devmap, XCCL_COLL_BROADCAST, cost_broadcast,
         "one host, device memory: every rank copies the root's mapped buffer; 3 flag steps, no "
         "messages");
DEV_ALGO(xccl_algo_reduce_devmap, XCCL_COLL_REDUCE, cost_reduce,
         "one host, device memory: the root reduces every rank's mapped send buffer in rank "
         "order; 3 flag steps, no messages");
DEV_ALGO(xccl_algo_gather_devmap, XCCL_COLL_GATHER, cost_gather,
         "one host, device memory: the root copies every rank's mapped send buffer; 3 flag "
         "steps, no messages");
DEV_ALGO(xccl_algo_scatter_devmap, XCCL_COLL_SCATTER, cost_scatter,
         "one host, device memory: every rank copies its block of the root's mapped send "
         "buffer; 3 flag steps, no messages");
DEV_ALGO(xccl_algo_alltoall_devmap, XCCL_COLL_ALLTOALL, cost_alltoall,
         "one host, device memory: each rank copies its block of every peer's mapped send "
         "buffer; 3 flag steps, no messages");
