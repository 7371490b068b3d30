/* SPDX-License-Identifier: Apache-2.0
 *
 * rcache.c - registration cache (rcache.h). This first version caches nothing: every get
 * registers and every put deregisters.
 */
#include "core/rcache.h"

#include <stdlib.h>

#include "core/check.h"

struct xccl_rreg {
    void *mr;
};

struct xccl_rcache {
    const xccl_transport_ops_t *ops;
    xccl_tp_ctx_t              *tc;
};

xccl_status_t xccl_rcache_new(const xccl_transport_ops_t *ops, xccl_tp_ctx_t *tc,
                              xccl_rcache_t **out)
{
    xccl_rcache_t *rc = calloc(1, sizeof(*rc));

    if (rc == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "registration cache: out of memory");
    rc->ops = ops;
    rc->tc  = tc;
    *out    = rc;
    return XCCL_OK;
}

void xccl_rcache_free(xccl_rcache_t *rc) { free(rc); }

xccl_status_t xccl_rcache_get(xccl_rcache_t *rc, void *ptr, size_t nbytes, xccl_mem_type_t mem,
                              xccl_rreg_t **reg, void **mr)
{
    xccl_rreg_t  *r = malloc(sizeof(*r));
    xccl_status_t st;

    if (r == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "registration cache: out of memory");
    st = rc->ops->mem_reg(rc->tc, ptr, nbytes, mem, &r->mr);
    if (st < 0) {
        free(r);
        return st;
    }
    *reg = r;
    *mr  = r->mr;
    return XCCL_OK;
}

void xccl_rcache_put(xccl_rcache_t *rc, xccl_rreg_t *reg)
{
    if (reg == NULL) return;
    rc->ops->mem_dereg(rc->tc, reg->mr);
    free(reg);
}

void xccl_rcache_invalidate(xccl_rcache_t *rc, const void *ptr, size_t nbytes)
{
    (void)rc, (void)ptr, (void)nbytes;
}
