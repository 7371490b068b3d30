/* SPDX-License-Identifier: Apache-2.0
 *
 * shared.c - node-shared memory for the algorithms built for the ranks of one host: the core's
 * side of task.h's "Node-shared memory" (who may use it, the segment of a communicator, its
 * ownership by epoch, waiting on it, reads from peers' memory).
 *
 * Who (topo.shared, xccl_shared_bits): every rank publishes at bootstrap, beside its peer info,
 * a self-assessment (xccl_core_info_t): XCCL_CI_SHARED ($XCCL_SHARED is not 0, an intra-host
 * transport was asked for and started), XCCL_CI_CMA ($XCCL_SHARED_CMA is not 0, the system call
 * works here, ptrace policy lets processes of our user read us), its uid and pid namespace. A
 * communicator gets XCCL_SHARED_SEG when it has more than one member, all on one node (topo.c)
 * and all with XCCL_CI_SHARED, and the policy wants a segment for its size; XCCL_SHARED_CMA too
 * when all members have XCCL_CI_CMA, one uid and one pid namespace. Every member computes this
 * from the same peer table, never from a probe of its own, so every member gets the same bits
 * and selects the same algorithms (a rank that cannot read its peers says so in its record,
 * and everybody then does without). The environment variables need not even agree: one rank
 * with XCCL_SHARED=0 turns the segment off for every communicator it belongs to.
 *
 * The segment of a communicator: POSIX shm "/xcclseg-<job id>-<comm id>-<pid of rank 0>"
 * (16 hex digits each), mode 0600, made on first use (the first grant), never at creation:
 *
 *   offset        size                      what
 *   0             SHSEG_HDR (one page)      shseg_hdr_t: magic, ids, layout, attach count,
 *                                           doorbell futex word and its sleeper count
 *   SHSEG_HDR     shared_bytes(size),       the algorithms' area (xccl_shared_t.base), zero
 *                 rounded up to a page      when created
 *
 *   Rank 0 creates it (O_EXCL), takes an OFD write lock on it, sizes and reserves it
 *   (posix_fallocate: a full /dev/shm fails here, not with SIGBUS later), maps it, fills the
 *   header with attached = 1 and stores the magic last (release). The others open it when the
 *   name exists, the size is right and the magic is there (each step: XCCL_INPROGRESS until
 *   then; nothing blocks), check the header and count themselves in `attached`; the one that
 *   makes it `size` removes the name. From then on no name is left however the processes end.
 *   Rank 0 keeps its descriptor (and so the lock) until everybody attached. A name left by a
 *   job killed before that is removed by the sweep at the next context creation on the host
 *   (xccl_shared_sweep): names of ours no process holds the lock of, whose creator is dead or
 *   that are older than SHSEG_ORPHAN_AGE_S (a creator takes the lock right after creating the
 *   file, and a creator in another pid namespace has a pid that means nothing here). A member
 *   destroying its communicator unmaps the segment; rank 0 also removes the name if somebody
 *   never attached.
 *
 * Ownership: coll_post numbers the collectives of shared algorithms (epoch 1, 2, ... per
 * communicator, under the context lock, in posting order, so every member numbers alike). A
 * task is granted the segment when no Work of an earlier epoch is active on this rank (the
 * first Work with an epoch on comm->works is its own): completion and failure both take a Work
 * off that list, so the grant passes on however the previous one ended (success, error,
 * timeout, abort, destroy) and no separate release exists.
 *
 * Waiting on memory: a task that calls xccl_task_shared_wait and returns XCCL_INPROGRESS is
 * polled again on every progress pass; a pass in which its state words changed counts as an
 * event (the waiters' spin window restarts). Once their spin window passed, idle threads sleep
 * on the segment's doorbell instead of in the transports, at most SHSEG_DOZE_MS at a time (the
 * transports and deadlines are served between naps):
 *     sleeper:  sleepers++ (seq_cst); fence; v = bell; a full progress pass; FUTEX_WAIT(bell, v)
 *     signaller: release stores of flags; fence (seq_cst); sleepers != 0 -> bell++, FUTEX_WAKE
 * Either the pass after the sleeper counted itself sees the flag, or the signaller sees the
 * sleeper and moves the bell, so no wake-up is lost; nobody sleeping costs the signaller one
 * load. A peer that dies while others wait for its writes: each waiting task checks the rank
 * it waits for (all members for -1) every SHSEG_LIVENESS_MS, through a pidfd per member opened
 * when the segment is first asked for (kill(pid, 0) where pidfd_open fails; nothing in another
 * pid namespace, where only the transports' verdict, ctx->peer_dead, counts), and fails with
 * XCCL_ERR_REMOTE naming the rank, its pid, the operation and the epoch.
 *
 * Cross-memory reads (xccl_task_peer_read): process_vm_readv from the peer's pid, continued
 * after partial reads; ESRCH (the peer exited) is XCCL_ERR_REMOTE, EPERM names the ptrace
 * policy and XCCL_SHARED_CMA=0, EFAULT names the rank and both address ranges. Each read is a
 * receive in the trace (transport "cma").
 */
#include "core/core.h"

#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

const xccl_algo_policy_t *xccl_core_policy = &xccl_algo_policy;

#define SHSEG_PREFIX       "xcclseg-"
#define SHSEG_NAME_MAX     80
#define SHSEG_MAGIC        0x4745534c43435858ull /* "XXCCLSEG" as a little-endian uint64 */
#define SHSEG_VERSION      1
#define SHSEG_HDR          ((size_t)4096) /* the header's page                     */
#define SHSEG_LIVENESS_MS  50
#define SHSEG_DOZE_MS      1
#define SHSEG_ORPHAN_AGE_S 2
#define SHSEG_READ_MAX     ((size_t)1 << 30) /* bytes per process_vm_readv call           */

/* The core's header at the start of the segment (the algorithms never see it). The counters
 * every rank writes sit on cache lines of their own. */
typedef struct shseg_hdr {
    _Atomic uint64_t magic; /* SHSEG_MAGIC once the rest is valid (stored last, release)   */
    uint32_t         version;
    uint32_t         size; /* members                                                     */
    uint64_t         job_id, comm_id;
    uint64_t         bytes;   /* the algorithms' area                                     */
    uint64_t         total;   /* the file                                                 */
    int32_t          creator; /* pid of rank 0                                            */
    _Alignas(64) _Atomic uint32_t attached; /* members that mapped it, rank 0 included   */
    _Alignas(64) _Atomic uint32_t bell;     /* the doorbell (futex word)                  */
    _Atomic uint32_t sleepers;              /* threads counted to sleep on it             */
} shseg_hdr_t;

_Static_assert(sizeof(shseg_hdr_t) <= SHSEG_HDR, "the segment header fits its page");

enum { SEG_OPENING = 0, SEG_READY, SEG_FAILED };

/* This rank's view of its communicator's segment (comm->shseg). */
struct xccl_shseg {
    int            state;
    int            leader; /* comm rank 0: creates it                                     */
    char           name[SHSEG_NAME_MAX];
    int            fd;     /* rank 0: open (holding the lock) until everybody attached    */
    int            linked; /* rank 0: the name may still exist                            */
    unsigned char *map;
    size_t         total, bytes;
    shseg_hdr_t   *hdr;
    int           *pidfd; /* per comm rank: a pidfd, -1: watch with kill(), -2: not at all */
    char          *error; /* SEG_FAILED: why (every later request fails with it)            */
};

/* ------------------------------------------------------------------------------------------ */
/* Bootstrap: what this rank says of itself, and what the members have in common              */
/* ------------------------------------------------------------------------------------------ */

/* Yama's ptrace_scope (0 when the module is absent). */
static int yama_scope(void)
{
    FILE *f = fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
    int   v = 0;

    if (f == NULL) return 0;
    if (fscanf(f, "%d", &v) != 1) v = 3; /* unreadable: assume the worst */
    fclose(f);
    return v;
}

/* Contexts of this process that let processes of its user read it past Yama's scope 1
 * (prctl PR_SET_PTRACER_ANY): the relaxation lasts while one of them lives. */
static atomic_int ptracer_users;

/* Whether processes of our user on this host can read this process's memory, and this process
 * theirs, with process_vm_readv. Only facts about this process: the peers' side is their own
 * record. *relaxed: this call relaxed Yama's restriction (xccl_shared_ptracer decides whether
 * that stays). */
static int cma_self_ok(const char **why, int *relaxed)
{
    volatile uint64_t src = 0x600dcafeull;
    uint64_t          dst = 0;
    struct iovec      l   = {&dst, sizeof(dst)};
    struct iovec      r   = {(void *)&src, sizeof(src)};
    int               scope;

    /* the call itself: missing (ENOSYS) or filtered (seccomp: EPERM, as in default container
     * profiles) shows on a read of our own memory, which no ptrace policy forbids */
    if (process_vm_readv(getpid(), &l, 1, &r, 1, 0) != (ssize_t)sizeof(dst) || dst != src) {
        *why = errno == ENOSYS ? "the kernel has no process_vm_readv"
                               : "process_vm_readv is refused here (a seccomp filter?)";
        return 0;
    }
    /* a process that is not dumpable can be read by privileged processes only */
    if (prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 1) {
        *why = "this process is not dumpable (prctl PR_SET_DUMPABLE)";
        return 0;
    }
    scope = yama_scope();
    if (scope == 0) return 1;
    if (scope >= 2) {
        *why = "/proc/sys/kernel/yama/ptrace_scope is 2 or more (only privileged processes may "
               "read others)";
        return 0;
    }
#ifdef PR_SET_PTRACER
    /* scope 1 lets only ancestors read a process unless it names its readers: let every
     * process of our user read this one, as without Yama, while a context with peers on this
     * host lives (XCCL_SHARED_CMA=0 keeps the restriction, and cross-memory reads off) */
    if (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0) {
        *relaxed = 1;
        return 1;
    }
#endif
    *why = "/proc/sys/kernel/yama/ptrace_scope is 1 and prctl(PR_SET_PTRACER) failed";
    return 0;
}

int xccl_shared_self_info(xccl_core_info_t *ci, int intra_asked, uint64_t pid_ns)
{
    const char *why     = NULL;
    int         relaxed = 0;

    memset(ci, 0, sizeof(*ci));
    ci->uid    = (uint32_t)geteuid();
    ci->pid_ns = pid_ns;
    if (!intra_asked || xccl_env_int("XCCL_SHARED", 1) == 0) return 0;
    ci->flags |= XCCL_CI_SHARED;
    if (xccl_env_int("XCCL_SHARED_CMA", 1) == 0) return 0;
    if (cma_self_ok(&why, &relaxed))
        ci->flags |= XCCL_CI_CMA;
    else
        XCCL_INFO("node-shared memory: no cross-memory reads: %s", why);
    return relaxed;
}

void xccl_shared_ptracer(int hold)
{
    if (hold > 0) {
        atomic_fetch_add(&ptracer_users, 1);
        return;
    }
    if (hold < 0 && atomic_fetch_sub(&ptracer_users, 1) != 1) return;
    if (hold == 0 && atomic_load(&ptracer_users) != 0) return;
#ifdef PR_SET_PTRACER
    (void)prctl(PR_SET_PTRACER, 0, 0, 0, 0); /* back to Yama's default for this process */
#endif
}

unsigned xccl_shared_bits(const xccl_comm_t *comm)
{
    const xccl_ctx_t       *ctx = comm->ctx;
    const xccl_core_info_t *c0;
    unsigned                bits = XCCL_SHARED_SEG | XCCL_SHARED_CMA;

    /* from the peer table and the policy alone: the same on every member (see the top) */
    if (comm->size < 2 || comm->topo.nnodes != 1 || ctx->cinfo == NULL ||
        xccl_core_policy->shared_bytes == NULL || xccl_core_policy->shared_bytes(comm->size) == 0)
        return 0;
    c0 = &ctx->cinfo[comm->world[0]];
    for (int i = 0; i < comm->size; i++) {
        const xccl_core_info_t *ci = &ctx->cinfo[comm->world[i]];
        if (!(ci->flags & XCCL_CI_SHARED)) return 0;
        if (!(ci->flags & XCCL_CI_CMA) || ci->uid != c0->uid || ci->pid_ns != c0->pid_ns ||
            ci->pid_ns == 0)
            bits &= ~(unsigned)XCCL_SHARED_CMA;
    }
    return bits;
}

/* "/xcclseg-<job>-<comm>-<pid>" */
static void seg_name(char *buf, size_t len, uint64_t job, uint64_t comm_id, int32_t pid)
{
    snprintf(buf, len, "/" SHSEG_PREFIX "%016" PRIx64 "-%016" PRIx64 "-%d", job, comm_id, (int)pid);
}

void xccl_shm_sweep(const char *prefix, int min_age_s, int (*creator_dead)(const char *name),
                    const char *who)
{
    DIR           *d = opendir("/dev/shm");
    struct dirent *e;
    time_t         now = time(NULL);

    if (d == NULL) return;
    while ((e = readdir(d)) != NULL) {
        struct stat  st;
        struct flock fl;
        char         name[NAME_MAX + 2];
        int          fd;

        if (strncmp(e->d_name, prefix, strlen(prefix)) != 0) continue;
        fd = openat(dirfd(d), e->d_name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        if (fd < 0) continue;
        memset(&fl, 0, sizeof(fl));
        fl.l_type   = F_WRLCK;
        fl.l_whence = SEEK_SET;
        if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() &&
            fcntl(fd, F_OFD_GETLK, &fl) == 0 && fl.l_type == F_UNLCK &&
            (now - st.st_ctime > min_age_s ||
             (creator_dead != NULL && creator_dead(e->d_name))) &&
            snprintf(name, sizeof(name), "/%s", e->d_name) > 0 && shm_unlink(name) == 0)
            XCCL_INFO("%s: removed %s, left by a process that died", who, name);
        close(fd);
    }
    closedir(d);
}

/* A segment name of ours whose creator (the pid in it) no longer exists. */
static int seg_creator_dead(const char *name)
{
    unsigned long long job, cid;
    int                pid, n = 0;

    if (sscanf(name, SHSEG_PREFIX "%16llx-%16llx-%d%n", &job, &cid, &pid, &n) != 3 ||
        name[n] != '\0' || pid <= 0)
        return 0;
    return kill(pid, 0) != 0 && errno == ESRCH;
}

void xccl_shared_sweep(void)
{
    xccl_shm_sweep(SHSEG_PREFIX, SHSEG_ORPHAN_AGE_S, seg_creator_dead, "node-shared memory");
}

/* ------------------------------------------------------------------------------------------ */
/* The segment                                                                                 */
/* ------------------------------------------------------------------------------------------ */

static size_t page_round(size_t n)
{
    long   pg = sysconf(_SC_PAGESIZE);
    size_t p  = pg > 0 ? (size_t)pg : 4096;

    return (n + p - 1) / p * p;
}

/* The peers' processes, watched while tasks wait for their writes. */
static void seg_watch_open(xccl_comm_t *comm, struct xccl_shseg *s)
{
    const xccl_ctx_t *ctx = comm->ctx;
    uint64_t          ns  = ctx->cinfo[ctx->rank].pid_ns;

    for (int i = 0; i < comm->size; i++) {
        const xccl_core_info_t *ci = &ctx->cinfo[comm->world[i]];
        s->pidfd[i]                = -2;
        if (i == comm->rank || ns == 0 || ci->pid_ns != ns) continue;
        s->pidfd[i] = xccl_pidfd_open(ctx->peers[comm->world[i]].pid);
        if (s->pidfd[i] < 0) s->pidfd[i] = -1;
    }
}

static xccl_status_t seg_fail(struct xccl_shseg *s, xccl_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static xccl_status_t seg_fail(struct xccl_shseg *s, xccl_status_t st, const char *fmt, ...)
{
    char    msg[512];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    s->state = SEG_FAILED;
    free(s->error);
    s->error = strdup(msg);
    return xccl_error_report(st, __FILE__, __LINE__, "%s", msg);
}

/* Rank 0: creates, reserves, maps and publishes the segment. Never waits for anybody. */
static xccl_status_t seg_create(xccl_comm_t *comm, struct xccl_shseg *s)
{
    struct flock fl;
    int          e;
    void        *m;

    s->fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (s->fd < 0)
        return seg_fail(s, XCCL_ERR_SYSTEM,
                        "comm '%s' rank 0: cannot create the node-shared segment %s: %s "
                        "(XCCL_SHARED=0 does without it)",
                        comm->name, s->name, strerror(errno));
    s->linked = 1;
    /* held until everybody attached: the sweep leaves a locked name alone */
    memset(&fl, 0, sizeof(fl));
    fl.l_type   = F_WRLCK;
    fl.l_whence = SEEK_SET;
    if (fcntl(s->fd, F_OFD_SETLK, &fl) != 0)
        XCCL_INFO("node-shared memory: cannot lock %s (%s)", s->name, strerror(errno));
    e = ftruncate(s->fd, (off_t)s->total) != 0 ? errno : posix_fallocate(s->fd, 0, (off_t)s->total);
    if (e != 0)
        return seg_fail(s, XCCL_ERR_SYSTEM,
                        "comm '%s' rank 0: cannot reserve %zu KiB in /dev/shm for the "
                        "node-shared segment %s: %s (XCCL_SHARED=0 does without it)",
                        comm->name, s->total >> 10, s->name, strerror(e));
    m = mmap(NULL, s->total, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
    if (m == MAP_FAILED)
        return seg_fail(s, XCCL_ERR_SYSTEM,
                        "comm '%s' rank 0: cannot map the node-shared segment %s (%zu bytes): %s",
                        comm->name, s->name, s->total, strerror(errno));
    s->map          = m;
    s->hdr          = m;
    s->hdr->version = SHSEG_VERSION;
    s->hdr->size    = (uint32_t)comm->size;
    s->hdr->job_id  = comm->ctx->job_id;
    s->hdr->comm_id = comm->id;
    s->hdr->bytes   = s->bytes;
    s->hdr->total   = s->total;
    s->hdr->creator = comm->ctx->peers[comm->world[0]].pid;
    atomic_store_explicit(&s->hdr->attached, 1, memory_order_relaxed);
    atomic_store_explicit(&s->hdr->magic, SHSEG_MAGIC, memory_order_release);
    s->state = SEG_READY;
    return XCCL_OK;
}

/* The others: one step towards a mapped, checked, counted segment; XCCL_INPROGRESS while rank 0
 * has not made it yet. */
static xccl_status_t seg_attach(xccl_comm_t *comm, struct xccl_shseg *s)
{
    const shseg_hdr_t *h;
    struct stat        sb;
    uint32_t           n;
    uint64_t           magic;

    if (s->map == NULL) {
        int   fd = shm_open(s->name, O_RDWR | O_CLOEXEC, 0);
        void *m;
        if (fd < 0) {
            if (errno == ENOENT) return XCCL_INPROGRESS;
            return seg_fail(s, XCCL_ERR_SYSTEM,
                            "comm '%s' rank %d: cannot open the node-shared segment %s of rank 0: "
                            "%s",
                            comm->name, comm->rank, s->name, strerror(errno));
        }
        if (fstat(fd, &sb) != 0 || sb.st_size == 0) { /* rank 0 has not sized it yet */
            close(fd);
            return XCCL_INPROGRESS;
        }
        if ((uint64_t)sb.st_size != s->total) {
            close(fd);
            return seg_fail(s, XCCL_ERR_REMOTE,
                            "comm '%s' rank %d: the node-shared segment %s of rank 0 has %lld "
                            "bytes, this rank expects %zu: the ranks run different builds?",
                            comm->name, comm->rank, s->name, (long long)sb.st_size, s->total);
        }
        m = mmap(NULL, s->total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd); /* the mapping keeps the memory */
        if (m == MAP_FAILED)
            return seg_fail(s, XCCL_ERR_SYSTEM,
                            "comm '%s' rank %d: cannot map the node-shared segment %s (%zu "
                            "bytes): %s",
                            comm->name, comm->rank, s->name, s->total, strerror(errno));
        s->map = m;
        s->hdr = m;
    }
    h = s->hdr;
    /* loaded once: rank 0 may store it between two loads (a 0 then the magic read as neither) */
    magic = atomic_load_explicit(&s->hdr->magic, memory_order_acquire);
    if (magic == 0) return XCCL_INPROGRESS; /* sized, not filled in yet */
    if (magic != SHSEG_MAGIC)
        return seg_fail(s, XCCL_ERR_REMOTE,
                        "comm '%s' rank %d: %s is not a node-shared segment of this version",
                        comm->name, comm->rank, s->name);
    if (h->version != SHSEG_VERSION || h->size != (uint32_t)comm->size ||
        h->job_id != comm->ctx->job_id || h->comm_id != comm->id || h->bytes != s->bytes ||
        h->total != s->total)
        return seg_fail(s, XCCL_ERR_REMOTE,
                        "comm '%s' rank %d: the node-shared segment %s is not the one rank 0 of "
                        "this communicator made (version %u, %u ranks, %" PRIu64
                        " bytes; expected %d ranks, %zu bytes)",
                        comm->name, comm->rank, s->name, h->version, h->size, h->bytes, comm->size,
                        s->bytes);
    n = atomic_fetch_add(&s->hdr->attached, 1) + 1;
    if (n == (uint32_t)comm->size && shm_unlink(s->name) != 0 && errno != ENOENT)
        XCCL_INFO("node-shared memory: cannot remove %s: %s", s->name, strerror(errno));
    s->state = SEG_READY;
    return XCCL_OK;
}

/* The segment, made or attached as far as it can be now. */
static xccl_status_t seg_get(xccl_comm_t *comm, struct xccl_shseg **out)
{
    struct xccl_shseg *s   = comm->shseg;
    xccl_ctx_t        *ctx = comm->ctx;

    if (s == NULL) {
        s = calloc(1, sizeof(*s));
        if (s != NULL) s->pidfd = malloc((size_t)comm->size * sizeof(int));
        if (s == NULL || s->pidfd == NULL) {
            free(s);
            return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "comm '%s': out of memory", comm->name);
        }
        s->fd     = -1;
        s->leader = comm->rank == 0;
        s->bytes  = page_round(xccl_core_policy->shared_bytes(comm->size));
        s->total  = SHSEG_HDR + s->bytes;
        seg_name(s->name, sizeof(s->name), ctx->job_id, comm->id, ctx->peers[comm->world[0]].pid);
        seg_watch_open(comm, s);
        comm->shseg = s;
    }
    *out = s;
    switch (s->state) {
    case SEG_READY:
        /* rank 0 lets the name's lock go once everybody attached (the last one removed it) */
        if (s->fd >= 0 &&
            atomic_load_explicit(&s->hdr->attached, memory_order_acquire) == (uint32_t)comm->size) {
            close(s->fd);
            s->fd     = -1;
            s->linked = 0;
        }
        return XCCL_OK;
    case SEG_FAILED:
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "%s", s->error ? s->error : "node-shared segment");
    default:
        return s->leader ? seg_create(comm, s) : seg_attach(comm, s);
    }
}

/* 1 if the process of comm rank p (not this one) has exited, as far as this rank can tell. */
static int proc_gone(const xccl_comm_t *comm, const struct xccl_shseg *s, int p)
{
    struct pollfd pfd;

    if (p == comm->rank) return 0;
    if (s->pidfd[p] >= 0) {
        pfd.fd      = s->pidfd[p];
        pfd.events  = POLLIN;
        pfd.revents = 0;
        return poll(&pfd, 1, 0) > 0; /* readable once the process exited */
    }
    if (s->pidfd[p] == -1)
        return kill(comm->ctx->peers[comm->world[p]].pid, 0) != 0 && errno == ESRCH;
    return 0;
}

void xccl_shared_free(xccl_comm_t *comm)
{
    struct xccl_shseg *s = comm->shseg;

    if (comm->ctx != NULL && comm->ctx->shwait == comm) comm->ctx->shwait = NULL;
    if (s == NULL) {
        /* never asked for here, but rank 0 may have made it and died before the others
         * attached (kill(): no pidfd was opened; best effort, the sweep does the rest) */
        const xccl_ctx_t *ctx = comm->ctx;
        char              name[SHSEG_NAME_MAX];
        if (ctx == NULL || comm->rank == 0 || !(comm->topo.shared & XCCL_SHARED_SEG) ||
            ctx->cinfo[comm->world[0]].pid_ns != ctx->cinfo[ctx->rank].pid_ns)
            return;
        if (kill(ctx->peers[comm->world[0]].pid, 0) == 0 || errno != ESRCH) return;
        seg_name(name, sizeof(name), ctx->job_id, comm->id, ctx->peers[comm->world[0]].pid);
        (void)shm_unlink(name);
        return;
    }
    comm->shseg = NULL;
    /* the name exists until every member attached. A member never attached (it died, or
     * never got that far): rank 0 removes it. Rank 0 died before the others could attach:
     * they do (the name is its job's and communicator's, nobody else's) */
    if (s->hdr == NULL ||
        atomic_load_explicit(&s->hdr->attached, memory_order_acquire) < (uint32_t)comm->size) {
        if (s->leader ? s->linked : proc_gone(comm, s, 0)) (void)shm_unlink(s->name);
    }
    if (s->map != NULL) munmap(s->map, s->total);
    if (s->fd >= 0) close(s->fd);
    for (int i = 0; i < comm->size; i++) {
        if (s->pidfd[i] >= 0) close(s->pidfd[i]);
    }
    free(s->pidfd);
    free(s->error);
    free(s);
}

/* ------------------------------------------------------------------------------------------ */
/* Task primitives (task.h)                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* A rank of task t as a rank of the communicator. */
static int comm_rank_of(const xccl_task_t *t, int peer)
{
    for (; t->parent != NULL; t = t->parent) {
        if (peer < 0 || peer >= t->size) return -1;
        peer = t->map[peer];
    }
    return peer;
}

void xccl_shared_post(xccl_work_t *w)
{
    if (w->task.algo->shared) w->task.shared_epoch = ++w->comm->shared_posted;
}

xccl_status_t xccl_task_shared(xccl_task_t *t, xccl_shared_t *out)
{
    xccl_work_t       *w    = t->work;
    xccl_comm_t       *comm = w->comm;
    const xccl_work_t *first;
    struct xccl_shseg *s = NULL;
    xccl_status_t      st;

    if (t->parent != NULL)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                          "%s: sub-task %s asked for the node-shared segment: only the task of "
                          "the collective itself can hold it",
                          w->name, t->algo->name);
    if (!t->shared_granted) {
        if (t->shared_epoch == 0)
            return XCCL_ERROR(XCCL_ERR_INTERNAL,
                              "%s: algorithm %s asked for the node-shared segment but does not "
                              "say it uses one (xccl_algo_t.shared)",
                              w->name, t->algo->name);
        if (!(comm->topo.shared & XCCL_SHARED_SEG))
            return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                              "%s: algorithm %s needs a node-shared segment, which comm '%s' "
                              "has not (its ranks span hosts, a rank set XCCL_SHARED=0, or no "
                              "shared-memory transport was asked for)",
                              w->name, t->algo->name, comm->name);
        /* its turn: no Work of an earlier epoch active here (comm->works is in posting
         * order, and epochs are numbered in posting order) */
        for (first = comm->works_head; first != NULL; first = first->cm_next)
            if (first->kind == WORK_COLL && first->task.shared_epoch != 0) break;
        if (first != w) {
            t->shared_wait = SHWAIT_TURN;
            return XCCL_INPROGRESS;
        }
    }
    st = seg_get(comm, &s);
    if (st == XCCL_INPROGRESS) {
        t->shared_wait = SHWAIT_ATTACH;
        t->shared_peer = 0;
        return st;
    }
    if (st < 0) {
        /* the others would wait for this rank until their timeout: tell them now */
        if (!t->shared_granted)
            xccl_coll_notify_failure(w, s != NULL && s->error ? s->error : "segment");
        return st;
    }
    t->shared_granted = 1;
    out->base         = s->map + SHSEG_HDR;
    out->bytes        = s->bytes;
    out->epoch        = t->shared_epoch;
    return XCCL_OK;
}

void xccl_task_shared_wait(xccl_task_t *t, int peer)
{
    xccl_task_t *root = &t->work->task;

    root->shared_wait = SHWAIT_WRITE;
    root->shared_peer = peer < 0 ? -1 : comm_rank_of(t, peer);
}

void xccl_task_shared_signal(xccl_task_t *t)
{
    struct xccl_shseg *s = t->work->comm->shseg;

    if (s == NULL || s->state != SEG_READY) return;
    atomic_thread_fence(memory_order_seq_cst); /* the flags before the sleeper count */
    if (atomic_load_explicit(&s->hdr->sleepers, memory_order_relaxed) == 0) return;
    atomic_fetch_add(&s->hdr->bell, 1);
    (void)syscall(SYS_futex, (uint32_t *)&s->hdr->bell, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

xccl_status_t xccl_task_peer_read(xccl_task_t *t, int peer, void *dst, const void *src,
                                  size_t nbytes)
{
    xccl_work_t *w    = t->work;
    xccl_comm_t *comm = w->comm;
    xccl_ctx_t  *ctx  = comm->ctx;
    int          p    = comm_rank_of(t, peer);
    uint64_t     t0   = comm->trace_cap ? xccl_now_ns() : 0;
    size_t       done = 0;
    pid_t        pid;

    if (p < 0 || p >= comm->size || p == comm->rank)
        return XCCL_ERROR(XCCL_ERR_INTERNAL,
                          "%s: algorithm %s read the memory of rank %d (of "
                          "%d) on rank %d",
                          w->name, t->algo->name, peer, xccl_task_size(t), comm->rank);
    if (!(comm->topo.shared & XCCL_SHARED_CMA) || t->args.mem != XCCL_MEM_HOST)
        return XCCL_ERROR(XCCL_ERR_INTERNAL,
                          "%s: algorithm %s read rank %d's memory, which comm '%s' cannot (no "
                          "cross-memory attach%s)",
                          w->name, t->algo->name, p, comm->name,
                          t->args.mem != XCCL_MEM_HOST ? " for device memory" : " here");
    pid = ctx->peers[comm->world[p]].pid;
    while (done < nbytes) {
        size_t        n   = nbytes - done < SHSEG_READ_MAX ? nbytes - done : SHSEG_READ_MAX;
        struct iovec  l   = {(char *)dst + done, n};
        struct iovec  r   = {(char *)(uintptr_t)src + done, n};
        ssize_t       got = process_vm_readv(pid, &l, 1, &r, 1, 0);
        int           e   = errno;
        char          op[256];
        xccl_status_t st;
        if (got > 0) { /* a partial read stops before a page it could not read: go on there */
            done += (size_t)got;
            continue;
        }
        if (got < 0 && e == EINTR) continue;
        snprintf(op, sizeof(op), "%s (algo %s, seq %llu) on comm '%s' failed on rank %d", w->name,
                 t->algo->name, (unsigned long long)w->seq, comm->name, comm->rank);
        if (got < 0 && e == ESRCH)
            st = XCCL_ERROR(XCCL_ERR_REMOTE,
                            "%s: rank %d (pid %d) exited while rank %d read its "
                            "memory",
                            op, p, (int)pid, comm->rank);
        else if (got < 0 && e == EPERM)
            st = XCCL_ERROR(XCCL_ERR_SYSTEM,
                            "%s: reading the memory of rank %d (pid %d) was "
                            "refused (EPERM): the ptrace policy (/proc/sys/kernel/yama/"
                            "ptrace_scope, a seccomp filter, or a process that is not dumpable) "
                            "forbids cross-memory reads; set XCCL_SHARED_CMA=0 on every rank to "
                            "do without them",
                            op, p, (int)pid);
        else if (got == 0 || e == EFAULT)
            st = XCCL_ERROR(XCCL_ERR_SYSTEM,
                            "%s: bad address reading [%p, %p) of rank %d (pid "
                            "%d) into [%p, %p) (%zu of %zu bytes read)",
                            op, (const char *)src + done, (const char *)src + nbytes, p, (int)pid,
                            (char *)dst + done, (char *)dst + nbytes, done, nbytes);
        else
            st = XCCL_ERROR(XCCL_ERR_SYSTEM, "%s: reading %zu bytes of rank %d (pid %d): %s", op,
                            nbytes - done, p, (int)pid, strerror(e));
        /* the others wait for this rank's flags: tell them now rather than at their timeout
         * (xccl_work_finish tells them of an XCCL_ERR_REMOTE failure) */
        if (st != XCCL_ERR_REMOTE) xccl_coll_notify_failure(w, xccl_last_error());
        return st;
    }
    if (t0) xccl_trace_read(t, p, dst, nbytes, t0);
    return XCCL_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Waiting                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* 1 if comm rank p is known dead; *why: the transport's reason, or NULL (its process exited). */
static int peer_gone(const xccl_comm_t *comm, const struct xccl_shseg *s, int p, const char **why)
{
    *why = comm->ctx->peer_dead[comm->world[p]];
    if (*why != NULL) return 1;
    return s != NULL && proc_gone(comm, s, p);
}

static void fail_gone(xccl_work_t *w, int p, const char *why)
{
    xccl_comm_t *comm = w->comm;
    char         msg[1024];
    int          n;

    n = snprintf(msg, sizeof(msg),
                 "%s (algo %s, seq %llu) on comm '%s' failed on rank %d: ", w->name,
                 w->task.algo->name, (unsigned long long)w->seq, comm->name, comm->rank);
    if (n < 0 || (size_t)n >= sizeof(msg)) n = 0;
    snprintf(msg + n, sizeof(msg) - (size_t)n,
             "rank %d (pid %d) %s while rank %d waited for it in %s (algo %s, epoch %llu)%s%s", p,
             (int)comm->ctx->peers[comm->world[p]].pid, why != NULL ? "failed" : "exited",
             comm->rank, w->name, w->task.algo->name, (unsigned long long)w->task.shared_epoch,
             why != NULL ? ": " : "", why != NULL ? why : "");
    (void)xccl_error_report(XCCL_ERR_REMOTE, __FILE__, __LINE__, "%s", msg);
    xccl_work_finish(w, XCCL_ERR_REMOTE, msg);
}

int xccl_shared_after(xccl_work_t *w, const uint64_t *state_before)
{
    xccl_task_t       *t     = &w->task;
    xccl_comm_t       *comm  = w->comm;
    struct xccl_shseg *s     = comm->shseg;
    int                moved = memcmp(state_before, t->state, sizeof(t->state)) != 0;
    const char        *why;
    int64_t            now;

    if (t->shared_wait != SHWAIT_WRITE && t->shared_wait != SHWAIT_ATTACH) return moved;
    if (t->shared_wait == SHWAIT_WRITE && s != NULL && s->state == SEG_READY &&
        comm->ctx->shwait == NULL)
        comm->ctx->shwait = comm;
    /* the transports' verdict on the rank waited for costs a load: every pass */
    if (t->shared_peer >= 0 && t->shared_peer < comm->size &&
        peer_gone(comm, NULL, t->shared_peer, &why)) {
        fail_gone(w, t->shared_peer, why);
        return 1;
    }
    now = xccl_now_ms();
    if (t->shared_check_ms == 0) t->shared_check_ms = now + SHSEG_LIVENESS_MS;
    if (now < t->shared_check_ms) return moved;
    t->shared_check_ms = now + SHSEG_LIVENESS_MS;
    for (int p = 0; p < comm->size; p++) {
        if (p == comm->rank || (t->shared_peer >= 0 && p != t->shared_peer)) continue;
        if (peer_gone(comm, s, p, &why)) {
            fail_gone(w, p, why);
            return 1;
        }
    }
    return moved;
}

size_t xccl_shared_describe(const xccl_work_t *w, char *buf, size_t len)
{
    const xccl_task_t *t    = &w->task;
    const xccl_comm_t *comm = w->comm;
    int                n    = 0;

    if (len == 0) return 0;
    buf[0] = '\0';
    if (w->kind != WORK_COLL || t->shared_epoch == 0) return 0;
    switch (t->shared_wait) {
    case SHWAIT_WRITE:
        if (t->shared_peer >= 0)
            n = snprintf(buf, len,
                         "rank %d (pid %d) to write the node-shared segment (epoch "
                         "%llu)",
                         t->shared_peer, (int)comm->ctx->peers[comm->world[t->shared_peer]].pid,
                         (unsigned long long)t->shared_epoch);
        else
            n = snprintf(buf, len,
                         "writes of several ranks to the node-shared segment (epoch "
                         "%llu)",
                         (unsigned long long)t->shared_epoch);
        break;
    case SHWAIT_ATTACH:
        n = snprintf(buf, len,
                     "rank 0 (pid %d) to create the node-shared segment %s (epoch "
                     "%llu)",
                     (int)comm->ctx->peers[comm->world[0]].pid,
                     comm->shseg != NULL ? comm->shseg->name : "",
                     (unsigned long long)t->shared_epoch);
        break;
    case SHWAIT_TURN: {
        const xccl_work_t *first = comm->works_head;
        while (first != NULL && (first->kind != WORK_COLL || first->task.shared_epoch == 0))
            first = first->cm_next;
        n = snprintf(buf, len,
                     "its turn on the node-shared segment (epoch %llu; epoch %llu, %s "
                     "#%llu, holds it on this rank)",
                     (unsigned long long)t->shared_epoch,
                     first ? (unsigned long long)first->task.shared_epoch : 0ull,
                     first ? first->name : "?", first ? (unsigned long long)first->seq : 0ull);
        break;
    }
    default:
        return 0;
    }
    return n < 0 ? 0 : (size_t)n < len ? (size_t)n : len - 1;
}

int xccl_shared_arm(xccl_ctx_t *ctx, xccl_shsleep_t *s)
{
    xccl_comm_t *comm = ctx->shwait;
    shseg_hdr_t *h;

    if (comm == NULL || comm->shseg == NULL || comm->shseg->state != SEG_READY) return 0;
    h = comm->shseg->hdr;
    xccl_comm_ref(comm); /* the mapping stays while this thread sleeps on it */
    s->comm = comm;
    atomic_fetch_add(&h->sleepers, 1);
    atomic_thread_fence(memory_order_seq_cst); /* the sleeper count before the flags */
    s->bell = atomic_load(&h->bell);
    return 1;
}

void xccl_shared_doze(xccl_shsleep_t *s, int timeout_ms)
{
    struct timespec ts = {0, (long)timeout_ms * 1000000L};

    if (s->comm == NULL || timeout_ms <= 0) return;
    if (timeout_ms > SHSEG_DOZE_MS) ts.tv_nsec = SHSEG_DOZE_MS * 1000000L;
    (void)syscall(SYS_futex, (uint32_t *)&s->comm->shseg->hdr->bell, FUTEX_WAIT, s->bell, &ts, NULL,
                  0);
}

void xccl_shared_disarm(xccl_shsleep_t *s)
{
    if (s->comm == NULL) return;
    atomic_fetch_sub(&s->comm->shseg->hdr->sleepers, 1);
    xccl_comm_unref(s->comm);
    s->comm = NULL;
}
