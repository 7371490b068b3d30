/* SPDX-License-Identifier: Apache-2.0
 *
 * registry.c - the table of every collective algorithm, by collective, and its lookup. The
 * order of a list is the tie-break of the cost-model selection (select.c): first wins.
 * Adding an algorithm = defining its xccl_algo_t in its file and naming it here. This file also
 * installs the selection policy the core calls (xccl_algo_policy, core/task.h).
 */
#include "algo/algo.h"
#include "algo/shm.h"

#include <string.h>

extern const xccl_algo_t xccl_algo_allreduce_ring, xccl_algo_allreduce_rd,
    xccl_algo_allreduce_rabenseifner, xccl_algo_allreduce_direct, xccl_algo_allreduce_owner,
    xccl_algo_allreduce_hier, xccl_algo_allreduce_hier_rs;
extern const xccl_algo_t xccl_algo_broadcast_binomial, xccl_algo_broadcast_linear,
    xccl_algo_broadcast_scatter_allgather, xccl_algo_broadcast_chain, xccl_algo_broadcast_hier;
extern const xccl_algo_t xccl_algo_reduce_binomial, xccl_algo_reduce_linear;
extern const xccl_algo_t xccl_algo_allgather_ring, xccl_algo_allgather_rd,
    xccl_algo_allgather_bruck, xccl_algo_allgather_direct;
extern const xccl_algo_t xccl_algo_gather_binomial, xccl_algo_gather_linear;
extern const xccl_algo_t xccl_algo_scatter_binomial, xccl_algo_scatter_linear;
extern const xccl_algo_t xccl_algo_reduce_scatter_ring, xccl_algo_reduce_scatter_rhd,
    xccl_algo_reduce_scatter_direct, xccl_algo_reduce_scatter_owner;
extern const xccl_algo_t xccl_algo_alltoall_pairwise, xccl_algo_alltoall_bruck,
    xccl_algo_alltoall_linear;
extern const xccl_algo_t xccl_algo_alltoallv_pairwise, xccl_algo_alltoallv_linear;
extern const xccl_algo_t xccl_algo_barrier_dissemination, xccl_algo_barrier_linear;
/* one host: through the node-shared segment's slots (shm.c), by cross-memory reads (shm_cma.c) */
extern const xccl_algo_t xccl_algo_allreduce_shm, xccl_algo_broadcast_shm, xccl_algo_reduce_shm,
    xccl_algo_allgather_shm, xccl_algo_gather_shm, xccl_algo_scatter_shm,
    xccl_algo_reduce_scatter_shm, xccl_algo_alltoall_shm, xccl_algo_alltoallv_shm,
    xccl_algo_barrier_shm;
extern const xccl_algo_t xccl_algo_allreduce_cma, xccl_algo_broadcast_cma, xccl_algo_reduce_cma,
    xccl_algo_allgather_cma, xccl_algo_gather_cma, xccl_algo_scatter_cma,
    xccl_algo_reduce_scatter_cma, xccl_algo_alltoall_cma;
/* one host, device memory mapped between the ranks (shm_dev.c) */
extern const xccl_algo_t xccl_algo_allreduce_devmap, xccl_algo_broadcast_devmap,
    xccl_algo_reduce_devmap, xccl_algo_allgather_devmap, xccl_algo_gather_devmap,
    xccl_algo_scatter_devmap, xccl_algo_reduce_scatter_devmap, xccl_algo_alltoall_devmap;

static const xccl_algo_t *const allreduce_algos[] = {
    &xccl_algo_allreduce_ring,         &xccl_algo_allreduce_rd,
    &xccl_algo_allreduce_rabenseifner, &xccl_algo_allreduce_direct,
    &xccl_algo_allreduce_owner,        &xccl_algo_allreduce_hier,
    &xccl_algo_allreduce_hier_rs,      &xccl_algo_allreduce_shm,
    &xccl_algo_allreduce_cma,          &xccl_algo_allreduce_devmap,
    NULL};
static const xccl_algo_t *const broadcast_algos[] = {&xccl_algo_broadcast_binomial,
                                                     &xccl_algo_broadcast_linear,
                                                     &xccl_algo_broadcast_scatter_allgather,
                                                     &xccl_algo_broadcast_chain,
                                                     &xccl_algo_broadcast_hier,
                                                     &xccl_algo_broadcast_shm,
                                                     &xccl_algo_broadcast_cma,
                                                     &xccl_algo_broadcast_devmap,
                                                     NULL};
static const xccl_algo_t *const reduce_algos[] = {&xccl_algo_reduce_binomial,
                                                  &xccl_algo_reduce_linear, &xccl_algo_reduce_shm,
                                                  &xccl_algo_reduce_cma,
                                                  &xccl_algo_reduce_devmap, NULL};
static const xccl_algo_t *const allgather_algos[] = {&xccl_algo_allgather_ring,
                                                     &xccl_algo_allgather_rd,
                                                     &xccl_algo_allgather_bruck,
                                                     &xccl_algo_allgather_direct,
                                                     &xccl_algo_allgather_shm,
                                                     &xccl_algo_allgather_cma,
                                                     &xccl_algo_allgather_devmap,
                                                     NULL};
static const xccl_algo_t *const gather_algos[]  = {&xccl_algo_gather_binomial,
                                                   &xccl_algo_gather_linear, &xccl_algo_gather_shm,
                                                   &xccl_algo_gather_cma,
                                                   &xccl_algo_gather_devmap, NULL};
static const xccl_algo_t *const scatter_algos[] = {
    &xccl_algo_scatter_binomial, &xccl_algo_scatter_linear, &xccl_algo_scatter_shm,
    &xccl_algo_scatter_cma, &xccl_algo_scatter_devmap, NULL};
static const xccl_algo_t *const reduce_scatter_algos[] = {&xccl_algo_reduce_scatter_ring,
                                                          &xccl_algo_reduce_scatter_rhd,
                                                          &xccl_algo_reduce_scatter_direct,
                                                          &xccl_algo_reduce_scatter_owner,
                                                          &xccl_algo_reduce_scatter_shm,
                                                          &xccl_algo_reduce_scatter_cma,
                                                          &xccl_algo_reduce_scatter_devmap,
                                                          NULL};
static const xccl_algo_t *const alltoall_algos[]       = {
    &xccl_algo_alltoall_pairwise, &xccl_algo_alltoall_bruck, &xccl_algo_alltoall_linear,
    &xccl_algo_alltoall_shm,      &xccl_algo_alltoall_cma,   &xccl_algo_alltoall_devmap,
    NULL};
static const xccl_algo_t *const alltoallv_algos[] = {
    &xccl_algo_alltoallv_pairwise, &xccl_algo_alltoallv_linear, &xccl_algo_alltoallv_shm, NULL};
static const xccl_algo_t *const barrier_algos[] = {
    &xccl_algo_barrier_dissemination, &xccl_algo_barrier_linear, &xccl_algo_barrier_shm, NULL};

/* Indexed by xccl_coll_t. */
static const xccl_algo_t *const *const colls[XCCL_COLL_COUNT] = {
    [XCCL_COLL_ALLREDUCE]      = allreduce_algos,
    [XCCL_COLL_BROADCAST]      = broadcast_algos,
    [XCCL_COLL_REDUCE]         = reduce_algos,
    [XCCL_COLL_ALLGATHER]      = allgather_algos,
    [XCCL_COLL_GATHER]         = gather_algos,
    [XCCL_COLL_SCATTER]        = scatter_algos,
    [XCCL_COLL_REDUCE_SCATTER] = reduce_scatter_algos,
    [XCCL_COLL_ALLTOALL]       = alltoall_algos,
    [XCCL_COLL_ALLTOALLV]      = alltoallv_algos,
    [XCCL_COLL_BARRIER]        = barrier_algos,
};

const xccl_algo_t *const *xccl_algo_list(xccl_coll_t coll)
{
    static const xccl_algo_t *const none[] = {NULL};
    return (unsigned)coll < XCCL_COLL_COUNT ? colls[coll] : none;
}

const xccl_algo_t *xccl_algo_find(xccl_coll_t coll, const char *name)
{
    const xccl_algo_t *const *list = xccl_algo_list(coll);

    if (name == NULL) return NULL;
    for (int i = 0; list[i] != NULL; i++)
        if (strcmp(list[i]->name, name) == 0) return list[i];
    return NULL;
}

double xccl_algo_predict(const xccl_algo_t *a, const xccl_cost_model_t *m, int size,
                         size_t nbytes)
{
    xccl_cost_t c = {0};

    if (a->cost != NULL) a->cost(size, nbytes, &c);
    return c.steps * m->alpha + c.bytes * m->beta + c.reduce_bytes * m->gamma +
           c.copy_bytes * m->delta;
}

double xccl_algo_predict_args(const xccl_algo_t *a, const xccl_coll_args_t *args,
                              const xccl_cost_model_t *m, int size, size_t nbytes)
{
    xccl_cost_t intra = {0}, inter = {0};

    if (a->cost_topo == NULL || args->topo == NULL) return xccl_algo_predict(a, m, size, nbytes);
    a->cost_topo(args->topo, size, nbytes, &intra, &inter);
    return intra.steps * args->topo->intra.alpha + intra.bytes * args->topo->intra.beta +
           intra.reduce_bytes * args->topo->intra.gamma +
           intra.copy_bytes * args->topo->intra.delta + inter.steps * args->topo->inter.alpha +
           inter.bytes * args->topo->inter.beta + inter.reduce_bytes * args->topo->inter.gamma +
           inter.copy_bytes * args->topo->inter.delta;
}

/* The one-host algorithms' segment: per rank a control block and two data slots (shm.h). */
static size_t shared_bytes(int size)
{
    return shm_segment_bytes(size);
}

const xccl_algo_policy_t xccl_algo_policy = {
    .select        = xccl_algo_select_memo,
    .list          = xccl_algo_list,
    .find          = xccl_algo_find,
    .predict       = xccl_algo_predict_args,
    .shared_bytes  = shared_bytes,
    .select_source = xccl_algo_select_source,
    .tune_load     = xccl_tune_load,
    .tune_applies  = xccl_tune_applies,
    .tune_free     = xccl_tune_free,
};
