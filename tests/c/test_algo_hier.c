/* SPDX-License-Identifier: Apache-2.0
 *
 * test_algo_hier.c - the two-level all_reduce and broadcast (csrc/algo/hier.c) on the
 * simulator, over many node layouts: blocks, round-robin, uneven, singletons.
 *
 * Inputs are small integers, so every order of reduction gives the same bits; references are
 * computed here in int64 / double. Beyond the results, the traffic is checked: only one rank
 * per node may send across nodes, and exactly as many messages as the schedule says cross
 * (recursive doubling among the leaders with the fold; a binomial tree for broadcast). The
 * selection test prices hier against the one-level algorithms with slow links between nodes.
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

extern const xccl_algo_t xccl_algo_allreduce_hier, xccl_algo_allreduce_hier_rs,
    xccl_algo_broadcast_hier;

#define MAXN 16

typedef enum { L_NONE, L_BLOCK2, L_BLOCK3, L_RR2, L_RR3, L_UNEVEN, L_PAIR, L_COUNT } layout_t;

static const char *layout_name[L_COUNT] = {"no topology",   "blocks of 2",   "blocks of 3",
                                           "round-robin 2", "round-robin 3", "1 + rest",
                                           "one pair"};

/* node_of for a layout, nodes numbered by their lowest rank; returns the node count. */
static int make_layout(layout_t l, int n, int *node_of)
{
    int raw[MAXN], map[MAXN], nn = 0;

    for (int r = 0; r < n; r++) {
        switch (l) {
        case L_NONE:
            raw[r] = 0;
            break;
        case L_BLOCK2:
            raw[r] = r / 2;
            break;
        case L_BLOCK3:
            raw[r] = r / 3;
            break;
        case L_RR2:
            raw[r] = r % 2;
            break;
        case L_RR3:
            raw[r] = r % 3;
            break;
        case L_UNEVEN:
            raw[r] = r == 0 ? 0 : 1;
            break;
        default:
            raw[r] = r <= 1 ? 0 : r;
            break; /* ranks 0,1 share a node, others alone */
        }
    }
    for (int i = 0; i < MAXN; i++)
        map[i] = -1;
    for (int r = 0; r < n; r++) {
        if (map[raw[r]] < 0) map[raw[r]] = nn++;
        node_of[r] = map[raw[r]];
    }
    return nn;
}

static int32_t value(int rank, size_t i)
{
    return (int32_t)((rank * 7 + (int)(i % 13) * 3) % 11) - 5;
}

static void check_allreduce(int n, layout_t l, size_t count, xccl_op_t op)
{
    int              node_of[MAXN];
    xccl_topo_t      topo = {0};
    xccl_coll_args_t args[MAXN];
    int32_t         *buf[MAXN];
    sim_result_t     res;
    sim_opts_t       opts = {.seed = (uint64_t)(n * 1000 + l * 10 + (int)count)};
    xccl_status_t    st;
    char             what[160];
    size_t           cross = 0;

    topo.nnodes  = make_layout(l, n, node_of);
    topo.node_of = node_of;
    snprintf(what, sizeof(what), "all_reduce hier n=%d (%s, %d nodes) count=%zu op=%d", n,
             layout_name[l], topo.nnodes, count, (int)op);
    for (int r = 0; r < n; r++) {
        buf[r] = malloc(count * sizeof(int32_t) + 1);
        for (size_t i = 0; i < count; i++)
            buf[r][i] = value(r, i);
        args[r] = (xccl_coll_args_t){.coll   = XCCL_COLL_ALLREDUCE,
                                     .sbuf   = buf[r],
                                     .rbuf   = buf[r],
                                     .count  = count,
                                     .dtype  = XCCL_INT32,
                                     .elsize = sizeof(int32_t),
                                     .op     = op,
                                     .topo   = l == L_NONE ? NULL : &topo};
    }
    st = sim_run(&xccl_algo_allreduce_hier, n, args, &opts, &res);
    CHECK_MSG(st == XCCL_OK, "%s: %s", what, res.error);
    for (size_t i = 0; st == XCCL_OK && i < count; i++) {
        int64_t want = op == XCCL_OP_MAX ? INT64_MIN : 0;
        for (int r = 0; r < n; r++) {
            int64_t v = value(r, i);
            want      = op == XCCL_OP_MAX ? (v > want ? v : want) : want + v;
        }
        for (int r = 0; r < n; r++) {
            if (buf[r][i] != (int32_t)want) {
                CHECK_MSG(0, "%s: rank %d element %zu = %d, want %lld", what, r, i, buf[r][i],
                          (long long)want);
                r = n;
                i = count;
            }
        }
    }
    /* only leaders (lowest rank of their node) cross, as often as the fold + doubling says */
    for (size_t m = 0; st == XCCL_OK && count > 0 && m < res.nmsgs; m++) {
        const sim_msg_t *g = &res.msgs[m];
        if (node_of[g->src] == node_of[g->dst]) continue;
        cross++;
        for (int r = 0; r < g->src; r++)
            CHECK_MSG(node_of[r] != node_of[g->src], "%s: non-leader %d sent across nodes", what,
                      g->src);
    }
    if (st == XCCL_OK && count > 0) {
        xccl_pat_fold_t f    = xccl_pat_fold(0, topo.nnodes);
        size_t          want = (size_t)(f.p * f.log_p + 2 * f.extra);
        CHECK_MSG(cross == want, "%s: %zu messages crossed nodes, want %zu", what, cross, want);
    }
    sim_result_free(&res);
    for (int r = 0; r < n; r++)
        free(buf[r]);
}

static void check_broadcast(int n, layout_t l, size_t count, int root)
{
    int              node_of[MAXN];
    xccl_topo_t      topo = {0};
    xccl_coll_args_t args[MAXN];
    double          *buf[MAXN];
    sim_result_t     res;
    sim_opts_t       opts = {.seed = (uint64_t)(n * 977 + root * 31 + l)};
    xccl_status_t    st;
    char             what[160];
    size_t           cross = 0;

    topo.nnodes  = make_layout(l, n, node_of);
    topo.node_of = node_of;
    snprintf(what, sizeof(what), "broadcast hier n=%d (%s, %d nodes) count=%zu root=%d", n,
             layout_name[l], topo.nnodes, count, root);
    for (int r = 0; r < n; r++) {
        buf[r] = malloc(count * sizeof(double) + 1);
        for (size_t i = 0; i < count; i++)
            buf[r][i] = r == root ? (double)i * 0.5 + root : -1.0;
        args[r] = (xccl_coll_args_t){.coll   = XCCL_COLL_BROADCAST,
                                     .sbuf   = buf[r],
                                     .rbuf   = buf[r],
                                     .count  = count,
                                     .dtype  = XCCL_FLOAT64,
                                     .elsize = sizeof(double),
                                     .op     = XCCL_OP_SUM,
                                     .root   = root,
                                     .topo   = l == L_NONE ? NULL : &topo};
    }
    st = sim_run(&xccl_algo_broadcast_hier, n, args, &opts, &res);
    CHECK_MSG(st == XCCL_OK, "%s: %s", what, res.error);
    for (int r = 0; st == XCCL_OK && r < n; r++) {
        for (size_t i = 0; i < count; i++) {
            if (buf[r][i] != (double)i * 0.5 + root) {
                CHECK_MSG(0, "%s: rank %d element %zu = %g", what, r, i, buf[r][i]);
                break;
            }
        }
    }
    for (size_t m = 0; st == XCCL_OK && m < res.nmsgs; m++)
        cross += node_of[res.msgs[m].src] != node_of[res.msgs[m].dst];
    if (st == XCCL_OK && count > 0)
        CHECK_MSG(cross == (size_t)(topo.nnodes - 1), "%s: %zu messages crossed nodes, want %d",
                  what, cross, topo.nnodes - 1);
    sim_result_free(&res);
    for (int r = 0; r < n; r++)
        free(buf[r]);
}

/* Every node as large as node 0 (hier_rs runs only then). */
static int equal_nodes(const int *node_of, int n, int nnodes)
{
    int L0 = 0;

    for (int r = 0; r < n; r++) L0 += node_of[r] == 0;
    return L0 * nnodes == n;
}

/* all_reduce hier_rs on random floats: the same bytes on every rank, within rounding of the
 * sum computed here; across nodes only the chunk all-reduce (phase B, steps [2S, 3S)) and the
 * tail (steps [5S, 6S)); with equal nodes and no tail, what crosses and what stays inside is
 * what cost_topo says. */
static void check_hier_rs(int n, layout_t l, size_t count, xccl_dtype_t dt)
{
    const uint32_t   S = (XCCL_STEP_MAX + 1u) / 8;
    int              node_of[MAXN];
    xccl_topo_t      topo = {0};
    xccl_coll_args_t args[MAXN];
    void            *buf[MAXN];
    double          *ref  = calloc(count + 1, sizeof(double));
    size_t           es   = dt == XCCL_FLOAT32 ? 4 : 8;
    sim_opts_t       opts = {.seed = (uint64_t)(n * 7919 + l * 13 + (int)count)};
    uint64_t         rng  = (uint64_t)(n * 31 + l) * 0x9E3779B97F4A7C15ull + count;
    size_t           cross[MAXN] = {0}, inside[MAXN] = {0};
    sim_result_t     res;
    xccl_status_t    st;
    char             what[160];
    int              L, H;

    topo.nnodes  = make_layout(l, n, node_of);
    topo.node_of = node_of;
    topo.intra   = (xccl_cost_model_t){1e-6, 1.0 / 5e9, 1.0 / 4e9, 0};
    topo.inter   = (xccl_cost_model_t){50e-6, 1.0 / 1e9, 1.0 / 4e9, 0};
    H            = topo.nnodes;
    L            = n / H;
    snprintf(what, sizeof(what), "all_reduce hier_rs n=%d (%s, %d nodes) count=%zu %s", n,
             layout_name[l], H, count, dt == XCCL_FLOAT32 ? "float32" : "float64");
    for (int r = 0; r < n; r++) {
        buf[r] = malloc(count * es + 1);
        for (size_t i = 0; i < count; i++) {
            double v;
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            v   = ((double)(rng >> 11) / 9007199254740992.0 - 0.5) * 100.0;
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
                                     .op     = XCCL_OP_SUM,
                                     .topo   = l == L_NONE ? NULL : &topo};
    }
    st = sim_run(&xccl_algo_allreduce_hier_rs, n, args, &opts, &res);
    CHECK_MSG(st == XCCL_OK, "%s: %s", what, res.error);
    for (int r = 1; st == XCCL_OK && r < n; r++)
        CHECK_MSG(memcmp(buf[r], buf[0], count * es) == 0, "%s: rank %d differs from rank 0",
                  what, r);
    for (size_t i = 0; st == XCCL_OK && i < count; i++) {
        double got = dt == XCCL_FLOAT32 ? ((float *)buf[0])[i] : ((double *)buf[0])[i];
        if (fabs(got - ref[i]) > (dt == XCCL_FLOAT32 ? 1e-3 : 1e-10) * n) {
            CHECK_MSG(0, "%s: element %zu = %.9g, want %.9g", what, i, got, ref[i]);
            break;
        }
    }
    for (size_t m = 0; st == XCCL_OK && m < res.nmsgs; m++) {
        const sim_msg_t *g = &res.msgs[m];
        if (l == L_NONE || node_of[g->src] == node_of[g->dst]) {
            inside[g->src] += g->nbytes;
            continue;
        }
        cross[g->src] += g->nbytes;
        CHECK_MSG((g->step >= 2 * S && g->step < 3 * S) || (g->step >= 5 * S && g->step < 6 * S),
                  "%s: rank %d -> %d step %u crossed nodes", what, g->src, g->dst, g->step);
    }
    if (st == XCCL_OK && l != L_NONE && equal_nodes(node_of, n, H) && count % (size_t)L == 0 &&
        count > 0) {
        xccl_cost_t intra, inter;
        xccl_algo_allreduce_hier_rs.cost_topo(&topo, n, count * es, &intra, &inter);
        for (int r = 0; r < n; r++) {
            CHECK_MSG((double)inside[r] == intra.bytes, "%s: rank %d sent %zu B inside, cost %g",
                      what, r, inside[r], intra.bytes);
            if ((count / (size_t)L) % (size_t)H == 0 && xccl_pat_is_pow2(H))
                CHECK_MSG((double)cross[r] == inter.bytes,
                          "%s: rank %d sent %zu B across, cost %g", what, r, cross[r],
                          inter.bytes);
        }
    }
    sim_result_free(&res);
    for (int r = 0; r < n; r++)
        free(buf[r]);
    free(ref);
}

static void test_results(void)
{
    static const int    ns[]     = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16};
    static const size_t counts[] = {0, 1, 7, 1000};

    for (size_t a = 0; a < sizeof(ns) / sizeof(ns[0]); a++) {
        int n = ns[a];
        for (int l = 0; l < L_COUNT; l++) {
            for (size_t c = 0; c < sizeof(counts) / sizeof(counts[0]); c++) {
                check_allreduce(n, (layout_t)l, counts[c], XCCL_OP_SUM);
                check_hier_rs(n, (layout_t)l, counts[c], XCCL_FLOAT32);
                if (c == 3) check_hier_rs(n, (layout_t)l, 4 * counts[c] + 3, XCCL_FLOAT64);
                if (c == 2) check_allreduce(n, (layout_t)l, counts[c], XCCL_OP_MAX);
                for (int root = 0; root < n; root += (n > 6 ? 3 : 1))
                    check_broadcast(n, (layout_t)l, counts[c], root);
            }
        }
    }
}

/* Pricing: with links between nodes 100x slower to start, hier wins small all_reduces on 2
 * nodes of 4; on one node (no topology) its degenerate schedule has twice the rounds of
 * recursive doubling and is not chosen, but runs when asked for. */
static void test_selection(void)
{
    int                node_of[8];
    xccl_topo_t        topo;
    xccl_coll_args_t   args   = {0};
    const xccl_algo_t *chosen = NULL;
    xccl_status_t      st;

    for (int r = 0; r < 8; r++)
        node_of[r] = r / 4;
    topo.nnodes  = 2;
    topo.node_of = node_of;
    topo.intra   = (xccl_cost_model_t){1e-6, 1.0 / 5e9, 1.0 / 4e9, 0};
    topo.inter   = (xccl_cost_model_t){100e-6, 1.0 / 1e9, 1.0 / 4e9, 0};
    args.coll    = XCCL_COLL_ALLREDUCE;
    args.count   = 2;
    args.dtype   = XCCL_FLOAT32;
    args.elsize  = 4;
    args.op      = XCCL_OP_SUM;
    args.topo    = &topo;
    st           = xccl_algo_select(&args, 8, 8, &topo.inter, NULL, &chosen);
    CHECK(st == XCCL_OK && chosen == &xccl_algo_allreduce_hier);
    /* large all_reduces: the bandwidth-optimal two-level one; not where nodes are unequal */
    args.count = (size_t)16 << 20;
    st         = xccl_algo_select(&args, 8, (size_t)64 << 20, &topo.inter, NULL, &chosen);
    CHECK_MSG(st == XCCL_OK && chosen == &xccl_algo_allreduce_hier_rs, "chose %s",
              chosen ? chosen->name : "?");
    /* nodes of 3 and 5: the core is 3 per node, 2 ranks fold in; priced dearer than 4 + 4 */
    {
        double even = xccl_algo_predict_args(&xccl_algo_allreduce_hier_rs, &args, &topo.inter, 8,
                                             (size_t)64 << 20);
        node_of[3] = 1;
        CHECK(xccl_algo_predict_args(&xccl_algo_allreduce_hier_rs, &args, &topo.inter, 8,
                                     (size_t)64 << 20) > even);
        CHECK(xccl_algo_select(&args, 8, (size_t)64 << 20, &topo.inter, "hier_rs", &chosen) ==
                  XCCL_OK &&
              chosen == &xccl_algo_allreduce_hier_rs);
        node_of[3] = 0;
    }
    args.count = 2;
    /* broadcast: linear from 1 MiB on one node whose receivers pull (cross-memory attach) */
    {
        xccl_coll_args_t b = args;
        xccl_topo_t      one = topo;
        int              zero[8] = {0};
        b.coll       = XCCL_COLL_BROADCAST;
        b.count      = (size_t)1 << 20;
        b.topo       = &one;
        one.nnodes   = 1;
        one.node_of  = zero;
        one.pull     = 1;
        CHECK(xccl_algo_select(&b, 4, (size_t)4 << 20, &one.intra, NULL, &chosen) == XCCL_OK &&
              strcmp(chosen->name, "linear") == 0);
        CHECK(xccl_algo_select(&b, 4, (size_t)4 << 20, &one.intra, "auto", &chosen) == XCCL_OK &&
              strcmp(chosen->name, "linear") != 0);
        one.pull = 0;
        CHECK(xccl_algo_select(&b, 4, (size_t)4 << 20, &one.intra, NULL, &chosen) == XCCL_OK &&
              strcmp(chosen->name, "linear") != 0);
        b.topo = &topo; /* two nodes */
        topo.pull = 1;
        CHECK(xccl_algo_select(&b, 8, (size_t)4 << 20, &topo.inter, NULL, &chosen) == XCCL_OK &&
              strcmp(chosen->name, "linear") != 0);
        topo.pull = 0;
    }
    /* the built-in large-vector rule (owner) is for one host only: across hosts, the model */
    st = xccl_algo_select(&args, 8, (size_t)64 << 20, &topo.inter, NULL, &chosen);
    CHECK(st == XCCL_OK && strcmp(chosen->name, "owner") != 0);
    args.topo = NULL;
    st        = xccl_algo_select(&args, 8, 8, &topo.intra, NULL, &chosen);
    CHECK(st == XCCL_OK && chosen != &xccl_algo_allreduce_hier);
    st = xccl_algo_select(&args, 8, 8, &topo.intra, "hier", &chosen);
    CHECK(st == XCCL_OK && chosen == &xccl_algo_allreduce_hier);
}

int main(void)
{
    test_results();
    test_selection();
    CTEST_MAIN_END("test_algo_hier");
}
