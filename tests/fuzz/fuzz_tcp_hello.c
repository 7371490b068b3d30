/* SPDX-License-Identifier: Apache-2.0
 *
 * fuzz_tcp_hello.c - the TCP transport's connection handshake (backends/tcp/tcp_wire.c): the
 * acceptor's check of a connector's hello and the connector's check of the acceptor's ack, as
 * tcp.c runs them on the 32 and 24 bytes read from the socket. Input: [u8 rank][u8 size]
 * [u64 job id][u8 has key][u64 busy bitmap][u64 use bitmap][hello 32][ack 24].
 *
 * Oracle: the acceptance rules of tcp_wire.h's header restated here: a hello is adopted only
 * with the right byte order, version and job, addressed to us, from a rank above ours that is
 * expected and not connected yet, in the same auth mode; an ack is accepted only with the
 * magic, status OK, our version and job, from the rank we dialled; a refusal always carries a
 * reason.
 */
#include "fuzz.h"

#include "../../backends/tcp/tcp_wire.h"

static uint64_t busy_bits;
static int      busy_asked_bad;
static int      busy_size;

static int busy(void *arg, int src)
{
    (void)arg;
    if (src < 0 || src >= busy_size) busy_asked_bad = 1;
    return src >= 0 && src < 64 && (busy_bits >> src & 1);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_in_t   in = {data, size};
    int         rank, nranks, has_key, peer;
    uint64_t    job, use_bits;
    uint8_t     use[64];
    tcp_hello_t h;
    tcp_ack_t   a;
    unsigned    got;
    int         want_ok, rc;
    char        why[160];

    nranks   = 1 + (int)(fuzz_take(&in, 1) % 64);
    rank     = (int)(fuzz_take(&in, 1) % (uint64_t)nranks);
    job      = fuzz_take(&in, 8);
    has_key  = (int)(fuzz_take(&in, 1) & 1);
    busy_bits = fuzz_take(&in, 8);
    use_bits = fuzz_take(&in, 8);
    for (int i = 0; i < nranks; i++) use[i] = (uint8_t)(use_bits >> i & 1);
    memset(&h, 0, sizeof(h));
    memset(&a, 0, sizeof(a));
    memcpy(&h, in.p, in.n < sizeof(h) ? in.n : sizeof(h));
    in.p += in.n < sizeof(h) ? in.n : sizeof(h);
    in.n -= in.n < sizeof(h) ? in.n : sizeof(h);
    memcpy(&a, in.p, in.n < sizeof(a) ? in.n : sizeof(a));

    busy_size      = nranks;
    busy_asked_bad = 0;
    got = xccl_tcp_hello_check(&h, rank, nranks, job, use, has_key, busy, NULL);
    FUZZ_CHECK(!busy_asked_bad, "asked whether rank %d (of %d) is busy", h.src_rank, nranks);
    want_ok = h.endian == TCP_ENDIAN_MARK && h.version == TCP_PROTO_VERSION && h.job_id == job &&
              h.dst_rank == rank && h.src_rank > rank && h.src_rank < nranks && use[h.src_rank] &&
              !(busy_bits >> h.src_rank & 1) && !!(h.flags & TCP_HELLO_AUTH) == has_key;
    FUZZ_CHECK((got == TCP_ACK_OK) == want_ok, "hello from %d to %d (we are %d of %d): %u, want %s",
               h.src_rank, h.dst_rank, rank, nranks, got, want_ok ? "OK" : "a refusal");
    FUZZ_CHECK(got <= TCP_ACK_AUTH_MODE, "refusal code %u has no meaning", got);
    FUZZ_CHECK(strcmp(xccl_tcp_ack_reason(got), "unknown reason") != 0, "code %u unnamed", got);

    peer = (int)(use_bits % (uint64_t)nranks);
    why[0] = '\0';
    rc = xccl_tcp_ack_check(&a, job, peer, why, sizeof(why));
    want_ok = memcmp(a.magic, TCP_MAGIC, 4) == 0 && a.status == TCP_ACK_OK &&
              a.version == TCP_PROTO_VERSION && a.job_id == job && a.rank == peer;
    FUZZ_CHECK((rc == 0) == want_ok, "ack from rank %d (dialled %d): %d", a.rank, peer, rc);
    FUZZ_CHECK(rc != -1 || memcmp(a.magic, TCP_MAGIC, 4) != 0, "a TCP ack called foreign");
    FUZZ_CHECK(rc != 1 || (why[0] != '\0' && memchr(why, '\0', sizeof(why)) != NULL),
               "a refusal without a reason");
    return 0;
}
