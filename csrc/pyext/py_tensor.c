/* SPDX-License-Identifier: Apache-2.0
 *
 * py_tensor.c - the DLPack consumer: turns any object with __dlpack__ (torch tensors, numpy
 * arrays, ...) into (pointer, element count, xccl dtype), owning the producer's managed tensor
 * until the operation using it has completed.
 *
 * Protocol (DLPack Python specification): call __dlpack__(max_version=(1, 1)); a producer too
 * old for that keyword raises TypeError and is asked again without it. The capsule is named
 * "dltensor_versioned" or "dltensor"; renaming it to "used_..." transfers ownership to us, so
 * from then on exactly one call of the tensor's deleter is ours to make (with the GIL held).
 *
 * Fast path: a type that publishes the DLPack 1.x C exchange table (__dlpack_c_exchange_api__,
 * e.g. torch.Tensor) is exported by one C call, managed_tensor_from_py_object_no_sync: the
 * same owning versioned tensor as the capsule route without the producer's Python-level
 * __dlpack__ (torch's costs ~3 us, twice per in-place collective). The producer's Python method
 * also vets what DLPack cannot describe (torch: conjugate/negative views, sparse layouts), so
 * complex tensors and any tensor the table refuses take the capsule route: the checks and
 * messages stay the producer's own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "pyxccl.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "dlpack.h"
#include "dlpack_check.h"

PyObject *xccl_py_device_string(int32_t device_type, int32_t device_id)
{
    char buf[64];

    xccl_dlpack_device_str(device_type, device_id, buf, sizeof(buf));
    return PyUnicode_FromString(buf);
}

void xccl_py_tensor_release(xccl_py_tensor_t *t)
{
    void     *managed = t->managed;
    PyObject *type, *value, *tb;

    if (t->view.obj != NULL) {
        Py_buffer view = t->view;
        t->view.obj    = NULL;
        PyBuffer_Release(&view); /* numpy's release runs no Python code */
    }
    if (managed == NULL) return;
    t->managed = NULL; /* empty first: the deleter may run Python code that re-enters */
    /* The deleter may run Python code (numpy's drops a reference), which must not see an
     * exception that our caller is in the middle of raising. */
    PyErr_Fetch(&type, &value, &tb);
    if (t->versioned) {
        DLManagedTensorVersioned *mv = managed;
        if (mv->deleter != NULL) mv->deleter(mv);
    } else {
        DLManagedTensor *ml = managed;
        if (ml->deleter != NULL) ml->deleter(ml);
    }
    if (PyErr_Occurred()) PyErr_WriteUnraisable(NULL);
    PyErr_Restore(type, value, tb);
}

/* The exchange table of obj's type, or NULL (none, or none of a major version we read). A
 * one-entry cache keyed by the type (held, so its address cannot be reused) makes the common
 * case - the same tensor type call after call - a pointer comparison. GIL held. */
static const DLPackExchangeAPI *exchange_api(PyObject *obj)
{
    static PyTypeObject            *cached_type;
    static const DLPackExchangeAPI *cached_api;
    PyTypeObject                   *type = Py_TYPE(obj);
    const DLPackExchangeAPIHeader  *h    = NULL;
    PyObject                       *cap;

    if (type == cached_type) return cached_api;
    cap = PyObject_GetAttrString((PyObject *)type, DLPACK_EXCHANGE_API_ATTR);
    if (cap != NULL && PyCapsule_IsValid(cap, DLPACK_EXCHANGE_API_CAPSULE))
        h = PyCapsule_GetPointer(cap, DLPACK_EXCHANGE_API_CAPSULE);
    while (h != NULL && h->version.major != XCCL_DLPACK_MAJOR) h = h->prev_api;
    PyErr_Clear();
    Py_XDECREF(cap); /* the table itself lives as long as the producer's module */
    Py_INCREF(type);
    Py_XDECREF(cached_type);
    cached_type = type;
    cached_api  = (const DLPackExchangeAPI *)h;
    if (cached_api != NULL && cached_api->managed_tensor_from_py_object_no_sync == NULL)
        cached_api = NULL;
    return cached_api;
}

/* Exports through the exchange table into t; 0 on success, -1 (no exception set) when the
 * capsule route must be taken instead. */
static int take_exchange(PyObject *obj, xccl_py_tensor_t *t)
{
    const DLPackExchangeAPI  *api = exchange_api(obj);
    DLManagedTensorVersioned *mv  = NULL;

    if (api == NULL) return -1;
    if (api->managed_tensor_from_py_object_no_sync(obj, &mv) != 0 || mv == NULL) {
        PyErr_Clear();
        return -1;
    }
    t->managed   = mv;
    t->versioned = 1;
    if (mv->version.major == XCCL_DLPACK_MAJOR && mv->dl_tensor.dtype.code == kDLComplex) {
        xccl_py_tensor_release(t);
        return -1;
    }
    return 0;
}

/* numpy.ndarray (held) once numpy is imported, else NULL. GIL held. */
static PyTypeObject *ndarray_type(void)
{
    static PyTypeObject *type;
    static PyObject     *name;
    PyObject            *np, *nd;

    if (type != NULL) return type;
    if (name == NULL && (name = PyUnicode_InternFromString("numpy")) == NULL) {
        PyErr_Clear();
        return NULL;
    }
    np = PyImport_GetModule(name);
    if (np == NULL) {
        PyErr_Clear();
        return NULL;
    }
    nd = PyObject_GetAttrString(np, "ndarray");
    Py_DECREF(np);
    if (nd == NULL || !PyType_Check(nd)) {
        Py_XDECREF(nd);
        PyErr_Clear();
        return NULL;
    }
    type = (PyTypeObject *)nd;
    return type;
}

/* The dtype of a buffer-protocol format (native byte order, no prefix), or -1. */
static int dtype_from_format(const char *f, Py_ssize_t itemsize, xccl_dtype_t *out)
{
    if (f == NULL || f[0] == '\0') return -1;
    if (f[0] == 'Z' && f[2] == '\0') { /* complex */
        if (f[1] == 'f' && itemsize == 8) *out = XCCL_COMPLEX64;
        else if (f[1] == 'd' && itemsize == 16) *out = XCCL_COMPLEX128;
        else return -1;
        return 0;
    }
    if (f[1] != '\0') return -1;
    switch (f[0]) {
    case '?': *out = XCCL_BOOL; return itemsize == 1 ? 0 : -1;
    case 'B': *out = XCCL_UINT8; return itemsize == 1 ? 0 : -1;
    case 'b':
    case 'h':
    case 'i':
    case 'l':
    case 'q':
        switch (itemsize) {
        case 1: *out = XCCL_INT8; return 0;
        case 2: *out = XCCL_INT16; return 0;
        case 4: *out = XCCL_INT32; return 0;
        case 8: *out = XCCL_INT64; return 0;
        }
        return -1;
    case 'e': *out = XCCL_FLOAT16; return itemsize == 2 ? 0 : -1;
    case 'f': *out = XCCL_FLOAT32; return itemsize == 4 ? 0 : -1;
    case 'd': *out = XCCL_FLOAT64; return itemsize == 8 ? 0 : -1;
    }
    return -1;
}

/* numpy arrays through the buffer protocol, which numpy serves without allocating (its
 * __dlpack__ builds a capsule and a managed tensor on every call). Only an exact
 * numpy.ndarray whose view needs no check the DLPack route would fail: C-contiguous, a
 * native-order dtype xccl handles, writable when `flags` has XCCL_PY_BUF_OUTPUT. Anything
 * else returns -1 (no exception set) and takes the DLPack route, which accepts or rejects it
 * with its messages. */
static int take_buffer(PyObject *obj, int flags, xccl_py_tensor_t *t)
{
    PyTypeObject *nd = ndarray_type();
    int           req = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT;

    if (nd == NULL || Py_TYPE(obj) != nd) return -1;
    if (flags & XCCL_PY_BUF_OUTPUT) req |= PyBUF_WRITABLE;
    if (PyObject_GetBuffer(obj, &t->view, req) != 0) {
        PyErr_Clear();
        t->view.obj = NULL;
        return -1;
    }
    if (t->view.itemsize <= 0 || dtype_from_format(t->view.format, t->view.itemsize, &t->dtype)) {
        PyBuffer_Release(&t->view);
        t->view.obj = NULL;
        return -1;
    }
    t->data        = t->view.len > 0 ? t->view.buf : NULL;
    t->count       = (size_t)(t->view.len / t->view.itemsize);
    t->rows        = t->view.ndim > 0 ? (int64_t)t->view.shape[0] : -1;
    t->read_only   = t->view.readonly;
    t->device_type = kDLCPU;
    t->device_id   = 0;
    return 0;
}

/* The argument named in messages, "all_reduce sendbuf": formatted only when one is raised. */
#define WHAT_FMT     "%s%s%s"
#define WHAT_ARGS(w) (w)->op, (w)->arg[0] ? " " : "", (w)->arg

/* Calls obj.__dlpack__, versioned first. Returns a new reference to the capsule. The method
 * name, the version tuple and the keyword-name tuple are built once (GIL held). */
static PyObject *export_capsule(PyObject *obj, const xccl_py_what_t *what)
{
    static PyObject *name, *version, *kwnames;
    PyObject        *slots[3] = {NULL, obj, NULL}; /* slots[0]: scratch the callee may use */
    PyObject        *cap;

    if (name == NULL) {
        name    = PyUnicode_InternFromString("__dlpack__");
        version = Py_BuildValue("(ii)", XCCL_DLPACK_MAJOR, XCCL_DLPACK_MINOR);
        kwnames = Py_BuildValue("(s)", "max_version");
        if (name == NULL || version == NULL || kwnames == NULL) {
            Py_CLEAR(name);
            Py_CLEAR(version);
            Py_CLEAR(kwnames);
            return NULL;
        }
    }
    slots[2] = version;
    cap = PyObject_VectorcallMethod(name, slots + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, kwnames);
    if (cap == NULL && PyErr_ExceptionMatches(PyExc_AttributeError) &&
        !PyObject_HasAttr(obj, name)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     WHAT_FMT
                     ": expected a tensor or array supporting DLPack (__dlpack__), got %.200s",
                     WHAT_ARGS(what), Py_TYPE(obj)->tp_name);
        return NULL;
    }
    if (cap == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear(); /* a producer predating DLPack 1.0: no max_version keyword */
        cap = PyObject_VectorcallMethod(name, slots + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    return cap;
}

/* Takes the managed tensor out of `cap` by renaming it "used_...". */
static int take_capsule(PyObject *cap, PyObject *obj, const xccl_py_what_t *what,
                        xccl_py_tensor_t *t)
{
    const char *name;
    const char *used;
    void       *managed;

    if (PyCapsule_IsValid(cap, DLPACK_CAPSULE_VERSIONED)) {
        name         = DLPACK_CAPSULE_VERSIONED;
        used         = DLPACK_CAPSULE_USED_VERSIONED;
        t->versioned = 1;
    } else if (PyCapsule_IsValid(cap, DLPACK_CAPSULE_LEGACY)) {
        name         = DLPACK_CAPSULE_LEGACY;
        used         = DLPACK_CAPSULE_USED_LEGACY;
        t->versioned = 0;
    } else {
        PyErr_Format(PyExc_TypeError,
                     WHAT_FMT ": %.200s.__dlpack__() returned %.200s, not an unused DLPack capsule",
                     WHAT_ARGS(what), Py_TYPE(obj)->tp_name, Py_TYPE(cap)->tp_name);
        return -1;
    }
    managed = PyCapsule_GetPointer(cap, name);
    if (managed == NULL) return -1;
    if (PyCapsule_SetName(cap, used) < 0) return -1;
    t->managed = managed;
    return 0;
}

int xccl_py_tensor_acquire(xccl_py_state_t *state, PyObject *obj, int flags,
                           const xccl_py_what_t *what, xccl_py_tensor_t *t)
{
    PyObject       *cap;
    const DLTensor *dl;
    uint64_t              dlflags = 0;
    xccl_dlpack_view_t    view;
    xccl_dlpack_verdict_t verdict;
    char                  msg[512];
    int                   rc;

    memset(t, 0, sizeof(*t));
    if (take_buffer(obj, flags, t) == 0) return 0;
    if (take_exchange(obj, t) < 0) {
        if (flags & XCCL_PY_BUF_NO_CAPSULE) return -1;
        cap = export_capsule(obj, what);
        if (cap == NULL) return -1;
        rc = take_capsule(cap, obj, what, t);
        if (rc < 0) {
            /* The capsule's destructor (the producer's code) must not run with our error set. */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            Py_DECREF(cap);
            PyErr_Restore(type, value, tb);
            return -1;
        }
        Py_DECREF(cap);
    }

    if (t->versioned) {
        DLManagedTensorVersioned *mv = t->managed;
        /* Only the version and the deleter may be read when the major version differs. */
        if (mv->version.major != XCCL_DLPACK_MAJOR) {
            unsigned major = mv->version.major, minor = mv->version.minor;
            xccl_py_tensor_release(t);
            xccl_py_raise_fmt(state, XCCL_ERR_INVALID_ARG,
                              WHAT_FMT ": DLPack version %u.%u is not supported (xccl reads 1.x)",
                              WHAT_ARGS(what), major, minor);
            return -1;
        }
        dl      = &mv->dl_tensor;
        dlflags = mv->flags;
    } else {
        dl = &((DLManagedTensor *)t->managed)->dl_tensor;
    }
    verdict = xccl_dlpack_check(dl, dlflags, (flags & XCCL_PY_BUF_OUTPUT) != 0,
                                (flags & XCCL_PY_BUF_ANY_DEVICE) != 0, &view, msg, sizeof(msg));
    t->device_type = view.device_type;
    t->device_id   = view.device_id;
    t->read_only   = view.read_only;
    switch (verdict) {
    case XCCL_DLPACK_OK: break;
    case XCCL_DLPACK_BAD_DTYPE:
        PyErr_Format(PyExc_TypeError, WHAT_FMT ": %s", WHAT_ARGS(what), msg);
        goto fail;
    case XCCL_DLPACK_BAD_DEVICE:
        xccl_py_raise_fmt(state, XCCL_ERR_NOT_SUPPORTED, WHAT_FMT ": %s", WHAT_ARGS(what), msg);
        goto fail;
    default:
        xccl_py_raise_fmt(state, XCCL_ERR_INVALID_ARG, WHAT_FMT ": %s", WHAT_ARGS(what), msg);
        goto fail;
    }
    t->data  = view.data;
    t->count = view.count;
    t->rows  = view.rows;
    t->dtype = view.dtype;
    return 0;
fail:
    xccl_py_tensor_release(t);
    return -1;
}
