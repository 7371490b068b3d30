/* SPDX-License-Identifier: Apache-2.0
 *
 * store_tcp.c - the TCP store: a server (one background thread, one epoll loop over
 * non-blocking sockets) started by the master, and a client (one connection per store object,
 * requests serialised by a mutex) in every process, the master included.
 *
 * Wire layout (integers big-endian)
 *   request   [u32 TCP_MAGIC][u32 total bytes, header included][u8 command][fields...]
 *   response  [u32 TCP_MAGIC][u32 total bytes, header included][i8 status][fields...]
 *   field     [u32 n][n bytes]   (integers are 8-byte fields)
 *
 *   command      request fields              OK response fields
 *   JOIN         -                           -
 *   SET          key, value                  -
 *   GET          timeout_ms, key             value            (TIMEOUT: -)
 *   ADD          key, delta                  new value
 *   WAIT         timeout_ms, key...          -                (TIMEOUT: missing keys)
 *   CHECK        key...                      u8 all present
 *   COMPARE_SET  key, expected, desired      value now stored (see xccl.h)
 *   DELETE       key                         u8 existed
 *   NUM_KEYS     -                           count
 *   A response with any other negative status carries one field: the server's message.
 *
 * Limits: keys XCCL_STORE_MAX_KEY, values XCCL_STORE_MAX_VALUE, a whole message TCP_MAX_MSG.
 * A request with a wrong magic, a length out of bounds, a field running past its end, extra
 * bytes or an unknown command closes that connection (WARN); nothing else is affected.
 *
 * Blocking requests (GET of a missing key, WAIT) park their connection: the server answers
 * when a write makes the keys appear, or with TIMEOUT at the request's own deadline, so the
 * loop never blocks on a client. A connection with a parked request or unsent output is not
 * read from (back-pressure), so one client holds at most one request and one response.
 *
 * Authentication (with a key): each new connection first runs the auth.h handshake, driven
 * by the loop as a state machine with a deadline of TCP_AUTH_TIMEOUT_MS:
 *   state        waits for                       then
 *   AUTH_HELLO   peer hello (36 bytes)           queue our proof          -> AUTH_PROOF
 *   AUTH_PROOF   peer proof (32 bytes)           right: queue verdict 1   -> AUTH_VERDICT
 *                                                wrong: queue verdict 0, close once sent
 *   AUTH_VERDICT peer verdict (1 byte)           1: -> READY, else close
 * Our hello is queued at accept. Clients run the same exchange with xccl_auth_handshake.
 */
#include "core/store.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/auth.h"
#include "core/check.h"
#include "core/sock.h"

#define TCP_MAGIC           0x58435331u /* "XCS1" */
#define TCP_HDR_LEN         9
#define TCP_MAX_MSG         (XCCL_STORE_MAX_VALUE + 16u * 1024u * 1024u)
#define TCP_AUTH_TIMEOUT_MS 10000
#define TCP_AUTH_CONTEXT    "xccl-store"
/* How long a client waits for a GET/WAIT answer beyond the request's own timeout (the server
 * answers TIMEOUT itself at the deadline; this only covers a server that stopped answering). */
#define TCP_REPLY_GRACE_MS  5000
/* A client's first reply buffer; it grows as more of a longer reply arrives. */
#define CLIENT_BUF_FIRST    (64u * 1024u)

enum {
    CMD_JOIN = 1,
    CMD_SET,
    CMD_GET,
    CMD_ADD,
    CMD_WAIT,
    CMD_CHECK,
    CMD_COMPARE_SET,
    CMD_DELETE,
    CMD_NUM_KEYS,
};

static const char *cmd_name(int cmd)
{
    static const char *names[] = {"?",     "join",  "set",         "get",    "add",
                                  "wait",  "check", "compare_set", "delete", "num_keys"};
    return cmd >= 0 && cmd <= CMD_NUM_KEYS ? names[cmd] : "?";
}

static void put_be32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (24 - 8 * i));
}

static uint32_t get_be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static void put_be64(uint8_t *p, uint64_t v)
{
    put_be32(p, (uint32_t)(v >> 32));
    put_be32(p + 4, (uint32_t)v);
}

static uint64_t get_be64(const uint8_t *p)
{
    return (uint64_t)get_be32(p) << 32 | get_be32(p + 4);
}

static int64_t deadline_after(int64_t timeout_ms)
{
    int64_t now = xccl_now_ms();

    if (timeout_ms < 0) timeout_ms = 0;
    return timeout_ms > INT64_MAX - now ? INT64_MAX : now + timeout_ms;
}

/* ---------------------------------------------------------------------------------------------
 * Message buffers: a growable byte buffer with a message being built at `start`.
 * ------------------------------------------------------------------------------------------- */

typedef struct buf {
    uint8_t *p;
    size_t   len, cap;
    size_t   start; /* offset of the message being built */
    int      oom;   /* an append failed; the message is unusable */
} buf_t;

static void buf_put(buf_t *b, const void *p, size_t n)
{
    if (b->oom) return;
    if (b->len + n > b->cap) {
        size_t   cap = b->cap ? b->cap : 256;
        uint8_t *q;
        while (cap < b->len + n) cap *= 2;
        q = realloc(b->p, cap);
        if (q == NULL) {
            b->oom = 1;
            return;
        }
        b->p   = q;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->len, p, n);
    b->len += n;
}

static void msg_begin(buf_t *b, int8_t code)
{
    uint8_t hdr[TCP_HDR_LEN];

    b->start = b->len;
    put_be32(hdr, TCP_MAGIC);
    put_be32(hdr + 4, 0);
    hdr[8] = (uint8_t)code;
    buf_put(b, hdr, sizeof(hdr));
}

static void msg_field(buf_t *b, const void *p, size_t n)
{
    uint8_t len[4];

    put_be32(len, (uint32_t)n);
    buf_put(b, len, 4);
    buf_put(b, p, n);
}

static void msg_i64(buf_t *b, int64_t v)
{
    uint8_t x[8];

    put_be64(x, (uint64_t)v);
    msg_field(b, x, 8);
}

/* Patches the total length; 0 if the message is complete and within TCP_MAX_MSG. */
static int msg_end(buf_t *b)
{
    size_t n = b->len - b->start;

    if (b->oom || n > TCP_MAX_MSG) return -1;
    put_be32(b->p + b->start + 4, (uint32_t)n);
    return 0;
}

/* Reader over the fields of one message. */
typedef struct rd {
    const uint8_t *p;
    size_t         n;
} rd_t;

static int rd_field(rd_t *r, const uint8_t **f, size_t *flen, size_t max)
{
    uint32_t len;

    if (r->n < 4) return -1;
    len = get_be32(r->p);
    if (len > max || r->n - 4 < len) return -1;
    *f    = r->p + 4;
    *flen = len;
    r->p += 4 + (size_t)len;
    r->n -= 4 + (size_t)len;
    return 0;
}

static int rd_i64(rd_t *r, int64_t *v)
{
    const uint8_t *f;
    size_t         n;

    if (rd_field(r, &f, &n, 8) != 0 || n != 8) return -1;
    *v = (int64_t)get_be64(f);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Server
 * ------------------------------------------------------------------------------------------- */

enum { ST_AUTH_HELLO, ST_AUTH_PROOF, ST_AUTH_VERDICT, ST_READY };

/* Connection buffers above this are given back once used (a large value passed through). */
#define CONN_BUF_KEEP (1u << 20)

typedef struct conn {
    struct conn *next, *prev; /* srv->conns, or srv->dead once closed */
    int          fd;
    int          state;
    int          dead;
    int          close_after_flush;
    int          parked;        /* a GET/WAIT at the head of `in` waits for keys         */
    int64_t      deadline;      /* of the handshake, or of the parked request            */
    uint32_t     events;        /* current epoll interest                                */
    uint8_t      nonce[XCCL_NONCE_LEN];
    uint8_t      peer_nonce[XCCL_NONCE_LEN];
    buf_t        in;            /* bytes received, not yet consumed                      */
    buf_t        out;           /* bytes to send                                         */
    size_t       out_sent;      /* of which sent                                         */
    char         name[64];      /* peer address, for messages                            */
} conn_t;

typedef struct tcp_server {
    pthread_t       thread;
    int             lfd;
    int             epfd;
    int             wake[2];      /* pipe: the owner writes a byte to stop the loop        */
    uint8_t        *key;          /* NULL: no authentication                               */
    size_t          keylen;
    xccl_sockaddr_t addr;         /* bound address                                        */
    char            addr_str[80];
    conn_t         *conns;
    conn_t         *dead;         /* closed during this loop iteration; freed at its end   */
    xccl_kvmap_t    map;
    int             keys_changed; /* parked requests may be satisfiable                   */
    int64_t         accept_paused_until; /* after EMFILE; 0 when accepting                */
    /* shared with the owner thread */
    pthread_mutex_t mu;
    pthread_cond_t  cond;
    int             joined;       /* JOIN requests served                                 */
    int             running;
    int             auth_failed;  /* clients that failed authentication ...               */
    char            auth_failed_name[64]; /* ... and the address of the last one          */
} tcp_server_t;

/* Tags for the two non-connection fds in epoll_event.data.ptr. */
static int listen_tag;
static int wake_tag;

static void conn_set_events(tcp_server_t *srv, conn_t *c)
{
    uint32_t           want = EPOLLRDHUP;
    struct epoll_event ev;
    int                pending = c->out.len > c->out_sent;

    if (c->dead) return;
    if (pending) want |= EPOLLOUT;
    /* read during the handshake; afterwards only when idle (back-pressure) */
    if (!c->close_after_flush &&
        (c->state != ST_READY || (!c->parked && !pending)))
        want |= EPOLLIN;
    if (want == c->events) return;
    ev.events   = want;
    ev.data.ptr = c;
    if (epoll_ctl(srv->epfd, EPOLL_CTL_MOD, c->fd, &ev) == 0) c->events = want;
}

static void conn_close(tcp_server_t *srv, conn_t *c)
{
    if (c->dead) return;
    epoll_ctl(srv->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->fd   = -1;
    c->dead = 1;
    if (c->prev) c->prev->next = c->next;
    else srv->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    c->prev   = NULL;
    c->next   = srv->dead;
    srv->dead = c;
}

static void conn_free(conn_t *c)
{
    free(c->in.p);
    free(c->out.p);
    free(c);
}

/* Sends what it can without blocking. */
static void conn_flush(tcp_server_t *srv, conn_t *c)
{
    while (!c->dead && c->out.len > c->out_sent) {
        ssize_t n = send(c->fd, c->out.p + c->out_sent, c->out.len - c->out_sent,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            c->out_sent += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        XCCL_INFO("TCP store server %s: send to %s failed: %s; connection closed",
                  srv->addr_str, c->name, n < 0 ? strerror(errno) : "no progress");
        conn_close(srv, c);
        return;
    }
    if (c->out.len == c->out_sent) {
        c->out.len  = 0;
        c->out_sent = 0;
        if (c->out.cap > CONN_BUF_KEEP) {
            free(c->out.p);
            c->out.p   = NULL;
            c->out.cap = 0;
        }
        if (c->close_after_flush) {
            conn_close(srv, c);
            return;
        }
    }
    conn_set_events(srv, c);
}

static void conn_consume(conn_t *c, size_t n)
{
    memmove(c->in.p, c->in.p + n, c->in.len - n);
    c->in.len -= n;
    if (c->in.cap > CONN_BUF_KEEP && c->in.len < CONN_BUF_KEEP / 2) {
        uint8_t *q = realloc(c->in.p, CONN_BUF_KEEP / 2);
        if (q != NULL) {
            c->in.p   = q;
            c->in.cap = CONN_BUF_KEEP / 2;
        }
    }
}

static void reply_end(tcp_server_t *srv, conn_t *c)
{
    if (msg_end(&c->out) != 0) {
        XCCL_WARN("TCP store server %s: cannot build the reply to %s (out of memory or over "
                  "%u bytes); connection closed",
                  srv->addr_str, c->name, TCP_MAX_MSG);
        conn_close(srv, c);
    }
}

/* Replies with the server thread's last error message. */
static void reply_error(tcp_server_t *srv, conn_t *c, xccl_status_t st)
{
    const char *msg = xccl_last_error();

    msg_begin(&c->out, (int8_t)st);
    msg_field(&c->out, msg, strlen(msg));
    reply_end(srv, c);
}

static void reply_ok(tcp_server_t *srv, conn_t *c)
{
    msg_begin(&c->out, XCCL_OK);
    reply_end(srv, c);
}

enum { REQ_DONE, REQ_PARKED, REQ_BAD };

/* Serves the request at the head of c->in (body = command byte and fields, blen bytes). For
 * a GET/WAIT whose keys are missing: REQ_PARKED until c->deadline, then a TIMEOUT reply. */
static int serve(tcp_server_t *srv, conn_t *c, const uint8_t *body, size_t blen)
{
    rd_t           r = {body + 1, blen - 1};
    const uint8_t *key, *val, *exp;
    size_t         klen, vlen, elen;
    int64_t        x;
    xccl_status_t  st;
    int            cmd = body[0];

    switch (cmd) {
    case CMD_JOIN:
        if (r.n != 0) return REQ_BAD;
        pthread_mutex_lock(&srv->mu);
        srv->joined++;
        pthread_cond_broadcast(&srv->cond);
        pthread_mutex_unlock(&srv->mu);
        reply_ok(srv, c);
        return REQ_DONE;

    case CMD_SET:
        if (rd_field(&r, &key, &klen, XCCL_STORE_MAX_KEY) || rd_field(&r, &val, &vlen,
                                                                       XCCL_STORE_MAX_VALUE) ||
            r.n != 0)
            return REQ_BAD;
        st = xccl_kvmap_set(&srv->map, (const char *)key, klen, val, vlen);
        if (st != XCCL_OK) reply_error(srv, c, st);
        else reply_ok(srv, c);
        srv->keys_changed = 1;
        return REQ_DONE;

    case CMD_GET: {
        xccl_kv_entry_t *e;
        if (rd_i64(&r, &x) || rd_field(&r, &key, &klen, XCCL_STORE_MAX_KEY) || r.n != 0)
            return REQ_BAD;
        e = xccl_kvmap_find(&srv->map, (const char *)key, klen);
        if (e != NULL) {
            msg_begin(&c->out, XCCL_OK);
            msg_field(&c->out, e->val, e->vlen);
            reply_end(srv, c);
            return REQ_DONE;
        }
        if (!c->parked) c->deadline = deadline_after(x);
        if (xccl_now_ms() < c->deadline) return REQ_PARKED;
        msg_begin(&c->out, XCCL_ERR_TIMEOUT);
        reply_end(srv, c);
        return REQ_DONE;
    }

    case CMD_ADD:
        if (rd_field(&r, &key, &klen, XCCL_STORE_MAX_KEY) || rd_i64(&r, &x) || r.n != 0)
            return REQ_BAD;
        {
            int64_t sum;
            st = xccl_kvmap_add(&srv->map, (const char *)key, klen, x, &sum);
            if (st != XCCL_OK) {
                reply_error(srv, c, st);
                return REQ_DONE;
            }
            msg_begin(&c->out, XCCL_OK);
            msg_i64(&c->out, sum);
            reply_end(srv, c);
        }
        srv->keys_changed = 1;
        return REQ_DONE;

    case CMD_WAIT:
    case CMD_CHECK: {
        size_t nmissing = 0;
        rd_t   keys;
        if (cmd == CMD_WAIT && rd_i64(&r, &x)) return REQ_BAD;
        keys = r;
        while (r.n > 0) {
            if (rd_field(&r, &key, &klen, XCCL_STORE_MAX_KEY)) return REQ_BAD;
            nmissing += xccl_kvmap_find(&srv->map, (const char *)key, klen) == NULL;
        }
        if (cmd == CMD_CHECK) {
            uint8_t all = nmissing == 0;
            msg_begin(&c->out, XCCL_OK);
            msg_field(&c->out, &all, 1);
            reply_end(srv, c);
            return REQ_DONE;
        }
        if (nmissing == 0) {
            reply_ok(srv, c);
            return REQ_DONE;
        }
        if (!c->parked) c->deadline = deadline_after(x);
        if (xccl_now_ms() < c->deadline) return REQ_PARKED;
        msg_begin(&c->out, XCCL_ERR_TIMEOUT);
        while (keys.n > 0) {
            rd_field(&keys, &key, &klen, XCCL_STORE_MAX_KEY);
            if (xccl_kvmap_find(&srv->map, (const char *)key, klen) == NULL)
                msg_field(&c->out, key, klen);
        }
        reply_end(srv, c);
        return REQ_DONE;
    }

    case CMD_COMPARE_SET: {
        void  *now;
        size_t nowlen;
        int    changed;
        if (rd_field(&r, &key, &klen, XCCL_STORE_MAX_KEY) ||
            rd_field(&r, &exp, &elen, XCCL_STORE_MAX_VALUE) ||
            rd_field(&r, &val, &vlen, XCCL_STORE_MAX_VALUE) || r.n != 0)
            return REQ_BAD;
        st = xccl_kvmap_compare_set(&srv->map, (const char *)key, klen, exp, elen, val, vlen,
                                    &now, &nowlen, &changed);
        if (st != XCCL_OK) {
            reply_error(srv, c, st);
            return REQ_DONE;
        }
        msg_begin(&c->out, XCCL_OK);
        msg_field(&c->out, now, nowlen);
        reply_end(srv, c);
        free(now);
        if (changed) srv->keys_changed = 1;
        return REQ_DONE;
    }

    case CMD_DELETE: {
        uint8_t existed;
        if (rd_field(&r, &key, &klen, XCCL_STORE_MAX_KEY) || r.n != 0) return REQ_BAD;
        existed = (uint8_t)xccl_kvmap_delete(&srv->map, (const char *)key, klen);
        msg_begin(&c->out, XCCL_OK);
        msg_field(&c->out, &existed, 1);
        reply_end(srv, c);
        return REQ_DONE;
    }

    case CMD_NUM_KEYS:
        if (r.n != 0) return REQ_BAD;
        msg_begin(&c->out, XCCL_OK);
        msg_i64(&c->out, (int64_t)srv->map.count);
        reply_end(srv, c);
        return REQ_DONE;
    }
    return REQ_BAD;
}

/* Validates the header at the head of c->in once it is there. Returns the message length,
 * 0 if more bytes are needed, -1 if the connection must be dropped. */
static int64_t head_len(tcp_server_t *srv, conn_t *c)
{
    uint32_t magic, len;

    if (c->in.len < TCP_HDR_LEN) return 0;
    magic = get_be32(c->in.p);
    len   = get_be32(c->in.p + 4);
    if (magic != TCP_MAGIC || len < TCP_HDR_LEN || len > TCP_MAX_MSG) {
        XCCL_WARN("TCP store server %s: client %s sent a malformed request header (magic "
                  "0x%08x, length %u); connection closed",
                  srv->addr_str, c->name, magic, len);
        return -1;
    }
    return len;
}

/* Serves requests at the head of c->in while the connection is idle. */
static void conn_process(tcp_server_t *srv, conn_t *c)
{
    while (!c->dead && c->state == ST_READY && !c->parked && c->out.len == 0) {
        int64_t len = head_len(srv, c);
        int     rc;

        if (len < 0) {
            conn_close(srv, c);
            return;
        }
        if (len == 0 || c->in.len < (size_t)len) break;
        rc = serve(srv, c, c->in.p + 8, (size_t)len - 8);
        if (rc == REQ_BAD) {
            XCCL_WARN("TCP store server %s: client %s sent a malformed or unknown request "
                      "(command %d '%s', %" PRId64 " bytes); connection closed",
                      srv->addr_str, c->name, c->in.p[8], cmd_name(c->in.p[8]), len);
            conn_close(srv, c);
            return;
        }
        if (rc == REQ_PARKED) {
            c->parked = 1;
            break;
        }
        conn_consume(c, (size_t)len);
        if (!c->dead) conn_flush(srv, c);
    }
    conn_set_events(srv, c);
}

/* Retries a parked request (keys changed or its deadline passed). */
static void conn_retry(tcp_server_t *srv, conn_t *c)
{
    size_t len = get_be32(c->in.p + 4);
    int    rc  = serve(srv, c, c->in.p + 8, len - 8);

    if (rc == REQ_PARKED) return;
    c->parked = 0;
    if (rc == REQ_BAD) {
        conn_close(srv, c);
        return;
    }
    conn_consume(c, len);
    if (!c->dead) conn_flush(srv, c);
    if (!c->dead) conn_process(srv, c);
}

/* Advances the handshake with the bytes in c->in. */
static void conn_auth(tcp_server_t *srv, conn_t *c)
{
    uint8_t proof[XCCL_SHA256_LEN];
    uint8_t verdict;

    if (c->state == ST_AUTH_HELLO && c->in.len >= XCCL_AUTH_HELLO_LEN) {
        if (get_be32(c->in.p) != XCCL_AUTH_MAGIC ||
            memcmp(c->in.p + 4, c->nonce, XCCL_NONCE_LEN) == 0) {
            XCCL_WARN("TCP store server %s: client %s did not start the authentication "
                      "handshake (no key, or not an xccl client); connection closed",
                      srv->addr_str, c->name);
            conn_close(srv, c);
            return;
        }
        memcpy(c->peer_nonce, c->in.p + 4, XCCL_NONCE_LEN);
        conn_consume(c, XCCL_AUTH_HELLO_LEN);
        xccl_auth_proof(srv->key, srv->keylen, XCCL_AUTH_ROLE_SERVER, c->nonce, c->peer_nonce,
                        TCP_AUTH_CONTEXT, strlen(TCP_AUTH_CONTEXT), proof);
        buf_put(&c->out, proof, sizeof(proof));
        c->state = ST_AUTH_PROOF;
    }
    if (c->state == ST_AUTH_PROOF && c->in.len >= XCCL_SHA256_LEN) {
        xccl_auth_proof(srv->key, srv->keylen, XCCL_AUTH_ROLE_CLIENT, c->peer_nonce, c->nonce,
                        TCP_AUTH_CONTEXT, strlen(TCP_AUTH_CONTEXT), proof);
        verdict = (uint8_t)xccl_ct_equal(proof, c->in.p, sizeof(proof));
        conn_consume(c, XCCL_SHA256_LEN);
        buf_put(&c->out, &verdict, 1);
        if (!verdict) {
            XCCL_WARN("TCP store server %s: client %s failed authentication (wrong key?); "
                      "connection closed",
                      srv->addr_str, c->name);
            pthread_mutex_lock(&srv->mu); /* for the timeout message of wait_workers */
            srv->auth_failed++;
            snprintf(srv->auth_failed_name, sizeof(srv->auth_failed_name), "%s", c->name);
            pthread_mutex_unlock(&srv->mu);
            c->close_after_flush = 1;
        } else {
            c->state = ST_AUTH_VERDICT;
        }
    }
    if (c->state == ST_AUTH_VERDICT && c->in.len >= 1) {
        if (c->in.p[0] != 1) {
            XCCL_WARN("TCP store server %s: client %s rejected the server's proof (different "
                      "key?); connection closed",
                      srv->addr_str, c->name);
            conn_close(srv, c);
            return;
        }
        conn_consume(c, 1);
        c->state = ST_READY;
    }
    if (c->out.oom) {
        conn_close(srv, c);
        return;
    }
    conn_flush(srv, c);
}

/* Reads what is available (bounded: the buffer only grows to hold the message at its head). */
static void conn_read(tcp_server_t *srv, conn_t *c)
{
    for (;;) {
        size_t  need = 4096;
        ssize_t n;

        if (c->state == ST_READY) {
            int64_t len = head_len(srv, c);
            if (len < 0) {
                conn_close(srv, c);
                return;
            }
            if (len > 0 && c->in.len >= (size_t)len) break; /* a whole request is here */
            if (len > 0) need = (size_t)len - c->in.len;
        }
        if (c->in.len == c->in.cap) {
            /* at most double what has arrived, so a peer announcing 1 GiB must send it */
            size_t   cap = c->in.cap ? c->in.cap * 2 : 4096;
            size_t   max = c->in.len + need > 4096 ? c->in.len + need : 4096;
            uint8_t *q   = realloc(c->in.p, cap < max ? cap : max);
            if (q == NULL) {
                XCCL_WARN("TCP store server %s: out of memory reading from %s; connection "
                          "closed",
                          srv->addr_str, c->name);
                conn_close(srv, c);
                return;
            }
            c->in.p   = q;
            c->in.cap = cap < max ? cap : max;
        }
        n = recv(c->fd, c->in.p + c->in.len, c->in.cap - c->in.len, MSG_DONTWAIT);
        if (n > 0) {
            c->in.len += (size_t)n;
            if (c->state != ST_READY) break;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (c->in.len > 0 && c->state == ST_READY)
            XCCL_WARN("TCP store server %s: client %s closed the connection in the middle of a "
                      "request (%zu bytes received)",
                      srv->addr_str, c->name, c->in.len);
        else
            XCCL_INFO("TCP store server %s: client %s disconnected", srv->addr_str, c->name);
        conn_close(srv, c);
        return;
    }
}

static void conn_event(tcp_server_t *srv, conn_t *c, uint32_t ev)
{
    if (ev & EPOLLOUT) {
        conn_flush(srv, c);
        if (!c->dead) conn_process(srv, c); /* requests that waited for the output to drain */
    }
    if (c->dead) return;
    if (ev & EPOLLIN) {
        conn_read(srv, c);
        if (c->dead) return;
        if (c->state != ST_READY) conn_auth(srv, c);
        if (!c->dead) conn_process(srv, c);
    } else if (ev & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
        /* gone while parked or while we were not reading */
        XCCL_INFO("TCP store server %s: client %s disconnected", srv->addr_str, c->name);
        conn_close(srv, c);
    }
}

static void server_accept(tcp_server_t *srv)
{
    for (;;) {
        xccl_sockaddr_t    peer;
        struct epoll_event ev;
        conn_t            *c;
        int                one = 1;
        int                fd;

        peer.len = sizeof(peer.ss);
        fd = accept4(srv->lfd, (struct sockaddr *)&peer.ss, &peer.len,
                     SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return;
            XCCL_WARN("TCP store server %s: accept failed: %s; pausing accepts for 100 ms",
                      srv->addr_str, strerror(errno));
            epoll_ctl(srv->epfd, EPOLL_CTL_DEL, srv->lfd, NULL);
            srv->accept_paused_until = xccl_now_ms() + 100;
            return;
        }
        (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        c = calloc(1, sizeof(*c));
        if (c == NULL) {
            close(fd);
            continue;
        }
        c->fd = fd;
        xccl_sock_str(&peer, c->name, sizeof(c->name));
        c->state = srv->key ? ST_AUTH_HELLO : ST_READY;
        if (srv->key) {
            uint8_t magic[4];
            c->deadline = xccl_now_ms() + TCP_AUTH_TIMEOUT_MS;
            put_be32(magic, XCCL_AUTH_MAGIC);
            if (xccl_random_bytes(c->nonce, sizeof(c->nonce)) != XCCL_OK) {
                close(fd);
                free(c);
                continue;
            }
            buf_put(&c->out, magic, 4);
            buf_put(&c->out, c->nonce, sizeof(c->nonce));
        }
        c->events   = EPOLLIN | EPOLLRDHUP;
        ev.events   = c->events;
        ev.data.ptr = c;
        if (c->out.oom || epoll_ctl(srv->epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
            close(fd);
            conn_free(c);
            continue;
        }
        c->next = srv->conns;
        if (srv->conns) srv->conns->prev = c;
        srv->conns = c;
        XCCL_INFO("TCP store server %s: connection from %s", srv->addr_str, c->name);
        conn_flush(srv, c);
    }
}

/* Answers parked requests whose keys appeared or whose deadline passed, closes handshakes
 * past theirs, and returns the epoll timeout until the next deadline. */
static int server_deadlines(tcp_server_t *srv)
{
    int64_t now     = xccl_now_ms();
    int64_t next    = now + 1000;
    int     changed = srv->keys_changed;
    conn_t *c, *n;

    do {
        srv->keys_changed = 0;
        for (c = srv->conns; c != NULL; c = n) {
            n = c->next; /* c may move to srv->dead, never n */
            if (c->parked && (changed || now >= c->deadline)) conn_retry(srv, c);
        }
        changed = srv->keys_changed;
    } while (changed);
    for (c = srv->conns; c != NULL; c = n) {
        n = c->next;
        if (c->state != ST_READY && now >= c->deadline) {
            XCCL_WARN("TCP store server %s: client %s did not finish the authentication "
                      "handshake within %d ms; connection closed",
                      srv->addr_str, c->name, TCP_AUTH_TIMEOUT_MS);
            conn_close(srv, c);
            continue;
        }
        if ((c->parked || c->state != ST_READY) && c->deadline < next) next = c->deadline;
    }
    if (srv->accept_paused_until && srv->accept_paused_until < next)
        next = srv->accept_paused_until;
    return next <= now ? 0 : (int)(next - now);
}

static void *server_main(void *arg)
{
    tcp_server_t      *srv = arg;
    struct epoll_event evs[64];
    int                stop = 0;

    while (!stop) {
        int timeout = server_deadlines(srv);
        int n, i;

        while (srv->dead) {
            conn_t *c = srv->dead;
            srv->dead = c->next;
            conn_free(c);
        }
        if (srv->accept_paused_until && xccl_now_ms() >= srv->accept_paused_until) {
            struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &listen_tag};
            srv->accept_paused_until = 0;
            epoll_ctl(srv->epfd, EPOLL_CTL_ADD, srv->lfd, &ev);
        }
        n = epoll_wait(srv->epfd, evs, 64, timeout);
        if (n < 0) {
            if (errno == EINTR) continue;
            XCCL_WARN("TCP store server %s: epoll_wait failed: %s; server stopped",
                      srv->addr_str, strerror(errno));
            break;
        }
        for (i = 0; i < n; i++) {
            void *p = evs[i].data.ptr;
            if (p == &wake_tag) {
                char b[16];
                while (read(srv->wake[0], b, sizeof(b)) > 0) {
                }
                pthread_mutex_lock(&srv->mu);
                stop = !srv->running;
                pthread_mutex_unlock(&srv->mu);
            } else if (p == &listen_tag) {
                server_accept(srv);
            } else if (!((conn_t *)p)->dead) {
                conn_event(srv, p, evs[i].events);
            }
        }
    }
    return NULL;
}

static void server_free(tcp_server_t *srv)
{
    conn_t *c;

    while ((c = srv->conns) != NULL) conn_close(srv, c);
    while ((c = srv->dead) != NULL) {
        srv->dead = c->next;
        conn_free(c);
    }
    if (srv->lfd >= 0) close(srv->lfd);
    if (srv->epfd >= 0) close(srv->epfd);
    if (srv->wake[0] >= 0) close(srv->wake[0]);
    if (srv->wake[1] >= 0) close(srv->wake[1]);
    xccl_kvmap_free(&srv->map);
    pthread_cond_destroy(&srv->cond);
    pthread_mutex_destroy(&srv->mu);
    free(srv->key);
    free(srv);
}

static void server_stop(tcp_server_t *srv)
{
    char b = 1;

    pthread_mutex_lock(&srv->mu);
    srv->running = 0;
    pthread_mutex_unlock(&srv->mu);
    while (write(srv->wake[1], &b, 1) < 0 && errno == EINTR) {
    }
    pthread_join(srv->thread, NULL);
    server_free(srv);
}

static xccl_status_t server_start(const char *host, int port, const void *key, size_t keylen,
                                  tcp_server_t **out)
{
    tcp_server_t      *srv = calloc(1, sizeof(*srv));
    pthread_condattr_t ca;
    struct epoll_event ev;
    xccl_status_t      st;
    int                rc;

    if (srv == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "TCP store: server state");
    srv->lfd = srv->epfd = srv->wake[0] = srv->wake[1] = -1;
    xccl_kvmap_init(&srv->map);
    pthread_mutex_init(&srv->mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&srv->cond, &ca);
    pthread_condattr_destroy(&ca);
    if (key != NULL && keylen > 0) {
        srv->key = xccl_store_memdup(key, keylen);
        if (srv->key == NULL) {
            st = XCCL_ERROR(XCCL_ERR_NO_MEMORY, "TCP store: key");
            goto fail;
        }
        srv->keylen = keylen;
    }
    XCCL_CHECK_GOTO(xccl_sock_resolve(host, port, &srv->addr), st, fail);
    XCCL_CHECK_GOTO(xccl_sock_listen(&srv->addr, &srv->lfd), st, fail);
    xccl_sock_str(&srv->addr, srv->addr_str, sizeof(srv->addr_str));
    srv->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (xccl_sock_set_nonblock(srv->lfd, 1) != 0 || srv->epfd < 0 ||
        pipe2(srv->wake, O_CLOEXEC | O_NONBLOCK) != 0) {
        st = XCCL_ERROR(XCCL_ERR_SYSTEM, "TCP store server %s: setup failed: %s",
                        srv->addr_str, strerror(errno));
        goto fail;
    }
    ev.events   = EPOLLIN;
    ev.data.ptr = &listen_tag;
    rc          = epoll_ctl(srv->epfd, EPOLL_CTL_ADD, srv->lfd, &ev);
    ev.data.ptr = &wake_tag;
    if (rc != 0 || epoll_ctl(srv->epfd, EPOLL_CTL_ADD, srv->wake[0], &ev) != 0) {
        st = XCCL_ERROR(XCCL_ERR_SYSTEM, "TCP store server %s: epoll_ctl failed: %s",
                        srv->addr_str, strerror(errno));
        goto fail;
    }
    srv->running = 1;
    rc           = pthread_create(&srv->thread, NULL, server_main, srv);
    if (rc != 0) {
        st = XCCL_ERROR(XCCL_ERR_SYSTEM, "TCP store server %s: pthread_create failed: %s",
                        srv->addr_str, strerror(rc));
        goto fail;
    }
    XCCL_INFO("TCP store server listening on %s%s", srv->addr_str,
              srv->key ? " (authentication on)" : "");
    *out = srv;
    return XCCL_OK;
fail:
    server_free(srv);
    return st;
}

/* ---------------------------------------------------------------------------------------------
 * Client
 * ------------------------------------------------------------------------------------------- */

typedef struct tcp_store {
    xccl_store_t    base;
    pthread_mutex_t lock;   /* one request at a time on fd                                */
    int             fd;     /* -1 once the connection is lost or out of step              */
    int             port;
    char            server_str[80];
    tcp_server_t   *server; /* the master's server, else NULL                             */
} tcp_store_t;

/* Adds "TCP store <server>: <op>('key')" in front of the message a lower layer reported,
 * without logging it a second time. */
static xccl_status_t with_context(tcp_store_t *t, xccl_status_t st, const char *op,
                                  const char *key)
{
    char inner[1024];

    snprintf(inner, sizeof(inner), "%s", xccl_last_error());
    return xccl_error_set(st, "TCP store %s: %s%s%.128s%s failed: %s", t->server_str, op,
                          key ? "('" : "", key ? key : "", key ? "')" : "", inner);
}

static void client_drop(tcp_store_t *t)
{
    if (t->fd >= 0) close(t->fd);
    t->fd = -1;
}

/* Sends the request in b and receives the response into *resp (malloc'd, *rlen bytes, header
 * included). With t->lock held. Any I/O failure leaves the connection unusable. */
static xccl_status_t client_call(tcp_store_t *t, buf_t *b, int64_t deadline_ms, const char *op,
                                 const char *key, uint8_t **resp, size_t *rlen)
{
    uint8_t       hdr[TCP_HDR_LEN];
    uint32_t      len;
    uint8_t      *p = NULL;
    size_t        cap, got;
    xccl_status_t st;

    *resp = NULL;
    if (msg_end(b) != 0)
        return XCCL_ERROR(b->oom ? XCCL_ERR_NO_MEMORY : XCCL_ERR_INVALID_ARG,
                          "TCP store %s: %s('%.128s'): request of %zu bytes %s", t->server_str,
                          op, key ? key : "", b->len,
                          b->oom ? "does not fit in memory" : "exceeds the protocol limit");
    if (t->fd < 0)
        return XCCL_ERROR(XCCL_ERR_REMOTE,
                          "TCP store %s: %s: the connection to the server was lost by an "
                          "earlier operation",
                          t->server_str, op);
    st = xccl_sock_send_all(t->fd, b->p, b->len, deadline_ms);
    if (st == XCCL_OK) st = xccl_sock_recv_all(t->fd, hdr, sizeof(hdr), deadline_ms);
    if (st != XCCL_OK) {
        client_drop(t);
        return with_context(t, st, op, key);
    }
    len = get_be32(hdr + 4);
    if (get_be32(hdr) != TCP_MAGIC || len < TCP_HDR_LEN || len > TCP_MAX_MSG) {
        client_drop(t);
        return XCCL_ERROR(XCCL_ERR_REMOTE,
                          "TCP store %s: %s: malformed reply from the server (magic 0x%08x, "
                          "length %u); does the server expect an auth key?",
                          t->server_str, op, get_be32(hdr), len);
    }
    /* The buffer grows with what arrives (at most doubling), as the server's does: a reply
     * header announcing 1 GiB costs memory only once the bytes are there. */
    cap = len < CLIENT_BUF_FIRST ? len : CLIENT_BUF_FIRST;
    p   = malloc(cap);
    if (p == NULL) goto oom;
    memcpy(p, hdr, sizeof(hdr));
    for (got = TCP_HDR_LEN; got < len; got = cap) {
        if (got == cap) {
            uint8_t *q;
            cap = len - cap < cap ? len : 2 * cap;
            q   = realloc(p, cap);
            if (q == NULL) goto oom;
            p = q;
        }
        st = xccl_sock_recv_all(t->fd, p + got, cap - got, deadline_ms);
        if (st != XCCL_OK) {
            free(p);
            client_drop(t);
            return with_context(t, st, op, key);
        }
    }
    *resp = p;
    *rlen = len;
    return XCCL_OK;
oom:
    free(p);
    client_drop(t);
    return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "TCP store %s: reply of %u bytes", t->server_str, len);
}

/* Turns a non-OK response status into an error (ERROR responses carry the server's text). */
static xccl_status_t client_status(tcp_store_t *t, const uint8_t *resp, size_t rlen,
                                   const char *op, const char *key)
{
    int8_t         code = (int8_t)resp[8];
    rd_t           r    = {resp + TCP_HDR_LEN, rlen - TCP_HDR_LEN};
    const uint8_t *msg  = (const uint8_t *)"";
    size_t         mlen = 0;

    if (code == XCCL_OK) return XCCL_OK;
    if (code > 0 || code < XCCL_ERR_AUTH) code = XCCL_ERR_REMOTE;
    rd_field(&r, &msg, &mlen, TCP_MAX_MSG);
    return XCCL_ERROR((xccl_status_t)code, "TCP store %s: %s%s%.128s%s failed on the server: %.*s",
                      t->server_str, op, key ? "('" : "", key ? key : "", key ? "')" : "",
                      (int)(mlen > 1024 ? 1024 : mlen), (const char *)msg);
}

static xccl_status_t bad_reply(tcp_store_t *t, const char *op)
{
    pthread_mutex_lock(&t->lock);
    client_drop(t);
    pthread_mutex_unlock(&t->lock);
    return XCCL_ERROR(XCCL_ERR_REMOTE, "TCP store %s: %s: malformed reply from the server",
                      t->server_str, op);
}

/* One request/response under the lock; frees the request. On XCCL_OK, *resp is the response
 * (the caller frees it) and `fields` its fields. A TIMEOUT response (GET/WAIT only, with
 * can_time_out) also returns XCCL_ERR_TIMEOUT with *resp set, for the caller to describe.
 * Every other failure is reported here and leaves *resp NULL. */
static xccl_status_t client_rpc(tcp_store_t *t, buf_t *b, int64_t deadline_ms, const char *op,
                                const char *key, int can_time_out, uint8_t **resp, rd_t *fields)
{
    size_t        rlen = 0;
    xccl_status_t st;

    pthread_mutex_lock(&t->lock);
    st = client_call(t, b, deadline_ms, op, key, resp, &rlen);
    if (st == XCCL_OK && (int8_t)(*resp)[8] == XCCL_ERR_TIMEOUT && !can_time_out) {
        free(*resp);
        *resp = NULL;
        client_drop(t);
        st = XCCL_ERROR(XCCL_ERR_REMOTE, "TCP store %s: %s: unexpected TIMEOUT reply",
                        t->server_str, op);
    }
    pthread_mutex_unlock(&t->lock);
    free(b->p);
    if (st != XCCL_OK) return st;
    fields->p = *resp + TCP_HDR_LEN;
    fields->n = rlen - TCP_HDR_LEN;
    if ((int8_t)(*resp)[8] == XCCL_ERR_TIMEOUT) return XCCL_ERR_TIMEOUT;
    st = client_status(t, *resp, rlen, op, key);
    if (st != XCCL_OK) {
        free(*resp);
        *resp = NULL;
    }
    return st;
}

static int64_t op_deadline(const tcp_store_t *t)
{
    return deadline_after(xccl_store_get_timeout(&t->base));
}

static int64_t wait_deadline(int64_t timeout_ms)
{
    return deadline_after(timeout_ms > INT64_MAX - TCP_REPLY_GRACE_MS
                              ? INT64_MAX - TCP_REPLY_GRACE_MS
                              : timeout_ms + TCP_REPLY_GRACE_MS);
}

static xccl_status_t tcp_set(xccl_store_t *s, const char *key, const void *val, size_t len)
{
    tcp_store_t  *t = (tcp_store_t *)s;
    buf_t         b = {0};
    uint8_t      *resp;
    rd_t          f;
    xccl_status_t st;

    msg_begin(&b, CMD_SET);
    msg_field(&b, key, strlen(key));
    msg_field(&b, val, len);
    st = client_rpc(t, &b, op_deadline(t), "set", key, 0, &resp, &f);
    if (st == XCCL_OK) free(resp);
    return st;
}

static xccl_status_t tcp_get(xccl_store_t *s, const char *key, int64_t timeout_ms, void **val,
                             size_t *len)
{
    tcp_store_t   *t     = (tcp_store_t *)s;
    buf_t          b     = {0};
    int64_t        start = xccl_now_ms();
    uint8_t       *resp;
    const uint8_t *v;
    size_t         vlen;
    rd_t           f;
    xccl_status_t  st;

    msg_begin(&b, CMD_GET);
    msg_i64(&b, timeout_ms);
    msg_field(&b, key, strlen(key));
    st = client_rpc(t, &b, wait_deadline(timeout_ms), "get", key, 1, &resp, &f);
    if (st == XCCL_ERR_TIMEOUT && resp != NULL) {
        free(resp);
        return XCCL_ERROR(XCCL_ERR_TIMEOUT,
                          "TCP store %s: get('%.128s') timed out after %" PRId64
                          " ms: key '%.128s' was not set",
                          t->server_str, key, xccl_now_ms() - start, key);
    }
    if (st != XCCL_OK) return st;
    if (rd_field(&f, &v, &vlen, XCCL_STORE_MAX_VALUE) || f.n != 0) {
        free(resp);
        return bad_reply(t, "get");
    }
    *val = xccl_store_memdup(v, vlen);
    free(resp);
    if (*val == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "TCP store: value of %zu bytes", vlen);
    *len = vlen;
    return XCCL_OK;
}

static xccl_status_t tcp_add(xccl_store_t *s, const char *key, int64_t delta, int64_t *result)
{
    tcp_store_t  *t = (tcp_store_t *)s;
    buf_t         b = {0};
    uint8_t      *resp;
    rd_t          f;
    xccl_status_t st;

    msg_begin(&b, CMD_ADD);
    msg_field(&b, key, strlen(key));
    msg_i64(&b, delta);
    st = client_rpc(t, &b, op_deadline(t), "add", key, 0, &resp, &f);
    if (st != XCCL_OK) return st;
    if (rd_i64(&f, result) || f.n != 0) st = bad_reply(t, "add");
    free(resp);
    return st;
}

static xccl_status_t tcp_wait(xccl_store_t *s, const char *const *keys, size_t nkeys,
                              int64_t timeout_ms)
{
    tcp_store_t   *t     = (tcp_store_t *)s;
    buf_t          b     = {0};
    int64_t        start = xccl_now_ms();
    uint8_t       *resp;
    rd_t           f;
    size_t         i, n = 0;
    const char   **missing;
    char           list[1200];
    xccl_status_t  st;

    msg_begin(&b, CMD_WAIT);
    msg_i64(&b, timeout_ms);
    for (i = 0; i < nkeys; i++) msg_field(&b, keys[i], strlen(keys[i]));
    st = client_rpc(t, &b, wait_deadline(timeout_ms), "wait", NULL, 1, &resp, &f);
    if (st == XCCL_OK) free(resp);
    if (st != XCCL_ERR_TIMEOUT || resp == NULL) return st;
    /* the server lists the missing keys; name them by the caller's strings */
    missing = malloc(nkeys * sizeof(*missing));
    if (missing == NULL) {
        free(resp);
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "TCP store: wait for %zu keys", nkeys);
    }
    while (f.n > 0) {
        const uint8_t *k;
        size_t         klen;
        if (rd_field(&f, &k, &klen, XCCL_STORE_MAX_KEY)) break;
        for (i = 0; i < nkeys; i++)
            if (strlen(keys[i]) == klen && memcmp(keys[i], k, klen) == 0) {
                missing[n++] = keys[i];
                break;
            }
        if (n == nkeys) break;
    }
    free(resp);
    xccl_store_format_keys(list, sizeof(list), missing, n);
    free(missing);
    return XCCL_ERROR(XCCL_ERR_TIMEOUT,
                      "TCP store %s: wait timed out after %" PRId64
                      " ms; %zu of %zu keys missing: %s",
                      t->server_str, xccl_now_ms() - start, n, nkeys, list);
}

static xccl_status_t tcp_check(xccl_store_t *s, const char *const *keys, size_t nkeys,
                               int *all_present)
{
    tcp_store_t   *t = (tcp_store_t *)s;
    buf_t          b = {0};
    uint8_t       *resp;
    const uint8_t *v;
    size_t         vlen, i;
    rd_t           f;
    xccl_status_t  st;

    msg_begin(&b, CMD_CHECK);
    for (i = 0; i < nkeys; i++) msg_field(&b, keys[i], strlen(keys[i]));
    st = client_rpc(t, &b, op_deadline(t), "check", NULL, 0, &resp, &f);
    if (st != XCCL_OK) return st;
    if (rd_field(&f, &v, &vlen, 1) || vlen != 1 || f.n != 0) st = bad_reply(t, "check");
    else *all_present = v[0] != 0;
    free(resp);
    return st;
}

static xccl_status_t tcp_compare_set(xccl_store_t *s, const char *key, const void *expected,
                                     size_t elen, const void *desired, size_t dlen, void **out,
                                     size_t *outlen)
{
    tcp_store_t   *t = (tcp_store_t *)s;
    buf_t          b = {0};
    uint8_t       *resp;
    const uint8_t *v;
    size_t         vlen;
    rd_t           f;
    xccl_status_t  st;

    msg_begin(&b, CMD_COMPARE_SET);
    msg_field(&b, key, strlen(key));
    msg_field(&b, expected, elen);
    msg_field(&b, desired, dlen);
    st = client_rpc(t, &b, op_deadline(t), "compare_set", key, 0, &resp, &f);
    if (st != XCCL_OK) return st;
    if (rd_field(&f, &v, &vlen, XCCL_STORE_MAX_VALUE) || f.n != 0) {
        free(resp);
        return bad_reply(t, "compare_set");
    }
    *out = xccl_store_memdup(v, vlen);
    free(resp);
    if (*out == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "TCP store: value of %zu bytes", vlen);
    *outlen = vlen;
    return XCCL_OK;
}

static xccl_status_t tcp_delete_key(xccl_store_t *s, const char *key, int *deleted)
{
    tcp_store_t   *t = (tcp_store_t *)s;
    buf_t          b = {0};
    uint8_t       *resp;
    const uint8_t *v;
    size_t         vlen;
    rd_t           f;
    xccl_status_t  st;

    msg_begin(&b, CMD_DELETE);
    msg_field(&b, key, strlen(key));
    st = client_rpc(t, &b, op_deadline(t), "delete_key", key, 0, &resp, &f);
    if (st != XCCL_OK) return st;
    if (rd_field(&f, &v, &vlen, 1) || vlen != 1 || f.n != 0) st = bad_reply(t, "delete_key");
    else *deleted = v[0] != 0;
    free(resp);
    return st;
}

static xccl_status_t tcp_num_keys(xccl_store_t *s, int64_t *n)
{
    tcp_store_t  *t = (tcp_store_t *)s;
    buf_t         b = {0};
    uint8_t      *resp;
    rd_t          f;
    xccl_status_t st;

    msg_begin(&b, CMD_NUM_KEYS);
    st = client_rpc(t, &b, op_deadline(t), "num_keys", NULL, 0, &resp, &f);
    if (st != XCCL_OK) return st;
    if (rd_i64(&f, n) || f.n != 0) st = bad_reply(t, "num_keys");
    free(resp);
    return st;
}

static void tcp_destroy(xccl_store_t *s)
{
    tcp_store_t *t = (tcp_store_t *)s;

    client_drop(t);
    if (t->server != NULL) server_stop(t->server);
    pthread_mutex_destroy(&t->lock);
    free(t);
}

static const xccl_store_vtable_t tcp_vtable = {
    .kind        = "tcp",
    .set         = tcp_set,
    .get         = tcp_get,
    .add         = tcp_add,
    .wait        = tcp_wait,
    .check       = tcp_check,
    .compare_set = tcp_compare_set,
    .delete_key  = tcp_delete_key,
    .num_keys    = tcp_num_keys,
    .destroy     = tcp_destroy,
};

int xccl_store_tcp_port(const xccl_store_t *store)
{
    if (store == NULL || store->vt != &tcp_vtable) return -1;
    return ((const tcp_store_t *)store)->port;
}

/* The master's server reached through loopback when it listens on every address. */
static void wildcard_to_loopback(xccl_sockaddr_t *a)
{
    if (a->ss.ss_family == AF_INET) {
        struct sockaddr_in *s4 = (struct sockaddr_in *)&a->ss;
        if (s4->sin_addr.s_addr == htonl(INADDR_ANY)) s4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    } else if (a->ss.ss_family == AF_INET6) {
        struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&a->ss;
        if (IN6_IS_ADDR_UNSPECIFIED(&s6->sin6_addr)) s6->sin6_addr = in6addr_loopback;
    }
}

/* Master only: waits until world_size clients have joined. */
static xccl_status_t wait_workers(tcp_store_t *t, int world_size, int64_t deadline_ms,
                                  int64_t timeout_ms)
{
    tcp_server_t *srv = t->server;
    int           joined, failed;
    char          last[sizeof(srv->auth_failed_name)];

    pthread_mutex_lock(&srv->mu);
    while (srv->joined < world_size && xccl_now_ms() < deadline_ms) {
        struct timespec ts = {.tv_sec  = (time_t)(deadline_ms / 1000),
                              .tv_nsec = (long)(deadline_ms % 1000) * 1000000L};
        pthread_cond_timedwait(&srv->cond, &srv->mu, &ts);
    }
    joined = srv->joined;
    failed = srv->auth_failed;
    memcpy(last, srv->auth_failed_name, sizeof(last));
    pthread_mutex_unlock(&srv->mu);
    if (joined >= world_size) return XCCL_OK;
    if (failed > 0) /* the missing workers may be those: say so where the job is waited for */
        return XCCL_ERROR(XCCL_ERR_TIMEOUT,
                          "TCP store %s: only %d of %d workers connected within %" PRId64
                          " ms; %d connection(s) failed authentication (the last from %s): "
                          "do all ranks have the same XCCL_AUTH_KEY?",
                          t->server_str, joined, world_size, timeout_ms, failed, last);
    return XCCL_ERROR(XCCL_ERR_TIMEOUT,
                      "TCP store %s: only %d of %d workers connected within %" PRId64 " ms",
                      t->server_str, joined, world_size, timeout_ms);
}

xccl_status_t xccl_store_tcp_create(const char *host, int port, int is_master, int world_size,
                                    int wait_for_workers, int64_t timeout_ms,
                                    const void *auth_key, size_t auth_key_len,
                                    xccl_store_t **out)
{
    tcp_store_t    *t;
    xccl_sockaddr_t addr;
    int64_t         deadline;
    buf_t           b = {0};
    uint8_t        *resp;
    rd_t            f;
    xccl_status_t   st;

    if (out == NULL) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "TCP store: out is NULL");
    if (port < 0 || port > 65535 || (!is_master && port == 0))
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "TCP store: port %d is not valid for a %s", port,
                          is_master ? "server" : "client (it needs the server's port)");
    if (auth_key == NULL) auth_key_len = 0;
    t = calloc(1, sizeof(*t));
    if (t == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "TCP store: %zu bytes", sizeof(*t));
    xccl_store_init(&t->base, &tcp_vtable, timeout_ms);
    pthread_mutex_init(&t->lock, NULL);
    t->fd    = -1;
    deadline = deadline_after(xccl_store_get_timeout(&t->base));

    if (is_master) {
        XCCL_CHECK_GOTO(server_start(host, port, auth_key, auth_key_len, &t->server), st, fail);
        addr = t->server->addr;
    } else {
        XCCL_CHECK_GOTO(xccl_sock_resolve(host, port, &addr), st, fail);
    }
    wildcard_to_loopback(&addr);
    t->port = xccl_sock_port(&addr);
    xccl_sock_str(&addr, t->server_str, sizeof(t->server_str));

    XCCL_CHECK_GOTO(xccl_sock_connect(&addr, deadline, &t->fd), st, fail);
    if (auth_key_len > 0) {
        int64_t hs = xccl_now_ms() + TCP_AUTH_TIMEOUT_MS;
        st = xccl_auth_handshake(t->fd, auth_key, auth_key_len, 0, TCP_AUTH_CONTEXT,
                                 hs < deadline ? hs : deadline);
        if (st != XCCL_OK) {
            with_context(t, st, "authentication", NULL);
            goto fail;
        }
    }
    msg_begin(&b, CMD_JOIN);
    XCCL_CHECK_GOTO(client_rpc(t, &b, deadline, "join", NULL, 0, &resp, &f), st, fail);
    free(resp);
    if (is_master && wait_for_workers && world_size > 0)
        XCCL_CHECK_GOTO(wait_workers(t, world_size, deadline, xccl_store_get_timeout(&t->base)),
                        st, fail);
    *out = &t->base;
    return XCCL_OK;
fail:
    tcp_destroy(&t->base);
    return st;
}
