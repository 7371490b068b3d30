/* SPDX-License-Identifier: Apache-2.0
 *
 * fake_dev.h - a fake "device" executor (core/exec.h) for tests, installed for XCCL_MEM_CUDA
 * with xccl_exec_set_for_test:
 *   - asynchronous: copy, reduce, scale and divide are only queued (XCCL_INPROGRESS with an
 *     event); they run, in issue order like work on one stream, when an event is tested for
 *     the 2nd to 4th time (chosen per event by a seeded generator). Each operation reads its
 *     inputs when it runs, as a device kernel would, so an algorithm that changes an input
 *     before the operation finished, or sends a result before it exists, gets wrong data;
 *   - inaccessible memory: what fdev_alloc returns (page-aligned mappings) is PROT_NONE
 *     outside executor calls, so a direct CPU access by an algorithm or the core crashes the
 *     test. fdev_open(1) / fdev_open(0) open and close every mapping (the test filling and
 *     checking buffers; the simulator's network phase, see sim_opts_t.transfer_access).
 * Host memory passed to it (staging) is simply accessed. One translation unit per program:
 * everything here is static. Not thread-safe.
 */
#ifndef XCCL_TESTS_FAKE_DEV_H
#define XCCL_TESTS_FAKE_DEV_H

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/exec.h"
#include "core/reduce.h"

enum { FDEV_COPY, FDEV_REDUCE, FDEV_SCALE, FDEV_DIVIDE, FDEV_REDUCE_N, FDEV_MARK };

typedef struct fdev_op {
    int             kind;
    void           *dst;
    const void     *a, *b;
    size_t          n; /* bytes (copy) or elements */
    xccl_dtype_t    dtype;
    xccl_op_t       op;
    double          factor;
    int             div;
    const void     *srcs[XCCL_EXEC_REDUCE_MAX]; /* FDEV_REDUCE_N: n elements of k sources */
    int             k;
    int             tests_left; /* tests before it runs (with everything queued before it) */
    int             done;
    xccl_status_t   status;
    struct fdev_op *next; /* queue: not yet run */
} fdev_op_t;

typedef struct fdev_region {
    void  *p;
    size_t len;
} fdev_region_t;

static struct {
    fdev_region_t *reg;
    size_t         nreg, cap;
    int            open; /* mappings are readable and writable now */
    int            async; /* 0: operations run inside the call (still behind PROT_NONE) */
    uint64_t       rng;
    fdev_op_t     *head, *tail;
    size_t         queued, ran, live; /* operations queued / run, events not yet released */
} fdev = {.async = 1, .rng = 1};

static void fdev_protect(int open)
{
    for (size_t i = 0; i < fdev.nreg; i++) {
        if (mprotect(fdev.reg[i].p, fdev.reg[i].len, open ? PROT_READ | PROT_WRITE : PROT_NONE)) {
            perror("fake_dev: mprotect");
            abort();
        }
    }
}

/* Opens (1) or closes (0) every mapping of the fake device to the CPU. */
static void fdev_open(int open)
{
    if (open == fdev.open) return;
    fdev_protect(open);
    fdev.open = open;
}

static void *fdev_alloc(size_t nbytes)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t len  = (nbytes + page - 1) / page * page;
    void  *p;

    if (len == 0) len = page;
    p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    if (fdev.nreg == fdev.cap) {
        size_t         cap = fdev.cap ? 2 * fdev.cap : 64;
        fdev_region_t *r   = realloc(fdev.reg, cap * sizeof(*r));
        if (r == NULL) {
            munmap(p, len);
            return NULL;
        }
        fdev.reg = r;
        fdev.cap = cap;
    }
    memset(p, 0xA5, len); /* reading before writing shows */
    if (!fdev.open) mprotect(p, len, PROT_NONE);
    fdev.reg[fdev.nreg++] = (fdev_region_t){p, len};
    return p;
}

static void fdev_free(void *p)
{
    for (size_t i = 0; i < fdev.nreg; i++) {
        if (fdev.reg[i].p != p) continue;
        munmap(p, fdev.reg[i].len);
        fdev.reg[i] = fdev.reg[--fdev.nreg];
        return;
    }
    fprintf(stderr, "fake_dev: free of %p, which it did not allocate\n", p);
    abort();
}

static void fdev_run(fdev_op_t *o)
{
    switch (o->kind) {
    case FDEV_COPY: memmove(o->dst, o->a, o->n); o->status = XCCL_OK; break;
    case FDEV_REDUCE: o->status = xccl_reduce2(o->dst, o->a, o->b, o->n, o->dtype, o->op); break;
    case FDEV_SCALE: o->status = xccl_scale(o->dst, o->a, o->n, o->dtype, o->factor); break;
    case FDEV_REDUCE_N: { /* into a temporary: a kernel reads every source before it writes */
        size_t nb  = o->n * xccl_dtype_size(o->dtype);
        void  *tmp = malloc(nb ? nb : 1);
        o->status  = tmp == NULL ? XCCL_ERR_NO_MEMORY
                                 : xccl_reduce_n(tmp, o->srcs, o->k, o->n, o->dtype, o->op);
        if (o->status == XCCL_OK) memcpy(o->dst, tmp, nb);
        free(tmp);
        break;
    }
    default: o->status = xccl_divide(o->dst, o->a, o->n, o->dtype, o->div); break;
    }
    o->done = 1;
    fdev.ran++;
}

/* Runs the queue up to and including `last`, in issue order. */
static void fdev_run_until(fdev_op_t *last)
{
    int was = fdev.open;

    fdev_open(1);
    while (fdev.head != NULL) {
        fdev_op_t *o = fdev.head;
        fdev.head    = o->next;
        if (fdev.head == NULL) fdev.tail = NULL;
        fdev_run(o);
        if (o == last) break;
    }
    fdev_open(was);
}

static xccl_status_t fdev_issue(fdev_op_t proto, void **ev)
{
    fdev_op_t *o = malloc(sizeof(*o));

    if (o == NULL) return XCCL_ERR_NO_MEMORY;
    *o = proto;
    fdev.rng += 0x9e3779b97f4a7c15ull;
    o->tests_left = 2 + (int)((fdev.rng >> 33) % 3);
    fdev.queued++;
    if (!fdev.async) {
        int was = fdev.open;
        fdev_open(1);
        fdev_run(o);
        fdev_open(was);
        xccl_status_t st = o->status;
        free(o);
        *ev = NULL;
        return st;
    }
    if (fdev.tail) fdev.tail->next = o;
    else fdev.head = o;
    fdev.tail = o;
    fdev.live++;
    *ev = o;
    return XCCL_INPROGRESS;
}

/* Queues (exec.h queue_new): tokens; the fake runs every queue's operations in one order,
 * stricter than a device. The test checks that each communicator gets its own, that its
 * operations name it, and that every one is freed (fdev_queues_live). */
static long  fdev_queues_live;
static void *fdev_last_queue; /* the queue of the last operation issued */

static xccl_status_t fdev_queue_new(void **q)
{
    *q = malloc(1);
    if (*q == NULL) return XCCL_ERR_NO_MEMORY;
    __atomic_add_fetch(&fdev_queues_live, 1, __ATOMIC_RELAXED);
    return XCCL_OK;
}

static void fdev_queue_free(void *q)
{
    __atomic_sub_fetch(&fdev_queues_live, 1, __ATOMIC_RELAXED);
    free(q);
}

static xccl_status_t fdev_copy(void *q, void *dst, const void *src, size_t nbytes, void **ev)
{
    fdev_last_queue = q;
    return fdev_issue((fdev_op_t){.kind = FDEV_COPY, .dst = dst, .a = src, .n = nbytes}, ev);
}

static xccl_status_t fdev_reduce(void *q, void *dst, const void *a, const void *b, size_t count,
                                 xccl_dtype_t dtype, xccl_op_t op, void **ev)
{
    fdev_last_queue = q;
    return fdev_issue((fdev_op_t){.kind  = FDEV_REDUCE,
                                  .dst   = dst,
                                  .a     = a,
                                  .b     = b,
                                  .n     = count,
                                  .dtype = dtype,
                                  .op    = op},
                      ev);
}

static xccl_status_t fdev_scale(void *q, void *dst, const void *src, size_t count,
                                xccl_dtype_t dtype, double factor, void **ev)
{
    fdev_last_queue = q;
    return fdev_issue((fdev_op_t){.kind   = FDEV_SCALE,
                                  .dst    = dst,
                                  .a      = src,
                                  .n      = count,
                                  .dtype  = dtype,
                                  .factor = factor},
                      ev);
}

static xccl_status_t fdev_divide(void *q, void *dst, const void *src, size_t count,
                                 xccl_dtype_t dtype, int n, void **ev)
{
    fdev_last_queue = q;
    return fdev_issue((fdev_op_t){.kind  = FDEV_DIVIDE,
                                  .dst   = dst,
                                  .a     = src,
                                  .n     = count,
                                  .dtype = dtype,
                                  .div   = n},
                      ev);
}

static xccl_status_t fdev_reduce_n(void *q, void *dst, const void *const *srcs, int k,
                                   size_t count, xccl_dtype_t dtype, xccl_op_t op, void **ev)
{
    fdev_op_t o = {.kind = FDEV_REDUCE_N, .dst = dst, .n = count, .dtype = dtype, .op = op, .k = k};
    fdev_last_queue = q;
    if (k < 2 || k > XCCL_EXEC_REDUCE_MAX) return XCCL_ERR_INVALID_ARG;
    memcpy(o.srcs, srcs, (size_t)k * sizeof(*srcs));
    return fdev_issue(o, ev);
}

/* Pinned host memory: registrations of host ranges (staging bounce buffers), each of which
 * must be undone before the memory is freed (checked by the test: fdev_pinned == 0 at the end,
 * fdev_pin_calls > 0). Executor copies to and from a range are checked to stay inside it. */
static long fdev_pinned, fdev_pin_calls;

static xccl_status_t fdev_host_register(void *p, size_t nbytes)
{
    if (p == NULL || nbytes == 0) return XCCL_ERR_INVALID_ARG;
    __atomic_add_fetch(&fdev_pinned, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&fdev_pin_calls, 1, __ATOMIC_RELAXED);
    return XCCL_OK;
}

static void fdev_host_release(void *p)
{
    __atomic_sub_fetch(&fdev_pinned, 1, __ATOMIC_RELAXED);
    free(p);
}

/* Peer access in one address space (the simulator's ranks): a blob is {magic, address,
 * bytes}; fdev_no_export makes export fail as memory a device cannot share does, and
 * fdev_refuse_import = k refuses every k-th import for now (XCCL_INPROGRESS), as the device
 * layer does while a caller's stream waits for a gate. */
static int      fdev_no_export;
static unsigned fdev_refuse_import, fdev_imports, fdev_refused;
#define FDEV_BLOB_MAGIC 0x66646576626c6f62ull

static xccl_status_t fdev_export(const void *ptr, size_t nbytes, void *blob, size_t *len)
{
    uint64_t b[3] = {FDEV_BLOB_MAGIC, (uint64_t)(uintptr_t)ptr, nbytes};
    if (fdev_no_export) return XCCL_ERR_NOT_SUPPORTED;
    memcpy(blob, b, sizeof(b));
    *len = sizeof(b);
    return XCCL_OK;
}

static xccl_status_t fdev_import(const void *blob, size_t len, void **ptr)
{
    uint64_t b[3];
    if (len != sizeof(b)) return XCCL_ERR_INVALID_ARG;
    memcpy(b, blob, sizeof(b));
    if (b[0] != FDEV_BLOB_MAGIC) return XCCL_ERR_INVALID_ARG;
    if (fdev_refuse_import > 0 && ++fdev_imports % fdev_refuse_import == 0) {
        fdev_refused++;
        return XCCL_INPROGRESS;
    }
    *ptr = (void *)(uintptr_t)b[1];
    return XCCL_OK;
}

static void fdev_mark_free(fdev_op_t *m);

static xccl_status_t fdev_test(void *ev)
{
    fdev_op_t    *o = ev;
    xccl_status_t st;

    if (o->kind == FDEV_MARK) { /* the caller's stream: not on the queue */
        if (--o->tests_left > 0) return XCCL_INPROGRESS;
        fdev_mark_free(o);
        return XCCL_OK;
    }
    if (!o->done && --o->tests_left > 0) return XCCL_INPROGRESS;
    if (!o->done) fdev_run_until(o);
    st = o->status;
    free(o);
    fdev.live--;
    return st;
}

/* Streams: order_after counts its calls and remembers the stream; with fgate.order_behind set
 * it answers that the stream is behind, with an event (FDEV_MARK, not on the queue) that
 * completes after a few tests or is dropped; gates are tickets 1, 2, ... whose state is kept (closed, open, opened twice
 * - a bug) and gate_wait counts its calls with the last ticket and stream. */
enum { FGATE_CLOSED = 1, FGATE_OPEN = 2, FGATE_TWICE = 3 };

static struct {
    unsigned char *state; /* by ticket */
    size_t         cap;
    uint64_t       next;
    unsigned       orders, waits;
    void          *order_stream, *wait_stream;
    uint64_t       wait_ticket;
    int            order_behind; /* order_after answers XCCL_INPROGRESS */
    long           marks_live;   /* its events not yet completed or dropped */
    pthread_mutex_t lock; /* gates are taken by posting threads, opened by the progress thread */
} fgate = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* Called by posting threads without the context's lock: touches fgate only. */
static xccl_status_t fdev_order_after(void *stream, void **ev)
{
    fdev_op_t *m = NULL;

    pthread_mutex_lock(&fgate.lock);
    fgate.orders++;
    fgate.order_stream = stream;
    if (fgate.order_behind && (m = calloc(1, sizeof(*m))) != NULL) {
        m->kind       = FDEV_MARK;
        m->tests_left = 2 + (int)(fgate.orders % 3);
        fgate.marks_live++;
    }
    pthread_mutex_unlock(&fgate.lock);
    *ev = m;
    return m != NULL ? XCCL_INPROGRESS : XCCL_OK;
}

static void fdev_mark_free(fdev_op_t *m)
{
    pthread_mutex_lock(&fgate.lock);
    fgate.marks_live--;
    pthread_mutex_unlock(&fgate.lock);
    free(m);
}

static void fdev_drop_event(void *ev)
{
    fdev_op_t *o = ev;
    if (o->kind != FDEV_MARK) {
        fprintf(stderr, "fake_dev: drop_event of a queued operation\n");
        abort();
    }
    fdev_mark_free(o);
}

static xccl_status_t fdev_gate_new(uint64_t *ticket)
{
    pthread_mutex_lock(&fgate.lock);
    if (fgate.next + 1 >= fgate.cap) {
        size_t         cap = fgate.cap ? 2 * fgate.cap : 1024;
        unsigned char *s   = realloc(fgate.state, cap);
        if (s == NULL) {
            pthread_mutex_unlock(&fgate.lock);
            return XCCL_ERR_NO_MEMORY;
        }
        memset(s + fgate.cap, 0, cap - fgate.cap);
        fgate.state = s;
        fgate.cap   = cap;
    }
    *ticket              = ++fgate.next;
    fgate.state[*ticket] = FGATE_CLOSED;
    pthread_mutex_unlock(&fgate.lock);
    return XCCL_OK;
}

static void fdev_gate_open(uint64_t ticket)
{
    pthread_mutex_lock(&fgate.lock);
    if (ticket == 0 || ticket > fgate.next) {
        fprintf(stderr, "fake_dev: gate_open of unknown ticket %llu\n", (unsigned long long)ticket);
        abort();
    }
    fgate.state[ticket] = fgate.state[ticket] == FGATE_CLOSED ? FGATE_OPEN : FGATE_TWICE;
    pthread_mutex_unlock(&fgate.lock);
}

static xccl_status_t fdev_gate_wait(uint64_t ticket, void *stream)
{
    pthread_mutex_lock(&fgate.lock);
    fgate.waits++;
    fgate.wait_ticket = ticket;
    fgate.wait_stream = stream;
    pthread_mutex_unlock(&fgate.lock);
    return XCCL_OK;
}

/* The state of a ticket's gate (FGATE_*), and how many tickets given out were not opened
 * exactly once (0: every gate opened once). */
static inline int fgate_state(uint64_t ticket)
{
    int st;
    pthread_mutex_lock(&fgate.lock);
    st = ticket >= 1 && ticket <= fgate.next ? fgate.state[ticket] : 0;
    pthread_mutex_unlock(&fgate.lock);
    return st;
}

static inline size_t fgate_unbalanced(void)
{
    size_t n = 0;
    for (uint64_t t = 1; t <= fgate.next; t++) n += fgate_state(t) != FGATE_OPEN;
    return n;
}

static const xccl_exec_ops_t fdev_ops = {
    .name        = "fake-device",
    .mem         = XCCL_MEM_CUDA,
    .copy        = fdev_copy,
    .reduce      = fdev_reduce,
    .scale       = fdev_scale,
    .divide      = fdev_divide,
    .test        = fdev_test,
    .queue_new   = fdev_queue_new,
    .queue_free  = fdev_queue_free,
    .alloc       = fdev_alloc,
    .free        = fdev_free,
    .order_after = fdev_order_after,
    .drop_event  = fdev_drop_event,
    .gate_new    = fdev_gate_new,
    .gate_open   = fdev_gate_open,
    .gate_wait   = fdev_gate_wait,
    .host_register   = fdev_host_register,
    .host_release    = fdev_host_release,
    .export_mem  = fdev_export,
    .import_mem  = fdev_import,
    .reduce_n    = fdev_reduce_n,
};

#endif /* XCCL_TESTS_FAKE_DEV_H */
