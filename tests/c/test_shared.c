/* SPDX-License-Identifier: Apache-2.0
 *
 * test_shared.c - the core's side of node-shared memory (task.h, "Node-shared memory";
 * csrc/core/shared.c) on forked ranks that meet through a file store, with two test-only
 * shared algorithms added to the selection policy (xccl_core_policy points at a wrapper):
 *   t_shm   all_reduce (int32 sum) through per-rank slots of the segment: wait until every
 *           peer finished reading this rank's slot in the previous epoch, copy in, publish,
 *           wait for every peer's slot, reduce them all in rank order, publish "done".
 *   t_read  all_gather through cross-memory reads: publish the receive buffer's address, read
 *           every peer's block from its buffer, publish "done", wait until every peer is done
 *           with ours.
 *
 *   bits       topo.shared on every member, with XCCL_SHARED=0 / XCCL_SHARED_CMA=0 set on one
 *              rank only, over tcp alone, and across two "hosts" (XCCL_HOST_ID): identical
 *              everywhere; a shared algorithm forced where there is no segment fails the call
 *              before anything moves.
 *   lifecycle  the segment's name exists while a member has not attached, is gone once every
 *              member attached (the mapping stays: "(deleted)" in /proc/self/maps); epochs 1, 2,
 *              ... in posting order and identical on every rank, for a dozen asynchronous
 *              shared collectives interleaved with message-based ones on two communicators;
 *              grants one at a time in epoch order; results checked against sums computed
 *              here; t_read's results and its trace (receives over "cma" from every peer).
 *   release    on a pair where one rank never calls: the first collective times out naming
 *              the rank it waits for, the next one is granted after that (its timeout says it
 *              waited for that rank's writes, not for its turn), an aborted communicator's
 *              collective fails, and destroying the communicator removes the name.
 *   dead       a rank killed while the others wait for its flags: they fail with
 *              XCCL_ERR_REMOTE naming it within a few seconds (the timeout is a minute), and
 *              nothing is left in /dev/shm.
 *   peer_read  a bad address (EFAULT: the rank and the range are named), a reader without
 *              CAP_SYS_PTRACE reading a process that is not dumpable (EPERM: the ptrace policy
 *              and XCCL_SHARED_CMA=0 are named), a peer that exited (ESRCH: XCCL_ERR_REMOTE).
 *   sweep      a name left by a dead process is removed at the next context creation; a name
 *              whose creator holds its lock, and a fresh one of a live process, are not.
 */
#include <dirent.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/core.h"
#include "ctest.h"
#include "xccl/xccl.h"

static char store_path[256];
static int  verbose; /* $TEST_SHARED_VERBOSE: print the errors the tests provoke */

static void show(const char *what, xccl_work_t *w)
{
    if (verbose) fprintf(stderr, "[%s] %s\n", what, xccl_work_error(w));
}

/* ------------------------------------------------------------------------------------------ */
/* What the forked ranks share                                                                 */
/* ------------------------------------------------------------------------------------------ */

enum { MAXR = 8, NLOG = 64 };

typedef struct shared {
    atomic_int       created;     /* lifecycle: rank 0 saw its segment's name              */
    atomic_int       dead;        /* peer_read: the parent reaped the rank that exited      */
    atomic_int       ready[MAXR]; /* per-test hand-shakes                                   */
    _Atomic unsigned bits[MAXR][4];
    _Atomic uint64_t epochs[2][MAXR][NLOG]; /* lifecycle: epoch of each op, per comm       */
} shared_t;
static shared_t *SH;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static xccl_comm_t *mk(int rank, int size, const char *tp, int64_t tmo)
{
    return ctest_file_comm(store_path, rank, size, tmo, "shared", tp);
}

static int wait_flag(atomic_int *f, int v, double secs)
{
    double end = now_s() + secs;
    while (atomic_load(f) < v && now_s() < end)
        usleep(500);
    return atomic_load(f) >= v;
}

/* A message-based barrier: the one-host algorithms of csrc/algo (which the default selection
 * picks on such communicators) use a layout of their own that t_shared_bytes does not size. */
static void barrier(xccl_comm_t *c)
{
    xccl_coll_opts_t o = {.algo = "dissemination"};
    xccl_work_t     *w;
    CHECK(xccl_barrier(c, &o, &w) == XCCL_OK);
    CHECK_MSG(xccl_work_wait(w, 60000) == XCCL_OK, "barrier: %s", xccl_work_error(w));
    xccl_work_release(w);
}

/* Names in /dev/shm of the segment of the communicator `id` of job `job`. */
static int seg_names_of(uint64_t job, uint64_t id)
{
    char           pre[64];
    DIR           *d = opendir("/dev/shm");
    struct dirent *e;
    int            n = 0;

    snprintf(pre, sizeof(pre), "xcclseg-%016llx-%016llx-", (unsigned long long)job,
             (unsigned long long)id);
    if (d == NULL) return -1;
    while ((e = readdir(d)) != NULL)
        n += strncmp(e->d_name, pre, strlen(pre)) == 0;
    closedir(d);
    return n;
}

static int seg_names(const xccl_comm_t *c)
{
    return seg_names_of(c->ctx->job_id, xccl_comm_id(c));
}

/* 1 if this process maps the (removed) segment of comm. */
static int seg_mapped_deleted(const xccl_comm_t *c)
{
    char  pre[64], line[512];
    FILE *f     = fopen("/proc/self/maps", "r");
    int   found = 0;

    snprintf(pre, sizeof(pre), "/dev/shm/xcclseg-%016llx-%016llx-",
             (unsigned long long)c->ctx->job_id, (unsigned long long)xccl_comm_id(c));
    if (f == NULL) return 0;
    while (fgets(line, sizeof(line), f) != NULL)
        found |= strstr(line, pre) != NULL && strstr(line, "(deleted)") != NULL;
    fclose(f);
    return found;
}

/* ------------------------------------------------------------------------------------------ */
/* The test-only shared algorithms and the policy around the real one                          */
/* ------------------------------------------------------------------------------------------ */

enum { SLOT_DATA = 4096 };
typedef struct slot {
    _Atomic uint64_t posted; /* epoch whose data (or address) is in place                  */
    _Atomic uint64_t done;   /* epoch this rank finished reading others' slots / buffers    */
    uint64_t         addr;   /* t_read: the receive buffer                                  */
    char             pad[40];
    unsigned char    data[SLOT_DATA];
} slot_t;

static size_t t_shared_bytes(int size)
{
    return (size_t)size * sizeof(slot_t);
}

/* Per process: the holder of each communicator's segment (grants one at a time, in epoch
 * order), and knobs of the peer_read test. */
static struct {
    const xccl_comm_t *comm;
    uint64_t           last; /* last epoch granted */
    int                held;
} g_grant[4];
static int        g_grant_bad;
static int        g_read_mode; /* 0 normal, 1 bad address, 2 wait for SH->dead first */
static atomic_int g_published; /* t_read published this rank's address */

static int grant_check(xccl_task_t *t, uint64_t epoch)
{
    const xccl_comm_t *c = t->work->comm;
    for (int i = 0; i < 4; i++) {
        if (g_grant[i].comm != c && g_grant[i].comm != NULL) continue;
        g_grant[i].comm = c;
        if (g_grant[i].held || g_grant[i].last + 1 != epoch) g_grant_bad++;
        g_grant[i].held = 1;
        g_grant[i].last = epoch;
        return i;
    }
    g_grant_bad++;
    return 0;
}

static void grant_end(xccl_task_t *t)
{
    for (int i = 0; i < 4; i++)
        if (g_grant[i].comm == t->work->comm) g_grant[i].held = 0;
}

/* Waits (without blocking) until every peer's counter `which` reaches e. */
static int all_reached(xccl_task_t *t, slot_t *s, int which, uint64_t e)
{
    int me = xccl_task_rank(t), n = xccl_task_size(t);
    for (int p = 0; p < n; p++) {
        _Atomic uint64_t *f = which ? &s[p].done : &s[p].posted;
        if (p == me || atomic_load_explicit(f, memory_order_acquire) >= e) continue;
        xccl_task_shared_wait(t, p);
        return 0;
    }
    return 1;
}

static xccl_status_t t_shm_progress(xccl_task_t *t)
{
    uint64_t               *st = xccl_task_state(t);
    const xccl_coll_args_t *a  = xccl_task_args(t);
    int                     me = xccl_task_rank(t), n = xccl_task_size(t);
    size_t                  bytes = a->count * a->elsize;
    xccl_shared_t           sh;
    xccl_status_t           rc = xccl_task_shared(t, &sh);
    slot_t                 *s;

    if (rc != XCCL_OK) return rc;
    s = (slot_t *)sh.base;
    if (sh.bytes < t_shared_bytes(n) || bytes > SLOT_DATA || ((uintptr_t)sh.base & 4095) != 0)
        return XCCL_ERROR(XCCL_ERR_INTERNAL, "t_shm: segment of %zu bytes at %p", sh.bytes,
                          (void *)sh.base);
    switch (st[0]) {
    case 0:
        st[1] = (uint64_t)grant_check(t, sh.epoch);
        st[0] = 1;
        /* fall through */
    case 1: /* peers finished reading my slot in the previous epoch */
        if (!all_reached(t, s, 1, sh.epoch - 1)) return XCCL_INPROGRESS;
        XCCL_CHECK(xccl_task_copy(t, s[me].data, a->rbuf, bytes));
        atomic_store_explicit(&s[me].posted, sh.epoch, memory_order_release);
        xccl_task_shared_signal(t);
        st[0] = 2;
        /* fall through */
    case 2:
        if (!all_reached(t, s, 0, sh.epoch)) return XCCL_INPROGRESS;
        XCCL_CHECK(xccl_task_copy(t, a->rbuf, s[0].data, bytes));
        for (int p = 1; p < n; p++)
            XCCL_CHECK(xccl_task_reduce(t, a->rbuf, a->rbuf, s[p].data, a->count));
        atomic_store_explicit(&s[me].done, sh.epoch, memory_order_release);
        xccl_task_shared_signal(t);
        grant_end(t);
        st[0] = 3;
        return XCCL_OK;
    default:
        return XCCL_OK;
    }
}

static xccl_status_t t_read_progress(xccl_task_t *t)
{
    uint64_t               *st = xccl_task_state(t);
    const xccl_coll_args_t *a  = xccl_task_args(t);
    int                     me = xccl_task_rank(t), n = xccl_task_size(t);
    size_t                  blk = a->count * a->elsize;
    xccl_shared_t           sh;
    xccl_status_t           rc = xccl_task_shared(t, &sh);
    slot_t                 *s;

    if (rc != XCCL_OK) return rc;
    s = (slot_t *)sh.base;
    switch (st[0]) {
    case 0:
        if (!all_reached(t, s, 1, sh.epoch - 1)) return XCCL_INPROGRESS;
        s[me].addr = (uint64_t)(uintptr_t)a->rbuf;
        atomic_store_explicit(&s[me].posted, sh.epoch, memory_order_release);
        xccl_task_shared_signal(t);
        atomic_store(&g_published, 1);
        st[0] = 1;
        /* fall through */
    case 1:
        if (!all_reached(t, s, 0, sh.epoch)) return XCCL_INPROGRESS;
        if (g_read_mode == 2 && atomic_load(&SH->dead) == 0) return XCCL_INPROGRESS;
        for (int p = 0; p < n; p++) {
            const char *src = (const char *)(uintptr_t)s[p].addr + (size_t)p * blk;
            if (p == me) continue;
            if (g_read_mode == 1) src = (const char *)(uintptr_t)64; /* never mapped */
            XCCL_CHECK(xccl_task_peer_read(t, p, (char *)a->rbuf + (size_t)p * blk, src, blk));
        }
        atomic_store_explicit(&s[me].done, sh.epoch, memory_order_release);
        xccl_task_shared_signal(t);
        st[0] = 2;
        /* fall through */
    case 2: /* peers read from our buffer: it stays untouched until they are done */
        if (!all_reached(t, s, 1, sh.epoch)) return XCCL_INPROGRESS;
        st[0] = 3;
        return XCCL_OK;
    default:
        return XCCL_OK;
    }
}

static void t_cost(int size, size_t nbytes, xccl_cost_t *out)
{
    out->steps      = 2;
    out->bytes      = 0;
    out->copy_bytes = (double)nbytes * size;
}

static const xccl_algo_t t_shm = {
    .name     = "t_shm",
    .coll     = XCCL_COLL_ALLREDUCE,
    .summary  = "test: slots in the node-shared segment",
    .cost     = t_cost,
    .progress = t_shm_progress,
    .shared   = 1,
};
static const xccl_algo_t t_read = {
    .name     = "t_read",
    .coll     = XCCL_COLL_ALLGATHER,
    .summary  = "test: cross-memory reads of peers' buffers",
    .cost     = t_cost,
    .progress = t_read_progress,
    .shared   = 1,
};

static xccl_status_t t_select(xccl_algo_memo_t *memo, const xccl_coll_args_t *args, int size,
                              size_t nbytes, const xccl_cost_model_t *m, const char *forced,
                              const xccl_algo_t **out)
{
    const xccl_algo_t *mine = NULL;

    if (forced != NULL && strcmp(forced, "t_shm") == 0 && args->coll == XCCL_COLL_ALLREDUCE)
        mine = &t_shm;
    if (forced != NULL && strcmp(forced, "t_read") == 0 && args->coll == XCCL_COLL_ALLGATHER)
        mine = &t_read;
    if (mine == NULL) return xccl_algo_policy.select(memo, args, size, nbytes, m, forced, out);
    if (args->topo == NULL || !(args->topo->shared & XCCL_SHARED_SEG) ||
        (mine == &t_read && !(args->topo->shared & XCCL_SHARED_CMA)))
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "algorithm %s cannot run here (topo.shared %u)",
                          mine->name, args->topo ? args->topo->shared : 0u);
    *out = mine;
    return XCCL_OK;
}

static xccl_algo_policy_t test_policy;

/* ------------------------------------------------------------------------------------------ */
/* bits                                                                                        */
/* ------------------------------------------------------------------------------------------ */

/* case: 0 default, 1 XCCL_SHARED=0 on rank 1, 2 XCCL_SHARED_CMA=0 on rank 2, 3 tcp only,
 *       4 ranks 0-1 on host "a", rank 2 on host "b" */
static int child_bits(int rank, int size, void *arg)
{
    int          cs = (int)(intptr_t)arg;
    xccl_comm_t *c, *sub = NULL;

    if (cs == 1 && rank == 1) setenv("XCCL_SHARED", "0", 1);
    if (cs == 2 && rank == 2) setenv("XCCL_SHARED_CMA", "0", 1);
    if (cs == 4) setenv("XCCL_HOST_ID", rank < 2 ? "a" : "b", 1);
    c = mk(rank, size, cs == 3 ? "tcp" : NULL, 60000);
    if (c == NULL) return 2;
    atomic_store(&SH->bits[rank][0], c->topo.shared);
    if (cs == 4) {
        int lo[2] = {0, 1}, hi[2] = {1, 2};
        CHECK(xccl_comm_split(c, 2, rank < 2 ? lo : hi, "pair", &sub) == XCCL_OK || rank == 1);
        if (rank == 1) { /* in both pairs: the host-local one and the one across hosts */
            xccl_comm_t *other = NULL;
            CHECK(xccl_comm_split(c, 2, lo, "lo", &sub) == XCCL_OK);
            CHECK(xccl_comm_split(c, 2, hi, "hi", &other) == XCCL_OK);
            atomic_store(&SH->bits[rank][2], other->topo.shared);
            xccl_comm_destroy(other);
        } else if (rank == 2) {
            atomic_store(&SH->bits[rank][2], sub->topo.shared);
        }
        if (rank < 2) atomic_store(&SH->bits[rank][1], sub->topo.shared);
        xccl_comm_destroy(sub);
    }
    if (!(c->topo.shared & XCCL_SHARED_SEG)) {
        /* forced where it cannot run: refused at the call, nothing posted */
        int32_t          x    = 1;
        xccl_work_t     *w    = NULL;
        xccl_coll_opts_t opts = {.algo = "t_shm"};
        uint64_t         next = c->next_seq;
        CHECK(xccl_allreduce(c, &x, &x, 1, XCCL_INT32, XCCL_OP_SUM, &opts, &w) ==
              XCCL_ERR_INVALID_ARG);
        CHECK(w == NULL && c->next_seq == next && c->shared_posted == 0);
    }
    barrier(c);
    xccl_comm_destroy(c);
    return ctest_failures != 0;
}

/* Whether cross-memory reads work between processes of this user here, as the parent sees it:
 * the call works on our own memory, no Yama restriction beyond what the core lifts (scope 1). */
static int expect_cma(void)
{
    volatile uint64_t src = 42;
    uint64_t          dst = 0;
    struct iovec      l = {&dst, sizeof(dst)}, r = {(void *)&src, sizeof(src)};
    FILE             *f     = fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
    int               scope = 0;

    if (f != NULL) {
        if (fscanf(f, "%d", &scope) != 1) scope = 3;
        fclose(f);
    }
    return process_vm_readv(getpid(), &l, 1, &r, 1, 0) == (ssize_t)sizeof(dst) && dst == src &&
           scope <= 1 && prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 1;
}

static void test_bits(void)
{
    int cma = expect_cma();

    for (int cs = 0; cs < 5; cs++) {
        unsigned want = cs == 0 ? XCCL_SHARED_SEG : cs == 2 ? XCCL_SHARED_SEG : 0;
        if (cs == 0 && cma) want |= XCCL_SHARED_CMA;
        memset(SH, 0, sizeof(*SH));
        snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-shared-%d-bits%d", (int)getpid(),
                 cs);
        unlink(store_path);
        CHECK_MSG(ctest_fork_ranks("bits", 3, child_bits, (void *)(intptr_t)cs) == 0, "case %d",
                  cs);
        unlink(store_path);
        for (int r = 0; r < 3; r++) {
            unsigned b = atomic_load(&SH->bits[r][0]);
            CHECK_MSG(b == atomic_load(&SH->bits[0][0]), "case %d: rank %d has %u, rank 0 %u", cs,
                      r, b, atomic_load(&SH->bits[0][0]));
            CHECK_MSG(b == want, "case %d: rank %d: topo.shared %u, want %u", cs, r, b, want);
        }
        if (cs == 4) { /* {0,1} share host "a"; {1,2} span two hosts */
            CHECK(atomic_load(&SH->bits[0][1]) & XCCL_SHARED_SEG);
            CHECK(atomic_load(&SH->bits[0][1]) == atomic_load(&SH->bits[1][1]));
            CHECK(atomic_load(&SH->bits[1][2]) == 0 && atomic_load(&SH->bits[2][2]) == 0);
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* lifecycle, epochs and grants                                                                */
/* ------------------------------------------------------------------------------------------ */

enum { NSH = 12, NELEM = 16 };

static int32_t val(int which, int k, int r, int i)
{
    return which * 100000 + k * 101 + r * 7 + i;
}

static int child_life(int rank, int size, void *unused)
{
    xccl_comm_t     *c   = mk(rank, size, NULL, 60000), *rev;
    xccl_coll_opts_t shm = {.algo = "t_shm"}, ring = {.algo = "ring"};
    int              order[MAXR];
    int32_t          buf[2][NSH][NELEM], plain[NSH][NELEM];
    xccl_work_t     *w[2][NSH], *pw[NSH];
    int              cma;

    (void)unused;
    if (c == NULL) return 2;
    cma = (c->topo.shared & XCCL_SHARED_CMA) != 0;
    CHECK(c->topo.shared & XCCL_SHARED_SEG);
    pthread_mutex_lock(&c->ctx->lock);
    CHECK(c->shseg == NULL); /* nothing before the first shared collective */
    pthread_mutex_unlock(&c->ctx->lock);
    if (rank == 0) CHECK(seg_names(c) == 0); /* the others may find it made already */

    /* 1. rank 0 alone makes it (its first progress runs at the post); the name stays while
     *    the others have not attached, and goes once they all have */
    for (int i = 0; i < NELEM; i++)
        buf[0][0][i] = val(0, 0, rank, i);
    if (rank == 0) {
        CHECK(xccl_allreduce(c, buf[0][0], buf[0][0], NELEM, XCCL_INT32, XCCL_OP_SUM, &shm,
                             &w[0][0]) == XCCL_OK);
        pthread_mutex_lock(&c->ctx->lock);
        CHECK(c->shseg != NULL);
        pthread_mutex_unlock(&c->ctx->lock);
        CHECK(seg_names(c) == 1);
        atomic_store(&SH->created, 1);
    } else {
        CHECK(wait_flag(&SH->created, 1, 30));
        CHECK(seg_names(c) == 1);
        CHECK(xccl_allreduce(c, buf[0][0], buf[0][0], NELEM, XCCL_INT32, XCCL_OP_SUM, &shm,
                             &w[0][0]) == XCCL_OK);
    }
    CHECK_MSG(xccl_work_wait(w[0][0], 60000) == XCCL_OK, "first: %s", xccl_work_error(w[0][0]));
    for (int i = 0; i < NELEM; i++) {
        int32_t want = 0;
        for (int r = 0; r < size; r++)
            want += val(0, 0, r, i);
        CHECK(buf[0][0][i] == want);
    }
    CHECK(w[0][0]->task.shared_epoch == 1);
    xccl_work_release(w[0][0]);
    barrier(c); /* everybody attached: the last one removed the name */
    CHECK_MSG(seg_names(c) == 0, "rank %d: %d names left", rank, seg_names(c));
    CHECK(seg_mapped_deleted(c));

    /* 2. epochs and grants: shared collectives on two communicators (the world and the same
     *    ranks in reverse order) interleaved with ring all_reduces, all posted before any is
     *    waited for */
    for (int r = 0; r < size; r++)
        order[r] = size - 1 - r;
    CHECK(xccl_comm_split(c, size, order, "rev", &rev) == XCCL_OK);
    CHECK(rev->topo.shared == c->topo.shared);
    for (int k = 0; k < NSH; k++) {
        for (int which = 0; which < 2; which++) {
            xccl_comm_t *cc = which ? rev : c;
            for (int i = 0; i < NELEM; i++)
                buf[which][k][i] = val(which + 1, k, cc->rank, i);
            CHECK(xccl_allreduce(cc, buf[which][k], buf[which][k], NELEM, XCCL_INT32, XCCL_OP_SUM,
                                 &shm, &w[which][k]) == XCCL_OK);
            atomic_store(&SH->epochs[which][rank][k], w[which][k]->task.shared_epoch);
        }
        for (int i = 0; i < NELEM; i++)
            plain[k][i] = val(9, k, rank, i);
        CHECK(xccl_allreduce(c, plain[k], plain[k], NELEM, XCCL_INT32, XCCL_OP_SUM, &ring,
                             &pw[k]) == XCCL_OK);
        CHECK(pw[k]->task.shared_epoch == 0);
    }
    for (int k = NSH - 1; k >= 0; k--) { /* waited for in reverse: the engine drives them all */
        for (int which = 0; which < 2; which++) {
            xccl_comm_t *cc = which ? rev : c;
            int          ok = 1;
            CHECK_MSG(xccl_work_wait(w[which][k], 60000) == XCCL_OK, "op %d/%d: %s", which, k,
                      xccl_work_error(w[which][k]));
            for (int i = 0; i < NELEM; i++) {
                int32_t want = 0;
                for (int r = 0; r < size; r++)
                    want += val(which + 1, k, r, i);
                ok &= buf[which][k][i] == want;
            }
            CHECK_MSG(ok, "op %d on %s: wrong sum", k, cc->name);
            xccl_work_release(w[which][k]);
        }
        CHECK(xccl_work_wait(pw[k], 60000) == XCCL_OK);
        for (int i = 0; i < NELEM; i++) {
            int32_t want = 0;
            for (int r = 0; r < size; r++)
                want += val(9, k, r, i);
            CHECK(plain[k][i] == want);
        }
        xccl_work_release(pw[k]);
    }
    CHECK_MSG(g_grant_bad == 0, "rank %d: %d grants out of order or overlapping", rank,
              g_grant_bad);
    CHECK(c->shared_posted == NSH + 1 && rev->shared_posted == NSH);
    CHECK(seg_names(rev) <= 1); /* gone once all attached; nobody waits for that here */

    /* 3. cross-memory reads: all_gather by t_read, traced */
    if (cma) {
        int32_t            mine[NELEM], out[MAXR * NELEM];
        xccl_coll_opts_t   rd = {.algo = "t_read"};
        xccl_trace_event_t ev[64];
        size_t             nev;
        int                seen[MAXR] = {0};
        xccl_work_t       *g;
        for (int i = 0; i < NELEM; i++)
            mine[i] = val(7, 0, rank, i);
        CHECK(xccl_comm_trace(c, 64) == XCCL_OK);
        CHECK(xccl_allgather(c, mine, out, NELEM, XCCL_INT32, &rd, &g) == XCCL_OK);
        CHECK_MSG(xccl_work_wait(g, 60000) == XCCL_OK, "t_read: %s", xccl_work_error(g));
        xccl_work_release(g);
        for (int r = 0; r < size; r++)
            for (int i = 0; i < NELEM; i++)
                CHECK(out[r * NELEM + i] == val(7, 0, r, i));
        nev = xccl_comm_trace_drain(c, ev, 64);
        for (size_t k = 0; k < nev; k++) {
            if (ev[k].kind != XCCL_TRACE_RECV || strcmp(ev[k].transport, "cma") != 0) continue;
            CHECK(ev[k].dst == rank && ev[k].nbytes == NELEM * 4 && ev[k].buf == 1 &&
                  ev[k].offset == (uint64_t)ev[k].src * NELEM * 4);
            if (ev[k].src >= 0 && ev[k].src < size) seen[ev[k].src]++;
        }
        for (int r = 0; r < size; r++)
            CHECK_MSG(seen[r] == (r != rank),
                      "rank %d: %d reads "
                      "of rank %d traced",
                      rank, seen[r], r);
        CHECK(xccl_comm_trace(c, 0) == XCCL_OK);
    }
    barrier(c);
    CHECK(seg_names(rev) == 0 && seg_names(c) == 0);
    xccl_comm_destroy(rev);
    xccl_comm_destroy(c);
    return ctest_failures != 0;
}

static void test_lifecycle(int size)
{
    memset(SH, 0, sizeof(*SH));
    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-shared-%d-life%d", (int)getpid(),
             size);
    unlink(store_path);
    CHECK_MSG(ctest_fork_ranks("lifecycle", size, child_life, NULL) == 0, "size %d", size);
    unlink(store_path);
    /* epochs: 2, 3, ... on the world (1 was the first one), 1, 2, ... on "rev"; the same on
     * every rank */
    for (int r = 0; r < size; r++) {
        for (int k = 0; k < NSH; k++) {
            CHECK_MSG(atomic_load(&SH->epochs[0][r][k]) == (uint64_t)k + 2 &&
                          atomic_load(&SH->epochs[1][r][k]) == (uint64_t)k + 1,
                      "size %d rank %d op %d: epochs %llu, %llu", size, r, k,
                      (unsigned long long)atomic_load(&SH->epochs[0][r][k]),
                      (unsigned long long)atomic_load(&SH->epochs[1][r][k]));
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* release: a grant passes on after a timeout; abort; destroy removes the name                 */
/* ------------------------------------------------------------------------------------------ */

static int child_release(int rank, int size, void *unused)
{
    xccl_comm_t *c       = mk(rank, size, NULL, 60000), *pair, *pair2;
    int          both[2] = {0, 1};

    (void)unused;
    if (c == NULL) return 2;
    CHECK(xccl_comm_split(c, 2, both, "pair", &pair) == XCCL_OK);
    CHECK(xccl_comm_split(c, 2, both, "pair2", &pair2) == XCCL_OK);
    if (rank == 0) { /* rank 1 never calls on these */
        int32_t          x[2][4] = {{1, 2, 3, 4}, {5, 6, 7, 8}}, y = 1;
        xccl_coll_opts_t a = {.algo = "t_shm", .timeout_ms = 400};
        xccl_coll_opts_t b = {.algo = "t_shm", .timeout_ms = 1500};
        xccl_work_t     *wa, *wb, *wc;
        char             pid1[32];
        double           t0 = now_s();
        snprintf(pid1, sizeof(pid1), "rank 1 (pid %d)", (int)c->ctx->peers[1].pid);
        CHECK(xccl_allreduce(pair, x[0], x[0], 4, XCCL_INT32, XCCL_OP_SUM, &a, &wa) == XCCL_OK);
        CHECK(xccl_allreduce(pair, x[1], x[1], 4, XCCL_INT32, XCCL_OP_SUM, &b, &wb) == XCCL_OK);
        CHECK(wa->task.shared_epoch == 1 && wb->task.shared_epoch == 2);
        CHECK(seg_names(pair) == 1); /* rank 1 never attached */
        CHECK(xccl_work_wait(wa, 30000) == XCCL_ERR_TIMEOUT);
        show("timeout A", wa);
        CHECK_MSG(strstr(xccl_work_error(wa), pid1) != NULL &&
                      strstr(xccl_work_error(wa), "to write the node-shared segment (epoch 1)"),
                  "A: %s", xccl_work_error(wa));
        CHECK(xccl_work_wait(wb, 30000) == XCCL_ERR_TIMEOUT);
        show("timeout B", wb);
        /* granted after A timed out: it waited for rank 1's writes, not for its turn (the
         * first line; the table after it may be the one collected for A) */
        {
            char        first[512];
            const char *nl = strchr(xccl_work_error(wb), '\n');
            size_t      n  = nl ? (size_t)(nl - xccl_work_error(wb)) : strlen(xccl_work_error(wb));
            snprintf(first, sizeof(first), "%.*s", (int)n, xccl_work_error(wb));
            CHECK_MSG(strstr(first, pid1) != NULL &&
                          strstr(first, "to write the node-shared segment (epoch 2)") &&
                          !strstr(first, "its turn"),
                      "B: %s", xccl_work_error(wb));
        }
        CHECK(now_s() - t0 < 15);
        xccl_work_release(wa);
        xccl_work_release(wb);
        /* abort fails the holder; its grant ends with it */
        CHECK(xccl_allreduce(pair2, &y, &y, 1, XCCL_INT32, XCCL_OP_SUM, &a, &wc) == XCCL_OK);
        xccl_comm_abort(pair2);
        CHECK(xccl_work_wait(wc, 30000) == XCCL_ERR_ABORTED);
        xccl_work_release(wc);
        {
            uint64_t job = c->ctx->job_id, id = xccl_comm_id(pair);
            CHECK(seg_names_of(job, id) == 1);
            xccl_comm_destroy(pair); /* rank 0 removes the name nobody else will */
            CHECK(seg_names_of(job, id) == 0);
        }
    } else {
        xccl_comm_destroy(pair);
    }
    xccl_comm_destroy(pair2);
    barrier(c);
    xccl_comm_destroy(c);
    return ctest_failures != 0;
}

/* ------------------------------------------------------------------------------------------ */
/* dead: a rank killed while the others wait for its flags                                      */
/* ------------------------------------------------------------------------------------------ */

static int run_with_victim(const char *what, int size, int victim, int (*child)(int, int, void *))
{
    pid_t pids[MAXR];
    int   failed = 0;

    fflush(NULL);
    for (int r = 0; r < size; r++) {
        pids[r] = fork();
        if (pids[r] == 0) _exit(child(r, size, NULL));
    }
    for (int r = 0; r < size; r++) {
        int status = 0;
        if (r == victim) continue;
        waitpid(pids[r], &status, 0);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "%s: rank %d failed (status 0x%x)\n", what, r, status);
            failed++;
        }
    }
    return failed;
}

static int child_dead(int rank, int size, void *unused)
{
    xccl_comm_t     *c    = mk(rank, size, NULL, 60000);
    xccl_coll_opts_t shm  = {.algo = "t_shm"};
    int32_t          x[4] = {rank, rank, rank, rank};
    xccl_work_t     *w;
    char             want[32];
    double           t0;
    xccl_status_t    st;

    (void)unused;
    if (c == NULL) return 2;
    CHECK(xccl_allreduce(c, x, x, 4, XCCL_INT32, XCCL_OP_SUM, &shm, &w) == XCCL_OK);
    CHECK(xccl_work_wait(w, 60000) == XCCL_OK);
    xccl_work_release(w);
    barrier(c);
    if (rank == size - 1) {
        /* die without a word, the others waiting on our flags */
        atomic_store(&SH->ready[0], 1);
        kill(getpid(), SIGKILL);
    }
    snprintf(want, sizeof(want), "rank %d (pid %d)", size - 1, (int)c->ctx->peers[size - 1].pid);
    CHECK(wait_flag(&SH->ready[0], 1, 30));
    t0 = now_s();
    CHECK(xccl_allreduce(c, x, x, 4, XCCL_INT32, XCCL_OP_SUM, &shm, &w) == XCCL_OK);
    st = xccl_work_wait(w, 60000);
    CHECK_MSG(st == XCCL_ERR_REMOTE, "status %d: %s", st, xccl_work_error(w));
    CHECK_MSG(strstr(xccl_work_error(w), want) != NULL, "error: %s", xccl_work_error(w));
    CHECK_MSG(now_s() - t0 < 5.0, "noticed after %.1f s", now_s() - t0);
    if (verbose) fprintf(stderr, "[dead] after %.3f s\n", now_s() - t0);
    show("dead", w);
    xccl_work_release(w);
    CHECK(seg_names(c) == 0);
    xccl_comm_abort(c);
    xccl_comm_destroy(c);
    return ctest_failures != 0;
}

/* ------------------------------------------------------------------------------------------ */
/* peer_read errors                                                                            */
/* ------------------------------------------------------------------------------------------ */

/* Drops CAP_SYS_PTRACE from this process's effective set; 0 on success. */
static int drop_ptrace_cap(void)
{
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct   d[2];

    if (syscall(SYS_capget, &h, d) != 0) return -1;
    d[CAP_SYS_PTRACE / 32].effective &= ~(1u << (CAP_SYS_PTRACE % 32));
    return (int)syscall(SYS_capset, &h, d);
}

/* mode 1: EFAULT; mode 3: EPERM (rank 1 is not dumpable, rank 0 has no CAP_SYS_PTRACE) */
static int child_read(int rank, int size, void *arg)
{
    int              mode    = (int)(intptr_t)arg;
    xccl_comm_t     *c       = mk(rank, size, NULL, 60000);
    xccl_coll_opts_t rd      = {.algo = "t_read", .timeout_ms = 20000};
    int32_t          mine[4] = {rank, rank, rank, rank}, out[MAXR * 4];
    xccl_work_t     *w;
    xccl_status_t    st;

    if (c == NULL) return 2;
    if (!(c->topo.shared & XCCL_SHARED_CMA)) {
        xccl_comm_destroy(c);
        return 0;
    }
    if (mode == 3) {
        if (rank == 1) CHECK(prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0);
        if (rank == 0 && drop_ptrace_cap() != 0) { /* cannot stage it: a normal run */
            printf("test_shared: cannot drop CAP_SYS_PTRACE: the EPERM case is not run\n");
            mode = 0;
        }
    }
    if (mode == 1 && rank == 0) g_read_mode = 1;
    barrier(c);
    CHECK(xccl_allgather(c, mine, out, 4, XCCL_INT32, &rd, &w) == XCCL_OK);
    st = xccl_work_wait(w, 30000);
    show(mode == 1 ? "efault" : mode == 3 ? "eperm" : "read", w);
    if (mode == 1 && rank == 0) {
        CHECK_MSG(st == XCCL_ERR_SYSTEM && strstr(xccl_work_error(w), "bad address") &&
                      strstr(xccl_work_error(w), "of rank 1") && strstr(xccl_work_error(w), "0x40"),
                  "EFAULT: %d %s", st, xccl_work_error(w));
    } else if (mode == 3 && rank == 0) {
        CHECK_MSG(st == XCCL_ERR_SYSTEM && strstr(xccl_work_error(w), "EPERM") &&
                      strstr(xccl_work_error(w), "XCCL_SHARED_CMA=0") &&
                      strstr(xccl_work_error(w), "rank 1"),
                  "EPERM: %d %s", st, xccl_work_error(w));
    } else if (mode == 0) {
        CHECK_MSG(st == XCCL_OK, "%s", xccl_work_error(w));
    } else {
        /* the others wait for rank 0, which failed: it told them */
        CHECK_MSG(st == XCCL_ERR_REMOTE && strstr(xccl_work_error(w), "rank 0 reported"),
                  "rank %d: status %d: %s", rank, st, xccl_work_error(w));
    }
    xccl_work_release(w);
    xccl_comm_abort(c);
    xccl_comm_destroy(c);
    return ctest_failures != 0;
}

/* ESRCH: rank 2 publishes its buffer and exits; the others read once the parent reaped it. */
static int child_esrch(int rank, int size, void *unused)
{
    xccl_comm_t     *c       = mk(rank, size, NULL, 60000);
    xccl_coll_opts_t rd      = {.algo = "t_read"};
    int32_t          mine[4] = {rank, rank, rank, rank}, out[MAXR * 4];
    xccl_work_t     *w;
    xccl_status_t    st;

    (void)unused;
    if (c == NULL) return 2;
    if (!(c->topo.shared & XCCL_SHARED_CMA)) {
        atomic_store(&SH->ready[1], 1);
        xccl_comm_destroy(c);
        return 0;
    }
    g_read_mode = 2;
    CHECK(xccl_allgather(c, mine, out, 4, XCCL_INT32, &rd, &w) == XCCL_OK);
    if (rank == 2) { /* leaves once its address is published */
        double end = now_s() + 30;
        while (atomic_load(&g_published) == 0 && now_s() < end)
            (void)xccl_work_test(w);
        _exit(atomic_load(&g_published) ? 0 : 3);
    }
    st = xccl_work_wait(w, 30000);
    show("esrch", w);
    CHECK_MSG(st == XCCL_ERR_REMOTE && strstr(xccl_work_error(w), "rank 2 (pid") &&
                  strstr(xccl_work_error(w), "exited"),
              "ESRCH: %d %s", st, xccl_work_error(w));
    xccl_work_release(w);
    xccl_comm_abort(c);
    xccl_comm_destroy(c);
    return ctest_failures != 0;
}

static void test_peer_read(void)
{
    pid_t pids[3];
    int   failed = 0;

    for (int mode = 1; mode <= 3; mode += 2) {
        memset(SH, 0, sizeof(*SH));
        snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-shared-%d-read%d", (int)getpid(),
                 mode);
        unlink(store_path);
        CHECK_MSG(ctest_fork_ranks("peer_read", 3, child_read, (void *)(intptr_t)mode) == 0,
                  "mode %d", mode);
        unlink(store_path);
    }
    /* ESRCH: the parent reaps rank 2 before the others read */
    memset(SH, 0, sizeof(*SH));
    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-shared-%d-esrch", (int)getpid());
    unlink(store_path);
    fflush(NULL);
    for (int r = 0; r < 3; r++) {
        pids[r] = fork();
        if (pids[r] == 0) _exit(child_esrch(r, 3, NULL));
    }
    for (int r = 2; r >= 0; r--) {
        int status = 0;
        waitpid(pids[r], &status, 0);
        if (r == 2) atomic_store(&SH->dead, 1);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "esrch: rank %d failed (status 0x%x)\n", r, status);
            failed++;
        }
    }
    CHECK(failed == 0);
    unlink(store_path);
}

/* ------------------------------------------------------------------------------------------ */
/* sweep                                                                                       */
/* ------------------------------------------------------------------------------------------ */

static int child_plain(int rank, int size, void *unused)
{
    xccl_comm_t *c = mk(rank, size, NULL, 60000);

    (void)unused;
    if (c == NULL) return 2;
    barrier(c);
    xccl_comm_destroy(c);
    return ctest_failures != 0;
}

static int exists(const char *name)
{
    char        path[128];
    struct stat st;
    snprintf(path, sizeof(path), "/dev/shm%s", name);
    return stat(path, &st) == 0;
}

static void test_sweep(void)
{
    char         stale[96], locked[96], fresh[96];
    pid_t        gone = fork();
    int          fd, lfd;
    struct flock fl;

    if (gone == 0) _exit(0);
    waitpid(gone, NULL, 0); /* a pid nobody has now */
    snprintf(stale, sizeof(stale), "/xcclseg-%016llx-%016llx-%d", 0xdeadull,
             (unsigned long long)getpid(), (int)gone);
    snprintf(locked, sizeof(locked), "/xcclseg-%016llx-%016llx-%d", 0xbeefull, 1ull, (int)gone);
    snprintf(fresh, sizeof(fresh), "/xcclseg-%016llx-%016llx-%d", 0xf00dull, 2ull, (int)getpid());
    fd = shm_open(stale, O_RDWR | O_CREAT | O_EXCL, 0600);
    CHECK(fd >= 0);
    close(fd);
    lfd = shm_open(locked, O_RDWR | O_CREAT | O_EXCL, 0600); /* its "creator" holds the lock */
    CHECK(lfd >= 0);
    memset(&fl, 0, sizeof(fl));
    fl.l_type   = F_WRLCK;
    fl.l_whence = SEEK_SET;
    CHECK(fcntl(lfd, F_OFD_SETLK, &fl) == 0);
    fd = shm_open(fresh, O_RDWR | O_CREAT | O_EXCL, 0600); /* a live creator, just made */
    CHECK(fd >= 0);
    close(fd);
    memset(SH, 0, sizeof(*SH));
    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-shared-%d-sweep", (int)getpid());
    unlink(store_path);
    CHECK(ctest_fork_ranks("sweep", 2, child_plain, NULL) == 0);
    unlink(store_path);
    CHECK_MSG(!exists(stale), "%s is still there", stale);
    CHECK_MSG(exists(locked), "%s (locked) was removed", locked);
    CHECK_MSG(exists(fresh), "%s (fresh, live creator) was removed", fresh);
    shm_unlink(locked);
    shm_unlink(fresh);
    shm_unlink(stale);
    close(lfd);
}

int main(void)
{
    verbose = getenv("TEST_SHARED_VERBOSE") != NULL;
    setenv("XCCL_DIAG_WAIT_MS", "200", 1);
    unsetenv("XCCL_SHARED");
    unsetenv("XCCL_SHARED_CMA");
    unsetenv("XCCL_TRANSPORTS");
    test_policy              = *xccl_core_policy;
    test_policy.select       = t_select;
    test_policy.shared_bytes = t_shared_bytes;
    xccl_core_policy         = &test_policy;
    SH = mmap(NULL, sizeof(*SH), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (SH == MAP_FAILED) return 1;

    test_sweep();
    test_bits();
    test_lifecycle(2);
    test_lifecycle(4);
    memset(SH, 0, sizeof(*SH));
    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-shared-%d-release", (int)getpid());
    unlink(store_path);
    CHECK(ctest_fork_ranks("release", 2, child_release, NULL) == 0);
    unlink(store_path);
    memset(SH, 0, sizeof(*SH));
    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-shared-%d-dead", (int)getpid());
    unlink(store_path);
    CHECK(run_with_victim("dead", 3, 2, child_dead) == 0);
    unlink(store_path);
    if (expect_cma())
        test_peer_read();
    else
        printf("test_shared: no process_vm_readv here: peer_read cases skipped\n");
    CTEST_MAIN_END("test_shared");
}
