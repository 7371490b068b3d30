/* SPDX-License-Identifier: Apache-2.0
 *
 * test_tp_plugin.c - a transport built against the public headers only (xccl/xccl.h,
 * xccl/xccl_transport.h, xccl/xccl_tp_support.h: no core header is included here), registered
 * at run time and used by communicators. The transport, "wtcp", wraps the built-in tcp ops it
 * finds through xccl_transport_find, holds the tcp context inside its own state and counts what
 * goes through it, so the test can tell that every message really took the registered
 * transport. Forked ranks meet through a file store and run point-to-point operations and
 * collectives over it, with values checked against ones computed here. Registration's refusals
 * (bad version, missing entries, bad or taken names, a full registry) are checked too.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ctest.h"
#include "tp_wrap.h"
#include "xccl/xccl.h"
#include "xccl/xccl_tp_support.h"
#include "xccl/xccl_transport.h"

/* ---- the transport -------------------------------------------------------------------------- */

struct xccl_tp_ctx {
    tpw_t w; /* the wrapped tcp (tp_wrap.h) */
};

/* Bumped by the progress thread (under the context's lock) and read by the test's thread:
 * atomic. */
static struct {
    _Atomic int      inits, finalizes, wireups, kv_ok;
    _Atomic uint64_t sends, send_bytes, progress;
} cnt;

/* The store's view (ABI 5), valid from init until wireup returns. */
static const xccl_tp_kv_t *kv;
static int                 kv_rank, kv_size;

static xccl_status_t w_init(const xccl_tp_init_params_t *params, xccl_tp_ctx_t **out)
{
    xccl_status_t st = tpw_init(params, out, sizeof(xccl_tp_ctx_t), "tcp", NULL);
    char          key[32];
    int32_t       v = params->rank * 1000 + 7;

    if (st == XCCL_OK) cnt.inits++;
    /* publish a per-rank record through the store's view, read back in wireup */
    kv      = params->kv;
    kv_rank = params->rank;
    kv_size = params->size;
    CHECK(kv != NULL);
    snprintf(key, sizeof(key), "hello/%d", params->rank);
    if (kv != NULL) CHECK(kv->put(kv->core, key, &v, sizeof(v)) == XCCL_OK);
    return st;
}

static void w_finalize(xccl_tp_ctx_t *c)
{
    tpw_finalize(c);
    cnt.finalizes++;
}

static xccl_status_t w_wireup(xccl_tp_ctx_t *c, const void *const *addrs, const size_t *lens,
                              const uint8_t *use, int64_t timeout_ms)
{
    cnt.wireups++;
    for (int p = 0; kv != NULL && p < kv_size; p++) {
        char    key[32];
        void   *v = NULL;
        size_t  len = 0;
        int32_t x   = -1;
        if (p == kv_rank) continue;
        snprintf(key, sizeof(key), "hello/%d", p);
        if (kv->get(kv->core, key, timeout_ms, &v, &len) == XCCL_OK && len == sizeof(x)) {
            memcpy(&x, v, sizeof(x));
            if (x == p * 1000 + 7) cnt.kv_ok++;
        }
        free(v);
    }
    /* a key nobody wrote: a timeout, not a hang (0: test once) */
    if (kv != NULL) {
        void  *v = NULL;
        size_t len;
        CHECK(kv->get(kv->core, "never/written", 0, &v, &len) == XCCL_ERR_TIMEOUT);
        free(v);
    }
    kv = NULL; /* not valid after wireup */
    return tpw_wireup(c, addrs, lens, use, timeout_ms);
}

static xccl_status_t w_isend(xccl_tp_ctx_t *c, int peer, const xccl_msg_hdr_t *hdr,
                             const xccl_tp_buf_t *buf, void *cookie)
{
    cnt.sends++;
    cnt.send_bytes += hdr->nbytes;
    return tpw_isend(c, peer, hdr, buf, cookie);
}

static xccl_status_t w_progress(xccl_tp_ctx_t *c, int *nevents)
{
    cnt.progress++;
    return tpw_progress(c, nevents);
}

static const xccl_transport_ops_t wtcp_ops = {
    .abi_version = XCCL_TRANSPORT_ABI_VERSION,
    .name        = "wtcp",
    .caps        = XCCL_TP_CAP_HOST_MEM,
    .priority    = 1,
    .init        = w_init,
    .finalize    = w_finalize,
    .reachable   = tpw_reachable,
    .get_addr    = tpw_get_addr,
    .wireup      = w_wireup,
    .isend       = w_isend,
    .progress    = w_progress,
    .wait        = tpw_wait,
    .wake        = tpw_wake,
    .close_peer  = tpw_close_peer,
};

/* ---- ranks ---------------------------------------------------------------------------------- */

static char store_path[256];

/* Waits for and releases *w, which the call that returned st posted. */
static int wait_ok(xccl_status_t st, xccl_work_t **wp, const char *what, int rank)
{
    xccl_work_t *w = *wp;

    if (st != XCCL_OK) {
        fprintf(stderr, "rank %d: %s: post failed: %s\n", rank, what, xccl_last_error());
        return 0;
    }
    st = xccl_work_wait(w, -1);
    if (st != XCCL_OK) fprintf(stderr, "rank %d: %s: %s\n", rank, what, xccl_work_error(w));
    xccl_work_release(w);
    return st == XCCL_OK;
}

static int32_t val(int r, size_t i) { return (int32_t)(r * 7919 + (int)(i % 1009)); }

static int child(int rank, int size, void *unused)
{
    (void)unused;
    xccl_store_t      *store = NULL;
    xccl_comm_t       *c     = NULL;
    xccl_comm_config_t cfg   = {0};
    xccl_work_t       *w, *w2;
    size_t             n = 70001;
    int32_t           *s = malloc(n * 4), *r = malloc(n * size * 4);
    uint64_t           sends0;

    if (xccl_store_file_create(store_path, size, 20000, &store) != XCCL_OK) return 1;
    cfg.rank         = rank;
    cfg.size         = size;
    cfg.store        = store;
    cfg.timeout_ms   = 20000;
    cfg.transports   = "wtcp";
    cfg.auth_key     = "plugin-secret";
    cfg.auth_key_len = 13;
    cfg.name         = "plugin";
    CHECK(xccl_comm_create(&cfg, &c) == XCCL_OK);
    {
        /* the transport's keys live under the context's prefix and its own name */
        void  *v = NULL;
        size_t len;
        char   key[64];
        snprintf(key, sizeof(key), "xccl/g0/tp/wtcp/hello/%d", rank);
        CHECK(xccl_store_get(store, key, 0, &v, &len) == XCCL_OK && len == 4);
        free(v);
    }
    xccl_store_release(store);
    if (c == NULL) return 1;
    CHECK(cnt.inits == 1 && cnt.wireups == 1);
    CHECK(cnt.kv_ok == size - 1);
    for (int p = 0; p < size; p++)
        CHECK(strcmp(xccl_comm_peer_transport(c, p), p == rank ? "self" : "wtcp") == 0);

    /* point to point around the ring */
    sends0 = cnt.sends;
    for (size_t i = 0; i < 1000; i++) s[i] = val(rank, i);
    CHECK(xccl_irecv(c, r, 4000, (rank + size - 1) % size, 5, &w2) == XCCL_OK);
    CHECK(wait_ok(xccl_isend(c, s, 4000, (rank + 1) % size, 5, &w), &w, "send", rank));
    CHECK(wait_ok(XCCL_OK, &w2, "recv", rank));
    for (size_t i = 0; i < 1000; i++)
        CHECK_MSG(r[i] == val((rank + size - 1) % size, i), "p2p at %zu", i);
    CHECK(cnt.sends > sends0);

    /* all_reduce, broadcast, all_gather */
    for (size_t i = 0; i < n; i++) s[i] = val(rank, i);
    sends0 = cnt.sends;
    CHECK(wait_ok(xccl_allreduce(c, s, r, n, XCCL_INT32, XCCL_OP_SUM, NULL, &w), &w, "allreduce",
                  rank));
    for (size_t i = 0; i < n; i++) {
        int32_t want = 0;
        for (int q = 0; q < size; q++) want += val(q, i);
        if (r[i] != want) {
            CHECK_MSG(r[i] == want, "all_reduce at %zu: %d, want %d", i, r[i], want);
            break;
        }
    }
    CHECK(cnt.sends > sends0 && cnt.send_bytes >= n * 4 / (size_t)size);

    for (size_t i = 0; i < n; i++) r[i] = rank == 1 ? val(1, i) : -1;
    CHECK(wait_ok(xccl_broadcast(c, r, n, XCCL_INT32, 1, NULL, &w), &w, "broadcast", rank));
    for (size_t i = 0; i < n; i++) {
        if (r[i] != val(1, i)) {
            CHECK_MSG(r[i] == val(1, i), "broadcast at %zu", i);
            break;
        }
    }

    CHECK(wait_ok(xccl_allgather(c, s, r, n, XCCL_INT32, NULL, &w), &w, "allgather", rank));
    for (int q = 0; q < size; q++) {
        for (size_t i = 0; i < n; i++) {
            if (r[(size_t)q * n + i] != val(q, i)) {
                CHECK_MSG(0, "all_gather block %d at %zu", q, i);
                break;
            }
        }
    }
    CHECK(cnt.progress > 0);
    xccl_comm_destroy(c);
    CHECK(cnt.finalizes == 1);
    free(s);
    free(r);
    return ctest_failures != 0;
}

/* ---- registration --------------------------------------------------------------------------- */

static void test_register_refusals(void)
{
    xccl_transport_ops_t bad = wtcp_ops;

    CHECK(xccl_transport_find("tcp") != NULL && xccl_transport_find("shm") != NULL);
    CHECK(xccl_transport_find("wtcp") == NULL);
    CHECK(xccl_transport_find("nope") == NULL);
    CHECK(xccl_transport_register(NULL) == XCCL_ERR_INVALID_ARG);
    bad.abi_version = XCCL_TRANSPORT_ABI_VERSION - 1;
    CHECK(xccl_transport_register(&bad) == XCCL_ERR_INVALID_ARG);
    CHECK(strstr(xccl_last_error(), "abi_version") != NULL);
    bad         = wtcp_ops;
    bad.wireup  = NULL;
    CHECK(xccl_transport_register(&bad) == XCCL_ERR_INVALID_ARG);
    bad         = wtcp_ops;
    bad.caps   |= XCCL_TP_CAP_NEEDS_REG;
    CHECK(xccl_transport_register(&bad) == XCCL_ERR_INVALID_ARG);
    bad         = wtcp_ops;
    bad.name    = "tcp";
    CHECK(xccl_transport_register(&bad) == XCCL_ERR_INVALID_ARG);
    CHECK(strstr(xccl_last_error(), "taken") != NULL);
    bad.name = "";
    CHECK(xccl_transport_register(&bad) == XCCL_ERR_INVALID_ARG);
    bad.name = "a-name-far-too-long";
    CHECK(xccl_transport_register(&bad) == XCCL_ERR_INVALID_ARG);
    bad.name = "auto";
    CHECK(xccl_transport_register(&bad) == XCCL_ERR_INVALID_ARG);
    CHECK(xccl_transport_find("wtcp") == NULL);
}

int main(void)
{
    static xccl_transport_ops_t more[XCCL_TP_REGISTER_MAX];
    const int                   size   = 3;
    int                         failed;

    test_register_refusals();
    CHECK(xccl_transport_register(&wtcp_ops) == XCCL_OK);
    CHECK(xccl_transport_find("wtcp") == &wtcp_ops);
    CHECK(xccl_transport_register(&wtcp_ops) == XCCL_ERR_INVALID_ARG); /* taken */

    snprintf(store_path, sizeof(store_path), "/tmp/xccl-test-plugin-%d", (int)getpid());
    unlink(store_path);
    failed = ctest_fork_ranks("test_tp_plugin", size, child, NULL);
    unlink(store_path);
    ctest_checks++;
    if (failed) ctest_failures++;

    /* the registry fills up: the rest of the room, then a refusal */
    for (int i = 0; i < XCCL_TP_REGISTER_MAX; i++) {
        static char names[XCCL_TP_REGISTER_MAX][XCCL_TP_NAME_MAX];
        snprintf(names[i], sizeof(names[i]), "more%d", i);
        more[i]      = wtcp_ops;
        more[i].name = names[i];
        CHECK(xccl_transport_register(&more[i]) == (i + 1 < XCCL_TP_REGISTER_MAX
                                                        ? XCCL_OK
                                                        : XCCL_ERR_NOT_SUPPORTED));
    }
    CTEST_MAIN_END("test_tp_plugin");
}
