/* SPDX-License-Identifier: Apache-2.0
 *
 * kernel_check.c - on a GPU: the CUDA executor against the CPU kernels, bit for bit.
 *   - reduce: every dtype and base operator, sizes from 1 to 70001 elements, buffers at
 *     offsets that give the vector path (same phase modulo 16 bytes, with a scalar head) and
 *     the scalar one (different phases), dst aliasing a or b; against xccl_reduce2;
 *   - scale (PREMUL_SUM) and divide (AVG): every dtype but bool, several factors and divisors
 *     (integer clamping, rounding ties); against xccl_scale / xccl_divide;
 *   - reduce_n (xccl_cuda_reduce_n) with 1 to 8 sources, dst aliasing one; against
 *     xccl_reduce_n;
 *   - copies: host to device, device to host, device to device, overlapping (memmove);
 *   - gates and stream order: a stream waiting on a closed gate does not run until the gate is
 *     opened; order_after marks such a stream with an event that completes only once the
 *     stream gets there, and xccl's own stream is not held up meanwhile.
 * Inputs are random bits (every float class: NaN, Inf, denormals, -0) mixed with small exact
 * values. Results must be identical byte for byte, except that two NaNs of a float type are
 * equal (which NaN an addition produces is not specified). Prints one summary line; exit status
 * 0 only if nothing differed.
 *
 * Build and run (GPU machine, after `python3 setup.py build_ext --inplace`, whose fatbin it
 * reuses from build/cuda-fatbin): make -C tests/c kernel_check
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/exec.h"
#include "core/reduce.h"
#include "cuda/cuda_exec.h"
#include "cuda/cuda_lib.h"
#include "xccl/xccl.h"

#define MAXB (16u * 110000u) /* bytes per buffer: the largest case plus offsets */

static const xccl_exec_ops_t *ex;
static uint64_t               rng = 0x9e3779b97f4a7c15ull;
static long                   ncases, nbad;
static unsigned char         *h_in[9], *h_ref, *h_out;
static unsigned char         *d_buf[9];

static uint64_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *what)
{
    fprintf(stderr, "kernel_check: %s: %s\n", what, xccl_last_error());
    exit(2);
}

/* Waits for an executor event (10 s at most: a hang is a failure). */
static void wait_ev(void *ev, const char *what)
{
    double t0 = now_s();
    for (;;) {
        xccl_status_t st = ex->test(ev);
        if (st == XCCL_OK) return;
        if (st != XCCL_INPROGRESS) die(what);
        if (now_s() - t0 > 10) {
            fprintf(stderr, "kernel_check: %s did not finish in 10 s\n", what);
            exit(2);
        }
    }
}

/* `ev` is read here, after the call that set it (an argument `ev` beside the call would be read
 * in an unspecified order) */
static void run(xccl_status_t st, void *const *ev, const char *what)
{
    if (st == XCCL_INPROGRESS)
        wait_ev(*ev, what);
    else if (st != XCCL_OK)
        die(what);
}

static void put(void *dev, const void *host, size_t n)
{
    void *ev = NULL;
    run(ex->copy(NULL, dev, host, n, &ev), &ev, "copy to device");
}

static void get(void *host, const void *dev, size_t n)
{
    void *ev = NULL;
    run(ex->copy(NULL, host, dev, n, &ev), &ev, "copy to host");
}

static void sync_stream(CUstream s)
{
    CUresult rc = xccl_cu.StreamSynchronize(s);
    if (rc != CUDA_SUCCESS) {
        xccl_cuda_fail(rc, "cuStreamSynchronize");
        die("synchronize");
    }
}

/* ---- inputs and comparison ---- */

static void fill(unsigned char *p, size_t n, xccl_dtype_t dt)
{
    size_t es = xccl_dtype_size(dt);

    for (size_t i = 0; i < n * es; i++)
        p[i] = (unsigned char)rnd();
    for (size_t i = 0; i < n; i++) {
        int   nice = rnd() % 2 == 0;
        float v    = (float)((int)(rnd() % 2001) - 1000) / 8.0f; /* exact in every float type */
        switch (dt) {
        case XCCL_BOOL:
            p[i] = rnd() % 3 == 0 ? 0 : p[i];
            break;
        case XCCL_FLOAT16:
            if (nice) ((uint16_t *)p)[i] = xccl_float_to_half(v / 4);
            break;
        case XCCL_BFLOAT16:
            if (nice) ((uint16_t *)p)[i] = xccl_float_to_bf16(v);
            break;
        case XCCL_FLOAT32:
        case XCCL_COMPLEX64:
            if (nice) ((float *)p)[i * (es / 4)] = v;
            break;
        case XCCL_FLOAT64:
        case XCCL_COMPLEX128:
            if (nice) ((double *)p)[i * (es / 8)] = (double)v / 3.0;
            break;
        default:
            if (nice) memset(p + i * es, (int)(rnd() % 3), es); /* small: 0, 0x01.., 0x02.. */
            break;
        }
    }
}

/* component i of a float-ish dtype is NaN */
static int comp_nan(xccl_dtype_t dt, const unsigned char *p, size_t i)
{
    uint16_t h;
    float    f;
    double   d;

    switch (dt) {
    case XCCL_FLOAT16:
        memcpy(&h, p + 2 * i, 2);
        return (h & 0x7fffu) > 0x7c00u;
    case XCCL_BFLOAT16:
        memcpy(&h, p + 2 * i, 2);
        return (h & 0x7fffu) > 0x7f80u;
    case XCCL_FLOAT32:
    case XCCL_COMPLEX64:
        memcpy(&f, p + 4 * i, 4);
        return isnan(f);
    case XCCL_FLOAT64:
    case XCCL_COMPLEX128:
        memcpy(&d, p + 8 * i, 8);
        return isnan(d);
    default:
        return 0;
    }
}

static void compare(const char *what, xccl_dtype_t dt, const char *opname, size_t n,
                    const int *offs, const unsigned char *exp, const unsigned char *got)
{
    size_t es = xccl_dtype_size(dt);
    size_t cs = dt == XCCL_COMPLEX64 || dt == XCCL_COMPLEX128 ? es / 2 : es; /* component */
    size_t nc = n * es / cs, bad = 0, first = 0;

    ncases++;
    if (memcmp(exp, got, n * es) == 0) return;
    for (size_t i = 0; i < nc; i++) {
        if (memcmp(exp + i * cs, got + i * cs, cs) == 0) continue;
        if (dt >= XCCL_FLOAT16 && comp_nan(dt, exp, i) && comp_nan(dt, got, i)) continue;
        if (bad++ == 0) first = i;
    }
    if (bad == 0) return;
    nbad++;
    if (nbad <= 20) {
        fprintf(stderr,
                "MISMATCH %s %s %s n=%zu offs=(%d,%d,%d): %zu components differ, first "
                "at %zu: expected ",
                what, xccl_dtype_name(dt), opname, n, offs[0], offs[1], offs[2], bad, first);
        for (size_t k = 0; k < cs; k++)
            fprintf(stderr, "%02x", exp[first * cs + cs - 1 - k]);
        fprintf(stderr, " got ");
        for (size_t k = 0; k < cs; k++)
            fprintf(stderr, "%02x", got[first * cs + cs - 1 - k]);
        fprintf(stderr, "\n");
    }
}

static const size_t sizes[] = {1, 2, 3, 7, 16, 17, 31, 100, 255, 1000, 4097, 70001};
#define NSIZES (sizeof sizes / sizeof sizes[0])
/* element offsets of (dst, a, b); alias: 0 none, 1 dst is a, 2 dst is b */
static const int offsets[][4] = {{0, 0, 0, 0}, {1, 1, 1, 0}, {3, 3, 3, 0}, {0, 1, 2, 0},
                                 {5, 0, 3, 0}, {2, 2, 0, 1}, {1, 4, 1, 2}, {7, 7, 7, 1}};
#define NOFFS (sizeof offsets / sizeof offsets[0])

/* ---- reduce ---- */

static void check_reduce(xccl_dtype_t dt, xccl_op_t op)
{
    size_t es = xccl_dtype_size(dt);

    for (size_t si = 0; si < NSIZES; si++) {
        size_t n = sizes[si];
        for (size_t oi = 0; oi < NOFFS; oi++) {
            const int *o  = offsets[oi];
            int        al = o[3];
            /* host: a in h_in[0], b in h_in[1] (dst's initial content in h_in[2]) */
            unsigned char *ha = h_in[0] + o[1] * es, *hb = h_in[1] + o[2] * es;
            unsigned char *da = d_buf[0] + o[1] * es, *db = d_buf[1] + o[2] * es;
            unsigned char *dd = al == 1 ? da : al == 2 ? db : d_buf[2] + o[0] * es;
            void          *ev = NULL;

            fill(ha, n, dt);
            fill(hb, n, dt);
            put(da, ha, n * es);
            put(db, hb, n * es);
            if (xccl_reduce2(h_ref, ha, hb, n, dt, op) != XCCL_OK) die("xccl_reduce2");
            run(ex->reduce(NULL, dd, da, db, n, dt, op, &ev), &ev, "reduce");
            get(h_out, dd, n * es);
            compare("reduce", dt, xccl_op_name(op), n, o, h_ref, h_out);
        }
    }
}

/* ---- scale / divide ---- */

static void check_map(xccl_dtype_t dt)
{
    static const double factors[] = {0.5, 3.0, -1.25, 1e-3, 1.0 / 3.0, 2.5, 1e10};
    static const int    divs[]    = {1, 2, 3, 7};
    size_t              es        = xccl_dtype_size(dt);
    char                name[32];

    for (size_t si = 0; si < NSIZES; si++) {
        size_t n = sizes[si];
        for (size_t oi = 0; oi < 4; oi++) {
            int            o[3] = {offsets[oi][0], offsets[oi][1], 0};
            unsigned char *hs = h_in[0] + o[1] * es, *ds = d_buf[0] + o[1] * es;
            unsigned char *dd = oi == 3 ? ds : d_buf[2] + o[0] * es; /* 3: in place */
            void          *ev = NULL;

            for (size_t fi = 0; fi < sizeof factors / sizeof factors[0]; fi++) {
                fill(hs, n, dt);
                put(ds, hs, n * es);
                if (xccl_scale(h_ref, hs, n, dt, factors[fi]) != XCCL_OK) die("xccl_scale");
                run(ex->scale(NULL, dd, ds, n, dt, factors[fi], &ev), &ev, "scale");
                get(h_out, dd, n * es);
                snprintf(name, sizeof name, "x%g", factors[fi]);
                compare("scale", dt, name, n, o, h_ref, h_out);
            }
            for (size_t di = 0; di < sizeof divs / sizeof divs[0]; di++) {
                fill(hs, n, dt);
                put(ds, hs, n * es);
                if (xccl_divide(h_ref, hs, n, dt, divs[di]) != XCCL_OK) die("xccl_divide");
                run(ex->divide(NULL, dd, ds, n, dt, divs[di], &ev), &ev, "divide");
                get(h_out, dd, n * es);
                snprintf(name, sizeof name, "/%d", divs[di]);
                compare("divide", dt, name, n, o, h_ref, h_out);
            }
        }
    }
}

/* ---- reduce_n ---- */

static void check_reduce_n(xccl_dtype_t dt, xccl_op_t op)
{
    static const size_t nsz[] = {1, 5, 33, 1000, 4099};
    size_t              es    = xccl_dtype_size(dt);

    for (int k = 1; k <= XCCL_CUDA_REDUCE_N_MAX; k++) {
        for (size_t si = 0; si < sizeof nsz / sizeof nsz[0]; si++) {
            /* 0 aligned, 1 mixed phases, 2 dst = the last source, 3 all at 3 elements */
            for (int mode = 0; mode < 4; mode++) {
                size_t         n = nsz[si];
                const void    *hs[8], *ds[8];
                unsigned char *dd;
                int            o[3] = {mode == 1 ? 1 : mode == 3 ? 3 : 0, k, mode};
                char           name[32];

                for (int j = 0; j < k; j++) {
                    size_t off = mode == 1 ? (size_t)j % 3 : mode == 3 ? 3 : 0;
                    fill(h_in[j] + off * es, n, dt);
                    put(d_buf[j] + off * es, h_in[j] + off * es, n * es);
                    hs[j] = h_in[j] + off * es;
                    ds[j] = d_buf[j] + off * es;
                }
                dd = mode == 2 ? (unsigned char *)ds[k - 1] : d_buf[8] + o[0] * es;
                if (xccl_reduce_n(h_ref, hs, k, n, dt, op) != XCCL_OK) die("xccl_reduce_n");
                if (xccl_cuda_reduce_n(dd, ds, k, n, dt, op, NULL) != XCCL_OK)
                    die("xccl_cuda_reduce_n");
                sync_stream(xccl_cuda_stream());
                get(h_out, dd, n * es);
                snprintf(name, sizeof name, "%s k=%d", xccl_op_name(op), k);
                compare("reduce_n", dt, name, n, o, h_ref, h_out);
            }
        }
    }
}

/* ---- copies ---- */

static void check_copies(void)
{
    static const size_t ns[] = {1, 3, 4096, 100003};
    int                 o[3] = {0, 0, 0};

    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
        size_t n  = ns[i];
        void  *ev = NULL;

        fill(h_in[0], n, XCCL_UINT8);
        put(d_buf[0] + 1, h_in[0], n);
        run(ex->copy(NULL, d_buf[1] + 3, d_buf[0] + 1, n, &ev), &ev, "copy d2d");
        get(h_out, d_buf[1] + 3, n);
        compare("copy d2d", XCCL_UINT8, "-", n, o, h_in[0], h_out);
        /* overlapping, both directions: memmove semantics */
        for (int dir = 0; dir < 2; dir++) {
            size_t shift = n / 3 + 1;
            put(d_buf[2], h_in[0], n + shift);
            memcpy(h_ref, h_in[0], n + shift);
            memmove(dir ? h_ref + shift : h_ref, dir ? h_ref : h_ref + shift, n);
            run(ex->copy(NULL, dir ? d_buf[2] + shift : d_buf[2], dir ? d_buf[2] : d_buf[2] + shift, n,
                         &ev),
                &ev, "copy overlapping");
            get(h_out, d_buf[2], n + shift);
            o[0] = dir;
            compare("copy overlap", XCCL_UINT8, dir ? "up" : "down", n + shift, o, h_ref, h_out);
        }
    }
}

/* ---- gates and order_after ---- */

static int event_done_within(CUevent e, double secs)
{
    double t0 = now_s();
    for (;;) {
        CUresult rc = xccl_cu.EventQuery(e);
        if (rc == CUDA_SUCCESS) return 1;
        if (rc != CUDA_ERROR_NOT_READY) {
            xccl_cuda_fail(rc, "cuEventQuery");
            die("event");
        }
        if (now_s() - t0 > secs) return 0;
    }
}

static void check_gates(void)
{
    CUstream s = NULL;
    CUevent  e = NULL;
    uint64_t t = 0, t2 = 0;
    int      o[3] = {0, 0, 0};
    void    *ev   = NULL, *mark = NULL;
    CUresult rc;

    rc = xccl_cu.StreamCreateWithPriority(&s, CU_STREAM_NON_BLOCKING, 0);
    if (rc == CUDA_SUCCESS) rc = xccl_cu.EventCreate(&e, CU_EVENT_DISABLE_TIMING);
    if (rc != CUDA_SUCCESS) {
        xccl_cuda_fail(rc, "stream/event");
        die("gates setup");
    }
    /* an open gate: no wait at all */
    if (ex->gate_new(&t2) != XCCL_OK) die("gate_new");
    ex->gate_open(t2);
    if (ex->gate_wait(t2, s) != XCCL_OK) die("gate_wait (open)");
    /* a closed one: the stream waits on the device */
    if (ex->gate_new(&t) != XCCL_OK) die("gate_new");
    if (ex->gate_wait(t, s) != XCCL_OK) die("gate_wait");
    if (xccl_cu.EventRecord(e, s) != CUDA_SUCCESS) die("record");
    /* order_after marks s (behind the closed gate): an event that completes only once s gets
     * there, while xccl's own stream stays free - a copy on it finishes meanwhile */
    fill(h_in[0], 4096, XCCL_UINT8);
    put(d_buf[0], h_in[0], 4096);
    if (ex->order_after(s, &mark) != XCCL_INPROGRESS || mark == NULL)
        die("order_after on a waiting stream: not in progress");
    if (ex->copy(NULL, d_buf[1], d_buf[0], 4096, &ev) != XCCL_INPROGRESS) die("copy");
    wait_ev(ev, "copy beside a waiting stream");
    get(h_out, d_buf[1], 4096);
    compare("copy beside a waiting stream", XCCL_UINT8, "-", 4096, o, h_in[0], h_out);
    ncases++;
    if (event_done_within(e, 0.2)) {
        nbad++;
        fprintf(stderr, "MISMATCH gates: a stream waiting on a closed gate ran on\n");
    }
    ncases++;
    if (ex->test(mark) != XCCL_INPROGRESS) {
        nbad++;
        fprintf(stderr, "MISMATCH order_after: the mark completed before its stream got there\n");
        mark = NULL;
    }
    ex->gate_open(t);
    ncases++;
    if (!event_done_within(e, 10)) {
        fprintf(stderr, "MISMATCH gates: the stream still waits 10 s after the gate opened\n");
        exit(2); /* the stream would wait forever: leave (the process's exit frees the GPU) */
    }
    if (mark != NULL) wait_ev(mark, "order_after's mark");
    /* a stream with nothing pending: no event */
    mark = (void *)1;
    if (ex->order_after(s, &mark) != XCCL_OK || mark != NULL) die("order_after on an idle stream");
    (void)xccl_cu.EventDestroy(e);
    (void)xccl_cu.StreamDestroy(s);
}

int main(void)
{
    xccl_cuda_info_t info;
    double           t0 = now_s();

    if (xccl_cuda_set_device(0) != XCCL_OK) die("xccl_cuda_set_device(0)");
    xccl_cuda_info(&info);
    ex = xccl_exec_for(XCCL_MEM_CUDA);
    if (ex == NULL) die("no CUDA executor");
    for (int i = 0; i < 9; i++) {
        h_in[i]  = malloc(MAXB);
        d_buf[i] = ex->alloc(MAXB);
        if (h_in[i] == NULL || d_buf[i] == NULL) die("alloc");
    }
    h_ref = malloc(MAXB);
    h_out = malloc(MAXB);
    if (h_ref == NULL || h_out == NULL) die("malloc");

    check_copies();
    /* the same through pinned host memory (staging buffers are registered so), in buffers of
     * their own: host_release frees what it unpins */
    {
        unsigned char *keep[3] = {h_ref, h_out, h_in[0]}, *pin[3];
        for (int i = 0; i < 3; i++) {
            pin[i] = malloc(MAXB);
            if (pin[i] == NULL) die("malloc");
            memcpy(pin[i], keep[i], MAXB);
            if (ex->host_register(pin[i], MAXB) != XCCL_OK) die("host_register");
        }
        h_ref = pin[0], h_out = pin[1], h_in[0] = pin[2];
        check_copies();
        for (int i = 0; i < 3; i++)
            ex->host_release(pin[i]);
        h_ref = keep[0], h_out = keep[1], h_in[0] = keep[2];
    }
    check_gates();
    for (int d = 0; d < XCCL_DTYPE_COUNT; d++) {
        for (int op = 0; op <= XCCL_OP_BXOR; op++) {
            if (xccl_op_check((xccl_op_t)op, (xccl_dtype_t)d) != XCCL_OK) continue;
            check_reduce((xccl_dtype_t)d, (xccl_op_t)op);
            check_reduce_n((xccl_dtype_t)d, (xccl_op_t)op);
        }
        if (d != XCCL_BOOL) check_map((xccl_dtype_t)d);
    }
    for (int i = 0; i < 9; i++) {
        ex->free(d_buf[i]);
        free(h_in[i]);
    }
    free(h_ref);
    free(h_out);
    printf("kernel_check: %ld cases, %ld mismatches on %s (sm_%d%d; kernels %s) in %.1f s\n",
           ncases, nbad, info.device_name, info.cc_major, info.cc_minor, info.archs, now_s() - t0);
    return nbad != 0;
}
