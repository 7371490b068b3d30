/* SPDX-License-Identifier: Apache-2.0
 *
 * comm.c - communicators: creation over a store, local splits, destroy/abort, accessors.
 *
 * A split is purely local: its id is a hash of the parent's id, the member list and how many
 * splits with that member list the parent made before (parent->splits), so members agree on it
 * without talking.
 *
 * Lifetime: see struct xccl_comm in core.h. A freed communicator leaves its id in ctx->gone for
 * the next XCCL_GONE_IDS frees, so that messages still on their way to it are dropped on
 * arrival; one arriving later than that is kept as if for a communicator not created yet.
 */
#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/auth.h"

static xccl_comm_t *comm_alloc(xccl_ctx_t *ctx, int rank, int size, const char *name)
{
    xccl_comm_t *c = calloc(1, sizeof(*c));

    if (c == NULL) return NULL;
    c->world   = calloc((size_t)size, sizeof(int));
    c->rank_of = malloc((size_t)ctx->size * sizeof(int));
    c->posted  = calloc((size_t)size, sizeof(*c->posted));
    c->unexp   = calloc((size_t)size, sizeof(*c->unexp));
    if (c->world == NULL || c->rank_of == NULL || c->posted == NULL || c->unexp == NULL) {
        xccl_comm_free(c);
        return NULL;
    }
    for (int i = 0; i < ctx->size; i++) c->rank_of[i] = -1;
    c->ctx  = ctx;
    c->refs = 1; /* the user's handle */
    c->rank = rank;
    c->size = size;
    snprintf(c->name, sizeof(c->name), "%s", name && *name ? name : "world");
    return c;
}

xccl_status_t xccl_comm_create(const xccl_comm_config_t *cfg, xccl_comm_t **out)
{
    xccl_comm_config_t c2;
    xccl_ctx_t        *ctx;
    xccl_comm_t       *c;
    xccl_status_t      st;

    if (cfg == NULL || out == NULL || cfg->store == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "comm create: config, store and out are required");
    if (cfg->size < 1 || cfg->rank < 0 || cfg->rank >= cfg->size)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "comm create: rank %d is not in [0, %d)",
                          cfg->rank, cfg->size);
    c2 = *cfg;
    if (c2.timeout_ms <= 0) c2.timeout_ms = xccl_env_int("XCCL_TIMEOUT_MS", 600000);
    st = xccl_ctx_create(&c2, &ctx);
    if (st < 0) return st;
    c = comm_alloc(ctx, cfg->rank, cfg->size, cfg->name);
    if (c == NULL) {
        xccl_ctx_release(ctx);
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "comm create: out of memory");
    }
    for (int i = 0; i < cfg->size; i++) c->world[i] = c->rank_of[i] = i;
    if (xccl_comm_topo_init(c) < 0) {
        xccl_comm_free(c);
        xccl_ctx_release(ctx);
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "comm create: out of memory");
    }
    c->id         = ctx->job_id;
    c->timeout_ms = c2.timeout_ms;
    pthread_mutex_lock(&ctx->lock);
    if (xccl_u64map_put(&ctx->comms, c->id, c) < 0) {
        pthread_mutex_unlock(&ctx->lock);
        xccl_comm_free(c);
        xccl_ctx_release(ctx);
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "comm create: out of memory");
    }
    ctx->ncomms = 1;
    xccl_ctx_adopt(ctx, c);
    pthread_mutex_unlock(&ctx->lock);
    *out        = c;
    xccl_diag_comm_ready(c); /* idle ranks answer hang-diagnosis queries */
    XCCL_INFO("comm '%s' rank %d/%d created (job %016llx)", c->name, c->rank, c->size,
              (unsigned long long)c->id);
    return XCCL_OK;
}

xccl_status_t xccl_comm_split(xccl_comm_t *parent, int nranks, const int *ranks, const char *name,
                              xccl_comm_t **out)
{
    xccl_ctx_t   *ctx;
    xccl_comm_t  *c;
    int           me = -1;
    xccl_sha256_t h;
    uint8_t       digest[XCCL_SHA256_LEN];
    uint64_t      nth, members;

    if (parent == NULL || ranks == NULL || out == NULL || nranks < 1)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "comm split: a non-empty rank list is required");
    if (parent->destroyed)
        return XCCL_ERROR(XCCL_ERR_INVALID_USAGE, "comm split: parent comm '%s' was destroyed",
                          parent->name);
    for (int i = 0; i < nranks; i++) {
        if (ranks[i] < 0 || ranks[i] >= parent->size)
            return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                              "comm split: rank %d is not in the parent's range [0, %d)", ranks[i],
                              parent->size);
        for (int j = 0; j < i; j++) {
            if (ranks[j] == ranks[i])
                return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "comm split: rank %d is listed twice",
                                  ranks[i]);
        }
        if (ranks[i] == parent->rank) me = i;
    }
    if (me < 0)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                          "comm split: rank %d is not a member of the new communicator",
                          parent->rank);
    ctx = parent->ctx;
    c   = comm_alloc(ctx, me, nranks, name);
    if (c == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "comm split: out of memory");
    for (int i = 0; i < nranks; i++) {
        c->world[i]             = parent->world[ranks[i]];
        c->rank_of[c->world[i]] = i;
    }
    c->timeout_ms = parent->timeout_ms;
    if (xccl_comm_topo_init(c) < 0) {
        xccl_comm_free(c);
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "comm split: out of memory");
    }

    pthread_mutex_lock(&ctx->lock);
    /* how many splits of the parent had this exact member list before */
    xccl_sha256_init(&h);
    xccl_sha256_update(&h, c->world, (size_t)nranks * sizeof(int));
    xccl_sha256_final(&h, digest);
    memcpy(&members, digest, sizeof(members));
    members |= 1; /* map keys are nonzero */
    nth = (uint64_t)(uintptr_t)xccl_u64map_get(&parent->splits, members);
    xccl_sha256_init(&h);
    xccl_sha256_update(&h, &parent->id, sizeof(parent->id));
    xccl_sha256_update(&h, c->world, (size_t)nranks * sizeof(int));
    xccl_sha256_update(&h, &nth, sizeof(nth));
    xccl_sha256_final(&h, digest);
    memcpy(&c->id, digest, sizeof(c->id));
    c->parent_id = parent->id;
    if (c->id == 0 || xccl_u64map_get(&ctx->comms, c->id) != NULL ||
        xccl_u64map_put(&parent->splits, members, (void *)(uintptr_t)(nth + 1)) < 0 ||
        xccl_u64map_put(&ctx->comms, c->id, c) < 0) {
        /* an id of 0 or one seen before: a 2^-64 accident, refused rather than confused */
        pthread_mutex_unlock(&ctx->lock);
        xccl_comm_free(c);
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "comm split: out of memory (or id collision)");
    }
    ctx->ncomms++;
    ctx->refcount++;
    xccl_ctx_adopt(ctx, c);
    pthread_mutex_unlock(&ctx->lock);
    *out = c;
    return XCCL_OK;
}

void xccl_comm_fail_all(xccl_comm_t *comm, xccl_status_t st, const char *why)
{
    /* finishing a Work unlinks it from comm->works (and may finish others) */
    while (comm->works_head != NULL) xccl_work_finish(comm->works_head, st, why);
}

static void comm_shutdown(xccl_comm_t *comm, const char *what)
{
    xccl_ctx_t *ctx = comm->ctx;
    char        why[160];

    pthread_mutex_lock(&ctx->lock);
    if (comm->destroyed) {
        pthread_mutex_unlock(&ctx->lock);
        return;
    }
    snprintf(why, sizeof(why), "comm '%s' was %s", comm->name, what);
    comm->destroyed   = 1;
    comm->async_error = XCCL_ERR_ABORTED;
    xccl_comm_fail_all(comm, XCCL_ERR_ABORTED, why);
    xccl_comm_free_spare(comm);     /* failed operations freed their own scratch */
    xccl_umsg_drop_comm(ctx, comm); /* they will never be received */
    pthread_mutex_unlock(&ctx->lock);
    xccl_ctx_run_callbacks(ctx);
}

void xccl_comm_abort(xccl_comm_t *comm)
{
    if (comm != NULL) comm_shutdown(comm, "aborted");
}

void xccl_comm_destroy(xccl_comm_t *comm)
{
    xccl_ctx_t *ctx;

    if (comm == NULL) return;
    ctx = comm->ctx;
    comm_shutdown(comm, "destroyed");
    pthread_mutex_lock(&ctx->lock);
    xccl_comm_unref(comm); /* the handle's reference: comm may be freed here */
    pthread_mutex_unlock(&ctx->lock);
    xccl_ctx_release(ctx);
}

xccl_comm_t xccl_comm_gone = {.destroyed = 1, .name = "(destroyed)"};

void xccl_comm_free(xccl_comm_t *c)
{
    xccl_shared_free(c);
    free(c->trace);
    free(c->broken);
    free(c->world);
    free(c->rank_of);
    free(c->posted);
    free(c->unexp);
    free((void *)c->topo.node_of);
    xccl_comm_free_spare(c);
    xccl_comm_free_queues(c);
    xccl_u64map_free(&c->splits);
    xccl_u64map_free(&c->colls);
    free(c);
}

void xccl_comm_unref(xccl_comm_t *c)
{
    xccl_ctx_t *ctx = c->ctx;

    if (--c->refs > 0) return;
    /* only a destroyed communicator loses its handle's reference */
    if (ctx->gone_ids == NULL) ctx->gone_ids = calloc(XCCL_GONE_IDS, sizeof(uint64_t));
    if (ctx->gone_ids != NULL) {
        uint64_t *slot = &ctx->gone_ids[ctx->gone_next++ % XCCL_GONE_IDS];
        if (*slot != 0) (void)xccl_u64map_del(&ctx->comms, *slot);
        *slot = c->id;
        /* replacing a value never allocates */
        (void)xccl_u64map_put(&ctx->comms, c->id, &xccl_comm_gone);
    } else {
        (void)xccl_u64map_del(&ctx->comms, c->id);
    }
    ctx->ncomms--;
    xccl_comm_free(c);
}

int      xccl_comm_rank(const xccl_comm_t *comm) { return comm->rank; }
int      xccl_comm_size(const xccl_comm_t *comm) { return comm->size; }
uint64_t xccl_comm_id(const xccl_comm_t *comm) { return comm->id; }

int xccl_comm_global_rank(const xccl_comm_t *comm, int rank)
{
    if (rank < 0 || rank >= comm->size) return -1;
    return comm->world[rank];
}

int xccl_comm_rank_of_world(const xccl_comm_t *comm, int world_rank)
{
    if (comm->rank_of == NULL || world_rank < 0 || world_rank >= comm->ctx->size) return -1;
    return comm->rank_of[world_rank];
}

const char *xccl_comm_peer_transport(const xccl_comm_t *comm, int peer)
{
    int w;

    if (peer < 0 || peer >= comm->size) return "?";
    w = comm->world[peer];
    if (w == comm->ctx->rank) return "self";
    return comm->ctx->tp[comm->ctx->peer_tp[w]].ops->name;
}

xccl_status_t xccl_comm_async_error(const xccl_comm_t *comm) { return comm->async_error; }

xccl_comm_t *xccl_ctx_find_comm(xccl_ctx_t *ctx, uint64_t id)
{
    return id != 0 ? xccl_u64map_get(&ctx->comms, id) : NULL;
}
