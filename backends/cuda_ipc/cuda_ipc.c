/* SPDX-License-Identifier: Apache-2.0
 *
 * cuda_ipc.c - device memory between the processes of one host with CUDA IPC. A wrapper: it
 * carries every message through an inner host transport (shm, or tcp where shm cannot start)
 * that it runs with its own state and upcalls, and adds a data path for device memory.
 *
 * Host memory passes through the inner transport unchanged, so the order of all messages to a
 * peer is the inner one's. A device send (xccl_tp_buf_t.mem == XCCL_MEM_CUDA):
 *   sender                                           receiver
 *   IPC handle of the allocation (cached by its
 *   buffer id), event recorded on xccl's stream
 *   event complete: DESC (original header, handle,   recv_match(original header):
 *   range, buffer id, offset, send id) ------------>   deferred: kept, asked again every pass
 *                                                      no buffer: dropped, ACK
 *                                                      else: the handle opened (cached by
 *                                                      (peer, buffer id)), copy queued on
 *                                                      xccl's stream, event recorded
 *                                                    event complete: recv_done, then
 *   send_done <--------------------------------------- ACK (NACK: the copy failed)
 * Control messages (DESC, ACK, NACK) have the reserved communicator id IPC_COMM, which the
 * receiving wrapper takes out before the core sees anything. ACKs are taken even while a
 * deferred descriptor holds its peer's other messages back (they are not ordered data).
 * The sender waits for its event before it sends the descriptor: the core posts a send only
 * once the caller's stream reached the operation (exec.h order_after), and the event, recorded
 * on xccl's stream, follows whatever xccl itself queued for the buffer; once it completed the
 * data is in memory and the receiver may copy it on its own stream.
 *
 * Sends leave in posting order: a device send whose event has not completed holds back every
 * later send to that peer (sq). Memory legacy IPC cannot export (cudaMallocAsync pools, VMM
 * allocations: IS_LEGACY_CUDA_IPC_CAPABLE == 0) is copied into a host bounce buffer and sent
 * as a host message; a host message whose receive is in device memory lands in a host bounce
 * buffer and is copied to the device before recv_done.
 *
 * Caches (ipc_cache.h): handles this process exported, by buffer id; mappings of peers'
 * allocations, by (peer, buffer id), stale ones (same range, another id: freed and
 * reallocated) closed, at most XCCL_CUDA_IPC_CACHE of them (least recently used closed first).
 *
 * Failure: a peer that fails (the inner transport says so) or that the core closes has every
 * pending send and receive of ours failed through the upcalls first; copies already queued are
 * waited for (they write the core's buffers) before their receives fail and the peer's
 * mappings close. finalize waits for every queued copy, then frees everything.
 *
 * Waiting: while an event, a copy or a deferred descriptor is pending, `wait` returns at once
 * and wait_arm answers "work to do" (a completing device event wakes no descriptor).
 *
 * Environment
 *   XCCL_CUDA_IPC_CACHE   peers' allocations kept mapped (default 128)
 *   XCCL_CUDA_IPC_INNER   the transport carrying its messages: shm (default; tcp when shm
 *                         cannot start) or tcp
 *   XCCL_CUDA_IPC_FAKE    TESTS ONLY: a fake device on host memory (ipc_dev_fake.c): "1";
 *                         "nolegacy" (no buffer exportable: the host-copy fallback);
 *                         "noimport" (no handle can be opened: the RESEND fallback);
 *                         "stuckcopy" (copies from peers complete only when waited for)
 */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../csrc/cuda/ipc_cache.h"
#include "ipc_dev.h"
#include "ipc_test.h"
#include "xccl/xccl_tp_support.h"
#include "xccl/xccl_transport.h"

#define IPC_COMM       0xc0da1bcc0da1bcffull /* communicator id of control messages       */
#define IPC_T_DESC     1
#define IPC_T_ACK      2
#define IPC_T_NACK     3
#define IPC_T_RESEND   4 /* the receiver cannot map the sender's memory: send the bytes      */
#define IPC_T_DATA     5 /* those bytes, for the descriptor of send id `fp`                  */
#define IPC_DESC_MAGIC 0x43534544u /* "DESC" */
#define IPC_ADDR_MAGIC 0x43495058u /* "XPIC" */
#define IPC_VERSION    1
#define IPC_ADDR_HDR   8
#define IPC_JOB_SALT   0x63756461495043ull /* the inner transport's job id: ours ^ this     */
#define IPC_EXP_CAP    256

/* Cookies of our own messages given to the inner transport have the low bit set (the core's
 * are pointers to its aligned structures); IPC_NOTHING marks ACKs, which need no completion. */
#define IPC_TAG(p)    ((void *)((uintptr_t)(p) | 1u))
#define IPC_IS_TAG(p) (((uintptr_t)(p) & 1u) != 0)
#define IPC_UNTAG(p)  ((void *)((uintptr_t)(p) & ~(uintptr_t)1u))
#define IPC_NOTHING   ((void *)(uintptr_t)1u)

enum { K_SEND = 0x53, K_RECV = 0x52 };

typedef struct ipc_desc {
    uint32_t       magic, version;
    xccl_msg_hdr_t hdr; /* the original message                                           */
    uint64_t       send_id;
    uint64_t       buf_id, base, size, offset; /* the allocation in the sender's space      */
    uint8_t        handle[IPC_HANDLE_BYTES];
} ipc_desc_t;

/* SEND_RESEND: a descriptor the receiver could not map; its bytes follow through host memory */
typedef enum { SEND_HOST, SEND_DEV, SEND_BOUNCE, SEND_RESEND } send_type_t;

typedef struct ipc_send {
    int              kind; /* K_SEND: first, like ipc_recv_t                               */
    send_type_t      type;
    struct ipc_send *next;
    int              peer;
    xccl_msg_hdr_t   hdr;
    xccl_tp_buf_t    buf;    /* SEND_HOST: the core's buffer                               */
    void            *cookie; /* the core's                                                 */
    void            *ev;     /* DEV: data ready; BOUNCE: copy into the bounce buffer done  */
    void            *bounce; /* bounce_get (pinned; ipc_dev.h says when not)              */
    size_t           bcap;
    const void      *src; /* SEND_DEV: the core's device buffer                           */
    ipc_desc_t       desc;
    int              out;      /* messages of it the inner transport holds (desc, bounce)  */
    int              data_out; /* SEND_RESEND: its DATA message was handed over            */
    int              finished; /* the core's send_done was called                          */
} ipc_send_t;

typedef enum { RECV_DESC, RECV_BOUNCE } recv_type_t;
/* R_AWAIT: matched, the sender asked to send the bytes (RESEND); R_DATA: they arrive */
typedef enum { R_PAYLOAD, R_HELD, R_COPY, R_AWAIT, R_DATA } recv_state_t;

typedef struct ipc_recv {
    int              kind; /* K_RECV */
    recv_type_t      type;
    recv_state_t     state;
    struct ipc_recv *next; /* the peer's list                                               */
    int              peer;
    ipc_desc_t       desc;   /* RECV_DESC: filled by the inner transport                   */
    void            *cookie; /* the core's, once matched                                   */
    void            *ev;
    ipc_entry_t     *imp;    /* the mapping the copy reads                                 */
    void            *bounce; /* bounce_get: RECV_BOUNCE, RESEND bytes, host dst            */
    size_t           bcap;
    int              host_out; /* copied on to dst (host memory) when the copy is done      */
    void            *dst;
    xccl_mem_type_t  dmem;
    size_t           n;
    int              resent; /* the bytes came through host memory: no ACK               */
} ipc_recv_t;

typedef struct ipc_peer {
    int         local, dead;
    int32_t     pid;
    ipc_send_t *sq_head, *sq_tail; /* not handed to the inner transport yet, posting order */
    ipc_send_t *out;               /* handed over, waiting for ACK or the inner's send_done */
    ipc_recv_t *recvs;             /* every receive item of ours                           */
    ipc_recv_t *held;              /* the descriptor the core deferred                     */
    int         copying;           /* receive items in R_COPY                              */
    int         resending;         /* SEND_RESEND sends whose copy to host runs            */
    int         no_import;         /* it cannot map our memory: device sends go as bytes   */
    /* dropped by us from inside an upcall of the inner transport: its close_peer runs at the
     * end of the progress pass (not re-entered from its own upcall) */
    int  close_pending;
    char close_why[256];
} ipc_peer_t;

struct xccl_tp_ctx {
    int                         rank, size;
    const xccl_tp_upcalls_t    *up;   /* the core's                                          */
    xccl_tp_upcalls_t           shim; /* ours, given to the inner transport                */
    const xccl_transport_ops_t *inner;
    xccl_tp_ctx_t              *ictx;
    int                         inner_id; /* 1 shm, 2 tcp                                  */
    const ipc_dev_ops_t        *dev;
    ipc_peer_t                 *peers;
    ipc_cache_t                 exp, imp;
    struct ipc_hbuf            *pool; /* idle pinned bounce buffers                        */
    size_t                      pool_bytes;
    uint64_t                    next_send_id;
    ipc_test_stats_t            stats;
    _Atomic int                 busy; /* device work or a deferred descriptor pending      */
};

static const char *const inner_names[] = {"", "shm", "tcp"};

/* ---------------------------------------------------------------------------------------------
 * Small helpers
 * ------------------------------------------------------------------------------------------- */

static void cache_close(void *arg, void *mapped)
{
    ((xccl_tp_ctx_t *)arg)->dev->close_handle(mapped);
}

static xccl_status_t inner_send(xccl_tp_ctx_t *ctx, int peer, const xccl_msg_hdr_t *hdr, void *ptr,
                                void *cookie)
{
    xccl_tp_buf_t b = {ptr, XCCL_MEM_HOST, NULL};
    return ctx->inner->isend(ctx->ictx, peer, hdr, &b, cookie);
}

/* Pinned bounce buffers: 64 KiB to a power of two, kept for reuse up to IPC_POOL_BYTES (a
 * pinned allocation costs far more than a copy). */
#define IPC_POOL_BYTES ((size_t)64 << 20)
#define IPC_BOUNCE_MIN ((size_t)64 << 10)

typedef struct ipc_hbuf {
    struct ipc_hbuf *next;
    void            *p;
    size_t           cap;
} ipc_hbuf_t;

static void *bounce_get(xccl_tp_ctx_t *ctx, size_t n, size_t *cap)
{
    size_t       c    = IPC_BOUNCE_MIN;
    ipc_hbuf_t **best = NULL;
    void        *p;

    for (ipc_hbuf_t **pp = &ctx->pool; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->cap >= n && (best == NULL || (*pp)->cap < (*best)->cap)) best = pp;
    }
    if (best != NULL) {
        ipc_hbuf_t *h = *best;
        *best         = h->next;
        ctx->pool_bytes -= h->cap;
        p    = h->p;
        *cap = h->cap;
        free(h);
        return p;
    }
    while (c < n && c < ((size_t)1 << 62))
        c <<= 1;
    if (c < n) c = n;
    p = ctx->dev->host_alloc(c);
    if (p != NULL) *cap = c;
    return p;
}

static void bounce_put(xccl_tp_ctx_t *ctx, void *p, size_t cap)
{
    ipc_hbuf_t *h;

    if (p == NULL) return;
    if (ctx->pool_bytes + cap > IPC_POOL_BYTES ||
        (ctx->dev->host_pinned != NULL && !ctx->dev->host_pinned(p)) ||
        (h = malloc(sizeof(*h))) == NULL) {
        ctx->dev->host_free(p);
        return;
    }
    h->p      = p;
    h->cap    = cap;
    h->next   = ctx->pool;
    ctx->pool = h;
    ctx->pool_bytes += cap;
}

/* ACK (ok) or NACK for the descriptor `send_id` from peer. A dead peer needs none. */
static void send_ack(xccl_tp_ctx_t *ctx, int peer, uint64_t send_id, int ok)
{
    xccl_msg_hdr_t h = {IPC_COMM, ok ? IPC_T_ACK : IPC_T_NACK, send_id, 0};

    if (ctx->peers[peer].dead) return;
    if (inner_send(ctx, peer, &h, NULL, IPC_NOTHING) < 0)
        XCCL_INFO("cuda_ipc: rank %d: no ACK to rank %d: %s", ctx->rank, peer, xccl_last_error());
}

static void send_free(xccl_tp_ctx_t *ctx, ipc_send_t *s)
{
    if (s->ev != NULL) ctx->dev->event_free(s->ev);
    bounce_put(ctx, s->bounce, s->bcap);
    free(s);
}

static void out_unlink(ipc_peer_t *p, ipc_send_t *s)
{
    for (ipc_send_t **pp = &p->out; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == s) {
            *pp = s->next;
            return;
        }
    }
}

/* The core's send_done, once; the request is freed when the inner transport let go too. */
static void send_finish(xccl_tp_ctx_t *ctx, ipc_send_t *s, xccl_status_t st)
{
    if (!s->finished) {
        s->finished = 1;
        ctx->up->send_done(ctx->up->core, s->cookie, st);
    }
    if (!s->out) {
        out_unlink(&ctx->peers[s->peer], s);
        send_free(ctx, s);
    }
}

static void recv_unlink(ipc_peer_t *p, ipc_recv_t *r)
{
    for (ipc_recv_t **pp = &p->recvs; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == r) {
            *pp = r->next;
            break;
        }
    }
    if (p->held == r) p->held = NULL;
}

static void recv_free(xccl_tp_ctx_t *ctx, ipc_recv_t *r)
{
    ipc_peer_t *p = &ctx->peers[r->peer];

    recv_unlink(p, r);
    if (r->state == R_COPY) p->copying--;
    if (r->ev != NULL) ctx->dev->event_free(r->ev);
    if (r->imp != NULL) ipc_cache_put(&ctx->imp, r->imp);
    bounce_put(ctx, r->bounce, r->bcap);
    free(r);
}

static ipc_recv_t *recv_new(xccl_tp_ctx_t *ctx, int peer, recv_type_t type)
{
    ipc_recv_t *r = calloc(1, sizeof(*r));

    if (r == NULL) return NULL;
    r->kind                = K_RECV;
    r->type                = type;
    r->state               = R_PAYLOAD;
    r->peer                = peer;
    r->next                = ctx->peers[peer].recvs;
    ctx->peers[peer].recvs = r;
    return r;
}

/* ---------------------------------------------------------------------------------------------
 * Failure
 * ------------------------------------------------------------------------------------------- */

/* Fails every pending send and receive of ours with `peer` (once); copies that write the core's
 * buffers are waited for first, then the peer's mappings close. Runs upcalls. */
static void fail_peer(xccl_tp_ctx_t *ctx, int peer, xccl_status_t st, const char *why)
{
    ipc_peer_t *p = &ctx->peers[peer];
    ipc_send_t *s;

    if (p->dead) return;
    p->dead = 1;
    XCCL_INFO("cuda_ipc: rank %d: %s", ctx->rank, why);
    while ((s = p->sq_head) != NULL) { /* never handed over */
        p->sq_head = s->next;
        if (p->sq_head == NULL) p->sq_tail = NULL;
        if (s->type == SEND_BOUNCE && s->ev != NULL) (void)ctx->dev->event_wait(s->ev);
        (void)xccl_error_set(st, "%s", why);
        ctx->up->send_done(ctx->up->core, s->cookie, st);
        send_free(ctx, s);
    }
    /* handed over: failed now; freed once the inner transport let go of them too */
    for (ipc_send_t **pp = &p->out; *pp != NULL;) {
        ipc_send_t *q = *pp;
        if (q->ev != NULL) (void)ctx->dev->event_wait(q->ev); /* a RESEND copy: into bounce */
        if (!q->finished) {
            q->finished = 1;
            (void)xccl_error_set(st, "%s", why);
            ctx->up->send_done(ctx->up->core, q->cookie, st);
        }
        if (!q->out) {
            *pp = q->next;
            send_free(ctx, q);
        } else {
            pp = &q->next;
        }
    }
    for (ipc_recv_t *r = p->recvs, *next; r != NULL; r = next) {
        next = r->next;
        if (r->state == R_PAYLOAD || r->state == R_DATA) continue; /* the inner fails those */
        if (r->state == R_COPY) (void)ctx->dev->event_wait(r->ev); /* it writes the core's */
        if (r->state == R_COPY || r->state == R_AWAIT) {
            (void)xccl_error_set(st, "%s", why);
            ctx->up->recv_done(ctx->up->core, r->cookie, st);
        }
        recv_free(ctx, r);
    }
    p->resending = 0;
    ipc_cache_drop(&ctx->imp, peer);
}

/* Drops the peer: ours fail (with `why`), then the inner transport's (it is told `cause`, to
 * which it adds who closed what; at the end of the progress pass when `later`: we may be
 * inside one of its upcalls), then the core hears of it. */
static void drop_peer(xccl_tp_ctx_t *ctx, int peer, xccl_status_t st, const char *why,
                      const char *cause, int later)
{
    ipc_peer_t *p        = &ctx->peers[peer];
    int         was_dead = p->dead;

    fail_peer(ctx, peer, st, why);
    if (was_dead) return;
    if (later && ctx->inner->close_peer != NULL) {
        p->close_pending = 1;
        snprintf(p->close_why, sizeof(p->close_why), "%s", cause);
    } else if (ctx->inner->close_peer != NULL) {
        ctx->inner->close_peer(ctx->ictx, peer, cause);
    } else {
        ctx->up->peer_failed(ctx->up->core, peer, st, why);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Receive path
 * ------------------------------------------------------------------------------------------- */

/* Asks the core where a descriptor's data goes and starts its copy. Returns 1 if it is held. */
static int desc_match(xccl_tp_ctx_t *ctx, ipc_recv_t *r, int *nev)
{
    ipc_peer_t   *p      = &ctx->peers[r->peer];
    ipc_desc_t   *d      = &r->desc;
    xccl_tp_buf_t dst    = {NULL, XCCL_MEM_HOST, NULL};
    void         *cookie = NULL, *mapped = NULL;
    xccl_status_t st;
    char          why[256];

    st = ctx->up->recv_match(ctx->up->core, r->peer, &d->hdr, &dst, &cookie);
    if (st == XCCL_INPROGRESS) {
        if (r->state != R_HELD) ctx->stats.deferred++;
        r->state = R_HELD;
        p->held  = r;
        return 1;
    }
    p->held = NULL;
    (*nev)++;
    if (st < 0) {
        int peer = r->peer;
        snprintf(why, sizeof(why),
                 "device message from rank %d (comm %" PRIx64 " tag %" PRIx64 ", %" PRIu64
                 " bytes) refused: %s",
                 peer, d->hdr.comm_id, d->hdr.tag, d->hdr.nbytes, xccl_status_string(st));
        recv_free(ctx, r);
        drop_peer(ctx, peer, st, why, why, 1);
        return 0;
    }
    r->cookie = cookie;
    if (d->hdr.nbytes == 0 || dst.ptr == NULL) { /* nothing to copy, or not wanted */
        uint64_t id   = d->send_id;
        int      peer = r->peer;
        recv_free(ctx, r);
        ctx->up->recv_done(ctx->up->core, cookie, XCCL_OK);
        send_ack(ctx, peer, id, 1);
        return 0;
    }
    r->imp = ipc_cache_get(&ctx->imp, r->peer, d->buf_id, d->base, d->size);
    if (r->imp == NULL) {
        st = ctx->dev->import_handle(p->pid, d->handle, &mapped);
        if (st != XCCL_OK) {
            /* not mappable here (no peer access, a driver refusal), or not now (XCCL_INPROGRESS:
             * a stream waits for a gate, and mapping could synchronise the device): the sender
             * sends this message's bytes through host memory instead */
            xccl_msg_hdr_t h = {IPC_COMM, IPC_T_RESEND, d->send_id, 0};
            if (st == XCCL_INPROGRESS)
                XCCL_TRACE("cuda_ipc: rank %d: a device message of rank %d comes through host "
                           "memory (no mapping while a stream waits for an operation)",
                           ctx->rank, r->peer);
            else
                XCCL_INFO("cuda_ipc: rank %d: cannot map the memory of rank %d (%s): its "
                          "device messages come through host memory",
                          ctx->rank, r->peer, xccl_last_error());
            r->state = R_AWAIT;
            r->dst   = dst.ptr;
            r->dmem  = dst.mem;
            r->n     = (size_t)d->hdr.nbytes;
            st       = inner_send(ctx, r->peer, &h, NULL, IPC_NOTHING);
            if (st < 0) {
                r->state = R_HELD; /* not R_AWAIT: the core hears of it below */
                goto fail;
            }
            ctx->stats.resend_recvs++;
            return 0;
        }
        r->imp = ipc_cache_add(&ctx->imp, r->peer, d->buf_id, d->base, d->size, mapped, NULL);
        if (r->imp == NULL) {
            ctx->dev->close_handle(mapped);
            st = xccl_error_set(XCCL_ERR_NO_MEMORY, "out of memory");
            goto fail;
        }
    }
    r->dst = dst.ptr;
    r->n   = (size_t)d->hdr.nbytes;
    if (dst.mem == XCCL_MEM_HOST) {
        /* into host memory (a staged unexpected message, a host receive): through a bounce
         * buffer (pinned: a copy into pageable memory would block), then copied on by the CPU */
        r->bounce = bounce_get(ctx, r->n, &r->bcap);
        if (r->bounce == NULL) {
            st = XCCL_ERR_NO_MEMORY;
            goto fail;
        }
        r->host_out = 1;
    }
    st = ctx->dev->copy(r->host_out ? r->bounce : r->dst, (char *)r->imp->mapped + d->offset, r->n,
                        p->pid);
    if (st < 0) goto fail;
    st = ctx->dev->event_record(&r->ev);
    if (st < 0) goto fail;
    r->state = R_COPY;
    p->copying++;
    ctx->stats.desc_recvs++;
    return 0;
fail:
    {
        uint64_t id = d->send_id, n = d->hdr.nbytes;
        int      peer = r->peer;
        char     err[200];
        snprintf(err, sizeof(err), "%s", xccl_last_error());
        if (r->ev != NULL) (void)ctx->dev->event_wait(r->ev); /* a copy may be queued */
        recv_free(ctx, r);
        (void)xccl_error_set(XCCL_ERR_CUDA,
                             "cuda_ipc: rank %d: reading the %" PRIu64 "-byte device message of "
                             "rank %d failed: %s",
                             ctx->rank, n, peer, err);
        ctx->up->recv_done(ctx->up->core, cookie, XCCL_ERR_CUDA);
        send_ack(ctx, peer, id, 0);
        return 0;
    }
}

/* A descriptor arrived whole: check it, then match it (or hold it). */
static void desc_arrived(xccl_tp_ctx_t *ctx, ipc_recv_t *r, int *nev)
{
    const ipc_desc_t *d = &r->desc;
    char              why[160];

    if (d->magic != IPC_DESC_MAGIC || d->version != IPC_VERSION || d->size == 0 ||
        d->offset > d->size || d->hdr.nbytes > d->size - d->offset || d->hdr.comm_id == IPC_COMM) {
        int peer = r->peer;
        snprintf(why, sizeof(why), "malformed device-message descriptor from rank %d", peer);
        recv_free(ctx, r);
        drop_peer(ctx, peer, XCCL_ERR_REMOTE, why, why, 1);
        return;
    }
    (void)desc_match(ctx, r, nev);
}

/* An ACK or NACK of one of our descriptors. */
static void ack_arrived(xccl_tp_ctx_t *ctx, int peer, uint64_t send_id, int ok)
{
    ipc_peer_t *p = &ctx->peers[peer];

    for (ipc_send_t *s = p->out; s != NULL; s = s->next) {
        if (s->type != SEND_DEV || s->finished || s->desc.send_id != send_id) continue;
        if (!ok)
            (void)xccl_error_set(XCCL_ERR_REMOTE,
                                 "rank %d could not read the %" PRIu64 "-byte device message "
                                 "sent to it (see its error)",
                                 peer, s->hdr.nbytes);
        send_finish(ctx, s, ok ? XCCL_OK : XCCL_ERR_REMOTE);
        return;
    }
    if (!p->dead)
        XCCL_WARN("cuda_ipc: rank %d: ACK of unknown send %" PRIu64 " from rank %d", ctx->rank,
                  send_id, peer);
}

/* The peer cannot map our memory: copy the descriptor's bytes to host memory, to be sent as
 * DATA once the copy is done (resend_progress); later device sends to it go as bytes. */
static void resend_asked(xccl_tp_ctx_t *ctx, int peer, uint64_t send_id)
{
    ipc_peer_t   *p = &ctx->peers[peer];
    ipc_send_t   *s = p->out;
    xccl_status_t st;

    while (s != NULL && !(s->type == SEND_DEV && !s->finished && s->desc.send_id == send_id))
        s = s->next;
    if (s == NULL) {
        XCCL_WARN("cuda_ipc: rank %d: RESEND of unknown send %" PRIu64 " from rank %d", ctx->rank,
                  send_id, peer);
        return;
    }
    p->no_import = 1;
    s->type      = SEND_RESEND;
    s->bounce    = bounce_get(ctx, (size_t)s->hdr.nbytes, &s->bcap);
    st           = s->bounce == NULL ? xccl_error_set(XCCL_ERR_NO_MEMORY,
                                                      "cuda_ipc: no host memory to "
                                                      "resend %" PRIu64 " bytes",
                                                      s->hdr.nbytes)
                                     : ctx->dev->copy(s->bounce, s->src, (size_t)s->hdr.nbytes, 0);
    if (st >= 0) st = ctx->dev->event_record(&s->ev);
    if (st < 0) {
        if (s->bounce != NULL && s->ev == NULL) s->bounce = NULL; /* a copy may write it */
        send_finish(ctx, s, st);
        return;
    }
    p->resending++;
    ctx->stats.resends++;
    atomic_store(&ctx->busy, 1);
}

/* Sends the bytes of the resent descriptors whose copy to host memory completed. */
static void resend_progress(xccl_tp_ctx_t *ctx, int peer, int *nev)
{
    ipc_peer_t *p = &ctx->peers[peer];

    for (ipc_send_t *s = p->out, *next; s != NULL && p->resending > 0; s = next) {
        xccl_status_t  st;
        xccl_msg_hdr_t h = {IPC_COMM, IPC_T_DATA, s->desc.send_id, s->hdr.nbytes};

        next = s->next;
        if (s->type != SEND_RESEND || s->ev == NULL || s->finished) continue;
        st = ctx->dev->event_test(s->ev);
        if (st == XCCL_INPROGRESS) continue;
        next = p->out; /* the send may complete (and go) inside inner_send: start over */
        ctx->dev->event_free(s->ev);
        s->ev = NULL;
        p->resending--;
        (*nev)++;
        if (st >= 0) {
            s->out++;
            s->data_out = 1;
            st          = inner_send(ctx, peer, &h, s->bounce, IPC_TAG(s));
            if (st < 0) {
                s->out--;
                s->data_out = 0;
            }
        }
        if (st < 0) send_finish(ctx, s, st);
    }
}

static xccl_status_t shim_recv_match(void *core, int peer, const xccl_msg_hdr_t *hdr,
                                     xccl_tp_buf_t *dst, void **cookie)
{
    xccl_tp_ctx_t *ctx = core;
    ipc_peer_t    *p   = &ctx->peers[peer];
    xccl_status_t  st;

    if (p->dead) { /* dropped by us; the inner transport closes it at the end of the pass */
        dst->ptr = NULL;
        dst->mem = XCCL_MEM_HOST;
        dst->mr  = NULL;
        *cookie  = IPC_NOTHING;
        return XCCL_OK;
    }
    if (hdr->comm_id == IPC_COMM) {
        dst->mem = XCCL_MEM_HOST;
        dst->mr  = NULL;
        if ((hdr->tag == IPC_T_ACK || hdr->tag == IPC_T_NACK) && hdr->nbytes == 0) {
            ack_arrived(ctx, peer, hdr->fp, hdr->tag == IPC_T_ACK);
            dst->ptr = NULL;
            *cookie  = IPC_NOTHING;
            return XCCL_OK;
        }
        if (hdr->tag == IPC_T_RESEND && hdr->nbytes == 0) {
            resend_asked(ctx, peer, hdr->fp);
            dst->ptr = NULL;
            *cookie  = IPC_NOTHING;
            return XCCL_OK;
        }
        if (hdr->tag == IPC_T_DATA) {
            ipc_recv_t *r = p->recvs;
            while (r != NULL && !(r->state == R_AWAIT && r->desc.send_id == hdr->fp))
                r = r->next;
            if (r == NULL || hdr->nbytes != r->n)
                return xccl_error_set(XCCL_ERR_REMOTE,
                                      "cuda_ipc: bytes of an unknown device message from rank "
                                      "%d",
                                      peer);
            if (r->dmem != XCCL_MEM_HOST) {
                r->bounce = bounce_get(ctx, r->n, &r->bcap);
                if (r->bounce == NULL)
                    return xccl_error_set(XCCL_ERR_NO_MEMORY,
                                          "cuda_ipc: no host memory to bounce %zu bytes", r->n);
            }
            r->state  = R_DATA;
            r->resent = 1;
            dst->ptr  = r->bounce != NULL ? r->bounce : r->dst;
            *cookie   = IPC_TAG(r);
            return XCCL_OK;
        }
        if (hdr->tag == IPC_T_DESC && hdr->nbytes == sizeof(ipc_desc_t)) {
            ipc_recv_t *r;
            if (p->held != NULL) return XCCL_INPROGRESS; /* behind the one deferred */
            r = recv_new(ctx, peer, RECV_DESC);
            if (r == NULL) return xccl_error_set(XCCL_ERR_NO_MEMORY, "cuda_ipc: descriptor");
            dst->ptr = &r->desc;
            *cookie  = IPC_TAG(r);
            return XCCL_OK;
        }
        return xccl_error_set(XCCL_ERR_REMOTE,
                              "cuda_ipc: unknown control message (tag %" PRIu64 ", %" PRIu64
                              " bytes) from rank %d",
                              hdr->tag, hdr->nbytes, peer);
    }
    if (p->held != NULL) return XCCL_INPROGRESS; /* behind the descriptor deferred */
    st = ctx->up->recv_match(ctx->up->core, peer, hdr, dst, cookie);
    if (st != XCCL_OK) return st;
    if (IPC_IS_TAG(*cookie))
        return xccl_error_set(XCCL_ERR_INTERNAL, "cuda_ipc: the core's cookie is unaligned");
    if (hdr->nbytes > 0 && dst->ptr != NULL && dst->mem != XCCL_MEM_HOST) {
        /* into device memory: through a host bounce buffer */
        ipc_recv_t *r = recv_new(ctx, peer, RECV_BOUNCE);
        if (r != NULL) r->bounce = bounce_get(ctx, (size_t)hdr->nbytes, &r->bcap);
        if (r == NULL || r->bounce == NULL) {
            if (r != NULL) recv_free(ctx, r);
            /* refused: the inner transport fails the peer, and the core hears it */
            ctx->up->recv_done(ctx->up->core, *cookie,
                               xccl_error_set(XCCL_ERR_NO_MEMORY,
                                              "cuda_ipc: no host memory to bounce %" PRIu64
                                              " bytes from rank %d to the device",
                                              hdr->nbytes, peer));
            return XCCL_ERR_NO_MEMORY;
        }
        r->cookie = *cookie;
        r->dst    = dst->ptr;
        r->n      = (size_t)hdr->nbytes;
        dst->ptr  = r->bounce;
        dst->mem  = XCCL_MEM_HOST;
        *cookie   = IPC_TAG(r);
    }
    return XCCL_OK;
}

static void shim_recv_done(void *core, void *cookie, xccl_status_t st)
{
    xccl_tp_ctx_t *ctx = core;
    ipc_recv_t    *r;
    int            nev = 0;

    if (!IPC_IS_TAG(cookie)) {
        ctx->up->recv_done(ctx->up->core, cookie, st);
        return;
    }
    if (cookie == IPC_NOTHING) return;
    r = IPC_UNTAG(cookie);
    if (st >= 0 && ctx->peers[r->peer].dead) /* dropped meanwhile: its data is not used */
        st = xccl_error_set(XCCL_ERR_REMOTE, "cuda_ipc: rank %d: rank %d was dropped", ctx->rank,
                            r->peer);
    if (r->type == RECV_DESC && r->state == R_DATA && (st < 0 || r->bounce == NULL)) {
        void *c = r->cookie; /* the bytes of a RESEND landed in host memory (or failed) */
        recv_free(ctx, r);
        ctx->up->recv_done(ctx->up->core, c, st);
        return;
    }
    if (r->type == RECV_DESC && r->state != R_DATA) {
        if (st < 0)
            recv_free(ctx, r);
        else
            desc_arrived(ctx, r, &nev);
        return;
    }
    /* RECV_BOUNCE, or RESEND bytes: in the bounce buffer; to the device */
    if (st >= 0) st = ctx->dev->copy(r->dst, r->bounce, r->n, 0);
    if (st >= 0) st = ctx->dev->event_record(&r->ev);
    if (st < 0) {
        void *c = r->cookie;
        recv_free(ctx, r);
        ctx->up->recv_done(ctx->up->core, c, st);
        return;
    }
    r->state = R_COPY;
    ctx->peers[r->peer].copying++;
    ctx->stats.bounce_recvs++;
    atomic_store(&ctx->busy, 1);
}

static void shim_send_done(void *core, void *cookie, xccl_status_t st)
{
    xccl_tp_ctx_t *ctx = core;
    ipc_send_t    *s;

    if (!IPC_IS_TAG(cookie)) {
        ctx->up->send_done(ctx->up->core, cookie, st);
        return;
    }
    if (cookie == IPC_NOTHING) return;
    s = IPC_UNTAG(cookie);
    s->out--;
    /* a bounce send is done once it left, a resent one once its bytes left; a descriptor
     * waits for its ACK unless it failed */
    if (s->type == SEND_BOUNCE || st < 0 || s->finished ||
        (s->type == SEND_RESEND && s->data_out && s->out == 0))
        send_finish(ctx, s, st);
}

static void shim_peer_failed(void *core, int peer, xccl_status_t st, const char *why)
{
    xccl_tp_ctx_t *ctx = core;

    ctx->peers[peer].close_pending = 0; /* closed already */
    fail_peer(ctx, peer, st, why);
    ctx->up->peer_failed(ctx->up->core, peer, st, why);
}

/* ---------------------------------------------------------------------------------------------
 * Send path
 * ------------------------------------------------------------------------------------------- */

/* Hands the ready sends at the head of the peer's queue to the inner transport. */
static void push_sends(xccl_tp_ctx_t *ctx, int peer, int *nev)
{
    ipc_peer_t *p = &ctx->peers[peer];
    ipc_send_t *s;

    while ((s = p->sq_head) != NULL && !p->dead) {
        xccl_status_t st = XCCL_OK;

        if (s->ev != NULL) {
            st = ctx->dev->event_test(s->ev);
            if (st == XCCL_INPROGRESS) return;
            ctx->dev->event_free(s->ev);
            s->ev = NULL;
        }
        p->sq_head = s->next;
        if (p->sq_head == NULL) p->sq_tail = NULL;
        s->next = NULL;
        (*nev)++;
        if (st < 0) {
            send_finish(ctx, s, st);
            continue;
        }
        if (s->type == SEND_HOST) {
            st = ctx->inner->isend(ctx->ictx, peer, &s->hdr, &s->buf, s->cookie);
            if (st < 0) ctx->up->send_done(ctx->up->core, s->cookie, st);
            send_free(ctx, s);
            continue;
        }
        s->out  = 1;
        s->next = p->out;
        p->out  = s;
        if (s->type == SEND_DEV) {
            xccl_msg_hdr_t h = {IPC_COMM, IPC_T_DESC, 0, sizeof(ipc_desc_t)};
            st               = inner_send(ctx, peer, &h, &s->desc, IPC_TAG(s));
        } else {
            st = inner_send(ctx, peer, &s->hdr, s->bounce, IPC_TAG(s));
        }
        if (st < 0) {
            s->out = 0;
            send_finish(ctx, s, st);
        }
    }
}

static void sq_append(ipc_peer_t *p, ipc_send_t *s)
{
    s->next = NULL;
    if (p->sq_tail != NULL)
        p->sq_tail->next = s;
    else
        p->sq_head = s;
    p->sq_tail = s;
}

static xccl_status_t ipc_isend(xccl_tp_ctx_t *ctx, int peer, const xccl_msg_hdr_t *hdr,
                               const xccl_tp_buf_t *buf, void *cookie)
{
    ipc_peer_t   *p;
    ipc_send_t   *s;
    xccl_status_t st;
    uint64_t      base = 0, size = 0, buf_id = 0;
    int           ipc_ok = 0, nev = 0, queued = 0;
    const void   *ptr;

    if (peer < 0 || peer >= ctx->size || peer == ctx->rank || !ctx->peers[peer].local)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "cuda_ipc: rank %d: send to invalid peer %d",
                          ctx->rank, peer);
    if (IPC_IS_TAG(cookie))
        return XCCL_ERROR(XCCL_ERR_INTERNAL, "cuda_ipc: the core's cookie is unaligned");
    p = &ctx->peers[peer];
    if (p->dead)
        return XCCL_ERROR(XCCL_ERR_REMOTE, "cuda_ipc: rank %d: cannot send to rank %d: it failed",
                          ctx->rank, peer);
    if (hdr->nbytes == 0 || buf == NULL || buf->mem == XCCL_MEM_HOST) {
        if (p->sq_head == NULL) return ctx->inner->isend(ctx->ictx, peer, hdr, buf, cookie);
        s = calloc(1, sizeof(*s));
        if (s == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "cuda_ipc: send request");
        s->kind   = K_SEND;
        s->type   = SEND_HOST;
        s->peer   = peer;
        s->hdr    = *hdr;
        s->buf    = buf != NULL ? *buf : (xccl_tp_buf_t){NULL, XCCL_MEM_HOST, NULL};
        s->cookie = cookie;
        sq_append(p, s);
        return XCCL_OK;
    }
    if (buf->mem != XCCL_MEM_CUDA || buf->ptr == NULL)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                          "cuda_ipc: rank %d: send of %" PRIu64 " bytes of memory type %d",
                          ctx->rank, hdr->nbytes, (int)buf->mem);
    ptr = buf->ptr;
    st  = ctx->dev->ptr_info(ptr, (size_t)hdr->nbytes, &base, &size, &buf_id, &ipc_ok);
    if (st < 0) return st;
    if ((uint64_t)(uintptr_t)ptr < base || (uint64_t)(uintptr_t)ptr - base > size ||
        hdr->nbytes > size - ((uint64_t)(uintptr_t)ptr - base))
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                          "cuda_ipc: rank %d: the %" PRIu64 "-byte device buffer %p runs past "
                          "its allocation (%" PRIu64 " bytes at 0x%" PRIx64 ")",
                          ctx->rank, hdr->nbytes, ptr, size, base);
    s = calloc(1, sizeof(*s));
    if (s == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "cuda_ipc: send request");
    s->kind   = K_SEND;
    s->peer   = peer;
    s->hdr    = *hdr;
    s->cookie = cookie;
    s->src    = ptr;
    if (ipc_ok && !p->no_import) {
        ipc_entry_t *e = ipc_cache_get(&ctx->exp, -1, buf_id, base, size);
        if (e == NULL) {
            uint8_t h[IPC_HANDLE_BYTES];
            if (ctx->dev->export_handle(base, size, buf_id, h) < 0) {
                /* the driver would not export it: through host memory (never fail) */
                XCCL_INFO("cuda_ipc: rank %d: %s; sent through host memory", ctx->rank,
                          xccl_last_error());
                ipc_ok = 0;
            } else if ((e = ipc_cache_add(&ctx->exp, -1, buf_id, base, size, NULL, h)) == NULL) {
                send_free(ctx, s);
                return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "cuda_ipc: handle cache");
            }
        }
        if (e != NULL) {
            memcpy(s->desc.handle, e->handle, IPC_HANDLE_BYTES);
            ipc_cache_put(&ctx->exp, e);
        }
    }
    if (!ipc_ok || p->no_import) {
        /* not exportable, or the peer cannot map it: through host memory, as a host message */
        s->type   = SEND_BOUNCE;
        s->bounce = bounce_get(ctx, (size_t)hdr->nbytes, &s->bcap);
        if (s->bounce == NULL) {
            free(s);
            return XCCL_ERROR(XCCL_ERR_NO_MEMORY,
                              "cuda_ipc: no host memory to bounce %" PRIu64 " device bytes",
                              hdr->nbytes);
        }
        st     = ctx->dev->copy(s->bounce, ptr, (size_t)hdr->nbytes, 0);
        queued = st >= 0;
    } else {
        s->type         = SEND_DEV;
        s->desc.magic   = IPC_DESC_MAGIC;
        s->desc.version = IPC_VERSION;
        s->desc.hdr     = *hdr;
        s->desc.send_id = ++ctx->next_send_id;
        s->desc.buf_id  = buf_id;
        s->desc.base    = base;
        s->desc.size    = size;
        s->desc.offset  = (uint64_t)(uintptr_t)ptr - base;
        st              = XCCL_OK;
    }
    if (st >= 0) st = ctx->dev->event_record(&s->ev);
    if (st < 0) {
        if (queued) {
            /* a copy into the bounce buffer is queued and no event tells when it is done:
             * keep the buffer (leaked) rather than free memory the device may still write */
            s->bounce = NULL;
        }
        send_free(ctx, s);
        return st;
    }
    sq_append(p, s);
    if (s->type == SEND_DEV)
        ctx->stats.dev_sends++;
    else
        ctx->stats.bounce_sends++;
    atomic_store(&ctx->busy, 1);
    push_sends(ctx, peer, &nev); /* the event may be complete already */
    return XCCL_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Progress and waiting
 * ------------------------------------------------------------------------------------------- */

static void copies_progress(xccl_tp_ctx_t *ctx, int peer, int *nev)
{
    ipc_peer_t *p = &ctx->peers[peer];

    for (ipc_recv_t *r = p->recvs, *next; r != NULL && p->copying > 0 && !p->dead; r = next) {
        xccl_status_t st;
        void         *cookie;
        uint64_t      id;
        int           is_desc;

        next = r->next;
        if (r->state != R_COPY) continue;
        st = ctx->dev->event_test(r->ev);
        if (st == XCCL_INPROGRESS) continue;
        (*nev)++;
        cookie  = r->cookie;
        id      = r->desc.send_id;
        is_desc = r->type == RECV_DESC && !r->resent;
        if (st == XCCL_OK && r->host_out) memcpy(r->dst, r->bounce, r->n);
        recv_free(ctx, r);
        if (st < 0)
            st = xccl_error_set(st,
                                "cuda_ipc: rank %d: the copy of a %s message from rank %d "
                                "failed: %s",
                                ctx->rank, is_desc ? "device" : "host", peer, xccl_last_error());
        ctx->up->recv_done(ctx->up->core, cookie, st);
        if (is_desc) send_ack(ctx, peer, id, st == XCCL_OK);
        next = p->recvs; /* upcalls may have changed the list: start over */
    }
}

static xccl_status_t ipc_progress(xccl_tp_ctx_t *ctx, int *nevents)
{
    int nev = 0, busy = 0, k = 0;

    /* deferred descriptors first: before anything behind them from the same peer */
    for (int i = 0; i < ctx->size; i++) {
        ipc_peer_t *p = &ctx->peers[i];
        if (p->held != NULL && !p->dead) (void)desc_match(ctx, p->held, &nev);
    }
    (void)ctx->inner->progress(ctx->ictx, &k);
    nev += k;
    for (int i = 0; i < ctx->size; i++) {
        ipc_peer_t *p = &ctx->peers[i];
        if (p->close_pending) { /* dropped inside an upcall of the inner transport */
            p->close_pending = 0;
            ctx->inner->close_peer(ctx->ictx, i, p->close_why);
            nev++;
        }
        if (!p->local || p->dead) continue;
        if (p->sq_head != NULL) push_sends(ctx, i, &nev);
        if (p->copying > 0) copies_progress(ctx, i, &nev);
        if (p->resending > 0) resend_progress(ctx, i, &nev);
        busy |= (p->sq_head != NULL && p->sq_head->ev != NULL) || p->copying > 0 ||
                p->held != NULL || p->resending > 0;
    }
    atomic_store(&ctx->busy, busy);
    if (nevents != NULL) *nevents = nev;
    return XCCL_OK;
}

static void ipc_wait(xccl_tp_ctx_t *ctx, int timeout_ms)
{
    if (atomic_load(&ctx->busy)) return; /* device events complete without a wake-up */
    if (ctx->inner->wait != NULL)
        ctx->inner->wait(ctx->ictx, timeout_ms);
    else if (timeout_ms > 0)
        usleep(1000);
}

static int ipc_wait_arm(xccl_tp_ctx_t *ctx, int *fd)
{
    if (atomic_load(&ctx->busy)) return 0;
    if (ctx->inner->wait_arm != NULL) return ctx->inner->wait_arm(ctx->ictx, fd);
    *fd = -1;
    return 1;
}

static void ipc_wait_disarm(xccl_tp_ctx_t *ctx)
{
    if (ctx->inner->wait_disarm != NULL) ctx->inner->wait_disarm(ctx->ictx);
}

static void ipc_wake(xccl_tp_ctx_t *ctx)
{
    if (ctx->inner->wake != NULL) ctx->inner->wake(ctx->ictx);
}

static void ipc_close_peer(xccl_tp_ctx_t *ctx, int peer, const char *why)
{
    char msg[320];

    if (peer < 0 || peer >= ctx->size || !ctx->peers[peer].local || ctx->peers[peer].dead) {
        if (peer >= 0 && peer < ctx->size && ctx->inner->close_peer != NULL)
            ctx->inner->close_peer(ctx->ictx, peer, why);
        return;
    }
    snprintf(msg, sizeof(msg), "connection to rank %d closed by rank %d: %s", peer, ctx->rank,
             why ? why : "closed");
    drop_peer(ctx, peer, XCCL_ERR_REMOTE, msg, why ? why : "closed", 0);
}

/* ---------------------------------------------------------------------------------------------
 * Context
 * ------------------------------------------------------------------------------------------- */

static void ipc_finalize(xccl_tp_ctx_t *ctx)
{
    if (ctx == NULL) return;
    /* no copy may write a buffer of the core's (or read one of ours) once we return */
    for (int i = 0; ctx->peers != NULL && i < ctx->size; i++) {
        ipc_peer_t *p = &ctx->peers[i];
        for (ipc_send_t *s = p->sq_head; s != NULL; s = s->next)
            if (s->ev != NULL) (void)ctx->dev->event_wait(s->ev);
        for (ipc_send_t *s = p->out; s != NULL; s = s->next)
            if (s->ev != NULL) (void)ctx->dev->event_wait(s->ev);
        for (ipc_recv_t *r = p->recvs; r != NULL; r = r->next)
            if (r->state == R_COPY && r->ev != NULL) (void)ctx->dev->event_wait(r->ev);
    }
    if (ctx->ictx != NULL) ctx->inner->finalize(ctx->ictx); /* it may hold our buffers */
    for (int i = 0; ctx->peers != NULL && i < ctx->size; i++) {
        ipc_peer_t *p        = &ctx->peers[i];
        ipc_send_t *lists[2] = {p->sq_head, p->out};
        for (int k = 0; k < 2; k++) {
            while (lists[k] != NULL) {
                ipc_send_t *next = lists[k]->next;
                send_free(ctx, lists[k]);
                lists[k] = next;
            }
        }
        p->sq_head = p->sq_tail = p->out = NULL;
        while (p->recvs != NULL) {
            ipc_recv_t *r = p->recvs;
            r->state      = R_PAYLOAD; /* waited above: no count to keep */
            recv_free(ctx, r);
        }
    }
    ipc_cache_drop(&ctx->imp, -2);
    ipc_cache_drop(&ctx->exp, -2);
    while (ctx->pool != NULL) {
        ipc_hbuf_t *h = ctx->pool;
        ctx->pool     = h->next;
        ctx->dev->host_free(h->p);
        free(h);
    }
    free(ctx->peers);
    free(ctx);
}

static int same_host(const xccl_peer_info_t *a, const xccl_peer_info_t *b)
{
    return a->host_id == b->host_id && a->ipc_ns == b->ipc_ns;
}

/* The device layer: the fake for tests, else the driver (when built with CUDA). */
static xccl_status_t pick_dev(const ipc_dev_ops_t **dev)
{
    const char *fake = getenv("XCCL_CUDA_IPC_FAKE");

    if (fake != NULL && *fake != '\0' && strcmp(fake, "0") != 0) {
        *dev = &ipc_dev_fake;
        return XCCL_OK;
    }
#ifdef XCCL_HAVE_CUDA
    {
        xccl_status_t st = ipc_dev_cuda_usable();
        if (st < 0) return st;
        *dev = &ipc_dev_cuda;
        return XCCL_OK;
    }
#else
    return xccl_error_set(XCCL_ERR_NOT_SUPPORTED, "xccl was built without CUDA");
#endif
}

static xccl_status_t ipc_init(const xccl_tp_init_params_t *params, xccl_tp_ctx_t **out)
{
    xccl_tp_ctx_t        *ctx;
    xccl_tp_init_params_t ip;
    const ipc_dev_ops_t  *dev = NULL;
    xccl_status_t         st;
    int                   nlocal       = 0;
    char                  why_shm[200] = "";
    const char           *inner_env;

    if (params == NULL || out == NULL || params->size < 1 || params->rank < 0 ||
        params->rank >= params->size || params->peers == NULL || params->up == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "cuda_ipc: init: bad parameters");
    st = pick_dev(&dev);
    if (st < 0) return XCCL_ERR_NOT_SUPPORTED; /* the reason is the thread's last error */
    for (int i = 0; i < params->size; i++)
        nlocal += i != params->rank && same_host(&params->peers[i], &params->peers[params->rank]);
    if (nlocal == 0) return xccl_error_set(XCCL_ERR_NOT_SUPPORTED, "no other rank on this host");
    ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "cuda_ipc: init");
    ctx->rank  = params->rank;
    ctx->size  = params->size;
    ctx->up    = params->up;
    ctx->dev   = dev;
    ctx->peers = calloc((size_t)ctx->size, sizeof(*ctx->peers));
    if (ctx->peers == NULL) {
        free(ctx);
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "cuda_ipc: init: %d peers", params->size);
    }
    for (int i = 0; i < ctx->size; i++) {
        ctx->peers[i].local =
            i != ctx->rank && same_host(&params->peers[i], &params->peers[ctx->rank]);
        ctx->peers[i].pid = params->peers[i].pid;
    }
    ipc_cache_init(&ctx->exp, IPC_EXP_CAP, NULL, NULL);
    ipc_cache_init(&ctx->imp, (int)xccl_env_int("XCCL_CUDA_IPC_CACHE", 128), cache_close, ctx);
    ctx->shim = (xccl_tp_upcalls_t){
        .core        = ctx,
        .recv_match  = shim_recv_match,
        .recv_done   = shim_recv_done,
        .send_done   = shim_send_done,
        .peer_failed = shim_peer_failed,
    };
    ip        = *params;
    ip.up     = &ctx->shim;
    ip.job_id = params->job_id ^ IPC_JOB_SALT; /* its own names, beside the core's shm/tcp */
    inner_env = getenv("XCCL_CUDA_IPC_INNER");
    if (inner_env != NULL && *inner_env != '\0' && strcmp(inner_env, "shm") != 0 &&
        strcmp(inner_env, "tcp") != 0) {
        ipc_finalize(ctx);
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "XCCL_CUDA_IPC_INNER='%s': expected shm or tcp",
                          inner_env);
    }
    for (int id = 1; id <= 2; id++) {
        const xccl_transport_ops_t *t = xccl_transport_find(inner_names[id]);
        if (inner_env != NULL && *inner_env != '\0' && strcmp(inner_env, inner_names[id]) != 0)
            continue;
        if (t == NULL || t->abi_version != XCCL_TRANSPORT_ABI_VERSION) continue;
        (void)xccl_error_set(XCCL_OK, "%s", "");
        st = t->init(&ip, &ctx->ictx);
        if (st == XCCL_OK) {
            ctx->inner    = t;
            ctx->inner_id = id;
            break;
        }
        ctx->ictx = NULL;
        if (st != XCCL_ERR_NOT_SUPPORTED) {
            ipc_finalize(ctx);
            return st;
        }
        if (id == 1) snprintf(why_shm, sizeof(why_shm), "%s", xccl_last_error());
    }
    if (ctx->inner == NULL) {
        char why_tcp[200];
        snprintf(why_tcp, sizeof(why_tcp), "%s", xccl_last_error());
        ipc_finalize(ctx);
        return xccl_error_set(
            XCCL_ERR_NOT_SUPPORTED, "no host transport to carry its messages (shm: %s; tcp: %s)",
            why_shm[0] ? why_shm : "not usable", why_tcp[0] ? why_tcp : "not usable");
    }
    XCCL_INFO("cuda_ipc: rank %d: %s device layer, messages through %s, %d local peer(s)",
              ctx->rank, dev->name, inner_names[ctx->inner_id], nlocal);
    *out = ctx;
    return XCCL_OK;
}

static int ipc_reachable(const xccl_tp_ctx_t *ctx, int peer)
{
    return peer >= 0 && peer < ctx->size && ctx->peers[peer].local &&
           ctx->inner->reachable(ctx->ictx, peer);
}

/* The blob: magic, version, the inner transport's id, then its own blob. */
static xccl_status_t ipc_get_addr(xccl_tp_ctx_t *ctx, void *addr, size_t *len)
{
    uint8_t       inner[XCCL_TP_ADDR_MAX];
    size_t        ilen  = sizeof(inner);
    uint32_t      magic = IPC_ADDR_MAGIC;
    uint8_t      *a     = addr;
    xccl_status_t st    = ctx->inner->get_addr(ctx->ictx, inner, &ilen);

    if (st < 0) return st;
    if (ilen > XCCL_TP_ADDR_MAX - IPC_ADDR_HDR)
        return XCCL_ERROR(XCCL_ERR_INTERNAL, "cuda_ipc: the %s address (%zu bytes) leaves no room",
                          inner_names[ctx->inner_id], ilen);
    memset(a, 0, IPC_ADDR_HDR);
    memcpy(a, &magic, 4);
    a[4] = IPC_VERSION;
    a[5] = (uint8_t)ctx->inner_id;
    memcpy(a + IPC_ADDR_HDR, inner, ilen);
    *len = IPC_ADDR_HDR + ilen;
    return XCCL_OK;
}

static xccl_status_t ipc_wireup(xccl_tp_ctx_t *ctx, const void *const *addrs, const size_t *lens,
                                const uint8_t *use, int64_t timeout_ms)
{
    const void  **ia = calloc((size_t)ctx->size, sizeof(*ia));
    size_t       *il = calloc((size_t)ctx->size, sizeof(*il));
    xccl_status_t st = XCCL_OK;

    if (ia == NULL || il == NULL) {
        st = XCCL_ERROR(XCCL_ERR_NO_MEMORY, "cuda_ipc: wire-up");
        goto out;
    }
    for (int i = 0; i < ctx->size; i++) {
        const uint8_t *a = addrs[i];
        uint32_t       magic;
        if (!use[i] || i == ctx->rank) continue;
        if (a == NULL || lens[i] < IPC_ADDR_HDR ||
            (memcpy(&magic, a, 4), magic) != IPC_ADDR_MAGIC || a[4] != IPC_VERSION || a[5] < 1 ||
            a[5] > 2) {
            st = XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                            "cuda_ipc: rank %d: the address of rank %d is malformed (%zu bytes)",
                            ctx->rank, i, lens[i]);
            goto out;
        }
        if (a[5] != ctx->inner_id) {
            st = XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                            "cuda_ipc: rank %d carries its messages through %s, rank %d through "
                            "%s (its shm could not start on one of them): leave cuda_ipc out "
                            "with XCCL_TRANSPORTS",
                            ctx->rank, inner_names[ctx->inner_id], i, inner_names[a[5]]);
            goto out;
        }
        ia[i] = a + IPC_ADDR_HDR;
        il[i] = lens[i] - IPC_ADDR_HDR;
    }
    st = ctx->inner->wireup(ctx->ictx, ia, il, use, timeout_ms);
out:
    free(ia);
    free(il);
    return st;
}

void xccl_cuda_ipc_test_stats(const xccl_tp_ctx_t *ctx, ipc_test_stats_t *out)
{
    *out             = ctx->stats;
    out->imp_hits    = ctx->imp.hits;
    out->imp_misses  = ctx->imp.misses;
    out->imp_stale   = ctx->imp.stale_dropped;
    out->imp_evicted = ctx->imp.evicted;
    out->imp_closed  = ctx->imp.closed;
    out->imp_live    = (uint64_t)ctx->imp.n;
    out->exp_hits    = ctx->exp.hits;
    out->exp_misses  = ctx->exp.misses;
}

const char *xccl_cuda_ipc_test_inner(const xccl_tp_ctx_t *ctx)
{
    return inner_names[ctx->inner_id];
}

const xccl_transport_ops_t xccl_transport_cuda_ipc = {
    .abi_version = XCCL_TRANSPORT_ABI_VERSION,
    .name        = "cuda_ipc",
    .caps        = XCCL_TP_CAP_HOST_MEM | XCCL_TP_CAP_CUDA_MEM | XCCL_TP_CAP_INTRA_HOST |
                   XCCL_TP_CAP_RECV_PULL | XCCL_TP_CAP_DEFER,
    .priority    = 30, /* above shm: it carries host messages through its own shm */
    /* the host path is shm's; a device message adds an event, a descriptor and an ACK */
    .alpha       = 3e-6,
    .beta        = 1.0 / 6e9,
    .init        = ipc_init,
    .finalize    = ipc_finalize,
    .reachable   = ipc_reachable,
    .get_addr    = ipc_get_addr,
    .wireup      = ipc_wireup,
    .isend       = ipc_isend,
    .progress    = ipc_progress,
    .wait        = ipc_wait,
    .wake        = ipc_wake,
    .close_peer  = ipc_close_peer,
    .wait_arm    = ipc_wait_arm,
    .wait_disarm = ipc_wait_disarm,
};
