/* SPDX-License-Identifier: Apache-2.0
 *
 * tp_wrap.h - the pieces of a test transport that wraps another one (a built-in found with
 * xccl_transport_find), built against the public headers only. A test defines its own
 * `struct xccl_tp_ctx` whose FIRST member is a tpw_t, writes the entries it changes (isend,
 * upcalls, mem_reg, ...) and takes the rest from here: each tpw_* entry passes the call on to
 * the wrapped transport unchanged.
 *
 * Upcalls: tpw_init gives the wrapped transport either the core's own upcalls (shim NULL) or
 * the test's shim, whose `core` becomes the wrapper's context and whose NULL entries pass the
 * call on to the core unchanged (tpw_up_*); a shim entry reaches the core through tpw_core().
 */
#ifndef XCCL_TESTS_TP_WRAP_H
#define XCCL_TESTS_TP_WRAP_H

#include <stdlib.h>

#include "xccl/xccl.h"
#include "xccl/xccl_transport.h"

typedef struct tpw {
    const xccl_transport_ops_t *inner;
    xccl_tp_ctx_t              *ictx;
    const xccl_tp_upcalls_t    *up;   /* the core's upcalls                                   */
    xccl_tp_upcalls_t           mine; /* the shim given to the wrapped transport (if any)     */
} tpw_t;

#define TPW(c) ((tpw_t *)(c))

/* The core's upcalls, for a shim entry that passes a call on. */
static inline const xccl_tp_upcalls_t *tpw_core(void *core)
{
    return TPW(core)->up;
}

static inline xccl_status_t tpw_up_recv_match(void *core, int peer, const xccl_msg_hdr_t *hdr,
                                              xccl_tp_buf_t *dst, void **cookie)
{
    return tpw_core(core)->recv_match(tpw_core(core)->core, peer, hdr, dst, cookie);
}

static inline void tpw_up_recv_done(void *core, void *cookie, xccl_status_t st)
{
    tpw_core(core)->recv_done(tpw_core(core)->core, cookie, st);
}

static inline void tpw_up_send_done(void *core, void *cookie, xccl_status_t st)
{
    tpw_core(core)->send_done(tpw_core(core)->core, cookie, st);
}

static inline void tpw_up_peer_failed(void *core, int peer, xccl_status_t st, const char *why)
{
    tpw_core(core)->peer_failed(tpw_core(core)->core, peer, st, why);
}

/* Allocates the test's context (`size` bytes, zeroed, a tpw_t first) and initialises the
 * transport named `inner` inside it. */
static inline xccl_status_t tpw_init(const xccl_tp_init_params_t *params, xccl_tp_ctx_t **out,
                                     size_t size, const char *inner, const xccl_tp_upcalls_t *shim)
{
    tpw_t                *w = calloc(1, size);
    xccl_tp_init_params_t p = *params;
    xccl_status_t         st;

    if (w == NULL) return XCCL_ERR_NO_MEMORY;
    w->inner = xccl_transport_find(inner);
    w->up    = params->up;
    if (shim != NULL) {
        w->mine             = *shim;
        w->mine.core        = w;
        w->mine.recv_match  = shim->recv_match ? shim->recv_match : tpw_up_recv_match;
        w->mine.recv_done   = shim->recv_done ? shim->recv_done : tpw_up_recv_done;
        w->mine.send_done   = shim->send_done ? shim->send_done : tpw_up_send_done;
        w->mine.peer_failed = shim->peer_failed ? shim->peer_failed : tpw_up_peer_failed;
        p.up                = &w->mine;
    }
    st = w->inner != NULL ? w->inner->init(&p, &w->ictx) : XCCL_ERR_NOT_SUPPORTED;
    if (st < 0) {
        free(w);
        return st;
    }
    *out = (xccl_tp_ctx_t *)w;
    return XCCL_OK;
}

static inline void tpw_finalize(xccl_tp_ctx_t *c)
{
    TPW(c)->inner->finalize(TPW(c)->ictx);
    free(c);
}

static inline int tpw_reachable(const xccl_tp_ctx_t *c, int peer)
{
    const tpw_t *w = (const tpw_t *)c;
    return w->inner->reachable(w->ictx, peer);
}

static inline xccl_status_t tpw_get_addr(xccl_tp_ctx_t *c, void *addr, size_t *len)
{
    return TPW(c)->inner->get_addr(TPW(c)->ictx, addr, len);
}

static inline xccl_status_t tpw_wireup(xccl_tp_ctx_t *c, const void *const *addrs,
                                       const size_t *lens, const uint8_t *use, int64_t timeout_ms)
{
    return TPW(c)->inner->wireup(TPW(c)->ictx, addrs, lens, use, timeout_ms);
}

static inline xccl_status_t tpw_isend(xccl_tp_ctx_t *c, int peer, const xccl_msg_hdr_t *hdr,
                                      const xccl_tp_buf_t *buf, void *cookie)
{
    return TPW(c)->inner->isend(TPW(c)->ictx, peer, hdr, buf, cookie);
}

static inline xccl_status_t tpw_progress(xccl_tp_ctx_t *c, int *nevents)
{
    return TPW(c)->inner->progress(TPW(c)->ictx, nevents);
}

static inline void tpw_wait(xccl_tp_ctx_t *c, int timeout_ms)
{
    TPW(c)->inner->wait(TPW(c)->ictx, timeout_ms);
}

static inline void tpw_wake(xccl_tp_ctx_t *c)
{
    TPW(c)->inner->wake(TPW(c)->ictx);
}

static inline void tpw_close_peer(xccl_tp_ctx_t *c, int peer, const char *why)
{
    TPW(c)->inner->close_peer(TPW(c)->ictx, peer, why);
}

#endif /* XCCL_TESTS_TP_WRAP_H */
