/* SPDX-License-Identifier: Apache-2.0
 *
 * test_reduce.c - the local reduction kernels (csrc/core/reduce.c and its AVX2 / AVX-512
 * sets) against a scalar reference written here, independently of the library:
 *   - float16/bfloat16 are decoded with ldexp from their fields and rounded by a binary
 *     search over the ordered bit patterns (ties to the even pattern), never with the
 *     library's bit tricks; known bit patterns and every rounding boundary are checked;
 *   - every dtype x valid base op x kernel set this CPU runs x lengths {0..4099} x aliasing
 *     (distinct, dst == a, dst == b, dst == a == b), with guard bytes after each buffer;
 *   - reduce_n for n = 1..9, invalid (op, dtype) pairs, NaN propagation, integer wrap-around,
 *     scale/divide, $XCCL_REDUCE_ISA (in forked children) and concurrent use from threads.
 * Float results must match bit for bit; a NaN only has to be a NaN (payloads are not
 * specified).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/reduce.h"
#include "core/reduce_impl.h" /* XCCL_REDUCE_X86: were the SIMD sets built? */
#include "ctest.h"

#define GUARD 32 /* bytes after every output buffer that must stay untouched */
#define NBASE 7  /* SUM .. BXOR */

static const char *const dt_names[XCCL_DTYPE_COUNT] = {
    "bool",    "uint8",    "int8",    "int16",   "int32",     "int64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
};
static const size_t dt_sizes[XCCL_DTYPE_COUNT] = {1, 1, 1, 2, 4, 8, 2, 2, 4, 8, 8, 16};
static const char *const op_names[XCCL_OP_COUNT] = {
    "sum", "product", "min", "max", "band", "bor", "bxor", "avg", "premul_sum",
};

static int is_int(xccl_dtype_t dt)
{
    return dt >= XCCL_UINT8 && dt <= XCCL_INT64;
}

static int is_cplx(xccl_dtype_t dt)
{
    return dt == XCCL_COMPLEX64 || dt == XCCL_COMPLEX128;
}

/* The validity table, written out from the documented rules. */
static int op_valid(xccl_op_t op, xccl_dtype_t dt)
{
    switch (op) {
    case XCCL_OP_SUM:
    case XCCL_OP_PROD: return 1;
    case XCCL_OP_MIN:
    case XCCL_OP_MAX: return !is_cplx(dt);
    case XCCL_OP_BAND:
    case XCCL_OP_BOR:
    case XCCL_OP_BXOR: return dt == XCCL_BOOL || is_int(dt);
    case XCCL_OP_AVG: return dt != XCCL_BOOL;
    case XCCL_OP_PREMUL_SUM: return dt >= XCCL_FLOAT16;
    default: return 0;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Deterministic random numbers (splitmix64)
 * ------------------------------------------------------------------------------------------- */
static uint64_t rng = 0x1234567887654321ull;

static uint64_t rnd(void)
{
    uint64_t z = (rng += 0x9e3779b97f4a7c15ull);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* ---------------------------------------------------------------------------------------------
 * Reference float16 / bfloat16
 * ------------------------------------------------------------------------------------------- */

/* Value of a float16 (bf = 0: 5 exponent, 10 mantissa bits) or bfloat16 (bf = 1: 8 and 7)
 * pattern, computed from its fields. */
static double ref_value(uint16_t h, int bf)
{
    int    mbits = bf ? 7 : 10, ebits = bf ? 8 : 5;
    int    bias = (1 << (ebits - 1)) - 1;
    int    e = (h >> mbits) & ((1 << ebits) - 1), m = h & ((1 << mbits) - 1);
    double v;

    if (e == (1 << ebits) - 1) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexp(m, 1 - bias - mbits);
    else v = ldexp((1 << mbits) + m, e - bias - mbits);
    return (h & 0x8000) ? -v : v;
}

static int ref_isnan16(uint16_t h, int bf)
{
    return (h & 0x7fff) > (bf ? 0x7f80 : 0x7c00);
}

/* Value of a non-negative pattern p <= the +Inf pattern, with +Inf standing for the value
 * one ulp above the largest finite number (the point where rounding overflows). */
static double ladder(uint16_t p, int bf)
{
    uint16_t inf = bf ? 0x7f80 : 0x7c00;

    if (p == inf) return ldexp(1.0, bf ? 128 : 16);
    return ref_value(p, bf);
}

/* x rounded to the nearest pattern, ties to the even pattern. */
static uint16_t ref_round(double x, int bf)
{
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    uint16_t lo = 0, hi = bf ? 0x7f80 : 0x7c00;
    double   ax = fabs(x), mid;

    if (isnan(x)) return bf ? 0x7fc0 : 0x7e00;
    if (ax >= ladder(hi, bf)) return sign | hi;
    while (hi - lo > 1) { /* ladder(lo) <= ax < ladder(hi) */
        uint16_t m = (uint16_t)((lo + hi) / 2);
        if (ladder(m, bf) <= ax) lo = m;
        else hi = m;
    }
    mid = (ladder(lo, bf) + ladder(hi, bf)) / 2; /* exact: both have few significant bits */
    if (ax < mid) return sign | lo;
    if (ax > mid) return sign | hi;
    return sign | ((lo & 1) ? hi : lo);
}

static uint32_t fbits(float f)
{
    uint32_t u;

    memcpy(&u, &f, 4);
    return u;
}

static float bitsf(uint32_t u)
{
    float f;

    memcpy(&f, &u, 4);
    return f;
}

static void test_conversions(void)
{
    static const struct {
        float    f;
        uint16_t h;
    } half_tab[] = {
        {1.0f, 0x3c00},         {-2.0f, 0xc000},       {0.5f, 0x3800},
        {65504.0f, 0x7bff},     {0x1p-24f, 0x0001},    {0x1p-14f, 0x0400},
        {0x1.ff8p-15f, 0x03ff}, {0.0f, 0x0000},        {-0.0f, 0x8000},
        {INFINITY, 0x7c00},     {-INFINITY, 0xfc00},   {1.0f / 3.0f, 0x3555},
        {0.1f, 0x2e66},         {1.0f + 0x1p-11f, 0x3c00}, /* tie -> even (down) */
        {1.0f + 0x3p-11f, 0x3c02},                          /* tie -> even (up)   */
        {65519.0f, 0x7bff},     {65520.0f, 0x7c00},    {1e10f, 0x7c00},
        {0x1p-25f, 0x0000},     {0x1.000002p-25f, 0x0001}, {0x3p-25f, 0x0002},
        {0x1p-26f, 0x0000},     {-0x1p-26f, 0x8000},   {0x1.ffcp-15f, 0x0400},
    };
    static const struct {
        uint32_t f;
        uint16_t h;
    } bf_tab[] = {
        {0x3f800000, 0x3f80}, {0x3f808000, 0x3f80}, /* tie -> even (down) */
        {0x3f818000, 0x3f82},                       /* tie -> even (up)   */
        {0x3f808001, 0x3f81}, {0x7f7fffff, 0x7f80}, {0x7f7f7fff, 0x7f7f},
        {0x00000001, 0x0000}, {0x00008000, 0x0000}, {0x00018000, 0x0002},
        {0x80000000, 0x8000}, {0xff800000, 0xff80}, {0x40490fdb, 0x4049},
    };
    int bad = 0;

    for (size_t i = 0; i < sizeof(half_tab) / sizeof(half_tab[0]); i++) {
        CHECK_MSG(xccl_float_to_half(half_tab[i].f) == half_tab[i].h, "half(%a) = 0x%04x != 0x%04x",
                  (double)half_tab[i].f, xccl_float_to_half(half_tab[i].f), half_tab[i].h);
        CHECK_MSG(ref_round(half_tab[i].f, 0) == half_tab[i].h, "reference half(%a)",
                  (double)half_tab[i].f);
    }
    for (size_t i = 0; i < sizeof(bf_tab) / sizeof(bf_tab[0]); i++) {
        float f = bitsf(bf_tab[i].f);
        CHECK_MSG(xccl_float_to_bf16(f) == bf_tab[i].h, "bf16(0x%08x) = 0x%04x != 0x%04x",
                  bf_tab[i].f, xccl_float_to_bf16(f), bf_tab[i].h);
        CHECK_MSG(ref_round(f, 1) == bf_tab[i].h, "reference bf16(0x%08x)", bf_tab[i].f);
    }
    CHECK(fbits(xccl_half_to_float(0x3c00)) == 0x3f800000);
    CHECK(fbits(xccl_half_to_float(0x0001)) == fbits(0x1p-24f));
    CHECK(fbits(xccl_bf16_to_float(0x3f80)) == 0x3f800000);
    /* NaNs stay NaN (a bfloat16 truncation would turn 0x7f800001 into Inf) */
    CHECK(isnan(xccl_half_to_float(0x7c01)) && isnan(xccl_half_to_float(0xfe00)));
    CHECK(isnan(xccl_bf16_to_float(0x7f81)) && isnan(xccl_bf16_to_float(0xffc0)));
    CHECK(ref_isnan16(xccl_float_to_half(bitsf(0x7f800001)), 0));
    CHECK(ref_isnan16(xccl_float_to_bf16(bitsf(0x7f800001)), 1));
    CHECK(ref_isnan16(xccl_float_to_bf16(bitsf(0xffffffff)), 1));
    CHECK(xccl_float_to_half(bitsf(0xffc00000)) & 0x8000);
    /* exact NaN patterns: float16 as the F16C instructions give them (quiet bit set, top
     * payload bits kept, sign kept); bfloat16 widens exactly and narrows to a quiet NaN */
    CHECK(fbits(xccl_half_to_float(0x7c01)) == 0x7fc02000);
    CHECK(fbits(xccl_half_to_float(0xfe00)) == 0xffc00000);
    CHECK(xccl_float_to_half(bitsf(0x7f800001)) == 0x7e00);
    CHECK(xccl_float_to_half(bitsf(0xff802000)) == 0xfe01);
    CHECK(xccl_float_to_half(bitsf(0x7fffffff)) == 0x7fff);
    CHECK(fbits(xccl_bf16_to_float(0x7f81)) == 0x7f810000);
    CHECK(xccl_float_to_bf16(bitsf(0x7f800001)) == 0x7fc0);
    CHECK(xccl_float_to_bf16(bitsf(0xff810000)) == 0xffc1);

    /* every pattern decodes to its value and encodes back; the midpoint between each finite
     * magnitude and the next one (Inf after the largest), and the floats just either side of
     * it, round as they must */
    for (int bf = 0; bf <= 1; bf++) {
        uint16_t (*cvt)(float) = bf ? xccl_float_to_bf16 : xccl_float_to_half;
        uint16_t inf           = bf ? 0x7f80 : 0x7c00;

        for (uint32_t p = 0; p <= 0xffff; p++) {
            uint16_t h = (uint16_t)p, mag = h & 0x7fff, sign = h & 0x8000;
            float    f = bf ? xccl_bf16_to_float(h) : xccl_half_to_float(h);
            double   v = ref_value(h, bf);

            if (ref_isnan16(h, bf)) {
                bad += !isnan(f);
                continue;
            }
            bad += fbits(f) != fbits((float)v);
            bad += cvt((float)v) != h;
            if (mag < inf) {
                uint16_t up    = (uint16_t)(mag + 1);
                float    m     = (float)((ladder(mag, bf) + ladder(up, bf)) / 2); /* exact */
                float    below = nextafterf(m, 0.0f), above = nextafterf(m, INFINITY);
                uint16_t even  = (mag & 1) ? up : mag;

                if (sign) {
                    m     = -m;
                    below = -below;
                    above = -above;
                }
                bad += cvt(m) != (sign | even) || ref_round(m, bf) != (sign | even);
                bad += cvt(below) != (sign | mag) || ref_round(below, bf) != (sign | mag);
                bad += cvt(above) != (sign | up) || ref_round(above, bf) != (sign | up);
            }
        }
    }
    CHECK_MSG(bad == 0, "%d exhaustive conversion mismatches", bad);
    bad = 0;
    for (int i = 0; i < 200000; i++) {
        float f = bitsf((uint32_t)rnd());
        if (i & 1) f = ldexpf((float)(rnd() & 0xffffff), (int)(rnd() % 60) - 60); /* near range */
        if (isnan(f)) continue;
        bad += xccl_float_to_half(f) != ref_round(f, 0);
        bad += xccl_float_to_bf16(f) != ref_round(f, 1);
    }
    CHECK_MSG(bad == 0, "%d random conversion mismatches", bad);
}

/* ---------------------------------------------------------------------------------------------
 * Reference reduction: out[i] = srcs[0][i] op ... op srcs[n-1][i], element by element.
 * Integers are folded in 64-bit unsigned arithmetic and truncated at the end (the same value
 * as wrapping at every step); f16/bf16 are folded in float and rounded once.
 * ------------------------------------------------------------------------------------------- */

static int64_t load_int(xccl_dtype_t dt, const void *p)
{
    switch (dt) {
    case XCCL_UINT8: return *(const uint8_t *)p;
    case XCCL_INT8: return *(const int8_t *)p;
    case XCCL_INT16: return *(const int16_t *)p;
    case XCCL_INT32: return *(const int32_t *)p;
    default: return *(const int64_t *)p;
    }
}

static void store_int(xccl_dtype_t dt, void *p, uint64_t v)
{
    switch (dt) {
    case XCCL_UINT8: *(uint8_t *)p = (uint8_t)v; break;
    case XCCL_INT8: *(uint8_t *)p = (uint8_t)v; break;
    case XCCL_INT16: *(uint16_t *)p = (uint16_t)v; break;
    case XCCL_INT32: *(uint32_t *)p = (uint32_t)v; break;
    default: *(uint64_t *)p = v; break;
    }
}

static float fold_f(xccl_op_t op, float acc, float x)
{
    switch (op) {
    case XCCL_OP_SUM: return acc + x;
    case XCCL_OP_PROD: return acc * x;
    case XCCL_OP_MIN:
        if (isnan(acc) || isnan(x)) return NAN;
        return acc < x ? acc : x; /* equal (+0 / -0): the later operand */
    default:
        if (isnan(acc) || isnan(x)) return NAN;
        return acc > x ? acc : x;
    }
}

static double fold_d(xccl_op_t op, double acc, double x)
{
    switch (op) {
    case XCCL_OP_SUM: return acc + x;
    case XCCL_OP_PROD: return acc * x;
    case XCCL_OP_MIN:
        if (isnan(acc) || isnan(x)) return NAN;
        return acc < x ? acc : x;
    default:
        if (isnan(acc) || isnan(x)) return NAN;
        return acc > x ? acc : x;
    }
}

static void ref_reduce(void *out, const void *const *srcs, int n, size_t count, xccl_dtype_t dt,
                       xccl_op_t op)
{
    size_t sz = dt_sizes[dt];

    for (size_t i = 0; i < count; i++) {
        const void *e[16];
        char       *o = (char *)out + i * sz;

        for (int j = 0; j < n; j++) e[j] = (const char *)srcs[j] + i * sz;
        if (dt == XCCL_BOOL) {
            int acc = *(const uint8_t *)e[0] != 0;
            for (int j = 1; j < n; j++) {
                int x = *(const uint8_t *)e[j] != 0;
                if (op == XCCL_OP_SUM || op == XCCL_OP_MAX || op == XCCL_OP_BOR) acc = acc || x;
                else if (op == XCCL_OP_BXOR) acc = acc != x;
                else acc = acc && x;
            }
            *(uint8_t *)o = (uint8_t)acc;
        } else if (is_int(dt)) {
            int64_t acc = load_int(dt, e[0]);
            for (int j = 1; j < n; j++) {
                int64_t x = load_int(dt, e[j]);
                switch (op) {
                case XCCL_OP_SUM: acc = (int64_t)((uint64_t)acc + (uint64_t)x); break;
                case XCCL_OP_PROD: acc = (int64_t)((uint64_t)acc * (uint64_t)x); break;
                case XCCL_OP_MIN: acc = x < acc ? x : acc; break;
                case XCCL_OP_MAX: acc = x > acc ? x : acc; break;
                case XCCL_OP_BAND: acc &= x; break;
                case XCCL_OP_BOR: acc |= x; break;
                default: acc ^= x; break;
                }
                /* MIN/MAX compare the wrapped values: truncate after every step */
                store_int(dt, o, (uint64_t)acc);
                acc = load_int(dt, o);
            }
            store_int(dt, o, (uint64_t)acc);
        } else if (dt == XCCL_FLOAT16 || dt == XCCL_BFLOAT16) {
            int   bf  = dt == XCCL_BFLOAT16;
            float acc = (float)ref_value(*(const uint16_t *)e[0], bf);
            for (int j = 1; j < n; j++)
                acc = fold_f(op, acc, (float)ref_value(*(const uint16_t *)e[j], bf));
            *(uint16_t *)o = ref_round(acc, bf);
        } else if (dt == XCCL_FLOAT32) {
            float acc = *(const float *)e[0];
            for (int j = 1; j < n; j++) acc = fold_f(op, acc, *(const float *)e[j]);
            *(float *)o = acc;
        } else if (dt == XCCL_FLOAT64) {
            double acc = *(const double *)e[0];
            for (int j = 1; j < n; j++) acc = fold_d(op, acc, *(const double *)e[j]);
            *(double *)o = acc;
        } else if (dt == XCCL_COMPLEX64) {
            float re = ((const float *)e[0])[0], im = ((const float *)e[0])[1];
            for (int j = 1; j < n; j++) {
                float br = ((const float *)e[j])[0], bi = ((const float *)e[j])[1];
                if (op == XCCL_OP_SUM) {
                    re += br;
                    im += bi;
                } else {
                    float r2 = re * br - im * bi, i2 = re * bi + im * br;
                    re = r2;
                    im = i2;
                }
            }
            ((float *)o)[0] = re;
            ((float *)o)[1] = im;
        } else {
            double re = ((const double *)e[0])[0], im = ((const double *)e[0])[1];
            for (int j = 1; j < n; j++) {
                double br = ((const double *)e[j])[0], bi = ((const double *)e[j])[1];
                if (op == XCCL_OP_SUM) {
                    re += br;
                    im += bi;
                } else {
                    double r2 = re * br - im * bi, i2 = re * bi + im * br;
                    re = r2;
                    im = i2;
                }
            }
            ((double *)o)[0] = re;
            ((double *)o)[1] = im;
        }
    }
}

/* Index of the first element where got differs from want, or -1. NaN matches any NaN. */
static long compare(xccl_dtype_t dt, const void *got, const void *want, size_t count)
{
    size_t sz = dt_sizes[dt];

    for (size_t i = 0; i < count; i++) {
        const char *g = (const char *)got + i * sz, *w = (const char *)want + i * sz;

        if (memcmp(g, w, sz) == 0) continue;
        if (dt == XCCL_FLOAT16 || dt == XCCL_BFLOAT16) {
            int bf = dt == XCCL_BFLOAT16;
            if (ref_isnan16(*(const uint16_t *)g, bf) && ref_isnan16(*(const uint16_t *)w, bf))
                continue;
        } else if (dt == XCCL_FLOAT32 || dt == XCCL_COMPLEX64) {
            int ok = 1;
            for (size_t k = 0; k < sz / 4; k++) {
                float a, b;
                memcpy(&a, g + 4 * k, 4);
                memcpy(&b, w + 4 * k, 4);
                ok &= (isnan(a) && isnan(b)) || fbits(a) == fbits(b);
            }
            if (ok) continue;
        } else if (dt == XCCL_FLOAT64 || dt == XCCL_COMPLEX128) {
            int ok = 1;
            for (size_t k = 0; k < sz / 8; k++) {
                double a, b;
                memcpy(&a, g + 8 * k, 8);
                memcpy(&b, w + 8 * k, 8);
                ok &= (isnan(a) && isnan(b)) || memcmp(&a, &b, 8) == 0;
            }
            if (ok) continue;
        }
        return (long)i;
    }
    return -1;
}

/* ---------------------------------------------------------------------------------------------
 * Test data
 * ------------------------------------------------------------------------------------------- */

static double rnd_real(void)
{
    switch (rnd() % 24) {
    case 0: return NAN;
    case 1: return INFINITY;
    case 2: return -INFINITY;
    case 3: return 0.0;
    case 4: return -0.0;
    case 5: return (rnd() & 1) ? 1e-40 : -1e-310; /* float / double subnormals */
    case 6: return (rnd() & 1) ? 3.4e38 : -1.7e308;
    default: {
        double v = ldexp((double)(rnd() >> 11), (int)(rnd() % 24) - 63); /* about 2^-12..2^11 */
        return (rnd() & 1) ? -v : v;
    }
    }
}

static void fill(xccl_dtype_t dt, void *buf, size_t count)
{
    for (size_t i = 0; i < count; i++) {
        char    *p = (char *)buf + i * dt_sizes[dt];
        uint64_t r = rnd();

        switch (dt) {
        case XCCL_BOOL: *(uint8_t *)p = (uint8_t)(r & 1); break;
        case XCCL_FLOAT16:
        case XCCL_BFLOAT16: *(uint16_t *)p = (uint16_t)r; break;
        case XCCL_FLOAT32: *(float *)p = (float)rnd_real(); break;
        case XCCL_FLOAT64: *(double *)p = rnd_real(); break;
        case XCCL_COMPLEX64:
            ((float *)p)[0] = (float)rnd_real();
            ((float *)p)[1] = (float)rnd_real();
            break;
        case XCCL_COMPLEX128:
            ((double *)p)[0] = rnd_real();
            ((double *)p)[1] = rnd_real();
            break;
        default: /* integers: mostly random bits, sometimes the extremes */
            if ((r & 7) == 0) { /* 0, 1, -1 (all ones), signed min, signed max */
                int bits = 8 * (int)dt_sizes[dt];
                switch ((r >> 3) % 5) {
                case 0: r = 0; break;
                case 1: r = 1; break;
                case 2: r = ~(uint64_t)0; break;
                case 3: r = (uint64_t)1 << (bits - 1); break;
                default: r = ((uint64_t)1 << (bits - 1)) - 1; break;
                }
            }
            memcpy(p, &r, dt_sizes[dt]);
            break;
        }
    }
}

/* malloc'd count elements followed by GUARD bytes of 0xa5 */
static void *alloc_buf(xccl_dtype_t dt, size_t count)
{
    size_t nb = count * dt_sizes[dt];
    char  *p  = malloc(nb + GUARD);

    if (p == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    memset(p + nb, 0xa5, GUARD);
    return p;
}

static int guard_ok(xccl_dtype_t dt, const void *buf, size_t count)
{
    const unsigned char *g = (const unsigned char *)buf + count * dt_sizes[dt];

    for (int i = 0; i < GUARD; i++)
        if (g[i] != 0xa5) return 0;
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * Kernel sets
 * ------------------------------------------------------------------------------------------- */
static const char *const isa_names[] = {"generic", "avx2", "avx512"};

/* What this CPU runs (and the build has), asked here rather than through the library. */
static int cpu_has(const char *isa)
{
#if XCCL_REDUCE_X86
    __builtin_cpu_init();
    if (strcmp(isa, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    if (strcmp(isa, "avx512") == 0)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
#endif
    return strcmp(isa, "generic") == 0;
}

static const char *best_isa(void)
{
    return cpu_has("avx512") ? "avx512" : cpu_has("avx2") ? "avx2" : "generic";
}

/* Children started before this process touches the library, so its one-time choice is
 * still to be made: the env var must select the set, and a bad value falls back to the best. */
static void test_env_isa(void)
{
    static const char *const vals[] = {"generic", "avx2", "avx512", "bogus", "auto", ""};

    for (size_t i = 0; i < sizeof(vals) / sizeof(vals[0]); i++) {
        const char *want = cpu_has(vals[i]) ? vals[i] : best_isa();
        pid_t       pid  = fork();
        int         wst  = 0;

        if (pid == 0) {
            setenv("XCCL_REDUCE_ISA", vals[i], 1);
            _exit(strcmp(xccl_reduce_isa(), want) == 0 ? 0 : 1);
        }
        CHECK(pid > 0 && waitpid(pid, &wst, 0) == pid);
        CHECK_MSG(WIFEXITED(wst) && WEXITSTATUS(wst) == 0, "XCCL_REDUCE_ISA=%s did not give %s",
                  vals[i], want);
    }
}

static void test_set_isa(void)
{
    for (size_t i = 0; i < 3; i++) {
        xccl_status_t st = xccl_reduce_set_isa(isa_names[i]);
        if (cpu_has(isa_names[i])) {
            CHECK(st == XCCL_OK);
            CHECK(strcmp(xccl_reduce_isa(), isa_names[i]) == 0);
        } else {
            CHECK(st == XCCL_ERR_NOT_SUPPORTED);
        }
    }
    CHECK(xccl_reduce_set_isa("sse9") == XCCL_ERR_INVALID_ARG);
    CHECK(xccl_reduce_set_isa(NULL) == XCCL_ERR_INVALID_ARG);
    CHECK(xccl_reduce_set_isa("auto") == XCCL_OK);
    CHECK(strcmp(xccl_reduce_isa(), best_isa()) == 0);
}

/* ---------------------------------------------------------------------------------------------
 * reduce2 and reduce_n against the reference
 * ------------------------------------------------------------------------------------------- */
static const size_t lengths[] = {0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 63, 65, 127, 1000, 4099};

static void test_reduce2(const char *isa)
{
    for (int dti = 0; dti < XCCL_DTYPE_COUNT; dti++) {
        xccl_dtype_t dt = (xccl_dtype_t)dti;
        for (int opi = 0; opi < NBASE; opi++) {
            xccl_op_t op = (xccl_op_t)opi;
            int       fails = 0;

            if (!op_valid(op, dt)) continue;
            for (size_t li = 0; li < sizeof(lengths) / sizeof(lengths[0]); li++) {
                size_t      n = lengths[li], nb = n * dt_sizes[dt];
                char       *a = alloc_buf(dt, n), *b = alloc_buf(dt, n), *d = alloc_buf(dt, n);
                char       *want = alloc_buf(dt, n), *want_aa = alloc_buf(dt, n);
                char       *a0 = alloc_buf(dt, n), *b0 = alloc_buf(dt, n);
                const void *ab[2], *aa[2];

                fill(dt, a, n);
                fill(dt, b, n);
                memcpy(a0, a, nb);
                memcpy(b0, b, nb);
                ab[0] = a;
                ab[1] = b;
                aa[0] = aa[1] = a;
                ref_reduce(want, ab, 2, n, dt, op);
                ref_reduce(want_aa, aa, 2, n, dt, op);
                for (int mode = 0; mode < 4; mode++) {
                    xccl_status_t st;
                    long          bad;

                    memcpy(a, a0, nb);
                    memcpy(b, b0, nb);
                    if (mode == 0) {
                        st = xccl_reduce2(d, a, b, n, dt, op);
                    } else if (mode == 1) {
                        memcpy(d, a, nb);
                        st = xccl_reduce2(d, d, b, n, dt, op);
                    } else if (mode == 2) {
                        memcpy(d, b, nb);
                        st = xccl_reduce2(d, a, d, n, dt, op);
                    } else {
                        memcpy(d, a, nb);
                        st = xccl_reduce2(d, d, d, n, dt, op);
                    }
                    bad = compare(dt, d, mode == 3 ? want_aa : want, n);
                    if (st != XCCL_OK || bad >= 0 || !guard_ok(dt, d, n) ||
                        memcmp(a, a0, nb) != 0 || memcmp(b, b0, nb) != 0) {
                        if (fails++ < 3)
                            CHECK_MSG(0, "%s reduce2 %s %s n=%zu alias=%d: st=%d first bad %ld",
                                      isa, dt_names[dt], op_names[op], n, mode, (int)st, bad);
                    }
                }
                free(a);
                free(b);
                free(d);
                free(want);
                free(want_aa);
                free(a0);
                free(b0);
            }
            CHECK_MSG(fails == 0, "%s reduce2 %s %s: %d failures", isa, dt_names[dt],
                      op_names[op], fails);
        }
    }
}

static void test_reduce_n(const char *isa)
{
    static const size_t lens[] = {0, 1, 17, 1000, 9001};

    for (int dti = 0; dti < XCCL_DTYPE_COUNT; dti++) {
        xccl_dtype_t dt = (xccl_dtype_t)dti;
        for (int opi = 0; opi < NBASE; opi++) {
            xccl_op_t op    = (xccl_op_t)opi;
            int       fails = 0;

            if (!op_valid(op, dt)) continue;
            for (int n = 1; n <= 9; n++) {
                for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
                    size_t      count = lens[li], nb = count * dt_sizes[dt];
                    char       *src[9], *keep[9], *d = alloc_buf(dt, count);
                    char       *want = alloc_buf(dt, count);
                    const void *cs[9];

                    if (count > 1000 && n != 3 && n != 9) {
                        free(d);
                        free(want);
                        continue;
                    }
                    for (int j = 0; j < n; j++) {
                        src[j]  = alloc_buf(dt, count);
                        keep[j] = alloc_buf(dt, count);
                        fill(dt, src[j], count);
                        memcpy(keep[j], src[j], nb);
                        cs[j] = src[j];
                    }
                    ref_reduce(want, cs, n, count, dt, op);
                    /* dst: distinct, srcs[0], srcs[1], srcs[n-1] (any source may be dst) */
                    for (int mode = 0; mode < (n == 1 ? 2 : n == 2 ? 3 : 4); mode++) {
                        xccl_status_t st;
                        long          bad;
                        char         *out = mode == 0 ? d : mode == 3 ? src[n - 1] : src[mode - 1];

                        for (int j = 0; j < n; j++) memcpy(src[j], keep[j], nb);
                        st  = xccl_reduce_n(out, cs, n, count, dt, op);
                        bad = compare(dt, out, want, count);
                        for (int j = 0; j < n; j++)
                            if (src[j] != out && memcmp(src[j], keep[j], nb) != 0) bad = -2;
                        if (st != XCCL_OK || bad != -1 || !guard_ok(dt, out, count)) {
                            if (fails++ < 3)
                                CHECK_MSG(0, "%s reduce_n %s %s n=%d count=%zu alias=%d: st=%d "
                                          "bad %ld", isa, dt_names[dt], op_names[op], n, count,
                                          mode, (int)st, bad);
                        }
                    }
                    for (int j = 0; j < n; j++) {
                        free(src[j]);
                        free(keep[j]);
                    }
                    free(d);
                    free(want);
                }
            }
            CHECK_MSG(fails == 0, "%s reduce_n %s %s: %d failures", isa, dt_names[dt],
                      op_names[op], fails);
        }
    }
}

/* NaN on either side, at the start (vector body) and at the end (tail) */
static void test_nan_minmax(const char *isa)
{
    enum { N = 37 };
    float    f[2][N], fo[N];
    double   g[2][N], go[N];
    uint16_t h[2][N], ho[N];

    for (int bf = 0; bf <= 1; bf++) {
        for (int side = 0; side < 2; side++) {
            for (int opi = XCCL_OP_MIN; opi <= XCCL_OP_MAX; opi++) {
                xccl_op_t op = (xccl_op_t)opi;
                for (int i = 0; i < N; i++) {
                    f[0][i] = g[0][i] = (float)i;
                    f[1][i] = g[1][i] = (float)(N - i);
                    h[0][i] = ref_round(i, bf);
                    h[1][i] = ref_round(N - i, bf);
                }
                f[side][0] = f[side][N - 1] = NAN;
                g[side][0] = g[side][N - 1] = NAN;
                h[side][0] = h[side][N - 1] = bf ? 0x7fc0 : 0x7e00;
                CHECK(xccl_reduce2(fo, f[0], f[1], N, XCCL_FLOAT32, op) == XCCL_OK);
                CHECK(xccl_reduce2(go, g[0], g[1], N, XCCL_FLOAT64, op) == XCCL_OK);
                CHECK(xccl_reduce2(ho, h[0], h[1], N, bf ? XCCL_BFLOAT16 : XCCL_FLOAT16, op) ==
                      XCCL_OK);
                CHECK_MSG(isnan(fo[0]) && isnan(fo[N - 1]) && !isnan(fo[1]), "%s f32 %s side %d",
                          isa, op_names[op], side);
                CHECK_MSG(isnan(go[0]) && isnan(go[N - 1]) && !isnan(go[1]), "%s f64 %s side %d",
                          isa, op_names[op], side);
                CHECK_MSG(ref_isnan16(ho[0], bf) && ref_isnan16(ho[N - 1], bf) &&
                              !ref_isnan16(ho[1], bf),
                          "%s %s %s side %d", isa, bf ? "bf16" : "f16", op_names[op], side);
                CHECK(fo[1] == (op == XCCL_OP_MAX ? (float)(N - 1) : 1.0f));
            }
        }
    }
}

static void test_wrap(const char *isa)
{
    enum { N = 35 }; /* a vector or two plus a tail for every width */
    int8_t   a8[N], b8[N], o8[N];
    uint8_t  ua[N], ub[N], uo[N];
    int16_t  a16[N], b16[N], o16[N];
    int32_t  a32[N], b32[N], o32[N];
    int64_t  a64[N], b64[N], o64[N];
    int      bad = 0;

    for (int i = 0; i < N; i++) {
        a8[i]  = 100;
        b8[i]  = 100;
        ua[i]  = 200;
        ub[i]  = 100;
        a16[i] = 300;
        b16[i] = 300;
        a32[i] = INT32_MAX;
        b32[i] = 1;
        a64[i] = INT64_MAX;
        b64[i] = 1;
    }
    xccl_reduce2(o8, a8, b8, N, XCCL_INT8, XCCL_OP_SUM);
    xccl_reduce2(uo, ua, ub, N, XCCL_UINT8, XCCL_OP_SUM);
    xccl_reduce2(o16, a16, b16, N, XCCL_INT16, XCCL_OP_PROD);
    xccl_reduce2(o32, a32, b32, N, XCCL_INT32, XCCL_OP_SUM);
    xccl_reduce2(o64, a64, b64, N, XCCL_INT64, XCCL_OP_SUM);
    for (int i = 0; i < N; i++)
        bad += o8[i] != -56 || uo[i] != 44 || o16[i] != 24464 || o32[i] != INT32_MIN ||
               o64[i] != INT64_MIN;
    for (int i = 0; i < N; i++) {
        a8[i]  = -128;
        b8[i]  = -1;
        a32[i] = 65536;
        b32[i] = 65536;
        a64[i] = (int64_t)1 << 32;
        b64[i] = ((int64_t)1 << 32) + 3;
    }
    xccl_reduce2(o8, a8, b8, N, XCCL_INT8, XCCL_OP_PROD);
    xccl_reduce2(o32, a32, b32, N, XCCL_INT32, XCCL_OP_PROD);
    xccl_reduce2(o64, a64, b64, N, XCCL_INT64, XCCL_OP_PROD);
    for (int i = 0; i < N; i++)
        bad += o8[i] != -128 || o32[i] != 0 || o64[i] != ((int64_t)3 << 32);
    CHECK_MSG(bad == 0, "%s: %d wrap-around mismatches", isa, bad);
}

static void test_bool_nonzero(void)
{
    uint8_t a[5] = {2, 0, 255, 1, 0}, b[5] = {4, 0, 1, 0, 7}, o[5];

    CHECK(xccl_reduce2(o, a, b, 5, XCCL_BOOL, XCCL_OP_BOR) == XCCL_OK);
    CHECK(o[0] == 1 && o[1] == 0 && o[2] == 1 && o[3] == 1 && o[4] == 1);
    CHECK(xccl_reduce2(o, a, b, 5, XCCL_BOOL, XCCL_OP_BAND) == XCCL_OK);
    CHECK(o[0] == 1 && o[1] == 0 && o[2] == 1 && o[3] == 0 && o[4] == 0);
    CHECK(xccl_reduce2(o, a, b, 5, XCCL_BOOL, XCCL_OP_BXOR) == XCCL_OK);
    CHECK(o[0] == 0 && o[1] == 0 && o[2] == 0 && o[3] == 1 && o[4] == 1);
    {
        const void *one[1] = {a};
        CHECK(xccl_reduce_n(o, one, 1, 5, XCCL_BOOL, XCCL_OP_SUM) == XCCL_OK);
        CHECK(o[0] == 1 && o[1] == 0 && o[2] == 1 && o[3] == 1 && o[4] == 0);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Scale and divide
 * ------------------------------------------------------------------------------------------- */
static void test_scale_divide(const char *isa)
{
    static uint16_t all[65536], out[65536];
    int             bad = 0;

    for (uint32_t p = 0; p <= 0xffff; p++) all[p] = (uint16_t)p;
    /* every pattern through each set's widen/narrow: x * 1 keeps it, x * 0.5 and x / 3 round
     * (ties included, subnormals included) as the reference says */
    for (int bf = 0; bf <= 1; bf++) {
        xccl_dtype_t dt = bf ? XCCL_BFLOAT16 : XCCL_FLOAT16;
        static const double factors[] = {1.0, 0.5, 3.0};

        for (int k = 0; k < 3; k++) {
            CHECK(xccl_scale(out, all, 65536, dt, factors[k]) == XCCL_OK);
            for (uint32_t p = 0; p <= 0xffff; p++) {
                float    v    = (float)ref_value((uint16_t)p, bf) * (float)factors[k];
                uint16_t want = ref_round(v, bf);
                if (out[p] != want && !(ref_isnan16(want, bf) && ref_isnan16(out[p], bf))) bad++;
            }
        }
        memcpy(out, all, sizeof(all));
        CHECK(xccl_divide(out, out, 65536, dt, 3) == XCCL_OK); /* in place */
        for (uint32_t p = 0; p <= 0xffff; p++) {
            uint16_t want = ref_round((float)ref_value((uint16_t)p, bf) / 3.0f, bf);
            if (out[p] != want && !(ref_isnan16(want, bf) && ref_isnan16(out[p], bf))) bad++;
        }
    }
    CHECK_MSG(bad == 0, "%s: %d f16/bf16 scale/divide mismatches", isa, bad);

    {
        int32_t i32[6] = {5, -5, 3, -3, 7, INT32_MIN}, o32[6];
        int8_t  i8[3] = {100, -100, 1}, o8[3];
        uint8_t u8[3] = {255, 7, 0}, ou8[3];
        int64_t i64[3] = {INT64_MAX, INT64_MIN, -7}, o64[3];
        float   f[3] = {1.5f, -3.0f, 1e-45f}, of[3];
        double  d[4] = {1.5, -3.0, 0.1, 1e308}, od[4];
        float   c[4] = {1.0f, -2.0f, 3.0f, 0.25f}, oc[4];

        CHECK(xccl_scale(o32, i32, 6, XCCL_INT32, 0.5) == XCCL_OK); /* ties away from zero */
        CHECK(o32[0] == 3 && o32[1] == -3 && o32[2] == 2 && o32[3] == -2 && o32[4] == 4 &&
              o32[5] == INT32_MIN / 2);
        CHECK(xccl_scale(o8, i8, 3, XCCL_INT8, 1e10) == XCCL_OK); /* saturates */
        CHECK(o8[0] == 127 && o8[1] == -128 && o8[2] == 127);
        CHECK(xccl_scale(ou8, u8, 3, XCCL_UINT8, -1.0) == XCCL_OK);
        CHECK(ou8[0] == 0 && ou8[1] == 0 && ou8[2] == 0);
        CHECK(xccl_scale(o64, i64, 3, XCCL_INT64, 2.0) == XCCL_OK);
        CHECK(o64[0] == INT64_MAX && o64[1] == INT64_MIN && o64[2] == -14);
        CHECK(xccl_scale(o32, i32, 6, XCCL_INT32, NAN) == XCCL_OK);
        CHECK(o32[0] == 0 && o32[5] == 0);
        CHECK(xccl_scale(of, f, 3, XCCL_FLOAT32, 0.1) == XCCL_OK);
        CHECK(of[0] == 1.5f * 0.1f && of[1] == -3.0f * 0.1f && of[2] == 1e-45f * 0.1f);
        CHECK(xccl_scale(od, d, 4, XCCL_FLOAT64, 0.1) == XCCL_OK);
        CHECK(od[0] == 1.5 * 0.1 && od[1] == -3.0 * 0.1 && od[2] == 0.1 * 0.1 &&
              od[3] == 1e308 * 0.1);
        CHECK(xccl_scale(oc, c, 2, XCCL_COMPLEX64, -2.0) == XCCL_OK);
        CHECK(oc[0] == -2.0f && oc[1] == 4.0f && oc[2] == -6.0f && oc[3] == -0.5f);

        CHECK(xccl_divide(o32, i32, 6, XCCL_INT32, 2) == XCCL_OK); /* truncates toward zero */
        CHECK(o32[0] == 2 && o32[1] == -2 && o32[2] == 1 && o32[3] == -1 && o32[4] == 3 &&
              o32[5] == INT32_MIN / 2);
        CHECK(xccl_divide(o8, i8, 3, XCCL_INT8, 3) == XCCL_OK);
        CHECK(o8[0] == 33 && o8[1] == -33 && o8[2] == 0);
        CHECK(xccl_divide(ou8, u8, 3, XCCL_UINT8, 2) == XCCL_OK);
        CHECK(ou8[0] == 127 && ou8[1] == 3 && ou8[2] == 0);
        CHECK(xccl_divide(o64, i64, 3, XCCL_INT64, 4) == XCCL_OK);
        CHECK(o64[0] == INT64_MAX / 4 && o64[1] == INT64_MIN / 4 && o64[2] == -1);
        CHECK(xccl_divide(of, f, 3, XCCL_FLOAT32, 3) == XCCL_OK);
        CHECK(of[0] == 1.5f / 3.0f && of[1] == -1.0f && of[2] == 1e-45f / 3.0f);
        CHECK(xccl_divide(od, d, 4, XCCL_FLOAT64, 3) == XCCL_OK);
        CHECK(od[0] == 0.5 && od[1] == -1.0 && od[2] == 0.1 / 3.0 && od[3] == 1e308 / 3.0);
        CHECK(xccl_divide(oc, c, 2, XCCL_COMPLEX64, 4) == XCCL_OK);
        CHECK(oc[0] == 0.25f && oc[1] == -0.5f && oc[2] == 0.75f && oc[3] == 0.0625f);

        CHECK(xccl_divide(o32, i32, 6, XCCL_INT32, 0) == XCCL_ERR_INVALID_ARG);
        CHECK(xccl_scale(ou8, u8, 3, XCCL_BOOL, 2.0) == XCCL_ERR_NOT_SUPPORTED);
        CHECK(xccl_divide(ou8, u8, 3, XCCL_BOOL, 2) == XCCL_ERR_NOT_SUPPORTED);
        CHECK(xccl_scale(NULL, NULL, 0, XCCL_FLOAT32, 2.0) == XCCL_OK);
        CHECK(xccl_scale(NULL, f, 3, XCCL_FLOAT32, 2.0) == XCCL_ERR_INVALID_ARG);
        CHECK(xccl_scale(of, f, 3, (xccl_dtype_t)42, 2.0) == XCCL_ERR_INVALID_ARG);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Names and argument checking
 * ------------------------------------------------------------------------------------------- */
static void test_names_and_checks(void)
{
    char      want[128];
    float     x[4] = {0}, y[4] = {0};
    const void *s[3] = {x, y, x};

    for (int dt = 0; dt < XCCL_DTYPE_COUNT; dt++) {
        CHECK(strcmp(xccl_dtype_name((xccl_dtype_t)dt), dt_names[dt]) == 0);
        CHECK(xccl_dtype_size((xccl_dtype_t)dt) == dt_sizes[dt]);
    }
    for (int op = 0; op < XCCL_OP_COUNT; op++)
        CHECK(strcmp(xccl_op_name((xccl_op_t)op), op_names[op]) == 0);
    CHECK(strcmp(xccl_dtype_name(XCCL_DTYPE_COUNT), "?") == 0);
    CHECK(strcmp(xccl_dtype_name((xccl_dtype_t)-1), "?") == 0);
    CHECK(strcmp(xccl_op_name(XCCL_OP_COUNT), "?") == 0);
    CHECK(xccl_dtype_size(XCCL_DTYPE_COUNT) == 0);

    for (int dti = 0; dti < XCCL_DTYPE_COUNT; dti++) {
        for (int opi = 0; opi < XCCL_OP_COUNT; opi++) {
            xccl_dtype_t  dt = (xccl_dtype_t)dti;
            xccl_op_t     op = (xccl_op_t)opi;
            char          buf[3][64];
            const void   *bs[2] = {buf[1], buf[2]};
            xccl_status_t st = xccl_op_check(op, dt);

            memset(buf, 0, sizeof(buf));
            snprintf(want, sizeof(want), "op %s is not defined for dtype %s", op_names[op],
                     dt_names[dt]);
            if (op_valid(op, dt)) {
                CHECK_MSG(st == XCCL_OK, "op_check(%s, %s)", op_names[op], dt_names[dt]);
            } else {
                CHECK_MSG(st == XCCL_ERR_INVALID_ARG, "op_check(%s, %s)", op_names[op],
                          dt_names[dt]);
                CHECK_MSG(strstr(xccl_last_error(), want) != NULL, "message '%s'",
                          xccl_last_error());
            }
            /* only valid base ops reduce; avg and premul_sum are built above reduce.h */
            st = xccl_reduce2(buf[0], buf[1], buf[2], 1, dt, op);
            CHECK_MSG(st == (op < NBASE && op_valid(op, dt) ? XCCL_OK : XCCL_ERR_INVALID_ARG),
                      "reduce2(%s, %s) = %d", op_names[op], dt_names[dt], (int)st);
            st = xccl_reduce_n(buf[0], bs, 2, 1, dt, op);
            CHECK_MSG(st == (op < NBASE && op_valid(op, dt) ? XCCL_OK : XCCL_ERR_INVALID_ARG),
                      "reduce_n(%s, %s) = %d", op_names[op], dt_names[dt], (int)st);
        }
    }
    CHECK(xccl_op_check(XCCL_OP_COUNT, XCCL_FLOAT32) == XCCL_ERR_INVALID_ARG);
    CHECK(xccl_op_check((xccl_op_t)-1, XCCL_FLOAT32) == XCCL_ERR_INVALID_ARG);
    CHECK(xccl_op_check(XCCL_OP_SUM, XCCL_DTYPE_COUNT) == XCCL_ERR_INVALID_ARG);
    CHECK(xccl_reduce2(x, x, y, 4, XCCL_DTYPE_COUNT, XCCL_OP_SUM) == XCCL_ERR_INVALID_ARG);
    CHECK(xccl_reduce2(NULL, NULL, NULL, 0, XCCL_FLOAT32, XCCL_OP_SUM) == XCCL_OK);
    CHECK(xccl_reduce2(NULL, x, y, 4, XCCL_FLOAT32, XCCL_OP_SUM) == XCCL_ERR_INVALID_ARG);
    CHECK(xccl_reduce_n(x, s, 0, 4, XCCL_FLOAT32, XCCL_OP_SUM) == XCCL_ERR_INVALID_ARG);
    CHECK(xccl_reduce_n(x, NULL, 2, 4, XCCL_FLOAT32, XCCL_OP_SUM) == XCCL_ERR_INVALID_ARG);
    CHECK(xccl_reduce_n(x, s, 3, 4, XCCL_FLOAT32, XCCL_OP_SUM) == XCCL_OK); /* dst == srcs[2] */
}

/* ---------------------------------------------------------------------------------------------
 * Concurrent use: threads reduce their own buffers at the same time
 * ------------------------------------------------------------------------------------------- */
struct thr_arg {
    int seed;
    int bad;
};

static void *thr_main(void *p)
{
    struct thr_arg *t = p;
    enum { N = 3001 };
    static const xccl_dtype_t dts[] = {XCCL_FLOAT32, XCCL_BFLOAT16, XCCL_INT64, XCCL_FLOAT16};
    xccl_dtype_t dt = dts[t->seed % 4];
    uint64_t     st = 0x9e3779b9u * (uint64_t)(t->seed + 1);
    char        *a = malloc(N * 8), *b = malloc(N * 8), *c = malloc(N * 8);
    char        *d = malloc(N * 8), *w = malloc(N * 8);
    const void  *s[3] = {a, b, c};

    for (size_t i = 0; i < (size_t)N * 8; i++) { /* a private generator: rnd() is shared */
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        a[i] = (char)(st >> 56);
        b[i] = (char)(st >> 48);
        c[i] = (char)(st >> 40);
    }
    ref_reduce(w, s, 3, N, dt, XCCL_OP_MAX);
    for (int it = 0; it < 50; it++) {
        if (xccl_reduce_n(d, s, 3, N, dt, XCCL_OP_MAX) != XCCL_OK) t->bad++;
        if (compare(dt, d, w, N) >= 0) t->bad++;
    }
    free(a);
    free(b);
    free(c);
    free(d);
    free(w);
    return NULL;
}

static void test_threads(void)
{
    pthread_t      th[4];
    struct thr_arg args[4];

    for (int i = 0; i < 4; i++) {
        args[i].seed = i;
        args[i].bad  = 0;
        CHECK(pthread_create(&th[i], NULL, thr_main, &args[i]) == 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        CHECK_MSG(args[i].bad == 0, "thread %d: %d bad results", i, args[i].bad);
    }
}

int main(void)
{
    int ran = 0;

    test_env_isa(); /* first: the children must inherit an undecided kernel choice */
    test_conversions();
    test_set_isa();
    test_names_and_checks();
    test_bool_nonzero();
    for (size_t i = 0; i < 3; i++) {
        if (!cpu_has(isa_names[i])) {
            printf("test_reduce: %s kernels not supported by this CPU, skipped\n", isa_names[i]);
            continue;
        }
        CHECK(xccl_reduce_set_isa(isa_names[i]) == XCCL_OK);
        test_reduce2(isa_names[i]);
        test_reduce_n(isa_names[i]);
        test_nan_minmax(isa_names[i]);
        test_wrap(isa_names[i]);
        test_scale_divide(isa_names[i]);
        test_threads();
        ran++;
    }
    printf("test_reduce: kernel sets tested: %d (best here: %s)\n", ran, best_isa());
    CTEST_MAIN_END("test_reduce");
}
