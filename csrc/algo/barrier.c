/* SPDX-License-Identifier: Apache-2.0
 *
 * barrier.c - barriers made of zero-byte messages: dissemination and linear (gather + release).
 *
 * A zero-byte message is given the address of the task's state words so that no null pointer
 * reaches the transport; nothing is written there.
 */
#include "algo/algo.h"

#include "algo/patterns.h"
#include "core/check.h"

/* Dissemination (Hensgen, Finkel, Manber): L = ceil(log2 n) rounds,
 *
 *   round k   send to rank + 2^k, receive from rank - 2^k (mod n), wait for both
 *
 * After round k a rank has heard, directly or not, from the 2^(k+1) - 1 ranks before it, so
 * after L rounds from everyone. Cost: L steps, no bytes. */
static void dissemination_cost(int size, size_t nbytes, xccl_cost_t *out)
{
    (void)nbytes;
    out->steps        = xccl_pat_log2_ceil(size);
    out->bytes        = 0;
    out->reduce_bytes = 0;
}

static xccl_status_t dissemination_progress(xccl_task_t *t)
{
    int           n     = xccl_task_size(t);
    int           rank  = xccl_task_rank(t);
    uint64_t     *round = xccl_task_state(t);
    xccl_status_t st;

    for (;;) {
        st = xccl_task_test(t);
        if (st != XCCL_OK) return st;
        int k = (int)*round;
        if ((1 << k) >= n) return XCCL_OK;
        ++*round;
        XCCL_CHECK(xccl_task_irecv(t, (rank - (1 << k) + n) % n, round, 0, (uint32_t)k));
        XCCL_CHECK(xccl_task_isend(t, (rank + (1 << k)) % n, round, 0, (uint32_t)k));
    }
}

/* Linear: every rank reports to rank 0, which releases them all once everyone has arrived.
 *
 *   step 0   rank != 0: send to 0 and post the receive of the release;  rank 0: receive n-1
 *   step 1   rank 0: send the n - 1 releases
 *
 * Cost: 2 (n - 1) messages through rank 0. */
static void linear_cost(int size, size_t nbytes, xccl_cost_t *out)
{
    (void)nbytes;
    out->steps        = 2.0 * (size - 1);
    out->bytes        = 0;
    out->reduce_bytes = 0;
}

static xccl_status_t linear_progress(xccl_task_t *t)
{
    int           n     = xccl_task_size(t);
    int           rank  = xccl_task_rank(t);
    uint64_t     *phase = xccl_task_state(t);
    xccl_status_t st;

    if (n == 1) return XCCL_OK;
    for (;;) {
        st = xccl_task_test(t);
        if (st != XCCL_OK) return st;
        uint64_t p = (*phase)++;
        if (rank != 0 && p == 0) {
            XCCL_CHECK(xccl_task_isend(t, 0, phase, 0, 0));
            XCCL_CHECK(xccl_task_irecv(t, 0, phase, 0, 1));
        } else if (rank == 0 && p < 2) {
            for (int peer = 1; peer < n; peer++) {
                if (p == 0)
                    XCCL_CHECK(xccl_task_irecv(t, peer, phase, 0, 0));
                else
                    XCCL_CHECK(xccl_task_isend(t, peer, phase, 0, 1));
            }
        } else {
            return XCCL_OK;
        }
    }
}

const xccl_algo_t xccl_algo_barrier_dissemination = {
    .name     = "dissemination",
    .coll     = XCCL_COLL_BARRIER,
    .summary  = "ceil(log2 n) rounds of empty messages to rank+2^k",
    .cost     = dissemination_cost,
    .progress = dissemination_progress,
};

const xccl_algo_t xccl_algo_barrier_linear = {
    .name     = "linear",
    .coll     = XCCL_COLL_BARRIER,
    .summary  = "everyone reports to rank 0, which then releases everyone: 2(n-1) messages",
    .cost     = linear_cost,
    .progress = linear_progress,
};
