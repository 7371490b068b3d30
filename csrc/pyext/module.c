/* SPDX-License-Identifier: Apache-2.0
 *
 * module.c - the xccl._C module: multi-phase initialisation, module state, the exception
 * hierarchy with its single status -> exception mapper, and the module-level functions.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "pyxccl.h"

#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>

/* ---------------------------------------------------------------------------------------------
 * Shutdown detection. C threads (the progress thread running completion callbacks, store
 * threads) must not take the GIL once the interpreter is finalizing: in 3.11 a thread doing so
 * is terminated in place, possibly in the middle of xccl code. The flag is set from an atexit
 * hook, which runs before finalization starts, to make that window as small as we can.
 * ------------------------------------------------------------------------------------------- */
static atomic_int shutting_down;

int xccl_py_finalizing(void)
{
    if (atomic_load(&shutting_down)) return 1;
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

static PyObject *mod_atexit(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    atomic_store(&shutting_down, 1);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------------
 * Errors
 * ------------------------------------------------------------------------------------------- */

PyObject *xccl_py_error_new(xccl_py_state_t *state, xccl_status_t st, const char *msg)
{
    PyObject *cls;
    PyObject *text;
    PyObject *exc;
    PyObject *code;
    PyObject *name;
    int       rc;

    switch (st) {
    case XCCL_ERR_INVALID_ARG: cls = PyExc_ValueError; break;
    case XCCL_ERR_NOT_SUPPORTED: cls = PyExc_NotImplementedError; break;
    case XCCL_ERR_NO_MEMORY: cls = PyExc_MemoryError; break;
    case XCCL_ERR_TIMEOUT: cls = state->XcclTimeoutError; break;
    case XCCL_ERR_REMOTE: cls = state->XcclConnectionError; break;
    case XCCL_ERR_MISMATCH: cls = state->XcclMismatchError; break;
    case XCCL_ERR_AUTH: cls = state->XcclAuthError; break;
    default: cls = state->XcclError; break;
    }
    if (msg == NULL || msg[0] == '\0') msg = xccl_status_string(st);
    text = PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "replace");
    if (text == NULL) return NULL;
    exc = PyObject_CallOneArg(cls, text);
    Py_DECREF(text);
    if (exc == NULL) return NULL;
    code = PyLong_FromLong((long)st);
    name = PyUnicode_FromString(xccl_status_string(st));
    rc   = (code == NULL || name == NULL ||
          PyObject_SetAttrString(exc, "status", code) < 0 ||
          PyObject_SetAttrString(exc, "status_name", name) < 0) ? -1 : 0;
    Py_XDECREF(code);
    Py_XDECREF(name);
    if (rc < 0) Py_CLEAR(exc);
    return exc;
}

PyObject *xccl_py_raise(xccl_py_state_t *state, xccl_status_t st, const char *msg)
{
    PyObject *exc = xccl_py_error_new(state, st, msg);

    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

PyObject *xccl_py_raise_fmt(xccl_py_state_t *state, xccl_status_t st, const char *fmt, ...)
{
    va_list     ap;
    PyObject   *text;
    const char *utf8;

    va_start(ap, fmt);
    text = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    if (text == NULL) return NULL;
    utf8 = PyUnicode_AsUTF8(text);
    if (utf8 != NULL) xccl_py_raise(state, st, utf8);
    Py_DECREF(text);
    return NULL;
}

/* The exception of the last failed Store.custom callback in this thread. Only touched with the
 * GIL held; one slot per thread. */
static _Thread_local PyObject *stashed_exc;

void xccl_py_stash_exception(void)
{
    PyObject *type, *value, *tb;

    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL) return;
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    Py_XSETREF(stashed_exc, value);
}

void xccl_py_stash_clear(void) { Py_CLEAR(stashed_exc); }

int xccl_py_stash_is(PyObject *exc_type)
{
    return stashed_exc != NULL && PyErr_GivenExceptionMatches(stashed_exc, exc_type);
}

PyObject *xccl_py_raise_last(xccl_py_state_t *state, xccl_status_t st)
{
    PyObject *cause = stashed_exc;
    PyObject *exc;

    stashed_exc = NULL;
    /* Ctrl-C (or sys.exit) inside a store callback: give the user that, not an XcclError. */
    if (cause != NULL && !PyObject_IsInstance(cause, PyExc_Exception) &&
        PyObject_IsInstance(cause, PyExc_BaseException) == 1) {
        PyErr_SetObject((PyObject *)Py_TYPE(cause), cause);
        Py_DECREF(cause);
        return NULL;
    }
    exc = xccl_py_error_new(state, st, xccl_last_error());
    if (exc == NULL) {
        Py_XDECREF(cause);
        return NULL;
    }
    if (cause != NULL) PyException_SetCause(exc, cause); /* steals cause */
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
}

int xccl_py_seconds_to_ms(PyObject *obj, int64_t none_ms, const char *what, int64_t *out)
{
    double    sec;
    PyObject *conv = NULL;

    if (obj == NULL || obj == Py_None) {
        *out = none_ms;
        return 0;
    }
    if (!PyFloat_Check(obj) && !PyLong_Check(obj) &&
        PyObject_HasAttrString(obj, "total_seconds")) { /* datetime.timedelta */
        conv = PyObject_CallMethod(obj, "total_seconds", NULL);
        if (conv == NULL) return -1;
        obj = conv;
    }
    sec = PyFloat_AsDouble(obj);
    Py_XDECREF(conv);
    if (sec == -1.0 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "%s must be a number of seconds or a timedelta", what);
        return -1;
    }
    if (isnan(sec) || sec < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be >= 0 seconds, got %R", what, obj);
        return -1;
    }
    if (isinf(sec) || sec * 1000.0 >= (double)XCCL_PY_FOREVER_MS) {
        *out = XCCL_PY_FOREVER_MS;
        return 0;
    }
    *out = (int64_t)ceil(sec * 1000.0);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Module functions
 * ------------------------------------------------------------------------------------------- */

static PyObject *mod_status_string(PyObject *module, PyObject *arg)
{
    long st = PyLong_AsLong(arg);

    (void)module;
    if (st == -1 && PyErr_Occurred()) return NULL;
    return PyUnicode_FromString(xccl_status_string((xccl_status_t)st));
}

static PyObject *mod_reduce_isa(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyUnicode_FromString(xccl_reduce_isa());
}

static PyObject *mod_buffer_info(PyObject *module, PyObject *obj)
{
    xccl_py_state_t *state = PyModule_GetState(module);
    xccl_py_what_t   what  = {"buffer_info", ""};
    xccl_py_tensor_t t;
    PyObject        *device;
    PyObject        *res;

    if (xccl_py_tensor_acquire(state, obj, XCCL_PY_BUF_ANY_DEVICE, &what, &t) < 0)
        return NULL;
    device = xccl_py_device_string(t.device_type, t.device_id);
    res    = device == NULL ? NULL
                            : Py_BuildValue("(snOO)", xccl_dtype_name(t.dtype), (Py_ssize_t)t.count,
                                            device, t.read_only ? Py_True : Py_False);
    Py_XDECREF(device);
    xccl_py_tensor_release(&t);
    return res;
}

static PyMethodDef mod_methods[] = {
    {"status_string", mod_status_string, METH_O,
     "status_string(status) -> str: the name of an xccl_status_t (\"XCCL_ERR_TIMEOUT\")."},
    {"reduce_isa", mod_reduce_isa, METH_NOARGS,
     "reduce_isa() -> str: the reduction kernel set chosen at run time (avx512, avx2, generic)."},
    {"buffer_info", mod_buffer_info, METH_O,
     "buffer_info(obj) -> (dtype, count, device, read_only) of a DLPack object.\n\n"
     "Validates like the operations do (dtype, contiguity) but reports the device instead of "
     "rejecting it."},
    {"explain", (PyCFunction)(void (*)(void))xccl_py_explain, METH_VARARGS | METH_KEYWORDS,
     "explain(coll, nbytes, size, model=None) -> list of dicts, one per algorithm of `coll`: "
     "name, summary, steps, bytes, reduce_bytes, predicted_s, applicable, chosen."},
    {"default_model", xccl_py_default_model, METH_NOARGS,
     "default_model() -> (alpha s, beta s/byte, gamma s/byte) of the built-in cost model."},
    {"set_fast_default", (PyCFunction)(void (*)(void))xccl_py_set_fast_default, METH_FASTCALL,
     "set_fast_default(comm, timeout): the default group's Comm and timeout argument that the "
     "fronts (Front) call; comm None: none (the fronts then call their Python function)."},
    {"cuda_info", xccl_py_cuda_info, METH_NOARGS,
     "cuda_info() -> dict: built, loaded, why, archs, header_version, driver_version, "
     "ndevices, device, device_name, compute_capability (loads the driver on first use)."},
    {"cuda_set_device", xccl_py_cuda_set_device, METH_VARARGS,
     "cuda_set_device(i, prefix='cuda.set_device'): the GPU of this process (once; another "
     "index later raises ValueError); `prefix` starts the messages."},
    {"cuda_device", xccl_py_cuda_device_fn, METH_NOARGS,
     "cuda_device() -> int: the GPU of this process, -1 while none is chosen."},
    {"_atexit", mod_atexit, METH_NOARGS, "Internal: marks the interpreter as shutting down."},
    {NULL, NULL, 0, NULL},
};

/* ---------------------------------------------------------------------------------------------
 * Initialisation
 * ------------------------------------------------------------------------------------------- */

/* Creates xccl._C.<name>(bases) with class-level status/status_name defaults (instances made
 * by the mapper override them) and adds it to the module. */
static PyObject *new_error(PyObject *m, const char *name, const char *doc, PyObject *bases,
                           xccl_status_t st)
{
    char      qual[64];
    PyObject *dict = Py_BuildValue("{s:i,s:s}", "status", (int)st, "status_name",
                                   xccl_status_string(st));
    PyObject *cls;

    if (dict == NULL) return NULL;
    snprintf(qual, sizeof(qual), "xccl._C.%s", name);
    cls = PyErr_NewExceptionWithDoc(qual, doc, bases, dict);
    Py_DECREF(dict);
    if (cls == NULL) return NULL;
    if (PyModule_AddObjectRef(m, name, cls) < 0) Py_CLEAR(cls);
    return cls;
}

static int add_errors(PyObject *m, xccl_py_state_t *state)
{
    PyObject *bases;

    state->XcclError = new_error(m, "XcclError",
                                 "An xccl operation failed; .status is the xccl_status_t, "
                                 ".status_name its name.",
                                 PyExc_RuntimeError, XCCL_ERR_INTERNAL);
    if (state->XcclError == NULL) return -1;

    bases = PyTuple_Pack(2, state->XcclError, PyExc_TimeoutError);
    if (bases == NULL) return -1;
    state->XcclTimeoutError = new_error(m, "XcclTimeoutError",
                                        "An operation or store wait passed its deadline.", bases,
                                        XCCL_ERR_TIMEOUT);
    Py_DECREF(bases);
    if (state->XcclTimeoutError == NULL) return -1;

    bases = PyTuple_Pack(2, state->XcclError, PyExc_ConnectionError);
    if (bases == NULL) return -1;
    state->XcclConnectionError = new_error(m, "XcclConnectionError",
                                           "A peer closed its connection or reported a failure "
                                           "(XCCL_ERR_REMOTE); the communicator is unusable.",
                                           bases, XCCL_ERR_REMOTE);
    Py_DECREF(bases);
    if (state->XcclConnectionError == NULL) return -1;

    state->XcclMismatchError = new_error(m, "XcclMismatchError",
                                         "Ranks called different collectives (or with different "
                                         "sizes, roots or ops).",
                                         state->XcclError, XCCL_ERR_MISMATCH);
    if (state->XcclMismatchError == NULL) return -1;
    state->XcclAuthError = new_error(m, "XcclAuthError",
                                     "A peer failed authentication or the handshake.",
                                     state->XcclError, XCCL_ERR_AUTH);
    return state->XcclAuthError == NULL ? -1 : 0;
}

static PyTypeObject *add_type(PyObject *m, PyType_Spec *spec)
{
    PyTypeObject *tp = (PyTypeObject *)PyType_FromModuleAndSpec(m, spec, NULL);

    if (tp == NULL) return NULL;
    if (PyModule_AddType(m, tp) < 0) Py_CLEAR(tp);
    return tp;
}

static int add_constants(PyObject *m)
{
    PyObject *dtypes = PyDict_New();
    PyObject *ops    = PyDict_New();
    PyObject *v;
    int       rc = -1;

    if (dtypes == NULL || ops == NULL) goto out;
    for (int d = 0; d < XCCL_DTYPE_COUNT; d++) {
        v = PyLong_FromLong(d);
        if (v == NULL || PyDict_SetItemString(dtypes, xccl_dtype_name((xccl_dtype_t)d), v) < 0) {
            Py_XDECREF(v);
            goto out;
        }
        Py_DECREF(v);
    }
    for (int op = 0; op < XCCL_OP_COUNT; op++) {
        v = PyLong_FromLong(op);
        if (v == NULL || PyDict_SetItemString(ops, xccl_op_name((xccl_op_t)op), v) < 0) {
            Py_XDECREF(v);
            goto out;
        }
        Py_DECREF(v);
    }
    if (PyModule_AddObjectRef(m, "DTYPES", dtypes) < 0) goto out;
    if (PyModule_AddObjectRef(m, "OPS", ops) < 0) goto out;
    if (PyModule_AddIntConstant(m, "ANY_SOURCE", XCCL_ANY_SOURCE) < 0) goto out;
    v = PyUnicode_FromFormat("%d.%d.%d", XCCL_VERSION_MAJOR, XCCL_VERSION_MINOR,
                             XCCL_VERSION_PATCH);
    if (v == NULL) goto out;
    rc = PyModule_AddObjectRef(m, "__version__", v);
    Py_DECREF(v);
out:
    Py_XDECREF(dtypes);
    Py_XDECREF(ops);
    return rc;
}

static int register_atexit(PyObject *m)
{
    PyObject *atexit = PyImport_ImportModule("atexit");
    PyObject *hook;
    PyObject *res = NULL;

    if (atexit == NULL) return -1;
    hook = PyObject_GetAttrString(m, "_atexit");
    if (hook != NULL) res = PyObject_CallMethod(atexit, "register", "O", hook);
    Py_XDECREF(hook);
    Py_DECREF(atexit);
    if (res == NULL) return -1;
    Py_DECREF(res);
    return 0;
}

static int mod_exec(PyObject *m)
{
    xccl_py_state_t *state = PyModule_GetState(m);
    PyTypeObject    *front;

    if (add_errors(m, state) < 0) return -1;
    if ((state->store_type = add_type(m, &xccl_py_store_spec)) == NULL) return -1;
    if ((state->comm_type = add_type(m, &xccl_py_comm_spec)) == NULL) return -1;
    if ((state->work_type = add_type(m, &xccl_py_work_spec)) == NULL) return -1;
    if ((front = add_type(m, &xccl_py_front_spec)) == NULL) return -1;
    Py_DECREF(front); /* the module holds it; nothing in C needs it */
    if (add_constants(m) < 0) return -1;
    return register_atexit(m);
}

static int mod_traverse(PyObject *m, visitproc visit, void *arg)
{
    xccl_py_state_t *state = PyModule_GetState(m);

    if (state == NULL) return 0;
    Py_VISIT(state->store_type);
    Py_VISIT(state->comm_type);
    Py_VISIT(state->work_type);
    Py_VISIT(state->XcclError);
    Py_VISIT(state->XcclTimeoutError);
    Py_VISIT(state->XcclConnectionError);
    Py_VISIT(state->XcclMismatchError);
    Py_VISIT(state->XcclAuthError);
    Py_VISIT(state->fast_comm);
    Py_VISIT(state->fast_timeout);
    return 0;
}

static int mod_clear(PyObject *m)
{
    xccl_py_state_t *state = PyModule_GetState(m);

    if (state == NULL) return 0;
    Py_CLEAR(state->store_type);
    Py_CLEAR(state->comm_type);
    Py_CLEAR(state->work_type);
    Py_CLEAR(state->XcclError);
    Py_CLEAR(state->XcclTimeoutError);
    Py_CLEAR(state->XcclConnectionError);
    Py_CLEAR(state->XcclMismatchError);
    Py_CLEAR(state->XcclAuthError);
    Py_CLEAR(state->fast_comm);
    Py_CLEAR(state->fast_timeout);
    return 0;
}

static void mod_free(void *m) { mod_clear((PyObject *)m); }

static PyModuleDef_Slot mod_slots[] = {
    {Py_mod_exec, mod_exec},
#ifdef Py_mod_multiple_interpreters
    /* Transports, the progress thread and the shutdown flag are per process. */
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef mod_def = {
    .m_base     = PyModuleDef_HEAD_INIT,
    .m_name     = "xccl._C",
    .m_doc      = "The C engine of xccl: stores, communicators, operations on DLPack buffers.",
    .m_size     = sizeof(xccl_py_state_t),
    .m_methods  = mod_methods,
    .m_slots    = mod_slots,
    .m_traverse = mod_traverse,
    .m_clear    = mod_clear,
    .m_free     = mod_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&mod_def); }
