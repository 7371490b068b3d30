/* SPDX-License-Identifier: Apache-2.0
 *
 * test_algo_device.c - every algorithm of every collective on "device" memory: the buffers
 * and scratch belong to the fake device executor of fake_dev.h (asynchronous, PROT_NONE
 * outside executor calls), run on the simulator (sim.c). An algorithm that touches operation
 * memory directly crashes; one that relies on a copy or reduction having finished when it
 * was issued sends or keeps wrong data. Results are compared with values computed here.
 */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "algo/algo.h"
#include "algo/patterns.h"
#include "ctest.h"
#include "fake_dev.h"
#include "sim.h"

#define MAXN 8

static const int    sizes[]  = {1, 2, 3, 4, 5, 7, 8};
static const size_t counts[] = {0, 1, 37, 1000};
static uint64_t     seed     = 1;

/* What rank r contributes at element i (of its whole send buffer). */
static int32_t val(int r, size_t i) { return (int32_t)((r + 1) * 1000 + (int)(i % 997)); }

static int32_t combined(xccl_op_t op, int n, size_t i)
{
    int32_t acc = val(0, i);
    for (int r = 1; r < n; r++) acc = op == XCCL_OP_MAX ? (val(r, i) > acc ? val(r, i) : acc)
                                                        : acc + val(r, i);
    return acc;
}

/* all-to-all(v): what rank `from` sends rank `to` at element i of that block */
static int32_t pair_val(int from, int to, size_t i)
{
    return (int32_t)((from * 16 + to) * 1000 + (int)(i % 997));
}

/* all-to-all-v: elements from `from` to `to`, uneven and sometimes none */
static size_t vcount(int from, int to, size_t count)
{
    return (size_t)((from + 2 * to) % 3) * count / 2;
}

/* Device buffers of the case, freed together. */
static void  *owned[4 * MAXN + 4];
static size_t nowned;

static int32_t *dev(size_t elems)
{
    void *p = fdev_alloc(elems * sizeof(int32_t));
    if (p == NULL) {
        fprintf(stderr, "test_algo_device: out of memory\n");
        exit(2);
    }
    owned[nowned++] = p;
    return p;
}

static void free_owned(void)
{
    while (nowned > 0) fdev_free(owned[--nowned]);
}

static void transfer_access(int open) { fdev_open(open); }

typedef struct vlayout {
    size_t sc[MAXN][MAXN], sd[MAXN][MAXN], rc[MAXN][MAXN], rd[MAXN][MAXN];
    size_t stotal[MAXN], rtotal[MAXN];
} vlayout_t;

/* Displacements leave one unused element after every block. */
static void vlayout_init(vlayout_t *v, int n, size_t count)
{
    for (int r = 0; r < n; r++) {
        size_t s = 0, d = 0;
        for (int j = 0; j < n; j++) {
            v->sc[r][j] = vcount(r, j, count);
            v->sd[r][j] = s;
            s += v->sc[r][j] + 1;
            v->rc[r][j] = vcount(j, r, count);
            v->rd[r][j] = d;
            d += v->rc[r][j] + 1;
        }
        v->stotal[r] = s;
        v->rtotal[r] = d;
    }
}

static void run_case(const xccl_algo_t *algo, int n, size_t count, int root, xccl_op_t op)
{
    static const int node_of[MAXN] = {0, 0, 1, 1, 2, 2, 3, 3};
    xccl_topo_t      topo           = {.nnodes = (n + 1) / 2, .node_of = node_of};
    xccl_coll_args_t args[MAXN];
    int32_t         *s[MAXN] = {0}, *rb[MAXN] = {0};
    vlayout_t        v;
    sim_opts_t       opts = {.seed = seed++, .transfer_access = transfer_access};
    sim_result_t     res;
    xccl_status_t    st;
    size_t           blk = count, bad = 0;
    char             what[200];

    snprintf(what, sizeof(what), "%s %s n=%d count=%zu root=%d op=%d", xccl_coll_name(algo->coll),
             algo->name, n, count, root, (int)op);
    fdev_open(1);
    for (int r = 0; r < n; r++) {
        args[r] = (xccl_coll_args_t){.coll   = algo->coll,
                                     .count  = count,
                                     .dtype  = XCCL_INT32,
                                     .elsize = sizeof(int32_t),
                                     .op     = op,
                                     .root   = root,
                                     .topo   = &topo,
                                     .mem    = XCCL_MEM_CUDA};
        switch (algo->coll) {
        case XCCL_COLL_ALLREDUCE:
            s[r] = dev(count);
            for (size_t i = 0; i < count; i++) s[r][i] = val(r, i);
            args[r].sbuf = args[r].rbuf = s[r];
            break;
        case XCCL_COLL_BROADCAST:
            s[r] = dev(count);
            for (size_t i = 0; r == root && i < count; i++) s[r][i] = val(r, i);
            args[r].sbuf = args[r].rbuf = s[r];
            break;
        case XCCL_COLL_REDUCE:
            s[r] = dev(count);
            for (size_t i = 0; i < count; i++) s[r][i] = val(r, i);
            if (r == root) rb[r] = dev(count);
            args[r].sbuf = s[r];
            args[r].rbuf = rb[r];
            break;
        case XCCL_COLL_ALLGATHER:
            rb[r] = dev((size_t)n * count);
            for (size_t i = 0; i < count; i++) rb[r][(size_t)r * blk + i] = val(r, i);
            args[r].sbuf = rb[r] + (size_t)r * blk;
            args[r].rbuf = rb[r];
            break;
        case XCCL_COLL_GATHER:
            if (r == root) {
                rb[r] = dev((size_t)n * count);
                for (size_t i = 0; i < count; i++) rb[r][(size_t)r * blk + i] = val(r, i);
                args[r].sbuf = rb[r] + (size_t)r * blk;
            } else {
                s[r] = dev(count);
                for (size_t i = 0; i < count; i++) s[r][i] = val(r, i);
                args[r].sbuf = s[r];
            }
            args[r].rbuf = rb[r];
            break;
        case XCCL_COLL_SCATTER:
            rb[r] = dev(count);
            if (r == root) {
                s[r] = dev((size_t)n * count);
                for (int b = 0; b < n; b++)
                    for (size_t i = 0; i < count; i++) s[r][(size_t)b * blk + i] = val(b, i);
                for (size_t i = 0; i < count; i++) rb[r][i] = val(r, i);
            }
            args[r].sbuf = s[r];
            args[r].rbuf = rb[r];
            break;
        case XCCL_COLL_REDUCE_SCATTER:
            s[r]  = dev((size_t)n * count);
            rb[r] = dev(count);
            for (size_t i = 0; i < (size_t)n * count; i++) s[r][i] = val(r, i);
            args[r].sbuf = s[r];
            args[r].rbuf = rb[r];
            break;
        case XCCL_COLL_ALLTOALL:
            s[r]  = dev((size_t)n * count);
            rb[r] = dev((size_t)n * count);
            for (int j = 0; j < n; j++)
                for (size_t i = 0; i < count; i++) s[r][(size_t)j * blk + i] = pair_val(r, j, i);
            for (size_t i = 0; i < count; i++) rb[r][(size_t)r * blk + i] = pair_val(r, r, i);
            args[r].sbuf = s[r];
            args[r].rbuf = rb[r];
            break;
        case XCCL_COLL_ALLTOALLV:
            if (r == 0) vlayout_init(&v, n, count);
            s[r]  = dev(v.stotal[r]);
            rb[r] = dev(v.rtotal[r]);
            for (int j = 0; j < n; j++)
                for (size_t i = 0; i < v.sc[r][j]; i++) s[r][v.sd[r][j] + i] = pair_val(r, j, i);
            for (size_t i = 0; i < v.sc[r][r]; i++) rb[r][v.rd[r][r] + i] = pair_val(r, r, i);
            args[r].sbuf    = s[r];
            args[r].rbuf    = rb[r];
            args[r].scounts = v.sc[r];
            args[r].sdispls = v.sd[r];
            args[r].rcounts = v.rc[r];
            args[r].rdispls = v.rd[r];
            break;
        default: break;
        }
    }
    fdev_open(0);
    st = sim_run(algo, n, args, &opts, &res);
    CHECK_MSG(st == XCCL_OK, "%s: %s", what, res.error);
    CHECK_MSG(fdev.live == 0, "%s: %zu executor events never released", what, fdev.live);
    fdev_open(1);
    for (int r = 0; st == XCCL_OK && r < n; r++) {
        switch (algo->coll) {
        case XCCL_COLL_ALLREDUCE:
            for (size_t i = 0; i < count; i++) bad += s[r][i] != combined(op, n, i);
            break;
        case XCCL_COLL_BROADCAST:
            for (size_t i = 0; i < count; i++) bad += s[r][i] != val(root, i);
            break;
        case XCCL_COLL_REDUCE:
            for (size_t i = 0; i < count; i++) bad += s[r][i] != val(r, i); /* read-only */
            for (size_t i = 0; r == root && i < count; i++)
                bad += rb[r][i] != combined(op, n, i);
            break;
        case XCCL_COLL_ALLGATHER:
            for (int b = 0; b < n; b++)
                for (size_t i = 0; i < count; i++) bad += rb[r][(size_t)b * blk + i] != val(b, i);
            break;
        case XCCL_COLL_GATHER:
            for (int b = 0; r == root && b < n; b++)
                for (size_t i = 0; i < count; i++) bad += rb[r][(size_t)b * blk + i] != val(b, i);
            break;
        case XCCL_COLL_SCATTER:
            for (size_t i = 0; i < count; i++) bad += rb[r][i] != val(r, i);
            break;
        case XCCL_COLL_REDUCE_SCATTER:
            for (size_t i = 0; i < (size_t)n * count; i++) bad += s[r][i] != val(r, i);
            for (size_t i = 0; i < count; i++)
                bad += rb[r][i] != combined(op, n, (size_t)r * count + i);
            break;
        case XCCL_COLL_ALLTOALL:
            for (int q = 0; q < n; q++)
                for (size_t i = 0; i < count; i++) {
                    bad += rb[r][(size_t)q * blk + i] != pair_val(q, r, i);
                    bad += s[r][(size_t)q * blk + i] != pair_val(r, q, i);
                }
            break;
        case XCCL_COLL_ALLTOALLV:
            for (int q = 0; q < n; q++)
                for (size_t i = 0; i < v.rc[r][q]; i++)
                    bad += rb[r][v.rd[r][q] + i] != pair_val(q, r, i);
            break;
        default: break;
        }
    }
    CHECK_MSG(bad == 0, "%s: %zu wrong elements", what, bad);
    sim_result_free(&res);
    free_owned();
    fdev_open(0);
}

static int algos_run;

static void sweep(void)
{
    for (int c = 0; c < XCCL_COLL_COUNT; c++) {
        const xccl_algo_t *const *list = xccl_algo_list((xccl_coll_t)c);
        for (size_t k = 0; list[k] != NULL; k++) {
            const xccl_algo_t *a   = list[k];
            int                ran = 0;
            if (a->shared) continue; /* one-host algorithms move host memory only */
            for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
                int n = sizes[si];
                for (size_t ci = 0; ci < sizeof(counts) / sizeof(counts[0]); ci++) {
                    xccl_coll_args_t probe = {.coll = a->coll, .count = counts[ci],
                                              .dtype = XCCL_INT32, .elsize = 4};
                    if (a->applicable != NULL && !a->applicable(&probe, n)) continue;
                    int rooted = c == XCCL_COLL_BROADCAST || c == XCCL_COLL_REDUCE ||
                                 c == XCCL_COLL_GATHER || c == XCCL_COLL_SCATTER;
                    int reducing = c == XCCL_COLL_ALLREDUCE || c == XCCL_COLL_REDUCE ||
                                   c == XCCL_COLL_REDUCE_SCATTER;
                    run_case(a, n, counts[ci], 0, XCCL_OP_SUM);
                    ran += n > 1 && counts[ci] > 0;
                    if (rooted && n > 1) run_case(a, n, counts[ci], n - 1, XCCL_OP_SUM);
                    if (reducing && counts[ci] > 1)
                        run_case(a, n, counts[ci], n / 2, XCCL_OP_MAX);
                }
            }
            CHECK_MSG(ran > 0 || c == XCCL_COLL_BARRIER, "%s %s never ran on several ranks",
                      xccl_coll_name(a->coll), a->name);
            algos_run++;
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * The ordering contract on its own, with hand-written algorithms
 * ------------------------------------------------------------------------------------------- */

/* Rank 0 computes x = a + b into scratch and sends it at once; rank 1 receives it into its
 * rbuf. The send must wait for the reduction (held), and the first test must say so. */
static int saw_inprogress;

static xccl_status_t reduce_send_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    uint64_t               *s = xccl_task_state(t);
    xccl_status_t           st;

    if (s[0]++ == 0) {
        if (xccl_task_rank(t) == 0) {
            char *x = xccl_task_scratch(t, a->count * a->elsize);
            if (x == NULL) return XCCL_ERR_NO_MEMORY;
            XCCL_CHECK(xccl_task_reduce(t, x, a->sbuf, a->sbuf, a->count));
            XCCL_CHECK(xccl_task_isend(t, 1, x, a->count * a->elsize, 0));
            saw_inprogress += xccl_task_test(t) == XCCL_INPROGRESS && xccl_task_pending(t) == 1;
        } else {
            XCCL_CHECK(xccl_task_irecv(t, 0, a->rbuf, a->count * a->elsize, 0));
        }
    }
    st = xccl_task_test(t);
    if (st != XCCL_OK) return st;
    /* completes with its last copy unfinished: the operation ends when it does */
    if (xccl_task_rank(t) == 1)
        XCCL_CHECK(xccl_task_copy(t, (char *)a->rbuf + a->count * a->elsize, a->rbuf,
                                  a->count * a->elsize));
    return XCCL_OK;
}

static void test_ordering(void)
{
    const xccl_algo_t algo = {.name = "reduce-send", .coll = XCCL_COLL_ALLREDUCE,
                              .progress = reduce_send_progress};
    xccl_coll_args_t  args[2];
    sim_opts_t        opts = {.seed = 7, .transfer_access = transfer_access};
    sim_result_t      res;
    size_t            count = 100, bad = 0;
    int32_t          *in, *out;
    xccl_status_t     st;

    fdev_open(1);
    in  = dev(count);
    out = dev(2 * count);
    for (size_t i = 0; i < count; i++) in[i] = val(0, i);
    fdev_open(0);
    for (int r = 0; r < 2; r++)
        args[r] = (xccl_coll_args_t){.coll = XCCL_COLL_ALLREDUCE, .sbuf = in, .rbuf = out,
                                     .count = count, .dtype = XCCL_INT32, .elsize = 4,
                                     .op = XCCL_OP_SUM, .mem = XCCL_MEM_CUDA};
    args[0].rbuf = NULL;
    saw_inprogress = 0;
    st = sim_run(&algo, 2, args, &opts, &res);
    CHECK_MSG(st == XCCL_OK, "reduce-send: %s", res.error);
    CHECK(saw_inprogress == 1);
    fdev_open(1);
    for (size_t i = 0; i < 2 * count; i++) bad += out[i] != 2 * val(0, i % count);
    CHECK_MSG(bad == 0, "reduce-send: %zu wrong elements", bad);
    fdev_open(0);
    sim_result_free(&res);
    free_owned();
}

/* An algorithm that reads operation memory itself must crash on the fake device: proves
 * that the sweep above would catch one. */
static xccl_status_t direct_progress(xccl_task_t *t)
{
    const xccl_coll_args_t *a = xccl_task_args(t);
    volatile const char    *p = a->sbuf;
    return p[0] == 0x5A ? XCCL_OK : XCCL_OK;
}

static void test_protection(void)
{
    const xccl_algo_t algo = {.name = "direct", .coll = XCCL_COLL_ALLREDUCE,
                              .progress = direct_progress};
    pid_t             pid;
    int               status = 0;

    fflush(NULL);
    pid = fork();
    if (pid == 0) {
        xccl_coll_args_t args[1];
        sim_result_t     res;
        int32_t         *b = dev(4);
        args[0] = (xccl_coll_args_t){.coll = XCCL_COLL_ALLREDUCE, .sbuf = b, .rbuf = b,
                                     .count = 4, .dtype = XCCL_INT32, .elsize = 4,
                                     .op = XCCL_OP_SUM, .mem = XCCL_MEM_CUDA};
        signal(SIGSEGV, SIG_DFL);
        if (freopen("/dev/null", "w", stderr) == NULL) _exit(3); /* a sanitizer's report */
        (void)sim_run(&algo, 1, args, NULL, &res);
        _exit(0);
    }
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
    /* killed by SIGSEGV, or (under AddressSanitizer, which catches it) exited with an error */
    CHECK_MSG((WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV) ||
                  (WIFEXITED(status) && WEXITSTATUS(status) != 0 && WEXITSTATUS(status) != 3),
              "status %d", status);
}

static void test_no_executor(void)
{
    const xccl_exec_ops_t *old = xccl_exec_set_for_test(XCCL_MEM_CUDA, NULL);
    xccl_coll_args_t       args[1];
    sim_result_t           res;
    int32_t                b[4] = {1, 2, 3, 4};

    args[0] = (xccl_coll_args_t){.coll = XCCL_COLL_ALLREDUCE, .sbuf = b, .rbuf = b, .count = 4,
                                 .dtype = XCCL_INT32, .elsize = 4, .op = XCCL_OP_SUM,
                                 .mem = XCCL_MEM_CUDA};
    CHECK(sim_run(xccl_algo_list(XCCL_COLL_ALLREDUCE)[0], 1, args, NULL, &res) ==
          XCCL_ERR_NOT_SUPPORTED);
    sim_result_free(&res);
    xccl_exec_set_for_test(XCCL_MEM_CUDA, old);
}

int main(void)
{
    unsetenv("XCCL_ALGO");
    unsetenv(XCCL_PAT_RING_CHUNK_ENV);
    unsetenv(XCCL_PAT_OWNER_CHUNK_ENV);
    CHECK(xccl_exec_for(XCCL_MEM_CUDA) == NULL); /* no device executor in this process */
    CHECK(xccl_exec_set_for_test(XCCL_MEM_CUDA, &fdev_ops) == NULL);
    CHECK(xccl_exec_for(XCCL_MEM_CUDA) == &fdev_ops);
    test_protection();
    test_ordering();
    test_no_executor();
    sweep();
    /* pipelined schedules: many chunks, so many copies and reductions in flight at once */
    setenv(XCCL_PAT_RING_CHUNK_ENV, "64", 1);
    setenv(XCCL_PAT_OWNER_CHUNK_ENV, "64", 1);
    sweep();
    CHECK_MSG(fdev.queued > 0 && fdev.ran == fdev.queued, "queued %zu, ran %zu", fdev.queued,
              fdev.ran);
    printf("test_algo_device: %d algorithms (twice), %zu device operations\n", algos_run,
           fdev.queued);
    CTEST_MAIN_END("test_algo_device");
}
