/* SPDX-License-Identifier: Apache-2.0
 *
 * hier.c - two-level (hierarchical) all-reduce and broadcast for communicators that span
 * several nodes: the heavy traffic stays on the links inside a node (shared memory) and only
 * one rank per node talks across nodes (TCP), so the slow links carry log2(nodes) messages
 * instead of the log2(n) or n-1 of a one-level schedule. Without a topology (args->topo NULL:
 * one node) the schedules degenerate to a binomial reduce + broadcast (all_reduce) and a
 * binomial broadcast, priced as such, so the cost model only picks them across nodes.
 *
 * Within node k the members in rank order have local indices 0..L_k-1; index 0 is the node's
 * leader. Nodes are numbered by their lowest rank, so leaders are in node order.
 *
 * all_reduce "hier" (in place on rbuf), rounds in this order, each rank skipping those it has
 * no part in:
 *
 *   phase         rounds              who                     does
 *   A reduce      ceil(log2 L)        local index i           round m: i has bit m set and
 *                                                             no lower one: send buf to i-2^m;
 *                                                             i+2^m < L: receive, buf op= it
 *   B all-reduce  log2 p + 2          leaders (p = 2^floor(   recursive doubling with the fold
 *                                     log2 H), H nodes)       of allreduce "rd"
 *   C broadcast   ceil(log2 L)        local index i           round m: i < 2^m sends buf to
 *                                                             i+2^m; 2^m <= i < 2^(m+1)
 *                                                             receives into buf
 *
 * Every partial sum is formed as (lower local or node index) op (higher), so the result is the
 * same bits on every rank (the leaders agree after B, C copies).
 * cost inside nodes (L = the largest node): 2 ceil(log2 L) α, 2 ceil(log2 L) N β,
 * ceil(log2 L) N γ; between nodes: log2 p + 2[x] α, (log2 p + 2[x]) N β, (log2 p + [x]) N γ
 * (x: H not a power of two).
 *
 * broadcast "hier": the root stands in for its node's leader. The heads (root, other nodes'
 * leaders) run a binomial broadcast ordered from the root's node, then each head runs a
 * binomial broadcast inside its node. Cost: ceil(log2 H) α + ceil(log2 H) N β between nodes,
 * ceil(log2 L) α + ceil(log2 L) N β inside.
 */
#include "algo/algo.h"

#include <string.h>

#include "algo/patterns.h"
#include "core/check.h"

#define STEP_A 0u /* + round: phase steps keep the phases' messages apart */
#define STEP_B 64u
#define STEP_C 128u

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

/* Rank of local index `li` in node `node`, or -1. */
static int local_rank(const place_t *p, int node, int li)
{
    if (p->node_of == NULL) return li; /* one node */
    for (int i = 0; i < p->n; i++) {
        if (p->node_of[i] == node && li-- == 0) return i;
    }
    return -1;
}

static int node_size(const int *node_of, int n, int node)
{
    int L = 0;

    for (int i = 0; i < n; i++)
        L += node_of[i] == node;
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

/* Binomial broadcast within a group of `m` members (virtual index v, 0 holds the data), round
 * `round`: sets *to (send) or *from (receive) to a virtual index, -1 when idle. */
static void binomial_bcast_round(int v, int m, int round, int *to, int *from)
{
    int mask = 1 << round;

    *to = *from = -1;
    if (v < mask && v + mask < m) *to = v + mask;
    if (v >= mask && v < 2 * mask) *from = v - mask;
}

/* ---------------------------------------------------------------------------------------------
 * all_reduce
 * ------------------------------------------------------------------------------------------- */

enum { RED_NONE = 0, RED_MINE_FIRST, RED_THEIRS_FIRST };

static xccl_status_t ar_reduce_pending(xccl_task_t *t, uint64_t *kind, char *buf, const char *tmp,
                                       size_t count)
{
    xccl_status_t st = XCCL_OK;

    if (*kind == RED_MINE_FIRST) st = xccl_task_reduce(t, buf, buf, tmp, count);
    if (*kind == RED_THEIRS_FIRST) st = xccl_task_reduce(t, buf, tmp, buf, count);
    *kind = RED_NONE;
    return st;
}

/* Posts round k of the schedule above; *kind receives the reduction to run once it is done. */
static xccl_status_t ar_post(xccl_task_t *t, const place_t *p, int k, char *buf, char *tmp,
                             size_t nbytes, uint64_t *kind)
{
    int             ra = xccl_pat_log2_ceil(p->L), leader = p->li == 0;
    int             hi = p->node; /* a leader's index among the leaders */
    xccl_pat_fold_t f  = xccl_pat_fold(hi, p->nnodes);
    int             rb = f.log_p + 2;

    if (k < ra) { /* A: binomial reduce to the leader */
        int mask = 1 << k, low = p->li & ((mask << 1) - 1);
        if (low == mask) /* bit k is my lowest set bit: hand my partial sum down, done */
            return xccl_task_isend(t, local_rank(p, p->node, p->li - mask), buf, nbytes,
                                   STEP_A + (uint32_t)k);
        if (low == 0 && p->li + mask < p->L) {
            *kind = RED_MINE_FIRST;
            return xccl_task_irecv(t, local_rank(p, p->node, p->li + mask), tmp, nbytes,
                                   STEP_A + (uint32_t)k);
        }
        return XCCL_OK;
    }
    k -= ra;
    if (k < rb) { /* B: recursive doubling among the leaders, fold for non-powers of two */
        uint32_t step = STEP_B + (uint32_t)k;
        if (!leader) return XCCL_OK;
        if (k == 0 && f.role == XCCL_PAT_EXTRA)
            return xccl_task_isend(t, local_rank(p, f.peer, 0), buf, nbytes, step);
        if (k == 0 && f.role == XCCL_PAT_PROXY) {
            *kind = RED_MINE_FIRST; /* the proxy's node index is the lower one */
            return xccl_task_irecv(t, local_rank(p, f.peer, 0), tmp, nbytes, step);
        }
        if (k >= 1 && k <= f.log_p && f.role != XCCL_PAT_EXTRA) {
            int partner = xccl_pat_rd_partner(hi, k - 1), peer = local_rank(p, partner, 0);
            *kind = partner < hi ? RED_THEIRS_FIRST : RED_MINE_FIRST;
            XCCL_CHECK(xccl_task_irecv(t, peer, tmp, nbytes, step));
            return xccl_task_isend(t, peer, buf, nbytes, step);
        }
        if (k == f.log_p + 1 && f.role == XCCL_PAT_PROXY)
            return xccl_task_isend(t, local_rank(p, f.peer, 0), buf, nbytes, step);
        if (k == f.log_p + 1 && f.role == XCCL_PAT_EXTRA)
            return xccl_task_irecv(t, local_rank(p, f.peer, 0), buf, nbytes, step);
        return XCCL_OK;
    }
    k -= rb;
    { /* C: binomial broadcast from the leader */
        int to, from;
        binomial_bcast_round(p->li, p->L, k, &to, &from);
        if (to >= 0)
            return xccl_task_isend(t, local_rank(p, p->node, to), buf, nbytes,
                                   STEP_C + (uint32_t)k);
        if (from >= 0)
            return xccl_task_irecv(t, local_rank(p, p->node, from), buf, nbytes,
                                   STEP_C + (uint32_t)k);
    }
    return XCCL_OK;
}

static xccl_status_t ar_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    uint64_t     *w      = xccl_task_state(t); /* w[0]: next round, w[1]: reduction owed (RED_*) */
    size_t        nbytes = a->count * a->elsize;
    place_t       p;
    char         *tmp;
    int           rounds;
    xccl_status_t st;

    if (nbytes == 0) return XCCL_OK;
    p      = place_of(t);
    rounds = 2 * xccl_pat_log2_ceil(p.L) + xccl_pat_log2_floor(p.nnodes) + 2;
    tmp    = xccl_task_scratch(t, nbytes);
    if (tmp == NULL)
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "all_reduce hier: rank %d: no memory for %zu B",
                          xccl_task_rank(t), nbytes);
    while ((st = xccl_task_test(t)) == XCCL_OK) {
        XCCL_CHECK(ar_reduce_pending(t, &w[1], a->rbuf, tmp, a->count));
        if (w[0] == (uint64_t)rounds) return XCCL_OK;
        XCCL_CHECK(ar_post(t, &p, (int)w[0], a->rbuf, tmp, nbytes, &w[1]));
        w[0]++;
    }
    return st;
}

static void ar_cost_topo(const xccl_topo_t *topo, int size, size_t nbytes, xccl_cost_t *intra,
                         xccl_cost_t *inter)
{
    double la = xccl_pat_log2_ceil(max_node_size(topo, size));
    double lb = xccl_pat_log2_floor(topo->nnodes);
    double x  = xccl_pat_is_pow2(topo->nnodes) ? 0 : 1;

    memset(intra, 0, sizeof(*intra));
    memset(inter, 0, sizeof(*inter));
    intra->steps        = 2 * la;
    intra->bytes        = 2 * la * (double)nbytes;
    intra->reduce_bytes = la * (double)nbytes;
    inter->steps        = lb + 2 * x;
    inter->bytes        = (lb + 2 * x) * (double)nbytes;
    inter->reduce_bytes = (lb + x) * (double)nbytes;
}

/* One node: a binomial reduce and a binomial broadcast over all ranks. */
static void ar_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    double la = xccl_pat_log2_ceil(n);

    out->steps        = 2 * la;
    out->bytes        = 2 * la * (double)nbytes;
    out->reduce_bytes = la * (double)nbytes;
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
 * broadcast
 * ------------------------------------------------------------------------------------------- */

/* Round k: heads' binomial broadcast across nodes (virtual node index from the root's node),
 * then the binomial broadcast inside each node from its head. */
static xccl_status_t bc_post(xccl_task_t *t, const place_t *p, int k, char *buf, size_t nbytes)
{
    int root = xccl_task_args(t)->root, rnode = p->node_of != NULL ? p->node_of[root] : 0;
    int rb = xccl_pat_log2_ceil(p->nnodes), to, from;
    int head_li, vl;

    /* the head of a node: the root in its own node, the leader elsewhere */
    head_li = 0;
    if (p->node == rnode) {
        for (int i = 0; i < root; i++)
            head_li += p->node_of == NULL || p->node_of[i] == rnode;
    }
    if (k < rb) {
        if (p->li != head_li) return XCCL_OK;
        binomial_bcast_round(xccl_pat_vrank(p->node, rnode, p->nnodes), p->nnodes, k, &to, &from);
        if (to >= 0) {
            int node = xccl_pat_unvrank(to, rnode, p->nnodes);
            return xccl_task_isend(t, node == rnode ? root : local_rank(p, node, 0), buf, nbytes,
                                   STEP_B + (uint32_t)k);
        }
        if (from >= 0) {
            int node = xccl_pat_unvrank(from, rnode, p->nnodes);
            return xccl_task_irecv(t, node == rnode ? root : local_rank(p, node, 0), buf, nbytes,
                                   STEP_B + (uint32_t)k);
        }
        return XCCL_OK;
    }
    k -= rb;
    vl = xccl_pat_vrank(p->li, head_li, p->L);
    binomial_bcast_round(vl, p->L, k, &to, &from);
    if (to >= 0)
        return xccl_task_isend(t, local_rank(p, p->node, xccl_pat_unvrank(to, head_li, p->L)), buf,
                               nbytes, STEP_C + (uint32_t)k);
    if (from >= 0)
        return xccl_task_irecv(t, local_rank(p, p->node, xccl_pat_unvrank(from, head_li, p->L)),
                               buf, nbytes, STEP_C + (uint32_t)k);
    return XCCL_OK;
}

static xccl_status_t bc_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a      = xccl_task_args(t);
    uint64_t               *w      = xccl_task_state(t); /* w[0]: next round */
    size_t                  nbytes = a->count * a->elsize;
    place_t                 p;
    int                     rounds;
    xccl_status_t           st;

    if (nbytes == 0) return XCCL_OK;
    p      = place_of(t);
    rounds = xccl_pat_log2_ceil(p.nnodes) + xccl_pat_log2_ceil(p.L);
    while ((st = xccl_task_test(t)) == XCCL_OK) {
        if (w[0] == (uint64_t)rounds) return XCCL_OK;
        XCCL_CHECK(bc_post(t, &p, (int)w[0], a->rbuf, nbytes));
        w[0]++;
    }
    return st;
}

static void bc_cost_topo(const xccl_topo_t *topo, int size, size_t nbytes, xccl_cost_t *intra,
                         xccl_cost_t *inter)
{
    double la = xccl_pat_log2_ceil(max_node_size(topo, size));
    double lb = xccl_pat_log2_ceil(topo->nnodes);

    memset(intra, 0, sizeof(*intra));
    memset(inter, 0, sizeof(*inter));
    intra->steps = la;
    intra->bytes = la * (double)nbytes;
    inter->steps = lb;
    inter->bytes = lb * (double)nbytes;
}

/* One node: a binomial broadcast over all ranks. */
static void bc_cost(int n, size_t nbytes, xccl_cost_t *out)
{
    out->steps        = xccl_pat_log2_ceil(n);
    out->bytes        = out->steps * (double)nbytes;
    out->reduce_bytes = 0;
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
