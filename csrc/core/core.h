/* SPDX-License-Identifier: Apache-2.0
 *
 * core.h - internal structures of the engine: the context (transports, matching, progress),
 * communicators, requests and Work.
 *
 * Ownership and locking
 *   A context (xccl_ctx) is created with a world communicator and shared by every communicator
 *   split from it. ctx->lock serialises everything that touches transports, the matching queues
 *   and the lists of active Works; algorithms run under it. Transports call the upcalls in
 *   ctx.c with the lock held. Work completion callbacks run after the lock is released.
 *   Communicators are reference counted (struct xccl_comm); Works by atomic counts (work.c).
 *
 * Tags (64 bits, compared whole; see tag_* below)
 *   kind (2 bits) | payload (62 bits)
 *     P2P:   the user's tag (32 bits)
 *     COLL:  seq (42 bits) << 20 | algorithm step (20 bits)
 *     CTRL:  control messages handled at match time (mismatch notices)
 */
#ifndef XCCL_CORE_CORE_H
#define XCCL_CORE_CORE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "core/check.h"
#include "core/exec.h"
#include "core/rcache.h"
#include "core/task.h"
#include "core/u64map.h"
#include "xccl/xccl.h"
#include "xccl/xccl_transport.h"

#define XCCL_MAX_TRANSPORTS 6

enum { TAG_KIND_P2P = 0, TAG_KIND_COLL = 1, TAG_KIND_CTRL = 2 };

#define TAG_SEQ_MASK ((1ull << 42) - 1) /* sequence numbers wrap at 2^42 */

static inline uint64_t tag_p2p(uint32_t tag) { return (uint64_t)tag; }
static inline uint64_t tag_coll(uint64_t seq, uint32_t step)
{
    return ((uint64_t)TAG_KIND_COLL << 62) | ((seq & TAG_SEQ_MASK) << 20) | step;
}
/* CTRL tags: bit 60 set = fingerprint check (sent to the next rank by every collective whose
 * start sent that rank no data message - which carries the fingerprint too - so a mismatch is
 * found even when the mismatched calls would exchange no message); clear = a mismatch notice
 * whose payload is the notifier's message. */
#define TAG_CTRL_CHECK (1ull << 60)
/* bit 59 set = failure notice: the sender's part of collective `seq` failed because a peer
 * died; the payload says why, so ranks that wait on the sender fail at once. */
#define TAG_CTRL_FAIL (1ull << 59)
static inline uint64_t tag_ctrl(uint64_t seq) { return ((uint64_t)TAG_KIND_CTRL << 62) | seq; }
static inline uint64_t tag_ctrl_seq(uint64_t tag) { return tag & TAG_SEQ_MASK; }
static inline int      tag_kind(uint64_t tag) { return (int)(tag >> 62); }
static inline uint64_t tag_seq(uint64_t tag) { return (tag >> 20) & TAG_SEQ_MASK; }

/* Fingerprint of a collective call: coll(4) dtype(4) op(4) root(12) count(40). */
uint64_t xccl_fp_make(xccl_coll_t coll, xccl_dtype_t dtype, xccl_op_t op, int root,
                      uint64_t count);
/* "all_reduce(dtype=float32, count=10, op=sum)" into buf. */
const char *xccl_fp_str(uint64_t fp, char *buf, size_t len);

typedef struct xccl_ctx  xccl_ctx_t;
typedef struct xccl_req  xccl_req_t;
typedef struct xccl_umsg xccl_umsg_t;
typedef struct xccl_sbuf xccl_sbuf_t;

/* A host bounce buffer of the staging pool (ctx.c, "Staging"): device memory sent to or
 * received from a peer whose transports move host memory only passes through one. */
struct xccl_sbuf {
    void        *p;
    size_t       cap;    /* bytes (what a registering transport registers, every time)    */
    int          pooled; /* 0: a one-off allocation (a receive found the pool used up)     */
    int          busy;
    xccl_sbuf_t *next;   /* ctx->stage_free while free                                     */
    xccl_sbuf_t *anext;  /* ctx->stage_all: every bounce buffer, freed with the context    */
    int          pinned;    /* registered (host_register) with an executor...               */
    int          pinned_by; /* ...the one of this memory type, which releases it           */
    int          pin_later; /* declined for now (a stream waited): tried again when returned  */
};

typedef enum { REQ_SEND, REQ_RECV } req_kind_t;

/* Request states: in the posted queue, held by a transport, finished. */
enum { REQ_POSTED = 1, REQ_ACTIVE = 2, REQ_DONE = 3 };

/* One send or receive. Sends live in a transport until send_done; receives sit in the posted
 * queue until a message matches, then in a transport until recv_done. */
enum { COOKIE_REQ = 0x52455131, COOKIE_UMSG = 0x554d5347 };

struct xccl_req {
    int          ctype;   /* COOKIE_REQ: upcall cookies are requests or unexpected messages */
    req_kind_t   kind;
    int          state;   /* REQ_POSTED, REQ_ACTIVE (in a transport), REQ_DONE            */
    xccl_status_t status; /* XCCL_INPROGRESS until done                                  */
    int          peer;    /* world rank; XCCL_ANY_SOURCE for any-source receives           */
    int          src;     /* world rank the matched message came from; -1 before a match   */
    uint64_t     comm_id;
    uint64_t     tag;
    uint64_t     fp;
    void        *buf;
    xccl_mem_type_t mem;  /* memory type of buf                                             */
    size_t       nbytes;  /* capacity (recv) or length (send)                               */
    size_t       received;
    uint32_t     step;
    uint64_t     t0, t1;  /* trace times                                                    */
    int          text;    /* allocated with its payload after it (control notices): freed,
                           * never pooled                                                 */
    int          tp;      /* slot of the transport holding it (REQ_ACTIVE); -1: self        */
    xccl_rreg_t *reg;     /* its buffer's registration with that transport, or NULL        */
    void        *ev;      /* recv: executor event of the copy out of a staged message     */
    xccl_umsg_t *umsg;    /* recv: unexpected message being completed into this request     */
    /* staging (device memory over a host-memory transport): the bounce buffer; a send on
     * ctx->stage_q (linked through `next`) until handed to its transport, with the status
     * that cancelled it while an executor copy was still running */
    xccl_sbuf_t *sbuf;
    int          staged;  /* send: its data goes through sbuf (else only queued in order)  */
    int          copied;  /* send: the copy into sbuf finished                            */
    int          on_stage_q;
    xccl_status_t stage_cancel;
    xccl_work_t *work;    /* owner                                                          */
    uint64_t     pseq;    /* recv: posting order within its communicator (any-source rule)  */
    xccl_req_t  *next, *prev; /* recv: its posted queue (comm->posted[peer] or comm->any)   */
    xccl_req_t  *wnext;   /* the Work's request list                                      */
};

/* The world rank a request exchanges with: a send's destination, a receive's posted source,
 * or for an any-source receive the source of the message it matched; -1 while an any-source
 * receive has matched nothing. */
static inline int xccl_req_world_peer(const xccl_req_t *r);

/* A message that arrived before its receive was posted. It is on ctx->unexp (every one, in
 * arrival order) and, once its communicator exists here, on that communicator's lists: a
 * control message on comm->ctrl (cidx -1), any other on its queue for the sender
 * (comm->unexp[cidx]) and on the communicator's arrival list (any-source receives). */
struct xccl_umsg {
    int            ctype; /* COOKIE_UMSG */
    int            src;   /* world rank */
    xccl_msg_hdr_t hdr;
    void          *data;
    int            done; /* payload fully arrived */
    xccl_status_t  status;
    xccl_req_t    *waiter; /* receive matched while the payload was still arriving */
    /* data's registration with the transport writing it (XCCL_TP_CAP_NEEDS_REG), held until
     * recv_done; rc stays set so that data leaves that cache when it is freed */
    xccl_rcache_t *rc;
    xccl_rreg_t   *reg;
    xccl_comm_t   *comm;   /* whose queues it is on; NULL: only on ctx->unexp            */
    int            cidx;   /* comm rank of src; -1: a control message (on comm->ctrl)  */
    xccl_umsg_t   *next, *prev;   /* ctx->unexp                                         */
    xccl_umsg_t   *pnext, *pprev; /* comm->unexp[cidx], or comm->ctrl                   */
    xccl_umsg_t   *anext, *aprev; /* comm->arrivals                                     */
};

typedef struct xccl_req_q {
    xccl_req_t *head, *tail;
} xccl_req_q_t;
typedef struct xccl_umsg_q {
    xccl_umsg_t *head, *tail;
} xccl_umsg_q_t;

/* A communicator is freed (under the context lock) once it is destroyed and nothing references
 * it: `refs` counts the user's handle until xccl_comm_destroy, each active Work (activate to
 * finish) and each request of its Works that a transport holds. A finished Work may outlive its
 * communicator: the Work accessors never read w->comm once it finished. A freed communicator's
 * id stays known for a while (ctx->gone) so that its late traffic is recognised and dropped. */
struct xccl_comm {
    xccl_ctx_t  *ctx;
    uint64_t     id;
    int          rank, size;
    int         *world; /* world rank of each comm rank                                    */
    int         *rank_of; /* comm rank of each world rank (-1: not a member)               */
    /* matching (ctx.c): posted specific receives and unexpected messages per sending comm
     * rank, posted any-source receives, unexpected messages in arrival order; the active
     * collectives by seq + 1 (fingerprint checks) */
    xccl_req_q_t  *posted;
    xccl_req_q_t   any;
    xccl_umsg_q_t *unexp;
    xccl_umsg_q_t  arrivals;
    xccl_umsg_q_t  ctrl; /* control messages not consumed yet (collectives not posted yet) */
    uint64_t       post_seq;
    xccl_u64map_t  colls;
    uint64_t     next_seq;
    uint64_t     parent_id; /* id of the communicator it was split from (0: none)        */
    int64_t      timeout_ms;
    int          destroyed;
    int          refs;  /* see above (under the context lock)                            */
    xccl_status_t async_error;
    /* why this communicator's collectives cannot go on, or NULL: a collective of a member
     * failed with XCCL_ERR_REMOTE (a peer vanished), so that member takes part in no later
     * one; set by xccl_coll_break, freed with the communicator */
    char         *broken;
    char         name[64];
    /* tracing (trace.c): a ring of events, off when trace_cap == 0 */
    xccl_trace_event_t *trace;
    size_t              trace_cap, trace_head, trace_n;
    uint64_t            trace_dropped;
    /* flight recorder: the last XCCL_FLIGHT_LEN finished operations */
    struct xccl_flight {
        uint64_t      seq;
        const char   *name;
        const char   *algo;
        xccl_status_t status;
        uint64_t      t_enq, t_end;
    } flight[32];
    uint64_t     nflight;
    xccl_topo_t  topo;  /* nodes of the members and the α-β of links (topo.c)           */
    /* node-shared memory (shared.c): the segment, mapped at the first grant (NULL before),
     * and the number of collectives posted with a shared algorithm (the last epoch) */
    struct xccl_shseg *shseg;
    uint64_t          shared_posted;
    xccl_algo_memo_t memo; /* algorithms chosen for earlier call shapes (the policy)    */
    /* scratch kept from a finished operation, per memory type (coll.c) */
    void        *spare[XCCL_MEM_TYPES];
    size_t       spare_len[XCCL_MEM_TYPES];
    /* the executor queue of each memory type (exec.h queue_new: a stream of this communicator
     * on a device), made by the first operation on that type; NULL: the executor's default */
    void *_Atomic queue[XCCL_MEM_TYPES];
    xccl_work_t *works_head, *works_tail; /* active Works (work.c)                      */
    /* splits made from this communicator, per member list (key: digest of the world ranks;
     * value: how many, as an integer): a split's id hashes in that count (comm.c) */
    xccl_u64map_t splits;
};

static inline int xccl_req_world_peer(const xccl_req_t *r)
{
    if (r->kind == REQ_SEND || r->peer != XCCL_ANY_SOURCE) return r->peer;
    if (r->src >= 0) return r->src;
    return r->umsg != NULL ? r->umsg->src : -1;
}

typedef enum { WORK_P2P, WORK_COLL } work_kind_t;

/* A send or receive an algorithm posted while executor events issued before it were
 * unfinished (task.h, "Local work"): posted once every event numbered below `fence` is done. */
typedef struct xccl_held {
    req_kind_t        kind;
    int               peer; /* comm rank */
    void             *buf;
    size_t            nbytes;
    uint32_t          step;
    uint64_t          fence;
    struct xccl_held *next;
} xccl_held_t;

struct xccl_task {
    const xccl_algo_t *algo;
    xccl_coll_args_t   args;
    uint64_t           state[XCCL_TASK_STATE_WORDS];
    xccl_req_t        *reqs; /* pending requests of the current phase                      */
    int                npending;
    void              *scratch;
    size_t             scratch_len;
    int                sent_next; /* a message of this operation went to rank + 1        */
    int                algo_done; /* progress returned XCCL_OK; the epilogue was issued   */
    const xccl_exec_ops_t *exec;  /* executor of args.mem (set before the prologue)      */
    /* unfinished executor events, oldest first: ev[ev_head .. ev_head + nev), numbered
     * ev_first, ev_first + 1, ... in issue order */
    void              **ev;
    int                 ev_head, nev, ev_cap;
    uint64_t            ev_first; /* number of the oldest unfinished event               */
    uint64_t            ev_issued; /* events issued so far                               */
    xccl_status_t       ev_error;  /* first executor failure (sticky)                     */
    xccl_held_t        *held, *held_tail; /* posts waiting for events, posting order      */
    int                 nheld;
    xccl_work_t       *work;
    /* sub-tasks (coll.c, xccl_task_sub): a sub-task posts through its parent, its peers mapped
     * by `map` and its steps offset by step_base; its requests live on the Work's own task. */
    xccl_task_t       *parent;     /* NULL: the Work's own task                            */
    int               *map;        /* sub-task: parent rank of each member (owned)         */
    int                rank, size; /* sub-task: its own rank and member count              */
    uint32_t           step_base, step_span;
    xccl_task_t       *sub[XCCL_TASK_SUBS]; /* running sub-tasks (owned)                  */
    /* node-shared memory (shared.c; the Work's own task only) */
    uint64_t           shared_epoch;   /* 0: the algorithm does not use the segment        */
    int                shared_granted; /* xccl_task_shared returned XCCL_OK                */
    int                shared_wait;    /* why the last progress call returned INPROGRESS  */
    int                shared_peer;    /* comm rank awaited (SHWAIT_WRITE, ATTACH); -1: several */
    int64_t            shared_check_ms; /* next liveness check of the awaited ranks (0: unset) */
};

/* xccl_task_t.shared_wait: what a task of a shared algorithm waited for in its last progress
 * call (reset before each call). */
enum {
    SHWAIT_NONE = 0,
    SHWAIT_WRITE,  /* xccl_task_shared_wait: a flag that shared_peer (-1: several) writes     */
    SHWAIT_ATTACH, /* the segment: rank 0 (shared_peer) has not created it yet                */
    SHWAIT_TURN,   /* the grant: a collective of an earlier epoch is active on this rank      */
};

struct xccl_work {
    atomic_int    refcount;
    work_kind_t   kind;
    xccl_comm_t  *comm;
    _Atomic int   status;   /* XCCL_INPROGRESS, XCCL_OK or an error                      */
    int           active;   /* on ctx->active                                              */
    char         *errmsg;
    const char   *name;
    uint64_t      seq;
    uint64_t      fp;
    uint64_t      t_enq, t_start, t_end;
    int64_t       deadline_ms;
    int64_t       timeout_ms;
    /* p2p */
    xccl_req_t   *req;     /* &p2p_req once posted                                          */
    xccl_req_t    p2p_req;
    int           source; /* comm rank a completed receive came from; -1 otherwise     */
    /* coll */
    xccl_task_t   task;
    xccl_op_t     user_op;
    double        premul;
    void         *tmp;     /* prologue copy (PREMUL_SUM scaling, in-place inputs)          */
    size_t        tmp_len;
    size_t       *vcounts; /* ALLTOALLV: private copy of counts and displacements          */
    /* completion callback */
    xccl_work_cb_t cb;
    void          *cb_arg;
    int            async_counted; /* counted in ctx->nasync (background progress wanted)   */
    int            notified;      /* failed because a peer said so: do not pass it on      */
    int            expiring;      /* xccl_work_expire is building its message              */
    /* device memory: the completion gate (exec.h) taken at post, opened when it finishes */
    const struct xccl_exec_ops *gate_exec; /* NULL: no gate                              */
    uint64_t                    gate;
    int                         gate_opened;
    _Atomic int                 stream_waited; /* a caller's stream waits for the gate */
    /* device memory: the caller's stream has not reached the operation yet (exec.h
     * order_after): a collective runs its prologue and algorithm, a p2p posts its request,
     * only once this event has completed */
    void                       *ready_ev;
    int                         held;      /* p2p: on ctx->hold_head, request not posted    */
    struct xccl_work           *hold_next;
    /* While active, a Work is on three doubly linked lists (O(1) unlink, see work.c):       */
    xccl_work_t   *next, *prev;       /* ctx->coll: collectives, in posting order (progress) */
    xccl_work_t   *cm_next, *cm_prev; /* comm->works: the comm's Works, in posting order   */
    xccl_work_t   *dl_next, *dl_prev; /* ctx->dl: every active Work by deadline            */
    xccl_work_t   *cnext; /* completion list                                              */
};

/* A walk over ctx->coll or ctx->dl that may finish Works (and so unlink them) as it goes:
 * registered on ctx->cursors, and moved on by the unlink of the Work it points at. */
typedef struct xccl_cursor {
    xccl_work_t        *w;
    int                 dl; /* walks ctx->dl (else ctx->coll) */
    struct xccl_cursor *up;
} xccl_cursor_t;

/* What the core publishes about itself at bootstrap, after its xccl_peer_info_t in the same
 * store record ("info/<rank>"): facts other ranks cannot see from outside, from which every
 * rank computes the same answers (topo.shared). */
enum {
    XCCL_CI_SHARED = 1u << 0, /* $XCCL_SHARED is not 0 and an intra-host transport was asked
                               * for (cleared after wire-up unless one started)             */
    XCCL_CI_CMA    = 1u << 1, /* $XCCL_SHARED_CMA is not 0, process_vm_readv works here and
                               * ptrace policy lets processes of our user read us           */
};
typedef struct xccl_core_info {
    uint32_t flags;  /* XCCL_CI_*                                                        */
    uint32_t uid;    /* effective uid                                                    */
    uint64_t pid_ns; /* pid namespace (hash of /proc/self/ns/pid; 0: unknown)            */
} xccl_core_info_t;

typedef struct tp_slot {
    const xccl_transport_ops_t *ops;
    xccl_tp_ctx_t              *ctx;
    xccl_rcache_t              *rcache; /* registrations (XCCL_TP_CAP_NEEDS_REG only)     */
    int                         ui;     /* its entry in ctx->tp_core / ctx->tp_up          */
} tp_slot_t;

/* What a transport's upcalls get as `core`: the context and the slot of that transport, so a
 * receive knows which transport delivers into it (slot -1: a self-send). The entries do not
 * move when unused transports are dropped after wire-up; `slot` is updated instead. */
typedef struct tp_core {
    xccl_ctx_t *ctx;
    int         slot;
} tp_core_t;

static inline const char *xccl_mem_type_name(xccl_mem_type_t mem)
{
    return mem == XCCL_MEM_HOST ? "host" : mem == XCCL_MEM_CUDA ? "cuda" : "unknown";
}

/* The data-path caps bit that accepts memory type mem. */
static inline uint32_t xccl_tp_cap_for(xccl_mem_type_t mem)
{
    return mem == XCCL_MEM_HOST ? XCCL_TP_CAP_HOST_MEM
           : mem == XCCL_MEM_CUDA ? XCCL_TP_CAP_CUDA_MEM
                                  : 0;
}

struct xccl_ctx {
    pthread_mutex_t   lock;
    pthread_cond_t    cond;
    xccl_tp_upcalls_t tp_up[XCCL_MAX_TRANSPORTS];
    tp_core_t         tp_core[XCCL_MAX_TRANSPORTS];
    tp_core_t         self_core; /* {ctx, -1}: the `core` of self-sends                 */
    int               refcount; /* communicators not destroyed yet (under lock)          */
    int               rank, size;
    uint64_t          job_id;
    xccl_peer_info_t *peers;
    tp_slot_t         tp[XCCL_MAX_TRANSPORTS];
    int               ntp;
    /* the models communicators price links with (topo.c): from the transports asked for
     * ($XCCL_TRANSPORTS), not those this rank loaded, so that they are the same on every rank */
    xccl_cost_model_t model_intra, model_inter;
    int               model_pull;
    /* the tuning table of $XCCL_TUNE_FILE (NULL: none), the same on every rank (ctx.c,
     * tune_agree); tune_ok: it was measured on this host with the transport of model_intra,
     * whose fitted model is then tune_intra (topo.c gives both to one-node communicators) */
    xccl_tune_t      *tune;
    int               tune_ok;
    xccl_cost_model_t tune_intra;
    int8_t           *peer_tp;   /* transport slot per world rank for host memory (-1: self) */
    /* transport slot per (memory type, world rank): [mem * size + rank]; -1: none moves that
     * memory type to that rank (or self) */
    int8_t           *peer_tp_mem;
    /* staged messages being copied into their receive by an asynchronous executor: requests
     * linked through `next`, tested in every progress pass */
    xccl_req_t       *copies;
    /* staging of device memory through host bounce buffers for peers whose transports move
     * host memory only: sends waiting for a bounce buffer, their executor copy, or an earlier
     * such send to the same peer (messages leave in posting order), in posting order; the
     * pool of bounce buffers (allocated once and reused, at most stage_limit bytes kept) */
    xccl_req_t       *stage_head, *stage_tail;
    int              *stage_pending; /* per world rank: its sends on stage_q              */
    int64_t          *stage_mark;    /* per world rank: pass in which it was held back    */
    int64_t           stage_pass;
    xccl_sbuf_t      *stage_free, *stage_all;
    size_t            stage_bytes;   /* bytes of pooled bounce buffers                    */
    size_t            stage_limit;   /* $XCCL_STAGE_BYTES                                 */
    int               stage_inuse;   /* pooled bounce buffers in use                      */
    uint64_t          stage_allocs;  /* bounce buffers allocated (tests: reuse)           */
    uint64_t          stage_sends, stage_recvs; /* messages staged (tests)                */
    char            **peer_dead; /* reason, or NULL while the peer is healthy            */
    uint8_t          *peer_scarce; /* its host runs more ranks of the job than their CPUs  */
    /* large unexpected messages held back in their transport (XCCL_TP_CAP_DEFER): when the
     * one from each world rank was first offered (ms, 0: none), for how long, from what size */
    int64_t          *defer_since;
    int64_t           defer_ms;
    uint64_t          defer_min;
    xccl_umsg_t      *unexp_head, *unexp_tail; /* every unexpected message, arrival order */
    uint64_t          match_headers; /* headers matched (recv_match)                        */
    uint64_t          match_probes;  /* queue entries those examined (tests: the cost)      */
    xccl_work_t      *coll_head, *coll_tail; /* active collectives, in posting order    */
    xccl_work_t      *dl_head, *dl_tail;     /* every active Work, earliest deadline first */
    xccl_cursor_t    *cursors;               /* walks in progress over those lists        */
    xccl_u64map_t     comms;   /* id -> live communicator (destroyed ones until freed)    */
    int               ncomms;  /* communicators allocated and not freed yet               */
    /* ids of the last XCCL_GONE_IDS freed communicators: in ctx->comms with the value
     * &xccl_comm_gone, and in this ring (oldest overwritten first) */
    uint64_t         *gone_ids;
    size_t            gone_next;
    uint64_t          staged_bytes; /* payload bytes held by unexpected messages          */
    /* free lists of request and unexpected-message records (at most XCCL_POOL_MAX each) */
    xccl_req_t       *req_pool;
    xccl_umsg_t      *umsg_pool;
    int               req_pool_n, umsg_pool_n;
    int               nwaiters;   /* threads inside xccl_work_wait                         */
    int               nasync;     /* active works nobody is waiting on                     */
    /* active Works on device memory: their completion is found by polling the device (no
     * descriptor can wake a sleeper), so while there are any, the threads that drive progress
     * nap for XCCL_DEVICE_NAP_NS between polls instead of sleeping on the transports (a
     * spinning thread would starve the others that take ctx->lock) */
    int               ndevice;
    /* point-to-point Works not posted yet, in posting order: the first waits for its caller's
     * stream (ready_ev), the others behind it keep the order messages are matched in */
    xccl_work_t      *hold_head, *hold_tail;
    pthread_t         thread;
    int               thread_started;
    int               stopping;
    int64_t           spin_ns;
    int               spin_yield; /* waiters yield between polls: the host is oversubscribed */
    /* node-shared memory (shared.c): what every rank said of itself at bootstrap, and the
     * communicator of a task that waited on its segment in the last progress pass (NULL:
     * none), whose doorbell idle threads sleep on */
    xccl_core_info_t *cinfo;
    xccl_comm_t      *shwait;
    int               ptracer; /* 1: relaxed Yama for this context, 2: and holds it */
    xccl_work_t      *done_head;  /* completed works whose callbacks must run             */
};

/* A polling loop's pause: lets the sibling hyper-thread run and saves power, no system call. */
static inline void xccl_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* ctx.c */
/* The address record each rank publishes through the store ("<prefix>addr/<rank>"):
 * [u32 ntp, host order] then per transport [char name[16]][u32 len, host order][len bytes of
 * its address blob]. Parsed from another process's bytes: names are cut at 15 characters, blobs
 * point into p and lie inside it, and lens[i] <= XCCL_TP_ADDR_MAX. */
typedef struct xccl_addr_rec {
    int         ntp;
    char        names[XCCL_MAX_TRANSPORTS][16];
    size_t      lens[XCCL_MAX_TRANSPORTS];
    const void *blobs[XCCL_MAX_TRANSPORTS];
    /* after the transports: the rank's tuning table, [u64 hash][i32 status of its load]
     * [u16 length][its $XCCL_TUNE_FILE] (ctx.c, tune_agree); tail_len 0 if absent */
    const uint8_t *tail;
    size_t         tail_len;
} xccl_addr_rec_t;
/* XCCL_ERR_REMOTE (naming `rank`) when the record is malformed. */
xccl_status_t xccl_addr_rec_parse(const uint8_t *p, size_t len, int rank, xccl_addr_rec_t *r);
xccl_status_t xccl_ctx_create(const xccl_comm_config_t *cfg, xccl_ctx_t **out);
/* Drops a communicator's reference; the last one tears the context down: waits for waiters to
 * leave, stops the progress thread, finalizes transports, frees every communicator. Lock NOT
 * held; never called from a transport upcall. */
void          xccl_ctx_release(xccl_ctx_t *ctx);
/* One pass over transports and active works. Lock held. Returns events handled. */
int           xccl_ctx_progress_locked(xccl_ctx_t *ctx);
/* Sleeps up to timeout_ms in the transports (lock NOT held). */
void          xccl_ctx_sleep(xccl_ctx_t *ctx, int timeout_ms);
/* Runs the callbacks of completed works (lock NOT held). */
void          xccl_ctx_run_callbacks(xccl_ctx_t *ctx);
void          xccl_ctx_wake_thread(xccl_ctx_t *ctx); /* lock held */
void          xccl_ctx_start_thread(xccl_ctx_t *ctx); /* lock held */
/* The pause between polls while device work is active (ctx->ndevice), lock not held. */
#define XCCL_DEVICE_NAP_NS 20000
void          xccl_device_nap(void);
/* Device Works (coll.c): XCCL_OK once the caller's stream reached the operation (w->ready_ev
 * completed; the error if its event failed), XCCL_INPROGRESS before; drop gives up the event
 * (a Work finishing early). The held p2p Works are posted in order as their streams get there:
 * hold_progress returns how many left the queue; hold_unlink takes a finishing one out. Lock
 * held. */
xccl_status_t xccl_work_ready(xccl_work_t *w);
void          xccl_work_ready_drop(xccl_work_t *w);
int           xccl_p2p_hold_progress(xccl_ctx_t *ctx);
void          xccl_p2p_hold_unlink(xccl_ctx_t *ctx, xccl_work_t *w);
/* memreg.c: the core is done with [ptr, ptr + nbytes), memory of its own that it may have
 * handed to transports (scratch, prologue copies, notices), and is about to free or reuse it:
 * every registration cache of the context drops it (deregistered once no transport uses it).
 * Lock held. */
void          xccl_ctx_mem_forget(xccl_ctx_t *ctx, const void *ptr, size_t nbytes);

/* Posting, under the lock. Errors are reported with XCCL_ERROR. */
xccl_status_t xccl_req_post_send(xccl_ctx_t *ctx, xccl_req_t *r);
xccl_status_t xccl_req_post_recv(xccl_ctx_t *ctx, xccl_req_t *r);
/* Removes a request from the posted queue, or closes its peer when a transport holds it,
 * so that it is retired with `st`. Lock held. */
void          xccl_req_cancel(xccl_ctx_t *ctx, xccl_req_t *r, xccl_status_t st, const char *why);
/* Request records: a zeroed one from the context's pool (NULL when out of memory), and back.
 * Lock held. A request freed where the lock is not held (a Work released after its context)
 * is simply free()d: pooled records are plain allocations. */
#define XCCL_POOL_MAX 1024
xccl_req_t   *xccl_req_get(xccl_ctx_t *ctx);
void          xccl_req_put(xccl_ctx_t *ctx, xccl_req_t *r);
/* Unlinks and frees a fully arrived unexpected message. Lock held. */
void          xccl_umsg_drop(xccl_ctx_t *ctx, xccl_umsg_t *u);
/* Frees the unexpected messages of a destroyed communicator; those still arriving are freed
 * when their payload is in. Lock held. */
void          xccl_umsg_drop_comm(xccl_ctx_t *ctx, xccl_comm_t *comm);
/* A communicator joined ctx->comms: its unexpected messages that arrived before move onto its
 * queues, in arrival order. Lock held. */
void          xccl_ctx_adopt(xccl_ctx_t *ctx, xccl_comm_t *comm);
/* A request finished (called by ctx.c); routes to the owning Work. Lock held. */
void          xccl_req_finished(xccl_ctx_t *ctx, xccl_req_t *r);

/* work.c */
xccl_work_t  *xccl_work_new(xccl_comm_t *comm, work_kind_t kind, const char *name,
                            int64_t timeout_ms);
/* Records the final status of a Work, takes it off the active list and queues its callback.
 * Lock held. msg may be NULL (then the thread's last error is used for errors). */
void          xccl_work_finish(xccl_work_t *w, xccl_status_t st, const char *msg);
/* Marks comm broken after its collective #seq failed with XCCL_ERR_REMOTE (here, or on the
 * member whose notice says so: `why`) and fails its active collectives posted after #seq, which
 * wait on a member that will not come; later posts are refused. Once only. Lock held. */
void          xccl_coll_break(xccl_comm_t *comm, uint64_t seq, const char *why);
/* The communicator's queue for executor `exec` (core.h xccl_comm.queue), made on first use;
 * NULL (the executor's default) when it has no queues or making one failed. Any thread. */
void         *xccl_comm_queue(xccl_comm_t *comm, const struct xccl_exec_ops *exec);
/* The queue of memory type `mem` as it stands (NULL: none made yet, the executor's default):
 * what the operations of `comm` on that memory run on. Any thread. */
static inline void *xccl_comm_queue_of(const xccl_comm_t *comm, xccl_mem_type_t mem)
{
    return atomic_load_explicit(&comm->queue[mem], memory_order_acquire);
}
/* "send (p2p, tag T) on comm 'C' failed on rank R: <detail>" into buf; returns buf */
const char   *xccl_p2p_error(const xccl_work_t *w, const char *detail, char *buf, size_t len);
/* Adds a posted Work to the active list; unless `blocking`, counts it for the background
 * progress thread (started on first use). Lock held. */
void          xccl_work_activate(xccl_work_t *w, int blocking);
/* Advances one Work (collective algorithm or p2p request). Lock held. */
void          xccl_work_progress_locked(xccl_work_t *w);
/* Fails a Work that passed its deadline, naming what it waits for. Lock held. */
void          xccl_work_expire(xccl_work_t *w);

/* coll.c: gives the task's scratch back to its communicator for reuse (reuse = 1; the
 * operation succeeded, nothing can still write into it) or frees it. A failed operation's
 * executor events are waited for first (they may still write into its buffers). Lock held. */
void          xccl_task_scratch_return(xccl_task_t *t, int reuse);
/* coll.c: frees what a collective's Work owns for its memory type (scratch, the prologue
 * copy, events and held posts); called when the Work is freed. */
void          xccl_coll_free(xccl_work_t *w);
/* coll.c: one progress step of a collective: the algorithm, then the epilogue, then its
 * executor events. XCCL_OK when complete, XCCL_INPROGRESS, or an error. Lock held. */
xccl_status_t xccl_coll_progress(xccl_work_t *w);
/* coll.c: frees the scratch buffers a communicator keeps (comm teardown). */
void          xccl_comm_free_spare(xccl_comm_t *comm);
/* coll.c: frees its executor queues (the last reference: nothing is queued on them). */
void          xccl_comm_free_queues(xccl_comm_t *comm);
/* coll.c: a mismatch notice (control message) is complete; 1 if it was consumed. */
int           xccl_coll_ctrl_arrived(xccl_ctx_t *ctx, xccl_umsg_t *u);
/* coll.c: tells the other members that this rank's part of collective w failed. */
void          xccl_coll_notify_failure(xccl_work_t *w, const char *msg);
/* coll.c: fail the comm's collective `seq` with a mismatch (lock held). */
void          xccl_coll_mismatch(xccl_comm_t *comm, uint64_t seq, int peer_rank, uint64_t peer_fp,
                                 int notify);
void          xccl_comm_fail_all(xccl_comm_t *comm, xccl_status_t st, const char *why);
/* The communicator with that id: a live one, &xccl_comm_gone (destroyed = 1, no members) for
 * a recently freed one, or NULL for one this rank has not created (yet). Lock held. */
xccl_comm_t  *xccl_ctx_find_comm(xccl_ctx_t *ctx, uint64_t id);
extern xccl_comm_t xccl_comm_gone;
#define XCCL_GONE_IDS 4096
/* Reference counting of communicators (see struct xccl_comm). Lock held. */
static inline void xccl_comm_ref(xccl_comm_t *c) { c->refs++; }
void          xccl_comm_unref(xccl_comm_t *c);
/* Frees a communicator's memory (ctx_free, or its last reference). Lock held or no lock
 * needed (context teardown). */
void          xccl_comm_free(xccl_comm_t *c);
int           xccl_comm_rank_of_world(const xccl_comm_t *comm, int world_rank);

/* topo.c: fills comm->topo from the members' host identities and the transports' models;
 * called once the member list (comm->world) is set. */
xccl_status_t xccl_comm_topo_init(xccl_comm_t *comm);
void          xccl_ctx_topo_models(xccl_ctx_t *ctx, const xccl_transport_ops_t *const *cand,
                                   int ncand);

/* ---- shared.c: node-shared memory (task.h, "Node-shared memory") -------------------------- */
/* The selection policy the core calls: &xccl_algo_policy. Tests of the core may point it at a
 * wrapper (one adding a test-only shared algorithm) before they create a communicator. */
extern const xccl_algo_policy_t *xccl_core_policy;
/* This process's part of the bootstrap record; `intra_asked`: an intra-host transport is
 * among those asked for. Returns 1 if it relaxed this process's Yama ptrace restriction so
 * that processes of the same user can read it; the context then calls xccl_shared_ptracer:
 * hold 1 (it has peers on this host: keep it, counted), 0 (it has none: restore Yama's
 * default unless another context holds it), -1 (a context that held it is freed). */
int           xccl_shared_self_info(xccl_core_info_t *ci, int intra_asked, uint64_t pid_ns);
void          xccl_shared_ptracer(int hold);
/* Removes node-shared segment names left in /dev/shm by processes that died (no lock held on
 * them, creator gone or the name older than a few seconds). */
void          xccl_shared_sweep(void);
/* topo.shared of a communicator, from the peer table (identical on every member). */
unsigned      xccl_shared_bits(const xccl_comm_t *comm);
/* The Work's epoch if its algorithm is shared (coll_post, lock held). */
void          xccl_shared_post(xccl_work_t *w);
/* After a progress call of w that left it unfinished: liveness of the ranks it waits for on
 * the segment (fails w, naming the rank, when one died), and ctx->shwait. Lock held. Returns
 * 1 if w's algorithm moved on (its state words changed: an event for the waiters). */
int           xccl_shared_after(xccl_work_t *w, const uint64_t *state_before);
/* "waiting for ..." of a task of a shared algorithm, for timeouts and hang tables ("" if it
 * waits for no memory). */
size_t        xccl_shared_describe(const xccl_work_t *w, char *buf, size_t len);
/* Sleeping on a segment's doorbell: arm (lock held; counts this thread as a sleeper, then the
 * caller runs one more progress pass), doze (lock NOT held; returns at once if the bell
 * moved, else after a wake-up or min(timeout_ms, 1 ms)), disarm (lock held). `arm` returns 0
 * when no task waited on a ready segment in the last pass. */
typedef struct xccl_shsleep {
    xccl_comm_t *comm;
    uint32_t     bell;
} xccl_shsleep_t;
int           xccl_shared_arm(xccl_ctx_t *ctx, xccl_shsleep_t *s);
void          xccl_shared_doze(xccl_shsleep_t *s, int timeout_ms);
void          xccl_shared_disarm(xccl_shsleep_t *s);
/* Unmaps the segment (and removes its name if a member never attached). Communicator
 * teardown; lock held or not needed. */
void          xccl_shared_free(xccl_comm_t *comm);
/* ---- end of shared.c ----------------------------------------------------------------------- */

/* explain.c: the α-β-γ model used for selection. */
const xccl_cost_model_t *xccl_core_default_model(void);

/* trace.c (lock held) */
void          xccl_trace_req(xccl_req_t *r);
void          xccl_trace_reduce(xccl_task_t *t, const void *dst, size_t nbytes, uint64_t t0);
/* A cross-memory read from comm rank `peer` into dst, recorded as a receive (transport "cma"). */
void          xccl_trace_read(xccl_task_t *t, int peer, const void *dst, size_t nbytes,
                              uint64_t t0);
void          xccl_flight_record(xccl_work_t *w);

/* transport.c: the only file that names backends. */
const xccl_transport_ops_t *const *xccl_transport_list(void);

/* ---- diag.c: cross-rank hang diagnosis (who waits for whom, on a timeout) ------------------ */
/* CTRL tag bits of the state query (bit 58) and its answer (bit 57); the seq field carries the
 * asker's query id. Consumed at match time by xccl_coll_ctrl_arrived -> xccl_diag_ctrl_arrived. */
#define TAG_CTRL_DIAG       (1ull << 58)
#define TAG_CTRL_DIAG_REPLY (1ull << 57)
/* A query (answered at once with this rank's row) or an answer arrived. Lock held. Returns 1:
 * the message is consumed. */
int           xccl_diag_ctrl_arrived(xccl_ctx_t *ctx, xccl_umsg_t *u);
/* This rank's row for comm: its active operations and whom they wait for, or "idle, last
 * finished #N op". Lock held. Returns the length written (buf is NUL-terminated). */
size_t        xccl_diag_row(const xccl_comm_t *comm, char *buf, size_t len);
/* Asks every other member of comm for its row, waits up to wait_ms (less once all answered or
 * are dead) and writes "\nwhere the N ranks of comm ... are:" plus one row per rank into buf,
 * and into `silent` (may be NULL) the members that gave no answer ("rank 1", "ranks 1, 4";
 * "" if none). Lock held; released while it sleeps (other threads may finish or fail
 * operations of comm meanwhile; comm itself stays). Returns the length written to buf. */
size_t        xccl_diag_table(xccl_comm_t *comm, int64_t wait_ms, char *buf, size_t len,
                              char *silent, size_t slen);
/* How long a timeout of timeout_ms collects answers: min(1 s, timeout / 4), at least 100 ms;
 * $XCCL_DIAG_WAIT_MS overrides (0: no table). */
int64_t       xccl_diag_wait_ms(int64_t timeout_ms);
/* A communicator was created: starts the progress thread so that this rank answers queries
 * while idle. Lock NOT held. */
void          xccl_diag_comm_ready(xccl_comm_t *comm);
/* ---- end of diag.c ------------------------------------------------------------------------- */

#endif /* XCCL_CORE_CORE_H */
