/* SPDX-License-Identifier: Apache-2.0
 *
 * ipc_test.h - counters of a cuda_ipc context, for tests (tests/c/test_cuda_ipc.c).
 */
#ifndef XCCL_IPC_TEST_H
#define XCCL_IPC_TEST_H

#include <stdint.h>

#include "xccl/xccl_transport.h"

typedef struct ipc_test_stats {
    uint64_t dev_sends;    /* device sends carried by a descriptor                          */
    uint64_t bounce_sends; /* device sends copied through host memory (not exportable)      */
    uint64_t desc_recvs;   /* descriptors whose data was copied                              */
    uint64_t bounce_recvs; /* host messages copied to device memory                          */
    uint64_t deferred;     /* times the core deferred a descriptor                           */
    uint64_t resends;      /* descriptors whose bytes were sent again (the peer cannot map)  */
    uint64_t resend_recvs; /* descriptors this rank could not map                           */
    uint64_t imp_hits, imp_misses, imp_stale, imp_evicted, imp_closed, imp_live;
    uint64_t exp_hits, exp_misses;
} ipc_test_stats_t;

extern const xccl_transport_ops_t xccl_transport_cuda_ipc;

/* Fills *out from a cuda_ipc context (the one the core holds for it). */
void xccl_cuda_ipc_test_stats(const xccl_tp_ctx_t *ctx, ipc_test_stats_t *out);
/* The name of the transport carrying its messages ("shm" or "tcp"). */
const char *xccl_cuda_ipc_test_inner(const xccl_tp_ctx_t *ctx);

#endif /* XCCL_IPC_TEST_H */
