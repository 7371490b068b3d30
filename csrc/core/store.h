/* SPDX-License-Identifier: Apache-2.0
 *
 * store.h - the key/value store object behind xccl_store_t: a vtable per kind (hash, prefix,
 * custom in store.c; tcp in store_tcp.c; file in store_file.c) and a small byte-keyed hash map
 * with the store semantics (add, compare_set) shared by the hash store, the TCP server and the
 * file store's cache.
 */
#ifndef XCCL_CORE_STORE_H
#define XCCL_CORE_STORE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "xccl/xccl.h"

/* Limits every store enforces (the TCP protocol bounds its requests with them). */
#define XCCL_STORE_MAX_KEY   (64u * 1024u)             /* bytes of a key                    */
#define XCCL_STORE_MAX_VALUE (1024u * 1024u * 1024u)   /* bytes of a value                  */
#define XCCL_STORE_DEFAULT_TIMEOUT_MS 300000           /* torch's default store timeout     */

/* One entry per store kind. The public dispatch functions in store.c validate arguments and
 * turn a negative timeout into the store's default before calling in, so every timeout_ms an
 * implementation sees is >= 0. Every entry may block up to its timeout (or the default one)
 * and must be thread-safe. Out-buffers are malloc'd. */
typedef struct xccl_store_vtable {
    const char *kind; /* "hash", "tcp", ... (for messages) */
    xccl_status_t (*set)(xccl_store_t *s, const char *key, const void *val, size_t len);
    xccl_status_t (*get)(xccl_store_t *s, const char *key, int64_t timeout_ms, void **val,
                         size_t *len);
    xccl_status_t (*add)(xccl_store_t *s, const char *key, int64_t delta, int64_t *result);
    xccl_status_t (*wait)(xccl_store_t *s, const char *const *keys, size_t nkeys,
                          int64_t timeout_ms);
    xccl_status_t (*check)(xccl_store_t *s, const char *const *keys, size_t nkeys,
                           int *all_present);
    xccl_status_t (*compare_set)(xccl_store_t *s, const char *key, const void *expected,
                                 size_t elen, const void *desired, size_t dlen, void **out,
                                 size_t *outlen);
    xccl_status_t (*delete_key)(xccl_store_t *s, const char *key, int *deleted);
    xccl_status_t (*num_keys)(xccl_store_t *s, int64_t *n);
    /* Frees everything, the object included. Called once, at refcount 0. */
    void (*destroy)(xccl_store_t *s);
} xccl_store_vtable_t;

/* The common head of every store; each kind embeds it as its first member. */
struct xccl_store {
    const xccl_store_vtable_t *vt;
    atomic_int                 refcount;
    _Atomic int64_t            timeout_ms; /* default timeout; < 0: ask `inherit` */
    xccl_store_t              *inherit;    /* prefix stores: the base, else NULL     */
};

/* Fills the head: refcount 1, default timeout (timeout_ms < 0 there means
 * $XCCL_STORE_TIMEOUT_MS, else XCCL_STORE_DEFAULT_TIMEOUT_MS). */
void xccl_store_init(xccl_store_t *s, const xccl_store_vtable_t *vt, int64_t timeout_ms);

/* The default timeout when a create call gets timeout_ms < 0. */
int64_t xccl_store_default_timeout(void);

/* "key 'a', 'b' and 3 more" style list of keys into buf (always NUL-terminated). */
void xccl_store_format_keys(char *buf, size_t buflen, const char *const *keys, size_t nkeys);

/* ---------------------------------------------------------------------------------------------
 * xccl_kvmap: a chained hash map from byte strings to byte strings. Not thread-safe (callers
 * hold their own lock). Keys and values are copied in; entries own them. Stored keys are also
 * NUL-terminated so they can be printed.
 * ------------------------------------------------------------------------------------------- */
typedef struct xccl_kv_entry {
    struct xccl_kv_entry *next;
    uint64_t              hash;
    char                 *key;
    size_t                klen;
    uint8_t              *val;
    size_t                vlen;
} xccl_kv_entry_t;

typedef struct xccl_kvmap {
    xccl_kv_entry_t **buckets;
    size_t            nbuckets;
    size_t            count;
} xccl_kvmap_t;

void             xccl_kvmap_init(xccl_kvmap_t *m);
void             xccl_kvmap_free(xccl_kvmap_t *m); /* frees every entry; map is empty after */
xccl_kv_entry_t *xccl_kvmap_find(const xccl_kvmap_t *m, const char *key, size_t klen);
/* Inserts or replaces. */
xccl_status_t    xccl_kvmap_set(xccl_kvmap_t *m, const char *key, size_t klen, const void *val,
                                size_t vlen);
/* 1 if the key was there. */
int              xccl_kvmap_delete(xccl_kvmap_t *m, const char *key, size_t klen);
/* The add semantics: value parsed as a decimal int64 (missing = 0), delta added, stored back as
 * decimal text. XCCL_ERR_INVALID_USAGE if the value is not an integer or the sum overflows. */
xccl_status_t    xccl_kvmap_add(xccl_kvmap_t *m, const char *key, size_t klen, int64_t delta,
                                int64_t *result);
/* torch's compare_set (see xccl.h). *out (malloc'd, never NULL on success) receives the value
 * the caller should see; *changed says whether the map was written. */
xccl_status_t    xccl_kvmap_compare_set(xccl_kvmap_t *m, const char *key, size_t klen,
                                        const void *expected, size_t elen, const void *desired,
                                        size_t dlen, void **out, size_t *outlen, int *changed);

/* malloc(len) (at least 1 byte) holding a copy of p; NULL when out of memory. */
void *xccl_store_memdup(const void *p, size_t len);

#endif /* XCCL_CORE_STORE_H */
