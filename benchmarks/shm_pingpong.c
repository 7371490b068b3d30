/* SPDX-License-Identifier: Apache-2.0
 *
 * shm_pingpong.c - ping-pong between two forked processes on this host (not a test), over
 *   shm (CMA)   the shared-memory transport, large messages pulled with process_vm_readv
 *   shm (ring)  the same with XCCL_SHM_CMA=0: everything copied through the rings
 *   tcp         the TCP transport over loopback
 * at two levels:
 *   transport   the transport's own ABI driven by a minimal core that polls `progress`
 *               (what the transport itself costs)
 *   api         xccl_isend / xccl_irecv / xccl_work_wait through the public C API, one
 *               transport per run (XCCL_TRANSPORTS), so matching, Work objects and the
 *               core's wait policy (poll XCCL_SPIN_US, then sleep in the transport) are in
 *
 * Build by hand from the repository root after `make -C tests/c` (which builds libxccl.a):
 *   gcc -std=c11 -D_GNU_SOURCE -O2 -pthread -Icsrc/include -Icsrc benchmarks/shm_pingpong.c \
 *       build/ctest/libxccl.a -ldl -lm -o build/shm_pingpong
 *   build/shm_pingpong [bytes ...]        (default: 8 B, 4 KiB, 64 KiB, 1 MiB, 16 MiB, 64 MiB)
 *
 * Each size runs a few warm-up round trips, then enough to last about 0.2 s (at least 5).
 * "us" is half a round trip (one-way latency), "GB/s" = bytes / that time. Receive buffers
 * are posted before the send at the API level, so no message is staged as unexpected.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/check.h"
#include "xccl/xccl.h"
#include "xccl/xccl_transport.h"

extern const xccl_transport_ops_t xccl_transport_shm;
extern const xccl_transport_ops_t xccl_transport_tcp;

#define MAXSIZES 16
#define NCONF    3

typedef struct shared {
    atomic_int ready[2];
    uint8_t    blob[2][XCCL_TP_ADDR_MAX];
    size_t     blen[2];
    double     us[2][NCONF][MAXSIZES]; /* [level][config][size], filled by rank 0 */
} shared_t;

static shared_t *S;
static size_t    SIZES[MAXSIZES] = {8, 4096, 65536, 1 << 20, 16 << 20, 64 << 20};
static int       NSIZES          = 6;

static double now_s(void) { return (double)xccl_now_ns() * 1e-9; }

/* Iterations for a round trip of t seconds: about 0.2 s, at least 5. */
static long iters_for(double t)
{
    long n = (long)(0.2 / (t > 1e-9 ? t : 1e-9));
    return n < 5 ? 5 : n > 200000 ? 200000 : n;
}

/* ---------------------------------------------------------------------------------------------
 * Transport level: a core reduced to counters
 * ------------------------------------------------------------------------------------------- */

static const xccl_transport_ops_t *TP;
static xccl_tp_ctx_t              *CTX;
static char                       *RBUF;
static long                        nrecv, nsent, nfailed;

static xccl_status_t tp_match(void *core, int peer, const xccl_msg_hdr_t *hdr, xccl_tp_buf_t *dst,
                              void **cookie)
{
    (void)core, (void)peer, (void)hdr;
    dst->ptr = RBUF;
    dst->mem = XCCL_MEM_HOST;
    dst->mr  = NULL;
    *cookie  = NULL;
    return XCCL_OK;
}
static void tp_recv_done(void *core, void *cookie, xccl_status_t st)
{
    (void)core, (void)cookie;
    nrecv += st == XCCL_OK;
    nfailed += st != XCCL_OK;
}
static void tp_send_done(void *core, void *cookie, xccl_status_t st)
{
    (void)core, (void)cookie;
    nsent += st == XCCL_OK;
    nfailed += st != XCCL_OK;
}
static void tp_failed(void *core, int peer, xccl_status_t st, const char *why)
{
    (void)core, (void)peer, (void)st, (void)why;
}

static const xccl_tp_upcalls_t UP = {NULL, tp_match, tp_recv_done, tp_send_done, tp_failed};

static int tp_poll_until(long *counter, long want)
{
    while (*counter < want) {
        int n;
        if (nfailed || TP->progress(CTX, &n) != XCCL_OK) return -1;
    }
    return 0;
}

/* One round trip of n bytes (rank 1 echoes). */
static int tp_round_trip(int rank, char *sbuf, size_t n)
{
    static long    rounds;
    xccl_msg_hdr_t h = {.comm_id = 1, .tag = 1, .nbytes = n};
    xccl_tp_buf_t  b = {sbuf, XCCL_MEM_HOST, NULL};

    /* counted, not compared with "one more than now": a send may complete inside isend, and
     * with CMA the peer's next message may arrive while we wait for our send to complete */
    rounds++;
    if (rank == 1 && tp_poll_until(&nrecv, rounds) != 0) return -1;
    if (TP->isend(CTX, 1 - rank, &h, &b, NULL) != XCCL_OK) return -1;
    if (tp_poll_until(&nsent, rounds) != 0) return -1;
    if (rank == 0 && tp_poll_until(&nrecv, rounds) != 0) return -1;
    return 0;
}

static int tp_rank(int rank, int conf, char *sbuf)
{
    xccl_peer_info_t      infos[2];
    xccl_tp_init_params_t p;
    const void           *addrs[2] = {S->blob[0], S->blob[1]};
    uint8_t               use[2]   = {rank != 0, rank != 1};

    memset(infos, 0, sizeof(infos));
    memset(&p, 0, sizeof(p));
    p.rank   = rank;
    p.size   = 2;
    p.job_id = 0xbe4c000000000000ull + (uint64_t)getppid() * 8 + (uint64_t)conf;
    p.peers  = infos;
    p.up     = &UP;
    TP       = conf == 2 ? &xccl_transport_tcp : &xccl_transport_shm;
    if (TP->init(&p, &CTX) != XCCL_OK) return -1;
    TP->get_addr(CTX, S->blob[rank], &S->blen[rank]);
    atomic_store(&S->ready[rank], 1);
    while (!atomic_load(&S->ready[1 - rank])) usleep(100);
    if (TP->wireup(CTX, addrs, S->blen, use, 10000) != XCCL_OK) return -1;
    for (int k = 0; k < NSIZES; k++) {
        long   iters;
        double t0, t;
        for (int i = 0; i < 5; i++)
            if (tp_round_trip(rank, sbuf, SIZES[k]) != 0) return -1;
        t0 = now_s();
        for (int i = 0; i < 3; i++)
            if (tp_round_trip(rank, sbuf, SIZES[k]) != 0) return -1;
        t     = (now_s() - t0) / 3;
        iters = iters_for(t);
        /* both ranks must agree on the count: rank 0 decides and leaves it in the shared
         * mapping; the phases (2 + 2k, 3 + 2k) only grow */
        if (rank == 0) S->us[0][conf][k] = (double)iters;
        atomic_store(&S->ready[rank], 2 + 2 * k);
        while (atomic_load(&S->ready[1 - rank]) < 2 + 2 * k) usleep(10);
        iters = (long)S->us[0][conf][k];
        t0    = now_s();
        for (long i = 0; i < iters; i++)
            if (tp_round_trip(rank, sbuf, SIZES[k]) != 0) return -1;
        t = (now_s() - t0) / (double)iters / 2;
        atomic_store(&S->ready[rank], 3 + 2 * k);
        while (atomic_load(&S->ready[1 - rank]) < 3 + 2 * k) usleep(10);
        if (rank == 0) S->us[0][conf][k] = t * 1e6;
    }
    /* leave together: a peer that finalizes first looks like a failure to the other */
    atomic_store(&S->ready[rank], 1000);
    while (atomic_load(&S->ready[1 - rank]) < 1000) usleep(100);
    TP->finalize(CTX);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * API level
 * ------------------------------------------------------------------------------------------- */

/* One round trip of n bytes. A receive is always posted before its message can arrive: with
 * CMA a send completes only once the peer has pulled the data, so a receive posted after our
 * own send completed could find the peer's next message already staged as unexpected (an
 * extra copy into fresh memory). *wr is the posted receive; the next one replaces it. */
static int api_round_trip(xccl_comm_t *c, int rank, char *sbuf, char *rbuf, size_t n,
                          xccl_work_t **wr)
{
    xccl_work_t *ws = NULL, *next = NULL;
    int          peer = 1 - rank, bad = 0;

    if (rank == 1) {
        bad |= xccl_work_wait(*wr, -1) != XCCL_OK;
        xccl_work_release(*wr);
        bad |= xccl_irecv(c, rbuf, n, peer, 1, &next) != XCCL_OK;
        *wr = next;
    }
    bad |= xccl_isend(c, sbuf, n, peer, 1, &ws) != XCCL_OK;
    bad |= ws == NULL || xccl_work_wait(ws, -1) != XCCL_OK;
    if (rank == 0) {
        bad |= xccl_work_wait(*wr, -1) != XCCL_OK;
        xccl_work_release(*wr);
        bad |= xccl_irecv(c, rbuf, n, peer, 1, &next) != XCCL_OK;
        *wr = next;
    }
    if (ws != NULL) xccl_work_release(ws);
    return bad ? -1 : 0;
}

static int api_rank(int rank, int conf, char *sbuf, char *rbuf)
{
    xccl_store_t      *store = NULL;
    xccl_comm_t       *c     = NULL;
    xccl_comm_config_t cfg   = {0};
    char               path[128];

    snprintf(path, sizeof(path), "/tmp/xccl-pingpong-%d-%d", (int)getppid(), conf);
    if (xccl_store_file_create(path, 2, 20000, &store) != XCCL_OK) return -1;
    cfg.rank       = rank;
    cfg.size       = 2;
    cfg.store      = store;
    cfg.timeout_ms = 60000;
    cfg.transports = conf == 2 ? "tcp" : "shm";
    cfg.name       = "pingpong";
    if (xccl_comm_create(&cfg, &c) != XCCL_OK) {
        fprintf(stderr, "rank %d: %s\n", rank, xccl_last_error());
        return -1;
    }
    xccl_store_release(store);
    for (int k = 0; k < NSIZES; k++) {
        long         iters;
        double       t0, t;
        xccl_work_t *w, *wr = NULL;
        if (xccl_irecv(c, rbuf, SIZES[k], 1 - rank, 1, &wr) != XCCL_OK) return -1;
        for (int i = 0; i < 5; i++)
            if (api_round_trip(c, rank, sbuf, rbuf, SIZES[k], &wr) != 0) return -1;
        t0 = now_s();
        for (int i = 0; i < 3; i++)
            if (api_round_trip(c, rank, sbuf, rbuf, SIZES[k], &wr) != 0) return -1;
        t     = (now_s() - t0) / 3;
        iters = iters_for(t);
        if (rank == 0) xccl_isend(c, &iters, sizeof(iters), 1, 2, &w);
        else xccl_irecv(c, &iters, sizeof(iters), 0, 2, &w);
        if (xccl_work_wait(w, -1) != XCCL_OK) return -1;
        xccl_work_release(w);
        t0 = now_s();
        for (long i = 0; i < iters; i++)
            if (api_round_trip(c, rank, sbuf, rbuf, SIZES[k], &wr) != 0) return -1;
        t = (now_s() - t0) / (double)iters / 2;
        if (rank == 0) S->us[1][conf][k] = t * 1e6;
        /* each side still has a receive posted: one more message each way fills them */
        if (xccl_isend(c, sbuf, SIZES[k], 1 - rank, 1, &w) != XCCL_OK) return -1;
        if (xccl_work_wait(w, -1) != XCCL_OK || xccl_work_wait(wr, -1) != XCCL_OK) return -1;
        xccl_work_release(w);
        xccl_work_release(wr);
    }
    {
        /* leave together */
        xccl_work_t *w;
        if (xccl_barrier(c, NULL, &w) == XCCL_OK) {
            xccl_work_wait(w, -1);
            xccl_work_release(w);
        }
    }
    xccl_comm_destroy(c);
    unlink(path);
    return 0;
}

/* Runs one level and config on two forked ranks. */
static int run(int level, int conf)
{
    pid_t pids[2];
    int   ok = 1;

    memset(S->ready, 0, sizeof(S->ready));
    for (int r = 0; r < 2; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            size_t maxn = 0;
            char  *sbuf, *rbuf;
            int    rc;
            for (int k = 0; k < NSIZES; k++) maxn = SIZES[k] > maxn ? SIZES[k] : maxn;
            sbuf = malloc(maxn + 1);
            rbuf = malloc(maxn + 1);
            RBUF = rbuf;
            memset(sbuf, 1, maxn + 1); /* touch every page before timing */
            memset(rbuf, 2, maxn + 1);
            setenv("XCCL_SHM_CMA", conf == 0 ? "1" : "0", 1);
            /* from 64 KiB: by default CMA is used only where ranks outnumber CPUs */
            setenv("XCCL_SHM_CMA_MIN", "65536", 1);
            rc = level == 0 ? tp_rank(r, conf, sbuf) : api_rank(r, conf, sbuf, rbuf);
            _exit(rc == 0 ? 0 : 1);
        }
    }
    for (int r = 0; r < 2; r++) {
        int status = 0;
        waitpid(pids[r], &status, 0);
        ok &= WIFEXITED(status) && WEXITSTATUS(status) == 0;
    }
    return ok ? 0 : -1;
}

int main(int argc, char **argv)
{
    static const char *const confs[NCONF]  = {"shm (CMA)", "shm (ring)", "tcp"};
    static const char *const levels[2]     = {"transport", "api"};

    if (argc > 1) {
        NSIZES = 0;
        for (int i = 1; i < argc && NSIZES < MAXSIZES; i++)
            SIZES[NSIZES++] = (size_t)atoll(argv[i]);
    }
    S = mmap(NULL, sizeof(*S), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (S == MAP_FAILED) return 1;
    setenv("XCCL_SOCKET_IFNAME", "lo", 0);
    for (int level = 0; level < 2; level++) {
        for (int conf = 0; conf < NCONF; conf++) {
            if (run(level, conf) != 0) {
                fprintf(stderr, "%s %s: failed\n", levels[level], confs[conf]);
                return 1;
            }
        }
    }
    printf("# ping-pong between 2 processes: us = half a round trip, GB/s = bytes / us\n");
    for (int level = 0; level < 2; level++) {
        printf("# level: %s\n%12s", levels[level], "bytes");
        for (int conf = 0; conf < NCONF; conf++) printf(" %14s %7s", confs[conf], "GB/s");
        printf("\n");
        for (int k = 0; k < NSIZES; k++) {
            printf("%12zu", SIZES[k]);
            for (int conf = 0; conf < NCONF; conf++)
                printf(" %11.2f us %7.2f", S->us[level][conf][k],
                       (double)SIZES[k] / S->us[level][conf][k] / 1e3);
            printf("\n");
        }
    }
    return 0;
}
