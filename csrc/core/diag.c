/* SPDX-License-Identifier: Apache-2.0
 *
 * diag.c - cross-rank hang diagnosis: when an operation times out, the rank asks every other
 * member of the communicator where it stands and appends the answers, one row per rank, to the
 * timeout message:
 *
 *     rank 0: all_reduce #3 (ring) waiting for recv from rank 2, send to rank 1 (2.0 s)
 *     rank 1: all_reduce #3 (ring) waiting for recv from rank 0 (1.0 s)
 *     rank 2: idle, last finished #2 all_reduce
 *
 * Protocol (two control messages of the communicator, see TAG_CTRL_DIAG in core.h)
 *   query   tag_ctrl(qid) | TAG_CTRL_DIAG         no payload; qid numbers the asker's queries
 *   answer  tag_ctrl(qid) | TAG_CTRL_DIAG_REPLY   payload: the answerer's row, text ending in NUL
 *
 *   A rank answers at match time (xccl_coll_ctrl_arrived), from whatever drives its progress:
 *   a thread waiting on a Work, the asker's own collection loop, or the background progress
 *   thread, which is started with the first communicator (xccl_diag_comm_ready) and makes one
 *   progress pass per 20 ms tick when idle, so a rank busy in user code still answers.
 *
 * Cost: nothing while no operation times out (no state, no messages). A timeout adds at most
 *   the collection time, min(1 s, timeout / 4) but at least 100 ms (XCCL_DIAG_WAIT_MS
 *   overrides; 0 turns the table off), usually much less: it ends when every member answered
 *   or is known dead. The asker pumps the transports under the context lock and sleeps
 *   without it, so the process's other threads go on meanwhile: they may deliver the answers,
 *   finish the operation that timed out, or destroy its communicator (the table holds a
 *   reference on it).
 *
 * Thread-safety: everything here runs under the context lock. The table of open collections
 *   is process-wide (several contexts may live in one process: xccl.launch threads mode) and
 *   has its own mutex, always taken after a context lock, never before.
 */
#include "core/core.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DIAG_ROW_MAX   400  /* one rank's row, answer payload included          */
#define DIAG_WORKS_MAX 4    /* active operations listed per row                 */
#define DIAG_REQS_MAX  6    /* pending messages listed per operation            */
#define DIAG_CACHE_MS  1000 /* a table this recent is reused for the same comm */

/* One collection in progress: the asker's stack frame, registered while it waits. */
typedef struct diag_wait {
    xccl_ctx_t       *ctx;
    uint64_t          comm_id;
    uint64_t          qid;
    xccl_comm_t      *comm;
    char            **rows; /* per comm rank: the answer (malloc), NULL while missing */
    int               nmissing;
    struct diag_wait *next;
} diag_wait_t;

static pthread_mutex_t  reg_lock = PTHREAD_MUTEX_INITIALIZER;
static diag_wait_t     *reg_head;
static _Atomic uint64_t next_qid = 1;
/* the last table built (reg_lock): reused when several operations of a comm time out at once */
static struct {
    const xccl_ctx_t *ctx;
    uint64_t          comm_id;
    int64_t           t_ms;
    char             *text;
    char             *silent;
} cache;

/* Appends printf output at *off, never past len - 1 (buf stays NUL-terminated). */
static void put(char *buf, size_t len, size_t *off, const char *fmt, ...)
{
    va_list ap;
    int     n;

    if (*off + 1 >= len) return;
    va_start(ap, fmt);
    n = vsnprintf(buf + *off, len - *off, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    *off = *off + (size_t)n < len ? *off + (size_t)n : len - 1;
}

static void put_work(char *buf, size_t len, size_t *off, const xccl_work_t *w, uint64_t now)
{
    const xccl_comm_t *comm  = w->comm;
    const xccl_req_t  *list  = w->kind == WORK_P2P ? w->req : w->task.reqs;
    int                shown = 0, more = 0;

    if (w->kind == WORK_P2P)
        put(buf, len, off, "%s (p2p, tag %u)", w->name,
            (unsigned)(list ? list->tag & 0xffffffffu : 0));
    else put(buf, len, off, "%s #%llu (%s)", w->name, (unsigned long long)w->seq,
             w->task.algo->name);
    for (const xccl_req_t *r = list; r != NULL; r = w->kind == WORK_P2P ? NULL : r->wnext) {
        if (r->state == REQ_DONE) continue;
        if (shown == DIAG_REQS_MAX) {
            more++;
            continue;
        }
        put(buf, len, off, "%s", shown++ ? ", " : " waiting for ");
        if (r->peer == XCCL_ANY_SOURCE) put(buf, len, off, "recv from any rank");
        else put(buf, len, off, "%s rank %d", r->kind == REQ_SEND ? "send to" : "recv from",
                 xccl_comm_rank_of_world(comm, r->peer));
    }
    if (more) put(buf, len, off, " and %d more", more);
    if (w->kind == WORK_COLL) {
        char what[256];
        if (xccl_shared_describe(w, what, sizeof(what)) > 0)
            put(buf, len, off, "%s%s", shown++ ? ", " : " waiting for ", what);
    }
    if (shown == 0) put(buf, len, off, " running (no message pending)");
    put(buf, len, off, " (%.1f s)", (double)(now - w->t_enq) / 1e9);
}

size_t xccl_diag_row(const xccl_comm_t *comm, char *buf, size_t len)
{
    const xccl_ctx_t *ctx = comm->ctx;
    uint64_t          now = xccl_now_ns();
    size_t            off = 0;
    int               n   = 0, other = 0;

    if (len == 0) return 0;
    buf[0] = '\0';
    for (const xccl_work_t *w = comm->works_head; w != NULL; w = w->cm_next) {
        if (n++ == DIAG_WORKS_MAX) continue;
        if (n > 1) put(buf, len, &off, "; ");
        put_work(buf, len, &off, w, now);
    }
    if (n > DIAG_WORKS_MAX) put(buf, len, &off, "; and %d more operations", n - DIAG_WORKS_MAX);
    if (n > 0) return off;
    if (comm->nflight == 0) {
        put(buf, len, &off, "idle, no operation finished yet");
    } else {
        const size_t              nf = sizeof(comm->flight) / sizeof(comm->flight[0]);
        const struct xccl_flight *f  = &comm->flight[(comm->nflight - 1) % nf];
        if (strcmp(f->algo, "p2p") == 0) /* p2p has no sequence number */
            put(buf, len, &off, "idle, last finished %s (p2p)", f->name);
        else put(buf, len, &off, "idle, last finished #%llu %s", (unsigned long long)f->seq,
                 f->name);
        if (f->status == XCCL_ERR_TIMEOUT) put(buf, len, &off, " (timed out)");
        else if (f->status != XCCL_OK)
            put(buf, len, &off, " (failed: %s)", xccl_status_string(f->status) + 5);
    }
    /* idle here, but maybe stuck on another communicator */
    for (const xccl_work_t *w = ctx->dl_head; w != NULL && !other; w = w->dl_next) {
        if (w->comm == comm) continue;
        put(buf, len, &off, "; busy on comm '%s': ", w->comm->name);
        put_work(buf, len, &off, w, now);
        other = 1;
    }
    return off;
}

/* An ownerless control message (freed by ctx.c when sent). 0 on success. */
static int send_ctrl(xccl_ctx_t *ctx, uint64_t comm_id, int world_peer, uint64_t tag,
                     const char *text)
{
    size_t      n = text ? strlen(text) + 1 : 0;
    xccl_req_t *r = n ? calloc(1, sizeof(*r) + n) : xccl_req_get(ctx);

    if (r == NULL) return -1;
    r->text    = n > 0;
    r->kind    = REQ_SEND;
    r->peer    = world_peer;
    r->comm_id = comm_id;
    r->tag     = tag;
    r->buf     = n ? (char *)(r + 1) : NULL;
    r->nbytes  = n;
    if (n) memcpy(r->buf, text, n);
    if (ctx->peer_dead[world_peer] != NULL || xccl_req_post_send(ctx, r) < 0) {
        xccl_req_put(ctx, r);
        return -1;
    }
    return 0;
}

int xccl_diag_ctrl_arrived(xccl_ctx_t *ctx, xccl_umsg_t *u)
{
    uint64_t     qid  = tag_ctrl_seq(u->hdr.tag);
    xccl_comm_t *comm = xccl_ctx_find_comm(ctx, u->hdr.comm_id);

    if (u->status != XCCL_OK) return 1;
    if (u->hdr.tag & TAG_CTRL_DIAG) {
        char row[DIAG_ROW_MAX];
        if (comm == NULL) snprintf(row, sizeof(row), "has not created this communicator yet");
        else if (comm->destroyed) snprintf(row, sizeof(row), "has destroyed this communicator");
        else (void)xccl_diag_row(comm, row, sizeof(row));
        (void)send_ctrl(ctx, u->hdr.comm_id, u->src, tag_ctrl(qid) | TAG_CTRL_DIAG_REPLY, row);
        return 1;
    }
    pthread_mutex_lock(&reg_lock);
    for (diag_wait_t *d = reg_head; d != NULL; d = d->next) {
        int r;
        if (d->ctx != ctx || d->comm_id != u->hdr.comm_id || d->qid != qid) continue;
        r = xccl_comm_rank_of_world(d->comm, u->src);
        if (r >= 0 && d->rows[r] == NULL) {
            size_t n = u->hdr.nbytes < DIAG_ROW_MAX ? (size_t)u->hdr.nbytes : DIAG_ROW_MAX - 1;
            d->rows[r] = malloc(n + 1);
            if (d->rows[r] != NULL) {
                if (n) memcpy(d->rows[r], u->data, n);
                d->rows[r][n] = '\0';
                d->nmissing--;
            }
        }
        break;
    }
    pthread_mutex_unlock(&reg_lock);
    return 1;
}

void xccl_diag_comm_ready(xccl_comm_t *comm)
{
    pthread_mutex_lock(&comm->ctx->lock);
    xccl_ctx_start_thread(comm->ctx);
    pthread_mutex_unlock(&comm->ctx->lock);
}

int64_t xccl_diag_wait_ms(int64_t timeout_ms)
{
    int64_t ms = xccl_env_int("XCCL_DIAG_WAIT_MS", -1);

    if (ms >= 0) return ms;
    ms = timeout_ms / 4;
    return ms > 1000 ? 1000 : ms < 100 ? 100 : ms;
}

/* The row of rank r in the table: its answer, or why there is none. */
static const char *row_text(const diag_wait_t *d, const uint8_t *dead, int r, int64_t wait_ms,
                            char *tmp, size_t len)
{
    const char *why;

    if (d->rows[r] != NULL) return d->rows[r];
    why = d->ctx->peer_dead[d->comm->world[r]];
    if (dead[r] && why != NULL) snprintf(tmp, len, "no answer, dead (%.200s)", why);
    else if (dead[r]) snprintf(tmp, len, "no answer, dead (could not be asked)");
    else snprintf(tmp, len, "no answer within %lld ms (dead, or not driving progress?)",
                  (long long)wait_ms);
    return tmp;
}

/* Writes the rows, ranks with the same row in a run merged ("ranks 3-7: ..."). */
static void put_rows(char *buf, size_t len, size_t *off, const diag_wait_t *d,
                     const uint8_t *dead, int64_t wait_ms)
{
    char a[DIAG_ROW_MAX], b[DIAG_ROW_MAX];

    for (int r = 0; r < d->comm->size;) {
        const char *row = row_text(d, dead, r, wait_ms, a, sizeof(a));
        int         e   = r + 1;
        while (e < d->comm->size && strcmp(row, row_text(d, dead, e, wait_ms, b, sizeof(b))) == 0)
            e++;
        if (e - r > 1) put(buf, len, off, "\n  ranks %d-%d: %s", r, e - 1, row);
        else put(buf, len, off, "\n  rank %d: %s", r, row);
        r = e;
    }
}

/* Pumps the transports until every member answered or is dead, or wait_ms. Lock held, but
 * released while sleeping. */
static void collect(diag_wait_t *d, uint8_t *dead, int64_t wait_ms)
{
    xccl_ctx_t  *ctx      = d->ctx;
    xccl_comm_t *comm     = d->comm;
    int64_t      deadline = xccl_now_ms() + wait_ms;

    for (;;) {
        int events = 0;
        for (int r = 0; r < comm->size; r++) {
            if (d->rows[r] == NULL && !dead[r] && ctx->peer_dead[comm->world[r]] != NULL) {
                dead[r] = 1;
                d->nmissing--;
            }
        }
        if (d->nmissing <= 0 || xccl_now_ms() >= deadline) break;
        for (int i = 0; i < ctx->ntp; i++) {
            int k = 0;
            (void)ctx->tp[i].ops->progress(ctx->tp[i].ctx, &k);
            events += k;
        }
        if (events == 0) {
            pthread_mutex_unlock(&ctx->lock);
            xccl_ctx_sleep(ctx, 1);
            pthread_mutex_lock(&ctx->lock);
        }
    }
}

/* "rank 1" or "ranks 1, 4, 5": the members that gave no answer (none: ""). */
static void put_silent(char *buf, size_t len, const diag_wait_t *d)
{
    size_t off = 0;
    int    n   = 0;

    buf[0] = '\0';
    for (int r = 0; r < d->comm->size; r++) n += d->rows[r] == NULL;
    for (int r = 0, k = 0; r < d->comm->size; r++) {
        if (d->rows[r] != NULL) continue;
        put(buf, len, &off, "%s%s%d", k == 0 ? (n > 1 ? "ranks " : "rank ") : "", k ? ", " : "",
            r);
        k++;
    }
}

static size_t table(xccl_comm_t *comm, int64_t wait_ms, int use_cache, char *buf, size_t len,
                    char *silent, size_t slen)
{
    xccl_ctx_t *ctx = comm->ctx;
    size_t      off = 0;
    diag_wait_t d   = {.ctx = ctx, .comm_id = comm->id, .comm = comm};
    uint8_t    *dead;
    char        row[DIAG_ROW_MAX];

    if (silent != NULL && slen > 0) silent[0] = '\0';
    if (len == 0) return 0;
    buf[0] = '\0';
    if (comm->size < 2 || comm->destroyed || wait_ms <= 0) return 0;
    pthread_mutex_lock(&reg_lock);
    if (use_cache && cache.text != NULL && cache.ctx == ctx && cache.comm_id == comm->id &&
        xccl_now_ms() - cache.t_ms < DIAG_CACHE_MS) {
        put(buf, len, &off, "%s", cache.text);
        if (silent != NULL && slen > 0)
            snprintf(silent, slen, "%s", cache.silent != NULL ? cache.silent : "");
        pthread_mutex_unlock(&reg_lock);
        return off;
    }
    pthread_mutex_unlock(&reg_lock);

    d.rows = calloc((size_t)comm->size, sizeof(char *));
    dead   = calloc((size_t)comm->size, 1);
    if (d.rows == NULL || dead == NULL) goto out;
    xccl_comm_ref(comm); /* the lock is let go while collecting */
    (void)xccl_diag_row(comm, row, sizeof(row));
    d.rows[comm->rank] = strdup(row);
    d.qid              = atomic_fetch_add(&next_qid, 1) & TAG_SEQ_MASK;
    pthread_mutex_lock(&reg_lock);
    d.next   = reg_head;
    reg_head = &d;
    pthread_mutex_unlock(&reg_lock);
    for (int r = 0; r < comm->size; r++) {
        if (r == comm->rank) continue;
        if (send_ctrl(ctx, comm->id, comm->world[r], tag_ctrl(d.qid) | TAG_CTRL_DIAG, NULL) < 0)
            dead[r] = 1;
        else d.nmissing++;
    }
    collect(&d, dead, wait_ms);
    pthread_mutex_lock(&reg_lock);
    for (diag_wait_t **pp = &reg_head; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == &d) {
            *pp = d.next;
            break;
        }
    }
    pthread_mutex_unlock(&reg_lock);

    put(buf, len, &off, "\nwhere the %d ranks of comm '%s' are (asked on rank %d):", comm->size,
        comm->name, comm->rank);
    put_rows(buf, len, &off, &d, dead, wait_ms);
    put_silent(row, sizeof(row), &d);
    if (silent != NULL && slen > 0) snprintf(silent, slen, "%s", row);
    pthread_mutex_lock(&reg_lock);
    free(cache.text);
    free(cache.silent);
    cache.silent  = strdup(row);
    cache.text    = strdup(buf);
    cache.ctx     = ctx;
    cache.comm_id = comm->id;
    cache.t_ms    = xccl_now_ms();
    pthread_mutex_unlock(&reg_lock);
    if (d.rows != NULL) {
        for (int r = 0; r < comm->size; r++) free(d.rows[r]);
    }
    xccl_comm_unref(comm); /* comm may be gone now */
out:
    free(d.rows);
    free(dead);
    return off;
}

size_t xccl_diag_table(xccl_comm_t *comm, int64_t wait_ms, char *buf, size_t len, char *silent,
                       size_t slen)
{
    return table(comm, wait_ms, 1, buf, len, silent, slen);
}

size_t xccl_comm_diag_table(xccl_comm_t *comm, int64_t wait_ms, char *buf, size_t len)
{
    size_t n;

    if (comm == NULL || buf == NULL || len == 0) return 0;
    pthread_mutex_lock(&comm->ctx->lock);
    n = table(comm, wait_ms, 0, buf, len, NULL, 0);
    pthread_mutex_unlock(&comm->ctx->lock);
    return n;
}
