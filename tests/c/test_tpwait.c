/* SPDX-License-Identifier: Apache-2.0
 *
 * test_tpwait.c - the core's sleep over several transports at once (xccl_ctx_sleep with
 * wait_arm / wait_disarm). Three forked ranks; XCCL_HOST_ID puts rank 2 on another "host", so
 * ranks 0 and 1 reach each other through shm and rank 2 through tcp: their contexts hold both
 * transports. Rank 0 waits for a message that rank 1 (then rank 2) sends only after a long
 * pause, sleeping in xccl_ctx_sleep with a long timeout: it must be woken by the message
 * itself, so it sleeps a few times (and switches context voluntarily a few times), where
 * alternating short sleeps over the transports would take hundreds. Then each transport's
 * `wake`, sent from another thread, must end a long sleep.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/core.h"
#include "ctest.h"
#include "xccl/xccl.h"

enum { SIZE = 3, LATE_MS = 300, SLEEP_MS = 5000 };

static char store_path[256];

static long thread_nvcsw(void)
{
    struct rusage ru;

    getrusage(RUSAGE_THREAD, &ru);
    return ru.ru_nvcsw;
}

static int wait_release(xccl_work_t *w)
{
    xccl_status_t st = xccl_work_wait(w, -1);

    if (st != XCCL_OK) fprintf(stderr, "wait: %s\n", xccl_work_error(w));
    xccl_work_release(w);
    return st == XCCL_OK;
}

/* Rank 0: receives from `src`, which sends LATE_MS after our "go", sleeping in between. */
static void wait_late(xccl_comm_t *c, int src)
{
    xccl_ctx_t  *ctx = c->ctx;
    int32_t      go = 1, x = -1;
    xccl_work_t *wr, *ws;
    long         csw0, csw;
    int          sleeps = 0;
    uint64_t     t0;

    CHECK(xccl_irecv(c, &x, sizeof(x), src, 20, &wr) == XCCL_OK);
    CHECK(xccl_isend(c, &go, sizeof(go), src, 10, &ws) == XCCL_OK);
    CHECK(wait_release(ws));
    t0   = xccl_now_ns();
    csw0 = thread_nvcsw();
    while (xccl_work_test(wr) == XCCL_INPROGRESS && sleeps < 100000) {
        xccl_ctx_sleep(ctx, SLEEP_MS);
        sleeps++;
    }
    csw = thread_nvcsw() - csw0;
    CHECK(xccl_work_status(wr) == XCCL_OK);
    CHECK_MSG(x == 1000 + src, "got %d from rank %d", x, src);
    /* the message is late by construction (sent LATE_MS after our go); a 1 ms alternation
     * would sleep ~LATE_MS times */
    CHECK_MSG(sleeps <= 10, "%d sleeps waiting for rank %d over %s", sleeps, src,
              xccl_comm_peer_transport(c, src));
    CHECK_MSG(csw <= 40, "%ld voluntary context switches waiting for rank %d", csw, src);
    printf("  rank %d over %s: %d sleeps, %ld voluntary switches, %.0f ms\n", src,
           xccl_comm_peer_transport(c, src), sleeps, csw, (double)(xccl_now_ns() - t0) / 1e6);
    xccl_work_release(wr);
}

typedef struct waker {
    xccl_ctx_t  *ctx;
    int          tp;
    _Atomic int  sent;
    uint64_t     t_sent;
} waker_t;

static void *waker_main(void *arg)
{
    waker_t *k = arg;

    usleep(100 * 1000);
    /* the condition first, then the wake (a wake-up says "look again") */
    k->t_sent = xccl_now_ns();
    atomic_store(&k->sent, 1);
    pthread_mutex_lock(&k->ctx->lock);
    k->ctx->tp[k->tp].ops->wake(k->ctx->tp[k->tp].ctx);
    pthread_mutex_unlock(&k->ctx->lock);
    return NULL;
}

/* Another thread calls tp's `wake` while we sleep SLEEP_MS at a time: the sleep going on then
 * must end at once, not at its timeout. */
static void wake_one(xccl_ctx_t *ctx, int tp)
{
    waker_t   k = {.ctx = ctx, .tp = tp};
    pthread_t th;
    double    late_ms;
    int       sleeps = 0;

    CHECK(pthread_create(&th, NULL, waker_main, &k) == 0);
    while (!atomic_load(&k.sent) && sleeps < 1000) {
        xccl_ctx_sleep(ctx, SLEEP_MS);
        sleeps++;
        pthread_mutex_lock(&ctx->lock); /* consumes what woke us, as a waiter's pass does */
        (void)xccl_ctx_progress_locked(ctx);
        pthread_mutex_unlock(&ctx->lock);
    }
    late_ms = (double)(xccl_now_ns() - k.t_sent) / 1e6;
    pthread_join(th, NULL);
    CHECK_MSG(sleeps <= 10, "%d sleeps until the %s wake", sleeps, ctx->tp[tp].ops->name);
    /* a sleep that the wake did not end would last ~SLEEP_MS after it */
    CHECK_MSG(late_ms < SLEEP_MS / 2, "the %s wake ended the sleep %.0f ms later",
              ctx->tp[tp].ops->name, late_ms);
    printf("  %s wake: %d sleeps, the last ended %.1f ms after the wake\n",
           ctx->tp[tp].ops->name, sleeps, late_ms);
}

static int child(int rank, int size, void *unused)
{
    (void)size, (void)unused;
    xccl_store_t      *store = NULL;
    xccl_comm_t       *c     = NULL;
    xccl_comm_config_t cfg   = {0};
    xccl_work_t       *w;
    int32_t            v;

    setenv("XCCL_HOST_ID", rank == 2 ? "tpwait-b" : "tpwait-a", 1);
    setenv("XCCL_PROGRESS_THREAD", "0", 1); /* the test's thread alone drives progress */
    if (xccl_store_file_create(store_path, SIZE, 20000, &store) != XCCL_OK) return 1;
    cfg.rank       = rank;
    cfg.size       = SIZE;
    cfg.store      = store;
    cfg.timeout_ms = 20000;
    cfg.transports = "shm,tcp";
    cfg.name       = "tpwait";
    CHECK(xccl_comm_create(&cfg, &c) == XCCL_OK);
    xccl_store_release(store);
    if (c == NULL) return 1;
    if (rank == 0) {
        CHECK(strcmp(xccl_comm_peer_transport(c, 1), "shm") == 0);
        CHECK(strcmp(xccl_comm_peer_transport(c, 2), "tcp") == 0);
        CHECK(c->ctx->ntp == 2);
        wait_late(c, 1);
        wait_late(c, 2);
        for (int i = 0; i < c->ctx->ntp; i++) wake_one(c->ctx, i);
    } else {
        /* wait for rank 0's go (long: rank 0 waits for rank 1 first), pause, answer */
        CHECK(xccl_irecv(c, &v, sizeof(v), 0, 10, &w) == XCCL_OK);
        CHECK(wait_release(w));
        usleep(LATE_MS * 1000);
        v = 1000 + rank;
        CHECK(xccl_isend(c, &v, sizeof(v), 0, 20, &w) == XCCL_OK);
        CHECK(wait_release(w));
    }
    v = 1;
    CHECK(xccl_allreduce(c, &v, &v, 1, XCCL_INT32, XCCL_OP_SUM, NULL, &w) == XCCL_OK);
    CHECK(wait_release(w));
    CHECK(v == SIZE);
    xccl_comm_destroy(c);
    fflush(stdout);
    return ctest_failures != 0;
}

int main(void)
{
    int failed;

    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-tpwait-%d", (int)getpid());
    unlink(store_path);
    failed = ctest_fork_ranks("test_tpwait", SIZE, child, NULL);
    unlink(store_path);
    ctest_checks++;
    if (failed) ctest_failures++;
    CTEST_MAIN_END("test_tpwait");
}
