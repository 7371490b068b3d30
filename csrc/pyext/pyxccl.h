/* SPDX-License-Identifier: Apache-2.0
 *
 * pyxccl.h - shared declarations of the CPython extension xccl._C: module state, the object
 * layouts of Store / Comm / Work, the DLPack consumer and the status -> exception mapper.
 *
 * The extension uses only the public C API (xccl/xccl.h). Every function here is called with
 * the GIL held unless its comment says otherwise.
 */
#ifndef XCCL_PYEXT_PYXCCL_H
#define XCCL_PYEXT_PYXCCL_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <stdint.h>

#include "xccl/xccl.h"

/* Module state: the heap types and exception classes (no C globals hold Python objects). */
typedef struct xccl_py_state {
    PyTypeObject *store_type;
    PyTypeObject *comm_type;
    PyTypeObject *work_type;
    PyObject     *XcclError;
    PyObject     *XcclTimeoutError;
    PyObject     *XcclConnectionError;
    PyObject     *XcclMismatchError;
    PyObject     *XcclAuthError;
    PyObject     *fast_comm;    /* the default group's Comm for the fronts (py_front.c)  */
    PyObject     *fast_timeout; /* and its timeout argument                              */
} xccl_py_state_t;

/* The types cannot be subclassed, so the module state is reachable from any instance. */
static inline xccl_py_state_t *xccl_py_state_of(PyObject *self)
{
    return (xccl_py_state_t *)PyType_GetModuleState(Py_TYPE(self));
}

/* ---------------------------------------------------------------------------------------------
 * Errors (module.c)
 * ------------------------------------------------------------------------------------------- */

/* The one place a status becomes a Python exception class: INVALID_ARG -> ValueError,
 * NOT_SUPPORTED -> NotImplementedError, NO_MEMORY -> MemoryError, TIMEOUT -> XcclTimeoutError,
 * REMOTE -> XcclConnectionError, MISMATCH -> XcclMismatchError, AUTH -> XcclAuthError, any
 * other error -> XcclError. Returns a new exception instance carrying `.status` and
 * `.status_name`, or NULL with an exception set. */
PyObject *xccl_py_error_new(xccl_py_state_t *state, xccl_status_t st, const char *msg);
/* Raises xccl_py_error_new(state, st, msg); msg NULL or "" falls back to the status name.
 * Always returns NULL. */
PyObject *xccl_py_raise(xccl_py_state_t *state, xccl_status_t st, const char *msg);
/* Same, formatting the message with PyUnicode_FromFormat rules. */
PyObject *xccl_py_raise_fmt(xccl_py_state_t *state, xccl_status_t st, const char *fmt, ...);
/* Raises for a C call that failed in this thread, with xccl_last_error() as the message.
 * When a Store.custom callback failed in this thread during that call, its Python exception
 * becomes __cause__ (or is re-raised as is when it was KeyboardInterrupt/SystemExit). */
PyObject *xccl_py_raise_last(xccl_py_state_t *state, xccl_status_t st);

/* Callback errors: a Store.custom callback that raised stores its exception here (per thread,
 * replacing any earlier one) so that xccl_py_raise_last can chain it. Callers of C functions
 * that may run such callbacks clear it first. */
void xccl_py_stash_exception(void);
void xccl_py_stash_clear(void);
/* Whether the stashed exception is an instance of exc_type. */
int  xccl_py_stash_is(PyObject *exc_type);

/* Timeouts at or above this (about ten years) mean "no deadline"; it is also the largest value
 * handed to the C library, which may add it to a nanosecond clock. */
#define XCCL_PY_FOREVER_MS (INT64_C(10) * 365 * 24 * 3600 * 1000)

/* Seconds (int, float or datetime.timedelta) -> milliseconds. None -> `none_ms`. Negative or
 * NaN -> ValueError; infinity and huge values -> XCCL_PY_FOREVER_MS. Returns 0 or -1 with an
 * exception set. */
int xccl_py_seconds_to_ms(PyObject *obj, int64_t none_ms, const char *what, int64_t *out);

/* True once the interpreter is shutting down (atexit ran, or finalization started): C threads
 * must then no longer take the GIL. */
int xccl_py_finalizing(void);

/* Non-zero while this thread runs a completion callback (py_work.c). Such a thread may be the
 * progress thread or a waiter inside xccl_work_wait: communicators are never destroyed on it. */
extern _Thread_local int xccl_py_in_callback;

/* ---------------------------------------------------------------------------------------------
 * DLPack consumer (py_tensor.c)
 * ------------------------------------------------------------------------------------------- */

/* A buffer taken from a DLPack producer (or, for numpy arrays, through the buffer protocol).
 * Owns the managed tensor or the buffer view until released. */
typedef struct xccl_py_tensor {
    void        *managed;   /* DLManagedTensor or DLManagedTensorVersioned, or NULL         */
    int          versioned; /* which of the two `managed` is                                */
    Py_buffer    view;      /* the buffer-protocol route's view (view.obj NULL: unused)     */
    void        *data;      /* first element (data + byte_offset)                          */
    size_t       count;     /* elements                                                    */
    int64_t      rows;      /* extent of dimension 0; -1 for a 0-d tensor                   */
    xccl_dtype_t dtype;
    int          read_only;
    int32_t      device_type;
    int32_t      device_id;
} xccl_py_tensor_t;

#define XCCL_PY_BUF_OUTPUT     0x1 /* the operation writes into it: reject read-only/copies */
#define XCCL_PY_BUF_ANY_DEVICE 0x2 /* report the device instead of rejecting it            */
#define XCCL_PY_BUF_NO_CAPSULE 0x4 /* only the routes that run no producer code (numpy's
                                    * buffer, the DLPack exchange table): -1 without an
                                    * exception when neither applies, or for CUDA memory */
#define XCCL_PY_BUF_CUDA       0x8 /* a CUDA operation: the buffer must be device memory of
                                    * the process's GPU (see xccl_py_tensor_acquire_cuda) */

/* The argument a message names: op "all_reduce", arg "recvbuf" (arg may be ""). */
typedef struct xccl_py_what {
    const char *op, *arg;
} xccl_py_what_t;

/* Exports `obj` through __dlpack__ (versioned first, legacy on TypeError), takes ownership of
 * the managed tensor and validates device, dtype, contiguity and (with XCCL_PY_BUF_OUTPUT)
 * writability. `what` names the argument in messages ("all_reduce recvbuf"). On failure the
 * tensor is released, *t left empty and -1 returned with an exception set. */
int  xccl_py_tensor_acquire(xccl_py_state_t *state, PyObject *obj, int flags,
                            const xccl_py_what_t *what, xccl_py_tensor_t *t);
/* The same for a CUDA operation ordered after CUstream `stream` (0: the legacy default
 * stream): the producer is asked through __dlpack__(stream=...) (DLPack's value: 1 for the
 * legacy default stream), so that it orders its pending work on the tensor before that
 * stream. The buffer must be CUDA device memory (not managed, not host) of the process's GPU;
 * the first CUDA buffer of a process that chose none chooses it (xccl_cuda_set_device). */
int  xccl_py_tensor_acquire_cuda(xccl_py_state_t *state, PyObject *obj, int flags,
                                 const xccl_py_what_t *what, unsigned long long stream,
                                 xccl_py_tensor_t *t);
/* The GPU of this process (-1: none chosen yet); reads the library once, then a cache that
 * xccl_py_cuda_use and _C.cuda_set_device keep. */
int  xccl_py_cuda_device(void);
/* Makes `device` the process's GPU if none is chosen (GIL released while the driver loads);
 * -1 with an exception naming `prefix` ("all_reduce sendbuf") when that fails or another GPU
 * is the process's already. */
int  xccl_py_cuda_use(xccl_py_state_t *state, int device, const char *prefix);
/* Calls the producer's deleter once (GIL held) and empties *t. Idempotent. */
void xccl_py_tensor_release(xccl_py_tensor_t *t);
/* "cpu", "cuda:0", ... for messages and buffer_info. */
PyObject *xccl_py_device_string(int32_t device_type, int32_t device_id);

/* ---------------------------------------------------------------------------------------------
 * Objects
 * ------------------------------------------------------------------------------------------- */

typedef struct xccl_py_store {
    PyObject_HEAD
    xccl_store_t *store;  /* owned reference                                           */
    PyObject     *custom; /* Store.custom: the wrapped object (also owned by the C ctx) */
} xccl_py_store_t;

typedef struct xccl_py_comm {
    PyObject_HEAD
    xccl_comm_t *comm;   /* NULL once destroyed                                          */
    int          busy;   /* threads using `comm` with the GIL released (abort)           */
    xccl_comm_t *doomed; /* destroyed while busy: freed when the last such thread returns */
    int          rank;
    int          size;
    uint64_t     id;
} xccl_py_comm_t;

#define XCCL_PY_WORK_MAX_BUFS 2

typedef struct xccl_py_work {
    PyObject_HEAD
    xccl_work_t     *work;       /* owned reference; NULL if posting failed             */
    xccl_py_tensor_t bufs[XCCL_PY_WORK_MAX_BUFS]; /* released once the op completed    */
    size_t          *vcounts;    /* alltoallv counts/displacements, PyMem_Raw, or NULL */
    PyObject        *callbacks;  /* list of Python callables, or NULL                  */
    int              cb_armed;   /* the C completion callback holds a reference to us  */
    int              driving;    /* a thread is inside xccl_work_wait (others poll)    */
    int              settled;    /* completion observed: buffers released, status final */
    xccl_status_t    status;     /* final status once settled                          */
    int              source;     /* sender of a successful receive, read when settling */
    int              cuda;       /* an operation on CUDA memory (stream-ordered)        */
} xccl_py_work_t;

extern PyType_Spec xccl_py_store_spec;
extern PyType_Spec xccl_py_comm_spec;
extern PyType_Spec xccl_py_work_spec;
extern PyType_Spec xccl_py_front_spec;

/* A one-call method of Comm (METH_FASTCALL), e.g. allreduce_now (py_comm.c). */
typedef PyObject *(*xccl_py_now_fn)(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* The one-call method `name` ("allreduce_now", ...), or NULL if there is none. */
xccl_py_now_fn xccl_py_comm_now_method(const char *name);
/* _C.set_fast_default(comm, timeout) (py_front.c). */
PyObject *xccl_py_set_fast_default(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* A fresh, empty Work (GIL held). The caller acquires buffers into it, then posts. */
xccl_py_work_t *xccl_py_work_new(xccl_py_state_t *state);
/* A one-call method's wait, without a Work object unless it needs one: waits for `w` (its
 * reference is consumed), whose buffers `bufs` (XCCL_PY_WORK_MAX_BUFS slots) are taken over.
 * An operation that ends within the spin with the GIL held is settled here; one that outlasts
 * it moves into a Work object and is waited for as Work.wait() waits (Ctrl-C, buffers kept
 * alive by the operation if the wait is interrupted). Returns Py_True, or with `source` the
 * sender's rank, or NULL with the operation's error or an interrupt. */
PyObject *xccl_py_wait_now(xccl_py_state_t *state, xccl_work_t *w, xccl_py_tensor_t *bufs,
                           int source);

/* ---------------------------------------------------------------------------------------------
 * Introspection (py_introspect.c): entries of the module and Comm method tables
 * ------------------------------------------------------------------------------------------- */

PyObject *xccl_py_explain(PyObject *module, PyObject *args, PyObject *kwds);
PyObject *xccl_py_default_model(PyObject *module, PyObject *unused);
PyObject *xccl_py_comm_trace(PyObject *self, PyObject *capacity);
PyObject *xccl_py_comm_trace_drain(PyObject *self, PyObject *unused);
PyObject *xccl_py_comm_trace_dropped(PyObject *self, PyObject *unused);
PyObject *xccl_py_comm_flight_dump(PyObject *self, PyObject *unused);
PyObject *xccl_py_comm_cost_model(PyObject *self, PyObject *unused);
PyObject *xccl_py_comm_choose(PyObject *self, PyObject *args);
PyObject *xccl_py_comm_explain(PyObject *self, PyObject *args);
PyObject *xccl_py_comm_diag_table(PyObject *self, PyObject *wait_s);

/* CUDA (py_tensor.c): module functions cuda_info(), cuda_set_device(i, prefix=None),
 * cuda_device() */
PyObject *xccl_py_cuda_info(PyObject *module, PyObject *unused);
PyObject *xccl_py_cuda_set_device(PyObject *module, PyObject *args);
PyObject *xccl_py_cuda_device_fn(PyObject *module, PyObject *unused);

#endif /* XCCL_PYEXT_PYXCCL_H */
