/* SPDX-License-Identifier: Apache-2.0
 *
 * dlpack_check.c - see dlpack_check.h. No Python here: the fuzz harness links this file alone
 * (with the engine, for xccl_dtype_size).
 */
#include "dlpack_check.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

static const char *device_name(int32_t type)
{
    switch (type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda";
    case kDLCUDAHost: return "cuda_host";
    case kDLOpenCL: return "opencl";
    case kDLVulkan: return "vulkan";
    case kDLMetal: return "metal";
    case kDLVPI: return "vpi";
    case kDLROCM: return "rocm";
    case kDLROCMHost: return "rocm_host";
    case kDLExtDev: return "ext_dev";
    case kDLCUDAManaged: return "cuda_managed";
    case kDLOneAPI: return "oneapi";
    case kDLWebGPU: return "webgpu";
    case kDLHexagon: return "hexagon";
    case kDLMAIA: return "maia";
    }
    return NULL;
}

void xccl_dlpack_device_str(int32_t device_type, int32_t device_id, char *buf, size_t len)
{
    const char *name = device_name(device_type);

    if (device_type == kDLCPU) snprintf(buf, len, "cpu");
    else if (name == NULL)
        snprintf(buf, len, "device_type_%d:%d", (int)device_type, (int)device_id);
    else snprintf(buf, len, "%s:%d", name, (int)device_id);
}

static int dtype_from_dlpack(DLDataType dt, xccl_dtype_t *out)
{
    if (dt.lanes != 1) return -1;
    switch (dt.code) {
    case kDLBool:
        if (dt.bits == 8) *out = XCCL_BOOL;
        return dt.bits == 8 ? 0 : -1;
    case kDLUInt:
        if (dt.bits == 8) *out = XCCL_UINT8;
        return dt.bits == 8 ? 0 : -1;
    case kDLInt:
        switch (dt.bits) {
        case 8: *out = XCCL_INT8; return 0;
        case 16: *out = XCCL_INT16; return 0;
        case 32: *out = XCCL_INT32; return 0;
        case 64: *out = XCCL_INT64; return 0;
        }
        return -1;
    case kDLFloat:
        switch (dt.bits) {
        case 16: *out = XCCL_FLOAT16; return 0;
        case 32: *out = XCCL_FLOAT32; return 0;
        case 64: *out = XCCL_FLOAT64; return 0;
        }
        return -1;
    case kDLBfloat:
        if (dt.bits == 16) *out = XCCL_BFLOAT16;
        return dt.bits == 16 ? 0 : -1;
    case kDLComplex:
        if (dt.bits == 64) *out = XCCL_COMPLEX64;
        if (dt.bits == 128) *out = XCCL_COMPLEX128;
        return dt.bits == 64 || dt.bits == 128 ? 0 : -1;
    }
    return -1;
}

static const char *dtype_code_name(uint8_t code)
{
    switch (code) {
    case kDLInt: return "int";
    case kDLUInt: return "uint";
    case kDLFloat: return "float";
    case kDLOpaqueHandle: return "opaque handle";
    case kDLBfloat: return "bfloat";
    case kDLComplex: return "complex";
    case kDLBool: return "bool";
    /* the narrow floats of DLPack 1.1 */
    case 7: return "float8_e3m4";
    case 8: return "float8_e4m3";
    case 9: return "float8_e4m3b11fnuz";
    case 10: return "float8_e4m3fn";
    case 11: return "float8_e4m3fnuz";
    case 12: return "float8_e5m2";
    case 13: return "float8_e5m2fnuz";
    case 14: return "float8_e8m0fnu";
    case 15: return "float6_e2m3fn";
    case 16: return "float6_e3m2fn";
    case 17: return "float4_e2m1fn";
    }
    return "unknown";
}

/* "(2, 3)" into buf (truncated with "..." when long). */
static void format_dims(char *buf, size_t len, const int64_t *v, int32_t n)
{
    size_t off = 0;
    int    w;

    w   = snprintf(buf, len, "(");
    off = w > 0 ? (size_t)w : 0;
    for (int32_t i = 0; i < n && off < len; i++) {
        w = snprintf(buf + off, len - off, "%s%" PRId64, i ? ", " : "", v[i]);
        if (w < 0) break;
        off += (size_t)w;
    }
    if (off < len) snprintf(buf + off, len - off, n == 1 ? ",)" : ")");
    if (off >= len && len > 4) memcpy(buf + len - 5, "...)", 5);
}

/* Compact row-major, ignoring the stride of every dimension of extent 1 (torch reports
 * arbitrary strides there). An empty tensor is contiguous. */
static int is_compact(const DLTensor *dl, size_t count)
{
    uint64_t expect = 1; /* a product of extents, at most count: cannot wrap */

    if (dl->strides == NULL || count == 0) return 1;
    for (int32_t i = dl->ndim - 1; i >= 0; i--) {
        if (dl->shape[i] == 1) continue;
        if (dl->strides[i] < 0 || (uint64_t)dl->strides[i] != expect) return 0;
        expect *= (uint64_t)dl->shape[i];
    }
    return 1;
}

xccl_dlpack_verdict_t xccl_dlpack_check(const DLTensor *dl, uint64_t dlflags, int output,
                                        int any_device, xccl_dlpack_view_t *out, char *msg,
                                        size_t msglen)
{
    size_t       count = 1;
    xccl_dtype_t dtype = XCCL_BOOL;
    char         dims[160], strides[160], dev[64];

    memset(out, 0, sizeof(*out));
    msg[0]           = '\0';
    out->device_type = dl->device.device_type;
    out->device_id   = dl->device.device_id;
    out->read_only   = (dlflags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;

    if (!any_device && out->device_type != kDLCPU && out->device_type != kDLCUDAHost) {
        xccl_dlpack_device_str(out->device_type, out->device_id, dev, sizeof(dev));
        snprintf(msg, msglen, "device %s is not supported by this transport yet", dev);
        return XCCL_DLPACK_BAD_DEVICE;
    }
    if (dtype_from_dlpack(dl->dtype, &dtype) < 0) {
        snprintf(msg, msglen,
                 "unsupported dtype (DLPack code %d (%s), bits %d, lanes %d); xccl handles bool, "
                 "uint8, int8/16/32/64, float16/32/64, bfloat16 and complex64/128 with lanes=1",
                 (int)dl->dtype.code, dtype_code_name(dl->dtype.code), (int)dl->dtype.bits,
                 (int)dl->dtype.lanes);
        return XCCL_DLPACK_BAD_DTYPE;
    }
    if (dl->ndim < 0 || (dl->ndim > 0 && dl->shape == NULL)) {
        snprintf(msg, msglen, "malformed DLPack tensor (ndim %d)", (int)dl->ndim);
        return XCCL_DLPACK_MALFORMED;
    }
    for (int32_t i = 0; i < dl->ndim; i++) {
        size_t limit = SIZE_MAX / xccl_dtype_size(dtype); /* keeps count * itemsize in range */
        if (dl->shape[i] < 0 || (dl->shape[i] > 0 && count > limit / (size_t)dl->shape[i])) {
            snprintf(msg, msglen, "malformed DLPack tensor (dimension %d has extent %lld)",
                     (int)i, (long long)dl->shape[i]);
            return XCCL_DLPACK_MALFORMED;
        }
        count *= (size_t)dl->shape[i];
    }
    if (!is_compact(dl, count)) {
        format_dims(strides, sizeof(strides), dl->strides, dl->ndim);
        format_dims(dims, sizeof(dims), dl->shape, dl->ndim);
        snprintf(msg, msglen,
                 "non-contiguous buffer (strides %s, shape %s) is not supported; call "
                 ".contiguous() / np.ascontiguousarray first",
                 strides, dims);
        return XCCL_DLPACK_MALFORMED;
    }
    if (dl->data == NULL && count > 0) {
        snprintf(msg, msglen, "DLPack tensor with a NULL data pointer");
        return XCCL_DLPACK_MALFORMED;
    }
    if (output && out->read_only) {
        snprintf(msg, msglen, "read-only buffer cannot receive data");
        return XCCL_DLPACK_MALFORMED;
    }
    if (output && (dlflags & DLPACK_FLAG_BITMASK_IS_COPIED)) {
        snprintf(msg, msglen,
                 "the producer exported a copy (DLPack IS_COPIED), so received data would not "
                 "reach the original buffer");
        return XCCL_DLPACK_MALFORMED;
    }
    /* data + byte_offset, and the count * itemsize bytes from there, must be addresses */
    if (dl->data != NULL &&
        (dl->byte_offset > UINTPTR_MAX - (uintptr_t)dl->data ||
         count * xccl_dtype_size(dtype) > UINTPTR_MAX - (uintptr_t)dl->data - dl->byte_offset)) {
        snprintf(msg, msglen,
                 "malformed DLPack tensor (byte_offset %" PRIu64 " with %zu elements runs past "
                 "the end of the address space)",
                 dl->byte_offset, count);
        return XCCL_DLPACK_MALFORMED;
    }
    out->data  = dl->data == NULL ? NULL : (char *)dl->data + dl->byte_offset;
    out->count = count;
    out->rows  = dl->ndim > 0 ? dl->shape[0] : -1;
    out->dtype = dtype;
    return XCCL_DLPACK_OK;
}
