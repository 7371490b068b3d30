/* SPDX-License-Identifier: Apache-2.0
 *
 * gate.c - the completion gates' bookkeeping (gate.h).
 */
#include "cuda/gate.h"

#include <stdlib.h>
#include <string.h>

#include "core/check.h"

static void free_flags(xccl_gates_t *g)
{
    free(g->busy);
    free(g->waited);
    free(g->owner);
    g->busy   = NULL;
    g->waited = NULL;
    g->owner  = NULL;
}

xccl_status_t xccl_gates_init(xccl_gates_t *g, uint32_t *words, uint32_t n)
{
    memset(g, 0, sizeof *g);
    if (words == NULL || n < 2 || (n & (n - 1)) != 0)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "gates: %u words (need a power of two >= 2)", n);
    g->busy   = calloc(n, 1);
    g->waited = calloc(n, 1);
    g->owner  = calloc(n, sizeof *g->owner);
    if (g->busy == NULL || g->waited == NULL || g->owner == NULL) {
        free_flags(g);
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "gates: out of memory");
    }
    atomic_init(&g->nwaited, 0);
    /* the words are plain memory until now; from here on only accessed atomically */
    g->words = (_Atomic uint32_t *)(void *)words;
    for (uint32_t w = 0; w < n; w++)
        atomic_store_explicit(&g->words[w], w, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    g->n    = n;
    g->next = n;
    if (pthread_mutex_init(&g->mu, NULL) != 0) {
        free_flags(g);
        return XCCL_ERROR(XCCL_ERR_INTERNAL, "gates: pthread_mutex_init failed");
    }
    return XCCL_OK;
}

void xccl_gates_fini(xccl_gates_t *g)
{
    if (g->busy == NULL) return;
    free_flags(g);
    pthread_mutex_destroy(&g->mu);
}

xccl_status_t xccl_gates_new(xccl_gates_t *g, uint32_t *ticket)
{
    uint32_t t, w;

    pthread_mutex_lock(&g->mu);
    if (g->nbusy == g->n) {
        uint32_t n = g->n;

        pthread_mutex_unlock(&g->mu);
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY,
                          "cuda: %u device operations wait to complete (their completion gates "
                          "are all in use)",
                          n);
    }
    /* some word is free: at most n - 1 busy ones are skipped */
    for (t = g->next;; t++) {
        w = t & (g->n - 1);
        if (!g->busy[w]) break;
    }
    g->busy[w]  = 1;
    g->owner[w] = t;
    g->nbusy++;
    g->next = t + 1;
    pthread_mutex_unlock(&g->mu);
    *ticket = t;
    return XCCL_OK;
}

static int cyclic_geq(uint32_t a, uint32_t b)
{
    return (int32_t)(a - b) >= 0;
}

void xccl_gates_open(xccl_gates_t *g, uint32_t ticket)
{
    uint32_t w = xccl_gates_word(g, ticket);

    pthread_mutex_lock(&g->mu);
    if (g->busy[w] && g->owner[w] == ticket) {
        atomic_store_explicit(&g->words[w], ticket, memory_order_release);
        g->busy[w] = 0;
        g->nbusy--;
        if (g->waited[w]) {
            g->waited[w] = 0;
            atomic_fetch_sub_explicit(&g->nwaited, 1, memory_order_release);
        }
    }
    pthread_mutex_unlock(&g->mu);
}

int xccl_gates_mark_waited(xccl_gates_t *g, uint32_t ticket)
{
    uint32_t w = xccl_gates_word(g, ticket);
    int      closed;

    pthread_mutex_lock(&g->mu);
    closed = g->busy[w] && g->owner[w] == ticket;
    if (closed && !g->waited[w]) {
        g->waited[w] = 1;
        atomic_fetch_add_explicit(&g->nwaited, 1, memory_order_acq_rel);
    }
    pthread_mutex_unlock(&g->mu);
    return closed;
}

int xccl_gates_is_open(xccl_gates_t *g, uint32_t ticket)
{
    uint32_t w = xccl_gates_word(g, ticket);

    return cyclic_geq(atomic_load_explicit(&g->words[w], memory_order_acquire), ticket);
}

void xccl_gates_unmark(xccl_gates_t *g, uint32_t ticket)
{
    uint32_t w = xccl_gates_word(g, ticket);

    pthread_mutex_lock(&g->mu);
    if (g->busy[w] && g->owner[w] == ticket && g->waited[w]) {
        g->waited[w] = 0;
        atomic_fetch_sub_explicit(&g->nwaited, 1, memory_order_release);
    }
    pthread_mutex_unlock(&g->mu);
}
