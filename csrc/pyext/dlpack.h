/* SPDX-License-Identifier: Apache-2.0
 *
 * dlpack.h - the few DLPack ABI structures the extension consumes, written from the published
 * DLPack specification (ABI 1.x, plus the pre-1.0 "legacy" managed tensor). Only the layout
 * matters: these structs are read from memory handed to us by other libraries.
 */
#ifndef XCCL_PYEXT_DLPACK_H
#define XCCL_PYEXT_DLPACK_H

#include <stdint.h>

/* Major version of the versioned ABI we understand. A capsule carrying another major version
 * has an unknown layout after its `version` field: only its deleter may be called. */
#define XCCL_DLPACK_MAJOR 1
#define XCCL_DLPACK_MINOR 1

/* Device types (DLDeviceType); the values are fixed by the specification. */
enum {
    kDLCPU         = 1,
    kDLCUDA        = 2,
    kDLCUDAHost    = 3, /* page-locked host memory: ordinary pointers work */
    kDLOpenCL      = 4,
    kDLVulkan      = 7,
    kDLMetal       = 8,
    kDLVPI         = 9,
    kDLROCM        = 10,
    kDLROCMHost    = 11,
    kDLExtDev      = 12,
    kDLCUDAManaged = 13,
    kDLOneAPI      = 14,
    kDLWebGPU      = 15,
    kDLHexagon     = 16,
    kDLMAIA        = 17,
};

/* Type codes (DLDataTypeCode). Codes above kDLBool are the narrow float formats of DLPack 1.1,
 * which xccl does not reduce. */
enum {
    kDLInt          = 0,
    kDLUInt         = 1,
    kDLFloat        = 2,
    kDLOpaqueHandle = 3,
    kDLBfloat       = 4,
    kDLComplex      = 5,
    kDLBool         = 6,
};

/* The enum member is stored as a C enum, i.e. a 32-bit int on every ABI we build for. */
typedef struct {
    int32_t device_type;
    int32_t device_id;
} DLDevice;

/* One element type: `lanes` > 1 would be a vector type (rejected). */
typedef struct {
    uint8_t  code;
    uint8_t  bits;
    uint16_t lanes;
} DLDataType;

/* A strided view. `shape` and `strides` have `ndim` entries, strides counted in elements;
 * strides == NULL means compact row-major. The first byte is data + byte_offset. */
typedef struct {
    void      *data;
    DLDevice   device;
    int32_t    ndim;
    DLDataType dtype;
    int64_t   *shape;
    int64_t   *strides;
    uint64_t   byte_offset;
} DLTensor;

/* Legacy (pre-1.0) managed tensor: the tensor first, the owner's context and deleter after. */
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void    *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

/* Flags of a versioned tensor. */
#define DLPACK_FLAG_BITMASK_READ_ONLY (UINT64_C(1) << 0) /* must not be written          */
#define DLPACK_FLAG_BITMASK_IS_COPIED (UINT64_C(1) << 1) /* producer exported a copy     */

/* Versioned managed tensor (ABI 1.x): the version comes first so it can be checked before
 * anything else is read. */
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void         *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* Capsule names: a producer hands out the first two; a consumer that takes ownership renames
 * the capsule to the "used_" form so the capsule's destructor leaves the tensor alone. */
#define DLPACK_CAPSULE_LEGACY         "dltensor"
#define DLPACK_CAPSULE_VERSIONED      "dltensor_versioned"
#define DLPACK_CAPSULE_USED_LEGACY    "used_dltensor"
#define DLPACK_CAPSULE_USED_VERSIONED "used_dltensor_versioned"

/* The C exchange table (DLPack 1.3): a framework may publish, as a capsule named
 * "dlpack_exchange_api" in the type attribute __dlpack_c_exchange_api__, C functions that export
 * its tensors without a Python-level __dlpack__ call. `version` is the DLPack version the table
 * follows; `prev_api` chains to tables of older versions. Only the function xccl calls is
 * typed; the others stay opaque pointers that keep the layout. */
#define DLPACK_EXCHANGE_API_ATTR    "__dlpack_c_exchange_api__"
#define DLPACK_EXCHANGE_API_CAPSULE "dlpack_exchange_api"

typedef struct DLPackExchangeAPIHeader {
    DLPackVersion                   version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

typedef struct {
    DLPackExchangeAPIHeader header;
    void                   *managed_tensor_allocator;
    /* An owning versioned tensor for a Python object of the table's type: 0, or -1 with a
     * Python exception set. No stream synchronisation (irrelevant for host memory). */
    int (*managed_tensor_from_py_object_no_sync)(void *py_object, DLManagedTensorVersioned **out);
    void *managed_tensor_to_py_object_no_sync;
    void *dltensor_from_py_object_no_sync;
    void *current_work_stream;
} DLPackExchangeAPI;

#endif /* XCCL_PYEXT_DLPACK_H */
