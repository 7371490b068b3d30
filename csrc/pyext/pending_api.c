/* SPDX-License-Identifier: Apache-2.0
 *
 * pending_api.c - TEMPORARY: weak stand-ins for the xccl_cuda_* functions of xccl.h that the
 * "cuda" branch of issue 16 implements, so that the extension links and its host paths can be
 * tested before they land. They behave as a build without CUDA does. Any real (strong)
 * definition replaces them at link time; this file is deleted once main has them.
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
