/* SPDX-License-Identifier: Apache-2.0
 *
 * memreg.c - the public face of the registration caches (rcache.h): invalidation of a range on
 * every transport of a context.
 */
#include "core/core.h"

xccl_status_t xccl_comm_mem_invalidate(xccl_comm_t *comm, const void *ptr, size_t nbytes)
{
    xccl_ctx_t *ctx;

    if (comm == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "mem invalidate: the communicator is NULL");
    if (nbytes == 0) return XCCL_OK;
    ctx = comm->ctx;
    pthread_mutex_lock(&ctx->lock);
    for (int i = 0; i < ctx->ntp; i++) {
        if (ctx->tp[i].rcache != NULL) xccl_rcache_invalidate(ctx->tp[i].rcache, ptr, nbytes);
    }
    pthread_mutex_unlock(&ctx->lock);
    return XCCL_OK;
}
