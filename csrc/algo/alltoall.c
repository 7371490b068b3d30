/* SPDX-License-Identifier: Apache-2.0
 *
 * alltoall.c - all-to-all with equal blocks (pairwise exchange, Bruck, linear) and with
 * per-peer counts (pairwise, linear).
 *
 * Buffers as the core hands them over (algo.h): sbuf and rbuf hold one block per rank, and the
 * block a rank keeps for itself is already in place, so no schedule here touches it. Progress
 * functions wait until everything posted has completed, then run the next phase (state word
 * 0), so they never block and resume at any XCCL_INPROGRESS.
 */
#include "algo/algo.h"

#include <string.h>

#include "algo/patterns.h"
#include "core/check.h"


static void set_cost(xccl_cost_t *out, double steps, double bytes)
{
    out->steps        = steps;
    out->bytes        = bytes;
    out->reduce_bytes = 0;
}

/* Pairwise exchange: n - 1 steps; in step s every rank sends to one peer and receives from
 * another (xccl_pat_pairwise_*):
 *
 *   step s = 1 .. n-1   n a power of two: exchange with rank ^ s
 *                       otherwise:        send to rank + s, receive from rank - s (mod n)
 *
 * One exchange in flight at a time keeps every link busy with exactly one message, which is
 * the schedule for large blocks. Cost: n - 1 steps, (n-1)/n * nbytes sent per rank. */
static void pairwise_cost(int size, size_t nbytes, xccl_cost_t *out)
{
    set_cost(out, size - 1, (double)nbytes * (size - 1) / size);
}

static xccl_status_t alltoall_pairwise_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a     = xccl_task_args(t);
    int                     n     = xccl_task_size(t);
    int                     rank  = xccl_task_rank(t);
    uint64_t               *phase = xccl_task_state(t);
    size_t                  blk   = a->count * a->elsize;
    xccl_status_t           st;

    if (n == 1 || blk == 0) return XCCL_OK;
    for (;;) {
        st = xccl_task_test(t);
        if (st != XCCL_OK) return st;
        int s = (int)++*phase;
        if (s >= n) return XCCL_OK;
        int to   = xccl_pat_pairwise_send_peer(rank, n, s);
        int from = xccl_pat_pairwise_recv_peer(rank, n, s);
        XCCL_CHECK(xccl_task_irecv(t, from, (char *)a->rbuf + (size_t)from * blk, blk,
                                   xccl_pat_step_cap(t, (uint64_t)s)));
        XCCL_CHECK(xccl_task_isend(t, to, (const char *)a->sbuf + (size_t)to * blk, blk,
                                   xccl_pat_step_cap(t, (uint64_t)s)));
    }
}

/* Bruck: ceil(log2 n) rounds moving about half of all blocks each, for small blocks where the
 * per-message latency dominates. tmp is an n-block scratch copy indexed by distance:
 *
 *   start       tmp[i] = sbuf block for rank + i                       (local rotation)
 *   round k     send every tmp[i] with bit k of i set, packed, to rank + 2^k;
 *               receive as many from rank - 2^k and unpack them into the same tmp[i]
 *   end         tmp[i] now holds the block from rank - i: rbuf[rank - i] = tmp[i]
 *
 * Round k moves m_k = #{i < n : bit k of i set} blocks (xccl_pat_bruck_a2a_nblocks), at most n/2.
 * Cost: ceil(log2 n) steps, sum_k m_k / n * nbytes sent per rank (~ log2(n)/2 * nbytes). */
static void bruck_cost(int size, size_t nbytes, xccl_cost_t *out)
{
    double blocks = 0;
    int    rounds = xccl_pat_log2_ceil(size);

    for (int k = 0; k < rounds; k++) blocks += xccl_pat_bruck_a2a_nblocks(size, k);
    set_cost(out, rounds, blocks * (double)nbytes / size);
}

/* Copies the tmp blocks whose index has bit k set to or from the packed buffer. */
static xccl_status_t bruck_pack(xccl_task_t *t, char *tmp, char *pack, int n, int k, size_t blk,
                                int unpack)
{
    size_t j = 0;

    for (int i = 1; i < n; i++) {
        if (!(i >> k & 1)) continue;
        if (unpack)
            XCCL_CHECK(xccl_task_copy(t, tmp + (size_t)i * blk, pack + j * blk, blk));
        else
            XCCL_CHECK(xccl_task_copy(t, pack + j * blk, tmp + (size_t)i * blk, blk));
        j++;
    }
    return XCCL_OK;
}

static xccl_status_t alltoall_bruck_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a      = xccl_task_args(t);
    int                     n      = xccl_task_size(t);
    int                     rank   = xccl_task_rank(t);
    int                     rounds = xccl_pat_log2_ceil(n);
    uint64_t               *phase  = xccl_task_state(t);
    size_t                  blk    = a->count * a->elsize;
    size_t                  maxm   = 0, bytes;
    const char             *sbuf   = a->sbuf;
    char                   *rbuf   = a->rbuf, *tmp, *spack, *rpack;
    xccl_status_t           st;

    if (n == 1 || blk == 0) return XCCL_OK;
    for (int k = 0; k < rounds; k++) {
        size_t m = (size_t)xccl_pat_bruck_a2a_nblocks(n, k);
        if (m > maxm) maxm = m;
    }
    bytes = ((size_t)n + 2 * maxm) * blk;
    tmp   = xccl_task_scratch(t, bytes);
    if (tmp == NULL)
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "alltoall bruck: rank %d: cannot allocate %zu "
                          "bytes of scratch", rank, bytes);
    spack = tmp + (size_t)n * blk;
    rpack = spack + maxm * blk;
    for (;;) {
        st = xccl_task_test(t);
        if (st != XCCL_OK) return st;
        int k = (int)(*phase)++;
        if (k == 0) {
            for (int i = 1; i < n; i++)
                XCCL_CHECK(
                    xccl_task_copy(t, tmp + (size_t)i * blk, sbuf + (size_t)((rank + i) % n) * blk,
                                   blk));
        } else {
            XCCL_CHECK(bruck_pack(t, tmp, rpack, n, k - 1, blk, 1));
        }
        if (k == rounds) {
            for (int i = 1; i < n; i++)
                XCCL_CHECK(xccl_task_copy(t, rbuf + (size_t)((rank - i + n) % n) * blk,
                                          tmp + (size_t)i * blk, blk));
            return XCCL_OK;
        }
        int    d = 1 << k;
        size_t m = (size_t)xccl_pat_bruck_a2a_nblocks(n, k);
        XCCL_CHECK(bruck_pack(t, tmp, spack, n, k, blk, 0));
        XCCL_CHECK(xccl_task_irecv(t, (rank - d + n) % n, rpack, m * blk, (uint32_t)k));
        XCCL_CHECK(xccl_task_isend(t, (rank + d) % n, spack, m * blk, (uint32_t)k));
    }
}

/* Linear: post all n - 1 receives and n - 1 sends at once, rank + 1 first so that the ranks
 * start on different peers. Nothing orders the messages, so links may congest with large
 * blocks (on one host it still led pairwise: docs/selection.md). Cost:
 * the exchanges are in flight together, one round's latency as the direct all-gather is
 * priced (xccl_pat_direct_steps), and (n-1)/n * nbytes sent. */
static void linear_cost(int size, size_t nbytes, xccl_cost_t *out)
{
    set_cost(out, xccl_pat_direct_steps(size), (double)nbytes * (size - 1) / size);
}

static xccl_status_t alltoall_linear_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a     = xccl_task_args(t);
    int                     n     = xccl_task_size(t);
    int                     rank  = xccl_task_rank(t);
    uint64_t               *phase = xccl_task_state(t);
    size_t                  blk   = a->count * a->elsize;

    if (n == 1 || blk == 0) return XCCL_OK;
    if ((*phase)++ == 0) {
        for (int s = 1; s < n; s++) {
            int from = (rank - s + n) % n;
            XCCL_CHECK(xccl_task_irecv(t, from, (char *)a->rbuf + (size_t)from * blk, blk, 0));
        }
        for (int s = 1; s < n; s++) {
            int to = (rank + s) % n;
            XCCL_CHECK(xccl_task_isend(t, to, (const char *)a->sbuf + (size_t)to * blk, blk, 0));
        }
    }
    return xccl_task_test(t);
}

/* ALLTOALLV: counts and displacements are in elements. A zero-length piece gets the address
 * of the task's state words, so no null pointer (or null + offset) reaches the transport. */
static char *piece(xccl_task_t *t, const void *base, size_t displ, size_t count, size_t el)
{
    if (count == 0) return (char *)xccl_task_state(t);
    return (char *)base + displ * el;
}

/* ALLTOALLV pairwise: the pairwise schedule above with per-peer lengths. Every step exchanges a
 * message even when its count is 0, so the ranks stay in step, and a piece sent where the
 * receiver expects none fails that receive (longer than posted) instead of lingering
 * unmatched. Cost: as the equal-block pairwise exchange. */
static xccl_status_t alltoallv_pairwise_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a     = xccl_task_args(t);
    int                     n     = xccl_task_size(t);
    int                     rank  = xccl_task_rank(t);
    uint64_t               *phase = xccl_task_state(t);
    size_t                  el    = a->elsize;
    xccl_status_t           st;

    if (n == 1) return XCCL_OK;
    for (;;) {
        st = xccl_task_test(t);
        if (st != XCCL_OK) return st;
        int s = (int)++*phase;
        if (s >= n) return XCCL_OK;
        int      to   = xccl_pat_pairwise_send_peer(rank, n, s);
        int      from = xccl_pat_pairwise_recv_peer(rank, n, s);
        size_t   rc = a->rcounts[from], sc = a->scounts[to];
        uint32_t step = xccl_pat_step_cap(t, (uint64_t)s);
        XCCL_CHECK(xccl_task_irecv(t, from, piece(t, a->rbuf, a->rdispls[from], rc, el), rc * el,
                                   step));
        XCCL_CHECK(xccl_task_isend(t, to, piece(t, a->sbuf, a->sdispls[to], sc, el), sc * el,
                                   step));
    }
}

/* ALLTOALLV linear: every nonzero piece posted at once (zero counts send nothing, which suits
 * sparse exchanges such as expert routing). Cost: as the equal-block linear exchange. */
static xccl_status_t alltoallv_linear_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a     = xccl_task_args(t);
    int                     n     = xccl_task_size(t);
    int                     rank  = xccl_task_rank(t);
    uint64_t               *phase = xccl_task_state(t);
    size_t                  el    = a->elsize;

    if (n == 1) return XCCL_OK;
    if ((*phase)++ == 0) {
        for (int s = 1; s < n; s++) {
            int from = (rank - s + n) % n;
            if (a->rcounts[from] == 0) continue;
            XCCL_CHECK(xccl_task_irecv(t, from, (char *)a->rbuf + a->rdispls[from] * el,
                                       a->rcounts[from] * el, 0));
        }
        for (int s = 1; s < n; s++) {
            int to = (rank + s) % n;
            if (a->scounts[to] == 0) continue;
            XCCL_CHECK(xccl_task_isend(t, to, (const char *)a->sbuf + a->sdispls[to] * el,
                                       a->scounts[to] * el, 0));
        }
    }
    return xccl_task_test(t);
}

const xccl_algo_t xccl_algo_alltoall_pairwise = {
    .name     = "pairwise",
    .coll     = XCCL_COLL_ALLTOALL,
    .summary  = "n-1 steps, one block to rank+s and one from rank-s (xor for powers of two)",
    .cost     = pairwise_cost,
    .progress = alltoall_pairwise_progress,
};

const xccl_algo_t xccl_algo_alltoall_bruck = {
    .name     = "bruck",
    .coll     = XCCL_COLL_ALLTOALL,
    .summary  = "ceil(log2 n) steps, each moving about half the blocks packed, with local "
                "rotations: for small blocks",
    .cost     = bruck_cost,
    .progress = alltoall_bruck_progress,
};

const xccl_algo_t xccl_algo_alltoall_linear = {
    .name     = "linear",
    .coll     = XCCL_COLL_ALLTOALL,
    .summary  = "all n-1 sends and receives posted at once",
    .cost     = linear_cost,
    .progress = alltoall_linear_progress,
};

const xccl_algo_t xccl_algo_alltoallv_pairwise = {
    .name     = "pairwise",
    .coll     = XCCL_COLL_ALLTOALLV,
    .summary  = "n-1 steps, one piece to rank+s and one from rank-s (xor for powers of two), "
                "empty pieces included",
    .cost     = pairwise_cost,
    .progress = alltoallv_pairwise_progress,
};

const xccl_algo_t xccl_algo_alltoallv_linear = {
    .name     = "linear",
    .coll     = XCCL_COLL_ALLTOALLV,
    .summary  = "all nonempty pieces posted at once",
    .cost     = linear_cost,
    .progress = alltoallv_linear_progress,
};
