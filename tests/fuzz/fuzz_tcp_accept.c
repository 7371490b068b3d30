/* SPDX-License-Identifier: Apache-2.0
 *
 * fuzz_tcp_accept.c - the TCP transport's acceptor during wire-up (backends/tcp/tcp.c:
 * tcp_accept_all, tcp_pending_read, tcp_pending_hello) reading the first bytes of a connection
 * nobody vouches for. Rank 0 is the real transport; this harness opens a connection and sends
 * the input on it (then half-closes), and opens a second connection that speaks for rank 1
 * correctly; then rank 0 wires up, expecting rank 1.
 *
 * Checked beyond "no crash or hang": wire-up succeeds whatever the first connection sent (a
 * stranger never keeps a job from wiring up); exactly one of the two connections is accepted
 * for rank 1 (the stranger only if its bytes start with a correct hello for rank 1, and the
 * correct one then answered "duplicate"); a refused connection gets an ack naming a known
 * reason, or nothing.
 */
#include "fuzz.h"

#include <errno.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/check.h"
#include "core/sock.h"
#include "xccl/xccl_transport.h"

#include "../../backends/tcp/tcp_wire.h"

extern const xccl_transport_ops_t xccl_transport_tcp;
#define TP (&xccl_transport_tcp)

static int failed;

static xccl_status_t f_match(void *core, int peer, const xccl_msg_hdr_t *hdr, xccl_tp_buf_t *dst,
                             void **cookie)
{
    (void)core;
    (void)peer;
    (void)hdr;
    (void)dst;
    (void)cookie;
    return XCCL_ERR_MISMATCH; /* nothing is sent after the hello here */
}

static void f_done(void *core, void *cookie, xccl_status_t st)
{
    (void)core;
    (void)cookie;
    (void)st;
}

static void f_failed(void *core, int peer, xccl_status_t st, const char *why)
{
    (void)core;
    (void)peer;
    (void)st;
    (void)why;
    failed = 1;
}

static const xccl_tp_upcalls_t UP = {NULL, f_match, f_done, f_done, f_failed};

/* The ack on fd if one is there within 2 s: 1 and *a, else 0. */
static int read_ack(int fd, tcp_ack_t *a)
{
    return xccl_sock_recv_all(fd, a, sizeof(*a), xccl_now_ms() + 2000) == XCCL_OK;
}

static void reset_close(int fd)
{
    struct linger lg = {1, 0};

    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    close(fd);
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
    xccl_sockaddr_t       a0;
    tcp_hello_t           h, fh;
    tcp_ack_t             ack_s, ack_g;
    int                   fs = -1, fg = -1, got_s, got_g, stranger_ok;
    uint64_t              job;
    xccl_status_t         st;

    if (size > 1u << 14) return 0;
    failed = 0;
    job    = ((uint64_t)getpid() << 32) ^ ++seq ^ 0x3ac0000000000000ull;
    memset(infos, 0, sizeof(infos));
    for (int r = 0; r < 2; r++) infos[r].cuda_dev = -1;
    infos[1].host_id = 1;
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

    /* the stranger: its bytes, with the job id of this run patched in where a hello has it
     * when the input asks for it (first byte odd), so correct hellos are reachable */
    memset(&fh, 0, sizeof(fh));
    FUZZ_CHECK(xccl_sock_connect(&a0, xccl_now_ms() + 5000, &fs) == XCCL_OK, "connect");
    if (size > 0) {
        uint8_t *b = malloc(size - 1 + 1);
        FUZZ_CHECK(b != NULL, "out of memory");
        memcpy(b, data + 1, size - 1);
        if ((data[0] & 1) && size - 1 >= offsetof(tcp_hello_t, job_id) + 8)
            memcpy(b + offsetof(tcp_hello_t, job_id), &job, 8);
        memcpy(&fh, b, size - 1 < sizeof(fh) ? size - 1 : sizeof(fh));
        for (size_t off = 0; off < size - 1;) {
            ssize_t w = send(fs, b + off, size - 1 - off, MSG_NOSIGNAL);
            if (w <= 0 && errno == EINTR) continue;
            if (w <= 0) break;
            off += (size_t)w;
        }
        free(b);
    }
    shutdown(fs, SHUT_WR);
    stranger_ok = size > 0 && size - 1 >= sizeof(fh) && memcmp(fh.magic, TCP_MAGIC, 4) == 0 &&
                  fh.endian == TCP_ENDIAN_MARK && fh.version == TCP_PROTO_VERSION &&
                  fh.job_id == job && fh.src_rank == 1 && fh.dst_rank == 0 &&
                  !(fh.flags & TCP_HELLO_AUTH);

    /* rank 1, correctly */
    FUZZ_CHECK(xccl_sock_connect(&a0, xccl_now_ms() + 5000, &fg) == XCCL_OK, "connect");
    memset(&h, 0, sizeof(h));
    memcpy(h.magic, TCP_MAGIC, 4);
    h.version  = TCP_PROTO_VERSION;
    h.endian   = TCP_ENDIAN_MARK;
    h.job_id   = job;
    h.src_rank = 1;
    h.dst_rank = 0;
    FUZZ_CHECK(send(fg, &h, sizeof(h), MSG_NOSIGNAL) == sizeof(h), "hello");

    xccl_tcp_addr_encode(&a0, blob1);
    addrs[0] = blob0;
    lens[0]  = len0;
    addrs[1] = blob1;
    lens[1]  = sizeof(blob1);
    st       = TP->wireup(ctx, addrs, lens, use, 10000);
    FUZZ_CHECK(st == XCCL_OK, "a stranger's %zu bytes kept the job from wiring up: %s", size,
               xccl_last_error());

    got_s = read_ack(fs, &ack_s);
    got_g = read_ack(fg, &ack_g);
    FUZZ_CHECK(got_g && memcmp(ack_g.magic, TCP_MAGIC, 4) == 0, "rank 1 got no ack");
    if (stranger_ok) {
        FUZZ_CHECK(got_s && ack_s.status == TCP_ACK_OK && ack_g.status == TCP_ACK_DUPLICATE,
                   "a correct first hello: acks %d/%u and %u", got_s, ack_s.status, ack_g.status);
    } else {
        FUZZ_CHECK(ack_g.status == TCP_ACK_OK, "rank 1 refused (%u) after a stranger's bytes",
                   ack_g.status);
        FUZZ_CHECK(!got_s || (ack_s.status != TCP_ACK_OK && ack_s.status <= TCP_ACK_AUTH_MODE),
                   "the stranger got ack %u", ack_s.status);
    }
    reset_close(fs);
    reset_close(fg);
    TP->finalize(ctx);
    return 0;
}
