/* SPDX-License-Identifier: Apache-2.0
 *
 * test_comm.c - end-to-end test of the engine through the public C API only: forked ranks meet
 * through a file store, connect over the real transports and run point-to-point operations and
 * every collective with every algorithm, checked against values computed here, and operations
 * whose caller stopped waiting, which the background progress thread must finish.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "algo/algo.h"
#include "ctest.h"
#include "xccl/xccl.h"

static char store_path[256];

static xccl_comm_t *make_comm(int rank, int size)
{
    xccl_store_t      *store = NULL;
    xccl_comm_t       *comm  = NULL;
    xccl_comm_config_t cfg   = {0};

    if (xccl_store_file_create(store_path, size, 20000, &store) != XCCL_OK) {
        fprintf(stderr, "rank %d: store: %s\n", rank, xccl_last_error());
        return NULL;
    }
    cfg.rank       = rank;
    cfg.size       = size;
    cfg.store      = store;
    cfg.timeout_ms = 20000;
    cfg.name       = "test";
    if (xccl_comm_create(&cfg, &comm) != XCCL_OK)
        fprintf(stderr, "rank %d: comm create: %s\n", rank, xccl_last_error());
    xccl_store_release(store);
    return comm;
}

static int run_wait(xccl_status_t st, xccl_work_t *w, const char *what, int rank)
{
    if (st != XCCL_OK) {
        fprintf(stderr, "rank %d: %s: post failed: %s\n", rank, what, xccl_last_error());
        return -1;
    }
    st = xccl_work_wait(w, -1);
    if (st != XCCL_OK) {
        fprintf(stderr, "rank %d: %s: %s\n", rank, what, xccl_work_error(w));
        xccl_work_release(w);
        return -1;
    }
    xccl_work_release(w);
    return 0;
}

/* value contributed by rank r at index i */
static int32_t val(int r, size_t i) { return (int32_t)(r * 1000 + (int)(i % 997)); }

static void test_p2p(xccl_comm_t *c, int rank, int size)
{
    size_t       n = 1000;
    int32_t     *s = malloc(n * 4), *r = malloc(n * 4);
    xccl_work_t *ws, *wr;
    int          next = (rank + 1) % size, prev = (rank + size - 1) % size;

    for (size_t i = 0; i < n; i++) s[i] = val(rank, i);
    CHECK(xccl_irecv(c, r, n * 4, prev, 7, &wr) == XCCL_OK);
    CHECK(xccl_isend(c, s, n * 4, next, 7, &ws) == XCCL_OK);
    CHECK(xccl_work_wait(ws, -1) == XCCL_OK);
    CHECK(xccl_work_wait(wr, -1) == XCCL_OK);
    CHECK(xccl_work_source(wr) == prev);
    for (size_t i = 0; i < n; i++) CHECK_MSG(r[i] == val(prev, i), "ring p2p at %zu", i);
    xccl_work_release(ws);
    xccl_work_release(wr);
    /* any-source: everyone sends its rank to 0 */
    if (rank == 0) {
        int seen = 0;
        for (int k = 1; k < size; k++) {
            int32_t x = -1;
            CHECK(xccl_irecv(c, &x, 4, XCCL_ANY_SOURCE, 9, &wr) == XCCL_OK);
            CHECK(xccl_work_wait(wr, -1) == XCCL_OK);
            CHECK(x == xccl_work_source(wr));
            seen |= 1 << x;
            xccl_work_release(wr);
        }
        CHECK(seen == ((1 << size) - 2));
    } else {
        int32_t x = rank;
        xccl_status_t st = xccl_isend(c, &x, 4, 0, 9, &ws);
        CHECK(run_wait(st, ws, "anysrc send", rank) == 0);
    }
    /* a receive buffer that is too small fails instead of truncating */
    if (size > 1) {
        if (rank == 0) {
            xccl_status_t st = xccl_isend(c, s, 64, 1, 11, &ws);
            CHECK(run_wait(st, ws, "big send", rank) == 0);
        } else if (rank == 1) {
            CHECK(xccl_irecv(c, r, 16, 0, 11, &wr) == XCCL_OK);
            CHECK(xccl_work_wait(wr, -1) == XCCL_ERR_INVALID_USAGE);
            xccl_work_release(wr);
        }
    }
    free(s);
    free(r);
}

static void test_collectives(xccl_comm_t *c, int rank, int size)
{
    static const size_t counts[] = {0, 1, 7, 1000, 70001};

    for (size_t ci = 0; ci < sizeof(counts) / sizeof(counts[0]); ci++) {
        size_t   n    = counts[ci];
        int32_t *s    = malloc((n * size + 1) * 4);
        int32_t *r    = malloc((n * size + 1) * 4);
        for (xccl_coll_t coll = 0; coll < XCCL_COLL_COUNT; coll++) {
            const xccl_algo_t *const *algos = xccl_algo_list(coll);
            for (int ai = 0; algos && algos[ai]; ai++) {
                xccl_coll_opts_t opts = {.algo = algos[ai]->name};
                xccl_work_t     *w    = NULL;
                xccl_status_t    st;
                int              root = size > 1 ? 1 : 0;
                char             what[96];
                snprintf(what, sizeof(what), "%s/%s n=%zu", xccl_coll_name(coll), algos[ai]->name,
                         n);
                for (size_t i = 0; i < n * size; i++) s[i] = val(rank, i), r[i] = -7;
                switch (coll) {
                case XCCL_COLL_ALLREDUCE:
                    st = xccl_allreduce(c, s, r, n, XCCL_INT32, XCCL_OP_SUM, &opts, &w);
                    break;
                case XCCL_COLL_BROADCAST:
                    st = xccl_broadcast(c, s, n, XCCL_INT32, root, &opts, &w);
                    break;
                case XCCL_COLL_REDUCE:
                    st = xccl_reduce(c, s, r, n, XCCL_INT32, XCCL_OP_MAX, root, &opts, &w);
                    break;
                case XCCL_COLL_ALLGATHER:
                    st = xccl_allgather(c, s, r, n, XCCL_INT32, &opts, &w);
                    break;
                case XCCL_COLL_GATHER: st = xccl_gather(c, s, r, n, XCCL_INT32, root, &opts, &w); break;
                case XCCL_COLL_SCATTER:
                    st = xccl_scatter(c, s, r, n, XCCL_INT32, root, &opts, &w);
                    break;
                case XCCL_COLL_REDUCE_SCATTER:
                    st = xccl_reduce_scatter(c, s, r, n, XCCL_INT32, XCCL_OP_SUM, &opts, &w);
                    break;
                case XCCL_COLL_ALLTOALL: st = xccl_alltoall(c, s, r, n, XCCL_INT32, &opts, &w); break;
                case XCCL_COLL_BARRIER: st = xccl_barrier(c, &opts, &w); break;
                default: continue; /* alltoallv below */
                }
                if (algos[ai]->shared && st == XCCL_ERR_INVALID_ARG) {
                    /* a one-host algorithm refuses a call it cannot run here (too large for
                     * its slots, no cross-memory reads) before any byte moves */
                    CHECK_MSG(strstr(xccl_last_error(), "cannot run") != NULL, "%s: %s", what,
                              xccl_last_error());
                    continue;
                }
                if (run_wait(st, w, what, rank) != 0) {
                    CHECK_MSG(0, "%s failed", what);
                    continue;
                }
                for (size_t i = 0; i < n * size; i++) {
                    int64_t want = 0, got = r[i];
                    int     have = 1;
                    switch (coll) {
                    case XCCL_COLL_ALLREDUCE:
                        if (i >= n) have = 0;
                        for (int q = 0; q < size; q++) want += val(q, i);
                        break;
                    case XCCL_COLL_BROADCAST:
                        have = i < n, want = val(root, i), got = s[i];
                        break;
                    case XCCL_COLL_REDUCE:
                        have = i < n && rank == root, want = val(size - 1, i);
                        break;
                    case XCCL_COLL_ALLGATHER: want = val((int)(i / n), i % n); break;
                    case XCCL_COLL_GATHER:
                        have = rank == root, want = val((int)(i / n), i % n);
                        break;
                    case XCCL_COLL_SCATTER: have = i < n, want = val(root, rank * n + i); break;
                    case XCCL_COLL_REDUCE_SCATTER:
                        have = i < n;
                        for (int q = 0; q < size; q++) want += val(q, rank * n + i);
                        break;
                    case XCCL_COLL_ALLTOALL: want = val((int)(i / n), rank * n + i % n); break;
                    default: have = 0;
                    }
                    if (have && got != want) {
                        CHECK_MSG(0, "rank %d %s: [%zu] = %lld, want %lld", rank, what, i,
                                  (long long)got, (long long)want);
                        break;
                    }
                }
            }
        }
        free(s);
        free(r);
    }
}

static void test_mismatch(xccl_comm_t *c, int rank, int size)
{
    int32_t      x[4] = {0};
    xccl_work_t *w;
    xccl_status_t st;

    if (size < 2) return;
    if (rank == 0) st = xccl_allreduce(c, x, x, 4, XCCL_INT32, XCCL_OP_SUM, NULL, &w);
    else st = xccl_broadcast(c, x, 4, XCCL_INT32, 0, NULL, &w);
    CHECK(st == XCCL_OK);
    st = xccl_work_wait(w, -1);
    CHECK_MSG(st == XCCL_ERR_MISMATCH, "rank %d: mismatch status %s: %s", rank,
              xccl_status_string(st), xccl_work_error(w));
    CHECK(strstr(xccl_work_error(w), "mismatch") != NULL);
    xccl_work_release(w);
    /* stay alive until every rank has seen its error: a rank that exits early would turn its
     * peers' pending mismatch notices into "peer closed" errors */
    {
        xccl_store_t *store = NULL;
        int64_t       v;
        if (xccl_store_file_create(store_path, size, 20000, &store) == XCCL_OK) {
            const char *key = "mismatch-done";
            CHECK(xccl_store_add(store, key, 1, &v) == XCCL_OK);
            for (int k = 0; v < size && k < 30000; k++) { /* 30 s: a failed peer never comes */
                usleep(1000);
                CHECK(xccl_store_add(store, key, 0, &v) == XCCL_OK);
            }
            CHECK_MSG(v >= size, "rank %d: only %lld of %d ranks finished the mismatch test", rank,
                      (long long)v, size);
            xccl_store_release(store);
        }
    }
}

/* Rank 0 waits briefly for operations its peers start only later, then stops driving them:
 * the background progress thread must finish them (it picks such Works up at its tick). */
static void test_background(xccl_comm_t *c, int rank, int size)
{
    size_t        n = 70001;
    int32_t      *b = malloc(n * 4), x = -1;
    xccl_work_t  *wr = NULL, *wa = NULL;
    xccl_status_t st;

    if (size < 2) {
        free(b);
        return;
    }
    for (size_t i = 0; i < n; i++)
        b[i] = val(rank, i);
    if (rank == 0) {
        CHECK(xccl_irecv(c, &x, 4, 1, 21, &wr) == XCCL_OK);
        CHECK(xccl_allreduce(c, b, b, n, XCCL_INT32, XCCL_OP_SUM, NULL, &wa) == XCCL_OK);
        CHECK(xccl_work_wait_us(wa, 100) == XCCL_INPROGRESS); /* the others start 50 ms late */
        for (int k = 0; k < 2000; k++) {                      /* up to 2 s; no progress here */
            if (xccl_work_status(wr) != XCCL_INPROGRESS && xccl_work_status(wa) != XCCL_INPROGRESS)
                break;
            usleep(1000);
        }
        st = xccl_work_status(wr);
        CHECK_MSG(st == XCCL_OK && x == 1, "background recv: %s, x = %d", xccl_status_string(st),
                  (int)x);
        st = xccl_work_status(wa);
        CHECK_MSG(st == XCCL_OK, "background all_reduce: %s", xccl_status_string(st));
        for (size_t i = 0; st == XCCL_OK && i < n; i++) {
            int64_t want = 0;
            for (int q = 0; q < size; q++)
                want += val(q, i);
            if (b[i] != (int32_t)want) {
                CHECK_MSG(0, "background all_reduce at %zu: %d, want %lld", i, (int)b[i],
                          (long long)want);
                break;
            }
        }
    } else {
        usleep(50 * 1000);
        if (rank == 1) {
            int32_t one = 1;
            st          = xccl_isend(c, &one, 4, 0, 21, &wr);
            CHECK(run_wait(st, wr, "background send", rank) == 0);
            wr = NULL;
        }
        st = xccl_allreduce(c, b, b, n, XCCL_INT32, XCCL_OP_SUM, NULL, &wa);
        CHECK(run_wait(st, wa, "background all_reduce", rank) == 0);
        wa = NULL;
    }
    if (wr != NULL) xccl_work_release(wr);
    if (wa != NULL) xccl_work_release(wa);
    free(b);
}

static int child(int rank, int size, void *unused)
{
    (void)unused;
    xccl_comm_t *c = make_comm(rank, size);

    if (c == NULL) return 2;
    test_p2p(c, rank, size);
    test_collectives(c, rank, size);
    {
        /* a split of the even ranks runs its own collective */
        int          ranks[8], n = 0;
        xccl_comm_t *sub;
        for (int q = 0; q < size; q += 2) ranks[n++] = q;
        if (rank % 2 == 0) {
            CHECK(xccl_comm_split(c, n, ranks, "even", &sub) == XCCL_OK);
            test_collectives(sub, xccl_comm_rank(sub), xccl_comm_size(sub));
            xccl_comm_destroy(sub);
        }
    }
    test_background(c, rank, size);
    test_mismatch(c, rank, size);
    xccl_comm_destroy(c);
    return ctest_failures != 0;
}

int main(void)
{
    static const int sizes[] = {1, 2, 3, 4, 5};
    int              failed  = 0;

    for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
        int   size = sizes[k];
        snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-comm-%d-%d", (int)getpid(), size);
        unlink(store_path);
        failed += ctest_fork_ranks("test_comm", size, child, NULL);
        unlink(store_path);
    }
    ctest_checks++;
    if (failed) ctest_failures++;
    CTEST_MAIN_END("test_comm");
}
