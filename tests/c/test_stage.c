/* SPDX-License-Identifier: Apache-2.0
 *
 * test_stage.c - device memory staged through host bounce buffers (ctx.c, "Staging"), end to
 * end: forked ranks over transports that move host memory only, with the fake asynchronous
 * executor of fake_dev.h installed for XCCL_MEM_CUDA and its memory kept PROT_NONE except while
 * the test fills or checks it (or the executor runs): a transport or the core touching device
 * memory crashes the rank (or gets EFAULT from the kernel), which fails the test.
 *   - over "tcp": point-to-point of device buffers (0, 1, small, odd and several-MiB sizes) in
 *     a ring, device to host and host to device, messages that arrive before their receive is
 *     posted, any-source receives, allreduce and allgather with opts.mem = XCCL_MEM_CUDA for
 *     every applicable algorithm; a small pool ($XCCL_STAGE_BYTES) with sends and receives
 *     both ways in flight at once and a message larger than the pool; a failing executor copy
 *     fails the send with a named error and the communicator stays usable; a send whose copy
 *     into its bounce buffer does not finish times out (named), and its buffer returns to the
 *     pool only once the copy has finished; a peer leaving while the copy runs fails the send
 *     naming it.
 *   - over "regtcp" (tcp wrapped to need registration, counting registrations and checking that
 *     every buffer it is handed is registered host memory): the bounce buffers are registered
 *     once across many operations.
 * Every result is compared with values computed independently from the rank and index.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "algo/algo.h"
#include "core/core.h"
#include "ctest.h"
#include "devp2p.h"
#include "fake_dev.h"
#include "tp_wrap.h"
#include "xccl/xccl.h"
#include "xccl/xccl_transport.h"

/* ---- regtcp: tcp that needs registration ------------------------------------------------- */

enum { RG_MAX = 4096 };

struct xccl_tp_ctx {
    tpw_t w;
};

static struct {
    pthread_mutex_t lock;
    uintptr_t       start[RG_MAX], end[RG_MAX];
    int             live[RG_MAX];
    int             n;
    _Atomic long regs, big, bad; /* big: of 64 KiB and more (bounce buffers, not barrier bytes) */
} rg = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* Whether [p, p + n) lies in a live registration `mr` (an index + 1). */
static int rg_covered(const void *mr, const void *p, size_t n)
{
    intptr_t k = (intptr_t)mr - 1;
    int      ok;

    if (n == 0) return 1;
    pthread_mutex_lock(&rg.lock);
    ok = mr != NULL && k >= 0 && k < rg.n && rg.live[k] && (uintptr_t)p >= rg.start[k] &&
         (uintptr_t)p + n <= rg.end[k];
    pthread_mutex_unlock(&rg.lock);
    return ok;
}

static xccl_status_t r_mem_reg(xccl_tp_ctx_t *c, void *ptr, size_t nbytes, xccl_mem_type_t mem,
                               void **mr)
{
    (void)c;
    if (mem != XCCL_MEM_HOST) {
        rg.bad++;
        return XCCL_ERR_NOT_SUPPORTED;
    }
    pthread_mutex_lock(&rg.lock);
    if (rg.n == RG_MAX) {
        pthread_mutex_unlock(&rg.lock);
        return XCCL_ERR_NO_MEMORY;
    }
    rg.start[rg.n] = (uintptr_t)ptr;
    rg.end[rg.n]   = (uintptr_t)ptr + nbytes;
    rg.live[rg.n]  = 1;
    *mr            = (void *)(intptr_t)(++rg.n);
    pthread_mutex_unlock(&rg.lock);
    rg.regs++;
    if (nbytes >= (64u << 10)) rg.big++;
    return XCCL_OK;
}

static void r_mem_dereg(xccl_tp_ctx_t *c, void *mr)
{
    (void)c;
    pthread_mutex_lock(&rg.lock);
    rg.live[(intptr_t)mr - 1] = 0;
    pthread_mutex_unlock(&rg.lock);
}

static xccl_status_t r_recv_match(void *core, int peer, const xccl_msg_hdr_t *hdr,
                                  xccl_tp_buf_t *dst, void **cookie)
{
    xccl_status_t st = tpw_up_recv_match(core, peer, hdr, dst, cookie);

    if (st == XCCL_OK && dst->ptr != NULL &&
        (dst->mem != XCCL_MEM_HOST || !rg_covered(dst->mr, dst->ptr, hdr->nbytes))) {
        fprintf(stderr, "regtcp: receive into memory type %d mr %p ptr %p n %llu\n", dst->mem,
                dst->mr, dst->ptr, (unsigned long long)hdr->nbytes);
        rg.bad++;
    }
    return st;
}

static xccl_status_t r_init(const xccl_tp_init_params_t *params, xccl_tp_ctx_t **out)
{
    static const xccl_tp_upcalls_t shim = {.recv_match = r_recv_match};

    return tpw_init(params, out, sizeof(xccl_tp_ctx_t), "tcp", &shim);
}

static xccl_status_t r_isend(xccl_tp_ctx_t *c, int peer, const xccl_msg_hdr_t *hdr,
                             const xccl_tp_buf_t *buf, void *cookie)
{
    if (buf->mem != XCCL_MEM_HOST || !rg_covered(buf->mr, buf->ptr, hdr->nbytes)) {
        fprintf(stderr, "regtcp: send from memory type %d mr %p ptr %p n %llu\n", buf->mem, buf->mr,
                buf->ptr, (unsigned long long)hdr->nbytes);
        rg.bad++;
    }
    return tpw_isend(c, peer, hdr, buf, cookie);
}

static const xccl_transport_ops_t regtcp_ops = {
    .abi_version = XCCL_TRANSPORT_ABI_VERSION,
    .name        = "regtcp",
    .caps        = XCCL_TP_CAP_HOST_MEM | XCCL_TP_CAP_NEEDS_REG,
    .priority    = 1,
    .init        = r_init,
    .finalize    = tpw_finalize,
    .reachable   = tpw_reachable,
    .get_addr    = tpw_get_addr,
    .wireup      = tpw_wireup,
    .isend       = r_isend,
    .progress    = tpw_progress,
    .wait        = tpw_wait,
    .wake        = tpw_wake,
    .close_peer  = tpw_close_peer,
    .mem_reg     = r_mem_reg,
    .mem_dereg   = r_mem_dereg,
};

/* ---- helpers -------------------------------------------------------------------------------- */

static xccl_comm_t *comm_new(int rank, int size, const char *tps)
{
    char path[300];

    xccl_comm_t *c;

    snprintf(path, sizeof(path), "%s-%d", store_path, store_gen++);
    c        = ctest_file_comm(path, rank, size, 30000, "stage", tps);
    dev_lock = c != NULL ? &c->ctx->lock : NULL;
    return c;
}

static uint64_t ctx_stat(xccl_comm_t *c, int which)
{
    xccl_ctx_t *ctx = c->ctx;
    uint64_t    v;

    pthread_mutex_lock(&ctx->lock);
    v = which == 0 ? ctx->stage_allocs : which == 1 ? ctx->stage_sends : ctx->stage_recvs;
    pthread_mutex_unlock(&ctx->lock);
    return v;
}

/* ---- tests ---------------------------------------------------------------------------------- */

/* Posts the exchange's send after a pause, from another thread: the receive posted before it
 * stays unfinished meanwhile. */
typedef struct late_send {
    xccl_comm_t     *c;
    void            *buf;
    int              to;
    xccl_p2p_opts_t *o;
    xccl_work_t     *w;
} late_send_t;

static void *late_send(void *arg)
{
    late_send_t *l = arg;

    usleep(1500 * 1000);
    CHECK(xccl_isend_opts(l->c, l->buf, 64, l->to, 89, l->o, &l->w) == XCCL_OK);
    return NULL;
}

/* Streams (exec.h): an operation on device memory is ordered after the caller's stream before
 * it queues anything and takes a gate when posted, which opens exactly once however it ends.
 * xccl_work_wait_stream (xccl.h) queues a wait on the gate of a running Work without waiting on
 * the CPU (here, for a send that comes 1.5 s late); it answers at once when the Work is done,
 * and refuses a host-memory Work. (A failed Work: test_copy_failure.) */
static void test_streams(xccl_comm_t *c)
{
    int              rank = xccl_comm_rank(c), size = xccl_comm_size(c);
    int              to = (rank + 1) % size, from = (rank + size - 1) % size;
    void            *stream = (void *)(uintptr_t)(0x5000 + rank), *other = (void *)0x77;
    xccl_p2p_opts_t  o      = {.mem = XCCL_MEM_CUDA, .stream = stream};
    xccl_coll_opts_t co     = {.mem = XCCL_MEM_CUDA, .stream = stream, .algo = "ring"};
    void            *s = dalloc(4096), *r = dalloc(4096), *h = mem_alloc(XCCL_MEM_HOST, 8);
    void            *s1 = dalloc(64), *r1 = dalloc(64);
    xccl_work_t     *ws = NULL, *wr = NULL, *wh = NULL, *wr1 = NULL;
    unsigned         orders = fgate.orders, waits;
    uint64_t         gr, t0;
    late_send_t      late = {c, s1, to, &o, NULL};
    pthread_t        th;

    fill(s, 4096, rank, 40);
    fill(s1, 64, rank, 41);
    /* an exchange whose sends come 300 ms late, then a receive whose send is posted only after
     * a barrier (still running when asked) */
    CHECK(xccl_irecv_opts(c, r1, 64, from, 89, &o, &wr1) == XCCL_OK);
    CHECK(xccl_irecv_opts(c, r, 4096, from, 90, &o, &wr) == XCCL_OK);
    CHECK_MSG(fgate.orders == orders + 2 && fgate.order_stream == stream, "orders %u",
              fgate.orders - orders);
    gr = wr->gate;
    CHECK(wr->gate_exec == &fdev_ops && fgate_state(gr) == FGATE_CLOSED);
    CHECK(pthread_create(&th, NULL, late_send, &late) == 0);
    waits = fgate.waits;
    t0    = xccl_now_ns();
    CHECK(xccl_work_wait_stream(wr1, other) == XCCL_OK);
    CHECK_MSG(xccl_work_status(wr1) == XCCL_INPROGRESS && xccl_now_ns() - t0 < 1000000000ull,
              "wait_stream returned after %.0f ms, the receive %s",
              (double)(xccl_now_ns() - t0) / 1e6, xccl_status_string(xccl_work_status(wr1)));
    CHECK_MSG(fgate.waits == waits + 1 && fgate.wait_ticket == wr1->gate &&
                  fgate.wait_stream == other,
              "wait_stream while running: %u waits", fgate.waits - waits);
    waits = fgate.waits;
    CHECK(xccl_work_wait_stream(wr, other) == XCCL_OK);
    CHECK_MSG(fgate.waits == waits + 1 && fgate.wait_ticket == gr && fgate.wait_stream == other,
              "wait_stream while running: %u waits, ticket %llu", fgate.waits - waits,
              (unsigned long long)fgate.wait_ticket);
    CHECK(xccl_work_status(wr) == XCCL_INPROGRESS);
    CHECK(pthread_join(th, NULL) == 0);
    if (wait_ok(wr1, "streams exchange") == XCCL_OK)
        (void)check(r1, 64, 64, from, 41, "streams exchange");
    /* finished: nothing to queue */
    waits = fgate.waits;
    CHECK(xccl_work_wait_stream(wr1, stream) == XCCL_OK && fgate.waits == waits);
    if (late.w != NULL) {
        (void)wait_ok(late.w, "streams late send");
        xccl_work_release(late.w);
    }
    xccl_work_release(wr1);
    sync_all(c);
    CHECK(xccl_isend_opts(c, s, 4096, to, 90, &o, &ws) == XCCL_OK);
    if (wait_ok(ws, "streams send") == XCCL_OK && wait_ok(wr, "streams recv") == XCCL_OK) {
        (void)check(r, 4096, 4096, from, 40, "streams recv");
        CHECK(fgate_state(gr) == FGATE_OPEN && fgate_state(ws->gate) == FGATE_OPEN);
        waits = fgate.waits;
        CHECK(xccl_work_wait_stream(wr, stream) == XCCL_OK && fgate.waits == waits);
    }
    /* a collective (the core orders it before its prologue's first copy) */
    xccl_work_release(ws);
    ws     = NULL;
    orders = fgate.orders;
    if (xccl_allreduce(c, s, r, 1024, XCCL_FLOAT32, XCCL_OP_SUM, &co, &ws) == XCCL_OK) {
        CHECK_MSG(fgate.orders == orders + 1 && fgate.order_stream == stream, "allreduce: %u "
                  "order_after calls", fgate.orders - orders);
        (void)wait_ok(ws, "streams allreduce");
        CHECK(fgate_state(ws->gate) == FGATE_OPEN);
    }
    /* the caller's stream behind (order_after answers with an event): the operations start
     * once it completes, and a host message posted after a held device one to the same peer
     * and tag still matches second */
    fgate.order_behind = 1;
    {
        uint64_t hs = 0x1234567800000000ull + (uint64_t)rank, hr = 0;
        xccl_work_t *w4[4] = {NULL, NULL, NULL, NULL};
        int ok = xccl_irecv_opts(c, r, 4096, from, 92, &o, &w4[0]) == XCCL_OK &&
                 xccl_irecv(c, &hr, 8, from, 92, &w4[1]) == XCCL_OK &&
                 xccl_isend_opts(c, s, 4096, to, 92, &o, &w4[2]) == XCCL_OK &&
                 xccl_isend(c, &hs, 8, to, 92, &w4[3]) == XCCL_OK;
        CHECK_MSG(ok, "held p2p: %s", xccl_last_error());
        for (int i = 0; i < 4 && ok; i++)
            ok = wait_ok(w4[i], "held p2p") == XCCL_OK;
        if (ok) {
            (void)check(r, 4096, 4096, from, 40, "held device receive");
            CHECK_MSG(hr == 0x1234567800000000ull + (uint64_t)from, "held p2p: host message "
                      "%llx out of order", (unsigned long long)hr);
        }
        for (int i = 0; i < 4; i++)
            if (w4[i]) xccl_work_release(w4[i]);
        xccl_work_release(ws);
        ws = NULL;
        if (xccl_allreduce(c, s, r, 1024, XCCL_FLOAT32, XCCL_OP_SUM, &co, &ws) == XCCL_OK &&
            wait_ok(ws, "held allreduce") == XCCL_OK) {
            float got[4], want[4] = {0, 0, 0, 0};
            dlock();
            fdev_open(1);
            memcpy(got, r, sizeof(got));
            for (int q = 0; q < size; q++)
                for (int i = 0; i < 4; i++) {
                    float v;
                    uint8_t b[4];
                    for (int k = 0; k < 4; k++)
                        b[k] = pat(q, (size_t)(i * 4 + k), 40);
                    memcpy(&v, b, 4);
                    want[i] += v;
                }
            fdev_open(0);
            dunlock();
            CHECK_MSG(memcmp(got, want, sizeof(got)) == 0 ||
                          (got[0] == want[0] && got[1] == want[1]),
                      "held allreduce: %g %g, want %g %g", got[0], got[1], want[0], want[1]);
        }
    }
    fgate.order_behind = 0;
    /* host memory: no gate to wait on */
    if (xccl_isend(c, h, 8, to, 91, &wh) == XCCL_OK) {
        CHECK(xccl_work_wait_stream(wh, stream) == XCCL_ERR_INVALID_USAGE);
        CHECK(wh->gate_exec == NULL);
        xccl_work_release(wh);
        if (xccl_irecv(c, h, 8, from, 91, &wh) == XCCL_OK) (void)wait_ok(wh, "host recv");
    }
    if (wh) xccl_work_release(wh);
    if (ws) xccl_work_release(ws);
    xccl_work_release(wr);
    dfree(s);
    dfree(r);
    dfree(s1);
    dfree(r1);
    free(h);
}

/* A failing executor copy fails the send with a named error; nothing reaches the peer and
 * the communicator stays usable. */
static xccl_status_t bad_copy(void *q, void *dst, const void *src, size_t n, void **ev)
{
    (void)q, (void)dst, (void)src, (void)n;
    *ev = NULL;
    return XCCL_ERR_CUDA;
}

static void test_copy_failure(xccl_comm_t *c)
{
    xccl_exec_ops_t        bad = fdev_ops;
    const xccl_exec_ops_t *old;
    void                  *b = dalloc(1000);
    xccl_work_t           *w = NULL;

    if (xccl_comm_rank(c) == 0) {
        bad.copy = bad_copy;
        old      = xccl_exec_set_for_test(XCCL_MEM_CUDA, &bad);
        if (post(c, 1, b, 1000, 1, 70, XCCL_MEM_CUDA, &w) == XCCL_OK) {
            xccl_status_t st = xccl_work_wait(w, -1);
            CHECK_MSG(st == XCCL_ERR_CUDA, "copy failure: %s", xccl_status_string(st));
            CHECK_MSG(strstr(xccl_work_error(w), "copy into the host staging buffer failed") &&
                          strstr(xccl_work_error(w), "rank 1"),
                      "copy failure: '%s'", xccl_work_error(w));
            /* a failed Work opened its gate and reports its error to a stream waiter */
            CHECK(fgate_state(w->gate) == FGATE_OPEN);
            CHECK(xccl_work_wait_stream(w, NULL) == XCCL_ERR_CUDA);
            xccl_work_release(w);
        }
        xccl_exec_set_for_test(XCCL_MEM_CUDA, old);
    }
    dfree(b);
}

/* Both directions at once with a pool smaller than what is in flight, plus a message larger
 * than the pool: no deadlock, right data. */
static void test_small_pool(xccl_comm_t *c)
{
    int rank = xccl_comm_rank(c), peer = 1 - rank;
    enum { N = 6 };
    size_t       n[N + 1];
    void        *s[N + 1], *r[N + 1];
    xccl_work_t *ws[N + 1] = {0}, *wr[N + 1] = {0};

    if (rank > 1) return;
    for (int k = 0; k <= N; k++) {
        n[k] = k == N ? (1u << 20) + 3 : 200000 + (size_t)k * 11; /* pool: 256 KiB */
        s[k] = dalloc(n[k]);
        r[k] = dalloc(n[k]);
        fill(s[k], n[k], rank, 80 + k);
    }
    for (int k = 0; k <= N; k++) {
        (void)post(c, 1, s[k], n[k], peer, 80, XCCL_MEM_CUDA, &ws[k]);
        (void)post(c, 0, r[k], n[k], peer, 80, XCCL_MEM_CUDA, &wr[k]);
    }
    for (int k = 0; k <= N; k++) {
        char what[64];
        snprintf(what, sizeof(what), "small pool #%d rank %d", k, rank);
        if (ws[k]) (void)wait_ok(ws[k], what);
        if (wr[k] && wait_ok(wr[k], what) == XCCL_OK)
            (void)check(r[k], n[k], n[k], peer, 80 + k, what);
    }
    for (int k = 0; k <= N; k++) {
        if (ws[k]) xccl_work_release(ws[k]);
        if (wr[k]) xccl_work_release(wr[k]);
        dfree(s[k]);
        dfree(r[k]);
    }
}

/* Many exchanges of a 1 MiB device buffer over regtcp, each receive posted before the peer
 * sends (a barrier between): after the first round, no new registration of a large buffer and
 * no new bounce buffer - the pool's buffers hit the registration cache every time. */
static void test_registered_once(xccl_comm_t *c)
{
    int      rank = xccl_comm_rank(c), size = xccl_comm_size(c);
    size_t   n = 1u << 20;
    void    *s = dalloc(n), *r = dalloc(n);
    uint64_t recvs0 = 0;

    for (int it = 0; it < 12; it++) {
        int          to = (rank + 1) % size, from = (rank + size - 1) % size;
        xccl_work_t *ws = NULL, *wr = NULL;
        fill(s, n, rank, 90 + it);
        if (post(c, 0, r, n, from, 90, XCCL_MEM_CUDA, &wr) == XCCL_OK) {
            sync_all(c);
            if (post(c, 1, s, n, to, 90, XCCL_MEM_CUDA, &ws) == XCCL_OK &&
                wait_ok(ws, "reg once") == XCCL_OK && wait_ok(wr, "reg once") == XCCL_OK)
                (void)check(r, n, n, from, 90 + it, "reg once");
        }
        if (ws) xccl_work_release(ws);
        if (wr) xccl_work_release(wr);
        if (it == 1) recvs0 = ctx_stat(c, 2);
    }
    /* a send and a receive in flight at once need two buffers, one after the other only one
     * (timing): at most two bounce buffers over the twelve rounds, each registered once (the
     * device buffers never are: regtcp refuses device memory) */
    CHECK_MSG(ctx_stat(c, 0) >= 1 && ctx_stat(c, 0) <= 2 && rg.big == (long)ctx_stat(c, 0),
              "%llu bounce buffers, %ld registrations of 64 KiB or more",
              (unsigned long long)ctx_stat(c, 0), (long)rg.big);
    CHECK_MSG(ctx_stat(c, 2) == recvs0 + 10, "staged receives %llu -> %llu",
              (unsigned long long)recvs0, (unsigned long long)ctx_stat(c, 2));
    dfree(s);
    dfree(r);
}

/* An executor whose copies stay in progress until the test lets them finish. */
static _Atomic int stuck;
static int         stuck_ev;

static xccl_status_t stuck_copy(void *q, void *dst, const void *src, size_t n, void **ev)
{
    (void)q, (void)dst, (void)src, (void)n;
    *ev = &stuck_ev;
    return XCCL_INPROGRESS;
}

static xccl_status_t stuck_test(void *ev)
{
    (void)ev;
    return stuck ? XCCL_INPROGRESS : XCCL_OK;
}

static void stage_counts(xccl_comm_t *c, int *inuse, int *queued)
{
    xccl_ctx_t *ctx = c->ctx;

    pthread_mutex_lock(&ctx->lock);
    *inuse  = ctx->stage_inuse;
    *queued = ctx->stage_head != NULL;
    pthread_mutex_unlock(&ctx->lock);
}

/* Rank 0's staged send whose copy into the bounce buffer does not finish: (1) on comm `b` (a
 * short timeout) the send times out with a named error while the bounce buffer stays taken
 * until the copy has finished; (2) on comm `b2` (a long timeout) the peer leaves while the copy
 * runs: once it finishes, the send fails naming the peer. Rank 1 meanwhile waits on comm `a`. */
static void test_stuck(xccl_comm_t *a, xccl_comm_t *b, xccl_comm_t *b2)
{
    int                    rank = xccl_comm_rank(a);
    xccl_exec_ops_t        slow = fdev_ops;
    const xccl_exec_ops_t *old;
    void                  *buf = dalloc(5000);
    xccl_work_t           *w   = NULL;
    int                    inuse, queued;

    if (rank == 0) {
        slow.copy = stuck_copy;
        slow.test = stuck_test;
        old       = xccl_exec_set_for_test(XCCL_MEM_CUDA, &slow);
        stuck     = 1;
        if (post(b, 1, buf, 5000, 1, 100, XCCL_MEM_CUDA, &w) == XCCL_OK) {
            xccl_status_t st = xccl_work_wait(w, -1);
            CHECK_MSG(st == XCCL_ERR_TIMEOUT, "stuck copy: %s (%s)", xccl_status_string(st),
                      xccl_work_error(w));
            stage_counts(b, &inuse, &queued);
            CHECK_MSG(inuse == 1 && queued, "timed out during its copy: %d in use, queued %d",
                      inuse, queued);
            stuck = 0; /* the copy finishes: the buffer goes back, nothing is sent */
            for (int i = 0; i < 2000 && (inuse || queued); i++) {
                usleep(1000);
                stage_counts(b, &inuse, &queued);
            }
            CHECK_MSG(inuse == 0 && !queued, "after the copy: %d in use, queued %d", inuse, queued);
            xccl_work_release(w);
            w = NULL;
        }
        xccl_exec_set_for_test(XCCL_MEM_CUDA, old);
        /* (1b) a collective a stream waits for times out - the peers never join: the stream
         * goes on when the gate opens, so the communicator refuses every later call, naming
         * the failure */
        {
            xccl_coll_opts_t co = {.mem = XCCL_MEM_CUDA, .stream = (void *)0x99, .algo = "ring"};
            void            *r  = dalloc(4096);
            xccl_work_t     *w2 = NULL;
            if (xccl_allreduce(b, buf, r, 1024, XCCL_FLOAT32, XCCL_OP_SUM, &co, &w) == XCCL_OK) {
                CHECK(xccl_work_wait_stream(w, (void *)0x98) == XCCL_OK);
                CHECK(fgate_state(w->gate) == FGATE_CLOSED);
                CHECK(xccl_work_wait(w, -1) == XCCL_ERR_TIMEOUT);
                CHECK(fgate_state(w->gate) == FGATE_OPEN);
                CHECK(xccl_allreduce(b, buf, r, 1024, XCCL_FLOAT32, XCCL_OP_SUM, &co, &w2) ==
                      XCCL_ERR_REMOTE);
                CHECK_MSG(strstr(xccl_last_error(), "refused") != NULL &&
                              strstr(xccl_last_error(), "timed out") != NULL,
                          "after a failure a stream waited for: %s", xccl_last_error());
                CHECK(w2 == NULL);
                xccl_work_release(w);
                w = NULL;
            }
            dfree(r);
        }
        old = xccl_exec_set_for_test(XCCL_MEM_CUDA, &slow);
        /* (2) the peer leaves while the copy runs */
        stuck = 1;
        if (post(b2, 1, buf, 5000, 1, 101, XCCL_MEM_CUDA, &w) == XCCL_OK) {
            int dead = 0;
            sync_all(a); /* rank 1 destroys b2 now */
            for (int i = 0; i < 3000 && !dead; i++) {
                usleep(1000);
                pthread_mutex_lock(&b2->ctx->lock);
                dead = b2->ctx->peer_dead[b2->world[1]] != NULL;
                pthread_mutex_unlock(&b2->ctx->lock);
            }
            CHECK_MSG(dead, "rank 1 left comm b2 but rank 0 did not see it");
            stuck            = 0;
            xccl_status_t st = xccl_work_wait(w, -1);
            CHECK_MSG(st == XCCL_ERR_REMOTE && strstr(xccl_work_error(w), "rank 1"),
                      "peer gone during the copy: %s (%s)", xccl_status_string(st),
                      xccl_work_error(w));
            stage_counts(b2, &inuse, &queued);
            CHECK_MSG(inuse == 0 && !queued, "after the failure: %d in use, queued %d", inuse,
                      queued);
            xccl_work_release(w);
        }
        xccl_exec_set_for_test(XCCL_MEM_CUDA, old);
    } else {
        sync_all(a);
        if (rank == 1) xccl_comm_destroy(b2);
    }
    dfree(buf);
}

/* The transport of the main parts: tcp, or $XCCL_TEST_STAGE_TRANSPORT (tests/rdma: ibverbs,
 * a registering transport on a real verbs device). */
static const char *main_tps(void)
{
    const char *t = getenv("XCCL_TEST_STAGE_TRANSPORT");
    return t != NULL && *t != '\0' ? t : "tcp";
}

static int child(int rank, int size, void *unused)
{
    xccl_comm_t *c;

    (void)unused;
    CHECK(xccl_exec_set_for_test(XCCL_MEM_CUDA, &fdev_ops) == NULL);
    fdev.rng = 1 + (uint64_t)rank;
    c        = comm_new(rank, size, main_tps());
    if (c == NULL) return 2;
    test_ring(c, XCCL_MEM_CUDA, XCCL_MEM_CUDA, 0);
    test_ring(c, XCCL_MEM_CUDA, XCCL_MEM_HOST, 1);
    test_ring(c, XCCL_MEM_HOST, XCCL_MEM_CUDA, 2);
    sync_all(c);
    test_unexpected(c);
    sync_all(c);
    test_any_source(c);
    sync_all(c);
    test_colls(c, 0);
    /* the communicator's device work ran on a queue of its own (exec.h queue_new) */
    CHECK(atomic_load(&c->queue[XCCL_MEM_CUDA]) != NULL &&
          fdev_last_queue == atomic_load(&c->queue[XCCL_MEM_CUDA]));
    sync_all(c);
    test_streams(c);
    sync_all(c);
    test_copy_failure(c);
    sync_all(c);
    test_ring(c, XCCL_MEM_CUDA, XCCL_MEM_CUDA, 3); /* still usable */
    CHECK_MSG(ctx_stat(c, 1) > 0 && ctx_stat(c, 2) > 0, "staged sends %llu, receives %llu",
              (unsigned long long)ctx_stat(c, 1), (unsigned long long)ctx_stat(c, 2));
    xccl_comm_destroy(c);
    dev_lock = NULL;

    setenv("XCCL_STAGE_BYTES", "262144", 1);
    c = comm_new(rank, size, main_tps());
    unsetenv("XCCL_STAGE_BYTES");
    if (c == NULL) return 2;
    test_small_pool(c);
    sync_all(c);
    xccl_comm_destroy(c);
    dev_lock = NULL;

    {
        xccl_comm_t     *a  = comm_new(rank, size, "tcp"), *b, *b2;
        pthread_mutex_t *la = dev_lock;
        char             path[300];
        snprintf(path, sizeof(path), "%s-%d", store_path, store_gen++);
        b = ctest_file_comm(path, rank, size, 1500, "stage-b", "tcp");
        snprintf(path, sizeof(path), "%s-%d", store_path, store_gen++);
        b2       = ctest_file_comm(path, rank, size, 30000, "stage-b2", "tcp");
        dev_lock = la;
        if (a == NULL || b == NULL || b2 == NULL) return 2;
        test_stuck(a, b, b2);
        if (rank == 0) /* two communicators, two queues */
            CHECK(atomic_load(&b->queue[XCCL_MEM_CUDA]) != NULL &&
                  atomic_load(&b->queue[XCCL_MEM_CUDA]) != atomic_load(&b2->queue[XCCL_MEM_CUDA]));
        xccl_comm_destroy(b);
        if (rank != 1) xccl_comm_destroy(b2);
        sync_all(a);
        xccl_comm_destroy(a);
        dev_lock = NULL;
    }

    c = comm_new(rank, size, "regtcp");
    if (c == NULL) return 2;
    test_registered_once(c);
    test_ring(c, XCCL_MEM_CUDA, XCCL_MEM_CUDA, 4);
    sync_all(c);
    xccl_comm_destroy(c);
    dev_lock = NULL;
    CHECK_MSG(rg.bad == 0, "regtcp saw %ld unregistered or device buffers", (long)rg.bad);
    CHECK_MSG(fdev.live == 0, "executor events not released: %zu", fdev.live);
    CHECK_MSG(fdev_pin_calls > 0 && fdev_pinned == 0,
              "staging buffers: %ld pinned, %ld still pinned after their contexts",
              fdev_pin_calls, fdev_pinned);
    CHECK_MSG(fgate.marks_live == 0, "%ld stream marks neither completed nor dropped",
              fgate.marks_live);
    CHECK_MSG(fdev_queues_live == 0, "%ld executor queues outlived their communicators",
              fdev_queues_live);
    CHECK_MSG(fgate_unbalanced() == 0, "%zu of %llu completion gates not opened exactly once",
              fgate_unbalanced(), (unsigned long long)fgate.next);
    return ctest_failures != 0;
}

int main(void)
{
    static const int nranks[] = {2, 3};
    int              failed   = 0;

    if (xccl_transport_register(&regtcp_ops) != XCCL_OK) {
        fprintf(stderr, "registering regtcp: %s\n", xccl_last_error());
        return 1;
    }
    for (size_t k = 0; k < sizeof(nranks) / sizeof(nranks[0]); k++) {
        snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-stage-%d-%d", (int)getpid(),
                 nranks[k]);
        store_gen = 0;
        failed += ctest_fork_ranks("test_stage", nranks[k], child, NULL);
        for (int g = 0; g < 6; g++) {
            char path[300];
            snprintf(path, sizeof(path), "%s-%d", store_path, g);
            unlink(path);
        }
    }
    ctest_checks++;
    if (failed) ctest_failures++;
    CTEST_MAIN_END("test_stage");
}
