/* SPDX-License-Identifier: Apache-2.0
 *
 * rcache.c - registration cache (rcache.h).
 *
 * Entries
 *   An entry is one registration: [start, end) of one memory type (host ranges widened to whole
 *   pages), the transport's handle and a reference count. It is in one of two states:
 *     CACHED    in the lookup index; when unreferenced it is also on the LRU list (idle)
 *     DETACHED  out of the index (invalidated, or covered by a newer merged registration)
 *               and still referenced; deregistered by its last put, on the detached list
 *   An entry that leaves the index unreferenced is deregistered at once.
 *
 * Index
 *   CACHED entries never overlap: a request that overlaps some without being covered by one
 *   registers the union of the request and all of them, and detaches them. The index is an
 *   array sorted by start, searched by bisection; insertion and removal move the tail of the
 *   array, which happens only next to a registration (a system call that pins pages) and over
 *   a bounded number of entries.
 *
 * Bounds
 *   Idle entries are kept up to XCCL_RCACHE_MAX_ENTRIES entries (default 1024) and
 *   XCCL_RCACHE_MAX_BYTES bytes (default 1 GiB), the least recently used evicted first.
 *   Referenced entries do not count: a registration in use is never evicted. When mem_reg
 *   fails, the idle entries are deregistered and it is tried once more (pinned-memory limits).
 *
 * Memory freed or reused (memhook.h)
 *   A registration pins the pages its range had when it was made: once the range is unmapped
 *   (free of a large chunk, munmap, madvise(MADV_DONTNEED), ...) and mapped again, the same
 *   address has other pages and the registration is stale. Every host entry is watched by the
 *   memory hooks; the ranges they report are read before every lookup and invalidate the
 *   entries whose requested bytes they overlap (when events were lost: every entry), not
 *   those that only share a page with a freed neighbour (see on_event). Without hooks (XCCL_MEM_HOOKS=0,
 *   or they could not be installed), and for memory types no hook sees (device memory), an
 *   entry is deregistered as soon as its last reference goes: registered per use, never stale.
 *   The core's own buffers (staging, scratch) are treated alike, and it also invalidates them
 *   explicitly before freeing them.
 */
#include "core/rcache.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/check.h"
#include "core/memhook.h"

enum { RREG_CACHED = 1, RREG_DETACHED = 2 };

struct xccl_rreg {
    uintptr_t       start, end;   /* registered (host: whole pages) */
    uintptr_t       ustart, uend; /* the bytes lookups asked for: within [start, end) */
    xccl_mem_type_t mem;
    void           *mr;
    int             refs;
    int             state;
    xccl_rreg_t    *prev, *next; /* LRU (CACHED, idle) or detached list; NULL otherwise */
};

struct xccl_rcache {
    const xccl_transport_ops_t *ops;
    xccl_tp_ctx_t              *tc;
    xccl_rreg_t               **idx; /* CACHED entries, by start; disjoint */
    size_t                      n, cap;
    xccl_rreg_t                 lru;      /* sentinel: lru.next is the most recently used */
    xccl_rreg_t                 detached; /* sentinel */
    size_t                      nidle, idle_bytes;
    size_t                      max_idle, max_idle_bytes;
    uintptr_t                   page;
    int                         hooks; /* memory hooks active: host entries may stay idle */
    int                         hooks_asked; /* xccl_rcache_watch_memory was called */
    xccl_memhook_cursor_t       cur;   /* the hooks' events read so far */
};

/* ---- lists ----------------------------------------------------------------------------------- */

static void list_init(xccl_rreg_t *s) { s->prev = s->next = s; }

static void list_push(xccl_rreg_t *s, xccl_rreg_t *e)
{
    e->prev       = s;
    e->next       = s->next;
    s->next->prev = e;
    s->next       = e;
}

static void list_del(xccl_rreg_t *e)
{
    e->prev->next = e->next;
    e->next->prev = e->prev;
    e->prev = e->next = NULL;
}

static void idle_add(xccl_rcache_t *rc, xccl_rreg_t *e)
{
    list_push(&rc->lru, e);
    rc->nidle++;
    rc->idle_bytes += e->end - e->start;
}

static void idle_del(xccl_rcache_t *rc, xccl_rreg_t *e)
{
    list_del(e);
    rc->nidle--;
    rc->idle_bytes -= e->end - e->start;
}

/* ---- index ----------------------------------------------------------------------------------- */

/* First position whose entry ends after addr (the only one that may contain addr). */
static size_t idx_search(const xccl_rcache_t *rc, uintptr_t addr)
{
    size_t lo = 0, hi = rc->n;

    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (rc->idx[mid]->end <= addr) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static xccl_status_t idx_insert(xccl_rcache_t *rc, xccl_rreg_t *e)
{
    size_t pos;

    if (rc->n == rc->cap) {
        size_t        cap = rc->cap ? rc->cap * 2 : 64;
        xccl_rreg_t **idx = realloc(rc->idx, cap * sizeof(*idx));
        if (idx == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "registration cache: out of memory");
        rc->idx = idx;
        rc->cap = cap;
    }
    pos = idx_search(rc, e->start);
    memmove(&rc->idx[pos + 1], &rc->idx[pos], (rc->n - pos) * sizeof(*rc->idx));
    rc->idx[pos] = e;
    rc->n++;
    return XCCL_OK;
}

static void idx_remove_at(xccl_rcache_t *rc, size_t pos)
{
    memmove(&rc->idx[pos], &rc->idx[pos + 1], (rc->n - pos - 1) * sizeof(*rc->idx));
    rc->n--;
}

/* ---- entries --------------------------------------------------------------------------------- */

static void reg_destroy(xccl_rcache_t *rc, xccl_rreg_t *e)
{
    if (rc->hooks && e->mem == XCCL_MEM_HOST) xccl_memhook_unwatch(e->start, e->end);
    rc->ops->mem_dereg(rc->tc, e->mr);
    free(e);
}

/* Takes e (at index position pos) out of the index: deregistered now when unreferenced, else
 * by its last put. */
static void reg_detach_at(xccl_rcache_t *rc, size_t pos)
{
    xccl_rreg_t *e = rc->idx[pos];

    idx_remove_at(rc, pos);
    if (e->refs == 0) {
        idle_del(rc, e);
        reg_destroy(rc, e);
    } else {
        e->state = RREG_DETACHED;
        list_push(&rc->detached, e);
    }
}

/* Evicts idle entries, least recently used first, until the bounds hold (max: 0 = all). */
static void evict(xccl_rcache_t *rc, size_t max_idle, size_t max_bytes)
{
    while (rc->nidle > 0 && (rc->nidle > max_idle || rc->idle_bytes > max_bytes)) {
        xccl_rreg_t *e   = rc->lru.prev;
        size_t       pos = idx_search(rc, e->start);
        reg_detach_at(rc, pos); /* idle: deregistered now */
    }
}

/* ---- interface ------------------------------------------------------------------------------- */

xccl_status_t xccl_rcache_new(const xccl_transport_ops_t *ops, xccl_tp_ctx_t *tc,
                              xccl_rcache_t **out)
{
    xccl_rcache_t *rc;
    long           page = sysconf(_SC_PAGESIZE);

    if (ops == NULL || ops->mem_reg == NULL || ops->mem_dereg == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "registration cache: the transport %s does not "
                          "register memory", ops && ops->name ? ops->name : "?");
    rc = calloc(1, sizeof(*rc));
    if (rc == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "registration cache: out of memory");
    rc->ops = ops;
    rc->tc  = tc;
    list_init(&rc->lru);
    list_init(&rc->detached);
    rc->max_idle       = (size_t)xccl_env_int("XCCL_RCACHE_MAX_ENTRIES", 1024);
    rc->max_idle_bytes = (size_t)xccl_env_int("XCCL_RCACHE_MAX_BYTES", (int64_t)1 << 30);
    rc->page           = page > 0 ? (uintptr_t)page : 4096;
    *out = rc;
    return XCCL_OK;
}

void xccl_rcache_free(xccl_rcache_t *rc)
{
    int held = 0;

    if (rc == NULL) return;
    while (rc->n > 0) {
        xccl_rreg_t *e = rc->idx[rc->n - 1];
        held += e->refs != 0;
        if (e->refs == 0) list_del(e);
        rc->n--;
        reg_destroy(rc, e);
    }
    while (rc->detached.next != &rc->detached) {
        xccl_rreg_t *e = rc->detached.next;
        held++;
        list_del(e);
        reg_destroy(rc, e);
    }
    if (held > 0)
        XCCL_WARN("registration cache of %s: %d registration(s) still referenced at free",
                  rc->ops->name, held);
    free(rc->idx);
    free(rc);
}

/* A range the memory hooks reported: entries whose requested bytes it overlaps leave the index.
 * Not those it only shares a page with: a page holding bytes still allocated (those of the
 * entry, which a lookup asked for) cannot be returned to the system by freeing its other
 * bytes; and the pages a free can return are free chunks, each reported when it was freed.
 * (munmap, madvise, mmap MAP_FIXED report whole pages, which overlap the requested bytes of
 * every entry whose pages they overlap.) */
static void on_event(void *arg, uintptr_t start, uintptr_t end)
{
    xccl_rcache_t *rc = arg;
    size_t         pos, last;

    pos = last = idx_search(rc, start);
    while (last < rc->n && rc->idx[last]->start < end) last++;
    for (size_t k = last; k > pos; k--) {
        xccl_rreg_t *e = rc->idx[k - 1];
        if (e->ustart < end && start < e->uend) reg_detach_at(rc, k - 1);
    }
}

/* Applies what the memory hooks reported since the last lookup. */
static void sync_events(xccl_rcache_t *rc)
{
    if (xccl_memhook_drain(&rc->cur, on_event, rc) != 0) {
        XCCL_TRACE("registration cache of %s: memory events lost; invalidating all %zu "
                   "registration(s)", rc->ops->name, rc->n);
        xccl_rcache_invalidate(rc, NULL, SIZE_MAX);
    }
}

void xccl_rcache_watch_memory(xccl_rcache_t *rc)
{
    if (rc->hooks_asked) return;
    rc->hooks_asked = 1;
    rc->hooks       = xccl_memhook_start();
    if (rc->hooks) xccl_memhook_cursor_init(&rc->cur);
}

xccl_status_t xccl_rcache_get(xccl_rcache_t *rc, void *ptr, size_t nbytes, xccl_mem_type_t mem,
                              xccl_rreg_t **reg, void **mr)
{
    uintptr_t     start = (uintptr_t)ptr, end = start + nbytes;
    uintptr_t     ustart = start, uend = end;
    size_t        pos, first, last;
    xccl_rreg_t  *e;
    xccl_status_t st;

    *reg = NULL;
    *mr  = NULL;
    if (nbytes == 0) return XCCL_OK;
    if (end < start)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "registration cache: range wraps around");
    if (mem == XCCL_MEM_HOST) { /* pinning works on whole pages: so does the cache */
        start &= ~(rc->page - 1);
        end = (end + rc->page - 1) & ~(rc->page - 1);
    }
    xccl_rcache_watch_memory(rc);
    if (rc->hooks) sync_events(rc);
    pos = idx_search(rc, start);
    if (pos < rc->n) {
        e = rc->idx[pos];
        if (e->start <= start && end <= e->end && e->mem == mem) { /* hit */
            if (e->refs++ == 0) idle_del(rc, e);
            if (ustart < e->ustart) e->ustart = ustart;
            if (uend > e->uend) e->uend = uend;
            *reg = e;
            *mr  = e->mr;
            return XCCL_OK;
        }
    }
    /* miss: the new registration covers the request and every entry it overlaps */
    first = last = pos;
    while (last < rc->n && rc->idx[last]->start < end) {
        if (rc->idx[last]->mem == mem) {
            if (rc->idx[last]->start < start) start = rc->idx[last]->start;
            if (rc->idx[last]->end > end) end = rc->idx[last]->end;
            if (rc->idx[last]->ustart < ustart) ustart = rc->idx[last]->ustart;
            if (rc->idx[last]->uend > uend) uend = rc->idx[last]->uend;
        }
        last++;
    }
    e = calloc(1, sizeof(*e));
    if (e == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "registration cache: out of memory");
    e->start  = start;
    e->end    = end;
    e->ustart = ustart;
    e->uend   = uend;
    e->mem    = mem;
    st       = rc->ops->mem_reg(rc->tc, (void *)start, end - start, mem, &e->mr);
    if (st < 0 && rc->nidle > 0) { /* perhaps a limit on pinned memory: let the idle ones go */
        XCCL_INFO("registration cache of %s: registering %zu bytes failed; retrying without "
                  "%zu idle registration(s)", rc->ops->name, (size_t)(end - start), rc->nidle);
        evict(rc, 0, 0);
        first = last = idx_search(rc, start);
        while (last < rc->n && rc->idx[last]->start < end) last++;
        st = rc->ops->mem_reg(rc->tc, (void *)start, end - start, mem, &e->mr);
    }
    if (st < 0) {
        free(e);
        return st;
    }
    if (rc->hooks && mem == XCCL_MEM_HOST) xccl_memhook_watch(e->start, e->end);
    /* the overlapped entries leave the index (unreferenced ones are deregistered now) */
    for (size_t k = last; k > first; k--) reg_detach_at(rc, k - 1);
    st = idx_insert(rc, e);
    if (st < 0) {
        reg_destroy(rc, e);
        return st;
    }
    e->state = RREG_CACHED;
    e->refs  = 1;
    *reg     = e;
    *mr      = e->mr;
    return XCCL_OK;
}

void xccl_rcache_put(xccl_rcache_t *rc, xccl_rreg_t *reg)
{
    if (reg == NULL || --reg->refs > 0) return;
    if (reg->state == RREG_DETACHED) {
        list_del(reg);
        reg_destroy(rc, reg);
        return;
    }
    if (!rc->hooks || reg->mem != XCCL_MEM_HOST) { /* nothing would tell it is stale later */
        size_t pos = idx_search(rc, reg->start);
        idx_remove_at(rc, pos);
        reg_destroy(rc, reg);
        return;
    }
    idle_add(rc, reg);
    evict(rc, rc->max_idle, rc->max_idle_bytes);
}

void xccl_rcache_invalidate(xccl_rcache_t *rc, const void *ptr, size_t nbytes)
{
    uintptr_t start = (uintptr_t)ptr, end = start + nbytes;
    size_t    pos, last;

    if (rc == NULL || nbytes == 0) return;
    if (end < start) end = UINTPTR_MAX;
    pos = last = idx_search(rc, start);
    while (last < rc->n && rc->idx[last]->start < end) last++;
    for (size_t k = last; k > pos; k--) reg_detach_at(rc, k - 1);
}
