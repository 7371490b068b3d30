/* SPDX-License-Identifier: Apache-2.0
 *
 * py_store.c - xccl._C.Store: the key/value stores of xccl.h, and Store.custom, which adapts
 * any Python object with torch.distributed.Store-like methods (torch's TCPStore, FileStore,
 * HashStore, PrefixStore, or a user class) to xccl_store_ops_t.
 *
 * Every store call runs with the GIL released: it may wait for a key or talk to a server.
 * Store.custom callbacks take the GIL themselves (PyGILState_Ensure), so they work from any
 * thread: the caller's own thread while its GIL is released (e.g. inside xccl_comm_create),
 * or a thread of the engine.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "pyxccl.h"

#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------
 * Store.custom: xccl_store_ops_t over a Python object
 * ------------------------------------------------------------------------------------------- */

/* ctx of a custom store: a strong reference to the Python object, dropped by release(). */
typedef struct custom_ctx {
    PyObject *obj;
} custom_ctx_t;

/* Maps the pending Python exception of a failed callback to a status, records a message for
 * xccl_last_error() and keeps the exception for chaining (xccl_py_raise_last). GIL held.
 * TimeoutError, and any other Exception whose message says "timeout" or "timed out" (torch
 * raises DistStoreError or a plain RuntimeError), become XCCL_ERR_TIMEOUT; a missing method
 * XCCL_ERR_NOT_SUPPORTED; KeyboardInterrupt and the like XCCL_ERR_ABORTED; anything else
 * XCCL_ERR_SYSTEM. */
static xccl_status_t callback_failed(PyObject *obj, const char *method, const char *key,
                                     int missing_method)
{
    PyObject     *type, *value, *tb;
    PyObject     *text = NULL;
    const char   *msg  = NULL;
    xccl_status_t st   = XCCL_ERR_SYSTEM;
    char          buf[1024];

    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL) text = PyObject_Str(value);
    if (text != NULL) msg = PyUnicode_AsUTF8(text);
    if (msg == NULL) {
        PyErr_Clear();
        msg = "";
    }
    if (missing_method) {
        st = XCCL_ERR_NOT_SUPPORTED;
    } else if (PyErr_GivenExceptionMatches(type, PyExc_TimeoutError)) {
        st = XCCL_ERR_TIMEOUT;
    } else if (!PyErr_GivenExceptionMatches(type, PyExc_Exception)) {
        st = XCCL_ERR_ABORTED;
    } else if (strcasestr(msg, "timeout") != NULL || strcasestr(msg, "timed out") != NULL) {
        st = XCCL_ERR_TIMEOUT; /* torch: DistStoreError (TCPStore), RuntimeError (FileStore) */
    }
    snprintf(buf, sizeof(buf), "Store.custom: %s.%s(%s%s%s) raised %s: %s", Py_TYPE(obj)->tp_name,
             method, key ? "'" : "", key ? key : "", key ? "'" : "",
             type != NULL ? ((PyTypeObject *)type)->tp_name : "?", msg);
    Py_XDECREF(text);
    PyErr_Restore(type, value, tb);
    xccl_py_stash_exception();
    return xccl_set_error(st, buf);
}

/* obj.<method>(*args) with the GIL held; NULL and a status in *st on failure. */
static PyObject *call(custom_ctx_t *c, const char *method, const char *key, xccl_status_t *st,
                      const char *fmt, ...)
{
    PyObject *fn = PyObject_GetAttrString(c->obj, method);
    PyObject *args;
    PyObject *res = NULL;
    va_list   ap;

    if (fn == NULL) {
        int missing = PyErr_ExceptionMatches(PyExc_AttributeError);
        *st         = callback_failed(c->obj, method, key, missing);
        return NULL;
    }
    va_start(ap, fmt);
    args = Py_VaBuildValue(fmt, ap);
    va_end(ap);
    if (args != NULL) res = PyObject_CallObject(fn, args);
    Py_XDECREF(args);
    Py_DECREF(fn);
    if (res == NULL) *st = callback_failed(c->obj, method, key, 0);
    return res;
}

/* Copies a bytes-like or str result into malloc'd memory (freed by the C store). */
static xccl_status_t to_value(custom_ctx_t *c, const char *method, const char *key,
                              PyObject *res, void **val, size_t *len)
{
    Py_buffer   view;
    const char *p;
    Py_ssize_t  n;

    if (PyUnicode_Check(res)) {
        if ((p = PyUnicode_AsUTF8AndSize(res, &n)) == NULL)
            return callback_failed(c->obj, method, key, 0);
    } else if (PyObject_GetBuffer(res, &view, PyBUF_SIMPLE) == 0) {
        p = view.buf;
        n = view.len;
    } else {
        PyErr_Format(PyExc_TypeError, "expected bytes, got %.200s", Py_TYPE(res)->tp_name);
        return callback_failed(c->obj, method, key, 0);
    }
    *val = malloc(n > 0 ? (size_t)n : 1);
    if (*val != NULL && n > 0) memcpy(*val, p, (size_t)n);
    *len = (size_t)n;
    if (!PyUnicode_Check(res)) PyBuffer_Release(&view);
    if (*val == NULL) return xccl_set_error(XCCL_ERR_NO_MEMORY, "Store.custom: out of memory");
    return XCCL_OK;
}

/* datetime.timedelta(milliseconds=ms), or NULL with an exception set. */
static PyObject *timedelta_ms(int64_t ms)
{
    PyObject *mod = PyImport_ImportModule("datetime");
    PyObject *td  = NULL;

    if (mod != NULL) td = PyObject_CallMethod(mod, "timedelta", "iiiL", 0, 0, 0, (long long)ms);
    Py_XDECREF(mod);
    return td;
}

static PyObject *key_list(const char *const *keys, size_t nkeys)
{
    PyObject *list = PyList_New((Py_ssize_t)nkeys);

    for (size_t i = 0; list != NULL && i < nkeys; i++) {
        PyObject *k = PyUnicode_FromString(keys[i]);
        if (k == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, (Py_ssize_t)i, k);
    }
    return list;
}

/* The GIL may not be taken once the interpreter is finalizing. */
#define ENTER(c)                                                                                  \
    custom_ctx_t    *c = ctx;                                                                     \
    PyGILState_STATE gil;                                                                         \
    if (xccl_py_finalizing())                                                                     \
        return xccl_set_error(XCCL_ERR_ABORTED, "Store.custom: the interpreter is shutting down"); \
    gil = PyGILState_Ensure()

static xccl_status_t cs_set(void *ctx, const char *key, const void *val, size_t len)
{
    xccl_status_t st = XCCL_OK;
    PyObject     *res;
    ENTER(c);

    res = call(c, "set", key, &st, "(sy#)", key, (const char *)val, (Py_ssize_t)len);
    Py_XDECREF(res);
    PyGILState_Release(gil);
    return st;
}

/* torch's get() waits with the store's own timeout; an explicit one is honoured by waiting
 * for the key first. */
static xccl_status_t wait_keys(custom_ctx_t *c, PyObject *list, int64_t timeout_ms,
                               const char *key)
{
    xccl_status_t st = XCCL_OK;
    PyObject     *td = NULL;
    PyObject     *res;

    if (timeout_ms >= 0 && (td = timedelta_ms(timeout_ms)) == NULL)
        return callback_failed(c->obj, "wait", key, 0);
    if (td != NULL) {
        res = call(c, "wait", key, &st, "(OO)", list, td);
        Py_DECREF(td);
        if (res != NULL || st != XCCL_ERR_SYSTEM || !xccl_py_stash_is(PyExc_TypeError)) {
            Py_XDECREF(res);
            return st;
        }
        st = XCCL_OK; /* wait(keys) without a timeout argument: ask again */
        xccl_py_stash_clear();
    }
    res = call(c, "wait", key, &st, "(O)", list);
    Py_XDECREF(res);
    return st;
}

static xccl_status_t cs_get(void *ctx, const char *key, int64_t timeout_ms, void **val,
                            size_t *len)
{
    xccl_status_t st = XCCL_OK;
    PyObject     *list;
    PyObject     *res;
    ENTER(c);

    list = key_list(&key, 1);
    if (list == NULL) st = callback_failed(c->obj, "get", key, 0);
    if (st == XCCL_OK && timeout_ms >= 0) st = wait_keys(c, list, timeout_ms, key);
    Py_XDECREF(list);
    if (st == XCCL_OK && (res = call(c, "get", key, &st, "(s)", key)) != NULL) {
        st = to_value(c, "get", key, res, val, len);
        Py_DECREF(res);
    }
    PyGILState_Release(gil);
    return st;
}

static xccl_status_t cs_add(void *ctx, const char *key, int64_t delta, int64_t *result)
{
    xccl_status_t st = XCCL_OK;
    PyObject     *res;
    ENTER(c);

    if ((res = call(c, "add", key, &st, "(sL)", key, (long long)delta)) != NULL) {
        long long v = PyLong_AsLongLong(res);
        if (v == -1 && PyErr_Occurred()) st = callback_failed(c->obj, "add", key, 0);
        else *result = v;
        Py_DECREF(res);
    }
    PyGILState_Release(gil);
    return st;
}

static xccl_status_t cs_wait(void *ctx, const char *const *keys, size_t nkeys, int64_t timeout_ms)
{
    xccl_status_t st = XCCL_OK;
    PyObject     *list;
    ENTER(c);

    list = key_list(keys, nkeys);
    if (list == NULL) st = callback_failed(c->obj, "wait", NULL, 0);
    else st = wait_keys(c, list, timeout_ms, nkeys > 0 ? keys[0] : NULL);
    Py_XDECREF(list);
    PyGILState_Release(gil);
    return st;
}

static xccl_status_t cs_check(void *ctx, const char *const *keys, size_t nkeys, int *all_present)
{
    xccl_status_t st = XCCL_OK;
    PyObject     *list;
    PyObject     *res = NULL;
    ENTER(c);

    list = key_list(keys, nkeys);
    if (list == NULL) st = callback_failed(c->obj, "check", NULL, 0);
    else res = call(c, "check", nkeys > 0 ? keys[0] : NULL, &st, "(O)", list);
    if (res != NULL) {
        int b = PyObject_IsTrue(res);
        if (b < 0) st = callback_failed(c->obj, "check", NULL, 0);
        else *all_present = b;
    }
    Py_XDECREF(res);
    Py_XDECREF(list);
    PyGILState_Release(gil);
    return st;
}

static xccl_status_t cs_compare_set(void *ctx, const char *key, const void *expected,
                                    size_t elen, const void *desired, size_t dlen, void **out,
                                    size_t *outlen)
{
    xccl_status_t st = XCCL_OK;
    PyObject     *res;
    ENTER(c);

    res = call(c, "compare_set", key, &st, "(sy#y#)", key, (const char *)expected,
               (Py_ssize_t)elen, (const char *)desired, (Py_ssize_t)dlen);
    if (res != NULL) {
        st = to_value(c, "compare_set", key, res, out, outlen);
        Py_DECREF(res);
    }
    PyGILState_Release(gil);
    return st;
}

static xccl_status_t cs_delete_key(void *ctx, const char *key, int *deleted)
{
    xccl_status_t st = XCCL_OK;
    PyObject     *res;
    ENTER(c);

    if ((res = call(c, "delete_key", key, &st, "(s)", key)) != NULL) {
        int b = PyObject_IsTrue(res);
        if (b < 0) st = callback_failed(c->obj, "delete_key", key, 0);
        else *deleted = b;
        Py_DECREF(res);
    }
    PyGILState_Release(gil);
    return st;
}

static xccl_status_t cs_num_keys(void *ctx, int64_t *n)
{
    xccl_status_t st = XCCL_OK;
    PyObject     *res;
    ENTER(c);

    if ((res = call(c, "num_keys", NULL, &st, "()")) != NULL) {
        long long v = PyLong_AsLongLong(res);
        if (v == -1 && PyErr_Occurred()) st = callback_failed(c->obj, "num_keys", NULL, 0);
        else *n = v;
        Py_DECREF(res);
    }
    PyGILState_Release(gil);
    return st;
}

static void cs_release(void *ctx)
{
    custom_ctx_t    *c = ctx;
    PyGILState_STATE gil;

    if (!xccl_py_finalizing()) { /* at shutdown the object is simply left alone */
        gil = PyGILState_Ensure();
        Py_CLEAR(c->obj);
        PyGILState_Release(gil);
    }
    PyMem_RawFree(c);
}

static const xccl_store_ops_t custom_ops = {
    .set         = cs_set,
    .get         = cs_get,
    .add         = cs_add,
    .wait        = cs_wait,
    .check       = cs_check,
    .compare_set = cs_compare_set,
    .delete_key  = cs_delete_key,
    .num_keys    = cs_num_keys,
    .release     = cs_release,
};

/* ---------------------------------------------------------------------------------------------
 * Factories
 * ------------------------------------------------------------------------------------------- */

/* Wraps a new C store (takes its reference), or raises for a failed create. */
static PyObject *wrap(PyTypeObject *tp, xccl_status_t st, xccl_store_t *store, PyObject *custom)
{
    xccl_py_store_t *self;

    if (st < 0) return xccl_py_raise_last(PyType_GetModuleState(tp), st);
    self = (xccl_py_store_t *)tp->tp_alloc(tp, 0);
    if (self == NULL) {
        xccl_store_release(store);
        return NULL;
    }
    self->store  = store;
    self->custom = Py_XNewRef(custom);
    return (PyObject *)self;
}

static PyObject *store_tcp(PyTypeObject *tp, PyObject *args, PyObject *kwds)
{
    static char  *kwlist[] = {"host",    "port",     "is_master", "world_size", "wait_for_workers",
                              "timeout", "auth_key", NULL};
    const char   *host;
    int           port, is_master, world_size, wait_for_workers;
    PyObject     *timeout_obj;
    Py_buffer     key = {0};
    int64_t       timeout_ms;
    xccl_store_t *store = NULL;
    xccl_status_t st;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "zipipO|z*:tcp", kwlist, &host, &port,
                                     &is_master, &world_size, &wait_for_workers, &timeout_obj,
                                     &key)) {
        return NULL;
    }
    if (xccl_py_seconds_to_ms(timeout_obj, -1, "timeout", &timeout_ms) < 0) {
        PyBuffer_Release(&key);
        return NULL;
    }
    xccl_py_stash_clear();
    Py_BEGIN_ALLOW_THREADS
    st = xccl_store_tcp_create(host, port, is_master, world_size, wait_for_workers, timeout_ms,
                               key.buf, key.buf != NULL ? (size_t)key.len : 0, &store);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&key);
    return wrap(tp, st, store, NULL);
}

static PyObject *store_file(PyTypeObject *tp, PyObject *args, PyObject *kwds)
{
    static char  *kwlist[] = {"path", "world_size", "timeout", NULL};
    PyObject     *path;
    int           world_size;
    PyObject     *timeout_obj;
    int64_t       timeout_ms;
    xccl_store_t *store = NULL;
    xccl_status_t st;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&iO:file", kwlist, PyUnicode_FSConverter,
                                     &path, &world_size, &timeout_obj)) {
        return NULL;
    }
    if (xccl_py_seconds_to_ms(timeout_obj, -1, "timeout", &timeout_ms) < 0) {
        Py_DECREF(path);
        return NULL;
    }
    xccl_py_stash_clear();
    Py_BEGIN_ALLOW_THREADS
    st = xccl_store_file_create(PyBytes_AS_STRING(path), world_size, timeout_ms, &store);
    Py_END_ALLOW_THREADS
    Py_DECREF(path);
    return wrap(tp, st, store, NULL);
}

static PyObject *store_hash(PyTypeObject *tp, PyObject *args, PyObject *kwds)
{
    static char  *kwlist[] = {"timeout", NULL};
    PyObject     *timeout_obj;
    int64_t       timeout_ms;
    xccl_store_t *store = NULL;
    xccl_status_t st;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:hash", kwlist, &timeout_obj)) return NULL;
    if (xccl_py_seconds_to_ms(timeout_obj, -1, "timeout", &timeout_ms) < 0) return NULL;
    xccl_py_stash_clear();
    st = xccl_store_hash_create(timeout_ms, &store);
    return wrap(tp, st, store, NULL);
}

static PyObject *store_prefix(PyTypeObject *tp, PyObject *args, PyObject *kwds)
{
    static char     *kwlist[] = {"prefix", "base", NULL};
    xccl_py_state_t *state    = PyType_GetModuleState(tp);
    const char      *prefix;
    xccl_py_store_t *base;
    xccl_store_t    *store = NULL;
    xccl_status_t    st;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sO!:prefix", kwlist, &prefix, state->store_type,
                                     &base)) {
        return NULL;
    }
    xccl_py_stash_clear();
    st = xccl_store_prefix_create(prefix, base->store, &store); /* retains base->store */
    return wrap(tp, st, store, base->custom);
}

static PyObject *store_custom(PyTypeObject *tp, PyObject *args, PyObject *kwds)
{
    static char  *kwlist[] = {"obj", "timeout", NULL};
    PyObject     *obj;
    PyObject     *timeout_obj;
    int64_t       timeout_ms;
    custom_ctx_t *ctx;
    xccl_store_t *store = NULL;
    xccl_status_t st;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:custom", kwlist, &obj, &timeout_obj))
        return NULL;
    if (xccl_py_seconds_to_ms(timeout_obj, -1, "timeout", &timeout_ms) < 0) return NULL;
    ctx = PyMem_RawMalloc(sizeof(*ctx));
    if (ctx == NULL) return PyErr_NoMemory();
    ctx->obj = Py_NewRef(obj);
    xccl_py_stash_clear();
    st = xccl_store_custom_create(&custom_ops, ctx, timeout_ms, &store);
    if (st < 0) { /* release() is only promised for a store that was created */
        Py_DECREF(ctx->obj);
        PyMem_RawFree(ctx);
    }
    return wrap(tp, st, store, obj);
}

/* ---------------------------------------------------------------------------------------------
 * Methods
 * ------------------------------------------------------------------------------------------- */

static PyObject *raise_store(xccl_py_store_t *self, xccl_status_t st)
{
    return xccl_py_raise_last(xccl_py_state_of((PyObject *)self), st);
}

static PyObject *store_set(xccl_py_store_t *self, PyObject *args, PyObject *kwds)
{
    static char  *kwlist[] = {"key", "value", NULL};
    const char   *key;
    Py_buffer     val;
    xccl_status_t st;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ss*:set", kwlist, &key, &val)) return NULL;
    xccl_py_stash_clear();
    Py_BEGIN_ALLOW_THREADS
    st = xccl_store_set(self->store, key, val.buf, (size_t)val.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&val);
    if (st < 0) return raise_store(self, st);
    Py_RETURN_NONE;
}

/* Takes ownership of a malloc'd value from the C store. */
static PyObject *bytes_from(void *val, size_t len)
{
    PyObject *b = PyBytes_FromStringAndSize(val, (Py_ssize_t)len);

    xccl_free(val);
    return b;
}

static PyObject *store_get(xccl_py_store_t *self, PyObject *args, PyObject *kwds)
{
    static char  *kwlist[] = {"key", "timeout", NULL};
    const char   *key;
    PyObject     *timeout_obj = Py_None;
    int64_t       timeout_ms;
    void         *val = NULL;
    size_t        len = 0;
    xccl_status_t st;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "s|O:get", kwlist, &key, &timeout_obj))
        return NULL;
    if (xccl_py_seconds_to_ms(timeout_obj, -1, "timeout", &timeout_ms) < 0) return NULL;
    xccl_py_stash_clear();
    Py_BEGIN_ALLOW_THREADS
    st = xccl_store_get(self->store, key, timeout_ms, &val, &len);
    Py_END_ALLOW_THREADS
    if (st < 0) return raise_store(self, st);
    return bytes_from(val, len);
}

static PyObject *store_add(xccl_py_store_t *self, PyObject *args, PyObject *kwds)
{
    static char  *kwlist[] = {"key", "delta", NULL};
    const char   *key;
    long long     delta;
    int64_t       result = 0;
    xccl_status_t st;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sL:add", kwlist, &key, &delta)) return NULL;
    xccl_py_stash_clear();
    Py_BEGIN_ALLOW_THREADS
    st = xccl_store_add(self->store, key, (int64_t)delta, &result);
    Py_END_ALLOW_THREADS
    if (st < 0) return raise_store(self, st);
    return PyLong_FromLongLong((long long)result);
}

/* A tuple of str (so that no other thread can change it while the GIL is released) and an
 * array of their UTF-8 forms, which live as long as the tuple. */
typedef struct keys {
    PyObject    *tuple;
    const char **v;
    size_t       n;
} keys_t;

static int keys_get(PyObject *obj, keys_t *k)
{
    memset(k, 0, sizeof(*k));
    if (PyUnicode_Check(obj) || PyBytes_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "keys must be a sequence of str, not a single string");
        return -1;
    }
    if ((k->tuple = PySequence_Tuple(obj)) == NULL) return -1;
    k->n = (size_t)PyTuple_GET_SIZE(k->tuple);
    k->v = PyMem_Calloc(k->n > 0 ? k->n : 1, sizeof(*k->v));
    if (k->v == NULL) {
        Py_CLEAR(k->tuple);
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < k->n; i++) {
        PyObject  *item = PyTuple_GET_ITEM(k->tuple, (Py_ssize_t)i);
        Py_ssize_t len;
        if (!PyUnicode_Check(item)) {
            PyErr_Format(PyExc_TypeError, "keys must be str, got %.200s", Py_TYPE(item)->tp_name);
            goto fail;
        }
        if ((k->v[i] = PyUnicode_AsUTF8AndSize(item, &len)) == NULL) goto fail;
        if ((size_t)len != strlen(k->v[i])) {
            PyErr_SetString(PyExc_ValueError, "embedded null character in a key");
            goto fail;
        }
    }
    return 0;
fail:
    PyMem_Free(k->v);
    Py_CLEAR(k->tuple);
    return -1;
}

static void keys_free(keys_t *k)
{
    PyMem_Free(k->v);
    Py_CLEAR(k->tuple);
}

static PyObject *store_wait(xccl_py_store_t *self, PyObject *args, PyObject *kwds)
{
    static char  *kwlist[] = {"keys", "timeout", NULL};
    PyObject     *keys_obj;
    PyObject     *timeout_obj = Py_None;
    int64_t       timeout_ms;
    keys_t        k;
    xccl_status_t st;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O:wait", kwlist, &keys_obj, &timeout_obj))
        return NULL;
    if (xccl_py_seconds_to_ms(timeout_obj, -1, "timeout", &timeout_ms) < 0) return NULL;
    if (keys_get(keys_obj, &k) < 0) return NULL;
    xccl_py_stash_clear();
    Py_BEGIN_ALLOW_THREADS
    st = xccl_store_wait(self->store, k.v, k.n, timeout_ms);
    Py_END_ALLOW_THREADS
    keys_free(&k);
    if (st < 0) return raise_store(self, st);
    Py_RETURN_NONE;
}

static PyObject *store_check(xccl_py_store_t *self, PyObject *keys_obj)
{
    keys_t        k;
    int           present = 0;
    xccl_status_t st;

    if (keys_get(keys_obj, &k) < 0) return NULL;
    xccl_py_stash_clear();
    Py_BEGIN_ALLOW_THREADS
    st = xccl_store_check(self->store, k.v, k.n, &present);
    Py_END_ALLOW_THREADS
    keys_free(&k);
    if (st < 0) return raise_store(self, st);
    return PyBool_FromLong(present);
}

static PyObject *store_compare_set(xccl_py_store_t *self, PyObject *args, PyObject *kwds)
{
    static char  *kwlist[] = {"key", "expected", "desired", NULL};
    const char   *key;
    Py_buffer     expected, desired;
    void         *out = NULL;
    size_t        outlen = 0;
    xccl_status_t st;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ss*s*:compare_set", kwlist, &key, &expected,
                                     &desired)) {
        return NULL;
    }
    xccl_py_stash_clear();
    Py_BEGIN_ALLOW_THREADS
    st = xccl_store_compare_set(self->store, key, expected.buf, (size_t)expected.len, desired.buf,
                                (size_t)desired.len, &out, &outlen);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&expected);
    PyBuffer_Release(&desired);
    if (st < 0) return raise_store(self, st);
    return bytes_from(out, outlen);
}

static PyObject *store_delete_key(xccl_py_store_t *self, PyObject *arg)
{
    const char   *key;
    Py_ssize_t    len;
    int           deleted = 0;
    xccl_status_t st;

    if (!PyUnicode_Check(arg)) {
        return PyErr_Format(PyExc_TypeError, "delete_key: key must be str, got %.200s",
                            Py_TYPE(arg)->tp_name);
    }
    if ((key = PyUnicode_AsUTF8AndSize(arg, &len)) == NULL) return NULL;
    if ((size_t)len != strlen(key)) {
        PyErr_SetString(PyExc_ValueError, "embedded null character in a key");
        return NULL;
    }
    xccl_py_stash_clear();
    Py_BEGIN_ALLOW_THREADS
    st = xccl_store_delete_key(self->store, key, &deleted);
    Py_END_ALLOW_THREADS
    if (st < 0) return raise_store(self, st);
    return PyBool_FromLong(deleted);
}

static PyObject *store_num_keys(xccl_py_store_t *self, PyObject *unused)
{
    int64_t       n = 0;
    xccl_status_t st;

    (void)unused;
    xccl_py_stash_clear();
    Py_BEGIN_ALLOW_THREADS
    st = xccl_store_num_keys(self->store, &n);
    Py_END_ALLOW_THREADS
    if (st < 0) return raise_store(self, st);
    return PyLong_FromLongLong((long long)n);
}

static PyObject *get_port(xccl_py_store_t *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(xccl_store_tcp_port(self->store));
}

static PyObject *get_timeout(xccl_py_store_t *self, void *closure)
{
    (void)closure;
    return PyFloat_FromDouble((double)xccl_store_get_timeout(self->store) / 1000.0);
}

static int set_timeout(xccl_py_store_t *self, PyObject *value, void *closure)
{
    int64_t ms;

    (void)closure;
    if (value == NULL || value == Py_None) {
        PyErr_SetString(PyExc_TypeError, "Store.timeout must be a number of seconds");
        return -1;
    }
    if (xccl_py_seconds_to_ms(value, -1, "timeout", &ms) < 0) return -1;
    xccl_store_set_timeout(self->store, ms);
    return 0;
}

static int store_traverse(xccl_py_store_t *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->custom);
    return 0;
}

static int store_clear(xccl_py_store_t *self)
{
    Py_CLEAR(self->custom); /* the C store keeps its own reference until release() */
    return 0;
}

static void store_dealloc(xccl_py_store_t *self)
{
    PyTypeObject *tp    = Py_TYPE(self);
    xccl_store_t *store = self->store;

    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->custom);
    self->store = NULL;
    if (store != NULL) {
        /* May stop a TCP store's server thread; a custom store's release() takes the GIL. */
        Py_BEGIN_ALLOW_THREADS
        xccl_store_release(store);
        Py_END_ALLOW_THREADS
    }
    tp->tp_free(self);
    Py_DECREF(tp);
}

#define KW(f) ((PyCFunction)(void (*)(void))(f)), METH_VARARGS | METH_KEYWORDS
#define CLS(f) ((PyCFunction)(void (*)(void))(f)), METH_VARARGS | METH_KEYWORDS | METH_CLASS

static PyMethodDef store_methods[] = {
    {"tcp", CLS(store_tcp),
     "tcp(host, port, is_master, world_size, wait_for_workers, timeout, auth_key=None) -> Store"
     "\n\nA TCP store; the master also runs the server (port 0 picks a free port)."},
    {"file", CLS(store_file), "file(path, world_size, timeout) -> Store in a shared file."},
    {"hash", CLS(store_hash), "hash(timeout) -> in-process Store."},
    {"prefix", CLS(store_prefix), "prefix(prefix, base) -> Store prefixing every key."},
    {"custom", CLS(store_custom),
     "custom(obj, timeout) -> Store over an object with torch.distributed.Store methods."},
    {"set", KW(store_set), "set(key, value): value is bytes or str."},
    {"get", KW(store_get), "get(key, timeout=None) -> bytes, waiting for the key."},
    {"add", KW(store_add), "add(key, delta) -> int"},
    {"wait", KW(store_wait), "wait(keys, timeout=None): until every key exists."},
    {"check", (PyCFunction)store_check, METH_O, "check(keys) -> bool: do all keys exist?"},
    {"compare_set", KW(store_compare_set),
     "compare_set(key, expected, desired) -> bytes (torch semantics)."},
    {"delete_key", (PyCFunction)store_delete_key, METH_O, "delete_key(key) -> bool"},
    {"num_keys", (PyCFunction)store_num_keys, METH_NOARGS, "num_keys() -> int"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef store_getset[] = {
    {"port", (getter)get_port, NULL, "port of a TCP store, -1 for other stores", NULL},
    {"timeout", (getter)get_timeout, (setter)set_timeout, "default timeout in seconds", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot store_slots[] = {
    {Py_tp_doc, "A key/value store. Not constructible directly: use the factory class methods."},
    {Py_tp_dealloc, store_dealloc},
    {Py_tp_traverse, store_traverse},
    {Py_tp_clear, store_clear},
    {Py_tp_methods, store_methods},
    {Py_tp_getset, store_getset},
    {0, NULL},
};

PyType_Spec xccl_py_store_spec = {
    .name      = "xccl._C.Store",
    .basicsize = sizeof(xccl_py_store_t),
    .flags     = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = store_slots,
};
