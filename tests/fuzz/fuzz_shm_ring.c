/* SPDX-License-Identifier: Apache-2.0
 *
 * fuzz_shm_ring.c - the shared-memory transport's consumer (backends/shm/shm.c: shm_consume,
 * shm_match, the CMA pull, the closed flag) reading the ring a peer process writes. Rank 0 is
 * the real transport with a small fake core; this harness is rank 1: it makes its own segment
 * by shm_layout.h, maps rank 0's, and writes into the ring rank 0 reads, driven by the input:
 *
 *   [u16 start] ring positions begin there (so records wrap early), then operations:
 *   0 INLINE  [u8 tag][u8 n]          a correct record with n % 25 payload bytes
 *   1 STREAM  [u8 tag][u16 n][u8 m]   a correct record of n * (1 + m % 4) bytes, published in
 *                                     pieces as rank 0 frees room
 *   2 CMA     [u8 tag][u16 n]         a correct record rank 0 pulls with process_vm_readv
 *   3 SLOT    [64 bytes]              a raw slot (any kind, header, payload address)
 *   4 BYTES   [u8 n][n bytes]         raw bytes at head, head += n (misaligned from then on)
 *   5 HEAD    [i16 d]                 head = tail + d (behind the tail, or far ahead)
 *   6 RUN     [u8 k]                  rank 0 progresses k % 8 + 1 times
 *   7 CLOSE   [u8 how][u8 fill]       closed = how % 3 with an unterminated `why`
 * Tags with bit 0 set ask the fake core to hold the message back once (XCCL_INPROGRESS), bit 1
 * to drop its payload; headers over 1 MiB are refused, as the core refuses unexpected sizes,
 * and so is every message after the 4096th.
 *
 * Checked beyond "no crash or hang" (receive buffers are exactly nbytes, so ASan sees any
 * write past them): while the ring holds only correct records, rank 0 delivers exactly them,
 * in order, with their payloads, and never fails the peer; whatever the ring holds, each
 * message is completed at most once and only after it was matched, and a failed peer is
 * reported once with a reason.
 */
#include "fuzz.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/check.h"

#include "../../backends/shm/shm_layout.h"

extern const xccl_transport_ops_t xccl_transport_shm;
#define TP (&xccl_transport_shm)

#define MAXQ 4096

typedef struct msg {
    xccl_msg_hdr_t hdr;
    uint8_t       *buf;
    int            matched, done, dropped;
} msg_t;

static struct core {
    msg_t  msgs[MAXQ];
    int    nmsgs;
    int    deferred[256]; /* tags held back once already */
    int    failed;
    int    bad;           /* a callback contract was broken */
    char   why[512];
} C;

static uint8_t byte_at(uint64_t tag, uint64_t i) { return (uint8_t)(tag * 131 + i * 7 + (i >> 8)); }

static xccl_status_t f_match(void *core, int peer, const xccl_msg_hdr_t *hdr, xccl_tp_buf_t *dst,
                             void **cookie)
{
    msg_t *m;

    if (core != &C || peer != 1) C.bad = 1;
    if (hdr->nbytes > (1u << 20)) return XCCL_ERR_MISMATCH;
    if (C.nmsgs == MAXQ) return XCCL_ERR_MISMATCH; /* a core out of room refuses too */
    if ((hdr->tag & 1) && !C.deferred[hdr->tag & 255]) {
        C.deferred[hdr->tag & 255] = 1;
        return XCCL_INPROGRESS;
    }
    m          = &C.msgs[C.nmsgs++];
    m->hdr     = *hdr;
    m->matched = 1;
    m->dropped = (hdr->tag & 2) != 0;
    if (!m->dropped && hdr->nbytes > 0) {
        m->buf = malloc((size_t)hdr->nbytes); /* exactly: ASan catches writes past it */
        FUZZ_CHECK(m->buf != NULL, "out of memory");
    }
    dst->ptr = m->buf;
    dst->mem = XCCL_MEM_HOST;
    dst->mr  = NULL;
    *cookie  = m;
    return XCCL_OK;
}

static void f_done(void *core, void *cookie, xccl_status_t st)
{
    msg_t *m = cookie;

    (void)st;
    if (core != &C || m == NULL || !m->matched || m->done) C.bad = 1;
    if (m != NULL) m->done = st == XCCL_OK ? 1 : -1;
}

static void f_send_done(void *core, void *cookie, xccl_status_t st)
{
    (void)core;
    (void)cookie;
    (void)st;
    C.bad = 1; /* rank 0 sends nothing */
}

static void f_failed(void *core, int peer, xccl_status_t st, const char *why)
{
    if (core != &C || peer != 1 || st >= 0 || why == NULL || why[0] == '\0' || C.failed) C.bad = 1;
    C.failed = 1;
    snprintf(C.why, sizeof(C.why), "%s", why ? why : "");
}

static const xccl_tp_upcalls_t UP = {&C, f_match, f_done, f_send_done, f_failed};

/* Rank 1's side: the ring it writes, and what it wrote. */
typedef struct prod {
    xccl_tp_ctx_t  *ctx;
    shm_ring_ctl_t *ctl;
    char           *data;
    uint64_t        cap, head;
    int             raw;       /* the ring holds something a correct producer never writes */
    int             closed;
    xccl_msg_hdr_t  want[MAXQ];
    int             nwant;
    uint8_t        *cma_bufs[MAXQ];
    int             ncma;
} prod_t;

static int run(prod_t *P, int passes)
{
    int total = 0;

    for (int i = 0; i < passes; i++) {
        int nev = 0;
        TP->progress(P->ctx, &nev);
        total += nev;
    }
    return total;
}

static void put(prod_t *P, const void *src, uint64_t n)
{
    uint64_t at = P->head & (P->cap - 1), first = n < P->cap - at ? n : P->cap - at;

    memcpy(P->data + at, src, (size_t)first);
    if (n > first) memcpy(P->data, (const char *)src + first, (size_t)(n - first));
}

static void publish(prod_t *P, uint64_t n)
{
    P->head += n;
    atomic_store_explicit(&P->ctl->head, P->head, memory_order_release);
}

/* Waits (progressing rank 0) for n bytes of room; 0 if rank 0 does not free them. */
static int room(prod_t *P, uint64_t n)
{
    for (int tries = 0; tries < 64; tries++) {
        uint64_t tail = atomic_load(&P->ctl->tail);
        if (P->head - tail + n <= P->cap) return 1;
        if (C.failed) return 0;
        run(P, 1);
    }
    return 0;
}

static void correct_record(prod_t *P, uint32_t kind, uint64_t tag, uint64_t n)
{
    shm_slot_t s;
    uint64_t   pad = (n + SHM_SLOT - 1) & ~(uint64_t)(SHM_SLOT - 1), done = 0;

    if (P->raw || P->closed || C.failed || P->nwant == MAXQ || !room(P, SHM_SLOT)) return;
    if (kind == SHM_REC_CMA && atomic_load(&P->ctl->cma) != SHM_CMA_ON) return; /* not allowed */
    memset(&s, 0, sizeof(s));
    s.kind       = kind;
    s.hdr.tag    = tag;
    s.hdr.nbytes = n;
    s.hdr.comm_id = 7;
    if (kind == SHM_REC_INLINE)
        for (uint64_t i = 0; i < n; i++) s.u.data[i] = byte_at(tag, i);
    if (kind == SHM_REC_CMA) {
        uint8_t *b = malloc(n ? n : 1);
        FUZZ_CHECK(b != NULL, "out of memory");
        for (uint64_t i = 0; i < n; i++) b[i] = byte_at(tag, i);
        P->cma_bufs[P->ncma++] = b;
        s.u.addr               = (uint64_t)(uintptr_t)b;
    }
    P->want[P->nwant++] = s.hdr;
    put(P, &s, sizeof(s));
    publish(P, sizeof(s));
    if (kind != SHM_REC_STREAM) return;
    while (done < pad) { /* the payload in pieces, as room frees up */
        uint8_t  chunk[4096];
        uint64_t k = pad - done < sizeof(chunk) ? pad - done : sizeof(chunk);
        uint64_t tail = atomic_load(&P->ctl->tail);
        uint64_t free_bytes = P->cap - (P->head - tail);
        if (free_bytes < k) k = free_bytes;
        if (k == 0) {
            if (run(P, 1) == 0 && atomic_load(&P->ctl->tail) == tail) {
                if (C.failed) return;
                usleep(10); /* the consumer holds the message back: it asks again */
            }
            continue;
        }
        for (uint64_t i = 0; i < k; i++) chunk[i] = done + i < n ? byte_at(tag, done + i) : 0;
        put(P, chunk, k);
        publish(P, k);
        done += k;
    }
}

static shm_seg_hdr_t *make_segment(const char *name, uint64_t job, uint64_t *bytes, int *fd)
{
    uint64_t       hdr = xccl_shm_hdr_bytes(2), ring = SHM_RING_MIN / 2;
    shm_seg_hdr_t *h;
    struct flock   fl;

    *bytes = hdr + SHM_CTL_BYTES + ring;
    *fd    = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    FUZZ_CHECK(*fd >= 0 && ftruncate(*fd, (off_t)*bytes) == 0, "segment %s: %s", name,
               strerror(errno));
    memset(&fl, 0, sizeof(fl));
    fl.l_type   = F_WRLCK;
    fl.l_whence = SEEK_SET;
    (void)fcntl(*fd, F_OFD_SETLK, &fl); /* alive, for other processes' orphan sweeps */
    h = mmap(NULL, (size_t)*bytes, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
    FUZZ_CHECK(h != MAP_FAILED, "mmap: %s", strerror(errno));
    h->magic      = SHM_SEG_MAGIC;
    h->version    = SHM_VERSION;
    h->rank       = 1;
    h->size       = 2;
    h->pid        = (int32_t)getpid();
    h->job_id     = job;
    h->seg_bytes  = *bytes;
    h->ring_bytes = ring;
    h->nrings     = 1;
    h->ring_of[0] = 0;
    h->ring_of[1] = -1;
    return h;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    setenv("XCCL_SHM_RING_KB", "64", 1); /* the smallest ring: records wrap and split */
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static uint64_t       seq;
    fuzz_in_t             in = {data, size};
    xccl_peer_info_t      infos[2];
    xccl_tp_init_params_t p;
    uint8_t               blob0[XCCL_TP_ADDR_MAX];
    size_t                len0 = sizeof(blob0);
    shm_addr_t            a0, a1;
    shm_seg_hdr_t        *h1, *h0;
    uint64_t              bytes1, job, start;
    int                   fd0, fd1;
    const void           *addrs[2];
    size_t                lens[2];
    uint8_t               use[2] = {0, 1};
    prod_t                P;
    char                  name1[SHM_NAME_MAX];
    xccl_status_t         st;

    if (size > 1u << 14) return 0;
    memset(&C, 0, sizeof(C));
    memset(&P, 0, sizeof(P));
    job = ((uint64_t)getpid() << 32) ^ ++seq ^ 0x5a5a000000000000ull;

    memset(infos, 0, sizeof(infos));
    for (int r = 0; r < 2; r++) {
        infos[r].host_id  = 0xf00d;
        infos[r].ipc_ns   = 0xbeef;
        infos[r].cuda_dev = -1;
    }
    memset(&p, 0, sizeof(p));
    p.rank   = 0;
    p.size   = 2;
    p.job_id = job;
    p.peers  = infos;
    p.up     = &UP;
    st       = TP->init(&p, &P.ctx);
    FUZZ_CHECK(st == XCCL_OK, "shm init: %s", xccl_last_error());
    FUZZ_CHECK(TP->get_addr(P.ctx, blob0, &len0) == XCCL_OK &&
                   xccl_shm_addr_decode(blob0, len0, &a0) == 0,
               "rank 0's address");

    /* rank 0's segment, as rank 1 maps it, and the ring rank 1 writes */
    fd0 = shm_open(a0.name, O_RDWR | O_CLOEXEC, 0);
    FUZZ_CHECK(fd0 >= 0, "open %s: %s", a0.name, strerror(errno));
    h0 = mmap(NULL, (size_t)a0.seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd0, 0);
    FUZZ_CHECK(h0 != MAP_FAILED, "mmap rank 0");
    close(fd0);
    {
        uint64_t hdr = xccl_shm_hdr_bytes(2);
        char    *r   = (char *)h0 + hdr + (uint64_t)h0->ring_of[1] * (SHM_CTL_BYTES + h0->ring_bytes);
        P.ctl  = (shm_ring_ctl_t *)r;
        P.data = r + SHM_CTL_BYTES;
        P.cap  = h0->ring_bytes;
    }
    start  = fuzz_take(&in, 2) * 64 % P.cap + (P.cap - 4096); /* wraps within the first 4 KiB */
    P.head = start;
    atomic_store(&P.ctl->tail, start);
    atomic_store(&P.ctl->head, start);
    atomic_store(&P.ctl->poke, 0);
    atomic_store(&P.ctl->attached, 1);

    /* rank 1's own segment and address */
    snprintf(name1, sizeof(name1), "/xccl-%016llx-1-%d", (unsigned long long)job, (int)getpid());
    h1 = make_segment(name1, job, &bytes1, &fd1);
    h1->pid_ns      = h0->pid_ns; /* one process: the same pid namespace */
    h1->probe_addr  = (uint64_t)(uintptr_t)&P.head;
    h1->probe_value = P.head;
    memset(&a1, 0, sizeof(a1));
    memcpy(a1.magic, SHM_ADDR_MAGIC, 4);
    a1.version   = SHM_VERSION;
    a1.job_id    = job;
    a1.rank      = 1;
    a1.pid       = (int32_t)getpid();
    a1.seg_bytes = bytes1;
    a1.pid_ns    = h1->pid_ns;
    snprintf(a1.name, sizeof(a1.name), "%s", name1);
    addrs[0] = blob0;
    lens[0]  = len0;
    addrs[1] = &a1;
    lens[1]  = sizeof(a1);
    st       = TP->wireup(P.ctx, addrs, lens, use, 10000);
    FUZZ_CHECK(st == XCCL_OK, "shm wireup: %s", xccl_last_error());

    while (in.n > 0) {
        unsigned op = (unsigned)fuzz_take(&in, 1) % 8;
        switch (op) {
        case 0: {
            uint64_t tag = fuzz_take(&in, 1);
            correct_record(&P, SHM_REC_INLINE, tag, fuzz_take(&in, 1) % (SHM_INLINE_MAX + 1));
            break;
        }
        case 1: {
            uint64_t tag = fuzz_take(&in, 1), n = fuzz_take(&in, 2);
            correct_record(&P, SHM_REC_STREAM, tag, n * (1 + fuzz_take(&in, 1) % 4));
            break;
        }
        case 2: {
            uint64_t tag = fuzz_take(&in, 1);
            correct_record(&P, SHM_REC_CMA, tag, fuzz_take(&in, 2));
            break;
        }
        case 3: {
            uint8_t s[SHM_SLOT] = {0};
            size_t  k           = in.n < sizeof(s) ? in.n : sizeof(s);
            memcpy(s, in.p, k);
            in.p += k;
            in.n -= k;
            put(&P, s, sizeof(s));
            publish(&P, sizeof(s));
            P.raw = 1;
            break;
        }
        case 4: {
            size_t n = (size_t)fuzz_take(&in, 1);
            if (n > in.n) n = in.n;
            put(&P, in.p, n);
            in.p += n;
            in.n -= n;
            publish(&P, n);
            P.raw = 1;
            break;
        }
        case 5:
            P.head = atomic_load(&P.ctl->tail) + (uint64_t)(int64_t)(int16_t)fuzz_take(&in, 2);
            atomic_store(&P.ctl->head, P.head);
            P.raw = 1;
            break;
        case 6: run(&P, (int)(fuzz_take(&in, 1) % 8) + 1); break;
        case 7: {
            uint32_t how  = (uint32_t)(fuzz_take(&in, 1) % 3);
            int      fill = (int)fuzz_take(&in, 1);
            memset(P.ctl->why, fill ? fill : 'x', sizeof(P.ctl->why)); /* no NUL */
            atomic_store(&P.ctl->closed, how);
            P.closed |= how != SHM_OPEN;
            break;
        }
        }
    }
    /* drain: until rank 0 has nothing left to do */
    for (int quiet = 0, i = 0; quiet < 3 && i < 10000; i++) {
        quiet = run(&P, 1) == 0 ? quiet + 1 : 0;
        if (quiet && C.nmsgs < P.nwant && !C.failed && !P.raw && !P.closed) quiet = 0;
    }

    if (getenv("FUZZ_VERBOSE"))
        fprintf(stderr, "shm_ring: %d correct records, %d matched, raw %d, closed %d, failed %d%s%s\n",
                P.nwant, C.nmsgs, P.raw, P.closed, C.failed, C.failed ? ": " : "", C.why);
    FUZZ_CHECK(!C.bad, "the transport broke a callback contract (match %d)", C.nmsgs);
    for (int i = 0; i < C.nmsgs; i++)
        FUZZ_CHECK(C.msgs[i].done != 0 || C.failed || P.raw || P.closed,
                   "message %d matched but never completed", i);
    if (!P.raw && !P.closed) {
        FUZZ_CHECK(!C.failed, "the peer failed on correct records: %s", C.why);
        FUZZ_CHECK(C.nmsgs == P.nwant, "%d of %d correct records delivered", C.nmsgs, P.nwant);
        for (int i = 0; i < C.nmsgs; i++) {
            msg_t *m = &C.msgs[i];
            FUZZ_CHECK(m->hdr.tag == P.want[i].tag && m->hdr.nbytes == P.want[i].nbytes &&
                           m->hdr.comm_id == 7,
                       "message %d: tag %llu, %llu bytes; want tag %llu, %llu bytes", i,
                       (unsigned long long)m->hdr.tag, (unsigned long long)m->hdr.nbytes,
                       (unsigned long long)P.want[i].tag, (unsigned long long)P.want[i].nbytes);
            FUZZ_CHECK(m->done == 1, "message %d not completed OK", i);
            for (uint64_t j = 0; m->buf != NULL && j < m->hdr.nbytes; j++)
                FUZZ_CHECK(m->buf[j] == byte_at(m->hdr.tag, j),
                           "message %d (tag %llu): byte %llu is %u, sent %u", i,
                           (unsigned long long)m->hdr.tag, (unsigned long long)j, m->buf[j],
                           byte_at(m->hdr.tag, j));
        }
    }
    if (C.failed) FUZZ_CHECK(memchr(C.why, '\0', sizeof(C.why)) != NULL, "unterminated reason");

    TP->finalize(P.ctx);
    munmap(h0, (size_t)a0.seg_bytes);
    munmap(h1, (size_t)bytes1);
    close(fd1);
    shm_unlink(name1);
    shm_unlink(a0.name); /* normally gone already */
    for (int i = 0; i < C.nmsgs; i++) free(C.msgs[i].buf);
    for (int i = 0; i < P.ncma; i++) free(P.cma_bufs[i]);
    return 0;
}
