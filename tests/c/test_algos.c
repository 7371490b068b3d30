/* SPDX-License-Identifier: Apache-2.0
 *
 * test_algos.c - the rank arithmetic of patterns.h, the all_reduce / reduce_scatter /
 * all_gather algorithms run on the simulator (sim.h), the registry and the selection rules
 * of $XCCL_ALGO.
 *
 * Every algorithm runs for n = 1..9, 12, 16, counts {0, 1, n-1, n, 2n+1, 1000, 65537},
 * dtypes int32 / float32 / float64 / uint8 / bfloat16 and operators sum / max / prod (and
 * bxor for the integer types), with random (seeded) message delivery; count 65537 only with
 * a few (dtype, op) pairs, to keep the test fast under ASan. Inputs are small
 * integers so that every order of reduction gives the same bits; references are computed
 * here in int64 / double and encoded independently of the library (bfloat16 = the top half
 * of the float32 bits). The ring algorithms also run with tiny chunks so that the pipeline
 * has many chunks in flight. Traffic is compared with the cost formulas.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "algo/algo.h"
#include "algo/patterns.h"
#include "ctest.h"
#include "sim.h"

extern const xccl_algo_t xccl_algo_allreduce_ring, xccl_algo_allreduce_rd,
    xccl_algo_allreduce_rabenseifner, xccl_algo_allreduce_direct, xccl_algo_allreduce_owner,
    xccl_algo_allreduce_hier, xccl_algo_allreduce_hier_rs;
extern const xccl_algo_t xccl_algo_allgather_ring, xccl_algo_allgather_rd,
    xccl_algo_allgather_bruck, xccl_algo_allgather_direct;
extern const xccl_algo_t xccl_algo_reduce_scatter_ring, xccl_algo_reduce_scatter_rhd,
    xccl_algo_reduce_scatter_direct, xccl_algo_reduce_scatter_owner;

/* select.c: makes the next selection read $XCCL_ALGO again. */
void xccl_algo_reset_env(void);

#define MAXN  16
#define GUARD 32

static const int sizes[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16};
#define NSIZES (sizeof(sizes) / sizeof(sizes[0]))

static const xccl_dtype_t dtypes[] = {XCCL_INT32, XCCL_FLOAT32, XCCL_FLOAT64, XCCL_UINT8,
                                      XCCL_BFLOAT16};
#define NDTYPES (sizeof(dtypes) / sizeof(dtypes[0]))

static const xccl_op_t ops[] = {XCCL_OP_SUM, XCCL_OP_MAX, XCCL_OP_PROD, XCCL_OP_BXOR};
#define NOPS (sizeof(ops) / sizeof(ops[0]))

static uint64_t seed_counter = 1;

/* =============================================================================================
 * Values and references
 * ============================================================================================= */

static size_t el_size(xccl_dtype_t dt)
{
    switch (dt) {
    case XCCL_INT32:
    case XCCL_FLOAT32: return 4;
    case XCCL_FLOAT64: return 8;
    case XCCL_BFLOAT16: return 2;
    default: return 1;
    }
}

static const char *dt_str(xccl_dtype_t dt)
{
    switch (dt) {
    case XCCL_INT32: return "int32";
    case XCCL_FLOAT32: return "float32";
    case XCCL_FLOAT64: return "float64";
    case XCCL_BFLOAT16: return "bfloat16";
    default: return "uint8";
    }
}

static const char *op_str(xccl_op_t op)
{
    return op == XCCL_OP_SUM ? "sum" : op == XCCL_OP_MAX ? "max" : op == XCCL_OP_PROD ? "prod"
                                                                                       : "bxor";
}

static int is_int(xccl_dtype_t dt) { return dt == XCCL_INT32 || dt == XCCL_UINT8; }

/* Input element i of rank r: small integers for which every reduction order is exact
 * (sums of at most 16 values in [-3, 4], products of at most 16 values in {-1, 1, 2}). */
static int64_t val(xccl_op_t op, xccl_dtype_t dt, int r, size_t i)
{
    uint64_t h = (uint64_t)r * 0x9e3779b1u + (uint64_t)i * 0x85ebca6bu + 12345u;
    int      sgn = dt != XCCL_UINT8;

    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    switch (op) {
    case XCCL_OP_SUM: return (int64_t)(h % 8) - (sgn ? 3 : 0);
    case XCCL_OP_PROD:
        if (h % 5 == 0) return 2;
        return sgn && h % 7 == 0 ? -1 : 1;
    case XCCL_OP_MAX: return sgn ? (int64_t)(h % 201) - 100 : (int64_t)(h % 256);
    default: return (int64_t)(h & (dt == XCCL_UINT8 ? 0xff : 0x7fffffff));
    }
}

static int64_t combine(xccl_op_t op, int64_t a, int64_t b)
{
    switch (op) {
    case XCCL_OP_SUM: return a + b;
    case XCCL_OP_PROD: return a * b;
    case XCCL_OP_MAX: return a > b ? a : b;
    default: return a ^ b;
    }
}

/* Stores the integer v as element i of buf in dtype dt (uint8 wraps mod 256, like the
 * kernels' unsigned arithmetic). */
static void put(void *buf, size_t i, xccl_dtype_t dt, int64_t v)
{
    switch (dt) {
    case XCCL_INT32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case XCCL_FLOAT32: ((float *)buf)[i] = (float)v; break;
    case XCCL_FLOAT64: ((double *)buf)[i] = (double)v; break;
    case XCCL_BFLOAT16: {
        float    f = (float)v;
        uint32_t u;
        memcpy(&u, &f, 4);
        ((uint16_t *)buf)[i] = (uint16_t)(u >> 16); /* exact: |v| < 2^8 or a power of 2 */
        break;
    }
    default: ((uint8_t *)buf)[i] = (uint8_t)(v & 0xff); break;
    }
}

/* =============================================================================================
 * Buffers with a guard zone
 * ============================================================================================= */

static void *alloc_buf(size_t nbytes, int fill)
{
    unsigned char *p = malloc(nbytes + GUARD);

    if (p == NULL) {
        fprintf(stderr, "test_algos: out of memory\n");
        exit(2);
    }
    memset(p, fill, nbytes);
    memset(p + nbytes, 0xC3, GUARD);
    return p;
}

static int guard_ok(const void *p, size_t nbytes)
{
    const unsigned char *g = (const unsigned char *)p + nbytes;
    for (int i = 0; i < GUARD; i++)
        if (g[i] != 0xC3) return 0;
    return 1;
}

/* Index of the first differing byte, or -1 if equal. */
static long first_diff(const void *a, const void *b, size_t nbytes)
{
    const unsigned char *x = a, *y = b;
    if (memcmp(a, b, nbytes) == 0) return -1;
    for (size_t i = 0; i < nbytes; i++)
        if (x[i] != y[i]) return (long)i;
    return -1;
}

static int run(const xccl_algo_t *algo, int n, const xccl_coll_args_t *args, sim_result_t *res,
               const char *what)
{
    sim_opts_t    opts = {.seed = seed_counter++};
    xccl_status_t st   = sim_run(algo, n, args, &opts, res);

    CHECK_MSG(st == XCCL_OK, "%s: %s", what, res->error);
    return st == XCCL_OK;
}

static xccl_cost_t cost_of(const xccl_algo_t *algo, int n, size_t nbytes)
{
    xccl_cost_t c = {0};
    algo->cost(n, nbytes, &c);
    return c;
}

/* Counts of the sweep for n ranks, without duplicates. */
static int counts_for(int n, size_t *out)
{
    size_t c[] = {0, 1, (size_t)n - 1, (size_t)n, 2 * (size_t)n + 1, 1000, 65537};
    int    k   = 0;

    for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++) {
        int dup = 0;
        for (int j = 0; j < k; j++) dup |= out[j] == c[i];
        if (!dup) out[k++] = c[i];
    }
    return k;
}

/* The largest count runs for a few combinations only, to keep the test fast. */
static int big_wanted(size_t count, xccl_dtype_t dt, xccl_op_t op)
{
    return count < 65537 || (op == XCCL_OP_SUM && (dt == XCCL_INT32 || dt == XCCL_FLOAT64)) ||
           (op == XCCL_OP_BXOR && dt == XCCL_UINT8);
}

/* =============================================================================================
 * patterns.h
 * ============================================================================================= */

static void test_patterns(void)
{
    /* integers */
    for (int n = 1; n <= 70; n++) {
        int p = xccl_pat_pow2_floor(n);
        CHECK(p <= n && 2 * p > n && xccl_pat_is_pow2(p));
        CHECK((1 << xccl_pat_log2_ceil(n)) >= n);
        CHECK(n == 1 || (1 << (xccl_pat_log2_ceil(n) - 1)) < n);
        CHECK(xccl_pat_mod(-n, 7) == (7 - n % 7) % 7);
        /* a direct round: 1 + (n-2)/8 */
        CHECK(n == 1 ? xccl_pat_direct_steps(n) == 0 : xccl_pat_direct_steps(n) == 1 + (n - 2) / 8.0);
    }
    /* owner: one step per peer for each round, C+1 rounds for all_reduce and C for
     * reduce_scatter, with C = chunks of XCCL_OWNER_CHUNK_BYTES (256 KiB) per block */
    {
        xccl_cost_t c;
        xccl_algo_allreduce_owner.cost(4, 1 << 20, &c); /* blocks of 256 KiB: C = 1 */
        CHECK_MSG(c.steps == 2 * 3, "owner all_reduce 4 x 1 MiB: %g steps", c.steps);
        xccl_algo_allreduce_owner.cost(2, 4 << 20, &c); /* blocks of 2 MiB: C = 8 */
        CHECK_MSG(c.steps == 9 * 1, "owner all_reduce 2 x 4 MiB: %g steps", c.steps);
        xccl_algo_reduce_scatter_owner.cost(4, 4 << 20, &c); /* blocks of 1 MiB: C = 4 */
        CHECK_MSG(c.steps == 4 * 3, "owner reduce_scatter 4 x 4 MiB: %g steps", c.steps);
    }

    /* blocks: cover [0, count), sizes differ by at most one, larger ones first */
    for (int n = 1; n <= 17; n++) {
        for (size_t count = 0; count < 60; count++) {
            size_t sum = 0;
            for (int i = 0; i < n; i++) {
                size_t c = xccl_pat_block_count(count, n, i);
                CHECK(xccl_pat_block_off(count, n, i) == sum);
                CHECK(c == count / n || c == count / n + 1);
                CHECK(c <= xccl_pat_block_max(count, n));
                if (i > 0) CHECK(c <= xccl_pat_block_count(count, n, i - 1));
                sum += c;
            }
            CHECK(sum == count && xccl_pat_block_off(count, n, n) == count);
        }
    }

    for (int n = 1; n <= 33; n++) {
        /* ring: the block received at step s is sent at step s+1; reduce-scatter ends with
         * block r, all-gather receives every other block once */
        for (int r = 0; r < n; r++) {
            int seen[64] = {0};
            CHECK(xccl_pat_ring_prev(xccl_pat_ring_next(r, n), n) == r);
            for (int s = 0; s + 1 < n; s++) {
                int nx = xccl_pat_ring_next(r, n);
                CHECK(xccl_pat_ring_rs_send_block(r, n, s) ==
                      xccl_pat_ring_rs_recv_block(nx, n, s));
                CHECK(xccl_pat_ring_ag_send_block(r, n, s) ==
                      xccl_pat_ring_ag_recv_block(nx, n, s));
                if (s + 2 < n) {
                    CHECK(xccl_pat_ring_rs_recv_block(r, n, s) ==
                          xccl_pat_ring_rs_send_block(r, n, s + 1));
                    CHECK(xccl_pat_ring_ag_recv_block(r, n, s) ==
                          xccl_pat_ring_ag_send_block(r, n, s + 1));
                }
                seen[xccl_pat_ring_ag_recv_block(r, n, s)]++;
            }
            if (n > 1) CHECK(xccl_pat_ring_rs_recv_block(r, n, n - 2) == r);
            for (int b = 0; b < n; b++) CHECK(seen[b] == (b != r));
        }

        /* fold: roles and peers are symmetric; parts of [0, p) cover every block once */
        {
            int covered[64] = {0};
            for (int r = 0; r < n; r++) {
                xccl_pat_fold_t f = xccl_pat_fold(r, n);
                CHECK(f.p + f.extra == n && f.p == 1 << f.log_p && f.extra < f.p);
                if (f.role != XCCL_PAT_PLAIN) {
                    xccl_pat_fold_t g = xccl_pat_fold(f.peer, n);
                    CHECK(g.peer == r && g.role != f.role && g.role != XCCL_PAT_PLAIN);
                }
            }
            for (int v = 0; v < xccl_pat_pow2_floor(n); v++) {
                int a0, a1, b0, b1;
                xccl_pat_fold_parts(xccl_pat_pow2_floor(n), n - xccl_pat_pow2_floor(n), v, v + 1,
                                    &a0, &a1, &b0, &b1);
                for (int b = a0; b < a1; b++) covered[b]++;
                for (int b = b0; b < b1; b++) covered[b]++;
            }
            for (int b = 0; b < n; b++) CHECK(covered[b] == 1);
        }

        /* binomial: for every root, parents and children agree, subtrees partition */
        for (int root = 0; root < n; root++) {
            int nparents = 0, below = 0;
            for (int r = 0; r < n; r++) {
                int par = xccl_pat_binomial_parent(r, root, n), nc, sub = 1;
                nparents += par >= 0;
                CHECK((par < 0) == (r == root));
                nc = xccl_pat_binomial_nchildren(r, root, n);
                for (int i = 0; i < nc; i++) {
                    int ch = xccl_pat_binomial_child(r, root, n, i);
                    CHECK(xccl_pat_binomial_parent(ch, root, n) == r);
                    sub += xccl_pat_binomial_subtree(ch, root, n);
                }
                CHECK(sub == xccl_pat_binomial_subtree(r, root, n));
                below += nc;
            }
            CHECK(nparents == n - 1 && below == n - 1);
            CHECK(xccl_pat_binomial_subtree(root, root, n) == n);
        }

        /* Bruck: the rounds deliver n-1 blocks; pairwise meets every peer once */
        {
            int total = 0;
            for (int k = 0; k < xccl_pat_bruck_rounds(n); k++) {
                total += xccl_pat_bruck_nblocks(n, k);
                for (int r = 0; r < n; r++)
                    CHECK(xccl_pat_bruck_recv_peer(xccl_pat_bruck_send_peer(r, n, k), n, k) == r);
            }
            CHECK(total == n - 1);
        }
        for (int r = 0; r < n; r++) {
            int met_s[64] = {0}, met_r[64] = {0};
            for (int s = 1; s < n; s++) {
                int to = xccl_pat_pairwise_send_peer(r, n, s);
                CHECK(xccl_pat_pairwise_recv_peer(to, n, s) == r);
                met_s[to]++;
                met_r[xccl_pat_pairwise_recv_peer(r, n, s)]++;
            }
            for (int q = 0; q < n; q++) CHECK(met_s[q] == (q != r) && met_r[q] == (q != r));
        }
    }

    /* pipeline: dependencies respected, messages numbered apart and below 2^20 */
    {
        int shapes[][3] = {{1, 0, 1},  {7, 0, 5},   {6, 6, 1},  {6, 6, 9},
                           {14, 7, 1}, {14, 7, 13}, {30, 15, 64}};
        for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
            xccl_pat_pipe_t p      = xccl_pat_pipe(shapes[i][0], shapes[i][1], shapes[i][2]);
            int             rounds = xccl_pat_pipe_rounds(&p), posted = 0;
            for (int k = 0; k < rounds; k++) {
                for (int s = 0; s < p.nsteps; s++) {
                    int c = xccl_pat_pipe_chunk(&p, s, k);
                    if (c < 0) continue;
                    posted++;
                    CHECK(xccl_pat_pipe_step(&p, s, c) <= XCCL_STEP_MAX);
                    if (s > 0) {
                        /* the chunk arrived in an earlier round; after a reduction step
                         * with chunks, two rounds earlier */
                        int prev = k - 1 - (s - 1 < p.nred && p.nchunks > 1);
                        CHECK(xccl_pat_pipe_chunk(&p, s - 1, prev) == c);
                    }
                }
            }
            CHECK(posted == p.nsteps * p.nchunks);
        }
        CHECK(xccl_pat_ring_nchunks(0, 512, 10, XCCL_STEP_MAX + 1u) == 1);
        CHECK(xccl_pat_ring_nchunks(1025, 512, 10, XCCL_STEP_MAX + 1u) == 3);
        CHECK(xccl_pat_ring_nchunks((size_t)1 << 40, 512, 10, XCCL_STEP_MAX + 1u) ==
              XCCL_PAT_RING_MAX_CHUNKS);
        CHECK(xccl_pat_ring_nchunks((size_t)1 << 40, 512, 4000, XCCL_STEP_MAX + 1u) * 4000 <=
              (int)XCCL_STEP_MAX + 1);
    }
}

/* =============================================================================================
 * all_reduce
 * ============================================================================================= */

static const xccl_algo_t *const allreduce_algos[] = {
    &xccl_algo_allreduce_ring,   &xccl_algo_allreduce_rd,   &xccl_algo_allreduce_rabenseifner,
    &xccl_algo_allreduce_direct, &xccl_algo_allreduce_owner, &xccl_algo_allreduce_hier,
    &xccl_algo_allreduce_hier_rs, NULL};

/* Chunks per block of the owner algorithms for blocks of at most block_max elements, and the
 * messages one block of bcnt elements takes (empty chunks are not sent). */
static int owner_chunks(size_t block_max, size_t es)
{
    const char *v     = getenv(XCCL_PAT_OWNER_CHUNK_ENV);
    size_t      chunk = v ? (size_t)strtoull(v, NULL, 10) : XCCL_PAT_OWNER_CHUNK_DEFAULT;

    return xccl_pat_owner_nchunks(block_max * es, chunk < es ? es : chunk);
}

static size_t owner_msgs(size_t bcnt, int nchunks)
{
    return bcnt < (size_t)nchunks ? bcnt : (size_t)nchunks;
}

/* Per-rank traffic of an all_reduce compared with the cost formula, for exact cases. */
static void allreduce_traffic(const xccl_algo_t *a, int n, size_t count, size_t es,
                              const sim_result_t *res, const char *what)
{
    size_t          N = count * es;
    xccl_cost_t     c = cost_of(a, n, N);
    xccl_pat_fold_t f0 = xccl_pat_fold(0, n);
    int             pow2 = xccl_pat_is_pow2(n);

    if (n == 1 || count == 0) {
        CHECK_MSG(res->nmsgs == 0, "%s: %zu messages", what, res->nmsgs);
        return;
    }
    for (int r = 0; r < n; r++) {
        xccl_pat_fold_t f = xccl_pat_fold(r, n);
        size_t          b = sim_sent_bytes(res, r), m = sim_sent_msgs(res, r);
        size_t          red = res->reduce_bytes[r];

        if (a == &xccl_algo_allreduce_ring && count % (size_t)n == 0 && count >= (size_t)n) {
            CHECK_MSG(m == 2 * (size_t)(n - 1) && (double)b == c.bytes &&
                          (double)red == c.reduce_bytes,
                      "%s rank %d: %zu msgs %zu B %zu reduced; cost %g B %g reduced", what, r, m,
                      b, red, c.bytes, c.reduce_bytes);
        } else if (a == &xccl_algo_allreduce_ring) {
            CHECK_MSG(b == 2 * N - (xccl_pat_block_count(count, n, r) +
                                    xccl_pat_block_count(count, n, (r + 1) % n)) * es,
                      "%s rank %d: %zu B", what, r, b);
        } else if (a == &xccl_algo_allreduce_rd) {
            /* plain ranks: log2 p vectors; proxies one more; extras one */
            size_t want =
                f.role == XCCL_PAT_EXTRA ? 1 : (size_t)f.log_p + (f.role == XCCL_PAT_PROXY);
            CHECK_MSG(m == want && b == want * N &&
                          (pow2 ? (double)b == c.bytes : (double)b < c.bytes),
                      "%s rank %d: %zu msgs %zu B, cost %g", what, r, m, b, c.bytes);
            CHECK_MSG((double)red <= c.reduce_bytes, "%s rank %d: reduced %zu", what, r, red);
        } else if (a == &xccl_algo_allreduce_rabenseifner) {
            if (pow2 && count % (size_t)n == 0)
                CHECK_MSG((double)b == c.bytes && m == 2 * (size_t)f0.log_p &&
                              (double)red == c.reduce_bytes,
                          "%s rank %d: %zu msgs %zu B %zu reduced, cost %g B", what, r, m, b,
                          red, c.bytes);
            CHECK_MSG((double)b <= c.bytes + 2.0 * (double)(f0.p * es),
                      "%s rank %d: %zu B, cost %g", what, r, b, c.bytes);
        } else if (a == &xccl_algo_allreduce_owner) {
            /* every other block's chunks to their owners, block r's chunks to every peer */
            int    C = owner_chunks(xccl_pat_block_max(count, n), es);
            size_t mine = xccl_pat_block_count(count, n, r), want_m = 0;
            for (int q = 0; q < n; q++)
                if (q != r) want_m += owner_msgs(xccl_pat_block_count(count, n, q), C);
            want_m += (size_t)(n - 1) * owner_msgs(mine, C);
            CHECK_MSG(m == want_m && b == N + (size_t)(n - 2) * mine * es &&
                          red == (size_t)(n - 1) * mine * es,
                      "%s rank %d: %zu msgs (want %zu) %zu B %zu reduced", what, r, m, want_m, b,
                      red);
            if (count % (size_t)n == 0)
                CHECK_MSG((double)b == c.bytes && (double)red == c.reduce_bytes,
                          "%s rank %d: %zu B %zu reduced, cost %g %g", what, r, b, red, c.bytes,
                          c.reduce_bytes);
        } else if (a == &xccl_algo_allreduce_hier_rs) {
            /* one node: its ring reduce-scatter and ring all-gather sub-tasks, priced as such */
            if (count % (size_t)n == 0)
                CHECK_MSG((double)b == c.bytes && (double)red == c.reduce_bytes,
                          "%s rank %d: %zu B %zu reduced, cost %g %g", what, r, b, red, c.bytes,
                          c.reduce_bytes);
        } else if (a == &xccl_algo_allreduce_hier) {
            /* one node: binomial reduce + broadcast; the root's link carries the most */
            CHECK_MSG((double)b <= c.bytes && (double)red <= c.reduce_bytes,
                      "%s rank %d: %zu B %zu reduced, cost %g %g", what, r, b, red, c.bytes,
                      c.reduce_bytes);
        } else {
            CHECK_MSG(m == (size_t)n - 1 && (double)b == c.bytes && (double)red == c.reduce_bytes,
                      "%s rank %d: %zu msgs %zu B", what, r, m, b);
        }
    }
    if (a == &xccl_algo_allreduce_owner) {
        /* the cost sees bytes only: it knows the chunks when blocks are even and a chunk
         * holds whole elements */
        int         C = owner_chunks(xccl_pat_block_max(count, n), es);
        const char *v = getenv(XCCL_PAT_OWNER_CHUNK_ENV);
        CHECK_MSG(sim_distinct_steps(res, -1) <= 2 * (size_t)C, "%s: %zu steps, %d chunks", what,
                  sim_distinct_steps(res, -1), C);
        /* C+1 rounds, each a synchronisation with the n-1 peers */
        double want = (double)(C + 1) * (n - 1);
        if (count % (size_t)n == 0 && (v == NULL || strtoull(v, NULL, 10) % es == 0))
            CHECK_MSG(c.steps == want, "%s: cost %g, want %g, %d chunks", what, c.steps, want, C);
    }
    if (a == &xccl_algo_allreduce_rd || a == &xccl_algo_allreduce_rabenseifner)
        CHECK_MSG(sim_distinct_steps(res, -1) == (size_t)c.steps, "%s: %zu steps, cost %g", what,
                  sim_distinct_steps(res, -1), c.steps);
}

/* Inputs and reference of one (n, count, dtype, op): rank r's input has n * count elements
 * (all of it for reduce_scatter, the first count for all_reduce); ref is their reduction. */
typedef struct red_case {
    int          n;
    size_t       count, es;
    xccl_dtype_t dt;
    xccl_op_t    op;
    void        *in[MAXN];
    void        *ref;
} red_case_t;

static void red_case_init(red_case_t *c, int n, size_t count, xccl_dtype_t dt, xccl_op_t op)
{
    size_t total = (size_t)n * count;

    c->n     = n;
    c->count = count;
    c->dt    = dt;
    c->op    = op;
    c->es    = el_size(dt);
    c->ref   = alloc_buf(total * c->es, 0);
    for (int r = 0; r < n; r++) c->in[r] = alloc_buf(total * c->es, 0);
    for (size_t i = 0; i < total; i++) {
        int64_t acc = val(op, dt, 0, i);
        put(c->in[0], i, dt, acc);
        for (int r = 1; r < n; r++) {
            int64_t v = val(op, dt, r, i);
            put(c->in[r], i, dt, v);
            acc = combine(op, acc, v);
        }
        put(c->ref, i, dt, dt == XCCL_UINT8 ? acc & 0xff : acc);
    }
}

static void red_case_free(red_case_t *c)
{
    for (int r = 0; r < c->n; r++) free(c->in[r]);
    free(c->ref);
}

static void allreduce_case(const xccl_algo_t *a, const red_case_t *c, int traffic)
{
    int              n = c->n;
    size_t           N = c->count * c->es;
    void            *buf[MAXN];
    xccl_coll_args_t args[MAXN];
    sim_result_t     res;
    char             what[160];

    snprintf(what, sizeof(what), "all_reduce %s n=%d count=%zu %s %s", a->name, n, c->count,
             dt_str(c->dt), op_str(c->op));
    for (int r = 0; r < n; r++) {
        buf[r] = alloc_buf(N, 0);
        memcpy(buf[r], c->in[r], N);
        args[r] = (xccl_coll_args_t){.coll   = XCCL_COLL_ALLREDUCE,
                                     .sbuf   = buf[r],
                                     .rbuf   = buf[r],
                                     .count  = c->count,
                                     .dtype  = c->dt,
                                     .elsize = c->es,
                                     .op     = c->op};
    }
    if (run(a, n, args, &res, what)) {
        for (int r = 0; r < n; r++) {
            long d = first_diff(buf[r], c->ref, N);
            CHECK_MSG(d < 0 && guard_ok(buf[r], N), "%s: rank %d differs at byte %ld", what, r,
                      d);
        }
        if (traffic) allreduce_traffic(a, n, c->count, c->es, &res, what);
    }
    sim_result_free(&res);
    for (int r = 0; r < n; r++) free(buf[r]);
}

/* =============================================================================================
 * reduce_scatter
 * ============================================================================================= */

static const xccl_algo_t *const reduce_scatter_algos[] = {
    &xccl_algo_reduce_scatter_ring, &xccl_algo_reduce_scatter_rhd,
    &xccl_algo_reduce_scatter_direct, &xccl_algo_reduce_scatter_owner, NULL};

static void reduce_scatter_traffic(const xccl_algo_t *a, int n, size_t count, size_t es,
                                   const sim_result_t *res, const char *what)
{
    size_t      N = (size_t)n * count * es;
    xccl_cost_t c = cost_of(a, n, N);

    if (n == 1 || count == 0) {
        CHECK_MSG(res->nmsgs == 0, "%s: %zu messages", what, res->nmsgs);
        return;
    }
    for (int r = 0; r < n; r++) {
        size_t b = sim_sent_bytes(res, r), m = sim_sent_msgs(res, r);
        size_t red = res->reduce_bytes[r];

        if (a == &xccl_algo_reduce_scatter_rhd) {
            xccl_pat_fold_t f = xccl_pat_fold(r, n);
            if (f.extra == 0)
                CHECK_MSG(m == (size_t)f.log_p && (double)b == c.bytes &&
                              (double)red == c.reduce_bytes,
                          "%s rank %d: %zu msgs %zu B %zu reduced, cost %g B", what, r, m, b, red,
                          c.bytes);
            else
                CHECK_MSG((double)b <= c.bytes && (double)red <= c.reduce_bytes &&
                              (r != 0 || (double)red == c.reduce_bytes),
                          "%s rank %d: %zu B %zu reduced, cost %g B %g", what, r, b, red, c.bytes,
                          c.reduce_bytes);
        } else if (a == &xccl_algo_reduce_scatter_owner) {
            /* n-1 blocks out in chunks, n-1 blocks reduced */
            size_t want_m = (size_t)(n - 1) * owner_msgs(count, owner_chunks(count, es));
            CHECK_MSG(m == want_m && (double)b == c.bytes && (double)red == c.reduce_bytes,
                      "%s rank %d: %zu msgs (want %zu) %zu B %zu reduced, cost %g B", what, r, m,
                      want_m, b, red, c.bytes);
        } else {
            /* ring (one chunk) and direct: n-1 blocks out, n-1 blocks reduced */
            CHECK_MSG(m == (size_t)n - 1 && (double)b == c.bytes && (double)red == c.reduce_bytes,
                      "%s rank %d: %zu msgs %zu B %zu reduced, cost %g B", what, r, m, b, red,
                      c.bytes);
        }
    }
    if (a == &xccl_algo_reduce_scatter_ring)
        CHECK_MSG(sim_distinct_steps(res, -1) == (size_t)c.steps, "%s: %zu steps, cost %g", what,
                  sim_distinct_steps(res, -1), c.steps);
}

/* alias: rbuf of rank r is block r of its sbuf (the in-place layout of NCCL). */
static void reduce_scatter_case(const xccl_algo_t *a, const red_case_t *c, int traffic, int alias)
{
    int              n = c->n;
    size_t           bb = c->count * c->es;
    void            *sbuf[MAXN], *rbuf[MAXN];
    xccl_coll_args_t args[MAXN];
    sim_result_t     res;
    char             what[160];

    snprintf(what, sizeof(what), "reduce_scatter %s n=%d count=%zu %s %s%s", a->name, n,
             c->count, dt_str(c->dt), op_str(c->op), alias ? " in place" : "");
    for (int r = 0; r < n; r++) {
        /* sbuf is read-only: the shared input serves, except where rbuf lives inside it */
        sbuf[r] = c->in[r];
        if (alias) {
            sbuf[r] = alloc_buf((size_t)n * bb, 0);
            memcpy(sbuf[r], c->in[r], (size_t)n * bb);
        }
        rbuf[r] = alias ? (char *)sbuf[r] + (size_t)r * bb : alloc_buf(bb, 0xCD);
        args[r] = (xccl_coll_args_t){.coll   = XCCL_COLL_REDUCE_SCATTER,
                                     .sbuf   = sbuf[r],
                                     .rbuf   = rbuf[r],
                                     .count  = c->count,
                                     .dtype  = c->dt,
                                     .elsize = c->es,
                                     .op     = c->op};
    }
    if (run(a, n, args, &res, what)) {
        for (int r = 0; r < n; r++) {
            long d = first_diff(rbuf[r], (char *)c->ref + (size_t)r * bb, bb);
            CHECK_MSG(d < 0 && (alias || guard_ok(rbuf[r], bb)), "%s: rank %d differs at byte %ld",
                      what, r, d);
            if (!alias)
                CHECK_MSG(first_diff(sbuf[r], c->in[r], (size_t)n * bb) < 0 &&
                              guard_ok(sbuf[r], (size_t)n * bb),
                          "%s: rank %d: sbuf modified", what, r);
        }
        if (traffic) reduce_scatter_traffic(a, n, c->count, c->es, &res, what);
    }
    sim_result_free(&res);
    for (int r = 0; r < n; r++) {
        if (alias)
            free(sbuf[r]);
        else
            free(rbuf[r]);
    }
}

/* =============================================================================================
 * all_gather
 * ============================================================================================= */

static const xccl_algo_t *const allgather_algos[] = {
    &xccl_algo_allgather_ring, &xccl_algo_allgather_rd, &xccl_algo_allgather_bruck,
    &xccl_algo_allgather_direct, NULL};

static void allgather_traffic(const xccl_algo_t *a, int n, size_t count, size_t es,
                              const sim_result_t *res, const char *what)
{
    size_t      N = (size_t)n * count * es;
    xccl_cost_t c = cost_of(a, n, N);

    if (n == 1 || count == 0) {
        CHECK_MSG(res->nmsgs == 0, "%s: %zu messages", what, res->nmsgs);
        return;
    }
    for (int r = 0; r < n; r++) {
        xccl_pat_fold_t f = xccl_pat_fold(r, n);
        size_t          b = sim_sent_bytes(res, r), m = sim_sent_msgs(res, r);

        if (a == &xccl_algo_allgather_rd && f.extra != 0) {
            CHECK_MSG((double)b <= c.bytes, "%s rank %d: %zu B, cost %g", what, r, b, c.bytes);
            continue;
        }
        /* every other algorithm sends each rank exactly n-1 blocks */
        CHECK_MSG((double)b == c.bytes, "%s rank %d: %zu B, cost %g", what, r, b, c.bytes);
        if (a == &xccl_algo_allgather_ring || a == &xccl_algo_allgather_direct)
            CHECK_MSG(m == (size_t)n - 1, "%s rank %d: %zu msgs", what, r, m);
        if (a == &xccl_algo_allgather_rd) CHECK_MSG(m == (size_t)f.log_p, "%s: %zu msgs", what, m);
        if (a == &xccl_algo_allgather_bruck)
            CHECK_MSG(m >= (size_t)c.steps && m <= 2 * (size_t)c.steps, "%s: %zu msgs", what, m);
    }
    if (a != &xccl_algo_allgather_direct)
        CHECK_MSG(sim_distinct_steps(res, -1) == (size_t)c.steps, "%s: %zu steps, cost %g", what,
                  sim_distinct_steps(res, -1), c.steps);
}

static void allgather_case(const xccl_algo_t *a, int n, size_t count, xccl_dtype_t dt,
                           int traffic)
{
    size_t           es = el_size(dt), bb = count * es, N = (size_t)n * bb;
    void            *buf[MAXN], *ref = alloc_buf(N, 0);
    xccl_coll_args_t args[MAXN];
    sim_result_t     res;
    char             what[160];

    snprintf(what, sizeof(what), "all_gather %s n=%d count=%zu %s", a->name, n, count,
             dt_str(dt));
    for (int q = 0; q < n; q++)
        for (size_t i = 0; i < count; i++)
            put(ref, (size_t)q * count + i, dt, val(XCCL_OP_MAX, dt, q, i));
    for (int r = 0; r < n; r++) {
        buf[r] = alloc_buf(N, 0xCD);
        memcpy((char *)buf[r] + (size_t)r * bb, (char *)ref + (size_t)r * bb, bb);
        args[r] = (xccl_coll_args_t){.coll   = XCCL_COLL_ALLGATHER,
                                     .sbuf   = (char *)buf[r] + (size_t)r * bb,
                                     .rbuf   = buf[r],
                                     .count  = count,
                                     .dtype  = dt,
                                     .elsize = es};
    }
    if (run(a, n, args, &res, what)) {
        for (int r = 0; r < n; r++) {
            long d = first_diff(buf[r], ref, N);
            CHECK_MSG(d < 0 && guard_ok(buf[r], N), "%s: rank %d differs at byte %ld", what, r,
                      d);
        }
        if (traffic) allgather_traffic(a, n, count, es, &res, what);
    }
    sim_result_free(&res);
    for (int r = 0; r < n; r++) free(buf[r]);
    free(ref);
}

/* =============================================================================================
 * Sweeps
 * ============================================================================================= */

static void sweep_reductions(void)
{
    for (size_t si = 0; si < NSIZES; si++) {
        int    n = sizes[si], nc;
        size_t counts[8];

        nc = counts_for(n, counts);
        for (int ci = 0; ci < nc; ci++) {
            for (size_t di = 0; di < NDTYPES; di++) {
                for (size_t oi = 0; oi < NOPS; oi++) {
                    xccl_dtype_t dt = dtypes[di];
                    xccl_op_t    op = ops[oi];
                    int          traffic = oi == 0 && di == 0;
                    red_case_t   c;
                    if (op == XCCL_OP_BXOR && !is_int(dt)) continue;
                    if (!big_wanted(counts[ci], dt, op)) continue;
                    red_case_init(&c, n, counts[ci], dt, op);
                    for (const xccl_algo_t *const *a = allreduce_algos; *a; a++)
                        allreduce_case(*a, &c, traffic);
                    for (const xccl_algo_t *const *a = reduce_scatter_algos; *a; a++)
                        reduce_scatter_case(*a, &c, traffic, 0);
                    red_case_free(&c);
                }
            }
        }
    }
}

/* The all-reduces that promise the same bits on every rank, on random floats whose sums
 * depend on the order of combination: every rank's result must equal rank 0's byte for byte,
 * and each element must be within rounding of the sum computed here in long double. */
static void bitwise_case(const xccl_algo_t *a, int n, size_t count, xccl_dtype_t dt,
                         uint64_t *rng)
{
    size_t           es = el_size(dt), N = count * es;
    void            *buf[MAXN];
    long double     *ref = calloc(count ? count : 1, sizeof(long double));
    xccl_coll_args_t args[MAXN];
    sim_result_t     res;
    char             what[160];

    snprintf(what, sizeof(what), "all_reduce %s n=%d count=%zu %s random", a->name, n, count,
             dt_str(dt));
    for (int r = 0; r < n; r++) {
        buf[r] = alloc_buf(N, 0);
        for (size_t i = 0; i < count; i++) {
            double v;
            *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
            v    = ((double)(*rng >> 11) / 9007199254740992.0 - 0.5) * 1e3;
            if (dt == XCCL_FLOAT32) {
                ((float *)buf[r])[i] = (float)v;
                ref[i] += (float)v;
            } else {
                ((double *)buf[r])[i] = v;
                ref[i] += v;
            }
        }
        args[r] = (xccl_coll_args_t){.coll   = XCCL_COLL_ALLREDUCE,
                                     .sbuf   = buf[r],
                                     .rbuf   = buf[r],
                                     .count  = count,
                                     .dtype  = dt,
                                     .elsize = es,
                                     .op     = XCCL_OP_SUM};
    }
    if (run(a, n, args, &res, what)) {
        for (int r = 1; r < n; r++) {
            long d = first_diff(buf[r], buf[0], N);
            CHECK_MSG(d < 0 && guard_ok(buf[r], N), "%s: rank %d differs from rank 0 at byte %ld",
                      what, r, d);
        }
        for (size_t i = 0; i < count; i++) {
            double got = dt == XCCL_FLOAT32 ? ((float *)buf[0])[i] : ((double *)buf[0])[i];
            double tol = (dt == XCCL_FLOAT32 ? 1e-4 : 1e-11) * 500.0 * n;
            if (fabs(got - (double)ref[i]) > tol) {
                CHECK_MSG(0, "%s: element %zu = %.17g, want %.17Lg", what, i, got, ref[i]);
                break;
            }
        }
    }
    sim_result_free(&res);
    for (int r = 0; r < n; r++) free(buf[r]);
    free(ref);
}

static void sweep_bitwise(void)
{
    static const xccl_algo_t *const same_bits[] = {
        &xccl_algo_allreduce_ring,  &xccl_algo_allreduce_rd,    &xccl_algo_allreduce_rabenseifner,
        &xccl_algo_allreduce_direct, &xccl_algo_allreduce_owner, &xccl_algo_allreduce_hier,
        &xccl_algo_allreduce_hier_rs, NULL};
    uint64_t rng = 12345;

    for (size_t si = 0; si < NSIZES; si++) {
        int    n        = sizes[si];
        size_t counts[] = {1, (size_t)n + 1, 1000, 4099};
        for (size_t ci = 0; ci < sizeof(counts) / sizeof(counts[0]); ci++)
            for (const xccl_algo_t *const *a = same_bits; *a; a++) {
                bitwise_case(*a, n, counts[ci], XCCL_FLOAT32, &rng);
                if (ci == 2) bitwise_case(*a, n, counts[ci], XCCL_FLOAT64, &rng);
            }
    }
}

static void sweep_allgather(void)
{
    for (size_t si = 0; si < NSIZES; si++) {
        int    n = sizes[si], nc;
        size_t counts[8];

        nc = counts_for(n, counts);
        for (int ci = 0; ci < nc; ci++) {
            for (size_t di = 0; di < NDTYPES; di++) {
                /* data movement only: the largest count with two element sizes is enough */
                if (counts[ci] == 65537 && dtypes[di] != XCCL_INT32 && dtypes[di] != XCCL_UINT8)
                    continue;
                for (const xccl_algo_t *const *a = allgather_algos; *a; a++)
                    allgather_case(*a, n, counts[ci], dtypes[di], di == 0);
            }
        }
    }
}

/* reduce_scatter with rbuf inside sbuf (block r), as NCCL's in-place form. */
static void sweep_reduce_scatter_alias(void)
{
    int n_list[] = {2, 3, 5, 8};

    for (size_t i = 0; i < sizeof(n_list) / sizeof(n_list[0]); i++) {
        red_case_t c1, c2;
        red_case_init(&c1, n_list[i], 37, XCCL_FLOAT32, XCCL_OP_SUM);
        red_case_init(&c2, n_list[i], 1, XCCL_INT32, XCCL_OP_MAX);
        for (const xccl_algo_t *const *a = reduce_scatter_algos; *a; a++) {
            reduce_scatter_case(*a, &c1, 0, 1);
            reduce_scatter_case(*a, &c2, 0, 1);
        }
        red_case_free(&c1);
        red_case_free(&c2);
    }
}

/* Chunked algorithms with tiny chunks, set through their chunk variable `env`: many chunks in
 * flight (ring: lag-2 rounds; owner: many rounds, chunks of uneven blocks, empty chunks when a
 * block has fewer elements than there are chunks). `traffic`: compare messages with the cost;
 * `ag`: the all_gather of the family, if any. */
static void sweep_chunks(const char *env, const xccl_algo_t *ar, const xccl_algo_t *rs,
                         const xccl_algo_t *ag, int traffic)
{
    /* chunk bytes, and the largest count to run with them */
    const struct {
        const char *bytes;
        size_t      max_count;
    } chunks[] = {{"1", 100}, {"24", 1000}, {"4096", 65537}};
    const size_t cnts[] = {1, 7, 100, 1000, 65537};

    for (size_t k = 0; k < sizeof(chunks) / sizeof(chunks[0]); k++) {
        setenv(env, chunks[k].bytes, 1);
        for (size_t si = 0; si < NSIZES; si++) {
            for (size_t ci = 0; ci < sizeof(cnts) / sizeof(cnts[0]); ci++) {
                int        n     = sizes[si];
                size_t     count = cnts[ci];
                red_case_t c;
                if (count > chunks[k].max_count) continue;
                red_case_init(&c, n, count, XCCL_FLOAT32, XCCL_OP_SUM);
                allreduce_case(ar, &c, traffic);
                reduce_scatter_case(rs, &c, traffic, 0);
                reduce_scatter_case(rs, &c, 0, 1); /* result written over its input block */
                red_case_free(&c);
                red_case_init(&c, n, count, XCCL_UINT8, XCCL_OP_BXOR);
                allreduce_case(ar, &c, 0);
                red_case_free(&c);
                red_case_init(&c, n, count, XCCL_INT32, XCCL_OP_PROD);
                reduce_scatter_case(rs, &c, 0, 0);
                red_case_free(&c);
                if (ag != NULL) allgather_case(ag, n, count, XCCL_FLOAT64, 0);
            }
        }
    }
    unsetenv(env);
}

/* Algorithms that promise rank order, ((x0 + x1) + x2) + ..., on float32 values whose sums
 * round (so another order gives other bits): the reference is that sum computed here. */
static void sweep_rank_order(void)
{
    const xccl_algo_t *ar[] = {&xccl_algo_allreduce_direct, &xccl_algo_allreduce_owner};
    const xccl_algo_t *rs[] = {&xccl_algo_reduce_scatter_direct,
                               &xccl_algo_reduce_scatter_owner};
    const int          ns[] = {3, 5, 8};

    setenv(XCCL_PAT_OWNER_CHUNK_ENV, "64", 1);
    for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++) {
        int        n = ns[ni];
        size_t     count = 301;
        red_case_t c;
        red_case_init(&c, n, count, XCCL_FLOAT32, XCCL_OP_SUM);
        for (size_t i = 0; i < (size_t)n * count; i++) {
            float acc = 0;
            for (int r = 0; r < n; r++) {
                /* values of very different magnitude: the order of the sum shows */
                uint64_t h = (uint64_t)(r + 1) * 0x9e3779b97f4a7c15ull ^ (uint64_t)i * 0xbf58476du;
                float    v = (float)((h >> 20) % 100000) / 7.0f * (r % 2 ? 1e4f : 1e-3f);
                ((float *)c.in[r])[i] = v;
                acc                   = r == 0 ? v : acc + v;
            }
            ((float *)c.ref)[i] = acc;
        }
        for (size_t k = 0; k < 2; k++) {
            allreduce_case(ar[k], &c, 0);
            reduce_scatter_case(rs[k], &c, 0, 0);
        }
        red_case_free(&c);
    }
    unsetenv(XCCL_PAT_OWNER_CHUNK_ENV);
}

/* =============================================================================================
 * The simulator itself: deadlocks and misuse are reported
 * ============================================================================================= */

static char sim_bufs[2][8];

/* Both ranks only receive: a deadlock. */
static xccl_status_t deadlock_progress(xccl_task_t *t)
{
    uint64_t *w = xccl_task_state(t);
    int       r = xccl_task_rank(t);

    if (w[0]++ == 0) {
        xccl_status_t st = xccl_task_irecv(t, 1 - r, sim_bufs[r], 4, 7);
        if (st != XCCL_OK) return st;
    }
    return xccl_task_test(t);
}

/* Rank 0 receives into the buffer it is sending from. */
static xccl_status_t overlap_progress(xccl_task_t *t)
{
    int           r = xccl_task_rank(t);
    xccl_status_t st;

    if (xccl_task_state(t)[0]++ == 0) {
        st = xccl_task_isend(t, 1 - r, sim_bufs[r], 8, 1);
        if (st == XCCL_OK && r == 0) st = xccl_task_irecv(t, 1, sim_bufs[0] + 4, 4, 1);
        if (st == XCCL_OK && r == 1) st = xccl_task_irecv(t, 0, sim_bufs[1], 8, 1);
        if (st != XCCL_OK) return st;
    }
    return xccl_task_test(t);
}

/* Sizes differ between the two sides. */
static xccl_status_t size_progress(xccl_task_t *t)
{
    int r = xccl_task_rank(t);

    if (xccl_task_state(t)[0]++ == 0) {
        xccl_status_t st = r == 0 ? xccl_task_isend(t, 1, sim_bufs[0], 8, 3)
                                  : xccl_task_irecv(t, 0, sim_bufs[1], 4, 3);
        if (st != XCCL_OK) return st;
    }
    return xccl_task_test(t);
}

/* Returns XCCL_OK at once, leaving its send behind. */
static xccl_status_t early_progress(xccl_task_t *t)
{
    if (xccl_task_rank(t) == 0) (void)xccl_task_isend(t, 1, sim_bufs[0], 8, 0);
    return XCCL_OK;
}

/* Sub-tasks (xccl_task_sub) on the simulator. */
static int32_t  sub_vals[8][5];
static int      sub_seen_pending;
static const uint32_t sub_span = 1u << 16;

/* Pairs (2i, 2i+1) all-reduce with "rd", members listed high rank first, in steps from 100;
 * then every rank all-reduces with "hier" (itself running sub-tasks) over the ranks in reverse
 * order, from step 1 << 17. */
static xccl_status_t sub_ok_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    uint64_t               *w = xccl_task_state(t);
    int                     r = xccl_task_rank(t), n = xccl_task_size(t), map[8];
    xccl_coll_args_t        s = *a;
    xccl_status_t           st;

    s.coll = XCCL_COLL_ALLREDUCE;
    s.sbuf = s.rbuf = sub_vals[r];
    if (w[0] == 0) {
        map[0] = r | 1;
        map[1] = r & ~1;
        st     = xccl_task_sub(t, 2, &xccl_algo_allreduce_rd, &s, map, 2, 100, 50);
        if (st == XCCL_INPROGRESS)
            sub_seen_pending |= xccl_task_pending(t) > 0 && xccl_task_test(t) == XCCL_INPROGRESS;
        if (st != XCCL_OK) return st;
        w[0] = 1;
    }
    for (int i = 0; i < n; i++) map[i] = n - 1 - i;
    return xccl_task_sub(t, 0, &xccl_algo_allreduce_hier, &s, map, n, 1u << 17, sub_span);
}

/* A sub-task whose algorithm posts a step beyond its span. */
static xccl_status_t sub_big_step_progress(xccl_task_t *t)
{
    if (xccl_task_state(t)[0]++ == 0) {
        xccl_status_t st = xccl_task_isend(t, 1 - xccl_task_rank(t), sim_bufs[0], 8, 10);
        if (st != XCCL_OK) return st;
    }
    return xccl_task_test(t);
}

static const xccl_algo_t sub_big_step = {.name = "big_step", .progress = sub_big_step_progress};

static xccl_status_t sub_bad_progress(xccl_task_t *t)
{
    int map[2] = {0, 1};

    return xccl_task_sub(t, 0, &sub_big_step, xccl_task_args(t), map, 2, 0, 10);
}

/* Returns XCCL_OK while its sub-task still runs. */
static xccl_status_t sub_left_progress(xccl_task_t *t)
{
    int           map[2] = {0, 1};
    xccl_status_t st = xccl_task_sub(t, 0, &sub_big_step, xccl_task_args(t), map, 2, 0, 100);

    return st < 0 ? st : XCCL_OK;
}

/* A sub-task whose members do not include the caller. */
static xccl_status_t sub_outside_progress(xccl_task_t *t)
{
    int map[2] = {2, 3};

    if (xccl_task_rank(t) != 0) return XCCL_OK;
    return xccl_task_sub(t, 0, &xccl_algo_allreduce_rd, xccl_task_args(t), map, 2, 0, 100);
}

static void test_sim_sub(void)
{
    xccl_algo_t      algo = {.name = "parent", .coll = XCCL_COLL_ALLREDUCE};
    xccl_coll_args_t args[8];
    sim_result_t     res;
    sim_opts_t       opts = {.seed = 99};
    xccl_status_t    st;
    int              n = 6;

    memset(args, 0, sizeof(args));
    for (int r = 0; r < 8; r++) {
        args[r] = (xccl_coll_args_t){.coll   = XCCL_COLL_ALLREDUCE,
                                     .count  = 5,
                                     .dtype  = XCCL_INT32,
                                     .elsize = 4,
                                     .op     = XCCL_OP_SUM};
        for (int i = 0; i < 5; i++) sub_vals[r][i] = r * 10 + i;
    }
    algo.progress = sub_ok_progress;
    st            = sim_run(&algo, n, args, &opts, &res);
    CHECK_MSG(st == XCCL_OK, "sub-tasks: %s", res.error);
    for (int r = 0; st == XCCL_OK && r < n; r++)
        for (int i = 0; i < 5; i++) /* pairs first: (20p+1)*10 + 2i per pair, then all pairs */
            CHECK_MSG(sub_vals[r][i] == 2 * (n * (n - 1) / 2 * 10 + n * i),
                      "sub-tasks: rank %d [%d] = %d", r, i, sub_vals[r][i]);
    for (size_t m = 0; st == XCCL_OK && m < res.nmsgs; m++) {
        const sim_msg_t *g = &res.msgs[m];
        int pair = g->step >= 100 && g->step < 150;
        CHECK_MSG(pair ? (g->src ^ 1) == g->dst
                       : g->step >= 1u << 17 && g->step < (1u << 17) + sub_span,
                  "sub-tasks: %d -> %d step %u", g->src, g->dst, g->step);
    }
    CHECK(sub_seen_pending);
    sim_result_free(&res);

    algo.progress = sub_bad_progress;
    st            = sim_run(&algo, 2, args, NULL, &res);
    CHECK_MSG(st == XCCL_ERR_INTERNAL && strstr(res.error, "step 10 of 10") != NULL,
              "sub-task step: %s", res.error);
    sim_result_free(&res);

    algo.progress = sub_left_progress;
    st            = sim_run(&algo, 2, args, NULL, &res);
    CHECK_MSG(st == XCCL_ERR_INTERNAL && strstr(res.error, "sub-task big_step running") != NULL,
              "sub-task left running: %s", res.error);
    sim_result_free(&res);

    algo.progress = sub_outside_progress;
    st            = sim_run(&algo, 4, args, NULL, &res);
    CHECK_MSG(st == XCCL_ERR_INTERNAL && strstr(res.error, "without it") != NULL,
              "sub-task outside: %s", res.error);
    sim_result_free(&res);
}

/* Every all_reduce and broadcast run as a sub-task over the ranks in reverse order, its steps
 * offset and confined to a narrow span (chunked schedules must fit their chunks to it). */
static const xccl_algo_t *wrapped;
static const uint32_t     wrap_base = 7, wrap_span = 40;

static xccl_status_t wrapper_progress(xccl_task_t *t)
{
    int map[MAXN], n = xccl_task_size(t);

    for (int i = 0; i < n; i++) map[i] = n - 1 - i;
    return xccl_task_sub(t, 0, wrapped, xccl_task_args(t), map, n, wrap_base, wrap_span);
}

static void test_as_subtask(void)
{
    static const int    ns[]     = {1, 2, 3, 5, 8};
    static const size_t counts[] = {1, 37, 1000};
    xccl_algo_t         wrapper  = {.name = "wrapper", .progress = wrapper_progress};

    setenv(XCCL_PAT_RING_CHUNK_ENV, "64", 1);
    for (int c = 0; c < 2; c++) {
        xccl_coll_t               coll = c ? XCCL_COLL_BROADCAST : XCCL_COLL_ALLREDUCE;
        const xccl_algo_t *const *list = xccl_algo_list(coll);
        for (int k = 0; list[k] != NULL; k++)
            for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++)
                for (size_t ci = 0; ci < sizeof(counts) / sizeof(counts[0]); ci++) {
                    int              n = ns[ni], root = n / 2, origin = n - 1 - root;
                    size_t           count = counts[ci];
                    int32_t         *buf[MAXN];
                    xccl_coll_args_t args[MAXN];
                    sim_result_t     res;
                    char             what[128];

                    snprintf(what, sizeof(what), "%s %s as a sub-task n=%d count=%zu",
                             xccl_coll_name(coll), list[k]->name, n, count);
                    wrapped      = list[k];
                    wrapper.coll = coll;
                    for (int r = 0; r < n; r++) {
                        buf[r] = alloc_buf(count * 4, 0);
                        for (size_t i = 0; i < count; i++)
                            buf[r][i] = c && r != origin ? -1 : (int32_t)(r * 100 + (int)i);
                        args[r] = (xccl_coll_args_t){.coll   = coll,
                                                     .sbuf   = buf[r],
                                                     .rbuf   = buf[r],
                                                     .count  = count,
                                                     .dtype  = XCCL_INT32,
                                                     .elsize = 4,
                                                     .op     = XCCL_OP_SUM,
                                                     .root   = root};
                    }
                    if (list[k]->applicable != NULL && !list[k]->applicable(&args[0], n)) {
                        for (int r = 0; r < n; r++) free(buf[r]);
                        continue;
                    }
                    if (run(&wrapper, n, args, &res, what)) {
                        for (int r = 0; r < n; r++)
                            for (size_t i = 0; i < count; i++) {
                                int32_t want = c ? origin * 100 + (int)i
                                                 : 100 * n * (n - 1) / 2 + n * (int)i;
                                if (buf[r][i] != want) {
                                    CHECK_MSG(0, "%s: rank %d [%zu] = %d, want %d", what, r, i,
                                              buf[r][i], want);
                                    r = n;
                                    break;
                                }
                            }
                        for (size_t m = 0; m < res.nmsgs; m++)
                            CHECK_MSG(res.msgs[m].step >= wrap_base &&
                                          res.msgs[m].step < wrap_base + wrap_span,
                                      "%s: step %u", what, res.msgs[m].step);
                    }
                    sim_result_free(&res);
                    for (int r = 0; r < n; r++) free(buf[r]);
                }
    }
    unsetenv(XCCL_PAT_RING_CHUNK_ENV);
}

static void test_sim(void)
{
    xccl_algo_t      algo = {.name = "test", .coll = XCCL_COLL_BARRIER};
    xccl_coll_args_t args[2];
    sim_result_t     res;
    xccl_status_t    st;

    memset(args, 0, sizeof(args));
    algo.progress = deadlock_progress;
    st            = sim_run(&algo, 2, args, NULL, &res);
    CHECK_MSG(st == XCCL_ERR_INTERNAL && strstr(res.error, "deadlock") != NULL &&
                  strstr(res.error, "recv<- 1 step 7") != NULL,
              "deadlock: %d %s", st, res.error);
    sim_result_free(&res);

    algo.progress = overlap_progress;
    st            = sim_run(&algo, 2, args, NULL, &res);
    CHECK_MSG(st == XCCL_ERR_INTERNAL && strstr(res.error, "overlaps") != NULL, "overlap: %s",
              res.error);
    sim_result_free(&res);

    algo.progress = size_progress;
    st            = sim_run(&algo, 2, args, NULL, &res);
    CHECK_MSG(st == XCCL_ERR_INTERNAL && strstr(res.error, "matched") != NULL, "size: %s",
              res.error);
    sim_result_free(&res);

    algo.progress = early_progress;
    st            = sim_run(&algo, 2, args, NULL, &res);
    CHECK_MSG(st == XCCL_ERR_INTERNAL && strstr(res.error, "not tested") != NULL, "early: %s",
              res.error);
    sim_result_free(&res);
}

/* =============================================================================================
 * Registry and selection
 * ============================================================================================= */

static void test_registry(void)
{
    static const char *names[XCCL_COLL_COUNT] = {
        "all_reduce", "broadcast", "reduce",     "all_gather",   "gather",
        "scatter",    "reduce_scatter", "all_to_all", "all_to_all_v", "barrier"};

    for (int c = 0; c < XCCL_COLL_COUNT; c++) {
        const xccl_algo_t *const *list = xccl_algo_list((xccl_coll_t)c);
        int                       k    = 0;

        CHECK_MSG(strcmp(xccl_coll_name((xccl_coll_t)c), names[c]) == 0, "coll %d: %s", c,
                  xccl_coll_name((xccl_coll_t)c));
        for (; list[k] != NULL; k++) {
            const xccl_algo_t *a = list[k];
            xccl_cost_t        cost;
            CHECK_MSG(a->coll == (xccl_coll_t)c && a->name && a->summary && a->cost && a->progress,
                      "%s/%s incomplete", names[c], a->name);
            CHECK(xccl_algo_find((xccl_coll_t)c, a->name) == a);
            for (int j = 0; j < k; j++) CHECK(strcmp(list[j]->name, a->name) != 0);
            a->cost(8, 1 << 20, &cost);
            CHECK_MSG(cost.steps >= 1 && cost.bytes >= 0 && cost.reduce_bytes >= 0,
                      "%s/%s: cost %g %g %g", names[c], a->name, cost.steps, cost.bytes,
                      cost.reduce_bytes);
        }
        CHECK_MSG(k >= 2, "%s: %d algorithms", names[c], k);
        CHECK(xccl_algo_find((xccl_coll_t)c, "nope") == NULL);
    }
    CHECK(strcmp(xccl_coll_name(XCCL_COLL_COUNT), "?") == 0);
    CHECK(xccl_algo_list(XCCL_COLL_COUNT)[0] == NULL);
    CHECK(xccl_algo_find(XCCL_COLL_ALLREDUCE, "rabenseifner") == &xccl_algo_allreduce_rabenseifner);
    {
        xccl_cost_model_t m = {1, 2, 3, 0};
        xccl_cost_t       c;
        xccl_algo_allreduce_ring.cost(4, 4000, &c);
        CHECK(fabs(xccl_algo_predict(&xccl_algo_allreduce_ring, &m, 4, 4000) -
                   (c.steps + 2 * c.bytes + 3 * c.reduce_bytes)) < 1e-9);
    }
}

/* The policy table the core calls (core/task.h) is the registry and the selector of this
 * layer: same lists, same lookups, same choices and the memo in front of them. */
static void test_policy(void)
{
    const xccl_algo_policy_t *p = &xccl_algo_policy;
    xccl_cost_model_t         lat = {1e-3, 1e-12, 1e-12, 0}, bw = {1e-9, 1e-6, 1e-9, 0};
    static xccl_algo_memo_t   memo;

    CHECK(p->select != NULL && p->list != NULL && p->find != NULL && p->predict != NULL);
    for (int c = 0; c <= XCCL_COLL_COUNT; c++) {
        const xccl_algo_t *const *list = p->list((xccl_coll_t)c);
        CHECK(list == xccl_algo_list((xccl_coll_t)c) || (c == XCCL_COLL_COUNT && list[0] == NULL));
        for (int k = 0; list[k] != NULL; k++)
            CHECK(p->find((xccl_coll_t)c, list[k]->name) == list[k]);
    }
    for (int i = 0; i < 2; i++) {
        const xccl_cost_model_t *m = i ? &bw : &lat;
        xccl_coll_args_t         a = {.coll   = XCCL_COLL_ALLREDUCE,
                                      .count  = 1 << 20,
                                      .dtype  = XCCL_FLOAT32,
                                      .elsize = 4,
                                      .op     = XCCL_OP_SUM};
        const xccl_algo_t       *want = NULL, *got = NULL, *again = NULL;
        CHECK(xccl_algo_select(&a, 8, 4 << 20, m, NULL, &want) == XCCL_OK);
        CHECK(p->select(NULL, &a, 8, 4 << 20, m, NULL, &got) == XCCL_OK && got == want);
        memset(&memo, 0, sizeof(memo));
        CHECK(p->select(&memo, &a, 8, 4 << 20, m, NULL, &again) == XCCL_OK && again == want);
        CHECK(p->select(&memo, &a, 8, 4 << 20, m, "rd", &again) == XCCL_OK &&
              again == &xccl_algo_allreduce_rd);
        CHECK(fabs(p->predict(want, &a, m, 8, 4 << 20) -
                   xccl_algo_predict(want, m, 8, 4 << 20)) < 1e-12);
    }
}

static xccl_coll_args_t sel_args(xccl_coll_t coll, size_t count)
{
    return (xccl_coll_args_t){.coll   = coll,
                              .count  = count,
                              .dtype  = XCCL_FLOAT32,
                              .elsize = 4,
                              .op     = XCCL_OP_SUM};
}

/* Selected algorithm's name, or the status as "!<code>". */
static const char *sel(xccl_coll_t coll, int size, size_t nbytes, const char *forced)
{
    static char              err[16];
    static xccl_cost_model_t m = {20e-6, 1.0 / 2e9, 1.0 / 4e9, 0};
    xccl_coll_args_t         a = sel_args(coll, nbytes / 4);
    const xccl_algo_t       *out = NULL;
    xccl_status_t            st = xccl_algo_select(&a, size, nbytes, &m, forced, &out);

    if (st != XCCL_OK) {
        snprintf(err, sizeof(err), "!%d", (int)st);
        return err;
    }
    return out->name;
}

static void set_algo_env(const char *v)
{
    if (v)
        setenv("XCCL_ALGO", v, 1);
    else
        unsetenv("XCCL_ALGO");
    xccl_algo_reset_env();
}

/* The same on one node whose receivers pull or not, with ranks outnumbering CPUs or not. */
static const char *sel_node(xccl_coll_t coll, int size, size_t nbytes, int pull, int scarce,
                            const char *forced)
{
    static char              err[16];
    static xccl_cost_model_t m       = {2e-6, 1.0 / 6e9, 1.0 / 4e9, 0};
    static int               zero[8] = {0};
    xccl_topo_t              topo = {.nnodes = 1, .node_of = zero, .pull = pull, .scarce = scarce};
    xccl_coll_args_t         a    = sel_args(coll, nbytes / 4);
    const xccl_algo_t       *out  = NULL;
    xccl_status_t            st;

    topo.intra = topo.inter = m;
    a.topo                  = &topo;
    st                      = xccl_algo_select(&a, size, nbytes, &m, forced, &out);
    if (st != XCCL_OK) {
        snprintf(err, sizeof(err), "!%d", (int)st);
        return err;
    }
    return out->name;
}

#define SEL_IS(want, ...)                                                                   \
    do {                                                                                    \
        const char *got_ = sel(__VA_ARGS__);                                                \
        CHECK_MSG(strcmp(got_, (want)) == 0, "select(%s) = %s, want %s (%s)", #__VA_ARGS__, \
                  got_, (want), xccl_last_error());                                         \
    } while (0)

static void test_select(void)
{
    xccl_cost_model_t  lat = {1, 0, 0, 0}, bw = {0, 1, 0, 0};
    xccl_coll_args_t   a   = sel_args(XCCL_COLL_ALLREDUCE, 1 << 20);
    const xccl_algo_t *out;
    char               inv[16];

    snprintf(inv, sizeof(inv), "!%d", (int)XCCL_ERR_INVALID_ARG);
    set_algo_env(NULL);

    /* the model: latency-bound picks the fewest steps, bandwidth-bound the fewest bytes */
    CHECK(xccl_algo_select(&a, 64, 4 << 20, &lat, NULL, &out) == XCCL_OK &&
          out == &xccl_algo_allreduce_rd);
    CHECK(xccl_algo_select(&a, 8, 4 << 20, &lat, NULL, &out) == XCCL_OK &&
          out == &xccl_algo_allreduce_direct);
    CHECK(xccl_algo_select(&a, 8, 4 << 20, &bw, NULL, &out) == XCCL_OK &&
          out == &xccl_algo_allreduce_ring);
    CHECK(xccl_algo_select(&a, 6, 4 << 20, &bw, NULL, &out) == XCCL_OK &&
          out == &xccl_algo_allreduce_ring);
    CHECK(xccl_algo_select(&a, 3, 4, &lat, NULL, &out) == XCCL_OK &&
          out == &xccl_algo_allreduce_direct);
    CHECK(xccl_algo_select(&a, 8, 4 << 20, NULL, NULL, &out) == XCCL_OK && out != NULL);
    a = sel_args(XCCL_COLL_ALLGATHER, 1 << 20);
    CHECK(xccl_algo_select(&a, 48, 4 << 20, &lat, NULL, &out) == XCCL_OK &&
          out == &xccl_algo_allgather_bruck);
    CHECK(xccl_algo_select(&a, 6, 4 << 20, &lat, NULL, &out) == XCCL_OK &&
          out == &xccl_algo_allgather_direct);
    SEL_IS("direct", XCCL_COLL_ALLREDUCE, 3, 8, NULL);
    /* on one node the two-level algorithms degenerate to more rounds than a one-level one of
     * the same bytes: never the model's choice, but they run when asked for */
    for (int n = 2; n <= 16; n++)
        for (size_t nb = 4; nb <= (size_t)256 << 20; nb *= 16) {
            const char *got = sel(XCCL_COLL_ALLREDUCE, n, nb, "auto");
            CHECK_MSG(strncmp(got, "hier", 4) != 0, "n=%d %zu B: %s", n, nb, got);
        }
    SEL_IS("hier_rs", XCCL_COLL_ALLREDUCE, 6, 64 << 20, "hier_rs");
    SEL_IS("hier", XCCL_COLL_ALLREDUCE, 6, 64, "hier");
    /* the model; from 16 MiB on 2 to 4 ranks of one host the measured built-in rule picks
     * owner (select.c; not measured above) */
    SEL_IS("rabenseifner", XCCL_COLL_ALLREDUCE, 8, 64 << 20, "auto");
    SEL_IS("rabenseifner", XCCL_COLL_ALLREDUCE, 8, 64 << 20, NULL);
    SEL_IS("owner", XCCL_COLL_ALLREDUCE, 2, 64 << 20, NULL);
    SEL_IS("owner", XCCL_COLL_ALLREDUCE, 2, 16 << 20, NULL);
    SEL_IS("owner", XCCL_COLL_ALLREDUCE, 4, 16 << 20, NULL);
    SEL_IS("ring", XCCL_COLL_ALLREDUCE, 6, 16 << 20, NULL);
    SEL_IS("ring", XCCL_COLL_ALLREDUCE, 6, (16 << 20) - 1, NULL);
    SEL_IS("bruck", XCCL_COLL_ALLGATHER, 48, 64 << 20, NULL);
    SEL_IS("direct", XCCL_COLL_ALLGATHER, 12, 64 << 20, NULL);
    SEL_IS("ring", XCCL_COLL_REDUCE_SCATTER, 12, 64 << 20, "auto");
    SEL_IS("ring", XCCL_COLL_REDUCE_SCATTER, 12, 64 << 20, NULL);
    SEL_IS("owner", XCCL_COLL_REDUCE_SCATTER, 2, 64 << 20, NULL);
    /* all_to_all: the model posts every exchange at once, at every size (no rule) */
    SEL_IS("linear", XCCL_COLL_ALLTOALL, 4, 64 << 10, NULL);
    SEL_IS("linear", XCCL_COLL_ALLTOALL, 8, 2 << 20, NULL);
    SEL_IS("linear", XCCL_COLL_ALLTOALL, 4, 64 << 20, NULL);
    SEL_IS("linear", XCCL_COLL_ALLTOALL, 4, 64 << 20, "auto");
    SEL_IS("linear", XCCL_COLL_ALLTOALLV, 4, 64 << 20, NULL);

    /* ranks outnumbering CPUs (topo->scarce): the measured rules for shared memory (pull);
     * tcp keeps the model's choices */
    {
        static const struct {
            size_t      nbytes;
            const char *want;
        } cases[] = {
            {8, "direct"},       {(64 << 10) - 4, "direct"},
            {64 << 10, "owner"}, {(1 << 20) - 4, "owner"},
            {1 << 20, NULL}, /* NULL: the model's choice */
            {(2 << 20) - 4, NULL},
            {2 << 20, "ring"},   {(16 << 20) - 4, "ring"},
            {16 << 20, "owner"},
        };
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
            const size_t n        = cases[i].nbytes;
            const char  *shm      = sel_node(XCCL_COLL_ALLREDUCE, 4, n, 1, 1, NULL);
            const char  *tcp      = sel_node(XCCL_COLL_ALLREDUCE, 4, n, 0, 1, NULL);
            const char  *tcp_cpus = sel_node(XCCL_COLL_ALLREDUCE, 4, n, 0, 0, NULL);
            const char  *want =
                cases[i].want ? cases[i].want : sel_node(XCCL_COLL_ALLREDUCE, 4, n, 1, 1, "auto");
            CHECK_MSG(strcmp(shm, want) == 0, "all_reduce %zu B shm scarce: %s", n, shm);
            CHECK_MSG(strcmp(tcp, tcp_cpus) == 0, "all_reduce %zu B tcp scarce: %s, not %s", n, tcp,
                      tcp_cpus);
        }
        CHECK(strcmp(sel_node(XCCL_COLL_BROADCAST, 4, 4 << 20, 0, 1, NULL),
                     sel_node(XCCL_COLL_BROADCAST, 4, 4 << 20, 0, 0, NULL)) == 0);
        /* a CPU per rank: none of the scarce rules, so below the other rules' sizes the
         * model's choice */
        for (size_t n = 8; n < (size_t)16 << 20; n *= 4) {
            for (int pull = 0; pull <= 1; pull++) {
                const char *got  = sel_node(XCCL_COLL_ALLREDUCE, 4, n, pull, 0, NULL);
                const char *want = sel_node(XCCL_COLL_ALLREDUCE, 4, n, pull, 0, "auto");
                CHECK_MSG(strcmp(got, want) == 0, "all_reduce %zu B pull %d: %s, model %s", n, pull,
                          got, want);
            }
            CHECK(strcmp(sel_node(XCCL_COLL_BROADCAST, 4, n, 0, 0, NULL),
                         sel_node(XCCL_COLL_BROADCAST, 4, n, 0, 0, "auto")) == 0);
        }
    }

    /* forced per call; "auto" means the model */
    SEL_IS("rabenseifner", XCCL_COLL_ALLREDUCE, 8, 64, "rabenseifner");
    SEL_IS("bruck", XCCL_COLL_ALLGATHER, 5, 64, "bruck");
    SEL_IS("ring", XCCL_COLL_ALLREDUCE, 6, 64 << 20, "auto");
    SEL_IS(inv, XCCL_COLL_ALLREDUCE, 8, 64, "rign");
    CHECK_MSG(strstr(xccl_last_error(), "'rign'") &&
                  strstr(xccl_last_error(), "ring, rd, rabenseifner, direct"),
              "%s", xccl_last_error());
    /* not applicable: direct would need (n-1) x 1 GiB of scratch */
    SEL_IS(inv, XCCL_COLL_ALLREDUCE, 8, (size_t)1 << 30, "direct");
    CHECK_MSG(strstr(xccl_last_error(), "'direct'") && strstr(xccl_last_error(), "cannot run"),
              "%s", xccl_last_error());
    SEL_IS(inv, XCCL_COLL_REDUCE_SCATTER, 8, (size_t)1 << 32, "direct");

    /* $XCCL_ALGO: ranges inclusive, suffixes, names without underscores, first match wins */
    set_algo_env(" allreduce:0-1k = direct ; all_reduce:1k-64K=rd;ALL_REDUCE:0-inf=ring;"
                 "reduce_scatter=rhd;allgather:2m-2M=ring;;");
    SEL_IS("direct", XCCL_COLL_ALLREDUCE, 8, 0, NULL);
    SEL_IS("direct", XCCL_COLL_ALLREDUCE, 8, 1024, NULL);
    SEL_IS("rd", XCCL_COLL_ALLREDUCE, 8, 1025, NULL);
    SEL_IS("rd", XCCL_COLL_ALLREDUCE, 8, 65536, NULL);
    SEL_IS("ring", XCCL_COLL_ALLREDUCE, 8, 65537, NULL);
    SEL_IS("rhd", XCCL_COLL_REDUCE_SCATTER, 3, 12, NULL);
    SEL_IS("ring", XCCL_COLL_ALLGATHER, 8, 2 << 20, NULL);
    SEL_IS("ring", XCCL_COLL_ALLGATHER, 6, 2 << 20, NULL);
    SEL_IS("direct", XCCL_COLL_ALLGATHER, 6, (2 << 20) + 1, NULL); /* no rule: the model */
    SEL_IS("rd", XCCL_COLL_ALLREDUCE, 8, 2048, NULL);
    SEL_IS("rabenseifner", XCCL_COLL_ALLREDUCE, 8, 2048, "rabenseifner"); /* call beats env */

    set_algo_env("alltoallv=linear;barrier=linear;all_to_all:0-inf=bruck;broadcast=auto");
    SEL_IS("linear", XCCL_COLL_ALLTOALLV, 4, 100, NULL);
    SEL_IS("linear", XCCL_COLL_BARRIER, 4, 0, NULL);
    SEL_IS("bruck", XCCL_COLL_ALLTOALL, 4, 100, NULL);
    CHECK(strcmp(sel(XCCL_COLL_BROADCAST, 4, 100, NULL), "!") > 0);

    /* an unknown or inapplicable algorithm fails the collectives its rule matches only */
    set_algo_env("allreduce:0-100=nope;allreduce:101-inf=direct");
    SEL_IS(inv, XCCL_COLL_ALLREDUCE, 4, 100, NULL);
    CHECK_MSG(strstr(xccl_last_error(), "'nope'") && strstr(xccl_last_error(), "XCCL_ALGO") &&
                  strstr(xccl_last_error(), "ring, rd, rabenseifner, direct"),
              "%s", xccl_last_error());
    SEL_IS("direct", XCCL_COLL_ALLREDUCE, 4, 4096, NULL);
    SEL_IS(inv, XCCL_COLL_ALLREDUCE, 4, (size_t)1 << 30, NULL);
    SEL_IS("binomial", XCCL_COLL_BROADCAST, 4, 100, "binomial");
    CHECK(sel(XCCL_COLL_BROADCAST, 4, 100, NULL)[0] != '!');

    /* malformed: every collective fails, naming the rule */
    {
        const char *bad[] = {"allreduce:1k=ring",    "bogus=ring",
                             "allreduce:2k-1k=ring", "allreduce=",
                             "allreduce:1x-2k=ring", "allreduce ring",
                             "allreduce:-5-10=ring", "allreduce=name_far_too_long_for_an_algorithm"};
        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
            set_algo_env(bad[i]);
            SEL_IS(inv, XCCL_COLL_BARRIER, 4, 0, NULL);
            CHECK_MSG(strstr(xccl_last_error(), "XCCL_ALGO") != NULL, "%s: %s", bad[i],
                      xccl_last_error());
        }
    }

    /* parsed once: a change is seen only after the reset */
    set_algo_env("allreduce=rd");
    SEL_IS("rd", XCCL_COLL_ALLREDUCE, 6, 64 << 20, NULL);
    setenv("XCCL_ALGO", "allreduce=direct", 1);
    SEL_IS("rd", XCCL_COLL_ALLREDUCE, 6, 64 << 20, NULL);
    xccl_algo_reset_env();
    SEL_IS("direct", XCCL_COLL_ALLREDUCE, 6, 64 << 10, NULL);
    set_algo_env("allreduce:1m-inf=auto");
    SEL_IS("ring", XCCL_COLL_ALLREDUCE, 6, 64 << 20, NULL); /* a rule's "auto": the model */
    set_algo_env(NULL);
    SEL_IS("owner", XCCL_COLL_ALLREDUCE, 2, 64 << 20, NULL);
}

/* Memoised selection gives xccl_algo_select's answers: for call shapes repeated and
 * interleaved (more than the slots, so slots get replaced), for shapes that differ only in
 * what `applicable` reads, after $XCCL_ALGO changes, and never remembers an error or a forced
 * choice. */
static void test_select_memo(void)
{
    static xccl_algo_memo_t memo; /* zeroed, as in a new communicator */
    xccl_cost_model_t       m        = {20e-6, 1.0 / 2e9, 1.0 / 4e9, 0};
    const xccl_coll_t       colls[]  = {XCCL_COLL_ALLREDUCE, XCCL_COLL_ALLGATHER,
                                        XCCL_COLL_REDUCE_SCATTER, XCCL_COLL_BROADCAST,
                                        XCCL_COLL_ALLTOALL};
    const char             *envs[]   = {NULL, NULL, "allreduce=rd;allgather:0-1m=ring", NULL};
    const xccl_algo_t      *want, *got;
    xccl_coll_args_t        a;
    int                     compared = 0;

    for (int pass = 0; pass < 4; pass++) {
        set_algo_env(envs[pass]);
        for (size_t c = 0; c < sizeof(colls) / sizeof(colls[0]); c++)
            for (int k = 0; k <= 28; k += 2)
                for (size_t el = 4; el <= 8; el += 4) {
                    size_t        nbytes = (size_t)8 << k;
                    xccl_status_t s1, s2;
                    a        = sel_args(colls[c], nbytes / el);
                    a.elsize = el;
                    want = got = NULL;
                    s1 = xccl_algo_select(&a, 6, nbytes, &m, NULL, &want);
                    s2 = xccl_algo_select_memo(&memo, &a, 6, nbytes, &m, NULL, &got);
                    CHECK_MSG(s1 == XCCL_OK && s2 == XCCL_OK && got == want,
                              "pass %d coll %d nbytes %zu: %s vs %s", pass, (int)colls[c], nbytes,
                              want ? want->name : "-", got ? got->name : "-");
                    compared++;
                }
    }
    CHECK(compared == 4 * 5 * 15 * 2);

    /* same nbytes, but a count direct cannot take: not the remembered direct */
    set_algo_env(NULL);
    a = sel_args(XCCL_COLL_ALLREDUCE, 16);
    CHECK(xccl_algo_select_memo(&memo, &a, 6, 64, &m, NULL, &got) == XCCL_OK &&
          got == &xccl_algo_allreduce_direct);
    a.count = (size_t)1 << 30;
    CHECK(xccl_algo_select_memo(&memo, &a, 6, 64, &m, NULL, &got) == XCCL_OK &&
          got != &xccl_algo_allreduce_direct);
    /* a forced choice passes by the memo both ways */
    a = sel_args(XCCL_COLL_ALLREDUCE, 16);
    CHECK(xccl_algo_select_memo(&memo, &a, 6, 64, &m, "ring", &got) == XCCL_OK &&
          got == &xccl_algo_allreduce_ring);
    CHECK(xccl_algo_select_memo(&memo, &a, 6, 64, &m, NULL, &got) == XCCL_OK &&
          got == &xccl_algo_allreduce_direct);
    /* errors are not remembered */
    set_algo_env("allreduce=nope");
    CHECK(xccl_algo_select_memo(&memo, &a, 6, 64, &m, NULL, &got) == XCCL_ERR_INVALID_ARG);
    CHECK(xccl_algo_select_memo(&memo, &a, 6, 64, &m, NULL, &got) == XCCL_ERR_INVALID_ARG);
    set_algo_env(NULL);
    CHECK(xccl_algo_select_memo(&memo, &a, 6, 64, &m, NULL, &got) == XCCL_OK &&
          got == &xccl_algo_allreduce_direct);
}

int main(void)
{
    unsetenv(XCCL_PAT_RING_CHUNK_ENV);
    unsetenv(XCCL_PAT_OWNER_CHUNK_ENV);
    unsetenv("XCCL_ALGO");
    test_patterns();
    test_sim();
    test_sim_sub();
    test_as_subtask();
    test_registry();
    test_policy();
    test_select();
    test_select_memo();
    sweep_reductions();
    sweep_bitwise();
    sweep_allgather();
    sweep_reduce_scatter_alias();
    sweep_chunks(XCCL_PAT_RING_CHUNK_ENV, &xccl_algo_allreduce_ring,
                 &xccl_algo_reduce_scatter_ring, &xccl_algo_allgather_ring, 0);
    sweep_chunks(XCCL_PAT_OWNER_CHUNK_ENV, &xccl_algo_allreduce_owner,
                 &xccl_algo_reduce_scatter_owner, NULL, 1);
    sweep_rank_order();
    CTEST_MAIN_END("test_algos");
}
