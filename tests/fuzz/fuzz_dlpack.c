/* SPDX-License-Identifier: Apache-2.0
 *
 * fuzz_dlpack.c - DLPack tensor metadata as a producer hands it over (csrc/pyext/dlpack_check.c,
 * the checks py_tensor.c runs on every capsule): device, dtype, ndim, shape, strides, data,
 * byte_offset and flags all come from the input. Shape and strides live in arrays of exactly
 * ndim entries, so reading one past them is caught by ASan.
 *
 * Checked beyond "no crash": an accepted tensor's element count is the product of its extents
 * (computed here in 128 bits) and count * itemsize fits a size_t; its strides (if any) are
 * row-major compact; its device is the CPU or pinned host memory unless any device was allowed;
 * data is data + byte_offset; an output is neither read-only nor a copy. A refused one carries a
 * message.
 */
#include "fuzz.h"

#include "../../csrc/pyext/dlpack_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_in_t             in = {data, size};
    DLTensor              dl;
    xccl_dlpack_view_t    v;
    xccl_dlpack_verdict_t verdict;
    uint64_t              dlflags;
    int                   output, any_device, ndim, has_strides;
    int64_t              *shape = NULL, *strides = NULL;
    char                  msg[512];
    static char           base[64];

    memset(&dl, 0, sizeof(dl));
    {
        uint8_t mode = (uint8_t)fuzz_take(&in, 1);
        output       = mode & 1;
        any_device   = (mode >> 1) & 1;
        has_strides  = (mode >> 2) & 1;
        if (mode & 8) dl.data = base; /* else NULL */
    }
    dl.device.device_type = (int32_t)(uint8_t)fuzz_take(&in, 1);
    dl.device.device_id   = (int32_t)fuzz_take(&in, 4);
    dl.dtype.code         = (uint8_t)fuzz_take(&in, 1);
    dl.dtype.bits         = (uint8_t)fuzz_take(&in, 1);
    dl.dtype.lanes        = (uint16_t)fuzz_take(&in, 2);
    dl.byte_offset        = fuzz_take(&in, 8);
    dlflags               = fuzz_take(&in, 8);
    ndim                  = (int8_t)fuzz_take(&in, 1); /* negative ones too */
    dl.ndim               = ndim;
    if (ndim > 0) {
        shape = malloc((size_t)ndim * sizeof(*shape));
        if (has_strides) strides = malloc((size_t)ndim * sizeof(*strides));
        FUZZ_CHECK(shape != NULL && (!has_strides || strides != NULL), "out of memory");
        for (int i = 0; i < ndim; i++) shape[i] = (int64_t)fuzz_take(&in, 8);
        for (int i = 0; has_strides && i < ndim; i++) strides[i] = (int64_t)fuzz_take(&in, 8);
        dl.shape   = shape;
        dl.strides = strides;
    } else if (ndim == 0 && has_strides) {
        static int64_t none;
        dl.strides = &none; /* 0-d tensors may carry a non-NULL, empty strides array */
    }

    verdict = xccl_dlpack_check(&dl, dlflags, output, any_device, &v, msg, sizeof(msg));
    FUZZ_CHECK(memchr(msg, '\0', sizeof(msg)) != NULL, "message not terminated");
    if (verdict != XCCL_DLPACK_OK) {
        FUZZ_CHECK(msg[0] != '\0', "refused (verdict %d) without a message", (int)verdict);
    } else {
        unsigned __int128 count = 1;
        size_t            itemsize = xccl_dtype_size(v.dtype);
        int64_t           expect   = 1;

        FUZZ_CHECK(itemsize > 0, "accepted dtype %d has no size", (int)v.dtype);
        FUZZ_CHECK(dl.dtype.lanes == 1, "accepted lanes %d", (int)dl.dtype.lanes);
        FUZZ_CHECK(ndim >= 0, "accepted ndim %d", ndim);
        for (int i = 0; i < ndim; i++) {
            FUZZ_CHECK(shape[i] >= 0, "accepted extent %lld", (long long)shape[i]);
            count *= (unsigned __int128)shape[i];
            if (count > (unsigned __int128)SIZE_MAX) count = (unsigned __int128)SIZE_MAX + 1;
        }
        FUZZ_CHECK(count == v.count, "count %zu, extents multiply to more or less", v.count);
        FUZZ_CHECK(count * itemsize <= SIZE_MAX, "count %zu of %zu-byte items overflows", v.count,
                   itemsize);
        if (strides != NULL && v.count > 0) {
            for (int i = ndim - 1; i >= 0; i--) {
                if (shape[i] == 1) continue;
                FUZZ_CHECK(strides[i] == expect, "accepted stride %lld of dimension %d (want %lld)",
                           (long long)strides[i], i, (long long)expect);
                expect = (int64_t)((uint64_t)expect * (uint64_t)shape[i]); /* last one unused */
            }
        }
        FUZZ_CHECK(any_device || v.device_type == kDLCPU || v.device_type == kDLCUDAHost,
                   "accepted device type %d", (int)v.device_type);
        FUZZ_CHECK(v.count == 0 || dl.data != NULL, "accepted NULL data with %zu elements",
                   v.count);
        FUZZ_CHECK(dl.data == NULL ||
                       dl.byte_offset <= UINTPTR_MAX - (uintptr_t)base - v.count * itemsize,
                   "byte_offset %llu with %zu elements wraps around the address space",
                   (unsigned long long)dl.byte_offset, v.count);
        FUZZ_CHECK(dl.data == NULL ? v.data == NULL
                                   : (uintptr_t)v.data == (uintptr_t)base + dl.byte_offset,
                   "data does not include byte_offset");
        FUZZ_CHECK(!output || !(dlflags & (DLPACK_FLAG_BITMASK_READ_ONLY |
                                           DLPACK_FLAG_BITMASK_IS_COPIED)),
                   "an output that is read-only or a copy was accepted");
        FUZZ_CHECK(v.rows == (ndim > 0 ? shape[0] : -1), "rows %lld", (long long)v.rows);
    }
    free(shape);
    free(strides);
    return 0;
}
