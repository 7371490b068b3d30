/* SPDX-License-Identifier: Apache-2.0
 *
 * tcp.c - the TCP transport: one connection per pair of ranks, non-blocking sockets in one
 * epoll set per context, messages (xccl_msg_hdr_t + payload) streamed in posting order.
 * Handshake and address formats are in tcp_wire.h.
 *
 * Data path per connection
 *   send: isend queues {hdr, buf, cookie}; when the queue was empty it writes at once. Each
 *         write is one sendmsg over header+payload of as many queued messages as fit in an
 *         iovec (MSG_NOSIGNAL, MSG_DONTWAIT); a partial write resumes where it stopped, with
 *         EPOLLOUT armed only while something is queued. send_done fires when the last byte
 *         of a message is in the kernel.
 *   recv: state machine
 *           HDR      read into a small staging buffer until a whole header is there
 *                    -> recv_match(hdr) gives the destination (nbytes == 0: recv_done now)
 *           PAYLOAD  bytes already staged are copied to the destination; the rest is read
 *                    straight into it (the read that finishes a message also fills the
 *                    staging buffer with what follows) -> recv_done -> HDR. With no
 *                    destination (the core drops the payload) the bytes are read through the
 *                    staging buffer and discarded there.
 *           DEFER    recv_match said "not yet" (a large message nobody has posted a receive
 *                    for): nothing more is read from that peer - TCP's flow control holds
 *                    the sender back - and every progress pass asks again, until the core
 *                    gives the receive's buffer (no staging copy) or, after its time limit,
 *                    a staging buffer
 *         A read that comes back short ends the connection's turn (the socket is empty; the
 *         read that would say so costs a call per message). Level-triggered epoll plus a
 *         per-pass read budget keep one busy peer from starving the others; nothing is ever
 *         left staged without the socket being readable, so `wait` never sleeps on work
 *         already in memory.
 *   Both directions are served in every pass, so two ranks sending each other large
 *   messages at once cannot deadlock on full socket buffers.
 *
 * Failure: EOF or an error on a connection fails every queued send (send_done with
 * XCCL_ERR_REMOTE), an in-flight receive (recv_done), then peer_failed; the peer is dead
 * from then on and isend to it fails at once. Errors met inside isend are only recorded (and
 * the context woken): failing a peer runs upcalls, which belong in `progress`.
 *
 * Threading: see xccl_transport.h. `wait` only polls the epoll descriptor, which becomes
 * readable when any socket in the set (or the wake-up eventfd) has something to report;
 * it consumes nothing, so the next `progress` sees every event.
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "tcp_wire.h"
#include "xccl/xccl_tp_support.h"
#include "xccl/xccl_transport.h"

#define TCP_RBUF_LEN       8192              /* staging buffer per connection               */
#define TCP_IO_CHUNK       ((size_t)1 << 30) /* most bytes one read/write call moves          */
#define TCP_IOV_MAX        64                /* iovec entries per sendmsg                     */
#define TCP_RECV_BUDGET    16                /* reads per connection per progress pass        */
#define TCP_MAX_EVENTS     64
#define TCP_HANDSHAKE_MS   5000    /* one connection's handshake, once it has been accepted */
#define TCP_MAX_PENDING    64      /* accepted, not yet identified connections during wire-up */
#define TCP_BACKOFF_MAX_MS 100
/* $XCCL_TCP_SOCKBUF: 0 (the default) leaves the socket buffers to the kernel's autotuning.
 * A fixed size turns autotuning off and is silently capped by net.core.[rw]mem_max (208 KiB
 * on a stock kernel), below what autotuning reaches (net.ipv4.tcp_[rw]mem); on loopback
 * (2 vCPUs) 4 MiB and autotuning measured the same within noise. */
#define TCP_SOCKBUF_DEF    0
#define TCP_NAME_LEN       (INET6_ADDRSTRLEN + 16)

/* epoll_event.data.u64: kind in the high half, index (peer or pending slot) in the low. */
enum { EV_WAKE = 1, EV_LISTEN = 2, EV_PENDING = 3, EV_PEER = 4 };
#define EV_DATA(kind, idx) (((uint64_t)(kind) << 32) | (uint32_t)(idx))

typedef enum tcp_peer_state {
    TCP_P_IDLE = 0,   /* not connected (or not used)                                       */
    TCP_P_RETRY,      /* connector: the last attempt failed, next one at retry_at          */
    TCP_P_CONNECTING, /* connector: non-blocking connect in flight (EPOLLOUT)              */
    TCP_P_WAIT_ACK,   /* connector: hello sent, reading the tcp_ack_t (EPOLLIN)            */
    TCP_P_UP,         /* messages flow                                                     */
    TCP_P_DEAD,       /* the connection broke; isend fails                                 */
} tcp_peer_state_t;

typedef enum tcp_rstate { TCP_R_HDR = 0, TCP_R_PAYLOAD, TCP_R_DEFER } tcp_rstate_t;

/* A queued send. The payload is the caller's until send_done. */
typedef struct tcp_send {
    struct tcp_send *next;
    xccl_msg_hdr_t   hdr;
    const char      *buf;
    size_t           off; /* bytes of header + payload already written */
    void            *cookie;
} tcp_send_t;

typedef struct tcp_peer {
    tcp_peer_state_t state;
    int              fd;
    uint32_t         events; /* what fd is registered for in epoll (UP only) */
    xccl_sockaddr_t  addr;   /* its listening address, from its blob         */
    char             name[TCP_NAME_LEN];

    /* connector side of wire-up */
    int64_t   retry_at;
    int       backoff_ms;
    tcp_ack_t ack;
    size_t    ack_got;
    char      last_err[128]; /* why the last attempt failed, for the timeout message */

    /* send side */
    tcp_send_t *sq_head, *sq_tail;
    int         flushing;   /* inside flush: a nested isend only queues                */
    int         broken_err; /* errno met inside isend; progress fails the peer          */

    /* receive side */
    tcp_rstate_t   rstate;
    char          *rbuf; /* TCP_RBUF_LEN; bytes [roff, rlen) are staged, unconsumed */
    size_t         roff, rlen;
    xccl_msg_hdr_t rhdr;
    char          *rdst;
    size_t         rgot;
    void          *rcookie;

    char why[256]; /* DEAD: what happened */
} tcp_peer_t;

/* A connection accepted during wire-up whose hello has not been read yet. */
typedef struct tcp_pending {
    int             fd; /* -1: free slot */
    int64_t         expires;
    xccl_sockaddr_t addr;
    tcp_hello_t     hello;
    size_t          got;
} tcp_pending_t;

struct xccl_tp_ctx {
    int                      rank, size;
    uint64_t                 job_id;
    const xccl_tp_upcalls_t *up;
    uint8_t                 *key;
    size_t                   keylen;
    char                     auth_ctx[32]; /* "xccl-tcp/<job id>" */
    int                      sockbuf;

    int             epfd, evfd, lfd;
    int             listen_armed;
    xccl_sockaddr_t laddr;
    char            lname[TCP_NAME_LEN];

    uint8_t       *use; /* ranks wire-up was asked to connect */
    tcp_peer_t    *peers;
    tcp_pending_t  pend[TCP_MAX_PENDING];
    int            in_wireup;
    xccl_status_t  wire_err; /* a fatal wire-up error met by an event handler */
    int64_t        wire_deadline;
    int            nbroken;
    int            ndefer; /* peers in TCP_R_DEFER */
    tcp_send_t    *free_sends;
};

/* ---------------------------------------------------------------------------------------------
 * Small helpers
 * ------------------------------------------------------------------------------------------- */

static void tcp_tune(const xccl_tp_ctx_t *ctx, int fd)
{
    int one = 1;

    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (ctx->sockbuf > 0) {
        (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &ctx->sockbuf, sizeof(ctx->sockbuf));
        (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &ctx->sockbuf, sizeof(ctx->sockbuf));
    }
}

static int tcp_epoll(xccl_tp_ctx_t *ctx, int op, int fd, int kind, int idx, uint32_t events)
{
    struct epoll_event ev;

    memset(&ev, 0, sizeof(ev));
    ev.events   = events;
    ev.data.u64 = EV_DATA(kind, idx);
    return epoll_ctl(ctx->epfd, op, fd, op == EPOLL_CTL_DEL ? NULL : &ev);
}

static void tcp_close(xccl_tp_ctx_t *ctx, int *fd)
{
    if (*fd < 0) return;
    (void)epoll_ctl(ctx->epfd, EPOLL_CTL_DEL, *fd, NULL);
    close(*fd);
    *fd = -1;
}

static void tcp_wake(xccl_tp_ctx_t *ctx)
{
    uint64_t one = 1;
    ssize_t  n   = write(ctx->evfd, &one, sizeof(one));
    (void)n; /* EAGAIN only when the counter is saturated: the waiter is woken anyway */
}

static int64_t tcp_min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---------------------------------------------------------------------------------------------
 * Failure
 * ------------------------------------------------------------------------------------------- */

/* Closes the connection, fails what is pending on it (sends, then the receive in flight),
 * then tells the core. Runs upcalls: only from progress or wire-up. */
static void tcp_fail_peer(xccl_tp_ctx_t *ctx, int peer, xccl_status_t st, const char *why)
{
    tcp_peer_t *p = &ctx->peers[peer];
    tcp_send_t *q;
    int         busy;

    if (p->state == TCP_P_DEAD) return;
    /* a connection closed between messages with nothing queued is a peer that finished */
    busy = p->sq_head != NULL || p->rstate != TCP_R_HDR || p->roff != p->rlen;
    tcp_close(ctx, &p->fd);
    p->state = TCP_P_DEAD;
    snprintf(p->why, sizeof(p->why), "%s", why);
    if (busy) XCCL_WARN("tcp: rank %d: %s", ctx->rank, why);
    else XCCL_INFO("tcp: rank %d: %s", ctx->rank, why);
    if (p->broken_err) {
        p->broken_err = 0;
        ctx->nbroken--;
    }
    /* the failed requests' messages (the core reads the thread's last error) say why */
    (void)xccl_error_set(st, "%s", p->why);
    q          = p->sq_head;
    p->sq_head = p->sq_tail = NULL;
    while (q != NULL) {
        tcp_send_t *next = q->next;
        void       *cookie = q->cookie;
        q->next         = ctx->free_sends;
        ctx->free_sends = q;
        ctx->up->send_done(ctx->up->core, cookie, XCCL_ERR_REMOTE);
        q = next;
    }
    if (p->rstate == TCP_R_DEFER) ctx->ndefer--; /* nothing was promised for it */
    if (p->rstate == TCP_R_PAYLOAD) {
        void *cookie = p->rcookie;
        p->rstate    = TCP_R_HDR;
        p->rcookie   = NULL;
        ctx->up->recv_done(ctx->up->core, cookie, XCCL_ERR_REMOTE);
    }
    free(p->rbuf);
    p->rbuf = NULL;
    p->roff = p->rlen = 0;
    ctx->up->peer_failed(ctx->up->core, peer, st, p->why);
}

/* Fails a peer after a read or write error `e` (0: EOF). */
static void tcp_fail_io(xccl_tp_ctx_t *ctx, int peer, int e)
{
    tcp_peer_t *p = &ctx->peers[peer];
    char        why[256];

    if (e == 0 && p->rstate == TCP_R_HDR && p->roff == p->rlen)
        snprintf(why, sizeof(why), "connection to rank %d (%s) closed by peer", peer, p->name);
    else if (e == 0)
        snprintf(why, sizeof(why),
                 "connection to rank %d (%s) closed by peer in the middle of a message",
                 peer, p->name);
    else
        snprintf(why, sizeof(why), "connection to rank %d (%s) failed: %s", peer, p->name,
                 strerror(e));
    tcp_fail_peer(ctx, peer, XCCL_ERR_REMOTE, why);
}

/* ---------------------------------------------------------------------------------------------
 * Send path
 * ------------------------------------------------------------------------------------------- */

static void tcp_want_out(xccl_tp_ctx_t *ctx, int peer, int on)
{
    tcp_peer_t *p  = &ctx->peers[peer];
    uint32_t    ev = EPOLLIN | (on ? EPOLLOUT : 0);

    if (p->events == ev || p->fd < 0) return;
    if (tcp_epoll(ctx, EPOLL_CTL_MOD, p->fd, EV_PEER, peer, ev) == 0) p->events = ev;
}

/* Writes as much of the queue as the socket takes. Returns 0 or the errno that broke the
 * connection (the caller decides when to fail the peer). Calls send_done for every message
 * written completely. */
static int tcp_flush(xccl_tp_ctx_t *ctx, int peer, int *nev)
{
    tcp_peer_t *p   = &ctx->peers[peer];
    int         err = 0;

    p->flushing = 1;
    while (p->sq_head != NULL) {
        struct iovec  iov[TCP_IOV_MAX];
        struct msghdr msg;
        size_t        total = 0;
        int           n     = 0;
        tcp_send_t   *r, *done = NULL, **done_tail = &done;
        ssize_t       w;
        size_t        left;

        for (r = p->sq_head; r != NULL && n + 2 <= TCP_IOV_MAX && total < TCP_IO_CHUNK;
             r = r->next) {
            size_t hlen = sizeof(r->hdr);
            size_t off  = r->off;

            if (off < hlen) {
                iov[n].iov_base = (char *)&r->hdr + off;
                iov[n].iov_len  = hlen - off;
                total += iov[n++].iov_len;
                off = hlen;
            }
            if (off - hlen < r->hdr.nbytes) {
                size_t rem = (size_t)r->hdr.nbytes - (off - hlen);
                size_t cap = TCP_IO_CHUNK - (total < TCP_IO_CHUNK ? total : TCP_IO_CHUNK);
                if (cap == 0) break;
                iov[n].iov_base = (char *)r->buf + (off - hlen);
                iov[n].iov_len  = rem < cap ? rem : cap;
                total += iov[n++].iov_len;
            }
        }
        memset(&msg, 0, sizeof(msg));
        msg.msg_iov    = iov;
        msg.msg_iovlen = (size_t)n;
        w              = sendmsg(p->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) err = errno;
            break;
        }
        /* retire what was written; completed messages leave the queue before any upcall */
        left = (size_t)w;
        while (left > 0) {
            tcp_send_t *h    = p->sq_head;
            size_t      need = sizeof(h->hdr) + (size_t)h->hdr.nbytes - h->off;
            size_t      take = left < need ? left : need;

            h->off += take;
            left -= take;
            if (take < need) break;
            p->sq_head = h->next;
            if (p->sq_head == NULL) p->sq_tail = NULL;
            h->next    = NULL;
            *done_tail = h;
            done_tail  = &h->next;
        }
        while (done != NULL) {
            tcp_send_t *h      = done;
            void       *cookie = h->cookie;
            done               = h->next;
            h->next            = ctx->free_sends;
            ctx->free_sends    = h;
            (*nev)++;
            ctx->up->send_done(ctx->up->core, cookie, XCCL_OK);
        }
        if ((size_t)w < total) break; /* the socket buffer is full */
    }
    p->flushing = 0;
    if (err == 0) tcp_want_out(ctx, peer, p->sq_head != NULL);
    return err;
}

static xccl_status_t tcp_isend(xccl_tp_ctx_t *ctx, int peer, const xccl_msg_hdr_t *hdr,
                               const xccl_tp_buf_t *buf, void *cookie)
{
    tcp_peer_t *p;
    tcp_send_t *r;
    int         nev = 0;

    if (peer < 0 || peer >= ctx->size || peer == ctx->rank)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "tcp: rank %d: send to invalid peer %d",
                          ctx->rank, peer);
    p = &ctx->peers[peer];
    if (p->state == TCP_P_DEAD)
        return XCCL_ERROR(XCCL_ERR_REMOTE, "tcp: rank %d: cannot send to rank %d: %s",
                          ctx->rank, peer, p->why);
    if (p->state != TCP_P_UP)
        return XCCL_ERROR(XCCL_ERR_INVALID_USAGE,
                          "tcp: rank %d: send to rank %d, which is not wired up", ctx->rank,
                          peer);
    if (hdr->nbytes > 0 && (buf == NULL || buf->ptr == NULL))
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "tcp: rank %d: send of %" PRIu64
                          " bytes to rank %d without a buffer", ctx->rank, hdr->nbytes, peer);
    if (hdr->nbytes > 0 && buf->mem != XCCL_MEM_HOST)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                          "tcp: rank %d: send to rank %d from device memory", ctx->rank, peer);
    r = ctx->free_sends;
    if (r != NULL) {
        ctx->free_sends = r->next;
    } else if ((r = malloc(sizeof(*r))) == NULL) {
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "tcp: rank %d: send request", ctx->rank);
    }
    r->next   = NULL;
    r->hdr    = *hdr;
    r->buf    = hdr->nbytes > 0 ? buf->ptr : NULL;
    r->off    = 0;
    r->cookie = cookie;
    if (p->sq_tail != NULL) {
        p->sq_tail->next = r;
        p->sq_tail       = r;
        return XCCL_OK;
    }
    p->sq_head = p->sq_tail = r;
    if (p->flushing || p->broken_err) return XCCL_OK;
    /* the queue was empty: try now, so a small message leaves without waiting for progress */
    p->broken_err = tcp_flush(ctx, peer, &nev);
    if (p->broken_err) {
        ctx->nbroken++;
        tcp_wake(ctx);
    }
    return XCCL_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Receive path
 * ------------------------------------------------------------------------------------------- */

/* A header is in p->rhdr (first offer, or again while deferred): ask the core where its
 * payload goes. 0: go on, 1: deferred (stop reading this peer), -1: peer failed. */
static int tcp_match(xccl_tp_ctx_t *ctx, int peer, int *nev)
{
    tcp_peer_t   *p      = &ctx->peers[peer];
    xccl_tp_buf_t dst    = {NULL, XCCL_MEM_HOST, NULL};
    void         *cookie = NULL;
    xccl_status_t st;
    char          why[256];

    st = ctx->up->recv_match(ctx->up->core, peer, &p->rhdr, &dst, &cookie);
    if (st == XCCL_INPROGRESS) {
        if (p->rstate != TCP_R_DEFER) ctx->ndefer++;
        p->rstate = TCP_R_DEFER;
        return 1;
    }
    if (p->rstate == TCP_R_DEFER) {
        ctx->ndefer--;
        p->rstate = TCP_R_HDR;
    }
    if (st < 0) {
        snprintf(why, sizeof(why),
                 "message from rank %d (comm %" PRIx64 " tag %" PRIx64 ", %" PRIu64
                 " bytes) refused: %s",
                 peer, p->rhdr.comm_id, p->rhdr.tag, p->rhdr.nbytes, xccl_status_string(st));
        tcp_fail_peer(ctx, peer, st, why);
        return -1;
    }
    if (p->rhdr.nbytes == 0) {
        (*nev)++;
        ctx->up->recv_done(ctx->up->core, cookie, XCCL_OK);
        return 0;
    }
    p->rstate  = TCP_R_PAYLOAD;
    p->rdst    = dst.ptr; /* NULL: drop the payload */
    p->rgot    = 0;
    p->rcookie = cookie;
    if (dst.ptr != NULL && dst.mem != XCCL_MEM_HOST) {
        snprintf(why, sizeof(why),
                 "message from rank %d (%" PRIu64 " bytes): the core gave no host buffer", peer,
                 p->rhdr.nbytes);
        tcp_fail_peer(ctx, peer, XCCL_ERR_INTERNAL, why);
        return -1;
    }
    return 0;
}

static void tcp_recv_complete(xccl_tp_ctx_t *ctx, tcp_peer_t *p, int *nev)
{
    void *cookie = p->rcookie;

    p->rstate  = TCP_R_HDR;
    p->rcookie = NULL;
    p->rdst    = NULL;
    (*nev)++;
    ctx->up->recv_done(ctx->up->core, cookie, XCCL_OK);
}

/* Reads what the socket has (up to TCP_RECV_BUDGET calls), delivering whole messages. A read
 * that comes back short has emptied the socket: the loop then only consumes what is staged and
 * leaves the next read to the next pass (level-triggered epoll reports the socket again if
 * more arrived), which saves the read that would only say EAGAIN, one call per message. */
static void tcp_recv(xccl_tp_ctx_t *ctx, int peer, int *nev)
{
    tcp_peer_t *p       = &ctx->peers[peer];
    int         budget  = TCP_RECV_BUDGET;
    int         drained = 0;
    ssize_t     r       = 0;

    if (p->rstate == TCP_R_DEFER && tcp_match(ctx, peer, nev) != 0) return;
    while (p->state == TCP_P_UP) {
        if (p->rstate == TCP_R_HDR) {
            size_t avail = p->rlen - p->roff;

            if (avail >= sizeof(p->rhdr)) {
                memcpy(&p->rhdr, p->rbuf + p->roff, sizeof(p->rhdr));
                p->roff += sizeof(p->rhdr);
                if (tcp_match(ctx, peer, nev) != 0) return;
                continue;
            }
            if (drained || budget-- == 0) return;
            if (p->roff > 0) {
                memmove(p->rbuf, p->rbuf + p->roff, avail);
                p->roff = 0;
                p->rlen = avail;
            }
            r = recv(p->fd, p->rbuf + avail, TCP_RBUF_LEN - avail, MSG_DONTWAIT);
            if (r > 0) {
                p->rlen += (size_t)r;
                drained = (size_t)r < TCP_RBUF_LEN - avail;
                continue;
            }
        } else {
            size_t        need = (size_t)p->rhdr.nbytes - p->rgot;
            struct iovec  iov[2];
            struct msghdr msg;

            if (p->roff < p->rlen) {
                size_t take = p->rlen - p->roff < need ? p->rlen - p->roff : need;
                if (p->rdst != NULL) memcpy(p->rdst + p->rgot, p->rbuf + p->roff, take);
                p->roff += take;
                p->rgot += take;
                if (p->rgot == p->rhdr.nbytes) tcp_recv_complete(ctx, p, nev);
                continue;
            }
            if (drained || budget-- == 0) return;
            p->roff = p->rlen = 0;
            if (p->rdst == NULL) { /* dropped: through the staging buffer, consumed above */
                r = recv(p->fd, p->rbuf, TCP_RBUF_LEN, MSG_DONTWAIT);
                if (r > 0) {
                    p->rlen = (size_t)r;
                    drained = (size_t)r < TCP_RBUF_LEN;
                    continue;
                }
                if (r < 0 && errno == EINTR) continue;
                if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
                tcp_fail_io(ctx, peer, r == 0 ? 0 : errno);
                return;
            }
            iov[0].iov_base   = p->rdst + p->rgot;
            iov[0].iov_len    = need < TCP_IO_CHUNK ? need : TCP_IO_CHUNK;
            iov[1].iov_base   = p->rbuf;
            iov[1].iov_len    = TCP_RBUF_LEN;
            memset(&msg, 0, sizeof(msg));
            msg.msg_iov    = iov;
            msg.msg_iovlen = need <= TCP_IO_CHUNK ? 2 : 1; /* stage what follows this message */
            r              = recvmsg(p->fd, &msg, MSG_DONTWAIT);
            if (r > 0) {
                drained = (size_t)r < iov[0].iov_len + (msg.msg_iovlen == 2 ? TCP_RBUF_LEN : 0);
                if ((size_t)r > iov[0].iov_len) {
                    p->rgot += iov[0].iov_len;
                    p->rlen = (size_t)r - iov[0].iov_len;
                } else {
                    p->rgot += (size_t)r;
                }
                if (p->rgot == p->rhdr.nbytes) tcp_recv_complete(ctx, p, nev);
                continue;
            }
        }
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        tcp_fail_io(ctx, peer, r == 0 ? 0 : errno);
        return;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Wire-up
 * ------------------------------------------------------------------------------------------- */

static void tcp_hello_fill(const xccl_tp_ctx_t *ctx, int dst, tcp_hello_t *h)
{
    memset(h, 0, sizeof(*h));
    memcpy(h->magic, TCP_MAGIC, 4);
    h->version  = TCP_PROTO_VERSION;
    h->endian   = TCP_ENDIAN_MARK;
    h->job_id   = ctx->job_id;
    h->src_rank = ctx->rank;
    h->dst_rank = dst;
    h->flags    = ctx->key ? TCP_HELLO_AUTH : 0;
}

/* The connection on p->fd has passed the handshake: make it a data connection. */
static xccl_status_t tcp_peer_up(xccl_tp_ctx_t *ctx, int peer, int op)
{
    tcp_peer_t *p = &ctx->peers[peer];

    p->rbuf = malloc(TCP_RBUF_LEN);
    if (p->rbuf == NULL)
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "tcp: rank %d: buffer for rank %d", ctx->rank,
                          peer);
    if (tcp_epoll(ctx, op, p->fd, EV_PEER, peer, EPOLLIN) != 0) {
        free(p->rbuf);
        p->rbuf = NULL;
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "tcp: rank %d: epoll_ctl for rank %d: %s",
                          ctx->rank, peer, strerror(errno));
    }
    p->events = EPOLLIN;
    p->state  = TCP_P_UP;
    p->rstate = TCP_R_HDR;
    p->roff = p->rlen = 0;
    XCCL_INFO("tcp: rank %d connected to rank %d (%s)", ctx->rank, peer, p->name);
    return XCCL_OK;
}

/* Connector: give up on this attempt, try again after a backoff. */
static void tcp_conn_retry(xccl_tp_ctx_t *ctx, int peer, const char *what, int e)
{
    tcp_peer_t *p = &ctx->peers[peer];

    tcp_close(ctx, &p->fd);
    if (e != 0)
        snprintf(p->last_err, sizeof(p->last_err), "%s: %s", what, strerror(e));
    else
        snprintf(p->last_err, sizeof(p->last_err), "%s", what);
    p->state      = TCP_P_RETRY;
    p->retry_at   = xccl_now_ms() + p->backoff_ms;
    p->backoff_ms = p->backoff_ms * 2 > TCP_BACKOFF_MAX_MS ? TCP_BACKOFF_MAX_MS : p->backoff_ms * 2;
}

static int tcp_conn_retryable(int e)
{
    return e == ECONNREFUSED || e == ETIMEDOUT || e == ECONNRESET || e == ECONNABORTED ||
           e == EAGAIN || e == EINTR || e == EHOSTUNREACH || e == ENETUNREACH ||
           e == EADDRNOTAVAIL || e == EPIPE;
}

/* Connector: the TCP connection is up; send the hello and wait for the ack. */
static xccl_status_t tcp_conn_established(xccl_tp_ctx_t *ctx, int peer)
{
    tcp_peer_t             *p = &ctx->peers[peer];
    tcp_hello_t             h;
    struct sockaddr_storage a, b;
    socklen_t               la = sizeof(a), lb = sizeof(b);

    /* connecting to a free local port can pick that port as the source and reach itself */
    if (getsockname(p->fd, (struct sockaddr *)&a, &la) == 0 &&
        getpeername(p->fd, (struct sockaddr *)&b, &lb) == 0 && la == lb &&
        memcmp(&a, &b, la) == 0) {
        tcp_conn_retry(ctx, peer, "connect", ECONNREFUSED);
        return XCCL_OK;
    }
    tcp_hello_fill(ctx, peer, &h);
    /* 32 bytes into an empty socket buffer: never waits in practice */
    if (xccl_sock_send_all(p->fd, &h, sizeof(h),
                           tcp_min64(ctx->wire_deadline, xccl_now_ms() + TCP_HANDSHAKE_MS)) !=
        XCCL_OK) {
        tcp_conn_retry(ctx, peer, "sending the hello failed", 0);
        return XCCL_OK;
    }
    p->ack_got = 0;
    p->state   = TCP_P_WAIT_ACK;
    if (tcp_epoll(ctx, EPOLL_CTL_MOD, p->fd, EV_PEER, peer, EPOLLIN) != 0)
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "tcp: rank %d: epoll_ctl: %s", ctx->rank,
                          strerror(errno));
    return XCCL_OK;
}

/* Connector: start one non-blocking connect to a lower rank. */
static xccl_status_t tcp_conn_start(xccl_tp_ctx_t *ctx, int peer)
{
    tcp_peer_t *p = &ctx->peers[peer];
    int         fd = socket(p->addr.ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);

    if (fd < 0)
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "tcp: rank %d: socket() for rank %d: %s", ctx->rank,
                          peer, strerror(errno));
    tcp_tune(ctx, fd); /* buffer sizes before connect, so the window scale can use them */
    p->fd = fd;
    if (connect(fd, (const struct sockaddr *)&p->addr.ss, p->addr.len) == 0) {
        if (tcp_epoll(ctx, EPOLL_CTL_ADD, fd, EV_PEER, peer, EPOLLIN) != 0)
            return XCCL_ERROR(XCCL_ERR_SYSTEM, "tcp: rank %d: epoll_ctl: %s", ctx->rank,
                              strerror(errno));
        return tcp_conn_established(ctx, peer);
    }
    if (errno == EINPROGRESS) {
        p->state = TCP_P_CONNECTING;
        if (tcp_epoll(ctx, EPOLL_CTL_ADD, fd, EV_PEER, peer, EPOLLOUT) != 0)
            return XCCL_ERROR(XCCL_ERR_SYSTEM, "tcp: rank %d: epoll_ctl: %s", ctx->rank,
                              strerror(errno));
        return XCCL_OK;
    }
    if (tcp_conn_retryable(errno)) {
        tcp_conn_retry(ctx, peer, "connect", errno);
        return XCCL_OK;
    }
    {
        int e = errno;
        tcp_close(ctx, &p->fd);
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "tcp: rank %d: connect to rank %d (%s) failed: %s",
                          ctx->rank, peer, p->name, strerror(e));
    }
}

/* Connector: the socket became writable (connect finished) or reported an error. */
static xccl_status_t tcp_conn_event(xccl_tp_ctx_t *ctx, int peer)
{
    tcp_peer_t *p   = &ctx->peers[peer];
    int         err = 0;
    socklen_t   len = sizeof(err);

    if (getsockopt(p->fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    if (err != 0) {
        if (tcp_conn_retryable(err)) {
            tcp_conn_retry(ctx, peer, "connect", err);
            return XCCL_OK;
        }
        tcp_close(ctx, &p->fd);
        p->state = TCP_P_IDLE;
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "tcp: rank %d: connect to rank %d (%s) failed: %s",
                          ctx->rank, peer, p->name, strerror(err));
    }
    return tcp_conn_established(ctx, peer);
}

/* Connector: read the ack; when complete, check it, authenticate, and go up. */
static xccl_status_t tcp_conn_read_ack(xccl_tp_ctx_t *ctx, int peer)
{
    tcp_peer_t   *p = &ctx->peers[peer];
    tcp_ack_t    *a = &p->ack;
    ssize_t       r;
    xccl_status_t st;
    char          why[160];
    int           rc;

    r = recv(p->fd, (char *)a + p->ack_got, sizeof(*a) - p->ack_got, MSG_DONTWAIT);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return XCCL_OK;
    if (r <= 0) {
        tcp_conn_retry(ctx, peer, r == 0 ? "closed during the handshake" : "handshake",
                       r == 0 ? 0 : errno);
        return XCCL_OK;
    }
    p->ack_got += (size_t)r;
    if (p->ack_got < sizeof(*a)) return XCCL_OK;

    rc = xccl_tcp_ack_check(a, ctx->job_id, peer, why, sizeof(why));
    if (rc < 0) {
        tcp_close(ctx, &p->fd);
        p->state = TCP_P_IDLE;
        return XCCL_ERROR(XCCL_ERR_AUTH,
                          "tcp: rank %d: %s (the address of rank %d) is not an xccl tcp "
                          "endpoint",
                          ctx->rank, p->name, peer);
    }
    if (rc > 0) {
        tcp_close(ctx, &p->fd);
        p->state = TCP_P_IDLE;
        return XCCL_ERROR(XCCL_ERR_AUTH, "tcp: rank %d: connection to rank %d (%s) refused: %s",
                          ctx->rank, peer, p->name, why);
    }
    if (ctx->key != NULL) {
        /* the acceptor entered the handshake right after its ack, so this wait is short */
        xccl_sock_set_nonblock(p->fd, 0);
        st = xccl_auth_handshake(p->fd, ctx->key, ctx->keylen, 0, ctx->auth_ctx,
                                 tcp_min64(ctx->wire_deadline, xccl_now_ms() + TCP_HANDSHAKE_MS));
        xccl_sock_set_nonblock(p->fd, 1);
        if (st == XCCL_ERR_AUTH) {
            tcp_close(ctx, &p->fd);
            p->state = TCP_P_IDLE;
            return XCCL_ERROR(XCCL_ERR_AUTH,
                              "tcp: rank %d: authentication with rank %d (%s) failed: is the "
                              "key the same on every rank?",
                              ctx->rank, peer, p->name);
        }
        if (st != XCCL_OK) {
            tcp_conn_retry(ctx, peer, "authentication handshake broke off", 0);
            return XCCL_OK;
        }
    }
    return tcp_peer_up(ctx, peer, EPOLL_CTL_MOD);
}

static void tcp_pending_drop(xccl_tp_ctx_t *ctx, int slot, const char *why)
{
    tcp_pending_t *q = &ctx->pend[slot];
    char           name[TCP_NAME_LEN];

    XCCL_WARN("tcp: rank %d (%s): closed connection from %s: %s", ctx->rank, ctx->lname,
              xccl_sock_str(&q->addr, name, sizeof(name)), why);
    tcp_close(ctx, &q->fd);
}

/* Acceptor: sends a refusal with its reason (best effort) and closes. */
static void tcp_pending_refuse(xccl_tp_ctx_t *ctx, int slot, unsigned status)
{
    tcp_pending_t *q = &ctx->pend[slot];
    tcp_ack_t      a;
    char           why[160];
    ssize_t        n;

    memset(&a, 0, sizeof(a));
    memcpy(a.magic, TCP_MAGIC, 4);
    a.version = TCP_PROTO_VERSION;
    a.status  = (uint16_t)status;
    a.job_id  = ctx->job_id;
    a.rank    = ctx->rank;
    n         = send(q->fd, &a, sizeof(a), MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)n;
    snprintf(why, sizeof(why), "hello claims rank %d of job %" PRIx64 ": %s",
             (int)q->hello.src_rank, q->hello.job_id, xccl_tcp_ack_reason(status));
    tcp_pending_drop(ctx, slot, why);
}

/* For xccl_tcp_hello_check: is rank `src` connected, or being connected, already? */
static int tcp_peer_busy(void *arg, int src)
{
    const xccl_tp_ctx_t *ctx = arg;
    return ctx->peers[src].state != TCP_P_IDLE;
}

/* Acceptor: a whole hello is in; check it, answer, authenticate, and adopt the connection. */
static xccl_status_t tcp_pending_hello(xccl_tp_ctx_t *ctx, int slot)
{
    tcp_pending_t *q   = &ctx->pend[slot];
    tcp_hello_t   *h   = &q->hello;
    int            src = h->src_rank;
    tcp_ack_t      a;
    tcp_peer_t    *p;
    unsigned       refuse = xccl_tcp_hello_check(h, ctx->rank, ctx->size, ctx->job_id, ctx->use,
                                                 ctx->key != NULL, tcp_peer_busy, ctx);

    if (refuse != TCP_ACK_OK) {
        tcp_pending_refuse(ctx, slot, refuse);
        return XCCL_OK;
    }

    memset(&a, 0, sizeof(a));
    memcpy(a.magic, TCP_MAGIC, 4);
    a.version = TCP_PROTO_VERSION;
    a.status  = TCP_ACK_OK;
    a.job_id  = ctx->job_id;
    a.rank    = ctx->rank;
    if (xccl_sock_send_all(q->fd, &a, sizeof(a), xccl_now_ms() + TCP_HANDSHAKE_MS) != XCCL_OK) {
        tcp_pending_drop(ctx, slot, "could not answer its hello");
        return XCCL_OK;
    }
    if (ctx->key != NULL) {
        xccl_status_t st;
        xccl_sock_set_nonblock(q->fd, 0);
        st = xccl_auth_handshake(q->fd, ctx->key, ctx->keylen, 1, ctx->auth_ctx,
                                 tcp_min64(ctx->wire_deadline, xccl_now_ms() + TCP_HANDSHAKE_MS));
        xccl_sock_set_nonblock(q->fd, 1);
        if (st != XCCL_OK) {
            char why[96];
            snprintf(why, sizeof(why), "claims rank %d but failed authentication (%s)", src,
                     xccl_status_string(st));
            tcp_pending_drop(ctx, slot, why);
            return XCCL_OK;
        }
    }
    p       = &ctx->peers[src];
    p->fd   = q->fd;
    q->fd   = -1;
    tcp_tune(ctx, p->fd);
    return tcp_peer_up(ctx, src, EPOLL_CTL_MOD);
}

/* Acceptor: bytes of a hello arrived on a pending connection. */
static xccl_status_t tcp_pending_read(xccl_tp_ctx_t *ctx, int slot)
{
    tcp_pending_t *q = &ctx->pend[slot];
    ssize_t        r;

    if (q->fd < 0) return XCCL_OK;
    r = recv(q->fd, (char *)&q->hello + q->got, sizeof(q->hello) - q->got, MSG_DONTWAIT);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return XCCL_OK;
    if (r <= 0) {
        tcp_pending_drop(ctx, slot, r == 0 ? "closed before completing its hello"
                                           : strerror(errno));
        return XCCL_OK;
    }
    q->got += (size_t)r;
    if (q->got >= 4 && memcmp(q->hello.magic, TCP_MAGIC, 4) != 0) {
        tcp_pending_drop(ctx, slot, "not an xccl tcp hello");
        return XCCL_OK;
    }
    if (q->got < sizeof(q->hello)) return XCCL_OK;
    return tcp_pending_hello(ctx, slot);
}

/* Accepts every waiting connection. During wire-up they become pending; afterwards nobody
 * is expected, so they are closed at once. */
static void tcp_accept_all(xccl_tp_ctx_t *ctx)
{
    for (;;) {
        xccl_sockaddr_t a;
        char            name[TCP_NAME_LEN];
        int             fd, slot;

        memset(&a, 0, sizeof(a));
        a.len = sizeof(a.ss);
        fd    = accept4(ctx->lfd, (struct sockaddr *)&a.ss, &a.len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                XCCL_WARN("tcp: rank %d: accept on %s failed: %s", ctx->rank, ctx->lname,
                          strerror(errno));
            return;
        }
        for (slot = 0; ctx->in_wireup && slot < TCP_MAX_PENDING; slot++)
            if (ctx->pend[slot].fd < 0) break;
        if (!ctx->in_wireup || slot == TCP_MAX_PENDING) {
            XCCL_WARN("tcp: rank %d (%s): closed connection from %s: %s", ctx->rank, ctx->lname,
                      xccl_sock_str(&a, name, sizeof(name)),
                      ctx->in_wireup ? "too many unidentified connections"
                                     : "no connection is expected after wire-up");
            close(fd);
            continue;
        }
        if (tcp_epoll(ctx, EPOLL_CTL_ADD, fd, EV_PENDING, slot, EPOLLIN) != 0) {
            close(fd);
            continue;
        }
        ctx->pend[slot].fd      = fd;
        ctx->pend[slot].addr    = a;
        ctx->pend[slot].got     = 0;
        ctx->pend[slot].expires = xccl_now_ms() + TCP_HANDSHAKE_MS;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Event dispatch (progress and wire-up)
 * ------------------------------------------------------------------------------------------- */

static void tcp_peer_event(xccl_tp_ctx_t *ctx, int peer, uint32_t events, int *nev)
{
    tcp_peer_t *p = &ctx->peers[peer];

    if (events & (EPOLLIN | EPOLLERR | EPOLLHUP)) tcp_recv(ctx, peer, nev);
    if (p->state == TCP_P_UP && (events & (EPOLLOUT | EPOLLERR))) {
        int e = tcp_flush(ctx, peer, nev);
        if (e != 0) tcp_fail_io(ctx, peer, e);
    }
}

static void tcp_dispatch(xccl_tp_ctx_t *ctx, const struct epoll_event *ev, int *nev)
{
    int      kind = (int)(ev->data.u64 >> 32);
    int      idx  = (int)(uint32_t)ev->data.u64;
    uint64_t v;

    switch (kind) {
    case EV_WAKE: {
        ssize_t r = read(ctx->evfd, &v, sizeof(v)); /* resets the counter */
        (void)r;
        break;
    }
    case EV_LISTEN:
        tcp_accept_all(ctx);
        break;
    case EV_PENDING: {
        xccl_status_t st = tcp_pending_read(ctx, idx);
        if (st < 0 && ctx->wire_err == XCCL_OK) ctx->wire_err = st;
        break;
    }
    case EV_PEER: {
        tcp_peer_t   *p  = &ctx->peers[idx];
        xccl_status_t st = XCCL_OK;
        if (p->state == TCP_P_UP) tcp_peer_event(ctx, idx, ev->events, nev);
        else if (p->state == TCP_P_CONNECTING) st = tcp_conn_event(ctx, idx);
        else if (p->state == TCP_P_WAIT_ACK) st = tcp_conn_read_ack(ctx, idx);
        if (st < 0 && ctx->wire_err == XCCL_OK) ctx->wire_err = st;
        break;
    }
    default:
        break;
    }
}

/* Fails the peers whose connection broke inside isend. */
static void tcp_fail_broken(xccl_tp_ctx_t *ctx)
{
    int i;

    for (i = 0; i < ctx->size && ctx->nbroken > 0; i++)
        if (ctx->peers[i].broken_err) tcp_fail_io(ctx, i, ctx->peers[i].broken_err);
}

static xccl_status_t tcp_progress(xccl_tp_ctx_t *ctx, int *nevents)
{
    struct epoll_event evs[TCP_MAX_EVENTS];
    int                nev = 0, n, i;

    if (ctx->nbroken > 0) tcp_fail_broken(ctx);
    /* held-back messages: ask again (their sockets may have nothing new to report) */
    for (i = 0; ctx->ndefer > 0 && i < ctx->size; i++)
        if (ctx->peers[i].state == TCP_P_UP && ctx->peers[i].rstate == TCP_R_DEFER)
            tcp_recv(ctx, i, &nev);
    n = epoll_wait(ctx->epfd, evs, TCP_MAX_EVENTS, 0);
    if (n < 0 && errno != EINTR)
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "tcp: rank %d: epoll_wait failed: %s", ctx->rank,
                          strerror(errno));
    for (i = 0; i < n; i++) tcp_dispatch(ctx, &evs[i], &nev);
    if (nevents != NULL) *nevents = nev;
    return XCCL_OK;
}

/* Ranks still missing, for the timeout message. */
static void tcp_missing(const xccl_tp_ctx_t *ctx, char *buf, size_t len)
{
    size_t used = 0;
    int    i, shown = 0, more = 0;

    buf[0] = '\0';
    for (i = 0; i < ctx->size; i++) {
        const tcp_peer_t *p = &ctx->peers[i];
        int               w;

        if (!ctx->use[i] || i == ctx->rank || p->state == TCP_P_UP || p->state == TCP_P_DEAD)
            continue;
        if (used + 200 > len) {
            more++;
            continue;
        }
        if (i < ctx->rank)
            w = snprintf(buf + used, len - used, "%srank %d (%s: %s)", shown ? ", " : "", i,
                         p->name,
                         p->state == TCP_P_WAIT_ACK   ? "no answer to our hello"
                         : p->state == TCP_P_CONNECTING ? "connect in progress"
                         : p->last_err[0]               ? p->last_err
                                                        : "not tried");
        else
            w = snprintf(buf + used, len - used, "%srank %d (%s: it never connected to us)",
                         shown ? ", " : "", i, p->name);
        if (w > 0) used += (size_t)w < len - used ? (size_t)w : len - used - 1;
        shown++;
    }
    if (more > 0) snprintf(buf + used, len - used, " and %d more", more);
}

static int tcp_all_up(const xccl_tp_ctx_t *ctx, const uint8_t *use)
{
    int i;

    for (i = 0; i < ctx->size; i++)
        if (use[i] && i != ctx->rank && ctx->peers[i].state != TCP_P_UP &&
            ctx->peers[i].state != TCP_P_DEAD)
            return 0;
    return 1;
}

static xccl_status_t tcp_wireup(xccl_tp_ctx_t *ctx, const void *const *addrs, const size_t *lens,
                                const uint8_t *use, int64_t timeout_ms)
{
    struct epoll_event evs[TCP_MAX_EVENTS];
    int64_t            t0 = xccl_now_ms();
    xccl_status_t      st = XCCL_OK;
    int                i, nev = 0;

    if (timeout_ms < 0) timeout_ms = 30LL * 60 * 1000; /* the caller gave none: 30 minutes */
    ctx->wire_deadline = t0 + timeout_ms;
    ctx->wire_err      = XCCL_OK;
    for (i = 0; i < ctx->size; i++) {
        tcp_peer_t *p = &ctx->peers[i];

        if (!use[i] || i == ctx->rank) continue;
        if (p->state == TCP_P_UP || p->state == TCP_P_DEAD) continue;
        if (xccl_tcp_addr_decode(addrs[i], lens[i], &p->addr) != 0)
            return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                              "tcp: rank %d: the address of rank %d is malformed (%zu bytes)",
                              ctx->rank, i, lens[i]);
        xccl_sock_str(&p->addr, p->name, sizeof(p->name));
        ctx->use[i]   = 1;
        p->backoff_ms = 1;
        p->last_err[0] = '\0';
        if (i < ctx->rank) {
            p->state    = TCP_P_RETRY;
            p->retry_at = t0;
        }
    }
    if (!ctx->listen_armed) {
        if (tcp_epoll(ctx, EPOLL_CTL_ADD, ctx->lfd, EV_LISTEN, 0, EPOLLIN) != 0)
            return XCCL_ERROR(XCCL_ERR_SYSTEM, "tcp: rank %d: epoll_ctl: %s", ctx->rank,
                              strerror(errno));
        ctx->listen_armed = 1;
    }
    ctx->in_wireup = 1;
    for (;;) {
        int64_t now = xccl_now_ms(), next = ctx->wire_deadline;
        int     n;

        if (ctx->wire_err < 0) {
            st = ctx->wire_err;
            break;
        }
        if (tcp_all_up(ctx, use)) break;
        if (now >= ctx->wire_deadline) {
            char missing[1024];
            tcp_missing(ctx, missing, sizeof(missing));
            st = XCCL_ERROR(XCCL_ERR_TIMEOUT,
                            "tcp: rank %d (%s): wire-up timed out after %lld ms; not connected: "
                            "%s",
                            ctx->rank, ctx->lname, (long long)(now - t0), missing);
            break;
        }
        for (i = 0; i < ctx->size && st == XCCL_OK; i++) {
            tcp_peer_t *p = &ctx->peers[i];
            if (p->state == TCP_P_RETRY && ctx->use[i]) {
                if (p->retry_at <= now) st = tcp_conn_start(ctx, i);
                if (p->state == TCP_P_RETRY) next = tcp_min64(next, p->retry_at);
            }
        }
        if (st < 0) break;
        for (i = 0; i < TCP_MAX_PENDING; i++) {
            if (ctx->pend[i].fd < 0) continue;
            if (ctx->pend[i].expires <= now)
                tcp_pending_drop(ctx, i, "no complete hello in time");
            else
                next = tcp_min64(next, ctx->pend[i].expires);
        }
        n = epoll_wait(ctx->epfd, evs, TCP_MAX_EVENTS,
                       (int)(next > now ? tcp_min64(next - now, 1000) : 0));
        if (n < 0 && errno != EINTR) {
            st = XCCL_ERROR(XCCL_ERR_SYSTEM, "tcp: rank %d: epoll_wait failed: %s", ctx->rank,
                            strerror(errno));
            break;
        }
        for (i = 0; i < n; i++) tcp_dispatch(ctx, &evs[i], &nev);
    }
    ctx->in_wireup = 0;
    for (i = 0; i < TCP_MAX_PENDING; i++)
        if (ctx->pend[i].fd >= 0) tcp_pending_drop(ctx, i, "wire-up ended before its hello");
    if (st < 0) {
        /* half-open attempts go; connections already up stay (finalize closes them) */
        for (i = 0; i < ctx->size; i++) {
            tcp_peer_t *p = &ctx->peers[i];
            if (p->state == TCP_P_RETRY || p->state == TCP_P_CONNECTING ||
                p->state == TCP_P_WAIT_ACK) {
                tcp_close(ctx, &p->fd);
                p->state = TCP_P_IDLE;
            }
        }
        return st;
    }
    XCCL_INFO("tcp: rank %d wired up in %lld ms", ctx->rank, (long long)(xccl_now_ms() - t0));
    return XCCL_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Context
 * ------------------------------------------------------------------------------------------- */

static void tcp_finalize(xccl_tp_ctx_t *ctx)
{
    int i;

    if (ctx == NULL) return;
    if (ctx->peers != NULL) {
        for (i = 0; i < ctx->size; i++) {
            tcp_peer_t *p = &ctx->peers[i];
            tcp_send_t *q = p->sq_head;
            if (p->fd >= 0) close(p->fd);
            while (q != NULL) {
                tcp_send_t *next = q->next;
                free(q);
                q = next;
            }
            free(p->rbuf);
        }
    }
    for (i = 0; i < TCP_MAX_PENDING; i++)
        if (ctx->pend[i].fd >= 0) close(ctx->pend[i].fd);
    while (ctx->free_sends != NULL) {
        tcp_send_t *next = ctx->free_sends->next;
        free(ctx->free_sends);
        ctx->free_sends = next;
    }
    if (ctx->lfd >= 0) close(ctx->lfd);
    if (ctx->evfd >= 0) close(ctx->evfd);
    if (ctx->epfd >= 0) close(ctx->epfd);
    if (ctx->key != NULL) {
        memset(ctx->key, 0, ctx->keylen);
        free(ctx->key);
    }
    free(ctx->peers);
    free(ctx->use);
    free(ctx);
}

static xccl_status_t tcp_init(const xccl_tp_init_params_t *params, xccl_tp_ctx_t **out)
{
    xccl_tp_ctx_t *ctx;
    xccl_status_t  st;
    int64_t        sockbuf = xccl_env_int("XCCL_TCP_SOCKBUF", TCP_SOCKBUF_DEF);
    int            i;

    if (params == NULL || out == NULL || params->size < 1 || params->rank < 0 ||
        params->rank >= params->size || params->up == NULL || params->up->recv_match == NULL ||
        params->up->recv_done == NULL || params->up->send_done == NULL ||
        params->up->peer_failed == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "tcp: init: bad parameters (rank %d of %d)",
                          params ? params->rank : -1, params ? params->size : 0);
    ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "tcp: init: context");
    ctx->epfd = ctx->evfd = ctx->lfd = -1;
    for (i = 0; i < TCP_MAX_PENDING; i++) ctx->pend[i].fd = -1;
    ctx->rank    = params->rank;
    ctx->size    = params->size;
    ctx->job_id  = params->job_id;
    ctx->up      = params->up;
    ctx->sockbuf = sockbuf < 0 ? 0 : sockbuf > INT_MAX / 2 ? INT_MAX / 2 : (int)sockbuf;
    snprintf(ctx->auth_ctx, sizeof(ctx->auth_ctx), "xccl-tcp/%016" PRIx64, ctx->job_id);
    ctx->peers = calloc((size_t)ctx->size, sizeof(*ctx->peers));
    ctx->use   = calloc((size_t)ctx->size, 1);
    if (ctx->peers == NULL || ctx->use == NULL) {
        st = XCCL_ERROR(XCCL_ERR_NO_MEMORY, "tcp: init: %d peers", ctx->size);
        goto fail;
    }
    for (i = 0; i < ctx->size; i++) ctx->peers[i].fd = -1;
    if (params->auth_key != NULL && params->auth_key_len > 0) {
        ctx->key = malloc(params->auth_key_len);
        if (ctx->key == NULL) {
            st = XCCL_ERROR(XCCL_ERR_NO_MEMORY, "tcp: init: key");
            goto fail;
        }
        memcpy(ctx->key, params->auth_key, params->auth_key_len);
        ctx->keylen = params->auth_key_len;
    }
    ctx->epfd = epoll_create1(EPOLL_CLOEXEC);
    ctx->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (ctx->epfd < 0 || ctx->evfd < 0 ||
        tcp_epoll(ctx, EPOLL_CTL_ADD, ctx->evfd, EV_WAKE, 0, EPOLLIN) != 0) {
        st = XCCL_ERROR(XCCL_ERR_SYSTEM, "tcp: init: epoll/eventfd: %s", strerror(errno));
        goto fail;
    }
    XCCL_CHECK_GOTO(xccl_sock_default_addr(&ctx->laddr), st, fail);
    XCCL_CHECK_GOTO(xccl_sock_listen(&ctx->laddr, &ctx->lfd), st, fail);
    tcp_tune(ctx, ctx->lfd); /* accepted sockets inherit the buffer sizes */
    xccl_sock_set_nonblock(ctx->lfd, 1);
    xccl_sock_str(&ctx->laddr, ctx->lname, sizeof(ctx->lname));
    XCCL_INFO("tcp: rank %d listening on %s", ctx->rank, ctx->lname);
    *out = ctx;
    return XCCL_OK;
fail:
    tcp_finalize(ctx);
    return st;
}

static int tcp_reachable(const xccl_tp_ctx_t *ctx, int peer)
{
    (void)ctx;
    (void)peer;
    return 1;
}

static xccl_status_t tcp_get_addr(xccl_tp_ctx_t *ctx, void *addr, size_t *len)
{
    xccl_tcp_addr_encode(&ctx->laddr, addr);
    *len = TCP_ADDR_LEN;
    return XCCL_OK;
}

/* Sleeps until the epoll set has something to report; consumes nothing (see Threading). */
/* The core gave up on an operation whose buffers this connection still holds. */
static void tcp_close_peer(xccl_tp_ctx_t *ctx, int peer, const char *why)
{
    char msg[256];

    snprintf(msg, sizeof(msg), "connection to rank %d dropped: %s", peer, why);
    tcp_fail_peer(ctx, peer, XCCL_ERR_ABORTED, msg);
}

static void tcp_wait(xccl_tp_ctx_t *ctx, int timeout_ms)
{
    struct pollfd pfd = {.fd = ctx->epfd, .events = POLLIN};

    /* a held-back message is asked about on every pass: no sleeping (the core bounds how
     * long a message is held) */
    if (ctx->ndefer > 0) return;
    (void)poll(&pfd, 1, timeout_ms);
}

/* The core's poll over several transports: the epoll set (sockets and the wake eventfd) is
 * readable whenever tcp_wait would return. */
static int tcp_wait_arm(xccl_tp_ctx_t *ctx, int *fd)
{
    if (ctx->ndefer > 0) return 0;
    *fd = ctx->epfd;
    return 1;
}

const xccl_transport_ops_t xccl_transport_tcp = {
    .abi_version = XCCL_TRANSPORT_ABI_VERSION,
    .name        = "tcp",
    .caps        = XCCL_TP_CAP_HOST_MEM | XCCL_TP_CAP_DEFER,
    .priority    = 10,
    .init        = tcp_init,
    .finalize    = tcp_finalize,
    .reachable   = tcp_reachable,
    .get_addr    = tcp_get_addr,
    .wireup      = tcp_wireup,
    .isend       = tcp_isend,
    .progress    = tcp_progress,
    .wait        = tcp_wait,
    .wait_arm    = tcp_wait_arm,
    .wake        = tcp_wake,
    .close_peer  = tcp_close_peer,
};
