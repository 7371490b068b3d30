/*
 * membw: what this machine's memory system allows for one copy per byte, with N copies at once.
 *
 *     cc -O2 -std=c11 -o membw benchmarks/membw.c
 *     ./membw -p 16 -s 64M            # 16 processes, each copying its own 64 MiB buffer
 *     ./membw -p 16 -s 64M --shared-src --json
 *
 * N processes (fork) each own a source and a destination buffer of SIZE bytes (--shared-src: one
 * source in shared memory that every process reads, as a broadcast's receivers read the root's
 * buffer; each still writes its own destination). Each process first copies once (every page
 * touched, no first-touch faults in the timed part) and measures that copy; after a barrier all
 * agree on the same number of copies (enough for the slowest to last --mintime seconds), wait
 * at a second barrier and copy at once. A round's time runs from the earliest start to the
 * latest end (CLOCK_MONOTONIC, one clock for every process), so a stream that ran alone while
 * the others were descheduled does not count as parallel. --rounds rounds; the best counts.
 *
 * Reported (stdout; --json: one JSON object):
 *   aggregate  = N * SIZE * copies / round time  (GB/s, 10^9 B/s; bytes copied: each byte is read
 *                once and written once, so the memory traffic is twice that, or more where the
 *                CPU reads a destination line before writing it)
 *   per_stream = aggregate / N: with N ranks copying at once, what one rank can copy per second.
 *                A broadcast or all_gather that copies each byte once, every rank copying its
 *                share in parallel, has a nccl-tests busbw of at most about this figure
 *                (broadcast: N-1 receivers each copy SIZE; all_gather: N ranks each copy
 *                (N-1)/N of SIZE; busbw's factors turn both into bytes copied per rank).
 *   min_stream, max_stream = the slowest and fastest process's own SIZE * copies / its own time.
 *
 * Copies are memcpy (glibc picks the kernel: non-temporal stores for large copies on x86). Buffers
 * come from mmap (4 KiB pages; --thp madvises them MADV_HUGEPAGE, as torch does with
 * THP_MEM_ALLOC_ENABLE=1). No process is pinned: ranks of the benchmarks are not either.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_PROCS 1024

/* One process's slot in the shared page: its warm-up copy time and each round's interval. */
struct slot {
    double warm_s;
    double start[64];
    double end[64];
    int    failed;
};

struct shared {
    pthread_barrier_t barrier;
    struct slot       slot[MAX_PROCS];
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int parse_size(const char *s, size_t *out)
{
    char *end;
    errno                = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) return -1;
    switch (*end) {
    case 'K':
    case 'k':
        v <<= 10;
        end++;
        break;
    case 'M':
    case 'm':
        v <<= 20;
        end++;
        break;
    case 'G':
    case 'g':
        v <<= 30;
        end++;
        break;
    default:
        break;
    }
    if (*end == 'B' || *end == 'b') end++;
    if (*end != '\0' || v == 0) return -1;
    *out = (size_t)v;
    return 0;
}

static void *map(size_t bytes, int shared, int thp)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                   MAP_ANONYMOUS | (shared ? MAP_SHARED : MAP_PRIVATE), -1, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    if (thp) (void)madvise(p, bytes, MADV_HUGEPAGE);
#else
    (void)thp;
#endif
    return p;
}

static int wait_barrier(struct shared *sh)
{
    int rc = pthread_barrier_wait(&sh->barrier);
    return rc == 0 || rc == PTHREAD_BARRIER_SERIAL_THREAD ? 0 : -1;
}

/* One stream: warm up, agree on the copy count, then `rounds` timed rounds. */
static int stream(struct shared *sh, int me, int nprocs, size_t size, const char *shared_src,
                  int thp, double mintime, int rounds)
{
    struct slot *s   = &sh->slot[me];
    char        *src = shared_src ? (char *)shared_src : map(size, 0, thp);
    char        *dst = map(size, 0, thp);
    if (!src || !dst) {
        /* Still meet the others at every barrier, or they would wait for this one forever. */
        s->failed = 1;
        for (int r = 0; r <= rounds; r++)
            if (wait_barrier(sh)) break;
        return -1;
    }
    if (!shared_src) memset(src, me + 1, size);
    memset(dst, 0, size);
    double t0 = now_s();
    memcpy(dst, src, size);
    s->warm_s = now_s() - t0;
    if (wait_barrier(sh)) return -1;
    double slowest = 0;
    for (int i = 0; i < nprocs; i++)
        slowest = sh->slot[i].warm_s > slowest ? sh->slot[i].warm_s : slowest;
    long copies = slowest > 0 ? (long)(mintime / slowest) + 1 : 1;
    for (int r = 0; r < rounds; r++) {
        if (wait_barrier(sh)) return -1;
        s->start[r] = now_s();
        for (long c = 0; c < copies; c++) {
            memcpy(dst, src, size);
            /* The copy's result is read back below, so the compiler cannot drop the loop. */
            __asm__ volatile("" : : "r"(dst) : "memory");
        }
        s->end[r] = now_s();
    }
    if (dst[size - 1] != src[size - 1]) s->failed = 1;
    return (int)copies;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: membw [-p PROCS] [-s SIZE] [--mintime SEC] [--rounds R] [--shared-src]"
               " [--thp] [--json]\n"
               "  -p, --procs N    parallel copy streams, one process each (default 2)\n"
               "  -s, --size SIZE  bytes each stream copies per memcpy (K/M/G; default 64M)\n"
               "  --mintime SEC    each round lasts at least this long (default 0.2)\n"
               "  --rounds R       timed rounds, best one reported (default 3, at most 64)\n"
               "  --shared-src     every stream reads one shared source (broadcast pattern)\n"
               "  --thp            madvise the buffers MADV_HUGEPAGE\n"
               "  --json           one JSON object on stdout\n");
}

int main(int argc, char **argv)
{
    int    nprocs = 2, rounds = 3, shared_src = 0, thp = 0, json = 0;
    size_t size    = (size_t)64 << 20;
    double mintime = 0.2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if ((!strcmp(a, "-p") || !strcmp(a, "--procs")) && v) {
            char *end;
            long  n = strtol(v, &end, 10);
            if (*end || n < 1 || n > MAX_PROCS) {
                fprintf(stderr, "membw: --procs must be 1..%d, not '%s'\n", MAX_PROCS, v);
                return 2;
            }
            nprocs = (int)n;
            i++;
        } else if ((!strcmp(a, "-s") || !strcmp(a, "--size")) && v) {
            if (parse_size(v, &size)) {
                fprintf(stderr, "membw: bad size '%s' (e.g. 4096, 64M)\n", v);
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--mintime") && v) {
            char *end;
            mintime = strtod(v, &end);
            if (*end || !(mintime >= 0) || mintime > 3600) {
                fprintf(stderr, "membw: bad --mintime '%s'\n", v);
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--rounds") && v) {
            char *end;
            long  r = strtol(v, &end, 10);
            if (*end || r < 1 || r > 64) {
                fprintf(stderr, "membw: --rounds must be 1..64, not '%s'\n", v);
                return 2;
            }
            rounds = (int)r;
            i++;
        } else if (!strcmp(a, "--shared-src")) {
            shared_src = 1;
        } else if (!strcmp(a, "--thp")) {
            thp = 1;
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "membw: unknown or incomplete argument '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }

    struct shared *sh  = map(sizeof *sh, 1, 0);
    char          *src = NULL;
    if (!sh || (shared_src && !(src = map(size, 1, thp)))) {
        fprintf(stderr, "membw: cannot map %zu bytes: %s\n", shared_src ? size : sizeof *sh,
                strerror(errno));
        return 1;
    }
    if (src) memset(src, 7, size);
    pthread_barrierattr_t attr;
    if (pthread_barrierattr_init(&attr) ||
        pthread_barrierattr_setpshared(&attr, PTHREAD_PROCESS_SHARED) ||
        pthread_barrier_init(&sh->barrier, &attr, (unsigned)nprocs)) {
        fprintf(stderr, "membw: cannot create a process-shared barrier\n");
        return 1;
    }
    pthread_barrierattr_destroy(&attr);

    pid_t pids[MAX_PROCS];
    int   started = 0;
    long  copies  = 0;
    for (; started < nprocs; started++) {
        pid_t pid = fork();
        if (pid < 0) {
            /* The streams already started would wait at the barrier forever. */
            fprintf(stderr, "membw: fork: %s\n", strerror(errno));
            for (int i = 0; i < started; i++)
                kill(pids[i], SIGKILL);
            for (int i = 0; i < started; i++)
                waitpid(pids[i], NULL, 0);
            return 1;
        }
        if (pid == 0) {
            int c = stream(sh, started, nprocs, size, src, thp, mintime, rounds);
            /* The exit status carries nothing but success; the copy count is recomputed. */
            _exit(c < 0 ? 1 : 0);
        }
        pids[started] = pid;
    }
    int bad = 0;
    for (int i = 0; i < nprocs; i++) {
        int status;
        while (waitpid(pids[i], &status, 0) < 0 && errno == EINTR) {
        }
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || sh->slot[i].failed) bad = 1;
    }
    if (bad) {
        fprintf(stderr, "membw: a copy stream failed (out of memory?)\n");
        return 1;
    }
    double slowest = 0;
    for (int i = 0; i < nprocs; i++)
        slowest = sh->slot[i].warm_s > slowest ? sh->slot[i].warm_s : slowest;
    copies = slowest > 0 ? (long)(mintime / slowest) + 1 : 1;

    double best = 0, best_min = 0, best_max = 0, best_t = 0;
    for (int r = 0; r < rounds; r++) {
        double t0 = sh->slot[0].start[r], t1 = sh->slot[0].end[r];
        double lo = 0, hi = 0;
        for (int i = 0; i < nprocs; i++) {
            const struct slot *s = &sh->slot[i];
            t0                   = s->start[r] < t0 ? s->start[r] : t0;
            t1                   = s->end[r] > t1 ? s->end[r] : t1;
            double own           = (double)size * (double)copies / (s->end[r] - s->start[r]) / 1e9;
            lo                   = i == 0 || own < lo ? own : lo;
            hi                   = i == 0 || own > hi ? own : hi;
        }
        double agg = (double)nprocs * (double)size * (double)copies / (t1 - t0) / 1e9;
        if (agg > best) {
            best     = agg;
            best_min = lo;
            best_max = hi;
            best_t   = t1 - t0;
        }
    }
    if (json)
        printf("{\"procs\": %d, \"size\": %zu, \"shared_src\": %s, \"thp\": %s, \"copies\": %ld, "
               "\"rounds\": %d, \"seconds\": %.6f, \"aggregate_gbps\": %.4f, "
               "\"per_stream_gbps\": %.4f, \"min_stream_gbps\": %.4f, "
               "\"max_stream_gbps\": %.4f}\n",
               nprocs, size, shared_src ? "true" : "false", thp ? "true" : "false", copies, rounds,
               best_t, best, best / nprocs, best_min, best_max);
    else
        printf("membw: %d streams x %zu B (%s source%s), %ld copies per round, best of %d: "
               "aggregate %.2f GB/s, per stream %.2f GB/s (slowest %.2f, fastest %.2f)\n",
               nprocs, size, shared_src ? "shared" : "own", thp ? ", huge pages" : "", copies,
               rounds, best, best / nprocs, best_min, best_max);
    return 0;
}
