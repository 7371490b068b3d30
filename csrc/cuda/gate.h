/* SPDX-License-Identifier: Apache-2.0
 *
 * gate.h - the bookkeeping of the CUDA executor's completion gates (exec.h gate_new/open/wait),
 * pure C so that it is tested without a GPU (tests/c/test_cuda_gate.c).
 *
 * A gate lives in one 32-bit word of an array the device can read (pinned, mapped host memory).
 * A ticket is a value of a 32-bit counter; ticket t uses word t % n (n a power of two, so the
 * mapping survives the counter's wrap). Opening ticket t stores t into its word; a stream waits
 * until its word is >= t in the cyclic order (cuStreamWaitValue32 GEQ: (int32_t)(word - t) >= 0).
 * A word is given to a new ticket only once the previous ticket on it was opened (a busy flag
 * per word; busy words are skipped, and so are their tickets), so a word's value only grows, and
 * a stream still waiting for an older ticket on it stays released. Word w starts at w with the
 * counter at n: every first ticket t = n + w is closed until opened.
 *
 * Waited gates: gate_wait marks a closed gate as waited on by a stream (xccl_gates_mark_waited)
 * and opening it clears the mark; xccl_gates_nwaited counts the closed gates some stream waits
 * for. While that count is not zero the CUDA layer makes no call that may synchronise the
 * device (cuda_lib.h, "Implicit synchronisation").
 *
 * Thread-safe (one mutex): Works of several communicators take and open gates concurrently.
 */
#ifndef XCCL_CUDA_GATE_H
#define XCCL_CUDA_GATE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "xccl/xccl.h"

typedef struct xccl_gates {
    _Atomic uint32_t *words; /* n words, read by the device */
    uint8_t          *busy;  /* n flags: the word's ticket is not open yet */
    uint32_t         *owner; /* n tickets: the word's last ticket */
    uint32_t          n;     /* a power of two */
    uint32_t          next;  /* the next ticket to try */
    uint32_t          nbusy;
    uint8_t          *waited;  /* n flags: a stream waits for the word's (closed) ticket */
    _Atomic uint32_t  nwaited; /* closed gates a stream waits for */
    pthread_mutex_t   mu;
} xccl_gates_t;

/* words: n words of memory the caller owns (n a power of two >= 2); they are initialised here.
 * XCCL_ERR_INVALID_ARG for a bad n, XCCL_ERR_NO_MEMORY. */
xccl_status_t xccl_gates_init(xccl_gates_t *g, uint32_t *words, uint32_t n);
void          xccl_gates_fini(xccl_gates_t *g); /* frees the flags; the words are the caller's */
/* A new closed gate: *ticket. XCCL_ERR_NO_MEMORY (with a message) when all n are closed. */
xccl_status_t xccl_gates_new(xccl_gates_t *g, uint32_t *ticket);
/* Opens the gate of `ticket` (release store of the ticket into its word). Opening a ticket
 * that is not closed (never given, or opened already) does nothing. */
void xccl_gates_open(xccl_gates_t *g, uint32_t ticket);
/* The word of `ticket` (its index) */
static inline uint32_t xccl_gates_word(const xccl_gates_t *g, uint32_t ticket)
{
    return ticket & (g->n - 1);
}
/* 1 if the gate of `ticket` is open: its word is >= ticket in the cyclic order (what the device
 * checks). */
int xccl_gates_is_open(xccl_gates_t *g, uint32_t ticket);
/* Marks the gate of `ticket` as waited on by a stream, if it is still closed: 1 (marked; the
 * caller queues the stream's wait), 0 when it is open already (nothing to wait for). */
int xccl_gates_mark_waited(xccl_gates_t *g, uint32_t ticket);
/* Undoes a mark whose stream wait could not be queued (the gate may be open by then). */
void xccl_gates_unmark(xccl_gates_t *g, uint32_t ticket);
/* The number of closed gates a stream waits for. */
static inline uint32_t xccl_gates_nwaited(xccl_gates_t *g)
{
    return atomic_load_explicit(&g->nwaited, memory_order_acquire);
}

#endif /* XCCL_CUDA_GATE_H */
