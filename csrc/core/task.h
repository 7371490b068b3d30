/* SPDX-License-Identifier: Apache-2.0
 *
 * task.h - the contract between the core and the collective algorithms, included by both: the
 * collectives, the call arguments, the cost model and topology, the algorithm descriptor, the
 * task primitives the core (or the simulator, tests/c/sim.c) offers algorithms, and the
 * selection policy the core calls. The core never includes csrc/algo/algo.h; the algorithms
 * include this file through it.
 *
 * An algorithm is data (name, collective, summary, cost formula) plus one re-entrant function,
 * `progress`, over a handful of core primitives (xccl_task_*). The core calls progress once to
 * start (with the state words zeroed) and again whenever the task might advance; progress posts
 * sends and receives, returns XCCL_INPROGRESS while it waits for them and XCCL_OK when the
 * collective is complete on this rank. It must never block. It keeps its resume point in the
 * state words (xccl_task_state). Algorithms never include a backend header and never see a
 * transport: they only know ranks of the communicator.
 *
 * Buffers as algorithms see them (the core normalises calls before the algorithm runs):
 *   ALLREDUCE       in place on rbuf (count elements); the core copied sbuf there.
 *   BROADCAST       in place on rbuf (== sbuf) at every rank.
 *   REDUCE          sbuf (count, read-only) on every rank; result into rbuf at the root only
 *                   (rbuf may equal sbuf at the root; rbuf is NULL elsewhere).
 *   ALLGATHER       rbuf holds size*count; this rank's block is already in place.
 *   GATHER          root: rbuf holds size*count with the root's block in place; others: sbuf.
 *   SCATTER         root: sbuf holds size*count; every rank: rbuf (count). The root's own
 *                   block is already copied.
 *   REDUCE_SCATTER  sbuf holds size*count (read-only); rbuf receives count.
 *   ALLTOALL        sbuf / rbuf hold size*count; the self block is already copied.
 *   ALLTOALLV       scounts/sdispls/rcounts/rdispls in elements; self block already copied.
 *   BARRIER         no data.
 * `op` is always a base operator (SUM..BXOR): the core turns AVG into SUM plus a division and
 * PREMUL_SUM into a scaling of the input plus SUM.
 *
 * Local work: operation buffers and scratch may be device memory (args->mem). Algorithms never
 * read or write them directly: every local copy and reduction goes through xccl_task_copy and
 * xccl_task_reduce, which run on the executor of that memory type (core/exec.h). An executor
 * may finish them later. The core then orders a task's primitives like a stream, so
 * algorithms are written as if every primitive finished at once:
 *   - copies and reductions run in the order they were issued (dependent ones need no wait);
 *   - a send or receive posted while a copy or reduction issued before it is unfinished is
 *     held in the task and posted, in posting order, once those have finished (so "reduce,
 *     then isend the result" is correct);
 *   - xccl_task_test reports XCCL_INPROGRESS while a copy, reduction or held request is
 *     unfinished; a failed one fails the test (and the operation);
 *   - progress may return XCCL_OK with copies or reductions unfinished: the operation
 *     completes once they finish.
 * The rule for buffers is unchanged: memory that a pending request uses is not touched by
 * any primitive until xccl_task_test returned XCCL_OK. A sub-task's copies and reductions
 * join its parent's stream.
 *
 * Tags: each message an algorithm posts carries a `step` number (below xccl_task_step_limit:
 * 2^20 for a collective, less in a sub-task). Messages between the same pair of ranks with the
 * same step are matched in posting order; distinct steps keep messages of different phases
 * apart and label them in traces.
 */
#ifndef XCCL_CORE_TASK_H
#define XCCL_CORE_TASK_H

#include <stddef.h>
#include <stdint.h>

#include "xccl/xccl.h"

typedef enum xccl_coll {
    XCCL_COLL_ALLREDUCE = 0,
    XCCL_COLL_BROADCAST,
    XCCL_COLL_REDUCE,
    XCCL_COLL_ALLGATHER,
    XCCL_COLL_GATHER,
    XCCL_COLL_SCATTER,
    XCCL_COLL_REDUCE_SCATTER,
    XCCL_COLL_ALLTOALL,
    XCCL_COLL_ALLTOALLV,
    XCCL_COLL_BARRIER,
    XCCL_COLL_COUNT
} xccl_coll_t;

/* "all_reduce", "broadcast", ... (torch.distributed spelling); "?" if invalid. */
static inline const char *xccl_coll_name(xccl_coll_t coll)
{
    static const char *const names[XCCL_COLL_COUNT] = {
        [XCCL_COLL_ALLREDUCE]      = "all_reduce",
        [XCCL_COLL_BROADCAST]      = "broadcast",
        [XCCL_COLL_REDUCE]         = "reduce",
        [XCCL_COLL_ALLGATHER]      = "all_gather",
        [XCCL_COLL_GATHER]         = "gather",
        [XCCL_COLL_SCATTER]        = "scatter",
        [XCCL_COLL_REDUCE_SCATTER] = "reduce_scatter",
        [XCCL_COLL_ALLTOALL]       = "all_to_all",
        [XCCL_COLL_ALLTOALLV]      = "all_to_all_v",
        [XCCL_COLL_BARRIER]        = "barrier",
    };
    return (unsigned)coll < XCCL_COLL_COUNT ? names[coll] : "?";
}

/* The α-β-γ-δ model: a step costs alpha seconds, each byte sent beta seconds, each byte reduced
 * gamma seconds, each byte a rank copies through memory itself (shared-memory algorithms: a
 * memcpy or a cross-memory-attach read, counted once per byte copied) delta seconds. The core
 * takes α and β from the transports (defaults in explain.c); a tuning table replaces all four
 * with values fitted on the machine. */
typedef struct xccl_cost_model {
    double alpha;
    double beta;
    double gamma;
    double delta;
} xccl_cost_model_t;

/* Where the ranks of a communicator live, for two-level algorithms: node_of[r] in [0, nnodes)
 * is the node (host) of rank r, nodes numbered in the order of their lowest rank; messages
 * inside a node cost `intra`, between nodes `inter`; `pull`: inside a node, receivers copy
 * large payloads from the sender's memory themselves (so a sender's fan-out is parallel);
 * `scarce`: a node of some member runs more ranks of the job than the CPUs they may use, so a
 * message often waits for its receiver to be scheduled. Identical on every rank. */
/* A tuning table ($XCCL_TUNE_FILE, written by xccl-tune): choices measured on one host signature
 * and transport, and a cost model fitted there. Its format belongs to the policy (csrc/algo/
 * tune.c); the core only loads it through the policy, agrees on it across ranks and hands it to
 * the communicators it applies to. */
typedef struct xccl_tune xccl_tune_t;

typedef struct xccl_topo {
    int               nnodes;
    const int        *node_of;
    xccl_cost_model_t intra, inter;
    int               pull;
    int               scarce;
    unsigned          shared; /* XCCL_SHARED_* bits: see "Node-shared memory" below         */
    /* the tuning table measured on this host with this transport, for a communicator on one
     * node (NULL: none; intra is then its fitted model where it has one). Identical on every
     * rank: the core checks that all ranks loaded the same table. */
    const xccl_tune_t *tune;
} xccl_topo_t;

typedef struct xccl_coll_args {
    xccl_coll_t   coll;
    const void   *sbuf;
    void         *rbuf;
    size_t        count; /* elements: per rank for gather-like collectives            */
    xccl_dtype_t  dtype;
    size_t        elsize;
    xccl_op_t     op;    /* base operator                                               */
    int           root;
    const size_t *scounts, *sdispls, *rcounts, *rdispls; /* ALLTOALLV only             */
    const xccl_topo_t *topo; /* NULL: unknown (the simulator, explain without a group)    */
    xccl_mem_type_t    mem;  /* memory type of sbuf, rbuf and the task's scratch            */
} xccl_coll_args_t;

#define XCCL_STEP_MAX         ((1u << 20) - 1)
#define XCCL_TASK_STATE_WORDS 16

typedef struct xccl_task xccl_task_t;
typedef struct xccl_algo xccl_algo_t; /* below */

const xccl_coll_args_t *xccl_task_args(const xccl_task_t *t);
int                     xccl_task_rank(const xccl_task_t *t);
int                     xccl_task_size(const xccl_task_t *t);
/* Algorithm-owned resume state, XCCL_TASK_STATE_WORDS words, zero when progress first runs. */
uint64_t               *xccl_task_state(xccl_task_t *t);

/* Posts a send / receive of nbytes to / from `peer` (a rank of the task - of the communicator,
 * or a member index in a sub-task - never the caller itself). The buffer must stay untouched
 * until xccl_task_test returns XCCL_OK. */
xccl_status_t xccl_task_isend(xccl_task_t *t, int peer, const void *buf, size_t nbytes,
                              uint32_t step);
xccl_status_t xccl_task_irecv(xccl_task_t *t, int peer, void *buf, size_t nbytes,
                              uint32_t step);
/* XCCL_OK when every request posted so far has completed (they are then forgotten),
 * XCCL_INPROGRESS while some are pending, or the first error. */
xccl_status_t xccl_task_test(xccl_task_t *t);
/* Number of requests posted and not yet completed. */
int           xccl_task_pending(const xccl_task_t *t);
/* dst = a op b over `count` elements with the task's dtype and operator (recorded in traces).
 * Runs on the executor of args->mem and may finish later (see "Local work" above). */
xccl_status_t xccl_task_reduce(xccl_task_t *t, void *dst, const void *a, const void *b,
                               size_t count);
/* dst = src over nbytes (the ranges may overlap), on the executor of args->mem; may finish
 * later. The only way an algorithm may move bytes between operation buffers. */
xccl_status_t xccl_task_copy(xccl_task_t *t, void *dst, const void *src, size_t nbytes);
/* A scratch buffer of at least nbytes of the task's memory type, owned by the task (freed at
 * completion). Growing it moves it and does not keep its contents: take pointers after the
 * last call. NULL when out of memory. */
void         *xccl_task_scratch(xccl_task_t *t, size_t nbytes);

/* The bound on step numbers of this task: XCCL_STEP_MAX + 1 for a collective, its step span
 * for a sub-task. Steps must stay below it. */
uint32_t      xccl_task_step_limit(const xccl_task_t *t);

/* Sub-tasks: an algorithm runs another algorithm on some of its ranks as part of its own
 * schedule. A sub-task has its own arguments, members, state words and scratch; inside it
 * xccl_task_rank / size / args / state / scratch are its own and peers are member indices.
 * Member i is rank map[i] of the calling task (distinct ranks, the caller among them). Its
 * message step s travels as step_base + s of the caller (s < step_span): every member must use
 * the same base, and the caller's own messages and the sub-tasks running beside it must use
 * disjoint step ranges. Its requests count as the caller's pending work (xccl_task_test and
 * xccl_task_pending on the caller include them). Buffers in its arguments must stay valid (the
 * caller's scratch must not grow) until it completes. XCCL_TASK_SUBS may run at once. */
#define XCCL_TASK_SUBS 4

/* Runs the sub-task in `slot` once and returns what its progress returned. The first call, or
 * the first after the slot's previous sub-task completed, creates it from algo, args and map
 * (copied; later calls ignore them) with zeroed state words. On XCCL_OK it is gone and the
 * slot is free again; on an error it is freed with the caller. */
xccl_status_t xccl_task_sub(xccl_task_t *t, int slot, const xccl_algo_t *algo,
                            const xccl_coll_args_t *args, const int *map, int nsub,
                            uint32_t step_base, uint32_t step_span);

/* What one rank does in an algorithm, on the critical path: `steps` rounds of messages,
 * `bytes` sent, `reduce_bytes` combined locally. Predicted time = the model applied to it. */
typedef struct xccl_cost {
    double steps;
    double bytes;
    double reduce_bytes;
    double copy_bytes; /* bytes this rank copies through memory itself (priced with delta) */
} xccl_cost_t;

struct xccl_algo {
    const char *name;    /* "ring", "rd", "rabenseifner", "binomial", "bruck", ... */
    xccl_coll_t coll;
    const char *summary; /* one line: the schedule, steps and bytes on the wire      */
    /* NULL: runs everywhere; otherwise 0 when it cannot run these arguments. It may look only
     * at args->count and args->elsize (communicators memoise selections by those). */
    int (*applicable)(const xccl_coll_args_t *args, int size);
    /* Cost for `size` ranks and a message of nbytes, where nbytes is the collective's size in
     * the nccl-tests sense: the whole vector for allreduce/broadcast/reduce, the whole gathered
     * output for allgather/gather/reduce_scatter-input/scatter-input, the whole send buffer
     * for all-to-all, 0 for barrier. */
    void (*cost)(int size, size_t nbytes, xccl_cost_t *out);
    xccl_status_t (*progress)(xccl_task_t *t);
    /* Two-level algorithms only (NULL for the others): the cost split into what crosses links
     * inside nodes (`intra`, priced with topo->intra) and between nodes (`inter`). */
    void (*cost_topo)(const xccl_topo_t *topo, int size, size_t nbytes, xccl_cost_t *intra,
                      xccl_cost_t *inter);
    /* 1: uses the node-shared segment (see "Node-shared memory"); applicable only where
     * args->topo->shared says it can run. */
    int shared;
};

/* ---------------------------------------------------------------------------------------------
 * Node-shared memory: algorithms built for the ranks of one host (csrc/algo/shm.c).
 *
 * A communicator whose ranks all run on one host and map shared memory with one another has
 * topo->shared & XCCL_SHARED_SEG set (identical on every rank; the core decides it from data
 * every rank holds, e.g. XCCL_SHARED=0 in the environment of any member turns it off). Such a
 * communicator owns one segment of xccl_algo_policy.shared_bytes(size) bytes, mapped by every
 * member (at different addresses), zero-filled when created, the same layout everywhere. The
 * core creates, maps and removes it (no file is left behind, also after killed ranks); its
 * layout belongs to the algorithms. XCCL_SHARED_CMA is set too when xccl_task_peer_read works
 * between every pair of members (cross-memory attach: same user, same pid namespace, allowed
 * by ptrace policy).
 *
 * Ownership: an algorithm that uses the segment says so (xccl_algo_t.shared = 1) and calls
 * xccl_task_shared from progress before it touches the segment. The core numbers such
 * collectives when they are posted: `epoch` is 1 for the first collective of the communicator
 * posted with a shared algorithm, 2 for the next, ... (collectives are posted in the same
 * order on every rank, so the epoch of a collective is identical everywhere; algorithms stamp
 * flags with it and never reset them). It grants the segment to one task at a time, in epoch
 * order: XCCL_INPROGRESS means "not yet" (the segment is being created or attached, or the
 * collective of an earlier epoch has not completed on this rank; return XCCL_INPROGRESS and
 * call again). Once granted (XCCL_OK), later calls of the same task return XCCL_OK at once
 * with the same description, and the task holds the segment until it completes (or fails).
 * Sub-tasks are never granted one (XCCL_ERR_NOT_SUPPORTED). A rank may be granted epoch e while a peer still finishes epoch
 * e - 1 (it may still read this rank's slots or buffers of e - 1): the algorithms' protocol
 * must cover that (e.g. "done" counters per rank). Mismatched calls are theirs to catch too:
 * the core sends no fingerprint-check message for a collective of a shared algorithm (it would
 * cost more than the collective), so such an algorithm compares a signature of each peer's
 * call (collective, dtype, op, root, count, algorithm) before it uses the peer's data and
 * fails with XCCL_ERR_MISMATCH naming both calls.
 *
 * Waiting on memory: progress may return XCCL_INPROGRESS with no request pending because a
 * flag in the segment is not set yet; before it does, it calls xccl_task_shared_wait naming the
 * rank whose write it waits for (-1: several). The core then polls the task again and again
 * (yielding the CPU when ranks outnumber CPUs), sleeps only on the segment's doorbell (which
 * xccl_task_shared_signal rings), and names that rank when the operation times out; if that
 * rank's process exits meanwhile (or a transport finds it dead), the operation fails with
 * XCCL_ERR_REMOTE naming it within about 50 ms (every member for -1). An
 * algorithm calls xccl_task_shared_signal after it published writes that others may be waiting
 * for (release stores of its flags); it costs one atomic load while nobody sleeps.
 *
 * Memory order: flags are C11 atomics in the segment; writers publish with release stores,
 * readers check with acquire loads. The core adds no fences of its own to them (the one in
 * xccl_task_shared_signal orders the doorbell only).
 * ------------------------------------------------------------------------------------------- */
/* Device memory of peers. Where the executor of args->mem can share memory between the
 * processes of a host (xccl_task_mem_shareable), an algorithm may map a peer's operation
 * buffers and copy or reduce from and into them with its executor: the rank exports a buffer
 * (a blob of at most XCCL_TASK_BLOB_MAX bytes, which it hands to its peers - through the
 * node-shared segment, say), each peer imports the blob and gets a pointer valid while the
 * exporting rank's operation runs. Exporting may fail for a buffer the device cannot share
 * (XCCL_ERR_NOT_SUPPORTED): every rank must then learn it and fall back the same way.
 * Importing may be refused for now (XCCL_INPROGRESS): mapping may synchronise the device, which
 * the device layer does not do while a caller's stream waits for a gate, and that stream may
 * be waiting for this very operation (xccl_work_wait_stream queues such a wait as soon as the
 * operation is posted). An algorithm must not try again until the refusal lifts - it might
 * never - but give up the mapping and fall back, every rank with it.
 * Copies and reductions on mapped memory are the task's device work (xccl_task_test waits for
 * them); an algorithm must not let a rank complete while a peer may still read or write its
 * buffers (e.g. "done" flags). */
#define XCCL_TASK_BLOB_MAX   128
#define XCCL_TASK_REDUCE_MAX 8
int           xccl_task_mem_shareable(xccl_mem_type_t mem);
xccl_status_t xccl_task_mem_export(xccl_task_t *t, const void *ptr, size_t nbytes, void *blob,
                                   size_t *len);
xccl_status_t xccl_task_mem_import(xccl_task_t *t, const void *blob, size_t len, void **ptr);
/* dst = srcs[0] op ... op srcs[k-1] over count elements (left to right, 2 <= k <=
 * XCCL_TASK_REDUCE_MAX; dst may alias a source), on the task's executor, like xccl_task_reduce. */
xccl_status_t xccl_task_reduce_n(xccl_task_t *t, void *dst, const void *const *srcs, int k,
                                 size_t count);

enum {
    XCCL_SHARED_SEG = 1u << 0, /* a shared segment (xccl_task_shared)                           */
    XCCL_SHARED_CMA = 1u << 1, /* xccl_task_peer_read between every pair                        */
};

typedef struct xccl_shared {
    unsigned char *base;  /* this rank's mapping of the segment (page aligned)                */
    size_t         bytes; /* xccl_algo_policy.shared_bytes(size)                               */
    uint64_t       epoch; /* 1, 2, ...: which shared collective of the communicator this is   */
} xccl_shared_t;

xccl_status_t xccl_task_shared(xccl_task_t *t, xccl_shared_t *out);
/* The task is about to return XCCL_INPROGRESS until `peer` (a rank of the task; -1: several)
 * writes the segment. */
void          xccl_task_shared_wait(xccl_task_t *t, int peer);
/* Wakes ranks sleeping on the segment's doorbell (after this rank's flag writes). */
void          xccl_task_shared_signal(xccl_task_t *t);
/* Copies nbytes from address `src` in the address space of `peer` (a rank of the task) to dst
 * in this process, now (it returns when the bytes are in place; it may take a while for large
 * copies, so algorithms pipeline in chunks). Host memory only; requires topo->shared &
 * XCCL_SHARED_CMA. Recorded in traces like a receive from peer. XCCL_OK, or an error naming the
 * peer and the system's reason (the peer exited: XCCL_ERR_REMOTE). */
xccl_status_t xccl_task_peer_read(xccl_task_t *t, int peer, void *dst, const void *src,
                                  size_t nbytes);

/* ---------------------------------------------------------------------------------------------
 * Selection policy: the core asks it which algorithm runs a call and what algorithms exist;
 * csrc/algo/registry.c, the one file that knows every algorithm, defines it.
 * ------------------------------------------------------------------------------------------- */

/* Selections one communicator remembers. Once the group's size, topology and model are fixed,
 * the choice depends only on the collective, nbytes, count and element size, so the rules and
 * the model run once per distinct call shape, not on every call. The core owns the storage
 * (zero-initialised, one per communicator); only the policy reads and writes it. */
#define XCCL_ALGO_MEMO_SLOTS 32
typedef struct xccl_algo_memo {
    struct xccl_algo_memo_slot {
        const xccl_algo_t *algo; /* NULL: empty */
        size_t             nbytes, count, elsize;
        unsigned           gen;
        xccl_coll_t        coll;
    } slot[XCCL_ALGO_MEMO_SLOTS];
} xccl_algo_memo_t;

typedef struct xccl_algo_policy {
    /* Chooses the algorithm of a call of `size` ranks whose model size is nbytes: `forced`
     * (per call, may be NULL) if given, else the policy's rules and cost model, priced with m.
     * `memo` (may be NULL) remembers choices made without `forced`; thread-safe. Errors name
     * the unknown or inapplicable algorithm and list the valid ones. */
    xccl_status_t (*select)(xccl_algo_memo_t *memo, const xccl_coll_args_t *args, int size,
                            size_t nbytes, const xccl_cost_model_t *m, const char *forced,
                            const xccl_algo_t **out);
    /* Every algorithm of a collective, NULL-terminated (empty for an invalid one). */
    const xccl_algo_t *const *(*list)(xccl_coll_t coll);
    /* The algorithm of `coll` called `name`, or NULL. */
    const xccl_algo_t *(*find)(xccl_coll_t coll, const char *name);
    /* Predicted seconds of `a` for the arguments (args->topo prices two-level algorithms). */
    double (*predict)(const xccl_algo_t *a, const xccl_coll_args_t *args,
                      const xccl_cost_model_t *m, int size, size_t nbytes);
    /* Bytes of the node-shared segment a communicator of `size` ranks needs (0: none). */
    size_t (*shared_bytes)(int size);
    /* select without a memo that also says where the choice came from: "forced" (the call's
     * algo=), "env" ($XCCL_ALGO), "table" (topo->tune), "rule" (a built-in rule) or "model". */
    xccl_status_t (*select_source)(const xccl_coll_args_t *args, int size, size_t nbytes,
                                   const xccl_cost_model_t *m, const char *forced,
                                   const xccl_algo_t **out, const char **source);
    /* Tuning tables. tune_load reads the table at `path` (NULL or "": *out = NULL, *hash = 0);
     * a malformed one fails naming the file and line. *hash identifies its content (ranks that
     * loaded different tables have different hashes). tune_applies says whether t was measured
     * on this host with the transport called `transport`; if so (1) and the table has a
     * fitted model, *m becomes it; if not (0), why[len] says why. */
    xccl_status_t (*tune_load)(const char *path, xccl_tune_t **out, uint64_t *hash);
    int (*tune_applies)(const xccl_tune_t *t, const char *transport, xccl_cost_model_t *m,
                        char *why, size_t len);
    void (*tune_free)(xccl_tune_t *t);
} xccl_algo_policy_t;

extern const xccl_algo_policy_t xccl_algo_policy;

#endif /* XCCL_CORE_TASK_H */
