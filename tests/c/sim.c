/* SPDX-License-Identifier: Apache-2.0
 *
 * sim.c - the in-process simulator of the xccl_task_* primitives (model in sim.h). Linked
 * instead of the core by the algorithm tests, so these definitions are the only ones.
 */
#include "sim.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/check.h"
#include "core/exec.h"
#include "core/reduce.h"

typedef struct sim sim_t;

typedef struct sim_req {
    xccl_task_t    *task; /* the task or sub-task that posted it */
    int             is_send;
    int             peer;
    void           *buf;
    size_t          nbytes;
    uint32_t        step;
    int             done;
    uint64_t        fence; /* held (posted behind unfinished executor events): 1 + the number */
                           /* of events before it; 0 once in the matching queues           */
    struct sim_req *match; /* the other side once matched */
} sim_req_t;

/* A growable array of request pointers. */
typedef struct req_vec {
    sim_req_t **v;
    size_t      n, cap;
} req_vec_t;

struct xccl_task {
    sim_t                  *sim;
    int                     rank;
    const xccl_coll_args_t *args;
    uint64_t                state[XCCL_TASK_STATE_WORDS];
    unsigned char          *scratch;
    size_t                  scratch_bytes;
    req_vec_t               reqs; /* posted and not yet forgotten by xccl_task_test */
    int                     finished;
    int                     draining; /* progress returned XCCL_OK; events still running */
    int                     refused;  /* an import said XCCL_INPROGRESS (task.h)          */
    const xccl_exec_ops_t  *exec;
    void                  **ev;       /* unfinished executor events, oldest first       */
    size_t                  nev, ev_cap;
    uint64_t                ev_done, ev_issued; /* events finished / issued so far      */
    xccl_status_t           ev_error;
    /* sub-tasks (xccl_task_sub): rank and size are the sub-task's own. Requests, executor
     * events and held posts of every sub-task are the rank's task's (reqs, ev), each request
     * naming the (sub-)task that posted it, the simulated ranks and the absolute step. */
    const xccl_algo_t      *algo;
    xccl_task_t            *parent;
    int                    *map;
    int                     size;
    uint32_t                step_base, step_span;
    int                     sub_done; /* its progress returned XCCL_OK */
    xccl_coll_args_t        own_args;
    xccl_task_t            *sub[XCCL_TASK_SUBS];
    /* sequences and node-shared memory (rank tasks only) */
    int                     coll;     /* index of its collective in the sequence         */
    uint64_t                epoch;    /* of that collective if its algorithm is shared    */
    int                     granted;  /* xccl_task_shared said XCCL_OK                    */
    int                     notyet;   /* ... said XCCL_INPROGRESS during this progress    */
    int                     waited;   /* xccl_task_shared_wait during this progress       */
    int                     wait_peer; /* its argument (deadlock reports)                 */
};

struct sim {
    int           size;
    xccl_task_t  *tasks;
    req_vec_t    *sends;   /* [src * size + dst]: unmatched sends, posting order    */
    req_vec_t    *recvs;   /* [src * size + dst]: unmatched receives, posting order */
    req_vec_t     matched; /* receives matched and not yet delivered                */
    uint64_t      rng;
    uint64_t      events;  /* posts, deliveries, reductions, completions, event tests */
    const sim_opts_t *opts;
    size_t        msgs_cap;
    int           failed;
    sim_result_t *res;
    /* sequences */
    const xccl_algo_t *const *algos;
    int                       ncoll;
    const xccl_coll_args_t   *all_args; /* [coll * size + rank] */
    /* the node-shared segment: one memfd mapped once per rank */
    int                       memfd;
    unsigned char           **maps;
    size_t                    seg_bytes, map_len;
};

static int vec_push(req_vec_t *q, sim_req_t *r)
{
    if (q->n == q->cap) {
        size_t      cap = q->cap ? 2 * q->cap : 16;
        sim_req_t **v   = realloc(q->v, cap * sizeof(*v));
        if (v == NULL) return -1;
        q->v   = v;
        q->cap = cap;
    }
    q->v[q->n++] = r;
    return 0;
}

static void vec_remove(req_vec_t *q, size_t i)
{
    memmove(&q->v[i], &q->v[i + 1], (q->n - i - 1) * sizeof(q->v[0]));
    q->n--;
}

/* Records the first failure; later ones only keep the first message. */
static xccl_status_t sim_fail(sim_t *sim, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static xccl_status_t sim_fail(sim_t *sim, const char *fmt, ...)
{
    va_list ap;

    if (!sim->failed) {
        va_start(ap, fmt);
        vsnprintf(sim->res->error, sizeof(sim->res->error), fmt, ap);
        va_end(ap);
        sim->failed = 1;
    }
    return xccl_error_set(XCCL_ERR_INTERNAL, "%s", sim->res->error);
}

static uint64_t sim_rand(sim_t *sim)
{
    /* splitmix64: deterministic for a given seed */
    uint64_t z = (sim->rng += 0x9e3779b97f4a7c15ull);
    z          = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z          = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int overlaps(const void *a, size_t na, const void *b, size_t nb)
{
    const char *pa = a, *pb = b;
    return na != 0 && nb != 0 && pa < pb + nb && pb < pa + na;
}

/* The rank's own task, which holds the requests and events of its sub-tasks. */
static xccl_task_t *root_of(xccl_task_t *t)
{
    while (t->parent != NULL) t = t->parent;
    return t;
}

/* Whether `t` is `anc` or one of its sub-tasks. */
static int within(const xccl_task_t *t, const xccl_task_t *anc)
{
    for (; t != NULL; t = t->parent)
        if (t == anc) return 1;
    return 0;
}

/* The first request of the rank not forgotten (receives only, with recvs_only) whose buffer
 * meets [buf, buf + nbytes). */
static const sim_req_t *find_overlap(xccl_task_t *t, const void *buf, size_t nbytes,
                                     int recvs_only)
{
    t = root_of(t);
    for (size_t i = 0; i < t->reqs.n; i++) {
        const sim_req_t *r = t->reqs.v[i];
        if (recvs_only && r->is_send) continue;
        if (overlaps(r->buf, r->nbytes, buf, nbytes)) return r;
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * The xccl_task_* primitives
 * ------------------------------------------------------------------------------------------- */

const xccl_coll_args_t *xccl_task_args(const xccl_task_t *t) { return t->args; }
int                     xccl_task_rank(const xccl_task_t *t) { return t->rank; }
uint64_t               *xccl_task_state(xccl_task_t *t) { return t->state; }

int xccl_task_size(const xccl_task_t *t) { return t->parent ? t->size : t->sim->size; }

uint32_t xccl_task_step_limit(const xccl_task_t *t)
{
    return t->parent ? t->step_span : XCCL_STEP_MAX + 1u;
}

static xccl_status_t enqueue(xccl_task_t *t, sim_req_t *r);

static xccl_status_t post(xccl_task_t *t, int is_send, int peer, void *buf, size_t nbytes,
                          uint32_t step)
{
    sim_t           *sim = t->sim;
    const char      *what = is_send ? "send to" : "recv from";
    const sim_req_t *o;
    sim_req_t       *r;
    xccl_task_t     *owner = t;

    /* a sub-task's message, in the terms of the simulated ranks */
    for (; t->parent != NULL; t = t->parent) {
        if (peer < 0 || peer >= t->size || peer == t->rank || step >= t->step_span)
            return sim_fail(sim, "rank %d: sub-task %s: %s member %d of %d, step %u of %u",
                            root_of(t)->rank, t->algo->name, what, peer, t->size, step,
                            t->step_span);
        peer = t->map[peer];
        step += t->step_base;
    }
    if (peer < 0 || peer >= sim->size || peer == t->rank)
        return sim_fail(sim, "rank %d: %s invalid peer %d (step %u)", t->rank, what, peer, step);
    if (step > XCCL_STEP_MAX)
        return sim_fail(sim, "rank %d: %s %d with step %u > XCCL_STEP_MAX", t->rank, what, peer,
                        step);
    if (buf == NULL && nbytes != 0)
        return sim_fail(sim, "rank %d: %s %d step %u: NULL buffer", t->rank, what, peer, step);
    o = find_overlap(t, buf, nbytes, is_send);
    if (o != NULL)
        return sim_fail(sim,
                        "rank %d: %s %d step %u (%zu B) overlaps its pending %s %d step %u",
                        t->rank, what, peer, step, nbytes, o->is_send ? "send to" : "recv from",
                        o->peer, o->step);
    r = calloc(1, sizeof(*r));
    if (r == NULL || vec_push(&t->reqs, r) != 0) {
        free(r);
        return sim_fail(sim, "sim: out of memory");
    }
    r->task    = owner;
    r->is_send = is_send;
    r->peer    = peer;
    r->buf     = buf;
    r->nbytes  = nbytes;
    r->step    = step;
    sim->events++;
    if (t->nev > 0) {
        /* an executor event issued before it is unfinished: held (task.h, "Local work") */
        r->fence = 1 + t->ev_issued;
        return XCCL_OK;
    }
    return enqueue(t, r);
}

/* Records a posted request and matches it with the other side. */
static xccl_status_t enqueue(xccl_task_t *t, sim_req_t *r)
{
    sim_t      *sim = t->sim;
    int         is_send = r->is_send, peer = r->peer;
    uint32_t    step   = r->step;
    size_t      nbytes = r->nbytes;
    const char *what   = is_send ? "send to" : "recv from";
    req_vec_t  *mine, *theirs;
    int         pair;

    r->fence = 0;
    if (is_send) {
        sim_result_t *res = sim->res;
        if (res->nmsgs == sim->msgs_cap) {
            size_t     cap = sim->msgs_cap ? 2 * sim->msgs_cap : 256;
            sim_msg_t *m   = realloc(res->msgs, cap * sizeof(*m));
            if (m == NULL) return sim_fail(sim, "sim: out of memory");
            res->msgs     = m;
            sim->msgs_cap = cap;
        }
        res->msgs[res->nmsgs++] = (sim_msg_t){t->rank, peer, step, nbytes};
    }

    /* match with the oldest unmatched request of the other side with the same step */
    pair   = is_send ? t->rank * sim->size + peer : peer * sim->size + t->rank;
    mine   = is_send ? &sim->sends[pair] : &sim->recvs[pair];
    theirs = is_send ? &sim->recvs[pair] : &sim->sends[pair];
    for (size_t i = 0; i < theirs->n; i++) {
        sim_req_t *x = theirs->v[i];
        if (x->step != step) continue;
        if (x->nbytes != nbytes)
            return sim_fail(sim, "rank %d: %s %d step %u of %zu B matched a %s of %zu B",
                            t->rank, what, peer, step, nbytes, is_send ? "recv" : "send",
                            x->nbytes);
        vec_remove(theirs, i);
        r->match = x;
        x->match = r;
        if (vec_push(&sim->matched, is_send ? x : r) != 0)
            return sim_fail(sim, "sim: out of memory");
        return XCCL_OK;
    }
    if (vec_push(mine, r) != 0) return sim_fail(sim, "sim: out of memory");
    return XCCL_OK;
}

xccl_status_t xccl_task_isend(xccl_task_t *t, int peer, const void *buf, size_t nbytes,
                              uint32_t step)
{
    return post(t, 1, peer, (void *)buf, nbytes, step);
}

xccl_status_t xccl_task_irecv(xccl_task_t *t, int peer, void *buf, size_t nbytes, uint32_t step)
{
    return post(t, 0, peer, buf, nbytes, step);
}

/* Tests the executor events oldest first, then queues the held requests whose events are all
 * finished, in posting order. */
static void poll_events(xccl_task_t *t)
{
    size_t k = 0;

    if (t->nev > 0) t->sim->events++; /* a running executor is progress, not a deadlock */
    while (k < t->nev) {
        xccl_status_t st = t->exec->test(t->ev[k]);
        if (st == XCCL_INPROGRESS) break;
        if (st < 0 && t->ev_error == XCCL_OK) t->ev_error = st;
        k++;
        t->ev_done++;
    }
    if (k > 0) {
        memmove(t->ev, t->ev + k, (t->nev - k) * sizeof(*t->ev));
        t->nev -= k;
    }
    for (size_t i = 0; i < t->reqs.n; i++) {
        sim_req_t *r = t->reqs.v[i];
        if (r->fence == 0) continue;
        if (r->fence - 1 > t->ev_done) break;
        if (enqueue(t, r) != XCCL_OK) return;
    }
}

/* Takes an executor call's outcome: queued events are tracked, errors are sticky. */
static xccl_status_t exec_result(xccl_task_t *t, xccl_status_t st, void *ev)
{
    if (st == XCCL_INPROGRESS) {
        if (t->nev == t->ev_cap) {
            size_t cap = t->ev_cap ? 2 * t->ev_cap : 16;
            void **v   = realloc(t->ev, cap * sizeof(*v));
            if (v == NULL) return sim_fail(t->sim, "sim: out of memory");
            t->ev     = v;
            t->ev_cap = cap;
        }
        t->ev[t->nev++] = ev;
        t->ev_issued++;
        return XCCL_OK;
    }
    if (st < 0 && t->ev_error == XCCL_OK) t->ev_error = st;
    return st;
}

/* A sub-task's requests and those of its sub-tasks are its own; its local work is in the
 * rank's stream, so a test waits for every event of the rank. */
xccl_status_t xccl_task_test(xccl_task_t *t)
{
    xccl_task_t *root = root_of(t);
    size_t       k    = 0;

    if (t->sim->failed) return XCCL_ERR_INTERNAL;
    poll_events(root);
    if (t->sim->failed) return XCCL_ERR_INTERNAL;
    if (root->ev_error < 0) return root->ev_error;
    if (root->nev > 0) return XCCL_INPROGRESS;
    for (size_t i = 0; i < root->reqs.n; i++)
        if (within(root->reqs.v[i]->task, t) && !root->reqs.v[i]->done) return XCCL_INPROGRESS;
    for (size_t i = 0; i < root->reqs.n; i++) {
        if (within(root->reqs.v[i]->task, t)) free(root->reqs.v[i]);
        else root->reqs.v[k++] = root->reqs.v[i];
    }
    root->reqs.n = k;
    return XCCL_OK;
}

int xccl_task_pending(const xccl_task_t *t)
{
    const xccl_task_t *root = t;
    int                n    = 0;

    while (root->parent != NULL) root = root->parent;
    for (size_t i = 0; i < root->reqs.n; i++)
        n += within(root->reqs.v[i]->task, t) && !root->reqs.v[i]->done;
    return n;
}

/* Frees a sub-task's own memory and its sub-tasks (not requests: the rank's task has them). */
static void sub_free(xccl_task_t *s)
{
    for (int i = 0; i < XCCL_TASK_SUBS; i++) {
        if (s->sub[i] == NULL) continue;
        sub_free(s->sub[i]);
        s->sub[i] = NULL;
    }
    if (s->parent != NULL) {
        if (s->scratch != NULL) s->exec->free(s->scratch);
        free(s->map);
        free(s);
    }
}

xccl_status_t xccl_task_sub(xccl_task_t *t, int slot, const xccl_algo_t *algo,
                            const xccl_coll_args_t *args, const int *map, int nsub,
                            uint32_t step_base, uint32_t step_span)
{
    sim_t        *sim  = t->sim;
    xccl_task_t  *root = root_of(t), *s;
    int           size = xccl_task_size(t), rank = -1;
    xccl_status_t st;

    if (slot < 0 || slot >= XCCL_TASK_SUBS)
        return sim_fail(sim, "rank %d: sub-task slot %d", root->rank, slot);
    if (t->sub[slot] == NULL) {
        uint32_t limit = xccl_task_step_limit(t);
        if (algo == NULL || args == NULL || map == NULL || nsub < 1 || step_span == 0 ||
            step_base > limit || step_span > limit - step_base)
            return sim_fail(sim, "rank %d: invalid sub-task (%d members, steps %u + %u of %u)",
                            root->rank, nsub, step_base, step_span, limit);
        for (int i = 0; i < nsub; i++) {
            for (int j = 0; j < i; j++)
                if (map[j] == map[i])
                    return sim_fail(sim, "rank %d: sub-task %s: rank %d is members %d and %d",
                                    root->rank, algo->name, map[i], j, i);
            if (map[i] < 0 || map[i] >= size)
                return sim_fail(sim, "rank %d: sub-task %s: member %d is rank %d of %d",
                                root->rank, algo->name, i, map[i], size);
            if (map[i] == t->rank) rank = i;
        }
        if (rank < 0)
            return sim_fail(sim, "rank %d: sub-task %s without it", root->rank, algo->name);
        s = calloc(1, sizeof(*s));
        if (s == NULL || (s->map = malloc((size_t)nsub * sizeof(int))) == NULL) {
            free(s);
            return sim_fail(sim, "sim: out of memory");
        }
        memcpy(s->map, map, (size_t)nsub * sizeof(int));
        s->sim           = sim;
        s->rank          = rank;
        s->size          = nsub;
        s->algo          = algo;
        s->parent        = t;
        s->own_args      = *args;
        s->own_args.mem  = t->args->mem; /* its buffers are its parent's kind of memory */
        s->args          = &s->own_args;
        s->exec          = t->exec;
        s->step_base     = step_base;
        s->step_span     = step_span;
        t->sub[slot]     = s;
        sim->events++;
    }
    s  = t->sub[slot];
    st = s->sub_done ? XCCL_OK : s->algo->progress(s);
    if (st != XCCL_OK) return st;
    s->sub_done = 1;
    if (xccl_task_pending(s) > 0)
        return sim_fail(sim, "rank %d: sub-task %s returned XCCL_OK with requests not tested",
                        root->rank, s->algo->name);
    for (int i = 0; i < XCCL_TASK_SUBS; i++)
        if (s->sub[i] != NULL)
            return sim_fail(sim, "rank %d: sub-task %s returned XCCL_OK with sub-task %s running",
                            root->rank, s->algo->name, s->sub[i]->algo->name);
    /* its scratch goes once the rank's queued work no longer uses it */
    poll_events(root);
    if (root->ev_error < 0) return root->ev_error;
    if (root->nev > 0) return XCCL_INPROGRESS;
    sub_free(s);
    t->sub[slot] = NULL;
    sim->events++;
    return XCCL_OK;
}

xccl_status_t xccl_task_reduce(xccl_task_t *t, void *dst, const void *a, const void *b,
                               size_t count)
{
    sim_t                  *sim    = t->sim;
    const xccl_coll_args_t *args   = t->args;
    size_t                  nbytes = count * args->elsize;
    const sim_req_t        *o;

    if ((o = find_overlap(t, dst, nbytes, 0)) != NULL ||
        (o = find_overlap(t, a, nbytes, 1)) != NULL || (o = find_overlap(t, b, nbytes, 1)) != NULL)
        return sim_fail(sim, "rank %d: reduce of %zu B touches its pending %s %d step %u",
                        t->rank, nbytes, o->is_send ? "send to" : "recv from", o->peer, o->step);
    sim->events++;
    sim->res->reduce_bytes[root_of(t)->rank] += nbytes;
    sim->res->reduce_calls[root_of(t)->rank]++;
    if (t->exec == &xccl_exec_cpu) return xccl_reduce2(dst, a, b, count, args->dtype, args->op);
    {
        void         *ev = NULL;
        xccl_status_t st = t->exec->reduce(NULL, dst, a, b, count, args->dtype, args->op, &ev);
        return exec_result(root_of(t), st, ev);
    }
}

int xccl_task_mem_shareable(xccl_mem_type_t mem)
{
    const xccl_exec_ops_t *ex = xccl_exec_for(mem);
    return ex != NULL && ex->export_mem != NULL && ex->import_mem != NULL && ex->reduce_n != NULL;
}

xccl_status_t xccl_task_mem_export(xccl_task_t *t, const void *ptr, size_t nbytes, void *blob,
                                   size_t *len)
{
    if (t->exec->export_mem == NULL) return XCCL_ERR_NOT_SUPPORTED;
    return t->exec->export_mem(ptr, nbytes, blob, len);
}

/* Checks the rule of task.h ("Device memory of peers"): no import is tried again after one was
 * refused for now (the refusal might never lift). */
xccl_status_t xccl_task_mem_import(xccl_task_t *t, const void *blob, size_t len, void **ptr)
{
    xccl_status_t st;

    if (t->exec->import_mem == NULL)
        return sim_fail(t->sim, "rank %d: import on an executor without peer access", t->rank);
    for (xccl_task_t *u = t; u != NULL; u = u->parent)
        if (u->refused)
            return sim_fail(t->sim, "rank %d: %s imports again after a refused import",
                            t->rank, t->algo->name);
    st = t->exec->import_mem(blob, len, ptr);
    if (st == XCCL_INPROGRESS) t->refused = 1;
    return st;
}

xccl_status_t xccl_task_reduce_n(xccl_task_t *t, void *dst, const void *const *srcs, int k,
                                 size_t count)
{
    const xccl_coll_args_t *args = t->args;
    void                   *ev   = NULL;
    xccl_status_t           st;

    if (t->exec->reduce_n == NULL || k < 2 || k > XCCL_TASK_REDUCE_MAX)
        return sim_fail(t->sim, "rank %d: reduce_n of %d sources", t->rank, k);
    if (count == 0) return XCCL_OK;
    t->sim->events++;
    t->sim->res->reduce_bytes[root_of(t)->rank] += count * args->elsize;
    t->sim->res->reduce_calls[root_of(t)->rank]++;
    st = t->exec->reduce_n(NULL, dst, srcs, k, count, args->dtype, args->op, &ev);
    return exec_result(root_of(t), st, ev);
}

xccl_status_t xccl_task_copy(xccl_task_t *t, void *dst, const void *src, size_t nbytes)
{
    const sim_req_t *o;
    void            *ev = NULL;
    xccl_status_t    st;

    if (nbytes == 0 || dst == src) return XCCL_OK;
    if ((dst == NULL || src == NULL))
        return sim_fail(t->sim, "rank %d: copy of %zu B with a NULL buffer", t->rank, nbytes);
    if ((o = find_overlap(t, dst, nbytes, 0)) != NULL ||
        (o = find_overlap(t, src, nbytes, 1)) != NULL)
        return sim_fail(t->sim, "rank %d: copy of %zu B touches its pending %s %d step %u",
                        t->rank, nbytes, o->is_send ? "send to" : "recv from", o->peer, o->step);
    t->sim->events++;
    t->sim->res->copy_bytes[root_of(t)->rank] += nbytes;
    if (t->exec == &xccl_exec_cpu) {
        memmove(dst, src, nbytes);
        return XCCL_OK;
    }
    st = t->exec->copy(NULL, dst, src, nbytes, &ev);
    return exec_result(root_of(t), st, ev);
}

void *xccl_task_scratch(xccl_task_t *t, size_t nbytes)
{
    unsigned char *p;

    if (nbytes <= t->scratch_bytes && t->scratch != NULL) return t->scratch;
    if (t->scratch != NULL && find_overlap(t, t->scratch, t->scratch_bytes, 0) != NULL) {
        sim_fail(t->sim, "rank %d: scratch grown to %zu B while a request uses it", t->rank,
                 nbytes);
        return NULL;
    }
    /* events still using the old buffer finish first */
    while (t->scratch != NULL && root_of(t)->nev > 0 && !t->sim->failed)
        poll_events(root_of(t));
    /* always move, so that stale pointers into the old buffer fail under ASan; the contents
     * are not kept (task.h) */
    p = t->exec->alloc(nbytes ? nbytes : 1);
    if (p == NULL) return NULL;
    if (t->exec == &xccl_exec_cpu) memset(p, 0xa5, nbytes);
    if (t->scratch != NULL) t->exec->free(t->scratch);
    t->scratch       = p;
    t->scratch_bytes = nbytes;
    return p;
}

/* ---------------------------------------------------------------------------------------------
 * Node-shared memory (task.h, "Node-shared memory")
 * ------------------------------------------------------------------------------------------- */

/* Maps the segment once per rank, each mapping followed by a PROT_NONE page, all of them
 * inaccessible until a granted rank's progress runs (seg_access). */
static int seg_create(sim_t *sim)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t bytes =
        sim->opts && sim->opts->shared_bytes ? sim->opts->shared_bytes
                                             : xccl_algo_policy.shared_bytes(sim->size);

    if (bytes == 0) {
        sim_fail(sim, "xccl_task_shared: the policy's shared_bytes(%d) is 0", sim->size);
        return -1;
    }
    sim->seg_bytes = bytes;
    sim->map_len   = (bytes + page - 1) / page * page;
    sim->memfd     = memfd_create("xccl-sim-seg", 0);
    sim->maps      = calloc((size_t)sim->size, sizeof(*sim->maps));
    if (sim->memfd < 0 || sim->maps == NULL || ftruncate(sim->memfd, (off_t)sim->map_len) != 0) {
        sim_fail(sim, "sim: cannot create the shared segment (%zu B)", bytes);
        return -1;
    }
    for (int r = 0; r < sim->size; r++) {
        void *v = mmap(NULL, sim->map_len + page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (v == MAP_FAILED ||
            mmap(v, sim->map_len, PROT_NONE, MAP_SHARED | MAP_FIXED, sim->memfd, 0) == MAP_FAILED) {
            if (v != MAP_FAILED) munmap(v, sim->map_len + page);
            sim_fail(sim, "sim: cannot map the shared segment");
            return -1;
        }
        sim->maps[r] = v;
    }
    return 0;
}

static void seg_destroy(sim_t *sim)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);

    for (int r = 0; sim->maps != NULL && r < sim->size; r++)
        if (sim->maps[r] != NULL) munmap(sim->maps[r], sim->map_len + page);
    free(sim->maps);
    if (sim->memfd > 0) close(sim->memfd);
    sim->maps  = NULL;
    sim->memfd = -1;
}

/* Rank r's mapping becomes accessible (open) while its granted progress runs. */
static void seg_access(sim_t *sim, int r, int open)
{
    if (sim->maps == NULL) return;
    if (mprotect(sim->maps[r], sim->map_len, open ? PROT_READ | PROT_WRITE : PROT_NONE) != 0)
        sim_fail(sim, "sim: mprotect of the segment failed");
}

xccl_status_t xccl_task_shared(xccl_task_t *t, xccl_shared_t *out)
{
    sim_t                  *sim = t->sim;
    const xccl_coll_args_t *a   = t->args;

    if (t->parent != NULL)
        return xccl_error_set(XCCL_ERR_NOT_SUPPORTED, "xccl_task_shared: not in a sub-task");
    if (!t->algo->shared)
        return sim_fail(sim, "rank %d: %s calls xccl_task_shared without .shared = 1", t->rank,
                        t->algo->name);
    if (a->topo == NULL || !(a->topo->shared & XCCL_SHARED_SEG))
        return sim_fail(sim, "rank %d: %s calls xccl_task_shared without XCCL_SHARED_SEG",
                        t->rank, t->algo->name);
    if (!t->granted) {
        if (sim->maps == NULL && seg_create(sim) != 0) return XCCL_ERR_INTERNAL;
        /* "not yet" now and then (the segment being attached) */
        if (sim->opts && sim->opts->seed != 0 && sim_rand(sim) % 3 == 0) {
            t->notyet = 1;
            sim->events++;
            return XCCL_INPROGRESS;
        }
        t->granted = 1;
        seg_access(sim, t->rank, 1);
        sim->events++;
    }
    out->base  = sim->maps[t->rank];
    out->bytes = sim->seg_bytes;
    out->epoch = t->epoch;
    return XCCL_OK;
}

void xccl_task_shared_wait(xccl_task_t *t, int peer)
{
    xccl_task_t *root = root_of(t);

    if (peer < -1 || peer >= xccl_task_size(t)) {
        sim_fail(t->sim, "rank %d: xccl_task_shared_wait(%d) of %d ranks", root->rank, peer,
                 xccl_task_size(t));
        return;
    }
    root->waited    = 1;
    root->wait_peer = peer;
}

void xccl_task_shared_signal(xccl_task_t *t)
{
    t->sim->events++;
    t->sim->res->signals[root_of(t)->rank]++;
}

/* Bytes of the buffers rank q exposes in its current collective: sbuf and rbuf extents. */
static void buf_extents(const xccl_coll_args_t *a, int n, size_t *sn, size_t *rn)
{
    size_t blk = a->count * a->elsize, all = blk * (size_t)n;

    *sn = *rn = 0;
    switch (a->coll) {
    case XCCL_COLL_ALLREDUCE:
    case XCCL_COLL_BROADCAST: *sn = *rn = blk; break;
    case XCCL_COLL_REDUCE: *sn = *rn = blk; break;
    case XCCL_COLL_ALLGATHER:
    case XCCL_COLL_GATHER: *sn = blk, *rn = all; break;
    case XCCL_COLL_SCATTER:
    case XCCL_COLL_REDUCE_SCATTER: *sn = all, *rn = blk; break;
    case XCCL_COLL_ALLTOALL: *sn = *rn = all; break;
    case XCCL_COLL_ALLTOALLV:
        for (int i = 0; i < n; i++) {
            size_t s = (a->sdispls[i] + a->scounts[i]) * a->elsize;
            size_t r = (a->rdispls[i] + a->rcounts[i]) * a->elsize;
            if (s > *sn) *sn = s;
            if (r > *rn) *rn = r;
        }
        break;
    default: break;
    }
}

static int inside(const void *p, size_t n, const void *buf, size_t len)
{
    const char *c = p, *b = buf;
    return buf != NULL && c >= b && n <= len && (size_t)(c - b) <= len - n;
}

xccl_status_t xccl_task_peer_read(xccl_task_t *t, int peer, void *dst, const void *src,
                                  size_t nbytes)
{
    sim_t           *sim = t->sim;
    xccl_task_t     *q;
    const sim_req_t *o;
    size_t           sn, rn;

    if (t->parent != NULL)
        return sim_fail(sim, "rank %d: xccl_task_peer_read from a sub-task", root_of(t)->rank);
    if (t->args->topo == NULL || !(t->args->topo->shared & XCCL_SHARED_CMA))
        return sim_fail(sim, "rank %d: %s reads rank %d's memory without XCCL_SHARED_CMA",
                        t->rank, t->algo->name, peer);
    if (peer < 0 || peer >= sim->size)
        return sim_fail(sim, "rank %d: xccl_task_peer_read from rank %d of %d", t->rank, peer,
                        sim->size);
    if (nbytes == 0) return XCCL_OK;
    if ((o = find_overlap(t, dst, nbytes, 0)) != NULL)
        return sim_fail(sim, "rank %d: peer read of %zu B touches its pending %s %d step %u",
                        t->rank, nbytes, o->is_send ? "send to" : "recv from", o->peer, o->step);
    q = &sim->tasks[peer];
    if (q->epoch != t->epoch || q->finished || q->draining)
        return sim_fail(sim,
                        "rank %d (epoch %llu): %s reads %zu B of rank %d, which is %s epoch %llu",
                        t->rank, (unsigned long long)t->epoch, t->algo->name, nbytes, peer,
                        q->finished || q->draining ? "done with" : "in",
                        (unsigned long long)q->epoch);
    buf_extents(q->args, sim->size, &sn, &rn);
    if (!inside(src, nbytes, q->args->sbuf, sn) && !inside(src, nbytes, q->args->rbuf, rn) &&
        !inside(src, nbytes, q->scratch, q->scratch_bytes))
        return sim_fail(sim, "rank %d: %s reads %zu B at %p of rank %d: not in its buffers",
                        t->rank, t->algo->name, nbytes, src, peer);
    memcpy(dst, src, nbytes);
    sim->events++;
    sim->res->read_bytes[t->rank] += nbytes;
    sim->res->read_calls[t->rank]++;
    return XCCL_OK;
}

/* ---------------------------------------------------------------------------------------------
 * The scheduler
 * ------------------------------------------------------------------------------------------- */

/* Delivers matched pairs: all of them with seed 0, else each with probability 1/2 and at
 * least one. */
static void deliver(sim_t *sim, int random)
{
    size_t i = 0, delivered = 0;

    if (sim->matched.n == 0) return;
    if (sim->opts && sim->opts->transfer_access) sim->opts->transfer_access(1);
    while (i < sim->matched.n) {
        sim_req_t *rv = sim->matched.v[i], *sd = rv->match;
        int        go = !random || (sim_rand(sim) & 1) ||
                 (delivered == 0 && i + 1 == sim->matched.n);
        if (!go) {
            i++;
            continue;
        }
        if (rv->nbytes != 0) memcpy(rv->buf, sd->buf, rv->nbytes);
        rv->done = sd->done = 1;
        vec_remove(&sim->matched, i);
        delivered++;
        sim->events++;
    }
    if (sim->opts && sim->opts->transfer_access) sim->opts->transfer_access(0);
}

static void describe_deadlock(sim_t *sim, long pass)
{
    char  *e   = sim->res->error;
    size_t cap = sizeof(sim->res->error), len;

    len = (size_t)snprintf(e, cap, "deadlock after %ld passes:", pass);
    for (int r = 0; r < sim->size && len < cap; r++) {
        const xccl_task_t *t = &sim->tasks[r];
        if (t->finished) continue;
        len += (size_t)snprintf(e + len, cap - len, " [rank %d:", r);
        for (size_t i = 0; i < t->reqs.n && len < cap; i++) {
            const sim_req_t *q = t->reqs.v[i];
            if (q->done) continue;
            len += (size_t)snprintf(e + len, cap - len, " %s %d step %u %zuB%s",
                                    q->is_send ? "send->" : "recv<-", q->peer, q->step,
                                    q->nbytes, q->match ? " (matched)" : "");
        }
        if (len < cap) len += (size_t)snprintf(e + len, cap - len, "]");
    }
    sim->failed = 1;
}

/* Sets rank task t up for collective c of the sequence (state zeroed, scratch dropped). */
static xccl_status_t task_start(sim_t *sim, xccl_task_t *t, int c)
{
    const xccl_algo_t *algo = sim->algos[c];
    uint64_t           e    = 0;

    for (int i = 0; i <= c; i++) e += sim->algos[i]->shared != 0;
    if (t->scratch != NULL) t->exec->free(t->scratch);
    t->scratch       = NULL;
    t->scratch_bytes = 0;
    memset(t->state, 0, sizeof(t->state));
    t->coll     = c;
    t->algo     = algo;
    t->args     = &sim->all_args[(size_t)c * (size_t)sim->size + (size_t)t->rank];
    t->epoch    = algo->shared ? e : 0;
    t->granted  = 0;
    t->finished = 0;
    t->draining = 0;
    t->exec     = xccl_exec_for(t->args->mem);
    if (t->exec == NULL) {
        snprintf(sim->res->error, sizeof(sim->res->error),
                 "rank %d: no executor for memory type %d", t->rank, (int)t->args->mem);
        return XCCL_ERR_NOT_SUPPORTED;
    }
    return XCCL_OK;
}

/* The rank finished its collective: the next one starts, or the rank is done (returns 1). */
static int task_finish(sim_t *sim, xccl_task_t *t, xccl_status_t *st)
{
    if (t->granted) seg_access(sim, t->rank, 0);
    t->granted  = 0;
    t->finished = 1;
    sim->events++;
    if (t->coll + 1 == sim->ncoll) return 1;
    *st = task_start(sim, t, t->coll + 1);
    return 0;
}

xccl_status_t sim_run(const xccl_algo_t *algo, int size, const xccl_coll_args_t *args,
                      const sim_opts_t *opts, sim_result_t *res)
{
    const xccl_algo_t *const algos[1] = {algo};
    return sim_run_seq(algos, 1, size, args, opts, res);
}

static void describe_waits(sim_t *sim)
{
    char  *e   = sim->res->error;
    size_t cap = sizeof(sim->res->error), len = strlen(e);

    for (int r = 0; r < sim->size && len < cap; r++) {
        const xccl_task_t *t = &sim->tasks[r];
        if (t->finished || !t->waited) continue;
        len += (size_t)snprintf(e + len, cap - len, " [rank %d (%s, epoch %llu) waits on %s %d]",
                                r, t->algo->name, (unsigned long long)t->epoch,
                                t->wait_peer < 0 ? "several ranks" : "rank", t->wait_peer);
    }
}

xccl_status_t sim_run_seq(const xccl_algo_t *const *algos, int ncoll, int size,
                          const xccl_coll_args_t *args, const sim_opts_t *opts,
                          sim_result_t *res)
{
    sim_t         sim;
    xccl_status_t st       = XCCL_OK;
    long          max_pass = opts && opts->max_passes > 0 ? opts->max_passes : 10000000;
    int           random   = opts && opts->seed != 0;
    int           left     = size;
    long          pass;

    memset(res, 0, sizeof(*res));
    memset(&sim, 0, sizeof(sim));
    sim.size     = size;
    sim.res      = res;
    sim.rng      = opts ? opts->seed : 0;
    sim.opts     = opts;
    sim.algos    = algos;
    sim.ncoll    = ncoll;
    sim.all_args = args;
    sim.memfd    = -1;
    sim.tasks = calloc((size_t)size, sizeof(*sim.tasks));
    sim.sends = calloc((size_t)size * (size_t)size, sizeof(*sim.sends));
    sim.recvs = calloc((size_t)size * (size_t)size, sizeof(*sim.recvs));
    res->reduce_bytes = calloc((size_t)size, sizeof(size_t));
    res->reduce_calls = calloc((size_t)size, sizeof(size_t));
    res->copy_bytes   = calloc((size_t)size, sizeof(size_t));
    res->read_bytes   = calloc((size_t)size, sizeof(size_t));
    res->read_calls   = calloc((size_t)size, sizeof(size_t));
    res->signals      = calloc((size_t)size, sizeof(size_t));
    if (!sim.tasks || !sim.sends || !sim.recvs || !res->reduce_bytes || !res->reduce_calls ||
        !res->copy_bytes || !res->read_bytes || !res->read_calls || !res->signals ||
        ncoll < 1) {
        snprintf(res->error, sizeof(res->error), "sim: out of memory (or no collective)");
        st = XCCL_ERR_NO_MEMORY;
        goto out;
    }
    for (int r = 0; r < size; r++) {
        sim.tasks[r].sim  = &sim;
        sim.tasks[r].rank = r;
        sim.tasks[r].exec = &xccl_exec_cpu;
        if ((st = task_start(&sim, &sim.tasks[r], 0)) != XCCL_OK) goto out;
    }

    for (pass = 0; left > 0; pass++) {
        uint64_t before  = sim.events;
        int      skipped = 0;

        if (pass == max_pass) {
            snprintf(res->error, sizeof(res->error), "no completion after %ld passes", pass);
            st = XCCL_ERR_INTERNAL;
            goto out;
        }
        for (int r = 0; r < size; r++) {
            xccl_task_t       *t = &sim.tasks[r];
            const xccl_algo_t *algo;
            if (t->finished) continue;
            if (random && opts->slow && sim_rand(&sim) % 3 != 0) {
                skipped = 1;
                continue;
            }
            if (t->draining) {
                poll_events(t);
                if (t->ev_error < 0) {
                    st = t->ev_error;
                    snprintf(res->error, sizeof(res->error), "rank %d: executor: %s", r,
                             xccl_status_string(st));
                    goto out;
                }
                if (t->nev == 0) {
                    st = XCCL_OK;
                    if (task_finish(&sim, t, &st)) left--;
                    if (st != XCCL_OK) goto out;
                }
                continue;
            }
            algo      = t->algo;
            t->waited = t->notyet = 0;
            if (t->granted) seg_access(&sim, r, 1);
            st = algo->progress(t);
            if (t->granted) seg_access(&sim, r, 0);
            if (sim.failed) {
                st = XCCL_ERR_INTERNAL;
                goto out;
            }
            if (st < 0) {
                snprintf(res->error, sizeof(res->error), "rank %d: %s progress: %s: %s", r,
                         algo->name, xccl_status_string(st), xccl_last_error());
                goto out;
            }
            if (st == XCCL_OK) {
                for (int i = 0; i < XCCL_TASK_SUBS; i++) {
                    if (t->sub[i] == NULL) continue;
                    st = sim_fail(&sim, "rank %d: %s returned XCCL_OK with sub-task %s running",
                                  r, algo->name, t->sub[i]->algo->name);
                    goto out;
                }
                if (t->reqs.n != 0) {
                    st = sim_fail(&sim, "rank %d: %s returned XCCL_OK with %zu requests "
                                        "not tested",
                                  r, algo->name, t->reqs.n);
                    goto out;
                }
                sim.events++;
                if (t->nev > 0) {
                    t->draining = 1; /* complete once its copies and reductions are */
                    continue;
                }
                st = XCCL_OK;
                if (task_finish(&sim, t, &st)) left--;
                if (st != XCCL_OK) goto out;
            } else if (st != XCCL_INPROGRESS) {
                st = sim_fail(&sim, "rank %d: progress returned %d", r, (int)st);
                goto out;
            } else if (algo->shared && !t->waited && !t->notyet && t->reqs.n == 0 &&
                       t->nev == 0) {
                int subs = 0;
                for (int i = 0; i < XCCL_TASK_SUBS; i++) subs += t->sub[i] != NULL;
                if (subs == 0) {
                    st = sim_fail(&sim,
                                  "rank %d: %s returned XCCL_INPROGRESS with nothing pending "
                                  "and no xccl_task_shared_wait",
                                  r, algo->name);
                    goto out;
                }
            }
        }
        deliver(&sim, random);
        if (sim.events == before && left > 0 && !skipped) {
            describe_deadlock(&sim, pass);
            describe_waits(&sim);
            st = XCCL_ERR_INTERNAL;
            goto out;
        }
    }
    res->passes = pass;
    st          = XCCL_OK;

out:
    if (sim.tasks != NULL) {
        for (int r = 0; r < size; r++) {
            xccl_task_t *t = &sim.tasks[r];
            /* executor events of a failed run finish before their buffers go */
            for (size_t i = 0; t->exec != NULL && t->exec->test != NULL && i < t->nev; i++)
                while (t->exec->test(t->ev[i]) == XCCL_INPROGRESS) {}
            free(t->ev);
            sub_free(t);
            for (size_t i = 0; i < t->reqs.n; i++) free(t->reqs.v[i]);
            free(t->reqs.v);
            if (t->scratch != NULL) t->exec->free(t->scratch);
        }
    }
    seg_destroy(&sim);
    for (int i = 0; sim.sends && sim.recvs && i < size * size; i++) {
        free(sim.sends[i].v);
        free(sim.recvs[i].v);
    }
    free(sim.matched.v);
    free(sim.sends);
    free(sim.recvs);
    free(sim.tasks);
    return st;
}

void sim_result_free(sim_result_t *res)
{
    free(res->msgs);
    free(res->reduce_bytes);
    free(res->reduce_calls);
    free(res->copy_bytes);
    free(res->read_bytes);
    free(res->read_calls);
    free(res->signals);
    res->copy_bytes   = NULL;
    res->read_bytes   = NULL;
    res->read_calls   = NULL;
    res->signals      = NULL;
    res->msgs         = NULL;
    res->reduce_bytes = NULL;
    res->reduce_calls = NULL;
    res->nmsgs        = 0;
}

size_t sim_sent_msgs(const sim_result_t *res, int rank)
{
    size_t n = 0;
    for (size_t i = 0; i < res->nmsgs; i++) n += rank < 0 || res->msgs[i].src == rank;
    return n;
}

size_t sim_sent_bytes(const sim_result_t *res, int rank)
{
    size_t n = 0;
    for (size_t i = 0; i < res->nmsgs; i++)
        if (rank < 0 || res->msgs[i].src == rank) n += res->msgs[i].nbytes;
    return n;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

size_t sim_distinct_steps(const sim_result_t *res, int rank)
{
    uint32_t *s = malloc((res->nmsgs + 1) * sizeof(*s));
    size_t    n = 0, d = 0;

    if (s == NULL) return 0;
    for (size_t i = 0; i < res->nmsgs; i++)
        if (rank < 0 || res->msgs[i].src == rank) s[n++] = res->msgs[i].step;
    qsort(s, n, sizeof(*s), cmp_u32);
    for (size_t i = 0; i < n; i++) d += i == 0 || s[i] != s[i - 1];
    free(s);
    return d;
}
