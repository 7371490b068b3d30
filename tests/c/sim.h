/* SPDX-License-Identifier: Apache-2.0
 *
 * sim.h - a deterministic in-process simulator of the xccl_task_* primitives (csrc/core/task.h)
 * for testing collective algorithms without transports: N simulated ranks run one algorithm
 * in a single thread.
 *
 * Model
 *   - isend/irecv post into per-(src, dst) queues; a receive matches the oldest unmatched send
 *     of the same step (posting order), and sizes must agree exactly.
 *   - Matched pairs are delivered (memcpy from the send buffer at that moment) by a "network"
 *     phase between scheduler passes; with a nonzero seed each is held back at random
 *     (deterministically), so algorithms see XCCL_INPROGRESS at every point. A send completes
 *     only when delivered (rendezvous): schedules that rely on eager buffering deadlock here.
 *   - The scheduler calls every unfinished rank's progress once per pass, in rank order, also
 *     when nothing changed for it. A pass in which no rank posted, completed a request or
 *     finished, while nothing is deliverable, is a deadlock: sim_run fails and describes
 *     every rank's pending requests.
 *   - Misuse is an error naming the rank: sending to itself or out of range, a step above
 *     XCCL_STEP_MAX, a receive (or reduction) into memory that a pending request of the same
 *     rank uses, growing the scratch while a request points into it, returning XCCL_OK with
 *     requests pending, unmatched messages at the end.
 *   - Every message is recorded (in posting order) with its step and size; reductions are
 *     counted per rank, so tests can compare traffic with the algorithms' cost formulas.
 *   - New scratch memory is filled with 0xA5 so that reading it before writing shows; growing
 *     the scratch does not keep its contents.
 *   - Memory types: each rank's copies, reductions and scratch go through the executor of
 *     args[r].mem (core/exec.h; tests install fake ones). Executor events are ordered as
 *     task.h says: sends and receives posted behind unfinished events are held, tests report
 *     XCCL_INPROGRESS while events run, a rank whose progress returned XCCL_OK finishes once
 *     its events did.
 *   - Node-shared memory (task.h): a rank whose args->topo has XCCL_SHARED_SEG is granted
 *     one segment of the run (xccl_algo_policy.shared_bytes(size) or opts->shared_bytes),
 *     zero-filled, mapped at a different address for every rank (one memfd mapped `size`
 *     times, a PROT_NONE page after each), readable and writable only while that rank's
 *     progress runs and it holds the grant, so that touching it before xccl_task_shared
 *     said XCCL_OK, after completion, or through another rank's address faults. Epochs are
 *     numbered in sequence order (1, 2, ...); with a seed, grants are delayed at
 *     random. A rank that returns XCCL_INPROGRESS with nothing pending and no
 *     xccl_task_shared_wait is an error; waits re-poll, and a pass in which nothing moved
 *     (no post, delivery, copy, read, signal, grant) is a deadlock naming the awaited ranks.
 *     xccl_task_peer_read (XCCL_SHARED_CMA only) copies from the peer's buffers of the same
 *     collective, which must not have completed on the peer: reading any other address, or
 *     a buffer whose owner moved on, is an error.
 *   - Sequences (sim_run_seq): every rank runs ncoll collectives in order, starting the next
 *     as soon as its previous one completed, so a rank may be one or more epochs ahead.
 *   - Sub-tasks (xccl_task_sub) run as task.h says: their messages are the rank's, with mapped
 *     peers and offset steps, their local work joins the rank's stream; a sub-task posting
 *     outside its members or step span, one started without the caller among its members, and
 *     a task returning XCCL_OK with a sub-task running are errors.
 *
 * Not thread-safe: one sim_run at a time per process.
 */
#ifndef XCCL_TESTS_SIM_H
#define XCCL_TESTS_SIM_H

#include <stddef.h>
#include <stdint.h>

#include "algo/algo.h"

typedef struct sim_msg {
    int      src, dst;
    uint32_t step;
    size_t   nbytes;
} sim_msg_t;

typedef struct sim_opts {
    uint64_t seed;       /* 0: deliver every matched message at the end of each pass      */
    long     max_passes; /* 0: 10 million                                                 */
    size_t   shared_bytes; /* the segment's size; 0: xccl_algo_policy.shared_bytes(size)   */
    int      slow;       /* with a seed: a pass skips each rank at random (slow processes),  */
                         /* so ranks drift epochs apart                                    */
    /* Called with 1 before the network phase copies payloads and with 0 after it (NULL:
     * none): lets a test keep executor memory inaccessible outside executor calls. */
    void (*transfer_access)(int open);
} sim_opts_t;

typedef struct sim_result {
    sim_msg_t *msgs; /* every message sent, in posting order                              */
    size_t     nmsgs;
    size_t    *reduce_bytes; /* per rank: bytes written by xccl_task_reduce               */
    size_t    *reduce_calls; /* per rank                                                  */
    size_t    *copy_bytes;   /* per rank: bytes copied by xccl_task_copy                      */
    size_t    *read_bytes;   /* per rank: bytes read by xccl_task_peer_read                   */
    size_t    *read_calls;   /* per rank                                                      */
    size_t    *signals;      /* per rank: xccl_task_shared_signal calls                       */
    long       passes;       /* scheduler passes until every rank finished                */
    char       error[4096];  /* why sim_run failed ("" on success)                        */
} sim_result_t;

/* Runs `algo` on `size` ranks, rank r with args[r] (buffers owned by the caller). Returns
 * XCCL_OK when every rank's progress returned XCCL_OK, the first negative status of an
 * algorithm, or XCCL_ERR_INTERNAL for a deadlock or a misuse (see res->error). `opts` may be
 * NULL. res must be released with sim_result_free, also after a failure. */
xccl_status_t sim_run(const xccl_algo_t *algo, int size, const xccl_coll_args_t *args,
                      const sim_opts_t *opts, sim_result_t *res);
void          sim_result_free(sim_result_t *res);

/* Runs ncoll collectives back to back: rank r runs algos[c] with args[c * size + r] for
 * c = 0, 1, ... in order, each started once the previous one completed on that rank. */
xccl_status_t sim_run_seq(const xccl_algo_t *const *algos, int ncoll, int size,
                          const xccl_coll_args_t *args, const sim_opts_t *opts,
                          sim_result_t *res);

/* Totals over the recorded messages; rank < 0 means every rank. */
size_t sim_sent_msgs(const sim_result_t *res, int rank);
size_t sim_sent_bytes(const sim_result_t *res, int rank);
/* Distinct step numbers used by messages sent from `rank` (< 0: any rank). */
size_t sim_distinct_steps(const sim_result_t *res, int rank);

#endif /* XCCL_TESTS_SIM_H */
