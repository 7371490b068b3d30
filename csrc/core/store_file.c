/* SPDX-License-Identifier: Apache-2.0
 *
 * store_file.c - a store in a file shared by processes: an append-only log of records, locked
 * with open-file-description fcntl locks, replayed into a per-store cache.
 *
 * File layout (integers big-endian)
 *   header  "XCCLFS01"                                 8 bytes, written with the first record
 *   record  [u8 type][3 bytes zero][u32 klen][u64 vlen][key][value]
 *           type 1 SET key=value, 2 DELETE key, 3 DONE (a store object was destroyed)
 *
 * Concurrency
 *   Every operation takes the store object's mutex (threads of this process), then an
 *   F_OFD_SETLKW lock on the whole file (shared for reads, exclusive for writes; OFD locks
 *   belong to the open file, so two store objects in one process exclude each other too and
 *   closing one does not drop the other's lock), replays the records appended since its last
 *   look, and for writes appends one record. Lock holds are one read and one write, so the
 *   lock wait itself has no deadline. get/wait poll: an fstat shows whether the file grew,
 *   with a sleep of 1 ms doubling to 10 ms between looks, up to the timeout.
 *
 * Cleanup: when world_size > 0 and world_size DONE records are in the file, the store that
 *   wrote the last one removes the file (like torch's FileStore).
 */
#include "core/store.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/check.h"

#define FILE_MAGIC     "XCCLFS01"
#define FILE_MAGIC_LEN 8
#define REC_HDR_LEN    16

enum { REC_SET = 1, REC_DELETE = 2, REC_DONE = 3 };

#ifdef F_OFD_SETLKW
#define LOCK_CMD F_OFD_SETLKW
#else
#define LOCK_CMD F_SETLKW /* process-owned locks: only one store object per file per process */
#endif

typedef struct file_store {
    xccl_store_t    base;
    pthread_mutex_t lock;
    char           *path;
    int             fd;
    int             world_size;
    uint64_t        offset; /* bytes of the file already replayed into `cache` */
    int64_t         ndone;  /* DONE records seen */
    xccl_kvmap_t    cache;
} file_store_t;

static void put_be32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (24 - 8 * i));
}

static void put_be64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (56 - 8 * i));
}

static uint32_t get_be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static uint64_t get_be64(const uint8_t *p)
{
    return (uint64_t)get_be32(p) << 32 | get_be32(p + 4);
}

static xccl_status_t file_lock(file_store_t *fs, short type)
{
    struct flock fl;

    memset(&fl, 0, sizeof(fl));
    fl.l_type   = type;
    fl.l_whence = SEEK_SET;
    while (fcntl(fs->fd, LOCK_CMD, &fl) != 0) {
        if (errno == EINTR) continue;
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "file store '%s': fcntl lock failed: %s", fs->path,
                          strerror(errno));
    }
    return XCCL_OK;
}

static void file_unlock(file_store_t *fs)
{
    struct flock fl;

    memset(&fl, 0, sizeof(fl));
    fl.l_type   = F_UNLCK;
    fl.l_whence = SEEK_SET;
    while (fcntl(fs->fd, LOCK_CMD, &fl) != 0 && errno == EINTR) {
    }
}

static void cache_reset(file_store_t *fs)
{
    xccl_kvmap_free(&fs->cache);
    fs->offset = 0;
    fs->ndone  = 0;
}

static xccl_status_t read_at(file_store_t *fs, uint8_t *buf, size_t len, uint64_t off)
{
    while (len > 0) {
        ssize_t n = pread(fs->fd, buf, len, (off_t)off);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0)
            return XCCL_ERROR(XCCL_ERR_SYSTEM, "file store '%s': read at %" PRIu64 " failed: %s",
                              fs->path, off, n < 0 ? strerror(errno) : "unexpected end of file");
        buf += n;
        len -= (size_t)n;
        off += (uint64_t)n;
    }
    return XCCL_OK;
}

static xccl_status_t write_at(file_store_t *fs, const uint8_t *buf, size_t len, uint64_t off)
{
    while (len > 0) {
        ssize_t n = pwrite(fs->fd, buf, len, (off_t)off);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0)
            return XCCL_ERROR(XCCL_ERR_SYSTEM, "file store '%s': write at %" PRIu64 " failed: %s",
                              fs->path, off, strerror(errno));
        buf += n;
        len -= (size_t)n;
        off += (uint64_t)n;
    }
    return XCCL_OK;
}

/* Replays the records appended since fs->offset into the cache. With the lock held (either
 * kind). *size receives the file size; a torn record at the end (a writer died mid-write) is
 * left unread, so fs->offset < *size afterwards. */
static xccl_status_t file_refresh(file_store_t *fs, uint64_t *size)
{
    struct stat    sb;
    uint8_t       *buf;
    uint64_t       len, pos = 0;
    xccl_status_t  st = XCCL_OK;

    if (fstat(fs->fd, &sb) != 0)
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "file store '%s': fstat failed: %s", fs->path,
                          strerror(errno));
    *size = (uint64_t)sb.st_size;
    if (*size < fs->offset) cache_reset(fs); /* the file was truncated or replaced */
    if (*size == fs->offset) return XCCL_OK;
    len = *size - fs->offset;
    buf = malloc(len);
    if (buf == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "file store: %" PRIu64 " bytes", len);
    XCCL_CHECK_GOTO(read_at(fs, buf, len, fs->offset), st, out);
    if (fs->offset == 0) {
        if (len < FILE_MAGIC_LEN) goto out;
        if (memcmp(buf, FILE_MAGIC, FILE_MAGIC_LEN) != 0) {
            st = XCCL_ERROR(XCCL_ERR_INVALID_USAGE,
                            "file store '%s': the file exists and is not an xccl file store",
                            fs->path);
            goto out;
        }
        pos = FILE_MAGIC_LEN;
    }
    while (len - pos >= REC_HDR_LEN) {
        const uint8_t *r    = buf + pos;
        uint32_t       klen = get_be32(r + 4);
        uint64_t       vlen = get_be64(r + 8);

        if (r[0] < REC_SET || r[0] > REC_DONE || klen > XCCL_STORE_MAX_KEY ||
            vlen > XCCL_STORE_MAX_VALUE) {
            st = XCCL_ERROR(XCCL_ERR_SYSTEM, "file store '%s': corrupt record at offset %" PRIu64,
                            fs->path, fs->offset + pos);
            goto out;
        }
        if (len - pos - REC_HDR_LEN < klen + vlen) break;
        if (r[0] == REC_SET)
            XCCL_CHECK_GOTO(xccl_kvmap_set(&fs->cache, (const char *)r + REC_HDR_LEN, klen,
                                           r + REC_HDR_LEN + klen, vlen),
                            st, out);
        else if (r[0] == REC_DELETE)
            xccl_kvmap_delete(&fs->cache, (const char *)r + REC_HDR_LEN, klen);
        else
            fs->ndone++;
        pos += REC_HDR_LEN + klen + vlen;
    }
out:
    if (st == XCCL_OK) fs->offset += pos;
    else cache_reset(fs);
    free(buf);
    return st;
}

/* Appends one record. With the exclusive lock held and right after file_refresh (size is what
 * it returned). The caller updates the cache; on failure the cache is dropped and rebuilt from
 * the file on the next operation. */
static xccl_status_t file_append(file_store_t *fs, uint64_t size, int type, const char *key,
                                 size_t klen, const void *val, size_t vlen)
{
    size_t        head = fs->offset == 0 ? FILE_MAGIC_LEN : 0;
    size_t        len  = head + REC_HDR_LEN + klen + vlen;
    uint8_t      *buf  = malloc(len);
    uint8_t      *r    = buf + head;
    xccl_status_t st;

    if (buf == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "file store: %zu bytes", len);
    /* drop a torn record left by a writer that died, so the log stays parseable */
    if (size > fs->offset && ftruncate(fs->fd, (off_t)fs->offset) != 0) {
        free(buf);
        cache_reset(fs);
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "file store '%s': truncate failed: %s", fs->path,
                          strerror(errno));
    }
    if (head) memcpy(buf, FILE_MAGIC, FILE_MAGIC_LEN);
    memset(r, 0, REC_HDR_LEN);
    r[0] = (uint8_t)type;
    put_be32(r + 4, (uint32_t)klen);
    put_be64(r + 8, vlen);
    if (klen) memcpy(r + REC_HDR_LEN, key, klen);
    if (vlen) memcpy(r + REC_HDR_LEN + klen, val, vlen);
    st = write_at(fs, buf, len, fs->offset);
    free(buf);
    if (st != XCCL_OK) {
        cache_reset(fs);
        return st;
    }
    fs->offset += len;
    return XCCL_OK;
}

/* Mutex and file lock, then replay. On success the caller must call file_end. */
static xccl_status_t file_begin(file_store_t *fs, short type, uint64_t *size)
{
    xccl_status_t st;

    pthread_mutex_lock(&fs->lock);
    st = file_lock(fs, type);
    if (st == XCCL_OK) {
        st = file_refresh(fs, size);
        if (st != XCCL_OK) file_unlock(fs);
    }
    if (st != XCCL_OK) pthread_mutex_unlock(&fs->lock);
    return st;
}

static void file_end(file_store_t *fs)
{
    file_unlock(fs);
    pthread_mutex_unlock(&fs->lock);
}

/* Whether the file changed size since a look that saw `seen` bytes (no lock needed: a false
 * "yes" only costs one locked replay; writes by this same store object count too). */
static int file_grew(file_store_t *fs, uint64_t seen)
{
    struct stat sb;

    return fstat(fs->fd, &sb) != 0 || (uint64_t)sb.st_size != seen;
}

/* Sleeps the current backoff (never past the deadline) and grows it; 0 if the deadline passed. */
static int backoff(int64_t deadline_ms, int64_t *delay_ms)
{
    int64_t         left = deadline_ms - xccl_now_ms();
    int64_t         ms   = *delay_ms < left ? *delay_ms : left;
    struct timespec ts;

    if (left <= 0) return 0;
    ts.tv_sec  = (time_t)(ms / 1000);
    ts.tv_nsec = (long)(ms % 1000) * 1000000L;
    nanosleep(&ts, NULL);
    if (*delay_ms < 10) *delay_ms *= 2;
    return 1;
}

static int64_t deadline_after(int64_t timeout_ms)
{
    int64_t now = xccl_now_ms();

    return timeout_ms > INT64_MAX - now ? INT64_MAX : now + timeout_ms;
}

static xccl_status_t file_set(xccl_store_t *s, const char *key, const void *val, size_t len)
{
    file_store_t *fs   = (file_store_t *)s;
    size_t        klen = strlen(key);
    uint64_t      size;
    xccl_status_t st;

    XCCL_CHECK(file_begin(fs, F_WRLCK, &size));
    st = file_append(fs, size, REC_SET, key, klen, val, len);
    if (st == XCCL_OK) {
        st = xccl_kvmap_set(&fs->cache, key, klen, val, len);
        if (st != XCCL_OK) cache_reset(fs);
    }
    file_end(fs);
    return st;
}

static xccl_status_t file_get(xccl_store_t *s, const char *key, int64_t timeout_ms, void **val,
                              size_t *len)
{
    file_store_t    *fs       = (file_store_t *)s;
    int64_t          start    = xccl_now_ms();
    int64_t          deadline = deadline_after(timeout_ms);
    int64_t          delay    = 1;
    uint64_t         size;
    xccl_kv_entry_t *e;
    xccl_status_t    st;

    for (;;) {
        XCCL_CHECK(file_begin(fs, F_RDLCK, &size));
        e = xccl_kvmap_find(&fs->cache, key, strlen(key));
        if (e != NULL) {
            *val = xccl_store_memdup(e->val, e->vlen);
            *len = e->vlen;
            st   = *val ? XCCL_OK
                        : XCCL_ERROR(XCCL_ERR_NO_MEMORY, "file store: value of %zu bytes",
                                     e->vlen);
            file_end(fs);
            return st;
        }
        file_end(fs);
        do {
            if (!backoff(deadline, &delay))
                return XCCL_ERROR(XCCL_ERR_TIMEOUT,
                                  "file store '%s': get('%.128s') timed out after %" PRId64
                                  " ms: key '%.128s' was not set",
                                  fs->path, key, xccl_now_ms() - start, key);
        } while (!file_grew(fs, size));
    }
}

static xccl_status_t file_add(xccl_store_t *s, const char *key, int64_t delta, int64_t *result)
{
    file_store_t    *fs   = (file_store_t *)s;
    size_t           klen = strlen(key);
    uint64_t         size;
    xccl_kv_entry_t *e;
    xccl_status_t    st;

    XCCL_CHECK(file_begin(fs, F_WRLCK, &size));
    st = xccl_kvmap_add(&fs->cache, key, klen, delta, result);
    if (st == XCCL_OK) {
        e  = xccl_kvmap_find(&fs->cache, key, klen);
        st = file_append(fs, size, REC_SET, key, klen, e->val, e->vlen);
    }
    file_end(fs);
    return st;
}

/* Keys of keys[] not in the cache, into missing[] (when not NULL); returns their number. */
static size_t file_missing(file_store_t *fs, const char *const *keys, size_t nkeys,
                           const char **missing)
{
    size_t i, n = 0;

    for (i = 0; i < nkeys; i++)
        if (xccl_kvmap_find(&fs->cache, keys[i], strlen(keys[i])) == NULL) {
            if (missing != NULL) missing[n] = keys[i];
            n++;
        }
    return n;
}

static xccl_status_t file_wait(xccl_store_t *s, const char *const *keys, size_t nkeys,
                               int64_t timeout_ms)
{
    file_store_t *fs       = (file_store_t *)s;
    int64_t       start    = xccl_now_ms();
    int64_t       deadline = deadline_after(timeout_ms);
    int64_t       delay    = 1;
    uint64_t      size;
    size_t        n;
    const char  **missing;
    char          list[1200];

    for (;;) {
        XCCL_CHECK(file_begin(fs, F_RDLCK, &size));
        n = file_missing(fs, keys, nkeys, NULL);
        file_end(fs);
        if (n == 0) return XCCL_OK;
        do {
            if (backoff(deadline, &delay)) continue;
            missing = malloc(nkeys * sizeof(*missing));
            if (missing == NULL)
                return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "file store: wait for %zu keys", nkeys);
            XCCL_CHECK(file_begin(fs, F_RDLCK, &size));
            n = file_missing(fs, keys, nkeys, missing);
            file_end(fs);
            xccl_store_format_keys(list, sizeof(list), missing, n);
            free(missing);
            if (n == 0) return XCCL_OK;
            return XCCL_ERROR(XCCL_ERR_TIMEOUT,
                              "file store '%s': wait timed out after %" PRId64
                              " ms; %zu of %zu keys missing: %s",
                              fs->path, xccl_now_ms() - start, n, nkeys, list);
        } while (!file_grew(fs, size));
    }
}

static xccl_status_t file_check(xccl_store_t *s, const char *const *keys, size_t nkeys,
                                int *all_present)
{
    file_store_t *fs = (file_store_t *)s;
    uint64_t      size;

    XCCL_CHECK(file_begin(fs, F_RDLCK, &size));
    *all_present = file_missing(fs, keys, nkeys, NULL) == 0;
    file_end(fs);
    return XCCL_OK;
}

static xccl_status_t file_compare_set(xccl_store_t *s, const char *key, const void *expected,
                                      size_t elen, const void *desired, size_t dlen, void **out,
                                      size_t *outlen)
{
    file_store_t *fs   = (file_store_t *)s;
    size_t        klen = strlen(key);
    uint64_t      size;
    int           changed;
    xccl_status_t st;

    XCCL_CHECK(file_begin(fs, F_WRLCK, &size));
    st = xccl_kvmap_compare_set(&fs->cache, key, klen, expected, elen, desired, dlen, out,
                                outlen, &changed);
    if (st == XCCL_OK && changed) {
        st = file_append(fs, size, REC_SET, key, klen, desired, dlen);
        if (st != XCCL_OK) {
            free(*out);
            *out = NULL;
        }
    }
    file_end(fs);
    return st;
}

static xccl_status_t file_delete_key(xccl_store_t *s, const char *key, int *deleted)
{
    file_store_t *fs   = (file_store_t *)s;
    size_t        klen = strlen(key);
    uint64_t      size;
    xccl_status_t st = XCCL_OK;

    XCCL_CHECK(file_begin(fs, F_WRLCK, &size));
    *deleted = xccl_kvmap_find(&fs->cache, key, klen) != NULL;
    if (*deleted) {
        st = file_append(fs, size, REC_DELETE, key, klen, NULL, 0);
        if (st == XCCL_OK) xccl_kvmap_delete(&fs->cache, key, klen);
    }
    file_end(fs);
    return st;
}

static xccl_status_t file_num_keys(xccl_store_t *s, int64_t *n)
{
    file_store_t *fs = (file_store_t *)s;
    uint64_t      size;

    XCCL_CHECK(file_begin(fs, F_RDLCK, &size));
    *n = (int64_t)fs->cache.count;
    file_end(fs);
    return XCCL_OK;
}

static void file_destroy(xccl_store_t *s)
{
    file_store_t *fs = (file_store_t *)s;
    uint64_t      size;

    /* count this store out; the last of world_size removes the file */
    if (fs->world_size > 0 && file_begin(fs, F_WRLCK, &size) == XCCL_OK) {
        if (file_append(fs, size, REC_DONE, NULL, 0, NULL, 0) == XCCL_OK) {
            fs->ndone++;
            if (fs->ndone >= fs->world_size && unlink(fs->path) != 0 && errno != ENOENT)
                XCCL_WARN("file store '%s': cannot remove the file: %s", fs->path,
                          strerror(errno));
        }
        file_end(fs);
    }
    close(fs->fd);
    xccl_kvmap_free(&fs->cache);
    pthread_mutex_destroy(&fs->lock);
    free(fs->path);
    free(fs);
}

static const xccl_store_vtable_t file_vtable = {
    .kind        = "file",
    .set         = file_set,
    .get         = file_get,
    .add         = file_add,
    .wait        = file_wait,
    .check       = file_check,
    .compare_set = file_compare_set,
    .delete_key  = file_delete_key,
    .num_keys    = file_num_keys,
    .destroy     = file_destroy,
};

xccl_status_t xccl_store_file_create(const char *path, int world_size, int64_t timeout_ms,
                                     xccl_store_t **out)
{
    file_store_t *fs;

    if (path == NULL || *path == '\0' || out == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "file store: %s",
                          out ? "empty path" : "out is NULL");
    fs = calloc(1, sizeof(*fs));
    if (fs == NULL || (fs->path = strdup(path)) == NULL) {
        free(fs);
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "file store '%.256s'", path);
    }
    fs->fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fs->fd < 0) {
        xccl_status_t st = XCCL_ERROR(XCCL_ERR_SYSTEM, "file store: cannot open '%.256s': %s",
                                      path, strerror(errno));
        free(fs->path);
        free(fs);
        return st;
    }
    xccl_store_init(&fs->base, &file_vtable, timeout_ms);
    pthread_mutex_init(&fs->lock, NULL);
    xccl_kvmap_init(&fs->cache);
    fs->world_size = world_size;
    *out           = &fs->base;
    return XCCL_OK;
}
