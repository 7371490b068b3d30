/* SPDX-License-Identifier: Apache-2.0
 *
 * tune.c - tuning tables: the algorithm choices xccl-tune measured on one machine, and the cost
 * model it fitted there ($XCCL_TUNE_FILE; written by python/xccl/tune.py).
 *
 * Format, version 1: text, one directive per line; '#' starts a comment, blank lines are
 * skipped; fields are separated by spaces.
 *
 *     xccl-tune 1                                   first directive: format and version
 *     host transport=shm cores=16 cpu=AMD EPYC 7B13 the host signature (cpu: the rest of the
 *                                                   line, /proc/cpuinfo's first "model name")
 *     model alpha=2.1e-06 beta=1.4e-10 gamma=9e-11 delta=1.2e-10    fitted model (optional)
 *     choose all_reduce np=8 bytes=0-4096 algo=rd   measured winner for np ranks and nbytes in
 *                                                   [lo, hi] (nccl-tests size, as $XCCL_ALGO)
 *     meas all_reduce np=8 bytes=1024 rd=3.1e-06 ring=9.2e-06 ...   the measured seconds
 *                                                   behind the choices (checked, not used)
 *
 * A table applies to a communicator whose ranks all run on one host whose signature (CPU
 * model, online cores) and intra-host transport equal the table's; elsewhere it is ignored
 * (the reason is logged by the core). Within a table the first matching choose line wins.
 */
#include "algo/algo.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/check.h"

#define TUNE_VERSION   1
#define TUNE_MAX_BYTES (8u << 20)

typedef struct tune_choice {
    xccl_coll_t coll;
    int         np;
    size_t      lo, hi;
    char        algo[32];
} tune_choice_t;

struct xccl_tune {
    char              path[512];
    char              cpu[128];
    char              transport[32];
    int               cores;
    int               has_model;
    xccl_cost_model_t model;
    int               n, cap;
    tune_choice_t    *choice;
};

/* This host's CPU model (first "model name" of /proc/cpuinfo, "unknown" without one) and
 * online cores: the signature tables are keyed by (python/xccl/tune.py computes the same). */
void xccl_tune_host(char *cpu, size_t len, int *cores)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    char  line[512];
    long  n = sysconf(_SC_NPROCESSORS_ONLN);

    snprintf(cpu, len, "unknown");
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        char  *colon = strchr(line, ':'), *v, *e;
        size_t klen;
        if (colon == NULL || strncmp(line, "model name", 10) != 0) continue;
        klen = (size_t)(colon - line);
        while (klen > 10 && isspace((unsigned char)line[klen - 1]))
            klen--;
        if (klen != 10) continue;
        for (v = colon + 1; isspace((unsigned char)*v); v++) {
        }
        for (e = v + strlen(v); e > v && isspace((unsigned char)e[-1]); e--) {
        }
        if (e > v) snprintf(cpu, len, "%.*s", (int)(e - v), v);
        break;
    }
    if (f != NULL) fclose(f);
    *cores = n > 0 ? (int)n : 1;
}

/* 64-bit FNV-1a of the table's bytes: ranks compare it to agree on one table. */
static uint64_t fnv1a(const char *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;

    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)p[i]) * 0x100000001b3ull;
    return h ? h : 1;
}

static int coll_by_name(const char *s, size_t n, xccl_coll_t *out)
{
    for (int c = 0; c < XCCL_COLL_COUNT; c++) {
        const char *name = xccl_coll_name((xccl_coll_t)c);
        if (strlen(name) == n && strncmp(name, s, n) == 0) {
            *out = (xccl_coll_t)c;
            return 0;
        }
    }
    return -1;
}

/* The next space-separated field of [*s, end) into [*f, *f + *n); 0 when there is none. */
static int field(const char **s, const char *end, const char **f, size_t *n)
{
    const char *p = *s;

    while (p < end && isspace((unsigned char)*p))
        p++;
    if (p == end) return 0;
    *f = p;
    while (p < end && !isspace((unsigned char)*p))
        p++;
    *n = (size_t)(p - *f);
    *s = p;
    return 1;
}

/* "key=value" with this key: the value into [*v, *v + *vn). */
static int keyval(const char *f, size_t n, const char *key, const char **v, size_t *vn)
{
    size_t k = strlen(key);

    if (n <= k || strncmp(f, key, k) != 0 || f[k] != '=') return 0;
    *v  = f + k + 1;
    *vn = n - k - 1;
    return 1;
}

/* A table's byte counts are plain decimal integers (xccl-tune writes them; unlike $XCCL_ALGO's,
 * no suffixes). */
static int parse_size(const char *s, size_t n, size_t *out)
{
    char               buf[32], *e;
    unsigned long long v;

    if (n == 0 || n >= sizeof(buf) || !isdigit((unsigned char)s[0])) return -1;
    memcpy(buf, s, n);
    buf[n] = '\0';
    errno = 0;
    v     = strtoull(buf, &e, 10);
    if (errno != 0 || *e != '\0' || v > SIZE_MAX) return -1;
    *out = (size_t)v;
    return 0;
}

static int parse_seconds(const char *s, size_t n, double *out)
{
    char buf[48], *e;

    if (n == 0 || n >= sizeof(buf)) return -1;
    memcpy(buf, s, n);
    buf[n] = '\0';
    errno  = 0;
    *out   = strtod(buf, &e);
    return errno != 0 || *e != '\0' || !(*out >= 0) || *out > 1e9 ? -1 : 0;
}

static int parse_int(const char *s, size_t n, int lo, int hi, int *out)
{
    size_t v;

    if (parse_size(s, n, &v) != 0 || v < (size_t)lo || v > (size_t)hi) return -1;
    *out = (int)v;
    return 0;
}

/* One line [s, end) (comment stripped) of the table; `seen_version` says whether the version
 * line came. On error writes why[len] and returns -1. */
static int parse_line(xccl_tune_t *t, const char *s, const char *end, int *seen_version,
                      int *seen_host, char *why, size_t len)
{
    const char *f, *v;
    size_t      n, vn;

    if (!field(&s, end, &f, &n)) return 0;
    if (!*seen_version) {
        int ver;
        if (n != 9 || strncmp(f, "xccl-tune", 9) != 0 || !field(&s, end, &v, &vn) ||
            parse_int(v, vn, 0, 1 << 20, &ver) != 0) {
            snprintf(why, len, "expected 'xccl-tune %d' first", TUNE_VERSION);
            return -1;
        }
        if (ver != TUNE_VERSION) {
            snprintf(why, len, "table version %d, this xccl reads version %d (run xccl-tune again)",
                     ver, TUNE_VERSION);
            return -1;
        }
        if (field(&s, end, &v, &vn)) goto extra;
        *seen_version = 1;
        return 0;
    }
    if (n == 4 && strncmp(f, "host", 4) == 0) {
        int got = 0;
        if (*seen_host) {
            snprintf(why, len, "a second host line");
            return -1;
        }
        while (field(&s, end, &f, &n)) {
            if (keyval(f, n, "transport", &v, &vn) && vn < sizeof(t->transport)) {
                snprintf(t->transport, sizeof(t->transport), "%.*s", (int)vn, v);
                got |= 1;
            } else if (keyval(f, n, "cores", &v, &vn)) {
                if (parse_int(v, vn, 1, 1 << 20, &t->cores) != 0) goto badval;
                got |= 2;
            } else if (keyval(f, n, "cpu", &v, &vn)) { /* the rest of the line */
                const char *e = end;
                while (e > v && isspace((unsigned char)e[-1]))
                    e--;
                if (e == v || (size_t)(e - v) >= sizeof(t->cpu)) goto badval;
                snprintf(t->cpu, sizeof(t->cpu), "%.*s", (int)(e - v), v);
                got |= 4;
                break;
            } else {
                goto badfield;
            }
        }
        if (got != 7) {
            snprintf(why, len, "host needs transport=, cores= and cpu= (last)");
            return -1;
        }
        *seen_host = 1;
        return 0;
    }
    if (n == 5 && strncmp(f, "model", 5) == 0) {
        static const char *const keys[4] = {"alpha", "beta", "gamma", "delta"};
        double                   c[4];
        int                      got = 0;
        while (field(&s, end, &f, &n)) {
            int k;
            for (k = 0; k < 4 && !keyval(f, n, keys[k], &v, &vn); k++) {
            }
            if (k == 4) goto badfield;
            if (parse_seconds(v, vn, &c[k]) != 0) goto badval;
            got |= 1 << k;
        }
        if (got != 15) {
            snprintf(why, len, "model needs alpha=, beta=, gamma= and delta= (seconds, >= 0)");
            return -1;
        }
        t->model     = (xccl_cost_model_t){c[0], c[1], c[2], c[3]};
        t->has_model = 1;
        return 0;
    }
    if ((n == 6 && strncmp(f, "choose", 6) == 0) || (n == 4 && strncmp(f, "meas", 4) == 0)) {
        int           choose = n == 6, got = 0;
        tune_choice_t c = {0};
        if (!*seen_host) {
            snprintf(why, len, "'%.*s' before the host line", (int)n, f);
            return -1;
        }
        if (!field(&s, end, &f, &n) || coll_by_name(f, n, &c.coll) != 0) {
            snprintf(why, len, "unknown collective '%.*s'", (int)n, f);
            return -1;
        }
        while (field(&s, end, &f, &n)) {
            if (keyval(f, n, "np", &v, &vn)) {
                if (parse_int(v, vn, 1, 1 << 24, &c.np) != 0) goto badval;
                got |= 1;
            } else if (keyval(f, n, "bytes", &v, &vn)) {
                const char *dash = memchr(v, '-', vn);
                if (dash == NULL && !choose) {
                    if (parse_size(v, vn, &c.lo) != 0) goto badval;
                    c.hi = c.lo;
                } else if (dash == NULL || parse_size(v, (size_t)(dash - v), &c.lo) != 0 ||
                           parse_size(dash + 1, vn - (size_t)(dash - v) - 1, &c.hi) != 0 ||
                           c.hi < c.lo) {
                    goto badval;
                }
                got |= 2;
            } else if (choose && keyval(f, n, "algo", &v, &vn)) {
                if (vn >= sizeof(c.algo)) goto badval;
                snprintf(c.algo, sizeof(c.algo), "%.*s", (int)vn, v);
                if (xccl_algo_find(c.coll, c.algo) == NULL) {
                    snprintf(why, len, "%s has no algorithm '%s'", xccl_coll_name(c.coll), c.algo);
                    return -1;
                }
                got |= 4;
            } else if (!choose && keyval(f, n, "best", &v, &vn)) {
                got |= 4;
            } else if (!choose && (v = memchr(f, '=', n)) != NULL) {
                double sec; /* <algorithm>=<seconds> */
                if (parse_seconds(v + 1, n - (size_t)(v - f) - 1, &sec) != 0) goto badval;
            } else {
                goto badfield;
            }
        }
        if ((got & 3) != 3 || (choose && got != 7)) {
            snprintf(why, len, "%s needs np=, bytes=%s", choose ? "choose" : "meas",
                     choose ? "lo-hi and algo=" : "n");
            return -1;
        }
        if (!choose) return 0;
        if (t->n == t->cap) {
            int            cap = t->cap ? 2 * t->cap : 32;
            tune_choice_t *p   = realloc(t->choice, (size_t)cap * sizeof(*p));
            if (p == NULL) {
                snprintf(why, len, "out of memory");
                return -1;
            }
            t->choice = p;
            t->cap    = cap;
        }
        t->choice[t->n++] = c;
        return 0;
    }
    snprintf(why, len, "unknown directive '%.*s' (xccl-tune, host, model, choose, meas)", (int)n,
             f);
    return -1;
extra:
    snprintf(why, len, "unexpected '%.*s'", (int)vn, v);
    return -1;
badval:
    snprintf(why, len, "bad value in '%.*s'", (int)n, f);
    return -1;
badfield:
    snprintf(why, len, "unknown field '%.*s'", (int)n, f);
    return -1;
}

void xccl_tune_free(xccl_tune_t *t)
{
    if (t == NULL) return;
    free(t->choice);
    free(t);
}

xccl_status_t xccl_tune_load(const char *path, xccl_tune_t **out, uint64_t *hash)
{
    FILE         *f;
    char         *buf = NULL, why[256];
    size_t        n   = 0;
    xccl_tune_t  *t;
    int           lineno = 0, seen_version = 0, seen_host = 0;
    xccl_status_t st;

    *out  = NULL;
    *hash = 0;
    if (path == NULL || *path == '\0') return XCCL_OK;
    f = fopen(path, "rb");
    if (f == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "XCCL_TUNE_FILE %s: cannot open: %s", path,
                          strerror(errno));
    buf = malloc(TUNE_MAX_BYTES + 1);
    t   = calloc(1, sizeof(*t));
    if (buf == NULL || t == NULL) {
        st = XCCL_ERROR(XCCL_ERR_NO_MEMORY, "XCCL_TUNE_FILE %s: out of memory", path);
        goto fail;
    }
    n = fread(buf, 1, TUNE_MAX_BYTES + 1, f);
    if (ferror(f) || n > TUNE_MAX_BYTES) {
        st = XCCL_ERROR(XCCL_ERR_INVALID_ARG, "XCCL_TUNE_FILE %s: %s", path,
                        ferror(f) ? "read error" : "larger than 8 MiB");
        goto fail;
    }
    buf[n] = '\0';
    snprintf(t->path, sizeof(t->path), "%s", path);
    for (const char *s = buf, *end; s < buf + n; s = end + (end < buf + n)) {
        const char *hashc;
        end = memchr(s, '\n', (size_t)(buf + n - s));
        if (end == NULL) end = buf + n;
        lineno++;
        if (memchr(s, '\0', (size_t)(end - s)) != NULL) {
            snprintf(why, sizeof(why), "not a text line");
            goto bad_line;
        }
        hashc = memchr(s, '#', (size_t)(end - s));
        if (parse_line(t, s, hashc ? hashc : end, &seen_version, &seen_host, why, sizeof(why)) != 0)
            goto bad_line;
    }
    if (!seen_version || !seen_host) {
        st = XCCL_ERROR(XCCL_ERR_INVALID_ARG, "XCCL_TUNE_FILE %s: %s", path,
                        !seen_version ? "empty (expected 'xccl-tune 1' first)" : "no host line");
        goto fail;
    }
    *hash = fnv1a(buf, n);
    *out  = t;
    free(buf);
    fclose(f);
    return XCCL_OK;
bad_line:
    st = XCCL_ERROR(XCCL_ERR_INVALID_ARG, "XCCL_TUNE_FILE %s:%d: %s", path, lineno, why);
fail:
    free(buf);
    xccl_tune_free(t);
    fclose(f);
    return st;
}

int xccl_tune_applies(const xccl_tune_t *t, const char *transport, xccl_cost_model_t *m, char *why,
                      size_t len)
{
    char cpu[128];
    int  cores;

    if (t == NULL) {
        snprintf(why, len, "no table");
        return 0;
    }
    xccl_tune_host(cpu, sizeof(cpu), &cores);
    if (strcmp(cpu, t->cpu) != 0 || cores != t->cores) {
        snprintf(why, len, "%s was measured on '%s' with %d cores, this host is '%s' with %d",
                 t->path, t->cpu, t->cores, cpu, cores);
        return 0;
    }
    if (transport == NULL || strcmp(transport, t->transport) != 0) {
        snprintf(why, len, "%s was measured with transport %s, ranks here use %s", t->path,
                 t->transport, transport ? transport : "none");
        return 0;
    }
    if (t->has_model) *m = t->model;
    return 1;
}

const char *xccl_tune_lookup(const xccl_tune_t *t, xccl_coll_t coll, int size, size_t nbytes)
{
    for (int i = 0; t != NULL && i < t->n; i++) {
        const tune_choice_t *c = &t->choice[i];
        if (c->coll == coll && c->np == size && c->lo <= nbytes && nbytes <= c->hi) return c->algo;
    }
    return NULL;
}
