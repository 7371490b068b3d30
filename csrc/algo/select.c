/* SPDX-License-Identifier: Apache-2.0
 *
 * select.c - choice of the algorithm of a collective. In order, the first that decides:
 *
 *   source   what decides
 *   forced   the call's algo= (anything but "auto")
 *   env      a rule of $XCCL_ALGO matching (collective, nbytes) (grammar below)
 *   table    the tuning table of the communicator (topo->tune: $XCCL_TUNE_FILE measured on
 *            this host and transport, one node; tune.c), for its np and a size in a range
 *   rule     the one-host block (topo->shared: "shm", then "cma") or a built-in rule
 *            (builtin_rules below), only where no table applies
 *   model    the α-β-γ-δ cost model: the applicable algorithm predicted fastest (with a
 *            table, its fitted model: the core passes it as topo->intra)
 *
 * A choice the arguments rule out (count not divisible, no shared segment) falls through to
 * the next source, except a forced one or an $XCCL_ALGO one, which fail naming it.
 *
 * $XCCL_ALGO grammar (spaces around tokens are ignored, empty rules are skipped):
 *
 *     XCCL_ALGO := rule { ";" rule }
 *     rule      := coll [ ":" lo "-" hi ] "=" algo
 *     coll      := a collective as xccl_coll_name prints it ("all_reduce", "broadcast",
 *                  "reduce_scatter", "all_to_all_v", ...), case and underscores optional
 *                  ("allreduce", "AllGather", "alltoallv")
 *     lo, hi    := bytes, an integer with an optional k, m or g suffix (powers of 1024); hi
 *                  may be "inf". A rule matches when lo <= nbytes <= hi, nbytes being the
 *                  size the cost model uses (algo.h: the whole vector for all_reduce, the
 *                  whole gathered output for all_gather, ...). No range: every size.
 *     algo      := an algorithm name of that collective, or "auto" for the cost model
 *
 *     XCCL_ALGO="allreduce:0-64k=rd; allreduce:64k-inf=ring; broadcast=binomial"
 *
 * The first matching rule wins. A malformed variable fails every collective, an unknown or
 * inapplicable algorithm fails the collectives its rule matches (XCCL_ERR_INVALID_ARG naming
 * it and the valid ones). The variable is parsed once, on first use (thread-safe);
 * xccl_algo_reset_env makes the next selection read it again. Every rank must see the same
 * value, or ranks will run different schedules.
 */
#include "algo/algo.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core/check.h"

#define MAX_RULES    64
#define NAME_MAX_LEN 32

typedef struct rule {
    xccl_coll_t coll;
    size_t      lo, hi; /* inclusive byte range */
    char        algo[NAME_MAX_LEN];
    char        text[96]; /* the rule as written, for messages */
} rule_t;

static pthread_mutex_t env_lock = PTHREAD_MUTEX_INITIALIZER;
static int             env_parsed;
static int             nrules;
static rule_t          rules[MAX_RULES];
static xccl_status_t   env_status;
static char            env_error[512];
static unsigned        env_gen; /* bumped by xccl_algo_reset_env: memoised choices go stale */

/* Fallback when the caller has no model (the core passes its own, fitted per transport). */
static const xccl_cost_model_t default_model = {20e-6, 1.0 / 2.0e9, 1.0 / 4.0e9, 1.0 / 8.0e9};

/* Choices the α-β-γ-δ model cannot make, because it has no term for them. They apply after
 * $XCCL_ALGO (whose rules win), only where no tuning table applies (a table replaces them), not
 * when "auto" asks for the model itself, and only to groups on one node; the first match wins.
 * Each was re-derived on the 2-vCPU VM (AMD EPYC, shared memory unless said; 2026-11-27, other
 * jobs running: load 15-17) from medians of 9 interleaved rounds of the rule's algorithm
 * against the model's choice, three launches; the numbers are t(rule) / t(model) per launch:
 *   - direct below 64 KiB, owner from 64 KiB to 1 MiB, where ranks outnumber CPUs and
 *     receivers pull (np=4): waiting to be scheduled costs more per round than α. 16 KiB:
 *     direct/rabenseifner 0.66 0.61 0.66; 32 KiB: 0.74 0.65 1.00. 256 KiB: owner/rabenseifner
 *     0.55 2.24 0.46, again 0.75 0.60 0.67; 512 KiB: 1.04 0.97 0.45.
 *   - owner for all_reduce and reduce_scatter from 16 MiB on 2 to 4 ranks (its receive window
 *     stays in cache where the others' whole-block scratch goes to memory and back). np=2:
 *     all_reduce 16 MiB owner/rabenseifner 0.82 0.83 0.74, 64 MiB 0.84 0.90 0.60; over TCP
 *     0.77 0.96 0.77 and 0.79 0.80 0.80; reduce_scatter 16 MiB owner/rhd 0.86 1.08 0.68,
 *     64 MiB 0.82 0.85 0.75; over TCP 0.81 0.80 0.91 and 0.82 0.83 0.81. np=4 it depends on
 *     the buffers: with torch's (4 KiB pages; what compare.py and most users pass) owner
 *     held - all_reduce 16 MiB 1.22 0.84 0.94, 64 MiB 1.61 0.71 0.95 (XCCL_SHARED=0),
 *     reduce_scatter (owner/direct) 1.14 0.85 0.96 and 1.34 0.68 0.86; compare.py --repeat 3,
 *     owner against the model's: all_reduce 64 MiB 54 ms against 86, reduce_scatter 16 MiB
 *     7.9 against 13.9 ms and 64 MiB 34 against 54 ms - while with numpy's (huge pages) the
 *     model's choice won: all_reduce 2.19 1.57 1.84 and 2.52 1.48 2.16, reduce_scatter 1.86
 *     1.18 1.60 and 1.99 1.34 1.60; over TCP all_reduce 1.18 1.05 1.04 and 1.01 1.33 1.54,
 *     reduce_scatter 0.83 1.52 1.64 and 1.02 1.51 1.32. Not measured above 4 ranks: the
 *     model (or a tuning table) decides there.
 *   - linear broadcast from 1 MiB on 3 ranks or more where receivers pull: the model prices a
 *     fan-out by what the sender sends, but the n-1 copies run in parallel, in one round.
 *     np=4 against the model's scatter_allgather (1 MiB) or chain: 1 MiB 0.43 0.82 0.51,
 *     4 MiB 0.19 0.58 0.34, 16 MiB 0.18 0.42 0.30, 64 MiB 0.18 0.50 0.29. On 2 ranks linear and
 *     binomial are one message alike (16 MiB 0.97 0.99 1.00): the model's choice stands.
 *   - ring from 2 to 16 MiB where ranks outnumber CPUs and receivers pull (np=4): re-measured
 *     on the quiet VM (load < 3) after the run above, which had favoured the model's
 *     Rabenseifner under load 15-17 (ring/rabenseifner 1.65 1.33 1.15 at 4 MiB; compare.py 3.09
 *     against 2.32 ms). xccl-bench --np 4 --tensor torch --algo ring|rabenseifner, 4 alternated
 *     launches, µs: 4 MiB ring 3089 2568 4636 2597 against 3661 3033 3440 4001 (medians 2843
 *     against 3551); 16 MiB 15358 14276 15601 16131 against 19276 19145 19247 18423; 1 MiB
 *     mixed (505 332 716 531 against 435 348 383 508), so the rule starts at 2 MiB.
 * None for all_to_all: the model's choice (linear) held against pairwise (docs/selection.md). */
static const struct builtin_rule {
    xccl_coll_t coll;
    size_t      lo, hi;               /* inclusive byte range */
    int         min_ranks, max_ranks; /* inclusive */
    int         pull;                 /* only where receivers pull (topo->pull) */
    int         scarce;               /* only where ranks outnumber CPUs (topo->scarce) */
    const char *algo;
} builtin_rules[] = {
    {XCCL_COLL_ALLREDUCE, 0, (64 << 10) - 1, 2, INT_MAX, 1, 1, "direct"},
    {XCCL_COLL_ALLREDUCE, 64 << 10, (1 << 20) - 1, 2, INT_MAX, 1, 1, "owner"},
    {XCCL_COLL_ALLREDUCE, 2 << 20, (16 << 20) - 1, 2, INT_MAX, 1, 1, "ring"},
    {XCCL_COLL_ALLREDUCE, 16 << 20, SIZE_MAX, 2, 4, 0, 0, "owner"},
    {XCCL_COLL_REDUCE_SCATTER, 16 << 20, SIZE_MAX, 2, 4, 0, 0, "owner"},
    {XCCL_COLL_BROADCAST, 1 << 20, SIZE_MAX, 3, INT_MAX, 1, 0, "linear"},
};

/* Groups from this size on a host with a node-shared segment run the one-host algorithms by
 * default (below: xccl_algo_select). */
#define ONE_HOST_MIN_RANKS 8

/* Internal, for tests (not in algo.h): the next selection reads $XCCL_ALGO again. */
void xccl_algo_reset_env(void);

/* Collective names compare without case and underscores: "allreduce" == "all_reduce". */
static int coll_name_eq(const char *a, size_t alen, const char *b)
{
    size_t i = 0;

    for (;;) {
        while (i < alen && a[i] == '_') i++;
        while (*b == '_') b++;
        if (i == alen || *b == '\0') return i == alen && *b == '\0';
        if (tolower((unsigned char)a[i]) != tolower((unsigned char)*b)) return 0;
        i++;
        b++;
    }
}

static const char *trim(const char *s, const char *end, size_t *len)
{
    while (s < end && isspace((unsigned char)*s)) s++;
    while (end > s && isspace((unsigned char)end[-1])) end--;
    *len = (size_t)(end - s);
    return s;
}

/* A byte count "123", "64k", "1M", "2g" or (hi only) "inf". Returns 0 on success. */
static int parse_bytes(const char *s, size_t len, int allow_inf, size_t *out)
{
    char               buf[32], *end;
    unsigned long long v;
    unsigned           shift = 0;

    if (len == 0 || len >= sizeof(buf)) return -1;
    memcpy(buf, s, len);
    buf[len] = '\0';
    if (allow_inf && strcasecmp(buf, "inf") == 0) {
        *out = SIZE_MAX;
        return 0;
    }
    if (!isdigit((unsigned char)buf[0])) return -1;
    errno = 0;
    v     = strtoull(buf, &end, 10);
    if (errno != 0) return -1;
    switch (tolower((unsigned char)*end)) {
    case '\0': break;
    case 'k': shift = 10; end++; break;
    case 'm': shift = 20; end++; break;
    case 'g': shift = 30; end++; break;
    default: return -1;
    }
    if (*end != '\0' || v > (SIZE_MAX >> shift)) return -1;
    *out = (size_t)(v << shift);
    return 0;
}

/* Parses one rule [s, end) into r; on error writes env_error and returns -1. */
static int parse_rule(const char *s, const char *end, rule_t *r)
{
    const char *eq = memchr(s, '=', (size_t)(end - s)), *colon, *dash, *p;
    size_t      len, clen;
    int         c;

    p = trim(s, end, &len);
    snprintf(r->text, sizeof(r->text), "%.*s", (int)len, p);
    if (eq == NULL) goto bad;
    colon = memchr(s, ':', (size_t)(eq - s));
    p     = trim(s, colon ? colon : eq, &clen);
    for (c = 0; c < XCCL_COLL_COUNT; c++)
        if (coll_name_eq(p, clen, xccl_coll_name((xccl_coll_t)c))) break;
    if (c == XCCL_COLL_COUNT) {
        snprintf(env_error, sizeof(env_error),
                 "XCCL_ALGO: rule '%s': unknown collective '%.*s' (all_reduce, broadcast, "
                 "reduce, all_gather, gather, scatter, reduce_scatter, all_to_all, "
                 "all_to_all_v, barrier)",
                 r->text, (int)clen, p);
        return -1;
    }
    r->coll = (xccl_coll_t)c;
    r->lo   = 0;
    r->hi   = SIZE_MAX;
    if (colon != NULL) {
        dash = memchr(colon + 1, '-', (size_t)(eq - colon - 1));
        if (dash == NULL) goto bad;
        p = trim(colon + 1, dash, &len);
        if (parse_bytes(p, len, 0, &r->lo) != 0) goto bad;
        p = trim(dash + 1, eq, &len);
        if (parse_bytes(p, len, 1, &r->hi) != 0 || r->hi < r->lo) goto bad;
    }
    p = trim(eq + 1, end, &len);
    if (len == 0 || len >= sizeof(r->algo)) goto bad;
    memcpy(r->algo, p, len);
    r->algo[len] = '\0';
    return 0;
bad:
    snprintf(env_error, sizeof(env_error),
             "XCCL_ALGO: malformed rule '%s' (expected coll[:lo-hi]=algo, e.g. "
             "all_reduce:0-64k=rd)",
             r->text);
    return -1;
}

/* Reads $XCCL_ALGO into rules[]; called with env_lock held. */
static void parse_env(void)
{
    const char *v = getenv("XCCL_ALGO"), *s, *end;

    nrules       = 0;
    env_status   = XCCL_OK;
    env_error[0] = '\0';
    env_parsed   = 1;
    if (v == NULL) return;
    for (s = v; *s != '\0'; s = *end ? end + 1 : end) {
        size_t len;

        end = strchr(s, ';');
        if (end == NULL) end = s + strlen(s);
        trim(s, end, &len);
        if (len == 0) continue;
        if (nrules == MAX_RULES) {
            snprintf(env_error, sizeof(env_error), "XCCL_ALGO: more than %d rules", MAX_RULES);
            env_status = XCCL_ERR_INVALID_ARG;
            return;
        }
        if (parse_rule(s, end, &rules[nrules]) != 0) {
            env_status = XCCL_ERR_INVALID_ARG;
            nrules     = 0;
            return;
        }
        nrules++;
    }
}

void xccl_algo_reset_env(void)
{
    pthread_mutex_lock(&env_lock);
    env_parsed = 0;
    env_gen++;
    pthread_mutex_unlock(&env_lock);
}

/* Whether `a` can run these arguments: its own test, and a shared-memory algorithm only where
 * the communicator has a node-shared segment (task.h, "Node-shared memory"). */
static int usable(const xccl_algo_t *a, const xccl_coll_args_t *args, int size)
{
    if (a->shared && (args->topo == NULL || !(args->topo->shared & XCCL_SHARED_SEG))) return 0;
    return a->applicable == NULL || a->applicable(args, size);
}

/* "ring, rd, direct" into buf; with args, only those applicable to them. */
static void list_names(const xccl_coll_args_t *args, int size, char *buf, size_t len)
{
    const xccl_algo_t *const *list = xccl_algo_list(args->coll);
    size_t                    at   = 0;

    buf[0] = '\0';
    for (int i = 0; list[i] != NULL && at < len; i++) {
        if (!usable(list[i], args, size)) continue;
        at += (size_t)snprintf(buf + at, len - at, "%s%s", at ? ", " : "", list[i]->name);
    }
}

/* The algorithm called `name`, checked against the arguments; `why` says who asked. */
static xccl_status_t choose_named(const xccl_coll_args_t *args, int size, const char *name,
                                  const char *why, const xccl_algo_t **out)
{
    const xccl_algo_t *a = xccl_algo_find(args->coll, name);
    char               valid[256];

    if (a != NULL && usable(a, args, size)) {
        *out = a;
        return XCCL_OK;
    }
    list_names(args, size, valid, sizeof(valid));
    if (a == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "%s: unknown algorithm '%s' (%s); valid: %s",
                          xccl_coll_name(args->coll), name, why, valid);
    return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                      "%s: algorithm '%s' (%s) cannot run %d ranks with count %zu of %s; "
                      "applicable: %s",
                      xccl_coll_name(args->coll), name, why, size, args->count,
                      xccl_dtype_name(args->dtype), valid);
}

xccl_status_t xccl_algo_select_source(const xccl_coll_args_t *args, int size, size_t nbytes,
                                      const xccl_cost_model_t *m, const char *forced,
                                      const xccl_algo_t **out, const char **source)
{
    const xccl_algo_t *const *list;
    const xccl_algo_t        *best = NULL;
    double                    best_t = 0;
    char                      algo[NAME_MAX_LEN], why[160], msg[sizeof(env_error)];
    xccl_status_t             st;
    const char               *tuned;
    int                       found = 0, model_only, one_node;

    if (args == NULL || out == NULL || (unsigned)args->coll >= XCCL_COLL_COUNT || size < 1)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "algorithm selection: bad arguments");
    if (m == NULL) m = &default_model;
    *source = "forced";
    if (forced != NULL && *forced != '\0' && strcmp(forced, "auto") != 0)
        return choose_named(args, size, forced, "requested by the call", out);
    model_only = forced != NULL && strcmp(forced, "auto") == 0;

    pthread_mutex_lock(&env_lock);
    if (!env_parsed) parse_env();
    st = env_status;
    if (st != XCCL_OK) snprintf(msg, sizeof(msg), "%s", env_error);
    for (int i = 0; st == XCCL_OK && i < nrules && !found; i++) {
        const rule_t *r = &rules[i];
        if (r->coll != args->coll || nbytes < r->lo || nbytes > r->hi) continue;
        snprintf(algo, sizeof(algo), "%s", r->algo);
        snprintf(why, sizeof(why), "XCCL_ALGO rule '%s'", r->text);
        found = 1;
    }
    pthread_mutex_unlock(&env_lock);
    if (st != XCCL_OK) return XCCL_ERROR(st, "%s", msg);
    *source = "env";
    if (found && strcmp(algo, "auto") != 0) return choose_named(args, size, algo, why, out);
    /* "auto" (per call or by a rule) asks for the model itself. A tuning table (the core sets
     * topo->tune only where it was measured: this host, this transport, one node) replaces the
     * built-in rules; where it has no choice, or its choice cannot run these arguments (the
     * measurement used other counts), its fitted model (m) decides. */
    one_node = args->topo == NULL || args->topo->nnodes == 1;
    tuned    = NULL;
    if (!found && !model_only && args->topo != NULL && args->topo->tune != NULL && one_node)
        tuned = xccl_tune_lookup(args->topo->tune, args->coll, size, nbytes);
    if (tuned != NULL) {
        const xccl_algo_t *a = xccl_algo_find(args->coll, tuned);
        if (a != NULL && usable(a, args, size)) {
            *source = "table";
            *out    = a;
            return XCCL_OK;
        }
    }
    *source = "rule";
    /* Device memory on one host whose executor maps it between processes: "devmap" at every
     * size (the device moves each byte once, peer to peer; the message-based schedules would
     * move it through a transport). */
    if (!found && !model_only && size > 1 && args->mem != XCCL_MEM_HOST) {
        const xccl_algo_t *a = xccl_algo_find(args->coll, "devmap");
        if (a != NULL && usable(a, args, size)) {
            *out = a;
            return XCCL_OK;
        }
    }
    /* One host sharing a segment (topo->shared, task.h), from ONE_HOST_MIN_RANKS ranks: the
     * one-host algorithms replace the message-based schedules - "shm" (segment slots) where
     * the call fits its slots, else "cma" (cross-memory reads) where the OS allows; otherwise
     * the rules below. Below that size the message-based rules stay: at np=2 and 4 on the
     * 2-core VM they were as fast or faster at most sizes (e.g. np=2 all_gather 32 KiB-1 MiB
     * 3.5-47 us against cma's 6.8-68, broadcast 8 B 0.65 against shm's 1.0 us). Not measured
     * on a many-core host yet; a tuning table replaces this block. */
    if (!found && !model_only && size >= ONE_HOST_MIN_RANKS && args->topo != NULL &&
        args->topo->tune == NULL &&
        (args->topo->shared & XCCL_SHARED_SEG)) {
        static const char *const one_host[] = {"shm", "cma"};
        for (size_t i = 0; i < sizeof(one_host) / sizeof(one_host[0]); i++) {
            const xccl_algo_t *a = xccl_algo_find(args->coll, one_host[i]);
            if (a == NULL || (a->applicable != NULL && !a->applicable(args, size))) continue;
            /* all_to_all_v's slots hold small blocks only: beyond them it needs CMA */
            if (args->coll == XCCL_COLL_ALLTOALLV && !(args->topo->shared & XCCL_SHARED_CMA))
                continue;
            /* all_reduce by cross-memory reads lost to the message-based rules below at every
             * size from 32 KiB to 16 MiB on the 2-core VM (np=2: 60-99 vs 27-32 us at 256
             * KiB, 2.9-3.3 vs 2.0-2.4 ms at 16 MiB): forced only, until measured elsewhere */
            if (args->coll == XCCL_COLL_ALLREDUCE && strcmp(one_host[i], "cma") == 0) continue;
            *out = a;
            return XCCL_OK;
        }
    }
    for (size_t i = 0; !found && !model_only && one_node && size > 1 &&
                       (args->topo == NULL || args->topo->tune == NULL) &&
                       i < sizeof(builtin_rules) / sizeof(builtin_rules[0]);
         i++) {
        const struct builtin_rule *b = &builtin_rules[i];
        const xccl_algo_t         *a;
        if (b->coll != args->coll || nbytes < b->lo || nbytes > b->hi) continue;
        if (size < b->min_ranks || size > b->max_ranks) continue;
        if (b->pull && (args->topo == NULL || !args->topo->pull)) continue;
        if (b->scarce && (args->topo == NULL || !args->topo->scarce)) continue;
        a = xccl_algo_find(args->coll, b->algo); /* by name only once a rule applies */
        if (a == NULL || !usable(a, args, size)) continue;
        *out = a;
        return XCCL_OK;
    }

    *source = "model";
    list    = xccl_algo_list(args->coll);
    for (int i = 0; list[i] != NULL; i++) {
        double t;
        if (!usable(list[i], args, size)) continue;
        /* below ONE_HOST_MIN_RANKS the one-host algorithms run when forced, asked of the model
         * itself ("auto") or chosen by a tuning table, not by default (see the block above) */
        if (list[i]->shared && !model_only && size < ONE_HOST_MIN_RANKS &&
            (args->topo == NULL || args->topo->tune == NULL))
            continue;
        t = xccl_algo_predict_args(list[i], args, m, size, nbytes);
        if (best == NULL || t < best_t) {
            best   = list[i];
            best_t = t;
        }
    }
    if (best == NULL)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                          "%s: no algorithm can run %d ranks with count %zu of %s",
                          xccl_coll_name(args->coll), size, args->count,
                          xccl_dtype_name(args->dtype));
    *out = best;
    return XCCL_OK;
}

xccl_status_t xccl_algo_select(const xccl_coll_args_t *args, int size, size_t nbytes,
                               const xccl_cost_model_t *m, const char *forced,
                               const xccl_algo_t **out)
{
    const char *source;

    return xccl_algo_select_source(args, size, nbytes, m, forced, out, &source);
}

static struct xccl_algo_memo_slot *memo_slot(xccl_algo_memo_t *memo, const xccl_coll_args_t *a,
                                             size_t nbytes)
{
    uint64_t h = (uint64_t)nbytes * 0x9E3779B97F4A7C15ull ^ (uint64_t)a->count * 0xC2B2AE3Dull ^
                 ((uint64_t)a->coll << 7) ^ a->elsize;

    return &memo->slot[(h ^ (h >> 29)) % XCCL_ALGO_MEMO_SLOTS];
}

xccl_status_t xccl_algo_select_memo(xccl_algo_memo_t *memo, const xccl_coll_args_t *args,
                                    int size, size_t nbytes, const xccl_cost_model_t *m,
                                    const char *forced, const xccl_algo_t **out)
{
    struct xccl_algo_memo_slot *s;
    xccl_status_t               st;
    unsigned                    gen;

    /* device calls are not remembered: the memo's key has no memory type, and the one-host
     * algorithms (host memory only) are applicable to host calls of the same shape */
    if (memo == NULL || forced != NULL || args == NULL || out == NULL ||
        args->mem != XCCL_MEM_HOST)
        return xccl_algo_select(args, size, nbytes, m, forced, out);
    s = memo_slot(memo, args, nbytes);
    pthread_mutex_lock(&env_lock);
    if (!env_parsed) parse_env();
    gen = env_gen;
    if (s->algo != NULL && s->gen == gen && s->coll == args->coll && s->nbytes == nbytes &&
        s->count == args->count && s->elsize == args->elsize) {
        *out = s->algo;
        pthread_mutex_unlock(&env_lock);
        return XCCL_OK;
    }
    pthread_mutex_unlock(&env_lock);
    st = xccl_algo_select(args, size, nbytes, m, NULL, out);
    if (st != XCCL_OK) return st;
    pthread_mutex_lock(&env_lock);
    if (gen == env_gen) /* not chosen under rules that were replaced meanwhile */
        *s = (struct xccl_algo_memo_slot){.algo   = *out,
                                          .nbytes = nbytes,
                                          .count  = args->count,
                                          .elsize = args->elsize,
                                          .gen    = gen,
                                          .coll   = args->coll};
    pthread_mutex_unlock(&env_lock);
    return XCCL_OK;
}
