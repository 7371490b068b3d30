/* SPDX-License-Identifier: Apache-2.0
 *
 * reduce_bench.c - micro-benchmark of the local reduction kernels (not a test): for every
 * kernel set this CPU runs, dst = a + b over distinct buffers (and a += b in place), for
 * float32, bfloat16 and float16 SUM, at 1 MiB and 64 MiB per buffer (or the sizes given).
 *
 * Build by hand from the repository root, e.g.:
 *   gcc -std=c11 -D_GNU_SOURCE -O2 -pthread -Icsrc/include -Icsrc benchmarks/reduce_bench.c \
 *       csrc/core/reduce.c csrc/core/reduce_avx2.c csrc/core/reduce_avx512.c csrc/core/util.c \
 *       -lm -o build/reduce_bench
 *   build/reduce_bench [bytes ...]
 *
 * Columns: thread CPU time per call (best of 5 rounds of ~0.1 s each), "algbw" =
 * bytes of one buffer / time, "membw" = bytes the kernel moves / time (3 buffers: two reads
 * and one write, for in place as well).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/reduce.h"

/* CPU time of this thread rather than wall-clock time: on a shared (virtual) machine, time
 * spent descheduled would otherwise land in the results */
static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* seconds per call, best of 5 rounds */
static double time_call(void *d, const void *a, const void *b, size_t count, xccl_dtype_t dt)
{
    double best = 1e30;
    int    iters = 1;

    /* calibrate: enough calls per round to last about 0.1 s */
    for (;;) {
        double t0 = now_s();
        for (int i = 0; i < iters; i++) xccl_reduce2(d, a, b, count, dt, XCCL_OP_SUM);
        if (now_s() - t0 > 0.02 || iters > (1 << 20)) break;
        iters *= 2;
    }
    iters = iters * 5 > 1 ? iters * 5 : 1;
    for (int r = 0; r < 5; r++) {
        double t0 = now_s(), t;
        for (int i = 0; i < iters; i++) xccl_reduce2(d, a, b, count, dt, XCCL_OP_SUM);
        t = (now_s() - t0) / iters;
        if (t < best) best = t;
    }
    return best;
}

int main(int argc, char **argv)
{
    static const char *const isas[] = {"generic", "avx2", "avx512"};
    static const xccl_dtype_t dts[] = {XCCL_FLOAT32, XCCL_BFLOAT16, XCCL_FLOAT16};
    size_t sizes[16] = {1u << 20, 64u << 20};
    int    nsizes    = 2;
    size_t maxb      = 0;
    char  *a, *b, *d;

    if (argc > 1) {
        nsizes = 0;
        for (int i = 1; i < argc && nsizes < 16; i++) sizes[nsizes++] = strtoull(argv[i], NULL, 0);
    }
    for (int i = 0; i < nsizes; i++) maxb = sizes[i] > maxb ? sizes[i] : maxb;
    a = malloc(maxb);
    b = malloc(maxb);
    d = malloc(maxb);
    if (a == NULL || b == NULL || d == NULL) {
        fprintf(stderr, "reduce_bench: cannot allocate 3 x %zu bytes\n", maxb);
        return 1;
    }
    /* normal (never subnormal) numbers whichever format reads them; repeated in-place sums
     * only grow them, towards Inf, which costs no more than any other value */
    for (size_t i = 0; i < maxb / 2; i++) {
        ((unsigned short *)a)[i] = (unsigned short)(0x3c00 + (i & 0xff));
        ((unsigned short *)b)[i] = (unsigned short)(0x3c00 + ((i * 7) & 0xff));
    }
    memset(d, 0, maxb);

    printf("# xccl reduce2 SUM micro-benchmark; default kernel set here: %s\n", xccl_reduce_isa());
    printf("# %-8s %-9s %-6s %12s %12s %10s %10s\n", "isa", "dtype", "place", "bytes",
           "time(us)", "algbw", "membw");
    printf("# %-8s %-9s %-6s %12s %12s %10s %10s\n", "", "", "", "", "", "(GB/s)", "(GB/s)");
    for (size_t k = 0; k < sizeof(isas) / sizeof(isas[0]); k++) {
        if (xccl_reduce_set_isa(isas[k]) != XCCL_OK) {
            printf("# %s: not supported by this CPU\n", isas[k]);
            continue;
        }
        for (size_t t = 0; t < sizeof(dts) / sizeof(dts[0]); t++) {
            size_t esz = xccl_dtype_size(dts[t]);
            for (int s = 0; s < nsizes; s++) {
                for (int inplace = 0; inplace <= 1; inplace++) {
                    size_t count = sizes[s] / esz;
                    double sec   = inplace ? time_call(a, a, b, count, dts[t])
                                           : time_call(d, a, b, count, dts[t]);
                    double bytes = (double)(count * esz);

                    printf("  %-8s %-9s %-6s %12zu %12.2f %10.2f %10.2f\n", isas[k],
                           xccl_dtype_name(dts[t]), inplace ? "in" : "out", count * esz,
                           sec * 1e6, bytes / sec / 1e9, 3 * bytes / sec / 1e9);
                }
            }
        }
    }
    free(a);
    free(b);
    free(d);
    return 0;
}
