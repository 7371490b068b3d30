/* SPDX-License-Identifier: Apache-2.0
 *
 * algo.h - what the algorithms know of each other: the registry of every algorithm
 * (registry.c) and the selection (select.c) behind the policy table the core calls
 * (xccl_algo_policy, core/task.h). The contract with the core - collectives, arguments, task
 * primitives, the algorithm descriptor - is core/task.h; the core never includes this file.
 */
#ifndef XCCL_ALGO_ALGO_H
#define XCCL_ALGO_ALGO_H

#include "core/task.h"

/* Every algorithm of a collective, NULL-terminated (csrc/algo/registry.c). */
const xccl_algo_t *const *xccl_algo_list(xccl_coll_t coll);
const xccl_algo_t        *xccl_algo_find(xccl_coll_t coll, const char *name);

/* Algorithms that others run as sub-tasks (xccl_task_sub). */
extern const xccl_algo_t xccl_algo_allreduce_ring, xccl_algo_allreduce_rd,
    xccl_algo_allreduce_rabenseifner, xccl_algo_reduce_scatter_ring, xccl_algo_allgather_ring,
    xccl_algo_reduce_binomial, xccl_algo_broadcast_binomial;

/* Predicted seconds of `a` under model m. */
double xccl_algo_predict(const xccl_algo_t *a, const xccl_cost_model_t *m, int size,
                         size_t nbytes);
/* The same for the arguments of a call: a two-level algorithm with args->topo set is priced
 * with topo->intra and topo->inter, any other with m. */
double xccl_algo_predict_args(const xccl_algo_t *a, const xccl_coll_args_t *args,
                              const xccl_cost_model_t *m, int size, size_t nbytes);

/* Chooses the algorithm: `forced` (per call) if given, else a rule of $XCCL_ALGO matching
 * (coll, nbytes), else the applicable algorithm with the lowest predicted time. Errors name the
 * unknown or inapplicable algorithm and list the valid ones. */
xccl_status_t xccl_algo_select(const xccl_coll_args_t *args, int size, size_t nbytes,
                               const xccl_cost_model_t *m, const char *forced,
                               const xccl_algo_t **out);

/* xccl_algo_select through `memo` (zero-initialised, owned by the caller's communicator;
 * thread-safe). Only calls without `forced` are remembered; errors never are. */
xccl_status_t xccl_algo_select_memo(xccl_algo_memo_t *memo, const xccl_coll_args_t *args,
                                    int size, size_t nbytes, const xccl_cost_model_t *m,
                                    const char *forced, const xccl_algo_t **out);

/* xccl_algo_select that also says where the choice came from (xccl_algo_policy.select_source). */
xccl_status_t xccl_algo_select_source(const xccl_coll_args_t *args, int size, size_t nbytes,
                                      const xccl_cost_model_t *m, const char *forced,
                                      const xccl_algo_t **out, const char **source);

/* Tuning tables (tune.c; the policy's tune_* entries). xccl_tune_lookup: the algorithm the
 * table chose for (coll, size ranks, nbytes), or NULL where it has no choice. xccl_tune_host:
 * this host's signature (CPU model, online cores). */
xccl_status_t xccl_tune_load(const char *path, xccl_tune_t **out, uint64_t *hash);
int  xccl_tune_applies(const xccl_tune_t *t, const char *transport, xccl_cost_model_t *m, char *why,
                       size_t len);
void xccl_tune_free(xccl_tune_t *t);
const char *xccl_tune_lookup(const xccl_tune_t *t, xccl_coll_t coll, int size, size_t nbytes);
void        xccl_tune_host(char *cpu, size_t len, int *cores);

#endif /* XCCL_ALGO_ALGO_H */
