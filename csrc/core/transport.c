/* SPDX-License-Identifier: Apache-2.0
 *
 * transport.c - the registry of built-in transports: the only file that names backends.
 */
#include "core/core.h"

extern const xccl_transport_ops_t xccl_transport_tcp;
extern const xccl_transport_ops_t xccl_transport_shm;

static const xccl_transport_ops_t *const builtin[] = {
    &xccl_transport_shm,
    &xccl_transport_tcp,
    NULL,
};

const xccl_transport_ops_t *const *xccl_transport_list(void) { return builtin; }
