/* SPDX-License-Identifier: Apache-2.0
 *
 * topo.c - the two-level view of a communicator: which members share a node, and what a
 * message costs inside a node and between nodes.
 *
 * A node is what the shared-memory transport can span: equal host identity (boot id and host
 * name, exchanged through the store at bootstrap) and equal IPC namespace. Nodes are numbered
 * in the order of their lowest member rank, so every member computes the same numbering from
 * the same peer table.
 *
 * Models: links inside a node are priced with the best loaded transport that serves same-host
 * peers (XCCL_TP_CAP_INTRA_HOST, e.g. shm), links between nodes with the best one that crosses
 * hosts (e.g. tcp); a transport that publishes no α/β gets the core's default. Every rank
 * loads the same transports ($XCCL_TRANSPORTS must agree, like $XCCL_ALGO), so every rank
 * prices alike and chooses the same algorithm. The models come from the transports every
 * rank asked for (xccl_ctx_topo_models), not from those this rank loaded and kept: a rank
 * alone on its host loads no shared-memory transport (no peer to reach), yet must price the
 * links inside the other nodes as their members do, or it picks another algorithm than they
 * do and the call hangs until its timeout. A transport between hosts that no rank could start
 * (its address record names it nowhere: ibverbs without an RDMA device) does not price the
 * links, since it carries none; every rank sees the same records and drops the same ones.
 *
 * Node-shared memory (topo.shared) comes from what every rank published of itself at
 * bootstrap (shared.c), so it is the same on every member too.
 */
#include "core/core.h"

#include <stdlib.h>

static xccl_cost_model_t transport_model(const xccl_transport_ops_t *ops)
{
    xccl_cost_model_t m = *xccl_core_default_model();

    if (ops != NULL && ops->alpha > 0 && ops->beta > 0) {
        m.alpha = ops->alpha;
        m.beta  = ops->beta;
    }
    return m;
}

/* The highest-priority transport of `ops` with (intra = 1) or without (intra = 0) the
 * same-host capability; NULL if none. */
static const xccl_transport_ops_t *best_transport(const xccl_transport_ops_t *const *ops, int n,
                                                  int intra)
{
    const xccl_transport_ops_t *best = NULL;

    for (int i = 0; i < n; i++) {
        if (ops[i]->abi_version != XCCL_TRANSPORT_ABI_VERSION) continue;
        if (((ops[i]->caps & XCCL_TP_CAP_INTRA_HOST) != 0) != intra) continue;
        if (best == NULL || ops[i]->priority > best->priority) best = ops[i];
    }
    return best;
}

void xccl_ctx_topo_models(xccl_ctx_t *ctx, const xccl_transport_ops_t *const *cand, int ncand)
{
    const xccl_transport_ops_t *inter = best_transport(cand, ncand, 0);
    const xccl_transport_ops_t *intra = best_transport(cand, ncand, 1);

    ctx->model_inter = transport_model(inter != NULL ? inter : intra);
    ctx->model_intra = transport_model(intra != NULL ? intra : inter);
    ctx->model_pull  = intra != NULL && (intra->caps & XCCL_TP_CAP_RECV_PULL) != 0;
    /* a tuning table applies where it was measured: this host's signature and the transport
     * that carries messages inside it */
    ctx->tune_ok = 0;
    if (ctx->tune != NULL) {
        const xccl_transport_ops_t *tp = intra != NULL ? intra : inter;
        char                        why[512];
        ctx->tune_intra = ctx->model_intra;
        ctx->tune_ok    = xccl_algo_policy.tune_applies(ctx->tune, tp ? tp->name : NULL,
                                                        &ctx->tune_intra, why, sizeof(why));
        if (!ctx->tune_ok) XCCL_WARN("tuning table ignored: %s", why);
    }
}

xccl_status_t xccl_comm_topo_init(xccl_comm_t *comm)
{
    const xccl_ctx_t *ctx     = comm->ctx;
    int              *node_of = malloc((size_t)comm->size * sizeof(int));
    int               nnodes  = 0;

    if (node_of == NULL) return XCCL_ERR_NO_MEMORY;
    for (int i = 0; i < comm->size; i++) {
        const xccl_peer_info_t *pi = &ctx->peers[comm->world[i]];
        node_of[i]                 = -1;
        for (int j = 0; j < i && node_of[i] < 0; j++) {
            const xccl_peer_info_t *pj = &ctx->peers[comm->world[j]];
            if (pj->host_id == pi->host_id && pj->ipc_ns == pi->ipc_ns) node_of[i] = node_of[j];
        }
        if (node_of[i] < 0) node_of[i] = nnodes++;
    }
    comm->topo.nnodes  = nnodes;
    comm->topo.node_of = node_of;
    comm->topo.inter   = ctx->model_inter;
    comm->topo.intra   = ctx->model_intra;
    comm->topo.pull    = ctx->model_pull;
    comm->topo.tune    = NULL;
    if (nnodes == 1 && ctx->tune_ok) { /* measured on one host: used on one host only */
        comm->topo.tune  = ctx->tune;
        comm->topo.intra = ctx->tune_intra;
    }
    comm->topo.scarce  = 0;
    for (int i = 0; i < comm->size; i++)
        comm->topo.scarce |= ctx->peer_scarce[comm->world[i]];
    comm->topo.shared = xccl_shared_bits(comm); /* needs nnodes */
    return XCCL_OK;
}

void xccl_comm_cost_model(const xccl_comm_t *comm, double model[3], int *nnodes)
{
    const xccl_cost_model_t *m = comm->topo.nnodes > 1 ? &comm->topo.inter : &comm->topo.intra;

    model[0] = m->alpha;
    model[1] = m->beta;
    model[2] = m->gamma;
    if (nnodes != NULL) *nnodes = comm->topo.nnodes;
}
