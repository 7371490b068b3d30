/* SPDX-License-Identifier: Apache-2.0
 *
 * cuda_exec.h - the CUDA executor (core/exec.h) for XCCL_MEM_CUDA, and the launcher of the
 * multi-source reduction kernel for GPU algorithms that read several peers' buffers. Needs the
 * CUDA headers (included by cuda_lib.h); used by cuda_lib.c and GPU algorithms' backends.
 */
#ifndef XCCL_CUDA_EXEC_H
#define XCCL_CUDA_EXEC_H

#include "core/exec.h"
#include "cuda/cuda_lib.h"

/* Sources of xccl_cuda_reduce_n, at most (kernels.cu's XCCL_REDUCE_N_MAX). */
#define XCCL_CUDA_REDUCE_N_MAX 8

extern const xccl_exec_ops_t xccl_exec_cuda;

/* Called by xccl_cuda_set_device with the device's primary context current: loads the kernels'
 * module, allocates the gates, reads the device's limits. */
xccl_status_t xccl_cuda_exec_init(CUdevice dev);
/* Undoes xccl_cuda_exec_init (its failure path: the context is about to be released). */
void xccl_cuda_exec_fini(void);

/* The GPU code compiled into this build ("sm_75 ... compute_121"; "" without kernels) and why
 * there are no kernels ("" when there are). */
const char *xccl_cuda_kernel_archs(void);
const char *xccl_cuda_kernel_why(void);

/* dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[k-1][i] (in that order), 1 <= k <=
 * XCCL_CUDA_REDUCE_N_MAX, on `stream` (NULL: xccl's stream); the semantics of xccl_reduce_n
 * (float16/bfloat16 accumulated in float32 and rounded once; k == 1 copies, bool normalised to
 * 0/1). Every pointer is device memory (or mapped memory) the device can read; dst may equal
 * any source. op a base operator valid for dtype. Queues the work and returns; the caller
 * orders what follows (an event, or the same stream). */
xccl_status_t xccl_cuda_reduce_n(void *dst, const void *const *srcs, int k, size_t count,
                                 xccl_dtype_t dtype, xccl_op_t op, CUstream stream);

/* Peer access of the executor (exec.h export_mem / import_mem; cuda_peer.c): legacy CUDA IPC
 * handles, cached on both sides; mappings last until evicted or found stale, at most until the
 * process exits (its device is never released). */
xccl_status_t xccl_cuda_export_mem(const void *ptr, size_t nbytes, void *blob, size_t *len);
xccl_status_t xccl_cuda_import_mem(const void *blob, size_t len, void **ptr);
/* Opens the peers' buffers whose import was refused for now, if no stream waits any more
 * (cuda_peer.c); called when a device operation is posted. */
void          xccl_cuda_peer_warm(void);

#endif /* XCCL_CUDA_EXEC_H */
