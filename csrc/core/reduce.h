/* SPDX-License-Identifier: Apache-2.0
 *
 * reduce.h - local reduction kernels for every dtype and base operator, vectorised (AVX2 /
 * AVX-512 chosen once at run time from CPUID, portable C otherwise). float16 and bfloat16 are
 * widened to float32, combined and rounded back (round-to-nearest-even); complex types support
 * SUM and PROD only; bool uses logical semantics for SUM/MAX/BOR (or), PROD/MIN/BAND (and),
 * BXOR (xor).
 *
 * The operators handled here are the base ones: SUM, PROD, MIN, MAX, BAND, BOR, BXOR. AVG and
 * PREMUL_SUM are built by the core from SUM plus xccl_scale.
 */
#ifndef XCCL_CORE_REDUCE_H
#define XCCL_CORE_REDUCE_H

#include <stddef.h>
#include <stdint.h>

#include "xccl/xccl.h"

/* dst[i] = a[i] op b[i] for i < count. dst may alias a or b (exactly, not partially). */
xccl_status_t xccl_reduce2(void *dst, const void *a, const void *b, size_t count,
                           xccl_dtype_t dtype, xccl_op_t op);

/* dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[n-1][i]; n >= 1. float16/bfloat16 are
 * accumulated in float32 across all n inputs and rounded once. dst may alias srcs[0]. */
xccl_status_t xccl_reduce_n(void *dst, const void *const *srcs, int n, size_t count,
                            xccl_dtype_t dtype, xccl_op_t op);

/* dst[i] = src[i] * factor (dst may alias src). Floating and complex types multiply in their
 * own precision (f16/bf16 through float32); integer types multiply in double and round to
 * nearest (ties away from zero). bool: not supported. */
xccl_status_t xccl_scale(void *dst, const void *src, size_t count, xccl_dtype_t dtype,
                         double factor);

/* dst[i] = src[i] / n for AVG. Floating/complex: division in their precision; integers:
 * division truncating toward zero (as torch's integer AVG through division). */
xccl_status_t xccl_divide(void *dst, const void *src, size_t count, xccl_dtype_t dtype, int n);

/* Name of the kernel set selected at run time: "avx512", "avx2" or "generic". */
const char *xccl_reduce_isa(void);
/* Forces a kernel set (for tests): "avx512", "avx2", "generic". XCCL_ERR_NOT_SUPPORTED if the
 * CPU lacks it. $XCCL_REDUCE_ISA has the same effect at start-up. */
xccl_status_t xccl_reduce_set_isa(const char *isa);

/* float16 / bfloat16 conversions (round to nearest even, NaN preserved). */
float    xccl_half_to_float(uint16_t h);
uint16_t xccl_float_to_half(float f);
float    xccl_bf16_to_float(uint16_t h);
uint16_t xccl_float_to_bf16(float f);

#endif /* XCCL_CORE_REDUCE_H */
