/* SPDX-License-Identifier: Apache-2.0
 *
 * pending_api.c - TEMPORARY: weak stand-ins for the functions of xccl.h that other branches of
 * issue 16 implement (xccl_cuda_*, xccl_isend_opts/xccl_irecv_opts, xccl_work_wait_stream), so
 * that the extension links and its host paths can be tested before they land. They behave as
 * a build without CUDA does. Any real (strong) definition replaces them at link time; this
 * file is deleted once main has all of them.
 */
#include <stdio.h>
#include <string.h>

#include "xccl/xccl.h"

#define WEAK __attribute__((weak))

WEAK void xccl_cuda_info(xccl_cuda_info_t *out)
{
    memset(out, 0, sizeof(*out));
    out->device = -1;
    snprintf(out->why, sizeof(out->why), "xccl was built without CUDA support");
}

WEAK xccl_status_t xccl_cuda_set_device(int device)
{
    (void)device;
    return xccl_set_error(XCCL_ERR_NOT_SUPPORTED, "xccl was built without CUDA support");
}

WEAK xccl_status_t xccl_cuda_check_ptr(const void *ptr, size_t nbytes)
{
    (void)ptr;
    (void)nbytes;
    return xccl_set_error(XCCL_ERR_INVALID_USAGE, "no CUDA device chosen");
}

WEAK xccl_status_t xccl_isend_opts(xccl_comm_t *comm, const void *buf, size_t nbytes, int peer,
                                   uint32_t tag, const xccl_p2p_opts_t *opts, xccl_work_t **w)
{
    if (opts != NULL && opts->mem != XCCL_MEM_HOST)
        return xccl_set_error(XCCL_ERR_NOT_SUPPORTED, "send: device memory is not supported");
    return xccl_isend(comm, buf, nbytes, peer, tag, w);
}

WEAK xccl_status_t xccl_irecv_opts(xccl_comm_t *comm, void *buf, size_t nbytes, int peer,
                                   uint32_t tag, const xccl_p2p_opts_t *opts, xccl_work_t **w)
{
    if (opts != NULL && opts->mem != XCCL_MEM_HOST)
        return xccl_set_error(XCCL_ERR_NOT_SUPPORTED, "recv: device memory is not supported");
    return xccl_irecv(comm, buf, nbytes, peer, tag, w);
}

WEAK xccl_status_t xccl_work_wait_stream(xccl_work_t *w, void *stream)
{
    (void)w;
    (void)stream;
    return xccl_set_error(XCCL_ERR_INVALID_USAGE, "Work on host memory: no stream to order");
}
