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
 * Models: links inside a node are priced with the best configured transport that serves
 * same-host peers (XCCL_TP_CAP_INTRA_HOST, e.g. shm), links between nodes with the best one
 * that crosses hosts (e.g. tcp); a transport that publishes no α/β gets the core's default.
 * Every rank is configured with the same transports ($XCCL_TRANSPORTS must agree, like
 * $XCCL_ALGO), so every rank prices alike and chooses the same algorithm. The configured
 * candidates count (ctx->model_tp_*), not the transports a rank kept: a rank alone on its
 * host drops shm, which serves none of its peers, and priced with tcp alone it chose another
 * algorithm than its peers did (a hang, found by tests/faults/driver.py).
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

xccl_status_t xccl_comm_topo_init(xccl_comm_t *comm)
{
    const xccl_ctx_t           *ctx     = comm->ctx;
    const xccl_transport_ops_t *inter   = ctx->model_tp_inter;
    const xccl_transport_ops_t *intra   = ctx->model_tp_intra;
    int                        *node_of = malloc((size_t)comm->size * sizeof(int));
    int                         nnodes  = 0;

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
    comm->topo.inter   = transport_model(inter != NULL ? inter : intra);
    comm->topo.intra   = transport_model(intra != NULL ? intra : inter);
    comm->topo.pull    = intra != NULL && (intra->caps & XCCL_TP_CAP_RECV_PULL) != 0;
    comm->topo.scarce  = 0;
    for (int i = 0; i < comm->size; i++)
        comm->topo.scarce |= ctx->peer_scarce[comm->world[i]];
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
