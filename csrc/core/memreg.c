/* SPDX-License-Identifier: Apache-2.0
 *
 * memreg.c - invalidation of a range in the registration caches (rcache.h) of every transport
 * of a context: by the user (xccl_comm_mem_invalidate) and by the core for its own memory.
 */
#include "core/core.h"

void xccl_ctx_mem_forget(xccl_ctx_t *ctx, const void *ptr, size_t nbytes)
{
    for (int i = 0; i < ctx->ntp; i++) {
        if (ctx->tp[i].rcache != NULL) xccl_rcache_invalidate(ctx->tp[i].rcache, ptr, nbytes);
    }
}

xccl_status_t xccl_comm_mem_invalidate(xccl_comm_t *comm, const void *ptr, size_t nbytes)
{
    xccl_ctx_t *ctx;

    if (comm == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "mem invalidate: the communicator is NULL");
    if (nbytes == 0) return XCCL_OK;
    ctx = comm->ctx;
    pthread_mutex_lock(&ctx->lock);
    xccl_ctx_mem_forget(ctx, ptr, nbytes);
    pthread_mutex_unlock(&ctx->lock);
    return XCCL_OK;
}
