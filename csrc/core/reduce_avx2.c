/* SPDX-License-Identifier: Apache-2.0
 *
 * reduce_avx2.c - AVX2 (+FMA, F16C) reduction kernels. Every function carries a target
 * attribute, so this file builds without -mavx2 and reduce.c only calls into it when
 * __builtin_cpu_supports says the CPU can run it.
 *
 * Each kernel runs two 256-bit vectors per iteration, then one, then finishes the last
 * partial vector by copying it into zero-padded locals and running the same vector code on
 * them, so tails take the very same instructions as the body (bit-identical to reduce.c's
 * portable kernels by construction of the operators below).
 */
#include "core/reduce_impl.h"

#if XCCL_REDUCE_X86

#include <string.h>

#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* loads and stores, one 256-bit register of float32 (for f16/bf16: 8 elements widened) */
#define LD_PS(p)    _mm256_loadu_ps(p)
#define ST_PS(p, v) _mm256_storeu_ps((p), (v))
#define LD_PD(p)    _mm256_loadu_pd(p)
#define ST_PD(p, v) _mm256_storeu_pd((p), (v))
#define LD_SI(p)    _mm256_loadu_si256((const __m256i *)(const void *)(p))
#define ST_SI(p, v) _mm256_storeu_si256((__m256i *)(void *)(p), (v))
#define LD_PH(p)    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define ST_PH(p, v) \
    _mm_storeu_si128((__m128i *)(void *)(p), _mm256_cvtps_ph((v), _MM_FROUND_TO_NEAREST_INT))
#define LD_BF(p)    bf16_widen(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define ST_BF(p, v) _mm_storeu_si128((__m128i *)(void *)(p), bf16_narrow(v))

static inline AVX2 __m256 bf16_widen(__m128i h)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* round to nearest even by adding 0x7fff (+1 if the kept lsb is odd); NaN: keep the top half,
 * set the quiet bit. Same arithmetic as xccl_float_to_bf16. */
static inline AVX2 __m128i bf16_narrow(__m256 v)
{
    __m256i x   = _mm256_castps_si256(v);
    __m256i hi  = _mm256_srli_epi32(x, 16);
    __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r   = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));

    r = _mm256_srli_epi32(r, 16);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* (a > b || a is NaN) ? a : b; vmaxps alone answers b whenever either side is NaN */
static inline AVX2 __m256 max_ps(__m256 a, __m256 b)
{
    return _mm256_blendv_ps(_mm256_max_ps(a, b), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}

static inline AVX2 __m256 min_ps(__m256 a, __m256 b)
{
    return _mm256_blendv_ps(_mm256_min_ps(a, b), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}

static inline AVX2 __m256d max_pd(__m256d a, __m256d b)
{
    return _mm256_blendv_pd(_mm256_max_pd(a, b), a, _mm256_cmp_pd(a, a, _CMP_UNORD_Q));
}

static inline AVX2 __m256d min_pd(__m256d a, __m256d b)
{
    return _mm256_blendv_pd(_mm256_min_pd(a, b), a, _mm256_cmp_pd(a, a, _CMP_UNORD_Q));
}

static inline AVX2 __m256i max_epi64(__m256i a, __m256i b)
{
    return _mm256_blendv_epi8(b, a, _mm256_cmpgt_epi64(a, b));
}

static inline AVX2 __m256i min_epi64(__m256i a, __m256i b)
{
    return _mm256_blendv_epi8(b, a, _mm256_cmpgt_epi64(b, a));
}

/* low 64 bits of a*b: lo(a)lo(b) + ((hi(a)lo(b) + lo(a)hi(b)) << 32) */
static inline AVX2 __m256i mul_epi64(__m256i a, __m256i b)
{
    __m256i ll = _mm256_mul_epu32(a, b);
    __m256i hl = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), b);
    __m256i lh = _mm256_mul_epu32(a, _mm256_srli_epi64(b, 32));

    return _mm256_add_epi64(ll, _mm256_slli_epi64(_mm256_add_epi64(hl, lh), 32));
}

/* T: element type; W: elements per vector; LD/ST: load/store one vector; OP: combine two */
#define AVX2_KERNEL(name, T, W, LD, ST, OP)                                                 \
    static AVX2 void name(void *dst, const void *a, const void *b, size_t count)           \
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
            T bx[W] = {0}, by[W] = {0}, bd[W];                                              \
            memcpy(bx, x + i, (count - i) * sizeof(T));                                     \
            memcpy(by, y + i, (count - i) * sizeof(T));                                     \
            ST(bd, OP(LD(bx), LD(by)));                                                     \
            memcpy(d + i, bd, (count - i) * sizeof(T));                                     \
        }                                                                                   \
    }

/* dst[i] = convert(src[i]) between a 16-bit format and float32 */
#define AVX2_CONVERT(name, TD, TS, W, LD, ST)                                               \
    static AVX2 void name(TD *dst, const TS *src, size_t count)                             \
    {                                                                                       \
        size_t i = 0;                                                                       \
                                                                                            \
        for (; i + (W) <= count; i += (W)) ST(dst + i, LD(src + i));                        \
        if (i < count) {                                                                    \
            TS bs[W] = {0};                                                                 \
            TD bd[W];                                                                       \
            memcpy(bs, src + i, (count - i) * sizeof(TS));                                  \
            ST(bd, LD(bs));                                                                 \
            memcpy(dst + i, bd, (count - i) * sizeof(TD));                                  \
        }                                                                                   \
    }

AVX2_KERNEL(f32_sum, float, 8, LD_PS, ST_PS, _mm256_add_ps)
AVX2_KERNEL(f32_prod, float, 8, LD_PS, ST_PS, _mm256_mul_ps)
AVX2_KERNEL(f32_min, float, 8, LD_PS, ST_PS, min_ps)
AVX2_KERNEL(f32_max, float, 8, LD_PS, ST_PS, max_ps)

AVX2_KERNEL(f64_sum, double, 4, LD_PD, ST_PD, _mm256_add_pd)
AVX2_KERNEL(f64_prod, double, 4, LD_PD, ST_PD, _mm256_mul_pd)
AVX2_KERNEL(f64_min, double, 4, LD_PD, ST_PD, min_pd)
AVX2_KERNEL(f64_max, double, 4, LD_PD, ST_PD, max_pd)

AVX2_KERNEL(f16_sum, uint16_t, 8, LD_PH, ST_PH, _mm256_add_ps)
AVX2_KERNEL(f16_prod, uint16_t, 8, LD_PH, ST_PH, _mm256_mul_ps)
AVX2_KERNEL(f16_min, uint16_t, 8, LD_PH, ST_PH, min_ps)
AVX2_KERNEL(f16_max, uint16_t, 8, LD_PH, ST_PH, max_ps)

AVX2_KERNEL(bf16_sum, uint16_t, 8, LD_BF, ST_BF, _mm256_add_ps)
AVX2_KERNEL(bf16_prod, uint16_t, 8, LD_BF, ST_BF, _mm256_mul_ps)
AVX2_KERNEL(bf16_min, uint16_t, 8, LD_BF, ST_BF, min_ps)
AVX2_KERNEL(bf16_max, uint16_t, 8, LD_BF, ST_BF, max_ps)

AVX2_KERNEL(u8_sum, uint8_t, 32, LD_SI, ST_SI, _mm256_add_epi8)
AVX2_KERNEL(u8_min, uint8_t, 32, LD_SI, ST_SI, _mm256_min_epu8)
AVX2_KERNEL(u8_max, uint8_t, 32, LD_SI, ST_SI, _mm256_max_epu8)
AVX2_KERNEL(u8_and, uint8_t, 32, LD_SI, ST_SI, _mm256_and_si256)
AVX2_KERNEL(u8_or, uint8_t, 32, LD_SI, ST_SI, _mm256_or_si256)
AVX2_KERNEL(u8_xor, uint8_t, 32, LD_SI, ST_SI, _mm256_xor_si256)

AVX2_KERNEL(i8_sum, int8_t, 32, LD_SI, ST_SI, _mm256_add_epi8)
AVX2_KERNEL(i8_min, int8_t, 32, LD_SI, ST_SI, _mm256_min_epi8)
AVX2_KERNEL(i8_max, int8_t, 32, LD_SI, ST_SI, _mm256_max_epi8)

AVX2_KERNEL(i16_sum, int16_t, 16, LD_SI, ST_SI, _mm256_add_epi16)
AVX2_KERNEL(i16_prod, int16_t, 16, LD_SI, ST_SI, _mm256_mullo_epi16)
AVX2_KERNEL(i16_min, int16_t, 16, LD_SI, ST_SI, _mm256_min_epi16)
AVX2_KERNEL(i16_max, int16_t, 16, LD_SI, ST_SI, _mm256_max_epi16)

AVX2_KERNEL(i32_sum, int32_t, 8, LD_SI, ST_SI, _mm256_add_epi32)
AVX2_KERNEL(i32_prod, int32_t, 8, LD_SI, ST_SI, _mm256_mullo_epi32)
AVX2_KERNEL(i32_min, int32_t, 8, LD_SI, ST_SI, _mm256_min_epi32)
AVX2_KERNEL(i32_max, int32_t, 8, LD_SI, ST_SI, _mm256_max_epi32)

AVX2_KERNEL(i64_sum, int64_t, 4, LD_SI, ST_SI, _mm256_add_epi64)
AVX2_KERNEL(i64_prod, int64_t, 4, LD_SI, ST_SI, mul_epi64)
AVX2_KERNEL(i64_min, int64_t, 4, LD_SI, ST_SI, min_epi64)
AVX2_KERNEL(i64_max, int64_t, 4, LD_SI, ST_SI, max_epi64)

AVX2_CONVERT(widen_half, float, uint16_t, 8, LD_PH, ST_PS)
AVX2_CONVERT(narrow_half, uint16_t, float, 8, LD_PS, ST_PH)
AVX2_CONVERT(widen_bf16, float, uint16_t, 8, LD_BF, ST_PS)
AVX2_CONVERT(narrow_bf16, uint16_t, float, 8, LD_PS, ST_BF)

/* Not here (portable kernels serve them): bool, int8/uint8 PROD, complex PROD. */
const xccl_reduce_kernels_t xccl_reduce_kernels_avx2 = {
    .name = "avx2",
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
