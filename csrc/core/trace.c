/* SPDX-License-Identifier: Apache-2.0
 *
 * trace.c - step tracing (every send, receive and local reduction of every operation, into a
 * per-communicator ring buffer) and the flight recorder (the last finished operations). When
 * tracing is off the cost is one branch per request.
 */
#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void locate(const xccl_work_t *w, const void *p, int32_t *buf, uint64_t *off)
{
    const xccl_task_t      *t  = &w->task;
    const xccl_coll_args_t *a  = &t->args;
    const char             *c  = p;
    size_t                  span;

    *buf = -1;
    *off = 0;
    if (w->kind != WORK_COLL || p == NULL) return;
    span = a->count * a->elsize * (size_t)w->comm->size;
    if (a->coll == XCCL_COLL_ALLTOALLV) span = SIZE_MAX / 4;
    if (t->scratch && c >= (const char *)t->scratch && c < (const char *)t->scratch + t->scratch_len) {
        *buf = 2, *off = (uint64_t)(c - (const char *)t->scratch);
    } else if (a->rbuf && c >= (const char *)a->rbuf && c <= (const char *)a->rbuf + span) {
        *buf = 1, *off = (uint64_t)(c - (const char *)a->rbuf);
    } else if (a->sbuf && c >= (const char *)a->sbuf && c <= (const char *)a->sbuf + span) {
        *buf = 0, *off = (uint64_t)(c - (const char *)a->sbuf);
    }
}

static xccl_trace_event_t *slot(xccl_comm_t *c)
{
    xccl_trace_event_t *e;

    if (c->trace_n == c->trace_cap) { /* full: drop the oldest */
        c->trace_head = (c->trace_head + 1) % c->trace_cap;
        c->trace_n--;
        c->trace_dropped++;
    }
    e = &c->trace[(c->trace_head + c->trace_n) % c->trace_cap];
    c->trace_n++;
    memset(e, 0, sizeof(*e));
    return e;
}

static void fill_names(xccl_trace_event_t *e, const xccl_work_t *w)
{
    snprintf(e->op, sizeof(e->op), "%s", w->name);
    snprintf(e->algo, sizeof(e->algo), "%s", xccl_work_algo(w));
}

void xccl_trace_req(xccl_req_t *r)
{
    xccl_work_t        *w = r->work;
    xccl_comm_t        *c;
    xccl_trace_event_t *e;
    int                 me, other;

    if (w == NULL || w->comm->trace_cap == 0) return;
    c     = w->comm;
    e     = slot(c);
    me    = c->rank;
    other = xccl_comm_rank_of_world(c, r->kind == REQ_SEND ? r->peer : r->src);
    fill_names(e, w);
    e->seq        = w->seq;
    e->step       = r->step;
    e->kind       = r->kind == REQ_SEND ? XCCL_TRACE_SEND : XCCL_TRACE_RECV;
    e->src        = r->kind == REQ_SEND ? me : other;
    e->dst        = r->kind == REQ_SEND ? other : me;
    e->nbytes     = r->kind == REQ_SEND ? r->nbytes : r->received;
    e->t_start_ns = r->t0;
    e->t_end_ns   = r->t1;
    locate(w, r->buf, &e->buf, &e->offset);
    snprintf(e->transport, sizeof(e->transport), "%s",
             other >= 0 ? xccl_comm_peer_transport(c, other) : "?");
}

/* A step this rank ran itself (no request): a reduction, or a read from `src`'s memory, that
 * began at t0 and just ended, landing at dst. */
static void trace_local(xccl_task_t *t, xccl_trace_kind_t kind, int src, const void *dst,
                        size_t nbytes, uint64_t t0, const char *how)
{
    xccl_work_t        *w = t->work;
    xccl_comm_t        *c = w->comm;
    xccl_trace_event_t *e;

    if (c->trace_cap == 0) return;
    e = slot(c);
    fill_names(e, w);
    e->seq        = w->seq;
    e->kind       = kind;
    e->src        = src < 0 ? c->rank : src;
    e->dst        = c->rank;
    e->nbytes     = nbytes;
    e->t_start_ns = t0;
    e->t_end_ns   = xccl_now_ns();
    locate(w, dst, &e->buf, &e->offset);
    snprintf(e->transport, sizeof(e->transport), "%s", how);
}

void xccl_trace_reduce(xccl_task_t *t, const void *dst, size_t nbytes, uint64_t t0)
{
    trace_local(t, XCCL_TRACE_REDUCE, -1, dst, nbytes, t0, "local");
}

void xccl_trace_read(xccl_task_t *t, int peer, const void *dst, size_t nbytes, uint64_t t0)
{
    trace_local(t, XCCL_TRACE_RECV, peer, dst, nbytes, t0, "cma");
}

xccl_status_t xccl_comm_trace(xccl_comm_t *comm, size_t capacity)
{
    xccl_trace_event_t *buf = NULL;

    if (comm == NULL) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "trace: comm is NULL");
    if (capacity > 0) {
        buf = calloc(capacity, sizeof(*buf));
        if (buf == NULL)
            return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "trace: no memory for %zu events", capacity);
    }
    pthread_mutex_lock(&comm->ctx->lock);
    free(comm->trace);
    comm->trace         = buf;
    comm->trace_cap     = capacity;
    comm->trace_head    = 0;
    comm->trace_n       = 0;
    comm->trace_dropped = 0;
    pthread_mutex_unlock(&comm->ctx->lock);
    return XCCL_OK;
}

size_t xccl_comm_trace_drain(xccl_comm_t *comm, xccl_trace_event_t *out, size_t max)
{
    size_t n = 0;

    pthread_mutex_lock(&comm->ctx->lock);
    while (n < max && comm->trace_n > 0) {
        out[n++]         = comm->trace[comm->trace_head];
        comm->trace_head = (comm->trace_head + 1) % comm->trace_cap;
        comm->trace_n--;
    }
    pthread_mutex_unlock(&comm->ctx->lock);
    return n;
}

uint64_t xccl_comm_trace_dropped(const xccl_comm_t *comm) { return comm->trace_dropped; }

void xccl_flight_record(xccl_work_t *w)
{
    xccl_comm_t        *c = w->comm;
    struct xccl_flight *f = &c->flight[c->nflight++ % (sizeof(c->flight) / sizeof(c->flight[0]))];

    f->seq    = w->seq;
    f->name   = w->name;
    f->algo   = xccl_work_algo(w);
    f->status = atomic_load(&w->status);
    f->t_enq  = w->t_enq;
    f->t_end  = w->t_end;
}

size_t xccl_comm_flight_dump(xccl_comm_t *comm, char *buf, size_t len)
{
    const size_t nf  = sizeof(comm->flight) / sizeof(comm->flight[0]);
    size_t       off = 0;
    uint64_t     now = xccl_now_ns();
    uint64_t     first;

#define OUT(...)                                                                              \
    do {                                                                                      \
        if (off < len) off += (size_t)snprintf(buf + off, len - off, __VA_ARGS__);            \
    } while (0)

    if (len == 0) return 0;
    buf[0] = '\0';
    pthread_mutex_lock(&comm->ctx->lock);
    OUT("comm '%s' rank %d/%d\n", comm->name, comm->rank, comm->size);
    OUT("%6s  %-16s %-14s %-10s %10s  %s\n", "seq", "operation", "algo", "state", "age_ms",
        "waiting for");
    first = comm->nflight > nf ? comm->nflight - nf : 0;
    for (uint64_t i = first; i < comm->nflight; i++) {
        struct xccl_flight *f = &comm->flight[i % nf];
        OUT("%6llu  %-16s %-14s %-10s %10.1f\n", (unsigned long long)f->seq, f->name, f->algo,
            f->status == XCCL_OK ? "done" : xccl_status_string(f->status) + 5,
            (double)(now - f->t_enq) / 1e6);
    }
    for (xccl_work_t *w = comm->works_head; w != NULL; w = w->cm_next) {
        xccl_req_t *list = w->kind == WORK_P2P ? w->req : w->task.reqs;
        OUT("%6llu  %-16s %-14s %-10s %10.1f  ", (unsigned long long)w->seq, w->name,
            xccl_work_algo(w), "pending", (double)(now - w->t_enq) / 1e6);
        for (xccl_req_t *r = list; r != NULL; r = w->kind == WORK_P2P ? NULL : r->wnext) {
            if (r->state == REQ_DONE) continue;
            if (r->peer == XCCL_ANY_SOURCE) OUT("recv<-any ");
            else
                OUT("%s%d ", r->kind == REQ_SEND ? "send->" : "recv<-",
                    xccl_comm_rank_of_world(comm, r->peer));
        }
        /* one-host algorithms wait for a rank's writes to the node-shared segment */
        if (w->kind == WORK_COLL &&
            (w->task.shared_wait == SHWAIT_WRITE || w->task.shared_wait == SHWAIT_ATTACH)) {
            if (w->task.shared_peer >= 0) OUT("shm<-%d ", w->task.shared_peer);
            else OUT("shm<-any ");
        }
        OUT("\n");
    }
    pthread_mutex_unlock(&comm->ctx->lock);
#undef OUT
    return off < len ? off : len - 1;
}
