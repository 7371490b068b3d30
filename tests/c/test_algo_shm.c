/* SPDX-License-Identifier: Apache-2.0
 *
 * test_algo_shm.c - the one-host algorithms (csrc/algo/shm.c "shm", shm_cma.c "cma") on the
 * simulator's node-shared segment (tests/c/sim.c): every collective x dtypes x ops x counts
 * (0, 1, odd, slot-sized, many chunks) x group sizes (1..64) x roots against references
 * computed here in rank order, collectives back to back (slots reused across epochs, ranks
 * epochs apart), mismatched calls, applicability, selection and costs against the reads and
 * copies the simulator counted. The device-memory algorithms (shm_dev.c, "devmap") run the
 * same sweeps on fake device memory (fake_dev.h: asynchronous, inaccessible to the CPU outside
 * executor calls), and with a rank that cannot export (the message-based fallback).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "algo/shm.h"
#include "ctest.h"
#include "fake_dev.h"
#include "sim.h"

#define MAXN 64

extern const xccl_algo_t xccl_algo_allreduce_shm, xccl_algo_broadcast_shm, xccl_algo_reduce_shm,
    xccl_algo_allgather_shm, xccl_algo_gather_shm, xccl_algo_scatter_shm,
    xccl_algo_reduce_scatter_shm, xccl_algo_alltoall_shm, xccl_algo_alltoallv_shm,
    xccl_algo_barrier_shm;
extern const xccl_algo_t xccl_algo_allreduce_devmap, xccl_algo_broadcast_devmap,
    xccl_algo_reduce_devmap, xccl_algo_allgather_devmap, xccl_algo_gather_devmap,
    xccl_algo_scatter_devmap, xccl_algo_reduce_scatter_devmap, xccl_algo_alltoall_devmap;
extern const xccl_algo_t xccl_algo_allreduce_cma, xccl_algo_broadcast_cma, xccl_algo_reduce_cma,
    xccl_algo_allgather_cma, xccl_algo_gather_cma, xccl_algo_scatter_cma,
    xccl_algo_reduce_scatter_cma, xccl_algo_alltoall_cma;

static const int         node0[MAXN]; /* every rank on node 0 */
static const xccl_topo_t topo_seg = {.nnodes = 1, .node_of = node0, .shared = XCCL_SHARED_SEG};
static const xccl_topo_t topo_cma = {
    .nnodes = 1, .node_of = node0, .shared = XCCL_SHARED_SEG | XCCL_SHARED_CMA};
static const xccl_topo_t topo_none = {.nnodes = 1, .node_of = node0};

static uint64_t rng = 88172645463325252ull;
static uint64_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* ---- data and references ----------------------------------------------------------------- */

/* Element values: small integers (every order exact) for integer dtypes, arbitrary floats
 * (rounding depends on the order: checks that the order is rank order) for float ones. */
static void fill(void *buf, size_t count, xccl_dtype_t dt, xccl_op_t op)
{
    for (size_t i = 0; i < count; i++) {
        uint64_t h = rnd();
        switch (dt) {
        case XCCL_INT32:
            ((int32_t *)buf)[i] =
                op == XCCL_OP_PROD ? (h & 1 ? 1 : -1) : (int32_t)(h % 2001) - 1000;
            break;
        case XCCL_INT64:
            ((int64_t *)buf)[i] =
                op == XCCL_OP_PROD ? (h & 1 ? 1 : -1) : (int64_t)(h % 200001) - 100000;
            break;
        case XCCL_UINT8:
            ((uint8_t *)buf)[i] = (uint8_t)h;
            break;
        case XCCL_FLOAT32:
            ((float *)buf)[i] = op == XCCL_OP_PROD ? 1.0f + (float)(h % 1000) / 997.0f
                                                   : (float)((int64_t)(h % 20001) - 10000) / 7.0f;
            break;
        case XCCL_FLOAT64:
            ((double *)buf)[i] = op == XCCL_OP_PROD ? 1.0 + (double)(h % 1000) / 997.0
                                                    : (double)((int64_t)(h % 20001) - 10000) / 7.0;
            break;
        default:
            ((uint8_t *)buf)[i] = (uint8_t)h;
            break;
        }
    }
}

#define REF_LOOP(T)                                                                                \
    do {                                                                                           \
        T       *d = acc;                                                                          \
        const T *s = x;                                                                            \
        for (size_t i = 0; i < count; i++) {                                                       \
            switch (op) {                                                                          \
            case XCCL_OP_SUM:                                                                      \
                d[i] = (T)(d[i] + s[i]);                                                           \
                break;                                                                             \
            case XCCL_OP_PROD:                                                                     \
                d[i] = (T)(d[i] * s[i]);                                                           \
                break;                                                                             \
            case XCCL_OP_MIN:                                                                      \
                d[i] = s[i] < d[i] ? s[i] : d[i];                                                  \
                break;                                                                             \
            case XCCL_OP_MAX:                                                                      \
                d[i] = s[i] > d[i] ? s[i] : d[i];                                                  \
                break;                                                                             \
            default:                                                                               \
                break;                                                                             \
            }                                                                                      \
        }                                                                                          \
    } while (0)

#define REF_BITS(T)                                                                                \
    do {                                                                                           \
        T       *d = acc;                                                                          \
        const T *s = x;                                                                            \
        for (size_t i = 0; i < count; i++)                                                         \
            d[i] = op == XCCL_OP_BAND  ? (T)(d[i] & s[i])                                          \
                   : op == XCCL_OP_BOR ? (T)(d[i] | s[i])                                          \
                                       : (T)(d[i] ^ s[i]);                                         \
    } while (0)

/* acc = acc op x, elementwise, written independently of the library's kernels. */
static void ref_reduce(xccl_dtype_t dt, xccl_op_t op, void *acc, const void *x, size_t count)
{
    int bits = op == XCCL_OP_BAND || op == XCCL_OP_BOR || op == XCCL_OP_BXOR;
    switch (dt) {
    case XCCL_INT32:
        if (bits)
            REF_BITS(int32_t);
        else
            REF_LOOP(int32_t);
        break;
    case XCCL_INT64:
        if (bits)
            REF_BITS(int64_t);
        else
            REF_LOOP(int64_t);
        break;
    case XCCL_UINT8:
        if (bits)
            REF_BITS(uint8_t);
        else
            REF_LOOP(uint8_t);
        break;
    case XCCL_FLOAT32:
        REF_LOOP(float);
        break;
    case XCCL_FLOAT64:
        REF_LOOP(double);
        break;
    default:
        break;
    }
}

/* ---- one collective: inputs, normalised buffers (task.h), expected outputs -------------- */

typedef struct ccase {
    xccl_coll_t      coll;
    int              n, root;
    size_t           count, es;
    xccl_dtype_t     dt;
    xccl_op_t        op;
    unsigned char   *in[MAXN]; /* the logical input of rank r                        */
    unsigned char   *sbuf[MAXN], *rbuf[MAXN];
    unsigned char   *want[MAXN];        /* expected rbuf (NULL: not checked)                  */
    size_t           rbytes;            /* bytes of rbuf checked                              */
    size_t           v[4][MAXN * MAXN]; /* alltoallv scounts, sdispls, rcounts, rdispls */
    xccl_coll_args_t args[MAXN];
} ccase_t;

static size_t in_elems(xccl_coll_t c, int n, size_t count)
{
    switch (c) {
    case XCCL_COLL_SCATTER:
    case XCCL_COLL_REDUCE_SCATTER:
    case XCCL_COLL_ALLTOALL:
        return (size_t)n * count;
    default:
        return count;
    }
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p == NULL) abort();
    return p;
}

/* Random all_to_all_v counts: v[0] scounts of rank r at [r * n + q] = v[2] rcounts of q at
 * [q * n + r]; displacements packed with a gap. `big` makes some blocks exceed a slot. */
static void a2av_counts(ccase_t *c, int big)
{
    int n = c->n;
    for (int r = 0; r < n; r++)
        for (int q = 0; q < n; q++) {
            size_t k = rnd() % (big ? 4000 : 5);
            if (rnd() % 4 == 0) k = 0;
            c->v[0][r * n + q] = k;
            c->v[2][q * n + r] = k;
        }
    for (int r = 0; r < n; r++) {
        size_t so = 0, ro = 0;
        for (int q = n - 1; q >= 0; q--) { /* reversed order: displacements are not sorted */
            c->v[1][r * n + q] = so;
            so += c->v[0][r * n + q] + 1;
            c->v[3][r * n + q] = ro;
            ro += c->v[2][r * n + q] + 2;
        }
    }
}

static size_t a2av_extent(const size_t *counts, const size_t *displs, int n)
{
    size_t m = 0;
    for (int q = 0; q < n; q++)
        if (displs[q] + counts[q] > m) m = displs[q] + counts[q];
    return m;
}

/* memcpy that accepts NULL buffers for zero bytes */
static void cp(void *dst, const void *src, size_t n)
{
    if (n) memcpy(dst, src, n);
}

/* Operation buffers: host memory, or fake device memory while dev_mode is set (the test opens
 * it to the CPU except while the simulator runs). */
static int dev_mode;

static void *buf_alloc(size_t n)
{
    void *p;
    if (!dev_mode) return xmalloc(n);
    p = fdev_alloc(n ? n : 1);
    if (p == NULL) abort();
    return p;
}

static void buf_free(void *p)
{
    if (p == NULL) return;
    if (dev_mode) fdev_free(p);
    else free(p);
}

static void case_init(ccase_t *c, xccl_coll_t coll, int n, size_t count, xccl_dtype_t dt,
                      xccl_op_t op, int root, const xccl_topo_t *topo, int a2av_big)
{
    size_t es = xccl_dtype_size(dt), ie = in_elems(coll, n, count), blk = count * es;

    memset(c, 0, sizeof(*c));
    c->coll = coll, c->n = n, c->count = count, c->es = es, c->dt = dt, c->op = op;
    c->root = root;
    if (coll == XCCL_COLL_ALLTOALLV) a2av_counts(c, a2av_big);
    for (int r = 0; r < n; r++) {
        size_t sb = ie * es, rb = 0;
        c->in[r] = xmalloc(ie * es);
        fill(c->in[r], ie, dt, op);
        switch (coll) {
        case XCCL_COLL_ALLREDUCE:
        case XCCL_COLL_BROADCAST:
            rb = blk;
            break;
        case XCCL_COLL_REDUCE:
            rb = r == root ? blk : 0;
            break;
        case XCCL_COLL_ALLGATHER:
            rb = n * blk;
            break;
        case XCCL_COLL_GATHER:
            rb = r == root ? n * blk : 0;
            break;
        case XCCL_COLL_SCATTER:
        case XCCL_COLL_REDUCE_SCATTER:
            rb = blk;
            break;
        case XCCL_COLL_ALLTOALL:
            rb = n * blk;
            break;
        case XCCL_COLL_ALLTOALLV:
            sb = a2av_extent(&c->v[0][r * n], &c->v[1][r * n], n) * es;
            rb = a2av_extent(&c->v[2][r * n], &c->v[3][r * n], n) * es;
            free(c->in[r]);
            c->in[r] = xmalloc(sb);
            fill(c->in[r], sb / es, dt, op);
            break;
        default:
            break;
        }
        c->sbuf[r] = buf_alloc(sb);
        cp(c->sbuf[r], c->in[r], sb);
        c->rbuf[r] = rb ? buf_alloc(rb) : NULL;
        if (rb) memset(c->rbuf[r], 0x5a, rb);
        c->args[r] = (xccl_coll_args_t){.coll   = coll,
                                        .sbuf   = c->sbuf[r],
                                        .rbuf   = c->rbuf[r],
                                        .count  = coll == XCCL_COLL_ALLTOALLV ? 0 : count,
                                        .dtype  = dt,
                                        .elsize = es,
                                        .op     = op,
                                        .root   = root,
                                        .topo   = topo,
                                        .mem    = dev_mode ? XCCL_MEM_CUDA : XCCL_MEM_HOST};
        if (coll == XCCL_COLL_ALLTOALLV) {
            c->args[r].scounts = &c->v[0][r * n];
            c->args[r].sdispls = &c->v[1][r * n];
            c->args[r].rcounts = &c->v[2][r * n];
            c->args[r].rdispls = &c->v[3][r * n];
        }
    }
    /* the core's prologue (task.h, "Buffers as algorithms see them") */
    for (int r = 0; r < n; r++) {
        switch (coll) {
        case XCCL_COLL_ALLREDUCE:
            cp(c->rbuf[r], c->in[r], blk);
            c->args[r].sbuf = c->rbuf[r];
            break;
        case XCCL_COLL_BROADCAST:
            if (r == root) cp(c->rbuf[r], c->in[r], blk);
            c->args[r].sbuf = c->rbuf[r];
            break;
        case XCCL_COLL_ALLGATHER:
            cp(c->rbuf[r] + r * blk, c->in[r], blk);
            break;
        case XCCL_COLL_GATHER:
            if (r == root) cp(c->rbuf[r] + r * blk, c->in[r], blk);
            break;
        case XCCL_COLL_SCATTER:
            if (r == root) cp(c->rbuf[r], c->in[r] + r * blk, blk);
            break;
        case XCCL_COLL_ALLTOALL:
            cp(c->rbuf[r] + r * blk, c->in[r] + r * blk, blk);
            break;
        case XCCL_COLL_ALLTOALLV:
            cp(c->rbuf[r] + c->v[3][r * n + r] * es, c->in[r] + c->v[1][r * n + r] * es,
               c->v[0][r * n + r] * es);
            break;
        default:
            break;
        }
    }
    /* expected outputs, from the inputs alone */
    for (int r = 0; r < n; r++) {
        unsigned char *w;
        switch (coll) {
        case XCCL_COLL_ALLREDUCE:
        case XCCL_COLL_REDUCE:
        case XCCL_COLL_REDUCE_SCATTER: {
            size_t at = coll == XCCL_COLL_REDUCE_SCATTER ? r * blk : 0;
            if (coll == XCCL_COLL_REDUCE && r != root) break;
            w = c->want[r] = xmalloc(blk);
            cp(w, c->in[0] + at, blk);
            for (int q = 1; q < n; q++)
                ref_reduce(dt, op, w, c->in[q] + at, count);
            break;
        }
        case XCCL_COLL_BROADCAST:
            w = c->want[r] = xmalloc(blk);
            cp(w, c->in[root], blk);
            break;
        case XCCL_COLL_ALLGATHER:
        case XCCL_COLL_GATHER:
            if (coll == XCCL_COLL_GATHER && r != root) break;
            w = c->want[r] = xmalloc(n * blk);
            for (int q = 0; q < n; q++)
                cp(w + q * blk, c->in[q], blk);
            break;
        case XCCL_COLL_SCATTER:
            w = c->want[r] = xmalloc(blk);
            cp(w, c->in[root] + r * blk, blk);
            break;
        case XCCL_COLL_ALLTOALL:
            w = c->want[r] = xmalloc(n * blk);
            for (int q = 0; q < n; q++)
                cp(w + q * blk, c->in[q] + r * blk, blk);
            break;
        case XCCL_COLL_ALLTOALLV: {
            size_t rb = a2av_extent(&c->v[2][r * n], &c->v[3][r * n], n) * es;
            w = c->want[r] = xmalloc(rb);
            memset(w, 0x5a, rb);
            for (int q = 0; q < n; q++)
                cp(w + c->v[3][r * n + q] * es, c->in[q] + c->v[1][q * n + r] * es,
                   c->v[2][r * n + q] * es);
            break;
        }
        default:
            break;
        }
    }
}

static size_t want_bytes(const ccase_t *c, int r)
{
    size_t blk = c->count * c->es;
    switch (c->coll) {
    case XCCL_COLL_ALLGATHER:
    case XCCL_COLL_GATHER:
    case XCCL_COLL_ALLTOALL:
        return c->n * blk;
    case XCCL_COLL_ALLTOALLV:
        return a2av_extent(&c->v[2][r * c->n], &c->v[3][r * c->n], c->n) * c->es;
    default:
        return blk;
    }
}

/* Compares every rank's output with the reference; returns 1 when all match. */
static int case_check(const ccase_t *c, const char *what)
{
    for (int r = 0; r < c->n; r++) {
        size_t nb = want_bytes(c, r);
        if (c->want[r] == NULL || nb == 0) continue;
        if (memcmp(c->rbuf[r], c->want[r], nb) != 0) {
            size_t i = 0;
            while (i < nb && c->rbuf[r][i] == c->want[r][i])
                i++;
            CHECK_MSG(0, "%s: rank %d differs at byte %zu of %zu", what, r, i, nb);
            return 0;
        }
    }
    /* inputs that are read-only stay untouched */
    for (int r = 0; r < c->n; r++) {
        size_t nb = c->coll == XCCL_COLL_ALLTOALLV
                        ? a2av_extent(&c->v[0][r * c->n], &c->v[1][r * c->n], c->n) * c->es
                        : in_elems(c->coll, c->n, c->count) * c->es;
        if (c->coll == XCCL_COLL_ALLREDUCE || c->coll == XCCL_COLL_BROADCAST) continue;
        if (memcmp(c->sbuf[r], c->in[r], nb) != 0) {
            CHECK_MSG(0, "%s: rank %d's send buffer was modified", what, r);
            return 0;
        }
    }
    return 1;
}

static void case_free(ccase_t *c)
{
    for (int r = 0; r < c->n; r++) {
        free(c->in[r]);
        buf_free(c->sbuf[r]);
        buf_free(c->rbuf[r]);
        free(c->want[r]);
    }
}

static int run_case(const xccl_algo_t *a, ccase_t *c, uint64_t seed, const char *what,
                    sim_result_t *keep)
{
    sim_opts_t    opts = {.seed            = seed,
                          .max_passes      = 2000000,
                          .slow            = seed % 2,
                          .transfer_access = dev_mode ? fdev_open : NULL};
    sim_result_t  res;
    xccl_status_t st;
    int           ok;

    if (dev_mode) fdev_open(0); /* the CPU must not touch device memory meanwhile */
    st = sim_run(a, c->n, c->args, &opts, &res);
    if (dev_mode) fdev_open(1);
    ok = st == XCCL_OK;

    CHECK_MSG(ok, "%s: %s: %s", what, xccl_status_string(st), res.error);
    if (ok) ok = case_check(c, what);
    if (keep != NULL)
        *keep = res;
    else
        sim_result_free(&res);
    return ok;
}

/* ---- sweeps ------------------------------------------------------------------------------ */

static const xccl_coll_t all_colls[] = {
    XCCL_COLL_ALLREDUCE, XCCL_COLL_BROADCAST, XCCL_COLL_REDUCE,         XCCL_COLL_ALLGATHER,
    XCCL_COLL_GATHER,    XCCL_COLL_SCATTER,   XCCL_COLL_REDUCE_SCATTER, XCCL_COLL_ALLTOALL,
    XCCL_COLL_ALLTOALLV, XCCL_COLL_BARRIER};

static int reducing(xccl_coll_t c)
{
    return c == XCCL_COLL_ALLREDUCE || c == XCCL_COLL_REDUCE || c == XCCL_COLL_REDUCE_SCATTER;
}

static int rooted(xccl_coll_t c)
{
    return c == XCCL_COLL_BROADCAST || c == XCCL_COLL_REDUCE || c == XCCL_COLL_GATHER ||
           c == XCCL_COLL_SCATTER;
}

/* The largest count whose slot write fits a slot. */
static size_t slot_count(xccl_coll_t c, int n, size_t es)
{
    size_t m = in_elems(c, n, 1);
    return SHM_SLOT_BYTES / es / m;
}

static int ncases;

static void sweep_one(const xccl_algo_t *a, const xccl_topo_t *topo, int n, size_t count,
                      xccl_dtype_t dt, xccl_op_t op, int root, uint64_t seed, int a2av_big)
{
    ccase_t *c = xmalloc(sizeof(*c));
    char     what[200];

    case_init(c, a->coll, n, count, dt, op, root, topo, a2av_big);
    snprintf(what, sizeof(what), "%s/%s n=%d count=%zu %s %s root=%d seed=%llu%s",
             xccl_coll_name(a->coll), a->name, n, count, xccl_dtype_name(dt), xccl_op_name(op),
             root, (unsigned long long)seed, a2av_big ? " big" : "");
    if (a->applicable == NULL || a->applicable(&c->args[0], n)) {
        run_case(a, c, seed, what, NULL);
        ncases++;
    } else {
        CHECK_MSG(0, "%s: not applicable", what);
    }
    case_free(c);
    free(c);
}

static void sweep(const xccl_algo_t *a, const xccl_topo_t *topo)
{
    static const int          ns[]  = {1, 2, 3, 5, 8, 16};
    static const xccl_dtype_t rdt[] = {XCCL_INT32, XCCL_FLOAT32, XCCL_FLOAT64, XCCL_UINT8,
                                       XCCL_INT64};
    static const xccl_op_t    ops[] = {XCCL_OP_SUM,  XCCL_OP_PROD, XCCL_OP_MIN, XCCL_OP_MAX,
                                       XCCL_OP_BAND, XCCL_OP_BOR,  XCCL_OP_BXOR};
    /* beyond slots: many chunks for cma, a slice per rank for devmap */
    int                       cma   = strcmp(a->name, "shm") != 0;

    for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++) {
        int n = ns[ni];
        for (int di = 0; di < 5; di++) {
            xccl_dtype_t dt       = rdt[di];
            size_t       es       = xccl_dtype_size(dt);
            size_t       big      = cma ? 1000 + (size_t)n : slot_count(a->coll, n, es);
            size_t       counts[] = {0, 1, 7, big};
            for (size_t ci = 0; ci < 4; ci++) {
                size_t count = counts[ci];
                if (a->coll == XCCL_COLL_BARRIER && ci > 0) break;
                for (int oi = 0; oi < 7; oi++) {
                    xccl_op_t op   = ops[oi];
                    int       fl   = dt == XCCL_FLOAT32 || dt == XCCL_FLOAT64;
                    int       root = (int)((ci + (size_t)oi) % (size_t)n);
                    if (!reducing(a->coll) && oi > 0) break;
                    if (fl && oi >= 4) break; /* bitwise ops: integers only */
                    if (!rooted(a->coll)) root = -1;
                    /* a random schedule for some, the in-order one for others */
                    sweep_one(a, topo, n, count, dt, op, root, (ci + oi) % 2 ? 0 : 7 + ci, 0);
                }
            }
        }
    }
    /* 64 ranks: the slot-sized and a multi-chunk case, every root kind */
    for (int k = 0; k < 2; k++) {
        size_t count = k == 0 ? 1 : (cma ? 3001 : slot_count(a->coll, 64, 4));
        if (a->coll == XCCL_COLL_BARRIER && k) break;
        sweep_one(a, topo, 64, count, XCCL_FLOAT32, XCCL_OP_SUM, rooted(a->coll) ? 63 - k : -1,
                  k ? 0 : 99, 0);
    }
}

static const xccl_algo_t *const shm_algos[] = {&xccl_algo_allreduce_shm,
                                               &xccl_algo_broadcast_shm,
                                               &xccl_algo_reduce_shm,
                                               &xccl_algo_allgather_shm,
                                               &xccl_algo_gather_shm,
                                               &xccl_algo_scatter_shm,
                                               &xccl_algo_reduce_scatter_shm,
                                               &xccl_algo_alltoall_shm,
                                               &xccl_algo_alltoallv_shm,
                                               &xccl_algo_barrier_shm,
                                               NULL};
static const xccl_algo_t *const cma_algos[] = {
    &xccl_algo_allreduce_cma,      &xccl_algo_broadcast_cma, &xccl_algo_reduce_cma,
    &xccl_algo_allgather_cma,      &xccl_algo_gather_cma,    &xccl_algo_scatter_cma,
    &xccl_algo_reduce_scatter_cma, &xccl_algo_alltoall_cma,  NULL};

static const xccl_algo_t *const devmap_algos[] = {
    &xccl_algo_allreduce_devmap, &xccl_algo_broadcast_devmap,      &xccl_algo_reduce_devmap,
    &xccl_algo_allgather_devmap, &xccl_algo_gather_devmap,         &xccl_algo_scatter_devmap,
    &xccl_algo_reduce_scatter_devmap, &xccl_algo_alltoall_devmap, NULL};

/* devmap on fake device memory: the sweeps (n up to 64: reductions chained beyond 8 sources),
 * back to back, with a rank that cannot export its buffer and with imports refused for now
 * (every rank falls back to the message-based algorithm); not applicable to host memory or
 * without a segment. */
static void test_devmap(void)
{
    int before = ncases;

    CHECK(xccl_exec_set_for_test(XCCL_MEM_CUDA, &fdev_ops) == NULL);
    fdev_open(1);
    dev_mode = 1;
    for (int i = 0; devmap_algos[i] != NULL; i++) {
        const xccl_algo_t *a    = devmap_algos[i];
        xccl_coll_args_t   host = {.coll = a->coll, .count = 4, .elsize = 4, .topo = &topo_seg};
        xccl_coll_args_t   dev = host, noseg = host;
        dev.mem = noseg.mem = XCCL_MEM_CUDA;
        noseg.topo          = &topo_none;
        CHECK_MSG(!a->applicable(&host, 4) && a->applicable(&dev, 4) &&
                      !a->applicable(&noseg, 4),
                  "%s/devmap: applicable to host memory or without a segment",
                  xccl_coll_name(a->coll));
        sweep(a, &topo_seg);
        fdev_no_export = 1;
        for (int n = 2; n <= 5; n += 3)
            sweep_one(a, &topo_seg, n, 301, XCCL_INT32, XCCL_OP_SUM,
                      rooted(a->coll) ? n - 1 : -1, 5, 0);
        fdev_no_export = 0;
        /* imports refused for now: a rank that met one, and so every rank, falls back (some
         * ranks mapped everything: step 3 tells them); the simulator fails a second try */
        {
            unsigned refused = fdev_refused;
            for (unsigned k = 1; k <= 4; k += 3) {
                fdev_refuse_import = k;
                for (int n = 2; n <= 5; n += 3)
                    sweep_one(a, &topo_seg, n, 301, XCCL_INT32, XCCL_OP_SUM,
                              rooted(a->coll) ? n - 1 : -1, k, 0);
            }
            fdev_refuse_import = 0;
            CHECK_MSG(fdev_refused > refused, "%s/devmap: no import was refused",
                      xccl_coll_name(a->coll));
        }
    }
    dev_mode = 0;
    fdev_open(0);
    CHECK_MSG(fdev.live == 0, "devmap: %zu device operations never tested", fdev.live);
    xccl_exec_set_for_test(XCCL_MEM_CUDA, NULL);
    printf("test_algo_shm: %d devmap collectives checked\n", ncases - before);
}

static void test_sweeps(void)
{
    setenv(SHM_CHUNK_ENV, "96", 1); /* many chunks (and ragged last ones) for the cma cases */
    for (int i = 0; shm_algos[i] != NULL; i++)
        sweep(shm_algos[i], &topo_seg);
    for (int i = 0; cma_algos[i] != NULL; i++)
        sweep(cma_algos[i], &topo_cma);
    /* all_to_all_v with blocks beyond a slot: read from the send buffers */
    for (int n = 2; n <= 8; n += 3)
        for (uint64_t seed = 0; seed < 3; seed++)
            sweep_one(&xccl_algo_alltoallv_shm, &topo_cma, n, 0, XCCL_INT32, XCCL_OP_SUM, -1, seed,
                      1);
    unsetenv(SHM_CHUNK_ENV);
    printf("test_algo_shm: %d collectives checked\n", ncases);
}

/* reduce_scatter with rbuf inside block r of sbuf (allowed by task.h) */
static void test_reduce_scatter_alias(void)
{
    for (int k = 0; k < 2; k++) {
        const xccl_algo_t *a = k ? &xccl_algo_reduce_scatter_cma : &xccl_algo_reduce_scatter_shm;
        int                n = 5;
        size_t             count = 33;
        ccase_t           *c     = xmalloc(sizeof(*c));
        char               what[96];

        setenv(SHM_CHUNK_ENV, "40", 1);
        case_init(c, XCCL_COLL_REDUCE_SCATTER, n, count, XCCL_FLOAT64, XCCL_OP_SUM, -1,
                  k ? &topo_cma : &topo_seg, 0);
        for (int r = 0; r < n; r++)
            c->args[r].rbuf = c->sbuf[r] + (size_t)r * count * 8;
        snprintf(what, sizeof(what), "reduce_scatter/%s rbuf = block r of sbuf", a->name);
        {
            sim_opts_t   opts = {.seed = 5};
            sim_result_t res;
            CHECK_MSG(sim_run(a, n, c->args, &opts, &res) == XCCL_OK, "%s: %s", what, res.error);
            for (int r = 0; r < n; r++)
                CHECK_MSG(memcmp(c->sbuf[r] + (size_t)r * count * 8, c->want[r], count * 8) == 0,
                          "%s: rank %d", what, r);
            sim_result_free(&res);
        }
        unsetenv(SHM_CHUNK_ENV);
        case_free(c);
        free(c);
    }
}

/* reduce with rbuf == sbuf at the root (allowed by task.h) */
static void test_reduce_inplace_root(void)
{
    for (int k = 0; k < 2; k++) {
        const xccl_algo_t *a = k ? &xccl_algo_reduce_cma : &xccl_algo_reduce_shm;
        ccase_t           *c = xmalloc(sizeof(*c));
        int                n = 4, root = 2;
        sim_opts_t         opts = {.seed = 11};
        sim_result_t       res;

        setenv(SHM_CHUNK_ENV, "24", 1);
        case_init(c, XCCL_COLL_REDUCE, n, 100, XCCL_INT32, XCCL_OP_SUM, root,
                  k ? &topo_cma : &topo_seg, 0);
        c->args[root].rbuf = c->sbuf[root];
        CHECK_MSG(sim_run(a, n, c->args, &opts, &res) == XCCL_OK, "reduce/%s in place: %s", a->name,
                  res.error);
        CHECK_MSG(memcmp(c->sbuf[root], c->want[root], 400) == 0, "reduce/%s in place", a->name);
        sim_result_free(&res);
        unsetenv(SHM_CHUNK_ENV);
        case_free(c);
        free(c);
    }
}

/* ---- back to back: slots reused across epochs, ranks apart by epochs -------------------- */

static void test_sequences(void)
{
    enum { NCOLL = 24 };
    static const int ns[] = {2, 3, 5, 8};

    setenv(SHM_CHUNK_ENV, "64", 1);
    for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++)
        for (uint64_t seed = 0; seed < 6; seed++) {
            int                n  = ns[ni];
            ccase_t           *cs = xmalloc(NCOLL * sizeof(*cs));
            const xccl_algo_t *algos[NCOLL];
            xccl_coll_args_t  *args = xmalloc((size_t)NCOLL * (size_t)n * sizeof(*args));
            sim_opts_t         opts = {.seed = seed, .slow = 1};
            sim_result_t       res;
            xccl_status_t      st;
            char               what[96];

            for (int k = 0; k < NCOLL; k++) {
                int                cma = (int)(rnd() % 2);
                const xccl_algo_t *a;
                size_t             count;
                do {
                    a     = cma ? cma_algos[rnd() % 8] : shm_algos[rnd() % 10];
                    count = rnd() % 3 == 0 ? 0 : 1 + rnd() % 300;
                    if (!cma && a->coll != XCCL_COLL_ALLTOALLV) {
                        size_t m = slot_count(a->coll, n, 8);
                        if (count > m) count = m;
                    }
                } while (0);
                algos[k] = a;
                case_init(&cs[k], a->coll, n, count, XCCL_FLOAT64, XCCL_OP_SUM,
                          rooted(a->coll) ? (int)(rnd() % (uint64_t)n) : -1, &topo_cma, 0);
                for (int r = 0; r < n; r++)
                    args[k * n + r] = cs[k].args[r];
            }
            snprintf(what, sizeof(what), "sequence n=%d seed=%llu", n, (unsigned long long)seed);
            st = sim_run_seq(algos, NCOLL, n, args, &opts, &res);
            CHECK_MSG(st == XCCL_OK, "%s: %s", what, res.error);
            for (int k = 0; k < NCOLL && st == XCCL_OK; k++) {
                char w2[160];
                snprintf(w2, sizeof(w2), "%s #%d %s/%s", what, k, xccl_coll_name(algos[k]->coll),
                         algos[k]->name);
                case_check(&cs[k], w2);
            }
            sim_result_free(&res);
            for (int k = 0; k < NCOLL; k++)
                case_free(&cs[k]);
            free(cs);
            free(args);
        }
    unsetenv(SHM_CHUNK_ENV);
}

/* ---- failures: mismatched calls, a rank that never comes, misuse ------------------------- */

/* Rank 0 runs mm_algo[0], the others mm_algo[1]: two different calls in one epoch. */
static const xccl_algo_t *mm_algo[2];
static xccl_status_t      mm_progress(xccl_task_t *t)
{
    return mm_algo[xccl_task_rank(t) == 0 ? 0 : 1]->progress(t);
}
static const xccl_algo_t mm_wrap = {
    .name = "mm", .coll = XCCL_COLL_ALLREDUCE, .progress = mm_progress, .shared = 1};

static void test_mismatch(void)
{
    /* 0: all_reduce vs broadcast; 1: counts differ; 2: shm vs cma; 3: cma vs shm broadcast */
    for (int k = 0; k < 4; k++) {
        ccase_t         *c = xmalloc(sizeof(*c)), *d = xmalloc(sizeof(*d));
        xccl_coll_args_t args[4];
        sim_result_t     res;
        xccl_status_t    st;
        int              n = 4;

        mm_algo[0] = k == 3 ? &xccl_algo_broadcast_cma : &xccl_algo_allreduce_shm;
        mm_algo[1] = k == 0 || k == 3 ? &xccl_algo_broadcast_shm
                     : k == 1         ? &xccl_algo_allreduce_shm
                                      : &xccl_algo_allreduce_cma;
        case_init(c, mm_algo[0]->coll, n, 8, XCCL_INT32, XCCL_OP_SUM,
                  rooted(mm_algo[0]->coll) ? 0 : -1, &topo_cma, 0);
        case_init(d, mm_algo[1]->coll, n, k == 1 ? 9 : 8, XCCL_INT32, XCCL_OP_SUM,
                  rooted(mm_algo[1]->coll) ? 0 : -1, &topo_cma, 0);
        args[0] = c->args[0];
        for (int r = 1; r < n; r++)
            args[r] = d->args[r];
        st = sim_run(&mm_wrap, n, args, NULL, &res);
        CHECK_MSG(st == XCCL_ERR_MISMATCH && strstr(res.error, "mismatch") != NULL,
                  "mismatch case %d: %s: %s", k, xccl_status_string(st), res.error);
        sim_result_free(&res);
        case_free(c);
        case_free(d);
        free(c);
        free(d);
    }
}

/* ranks whose XCCL_SHM_CHUNK_BYTES differ: the progress counters would mean different
 * chunks, so the call must fail as a mismatch instead of reading unwritten data */
static xccl_status_t chunky_progress(xccl_task_t *t)
{
    setenv(SHM_CHUNK_ENV, xccl_task_rank(t) == 0 ? "64" : "128", 1);
    return xccl_algo_broadcast_cma.progress(t);
}

static void test_chunk_mismatch(void)
{
    ccase_t      *c = xmalloc(sizeof(*c));
    xccl_algo_t   chunky = xccl_algo_broadcast_cma;
    sim_result_t  res;
    xccl_status_t st;

    chunky.progress = chunky_progress;
    case_init(c, XCCL_COLL_BROADCAST, 3, 1000, XCCL_INT32, XCCL_OP_SUM, 0, &topo_cma, 0);
    st = sim_run(&chunky, 3, c->args, NULL, &res);
    CHECK_MSG(st == XCCL_ERR_MISMATCH && strstr(res.error, SHM_CHUNK_ENV) != NULL,
              "chunk mismatch: %s: %s", xccl_status_string(st), res.error);
    sim_result_free(&res);
    unsetenv(SHM_CHUNK_ENV);
    case_free(c);
    free(c);
}

/* a rank that never publishes: the others wait on it, the simulator names the deadlock */
static xccl_status_t absent_progress(xccl_task_t *t)
{
    if (xccl_task_rank(t) == 2) {
        xccl_shared_t sh;
        xccl_status_t st = xccl_task_shared(t, &sh);
        if (st != XCCL_OK) return st;
        xccl_task_shared_wait(t, 0);
        return XCCL_INPROGRESS; /* waits for something nobody writes */
    }
    return xccl_algo_barrier_shm.progress(t);
}

static xccl_status_t nowait_progress(xccl_task_t *t)
{
    xccl_shared_t sh;
    xccl_status_t st = xccl_task_shared(t, &sh);
    return st != XCCL_OK ? st : XCCL_INPROGRESS; /* no wait named */
}

static void test_sim_contract(void)
{
    xccl_coll_args_t args[4];
    sim_result_t     res;
    xccl_status_t    st;
    xccl_algo_t      absent = {
        .name = "absent", .coll = XCCL_COLL_BARRIER, .progress = absent_progress, .shared = 1};
    xccl_algo_t nowait = {
        .name = "nowait", .coll = XCCL_COLL_BARRIER, .progress = nowait_progress, .shared = 1};
    xccl_algo_t unshared = xccl_algo_barrier_shm;

    for (int r = 0; r < 4; r++)
        args[r] = (xccl_coll_args_t){.coll   = XCCL_COLL_BARRIER,
                                     .dtype  = XCCL_UINT8,
                                     .elsize = 1,
                                     .topo   = &topo_seg,
                                     .root   = -1};
    st = sim_run(&absent, 4, args, NULL, &res);
    CHECK_MSG(st == XCCL_ERR_INTERNAL && strstr(res.error, "deadlock") != NULL &&
                  strstr(res.error, "waits on rank 2") != NULL,
              "absent rank: %s", res.error);
    sim_result_free(&res);
    st = sim_run(&nowait, 2, args, NULL, &res);
    CHECK_MSG(st == XCCL_ERR_INTERNAL && strstr(res.error, "no xccl_task_shared_wait") != NULL,
              "no wait: %s", res.error);
    sim_result_free(&res);
    unshared.shared = 0;
    st              = sim_run(&unshared, 2, args, NULL, &res);
    CHECK_MSG(st == XCCL_ERR_INTERNAL && strstr(res.error, ".shared = 1") != NULL, "undeclared: %s",
              res.error);
    sim_result_free(&res);
    for (int r = 0; r < 4; r++)
        args[r].topo = &topo_none;
    st = sim_run(&xccl_algo_barrier_shm, 2, args, NULL, &res);
    CHECK_MSG(st == XCCL_ERR_INTERNAL && strstr(res.error, "XCCL_SHARED_SEG") != NULL,
              "no segment: %s", res.error);
    sim_result_free(&res);
}

/* all_to_all_v whose blocks exceed a slot without cross-memory reads: a named error */
static void test_a2av_too_big(void)
{
    ccase_t      *c = xmalloc(sizeof(*c));
    sim_result_t  res;
    xccl_status_t st;

    case_init(c, XCCL_COLL_ALLTOALLV, 3, 0, XCCL_INT32, XCCL_OP_SUM, -1, &topo_seg, 1);
    st = sim_run(&xccl_algo_alltoallv_shm, 3, c->args, NULL, &res);
    CHECK_MSG(st == XCCL_ERR_NOT_SUPPORTED && strstr(res.error, "cross-memory") != NULL,
              "a2av too big: %s: %s", xccl_status_string(st), res.error);
    sim_result_free(&res);
    case_free(c);
    free(c);
}

/* ---- applicability, selection, costs ----------------------------------------------------- */

void xccl_algo_reset_env(void);

static void test_select(void)
{
    xccl_coll_args_t   a   = {.coll   = XCCL_COLL_ALLREDUCE,
                              .count  = 2,
                              .dtype  = XCCL_FLOAT32,
                              .elsize = 4,
                              .topo   = &topo_cma};
    const xccl_algo_t *out = NULL;
    xccl_cost_model_t  m   = {5e-6, 1e-10, 1e-10, 1e-10};

    unsetenv("XCCL_ALGO");
    xccl_algo_reset_env();
    /* applicability */
    CHECK(xccl_algo_allreduce_shm.applicable(&a, 8));
    a.count = SHM_SLOT_BYTES / 4;
    CHECK(xccl_algo_allreduce_shm.applicable(&a, 64));
    a.count++;
    CHECK(!xccl_algo_allreduce_shm.applicable(&a, 2));
    CHECK(xccl_algo_allreduce_cma.applicable(&a, 2));
    a.topo = &topo_seg;
    CHECK(!xccl_algo_allreduce_cma.applicable(&a, 2));
    a.topo  = NULL;
    a.count = 1;
    CHECK(!xccl_algo_allreduce_shm.applicable(&a, 2));
    a.topo = &topo_cma;
    a.mem  = XCCL_MEM_CUDA;
    CHECK(!xccl_algo_allreduce_shm.applicable(&a, 2));
    a.mem   = XCCL_MEM_HOST;
    a.coll  = XCCL_COLL_ALLTOALL;
    a.count = SHM_SLOT_BYTES / 4 / 8;
    CHECK(xccl_algo_alltoall_shm.applicable(&a, 8));
    a.count++;
    CHECK(!xccl_algo_alltoall_shm.applicable(&a, 8));
    CHECK(!xccl_algo_alltoall_shm.applicable(
        &(xccl_coll_args_t){
            .coll = XCCL_COLL_ALLTOALL, .count = SIZE_MAX / 2, .elsize = 4, .topo = &topo_cma},
        8));

    /* the built-in rule: shm where the call fits a slot, else cma; neither without a segment */
    a = (xccl_coll_args_t){.coll   = XCCL_COLL_ALLREDUCE,
                           .count  = 2,
                           .dtype  = XCCL_FLOAT32,
                           .elsize = 4,
                           .topo   = &topo_cma};
    CHECK(xccl_algo_select(&a, 16, 8, &m, NULL, &out) == XCCL_OK &&
          out == &xccl_algo_allreduce_shm);
    a.count = 1 << 20;
    CHECK(xccl_algo_select(&a, 16, 4u << 20, &m, NULL, &out) == XCCL_OK && out->shared == 0);
    a.coll = XCCL_COLL_ALLGATHER; /* all_reduce by cma is forced only (select.c) */
    CHECK(xccl_algo_select(&a, 16, 64u << 20, &m, NULL, &out) == XCCL_OK &&
          out == &xccl_algo_allgather_cma);
    a.coll = XCCL_COLL_ALLREDUCE;
    a.topo = &topo_seg;
    CHECK(xccl_algo_select(&a, 16, 4u << 20, &m, NULL, &out) == XCCL_OK && out->shared == 0);
    a.topo  = &topo_none;
    a.count = 2;
    CHECK(xccl_algo_select(&a, 16, 8, &m, NULL, &out) == XCCL_OK && out->shared == 0);
    /* fewer than 8 ranks: the message-based rules (measured on the 2-core VM) */
    a.topo = &topo_cma;
    CHECK(xccl_algo_select(&a, 4, 8, &m, NULL, &out) == XCCL_OK && out->shared == 0);
    CHECK(xccl_algo_select(&a, 8, 8, &m, NULL, &out) == XCCL_OK &&
          out == &xccl_algo_allreduce_shm);
    /* forcing: by name, and a clear error where it cannot run */
    a.topo = &topo_cma;
    CHECK(xccl_algo_select(&a, 4, 8, &m, "cma", &out) == XCCL_OK &&
          out == &xccl_algo_allreduce_cma);
    a.topo = &topo_seg;
    CHECK(xccl_algo_select(&a, 4, 8, &m, "cma", &out) == XCCL_ERR_INVALID_ARG);
    CHECK(strstr(xccl_last_error(), "'cma'") != NULL);
    for (size_t i = 0; i < sizeof(all_colls) / sizeof(all_colls[0]); i++) {
        xccl_coll_args_t b = {.coll   = all_colls[i],
                              .count  = 1,
                              .dtype  = XCCL_INT32,
                              .elsize = 4,
                              .topo   = &topo_cma,
                              .root   = 0};
        CHECK_MSG(xccl_algo_select(&b, 8, 4, &m, NULL, &out) == XCCL_OK &&
                      strcmp(out->name, "shm") == 0,
                  "%s small: %s", xccl_coll_name(all_colls[i]), out ? out->name : "-");
    }
    /* the model ("auto") prices them too, with δ */
    a = (xccl_coll_args_t){.coll   = XCCL_COLL_ALLGATHER,
                           .count  = 1 << 18,
                           .dtype  = XCCL_FLOAT32,
                           .elsize = 4,
                           .topo   = &topo_cma};
    CHECK(xccl_algo_predict(&xccl_algo_allgather_cma, &m, 8, 8u << 20) > 0);
}

/* cma: bytes read per rank = the cost's copy_bytes; no messages at all */
static void test_costs(void)
{
    static const int   n       = 8;
    const xccl_algo_t *algos[] = {&xccl_algo_allgather_cma, &xccl_algo_alltoall_cma,
                                  &xccl_algo_broadcast_cma, &xccl_algo_allreduce_cma,
                                  &xccl_algo_reduce_scatter_cma};
    size_t             count   = 8 * 100;

    setenv(SHM_CHUNK_ENV, "256", 1);
    for (size_t k = 0; k < sizeof(algos) / sizeof(algos[0]); k++) {
        const xccl_algo_t *a = algos[k];
        ccase_t           *c = xmalloc(sizeof(*c));
        sim_result_t       res;
        xccl_cost_t        cost;
        size_t             nbytes;

        case_init(c, a->coll, n, count, XCCL_INT32, XCCL_OP_SUM,
                  a->coll == XCCL_COLL_BROADCAST ? 3 : -1, &topo_cma, 0);
        nbytes = a->coll == XCCL_COLL_ALLREDUCE || a->coll == XCCL_COLL_BROADCAST
                     ? count * 4
                     : (size_t)n * count * 4;
        a->cost(n, nbytes, &cost);
        if (run_case(a, c, 3, a->summary, &res)) {
            CHECK_MSG(res.nmsgs == 0, "%s/%s sent %zu messages", xccl_coll_name(a->coll), a->name,
                      res.nmsgs);
            for (int r = 0; r < n; r++) {
                double got = (double)res.read_bytes[r];
                if (a->coll == XCCL_COLL_BROADCAST && r == 3) continue; /* the root reads none */
                CHECK_MSG(got == cost.copy_bytes, "%s/%s rank %d read %.0f B, cost says %.0f",
                          xccl_coll_name(a->coll), a->name, r, got, cost.copy_bytes);
            }
        }
        sim_result_free(&res);
        case_free(c);
        free(c);
    }
    unsetenv(SHM_CHUNK_ENV);
    /* the root's memory is read once in a broadcast: no rank reads more than its slice from it */
}

int main(void)
{
    test_sim_contract();
    test_select();
    test_sweeps();
    test_devmap();
    test_reduce_scatter_alias();
    test_reduce_inplace_root();
    test_sequences();
    test_mismatch();
    test_chunk_mismatch();
    test_a2av_too_big();
    test_costs();
    CTEST_MAIN_END("test_algo_shm");
}
