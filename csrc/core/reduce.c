/* SPDX-License-Identifier: Apache-2.0
 *
 * reduce.c - dtype/op names and validity, float16/bfloat16 conversions, the portable reduction
 * kernels, the one-time choice of kernel set (generic, AVX2, AVX-512) and the entry points of
 * reduce.h. The SIMD kernels live in reduce_avx2.c and reduce_avx512.c.
 *
 * Semantics every kernel set follows (and the tests pin down):
 *   - integers: SUM and PROD wrap modulo 2^bits (computed in unsigned arithmetic);
 *   - floats: MAX(a, b) = (a > b || a is NaN) ? a : b, MIN likewise with <; so a NaN on
 *     either side gives NaN, and for equal values (-0 vs +0) b wins (torch's rule);
 *   - float16/bfloat16: widened to float32 exactly, combined in float32, rounded back to
 *     nearest-even once; NaNs come back quiet. For SUM and PROD of two inputs this is the
 *     correctly rounded result, because float32 has more than 2p+2 bits;
 *   - bool: any nonzero byte is true, results are 0 or 1.
 *   - complex: SUM per component; PROD (ar*br - ai*bi, ar*bi + ai*br), portable kernel only
 *     (so every set agrees even where a compiler would contract it into FMAs).
 * Which NaN payload comes out of a float operation is not specified. Beyond reduce.h's
 * promise, xccl_reduce_n accepts dst equal to any one of the sources (not just srcs[0]), so a
 * rank can fold every rank's block, in rank order, into its own.
 *
 * Thread-safety: kernels keep no state. The only mutable global is the pointer to the
 * selected kernel set, set once (pthread_once) and atomically by xccl_reduce_set_isa.
 */
#include "core/reduce.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core/check.h"
#include "core/reduce_impl.h"

/* ---------------------------------------------------------------------------------------------
 * Names, sizes, validity
 * ------------------------------------------------------------------------------------------- */

static const struct {
    const char *name;
    size_t      size;
} dtype_info[XCCL_DTYPE_COUNT] = {
    [XCCL_BOOL] = {"bool", 1},         [XCCL_UINT8] = {"uint8", 1},
    [XCCL_INT8] = {"int8", 1},         [XCCL_INT16] = {"int16", 2},
    [XCCL_INT32] = {"int32", 4},       [XCCL_INT64] = {"int64", 8},
    [XCCL_FLOAT16] = {"float16", 2},   [XCCL_BFLOAT16] = {"bfloat16", 2},
    [XCCL_FLOAT32] = {"float32", 4},   [XCCL_FLOAT64] = {"float64", 8},
    [XCCL_COMPLEX64] = {"complex64", 8}, [XCCL_COMPLEX128] = {"complex128", 16},
};

static const char *const op_names[XCCL_OP_COUNT] = {
    [XCCL_OP_SUM] = "sum",   [XCCL_OP_PROD] = "product", [XCCL_OP_MIN] = "min",
    [XCCL_OP_MAX] = "max",   [XCCL_OP_BAND] = "band",    [XCCL_OP_BOR] = "bor",
    [XCCL_OP_BXOR] = "bxor", [XCCL_OP_AVG] = "avg",      [XCCL_OP_PREMUL_SUM] = "premul_sum",
};

static int dtype_ok(xccl_dtype_t dtype)
{
    return (unsigned)dtype < XCCL_DTYPE_COUNT;
}

size_t xccl_dtype_size(xccl_dtype_t dtype)
{
    return dtype_ok(dtype) ? dtype_info[dtype].size : 0;
}

const char *xccl_dtype_name(xccl_dtype_t dtype)
{
    return dtype_ok(dtype) ? dtype_info[dtype].name : "?";
}

const char *xccl_op_name(xccl_op_t op)
{
    return (unsigned)op < XCCL_OP_COUNT ? op_names[op] : "?";
}

static int is_integer(xccl_dtype_t dt)
{
    return dt == XCCL_UINT8 || dt == XCCL_INT8 || dt == XCCL_INT16 || dt == XCCL_INT32 ||
           dt == XCCL_INT64;
}

static int is_complex(xccl_dtype_t dt)
{
    return dt == XCCL_COMPLEX64 || dt == XCCL_COMPLEX128;
}

static int is_half(xccl_dtype_t dt)
{
    return dt == XCCL_FLOAT16 || dt == XCCL_BFLOAT16;
}

xccl_status_t xccl_op_check(xccl_op_t op, xccl_dtype_t dtype)
{
    int ok = 1;

    if (!dtype_ok(dtype)) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "invalid dtype %d", (int)dtype);
    if ((unsigned)op >= XCCL_OP_COUNT)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "invalid reduction op %d", (int)op);
    switch (op) {
    case XCCL_OP_SUM:
    case XCCL_OP_PROD: break;
    case XCCL_OP_MIN:
    case XCCL_OP_MAX: ok = !is_complex(dtype); break;
    case XCCL_OP_BAND:
    case XCCL_OP_BOR:
    case XCCL_OP_BXOR: ok = dtype == XCCL_BOOL || is_integer(dtype); break;
    case XCCL_OP_AVG: ok = dtype != XCCL_BOOL; break;
    case XCCL_OP_PREMUL_SUM: ok = dtype != XCCL_BOOL && !is_integer(dtype); break;
    case XCCL_OP_COUNT: ok = 0; break;
    }
    if (!ok)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "op %s is not defined for dtype %s",
                          op_names[op], dtype_info[dtype].name);
    return XCCL_OK;
}

/* ---------------------------------------------------------------------------------------------
 * float16 / bfloat16 <-> float32, bit by bit. float16 NaNs are made quiet in both directions,
 * as the F16C and AVX-512 conversion instructions do, so every kernel set agrees; bfloat16
 * widens exactly (a shift) and narrows NaNs to quiet NaNs with the top payload bits.
 *
 *   binary16: s eeeee mmmmmmmmmm     bias 15, subnormals below 2^-14, max 65504
 *   bfloat16: s eeeeeeee mmmmmmm     the top half of a float32
 * ------------------------------------------------------------------------------------------- */

/* type punning through a union is defined in C11 and vectorises, unlike memcpy here */
typedef union {
    uint32_t u;
    float    f;
} fbits_t;

static inline float bits_to_float(uint32_t u)
{
    fbits_t c = {.u = u};

    return c.f;
}

static inline uint32_t float_to_bits(float f)
{
    fbits_t c = {.f = f};

    return c.u;
}

/* all-ones if c, else 0; SEL(c, x, y) is c ? x : y written without a branch, so that the
 * array loops below vectorise */
#define MASK(c)      (0u - (uint32_t)(c))
#define SEL(c, x, y) (((x) & MASK(c)) | ((y) & ~MASK(c)))

static inline float half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em   = h & 0x7fffu;
    uint32_t norm = (em << 13) + ((127u - 15u) << 23); /* rebias the exponent */
    uint32_t nan  = (em << 13) | 0x7f800000u | (MASK(em > 0x7c00u) & 0x400000u); /* Inf, NaN */
    uint32_t sub  = float_to_bits((float)(int32_t)em * 0x1p-24f); /* exact, and normal */

    return bits_to_float(sign | SEL(em >= 0x7c00u, nan, SEL(em >= 0x400u, norm, sub)));
}

/* Integer-only, so the result does not depend on the floating-point environment (F16C's
 * conversion uses its own rounding mode too). gcc does not vectorise it (per-lane shifts). */
static inline uint16_t float_to_half(float f)
{
    uint32_t x    = float_to_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t a    = x & 0x7fffffffu;
    uint32_t man, shift, h;

    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 (max + ulp/2), Inf */
    if (a >= 0x38800000u) { /* normal result, >= 2^-14 */
        /* adding 0xfff (+1 when the kept lsb is odd) carries exactly when the 13 dropped
         * bits round up to nearest even; then rebias 127 -> 15 */
        h = ((a + 0xfffu + ((a >> 13) & 1u)) >> 13) - ((127u - 15u) << 10);
        return (uint16_t)(sign | h);
    }
    if (a <= 0x33000000u) return (uint16_t)sign; /* <= 2^-25: to zero (2^-25 ties to even) */
    /* subnormal result: round man * 2^(e-150) to a multiple of 2^-24 (may give 0x400) */
    man   = (a & 0x7fffffu) | 0x800000u;
    shift = 126u - (a >> 23); /* 14..24 */
    h     = man >> shift;
    man &= (1u << shift) - 1u; /* the dropped bits */
    h += man > (1u << (shift - 1u)) || (man == (1u << (shift - 1u)) && (h & 1u));
    return (uint16_t)(sign | h);
}

static inline uint16_t float_to_bf16(float f)
{
    uint32_t x = float_to_bits(f);
    /* adding 0x7fff (+1 when the kept lsb is odd) carries exactly when rounding up; NaN:
     * the top half with the quiet bit set */
    uint32_t r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;

    return (uint16_t)SEL((x & 0x7fffffffu) > 0x7f800000u, (x >> 16) | 0x40u, r);
}

float xccl_half_to_float(uint16_t h)
{
    return half_to_float(h);
}

uint16_t xccl_float_to_half(float f)
{
    return float_to_half(f);
}

float xccl_bf16_to_float(uint16_t h)
{
    return bits_to_float((uint32_t)h << 16);
}

uint16_t xccl_float_to_bf16(float f)
{
    return float_to_bf16(f);
}

/* ---------------------------------------------------------------------------------------------
 * Portable kernels and array conversions, written for gcc's auto-vectoriser at -O2, whose
 * cheap cost model refuses loops that need an alias check or a scalar epilogue:
 *   - restrict pointers: each kernel has one variant per aliasing case (dst distinct, dst == a,
 *     dst == b, dst == a == b), so every object written is reached through one pointer only and
 *     restrict stays truthful;
 *   - a fixed-length inner loop over 64-byte blocks, then a scalar loop for the tail.
 * ------------------------------------------------------------------------------------------- */

/* runs STMT (which uses the index k) for k in [0, count) */
#define GEN_LOOP(T, count, STMT)                                                           \
    do {                                                                                   \
        enum { B = 64 / sizeof(T) };                                                       \
        size_t k = 0;                                                                      \
                                                                                           \
        while (k + B <= (count))                                                           \
            for (size_t j = 0; j < B; j++, k++) STMT;                                      \
        for (; k < (count); k++) STMT;                                                     \
    } while (0)

static void widen_half(float *restrict dst, const uint16_t *restrict src, size_t count)
{
    GEN_LOOP(float, count, dst[k] = half_to_float(src[k]));
}

static void narrow_half(uint16_t *restrict dst, const float *restrict src, size_t count)
{
    GEN_LOOP(float, count, dst[k] = float_to_half(src[k]));
}

static void widen_bf16(float *restrict dst, const uint16_t *restrict src, size_t count)
{
    GEN_LOOP(float, count, dst[k] = bits_to_float((uint32_t)src[k] << 16));
}

static void narrow_bf16(uint16_t *restrict dst, const float *restrict src, size_t count)
{
    GEN_LOOP(float, count, dst[k] = float_to_bf16(src[k]));
}

#define GEN_KERNEL(name, T, OP)                                                            \
    static void name##_dab(T *restrict d, const T *restrict x, const T *restrict y,        \
                           size_t count)                                                   \
    {                                                                                      \
        GEN_LOOP(T, count, d[k] = (T)OP(x[k], y[k]));                                      \
    }                                                                                      \
    static void name##_da(T *restrict d, const T *restrict y, size_t count)                \
    {                                                                                      \
        GEN_LOOP(T, count, d[k] = (T)OP(d[k], y[k]));                                      \
    }                                                                                      \
    static void name##_db(T *restrict d, const T *restrict x, size_t count)                \
    {                                                                                      \
        GEN_LOOP(T, count, d[k] = (T)OP(x[k], d[k]));                                      \
    }                                                                                      \
    static void name##_dd(T *restrict d, size_t count)                                     \
    {                                                                                      \
        GEN_LOOP(T, count, d[k] = (T)OP(d[k], d[k]));                                      \
    }                                                                                      \
    static void name(void *dst, const void *a, const void *b, size_t count)                \
    {                                                                                      \
        if (dst != a && dst != b) name##_dab(dst, a, b, count);                            \
        else if (dst != b) name##_da(dst, b, count);                                       \
        else if (dst != a) name##_db(dst, a, count);                                       \
        else name##_dd(dst, count);                                                        \
    }

#define OP_ADD(x, y)  ((x) + (y))
#define OP_MUL(x, y)  ((x) * (y))
#define OP_MIN(x, y)  ((x) < (y) ? (x) : (y))
#define OP_MAX(x, y)  ((x) > (y) ? (x) : (y))
/* (x > y || x is NaN) ? x : y, with | rather than || so that gcc can if-convert it */
#define OP_FMIN(x, y) ((((x) < (y)) | ((x) != (x))) ? (x) : (y))
#define OP_FMAX(x, y) ((((x) > (y)) | ((x) != (x))) ? (x) : (y))
#define OP_AND(x, y)  ((x) & (y))
#define OP_OR(x, y)   ((x) | (y))
#define OP_XOR(x, y)  ((x) ^ (y))
/* wrap-around arithmetic: operands converted to an unsigned type at least as wide as int */
#define OP_ADD32(x, y) ((uint32_t)(x) + (uint32_t)(y))
#define OP_MUL32(x, y) ((uint32_t)(x) * (uint32_t)(y))
#define OP_ADD64(x, y) ((uint64_t)(x) + (uint64_t)(y))
#define OP_MUL64(x, y) ((uint64_t)(x) * (uint64_t)(y))
#define OP_LAND(x, y)  ((uint8_t)(((x) != 0) & ((y) != 0)))
#define OP_LOR(x, y)   ((uint8_t)(((x) != 0) | ((y) != 0)))
#define OP_LXOR(x, y)  ((uint8_t)(((x) != 0) ^ ((y) != 0)))

GEN_KERNEL(bool_and, uint8_t, OP_LAND)
GEN_KERNEL(bool_or, uint8_t, OP_LOR)
GEN_KERNEL(bool_xor, uint8_t, OP_LXOR)

GEN_KERNEL(u8_sum, uint8_t, OP_ADD32)
GEN_KERNEL(u8_prod, uint8_t, OP_MUL32)
GEN_KERNEL(u8_min, uint8_t, OP_MIN)
GEN_KERNEL(u8_max, uint8_t, OP_MAX)
GEN_KERNEL(u8_and, uint8_t, OP_AND)
GEN_KERNEL(u8_or, uint8_t, OP_OR)
GEN_KERNEL(u8_xor, uint8_t, OP_XOR)

GEN_KERNEL(i8_sum, int8_t, OP_ADD32)
GEN_KERNEL(i8_prod, int8_t, OP_MUL32)
GEN_KERNEL(i8_min, int8_t, OP_MIN)
GEN_KERNEL(i8_max, int8_t, OP_MAX)

GEN_KERNEL(i16_sum, int16_t, OP_ADD32)
GEN_KERNEL(i16_prod, int16_t, OP_MUL32)
GEN_KERNEL(i16_min, int16_t, OP_MIN)
GEN_KERNEL(i16_max, int16_t, OP_MAX)

GEN_KERNEL(i32_sum, int32_t, OP_ADD32)
GEN_KERNEL(i32_prod, int32_t, OP_MUL32)
GEN_KERNEL(i32_min, int32_t, OP_MIN)
GEN_KERNEL(i32_max, int32_t, OP_MAX)

GEN_KERNEL(i64_sum, int64_t, OP_ADD64)
GEN_KERNEL(i64_prod, int64_t, OP_MUL64)
GEN_KERNEL(i64_min, int64_t, OP_MIN)
GEN_KERNEL(i64_max, int64_t, OP_MAX)

GEN_KERNEL(f32_sum, float, OP_ADD)
GEN_KERNEL(f32_prod, float, OP_MUL)
GEN_KERNEL(f32_min, float, OP_FMIN)
GEN_KERNEL(f32_max, float, OP_FMAX)

GEN_KERNEL(f64_sum, double, OP_ADD)
GEN_KERNEL(f64_prod, double, OP_MUL)
GEN_KERNEL(f64_min, double, OP_FMIN)
GEN_KERNEL(f64_max, double, OP_FMAX)

/* Complex PROD, (ar + i ai)(br + i bi), with the plain formula (no Inf/NaN recovery, as torch).
 * Each element is read completely before it is written, so dst may alias a or b. */
#define GEN_CPROD(name, T)                                                          \
    static void name(void *dst, const void *a, const void *b, size_t count)        \
    {                                                                               \
        T       *d = dst;                                                           \
        const T *x = a, *y = b;                                                     \
                                                                                    \
        for (size_t i = 0; i < count; i++) {                                        \
            T ar = x[2 * i], ai = x[2 * i + 1], br = y[2 * i], bi = y[2 * i + 1];   \
            T re = ar * br, im = ar * bi;                                           \
            re -= ai * bi;                                                          \
            im += ai * br;                                                          \
            d[2 * i]     = re;                                                      \
            d[2 * i + 1] = im;                                                      \
        }                                                                           \
    }

GEN_CPROD(c64_prod, float)
GEN_CPROD(c128_prod, double)

/* float16/bfloat16 and complex SUM have no generic entry: see half_reduce and canonical(). */
static const xccl_reduce_kernels_t kernels_generic = {
    .name = "generic",
    .fn = {
        [XCCL_BOOL] = {bool_or, bool_and, bool_and, bool_or, bool_and, bool_or, bool_xor},
        [XCCL_UINT8] = {u8_sum, u8_prod, u8_min, u8_max, u8_and, u8_or, u8_xor},
        [XCCL_INT8] = {i8_sum, i8_prod, i8_min, i8_max},
        [XCCL_INT16] = {i16_sum, i16_prod, i16_min, i16_max},
        [XCCL_INT32] = {i32_sum, i32_prod, i32_min, i32_max},
        [XCCL_INT64] = {i64_sum, i64_prod, i64_min, i64_max},
        [XCCL_FLOAT32] = {f32_sum, f32_prod, f32_min, f32_max},
        [XCCL_FLOAT64] = {f64_sum, f64_prod, f64_min, f64_max},
        [XCCL_COMPLEX64] = {[XCCL_OP_PROD] = c64_prod},
        [XCCL_COMPLEX128] = {[XCCL_OP_PROD] = c128_prod},
    },
    .widen  = {widen_half, widen_bf16},
    .narrow = {narrow_half, narrow_bf16},
};

/* ---------------------------------------------------------------------------------------------
 * Kernel-set selection: once, at the first use, from $XCCL_REDUCE_ISA or the best the CPU
 * supports (__builtin_cpu_supports also checks that the OS saves the wider registers).
 * ------------------------------------------------------------------------------------------- */

static pthread_once_t                         isa_once = PTHREAD_ONCE_INIT;
static _Atomic(const xccl_reduce_kernels_t *) isa_cur;

static int isa_available(const char *name)
{
    if (strcmp(name, "generic") == 0) return 1;
#if XCCL_REDUCE_X86
    __builtin_cpu_init();
    if (strcmp(name, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    if (strcmp(name, "avx512") == 0)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
#endif
    return 0;
}

/* Finds the kernel set called `name` ("auto": the best this CPU runs). Returns XCCL_OK,
 * XCCL_ERR_INVALID_ARG for an unknown name or XCCL_ERR_NOT_SUPPORTED; reports nothing. */
static xccl_status_t isa_lookup(const char *name, const xccl_reduce_kernels_t **out)
{
    if (strcmp(name, "auto") == 0) {
        if (isa_available("avx512")) name = "avx512";
        else if (isa_available("avx2")) name = "avx2";
        else name = "generic";
    }
    if (strcmp(name, "generic") == 0) {
        *out = &kernels_generic;
        return XCCL_OK;
    }
    if (strcmp(name, "avx2") != 0 && strcmp(name, "avx512") != 0) return XCCL_ERR_INVALID_ARG;
    if (!isa_available(name)) return XCCL_ERR_NOT_SUPPORTED;
#if XCCL_REDUCE_X86
    *out = strcmp(name, "avx2") == 0 ? &xccl_reduce_kernels_avx2 : &xccl_reduce_kernels_avx512;
#endif
    return XCCL_OK;
}

static void isa_init(void)
{
    const char                  *env = getenv("XCCL_REDUCE_ISA");
    const xccl_reduce_kernels_t *k   = &kernels_generic;

    (void)isa_lookup("auto", &k);
    if (env != NULL && *env != '\0' && isa_lookup(env, &k) != XCCL_OK)
        XCCL_WARN("XCCL_REDUCE_ISA=%s: unknown or not supported by this CPU; using %s", env,
                  k->name);
    atomic_store_explicit(&isa_cur, k, memory_order_release);
}

static const xccl_reduce_kernels_t *kernels(void)
{
    pthread_once(&isa_once, isa_init);
    return atomic_load_explicit(&isa_cur, memory_order_acquire);
}

const char *xccl_reduce_isa(void)
{
    return kernels()->name;
}

xccl_status_t xccl_reduce_set_isa(const char *isa)
{
    const xccl_reduce_kernels_t *k  = NULL;
    xccl_status_t                st = isa ? isa_lookup(isa, &k) : XCCL_ERR_INVALID_ARG;

    if (st == XCCL_ERR_INVALID_ARG)
        return XCCL_ERROR(st, "reduce: unknown kernel set '%s' (generic, avx2, avx512, auto)",
                          isa ? isa : "(null)");
    if (st != XCCL_OK)
        return XCCL_ERROR(st, "reduce: this CPU cannot run the %s kernels", isa);
    pthread_once(&isa_once, isa_init); /* so a later first use does not override the choice */
    atomic_store_explicit(&isa_cur, k, memory_order_release);
    return XCCL_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Dispatch
 * ------------------------------------------------------------------------------------------- */

/* Elements per step when float16/bfloat16 go through float32 scratch on the stack (2 x 2 KiB),
 * and bytes per step of reduce_n, sized so the destination block stays in L1 while every
 * source streams through it. */
#define HALF_BLOCK    512
#define REDUCE_N_STEP 8192

static xccl_status_t check_base_op(const char *what, xccl_op_t op, xccl_dtype_t dtype)
{
    XCCL_CHECK(xccl_op_check(op, dtype));
    if (op >= XCCL_REDUCE_NBASE)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                          "%s: op %s is not a base operator (reduce with sum, then scale)", what,
                          op_names[op]);
    return XCCL_OK;
}

/* Complex SUM is float SUM over twice the elements; bitwise ops on integers are uint8 ops over
 * the same bytes. Rewrites dtype and count accordingly. */
static void canonical(xccl_dtype_t *dtype, xccl_op_t op, size_t *count)
{
    if (op == XCCL_OP_SUM && is_complex(*dtype)) {
        *dtype = *dtype == XCCL_COMPLEX64 ? XCCL_FLOAT32 : XCCL_FLOAT64;
        *count *= 2;
    } else if ((op == XCCL_OP_BAND || op == XCCL_OP_BOR || op == XCCL_OP_BXOR) &&
               is_integer(*dtype)) {
        *count *= dtype_info[*dtype].size;
        *dtype = XCCL_UINT8;
    }
}

static xccl_reduce_fn pick(const xccl_reduce_kernels_t *k, xccl_dtype_t dtype, xccl_op_t op)
{
    xccl_reduce_fn fn = k->fn[dtype][op];

    return fn != NULL ? fn : kernels_generic.fn[dtype][op];
}

/* float16/bfloat16 over n >= 1 sources: per block, widen srcs[0] into a float32 accumulator,
 * fold srcs[1..n-1] into it in index order with the float32 kernel, narrow once. Every block
 * is read completely before it is written, so dst may alias any source. */
static void half_reduce(const xccl_reduce_kernels_t *k, uint16_t *dst, const void *const *srcs,
                        int n, size_t count, xccl_dtype_t dtype, xccl_op_t op)
{
    int            w      = dtype == XCCL_BFLOAT16;
    xccl_widen_fn  widen  = k->widen[w] ? k->widen[w] : kernels_generic.widen[w];
    xccl_narrow_fn narrow = k->narrow[w] ? k->narrow[w] : kernels_generic.narrow[w];
    xccl_reduce_fn f32    = pick(k, XCCL_FLOAT32, op);
    float          acc[HALF_BLOCK], tmp[HALF_BLOCK];

    for (size_t off = 0; off < count; off += HALF_BLOCK) {
        size_t m = count - off < HALF_BLOCK ? count - off : HALF_BLOCK;

        widen(acc, (const uint16_t *)srcs[0] + off, m);
        for (int j = 1; j < n; j++) {
            widen(tmp, (const uint16_t *)srcs[j] + off, m);
            f32(acc, acc, tmp, m);
        }
        narrow(dst + off, acc, m);
    }
}

xccl_status_t xccl_reduce2(void *dst, const void *a, const void *b, size_t count,
                           xccl_dtype_t dtype, xccl_op_t op)
{
    const xccl_reduce_kernels_t *k;
    xccl_reduce_fn               fn;

    XCCL_CHECK(check_base_op("reduce2", op, dtype));
    if (count == 0) return XCCL_OK;
    if (dst == NULL || a == NULL || b == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "reduce2: NULL buffer for %zu %s elements", count,
                          dtype_info[dtype].name);
    k = kernels();
    canonical(&dtype, op, &count);
    fn = pick(k, dtype, op);
    if (fn != NULL) {
        fn(dst, a, b, count);
    } else {
        const void *srcs[2] = {a, b};
        half_reduce(k, dst, srcs, 2, count, dtype, op);
    }
    return XCCL_OK;
}

/* Non-half types over n >= 3 sources, in steps of REDUCE_N_STEP bytes:
 *   acc = srcs[0] op srcs[1];  acc = acc op srcs[j] for j = 2..n-1;  (acc is dst's block)
 * When dst is also srcs[j] for some j >= 2, acc is a scratch block copied to dst at the end
 * of each step, so that source j is not read after dst was written. */
static void chain_reduce(xccl_reduce_fn fn, char *dst, const void *const *srcs, int n,
                         size_t count, size_t size)
{
    _Alignas(64) char scratch[REDUCE_N_STEP];
    size_t            step  = REDUCE_N_STEP / size;
    int               alias = 0;

    for (int j = 2; j < n; j++) alias |= srcs[j] == dst;
    for (size_t off = 0; off < count; off += step) {
        size_t m   = count - off < step ? count - off : step;
        char  *d   = dst + off * size;
        char  *acc = alias ? scratch : d;

        fn(acc, (const char *)srcs[0] + off * size, (const char *)srcs[1] + off * size, m);
        for (int j = 2; j < n; j++) fn(acc, acc, (const char *)srcs[j] + off * size, m);
        if (alias) memcpy(d, acc, m * size);
    }
}

xccl_status_t xccl_reduce_n(void *dst, const void *const *srcs, int n, size_t count,
                            xccl_dtype_t dtype, xccl_op_t op)
{
    const xccl_reduce_kernels_t *k;
    xccl_reduce_fn               fn;

    XCCL_CHECK(check_base_op("reduce_n", op, dtype));
    if (n < 1 || srcs == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "reduce_n: %d sources (need >= 1)", n);
    if (count == 0) return XCCL_OK;
    if (dst == NULL) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "reduce_n: NULL destination");
    for (int j = 0; j < n; j++)
        if (srcs[j] == NULL)
            return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "reduce_n: source %d of %d is NULL", j, n);
    k = kernels();
    if (n == 1) {
        if (dtype == XCCL_BOOL) pick(k, XCCL_BOOL, XCCL_OP_BOR)(dst, srcs[0], srcs[0], count);
        else if (dst != srcs[0]) memmove(dst, srcs[0], count * dtype_info[dtype].size);
        return XCCL_OK;
    }
    canonical(&dtype, op, &count);
    fn = pick(k, dtype, op);
    if (fn != NULL && n == 2) /* for f16/bf16 too: a fused kernel also rounds once */
        fn(dst, srcs[0], srcs[1], count);
    else if (is_half(dtype)) /* one rounding after all n inputs: never chain 16-bit results */
        half_reduce(k, dst, srcs, n, count, dtype, op);
    else
        chain_reduce(fn, dst, srcs, n, count, dtype_info[dtype].size);
    return XCCL_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Scaling (PREMUL_SUM) and division (AVG)
 * ------------------------------------------------------------------------------------------- */

/* round(v) (ties away from zero) clamped to [lo, hi]; NaN gives 0. lo and hi are exact. */
static int64_t round_clamp(double v, double lo, double hi)
{
    double r = round(v);

    if (r != r) return 0;
    if (r <= lo) return (int64_t)lo;
    if (r >= hi) return (int64_t)hi;
    return (int64_t)r;
}

/* int64: 2^63 is not an int64, so the upper clamp is separate */
static int64_t round_clamp64(double v)
{
    double r = round(v);

    if (r != r) return 0;
    if (r >= 0x1p63) return INT64_MAX;
    if (r <= -0x1p63) return INT64_MIN;
    return (int64_t)r;
}

/* float16/bfloat16 through float32 blocks: dst[i] = narrow(widen(src[i]) <op> f). */
static void half_map(const xccl_reduce_kernels_t *k, uint16_t *dst, const uint16_t *src,
                     size_t count, xccl_dtype_t dtype, float f, int divide)
{
    int            w      = dtype == XCCL_BFLOAT16;
    xccl_widen_fn  widen  = k->widen[w] ? k->widen[w] : kernels_generic.widen[w];
    xccl_narrow_fn narrow = k->narrow[w] ? k->narrow[w] : kernels_generic.narrow[w];
    float          buf[HALF_BLOCK];

    for (size_t off = 0; off < count; off += HALF_BLOCK) {
        size_t m = count - off < HALF_BLOCK ? count - off : HALF_BLOCK;

        widen(buf, src + off, m);
        if (divide)
            for (size_t i = 0; i < m; i++) buf[i] /= f;
        else
            for (size_t i = 0; i < m; i++) buf[i] *= f;
        narrow(dst + off, buf, m);
    }
}

#define MAP_LOOP(T, expr)                                                            \
    do {                                                                             \
        T       *d_ = dst;                                                           \
        const T *s_ = src;                                                           \
        for (size_t i = 0; i < count; i++) {                                         \
            T x = s_[i];                                                             \
            d_[i] = (T)(expr);                                                       \
        }                                                                            \
    } while (0)

static xccl_status_t map_args(const char *what, void *dst, const void *src, size_t count,
                              xccl_dtype_t dtype)
{
    if (!dtype_ok(dtype))
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "%s: invalid dtype %d", what, (int)dtype);
    if (dtype == XCCL_BOOL)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED, "%s: not defined for dtype bool", what);
    if (count > 0 && (dst == NULL || src == NULL))
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "%s: NULL buffer for %zu %s elements", what,
                          count, dtype_info[dtype].name);
    return XCCL_OK;
}

xccl_status_t xccl_scale(void *dst, const void *src, size_t count, xccl_dtype_t dtype,
                         double factor)
{
    float ff = (float)factor;

    XCCL_CHECK(map_args("scale", dst, src, count, dtype));
    if (dtype == XCCL_COMPLEX64 || dtype == XCCL_COMPLEX128) {
        dtype = dtype == XCCL_COMPLEX64 ? XCCL_FLOAT32 : XCCL_FLOAT64;
        count *= 2;
    }
    switch (dtype) {
    case XCCL_UINT8: MAP_LOOP(uint8_t, round_clamp(x * factor, 0, UINT8_MAX)); break;
    case XCCL_INT8: MAP_LOOP(int8_t, round_clamp(x * factor, INT8_MIN, INT8_MAX)); break;
    case XCCL_INT16: MAP_LOOP(int16_t, round_clamp(x * factor, INT16_MIN, INT16_MAX)); break;
    case XCCL_INT32: MAP_LOOP(int32_t, round_clamp(x * factor, INT32_MIN, INT32_MAX)); break;
    case XCCL_INT64: MAP_LOOP(int64_t, round_clamp64((double)x * factor)); break;
    case XCCL_FLOAT16:
    case XCCL_BFLOAT16: half_map(kernels(), dst, src, count, dtype, ff, 0); break;
    case XCCL_FLOAT32: MAP_LOOP(float, x * ff); break;
    case XCCL_FLOAT64: MAP_LOOP(double, x * factor); break;
    default: break; /* bool and complex were dealt with above */
    }
    return XCCL_OK;
}

xccl_status_t xccl_divide(void *dst, const void *src, size_t count, xccl_dtype_t dtype, int n)
{
    XCCL_CHECK(map_args("divide", dst, src, count, dtype));
    if (n <= 0) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "divide: divisor %d (need > 0)", n);
    if (dtype == XCCL_COMPLEX64 || dtype == XCCL_COMPLEX128) {
        dtype = dtype == XCCL_COMPLEX64 ? XCCL_FLOAT32 : XCCL_FLOAT64;
        count *= 2;
    }
    /* C integer division truncates toward zero; n > 0 rules out INT_MIN / -1 */
    switch (dtype) {
    case XCCL_UINT8: MAP_LOOP(uint8_t, x / n); break;
    case XCCL_INT8: MAP_LOOP(int8_t, x / n); break;
    case XCCL_INT16: MAP_LOOP(int16_t, x / n); break;
    case XCCL_INT32: MAP_LOOP(int32_t, x / n); break;
    case XCCL_INT64: MAP_LOOP(int64_t, x / (int64_t)n); break;
    case XCCL_FLOAT16:
    case XCCL_BFLOAT16: half_map(kernels(), dst, src, count, dtype, (float)n, 1); break;
    case XCCL_FLOAT32: MAP_LOOP(float, x / (float)n); break;
    case XCCL_FLOAT64: MAP_LOOP(double, x / (double)n); break;
    default: break;
    }
    return XCCL_OK;
}
