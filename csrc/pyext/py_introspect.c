/* SPDX-License-Identifier: Apache-2.0
 *
 * py_introspect.c - the introspection part of xccl._C: explain() and default_model() (the
 * cost model behind algorithm selection), and the Comm methods trace(), trace_drain(),
 * trace_dropped() and flight_dump() (step tracing and the flight recorder), cost_model().
 *
 * Every function here runs with the GIL held and calls only quick, non-blocking C functions
 * (they take the engine's lock for a few microseconds; the engine never waits for the GIL
 * while holding it). Keeping the GIL also keeps Comm.destroy() on another thread away.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "pyxccl.h"

#include <stdlib.h>
#include <string.h>

#define EXPLAIN_MAX      32          /* more than any collective has algorithms            */
#define DRAIN_BATCH      256         /* events copied out of the engine per call           */
#define DUMP_FIRST_BYTES (16 * 1024) /* flight_dump's first buffer; doubled while too small */
#define DUMP_MAX_BYTES   (4 * 1024 * 1024)

/* ---------------------------------------------------------------------------------------------
 * Module functions
 * ------------------------------------------------------------------------------------------- */

/* Reads `model`, None or a sequence of three floats (alpha s, beta s/byte, gamma s/byte),
 * into out[3]. Returns 1 when given, 0 for None, -1 with TypeError/ValueError set. */
static int parse_model(PyObject *model, double out[3])
{
    PyObject *seq;

    if (model == Py_None) return 0;
    seq = PySequence_Fast(model, "explain: model must be (alpha, beta, gamma) or None");
    if (seq == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != 3) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError,
                        "explain: model must hold three numbers (alpha, beta, gamma)");
        return -1;
    }
    for (int i = 0; i < 3; i++) {
        out[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
        if (out[i] == -1.0 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        if (!(out[i] >= 0.0)) { /* also rejects NaN */
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "explain: model coefficients must be >= 0");
            return -1;
        }
    }
    Py_DECREF(seq);
    return 1;
}

static PyObject *algo_info_dict(const xccl_algo_info_t *a)
{
    return Py_BuildValue("{s:s,s:s,s:d,s:d,s:d,s:d,s:d,s:O,s:O,s:s}", "name", a->name, "summary",
                         a->summary, "steps", a->steps, "bytes", a->bytes, "reduce_bytes",
                         a->reduce_bytes, "copy_bytes", a->copy_bytes, "predicted_s",
                         a->predicted_s, "applicable", a->applicable ? Py_True : Py_False, "chosen",
                         a->chosen ? Py_True : Py_False, "source", a->source);
}

/* A list of algo_info_dict, one per entry of info[0..n). */
static PyObject *algo_info_list(const xccl_algo_info_t *info, int n)
{
    PyObject *list = PyList_New(n);

    for (int i = 0; list != NULL && i < n; i++) {
        PyObject *d = algo_info_dict(&info[i]);
        if (d == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, d);
    }
    return list;
}

PyObject *xccl_py_explain(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char     *kwlist[] = {"coll", "nbytes", "size", "model", NULL};
    xccl_py_state_t *state    = PyModule_GetState(module);
    const char      *coll;
    Py_ssize_t       nbytes;
    int              size, n = 0, given;
    PyObject        *model_obj = Py_None;
    double           model[3];
    xccl_algo_info_t info[EXPLAIN_MAX];
    xccl_status_t    st;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sni|O:explain", kwlist, &coll, &nbytes, &size,
                                     &model_obj))
        return NULL;
    if (nbytes < 0) {
        PyErr_Format(PyExc_ValueError, "explain: nbytes must be >= 0, got %zd", nbytes);
        return NULL;
    }
    if (size < 1) {
        PyErr_Format(PyExc_ValueError, "explain: size must be >= 1, got %d", size);
        return NULL;
    }
    if ((given = parse_model(model_obj, model)) < 0) return NULL;
    st = xccl_explain(coll, (size_t)nbytes, size, given ? model : NULL, info, EXPLAIN_MAX, &n);
    if (st != XCCL_OK) return xccl_py_raise_last(state, st);
    return algo_info_list(info, n);
}

PyObject *xccl_py_default_model(PyObject *module, PyObject *unused)
{
    double m[3];

    (void)module;
    (void)unused;
    xccl_default_model(m);
    return Py_BuildValue("(ddd)", m[0], m[1], m[2]);
}

/* ---------------------------------------------------------------------------------------------
 * Comm methods
 * ------------------------------------------------------------------------------------------- */

/* The live communicator, or NULL with XcclError raised (as the other Comm methods do). */
static xccl_comm_t *live(PyObject *self, const char *opname)
{
    xccl_py_comm_t *c = (xccl_py_comm_t *)self;

    if (c->comm != NULL) return c->comm;
    xccl_py_raise_fmt(xccl_py_state_of(self), XCCL_ERR_INVALID_USAGE,
                      "%s: the communicator was destroyed", opname);
    return NULL;
}

PyObject *xccl_py_comm_trace(PyObject *self, PyObject *arg)
{
    Py_ssize_t    capacity;
    xccl_comm_t  *comm;
    xccl_status_t st;

    capacity = PyNumber_AsSsize_t(arg, PyExc_OverflowError);
    if (capacity == -1 && PyErr_Occurred()) return NULL;
    if (capacity < 0) {
        PyErr_Format(PyExc_ValueError, "trace: capacity must be >= 0 (0 stops), got %zd",
                     capacity);
        return NULL;
    }
    if ((comm = live(self, "trace")) == NULL) return NULL;
    st = xccl_comm_trace(comm, (size_t)capacity);
    if (st != XCCL_OK) return xccl_py_raise_last(xccl_py_state_of(self), st);
    Py_RETURN_NONE;
}

static const char *kind_name(int32_t kind)
{
    switch (kind) {
    case XCCL_TRACE_SEND: return "send";
    case XCCL_TRACE_RECV: return "recv";
    case XCCL_TRACE_REDUCE: return "reduce";
    default: return "?";
    }
}

/* The buffer an event's offset refers to; NULL (None) when the engine could not tell. */
static const char *buf_name(int32_t buf)
{
    switch (buf) {
    case 0: return "send";
    case 1: return "recv";
    case 2: return "scratch";
    default: return NULL;
    }
}

static PyObject *event_dict(const xccl_trace_event_t *e)
{
    const char *buf = buf_name(e->buf);

    return Py_BuildValue("{s:K,s:I,s:s,s:i,s:i,s:z,s:K,s:K,s:K,s:K,s:s,s:s,s:s}", "seq",
                         (unsigned long long)e->seq, "step", (unsigned int)e->step, "kind",
                         kind_name(e->kind), "src", (int)e->src, "dst", (int)e->dst, "buf", buf,
                         "offset", (unsigned long long)e->offset, "nbytes",
                         (unsigned long long)e->nbytes, "start_ns",
                         (unsigned long long)e->t_start_ns, "end_ns",
                         (unsigned long long)e->t_end_ns, "op", e->op, "algo", e->algo,
                         "transport", e->transport);
}

PyObject *xccl_py_comm_trace_drain(PyObject *self, PyObject *unused)
{
    xccl_trace_event_t *ev;
    xccl_comm_t        *comm;
    PyObject           *list;
    size_t              n;

    (void)unused;
    if ((comm = live(self, "trace_drain")) == NULL) return NULL;
    if ((list = PyList_New(0)) == NULL) return NULL;
    ev = PyMem_Malloc(DRAIN_BATCH * sizeof(*ev));
    if (ev == NULL) {
        Py_DECREF(list);
        return PyErr_NoMemory();
    }
    do {
        n = xccl_comm_trace_drain(comm, ev, DRAIN_BATCH);
        for (size_t i = 0; i < n; i++) {
            PyObject *d = event_dict(&ev[i]);
            if (d == NULL || PyList_Append(list, d) < 0) {
                /* the events drained so far are lost: tracing is best effort */
                Py_XDECREF(d);
                Py_DECREF(list);
                PyMem_Free(ev);
                return NULL;
            }
            Py_DECREF(d);
        }
    } while (n == DRAIN_BATCH);
    PyMem_Free(ev);
    return list;
}

PyObject *xccl_py_comm_trace_dropped(PyObject *self, PyObject *unused)
{
    xccl_comm_t *comm;

    (void)unused;
    if ((comm = live(self, "trace_dropped")) == NULL) return NULL;
    return PyLong_FromUnsignedLongLong(xccl_comm_trace_dropped(comm));
}

PyObject *xccl_py_comm_flight_dump(PyObject *self, PyObject *unused)
{
    xccl_comm_t *comm;
    size_t       cap = DUMP_FIRST_BYTES, n;
    char        *buf;
    PyObject    *text;

    (void)unused;
    if ((comm = live(self, "flight_dump")) == NULL) return NULL;
    for (;;) {
        if ((buf = PyMem_Malloc(cap)) == NULL) return PyErr_NoMemory();
        n = xccl_comm_flight_dump(comm, buf, cap);
        if (n < cap - 1 || cap >= DUMP_MAX_BYTES) break; /* fitted, or as much as we show */
        PyMem_Free(buf);
        cap *= 2;
    }
    text = PyUnicode_DecodeUTF8(buf, (Py_ssize_t)n, "replace");
    PyMem_Free(buf);
    return text;
}

/* diag_table(wait): the rows of every member, asked now (the GIL is released while answers
 * come in, for up to `wait` seconds). */
PyObject *xccl_py_comm_diag_table(PyObject *self, PyObject *arg)
{
    enum { DIAG_BYTES = 64 * 1024 };
    xccl_comm_t *comm;
    double       wait = PyFloat_AsDouble(arg);
    char        *buf;
    size_t       n;
    PyObject    *text;

    if (wait == -1.0 && PyErr_Occurred()) return NULL;
    if ((comm = live(self, "diag_table")) == NULL) return NULL;
    if ((buf = PyMem_Malloc(DIAG_BYTES)) == NULL) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    n = xccl_comm_diag_table(comm, wait > 0 ? (int64_t)(wait * 1000.0) : 0, buf, DIAG_BYTES);
    Py_END_ALLOW_THREADS
    text = PyUnicode_DecodeUTF8(buf, (Py_ssize_t)n, "replace");
    PyMem_Free(buf);
    return text;
}

/* cost_model() -> (alpha, beta, gamma, nnodes). */
PyObject *xccl_py_comm_cost_model(PyObject *self, PyObject *unused)
{
    xccl_comm_t *comm;
    double       m[3];
    int          nnodes;

    (void)unused;
    if ((comm = live(self, "cost_model")) == NULL) return NULL;
    xccl_comm_cost_model(comm, m, &nnodes);
    return Py_BuildValue("(dddi)", m[0], m[1], m[2], nnodes);
}

/* choose(collective, nbytes) -> the algorithm name a call would run now. */
PyObject *xccl_py_comm_choose(PyObject *self, PyObject *args)
{
    xccl_comm_t       *comm;
    const char        *coll;
    unsigned long long nbytes;
    char               name[64];

    if (!PyArg_ParseTuple(args, "sK:choose", &coll, &nbytes)) return NULL;
    if ((comm = live(self, "choose")) == NULL) return NULL;
    if (xccl_comm_choose(comm, coll, (size_t)nbytes, name, sizeof(name)) < 0)
        return xccl_py_raise_last(xccl_py_state_of(self), XCCL_ERR_INVALID_ARG);
    return PyUnicode_FromString(name);
}

/* explain(collective, nbytes) -> rows as xccl.explain's, priced for this communicator. */
PyObject *xccl_py_comm_explain(PyObject *self, PyObject *args)
{
    xccl_comm_t       *comm;
    const char        *coll;
    unsigned long long nbytes;
    xccl_algo_info_t   info[EXPLAIN_MAX];
    int                n = 0;
    xccl_status_t      st;

    if (!PyArg_ParseTuple(args, "sK:explain", &coll, &nbytes)) return NULL;
    if ((comm = live(self, "explain")) == NULL) return NULL;
    st = xccl_comm_explain(comm, coll, (size_t)nbytes, info, EXPLAIN_MAX, &n);
    if (st != XCCL_OK) return xccl_py_raise_last(xccl_py_state_of(self), st);
    return algo_info_list(info, n);
}
