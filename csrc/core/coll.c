/* SPDX-License-Identifier: Apache-2.0
 *
 * coll.c - the operations of the public API (point-to-point and collectives), the task
 * primitives algorithms are written against, call fingerprints and mismatch handling.
 *
 * A collective goes through: argument checks (nothing moves on error) -> algorithm choice ->
 * prologue (normalise buffers as task.h describes: copy-in, PREMUL scaling) -> sequence number
 * and fingerprint under the context lock -> eager first progress -> ... -> epilogue (AVG
 * division) -> completion.
 */
#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/reduce.h"

/* ------------------------------------------------------------------------------------------ */
/* Fingerprints                                                                                */
/* ------------------------------------------------------------------------------------------ */

#define FP_COUNT_BITS 40
#define FP_ROOT_NONE  0xFFFu

uint64_t xccl_fp_make(xccl_coll_t coll, xccl_dtype_t dtype, xccl_op_t op, int root,
                      uint64_t count)
{
    uint64_t r = root < 0 || root >= (int)FP_ROOT_NONE ? FP_ROOT_NONE : (uint64_t)root;

    return ((uint64_t)(coll & 0xF) << 60) | ((uint64_t)(dtype & 0xF) << 56) |
           ((uint64_t)(op & 0xF) << 52) | (r << 40) | (count & ((1ull << FP_COUNT_BITS) - 1));
}

const char *xccl_fp_str(uint64_t fp, char *buf, size_t len)
{
    xccl_coll_t  coll  = (xccl_coll_t)(fp >> 60);
    xccl_dtype_t dtype = (xccl_dtype_t)((fp >> 56) & 0xF);
    xccl_op_t    op    = (xccl_op_t)((fp >> 52) & 0xF);
    unsigned     root  = (unsigned)((fp >> 40) & 0xFFF);
    uint64_t     count = fp & ((1ull << FP_COUNT_BITS) - 1);
    int          n;

    if (coll == XCCL_COLL_BARRIER) {
        snprintf(buf, len, "barrier()");
        return buf;
    }
    n = snprintf(buf, len, "%s(dtype=%s, count=%llu", xccl_coll_name(coll), xccl_dtype_name(dtype),
                 (unsigned long long)count);
    if (coll == XCCL_COLL_ALLREDUCE || coll == XCCL_COLL_REDUCE || coll == XCCL_COLL_REDUCE_SCATTER)
        n += snprintf(buf + n, len - (size_t)n, ", op=%s", xccl_op_name(op));
    if (root != FP_ROOT_NONE) n += snprintf(buf + n, len - (size_t)n, ", root=%u", root);
    snprintf(buf + n, len - (size_t)n, ")");
    return buf;
}

/* ------------------------------------------------------------------------------------------ */
/* Requests                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* The queue a task's executor operations run on: its communicator's. */
static void *task_queue(const xccl_task_t *t)
{
    return xccl_comm_queue_of(t->work->comm, t->args.mem);
}

static void req_init(xccl_req_t *r, xccl_work_t *w, req_kind_t kind, int world_peer, void *buf,
                     size_t nbytes, uint64_t tag)
{
    r->kind    = kind;
    r->peer    = world_peer;
    r->src     = -1;
    r->buf     = buf;
    r->nbytes  = nbytes;
    r->tag     = tag;
    r->work    = w;
    r->comm_id = w->comm->id;
    r->fp      = w->fp;
    r->status  = XCCL_INPROGRESS;
}

/* A control message that no Work owns: a mismatch or failure notice (`flags`) carrying
 * `text`, or (text == NULL) a fingerprint check. */
static void send_ctrl_flags(xccl_comm_t *comm, int peer, uint64_t seq, uint64_t fp,
                            const char *text, uint64_t flags);
static void send_ctrl(xccl_comm_t *comm, int peer, uint64_t seq, uint64_t fp, const char *text)
{
    send_ctrl_flags(comm, peer, seq, fp, text, 0);
}

void xccl_coll_notify_failure(xccl_work_t *w, const char *msg)
{
    xccl_comm_t *comm = w->comm;

    if (w->notified || comm->destroyed) return;
    for (int p = 0; p < comm->size; p++) {
        if (p != comm->rank) send_ctrl_flags(comm, p, w->seq, w->fp, msg, TAG_CTRL_FAIL);
    }
}

static void send_ctrl_flags(xccl_comm_t *comm, int peer, uint64_t seq, uint64_t fp,
                            const char *text, uint64_t flags)
{
    xccl_ctx_t *ctx = comm->ctx;
    size_t      len = text ? strlen(text) + 1 : 0;
    xccl_req_t *r   = len ? calloc(1, sizeof(*r) + len) : xccl_req_get(ctx);

    if (r == NULL) return;
    r->text    = len > 0;
    r->kind    = REQ_SEND;
    r->peer    = comm->world[peer];
    r->comm_id = comm->id;
    r->tag     = tag_ctrl(seq) | (text ? flags : TAG_CTRL_CHECK);
    r->fp      = fp;
    r->buf     = len ? (char *)(r + 1) : NULL;
    r->nbytes  = len;
    if (len) memcpy(r->buf, text, len);
    if (ctx->peer_dead[r->peer] != NULL || xccl_req_post_send(ctx, r) < 0) xccl_req_put(ctx, r);
    /* on success the request frees itself when sent (work == NULL, see ctx.c) */
}

/* ------------------------------------------------------------------------------------------ */
/* Task primitives (task.h)                                                                    */
/* ------------------------------------------------------------------------------------------ */

const xccl_coll_args_t *xccl_task_args(const xccl_task_t *t) { return &t->args; }
uint64_t               *xccl_task_state(xccl_task_t *t) { return t->state; }

int xccl_task_rank(const xccl_task_t *t)
{
    return t->parent != NULL ? t->rank : t->work->comm->rank;
}

int xccl_task_size(const xccl_task_t *t)
{
    return t->parent != NULL ? t->size : t->work->comm->size;
}

/* Creates and posts one request of the task now. */
static xccl_status_t task_post_now(xccl_task_t *t, req_kind_t kind, int peer, void *buf,
                                   size_t nbytes, uint32_t step)
{
    xccl_work_t  *w    = t->work;
    xccl_comm_t  *comm = w->comm;
    xccl_req_t   *r;
    xccl_status_t st;

    r = xccl_req_get(comm->ctx);
    if (r == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "%s: out of memory", w->name);
    req_init(r, w, kind, comm->world[peer], buf, nbytes, tag_coll(w->seq, step));
    r->step  = step;
    r->mem   = t->args.mem;
    r->wnext = t->reqs;
    t->reqs  = r;
    t->npending++;
    if (kind == REQ_SEND && peer == (comm->rank + 1) % comm->size) t->sent_next = 1;
    st = kind == REQ_SEND ? xccl_req_post_send(comm->ctx, r) : xccl_req_post_recv(comm->ctx, r);
    if (st < 0) {
        r->state  = REQ_DONE;
        r->status = st;
        t->npending--;
    }
    return st;
}

/* Posts the held requests whose events have all finished, in posting order. A failed post
 * stays in t->reqs as a finished request with its error, which xccl_task_test reports. */
static void task_release_held(xccl_task_t *t)
{
    while (t->held != NULL && t->held->fence <= t->ev_first) {
        xccl_held_t *h = t->held;
        t->held        = h->next;
        if (t->held == NULL) t->held_tail = NULL;
        t->nheld--;
        (void)task_post_now(t, h->kind, h->peer, h->buf, h->nbytes, h->step);
        free(h);
    }
}

/* Reports a failure of the task's executor (its own message, from the thread's last error,
 * is kept) and makes it sticky on the task. */
static xccl_status_t task_exec_fail(xccl_task_t *t, xccl_status_t st, const char *what)
{
    xccl_work_t *w = t->work;
    char         why[256];

    snprintf(why, sizeof(why), "%s", xccl_last_error());
    st = XCCL_ERROR(st, "%s: %s on the %s executor failed on rank %d: %s", w->name, what,
                    t->exec->name, w->comm->rank, why[0] ? why : xccl_status_string(st));
    if (t->ev_error == XCCL_OK) t->ev_error = st;
    return st;
}

/* Tests the task's executor events, oldest first, up to the first unfinished one, then posts
 * what they held back. */
static void task_poll_events(xccl_task_t *t)
{
    while (t->nev > 0) {
        xccl_status_t st = t->exec->test(t->ev[t->ev_head]);
        if (st == XCCL_INPROGRESS) break;
        if (st < 0 && t->ev_error == XCCL_OK) (void)task_exec_fail(t, st, "queued work");
        t->ev_head++;
        t->nev--;
        t->ev_first++;
    }
    if (t->nev == 0) t->ev_head = 0;
    if (t->held != NULL) task_release_held(t);
}

/* Takes the outcome of an executor call: a queued event is recorded (so later posts wait for
 * it), an error is made sticky on the task. */
static xccl_status_t task_exec_result(xccl_task_t *t, xccl_status_t st, void *ev,
                                      const char *what)
{
    if (st == XCCL_INPROGRESS) {
        if (t->ev_head + t->nev == t->ev_cap) {
            if (t->ev_head > 0) {
                memmove(t->ev, t->ev + t->ev_head, (size_t)t->nev * sizeof(*t->ev));
                t->ev_head = 0;
            } else {
                int    cap = t->ev_cap ? 2 * t->ev_cap : 8;
                void **v   = realloc(t->ev, (size_t)cap * sizeof(*v));
                if (v == NULL) {
                    /* cannot track it: let it finish here rather than lose the ordering */
                    while ((st = t->exec->test(ev)) == XCCL_INPROGRESS) xccl_cpu_relax();
                    goto done;
                }
                t->ev     = v;
                t->ev_cap = cap;
            }
        }
        t->ev[t->ev_head + t->nev++] = ev;
        t->ev_issued++;
        return XCCL_OK;
    }
done:
    return st < 0 ? task_exec_fail(t, st, what) : st;
}

static xccl_status_t task_post(xccl_task_t *t, req_kind_t kind, int peer, void *buf,
                               size_t nbytes, uint32_t step)
{
    xccl_work_t *w    = t->work;
    xccl_comm_t *comm = w->comm;
    xccl_held_t *h;

    if (t->parent != NULL) { /* a sub-task: post as its parent, in the parent's terms */
        if (peer < 0 || peer >= t->size || peer == t->rank || step >= t->step_span)
            return XCCL_ERROR(XCCL_ERR_INTERNAL, "%s: sub-task %s posted an invalid %s (member "
                              "%d of %d, step %u of %u) on rank %d", w->name, t->algo->name,
                              kind == REQ_SEND ? "send" : "receive", peer, t->size, step,
                              t->step_span, comm->rank);
        return task_post(t->parent, kind, t->map[peer], buf, nbytes, t->step_base + step);
    }
    if (peer < 0 || peer >= comm->size || peer == comm->rank || step > XCCL_STEP_MAX)
        return XCCL_ERROR(XCCL_ERR_INTERNAL, "%s: algorithm %s posted an invalid %s (peer %d, "
                          "step %u) on rank %d", w->name, t->algo->name,
                          kind == REQ_SEND ? "send" : "receive", peer, step, comm->rank);
    if (t->nev == 0) return task_post_now(t, kind, peer, buf, nbytes, step);
    /* an executor event issued before it may still write (or read) the buffer: hold it */
    h = malloc(sizeof(*h));
    if (h == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "%s: out of memory", w->name);
    *h = (xccl_held_t){kind, peer, buf, nbytes, step, t->ev_issued, NULL};
    if (t->held_tail) t->held_tail->next = h;
    else t->held = h;
    t->held_tail = h;
    t->nheld++;
    /* the fingerprint check rides on this message, whenever it leaves */
    if (kind == REQ_SEND && peer == (comm->rank + 1) % comm->size) t->sent_next = 1;
    return XCCL_OK;
}

/* ---- sub-tasks (task.h) -------------------------------------------------------------------
 * A sub-task is a task of the same Work whose posts go through its parent (peers mapped, steps
 * offset) down to the Work's own task, which holds every request, every executor event and
 * every held post: the Work's stream ordering, failure handling, hang diagnosis and traces
 * see a sub-task's work like any other. */

/* The Work's own task, and a sub-task's step range [*lo, *lo + span) in the Work's steps. */
static xccl_task_t *sub_root(const xccl_task_t *t, uint32_t *lo)
{
    *lo = 0;
    for (; t->parent != NULL; t = t->parent) *lo += t->step_base;
    return &t->work->task;
}

static int in_range(uint32_t step, uint32_t lo, uint32_t span)
{
    return step >= lo && step - lo < span;
}

/* Requests of sub-task t not finished yet, held posts included; *err: the first that failed
 * (unchanged if none). */
static int sub_pending(const xccl_task_t *t, xccl_status_t *err)
{
    uint32_t     lo;
    xccl_task_t *root = sub_root(t, &lo);
    int          n    = 0;

    for (const xccl_req_t *r = root->reqs; r != NULL; r = r->wnext) {
        if (!in_range(r->step, lo, t->step_span)) continue;
        if (r->state != REQ_DONE) n++;
        else if (r->status < 0 && err != NULL && *err == XCCL_OK) *err = r->status;
    }
    for (const xccl_held_t *h = root->held; h != NULL; h = h->next)
        n += in_range(h->step, lo, t->step_span);
    return n;
}

/* xccl_task_test for a sub-task: its requests are the Work's requests in its step range; its
 * copies and reductions are in the Work's stream, so it waits for that stream too. */
static xccl_status_t sub_test(xccl_task_t *t)
{
    xccl_status_t err = XCCL_OK;
    uint32_t      lo;
    xccl_task_t  *root = sub_root(t, &lo);

    if (root->nev > 0) task_poll_events(root);
    if (root->ev_error < 0) return root->ev_error;
    if (sub_pending(t, &err) > 0 || err < 0) return err < 0 ? err : XCCL_INPROGRESS;
    if (root->nev > 0) return XCCL_INPROGRESS;
    for (xccl_req_t **pp = &root->reqs; *pp != NULL;) {
        xccl_req_t *r = *pp;
        if (!in_range(r->step, lo, t->step_span)) {
            pp = &r->wnext;
            continue;
        }
        *pp = r->wnext;
        xccl_req_put(root->work->comm->ctx, r);
    }
    return XCCL_OK;
}

xccl_status_t xccl_task_isend(xccl_task_t *t, int peer, const void *buf, size_t nbytes,
                              uint32_t step)
{
    return task_post(t, REQ_SEND, peer, (void *)buf, nbytes, step);
}

xccl_status_t xccl_task_irecv(xccl_task_t *t, int peer, void *buf, size_t nbytes, uint32_t step)
{
    return task_post(t, REQ_RECV, peer, buf, nbytes, step);
}

int xccl_task_pending(const xccl_task_t *t)
{
    return t->parent != NULL ? sub_pending(t, NULL) : t->npending + t->nheld;
}

xccl_status_t xccl_task_test(xccl_task_t *t)
{
    if (!t->work->active) {
        xccl_status_t st = atomic_load(&t->work->status);
        return st < 0 ? st : XCCL_ERR_ABORTED;
    }
    if (t->parent != NULL) return sub_test(t);
    if (t->nev > 0) task_poll_events(t);
    if (t->ev_error < 0) return t->ev_error;
    for (xccl_req_t *r = t->reqs; r != NULL; r = r->wnext) {
        if (r->state == REQ_DONE && r->status < 0) return r->status;
    }
    if (t->npending > 0 || t->nev > 0 || t->nheld > 0) return XCCL_INPROGRESS;
    while (t->reqs != NULL) {
        xccl_req_t *r = t->reqs;
        t->reqs       = r->wnext;
        xccl_req_put(t->work->comm->ctx, r);
    }
    return XCCL_OK;
}

xccl_status_t xccl_task_reduce(xccl_task_t *t, void *dst, const void *a, const void *b,
                               size_t count)
{
    uint64_t      t0 = t->work->comm->trace_cap ? xccl_now_ns() : 0;
    xccl_status_t st;
    void         *ev = NULL;

    if (t->exec == &xccl_exec_cpu) {
        st = xccl_reduce2(dst, a, b, count, t->args.dtype, t->args.op);
    } else {
        st = t->exec->reduce(task_queue(t), dst, a, b, count, t->args.dtype, t->args.op, &ev);
        /* a sub-task's local work is in the Work's stream */
        if (st != XCCL_OK) st = task_exec_result(&t->work->task, st, ev, "a reduction");
    }
    if (t0) xccl_trace_reduce(t, dst, count * t->args.elsize, t0);
    return st;
}

int xccl_task_mem_shareable(xccl_mem_type_t mem)
{
    const xccl_exec_ops_t *ex = xccl_exec_for(mem);
    return ex != NULL && ex->export_mem != NULL && ex->import_mem != NULL && ex->reduce_n != NULL;
}

_Static_assert(XCCL_TASK_BLOB_MAX == XCCL_EXEC_BLOB_MAX, "blob sizes of task.h and exec.h");
_Static_assert(XCCL_TASK_REDUCE_MAX == XCCL_EXEC_REDUCE_MAX, "reduce_n bounds");

xccl_status_t xccl_task_mem_export(xccl_task_t *t, const void *ptr, size_t nbytes, void *blob,
                                   size_t *len)
{
    if (t->exec->export_mem == NULL)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED, "%s: the %s executor cannot share memory",
                          t->work->name, t->exec->name);
    return t->exec->export_mem(ptr, nbytes, blob, len);
}

xccl_status_t xccl_task_mem_import(xccl_task_t *t, const void *blob, size_t len, void **ptr)
{
    xccl_status_t st;

    if (t->exec->import_mem == NULL)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED, "%s: the %s executor cannot map memory",
                          t->work->name, t->exec->name);
    st = t->exec->import_mem(blob, len, ptr);
    return st < 0 ? task_exec_fail(&t->work->task, st, "mapping a peer's buffer") : st;
}

xccl_status_t xccl_task_reduce_n(xccl_task_t *t, void *dst, const void *const *srcs, int k,
                                 size_t count)
{
    uint64_t      t0 = t->work->comm->trace_cap ? xccl_now_ns() : 0;
    void         *ev = NULL;
    xccl_status_t st;

    if (t->exec->reduce_n == NULL || k < 2 || k > XCCL_TASK_REDUCE_MAX)
        return XCCL_ERROR(XCCL_ERR_INTERNAL, "%s: reduce_n of %d sources on the %s executor",
                          t->work->name, k, t->exec->name);
    if (count == 0) return XCCL_OK;
    st = t->exec->reduce_n(task_queue(t), dst, srcs, k, count, t->args.dtype, t->args.op, &ev);
    if (st != XCCL_OK) st = task_exec_result(&t->work->task, st, ev, "a reduction");
    if (t0) xccl_trace_reduce(t, dst, count * t->args.elsize, t0);
    return st;
}

xccl_status_t xccl_task_copy(xccl_task_t *t, void *dst, const void *src, size_t nbytes)
{
    xccl_task_t  *root = &t->work->task; /* a sub-task's local work is in the Work's stream */
    void         *ev   = NULL;
    xccl_status_t st;

    if (nbytes == 0 || dst == src) return XCCL_OK;
    if (t->exec == &xccl_exec_cpu) {
        memmove(dst, src, nbytes);
        return XCCL_OK;
    }
    st = t->exec->copy(task_queue(t), dst, src, nbytes, &ev);
    return st == XCCL_OK ? XCCL_OK : task_exec_result(root, st, ev, "a copy");
}

static void sub_free_all(xccl_task_t *t);

/* Scratch is lent by the communicator: the largest buffer a finished operation used is kept
 * (up to XCCL_SCRATCH_KEEP bytes, one per memory type) for the next one, so a large
 * collective does not map, fault in and unmap tens of MiB on every call (12k page faults per
 * 64 MiB all_reduce otherwise). Lock held, or the Work not yet posted. */
#define XCCL_SCRATCH_KEEP ((size_t)256 << 20)

void *xccl_task_scratch(xccl_task_t *t, size_t nbytes)
{
    xccl_comm_t    *comm = t->work->comm;
    xccl_mem_type_t mem  = t->args.mem;
    void           *p;

    if (nbytes <= t->scratch_len && t->scratch != NULL) return t->scratch;
    if (t->scratch == NULL && comm->spare[mem] != NULL && comm->spare_len[mem] >= nbytes) {
        t->scratch           = comm->spare[mem];
        t->scratch_len       = comm->spare_len[mem];
        comm->spare[mem]     = NULL;
        comm->spare_len[mem] = 0;
        return t->scratch;
    }
    if (t->scratch != NULL) xccl_ctx_mem_forget(comm->ctx, t->scratch, t->scratch_len);
    if (t->exec == &xccl_exec_cpu) {
        p = realloc(t->scratch, nbytes ? nbytes : 1);
        if (p == NULL) return NULL;
    } else {
        /* executor memory cannot be resized: the old buffer is dropped with its contents
         * (task.h), after the events that may still use it */
        while (t->scratch != NULL && t->work->task.nev > 0) task_poll_events(&t->work->task);
        p = t->exec->alloc(nbytes);
        if (p == NULL) return NULL;
        if (t->scratch != NULL) t->exec->free(t->scratch);
    }
    t->scratch     = p;
    t->scratch_len = nbytes;
    return t->scratch;
}

/* Waits for the task's executor events (a failed operation, whose buffers are about to be
 * freed or handed back: the executor may still be writing into them) and drops held posts. */
static void task_drain(xccl_task_t *t)
{
    while (t->nev > 0) {
        xccl_status_t st = t->exec->test(t->ev[t->ev_head]);
        if (st == XCCL_INPROGRESS) {
            xccl_cpu_relax();
            continue;
        }
        t->ev_head++;
        t->nev--;
        t->ev_first++;
    }
    t->ev_head = 0;
    while (t->held != NULL) {
        xccl_held_t *h = t->held;
        t->held        = h->next;
        free(h);
    }
    t->held_tail = NULL;
    t->nheld     = 0;
}

void xccl_task_scratch_return(xccl_task_t *t, int reuse)
{
    xccl_comm_t    *comm = t->work->comm;
    xccl_mem_type_t mem  = t->args.mem;

    if (t->nev > 0 || t->held != NULL) task_drain(t);
    sub_free_all(t); /* after the drain: queued work may use their scratch */
    if (t->scratch == NULL) return;
    if (reuse && t->scratch_len <= XCCL_SCRATCH_KEEP && t->scratch_len > comm->spare_len[mem]) {
        if (comm->spare[mem] != NULL) {
            xccl_ctx_mem_forget(comm->ctx, comm->spare[mem], comm->spare_len[mem]);
            t->exec->free(comm->spare[mem]);
        }
        comm->spare[mem]     = t->scratch;
        comm->spare_len[mem] = t->scratch_len;
    } else {
        xccl_ctx_mem_forget(comm->ctx, t->scratch, t->scratch_len);
        t->exec->free(t->scratch);
    }
    t->scratch     = NULL;
    t->scratch_len = 0;
}

/* Frees a sub-task, its own sub-tasks and its scratch (the Work's stream holds no work that
 * uses them any more). Lock held. */
static void sub_free(xccl_task_t *s, int reuse)
{
    xccl_task_scratch_return(s, reuse); /* frees its own sub-tasks first */
    free(s->map);
    free(s);
}

static void sub_free_all(xccl_task_t *t)
{
    for (int i = 0; i < XCCL_TASK_SUBS; i++) {
        if (t->sub[i] != NULL) sub_free(t->sub[i], 0);
        t->sub[i] = NULL;
    }
}

uint32_t xccl_task_step_limit(const xccl_task_t *t)
{
    return t->parent != NULL ? t->step_span : XCCL_STEP_MAX + 1u;
}

static xccl_status_t sub_create(xccl_task_t *t, const xccl_algo_t *algo,
                                const xccl_coll_args_t *args, const int *map, int nsub,
                                uint32_t step_base, uint32_t step_span, xccl_task_t **out)
{
    const char  *name = t->work->name;
    int          me = xccl_task_rank(t), size = xccl_task_size(t), rank = -1;
    xccl_task_t *s;

    if (algo == NULL || args == NULL || map == NULL || nsub < 1 || step_span == 0 ||
        step_base > xccl_task_step_limit(t) || step_span > xccl_task_step_limit(t) - step_base)
        return XCCL_ERROR(XCCL_ERR_INTERNAL, "%s: algorithm %s started an invalid sub-task "
                          "(%d members, steps %u + %u)", name, t->algo->name, nsub, step_base,
                          step_span);
    for (int i = 0; i < nsub; i++) {
        int dup = 0;
        for (int j = 0; j < i; j++) dup |= map[j] == map[i];
        if (map[i] < 0 || map[i] >= size || dup)
            return XCCL_ERROR(XCCL_ERR_INTERNAL, "%s: sub-task %s: member %d is rank %d of %d%s",
                              name, algo->name, i, map[i], size, dup ? " twice" : "");
        if (map[i] == me) rank = i;
    }
    if (rank < 0)
        return XCCL_ERROR(XCCL_ERR_INTERNAL, "%s: sub-task %s started on rank %d, not a member",
                          name, algo->name, me);
    s = calloc(1, sizeof(*s));
    if (s != NULL) s->map = malloc((size_t)nsub * sizeof(int));
    if (s == NULL || s->map == NULL) {
        free(s);
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "%s: out of memory", name);
    }
    memcpy(s->map, map, (size_t)nsub * sizeof(int));
    s->algo      = algo;
    s->args      = *args;
    s->args.mem  = t->args.mem; /* its buffers are its parent's kind of memory */
    s->exec      = t->exec;
    s->work      = t->work;
    s->parent    = t;
    s->rank      = rank;
    s->size      = nsub;
    s->step_base = step_base;
    s->step_span = step_span;
    *out         = s;
    return XCCL_OK;
}

xccl_status_t xccl_task_sub(xccl_task_t *t, int slot, const xccl_algo_t *algo,
                            const xccl_coll_args_t *args, const int *map, int nsub,
                            uint32_t step_base, uint32_t step_span)
{
    xccl_task_t  *root = &t->work->task, *s;
    xccl_status_t st;

    if (slot < 0 || slot >= XCCL_TASK_SUBS)
        return XCCL_ERROR(XCCL_ERR_INTERNAL, "%s: algorithm %s: sub-task slot %d", t->work->name,
                          t->algo->name, slot);
    if (t->sub[slot] == NULL)
        XCCL_CHECK(sub_create(t, algo, args, map, nsub, step_base, step_span, &t->sub[slot]));
    s  = t->sub[slot];
    st = s->algo_done ? XCCL_OK : s->algo->progress(s);
    if (st != XCCL_OK) return st;
    /* done; its scratch is freed once the stream's queued work no longer uses it */
    s->algo_done = 1;
    if (root->nev > 0) task_poll_events(root);
    if (root->ev_error < 0) return root->ev_error;
    if (root->nev > 0) return XCCL_INPROGRESS;
    sub_free(s, 1);
    t->sub[slot] = NULL;
    return XCCL_OK;
}

void xccl_coll_free(xccl_work_t *w)
{
    xccl_task_t           *t    = &w->task;
    const xccl_exec_ops_t *exec = t->exec ? t->exec : &xccl_exec_cpu;

    if (t->nev > 0 || t->held != NULL) task_drain(t);
    sub_free_all(t);
    if (t->scratch != NULL) exec->free(t->scratch);
    if (w->tmp != NULL) exec->free(w->tmp);
    free(t->ev);
    t->scratch = w->tmp = NULL;
    t->ev               = NULL;
}

void xccl_comm_free_queues(xccl_comm_t *comm)
{
    for (int m = 0; m < XCCL_MEM_TYPES; m++) {
        const xccl_exec_ops_t *exec = xccl_exec_for((xccl_mem_type_t)m);
        void                  *q    = atomic_exchange(&comm->queue[m], NULL);
        /* an executor that went away leaks its queue rather than free it wrongly */
        if (q != NULL && exec != NULL && exec->queue_free != NULL) exec->queue_free(q);
    }
}

void xccl_comm_free_spare(xccl_comm_t *comm)
{
    for (int m = 0; m < XCCL_MEM_TYPES; m++) {
        const xccl_exec_ops_t *exec = xccl_exec_for((xccl_mem_type_t)m);
        /* an executor that went away leaks its buffer rather than free it wrongly */
        if (comm->spare[m] != NULL && comm->ctx != NULL)
            xccl_ctx_mem_forget(comm->ctx, comm->spare[m], comm->spare_len[m]);
        if (comm->spare[m] != NULL && exec != NULL) exec->free(comm->spare[m]);
        comm->spare[m]     = NULL;
        comm->spare_len[m] = 0;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Mismatch                                                                                    */
/* ------------------------------------------------------------------------------------------ */

static xccl_work_t *find_coll(xccl_comm_t *comm, uint64_t seq)
{
    return xccl_u64map_get(&comm->colls, seq + 1); /* active collectives by seq + 1 */
}

void xccl_coll_mismatch(xccl_comm_t *comm, uint64_t seq, int peer_rank, uint64_t peer_fp,
                        int notify)
{
    xccl_work_t *w = find_coll(comm, seq);
    char         mine[160], theirs[160], msg[600];

    if (w == NULL || w->fp == peer_fp) return;
    snprintf(msg, sizeof(msg),
             "collective mismatch on comm '%s' (operation #%llu): rank %d called %s but rank %d "
             "called %s",
             comm->name, (unsigned long long)seq, comm->rank, xccl_fp_str(w->fp, mine, sizeof(mine)),
             peer_rank, xccl_fp_str(peer_fp, theirs, sizeof(theirs)));
    (void)xccl_error_report(XCCL_ERR_MISMATCH, __FILE__, __LINE__, "%s", msg);
    if (notify) {
        for (int p = 0; p < comm->size; p++) {
            if (p != comm->rank) send_ctrl(comm, p, seq, w->fp, msg);
        }
    }
    xccl_work_finish(w, XCCL_ERR_MISMATCH, msg);
}

void xccl_coll_break(xccl_comm_t *comm, uint64_t seq, const char *why)
{
    char msg[1200];

    if (comm->broken != NULL || comm->destroyed) return;
    snprintf(msg, sizeof(msg), "operation #%llu of comm '%s' failed: %s",
             (unsigned long long)seq, comm->name, why);
    comm->broken = strdup(msg);
    if (comm->broken == NULL) return;
    for (xccl_work_t *w = comm->works_head, *next; w != NULL; w = next) {
        next = w->cm_next; /* finishing w takes it off this list, and only it */
        if (w->kind != WORK_COLL || !w->active || w->seq <= seq) continue;
        snprintf(msg, sizeof(msg), "%s (algo %s, seq %llu) on comm '%s' failed on rank %d: %s",
                 w->name, w->task.algo->name, (unsigned long long)w->seq, comm->name,
                 comm->rank, comm->broken);
        (void)xccl_error_report(XCCL_ERR_REMOTE, __FILE__, __LINE__, "%s", msg);
        w->notified = 1; /* every member learns of #seq itself */
        xccl_work_finish(w, XCCL_ERR_REMOTE, msg);
    }
}

/* A fingerprint check or a mismatch notice arrived. Returns 1 if consumed. */
int xccl_coll_ctrl_arrived(xccl_ctx_t *ctx, xccl_umsg_t *u)
{
    xccl_comm_t *comm = xccl_ctx_find_comm(ctx, u->hdr.comm_id);
    uint64_t     seq  = tag_ctrl_seq(u->hdr.tag);
    xccl_work_t *w;
    char         mine[160], theirs[160], msg[1200];
    int          peer;

    if (u->hdr.tag & (TAG_CTRL_DIAG | TAG_CTRL_DIAG_REPLY)) return xccl_diag_ctrl_arrived(ctx, u);
    if (comm == NULL) return 0; /* a communicator this rank has not created yet */
    if (comm->destroyed) return 1;
    w    = find_coll(comm, seq);
    peer = xccl_comm_rank_of_world(comm, u->src);
    if (w == NULL && comm->next_seq > seq && (u->hdr.tag & TAG_CTRL_FAIL)) {
        /* an operation this rank finished failed on the sender: it takes part in no later
         * one, so those posted here since would wait for it until their timeout */
        snprintf(msg, sizeof(msg), "rank %d reported: %s", peer,
                 u->data ? (const char *)u->data : "failure");
        xccl_coll_break(comm, seq, msg);
        return 1;
    }
    if (w == NULL) return comm->next_seq > seq; /* not reached yet: keep it for coll_post */
    if (u->hdr.tag & TAG_CTRL_CHECK) {
        if (w->fp != u->hdr.fp) xccl_coll_mismatch(comm, seq, peer, u->hdr.fp, 1);
        return 1;
    }
    if (u->hdr.tag & TAG_CTRL_FAIL) {
        snprintf(msg, sizeof(msg), "%s (algo %s, seq %llu) on comm '%s' failed on rank %d: "
                 "rank %d reported: %s", w->name, w->task.algo->name, (unsigned long long)seq,
                 comm->name, comm->rank, peer, u->data ? (const char *)u->data : "failure");
        (void)xccl_error_report(XCCL_ERR_REMOTE, __FILE__, __LINE__, "%s", msg);
        w->notified = 1;
        xccl_work_finish(w, XCCL_ERR_REMOTE, msg);
        return 1;
    }
    if (w->fp != u->hdr.fp) {
        snprintf(msg, sizeof(msg),
                 "collective mismatch on comm '%s' (operation #%llu): rank %d called %s but "
                 "rank %d called %s",
                 comm->name, (unsigned long long)seq, comm->rank,
                 xccl_fp_str(w->fp, mine, sizeof(mine)), peer,
                 xccl_fp_str(u->hdr.fp, theirs, sizeof(theirs)));
    } else {
        snprintf(msg, sizeof(msg), "rank %d reported: %s", peer,
                 u->data ? (const char *)u->data : "collective mismatch");
    }
    (void)xccl_error_report(XCCL_ERR_MISMATCH, __FILE__, __LINE__, "%s", msg);
    xccl_work_finish(w, XCCL_ERR_MISMATCH, msg);
    return 1;
}

/* ------------------------------------------------------------------------------------------ */
/* Posting                                                                                     */
/* ------------------------------------------------------------------------------------------ */

static xccl_status_t comm_usable(const xccl_comm_t *comm, const char *what)
{
    if (comm == NULL) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "%s: comm is NULL", what);
    if (comm->destroyed)
        return XCCL_ERROR(XCCL_ERR_INVALID_USAGE, "%s: comm '%s' was destroyed or aborted", what,
                          comm->name);
    return XCCL_OK;
}

void *xccl_comm_queue(xccl_comm_t *comm, const xccl_exec_ops_t *exec)
{
    void *q = xccl_comm_queue_of(comm, exec->mem), *none = NULL;

    if (q != NULL || exec->queue_new == NULL) return q;
    if (exec->queue_new(&q) != XCCL_OK) {
        XCCL_WARN("comm '%s': no queue of its own for %s memory (%s): its device work shares the "
                  "executor's default queue", comm->name, exec->name, xccl_last_error());
        return NULL;
    }
    /* two threads posting the first operations at once: one queue wins, the other goes */
    if (!atomic_compare_exchange_strong(&comm->queue[exec->mem], &none, q)) {
        exec->queue_free(q);
        q = none;
    }
    return q;
}

/* Device memory, before anything of the operation is queued: takes its completion gate and
 * marks where the caller's stream stands (exec.h "streams"): while that point is ahead, the
 * operation waits in w->ready_ev. */
static xccl_status_t exec_prepare(xccl_work_t *w, const xccl_exec_ops_t *exec, void *stream)
{
    xccl_status_t st;
    void         *ev = NULL;

    w->task.exec = exec;
    (void)xccl_comm_queue(w->comm, exec); /* before anything of the operation is queued */
    if (exec->gate_new != NULL) {
        XCCL_CHECK(exec->gate_new(&w->gate));
        w->gate_exec = exec;
    }
    if (exec->order_after != NULL) {
        st = exec->order_after(stream, &ev);
        if (st < 0) return st;
        if (st == XCCL_INPROGRESS) w->ready_ev = ev;
    }
    return XCCL_OK;
}

xccl_status_t xccl_work_ready(xccl_work_t *w)
{
    xccl_status_t st;

    if (w->ready_ev == NULL) return XCCL_OK;
    st = w->task.exec->test(w->ready_ev);
    if (st == XCCL_INPROGRESS) return st;
    w->ready_ev = NULL;
    if (st < 0)
        return XCCL_ERROR(st, "%s on comm '%s' (rank %d): waiting for the caller's stream to "
                          "reach it failed: %s", w->name, w->comm->name, w->comm->rank,
                          xccl_last_error());
    return XCCL_OK;
}

void xccl_work_ready_drop(xccl_work_t *w)
{
    const xccl_exec_ops_t *ex = w->task.exec;

    if (w->ready_ev == NULL) return;
    ex->drop_event(w->ready_ev); /* an executor with order_after has it (exec.h) */
    w->ready_ev = NULL;
}

/* Finishes a p2p Work whose request never reached a transport, with the thread's last error
 * in its message. Lock held. */
static void p2p_fail(xccl_work_t *w, xccl_status_t st)
{
    char msg[800];

    w->req->state = REQ_DONE;
    xccl_work_finish(w, st, xccl_p2p_error(w, xccl_last_error(), msg, sizeof(msg)));
}

/* Posts a p2p Work's request (lock held); a failed post finishes the Work. */
static void p2p_start(xccl_ctx_t *ctx, xccl_work_t *w)
{
    xccl_req_t   *r  = w->req;
    xccl_status_t st = r->kind == REQ_SEND ? xccl_req_post_send(ctx, r) : xccl_req_post_recv(ctx, r);

    if (st < 0) p2p_fail(w, st);
}

int xccl_p2p_hold_progress(xccl_ctx_t *ctx)
{
    int n = 0;

    while (ctx->hold_head != NULL) {
        xccl_work_t  *w  = ctx->hold_head;
        xccl_status_t st = xccl_work_ready(w);
        if (st == XCCL_INPROGRESS) break;
        ctx->hold_head = w->hold_next;
        if (ctx->hold_head == NULL) ctx->hold_tail = NULL;
        w->hold_next = NULL;
        w->held      = 0;
        n++;
        if (st < 0) {
            p2p_fail(w, st);
            continue;
        }
        w->t_start = xccl_now_ns();
        p2p_start(ctx, w);
    }
    return n;
}

void xccl_p2p_hold_unlink(xccl_ctx_t *ctx, xccl_work_t *w)
{
    xccl_work_t *prev = NULL;

    for (xccl_work_t *p = ctx->hold_head; p != NULL; prev = p, p = p->hold_next) {
        if (p != w) continue;
        if (prev != NULL) prev->hold_next = w->hold_next;
        else ctx->hold_head = w->hold_next;
        if (ctx->hold_tail == w) ctx->hold_tail = prev;
        w->hold_next = NULL;
        w->held      = 0;
        return;
    }
}

static xccl_status_t p2p_post(xccl_comm_t *comm, req_kind_t kind, void *buf, size_t nbytes,
                              int peer, uint32_t tag, const xccl_p2p_opts_t *opts,
                              xccl_work_t **out)
{
    xccl_mem_type_t mem = opts != NULL ? opts->mem : XCCL_MEM_HOST;
    const xccl_exec_ops_t *exec;
    const char   *name = kind == REQ_SEND ? "send" : "recv";
    xccl_work_t  *w;
    xccl_req_t   *r;
    xccl_ctx_t   *ctx;
    xccl_status_t st;

    XCCL_CHECK(comm_usable(comm, name));
    if (out == NULL) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "%s: out is NULL", name);
    if ((peer < 0 && !(kind == REQ_RECV && peer == XCCL_ANY_SOURCE)) || peer >= comm->size)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "%s: peer rank %d is not in [0, %d)", name, peer,
                          comm->size);
    if (buf == NULL && nbytes > 0)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "%s: NULL buffer of %zu bytes", name, nbytes);
    if (tag > 0x7fffffffu)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "%s: tag %u is not in [0, 2^31)", name, tag);
    exec = xccl_exec_for(mem);
    if (exec == NULL)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                          "%s: buffers of memory type %d (%s) have no executor in this process "
                          "(rank %d of comm '%s')",
                          name, (int)mem, xccl_mem_type_name(mem), comm->rank, comm->name);
    w = xccl_work_new(comm, WORK_P2P, name, 0);
    if (w == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "%s: out of memory", name);
    if (mem != XCCL_MEM_HOST && (st = exec_prepare(w, exec, opts->stream)) < 0) {
        xccl_work_release(w);
        return st;
    }
    r = &w->p2p_req; /* a p2p Work carries its one request: nothing to allocate */
    req_init(r, w, kind, peer == XCCL_ANY_SOURCE ? XCCL_ANY_SOURCE : comm->world[peer], buf,
             nbytes, tag_p2p(tag));
    r->mem = mem;
    w->req = r;
    ctx    = comm->ctx;
    pthread_mutex_lock(&ctx->lock);
    xccl_work_activate(w, 0);
    if (w->ready_ev != NULL || ctx->hold_head != NULL) {
        /* its stream is behind (or an earlier one's is): posted in order, once it is there */
        w->held = 1;
        if (ctx->hold_tail != NULL) ctx->hold_tail->hold_next = w;
        else ctx->hold_head = w;
        ctx->hold_tail = w;
        (void)xccl_p2p_hold_progress(ctx);
    } else {
        w->t_start = w->t_enq; /* posting is its start */
        p2p_start(ctx, w);
    }
    pthread_mutex_unlock(&ctx->lock);
    xccl_ctx_run_callbacks(ctx);
    *out = w;
    return XCCL_OK;
}

xccl_status_t xccl_isend(xccl_comm_t *comm, const void *buf, size_t nbytes, int peer,
                         uint32_t tag, xccl_work_t **w)
{
    return p2p_post(comm, REQ_SEND, (void *)buf, nbytes, peer, tag, NULL, w);
}

xccl_status_t xccl_irecv(xccl_comm_t *comm, void *buf, size_t nbytes, int peer, uint32_t tag,
                         xccl_work_t **w)
{
    return p2p_post(comm, REQ_RECV, buf, nbytes, peer, tag, NULL, w);
}

xccl_status_t xccl_isend_opts(xccl_comm_t *comm, const void *buf, size_t nbytes, int peer,
                              uint32_t tag, const xccl_p2p_opts_t *opts, xccl_work_t **w)
{
    return p2p_post(comm, REQ_SEND, (void *)buf, nbytes, peer, tag, opts, w);
}

xccl_status_t xccl_irecv_opts(xccl_comm_t *comm, void *buf, size_t nbytes, int peer,
                              uint32_t tag, const xccl_p2p_opts_t *opts, xccl_work_t **w)
{
    return p2p_post(comm, REQ_RECV, buf, nbytes, peer, tag, opts, w);
}


static xccl_status_t coll_prologue(xccl_work_t *w);

/* AVG: divides the result by the group size, on the task's executor. */
static xccl_status_t coll_epilogue(xccl_work_t *w)
{
    xccl_task_t            *t = &w->task;
    const xccl_coll_args_t *a = &t->args;
    xccl_status_t           st;
    void                   *ev = NULL;

    if (w->user_op != XCCL_OP_AVG) return XCCL_OK;
    switch (a->coll) {
    case XCCL_COLL_ALLREDUCE: break;
    case XCCL_COLL_REDUCE_SCATTER: break;
    case XCCL_COLL_REDUCE:
        if (w->comm->rank != a->root) return XCCL_OK;
        break;
    default: return XCCL_OK;
    }
    if (a->count == 0) return XCCL_OK;
    if (t->exec == &xccl_exec_cpu)
        return xccl_divide(a->rbuf, a->rbuf, a->count, a->dtype, w->comm->size);
    st = t->exec->divide(task_queue(t), a->rbuf, a->rbuf, a->count, a->dtype, w->comm->size, &ev);
    return st == XCCL_OK ? XCCL_OK : task_exec_result(t, st, ev, "the average's division");
}

xccl_status_t xccl_coll_progress(xccl_work_t *w)
{
    xccl_task_t  *t = &w->task;
    xccl_status_t st;

    if (w->ready_ev != NULL) {
        st = xccl_work_ready(w);
        if (st != XCCL_OK) return st;
        XCCL_CHECK(coll_prologue(w));
    }
    if (!t->algo_done) {
        t->shared_wait = SHWAIT_NONE; /* the algorithm says again what it waits for */
        st             = t->algo->progress(t);
        if (st != XCCL_OK || !w->active) return st;
        t->algo_done = 1;
        XCCL_CHECK(coll_epilogue(w));
    }
    if (t->nev > 0) task_poll_events(t);
    if (t->ev_error < 0) return t->ev_error;
    return t->nev > 0 ? XCCL_INPROGRESS : XCCL_OK;
}

/* PREMUL_SUM: dst = src * factor on the task's executor. */
static xccl_status_t task_scale(xccl_task_t *t, void *dst, const void *src, size_t count,
                                double factor)
{
    void         *ev = NULL;
    xccl_status_t st;

    if (count == 0) return XCCL_OK;
    if (t->exec == &xccl_exec_cpu) return xccl_scale(dst, src, count, t->args.dtype, factor);
    st = t->exec->scale(task_queue(t), dst, src, count, t->args.dtype, factor, &ev);
    return st == XCCL_OK ? XCCL_OK : task_exec_result(t, st, ev, "the premul_sum scaling");
}

/* Copies (and for PREMUL_SUM scales) `n` elements into a fresh buffer of the operation's
 * memory type owned by the Work. */
static xccl_status_t work_tmp_copy(xccl_work_t *w, const void *src, size_t n, size_t el,
                                   int scale, const void **out)
{
    xccl_task_t *t      = &w->task;
    size_t       nbytes = n * el;

    w->tmp     = t->exec->alloc(nbytes > 0 ? nbytes : 1);
    w->tmp_len = nbytes;
    if (w->tmp == NULL)
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "%s: no memory for a %zu-byte %s copy", w->name,
                          nbytes, t->exec->name);
    if (scale) XCCL_CHECK(task_scale(t, w->tmp, src, n, w->premul));
    else XCCL_CHECK(xccl_task_copy(t, w->tmp, src, nbytes));
    *out = w->tmp;
    return XCCL_OK;
}

/* Normalises the buffers as task.h describes. Local copies run on the task's executor and may
 * finish later: the algorithm's first sends and receives wait for them (task.h). */
static xccl_status_t coll_prologue(xccl_work_t *w)
{
    xccl_task_t      *t     = &w->task;
    xccl_coll_args_t *a     = &t->args;
    int               rank  = w->comm->rank, size = w->comm->size;
    size_t            el    = a->elsize, blk = a->count * el;
    int               scale = w->user_op == XCCL_OP_PREMUL_SUM;

    switch (a->coll) {
    case XCCL_COLL_ALLREDUCE:
        if (scale) XCCL_CHECK(task_scale(t, a->rbuf, a->sbuf, a->count, w->premul));
        else if (a->sbuf != a->rbuf && blk) XCCL_CHECK(xccl_task_copy(t, a->rbuf, a->sbuf, blk));
        a->sbuf = a->rbuf;
        break;
    case XCCL_COLL_REDUCE:
        if (scale) XCCL_CHECK(work_tmp_copy(w, a->sbuf, a->count, el, 1, &a->sbuf));
        break;
    case XCCL_COLL_REDUCE_SCATTER:
        if (scale || a->sbuf == a->rbuf)
            XCCL_CHECK(work_tmp_copy(w, a->sbuf, a->count * (size_t)size, el, scale, &a->sbuf));
        break;
    case XCCL_COLL_ALLGATHER:
        XCCL_CHECK(xccl_task_copy(t, (char *)a->rbuf + (size_t)rank * blk, a->sbuf, blk));
        break;
    case XCCL_COLL_GATHER:
        if (rank == a->root)
            XCCL_CHECK(xccl_task_copy(t, (char *)a->rbuf + (size_t)rank * blk, a->sbuf, blk));
        break;
    case XCCL_COLL_SCATTER:
        if (rank == a->root)
            XCCL_CHECK(
                xccl_task_copy(t, a->rbuf, (const char *)a->sbuf + (size_t)rank * blk, blk));
        break;
    case XCCL_COLL_ALLTOALL:
        if (a->sbuf == a->rbuf)
            XCCL_CHECK(work_tmp_copy(w, a->sbuf, a->count * (size_t)size, el, 0, &a->sbuf));
        XCCL_CHECK(xccl_task_copy(t, (char *)a->rbuf + (size_t)rank * blk,
                                  (const char *)a->sbuf + (size_t)rank * blk, blk));
        break;
    case XCCL_COLL_ALLTOALLV: {
        size_t stotal = 0;
        /* the caller's arrays need not outlive the call */
        w->vcounts = malloc(4 * (size_t)size * sizeof(size_t));
        if (w->vcounts == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "%s: out of memory", w->name);
        memcpy(w->vcounts, a->scounts, (size_t)size * sizeof(size_t));
        memcpy(w->vcounts + size, a->sdispls, (size_t)size * sizeof(size_t));
        memcpy(w->vcounts + 2 * size, a->rcounts, (size_t)size * sizeof(size_t));
        memcpy(w->vcounts + 3 * size, a->rdispls, (size_t)size * sizeof(size_t));
        a->scounts = w->vcounts;
        a->sdispls = w->vcounts + size;
        a->rcounts = w->vcounts + 2 * size;
        a->rdispls = w->vcounts + 3 * size;
        for (int i = 0; i < size; i++) {
            size_t end = a->sdispls[i] + a->scounts[i];
            if (end > stotal) stotal = end;
        }
        if (a->sbuf == a->rbuf) XCCL_CHECK(work_tmp_copy(w, a->sbuf, stotal, el, 0, &a->sbuf));
        XCCL_CHECK(xccl_task_copy(t, (char *)a->rbuf + a->rdispls[rank] * el,
                                  (const char *)a->sbuf + a->sdispls[rank] * el,
                                  a->scounts[rank] * el));
        break;
    }
    default: break;
    }
    return XCCL_OK;
}

static const char *mem_type_name(xccl_mem_type_t mem)
{
    switch (mem) {
    case XCCL_MEM_HOST: return "host";
    case XCCL_MEM_CUDA: return "cuda";
    default: return "unknown";
    }
}

static xccl_status_t coll_post(xccl_comm_t *comm, xccl_coll_args_t *a, xccl_op_t user_op,
                               const xccl_coll_opts_t *opts, size_t nbytes_model,
                               xccl_work_t **out)
{
    const char        *name = xccl_coll_name(a->coll);
    const xccl_algo_t *algo;
    const xccl_exec_ops_t *exec;
    xccl_work_t       *w;
    xccl_ctx_t        *ctx;
    xccl_status_t      st;
    int                blocking = opts ? opts->blocking : 0;
    int                started;

    XCCL_CHECK(comm_usable(comm, name));
    if (out == NULL) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "%s: out is NULL", name);
    a->mem = opts ? opts->mem : XCCL_MEM_HOST;
    exec   = xccl_exec_for(a->mem);
    if (exec == NULL)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                          "%s: buffers of memory type %d (%s) have no executor in this process "
                          "(rank %d of comm '%s'): nothing was sent",
                          name, (int)a->mem, mem_type_name(a->mem), comm->rank, comm->name);
    if (comm->async_error < 0)
        return XCCL_ERROR(comm->async_error, "%s: comm '%s' has failed earlier (%s)", name,
                          comm->name, xccl_status_string(comm->async_error));
    /* one-level algorithms are priced with the links they mostly cross: between nodes when
     * the members span several */
    a->topo = &comm->topo;
    XCCL_CHECK(xccl_core_policy->select(&comm->memo, a, comm->size, nbytes_model,
                                     comm->topo.nnodes > 1 ? &comm->topo.inter
                                                           : &comm->topo.intra,
                                     opts ? opts->algo : NULL, &algo));
    w = xccl_work_new(comm, WORK_COLL, name, opts ? opts->timeout_ms : 0);
    if (w == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "%s: out of memory", name);
    w->task.algo = algo;
    w->task.args = *a;
    w->task.exec = exec;
    w->user_op   = user_op;
    w->premul    = opts ? opts->premul_factor : 1.0;
    w->fp        = xccl_fp_make(a->coll, a->dtype, user_op, a->root, a->count);
    st           = a->mem != XCCL_MEM_HOST ? exec_prepare(w, exec, opts->stream) : XCCL_OK;
    /* the prologue's copies wait for the caller's stream too: then they run in progress */
    if (st >= 0 && w->ready_ev == NULL) st = coll_prologue(w);
    if (st < 0) {
        xccl_work_release(w);
        return st;
    }
    ctx = comm->ctx;
    pthread_mutex_lock(&ctx->lock);
    if (comm->broken != NULL) {
        st = XCCL_ERROR(XCCL_ERR_REMOTE, "%s on comm '%s' (rank %d): refused, %s", name,
                        comm->name, comm->rank, comm->broken);
        pthread_mutex_unlock(&ctx->lock);
        xccl_work_release(w);
        return st;
    }
    w->seq = comm->next_seq++;
    xccl_shared_post(w); /* its epoch, if its algorithm uses the node-shared segment */
    xccl_work_activate(w, blocking);
    /* messages of this operation that arrived early (the communicator's own lists): check
     * their fingerprints, and take the notices about it */
    for (xccl_umsg_t *u = comm->arrivals.head, *next; u != NULL && w->active; u = next) {
        next = u->anext;
        if (tag_kind(u->hdr.tag) == TAG_KIND_COLL && tag_seq(u->hdr.tag) == w->seq &&
            u->hdr.fp != w->fp) {
            xccl_coll_mismatch(comm, w->seq, xccl_comm_rank_of_world(comm, u->src), u->hdr.fp, 1);
            break; /* w failed */
        }
    }
    for (xccl_umsg_t *u = comm->ctrl.head, *next; u != NULL && w->active; u = next) {
        next = u->pnext;
        if (u->done && tag_ctrl_seq(u->hdr.tag) == w->seq && u->hdr.tag != ~0ull &&
            xccl_coll_ctrl_arrived(ctx, u))
            xccl_umsg_drop(ctx, u);
    }
    started = w->active;
    if (started) { /* eager start, at the enqueue time */
        w->t_start = w->t_enq;
        xccl_work_progress_locked(w);
    }
    /* the fingerprint check to the next rank (see TAG_CTRL_CHECK), unless the start already
     * sent it a message of this operation, which carries the same fingerprint, or the
     * algorithm uses the node-shared segment: the one-host algorithms compare every peer's
     * call signature there (csrc/algo/shm.h), and a message per call would cost them more
     * than the collective itself */
    if (started && !w->task.sent_next && comm->size > 1 && !algo->shared)
        send_ctrl(comm, (comm->rank + 1) % comm->size, w->seq, w->fp, NULL);
    pthread_mutex_unlock(&ctx->lock);
    xccl_ctx_run_callbacks(ctx);
    *out = w;
    return XCCL_OK;
}

static xccl_status_t check_common(const char *name, size_t count, xccl_dtype_t dtype)
{
    (void)count;
    if (dtype < 0 || dtype >= XCCL_DTYPE_COUNT)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "%s: invalid dtype %d", name, (int)dtype);
    return XCCL_OK;
}

static xccl_status_t check_root(const xccl_comm_t *comm, const char *name, int root)
{
    if (comm != NULL && (root < 0 || root >= comm->size))
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "%s: root rank %d is not in [0, %d)", name, root,
                          comm->size);
    return XCCL_OK;
}

static xccl_status_t check_buf(const char *name, const char *which, const void *p, size_t n)
{
    if (p == NULL && n > 0)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "%s: %s is NULL", name, which);
    return XCCL_OK;
}

static xccl_status_t check_op(const char *name, xccl_op_t op, xccl_dtype_t dtype,
                              const xccl_coll_opts_t *opts)
{
    xccl_status_t st = xccl_op_check(op, dtype);

    if (st < 0) return st;
    if (op == XCCL_OP_PREMUL_SUM && opts == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "%s: premul_sum needs a factor in opts", name);
    return XCCL_OK;
}

static xccl_op_t base_op(xccl_op_t op)
{
    return op == XCCL_OP_AVG || op == XCCL_OP_PREMUL_SUM ? XCCL_OP_SUM : op;
}

#define ARGS(c, s, r, n, d, o, rt)                                                            \
    (xccl_coll_args_t)                                                                       \
    {                                                                                        \
        .coll = (c), .sbuf = (s), .rbuf = (r), .count = (n), .dtype = (d),                   \
        .elsize = xccl_dtype_size(d), .op = base_op(o), .root = (rt)                         \
    }

xccl_status_t xccl_allreduce(xccl_comm_t *comm, const void *sbuf, void *rbuf, size_t count,
                             xccl_dtype_t dtype, xccl_op_t op, const xccl_coll_opts_t *opts,
                             xccl_work_t **w)
{
    xccl_coll_args_t a;

    XCCL_CHECK(check_common("all_reduce", count, dtype));
    XCCL_CHECK(check_op("all_reduce", op, dtype, opts));
    XCCL_CHECK(check_buf("all_reduce", "send buffer", sbuf, count));
    XCCL_CHECK(check_buf("all_reduce", "receive buffer", rbuf, count));
    a = ARGS(XCCL_COLL_ALLREDUCE, sbuf, rbuf, count, dtype, op, -1);
    return coll_post(comm, &a, op, opts, count * a.elsize, w);
}

xccl_status_t xccl_broadcast(xccl_comm_t *comm, void *buf, size_t count, xccl_dtype_t dtype,
                             int root, const xccl_coll_opts_t *opts, xccl_work_t **w)
{
    xccl_coll_args_t a;

    XCCL_CHECK(check_common("broadcast", count, dtype));
    XCCL_CHECK(check_root(comm, "broadcast", root));
    XCCL_CHECK(check_buf("broadcast", "buffer", buf, count));
    a = ARGS(XCCL_COLL_BROADCAST, buf, buf, count, dtype, XCCL_OP_SUM, root);
    return coll_post(comm, &a, XCCL_OP_SUM, opts, count * a.elsize, w);
}

xccl_status_t xccl_reduce(xccl_comm_t *comm, const void *sbuf, void *rbuf, size_t count,
                          xccl_dtype_t dtype, xccl_op_t op, int root,
                          const xccl_coll_opts_t *opts, xccl_work_t **w)
{
    xccl_coll_args_t a;

    XCCL_CHECK(check_common("reduce", count, dtype));
    XCCL_CHECK(check_op("reduce", op, dtype, opts));
    XCCL_CHECK(check_root(comm, "reduce", root));
    XCCL_CHECK(check_buf("reduce", "send buffer", sbuf, count));
    if (comm != NULL && comm->rank == root)
        XCCL_CHECK(check_buf("reduce", "receive buffer at the root", rbuf, count));
    a = ARGS(XCCL_COLL_REDUCE, sbuf, comm && comm->rank == root ? rbuf : NULL, count, dtype, op,
             root);
    return coll_post(comm, &a, op, opts, count * a.elsize, w);
}

xccl_status_t xccl_allgather(xccl_comm_t *comm, const void *sbuf, void *rbuf, size_t count,
                             xccl_dtype_t dtype, const xccl_coll_opts_t *opts, xccl_work_t **w)
{
    xccl_coll_args_t a;

    XCCL_CHECK(check_common("all_gather", count, dtype));
    XCCL_CHECK(check_buf("all_gather", "send buffer", sbuf, count));
    XCCL_CHECK(check_buf("all_gather", "receive buffer", rbuf, count));
    a = ARGS(XCCL_COLL_ALLGATHER, sbuf, rbuf, count, dtype, XCCL_OP_SUM, -1);
    return coll_post(comm, &a, XCCL_OP_SUM, opts,
                     count * a.elsize * (size_t)(comm ? comm->size : 1), w);
}

xccl_status_t xccl_gather(xccl_comm_t *comm, const void *sbuf, void *rbuf, size_t count,
                          xccl_dtype_t dtype, int root, const xccl_coll_opts_t *opts,
                          xccl_work_t **w)
{
    xccl_coll_args_t a;

    XCCL_CHECK(check_common("gather", count, dtype));
    XCCL_CHECK(check_root(comm, "gather", root));
    XCCL_CHECK(check_buf("gather", "send buffer", sbuf, count));
    if (comm != NULL && comm->rank == root)
        XCCL_CHECK(check_buf("gather", "receive buffer at the root", rbuf, count));
    a = ARGS(XCCL_COLL_GATHER, sbuf, rbuf, count, dtype, XCCL_OP_SUM, root);
    return coll_post(comm, &a, XCCL_OP_SUM, opts,
                     count * a.elsize * (size_t)(comm ? comm->size : 1), w);
}

xccl_status_t xccl_scatter(xccl_comm_t *comm, const void *sbuf, void *rbuf, size_t count,
                           xccl_dtype_t dtype, int root, const xccl_coll_opts_t *opts,
                           xccl_work_t **w)
{
    xccl_coll_args_t a;

    XCCL_CHECK(check_common("scatter", count, dtype));
    XCCL_CHECK(check_root(comm, "scatter", root));
    XCCL_CHECK(check_buf("scatter", "receive buffer", rbuf, count));
    if (comm != NULL && comm->rank == root)
        XCCL_CHECK(check_buf("scatter", "send buffer at the root", sbuf, count));
    a = ARGS(XCCL_COLL_SCATTER, sbuf, rbuf, count, dtype, XCCL_OP_SUM, root);
    return coll_post(comm, &a, XCCL_OP_SUM, opts,
                     count * a.elsize * (size_t)(comm ? comm->size : 1), w);
}

xccl_status_t xccl_reduce_scatter(xccl_comm_t *comm, const void *sbuf, void *rbuf, size_t count,
                                  xccl_dtype_t dtype, xccl_op_t op,
                                  const xccl_coll_opts_t *opts, xccl_work_t **w)
{
    xccl_coll_args_t a;

    XCCL_CHECK(check_common("reduce_scatter", count, dtype));
    XCCL_CHECK(check_op("reduce_scatter", op, dtype, opts));
    XCCL_CHECK(check_buf("reduce_scatter", "send buffer", sbuf, count));
    XCCL_CHECK(check_buf("reduce_scatter", "receive buffer", rbuf, count));
    a = ARGS(XCCL_COLL_REDUCE_SCATTER, sbuf, rbuf, count, dtype, op, -1);
    return coll_post(comm, &a, op, opts, count * a.elsize * (size_t)(comm ? comm->size : 1), w);
}

xccl_status_t xccl_alltoall(xccl_comm_t *comm, const void *sbuf, void *rbuf, size_t count,
                            xccl_dtype_t dtype, const xccl_coll_opts_t *opts, xccl_work_t **w)
{
    xccl_coll_args_t a;

    XCCL_CHECK(check_common("all_to_all", count, dtype));
    XCCL_CHECK(check_buf("all_to_all", "send buffer", sbuf, count));
    XCCL_CHECK(check_buf("all_to_all", "receive buffer", rbuf, count));
    a = ARGS(XCCL_COLL_ALLTOALL, sbuf, rbuf, count, dtype, XCCL_OP_SUM, -1);
    return coll_post(comm, &a, XCCL_OP_SUM, opts,
                     count * a.elsize * (size_t)(comm ? comm->size : 1), w);
}

xccl_status_t xccl_alltoallv(xccl_comm_t *comm, const void *sbuf, const size_t *scounts,
                             const size_t *sdispls, void *rbuf, const size_t *rcounts,
                             const size_t *rdispls, xccl_dtype_t dtype,
                             const xccl_coll_opts_t *opts, xccl_work_t **w)
{
    xccl_coll_args_t a;
    size_t           total = 0, rtotal = 0;

    XCCL_CHECK(check_common("all_to_all_v", 0, dtype));
    XCCL_CHECK(comm_usable(comm, "all_to_all_v"));
    if (!scounts || !sdispls || !rcounts || !rdispls)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "all_to_all_v: counts and displacements needed");
    for (int i = 0; i < comm->size; i++) {
        total += scounts[i];
        rtotal += rcounts[i];
    }
    XCCL_CHECK(check_buf("all_to_all_v", "send buffer", sbuf, total));
    XCCL_CHECK(check_buf("all_to_all_v", "receive buffer", rbuf, rtotal));
    if (scounts[comm->rank] != rcounts[comm->rank])
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                          "all_to_all_v: rank %d sends %zu elements to itself but expects %zu",
                          comm->rank, scounts[comm->rank], rcounts[comm->rank]);
    a         = ARGS(XCCL_COLL_ALLTOALLV, sbuf, rbuf, 0, dtype, XCCL_OP_SUM, -1);
    a.scounts = scounts;
    a.sdispls = sdispls;
    a.rcounts = rcounts;
    a.rdispls = rdispls;
    return coll_post(comm, &a, XCCL_OP_SUM, opts, total * a.elsize, w);
}

xccl_status_t xccl_barrier(xccl_comm_t *comm, const xccl_coll_opts_t *opts, xccl_work_t **w)
{
    xccl_coll_args_t a = ARGS(XCCL_COLL_BARRIER, NULL, NULL, 0, XCCL_UINT8, XCCL_OP_SUM, -1);

    return coll_post(comm, &a, XCCL_OP_SUM, opts, 0, w);
}
