/* SPDX-License-Identifier: Apache-2.0
 *
 * test_exec.c - collectives on a memory type served by a test executor, end to end through
 * the public API: forked ranks over the real transports run every algorithm of every
 * collective with opts.mem = XCCL_MEM_CUDA served by the fake asynchronous executor of
 * fake_dev.h (its memory left accessible: the transports read it), including the core's
 * prologue and epilogue (in-place copies, PREMUL_SUM scaling, AVG division). Also: a memory
 * type without an executor fails before any byte moves, and a failing executor fails the
 * operation with its error.
 *
 * The built-in transports move host memory only, and the core refuses to hand them anything
 * else. The ranks therefore talk through "devtcp", a transport registered at run time that
 * declares XCCL_TP_CAP_CUDA_MEM and wraps tcp: the fake device memory is host memory, so it
 * hands tcp every buffer as host memory, in both directions, and counts the device buffers it
 * saw (which proves that the core chose the transport by memory type and passed the type on).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "algo/algo.h"
#include "core/check.h"
#include "ctest.h"
#include "fake_dev.h"
#include "tp_wrap.h"
#include "xccl/xccl.h"
#include "xccl/xccl_transport.h"

/* ---- devtcp: tcp that accepts the fake device memory ------------------------------------- */

struct xccl_tp_ctx {
    tpw_t w; /* the wrapped tcp and the upcall shim (tp_wrap.h) */
};

static struct {
    uint64_t dev_sends, dev_recvs;
} devtcp;

static xccl_status_t d_recv_match(void *core, int peer, const xccl_msg_hdr_t *hdr,
                                  xccl_tp_buf_t *dst, void **cookie)
{
    xccl_status_t st = tpw_up_recv_match(core, peer, hdr, dst, cookie);

    if (st == XCCL_OK && dst->mem == XCCL_MEM_CUDA) {
        devtcp.dev_recvs++;
        dst->mem = XCCL_MEM_HOST;
    }
    return st;
}

static xccl_status_t d_init(const xccl_tp_init_params_t *params, xccl_tp_ctx_t **out)
{
    static const xccl_tp_upcalls_t shim = {.recv_match = d_recv_match};

    return tpw_init(params, out, sizeof(xccl_tp_ctx_t), "tcp", &shim);
}

static xccl_status_t d_isend(xccl_tp_ctx_t *c, int peer, const xccl_msg_hdr_t *hdr,
                             const xccl_tp_buf_t *buf, void *cookie)
{
    xccl_tp_buf_t host = *buf;

    if (buf->mem == XCCL_MEM_CUDA) devtcp.dev_sends++;
    host.mem = XCCL_MEM_HOST;
    return tpw_isend(c, peer, hdr, &host, cookie);
}

static const xccl_transport_ops_t devtcp_ops = {
    .abi_version = XCCL_TRANSPORT_ABI_VERSION,
    .name        = "devtcp",
    .caps        = XCCL_TP_CAP_HOST_MEM | XCCL_TP_CAP_CUDA_MEM,
    .priority    = 1,
    .init        = d_init,
    .finalize    = tpw_finalize,
    .reachable   = tpw_reachable,
    .get_addr    = tpw_get_addr,
    .wireup      = tpw_wireup,
    .isend       = d_isend,
    .progress    = tpw_progress,
    .wait        = tpw_wait,
    .wake        = tpw_wake,
    .close_peer  = tpw_close_peer,
};

/* ---- ranks ---------------------------------------------------------------------------------- */

static char store_path[256];

static xccl_comm_t *comm_new(int rank, int size)
{
    return ctest_file_comm(store_path, rank, size, 20000, "exec", "devtcp");
}

/* Small integers: float32 sums of them are exact in any order. */
static float val(int r, size_t i) { return (float)((r + 1) * 100 + (int)(i % 97)); }

static float sum_at(int size, size_t i)
{
    float s = 0;
    for (int q = 0; q < size; q++) s += val(q, i);
    return s;
}

enum { V_PLAIN, V_INPLACE, V_AVG, V_PREMUL, V_COUNT };

static const char *vname[V_COUNT] = {"", " in-place", " avg", " premul"};

/* Runs one collective, algorithm `algo`, variant v on device buffers; 0 when it succeeded. */
static int run_one(xccl_comm_t *c, xccl_coll_t coll, const char *algo, int v, size_t n)
{
    int              rank = xccl_comm_rank(c), size = xccl_comm_size(c);
    int              root = size - 1;
    size_t           tot  = n * (size_t)size;
    float           *s    = fdev_alloc((tot + 1) * 4);
    float           *r    = fdev_alloc((tot + 1) * 4);
    float           *out  = r;
    size_t           sc[16], sd[16], rc[16], rd[16];
    xccl_op_t        op   = v == V_AVG ? XCCL_OP_AVG : v == V_PREMUL ? XCCL_OP_PREMUL_SUM
                                                                    : XCCL_OP_SUM;
    xccl_coll_opts_t opts = {.algo = algo, .premul_factor = 3.0, .mem = XCCL_MEM_CUDA};
    xccl_work_t     *w    = NULL;
    xccl_status_t    st;
    char             what[128];
    int              bad = 0;

    snprintf(what, sizeof(what), "rank %d/%d %s/%s%s n=%zu", rank, size, xccl_coll_name(coll),
             algo, vname[v], n);
    for (size_t i = 0; i < tot; i++) s[i] = val(rank, i), r[i] = -7;
    if (v == V_INPLACE) out = s;
    switch (coll) {
    case XCCL_COLL_ALLREDUCE:
        st = xccl_allreduce(c, s, out, n, XCCL_FLOAT32, op, &opts, &w);
        break;
    case XCCL_COLL_BROADCAST: st = xccl_broadcast(c, s, n, XCCL_FLOAT32, root, &opts, &w); break;
    case XCCL_COLL_REDUCE:
        st = xccl_reduce(c, s, out, n, XCCL_FLOAT32, op, root, &opts, &w);
        break;
    case XCCL_COLL_ALLGATHER: st = xccl_allgather(c, s, r, n, XCCL_FLOAT32, &opts, &w); break;
    case XCCL_COLL_GATHER: st = xccl_gather(c, s, r, n, XCCL_FLOAT32, root, &opts, &w); break;
    case XCCL_COLL_SCATTER: st = xccl_scatter(c, s, r, n, XCCL_FLOAT32, root, &opts, &w); break;
    case XCCL_COLL_REDUCE_SCATTER:
        st = xccl_reduce_scatter(c, s, out, n, XCCL_FLOAT32, op, &opts, &w);
        break;
    case XCCL_COLL_ALLTOALL: st = xccl_alltoall(c, s, out, n, XCCL_FLOAT32, &opts, &w); break;
    case XCCL_COLL_ALLTOALLV:
        /* block q of this rank's buffers holds count n - (q + rank) % 2, one spare element */
        for (int q = 0; q < size; q++) {
            sc[q] = n - (size_t)((q + rank) % 2 && n > 0);
            rc[q] = sc[q];
            sd[q] = rd[q] = (size_t)q * n;
        }
        st = xccl_alltoallv(c, s, sc, sd, out, rc, rd, XCCL_FLOAT32, &opts, &w);
        break;
    default: st = xccl_barrier(c, &opts, &w); break;
    }
    if (st == XCCL_OK) st = xccl_work_wait(w, -1);
    CHECK_MSG(st == XCCL_OK, "%s: %s", what, w ? xccl_work_error(w) : xccl_last_error());
    if (w != NULL) xccl_work_release(w);
    for (size_t i = 0; st == XCCL_OK && i < tot && !bad; i++) {
        float   want = 0, got = out[i];
        int     have = i < n;
        switch (coll) {
        case XCCL_COLL_ALLREDUCE:
        case XCCL_COLL_REDUCE:
            have = i < n && (coll == XCCL_COLL_ALLREDUCE || rank == root);
            want = sum_at(size, i);
            break;
        case XCCL_COLL_REDUCE_SCATTER: want = sum_at(size, (size_t)rank * n + i); break;
        case XCCL_COLL_BROADCAST: want = val(root, i), got = s[i]; break;
        case XCCL_COLL_ALLGATHER: have = 1, want = val((int)(i / n), i % n); break;
        case XCCL_COLL_GATHER: have = rank == root, want = val((int)(i / n), i % n); break;
        case XCCL_COLL_SCATTER: want = val(root, (size_t)rank * n + i); break;
        case XCCL_COLL_ALLTOALL:
            have = 1, want = val((int)(i / n), (size_t)rank * n + i % n);
            break;
        case XCCL_COLL_ALLTOALLV: {
            int    q = (int)(i / n);
            size_t k = i % n;
            have     = k < rc[q];
            want     = val(q, (size_t)rank * n + k);
            break;
        }
        default: have = 0;
        }
        if (v == V_AVG) want /= (float)size;
        if (v == V_PREMUL) want *= 3;
        if (have && got != want) {
            CHECK_MSG(0, "%s: [%zu] = %g, want %g", what, i, (double)got, (double)want);
            bad = 1;
        }
    }
    fdev_free(s);
    fdev_free(r);
    return st == XCCL_OK && !bad ? 0 : -1;
}

static void test_all(xccl_comm_t *c)
{
    static const size_t counts[] = {0, 1, 33, 5000};

    for (size_t ci = 0; ci < sizeof(counts) / sizeof(counts[0]); ci++) {
        for (int coll = 0; coll < XCCL_COLL_COUNT; coll++) {
            const xccl_algo_t *const *algos = xccl_algo_list((xccl_coll_t)coll);
            int reducing = coll == XCCL_COLL_ALLREDUCE || coll == XCCL_COLL_REDUCE ||
                           coll == XCCL_COLL_REDUCE_SCATTER;
            int inplace = reducing || coll == XCCL_COLL_ALLTOALL || coll == XCCL_COLL_ALLTOALLV;
            for (int ai = 0; algos[ai] != NULL; ai++) {
                xccl_coll_args_t probe = {.coll = (xccl_coll_t)coll, .count = counts[ci],
                                          .dtype = XCCL_FLOAT32, .elsize = 4};
                if (algos[ai]->applicable && !algos[ai]->applicable(&probe, xccl_comm_size(c)))
                    continue;
                for (int v = 0; v < V_COUNT; v++) {
                    if ((v == V_INPLACE && !inplace) || (v >= V_AVG && !reducing)) continue;
                    (void)run_one(c, (xccl_coll_t)coll, algos[ai]->name, v, counts[ci]);
                }
            }
        }
    }
}

/* No executor for the memory type: the call fails at once, names the cause, moves nothing;
 * the communicator stays usable. */
static void test_no_executor(xccl_comm_t *c)
{
    const xccl_exec_ops_t *old  = xccl_exec_set_for_test(XCCL_MEM_CUDA, NULL);
    xccl_coll_opts_t       opts = {.mem = XCCL_MEM_CUDA};
    float                  s[4] = {1, 2, 3, 4}, r[4] = {9, 9, 9, 9};
    xccl_work_t           *w    = NULL;
    xccl_status_t          st;

    st = xccl_allreduce(c, s, r, 4, XCCL_FLOAT32, XCCL_OP_SUM, &opts, &w);
    CHECK(st == XCCL_ERR_NOT_SUPPORTED && w == NULL);
    CHECK_MSG(strstr(xccl_last_error(), "no executor") != NULL, "%s", xccl_last_error());
    CHECK(r[0] == 9 && r[3] == 9);
    opts.mem = (xccl_mem_type_t)77;
    CHECK(xccl_broadcast(c, s, 4, XCCL_FLOAT32, 0, &opts, &w) == XCCL_ERR_NOT_SUPPORTED);
    xccl_exec_set_for_test(XCCL_MEM_CUDA, old);
    CHECK(run_one(c, XCCL_COLL_ALLREDUCE, "ring", V_PLAIN, 8) == 0);
}

/* An executor error fails the operation with that error, naming the executor (one rank:
 * peers of a failed rank would only time out). */
static xccl_status_t fail_copy(void *q, void *dst, const void *src, size_t nbytes, void **ev)
{
    (void)q, (void)dst, (void)src, (void)nbytes;
    *ev = NULL;
    return xccl_error_set(XCCL_ERR_CUDA, "fake device: copy failed");
}

static xccl_status_t fail_test(void *ev)
{
    xccl_status_t st = fdev_test(ev);
    if (st != XCCL_OK) return st;
    return xccl_error_set(XCCL_ERR_CUDA, "fake device: kernel failed");
}

static void test_exec_error(xccl_comm_t *c)
{
    xccl_exec_ops_t        bad  = fdev_ops;
    const xccl_exec_ops_t *old;
    xccl_coll_opts_t       opts = {.mem = XCCL_MEM_CUDA};
    float                 *s = fdev_alloc(16), *r = fdev_alloc(16);
    xccl_work_t           *w = NULL;
    xccl_status_t          st;

    bad.copy = fail_copy;
    old      = xccl_exec_set_for_test(XCCL_MEM_CUDA, &bad);
    st       = xccl_allreduce(c, s, r, 4, XCCL_FLOAT32, XCCL_OP_SUM, &opts, &w);
    CHECK(st == XCCL_ERR_CUDA && w == NULL);
    CHECK_MSG(strstr(xccl_last_error(), "fake-device") != NULL, "%s", xccl_last_error());
    /* the same found later, when the queued copy is tested */
    bad.copy = fdev_ops.copy;
    bad.test = fail_test;
    st       = xccl_allreduce(c, s, r, 4, XCCL_FLOAT32, XCCL_OP_SUM, &opts, &w);
    CHECK(st == XCCL_OK && w != NULL);
    if (w != NULL) {
        CHECK(xccl_work_wait(w, -1) == XCCL_ERR_CUDA);
        CHECK_MSG(strstr(xccl_work_error(w), "kernel failed") != NULL &&
                      strstr(xccl_work_error(w), "fake-device") != NULL,
                  "%s", xccl_work_error(w));
        xccl_work_release(w);
    }
    xccl_exec_set_for_test(XCCL_MEM_CUDA, old);
    fdev_free(s);
    fdev_free(r);
}

static int child(int rank, int size, void *unused)
{
    (void)unused;
    xccl_comm_t *c;

    fdev_open(1); /* the transports read and write this memory directly */
    CHECK(xccl_exec_set_for_test(XCCL_MEM_CUDA, &fdev_ops) == NULL);
    c = comm_new(rank, size);
    if (c == NULL) return 2;
    test_all(c);
    test_no_executor(c);
    if (size == 1) test_exec_error(c);
    CHECK_MSG(fdev.queued > 0 && fdev.live == 0, "queued %zu, live %zu", fdev.queued, fdev.live);
    /* with peers, device buffers went to the transport as device memory both ways */
    CHECK_MSG(size == 1 || (devtcp.dev_sends > 0 && devtcp.dev_recvs > 0),
              "device sends %llu, receives %llu", (unsigned long long)devtcp.dev_sends,
              (unsigned long long)devtcp.dev_recvs);
    xccl_comm_destroy(c);
    return ctest_failures != 0;
}

int main(void)
{
    static const int sizes[] = {1, 2, 3, 4};
    int              failed  = 0;

    if (xccl_transport_register(&devtcp_ops) != XCCL_OK) {
        fprintf(stderr, "registering devtcp: %s\n", xccl_last_error());
        return 1;
    }
    for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
        int   size = sizes[k];
        snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-exec-%d-%d", (int)getpid(), size);
        unlink(store_path);
        failed += ctest_fork_ranks("test_exec", size, child, NULL);
        unlink(store_path);
    }
    ctest_checks++;
    if (failed) ctest_failures++;
    CTEST_MAIN_END("test_exec");
}
