/* SPDX-License-Identifier: Apache-2.0
 *
 * test_rooted.c - the rooted, all-to-all and barrier algorithms (rooted.c, alltoall.c,
 * barrier.c) on the in-process simulator (sim.h): every algorithm for n = 1..9, 12, 16, every
 * root, counts {0, 1, n-1, n, 2n+1, 1000, 65537}, dtypes int32 / float64 / uint8, and for
 * reduce the operators sum / max / prod / bor. Results are compared with references computed
 * here element by element, and the traffic of each run with the algorithm's cost formula.
 * The simulator holds messages back at random (seeded), so every resume point is exercised.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "algo/algo.h"
#include "algo/patterns.h"
#include "ctest.h"
#include "sim.h"

extern const xccl_algo_t xccl_algo_broadcast_binomial, xccl_algo_broadcast_linear,
    xccl_algo_broadcast_scatter_allgather, xccl_algo_broadcast_chain, xccl_algo_reduce_binomial,
    xccl_algo_reduce_linear, xccl_algo_gather_binomial, xccl_algo_gather_linear,
    xccl_algo_scatter_binomial, xccl_algo_scatter_linear, xccl_algo_alltoall_pairwise,
    xccl_algo_alltoall_bruck, xccl_algo_alltoall_linear, xccl_algo_alltoallv_pairwise,
    xccl_algo_alltoallv_linear, xccl_algo_barrier_dissemination, xccl_algo_barrier_linear;

#define MAXN  16
#define GUARD 16 /* bytes after every buffer that must stay untouched */
#define BIG   65537
#define MEM_BUDGET ((size_t)32 << 20)

static const int          sizes[]  = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16};
static const xccl_dtype_t dtypes[] = {XCCL_INT32, XCCL_FLOAT64, XCCL_UINT8};
#define NSIZES  (sizeof(sizes) / sizeof(sizes[0]))
#define NDTYPES (sizeof(dtypes) / sizeof(dtypes[0]))

static size_t elsize(xccl_dtype_t dt) { return dt == XCCL_INT32 ? 4 : dt == XCCL_FLOAT64 ? 8 : 1; }

static const char *dt_name(xccl_dtype_t dt)
{
    return dt == XCCL_INT32 ? "int32" : dt == XCCL_FLOAT64 ? "float64" : "uint8";
}

static const char *coll_str(const xccl_algo_t *algo)
{
    switch (algo->coll) {
    case XCCL_COLL_BROADCAST: return "broadcast";
    case XCCL_COLL_REDUCE: return "reduce";
    case XCCL_COLL_GATHER: return "gather";
    case XCCL_COLL_SCATTER: return "scatter";
    case XCCL_COLL_ALLTOALL: return "all_to_all";
    case XCCL_COLL_ALLTOALLV: return "all_to_all_v";
    case XCCL_COLL_BARRIER: return "barrier";
    default: return "?";
    }
}

/* Stores v (integral, or a multiple of 1/4 for float64) as element i; uint8 wraps mod 256. */
static void put(void *buf, size_t i, xccl_dtype_t dt, double v)
{
    if (dt == XCCL_INT32)
        ((int32_t *)buf)[i] = (int32_t)v;
    else if (dt == XCCL_FLOAT64)
        ((double *)buf)[i] = v;
    else
        ((uint8_t *)buf)[i] = (uint8_t)(long long)v;
}

/* Elements [off, off + count) of buf get values naming (rank, block): element i holds
 * (rank * 131 + block * 31 + 7 i + 3) mod 251. */
static void fill_tag(void *buf, size_t off, size_t count, xccl_dtype_t dt, int rank, int block)
{
    int v = (rank * 131 + block * 31 + 3) % 251;

    for (size_t i = 0; i < count; i++) {
        put(buf, off + i, dt, v);
        v = v + 7 >= 251 ? v + 7 - 251 : v + 7;
    }
}

/* Counts to test for n ranks: {0, 1, n-1, n, 2n+1, 1000, 65537} without repeats. */
static int counts_for(int n, size_t *out)
{
    size_t c[] = {0, 1, (size_t)n - 1, (size_t)n, 2 * (size_t)n + 1, 1000, BIG};
    int    k   = 0;

    for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++) {
        int dup = 0;
        for (int j = 0; j < k; j++) dup |= out[j] == c[i];
        if (!dup) out[k++] = c[i];
    }
    return k;
}

/* The big count runs for three roots only, to keep the test fast. */
static int root_wanted(int n, int root, size_t count)
{
    return count < BIG || root == 0 || root == n - 1 || root == n / 2;
}

/* A buffer of nbytes filled with 0xEE, followed by a guard zone of 0xC3. */
static void *alloc_buf(size_t nbytes)
{
    unsigned char *p = malloc(nbytes + GUARD);

    if (p == NULL) {
        fprintf(stderr, "test_rooted: out of memory\n");
        exit(2);
    }
    memset(p, 0xEE, nbytes);
    memset(p + nbytes, 0xC3, GUARD);
    return p;
}

static void reset_buf(void *p, size_t nbytes) { memset(p, 0xEE, nbytes); }

static int guard_ok(const void *p, size_t nbytes)
{
    const unsigned char *g = (const unsigned char *)p + nbytes;

    for (int i = 0; i < GUARD; i++) {
        if (g[i] != 0xC3) return 0;
    }
    return 1;
}

/* buf holds exactly ref (nbytes) and its guard is intact. */
static int same(const void *buf, const void *ref, size_t nbytes)
{
    return memcmp(buf, ref, nbytes) == 0 && guard_ok(buf, nbytes);
}

static uint64_t seed_counter = 1;

/* Runs the algorithm with a fresh seed; records a failure with context on an error. */
static int run(const xccl_algo_t *algo, int n, const xccl_coll_args_t *args, sim_result_t *res,
               const char *what)
{
    sim_opts_t    opts = {.seed = seed_counter++, .max_passes = 0};
    xccl_status_t st   = sim_run(algo, n, args, &opts, res);

    CHECK_MSG(st == XCCL_OK, "%s %s %s: %s", coll_str(algo), algo->name, what, res->error);
    return st == XCCL_OK;
}

static xccl_cost_t cost_of(const xccl_algo_t *algo, int n, size_t nbytes)
{
    xccl_cost_t c;

    algo->cost(n, nbytes, &c);
    return c;
}

static size_t recv_bytes(const sim_result_t *res, int rank)
{
    size_t b = 0;

    for (size_t i = 0; i < res->nmsgs; i++) {
        if (res->msgs[i].dst == rank) b += res->msgs[i].nbytes;
    }
    return b;
}

static size_t recv_msgs(const sim_result_t *res, int rank)
{
    size_t k = 0;

    for (size_t i = 0; i < res->nmsgs; i++) k += res->msgs[i].dst == rank;
    return k;
}

/* Calls fn for every (n, count, dtype) of the sweep. */
typedef void (*case_fn)(const xccl_algo_t *const *algos, int n, size_t count, xccl_dtype_t dt);

static void sweep(const xccl_algo_t *const *algos, case_fn fn)
{
    for (size_t si = 0; si < NSIZES; si++) {
        size_t counts[8];
        int    nc = counts_for(sizes[si], counts);
        for (int ci = 0; ci < nc; ci++) {
            for (size_t di = 0; di < NDTYPES; di++) fn(algos, sizes[si], counts[ci], dtypes[di]);
        }
    }
}

/* =============================================================================================
 * Broadcast
 * ============================================================================================= */
static void broadcast_traffic(const xccl_algo_t *algo, int n, int root, size_t count, size_t el,
                              const sim_result_t *res, const char *what)
{
    size_t      nbytes = count * el, max_sent = 0;
    xccl_cost_t c      = cost_of(algo, n, nbytes);

    for (int r = 0; r < n; r++) {
        size_t b = sim_sent_bytes(res, r);
        if (b > max_sent) max_sent = b;
        /* every algorithm delivers each byte to each rank exactly once */
        CHECK_MSG(recv_bytes(res, r) == (r == root ? 0 : nbytes),
                  "broadcast %s %s: rank %d received %zu bytes", algo->name, what, r,
                  recv_bytes(res, r));
    }
    if (n == 1 || count == 0) {
        CHECK_MSG(res->nmsgs == 0, "broadcast %s %s: %zu messages", algo->name, what, res->nmsgs);
    } else if (algo == &xccl_algo_broadcast_chain) {
        /* every rank but the last forwards the vector once, in C = (steps - n + 2) chunks */
        size_t chunks = (size_t)(c.steps - n + 2), empty = chunks > count ? chunks - count : 0;
        for (int r = 0; r < n; r++) {
            int last = r == (root + n - 1) % n;
            CHECK_MSG(sim_sent_bytes(res, r) == (last ? 0 : nbytes) &&
                          sim_sent_msgs(res, r) == (last ? 0 : chunks - empty),
                      "broadcast chain %s: rank %d sent %zu msgs %zu bytes (%zu chunks)", what,
                      r, sim_sent_msgs(res, r), sim_sent_bytes(res, r), chunks);
        }
    } else if (algo != &xccl_algo_broadcast_scatter_allgather) {
        /* trees and linear: n - 1 messages; the root sends `steps` whole vectors */
        CHECK_MSG(res->nmsgs == (size_t)n - 1 &&
                      (double)sim_sent_msgs(res, root) == c.steps &&
                      (double)sim_sent_bytes(res, root) == c.bytes,
                  "broadcast %s %s: %zu msgs, root %zu msgs %zu bytes, cost %g steps %g bytes",
                  algo->name, what, res->nmsgs, sim_sent_msgs(res, root),
                  sim_sent_bytes(res, root), c.steps, c.bytes);
    } else if (count % (size_t)n == 0) {
        /* equal blocks: the root sends exactly 2 (n-1) blocks, every other rank no more */
        CHECK_MSG((double)max_sent == c.bytes && (double)sim_sent_bytes(res, root) == c.bytes,
                  "broadcast %s %s: max sent %zu, cost %g", algo->name, what, max_sent, c.bytes);
    } else {
        CHECK_MSG((double)max_sent <= c.bytes + 2.0 * n * (double)el,
                  "broadcast %s %s: max sent %zu, cost %g", algo->name, what, max_sent, c.bytes);
    }
}

static void broadcast_case(const xccl_algo_t *const *algos, int n, size_t count, xccl_dtype_t dt)
{
    size_t           el = elsize(dt), nbytes = count * el;
    void            *buf[MAXN], *ref = alloc_buf(nbytes);
    xccl_coll_args_t args[MAXN];

    for (int r = 0; r < n; r++) buf[r] = alloc_buf(nbytes);
    for (int root = 0; root < n; root++) {
        if (!root_wanted(n, root, count)) continue;
        fill_tag(ref, 0, count, dt, root, 0);
        for (int r = 0; r < n; r++) {
            args[r] = (xccl_coll_args_t){.coll   = XCCL_COLL_BROADCAST,
                                         .sbuf   = buf[r],
                                         .rbuf   = buf[r],
                                         .count  = count,
                                         .dtype  = dt,
                                         .elsize = el,
                                         .root   = root};
        }
        for (const xccl_algo_t *const *a = algos; *a; a++) {
            sim_result_t res;
            char         what[96];
            snprintf(what, sizeof(what), "n=%d root=%d count=%zu %s", n, root, count,
                     dt_name(dt));
            for (int r = 0; r < n; r++) reset_buf(buf[r], nbytes);
            memcpy(buf[root], ref, nbytes);
            if (run(*a, n, args, &res, what)) {
                int bad = -1;
                for (int r = 0; r < n; r++) {
                    if (!same(buf[r], ref, nbytes)) bad = r;
                }
                CHECK_MSG(bad < 0, "broadcast %s %s: rank %d wrong", (*a)->name, what, bad);
                broadcast_traffic(*a, n, root, count, el, &res, what);
            }
            sim_result_free(&res);
        }
    }
    for (int r = 0; r < n; r++) free(buf[r]);
    free(ref);
}

/* =============================================================================================
 * Reduce
 * ============================================================================================= */
static const xccl_op_t ops[] = {XCCL_OP_SUM, XCCL_OP_MAX, XCCL_OP_PROD, XCCL_OP_BOR};

/* Input of `rank` at element i, chosen so that every result is exact in every dtype whatever
 * the combination order: sums of quarters stay exact in float64, so do products of {-1, 1/2,
 * 1, 2}; int32 products stay below 2^16; uint8 arithmetic is mod 256. */
static double reduce_input(xccl_op_t op, xccl_dtype_t dt, int rank, size_t i)
{
    long long h = (rank * 37 + (long long)(i % 65521) * 11) % 2001;

    switch (op) {
    case XCCL_OP_PROD:
        if (dt == XCCL_FLOAT64) return (double[]){1, 2, 0.5, -1, 1}[(rank + 3 * i) % 5];
        if (dt == XCCL_INT32) return (double[]){1, 2, 1, -1, 1}[(rank + 3 * i) % 5];
        return (double[]){1, 2, 3, 1, 5}[(rank + 3 * i) % 5];
    case XCCL_OP_BOR:
        if (dt == XCCL_INT32) return (double)((1LL << ((rank + i) % 31)) | (long long)(i & 0xff));
        return (double)((rank * 53 + (long long)(i % 251) * 17) % 256);
    default:
        if (dt == XCCL_UINT8) return (double)(h % 251);
        if (dt == XCCL_FLOAT64) return (double)(h - 1000) / 4.0;
        return (double)(h - 1000);
    }
}

static double combine(xccl_op_t op, xccl_dtype_t dt, double x, double y)
{
    switch (op) {
    case XCCL_OP_SUM: return x + y;
    case XCCL_OP_MAX: return x > y ? x : y;
    case XCCL_OP_PROD: return dt == XCCL_UINT8 ? (double)((long long)(x * y) % 256) : x * y;
    default: return (double)((long long)x | (long long)y);
    }
}

static void reduce_traffic(const xccl_algo_t *algo, int n, int root, size_t nbytes,
                           const sim_result_t *res, const char *what)
{
    xccl_cost_t c = cost_of(algo, n, nbytes);

    if (n == 1 || nbytes == 0) {
        CHECK(res->nmsgs == 0);
        return;
    }
    /* the root receives `bytes` and reduces `reduce_bytes`, in `steps` messages for the tree
     * (the linear reduce cuts each vector into chunks) */
    CHECK_MSG((double)recv_bytes(res, root) == c.bytes &&
                  (double)res->reduce_bytes[root] == c.reduce_bytes &&
                  (algo != &xccl_algo_reduce_binomial ||
                   (res->nmsgs == (size_t)n - 1 && (double)recv_msgs(res, root) == c.steps)),
              "reduce %s %s: root got %zu msgs %zu bytes, reduced %zu; cost %g %g %g",
              algo->name, what, recv_msgs(res, root), recv_bytes(res, root),
              res->reduce_bytes[root], c.steps, c.bytes, c.reduce_bytes);
}

static void reduce_case_op(const xccl_algo_t *const *algos, int n, size_t count, xccl_dtype_t dt,
                           xccl_op_t op)
{
    size_t           el = elsize(dt), nbytes = count * el;
    void            *in[MAXN], *sbuf[MAXN], *ref = alloc_buf(nbytes), *rbuf = alloc_buf(nbytes);
    xccl_coll_args_t args[MAXN];

    for (size_t i = 0; i < count; i++) {
        double acc = reduce_input(op, dt, 0, i);
        for (int r = 1; r < n; r++) acc = combine(op, dt, acc, reduce_input(op, dt, r, i));
        put(ref, i, dt, acc);
    }
    for (int r = 0; r < n; r++) {
        in[r]   = alloc_buf(nbytes);
        sbuf[r] = alloc_buf(nbytes);
        for (size_t i = 0; i < count; i++) put(in[r], i, dt, reduce_input(op, dt, r, i));
    }
    for (int root = 0; root < n; root++) {
        if (!root_wanted(n, root, count)) continue;
        for (const xccl_algo_t *const *a = algos; *a; a++) {
            int          alias = (root + (int)count + (int)(a - algos)) % 2; /* rbuf == sbuf */
            void        *out   = alias ? sbuf[root] : rbuf;
            sim_result_t res;
            char         what[128];
            snprintf(what, sizeof(what), "n=%d root=%d count=%zu %s op=%d%s", n, root, count,
                     dt_name(dt), (int)op, alias ? " in place" : "");
            for (int r = 0; r < n; r++) {
                memcpy(sbuf[r], in[r], nbytes);
                args[r] = (xccl_coll_args_t){.coll   = XCCL_COLL_REDUCE,
                                             .sbuf   = sbuf[r],
                                             .rbuf   = r == root ? out : NULL,
                                             .count  = count,
                                             .dtype  = dt,
                                             .elsize = el,
                                             .op     = op,
                                             .root   = root};
            }
            reset_buf(rbuf, nbytes);
            if (run(*a, n, args, &res, what)) {
                int touched = -1;
                CHECK_MSG(same(out, ref, nbytes), "reduce %s %s: wrong result", (*a)->name,
                          what);
                for (int r = 0; r < n; r++) {
                    if (!(alias && r == root) && !same(sbuf[r], in[r], nbytes)) touched = r;
                }
                CHECK_MSG(touched < 0, "reduce %s %s: sbuf of rank %d modified", (*a)->name,
                          what, touched);
                reduce_traffic(*a, n, root, nbytes, &res, what);
            }
            sim_result_free(&res);
        }
    }
    for (int r = 0; r < n; r++) {
        free(in[r]);
        free(sbuf[r]);
    }
    free(ref);
    free(rbuf);
}

static void reduce_case(const xccl_algo_t *const *algos, int n, size_t count, xccl_dtype_t dt)
{
    for (size_t oi = 0; oi < sizeof(ops) / sizeof(ops[0]); oi++) {
        if (ops[oi] == XCCL_OP_BOR && dt == XCCL_FLOAT64) continue;
        reduce_case_op(algos, n, count, dt, ops[oi]);
    }
}

/* Vectors of a few MiB, so that the linear reduce goes in several chunks (1 MiB per peer) with
 * a short last one. */
static void reduce_long(const xccl_algo_t *const *algos)
{
    static const int ns[] = {2, 3, 5};

    for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++) {
        reduce_case_op(algos, ns[i], ((size_t)5 << 20) / 8 + 3, XCCL_FLOAT64, XCCL_OP_SUM);
        reduce_case_op(algos, ns[i], ((size_t)2 << 20) + 1, XCCL_UINT8, XCCL_OP_MAX);
    }
}

/* =============================================================================================
 * Gather and scatter: the full buffer (n blocks, block j from/for rank j) is `ref`.
 * ============================================================================================= */
static void gs_traffic(const xccl_algo_t *algo, int gather, int n, int root, size_t all,
                       const sim_result_t *res, const char *what)
{
    xccl_cost_t c = cost_of(algo, n, all);
    size_t      b = gather ? recv_bytes(res, root) : sim_sent_bytes(res, root);
    size_t      m = gather ? recv_msgs(res, root) : sim_sent_msgs(res, root);

    if (n == 1 || all == 0) {
        CHECK(res->nmsgs == 0);
        return;
    }
    /* n - 1 messages in all; the root's link carries (n-1)/n of the buffer in `steps` */
    CHECK_MSG(res->nmsgs == (size_t)n - 1 && (double)b == c.bytes && (double)m == c.steps,
              "%s %s %s: %zu msgs, root %zu msgs %zu bytes, cost %g %g", coll_str(algo),
              algo->name, what, res->nmsgs, m, b, c.steps, c.bytes);
}

static void gather_scatter_case(const xccl_algo_t *const *algos, int n, size_t count,
                                xccl_dtype_t dt)
{
    int              gather = algos[0]->coll == XCCL_COLL_GATHER;
    size_t           el = elsize(dt), blk = count * el, all = blk * (size_t)n;
    void            *small[MAXN], *big = alloc_buf(all), *ref = alloc_buf(all);
    xccl_coll_args_t args[MAXN];

    for (int j = 0; j < n; j++) fill_tag(ref, (size_t)j * count, count, dt, j, 7);
    for (int r = 0; r < n; r++) small[r] = alloc_buf(blk);
    for (int root = 0; root < n; root++) {
        if (!root_wanted(n, root, count)) continue;
        for (const xccl_algo_t *const *a = algos; *a; a++) {
            sim_result_t res;
            char         what[96];
            int          bad = -1;
            snprintf(what, sizeof(what), "n=%d root=%d count=%zu %s", n, root, count,
                     dt_name(dt));
            /* gather: every rank's input, the root's block already in place in rbuf;
             * scatter: the root's input, its own block already copied to its rbuf */
            reset_buf(big, all);
            for (int r = 0; r < n; r++) {
                reset_buf(small[r], blk);
                if (gather || r == root) memcpy(small[r], (char *)ref + (size_t)r * blk, blk);
                args[r] = (xccl_coll_args_t){.coll   = (*a)->coll,
                                             .count  = count,
                                             .dtype  = dt,
                                             .elsize = el,
                                             .root   = root};
                args[r].sbuf = gather ? small[r] : (r == root ? big : NULL);
                args[r].rbuf = gather ? (r == root ? big : NULL) : small[r];
            }
            if (gather)
                memcpy((char *)big + (size_t)root * blk, (char *)ref + (size_t)root * blk, blk);
            else
                memcpy(big, ref, all);
            if (run(*a, n, args, &res, what)) {
                if (!same(big, ref, all)) bad = root; /* gather's output, scatter's input */
                for (int r = 0; r < n; r++) {
                    if (!same(small[r], (char *)ref + (size_t)r * blk, blk)) bad = r;
                }
                CHECK_MSG(bad < 0, "%s %s %s: rank %d wrong", coll_str(*a), (*a)->name, what,
                          bad);
                gs_traffic(*a, gather, n, root, all, &res, what);
            }
            sim_result_free(&res);
        }
    }
    for (int r = 0; r < n; r++) free(small[r]);
    free(big);
    free(ref);
}

/* =============================================================================================
 * All-to-all: rank r sends block j = tag(r, j) to rank j.
 * ============================================================================================= */
static void alltoall_case(const xccl_algo_t *const *algos, int n, size_t count, xccl_dtype_t dt)
{
    size_t           el = elsize(dt), blk = count * el, all = blk * (size_t)n;
    void            *sbuf[MAXN], *rbuf[MAXN], *ref[MAXN];
    xccl_coll_args_t args[MAXN];

    /* n^2 blocks of up to 65537 elements per buffer set: leave out the sets above 32 MiB
     * (float64 at n = 12, 16; int32 at n = 16), which only repeat smaller cases */
    if ((size_t)n * all > MEM_BUDGET) return;
    for (int r = 0; r < n; r++) {
        sbuf[r] = alloc_buf(all);
        rbuf[r] = alloc_buf(all);
        ref[r]  = alloc_buf(all);
        for (int j = 0; j < n; j++) {
            fill_tag(sbuf[r], (size_t)j * count, count, dt, r, j);
            fill_tag(ref[r], (size_t)j * count, count, dt, j, r);
        }
        args[r] = (xccl_coll_args_t){.coll   = XCCL_COLL_ALLTOALL,
                                     .sbuf   = sbuf[r],
                                     .rbuf   = rbuf[r],
                                     .count  = count,
                                     .dtype  = dt,
                                     .elsize = el};
    }
    for (const xccl_algo_t *const *a = algos; *a; a++) {
        sim_result_t res;
        char         what[96];
        xccl_cost_t  c   = cost_of(*a, n, all);
        int          bad = -1;
        snprintf(what, sizeof(what), "n=%d count=%zu %s", n, count, dt_name(dt));
        for (int r = 0; r < n; r++) {
            reset_buf(rbuf[r], all);
            memcpy((char *)rbuf[r] + (size_t)r * blk, (char *)sbuf[r] + (size_t)r * blk, blk);
        }
        if (run(*a, n, args, &res, what)) {
            for (int r = 0; r < n; r++) {
                if (!same(rbuf[r], ref[r], all)) bad = r;
            }
            CHECK_MSG(bad < 0, "alltoall %s %s: rank %d wrong", (*a)->name, what, bad);
            /* every rank sends `bytes` bytes in `steps` messages; linear sends its n-1
             * together, priced as one round (xccl_pat_direct_steps) */
            double msgs = c.steps;
            if (*a == &xccl_algo_alltoall_linear) {
                CHECK(c.steps == xccl_pat_direct_steps(n));
                msgs = n - 1;
            }
            for (int r = 0; r < n && n > 1 && count > 0; r++) {
                CHECK_MSG((double)sim_sent_msgs(&res, r) == msgs &&
                              (double)sim_sent_bytes(&res, r) == c.bytes,
                          "alltoall %s %s: rank %d sent %zu msgs %zu bytes, cost %g %g",
                          (*a)->name, what, r, sim_sent_msgs(&res, r), sim_sent_bytes(&res, r),
                          c.steps, c.bytes);
            }
            if (n == 1 || count == 0) CHECK(res.nmsgs == 0);
        }
        sim_result_free(&res);
    }
    for (int r = 0; r < n; r++) {
        free(sbuf[r]);
        free(rbuf[r]);
        free(ref[r]);
    }
}

/* All-to-all-v with uneven counts and zeros (whole rows and columns of zeros in pattern 1,
 * nothing at all in pattern 3); send pieces packed in rank order with one-element gaps,
 * receive pieces packed in reverse rank order. */
static size_t v_count(int pattern, int src, int dst, int n)
{
    switch (pattern) {
    case 0: return (size_t)((src * 7 + dst * 3) % 5);
    case 1: return src == n - 1 || dst == 0 ? 0 : (size_t)(src + dst + 1);
    case 2: return (size_t)((src * 31 + dst * 17) % 9) * 1500;
    default: return 0;
    }
}

static void alltoallv_case(const xccl_algo_t *const *algos, int n, int pattern, xccl_dtype_t dt)
{
    size_t           el = elsize(dt);
    size_t           sc[MAXN][MAXN], sd[MAXN][MAXN], rc[MAXN][MAXN], rd[MAXN][MAXN];
    size_t           stot[MAXN], rtot[MAXN], nonempty = 0;
    void            *sbuf[MAXN], *rbuf[MAXN], *ref[MAXN];
    xccl_coll_args_t args[MAXN];

    for (int r = 0; r < n; r++) {
        stot[r] = rtot[r] = 0;
        for (int j = 0; j < n; j++) {
            sc[r][j] = v_count(pattern, r, j, n);
            sd[r][j] = stot[r];
            stot[r] += sc[r][j] + 1;
            rc[r][j] = v_count(pattern, j, r, n);
            nonempty += j != r && sc[r][j] > 0;
        }
        for (int j = n - 1; j >= 0; j--) {
            rd[r][j] = rtot[r];
            rtot[r] += rc[r][j];
        }
    }
    for (int r = 0; r < n; r++) {
        sbuf[r] = alloc_buf(stot[r] * el);
        rbuf[r] = alloc_buf(rtot[r] * el);
        ref[r]  = alloc_buf(rtot[r] * el);
        for (int j = 0; j < n; j++) {
            fill_tag(sbuf[r], sd[r][j], sc[r][j], dt, r, j);
            fill_tag(ref[r], rd[r][j], rc[r][j], dt, j, r);
        }
        args[r] = (xccl_coll_args_t){.coll    = XCCL_COLL_ALLTOALLV,
                                     .sbuf    = sbuf[r],
                                     .rbuf    = rbuf[r],
                                     .dtype   = dt,
                                     .elsize  = el,
                                     .scounts = sc[r],
                                     .sdispls = sd[r],
                                     .rcounts = rc[r],
                                     .rdispls = rd[r]};
    }
    for (const xccl_algo_t *const *a = algos; *a; a++) {
        sim_result_t res;
        char         what[64];
        int          bad = -1;
        snprintf(what, sizeof(what), "n=%d pattern=%d %s", n, pattern, dt_name(dt));
        for (int r = 0; r < n; r++) {
            reset_buf(rbuf[r], rtot[r] * el);
            memcpy((char *)rbuf[r] + rd[r][r] * el, (char *)sbuf[r] + sd[r][r] * el,
                   sc[r][r] * el);
        }
        if (run(*a, n, args, &res, what)) {
            for (int r = 0; r < n; r++) {
                if (!same(rbuf[r], ref[r], rtot[r] * el)) bad = r;
            }
            CHECK_MSG(bad < 0, "alltoallv %s %s: rank %d wrong", (*a)->name, what, bad);
            /* pairwise exchanges a message per ordered pair, linear only nonempty pieces */
            size_t want = *a == &xccl_algo_alltoallv_pairwise ? (size_t)n * (size_t)(n - 1)
                                                              : nonempty;
            CHECK_MSG(res.nmsgs == want, "alltoallv %s %s: %zu messages, want %zu", (*a)->name,
                      what, res.nmsgs, want);
        }
        sim_result_free(&res);
    }
    for (int r = 0; r < n; r++) {
        free(sbuf[r]);
        free(rbuf[r]);
        free(ref[r]);
    }
}

/* =============================================================================================
 * Barrier
 * ============================================================================================= */

/* Message counts against the cost formula, and a necessary condition for a barrier on the
 * message graph in posting order: every rank hears, directly or through others, from every
 * other rank. */
static void test_barrier(const xccl_algo_t *algo)
{
    enum { MAXB = 33 };

    for (int n = 1; n <= MAXB; n++) {
        xccl_coll_args_t args[MAXB];
        sim_result_t     res;
        char             what[32];
        xccl_cost_t      c = cost_of(algo, n, 0);
        snprintf(what, sizeof(what), "n=%d", n);
        for (int r = 0; r < n; r++) args[r] = (xccl_coll_args_t){.coll = XCCL_COLL_BARRIER};
        if (run(algo, n, args, &res, what)) {
            static unsigned char heard[MAXB][MAXB];
            int                  deaf = -1;
            CHECK(sim_sent_bytes(&res, -1) == 0 && c.bytes == 0);
            if (algo == &xccl_algo_barrier_dissemination) {
                for (int r = 0; r < n; r++) {
                    CHECK_MSG((double)sim_sent_msgs(&res, r) == c.steps &&
                                  (double)sim_distinct_steps(&res, r) == c.steps,
                              "barrier dissemination n=%d rank %d: %zu messages, cost %g", n, r,
                              sim_sent_msgs(&res, r), c.steps);
                }
            } else {
                CHECK_MSG((double)res.nmsgs == c.steps &&
                              sim_sent_msgs(&res, 0) + recv_msgs(&res, 0) == res.nmsgs,
                          "barrier linear n=%d: %zu messages, cost %g", n, res.nmsgs, c.steps);
            }
            memset(heard, 0, sizeof(heard));
            for (int r = 0; r < n; r++) heard[r][r] = 1;
            for (size_t i = 0; i < res.nmsgs; i++) {
                int s = res.msgs[i].src, d = res.msgs[i].dst;
                for (int k = 0; k < n; k++) heard[d][k] |= heard[s][k];
            }
            for (int r = 0; r < n; r++) {
                for (int k = 0; k < n; k++) {
                    if (!heard[r][k]) deaf = r;
                }
            }
            CHECK_MSG(deaf < 0, "barrier %s n=%d: rank %d may leave early", algo->name, n, deaf);
        }
        sim_result_free(&res);
    }
}

/* =============================================================================================
 * Cost formulas at a glance, and the rank arithmetic added to patterns.h for these algorithms.
 * ============================================================================================= */
static void test_costs(void)
{
    xccl_cost_t c;

    /* n = 8, 1 MiB: binomial broadcast 3 steps of the whole vector; van de Geijn 3 + 7 steps
     * and 2 * 7/8 of the vector; bruck moves 3 * 4 of 8 blocks */
    xccl_algo_broadcast_binomial.cost(8, 1 << 20, &c);
    CHECK(c.steps == 3 && c.bytes == 3.0 * (1 << 20) && c.reduce_bytes == 0);
    xccl_algo_broadcast_scatter_allgather.cost(8, 1 << 20, &c);
    CHECK(c.steps == 10 && c.bytes == 2.0 * 7 / 8 * (1 << 20));
    xccl_algo_alltoall_bruck.cost(8, 1 << 20, &c);
    CHECK(c.steps == 3 && c.bytes == 12.0 / 8 * (1 << 20));
    /* chain, default 512 KiB chunks: 2 chunks, 2 + 6 steps of 512 KiB */
    xccl_algo_broadcast_chain.cost(8, 1 << 20, &c);
    CHECK(c.steps == 8 && c.bytes == 8.0 * (1 << 19));
    xccl_algo_reduce_binomial.cost(5, 1000, &c);
    CHECK(c.steps == 3 && c.bytes == 3000 && c.reduce_bytes == 3000);
    xccl_algo_barrier_dissemination.cost(5, 0, &c);
    CHECK(c.steps == 3 && c.bytes == 0);
    /* one rank: nothing to do */
    const xccl_algo_t *all[] = {&xccl_algo_broadcast_binomial, &xccl_algo_broadcast_linear,
                                &xccl_algo_broadcast_scatter_allgather, &xccl_algo_broadcast_chain,
                                &xccl_algo_reduce_binomial, &xccl_algo_reduce_linear,
                                &xccl_algo_gather_binomial, &xccl_algo_gather_linear,
                                &xccl_algo_scatter_binomial, &xccl_algo_scatter_linear,
                                &xccl_algo_alltoall_pairwise, &xccl_algo_alltoall_bruck,
                                &xccl_algo_alltoall_linear, &xccl_algo_alltoallv_pairwise,
                                &xccl_algo_alltoallv_linear, &xccl_algo_barrier_dissemination,
                                &xccl_algo_barrier_linear};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        all[i]->cost(1, 4096, &c);
        CHECK_MSG(c.steps == 0 && c.bytes == 0 && c.reduce_bytes == 0, "%s %s cost at n=1",
                  coll_str(all[i]), all[i]->name);
        CHECK(all[i]->summary != NULL && all[i]->progress != NULL);
    }
}

static void test_patterns(void)
{
    for (int n = 1; n <= 70; n++) {
        for (int k = 0; (1 << k) < 2 * n; k++) {
            int want = 0;
            for (int i = 0; i < n; i++) want += (i >> k) & 1;
            CHECK_MSG(xccl_pat_bruck_a2a_nblocks(n, k) == want, "bruck a2a n=%d k=%d", n, k);
            CHECK(want <= n / 2);
        }
    }
}

int main(void)
{
    static const xccl_algo_t *const bcast[] = {&xccl_algo_broadcast_binomial,
                                               &xccl_algo_broadcast_linear,
                                               &xccl_algo_broadcast_scatter_allgather,
                                               &xccl_algo_broadcast_chain, NULL};
    static const xccl_algo_t *const chain[] = {&xccl_algo_broadcast_chain, NULL};
    static const xccl_algo_t *const reduce[] = {&xccl_algo_reduce_binomial,
                                                &xccl_algo_reduce_linear, NULL};
    static const xccl_algo_t *const gather[] = {&xccl_algo_gather_binomial,
                                                &xccl_algo_gather_linear, NULL};
    static const xccl_algo_t *const scatter[] = {&xccl_algo_scatter_binomial,
                                                 &xccl_algo_scatter_linear, NULL};
    static const xccl_algo_t *const a2a[] = {&xccl_algo_alltoall_pairwise,
                                             &xccl_algo_alltoall_bruck,
                                             &xccl_algo_alltoall_linear, NULL};
    static const xccl_algo_t *const a2av[] = {&xccl_algo_alltoallv_pairwise,
                                              &xccl_algo_alltoallv_linear, NULL};

    test_patterns();
    test_costs();
    sweep(bcast, broadcast_case);
    /* chain again with chunks of 1000 bytes: the larger counts become up to 525 chunks */
    setenv("XCCL_RING_CHUNK_BYTES", "1000", 1);
    sweep(chain, broadcast_case);
    unsetenv("XCCL_RING_CHUNK_BYTES");
    sweep(reduce, reduce_case);
    reduce_long(reduce);
    sweep(gather, gather_scatter_case);
    sweep(scatter, gather_scatter_case);
    sweep(a2a, alltoall_case);
    for (size_t si = 0; si < NSIZES; si++) {
        for (int pattern = 0; pattern < 4; pattern++) {
            for (size_t di = 0; di < NDTYPES; di++)
                alltoallv_case(a2av, sizes[si], pattern, dtypes[di]);
        }
    }
    test_barrier(&xccl_algo_barrier_dissemination);
    test_barrier(&xccl_algo_barrier_linear);
    CTEST_MAIN_END("test_rooted");
}
