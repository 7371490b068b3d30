/* SPDX-License-Identifier: Apache-2.0
 *
 * test_store.c - every store method on the hash, file, prefix(hash), custom and TCP stores
 * (one shared body, expected values written out by hand), plus per-kind checks: TCP with port
 * 0, with and without an auth key, a wrong key refused while good clients go on, raw
 * connections sending garbage closed while a good client goes on, a vanished server, waiting
 * for workers; the file store shared by store objects and processes, its torn-record recovery
 * and its last-one-out cleanup; concurrent add() from threads and forked processes reaching
 * the exact total.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/check.h"
#include "core/store.h"
#include "xccl/xccl.h"
#include "ctest.h"

static char tmpdir[64];

/* ---------------------------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------------------------- */

static int get_is(xccl_store_t *s, const char *key, const void *want, size_t wlen)
{
    void         *v = NULL;
    size_t        n = 0;
    xccl_status_t st = xccl_store_get(s, key, 1000, &v, &n);
    int           ok = st == XCCL_OK && n == wlen && (wlen == 0 || memcmp(v, want, wlen) == 0);

    if (!ok) fprintf(stderr, "get('%s'): %s %s\n", key, xccl_status_string(st), xccl_last_error());
    xccl_free(v);
    return ok;
}

static int cas_is(xccl_store_t *s, const char *key, const char *exp, const char *des,
                  const char *want)
{
    void  *v = NULL;
    size_t n = 0;
    int    ok = xccl_store_compare_set(s, key, exp, strlen(exp), des, strlen(des), &v, &n) ==
                    XCCL_OK &&
                n == strlen(want) && memcmp(v, want, n) == 0;

    xccl_free(v);
    return ok;
}

static int present(xccl_store_t *s, const char *key)
{
    int all = -1;

    CHECK(xccl_store_check(s, &key, 1, &all) == XCCL_OK);
    return all;
}

typedef struct delayed {
    xccl_store_t *s;
    const char   *key;
    const char   *val;
    int           delay_ms;
} delayed_t;

static void *set_later(void *arg)
{
    delayed_t *d = arg;

    usleep((useconds_t)d->delay_ms * 1000u);
    CHECK(xccl_store_set(d->s, d->key, d->val, strlen(d->val)) == XCCL_OK);
    return NULL;
}

typedef struct adder {
    xccl_store_t *s;
    const char   *key;
    int           n;
    int           failures;
} adder_t;

static void *add_many(void *arg)
{
    adder_t *a = arg;
    int64_t  r;

    for (int i = 0; i < a->n; i++)
        if (xccl_store_add(a->s, a->key, 1, &r) != XCCL_OK) a->failures++;
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * The shared body: `s` must be empty; `other` reaches the same data (it may be `s`; TCP clients
 * serialise their requests, so there it is a second client, used by the thread that releases
 * a blocked get). `name` appears in failure messages.
 * ------------------------------------------------------------------------------------------- */

static void test_methods(xccl_store_t *s, xccl_store_t *other, const char *name)
{
    const char   *two[]     = {"a", "cnt"};
    const char   *some[]    = {"a", "m1", "m2"};
    const uint8_t bin[]     = {0, 1, 2, 0, 255};
    int64_t       n         = -1, r = 0;
    int           all       = -1, deleted = -1;
    void         *v         = NULL;
    size_t        vlen      = 0;
    int64_t       t0;
    pthread_t     th;
    delayed_t     d;
    adder_t       ad[4];
    char         *big;

    fprintf(stderr, "[%s]\n", name);
    CHECK(xccl_store_num_keys(s, &n) == XCCL_OK && n == 0);

    /* set / get, empty and binary values, overwrite */
    CHECK(xccl_store_set(s, "a", "hello", 5) == XCCL_OK);
    CHECK(get_is(s, "a", "hello", 5));
    CHECK(xccl_store_set(s, "empty", "", 0) == XCCL_OK);
    CHECK(get_is(s, "empty", "", 0));
    CHECK(xccl_store_set(s, "bin", bin, sizeof(bin)) == XCCL_OK);
    CHECK(get_is(s, "bin", bin, sizeof(bin)));
    CHECK(xccl_store_set(s, "bin", "x", 1) == XCCL_OK);
    CHECK(get_is(s, "bin", "x", 1));

    /* add: missing = 0, decimal text, negative deltas, errors */
    CHECK(xccl_store_add(s, "cnt", 5, &r) == XCCL_OK && r == 5);
    CHECK(xccl_store_add(s, "cnt", -7, &r) == XCCL_OK && r == -2);
    CHECK(get_is(s, "cnt", "-2", 2));
    CHECK(xccl_store_set(s, "num", "40", 2) == XCCL_OK);
    CHECK(xccl_store_add(s, "num", 2, &r) == XCCL_OK && r == 42);
    CHECK(xccl_store_add(s, "a", 1, &r) == XCCL_ERR_INVALID_USAGE);
    CHECK(strstr(xccl_last_error(), "a')") != NULL);
    CHECK(xccl_store_add(s, "num", INT64_MAX, &r) == XCCL_ERR_INVALID_USAGE);
    CHECK(get_is(s, "num", "42", 2));

    /* check */
    CHECK(xccl_store_check(s, two, 2, &all) == XCCL_OK && all == 1);
    CHECK(xccl_store_check(s, some, 3, &all) == XCCL_OK && all == 0);
    CHECK(xccl_store_check(s, NULL, 0, &all) == XCCL_OK && all == 1);

    /* wait: present keys return at once; a timeout names every missing key and no other */
    CHECK(xccl_store_wait(s, two, 2, 1000) == XCCL_OK);
    t0 = xccl_now_ms();
    CHECK(xccl_store_wait(s, some, 3, 60) == XCCL_ERR_TIMEOUT);
    CHECK(xccl_now_ms() - t0 >= 55);
    /* (a prefix store names its full keys, "'pg0/m1'") */
    CHECK_MSG(strstr(xccl_last_error(), "m1'") && strstr(xccl_last_error(), "m2'") &&
                  !strstr(xccl_last_error(), "a'"),
              "%s", xccl_last_error());

    /* get of a missing key: timeout naming the key and the time */
    t0 = xccl_now_ms();
    CHECK(xccl_store_get(s, "nokey", 60, &v, &vlen) == XCCL_ERR_TIMEOUT);
    CHECK(xccl_now_ms() - t0 >= 55 && xccl_now_ms() - t0 < 3000);
    CHECK_MSG(strstr(xccl_last_error(), "nokey'") && strstr(xccl_last_error(), " ms"), "%s",
              xccl_last_error());
    CHECK(v == NULL);
    CHECK(xccl_store_get(s, "nokey", 0, &v, &vlen) == XCCL_ERR_TIMEOUT);

    /* default timeout (timeout < 0) */
    xccl_store_set_timeout(s, 40);
    CHECK(xccl_store_get_timeout(s) == 40);
    t0 = xccl_now_ms();
    CHECK(xccl_store_get(s, "nokey", -1, &v, &vlen) == XCCL_ERR_TIMEOUT);
    CHECK(xccl_now_ms() - t0 < 3000);
    xccl_store_set_timeout(s, 5000);

    /* blocking get / wait released by a set from another thread */
    d = (delayed_t){other, "late", "arrived", 30};
    pthread_create(&th, NULL, set_later, &d);
    CHECK(get_is(s, "late", "arrived", 7));
    pthread_join(th, NULL);
    d = (delayed_t){other, "late2", "x", 30};
    pthread_create(&th, NULL, set_later, &d);
    {
        const char *k[] = {"late", "late2"};
        CHECK(xccl_store_wait(s, k, 2, 2000) == XCCL_OK);
    }
    pthread_join(th, NULL);

    /* compare_set, torch semantics */
    CHECK(cas_is(s, "cs", "", "v1", "v1"));    /* missing, expected empty: set       */
    CHECK(get_is(s, "cs", "v1", 2));
    CHECK(cas_is(s, "cs2", "x", "v1", "x"));   /* missing, expected given: untouched  */
    CHECK(present(s, "cs2") == 0);
    CHECK(cas_is(s, "cs", "v1", "v2", "v2"));  /* matches: swapped                    */
    CHECK(cas_is(s, "cs", "zz", "v3", "v2"));  /* differs: current value back         */
    CHECK(get_is(s, "cs", "v2", 2));
    CHECK(xccl_store_set(s, "cse", "", 0) == XCCL_OK);
    CHECK(cas_is(s, "cse", "", "full", "full")); /* present and empty equals empty    */

    /* delete_key */
    CHECK(xccl_store_delete_key(s, "a", &deleted) == XCCL_OK && deleted == 1);
    CHECK(xccl_store_delete_key(s, "a", &deleted) == XCCL_OK && deleted == 0);
    CHECK(present(s, "a") == 0);
    CHECK(xccl_store_get(s, "a", 0, &v, &vlen) == XCCL_ERR_TIMEOUT);

    /* keys now: empty bin cnt num late late2 cs cse */
    CHECK(xccl_store_num_keys(s, &n) == XCCL_OK);
    CHECK_MSG(n == 8, "num_keys %" PRId64, n);

    /* a 3 MiB value */
    big = malloc(3u << 20);
    for (size_t i = 0; i < (3u << 20); i++) big[i] = (char)(i * 7 + 1);
    CHECK(xccl_store_set(s, "big", big, 3u << 20) == XCCL_OK);
    CHECK(get_is(s, "big", big, 3u << 20));
    free(big);

    /* argument checks */
    CHECK(xccl_store_set(s, NULL, "x", 1) == XCCL_ERR_INVALID_ARG);
    CHECK(xccl_store_set(s, "k", NULL, 1) == XCCL_ERR_INVALID_ARG);
    CHECK(xccl_store_get(NULL, "k", 0, &v, &vlen) == XCCL_ERR_INVALID_ARG);

    /* concurrent add from threads on one store object */
    for (int i = 0; i < 4; i++) ad[i] = (adder_t){s, "par", 100, 0};
    {
        pthread_t ths[4];
        for (int i = 0; i < 4; i++) pthread_create(&ths[i], NULL, add_many, &ad[i]);
        for (int i = 0; i < 4; i++) pthread_join(ths[i], NULL);
    }
    for (int i = 0; i < 4; i++) CHECK(ad[i].failures == 0);
    CHECK(xccl_store_add(s, "par", 0, &r) == XCCL_OK && r == 400);
}

/* ---------------------------------------------------------------------------------------------
 * Hash, prefix, custom
 * ------------------------------------------------------------------------------------------- */

static void test_hash_prefix(void)
{
    xccl_store_t *h, *p, *q;
    int64_t       r;

    CHECK(xccl_store_hash_create(5000, &h) == XCCL_OK);
    test_methods(h, h, "hash");
    xccl_store_release(h);

    CHECK(xccl_store_hash_create(5000, &h) == XCCL_OK);
    CHECK(xccl_store_prefix_create("pg0", h, &p) == XCCL_OK);
    test_methods(p, p, "prefix(hash)");
    /* the keys live under "pg0/" in the base */
    CHECK(get_is(h, "pg0/cnt", "-2", 2));
    CHECK(present(h, "cnt") == 0);
    /* nested prefixes compose; the prefix store keeps the base alive */
    CHECK(xccl_store_prefix_create("sub", p, &q) == XCCL_OK);
    CHECK(xccl_store_add(q, "n", 3, &r) == XCCL_OK && r == 3);
    CHECK(get_is(h, "pg0/sub/n", "3", 1));
    /* timeouts follow the base until set (a negative timeout goes back to following) */
    xccl_store_set_timeout(p, -1);
    xccl_store_set_timeout(h, 1234);
    CHECK(xccl_store_get_timeout(q) == 1234);
    xccl_store_set_timeout(q, 77);
    CHECK(xccl_store_get_timeout(q) == 77 && xccl_store_get_timeout(h) == 1234);
    xccl_store_release(h);
    xccl_store_release(p);
    CHECK(xccl_store_add(q, "n", 1, &r) == XCCL_OK && r == 4);
    xccl_store_release(q); /* frees p and h (ASan would report a leak otherwise) */
}

static int released;

static xccl_status_t c_set(void *ctx, const char *key, const void *val, size_t len)
{
    return xccl_store_set(ctx, key, val, len);
}
static xccl_status_t c_get(void *ctx, const char *key, int64_t timeout_ms, void **val,
                           size_t *len)
{
    return xccl_store_get(ctx, key, timeout_ms, val, len);
}
static xccl_status_t c_add(void *ctx, const char *key, int64_t delta, int64_t *result)
{
    return xccl_store_add(ctx, key, delta, result);
}
static xccl_status_t c_wait(void *ctx, const char *const *keys, size_t nkeys, int64_t timeout_ms)
{
    return xccl_store_wait(ctx, keys, nkeys, timeout_ms);
}
static xccl_status_t c_check(void *ctx, const char *const *keys, size_t nkeys, int *all)
{
    return xccl_store_check(ctx, keys, nkeys, all);
}
static xccl_status_t c_cas(void *ctx, const char *key, const void *e, size_t elen, const void *d,
                           size_t dlen, void **out, size_t *outlen)
{
    return xccl_store_compare_set(ctx, key, e, elen, d, dlen, out, outlen);
}
static xccl_status_t c_del(void *ctx, const char *key, int *deleted)
{
    return xccl_store_delete_key(ctx, key, deleted);
}
static xccl_status_t c_num(void *ctx, int64_t *n)
{
    return xccl_store_num_keys(ctx, n);
}
static void c_release(void *ctx)
{
    released++;
    xccl_store_release(ctx);
}
static xccl_status_t c_fail_quietly(void *ctx, const char *key, const void *val, size_t len)
{
    (void)ctx, (void)key, (void)val, (void)len;
    return XCCL_ERR_REMOTE; /* like a Python callback: no message of its own */
}

static void test_custom(void)
{
    xccl_store_ops_t ops = {c_set, c_get, c_add, c_wait, c_check, c_cas, c_del, c_num,
                            c_release};
    xccl_store_ops_t few = {0};
    xccl_store_t    *h, *c;
    int64_t          n;

    CHECK(xccl_store_hash_create(5000, &h) == XCCL_OK);
    CHECK(xccl_store_custom_create(&ops, h, 5000, &c) == XCCL_OK);
    test_methods(c, c, "custom(hash)");
    released = 0;
    xccl_store_release(c);
    CHECK(released == 1);

    few.set = c_fail_quietly;
    CHECK(xccl_store_custom_create(&few, NULL, -1, &c) == XCCL_OK);
    CHECK(xccl_store_get_timeout(c) == XCCL_STORE_DEFAULT_TIMEOUT_MS ||
          getenv("XCCL_STORE_TIMEOUT_MS") != NULL);
    CHECK(xccl_store_num_keys(c, &n) == XCCL_ERR_NOT_SUPPORTED);
    CHECK(xccl_store_set(c, "k", "v", 1) == XCCL_ERR_REMOTE);
    CHECK_MSG(strstr(xccl_last_error(), "set('k')") != NULL, "%s", xccl_last_error());
    xccl_store_release(c);
}

/* ---------------------------------------------------------------------------------------------
 * File store
 * ------------------------------------------------------------------------------------------- */

static void test_file(void)
{
    char          path[128], other[128];
    xccl_store_t *s, *t;
    int64_t       r;
    int           fd;

    snprintf(path, sizeof(path), "%s/filestore", tmpdir);
    CHECK(xccl_store_file_create(path, 0, 5000, &s) == XCCL_OK);
    test_methods(s, s, "file");
    /* a second store object on the same file sees everything and excludes the first */
    CHECK(xccl_store_file_create(path, 0, 5000, &t) == XCCL_OK);
    CHECK(get_is(t, "cs", "v2", 2));
    CHECK(xccl_store_add(t, "par", 1, &r) == XCCL_OK && r == 401);
    CHECK(xccl_store_add(s, "par", 1, &r) == XCCL_OK && r == 402);
    {
        adder_t   a = {s, "two", 150, 0}, b = {t, "two", 150, 0};
        pthread_t ta, tb;
        pthread_create(&ta, NULL, add_many, &a);
        pthread_create(&tb, NULL, add_many, &b);
        pthread_join(ta, NULL);
        pthread_join(tb, NULL);
        CHECK(a.failures == 0 && b.failures == 0);
        CHECK(xccl_store_add(t, "two", 0, &r) == XCCL_OK && r == 300);
    }
    xccl_store_release(t);

    /* a torn record at the end (a writer that died) is ignored, then overwritten */
    fd = open(path, O_WRONLY | O_APPEND);
    CHECK(fd >= 0);
    {
        uint8_t torn[20] = {1, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 9, 'k', 'e'};
        CHECK(write(fd, torn, sizeof(torn)) == (ssize_t)sizeof(torn));
    }
    close(fd);
    CHECK(xccl_store_file_create(path, 0, 5000, &t) == XCCL_OK);
    CHECK(get_is(t, "cs", "v2", 2));
    CHECK(xccl_store_set(t, "after", "torn", 4) == XCCL_OK);
    CHECK(get_is(s, "after", "torn", 4));
    xccl_store_release(t);
    CHECK(xccl_store_file_create(path, 0, 5000, &t) == XCCL_OK);
    CHECK(get_is(t, "after", "torn", 4));
    CHECK(get_is(t, "par", "402", 3));
    xccl_store_release(t);
    xccl_store_release(s);
    CHECK(access(path, F_OK) == 0); /* world_size 0: the file stays */
    unlink(path);

    /* a file that is not a store */
    snprintf(other, sizeof(other), "%s/notastore", tmpdir);
    fd = open(other, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    CHECK(write(fd, "hello world, not a store", 24) == 24);
    close(fd);
    CHECK(xccl_store_file_create(other, 0, 1000, &s) == XCCL_OK);
    CHECK(xccl_store_set(s, "k", "v", 1) == XCCL_ERR_INVALID_USAGE);
    xccl_store_release(s);
    unlink(other);

    /* last one out removes the file */
    CHECK(xccl_store_file_create(path, 2, 5000, &s) == XCCL_OK);
    CHECK(xccl_store_file_create(path, 2, 5000, &t) == XCCL_OK);
    CHECK(xccl_store_set(s, "k", "v", 1) == XCCL_OK);
    xccl_store_release(s);
    CHECK(access(path, F_OK) == 0);
    CHECK(get_is(t, "k", "v", 1));
    xccl_store_release(t);
    CHECK(access(path, F_OK) != 0);

    CHECK(xccl_store_file_create(NULL, 0, 1000, &s) == XCCL_ERR_INVALID_ARG);
    snprintf(other, sizeof(other), "%s/no/such/dir/f", tmpdir);
    CHECK(xccl_store_file_create(other, 0, 1000, &s) == XCCL_ERR_SYSTEM);
}

/* Forked adders: each child opens its own store with `open_store` and adds 1 to `key` `nadd`
 * times. All children are forked before the parent starts any thread and wait on a pipe until
 * forks_go(): a child forked while another thread holds the allocator's lock (glibc is safe,
 * the ASan allocator of gcc 12 is not) would deadlock on its first malloc. */
typedef xccl_status_t (*open_fn)(void *arg, xccl_store_t **out);

typedef struct forks {
    pid_t pids[8];
    int   n;
    int   go; /* write end: closing it starts the children */
} forks_t;

static void forks_start(forks_t *f, open_fn open_store, void *arg, const char *key, int nproc,
                        int nadd)
{
    int fds[2];

    CHECK(pipe(fds) == 0);
    fflush(stdout);
    fflush(stderr);
    f->n  = nproc;
    f->go = fds[1];
    for (int i = 0; i < nproc; i++) {
        f->pids[i] = fork();
        if (f->pids[i] == 0) {
            xccl_store_t *s;
            int64_t       r;
            char          c;
            int           bad;
            close(fds[1]);
            while (read(fds[0], &c, 1) < 0 && errno == EINTR) {
            }
            bad = open_store(arg, &s) != XCCL_OK;
            for (int k = 0; !bad && k < nadd; k++) bad = xccl_store_add(s, key, 1, &r) != 0;
            if (!bad) xccl_store_release(s);
            if (bad) fprintf(stderr, "child %d: %s\n", i, xccl_last_error());
            _exit(bad);
        }
    }
    close(fds[0]);
}

static void forks_go(forks_t *f)
{
    close(f->go);
}

/* Number of children that failed. */
static int forks_wait(forks_t *f)
{
    int failed = 0;

    for (int i = 0; i < f->n; i++) {
        int status = 0;
        waitpid(f->pids[i], &status, 0);
        failed += !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    }
    return failed;
}

static xccl_status_t open_file(void *arg, xccl_store_t **out)
{
    return xccl_store_file_create(arg, 0, 5000, out);
}

static void test_file_fork(void)
{
    char          path[128];
    xccl_store_t *s;
    int64_t       r;
    adder_t       a;
    pthread_t     th;
    forks_t       f;

    snprintf(path, sizeof(path), "%s/forkstore", tmpdir);
    CHECK(xccl_store_file_create(path, 0, 5000, &s) == XCCL_OK);

    forks_start(&f, open_file, path, "total", 3, 100);
    a = (adder_t){s, "total", 100, 0};
    pthread_create(&th, NULL, add_many, &a);
    forks_go(&f);
    CHECK(forks_wait(&f) == 0);
    pthread_join(th, NULL);
    CHECK(a.failures == 0);
    CHECK(xccl_store_add(s, "total", 0, &r) == XCCL_OK && r == 400);
    xccl_store_release(s);
    unlink(path);
}

/* ---------------------------------------------------------------------------------------------
 * TCP store
 * ------------------------------------------------------------------------------------------- */

typedef struct tcp_target {
    int         port;
    const char *key;
} tcp_target_t;

static xccl_status_t open_tcp(void *arg, xccl_store_t **out)
{
    tcp_target_t *t = arg;
    return xccl_store_tcp_create("127.0.0.1", t->port, 0, 0, 0, 5000, t->key,
                                 t->key ? strlen(t->key) : 0, out);
}

static int raw_connect(int port)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    int                fd = socket(AF_INET, SOCK_STREAM, 0);

    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Whether the server closes fd within 2 s (EOF or reset), reading and discarding anything. */
static int closed_by_server(int fd)
{
    struct pollfd p   = {.fd = fd, .events = POLLIN};
    int64_t       end = xccl_now_ms() + 2000;
    char          b[256];

    while (xccl_now_ms() < end) {
        if (poll(&p, 1, 100) <= 0) continue;
        ssize_t n = recv(fd, b, sizeof(b), 0);
        if (n == 0 || (n < 0 && errno == ECONNRESET)) return 1;
    }
    return 0;
}

static void put32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24), p[1] = (uint8_t)(v >> 16), p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* Sends `len` bytes on a raw connection and expects the server to drop it. */
static int garbage_dropped(int port, const uint8_t *msg, size_t len)
{
    int fd = raw_connect(port);
    int ok;

    if (fd < 0) return 0;
    ok = send(fd, msg, len, MSG_NOSIGNAL) == (ssize_t)len && closed_by_server(fd);
    close(fd);
    return ok;
}

static void test_tcp_garbage(xccl_store_t *good, int port)
{
    uint8_t m[64];
    int64_t r;

    /* bad magic */
    memset(m, 0, sizeof(m));
    memcpy(m, "GET / HTTP/1.1\r\n\r\n", 18);
    CHECK(garbage_dropped(port, m, 18));
    CHECK(xccl_store_add(good, "alive", 1, &r) == XCCL_OK && r == 1);
    /* absurd length */
    put32(m, 0x58435331u);
    put32(m + 4, 0xfffffff0u);
    m[8] = 2;
    CHECK(garbage_dropped(port, m, 9));
    /* length below the header */
    put32(m + 4, 3);
    CHECK(garbage_dropped(port, m, 9));
    /* a field running past the end of the request (SET, key length 1000 in 20 bytes) */
    put32(m + 4, 20);
    m[8] = 2;
    put32(m + 9, 1000);
    memcpy(m + 13, "abcdefg", 7);
    CHECK(garbage_dropped(port, m, 20));
    /* a key over the limit */
    put32(m + 4, 13);
    put32(m + 9, 70000);
    CHECK(garbage_dropped(port, m, 13));
    /* unknown command */
    put32(m + 4, 9);
    m[8] = 99;
    CHECK(garbage_dropped(port, m, 9));
    /* trailing bytes after the fields (NUM_KEYS takes none) */
    put32(m + 4, 10);
    m[8] = 9;
    m[9] = 0;
    CHECK(garbage_dropped(port, m, 10));
    CHECK(xccl_store_add(good, "alive", 1, &r) == XCCL_OK && r == 2);

    /* truncated: half a request, then hang up; and a parked GET whose client hangs up */
    {
        int fd = raw_connect(port);
        put32(m + 4, 40);
        m[8] = 2;
        CHECK(send(fd, m, 15, MSG_NOSIGNAL) == 15);
        usleep(20000);
        close(fd);
    }
    {
        int fd = raw_connect(port);
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        put32(m + 4, 9 + 12 + 12);
        m[8] = 3; /* GET, timeout 100000 ms, key "never123" */
        put32(m + 9, 8);
        memset(m + 13, 0, 8);
        put32(m + 17, 100000);
        put32(m + 21, 8);
        memcpy(m + 25, "never123", 8);
        CHECK(send(fd, m, 33, MSG_NOSIGNAL) == 33);
        CHECK(poll(&pf, 1, 50) == 0); /* parked: no answer, not closed */
        close(fd);
    }
    CHECK(xccl_store_add(good, "alive", 1, &r) == XCCL_OK && r == 3);
    CHECK(xccl_store_set(good, "never123", "now", 3) == XCCL_OK);
    CHECK(get_is(good, "never123", "now", 3));
}

static void test_tcp_basic(void)
{
    xccl_store_t *m, *c, *p;
    int           port;
    int64_t       r;
    tcp_target_t  tgt;
    adder_t       ad[3];
    pthread_t     th[3];
    forks_t       f;
    delayed_t     d;
    void         *v;
    size_t        vlen;

    CHECK(xccl_store_tcp_create("127.0.0.1", 0, 1, 1, 1, 5000, NULL, 0, &m) == XCCL_OK);
    port = xccl_store_tcp_port(m);
    CHECK(port > 0);
    /* a second client sees the same data; port reported on both */
    CHECK(xccl_store_tcp_create("127.0.0.1", port, 0, 2, 0, 5000, NULL, 0, &c) == XCCL_OK);
    CHECK(xccl_store_tcp_port(c) == port);
    test_methods(m, c, "tcp master");

    CHECK(get_is(c, "cs", "v2", 2));
    CHECK(xccl_store_tcp_port(NULL) == -1);

    /* a GET parked on the server is released by another client's set */
    d = (delayed_t){c, "parked", "go", 40};
    pthread_create(&th[0], NULL, set_later, &d);
    CHECK(get_is(m, "parked", "go", 2));
    pthread_join(th[0], NULL);
    /* after a server-side timeout the connection is still in step */
    CHECK(xccl_store_get(c, "nope", 30, &v, &vlen) == XCCL_ERR_TIMEOUT);
    CHECK(strstr(xccl_last_error(), "'nope'") != NULL);
    CHECK(get_is(c, "parked", "go", 2));

    /* prefix over TCP */
    CHECK(xccl_store_prefix_create("job", c, &p) == XCCL_OK);
    CHECK(xccl_store_add(p, "x", 2, &r) == XCCL_OK && r == 2);
    CHECK(get_is(m, "job/x", "2", 1));
    xccl_store_release(p);

    /* threads on separate client objects plus forked processes: exact total */
    tgt = (tcp_target_t){port, NULL};
    forks_start(&f, open_tcp, &tgt, "sum", 3, 100);
    for (int i = 0; i < 3; i++) {
        xccl_store_t *s;
        CHECK(open_tcp(&tgt, &s) == XCCL_OK);
        ad[i] = (adder_t){s, "sum", 100, 0};
        pthread_create(&th[i], NULL, add_many, &ad[i]);
    }
    forks_go(&f);
    CHECK(forks_wait(&f) == 0);
    for (int i = 0; i < 3; i++) {
        pthread_join(th[i], NULL);
        CHECK(ad[i].failures == 0);
        xccl_store_release(ad[i].s);
    }
    CHECK(xccl_store_add(c, "sum", 0, &r) == XCCL_OK && r == 600);

    test_tcp_garbage(c, port);

    /* the server goes away: clear REMOTE errors, no SIGPIPE */
    xccl_store_release(m);
    CHECK(xccl_store_set(c, "k", "v", 1) == XCCL_ERR_REMOTE);
    CHECK_MSG(strstr(xccl_last_error(), "set('k')") != NULL, "%s", xccl_last_error());
    CHECK(xccl_store_add(c, "k", 1, &r) == XCCL_ERR_REMOTE);
    xccl_store_release(c);

    /* a client with nobody listening gives up at its timeout */
    CHECK(xccl_store_tcp_create("127.0.0.1", port, 0, 1, 0, 100, NULL, 0, &c) ==
          XCCL_ERR_TIMEOUT);
    CHECK(xccl_store_tcp_create("127.0.0.1", 0, 0, 1, 0, 100, NULL, 0, &c) ==
          XCCL_ERR_INVALID_ARG);
}

static void test_tcp_auth(void)
{
    const char   *key = "s3cret-job-key";
    xccl_store_t *m, *c;
    int           port, silent;
    tcp_target_t  tgt;
    int64_t       r;
    forks_t       f;

    CHECK(xccl_store_tcp_create("127.0.0.1", 0, 1, 1, 1, 5000, key, strlen(key), &m) ==
          XCCL_OK);
    port = xccl_store_tcp_port(m);

    /* a connection that never speaks does not hold up anyone */
    silent = raw_connect(port);
    CHECK(silent >= 0);

    CHECK(xccl_store_tcp_create("127.0.0.1", port, 0, 1, 0, 5000, key, strlen(key), &c) ==
          XCCL_OK);
    CHECK(xccl_store_set(c, "k", "v", 1) == XCCL_OK);
    CHECK(get_is(m, "k", "v", 1));

    /* wrong key: refused with AUTH, and the server keeps serving */
    CHECK(xccl_store_tcp_create("127.0.0.1", port, 0, 1, 0, 2000, "wrong", 5, NULL) ==
          XCCL_ERR_INVALID_ARG);
    {
        xccl_store_t *bad = NULL;
        CHECK(xccl_store_tcp_create("127.0.0.1", port, 0, 1, 0, 2000, "wrong", 5, &bad) ==
              XCCL_ERR_AUTH);
        CHECK_MSG(strstr(xccl_last_error(), "wrong key") != NULL, "%s", xccl_last_error());
        CHECK(bad == NULL);
        /* no key at all: the server's hello is not a reply */
        CHECK(xccl_store_tcp_create("127.0.0.1", port, 0, 1, 0, 2000, NULL, 0, &bad) < 0);
        CHECK(bad == NULL);
    }
    CHECK(xccl_store_add(c, "n", 5, &r) == XCCL_OK && r == 5);
    /* the handshake state machine refuses a plain request in place of a hello */
    {
        uint8_t msg[40] = {0};
        put32(msg, 0x58435331u);
        put32(msg + 4, 9);
        msg[8] = 9;
        CHECK(garbage_dropped(port, msg, sizeof(msg)));
    }

    /* forked clients with the key */
    tgt = (tcp_target_t){port, key};
    forks_start(&f, open_tcp, &tgt, "n", 2, 50);
    forks_go(&f);
    CHECK(forks_wait(&f) == 0);
    CHECK(xccl_store_add(m, "n", 0, &r) == XCCL_OK && r == 105);

    close(silent);
    xccl_store_release(c);
    xccl_store_release(m);
}

static int free_port(void)
{
    struct sockaddr_in a = {.sin_family = AF_INET};
    socklen_t          len = sizeof(a);
    int                fd = socket(AF_INET, SOCK_STREAM, 0), port;

    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd, (struct sockaddr *)&a, sizeof(a));
    getsockname(fd, (struct sockaddr *)&a, &len);
    port = ntohs(a.sin_port);
    close(fd);
    return port;
}

typedef struct master_arg {
    int           port;
    int           world;
    int64_t       timeout;
    xccl_store_t *s;
    xccl_status_t st;
    const char   *key;      /* NULL: no authentication                               */
    char          msg[512]; /* the master's error message (errors are per thread)    */
} master_arg_t;

static void *run_master(void *arg)
{
    master_arg_t *ma = arg;
    ma->st = xccl_store_tcp_create("127.0.0.1", ma->port, 1, ma->world, 1, ma->timeout, ma->key,
                                   ma->key ? strlen(ma->key) : 0, &ma->s);
    snprintf(ma->msg, sizeof(ma->msg), "%s", ma->st == XCCL_OK ? "" : xccl_last_error());
    return NULL;
}

static void test_tcp_workers(void)
{
    master_arg_t  ma;
    pthread_t     th;
    xccl_store_t *c1, *c2;
    int64_t       t0 = xccl_now_ms();

    /* nobody else comes: the timeout names how many arrived */
    ma = (master_arg_t){free_port(), 3, 150, NULL, XCCL_OK, NULL, ""};
    run_master(&ma);
    CHECK(ma.st == XCCL_ERR_TIMEOUT);
    CHECK_MSG(strstr(xccl_last_error(), "1 of 3") != NULL, "%s", xccl_last_error());
    CHECK(xccl_now_ms() - t0 < 3000);

    /* two workers join: the master's create returns */
    ma = (master_arg_t){free_port(), 3, 5000, NULL, XCCL_OK, NULL, ""};
    pthread_create(&th, NULL, run_master, &ma);
    CHECK(xccl_store_tcp_create("127.0.0.1", ma.port, 0, 3, 0, 5000, NULL, 0, &c1) == XCCL_OK);
    CHECK(xccl_store_tcp_create("127.0.0.1", ma.port, 0, 3, 0, 5000, NULL, 0, &c2) == XCCL_OK);
    pthread_join(th, NULL);
    CHECK(ma.st == XCCL_OK);
    if (ma.st == XCCL_OK) {
        CHECK(xccl_store_set(c1, "w", "1", 1) == XCCL_OK);
        CHECK(get_is(c2, "w", "1", 1));
        xccl_store_release(ma.s);
    }
    xccl_store_release(c1);
    xccl_store_release(c2);

    /* a worker with another key is refused; the master's timeout says that some connection
     * failed authentication, from where, and which variable to check: on the master's host
     * "1 of 2 workers connected" alone does not tell a wrong key from a dead host (found by
     * tests/hosts, hosts with different XCCL_AUTH_KEYs) */
    ma = (master_arg_t){free_port(), 2, 1500, NULL, XCCL_OK, "the-key", ""};
    pthread_create(&th, NULL, run_master, &ma);
    {
        xccl_store_t *bad = NULL;
        xccl_status_t st  = XCCL_ERR_TIMEOUT;
        int64_t       end = xccl_now_ms() + 1000;
        /* until the master listens: refused connections are retried inside create */
        while (st != XCCL_ERR_AUTH && xccl_now_ms() < end)
            st = xccl_store_tcp_create("127.0.0.1", ma.port, 0, 2, 0, 200, "other", 5, &bad);
        CHECK(st == XCCL_ERR_AUTH && bad == NULL);
    }
    pthread_join(th, NULL);
    CHECK(ma.st == XCCL_ERR_TIMEOUT);
    CHECK_MSG(strstr(ma.msg, "1 of 2 workers") != NULL, "%s", ma.msg);
    CHECK_MSG(strstr(ma.msg, "1 connection(s) failed authentication (the last from 127.0.0.1:") !=
                  NULL,
              "%s", ma.msg);
    CHECK_MSG(strstr(ma.msg, "XCCL_AUTH_KEY") != NULL, "%s", ma.msg);
    if (ma.st == XCCL_OK) xccl_store_release(ma.s);

    /* binding to every address; clients still reach it through loopback */
    CHECK(xccl_store_tcp_create(NULL, 0, 1, 1, 0, 5000, NULL, 0, &c1) == XCCL_OK);
    CHECK(xccl_store_tcp_create("localhost", xccl_store_tcp_port(c1), 0, 1, 0, 5000, NULL, 0,
                                &c2) == XCCL_OK);
    CHECK(xccl_store_set(c2, "any", "1", 1) == XCCL_OK);
    CHECK(get_is(c1, "any", "1", 1));
    xccl_store_release(c2);
    xccl_store_release(c1);
}

int main(void)
{
    int64_t t0 = xccl_now_ms();

    snprintf(tmpdir, sizeof(tmpdir), "/tmp/xccl_test_store.XXXXXX");
    if (mkdtemp(tmpdir) == NULL) return 1;
    test_hash_prefix();
    test_custom();
    test_file();
    test_file_fork();
    test_tcp_basic();
    test_tcp_auth();
    test_tcp_workers();
    rmdir(tmpdir);
    fprintf(stderr, "test_store: %" PRId64 " ms\n", xccl_now_ms() - t0);
    CTEST_MAIN_END("test_store");
}
