/* SPDX-License-Identifier: Apache-2.0
 *
 * shm.c - the one-host algorithms "shm": every collective as a flag-based fan-in / fan-out
 * over per-rank slots of the node-shared segment (layout and protocol in shm.h), with no
 * message between ranks; and the protocol helpers that shm_cma.c (the "cma" algorithms,
 * cross-memory reads from peers' buffers) shares.
 *
 * A slot collective at epoch e, rank r of n (the data a rank writes must fit one slot,
 * SHM_SLOT_BYTES; `applicable` says so):
 *
 *   step  rank r
 *   1     wait until every rank's done >= e - 2 (nobody reads r's slot of parity e & 1 any more)
 *   2     copy its contribution into its slot; publish (signature, flag = e); signal
 *   3     for each rank it reads, as its flag reaches e (signature checked): copy or reduce
 *         from that rank's slot into its own buffers
 *   4     done = e; signal
 *
 *   collective      writes into its slot                 reads
 *   all_reduce      its vector                           every slot, rank order: reduced
 *   reduce          its vector                           root: every slot, rank order
 *   broadcast       root: the vector                     others: the root's slot
 *   all_gather      its block                            every other slot
 *   gather          its block                            root: every other slot
 *   scatter         root: all n blocks                   others: their block of the root's
 *   reduce_scatter  all n blocks                         block r of every slot, rank order
 *   all_to_all      all n blocks                         block r of every other slot
 *   all_to_all_v    a header (offset, bytes per peer) + its blocks, or, when they do not fit
 *                   and cross-memory reads work, the header with their addresses: peers then
 *                   read them from its send buffer and it completes once every peer is done
 *   barrier         nothing (the flag)                   every flag
 *
 * Reductions combine the n contributions in rank order, ((x0 op x1) op x2) ..., from the
 * slots, so every rank of all_reduce computes the same bits whatever the timing. Every rank
 * that reads a peer's slot checks that peer's signature first. A rank that reads nobody
 * (broadcast's and scatter's root, reduce's and gather's others) completes once its data is
 * published, like an eager send: it depends on no other rank, and a mismatched call fails at
 * the ranks that read it.
 *
 * Cost (per rank, the critical path): one step (a flag fan-in), the slot writes and reads as
 * copy_bytes (priced with δ), the reductions as reduce_bytes; nothing on the wire.
 */
#include "algo/shm.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "algo/patterns.h"
#include "core/check.h"

/* ---------------------------------------------------------------------------------------------
 * The protocol (shm.h)
 * ------------------------------------------------------------------------------------------- */

size_t shm_segment_bytes(int n)
{
    return n < 1 ? 0 : (size_t)n * (SHM_CTL_BYTES + 2 * SHM_SLOT_BYTES);
}

int shm_usable(const xccl_coll_args_t *a, int cma)
{
    unsigned need = XCCL_SHARED_SEG | (cma ? XCCL_SHARED_CMA : 0u);

    return a->topo != NULL && (a->topo->shared & need) == need && a->mem == XCCL_MEM_HOST;
}

xccl_status_t shm_begin(xccl_task_t *t, int id, shm_t *x)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    xccl_shared_t           sh;
    xccl_status_t           st;
    int                     n = xccl_task_size(t);

    st = xccl_task_shared(t, &sh);
    if (st != XCCL_OK) return st;
    if (sh.bytes < shm_segment_bytes(n) || sh.epoch == 0)
        return XCCL_ERROR(XCCL_ERR_INTERNAL,
                          "%s: the node-shared segment has %zu B (epoch %llu), %d ranks need %zu",
                          xccl_coll_name(a->coll), sh.bytes, (unsigned long long)sh.epoch, n,
                          shm_segment_bytes(n));
    x->t    = t;
    x->a    = a;
    x->st   = xccl_task_state(t);
    x->base = sh.base;
    x->e    = sh.epoch;
    x->p    = (int)(sh.epoch & 1);
    x->rank = xccl_task_rank(t);
    x->size = n;
    x->id   = id;
    x->es    = a->elsize;
    x->chunk = 0;
    return XCCL_OK;
}

/* The packed signature of this rank's call: collective, dtype, op, algorithm, root + 1. */
static uint64_t shm_sig(const shm_t *x)
{
    const xccl_coll_args_t *a = x->a;

    return (uint64_t)a->coll | (uint64_t)a->dtype << 8 | (uint64_t)a->op << 16 |
           (uint64_t)(unsigned)x->id << 24 | (uint64_t)(uint32_t)(a->root + 1) << 32;
}

static void shm_describe(uint64_t sig, uint64_t count, uint64_t chunk_bytes, char *buf,
                         size_t len)
{
    int    id = (int)(sig >> 24 & 0xff);
    size_t at;

    at = (size_t)snprintf(buf, len, "%s(dtype=%s, count=%llu, op=%s, root=%d) with algorithm %s",
                          xccl_coll_name((xccl_coll_t)(sig & 0xff)),
                          xccl_dtype_name((xccl_dtype_t)(sig >> 8 & 0xff)),
                          (unsigned long long)count, xccl_op_name((xccl_op_t)(sig >> 16 & 0xff)),
                          (int)(uint32_t)(sig >> 32) - 1,
                          id >= SHM_ID_DEV ? "devmap" : id >= SHM_ID_CMA ? "cma" : "shm");
    if (chunk_bytes && at < len)
        snprintf(buf + at, len - at, " in chunks of %llu B (" SHM_CHUNK_ENV ")",
                 (unsigned long long)chunk_bytes);
}

void shm_publish(shm_t *x, uint64_t a0, uint64_t a1)
{
    shm_ctl_t *c = shm_ctl(x, x->rank);

    c->sig[x->p][0]  = shm_sig(x);
    c->sig[x->p][1]  = x->a->count;
    c->sig[x->p][2]  = x->chunk;
    c->addr[x->p][0] = a0;
    c->addr[x->p][1] = a1;
    atomic_store_explicit(&c->flag[x->p], x->e, memory_order_release);
    xccl_task_shared_signal(x->t);
}

int shm_ready(shm_t *x, int q)
{
    shm_ctl_t *c = shm_ctl(x, q);
    char       mine[160], theirs[160];

    if (atomic_load_explicit(&c->flag[x->p], memory_order_acquire) < x->e) {
        xccl_task_shared_wait(x->t, q);
        return 0;
    }
    if (c->sig[x->p][0] == shm_sig(x) && c->sig[x->p][1] == x->a->count &&
        c->sig[x->p][2] == x->chunk)
        return 1;
    shm_describe(shm_sig(x), x->a->count, x->chunk * x->es, mine, sizeof(mine));
    shm_describe(c->sig[x->p][0], c->sig[x->p][1], c->sig[x->p][2] * x->es, theirs,
                 sizeof(theirs));
    return XCCL_ERROR(XCCL_ERR_MISMATCH,
                      "collective mismatch in the node-shared segment (epoch %llu): rank %d "
                      "called %s, rank %d called %s",
                      (unsigned long long)x->e, x->rank, mine, q, theirs);
}

int shm_prog_ready(shm_t *x, int q, uint64_t v)
{
    if (atomic_load_explicit(&shm_ctl(x, q)->prog, memory_order_acquire) >= shm_stamp(x->e, v))
        return 1;
    xccl_task_shared_wait(x->t, q);
    return 0;
}

void shm_set_prog(shm_t *x, uint64_t v)
{
    atomic_store_explicit(&shm_ctl(x, x->rank)->prog, shm_stamp(x->e, v), memory_order_release);
    xccl_task_shared_signal(x->t);
}

void shm_set_done(shm_t *x)
{
    atomic_store_explicit(&shm_ctl(x, x->rank)->done, x->e, memory_order_release);
    xccl_task_shared_signal(x->t);
}

xccl_status_t shm_wait_done(shm_t *x, uint64_t min_lag)
{
    for (int q = (int)x->st[SHM_CURSOR]; q < x->size; q++) {
        uint64_t d = atomic_load_explicit(&shm_ctl(x, q)->done, memory_order_acquire);
        if (d + min_lag < x->e) {
            x->st[SHM_CURSOR] = (uint64_t)q;
            xccl_task_shared_wait(x->t, q);
            return XCCL_INPROGRESS;
        }
    }
    x->st[SHM_CURSOR] = 0;
    return XCCL_OK;
}

size_t shm_chunk_elems(size_t count, size_t es)
{
    const char *v     = getenv(SHM_CHUNK_ENV);
    size_t      bytes = SHM_CHUNK_DEFAULT, ce;

    if (v != NULL && *v != '\0') {
        char              *end;
        unsigned long long b;
        errno = 0;
        b     = strtoull(v, &end, 10);
        if (errno == 0 && *end == '\0' && b >= 1) bytes = (size_t)b;
    }
    ce = bytes / es ? bytes / es : 1;
    if (count / ce >= (1u << 20)) ce = count / (1u << 20) + 1;
    return ce;
}

/* ---------------------------------------------------------------------------------------------
 * The slot algorithms
 * ------------------------------------------------------------------------------------------- */

/* Bytes the largest writer puts into its slot, or SIZE_MAX when that overflows. */
static size_t slot_need(const xccl_coll_args_t *a, int n)
{
    size_t es = a->elsize ? a->elsize : 1, m = 1;

    switch (a->coll) {
    case XCCL_COLL_SCATTER:
    case XCCL_COLL_REDUCE_SCATTER:
    case XCCL_COLL_ALLTOALL:
        m = (size_t)n;
        break;
    case XCCL_COLL_BARRIER:
        return 0;
    default:
        break;
    }
    if (a->count > SIZE_MAX / es / m) return SIZE_MAX;
    return a->count * es * m;
}

static int slot_applicable(const xccl_coll_args_t *a, int n)
{
    return shm_usable(a, 0) && slot_need(a, n) <= SHM_SLOT_BYTES;
}

static int is_reduction(xccl_coll_t c)
{
    return c == XCCL_COLL_ALLREDUCE || c == XCCL_COLL_REDUCE || c == XCCL_COLL_REDUCE_SCATTER;
}

/* Step 2: this rank's contribution into its slot. */
static xccl_status_t slot_write(shm_t *x)
{
    const xccl_coll_args_t *a   = x->a;
    size_t                  blk = a->count * x->es, n = (size_t)x->size;
    const void             *src  = NULL;
    size_t                  len  = 0;
    int                     root = x->rank == a->root;

    switch (a->coll) {
    case XCCL_COLL_ALLREDUCE:
        src = a->rbuf, len = blk;
        break;
    case XCCL_COLL_BROADCAST:
        if (root) src = a->rbuf, len = blk;
        break;
    case XCCL_COLL_REDUCE:
        src = a->sbuf, len = blk;
        break;
    case XCCL_COLL_ALLGATHER:
        src = (const char *)a->rbuf + (size_t)x->rank * blk, len = blk;
        break;
    case XCCL_COLL_GATHER:
        if (!root) src = a->sbuf, len = blk;
        break;
    case XCCL_COLL_SCATTER:
        if (root) src = a->sbuf, len = n * blk;
        break;
    case XCCL_COLL_REDUCE_SCATTER:
    case XCCL_COLL_ALLTOALL:
        src = a->sbuf, len = n * blk;
        break;
    default:
        break;
    }
    return len ? xccl_task_copy(x->t, shm_slot(x, x->rank), src, len) : XCCL_OK;
}

/* Which ranks this rank reads in step 3: 2 every rank, 1 the root only, 0 none. */
static int slot_reads(const shm_t *x)
{
    int root = x->rank == x->a->root;

    switch (x->a->coll) {
    case XCCL_COLL_REDUCE:
    case XCCL_COLL_GATHER:
        return root ? 2 : 0;
    case XCCL_COLL_BROADCAST:
    case XCCL_COLL_SCATTER:
        return root ? 0 : 1;
    default:
        return 2;
    }
}

/* Step 3 for rank q, the j-th rank read (j = q for reductions). */
static xccl_status_t slot_consume(shm_t *x, int q, int j)
{
    const xccl_coll_args_t *a   = x->a;
    size_t                  blk = a->count * x->es, r = (size_t)x->rank;
    char                   *rb = a->rbuf;
    const unsigned char    *s  = shm_slot(x, q);

    if (blk == 0) return XCCL_OK;
    switch (a->coll) {
    case XCCL_COLL_ALLREDUCE:
    case XCCL_COLL_REDUCE:
    case XCCL_COLL_REDUCE_SCATTER: {
        size_t at = a->coll == XCCL_COLL_REDUCE_SCATTER ? r * blk : 0;
        if (j == 0) return x->size == 1 ? xccl_task_copy(x->t, rb, s + at, blk) : XCCL_OK;
        if (j == 1) return xccl_task_reduce(x->t, rb, shm_slot(x, 0) + at, s + at, a->count);
        return xccl_task_reduce(x->t, rb, rb, s + at, a->count);
    }
    case XCCL_COLL_ALLGATHER:
    case XCCL_COLL_GATHER:
        return q == x->rank ? XCCL_OK : xccl_task_copy(x->t, rb + (size_t)q * blk, s, blk);
    case XCCL_COLL_ALLTOALL:
        return q == x->rank ? XCCL_OK
                            : xccl_task_copy(x->t, rb + (size_t)q * blk, s + r * blk, blk);
    case XCCL_COLL_BROADCAST:
        return xccl_task_copy(x->t, rb, s, blk);
    case XCCL_COLL_SCATTER:
        return xccl_task_copy(x->t, rb, s + r * blk, blk);
    default:
        return XCCL_OK;
    }
}

static xccl_status_t slot_progress(xccl_task_t *t)
{
    shm_t         x;
    xccl_status_t st = shm_begin(t, SHM_ID_SLOT + (int)xccl_task_args(t)->coll, &x);
    int           n, reads, red;

    if (st != XCCL_OK) return st;
    n     = x.size;
    reads = slot_reads(&x);
    red   = is_reduction(x.a->coll);
    if (x.st[SHM_PHASE] == 0) {
        SHM_TRY(shm_wait_done(&x, 2));
        XCCL_CHECK(slot_write(&x));
        shm_publish(&x, 0, 0);
        x.st[SHM_PHASE] = 1;
    }
    if (x.st[SHM_PHASE] == 1) {
        int nread = reads == 2 ? n : reads;
        for (int j = (int)x.st[SHM_CURSOR]; j < nread; j++) {
            int q  = reads == 1 ? x.a->root : red ? j : (x.rank + j) % n;
            int rd = shm_ready(&x, q);
            if (rd <= 0) {
                x.st[SHM_CURSOR] = (uint64_t)j;
                return rd < 0 ? rd : XCCL_INPROGRESS;
            }
            XCCL_CHECK(slot_consume(&x, q, j));
        }
        x.st[SHM_CURSOR] = 0;
        x.st[SHM_PHASE]  = 2;
    }
    shm_set_done(&x);
    return XCCL_OK;
}

/* ---- all_to_all_v: blocks in the slot when they fit, else their addresses ---------------- */

enum { A2AV_SLOT = 1, A2AV_CMA = 2, A2AV_TOO_BIG = 3 };

static int a2av_applicable(const xccl_coll_args_t *a, int n)
{
    return shm_usable(a, 0) && (size_t)n * 16 <= SHM_SLOT_BYTES / 2;
}

static xccl_status_t a2av_progress(xccl_task_t *t)
{
    shm_t                   x;
    xccl_status_t           st = shm_begin(t, SHM_ID_SLOT + XCCL_COLL_ALLTOALLV, &x);
    const xccl_coll_args_t *a;
    int                     n, r;

    if (st != XCCL_OK) return st;
    a = x.a, n = x.size, r = x.rank;
    if (x.st[SHM_PHASE] == 0) {
        uint64_t *hdr  = (uint64_t *)(void *)shm_slot(&x, r);
        size_t    hdrb = (size_t)n * 16, total = 0, off = hdrb;
        uint64_t  mode;
        int       cma = a->topo->shared & XCCL_SHARED_CMA;

        SHM_TRY(shm_wait_done(&x, 2));
        for (int q = 0; q < n; q++)
            total += q == r ? 0 : a->scounts[q] * x.es;
        mode = total <= SHM_SLOT_BYTES - hdrb ? A2AV_SLOT : cma ? A2AV_CMA : A2AV_TOO_BIG;
        for (int q = 0; q < n; q++) {
            size_t      b   = q == r ? 0 : a->scounts[q] * x.es;
            const char *src = (const char *)a->sbuf + a->sdispls[q] * x.es;
            hdr[2 * q + 1]  = b;
            if (mode == A2AV_SLOT) {
                hdr[2 * q] = off;
                XCCL_CHECK(xccl_task_copy(t, (unsigned char *)hdr + off, src, b));
                off += b;
            } else {
                hdr[2 * q] = (uint64_t)(uintptr_t)src;
            }
        }
        shm_publish(&x, mode, 0);
        if (mode == A2AV_TOO_BIG) {
            shm_set_done(&x);
            return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                              "all_to_all_v: algorithm shm: rank %d sends %zu B to its peers, "
                              "more than a segment slot holds (%zu B), and cross-memory reads "
                              "are not available between these ranks; choose another algorithm",
                              r, total, SHM_SLOT_BYTES - hdrb);
        }
        x.st[SHM_PHASE] = 1;
        x.st[2]         = mode;
    }
    if (x.st[SHM_PHASE] == 1) {
        for (int j = (int)x.st[SHM_CURSOR]; j < n; j++) {
            int             q = (r + j) % n, rd;
            const uint64_t *hdr;
            uint64_t        mode, o, b;
            size_t          want = a->rcounts[q] * x.es;
            char           *dst  = (char *)a->rbuf + a->rdispls[q] * x.es;

            if (q == r) continue;
            rd = shm_ready(&x, q);
            if (rd <= 0) {
                x.st[SHM_CURSOR] = (uint64_t)j;
                return rd < 0 ? rd : XCCL_INPROGRESS;
            }
            hdr  = (const uint64_t *)(const void *)shm_slot(&x, q);
            mode = shm_ctl(&x, q)->addr[x.p][0];
            o    = hdr[2 * r];
            b    = hdr[2 * r + 1];
            if (mode == A2AV_TOO_BIG)
                return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                                  "all_to_all_v: algorithm shm: rank %d's blocks do not fit its "
                                  "segment slot and cross-memory reads are not available",
                                  q);
            if (b != want)
                return XCCL_ERROR(XCCL_ERR_MISMATCH,
                                  "all_to_all_v: rank %d sends %llu B to rank %d, which expects "
                                  "%zu B from it",
                                  q, (unsigned long long)b, r, want);
            if (mode == A2AV_SLOT)
                XCCL_CHECK(xccl_task_copy(t, dst, shm_slot(&x, q) + o, b));
            else
                XCCL_CHECK(xccl_task_peer_read(t, q, dst, (const void *)(uintptr_t)o, b));
        }
        x.st[SHM_CURSOR] = 0;
        x.st[SHM_PHASE]  = 2;
        shm_set_done(&x);
    }
    /* send blocks read in place: complete once every peer has read them */
    if (x.st[2] == A2AV_CMA) SHM_TRY(shm_wait_done(&x, 0));
    return XCCL_OK;
}

/* ---- costs ------------------------------------------------------------------------------ */

/* nbytes is the collective's size (task.h): one fan-in step, copies priced with δ. */
static void slot_cost(xccl_coll_t c, int n, size_t nbytes, xccl_cost_t *o)
{
    double N = (double)nbytes, f = n > 0 ? (double)(n - 1) / n : 0;

    *o = (xccl_cost_t){.steps = n > 1 ? 1 : 0};
    switch (c) {
    case XCCL_COLL_ALLREDUCE:
    case XCCL_COLL_REDUCE:
        o->copy_bytes = N, o->reduce_bytes = (n - 1) * N;
        break;
    case XCCL_COLL_BROADCAST:
        o->copy_bytes = 2 * N;
        break;
    case XCCL_COLL_ALLGATHER:
    case XCCL_COLL_GATHER:
        o->copy_bytes = N;
        break;
    case XCCL_COLL_SCATTER:
        o->copy_bytes = N + N / n;
        break;
    case XCCL_COLL_REDUCE_SCATTER:
        o->copy_bytes = N, o->reduce_bytes = f * N;
        break;
    case XCCL_COLL_ALLTOALL:
    case XCCL_COLL_ALLTOALLV:
        o->copy_bytes = N + f * N;
        break;
    default:
        break;
    }
}

#define SLOT_COST(fn, coll)                                                                        \
    static void fn(int n, size_t nbytes, xccl_cost_t *o)                                           \
    {                                                                                              \
        slot_cost(coll, n, nbytes, o);                                                             \
    }
SLOT_COST(cost_allreduce, XCCL_COLL_ALLREDUCE)
SLOT_COST(cost_broadcast, XCCL_COLL_BROADCAST)
SLOT_COST(cost_reduce, XCCL_COLL_REDUCE)
SLOT_COST(cost_allgather, XCCL_COLL_ALLGATHER)
SLOT_COST(cost_gather, XCCL_COLL_GATHER)
SLOT_COST(cost_scatter, XCCL_COLL_SCATTER)
SLOT_COST(cost_reduce_scatter, XCCL_COLL_REDUCE_SCATTER)
SLOT_COST(cost_alltoall, XCCL_COLL_ALLTOALL)
SLOT_COST(cost_alltoallv, XCCL_COLL_ALLTOALLV)
SLOT_COST(cost_barrier, XCCL_COLL_BARRIER)

#define SLOT_ALGO(var, c, cost_fn, text)                                                           \
    const xccl_algo_t var = {.name       = "shm",                                                  \
                             .coll       = c,                                                      \
                             .summary    = text,                                                   \
                             .applicable = slot_applicable,                                        \
                             .cost       = cost_fn,                                                \
                             .progress   = slot_progress,                                          \
                             .shared     = 1}

SLOT_ALGO(xccl_algo_allreduce_shm, XCCL_COLL_ALLREDUCE, cost_allreduce,
          "one host: every rank writes its vector to its segment slot and reduces all slots "
          "in rank order (identical bits everywhere); 1 flag step, no messages");
SLOT_ALGO(xccl_algo_broadcast_shm, XCCL_COLL_BROADCAST, cost_broadcast,
          "one host: the root writes the vector to its segment slot, every rank copies it "
          "out; 1 flag step, no messages");
SLOT_ALGO(xccl_algo_reduce_shm, XCCL_COLL_REDUCE, cost_reduce,
          "one host: every rank writes its vector to its segment slot, the root reduces all "
          "slots in rank order; 1 flag step, no messages");
SLOT_ALGO(xccl_algo_allgather_shm, XCCL_COLL_ALLGATHER, cost_allgather,
          "one host: every rank writes its block to its segment slot and copies the others' "
          "blocks; 1 flag step, no messages");
SLOT_ALGO(xccl_algo_gather_shm, XCCL_COLL_GATHER, cost_gather,
          "one host: every rank writes its block to its segment slot, the root copies them; "
          "1 flag step, no messages");
SLOT_ALGO(xccl_algo_scatter_shm, XCCL_COLL_SCATTER, cost_scatter,
          "one host: the root writes all blocks to its segment slot, every rank copies its "
          "own; 1 flag step, no messages");
SLOT_ALGO(xccl_algo_reduce_scatter_shm, XCCL_COLL_REDUCE_SCATTER, cost_reduce_scatter,
          "one host: every rank writes its input to its segment slot and reduces its block "
          "of all slots in rank order; 1 flag step, no messages");
SLOT_ALGO(xccl_algo_alltoall_shm, XCCL_COLL_ALLTOALL, cost_alltoall,
          "one host: every rank writes its send buffer to its segment slot and copies its "
          "block from every slot; 1 flag step, no messages");
SLOT_ALGO(xccl_algo_barrier_shm, XCCL_COLL_BARRIER, cost_barrier,
          "one host: every rank sets its flag in the segment and waits for all flags; "
          "no messages");

const xccl_algo_t xccl_algo_alltoallv_shm = {
    .name       = "shm",
    .coll       = XCCL_COLL_ALLTOALLV,
    .summary    = "one host: blocks through the segment slots where a rank's fit, else read "
                  "from its send buffer by cross-memory attach; 1 flag step, no messages",
    .applicable = a2av_applicable,
    .cost       = cost_alltoallv,
    .progress   = a2av_progress,
    .shared     = 1,
};
