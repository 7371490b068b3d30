/* SPDX-License-Identifier: Apache-2.0
 *
 * store.c - the public store functions (argument checks, default timeouts, refcounting, then
 * dispatch through the vtable), the byte-keyed map shared by the stores, and three stores:
 * hash (in-process), prefix (a key namespace over another store) and custom (user callbacks).
 */
#include "core/store.h"

#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/check.h"

/* ---------------------------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------------------------- */

void *xccl_store_memdup(const void *p, size_t len)
{
    void *q = malloc(len > 0 ? len : 1);

    if (q != NULL && len > 0) memcpy(q, p, len);
    return q;
}

int64_t xccl_store_default_timeout(void)
{
    int64_t t = xccl_env_int("XCCL_STORE_TIMEOUT_MS", XCCL_STORE_DEFAULT_TIMEOUT_MS);

    return t >= 0 ? t : XCCL_STORE_DEFAULT_TIMEOUT_MS;
}

void xccl_store_init(xccl_store_t *s, const xccl_store_vtable_t *vt, int64_t timeout_ms)
{
    s->vt = vt;
    atomic_init(&s->refcount, 1);
    atomic_init(&s->timeout_ms, timeout_ms >= 0 ? timeout_ms : xccl_store_default_timeout());
    s->inherit = NULL;
}

void xccl_store_format_keys(char *buf, size_t buflen, const char *const *keys, size_t nkeys)
{
    size_t used = 0;
    size_t i;

    if (buflen == 0) return;
    buf[0] = '\0';
    for (i = 0; i < nkeys; i++) {
        size_t klen  = strlen(keys[i]);
        int    shown = klen > 128 ? 128 : (int)klen;
        char   item[160];
        int    n = snprintf(item, sizeof(item), "%s'%.*s%s'", i ? ", " : "", shown, keys[i],
                            klen > 128 ? "..." : "");

        /* keep room for the " and N more" tail */
        if (used + (size_t)n + 32 >= buflen) {
            snprintf(buf + used, buflen - used, " and %zu more", nkeys - i);
            return;
        }
        memcpy(buf + used, item, (size_t)n + 1);
        used += (size_t)n;
    }
}

/* Absolute CLOCK_MONOTONIC time for pthread_cond_timedwait. */
static struct timespec deadline_ts(int64_t deadline_ms)
{
    struct timespec ts;

    ts.tv_sec  = (time_t)(deadline_ms / 1000);
    ts.tv_nsec = (long)(deadline_ms % 1000) * 1000000L;
    return ts;
}

static int64_t deadline_after(int64_t timeout_ms)
{
    int64_t now = xccl_now_ms();

    return timeout_ms > INT64_MAX - now ? INT64_MAX : now + timeout_ms;
}

/* ---------------------------------------------------------------------------------------------
 * xccl_kvmap: chained hash map, FNV-1a hashing, doubles when the load factor reaches 1.
 * ------------------------------------------------------------------------------------------- */

static uint64_t fnv1a(const char *p, size_t len)
{
    uint64_t h = 1469598103934665603ull;
    size_t   i;

    for (i = 0; i < len; i++) {
        h ^= (uint8_t)p[i];
        h *= 1099511628211ull;
    }
    return h;
}

void xccl_kvmap_init(xccl_kvmap_t *m)
{
    m->buckets  = NULL;
    m->nbuckets = 0;
    m->count    = 0;
}

static void entry_free(xccl_kv_entry_t *e)
{
    free(e->key);
    free(e->val);
    free(e);
}

void xccl_kvmap_free(xccl_kvmap_t *m)
{
    size_t i;

    for (i = 0; i < m->nbuckets; i++) {
        xccl_kv_entry_t *e = m->buckets[i];
        while (e != NULL) {
            xccl_kv_entry_t *next = e->next;
            entry_free(e);
            e = next;
        }
    }
    free(m->buckets);
    xccl_kvmap_init(m);
}

xccl_kv_entry_t *xccl_kvmap_find(const xccl_kvmap_t *m, const char *key, size_t klen)
{
    uint64_t         h;
    xccl_kv_entry_t *e;

    if (m->nbuckets == 0) return NULL;
    h = fnv1a(key, klen);
    for (e = m->buckets[h & (m->nbuckets - 1)]; e != NULL; e = e->next)
        if (e->hash == h && e->klen == klen && memcmp(e->key, key, klen) == 0) return e;
    return NULL;
}

static xccl_status_t kvmap_grow(xccl_kvmap_t *m)
{
    size_t            n = m->nbuckets ? m->nbuckets * 2 : 16;
    xccl_kv_entry_t **b = calloc(n, sizeof(*b));
    size_t            i;

    if (b == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "store: hash table of %zu buckets", n);
    for (i = 0; i < m->nbuckets; i++) {
        xccl_kv_entry_t *e = m->buckets[i];
        while (e != NULL) {
            xccl_kv_entry_t *next = e->next;
            e->next               = b[e->hash & (n - 1)];
            b[e->hash & (n - 1)]  = e;
            e                     = next;
        }
    }
    free(m->buckets);
    m->buckets  = b;
    m->nbuckets = n;
    return XCCL_OK;
}

xccl_status_t xccl_kvmap_set(xccl_kvmap_t *m, const char *key, size_t klen, const void *val,
                             size_t vlen)
{
    xccl_kv_entry_t *e = xccl_kvmap_find(m, key, klen);
    uint8_t         *v = xccl_store_memdup(val, vlen);

    if (v == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "store: value of %zu bytes", vlen);
    if (e != NULL) {
        free(e->val);
        e->val  = v;
        e->vlen = vlen;
        return XCCL_OK;
    }
    if (m->count >= m->nbuckets) {
        xccl_status_t st = kvmap_grow(m);
        if (st != XCCL_OK) {
            free(v);
            return st;
        }
    }
    e = calloc(1, sizeof(*e));
    if (e == NULL || (e->key = malloc(klen + 1)) == NULL) {
        free(e);
        free(v);
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "store: key of %zu bytes", klen);
    }
    memcpy(e->key, key, klen);
    e->key[klen]                       = '\0';
    e->klen                            = klen;
    e->val                             = v;
    e->vlen                            = vlen;
    e->hash                            = fnv1a(key, klen);
    e->next                            = m->buckets[e->hash & (m->nbuckets - 1)];
    m->buckets[e->hash & (m->nbuckets - 1)] = e;
    m->count++;
    return XCCL_OK;
}

int xccl_kvmap_delete(xccl_kvmap_t *m, const char *key, size_t klen)
{
    uint64_t          h;
    xccl_kv_entry_t **pp;

    if (m->nbuckets == 0) return 0;
    h = fnv1a(key, klen);
    for (pp = &m->buckets[h & (m->nbuckets - 1)]; *pp != NULL; pp = &(*pp)->next) {
        xccl_kv_entry_t *e = *pp;
        if (e->hash == h && e->klen == klen && memcmp(e->key, key, klen) == 0) {
            *pp = e->next;
            entry_free(e);
            m->count--;
            return 1;
        }
    }
    return 0;
}

/* Parses [+-]digits exactly (what the add operation itself writes, plus a leading '+'). */
static int parse_int64(const uint8_t *p, size_t len, int64_t *out)
{
    size_t  i   = 0;
    int     neg = 0;
    int64_t v   = 0;

    if (len > 0 && (p[0] == '-' || p[0] == '+')) {
        neg = p[0] == '-';
        i   = 1;
    }
    if (i == len) return -1;
    for (; i < len; i++) {
        if (p[i] < '0' || p[i] > '9') return -1;
        /* accumulate negatively so INT64_MIN parses */
        if (__builtin_mul_overflow(v, 10, &v) || __builtin_sub_overflow(v, p[i] - '0', &v))
            return -1;
    }
    if (!neg && __builtin_mul_overflow(v, -1, &v)) return -1;
    *out = v;
    return 0;
}

xccl_status_t xccl_kvmap_add(xccl_kvmap_t *m, const char *key, size_t klen, int64_t delta,
                             int64_t *result)
{
    xccl_kv_entry_t *e   = xccl_kvmap_find(m, key, klen);
    int64_t          cur = 0;
    int64_t          sum;
    char             text[32];
    int              n;

    if (e != NULL && parse_int64(e->val, e->vlen, &cur) != 0)
        return XCCL_ERROR(XCCL_ERR_INVALID_USAGE,
                          "store add('%.*s'): the key holds a %zu-byte value that is not a "
                          "decimal integer",
                          (int)(klen > 128 ? 128 : klen), key, e->vlen);
    if (__builtin_add_overflow(cur, delta, &sum))
        return XCCL_ERROR(XCCL_ERR_INVALID_USAGE,
                          "store add('%.*s'): %" PRId64 " + %" PRId64 " overflows int64",
                          (int)(klen > 128 ? 128 : klen), key, cur, delta);
    n = snprintf(text, sizeof(text), "%" PRId64, sum);
    XCCL_CHECK(xccl_kvmap_set(m, key, klen, text, (size_t)n));
    *result = sum;
    return XCCL_OK;
}

xccl_status_t xccl_kvmap_compare_set(xccl_kvmap_t *m, const char *key, size_t klen,
                                     const void *expected, size_t elen, const void *desired,
                                     size_t dlen, void **out, size_t *outlen, int *changed)
{
    xccl_kv_entry_t *e = xccl_kvmap_find(m, key, klen);
    const void      *show;
    size_t           showlen;

    *changed = 0;
    if ((e == NULL && elen == 0) ||
        (e != NULL && e->vlen == elen && (elen == 0 || memcmp(e->val, expected, elen) == 0))) {
        XCCL_CHECK(xccl_kvmap_set(m, key, klen, desired, dlen));
        *changed = 1;
        show     = desired;
        showlen  = dlen;
    } else if (e == NULL) {
        show    = expected;
        showlen = elen;
    } else {
        show    = e->val;
        showlen = e->vlen;
    }
    *out = xccl_store_memdup(show, showlen);
    if (*out == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "store: value of %zu bytes", showlen);
    *outlen = showlen;
    return XCCL_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Public dispatch
 * ------------------------------------------------------------------------------------------- */

static xccl_status_t check_store(const xccl_store_t *s, const char *op)
{
    if (s == NULL) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "store %s: store is NULL", op);
    return XCCL_OK;
}

static xccl_status_t check_key(const char *op, const char *key)
{
    size_t klen;

    if (key == NULL) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "store %s: key is NULL", op);
    klen = strnlen(key, XCCL_STORE_MAX_KEY + 1);
    if (klen > XCCL_STORE_MAX_KEY)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                          "store %s('%.64s...'): key longer than the limit of %u bytes", op, key,
                          XCCL_STORE_MAX_KEY);
    return XCCL_OK;
}

static xccl_status_t check_keys(const char *op, const char *const *keys, size_t nkeys)
{
    size_t i;

    if (nkeys > 0 && keys == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "store %s: keys is NULL", op);
    for (i = 0; i < nkeys; i++) XCCL_CHECK(check_key(op, keys[i]));
    return XCCL_OK;
}

static xccl_status_t check_value(const char *op, const char *key, const void *val, size_t len)
{
    if (val == NULL && len > 0)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "store %s('%.128s'): value is NULL", op, key);
    if (len > XCCL_STORE_MAX_VALUE)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                          "store %s('%.128s'): value of %zu bytes exceeds the limit of %u", op,
                          key, len, XCCL_STORE_MAX_VALUE);
    return XCCL_OK;
}

static xccl_status_t no_op(const xccl_store_t *s, const char *op)
{
    return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED, "%s store does not implement %s", s->vt->kind, op);
}

int64_t xccl_store_get_timeout(const xccl_store_t *s)
{
    while (s != NULL) {
        int64_t t = atomic_load(&s->timeout_ms);
        if (t >= 0) return t;
        s = s->inherit;
    }
    return xccl_store_default_timeout();
}

void xccl_store_set_timeout(xccl_store_t *s, int64_t timeout_ms)
{
    if (s == NULL) return;
    /* a prefix store given a negative timeout goes back to following its base */
    if (timeout_ms < 0 && s->inherit == NULL) timeout_ms = xccl_store_default_timeout();
    atomic_store(&s->timeout_ms, timeout_ms < 0 ? -1 : timeout_ms);
}

static int64_t resolve_timeout(const xccl_store_t *s, int64_t timeout_ms)
{
    return timeout_ms >= 0 ? timeout_ms : xccl_store_get_timeout(s);
}

void xccl_store_retain(xccl_store_t *s)
{
    if (s != NULL) atomic_fetch_add(&s->refcount, 1);
}

void xccl_store_release(xccl_store_t *s)
{
    if (s != NULL && atomic_fetch_sub(&s->refcount, 1) == 1) s->vt->destroy(s);
}

xccl_status_t xccl_store_set(xccl_store_t *s, const char *key, const void *val, size_t len)
{
    XCCL_CHECK(check_store(s, "set"));
    XCCL_CHECK(check_key("set", key));
    XCCL_CHECK(check_value("set", key, val, len));
    if (s->vt->set == NULL) return no_op(s, "set");
    return s->vt->set(s, key, val, len);
}

xccl_status_t xccl_store_get(xccl_store_t *s, const char *key, int64_t timeout_ms, void **val,
                             size_t *len)
{
    XCCL_CHECK(check_store(s, "get"));
    XCCL_CHECK(check_key("get", key));
    if (val == NULL || len == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "store get('%.128s'): NULL output", key);
    *val = NULL;
    *len = 0;
    if (s->vt->get == NULL) return no_op(s, "get");
    return s->vt->get(s, key, resolve_timeout(s, timeout_ms), val, len);
}

xccl_status_t xccl_store_add(xccl_store_t *s, const char *key, int64_t delta, int64_t *result)
{
    int64_t dummy;

    XCCL_CHECK(check_store(s, "add"));
    XCCL_CHECK(check_key("add", key));
    if (s->vt->add == NULL) return no_op(s, "add");
    return s->vt->add(s, key, delta, result ? result : &dummy);
}

xccl_status_t xccl_store_wait(xccl_store_t *s, const char *const *keys, size_t nkeys,
                              int64_t timeout_ms)
{
    XCCL_CHECK(check_store(s, "wait"));
    XCCL_CHECK(check_keys("wait", keys, nkeys));
    if (s->vt->wait == NULL) return no_op(s, "wait");
    if (nkeys == 0) return XCCL_OK;
    return s->vt->wait(s, keys, nkeys, resolve_timeout(s, timeout_ms));
}

xccl_status_t xccl_store_check(xccl_store_t *s, const char *const *keys, size_t nkeys,
                               int *all_present)
{
    XCCL_CHECK(check_store(s, "check"));
    XCCL_CHECK(check_keys("check", keys, nkeys));
    if (all_present == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "store check: NULL output");
    if (s->vt->check == NULL) return no_op(s, "check");
    *all_present = 1;
    if (nkeys == 0) return XCCL_OK;
    return s->vt->check(s, keys, nkeys, all_present);
}

xccl_status_t xccl_store_compare_set(xccl_store_t *s, const char *key, const void *expected,
                                     size_t elen, const void *desired, size_t dlen, void **out,
                                     size_t *outlen)
{
    XCCL_CHECK(check_store(s, "compare_set"));
    XCCL_CHECK(check_key("compare_set", key));
    XCCL_CHECK(check_value("compare_set", key, expected, elen));
    XCCL_CHECK(check_value("compare_set", key, desired, dlen));
    if (out == NULL || outlen == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "store compare_set('%.128s'): NULL output", key);
    *out    = NULL;
    *outlen = 0;
    if (s->vt->compare_set == NULL) return no_op(s, "compare_set");
    return s->vt->compare_set(s, key, expected, elen, desired, dlen, out, outlen);
}

xccl_status_t xccl_store_delete_key(xccl_store_t *s, const char *key, int *deleted)
{
    int dummy;

    XCCL_CHECK(check_store(s, "delete_key"));
    XCCL_CHECK(check_key("delete_key", key));
    if (s->vt->delete_key == NULL) return no_op(s, "delete_key");
    return s->vt->delete_key(s, key, deleted ? deleted : &dummy);
}

xccl_status_t xccl_store_num_keys(xccl_store_t *s, int64_t *n)
{
    XCCL_CHECK(check_store(s, "num_keys"));
    if (n == NULL) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "store num_keys: NULL output");
    if (s->vt->num_keys == NULL) return no_op(s, "num_keys");
    return s->vt->num_keys(s, n);
}

/* ---------------------------------------------------------------------------------------------
 * Hash store: one map under a mutex; a condition variable (CLOCK_MONOTONIC) is broadcast on
 * every write, and get/wait re-check their keys after each wake-up.
 * ------------------------------------------------------------------------------------------- */

typedef struct hash_store {
    xccl_store_t    base;
    pthread_mutex_t lock;
    pthread_cond_t  changed;
    xccl_kvmap_t    map;
} hash_store_t;

/* Waits on `changed` until the deadline; returns 0 when the deadline has passed. Called with
 * the lock held. */
static int hash_wait_until(hash_store_t *h, int64_t deadline_ms)
{
    struct timespec ts;

    if (xccl_now_ms() >= deadline_ms) return 0;
    ts = deadline_ts(deadline_ms);
    pthread_cond_timedwait(&h->changed, &h->lock, &ts);
    return 1;
}

static xccl_status_t hash_set(xccl_store_t *s, const char *key, const void *val, size_t len)
{
    hash_store_t *h = (hash_store_t *)s;
    xccl_status_t st;

    pthread_mutex_lock(&h->lock);
    st = xccl_kvmap_set(&h->map, key, strlen(key), val, len);
    pthread_cond_broadcast(&h->changed);
    pthread_mutex_unlock(&h->lock);
    return st;
}

static xccl_status_t hash_get(xccl_store_t *s, const char *key, int64_t timeout_ms, void **val,
                              size_t *len)
{
    hash_store_t    *h        = (hash_store_t *)s;
    int64_t          start    = xccl_now_ms();
    int64_t          deadline = deadline_after(timeout_ms);
    xccl_kv_entry_t *e;
    xccl_status_t    st = XCCL_OK;

    pthread_mutex_lock(&h->lock);
    while ((e = xccl_kvmap_find(&h->map, key, strlen(key))) == NULL) {
        if (!hash_wait_until(h, deadline)) {
            pthread_mutex_unlock(&h->lock);
            return XCCL_ERROR(XCCL_ERR_TIMEOUT,
                              "hash store: get('%.128s') timed out after %" PRId64
                              " ms: key '%.128s' was not set",
                              key, xccl_now_ms() - start, key);
        }
    }
    *val = xccl_store_memdup(e->val, e->vlen);
    if (*val == NULL) st = XCCL_ERROR(XCCL_ERR_NO_MEMORY, "hash store: value of %zu bytes",
                                      e->vlen);
    else *len = e->vlen;
    pthread_mutex_unlock(&h->lock);
    return st;
}

static xccl_status_t hash_add(xccl_store_t *s, const char *key, int64_t delta, int64_t *result)
{
    hash_store_t *h = (hash_store_t *)s;
    xccl_status_t st;

    pthread_mutex_lock(&h->lock);
    st = xccl_kvmap_add(&h->map, key, strlen(key), delta, result);
    pthread_cond_broadcast(&h->changed);
    pthread_mutex_unlock(&h->lock);
    return st;
}

/* Writes the keys not in the map into missing[] and returns how many. Lock held. */
static size_t hash_missing(hash_store_t *h, const char *const *keys, size_t nkeys,
                           const char **missing)
{
    size_t i, n = 0;

    for (i = 0; i < nkeys; i++)
        if (xccl_kvmap_find(&h->map, keys[i], strlen(keys[i])) == NULL) {
            if (missing != NULL) missing[n] = keys[i];
            n++;
        }
    return n;
}

static xccl_status_t hash_wait(xccl_store_t *s, const char *const *keys, size_t nkeys,
                               int64_t timeout_ms)
{
    hash_store_t *h        = (hash_store_t *)s;
    int64_t       start    = xccl_now_ms();
    int64_t       deadline = deadline_after(timeout_ms);
    const char  **missing;
    size_t        n;
    char          list[1200];

    pthread_mutex_lock(&h->lock);
    while (hash_missing(h, keys, nkeys, NULL) > 0) {
        if (hash_wait_until(h, deadline)) continue;
        missing = malloc(nkeys * sizeof(*missing));
        if (missing == NULL) {
            pthread_mutex_unlock(&h->lock);
            return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "hash store: wait for %zu keys", nkeys);
        }
        n = hash_missing(h, keys, nkeys, missing);
        pthread_mutex_unlock(&h->lock);
        xccl_store_format_keys(list, sizeof(list), missing, n);
        free(missing);
        return XCCL_ERROR(XCCL_ERR_TIMEOUT,
                          "hash store: wait timed out after %" PRId64
                          " ms; %zu of %zu keys missing: %s",
                          xccl_now_ms() - start, n, nkeys, list);
    }
    pthread_mutex_unlock(&h->lock);
    return XCCL_OK;
}

static xccl_status_t hash_check(xccl_store_t *s, const char *const *keys, size_t nkeys,
                                int *all_present)
{
    hash_store_t *h = (hash_store_t *)s;

    pthread_mutex_lock(&h->lock);
    *all_present = hash_missing(h, keys, nkeys, NULL) == 0;
    pthread_mutex_unlock(&h->lock);
    return XCCL_OK;
}

static xccl_status_t hash_compare_set(xccl_store_t *s, const char *key, const void *expected,
                                      size_t elen, const void *desired, size_t dlen, void **out,
                                      size_t *outlen)
{
    hash_store_t *h = (hash_store_t *)s;
    xccl_status_t st;
    int           changed;

    pthread_mutex_lock(&h->lock);
    st = xccl_kvmap_compare_set(&h->map, key, strlen(key), expected, elen, desired, dlen, out,
                                outlen, &changed);
    if (changed) pthread_cond_broadcast(&h->changed);
    pthread_mutex_unlock(&h->lock);
    return st;
}

static xccl_status_t hash_delete_key(xccl_store_t *s, const char *key, int *deleted)
{
    hash_store_t *h = (hash_store_t *)s;

    pthread_mutex_lock(&h->lock);
    *deleted = xccl_kvmap_delete(&h->map, key, strlen(key));
    pthread_mutex_unlock(&h->lock);
    return XCCL_OK;
}

static xccl_status_t hash_num_keys(xccl_store_t *s, int64_t *n)
{
    hash_store_t *h = (hash_store_t *)s;

    pthread_mutex_lock(&h->lock);
    *n = (int64_t)h->map.count;
    pthread_mutex_unlock(&h->lock);
    return XCCL_OK;
}

static void hash_destroy(xccl_store_t *s)
{
    hash_store_t *h = (hash_store_t *)s;

    xccl_kvmap_free(&h->map);
    pthread_cond_destroy(&h->changed);
    pthread_mutex_destroy(&h->lock);
    free(h);
}

static const xccl_store_vtable_t hash_vtable = {
    .kind        = "hash",
    .set         = hash_set,
    .get         = hash_get,
    .add         = hash_add,
    .wait        = hash_wait,
    .check       = hash_check,
    .compare_set = hash_compare_set,
    .delete_key  = hash_delete_key,
    .num_keys    = hash_num_keys,
    .destroy     = hash_destroy,
};

xccl_status_t xccl_store_hash_create(int64_t timeout_ms, xccl_store_t **out)
{
    hash_store_t      *h;
    pthread_condattr_t ca;

    if (out == NULL) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "hash store: out is NULL");
    h = calloc(1, sizeof(*h));
    if (h == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "hash store: %zu bytes", sizeof(*h));
    xccl_store_init(&h->base, &hash_vtable, timeout_ms);
    xccl_kvmap_init(&h->map);
    pthread_mutex_init(&h->lock, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&h->changed, &ca);
    pthread_condattr_destroy(&ca);
    *out = &h->base;
    return XCCL_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Prefix store: "prefix/key" on the base store, through the public functions (so the base's
 * own checks apply to the full key). Its default timeout follows the base until set.
 * ------------------------------------------------------------------------------------------- */

typedef struct prefix_store {
    xccl_store_t  base;
    xccl_store_t *inner;
    char         *prefix;
    size_t        plen;
} prefix_store_t;

/* malloc'd "prefix/key"; NULL when out of memory (reported). */
static char *prefixed(const prefix_store_t *p, const char *key)
{
    size_t klen = strlen(key);
    char  *full = malloc(p->plen + 1 + klen + 1);

    if (full == NULL) {
        XCCL_ERROR(XCCL_ERR_NO_MEMORY, "prefix store: key of %zu bytes", p->plen + 1 + klen);
        return NULL;
    }
    memcpy(full, p->prefix, p->plen);
    full[p->plen] = '/';
    memcpy(full + p->plen + 1, key, klen + 1);
    return full;
}

static void free_keys(char **keys, size_t n)
{
    size_t i;

    if (keys == NULL) return;
    for (i = 0; i < n; i++) free(keys[i]);
    free(keys);
}

static char **prefixed_all(const prefix_store_t *p, const char *const *keys, size_t nkeys)
{
    char **full = calloc(nkeys ? nkeys : 1, sizeof(*full));
    size_t i;

    if (full == NULL) {
        XCCL_ERROR(XCCL_ERR_NO_MEMORY, "prefix store: %zu keys", nkeys);
        return NULL;
    }
    for (i = 0; i < nkeys; i++) {
        full[i] = prefixed(p, keys[i]);
        if (full[i] == NULL) {
            free_keys(full, i);
            return NULL;
        }
    }
    return full;
}

static xccl_status_t prefix_set(xccl_store_t *s, const char *key, const void *val, size_t len)
{
    prefix_store_t *p    = (prefix_store_t *)s;
    char           *full = prefixed(p, key);
    xccl_status_t   st;

    if (full == NULL) return XCCL_ERR_NO_MEMORY;
    st = xccl_store_set(p->inner, full, val, len);
    free(full);
    return st;
}

static xccl_status_t prefix_get(xccl_store_t *s, const char *key, int64_t timeout_ms, void **val,
                                size_t *len)
{
    prefix_store_t *p    = (prefix_store_t *)s;
    char           *full = prefixed(p, key);
    xccl_status_t   st;

    if (full == NULL) return XCCL_ERR_NO_MEMORY;
    st = xccl_store_get(p->inner, full, timeout_ms, val, len);
    free(full);
    return st;
}

static xccl_status_t prefix_add(xccl_store_t *s, const char *key, int64_t delta, int64_t *result)
{
    prefix_store_t *p    = (prefix_store_t *)s;
    char           *full = prefixed(p, key);
    xccl_status_t   st;

    if (full == NULL) return XCCL_ERR_NO_MEMORY;
    st = xccl_store_add(p->inner, full, delta, result);
    free(full);
    return st;
}

static xccl_status_t prefix_wait(xccl_store_t *s, const char *const *keys, size_t nkeys,
                                 int64_t timeout_ms)
{
    prefix_store_t *p    = (prefix_store_t *)s;
    char          **full = prefixed_all(p, keys, nkeys);
    xccl_status_t   st;

    if (full == NULL) return XCCL_ERR_NO_MEMORY;
    st = xccl_store_wait(p->inner, (const char *const *)full, nkeys, timeout_ms);
    free_keys(full, nkeys);
    return st;
}

static xccl_status_t prefix_check(xccl_store_t *s, const char *const *keys, size_t nkeys,
                                  int *all_present)
{
    prefix_store_t *p    = (prefix_store_t *)s;
    char          **full = prefixed_all(p, keys, nkeys);
    xccl_status_t   st;

    if (full == NULL) return XCCL_ERR_NO_MEMORY;
    st = xccl_store_check(p->inner, (const char *const *)full, nkeys, all_present);
    free_keys(full, nkeys);
    return st;
}

static xccl_status_t prefix_compare_set(xccl_store_t *s, const char *key, const void *expected,
                                        size_t elen, const void *desired, size_t dlen,
                                        void **out, size_t *outlen)
{
    prefix_store_t *p    = (prefix_store_t *)s;
    char           *full = prefixed(p, key);
    xccl_status_t   st;

    if (full == NULL) return XCCL_ERR_NO_MEMORY;
    st = xccl_store_compare_set(p->inner, full, expected, elen, desired, dlen, out, outlen);
    free(full);
    return st;
}

static xccl_status_t prefix_delete_key(xccl_store_t *s, const char *key, int *deleted)
{
    prefix_store_t *p    = (prefix_store_t *)s;
    char           *full = prefixed(p, key);
    xccl_status_t   st;

    if (full == NULL) return XCCL_ERR_NO_MEMORY;
    st = xccl_store_delete_key(p->inner, full, deleted);
    free(full);
    return st;
}

/* Like torch's PrefixStore: the count of the whole base store (a store cannot count one
 * prefix without listing keys, which the store interface does not have). */
static xccl_status_t prefix_num_keys(xccl_store_t *s, int64_t *n)
{
    return xccl_store_num_keys(((prefix_store_t *)s)->inner, n);
}

static void prefix_destroy(xccl_store_t *s)
{
    prefix_store_t *p = (prefix_store_t *)s;

    xccl_store_release(p->inner);
    free(p->prefix);
    free(p);
}

static const xccl_store_vtable_t prefix_vtable = {
    .kind        = "prefix",
    .set         = prefix_set,
    .get         = prefix_get,
    .add         = prefix_add,
    .wait        = prefix_wait,
    .check       = prefix_check,
    .compare_set = prefix_compare_set,
    .delete_key  = prefix_delete_key,
    .num_keys    = prefix_num_keys,
    .destroy     = prefix_destroy,
};

xccl_status_t xccl_store_prefix_create(const char *prefix, xccl_store_t *base,
                                       xccl_store_t **out)
{
    prefix_store_t *p;

    if (prefix == NULL || base == NULL || out == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "prefix store: %s is NULL",
                          prefix == NULL ? "prefix" : base == NULL ? "base" : "out");
    p = calloc(1, sizeof(*p));
    if (p == NULL || (p->prefix = strdup(prefix)) == NULL) {
        free(p);
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "prefix store '%.128s'", prefix);
    }
    xccl_store_init(&p->base, &prefix_vtable, 0);
    atomic_store(&p->base.timeout_ms, -1);
    p->base.inherit = base;
    p->plen         = strlen(prefix);
    p->inner        = base;
    xccl_store_retain(base);
    *out = &p->base;
    return XCCL_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Custom store: the caller's callbacks. A callback that fails without leaving a message in
 * xccl_last_error() (e.g. one written in Python, which cannot) gets a generic one.
 * ------------------------------------------------------------------------------------------- */

typedef struct custom_store {
    xccl_store_t     base;
    xccl_store_ops_t ops;
    void            *ctx;
} custom_store_t;

static void custom_pre(void)
{
    xccl_error_set(XCCL_OK, "%s", "");
}

static xccl_status_t custom_post(xccl_status_t st, const char *op, const char *key)
{
    if (st >= 0 || xccl_last_error()[0] != '\0') return st;
    return XCCL_ERROR(st, "custom store: %s%s%.128s%s failed (%s)", op, key ? "('" : "",
                      key ? key : "", key ? "')" : "", xccl_status_string(st));
}

static xccl_status_t custom_set(xccl_store_t *s, const char *key, const void *val, size_t len)
{
    custom_store_t *c = (custom_store_t *)s;

    if (c->ops.set == NULL) return no_op(s, "set");
    custom_pre();
    return custom_post(c->ops.set(c->ctx, key, val, len), "set", key);
}

static xccl_status_t custom_get(xccl_store_t *s, const char *key, int64_t timeout_ms, void **val,
                                size_t *len)
{
    custom_store_t *c = (custom_store_t *)s;

    if (c->ops.get == NULL) return no_op(s, "get");
    custom_pre();
    return custom_post(c->ops.get(c->ctx, key, timeout_ms, val, len), "get", key);
}

static xccl_status_t custom_add(xccl_store_t *s, const char *key, int64_t delta, int64_t *result)
{
    custom_store_t *c = (custom_store_t *)s;

    if (c->ops.add == NULL) return no_op(s, "add");
    custom_pre();
    return custom_post(c->ops.add(c->ctx, key, delta, result), "add", key);
}

static xccl_status_t custom_wait(xccl_store_t *s, const char *const *keys, size_t nkeys,
                                 int64_t timeout_ms)
{
    custom_store_t *c = (custom_store_t *)s;

    if (c->ops.wait == NULL) return no_op(s, "wait");
    custom_pre();
    return custom_post(c->ops.wait(c->ctx, keys, nkeys, timeout_ms), "wait", NULL);
}

static xccl_status_t custom_check(xccl_store_t *s, const char *const *keys, size_t nkeys,
                                  int *all_present)
{
    custom_store_t *c = (custom_store_t *)s;

    if (c->ops.check == NULL) return no_op(s, "check");
    custom_pre();
    return custom_post(c->ops.check(c->ctx, keys, nkeys, all_present), "check", NULL);
}

static xccl_status_t custom_compare_set(xccl_store_t *s, const char *key, const void *expected,
                                        size_t elen, const void *desired, size_t dlen,
                                        void **out, size_t *outlen)
{
    custom_store_t *c = (custom_store_t *)s;

    if (c->ops.compare_set == NULL) return no_op(s, "compare_set");
    custom_pre();
    return custom_post(c->ops.compare_set(c->ctx, key, expected, elen, desired, dlen, out,
                                          outlen),
                       "compare_set", key);
}

static xccl_status_t custom_delete_key(xccl_store_t *s, const char *key, int *deleted)
{
    custom_store_t *c = (custom_store_t *)s;

    if (c->ops.delete_key == NULL) return no_op(s, "delete_key");
    custom_pre();
    return custom_post(c->ops.delete_key(c->ctx, key, deleted), "delete_key", key);
}

static xccl_status_t custom_num_keys(xccl_store_t *s, int64_t *n)
{
    custom_store_t *c = (custom_store_t *)s;

    if (c->ops.num_keys == NULL) return no_op(s, "num_keys");
    custom_pre();
    return custom_post(c->ops.num_keys(c->ctx, n), "num_keys", NULL);
}

static void custom_destroy(xccl_store_t *s)
{
    custom_store_t *c = (custom_store_t *)s;

    if (c->ops.release != NULL) c->ops.release(c->ctx);
    free(c);
}

static const xccl_store_vtable_t custom_vtable = {
    .kind        = "custom",
    .set         = custom_set,
    .get         = custom_get,
    .add         = custom_add,
    .wait        = custom_wait,
    .check       = custom_check,
    .compare_set = custom_compare_set,
    .delete_key  = custom_delete_key,
    .num_keys    = custom_num_keys,
    .destroy     = custom_destroy,
};

xccl_status_t xccl_store_custom_create(const xccl_store_ops_t *ops, void *ctx,
                                       int64_t timeout_ms, xccl_store_t **out)
{
    custom_store_t *c;

    if (ops == NULL || out == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "custom store: %s is NULL",
                          ops == NULL ? "ops" : "out");
    c = calloc(1, sizeof(*c));
    if (c == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "custom store: %zu bytes", sizeof(*c));
    xccl_store_init(&c->base, &custom_vtable, timeout_ms);
    c->ops = *ops;
    c->ctx = ctx;
    *out   = &c->base;
    return XCCL_OK;
}
