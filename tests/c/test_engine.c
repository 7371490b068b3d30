/* SPDX-License-Identifier: Apache-2.0
 *
 * test_engine.c - the core's progress, matching and lifetime, through the public C API (and,
 * where a count is the only honest witness, the context's internals from core/core.h): forked
 * ranks meet through a file store and connect over the real transports.
 *
 *   many_works   hundreds of asynchronous collectives on two communicators, posted in opposite
 *                orders on alternate ranks, all complete with the right sums; a stalled one
 *                posted behind a hundred pending receives times out within its own timeout and
 *                names the peer it waits for.
 *   too_small    over tcp and over shm: a 4 MiB message for a posted 1 KiB receive fails that
 *                receive with the clear error, is dropped by the transport without any buffer
 *                of its size being allocated, and the next message from that peer is intact.
 *   matching     posting order across any-source and specific receives, for posted receives
 *                and for unexpected messages; and the cost: with hundreds of receives pending
 *                on other communicators and from other peers, a header is matched after
 *                examining at most three queue entries on average (a collective header: the
 *                fingerprint lookup and its receive; ctx->match_probes / match_headers).
 *   diag_unlocked  while an operation's timeout collects the hang table (3 s: one rank never
 *                answers), another thread of the same process completes a ping-pong: the
 *                collection does not hold the context lock while it waits.
 *   mem_types    a send of device memory to a peer no transport moves it to fails at once,
 *                naming the memory type and the peer; a message for a device-memory receive
 *                over a host-only transport fails that receive and the next one is intact.
 *   churn        thousands of subgroups created and destroyed, each with a message it receives
 *                (possibly before this rank created it) and one it never receives (staged, or
 *                arriving after the destroy): the context holds a bounded number of
 *                communicators and no staged bytes, split ids never collide, and the matching
 *                cost per header stays as low as with one communicator.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/core.h"
#include "ctest.h"
#include "xccl/xccl.h"

static char store_path[256];

/* The largest malloc since the counter was reset (the test's own malloc wraps glibc's; not
 * under AddressSanitizer or ThreadSanitizer, which own malloc: TSan's runtime calls malloc
 * before it is initialised, and an instrumented malloc crashes there). */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SAN_OWNS_MALLOC 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define SAN_OWNS_MALLOC 1
#endif
#endif
#if defined(SAN_OWNS_MALLOC)
#define HOOK_MALLOC 0
#else
#define HOOK_MALLOC 1
extern void          *__libc_malloc(size_t n);
static _Atomic size_t max_alloc;
void                 *malloc(size_t n)
{
    size_t m = atomic_load_explicit(&max_alloc, memory_order_relaxed);
    while (n > m && !atomic_compare_exchange_weak(&max_alloc, &m, n)) {
    }
    return __libc_malloc(n);
}
#endif

/* Flags shared by the ranks of one job (mmap'd before the fork). */
typedef struct shared {
    atomic_int stall_done;
    atomic_int posted;
    atomic_int pong_done; /* rank 0's second thread finished its ping-pong */
    atomic_int timed_out; /* rank 0's all_reduce returned */
    atomic_int leave;
} shared_t;
static shared_t *SH;

static int wait_posted(void)
{
    for (int i = 0; i < 30000 && atomic_load(&SH->posted) == 0; i++)
        usleep(1000);
    return atomic_load(&SH->posted) != 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static xccl_comm_t *make_comm_tp(int rank, int size, const char *transports)
{
    return ctest_file_comm(store_path, rank, size, 60000, "engine", transports);
}

static xccl_comm_t *make_comm(int rank, int size)
{
    return make_comm_tp(rank, size, NULL);
}

/* Element i of operation k on communicator `which`, contributed by rank r. */
static int32_t contrib(int which, int k, int r, int i)
{
    return which * 100000 + k * 37 + r * 3 + i;
}

enum { NOPS = 160, NELEM = 8, NSTALL_BEHIND = 100 };

static void many_works(xccl_comm_t *world, int rank, int size)
{
    xccl_comm_t *comm[2];
    int          all[16];
    int32_t     *buf = malloc(sizeof(int32_t) * 2 * NOPS * NELEM);
    xccl_work_t *w[2][NOPS];
    /* ring: every operation needs several passes of progress on every rank, so none completes
     * unless each rank progresses the other's first operations too */
    xccl_coll_opts_t ring = {.algo = "ring"};

    for (int r = 0; r < size; r++)
        all[r] = r;
    CHECK(xccl_comm_split(world, size, all, "A", &comm[0]) == XCCL_OK);
    CHECK(xccl_comm_split(world, size, all, "B", &comm[1]) == XCCL_OK);
    /* even ranks post every operation of A, then every one of B; odd ranks B first */
    for (int o = 0; o < 2; o++) {
        int which = rank % 2 == 0 ? o : 1 - o;
        for (int k = 0; k < NOPS; k++) {
            int32_t *b = buf + ((size_t)which * NOPS + (size_t)k) * NELEM;
            for (int i = 0; i < NELEM; i++)
                b[i] = contrib(which, k, rank, i);
            CHECK(xccl_allreduce(comm[which], b, b, NELEM, XCCL_INT32, XCCL_OP_SUM, &ring,
                                 &w[which][k]) == XCCL_OK);
        }
    }
    for (int which = 0; which < 2; which++) {
        for (int k = 0; k < NOPS; k++) {
            int32_t *b  = buf + ((size_t)which * NOPS + (size_t)k) * NELEM;
            int      ok = 1;
            CHECK_MSG(xccl_work_wait(w[which][k], 30000) == XCCL_OK, "op %d of %c: %s", k,
                      'A' + which, xccl_work_error(w[which][k]));
            for (int i = 0; i < NELEM; i++) {
                int32_t want = 0;
                for (int r = 0; r < size; r++)
                    want += contrib(which, k, r, i);
                ok &= b[i] == want;
            }
            CHECK_MSG(ok, "op %d of %c: wrong sum", k, 'A' + which);
            xccl_work_release(w[which][k]);
        }
    }
    xccl_comm_destroy(comm[0]);
    xccl_comm_destroy(comm[1]);

    /* The stall: ranks 0 and 1 share a communicator on which only rank 0 posts an all_reduce
     * with a 1.5 s timeout, behind a hundred receives that rank 1 sends only once rank 0 has
     * seen the all_reduce time out. */
    if (rank <= 1 && size >= 2) {
        int          pair[2] = {0, 1};
        xccl_comm_t *s;
        int32_t      x[4] = {1, 2, 3, 4}, rv[NSTALL_BEHIND];
        xccl_work_t *rw[NSTALL_BEHIND];

        CHECK(xccl_comm_split(world, 2, pair, "stall", &s) == XCCL_OK);
        if (rank == 0) {
            xccl_coll_opts_t opts = {.timeout_ms = 1500};
            xccl_work_t     *ws;
            xccl_status_t    st;
            double           t0;
            for (int k = 0; k < NSTALL_BEHIND; k++)
                CHECK(xccl_irecv(world, &rv[k], sizeof(rv[k]), 1, (uint32_t)(500 + k), &rw[k]) ==
                      XCCL_OK);
            t0 = now_s();
            CHECK(xccl_allreduce(s, x, x, 4, XCCL_INT32, XCCL_OP_SUM, &opts, &ws) == XCCL_OK);
            st = xccl_work_wait(ws, 20000);
            CHECK_MSG(st == XCCL_ERR_TIMEOUT, "stalled all_reduce: status %d", st);
            CHECK_MSG(now_s() - t0 < 10.0, "timed out after %.1f s", now_s() - t0);
            /* a message-based all_reduce waits "for a message from rank 1", a one-host one
             * "for rank 1 (pid) to write the node-shared segment" */
            CHECK_MSG(strstr(xccl_work_error(ws), "from rank 1") != NULL ||
                          strstr(xccl_work_error(ws), "for rank 1 (pid") != NULL,
                      "error: %s",
                      xccl_work_error(ws));
            xccl_work_release(ws);
            atomic_store(&SH->stall_done, 1);
            for (int k = 0; k < NSTALL_BEHIND; k++) {
                CHECK(xccl_work_wait(rw[k], 30000) == XCCL_OK);
                CHECK(rv[k] == 7 * k);
                xccl_work_release(rw[k]);
            }
        } else {
            double end = now_s() + 30;
            while (atomic_load(&SH->stall_done) == 0 && now_s() < end)
                usleep(1000);
            CHECK(atomic_load(&SH->stall_done) == 1);
            for (int k = 0; k < NSTALL_BEHIND; k++) {
                rv[k] = 7 * k;
                CHECK(xccl_isend(world, &rv[k], sizeof(rv[k]), 0, (uint32_t)(500 + k), &rw[k]) ==
                      XCCL_OK);
            }
            for (int k = 0; k < NSTALL_BEHIND; k++) {
                CHECK(xccl_work_wait(rw[k], 30000) == XCCL_OK);
                xccl_work_release(rw[k]);
            }
        }
        xccl_comm_destroy(s);
    }
    free(buf);
}

static void barrier(xccl_comm_t *c)
{
    xccl_work_t *w;
    CHECK(xccl_barrier(c, NULL, &w) == XCCL_OK && xccl_work_wait(w, 30000) == XCCL_OK);
    xccl_work_release(w);
}

static void send_val(xccl_comm_t *c, int peer, uint32_t tag, int32_t v)
{
    xccl_work_t *w;
    CHECK(xccl_isend(c, &v, sizeof(v), peer, tag, &w) == XCCL_OK);
    CHECK(xccl_work_wait(w, 30000) == XCCL_OK);
    xccl_work_release(w);
}

/* Waits for a receive of one int32 and checks its value and source. */
static void want(xccl_work_t *w, const int32_t *v, int32_t value, int src, const char *what)
{
    CHECK_MSG(xccl_work_wait(w, 30000) == XCCL_OK, "%s: %s", what, xccl_work_error(w));
    CHECK_MSG(*v == value && xccl_work_source(w) == src, "%s: got %d from %d, want %d from %d",
              what, (int)*v, xccl_work_source(w), (int)value, src);
    xccl_work_release(w);
}

enum { NC = 12, NP = 20, NM = 50 };

static void matching(xccl_comm_t *world, int rank, int size)
{
    xccl_ctx_t  *ctx = world->ctx;
    int32_t      v[8];
    xccl_work_t *w[8];
    int          all[16];

    /* posted: any, specific, any - all tag 5 - take rank 1's three messages in that order */
    if (rank == 0) {
        CHECK(xccl_irecv(world, &v[0], 4, XCCL_ANY_SOURCE, 5, &w[0]) == XCCL_OK);
        CHECK(xccl_irecv(world, &v[1], 4, 1, 5, &w[1]) == XCCL_OK);
        CHECK(xccl_irecv(world, &v[2], 4, XCCL_ANY_SOURCE, 5, &w[2]) == XCCL_OK);
        CHECK(xccl_irecv(world, &v[3], 4, 1, 6, &w[3]) == XCCL_OK);
        CHECK(xccl_irecv(world, &v[4], 4, XCCL_ANY_SOURCE, 6, &w[4]) == XCCL_OK);
    }
    barrier(world);
    if (rank == 1) {
        for (int k = 1; k <= 3; k++)
            send_val(world, 0, 5, k);
        send_val(world, 0, 6, 11);
        send_val(world, 0, 6, 12);
    }
    if (rank == 0) {
        want(w[0], &v[0], 1, 1, "any-source posted first");
        want(w[1], &v[1], 2, 1, "specific posted second");
        want(w[2], &v[2], 3, 1, "any-source posted third");
        want(w[3], &v[3], 11, 1, "specific posted before any-source");
        want(w[4], &v[4], 12, 1, "any-source posted after specific");
    }
    if (size >= 3) {
        /* unexpected: an any-source receive takes the earliest arrival of any sender */
        if (rank == 1) send_val(world, 0, 7, 21);
        barrier(world);
        if (rank == 2) send_val(world, 0, 7, 22);
        if (rank == 2) send_val(world, 0, 8, 31);
        barrier(world);
        if (rank == 1) send_val(world, 0, 8, 32);
        barrier(world);
        if (rank == 0) {
            CHECK(xccl_irecv(world, &v[0], 4, XCCL_ANY_SOURCE, 7, &w[0]) == XCCL_OK);
            CHECK(xccl_irecv(world, &v[1], 4, XCCL_ANY_SOURCE, 7, &w[1]) == XCCL_OK);
            CHECK(xccl_irecv(world, &v[2], 4, 1, 8, &w[2]) == XCCL_OK);
            CHECK(xccl_irecv(world, &v[3], 4, XCCL_ANY_SOURCE, 8, &w[3]) == XCCL_OK);
            want(w[0], &v[0], 21, 1, "earliest unexpected");
            want(w[1], &v[1], 22, 2, "next unexpected");
            want(w[2], &v[2], 32, 1, "specific unexpected");
            want(w[3], &v[3], 31, 2, "any-source unexpected after a specific one took its own");
        }
    }

    /* the cost of matching does not grow with the receives pending elsewhere */
    {
        xccl_comm_t  *c[NC];
        int32_t      *pv      = calloc((size_t)NC * NP * 16 + NC, sizeof(int32_t));
        int32_t      *mv      = calloc((size_t)NM * 16, sizeof(int32_t));
        xccl_work_t **pw      = calloc((size_t)NC * NP * 16 + NC, sizeof(*pw));
        xccl_work_t **mw      = calloc((size_t)NM * 16, sizeof(*mw));
        size_t        np      = 0;
        uint64_t      headers = 0, probes = 0;

        for (int r = 0; r < size; r++)
            all[r] = r;
        for (int i = 0; i < NC; i++)
            CHECK(xccl_comm_split(world, size, all, "m", &c[i]) == XCCL_OK);
        if (rank == 0) {
            for (int i = 0; i < NC - 1; i++) {
                for (int p = 1; p < size; p++) {
                    for (int k = 0; k < NP; k++, np++)
                        CHECK(xccl_irecv(c[i], &pv[np], 4, p, (uint32_t)(1000 + k), &pw[np]) ==
                              XCCL_OK);
                }
                CHECK(xccl_irecv(c[i], &pv[np], 4, XCCL_ANY_SOURCE, 3000, &pw[np]) == XCCL_OK);
                np++;
            }
            for (int p = 1; p < size; p++) {
                for (int k = 0; k < NM; k++)
                    CHECK(xccl_irecv(c[NC - 1], &mv[(p - 1) * NM + k], 4, p, (uint32_t)(2000 + k),
                                     &mw[(p - 1) * NM + k]) == XCCL_OK);
            }
            pthread_mutex_lock(&ctx->lock);
            ctx->match_headers = ctx->match_probes = 0;
            pthread_mutex_unlock(&ctx->lock);
        }
        barrier(world);
        if (rank != 0) {
            for (int k = 0; k < NM; k++)
                send_val(c[NC - 1], 0, (uint32_t)(2000 + k), rank * 1000 + k);
        } else {
            for (int p = 1; p < size; p++) {
                for (int k = 0; k < NM; k++)
                    want(mw[(p - 1) * NM + k], &mv[(p - 1) * NM + k], p * 1000 + k, p, "measured");
            }
            pthread_mutex_lock(&ctx->lock);
            headers = ctx->match_headers;
            probes  = ctx->match_probes;
            pthread_mutex_unlock(&ctx->lock);
            CHECK_MSG(headers >= (uint64_t)NM * (size - 1) && probes <= 3 * headers,
                      "%llu queue entries examined for %llu headers with %zu receives pending",
                      (unsigned long long)probes, (unsigned long long)headers, np);
        }
        barrier(world);
        /* now the pending ones */
        if (rank != 0) {
            for (int i = 0; i < NC - 1; i++) {
                for (int k = 0; k < NP; k++)
                    send_val(c[i], 0, (uint32_t)(1000 + k), rank * 100 + k);
                if (rank == 1) send_val(c[i], 0, 3000, 7);
            }
        } else {
            np = 0;
            for (int i = 0; i < NC - 1; i++) {
                for (int p = 1; p < size; p++) {
                    for (int k = 0; k < NP; k++, np++)
                        want(pw[np], &pv[np], p * 100 + k, p, "pending");
                }
                want(pw[np], &pv[np], 7, 1, "pending any-source");
                np++;
            }
        }
        barrier(world);
        for (int i = 0; i < NC; i++)
            xccl_comm_destroy(c[i]);
        free(pv);
        free(mv);
        free(pw);
        free(mw);
    }
}

/* A p2p Work whose request has memory type `mem` (the public API posts host memory only). */
static xccl_work_t *p2p_work(xccl_comm_t *c, req_kind_t kind, int peer, void *buf, size_t n,
                             uint32_t tag, xccl_mem_type_t mem)
{
    xccl_work_t *w = xccl_work_new(c, WORK_P2P, kind == REQ_SEND ? "send" : "recv", 0);
    xccl_req_t  *r = &w->p2p_req;

    r->kind    = kind;
    r->peer    = c->world[peer];
    r->src     = -1;
    r->buf     = buf;
    r->nbytes  = n;
    r->tag     = tag;
    r->work    = w;
    r->comm_id = c->id;
    r->mem     = mem;
    w->req     = r;
    return w;
}

static void mem_types(xccl_comm_t *c, int rank)
{
    xccl_ctx_t *ctx    = c->ctx;
    char        buf[8] = {0};
    int32_t     v      = 0;

    if (rank == 0) {
        xccl_work_t  *w = p2p_work(c, REQ_SEND, 1, buf, sizeof(buf), 99, XCCL_MEM_CUDA);
        xccl_work_t  *wr, *wn;
        xccl_status_t st;
        pthread_mutex_lock(&ctx->lock);
        st = xccl_req_post_send(ctx, w->req);
        pthread_mutex_unlock(&ctx->lock);
        CHECK_MSG(st == XCCL_ERR_NOT_SUPPORTED &&
                      strstr(xccl_last_error(), "cuda memory to rank 1") != NULL,
                  "status %d: %s", st, xccl_last_error());
        xccl_work_release(w);

        wr = p2p_work(c, REQ_RECV, 1, buf, sizeof(buf), 98, XCCL_MEM_CUDA);
        pthread_mutex_lock(&ctx->lock);
        xccl_work_activate(wr, 1);
        CHECK(xccl_req_post_recv(ctx, wr->req) == XCCL_OK);
        pthread_mutex_unlock(&ctx->lock);
        CHECK(xccl_irecv(c, &v, 4, 1, 97, &wn) == XCCL_OK);
        barrier(c);
        CHECK(xccl_work_wait(wr, 30000) == XCCL_ERR_NOT_SUPPORTED);
        CHECK_MSG(strstr(xccl_work_error(wr), "into cuda memory") != NULL, "%s",
                  xccl_work_error(wr));
        want(wn, &v, 1234, 1, "after the refused device receive");
        xccl_work_release(wr);
    } else {
        barrier(c);
        if (rank == 1) {
            send_val(c, 0, 98, 5);
            send_val(c, 0, 97, 1234);
        }
    }
    barrier(c);
}

enum { NCHURN = 3000 };

static void churn(xccl_comm_t *world, int rank, int size)
{
    xccl_ctx_t  *ctx = world->ctx;
    int          all[16];
    int          max_comms = 0;
    xccl_work_t *w;

    for (int r = 0; r < size; r++)
        all[r] = r;
    pthread_mutex_lock(&ctx->lock);
    ctx->match_headers = ctx->match_probes = 0;
    pthread_mutex_unlock(&ctx->lock);
    for (int i = 0; i < NCHURN; i++) {
        xccl_comm_t *sub;
        int32_t      v = -1, late = i;
        /* the same member list every time: only the parent's split count tells them apart */
        CHECK(xccl_comm_split(world, size, all, "churn", &sub) == XCCL_OK);
        if (rank == 0) {
            xccl_work_t *w2;
            v = i;
            CHECK(xccl_isend(sub, &v, sizeof(v), 1, 1, &w) == XCCL_OK);
            CHECK(xccl_isend(sub, &late, sizeof(late), 1, 2, &w2) == XCCL_OK);
            CHECK(xccl_work_wait(w, 30000) == XCCL_OK);
            CHECK(xccl_work_wait(w2, 30000) == XCCL_OK);
            xccl_work_release(w);
            xccl_work_release(w2);
        } else if (rank == 1) {
            CHECK(xccl_irecv(sub, &v, sizeof(v), 0, 1, &w) == XCCL_OK);
            CHECK_MSG(xccl_work_wait(w, 30000) == XCCL_OK, "subgroup %d: %s", i,
                      xccl_work_error(w));
            CHECK_MSG(v == i, "subgroup %d got %d", i, (int)v);
            xccl_work_release(w);
        }
        xccl_comm_destroy(sub);
        pthread_mutex_lock(&ctx->lock);
        if (ctx->ncomms > max_comms) max_comms = ctx->ncomms;
        pthread_mutex_unlock(&ctx->lock);
        if (i % 500 == 499 || i == NCHURN - 1) {
            /* after the barrier every message rank 0 sent before it has reached rank 1 */
            CHECK(xccl_barrier(world, NULL, &w) == XCCL_OK && xccl_work_wait(w, 30000) == XCCL_OK);
            xccl_work_release(w);
            pthread_mutex_lock(&ctx->lock);
            CHECK_MSG(ctx->staged_bytes == 0, "%llu bytes staged after %d subgroups",
                      (unsigned long long)ctx->staged_bytes, i + 1);
            CHECK_MSG(ctx->ncomms == 1, "%d communicators held after %d subgroups", ctx->ncomms,
                      i + 1);
            pthread_mutex_unlock(&ctx->lock);
            /* nobody sends for the next subgroup before everyone has looked */
            CHECK(xccl_barrier(world, NULL, &w) == XCCL_OK && xccl_work_wait(w, 30000) == XCCL_OK);
            xccl_work_release(w);
        }
    }
    CHECK_MSG(max_comms <= 2, "up to %d communicators held", max_comms);
    /* the matching cost did not grow with the communicators created before */
    pthread_mutex_lock(&ctx->lock);
    CHECK_MSG(ctx->match_probes <= 3 * ctx->match_headers,
              "%llu queue entries examined for %llu headers", (unsigned long long)ctx->match_probes,
              (unsigned long long)ctx->match_headers);
    pthread_mutex_unlock(&ctx->lock);
}

enum { BIG = 4 << 20, SMALL = 1024, NEXT = 5000 };

static uint8_t pattern(size_t i, int salt)
{
    return (uint8_t)(i * 131 + (i >> 9) + (size_t)salt);
}

static int child_small(int rank, int size, void *arg)
{
    const char *tp = arg;

    (void)size;
    xccl_comm_t *c = make_comm_tp(rank, 2, tp);
    xccl_work_t *w1, *w2;

    if (c == NULL) return 2;
    CHECK(strcmp(xccl_comm_peer_transport(c, 1 - rank), tp) == 0);
    if (rank == 0) {
        uint8_t *big = malloc(BIG), *next = malloc(NEXT);
        for (size_t i = 0; i < BIG; i++)
            big[i] = pattern(i, 1);
        for (size_t i = 0; i < NEXT; i++)
            next[i] = pattern(i, 2);
        CHECK(wait_posted());
        CHECK(xccl_isend(c, big, BIG, 1, 1, &w1) == XCCL_OK);
        CHECK(xccl_isend(c, next, NEXT, 1, 2, &w2) == XCCL_OK);
        CHECK(xccl_work_wait(w1, 30000) == XCCL_OK);
        CHECK(xccl_work_wait(w2, 30000) == XCCL_OK);
        xccl_work_release(w1);
        xccl_work_release(w2);
        free(big);
        free(next);
    } else {
        uint8_t *small = malloc(SMALL), *next = malloc(NEXT);
        int      ok = 1;
        CHECK(xccl_irecv(c, small, SMALL, 0, 1, &w1) == XCCL_OK);
        CHECK(xccl_irecv(c, next, NEXT, 0, 2, &w2) == XCCL_OK);
#if HOOK_MALLOC
        atomic_store(&max_alloc, 0);
#endif
        atomic_store(&SH->posted, 1);
        CHECK(xccl_work_wait(w1, 30000) == XCCL_ERR_INVALID_USAGE);
        CHECK_MSG(strstr(xccl_work_error(w1), "smaller than the 4194304-byte message") != NULL,
                  "%s: %s", tp, xccl_work_error(w1));
        CHECK_MSG(xccl_work_wait(w2, 30000) == XCCL_OK, "%s: %s", tp, xccl_work_error(w2));
        for (size_t i = 0; i < NEXT; i++)
            ok &= next[i] == pattern(i, 2);
        CHECK_MSG(ok, "%s: the message after the dropped one is corrupt", tp);
#if HOOK_MALLOC
        CHECK_MSG(atomic_load(&max_alloc) < BIG, "%s: a %zu-byte allocation", tp,
                  atomic_load(&max_alloc));
#endif
        xccl_work_release(w1);
        xccl_work_release(w2);
        free(small);
        free(next);
    }
    CHECK(xccl_barrier(c, NULL, &w1) == XCCL_OK && xccl_work_wait(w1, 30000) == XCCL_OK);
    xccl_work_release(w1);
    xccl_comm_destroy(c);
    return ctest_failures != 0;
}

typedef struct pong_arg {
    xccl_comm_t *world;
    int          rank;
} pong_arg_t;

/* Rank 0 and 1's second thread: after the all_reduce has timed out (0.5 s) and while its
 * table is being collected (3 s), one exchange with the other rank over the world comm. */
static void *pong_main(void *arg)
{
    pong_arg_t *a = arg;
    int32_t     v = 0;

    usleep(1500 * 1000);
    if (a->rank == 0) {
        send_val(a->world, 1, 40, 41);
        CHECK(atomic_load(&SH->timed_out) == 0); /* still collecting */
        {
            xccl_work_t *w;
            CHECK(xccl_irecv(a->world, &v, 4, 1, 41, &w) == XCCL_OK);
            want(w, &v, 42, 1, "pong");
        }
        atomic_store(&SH->pong_done, atomic_load(&SH->timed_out) == 0 ? 1 : 2);
    } else {
        xccl_work_t *w;
        CHECK(xccl_irecv(a->world, &v, 4, 0, 40, &w) == XCCL_OK);
        want(w, &v, 41, 0, "ping");
        send_val(a->world, 0, 41, 42);
    }
    return NULL;
}

static int child_diag(int rank, int size, void *unused)
{
    (void)size, (void)unused;
    xccl_comm_t *c, *s;
    int          all[3] = {0, 1, 2};
    pthread_t    th;
    pong_arg_t   arg;

    setenv("XCCL_DIAG_WAIT_MS", "3000", 1);
    if (rank == 2) setenv("XCCL_PROGRESS_THREAD", "0", 1); /* never answers a query */
    c = make_comm(rank, 3);
    if (c == NULL) return 2;
    CHECK(xccl_comm_split(c, 3, all, "unlocked", &s) == XCCL_OK);
    arg = (pong_arg_t){c, rank};
    if (rank < 2) {
        xccl_coll_opts_t opts = {.timeout_ms = 500};
        int32_t          x[2] = {1, 2};
        xccl_work_t     *w;
        CHECK(pthread_create(&th, NULL, pong_main, &arg) == 0);
        CHECK(xccl_allreduce(s, x, x, 2, XCCL_INT32, XCCL_OP_SUM, &opts, &w) == XCCL_OK);
        CHECK(xccl_work_wait(w, 30000) == XCCL_ERR_TIMEOUT);
        if (rank == 0) atomic_store(&SH->timed_out, 1);
        CHECK_MSG(strstr(xccl_work_error(w), "rank 2: no answer") != NULL, "%s",
                  xccl_work_error(w));
        xccl_work_release(w);
        pthread_join(th, NULL);
        if (rank == 0)
            CHECK_MSG(atomic_load(&SH->pong_done) == 1,
                      "the ping-pong finished only after the table (%d)",
                      atomic_load(&SH->pong_done));
        atomic_fetch_add(&SH->leave, 1);
    } else {
        for (int i = 0; i < 30000 && atomic_load(&SH->leave) < 2; i++)
            usleep(1000);
    }
    xccl_comm_destroy(s);
    barrier(c);
    xccl_comm_destroy(c);
    return ctest_failures != 0;
}

/* A control message about a collective this rank has not posted yet (the fingerprint check a
 * rank sends when its start sent the next rank no data) waits on the communicator's control
 * list and is taken when the collective is posted: ranks 0 and 1 of a split call broadcast and
 * reduce; rank 1 posts only once rank 0's check has arrived (it came before a p2p message
 * rank 0 sent after posting, on the same connection), so rank 1 finds the mismatch at post
 * time and the notice leaves the list (left there, it would stay until the communicator goes:
 * rank 0's reply also fails rank 1's call, but never takes rank 0's check). */
static void early_notice(xccl_comm_t *world, int rank)
{
    static const int pair[2] = {0, 1};
    xccl_comm_t     *c       = NULL;
    xccl_work_t     *w = NULL, *wr;
    float            x[4]    = {1, 2, 3, 4};
    int32_t          v       = 0;
    xccl_status_t    st;

    if (rank > 1) return;
    CHECK(xccl_comm_split(world, 2, pair, "early", &c) == XCCL_OK);
    if (c == NULL) return;
    if (rank == 0) {
        CHECK(xccl_broadcast(c, x, 4, XCCL_FLOAT32, 1, NULL, &w) == XCCL_OK);
        send_val(world, 1, 77, 1);
    } else {
        CHECK(xccl_irecv(world, &v, sizeof(v), 0, 77, &wr) == XCCL_OK);
        want(wr, &v, 1, 0, "early_notice ready");
        CHECK(xccl_reduce(c, x, x, 4, XCCL_FLOAT32, XCCL_OP_SUM, 1, NULL, &w) == XCCL_OK);
    }
    if (w != NULL) {
        st = xccl_work_wait(w, 20000);
        CHECK_MSG(st == XCCL_ERR_MISMATCH, "rank %d: %s", rank, xccl_work_error(w));
        if (rank == 1)
            CHECK_MSG(strstr(xccl_work_error(w), "rank 1 called reduce") != NULL &&
                          strstr(xccl_work_error(w), "rank 0 called broadcast") != NULL,
                      "rank 1: %s", xccl_work_error(w));
        if (rank == 1)
            CHECK_MSG(c->ctrl.head == NULL, "a notice about a posted collective stayed");
        xccl_work_release(w);
    }
    xccl_comm_destroy(c);
}

static int child(int rank, int size, void *unused)
{
    (void)unused;
    xccl_comm_t *c = make_comm(rank, size);
    xccl_work_t *w;

    if (c == NULL) return 2;
    many_works(c, rank, size);
    matching(c, rank, size);
    mem_types(c, rank);
    churn(c, rank, size);
    early_notice(c, rank);
    /* leave together: a rank that exits early looks like a failure to the others */
    CHECK(xccl_barrier(c, NULL, &w) == XCCL_OK && xccl_work_wait(w, 30000) == XCCL_OK);
    xccl_work_release(w);
    xccl_comm_destroy(c);
    return ctest_failures != 0;
}

int main(void)
{
    static const int sizes[] = {2, 3};
    int              failed  = 0;

    setenv("XCCL_DIAG_WAIT_MS", "200", 1);
    SH = mmap(NULL, sizeof(*SH), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (SH == MAP_FAILED) return 1;
    for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
        int   size = sizes[k];
        memset(SH, 0, sizeof(*SH));
        snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-engine-%d-%d", (int)getpid(),
                 size);
        unlink(store_path);
        failed += ctest_fork_ranks("engine", size, child, NULL);
        unlink(store_path);
    }
    {
        memset(SH, 0, sizeof(*SH));
        snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-engine-%d-diag", (int)getpid());
        unlink(store_path);
        failed += ctest_fork_ranks("diag_unlocked", 3, child_diag, NULL);
        unlink(store_path);
    }
    for (int k = 0; k < 2; k++) {
        const char *tp = k == 0 ? "tcp" : "shm";
        memset(SH, 0, sizeof(*SH));
        snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-engine-%d-%s", (int)getpid(), tp);
        unlink(store_path);
        failed += ctest_fork_ranks(tp, 2, child_small, (void *)tp);
        unlink(store_path);
    }
    ctest_checks++;
    if (failed) ctest_failures++;
    CTEST_MAIN_END("test_engine");
}
