/* SPDX-License-Identifier: Apache-2.0
 *
 * ibverbs.c - the RDMA transport over libibverbs (InfiniBand, RoCE): one reliable-connected
 * queue pair (RC QP) per peer, host memory, buffers registered by the core's registration cache
 * (caps NEEDS_REG). libibverbs is never linked: init dlopens libibverbs.so.1 and resolves the
 * exported entry points it needs into a table (ib_fns_t); the data-path verbs (post_send,
 * post_recv, poll_cq, req_notify_cq) are verbs.h inlines that call through the device
 * context's ops and need no symbol.
 *
 * Device and port
 *   The first ACTIVE port of the first device, or of those $XCCL_IB_HCA allows (ib_hca.h).
 *   RoCE (link layer Ethernet) uses GRH addressing with a GID index chosen from sysfs
 *   (.../ports/<p>/gid_attrs/types/<i>): the RoCE v2 GID of an IPv4 address (::ffff:a.b.c.d),
 *   else a RoCE v2 link-local one, else any RoCE v2, else RoCE v1; $XCCL_IB_GID_INDEX
 *   overrides. InfiniBand uses LID addressing (untested: the soft-RoCE test bed has no IB).
 *   The path MTU is the smaller of both ends' active MTU.
 *
 * Wire-up (through the bootstrap store's view, xccl_tp_kv_t; keys relative to it)
 *   address blob (get_addr)  ib_addr_t: link layer, port, LID, GID, active MTU, device name
 *   "<from>-<to>"            ib_conn_t: the QP number and first PSN `from` uses towards `to`
 *   "ready/<rank>"           published once all of that rank's QPs are in RTS
 *   A rank creates its QPs, posts their receives (INIT), publishes "<me>-<p>", reads
 *   "<p>-<me>", moves each QP to RTR and RTS, publishes "ready/<me>" and waits for
 *   "ready/<p>" of every peer it uses: when wireup returns, every peer's QP towards this rank
 *   accepts messages. Each wait is bounded by the wire-up timeout; a timeout names the peers
 *   whose keys are missing.
 *
 * Messages (every SEND starts with an ib_wire_t)
 *   EAGER   hdr + payload (hdr.nbytes <= eager_bytes), copied into a registered send slot;
 *           send_done right after the copy. The receiver copies it from its receive slot into
 *           the destination recv_match gives.
 *   RTS     hdr, address, rkey and id of a larger payload, which stays in the user's memory
 *           (registered by the core: rkey of buf->mr). The receiver RDMA-READs it straight
 *           into the destination (chunks of at most chunk_bytes, itself below the port's
 *           max_msg_sz, so messages >= 2 GiB are split; at most max_reads outstanding per
 *           QP), then calls recv_done and sends FIN. A receive that does not want the payload
 *           (dst->ptr NULL) sends FIN without reading.
 *   FIN     id (and status) of a finished RTS: the sender calls send_done.
 *   CREDIT  credits only (see below).
 *   Messages of a peer are handed to recv_match in arrival order, which is posting order (RC
 *   delivers in order); a later eager message may complete before an earlier rendezvous one
 *   (the core matches in order and completes in any order).
 *
 * Flow control
 *   Each QP has depth + 1 receives posted, one registered slot of eager_bytes + 80 each.
 *   EAGER, RTS and FIN are data messages: a sender posts one only with a credit (it starts
 *   with depth) and otherwise queues it. The receiver reposts a slot as soon as it has handled
 *   its message and owes the sender a credit for it; every message carries the credits owed
 *   (piggybacked). When a receiver owes half its depth and has nothing to send, it sends a
 *   CREDIT message, which needs no credit: it lands in the extra (+1) receive, and the next
 *   CREDIT is sent only after the peer reports (ctrl_seen, carried by every message) that it
 *   has handled the previous one, so at most one is in flight. CREDIT messages are not
 *   themselves owed for. Hence at most depth data messages + 1 CREDIT are ever in flight
 *   towards a QP with depth + 1 receives posted: no receiver-not-ready, ever.
 *
 * Progress and sleeping
 *   progress polls the one CQ of the context. Sleeping uses the completion channel: when the
 *   core is about to sleep (wait or wait_arm finds the CQ not armed), the next progress pass
 *   that finds nothing arms it (ibv_req_notify_cq) and polls once more (a completion that
 *   came in between is handled, not slept through); the channel's descriptor is then readable
 *   when a new completion arrives. wait and wait_arm poll an epoll set holding the channel,
 *   the device's async-event descriptor and an eventfd (wake).
 *
 * Failure
 *   A failed work completion (retry exceeded, remote access error, flush...), an async event
 *   naming a QP (fatal, access error) or the port/device (port error, device fatal), a
 *   malformed message, or close_peer: the peer's QP is destroyed (no more DMA into its
 *   buffers), its queued and in-flight sends fail through send_done, its rendezvous receives
 *   through recv_done, then peer_failed names rank, device and the verbs status. A peer that
 *   dies while nothing is in flight towards it is noticed by the core's operation timeout,
 *   which calls close_peer. RC retries: $XCCL_IB_TIMEOUT (4.096 us * 2^t per try, default 20)
 *   and $XCCL_IB_RETRY_CNT (default 7), NCCL's defaults.
 *
 * Threading: see xccl_transport.h. wait/wait_arm/wake touch only `armed`/`want_arm`
 * (atomics) and descriptors.
 */
#if !defined(XCCL_NO_IBVERBS) && defined(__has_include)
#if __has_include(<infiniband/verbs.h>)
#define IB_BUILD 1
#endif
#endif

#ifndef IB_BUILD
typedef int xccl_ibverbs_not_built_t; /* rdma-core's headers are missing: nothing to build */
#else

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

#include <infiniband/verbs.h>

#include "ib_hca.h"
#include "xccl/xccl_tp_support.h"
#include "xccl/xccl_transport.h"

#define IB_MAGIC          0x58494256u /* "XIBV" */
#define IB_VERSION        1
#define IB_WIRE_SZ        80 /* bytes of ib_wire_t room: the eager payload starts there */
#define IB_POLL_BATCH     32
#define IB_POLL_BUDGET    256 /* completions handled per progress pass */
#define IB_ASYNC_CHECK_MS 50  /* async events are looked at least this often while busy */

/* ---- the entry points of libibverbs we call -------------------------------------------- */

typedef struct ib_fns {
    void *lib;
    struct ibv_device **(*get_device_list)(int *num);
    void (*free_device_list)(struct ibv_device **list);
    const char *(*get_device_name)(struct ibv_device *dev);
    struct ibv_context *(*open_device)(struct ibv_device *dev);
    int (*close_device)(struct ibv_context *c);
    int (*query_device)(struct ibv_context *c, struct ibv_device_attr *a);
    /* the exported (compat) ibv_query_port: fills the leading fields of ibv_port_attr */
    int (*query_port)(struct ibv_context *c, uint8_t port, struct ibv_port_attr *a);
    int (*query_gid)(struct ibv_context *c, uint8_t port, int index, union ibv_gid *gid);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *c);
    int (*dealloc_pd)(struct ibv_pd *pd);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *pd, void *addr, size_t len, int access);
    int (*dereg_mr)(struct ibv_mr *mr);
    struct ibv_comp_channel *(*create_comp_channel)(struct ibv_context *c);
    int (*destroy_comp_channel)(struct ibv_comp_channel *ch);
    struct ibv_cq *(*create_cq)(struct ibv_context *c, int cqe, void *cq_ctx,
                                struct ibv_comp_channel *ch, int vec);
    int (*destroy_cq)(struct ibv_cq *cq);
    int (*get_cq_event)(struct ibv_comp_channel *ch, struct ibv_cq **cq, void **cq_ctx);
    void (*ack_cq_events)(struct ibv_cq *cq, unsigned int n);
    struct ibv_qp *(*create_qp)(struct ibv_pd *pd, struct ibv_qp_init_attr *a);
    int (*modify_qp)(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask);
    int (*destroy_qp)(struct ibv_qp *qp);
    int (*get_async_event)(struct ibv_context *c, struct ibv_async_event *ev);
    void (*ack_async_event)(struct ibv_async_event *ev);
    const char *(*wc_status_str)(enum ibv_wc_status st);
    const char *(*event_type_str)(enum ibv_event_type ev);
} ib_fns_t;

/* dlopens libibverbs and fills f. 0, or -1 with the reason in why. */
static int ib_fns_load(ib_fns_t *f, char *why, size_t len)
{
    static const struct {
        const char *name;
        size_t      off;
    } syms[] = {
#define S(field, sym)     {sym, offsetof(ib_fns_t, field)}
        S(get_device_list, "ibv_get_device_list"),
        S(free_device_list, "ibv_free_device_list"),
        S(get_device_name, "ibv_get_device_name"),
        S(open_device, "ibv_open_device"),
        S(close_device, "ibv_close_device"),
        S(query_device, "ibv_query_device"),
        S(query_port, "ibv_query_port"),
        S(query_gid, "ibv_query_gid"),
        S(alloc_pd, "ibv_alloc_pd"),
        S(dealloc_pd, "ibv_dealloc_pd"),
        S(reg_mr, "ibv_reg_mr"),
        S(dereg_mr, "ibv_dereg_mr"),
        S(create_comp_channel, "ibv_create_comp_channel"),
        S(destroy_comp_channel, "ibv_destroy_comp_channel"),
        S(create_cq, "ibv_create_cq"),
        S(destroy_cq, "ibv_destroy_cq"),
        S(get_cq_event, "ibv_get_cq_event"),
        S(ack_cq_events, "ibv_ack_cq_events"),
        S(create_qp, "ibv_create_qp"),
        S(modify_qp, "ibv_modify_qp"),
        S(destroy_qp, "ibv_destroy_qp"),
        S(get_async_event, "ibv_get_async_event"),
        S(ack_async_event, "ibv_ack_async_event"),
        S(wc_status_str, "ibv_wc_status_str"),
        S(event_type_str, "ibv_event_type_str"),
#undef S
    };
    const char *lib = getenv("XCCL_IB_LIBRARY");

    memset(f, 0, sizeof(*f));
    if (lib == NULL || *lib == '\0') lib = "libibverbs.so.1";
    f->lib = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (f->lib == NULL) {
        const char *e = dlerror();
        snprintf(why, len, "cannot load %s (%s)", lib, e ? e : "dlopen failed");
        return -1;
    }
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        void *p = dlsym(f->lib, syms[i].name);
        if (p == NULL) {
            snprintf(why, len, "%s lacks %s", lib, syms[i].name);
            dlclose(f->lib);
            f->lib = NULL;
            return -1;
        }
        memcpy((char *)f + syms[i].off, &p, sizeof(p));
    }
    return 0;
}

/* ---- wire formats ------------------------------------------------------------------------- */

/* Address blob (host byte order, like every xccl wire format). */
typedef struct ib_addr {
    uint32_t magic;
    uint16_t version;
    uint8_t  link_layer; /* IBV_LINK_LAYER_INFINIBAND / _ETHERNET */
    uint8_t  port;
    uint8_t  mtu; /* enum ibv_mtu, active */
    uint8_t  gid_index;
    uint16_t lid;
    uint32_t rank;
    uint64_t job_id;
    uint8_t  gid[16];
    char     dev[32];
} ib_addr_t;

/* Per-pair record "<from>-<to>". */
typedef struct ib_conn {
    uint32_t magic;
    uint32_t from, to;
    uint32_t qpn, psn;
    uint32_t depth;       /* receives posted: both ends must agree                     */
    uint32_t eager_bytes; /* receive slot payload: both ends must agree                */
    uint32_t reads;       /* RDMA READs `from` serves at once as the responder         */
    uint32_t pad;
    uint64_t job_id;
} ib_conn_t;

enum { IB_MSG_EAGER = 1, IB_MSG_RTS = 2, IB_MSG_FIN = 3, IB_MSG_CREDIT = 4 };

typedef struct ib_wire {
    uint8_t  type;
    uint8_t  pad0[3];
    uint32_t credits;   /* data-message credits returned to the receiver of this message  */
    uint32_t ctrl_seen; /* CREDIT messages of the receiver the sender has handled so far  */
    uint32_t pad1;
    union {
        xccl_msg_hdr_t hdr; /* EAGER (payload follows at IB_WIRE_SZ) */
        struct {
            xccl_msg_hdr_t hdr;
            uint64_t       addr;
            uint64_t       id;
            uint32_t       rkey;
            uint32_t       pad;
        } rts;
        struct {
            uint64_t id;
            int32_t  status;
            uint32_t pad;
        } fin;
    } u;
} ib_wire_t;
_Static_assert(sizeof(ib_wire_t) <= IB_WIRE_SZ, "ib_wire_t fits its room");

/* ---- state ---------------------------------------------------------------------------------- */

/* wr_id: kind (8 bits) | peer (24) | index (32) */
enum { WR_SEND = 1, WR_RECV = 2, WR_READ = 3 };
#define WR_ID(kind, peer, idx) (((uint64_t)(kind) << 56) | ((uint64_t)(peer) << 32) | (idx))
#define WR_KIND(id)            ((int)((id) >> 56))
#define WR_PEER(id)            ((int)(((id) >> 32) & 0xffffff))
#define WR_IDX(id)             ((uint32_t)(id))

/* A message waiting to be posted (user send, or a FIN owed), or an RTS waiting for its FIN. */
typedef struct ib_send {
    struct ib_send *next;
    int             kind; /* IB_MSG_EAGER, IB_MSG_RTS, IB_MSG_FIN */
    xccl_msg_hdr_t  hdr;
    const char     *buf;
    uint32_t        rkey;
    uint64_t        id;     /* RTS: this send's id; FIN: the id finished */
    int32_t         status; /* FIN */
    void           *cookie;
} ib_send_t;

/* A rendezvous receive pulling its payload with RDMA READs. */
typedef struct ib_rdv {
    struct ib_rdv *next;
    uint64_t       raddr, id, len, posted;
    uint32_t       rkey, lkey;
    char          *dst;
    int            nreads; /* outstanding */
    void          *cookie;
} ib_rdv_t;

enum { IB_P_IDLE = 0, IB_P_UP, IB_P_DEAD };

typedef struct ib_peer {
    int            state;
    struct ibv_qp *qp;
    ib_addr_t      addr;
    char          *rslots; /* depth + 1 receive slots */
    char          *sslots; /* nsslots send slots */
    uint32_t      *sfree;  /* stack of free send slot indices */
    int            nsfree;
    int            credits;             /* data messages this rank may still send */
    int            owed;                /* credits to return to the peer */
    uint32_t       ctrl_sent;           /* CREDIT messages sent */
    uint32_t       ctrl_acked;          /* ... that the peer reported handled */
    uint32_t       ctrl_recv;           /* CREDIT messages of the peer handled here */
    ib_send_t     *fq_head, *fq_tail;   /* FINs to send (before user sends) */
    ib_send_t     *sq_head, *sq_tail;   /* user sends not posted yet */
    ib_send_t     *rts_head, *rts_tail; /* RTS posted, waiting for FIN */
    ib_rdv_t      *rd_head, *rd_tail;   /* rendezvous receives */
    int            reads_out;
    int            max_reads; /* outstanding READs towards it: min of both ends' limits */
    uint64_t       next_id;
    int            flushing;
    int            broken; /* a post failed outside progress: progress fails the peer */
    char           broken_why[160];
    char           why[320]; /* DEAD: what happened */
} ib_peer_t;

struct xccl_tp_ctx {
    int                      rank, size;
    uint64_t                 job_id;
    const xccl_tp_upcalls_t *up;
    const xccl_tp_kv_t      *kv;
    ib_fns_t                 f;

    struct ibv_context      *dev;
    char                     dev_name[64];
    uint8_t                  port;
    struct ibv_port_attr     pattr;
    struct ibv_device_attr   dattr;
    int                      gid_index;
    union ibv_gid            gid;
    char                     gid_kind[64];
    struct ibv_pd           *pd;
    struct ibv_comp_channel *chan;
    struct ibv_cq           *cq;
    int                      epfd, evfd;

    /* knobs */
    size_t   eager_bytes, slot_bytes;
    int      depth, nsslots, max_reads;
    uint64_t chunk_bytes;
    int      timeout, retry_cnt, sl, tc;

    char          *slab; /* every peer's slots, registered once */
    size_t         slab_len;
    struct ibv_mr *slab_mr;

    ib_peer_t *peers;
    ib_send_t *free_sends;
    ib_rdv_t  *free_rdvs;
    int        nbroken;
    atomic_int armed, want_arm;
    int64_t    next_async_ms;
};

/* ---- small helpers -------------------------------------------------------------------------- */

static const char *ib_mtu_str(int mtu)
{
    switch (mtu) {
    case IBV_MTU_256:
        return "256";
    case IBV_MTU_512:
        return "512";
    case IBV_MTU_1024:
        return "1024";
    case IBV_MTU_2048:
        return "2048";
    case IBV_MTU_4096:
        return "4096";
    default:
        return "?";
    }
}

static const char *ib_port_state_str(int s)
{
    switch (s) {
    case IBV_PORT_DOWN:
        return "DOWN";
    case IBV_PORT_INIT:
        return "INIT";
    case IBV_PORT_ARMED:
        return "ARMED";
    case IBV_PORT_ACTIVE:
        return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER:
        return "ACTIVE_DEFER";
    default:
        return "NOP";
    }
}

static void ib_gid_str(const uint8_t g[16], char *buf, size_t len)
{
    snprintf(buf, len, "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x",
             g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7], g[8], g[9], g[10], g[11], g[12], g[13],
             g[14], g[15]);
}

static void ib_wake(xccl_tp_ctx_t *ctx)
{
    uint64_t one = 1;
    ssize_t  n   = write(ctx->evfd, &one, sizeof(one));
    (void)n; /* EAGAIN only when the counter is saturated: the waiter wakes anyway */
}

static ib_send_t *ib_send_get(xccl_tp_ctx_t *ctx)
{
    ib_send_t *q = ctx->free_sends;
    if (q != NULL)
        ctx->free_sends = q->next;
    else
        q = malloc(sizeof(*q));
    if (q != NULL) memset(q, 0, sizeof(*q));
    return q;
}

static void ib_send_put(xccl_tp_ctx_t *ctx, ib_send_t *q)
{
    q->next         = ctx->free_sends;
    ctx->free_sends = q;
}

static void ib_q_push(ib_send_t **head, ib_send_t **tail, ib_send_t *q)
{
    q->next = NULL;
    if (*tail)
        (*tail)->next = q;
    else
        *head = q;
    *tail = q;
}

static ib_send_t *ib_q_pop(ib_send_t **head, ib_send_t **tail)
{
    ib_send_t *q = *head;
    if (q != NULL) {
        *head = q->next;
        if (*head == NULL) *tail = NULL;
        q->next = NULL;
    }
    return q;
}

/* ---- failure -------------------------------------------------------------------------------- */

/* Destroys the peer's QP (no more DMA into its buffers), fails everything pending with it
 * through the upcalls, then reports it. Only from progress/close_peer (runs upcalls). */
static void ib_fail_peer(xccl_tp_ctx_t *ctx, int peer, xccl_status_t st, const char *why)
{
    ib_peer_t *p = &ctx->peers[peer];
    ib_send_t *q;
    ib_rdv_t  *rd;
    int        busy;

    if (p->state == IB_P_DEAD) return;
    busy     = p->sq_head != NULL || p->rts_head != NULL || p->rd_head != NULL;
    p->state = IB_P_DEAD;
    snprintf(p->why, sizeof(p->why), "%s", why);
    if (busy)
        XCCL_WARN("ibverbs: rank %d: %s", ctx->rank, p->why);
    else
        XCCL_INFO("ibverbs: rank %d: %s", ctx->rank, p->why);
    if (p->broken) {
        p->broken = 0;
        ctx->nbroken--;
    }
    if (p->qp != NULL) {
        (void)ctx->f.destroy_qp(p->qp);
        p->qp = NULL;
    }
    (void)xccl_error_set(st, "%s", p->why);
    while ((q = ib_q_pop(&p->fq_head, &p->fq_tail)) != NULL)
        ib_send_put(ctx, q);
    while ((q = ib_q_pop(&p->sq_head, &p->sq_tail)) != NULL) {
        void *cookie = q->cookie;
        ib_send_put(ctx, q);
        ctx->up->send_done(ctx->up->core, cookie, XCCL_ERR_REMOTE);
    }
    while ((q = ib_q_pop(&p->rts_head, &p->rts_tail)) != NULL) {
        void *cookie = q->cookie;
        ib_send_put(ctx, q);
        ctx->up->send_done(ctx->up->core, cookie, XCCL_ERR_REMOTE);
    }
    while ((rd = p->rd_head) != NULL) {
        void *cookie   = rd->cookie;
        p->rd_head     = rd->next;
        rd->next       = ctx->free_rdvs;
        ctx->free_rdvs = rd;
        ctx->up->recv_done(ctx->up->core, cookie, XCCL_ERR_REMOTE);
    }
    p->rd_tail   = NULL;
    p->reads_out = 0;
    ctx->up->peer_failed(ctx->up->core, peer, st, p->why);
}

static void ib_fail_peer_fmt(xccl_tp_ctx_t *ctx, int peer, xccl_status_t st, const char *what)
{
    char msg[320];

    snprintf(msg, sizeof(msg), "ibverbs (%.32s port %u) connection to rank %d failed: %.200s",
             ctx->dev_name, ctx->port, peer, what);
    ib_fail_peer(ctx, peer, st, msg);
}

/* A post failed where upcalls must not run (isend): progress fails the peer. */
static void ib_mark_broken(xccl_tp_ctx_t *ctx, int peer, const char *what, int err)
{
    ib_peer_t *p = &ctx->peers[peer];

    if (p->broken || p->state != IB_P_UP) return;
    p->broken = 1;
    ctx->nbroken++;
    snprintf(p->broken_why, sizeof(p->broken_why), "%s: %s", what, strerror(err));
    ib_wake(ctx);
}

/* ---- posting -------------------------------------------------------------------------------- */

static int ib_post_recv(xccl_tp_ctx_t *ctx, int peer, uint32_t slot)
{
    ib_peer_t          *p   = &ctx->peers[peer];
    struct ibv_sge      sg  = {.addr   = (uintptr_t)(p->rslots + (size_t)slot * ctx->slot_bytes),
                               .length = (uint32_t)ctx->slot_bytes,
                               .lkey   = ctx->slab_mr->lkey};
    struct ibv_recv_wr  wr  = {.wr_id = WR_ID(WR_RECV, peer, slot), .sg_list = &sg, .num_sge = 1};
    struct ibv_recv_wr *bad = NULL;

    return ibv_post_recv(p->qp, &wr, &bad);
}

/* Posts one message from a send slot: the wire header (credits piggybacked) and len bytes of
 * payload already in the slot. */
static int ib_post_wire(xccl_tp_ctx_t *ctx, int peer, uint32_t slot, size_t len)
{
    ib_peer_t     *p  = &ctx->peers[peer];
    char          *s  = p->sslots + (size_t)slot * ctx->slot_bytes;
    ib_wire_t     *w  = (ib_wire_t *)s;
    struct ibv_sge sg = {.addr = (uintptr_t)s, .length = (uint32_t)len, .lkey = ctx->slab_mr->lkey};
    struct ibv_send_wr  wr;
    struct ibv_send_wr *bad = NULL;
    int                 rc;

    w->credits   = (uint32_t)p->owed;
    w->ctrl_seen = p->ctrl_recv;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id      = WR_ID(WR_SEND, peer, slot);
    wr.sg_list    = &sg;
    wr.num_sge    = 1;
    wr.opcode     = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    rc            = ibv_post_send(p->qp, &wr, &bad);
    if (rc == 0) p->owed = 0;
    return rc;
}

/* Posts what the peer's queues and credits allow: FINs first, then user sends in order, then a
 * CREDIT message when one is due. Re-entrant calls (an isend from inside a send_done) only
 * queue: the outer loop posts them. Returns messages posted. */
static int ib_flush(xccl_tp_ctx_t *ctx, int peer)
{
    ib_peer_t *p = &ctx->peers[peer];
    int        n = 0, rc;

    if (p->flushing || p->state != IB_P_UP || p->broken) return 0;
    p->flushing = 1;
    for (;;) {
        ib_send_t *q     = p->fq_head != NULL ? p->fq_head : p->sq_head;
        int        isfin = q != NULL && q == p->fq_head;
        uint32_t   slot;
        char      *s;
        ib_wire_t *w;
        size_t     len = IB_WIRE_SZ;

        if (q == NULL || p->credits < 1 || p->nsfree == 0) break;
        slot = p->sfree[--p->nsfree];
        s    = p->sslots + (size_t)slot * ctx->slot_bytes;
        w    = (ib_wire_t *)s;
        memset(w, 0, sizeof(*w));
        w->type = (uint8_t)q->kind;
        if (q->kind == IB_MSG_FIN) {
            w->u.fin.id     = q->id;
            w->u.fin.status = q->status;
        } else if (q->kind == IB_MSG_EAGER) {
            w->u.hdr = q->hdr;
            if (q->hdr.nbytes > 0) memcpy(s + IB_WIRE_SZ, q->buf, q->hdr.nbytes);
            len += q->hdr.nbytes;
        } else {
            w->u.rts.hdr  = q->hdr;
            w->u.rts.addr = (uintptr_t)q->buf;
            w->u.rts.rkey = q->rkey;
            w->u.rts.id   = q->id;
        }
        rc = ib_post_wire(ctx, peer, slot, len);
        if (rc != 0) {
            p->sfree[p->nsfree++] = slot;
            ib_mark_broken(ctx, peer, "ibv_post_send", rc);
            break;
        }
        p->credits--;
        n++;
        if (isfin) {
            (void)ib_q_pop(&p->fq_head, &p->fq_tail);
            ib_send_put(ctx, q);
        } else {
            (void)ib_q_pop(&p->sq_head, &p->sq_tail);
            if (q->kind == IB_MSG_RTS) {
                ib_q_push(&p->rts_head, &p->rts_tail, q);
            } else {
                void *cookie = q->cookie;
                ib_send_put(ctx, q);
                ctx->up->send_done(ctx->up->core, cookie, XCCL_OK); /* payload copied */
                if (p->state != IB_P_UP) break;
            }
        }
    }
    /* credits owed and nothing going back soon: an explicit CREDIT (see Flow control) */
    if (p->state == IB_P_UP && !p->broken && p->owed >= (ctx->depth + 1) / 2 &&
        p->ctrl_sent == p->ctrl_acked && p->nsfree > 0) {
        uint32_t   slot = p->sfree[--p->nsfree];
        ib_wire_t *w    = (ib_wire_t *)(p->sslots + (size_t)slot * ctx->slot_bytes);
        memset(w, 0, sizeof(*w));
        w->type = IB_MSG_CREDIT;
        rc      = ib_post_wire(ctx, peer, slot, IB_WIRE_SZ);
        if (rc != 0) {
            p->sfree[p->nsfree++] = slot;
            ib_mark_broken(ctx, peer, "ibv_post_send", rc);
        } else {
            p->ctrl_sent++;
            n++;
        }
    }
    p->flushing = 0;
    return n;
}

/* Issues the RDMA READs the peer's rendezvous receives need, oldest first. */
static void ib_issue_reads(xccl_tp_ctx_t *ctx, int peer)
{
    ib_peer_t *p = &ctx->peers[peer];

    for (ib_rdv_t *rd = p->rd_head; rd != NULL && p->reads_out < p->max_reads; rd = rd->next) {
        while (rd->posted < rd->len && p->reads_out < p->max_reads) {
            uint64_t            chunk = rd->len - rd->posted;
            struct ibv_sge      sg;
            struct ibv_send_wr  wr;
            struct ibv_send_wr *bad = NULL;
            int                 rc;

            if (chunk > ctx->chunk_bytes) chunk = ctx->chunk_bytes;
            sg.addr   = (uintptr_t)(rd->dst + rd->posted);
            sg.length = (uint32_t)chunk;
            sg.lkey   = rd->lkey;
            memset(&wr, 0, sizeof(wr));
            wr.wr_id               = WR_ID(WR_READ, peer, 0);
            wr.sg_list             = &sg;
            wr.num_sge             = 1;
            wr.opcode              = IBV_WR_RDMA_READ;
            wr.send_flags          = IBV_SEND_SIGNALED;
            wr.wr.rdma.remote_addr = rd->raddr + rd->posted;
            wr.wr.rdma.rkey        = rd->rkey;
            rc                     = ibv_post_send(p->qp, &wr, &bad);
            if (rc != 0) {
                ib_mark_broken(ctx, peer, "ibv_post_send (RDMA READ)", rc);
                return;
            }
            rd->posted += chunk;
            rd->nreads++;
            p->reads_out++;
        }
    }
}

/* Queues a FIN for the rendezvous `id` of the peer. */
static void ib_queue_fin(xccl_tp_ctx_t *ctx, int peer, uint64_t id, int32_t status)
{
    ib_peer_t *p = &ctx->peers[peer];
    ib_send_t *q = ib_send_get(ctx);

    if (q == NULL) {
        ib_fail_peer_fmt(ctx, peer, XCCL_ERR_NO_MEMORY, "out of memory for a FIN");
        return;
    }
    q->kind   = IB_MSG_FIN;
    q->id     = id;
    q->status = status;
    ib_q_push(&p->fq_head, &p->fq_tail, q);
}

/* ---- receiving ------------------------------------------------------------------------------ */

static void ib_handle_recv(xccl_tp_ctx_t *ctx, int peer, uint32_t slot, uint32_t byte_len)
{
    ib_peer_t    *p = &ctx->peers[peer];
    ib_wire_t     w;
    const char   *s = p->rslots + (size_t)slot * ctx->slot_bytes;
    xccl_tp_buf_t dst;
    void         *cookie = NULL;
    xccl_status_t st;
    int           rc, data = 1;
    char          why[160];

    if (byte_len < IB_WIRE_SZ) {
        snprintf(why, sizeof(why), "malformed message (%u bytes)", byte_len);
        goto bad;
    }
    memcpy(&w, s, sizeof(w));
    p->credits += (int)w.credits;
    if (w.ctrl_seen > p->ctrl_acked) p->ctrl_acked = w.ctrl_seen;
    if (p->credits > ctx->depth) {
        snprintf(why, sizeof(why), "protocol error: %d credits for %d receives", p->credits,
                 ctx->depth);
        goto bad;
    }
    switch (w.type) {
    case IB_MSG_CREDIT:
        p->ctrl_recv++;
        data = 0;
        break;
    case IB_MSG_EAGER:
        if (w.u.hdr.nbytes > ctx->eager_bytes || byte_len != IB_WIRE_SZ + w.u.hdr.nbytes) {
            snprintf(why, sizeof(why),
                     "malformed eager message (%u bytes, header says %" PRIu64 ")", byte_len,
                     w.u.hdr.nbytes);
            goto bad;
        }
        dst = (xccl_tp_buf_t){NULL, XCCL_MEM_HOST, NULL};
        st  = ctx->up->recv_match(ctx->up->core, peer, &w.u.hdr, &dst, &cookie);
        if (st < 0) {
            snprintf(why, sizeof(why), "message refused: %s", xccl_status_string(st));
            ib_fail_peer_fmt(ctx, peer, st, why);
            return;
        }
        if (dst.ptr != NULL && w.u.hdr.nbytes > 0) memcpy(dst.ptr, s + IB_WIRE_SZ, w.u.hdr.nbytes);
        ctx->up->recv_done(ctx->up->core, cookie, XCCL_OK);
        if (p->state != IB_P_UP) return;
        break;
    case IB_MSG_RTS: {
        ib_rdv_t *rd;
        dst = (xccl_tp_buf_t){NULL, XCCL_MEM_HOST, NULL};
        st  = ctx->up->recv_match(ctx->up->core, peer, &w.u.rts.hdr, &dst, &cookie);
        if (st < 0) {
            snprintf(why, sizeof(why), "message refused: %s", xccl_status_string(st));
            ib_fail_peer_fmt(ctx, peer, st, why);
            return;
        }
        if (dst.ptr == NULL || w.u.rts.hdr.nbytes == 0) { /* payload not wanted */
            ib_queue_fin(ctx, peer, w.u.rts.id, 0);
            ctx->up->recv_done(ctx->up->core, cookie, XCCL_OK);
            if (p->state != IB_P_UP) return;
            break;
        }
        if (dst.mr == NULL || dst.mem != XCCL_MEM_HOST) {
            ib_queue_fin(ctx, peer, w.u.rts.id, XCCL_ERR_NOT_SUPPORTED);
            xccl_error_set(XCCL_ERR_NOT_SUPPORTED,
                           "ibverbs: rank %d: receive of %" PRIu64 " bytes from rank %d into "
                           "unregistered or non-host memory",
                           ctx->rank, w.u.rts.hdr.nbytes, peer);
            ctx->up->recv_done(ctx->up->core, cookie, XCCL_ERR_NOT_SUPPORTED);
            if (p->state != IB_P_UP) return;
            break;
        }
        rd = ctx->free_rdvs;
        if (rd != NULL)
            ctx->free_rdvs = rd->next;
        else
            rd = malloc(sizeof(*rd));
        if (rd == NULL) {
            ctx->up->recv_done(ctx->up->core, cookie, XCCL_ERR_NO_MEMORY);
            ib_fail_peer_fmt(ctx, peer, XCCL_ERR_NO_MEMORY, "out of memory for a receive");
            return;
        }
        memset(rd, 0, sizeof(*rd));
        rd->raddr  = w.u.rts.addr;
        rd->rkey   = w.u.rts.rkey;
        rd->id     = w.u.rts.id;
        rd->len    = w.u.rts.hdr.nbytes;
        rd->dst    = dst.ptr;
        rd->lkey   = ((struct ibv_mr *)dst.mr)->lkey;
        rd->cookie = cookie;
        if (p->rd_tail)
            p->rd_tail->next = rd;
        else
            p->rd_head = rd;
        p->rd_tail = rd;
        ib_issue_reads(ctx, peer);
        break;
    }
    case IB_MSG_FIN: {
        ib_send_t *q, *prev = NULL;
        for (q = p->rts_head; q != NULL && q->id != w.u.fin.id; q = q->next)
            prev = q;
        if (q == NULL) {
            snprintf(why, sizeof(why), "protocol error: FIN for unknown send %" PRIu64, w.u.fin.id);
            goto bad;
        }
        if (prev)
            prev->next = q->next;
        else
            p->rts_head = q->next;
        if (p->rts_tail == q) p->rts_tail = prev;
        {
            void         *ck = q->cookie;
            xccl_status_t fs = w.u.fin.status == 0 ? XCCL_OK : XCCL_ERR_REMOTE;
            if (fs < 0)
                xccl_error_set(fs, "ibverbs: rank %d could not receive the message: %s", peer,
                               xccl_status_string((xccl_status_t)w.u.fin.status));
            ib_send_put(ctx, q);
            ctx->up->send_done(ctx->up->core, ck, fs);
        }
        if (p->state != IB_P_UP) return;
        break;
    }
    default:
        snprintf(why, sizeof(why), "malformed message (type %u)", w.type);
        goto bad;
    }
    rc = ib_post_recv(ctx, peer, slot);
    if (rc != 0) {
        snprintf(why, sizeof(why), "ibv_post_recv: %s", strerror(rc));
        goto bad;
    }
    if (data) p->owed++;
    return;
bad:
    ib_fail_peer_fmt(ctx, peer, XCCL_ERR_REMOTE, why);
}

static void ib_read_done(xccl_tp_ctx_t *ctx, int peer)
{
    ib_peer_t *p = &ctx->peers[peer];
    ib_rdv_t  *rd, *prev = NULL;

    p->reads_out--;
    for (rd = p->rd_head; rd != NULL && rd->nreads == 0; rd = rd->next)
        prev = rd;
    if (rd == NULL) return; /* cannot happen: completions come in posting order */
    rd->nreads--;
    if (rd->nreads > 0 || rd->posted < rd->len) return;
    if (prev)
        prev->next = rd->next;
    else
        p->rd_head = rd->next;
    if (p->rd_tail == rd) p->rd_tail = prev;
    ib_queue_fin(ctx, peer, rd->id, 0);
    {
        void *cookie   = rd->cookie;
        rd->next       = ctx->free_rdvs;
        ctx->free_rdvs = rd;
        ctx->up->recv_done(ctx->up->core, cookie, XCCL_OK);
    }
}

static int         ib_query_port(xccl_tp_ctx_t *ctx, struct ibv_context *c, uint8_t port,
                                 struct ibv_port_attr *pa);
static const char *ib_port_state_str(int s);

static void ib_handle_wc(xccl_tp_ctx_t *ctx, const struct ibv_wc *wc)
{
    int        kind = WR_KIND(wc->wr_id), peer = WR_PEER(wc->wr_id);
    ib_peer_t *p;

    if (peer < 0 || peer >= ctx->size) return;
    p = &ctx->peers[peer];
    if (p->state != IB_P_UP) return; /* flushed work of a failed peer */
    if (wc->status != IBV_WC_SUCCESS) {
        char                 what[200], port[64] = "";
        struct ibv_port_attr pa;
        /* a port that went down explains the failure better than the completion status */
        if (ib_query_port(ctx, ctx->dev, ctx->port, &pa) == 0 && pa.state != IBV_PORT_ACTIVE)
            snprintf(port, sizeof(port), "; port %u of %.32s is %s", ctx->port, ctx->dev_name,
                     ib_port_state_str(pa.state));
        snprintf(what, sizeof(what), "%s failed: %s (status %d, vendor error 0x%x)%s",
                 kind == WR_RECV   ? "receive"
                 : kind == WR_READ ? "RDMA READ"
                                   : "send",
                 ctx->f.wc_status_str(wc->status), (int)wc->status, wc->vendor_err, port);
        ib_fail_peer_fmt(ctx, peer, XCCL_ERR_REMOTE, what);
        return;
    }
    switch (kind) {
    case WR_SEND:
        p->sfree[p->nsfree++] = WR_IDX(wc->wr_id);
        break;
    case WR_RECV:
        ib_handle_recv(ctx, peer, WR_IDX(wc->wr_id), wc->byte_len);
        break;
    case WR_READ:
        ib_read_done(ctx, peer);
        break;
    default:
        break;
    }
    if (p->state != IB_P_UP) return;
    ib_issue_reads(ctx, peer);
    (void)ib_flush(ctx, peer);
}

/* ---- async events --------------------------------------------------------------------------- */

static int ib_peer_of_qp(const xccl_tp_ctx_t *ctx, const struct ibv_qp *qp)
{
    for (int r = 0; r < ctx->size; r++)
        if (ctx->peers[r].qp == qp && qp != NULL) return r;
    return -1;
}

static int ib_async(xccl_tp_ctx_t *ctx)
{
    struct ibv_async_event ev;
    int                    n = 0;

    while (ctx->f.get_async_event(ctx->dev, &ev) == 0) {
        enum ibv_event_type t    = ev.event_type;
        const char         *name = ctx->f.event_type_str(t);
        int                 peer = -1;
        char                what[200];
        n++;
        switch (t) {
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR:
        case IBV_EVENT_PATH_MIG_ERR:
            peer = ib_peer_of_qp(ctx, ev.element.qp);
            ctx->f.ack_async_event(&ev);
            if (peer >= 0) {
                snprintf(what, sizeof(what), "asynchronous event %s on its queue pair", name);
                ib_fail_peer_fmt(ctx, peer, XCCL_ERR_REMOTE, what);
            }
            break;
        case IBV_EVENT_PORT_ERR:
        case IBV_EVENT_DEVICE_FATAL: {
            int port = t == IBV_EVENT_PORT_ERR ? ev.element.port_num : 0;
            ctx->f.ack_async_event(&ev);
            if (t == IBV_EVENT_PORT_ERR && port != ctx->port) break;
            snprintf(what, sizeof(what), "asynchronous event %s", name);
            XCCL_WARN("ibverbs: rank %d: %s on %s", ctx->rank, what, ctx->dev_name);
            for (int r = 0; r < ctx->size; r++)
                if (ctx->peers[r].state == IB_P_UP) ib_fail_peer_fmt(ctx, r, XCCL_ERR_REMOTE, what);
            break;
        }
        default:
            XCCL_INFO("ibverbs: rank %d: asynchronous event %s on %s", ctx->rank, name,
                      ctx->dev_name);
            ctx->f.ack_async_event(&ev);
            break;
        }
    }
    return n;
}

/* ---- progress and sleeping ------------------------------------------------------------------ */

static int ib_poll(xccl_tp_ctx_t *ctx)
{
    struct ibv_wc wc[IB_POLL_BATCH];
    int           total = 0, n;

    if (ctx->cq == NULL) return 0;
    do {
        n = ibv_poll_cq(ctx->cq, IB_POLL_BATCH, wc);
        if (n < 0) {
            XCCL_WARN("ibverbs: rank %d: ibv_poll_cq failed (%d)", ctx->rank, n);
            for (int r = 0; r < ctx->size; r++)
                if (ctx->peers[r].state == IB_P_UP)
                    ib_fail_peer_fmt(ctx, r, XCCL_ERR_SYSTEM, "ibv_poll_cq failed");
            return total;
        }
        for (int i = 0; i < n; i++)
            ib_handle_wc(ctx, &wc[i]);
        total += n;
    } while (n == IB_POLL_BATCH && total < IB_POLL_BUDGET);
    return total;
}

/* The descriptors: the completion channel (consumes the event and acknowledges it, which
 * disarms), async events, the wake eventfd. */
static int ib_check_fds(xccl_tp_ctx_t *ctx)
{
    struct epoll_event evs[4];
    int                n = epoll_wait(ctx->epfd, evs, 4, 0), k = 0;

    for (int i = 0; i < n; i++) {
        if (evs[i].data.u32 == 1) {
            struct ibv_cq *cq;
            void          *cqc;
            if (ctx->f.get_cq_event(ctx->chan, &cq, &cqc) == 0) {
                ctx->f.ack_cq_events(cq, 1);
                atomic_store(&ctx->armed, 0);
                k++;
            }
        } else if (evs[i].data.u32 == 2) {
            k += ib_async(ctx);
        } else {
            uint64_t v;
            ssize_t  r = read(ctx->evfd, &v, sizeof(v));
            (void)r;
        }
    }
    return k;
}

static xccl_status_t ib_progress(xccl_tp_ctx_t *ctx, int *nevents)
{
    int     n   = 0;
    int64_t now = xccl_now_ms();

    if (ctx->nbroken > 0) {
        for (int r = 0; r < ctx->size; r++) {
            ib_peer_t *p = &ctx->peers[r];
            if (p->broken) {
                char why[200];
                snprintf(why, sizeof(why), "%s", p->broken_why);
                ib_fail_peer_fmt(ctx, r, XCCL_ERR_REMOTE, why);
            }
        }
    }
    n += ib_poll(ctx);
    if (atomic_load_explicit(&ctx->armed, memory_order_relaxed) || now >= ctx->next_async_ms) {
        ctx->next_async_ms = now + IB_ASYNC_CHECK_MS;
        n += ib_check_fds(ctx);
    }
    if (n == 0 && ctx->cq != NULL && atomic_load(&ctx->want_arm) && !atomic_load(&ctx->armed)) {
        /* arm, then look once more: a completion between the last poll and the arming
         * raises no event */
        if (ibv_req_notify_cq(ctx->cq, 0) == 0) {
            atomic_store(&ctx->want_arm, 0);
            atomic_store(&ctx->armed, 1);
        }
        n += ib_poll(ctx);
    }
    *nevents = n;
    return XCCL_OK;
}

static void ib_wait(xccl_tp_ctx_t *ctx, int timeout_ms)
{
    struct pollfd pfd = {.fd = ctx->epfd, .events = POLLIN};

    if (ctx->cq != NULL && !atomic_load(&ctx->armed)) {
        atomic_store(&ctx->want_arm, 1); /* the next idle progress pass arms */
        return;
    }
    (void)poll(&pfd, 1, timeout_ms);
}

static int ib_wait_arm(xccl_tp_ctx_t *ctx, int *fd)
{
    if (ctx->cq != NULL && !atomic_load(&ctx->armed)) {
        atomic_store(&ctx->want_arm, 1);
        return 0;
    }
    *fd = ctx->epfd;
    return 1;
}

/* ---- data path entries ---------------------------------------------------------------------- */

static xccl_status_t ib_isend(xccl_tp_ctx_t *ctx, int peer, const xccl_msg_hdr_t *hdr,
                              const xccl_tp_buf_t *buf, void *cookie)
{
    ib_peer_t *p;
    ib_send_t *q;

    if (peer < 0 || peer >= ctx->size || peer == ctx->rank)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "ibverbs: rank %d: send to invalid peer %d",
                          ctx->rank, peer);
    if (hdr->nbytes > 0 && (buf == NULL || buf->ptr == NULL))
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                          "ibverbs: rank %d: send of %" PRIu64 " bytes to rank %d without a "
                          "buffer",
                          ctx->rank, hdr->nbytes, peer);
    if (hdr->nbytes > 0 && buf->mem != XCCL_MEM_HOST)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                          "ibverbs: rank %d: send to rank %d from device memory", ctx->rank, peer);
    p = &ctx->peers[peer];
    if (p->state == IB_P_DEAD)
        return XCCL_ERROR(XCCL_ERR_REMOTE, "ibverbs: rank %d: cannot send to rank %d: %s",
                          ctx->rank, peer, p->why);
    if (p->state != IB_P_UP)
        return XCCL_ERROR(XCCL_ERR_INVALID_USAGE,
                          "ibverbs: rank %d: send to rank %d, which is not wired up", ctx->rank,
                          peer);
    if (hdr->nbytes > ctx->eager_bytes && buf->mr == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_USAGE,
                          "ibverbs: rank %d: send of %" PRIu64 " bytes to rank %d from "
                          "unregistered memory",
                          ctx->rank, hdr->nbytes, peer);
    q = ib_send_get(ctx);
    if (q == NULL)
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "ibverbs: rank %d: send request", ctx->rank);
    q->hdr    = *hdr;
    q->buf    = hdr->nbytes > 0 ? buf->ptr : NULL;
    q->cookie = cookie;
    if (hdr->nbytes > ctx->eager_bytes) {
        q->kind = IB_MSG_RTS;
        q->rkey = ((struct ibv_mr *)buf->mr)->rkey;
        q->id   = ++p->next_id;
    } else {
        q->kind = IB_MSG_EAGER;
    }
    ib_q_push(&p->sq_head, &p->sq_tail, q);
    (void)ib_flush(ctx, peer);
    return XCCL_OK;
}

static void ib_close_peer(xccl_tp_ctx_t *ctx, int peer, const char *why)
{
    char msg[320];

    if (peer < 0 || peer >= ctx->size) return;
    snprintf(msg, sizeof(msg), "ibverbs connection to rank %d dropped: %.250s", peer, why);
    ib_fail_peer(ctx, peer, XCCL_ERR_ABORTED, msg);
}

/* ---- memory registration -------------------------------------------------------------------- */

static void ib_fmt_bytes(uint64_t b, char *buf, size_t len)
{
    if (b == (uint64_t)RLIM_INFINITY)
        snprintf(buf, len, "unlimited");
    else if (b >= (1ull << 30) && b % (1ull << 30) == 0)
        snprintf(buf, len, "%" PRIu64 " GiB", b >> 30);
    else if (b >= (1ull << 20) && b % (1ull << 20) == 0)
        snprintf(buf, len, "%" PRIu64 " MiB", b >> 20);
    else if (b >= 1024 && b % 1024 == 0)
        snprintf(buf, len, "%" PRIu64 " KiB", b >> 10);
    else
        snprintf(buf, len, "%" PRIu64 " bytes", b);
}

static struct ibv_mr *ib_reg(xccl_tp_ctx_t *ctx, void *ptr, size_t n, int access, xccl_status_t *st)
{
    struct ibv_mr *mr = ctx->f.reg_mr(ctx->pd, ptr, n, access);
    int            e  = errno;
    struct rlimit  rl;
    char           cur[32], sz[32];

    if (mr != NULL) return mr;
    ib_fmt_bytes(n, sz, sizeof(sz));
    if ((e == ENOMEM || e == EPERM || e == EAGAIN) && getrlimit(RLIMIT_MEMLOCK, &rl) == 0 &&
        rl.rlim_cur != RLIM_INFINITY) {
        ib_fmt_bytes(rl.rlim_cur, cur, sizeof(cur));
        *st = XCCL_ERROR(XCCL_ERR_NO_MEMORY,
                         "ibverbs: rank %d: cannot register %s at %p with %s: %s; the "
                         "locked-memory limit (RLIMIT_MEMLOCK) is %s: raise it (ulimit -l "
                         "unlimited in the shell that starts the job, a 'memlock' line in "
                         "/etc/security/limits.conf, or docker run --ulimit memlock=-1)",
                         ctx->rank, sz, ptr, ctx->dev_name, strerror(e), cur);
    } else {
        *st = XCCL_ERROR(e == ENOMEM ? XCCL_ERR_NO_MEMORY : XCCL_ERR_SYSTEM,
                         "ibverbs: rank %d: cannot register %s at %p with %s: %s", ctx->rank, sz,
                         ptr, ctx->dev_name, strerror(e));
    }
    return NULL;
}

static xccl_status_t ib_mem_reg(xccl_tp_ctx_t *ctx, void *ptr, size_t nbytes, xccl_mem_type_t mem,
                                void **mr)
{
    xccl_status_t  st = XCCL_OK;
    struct ibv_mr *m;

    if (mem != XCCL_MEM_HOST)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                          "ibverbs: rank %d: registering device memory is not supported",
                          ctx->rank);
    m = ib_reg(ctx, ptr, nbytes,
               IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE, &st);
    if (m == NULL) return st;
    *mr = m;
    return XCCL_OK;
}

static void ib_mem_dereg(xccl_tp_ctx_t *ctx, void *mr)
{
    if (mr != NULL && ctx->f.dereg_mr((struct ibv_mr *)mr) != 0)
        XCCL_WARN("ibverbs: rank %d: ibv_dereg_mr failed: %s", ctx->rank, strerror(errno));
}

/* ---- device and address selection ---------------------------------------------------------- */

/* What verbs.h's ibv_query_port does (an inline over the extended context when the provider
 * has it, else the exported compat entry point, which fills the leading fields). */
static int ib_query_port(xccl_tp_ctx_t *ctx, struct ibv_context *c, uint8_t port,
                         struct ibv_port_attr *pa)
{
    struct verbs_context *vctx = verbs_get_ctx_op(c, query_port);

    memset(pa, 0, sizeof(*pa));
    if (vctx != NULL) return vctx->query_port(c, port, pa, sizeof(*pa));
    return ctx->f.query_port(c, port, pa);
}

/* Reads /sys/class/infiniband/<dev>/ports/<port>/gid_attrs/types/<i>; "" when unknown. */
static void ib_gid_type(const char *dev, int port, int i, char *buf, size_t len)
{
    char  path[256];
    FILE *f;

    buf[0] = '\0';
    snprintf(path, sizeof(path), "/sys/class/infiniband/%s/ports/%d/gid_attrs/types/%d", dev, port,
             i);
    f = fopen(path, "r");
    if (f == NULL) return;
    if (fgets(buf, (int)len, f) == NULL) buf[0] = '\0';
    fclose(f);
    buf[strcspn(buf, "\n")] = '\0';
}

/* RoCE: picks the GID index (see the file comment). 0, -1 (none usable: why) or -2 (a bad
 * XCCL_IB_GID_INDEX: why). */
static int ib_pick_gid(xccl_tp_ctx_t *ctx, char *why, size_t len)
{
    const char *env    = getenv("XCCL_IB_GID_INDEX");
    int64_t     forced = -1;
    int         best = -1, best_rank = 0;

    if (env != NULL && *env != '\0') { /* a decimal index; anything else is a mistake */
        char *end = NULL;
        long  v;
        errno = 0;
        v     = strtol(env, &end, 10);
        if (errno != 0 || end == env || *end != '\0' || v < 0 || v > 255) {
            snprintf(why, len,
                     "XCCL_IB_GID_INDEX='%.32s': expected a GID index from 0 to 255 (unset: "
                     "chosen automatically)",
                     env);
            return -2;
        }
        forced = v;
    }
    if (forced >= 0) {
        char t[32];
        int  zero = 1;
        if (forced < ctx->pattr.gid_tbl_len &&
            ctx->f.query_gid(ctx->dev, ctx->port, (int)forced, &ctx->gid) == 0) {
            for (int k = 0; k < 16; k++)
                zero &= ctx->gid.raw[k] == 0;
        }
        if (zero) {
            snprintf(why, len,
                     "XCCL_IB_GID_INDEX=%" PRId64 ": %s port %u has no GID there "
                     "(table of %d entries; ibv_devinfo -v lists them)",
                     forced, ctx->dev_name, ctx->port, ctx->pattr.gid_tbl_len);
            return -2;
        }
        ib_gid_type(ctx->dev_name, ctx->port, (int)forced, t, sizeof(t));
        ctx->gid_index = (int)forced;
        snprintf(ctx->gid_kind, sizeof(ctx->gid_kind), "%s, forced", t[0] ? t : "type unknown");
        return 0;
    }
    for (int i = 0; i < ctx->pattr.gid_tbl_len && i < 256; i++) {
        union ibv_gid g;
        char          t[32];
        int           rank, zero = 1, v4, ll;
        if (ctx->f.query_gid(ctx->dev, ctx->port, i, &g) != 0) continue;
        for (int k = 0; k < 16; k++)
            zero &= g.raw[k] == 0;
        if (zero) continue;
        ib_gid_type(ctx->dev_name, ctx->port, i, t, sizeof(t));
        v4 = g.raw[10] == 0xff && g.raw[11] == 0xff;
        for (int k = 0; k < 10; k++)
            v4 &= g.raw[k] == 0;
        ll = g.raw[0] == 0xfe && (g.raw[1] & 0xc0) == 0x80;
        if (strcmp(t, "RoCE v2") == 0)
            rank = v4 ? 5 : ll ? 4 : 3;
        else if (t[0] != '\0')
            rank = 2; /* "IB/RoCE v1" */
        else
            rank = 1; /* no sysfs type (old kernel): the first one */
        if (rank > best_rank) {
            best_rank = rank;
            best      = i;
            ctx->gid  = g;
            snprintf(ctx->gid_kind, sizeof(ctx->gid_kind), "%s%s", t[0] ? t : "type unknown",
                     rank == 5   ? ", IPv4"
                     : rank == 4 ? ", link-local"
                                 : "");
        }
    }
    if (best < 0) {
        snprintf(why, len, "%s port %u (RoCE) has no usable GID", ctx->dev_name, ctx->port);
        return -1;
    }
    ctx->gid_index = best;
    return 0;
}

/* Opens the device and port to use. 0, -1 (not usable: why) or -2 (user error: why). */
static int ib_open_port(xccl_tp_ctx_t *ctx, char *why, size_t len)
{
    const char         *spec = getenv("XCCL_IB_HCA");
    xccl_ib_hca_t       hca;
    char                err[200], seen[256] = "";
    struct ibv_device **list;
    int                 ndev = 0;

    if (xccl_ib_hca_parse(spec, &hca, err, sizeof(err)) != 0) {
        snprintf(why, len, "XCCL_IB_HCA='%s': %s", spec, err);
        return -2;
    }
    errno = 0;
    list  = ctx->f.get_device_list(&ndev);
    if (list == NULL || ndev == 0) {
        int e = errno;
        if (list != NULL) ctx->f.free_device_list(list);
        snprintf(why, len, "no RDMA device (ibv_get_device_list: %s)",
                 e != 0 ? strerror(e) : "none found");
        return -1;
    }
    for (int d = 0; d < ndev && ctx->dev == NULL; d++) {
        const char            *name = ctx->f.get_device_name(list[d]);
        struct ibv_context    *c    = ctx->f.open_device(list[d]);
        struct ibv_device_attr da;
        if (c == NULL) {
            size_t sl = strlen(seen);
            snprintf(seen + sl, sizeof(seen) - sl, "%s%s (cannot open: %s)", sl ? ", " : "", name,
                     strerror(errno));
            continue;
        }
        if (ctx->f.query_device(c, &da) != 0) {
            ctx->f.close_device(c);
            continue;
        }
        for (int port = 1; port <= da.phys_port_cnt; port++) {
            struct ibv_port_attr pa;
            size_t               sl = strlen(seen);
            memset(&pa, 0, sizeof(pa));
            if (ib_query_port(ctx, c, (uint8_t)port, &pa) != 0) continue;
            snprintf(seen + sl, sizeof(seen) - sl, "%s%s:%d %s", sl ? ", " : "", name, port,
                     ib_port_state_str(pa.state));
            if (pa.state != IBV_PORT_ACTIVE || !xccl_ib_hca_match(&hca, name, port)) continue;
            ctx->dev   = c;
            ctx->port  = (uint8_t)port;
            ctx->pattr = pa;
            ctx->dattr = da;
            snprintf(ctx->dev_name, sizeof(ctx->dev_name), "%s", name);
            break;
        }
        if (ctx->dev != c) ctx->f.close_device(c);
    }
    ctx->f.free_device_list(list);
    if (ctx->dev == NULL) {
        if (hca.n > 0) {
            snprintf(why, len, "XCCL_IB_HCA='%s' matches no active port (seen: %s)", spec, seen);
            return -2;
        }
        snprintf(why, len, "no active RDMA port (seen: %s)", seen);
        return -1;
    }
    return 0;
}

/* ---- init / finalize ------------------------------------------------------------------------ */

static void ib_finalize(xccl_tp_ctx_t *ctx)
{
    if (ctx == NULL) return;
    if (ctx->peers != NULL) {
        for (int r = 0; r < ctx->size; r++) {
            ib_peer_t *p = &ctx->peers[r];
            ib_send_t *q;
            ib_rdv_t  *rd;
            if (p->qp != NULL) (void)ctx->f.destroy_qp(p->qp);
            while ((q = ib_q_pop(&p->fq_head, &p->fq_tail)) != NULL)
                free(q);
            while ((q = ib_q_pop(&p->sq_head, &p->sq_tail)) != NULL)
                free(q);
            while ((q = ib_q_pop(&p->rts_head, &p->rts_tail)) != NULL)
                free(q);
            while ((rd = p->rd_head) != NULL) {
                p->rd_head = rd->next;
                free(rd);
            }
            free(p->sfree);
        }
        free(ctx->peers);
    }
    while (ctx->free_sends != NULL) {
        ib_send_t *q    = ctx->free_sends;
        ctx->free_sends = q->next;
        free(q);
    }
    while (ctx->free_rdvs != NULL) {
        ib_rdv_t *rd   = ctx->free_rdvs;
        ctx->free_rdvs = rd->next;
        free(rd);
    }
    if (ctx->slab_mr != NULL) (void)ctx->f.dereg_mr(ctx->slab_mr);
    free(ctx->slab);
    if (ctx->cq != NULL) (void)ctx->f.destroy_cq(ctx->cq);
    if (ctx->chan != NULL) (void)ctx->f.destroy_comp_channel(ctx->chan);
    if (ctx->pd != NULL) (void)ctx->f.dealloc_pd(ctx->pd);
    if (ctx->dev != NULL) (void)ctx->f.close_device(ctx->dev);
    if (ctx->epfd >= 0) close(ctx->epfd);
    if (ctx->evfd >= 0) close(ctx->evfd);
    if (ctx->f.lib != NULL) dlclose(ctx->f.lib);
    free(ctx);
}

static int ib_set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static int ib_epoll_add(xccl_tp_ctx_t *ctx, int fd, uint32_t tag)
{
    struct epoll_event ev;

    memset(&ev, 0, sizeof(ev));
    ev.events   = EPOLLIN;
    ev.data.u32 = tag;
    return epoll_ctl(ctx->epfd, EPOLL_CTL_ADD, fd, &ev);
}

static int64_t ib_env_range(const char *name, int64_t def, int64_t lo, int64_t hi)
{
    int64_t v = xccl_env_int(name, def);
    if (v < lo || v > hi) {
        XCCL_WARN("ibverbs: %s=%" PRId64 " is outside [%" PRId64 ", %" PRId64 "]: using %" PRId64,
                  name, v, lo, hi, def);
        v = def;
    }
    return v;
}

static xccl_status_t ib_init(const xccl_tp_init_params_t *params, xccl_tp_ctx_t **out)
{
    xccl_tp_ctx_t *ctx;
    char           why[512];
    int            rc;
    xccl_status_t  st;

    *out = NULL;
    if (params->kv == NULL)
        return xccl_error_set(XCCL_ERR_NOT_SUPPORTED,
                              "no bootstrap store to exchange connection data through");
    ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "ibverbs: init: out of memory");
    ctx->epfd   = -1;
    ctx->evfd   = -1;
    ctx->rank   = params->rank;
    ctx->size   = params->size;
    ctx->job_id = params->job_id;
    ctx->up     = params->up;
    ctx->kv     = params->kv;
    if (ib_fns_load(&ctx->f, why, sizeof(why)) != 0) {
        ib_finalize(ctx);
        return xccl_error_set(XCCL_ERR_NOT_SUPPORTED, "%s", why);
    }
    rc = ib_open_port(ctx, why, sizeof(why));
    if (rc != 0) {
        ib_finalize(ctx);
        if (rc == -2) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "ibverbs: %s", why);
        return xccl_error_set(XCCL_ERR_NOT_SUPPORTED, "%s", why);
    }
    if (ctx->pattr.link_layer == IBV_LINK_LAYER_ETHERNET) {
        rc = ib_pick_gid(ctx, why, sizeof(why));
        if (rc != 0) {
            ib_finalize(ctx);
            if (rc == -2) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "ibverbs: %s", why);
            return xccl_error_set(XCCL_ERR_NOT_SUPPORTED, "%s", why);
        }
    } else {
        ctx->gid_index = -1;
        if (ctx->pattr.lid == 0) {
            snprintf(why, sizeof(why),
                     "%s port %u (InfiniBand) has no LID yet (no subnet "
                     "manager?)",
                     ctx->dev_name, ctx->port);
            ib_finalize(ctx);
            return xccl_error_set(XCCL_ERR_NOT_SUPPORTED, "%s", why);
        }
        snprintf(ctx->gid_kind, sizeof(ctx->gid_kind), "InfiniBand LID %u", ctx->pattr.lid);
    }

    /* knobs: 8 KiB eager (a receive slot per peer and credit costs this much pinned memory:
     * 64 peers * 33 slots * 2 (send + receive) * 8 KiB = 34 MiB) and 32 credits (enough to
     * keep a link busy with small messages while the receiver is between progress passes) */
    ctx->eager_bytes = (size_t)ib_env_range("XCCL_IB_EAGER_BYTES", 8192, 0, 1 << 20);
    ctx->depth       = (int)ib_env_range("XCCL_IB_RECV_DEPTH", 32, 2, 4096);
    ctx->timeout     = (int)ib_env_range("XCCL_IB_TIMEOUT", 20, 1, 31);
    ctx->retry_cnt   = (int)ib_env_range("XCCL_IB_RETRY_CNT", 7, 0, 7);
    ctx->sl          = (int)ib_env_range("XCCL_IB_SL", 0, 0, 15);
    ctx->tc          = (int)ib_env_range("XCCL_IB_TC", 0, 0, 255);
    ctx->chunk_bytes = (uint64_t)ib_env_range("XCCL_IB_CHUNK_BYTES", 1 << 20, 4096, 1 << 30);
    if (ctx->pattr.max_msg_sz > 0 && ctx->chunk_bytes > ctx->pattr.max_msg_sz)
        ctx->chunk_bytes = ctx->pattr.max_msg_sz;
    ctx->max_reads = (int)ib_env_range("XCCL_IB_READS", 8, 1, 128);
    if (ctx->dattr.max_qp_rd_atom > 0 && ctx->max_reads > ctx->dattr.max_qp_rd_atom)
        ctx->max_reads = ctx->dattr.max_qp_rd_atom;
    if (ctx->dattr.max_qp_init_rd_atom > 0 && ctx->max_reads > ctx->dattr.max_qp_init_rd_atom)
        ctx->max_reads = ctx->dattr.max_qp_init_rd_atom;
    ctx->slot_bytes = (IB_WIRE_SZ + ctx->eager_bytes + 63) & ~(size_t)63;
    ctx->nsslots    = ctx->depth + 2;

    ctx->pd = ctx->f.alloc_pd(ctx->dev);
    if (ctx->pd == NULL) {
        st = XCCL_ERROR(XCCL_ERR_SYSTEM, "ibverbs: ibv_alloc_pd on %s: %s", ctx->dev_name,
                        strerror(errno));
        goto fail;
    }
    ctx->chan = ctx->f.create_comp_channel(ctx->dev);
    if (ctx->chan == NULL) {
        st = XCCL_ERROR(XCCL_ERR_SYSTEM, "ibverbs: ibv_create_comp_channel on %s: %s",
                        ctx->dev_name, strerror(errno));
        goto fail;
    }
    ctx->epfd = epoll_create1(EPOLL_CLOEXEC);
    ctx->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (ctx->epfd < 0 || ctx->evfd < 0 || ib_set_nonblock(ctx->chan->fd) != 0 ||
        ib_set_nonblock(ctx->dev->async_fd) != 0 || ib_epoll_add(ctx, ctx->chan->fd, 1) != 0 ||
        ib_epoll_add(ctx, ctx->dev->async_fd, 2) != 0 || ib_epoll_add(ctx, ctx->evfd, 3) != 0) {
        st = XCCL_ERROR(XCCL_ERR_SYSTEM, "ibverbs: epoll/eventfd: %s", strerror(errno));
        goto fail;
    }
    ctx->peers = calloc((size_t)ctx->size, sizeof(*ctx->peers));
    if (ctx->peers == NULL) {
        st = XCCL_ERROR(XCCL_ERR_NO_MEMORY, "ibverbs: init: out of memory");
        goto fail;
    }
    {
        char g[64];
        ib_gid_str(ctx->gid.raw, g, sizeof(g));
        XCCL_INFO("ibverbs: rank %d: %s port %u, %s, MTU %s, GID[%d] %s (%s)", ctx->rank,
                  ctx->dev_name, ctx->port,
                  ctx->pattr.link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "InfiniBand",
                  ib_mtu_str(ctx->pattr.active_mtu), ctx->gid_index, g, ctx->gid_kind);
    }
    *out = ctx;
    return XCCL_OK;
fail:
    ib_finalize(ctx);
    return st;
}

static int ib_reachable(const xccl_tp_ctx_t *ctx, int peer)
{
    return peer != ctx->rank; /* any host; the blobs say at wire-up whether the fabrics meet */
}

static xccl_status_t ib_get_addr(xccl_tp_ctx_t *ctx, void *addr, size_t *len)
{
    ib_addr_t a;

    if (*len < sizeof(a)) return XCCL_ERROR(XCCL_ERR_INTERNAL, "ibverbs: address blob too small");
    memset(&a, 0, sizeof(a));
    a.magic      = IB_MAGIC;
    a.version    = IB_VERSION;
    a.link_layer = ctx->pattr.link_layer;
    a.port       = ctx->port;
    a.mtu        = (uint8_t)ctx->pattr.active_mtu;
    a.gid_index  = (uint8_t)(ctx->gid_index < 0 ? 0 : ctx->gid_index);
    a.lid        = ctx->pattr.lid;
    a.rank       = (uint32_t)ctx->rank;
    a.job_id     = ctx->job_id;
    memcpy(a.gid, ctx->gid.raw, 16);
    snprintf(a.dev, sizeof(a.dev), "%.31s", ctx->dev_name);
    memcpy(addr, &a, sizeof(a));
    *len = sizeof(a);
    return XCCL_OK;
}

/* ---- wire-up -------------------------------------------------------------------------------- */

/* Lists in buf the used peers whose key "<fmt with p>" is missing in the store now. */
static void ib_missing(xccl_tp_ctx_t *ctx, const uint8_t *use, int first, int pair, char *buf,
                       size_t len)
{
    size_t off = 0;
    int    n   = 0;

    buf[0] = '\0';
    for (int r = first; r < ctx->size; r++) {
        char   key[64];
        void  *v = NULL;
        size_t vl;
        if (r == ctx->rank || !use[r]) continue;
        if (pair)
            snprintf(key, sizeof(key), "%d-%d", r, ctx->rank);
        else
            snprintf(key, sizeof(key), "ready/%d", r);
        if (ctx->kv->get(ctx->kv->core, key, 0, &v, &vl) == XCCL_OK) {
            free(v);
            continue;
        }
        if (n++ < 16 && off < len)
            off += (size_t)snprintf(buf + off, len - off, "%s%d", off ? ", " : "", r);
    }
    if (n > 16 && off < len) snprintf(buf + off, len - off, " and %d more", n - 16);
}

static xccl_status_t ib_qp_create(xccl_tp_ctx_t *ctx, int peer)
{
    ib_peer_t              *p = &ctx->peers[peer];
    struct ibv_qp_init_attr ia;
    struct ibv_qp_attr      a;
    int                     rc;

    memset(&ia, 0, sizeof(ia));
    ia.send_cq          = ctx->cq;
    ia.recv_cq          = ctx->cq;
    ia.qp_type          = IBV_QPT_RC;
    ia.cap.max_send_wr  = (uint32_t)(ctx->nsslots + ctx->max_reads + 1);
    ia.cap.max_recv_wr  = (uint32_t)(ctx->depth + 1);
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    p->qp               = ctx->f.create_qp(ctx->pd, &ia);
    if (p->qp == NULL)
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "ibverbs: rank %d: ibv_create_qp for rank %d on %s: %s",
                          ctx->rank, peer, ctx->dev_name, strerror(errno));
    memset(&a, 0, sizeof(a));
    a.qp_state        = IBV_QPS_INIT;
    a.pkey_index      = 0;
    a.port_num        = ctx->port;
    a.qp_access_flags = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
    rc = ctx->f.modify_qp(p->qp, &a,
                          IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (rc != 0)
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "ibverbs: rank %d: QP for rank %d to INIT: %s",
                          ctx->rank, peer, strerror(rc));
    for (int i = 0; i <= ctx->depth; i++) {
        rc = ib_post_recv(ctx, peer, (uint32_t)i);
        if (rc != 0)
            return XCCL_ERROR(XCCL_ERR_SYSTEM, "ibverbs: rank %d: ibv_post_recv for rank %d: %s",
                              ctx->rank, peer, strerror(rc));
    }
    return XCCL_OK;
}

static xccl_status_t ib_qp_connect(xccl_tp_ctx_t *ctx, int peer, const ib_conn_t *c, uint32_t psn)
{
    ib_peer_t         *p = &ctx->peers[peer];
    struct ibv_qp_attr a;
    int                rc, mtu = ctx->pattr.active_mtu;

    if (p->addr.mtu < mtu) mtu = p->addr.mtu;
    memset(&a, 0, sizeof(a));
    a.qp_state           = IBV_QPS_RTR;
    a.path_mtu           = (enum ibv_mtu)mtu;
    a.dest_qp_num        = c->qpn;
    a.rq_psn             = c->psn;
    a.max_dest_rd_atomic = (uint8_t)ctx->max_reads;
    a.min_rnr_timer      = 12;
    a.ah_attr.port_num   = ctx->port;
    a.ah_attr.sl         = (uint8_t)ctx->sl;
    if (ctx->pattr.link_layer == IBV_LINK_LAYER_ETHERNET) {
        a.ah_attr.is_global         = 1;
        a.ah_attr.grh.sgid_index    = (uint8_t)ctx->gid_index;
        a.ah_attr.grh.hop_limit     = 255;
        a.ah_attr.grh.traffic_class = (uint8_t)ctx->tc;
        memcpy(a.ah_attr.grh.dgid.raw, p->addr.gid, 16);
    } else {
        a.ah_attr.is_global = 0;
        a.ah_attr.dlid      = p->addr.lid;
    }
    rc = ctx->f.modify_qp(p->qp, &a,
                          IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                              IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc != 0)
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "ibverbs: rank %d: QP for rank %d to RTR: %s", ctx->rank,
                          peer, strerror(rc));
    memset(&a, 0, sizeof(a));
    a.qp_state      = IBV_QPS_RTS;
    a.timeout       = (uint8_t)ctx->timeout;
    a.retry_cnt     = (uint8_t)ctx->retry_cnt;
    a.rnr_retry     = 7;
    a.sq_psn        = psn;
    a.max_rd_atomic = (uint8_t)p->max_reads;
    rc = ctx->f.modify_qp(p->qp, &a,
                          IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                              IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
    if (rc != 0)
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "ibverbs: rank %d: QP for rank %d to RTS: %s", ctx->rank,
                          peer, strerror(rc));
    return XCCL_OK;
}

static xccl_status_t ib_wireup(xccl_tp_ctx_t *ctx, const void *const *addrs, const size_t *lens,
                               const uint8_t *use, int64_t timeout_ms)
{
    int64_t       deadline = xccl_now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
    int           nused    = 0, ncqe;
    uint32_t     *psn      = NULL;
    xccl_status_t st       = XCCL_OK;
    size_t        per_peer;
    char          key[64], miss[256];

    for (int r = 0; r < ctx->size; r++) {
        ib_addr_t a;
        if (r == ctx->rank || !use[r]) continue;
        if (addrs[r] == NULL || lens[r] != sizeof(a))
            return XCCL_ERROR(XCCL_ERR_REMOTE, "ibverbs: rank %d: bad address blob from rank %d",
                              ctx->rank, r);
        memcpy(&a, addrs[r], sizeof(a));
        if (a.magic != IB_MAGIC || a.version != IB_VERSION || a.job_id != ctx->job_id ||
            a.rank != (uint32_t)r)
            return XCCL_ERROR(XCCL_ERR_REMOTE,
                              "ibverbs: rank %d: address blob of rank %d is from another "
                              "version or job",
                              ctx->rank, r);
        if (a.link_layer != ctx->pattr.link_layer)
            return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                              "ibverbs: rank %d (%s, %s) cannot reach rank %d (%s, %s): "
                              "InfiniBand and RoCE do not meet",
                              ctx->rank, ctx->dev_name,
                              ctx->pattr.link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "IB", r,
                              a.dev, a.link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "IB");
        a.dev[sizeof(a.dev) - 1] = '\0';
        ctx->peers[r].addr       = a;
        nused++;
    }
    if (nused == 0) return XCCL_OK;

    /* one CQ for every QP's send and receive queues */
    ncqe = nused * (ctx->nsslots + ctx->max_reads + 1 + ctx->depth + 1) + 16;
    if (ctx->dattr.max_cqe > 0 && ncqe > ctx->dattr.max_cqe) ncqe = ctx->dattr.max_cqe;
    ctx->cq = ctx->f.create_cq(ctx->dev, ncqe, NULL, ctx->chan, 0);
    if (ctx->cq == NULL)
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "ibverbs: rank %d: ibv_create_cq (%d entries) on %s: %s",
                          ctx->rank, ncqe, ctx->dev_name, strerror(errno));

    /* the slots of every peer: one allocation, one registration */
    per_peer      = (size_t)(ctx->depth + 1 + ctx->nsslots) * ctx->slot_bytes;
    ctx->slab_len = per_peer * (size_t)nused;
    if (posix_memalign((void **)&ctx->slab, 4096, ctx->slab_len) != 0)
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "ibverbs: rank %d: %zu bytes of message slots",
                          ctx->rank, ctx->slab_len);
    memset(ctx->slab, 0, ctx->slab_len);
    ctx->slab_mr = ib_reg(ctx, ctx->slab, ctx->slab_len, IBV_ACCESS_LOCAL_WRITE, &st);
    if (ctx->slab_mr == NULL) return st;
    psn = calloc((size_t)ctx->size, sizeof(*psn));
    if (psn == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "ibverbs: wireup: out of memory");

    /* QPs in INIT with their receives posted, and this rank's half of each pair published */
    {
        int k = 0;
        for (int r = 0; r < ctx->size; r++) {
            ib_peer_t *p = &ctx->peers[r];
            ib_conn_t  c;
            if (r == ctx->rank || !use[r]) continue;
            p->rslots = ctx->slab + per_peer * (size_t)k++;
            p->sslots = p->rslots + (size_t)(ctx->depth + 1) * ctx->slot_bytes;
            p->sfree  = malloc((size_t)ctx->nsslots * sizeof(*p->sfree));
            if (p->sfree == NULL) {
                st = XCCL_ERROR(XCCL_ERR_NO_MEMORY, "ibverbs: wireup: out of memory");
                goto out;
            }
            for (int i = 0; i < ctx->nsslots; i++)
                p->sfree[i] = (uint32_t)(ctx->nsslots - 1 - i);
            p->nsfree  = ctx->nsslots;
            p->credits = ctx->depth;
            XCCL_CHECK_GOTO(xccl_random_bytes(&psn[r], sizeof(psn[r])), st, out);
            psn[r] &= 0xffffff;
            XCCL_CHECK_GOTO(ib_qp_create(ctx, r), st, out);
            memset(&c, 0, sizeof(c));
            c.magic       = IB_MAGIC;
            c.from        = (uint32_t)ctx->rank;
            c.to          = (uint32_t)r;
            c.qpn         = p->qp->qp_num;
            c.psn         = psn[r];
            c.depth       = (uint32_t)ctx->depth;
            c.eager_bytes = (uint32_t)ctx->eager_bytes;
            c.reads       = (uint32_t)ctx->max_reads;
            c.job_id      = ctx->job_id;
            snprintf(key, sizeof(key), "%d-%d", ctx->rank, r);
            XCCL_CHECK_GOTO(ctx->kv->put(ctx->kv->core, key, &c, sizeof(c)), st, out);
        }
    }
    /* the peers' halves: RTR, RTS */
    for (int r = 0; r < ctx->size; r++) {
        void     *v  = NULL;
        size_t    vl = 0;
        ib_conn_t c;
        if (r == ctx->rank || !use[r]) continue;
        snprintf(key, sizeof(key), "%d-%d", r, ctx->rank);
        st = ctx->kv->get(ctx->kv->core, key, deadline - xccl_now_ms(), &v, &vl);
        if (st == XCCL_ERR_TIMEOUT) {
            ib_missing(ctx, use, r, 1, miss, sizeof(miss));
            st = XCCL_ERROR(XCCL_ERR_TIMEOUT,
                            "ibverbs: rank %d: wire-up timed out after %.1f s: no connection "
                            "data from rank(s) %s",
                            ctx->rank, (double)timeout_ms / 1000.0, miss[0] ? miss : "?");
            goto out;
        }
        if (st < 0) goto out;
        if (vl != sizeof(c)) {
            free(v);
            st = XCCL_ERROR(XCCL_ERR_REMOTE, "ibverbs: rank %d: bad connection data from rank %d",
                            ctx->rank, r);
            goto out;
        }
        memcpy(&c, v, sizeof(c));
        free(v);
        if (c.magic != IB_MAGIC || c.from != (uint32_t)r || c.to != (uint32_t)ctx->rank ||
            c.job_id != ctx->job_id) {
            st = XCCL_ERROR(XCCL_ERR_REMOTE,
                            "ibverbs: rank %d: connection data from rank %d is from another job",
                            ctx->rank, r);
            goto out;
        }
        if (c.depth != (uint32_t)ctx->depth || c.eager_bytes != (uint32_t)ctx->eager_bytes) {
            st = XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                            "ibverbs: rank %d: XCCL_IB_RECV_DEPTH / XCCL_IB_EAGER_BYTES must be "
                            "the same on every rank: %u / %u here, %u / %u on rank %d",
                            ctx->rank, (unsigned)ctx->depth, (unsigned)ctx->eager_bytes,
                            (unsigned)c.depth, (unsigned)c.eager_bytes, r);
            goto out;
        }
        ctx->peers[r].max_reads = (int)c.reads < ctx->max_reads ? (int)c.reads : ctx->max_reads;
        if (ctx->peers[r].max_reads < 1) ctx->peers[r].max_reads = 1;
        XCCL_CHECK_GOTO(ib_qp_connect(ctx, r, &c, psn[r]), st, out);
    }
    /* every peer's QP towards this rank in RTR before anyone sends */
    snprintf(key, sizeof(key), "ready/%d", ctx->rank);
    XCCL_CHECK_GOTO(ctx->kv->put(ctx->kv->core, key, "1", 1), st, out);
    for (int r = 0; r < ctx->size; r++) {
        void  *v = NULL;
        size_t vl;
        if (r == ctx->rank || !use[r]) continue;
        snprintf(key, sizeof(key), "ready/%d", r);
        st = ctx->kv->get(ctx->kv->core, key, deadline - xccl_now_ms(), &v, &vl);
        free(v);
        if (st == XCCL_ERR_TIMEOUT) {
            ib_missing(ctx, use, r, 0, miss, sizeof(miss));
            st = XCCL_ERROR(XCCL_ERR_TIMEOUT,
                            "ibverbs: rank %d: wire-up timed out after %.1f s: rank(s) %s did "
                            "not bring their queue pairs up",
                            ctx->rank, (double)timeout_ms / 1000.0, miss[0] ? miss : "?");
            goto out;
        }
        if (st < 0) goto out;
    }
    for (int r = 0; r < ctx->size; r++)
        if (r != ctx->rank && use[r]) ctx->peers[r].state = IB_P_UP;
    XCCL_INFO("ibverbs: rank %d: %d queue pair(s) up on %s port %u", ctx->rank, nused,
              ctx->dev_name, ctx->port);
out:
    free(psn);
    return st;
}

const xccl_transport_ops_t xccl_transport_ibverbs = {
    .abi_version = XCCL_TRANSPORT_ABI_VERSION,
    .name        = "ibverbs",
    .caps        = XCCL_TP_CAP_HOST_MEM | XCCL_TP_CAP_NEEDS_REG,
    .priority    = 15, /* below shm (20) inside a host, above tcp (10) between hosts */
    .init        = ib_init,
    .finalize    = ib_finalize,
    .reachable   = ib_reachable,
    .get_addr    = ib_get_addr,
    .wireup      = ib_wireup,
    .isend       = ib_isend,
    .progress    = ib_progress,
    .wait        = ib_wait,
    .wait_arm    = ib_wait_arm,
    .wake        = ib_wake,
    .close_peer  = ib_close_peer,
    .mem_reg     = ib_mem_reg,
    .mem_dereg   = ib_mem_dereg,
    /* a 100 Gb/s NIC: ~3 us per message (post, wire, completion), ~10 GB/s */
    .alpha = 3e-6,
    .beta  = 1.0 / 10e9,
};

#endif /* IB_BUILD */
