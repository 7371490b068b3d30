/* SPDX-License-Identifier: Apache-2.0
 *
 * py_work.c - xccl._C.Work: one posted operation, the owner of its DLPack buffers.
 *
 * Buffer lifetime. The Work owns the producers' managed tensors and calls their deleters
 * (GIL held) once the operation is seen complete: by wait(), a poll (is_completed, ...), the
 * completion callback, or deallocation. A Work dropped while its operation is pending does not
 * block: its buffers move to a small heap record that a C completion callback releases, taking
 * the GIL, when the operation ends (dropping an isend handle is common torch usage). During
 * interpreter shutdown nothing is released any more: the memory simply stays valid.
 *
 * Waiting. wait() first waits up to GIL_SPIN_US with the GIL held (an operation finished by
 * then costs no GIL hand-off), then in slices of WAIT_SLICE_MS inside xccl_work_wait with the
 * GIL released, running signal handlers between slices so Ctrl-C interrupts it. The C
 * library allows one waiter per Work: a second Python thread waiting on the same Work only
 * polls. The one-call methods wait the same way, without a Work object unless the operation
 * outlasts the spin (xccl_py_wait_now).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "pyxccl.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#define WAIT_SLICE_MS 100
/* Waits first poll this long with the GIL held: most small operations end within it, and
 * handing the GIL off and back cost an 8-byte all_reduce on 2 ranks about 0.3 us of its
 * 1.2 us (measured on a 2-vCPU VM); other threads lose at most this much. */
#define GIL_SPIN_US 20

_Thread_local int xccl_py_in_callback;

static int64_t mono_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

xccl_py_work_t *xccl_py_work_new(xccl_py_state_t *state)
{
    PyTypeObject *tp = state->work_type;

    return (xccl_py_work_t *)tp->tp_alloc(tp, 0); /* zero-filled, GC-tracked */
}

/* Gives the buffers back to their producers; `vcounts` (alltoallv's counts) may be NULL. */
static void release_buffers(xccl_py_tensor_t *bufs, size_t **vcounts)
{
    for (int i = 0; i < XCCL_PY_WORK_MAX_BUFS; i++) xccl_py_tensor_release(&bufs[i]);
    if (vcounts == NULL) return;
    PyMem_RawFree(*vcounts);
    *vcounts = NULL;
}

/* Records the final status and gives the buffers back to their producers. Idempotent. */
static void settle(xccl_py_work_t *self, xccl_status_t st)
{
    if (self->settled || st == XCCL_INPROGRESS) return;
    self->settled = 1;
    self->status  = st;
    /* Read now: the communicator (which maps the sender's rank) may be destroyed later. */
    self->source = st == XCCL_OK && self->work != NULL ? xccl_work_source(self->work) : -1;
    release_buffers(self->bufs, &self->vcounts);
}

/* Status without blocking; `drive` runs one round of progress unless another thread is
 * inside xccl_work_wait on this Work (the C library wants a single waiter). */
static xccl_status_t poll(xccl_py_work_t *self, int drive)
{
    xccl_status_t st;

    if (self->settled) return self->status;
    if (self->work == NULL) {
        settle(self, XCCL_ERR_INTERNAL);
        return self->status;
    }
    /* The status first: a finished Work must not reach into its (maybe destroyed) comm. */
    st = xccl_work_status(self->work);
    if (st == XCCL_INPROGRESS && drive && !self->driving) st = xccl_work_test(self->work);
    settle(self, st);
    return st;
}

static PyObject *error_of(xccl_py_work_t *self)
{
    return xccl_py_error_new(xccl_py_state_of((PyObject *)self), self->status,
                             self->work != NULL ? xccl_work_error(self->work) : "");
}

static PyObject *raise_error_of(xccl_py_work_t *self)
{
    PyObject *exc = error_of(self);

    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Completion callbacks
 * ------------------------------------------------------------------------------------------- */

/* Calls every fn(work) of `fns`; exceptions are reported as unraisable (there is no caller to
 * give them to on the progress thread, and the immediate case behaves the same way). */
static void run_callbacks(xccl_py_work_t *self, PyObject *fns)
{
    for (Py_ssize_t i = 0; fns != NULL && i < PyList_GET_SIZE(fns); i++) {
        PyObject *fn  = PyList_GET_ITEM(fns, i);
        PyObject *res = PyObject_CallOneArg(fn, (PyObject *)self);

        if (res == NULL) PyErr_WriteUnraisable(fn);
        Py_XDECREF(res);
    }
}

/* C completion callback registered by add_done_callback; holds a reference to the Work. Runs
 * on the completing thread, which may hold no GIL (the progress thread). */
static void work_done(xccl_work_t *w, void *arg)
{
    xccl_py_work_t  *self = arg;
    PyObject        *fns;
    PyGILState_STATE gil;

    if (xccl_py_finalizing()) return; /* leaks the Work: the process is exiting */
    gil = PyGILState_Ensure();
    xccl_py_in_callback++;
    settle(self, xccl_work_status(w));
    fns             = self->callbacks;
    self->callbacks = NULL;
    self->cb_armed  = 0;
    run_callbacks(self, fns);
    Py_XDECREF(fns);
    Py_DECREF(self);
    xccl_py_in_callback--;
    PyGILState_Release(gil);
}

/* Buffers of a Work object freed while its operation was still pending. */
typedef struct orphan {
    xccl_py_tensor_t bufs[XCCL_PY_WORK_MAX_BUFS];
    size_t          *vcounts;
} orphan_t;

static void orphan_done(xccl_work_t *w, void *arg)
{
    orphan_t        *o = arg;
    PyGILState_STATE gil;

    (void)w;
    if (xccl_py_finalizing()) return; /* memory stays valid until exit */
    gil = PyGILState_Ensure();
    xccl_py_in_callback++;
    release_buffers(o->bufs, &o->vcounts);
    PyMem_RawFree(o);
    xccl_py_in_callback--;
    PyGILState_Release(gil);
}

/* Waits, GIL released, until `w` ends (its own timeout bounds this): for buffers that cannot
 * be handed to a completion callback. */
static xccl_status_t wait_out(xccl_work_t *w)
{
    xccl_status_t st;

    Py_BEGIN_ALLOW_THREADS
    do {
        st = xccl_work_wait(w, -1);
    } while (st == XCCL_INPROGRESS);
    Py_END_ALLOW_THREADS
    return st;
}

/* Called from dealloc: makes sure the buffers outlive the operation without blocking. */
static void detach(xccl_py_work_t *self)
{
    orphan_t     *o;
    xccl_status_t st;

    if (self->settled || self->work == NULL) {
        settle(self, XCCL_ERR_INTERNAL);
        return;
    }
    st = xccl_work_status(self->work);
    if (st != XCCL_INPROGRESS) {
        settle(self, st);
        return;
    }
    if (xccl_py_finalizing()) return; /* never release memory an operation may still use */
    o = PyMem_RawMalloc(sizeof(*o));
    if (o != NULL) {
        memcpy(o->bufs, self->bufs, sizeof(o->bufs));
        o->vcounts = self->vcounts;
        if (xccl_work_on_complete(self->work, orphan_done, o) >= 0) {
            memset(self->bufs, 0, sizeof(self->bufs));
            self->vcounts = NULL;
            self->settled = 1;
            return;
        }
        PyMem_RawFree(o);
    }
    /* No way to hand the buffers over: wait for the operation. */
    settle(self, wait_out(self->work));
}

/* ---------------------------------------------------------------------------------------------
 * Methods
 * ------------------------------------------------------------------------------------------- */

/* Slices of xccl_work_wait with the GIL released until the operation ends, the user deadline
 * passes (returns XCCL_INPROGRESS) or a signal handler raises (returns XCCL_OK with an
 * exception set, *interrupted = 1). */
static xccl_status_t wait_slices(xccl_py_work_t *self, int64_t timeout_ms, int *interrupted)
{
    int64_t       deadline = timeout_ms == INT64_MAX ? INT64_MAX : mono_ms() + timeout_ms;
    xccl_status_t st       = XCCL_INPROGRESS;

    for (;;) {
        int64_t slice = WAIT_SLICE_MS;
        int     drive = !self->driving; /* whoever finds no driver becomes it, slice by slice */

        if (deadline != INT64_MAX) {
            int64_t left = deadline - mono_ms();
            if (left <= 0) break;
            if (left < slice) slice = left;
        }
        self->driving |= drive;
        Py_BEGIN_ALLOW_THREADS
        if (drive) {
            st = xccl_work_wait(self->work, slice);
        } else {
            /* Another thread drives this Work; look at its status every millisecond. */
            struct timespec ms = {0, 1000000};
            for (int64_t t = 0; t < slice; t++) {
                st = xccl_work_status(self->work);
                if (st != XCCL_INPROGRESS) break;
                nanosleep(&ms, NULL);
            }
        }
        Py_END_ALLOW_THREADS
        if (drive) self->driving = 0;
        if (st != XCCL_INPROGRESS) break;
        if (PyErr_CheckSignals() < 0) {
            *interrupted = 1;
            break;
        }
    }
    return st;
}

/* Work.wait's body past the spin with the GIL held: slices with the GIL released. Py_True
 * once the operation succeeded; NULL with the operation's error, a timeout (`timeout_obj`
 * names the limit in the message) or an interrupt. */
static PyObject *wait_released(xccl_py_work_t *self, int64_t timeout_ms, PyObject *timeout_obj)
{
    int           interrupted = 0;
    xccl_status_t st          = poll(self, 0);

    if (st == XCCL_INPROGRESS) {
        st = wait_slices(self, timeout_ms, &interrupted);
        if (interrupted) return NULL;
        settle(self, st);
    }
    if (st == XCCL_INPROGRESS) {
        return xccl_py_raise_fmt(xccl_py_state_of((PyObject *)self), XCCL_ERR_TIMEOUT,
                                 "Work.wait: %s (seq %llu) did not complete within %S s; the "
                                 "operation continues",
                                 xccl_work_name(self->work),
                                 (unsigned long long)xccl_work_seq(self->work), timeout_obj);
    }
    if (st < 0) return raise_error_of(self);
    Py_RETURN_TRUE;
}

/* Work.wait's body: up to GIL_SPIN_US with the GIL held, then wait_released. */
static PyObject *wait_for(xccl_py_work_t *self, int64_t timeout_ms, PyObject *timeout_obj)
{
    if (timeout_ms >= XCCL_PY_FOREVER_MS) timeout_ms = INT64_MAX;
    if (poll(self, 0) == XCCL_INPROGRESS && !self->driving)
        settle(self, xccl_work_wait_us(self->work, timeout_ms > 0 ? GIL_SPIN_US : 0));
    return wait_released(self, timeout_ms, timeout_obj);
}

PyObject *xccl_py_wait_now(xccl_py_state_t *state, xccl_work_t *w, xccl_py_tensor_t *bufs,
                           int source)
{
    xccl_py_work_t *self;
    PyObject       *res;
    xccl_status_t   st = xccl_work_wait_us(w, GIL_SPIN_US);

    if (st != XCCL_INPROGRESS) {
        release_buffers(bufs, NULL);
        if (st < 0)
            res = xccl_py_raise(state, st, xccl_work_error(w));
        else
            res = source ? PyLong_FromLong(xccl_work_source(w)) : Py_NewRef(Py_True);
        xccl_work_release(w);
        return res;
    }
    /* Still running: from here on a Work object owns the buffers and the operation. */
    self = xccl_py_work_new(state);
    if (self == NULL) {
        PyObject *type, *value, *tb;

        PyErr_Fetch(&type, &value, &tb);
        (void)wait_out(w); /* the buffers must outlive the operation */
        release_buffers(bufs, NULL);
        xccl_work_release(w);
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    memcpy(self->bufs, bufs, sizeof(self->bufs));
    self->work = w;
    res        = wait_released(self, INT64_MAX, Py_None);
    if (res != NULL && source) Py_SETREF(res, PyLong_FromLong(self->source));
    Py_DECREF(self);
    return res;
}

static PyObject *work_wait(xccl_py_work_t *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[]    = {"timeout", NULL};
    PyObject    *timeout_obj = Py_None;
    int64_t      timeout_ms;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:wait", kwlist, &timeout_obj)) return NULL;
    if (xccl_py_seconds_to_ms(timeout_obj, INT64_MAX, "timeout", &timeout_ms) < 0) return NULL;
    return wait_for(self, timeout_ms, timeout_obj);
}

/* Work.wait_stream(stream): makes CUstream `stream` (0 or 1: the legacy default stream) wait
 * for an operation on CUDA memory (xccl_work_wait_stream, GIL released: it takes the context's
 * lock); raises the operation's error when it has failed by then. */
static PyObject *work_wait_stream(xccl_py_work_t *self, PyObject *arg)
{
    xccl_py_state_t   *state = xccl_py_state_of((PyObject *)self);
    unsigned long long v;
    xccl_status_t      st;

    if (PyBool_Check(arg) || !PyLong_Check(arg)) {
        return PyErr_Format(PyExc_TypeError,
                            "Work.wait_stream: expected a CUstream handle (int), got %.200s",
                            Py_TYPE(arg)->tp_name);
    }
    v = PyLong_AsUnsignedLongLong(arg);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return xccl_py_raise_fmt(state, XCCL_ERR_INVALID_ARG,
                                 "Work.wait_stream: %R is not a CUstream handle (an int in "
                                 "[0, 2**64))",
                                 arg);
    }
    if (!self->cuda) {
        return xccl_py_raise(state, XCCL_ERR_INVALID_USAGE,
                             "Work.wait_stream: the operation is on host memory (no stream to "
                             "order)");
    }
    st = poll(self, 0);
    if (st < 0) return raise_error_of(self);
    if (st == XCCL_OK) Py_RETURN_TRUE; /* finished: nothing to wait for */
    if (self->driving) {
        /* another thread waits on it (the C library wants one waiter): wait for its end */
        struct timespec ms = {0, 1000000};

        Py_BEGIN_ALLOW_THREADS
        while ((st = xccl_work_status(self->work)) == XCCL_INPROGRESS)
            nanosleep(&ms, NULL);
        Py_END_ALLOW_THREADS
    } else {
        self->driving = 1;
        Py_BEGIN_ALLOW_THREADS
        st = xccl_work_wait_stream(self->work, v <= 1 ? NULL : (void *)(uintptr_t)v);
        Py_END_ALLOW_THREADS
        self->driving = 0;
    }
    if (st < 0) {
        /* the operation failed meanwhile (its error), or the stream could not be ordered */
        if (poll(self, 0) < 0) return raise_error_of(self);
        return xccl_py_raise_fmt(state, st, "Work.wait_stream: %s", xccl_last_error());
    }
    /* finished meanwhile: its buffers go back now, and a failure is raised (the stream goes
     * on when the gate opens; the communicator is broken, xccl.h Streams) */
    if (poll(self, 0) < 0) return raise_error_of(self);
    Py_RETURN_TRUE;
}

static PyObject *work_is_completed(xccl_py_work_t *self, PyObject *unused)
{
    (void)unused;
    return PyBool_FromLong(poll(self, 1) != XCCL_INPROGRESS);
}

static PyObject *work_is_success(xccl_py_work_t *self, PyObject *unused)
{
    (void)unused;
    return PyBool_FromLong(poll(self, 1) == XCCL_OK);
}

static PyObject *work_exception(xccl_py_work_t *self, PyObject *unused)
{
    (void)unused;
    if (poll(self, 1) >= 0) Py_RETURN_NONE;
    return error_of(self);
}

static PyObject *work_source_rank(xccl_py_work_t *self, PyObject *unused)
{
    (void)unused;
    return PyLong_FromLong(poll(self, 0) == XCCL_OK ? self->source : -1);
}

static PyObject *work_times(xccl_py_work_t *self, PyObject *unused)
{
    uint64_t t[3] = {0, 0, 0};

    (void)unused;
    if (self->work != NULL) xccl_work_times(self->work, &t[0], &t[1], &t[2]);
    /* CLOCK_MONOTONIC nanoseconds: the clock behind time.monotonic() on Linux. */
    return Py_BuildValue("(ddd)", (double)t[0] * 1e-9, (double)t[1] * 1e-9, (double)t[2] * 1e-9);
}

static PyObject *work_add_done_callback(xccl_py_work_t *self, PyObject *fn)
{
    xccl_status_t st;

    if (!PyCallable_Check(fn)) {
        return PyErr_Format(PyExc_TypeError, "add_done_callback: %.200s is not callable",
                            Py_TYPE(fn)->tp_name);
    }
    if (poll(self, 1) != XCCL_INPROGRESS) {
        PyObject *res = PyObject_CallOneArg(fn, (PyObject *)self);
        if (res == NULL) PyErr_WriteUnraisable(fn);
        Py_XDECREF(res);
        Py_RETURN_NONE;
    }
    if (self->callbacks == NULL && (self->callbacks = PyList_New(0)) == NULL) return NULL;
    if (PyList_Append(self->callbacks, fn) < 0) return NULL;
    if (self->cb_armed) Py_RETURN_NONE;
    /* One C callback per Work: registered once, it runs the whole list. It may run right here
     * if the operation completed meanwhile (the GIL is re-entrant for this thread). */
    self->cb_armed = 1;
    Py_INCREF(self);
    st = xccl_work_on_complete(self->work, work_done, self);
    if (st < 0) {
        self->cb_armed = 0;
        Py_CLEAR(self->callbacks);
        Py_DECREF(self);
        return xccl_py_raise_last(xccl_py_state_of((PyObject *)self), st);
    }
    Py_RETURN_NONE;
}

static PyObject *get_name(xccl_py_work_t *self, void *closure)
{
    const char *s = self->work != NULL ? xccl_work_name(self->work) : NULL;

    (void)closure;
    return PyUnicode_FromString(s != NULL ? s : "");
}

static PyObject *get_algo(xccl_py_work_t *self, void *closure)
{
    const char *s = self->work != NULL ? xccl_work_algo(self->work) : NULL;

    (void)closure;
    return PyUnicode_FromString(s != NULL ? s : "");
}

static PyObject *get_seq(xccl_py_work_t *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->work != NULL ? xccl_work_seq(self->work) : 0);
}

static PyObject *get_cuda(xccl_py_work_t *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->cuda);
}

static PyObject *get_nbytes(xccl_py_work_t *self, void *closure)
{
    (void)closure;
    return PyLong_FromSize_t(self->work != NULL ? xccl_work_nbytes(self->work) : 0);
}

static PyObject *work_repr(xccl_py_work_t *self)
{
    const char *state;
    const char *name = self->work != NULL ? xccl_work_name(self->work) : NULL;

    if (!self->settled) state = "pending";
    else if (self->status == XCCL_OK) state = "done";
    else state = xccl_status_string(self->status);
    return PyUnicode_FromFormat("<xccl._C.Work %s seq=%llu %s>", name != NULL ? name : "?",
                                (unsigned long long)(self->work ? xccl_work_seq(self->work) : 0),
                                state);
}

static int work_traverse(xccl_py_work_t *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->callbacks);
    return 0;
}

static int work_clear(xccl_py_work_t *self)
{
    Py_CLEAR(self->callbacks);
    return 0;
}

static void work_dealloc(xccl_py_work_t *self)
{
    PyTypeObject *tp = Py_TYPE(self);

    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->callbacks);
    detach(self);
    if (self->work != NULL) xccl_work_release(self->work);
    self->work = NULL;
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef work_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))work_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(timeout=None) -> True\n\nBlocks (GIL released, Ctrl-C honoured) until the operation "
     "completes. Raises its error on failure, XcclTimeoutError if `timeout` seconds pass first "
     "(the operation itself continues)."},
    {"wait_stream", (PyCFunction)work_wait_stream, METH_O,
     "wait_stream(stream) -> True\n\nAn operation on CUDA memory: CUstream `stream` (an int; 0 "
     "is the legacy default stream) waits for it on the GPU; the CPU does not wait (xccl.cuda, "
     "Streams). Raises the operation's error if it has failed by then."},
    {"is_completed", (PyCFunction)work_is_completed, METH_NOARGS,
     "is_completed() -> bool: True once the operation has finished, successfully or not."},
    {"is_success", (PyCFunction)work_is_success, METH_NOARGS,
     "is_success() -> bool: True once the operation has finished successfully."},
    {"exception", (PyCFunction)work_exception, METH_NOARGS,
     "exception() -> the operation's error as an exception object, or None."},
    {"source_rank", (PyCFunction)work_source_rank, METH_NOARGS,
     "source_rank() -> int: the sender of a completed receive."},
    {"times", (PyCFunction)work_times, METH_NOARGS,
     "times() -> (enqueue, start, end) in time.monotonic() seconds; 0.0 where not reached."},
    {"add_done_callback", (PyCFunction)work_add_done_callback, METH_O,
     "add_done_callback(fn): fn(work) runs once when the operation completes, with the GIL, on "
     "the thread that completes it; at once if already complete."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef work_getset[] = {
    {"name", (getter)get_name, NULL, "operation name (\"all_reduce\", \"send\", ...)", NULL},
    {"algo", (getter)get_algo, NULL, "algorithm that ran (\"p2p\" for point-to-point)", NULL},
    {"seq", (getter)get_seq, NULL, "sequence number on its communicator", NULL},
    {"nbytes", (getter)get_nbytes, NULL, "bytes received (receives)", NULL},
    {"cuda", (getter)get_cuda, NULL, "True for an operation on CUDA memory", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot work_slots[] = {
    {Py_tp_doc, "One posted operation. Keeps its buffers alive until it completes."},
    {Py_tp_dealloc, work_dealloc},
    {Py_tp_traverse, work_traverse},
    {Py_tp_clear, work_clear},
    {Py_tp_repr, work_repr},
    {Py_tp_methods, work_methods},
    {Py_tp_getset, work_getset},
    {0, NULL},
};

PyType_Spec xccl_py_work_spec = {
    .name      = "xccl._C.Work",
    .basicsize = sizeof(xccl_py_work_t),
    .flags     = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = work_slots,
};
