/* SPDX-License-Identifier: Apache-2.0
 *
 * ctx.c - the context: bootstrap through the store, transport wire-up, message matching (the
 * transport upcalls), the progress pass and the background progress thread.
 *
 * Bootstrap (keys under "xccl/g<gen>/", gen counted with store add so a store can be reused):
 *   1. rank 0 publishes a random job id                           key "job"
 *   2. every rank publishes its peer info                          key "info/<rank>"
 *   3. transports are initialised knowing every peer's info, and every rank publishes the
 *      address blobs of the transports it could start              key "addr/<rank>"
 *   4. each peer gets, per memory type, the preferred transport both ends have, that reaches
 *      it and that takes that memory type; each transport wires up the peers it serves.
 *
 * Matching (constant time in ranks, communicators and pending operations): a header finds its
 * communicator by id (hash map), then the first receive with its tag in the queue of receives
 * posted for its sender and in the communicator's any-source queue; of the two, the one posted
 * first wins (posting sequence numbers). Messages without a posted receive are kept as
 * unexpected messages, staged in host memory: per sender and in arrival order on their
 * communicator, and in ctx->unexp (which alone holds those of communicators this rank has not
 * created yet, and control messages). A posted receive looks for its message the same way.
 *
 * Staging ("Staging" below): device memory to or from a peer that only host-memory transports
 * reach passes through host bounce buffers, copied by the executor of its memory type.
 */
#include "core/core.h"

#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/auth.h"
#include "core/exec.h"

/* ------------------------------------------------------------------------------------------ */
/* Bootstrap helpers                                                                           */
/* ------------------------------------------------------------------------------------------ */

static uint64_t hash64(const void *data, size_t len, uint64_t seed)
{
    uint8_t       digest[XCCL_SHA256_LEN];
    xccl_sha256_t s;
    uint64_t      h;

    xccl_sha256_init(&s);
    xccl_sha256_update(&s, &seed, sizeof(seed));
    xccl_sha256_update(&s, data, len);
    xccl_sha256_final(&s, digest);
    memcpy(&h, digest, sizeof(h));
    return h;
}

static void local_peer_info(xccl_peer_info_t *pi)
{
    char        buf[512] = {0};
    char        host[256] = {0};
    FILE       *f;
    char        ns[64]  = {0};
    const char *forced = getenv("XCCL_HOST_ID");
    cpu_set_t   set;

    if (forced != NULL && *forced != '\0') {
        /* the host's name given explicitly: processes that share a kernel but must not share
         * memory (some container set-ups), or tests that split one machine into "hosts" */
        snprintf(buf, sizeof(buf), "id:%s", forced);
    } else {
        f = fopen("/proc/sys/kernel/random/boot_id", "r");
        if (f != NULL) {
            if (fgets(buf, sizeof(buf) - sizeof(host), f) == NULL) buf[0] = '\0';
            fclose(f);
        }
        if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
    }
    strncat(buf, host, sizeof(buf) - strlen(buf) - 1);
    memset(pi, 0, sizeof(*pi));
    pi->host_id  = hash64(buf, strlen(buf), 0x686f7374);
    pi->pid      = (int32_t)getpid();
    pi->cuda_dev = -1;
    if (readlink("/proc/self/ns/ipc", ns, sizeof(ns) - 1) > 0) pi->ipc_ns = hash64(ns, strlen(ns), 1);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) {
        CPU_ZERO(&set);
        CPU_SET(0, &set); /* unknown: count one CPU */
    }
    for (int c = 0; c < CPU_SETSIZE && c < XCCL_CPU_WORDS * 64; c++)
        if (CPU_ISSET(c, &set)) pi->cpus[c / 64] |= 1ull << (c % 64);
}

xccl_status_t xccl_addr_rec_parse(const uint8_t *p, size_t len, int rank, xccl_addr_rec_t *r)
{
    size_t   off = 4;
    uint32_t n;

    if (len < 4) goto bad;
    memcpy(&n, p, 4);
    if (n > XCCL_MAX_TRANSPORTS) goto bad;
    r->ntp = (int)n;
    for (int i = 0; i < r->ntp; i++) {
        uint32_t l;
        if (off + 20 > len) goto bad;
        memcpy(r->names[i], p + off, 16);
        r->names[i][15] = '\0';
        memcpy(&l, p + off + 16, 4);
        off += 20;
        if (l > XCCL_TP_ADDR_MAX || off + l > len) goto bad;
        r->lens[i]  = l;
        r->blobs[i] = p + off;
        off += l;
    }
    r->tail     = p + off;
    r->tail_len = len - off;
    return XCCL_OK;
bad:
    return XCCL_ERROR(XCCL_ERR_REMOTE, "bootstrap: malformed address record from rank %d", rank);
}

/* Transport preference: $XCCL_TRANSPORTS / cfg order if given, else priority order. */
static int select_transports(const char *spec, const xccl_transport_ops_t **out)
{
    const xccl_transport_ops_t *const *all = xccl_transport_list();
    int                                n   = 0;

    if (spec != NULL && *spec != '\0' && strcmp(spec, "auto") != 0) {
        char  buf[256];
        char *save = NULL;
        snprintf(buf, sizeof(buf), "%s", spec);
        for (char *tok = strtok_r(buf, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save)) {
            for (int i = 0; all[i] != NULL; i++) {
                if (strcmp(all[i]->name, tok) == 0 && n < XCCL_MAX_TRANSPORTS) out[n++] = all[i];
            }
        }
        return n;
    }
    for (int i = 0; all[i] != NULL && n < XCCL_MAX_TRANSPORTS; i++) out[n++] = all[i];
    for (int i = 1; i < n; i++) { /* insertion sort by priority, highest first */
        const xccl_transport_ops_t *t = out[i];
        int                         j = i - 1;
        while (j >= 0 && out[j]->priority < t->priority) {
            out[j + 1] = out[j];
            j--;
        }
        out[j + 1] = t;
    }
    return n;
}

/* The error of a staged receive whose copy out of its host bounce buffer failed. */
static xccl_status_t stage_out_failed(const xccl_req_t *r, xccl_status_t st)
{
    return XCCL_ERROR(st,
                      "receive of %zu bytes from rank %d into %s memory: the copy out of the "
                      "host staging buffer failed (%s)",
                      r->received, r->src, xccl_mem_type_name(r->mem), xccl_status_string(st));
}

static void stage_drain(xccl_ctx_t *ctx);

/* The executor queue a request's staging copies run on: its operation's communicator's. */
static void *req_queue(const xccl_req_t *r, xccl_mem_type_t mem)
{
    return r->work != NULL ? xccl_comm_queue_of(r->work->comm, mem) : NULL;
}

static void sbuf_release(xccl_sbuf_t *b);

static void ctx_free(xccl_ctx_t *ctx)
{
    if (ctx == NULL) return;
    stage_drain(ctx); /* no executor may still write a buffer freed below */
    for (int i = 0; i < ctx->ntp; i++) {
        if (ctx->tp[i].rcache != NULL) xccl_rcache_free(ctx->tp[i].rcache);
        ctx->tp[i].rcache = NULL; /* the communicators freed below find no cache */
        if (ctx->tp[i].ctx != NULL) ctx->tp[i].ops->finalize(ctx->tp[i].ctx);
    }
    while (ctx->unexp_head != NULL) {
        xccl_umsg_t *u  = ctx->unexp_head;
        ctx->unexp_head = u->next;
        free(u->data);
        free(u);
    }
    while (ctx->umsg_pool != NULL) {
        xccl_umsg_t *u = ctx->umsg_pool;
        ctx->umsg_pool = u->next;
        free(u);
    }
    while (ctx->req_pool != NULL) {
        xccl_req_t *r = ctx->req_pool;
        ctx->req_pool = r->next;
        free(r);
    }
    if (ctx->peer_dead != NULL) {
        for (int i = 0; i < ctx->size; i++) free(ctx->peer_dead[i]);
    }
    /* communicators still referenced (by requests the transports dropped at finalize) */
    for (size_t i = 0; i < ctx->comms.cap; i++) {
        xccl_comm_t *c = ctx->comms.vals[i];
        if (ctx->comms.keys[i] != 0 && c != &xccl_comm_gone) xccl_comm_free(c);
    }
    xccl_u64map_free(&ctx->comms);
    free(ctx->gone_ids);
    free(ctx->peer_dead);
    free(ctx->peer_scarce);
    free(ctx->defer_since);
    xccl_algo_policy.tune_free(ctx->tune);
    while (ctx->stage_all != NULL) {
        xccl_sbuf_t *b = ctx->stage_all;
        ctx->stage_all = b->anext;
        sbuf_release(b);
    }
    free(ctx->stage_pending);
    free(ctx->stage_mark);
    free(ctx->peer_tp);
    free(ctx->peer_tp_mem);
    free(ctx->peers);
    free(ctx->cinfo);
    if (ctx->ptracer == 2) xccl_shared_ptracer(-1);
    else if (ctx->ptracer == 1) xccl_shared_ptracer(0); /* failed before the peers were known */
    pthread_mutex_destroy(&ctx->lock);
    pthread_cond_destroy(&ctx->cond);
    free(ctx);
}

static const xccl_tp_upcalls_t *ctx_upcalls(xccl_ctx_t *ctx, int k);

/* The key-value view of the store a transport gets for init and wireup (xccl_tp_kv_t): its
 * keys live under "xccl/g<gen>/tp/<transport>/", beside the core's own. */
typedef struct tp_kv_view {
    xccl_tp_kv_t  kv;
    xccl_store_t *store;
    char          prefix[96];
} tp_kv_view_t;

static xccl_status_t kv_key(const tp_kv_view_t *v, const char *key, char *out, size_t len)
{
    if (key == NULL || *key == '\0' || strlen(key) > 96)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "transport store key: 1 to 96 characters");
    snprintf(out, len, "%s%s", v->prefix, key);
    return XCCL_OK;
}

static xccl_status_t kv_put(void *core, const char *key, const void *val, size_t len)
{
    tp_kv_view_t *v = core;
    char          k[200];

    XCCL_CHECK(kv_key(v, key, k, sizeof(k)));
    return xccl_store_set(v->store, k, val, len);
}

static xccl_status_t kv_get(void *core, const char *key, int64_t timeout_ms, void **val,
                            size_t *len)
{
    tp_kv_view_t *v = core;
    char          k[200];

    XCCL_CHECK(kv_key(v, key, k, sizeof(k)));
    return xccl_store_get(v->store, k, timeout_ms > 0 ? timeout_ms : 0, val, len);
}

/* Whether each world rank's host runs more ranks of this job than the CPUs they may run on
 * together (the union of their affinity masks: ranks bound one per CPU are not short of CPUs,
 * ranks all bound to one are). Every rank computes it from the same peer table, so the answer
 * is the job's, not a per-process guess: the algorithm selection may depend on it
 * (topo.scarce). On this rank's host, waiters then yield the CPU between polls (the rank
 * they wait for may need it; otherwise they poll flat out, since a sched_yield per poll is a
 * system call that delays noticing a message; XCCL_SPIN_YIELD=0/1 overrides), and the
 * transports learn it at init. */
static xccl_status_t scarce_hosts(xccl_ctx_t *ctx)
{
    const xccl_peer_info_t *p = ctx->peers;

    ctx->peer_scarce = calloc((size_t)ctx->size, 1);
    if (ctx->peer_scarce == NULL)
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "comm create: out of memory");
    for (int r = 0; r < ctx->size; r++) {
        uint64_t cpus[XCCL_CPU_WORDS] = {0};
        int      nlocal = 0, ncpus = 0, first = r;

        for (int q = 0; q < r && first == r; q++)
            if (p[q].host_id == p[r].host_id) first = q;
        if (first != r) { /* the host's first rank has the answer */
            ctx->peer_scarce[r] = ctx->peer_scarce[first];
            continue;
        }
        for (int q = r; q < ctx->size; q++) {
            if (p[q].host_id != p[r].host_id) continue;
            nlocal++;
            for (int w = 0; w < XCCL_CPU_WORDS; w++)
                cpus[w] |= p[q].cpus[w];
        }
        for (int w = 0; w < XCCL_CPU_WORDS; w++)
            ncpus += __builtin_popcountll(cpus[w]);
        ctx->peer_scarce[r] = nlocal > ncpus;
    }
    return XCCL_OK;
}

/* The tuning-table trailer of this rank's address record (xccl_addr_rec_t.tail) at p; returns
 * its length (at most TUNE_TAIL_MAX). */
#define TUNE_TAIL_MAX (8 + 4 + 2 + 256)
static size_t tune_tail(uint8_t *p, uint64_t hash, xccl_status_t st, const char *path)
{
    uint16_t n = (uint16_t)(path != NULL ? strnlen(path, 256) : 0);
    int32_t  s = st;

    memcpy(p, &hash, 8);
    memcpy(p + 8, &s, 4);
    memcpy(p + 12, &n, 2);
    if (n > 0) memcpy(p + 14, path, n);
    return 14 + (size_t)n;
}

/* Every rank must choose the same algorithms, so every rank must use the same tuning table
 * ($XCCL_TUNE_FILE, the same bytes) or none. Each rank published the hash of its table (or the
 * failure to load it) in its address record; all ranks see the same records, so all fail
 * alike: naming the ranks whose file could not be loaded, or the ranks and files that differ
 * from rank 0's. `mine` is this rank's own load (its error message in my_err). */
static xccl_status_t tune_agree(const xccl_ctx_t *ctx, const xccl_addr_rec_t *recs,
                                uint64_t my_hash, xccl_status_t mine, const char *my_path,
                                const char *my_err)
{
    char     msg[768];
    size_t   at  = 0;
    uint64_t h0  = 0;
    int      bad = 0;

    if (mine < 0) return XCCL_ERROR(mine, "comm create on rank %d: %s", ctx->rank, my_err);
    for (int r = 0; r < ctx->size; r++) {
        uint64_t    h    = my_hash;
        int32_t     s    = 0;
        uint16_t    n    = 0;
        const char *path = my_path ? my_path : "";
        if (r != ctx->rank) {
            const xccl_addr_rec_t *rec = &recs[r];
            if (rec->tail_len < 14) {
                return XCCL_ERROR(XCCL_ERR_REMOTE,
                                  "comm create on rank %d: rank %d sent no tuning-table hash "
                                  "(a different xccl version?)",
                                  ctx->rank, r);
            }
            memcpy(&h, rec->tail, 8);
            memcpy(&s, rec->tail + 8, 4);
            memcpy(&n, rec->tail + 12, 2);
            if (n > 256 || 14 + (size_t)n > rec->tail_len)
                return XCCL_ERROR(XCCL_ERR_REMOTE,
                                  "bootstrap: malformed tuning record from "
                                  "rank %d",
                                  r);
            path = (const char *)rec->tail + 14;
        } else {
            n = (uint16_t)strnlen(path, 256);
        }
        if (s < 0)
            return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                              "comm create on rank %d: rank %d could not load its tuning table "
                              "XCCL_TUNE_FILE=%.*s (its error says why)",
                              ctx->rank, r, (int)n, path);
        if (r == 0) h0 = h;
        if (r == 0 || h != h0) {
            if (h != h0) bad++;
            if (at < sizeof(msg))
                at += (size_t)snprintf(
                    msg + at, sizeof(msg) - at, "%srank %d: %s%.*s (hash %016llx)", at ? ", " : "",
                    r, n ? "XCCL_TUNE_FILE=" : "no table", (int)n, path, (unsigned long long)h);
        }
    }
    if (bad == 0) return XCCL_OK;
    return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                      "comm create on rank %d: the ranks' tuning tables differ (every rank must "
                      "load the same XCCL_TUNE_FILE content, or none, to choose the same "
                      "algorithms): %s",
                      ctx->rank, msg);
}

xccl_status_t xccl_ctx_create(const xccl_comm_config_t *cfg, xccl_ctx_t **out)
{
    xccl_ctx_t                 *ctx = calloc(1, sizeof(*ctx));
    const xccl_transport_ops_t *cand[XCCL_MAX_TRANSPORTS];
    int                         ncand, scarce;
    int64_t                     gen_v;
    char                        prefix[64], key[96];
    void                       *val   = NULL;
    size_t                      vlen  = 0;
    xccl_status_t               st    = XCCL_OK;
    int64_t                     tmo   = cfg->timeout_ms;
    int64_t                     t_end = xccl_now_ms() + tmo;
    uint8_t                    *rec   = NULL;
    xccl_addr_rec_t            *recs  = NULL;
    void                      **raw   = NULL;
    tp_kv_view_t                kvs[XCCL_MAX_TRANSPORTS];
    char                        unusable[512] = ""; /* "name not usable: why; ..." */
    const char                 *spec  = cfg->transports ? cfg->transports : getenv("XCCL_TRANSPORTS");
    const void                 *key_p = cfg->auth_key;
    size_t                      key_l = cfg->auth_key_len;
    const char                 *tune_path = getenv("XCCL_TUNE_FILE");
    uint64_t                    tune_hash = 0;
    xccl_status_t               tune_st;
    char                        tune_err[512] = "";

    if (ctx == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "comm create: out of memory");
    pthread_mutex_init(&ctx->lock, NULL);
    pthread_cond_init(&ctx->cond, NULL);
    ctx->rank    = cfg->rank;
    ctx->size    = cfg->size;
    ctx->spin_ns = xccl_env_int("XCCL_SPIN_US", 50) * 1000;
    ctx->peers   = calloc((size_t)cfg->size, sizeof(*ctx->peers));
    ctx->cinfo   = calloc((size_t)cfg->size, sizeof(*ctx->cinfo));
    ctx->peer_tp = calloc((size_t)cfg->size, sizeof(*ctx->peer_tp));
    ctx->peer_tp_mem = calloc((size_t)cfg->size * XCCL_MEM_TYPES, sizeof(*ctx->peer_tp_mem));
    ctx->self_core   = (tp_core_t){ctx, -1};
    ctx->peer_dead = calloc((size_t)cfg->size, sizeof(char *));
    ctx->defer_since = calloc((size_t)cfg->size, sizeof(int64_t));
    ctx->defer_ms    = xccl_env_int("XCCL_DEFER_MS", 10);
    ctx->defer_min   = (uint64_t)xccl_env_int("XCCL_DEFER_MIN_BYTES", 64 << 10);
    ctx->stage_pending = calloc((size_t)cfg->size, sizeof(int));
    ctx->stage_mark    = calloc((size_t)cfg->size, sizeof(int64_t));
    {
        int64_t lim = xccl_env_int("XCCL_STAGE_BYTES", 64 << 20);
        ctx->stage_limit = lim > 0 ? (size_t)lim : 64u << 20;
    }
    recs         = calloc((size_t)cfg->size, sizeof(*recs));
    raw          = calloc((size_t)cfg->size, sizeof(void *));
    if (!ctx->peers || !ctx->cinfo || !ctx->peer_tp || !ctx->peer_tp_mem || !ctx->peer_dead ||
        !ctx->defer_since || !ctx->stage_pending || !ctx->stage_mark || !recs || !raw) {
        st = XCCL_ERROR(XCCL_ERR_NO_MEMORY, "comm create: out of memory");
        goto out;
    }
    if (key_p == NULL) {
        const char *env = getenv("XCCL_AUTH_KEY");
        if (env != NULL && *env != '\0') {
            key_p = env;
            key_l = strlen(env);
        }
    }

    /* 1. generation and job id */
    XCCL_CHECK_GOTO(xccl_store_add(cfg->store, "xccl/gen", 1, &gen_v), st, out);
    snprintf(prefix, sizeof(prefix), "xccl/g%lld/", (long long)((gen_v - 1) / cfg->size));
    snprintf(key, sizeof(key), "%sjob", prefix);
    if (cfg->rank == 0) {
        uint64_t id;
        XCCL_CHECK_GOTO(xccl_random_bytes(&id, sizeof(id)), st, out);
        XCCL_CHECK_GOTO(xccl_store_set(cfg->store, key, &id, sizeof(id)), st, out);
    }
    XCCL_CHECK_GOTO(xccl_store_get(cfg->store, key, tmo, &val, &vlen), st, out);
    if (vlen != sizeof(ctx->job_id)) {
        st = XCCL_ERROR(XCCL_ERR_REMOTE, "bootstrap: bad job id record");
        goto out;
    }
    memcpy(&ctx->job_id, val, sizeof(ctx->job_id));
    free(val);
    val = NULL;

    /* 2. peer infos: the transports' view of this process, then the core's own (shared.c) */
    local_peer_info(&ctx->peers[cfg->rank]);
    ncand = select_transports(spec, cand);
    {
        int     intra = 0;
        char    ns[64] = {0};
        uint8_t info[sizeof(xccl_peer_info_t) + sizeof(xccl_core_info_t)];
        for (int i = 0; i < ncand; i++) intra |= (cand[i]->caps & XCCL_TP_CAP_INTRA_HOST) != 0;
        ctx->ptracer = xccl_shared_self_info(&ctx->cinfo[cfg->rank], intra,
                                             readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1) > 0
                                                 ? hash64(ns, strlen(ns), 2) | 1
                                                 : 0);
        memcpy(info, &ctx->peers[cfg->rank], sizeof(xccl_peer_info_t));
        memcpy(info + sizeof(xccl_peer_info_t), &ctx->cinfo[cfg->rank], sizeof(xccl_core_info_t));
        snprintf(key, sizeof(key), "%sinfo/%d", prefix, cfg->rank);
        XCCL_CHECK_GOTO(xccl_store_set(cfg->store, key, info, sizeof(info)), st, out);
    }
    for (int r = 0; r < cfg->size; r++) {
        if (r == cfg->rank) continue;
        snprintf(key, sizeof(key), "%sinfo/%d", prefix, r);
        st = xccl_store_get(cfg->store, key, t_end - xccl_now_ms(), &val, &vlen);
        if (st == XCCL_ERR_TIMEOUT) {
            st = XCCL_ERROR(XCCL_ERR_TIMEOUT,
                            "comm create on rank %d: rank %d did not join within %.1f s",
                            cfg->rank, r, (double)tmo / 1000.0);
            goto out;
        }
        if (st < 0) goto out;
        if (vlen != sizeof(xccl_peer_info_t) + sizeof(xccl_core_info_t)) {
            st = XCCL_ERROR(XCCL_ERR_REMOTE, "bootstrap: bad peer info from rank %d (%zu "
                            "bytes; another version of xccl?)", r, vlen);
            goto out;
        }
        memcpy(&ctx->peers[r], val, sizeof(xccl_peer_info_t));
        memcpy(&ctx->cinfo[r], (uint8_t *)val + sizeof(xccl_peer_info_t),
               sizeof(xccl_core_info_t));
        free(val);
        val = NULL;
    }

    if (ctx->ptracer) { /* Yama relaxed for peers on this host: only if there are some */
        int local = 0;
        for (int r = 0; r < cfg->size; r++)
            local |= r != cfg->rank && ctx->peers[r].host_id == ctx->peers[cfg->rank].host_id;
        xccl_shared_ptracer(local);
        ctx->ptracer = local ? 2 : 0;
    }
    XCCL_CHECK_GOTO(scarce_hosts(ctx), st, out);
    scarce          = ctx->peer_scarce[cfg->rank];
    ctx->spin_yield = xccl_env_int("XCCL_SPIN_YIELD", scarce) != 0;

    /* the tuning table: loaded here, published with the address record, agreed below (a rank
     * whose file is malformed still publishes, so that the others fail at once too) */
    tune_st = xccl_algo_policy.tune_load(tune_path, &ctx->tune, &tune_hash);
    if (tune_st < 0) snprintf(tune_err, sizeof(tune_err), "%s", xccl_last_error());

    /* 3. transports */
    if (ncand == 0) {
        st = XCCL_ERROR(XCCL_ERR_INVALID_ARG, "no transport matches XCCL_TRANSPORTS='%s'",
                        spec ? spec : "");
        goto out;
    }
    {
        xccl_tp_init_params_t p = {
            .rank = cfg->rank, .size = cfg->size, .job_id = ctx->job_id, .peers = ctx->peers,
            .auth_key = key_p, .auth_key_len = key_p ? key_l : 0, .cpus_scarce = scarce,
        };
        size_t off;
        rec = calloc(1, 4 + (size_t)XCCL_MAX_TRANSPORTS * (20 + XCCL_TP_ADDR_MAX) + TUNE_TAIL_MAX);
        if (rec == NULL) {
            st = XCCL_ERROR(XCCL_ERR_NO_MEMORY, "comm create: out of memory");
            goto out;
        }
        off = 4;
        for (int i = 0; i < ncand; i++) {
            xccl_tp_ctx_t *tc = NULL;
            size_t         alen = XCCL_TP_ADDR_MAX;
            uint32_t       l32;
            if (cand[i]->abi_version != XCCL_TRANSPORT_ABI_VERSION) continue;
            p.up          = ctx_upcalls(ctx, ctx->ntp);
            kvs[ctx->ntp] = (tp_kv_view_t){
                .kv = {.core = &kvs[ctx->ntp], .put = kv_put, .get = kv_get},
                .store = cfg->store,
            };
            snprintf(kvs[ctx->ntp].prefix, sizeof(kvs[ctx->ntp].prefix), "%stp/%s/", prefix,
                     cand[i]->name);
            p.kv = &kvs[ctx->ntp].kv;
            xccl_error_set(XCCL_OK, "%s", "");
            st = cand[i]->init(&p, &tc);
            if (st == XCCL_ERR_NOT_SUPPORTED) {
                /* the transport said why with xccl_error_set (xccl_transport.h) */
                const char *why = xccl_last_error();
                size_t      ul  = strlen(unusable);
                if (why == NULL || *why == '\0') why = "not available here";
                XCCL_INFO("transport %s not usable: %s", cand[i]->name, why);
                snprintf(unusable + ul, sizeof(unusable) - ul, "%s%s not usable: %s",
                         ul > 0 ? "; " : "", cand[i]->name, why);
                continue;
            }
            if (st < 0) goto out;
            ctx->tp[ctx->ntp].ops = cand[i];
            ctx->tp[ctx->ntp].ctx = tc;
            ctx->tp[ctx->ntp].ui  = ctx->ntp;
            ctx->ntp++;
            if (cand[i]->caps & XCCL_TP_CAP_NEEDS_REG)
                XCCL_CHECK_GOTO(xccl_rcache_new(cand[i], tc, &ctx->tp[ctx->ntp - 1].rcache), st,
                                out);
            XCCL_CHECK_GOTO(cand[i]->get_addr(tc, rec + off + 20, &alen), st, out);
            strncpy((char *)rec + off, cand[i]->name, 15);
            l32 = (uint32_t)alen;
            memcpy(rec + off + 16, &l32, 4);
            off += 20 + alen;
        }
        {
            uint32_t n32 = (uint32_t)ctx->ntp;
            memcpy(rec, &n32, 4);
        }
        if (ctx->ntp == 0) {
            st = XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                            "comm create on rank %d: no usable transport: XCCL_TRANSPORTS='%s': %s",
                            cfg->rank, spec != NULL ? spec : "auto", unusable);
            goto out;
        }
        off += tune_tail(rec + off, tune_hash, tune_st, tune_path);
        snprintf(key, sizeof(key), "%saddr/%d", prefix, cfg->rank);
        XCCL_CHECK_GOTO(xccl_store_set(cfg->store, key, rec, off), st, out);
    }
    for (int r = 0; r < cfg->size; r++) {
        if (r == cfg->rank) continue;
        snprintf(key, sizeof(key), "%saddr/%d", prefix, r);
        st = xccl_store_get(cfg->store, key, t_end - xccl_now_ms(), &raw[r], &vlen);
        if (st < 0) goto out;
        XCCL_CHECK_GOTO(xccl_addr_rec_parse(raw[r], vlen, r, &recs[r]), st, out);
    }
    XCCL_CHECK_GOTO(tune_agree(ctx, recs, tune_hash, tune_st, tune_path, tune_err), st, out);

    /* the models communicators price links with (topo.c), the same on every rank: from the
     * transports asked for, less those that no rank could start (ibverbs on a cluster
     * without RDMA must not price its TCP links as RDMA ones; cuda_ipc in processes without a
     * GPU must not price, or name for the tuning table, the shm links they use). Where no
     * rank started a same-host transport (one rank per host), the host-memory ones are kept:
     * they price what such a host would use. Every rank sees the same address records, so
     * every rank drops the same. */
    {
        const xccl_transport_ops_t *price[XCCL_MAX_TRANSPORTS];
        int                         nprice = 0, started[XCCL_MAX_TRANSPORTS] = {0}, intra = 0;
        for (int i = 0; i < ncand && i < XCCL_MAX_TRANSPORTS; i++) {
            for (int k = 0; k < ctx->ntp && !started[i]; k++)
                started[i] = ctx->tp[k].ops == cand[i];
            for (int r = 0; r < cfg->size && !started[i]; r++) {
                for (int j = 0; r != cfg->rank && j < recs[r].ntp && !started[i]; j++)
                    started[i] = strcmp(recs[r].names[j], cand[i]->name) == 0;
            }
            intra |= started[i] && (cand[i]->caps & XCCL_TP_CAP_INTRA_HOST);
        }
        for (int i = 0; i < ncand && i < XCCL_MAX_TRANSPORTS; i++) {
            if (started[i] || (!intra && (cand[i]->caps & XCCL_TP_CAP_INTRA_HOST) &&
                               !(cand[i]->caps & XCCL_TP_CAP_CUDA_MEM)))
                price[nprice++] = cand[i];
        }
        xccl_ctx_topo_models(ctx, price, nprice);
    }
    /* node-shared memory needs an intra-host transport started on every member (the records
     * name those a rank started; every rank sees the same ones), which also tells that it
     * could make shared-memory objects at all */
    for (int r = 0; r < cfg->size; r++) {
        int started = 0;
        if (r == cfg->rank) {
            for (int k = 0; k < ctx->ntp; k++)
                started |= (ctx->tp[k].ops->caps & XCCL_TP_CAP_INTRA_HOST) != 0;
        } else {
            const xccl_transport_ops_t *const *all = xccl_transport_list();
            for (int j = 0; j < recs[r].ntp; j++) {
                for (int i = 0; all[i] != NULL; i++)
                    started |= strcmp(recs[r].names[j], all[i]->name) == 0 &&
                               (all[i]->caps & XCCL_TP_CAP_INTRA_HOST) != 0;
            }
        }
        if (!started) ctx->cinfo[r].flags &= ~(uint32_t)(XCCL_CI_SHARED | XCCL_CI_CMA);
    }
    /* names of node-shared segments that killed jobs left behind on this host */
    if (ctx->cinfo[cfg->rank].flags & XCCL_CI_SHARED) xccl_shared_sweep();

    /* 4. per (peer, memory type) transport choice - the first in preference order that both
     *    ends have, that reaches the peer and whose data path takes that memory type - and
     *    wire-up. Host memory must be reachable for every peer. */
    for (int r = 0; r < cfg->size; r++) {
        for (int m = 0; m < XCCL_MEM_TYPES; m++) {
            int8_t *choice = &ctx->peer_tp_mem[m * cfg->size + r];
            *choice        = -1;
            if (r == cfg->rank) continue;
            for (int i = 0; i < ctx->ntp && *choice < 0; i++) {
                if (!(ctx->tp[i].ops->caps & xccl_tp_cap_for((xccl_mem_type_t)m))) continue;
                for (int j = 0; j < recs[r].ntp; j++) {
                    if (strcmp(recs[r].names[j], ctx->tp[i].ops->name) == 0 &&
                        ctx->tp[i].ops->reachable(ctx->tp[i].ctx, r)) {
                        *choice = (int8_t)i;
                        break;
                    }
                }
            }
        }
        ctx->peer_tp[r] = ctx->peer_tp_mem[XCCL_MEM_HOST * cfg->size + r];
        if (r != cfg->rank && ctx->peer_tp[r] < 0) {
            st = XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                            "comm create on rank %d: no common transport reaches rank %d%s%s%s",
                            cfg->rank, r, unusable[0] ? " (on this rank: " : "", unusable,
                            unusable[0] ? ")" : "");
            goto out;
        }
    }
    /* a transport that serves no peer only costs wake-ups: drop it */
    for (int i = 0; i < ctx->ntp;) {
        int used = 0;
        for (int k = 0; k < cfg->size * XCCL_MEM_TYPES; k++) used |= ctx->peer_tp_mem[k] == i;
        if (used || ctx->ntp == 1) {
            i++;
            continue;
        }
        if (ctx->tp[i].rcache != NULL) xccl_rcache_free(ctx->tp[i].rcache);
        ctx->tp[i].ops->finalize(ctx->tp[i].ctx);
        for (int j = i; j + 1 < ctx->ntp; j++) {
            ctx->tp[j]                       = ctx->tp[j + 1];
            ctx->tp_core[ctx->tp[j].ui].slot = j;
        }
        ctx->ntp--;
        for (int r = 0; r < cfg->size; r++) {
            if (ctx->peer_tp[r] > i) ctx->peer_tp[r]--;
        }
        for (int k = 0; k < cfg->size * XCCL_MEM_TYPES; k++) {
            if (ctx->peer_tp_mem[k] > i) ctx->peer_tp_mem[k]--;
        }
    }
    /* the transports kept that register memory: their caches start watching it now */
    for (int i = 0; i < ctx->ntp; i++) {
        if (ctx->tp[i].rcache != NULL) xccl_rcache_watch_memory(ctx->tp[i].rcache);
    }
    for (int i = 0; i < ctx->ntp; i++) {
        const void **addrs = calloc((size_t)cfg->size, sizeof(void *));
        size_t      *lens  = calloc((size_t)cfg->size, sizeof(size_t));
        uint8_t     *use   = calloc((size_t)cfg->size, 1);
        int          any   = 0;
        if (!addrs || !lens || !use) {
            free(addrs), free(lens), free(use);
            st = XCCL_ERROR(XCCL_ERR_NO_MEMORY, "comm create: out of memory");
            goto out;
        }
        for (int r = 0; r < cfg->size; r++) {
            int serves = 0;
            for (int m = 0; m < XCCL_MEM_TYPES; m++)
                serves |= ctx->peer_tp_mem[m * cfg->size + r] == i;
            if (!serves) continue;
            for (int j = 0; j < recs[r].ntp; j++) {
                if (strcmp(recs[r].names[j], ctx->tp[i].ops->name) == 0) {
                    addrs[r] = recs[r].blobs[j];
                    lens[r]  = recs[r].lens[j];
                }
            }
            use[r] = 1;
            any    = 1;
        }
        st = ctx->tp[i].ops->wireup(ctx->tp[i].ctx, addrs, lens, use,
                                    any ? t_end - xccl_now_ms() : 0);
        free(addrs), free(lens), free(use);
        if (st < 0) goto out;
    }
    st = XCCL_OK;

out:
    free(val);
    free(rec);
    if (raw != NULL) {
        for (int r = 0; r < cfg->size; r++) free(raw[r]);
    }
    free(raw);
    free(recs);
    if (st < 0) {
        ctx_free(ctx);
        return st;
    }
    ctx->refcount = 1;
    *out          = ctx;
    return XCCL_OK;
}

void xccl_ctx_release(xccl_ctx_t *ctx)
{
    int last;

    pthread_mutex_lock(&ctx->lock);
    last = --ctx->refcount == 0;
    if (last) {
        ctx->stopping = 1;
        pthread_cond_broadcast(&ctx->cond);
        for (int i = 0; i < ctx->ntp; i++) {
            if (ctx->tp[i].ops->wake) ctx->tp[i].ops->wake(ctx->tp[i].ctx);
        }
    }
    while (last && ctx->nwaiters > 0) pthread_cond_wait(&ctx->cond, &ctx->lock);
    pthread_mutex_unlock(&ctx->lock);
    if (!last) return;
    if (ctx->thread_started && !pthread_equal(ctx->thread, pthread_self()))
        pthread_join(ctx->thread, NULL);
    else if (ctx->thread_started)
        pthread_detach(ctx->thread);
    /* Works still referenced by users no longer touch the context: xccl_comm_destroy failed
     * them and retired their requests before the last reference went. */
    ctx_free(ctx);
}

/* ------------------------------------------------------------------------------------------ */
/* Matching                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* Lists: posted receives are doubly linked in their queue (comm->posted[comm rank of the
 * source] or comm->any); unexpected messages on ctx->unexp and, when their communicator exists
 * here, on comm->unexp[sender] and comm->arrivals. Every unlink is O(1). */

static xccl_req_q_t *posted_q(xccl_comm_t *c, const xccl_req_t *r)
{
    return r->peer == XCCL_ANY_SOURCE ? &c->any : &c->posted[c->rank_of[r->peer]];
}

static void posted_link(xccl_comm_t *c, xccl_req_t *r)
{
    xccl_req_q_t *q = posted_q(c, r);

    r->pseq = ++c->post_seq;
    r->next = NULL;
    r->prev = q->tail;
    if (q->tail) q->tail->next = r;
    else q->head = r;
    q->tail = r;
}

static void posted_unlink(xccl_ctx_t *ctx, xccl_req_t *r)
{
    xccl_req_q_t *q = posted_q(r->work->comm, r);

    (void)ctx;
    if (r->prev) r->prev->next = r->next;
    else q->head = r->next;
    if (r->next) r->next->prev = r->prev;
    else q->tail = r->prev;
    r->next = r->prev = NULL;
}

/* Puts u on its communicator's queues (c NULL: not created here yet; ctx->unexp only). */
static void umsg_link_comm(xccl_comm_t *c, xccl_umsg_t *u)
{
    xccl_umsg_q_t *q;

    u->comm = NULL;
    if (c == NULL || c->rank_of[u->src] < 0) return; /* from a non-member: never received */
    u->comm = c;
    if (tag_kind(u->hdr.tag) == TAG_KIND_CTRL) { /* for the collective it names (coll.c) */
        u->cidx = -1;
        q       = &c->ctrl;
    } else {
        u->cidx = c->rank_of[u->src];
        q       = &c->unexp[u->cidx];
    }
    u->pnext = NULL;
    u->pprev = q->tail;
    if (q->tail) q->tail->pnext = u;
    else q->head = u;
    q->tail = u;
    if (u->cidx < 0) return;
    u->anext = NULL;
    u->aprev = c->arrivals.tail;
    if (c->arrivals.tail) c->arrivals.tail->anext = u;
    else c->arrivals.head = u;
    c->arrivals.tail = u;
}

static void umsg_unlink_comm(xccl_umsg_t *u)
{
    xccl_comm_t   *c = u->comm;
    xccl_umsg_q_t *q;

    if (c == NULL) return;
    q = u->cidx < 0 ? &c->ctrl : &c->unexp[u->cidx];
    if (u->pprev) u->pprev->pnext = u->pnext;
    else q->head = u->pnext;
    if (u->pnext) u->pnext->pprev = u->pprev;
    else q->tail = u->pprev;
    u->pnext = u->pprev = NULL;
    u->comm             = NULL;
    if (u->cidx < 0) return;
    if (u->aprev) u->aprev->anext = u->anext;
    else c->arrivals.head = u->anext;
    if (u->anext) u->anext->aprev = u->aprev;
    else c->arrivals.tail = u->aprev;
    u->pnext = u->pprev = u->anext = u->aprev = NULL;
    u->comm = NULL;
}

static void umsg_unlink(xccl_ctx_t *ctx, xccl_umsg_t *u)
{
    umsg_unlink_comm(u);
    if (u->prev) u->prev->next = u->next;
    else ctx->unexp_head = u->next;
    if (u->next) u->next->prev = u->prev;
    else ctx->unexp_tail = u->prev;
    u->next = u->prev = NULL;
}

void xccl_ctx_adopt(xccl_ctx_t *ctx, xccl_comm_t *comm)
{
    for (xccl_umsg_t *u = ctx->unexp_head; u != NULL; u = u->next) {
        if (u->comm == NULL && u->hdr.comm_id == comm->id && u->hdr.tag != ~0ull)
            umsg_link_comm(comm, u);
    }
}

xccl_req_t *xccl_req_get(xccl_ctx_t *ctx)
{
    xccl_req_t *r = ctx->req_pool;

    if (r == NULL) return calloc(1, sizeof(*r));
    ctx->req_pool = r->next;
    ctx->req_pool_n--;
    memset(r, 0, sizeof(*r));
    return r;
}

void xccl_req_put(xccl_ctx_t *ctx, xccl_req_t *r)
{
    if (r->text && r->nbytes > 0) xccl_ctx_mem_forget(ctx, r->buf, r->nbytes); /* freed next */
    if (r->text || ctx->req_pool_n >= XCCL_POOL_MAX) {
        free(r);
        return;
    }
    r->next       = ctx->req_pool;
    ctx->req_pool = r;
    ctx->req_pool_n++;
}

static xccl_umsg_t *umsg_get(xccl_ctx_t *ctx)
{
    xccl_umsg_t *u = ctx->umsg_pool;

    if (u == NULL) return calloc(1, sizeof(*u));
    ctx->umsg_pool = u->next;
    ctx->umsg_pool_n--;
    memset(u, 0, sizeof(*u));
    return u;
}

/* ------------------------------------------------------------------------------------------ */
/* Staging                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* Device memory (any memory type but host) to or from a peer that no transport moving that
 * type reaches, while a host-memory transport does: the data passes through a host bounce
 * buffer, copied by the executor of its memory type (asynchronously: its event is tested in
 * the progress pass). A send copies into a bounce buffer and sends that (ctx->stage_q keeps
 * its place among the sends to its peer while it waits for a buffer or its copy); a receive
 * lands in a bounce buffer taken when its message is matched and is copied out before it
 * completes. Algorithms and transports know nothing of it: a transport sees host memory.
 *
 * The pool: bounce buffers are allocated once (64 KiB to a power of two) and reused, so that a
 * registering transport finds them in its registration cache every time; the pool keeps at
 * most ctx->stage_limit bytes ($XCCL_STAGE_BYTES, 64 MiB). A send waits (in posting order) for
 * a buffer while the pool is used up; one larger than the limit gets a buffer of its own once
 * the pool is idle, freed when it is done. A receive never waits: when the pool is used up it
 * takes a one-off allocation, as an unexpected message does, so a receive can never wait on a
 * send of its own rank that waits on it. A buffer returns to the pool only when neither a
 * transport (send_done / recv_done) nor an executor (its event finished) uses it. */

#define STAGE_MIN_CAP ((size_t)64 << 10)

static size_t stage_cap_for(size_t n)
{
    size_t c = STAGE_MIN_CAP;

    while (c < n && c < ((size_t)1 << 62)) c <<= 1;
    return c < n ? n : c;
}

/* Frees a bounce buffer no transport and no executor copy uses any more (a pinned one through
 * the executor that pinned it). */
static void sbuf_release(xccl_sbuf_t *b)
{
    if (b->pinned != 0) xccl_exec_for((xccl_mem_type_t)b->pinned_by)->host_release(b->p);
    else free(b->p);
    free(b);
}

/* Pins a pooled buffer for the first device executor there is (one per process in practice),
 * so that its copies to and from the buffer are asynchronous (a copy of pageable memory holds
 * the calling thread, the progress, until the device has run everything queued before it). A
 * one-off buffer is used once, and pinning it would cost more than that copy. Declined while
 * a stream waits for an operation (exec.h host_register): tried again when it comes back. */
static void sbuf_pin(xccl_sbuf_t *b, size_t cap)
{
    b->pin_later = 0;
    for (int m = 0; m < XCCL_MEM_TYPES && !b->pinned; m++) {
        const xccl_exec_ops_t *ex = xccl_exec_for((xccl_mem_type_t)m);
        xccl_status_t          st;
        if (m == XCCL_MEM_HOST || ex == NULL || ex->host_register == NULL) continue;
        st = ex->host_register(b->p, cap);
        if (st == XCCL_OK) {
            b->pinned    = 1;
            b->pinned_by = m;
        }
        b->pin_later |= st == XCCL_INPROGRESS;
    }
}

static xccl_sbuf_t *sbuf_new(xccl_ctx_t *ctx, size_t cap, int pooled)
{
    xccl_sbuf_t *b = calloc(1, sizeof(*b));

    if (b == NULL) return NULL;
    if (posix_memalign(&b->p, 4096, cap) != 0) {
        free(b);
        return NULL;
    }
    if (pooled) sbuf_pin(b, cap);
    b->cap         = cap;
    b->pooled      = pooled;
    b->busy        = 1;
    b->anext       = ctx->stage_all;
    ctx->stage_all = b;
    ctx->stage_allocs++;
    if (pooled) {
        ctx->stage_bytes += cap;
        ctx->stage_inuse++;
    }
    return b;
}

static void sbuf_destroy(xccl_ctx_t *ctx, xccl_sbuf_t *b)
{
    xccl_ctx_mem_forget(ctx, b->p, b->cap); /* no registration outlives the memory it pins */
    for (xccl_sbuf_t **pp = &ctx->stage_all; *pp != NULL; pp = &(*pp)->anext) {
        if (*pp == b) {
            *pp = b->anext;
            break;
        }
    }
    if (b->pooled) ctx->stage_bytes -= b->cap;
    sbuf_release(b);
}

/* A bounce buffer of at least n (> 0) bytes. NULL while the pool is used up (oneoff: a one-off
 * buffer then) or, with *oom set, out of memory. */
static xccl_sbuf_t *stage_get(xccl_ctx_t *ctx, size_t n, int oneoff, int *oom)
{
    xccl_sbuf_t **best = NULL, *b;
    size_t        cap  = stage_cap_for(n), free_bytes = 0;

    *oom = 0;
    for (xccl_sbuf_t **pp = &ctx->stage_free; *pp != NULL; pp = &(*pp)->next) {
        free_bytes += (*pp)->cap;
        if ((*pp)->cap >= n && (best == NULL || (*pp)->cap < (*best)->cap)) best = pp;
    }
    if (best != NULL) {
        b       = *best;
        *best   = b->next;
        b->next = NULL;
        b->busy = 1;
        ctx->stage_inuse++;
        return b;
    }
    /* a new one, making room by freeing idle ones too small for it, when the buffers in use
     * leave room for it (or none is in use: a message larger than the limit) */
    if (ctx->stage_bytes - free_bytes + cap <= ctx->stage_limit || ctx->stage_inuse == 0) {
        while (ctx->stage_free != NULL && ctx->stage_bytes + cap > ctx->stage_limit) {
            b               = ctx->stage_free;
            ctx->stage_free = b->next;
            sbuf_destroy(ctx, b);
        }
        b = sbuf_new(ctx, cap, 1);
        if (b != NULL) return b;
        *oom = 1;
    }
    if (!oneoff) return NULL;
    b    = sbuf_new(ctx, n, 0);
    *oom = b == NULL;
    return b;
}

/* Gives a bounce buffer back: nothing uses it any more. */
static void stage_put(xccl_ctx_t *ctx, xccl_sbuf_t *b)
{
    b->busy = 0;
    if (!b->pooled) {
        sbuf_destroy(ctx, b);
        return;
    }
    ctx->stage_inuse--;
    if (ctx->stage_bytes > ctx->stage_limit) { /* a message larger than the pool had it */
        sbuf_destroy(ctx, b);
        return;
    }
    if (b->pin_later) sbuf_pin(b, b->cap); /* pinning was declined for now when it was made */
    b->next         = ctx->stage_free;
    ctx->stage_free = b;
}


/* Frees an unexpected message already unlinked. */
static void umsg_release(xccl_ctx_t *ctx, xccl_umsg_t *u)
{
    ctx->staged_bytes -= u->data != NULL ? u->hdr.nbytes : 0;
    if (u->rc != NULL) { /* no registration may outlive the memory it pins */
        xccl_rcache_put(u->rc, u->reg);
        xccl_rcache_invalidate(u->rc, u->data, u->hdr.nbytes);
    }
    free(u->data);
    if (ctx->umsg_pool_n >= XCCL_POOL_MAX) {
        free(u);
        return;
    }
    u->next        = ctx->umsg_pool;
    ctx->umsg_pool = u;
    ctx->umsg_pool_n++;
}

static void umsg_free(xccl_ctx_t *ctx, xccl_umsg_t *u)
{
    umsg_unlink(ctx, u);
    umsg_release(ctx, u);
}

void xccl_umsg_drop(xccl_ctx_t *ctx, xccl_umsg_t *u) { umsg_free(ctx, u); }

void xccl_umsg_drop_comm(xccl_ctx_t *ctx, xccl_comm_t *comm)
{
    for (xccl_umsg_t *u = ctx->unexp_head, *next; u != NULL; u = next) {
        next = u->next;
        if (u->hdr.comm_id != comm->id || u->waiter != NULL) continue;
        if (u->done) {
            umsg_free(ctx, u);
        } else { /* freed when the payload is in; off the queues of comm, which may go first */
            umsg_unlink_comm(u);
            u->hdr.tag = ~0ull;
        }
    }
}

/* A transport holds r (until send_done / recv_done): its Work and communicator stay. */
static void req_hold(xccl_req_t *r)
{
    if (r->work == NULL) return;
    xccl_work_retain(r->work);
    xccl_comm_ref(r->work->comm);
}

static void req_unhold(xccl_req_t *r)
{
    xccl_work_t *w = r->work;
    xccl_comm_t *c = w->comm;

    xccl_work_release(w);
    xccl_comm_unref(c);
}

/* A request's trace time: the clock is read only when its communicator traces (it would be
 * read several times per small operation). */
static uint64_t trace_now(const xccl_req_t *r)
{
    return r->work != NULL && r->work->comm->trace_cap > 0 ? xccl_now_ns() : 0;
}

/* A request reached its final state. Drops the reference a transport-held request had. */
static void req_complete(xccl_ctx_t *ctx, xccl_req_t *r, xccl_status_t st)
{
    int          was_active = r->state == REQ_ACTIVE;
    xccl_work_t *w          = r->work;

    r->state  = REQ_DONE;
    r->status = st;
    r->t1     = trace_now(r);
    if (r->reg != NULL) { /* the transport let go of the buffer */
        xccl_rcache_put(ctx->tp[r->tp].rcache, r->reg);
        r->reg = NULL;
    }
    if (r->sbuf != NULL) { /* a staged send's bounce buffer: neither transport nor executor
                            * uses it now */
        stage_put(ctx, r->sbuf);
        r->sbuf = NULL;
    }
    if (w == NULL) { /* an ownerless control notice */
        xccl_req_put(ctx, r);
        return;
    }
    xccl_trace_req(r);
    xccl_req_finished(ctx, r);
    if (was_active) req_unhold(r);
}

/* Copies a fully-arrived unexpected message (staged in host memory) into a receive with the
 * executor of the receive's memory type, and completes it - later, when that executor's copy
 * is asynchronous (the request then waits on ctx->copies, holding its Work, and keeps u). */
static void umsg_deliver(xccl_ctx_t *ctx, xccl_umsg_t *u, xccl_req_t *r)
{
    xccl_status_t          st = u->status;
    const xccl_exec_ops_t *ex = xccl_exec_for(r->mem);

    r->src      = u->src;
    r->received = u->hdr.nbytes;
    r->umsg     = NULL;
    umsg_unlink(ctx, u);
    if (st == XCCL_OK && u->hdr.nbytes > r->nbytes) {
        st = XCCL_ERROR(XCCL_ERR_INVALID_USAGE,
                        "receive buffer of %zu bytes is smaller than the %llu-byte message "
                        "from rank %d",
                        r->nbytes, (unsigned long long)u->hdr.nbytes, u->src);
    } else if (st == XCCL_OK && u->hdr.nbytes > 0 && ex == NULL) {
        st = XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                        "receive from rank %d into %s memory: no executor for that memory type "
                        "in this process",
                        u->src, xccl_mem_type_name(r->mem));
    } else if (st == XCCL_OK && u->hdr.nbytes > 0) {
        void *ev = NULL;
        st       = ex->copy(req_queue(r, ex->mem), r->buf, u->data, u->hdr.nbytes, &ev);
        if (st == XCCL_INPROGRESS) {
            r->ev    = ev;
            r->umsg  = u;
            r->tp    = -1;
            r->state = REQ_ACTIVE;
            req_hold(r);
            r->next     = ctx->copies;
            ctx->copies = r;
            return;
        }
    }
    umsg_release(ctx, u);
    req_complete(ctx, r, st);
}

/* Tests the asynchronous copies out of staged messages; completes the finished ones. */
static int copies_progress(xccl_ctx_t *ctx)
{
    int events = 0;

    for (xccl_req_t **pp = &ctx->copies; *pp != NULL;) {
        xccl_req_t   *r  = *pp;
        xccl_status_t st = xccl_exec_for(r->mem)->test(r->ev);
        xccl_umsg_t  *u  = r->umsg;
        if (st == XCCL_INPROGRESS) {
            pp = &r->next;
            continue;
        }
        *pp     = r->next;
        r->next = NULL;
        r->ev   = NULL;
        r->umsg = NULL;
        if (u != NULL) umsg_release(ctx, u);
        if (r->sbuf != NULL) { /* a staged receive: the executor is done with the buffer */
            stage_put(ctx, r->sbuf);
            r->sbuf = NULL;
            if (st < 0) st = stage_out_failed(r, st);
        }
        req_complete(ctx, r, st);
        events++;
    }
    return events;
}

/* Whether the unexpected message `hdr` from `peer` waits in its transport for a receive
 * (XCCL_INPROGRESS) rather than being staged, which costs a fresh buffer and a second copy.
 * Only payloads of XCCL_DEFER_MIN_BYTES and more, only operation data (control messages are
 * the core's own), only over transports that can hold a message, and for a limited time:
 * everything behind it from that peer waits too, and a program may first need one of those
 * (a receive for a later tag), so the wait must end by itself. The limit is XCCL_DEFER_MS plus
 * 1 ms per MiB, about what staging the message would cost (faulting in a fresh buffer and
 * copying into it): the receiver of a large message is often busy with one as large, so the
 * limit grows with the size rather than being one flat time. */
static int defer(xccl_ctx_t *ctx, int slot, int peer, const xccl_msg_hdr_t *hdr)
{
    int64_t now;

    if (hdr->nbytes < ctx->defer_min || ctx->defer_ms <= 0 || slot < 0 ||
        !(ctx->tp[slot].ops->caps & XCCL_TP_CAP_DEFER))
        return 0;
    now = xccl_now_ms();
    if (ctx->defer_since[peer] == 0) ctx->defer_since[peer] = now;
    return now - ctx->defer_since[peer] < ctx->defer_ms + (int64_t)(hdr->nbytes >> 20);
}

static xccl_status_t up_recv_match(void *core, int peer, const xccl_msg_hdr_t *hdr,
                                   xccl_tp_buf_t *dst, void **cookie)
{
    xccl_ctx_t  *ctx     = ((tp_core_t *)core)->ctx;
    int          slot    = ((tp_core_t *)core)->slot; /* the transport delivering; -1: self */
    xccl_comm_t *c       = xccl_ctx_find_comm(ctx, hdr->comm_id);
    int          discard = 0;
    xccl_req_t  *r;
    xccl_umsg_t *u;

    dst->mem = XCCL_MEM_HOST;
    dst->mr  = NULL;
    if (c != NULL && c->destroyed) {
        discard = 1; /* late traffic of a destroyed communicator */
        goto stage;
    }
    if (tag_kind(hdr->tag) == TAG_KIND_CTRL) goto stage; /* handled when complete */
    ctx->match_headers++;
    if (c == NULL) goto unexpected; /* a communicator this rank has not created yet */
    if (tag_kind(hdr->tag) == TAG_KIND_COLL) {
        /* check the call's fingerprint against the local collective with that seq */
        xccl_work_t *w = xccl_u64map_get(&c->colls, tag_seq(hdr->tag) + 1);
        ctx->match_probes++;
        if (w != NULL && w->fp != hdr->fp) {
            xccl_coll_mismatch(c, w->seq, xccl_comm_rank_of_world(c, peer), hdr->fp, 1);
            discard = 1;
            goto stage;
        }
    }
    /* the first match from that sender's queue and from the any-source queue: the one posted
     * first wins */
    {
        int         src = c->rank_of[peer];
        xccl_req_t *a;
        if (src < 0) goto unexpected; /* not a member: no receive of c may take it */
        for (r = c->posted[src].head; r != NULL; r = r->next) {
            ctx->match_probes++;
            if (r->tag == hdr->tag) break;
        }
        for (a = c->any.head; a != NULL && (r == NULL || a->pseq < r->pseq); a = a->next) {
            ctx->match_probes++;
            if (a->tag == hdr->tag) {
                r = a;
                break;
            }
        }
    }
    if (r != NULL) {
        ctx->defer_since[peer] = 0;
        posted_unlink(ctx, r);
        r->src      = peer;
        r->received = hdr->nbytes;
        r->state    = REQ_ACTIVE;
        r->tp       = slot;
        req_hold(r);
        dst->ptr = NULL; /* unless it is taken below, the transport drops the payload and the
                          * receive fails at recv_done with r->status's reason */
        if (hdr->nbytes > r->nbytes) {
            r->status = XCCL_ERR_INVALID_USAGE; /* no truncation */
        } else if (hdr->nbytes > 0 && slot >= 0 &&
                   !(ctx->tp[slot].ops->caps & xccl_tp_cap_for(r->mem)) &&
                   (ctx->tp[slot].ops->caps & XCCL_TP_CAP_HOST_MEM) &&
                   xccl_exec_for(r->mem) != NULL) {
            /* staged: lands in a host bounce buffer, copied out at recv_done */
            int oom;
            r->sbuf = stage_get(ctx, hdr->nbytes, 1, &oom);
            if (r->sbuf == NULL) {
                r->status = XCCL_ERR_NO_MEMORY;
            } else if (ctx->tp[slot].rcache != NULL &&
                       xccl_rcache_get(ctx->tp[slot].rcache, r->sbuf->p, r->sbuf->cap,
                                       XCCL_MEM_HOST, &r->reg, &dst->mr) < 0) {
                stage_put(ctx, r->sbuf);
                r->sbuf   = NULL;
                r->status = XCCL_ERR_NOT_SUPPORTED;
            } else {
                ctx->stage_recvs++;
                dst->ptr = r->sbuf->p;
                dst->mem = XCCL_MEM_HOST;
            }
        } else if (hdr->nbytes > 0 && slot >= 0 &&
                   !(ctx->tp[slot].ops->caps & xccl_tp_cap_for(r->mem))) {
            r->status = XCCL_ERR_NOT_SUPPORTED;
        } else if (hdr->nbytes > 0 && slot >= 0 && ctx->tp[slot].rcache != NULL &&
                   xccl_rcache_get(ctx->tp[slot].rcache, r->buf, r->nbytes, r->mem, &r->reg,
                                   &dst->mr) < 0) {
            r->status = XCCL_ERR_NOT_SUPPORTED;
        } else {
            dst->ptr = r->buf;
            /* no bytes: nothing in the buffer's memory type for a transport that lacks it */
            dst->mem = hdr->nbytes == 0 && slot >= 0 &&
                               !(ctx->tp[slot].ops->caps & xccl_tp_cap_for(r->mem))
                           ? XCCL_MEM_HOST
                           : r->mem;
        }
        *cookie = r;
        return XCCL_OK;
    }
unexpected:
    if (defer(ctx, slot, peer, hdr)) return XCCL_INPROGRESS;
stage:
    ctx->defer_since[peer] = 0;
    if (discard) { /* the transport drops the payload; recv_done(NULL) is a no-op */
        dst->ptr = NULL;
        *cookie  = NULL;
        return XCCL_OK;
    }
    u = umsg_get(ctx);
    if (u == NULL) return XCCL_ERR_NO_MEMORY;
    u->ctype  = COOKIE_UMSG;
    u->src    = peer;
    u->hdr    = *hdr;
    u->status = XCCL_OK;
    if (hdr->nbytes > 0) {
        u->data = malloc(hdr->nbytes);
        if (u->data == NULL) {
            u->next        = ctx->umsg_pool;
            ctx->umsg_pool = u;
            ctx->umsg_pool_n++;
            return XCCL_ERROR(XCCL_ERR_NO_MEMORY,
                              "no memory to stage a %llu-byte message from rank %d",
                              (unsigned long long)hdr->nbytes, peer);
        }
        ctx->staged_bytes += hdr->nbytes;
        if (slot >= 0 && ctx->tp[slot].rcache != NULL) {
            xccl_status_t st = xccl_rcache_get(ctx->tp[slot].rcache, u->data, hdr->nbytes,
                                               XCCL_MEM_HOST, &u->reg, &dst->mr);
            if (st < 0) {
                ctx->staged_bytes -= hdr->nbytes;
                free(u->data);
                u->next        = ctx->umsg_pool;
                ctx->umsg_pool = u;
                ctx->umsg_pool_n++;
                return st;
            }
            u->rc = ctx->tp[slot].rcache;
        }
    }
    u->next = NULL;
    u->prev = ctx->unexp_tail;
    if (ctx->unexp_tail) ctx->unexp_tail->next = u;
    else ctx->unexp_head = u;
    ctx->unexp_tail = u;
    umsg_link_comm(c, u);
    dst->ptr = u->data;
    *cookie  = u;
    return XCCL_OK;
}

/* A staged receive's message is in its bounce buffer (st: how the transport finished): the
 * executor of the receive's memory type copies it out, and the request completes when that
 * copy has (copies_progress) - the bounce buffer returns to the pool only then. */
static void stage_recv_copy(xccl_ctx_t *ctx, xccl_req_t *r, xccl_status_t st)
{
    const xccl_exec_ops_t *ex = xccl_exec_for(r->mem);
    void                  *ev = NULL;

    if (r->reg != NULL) { /* the transport let go of the bounce buffer */
        xccl_rcache_put(ctx->tp[r->tp].rcache, r->reg);
        r->reg = NULL;
    }
    if (st == XCCL_OK && ex == NULL)
        st = XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                        "receive from rank %d into %s memory: no executor for that memory "
                        "type in this process",
                        r->src, xccl_mem_type_name(r->mem));
    if (st == XCCL_OK && r->received > 0) {
        st = ex->copy(req_queue(r, ex->mem), r->buf, r->sbuf->p, r->received, &ev);
        if (st == XCCL_INPROGRESS) {
            r->ev       = ev;
            r->tp       = -1;
            r->next     = ctx->copies;
            ctx->copies = r;
            return;
        }
        if (st < 0) st = stage_out_failed(r, st);
    }
    stage_put(ctx, r->sbuf);
    r->sbuf = NULL;
    req_complete(ctx, r, st);
}

static void up_recv_done(void *core, void *cookie, xccl_status_t st)
{
    xccl_ctx_t *ctx = ((tp_core_t *)core)->ctx;

    if (cookie == NULL) return;
    if (*(int *)cookie == COOKIE_REQ) {
        xccl_req_t *r = cookie;
        if (r->status == XCCL_ERR_INVALID_USAGE && st == XCCL_OK) {
            st = XCCL_ERROR(XCCL_ERR_INVALID_USAGE,
                            "receive buffer of %zu bytes is smaller than the %zu-byte message "
                            "from rank %d",
                            r->nbytes, r->received, r->src);
        } else if (r->status == XCCL_ERR_NOT_SUPPORTED && st == XCCL_OK) {
            st = XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                            "receive of %zu bytes from rank %d into %s memory: transport %s "
                            "cannot deliver into that memory type",
                            r->received, r->src, xccl_mem_type_name(r->mem),
                            ctx->tp[r->tp].ops->name);
        } else if (r->status == XCCL_ERR_NO_MEMORY && st == XCCL_OK) {
            st = XCCL_ERROR(XCCL_ERR_NO_MEMORY,
                            "receive of %zu bytes from rank %d into %s memory: no host memory "
                            "for its staging buffer",
                            r->received, r->src, xccl_mem_type_name(r->mem));
        }
        if (r->sbuf != NULL) {
            stage_recv_copy(ctx, r, st);
            return;
        }
        req_complete(ctx, r, st);
        return;
    }
    {
        xccl_umsg_t *u = cookie;
        u->done        = 1;
        u->status      = st;
        if (u->reg != NULL) { /* the transport let go of the staging buffer */
            xccl_rcache_put(u->rc, u->reg);
            u->reg = NULL;
        }
        if (tag_kind(u->hdr.tag) == TAG_KIND_CTRL && xccl_coll_ctrl_arrived(ctx, u))
            u->hdr.tag = ~0ull;
        if (u->hdr.tag == ~0ull) { /* discarded payload */
            umsg_free(ctx, u);
            return;
        }
        if (u->waiter != NULL) umsg_deliver(ctx, u, u->waiter);
    }
}

static void up_send_done(void *core, void *cookie, xccl_status_t st)
{
    req_complete(((tp_core_t *)core)->ctx, cookie, st);
}

static void up_peer_failed(void *core, int peer, xccl_status_t st, const char *why)
{
    xccl_ctx_t *ctx = ((tp_core_t *)core)->ctx;
    xccl_req_t *r, *next;
    char        msg[512];
    int         failed = 0;

    if (ctx->peer_dead[peer] == NULL) ctx->peer_dead[peer] = strdup(why ? why : "failed");
    snprintf(msg, sizeof(msg), "rank %d (world) failed: %s", peer, why ? why : "failed");
    /* receives posted for it, on every communicator it belongs to (destroyed ones have none;
     * live ones are not freed by this, so the table does not change under the walk) */
    for (size_t i = 0; i < ctx->comms.cap; i++) {
        xccl_comm_t *c = ctx->comms.vals[i];
        int          idx;
        if (ctx->comms.keys[i] == 0 || c->destroyed || (idx = c->rank_of[peer]) < 0) continue;
        for (r = c->posted[idx].head; r != NULL; r = next) {
            next = r->next;
            posted_unlink(ctx, r);
            xccl_error_set(st, "%s", msg);
            req_complete(ctx, r, st);
            failed++;
        }
    }
    /* unexpected messages still arriving from the peer will never complete */
    for (xccl_umsg_t *u = ctx->unexp_head; u != NULL; u = u->next) {
        if (u->src == peer && !u->done) {
            u->done   = 1;
            u->status = st;
            failed++;
            if (u->waiter != NULL) {
                xccl_error_set(st, "%s", msg);
                umsg_deliver(ctx, u, u->waiter);
                break; /* the list changed; remaining entries fail on their own receive */
            }
        }
    }
    /* A peer that leaves with nothing of ours waiting on it is how a job ends (ranks finalize
     * in any order): not a warning. Sends still queued to it fail through send_done, and a
     * later operation that needs it fails with this reason. */
    if (failed > 0) XCCL_WARN("%s (%d pending receive(s) failed)", msg, failed);
    else XCCL_INFO("%s", msg);
}

/* The upcall table of the transport initialised k-th (its slot until unused ones are
 * dropped). */
static const xccl_tp_upcalls_t *ctx_upcalls(xccl_ctx_t *ctx, int k)
{
    xccl_tp_upcalls_t *up = &ctx->tp_up[k];

    ctx->tp_core[k]  = (tp_core_t){ctx, k};
    up->core         = &ctx->tp_core[k];
    up->recv_match   = up_recv_match;
    up->recv_done    = up_recv_done;
    up->send_done    = up_send_done;
    up->peer_failed  = up_peer_failed;
    return up;
}

/* ------------------------------------------------------------------------------------------ */
/* Posting                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* Hands send r (active, held) to the transport in `slot`: the bytes at ptr, of memory type
 * mem (reg_len: the span a registering transport registers). On failure the request is as
 * before (the caller completes or fails it). */
static xccl_status_t tp_send(xccl_ctx_t *ctx, xccl_req_t *r, int slot, void *ptr,
                             xccl_mem_type_t mem, size_t reg_len)
{
    xccl_msg_hdr_t hdr = {.comm_id = r->comm_id, .tag = r->tag, .fp = r->fp, .nbytes = r->nbytes};
    xccl_tp_buf_t  buf = {.ptr = ptr, .mem = mem, .mr = NULL};
    tp_slot_t     *tp  = &ctx->tp[slot];
    xccl_status_t  st;

    if (tp->rcache != NULL && r->nbytes > 0)
        XCCL_CHECK(xccl_rcache_get(tp->rcache, ptr, reg_len, mem, &r->reg, &buf.mr));
    r->tp = slot;
    st    = tp->ops->isend(tp->ctx, r->peer, &hdr, &buf, r);
    if (st < 0) {
        r->tp = -1;
        if (r->reg != NULL) {
            xccl_rcache_put(tp->rcache, r->reg);
            r->reg = NULL;
        }
    }
    return st;
}

static void stage_unlink(xccl_ctx_t *ctx, xccl_req_t *r, xccl_req_t *prev)
{
    if (prev != NULL) prev->next = r->next;
    else ctx->stage_head = r->next;
    if (ctx->stage_tail == r) ctx->stage_tail = prev;
    r->next       = NULL;
    r->on_stage_q = 0;
    ctx->stage_pending[r->peer]--;
}

/* Moves the queued sends on: bounce buffers taken in posting order, executor copies issued and
 * tested, and each send handed to its transport once it is ready and every earlier one to the
 * same peer has left. Returns events handled (plus one while an executor copy runs: its
 * completion cannot wake a transport's wait, so the caller must keep polling). */
static int stage_progress(xccl_ctx_t *ctx)
{
    int64_t pass   = ++ctx->stage_pass;
    int     events = 0, pool_wait = 0, copying = 0;

    for (xccl_req_t *r = ctx->stage_head, *prev = NULL, *next; r != NULL; r = next) {
        const xccl_exec_ops_t *ex   = xccl_exec_for(r->mem);
        int                    peer = r->peer;
        xccl_status_t          st   = XCCL_OK;

        next = r->next;
        if (r->ev != NULL) { /* its copy into the bounce buffer runs */
            st = ex->test(r->ev);
            if (st == XCCL_INPROGRESS) {
                copying = 1;
                goto held;
            }
            r->ev = NULL;
            if (st < 0) goto copy_failed;
            r->copied = 1;
        }
        if (r->stage_cancel < 0) {
            st = r->stage_cancel;
            goto fail;
        }
        if (ctx->peer_dead[peer] != NULL) {
            st = XCCL_ERROR(XCCL_ERR_REMOTE, "cannot send to rank %d: %s", peer,
                            ctx->peer_dead[peer]);
            goto fail;
        }
        if (r->staged && r->sbuf == NULL) {
            int oom;
            if (pool_wait) goto held; /* an earlier send waits for the pool: it goes first */
            r->sbuf = stage_get(ctx, r->nbytes, 0, &oom);
            if (r->sbuf == NULL && oom) {
                st = XCCL_ERROR(XCCL_ERR_NO_MEMORY,
                                "send of %zu bytes of %s memory to rank %d: no host memory for "
                                "its staging buffer",
                                r->nbytes, xccl_mem_type_name(r->mem), peer);
                goto fail;
            }
            if (r->sbuf == NULL) {
                pool_wait = 1;
                goto held;
            }
        }
        if (r->staged && !r->copied) {
            void *ev = NULL;
            if (ex == NULL) {
                st = XCCL_ERR_NOT_SUPPORTED;
                goto copy_failed;
            }
            st = ex->copy(req_queue(r, ex->mem), r->sbuf->p, r->buf, r->nbytes, &ev);
            if (st == XCCL_INPROGRESS) {
                r->ev   = ev;
                copying = 1;
                goto held;
            }
            if (st < 0) goto copy_failed;
            r->copied = 1;
        }
        if (ctx->stage_mark[peer] == pass) goto held; /* an earlier one to peer waits */
        stage_unlink(ctx, r, prev);
        if (r->staged) st = tp_send(ctx, r, ctx->peer_tp[peer], r->sbuf->p, XCCL_MEM_HOST,
                                    r->sbuf->cap);
        else {
            int slot = ctx->peer_tp_mem[r->mem * ctx->size + peer];
            if (slot < 0) slot = ctx->peer_tp[peer]; /* no bytes: no memory type to move */
            st       = tp_send(ctx, r, slot, r->buf,
                               (ctx->tp[slot].ops->caps & xccl_tp_cap_for(r->mem)) ? r->mem
                                                                                  : XCCL_MEM_HOST,
                               r->nbytes);
        }
        events++;
        if (st < 0) goto failed_unlinked;
        continue;
    held:
        ctx->stage_mark[peer] = pass;
        prev                  = r;
        continue;
    copy_failed:
        st = XCCL_ERROR(st,
                        "send of %zu bytes of %s memory to rank %d: the copy into the host "
                        "staging buffer failed (%s)",
                        r->nbytes, xccl_mem_type_name(r->mem), peer, xccl_status_string(st));
    fail:
        stage_unlink(ctx, r, prev);
        events++;
    failed_unlinked:
        if (r->sbuf != NULL) {
            stage_put(ctx, r->sbuf);
            r->sbuf = NULL;
        }
        req_complete(ctx, r, st);
    }
    return events + copying;
}

/* Context teardown: the executor copies still running finish before their buffers go. */
static void stage_drain(xccl_ctx_t *ctx)
{
    for (xccl_req_t *r = ctx->stage_head; r != NULL; r = r->next) {
        const xccl_exec_ops_t *ex = xccl_exec_for(r->mem);
        while (r->ev != NULL && ex != NULL && ex->test(r->ev) == XCCL_INPROGRESS) {
        }
        r->ev = NULL;
    }
    for (xccl_req_t *r = ctx->copies; r != NULL; r = r->next) {
        const xccl_exec_ops_t *ex = xccl_exec_for(r->mem);
        while (r->ev != NULL && ex != NULL && ex->test(r->ev) == XCCL_INPROGRESS) {
        }
        r->ev = NULL;
    }
}

xccl_status_t xccl_req_post_send(xccl_ctx_t *ctx, xccl_req_t *r)
{
    xccl_msg_hdr_t hdr = {.comm_id = r->comm_id, .tag = r->tag, .fp = r->fp, .nbytes = r->nbytes};
    int            slot;
    xccl_status_t  st;

    r->ctype  = COOKIE_REQ;
    r->status = XCCL_INPROGRESS;
    r->t0     = trace_now(r);
    r->tp     = -1;
    if (r->peer == ctx->rank) {
        /* self-send: deliver through the matching path, never through a transport; a copy
         * into or out of device memory runs on that memory type's executor (and is waited
         * for here: a self-send has no transport request to complete later) */
        xccl_tp_buf_t dst = {NULL, XCCL_MEM_HOST, NULL};
        void         *cookie = NULL;
        st = up_recv_match(&ctx->self_core, ctx->rank, &hdr, &dst, &cookie);
        if (st < 0) return st;
        if (hdr.nbytes > 0 && dst.ptr != NULL) {
            xccl_mem_type_t        m  = dst.mem != XCCL_MEM_HOST ? dst.mem : r->mem;
            const xccl_exec_ops_t *ex = xccl_exec_for(m);
            void                  *ev = NULL;
            if (ex == NULL)
                return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                                  "send to self from %s memory: no executor for that memory "
                                  "type in this process", xccl_mem_type_name(m));
            st = ex->copy(req_queue(r, ex->mem), dst.ptr, r->buf, hdr.nbytes, &ev);
            while (st == XCCL_INPROGRESS) st = ex->test(ev);
            if (st < 0) return st;
        }
        r->state = REQ_POSTED;
        up_recv_done(&ctx->self_core, cookie, XCCL_OK);
        req_complete(ctx, r, XCCL_OK);
        return XCCL_OK;
    }
    if (ctx->peer_dead[r->peer] != NULL) {
        return XCCL_ERROR(XCCL_ERR_REMOTE, "cannot send to rank %d: %s", r->peer,
                          ctx->peer_dead[r->peer]);
    }
    slot = r->mem < XCCL_MEM_TYPES ? ctx->peer_tp_mem[r->mem * ctx->size + r->peer] : -1;
    if (slot < 0 && r->nbytes == 0 && r->mem < XCCL_MEM_TYPES)
        slot = ctx->peer_tp[r->peer]; /* no data: nothing to stage */
    if (slot < 0 && r->mem < XCCL_MEM_TYPES && ctx->peer_tp[r->peer] >= 0 &&
        xccl_exec_for(r->mem) == NULL)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                          "cannot send %s memory to rank %d (world): no transport between "
                          "these ranks moves that memory type, and this process has no "
                          "executor to stage it through host memory",
                          xccl_mem_type_name(r->mem), r->peer);
    if (slot < 0 && (r->mem >= XCCL_MEM_TYPES || ctx->peer_tp[r->peer] < 0))
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                          "cannot send %s memory to rank %d (world): no transport between "
                          "these ranks moves that memory type",
                          xccl_mem_type_name(r->mem), r->peer);
    if (slot < 0 || ctx->stage_pending[r->peer] > 0) {
        /* staged through a host bounce buffer, or behind a staged send to the same peer
         * (messages leave in posting order): the progress pass moves it on */
        r->staged     = slot < 0;
        r->copied     = 0;
        r->sbuf       = NULL;
        r->ev         = NULL;
        r->stage_cancel = XCCL_OK;
        r->on_stage_q = 1;
        r->state      = REQ_ACTIVE;
        req_hold(r);
        r->next = NULL;
        if (ctx->stage_tail) ctx->stage_tail->next = r;
        else ctx->stage_head = r;
        ctx->stage_tail = r;
        ctx->stage_pending[r->peer]++;
        if (r->staged) ctx->stage_sends++;
        return XCCL_OK;
    }
    r->state = REQ_ACTIVE;
    req_hold(r);
    st = tp_send(ctx, r, slot, r->buf,
                 (ctx->tp[slot].ops->caps & xccl_tp_cap_for(r->mem)) ? r->mem : XCCL_MEM_HOST,
                 r->nbytes);
    if (st < 0) {
        r->state  = REQ_DONE;
        r->status = st;
        if (r->work) req_unhold(r);
    }
    return st;
}

/* The first unexpected message r can take: from its source's queue, or for an any-source
 * receive the earliest arrival of its communicator with its tag. */
static xccl_umsg_t *unexp_find(xccl_ctx_t *ctx, xccl_comm_t *c, const xccl_req_t *r)
{
    xccl_umsg_t *u;

    if (r->peer != XCCL_ANY_SOURCE) {
        int src = c->rank_of[r->peer];
        for (u = src >= 0 ? c->unexp[src].head : NULL; u != NULL; u = u->pnext) {
            ctx->match_probes++;
            if (u->waiter == NULL && u->hdr.tag == r->tag) return u;
        }
        return NULL;
    }
    for (u = c->arrivals.head; u != NULL; u = u->anext) {
        ctx->match_probes++;
        if (u->waiter == NULL && u->hdr.tag == r->tag) return u;
    }
    return NULL;
}

xccl_status_t xccl_req_post_recv(xccl_ctx_t *ctx, xccl_req_t *r)
{
    xccl_comm_t *c = r->work->comm;
    xccl_umsg_t *u;

    r->ctype  = COOKIE_REQ;
    r->status = XCCL_INPROGRESS;
    r->t0     = trace_now(r);
    u         = c->arrivals.head != NULL ? unexp_find(ctx, c, r) : NULL;
    if (u != NULL) {
        if (u->done) {
            r->state = REQ_POSTED;
            umsg_deliver(ctx, u, r);
        } else {
            r->state  = REQ_POSTED;
            r->umsg   = u;
            u->waiter = r;
        }
        return XCCL_OK;
    }
    if (r->peer != XCCL_ANY_SOURCE && r->peer != ctx->rank && ctx->peer_dead[r->peer] != NULL) {
        return XCCL_ERROR(XCCL_ERR_REMOTE, "cannot receive from rank %d: %s", r->peer,
                          ctx->peer_dead[r->peer]);
    }
    r->state = REQ_POSTED;
    posted_link(c, r);
    return XCCL_OK;
}

void xccl_req_cancel(xccl_ctx_t *ctx, xccl_req_t *r, xccl_status_t st, const char *why)
{
    if (r->state == REQ_DONE) return;
    if (r->state == REQ_POSTED) {
        if (r->umsg != NULL) {
            r->umsg->waiter = NULL;
            r->umsg         = NULL;
        } else {
            posted_unlink(ctx, r);
        }
        r->state  = REQ_DONE;
        r->status = st;
        return;
    }
    /* a transport holds the buffer: drop that connection so it lets go now (an executor's
     * copy out of a staged message cannot be recalled: it completes the request when done) */
    if (r->tp >= 0) {
        int        peer = xccl_req_world_peer(r); /* a transport holds it: matched */
        tp_slot_t *tp   = &ctx->tp[r->tp];
        if (tp->ops->close_peer != NULL) tp->ops->close_peer(tp->ctx, peer, why);
    } else if (r->on_stage_q) {
        /* a send being staged: fails in the next progress pass, once an executor copy it
         * started has finished with the bounce buffer */
        r->stage_cancel = st < 0 ? st : XCCL_ERR_TIMEOUT;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Progress                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* Every active collective is progressed, in posting order, and every Work past its deadline
 * expired; a deadline check costs O(1) while nothing expires (ctx->dl is ordered). Progressing
 * one Work can finish others (a transport flushes queued sends, a mismatch notice arrives),
 * and an expiry's diagnosis may let other threads in: the walks are cursors that the unlink of
 * a finished Work moves on (active_unlink in work.c), and the Work in hand is referenced. */
int xccl_ctx_progress_locked(xccl_ctx_t *ctx)
{
    xccl_cursor_t cur = {.w = ctx->coll_head, .dl = 0, .up = ctx->cursors};
    xccl_work_t  *w;
    int           events = 0;
    int64_t       now;

    for (int i = 0; i < ctx->ntp; i++) {
        int k = 0;
        (void)ctx->tp[i].ops->progress(ctx->tp[i].ctx, &k);
        events += k;
    }
    if (ctx->copies != NULL) events += copies_progress(ctx) + (ctx->copies != NULL);
    if (ctx->stage_head != NULL) events += stage_progress(ctx);
    if (ctx->hold_head != NULL) events += xccl_p2p_hold_progress(ctx);
    ctx->cursors = &cur;
    ctx->shwait = NULL; /* set again below by a task that waits on a segment */
    while ((w = cur.w) != NULL) {
        uint64_t before[XCCL_TASK_STATE_WORDS];
        int      shared = w->kind == WORK_COLL && w->task.shared_epoch != 0;
        cur.w           = w->next;
        xccl_work_retain(w);
        if (shared) memcpy(before, w->task.state, sizeof(before));
        xccl_work_progress_locked(w);
        if (!w->active) events++;
        /* executor events cannot wake a transport's wait: keep the caller polling them */
        else if (w->kind == WORK_COLL && w->task.nev > 0) events++;
        /* nor can flags in a node-shared segment: an algorithm that moved on is an event,
         * and one that waits there is watched (its peers' liveness) */
        else if (shared) events += xccl_shared_after(w, before);
        xccl_work_release(w);
    }
    now = xccl_now_ms();
    cur.w  = ctx->dl_head;
    cur.dl = 1;
    while ((w = cur.w) != NULL && now > w->deadline_ms) {
        cur.w = w->dl_next;
        if (w->expiring) continue; /* another walk is expiring it */
        xccl_work_retain(w);
        xccl_work_expire(w);
        if (!w->active) events++;
        xccl_work_release(w);
    }
    for (xccl_cursor_t **pp = &ctx->cursors; *pp != NULL; pp = &(*pp)->up) {
        if (*pp == &cur) { /* not always the top: an expiry may have let another pass in */
            *pp = cur.up;
            break;
        }
    }
    return events;
}

void xccl_ctx_sleep(xccl_ctx_t *ctx, int timeout_ms)
{
    struct pollfd pfd[XCCL_MAX_TRANSPORTS];
    unsigned      armed = 0; /* bit i: tp[i] was armed and must be disarmed */
    int           nfd = 0, cap = 0, i;

    /* one transport: its own wait (a direct epoll_wait / futex wait) */
    if (ctx->ntp == 1 && ctx->tp[0].ops->wait != NULL) {
        ctx->tp[0].ops->wait(ctx->tp[0].ctx, timeout_ms);
        return;
    }
    if (timeout_ms <= 0) return;
    /* several: arm every one, then one poll over their descriptors (xccl_transport.h,
     * Sleeping); a transport with something to do now cancels the sleep */
    for (i = 0; i < ctx->ntp; i++) {
        const xccl_transport_ops_t *ops = ctx->tp[i].ops;
        int                         fd  = -1;
        if (ops->wait_arm == NULL) {
            cap = 1;
            continue;
        }
        if (!ops->wait_arm(ctx->tp[i].ctx, &fd)) break;
        armed |= 1u << i;
        if (fd >= 0) {
            pfd[nfd].fd      = fd;
            pfd[nfd].events  = POLLIN;
            pfd[nfd].revents = 0;
            nfd++;
        } else {
            cap = 1;
        }
    }
    if (i == ctx->ntp) (void)poll(pfd, (nfds_t)nfd, cap && timeout_ms > 1 ? 1 : timeout_ms);
    for (i = 0; i < ctx->ntp; i++) {
        if ((armed & (1u << i)) && ctx->tp[i].ops->wait_disarm != NULL)
            ctx->tp[i].ops->wait_disarm(ctx->tp[i].ctx);
    }
}

void xccl_ctx_run_callbacks(xccl_ctx_t *ctx)
{
    xccl_work_t *list;

    pthread_mutex_lock(&ctx->lock);
    list           = ctx->done_head;
    ctx->done_head = NULL;
    pthread_mutex_unlock(&ctx->lock);
    while (list != NULL) {
        xccl_work_t *w = list;
        list           = w->cnext;
        if (w->cb != NULL) w->cb(w, w->cb_arg);
        xccl_work_release(w);
    }
}

void xccl_ctx_wake_thread(xccl_ctx_t *ctx)
{
    pthread_cond_signal(&ctx->cond);
    for (int i = 0; i < ctx->ntp; i++) {
        if (ctx->tp[i].ops->wake) ctx->tp[i].ops->wake(ctx->tp[i].ctx);
    }
}

static void *progress_thread_main(void *arg)
{
    xccl_ctx_t    *ctx = arg;
    xccl_shsleep_t sh  = {0};

    /* named, so that tools (top -H, /proc/<pid>/task/<tid>/comm, tests) can tell it apart */
    (void)pthread_setname_np(pthread_self(), "xccl-progress");
    /* its naps while device work runs (xccl_device_nap) are tens of microseconds: without
     * this, the kernel would round each up by its default slack of 50 us */
    (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    pthread_mutex_lock(&ctx->lock);
    while (!ctx->stopping) {
        if (ctx->nasync == 0 || ctx->nwaiters > 0) {
            xccl_shared_disarm(&sh);
            /* nothing to drive, or a waiter drives: sleep, waking now and then for deadlines */
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += (ctx->nasync > 0 ? 2 : 20) * 1000000; /* tick: see count_async */
            if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
            }
            pthread_cond_timedwait(&ctx->cond, &ctx->lock, &ts);
            if (ctx->nwaiters == 0) { /* idle too: answers diag queries (diag.c) */
                (void)xccl_ctx_progress_locked(ctx);
            }
            if (ctx->done_head != NULL) {
                pthread_mutex_unlock(&ctx->lock);
                xccl_ctx_run_callbacks(ctx);
                pthread_mutex_lock(&ctx->lock);
            }
        } else {
            int n = xccl_ctx_progress_locked(ctx);
            if (n > 0) xccl_shared_disarm(&sh);
            /* a task waits on a node-shared segment: sleep on its doorbell, counted as a
             * sleeper before one more pass (shared.c, "Waiting on memory") */
            if (n == 0 && sh.comm == NULL && xccl_shared_arm(ctx, &sh)) continue;
            /* while device work runs, every pass lets go of the lock: such a pass often counts
             * as progress only because it polled the device, and a thread that never let go
             * would starve callers posting or waiting meanwhile */
            int device = ctx->ndevice > 0;
            if (ctx->done_head != NULL || n == 0 || device) {
                pthread_mutex_unlock(&ctx->lock);
                xccl_ctx_run_callbacks(ctx);
                if (device && n > 0) sched_yield();
                else if (device) xccl_device_nap();
                else if (n == 0 && sh.comm != NULL) xccl_shared_doze(&sh, 1);
                else if (n == 0) xccl_ctx_sleep(ctx, 5);
                pthread_mutex_lock(&ctx->lock);
                xccl_shared_disarm(&sh);
            }
        }
    }
    xccl_shared_disarm(&sh);
    pthread_mutex_unlock(&ctx->lock);
    return NULL;
}

void xccl_device_nap(void)
{
    struct timespec ts = {0, XCCL_DEVICE_NAP_NS};
    (void)nanosleep(&ts, NULL);
}

void xccl_ctx_start_thread(xccl_ctx_t *ctx)
{
    if (ctx->thread_started || xccl_env_int("XCCL_PROGRESS_THREAD", 1) == 0) return;
    if (pthread_create(&ctx->thread, NULL, progress_thread_main, ctx) == 0)
        ctx->thread_started = 1;
}
