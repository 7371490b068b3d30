/* SPDX-License-Identifier: Apache-2.0
 *
 * reduce_avx512.c - AVX-512 (F, BW, VL) reduction kernels. Every function carries a target
 * attribute, so this file builds without -mavx512f and reduce.c only calls into it when
 * __builtin_cpu_supports says the CPU can run it.
 *
 * Each kernel runs two 512-bit vectors per iteration, then one, then the last partial vector
 * with masked loads and stores (masked-off lanes are neither read nor written, so they cannot
 * fault). Operators are chosen to match reduce.c's portable kernels bit for bit.
 */
#include "core/reduce_impl.h"

#if XCCL_REDUCE_X86

#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

/* Full and masked (M*) loads/stores of one register; p is an element pointer, m a mask of
 * the lanes to touch. f16/bf16 hold 16 elements widened to float32. */
#define LD_PS(p)        _mm512_loadu_ps(p)
#define ST_PS(p, v)     _mm512_storeu_ps((p), (v))
#define MLD_PS(m, p)    _mm512_maskz_loadu_ps((__mmask16)(m), (p))
#define MST_PS(p, m, v) _mm512_mask_storeu_ps((p), (__mmask16)(m), (v))

#define LD_PD(p)        _mm512_loadu_pd(p)
#define ST_PD(p, v)     _mm512_storeu_pd((p), (v))
#define MLD_PD(m, p)    _mm512_maskz_loadu_pd((__mmask8)(m), (p))
#define MST_PD(p, m, v) _mm512_mask_storeu_pd((p), (__mmask8)(m), (v))

#define LD_SI(p)    _mm512_loadu_si512((const void *)(p))
#define ST_SI(p, v) _mm512_storeu_si512((void *)(p), (v))

#define MLD_8(m, p)     _mm512_maskz_loadu_epi8((__mmask64)(m), (const void *)(p))
#define MST_8(p, m, v)  _mm512_mask_storeu_epi8((void *)(p), (__mmask64)(m), (v))
#define MLD_16(m, p)    _mm512_maskz_loadu_epi16((__mmask32)(m), (const void *)(p))
#define MST_16(p, m, v) _mm512_mask_storeu_epi16((void *)(p), (__mmask32)(m), (v))
#define MLD_32(m, p)    _mm512_maskz_loadu_epi32((__mmask16)(m), (const void *)(p))
#define MST_32(p, m, v) _mm512_mask_storeu_epi32((void *)(p), (__mmask16)(m), (v))
#define MLD_64(m, p)    _mm512_maskz_loadu_epi64((__mmask8)(m), (const void *)(p))
#define MST_64(p, m, v) _mm512_mask_storeu_epi64((void *)(p), (__mmask8)(m), (v))

#define LD_H16(p)        _mm256_loadu_si256((const __m256i *)(const void *)(p))
#define ST_H16(p, v)     _mm256_storeu_si256((__m256i *)(void *)(p), (v))
#define MLD_H16(m, p)    _mm256_maskz_loadu_epi16((__mmask16)(m), (const void *)(p))
#define MST_H16(p, m, v) _mm256_mask_storeu_epi16((void *)(p), (__mmask16)(m), (v))

#define PH_ROUND            (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define LD_PH(p)            _mm512_cvtph_ps(LD_H16(p))
#define ST_PH(p, v)         ST_H16((p), _mm512_cvtps_ph((v), PH_ROUND))
#define MLD_PH(m, p)        _mm512_cvtph_ps(MLD_H16((m), (p)))
#define MST_PH(p, m, v)     MST_H16((p), (m), _mm512_cvtps_ph((v), PH_ROUND))
#define LD_BF(p)            bf16_widen(LD_H16(p))
#define ST_BF(p, v)         ST_H16((p), bf16_narrow(v))
#define MLD_BF(m, p)        bf16_widen(MLD_H16((m), (p)))
#define MST_BF(p, m, v)     MST_H16((p), (m), bf16_narrow(v))

static inline AVX512 __m512 bf16_widen(__m256i h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* round to nearest even by adding 0x7fff (+1 if the kept lsb is odd); NaN: keep the top half,
 * set the quiet bit. Same arithmetic as xccl_float_to_bf16. */
static inline AVX512 __m256i bf16_narrow(__m512 v)
{
    __m512i   x   = _mm512_castps_si512(v);
    __m512i   hi  = _mm512_srli_epi32(x, 16);
    __m512i   lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i   r   = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);

    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

/* (a > b || a is NaN) ? a : b; vmaxps alone answers b whenever either side is NaN */
static inline AVX512 __m512 max_ps(__m512 a, __m512 b)
{
    return _mm512_mask_mov_ps(_mm512_max_ps(a, b), _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), a);
}

static inline AVX512 __m512 min_ps(__m512 a, __m512 b)
{
    return _mm512_mask_mov_ps(_mm512_min_ps(a, b), _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), a);
}

static inline AVX512 __m512d max_pd(__m512d a, __m512d b)
{
    return _mm512_mask_mov_pd(_mm512_max_pd(a, b), _mm512_cmp_pd_mask(a, a, _CMP_UNORD_Q), a);
}

static inline AVX512 __m512d min_pd(__m512d a, __m512d b)
{
    return _mm512_mask_mov_pd(_mm512_min_pd(a, b), _mm512_cmp_pd_mask(a, a, _CMP_UNORD_Q), a);
}

/* low 64 bits of a*b (vpmullq needs AVX512DQ): lo*lo + ((hi(a)lo(b) + lo(a)hi(b)) << 32) */
static inline AVX512 __m512i mul_epi64(__m512i a, __m512i b)
{
    __m512i ll = _mm512_mul_epu32(a, b);
    __m512i hl = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), b);
    __m512i lh = _mm512_mul_epu32(a, _mm512_srli_epi64(b, 32));

    return _mm512_add_epi64(ll, _mm512_slli_epi64(_mm512_add_epi64(hl, lh), 32));
}

/* T: element type; W: elements per vector (<= 64); LD/ST, MLD/MST: full and masked access;
 * OP: combine two vectors */
#define AVX512_KERNEL(name, T, W, LD, ST, MLD, MST, OP)                                     \
    static AVX512 void name(void *dst, const void *a, const void *b, size_t count)         \
    {                                                                                       \
        T       *d = dst;                                                                   \
        const T *x = a, *y = b;                                                             \
        size_t   i = 0;                                                                     \
                                                                                            \
        for (; i + 2 * (W) <= count; i += 2 * (W)) {                                        \
            ST(d + i, OP(LD(x + i), LD(y + i)));                                            \
            ST(d + i + (W), OP(LD(x + i + (W)), LD(y + i + (W))));                          \
        }                                                                                   \
        for (; i + (W) <= count; i += (W)) ST(d + i, OP(LD(x + i), LD(y + i)));             \
        if (i < count) {                                                                    \
            uint64_t m = ((uint64_t)1 << (count - i)) - 1;                                  \
            MST(d + i, m, OP(MLD(m, x + i), MLD(m, y + i)));                                \
        }                                                                                   \
    }

/* dst[i] = convert(src[i]) between a 16-bit format and float32, 16 at a time */
#define AVX512_CONVERT(name, TD, TS, LD, ST, MLD, MST)                                      \
    static AVX512 void name(TD *dst, const TS *src, size_t count)                           \
    {                                                                                       \
        size_t i = 0;                                                                       \
                                                                                            \
        for (; i + 16 <= count; i += 16) ST(dst + i, LD(src + i));                          \
        if (i < count) {                                                                    \
            uint64_t m = ((uint64_t)1 << (count - i)) - 1;                                  \
            MST(dst + i, m, MLD(m, src + i));                                               \
        }                                                                                   \
    }

#define K_PS(name, OP) AVX512_KERNEL(name, float, 16, LD_PS, ST_PS, MLD_PS, MST_PS, OP)
#define K_PD(name, OP) AVX512_KERNEL(name, double, 8, LD_PD, ST_PD, MLD_PD, MST_PD, OP)
#define K_PH(name, OP) AVX512_KERNEL(name, uint16_t, 16, LD_PH, ST_PH, MLD_PH, MST_PH, OP)
#define K_BF(name, OP) AVX512_KERNEL(name, uint16_t, 16, LD_BF, ST_BF, MLD_BF, MST_BF, OP)
#define K_8(name, OP)  AVX512_KERNEL(name, uint8_t, 64, LD_SI, ST_SI, MLD_8, MST_8, OP)
#define K_16(name, OP) AVX512_KERNEL(name, int16_t, 32, LD_SI, ST_SI, MLD_16, MST_16, OP)
#define K_32(name, OP) AVX512_KERNEL(name, int32_t, 16, LD_SI, ST_SI, MLD_32, MST_32, OP)
#define K_64(name, OP) AVX512_KERNEL(name, int64_t, 8, LD_SI, ST_SI, MLD_64, MST_64, OP)

K_PS(f32_sum, _mm512_add_ps)
K_PS(f32_prod, _mm512_mul_ps)
K_PS(f32_min, min_ps)
K_PS(f32_max, max_ps)

K_PD(f64_sum, _mm512_add_pd)
K_PD(f64_prod, _mm512_mul_pd)
K_PD(f64_min, min_pd)
K_PD(f64_max, max_pd)

K_PH(f16_sum, _mm512_add_ps)
K_PH(f16_prod, _mm512_mul_ps)
K_PH(f16_min, min_ps)
K_PH(f16_max, max_ps)

K_BF(bf16_sum, _mm512_add_ps)
K_BF(bf16_prod, _mm512_mul_ps)
K_BF(bf16_min, min_ps)
K_BF(bf16_max, max_ps)

K_8(u8_sum, _mm512_add_epi8)
K_8(u8_min, _mm512_min_epu8)
K_8(u8_max, _mm512_max_epu8)
K_8(u8_and, _mm512_and_si512)
K_8(u8_or, _mm512_or_si512)
K_8(u8_xor, _mm512_xor_si512)
K_8(i8_sum, _mm512_add_epi8)
K_8(i8_min, _mm512_min_epi8)
K_8(i8_max, _mm512_max_epi8)

K_16(i16_sum, _mm512_add_epi16)
K_16(i16_prod, _mm512_mullo_epi16)
K_16(i16_min, _mm512_min_epi16)
K_16(i16_max, _mm512_max_epi16)

K_32(i32_sum, _mm512_add_epi32)
K_32(i32_prod, _mm512_mullo_epi32)
K_32(i32_min, _mm512_min_epi32)
K_32(i32_max, _mm512_max_epi32)

K_64(i64_sum, _mm512_add_epi64)
K_64(i64_prod, mul_epi64)
K_64(i64_min, _mm512_min_epi64)
K_64(i64_max, _mm512_max_epi64)

AVX512_CONVERT(widen_half, float, uint16_t, LD_PH, ST_PS, MLD_PH, MST_PS)
AVX512_CONVERT(narrow_half, uint16_t, float, LD_PS, ST_PH, MLD_PS, MST_PH)
AVX512_CONVERT(widen_bf16, float, uint16_t, LD_BF, ST_PS, MLD_BF, MST_PS)
AVX512_CONVERT(narrow_bf16, uint16_t, float, LD_PS, ST_BF, MLD_PS, MST_BF)

/* Not here (portable kernels serve them): bool, int8/uint8 PROD, complex PROD. */
const xccl_reduce_kernels_t xccl_reduce_kernels_avx512 = {
    .name = "avx512",
    .fn = {
        [XCCL_UINT8] = {u8_sum, NULL, u8_min, u8_max, u8_and, u8_or, u8_xor},
        [XCCL_INT8] = {i8_sum, NULL, i8_min, i8_max},
        [XCCL_INT16] = {i16_sum, i16_prod, i16_min, i16_max},
        [XCCL_INT32] = {i32_sum, i32_prod, i32_min, i32_max},
        [XCCL_INT64] = {i64_sum, i64_prod, i64_min, i64_max},
        [XCCL_FLOAT16] = {f16_sum, f16_prod, f16_min, f16_max},
        [XCCL_BFLOAT16] = {bf16_sum, bf16_prod, bf16_min, bf16_max},
        [XCCL_FLOAT32] = {f32_sum, f32_prod, f32_min, f32_max},
        [XCCL_FLOAT64] = {f64_sum, f64_prod, f64_min, f64_max},
    },
    .widen  = {widen_half, widen_bf16},
    .narrow = {narrow_half, narrow_bf16},
};

#endif /* XCCL_REDUCE_X86 */
