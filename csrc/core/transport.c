/* SPDX-License-Identifier: Apache-2.0
 *
 * transport.c - the registry of built-in transports: the only file that names backends.
 */
#include "core/core.h"

extern const xccl_transport_ops_t xccl_transport_tcp;
#ifdef XCCL_HAVE_SHM
extern const xccl_transport_ops_t xccl_transport_shm;
#endif

static const xccl_transport_ops_t *const builtin[] = {
#ifdef XCCL_HAVE_SHM
    &xccl_transport_shm,
#endif
    &xccl_transport_tcp,
    NULL,
};

const xccl_transport_ops_t *const *xccl_transport_list(void) { return builtin; }
