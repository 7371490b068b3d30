/* SPDX-License-Identifier: Apache-2.0
 *
 * devp2p.h - what the tests of device memory between forked ranks share (test_stage.c: staging
 * through host transports; test_cuda_ipc.c: the cuda_ipc transport): fake device memory of
 * fake_dev.h used under the context's lock, byte patterns per sender, posting and waiting, and
 * the scenarios both run - a ring of sizes between memory types, unexpected messages,
 * any-source receives, and
 * allreduce/allgather with every applicable algorithm. Results are compared with values
 * computed from the rank and index. One translation unit per program (everything static);
 * include after fake_dev.h and ctest.h.
 */
#ifndef XCCL_TESTS_DEVP2P_H
#define XCCL_TESTS_DEVP2P_H

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "algo/algo.h"
#include "core/core.h"
#include "ctest.h"
#include "fake_dev.h"
#include "xccl/xccl.h"

#define DEVP2P_WAIT_MS 60000 /* every wait is bounded: a hang fails the test */

static char store_path[256];
static int  store_gen;

/* fake_dev is not thread-safe and its executor runs under the context's lock, on the progress
 * thread too: the test's own use of it (allocating, opening mappings to fill or check them)
 * takes that lock, so that an executor copy never finds the mappings closed under it. */
static pthread_mutex_t *dev_lock;
/* 1: device memory stays open to the CPU (a transport reading it with process_vm_readv, which
 * PROT_NONE would fail); 0: it is opened only to fill or check it */
static int devp2p_keep_open;

static void dlock(void)
{
    if (dev_lock) pthread_mutex_lock(dev_lock);
}

static void dunlock(void)
{
    if (dev_lock) pthread_mutex_unlock(dev_lock);
}

static void dev_open(int open)
{
    if (!devp2p_keep_open) fdev_open(open);
}

static void *dalloc(size_t n)
{
    void *p;

    dlock();
    p = fdev_alloc(n);
    dunlock();
    return p;
}

static void dfree(void *p)
{
    dlock();
    fdev_free(p);
    dunlock();
}

/* A buffer of memory type m, its bytes 0xA5 (as fdev_alloc leaves them). */
static void *mem_alloc(xccl_mem_type_t m, size_t n)
{
    void *p = m == XCCL_MEM_CUDA ? dalloc(n) : malloc(n ? n : 1);
    if (p != NULL && m != XCCL_MEM_CUDA) memset(p, 0xA5, n);
    return p;
}

static void mem_free(xccl_mem_type_t m, void *p)
{
    if (m == XCCL_MEM_CUDA)
        dfree(p);
    else
        free(p);
}

/* The byte at index i of the message rank `src` sends with `salt`. */
static uint8_t pat(int src, size_t i, int salt)
{
    return (uint8_t)(src * 53 + salt * 17 + (int)(i % 251) + (int)(i / 251) * 7 + 1);
}

static void fill(void *p, size_t n, int src, int salt)
{
    dlock();
    dev_open(1);
    for (size_t i = 0; i < n; i++)
        ((uint8_t *)p)[i] = pat(src, i, salt);
    dev_open(0);
    dunlock();
}

/* Checks n bytes at p against the pattern and that the rest of the buffer (to cap) is still
 * 0xA5. Returns 0 when they match. */
static int check(const void *p, size_t n, size_t cap, int src, int salt, const char *what)
{
    int bad = -1;

    dlock();
    dev_open(1);
    for (size_t i = 0; i < n && bad < 0; i++)
        if (((const uint8_t *)p)[i] != pat(src, i, salt)) bad = (int)i;
    for (size_t i = n; i < cap && bad < 0; i++)
        if (((const uint8_t *)p)[i] != 0xA5) bad = (int)i;
    dev_open(0);
    dunlock();
    CHECK_MSG(bad < 0, "%s: byte %d of %zu wrong", what, bad, n);
    return bad < 0 ? 0 : -1;
}

static xccl_status_t wait_ok(xccl_work_t *w, const char *what)
{
    xccl_status_t st = xccl_work_wait(w, DEVP2P_WAIT_MS);

    CHECK_MSG(st == XCCL_OK, "%s: %s (%s)", what, xccl_status_string(st), xccl_work_error(w));
    return st;
}

static xccl_status_t post(xccl_comm_t *c, int send, void *buf, size_t n, int peer, uint32_t tag,
                          xccl_mem_type_t mem, xccl_work_t **w)
{
    xccl_p2p_opts_t o  = {.mem = mem};
    xccl_status_t   st = send ? xccl_isend_opts(c, buf, n, peer, tag, &o, w)
                              : xccl_irecv_opts(c, buf, n, peer, tag, &o, w);

    CHECK_MSG(st == XCCL_OK, "post: %s", xccl_last_error());
    return st;
}

/* A host-memory barrier between tests (its own tag range). */
static void sync_all(xccl_comm_t *c)
{
    xccl_work_t *w = NULL;

    CHECK(xccl_barrier(c, NULL, &w) == XCCL_OK && wait_ok(w, "barrier") == XCCL_OK);
    if (w) xccl_work_release(w);
}

static const size_t sizes[] = {0, 1, 7, 4096, 65537, (3u << 20) + 13};
enum { NSIZES = sizeof(sizes) / sizeof(sizes[0]) };

/* Ring: each rank sends to the next and receives from the previous, every size; memory types
 * of the send and receive buffers given. */
static void test_ring(xccl_comm_t *c, xccl_mem_type_t smem, xccl_mem_type_t rmem, int salt)
{
    int rank = xccl_comm_rank(c), size = xccl_comm_size(c);
    int to = (rank + 1) % size, from = (rank + size - 1) % size;

    for (int k = 0; k < NSIZES; k++) {
        size_t       n = sizes[k], cap = n + 5;
        void        *s = mem_alloc(smem, n), *r = mem_alloc(rmem, cap);
        xccl_work_t *ws = NULL, *wr = NULL;
        char         what[96];

        snprintf(what, sizeof(what), "ring %s->%s n=%zu rank %d",
                 smem == XCCL_MEM_CUDA ? "dev" : "host", rmem == XCCL_MEM_CUDA ? "dev" : "host", n,
                 rank);
        fill(s, n, rank, salt + k);
        if (post(c, 0, r, cap, from, 10 + (uint32_t)k, rmem, &wr) == XCCL_OK &&
            post(c, 1, s, n, to, 10 + (uint32_t)k, smem, &ws) == XCCL_OK &&
            wait_ok(ws, what) == XCCL_OK && wait_ok(wr, what) == XCCL_OK) {
            CHECK_MSG(xccl_work_source(wr) == from, "%s: source %d", what, xccl_work_source(wr));
            (void)check(r, n, cap, from, salt + k, what);
        }
        if (ws) xccl_work_release(ws);
        if (wr) xccl_work_release(wr);
        mem_free(smem, s);
        mem_free(rmem, r);
    }
}

/* Rank 0 sends every size to rank 1, then a host "go" on the same connection, and only then
 * does rank 1 post its device receives: the messages arrive unexpected (held back in the
 * transport a while, or staged as such). */
static void test_unexpected(xccl_comm_t *c)
{
    int          rank = xccl_comm_rank(c);
    void        *b[NSIZES];
    xccl_work_t *w[NSIZES] = {0}, *g = NULL;
    uint8_t      go = 1;

    if (rank > 1) return;
    for (int k = 0; k < NSIZES; k++) {
        b[k] = dalloc(sizes[k] + 3);
        if (rank == 0) fill(b[k], sizes[k], 0, 40 + k);
    }
    if (rank == 0) {
        for (int k = 0; k < NSIZES; k++)
            (void)post(c, 1, b[k], sizes[k], 1, 40, XCCL_MEM_CUDA, &w[k]);
        if (xccl_isend(c, &go, 1, 1, 49, &g) == XCCL_OK) (void)wait_ok(g, "unexpected: go");
        for (int k = 0; k < NSIZES; k++)
            if (w[k]) (void)wait_ok(w[k], "unexpected: send");
    } else {
        if (xccl_irecv(c, &go, 1, 0, 49, &g) == XCCL_OK) (void)wait_ok(g, "unexpected: go");
        for (int k = 0; k < NSIZES; k++)
            (void)post(c, 0, b[k], sizes[k] + 3, 0, 40, XCCL_MEM_CUDA, &w[k]);
        for (int k = 0; k < NSIZES; k++) {
            char what[64];
            snprintf(what, sizeof(what), "unexpected n=%zu", sizes[k]);
            if (w[k] && wait_ok(w[k], what) == XCCL_OK)
                (void)check(b[k], sizes[k], sizes[k] + 3, 0, 40 + k, what);
        }
    }
    if (g) xccl_work_release(g);
    for (int k = 0; k < NSIZES; k++) {
        if (w[k]) xccl_work_release(w[k]);
        dfree(b[k]);
    }
}

/* Every other rank sends rank 0 a message of its own size; rank 0 receives them with
 * any-source receives and checks each by its sender. */
static void test_any_source(xccl_comm_t *c)
{
    int          rank = xccl_comm_rank(c), size = xccl_comm_size(c);
    size_t       cap      = (1u << 20) + 64;
    xccl_work_t *w[64]    = {0};
    void        *b[64]    = {0};
    int          seen[64] = {0};

    if (rank == 0) {
        for (int q = 1; q < size; q++) {
            b[q] = dalloc(cap);
            (void)post(c, 0, b[q], cap, XCCL_ANY_SOURCE, 60, XCCL_MEM_CUDA, &w[q]);
        }
        for (int q = 1; q < size; q++) {
            int src;
            if (w[q] == NULL || wait_ok(w[q], "any-source") != XCCL_OK) continue;
            src = xccl_work_source(w[q]);
            CHECK_MSG(src >= 1 && src < size && !seen[src], "any-source: source %d", src);
            if (src < 1 || src >= size || seen[src]) continue;
            seen[src] = 1;
            (void)check(b[q], (1u << 20) - (size_t)src * 1000, cap, src, 61, "any-source");
        }
    } else {
        size_t n = (1u << 20) - (size_t)rank * 1000;
        b[0]     = dalloc(n);
        fill(b[0], n, rank, 61);
        if (post(c, 1, b[0], n, 0, 60, XCCL_MEM_CUDA, &w[0]) == XCCL_OK)
            (void)wait_ok(w[0], "any-source: send");
    }
    for (int q = 0; q < 64; q++) {
        if (w[q]) xccl_work_release(w[q]);
        if (b[q]) dfree(b[q]);
    }
}

static float val(int r, size_t i)
{
    return (float)((r + 1) * 100 + (int)(i % 97));
}

/* allreduce (sum) and allgather on device buffers, every applicable algorithm
 * (transports_only: not those of the node-shared segment, which use no transport). */
static void test_colls(xccl_comm_t *c, int transports_only)
{
    static const size_t      counts[] = {0, 1, 33, 5000, 300001};
    static const xccl_coll_t colls[]  = {XCCL_COLL_ALLREDUCE, XCCL_COLL_ALLGATHER};
    int                      rank = xccl_comm_rank(c), size = xccl_comm_size(c);

    for (size_t ci = 0; ci < sizeof(counts) / sizeof(counts[0]); ci++) {
        for (int k = 0; k < 2; k++) {
            const xccl_algo_t *const *algos = xccl_algo_list(colls[k]);
            for (int ai = 0; algos[ai] != NULL; ai++) {
                size_t           n = counts[ci], tot = n * (size_t)size;
                xccl_coll_args_t probe = {
                    .coll = colls[k], .count = n, .dtype = XCCL_FLOAT32, .elsize = 4};
                xccl_coll_opts_t opts = {.algo = algos[ai]->name, .mem = XCCL_MEM_CUDA};
                float           *s, *r;
                xccl_work_t     *w = NULL;
                xccl_status_t    st;
                char             what[128];
                int              bad = -1;

                if (algos[ai]->applicable && !algos[ai]->applicable(&probe, size)) continue;
                if (transports_only && algos[ai]->shared) continue; /* no transport used */
                snprintf(what, sizeof(what), "rank %d/%d %s/%s n=%zu", rank, size,
                         xccl_coll_name(colls[k]), algos[ai]->name, n);
                s = dalloc((tot + 1) * 4);
                r = dalloc((tot + 1) * 4);
                dlock();
                dev_open(1);
                for (size_t i = 0; i < n; i++)
                    s[i] = val(rank, i);
                for (size_t i = 0; i < tot; i++)
                    r[i] = -7;
                dev_open(0);
                dunlock();
                st = colls[k] == XCCL_COLL_ALLREDUCE
                         ? xccl_allreduce(c, s, r, n, XCCL_FLOAT32, XCCL_OP_SUM, &opts, &w)
                         : xccl_allgather(c, s, r, n, XCCL_FLOAT32, &opts, &w);
                if (st == XCCL_OK) st = xccl_work_wait(w, DEVP2P_WAIT_MS);
                CHECK_MSG(st == XCCL_OK, "%s: %s", what,
                          w ? xccl_work_error(w) : xccl_last_error());
                dlock();
                dev_open(1);
                for (size_t i = 0; st == XCCL_OK && i < (k == 0 ? n : tot) && bad < 0; i++) {
                    float want = 0;
                    if (k == 0)
                        for (int q = 0; q < size; q++)
                            want += val(q, i);
                    else
                        want = val((int)(i / n), i % n);
                    if (r[i] != want) bad = (int)i;
                }
                dev_open(0);
                dunlock();
                CHECK_MSG(bad < 0, "%s: element %d wrong", what, bad);
                if (w) xccl_work_release(w);
                dfree(s);
                dfree(r);
            }
        }
    }
}

#endif /* XCCL_TESTS_DEVP2P_H */
