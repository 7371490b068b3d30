/* SPDX-License-Identifier: Apache-2.0
 *
 * ipc_cache.c - see ipc_cache.h.
 */
#include "cuda/ipc_cache.h"

#include <stdlib.h>
#include <string.h>

void ipc_cache_init(ipc_cache_t *c, int cap, void (*close)(void *, void *), void *arg)
{
    memset(c, 0, sizeof(*c));
    c->cap   = cap > 0 ? cap : 1;
    c->close = close;
    c->arg   = arg;
}

static void entry_close(ipc_cache_t *c, ipc_entry_t *e)
{
    if (c->close != NULL && e->mapped != NULL) {
        c->close(c->arg, e->mapped);
        c->closed++;
    }
    free(e);
}

/* Takes e (unlinked from `live`) out of the cache: closed now, or parked until unreferenced. */
static void entry_retire(ipc_cache_t *c, ipc_entry_t *e)
{
    if (e->refs > 0) {
        e->stale  = 1;
        e->next   = c->zombie;
        c->zombie = e;
        return;
    }
    entry_close(c, e);
}

static int overlaps(const ipc_entry_t *e, uint64_t base, uint64_t size)
{
    return base < e->base + e->size && e->base < base + size;
}

int ipc_cache_overlaps(const ipc_cache_t *c, int peer, uint64_t base, uint64_t size)
{
    for (const ipc_entry_t *e = c->live; e != NULL; e = e->next)
        if (e->peer == peer && overlaps(e, base, size)) return 1;
    return 0;
}

ipc_entry_t *ipc_cache_get(ipc_cache_t *c, int peer, uint64_t buf_id, uint64_t base, uint64_t size)
{
    ipc_entry_t *hit = NULL;

    for (ipc_entry_t **pp = &c->live; *pp != NULL;) {
        ipc_entry_t *e = *pp;
        if (e->peer != peer || !overlaps(e, base, size)) {
            pp = &e->next;
            continue;
        }
        if (e->buf_id == buf_id && e->base == base && e->size == size) {
            hit = e;
            pp  = &e->next;
            continue;
        }
        /* the owner freed that allocation and the range was reused */
        *pp = e->next;
        c->n--;
        c->stale_dropped++;
        entry_retire(c, e);
    }
    if (hit == NULL) {
        c->misses++;
        return NULL;
    }
    c->hits++;
    hit->refs++;
    hit->used = ++c->clock;
    return hit;
}

/* Evicts least recently used unreferenced entries while more than cap are live. */
static void evict(ipc_cache_t *c)
{
    while (c->n > c->cap) {
        ipc_entry_t **victim = NULL;
        for (ipc_entry_t **pp = &c->live; *pp != NULL; pp = &(*pp)->next) {
            if ((*pp)->refs == 0 && (victim == NULL || (*pp)->used < (*victim)->used)) victim = pp;
        }
        if (victim == NULL) return; /* every one is in use: over the cap until they are not */
        {
            ipc_entry_t *e = *victim;
            *victim        = e->next;
            c->n--;
            c->evicted++;
            entry_close(c, e);
        }
    }
}

ipc_entry_t *ipc_cache_add(ipc_cache_t *c, int peer, uint64_t buf_id, uint64_t base, uint64_t size,
                           void *mapped, const void *handle)
{
    ipc_entry_t *e = calloc(1, sizeof(*e));

    if (e == NULL) return NULL;
    e->peer   = peer;
    e->buf_id = buf_id;
    e->base   = base;
    e->size   = size;
    e->mapped = mapped;
    if (handle != NULL) memcpy(e->handle, handle, IPC_HANDLE_BYTES);
    e->refs = 1;
    e->used = ++c->clock;
    e->next = c->live;
    c->live = e;
    c->n++;
    evict(c);
    return e;
}

void ipc_cache_put(ipc_cache_t *c, ipc_entry_t *e)
{
    if (e == NULL || e->refs <= 0) return;
    if (--e->refs > 0) return;
    if (e->stale) {
        for (ipc_entry_t **pp = &c->zombie; *pp != NULL; pp = &(*pp)->next) {
            if (*pp == e) {
                *pp = e->next;
                break;
            }
        }
        entry_close(c, e);
        return;
    }
    evict(c); /* it may have kept the cache over its cap */
}

void ipc_cache_drop(ipc_cache_t *c, int peer)
{
    ipc_entry_t **lists[2] = {&c->live, &c->zombie};

    for (int k = 0; k < 2; k++) {
        for (ipc_entry_t **pp = lists[k]; *pp != NULL;) {
            ipc_entry_t *e = *pp;
            if (peer != -2 && e->peer != peer) {
                pp = &e->next;
                continue;
            }
            *pp = e->next;
            if (k == 0) c->n--;
            entry_close(c, e);
        }
    }
}
