/* SPDX-License-Identifier: Apache-2.0
 *
 * test_shm.c - the shared-memory transport driven by a tiny fake core, in forked processes.
 * Each job forks its ranks; they meet through a shared anonymous mapping (address blobs and
 * flags). Payloads are checked against a generator seeded per message, independent of the
 * transport. Jobs marked "x2" run with cross-memory attach (CMA) and again with
 * XCCL_SHM_CMA=0 (everything through the rings). After every job /dev/shm must hold no
 * segment of it.
 *
 *   job              ranks  checks
 *   reach            1      reachable() follows host id and IPC namespace; no local peer:
 *                           init says NOT_SUPPORTED; the name exists until finalize
 *   basic     x2     2      ping-pong 0 B .. 64 MiB (posted and unexpected buffers), header
 *                           fields, bad isend arguments, wait/wake, wait returns when data
 *                           arrives, the segment name is gone once wire-up returns
 *   path      x2     2      which path carried a 256 KiB message (CMA reads the sender's
 *                           buffer late, the ring copies it at isend)
 *   order     x2     2      2000 messages of mixed sizes posted back to back arrive in order
 *   wrap             2      the same through 64 KiB rings (wrap-around, pieces)
 *   both_ways x2     2      4 x 16 MiB each way at once (no deadlock), small ones between
 *   all_to_all x2    4      every pair, mixed sizes incl. 0 (4 ranks on 2 cores)
 *   sleepy    x2     2      ping-pong with long sleeps in wait: no wake-up is ever lost
 *   ring_use         4      only neighbours wired; isend elsewhere is refused
 *   refuse           2      recv_match refusing a message fails that peer with its status;
 *                           the sender learns it was dropped
 *   close_peer x2    2      close_peer fails the pending send and receive, then peer_failed;
 *                           the peer's failure carries close_peer's reason
 *   finalize         2      messages sent before a peer finalized are delivered, then the peer
 *                           is reported
 *   kill      x2     3      rank 1 is SIGKILLed mid-transfer: reported within 1 s, its
 *                           transfers fail, ranks 0 and 2 carry on
 *   missing          3      rank 1 never wires up: ranks 0 and 2 time out naming rank 1
 *   early_death      3      rank 1 is SIGKILLed before wire-up: ranks 0 and 2 fail fast naming
 *                           it and unlink the segment name it left behind
 *   kill_lock        3      the kill job with peers watched through their segment locks (the
 *                           way peers in another pid namespace are watched)
 *   big (XCCL_TEST_BIG=1) x2 2  one message of 2 GiB + 4097 bytes
 *
 * XCCL_TEST_JOB=<name> runs only the jobs of that name.
 */
#include <dirent.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../../backends/shm/shm_layout.h"
#include "core/check.h"
#include "ctest.h"
#include "xccl/xccl_transport.h"

extern const xccl_transport_ops_t xccl_transport_shm;
static const xccl_transport_ops_t *const TP = &xccl_transport_shm;

#define MAXR     8
#define JOB_BASE 0x5a1d0000beef0000ull
#define MiB      ((size_t)1 << 20)

#include "tp_harness.h"

/* ---------------------------------------------------------------------------------------------
 * Shared state between the processes of a job
 * ------------------------------------------------------------------------------------------- */

enum { FL_WAITING, FL_DONE, FL_GO, FL_FINALIZED, FL_STEP, FL_SENT, FL_COUNT };

typedef struct shared {
    atomic_int     ready[MAXR];
    uint8_t        blob[MAXR][XCCL_TP_ADDR_MAX];
    size_t         blen[MAXR];
    atomic_int     flag[FL_COUNT];
    atomic_llong   kill_ms;          /* when the victim of the kill job killed itself */
    atomic_int     checks, failures; /* the children's ctest counters, summed */
} shared_t;

static shared_t *S;
static uint64_t  JOB_ID; /* of the running job: segment names contain it */
static int       CMA;    /* XCCL_SHM_CMA of the running job */


/* Segments of the running job still named in /dev/shm. */
static int leftovers(void)
{
    char           prefix[64];
    DIR           *d = opendir("/dev/shm");
    struct dirent *e;
    int            n = 0;

    snprintf(prefix, sizeof(prefix), SHM_NAME_PREFIX "%016" PRIx64 "-", JOB_ID);
    if (d == NULL) return 0;
    while ((e = readdir(d)) != NULL) n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    closedir(d);
    return n;
}

/* ---------------------------------------------------------------------------------------------
 * Job harness
 * ------------------------------------------------------------------------------------------- */


static void infos_same_host(xccl_peer_info_t *infos, int n)
{
    memset(infos, 0, (size_t)n * sizeof(*infos));
    for (int r = 0; r < n; r++) {
        infos[r].host_id  = 0x1234;
        infos[r].ipc_ns   = 0x77;
        infos[r].pid      = -1; /* the transport must not need it */
        infos[r].cuda_dev = -1;
    }
}

/* Init, publish the address, wait for everyone's. */
static void setup(int rank)
{
    xccl_tp_init_params_t p;
    xccl_peer_info_t      infos[MAXR];

    memset(&F, 0, sizeof(F));
    infos_same_host(infos, NRANKS);
    F.rank = rank;
    F.size = NRANKS;
    memset(&p, 0, sizeof(p));
    p.rank   = rank;
    p.size   = NRANKS;
    p.job_id = JOB_ID;
    p.peers  = infos; /* only read during init */
    p.up     = &UP;
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

/* Forks nprocs processes running body(rank); a hang is a failure (killed after timeout_s).
 * `victim` (or -1) is the rank expected to die of SIGKILL. */
static void run_job(const char *name, int nranks, int cma, void (*body)(int rank), int timeout_s,
                    int victim)
{
    static int  jobs;
    const char *only = getenv("XCCL_TEST_JOB");
    pid_t       pids[MAXR];
    int        left = nranks;
    int64_t    end  = xccl_now_ms() + (int64_t)timeout_s * 1000;
    int64_t    t0   = xccl_now_ms();

    if (only != NULL && *only != '\0' && strcmp(only, name) != 0) return;
    memset(S, 0, sizeof(*S));
    NRANKS = nranks;
    JOB_ID = JOB_BASE + (uint64_t)(++jobs) + ((uint64_t)getpid() << 16);
    CMA    = cma;
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < nranks; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            ctest_failures = ctest_checks = 0;
            setenv("XCCL_SHM_CMA", cma ? "1" : "0", 1);
            setenv("XCCL_SHM_CMA_MIN", "65536", 1); /* not the default's none or ring size */
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
            for (int r = 0; r < nranks; r++) {
                if (pids[r] != pid) continue;
                if (r == victim)
                    CHECK_MSG(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
                              "job %s: rank %d ended with status 0x%x, not SIGKILL", name, r,
                              status);
                else
                    CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                              "job %s (cma %d): rank %d ended with status 0x%x", name, cma, r,
                              status);
                pids[r] = -1;
            }
            left--;
            continue;
        }
        if (xccl_now_ms() > end) {
            for (int r = 0; r < nranks; r++)
                if (pids[r] > 0) {
                    CHECK_MSG(0, "job %s (cma %d): rank %d hung; killed", name, cma, r);
                    kill(pids[r], SIGKILL);
                    waitpid(pids[r], &status, 0);
                    left--;
                }
            break;
        }
        usleep(1000);
    }
    ctest_checks += atomic_load(&S->checks);
    ctest_failures += atomic_load(&S->failures);
    CHECK_MSG(leftovers() == 0, "job %s (cma %d) left segments in /dev/shm", name, cma);
    fprintf(stderr, "  job %-10s cma %d %5lld ms\n", name, cma, (long long)(xccl_now_ms() - t0));
}

/* ---------------------------------------------------------------------------------------------
 * Jobs
 * ------------------------------------------------------------------------------------------- */

/* reachable() and init without local peers, in this process. */
static void job_reach(void)
{
    xccl_peer_info_t      infos[3];
    xccl_tp_init_params_t p;
    xccl_tp_ctx_t        *ctx = NULL;
    uint8_t               blob[XCCL_TP_ADDR_MAX];
    size_t                len = 0;

    JOB_ID = JOB_BASE + 0xfff;
    infos_same_host(infos, 3);
    infos[2].host_id = 0x9999; /* another host */
    memset(&p, 0, sizeof(p));
    p.rank   = 0;
    p.size   = 3;
    p.job_id = JOB_ID;
    p.peers  = infos;
    p.up     = &UP;
    CHECK(TP->init(&p, &ctx) == XCCL_OK);
    if (ctx == NULL) return;
    CHECK(TP->reachable(ctx, 1) == 1);
    CHECK(TP->reachable(ctx, 2) == 0);
    CHECK(TP->reachable(ctx, 0) == 0);
    CHECK(TP->get_addr(ctx, blob, &len) == XCCL_OK && len == SHM_ADDR_LEN);
    CHECK(memcmp(blob, SHM_ADDR_MAGIC, 4) == 0);
    CHECK(leftovers() == 1); /* until wire-up or finalize */
    TP->finalize(ctx);
    CHECK(leftovers() == 0);

    infos[1].ipc_ns = 0x78; /* same host, another IPC namespace: nobody to reach */
    ctx             = NULL;
    CHECK(TP->init(&p, &ctx) == XCCL_ERR_NOT_SUPPORTED && ctx == NULL);
    p.size = 1;
    CHECK(TP->init(&p, &ctx) == XCCL_ERR_NOT_SUPPORTED && ctx == NULL);
    CHECK(leftovers() == 0);
}

/* What a waiter waits for: `wait` may return early (the transport cannot always tell a stray
 * bell from news), so waiters call it until the event they expect has happened. */
static atomic_int *WAIT_FOR;

static void *waiter(void *arg)
{
    int64_t *ms = arg;
    int64_t  t0 = xccl_now_ms();

    do TP->wait(CTX, 5000);
    while (WAIT_FOR != NULL && !atomic_load(WAIT_FOR) && xccl_now_ms() - t0 < 10000);
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
    static const size_t sizes[] = {0,         1,          7,        24,      25,
                                   63,        64,         65,       4096,    65535,
                                   65536,     65537,      MiB,      MiB + 3, 3 * MiB + 5,
                                   64 * MiB};
    const size_t        nsizes  = sizeof(sizes) / sizeof(sizes[0]);
    int                 peer    = 1 - rank;
    char               *big     = malloc(64 * MiB);

    setup(rank);
    CHECK(leftovers() >= 1);
    CHECK(wire(NULL, 5000) == XCCL_OK);
    CHECK(TP->reachable(CTX, peer) == 1);
    /* both ranks are wired: both names are gone */
    atomic_fetch_add(&S->flag[FL_GO], 1);
    CHECK(wait_flag(&S->flag[FL_GO], 2, 5000));
    CHECK_MSG(leftovers() == 0, "rank %d: segments still named after wire-up", rank);
    for (size_t k = 0; k < nsizes; k++) {
        size_t         n       = sizes[k];
        xccl_status_t  st      = XCCL_INPROGRESS;
        sends_t        s       = {&st, 1};
        size_t         want    = 1;
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
            /* rank 1 is done with the previous step (with CMA our send of it completed when
             * rank 1 had pulled the data, before rank 1 saw its own echo complete) */
            CHECK(wait_flag(&S->flag[FL_STEP], (int)k, 20000));
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
                st    = XCCL_INPROGRESS;
                b.ptr = m->ptr;
                CHECK(TP->isend(CTX, peer, &m->hdr, n ? &b : NULL, &st) == XCCL_OK);
                CHECK(drive(sends_done, &s, 20000));
                CHECK(st == XCCL_OK);
            }
        }
        CHECK_MSG(F.nmsgs == 1, "rank %d step %zu: %zu messages", rank, k, F.nmsgs);
        if (rank == 1) atomic_store(&S->flag[FL_STEP], (int)k + 1);
        F.posted[peer] = NULL;
        reset_msgs();
        free(rb);
    }

    /* bad arguments fail at once, without upcalls */
    {
        xccl_msg_hdr_t h   = {.nbytes = 8};
        xccl_status_t  st  = XCCL_INPROGRESS;
        xccl_tp_buf_t  dev = {big, XCCL_MEM_CUDA, NULL};
        CHECK(TP->isend(CTX, rank, &h, NULL, &st) == XCCL_ERR_INVALID_ARG);
        CHECK(TP->isend(CTX, 5, &h, NULL, &st) == XCCL_ERR_INVALID_ARG);
        CHECK(TP->isend(CTX, -1, &h, NULL, &st) == XCCL_ERR_INVALID_ARG);
        CHECK(TP->isend(CTX, peer, &h, NULL, &st) == XCCL_ERR_INVALID_ARG);
        CHECK(TP->isend(CTX, peer, &h, &dev, &st) == XCCL_ERR_NOT_SUPPORTED);
        CHECK(st == XCCL_INPROGRESS);
    }

    /* wait returns on wake, and when data arrives; neither consumes the event */
    if (rank == 0) {
        pthread_t th;
        int64_t   ms   = -1;
        size_t    want = 1;

        atomic_int woke = 0;

        drain();
        WAIT_FOR = &woke;
        pthread_create(&th, NULL, waiter, &ms);
        usleep(50000);
        atomic_store(&woke, 1);
        TP->wake(CTX);
        pthread_join(th, NULL);
        CHECK_MSG(ms >= 40 && ms < 2000, "wake took %lld ms", (long long)ms);
        drain();
        atomic_store(&S->flag[FL_WAITING], 1);
        ms       = -1;
        WAIT_FOR = &S->flag[FL_SENT];
        waiter(&ms); /* rank 1 sends 100 ms after the flag */
        CHECK_MSG(ms >= 50 && ms < 2000, "wait for data took %lld ms", (long long)ms);
        CHECK(F.nmsgs == 0); /* nothing was consumed yet */
        CHECK(drive(have_msgs, &want, 2000));
        CHECK(F.nmsgs == 1 && F.msgs[0]->hdr.tag == 999);
        /* a wake before anyone waits is not lost: the next wait returns at once */
        drain();
        TP->wake(CTX);
        ms       = -1;
        WAIT_FOR = NULL;
        waiter(&ms);
        CHECK_MSG(ms < 100, "wait after wake took %lld ms", (long long)ms);
        atomic_store(&S->flag[FL_DONE], 1);
    } else {
        xccl_msg_hdr_t h  = {.tag = 999, .nbytes = 8};
        xccl_tp_buf_t  b  = {big, XCCL_MEM_HOST, NULL};
        xccl_status_t  st = XCCL_INPROGRESS;
        sends_t        s  = {&st, 1};

        CHECK(wait_flag(&S->flag[FL_WAITING], 1, 5000));
        usleep(100000);
        CHECK(TP->isend(CTX, peer, &h, &b, &st) == XCCL_OK);
        atomic_store(&S->flag[FL_SENT], 1);
        CHECK(drive(sends_done, &s, 2000));
        /* stay until rank 0 has the message: our exit would look like a failure to it */
        CHECK(wait_flag(&S->flag[FL_DONE], 1, 5000));
    }
    CHECK(F.nsend_err == 0 && F.nrecv_err == 0);
    CHECK(F.failed[peer] == 0);
    teardown();
    free(big);
}

/* A 256 KiB message whose buffer the sender (against the rules) rewrites right after isend:
 * with CMA the receiver pulls the new bytes, through the ring it got the old ones. */
static void job_path(int rank)
{
    size_t         n   = 256 << 10;
    char          *buf = malloc(n);
    xccl_msg_hdr_t h   = {.tag = 1, .fp = 11, .nbytes = n};
    xccl_tp_buf_t  b   = {buf, XCCL_MEM_HOST, NULL};
    xccl_status_t  st  = XCCL_INPROGRESS;
    sends_t        s   = {&st, 1};
    size_t         want = 1;

    setup(rank);
    CHECK(wire(NULL, 5000) == XCCL_OK);
    if (rank == 0) {
        fill(buf, n, 11);
        CHECK(TP->isend(CTX, 1, &h, &b, &st) == XCCL_OK);
        fill(buf, n, 22);
        atomic_store(&S->flag[FL_GO], 1);
        CHECK(drive(sends_done, &s, 5000) && st == XCCL_OK);
        CHECK(wait_flag(&S->flag[FL_DONE], 1, 5000));
    } else {
        CHECK(wait_flag(&S->flag[FL_GO], 1, 5000));
        CHECK(drive(have_msgs, &want, 5000));
        CHECK(F.nmsgs == 1 && F.msgs[0]->st == XCCL_OK);
        if (F.nmsgs == 1)
            CHECK_MSG(verify(F.msgs[0]->ptr, n, CMA ? 22 : 11), "cma %d: the %s path was not used",
                      CMA, CMA ? "CMA" : "ring");
        atomic_store(&S->flag[FL_DONE], 1);
    }
    teardown();
    free(buf);
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
        total += (i % 97 == 0) ? 100000 + (size_t)i : (i % 11 == 0) ? (size_t)i % 25
                                                                  : (size_t)(i * 13) % 3001;
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

static void job_wrap(int rank)
{
    setenv("XCCL_SHM_RING_KB", "64", 1);
    job_order(rank);
}

static void job_both_ways(int rank)
{
    static const size_t sizes[]   = {16 * MiB, 100, 16 * MiB - 1, 0};
    uint8_t             use[MAXR] = {0};

    setup(rank);
    use[1 - rank] = 1;
    CHECK(wire(use, 5000) == XCCL_OK);
    exchange(use, 8, sizes, 4, &S->flag[FL_DONE]);
    CHECK(F.nsend_err == 0 && F.nrecv_err == 0);
    teardown();
}

static void job_all_to_all(int rank)
{
    static const size_t sizes[]   = {0, 13, 4096, 100000, MiB + 1, 8, 65536, 3 * MiB};
    uint8_t             use[MAXR] = {0};

    setup(rank);
    for (int p = 0; p < NRANKS; p++) use[p] = p != rank;
    CHECK(wire(use, 5000) == XCCL_OK);
    exchange(use, 30, sizes, 8, &S->flag[FL_DONE]);
    teardown();
}

/* Ping-pong where every idle moment is a long sleep in `wait`: a lost wake-up would show as a
 * sleep of WAIT_MS. Covers data arriving, room freeing up in a full ring, and CMA reads
 * completing. */
static void job_sleepy(int rank)
{
    static const struct {
        size_t n;
        int    rounds;
    } steps[] = {{8, 1500}, {3000, 200}, {MiB, 20}, {16 * MiB, 4}};
    char   *buf  = malloc(16 * MiB);
    int     peer = 1 - rank;
    size_t  got  = 0;
    int64_t t0;

    setup(rank);
    CHECK(wire(NULL, 5000) == XCCL_OK);
    WAIT_MS = 3000;
    t0      = xccl_now_ms();
    fill(buf, 16 * MiB, 5);
    for (size_t k = 0; k < sizeof(steps) / sizeof(steps[0]); k++) {
        for (int i = 0; i < steps[k].rounds; i++) {
            xccl_msg_hdr_t h    = {.tag = (uint64_t)i, .fp = 5, .nbytes = steps[k].n};
            xccl_tp_buf_t  b    = {buf, XCCL_MEM_HOST, NULL};
            xccl_status_t  st   = XCCL_INPROGRESS;
            sends_t        s    = {&st, 1};
            size_t         want = ++got;

            /* with CMA a send completes when the peer has the data, so the peer's next message
             * may arrive while we still wait for our send: count messages, never drop them */
            if (rank == 0) {
                CHECK(TP->isend(CTX, peer, &h, &b, &st) == XCCL_OK);
                CHECK(drive(sends_done, &s, 10000) && st == XCCL_OK);
                CHECK(drive(have_msgs, &want, 10000));
            } else {
                CHECK(drive(have_msgs, &want, 10000));
                CHECK(TP->isend(CTX, peer, &h, &b, &st) == XCCL_OK);
                CHECK(drive(sends_done, &s, 10000) && st == XCCL_OK);
            }
            CHECK(F.nmsgs >= got && F.msgs[got - 1]->hdr.nbytes == steps[k].n &&
                  F.msgs[got - 1]->hdr.tag == (uint64_t)i);
        }
    }
    for (size_t i = 0; i < F.nmsgs; i++) CHECK(verify(F.msgs[i]->ptr, F.msgs[i]->hdr.nbytes, 5));
    CHECK(verify(buf, 16 * MiB, 5));
    CHECK_MSG(WAIT_MAX < 1000, "rank %d: a wait lasted %lld ms (lost wake-up)", rank,
              (long long)WAIT_MAX);
    if (rank == 0)
        fprintf(stderr, "    sleepy ping-pong: %lld ms, longest wait %lld ms\n",
                (long long)(xccl_now_ms() - t0), (long long)WAIT_MAX);
    atomic_fetch_add(&S->flag[FL_DONE], 1);
    CHECK(wait_flag(&S->flag[FL_DONE], 2, 5000));
    teardown();
    free(buf);
}

static void job_ring_use(int rank)
{
    static const size_t sizes[]   = {5, 0, 70000};
    uint8_t             use[MAXR] = {0};
    int                 far       = (rank + 2) % NRANKS;
    xccl_msg_hdr_t      h         = {.nbytes = 0};
    xccl_status_t       st        = XCCL_INPROGRESS;

    setup(rank);
    use[(rank + 1) % NRANKS]          = 1;
    use[(rank + NRANKS - 1) % NRANKS] = 1;
    CHECK(wire(use, 5000) == XCCL_OK);
    CHECK(TP->isend(CTX, far, &h, NULL, &st) == XCCL_ERR_INVALID_USAGE);
    CHECK(strstr(xccl_last_error(), "not wired up") != NULL);
    exchange(use, 10, sizes, 3, &S->flag[FL_DONE]);
    teardown();
}

/* The core holds a large message back (see defer_check): a CMA record, or (cma = 0) one
 * streamed through the ring. */
static void job_defer(int rank)
{
    setup(rank);
    CHECK(wire(NULL, 5000) == XCCL_OK);
    defer_check(rank, &S->flag[FL_DONE]);
    teardown();
}

/* The core drops payloads (see drop_check): over CMA, INLINE and STREAM records. */
static void job_drop(int rank)
{
    setup(rank);
    CHECK(wire(NULL, 5000) == XCCL_OK);
    drop_check(rank, &S->flag[FL_DONE]);
    teardown();
}

/* The core refuses a message: the transport fails that peer with the core's status, and the
 * sender learns it was dropped. */
static void job_refuse(int rank)
{
    setup(rank);
    CHECK(wire(NULL, 5000) == XCCL_OK);
    if (rank == 0) {
        int peer     = 1;
        F.refuse_tag = 0xbad;
        CHECK(drive(have_failed, &peer, 5000));
        CHECK(F.failed_st[1] == XCCL_ERR_MISMATCH);
        CHECK(strstr(F.failed_why[1], "rank 1") != NULL);
        CHECK(F.nmsgs == 1 && F.msgs[0]->done && F.msgs[0]->hdr.tag == 1); /* the one before */
    } else {
        char           b8[8] = "12345678";
        xccl_tp_buf_t  b     = {b8, XCCL_MEM_HOST, NULL};
        xccl_msg_hdr_t h1    = {.tag = 1, .nbytes = 8};
        xccl_msg_hdr_t h2    = {.tag = 0xbad, .nbytes = 8};
        xccl_status_t  st[2] = {XCCL_INPROGRESS, XCCL_INPROGRESS};
        sends_t        s     = {st, 2};
        int            peer  = 0;
        CHECK(TP->isend(CTX, 0, &h1, &b, &st[0]) == XCCL_OK);
        CHECK(TP->isend(CTX, 0, &h2, &b, &st[1]) == XCCL_OK);
        CHECK(drive(sends_done, &s, 5000));
        CHECK(drive(have_failed, &peer, 5000));
        CHECK(F.failed_st[0] == XCCL_ERR_REMOTE);
        CHECK_MSG(strstr(F.failed_why[0], "rank 0") && strstr(F.failed_why[0], "dropped"), "%s",
                  F.failed_why[0]);
    }
    atomic_fetch_add(&S->flag[FL_DONE], 1);
    CHECK(wait_flag(&S->flag[FL_DONE], 2, 5000));
    teardown();
}

/* close_peer with a send and a receive in flight: both fail before it returns, then
 * peer_failed; the other side is told, and why. */
static void job_close_peer(int rank)
{
    size_t         n   = 64 * MiB;
    char          *buf = malloc(n);
    xccl_tp_buf_t  b   = {buf, XCCL_MEM_HOST, NULL};
    xccl_msg_hdr_t h   = {.tag = (uint64_t)5 + (uint64_t)rank, .nbytes = n};
    xccl_status_t  st  = XCCL_INPROGRESS;
    int            peer = 1 - rank;

    memset(buf, rank, n);
    setup(rank);
    CHECK(wire(NULL, 5000) == XCCL_OK);
    CHECK(TP->isend(CTX, peer, &h, &b, &st) == XCCL_OK);
    if (rank == 0) {
        int64_t t0 = xccl_now_ms();
        rmsg_t *m;

        while (find_msg(1, 6) == NULL && xccl_now_ms() - t0 < 5000) spin(1);
        m = find_msg(1, 6);
        CHECK(m != NULL && !m->done);
        CHECK(st == XCCL_INPROGRESS);
        TP->close_peer(CTX, 1, "operation timed out");
        CHECK(st == XCCL_ERR_REMOTE);
        CHECK(m != NULL && m->done && m->st == XCCL_ERR_REMOTE);
        CHECK(F.failed[1] && F.failed_st[1] == XCCL_ERR_REMOTE);
        CHECK_MSG(strstr(F.failed_why[1], "operation timed out") != NULL, "%s", F.failed_why[1]);
        st = XCCL_INPROGRESS;
        CHECK(TP->isend(CTX, 1, &h, &b, &st) == XCCL_ERR_REMOTE);
        TP->close_peer(CTX, 1, "again"); /* harmless */
        atomic_store(&S->flag[FL_GO], 1);
    } else {
        CHECK(wait_flag(&S->flag[FL_GO], 1, 10000)); /* rank 1 sits still meanwhile */
        CHECK(drive(have_failed, &peer, 5000));
        /* rank 0's 64 MiB message sits unread in our ring: the reason comes with the drop */
        CHECK_MSG(strstr(F.failed_why[0], "dropped") != NULL &&
                      strstr(F.failed_why[0], "operation timed out") != NULL,
                  "%s", F.failed_why[0]);
        CHECK(st == XCCL_ERR_REMOTE);
    }
    CHECK(F.callbacks_bad == 0);
    atomic_fetch_add(&S->flag[FL_DONE], 1);
    CHECK(wait_flag(&S->flag[FL_DONE], 2, 5000));
    teardown();
    free(buf);
}

/* Rank 1 sends, finalizes and exits while rank 0 looks away: rank 0 still gets every message,
 * then learns that rank 1 is gone. */
static void job_finalize(int rank)
{
    static const size_t sizes[] = {0, 8, 1000, 30000, 24, 25};
    const int           n       = 12;

    setup(rank);
    CHECK(wire(NULL, 5000) == XCCL_OK);
    if (rank == 1) {
        xccl_status_t st[12];
        char         *bufs[12];
        sends_t       s = {st, (size_t)n};
        for (int i = 0; i < n; i++) {
            xccl_msg_hdr_t h = {.tag    = (uint64_t)i,
                                .fp     = 300 + (uint64_t)i,
                                .nbytes = sizes[i % 6]};
            xccl_tp_buf_t  b;
            bufs[i] = malloc(h.nbytes + 1);
            fill(bufs[i], h.nbytes, h.fp);
            b     = (xccl_tp_buf_t){bufs[i], XCCL_MEM_HOST, NULL};
            st[i] = XCCL_INPROGRESS;
            CHECK(TP->isend(CTX, 0, &h, &b, &st[i]) == XCCL_OK);
        }
        CHECK(drive(sends_done, &s, 5000));
        for (int i = 0; i < n; i++) {
            CHECK(st[i] == XCCL_OK);
            free(bufs[i]);
        }
        teardown();
        atomic_store(&S->flag[FL_FINALIZED], 1);
    } else {
        int peer = 1;
        CHECK(wait_flag(&S->flag[FL_FINALIZED], 1, 5000));
        F.verify_free = 1;
        CHECK(drive(have_failed, &peer, 5000));
        CHECK_MSG(strstr(F.failed_why[1], "rank 1") && strstr(F.failed_why[1], "closed"), "%s",
                  F.failed_why[1]);
        CHECK_MSG(F.nmsgs == (size_t)n, "%zu of %d messages", F.nmsgs, n);
        for (size_t i = 0; i < F.nmsgs; i++)
            CHECK(F.msgs[i]->done && F.msgs[i]->st == XCCL_OK && F.msgs[i]->intact &&
                  F.msgs[i]->hdr.tag == i);
        teardown();
    }
}

/* Rank 1 is SIGKILLed in the middle of two large transfers (one each way). */
static void job_kill(int rank)
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
        while (find_msg(0, 6) == NULL && xccl_now_ms() - t0 < 5000) spin(1);
        spin(3);
        CHECK(st == XCCL_INPROGRESS && find_msg(0, 6) && !find_msg(0, 6)->done);
        atomic_fetch_add(&S->checks, ctest_checks);
        atomic_fetch_add(&S->failures, ctest_failures);
        fflush(stderr);
        atomic_store(&S->kill_ms, xccl_now_ms());
        kill(getpid(), SIGKILL);
        for (;;) pause();
    }
    if (rank == 0) {
        xccl_msg_hdr_t h    = {.tag = 6, .nbytes = n};
        xccl_status_t  st   = XCCL_INPROGRESS;
        int            peer = 1;
        rmsg_t        *m;
        int64_t        late;

        CHECK(TP->isend(CTX, 1, &h, &b, &st) == XCCL_OK);
        CHECK(drive(have_failed, &peer, 5000));
        late = xccl_now_ms() - atomic_load(&S->kill_ms);
        CHECK_MSG(late < 1000, "failure noticed %lld ms after the kill", (long long)late);
        CHECK(F.failed_st[1] == XCCL_ERR_REMOTE);
        CHECK_MSG(strstr(F.failed_why[1], "rank 1 (pid") && strstr(F.failed_why[1], "exited"),
                  "%s", F.failed_why[1]);
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
        CHECK(leftovers() == 0);
        atomic_fetch_add(&S->flag[FL_DONE], 1);
        CHECK(wait_flag(&S->flag[FL_DONE], 2, 5000));
    }
    teardown();
    free(buf);
}

/* Rank 1 publishes an address and leaves: ranks 0 and 2 time out naming it. */
static void job_missing(int rank)
{
    int64_t       t0;
    xccl_status_t st;

    setup(rank);
    if (rank == 1) { /* alive, but never wires up */
        teardown();
        CHECK(wait_flag(&S->flag[FL_DONE], 2, 5000));
        return;
    }
    t0 = xccl_now_ms();
    st = wire(NULL, 600);
    CHECK(st == XCCL_ERR_TIMEOUT);
    CHECK_MSG(xccl_now_ms() - t0 >= 550 && xccl_now_ms() - t0 < 3000, "%lld ms",
              (long long)(xccl_now_ms() - t0));
    CHECK_MSG(strstr(xccl_last_error(), "rank 1") != NULL, "%s", xccl_last_error());
    CHECK_MSG(strstr(xccl_last_error(), rank == 0 ? "rank 2" : "rank 0") == NULL, "%s",
              xccl_last_error());
    /* both finish the timeout before either finalizes (the other's segment must stay) */
    atomic_fetch_add(&S->flag[FL_DONE], 1);
    CHECK(wait_flag(&S->flag[FL_DONE], 2, 5000));
    teardown();
}

/* Rank 1 dies between init and wire-up (its name is still in /dev/shm): ranks 0 and 2 fail
 * fast naming it, and remove the name it left. */
static void job_early_death(int rank)
{
    int64_t       t0;
    xccl_status_t st;

    setup(rank);
    if (rank == 1) {
        atomic_fetch_add(&S->checks, ctest_checks);
        atomic_fetch_add(&S->failures, ctest_failures);
        kill(getpid(), SIGKILL);
        for (;;) pause();
    }
    t0 = xccl_now_ms();
    st = wire(NULL, 10000);
    CHECK_MSG(st == XCCL_ERR_REMOTE, "%s", xccl_status_string(st));
    CHECK_MSG(xccl_now_ms() - t0 < 2000, "%lld ms", (long long)(xccl_now_ms() - t0));
    CHECK_MSG(strstr(xccl_last_error(), "rank 1 (pid") && strstr(xccl_last_error(), "exited"),
              "%s", xccl_last_error());
    atomic_fetch_add(&S->flag[FL_DONE], 1);
    CHECK(wait_flag(&S->flag[FL_DONE], 2, 5000));
    teardown();
}

/* The kill job with every peer watched through its segment lock (as across pid namespaces). */
static void job_kill_lock(int rank)
{
    setenv("XCCL_SHM_WATCH", "lock", 1);
    job_kill(rank);
}

static void job_big(int rank)
{
    size_t         n    = ((size_t)2 << 30) + 4097;
    char          *p    = malloc(n);
    xccl_msg_hdr_t h    = {.tag = 1, .fp = 31337, .nbytes = n};
    xccl_tp_buf_t  b    = {p, XCCL_MEM_HOST, NULL};
    xccl_status_t  st   = XCCL_INPROGRESS;
    sends_t        s    = {&st, 1};
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

int main(void)
{
    S = mmap(NULL, sizeof(*S), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(S != MAP_FAILED);

    job_reach();
    for (int cma = 1; cma >= 0; cma--) {
        run_job("basic", 2, cma, job_basic, 60, -1);
        run_job("path", 2, cma, job_path, 30, -1);
        run_job("order", 2, cma, job_order, 60, -1);
        run_job("both_ways", 2, cma, job_both_ways, 60, -1);
        run_job("all_to_all", 4, cma, job_all_to_all, 60, -1);
        run_job("sleepy", 2, cma, job_sleepy, 60, -1);
        run_job("close_peer", 2, cma, job_close_peer, 30, -1);
        run_job("defer", 2, cma, job_defer, 30, -1);
        run_job("drop", 2, cma, job_drop, 30, -1);
        run_job("kill", 3, cma, job_kill, 30, 1);
    }
    run_job("wrap", 2, 0, job_wrap, 60, -1);
    run_job("ring_use", 4, 1, job_ring_use, 60, -1);
    run_job("refuse", 2, 1, job_refuse, 30, -1);
    run_job("finalize", 2, 1, job_finalize, 30, -1);
    run_job("missing", 3, 1, job_missing, 30, -1);
    run_job("early_death", 3, 1, job_early_death, 30, 1);
    run_job("kill_lock", 3, 0, job_kill_lock, 30, 1);
    if (xccl_env_int("XCCL_TEST_BIG", 0) == 1) {
        run_job("big", 2, 1, job_big, 300, -1);
        run_job("big", 2, 0, job_big, 300, -1);
    }
    CTEST_MAIN_END("test_shm");
}
