/* SPDX-License-Identifier: Apache-2.0
 *
 * rcache.h - the registration cache: the core's single caller of a transport's mem_reg and
 * mem_dereg (transports with XCCL_TP_CAP_NEEDS_REG). One cache per transport context.
 *
 * A registration is looked up (or made) for every buffer handed to such a transport and held
 * until the transport lets go of the buffer (send_done / recv_done): xccl_rcache_get takes a
 * reference, xccl_rcache_put drops it. Invalidation (memory freed or remapped) makes an entry
 * unusable for new lookups at once; it is deregistered when its last reference goes, never
 * under a transport that still uses it. Memory freed or unmapped anywhere in the process is
 * seen by the memory hooks (memhook.h), applied before every lookup; without them
 * (XCCL_MEM_HOOKS=0) no entry is kept past its last reference.
 *
 * Threading: under the context lock.
 */
#ifndef XCCL_CORE_RCACHE_H
#define XCCL_CORE_RCACHE_H

#include <stddef.h>

#include "xccl/xccl_transport.h"

typedef struct xccl_rcache xccl_rcache_t;
typedef struct xccl_rreg   xccl_rreg_t; /* one registration */

xccl_status_t xccl_rcache_new(const xccl_transport_ops_t *ops, xccl_tp_ctx_t *tc,
                              xccl_rcache_t **out);
/* Deregisters everything (no reference may be held any more) and frees the cache. */
void          xccl_rcache_free(xccl_rcache_t *rc);
/* Starts the memory hooks (memhook.h) for this cache, once; the first lookup does it too. A
 * context calls it as soon as it knows it keeps the transport (not at creation: a transport that
 * serves no peer is dropped, and patching the process for it would be for nothing), before the
 * program gets to take function pointers (ctypes) that the hooks should still see. */
void          xccl_rcache_watch_memory(xccl_rcache_t *rc);
/* A registration covering [ptr, ptr + nbytes) of memory type mem: *mr is the transport's handle
 * to put in xccl_tp_buf_t.mr, *reg the reference to give back with xccl_rcache_put. */
xccl_status_t xccl_rcache_get(xccl_rcache_t *rc, void *ptr, size_t nbytes, xccl_mem_type_t mem,
                              xccl_rreg_t **reg, void **mr);
void          xccl_rcache_put(xccl_rcache_t *rc, xccl_rreg_t *reg);
/* [ptr, ptr + nbytes) is being freed or remapped: no later lookup returns a registration that
 * overlaps it. */
void          xccl_rcache_invalidate(xccl_rcache_t *rc, const void *ptr, size_t nbytes);

#endif /* XCCL_CORE_RCACHE_H */
