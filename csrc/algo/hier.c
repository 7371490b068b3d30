/* SPDX-License-Identifier: Apache-2.0
 *
 * hier.c - two-level (hierarchical) all-reduce and broadcast for communicators that span
 * several nodes: the heavy traffic stays on the links inside a node (shared memory) and only
 * some ranks talk across nodes (TCP). Each phase is a one-level algorithm run as a sub-task
 * (xccl_task_sub) on the ranks it concerns, in its own part of the step range. Without a
 * topology (args->topo NULL: one node) the schedules degenerate to their in-node phases and
 * are priced as such, so the cost model only picks them across nodes.
 *
 * Within node k the members in rank order have local indices 0..L_k-1; index 0 is the node's
 * leader. Nodes are numbered by their lowest rank, so leaders are in node order.
 *
 * all_reduce "hier" (in place on rbuf), latency-bound:
 *
 *   phase  sub-task                          members                    steps
 *   A      reduce "binomial", root index 0   each node                  [0, S)
 *   B      all_reduce "rd"                   the leaders, node order    [S, 2S)
 *   C      broadcast "binomial", root 0      each node                  [2S, 3S)
 *
 * (S = a quarter of the task's step limit.) Every partial sum is formed as (lower local or node
 * index) op (higher), so the result is the same bits on every rank (the leaders agree after B,
 * C copies). Cost inside nodes (L = the largest node): 2 ceil(log2 L) α, 2 ceil(log2 L) N β,
 * ceil(log2 L) N γ; between nodes: that of "rd" on H nodes.
 *
 * all_reduce "hier_rs" (in place on rbuf), bandwidth-bound. K is the size of the smallest
 * node; in each node the members of local index j >= K fold onto the one of index j mod K (a
 * fold group: local indices congruent mod K, the lowest first), so K ranks per node (the core,
 * local index < K) carry the schedule. With q = floor(count / K), the first K q elements are K
 * chunks of q, chunk i owned by local index i:
 *
 *   phase  sub-task                            members                       steps
 *   F      reduce "binomial" of the K q        each fold group, root: the    [0, S)
 *          elements                            core rank
 *   A      reduce_scatter "ring" -> chunk li   the core of each node         [S, 2S)
 *   B      all_reduce "ring" or "rabenseifner" the core ranks of local       [2S, 3S)
 *          (cheaper under topo->inter)         index li, node order
 *   C      all_gather "ring" of the chunks     the core of each node         [3S, 4S)
 *   U      broadcast "binomial" of the K q     each fold group, root: the    [4S, 5S)
 *          elements                            core rank
 *   T      all_reduce "rd" of the last         every rank                    [5S, 6S)
 *          count - K q (< K) elements, beside the others
 *
 * (S = an eighth of the task's step limit; F and U only where nodes are larger than K.) After
 * B the core ranks of local index li hold the same bits of chunk li; C and U copy them, so the
 * result is the same bits on every rank. Cost inside nodes: a ring reduce-scatter and a ring
 * all-gather of N on K ranks (2(K-1)/K N β), plus a binomial reduce and broadcast over the
 * largest fold group; between nodes: the chosen all-reduce of N/K on H ranks (T is fewer than
 * K elements and not priced).
 *
 * broadcast "hier": the root stands in for its node's leader. The heads (root, other nodes'
 * leaders) run broadcast "binomial" rooted at the root's node, then each head runs broadcast
 * "binomial" inside its node. Cost: ceil(log2 H) α + ceil(log2 H) N β between nodes,
 * ceil(log2 L) α + ceil(log2 L) N β inside.
 */
#include "algo/algo.h"

#include <stdlib.h>
#include <string.h>

#include "algo/patterns.h"
#include "core/check.h"

/* A rank's place in the topology. */
typedef struct place {
    const int *node_of;
    int        n, node, nnodes;
    int        li, L; /* local index and size of this rank's node */
} place_t;

static place_t place_of(const xccl_task_t *t)
{
    const xccl_topo_t *topo = xccl_task_args(t)->topo;
    int                r    = xccl_task_rank(t);
    place_t            p;

    p.node_of = topo != NULL ? topo->node_of : NULL;
    p.n       = xccl_task_size(t);
    p.node    = topo != NULL ? topo->node_of[r] : 0;
    p.nnodes  = topo != NULL ? topo->nnodes : 1;
    p.li = p.L = 0;
    for (int i = 0; i < p.n; i++) {
        if (p.node_of != NULL && p.node_of[i] != p.node) continue;
        if (i < r) p.li++;
        p.L++;
    }
    return p;
}

static int node_of(const place_t *p, int rank) { return p->node_of ? p->node_of[rank] : 0; }

/* The members of `node` in rank order into map; returns how many. */
static int node_members(const place_t *p, int node, int *map)
{
    int k = 0;

    for (int i = 0; i < p->n; i++)
        if (node_of(p, i) == node) map[k++] = i;
    return k;
}

/* The rank of local index li in every node, in node order, into map (-1 where a node is
 * smaller). */
static void local_index_ranks(const place_t *p, int li, int *map)
{
    for (int k = 0; k < p->nnodes; k++) map[k] = -1;
    for (int k = 0; k < p->nnodes; k++) {
        int at = 0;
        for (int i = 0; i < p->n && map[k] < 0; i++) {
            if (node_of(p, i) != k) continue;
            if (at++ == li) map[k] = i;
        }
    }
}

static int node_size(const int *of, int n, int node)
{
    int L = 0;

    for (int i = 0; i < n; i++)
        L += of[i] == node;
    return L;
}

static int max_node_size(const xccl_topo_t *topo, int n)
{
    int best = 0;

    for (int k = 0; k < topo->nnodes; k++) {
        int L = node_size(topo->node_of, n, k);
        if (L > best) best = L;
    }
    return best;
}

/* The arguments of a phase: the parent's, re-aimed, without topology. */
static xccl_coll_args_t phase_args(const xccl_coll_args_t *a, xccl_coll_t coll, const void *sbuf,
                                   void *rbuf, size_t count, int root)
{
    xccl_coll_args_t s = *a;

    s.coll  = coll;
    s.sbuf  = sbuf;
    s.rbuf  = rbuf;
    s.count = count;
    s.root  = root;
    s.topo  = NULL;
    return s;
}

static void cost_add(xccl_cost_t *acc, const xccl_algo_t *a, int size, size_t nbytes)
{
    xccl_cost_t c = {0};

    if (size > 1) a->cost(size, nbytes, &c);
    acc->steps += c.steps;
    acc->bytes += c.bytes;
    acc->reduce_bytes += c.reduce_bytes;
}

static void *scratch_or_fail(xccl_task_t *t, size_t nbytes, const char *algo)
{
    void *p = xccl_task_scratch(t, nbytes);

    if (p == NULL)
        XCCL_ERROR(XCCL_ERR_NO_MEMORY, "%s: rank %d: no memory for %zu B of scratch", algo,
                   xccl_task_rank(t), nbytes);
    return p;
}

/* Runs a progress function with room for k * n + nnodes ints of rank maps. The maps are host
 * memory, which the task's scratch need not be; they are rebuilt on every call, and
 * xccl_task_sub copies the ones it needs when it creates a sub-task. Nothing to do without
 * data or peers. */
static xccl_status_t with_maps(xccl_task_t *t, int k,
                               xccl_status_t (*run)(xccl_task_t *t, int *maps))
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    int                     n = xccl_task_size(t), H = a->topo != NULL ? a->topo->nnodes : 1;
    int                    *maps;
    xccl_status_t           st;

    if (a->count == 0 || n == 1) return XCCL_OK;
    maps = malloc(((size_t)k * (size_t)n + (size_t)H) * sizeof(int));
    if (maps == NULL)
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "%s %s: rank %d: out of memory",
                          xccl_coll_name(a->coll), "hier", xccl_task_rank(t));
    st = run(t, maps);
    free(maps);
    return st;
}

/* ---------------------------------------------------------------------------------------------
 * all_reduce "hier"
 * ------------------------------------------------------------------------------------------- */

static xccl_status_t ar_run(xccl_task_t *t, int *maps)
{
    const xccl_coll_args_t *a    = xccl_task_args(t);
    uint64_t               *w    = xccl_task_state(t); /* w[0]: next phase */
    uint32_t                span = xccl_task_step_limit(t) / 4;
    place_t                 p    = place_of(t);
    xccl_coll_args_t        s;
    int                    *local = maps, *leaders = maps + p.n, L;
    xccl_status_t           st;

    L       = node_members(&p, p.node, local);
    local_index_ranks(&p, 0, leaders);
    for (;;) {
        switch (w[0]) {
        case 0:
            s  = phase_args(a, XCCL_COLL_REDUCE, a->rbuf, p.li == 0 ? a->rbuf : NULL, a->count, 0);
            st = xccl_task_sub(t, 0, &xccl_algo_reduce_binomial, &s, local, L, 0, span);
            break;
        case 1:
            s  = phase_args(a, XCCL_COLL_ALLREDUCE, a->rbuf, a->rbuf, a->count, -1);
            st = p.li != 0 ? XCCL_OK
                           : xccl_task_sub(t, 0, &xccl_algo_allreduce_rd, &s, leaders, p.nnodes,
                                           span, span);
            break;
        case 2:
            s  = phase_args(a, XCCL_COLL_BROADCAST, a->rbuf, a->rbuf, a->count, 0);
            st = xccl_task_sub(t, 0, &xccl_algo_broadcast_binomial, &s, local, L, 2 * span, span);
            break;
        default: return XCCL_OK;
        }
        if (st != XCCL_OK) return st;
        w[0]++;
    }
}

static xccl_status_t ar_progress(xccl_task_t *t) { return with_maps(t, 1, ar_run); }

static void ar_cost_topo(const xccl_topo_t *topo, int size, size_t nbytes, xccl_cost_t *intra,
                         xccl_cost_t *inter)
{
    int L = max_node_size(topo, size);

    memset(intra, 0, sizeof(*intra));
    memset(inter, 0, sizeof(*inter));
    cost_add(intra, &xccl_algo_reduce_binomial, L, nbytes);
    cost_add(intra, &xccl_algo_broadcast_binomial, L, nbytes);
    cost_add(inter, &xccl_algo_allreduce_rd, topo->nnodes, nbytes);
}

/* One node: a binomial reduce and a binomial broadcast over all ranks. */
static void ar_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    memset(out, 0, sizeof(*out));
    cost_add(out, &xccl_algo_reduce_binomial, n, nbytes);
    cost_add(out, &xccl_algo_broadcast_binomial, n, nbytes);
}

const xccl_algo_t xccl_algo_allreduce_hier = {
    .name      = "hier",
    .coll      = XCCL_COLL_ALLREDUCE,
    .summary   = "two-level: binomial reduce to each node's leader, recursive doubling "
                 "between leaders, binomial broadcast in each node",
    .cost      = ar_cost,
    .progress  = ar_progress,
    .cost_topo = ar_cost_topo,
};

/* ---------------------------------------------------------------------------------------------
 * all_reduce "hier_rs"
 * ------------------------------------------------------------------------------------------- */

/* The size of the smallest node: the ranks per node that take part in every phase. */
static int min_node_size(const xccl_topo_t *topo, int n)
{
    int best = n;

    for (int k = 0; k < topo->nnodes; k++) {
        int L = node_size(topo->node_of, n, k);
        if (L < best) best = L;
    }
    return best;
}

/* The all-reduce between nodes: ring or Rabenseifner, whichever the model of the links between
 * nodes prices lower for `nbytes` on H ranks (ring on a tie); the same on every rank. */
static const xccl_algo_t *rs_inter_algo(const xccl_topo_t *topo, int H, size_t nbytes)
{
    const xccl_cost_model_t *m    = &topo->inter;
    const xccl_algo_t       *ring = &xccl_algo_allreduce_ring;
    const xccl_algo_t       *rab  = &xccl_algo_allreduce_rabenseifner;

    return xccl_algo_predict(rab, m, H, nbytes) < xccl_algo_predict(ring, m, H, nbytes) ? rab
                                                                                          : ring;
}

enum { RS_PHASE = 0, RS_TAIL_DONE };
enum { RS_F = 0, RS_A, RS_B, RS_C, RS_U, RS_T }; /* phases and their step ranges */

static xccl_status_t rs_run(xccl_task_t *t, int *maps)
{
    const xccl_coll_args_t *a    = xccl_task_args(t);
    uint64_t               *w    = xccl_task_state(t);
    uint32_t                span = xccl_task_step_limit(t) / 8;
    size_t                  es = a->elsize, q, tail, cbytes;
    place_t                 p;
    xccl_coll_args_t        s;
    char                   *buf = a->rbuf, *chunk;
    int                    *local, *fold, *across, *all, K, nfold = 0, core;
    xccl_status_t           st;

    p      = place_of(t);
    K      = a->topo != NULL ? min_node_size(a->topo, p.n) : p.n;
    core   = p.li < K;
    q      = a->count / (size_t)K;
    tail   = a->count - q * (size_t)K;
    cbytes = (q * es + 7) & ~(size_t)7;
    chunk  = scratch_or_fail(t, cbytes, "all_reduce hier_rs");
    if (chunk == NULL) return XCCL_ERR_NO_MEMORY;
    local  = maps;
    fold   = local + p.n;
    across = fold + p.n;
    all    = across + p.nnodes;
    node_members(&p, p.node, local);
    for (int j = p.li % K; j < p.L; j += K) fold[nfold++] = local[j];
    if (core) local_index_ranks(&p, p.li, across);
    for (int i = 0; i < p.n; i++) all[i] = i;

    /* T: the last elements, beside the other phases */
    if (tail > 0 && !w[RS_TAIL_DONE]) {
        char *end = buf + q * (size_t)K * es;
        s         = phase_args(a, XCCL_COLL_ALLREDUCE, end, end, tail, -1);
        st        = xccl_task_sub(t, 1, &xccl_algo_allreduce_rd, &s, all, p.n, RS_T * span, span);
        if (st < 0) return st;
        if (st == XCCL_OK) w[RS_TAIL_DONE] = 1;
    }
    while (q > 0 && w[RS_PHASE] <= RS_U) {
        st = XCCL_OK;
        switch (w[RS_PHASE]) {
        case RS_F:
            s = phase_args(a, XCCL_COLL_REDUCE, buf, core ? buf : NULL, q * (size_t)K, 0);
            if (nfold > 1)
                st = xccl_task_sub(t, 0, &xccl_algo_reduce_binomial, &s, fold, nfold, 0, span);
            break;
        case RS_A:
            s = phase_args(a, XCCL_COLL_REDUCE_SCATTER, buf, chunk, q, -1);
            if (core)
                st = xccl_task_sub(t, 0, &xccl_algo_reduce_scatter_ring, &s, local, K,
                                   RS_A * span, span);
            break;
        case RS_B:
            s = phase_args(a, XCCL_COLL_ALLREDUCE, chunk, chunk, q, -1);
            if (core && p.nnodes > 1)
                st = xccl_task_sub(t, 0, rs_inter_algo(a->topo, p.nnodes, q * es), &s, across,
                                   p.nnodes, RS_B * span, span);
            /* C's input: this rank's chunk in its place */
            if (core && st == XCCL_OK)
                st = xccl_task_copy(t, buf + (size_t)p.li * q * es, chunk, q * es);
            break;
        case RS_C:
            s = phase_args(a, XCCL_COLL_ALLGATHER, buf + (size_t)p.li * q * es, buf, q, -1);
            if (core)
                st = xccl_task_sub(t, 0, &xccl_algo_allgather_ring, &s, local, K, RS_C * span,
                                   span);
            break;
        default: /* RS_U */
            s = phase_args(a, XCCL_COLL_BROADCAST, buf, buf, q * (size_t)K, 0);
            if (nfold > 1)
                st = xccl_task_sub(t, 0, &xccl_algo_broadcast_binomial, &s, fold, nfold,
                                   RS_U * span, span);
            break;
        }
        if (st != XCCL_OK) return st;
        w[RS_PHASE]++;
    }
    return tail > 0 && !w[RS_TAIL_DONE] ? XCCL_INPROGRESS : XCCL_OK;
}

static xccl_status_t rs_progress(xccl_task_t *t) { return with_maps(t, 3, rs_run); }

static void rs_cost_topo(const xccl_topo_t *topo, int size, size_t nbytes, xccl_cost_t *intra,
                         xccl_cost_t *inter)
{
    int K = min_node_size(topo, size), H = topo->nnodes;
    int g = (max_node_size(topo, size) + K - 1) / K; /* the largest fold group */

    memset(intra, 0, sizeof(*intra));
    memset(inter, 0, sizeof(*inter));
    cost_add(intra, &xccl_algo_reduce_binomial, g, nbytes);
    cost_add(intra, &xccl_algo_reduce_scatter_ring, K, nbytes);
    cost_add(intra, &xccl_algo_allgather_ring, K, nbytes);
    cost_add(intra, &xccl_algo_broadcast_binomial, g, nbytes);
    cost_add(inter, rs_inter_algo(topo, H, nbytes / (size_t)K), H, nbytes / (size_t)K);
}

/* One node: a ring reduce-scatter and a ring all-gather over all ranks. */
static void rs_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    memset(out, 0, sizeof(*out));
    cost_add(out, &xccl_algo_reduce_scatter_ring, n, nbytes);
    cost_add(out, &xccl_algo_allgather_ring, n, nbytes);
}

const xccl_algo_t xccl_algo_allreduce_hier_rs = {
    .name      = "hier_rs",
    .coll      = XCCL_COLL_ALLREDUCE,
    .summary   = "two-level, bandwidth-optimal: ring reduce-scatter in each node, all-reduce of "
                 "each 1/L chunk between nodes, ring all-gather in each node",
    .cost      = rs_cost,
    .progress  = rs_progress,
    .cost_topo = rs_cost_topo,
};

/* ---------------------------------------------------------------------------------------------
 * broadcast "hier"
 * ------------------------------------------------------------------------------------------- */

static xccl_status_t bc_run(xccl_task_t *t, int *maps)
{
    const xccl_coll_args_t *a    = xccl_task_args(t);
    uint64_t               *w    = xccl_task_state(t); /* w[0]: next phase */
    uint32_t                span = xccl_task_step_limit(t) / 4;
    int                     r    = xccl_task_rank(t);
    place_t                 p;
    xccl_coll_args_t        s;
    int                    *local = maps, *heads, L, rnode, head_li = 0, head;
    xccl_status_t           st;

    p     = place_of(t);
    rnode = node_of(&p, a->root);
    heads = local + p.n;
    L     = node_members(&p, p.node, local);
    local_index_ranks(&p, 0, heads);
    heads[rnode] = a->root;
    head         = heads[p.node];
    while (local[head_li] != head) head_li++;
    for (;;) {
        switch (w[0]) {
        case 0:
            s  = phase_args(a, XCCL_COLL_BROADCAST, a->rbuf, a->rbuf, a->count, rnode);
            st = r != head ? XCCL_OK
                           : xccl_task_sub(t, 0, &xccl_algo_broadcast_binomial, &s, heads,
                                           p.nnodes, span, span);
            break;
        case 1:
            s  = phase_args(a, XCCL_COLL_BROADCAST, a->rbuf, a->rbuf, a->count, head_li);
            st = xccl_task_sub(t, 0, &xccl_algo_broadcast_binomial, &s, local, L, 2 * span, span);
            break;
        default: return XCCL_OK;
        }
        if (st != XCCL_OK) return st;
        w[0]++;
    }
}

static xccl_status_t bc_progress(xccl_task_t *t) { return with_maps(t, 1, bc_run); }

static void bc_cost_topo(const xccl_topo_t *topo, int size, size_t nbytes, xccl_cost_t *intra,
                         xccl_cost_t *inter)
{
    memset(intra, 0, sizeof(*intra));
    memset(inter, 0, sizeof(*inter));
    cost_add(intra, &xccl_algo_broadcast_binomial, max_node_size(topo, size), nbytes);
    cost_add(inter, &xccl_algo_broadcast_binomial, topo->nnodes, nbytes);
}

/* One node: a binomial broadcast over all ranks. */
static void bc_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    memset(out, 0, sizeof(*out));
    cost_add(out, &xccl_algo_broadcast_binomial, n, nbytes);
}

const xccl_algo_t xccl_algo_broadcast_hier = {
    .name      = "hier",
    .coll      = XCCL_COLL_BROADCAST,
    .summary   = "two-level: binomial broadcast between one rank per node, then binomial "
                 "broadcast inside each node",
    .cost      = bc_cost,
    .progress  = bc_progress,
    .cost_topo = bc_cost_topo,
};
