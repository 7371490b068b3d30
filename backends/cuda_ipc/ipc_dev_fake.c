/* SPDX-License-Identifier: Apache-2.0
 *
 * ipc_dev_fake.c - the fake device of the cuda_ipc transport (ipc_dev.h), for tests on
 * machines without a GPU; selected only by the test-only XCCL_CUDA_IPC_FAKE.
 *   - an "allocation" is the page-aligned range around the buffer, its buffer id a hash of
 *     that range (so another range at the same address looks like a reallocation);
 *   - a handle carries (magic, base, size, buffer id); importing checks it and maps nothing:
 *     the peer's address is used as is, with the peer's pid;
 *   - copies and events queue on one stream per process and run in order; a copy from a
 *     peer's memory is a process_vm_readv (EFAULT or a dead peer fail it), and an event
 *     completes (running everything queued before it) on its 2nd to 4th test, so a caller
 *     that uses data before its event completed reads what was there before;
 *   - XCCL_CUDA_IPC_FAKE=stuckcopy: an event recorded after a copy from a peer's memory never
 *     completes by testing (event_wait runs it), to catch a copy in flight with a failure.
 */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "ipc_dev.h"
#include "xccl/xccl_tp_support.h"

#define FAKE_MAGIC 0x46414b4549504331ull /* "FAKEIPC1" */

typedef struct fake_op {
    struct fake_op *next;
    int             is_event;
    /* copy */
    void       *dst;
    const void *src;
    size_t      n;
    int32_t     pid;
    /* event */
    int           tests_left;
    int           done;   /* ran (events: everything before it ran)                 */
    int           freed;  /* the owner gave it back before it ran                    */
    xccl_status_t status; /* of the copies since the previous event                 */
} fake_op_t;

static struct {
    pthread_mutex_t lock;
    fake_op_t      *head, *tail;
    uint64_t        rng;
    xccl_status_t   copy_status; /* first failure of a copy since the last event ran      */
    long            imports, closes;
} fk = {.lock = PTHREAD_MUTEX_INITIALIZER, .rng = 7};

typedef struct fake_handle {
    uint64_t magic, base, size, buf_id;
} fake_handle_t;

int ipc_dev_fake_legacy(void)
{
    const char *v = getenv("XCCL_CUDA_IPC_FAKE");
    return !(v != NULL && strcmp(v, "nolegacy") == 0);
}

static xccl_status_t fake_ptr_info(const void *ptr, size_t n, uint64_t *base, uint64_t *size,
                                   uint64_t *buf_id, int *ipc_ok)
{
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), p = (uint64_t)(uintptr_t)ptr;

    *base = p / page * page;
    *size = (p + n + page - 1) / page * page - *base;
    if (*size == 0) *size = page;
    *buf_id = (*base * 0x9e3779b97f4a7c15ull) ^ (*size * 0xc2b2ae3d27d4eb4full);
    *ipc_ok = ipc_dev_fake_legacy();
    return XCCL_OK;
}

static xccl_status_t fake_export(uint64_t base, uint64_t size, uint64_t buf_id,
                                 uint8_t handle[IPC_HANDLE_BYTES])
{
    fake_handle_t h = {FAKE_MAGIC, base, size, buf_id};

    memset(handle, 0, IPC_HANDLE_BYTES);
    memcpy(handle, &h, sizeof(h));
    return XCCL_OK;
}

static xccl_status_t fake_import(int32_t pid, const uint8_t handle[IPC_HANDLE_BYTES], void **mapped)
{
    fake_handle_t h;

    const char *mode = getenv("XCCL_CUDA_IPC_FAKE");

    if (mode != NULL && strcmp(mode, "noimport") == 0)
        return xccl_error_set(XCCL_ERR_CUDA, "fake IPC: opening handles refused (noimport)");
    memcpy(&h, handle, sizeof(h));
    if (h.magic != FAKE_MAGIC || pid <= 0)
        return xccl_error_set(XCCL_ERR_REMOTE, "fake IPC: not a fake handle");
    __atomic_add_fetch(&fk.imports, 1, __ATOMIC_RELAXED);
    *mapped = (void *)(uintptr_t)h.base;
    return XCCL_OK;
}

static void fake_close(void *mapped)
{
    (void)mapped;
    __atomic_add_fetch(&fk.closes, 1, __ATOMIC_RELAXED);
}

static void fake_push(fake_op_t *o)
{
    if (fk.tail != NULL)
        fk.tail->next = o;
    else
        fk.head = o;
    fk.tail = o;
}

/* Runs the stream up to and including `last` (lock held). */
static void fake_run_until(fake_op_t *last)
{
    while (fk.head != NULL) {
        fake_op_t *o = fk.head;
        fk.head      = o->next;
        if (fk.head == NULL) fk.tail = NULL;
        if (!o->is_event) {
            if (o->pid == 0) {
                memmove(o->dst, o->src, o->n);
            } else {
                struct iovec l = {o->dst, o->n}, r = {(void *)(uintptr_t)o->src, o->n};
                ssize_t      got = o->n ? process_vm_readv(o->pid, &l, 1, &r, 1, 0) : 0;
                if (got != (ssize_t)o->n && fk.copy_status == XCCL_OK)
                    fk.copy_status = xccl_error_set(
                        XCCL_ERR_CUDA, "fake IPC: reading %zu bytes of pid %d failed: %s", o->n,
                        (int)o->pid, got < 0 ? strerror(errno) : "short read");
            }
            free(o);
        } else {
            o->done        = 1;
            o->status      = fk.copy_status;
            fk.copy_status = XCCL_OK;
            if (o->freed) free(o);
        }
        if (o == last) break;
    }
}

static xccl_status_t fake_copy(void *dst, const void *src, size_t n, int32_t src_pid)
{
    fake_op_t *o = calloc(1, sizeof(*o));

    if (o == NULL) return xccl_error_set(XCCL_ERR_NO_MEMORY, "fake IPC: copy");
    o->dst = dst;
    o->src = src;
    o->n   = n;
    o->pid = src_pid;
    pthread_mutex_lock(&fk.lock);
    fake_push(o);
    pthread_mutex_unlock(&fk.lock);
    return XCCL_OK;
}

static xccl_status_t fake_record(void **ev)
{
    fake_op_t *o = calloc(1, sizeof(*o));

    if (o == NULL) return xccl_error_set(XCCL_ERR_NO_MEMORY, "fake IPC: event");
    o->is_event = 1;
    pthread_mutex_lock(&fk.lock);
    fk.rng += 0x9e3779b97f4a7c15ull;
    o->tests_left = 2 + (int)((fk.rng >> 33) % 3);
    /* "stuckcopy": an event after a read of a peer's memory never completes by testing
     * (only event_wait runs it): a copy caught in flight by a failure */
    if (fk.tail != NULL && !fk.tail->is_event && fk.tail->pid != 0 &&
        getenv("XCCL_CUDA_IPC_FAKE") && strcmp(getenv("XCCL_CUDA_IPC_FAKE"), "stuckcopy") == 0)
        o->tests_left = INT_MAX;
    fake_push(o);
    pthread_mutex_unlock(&fk.lock);
    *ev = o;
    return XCCL_OK;
}

static xccl_status_t fake_test(void *ev)
{
    fake_op_t    *o = ev;
    xccl_status_t st;

    pthread_mutex_lock(&fk.lock);
    if (!o->done && --o->tests_left <= 0) fake_run_until(o);
    st = o->done ? o->status : XCCL_INPROGRESS;
    pthread_mutex_unlock(&fk.lock);
    return st;
}

static xccl_status_t fake_wait(void *ev)
{
    fake_op_t    *o = ev;
    xccl_status_t st;

    pthread_mutex_lock(&fk.lock);
    if (!o->done) fake_run_until(o);
    st = o->status;
    pthread_mutex_unlock(&fk.lock);
    return st;
}

static void fake_free(void *ev)
{
    fake_op_t *o = ev;

    if (o == NULL) return;
    pthread_mutex_lock(&fk.lock);
    if (o->done)
        free(o);
    else
        o->freed = 1; /* freed when the stream reaches it */
    pthread_mutex_unlock(&fk.lock);
}

static void *fake_host_alloc(size_t n)
{
    void *p = malloc(n > 0 ? n : 1);
    if (p == NULL) (void)xccl_error_set(XCCL_ERR_NO_MEMORY, "fake IPC: %zu bytes", n);
    return p;
}

const ipc_dev_ops_t ipc_dev_fake = {
    .name          = "fake",
    .ptr_info      = fake_ptr_info,
    .export_handle = fake_export,
    .import_handle = fake_import,
    .close_handle  = fake_close,
    .copy          = fake_copy,
    .event_record  = fake_record,
    .event_test    = fake_test,
    .event_wait    = fake_wait,
    .event_free    = fake_free,
    .host_alloc    = fake_host_alloc,
    .host_free     = free,
};
