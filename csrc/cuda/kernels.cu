/* SPDX-License-Identifier: Apache-2.0
 *
 * kernels.cu - the GPU reduction kernels of the CUDA executor, with exactly the semantics of
 * the CPU kernels (csrc/core/reduce.c), so a result does not depend on where it was computed:
 *   - integers: SUM and PROD wrap modulo 2^bits (unsigned arithmetic); MIN/MAX compare;
 *   - floats: MAX(a, b) = (a > b || a is NaN) ? a : b, MIN likewise with <;
 *   - float16/bfloat16: widened to float32 exactly (float16 NaNs made quiet), combined in
 *     float32, rounded back to nearest-even once, by the same integer bit code as the CPU's;
 *   - bool: any nonzero byte is true, results are 0 or 1 (SUM/MAX/BOR: or, PROD/MIN/BAND: and,
 *     BXOR: xor);
 *   - complex PROD: re = ar*br - ai*bi, im = ar*bi + ai*br, each product rounded (no FMA);
 *   - scale (PREMUL_SUM): floats multiply in their precision (float16/bfloat16 through float32
 *     by (float)factor), integers in double, rounded to nearest (ties away from zero) and
 *     clamped, NaN giving 0; divide (AVG): floats divide, integers truncate toward zero.
 * Which NaN payload a float addition or multiplication produces is not specified (the GPU's
 * is canonical, the CPU's propagates an operand's).
 *
 * Built with -fmad=false (no contraction into FMA) and without fast-math (IEEE division and
 * square root, denormals kept). The host (cuda_exec.c) rewrites some cases before it picks a
 * kernel, as reduce.c does: complex SUM is float SUM over twice the elements, bitwise ops on
 * integers are uint8 ops over the bytes, bool ops are and/or/xor, complex scale/divide are the
 * float ones over twice the elements.
 *
 * Entry points, extern "C", looked up by name (cuModuleGetFunction):
 *   xccl_reduce2_<t>_<op>(T *dst, const T *a, const T *b, size_t n)      dst = a op b
 *   xccl_reduce_n_<t>_<op>(T *dst, xccl_srcs_t srcs, int k, size_t n)     dst = s0 op ... s(k-1)
 *   xccl_scale_<t>(T *dst, const T *src, size_t n, double factor)
 *   xccl_divide_<t>(T *dst, const T *src, size_t n, int d)
 * with <t> one of bool u8 i8 i16 i32 i64 f16 bf16 f32 f64 c64 c128 and <op> one of sum prod min
 * max and or xor (only the pairs the host asks for exist). dst may alias any input exactly
 * (each element is read completely before it is written, by the same thread). Grid-stride
 * loops; 16-byte vector loads and stores where every pointer has the same offset modulo 16
 * (after a scalar head that aligns them), scalar otherwise.
 */
#include <stddef.h>
#include <stdint.h>

#define XCCL_REDUCE_N_MAX 8 /* csrc/cuda/cuda_kernels.h says the same */

struct xccl_srcs_t {
    const void *p[XCCL_REDUCE_N_MAX];
};

struct c64_t {
    float r, i;
};
struct c128_t {
    double r, i;
};

/* ---- float16 / bfloat16 conversions: the integer code of reduce.c ---- */

__device__ __forceinline__ uint32_t mask_of(bool c)
{
    return 0u - (uint32_t)c;
}

__device__ __forceinline__ float half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em   = h & 0x7fffu;
    uint32_t norm = (em << 13) + ((127u - 15u) << 23);
    uint32_t nan  = (em << 13) | 0x7f800000u | (mask_of(em > 0x7c00u) & 0x400000u);
    uint32_t sub  = __float_as_uint(__fmul_rn((float)(int32_t)em, 0x1p-24f)); /* exact */
    uint32_t r    = em >= 0x7c00u ? nan : (em >= 0x400u ? norm : sub);

    return __uint_as_float(sign | r);
}

__device__ __forceinline__ uint16_t float_to_half(float f)
{
    uint32_t x    = __float_as_uint(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t a    = x & 0x7fffffffu;
    uint32_t man, shift, h;

    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) {
        h = ((a + 0xfffu + ((a >> 13) & 1u)) >> 13) - ((127u - 15u) << 10);
        return (uint16_t)(sign | h);
    }
    if (a <= 0x33000000u) return (uint16_t)sign;
    man   = (a & 0x7fffffu) | 0x800000u;
    shift = 126u - (a >> 23);
    h     = man >> shift;
    man &= (1u << shift) - 1u;
    h += man > (1u << (shift - 1u)) || (man == (1u << (shift - 1u)) && (h & 1u));
    return (uint16_t)(sign | h);
}

__device__ __forceinline__ float bf16_to_float(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

__device__ __forceinline__ uint16_t float_to_bf16(float f)
{
    uint32_t x = __float_as_uint(f);
    uint32_t r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;

    return (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? ((x >> 16) | 0x40u) : r);
}

/* ---- element types: storage type S, accumulator A, load (widen) and store (narrow) ---- */

template <typename T> struct plain {
    typedef T S;
    typedef T A;
    static __device__ __forceinline__ A load(S v) { return v; }
    static __device__ __forceinline__ S store(A v) { return v; }
};
struct half_t {
    typedef uint16_t S;
    typedef float    A;
    static __device__ __forceinline__ A load(S v) { return half_to_float(v); }
    static __device__ __forceinline__ S store(A v) { return float_to_half(v); }
};
struct bf16_t {
    typedef uint16_t S;
    typedef float    A;
    static __device__ __forceinline__ A load(S v) { return bf16_to_float(v); }
    static __device__ __forceinline__ S store(A v) { return float_to_bf16(v); }
};

/* ---- operators on the accumulator type ---- */

template <typename A> struct op_sum;
template <typename A> struct op_prod;
#define INT_SUM_PROD(T, U)                                                                 \
    template <> struct op_sum<T> {                                                         \
        static __device__ __forceinline__ T f(T x, T y) { return (T)((U)x + (U)y); }        \
    };                                                                                     \
    template <> struct op_prod<T> {                                                        \
        static __device__ __forceinline__ T f(T x, T y) { return (T)((U)x * (U)y); }        \
    };
INT_SUM_PROD(uint8_t, uint32_t)
INT_SUM_PROD(int8_t, uint32_t)
INT_SUM_PROD(int16_t, uint32_t)
INT_SUM_PROD(int32_t, uint32_t)
INT_SUM_PROD(int64_t, uint64_t)
template <> struct op_sum<float> {
    static __device__ __forceinline__ float f(float x, float y) { return __fadd_rn(x, y); }
};
template <> struct op_prod<float> {
    static __device__ __forceinline__ float f(float x, float y) { return __fmul_rn(x, y); }
};
template <> struct op_sum<double> {
    static __device__ __forceinline__ double f(double x, double y) { return __dadd_rn(x, y); }
};
template <> struct op_prod<double> {
    static __device__ __forceinline__ double f(double x, double y) { return __dmul_rn(x, y); }
};
template <> struct op_prod<c64_t> {
    static __device__ __forceinline__ c64_t f(c64_t x, c64_t y)
    {
        c64_t r;
        r.r = __fsub_rn(__fmul_rn(x.r, y.r), __fmul_rn(x.i, y.i));
        r.i = __fadd_rn(__fmul_rn(x.r, y.i), __fmul_rn(x.i, y.r));
        return r;
    }
};
template <> struct op_prod<c128_t> {
    static __device__ __forceinline__ c128_t f(c128_t x, c128_t y)
    {
        c128_t r;
        r.r = __dsub_rn(__dmul_rn(x.r, y.r), __dmul_rn(x.i, y.i));
        r.i = __dadd_rn(__dmul_rn(x.r, y.i), __dmul_rn(x.i, y.r));
        return r;
    }
};
/* integers: plain comparison; floats: a NaN on the left wins, for equal values the right */
template <typename A> struct op_min {
    static __device__ __forceinline__ A f(A x, A y) { return ((x < y) | (x != x)) ? x : y; }
};
template <typename A> struct op_max {
    static __device__ __forceinline__ A f(A x, A y) { return ((x > y) | (x != x)) ? x : y; }
};
template <typename A> struct op_and {
    static __device__ __forceinline__ A f(A x, A y) { return (A)(x & y); }
};
template <typename A> struct op_or {
    static __device__ __forceinline__ A f(A x, A y) { return (A)(x | y); }
};
template <typename A> struct op_xor {
    static __device__ __forceinline__ A f(A x, A y) { return (A)(x ^ y); }
};
struct op_land {
    static __device__ __forceinline__ uint8_t f(uint8_t x, uint8_t y)
    {
        return (uint8_t)((x != 0) & (y != 0));
    }
};
struct op_lor {
    static __device__ __forceinline__ uint8_t f(uint8_t x, uint8_t y)
    {
        return (uint8_t)((x != 0) | (y != 0));
    }
};
struct op_lxor {
    static __device__ __forceinline__ uint8_t f(uint8_t x, uint8_t y)
    {
        return (uint8_t)((x != 0) ^ (y != 0));
    }
};

/* ---- loops ---- */

/* 16 bytes of S, moved as one uint4 */
template <typename S> union vec16 {
    uint4 u;
    S     v[16 / sizeof(S)];
};

__device__ __forceinline__ size_t gtid()
{
    return (size_t)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ size_t gstride()
{
    return (size_t)gridDim.x * blockDim.x;
}

/* Elements before the first 16-byte boundary of p, when every pointer in ptrs[0..k) has the
 * same offset modulo 16 as p and that offset is a multiple of the element size; else -1 (no
 * vector path). */
template <typename S>
__device__ __forceinline__ long long vec_head(const void *const *ptrs, int k, size_t n)
{
    uintptr_t off = (uintptr_t)ptrs[0] & 15u;

    if (sizeof(S) > 16 || off % sizeof(S) != 0) return -1;
    for (int j = 1; j < k; j++)
        if (((uintptr_t)ptrs[j] & 15u) != off) return -1;
    size_t head = off == 0 ? 0 : (16u - off) / sizeof(S);
    return (long long)(head < n ? head : n);
}

template <typename E, typename OP>
__device__ __forceinline__ typename E::S elem2(typename E::S x, typename E::S y)
{
    return E::store(OP::f(E::load(x), E::load(y)));
}

template <typename E, typename OP>
__device__ void reduce2(typename E::S *d, const typename E::S *a, const typename E::S *b,
                        size_t n)
{
    typedef typename E::S S;
    enum { V = 16 / sizeof(S) };
    const void *ptrs[3] = {d, a, b};
    long long   h       = V > 1 || sizeof(S) == 16 ? vec_head<S>(ptrs, 3, n) : -1;
    size_t      i, start = 0, tid = gtid(), stride = gstride();

    if (h >= 0) {
        size_t nv = (n - (size_t)h) / V;
        for (i = tid; i < (size_t)h; i += stride) d[i] = elem2<E, OP>(a[i], b[i]);
        const uint4 *va = reinterpret_cast<const uint4 *>(a + h);
        const uint4 *vb = reinterpret_cast<const uint4 *>(b + h);
        uint4       *vd = reinterpret_cast<uint4 *>(d + h);
        for (i = tid; i < nv; i += stride) {
            vec16<S> x, y, r;
            x.u = va[i];
            y.u = vb[i];
#pragma unroll
            for (int k = 0; k < V; k++) r.v[k] = elem2<E, OP>(x.v[k], y.v[k]);
            vd[i] = r.u;
        }
        start = (size_t)h + nv * V;
    }
    for (i = start + tid; i < n; i += stride) d[i] = elem2<E, OP>(a[i], b[i]);
}

/* k >= 1 sources; the accumulator type carries across sources (float16/bfloat16 are rounded
 * once, as xccl_reduce_n does). k == 1 is a copy, except that bool is normalised to 0/1. */
template <typename E, typename OP>
__device__ __forceinline__ typename E::S elemn(const xccl_srcs_t &s, int k, size_t i)
{
    typedef typename E::S S;
    typename E::A acc = E::load(static_cast<const S *>(s.p[0])[i]);
    for (int j = 1; j < k; j++) acc = OP::f(acc, E::load(static_cast<const S *>(s.p[j])[i]));
    return E::store(acc);
}

template <typename E, typename OP>
__device__ void reduce_n(typename E::S *d, const xccl_srcs_t &s, int k, size_t n)
{
    typedef typename E::S S;
    enum { V = 16 / sizeof(S) };
    const void *ptrs[XCCL_REDUCE_N_MAX + 1];
    size_t      i, start = 0, tid = gtid(), stride = gstride();

    ptrs[0] = d;
    for (int j = 0; j < k; j++) ptrs[j + 1] = s.p[j];
    long long h = vec_head<S>(ptrs, k + 1, n);
    if (h >= 0) {
        size_t nv = (n - (size_t)h) / V;
        for (i = tid; i < (size_t)h; i += stride) d[i] = elemn<E, OP>(s, k, i);
        for (i = tid; i < nv; i += stride) {
            vec16<S> x, r;
            size_t   base = (size_t)h + i * V;
            typename E::A acc[V];
            x.u = *reinterpret_cast<const uint4 *>(static_cast<const S *>(s.p[0]) + base);
#pragma unroll
            for (int e = 0; e < V; e++) acc[e] = E::load(x.v[e]);
            for (int j = 1; j < k; j++) {
                x.u = *reinterpret_cast<const uint4 *>(static_cast<const S *>(s.p[j]) + base);
#pragma unroll
                for (int e = 0; e < V; e++) acc[e] = OP::f(acc[e], E::load(x.v[e]));
            }
#pragma unroll
            for (int e = 0; e < V; e++) r.v[e] = E::store(acc[e]);
            *reinterpret_cast<uint4 *>(d + base) = r.u;
        }
        start = (size_t)h + nv * V;
    }
    for (i = start + tid; i < n; i += stride) d[i] = elemn<E, OP>(s, k, i);
}

/* ---- scale and divide ---- */

__device__ __forceinline__ long long round_clamp(double v, double lo, double hi)
{
    double r = round(v);

    if (r != r) return 0;
    if (r <= lo) return (long long)lo;
    if (r >= hi) return (long long)hi;
    return (long long)r;
}

__device__ __forceinline__ long long round_clamp64(double v)
{
    double r = round(v);

    if (r != r) return 0;
    if (r >= 0x1p63) return INT64_MAX;
    if (r <= -0x1p63) return INT64_MIN;
    return (long long)r;
}

template <typename T> struct scaler;
#define INT_SCALER(T, LO, HI)                                                              \
    template <> struct scaler<T> {                                                         \
        static __device__ __forceinline__ T mul(T x, double f)                             \
        {                                                                                  \
            return (T)round_clamp(__dmul_rn((double)x, f), LO, HI);                        \
        }                                                                                  \
        static __device__ __forceinline__ T div(T x, int n) { return (T)(x / n); }          \
    };
INT_SCALER(uint8_t, 0, UINT8_MAX)
INT_SCALER(int8_t, INT8_MIN, INT8_MAX)
INT_SCALER(int16_t, INT16_MIN, INT16_MAX)
INT_SCALER(int32_t, INT32_MIN, INT32_MAX)
template <> struct scaler<int64_t> {
    static __device__ __forceinline__ int64_t mul(int64_t x, double f)
    {
        return (int64_t)round_clamp64(__dmul_rn((double)x, f));
    }
    static __device__ __forceinline__ int64_t div(int64_t x, int n) { return x / (int64_t)n; }
};
template <> struct scaler<float> {
    static __device__ __forceinline__ float mul(float x, double f)
    {
        return __fmul_rn(x, (float)f);
    }
    static __device__ __forceinline__ float div(float x, int n) { return __fdiv_rn(x, (float)n); }
};
template <> struct scaler<double> {
    static __device__ __forceinline__ double mul(double x, double f) { return __dmul_rn(x, f); }
    static __device__ __forceinline__ double div(double x, int n)
    {
        return __ddiv_rn(x, (double)n);
    }
};

template <typename E> struct mapper {
    typedef typename E::S S;
    static __device__ __forceinline__ S mul(S x, double f)
    {
        return E::store(scaler<typename E::A>::mul(E::load(x), f));
    }
    static __device__ __forceinline__ S div(S x, int n)
    {
        return E::store(scaler<typename E::A>::div(E::load(x), n));
    }
};

/* dst[i] = src[i] * f (DIV false) or src[i] / n (DIV true) */
template <typename E, bool DIV>
__device__ void map(typename E::S *d, const typename E::S *s, size_t n, double f, int dn)
{
    typedef typename E::S S;
    enum { V = 16 / sizeof(S) };
    const void *ptrs[2] = {d, s};
    long long   h       = vec_head<S>(ptrs, 2, n);
    size_t      i, start = 0, tid = gtid(), stride = gstride();

#define XCCL_MAP1(x) (DIV ? mapper<E>::div((x), dn) : mapper<E>::mul((x), f))
    if (h >= 0) {
        size_t nv = (n - (size_t)h) / V;
        for (i = tid; i < (size_t)h; i += stride) d[i] = XCCL_MAP1(s[i]);
        const uint4 *vs = reinterpret_cast<const uint4 *>(s + h);
        uint4       *vd = reinterpret_cast<uint4 *>(d + h);
        for (i = tid; i < nv; i += stride) {
            vec16<S> x, r;
            x.u = vs[i];
#pragma unroll
            for (int k = 0; k < V; k++) r.v[k] = XCCL_MAP1(x.v[k]);
            vd[i] = r.u;
        }
        start = (size_t)h + nv * V;
    }
    for (i = start + tid; i < n; i += stride) d[i] = XCCL_MAP1(s[i]);
#undef XCCL_MAP1
}

/* ---- entry points ---- */

#define REDUCE(tname, E, OP)                                                               \
    extern "C" __global__ void xccl_reduce2_##tname(E::S *d, const E::S *a, const E::S *b,   \
                                                    size_t n)                              \
    {                                                                                      \
        reduce2<E, OP>(d, a, b, n);                                                        \
    }                                                                                      \
    extern "C" __global__ void xccl_reduce_n_##tname(E::S *d, xccl_srcs_t s, int k,         \
                                                     size_t n)                             \
    {                                                                                      \
        reduce_n<E, OP>(d, s, k, n);                                                       \
    }

#define REDUCE_ORD(t, E, A)                                                                \
    REDUCE(t##_sum, E, op_sum<A>)                                                          \
    REDUCE(t##_prod, E, op_prod<A>)                                                        \
    REDUCE(t##_min, E, op_min<A>)                                                          \
    REDUCE(t##_max, E, op_max<A>)

REDUCE(bool_and, plain<uint8_t>, op_land)
REDUCE(bool_or, plain<uint8_t>, op_lor)
REDUCE(bool_xor, plain<uint8_t>, op_lxor)
REDUCE_ORD(u8, plain<uint8_t>, uint8_t)
REDUCE(u8_and, plain<uint8_t>, op_and<uint8_t>)
REDUCE(u8_or, plain<uint8_t>, op_or<uint8_t>)
REDUCE(u8_xor, plain<uint8_t>, op_xor<uint8_t>)
REDUCE_ORD(i8, plain<int8_t>, int8_t)
REDUCE_ORD(i16, plain<int16_t>, int16_t)
REDUCE_ORD(i32, plain<int32_t>, int32_t)
REDUCE_ORD(i64, plain<int64_t>, int64_t)
REDUCE_ORD(f16, half_t, float)
REDUCE_ORD(bf16, bf16_t, float)
REDUCE_ORD(f32, plain<float>, float)
REDUCE_ORD(f64, plain<double>, double)
REDUCE(c64_prod, plain<c64_t>, op_prod<c64_t>)
REDUCE(c128_prod, plain<c128_t>, op_prod<c128_t>)

#define MAP(tname, E)                                                                      \
    extern "C" __global__ void xccl_scale_##tname(E::S *d, const E::S *s, size_t n,         \
                                                  double f)                                \
    {                                                                                      \
        map<E, false>(d, s, n, f, 1);                                                      \
    }                                                                                      \
    extern "C" __global__ void xccl_divide_##tname(E::S *d, const E::S *s, size_t n, int dn) \
    {                                                                                      \
        map<E, true>(d, s, n, 0.0, dn);                                                    \
    }

MAP(u8, plain<uint8_t>)
MAP(i8, plain<int8_t>)
MAP(i16, plain<int16_t>)
MAP(i32, plain<int32_t>)
MAP(i64, plain<int64_t>)
MAP(f16, half_t)
MAP(bf16, bf16_t)
MAP(f32, plain<float>)
MAP(f64, plain<double>)
