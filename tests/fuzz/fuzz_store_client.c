/* SPDX-License-Identifier: Apache-2.0
 *
 * fuzz_store_client.c - the TCP store client (csrc/core/store_tcp.c) reading what a server
 * answers. Input: [u8 mode][stream...]. A fake server (a thread of this process) accepts the
 * client's connection, sends the stream as its replies, half-closes and drains the requests;
 * the client joins (with the auth handshake first when mode bit 0 is set) and then calls every
 * store operation once, each reading its reply from the stream.
 *
 * Checked beyond "no crash or hang": every operation returns within its deadline; a value or
 * compare_set result that the client returns is a run of bytes the server sent; check and
 * delete give booleans; no operation runs out of memory (a reply header announcing 1 GiB must
 * not make the client allocate it); a client with a key is never authenticated by a server
 * without it.
 */
#include "fuzz.h"

#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/store.h"

static int lfd = -1;
static int port;

typedef struct peer {
    const uint8_t *p;
    size_t         n;
} peer_t;

static void *fake_server(void *arg)
{
    peer_t       *s  = arg;
    struct linger lg = {1, 0};
    char          sink[4096];
    int           fd;

    do fd = accept(lfd, NULL, NULL);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) return NULL;
    for (size_t off = 0; off < s->n;) {
        ssize_t w = send(fd, s->p + off, s->n - off, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break; /* the client gave up on us */
        off += (size_t)w;
    }
    shutdown(fd, SHUT_WR);
    while (recv(fd, sink, sizeof(sink), 0) > 0) {
    }
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    close(fd);
    return NULL;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    struct sockaddr_in a;
    socklen_t          alen = sizeof(a);

    (void)argc;
    (void)argv;
    memset(&a, 0, sizeof(a));
    a.sin_family      = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    lfd               = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    FUZZ_CHECK(lfd >= 0 && bind(lfd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
                   listen(lfd, 16) == 0 && getsockname(lfd, (struct sockaddr *)&a, &alen) == 0,
               "fake server: %s", strerror(errno));
    port = ntohs(a.sin_port);
    return 0;
}

/* A value the client returned must be bytes the server sent. */
static void check_from_stream(const peer_t *s, const void *v, size_t n, const char *op)
{
    FUZZ_CHECK(n <= s->n, "%s: %zu bytes from a %zu-byte stream", op, n, s->n);
    FUZZ_CHECK(n == 0 || memmem(s->p, s->n, v, n) != NULL, "%s: value not from the stream", op);
}

/* Replies of a few KiB never justify running out of memory here (the replay limits the
 * address space to 768 MiB; an allocation of what a reply header announces would fail). The
 * server may report its own NO_MEMORY, which the client passes on as such. */
static xccl_status_t no_oom(xccl_status_t rc, const char *op)
{
    FUZZ_CHECK(rc != XCCL_ERR_NO_MEMORY || strstr(xccl_last_error(), "failed on the server"),
               "%s: out of memory on a short reply stream: %s", op, xccl_last_error());
    return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const char  key[] = "fuzz-key";
    fuzz_in_t          in    = {data, size};
    int                with_key;
    peer_t             s;
    pthread_t          th;
    xccl_store_t      *st = NULL;
    xccl_status_t      rc;
    const char *const  keys[2] = {"a", "b"};
    void              *v;
    size_t             vlen;
    int64_t            n;
    int                flag;

    if (lfd < 0) LLVMFuzzerInitialize(NULL, NULL);
    if (size > 1u << 16) return 0;
    with_key = (int)(fuzz_take(&in, 1) & 1);
    s.p      = in.p;
    s.n      = in.n;
    FUZZ_CHECK(pthread_create(&th, NULL, fake_server, &s) == 0, "pthread_create");
    rc = xccl_store_tcp_create("127.0.0.1", port, 0, 1, 0, 10000, with_key ? key : NULL,
                               with_key ? strlen(key) : 0, &st);
    if (rc == XCCL_OK) {
        FUZZ_CHECK(!with_key, "authenticated by a server that does not know the key");
        no_oom(xccl_store_set(st, "k", "v", 1), "set");
        rc = no_oom(xccl_store_get(st, "k", 0, &v, &vlen), "get");
        if (rc == XCCL_OK) {
            check_from_stream(&s, v, vlen, "get");
            free(v);
        }
        no_oom(xccl_store_add(st, "c", 1, &n), "add");
        no_oom(xccl_store_wait(st, keys, 2, 0), "wait");
        flag = -1;
        if (no_oom(xccl_store_check(st, keys, 2, &flag), "check") == XCCL_OK)
            FUZZ_CHECK(flag == 0 || flag == 1, "check gave %d", flag);
        rc = no_oom(xccl_store_compare_set(st, "k", "v", 1, "w", 1, &v, &vlen), "compare_set");
        if (rc == XCCL_OK) {
            check_from_stream(&s, v, vlen, "compare_set");
            free(v);
        }
        flag = -1;
        if (no_oom(xccl_store_delete_key(st, "k", &flag), "delete_key") == XCCL_OK)
            FUZZ_CHECK(flag == 0 || flag == 1, "delete_key gave %d", flag);
        no_oom(xccl_store_num_keys(st, &n), "num_keys");
        xccl_store_release(st);
    }
    pthread_join(th, NULL);
    return 0;
}
