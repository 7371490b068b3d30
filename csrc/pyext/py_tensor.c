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

/* Calls obj.__dlpack__, versioned first; with `stream` (NULL: none) also stream=stream. Returns
 * a new reference to the capsule. The method name, the version tuple and the keyword-name
 * tuples are built once (GIL held). */
static PyObject *export_capsule(PyObject *obj, const xccl_py_what_t *what, PyObject *stream)
{
    static PyObject *name, *version, *kwnames, *kwnames_stream, *kw_stream;
    PyObject        *slots[4] = {NULL, obj, NULL, NULL}; /* slots[0]: scratch for the callee */
    PyObject        *cap;

    if (name == NULL) {
        name           = PyUnicode_InternFromString("__dlpack__");
        version        = Py_BuildValue("(ii)", XCCL_DLPACK_MAJOR, XCCL_DLPACK_MINOR);
        kwnames        = Py_BuildValue("(s)", "max_version");
        kwnames_stream = Py_BuildValue("(ss)", "max_version", "stream");
        kw_stream      = Py_BuildValue("(s)", "stream");
        if (name == NULL || version == NULL || kwnames == NULL || kwnames_stream == NULL ||
            kw_stream == NULL) {
            Py_CLEAR(name);
            Py_CLEAR(version);
            Py_CLEAR(kwnames);
            Py_CLEAR(kwnames_stream);
            Py_CLEAR(kw_stream);
            return NULL;
        }
    }
    slots[2] = version;
    slots[3] = stream;
    cap      = PyObject_VectorcallMethod(name, slots + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                         stream != NULL ? kwnames_stream : kwnames);
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
        slots[2] = stream;
        cap      = PyObject_VectorcallMethod(name, slots + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                             stream != NULL ? kw_stream : NULL);
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

/* ---------------------------------------------------------------------------------------------
 * CUDA: the process's GPU and the checks of a CUDA operation's buffers
 * ------------------------------------------------------------------------------------------- */

/* The process's GPU as last read or set here (-2: not read yet). GIL-protected. */
static int process_device = -2;

int xccl_py_cuda_device(void)
{
    int dev = -1;

    if (process_device != -2) return process_device;
    Py_BEGIN_ALLOW_THREADS /* the first call loads the driver */
    {
        xccl_cuda_info_t info;
        xccl_cuda_info(&info);
        dev = info.device;
    }
    Py_END_ALLOW_THREADS
    if (process_device == -2) process_device = dev;
    return process_device;
}

int xccl_py_cuda_use(xccl_py_state_t *state, int device, const char *prefix)
{
    int           cur = xccl_py_cuda_device();
    xccl_status_t st;

    if (cur < 0) {
        Py_BEGIN_ALLOW_THREADS /* loads the driver and retains the primary context */
        st = xccl_cuda_set_device(device);
        Py_END_ALLOW_THREADS
        if (st == XCCL_OK) {
            process_device = device;
            return 0;
        }
        if (st == XCCL_ERR_NOT_SUPPORTED) {
            xccl_cuda_info_t info;
            char             why[512];
            snprintf(why, sizeof(why), "%s", xccl_last_error());
            xccl_cuda_info(&info);
            xccl_py_raise_fmt(state, st, "%s: cuda:%d: CUDA is not usable in this process: %s",
                              prefix, device, info.why[0] ? info.why : why);
            return -1;
        }
        if (st != XCCL_ERR_INVALID_USAGE) {
            xccl_py_raise_fmt(state, st, "%s: cannot use cuda:%d: %s", prefix, device,
                              xccl_last_error());
            return -1;
        }
        /* another thread chose a GPU meanwhile */
        process_device = -2;
        cur            = xccl_py_cuda_device();
    }
    if (cur == device) return 0;
    xccl_py_raise_fmt(state, XCCL_ERR_INVALID_ARG,
                      "%s: cuda:%d, but this process uses cuda:%d (one GPU per process, chosen "
                      "by xccl.cuda.set_device or by the first CUDA tensor it passed)",
                      prefix, device, cur);
    return -1;
}

/* A CUDA operation's buffer: device memory of the process's GPU (choosing it if none was),
 * not managed, not host memory. -1 with the exception set. */
static int cuda_buffer_check(xccl_py_state_t *state, const xccl_py_what_t *what,
                             const xccl_py_tensor_t *t)
{
    char          prefix[128];
    char          dev[64];
    size_t        nbytes = t->count * xccl_dtype_size(t->dtype);
    xccl_status_t st;

    snprintf(prefix, sizeof(prefix), WHAT_FMT, WHAT_ARGS(what));
    xccl_dlpack_device_str(t->device_type, t->device_id, dev, sizeof(dev));
    switch (t->device_type) {
    case kDLCUDA: break;
    case kDLCUDAManaged:
        xccl_py_raise_fmt(state, XCCL_ERR_INVALID_ARG,
                          "%s: managed (unified) memory (%s) is not supported; use device "
                          "memory (torch.empty(..., device='cuda'), cupy.empty)",
                          prefix, dev);
        return -1;
    case kDLCPU:
    case kDLCUDAHost:
        xccl_py_raise_fmt(state, XCCL_ERR_INVALID_ARG,
                          "%s: host memory (%s) in an operation on CUDA memory; the tensors of "
                          "one call must all be CUDA tensors or all host tensors",
                          prefix, dev);
        return -1;
    default:
        xccl_py_raise_fmt(state, XCCL_ERR_NOT_SUPPORTED,
                          "%s: device %s is not supported (xccl moves host and CUDA memory)",
                          prefix, dev);
        return -1;
    }
    if (xccl_py_cuda_use(state, t->device_id, prefix) < 0) return -1;
    if (nbytes == 0) return 0;
    st = xccl_cuda_check_ptr(t->data, nbytes);
    if (st < 0) {
        xccl_py_raise_fmt(state, st, "%s: %s", prefix, xccl_last_error());
        return -1;
    }
    return 0;
}

/* A host operation was handed CUDA memory: -1 with the message. */
static int host_call_cuda_buffer(xccl_py_state_t *state, const xccl_py_what_t *what,
                                 const xccl_py_tensor_t *t)
{
    char dev[64];

    xccl_dlpack_device_str(t->device_type, t->device_id, dev, sizeof(dev));
    xccl_py_raise_fmt(state, XCCL_ERR_INVALID_ARG,
                      WHAT_FMT ": %s memory in an operation on host memory (the tensors of one "
                               "call must all be CUDA tensors or all host tensors; a CUDA "
                               "operation is posted with stream=)",
                      WHAT_ARGS(what), dev);
    return -1;
}

/* Whether obj.__dlpack_device__() names CUDA device or managed memory; a producer without
 * the method, or whose answer cannot be read, counts as CUDA (its tensor is checked after the
 * export). The DLPack protocol passes stream= only for a device with streams (numpy refuses
 * one), so a host tensor in a CUDA call is exported without it, then refused. */
static int on_cuda_device(PyObject *obj)
{
    PyObject *dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
    long      type;

    if (dev == NULL || !PyTuple_Check(dev) || PyTuple_GET_SIZE(dev) != 2) {
        Py_XDECREF(dev);
        PyErr_Clear();
        return 1;
    }
    type = PyLong_AsLong(PyTuple_GET_ITEM(dev, 0));
    Py_DECREF(dev);
    if (type == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    return type == kDLCUDA || type == kDLCUDAManaged;
}

static int acquire(xccl_py_state_t *state, PyObject *obj, int flags, const xccl_py_what_t *what,
                   PyObject *stream, xccl_py_tensor_t *t)
{
    PyObject       *cap;
    const DLTensor *dl;
    uint64_t              dlflags = 0;
    xccl_dlpack_view_t    view;
    xccl_dlpack_verdict_t verdict;
    char                  msg[512];
    int                   rc;
    const int             cuda = (flags & XCCL_PY_BUF_CUDA) != 0;

    memset(t, 0, sizeof(*t));
    /* a CUDA operation takes the capsule route only: the exchange table does not synchronise
     * with a stream, __dlpack__(stream=) does */
    if (!cuda && take_buffer(obj, flags, t) == 0) return 0;
    if (cuda || take_exchange(obj, t) < 0) {
        if (flags & XCCL_PY_BUF_NO_CAPSULE) return -1;
        if (stream != NULL && !on_cuda_device(obj)) stream = NULL;
        cap = export_capsule(obj, what, stream);
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
                                cuda || (flags & XCCL_PY_BUF_ANY_DEVICE) != 0, &view, msg,
                                sizeof(msg));
    t->device_type = view.device_type;
    t->device_id   = view.device_id;
    t->read_only   = view.read_only;
    switch (verdict) {
    case XCCL_DLPACK_OK: break;
    case XCCL_DLPACK_BAD_DTYPE:
        PyErr_Format(PyExc_TypeError, WHAT_FMT ": %s", WHAT_ARGS(what), msg);
        goto fail;
    case XCCL_DLPACK_BAD_DEVICE:
        /* a one-call path (NO_CAPSULE) declines a CUDA tensor quietly: the general path
         * takes it (or says why not); building the message here would be thrown away */
        if ((flags & XCCL_PY_BUF_NO_CAPSULE) &&
            (t->device_type == kDLCUDA || t->device_type == kDLCUDAManaged))
            goto fail;
        if (t->device_type == kDLCUDA || t->device_type == kDLCUDAManaged) {
            host_call_cuda_buffer(state, what, t);
            goto fail;
        }
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
    if (cuda && cuda_buffer_check(state, what, t) < 0) goto fail;
    return 0;
fail:
    xccl_py_tensor_release(t);
    return -1;
}

int xccl_py_tensor_acquire(xccl_py_state_t *state, PyObject *obj, int flags,
                           const xccl_py_what_t *what, xccl_py_tensor_t *t)
{
    return acquire(state, obj, flags & ~XCCL_PY_BUF_CUDA, what, NULL, t);
}

int xccl_py_tensor_acquire_cuda(xccl_py_state_t *state, PyObject *obj, int flags,
                                const xccl_py_what_t *what, unsigned long long stream,
                                xccl_py_tensor_t *t)
{
    /* DLPack names the legacy default stream 1 (0 is not allowed for CUDA) */
    PyObject *s = PyLong_FromUnsignedLongLong(stream == 0 ? 1 : stream);
    int       rc;

    if (s == NULL) {
        memset(t, 0, sizeof(*t));
        return -1;
    }
    rc = acquire(state, obj, (flags | XCCL_PY_BUF_CUDA) & ~XCCL_PY_BUF_NO_CAPSULE, what, s, t);
    Py_DECREF(s);
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * Module functions: cuda_info(), cuda_set_device(i), cuda_device()
 * ------------------------------------------------------------------------------------------- */

/* "sm_75 sm_80 compute_90" -> ["sm_75", "sm_80", "compute_90"] */
static PyObject *split_words(const char *s)
{
    PyObject *text = PyUnicode_FromString(s);
    PyObject *res;

    if (text == NULL) return NULL;
    res = PyUnicode_Split(text, NULL, -1);
    Py_DECREF(text);
    return res;
}

PyObject *xccl_py_cuda_info(PyObject *module, PyObject *unused)
{
    xccl_cuda_info_t info;
    PyObject        *archs, *cc, *res;

    (void)module;
    (void)unused;
    memset(&info, 0, sizeof(info));
    Py_BEGIN_ALLOW_THREADS /* the first call loads the driver */
    xccl_cuda_info(&info);
    Py_END_ALLOW_THREADS
    info.why[sizeof(info.why) - 1]                 = '\0';
    info.archs[sizeof(info.archs) - 1]             = '\0';
    info.device_name[sizeof(info.device_name) - 1] = '\0';
    if (info.device >= 0) process_device = info.device;
    archs = split_words(info.archs);
    if (archs == NULL) return NULL;
    if (info.device >= 0) {
        cc = Py_BuildValue("(ii)", info.cc_major, info.cc_minor);
    } else {
        cc = Py_NewRef(Py_None);
    }
    if (cc == NULL) {
        Py_DECREF(archs);
        return NULL;
    }
    res = Py_BuildValue("{s:O,s:O,s:s,s:O,s:i,s:i,s:i,s:i,s:s,s:O}", "built",
                        info.built ? Py_True : Py_False, "loaded",
                        info.loaded ? Py_True : Py_False, "why", info.why, "archs", archs,
                        "header_version", info.header_version, "driver_version",
                        info.driver_version, "ndevices", info.ndevices, "device", info.device,
                        "device_name", info.device_name, "compute_capability", cc);
    Py_DECREF(archs);
    Py_DECREF(cc);
    return res;
}

PyObject *xccl_py_cuda_set_device(PyObject *module, PyObject *args)
{
    xccl_py_state_t *state  = PyModule_GetState(module);
    const char      *prefix = "cuda.set_device";
    PyObject        *arg;
    long             dev;

    if (!PyArg_ParseTuple(args, "O|s:cuda_set_device", &arg, &prefix)) return NULL;
    if (PyBool_Check(arg) || !PyLong_Check(arg)) {
        return PyErr_Format(PyExc_TypeError, "cuda.set_device: expected a device index (int), "
                                             "got %.200s",
                            Py_TYPE(arg)->tp_name);
    }
    dev = PyLong_AsLong(arg);
    if (dev == -1 && PyErr_Occurred()) return NULL;
    if (dev < 0 || dev > INT32_MAX)
        return xccl_py_raise_fmt(state, XCCL_ERR_INVALID_ARG,
                                 "cuda.set_device: device %ld is not a device index", dev);
    if (xccl_py_cuda_use(state, (int)dev, prefix) < 0) return NULL;
    Py_RETURN_NONE;
}

PyObject *xccl_py_cuda_device_fn(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyLong_FromLong(xccl_py_cuda_device());
}
