/* SPDX-License-Identifier: Apache-2.0
 *
 * test_cuda_ipc.c - the cuda_ipc transport (backends/cuda_ipc) without a GPU.
 *   - its handle caches (ipc_cache.c) as pure bookkeeping: hits, a stale entry (same range,
 *     another buffer id) closed, closed only once unreferenced, LRU eviction beyond the cap
 *     closing what it evicts and never an entry in use, dropping a peer;
 *   - the protocol end to end across forked ranks with the fake device (XCCL_CUDA_IPC_FAKE,
 *     test-only: "device memory" is host memory, a peer's buffer is read with process_vm_readv,
 *     copies and events run late on a fake stream) and the fake executor of fake_dev.h for
 *     XCCL_MEM_CUDA: point-to-point device<->device/host in a ring at several sizes, messages
 *     that arrive before their receive (deferred, then staged), a descriptor held back by the
 *     core with a host message behind it, any-source receives, allreduce and allgather with
 *     every applicable algorithm, host and device messages interleaved to one peer with one
 *     tag (they must match in posting order), the handle cache reused across iterations and
 *     invalidated by a reallocation, buffers legacy IPC cannot export (the host-copy
 *     fallback), handles the receiver cannot open (it asks for the bytes through host
 *     memory), a peer that exits while a device send waits for its ACK (named error, no
 *     hang), a peer that exits while the receiver's copy of its data is in flight (the copy
 *     waited for, then the receive fails naming it), and a device send nobody receives timing
 *     out (the core closes the pair). Every run checks that nothing was staged by the core: the
 * device path ran. Results are compared with values computed from rank and index.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda/ipc_cache.h"
#include "../../backends/cuda_ipc/ipc_test.h"
#include "algo/algo.h"
#include "core/core.h"
#include "ctest.h"
#include "devp2p.h"
#include "fake_dev.h"
#include "xccl/xccl.h"
#include "xccl/xccl_transport.h"

/* ---- the caches ------------------------------------------------------------------------------ */

static int closed_log[64], nclosed;

static void log_close(void *arg, void *mapped)
{
    (void)arg;
    if (nclosed < 64) closed_log[nclosed++] = (int)(intptr_t)mapped;
}

static void test_cache(void)
{
    ipc_cache_t  c;
    ipc_entry_t *a, *b, *e;

    ipc_cache_init(&c, 3, log_close, NULL);
    nclosed = 0;
    /* miss, add, hit */
    CHECK(ipc_cache_get(&c, 1, 100, 0x1000, 0x1000) == NULL);
    a = ipc_cache_add(&c, 1, 100, 0x1000, 0x1000, (void *)(intptr_t)11, NULL);
    CHECK(a != NULL && a->refs == 1);
    ipc_cache_put(&c, a);
    e = ipc_cache_get(&c, 1, 100, 0x1000, 0x1000);
    CHECK(e == a && c.hits == 1 && c.misses == 1);
    ipc_cache_put(&c, e);
    /* the same range of another peer is another allocation: no interference */
    b = ipc_cache_add(&c, 2, 100, 0x1000, 0x1000, (void *)(intptr_t)21, NULL);
    ipc_cache_put(&c, b);
    CHECK(c.n == 2 && nclosed == 0);
    /* peer 1 freed and reallocated: an overlapping range with a new id -> stale, closed */
    CHECK(ipc_cache_get(&c, 1, 101, 0x1800, 0x1000) == NULL);
    CHECK(nclosed == 1 && closed_log[0] == 11 && c.stale_dropped == 1 && c.n == 1);
    /* a stale entry in use is closed only when its user lets go */
    a = ipc_cache_add(&c, 1, 101, 0x1800, 0x1000, (void *)(intptr_t)12, NULL);
    CHECK(ipc_cache_get(&c, 1, 102, 0x1000, 0x4000) == NULL); /* overlaps, new id */
    CHECK(nclosed == 1 && a->stale && c.n == 1);
    ipc_cache_put(&c, a);
    CHECK(nclosed == 2 && closed_log[1] == 12);
    /* LRU: cap 3, entries 31, 32, 33 (peer 3); 31 used again; adding 34 evicts 32 */
    for (int i = 1; i <= 3; i++) {
        e = ipc_cache_add(&c, 3, 300 + (uint64_t)i, 0x100000 * (uint64_t)i, 0x1000,
                          (void *)(intptr_t)(30 + i), NULL);
        ipc_cache_put(&c, e);
    }
    /* with peer 2's entry that is 4: the oldest unused (peer 2's) went first */
    CHECK(c.n == 3 && nclosed == 3 && closed_log[2] == 21 && c.evicted == 1);
    e = ipc_cache_get(&c, 3, 301, 0x100000, 0x1000);
    ipc_cache_put(&c, e);
    e = ipc_cache_add(&c, 3, 304, 0x400000, 0x1000, (void *)(intptr_t)34, NULL);
    CHECK(c.n == 3 && nclosed == 4 && closed_log[3] == 32);
    /* entries in use are never evicted: the cache goes over its cap until they are put */
    a = ipc_cache_get(&c, 3, 301, 0x100000, 0x1000);
    b = ipc_cache_get(&c, 3, 303, 0x300000, 0x1000);
    {
        ipc_entry_t *f = ipc_cache_add(&c, 3, 305, 0x500000, 0x1000, (void *)(intptr_t)35, NULL);
        CHECK(c.n == 4 && nclosed == 4); /* 34, 31, 33, 35 all referenced */
        ipc_cache_put(&c, f);
        CHECK(c.n == 3 && nclosed == 5 && closed_log[4] == 35); /* 35 the only one free */
    }
    ipc_cache_put(&c, e);
    ipc_cache_put(&c, a);
    ipc_cache_put(&c, b);
    /* dropping a peer closes its entries, every one */
    ipc_cache_drop(&c, 3);
    CHECK(c.n == 0 && nclosed == 8 && c.live == NULL && c.zombie == NULL);
    /* the exporter's cache keeps handles and closes nothing */
    {
        ipc_cache_t x;
        uint8_t     h[IPC_HANDLE_BYTES];
        memset(h, 7, sizeof(h));
        ipc_cache_init(&x, 2, NULL, NULL);
        e = ipc_cache_add(&x, -1, 5, 0x1000, 0x100, NULL, h);
        ipc_cache_put(&x, e);
        e = ipc_cache_get(&x, -1, 5, 0x1000, 0x100);
        CHECK(e != NULL && e->handle[63] == 7);
        ipc_cache_put(&x, e);
        ipc_cache_drop(&x, -2);
        CHECK(x.n == 0);
    }
}

/* ---- end to end ------------------------------------------------------------------------------ */

static xccl_comm_t *comm_new(int rank, int size, int64_t timeout_ms)
{
    char         path[300];
    xccl_comm_t *c;

    snprintf(path, sizeof(path), "%s-%d", store_path, store_gen++);
    c        = ctest_file_comm(path, rank, size, timeout_ms, "ipc", "cuda_ipc");
    dev_lock = c != NULL ? &c->ctx->lock : NULL;
    return c;
}

static void stats(xccl_comm_t *c, ipc_test_stats_t *s)
{
    memset(s, 0, sizeof(*s));
    pthread_mutex_lock(&c->ctx->lock);
    for (int i = 0; i < c->ctx->ntp; i++)
        if (c->ctx->tp[i].ops == &xccl_transport_cuda_ipc)
            xccl_cuda_ipc_test_stats(c->ctx->tp[i].ctx, s);
    pthread_mutex_unlock(&c->ctx->lock);
}
static void drive(xccl_comm_t *c)
{
    pthread_mutex_lock(&c->ctx->lock);
    (void)xccl_ctx_progress_locked(c->ctx);
    pthread_mutex_unlock(&c->ctx->lock);
}
static uint64_t staged(xccl_comm_t *c)
{
    uint64_t v;
    pthread_mutex_lock(&c->ctx->lock);
    v = c->ctx->stage_sends + c->ctx->stage_recvs;
    pthread_mutex_unlock(&c->ctx->lock);
    return v;
}

/* With XCCL_DEFER_MS large: a 1 MiB device message waits (held by the transport) until rank 1
 * posts its receive; a host message sent after it waits behind it and matches after it. */
static void test_held(xccl_comm_t *c)
{
    int              rank = xccl_comm_rank(c);
    size_t           n    = 1u << 20;
    void            *b    = dalloc(n);
    uint32_t         h    = 0;
    xccl_work_t     *w1 = NULL, *w2 = NULL;
    ipc_test_stats_t st;

    if (rank == 0) {
        fill(b, n, 0, 50);
        h = 0xfeed;
        (void)post(c, 1, b, n, 1, 50, XCCL_MEM_CUDA, &w1);
        (void)post(c, 1, &h, sizeof(h), 1, 51, XCCL_MEM_HOST, &w2);
        if (w1) (void)wait_ok(w1, "held: device send");
        if (w2) (void)wait_ok(w2, "held: host send");
    } else if (rank == 1) {
        dlock();
        memset(b, 0xA5, n);
        dunlock();
        /* the descriptor arrives and is deferred; then everything from rank 0 waits */
        for (int i = 0; i < 2000; i++) {
            stats(c, &st);
            if (st.deferred > 0) break;
            drive(c);
            usleep(1000);
        }
        CHECK_MSG(st.deferred > 0, "held: the descriptor was never deferred");
        (void)post(c, 0, &h, sizeof(h), 0, 51, XCCL_MEM_HOST, &w2);
        (void)post(c, 0, b, n, 0, 50, XCCL_MEM_CUDA, &w1);
        if (w1 && wait_ok(w1, "held: device recv") == XCCL_OK) (void)check(b, n, n, 0, 50, "held");
        if (w2 && wait_ok(w2, "held: host recv") == XCCL_OK)
            CHECK_MSG(h == 0xfeed, "held: host message %x", h);
    }
    if (w1) xccl_work_release(w1);
    if (w2) xccl_work_release(w2);
    dfree(b);
}

/* Host and device messages, one tag, interleaved from rank 0 to rank 1: matched in posting
 * order (message k carries salt k and a size of its own). */
static void test_mixed_order(xccl_comm_t *c)
{
    enum { M = 12 };
    int          rank = xccl_comm_rank(c);
    void        *b[M];
    size_t       n[M];
    xccl_work_t *w[M] = {0};

    if (rank > 1) return;
    for (int k = 0; k < M; k++) {
        xccl_mem_type_t m = (k % 3 == 1) ? XCCL_MEM_HOST : XCCL_MEM_CUDA;
        n[k]              = k % 2 ? 100 + (size_t)k : (200u << 10) + (size_t)k;
        b[k]              = mem_alloc(m, n[k]);
        if (rank == 0) fill(b[k], n[k], 0, 70 + k);
    }
    for (int k = 0; k < M; k++) {
        xccl_mem_type_t m = (k % 3 == 1) ? XCCL_MEM_HOST : XCCL_MEM_CUDA;
        (void)post(c, rank == 0, b[k], n[k], 1 - rank, 70, m, &w[k]);
    }
    for (int k = 0; k < M; k++) {
        char what[64];
        snprintf(what, sizeof(what), "mixed order #%d rank %d", k, rank);
        if (w[k] && wait_ok(w[k], what) == XCCL_OK && rank == 1)
            (void)check(b[k], n[k], n[k], 0, 70 + k, what);
    }
    for (int k = 0; k < M; k++) {
        if (w[k]) xccl_work_release(w[k]);
        mem_free((k % 3 == 1) ? XCCL_MEM_HOST : XCCL_MEM_CUDA, b[k]);
    }
}

/* One buffer sent 8 times: one import, then hits; a new allocation at another size (the fake
 * sees a new buffer id for the range) makes the old mapping stale. */
static void test_cache_reuse(xccl_comm_t *c)
{
    int              rank = xccl_comm_rank(c);
    size_t           n    = 256u << 10;
    void            *b    = dalloc(n);
    ipc_test_stats_t s0, s1;

    if (rank > 1) {
        dfree(b);
        return;
    }
    stats(c, &s0);
    for (int it = 0; it < 8; it++) {
        xccl_work_t *w = NULL;
        if (rank == 0) fill(b, n, 0, 90 + it);
        if (post(c, rank == 0, b, n, 1 - rank, 90, XCCL_MEM_CUDA, &w) == XCCL_OK &&
            wait_ok(w, "cache reuse") == XCCL_OK && rank == 1)
            (void)check(b, n, n, 0, 90 + it, "cache reuse");
        if (w) xccl_work_release(w);
    }
    stats(c, &s1);
    if (rank == 1) {
        CHECK_MSG(s1.imp_misses - s0.imp_misses == 1 && s1.imp_hits - s0.imp_hits == 7,
                  "cache reuse: %llu misses, %llu hits",
                  (unsigned long long)(s1.imp_misses - s0.imp_misses),
                  (unsigned long long)(s1.imp_hits - s0.imp_hits));
    } else {
        CHECK_MSG(s1.exp_misses - s0.exp_misses == 1 && s1.exp_hits - s0.exp_hits == 7,
                  "cache reuse: %llu exports, %llu hits",
                  (unsigned long long)(s1.exp_misses - s0.exp_misses),
                  (unsigned long long)(s1.exp_hits - s0.exp_hits));
    }
    /* a larger buffer at a range overlapping the first: on rank 0 a second mapping of
     * the same pages with another size - the fake's buffer id differs, the receiver's old
     * mapping is stale */
    {
        xccl_work_t *w  = NULL;
        char        *b2 = (char *)b;
        size_t       n2 = n / 2; /* the first half: another (page-rounded) range */
        if (rank == 0) fill(b2, n2, 0, 99);
        if (post(c, rank == 0, b2, n2, 1 - rank, 91, XCCL_MEM_CUDA, &w) == XCCL_OK &&
            wait_ok(w, "cache stale") == XCCL_OK && rank == 1)
            (void)check(b2, n2, n2, 0, 99, "cache stale");
        if (w) xccl_work_release(w);
        stats(c, &s0);
        if (rank == 1)
            CHECK_MSG(s0.imp_stale - s1.imp_stale == 1 && s0.imp_closed - s1.imp_closed == 1,
                      "cache stale: %llu stale, %llu closed",
                      (unsigned long long)(s0.imp_stale - s1.imp_stale),
                      (unsigned long long)(s0.imp_closed - s1.imp_closed));
    }
    dfree(b);
}

static int child(int rank, int size, void *arg)
{
    xccl_comm_t     *c;
    ipc_test_stats_t s;
    int              mode     = (int)(intptr_t)arg; /* 0, 1 nolegacy, 2 noimport, 3 over tcp */
    int              nolegacy = mode == 1;

    (void)size;
    devp2p_keep_open = 1; /* the fake transport reads peers with process_vm_readv */
    fdev_open(1);
    CHECK(xccl_exec_set_for_test(XCCL_MEM_CUDA, &fdev_ops) == NULL);
    fdev.rng = 1 + (uint64_t)rank;
    c        = comm_new(rank, size, 60000);
    if (c == NULL) return 2;
    CHECK_MSG(c->ctx->ntp == 1 && c->ctx->tp[0].ops == &xccl_transport_cuda_ipc,
              "the context does not run on cuda_ipc alone");
    {
        xccl_tp_ctx_t *tc = c->ctx->tp[0].ctx;
        CHECK_MSG(xccl_cuda_ipc_test_inner(tc) != NULL &&
                      strcmp(xccl_cuda_ipc_test_inner(tc), mode == 3 ? "tcp" : "shm") == 0,
                  "inner transport %s", xccl_cuda_ipc_test_inner(tc));
    }
    test_ring(c, XCCL_MEM_CUDA, XCCL_MEM_CUDA, 0);
    test_ring(c, XCCL_MEM_CUDA, XCCL_MEM_HOST, 1);
    test_ring(c, XCCL_MEM_HOST, XCCL_MEM_CUDA, 2);
    sync_all(c);
    test_unexpected(c);
    sync_all(c);
    test_any_source(c);
    sync_all(c);
    test_mixed_order(c);
    sync_all(c);
    test_colls(c, 1);
    sync_all(c);
    if (mode == 0 || mode == 3) {
        test_cache_reuse(c);
        sync_all(c);
    }
    stats(c, &s);
    CHECK_MSG(staged(c) == 0, "the core staged %llu messages", (unsigned long long)staged(c));
    if (mode == 2)
        CHECK_MSG(s.resends > 0 && s.resend_recvs > 0 && s.bounce_sends > 0 && s.desc_recvs == 0,
                  "noimport: %llu resends, %llu refused descriptors, %llu bounced sends, "
                  "%llu copied",
                  (unsigned long long)s.resends, (unsigned long long)s.resend_recvs,
                  (unsigned long long)s.bounce_sends, (unsigned long long)s.desc_recvs);
    else if (nolegacy)
        CHECK_MSG(s.dev_sends == 0 && s.bounce_sends > 0 && s.bounce_recvs > 0,
                  "nolegacy: %llu descriptors, %llu bounced sends, %llu bounced receives",
                  (unsigned long long)s.dev_sends, (unsigned long long)s.bounce_sends,
                  (unsigned long long)s.bounce_recvs);
    else
        CHECK_MSG(s.dev_sends > 0 && s.desc_recvs > 0 && s.bounce_sends == 0,
                  "%llu descriptors sent, %llu copied, %llu bounced sends",
                  (unsigned long long)s.dev_sends, (unsigned long long)s.desc_recvs,
                  (unsigned long long)s.bounce_sends);
    xccl_comm_destroy(c);
    dev_lock = NULL;

    if (mode == 0 && rank < 2) {
        /* the held descriptor: long deferral, 2 ranks of their own */
        char path[300];
        setenv("XCCL_DEFER_MS", "600000", 1);
        snprintf(path, sizeof(path), "%s-held", store_path);
        c = rank < 2 ? ctest_file_comm(path, rank, 2, 60000, "ipc-held", "cuda_ipc") : NULL;
        unsetenv("XCCL_DEFER_MS");
        dev_lock = c != NULL ? &c->ctx->lock : NULL;
        if (c == NULL) return 2;
        test_held(c);
        sync_all(c);
        xccl_comm_destroy(c);
        dev_lock = NULL;
    }
    CHECK_MSG(fdev.live == 0, "executor events not released: %zu", fdev.live);
    return ctest_failures != 0;
}

/* Rank 1 exits while rank 0's device send waits for its ACK: the send fails, naming rank 1,
 * well within the timeout. */
static int child_kill(int rank, int size, void *arg)
{
    xccl_comm_t  *c;
    size_t        n = 1u << 20;
    void         *b;
    xccl_work_t  *w = NULL;
    xccl_status_t st;
    int64_t       t0;

    (void)arg;
    devp2p_keep_open = 1;
    fdev_open(1);
    CHECK(xccl_exec_set_for_test(XCCL_MEM_CUDA, &fdev_ops) == NULL);
    setenv("XCCL_DEFER_MS", "600000", 1); /* rank 1 holds the descriptor until it dies */
    c = comm_new(rank, size, 20000);
    unsetenv("XCCL_DEFER_MS");
    if (c == NULL) return 2;
    b = dalloc(n);
    sync_all(c);
    if (rank == 1) {
        /* wait until the descriptor is here (deferred: no receive), then die */
        ipc_test_stats_t s = {0};
        for (int i = 0; i < 5000 && s.deferred == 0; i++) {
            drive(c);
            stats(c, &s);
            usleep(1000);
        }
        _exit(s.deferred > 0 ? 0 : 3);
    }
    fill(b, n, 0, 5);
    t0 = xccl_now_ms();
    if (post(c, 1, b, n, 1, 5, XCCL_MEM_CUDA, &w) == XCCL_OK) {
        st = xccl_work_wait(w, 30000);
        CHECK_MSG(st == XCCL_ERR_REMOTE, "kill: %s (%s)", xccl_status_string(st),
                  xccl_work_error(w));
        CHECK_MSG(strstr(xccl_work_error(w), "rank 1") != NULL, "kill: '%s'", xccl_work_error(w));
        CHECK_MSG(xccl_now_ms() - t0 < 15000, "kill: noticed after %lld ms",
                  (long long)(xccl_now_ms() - t0));
        xccl_work_release(w);
    }
    xccl_comm_destroy(c);
    dev_lock = NULL;
    dfree(b);
    return ctest_failures != 0;
}

/* With XCCL_CUDA_IPC_FAKE=stuckcopy: rank 1's copy of rank 0's data stays in flight; rank 0
 * exits once rank 1 says the copy is queued. Rank 1's receive fails naming rank 0 (the copy
 * waited for first), and nothing hangs. */
static int child_copy_kill(int rank, int size, void *arg)
{
    xccl_comm_t *c;
    size_t       n = 1u << 20;
    void        *b;
    xccl_work_t *w = NULL, *m = NULL;
    uint8_t      note = 0;

    (void)arg;
    devp2p_keep_open = 1;
    fdev_open(1);
    CHECK(xccl_exec_set_for_test(XCCL_MEM_CUDA, &fdev_ops) == NULL);
    c = comm_new(rank, size, 20000);
    if (c == NULL) return 2;
    b = dalloc(n);
    if (rank == 0) {
        fill(b, n, 0, 6);
        (void)post(c, 1, b, n, 1, 6, XCCL_MEM_CUDA, &w);
        if (xccl_irecv(c, &note, 1, 1, 8, &m) == XCCL_OK) (void)wait_ok(m, "copy kill: note");
        _exit(note == 1 ? 0 : 3); /* with the copy from our memory in flight */
    } else {
        ipc_test_stats_t s = {0};
        xccl_status_t    st;
        int64_t          t0;
        (void)post(c, 0, b, n, 0, 6, XCCL_MEM_CUDA, &w);
        for (int i = 0; i < 5000 && s.desc_recvs == 0; i++) {
            drive(c);
            stats(c, &s);
            usleep(1000);
        }
        CHECK_MSG(s.desc_recvs == 1, "copy kill: no copy started");
        note = 1;
        if (xccl_isend(c, &note, 1, 0, 8, &m) == XCCL_OK) (void)wait_ok(m, "copy kill: note");
        t0 = xccl_now_ms();
        if (w != NULL) {
            st = xccl_work_wait(w, 30000);
            CHECK_MSG(st == XCCL_ERR_REMOTE, "copy kill: %s (%s)", xccl_status_string(st),
                      xccl_work_error(w));
            CHECK_MSG(strstr(xccl_work_error(w), "rank 0") != NULL, "copy kill: '%s'",
                      xccl_work_error(w));
            CHECK_MSG(xccl_now_ms() - t0 < 15000, "copy kill: noticed after %lld ms",
                      (long long)(xccl_now_ms() - t0));
        }
    }
    if (w) xccl_work_release(w);
    if (m) xccl_work_release(m);
    xccl_comm_destroy(c);
    dev_lock = NULL;
    dfree(b);
    return ctest_failures != 0;
}

/* A device send nobody receives (rank 1 holds its descriptor) times out on rank 0: the core
 * closes the pair through the transport (close_peer), the send fails with XCCL_ERR_TIMEOUT,
 * and both ranks go on on another communicator. */
static int child_timeout(int rank, int size, void *arg)
{
    xccl_comm_t     *a, *b;
    char             path[300];
    size_t           n = 1u << 20;
    void            *buf;
    xccl_work_t     *w = NULL;
    pthread_mutex_t *la;

    (void)arg;
    devp2p_keep_open = 1;
    fdev_open(1);
    CHECK(xccl_exec_set_for_test(XCCL_MEM_CUDA, &fdev_ops) == NULL);
    a  = comm_new(rank, size, 30000);
    la = dev_lock;
    setenv("XCCL_DEFER_MS", "600000", 1);
    snprintf(path, sizeof(path), "%s-tmo", store_path);
    b = ctest_file_comm(path, rank, size, 1500, "ipc-tmo", "cuda_ipc");
    unsetenv("XCCL_DEFER_MS");
    dev_lock = la; /* the test's allocations serialise with a's executor */
    if (a == NULL || b == NULL) return 2;
    buf = dalloc(n);
    if (rank == 0) {
        xccl_status_t st;
        fill(buf, n, 0, 7);
        if (post(b, 1, buf, n, 1, 7, XCCL_MEM_CUDA, &w) == XCCL_OK) {
            st = xccl_work_wait(w, 20000);
            CHECK_MSG(st == XCCL_ERR_TIMEOUT, "timeout: %s (%s)", xccl_status_string(st),
                      xccl_work_error(w));
            xccl_work_release(w);
        }
    }
    sync_all(a); /* rank 1 waited here while rank 0 timed out */
    xccl_comm_destroy(b);
    sync_all(a);
    xccl_comm_destroy(a);
    dev_lock = NULL;
    dfree(buf);
    return ctest_failures != 0;
}

/* The links are priced with the transports some rank started: cuda_ipc where it runs, shm
 * where it could not start (no device: XCCL_CUDA_IPC_FAKE unset, no driver here). */
static int child_model(int rank, int size, void *arg)
{
    extern const xccl_transport_ops_t xccl_transport_shm;
    const xccl_transport_ops_t *want = arg != NULL ? &xccl_transport_cuda_ipc : &xccl_transport_shm;
    char                        path[300];
    xccl_comm_t                *c;

    snprintf(path, sizeof(path), "%s-model", store_path);
    c = ctest_file_comm(path, rank, size, 30000, "ipc-model", "cuda_ipc,shm,tcp");
    if (c == NULL) return 2;
    /* one rank: nothing same-host starts; the host-memory one prices the links */
    CHECK_MSG(size == 1 || c->ctx->tp[0].ops ==
                               (arg != NULL ? &xccl_transport_cuda_ipc : &xccl_transport_shm),
              "model: runs on %s", c->ctx->tp[0].ops->name);
    CHECK_MSG(c->ctx->model_intra.alpha == want->alpha && c->ctx->model_intra.beta == want->beta,
              "model: links priced at alpha %g (want %s's %g)", c->ctx->model_intra.alpha,
              want->name, want->alpha);
    sync_all(c);
    xccl_comm_destroy(c);
    return ctest_failures != 0;
}

#if defined(XCCL_HAVE_CUDA) && defined(FAKE_CUDA_LIB)
/* The transport's real device layer (ipc_dev_cuda.c on csrc/cuda) with the CUDA executor, on
 * the fake driver (fake_cuda.cc, $XCCL_CUDA_LIB, whose opened IPC handles map the exporter's
 * memory): descriptors, handles opened and cached, copies and events on xccl's stream;
 * allreduce runs the executor's kernels. */
static int child_drv(int rank, int size, void *arg)
{
    static const size_t    nb[] = {0, 1, 4099, (1u << 20) + 3};
    const xccl_exec_ops_t *ex;
    xccl_comm_t           *c;
    ipc_test_stats_t       s;
    int                    to = (rank + 1) % size, from = (rank + size - 1) % size;

    (void)arg;
    if (xccl_cuda_set_device(0) != XCCL_OK) {
        fprintf(stderr, "rank %d: xccl_cuda_set_device: %s\n", rank, xccl_last_error());
        return 2;
    }
    ex       = xccl_exec_for(XCCL_MEM_CUDA);
    c        = comm_new(rank, size, 60000);
    dev_lock = NULL; /* the real executor is thread-safe */
    if (ex == NULL || c == NULL) return 2;
    CHECK_MSG(c->ctx->tp[0].ops == &xccl_transport_cuda_ipc, "drv: runs on %s",
              c->ctx->tp[0].ops->name);
    for (size_t k = 0; k < sizeof(nb) / sizeof(nb[0]); k++) {
        size_t          n    = nb[k];
        xccl_mem_type_t rmem = k % 2 ? XCCL_MEM_HOST : XCCL_MEM_CUDA; /* host: via pinned */
        uint8_t        *sb   = ex->alloc(n + 1);
        uint8_t        *rb   = rmem == XCCL_MEM_CUDA ? ex->alloc(n + 8) : malloc(n + 8);
        xccl_work_t    *ws = NULL, *wr = NULL;
        char            what[64];

        snprintf(what, sizeof(what), "drv ring n=%zu to %s rank %d", n,
                 rmem == XCCL_MEM_CUDA ? "device" : "host", rank);
        if (sb == NULL || rb == NULL) return 2;
        /* the fake driver's device memory is host memory: filled and read directly */
        for (size_t i = 0; i < n; i++)
            sb[i] = pat(rank, i, 3);
        memset(rb, 0xA5, n + 8);
        if (post(c, 0, rb, n + 8, from, 3, rmem, &wr) == XCCL_OK &&
            post(c, 1, sb, n, to, 3, XCCL_MEM_CUDA, &ws) == XCCL_OK &&
            wait_ok(ws, what) == XCCL_OK && wait_ok(wr, what) == XCCL_OK)
            (void)check(rb, n, n + 8, from, 3, what);
        if (ws) xccl_work_release(ws);
        if (wr) xccl_work_release(wr);
        ex->free(sb);
        if (rmem == XCCL_MEM_CUDA)
            ex->free(rb);
        else
            free(rb);
    }
    {
        size_t           n  = 100003;
        float           *sb = ex->alloc(n * 4), *rb = ex->alloc(n * 4);
        xccl_coll_opts_t o   = {.algo = "ring", .mem = XCCL_MEM_CUDA};
        xccl_work_t     *w   = NULL;
        int              bad = -1;
        for (size_t i = 0; i < n; i++)
            sb[i] = val(rank, i);
        if (xccl_allreduce(c, sb, rb, n, XCCL_FLOAT32, XCCL_OP_SUM, &o, &w) == XCCL_OK &&
            wait_ok(w, "drv allreduce") == XCCL_OK) {
            for (size_t i = 0; i < n && bad < 0; i++) {
                float want = 0;
                for (int q = 0; q < size; q++)
                    want += val(q, i);
                if (rb[i] != want) bad = (int)i;
            }
            CHECK_MSG(bad < 0, "drv allreduce: element %d wrong", bad);
        }
        if (w) xccl_work_release(w);
        ex->free(sb);
        ex->free(rb);
    }
    stats(c, &s);
    CHECK_MSG(s.dev_sends > 0 && s.desc_recvs > 0 && s.bounce_sends == 0 && staged(c) == 0,
              "drv: %llu descriptors, %llu copied, %llu bounced sends, %llu staged",
              (unsigned long long)s.dev_sends, (unsigned long long)s.desc_recvs,
              (unsigned long long)s.bounce_sends, (unsigned long long)staged(c));
    sync_all(c);
    xccl_comm_destroy(c);
    return ctest_failures != 0;
}
#endif

int main(void)
{
    static const int nranks[] = {2, 3};
    int              failed   = 0;

    test_cache();
    if (xccl_transport_register(&xccl_transport_cuda_ipc) != XCCL_OK &&
        xccl_transport_find("cuda_ipc") != &xccl_transport_cuda_ipc) {
        fprintf(stderr, "registering cuda_ipc: %s\n", xccl_last_error());
        return 1;
    }
    setenv("XCCL_CUDA_IPC_FAKE", "1", 1);
    for (size_t k = 0; k < sizeof(nranks) / sizeof(nranks[0]); k++) {
        snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-ipc-%d-%d", (int)getpid(),
                 nranks[k]);
        store_gen = 0;
        failed += ctest_fork_ranks("test_cuda_ipc", nranks[k], child, NULL);
    }
    /* the cost model follows the transports that started */
    unsetenv("XCCL_CUDA_IPC_FAKE");
    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-ipc-%d-m0", (int)getpid());
    failed += ctest_fork_ranks("test_cuda_ipc model (no device)", 2, child_model, NULL);
    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-ipc-%d-m2", (int)getpid());
    failed += ctest_fork_ranks("test_cuda_ipc model (one rank)", 1, child_model, NULL);
    setenv("XCCL_CUDA_IPC_FAKE", "1", 1);
    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-ipc-%d-m1", (int)getpid());
    failed += ctest_fork_ranks("test_cuda_ipc model", 2, child_model, (void *)1);
    /* messages through tcp instead of shm */
    setenv("XCCL_CUDA_IPC_INNER", "tcp", 1);
    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-ipc-%d-tcp", (int)getpid());
    store_gen = 0;
    failed += ctest_fork_ranks("test_cuda_ipc over tcp", 2, child, (void *)3);
    unsetenv("XCCL_CUDA_IPC_INNER");
    /* memory legacy IPC cannot export: through host memory */
    setenv("XCCL_CUDA_IPC_FAKE", "nolegacy", 1);
    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-ipc-%d-nl", (int)getpid());
    store_gen = 0;
    failed += ctest_fork_ranks("test_cuda_ipc nolegacy", 2, child, (void *)1);
    /* handles that cannot be opened: the receiver asks for the bytes instead */
    setenv("XCCL_CUDA_IPC_FAKE", "noimport", 1);
    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-ipc-%d-ni", (int)getpid());
    store_gen = 0;
    failed += ctest_fork_ranks("test_cuda_ipc noimport", 3, child, (void *)2);
    setenv("XCCL_CUDA_IPC_FAKE", "1", 1);
    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-ipc-%d-kill", (int)getpid());
    store_gen = 0;
    failed += ctest_fork_ranks("test_cuda_ipc kill", 2, child_kill, NULL);
    failed += ctest_fork_ranks("test_cuda_ipc timeout", 2, child_timeout, NULL);
    setenv("XCCL_CUDA_IPC_FAKE", "stuckcopy", 1);
    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-ipc-%d-ck", (int)getpid());
    store_gen = 0;
    failed += ctest_fork_ranks("test_cuda_ipc copy kill", 2, child_copy_kill, NULL);
#if defined(XCCL_HAVE_CUDA) && defined(FAKE_CUDA_LIB)
    unsetenv("XCCL_CUDA_IPC_FAKE");
    setenv("XCCL_CUDA_LIB", FAKE_CUDA_LIB, 1);
    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-ipc-%d-drv", (int)getpid());
    store_gen = 0;
    failed += ctest_fork_ranks("test_cuda_ipc fake driver", 2, child_drv, NULL);
    unsetenv("XCCL_CUDA_LIB");
#else
    printf("test_cuda_ipc: the device layer on the fake driver skipped (needs the CUDA headers "
           "and FAKE_CUDA_LIB)\n");
#endif
    {
        const char *tags[] = {"2", "3", "m0", "m1", "m2", "tcp", "nl", "ni", "kill", "ck", "drv"};
        for (int t = 0; t < 11; t++) {
            for (int g = 0; g < 4; g++) {
                char path[300];
                snprintf(path, sizeof(path), "/tmp/xccl-test-ipc-%d-%s-%d", (int)getpid(), tags[t],
                         g);
                unlink(path);
            }
            char path[300];
            snprintf(path, sizeof(path), "/tmp/xccl-test-ipc-%d-%s-held", (int)getpid(), tags[t]);
            unlink(path);
            snprintf(path, sizeof(path), "/tmp/xccl-test-ipc-%d-%s-tmo", (int)getpid(), tags[t]);
            unlink(path);
            snprintf(path, sizeof(path), "/tmp/xccl-test-ipc-%d-%s-model", (int)getpid(), tags[t]);
            unlink(path);
        }
    }
    ctest_checks++;
    if (failed) ctest_failures++;
    CTEST_MAIN_END("test_cuda_ipc");
}
