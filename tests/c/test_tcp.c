/* SPDX-License-Identifier: Apache-2.0
 *
 * test_tcp.c - the TCP transport driven by a tiny fake core, in forked processes on loopback.
 * Each job forks its ranks (plus, for one job, a rogue process); they meet through a shared
 * anonymous mapping (address blobs and flags). Payloads are checked against a generator
 * seeded per message, independent of the transport.
 *
 *   job                 ranks  checks
 *   basic               2      ping-pong 0 B .. 64 MiB (posted and unexpected buffers), header
 *                              fields, wait/wake, wait returns when data arrives, bad isend args
 *   order               2      2000 messages posted back to back arrive in order, intact
 *   both_ways           2      4 x 16 MiB each way at once (no deadlock), small ones between
 *   all_to_all          4      every pair, mixed sizes incl. 0, per-peer order
 *   ring_use            4      only neighbours wired; isend elsewhere is refused
 *   refuse              2      recv_match refusing a message fails that peer with its status
 *   peer_exit           3      rank 1 dies mid-transfer: its send and receive fail, peer_failed
 *                              names it, isend to it fails; ranks 0 and 2 carry on
 *   rogue               2 + 1  garbage, silent, wrong job id, wrong key, no key, bad rank,
 *                              partial hello, and a connection after wire-up: all refused,
 *                              the job wires up and works (with an auth key)
 *   missing             3      rank 1 never wires up: ranks 0 and 2 time out naming rank 1
 *   big (XCCL_TEST_BIG=1) 2    one message of 2 GiB + 4097 bytes
 *   perf (XCCL_TEST_PERF=1) 2  timings only, printed to stderr: ping-pong half round trip at
 *                              8 B .. 64 MiB, and both ranks streaming 64 MiB to each other
 *                              in 512 KiB messages at once (a ring step); receives posted
 */
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../../backends/tcp/tcp_wire.h"
#include "core/auth.h"
#include "core/check.h"
#include "core/sock.h"
#include "ctest.h"
#include "xccl/xccl_transport.h"

extern const xccl_transport_ops_t xccl_transport_tcp;
static const xccl_transport_ops_t *const TP = &xccl_transport_tcp;

#define MAXR   8
#define JOB_ID 0x5eed0000c0ffee01ull
#define MiB    ((size_t)1 << 20)

#include "tp_harness.h"

/* ---------------------------------------------------------------------------------------------
 * Shared state between the processes of a job
 * ------------------------------------------------------------------------------------------- */

enum { FL_ROGUE_DONE, FL_WIRED, FL_ROGUE2_DONE, FL_WAITING, FL_DONE, FL_COUNT };

typedef struct shared {
    atomic_int ready[MAXR];
    uint8_t    blob[MAXR][XCCL_TP_ADDR_MAX];
    size_t     blen[MAXR];
    atomic_int flag[FL_COUNT];
    atomic_int checks, failures; /* the children's ctest counters, summed */
} shared_t;

static shared_t *S;


/* ---------------------------------------------------------------------------------------------
 * Job harness
 * ------------------------------------------------------------------------------------------- */

static const char    *KEY;    /* auth key of the running job, or NULL */

/* Init, publish the address, wait for everyone's. */
static void setup(int rank)
{
    xccl_tp_init_params_t p;
    xccl_peer_info_t      infos[MAXR];

    memset(&F, 0, sizeof(F));
    memset(infos, 0, sizeof(infos));
    F.rank = rank;
    F.size = NRANKS;
    memset(&p, 0, sizeof(p));
    p.rank         = rank;
    p.size         = NRANKS;
    p.job_id       = JOB_ID;
    p.peers        = infos;
    p.auth_key     = KEY;
    p.auth_key_len = KEY ? strlen(KEY) : 0;
    p.up           = &UP;
    CHECK(TP->init(&p, &CTX) == XCCL_OK);
    CHECK(TP->get_addr(CTX, S->blob[rank], &S->blen[rank]) == XCCL_OK);
    CHECK(S->blen[rank] > 0 && S->blen[rank] <= XCCL_TP_ADDR_MAX);
    atomic_store(&S->ready[rank], 1);
    for (int r = 0; r < NRANKS; r++) CHECK(wait_flag(&S->ready[r], 1, 10000));
}

static xccl_status_t wire(const uint8_t *use, int64_t timeout_ms)
{
    const void *addrs[MAXR];
    size_t      lens[MAXR];
    uint8_t     all[MAXR];

    for (int r = 0; r < NRANKS; r++) {
        addrs[r] = S->blob[r];
        lens[r]  = S->blen[r];
        all[r]   = r != F.rank;
    }
    return TP->wireup(CTX, addrs, lens, use ? use : all, timeout_ms);
}

static void teardown(void)
{
    reset_msgs();
    free(F.msgs);
    CHECK(F.callbacks_bad == 0);
    TP->finalize(CTX);
    CTX = NULL;
}

/* Forks nprocs processes running body(rank); a hang is a failure (killed after timeout_s). */
static void run_job(const char *name, int nprocs, int nranks, const char *key,
                    void (*body)(int rank), int timeout_s)
{
    pid_t   pids[MAXR];
    int     left = nprocs;
    int64_t end  = xccl_now_ms() + (int64_t)timeout_s * 1000;
    int64_t t0   = xccl_now_ms();

    memset(S, 0, sizeof(*S));
    NRANKS = nranks;
    KEY    = key;
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < nprocs; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            ctest_failures = ctest_checks = 0;
            body(r);
            atomic_fetch_add(&S->checks, ctest_checks);
            atomic_fetch_add(&S->failures, ctest_failures);
            exit(ctest_failures != 0 ? 1 : 0); /* exit, not _exit: LeakSanitizer runs */
        }
    }
    while (left > 0) {
        int   status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid > 0) {
            for (int r = 0; r < nprocs; r++)
                if (pids[r] == pid) {
                    CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                              "job %s: process %d ended with status 0x%x", name, r, status);
                    pids[r] = -1;
                }
            left--;
            continue;
        }
        if (xccl_now_ms() > end) {
            for (int r = 0; r < nprocs; r++)
                if (pids[r] > 0) {
                    CHECK_MSG(0, "job %s: process %d hung; killed", name, r);
                    kill(pids[r], SIGKILL);
                    waitpid(pids[r], &status, 0);
                    left--;
                }
            break;
        }
        usleep(2000);
    }
    ctest_checks += atomic_load(&S->checks);
    ctest_failures += atomic_load(&S->failures);
    fprintf(stderr, "  job %-10s %5lld ms\n", name, (long long)(xccl_now_ms() - t0));
}

/* ---------------------------------------------------------------------------------------------
 * Jobs
 * ------------------------------------------------------------------------------------------- */

static void *waiter(void *arg)
{
    int64_t *ms = arg;
    int64_t  t0 = xccl_now_ms();

    TP->wait(CTX, 5000);
    *ms = xccl_now_ms() - t0;
    return NULL;
}

static void drain(void)
{
    int nev = 1, rounds = 0;

    while (nev > 0 || rounds < 3) {
        TP->progress(CTX, &nev);
        rounds++;
    }
}

/* Ping-pong across sizes: rank 0 sends, rank 1 echoes what it received. */
static void job_basic(int rank)
{
    static const size_t sizes[] = {0, 1, 7, 31, 32, 33, 4095, 8192, 65537, MiB + 3, 64 * MiB};
    const size_t        nsizes  = sizeof(sizes) / sizeof(sizes[0]);
    int                 peer    = 1 - rank;
    char               *big     = malloc(64 * MiB);

    setup(rank);
    CHECK(wire(NULL, 5000) == XCCL_OK);
    for (size_t k = 0; k < nsizes; k++) {
        size_t         n  = sizes[k];
        xccl_status_t  st = XCCL_INPROGRESS;
        sends_t        s  = {&st, 1};
        size_t         want = 1;
        void          *both[2] = {&s, &want};
        xccl_msg_hdr_t h  = {.comm_id = 7, .tag = 100 + k, .fp = 1000 + k, .nbytes = n};
        xccl_tp_buf_t  b  = {big, XCCL_MEM_HOST, NULL};
        char          *rb = malloc(n + 1);

        /* odd steps receive into a posted buffer, even ones into an unexpected one */
        if (k % 2) {
            F.posted[peer]     = rb;
            F.posted_cap[peer] = n + 1;
        }
        if (rank == 0) {
            fill(big, n, h.fp);
            CHECK(TP->isend(CTX, peer, &h, n ? &b : NULL, &st) == XCCL_OK);
            CHECK(drive(all_done, both, 20000));
        } else {
            CHECK(drive(have_msgs, &want, 20000));
        }
        CHECK(st == XCCL_OK || rank == 1);
        if (F.nmsgs == 1) {
            rmsg_t *m = F.msgs[0];
            CHECK(m->peer == peer && m->done && m->st == XCCL_OK);
            CHECK(m->hdr.comm_id == 7 && m->hdr.tag == 100 + k && m->hdr.fp == 1000 + k);
            CHECK_MSG(m->hdr.nbytes == n, "%" PRIu64 " != %zu", m->hdr.nbytes, n);
            CHECK(n == 0 || m->ptr == (k % 2 ? rb : m->ptr));
            CHECK_MSG(verify(m->ptr, n, 1000 + k), "rank %d size %zu corrupted", rank, n);
            if (rank == 1) { /* echo it */
                st = XCCL_INPROGRESS;
                b.ptr = m->ptr;
                CHECK(TP->isend(CTX, peer, &m->hdr, n ? &b : NULL, &st) == XCCL_OK);
                CHECK(drive(sends_done, &s, 20000));
                CHECK(st == XCCL_OK);
            }
        }
        CHECK_MSG(F.nmsgs == 1, "rank %d step %zu: %zu messages", rank, k, F.nmsgs);
        F.posted[peer] = NULL;
        reset_msgs();
        free(rb);
    }

    /* bad arguments fail at once, without upcalls */
    {
        xccl_msg_hdr_t h = {.nbytes = 8};
        xccl_status_t  st = XCCL_INPROGRESS;
        xccl_tp_buf_t  dev = {big, XCCL_MEM_CUDA, NULL};
        CHECK(TP->isend(CTX, rank, &h, NULL, &st) == XCCL_ERR_INVALID_ARG);
        CHECK(TP->isend(CTX, 5, &h, NULL, &st) == XCCL_ERR_INVALID_ARG);
        CHECK(TP->isend(CTX, peer, &h, NULL, &st) == XCCL_ERR_INVALID_ARG);
        CHECK(TP->isend(CTX, peer, &h, &dev, &st) == XCCL_ERR_NOT_SUPPORTED);
        CHECK(st == XCCL_INPROGRESS);
        CHECK(TP->reachable(CTX, peer) == 1);
    }

    /* wait returns on wake, and when data arrives; neither consumes the event */
    if (rank == 0) {
        pthread_t th;
        int64_t   ms = -1;
        size_t    want = 1;

        drain();
        pthread_create(&th, NULL, waiter, &ms);
        usleep(50000);
        TP->wake(CTX);
        pthread_join(th, NULL);
        CHECK_MSG(ms >= 40 && ms < 2000, "wake took %lld ms", (long long)ms);
        drain();
        atomic_store(&S->flag[FL_WAITING], 1);
        ms = -1;
        waiter(&ms); /* rank 1 sends 100 ms after the flag */
        CHECK_MSG(ms >= 50 && ms < 2000, "wait for data took %lld ms", (long long)ms);
        CHECK(F.nmsgs == 0); /* nothing was consumed yet */
        CHECK(drive(have_msgs, &want, 2000));
        CHECK(F.nmsgs == 1 && F.msgs[0]->hdr.tag == 999);
        atomic_store(&S->flag[FL_DONE], 1);
    } else {
        xccl_msg_hdr_t h  = {.tag = 999, .nbytes = 8};
        xccl_tp_buf_t  b  = {big, XCCL_MEM_HOST, NULL};
        xccl_status_t  st = XCCL_INPROGRESS;
        sends_t        s  = {&st, 1};

        CHECK(wait_flag(&S->flag[FL_WAITING], 1, 5000));
        usleep(100000);
        CHECK(TP->isend(CTX, peer, &h, &b, &st) == XCCL_OK);
        CHECK(drive(sends_done, &s, 2000));
        /* stay until rank 0 has the message: our exit would look like a failure to it */
        CHECK(wait_flag(&S->flag[FL_DONE], 1, 5000));
    }
    CHECK(F.nsend_err == 0 && F.nrecv_err == 0);
    CHECK(F.failed[peer] == 0);
    teardown();
    free(big);
}

/* Many messages posted back to back, before any progress: order and contents survive. */
static void job_order(int rank)
{
    enum { N = 2000 };
    static xccl_status_t st[N];
    size_t               total = 0, off[N + 1];
    char                *buf;
    size_t               want = N;
    sends_t              s    = {st, N};

    setup(rank);
    CHECK(wire(NULL, 5000) == XCCL_OK);
    for (int i = 0; i < N; i++) {
        off[i] = total;
        total += (i % 97 == 0) ? 100000 + (size_t)i : (size_t)(i * 13) % 3001;
    }
    off[N] = total;
    buf    = malloc(total);
    if (rank == 0) {
        for (int i = 0; i < N; i++) {
            xccl_msg_hdr_t h = {.comm_id = 1, .tag = (uint64_t)i, .fp = 77 + (uint64_t)i,
                                .nbytes = off[i + 1] - off[i]};
            xccl_tp_buf_t  b = {buf + off[i], XCCL_MEM_HOST, NULL};
            fill(buf + off[i], h.nbytes, h.fp);
            st[i] = XCCL_INPROGRESS;
            CHECK(TP->isend(CTX, 1, &h, &b, &st[i]) == XCCL_OK);
        }
        CHECK(drive(sends_done, &s, 20000));
        for (int i = 0; i < N; i++) CHECK(st[i] == XCCL_OK);
        CHECK(wait_flag(&S->flag[FL_DONE], 1, 20000));
    } else {
        F.verify_free = 1;
        CHECK(drive(have_msgs, &want, 20000));
        CHECK(F.nmsgs == N);
        for (size_t i = 0; i < F.nmsgs && i < N; i++) {
            rmsg_t *m = F.msgs[i];
            CHECK_MSG(m->hdr.tag == i && m->hdr.nbytes == off[i + 1] - off[i] && m->intact,
                      "message %zu: tag %" PRIu64 " intact %d", i, m->hdr.tag, m->intact);
        }
        atomic_store(&S->flag[FL_DONE], 1);
    }
    teardown();
    free(buf);
}

static void job_both_ways(int rank)
{
    static const size_t sizes[] = {16 * MiB, 100, 16 * MiB - 1, 0};
    uint8_t             use[MAXR] = {0};

    setup(rank);
    use[1 - rank] = 1;
    F.verify_free = 1; /* messages may arrive while wire-up still waits for others */
    CHECK(wire(use, 5000) == XCCL_OK);
    exchange(use, 8, sizes, 4, &S->flag[FL_DONE]);
    CHECK(F.nsend_err == 0 && F.nrecv_err == 0);
    teardown();
}

static void job_all_to_all(int rank)
{
    static const size_t sizes[] = {0, 13, 4096, 100000, MiB + 1, 8};
    uint8_t             use[MAXR] = {0};

    setup(rank);
    for (int p = 0; p < NRANKS; p++) use[p] = p != rank;
    F.verify_free = 1;
    CHECK(wire(use, 5000) == XCCL_OK);
    exchange(use, 30, sizes, 6, &S->flag[FL_DONE]);
    teardown();
}

static void job_ring_use(int rank)
{
    static const size_t sizes[] = {5, 0, 70000};
    uint8_t             use[MAXR] = {0};
    int                 far       = (rank + 2) % NRANKS;
    xccl_msg_hdr_t      h         = {.nbytes = 0};
    xccl_status_t       st        = XCCL_INPROGRESS;

    setup(rank);
    use[(rank + 1) % NRANKS]          = 1;
    use[(rank + NRANKS - 1) % NRANKS] = 1;
    F.verify_free = 1;
    CHECK(wire(use, 5000) == XCCL_OK);
    CHECK(TP->isend(CTX, far, &h, NULL, &st) == XCCL_ERR_INVALID_USAGE);
    CHECK(strstr(xccl_last_error(), "not wired up") != NULL);
    exchange(use, 10, sizes, 3, &S->flag[FL_DONE]);
    teardown();
}

/* The core refuses a message: the transport fails that peer with the core's status. */
static void job_refuse(int rank)
{
    setup(rank);
    CHECK(wire(NULL, 5000) == XCCL_OK);
    if (rank == 0) {
        int peer = 1;
        F.refuse_tag = 0xbad;
        CHECK(drive(have_failed, &peer, 5000));
        CHECK(F.failed_st[1] == XCCL_ERR_MISMATCH);
        CHECK(strstr(F.failed_why[1], "rank 1") != NULL);
        CHECK(F.nmsgs == 1 && F.msgs[0]->done && F.msgs[0]->hdr.tag == 1); /* the one before */
        atomic_store(&S->flag[FL_DONE], 1);
    } else {
        char           b8[8]  = "12345678";
        xccl_tp_buf_t  b      = {b8, XCCL_MEM_HOST, NULL};
        xccl_msg_hdr_t h1     = {.tag = 1, .nbytes = 8};
        xccl_msg_hdr_t h2     = {.tag = 0xbad, .nbytes = 8};
        xccl_status_t  st[2]  = {XCCL_INPROGRESS, XCCL_INPROGRESS};
        sends_t        s      = {st, 2};
        CHECK(TP->isend(CTX, 0, &h1, &b, &st[0]) == XCCL_OK);
        CHECK(TP->isend(CTX, 0, &h2, &b, &st[1]) == XCCL_OK);
        CHECK(drive(sends_done, &s, 5000));
        CHECK(wait_flag(&S->flag[FL_DONE], 1, 5000));
    }
    teardown();
}

/* The core holds a large message back (see defer_check). */
static void job_defer(int rank)
{
    setup(rank);
    CHECK(wire(NULL, 5000) == XCCL_OK);
    defer_check(rank, &S->flag[FL_DONE]);
    teardown();
}

/* The core drops payloads (see drop_check): read through the staging buffer. */
static void job_drop(int rank)
{
    setup(rank);
    CHECK(wire(NULL, 5000) == XCCL_OK);
    drop_check(rank, &S->flag[FL_DONE]);
    teardown();
}

/* Rank 1 dies in the middle of two large transfers (one each way); ranks 0 and 2 go on. */
static void job_peer_exit(int rank)
{
    size_t        n   = 256 * MiB;
    char         *buf = malloc(n); /* never written: its pages stay the shared zero page */
    xccl_tp_buf_t b   = {buf, XCCL_MEM_HOST, NULL};

    setup(rank);
    CHECK(wire(NULL, 5000) == XCCL_OK);
    if (rank == 1) {
        xccl_msg_hdr_t h  = {.tag = 5, .nbytes = n};
        xccl_status_t  st = XCCL_INPROGRESS;
        int64_t        t0 = xccl_now_ms();

        CHECK(TP->isend(CTX, 0, &h, &b, &st) == XCCL_OK);
        /* until rank 0's big message has started to arrive, then a little more */
        while (find_msg(0, 6) == NULL && xccl_now_ms() - t0 < 5000) {
            int nev;
            TP->progress(CTX, &nev);
        }
        t0 = xccl_now_ms();
        while (xccl_now_ms() - t0 < 3) {
            int nev;
            TP->progress(CTX, &nev);
        }
        CHECK(st == XCCL_INPROGRESS && find_msg(0, 6) && !find_msg(0, 6)->done);
        atomic_fetch_add(&S->checks, ctest_checks);
        atomic_fetch_add(&S->failures, ctest_failures);
        fflush(stderr);
        _exit(ctest_failures != 0 ? 1 : 0); /* no finalize: like a crash */
    }
    if (rank == 0) {
        xccl_msg_hdr_t h    = {.tag = 6, .nbytes = n};
        xccl_status_t  st   = XCCL_INPROGRESS;
        int            peer = 1;
        int64_t        t0   = xccl_now_ms();
        rmsg_t        *m;

        CHECK(TP->isend(CTX, 1, &h, &b, &st) == XCCL_OK);
        CHECK(drive(have_failed, &peer, 5000));
        CHECK_MSG(xccl_now_ms() - t0 < 3000, "failure noticed after %lld ms",
                  (long long)(xccl_now_ms() - t0));
        CHECK(F.failed_st[1] == XCCL_ERR_REMOTE);
        CHECK_MSG(strstr(F.failed_why[1], "rank 1") != NULL, "%s", F.failed_why[1]);
        CHECK(st == XCCL_ERR_REMOTE);
        /* rank 1's message had started and can never finish */
        m = find_msg(1, 5);
        CHECK(m != NULL && m->done && m->st == XCCL_ERR_REMOTE);
        st = XCCL_INPROGRESS;
        CHECK(TP->isend(CTX, 1, &h, &b, &st) == XCCL_ERR_REMOTE);
        CHECK(strstr(xccl_last_error(), "rank 1") != NULL);
        CHECK(st == XCCL_INPROGRESS);
    }
    /* ranks 0 and 2 carry on */
    {
        int            peer = 2 - rank;
        char           data[100];
        xccl_tp_buf_t  sb   = {data, XCCL_MEM_HOST, NULL};
        xccl_msg_hdr_t h    = {.tag = 42, .fp = 4242, .nbytes = sizeof(data)};
        xccl_status_t  st   = XCCL_INPROGRESS;
        sends_t        s    = {&st, 1};
        want_msg_t     w    = {peer, 42};
        int            dead = 1;

        fill(data, sizeof(data), 4242);
        CHECK(TP->isend(CTX, peer, &h, &sb, &st) == XCCL_OK);
        CHECK(drive(sends_done, &s, 5000) && st == XCCL_OK);
        CHECK(drive(have_msg, &w, 5000));
        CHECK(find_msg(peer, 42) && verify(find_msg(peer, 42)->ptr, sizeof(data), 4242));
        CHECK(drive(have_failed, &dead, 5000)); /* rank 2 sees rank 1 go too */
        CHECK(F.failed[peer] == 0);
        atomic_fetch_add(&S->flag[FL_DONE], 1);
        CHECK(wait_flag(&S->flag[FL_DONE], 2, 5000));
    }
    teardown();
    free(buf);
}

/* ---- rogue peers ---- */

static int rogue_connect(void)
{
    xccl_sockaddr_t a;
    const uint8_t  *blob = S->blob[0];
    int             fd   = -1;

    /* decode rank 0's blob from the documented layout */
    memset(&a, 0, sizeof(a));
    CHECK(memcmp(blob, "XTCA", 4) == 0 && S->blen[0] == 28);
    if (blob[4] == 4) {
        struct sockaddr_in *s4 = (struct sockaddr_in *)&a.ss;
        s4->sin_family         = AF_INET;
        memcpy(&s4->sin_port, blob + 6, 2);
        memcpy(&s4->sin_addr, blob + 12, 4);
        a.len = sizeof(*s4);
    } else {
        struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&a.ss;
        s6->sin6_family         = AF_INET6;
        memcpy(&s6->sin6_port, blob + 6, 2);
        memcpy(&s6->sin6_addr, blob + 12, 16);
        a.len = sizeof(*s6);
    }
    CHECK(xccl_sock_connect(&a, xccl_now_ms() + 2000, &fd) == XCCL_OK);
    return fd;
}

static tcp_hello_t rogue_hello(uint64_t job, int src, int dst, uint32_t flags)
{
    tcp_hello_t h;

    memset(&h, 0, sizeof(h));
    memcpy(h.magic, TCP_MAGIC, 4);
    h.version  = TCP_PROTO_VERSION;
    h.endian   = TCP_ENDIAN_MARK;
    h.job_id   = job;
    h.src_rank = src;
    h.dst_rank = dst;
    h.flags    = flags;
    return h;
}

/* 1 if the other side closes the connection within 2 s (after any bytes it sends). */
static int closed_by_peer(int fd)
{
    char    tmp[256];
    int64_t end = xccl_now_ms() + 2000;

    while (xccl_now_ms() < end) {
        ssize_t r = recv(fd, tmp, sizeof(tmp), MSG_DONTWAIT);
        if (r == 0 || (r < 0 && errno == ECONNRESET)) return 1;
        if (r < 0 && errno != EAGAIN) return 0;
        usleep(1000);
    }
    return 0;
}

/* Sends a hello, expects a refusal ack with `status`, then EOF. */
static void rogue_refused(tcp_hello_t h, unsigned status)
{
    int       fd = rogue_connect();
    tcp_ack_t a;

    CHECK(xccl_sock_send_all(fd, &h, sizeof(h), xccl_now_ms() + 2000) == XCCL_OK);
    CHECK(xccl_sock_recv_all(fd, &a, sizeof(a), xccl_now_ms() + 2000) == XCCL_OK);
    CHECK(memcmp(a.magic, TCP_MAGIC, 4) == 0);
    CHECK_MSG(a.status == status, "status %u, expected %u", a.status, status);
    CHECK(closed_by_peer(fd));
    close(fd);
}

static void rogue(void)
{
    const char *junk = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    char        ctxs[64];
    int         silent, partial, fd;
    tcp_hello_t h;
    tcp_ack_t   a;

    CHECK(wait_flag(&S->ready[0], 1, 5000));
    /* garbage: closed as soon as the magic is wrong */
    fd = rogue_connect();
    CHECK(xccl_sock_send_all(fd, junk, strlen(junk), xccl_now_ms() + 1000) == XCCL_OK);
    CHECK(closed_by_peer(fd));
    close(fd);
    /* silent, and half a hello: both stay pending, harmlessly */
    silent  = rogue_connect();
    partial = rogue_connect();
    h       = rogue_hello(JOB_ID, 1, 0, TCP_HELLO_AUTH);
    CHECK(xccl_sock_send_all(partial, &h, 10, xccl_now_ms() + 1000) == XCCL_OK);
    /* well-formed hellos that must be refused */
    rogue_refused(rogue_hello(JOB_ID + 1, 1, 0, TCP_HELLO_AUTH), TCP_ACK_JOB);
    rogue_refused(rogue_hello(JOB_ID, 7, 0, TCP_HELLO_AUTH), TCP_ACK_RANK);
    rogue_refused(rogue_hello(JOB_ID, 1, 1, TCP_HELLO_AUTH), TCP_ACK_RANK);
    rogue_refused(rogue_hello(JOB_ID, 0, 0, TCP_HELLO_AUTH), TCP_ACK_UNEXPECTED);
    rogue_refused(rogue_hello(JOB_ID, 1, 0, 0), TCP_ACK_AUTH_MODE);
    h         = rogue_hello(JOB_ID, 1, 0, TCP_HELLO_AUTH);
    h.version = TCP_PROTO_VERSION + 1;
    rogue_refused(h, TCP_ACK_VERSION);
    /* right job, claims rank 1, wrong key: the proof fails and rank 1 stays expected */
    fd = rogue_connect();
    h  = rogue_hello(JOB_ID, 1, 0, TCP_HELLO_AUTH);
    CHECK(xccl_sock_send_all(fd, &h, sizeof(h), xccl_now_ms() + 1000) == XCCL_OK);
    CHECK(xccl_sock_recv_all(fd, &a, sizeof(a), xccl_now_ms() + 1000) == XCCL_OK);
    CHECK(a.status == TCP_ACK_OK && a.rank == 0 && a.job_id == JOB_ID);
    snprintf(ctxs, sizeof(ctxs), "xccl-tcp/%016" PRIx64, (uint64_t)JOB_ID);
    CHECK(xccl_auth_handshake(fd, "not the key", 11, 0, ctxs, xccl_now_ms() + 2000) ==
          XCCL_ERR_AUTH);
    CHECK(closed_by_peer(fd));
    close(fd);
    atomic_store(&S->flag[FL_ROGUE_DONE], 1);

    /* after wire-up: accepted and closed, the pending ones were dropped */
    CHECK(wait_flag(&S->flag[FL_WIRED], 1, 10000));
    CHECK(closed_by_peer(silent));
    CHECK(closed_by_peer(partial));
    close(silent);
    close(partial);
    fd = rogue_connect();
    CHECK(xccl_sock_send_all(fd, junk, strlen(junk), xccl_now_ms() + 1000) == XCCL_OK);
    CHECK(closed_by_peer(fd));
    close(fd);
    atomic_store(&S->flag[FL_ROGUE2_DONE], 1);
}

static void job_rogue(int rank)
{
    if (rank == 2) {
        rogue();
        return;
    }
    setup(rank);
    if (rank == 1) CHECK(wait_flag(&S->flag[FL_ROGUE_DONE], 1, 10000));
    CHECK(wire(NULL, 8000) == XCCL_OK);
    if (rank == 0) atomic_store(&S->flag[FL_WIRED], 1);
    /* messages flow while the rogue knocks again */
    for (int round = 0; round < 2; round++) {
        char           data[3000];
        xccl_tp_buf_t  b    = {data, XCCL_MEM_HOST, NULL};
        xccl_msg_hdr_t h    = {.tag = (uint64_t)round, .fp = 50 + (uint64_t)(rank * 10 + round),
                               .nbytes = sizeof(data)};
        xccl_status_t  st   = XCCL_INPROGRESS;
        sends_t        s    = {&st, 1};
        size_t         want = (size_t)round + 1;
        void          *both[2] = {&s, &want};

        fill(data, sizeof(data), h.fp);
        CHECK(TP->isend(CTX, 1 - rank, &h, &b, &st) == XCCL_OK);
        CHECK(drive(all_done, both, 5000));
        CHECK(st == XCCL_OK);
        CHECK(F.nmsgs == want &&
              verify(F.msgs[round]->ptr, sizeof(data), 50 + (uint64_t)((1 - rank) * 10 + round)));
        if (round == 0 && rank == 0) {
            /* rank 0 keeps progressing (accepting and closing) until the rogue is done */
            while (!atomic_load(&S->flag[FL_ROGUE2_DONE])) {
                int nev;
                TP->progress(CTX, &nev);
                TP->wait(CTX, 5);
            }
        }
        if (round == 0 && rank == 1) CHECK(wait_flag(&S->flag[FL_ROGUE2_DONE], 1, 10000));
    }
    CHECK(F.failed[1 - rank] == 0);
    atomic_fetch_add(&S->flag[FL_DONE], 1);
    while (atomic_load(&S->flag[FL_DONE]) < 2) {
        int nev;
        TP->progress(CTX, &nev);
        usleep(500);
    }
    teardown();
}

/* Rank 1 publishes an address and leaves: ranks 0 and 2 time out naming it. */
static void job_missing(int rank)
{
    int64_t       t0;
    xccl_status_t st;

    setup(rank);
    if (rank == 1) {
        teardown();
        return;
    }
    t0 = xccl_now_ms();
    st = wire(NULL, 600);
    CHECK(st == XCCL_ERR_TIMEOUT);
    CHECK_MSG(xccl_now_ms() - t0 >= 550 && xccl_now_ms() - t0 < 3000, "%lld ms",
              (long long)(xccl_now_ms() - t0));
    CHECK_MSG(strstr(xccl_last_error(), "rank 1 (") != NULL, "%s", xccl_last_error());
    CHECK_MSG(strstr(xccl_last_error(), rank == 0 ? "rank 2 (" : "rank 0 (") == NULL, "%s",
              xccl_last_error());
    teardown();
}

static void job_big(int rank)
{
    size_t         n = ((size_t)2 << 30) + 4097;
    char          *p = malloc(n);
    xccl_msg_hdr_t h = {.tag = 1, .fp = 31337, .nbytes = n};
    xccl_tp_buf_t  b = {p, XCCL_MEM_HOST, NULL};
    xccl_status_t  st = XCCL_INPROGRESS;
    sends_t        s  = {&st, 1};
    size_t         want = 1;

    setup(rank);
    CHECK(p != NULL);
    CHECK(wire(NULL, 5000) == XCCL_OK);
    if (rank == 0) {
        fill(p, n, h.fp);
        CHECK(TP->isend(CTX, 1, &h, &b, &st) == XCCL_OK);
        CHECK(drive(sends_done, &s, 120000));
        CHECK(st == XCCL_OK);
        CHECK(wait_flag(&S->flag[FL_DONE], 1, 120000));
    } else {
        F.posted[0]     = p;
        F.posted_cap[0] = n;
        CHECK(drive(have_msgs, &want, 120000));
        CHECK(F.nmsgs == 1 && F.msgs[0]->hdr.nbytes == n && F.msgs[0]->ptr == p);
        CHECK(verify(p, n, h.fp));
        atomic_store(&S->flag[FL_DONE], 1);
    }
    teardown();
    free(p);
}

/* Like drive, but spins (progress + sched_yield) for 50 us before each sleep, as the core
 * does (XCCL_SPIN_US), so the timings are the transport's and not the sleep's. */
static int drive_spin(int (*cond)(void *), void *arg, int64_t timeout_ms)
{
    int64_t end = xccl_now_ms() + timeout_ms;
    int64_t spin_end = (int64_t)xccl_now_ns() + 50000;

    while (!cond(arg)) {
        int nev = 0;
        if (xccl_now_ms() > end) return 0;
        if (TP->progress(CTX, &nev) != XCCL_OK) return 0;
        if (nev > 0) continue;
        if ((int64_t)xccl_now_ns() < spin_end) sched_yield();
        else TP->wait(CTX, 2);
    }
    return 1;
}

/* Forgets the delivered messages; one of the next round may be arriving already. */
static void reset_done_msgs(void)
{
    size_t i, kept = 0;

    for (i = 0; i < F.nmsgs; i++) {
        if (F.msgs[i]->done) {
            if (F.msgs[i]->owned) free(F.msgs[i]->ptr);
            free(F.msgs[i]);
        } else {
            F.msgs[kept++] = F.msgs[i];
        }
    }
    F.nmsgs = kept;
}

static int perf_expect; /* receives this rank has been sent since the job started */

static int perf_done(void *arg)
{
    return sends_done(arg) && F.nrecv_ok >= perf_expect;
}

/* One ping-pong round (rank 0 sends first) of n bytes, or one exchange of n bytes each way in
 * messages of `chunk` bytes; receives land in F.recv_base. A round may end with messages of
 * the peer's next round already in, so receives are counted since the job started. */
static void perf_round(int rank, char *src, size_t n, size_t chunk, int pingpong)
{
    size_t         nmsg = chunk == 0 || n == 0 ? 1 : (n + chunk - 1) / chunk;
    xccl_status_t *st   = malloc(nmsg * sizeof(*st));
    sends_t        s    = {st, 0};

    for (int turn = 0; turn < (pingpong ? 2 : 1); turn++) {
        int sender = !pingpong || turn == rank;
        if (sender) {
            for (size_t i = 0; i < nmsg; i++) {
                size_t         off = i * chunk;
                size_t         len = nmsg == 1 ? n : n - off < chunk ? n - off : chunk;
                xccl_msg_hdr_t h   = {.comm_id = 9, .tag = i, .fp = off, .nbytes = len};
                xccl_tp_buf_t  b   = {src + off, XCCL_MEM_HOST, NULL};
                st[i]              = XCCL_INPROGRESS;
                CHECK(TP->isend(CTX, 1 - rank, &h, &b, &st[i]) == XCCL_OK);
            }
            s.n = nmsg;
        } else {
            s.n = 0;
        }
        if (!pingpong || !sender) perf_expect += (int)nmsg;
        CHECK(drive_spin(perf_done, &s, 20000));
        CHECK(F.nsend_err == 0 && F.nrecv_err == 0);
        reset_done_msgs();
    }
    free(st);
}

static void job_perf(int rank)
{
    static const size_t sizes[] = {8, 4096, 65536, MiB, 16 * MiB, 64 * MiB};
    char               *src = malloc(64 * MiB), *dst = malloc(64 * MiB);

    memset(src, rank + 1, 64 * MiB);
    memset(dst, 0, 64 * MiB); /* faulted in: the timings are the transport's */
    setup(rank);
    F.recv_base = dst;
    perf_expect = 0;
    CHECK(wire(NULL, 5000) == XCCL_OK);
    for (int k = 0; k < (int)(sizeof(sizes) / sizeof(sizes[0])); k++) {
        size_t  n     = sizes[k];
        int     iters = n <= 65536 ? 2000 : n <= MiB ? 200 : 10;
        int64_t t0;
        double  us;

        for (int i = 0; i < iters / 10 + 1; i++) perf_round(rank, src, n, 0, 1);
        t0 = (int64_t)xccl_now_ns();
        for (int i = 0; i < iters; i++) perf_round(rank, src, n, 0, 1);
        us = (double)((int64_t)xccl_now_ns() - t0) / 1e3 / iters / 2;
        if (rank == 0)
            fprintf(stderr, "  perf pingpong %9zu B  %10.2f us  %6.3f GB/s\n", n, us,
                    (double)n / us / 1e3);
    }
    {
        size_t  n = 64 * MiB;
        int64_t t0;
        double  us;

        perf_round(rank, src, n, 512 * 1024, 0);
        t0 = (int64_t)xccl_now_ns();
        for (int i = 0; i < 10; i++) perf_round(rank, src, n, 512 * 1024, 0);
        us = (double)((int64_t)xccl_now_ns() - t0) / 1e3 / 10;
        if (rank == 0)
            fprintf(stderr, "  perf exchange %9zu B  %10.2f us  %6.3f GB/s each way\n", n, us,
                    (double)n / us / 1e3);
    }
    /* leave together: an early exit would look like a failure to the peer */
    atomic_fetch_add(&S->flag[FL_DONE], 1);
    CHECK(wait_flag(&S->flag[FL_DONE], 2, 20000));
    F.recv_base = NULL;
    teardown();
    free(src);
    free(dst);
}

int main(void)
{
    S = mmap(NULL, sizeof(*S), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(S != MAP_FAILED);
    /* loopback keeps the test independent of the machine's network */
    setenv("XCCL_SOCKET_IFNAME", "lo", 1);

    run_job("basic", 2, 2, NULL, job_basic, 60);
    run_job("order", 2, 2, NULL, job_order, 60);
    run_job("both_ways", 2, 2, NULL, job_both_ways, 60);
    run_job("all_to_all", 4, 4, NULL, job_all_to_all, 60);
    run_job("ring_use", 4, 4, NULL, job_ring_use, 60);
    run_job("refuse", 2, 2, NULL, job_refuse, 30);
    run_job("defer", 2, 2, NULL, job_defer, 30);
    run_job("drop", 2, 2, NULL, job_drop, 30);
    run_job("peer_exit", 3, 3, NULL, job_peer_exit, 30);
    run_job("rogue", 3, 2, "s3cret key", job_rogue, 30);
    run_job("missing", 3, 3, NULL, job_missing, 30);
    if (xccl_env_int("XCCL_TEST_BIG", 0) == 1) run_job("big", 2, 2, NULL, job_big, 300);
    if (xccl_env_int("XCCL_TEST_PERF", 0) == 1) run_job("perf", 2, 2, NULL, job_perf, 300);
    CTEST_MAIN_END("test_tcp");
}
