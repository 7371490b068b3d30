/* SPDX-License-Identifier: Apache-2.0
 *
 * py_front.c - xccl._C.Front: the C front of a Python API function whose common call maps
 * onto one of the Comm's one-call methods (allreduce_now, send_now, ...).
 *
 * `xccl.all_reduce(t)` through a Python function costs about 160 ns before the engine is
 * reached (frame set-up, defaults, module and attribute lookups), a sixth of an 8-byte
 * all_reduce on two ranks. A Front is called instead: it binds the arguments against the
 * Python function's own parameter list and defaults, and when the call is the common one (the
 * default group, the defaults where the spec asks for them, the SUM operator) calls the
 * one-call method of the default group's Comm directly. Anything else, and any call the
 * method declines (returns None), goes to the Python function with the arguments as given, so
 * behaviour and error messages are the Python function's. `__wrapped__` is that function, so
 * inspect.signature and help() show its signature and docstring.
 *
 * The spec has one character per parameter of the Python function, in order:
 *   '0'..'3'  the argument (given or default) is argument k of the method
 *   'a'..'d'  an operator that must be the SUM object; argument k of the method gets the
 *             engine's SUM
 *   'n'       must be None
 *   'f'       must be False
 *   'e'       must be None or an empty list or tuple
 * With `timeout`, the default group's timeout argument follows the method's other arguments.
 * The default group (its Comm and timeout argument) is published by set_fast_default; none is
 * published while threads have worlds of their own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <structmember.h>

#include "pyxccl.h"

#include <string.h>

#define FRONT_MAX_PARAMS 8
#define FRONT_MAX_ARGS   4

typedef struct front {
    PyObject_HEAD
    PyObject      *impl;   /* the Python function                                        */
    PyObject      *dict;   /* __wrapped__, __doc__, __name__, ... (update_wrapper)        */
    PyObject      *sum;    /* the SUM operator object ('a'..'d')                         */
    PyObject      *c_sum;  /* the engine's SUM as an int                                 */
    xccl_py_now_fn method; /* the Comm's one-call method                                 */
    PyObject      *names[FRONT_MAX_PARAMS];
    PyObject      *defaults[FRONT_MAX_PARAMS]; /* NULL: required                         */
    char           spec[FRONT_MAX_PARAMS];
    int            nparams, npositional, nargs, timeout;
    vectorcallfunc vectorcall;
} front_t;

/* The method argument role `r` fills ('0'..'3', or 'a'..'d' for an operator), else -1. */
static int role_slot(char r)
{
    if (r >= '0' && r <= '3') return r - '0';
    if (r >= 'a' && r <= 'd') return r - 'a';
    return -1;
}

/* Checks `v` against role `r` and stores what the method gets into out[]; 0: not the common
 * call. */
static int bind_one(const front_t *f, char r, PyObject *v, PyObject **out)
{
    int k = role_slot(r);

    if (k >= 0 && r >= 'a') { /* an operator: only SUM, passed as the engine's */
        if (v != f->sum) return 0;
        out[k] = f->c_sum;
        return 1;
    }
    if (k >= 0) {
        out[k] = v;
        return 1;
    }
    if (r == 'n') return v == Py_None;
    if (r == 'f') return v == Py_False;
    if (r == 'e')
        return v == Py_None || (PyList_CheckExact(v) && PyList_GET_SIZE(v) == 0) ||
               (PyTuple_CheckExact(v) && PyTuple_GET_SIZE(v) == 0);
    return 0;
}

static int int_attr(PyObject *obj, const char *name, int *out)
{
    PyObject *v = PyObject_GetAttrString(obj, name);
    long      l = v != NULL ? PyLong_AsLong(v) : -1;

    Py_XDECREF(v);
    if (l == -1 && PyErr_Occurred()) return -1;
    *out = (int)l;
    return 0;
}

static int param_index(const front_t *f, PyObject *name)
{
    for (int i = 0; i < f->nparams; i++)
        if (f->names[i] == name) return i;
    for (int i = 0; i < f->nparams; i++) {
        int eq = PyUnicode_Compare(f->names[i], name);
        if (eq == 0) return i;
        if (eq == -1 && PyErr_Occurred()) PyErr_Clear();
    }
    return -1;
}

/* The method's arguments for this call into out[]; 0 where the Python function must run. */
static int bind(const front_t *f, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                PyObject **out)
{
    PyObject  *given[FRONT_MAX_PARAMS] = {NULL};
    Py_ssize_t nkw                     = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;

    if (nargs > f->npositional) return 0;
    for (Py_ssize_t i = 0; i < nargs; i++)
        given[i] = args[i];
    for (Py_ssize_t k = 0; k < nkw; k++) {
        int i = param_index(f, PyTuple_GET_ITEM(kwnames, k));
        if (i < 0 || given[i] != NULL) return 0;
        given[i] = args[nargs + k];
    }
    for (int i = 0; i < f->nparams; i++) {
        PyObject *v = given[i] != NULL ? given[i] : f->defaults[i];
        if (v == NULL || !bind_one(f, f->spec[i], v, out)) return 0;
    }
    return 1;
}

static PyObject *front_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                  PyObject *kwnames)
{
    front_t         *f     = (front_t *)self;
    xccl_py_state_t *state = xccl_py_state_of(self);
    Py_ssize_t       nargs = PyVectorcall_NARGS(nargsf);
    PyObject        *margs[FRONT_MAX_ARGS + 1];
    PyObject        *comm, *timeout, *res;

    if (state->fast_comm != NULL && bind(f, args, nargs, kwnames, margs)) {
        /* the method may release the GIL: another thread may unpublish the group meanwhile */
        comm    = Py_NewRef(state->fast_comm);
        timeout = Py_NewRef(state->fast_timeout);
        if (f->timeout) margs[f->nargs] = timeout;
        res = f->method(comm, margs, f->nargs + f->timeout);
        Py_DECREF(timeout);
        Py_DECREF(comm);
        if (res != Py_None) {
            if (res != Py_True) return res; /* NULL (an error) or recv's source rank */
            Py_DECREF(res);
            Py_RETURN_NONE;
        }
        Py_DECREF(res);
    }
    return PyObject_Vectorcall(f->impl, args, nargsf, kwnames);
}

/* Front(impl, method, spec, timeout, sum=None, c_sum=None) */
static PyObject *front_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"impl", "method", "spec", "timeout", "sum", "c_sum", NULL};
    PyObject    *impl, *sum = Py_None, *c_sum = Py_None, *code = NULL, *varnames = NULL;
    PyObject    *defs = NULL, *kwdefs = NULL;
    const char  *method, *spec;
    int          timeout, argc = 0, kwonly = 0, ndefs, uses[FRONT_MAX_ARGS] = {0};
    front_t     *f;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "Ossp|OO:Front", kwlist, &impl, &method, &spec,
                                     &timeout, &sum, &c_sum))
        return NULL;
    if (!PyFunction_Check(impl))
        return PyErr_Format(PyExc_TypeError, "Front: impl must be a function");
    f = (front_t *)type->tp_alloc(type, 0);
    if (f == NULL) return NULL;
    f->impl       = Py_NewRef(impl);
    f->sum        = Py_NewRef(sum);
    f->c_sum      = Py_NewRef(c_sum);
    f->timeout    = timeout;
    f->method     = xccl_py_comm_now_method(method);
    f->vectorcall = front_vectorcall;
    if (f->method == NULL) {
        PyErr_Format(PyExc_ValueError, "Front: Comm has no one-call method %s", method);
        goto fail;
    }
    code     = PyObject_GetAttrString(impl, "__code__");
    varnames = code ? PyObject_GetAttrString(code, "co_varnames") : NULL;
    if (varnames == NULL || int_attr(code, "co_argcount", &argc) < 0 ||
        int_attr(code, "co_kwonlyargcount", &kwonly) < 0)
        goto fail;
    f->nparams     = argc + kwonly;
    f->npositional = argc;
    if ((size_t)f->nparams != strlen(spec) || f->nparams > FRONT_MAX_PARAMS) {
        PyErr_Format(PyExc_ValueError, "Front: spec '%s' does not describe %d parameters", spec,
                     f->nparams);
        goto fail;
    }
    memcpy(f->spec, spec, (size_t)f->nparams);
    for (int i = 0; i < f->nparams; i++) {
        int k = role_slot(spec[i]);

        f->names[i] = Py_NewRef(PyTuple_GET_ITEM(varnames, i));
        if (k < 0 && strchr("nfe", spec[i]) == NULL) {
            PyErr_Format(PyExc_ValueError, "Front: unknown role '%c' in spec '%s'", spec[i], spec);
            goto fail;
        }
        if (k >= 0 && spec[i] >= 'a' && sum == Py_None) {
            PyErr_Format(PyExc_ValueError, "Front: spec '%s' has an operator but no sum", spec);
            goto fail;
        }
        if (k >= 0) uses[k]++;
        if (k + 1 > f->nargs) f->nargs = k + 1;
    }
    for (int k = 0; k < f->nargs; k++) { /* every argument of the method given, once */
        if (uses[k] != 1) {
            PyErr_Format(PyExc_ValueError, "Front: spec '%s' gives argument %d %d times", spec, k,
                         uses[k]);
            goto fail;
        }
    }
    /* the defaults of the last positional parameters, then of the keyword-only ones */
    defs   = PyObject_GetAttrString(impl, "__defaults__");
    kwdefs = defs ? PyObject_GetAttrString(impl, "__kwdefaults__") : NULL;
    if (kwdefs == NULL) goto fail;
    ndefs = defs != Py_None ? (int)PyTuple_GET_SIZE(defs) : 0;
    for (int i = 0; i < ndefs; i++)
        f->defaults[argc - ndefs + i] = Py_NewRef(PyTuple_GET_ITEM(defs, i));
    for (int i = argc; i < f->nparams && kwdefs != Py_None; i++) {
        PyObject *d = PyDict_GetItemWithError(kwdefs, f->names[i]);
        if (d == NULL && PyErr_Occurred()) goto fail;
        f->defaults[i] = Py_XNewRef(d);
    }
    Py_DECREF(code);
    Py_DECREF(varnames);
    Py_DECREF(defs);
    Py_DECREF(kwdefs);
    return (PyObject *)f;
fail:
    Py_XDECREF(code);
    Py_XDECREF(varnames);
    Py_XDECREF(defs);
    Py_XDECREF(kwdefs);
    Py_DECREF(f);
    return NULL;
}

static int front_traverse(front_t *f, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(f));
    Py_VISIT(f->impl);
    Py_VISIT(f->dict);
    Py_VISIT(f->sum);
    Py_VISIT(f->c_sum);
    for (int i = 0; i < FRONT_MAX_PARAMS; i++)
        Py_VISIT(f->defaults[i]);
    return 0;
}

static int front_clear(front_t *f)
{
    Py_CLEAR(f->impl);
    Py_CLEAR(f->dict);
    Py_CLEAR(f->sum);
    Py_CLEAR(f->c_sum);
    for (int i = 0; i < FRONT_MAX_PARAMS; i++) {
        Py_CLEAR(f->names[i]);
        Py_CLEAR(f->defaults[i]);
    }
    return 0;
}

static void front_dealloc(front_t *f)
{
    PyTypeObject *tp = Py_TYPE(f);

    PyObject_GC_UnTrack(f);
    front_clear(f);
    tp->tp_free(f);
    Py_DECREF(tp);
}

/* Bound as a method when stored on a class, like the function it fronts. */
static PyObject *front_get(PyObject *self, PyObject *obj, PyObject *type)
{
    (void)type;
    return obj == NULL || obj == Py_None ? Py_NewRef(self) : PyMethod_New(self, obj);
}

/* Pickled (and copied) by reference, as the function it fronts is. */
static PyObject *front_reduce(front_t *f, PyObject *unused)
{
    (void)unused;
    return PyObject_GetAttrString(f->impl, "__qualname__");
}

static PyMethodDef front_methods[] = {
    {"__reduce__", (PyCFunction)front_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyObject *front_repr(front_t *f)
{
    return PyUnicode_FromFormat("<xccl front of %R>", f->impl);
}

static PyMemberDef front_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(front_t, dict), READONLY, NULL},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(front_t, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef front_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot front_slots[] = {
    {Py_tp_doc, "Front(impl, method, spec, timeout, sum=None, c_sum=None): the C front of a "
                "Python API function (see py_front.c); calls `impl` for anything but the "
                "common call."},
    {Py_tp_new, front_new},
    {Py_tp_dealloc, front_dealloc},
    {Py_tp_traverse, front_traverse},
    {Py_tp_clear, front_clear},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_descr_get, front_get},
    {Py_tp_repr, front_repr},
    {Py_tp_members, front_members},
    {Py_tp_getset, front_getset},
    {Py_tp_methods, front_methods},
    {0, NULL},
};

PyType_Spec xccl_py_front_spec = {
    .name      = "xccl._C.Front",
    .basicsize = sizeof(front_t),
    .flags     = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .slots     = front_slots,
};

/* set_fast_default(comm, timeout): the default group the fronts use (comm None: none). */
PyObject *xccl_py_set_fast_default(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    xccl_py_state_t *state = PyModule_GetState(module);
    PyObject        *old_c = state->fast_comm, *old_t = state->fast_timeout;

    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "set_fast_default(comm, timeout)");
    if (args[0] != Py_None && !PyObject_TypeCheck(args[0], state->comm_type))
        return PyErr_Format(PyExc_TypeError, "set_fast_default: comm must be a Comm or None");
    state->fast_comm    = args[0] != Py_None ? Py_NewRef(args[0]) : NULL;
    state->fast_timeout = args[0] != Py_None ? Py_NewRef(args[1]) : NULL;
    Py_XDECREF(old_c);
    Py_XDECREF(old_t);
    Py_RETURN_NONE;
}
