// SPDX-License-Identifier: Apache-2.0
//
// cuda_host_shim.h - what csrc/cuda/kernels.cu needs from CUDA, for the host: it is compiled
// as C++ into the fake driver (fake_cuda.cc), with every rounding intrinsic an IEEE operation
// of the same precision (x86-64 SSE, no contraction: -ffp-contract=off) and the thread indices
// emulated per call.
#ifndef XCCL_TESTS_CUDA_HOST_SHIM_H
#define XCCL_TESTS_CUDA_HOST_SHIM_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define __device__
#define __global__
#define __forceinline__ inline

struct dim3_t {
    unsigned x, y, z;
};
extern thread_local dim3_t blockIdx, threadIdx, blockDim, gridDim;

struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

static inline float  __fadd_rn(float a, float b) { return a + b; }
static inline float  __fsub_rn(float a, float b) { return a - b; }
static inline float  __fmul_rn(float a, float b) { return a * b; }
static inline float  __fdiv_rn(float a, float b) { return a / b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }

static inline uint32_t __float_as_uint(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float __uint_as_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#endif
