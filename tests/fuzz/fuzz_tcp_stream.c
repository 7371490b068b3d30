/* SPDX-License-Identifier: Apache-2.0
 *
 * fuzz_tcp_stream.c - the TCP transport's receive path (backends/tcp/tcp.c, tcp_recv: message
 * headers and payloads parsed from the byte stream of a connected peer). Rank 0 is the real
 * transport with a small fake core; this harness is rank 1: it connects with a correct hello,
 * is accepted by wire-up, then sends the input as its message stream ([xccl_msg_hdr_t][payload]
 * ..., host byte order), lets rank 0 progress, and finally resets the connection.
 * Tags with bit 0 set ask the fake core to hold the message back once (XCCL_INPROGRESS), bit 1
 * to drop its payload; headers over 1 MiB are refused, as the core refuses unexpected sizes.
 *
 * Oracle: the stream parsed here into messages. Every header rank 0 offers is the next one of
 * the stream, every payload it completes is that message's bytes of the stream (receive
 * buffers are exactly nbytes: ASan sees any write past them); all complete messages before the
 * first refused one are delivered before the connection ends; each message completes once; the
 * reset fails the peer exactly once, with a reason.
 */
#include "fuzz.h"

#include <errno.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/check.h"
#include "core/sock.h"
#include "xccl/xccl_transport.h"

#include "../../backends/tcp/tcp_wire.h"

extern const xccl_transport_ops_t xccl_transport_tcp;
#define TP      (&xccl_transport_tcp)
#define MAXQ    4096
#define MAX_MSG (1u << 20)

typedef struct msg {
    xccl_msg_hdr_t hdr;
    uint8_t       *buf;
    int            done, dropped;
} msg_t;

static struct core {
    msg_t   msgs[MAXQ];
    int     nmsgs;
    uint8_t deferred[MAXQ]; /* message index held back once already */
    int     failed, bad;
    char    why[512];
} C;

static xccl_status_t f_match(void *core, int peer, const xccl_msg_hdr_t *hdr, xccl_tp_buf_t *dst,
                             void **cookie)
{
    msg_t *m;

    if (core != &C || peer != 1) C.bad = 1;
    if (hdr->nbytes > MAX_MSG) return XCCL_ERR_MISMATCH;
    FUZZ_CHECK(C.nmsgs < MAXQ, "too many messages"); /* 32 KiB of input hold at most 1024 */
    if ((hdr->tag & 1) && !C.deferred[C.nmsgs]) {
        C.deferred[C.nmsgs] = 1;
        return XCCL_INPROGRESS;
    }
    m          = &C.msgs[C.nmsgs++];
    m->hdr     = *hdr;
    m->dropped = (hdr->tag & 2) != 0;
    if (!m->dropped && hdr->nbytes > 0) {
        m->buf = malloc((size_t)hdr->nbytes);
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

    if (core != &C || m == NULL || m->done) C.bad = 1;
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

static int run(xccl_tp_ctx_t *ctx, int passes)
{
    int total = 0;

    for (int i = 0; i < passes; i++) {
        int nev = 0;
        TP->progress(ctx, &nev);
        total += nev;
    }
    return total;
}

/* Progresses until three passes in a row do nothing. */
static void drain(xccl_tp_ctx_t *ctx)
{
    for (int quiet = 0, i = 0; quiet < 3 && i < 100000; i++) quiet = run(ctx, 1) ? 0 : quiet + 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static uint64_t       seq;
    xccl_peer_info_t      infos[2];
    xccl_tp_init_params_t p;
    xccl_tp_ctx_t        *ctx = NULL;
    uint8_t               blob0[XCCL_TP_ADDR_MAX], blob1[TCP_ADDR_LEN];
    size_t                len0 = sizeof(blob0);
    const void           *addrs[2];
    size_t                lens[2];
    uint8_t               use[2] = {0, 1};
    xccl_sockaddr_t       a0, a1;
    tcp_hello_t           h;
    tcp_ack_t             ack;
    struct linger         lg = {1, 0};
    int                   fd = -1, nwhole = 0, limit;
    size_t                off, ends[MAXQ];
    xccl_msg_hdr_t        hdrs[MAXQ];
    uint64_t              job;
    xccl_status_t         st;

    if (size > 1u << 15) return 0;
    memset(&C, 0, sizeof(C));
    job = ((uint64_t)getpid() << 32) ^ ++seq ^ 0x7cb0000000000000ull;
    memset(infos, 0, sizeof(infos));
    for (int r = 0; r < 2; r++) infos[r].cuda_dev = -1;
    infos[1].host_id = 1; /* another host: tcp is the transport */
    memset(&p, 0, sizeof(p));
    p.rank   = 0;
    p.size   = 2;
    p.job_id = job;
    p.peers  = infos;
    p.up     = &UP;
    st       = TP->init(&p, &ctx);
    FUZZ_CHECK(st == XCCL_OK, "tcp init: %s", xccl_last_error());
    FUZZ_CHECK(TP->get_addr(ctx, blob0, &len0) == XCCL_OK &&
                   xccl_tcp_addr_decode(blob0, len0, &a0) == 0,
               "rank 0's address");

    /* rank 1: connect and queue a correct hello before rank 0's wire-up accepts it */
    st = xccl_sock_connect(&a0, xccl_now_ms() + 5000, &fd);
    FUZZ_CHECK(st == XCCL_OK, "connect: %s", xccl_last_error());
    memset(&h, 0, sizeof(h));
    memcpy(h.magic, TCP_MAGIC, 4);
    h.version  = TCP_PROTO_VERSION;
    h.endian   = TCP_ENDIAN_MARK;
    h.job_id   = job;
    h.src_rank = 1;
    h.dst_rank = 0;
    FUZZ_CHECK(send(fd, &h, sizeof(h), MSG_NOSIGNAL) == sizeof(h), "hello");
    a1 = a0; /* rank 0 never dials rank 1; any valid blob will do */
    xccl_tcp_addr_encode(&a1, blob1);
    addrs[0] = blob0;
    lens[0]  = len0;
    addrs[1] = blob1;
    lens[1]  = sizeof(blob1);
    st       = TP->wireup(ctx, addrs, lens, use, 10000);
    FUZZ_CHECK(st == XCCL_OK, "tcp wireup: %s", xccl_last_error());
    FUZZ_CHECK(xccl_sock_recv_all(fd, &ack, sizeof(ack), xccl_now_ms() + 5000) == XCCL_OK &&
                   memcmp(ack.magic, TCP_MAGIC, 4) == 0 && ack.status == TCP_ACK_OK,
               "rank 0 did not accept a correct hello");

    /* the stream as messages: complete ones, up to the first that rank 0 refuses */
    for (off = 0; nwhole < MAXQ && size - off >= sizeof(xccl_msg_hdr_t);) {
        xccl_msg_hdr_t m;
        memcpy(&m, data + off, sizeof(m));
        if (m.nbytes > MAX_MSG || m.nbytes > size - off - sizeof(m)) break;
        hdrs[nwhole]   = m;
        ends[nwhole++] = off + sizeof(m) + (size_t)m.nbytes;
        off += sizeof(m) + (size_t)m.nbytes;
    }
    for (off = 0; off < size;) {
        ssize_t w = send(fd, data + off, size - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) off += (size_t)w;
        else if (w < 0 && (errno == EAGAIN || errno == EINTR)) run(ctx, 1);
        else break; /* rank 0 closed on a refused message */
    }
    drain(ctx);
    limit = C.nmsgs;
    if (!C.failed)
        FUZZ_CHECK(C.nmsgs >= nwhole, "%d of %d complete messages delivered", C.nmsgs, nwhole);
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    close(fd); /* a reset: rank 0 must fail the peer */
    for (int i = 0; i < 2000 && !C.failed; i++) {
        drain(ctx);
        if (!C.failed) usleep(1000);
    }
    if (getenv("FUZZ_VERBOSE"))
        fprintf(stderr, "tcp_stream: %d complete messages in the stream, %d offered, failed: %s\n",
                nwhole, C.nmsgs, C.why);
    FUZZ_CHECK(C.failed, "the connection was reset and rank 0 did not fail the peer");
    FUZZ_CHECK(!C.bad, "the transport broke a callback contract");
    FUZZ_CHECK(C.nmsgs == limit, "messages offered after the connection was reset");
    for (int i = 0; i < C.nmsgs; i++) {
        msg_t *m = &C.msgs[i];
        if (i >= nwhole) {
            /* the last, cut-off message: it cannot have completed */
            FUZZ_CHECK(m->done != 1, "message %d completed past the end of the stream", i);
            continue;
        }
        FUZZ_CHECK(memcmp(&m->hdr, &hdrs[i], sizeof(m->hdr)) == 0,
                   "message %d: header differs from the stream's", i);
        if (m->done == 1 && m->buf != NULL)
            FUZZ_CHECK(memcmp(m->buf, data + ends[i] - m->hdr.nbytes, (size_t)m->hdr.nbytes) == 0,
                       "message %d: payload differs from the stream's", i);
        FUZZ_CHECK(m->done == 1, "message %d was complete in the stream but not delivered", i);
    }
    TP->finalize(ctx);
    for (int i = 0; i < C.nmsgs; i++) free(C.msgs[i].buf);
    return 0;
}
