/* SPDX-License-Identifier: Apache-2.0
 *
 * transport.c - the registry of transports: the built-in ones (the only place that names
 * backends) followed by those added at run time with xccl_transport_register.
 *
 * The list xccl_transport_list returns is NULL-terminated and only grows: a registration
 * stores its entry (release) into the first NULL slot, which readers walking the list without
 * a lock see either as the end or as the new entry. Registrations are serialised by reg_lock.
 */
#include <pthread.h>
#include <string.h>

#include "core/core.h"

extern const xccl_transport_ops_t xccl_transport_tcp;
extern const xccl_transport_ops_t xccl_transport_shm;

/* The ibverbs transport is built where rdma-core's headers are (backends/ibverbs/ibverbs.c
 * uses the same test, so both agree; setup.py defines XCCL_NO_IBVERBS when it leaves it out). */
#if !defined(XCCL_NO_IBVERBS) && defined(__has_include)
#if __has_include(<infiniband/verbs.h>)
#define XCCL_WITH_IBVERBS 1
#endif
#endif
#ifdef XCCL_WITH_IBVERBS
extern const xccl_transport_ops_t xccl_transport_ibverbs;
#endif
/* cuda_ipc (backends/cuda_ipc) is listed where xccl is built with CUDA; its code is built
 * everywhere (tests register it with a fake device). */
#ifdef XCCL_HAVE_CUDA
extern const xccl_transport_ops_t xccl_transport_cuda_ipc;
#endif
enum {
    NBUILTIN = 2
#ifdef XCCL_WITH_IBVERBS
               + 1
#endif
#ifdef XCCL_HAVE_CUDA
               + 1
#endif
};

_Static_assert(NBUILTIN + XCCL_TP_REGISTER_MAX <= XCCL_MAX_TRANSPORTS,
               "a context can hold every registered transport");

/* one NULL slot after the last possible entry */
static const xccl_transport_ops_t *registry[NBUILTIN + XCCL_TP_REGISTER_MAX + 1] = {
#ifdef XCCL_HAVE_CUDA
    &xccl_transport_cuda_ipc,
#endif
    &xccl_transport_shm,
#ifdef XCCL_WITH_IBVERBS
    &xccl_transport_ibverbs,
#endif
    &xccl_transport_tcp,
};
static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;

const xccl_transport_ops_t *const *xccl_transport_list(void) { return registry; }

const xccl_transport_ops_t *xccl_transport_find(const char *name)
{
    if (name == NULL) return NULL;
    for (int i = 0;; i++) {
        const xccl_transport_ops_t *t = __atomic_load_n(&registry[i], __ATOMIC_ACQUIRE);
        if (t == NULL) return NULL;
        if (strcmp(t->name, name) == 0) return t;
    }
}

static xccl_status_t check_ops(const xccl_transport_ops_t *ops)
{
    size_t len;

    if (ops == NULL) return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "transport register: ops is NULL");
    if (ops->abi_version != XCCL_TRANSPORT_ABI_VERSION)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                          "transport register: abi_version %u, this library speaks %u",
                          (unsigned)ops->abi_version, (unsigned)XCCL_TRANSPORT_ABI_VERSION);
    len = ops->name != NULL ? strnlen(ops->name, XCCL_TP_NAME_MAX) : 0;
    if (len == 0 || len >= XCCL_TP_NAME_MAX || strcmp(ops->name, "auto") == 0 ||
        strpbrk(ops->name, ", ") != NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                          "transport register: a name needs 1 to %d characters, no ',' or ' ', "
                          "and not \"auto\"",
                          XCCL_TP_NAME_MAX - 1);
    if (!ops->init || !ops->finalize || !ops->reachable || !ops->get_addr || !ops->wireup ||
        !ops->isend || !ops->progress)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "transport register: %s lacks a mandatory entry",
                          ops->name);
    if ((ops->caps & XCCL_TP_CAP_NEEDS_REG) && (!ops->mem_reg || !ops->mem_dereg))
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                          "transport register: %s needs registration but lacks mem_reg/mem_dereg",
                          ops->name);
    return XCCL_OK;
}

xccl_status_t xccl_transport_register(const xccl_transport_ops_t *ops)
{
    xccl_status_t st = check_ops(ops);
    int           i;

    if (st < 0) return st;
    pthread_mutex_lock(&reg_lock);
    for (i = 0; registry[i] != NULL; i++) {
        if (strcmp(registry[i]->name, ops->name) == 0) {
            pthread_mutex_unlock(&reg_lock);
            return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                              "transport register: the name %s is taken", ops->name);
        }
    }
    if (i >= NBUILTIN + XCCL_TP_REGISTER_MAX) {
        pthread_mutex_unlock(&reg_lock);
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                          "transport register: no room for %s (at most %d transports added)",
                          ops->name, XCCL_TP_REGISTER_MAX);
    }
    __atomic_store_n(&registry[i], ops, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&reg_lock);
    XCCL_INFO("transport %s registered (priority %d)", ops->name, ops->priority);
    return XCCL_OK;
}
