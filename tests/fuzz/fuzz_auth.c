/* SPDX-License-Identifier: Apache-2.0
 *
 * fuzz_auth.c - the blocking authentication handshake (csrc/core/auth.c, xccl_auth_handshake,
 * which the TCP transport runs on both ends and the TCP store client runs) reading a peer that
 * does not know the key. Input: [u8 role][peer stream...]; the stream is queued on the other
 * end of a socketpair, half-closed, and the handshake runs as server (role bit 0) or client.
 *
 * Checked beyond "no crash or hang": the handshake never succeeds (a proof needs the key and
 * our fresh nonce), it returns a status within its deadline, and what it sent is its hello
 * followed at most by its proof and a verdict of 0.
 */
#include "fuzz.h"

#include <errno.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/auth.h"
#include "core/check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const char key[] = "fuzz-key";
    fuzz_in_t         in    = {data, size};
    int               sv[2], is_server;
    int64_t           t0;
    xccl_status_t     st;
    uint8_t           out[256];
    ssize_t           got;

    if (size > 1u << 15) return 0; /* fits the socket buffer: the writer never blocks */
    is_server = (int)(fuzz_take(&in, 1) & 1);
    FUZZ_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0, "socketpair: %s",
               strerror(errno));
    for (size_t off = 0; off < in.n;) {
        ssize_t w = send(sv[1], in.p + off, in.n - off, MSG_NOSIGNAL);
        FUZZ_CHECK(w > 0 || errno == EINTR, "queueing the peer stream: %s", strerror(errno));
        if (w > 0) off += (size_t)w;
    }
    shutdown(sv[1], SHUT_WR);
    t0 = xccl_now_ms();
    st = xccl_auth_handshake(sv[0], key, strlen(key), is_server, "xccl-fuzz", t0 + 5000);
    FUZZ_CHECK(st != XCCL_OK, "authenticated a peer that does not know the key");
    FUZZ_CHECK(xccl_now_ms() - t0 < 4000, "a half-closed peer held the handshake %lld ms",
               (long long)(xccl_now_ms() - t0));
    close(sv[0]);
    got = recv(sv[1], out, sizeof(out), MSG_DONTWAIT);
    FUZZ_CHECK(got <= XCCL_AUTH_HELLO_LEN + XCCL_SHA256_LEN + 1, "%zd bytes sent", got);
    if (got >= 4) FUZZ_CHECK(out[0] == 0x58 && out[1] == 0x41, "our hello lacks its magic");
    if (got == XCCL_AUTH_HELLO_LEN + XCCL_SHA256_LEN + 1)
        FUZZ_CHECK(out[got - 1] == 0, "verdict %u for a wrong proof", out[got - 1]);
    close(sv[1]);
    return 0;
}
