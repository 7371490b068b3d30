/* SPDX-License-Identifier: Apache-2.0
 *
 * mh_pyshim.c - the registration cache and the memory hooks (csrc/core/rcache.c, memhook.c)
 * compiled on their own into a shared object with this file, for tests/test_memhook.py: it
 * loads them with ctypes into a Python process, so that the hooks patch the interpreter (its
 * binary, libpython when separate) and numpy's modules, and numpy arrays freed and allocated
 * again at the same address must be registered again. No NEEDS_REG transport reaches Python on
 * a host without RDMA; this one is a fake whose registrations record a fingerprint of their
 * pages. The few core functions the two files call are defined here.
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/check.h"
#include "core/memhook.h"
#include "core/rcache.h"

/* ---- what rcache.c and memhook.c need of the core -------------------------------------------- */

int64_t xccl_env_int(const char *name, int64_t def)
{
    const char *v = getenv(name);
    return v != NULL && *v != '\0' ? strtoll(v, NULL, 0) : def;
}

xccl_log_level_t xccl_log_level(void)
{
    return getenv("XCCL_DEBUG") ? XCCL_LOG_INFO : XCCL_LOG_NONE;
}

void xccl_log(xccl_log_level_t lvl, const char *file, int line, const char *fmt, ...)
{
    va_list ap;

    (void)lvl;
    fprintf(stderr, "mh_pyshim %s:%d ", file, line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

xccl_status_t xccl_error_report(xccl_status_t st, const char *file, int line, const char *fmt, ...)
{
    (void)file, (void)line, (void)fmt;
    return st;
}

/* ---- the fake transport ---------------------------------------------------------------------- */

typedef struct shim_mr {
    uintptr_t start, end;
    uint64_t  fp;
    int       live;
} shim_mr_t;

enum { SHIM_MAXMR = 1 << 16 };
static shim_mr_t mrs[SHIM_MAXMR];
static int       nreg;

static uint64_t fingerprint(uintptr_t s, uintptr_t e)
{
    uint64_t h = 1469598103934665603ull;

    for (const unsigned char *p = (const unsigned char *)s; p < (const unsigned char *)e; p += 61)
        h = (h ^ *p) * 1099511628211ull;
    return h;
}

static xccl_status_t shim_reg(xccl_tp_ctx_t *tc, void *ptr, size_t nbytes, xccl_mem_type_t mem,
                              void **mr)
{
    (void)tc, (void)mem;
    if (nreg >= SHIM_MAXMR) return XCCL_ERR_NO_MEMORY;
    mrs[nreg] = (shim_mr_t){(uintptr_t)ptr, (uintptr_t)ptr + nbytes,
                            fingerprint((uintptr_t)ptr, (uintptr_t)ptr + nbytes), 1};
    *mr       = &mrs[nreg++];
    return XCCL_OK;
}

static void shim_dereg(xccl_tp_ctx_t *tc, void *mr)
{
    (void)tc;
    ((shim_mr_t *)mr)->live = 0;
}

static const xccl_transport_ops_t shim_ops = {
    .abi_version = XCCL_TRANSPORT_ABI_VERSION,
    .name        = "shim",
    .caps        = XCCL_TP_CAP_HOST_MEM | XCCL_TP_CAP_NEEDS_REG,
    .mem_reg     = shim_reg,
    .mem_dereg   = shim_dereg,
};

/* ---- what the test calls --------------------------------------------------------------------- */

void *mh_cache_new(void);
void  mh_cache_free(void *rc);
long  mh_use(void *rc, void *p, size_t n);
int   mh_live(long id);
int   mh_fresh(long id);
int   mh_nreg(void);
int   mh_stats(int *slots, int *objects, unsigned long long *events);

void *mh_cache_new(void)
{
    xccl_rcache_t *rc = NULL;
    return xccl_rcache_new(&shim_ops, NULL, &rc) == XCCL_OK ? rc : NULL;
}

void mh_cache_free(void *rc) { xccl_rcache_free(rc); }

/* One operation's registration of [p, p + n): its number, or -1. */
long mh_use(void *rc, void *p, size_t n)
{
    xccl_rreg_t *reg = NULL;
    void        *mr  = NULL;

    if (xccl_rcache_get(rc, p, n, XCCL_MEM_HOST, &reg, &mr) != XCCL_OK || mr == NULL) return -1;
    xccl_rcache_put(rc, reg);
    return (long)((shim_mr_t *)mr - mrs);
}

int mh_live(long id) { return id >= 0 && id < nreg && mrs[id].live; }

/* Registration id's fingerprint is that of its pages now. */
int mh_fresh(long id)
{
    return id >= 0 && id < nreg && mrs[id].fp == fingerprint(mrs[id].start, mrs[id].end);
}

int mh_nreg(void) { return nreg; }

int mh_stats(int *slots, int *objects, unsigned long long *events)
{
    xccl_memhook_stats_t s;

    xccl_memhook_stats(&s);
    *slots   = s.slots;
    *objects = s.objects;
    *events  = s.events;
    return s.active;
}
