/* SPDX-License-Identifier: Apache-2.0
 *
 * reduce_impl.h - the kernel tables shared by reduce.c (portable C and dispatch) and the
 * AVX2 / AVX-512 kernel files. Internal to csrc/core.
 *
 * A kernel set is a const table indexed by dtype and base operator. A NULL entry means "this
 * set has nothing better than the portable kernel"; dispatch then falls back to the generic
 * table, so a SIMD file only fills in the cases it speeds up. Every kernel must give results
 * bit-identical to the generic one (NaN payloads aside), so the choice of set never changes
 * an answer.
 */
#ifndef XCCL_CORE_REDUCE_IMPL_H
#define XCCL_CORE_REDUCE_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "xccl/xccl.h"

/* SUM, PROD, MIN, MAX, BAND, BOR, BXOR: the first seven xccl_op_t values. */
#define XCCL_REDUCE_NBASE 7

/* 1: build the AVX2 / AVX-512 sets (x86 only). -DXCCL_REDUCE_X86=0 builds the portable
 * kernels alone, as on other architectures. */
#ifndef XCCL_REDUCE_X86
#if defined(__x86_64__) || defined(__i386__)
#define XCCL_REDUCE_X86 1
#else
#define XCCL_REDUCE_X86 0
#endif
#endif

/* dst[i] = a[i] op b[i]; dst may be a or b (exactly). Never fails. */
typedef void (*xccl_reduce_fn)(void *dst, const void *a, const void *b, size_t count);
/* float16/bfloat16 <-> float32 arrays; dst and src never overlap. */
typedef void (*xccl_widen_fn)(float *dst, const uint16_t *src, size_t count);
typedef void (*xccl_narrow_fn)(uint16_t *dst, const float *src, size_t count);

typedef struct xccl_reduce_kernels {
    const char    *name;
    /* Complex SUM and the bitwise operators on integers never reach a table: dispatch turns
     * them into float32/float64 SUM and uint8 bitwise over the same bytes. */
    xccl_reduce_fn fn[XCCL_DTYPE_COUNT][XCCL_REDUCE_NBASE];
    xccl_widen_fn  widen[2];  /* [0] float16, [1] bfloat16; NULL: generic */
    xccl_narrow_fn narrow[2];
} xccl_reduce_kernels_t;

#if XCCL_REDUCE_X86
extern const xccl_reduce_kernels_t xccl_reduce_kernels_avx2;   /* needs avx2, fma, f16c  */
extern const xccl_reduce_kernels_t xccl_reduce_kernels_avx512; /* needs avx512f, bw, vl  */
#endif

#endif /* XCCL_CORE_REDUCE_IMPL_H */
