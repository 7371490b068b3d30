/* SPDX-License-Identifier: Apache-2.0
 *
 * dlpack_check.h - the validation of a DLPack tensor's metadata (device, dtype, ndim, shape,
 * strides, data pointer, byte_offset, flags) as a pure C function: py_tensor.c calls it on
 * every tensor a producer exports, and tests/fuzz drives it without Python. Everything in the
 * DLTensor is the producer's word and is checked here before xccl uses any of it.
 */
#ifndef XCCL_PYEXT_DLPACK_CHECK_H
#define XCCL_PYEXT_DLPACK_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "dlpack.h"
#include "xccl/xccl.h"

/* What xccl_dlpack_check found wrong; the message says the rest. */
typedef enum xccl_dlpack_verdict {
    XCCL_DLPACK_OK = 0,
    XCCL_DLPACK_BAD_DTYPE,   /* a dtype xccl does not handle (Python: TypeError)             */
    XCCL_DLPACK_BAD_DEVICE,  /* a device this build does not move (XCCL_ERR_NOT_SUPPORTED)    */
    XCCL_DLPACK_MALFORMED,   /* metadata no valid tensor has, or unusable (XCCL_ERR_INVALID_ARG) */
} xccl_dlpack_verdict_t;

/* The tensor as xccl uses it: `data` (NULL only when count == 0) spans count * the dtype's
 * size bytes. */
typedef struct xccl_dlpack_view {
    void        *data;
    size_t       count;
    int64_t      rows; /* extent of dimension 0; -1 for a 0-d tensor */
    xccl_dtype_t dtype;
    int          read_only;
    int32_t      device_type, device_id;
} xccl_dlpack_view_t;

/* Checks `dl` (with the versioned tensor's flags, 0 for a legacy one). `output`: the operation
 * writes into it (read-only tensors and copies are refused); `any_device`: report the device
 * instead of refusing one other than the CPU. On anything but XCCL_DLPACK_OK, `msg` holds the
 * reason (without the argument's name), NUL-terminated, and *out holds the device only. */
xccl_dlpack_verdict_t xccl_dlpack_check(const DLTensor *dl, uint64_t dlflags, int output,
                                        int any_device, xccl_dlpack_view_t *out, char *msg,
                                        size_t msglen);

/* "cpu", "cuda:1", "device_type_99:0" into buf. */
void xccl_dlpack_device_str(int32_t device_type, int32_t device_id, char *buf, size_t len);

#endif /* XCCL_PYEXT_DLPACK_CHECK_H */
