/* SPDX-License-Identifier: Apache-2.0
 *
 * fuzz_algo.c - the $XCCL_ALGO grammar (csrc/algo/select.c): "coll[:lo-hi]=algo;..." as a user
 * or a job script writes it. Input: [u8 ranks][u64 nbytes a][u64 nbytes b][spec...]; the spec
 * is put in the environment and every collective is selected at four message sizes.
 *
 * Oracle: a second, independent parser of the grammar written here from its description in
 * docs/selection.md and select.c's header. For every (collective, size) the selection must agree
 * with it: a malformed spec fails with XCCL_ERR_INVALID_ARG; the first matching rule's algorithm
 * is chosen when it exists and applies, and refused with XCCL_ERR_INVALID_ARG otherwise; with no
 * rule (or "auto") the model chooses an applicable algorithm of that collective.
 */
#include "fuzz.h"

#include <ctype.h>
#include <stdbool.h>
#include <strings.h>

#include "algo/algo.h"

void xccl_algo_reset_env(void); /* select.c, for tests */

#define REF_MAX_RULES 64

typedef struct ref_rule {
    int    coll;
    size_t lo, hi;
    char   algo[32];
} ref_rule_t;

static bool ref_space(char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

static void ref_trim(const char **s, const char **e)
{
    while (*s < *e && ref_space(**s)) (*s)++;
    while (*e > *s && ref_space((*e)[-1])) (*e)--;
}

static bool ref_coll(const char *s, const char *e, int *out)
{
    for (int c = 0; c < XCCL_COLL_COUNT; c++) {
        const char *n = xccl_coll_name((xccl_coll_t)c), *p = s;
        for (;;) {
            while (p < e && *p == '_') p++;
            while (*n == '_') n++;
            if (p == e || *n == '\0') break;
            if (tolower((unsigned char)*p) != tolower((unsigned char)*n)) break;
            p++;
            n++;
        }
        if (p == e && *n == '\0') {
            *out = c;
            return true;
        }
    }
    return false;
}

static bool ref_bytes(const char *s, const char *e, bool inf, size_t *out)
{
    unsigned __int128 v = 0;
    unsigned          shift = 0;

    if (s == e || e - s >= 32) return false;
    if (inf && e - s == 3 && strncasecmp(s, "inf", 3) == 0) {
        *out = SIZE_MAX;
        return true;
    }
    if (!isdigit((unsigned char)*s)) return false;
    while (s < e && isdigit((unsigned char)*s)) {
        v = v * 10 + (unsigned)(*s++ - '0');
        if (v > UINT64_MAX) return false;
    }
    if (s < e) {
        switch (tolower((unsigned char)*s++)) {
        case 'k': shift = 10; break;
        case 'm': shift = 20; break;
        case 'g': shift = 30; break;
        default: return false;
        }
    }
    if (s != e || (v << shift) > SIZE_MAX) return false;
    *out = (size_t)(v << shift);
    return true;
}

/* The rules of spec, or -1 if it is malformed. */
static int ref_parse(const char *spec, ref_rule_t *rules)
{
    int n = 0;

    for (const char *s = spec; *s != '\0';) {
        const char *e = strchr(s, ';'), *eq, *colon, *dash, *a, *b;
        ref_rule_t  r;

        if (e == NULL) e = s + strlen(s);
        a = s;
        b = e;
        ref_trim(&a, &b);
        if (a != b) {
            if (n == REF_MAX_RULES) return -1;
            eq = memchr(s, '=', (size_t)(e - s));
            if (eq == NULL) return -1;
            colon = memchr(s, ':', (size_t)(eq - s));
            a     = s;
            b     = colon ? colon : eq;
            ref_trim(&a, &b);
            if (!ref_coll(a, b, &r.coll)) return -1;
            r.lo = 0;
            r.hi = SIZE_MAX;
            if (colon != NULL) {
                dash = memchr(colon + 1, '-', (size_t)(eq - colon - 1));
                if (dash == NULL) return -1;
                a = colon + 1;
                b = dash;
                ref_trim(&a, &b);
                if (!ref_bytes(a, b, false, &r.lo)) return -1;
                a = dash + 1;
                b = eq;
                ref_trim(&a, &b);
                if (!ref_bytes(a, b, true, &r.hi) || r.hi < r.lo) return -1;
            }
            a = eq + 1;
            b = e;
            ref_trim(&a, &b);
            if (a == b || b - a >= (ptrdiff_t)sizeof(r.algo)) return -1;
            memcpy(r.algo, a, (size_t)(b - a));
            r.algo[b - a] = '\0';
            rules[n++]    = r;
        }
        s = *e ? e + 1 : e;
    }
    return n;
}

static bool applicable(const xccl_algo_t *a, const xccl_coll_args_t *args, int size)
{
    return a->applicable == NULL || a->applicable(args, size);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_in_t   in = {data, size};
    static ref_rule_t rules[REF_MAX_RULES];
    int         ranks = 1 + (int)(fuzz_take(&in, 1) % 64), nrules;
    size_t      sizes[4];
    char       *spec;

    sizes[0] = (size_t)fuzz_take(&in, 8);
    sizes[1] = (size_t)fuzz_take(&in, 8) >> (fuzz_take(&in, 1) & 63);
    sizes[2] = 0;
    sizes[3] = SIZE_MAX;
    spec     = malloc(in.n + 1);
    FUZZ_CHECK(spec != NULL, "out of memory");
    memcpy(spec, in.p, in.n);
    spec[in.n] = '\0'; /* the environment ends it at the first NUL */
    setenv("XCCL_ALGO", spec, 1);
    xccl_algo_reset_env();
    nrules = ref_parse(spec, rules);

    for (int c = 0; c < XCCL_COLL_COUNT; c++) {
        for (int k = 0; k < 4; k++) {
            xccl_coll_args_t   args = {0};
            const xccl_algo_t *out  = NULL, *want = NULL;
            const ref_rule_t  *hit  = NULL;
            xccl_status_t      st;

            args.coll   = (xccl_coll_t)c;
            args.dtype  = XCCL_FLOAT32;
            args.elsize = 4;
            args.count  = sizes[k] / 4;
            args.op     = XCCL_OP_SUM;
            st          = xccl_algo_select(&args, ranks, sizes[k], NULL, NULL, &out);
            if (nrules < 0) {
                FUZZ_CHECK(st == XCCL_ERR_INVALID_ARG, "malformed spec '%s' gave status %d",
                           spec, (int)st);
                continue;
            }
            for (int i = 0; i < nrules && hit == NULL; i++)
                if (rules[i].coll == c && sizes[k] >= rules[i].lo && sizes[k] <= rules[i].hi)
                    hit = &rules[i];
            if (hit != NULL && strcmp(hit->algo, "auto") != 0) {
                want = xccl_algo_find(args.coll, hit->algo);
                if (want != NULL && applicable(want, &args, ranks))
                    FUZZ_CHECK(st == XCCL_OK && out == want,
                               "spec '%s', %s of %zu bytes: rule names '%s', got status %d (%s)",
                               spec, xccl_coll_name(args.coll), sizes[k], hit->algo, (int)st,
                               st == XCCL_OK ? out->name : xccl_last_error());
                else
                    FUZZ_CHECK(st == XCCL_ERR_INVALID_ARG,
                               "spec '%s', %s: '%s' is unknown or inapplicable, got status %d",
                               spec, xccl_coll_name(args.coll), hit->algo, (int)st);
                continue;
            }
            FUZZ_CHECK(st == XCCL_OK || st == XCCL_ERR_NOT_SUPPORTED,
                       "spec '%s', %s of %zu bytes: no rule applies, got status %d (%s)", spec,
                       xccl_coll_name(args.coll), sizes[k], (int)st, xccl_last_error());
            if (st == XCCL_OK) {
                bool listed = false;
                for (const xccl_algo_t *const *l = xccl_algo_list(args.coll); *l; l++)
                    listed |= *l == out;
                FUZZ_CHECK(listed && out->coll == args.coll && applicable(out, &args, ranks),
                           "model chose '%s', not an applicable %s algorithm", out->name,
                           xccl_coll_name(args.coll));
            }
        }
    }
    free(spec);
    return 0;
}
