/* SPDX-License-Identifier: Apache-2.0
 *
 * fuzz_store_server.c - the TCP store server (csrc/core/store_tcp.c) reading what a client
 * sends. Input: [u8 mode][stream...]. Each input starts a fresh server (so that every input
 * replays alone), connects one raw socket to it, sends the stream, half-closes, and reads
 * everything the server answers until it closes. mode bit 0: the server has an auth key, so
 * the stream first meets the authentication state machine.
 *
 * Checked beyond "no crash or hang": the server always closes (never waits on a half-closed
 * peer); without a key, the replies are well-formed and each has the shape its request's
 * command calls for (the requests are parsed here with this file's own reader of the wire
 * layout in store_tcp.c's header), and there are no more replies than complete requests; with
 * a key, a client that cannot know it gets the server's hello, its proof and a "no" verdict,
 * and no store reply at all.
 */
#include "fuzz.h"

#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/auth.h"
#include "core/store.h"

#define MAGIC   0x58435331u /* "XCS1" */
#define HDR_LEN 9
#define MAX_REQ 4096

static uint32_t be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Fields of one message body: count them, -1 if they do not tile it exactly. */
static int count_fields(const uint8_t *p, size_t n, size_t *first_len)
{
    int k = 0;

    while (n > 0) {
        uint32_t l;
        if (n < 4) return -1;
        l = be32(p);
        if (n - 4 < l) return -1;
        if (k == 0 && first_len) *first_len = l;
        p += 4 + (size_t)l;
        n -= 4 + (size_t)l;
        k++;
    }
    return k;
}

/* The commands of the complete requests at the front of the stream (stops at the first that
 * is cut off); returns how many. */
static int parse_requests(const uint8_t *p, size_t n, uint8_t *cmds, int max)
{
    int k = 0;

    while (k < max && n >= HDR_LEN) {
        uint32_t len = be32(p + 4);
        if (be32(p) != MAGIC || len < HDR_LEN || len > n) break;
        cmds[k++] = p[8];
        p += len;
        n -= len;
    }
    return k;
}

/* Reads from fd until EOF; fails the input if the server neither closes nor answers. */
static size_t read_all(int fd, uint8_t **out)
{
    size_t   len = 0, cap = 4096;
    uint8_t *buf = malloc(cap);

    FUZZ_CHECK(buf != NULL, "out of memory");
    for (;;) {
        struct pollfd pfd = {fd, POLLIN, 0};
        ssize_t       r;
        int           pr = poll(&pfd, 1, 20000);
        FUZZ_CHECK(pr > 0, "the server kept a half-closed connection open for 20 s");
        if (len == cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            FUZZ_CHECK(buf != NULL, "out of memory");
        }
        r = recv(fd, buf + len, cap - len, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break; /* EOF or reset */
        len += (size_t)r;
    }
    *out = buf;
    return len;
}

static void check_replies(const uint8_t *rep, size_t rlen, const uint8_t *cmds, int ncmds)
{
    int k = 0;

    while (rlen > 0) {
        uint32_t len;
        int8_t   st;
        int      nf;
        size_t   f0 = 0;

        FUZZ_CHECK(rlen >= HDR_LEN, "a reply cut short (%zu bytes)", rlen);
        len = be32(rep + 4);
        FUZZ_CHECK(be32(rep) == MAGIC && len >= HDR_LEN && len <= rlen,
                   "malformed reply header (magic %08x, length %u of %zu)", be32(rep), len, rlen);
        FUZZ_CHECK(k < ncmds, "reply %d, but only %d complete requests were sent", k + 1, ncmds);
        st = (int8_t)rep[8];
        nf = count_fields(rep + HDR_LEN, len - HDR_LEN, &f0);
        FUZZ_CHECK(nf >= 0, "reply %d: fields do not tile its body", k);
        if (st == XCCL_ERR_TIMEOUT) {
            FUZZ_CHECK(cmds[k] == 3 /* GET */ || cmds[k] == 5 /* WAIT */,
                       "TIMEOUT answers command %d", cmds[k]);
            FUZZ_CHECK(cmds[k] == 5 || nf == 0, "GET's TIMEOUT carries %d fields", nf);
        } else if (st != XCCL_OK) {
            FUZZ_CHECK(st < 0 && st >= XCCL_ERR_AUTH && nf == 1,
                       "reply %d: status %d with %d fields", k, st, nf);
        } else {
            switch (cmds[k]) {
            case 1: /* JOIN */
            case 2: /* SET */
            case 5: /* WAIT */
                FUZZ_CHECK(nf == 0, "command %d: OK with %d fields", cmds[k], nf);
                break;
            case 3: /* GET */
            case 7: /* COMPARE_SET */
                FUZZ_CHECK(nf == 1, "command %d: OK with %d fields", cmds[k], nf);
                break;
            case 4: /* ADD */
            case 9: /* NUM_KEYS */
                FUZZ_CHECK(nf == 1 && f0 == 8, "command %d: OK with %d fields", cmds[k], nf);
                break;
            case 6: /* CHECK */
            case 8: /* DELETE */
                FUZZ_CHECK(nf == 1 && f0 == 1 && rep[HDR_LEN + 4] <= 1,
                           "command %d: OK without one boolean byte", cmds[k]);
                break;
            default: FUZZ_CHECK(0, "unknown command %d was answered OK", cmds[k]);
            }
        }
        rep += len;
        rlen -= len;
        k++;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const char key[] = "fuzz-key";
    fuzz_in_t          in   = {data, size};
    int                with_key;
    xccl_store_t      *store = NULL;
    struct sockaddr_in a;
    struct linger      lg = {1, 0};
    uint8_t           *rep, cmds[MAX_REQ];
    size_t             rlen;
    int                fd, ncmds;
    xccl_status_t      st;

    if (size > 1u << 16) return 0;
    with_key = (int)(fuzz_take(&in, 1) & 1);
    st       = xccl_store_tcp_create("127.0.0.1", 0, 1, 1, 0, 10000, with_key ? key : NULL,
                                     with_key ? strlen(key) : 0, &store);
    FUZZ_CHECK(st == XCCL_OK, "store server: %s", xccl_last_error());

    memset(&a, 0, sizeof(a));
    a.sin_family      = AF_INET;
    a.sin_port        = htons((uint16_t)xccl_store_tcp_port(store));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    fd                = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    FUZZ_CHECK(fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0, "connect: %s",
               strerror(errno));
    for (size_t off = 0; off < in.n;) {
        ssize_t w = send(fd, in.p + off, in.n - off, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break; /* the server closed on a malformed request: fine */
        off += (size_t)w;
    }
    shutdown(fd, SHUT_WR);
    rlen = read_all(fd, &rep);
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg)); /* no TIME_WAIT per input */
    close(fd);

    if (with_key) {
        /* hello (36), proof (32), verdict 0 - nothing of the store */
        FUZZ_CHECK(rlen <= XCCL_AUTH_HELLO_LEN + XCCL_SHA256_LEN + 1,
                   "%zu bytes to a client that does not know the key", rlen);
        if (rlen == XCCL_AUTH_HELLO_LEN + XCCL_SHA256_LEN + 1)
            FUZZ_CHECK(rep[rlen - 1] == 0, "the server accepted a proof made without the key");
    } else {
        ncmds = parse_requests(in.p, in.n, cmds, MAX_REQ);
        check_replies(rep, rlen, cmds, ncmds);
    }
    free(rep);
    xccl_store_release(store);
    return 0;
}
