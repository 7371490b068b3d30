/* SPDX-License-Identifier: Apache-2.0
 *
 * tp_harness.h - what the transport tests (test_shm.c, test_tcp.c) share: a payload
 * generator, a cross-process flag wait, a fake core that records every upcall of the
 * transport under test, and the many-messages exchange job. Include after defining MAXR
 * (most ranks of a job) and TP (the transport's ops); one translation unit per test
 * program, so everything here is static.
 */
#ifndef XCCL_TESTS_TP_HARNESS_H
#define XCCL_TESTS_TP_HARNESS_H

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "core/check.h"
#include "xccl/xccl_transport.h"

/* ---------------------------------------------------------------------------------------------
 * Payload generator: byte i of message `seed` is a hash of (seed, i / 8).
 * ------------------------------------------------------------------------------------------- */

static inline uint64_t mix(uint64_t x)
{
    x ^= x >> 31;
    x *= 0x9e3779b97f4a7c15ull;
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ull;
    return x ^ (x >> 32);
}

static inline void fill(char *p, size_t n, uint64_t seed)
{
    size_t i;

    for (i = 0; i + 8 <= n; i += 8) {
        uint64_t w = mix(seed * 0x100000001b3ull + i / 8);
        memcpy(p + i, &w, 8);
    }
    if (i < n) {
        uint64_t w = mix(seed * 0x100000001b3ull + i / 8);
        memcpy(p + i, &w, n - i);
    }
}

static inline int verify(const char *p, size_t n, uint64_t seed)
{
    size_t i;

    for (i = 0; i + 8 <= n; i += 8) {
        uint64_t w = mix(seed * 0x100000001b3ull + i / 8);
        if (memcmp(p + i, &w, 8) != 0) return 0;
    }
    if (i < n) {
        uint64_t w = mix(seed * 0x100000001b3ull + i / 8);
        if (memcmp(p + i, &w, n - i) != 0) return 0;
    }
    return 1;
}

/* Waits until *f >= value (another process sets it); 0 on timeout. */
static inline int wait_flag(atomic_int *f, int value, int64_t timeout_ms)
{
    int64_t end = xccl_now_ms() + timeout_ms;

    while (atomic_load(f) < value) {
        if (xccl_now_ms() > end) return 0;
        usleep(200);
    }
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * The fake core: records what the transport reports
 * ------------------------------------------------------------------------------------------- */

typedef struct rmsg {
    int            peer;
    xccl_msg_hdr_t hdr;
    char          *ptr;
    int            owned;
    int            done;
    xccl_status_t  st;
    int            intact; /* verify mode: payload matched the generator (seed = hdr.fp) */
    int            dropped; /* recv_match gave no destination: the transport drops it */
} rmsg_t;

static int NRANKS; /* transport ranks of the running job */

static struct fake {
    int           rank, size;
    rmsg_t      **msgs;
    size_t        nmsgs, cap;
    char         *posted[MAXR]; /* the next message from that peer goes here */
    size_t        posted_cap[MAXR];
    int           verify_free; /* check the payload at recv_done, then free it */
    uint64_t      refuse_tag;  /* recv_match refuses this tag (0: none) */
    uint64_t      drop_tags;   /* recv_match gives no destination to tags with this bit set */
    uint64_t      defer_tag;   /* recv_match holds this tag back ... */
    int           defer_left;  /* ... for this many more offers (XCCL_INPROGRESS) */
    int           nsend_ok, nsend_err, nrecv_ok, nrecv_err;
    int           failed[MAXR];
    xccl_status_t failed_st[MAXR];
    char          failed_why[MAXR][256];
    int           callbacks_bad;
    char         *recv_base; /* perf: every payload goes to recv_base + hdr.fp, unchecked */
} F;

static xccl_tp_ctx_t *CTX;
static int            WAIT_MS = 2; /* drive() sleeps this long in `wait` when idle */
static int64_t        WAIT_MAX;    /* longest such sleep */

static inline xccl_status_t fake_recv_match(void *core, int peer, const xccl_msg_hdr_t *hdr,
                                     xccl_tp_buf_t *dst, void **cookie)
{
    rmsg_t *m;

    if (core != &F || peer < 0 || peer >= F.size) F.callbacks_bad++;
    if (F.refuse_tag != 0 && hdr->tag == F.refuse_tag) return XCCL_ERR_MISMATCH;
    if (F.defer_left > 0 && hdr->tag == F.defer_tag) {
        F.defer_left--;
        return XCCL_INPROGRESS;
    }
    m       = calloc(1, sizeof(*m));
    m->peer = peer;
    m->hdr  = *hdr;
    if (hdr->tag < 64 && (F.drop_tags >> hdr->tag & 1)) {
        m->dropped = 1; /* ptr stays NULL */
    } else if (F.recv_base != NULL) {
        m->ptr = F.recv_base + hdr->fp;
    } else if (F.posted[peer] != NULL && F.posted_cap[peer] >= hdr->nbytes) {
        m->ptr         = F.posted[peer];
        F.posted[peer] = NULL;
    } else if (hdr->nbytes > 0) {
        m->ptr   = malloc(hdr->nbytes);
        m->owned = 1;
    }
    if (F.nmsgs == F.cap) {
        F.cap  = F.cap ? F.cap * 2 : 64;
        F.msgs = realloc(F.msgs, F.cap * sizeof(*F.msgs));
    }
    F.msgs[F.nmsgs++] = m;
    dst->ptr          = m->ptr;
    dst->mem          = XCCL_MEM_HOST;
    dst->mr           = NULL;
    *cookie           = m;
    return XCCL_OK;
}

static inline void fake_recv_done(void *core, void *cookie, xccl_status_t st)
{
    rmsg_t *m = cookie;

    if (core != &F || m->done) F.callbacks_bad++;
    m->done = 1;
    m->st   = st;
    if (st == XCCL_OK) F.nrecv_ok++;
    else F.nrecv_err++;
    if (F.verify_free && st == XCCL_OK && m->dropped) {
        m->intact = 1;
    } else if (F.verify_free && st == XCCL_OK) {
        m->intact = verify(m->ptr, m->hdr.nbytes, m->hdr.fp);
        if (m->owned) free(m->ptr);
        m->ptr = NULL;
    }
}

static inline void fake_send_done(void *core, void *cookie, xccl_status_t st)
{
    xccl_status_t *slot = cookie;

    if (core != &F || *slot != XCCL_INPROGRESS) F.callbacks_bad++;
    *slot = st;
    if (st == XCCL_OK) F.nsend_ok++;
    else F.nsend_err++;
}

static inline void fake_peer_failed(void *core, int peer, xccl_status_t st, const char *why)
{
    if (core != &F || peer < 0 || peer >= F.size || F.failed[peer]) F.callbacks_bad++;
    F.failed[peer]    = 1;
    F.failed_st[peer] = st;
    snprintf(F.failed_why[peer], sizeof(F.failed_why[peer]), "%s", why);
}

static const xccl_tp_upcalls_t UP = {
    .core        = &F,
    .recv_match  = fake_recv_match,
    .recv_done   = fake_recv_done,
    .send_done   = fake_send_done,
    .peer_failed = fake_peer_failed,
};

/* Runs progress (sleeping in `wait` when idle) until cond() or the timeout. */
static inline int drive(int (*cond)(void *), void *arg, int64_t timeout_ms)
{
    int64_t end = xccl_now_ms() + timeout_ms;

    while (!cond(arg)) {
        int nev = 0;
        if (xccl_now_ms() > end) return 0;
        if (TP->progress(CTX, &nev) != XCCL_OK) return 0;
        if (nev == 0) {
            int64_t t0 = xccl_now_ms();
            TP->wait(CTX, WAIT_MS);
            if (xccl_now_ms() - t0 > WAIT_MAX) WAIT_MAX = xccl_now_ms() - t0;
        }
    }
    return 1;
}

static inline int have_msgs(void *arg)
{
    size_t n = *(size_t *)arg, i, done = 0;

    for (i = 0; i < F.nmsgs; i++) done += F.msgs[i]->done;
    return done >= n;
}

static inline int have_failed(void *arg) { return F.failed[*(int *)arg]; }

typedef struct sends {
    xccl_status_t *st;
    size_t         n;
} sends_t;

static inline int sends_done(void *arg)
{
    sends_t *s = arg;

    for (size_t i = 0; i < s->n; i++)
        if (s->st[i] == XCCL_INPROGRESS) return 0;
    return 1;
}

static inline int all_done(void *arg)
{
    void **a = arg;
    return sends_done(a[0]) && have_msgs(a[1]);
}

static inline void reset_msgs(void)
{
    for (size_t i = 0; i < F.nmsgs; i++) {
        if (F.msgs[i]->owned) free(F.msgs[i]->ptr);
        free(F.msgs[i]);
    }
    F.nmsgs = 0;
}

static rmsg_t *find_msg(int peer, uint64_t tag)
{
    for (size_t i = 0; i < F.nmsgs; i++)
        if (F.msgs[i]->peer == peer && F.msgs[i]->hdr.tag == tag) return F.msgs[i];
    return NULL;
}

typedef struct want_msg {
    int      peer;
    uint64_t tag;
} want_msg_t;

static inline int have_msg(void *arg)
{
    want_msg_t *w = arg;
    rmsg_t     *m = find_msg(w->peer, w->tag);
    return m != NULL && m->done;
}

/* Progress for `ms` milliseconds whatever happens. */
static inline void spin(int64_t ms)
{
    int64_t end = xccl_now_ms() + ms;

    while (xccl_now_ms() < end) {
        int nev;
        TP->progress(CTX, &nev);
        if (nev == 0) TP->wait(CTX, 1);
    }
}

/* Exchange: this rank sends `count` messages (sizes cycling through `sizes`) to every rank
 * in `use`, all posted before any progress, while the others do the same to it. `done`, a
 * counter shared by the job's processes, keeps everyone progressing until all are through. */
static inline void exchange(const uint8_t *use, int count, const size_t *sizes, int nsizes,
                            atomic_int *done)
{
    size_t         total = 0, want, k = 0;
    xccl_status_t *st;
    char         **bufs;
    sends_t        s;
    void          *both[2];
    int            next[MAXR] = {0};

    for (int p = 0; p < NRANKS; p++) total += use[p] ? (size_t)count : 0;
    st            = malloc(total * sizeof(*st));
    bufs          = calloc(total, sizeof(*bufs));
    s             = (sends_t){st, total};
    want          = total;
    both[0]       = &s;
    both[1]       = &want;
    F.verify_free = 1;
    for (int i = 0; i < count; i++) {
        for (int p = 0; p < NRANKS; p++) {
            size_t         n = sizes[(i + p) % nsizes];
            xccl_msg_hdr_t h;
            xccl_tp_buf_t  b;

            if (!use[p]) continue;
            /* the seed names sender, receiver and index */
            h = (xccl_msg_hdr_t){.comm_id = 3, .tag = (uint64_t)i,
                                 .fp = (uint64_t)(F.rank * 1000 + p * 100000 + i), .nbytes = n};
            bufs[k] = malloc(n ? n : 1);
            fill(bufs[k], n, h.fp);
            b     = (xccl_tp_buf_t){bufs[k], XCCL_MEM_HOST, NULL};
            st[k] = XCCL_INPROGRESS;
            CHECK(TP->isend(CTX, p, &h, &b, &st[k]) == XCCL_OK);
            k++;
        }
    }
    CHECK(drive(all_done, both, 30000));
    for (k = 0; k < total; k++) {
        CHECK(st[k] == XCCL_OK);
        free(bufs[k]);
    }
    CHECK(F.nmsgs == total);
    for (size_t i = 0; i < F.nmsgs; i++) {
        rmsg_t *m = F.msgs[i];
        CHECK_MSG(m->intact && m->st == XCCL_OK, "rank %d: message %zu from %d corrupt", F.rank,
                  i, m->peer);
        CHECK(m->hdr.fp == (uint64_t)(m->peer * 1000 + F.rank * 100000) + m->hdr.tag);
        CHECK_MSG(m->hdr.tag == (uint64_t)next[m->peer], "order from %d", m->peer);
        next[m->peer]++;
    }
    /* leave only when everyone has received everything */
    atomic_fetch_add(done, 1);
    while (atomic_load(done) < NRANKS) {
        int nev;
        TP->progress(CTX, &nev);
        usleep(500);
    }
    free(st);
    free(bufs);
}

/* Held back (XCCL_TP_CAP_DEFER): the core answers XCCL_INPROGRESS to a large message's first
 * offers. The transport must offer it again on later passes, take nothing else from that peer
 * meanwhile (the small message sent after it arrives after it), and deliver it intact once
 * accepted. Rank 1 sends, rank 0 receives; `done` lets the sender go. */
static inline void defer_check(int rank, atomic_int *done)
{
    enum { BIG = 300000, SMALL = 64, OFFERS = 5 };

    if (rank == 0) {
        size_t n      = 2;
        F.verify_free = 1;
        F.defer_tag   = 7;
        F.defer_left  = OFFERS;
        CHECK(drive(have_msgs, &n, 10000));
        CHECK(F.defer_left == 0); /* asked again until accepted */
        CHECK(F.nmsgs == 2 && F.msgs[0]->hdr.tag == 7 && F.msgs[1]->hdr.tag == 8);
        CHECK(F.msgs[0]->intact && F.msgs[1]->intact);
        atomic_store(done, 1);
    } else {
        char          *big = malloc(BIG), small[SMALL];
        xccl_msg_hdr_t h1  = {.tag = 7, .fp = 77, .nbytes = BIG};
        xccl_msg_hdr_t h2  = {.tag = 8, .fp = 78, .nbytes = SMALL};
        xccl_tp_buf_t  b1  = {big, XCCL_MEM_HOST, NULL}, b2 = {small, XCCL_MEM_HOST, NULL};
        xccl_status_t  st[2] = {XCCL_INPROGRESS, XCCL_INPROGRESS};
        sends_t        s     = {st, 2};

        fill(big, BIG, 77);
        fill(small, SMALL, 78);
        CHECK(TP->isend(CTX, 0, &h1, &b1, &st[0]) == XCCL_OK);
        CHECK(TP->isend(CTX, 0, &h2, &b2, &st[1]) == XCCL_OK);
        CHECK(drive(sends_done, &s, 10000));
        CHECK(st[0] == XCCL_OK && st[1] == XCCL_OK);
        CHECK(wait_flag(done, 1, 10000));
        free(big);
    }
}

/* The core drops payloads (recv_match answers no destination): a large one (pulled over CMA
 * where the pair uses it, else streamed), an INLINE one and a STREAM one, each followed by one
 * that is kept. The dropped ones complete (recv_done OK), the kept ones arrive intact and in
 * order, the sender's sends all succeed and the receiver fails nobody. Rank 1 sends, rank 0
 * receives. */
static inline void drop_check(int rank, atomic_int *done)
{
    enum { N = 6 };
    static const size_t sizes[N] = {300000, 64, 16, 8, 5000, 100};

    if (rank == 0) {
        size_t n      = N;
        F.verify_free = 1;
        F.drop_tags   = (1u << 1) | (1u << 3) | (1u << 5); /* tags 1, 3, 5 */
        CHECK(drive(have_msgs, &n, 10000));
        CHECK(F.nmsgs == N && F.nrecv_ok == N && F.nrecv_err == 0 && !F.failed[1]);
        for (size_t i = 0; i < F.nmsgs && i < N; i++) {
            rmsg_t *m = F.msgs[i];
            CHECK_MSG(m->hdr.tag == i + 1 && m->intact && m->dropped == (int)(i % 2 == 0),
                      "message %zu: tag %llu intact %d dropped %d", i,
                      (unsigned long long)m->hdr.tag, m->intact, m->dropped);
        }
        atomic_store(done, 1);
    } else {
        char         *bufs[N];
        xccl_status_t st[N];
        sends_t       s = {st, N};
        for (int i = 0; i < N; i++) {
            xccl_msg_hdr_t h = {.tag = (uint64_t)i + 1, .fp = 500 + (uint64_t)i, .nbytes = sizes[i]};
            xccl_tp_buf_t  b;
            bufs[i] = malloc(sizes[i]);
            fill(bufs[i], sizes[i], h.fp);
            b     = (xccl_tp_buf_t){bufs[i], XCCL_MEM_HOST, NULL};
            st[i] = XCCL_INPROGRESS;
            CHECK(TP->isend(CTX, 0, &h, &b, &st[i]) == XCCL_OK);
        }
        CHECK(drive(sends_done, &s, 10000));
        for (int i = 0; i < N; i++) {
            CHECK(st[i] == XCCL_OK);
            free(bufs[i]);
        }
        CHECK(wait_flag(done, 1, 10000));
    }
}

#endif /* XCCL_TESTS_TP_HARNESS_H */
