/* SPDX-License-Identifier: Apache-2.0
 *
 * shm.c - the shared-memory transport for ranks on one host: every rank owns one POSIX shm
 * segment holding one single-producer/single-consumer ring per peer that sends to it. Layouts
 * are in shm_layout.h.
 *
 * Data path (sender S, receiver R, ring S->R in R's segment)
 *   nbytes <= 24                  INLINE: header and payload in one 64-byte slot
 *   nbytes <  cma_min             STREAM: slot + payload copied through the ring (the whole
 *   or CMA off for this pair      record at once when it is small, else in pieces as R frees
 *                                 space: a pipelined double copy)
 *   otherwise                     CMA: S writes a slot with its buffer's address; R calls
 *                                 recv_match, then process_vm_readv straight from S's buffer
 *                                 into the destination (<= SHM_CMA_STEP bytes per progress
 *                                 pass), then bumps cma_done; S calls send_done when it sees it
 *   isend writes at once when the queue to that peer is empty (INLINE and small STREAM sends
 *   complete inside isend); otherwise progress writes what the ring has room for. R delivers
 *   one message at a time per peer, in ring order, so matching sees posting order. A large
 *   message nobody has posted a receive for yet may be held back (recv_match answers
 *   XCCL_INPROGRESS): its slot stays at the head of the ring and is offered again each pass,
 *   so a CMA read lands in the receive's buffer instead of a staging copy.
 *   Cost per message: INLINE ~2 cache-line transfers; STREAM 2 copies; CMA 1 copy + 1 syscall
 *   per 4 MiB, plus pinning the sender's pages one by one.
 *   cma_min (shm_cma_min): while every local rank has a CPU of its own, nothing is pulled: S's
 *   copy in and R's copy out of a streamed message run at once on two CPUs through a ring that
 *   stays in cache, which beat one CMA copy at every size measured (2 ranks on 2 vCPUs,
 *   ping-pong one way: 1 MiB 52 us vs 135, 64 MiB 7.3 ms vs 10.7). When local ranks outnumber
 *   CPUs the second copy takes CPU time another rank needs, and a rank waits for its peer to be
 *   scheduled anyway: messages the size of a ring or more are pulled (4 ranks on 2 vCPUs: CMA
 *   ahead for reductions and all_gather from 1-4 MiB, the rings ahead below).
 *
 * Cross-memory attach (CMA) is decided per pair at wire-up by the receiver: it reads a probe
 * word from the sender with process_vm_readv and compares it with the value the sender put in
 * its segment. EPERM (ptrace restrictions, /proc/sys/kernel/yama/ptrace_scope), a pid from
 * another namespace, or XCCL_SHM_CMA=0 turn it off for that pair: large messages then stream.
 *
 * Waiting
 *   Each segment header has a futex word `bell` and a count of the owner's sleeping threads.
 *   A producer that published data looks at `sleepers` (after a full fence) and only then bumps
 *   the bell and calls FUTEX_WAKE, so a spinning receiver costs the sender no syscall. Events a
 *   sleeping producer may wait for (tail or cma_done moving while it set prod_wants, a peer
 *   closing, `wake`) always bump the bell. `wait` compares the bell with the value the last
 *   progress pass saw at its start, looks at the heads of its rings, and sleeps on the bell:
 *     waiter: sleepers++ (seq_cst); any head != tail, or bell != seen -> return; FUTEX_WAIT(seen)
 *     sender: store head (release); fence; sleepers != 0 -> bell++, FUTEX_WAKE
 *   Either the waiter sees the data or the sender sees the sleeper, so no wake-up is lost.
 *   In a context with other transports too, the core sleeps on all of them in one poll(2)
 *   (wait_arm / wait_disarm), which a futex cannot join. Each rank then also has a wake socket:
 *   a datagram socket bound to an abstract name made of the job id, its rank and pid, so peers
 *   reach it with no file to clean up. A polling thread counts itself in `pollers` instead of
 *   `sleepers`, and senders that see pollers != 0 (at the same points as sleepers) send it an
 *   empty datagram from a socket of their process; the last poller to leave drains it. Peers
 *   that cannot reach the socket (another network namespace) say so at attach time (ring
 *   `poke` stays 0), and then the core sleeps 1 ms at a time, as without the socket. The
 *   single-transport path never touches the socket: senders only read `pollers` beside
 *   `sleepers`, on the same cache line.
 *
 * Failure
 *   Each peer's process is watched through a pidfd (kill(pid, 0) where pidfd_open is missing),
 *   polled at most every SHM_LIVENESS_MS in progress. A peer in another pid namespace (same
 *   IPC namespace, e.g. containers sharing /dev/shm) has a pid that means nothing here: it is
 *   watched through the OFD lock it holds on its segment file instead, and CMA stays off.
 *   A peer found dead also has its segment name unlinked, in case it died before doing so.
 *   A peer that closes the pair (finalize, close_peer, a refused message) sets `closed` in the
 *   ring it writes to and rings our bell; one that drops it first writes why into the ring's
 *   control block, and our failure quotes it (a rank that gives up because a third one died
 *   names that one even while its notice sits unread behind a record we are pulling).
 *   Either way, complete messages already in the ring are delivered first; then queued and
 *   in-flight sends and the receive in progress fail (XCCL_ERR_REMOTE) and peer_failed runs.
 *
 * Lifetime of the names: a segment is created O_EXCL at init under a name unique to the job,
 * rank and pid, and unlinked at the end of wire-up once every peer that uses it has set
 * `attached` in its ring (and at finalize, if wire-up never got that far). From then on
 * nothing is left in /dev/shm however the processes end; the memory goes with the last
 * mapping. The segment is mode 0600: only processes of the same user can map it.
 *
 * Environment
 *   XCCL_SHM_CMA=0        no cross-memory attach (large messages stream through the rings)
 *   XCCL_SHM_CMA_MIN      smallest message sent with CMA (bytes; default: the ring size when
 *                         local ranks outnumber CPUs, else none)
 *   XCCL_SHM_RING_KB      ring size per peer (default: 8 MiB shared by the local peers,
 *                         between 128 KiB and 1 MiB each)
 *   XCCL_SHM_WATCH=lock   watch every peer through its segment lock (testing)
 *
 * Threading: see xccl_transport.h. `wait` reads only atomics (shared rings and bell, the
 * per-peer state and a few context words) and never touches the queues.
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include "shm_layout.h"
#include "xccl/xccl_tp_support.h"
#include "xccl/xccl_transport.h"

#define SHM_CMA_STEP     ((size_t)4 << 20)    /* most bytes one process_vm_readv pulls     */
#define SHM_RING_MAX     ((uint64_t)1 << 20)  /* default ring size bounds                  */
#define SHM_RING_BUDGET  ((uint64_t)8 << 20)  /* default: the rings of a segment total this */
#define SHM_RECV_MSGS    64                   /* messages per peer per progress pass       */
#define SHM_LIVENESS_MS  100
#define SHM_WIRE_SLEEP_US 1000
#define SHM_ORPHAN_AGE_S  2 /* an unlocked segment older than this has a dead owner */

typedef enum shm_peer_state {
    SHM_P_IDLE = 0, /* not wired up (or not used)                                         */
    SHM_P_UP,       /* mapped both ways                                                   */
    SHM_P_DEAD,     /* failed; isend fails                                                */
} shm_peer_state_t;

typedef enum shm_rstate { SHM_R_IDLE = 0, SHM_R_STREAM, SHM_R_CMA } shm_rstate_t;

/* How a peer's death is noticed. */
typedef enum shm_watch {
    SHM_WATCH_PIDFD = 0, /* poll a pidfd (readable once the process has exited)           */
    SHM_WATCH_KILL,      /* kill(pid, 0) == ESRCH (kernels without pidfd_open)            */
    SHM_WATCH_LOCK,      /* its OFD lock on its segment file is gone (other pid namespace) */
} shm_watch_t;

typedef struct shm_ring {
    shm_ring_ctl_t *ctl;
    char           *data;
    uint64_t        cap, mask;
} shm_ring_t;

/* A queued send. The payload is the caller's until send_done. */
typedef struct shm_send {
    struct shm_send *next;
    xccl_msg_hdr_t   hdr;
    const char      *buf;
    uint32_t         kind;    /* SHM_REC_*                                        */
    uint64_t         rec_len; /* bytes the record takes in the ring               */
    uint64_t         off;     /* bytes of it written                              */
    uint64_t         cma_seq; /* CMA: cma_done value that completes it            */
    void            *cookie;
} shm_send_t;

typedef struct shm_peer {
    _Atomic int    state; /* shm_peer_state_t; read by `wait`                     */
    int32_t        pid;
    char           name[SHM_NAME_MAX];
    uint64_t       seg_bytes;
    shm_seg_hdr_t *seg;   /* its segment, mapped during wire-up                 */
    shm_ring_t     out;   /* ring this rank -> peer, in its segment               */
    shm_ring_t     in;    /* ring peer -> this rank, in ours                      */
    shm_watch_t    watch;
    int            pidfd;  /* SHM_WATCH_PIDFD                                     */
    int            lockfd; /* SHM_WATCH_LOCK: our descriptor of its segment       */
    int            cma;    /* the peer accepts CMA records from us                */

    /* send side */
    shm_send_t *sq_head, *sq_tail; /* not completely written yet                   */
    shm_send_t *cq_head, *cq_tail; /* CMA records written, waiting for cma_done    */
    uint64_t    cma_posted;
    uint64_t    tail_cache;
    int         pushing; /* inside push: a nested isend only queues                  */
    int         wants;   /* last value stored in out.ctl->prod_wants               */

    /* receive side */
    shm_rstate_t   rstate;
    xccl_msg_hdr_t rhdr;
    char          *rdst;
    uint64_t       rgot;
    uint64_t       raddr;
    void          *rcookie;
    uint64_t       rtail;      /* consumer position (published to in.ctl->tail lazily) */
    uint64_t       rhead;      /* last head seen                                     */
    uint64_t       rtail_pub;  /* last value stored in in.ctl->tail                  */
    uint64_t       cma_pulled; /* CMA messages completed (in.ctl->cma_done)          */
    int            in_moved;   /* tail or cma_done moved this pass: tell the producer */
} shm_peer_t;

struct xccl_tp_ctx {
    int                      rank, size;
    uint64_t                 job_id;
    const xccl_tp_upcalls_t *up;
    xccl_peer_info_t        *infos;
    int                      cma_env; /* XCCL_SHM_CMA (1 by default)                  */
    uint64_t                 cma_min;

    char           name[SHM_NAME_MAX];
    int            linked; /* the name still exists in /dev/shm                          */
    int            fd;     /* our segment; holds the OFD lock peers watch                */
    uint64_t       pid_ns;
    int            watch_lock; /* XCCL_SHM_WATCH=lock: watch every peer through its lock */
    shm_seg_hdr_t *seg;
    uint64_t       seg_bytes, hdr_bytes, ring_bytes;

    shm_peer_t    *peers;
    int           *up_list; /* the peers in state UP or DEAD-with-rings, for scans      */
    int            nup;
    struct pollfd *pfds;
    int           *pfd_peer;
    int64_t        next_liveness;
    shm_send_t    *free_sends;

    int            wake_fd;  /* our wake socket (see Waiting); -1: none              */
    int            poke_held; /* holds a use of the process's poke socket            */
    int            pollable; /* every peer reaches it: wait_arm may hand it out      */

    _Atomic uint32_t seen_bell; /* bell value at the start of the last progress pass */
    _Atomic int      must_poll; /* progress stopped on a budget: `wait` must not sleep */
    volatile uint64_t probe;    /* peers read this with process_vm_readv             */
};

/* ---------------------------------------------------------------------------------------------
 * Small helpers
 * ------------------------------------------------------------------------------------------- */

static uint64_t shm_min64(uint64_t a, uint64_t b) { return a < b ? a : b; }
static uint64_t shm_pad64(uint64_t n) { return (n + SHM_SLOT - 1) & ~(uint64_t)(SHM_SLOT - 1); }

static void shm_futex_wake(_Atomic uint32_t *word)
{
    (void)syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* The abstract socket name of the wake socket of (job, rank, pid); returns its length. */
static socklen_t shm_wake_addr(struct sockaddr_un *a, uint64_t job_id, int rank, int32_t pid)
{
    int n;

    memset(a, 0, sizeof(*a));
    a->sun_family = AF_UNIX;
    /* sun_path[0] = 0: the abstract namespace */
    n = snprintf(a->sun_path + 1, sizeof(a->sun_path) - 1, SHM_NAME_PREFIX "wake-%016" PRIx64
                 "-%d-%d", job_id, rank, (int)pid);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* This process's socket for sending wake datagrams: shared by every shm context of the process
 * (sendto on one socket needs no lock), made by the first context and closed with the last. */
static _Atomic int      shm_poke_sock  = -1;
static int              shm_poke_users = 0;
static pthread_mutex_t  shm_poke_lock  = PTHREAD_MUTEX_INITIALIZER;

static void shm_poke_hold(void)
{
    pthread_mutex_lock(&shm_poke_lock);
    if (shm_poke_users++ == 0)
        atomic_store(&shm_poke_sock, socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    pthread_mutex_unlock(&shm_poke_lock);
}

static void shm_poke_drop(void)
{
    pthread_mutex_lock(&shm_poke_lock);
    if (--shm_poke_users == 0) {
        int fd = atomic_exchange(&shm_poke_sock, -1);
        if (fd >= 0) close(fd);
    }
    pthread_mutex_unlock(&shm_poke_lock);
}

/* Sends the owner of `h` a wake datagram. 0 when it is (or already was: a full queue) woken. */
static int shm_poke(const shm_seg_hdr_t *h)
{
    struct sockaddr_un a;
    socklen_t          len = shm_wake_addr(&a, h->job_id, h->rank, h->pid);
    int                fd  = atomic_load_explicit(&shm_poke_sock, memory_order_relaxed);

    if (fd < 0) return -1;
    if (sendto(fd, "", 0, MSG_DONTWAIT | MSG_NOSIGNAL, (struct sockaddr *)&a, len) == 0 ||
        errno == EAGAIN)
        return 0;
    return -1;
}

/* Data was published into a ring of the owner of `h`: wake it only if it sleeps. */
static void shm_bell_if_sleeping(shm_seg_hdr_t *h)
{
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&h->sleepers, memory_order_relaxed) != 0) {
        atomic_fetch_add(&h->bell, 1);
        shm_futex_wake(&h->bell);
    }
    if (XCCL_UNLIKELY(atomic_load_explicit(&h->pollers, memory_order_relaxed) != 0))
        (void)shm_poke(h);
}

/* Something the owner of `h` does not poll for happened: always move the bell. */
static void shm_bell(shm_seg_hdr_t *h)
{
    atomic_fetch_add(&h->bell, 1);
    if (atomic_load(&h->sleepers) != 0) shm_futex_wake(&h->bell);
    if (atomic_load(&h->pollers) != 0) (void)shm_poke(h);
}

static uint64_t shm_pid_ns(void)
{
    struct stat sb;
    return stat("/proc/self/ns/pid", &sb) == 0 ? (uint64_t)sb.st_ino : 0;
}

/* 1 if the peer's process is gone (or, for SHM_WATCH_LOCK, has closed its segment). */
static int shm_peer_gone(const shm_peer_t *p)
{
    struct pollfd pfd;
    struct flock  fl;

    switch (p->watch) {
    case SHM_WATCH_PIDFD:
        pfd.fd     = p->pidfd;
        pfd.events = POLLIN;
        return poll(&pfd, 1, 0) > 0;
    case SHM_WATCH_KILL:
        return kill(p->pid, 0) != 0 && errno == ESRCH;
    case SHM_WATCH_LOCK:
        memset(&fl, 0, sizeof(fl));
        fl.l_type   = F_WRLCK;
        fl.l_whence = SEEK_SET;
        return fcntl(p->lockfd, F_OFD_GETLK, &fl) == 0 && fl.l_type == F_UNLCK;
    }
    return 0;
}

static void shm_ring_write(const shm_ring_t *r, uint64_t pos, const void *src, size_t n)
{
    size_t at    = (size_t)(pos & r->mask);
    size_t first = (size_t)shm_min64(n, r->cap - at);

    memcpy(r->data + at, src, first);
    if (n > first) memcpy(r->data, (const char *)src + first, n - first);
}

static void shm_ring_read(const shm_ring_t *r, uint64_t pos, void *dst, size_t n)
{
    size_t at    = (size_t)(pos & r->mask);
    size_t first = (size_t)shm_min64(n, r->cap - at);

    memcpy(dst, r->data + at, first);
    if (n > first) memcpy((char *)dst + first, r->data, n - first);
}

/* ring_bytes: as checked (a peer's segment: the value xccl_shm_seg_check read, not the
 * header's, which the peer could change after the check). */
static void shm_ring_map(shm_ring_t *r, shm_seg_hdr_t *seg, uint64_t hdr_bytes,
                         uint64_t ring_bytes, int idx)
{
    char *base = (char *)seg + hdr_bytes + (uint64_t)idx * (SHM_CTL_BYTES + ring_bytes);

    r->ctl  = (shm_ring_ctl_t *)base;
    r->data = base + SHM_CTL_BYTES;
    r->cap  = ring_bytes;
    r->mask = ring_bytes - 1;
}

static uint64_t shm_hdr_bytes(int size) { return xccl_shm_hdr_bytes(size); }

/* Removes segments whose owner died before it could unlink the name (killed between creating
 * its segment and wire-up): no process holds their lock any more. Only our user's files named
 * like ours, and only ones older than SHM_ORPHAN_AGE_S (an owner locks its segment right after
 * creating it, so a younger unlocked one may be one being created). The lock tells, not the
 * pid in the name, which means nothing in another pid namespace sharing /dev/shm. */
static void shm_sweep_orphans(void)
{
    xccl_shm_sweep(SHM_NAME_PREFIX, SHM_ORPHAN_AGE_S, NULL, "shm");
}

static void shm_seg_name(char *buf, uint64_t job_id, int rank)
{
    snprintf(buf, SHM_NAME_MAX, "/" SHM_NAME_PREFIX "%016" PRIx64 "-%d-%d", job_id, rank,
             (int)getpid());
}

static int shm_same_host(const xccl_peer_info_t *a, const xccl_peer_info_t *b)
{
    return a->host_id == b->host_id && a->ipc_ns == b->ipc_ns;
}

/* Pids of a process whose pid namespace is `ns` mean the same here. */
static int shm_same_pidns(const xccl_tp_ctx_t *ctx, uint64_t ns)
{
    return ns != 0 && ns == ctx->pid_ns;
}

/* ---------------------------------------------------------------------------------------------
 * Failure
 * ------------------------------------------------------------------------------------------- */

/* Fails every pending operation with `peer`, tells it (closed flag + bell) unless it is the
 * one that closed, then reports it. Runs upcalls: only from progress, close_peer. */
static void shm_fail_peer(xccl_tp_ctx_t *ctx, int peer, xccl_status_t st, uint32_t mark,
                          const char *why)
{
    shm_peer_t *p = &ctx->peers[peer];
    shm_send_t *lists[2], *q;

    if (atomic_load(&p->state) != SHM_P_UP) return;
    atomic_store(&p->state, SHM_P_DEAD);
    XCCL_INFO("shm: rank %d: %s", ctx->rank, why);
    if (mark != SHM_OPEN && p->out.ctl != NULL &&
        atomic_load(&p->out.ctl->closed) == SHM_OPEN) { /* we are its only writer */
        if (mark == SHM_DROPPED) snprintf(p->out.ctl->why, sizeof(p->out.ctl->why), "%s", why);
        atomic_store(&p->out.ctl->closed, mark);
        atomic_store(&p->out.ctl->prod_wants, 0);
        shm_bell(p->seg);
    }
    /* the failed requests' messages (the core reads the thread's last error) say why */
    (void)xccl_error_set(st, "%s", why);
    lists[0]   = p->cq_head; /* CMA sends were posted first */
    lists[1]   = p->sq_head;
    p->cq_head = p->cq_tail = p->sq_head = p->sq_tail = NULL;
    for (int i = 0; i < 2; i++) {
        for (q = lists[i]; q != NULL;) {
            shm_send_t *next   = q->next;
            void       *cookie = q->cookie;
            q->next            = ctx->free_sends;
            ctx->free_sends    = q;
            ctx->up->send_done(ctx->up->core, cookie, XCCL_ERR_REMOTE);
            q = next;
        }
    }
    if (p->rstate != SHM_R_IDLE) {
        void *cookie = p->rcookie;
        p->rstate    = SHM_R_IDLE;
        p->rcookie   = NULL;
        ctx->up->recv_done(ctx->up->core, cookie, XCCL_ERR_REMOTE);
    }
    ctx->up->peer_failed(ctx->up->core, peer, st, why);
}

/* ---------------------------------------------------------------------------------------------
 * Send path
 * ------------------------------------------------------------------------------------------- */

static void shm_set_wants(shm_peer_t *p, int on)
{
    if (p->wants == on) return;
    p->wants = on;
    /* seq_cst: ordered before the loads of tail / cma_done that follow (see Waiting) */
    atomic_store(&p->out.ctl->prod_wants, (uint32_t)on);
}

/* Writes the next piece of `q` into the ring at `head`: `take` bytes of its record, a multiple
 * of SHM_SLOT (or the rest of the record). */
static void shm_write_piece(const shm_ring_t *r, uint64_t head, shm_send_t *q, uint64_t take)
{
    uint64_t pos = head, end = q->off + take;

    if (q->off == 0) {
        shm_slot_t s;
        memset(&s, 0, sizeof(s));
        s.kind = q->kind;
        s.hdr  = q->hdr;
        if (q->kind == SHM_REC_INLINE && q->hdr.nbytes > 0)
            memcpy(s.u.data, q->buf, (size_t)q->hdr.nbytes);
        else if (q->kind == SHM_REC_CMA)
            s.u.addr = (uint64_t)(uintptr_t)q->buf;
        shm_ring_write(r, pos, &s, sizeof(s));
        pos += SHM_SLOT;
        q->off = SHM_SLOT;
    }
    if (q->kind == SHM_REC_STREAM && end > q->off) {
        uint64_t from = q->off - SHM_SLOT;
        uint64_t to   = shm_min64(end - SHM_SLOT, q->hdr.nbytes);
        if (to > from) shm_ring_write(r, pos, q->buf + from, (size_t)(to - from));
    }
    q->off = end;
}

/* Completes the CMA sends the receiver has finished pulling. */
static void shm_reap_cma(xccl_tp_ctx_t *ctx, int peer, int *nev)
{
    shm_peer_t *p = &ctx->peers[peer];
    uint64_t    done;

    if (p->cq_head == NULL) return;
    done = atomic_load_explicit(&p->out.ctl->cma_done, memory_order_acquire);
    while (p->cq_head != NULL && p->cq_head->cma_seq <= done &&
           atomic_load(&p->state) == SHM_P_UP) {
        shm_send_t *q   = p->cq_head;
        void       *cookie = q->cookie;
        p->cq_head      = q->next;
        if (p->cq_head == NULL) p->cq_tail = NULL;
        q->next         = ctx->free_sends;
        ctx->free_sends = q;
        (*nev)++;
        ctx->up->send_done(ctx->up->core, cookie, XCCL_OK);
    }
}

/* Writes as much of the send queue as the ring has room for. Never blocks; calls send_done
 * for INLINE and STREAM messages written completely. */
static void shm_push(xccl_tp_ctx_t *ctx, int peer, int *nev)
{
    shm_peer_t *p    = &ctx->peers[peer];
    shm_ring_t *r    = &p->out;
    uint64_t    head = atomic_load_explicit(&r->ctl->head, memory_order_relaxed);
    uint64_t    head0 = head;

    if (p->sq_head == NULL || p->pushing) return;
    p->pushing = 1;
    while (p->sq_head != NULL && atomic_load(&p->state) == SHM_P_UP) {
        shm_send_t *q   = p->sq_head;
        uint64_t    rem = q->rec_len - q->off;
        uint64_t    want, room, take;

        /* small records go whole; big ones in pieces of at least an eighth of the ring */
        want = q->off == 0 && q->rec_len <= r->cap / 4 ? q->rec_len : shm_min64(rem, r->cap / 8);
        room = (r->cap - (head - p->tail_cache)) & ~(uint64_t)(SHM_SLOT - 1);
        if (room < want) {
            /* ask to be told when the consumer frees room, then look again (see Waiting) */
            shm_set_wants(p, 1);
            p->tail_cache = atomic_load(&r->ctl->tail);
            room = (r->cap - (head - p->tail_cache)) & ~(uint64_t)(SHM_SLOT - 1);
            if (room < want) break;
        }
        take = shm_min64(room, rem);
        if (q->kind == SHM_REC_CMA) shm_set_wants(p, 1); /* before the consumer sees it */
        shm_write_piece(r, head, q, take);
        head += take;
        atomic_store_explicit(&r->ctl->head, head, memory_order_release);
        (*nev)++;
        if (q->off < q->rec_len) continue; /* more of it when room frees up */
        p->sq_head = q->next;
        if (p->sq_head == NULL) p->sq_tail = NULL;
        q->next = NULL;
        if (q->kind == SHM_REC_CMA) {
            if (p->cq_tail != NULL) p->cq_tail->next = q;
            else p->cq_head = q;
            p->cq_tail = q;
        } else {
            void *cookie    = q->cookie;
            q->next         = ctx->free_sends;
            ctx->free_sends = q;
            ctx->up->send_done(ctx->up->core, cookie, XCCL_OK);
        }
    }
    p->pushing = 0;
    if (p->sq_head == NULL && p->cq_head == NULL) shm_set_wants(p, 0);
    if (head != head0) shm_bell_if_sleeping(p->seg);
}

static xccl_status_t shm_isend(xccl_tp_ctx_t *ctx, int peer, const xccl_msg_hdr_t *hdr,
                               const xccl_tp_buf_t *buf, void *cookie)
{
    shm_peer_t *p;
    shm_send_t *q;
    int         nev = 0, st;

    if (peer < 0 || peer >= ctx->size || peer == ctx->rank)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "shm: rank %d: send to invalid peer %d",
                          ctx->rank, peer);
    if (hdr->nbytes > 0 && (buf == NULL || buf->ptr == NULL))
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                          "shm: rank %d: send of %" PRIu64 " bytes to rank %d without a buffer",
                          ctx->rank, hdr->nbytes, peer);
    if (hdr->nbytes > 0 && buf->mem != XCCL_MEM_HOST)
        return XCCL_ERROR(XCCL_ERR_NOT_SUPPORTED,
                          "shm: rank %d: send to rank %d from device memory", ctx->rank, peer);
    p  = &ctx->peers[peer];
    st = atomic_load(&p->state);
    if (st == SHM_P_DEAD)
        return XCCL_ERROR(XCCL_ERR_REMOTE, "shm: rank %d: cannot send to rank %d: it failed",
                          ctx->rank, peer);
    if (st != SHM_P_UP)
        return XCCL_ERROR(XCCL_ERR_INVALID_USAGE,
                          "shm: rank %d: send to rank %d, which is not wired up", ctx->rank,
                          peer);
    q = ctx->free_sends;
    if (q != NULL) ctx->free_sends = q->next;
    else if ((q = malloc(sizeof(*q))) == NULL)
        return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "shm: rank %d: send request", ctx->rank);
    q->next   = NULL;
    q->hdr    = *hdr;
    q->buf    = hdr->nbytes > 0 ? buf->ptr : NULL;
    q->off    = 0;
    q->cookie = cookie;
    if (hdr->nbytes <= SHM_INLINE_MAX) {
        q->kind    = SHM_REC_INLINE;
        q->rec_len = SHM_SLOT;
    } else if (p->cma && hdr->nbytes >= ctx->cma_min) {
        q->kind    = SHM_REC_CMA;
        q->rec_len = SHM_SLOT;
        q->cma_seq = ++p->cma_posted;
    } else {
        q->kind    = SHM_REC_STREAM;
        q->rec_len = SHM_SLOT + shm_pad64(hdr->nbytes);
    }
    if (p->sq_tail != NULL) {
        p->sq_tail->next = q;
        p->sq_tail       = q;
        return XCCL_OK;
    }
    p->sq_head = p->sq_tail = q;
    /* the queue was empty: write now, so a small message leaves without waiting for progress */
    shm_push(ctx, peer, &nev);
    return XCCL_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Receive path
 * ------------------------------------------------------------------------------------------- */

/* The receive in p->r* is complete. */
static void shm_recv_complete(xccl_tp_ctx_t *ctx, shm_peer_t *p, int *nev)
{
    void *cookie = p->rcookie;

    p->rstate  = SHM_R_IDLE;
    p->rcookie = NULL;
    p->rdst    = NULL;
    (*nev)++;
    ctx->up->recv_done(ctx->up->core, cookie, XCCL_OK);
}

/* A slot was read: ask the core where its payload goes. 0: go on, 1: held back (the slot
 * stays at the head of the ring and is offered again next pass), -1: the peer failed. */
static int shm_match(xccl_tp_ctx_t *ctx, int peer, const shm_slot_t *s, int *nev)
{
    shm_peer_t   *p      = &ctx->peers[peer];
    xccl_tp_buf_t dst    = {NULL, XCCL_MEM_HOST, NULL};
    void         *cookie = NULL;
    xccl_status_t st;
    char          why[256];

    p->rhdr = s->hdr;
    st      = ctx->up->recv_match(ctx->up->core, peer, &p->rhdr, &dst, &cookie);
    if (st == XCCL_INPROGRESS) return 1;
    if (st < 0) {
        snprintf(why, sizeof(why),
                 "message from rank %d (comm %" PRIx64 " tag %" PRIx64 ", %" PRIu64
                 " bytes) refused: %s",
                 peer, p->rhdr.comm_id, p->rhdr.tag, p->rhdr.nbytes, xccl_status_string(st));
        shm_fail_peer(ctx, peer, st, SHM_DROPPED, why);
        return -1;
    }
    if (atomic_load(&p->state) != SHM_P_UP) return -1;
    if (p->rhdr.nbytes > 0 && dst.ptr != NULL && dst.mem != XCCL_MEM_HOST) {
        p->rstate  = SHM_R_STREAM; /* so the failure reports this receive */
        p->rcookie = cookie;
        snprintf(why, sizeof(why),
                 "message from rank %d (%" PRIu64 " bytes): the core gave no host buffer", peer,
                 p->rhdr.nbytes);
        shm_fail_peer(ctx, peer, XCCL_ERR_INTERNAL, SHM_DROPPED, why);
        return -1;
    }
    p->rdst    = dst.ptr; /* NULL: drop the payload (consume it from the ring, pull nothing) */
    p->rgot    = 0;
    p->rcookie = cookie;
    if (s->kind == SHM_REC_INLINE || p->rhdr.nbytes == 0) {
        if (p->rhdr.nbytes > 0 && p->rdst != NULL)
            memcpy(p->rdst, s->u.data, (size_t)p->rhdr.nbytes);
        shm_recv_complete(ctx, p, nev);
        return atomic_load(&p->state) == SHM_P_UP ? 0 : -1;
    }
    if (s->kind == SHM_REC_CMA) {
        p->rstate = SHM_R_CMA;
        p->raddr  = s->u.addr;
    } else {
        p->rstate = SHM_R_STREAM;
    }
    return 0;
}

/* One process_vm_readv step of the CMA receive in progress. 1: complete, 0: more to do,
 * -1: the peer failed. */
static int shm_cma_step(xccl_tp_ctx_t *ctx, int peer, uint64_t *budget, int *nev)
{
    shm_peer_t  *p    = &ctx->peers[peer];
    uint64_t     left = p->rhdr.nbytes - p->rgot;
    size_t       n    = (size_t)shm_min64(left, SHM_CMA_STEP);
    struct iovec r    = {(void *)(uintptr_t)(p->raddr + p->rgot), n};
    ssize_t      got  = (ssize_t)left;
    char         why[256];

    while (p->rdst != NULL) { /* a dropped payload is not pulled at all */
        struct iovec l = {p->rdst + p->rgot, n};
        got            = process_vm_readv(p->pid, &l, 1, &r, 1, 0);
        if (got >= 0 || errno != EINTR) break;
    }
    if (got <= 0) {
        int e = got < 0 ? errno : EFAULT;
        if (e == ESRCH)
            snprintf(why, sizeof(why), "rank %d (pid %d) exited", peer, (int)p->pid);
        else
            snprintf(why, sizeof(why),
                     "cross-memory read of %zu bytes at offset %" PRIu64 " of a %" PRIu64
                     "-byte message from rank %d (pid %d) failed: %s",
                     n, p->rgot, p->rhdr.nbytes, peer, (int)p->pid, strerror(e));
        shm_fail_peer(ctx, peer, XCCL_ERR_REMOTE, SHM_DROPPED, why);
        return -1;
    }
    p->rgot += (uint64_t)got;
    *budget -= shm_min64(*budget, (uint64_t)got);
    (*nev)++;
    if (p->rgot < p->rhdr.nbytes) return 0;
    atomic_store_explicit(&p->in.ctl->cma_done, ++p->cma_pulled, memory_order_release);
    p->in_moved = 1;
    return 1;
}

/* Publishes the consumer position and tells a producer that waits for it. */
static void shm_publish_tail(shm_peer_t *p)
{
    if (p->rtail != p->rtail_pub) {
        p->rtail_pub = p->rtail;
        atomic_store(&p->in.ctl->tail, p->rtail); /* seq_cst: before the load of prod_wants */
        p->in_moved = 1;
    }
    if (p->in_moved) {
        p->in_moved = 0;
        atomic_thread_fence(memory_order_seq_cst);
        if (atomic_load_explicit(&p->in.ctl->prod_wants, memory_order_relaxed))
            shm_bell(p->seg);
    }
}

/* Delivers what the ring from `peer` holds, within a budget. `drain`: the peer is gone, so take
 * only complete INLINE/STREAM records and start no CMA read. Returns 1 if the budget ran out
 * with work left. */
static int shm_consume(xccl_tp_ctx_t *ctx, int peer, int drain, int *nev)
{
    shm_peer_t *p     = &ctx->peers[peer];
    shm_ring_t *r     = &p->in;
    int         msgs  = drain ? INT_MAX : SHM_RECV_MSGS;
    uint64_t    bytes = drain ? UINT64_MAX : r->cap < SHM_CMA_STEP ? SHM_CMA_STEP : r->cap;
    int         more  = 0;

    while (atomic_load(&p->state) == SHM_P_UP) {
        if (p->rstate == SHM_R_IDLE) {
            shm_slot_t s;
            int        rc;

            if (p->rtail == p->rhead) {
                p->rhead = atomic_load_explicit(&r->ctl->head, memory_order_acquire);
                if (p->rtail == p->rhead) break;
            }
            if (msgs-- == 0) {
                more = 1;
                break;
            }
            shm_ring_read(r, p->rtail, &s, sizeof(s));
            if (drain) p->rhead = atomic_load_explicit(&r->ctl->head, memory_order_acquire);
            if (drain && (s.kind == SHM_REC_CMA ||
                          (s.kind == SHM_REC_STREAM &&
                           p->rhead - p->rtail < SHM_SLOT + shm_pad64(s.hdr.nbytes))))
                break; /* the rest of it will never come */
            if ((s.kind != SHM_REC_INLINE && s.kind != SHM_REC_STREAM && s.kind != SHM_REC_CMA) ||
                (s.kind == SHM_REC_INLINE && s.hdr.nbytes > SHM_INLINE_MAX)) {
                char why[128];
                snprintf(why, sizeof(why),
                         "rank %d wrote a corrupt record (kind %u) into our ring", peer, s.kind);
                shm_fail_peer(ctx, peer, XCCL_ERR_INTERNAL, SHM_DROPPED, why);
                break;
            }
            rc = shm_match(ctx, peer, &s, nev);
            if (rc == 1) break; /* held back (when draining, dropped like a CMA record) */
            p->rtail += SHM_SLOT;
            if (rc != 0) break;
            continue;
        }
        if (p->rstate == SHM_R_STREAM) {
            uint64_t avail, take;

            if (p->rtail == p->rhead)
                p->rhead = atomic_load_explicit(&r->ctl->head, memory_order_acquire);
            avail = p->rhead - p->rtail;
            if (avail == 0) break;
            if (bytes == 0) {
                more = 1;
                break;
            }
            /* in quarters of the ring at most, each released at once, so the producer
             * refills behind us while we copy on */
            take = shm_min64(shm_min64(avail, p->rhdr.nbytes - p->rgot), bytes);
            take = shm_min64(take, r->cap / 4);
            if (p->rdst != NULL) shm_ring_read(r, p->rtail, p->rdst + p->rgot, (size_t)take);
            p->rgot += take;
            p->rtail += take;
            bytes -= take;
            (*nev)++;
            if (p->rgot < p->rhdr.nbytes) {
                if (p->rtail - p->rtail_pub >= r->cap / 4) shm_publish_tail(p);
                continue;
            }
            p->rtail += shm_pad64(p->rhdr.nbytes) - p->rhdr.nbytes;
            shm_recv_complete(ctx, p, nev);
            continue;
        }
        /* SHM_R_CMA */
        if (drain) break;
        if (bytes == 0) {
            more = 1;
            break;
        }
        shm_publish_tail(p); /* the slot is consumed: free its room before the long copy */
        {
            int rc = shm_cma_step(ctx, peer, &bytes, nev);
            if (rc < 0) break;
            if (rc == 0) {
                more = 1;
                break;
            }
            shm_publish_tail(p); /* cma_done moved: the sender may be waiting for it */
            shm_recv_complete(ctx, p, nev);
        }
    }
    if (atomic_load(&p->state) == SHM_P_UP) shm_publish_tail(p);
    return more;
}

/* ---------------------------------------------------------------------------------------------
 * Progress
 * ------------------------------------------------------------------------------------------- */

/* The peer's process is gone: deliver what it left complete in the ring, then fail it. */
static void shm_peer_exited(xccl_tp_ctx_t *ctx, int peer, int *nev)
{
    shm_peer_t *p = &ctx->peers[peer];
    char        why[128];

    (void)shm_unlink(p->name); /* normally gone already (ENOENT) */
    snprintf(why, sizeof(why), "rank %d (pid %d) exited", peer, (int)p->pid);
    shm_reap_cma(ctx, peer, nev); /* pulls it finished before it went did complete */
    shm_consume(ctx, peer, 1, nev);
    shm_fail_peer(ctx, peer, XCCL_ERR_REMOTE, SHM_OPEN, why);
}

/* Fails the peers whose process is gone; the pidfds are polled together in one call. */
static void shm_check_liveness(xccl_tp_ctx_t *ctx, int *nev)
{
    int n = 0;

    for (int i = 0; i < ctx->nup; i++) {
        int         peer = ctx->up_list[i];
        shm_peer_t *p    = &ctx->peers[peer];

        if (atomic_load(&p->state) != SHM_P_UP) continue;
        if (p->watch == SHM_WATCH_PIDFD) {
            ctx->pfds[n].fd      = p->pidfd;
            ctx->pfds[n].events  = POLLIN;
            ctx->pfds[n].revents = 0;
            ctx->pfd_peer[n++]   = peer;
        } else if (shm_peer_gone(p)) {
            shm_peer_exited(ctx, peer, nev);
        }
    }
    if (n == 0 || poll(ctx->pfds, (nfds_t)n, 0) <= 0) return;
    for (int i = 0; i < n; i++)
        if (ctx->pfds[i].revents != 0) shm_peer_exited(ctx, ctx->pfd_peer[i], nev);
}

/* The peer closed the pair (finalize, close_peer, a refused message). A live peer drops a
 * pair mostly because a third rank died in an operation they shared: look for dead peers
 * first, so that operations fail naming the cause rather than the messenger. */
static void shm_peer_closed(xccl_tp_ctx_t *ctx, int peer, uint32_t how, int *nev)
{
    shm_peer_t *p = &ctx->peers[peer];
    char        told[SHM_WHY_LEN], why[SHM_WHY_LEN + 96];

    if (how != SHM_FINALIZED) {
        shm_check_liveness(ctx, nev);
        if (atomic_load(&ctx->peers[peer].state) != SHM_P_UP) return;
    }

    shm_reap_cma(ctx, peer, nev); /* cma_done is final: what it pulled before closing is done */
    shm_consume(ctx, peer, 1, nev);
    if (how == SHM_FINALIZED) {
        snprintf(why, sizeof(why), "rank %d (pid %d) closed its shared-memory transport", peer,
                 (int)p->pid);
    } else {
        memcpy(told, p->in.ctl->why, sizeof(told)); /* another process wrote it: bound it */
        told[sizeof(told) - 1] = '\0';
        snprintf(why, sizeof(why), "rank %d (pid %d) dropped its connection to us%s%s", peer,
                 (int)p->pid, told[0] ? ": " : "", told);
    }
    shm_fail_peer(ctx, peer, XCCL_ERR_REMOTE, SHM_OPEN, why);
}

static xccl_status_t shm_progress(xccl_tp_ctx_t *ctx, int *nevents)
{
    int     nev = 0, more = 0;
    int64_t now;

    atomic_store_explicit(&ctx->seen_bell, atomic_load_explicit(&ctx->seg->bell,
                                                                memory_order_acquire),
                          memory_order_relaxed);
    for (int i = 0; i < ctx->nup; i++) {
        int         peer = ctx->up_list[i];
        shm_peer_t *p    = &ctx->peers[peer];
        uint32_t    how;

        if (atomic_load_explicit(&p->state, memory_order_relaxed) != SHM_P_UP) continue;
        /* send side */
        if (p->cq_head != NULL) shm_reap_cma(ctx, peer, &nev);
        if (p->sq_head != NULL) shm_push(ctx, peer, &nev);
        if (atomic_load(&p->state) != SHM_P_UP) continue;
        if (p->sq_head == NULL && p->cq_head == NULL) shm_set_wants(p, 0);
        /* receive side */
        how = atomic_load_explicit(&p->in.ctl->closed, memory_order_acquire);
        if (how != SHM_OPEN) shm_peer_closed(ctx, peer, how, &nev);
        else more |= shm_consume(ctx, peer, 0, &nev);
    }
    now = xccl_now_ms();
    if (now >= ctx->next_liveness) {
        ctx->next_liveness = now + SHM_LIVENESS_MS;
        shm_check_liveness(ctx, &nev);
    }
    atomic_store_explicit(&ctx->must_poll, more, memory_order_relaxed);
    if (nevents != NULL) *nevents = nev;
    return XCCL_OK;
}

/* 1 when no ring has data or a close to look at (read by a thread that counted itself in
 * sleepers or pollers first, see Waiting). */
static int shm_rings_idle(const xccl_tp_ctx_t *ctx)
{
    for (int i = 0; i < ctx->nup; i++) {
        shm_peer_t *p = &ctx->peers[ctx->up_list[i]];
        if (atomic_load_explicit(&p->state, memory_order_relaxed) != SHM_P_UP) continue;
        if (atomic_load(&p->in.ctl->head) != atomic_load(&p->in.ctl->tail) ||
            atomic_load_explicit(&p->in.ctl->closed, memory_order_relaxed) != SHM_OPEN)
            return 0;
    }
    return 1;
}

/* Sleeps on our bell unless a ring has data, progress left work behind, or the bell moved
 * since the last progress pass (see Waiting). A peer's death rings no bell: it is noticed by
 * the progress pass after the sleep, so timeout_ms bounds how late (the core passes a few ms). */
static void shm_wait(xccl_tp_ctx_t *ctx, int timeout_ms)
{
    shm_seg_hdr_t  *h    = ctx->seg;
    uint32_t        seen = atomic_load_explicit(&ctx->seen_bell, memory_order_relaxed);
    struct timespec ts;

    if (timeout_ms <= 0 || atomic_load_explicit(&ctx->must_poll, memory_order_relaxed)) return;
    atomic_fetch_add(&h->sleepers, 1);
    if (shm_rings_idle(ctx) && atomic_load(&h->bell) == seen) {
        ts.tv_sec  = timeout_ms / 1000;
        ts.tv_nsec = (long)(timeout_ms % 1000) * 1000000L;
        (void)syscall(SYS_futex, (uint32_t *)&h->bell, FUTEX_WAIT, seen, &ts, NULL, 0);
    }
    atomic_fetch_sub(&h->sleepers, 1);
}

/* The same checks as shm_wait, for the core's poll over several transports: counted in
 * pollers, the thread is woken through the wake socket (see Waiting). */
static int shm_wait_arm(xccl_tp_ctx_t *ctx, int *fd)
{
    shm_seg_hdr_t *h    = ctx->seg;
    uint32_t       seen = atomic_load_explicit(&ctx->seen_bell, memory_order_relaxed);

    if (atomic_load_explicit(&ctx->must_poll, memory_order_relaxed)) return 0;
    if (!ctx->pollable) {
        *fd = -1;
        return 1;
    }
    atomic_fetch_add(&h->pollers, 1);
    if (!shm_rings_idle(ctx) || atomic_load(&h->bell) != seen) {
        atomic_fetch_sub(&h->pollers, 1);
        return 0;
    }
    *fd = ctx->wake_fd;
    return 1;
}

/* The last poller out empties the wake socket; one still polling would lose its wake-up. */
static void shm_wait_disarm(xccl_tp_ctx_t *ctx)
{
    char buf[8];
    int  n = 0;

    if (!ctx->pollable || atomic_fetch_sub(&ctx->seg->pollers, 1) != 1) return;
    while (n++ < 256 && recv(ctx->wake_fd, buf, sizeof(buf), MSG_DONTWAIT) >= 0)
        continue;
}

static void shm_wake(xccl_tp_ctx_t *ctx) { shm_bell(ctx->seg); }

static void shm_close_peer(xccl_tp_ctx_t *ctx, int peer, const char *why)
{
    char msg[320];

    if (peer < 0 || peer >= ctx->size || atomic_load(&ctx->peers[peer].state) != SHM_P_UP) return;
    snprintf(msg, sizeof(msg), "connection to rank %d closed by rank %d: %s", peer, ctx->rank,
             why ? why : "closed");
    shm_fail_peer(ctx, peer, XCCL_ERR_REMOTE, SHM_DROPPED, msg);
}

/* ---------------------------------------------------------------------------------------------
 * Wire-up
 * ------------------------------------------------------------------------------------------- */

/* Decides whether we can pull `peer`'s memory: read its probe word with process_vm_readv. */
static int shm_cma_probe(xccl_tp_ctx_t *ctx, shm_peer_t *p, const char **why)
{
    uint64_t     v = 0;
    struct iovec l = {&v, sizeof(v)};
    struct iovec r = {(void *)(uintptr_t)p->seg->probe_addr, sizeof(v)};
    ssize_t      n;

    if (!ctx->cma_env) {
        *why = "XCCL_SHM_CMA=0";
        return 0;
    }
    if (!shm_same_pidns(ctx, p->seg->pid_ns)) {
        *why = "it runs in another pid namespace";
        return 0;
    }
    n = process_vm_readv(p->pid, &l, 1, &r, 1, 0);
    if (n == (ssize_t)sizeof(v) && v == p->seg->probe_value) return 1;
    if (n < 0 && errno == EPERM)
        *why = "not permitted (ptrace restrictions: see /proc/sys/kernel/yama/ptrace_scope)";
    else if (n < 0 && errno == ENOSYS)
        *why = "the kernel has no process_vm_readv";
    else
        *why = "the peer's pid is not ours to read (another pid namespace?)";
    return 0;
}

/* Maps `peer`'s segment, checks it, decides CMA and tells the peer we are attached.
 * XCCL_INPROGRESS: its segment is not there (yet). */
static xccl_status_t shm_attach(xccl_tp_ctx_t *ctx, int peer, const shm_addr_t *a)
{
    shm_peer_t    *p = &ctx->peers[peer];
    shm_seg_hdr_t *h;
    struct stat    sb;
    const char    *why = NULL;
    int            fd, cma;
    void          *m;
    shm_ring_loc_t loc;

    fd = shm_open(a->name, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) {
        if (errno == ENOENT) return XCCL_INPROGRESS;
        return XCCL_ERROR(XCCL_ERR_SYSTEM,
                          "shm: rank %d: cannot open the segment %s of rank %d: %s", ctx->rank,
                          a->name, peer, strerror(errno));
    }
    if (fstat(fd, &sb) != 0 || (uint64_t)sb.st_size != a->seg_bytes ||
        a->seg_bytes < shm_hdr_bytes(ctx->size)) {
        close(fd);
        return XCCL_ERROR(XCCL_ERR_REMOTE,
                          "shm: rank %d: the segment %s of rank %d has the wrong size", ctx->rank,
                          a->name, peer);
    }
    m = mmap(NULL, (size_t)a->seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (m == MAP_FAILED) {
        int e = errno;
        close(fd);
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "shm: rank %d: mapping %" PRIu64 " bytes of %s: %s",
                          ctx->rank, a->seg_bytes, a->name, strerror(e));
    }
    h = m;
    if (xccl_shm_seg_check(h, a->seg_bytes, a->pid, peer, ctx->rank, ctx->size, ctx->job_id,
                           &loc) != 0) {
        munmap(m, (size_t)a->seg_bytes);
        close(fd);
        return XCCL_ERROR(XCCL_ERR_REMOTE,
                          "shm: rank %d: the segment %s is not the one rank %d of this job made",
                          ctx->rank, a->name, peer);
    }
    p->seg       = h;
    p->seg_bytes = a->seg_bytes;
    p->pid       = a->pid;
    snprintf(p->name, sizeof(p->name), "%s", a->name);
    shm_ring_map(&p->out, h, shm_hdr_bytes(ctx->size), loc.ring_bytes, loc.idx);
    shm_ring_map(&p->in, ctx->seg, ctx->hdr_bytes, ctx->seg->ring_bytes, ctx->seg->ring_of[peer]);
    if (ctx->watch_lock || !shm_same_pidns(ctx, h->pid_ns)) {
        p->watch  = SHM_WATCH_LOCK;
        p->lockfd = fd;
        fd        = -1;
    } else if ((p->pidfd = xccl_pidfd_open(p->pid)) >= 0) {
        p->watch = SHM_WATCH_PIDFD;
    } else {
        p->watch = SHM_WATCH_KILL;
        if (errno != ENOSYS)
            XCCL_INFO("shm: rank %d: pidfd_open(%d) for rank %d failed (%s); watching it with "
                      "kill()", ctx->rank, (int)p->pid, peer, strerror(errno));
    }
    if (fd >= 0) close(fd);
    cma = shm_cma_probe(ctx, p, &why);
    if (!cma)
        XCCL_INFO("shm: rank %d: no cross-memory attach from rank %d (pid %d): %s", ctx->rank,
                  peer, (int)p->pid, why);
    /* our decision goes into the ring it writes to, before it learns we are attached */
    atomic_store(&p->in.ctl->cma, cma ? SHM_CMA_ON : SHM_CMA_OFF);
    atomic_store(&p->out.ctl->poke, shm_poke(h) == 0); /* a stray wake-up is harmless */
    atomic_store(&p->out.ctl->attached, 1);
    shm_bell(h);
    return XCCL_OK;
}

static void shm_list(xccl_tp_ctx_t *ctx, const uint8_t *use, int attached, char *buf, size_t len)
{
    size_t used = 0;
    int    shown = 0;

    buf[0] = '\0';
    for (int i = 0; i < ctx->size && used + 64 < len; i++) {
        shm_peer_t *p = &ctx->peers[i];
        int         w;
        if (!use[i] || i == ctx->rank) continue;
        if (!attached && p->seg != NULL) continue;
        if (attached && (p->seg == NULL || atomic_load(&p->in.ctl->attached))) continue;
        w = snprintf(buf + used, len - used, "%srank %d", shown++ ? ", " : "", i);
        if (w > 0) used += (size_t)w;
    }
}

static xccl_status_t shm_wireup(xccl_tp_ctx_t *ctx, const void *const *addrs, const size_t *lens,
                                const uint8_t *use, int64_t timeout_ms)
{
    shm_addr_t   *a;
    int64_t       t0 = xccl_now_ms(), deadline;
    xccl_status_t st = XCCL_OK;
    int           ncma = 0, nused = 0;
    useconds_t    nap = 50;
    char          from[48];

    if (timeout_ms < 0) timeout_ms = 30LL * 60 * 1000; /* the caller gave none: 30 minutes */
    deadline = t0 + timeout_ms;
    a        = calloc((size_t)ctx->size, sizeof(*a));
    if (a == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "shm: rank %d: wire-up", ctx->rank);
    for (int i = 0; i < ctx->size; i++) {
        if (!use[i] || i == ctx->rank) continue;
        if (atomic_load(&ctx->peers[i].state) != SHM_P_IDLE || ctx->peers[i].seg != NULL) {
            st = XCCL_ERROR(XCCL_ERR_INVALID_USAGE, "shm: rank %d: rank %d is already wired up",
                            ctx->rank, i);
            goto out;
        }
        if (!ctx->linked) {
            st = XCCL_ERROR(XCCL_ERR_INVALID_USAGE,
                            "shm: rank %d: wire-up of rank %d after our segment was unlinked "
                            "(wire-up runs once)", ctx->rank, i);
            goto out;
        }
        if (ctx->seg->ring_of[i] < 0) {
            st = XCCL_ERROR(XCCL_ERR_INVALID_ARG, "shm: rank %d: rank %d is not on this host",
                            ctx->rank, i);
            goto out;
        }
        if (xccl_shm_addr_decode(addrs[i], lens[i], &a[i]) != 0 || a[i].job_id != ctx->job_id ||
            a[i].rank != i) {
            st = XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                            "shm: rank %d: the address of rank %d is malformed or from another "
                            "job (%zu bytes)", ctx->rank, i, lens[i]);
            goto out;
        }
        nused++;
    }
    for (;;) {
        int pending = 0, now_ms;

        for (int i = 0; i < ctx->size; i++) {
            shm_peer_t *p    = &ctx->peers[i];
            int         gone = 0;

            if (!use[i] || i == ctx->rank) continue;
            if (p->seg == NULL) {
                st = shm_attach(ctx, i, &a[i]);
                if (st < 0) goto out;
            }
            if (p->seg == NULL) {
                pending++;
                gone = shm_same_pidns(ctx, a[i].pid_ns) && kill(a[i].pid, 0) != 0 &&
                       errno == ESRCH;
            } else if (!atomic_load(&p->in.ctl->attached)) {
                pending++;
                gone = shm_peer_gone(p);
            }
            if (gone) {
                (void)shm_unlink(a[i].name); /* it may have died before unlinking it */
                st = XCCL_ERROR(XCCL_ERR_REMOTE,
                                "shm: rank %d: rank %d (pid %d) exited during wire-up", ctx->rank,
                                i, (int)a[i].pid);
                goto out;
            }
        }
        st = XCCL_OK;
        if (pending == 0) break;
        now_ms = (int)(xccl_now_ms() - t0);
        if (xccl_now_ms() >= deadline) {
            char mis[512], unat[512];
            shm_list(ctx, use, 0, mis, sizeof(mis));
            shm_list(ctx, use, 1, unat, sizeof(unat));
            st = XCCL_ERROR(XCCL_ERR_TIMEOUT,
                            "shm: rank %d: wire-up timed out after %d ms; segment not found: "
                            "%s; never mapped ours: %s",
                            ctx->rank, now_ms, mis[0] ? mis : "none", unat[0] ? unat : "none");
            goto out;
        }
        usleep(nap);
        nap = nap * 2 > SHM_WIRE_SLEEP_US ? SHM_WIRE_SLEEP_US : nap * 2;
    }
    /* everyone who will ever map our segment has: the name can go */
    if (ctx->linked && shm_unlink(ctx->name) == 0) ctx->linked = 0;
    ctx->pollable = ctx->wake_fd >= 0;
    for (int i = 0; i < ctx->size; i++) {
        shm_peer_t *p = &ctx->peers[i];
        if (!use[i] || i == ctx->rank) continue;
        p->cma = atomic_load(&p->out.ctl->cma) == SHM_CMA_ON;
        ncma += p->cma;
        p->tail_cache = atomic_load(&p->out.ctl->tail);
        p->rhead = p->rtail = p->rtail_pub = atomic_load(&p->in.ctl->tail);
        ctx->up_list[ctx->nup++] = i;
        if (!atomic_load(&p->in.ctl->poke)) ctx->pollable = 0;
        atomic_store(&p->state, SHM_P_UP);
    }
    if (ctx->cma_min == UINT64_MAX)
        snprintf(from, sizeof(from), "unused: a CPU per local rank");
    else
        snprintf(from, sizeof(from), "from %" PRIu64 " bytes", ctx->cma_min);
    XCCL_INFO("shm: rank %d wired up %d peer(s) in %lld ms (rings of %" PRIu64
              " KiB, cross-memory attach to %d of them, %s)",
              ctx->rank, nused, (long long)(xccl_now_ms() - t0), ctx->ring_bytes >> 10, ncma, from);
out:
    free(a);
    return st;
}

/* ---------------------------------------------------------------------------------------------
 * Context
 * ------------------------------------------------------------------------------------------- */

static void shm_finalize(xccl_tp_ctx_t *ctx)
{
    if (ctx == NULL) return;
    if (ctx->peers != NULL) {
        for (int i = 0; i < ctx->size; i++) {
            shm_peer_t *p = &ctx->peers[i];
            shm_send_t *lists[2] = {p->sq_head, p->cq_head};

            if (p->seg != NULL) {
                uint32_t open = SHM_OPEN;
                atomic_compare_exchange_strong(&p->out.ctl->closed, &open, SHM_FINALIZED);
                shm_bell(p->seg);
                munmap(p->seg, (size_t)p->seg_bytes);
            }
            if (p->pidfd >= 0) close(p->pidfd);
            if (p->lockfd >= 0) close(p->lockfd);
            for (int k = 0; k < 2; k++) {
                while (lists[k] != NULL) {
                    shm_send_t *next = lists[k]->next;
                    free(lists[k]);
                    lists[k] = next;
                }
            }
        }
    }
    while (ctx->free_sends != NULL) {
        shm_send_t *next = ctx->free_sends->next;
        free(ctx->free_sends);
        ctx->free_sends = next;
    }
    if (ctx->linked) shm_unlink(ctx->name);
    if (ctx->seg != NULL) munmap(ctx->seg, (size_t)ctx->seg_bytes);
    if (ctx->fd >= 0) close(ctx->fd); /* drops our OFD lock */
    if (ctx->wake_fd >= 0) close(ctx->wake_fd);
    if (ctx->poke_held) shm_poke_drop();
    free(ctx->peers);
    free(ctx->up_list);
    free(ctx->pfds);
    free(ctx->pfd_peer);
    free(ctx->infos);
    free(ctx);
}

/* Ring size: XCCL_SHM_RING_KB, else SHM_RING_BUDGET shared by the local peers, within
 * [SHM_RING_MIN, SHM_RING_MAX]; a power of two either way. */
static uint64_t shm_ring_size(int nlocal)
{
    int64_t  kb = xccl_env_int("XCCL_SHM_RING_KB", 0);
    uint64_t want, cap = 64 << 10;

    if (kb > 0) want = (uint64_t)kb << 10;
    else want = SHM_RING_BUDGET / (uint64_t)(nlocal > 0 ? nlocal : 1);
    if (want > ((uint64_t)1 << 30)) want = (uint64_t)1 << 30;
    while (cap * 2 <= want) cap *= 2;
    if (kb <= 0) cap = cap < SHM_RING_MIN ? SHM_RING_MIN : cap > SHM_RING_MAX ? SHM_RING_MAX : cap;
    return cap;
}

/* Smallest message pulled with CMA (see the top of the file): XCCL_SHM_CMA_MIN, else the ring
 * size where the core found CPUs scarce (more local ranks than CPUs), else none. Only the
 * sender reads it (the slot says which path a message takes), so ranks need not agree. */
static uint64_t shm_cma_min(int cpus_scarce, uint64_t ring_bytes)
{
    int64_t v = xccl_env_int("XCCL_SHM_CMA_MIN", -1);

    if (v >= 0) return v <= SHM_INLINE_MAX ? SHM_INLINE_MAX + 1 : (uint64_t)v;
    return cpus_scarce ? ring_bytes : UINT64_MAX;
}

static xccl_status_t shm_init(const xccl_tp_init_params_t *params, xccl_tp_ctx_t **out)
{
    xccl_tp_ctx_t *ctx;
    xccl_status_t  st;
    int            nlocal = 0, e;

    if (params == NULL || out == NULL || params->size < 1 || params->rank < 0 ||
        params->rank >= params->size || params->peers == NULL || params->up == NULL ||
        params->up->recv_match == NULL || params->up->recv_done == NULL ||
        params->up->send_done == NULL || params->up->peer_failed == NULL)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "shm: init: bad parameters (rank %d of %d)",
                          params ? params->rank : -1, params ? params->size : 0);
    for (int i = 0; i < params->size; i++)
        nlocal += i != params->rank &&
                  shm_same_host(&params->peers[i], &params->peers[params->rank]);
    if (nlocal == 0) return XCCL_ERR_NOT_SUPPORTED; /* nobody to reach: no segment */

    ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL) return XCCL_ERROR(XCCL_ERR_NO_MEMORY, "shm: init: context");
    ctx->fd      = -1;
    ctx->wake_fd = -1;
    ctx->rank    = params->rank;
    ctx->size    = params->size;
    ctx->job_id  = params->job_id;
    ctx->up      = params->up;
    ctx->cma_env = xccl_env_int("XCCL_SHM_CMA", 1) != 0;
    ctx->infos    = malloc((size_t)ctx->size * sizeof(*ctx->infos));
    ctx->peers    = calloc((size_t)ctx->size, sizeof(*ctx->peers));
    ctx->up_list  = calloc((size_t)ctx->size, sizeof(*ctx->up_list));
    ctx->pfds     = calloc((size_t)ctx->size, sizeof(*ctx->pfds));
    ctx->pfd_peer = calloc((size_t)ctx->size, sizeof(*ctx->pfd_peer));
    for (int i = 0; ctx->peers != NULL && i < ctx->size; i++)
        ctx->peers[i].pidfd = ctx->peers[i].lockfd = -1;
    if (!ctx->infos || !ctx->peers || !ctx->up_list || !ctx->pfds || !ctx->pfd_peer) {
        st = XCCL_ERROR(XCCL_ERR_NO_MEMORY, "shm: init: %d peers", ctx->size);
        goto fail;
    }
    memcpy(ctx->infos, params->peers, (size_t)ctx->size * sizeof(*ctx->infos));
    ctx->pid_ns     = shm_pid_ns();
    ctx->watch_lock = getenv("XCCL_SHM_WATCH") && strcmp(getenv("XCCL_SHM_WATCH"), "lock") == 0;
    if (getrandom((void *)&ctx->probe, sizeof(ctx->probe), GRND_NONBLOCK) != sizeof(ctx->probe))
        ctx->probe = xccl_now_ns() ^ ((uint64_t)getpid() << 32) ^ (uintptr_t)ctx;

    ctx->ring_bytes = shm_ring_size(nlocal);
    ctx->cma_min    = shm_cma_min(params->cpus_scarce, ctx->ring_bytes);
    ctx->hdr_bytes  = shm_hdr_bytes(ctx->size);
    ctx->seg_bytes  = ctx->hdr_bytes + (uint64_t)nlocal * (SHM_CTL_BYTES + ctx->ring_bytes);
    shm_sweep_orphans();
    shm_seg_name(ctx->name, ctx->job_id, ctx->rank);
    ctx->fd = shm_open(ctx->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (ctx->fd < 0) {
        e = errno;
        if (e == EEXIST) {
            st = XCCL_ERROR(XCCL_ERR_SYSTEM, "shm: rank %d: segment %s already exists", ctx->rank,
                            ctx->name);
            goto fail;
        }
        XCCL_WARN("shm: rank %d: shm_open(%s) failed (%s): shared memory not used", ctx->rank,
                  ctx->name, strerror(e));
        st = XCCL_ERR_NOT_SUPPORTED;
        goto fail;
    }
    ctx->linked = 1;
    {
        /* held until we exit or finalize, taken first thing: how peers in another pid
         * namespace see us alive, and what tells shm_sweep_orphans the segment is in use */
        struct flock fl;
        memset(&fl, 0, sizeof(fl));
        fl.l_type   = F_WRLCK;
        fl.l_whence = SEEK_SET;
        if (fcntl(ctx->fd, F_OFD_SETLK, &fl) != 0)
            XCCL_INFO("shm: rank %d: cannot lock %s (%s)", ctx->rank, ctx->name, strerror(errno));
    }
    /* reserve the pages now: a full /dev/shm fails here rather than with SIGBUS later */
    e = ftruncate(ctx->fd, (off_t)ctx->seg_bytes) != 0
            ? errno
            : posix_fallocate(ctx->fd, 0, (off_t)ctx->seg_bytes);
    if (e != 0) {
        XCCL_WARN("shm: rank %d: cannot reserve %" PRIu64 " KiB in /dev/shm (%s): shared memory "
                  "not used; XCCL_SHM_RING_KB makes the rings smaller",
                  ctx->rank, ctx->seg_bytes >> 10, strerror(e));
        st = XCCL_ERR_NOT_SUPPORTED;
        goto fail;
    }
    ctx->seg = mmap(NULL, (size_t)ctx->seg_bytes, PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_POPULATE, ctx->fd, 0);
    if (ctx->seg == MAP_FAILED) {
        ctx->seg = NULL;
        st = XCCL_ERROR(XCCL_ERR_SYSTEM, "shm: rank %d: mapping %" PRIu64 " bytes: %s", ctx->rank,
                        ctx->seg_bytes, strerror(errno));
        goto fail;
    }
    {
        /* the wake socket exists before peers can attach (they test it then) */
        struct sockaddr_un a;
        shm_poke_hold();
        ctx->poke_held = 1;
        socklen_t          alen = shm_wake_addr(&a, ctx->job_id, ctx->rank, (int32_t)getpid());
        ctx->wake_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (ctx->wake_fd < 0 || bind(ctx->wake_fd, (struct sockaddr *)&a, alen) != 0) {
            e = errno;
            if (ctx->wake_fd >= 0) close(ctx->wake_fd);
            ctx->wake_fd = -1;
            XCCL_INFO("shm: rank %d: no wake socket (%s): beside other transports the wait "
                      "polls every ms", ctx->rank, strerror(e));
        }
    }
    {
        shm_seg_hdr_t *h = ctx->seg;
        int            k = 0;

        h->version     = SHM_VERSION;
        h->rank        = ctx->rank;
        h->size        = ctx->size;
        h->pid         = (int32_t)getpid();
        h->job_id      = ctx->job_id;
        h->seg_bytes   = ctx->seg_bytes;
        h->ring_bytes  = ctx->ring_bytes;
        h->probe_addr  = (uint64_t)(uintptr_t)&ctx->probe;
        h->probe_value = ctx->probe;
        h->pid_ns      = ctx->pid_ns;
        h->nrings      = nlocal;
        for (int i = 0; i < ctx->size; i++)
            h->ring_of[i] =
                i != ctx->rank && shm_same_host(&ctx->infos[i], &ctx->infos[ctx->rank]) ? k++
                                                                                        : -1;
        atomic_store(&h->bell, 0);
        atomic_store(&h->sleepers, 0);
        atomic_store(&h->pollers, 0);
        /* the magic last: a peer that sees it sees the rest */
        atomic_thread_fence(memory_order_release);
        h->magic = SHM_SEG_MAGIC;
    }
    XCCL_INFO("shm: rank %d created %s (%" PRIu64 " KiB, %d ring(s) of %" PRIu64 " KiB)",
              ctx->rank, ctx->name, ctx->seg_bytes >> 10, nlocal, ctx->ring_bytes >> 10);
    *out = ctx;
    return XCCL_OK;
fail:
    shm_finalize(ctx);
    return st;
}

static int shm_reachable(const xccl_tp_ctx_t *ctx, int peer)
{
    return peer >= 0 && peer < ctx->size && peer != ctx->rank && ctx->seg->ring_of[peer] >= 0;
}

static xccl_status_t shm_get_addr(xccl_tp_ctx_t *ctx, void *addr, size_t *len)
{
    shm_addr_t a;

    memset(&a, 0, sizeof(a));
    memcpy(a.magic, SHM_ADDR_MAGIC, 4);
    a.version   = SHM_VERSION;
    a.job_id    = ctx->job_id;
    a.rank      = ctx->rank;
    a.pid       = (int32_t)getpid();
    a.seg_bytes = ctx->seg_bytes;
    a.pid_ns    = ctx->pid_ns;
    snprintf(a.name, sizeof(a.name), "%s", ctx->name);
    memcpy(addr, &a, sizeof(a));
    *len = SHM_ADDR_LEN;
    return XCCL_OK;
}

const xccl_transport_ops_t xccl_transport_shm = {
    .abi_version = XCCL_TRANSPORT_ABI_VERSION,
    .name        = "shm",
    .caps        = XCCL_TP_CAP_HOST_MEM | XCCL_TP_CAP_INTRA_HOST | XCCL_TP_CAP_RECV_PULL |
                   XCCL_TP_CAP_DEFER,
    .priority    = 20,
    /* a slot through a ring (~1-2 us with the call around it); bulk data at memory speed (two
     * pipelined copies through a ring, or one CMA copy) */
    .alpha       = 2e-6,
    .beta        = 1.0 / 6e9,
    .init        = shm_init,
    .finalize    = shm_finalize,
    .reachable   = shm_reachable,
    .get_addr    = shm_get_addr,
    .wireup      = shm_wireup,
    .isend       = shm_isend,
    .progress    = shm_progress,
    .wait        = shm_wait,
    .wait_arm    = shm_wait_arm,
    .wait_disarm = shm_wait_disarm,
    .wake        = shm_wake,
    .close_peer  = shm_close_peer,
};
