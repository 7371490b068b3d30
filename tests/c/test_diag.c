/* SPDX-License-Identifier: Apache-2.0
 *
 * test_diag.c - the cross-rank table of a timeout (csrc/core/diag.c), through the public C API:
 * three forked ranks meet through a file store; rank 0 and rank 1 enter an all_reduce that
 * rank 2, busy elsewhere (a plain sleep, no xccl call), never joins. Rank 0 times out first and
 * its error must show rank 1 waiting in the all_reduce and rank 2 idle since the warm-up, and
 * must arrive within the timeout plus the bounded collection time. Then rank 2 dies and a
 * receive on rank 0 that times out must show it dead or silent, without hanging. Both over
 * shared memory and over TCP (they notice a dead peer differently).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ctest.h"
#include "xccl/xccl.h"

static char store_path[256];

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static xccl_comm_t *make_comm(int rank, int size)
{
    /* the timeout covers the bootstrap and the p2p receive below */
    return ctest_file_comm(store_path, rank, size, 2000, "diag", NULL);
}

/* Waits for *w (read after the post call set it) and releases it; its error text into err. */
static xccl_status_t run(xccl_status_t st, xccl_work_t **wp, char *err, size_t len)
{
    xccl_work_t *w = *wp;

    if (st != XCCL_OK) return st;
    st = xccl_work_wait(w, -1);
    if (err != NULL) snprintf(err, len, "%s", xccl_work_error(w));
    xccl_work_release(w);
    return st;
}

static int child(int rank, int size, void *unused)
{
    (void)unused;
    xccl_comm_t     *c = make_comm(rank, size);
    float            x[16];
    char             err[4096];
    xccl_coll_opts_t opts = {0};
    xccl_work_t     *w;
    double           t0;

    if (c == NULL) return 2;
    for (int i = 0; i < 16; i++) x[i] = (float)rank;
    /* warm-up: everyone connected, every recorder holds #0 */
    CHECK(run(xccl_allreduce(c, x, x, 16, XCCL_FLOAT32, XCCL_OP_SUM, NULL, &w), &w, NULL, 0) ==
          XCCL_OK);
    CHECK(x[0] == 3.0f);
    if (rank == 2) {
        usleep(2800 * 1000); /* never joins #1; answers from the progress thread */
        _exit(ctest_failures != 0); /* no goodbye: rank 0's second check sees it dead */
    }
    /* rank 1 is still waiting when rank 0 asks: a longer timeout */
    opts.timeout_ms = rank == 0 ? 800 : 2000;
    opts.algo       = "ring";
    t0              = now_s();
    CHECK(run(xccl_allreduce(c, x, x, 16, XCCL_FLOAT32, XCCL_OP_SUM, &opts, &w), &w, err,
              sizeof(err)) == XCCL_ERR_TIMEOUT);
    if (rank == 0) {
        double waited = now_s() - t0;
        if (getenv("XCCL_TEST_VERBOSE") != NULL) fprintf(stderr, "%s\n(%.2f s)\n", err, waited);
        CHECK_MSG(strstr(err, "where the 3 ranks of comm 'diag' are") != NULL, "%s", err);
        CHECK_MSG(strstr(err, "rank 0: all_reduce #1 (ring) waiting for") != NULL, "%s", err);
        CHECK_MSG(strstr(err, "rank 1: all_reduce #1 (ring) waiting for") != NULL, "%s", err);
        CHECK_MSG(strstr(err, "rank 2: idle, last finished #0 all_reduce") != NULL, "%s", err);
        /* 800 ms timeout + at most 200 ms collection (+ slack for a busy machine) */
        CHECK_MSG(waited > 0.75 && waited < 1.6, "waited %.2f s", waited);
    }
    if (rank == 0) {
        /* rank 2 is gone by now; rank 1 never sends: the receive times out */
        char buf[4];
        usleep(1500 * 1000);
        t0 = now_s();
        CHECK(run(xccl_irecv(c, buf, sizeof(buf), 1, 5, &w), &w, err, sizeof(err)) ==
              XCCL_ERR_TIMEOUT);
        if (getenv("XCCL_TEST_VERBOSE") != NULL)
            fprintf(stderr, "%s\n(%.2f s)\n", err, now_s() - t0);
        CHECK_MSG(strstr(err, "rank 0: recv (p2p, tag 5) waiting for recv from rank 1") != NULL,
                  "%s", err);
        CHECK_MSG(strstr(err, "rank 1: idle, last finished #1 all_reduce (timed out)") != NULL,
                  "%s", err);
        CHECK_MSG(strstr(err, "rank 2: no answer") != NULL, "%s", err);
        /* 2 s timeout + at most 500 ms collection (+ slack) */
        CHECK_MSG(now_s() - t0 < 3.5, "waited %.2f s", now_s() - t0);
    } else {
        usleep(3000 * 1000); /* idle while rank 0 waits in vain */
    }
    xccl_comm_destroy(c);
    return ctest_failures != 0;
}

int main(void)
{
    enum { SIZE = 3 };
    static const char *const transports[] = {"shm", "tcp"};
    int                      failed       = 0;

    for (size_t t = 0; t < sizeof(transports) / sizeof(transports[0]); t++) {
        setenv("XCCL_TRANSPORTS", transports[t], 1);
        snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-diag-%d-%zu", (int)getpid(), t);
        unlink(store_path);
        failed += ctest_fork_ranks(transports[t], SIZE, child, NULL);
        unlink(store_path);
    }
    ctest_checks++;
    if (failed) ctest_failures++;
    CTEST_MAIN_END("test_diag");
}
