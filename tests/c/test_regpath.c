/* SPDX-License-Identifier: Apache-2.0
 *
 * test_regpath.c - the registration path and device-memory delivery, end to end: forked ranks
 * over a file store and two transports registered at run time, both wrapping tcp:
 *   - "regtcp" (host memory, XCCL_TP_CAP_NEEDS_REG) keeps a table of live registrations and
 *     checks that every buffer the core hands it, sent or received into, carries a live
 *     registration of the right memory type covering it, and that nothing is deregistered
 *     while a send or receive of it is in flight. Over it: point-to-point and collectives
 *     (several algorithms, in place and out of place); cache hits on reused buffers; a new
 *     registration after xccl_comm_mem_invalidate; invalidation while a send and a receive
 *     are held in flight; large messages (staged, and with scratch), after which no
 *     registration of memory the core freed (unmapped) is left cached; every registration
 *     gone at destroy.
 *   - "regdev" (the same, also moving XCCL_MEM_CUDA) with the fake asynchronous executor of
 *     fake_dev.h for that type (its memory left accessible: tcp reads and writes it): messages
 *     that arrive before their receive is posted, staged in host memory, reach a receive into
 *     device memory through the executor, and the receive completes only after its copy:
 *     broadcast and gather whose senders finished before the receiver posted, and an
 *     allreduce that one rank joins late.
 *
 * The wrappers can hold sends back (queued, handed to tcp in order once released) and hold
 * recv_done upcalls, so that a buffer is deterministically in the transport's hands while the
 * test invalidates it. Upcalls and transport entries run under the core's lock, on the
 * progress thread or the caller's; the table has its own lock, never held across a call into
 * the core or tcp. Violations are counted there and checked by the test thread.
 */
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "algo/algo.h"
#include "ctest.h"
#include "tp_wrap.h"
#include "fake_dev.h"
#include "xccl/xccl.h"
#include "xccl/xccl_transport.h"

/* ---- the registration table ------------------------------------------------------------------ */

typedef struct rt_reg {
    uintptr_t       start, end;
    xccl_mem_type_t mem;
    int             live;
    int             inflight; /* sends and receives of the transport using it now */
} rt_reg_t;

typedef struct rt_op { /* a send or receive the transport holds, and its registration */
    void     *cookie;
    rt_reg_t *reg;
} rt_op_t;

enum { RT_MAXREG = 1 << 15, RT_MAXOPS = 4096, RT_MAXHELD = 256 };

static struct {
    pthread_mutex_t lock;
    rt_reg_t        regs[RT_MAXREG]; /* a handle is &regs[i]; never reused */
    int             nregs;
    long            n_reg, n_dereg;
    int             bad;
    char            why[256]; /* the first violation */
    rt_op_t         sends[RT_MAXOPS], recvs[RT_MAXOPS];
    int             nsends, nrecvs;
    long            recv_done_calls;
} rt = {.lock = PTHREAD_MUTEX_INITIALIZER};

static atomic_int hold_sends, hold_recvs; /* the test holds sends / recv_done upcalls back */
static atomic_int held_sends, held_recvs; /* sends / recv_done upcalls held now */

static void rt_bad(const char *fmt, const char *what, uintptr_t a, uintptr_t b)
{
    if (rt.bad++ == 0) snprintf(rt.why, sizeof(rt.why), fmt, what, (void *)a, (void *)b);
}

/* Checks (under rt.lock) that mr is a live registration of mem covering [p, p + n). */
static rt_reg_t *rt_check(const char *what, void *mr, const void *p, size_t n, xccl_mem_type_t mem)
{
    rt_reg_t *g = mr;

    if (g == NULL || g < rt.regs || g >= rt.regs + rt.nregs) {
        rt_bad("%s of [%p, %p): no registration handle", what, (uintptr_t)p, (uintptr_t)p + n);
        return NULL;
    }
    if (!g->live)
        rt_bad("%s of [%p, %p): deregistered handle", what, (uintptr_t)p, (uintptr_t)p + n);
    else if (g->start > (uintptr_t)p || g->end < (uintptr_t)p + n)
        rt_bad("%s: the registration [%p, %p) does not cover the buffer", what, g->start, g->end);
    else if (g->mem != mem)
        rt_bad("%s of [%p, %p): registration of another memory type", what, (uintptr_t)p,
               (uintptr_t)p + n);
    return g;
}

static void rt_op_add(rt_op_t *ops, int *n, void *cookie, rt_reg_t *g)
{
    if (*n == RT_MAXOPS) {
        rt_bad("%s: %p %p", "too many operations in flight", 0, 0);
        return;
    }
    ops[(*n)++] = (rt_op_t){cookie, g};
    g->inflight++;
}

static void rt_op_del(rt_op_t *ops, int *n, void *cookie)
{
    for (int i = 0; i < *n; i++) {
        if (ops[i].cookie != cookie) continue;
        ops[i].reg->inflight--;
        ops[i] = ops[--*n];
        return;
    }
}

/* Registrations made so far whose range overlaps [p, p + n). */
static long rt_regs_over(const void *p, size_t n)
{
    long k = 0;

    pthread_mutex_lock(&rt.lock);
    for (int i = 0; i < rt.nregs; i++)
        k += rt.regs[i].start < (uintptr_t)p + n && (uintptr_t)p < rt.regs[i].end;
    pthread_mutex_unlock(&rt.lock);
    return k;
}

/* Live registrations overlapping [p, p + n); *inflight: those of them in use. */
static int rt_live_over(const void *p, size_t n, int *inflight)
{
    int k = 0, busy = 0;

    pthread_mutex_lock(&rt.lock);
    for (int i = 0; i < rt.nregs; i++) {
        rt_reg_t *g = &rt.regs[i];
        if (g->live && g->start < (uintptr_t)p + n && (uintptr_t)p < g->end) {
            k++;
            busy += g->inflight > 0;
        }
    }
    pthread_mutex_unlock(&rt.lock);
    if (inflight != NULL) *inflight = busy;
    return k;
}

/* Live registrations overlapping [p, p + n) among the first `mark` ever made. */
static int rt_live_before(const void *p, size_t n, int mark)
{
    int k = 0;

    pthread_mutex_lock(&rt.lock);
    for (int i = 0; i < mark && i < rt.nregs; i++) {
        rt_reg_t *g = &rt.regs[i];
        k += g->live && g->start < (uintptr_t)p + n && (uintptr_t)p < g->end;
    }
    pthread_mutex_unlock(&rt.lock);
    return k;
}

static int rt_nregs(void)
{
    int n;

    pthread_mutex_lock(&rt.lock);
    n = rt.nregs;
    pthread_mutex_unlock(&rt.lock);
    return n;
}

/* Live registrations of memory that is no longer mapped: memory the core allocated (large
 * staging buffers, scratch) and freed without dropping its registration, which then pins pages
 * the process no longer has there (a later buffer at that address would be sent from them). */
static int rt_live_unmapped(void)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    int       k    = 0;

    pthread_mutex_lock(&rt.lock);
    for (int i = 0; i < rt.nregs; i++) {
        rt_reg_t *g = &rt.regs[i];
        uintptr_t a = g->start & ~(page - 1);
        if (g->live && g->mem == XCCL_MEM_HOST && msync((void *)a, g->end - a, MS_ASYNC) != 0 &&
            errno == ENOMEM)
            k++;
    }
    pthread_mutex_unlock(&rt.lock);
    return k;
}

/* ---- the wrapping transport --------------------------------------------------------------------
 */

typedef struct held_send {
    int            peer;
    xccl_msg_hdr_t hdr;
    xccl_tp_buf_t  buf;
    void          *cookie;
} held_send_t;

typedef struct held_recv {
    void         *cookie;
    xccl_status_t st;
} held_recv_t;

struct xccl_tp_ctx {
    tpw_t       w; /* the wrapped tcp; its upcall shim checks, then passes on (tp_wrap.h) */
    held_send_t sq[RT_MAXHELD];
    int         nsq;
    held_recv_t rq[RT_MAXHELD];
    int         nrq;
};

static xccl_status_t w_recv_match(void *core, int peer, const xccl_msg_hdr_t *hdr,
                                  xccl_tp_buf_t *dst, void **cookie)
{
    xccl_status_t st = tpw_up_recv_match(core, peer, hdr, dst, cookie);

    if (st == XCCL_OK && hdr->nbytes > 0 && dst->ptr != NULL) {
        pthread_mutex_lock(&rt.lock);
        rt_reg_t *g = rt_check("receive", dst->mr, dst->ptr, hdr->nbytes, dst->mem);
        if (g != NULL) rt_op_add(rt.recvs, &rt.nrecvs, *cookie, g);
        pthread_mutex_unlock(&rt.lock);
    }
    if (st == XCCL_OK) dst->mem = XCCL_MEM_HOST; /* the fake device memory is host memory */
    return st;
}

static void w_deliver_recv(xccl_tp_ctx_t *c, void *cookie, xccl_status_t st)
{
    pthread_mutex_lock(&rt.lock);
    rt_op_del(rt.recvs, &rt.nrecvs, cookie);
    rt.recv_done_calls++;
    pthread_mutex_unlock(&rt.lock);
    tpw_up_recv_done(c, cookie, st);
}

static void w_recv_done(void *core, void *cookie, xccl_status_t st)
{
    xccl_tp_ctx_t *c = core;

    if (cookie != NULL && atomic_load(&hold_recvs) && c->nrq < RT_MAXHELD) {
        c->rq[c->nrq++] = (held_recv_t){cookie, st};
        atomic_fetch_add(&held_recvs, 1);
        return;
    }
    w_deliver_recv(c, cookie, st);
}

static void w_send_done(void *core, void *cookie, xccl_status_t st)
{
    pthread_mutex_lock(&rt.lock);
    rt_op_del(rt.sends, &rt.nsends, cookie);
    pthread_mutex_unlock(&rt.lock);
    tpw_up_send_done(core, cookie, st);
}

static xccl_status_t w_init(const xccl_tp_init_params_t *params, xccl_tp_ctx_t **out)
{
    static const xccl_tp_upcalls_t shim = {
        .recv_match = w_recv_match, .recv_done = w_recv_done, .send_done = w_send_done};

    return tpw_init(params, out, sizeof(xccl_tp_ctx_t), "tcp", &shim);
}

static xccl_status_t w_isend(xccl_tp_ctx_t *c, int peer, const xccl_msg_hdr_t *hdr,
                             const xccl_tp_buf_t *buf, void *cookie)
{
    xccl_tp_buf_t host = *buf;
    xccl_status_t st;

    if (hdr->nbytes > 0) {
        pthread_mutex_lock(&rt.lock);
        rt_reg_t *g = rt_check("send", buf->mr, buf->ptr, hdr->nbytes, buf->mem);
        if (g != NULL) rt_op_add(rt.sends, &rt.nsends, cookie, g);
        pthread_mutex_unlock(&rt.lock);
    }
    host.mem = XCCL_MEM_HOST;
    /* held, or behind held ones: messages to a peer leave in posting order */
    if ((atomic_load(&hold_sends) || c->nsq > 0) && c->nsq < RT_MAXHELD) {
        c->sq[c->nsq++] = (held_send_t){peer, *hdr, host, cookie};
        atomic_fetch_add(&held_sends, 1);
        return XCCL_OK;
    }
    st = tpw_isend(c, peer, hdr, &host, cookie);
    if (st < 0) {
        pthread_mutex_lock(&rt.lock);
        rt_op_del(rt.sends, &rt.nsends, cookie);
        pthread_mutex_unlock(&rt.lock);
    }
    return st;
}

static xccl_status_t w_progress(xccl_tp_ctx_t *c, int *nevents)
{
    int k = 0;

    if (!atomic_load(&hold_sends) && c->nsq > 0) {
        for (int i = 0; i < c->nsq; i++) {
            held_send_t  *h  = &c->sq[i];
            xccl_status_t st = tpw_isend(c, h->peer, &h->hdr, &h->buf, h->cookie);
            if (st < 0) w_send_done(c, h->cookie, st);
        }
        k += c->nsq;
        atomic_fetch_sub(&held_sends, c->nsq);
        c->nsq = 0;
    }
    if (!atomic_load(&hold_recvs) && c->nrq > 0) {
        int n  = c->nrq;
        c->nrq = 0;
        for (int i = 0; i < n; i++) {
            atomic_fetch_sub(&held_recvs, 1);
            w_deliver_recv(c, c->rq[i].cookie, c->rq[i].st);
        }
        k += n;
    }
    xccl_status_t st = tpw_progress(c, nevents);
    *nevents += k;
    return st;
}

static void w_wait(xccl_tp_ctx_t *c, int timeout_ms)
{
    /* held work is released by a flag, which wakes nobody: sleep briefly while there is some
     * (called without the core lock: the counters, not the queues) */
    int held = atomic_load(&held_sends) + atomic_load(&held_recvs);
    tpw_wait(c, held > 0 && timeout_ms > 1 ? 1 : timeout_ms);
}

static xccl_status_t w_mem_reg(xccl_tp_ctx_t *c, void *ptr, size_t nbytes, xccl_mem_type_t mem,
                               void **mr)
{
    (void)c;
    pthread_mutex_lock(&rt.lock);
    rt.n_reg++;
    if (rt.nregs == RT_MAXREG) {
        pthread_mutex_unlock(&rt.lock);
        return XCCL_ERR_NO_MEMORY;
    }
    if (nbytes == 0) rt_bad("%s [%p, %p)", "empty registration", (uintptr_t)ptr, 0);
    rt.regs[rt.nregs] = (rt_reg_t){(uintptr_t)ptr, (uintptr_t)ptr + nbytes, mem, 1, 0};
    *mr               = &rt.regs[rt.nregs++];
    pthread_mutex_unlock(&rt.lock);
    return XCCL_OK;
}

static void w_mem_dereg(xccl_tp_ctx_t *c, void *mr)
{
    rt_reg_t *g = mr;

    (void)c;
    pthread_mutex_lock(&rt.lock);
    rt.n_dereg++;
    if (g < rt.regs || g >= rt.regs + rt.nregs || !g->live)
        rt_bad("%s %p%p", "deregistration of an unknown or dead handle", (uintptr_t)g, 0);
    else if (g->inflight > 0)
        rt_bad("%s [%p, %p) while the transport uses it", "deregistration", g->start, g->end);
    else
        g->live = 0;
    pthread_mutex_unlock(&rt.lock);
}

#define WRAP_OPS(NAME, CAPS)                                                                       \
    {                                                                                              \
        .abi_version = XCCL_TRANSPORT_ABI_VERSION,                                                 \
        .name        = NAME,                                                                       \
        .caps        = (CAPS),                                                                     \
        .priority    = 1,                                                                          \
        .init        = w_init,                                                                     \
        .finalize    = tpw_finalize,                                                               \
        .reachable   = tpw_reachable,                                                              \
        .get_addr    = tpw_get_addr,                                                               \
        .wireup      = tpw_wireup,                                                                 \
        .isend       = w_isend,                                                                    \
        .progress    = w_progress,                                                                 \
        .wait        = w_wait,                                                                     \
        .wake        = tpw_wake,                                                                   \
        .close_peer  = tpw_close_peer,                                                             \
        .mem_reg     = w_mem_reg,                                                                  \
        .mem_dereg   = w_mem_dereg,                                                                \
    }

static const xccl_transport_ops_t regtcp_ops =
    WRAP_OPS("regtcp", XCCL_TP_CAP_HOST_MEM | XCCL_TP_CAP_NEEDS_REG);
static const xccl_transport_ops_t regdev_ops =
    WRAP_OPS("regdev", XCCL_TP_CAP_HOST_MEM | XCCL_TP_CAP_CUDA_MEM | XCCL_TP_CAP_NEEDS_REG);

/* ---- helpers ------------------------------------------------------------------------------------
 */

static char store_path[256];

static xccl_comm_t *comm_new(int rank, int size, const char *tp, xccl_store_t **store)
{
    xccl_comm_t       *comm = NULL;
    xccl_comm_config_t cfg  = {0};

    *store = NULL;
    if (xccl_store_file_create(store_path, size, 20000, store) != XCCL_OK) return NULL;
    cfg.rank       = rank;
    cfg.size       = size;
    cfg.store      = *store;
    cfg.timeout_ms = 20000;
    cfg.name       = "regpath";
    cfg.transports = tp;
    if (xccl_comm_create(&cfg, &comm) != XCCL_OK)
        fprintf(stderr, "rank %d: comm create: %s\n", rank, xccl_last_error());
    return comm;
}

/* Every rank reaches step `key` before any goes on (through the store, not the transport). */
static void store_meet(xccl_store_t *s, int size, const char *key)
{
    int64_t n = 0;

    CHECK(xccl_store_add(s, key, 1, &n) == XCCL_OK);
    for (int i = 0; i < 20000 && n < size; i++) {
        usleep(1000);
        CHECK(xccl_store_add(s, key, 0, &n) == XCCL_OK);
    }
    CHECK_MSG(n >= size, "%s: %lld of %d ranks met", key, (long long)n, size);
}

/* Page-aligned host buffers of whole pages: a registration of one never covers another. */
static void *page_alloc(size_t nbytes)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    void  *p    = NULL;

    if (posix_memalign(&p, page, (nbytes + page - 1) / page * page + page) != 0) abort();
    return p;
}

static int rt_check_clean(const char *where)
{
    int  bad;
    char why[256];

    pthread_mutex_lock(&rt.lock);
    bad = rt.bad;
    memcpy(why, rt.why, sizeof(why));
    pthread_mutex_unlock(&rt.lock);
    CHECK_MSG(bad == 0, "%s: %d violation(s), first: %s", where, bad, why);
    return bad;
}

static xccl_status_t wait_release(xccl_work_t *w, xccl_status_t st, const char *what)
{
    if (st == XCCL_OK) st = xccl_work_wait(w, -1);
    CHECK_MSG(st == XCCL_OK, "%s: %s", what, w ? xccl_work_error(w) : xccl_last_error());
    if (w != NULL) xccl_work_release(w);
    return st;
}

/* Small integers: float32 sums of them are exact in any order. */
static float val(int r, size_t i)
{
    return (float)((r + 1) * 100 + (int)(i % 97));
}

static float sum_at(int size, size_t i)
{
    float s = 0;
    for (int q = 0; q < size; q++)
        s += val(q, i);
    return s;
}

/* ---- part 1: regtcp -----------------------------------------------------------------------------
 */

/* Ring exchange: rank r sends n floats to r + 1 and receives from r - 1; values checked. */
static void p2p_ring(xccl_comm_t *c, float *s, float *r, size_t n, uint32_t tag)
{
    int          rank = xccl_comm_rank(c), size = xccl_comm_size(c);
    int          to = (rank + 1) % size, from = (rank + size - 1) % size;
    xccl_work_t *ws = NULL, *wr = NULL;
    size_t       bad = 0;

    for (size_t i = 0; i < n; i++)
        s[i] = val(rank, i + tag), r[i] = -1;
    CHECK(xccl_irecv(c, r, n * 4, from, tag, &wr) == XCCL_OK);
    CHECK(xccl_isend(c, s, n * 4, to, tag, &ws) == XCCL_OK);
    wait_release(ws, XCCL_OK, "p2p send");
    wait_release(wr, XCCL_OK, "p2p recv");
    for (size_t i = 0; i < n; i++)
        bad += r[i] != val(from, i + tag);
    CHECK_MSG(bad == 0, "p2p tag %u: %zu wrong values", tag, bad);
}

/* One collective on host buffers s and r (n * size floats each); 0 when it succeeded with the
 * independently computed values. */
static int coll_one(xccl_comm_t *c, xccl_coll_t coll, const char *algo, int inplace, float *s,
                    float *r, size_t n)
{
    int              rank = xccl_comm_rank(c), size = xccl_comm_size(c), root = size - 1;
    size_t           tot  = n * (size_t)size;
    float           *out  = inplace ? s : r;
    xccl_coll_opts_t opts = {.algo = algo};
    xccl_work_t     *w    = NULL;
    xccl_status_t    st;
    char             what[128];
    size_t           bad = 0;

    snprintf(what, sizeof(what), "rank %d/%d %s/%s%s n=%zu", rank, size, xccl_coll_name(coll), algo,
             inplace ? " in-place" : "", n);
    for (size_t i = 0; i < tot; i++)
        s[i] = val(rank, i), r[i] = -7;
    switch (coll) {
    case XCCL_COLL_ALLREDUCE:
        st = xccl_allreduce(c, s, out, n, XCCL_FLOAT32, XCCL_OP_SUM, &opts, &w);
        break;
    case XCCL_COLL_BROADCAST:
        st = xccl_broadcast(c, s, n, XCCL_FLOAT32, root, &opts, &w);
        break;
    case XCCL_COLL_ALLGATHER:
        st = xccl_allgather(c, s, r, n, XCCL_FLOAT32, &opts, &w);
        break;
    case XCCL_COLL_REDUCE_SCATTER:
        st = xccl_reduce_scatter(c, s, out, n, XCCL_FLOAT32, XCCL_OP_SUM, &opts, &w);
        break;
    default:
        st = xccl_alltoall(c, s, out, n, XCCL_FLOAT32, &opts, &w);
        break;
    }
    if (wait_release(w, st, what) != XCCL_OK) return -1;
    for (size_t i = 0; i < tot; i++) {
        float want = 0, got = out[i];
        int   have = i < n;
        switch (coll) {
        case XCCL_COLL_ALLREDUCE:
            want = sum_at(size, i);
            break;
        case XCCL_COLL_BROADCAST:
            want = val(root, i), got = s[i];
            break;
        case XCCL_COLL_ALLGATHER:
            have = 1, want = val((int)(i / n), i % n);
            break;
        case XCCL_COLL_REDUCE_SCATTER:
            want = sum_at(size, (size_t)rank * n + i);
            break;
        default:
            have = 1, want = val((int)(i / n), (size_t)rank * n + i % n);
            break;
        }
        bad += have && got != want;
    }
    CHECK_MSG(bad == 0, "%s: %zu wrong values", what, bad);
    return bad == 0 ? 0 : -1;
}

static const xccl_coll_t colls[] = {XCCL_COLL_ALLREDUCE, XCCL_COLL_BROADCAST, XCCL_COLL_ALLGATHER,
                                    XCCL_COLL_REDUCE_SCATTER, XCCL_COLL_ALLTOALL};

/* Every applicable algorithm of the collectives above, in place where it exists. */
static void colls_all(xccl_comm_t *c, float *s, float *r, size_t n)
{
    for (size_t k = 0; k < sizeof(colls) / sizeof(colls[0]); k++) {
        const xccl_algo_t *const *algos = xccl_algo_list(colls[k]);
        int inplace = colls[k] != XCCL_COLL_BROADCAST && colls[k] != XCCL_COLL_ALLGATHER;
        for (int ai = 0; algos[ai] != NULL; ai++) {
            xccl_coll_args_t probe = {
                .coll = colls[k], .count = n, .dtype = XCCL_FLOAT32, .elsize = 4};
            if (algos[ai]->applicable && !algos[ai]->applicable(&probe, xccl_comm_size(c)))
                continue;
            for (int ip = 0; ip <= inplace; ip++)
                (void)coll_one(c, colls[k], algos[ai]->name, ip, s, r, n);
        }
    }
}

/* A send (rank 0 to 1) and a receive (rank 1 from 0) held in the transport while their buffer
 * is invalidated: the registration stays until the transport let go, then goes. */
static void inflight_invalidate(xccl_comm_t *c, xccl_store_t *store)
{
    int          rank = xccl_comm_rank(c), size = xccl_comm_size(c);
    size_t       n = 16384, bytes = n * 4, bad = 0;
    float       *b = page_alloc(bytes);
    xccl_work_t *w = NULL;
    int          live, busy = 0;

    for (size_t i = 0; i < n; i++)
        b[i] = rank == 0 ? val(0, i) : -1;
    /* the send */
    if (rank == 0) {
        atomic_store(&hold_sends, 1);
        CHECK(xccl_isend(c, b, bytes, 1, 90, &w) == XCCL_OK);
        live = rt_live_over(b, bytes, &busy);
        CHECK_MSG(live == 1 && busy == 1, "send held: %d live registration(s), %d busy", live,
                  busy);
        CHECK(xccl_comm_mem_invalidate(c, b, bytes) == XCCL_OK);
        live = rt_live_over(b, bytes, &busy);
        CHECK_MSG(live == 1 && busy == 1, "invalidated under a held send: %d live, %d busy", live,
                  busy);
        CHECK(xccl_work_test(w) == XCCL_INPROGRESS);
        atomic_store(&hold_sends, 0);
        wait_release(w, XCCL_OK, "held send");
        CHECK_MSG(rt_live_over(b, bytes, NULL) == 0, "registration left after the send");
    } else if (rank == 1) {
        float *r = page_alloc(bytes);
        CHECK(xccl_irecv(c, r, bytes, 0, 90, &w) == XCCL_OK);
        wait_release(w, XCCL_OK, "receive of the held send");
        for (size_t i = 0; i < n; i++)
            bad += r[i] != val(0, i);
        CHECK_MSG(bad == 0, "receive of the held send: %zu wrong values", bad);
        CHECK(xccl_comm_mem_invalidate(c, r, bytes) == XCCL_OK);
        free(r);
    }
    store_meet(store, size, "held-send");
    /* the receive */
    if (rank == 1) {
        atomic_store(&hold_recvs, 1);
        CHECK(xccl_irecv(c, b, bytes, 0, 91, &w) == XCCL_OK);
    }
    store_meet(store, size, "held-recv-posted");
    if (rank == 0) {
        CHECK(xccl_isend(c, b, bytes, 1, 91, &w) == XCCL_OK);
        wait_release(w, XCCL_OK, "send to the held receive");
    } else if (rank == 1) {
        for (int i = 0; i < 20000 && atomic_load(&held_recvs) == 0; i++)
            usleep(1000);
        CHECK(atomic_load(&held_recvs) > 0);
        live = rt_live_over(b, bytes, &busy);
        CHECK_MSG(live == 1 && busy == 1, "receive held: %d live registration(s), %d busy", live,
                  busy);
        CHECK(xccl_comm_mem_invalidate(c, b, bytes) == XCCL_OK);
        live = rt_live_over(b, bytes, &busy);
        CHECK_MSG(live == 1 && busy == 1, "invalidated under a held receive: %d live, %d busy",
                  live, busy);
        CHECK(xccl_work_test(w) == XCCL_INPROGRESS);
        atomic_store(&hold_recvs, 0);
        wait_release(w, XCCL_OK, "held receive");
        CHECK_MSG(rt_live_over(b, bytes, NULL) == 0, "registration left after the receive");
        for (size_t i = 0; i < n; i++)
            bad += b[i] != val(0, i);
        CHECK_MSG(bad == 0, "held receive: %zu wrong values", bad);
    }
    store_meet(store, size, "held-done");
    CHECK(xccl_comm_mem_invalidate(c, b, bytes) == XCCL_OK); /* before memory is freed */
    free(b);
}

/* Buffers freed and allocated again (same address where malloc gives it back) with no
 * xccl_comm_mem_invalidate: the memory hooks make the next operations register them anew;
 * nothing registered before the free is used or kept. */
static void freed_and_reused(xccl_comm_t *c, xccl_store_t *store)
{
    int       size = xccl_comm_size(c);
    size_t    n = 300000, bytes = n * 4; /* past the mmap threshold: unmapped by free */
    float    *s = malloc(bytes), *r = malloc(bytes), *s2, *r2;
    int       mark;
    uintptr_t sa, ra;

    CHECK(s != NULL && r != NULL);
    p2p_ring(c, s, r, n, 40);
    /* the send buffer is registered (a receive may have been staged instead, if the message
     * came first) */
    CHECK(rt_live_over(s, bytes, NULL) > 0);
    store_meet(store, size, "reuse-before-free");
    mark = rt_nregs();
    sa   = (uintptr_t)s;
    ra   = (uintptr_t)r;
    free(s);
    free(r);
    s2 = malloc(bytes);
    r2 = malloc(bytes);
    CHECK(s2 != NULL && r2 != NULL);
    if ((uintptr_t)s2 != sa || (uintptr_t)r2 != ra)
        printf("  freed_and_reused: malloc gave other addresses (%#lx %#lx -> %p %p)\n",
               (unsigned long)sa, (unsigned long)ra, (void *)s2, (void *)r2);
    p2p_ring(c, s2, r2, n, 41); /* other values than tag 40's */
    CHECK_MSG(rt_live_before(s2, bytes, mark) == 0 && rt_live_before(r2, bytes, mark) == 0,
              "a registration made before the buffers were freed is still live");
    CHECK(rt_live_over(s2, bytes, NULL) > 0);
    {
        long s0 = rt_regs_over(s2, bytes), r0 = rt_regs_over(r2, bytes), s1, r1;
        for (int round = 0; round < 4; round++)
            p2p_ring(c, s2, r2, n, 42 + round); /* still valid: hits */
        s1 = rt_regs_over(s2, bytes);
        r1 = rt_regs_over(r2, bytes);
        /* Four more rounds add at most one registration per buffer: a receive whose message
         * came first was staged, not registered (timing), and a registration merged with a
         * neighbour's (buffers sharing a page) goes when memory of that neighbour is freed:
         * conservative, once. A buffer registered again every round fails. */
        CHECK_MSG(s1 <= s0 + 1 && r1 <= r0 + 1,
                  "valid buffers registered again: %ld -> %ld, %ld -> %ld over 4 rounds", s0, s1,
                  r0, r1);
    }
    store_meet(store, size, "reuse-done");
    free(s2);
    free(r2);
}

static long recv_dones(void);
static void await_arrivals(long base, long want, const char *what);

/* Large messages (past malloc's mmap threshold: the core's staging and scratch for them are
 * unmapped when freed): collectives, and a ring of sends that each arrive before their
 * receive is posted, so the receiver stages them. */
static void large(xccl_comm_t *c, xccl_store_t *store)
{
    int              rank = xccl_comm_rank(c), size = xccl_comm_size(c);
    size_t           n = 96 * 1024, bytes = n * (size_t)size * 4, bad = 0;
    float           *s = page_alloc(bytes), *r = page_alloc(bytes);
    xccl_work_t     *ws = NULL, *wr = NULL;
    xccl_coll_opts_t opts = {.algo = "rd"}; /* scratch: the whole vector */
    long             base;

    colls_all(c, s, r, n);
    /* two at once: the second's scratch cannot come from the communicator's spare buffer, and
     * is freed (not kept) when it finishes */
    for (size_t i = 0; i < 2 * n; i++)
        s[i] = val(rank, i), r[i] = -1;
    CHECK(xccl_allreduce(c, s, r, n, XCCL_FLOAT32, XCCL_OP_SUM, &opts, &ws) == XCCL_OK);
    CHECK(xccl_allreduce(c, s + n, r + n, n, XCCL_FLOAT32, XCCL_OP_SUM, &opts, &wr) == XCCL_OK);
    wait_release(ws, XCCL_OK, "first of two allreduces");
    wait_release(wr, XCCL_OK, "second of two allreduces");
    for (size_t i = 0; i < 2 * n; i++)
        bad += r[i] != sum_at(size, i);
    CHECK_MSG(bad == 0, "two allreduces at once: %zu wrong values", bad);
    /* checked now, before a later buffer of the same size maps the same addresses again */
    CHECK_MSG(rt_live_unmapped() == 0,
              "after the collectives: %d registration(s) of unmapped "
              "memory are cached",
              rt_live_unmapped());

    for (size_t i = 0; i < n; i++)
        s[i] = val(rank, i), r[i] = -1;
    base = recv_dones();
    store_meet(store, size, "large-start");
    CHECK(xccl_isend(c, s, n * 4, (rank + 1) % size, 60, &ws) == XCCL_OK);
    await_arrivals(base, 1, "large send");
    CHECK(xccl_irecv(c, r, n * 4, (rank + size - 1) % size, 60, &wr) == XCCL_OK);
    wait_release(ws, XCCL_OK, "large send");
    wait_release(wr, XCCL_OK, "large receive");
    for (size_t i = 0; i < n; i++)
        bad += r[i] != val((rank + size - 1) % size, i);
    CHECK_MSG(bad == 0, "large staged receive: %zu wrong values", bad);
    store_meet(store, size, "large-done");
    CHECK(xccl_comm_mem_invalidate(c, s, bytes) == XCCL_OK);
    CHECK(xccl_comm_mem_invalidate(c, r, bytes) == XCCL_OK);
    free(s);
    free(r);
}

static int part_regtcp(int rank, int size)
{
    xccl_store_t *store;
    xccl_comm_t  *c;
    size_t        n = 5000, bytes = n * (size_t)size * 4;
    float        *s = page_alloc(bytes), *r = page_alloc(bytes);
    long          s0, r0;

    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-regpath-%d-%d-tcp", (int)getppid(),
             size);
    c = comm_new(rank, size, "regtcp", &store);
    if (c == NULL) return 2;
    CHECK(strcmp(xccl_comm_peer_transport(c, (rank + 1) % size), "regtcp") == 0);

    for (uint32_t tag = 1; tag <= 3; tag++)
        p2p_ring(c, s, r, tag == 2 ? n : 33, tag);
    colls_all(c, s, r, 33);
    colls_all(c, s, r, n);
    rt_check_clean("first use");
    CHECK(rt_regs_over(s, bytes) > 0 && rt_regs_over(r, bytes) > 0);

    /* the same buffers again: cache hits only */
    s0 = rt_regs_over(s, bytes);
    r0 = rt_regs_over(r, bytes);
    p2p_ring(c, s, r, n, 4);
    colls_all(c, s, r, 33);
    colls_all(c, s, r, n);
    CHECK_MSG(rt_regs_over(s, bytes) == s0 && rt_regs_over(r, bytes) == r0,
              "reused buffers registered again: %ld -> %ld and %ld -> %ld", s0,
              rt_regs_over(s, bytes), r0, rt_regs_over(r, bytes));

    /* invalidated: gone now (nothing in flight), registered again by the next use, the other
     * buffer untouched */
    CHECK(xccl_comm_mem_invalidate(c, s, bytes) == XCCL_OK);
    CHECK_MSG(rt_live_over(s, bytes, NULL) == 0, "a registration of s outlived invalidation");
    CHECK(rt_live_over(r, bytes, NULL) > 0);
    p2p_ring(c, s, r, n, 5);
    CHECK_MSG(rt_regs_over(s, bytes) == s0 + 1 && rt_regs_over(r, bytes) == r0,
              "after invalidation: %ld -> %ld (want one more), %ld -> %ld", s0,
              rt_regs_over(s, bytes), r0, rt_regs_over(r, bytes));
    (void)coll_one(c, XCCL_COLL_ALLREDUCE, "ring", 0, s, r, n);
    CHECK(rt_regs_over(s, bytes) == s0 + 1);

    if (size >= 2) inflight_invalidate(c, store);
    freed_and_reused(c, store);
    large(c, store);
    rt_check_clean("regtcp");
    CHECK_MSG(rt_live_unmapped() == 0, "%d registration(s) of unmapped memory are cached",
              rt_live_unmapped());

    xccl_comm_destroy(c);
    xccl_store_release(store);
    pthread_mutex_lock(&rt.lock);
    CHECK_MSG(rt.n_reg > 0 && rt.n_reg == rt.n_dereg,
              "after destroy: %ld registered, %ld "
              "deregistered",
              rt.n_reg, rt.n_dereg);
    CHECK(rt.nsends == 0 && rt.nrecvs == 0);
    pthread_mutex_unlock(&rt.lock);
    rt_check_clean("regtcp destroyed");
    free(s);
    free(r);
    return 0;
}

/* ---- part 2: staged messages into device memory
 * --------------------------------------------------- */

/* The fake device executor with its copies out of host memory (the core's staged messages:
 * everything else the core copies for a device receive is device memory) followed from issue
 * to the test that finds them done. */
enum { MAXEV = 256 };
static struct {
    long  staged_issued, staged_done;
    void *ev[MAXEV];
    int   nev;
} sx;

static int fdev_owns(const void *p)
{
    for (size_t i = 0; i < fdev.nreg; i++)
        if ((const char *)p >= (char *)fdev.reg[i].p &&
            (const char *)p < (char *)fdev.reg[i].p + fdev.reg[i].len)
            return 1;
    return 0;
}

static xccl_status_t sx_copy(void *q, void *dst, const void *src, size_t nbytes, void **ev)
{
    xccl_status_t st = fdev_copy(q, dst, src, nbytes, ev);

    if (st == XCCL_INPROGRESS && !fdev_owns(src) && fdev_owns(dst)) {
        pthread_mutex_lock(&rt.lock);
        sx.staged_issued++;
        if (sx.nev < MAXEV) sx.ev[sx.nev++] = *ev;
        pthread_mutex_unlock(&rt.lock);
    }
    return st;
}

static xccl_status_t sx_test(void *ev)
{
    xccl_status_t st = fdev_test(ev);

    if (st != XCCL_INPROGRESS) {
        pthread_mutex_lock(&rt.lock);
        for (int i = 0; i < sx.nev; i++) {
            if (sx.ev[i] != ev) continue;
            sx.ev[i] = sx.ev[--sx.nev];
            sx.staged_done++;
            break;
        }
        pthread_mutex_unlock(&rt.lock);
    }
    return st;
}

static long recv_dones(void)
{
    long k;
    pthread_mutex_lock(&rt.lock);
    k = rt.recv_done_calls;
    pthread_mutex_unlock(&rt.lock);
    return k;
}

/* Progress until `want` more messages than `base` fully arrived (the core staged them: no
 * receive is posted for them yet). */
static void await_arrivals(long base, long want, const char *what)
{
    for (int i = 0; i < 20000 && recv_dones() < base + want; i++)
        usleep(1000);
    CHECK_MSG(recv_dones() >= base + want, "%s: %ld of %ld messages arrived", what,
              recv_dones() - base, want);
}

/* After the Work of a receive into device memory completed: its staged copies were issued and
 * all of them finished before. */
static void check_staged(long before, const char *what)
{
    pthread_mutex_lock(&rt.lock);
    CHECK_MSG(sx.staged_issued > before && sx.staged_done == sx.staged_issued && sx.nev == 0,
              "%s: %ld staged copies issued (before %ld), %ld finished", what, sx.staged_issued,
              before, sx.staged_done);
    pthread_mutex_unlock(&rt.lock);
}

static long staged_issued(void)
{
    long k;
    pthread_mutex_lock(&rt.lock);
    k = sx.staged_issued;
    pthread_mutex_unlock(&rt.lock);
    return k;
}

/* A rooted collective in device memory whose senders finished before the receiver posted:
 * broadcast (root size - 1 ran ahead) and gather (every rank but root 0 ran ahead), both
 * "linear" (one message from each sender); then an allreduce that rank 0 joins only after a
 * message of it arrived. */
static void staged_colls(xccl_comm_t *c, xccl_store_t *store)
{
    int              rank = xccl_comm_rank(c), size = xccl_comm_size(c);
    size_t           n = 2000, tot = n * (size_t)size, bad = 0;
    float           *s = fdev_alloc(tot * 4), *r = fdev_alloc(tot * 4);
    xccl_coll_opts_t opts = {.algo = "linear", .mem = XCCL_MEM_CUDA};
    xccl_work_t     *w    = NULL;
    long             base, before;

    /* broadcast from size - 1 */
    for (size_t i = 0; i < tot; i++)
        s[i] = rank == size - 1 ? val(rank, i) : -7;
    base = recv_dones();
    store_meet(store, size, "bcast-start");
    if (rank == size - 1)
        wait_release(w, xccl_broadcast(c, s, n, XCCL_FLOAT32, rank, &opts, &w), "bcast root");
    store_meet(store, size, "bcast-root-done");
    if (rank != size - 1) {
        await_arrivals(base, 1, "broadcast");
        before = staged_issued();
        wait_release(w, xccl_broadcast(c, s, n, XCCL_FLOAT32, size - 1, &opts, &w), "bcast");
        check_staged(before, "broadcast");
        for (size_t i = 0; i < n; i++)
            bad += s[i] != val(size - 1, i);
        CHECK_MSG(bad == 0, "staged broadcast: %zu wrong values", bad);
    }

    /* gather to 0 */
    for (size_t i = 0; i < tot; i++)
        s[i] = val(rank, i), r[i] = -7;
    base = recv_dones();
    store_meet(store, size, "gather-start");
    if (rank != 0)
        wait_release(w, xccl_gather(c, s, r, n, XCCL_FLOAT32, 0, &opts, &w), "gather leaf");
    store_meet(store, size, "gather-leaves-done");
    if (rank == 0) {
        await_arrivals(base, size - 1, "gather");
        before = staged_issued();
        wait_release(w, xccl_gather(c, s, r, n, XCCL_FLOAT32, 0, &opts, &w), "gather root");
        check_staged(before, "gather");
        for (size_t i = 0; i < tot; i++)
            bad += r[i] != val((int)(i / n), i % n);
        CHECK_MSG(bad == 0, "staged gather: %zu wrong values", bad);
    }

    /* allreduce (ring), rank 0 late */
    opts.algo = "ring";
    for (size_t i = 0; i < tot; i++)
        s[i] = val(rank, i), r[i] = -7;
    base = recv_dones();
    store_meet(store, size, "allreduce-start");
    if (rank != 0)
        CHECK(xccl_allreduce(c, s, r, n, XCCL_FLOAT32, XCCL_OP_SUM, &opts, &w) == 0);
    else
        await_arrivals(base, 1, "allreduce");
    if (rank == 0) {
        before = staged_issued();
        CHECK(xccl_allreduce(c, s, r, n, XCCL_FLOAT32, XCCL_OP_SUM, &opts, &w) == XCCL_OK);
    }
    wait_release(w, XCCL_OK, "allreduce");
    if (rank == 0) check_staged(before, "allreduce");
    for (size_t i = 0; i < n; i++)
        bad += r[i] != sum_at(size, i);
    CHECK_MSG(bad == 0, "allreduce with a late rank: %zu wrong values", bad);
    store_meet(store, size, "staged-done");
    CHECK(xccl_comm_mem_invalidate(c, s, tot * 4) == XCCL_OK);
    CHECK(xccl_comm_mem_invalidate(c, r, tot * 4) == XCCL_OK);
    fdev_free(s);
    fdev_free(r);
}

static int part_regdev(int rank, int size)
{
    static xccl_exec_ops_t ops;
    xccl_store_t          *store;
    xccl_comm_t           *c;

    ops      = fdev_ops;
    ops.copy = sx_copy;
    ops.test = sx_test;
    fdev_open(1); /* the transport reads and writes this memory directly */
    CHECK(xccl_exec_set_for_test(XCCL_MEM_CUDA, &ops) == NULL);
    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-regpath-%d-%d-dev", (int)getppid(),
             size);
    c = comm_new(rank, size, "regdev", &store);
    if (c == NULL) return 2;
    staged_colls(c, store);
    rt_check_clean("regdev");
    xccl_comm_destroy(c);
    xccl_store_release(store);
    pthread_mutex_lock(&rt.lock);
    CHECK_MSG(rt.n_reg == rt.n_dereg, "after destroy: %ld registered, %ld deregistered", rt.n_reg,
              rt.n_dereg);
    pthread_mutex_unlock(&rt.lock);
    CHECK_MSG(fdev.live == 0, "%zu executor events never released", fdev.live);
    return 0;
}

static int child(int rank, int size, void *unused)
{
    (void)unused;
    int rc;

    /* a fixed threshold (glibc raises it after freeing a mapped chunk otherwise): every buffer
     * of 64 KiB and more is mapped when allocated and unmapped when freed, which
     * rt_live_unmapped sees */
    mallopt(M_MMAP_THRESHOLD, 64 * 1024);
    rc = part_regtcp(rank, size);
    if (rc == 0) rc = part_regdev(rank, size);
    if (rank == 0)
        printf("size %d rank 0: %d checks, %d failed, %ld registrations\n", size, ctest_checks,
               ctest_failures, rt.n_reg);
    fflush(stdout);
    return rc != 0 ? rc : ctest_failures != 0;
}

int main(void)
{
    static const int sizes[] = {2, 3};
    int              failed  = 0;

    if (xccl_transport_register(&regtcp_ops) != XCCL_OK ||
        xccl_transport_register(&regdev_ops) != XCCL_OK) {
        fprintf(stderr, "registering the transports: %s\n", xccl_last_error());
        return 1;
    }
    for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
        int  size = sizes[k];
        char path[256];
        failed += ctest_fork_ranks("test_regpath", size, child, NULL);
        for (int t = 0; t < 2; t++) {
            snprintf(path, sizeof(path), "/tmp/xccl-test-regpath-%d-%d-%s", (int)getpid(), size,
                     t ? "dev" : "tcp");
            unlink(path);
        }
    }
    ctest_checks++;
    if (failed) ctest_failures++;
    CTEST_MAIN_END("test_regpath");
}
