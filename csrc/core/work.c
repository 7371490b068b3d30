/* SPDX-License-Identifier: Apache-2.0
 *
 * work.c - Work lifecycle: creation, completion, callbacks, test/wait, timeouts.
 *
 * References: the caller's handle, the active list while posted, one per request a transport
 * holds, and the callback list until the callback ran. The Work is freed at zero.
 *
 * Waiting: a waiter drives progress itself (no thread hand-off for synchronous operations):
 * it polls for XCCL_SPIN_US microseconds after the last event, then sleeps in the transports
 * and polls again. Between polls it yields the CPU where the host has more ranks than CPUs
 * (ctx->spin_yield), otherwise only every 16th idle poll (a peer that shares our CPU still
 * gets it soon). The background progress thread stands aside while anyone waits.
 */
#include "core/core.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

xccl_work_t *xccl_work_new(xccl_comm_t *comm, work_kind_t kind, const char *name,
                           int64_t timeout_ms)
{
    xccl_work_t *w = calloc(1, sizeof(*w));

    if (w == NULL) return NULL;
    atomic_init(&w->refcount, 1);
    atomic_init(&w->status, XCCL_INPROGRESS);
    w->kind       = kind;
    w->comm       = comm;
    w->name       = name;
    w->timeout_ms = timeout_ms > 0 ? timeout_ms : comm->timeout_ms;
    w->task.work  = w;
    w->source     = -1;
    return w;
}

void xccl_work_retain(xccl_work_t *w) { atomic_fetch_add(&w->refcount, 1); }

/* Requests a failed collective left behind; the context may be gone, so not into its pool. */
static void free_reqs(xccl_req_t *r)
{
    while (r != NULL) {
        xccl_req_t *n = r->wnext;
        free(r);
        r = n;
    }
}

/* Opens the Work's completion gate (exec.h), once: streams waiting for it go on. */
static void gate_open(xccl_work_t *w)
{
    if (w->gate_exec != NULL && !w->gate_opened) {
        w->gate_opened = 1;
        w->gate_exec->gate_open(w->gate);
    }
}

void xccl_work_release(xccl_work_t *w)
{
    if (w == NULL || atomic_fetch_sub(&w->refcount, 1) != 1) return;
    /* a Work that failed while being posted never finished */
    xccl_work_ready_drop(w);
    gate_open(w);
    if (w->kind == WORK_COLL) xccl_coll_free(w);
    free_reqs(w->task.reqs);
    free(w->vcounts);
    free(w->errmsg);
    free(w);
}

/* Counts w for the background progress thread. `urgent` (a completion callback is waiting)
 * wakes the thread now; otherwise it picks the Work up on its next tick, so an operation that
 * its caller waits for right away never pays a thread wake-up (costly on small VMs). */
static void count_async(xccl_ctx_t *ctx, xccl_work_t *w, int urgent)
{
    if (w->async_counted) return;
    w->async_counted = 1;
    ctx->nasync++;
    xccl_ctx_start_thread(ctx);
    if (urgent && ctx->nwaiters == 0) pthread_cond_signal(&ctx->cond);
}

/* Inserts w into ctx->dl, ordered by deadline (ties in posting order). Works of one timeout
 * arrive in deadline order, so the walk back from the tail is usually one step. */
static void dl_insert(xccl_ctx_t *ctx, xccl_work_t *w)
{
    xccl_work_t *p = ctx->dl_tail;

    while (p != NULL && p->deadline_ms > w->deadline_ms) p = p->dl_prev;
    w->dl_prev = p;
    w->dl_next = p != NULL ? p->dl_next : ctx->dl_head;
    if (w->dl_next != NULL) w->dl_next->dl_prev = w;
    else ctx->dl_tail = w;
    if (p != NULL) p->dl_next = w;
    else ctx->dl_head = w;
}

void xccl_work_activate(xccl_work_t *w, int blocking)
{
    xccl_comm_t *comm = w->comm;
    xccl_ctx_t  *ctx  = comm->ctx;

    /* device work: its caller usually does not wait on the CPU (a stream waits for its
     * gate), so the thread takes it over now rather than at its next tick */
    if (w->gate_exec != NULL) ctx->ndevice++;
    if (!blocking) count_async(ctx, w, w->gate_exec != NULL);
    /* one clock read serves the enqueue time and the deadline */
    w->t_enq       = xccl_now_ns();
    w->active      = 1;
    w->deadline_ms = w->timeout_ms > 0 ? (int64_t)(w->t_enq / 1000000u) + w->timeout_ms
                                       : INT64_MAX;
    xccl_work_retain(w);
    xccl_comm_ref(comm);
    if (w->kind == WORK_COLL) {
        w->next = NULL;
        w->prev = ctx->coll_tail;
        if (ctx->coll_tail) ctx->coll_tail->next = w;
        else ctx->coll_head = w;
        ctx->coll_tail = w;
        /* out of memory only costs the early fingerprint check of this operation */
        (void)xccl_u64map_put(&comm->colls, w->seq + 1, w);
    }
    w->cm_next = NULL;
    w->cm_prev = comm->works_tail;
    if (comm->works_tail) comm->works_tail->cm_next = w;
    else comm->works_head = w;
    comm->works_tail = w;
    dl_insert(ctx, w);
}

/* Takes w off the lists of active Works, moving on any walk that stood on it. */
static void active_unlink(xccl_ctx_t *ctx, xccl_work_t *w)
{
    xccl_comm_t *comm = w->comm;

    for (xccl_cursor_t *c = ctx->cursors; c != NULL; c = c->up) {
        if (c->w == w) c->w = c->dl ? w->dl_next : w->next;
    }
    if (w->kind == WORK_COLL) {
        if (w->prev) w->prev->next = w->next;
        else ctx->coll_head = w->next;
        if (w->next) w->next->prev = w->prev;
        else ctx->coll_tail = w->prev;
        w->next = w->prev = NULL;
        if (xccl_u64map_get(&comm->colls, w->seq + 1) == w)
            (void)xccl_u64map_del(&comm->colls, w->seq + 1);
    }
    if (w->cm_prev) w->cm_prev->cm_next = w->cm_next;
    else comm->works_head = w->cm_next;
    if (w->cm_next) w->cm_next->cm_prev = w->cm_prev;
    else comm->works_tail = w->cm_prev;
    w->cm_next = w->cm_prev = NULL;
    if (w->dl_prev) w->dl_prev->dl_next = w->dl_next;
    else ctx->dl_head = w->dl_next;
    if (w->dl_next) w->dl_next->dl_prev = w->dl_prev;
    else ctx->dl_tail = w->dl_prev;
    w->dl_next = w->dl_prev = NULL;
}

void xccl_work_finish(xccl_work_t *w, xccl_status_t st, const char *msg)
{
    xccl_ctx_t *ctx = w->comm->ctx;

    if (!w->active) return;
    w->active = 0;
    if (st < 0) {
        const char *m = msg ? msg : xccl_last_error();
        w->errmsg     = strdup(m && *m ? m : xccl_status_string(st));
        /* peers waiting on this rank's part would otherwise only time out (a timeout needs no
         * notice: every rank waiting on the stalled one times out on its own and says so) */
        if (w->kind == WORK_COLL && st == XCCL_ERR_REMOTE) {
            xccl_coll_notify_failure(w, w->errmsg ? w->errmsg : "failure");
            xccl_coll_break(w->comm, w->seq, w->errmsg ? w->errmsg : "failure");
        }
        /* a stream that waited for it goes on when its gate opens, with whatever its buffers
         * hold: the communicator refuses every later call, so the failure cannot go unseen */
        if (w->kind == WORK_COLL && atomic_load(&w->stream_waited))
            xccl_coll_break(w->comm, w->seq, w->errmsg ? w->errmsg : "failure");
        /* retire every request still out: posted ones are unlinked, transport-held ones are
         * dropped with their connection (xccl_req_cancel) */
        if (w->kind == WORK_P2P && w->held) xccl_p2p_hold_unlink(ctx, w); /* never posted */
        else if (w->kind == WORK_P2P && w->req) xccl_req_cancel(ctx, w->req, st, w->errmsg);
        for (xccl_req_t *r = w->task.reqs; r != NULL; r = r->wnext)
            xccl_req_cancel(ctx, r, st, w->errmsg);
    }
    if (w->async_counted) {
        w->async_counted = 0;
        ctx->nasync--;
    }
    if (w->kind == WORK_COLL) {
        xccl_task_scratch_return(&w->task, st == XCCL_OK);
        /* freed with the Work, perhaps after the context: leaves the caches now */
        if (w->tmp != NULL) xccl_ctx_mem_forget(ctx, w->tmp, w->tmp_len);
    }
    w->t_end = xccl_now_ns();
    xccl_work_ready_drop(w);
    if (w->gate_exec != NULL) ctx->ndevice--;
    gate_open(w);
    atomic_store(&w->status, st);
    xccl_flight_record(w);
    active_unlink(ctx, w);
    /* the active list's reference moves to the callback list */
    w->cnext       = ctx->done_head;
    ctx->done_head = w;
    /* only a callback needs the thread (a waiter runs callbacks itself); waking it for every
     * finished operation costs a context switch per call on small machines */
    if (w->cb != NULL && ctx->nwaiters == 0) pthread_cond_signal(&ctx->cond);
    xccl_comm_unref(w->comm); /* the Work no longer reads w->comm */
}

/* A failed point-to-point operation in the words of a failed collective: which operation, on
 * which communicator, on which of its ranks (the ranks it names are that communicator's). */
const char *xccl_p2p_error(const xccl_work_t *w, const char *detail, char *buf, size_t len)
{
    snprintf(buf, len, "%s (p2p, tag %llu) on comm '%s' failed on rank %d: %s", w->name,
             (unsigned long long)(w->req != NULL ? w->req->tag : 0), w->comm->name,
             w->comm->rank, detail != NULL && *detail ? detail : "failure");
    return buf;
}

/* The message of a failed request: the transport's reason for its peer when there is one. */
static const char *req_error(xccl_ctx_t *ctx, const xccl_req_t *r, char *buf, size_t len)
{
    int         world = xccl_req_world_peer(r);
    const char *why   = world >= 0 && world < ctx->size ? ctx->peer_dead[world] : NULL;
    const char *last  = xccl_last_error();

    const xccl_comm_t *comm = r->work->comm;
    size_t             off;

    if (r->status == XCCL_ERR_INVALID_USAGE && last && *last) return last;
    off = (size_t)snprintf(buf, len, "%s rank %d failed: %s",
                           r->kind == REQ_SEND ? "send to" : "receive from",
                           world >= 0 ? xccl_comm_rank_of_world(comm, world) : -1,
                           why ? why : (last && *last ? last : xccl_status_string(r->status)));
    /* a live peer that gave up usually did so because another member died: name that one */
    for (int i = 0; i < comm->size && off < len; i++) {
        const char *dead = ctx->peer_dead[comm->world[i]];
        if (comm->world[i] != world && dead != NULL)
            off += (size_t)snprintf(buf + off, len - off, "; rank %d had failed: %s", i, dead);
    }
    return buf;
}

void xccl_req_finished(xccl_ctx_t *ctx, xccl_req_t *r)
{
    xccl_work_t *w = r->work;
    char         msg[600];

    if (!w->active) return;
    if (w->kind == WORK_P2P) {
        /* recorded now: the communicator may be gone when the user asks */
        if (r->kind == REQ_RECV && r->status == XCCL_OK)
            w->source = xccl_comm_rank_of_world(w->comm, r->src);
        if (r->status == XCCL_OK) {
            xccl_work_finish(w, XCCL_OK, NULL);
        } else {
            char full[800];
            xccl_work_finish(w, r->status,
                             xccl_p2p_error(w, req_error(ctx, r, msg, sizeof(msg)), full,
                                            sizeof(full)));
        }
        return;
    }
    w->task.npending--;
    if (r->status < 0) {
        char full[800];
        snprintf(full, sizeof(full), "%s (algo %s, seq %llu) on comm '%s' failed on rank %d: %s",
                 w->name, w->task.algo->name, (unsigned long long)w->seq, w->comm->name,
                 w->comm->rank, req_error(ctx, r, msg, sizeof(msg)));
        xccl_work_finish(w, r->status, full);
    }
}

void xccl_work_progress_locked(xccl_work_t *w)
{
    xccl_status_t st;

    if (w->kind != WORK_COLL) return;
    if (w->t_start == 0) w->t_start = xccl_now_ns();
    st = xccl_coll_progress(w);
    if (st == XCCL_INPROGRESS || !w->active) return;
    xccl_work_finish(w, st, NULL);
}

void xccl_work_expire(xccl_work_t *w)
{
    char        msg[4096], table[3072], silent[256];
    size_t      tlen;
    size_t      off = 0;
    int         shown = 0;
    xccl_req_t *list  = w->kind == WORK_P2P ? w->req : w->task.reqs;

    w->expiring = 1;
    off += (size_t)snprintf(msg + off, sizeof(msg) - off,
                            "%s (algo %s, seq %llu) on comm '%s' timed out after %.1f s on rank %d",
                            w->name, w->kind == WORK_P2P ? "p2p" : w->task.algo->name,
                            (unsigned long long)w->seq, w->comm->name,
                            (double)w->timeout_ms / 1000.0, w->comm->rank);
    for (xccl_req_t *r = list; r != NULL && off < sizeof(msg) - 80;
         r = w->kind == WORK_P2P ? NULL : r->wnext) {
        int world, peer;
        if (r->state == REQ_DONE) continue;
        world = xccl_req_world_peer(r);
        peer  = world < 0 ? -1 : xccl_comm_rank_of_world(w->comm, world);
        if (shown++ == 0) off += (size_t)snprintf(msg + off, sizeof(msg) - off, ": waiting for");
        if (peer < 0)
            off += (size_t)snprintf(msg + off, sizeof(msg) - off, "%s a message from any rank",
                                    shown > 1 ? "," : "");
        else
            off += (size_t)snprintf(msg + off, sizeof(msg) - off, "%s %s rank %d (%s, %zu bytes)",
                                    shown > 1 ? "," : "",
                                    r->kind == REQ_SEND ? "a send to" : "a message from", peer,
                                    r->state == REQ_ACTIVE ? "in transfer" : "not started",
                                    r->nbytes);
    }
    if (w->kind == WORK_COLL && off < sizeof(msg) - 80) {
        char   what[512];
        size_t n = xccl_shared_describe(w, what, sizeof(what));
        if (n > 0)
            off += (size_t)snprintf(msg + off, sizeof(msg) - off, "%s %s",
                                    shown++ ? "," : ": waiting for", what);
    }
    if (w->kind == WORK_COLL && (w->task.nev > 0 || w->task.nheld > 0) && off < sizeof(msg))
        off += (size_t)snprintf(msg + off, sizeof(msg) - off,
                                "%s %d local operation(s) unfinished on the %s executor (%d "
                                "send(s)/receive(s) held behind them)",
                                shown ? ";" : ":", w->task.nev, w->task.exec->name,
                                w->task.nheld);
    if (off >= sizeof(msg)) off = sizeof(msg) - 1;
    /* diag.c: where every member is. It lets the lock go while it waits for answers, so w may
     * finish otherwise meanwhile (its caller holds a reference; `expiring` keeps other
     * progress passes from expiring it too). The members that do not answer are named in the
     * first line: the rank waited for may itself wait for one that is stopped or dead (a rank
     * SIGSTOPped mid-ring is otherwise named only in the table) */
    tlen = xccl_diag_table(w->comm, xccl_diag_wait_ms(w->timeout_ms), table, sizeof(table),
                           silent, sizeof(silent));
    if (!w->active) return;
    if (silent[0] != '\0' && off < sizeof(msg))
        off += (size_t)snprintf(msg + off, sizeof(msg) - off,
                                "; no answer from %s (stopped, dead, or not driving progress?)",
                                silent);
    if (off >= sizeof(msg)) off = sizeof(msg) - 1;
    if (tlen > 0) off += (size_t)snprintf(msg + off, sizeof(msg) - off, "%s", table);
    (void)xccl_error_report(XCCL_ERR_TIMEOUT, __FILE__, __LINE__, "%s", msg);
    xccl_work_finish(w, XCCL_ERR_TIMEOUT, msg);
}

/* ------------------------------------------------------------------------------------------ */
/* Public Work API                                                                             */
/* ------------------------------------------------------------------------------------------ */

xccl_status_t xccl_work_status(const xccl_work_t *w) { return atomic_load(&w->status); }

const char *xccl_work_error(const xccl_work_t *w) { return w->errmsg ? w->errmsg : ""; }

xccl_status_t xccl_work_wait_stream(xccl_work_t *w, void *stream)
{
    xccl_status_t st;

    if (w == NULL) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "wait_stream: Work is NULL");
    if (w->gate_exec == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_USAGE, "%s: wait_stream needs an operation on device "
                          "memory (this one's buffers are host memory)", w->name);
    /* marked under the lock: a failure from here on breaks the communicator (xccl.h, Streams).
     * No operation waits for a driver call the device layer refuses while a stream waits
     * (task.h, "Device memory of peers"), so the stream may wait right away. */
    st = atomic_load(&w->status);
    if (st == XCCL_INPROGRESS) {
        xccl_ctx_t *ctx = w->comm->ctx;

        pthread_mutex_lock(&ctx->lock);
        st = atomic_load(&w->status);
        if (st == XCCL_INPROGRESS) {
            atomic_store(&w->stream_waited, 1);
            count_async(ctx, w, 1); /* nobody waits on the CPU: the thread drives it */
        }
        pthread_mutex_unlock(&ctx->lock);
    }
    if (st == XCCL_OK) return XCCL_OK; /* its device work has finished */
    if (st < 0) return XCCL_ERROR(st, "%s", xccl_work_error(w));
    /* racing with the finish is fine: a gate, once open, lets every later waiter through */
    st = w->gate_exec->gate_wait(w->gate, stream);
    if (st < 0) {
        /* no stream waits: a failure need not break the communicator (a finished Work has
         * decided already, and may have outlived its communicator) */
        if (atomic_load(&w->status) == XCCL_INPROGRESS) {
            xccl_ctx_t *ctx = w->comm->ctx;

            pthread_mutex_lock(&ctx->lock);
            atomic_store(&w->stream_waited, 0);
            pthread_mutex_unlock(&ctx->lock);
        }
        return st;
    }
    st = atomic_load(&w->status);
    return st < 0 ? XCCL_ERROR(st, "%s", xccl_work_error(w)) : XCCL_OK;
}

int xccl_work_source(const xccl_work_t *w) { return w->source; }

size_t xccl_work_nbytes(const xccl_work_t *w)
{
    if (w->kind != WORK_P2P || w->req == NULL) return 0;
    return w->req->kind == REQ_RECV ? w->req->received : w->req->nbytes;
}

const char *xccl_work_algo(const xccl_work_t *w)
{
    return w->kind == WORK_P2P ? "p2p" : w->task.algo->name;
}

const char *xccl_work_name(const xccl_work_t *w) { return w->name; }

uint64_t xccl_work_seq(const xccl_work_t *w) { return w->seq; }

void xccl_work_times(const xccl_work_t *w, uint64_t *enqueue_ns, uint64_t *start_ns,
                     uint64_t *end_ns)
{
    if (enqueue_ns) *enqueue_ns = w->t_enq;
    if (start_ns) *start_ns = w->t_start;
    if (end_ns) *end_ns = atomic_load(&w->status) == XCCL_INPROGRESS ? 0 : w->t_end;
}

xccl_status_t xccl_work_on_complete(xccl_work_t *w, xccl_work_cb_t cb, void *arg)
{
    xccl_ctx_t *ctx;
    int         now;

    if (atomic_load(&w->status) != XCCL_INPROGRESS) {
        /* finished: its trip through the callback list (if any) happened without a callback,
         * and the context may be gone, so run it here without touching the context */
        cb(w, arg);
        return XCCL_OK;
    }
    ctx = w->comm->ctx;
    pthread_mutex_lock(&ctx->lock);
    if (w->cb != NULL) {
        pthread_mutex_unlock(&ctx->lock);
        return XCCL_ERROR(XCCL_ERR_INVALID_USAGE, "a completion callback is already set");
    }
    /* complete and already past the callback list: run here */
    now = !w->active && atomic_load(&w->status) != XCCL_INPROGRESS;
    if (!now) {
        w->cb     = cb;
        w->cb_arg = arg;
        count_async(ctx, w, 1); /* someone must drive it even if nobody waits */
    }
    pthread_mutex_unlock(&ctx->lock);
    if (now) cb(w, arg); /* queued without a callback: nothing else runs this one */
    return XCCL_OK;
}

xccl_status_t xccl_work_test(xccl_work_t *w)
{
    xccl_status_t st = atomic_load(&w->status);
    xccl_ctx_t   *ctx;

    /* a finished Work may outlive its communicator: do not touch it */
    if (st != XCCL_INPROGRESS) return st;
    ctx = w->comm->ctx;
    if (pthread_mutex_trylock(&ctx->lock) == 0) {
        (void)xccl_ctx_progress_locked(ctx);
        pthread_mutex_unlock(&ctx->lock);
        xccl_ctx_run_callbacks(ctx);
    }
    return atomic_load(&w->status);
}

xccl_status_t xccl_work_wait(xccl_work_t *w, int64_t slice_ms)
{
    return xccl_work_wait_us(w, slice_ms < 0 ? -1 : slice_ms * 1000);
}

/* Drives progress until w completes; at most slice_us (< 0: no limit but the Works'
 * deadlines). */
xccl_status_t xccl_work_wait_us(xccl_work_t *w, int64_t slice_us)
{
    xccl_status_t st = atomic_load(&w->status);
    xccl_ctx_t   *ctx;
    uint64_t      now, spin_end, slice_end;
    unsigned      busy = 0; /* passes with events since the clock was last read */
    unsigned      idle = 0; /* passes that found nothing */
    int           device;   /* device work is active: poll, never sleep (ctx->ndevice) */
    xccl_shsleep_t sh  = {0}; /* armed: about to sleep on a node-shared segment's doorbell */

    if (st != XCCL_INPROGRESS) return st;
    ctx       = w->comm->ctx;
    spin_end  = 0; /* both set at the first clock read: an operation that ends in the first */
    slice_end = 0; /* busy passes costs no clock read                                       */
    pthread_mutex_lock(&ctx->lock);
    ctx->nwaiters++;
    for (;;) {
        int n = xccl_ctx_progress_locked(ctx);
        if (n > 0) xccl_shared_disarm(&sh);
        if (atomic_load(&w->status) != XCCL_INPROGRESS) break;
        if (ctx->done_head != NULL) {
            pthread_mutex_unlock(&ctx->lock);
            xccl_ctx_run_callbacks(ctx);
            pthread_mutex_lock(&ctx->lock);
        }
        /* the clock is read when a pass finds nothing (and every 64 busy passes, for the
         * slice): a busy pass goes straight to the next */
        if (n > 0 && ++busy % 64 != 0) continue;
        now = xccl_now_ns();
        if (slice_end == 0) {
            spin_end  = now + (uint64_t)ctx->spin_ns;
            slice_end = slice_us < 0 ? UINT64_MAX : now + (uint64_t)slice_us * 1000u;
        }
        if (now >= slice_end) break;
        if (busy > 0) {
            /* poll again for a while after every event, not only at the start: the next
             * message of a multi-step collective usually follows within microseconds */
            spin_end = now + (uint64_t)ctx->spin_ns;
            busy     = 0;
        }
        if (n > 0) continue;
        /* past the spin window while a task waits on a node-shared segment: count this thread
         * as a sleeper on its doorbell, make one more pass, then sleep there (shared.c) */
        if (now >= spin_end && sh.comm == NULL && xccl_shared_arm(ctx, &sh)) continue;
        device = ctx->ndevice > 0;
        pthread_mutex_unlock(&ctx->lock);
        if (now < spin_end) {
            if (ctx->spin_yield || ++idle % 16 == 0) sched_yield();
            else xccl_cpu_relax();
        } else if (device) {
            xccl_device_nap();
        } else {
            uint64_t left = (slice_end - now) / 1000000u;
            int      ms   = (int)(left < 2 ? (left < 1 ? 0 : 1) : 2);
            if (sh.comm != NULL) xccl_shared_doze(&sh, ms);
            else xccl_ctx_sleep(ctx, ms);
        }
        pthread_mutex_lock(&ctx->lock);
        xccl_shared_disarm(&sh);
    }
    xccl_shared_disarm(&sh);
    ctx->nwaiters--;
    /* the last waiter hands progress back to the thread (if it has async work) or lets a
     * closing context go on. Not after a short slice that ends with its own Work unfinished:
     * such a caller waits again at once (the Python layer's short spin with the GIL, then the
     * wait without it), and waking the thread in between would cost thread wake-ups on every
     * call; should it not come back, the thread takes the Work over at its next tick (2 ms),
     * as count_async says. */
    {
        int short_slice = slice_us >= 0 && slice_us < 1000;
        int hand_over =
            ctx->nasync > 0 && !(short_slice && atomic_load(&w->status) == XCCL_INPROGRESS);
        if (ctx->nwaiters == 0 && (hand_over || ctx->stopping)) pthread_cond_broadcast(&ctx->cond);
    }
    pthread_mutex_unlock(&ctx->lock);
    xccl_ctx_run_callbacks(ctx);
    return atomic_load(&w->status);
}
