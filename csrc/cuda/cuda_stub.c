/* SPDX-License-Identifier: Apache-2.0
 *
 * cuda_stub.c - xccl.h's CUDA functions in a build without CUDA (the headers were not found;
 * setup.py leaves the rest of csrc/cuda out): they say why, in XCCL_CUDA_WHY.
 */
#include <stdio.h>
#include <string.h>

#include "core/check.h"

#ifndef XCCL_HAVE_CUDA

#ifndef XCCL_CUDA_WHY
#define XCCL_CUDA_WHY "built without CUDA"
#endif

void xccl_cuda_info(xccl_cuda_info_t *out)
{
    if (out == NULL) return;
    memset(out, 0, sizeof *out);
    out->device = -1;
    snprintf(out->why, sizeof out->why, "xccl was %s%s", "built without CUDA: ", XCCL_CUDA_WHY);
}

xccl_status_t xccl_cuda_set_device(int device)
{
    return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                      "cuda: cannot use device %d: xccl was built without CUDA (%s)", device,
                      XCCL_CUDA_WHY);
}

xccl_status_t xccl_cuda_check_ptr(const void *ptr, size_t nbytes)
{
    (void)nbytes;
    return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                      "cuda: cannot check %p: xccl was built without CUDA (%s)", ptr,
                      XCCL_CUDA_WHY);
}

#else
typedef int xccl_cuda_stub_unused_t; /* the real functions are in cuda_lib.c */
#endif
