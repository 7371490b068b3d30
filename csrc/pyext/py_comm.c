/* SPDX-License-Identifier: Apache-2.0
 *
 * py_comm.c - xccl._C.Comm: a communicator and its operations.
 *
 * Every operation takes its buffers through the DLPack consumer, checks that their sizes and
 * dtypes agree for this operation (the C library checks again; we give messages in the
 * caller's terms), posts (the GIL released for large buffers, see nogil_begin) and returns a
 * Work that owns the buffers. Communicator creation and destruction run with the GIL released:
 * creation talks to the store (whose callbacks may need the GIL) and destruction fails pending
 * operations, whose completion callbacks take the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "pyxccl.h"

#include <string.h>

#define MAX_TAG ((long long)INT32_MAX)

/* PyLong_AsInt arrived in 3.13. */
static int as_int(PyObject *obj, int *out)
{
    long v = PyLong_AsLong(obj);

    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "%ld does not fit in a C int", v);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Disposal. A communicator is never destroyed on a thread that is running a completion
 * callback (the progress thread, or a waiter inside xccl_work_wait): the engine is in the
 * middle of completing an operation there. Its last reference can still drop there (a callback
 * closure holding the Comm), so such communicators are parked and destroyed by the next
 * create/destroy/dealloc on an ordinary thread. The list is protected by the GIL.
 * ------------------------------------------------------------------------------------------- */
static xccl_comm_t **parked;
static size_t        nparked, parked_cap;

static void destroy_now(xccl_comm_t *comm)
{
    Py_BEGIN_ALLOW_THREADS
    xccl_comm_destroy(comm);
    Py_END_ALLOW_THREADS
}

static void drain_parked(void)
{
    while (!xccl_py_in_callback && nparked > 0) destroy_now(parked[--nparked]);
}

static void dispose(xccl_comm_t *comm)
{
    if (xccl_py_in_callback) {
        if (nparked == parked_cap) {
            size_t        cap = parked_cap ? 2 * parked_cap : 8;
            xccl_comm_t **p   = PyMem_RawRealloc(parked, cap * sizeof(*p));
            if (p == NULL) return; /* leaks the communicator rather than risk a deadlock */
            parked     = p;
            parked_cap = cap;
        }
        parked[nparked++] = comm;
        return;
    }
    destroy_now(comm);
    drain_parked();
}

/* ---------------------------------------------------------------------------------------------
 * Construction, properties, lifetime
 * ------------------------------------------------------------------------------------------- */

static xccl_py_comm_t *wrap(PyTypeObject *tp, xccl_comm_t *comm)
{
    xccl_py_comm_t *self = (xccl_py_comm_t *)tp->tp_alloc(tp, 0);

    if (self == NULL) {
        dispose(comm);
        return NULL;
    }
    self->comm = comm;
    self->rank = xccl_comm_rank(comm);
    self->size = xccl_comm_size(comm);
    self->id   = xccl_comm_id(comm);
    return self;
}

static PyObject *comm_new(PyTypeObject *tp, PyObject *args, PyObject *kwds)
{
    static char        *kwlist[] = {"store",    "rank", "size", "timeout", "transports",
                                    "auth_key", "name", NULL};
    xccl_py_state_t    *state    = PyType_GetModuleState(tp);
    xccl_py_store_t    *store;
    PyObject           *timeout_obj;
    const char         *transports = NULL;
    const char         *name       = NULL;
    Py_buffer           key        = {0};
    xccl_comm_config_t  cfg;
    xccl_comm_t        *comm = NULL;
    xccl_status_t       st;

    memset(&cfg, 0, sizeof(cfg));
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!iiO|zz*z:Comm", kwlist, state->store_type,
                                     &store, &cfg.rank, &cfg.size, &timeout_obj, &transports,
                                     &key, &name)) {
        return NULL;
    }
    if (cfg.size < 1 || cfg.rank < 0 || cfg.rank >= cfg.size) {
        PyBuffer_Release(&key);
        return xccl_py_raise_fmt(state, XCCL_ERR_INVALID_ARG,
                                 "Comm: rank %d is not in [0, %d) (size must be >= 1)", cfg.rank,
                                 cfg.size);
    }
    if (xccl_py_seconds_to_ms(timeout_obj, 0, "timeout", &cfg.timeout_ms) < 0) {
        PyBuffer_Release(&key);
        return NULL;
    }
    cfg.store        = store->store;
    cfg.transports   = transports;
    cfg.auth_key     = key.buf;
    cfg.auth_key_len = key.buf != NULL ? (size_t)key.len : 0;
    cfg.name         = name;

    drain_parked();
    xccl_py_stash_clear();
    /* Blocks until every rank showed up (or the timeout); a custom store's callbacks take the
     * GIL from this thread while it is released. */
    Py_BEGIN_ALLOW_THREADS
    st = xccl_comm_create(&cfg, &comm);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&key);
    if (st < 0) return xccl_py_raise_last(state, st);
    return (PyObject *)wrap(tp, comm);
}

static void comm_dealloc(xccl_py_comm_t *self)
{
    PyTypeObject *tp = Py_TYPE(self);

    if (self->comm != NULL) dispose(self->comm);
    if (self->doomed != NULL) dispose(self->doomed);
    self->comm = self->doomed = NULL;
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* The live communicator, or NULL with XcclError raised. */
static xccl_comm_t *alive(xccl_py_comm_t *self, const char *opname)
{
    if (self->comm != NULL) return self->comm;
    xccl_py_raise_fmt(xccl_py_state_of((PyObject *)self), XCCL_ERR_INVALID_USAGE,
                      "%s: the communicator was destroyed", opname);
    return NULL;
}

static int check_rank(xccl_py_comm_t *self, const char *opname, const char *what, int r)
{
    if (r >= 0 && r < self->size) return 0;
    xccl_py_raise_fmt(xccl_py_state_of((PyObject *)self), XCCL_ERR_INVALID_ARG,
                      "%s: %s %d is not in [0, %d)", opname, what, r, self->size);
    return -1;
}

/* A thread that used `comm` with the GIL released is back (holding the GIL): the last one
 * frees a communicator destroy() left to it. */
static void leave_busy(xccl_py_comm_t *self)
{
    xccl_comm_t *comm = self->doomed;

    if (--self->busy > 0 || comm == NULL) return;
    self->doomed = NULL;
    dispose(comm);
}

static PyObject *comm_destroy(xccl_py_comm_t *self, PyObject *unused)
{
    xccl_comm_t *comm = self->comm;

    (void)unused;
    self->comm = NULL;
    if (comm == NULL) Py_RETURN_NONE;
    if (self->busy > 0) self->doomed = comm; /* another thread is inside abort() with it */
    else dispose(comm);
    Py_RETURN_NONE;
}

static PyObject *comm_abort(xccl_py_comm_t *self, PyObject *unused)
{
    xccl_comm_t *comm = self->comm;

    (void)unused;
    if (comm == NULL) Py_RETURN_NONE;
    /* Fails pending operations, whose callbacks take the GIL. Another thread may call
     * destroy() meanwhile: `busy` makes it leave the freeing to us. */
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    xccl_comm_abort(comm);
    Py_END_ALLOW_THREADS
    leave_busy(self);
    Py_RETURN_NONE;
}

static PyObject *comm_split(xccl_py_comm_t *self, PyObject *args, PyObject *kwds)
{
    static char     *kwlist[] = {"ranks", "name", NULL};
    xccl_py_state_t *state    = xccl_py_state_of((PyObject *)self);
    PyObject        *ranks_obj;
    PyObject        *seq;
    const char      *name  = NULL;
    int             *ranks = NULL;
    char            *seen  = NULL;
    int              member = 0;
    Py_ssize_t       n;
    xccl_comm_t     *comm;
    xccl_comm_t     *out = NULL;
    xccl_status_t    st;
    PyObject        *res = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|z:split", kwlist, &ranks_obj, &name))
        return NULL;
    if ((comm = alive(self, "split")) == NULL) return NULL;
    seq = PySequence_Fast(ranks_obj, "split: ranks must be a sequence of ints");
    if (seq == NULL) return NULL;
    n     = PySequence_Fast_GET_SIZE(seq);
    ranks = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(*ranks));
    seen  = PyMem_Calloc((size_t)self->size, 1);
    if (ranks == NULL || seen == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    if (n == 0) {
        xccl_py_raise(state, XCCL_ERR_INVALID_ARG, "split: ranks is empty");
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int r;
        if (as_int(PySequence_Fast_GET_ITEM(seq, i), &r) < 0) goto out;
        if (check_rank(self, "split", "rank", r) < 0) goto out;
        if (seen[r]) {
            xccl_py_raise_fmt(state, XCCL_ERR_INVALID_ARG, "split: rank %d is listed twice", r);
            goto out;
        }
        seen[r]  = 1;
        ranks[i] = r;
        member |= r == self->rank;
    }
    if (!member) {
        xccl_py_raise_fmt(state, XCCL_ERR_INVALID_ARG,
                          "split: this rank (%d) is not in ranks; only members call split",
                          self->rank);
        goto out;
    }
    /* Converting the ranks ran Python code: another thread may have destroyed us since. */
    if ((comm = alive(self, "split")) == NULL) goto out;
    st = xccl_comm_split(comm, (int)n, ranks, name, &out); /* local, does not block */
    if (st < 0) {
        xccl_py_raise_last(state, st);
        goto out;
    }
    res = (PyObject *)wrap(Py_TYPE(self), out);
out:
    PyMem_Free(ranks);
    PyMem_Free(seen);
    Py_DECREF(seq);
    return res;
}

static PyObject *comm_global_rank(xccl_py_comm_t *self, PyObject *arg)
{
    int          r;
    xccl_comm_t *comm;

    if (as_int(arg, &r) < 0) return NULL;
    if ((comm = alive(self, "global_rank")) == NULL) return NULL;
    if (check_rank(self, "global_rank", "rank", r) < 0) return NULL;
    return PyLong_FromLong(xccl_comm_global_rank(comm, r));
}

static PyObject *comm_peer_transport(xccl_py_comm_t *self, PyObject *arg)
{
    int          r;
    xccl_comm_t *comm;
    const char  *name;

    if (as_int(arg, &r) < 0) return NULL;
    if ((comm = alive(self, "peer_transport")) == NULL) return NULL;
    if (check_rank(self, "peer_transport", "peer", r) < 0) return NULL;
    name = xccl_comm_peer_transport(comm, r);
    return PyUnicode_FromString(name != NULL ? name : "");
}

static PyObject *get_rank(xccl_py_comm_t *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(self->rank);
}

static PyObject *get_size(xccl_py_comm_t *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(self->size);
}

static PyObject *get_id(xccl_py_comm_t *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->id);
}

static PyObject *comm_repr(xccl_py_comm_t *self)
{
    char id[24];

    PyOS_snprintf(id, sizeof(id), "%016llx", (unsigned long long)self->id);
    return PyUnicode_FromFormat("<xccl._C.Comm rank=%d size=%d id=%s%s>", self->rank, self->size,
                                id, self->comm == NULL ? " destroyed" : "");
}

/* ---------------------------------------------------------------------------------------------
 * Operations
 * ------------------------------------------------------------------------------------------- */

/* State of one operation call: the Work under construction (none for a one-call method,
 * whose buffers stay here) and its options. */
typedef struct call {
    xccl_py_state_t  *state;
    const char       *opname;
    xccl_comm_t      *comm;
    xccl_py_work_t   *work;
    xccl_coll_opts_t  opts;
    xccl_py_tensor_t  bufs[XCCL_PY_WORK_MAX_BUFS];
    int                cuda;   /* an operation on CUDA memory (stream= was given)         */
    unsigned long long stream; /* its CUstream handle (0 and 1: the legacy default stream) */
} call_t;

/* A call without a Work object (the one-call methods). */
static int call_begin_now(call_t *c, xccl_py_comm_t *self, const char *opname,
                          PyObject *timeout_obj)
{
    memset(c, 0, sizeof(*c));
    c->state              = xccl_py_state_of((PyObject *)self);
    c->opname             = opname;
    c->opts.premul_factor = 1.0;
    if (xccl_py_seconds_to_ms(timeout_obj, 0, "timeout", &c->opts.timeout_ms) < 0) return -1;
    return (c->comm = alive(self, opname)) == NULL ? -1 : 0;
}

/* stream=: None for an operation on host memory, else the CUstream (an int >= 0; 0 and 1 are
 * the legacy default stream) that an operation on CUDA memory is ordered after. */
static int parse_stream(call_t *c, PyObject *stream_obj)
{
    unsigned long long v;

    if (stream_obj == NULL || stream_obj == Py_None) return 0;
    if (PyBool_Check(stream_obj) || !PyLong_Check(stream_obj)) {
        PyErr_Format(PyExc_TypeError,
                     "%s: stream must be None or a CUstream handle (int), got %.200s", c->opname,
                     Py_TYPE(stream_obj)->tp_name);
        return -1;
    }
    v = PyLong_AsUnsignedLongLong(stream_obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        xccl_py_raise_fmt(c->state, XCCL_ERR_INVALID_ARG,
                          "%s: stream %R is not a CUstream handle (an int in [0, 2**64))",
                          c->opname, stream_obj);
        return -1;
    }
    c->cuda        = 1;
    c->stream      = v;
    c->opts.mem    = XCCL_MEM_CUDA;
    c->opts.stream = v <= 1 ? NULL : (void *)(uintptr_t)v; /* NULL: the legacy default stream */
    return 0;
}

static int call_begin(call_t *c, xccl_py_comm_t *self, const char *opname, const char *algo,
                      double premul, PyObject *timeout_obj, PyObject *stream_obj)
{
    if (call_begin_now(c, self, opname, timeout_obj) < 0) return -1;
    c->opts.algo          = algo;
    c->opts.premul_factor = premul;
    if (parse_stream(c, stream_obj) < 0) return -1;
    c->work = xccl_py_work_new(c->state);
    if (c->work == NULL) return -1;
    c->work->cuda = c->cuda;
    return 0;
}

/* Acquires buffer `obj` into slot `i` of the Work (or of the call); `what` is the argument
 * name. */
static xccl_py_tensor_t *take(call_t *c, int i, PyObject *obj, int flags, const char *what)
{
    xccl_py_what_t    label = {c->opname, what};
    xccl_py_tensor_t *slot  = c->work != NULL ? &c->work->bufs[i] : &c->bufs[i];
    int               rc;

    if (c->cuda)
        rc = xccl_py_tensor_acquire_cuda(c->state, obj, flags, &label, c->stream, slot);
    else
        rc = xccl_py_tensor_acquire(c->state, obj, flags, &label, slot);
    return rc < 0 ? NULL : slot;
}

/* Called right before posting: taking the buffers ran Python code (__dlpack__), during which
 * another thread may have destroyed the communicator. From here on this thread runs no Python
 * code until the post returns (other threads may, while a large post has the GIL released). */
static int ready(call_t *c, xccl_py_comm_t *self)
{
    return (c->comm = alive(self, c->opname)) == NULL ? -1 : 0;
}

/* Posts of at least this many bytes run with the GIL released. A post starts the operation
 * at once, and that start may copy a whole buffer (an out-of-place all_reduce copies sendbuf
 * into recvbuf, then reduces in place; a shared-memory send copies into the segment); other
 * Python threads must not stall behind it. Smaller posts keep the GIL: releasing it is cheap,
 * but taking it back from a busy thread can cost a whole switch interval. */
#define POST_NOGIL_BYTES ((size_t)1 << 20)

static size_t nbytes_of(const xccl_py_tensor_t *t)
{
    return t != NULL ? t->count * xccl_dtype_size(t->dtype) : 0;
}

/* Before a post of buffers `a` and `b` (either may be NULL): releases the GIL when the larger
 * is big, and returns the thread state to give to nogil_end (NULL: the GIL stays held). While
 * it is released another thread may destroy() the communicator: `busy` makes it leave the
 * freeing to nogil_end, so the post's `comm` stays valid. */
static PyThreadState *nogil_begin(xccl_py_comm_t *self, const xccl_py_tensor_t *a,
                                  const xccl_py_tensor_t *b)
{
    size_t na = nbytes_of(a), nb = nbytes_of(b);

    if ((na > nb ? na : nb) < POST_NOGIL_BYTES) return NULL;
    self->busy++;
    return PyEval_SaveThread();
}

static void nogil_end(xccl_py_comm_t *self, PyThreadState *ts)
{
    if (ts == NULL) return;
    PyEval_RestoreThread(ts);
    leave_busy(self);
}

/* Finishes a call: on success the Work is returned, otherwise it is dropped (its buffers are
 * released at once: nothing was posted). */
static PyObject *call_end(call_t *c, xccl_status_t st, xccl_work_t *w)
{
    if (st < 0) {
        Py_CLEAR(c->work);
        return xccl_py_raise_last(c->state, st);
    }
    c->work->work = w;
    return (PyObject *)c->work;
}

static PyObject *call_fail(call_t *c)
{
    Py_CLEAR(c->work);
    for (int i = 0; i < XCCL_PY_WORK_MAX_BUFS; i++)
        xccl_py_tensor_release(&c->bufs[i]);
    return NULL;
}

static int same_dtype(call_t *c, const xccl_py_tensor_t *a, const xccl_py_tensor_t *b)
{
    if (a->dtype == b->dtype) return 0;
    xccl_py_raise_fmt(c->state, XCCL_ERR_INVALID_ARG,
                      "%s: sendbuf is %s but recvbuf is %s; the dtypes must match", c->opname,
                      xccl_dtype_name(a->dtype), xccl_dtype_name(b->dtype));
    return -1;
}

/* recv.count == factor * send.count (factor = size for gathers) or the reverse (scatters). */
static int counts_match(call_t *c, size_t nsend, size_t nrecv, int send_mult, int recv_mult,
                        const char *rule)
{
    if (nsend * (size_t)send_mult == nrecv * (size_t)recv_mult) return 0;
    xccl_py_raise_fmt(c->state, XCCL_ERR_INVALID_ARG,
                      "%s: sendbuf has %zu elements and recvbuf %zu; expected %s", c->opname,
                      nsend, nrecv, rule);
    return -1;
}

/* Element-wise reductions read and write the same index: buffers must be the same memory or
 * not overlap at all. */
static int no_partial_overlap(call_t *c, const xccl_py_tensor_t *a, const xccl_py_tensor_t *b)
{
    size_t      n  = a->count * xccl_dtype_size(a->dtype);
    size_t      m  = b->count * xccl_dtype_size(b->dtype);
    const char *pa = a->data;
    const char *pb = b->data;

    if (pa == pb || n == 0 || m == 0 || pa + n <= pb || pb + m <= pa) return 0;
    xccl_py_raise_fmt(c->state, XCCL_ERR_INVALID_ARG,
                      "%s: sendbuf and recvbuf overlap partially; pass the same buffer for an "
                      "in-place operation",
                      c->opname);
    return -1;
}

static int check_op(call_t *c, int op, xccl_dtype_t dtype)
{
    xccl_status_t st;

    if (op < 0 || op >= XCCL_OP_COUNT) {
        xccl_py_raise_fmt(c->state, XCCL_ERR_INVALID_ARG, "%s: unknown reduction op %d",
                          c->opname, op);
        return -1;
    }
    st = xccl_op_check((xccl_op_t)op, dtype);
    if (st < 0) {
        xccl_py_raise_last(c->state, st);
        return -1;
    }
    return 0;
}

/* Send and receive buffers of a collective. `sendbuf is recvbuf` means in place: one buffer,
 * acquired writable. Either may be skipped (NULL result, no error) when `*_obj` is NULL. */
static int take_pair(call_t *c, PyObject *send_obj, PyObject *recv_obj, xccl_py_tensor_t **s,
                     xccl_py_tensor_t **r)
{
    *s = *r = NULL;
    if (send_obj != NULL && send_obj == recv_obj) {
        if ((*s = take(c, 0, send_obj, XCCL_PY_BUF_OUTPUT, "sendbuf/recvbuf")) == NULL) return -1;
        *r = *s;
        return 0;
    }
    if (send_obj != NULL && (*s = take(c, 0, send_obj, 0, "sendbuf")) == NULL) return -1;
    if (recv_obj != NULL && (*r = take(c, 1, recv_obj, XCCL_PY_BUF_OUTPUT, "recvbuf")) == NULL)
        return -1;
    return 0;
}

/* The options of a point-to-point post: NULL (host memory) or the CUDA ones in *o. */
static const xccl_p2p_opts_t *p2p_opts(const call_t *c, xccl_p2p_opts_t *o)
{
    if (!c->cuda) return NULL;
    memset(o, 0, sizeof(*o));
    o->mem    = c->opts.mem;
    o->stream = c->opts.stream;
    return o;
}

static PyObject *comm_isend(xccl_py_comm_t *self, PyObject *args, PyObject *kwds)
{
    static char      *kwlist[] = {"buf", "peer", "tag", "stream", NULL};
    PyObject         *buf, *stream = Py_None;
    int               peer;
    long long         tag = 0;
    call_t            c;
    xccl_py_tensor_t *t;
    xccl_work_t      *w = NULL;
    xccl_status_t     st;
    PyThreadState    *ts;
    xccl_p2p_opts_t   popts;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oi|LO:isend", kwlist, &buf, &peer, &tag, &stream))
        return NULL;
    if (call_begin(&c, self, "send", NULL, 1.0, NULL, stream) < 0) return NULL;
    if (check_rank(self, "send", "peer", peer) < 0) return call_fail(&c);
    if (tag < 0 || tag > MAX_TAG) {
        xccl_py_raise_fmt(c.state, XCCL_ERR_INVALID_ARG, "send: tag %lld is not in [0, 2**31)",
                          tag);
        return call_fail(&c);
    }
    if ((t = take(&c, 0, buf, 0, "buf")) == NULL) return call_fail(&c);
    if (ready(&c, self) < 0) return call_fail(&c);
    ts = nogil_begin(self, t, NULL);
    st = xccl_isend_opts(c.comm, t->data, t->count * xccl_dtype_size(t->dtype), peer,
                         (uint32_t)tag, p2p_opts(&c, &popts), &w);
    nogil_end(self, ts);
    return call_end(&c, st, w);
}

static PyObject *comm_irecv(xccl_py_comm_t *self, PyObject *args, PyObject *kwds)
{
    static char      *kwlist[] = {"buf", "peer", "tag", "stream", NULL};
    PyObject         *buf, *stream = Py_None;
    int               peer = XCCL_ANY_SOURCE;
    long long         tag  = 0;
    call_t            c;
    xccl_py_tensor_t *t;
    xccl_work_t      *w = NULL;
    xccl_status_t     st;
    PyThreadState    *ts;
    xccl_p2p_opts_t   popts;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|iLO:irecv", kwlist, &buf, &peer, &tag, &stream))
        return NULL;
    if (call_begin(&c, self, "recv", NULL, 1.0, NULL, stream) < 0) return NULL;
    if (peer != XCCL_ANY_SOURCE && check_rank(self, "recv", "peer", peer) < 0)
        return call_fail(&c);
    if (tag < 0 || tag > MAX_TAG) {
        xccl_py_raise_fmt(c.state, XCCL_ERR_INVALID_ARG, "recv: tag %lld is not in [0, 2**31)",
                          tag);
        return call_fail(&c);
    }
    if ((t = take(&c, 0, buf, XCCL_PY_BUF_OUTPUT, "buf")) == NULL) return call_fail(&c);
    if (ready(&c, self) < 0) return call_fail(&c);
    ts = nogil_begin(self, t, NULL);
    st = xccl_irecv_opts(c.comm, t->data, t->count * xccl_dtype_size(t->dtype), peer,
                         (uint32_t)tag, p2p_opts(&c, &popts), &w);
    nogil_end(self, ts);
    return call_end(&c, st, w);
}

static PyObject *comm_allreduce(xccl_py_comm_t *self, PyObject *args, PyObject *kwds)
{
    static char      *kwlist[] = {"sendbuf", "recvbuf", "op",      "premul",
                                  "algo",    "timeout", "stream", NULL};
    PyObject         *sobj, *robj, *timeout = Py_None, *stream = Py_None;
    int               op;
    double            premul = 1.0;
    const char       *algo   = NULL;
    call_t            c;
    xccl_py_tensor_t *s, *r;
    xccl_work_t      *w = NULL;
    xccl_status_t     st;
    PyThreadState    *ts;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOi|dzOO:allreduce", kwlist, &sobj, &robj, &op,
                                     &premul, &algo, &timeout, &stream)) {
        return NULL;
    }
    if (call_begin(&c, self, "all_reduce", algo, premul, timeout, stream) < 0) return NULL;
    if (take_pair(&c, sobj, robj, &s, &r) < 0 || same_dtype(&c, s, r) < 0 ||
        counts_match(&c, s->count, r->count, 1, 1, "the same count") < 0 ||
        no_partial_overlap(&c, s, r) < 0 || check_op(&c, op, s->dtype) < 0) {
        return call_fail(&c);
    }
    if (ready(&c, self) < 0) return call_fail(&c);
    ts = nogil_begin(self, s, r);
    st = xccl_allreduce(c.comm, s->data, r->data, s->count, s->dtype, (xccl_op_t)op, &c.opts, &w);
    nogil_end(self, ts);
    return call_end(&c, st, w);
}

/* The collectives of two buffers whose shapes relate by the group size. */
enum { PAIR_ALLGATHER, PAIR_REDUCE_SCATTER, PAIR_ALLTOALL };

/* The argument checks of all_gather, reduce_scatter (with its operator `op`) and all_to_all on
 * `n` ranks, shared by the general methods and the one-call paths: -1 with the exception set. */
static int pair_checks(call_t *c, int coll, int n, const xccl_py_tensor_t *s,
                       const xccl_py_tensor_t *r, int op)
{
    if (same_dtype(c, s, r) < 0) return -1;
    switch (coll) {
    case PAIR_ALLGATHER:
        return counts_match(c, s->count, r->count, n, 1, "recvbuf = size * sendbuf");
    case PAIR_REDUCE_SCATTER:
        if (counts_match(c, s->count, r->count, 1, n, "sendbuf = size * recvbuf") < 0) return -1;
        return check_op(c, op, s->dtype);
    default:
        if (counts_match(c, s->count, r->count, 1, 1, "the same count") < 0) return -1;
        if (s->count % (size_t)n == 0) return 0;
        xccl_py_raise_fmt(c->state, XCCL_ERR_INVALID_ARG,
                          "all_to_all: %zu elements do not split into %d equal blocks", s->count,
                          n);
        return -1;
    }
}

/* ---------------------------------------------------------------------------------------------
 * One-call paths: an operation posted and waited for in one call, for the torch-style layer's
 * common cases (default group, blocking, a numpy array or a tensor with a DLPack exchange
 * table). Each declines - returns None, having posted nothing and set no exception - where the
 * general path must handle the call (a buffer readable only through producer code, an
 * argument a check refuses), so that this path raises the message. Failures of the operation
 * itself raise.
 * ------------------------------------------------------------------------------------------- */

static PyObject *now_decline(call_t *c)
{
    PyErr_Clear();
    call_fail(c);
    Py_RETURN_NONE;
}

/* The post's result waited for: Py_True (or, with `source`, the sender's rank), or NULL. */
static PyObject *now_wait(call_t *c, xccl_status_t st, xccl_work_t *w, int source)
{
    if (st < 0) {
        call_fail(c);
        return xccl_py_raise_last(c->state, st);
    }
    return xccl_py_wait_now(c->state, w, c->bufs, source);
}

/* The integer arguments of a one-call method: args[1], and args[2] when `b` is given (else
 * args[2] is a timeout). -1 (exception cleared) when one is not an integer in range, which
 * the general path then reports; -2 (TypeError) for a wrong argument count. */
static int now_ints(PyObject *const *args, Py_ssize_t nargs, const char *sig, long *a, long *b)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "%s takes 3 arguments", sig);
        return -2;
    }
    *a = PyLong_AsLong(args[1]);
    if (b != NULL && !PyErr_Occurred()) *b = PyLong_AsLong(args[2]);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

/* A peer rank other than this one, and a tag, both in range. */
static int now_peer_ok(const xccl_py_comm_t *self, long peer, long tag)
{
    return peer >= 0 && peer < self->size && peer != self->rank && tag >= 0 && tag <= MAX_TAG;
}

/* allreduce_now(buf, op, timeout) -> True | None, in place, and broadcast_now(buf, root,
 * timeout) -> True | None (`bcast`: `arg` is the root, else the operator). */
static PyObject *one_buf_now(xccl_py_comm_t *self, PyObject *const *args, Py_ssize_t nargs,
                             int bcast)
{
    call_t            c;
    xccl_py_tensor_t *t;
    xccl_work_t      *w = NULL;
    xccl_status_t     st;
    PyThreadState    *ts;
    long              arg = 0;
    int               flags, rc;

    rc = now_ints(args, nargs,
                  bcast ? "broadcast_now(buf, root, timeout)" : "allreduce_now(buf, op, timeout)",
                  &arg, NULL);
    if (rc == -2) return NULL;
    if (rc < 0 || (bcast && (arg < 0 || arg >= self->size))) Py_RETURN_NONE;
    if (call_begin_now(&c, self, bcast ? "broadcast" : "all_reduce", args[2]) < 0) return NULL;
    /* a broadcast root only reads its buffer */
    flags = (bcast && arg == self->rank ? 0 : XCCL_PY_BUF_OUTPUT) | XCCL_PY_BUF_NO_CAPSULE;
    t     = take(&c, 0, args[0], flags, bcast ? "buf" : "sendbuf/recvbuf");
    if (t == NULL || (!bcast && check_op(&c, (int)arg, t->dtype) < 0)) return now_decline(&c);
    if (ready(&c, self) < 0) return call_fail(&c);
    ts = nogil_begin(self, t, NULL);
    st = bcast ? xccl_broadcast(c.comm, t->data, t->count, t->dtype, (int)arg, &c.opts, &w)
               : xccl_allreduce(c.comm, t->data, t->data, t->count, t->dtype, (xccl_op_t)arg,
                                &c.opts, &w);
    nogil_end(self, ts);
    return now_wait(&c, st, w, 0);
}

static PyObject *comm_allreduce_now(xccl_py_comm_t *self, PyObject *const *args,
                                    Py_ssize_t nargs)
{
    return one_buf_now(self, args, nargs, 0);
}

static PyObject *comm_broadcast_now(xccl_py_comm_t *self, PyObject *const *args,
                                    Py_ssize_t nargs)
{
    return one_buf_now(self, args, nargs, 1);
}

static const char *const pair_now_name[] = {"all_gather", "reduce_scatter", "all_to_all"};
static const char *const pair_now_sig[]  = {"allgather_now(sendbuf, recvbuf, timeout)",
                                            "reduce_scatter_now(sendbuf, recvbuf, op, timeout)",
                                            "alltoall_now(sendbuf, recvbuf, timeout)"};

/* allgather_now(sendbuf, recvbuf, timeout), reduce_scatter_now(sendbuf, recvbuf, op, timeout)
 * and alltoall_now(sendbuf, recvbuf, timeout) -> True | None: two distinct buffers, checked as
 * the general methods check them (which also take one buffer for both); all_to_all's blocks
 * are equal splits of sendbuf's first dimension, as torch's all_to_all_single makes them. */
static PyObject *pair_now(xccl_py_comm_t *self, PyObject *const *args, Py_ssize_t nargs,
                          int coll)
{
    const int         rs   = coll == PAIR_REDUCE_SCATTER;
    const Py_ssize_t  want = rs ? 4 : 3;
    call_t            c;
    xccl_py_tensor_t *s, *r;
    xccl_work_t      *w  = NULL;
    long              op = 0;
    xccl_status_t     st;
    PyThreadState    *ts;

    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %d arguments", pair_now_sig[coll], (int)want);
        return NULL;
    }
    if (args[0] == args[1]) Py_RETURN_NONE;
    if (rs && (op = PyLong_AsLong(args[2])) == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (call_begin_now(&c, self, pair_now_name[coll], args[want - 1]) < 0) return NULL;
    s = take(&c, 0, args[0], XCCL_PY_BUF_NO_CAPSULE, "sendbuf");
    r = s ? take(&c, 1, args[1], XCCL_PY_BUF_OUTPUT | XCCL_PY_BUF_NO_CAPSULE, "recvbuf") : NULL;
    if (r == NULL || pair_checks(&c, coll, self->size, s, r, (int)op) < 0 ||
        (coll == PAIR_ALLTOALL && (s->rows < 0 || s->rows % self->size != 0)))
        return now_decline(&c);
    if (ready(&c, self) < 0) return call_fail(&c);
    ts = nogil_begin(self, s, r);
    if (coll == PAIR_ALLGATHER)
        st = xccl_allgather(c.comm, s->data, r->data, s->count, s->dtype, &c.opts, &w);
    else if (rs)
        st = xccl_reduce_scatter(c.comm, s->data, r->data, r->count, r->dtype, (xccl_op_t)op,
                                 &c.opts, &w);
    else
        st = xccl_alltoall(c.comm, s->data, r->data, s->count / (size_t)self->size, s->dtype,
                           &c.opts, &w);
    nogil_end(self, ts);
    return now_wait(&c, st, w, 0);
}

static PyObject *comm_allgather_now(xccl_py_comm_t *self, PyObject *const *args, Py_ssize_t nargs)
{
    return pair_now(self, args, nargs, PAIR_ALLGATHER);
}

static PyObject *comm_reduce_scatter_now(xccl_py_comm_t *self, PyObject *const *args,
                                         Py_ssize_t nargs)
{
    return pair_now(self, args, nargs, PAIR_REDUCE_SCATTER);
}

static PyObject *comm_alltoall_now(xccl_py_comm_t *self, PyObject *const *args, Py_ssize_t nargs)
{
    return pair_now(self, args, nargs, PAIR_ALLTOALL);
}

/* send_now(buf, peer, tag) -> True | None, a send waited for until it completed, and
 * recv_now(buf, peer, tag) -> the sender's rank | None (`recv`). */
static PyObject *p2p_now(xccl_py_comm_t *self, PyObject *const *args, Py_ssize_t nargs,
                         int recv)
{
    call_t            c;
    xccl_py_tensor_t *t;
    xccl_work_t      *w = NULL;
    xccl_status_t     st;
    PyThreadState    *ts;
    long              peer = 0, tag = 0;
    size_t            nbytes;
    int               rc = now_ints(args, nargs, recv ? "recv_now(buf, peer, tag)"
                                                      : "send_now(buf, peer, tag)",
                                    &peer, &tag);

    if (rc == -2) return NULL;
    if (rc < 0 || !now_peer_ok(self, peer, tag)) Py_RETURN_NONE;
    if (call_begin_now(&c, self, recv ? "recv" : "send", NULL) < 0) return NULL;
    t = take(&c, 0, args[0], (recv ? XCCL_PY_BUF_OUTPUT : 0) | XCCL_PY_BUF_NO_CAPSULE, "buf");
    if (t == NULL) return now_decline(&c);
    if (ready(&c, self) < 0) return call_fail(&c);
    ts = nogil_begin(self, t, NULL);
    nbytes = t->count * xccl_dtype_size(t->dtype);
    st     = recv ? xccl_irecv(c.comm, t->data, nbytes, (int)peer, (uint32_t)tag, &w)
                  : xccl_isend(c.comm, t->data, nbytes, (int)peer, (uint32_t)tag, &w);
    nogil_end(self, ts);
    return now_wait(&c, st, w, recv);
}

static PyObject *comm_send_now(xccl_py_comm_t *self, PyObject *const *args, Py_ssize_t nargs)
{
    return p2p_now(self, args, nargs, 0);
}

static PyObject *comm_recv_now(xccl_py_comm_t *self, PyObject *const *args, Py_ssize_t nargs)
{
    return p2p_now(self, args, nargs, 1);
}

static PyObject *comm_broadcast(xccl_py_comm_t *self, PyObject *args, PyObject *kwds)
{
    static char      *kwlist[] = {"buf", "root", "algo", "timeout", "stream", NULL};
    PyObject         *buf, *timeout = Py_None, *stream = Py_None;
    int               root;
    const char       *algo = NULL;
    call_t            c;
    xccl_py_tensor_t *t;
    xccl_work_t      *w = NULL;
    xccl_status_t     st;
    PyThreadState    *ts;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oi|zOO:broadcast", kwlist, &buf, &root, &algo,
                                     &timeout, &stream)) {
        return NULL;
    }
    if (call_begin(&c, self, "broadcast", algo, 1.0, timeout, stream) < 0) return NULL;
    if (check_rank(self, "broadcast", "root", root) < 0) return call_fail(&c);
    /* The root only reads its buffer. */
    t = take(&c, 0, buf, root == self->rank ? 0 : XCCL_PY_BUF_OUTPUT, "buf");
    if (t == NULL) return call_fail(&c);
    if (ready(&c, self) < 0) return call_fail(&c);
    ts = nogil_begin(self, t, NULL);
    st = xccl_broadcast(c.comm, t->data, t->count, t->dtype, root, &c.opts, &w);
    nogil_end(self, ts);
    return call_end(&c, st, w);
}

static PyObject *comm_reduce(xccl_py_comm_t *self, PyObject *args, PyObject *kwds)
{
    static char      *kwlist[] = {"sendbuf", "recvbuf", "op",      "root",
                                  "premul",  "algo",    "timeout", "stream", NULL};
    PyObject         *sobj, *robj, *timeout = Py_None, *stream = Py_None;
    int               op, root;
    double            premul = 1.0;
    const char       *algo   = NULL;
    call_t            c;
    xccl_py_tensor_t *s, *r;
    xccl_work_t      *w = NULL;
    xccl_status_t     st;
    PyThreadState    *ts;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOii|dzOO:reduce", kwlist, &sobj, &robj, &op,
                                     &root, &premul, &algo, &timeout, &stream)) {
        return NULL;
    }
    if (call_begin(&c, self, "reduce", algo, premul, timeout, stream) < 0) return NULL;
    if (check_rank(self, "reduce", "root", root) < 0) return call_fail(&c);
    if (root == self->rank) {
        if (robj == Py_None) {
            xccl_py_raise(c.state, XCCL_ERR_INVALID_ARG, "reduce: recvbuf is required at the root");
            return call_fail(&c);
        }
        if (take_pair(&c, sobj, robj, &s, &r) < 0 || same_dtype(&c, s, r) < 0 ||
            counts_match(&c, s->count, r->count, 1, 1, "the same count") < 0 ||
            no_partial_overlap(&c, s, r) < 0) {
            return call_fail(&c);
        }
    } else {
        /* recvbuf is not significant here: only sendbuf is read. */
        if (take_pair(&c, sobj, NULL, &s, &r) < 0) return call_fail(&c);
    }
    if (check_op(&c, op, s->dtype) < 0) return call_fail(&c);
    if (ready(&c, self) < 0) return call_fail(&c);
    ts = nogil_begin(self, s, r);
    st = xccl_reduce(c.comm, s->data, r != NULL ? r->data : NULL, s->count, s->dtype,
                     (xccl_op_t)op, root, &c.opts, &w);
    nogil_end(self, ts);
    return call_end(&c, st, w);
}

static PyObject *comm_allgather(xccl_py_comm_t *self, PyObject *args, PyObject *kwds)
{
    static char      *kwlist[] = {"sendbuf", "recvbuf", "algo", "timeout", "stream", NULL};
    PyObject         *sobj, *robj, *timeout = Py_None, *stream = Py_None;
    const char       *algo = NULL;
    call_t            c;
    xccl_py_tensor_t *s, *r;
    xccl_work_t      *w = NULL;
    xccl_status_t     st;
    PyThreadState    *ts;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|zOO:allgather", kwlist, &sobj, &robj, &algo,
                                     &timeout, &stream)) {
        return NULL;
    }
    if (call_begin(&c, self, "all_gather", algo, 1.0, timeout, stream) < 0) return NULL;
    if (take_pair(&c, sobj, robj, &s, &r) < 0 ||
        pair_checks(&c, PAIR_ALLGATHER, self->size, s, r, 0) < 0)
        return call_fail(&c);
    if (ready(&c, self) < 0) return call_fail(&c);
    ts = nogil_begin(self, s, r);
    st = xccl_allgather(c.comm, s->data, r->data, s->count, s->dtype, &c.opts, &w);
    nogil_end(self, ts);
    return call_end(&c, st, w);
}

static PyObject *comm_gather(xccl_py_comm_t *self, PyObject *args, PyObject *kwds)
{
    static char      *kwlist[] = {"sendbuf", "recvbuf", "root", "algo", "timeout", "stream", NULL};
    PyObject         *sobj, *robj, *timeout = Py_None, *stream = Py_None;
    int               root;
    const char       *algo = NULL;
    call_t            c;
    xccl_py_tensor_t *s, *r;
    xccl_work_t      *w = NULL;
    xccl_status_t     st;
    PyThreadState    *ts;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOi|zOO:gather", kwlist, &sobj, &robj, &root,
                                     &algo, &timeout, &stream)) {
        return NULL;
    }
    if (call_begin(&c, self, "gather", algo, 1.0, timeout, stream) < 0) return NULL;
    if (check_rank(self, "gather", "root", root) < 0) return call_fail(&c);
    if (root == self->rank) {
        if (robj == Py_None) {
            xccl_py_raise(c.state, XCCL_ERR_INVALID_ARG, "gather: recvbuf is required at the root");
            return call_fail(&c);
        }
        if (take_pair(&c, sobj, robj, &s, &r) < 0 || same_dtype(&c, s, r) < 0 ||
            counts_match(&c, s->count, r->count, self->size, 1, "recvbuf = size * sendbuf") < 0) {
            return call_fail(&c);
        }
    } else if (take_pair(&c, sobj, NULL, &s, &r) < 0) {
        return call_fail(&c);
    }
    if (ready(&c, self) < 0) return call_fail(&c);
    ts = nogil_begin(self, s, r);
    st = xccl_gather(c.comm, s->data, r != NULL ? r->data : NULL, s->count, s->dtype, root,
                     &c.opts, &w);
    nogil_end(self, ts);
    return call_end(&c, st, w);
}

static PyObject *comm_scatter(xccl_py_comm_t *self, PyObject *args, PyObject *kwds)
{
    static char      *kwlist[] = {"sendbuf", "recvbuf", "root", "algo", "timeout", "stream", NULL};
    PyObject         *sobj, *robj, *timeout = Py_None, *stream = Py_None;
    int               root;
    const char       *algo = NULL;
    call_t            c;
    xccl_py_tensor_t *s, *r;
    xccl_work_t      *w = NULL;
    xccl_status_t     st;
    PyThreadState    *ts;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOi|zOO:scatter", kwlist, &sobj, &robj, &root,
                                     &algo, &timeout, &stream)) {
        return NULL;
    }
    if (call_begin(&c, self, "scatter", algo, 1.0, timeout, stream) < 0) return NULL;
    if (check_rank(self, "scatter", "root", root) < 0) return call_fail(&c);
    if (root == self->rank) {
        if (sobj == Py_None) {
            xccl_py_raise(c.state, XCCL_ERR_INVALID_ARG,
                          "scatter: sendbuf is required at the root");
            return call_fail(&c);
        }
        if (take_pair(&c, sobj, robj, &s, &r) < 0 || same_dtype(&c, s, r) < 0 ||
            counts_match(&c, s->count, r->count, 1, self->size, "sendbuf = size * recvbuf") < 0) {
            return call_fail(&c);
        }
    } else if (take_pair(&c, NULL, robj, &s, &r) < 0) {
        return call_fail(&c);
    }
    if (ready(&c, self) < 0) return call_fail(&c);
    ts = nogil_begin(self, s, r);
    st = xccl_scatter(c.comm, s != NULL ? s->data : NULL, r->data, r->count, r->dtype, root,
                      &c.opts, &w);
    nogil_end(self, ts);
    return call_end(&c, st, w);
}

static PyObject *comm_reduce_scatter(xccl_py_comm_t *self, PyObject *args, PyObject *kwds)
{
    static char      *kwlist[] = {"sendbuf", "recvbuf", "op",     "premul",
                                  "algo",    "timeout", "stream", NULL};
    PyObject         *sobj, *robj, *timeout = Py_None, *stream = Py_None;
    int               op;
    double            premul = 1.0;
    const char       *algo   = NULL;
    call_t            c;
    xccl_py_tensor_t *s, *r;
    xccl_work_t      *w = NULL;
    xccl_status_t     st;
    PyThreadState    *ts;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOi|dzOO:reduce_scatter", kwlist, &sobj, &robj,
                                     &op, &premul, &algo, &timeout, &stream)) {
        return NULL;
    }
    if (call_begin(&c, self, "reduce_scatter", algo, premul, timeout, stream) < 0) return NULL;
    if (take_pair(&c, sobj, robj, &s, &r) < 0 ||
        pair_checks(&c, PAIR_REDUCE_SCATTER, self->size, s, r, op) < 0)
        return call_fail(&c);
    if (ready(&c, self) < 0) return call_fail(&c);
    ts = nogil_begin(self, s, r);
    st = xccl_reduce_scatter(c.comm, s->data, r->data, r->count, r->dtype, (xccl_op_t)op, &c.opts,
                             &w);
    nogil_end(self, ts);
    return call_end(&c, st, w);
}

static PyObject *comm_alltoall(xccl_py_comm_t *self, PyObject *args, PyObject *kwds)
{
    static char      *kwlist[] = {"sendbuf", "recvbuf", "algo", "timeout", "stream", NULL};
    PyObject         *sobj, *robj, *timeout = Py_None, *stream = Py_None;
    const char       *algo = NULL;
    call_t            c;
    xccl_py_tensor_t *s, *r;
    xccl_work_t      *w = NULL;
    xccl_status_t     st;
    PyThreadState    *ts;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|zOO:alltoall", kwlist, &sobj, &robj, &algo,
                                     &timeout, &stream)) {
        return NULL;
    }
    if (call_begin(&c, self, "all_to_all", algo, 1.0, timeout, stream) < 0) return NULL;
    if (take_pair(&c, sobj, robj, &s, &r) < 0 ||
        pair_checks(&c, PAIR_ALLTOALL, self->size, s, r, 0) < 0)
        return call_fail(&c);
    if (ready(&c, self) < 0) return call_fail(&c);
    ts = nogil_begin(self, s, r);
    st = xccl_alltoall(c.comm, s->data, r->data, s->count / (size_t)self->size, s->dtype, &c.opts,
                       &w);
    nogil_end(self, ts);
    return call_end(&c, st, w);
}

/* One of the four alltoallv vectors: `size` non-negative ints, each block inside the buffer. */
static int take_counts(call_t *c, PyObject *obj, const char *what, int size, size_t *out)
{
    PyObject *seq = PySequence_Fast(obj, "all_to_allv: counts and displacements must be sequences");

    if (seq == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != size) {
        xccl_py_raise_fmt(c->state, XCCL_ERR_INVALID_ARG,
                          "all_to_allv: %s has %zd entries, expected one per rank (%d)", what,
                          PySequence_Fast_GET_SIZE(seq), size);
        Py_DECREF(seq);
        return -1;
    }
    for (int i = 0; i < size; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        if (v < 0) {
            xccl_py_raise_fmt(c->state, XCCL_ERR_INVALID_ARG, "all_to_allv: %s[%d] = %lld < 0",
                              what, i, v);
            Py_DECREF(seq);
            return -1;
        }
        out[i] = (size_t)v;
    }
    Py_DECREF(seq);
    return 0;
}

static int blocks_inside(call_t *c, const char *buf, const size_t *counts, const size_t *displs,
                         int size, size_t total)
{
    for (int i = 0; i < size; i++) {
        if (displs[i] <= total && counts[i] <= total - displs[i]) continue;
        xccl_py_raise_fmt(c->state, XCCL_ERR_INVALID_ARG,
                          "all_to_allv: block %d of %s (displacement %zu, count %zu) ends past "
                          "its %zu elements",
                          i, buf, displs[i], counts[i], total);
        return -1;
    }
    return 0;
}

static PyObject *comm_alltoallv(xccl_py_comm_t *self, PyObject *args, PyObject *kwds)
{
    static char      *kwlist[] = {"sendbuf", "scounts", "sdispls", "recvbuf", "rcounts",
                                  "rdispls", "algo",    "timeout", "stream", NULL};
    PyObject         *sobj, *robj, *sc, *sd, *rc, *rd;
    PyObject         *timeout = Py_None, *stream = Py_None;
    const char       *algo = NULL;
    call_t            c;
    xccl_py_tensor_t *s, *r;
    size_t           *v;
    size_t            n = (size_t)self->size;
    xccl_work_t      *w = NULL;
    xccl_status_t     st;
    PyThreadState    *ts;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOO|zOO:alltoallv", kwlist, &sobj, &sc, &sd,
                                     &robj, &rc, &rd, &algo, &timeout, &stream)) {
        return NULL;
    }
    if (call_begin(&c, self, "all_to_allv", algo, 1.0, timeout, stream) < 0) return NULL;
    /* The vectors live in the Work until completion, in case the engine reads them late. */
    v = c.work->vcounts = PyMem_RawCalloc(4 * n, sizeof(size_t));
    if (v == NULL) {
        PyErr_NoMemory();
        return call_fail(&c);
    }
    if (take_pair(&c, sobj, robj, &s, &r) < 0 || same_dtype(&c, s, r) < 0 ||
        take_counts(&c, sc, "scounts", self->size, v) < 0 ||
        take_counts(&c, sd, "sdispls", self->size, v + n) < 0 ||
        take_counts(&c, rc, "rcounts", self->size, v + 2 * n) < 0 ||
        take_counts(&c, rd, "rdispls", self->size, v + 3 * n) < 0 ||
        blocks_inside(&c, "sendbuf", v, v + n, self->size, s->count) < 0 ||
        blocks_inside(&c, "recvbuf", v + 2 * n, v + 3 * n, self->size, r->count) < 0) {
        return call_fail(&c);
    }
    if (ready(&c, self) < 0) return call_fail(&c);
    ts = nogil_begin(self, s, r);
    st = xccl_alltoallv(c.comm, s->data, v, v + n, r->data, v + 2 * n, v + 3 * n, s->dtype,
                        &c.opts, &w);
    nogil_end(self, ts);
    return call_end(&c, st, w);
}

static PyObject *comm_barrier(xccl_py_comm_t *self, PyObject *args, PyObject *kwds)
{
    static char  *kwlist[] = {"algo", "timeout", NULL};
    PyObject     *timeout  = Py_None;
    const char   *algo     = NULL;
    call_t        c;
    xccl_work_t  *w = NULL;
    xccl_status_t st;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|zO:barrier", kwlist, &algo, &timeout))
        return NULL;
    if (call_begin(&c, self, "barrier", algo, 1.0, timeout, NULL) < 0) return NULL;
    if (ready(&c, self) < 0) return call_fail(&c);
    st = xccl_barrier(c.comm, &c.opts, &w);
    return call_end(&c, st, w);
}

/* ---------------------------------------------------------------------------------------------
 * Type
 * ------------------------------------------------------------------------------------------- */

#define KW(f)  ((PyCFunction)(void (*)(void))(f)), METH_VARARGS | METH_KEYWORDS
#define NOW(f) ((PyCFunction)(void (*)(void))(f)), METH_FASTCALL

static PyMethodDef comm_methods[] = {
    {"split", KW(comm_split),
     "split(ranks, name=None) -> Comm over `ranks` (members only; local, no communication)."},
    {"global_rank", (PyCFunction)comm_global_rank, METH_O,
     "global_rank(rank) -> rank in the root communicator."},
    {"peer_transport", (PyCFunction)comm_peer_transport, METH_O,
     "peer_transport(peer) -> \"tcp\", \"shm\", \"self\", ..."},
    {"destroy", (PyCFunction)comm_destroy, METH_NOARGS,
     "destroy(): idempotent; pending operations fail, later operations raise XcclError."},
    {"abort", (PyCFunction)comm_abort, METH_NOARGS,
     "abort(): pending operations fail with XCCL_ERR_ABORTED, later ones fail at once."},
    {"isend", KW(comm_isend), "isend(buf, peer, tag=0, stream=None) -> Work"},
    {"irecv", KW(comm_irecv), "irecv(buf, peer=ANY_SOURCE, tag=0, stream=None) -> Work"},
    {"allreduce", KW(comm_allreduce),
     "allreduce(sendbuf, recvbuf, op, premul=1.0, algo=None, timeout=None, stream=None) -> "
     "Work\n\nstream (every operation but barrier): None for host buffers; for CUDA buffers "
     "the CUstream handle (int; 0 is the legacy default stream) the operation is ordered "
     "after."},
    {"allreduce_now", NOW(comm_allreduce_now),
     "allreduce_now(buf, op, timeout) -> True | None: in-place all_reduce, posted and waited "
     "for; None (nothing done) where the general path must handle the call"},
    {"broadcast_now", NOW(comm_broadcast_now),
     "broadcast_now(buf, root, timeout) -> True | None: broadcast, posted and waited for"},
    {"allgather_now", NOW(comm_allgather_now),
     "allgather_now(sendbuf, recvbuf, timeout) -> True | None: all_gather of two buffers, "
     "posted and waited for"},
    {"reduce_scatter_now", NOW(comm_reduce_scatter_now),
     "reduce_scatter_now(sendbuf, recvbuf, op, timeout) -> True | None: reduce_scatter of two "
     "buffers, posted and waited for"},
    {"alltoall_now", NOW(comm_alltoall_now),
     "alltoall_now(sendbuf, recvbuf, timeout) -> True | None: all_to_all of equal splits of "
     "sendbuf's first dimension, posted and waited for"},
    {"send_now", NOW(comm_send_now), "send_now(buf, peer, tag) -> True | None: blocking send"},
    {"recv_now", NOW(comm_recv_now),
     "recv_now(buf, peer, tag) -> source rank | None: blocking receive from `peer`"},
    {"broadcast", KW(comm_broadcast),
     "broadcast(buf, root, algo=None, timeout=None, stream=None) -> Work"},
    {"reduce", KW(comm_reduce),
     "reduce(sendbuf, recvbuf, op, root, premul=1.0, algo=None, timeout=None, stream=None) -> "
     "Work\n\n"
     "recvbuf may be None on non-root ranks."},
    {"allgather", KW(comm_allgather),
     "allgather(sendbuf, recvbuf, algo=None, timeout=None, stream=None) -> Work; recvbuf holds "
     "size * "
     "len(sendbuf), rank-major."},
    {"gather", KW(comm_gather),
     "gather(sendbuf, recvbuf, root, algo=None, timeout=None, stream=None) -> Work; recvbuf "
     "may be None "
     "off the root."},
    {"scatter", KW(comm_scatter),
     "scatter(sendbuf, recvbuf, root, algo=None, timeout=None, stream=None) -> Work; sendbuf "
     "may be None "
     "off the root."},
    {"reduce_scatter", KW(comm_reduce_scatter),
     "reduce_scatter(sendbuf, recvbuf, op, premul=1.0, algo=None, timeout=None, stream=None) "
     "-> Work"},
    {"alltoall", KW(comm_alltoall),
     "alltoall(sendbuf, recvbuf, algo=None, timeout=None, stream=None) -> Work"},
    {"alltoallv", KW(comm_alltoallv),
     "alltoallv(sendbuf, scounts, sdispls, recvbuf, rcounts, rdispls, algo=None, timeout=None, "
     "stream=None) -> Work (counts and displacements in elements)"},
    {"barrier", KW(comm_barrier), "barrier(algo=None, timeout=None) -> Work"},
    {"trace", xccl_py_comm_trace, METH_O,
     "trace(capacity): record up to `capacity` step events (oldest dropped); 0 stops."},
    {"trace_drain", xccl_py_comm_trace_drain, METH_NOARGS,
     "trace_drain() -> list of dicts: the recorded events, oldest first (removed)."},
    {"trace_dropped", xccl_py_comm_trace_dropped, METH_NOARGS,
     "trace_dropped() -> events lost to a full buffer since tracing started."},
    {"choose", xccl_py_comm_choose, METH_VARARGS,
     "choose(collective, nbytes) -> str: the algorithm a call would run now (no algo=)."},
    {"explain", xccl_py_comm_explain, METH_VARARGS,
     "explain(collective, nbytes) -> list of dicts: every algorithm priced as the selector "
     "prices this group's calls (two-level ones with its links inside and between hosts)."},
    {"cost_model", xccl_py_comm_cost_model, METH_NOARGS,
     "cost_model() -> (alpha, beta, gamma, nnodes): the model its algorithms are chosen with."},
    {"flight_dump", xccl_py_comm_flight_dump, METH_NOARGS,
     "flight_dump() -> str: the flight recorder's table of recent and pending operations."},
    {"diag_table", xccl_py_comm_diag_table, METH_O,
     "diag_table(wait_s) -> str: every member's pending operations, asked now (waits up to "
     "wait_s for answers)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef comm_getset[] = {
    {"rank", (getter)get_rank, NULL, "this process's rank", NULL},
    {"size", (getter)get_size, NULL, "number of ranks", NULL},
    {"id", (getter)get_id, NULL, "communicator id (the same on every rank)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

xccl_py_now_fn xccl_py_comm_now_method(const char *name)
{
    for (const PyMethodDef *m = comm_methods; m->ml_name != NULL; m++)
        if (m->ml_flags == METH_FASTCALL && strcmp(m->ml_name, name) == 0)
            return (xccl_py_now_fn)(void (*)(void))m->ml_meth;
    return NULL;
}

static PyType_Slot comm_slots[] = {
    {Py_tp_doc, "Comm(store, rank, size, timeout, transports=None, auth_key=None, name=None)\n\n"
                "A communicator (xccl_comm_t). Creation is collective over the store."},
    {Py_tp_new, comm_new},
    {Py_tp_dealloc, comm_dealloc},
    {Py_tp_repr, comm_repr},
    {Py_tp_methods, comm_methods},
    {Py_tp_getset, comm_getset},
    {0, NULL},
};

PyType_Spec xccl_py_comm_spec = {
    .name      = "xccl._C.Comm",
    .basicsize = sizeof(xccl_py_comm_t),
    .flags     = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots     = comm_slots,
};
