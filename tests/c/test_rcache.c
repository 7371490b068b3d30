/* SPDX-License-Identifier: Apache-2.0
 *
 * test_rcache.c - the registration cache (csrc/core/rcache.c) against a fake transport that
 * records every mem_reg / mem_dereg: hits inside a registration, a request overlapping
 * registrations (one registration of the union), invalidation while a registration is in use
 * (deregistered by the last put, never before), least-recently-used eviction by entries and by
 * bytes, a failed registration retried without the idle ones, free; and the public
 * xccl_comm_mem_invalidate reaching a context's caches.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"
#include "core/rcache.h"
#include "ctest.h"
#include "xccl/xccl.h"

/* ---- the fake transport: handles are records of what was registered ------------------------ */

typedef struct fake_mr {
    uintptr_t start, end;
    int       live;
} fake_mr_t;

enum { MAXMR = 256 };
static fake_mr_t mrs[MAXMR];
static int       nreg, ndereg, nbad, fail_next;
static fake_mr_t *last_dereg;

static xccl_status_t fake_reg(xccl_tp_ctx_t *tc, void *ptr, size_t nbytes, xccl_mem_type_t mem,
                              void **mr)
{
    (void)tc, (void)mem;
    if (fail_next > 0) {
        fail_next--;
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "fake: registration refused");
    }
    if (nreg >= MAXMR) return XCCL_ERR_NO_MEMORY;
    mrs[nreg] = (fake_mr_t){(uintptr_t)ptr, (uintptr_t)ptr + nbytes, 1};
    *mr       = &mrs[nreg++];
    return XCCL_OK;
}

static void fake_dereg(xccl_tp_ctx_t *tc, void *mr)
{
    fake_mr_t *m = mr;

    (void)tc;
    if (m < mrs || m >= mrs + nreg || !m->live) nbad++; /* unknown or twice */
    else m->live = 0;
    last_dereg = m;
    ndereg++;
}

static const xccl_transport_ops_t fake_ops = {
    .abi_version = XCCL_TRANSPORT_ABI_VERSION,
    .name        = "fake",
    .caps        = XCCL_TP_CAP_HOST_MEM | XCCL_TP_CAP_NEEDS_REG,
    .mem_reg     = fake_reg,
    .mem_dereg   = fake_dereg,
};

static int nlive(void)
{
    int n = 0;

    for (int i = 0; i < nreg; i++) n += mrs[i].live;
    return n;
}

static void reset(void)
{
    memset(mrs, 0, sizeof(mrs));
    nreg = ndereg = nbad = fail_next = 0;
    last_dereg                       = NULL;
}

static long page;
static char *arena; /* page-aligned, 64 pages */

#define P(i) (arena + (size_t)(i) * (size_t)page)

/* Registration covering [p, p + n); checks the handle covers it. */
static xccl_rreg_t *get(xccl_rcache_t *rc, void *p, size_t n, fake_mr_t **mr)
{
    xccl_rreg_t *reg = NULL;
    void        *h   = NULL;

    CHECK(xccl_rcache_get(rc, p, n, XCCL_MEM_HOST, &reg, &h) == XCCL_OK);
    *mr = h;
    CHECK(reg != NULL && h != NULL);
    if (h != NULL) {
        CHECK(((fake_mr_t *)h)->live);
        CHECK(((fake_mr_t *)h)->start <= (uintptr_t)p && (uintptr_t)p + n <= ((fake_mr_t *)h)->end);
    }
    return reg;
}

static void test_hits_and_overlap(void)
{
    xccl_rcache_t *rc;
    xccl_rreg_t   *a, *b, *c, *u;
    fake_mr_t     *ma, *mb, *mc, *mu;

    reset();
    CHECK(xccl_rcache_new(&fake_ops, NULL, &rc) == XCCL_OK);
    a = get(rc, P(0) + 100, 1000, &ma);
    CHECK(nreg == 1);
    b = get(rc, P(0) + 10, 20, &mb); /* inside a's page: a hit */
    CHECK(nreg == 1 && mb == ma && b == a);
    xccl_rcache_put(rc, b);
    xccl_rcache_put(rc, a);
    CHECK(ndereg == 0); /* idle, still cached */
    b = get(rc, P(0), (size_t)page, &mb);
    CHECK(nreg == 1 && mb == ma);
    xccl_rcache_put(rc, b);
    /* a second registration two pages on, then one overlapping both: the union */
    c = get(rc, P(2), (size_t)page, &mc);
    CHECK(nreg == 2 && mc != ma);
    u = get(rc, P(0) + 500, (size_t)page * 2, &mu); /* pages 0-2: touches both */
    CHECK(nreg == 3);
    CHECK(mu->start == (uintptr_t)P(0) && mu->end == (uintptr_t)P(3));
    CHECK(!ma->live); /* idle and covered: gone at once */
    CHECK(mc->live);  /* covered but referenced: kept until its put */
    xccl_rcache_put(rc, c);
    CHECK(!mc->live && nbad == 0);
    /* page 1 alone is now a hit in the union */
    a = get(rc, P(1), 8, &ma);
    CHECK(ma == mu && nreg == 3);
    xccl_rcache_put(rc, a);
    xccl_rcache_put(rc, u);
    xccl_rcache_free(rc);
    CHECK(nlive() == 0 && nbad == 0);
}

static void test_invalidate(void)
{
    xccl_rcache_t *rc;
    xccl_rreg_t   *a, *b, *c;
    fake_mr_t     *ma, *mb, *mc;

    reset();
    CHECK(xccl_rcache_new(&fake_ops, NULL, &rc) == XCCL_OK);
    a = get(rc, P(4), (size_t)page * 2, &ma);
    c = get(rc, P(10), (size_t)page, &mc);
    xccl_rcache_put(rc, c); /* idle */
    xccl_rcache_invalidate(rc, P(5) + 7, 1); /* inside a, which is in use */
    CHECK(ma->live && ndereg == 0);
    b = get(rc, P(4), 64, &mb); /* a no longer answers: a fresh registration */
    CHECK(mb != ma && nreg == 3);
    xccl_rcache_put(rc, a); /* last reference of the invalidated entry */
    CHECK(!ma->live && ndereg == 1 && last_dereg == ma);
    xccl_rcache_invalidate(rc, P(9), (size_t)page * 3); /* c, idle: deregistered at once */
    CHECK(!mc->live && ndereg == 2);
    xccl_rcache_invalidate(rc, P(20), (size_t)page); /* nothing there */
    CHECK(ndereg == 2);
    c = get(rc, P(10), 4, &mc);
    CHECK(nreg == 4);
    xccl_rcache_put(rc, c);
    xccl_rcache_put(rc, b);
    xccl_rcache_free(rc);
    CHECK(nlive() == 0 && nbad == 0 && ndereg == nreg);
}

static void test_eviction(void)
{
    xccl_rcache_t *rc;
    xccl_rreg_t   *r[4];
    fake_mr_t     *m[4], *x;

    reset();
    setenv("XCCL_RCACHE_MAX_ENTRIES", "2", 1);
    CHECK(xccl_rcache_new(&fake_ops, NULL, &rc) == XCCL_OK);
    unsetenv("XCCL_RCACHE_MAX_ENTRIES");
    for (int i = 0; i < 3; i++) r[i] = get(rc, P(2 * i), 16, &m[i]);
    CHECK(nreg == 3 && ndereg == 0); /* referenced ones are never evicted */
    for (int i = 0; i < 3; i++) xccl_rcache_put(rc, r[i]); /* idle order: 0 (oldest), 1, 2 */
    CHECK(ndereg == 1 && last_dereg == m[0]);
    r[1] = get(rc, P(2), 16, &x); /* 1 used again: now 2 is the oldest idle */
    CHECK(x == m[1] && nreg == 3);
    xccl_rcache_put(rc, r[1]);
    r[3] = get(rc, P(6), 16, &m[3]);
    xccl_rcache_put(rc, r[3]);
    CHECK(ndereg == 2 && last_dereg == m[2] && m[1]->live && m[3]->live);
    xccl_rcache_free(rc);
    CHECK(nlive() == 0 && nbad == 0);

    /* by bytes: two idle pages fit, a third pushes the oldest out */
    reset();
    {
        char lim[32];
        snprintf(lim, sizeof(lim), "%ld", page * 2);
        setenv("XCCL_RCACHE_MAX_BYTES", lim, 1);
    }
    CHECK(xccl_rcache_new(&fake_ops, NULL, &rc) == XCCL_OK);
    unsetenv("XCCL_RCACHE_MAX_BYTES");
    for (int i = 0; i < 3; i++) {
        r[i] = get(rc, P(2 * i), 16, &m[i]);
        xccl_rcache_put(rc, r[i]);
    }
    CHECK(ndereg == 1 && last_dereg == m[0]);
    r[0] = get(rc, P(20), (size_t)page * 2, &m[0]); /* two pages in use */
    xccl_rcache_put(rc, r[0]); /* idle: 1, 2 and it, four pages: 1 and 2 go */
    CHECK(ndereg == 3 && m[0]->live && !m[1]->live && !m[2]->live);
    xccl_rcache_free(rc);
    CHECK(nlive() == 0 && nbad == 0);
}

static void test_failure_and_free(void)
{
    xccl_rcache_t *rc;
    xccl_rreg_t   *r, *held;
    fake_mr_t     *m, *mh;
    void          *h = NULL;

    reset();
    CHECK(xccl_rcache_new(&fake_ops, NULL, &rc) == XCCL_OK);
    r = get(rc, P(0), 16, &m);
    xccl_rcache_put(rc, r); /* idle */
    fail_next = 1;          /* refused once: the idle one goes, then it succeeds */
    held      = get(rc, P(8), 16, &mh);
    CHECK(!m->live && mh->live && nreg == 2);
    fail_next = 1; /* refused with nothing idle to let go: an error, nothing leaks */
    r         = NULL;
    CHECK(xccl_rcache_get(rc, P(12), 16, XCCL_MEM_HOST, &r, &h) == XCCL_ERR_SYSTEM);
    CHECK(r == NULL && h == NULL && fail_next == 0 && nreg == 2);
    CHECK(xccl_rcache_get(rc, P(12), 0, XCCL_MEM_HOST, &r, &h) == XCCL_OK && r == NULL);
    xccl_rcache_put(rc, r); /* NULL: nothing */
    xccl_rcache_put(rc, held);
    for (int i = 0; i < 5; i++) { /* five idle entries */
        r = get(rc, P(30 + 2 * i), 16, &m);
        xccl_rcache_put(rc, r);
    }
    CHECK(nlive() == 6);
    xccl_rcache_free(rc);
    CHECK(nlive() == 0 && nbad == 0 && ndereg == nreg);
}

/* The public call reaches the context's caches (a one-rank communicator whose transport slot
 * is given a cache over the fake transport). */
static void test_public_invalidate(void)
{
    char               path[128];
    xccl_store_t      *store = NULL;
    xccl_comm_t       *comm  = NULL;
    xccl_comm_config_t cfg   = {0};
    xccl_rcache_t     *rc;
    xccl_rreg_t       *r;
    fake_mr_t         *m;

    reset();
    snprintf(path, sizeof(path), "/tmp/xccl-test-rcache-%d", (int)getpid());
    unlink(path);
    CHECK(xccl_store_file_create(path, 1, 10000, &store) == XCCL_OK);
    cfg.rank  = 0;
    cfg.size  = 1;
    cfg.store = store;
    CHECK(xccl_comm_create(&cfg, &comm) == XCCL_OK);
    xccl_store_release(store);
    unlink(path);
    if (comm == NULL) return;
    CHECK(comm->ctx->ntp >= 1 && comm->ctx->tp[0].rcache == NULL);
    CHECK(xccl_rcache_new(&fake_ops, NULL, &rc) == XCCL_OK);
    comm->ctx->tp[0].rcache = rc;
    r = get(rc, P(3), 16, &m);
    xccl_rcache_put(rc, r);
    CHECK(xccl_comm_mem_invalidate(comm, P(3), 1) == XCCL_OK);
    CHECK(!m->live && ndereg == 1);
    CHECK(xccl_comm_mem_invalidate(NULL, P(3), 1) == XCCL_ERR_INVALID_ARG);
    comm->ctx->tp[0].rcache = NULL;
    xccl_rcache_free(rc);
    xccl_comm_destroy(comm);
    CHECK(nbad == 0);
}

int main(void)
{
    page  = sysconf(_SC_PAGESIZE);
    arena = aligned_alloc((size_t)page, (size_t)page * 64);
    test_hits_and_overlap();
    test_invalidate();
    test_eviction();
    test_failure_and_free();
    test_public_invalidate();
    free(arena);
    CTEST_MAIN_END("test_rcache");
}
