/* SPDX-License-Identifier: Apache-2.0
 *
 * explain.c - xccl_explain: every algorithm of a collective with its α-β-γ prediction and the
 * one the selector would choose.
 */
#include "core/core.h"

#include <stdio.h>
#include <string.h>

/* Defaults until measurements replace them: loopback TCP on a small VM (20 us per message,
 * 2 GB/s on the wire, 4 GB/s of local reduction). */
static const xccl_cost_model_t default_model = {20e-6, 1.0 / 2.0e9, 1.0 / 4.0e9, 1.0 / 8.0e9};

const xccl_cost_model_t *xccl_core_default_model(void) { return &default_model; }

void xccl_default_model(double model[3])
{
    model[0] = default_model.alpha;
    model[1] = default_model.beta;
    model[2] = default_model.gamma;
}

/* The arguments explain prices: a byte vector of the collective's nbytes (the size in the
 * nccl-tests sense) on `size` ranks. */
static xccl_status_t explain_args(const char *coll, size_t nbytes, int size,
                                  xccl_coll_args_t *args)
{
    xccl_coll_t c;

    for (c = 0; c < XCCL_COLL_COUNT; c++) {
        if (strcmp(xccl_coll_name(c), coll) == 0) break;
    }
    if (c == XCCL_COLL_COUNT)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "explain: unknown collective '%s'", coll);
    memset(args, 0, sizeof(*args));
    args->coll   = c;
    args->dtype  = XCCL_UINT8;
    args->elsize = 1;
    args->op     = XCCL_OP_SUM;
    args->count  = c == XCCL_COLL_ALLREDUCE || c == XCCL_COLL_BROADCAST || c == XCCL_COLL_REDUCE
                       ? nbytes
                       : nbytes / (size_t)size;
    return XCCL_OK;
}

xccl_status_t xccl_comm_choose(const xccl_comm_t *comm, const char *coll, size_t nbytes,
                               char *name, size_t len)
{
    xccl_coll_args_t   args;
    const xccl_algo_t *chosen;

    if (comm == NULL || coll == NULL || name == NULL || len == 0)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "choose: comm, collective and name needed");
    XCCL_CHECK(explain_args(coll, nbytes, comm->size, &args));
    args.topo = &comm->topo; /* as coll.c passes it */
    XCCL_CHECK(xccl_algo_policy.select(NULL, &args, comm->size, nbytes,
                                       comm->topo.nnodes > 1 ? &comm->topo.inter
                                                             : &comm->topo.intra,
                                       NULL, &chosen));
    snprintf(name, len, "%s", chosen->name);
    return XCCL_OK;
}

/* The rows of explain for `args` (args->topo set: priced with its links) under model m, the
 * chosen one marked. */
static int explain_rows(const xccl_coll_args_t *args, int size, size_t nbytes,
                        const xccl_cost_model_t *m, xccl_algo_info_t *out, int max)
{
    const xccl_algo_t *const *list   = xccl_algo_policy.list(args->coll);
    const xccl_algo_t        *chosen = NULL;
    const char               *source = "";
    int                       k      = 0;

    if (xccl_algo_policy.select_source(args, size, nbytes, m, NULL, &chosen, &source) < 0)
        chosen = NULL;
    for (int i = 0; list[i] != NULL && k < max; i++, k++) {
        const xccl_algo_t *a    = list[i];
        xccl_cost_t        cost = {0}, inter = {0};
        xccl_algo_info_t  *o    = &out[k];
        memset(o, 0, sizeof(*o));
        snprintf(o->name, sizeof(o->name), "%s", a->name);
        snprintf(o->summary, sizeof(o->summary), "%s", a->summary ? a->summary : "");
        if (a->cost_topo != NULL && args->topo != NULL)
            a->cost_topo(args->topo, size, nbytes, &cost, &inter);
        else if (a->cost != NULL)
            a->cost(size, nbytes, &cost);
        o->steps        = cost.steps + inter.steps;
        o->bytes        = cost.bytes + inter.bytes;
        o->reduce_bytes = cost.reduce_bytes + inter.reduce_bytes;
        o->copy_bytes   = cost.copy_bytes + inter.copy_bytes;
        o->predicted_s  = xccl_algo_policy.predict(a, args, m, size, nbytes);
        o->applicable =
            (a->applicable == NULL || a->applicable(args, size)) &&
            (!a->shared || (args->topo != NULL && (args->topo->shared & XCCL_SHARED_SEG)));
        o->chosen       = a == chosen;
        if (o->chosen) snprintf(o->source, sizeof(o->source), "%s", source);
    }
    return k;
}

xccl_status_t xccl_explain(const char *coll, size_t nbytes, int size, const double *model,
                           xccl_algo_info_t *out, int max, int *n)
{
    xccl_cost_model_t m;
    xccl_coll_args_t  args;

    if (coll == NULL || out == NULL || n == NULL || size < 1)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "explain: collective, output and size >= 1 needed");
    XCCL_CHECK(explain_args(coll, nbytes, size, &args));
    m = default_model;
    if (model != NULL) {
        m.alpha = model[0];
        m.beta  = model[1];
        m.gamma = model[2];
    }
    *n = explain_rows(&args, size, nbytes, &m, out, max);
    return XCCL_OK;
}

xccl_status_t xccl_comm_explain(const xccl_comm_t *comm, const char *coll, size_t nbytes,
                                xccl_algo_info_t *out, int max, int *n)
{
    xccl_coll_args_t args;

    if (comm == NULL || coll == NULL || out == NULL || n == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "explain: comm, collective and output needed");
    XCCL_CHECK(explain_args(coll, nbytes, comm->size, &args));
    args.topo = &comm->topo; /* as coll.c passes it */
    *n        = explain_rows(&args, comm->size, nbytes,
                             comm->topo.nnodes > 1 ? &comm->topo.inter : &comm->topo.intra, out,
                             max);
    return XCCL_OK;
}
