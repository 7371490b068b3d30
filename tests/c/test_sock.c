/* SPDX-License-Identifier: Apache-2.0
 *
 * test_sock.c - the socket helpers of csrc/core/sock.h: interface selection, resolution,
 * listen/connect/accept with deadlines and retries, and full reads/writes on blocking and
 * non-blocking sockets, including timeouts, EOF and resets. Loopback only.
 */
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/check.h"
#include "core/sock.h"
#include "ctest.h"

static int is_loopback(const xccl_sockaddr_t *a)
{
    if (a->ss.ss_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)&a->ss)->sin_addr.s_addr) >> 24) == 127;
    if (a->ss.ss_family == AF_INET6)
        return IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)&a->ss)->sin6_addr);
    return 0;
}

/* Independent check: is `a` an address of some interface that is up? */
static int is_local_up_addr(const xccl_sockaddr_t *a)
{
    struct ifaddrs *ifs, *ifa;
    int             found = 0;

    if (getifaddrs(&ifs) != 0) return 0;
    for (ifa = ifs; ifa != NULL && !found; ifa = ifa->ifa_next) {
        if (ifa->ifa_addr == NULL || !(ifa->ifa_flags & IFF_UP)) continue;
        if (ifa->ifa_addr->sa_family != a->ss.ss_family) continue;
        if (a->ss.ss_family == AF_INET)
            found = memcmp(&((struct sockaddr_in *)ifa->ifa_addr)->sin_addr,
                           &((const struct sockaddr_in *)&a->ss)->sin_addr, 4) == 0;
        else
            found = memcmp(&((struct sockaddr_in6 *)ifa->ifa_addr)->sin6_addr,
                           &((const struct sockaddr_in6 *)&a->ss)->sin6_addr, 16) == 0;
    }
    freeifaddrs(ifs);
    return found;
}

static int has_non_loopback_ipv4(void)
{
    struct ifaddrs *ifs, *ifa;
    int             found = 0;

    if (getifaddrs(&ifs) != 0) return 0;
    for (ifa = ifs; ifa != NULL; ifa = ifa->ifa_next)
        if (ifa->ifa_addr && ifa->ifa_addr->sa_family == AF_INET &&
            (ifa->ifa_flags & IFF_UP) && (ifa->ifa_flags & IFF_RUNNING) &&
            !(ifa->ifa_flags & IFF_LOOPBACK))
            found = 1;
    freeifaddrs(ifs);
    return found;
}

static void test_default_addr(void)
{
    xccl_sockaddr_t a;
    char            buf[64];

    unsetenv("XCCL_SOCKET_IFNAME");
    CHECK(xccl_sock_default_addr(&a) == XCCL_OK);
    CHECK_MSG(is_local_up_addr(&a), "%s", xccl_sock_str(&a, buf, sizeof(buf)));
    CHECK(xccl_sock_port(&a) == 0);
    if (has_non_loopback_ipv4()) CHECK(a.ss.ss_family == AF_INET && !is_loopback(&a));

    setenv("XCCL_SOCKET_IFNAME", "lo", 1);
    CHECK(xccl_sock_default_addr(&a) == XCCL_OK);
    CHECK_MSG(a.ss.ss_family == AF_INET && is_loopback(&a), "%s",
              xccl_sock_str(&a, buf, sizeof(buf)));

    setenv("XCCL_SOCKET_IFNAME", "=lo", 1);
    CHECK(xccl_sock_default_addr(&a) == XCCL_OK);
    CHECK(a.ss.ss_family == AF_INET && is_loopback(&a));

    setenv("XCCL_SOCKET_IFNAME", "=l", 1); /* exact match: "l" is not "lo" */
    CHECK(xccl_sock_default_addr(&a) == XCCL_ERR_INVALID_ARG);

    setenv("XCCL_SOCKET_IFNAME", "nosuchif0,nosuchif1", 1);
    CHECK(xccl_sock_default_addr(&a) == XCCL_ERR_INVALID_ARG);
    CHECK(strstr(xccl_last_error(), "nosuchif0") != NULL);

    setenv("XCCL_SOCKET_IFNAME", "nosuchif0,lo", 1);
    CHECK(xccl_sock_default_addr(&a) == XCCL_OK);
    CHECK(is_loopback(&a));

    setenv("XCCL_SOCKET_IFNAME", "^lo", 1);
    if (xccl_sock_default_addr(&a) == XCCL_OK) CHECK(!is_loopback(&a) && is_local_up_addr(&a));
    unsetenv("XCCL_SOCKET_IFNAME");
}

static void test_resolve(void)
{
    xccl_sockaddr_t a;
    char            buf[64];

    CHECK(xccl_sock_resolve("127.0.0.1", 1234, &a) == XCCL_OK);
    CHECK(strcmp(xccl_sock_str(&a, buf, sizeof(buf)), "127.0.0.1:1234") == 0);
    CHECK(xccl_sock_port(&a) == 1234);
    if (xccl_sock_resolve("[::1]", 80, &a) == XCCL_OK)
        CHECK(strcmp(xccl_sock_str(&a, buf, sizeof(buf)), "[::1]:80") == 0);
    CHECK(xccl_sock_resolve("localhost", 7, &a) == XCCL_OK);
    CHECK(is_loopback(&a) && xccl_sock_port(&a) == 7);
    CHECK(xccl_sock_resolve(NULL, 99, &a) == XCCL_OK);
    CHECK(xccl_sock_port(&a) == 99);
    CHECK(xccl_sock_resolve("", 0, &a) == XCCL_OK);
    CHECK(xccl_sock_resolve("127.0.0.1", 70000, &a) == XCCL_ERR_INVALID_ARG);
    CHECK(xccl_sock_resolve("no-such-host.invalid", 1, &a) == XCCL_ERR_INVALID_ARG);
    CHECK(strstr(xccl_last_error(), "no-such-host.invalid") != NULL);
}

/* A connected loopback pair: *c (client) and *s (server side). */
static void make_pair(int *c, int *s)
{
    xccl_sockaddr_t a;
    int             lfd;

    *c = *s = -1;
    CHECK(xccl_sock_resolve("127.0.0.1", 0, &a) == XCCL_OK);
    CHECK(xccl_sock_listen(&a, &lfd) == XCCL_OK);
    CHECK(xccl_sock_port(&a) > 0);
    CHECK(xccl_sock_connect(&a, xccl_now_ms() + 2000, c) == XCCL_OK);
    CHECK(xccl_sock_accept(lfd, xccl_now_ms() + 2000, s, NULL) == XCCL_OK);
    close(lfd);
}

typedef struct xfer {
    int    fd;
    char  *buf;
    size_t len;
    int    st;
} xfer_t;

static void *sender(void *arg)
{
    xfer_t *x = arg;
    x->st     = xccl_sock_send_all(x->fd, x->buf, x->len, xccl_now_ms() + 10000);
    return NULL;
}

static void test_transfer(int nonblock)
{
    size_t    len = (size_t)24 << 20;
    char     *src = malloc(len), *dst = malloc(len);
    xfer_t    x;
    pthread_t th;
    int       c, s;
    size_t    i;

    make_pair(&c, &s);
    for (i = 0; i < len; i++) src[i] = (char)(i * 7 + (i >> 13));
    memset(dst, 0, len);
    if (nonblock) {
        CHECK(xccl_sock_set_nonblock(c, 1) == 0);
        CHECK(xccl_sock_set_nonblock(s, 1) == 0);
        CHECK((fcntl(c, F_GETFL) & O_NONBLOCK) != 0);
    } else {
        CHECK((fcntl(c, F_GETFL) & O_NONBLOCK) == 0);
        CHECK((fcntl(s, F_GETFL) & O_NONBLOCK) == 0);
    }
    x = (xfer_t){.fd = c, .buf = src, .len = len, .st = -100};
    pthread_create(&th, NULL, sender, &x);
    CHECK(xccl_sock_recv_all(s, dst, len, xccl_now_ms() + 10000) == XCCL_OK);
    pthread_join(th, NULL);
    CHECK(x.st == XCCL_OK);
    CHECK(memcmp(src, dst, len) == 0);
    /* zero bytes is a no-op */
    CHECK(xccl_sock_send_all(c, src, 0, 0) == XCCL_OK);
    CHECK(xccl_sock_recv_all(s, dst, 0, 0) == XCCL_OK);

    /* nothing arrives: the deadline holds whatever the blocking mode */
    {
        int64_t t0 = xccl_now_ms();
        CHECK(xccl_sock_recv_all(s, dst, 10, t0 + 100) == XCCL_ERR_TIMEOUT);
        CHECK(xccl_now_ms() - t0 >= 90 && xccl_now_ms() - t0 < 2000);
        CHECK(strstr(xccl_last_error(), "timed out") != NULL);
    }
    /* the peer writes 3 bytes and closes: EOF is XCCL_ERR_REMOTE */
    CHECK(xccl_sock_send_all(c, "abc", 3, xccl_now_ms() + 1000) == XCCL_OK);
    close(c);
    CHECK(xccl_sock_recv_all(s, dst, 10, xccl_now_ms() + 1000) == XCCL_ERR_REMOTE);
    CHECK(strstr(xccl_last_error(), "closed by peer after 3 of 10") != NULL);
    close(s);
    free(src);
    free(dst);
}

/* Writing to a peer that closed without reading: EPIPE/ECONNRESET, no SIGPIPE. */
static void test_send_reset(void)
{
    size_t len = (size_t)32 << 20;
    char  *src = calloc(1, len);
    int    c, s;

    make_pair(&c, &s);
    CHECK(xccl_sock_send_all(c, src, 100, xccl_now_ms() + 1000) == XCCL_OK);
    close(s); /* unread data: the kernel answers with a reset */
    CHECK(xccl_sock_send_all(c, src, len, xccl_now_ms() + 5000) == XCCL_ERR_REMOTE);
    close(c);
    free(src);
}

static void test_connect_timeout(void)
{
    xccl_sockaddr_t a;
    int             lfd, fd = -1;
    int64_t         t0;

    /* a port that was just free: nothing listens there */
    CHECK(xccl_sock_resolve("127.0.0.1", 0, &a) == XCCL_OK);
    CHECK(xccl_sock_listen(&a, &lfd) == XCCL_OK);
    close(lfd);
    t0 = xccl_now_ms();
    CHECK(xccl_sock_connect(&a, t0 + 200, &fd) == XCCL_ERR_TIMEOUT);
    CHECK(xccl_now_ms() - t0 >= 190 && xccl_now_ms() - t0 < 3000);
    CHECK(strstr(xccl_last_error(), "127.0.0.1") != NULL);
    CHECK(fd == -1);

    /* accept with nobody connecting */
    CHECK(xccl_sock_resolve("127.0.0.1", 0, &a) == XCCL_OK);
    CHECK(xccl_sock_listen(&a, &lfd) == XCCL_OK);
    t0 = xccl_now_ms();
    CHECK(xccl_sock_accept(lfd, t0 + 100, &fd, NULL) == XCCL_ERR_TIMEOUT);
    CHECK(xccl_now_ms() - t0 >= 90);
    close(lfd);
}

/* The listener appears 150 ms after the first connect attempt: connect keeps retrying. */
static void test_connect_retry(void)
{
    xccl_sockaddr_t a, peer;
    int             lfd, fd = -1, s = -1;
    pid_t           pid;
    int             status = 0;
    char            b      = 0;

    CHECK(xccl_sock_resolve("127.0.0.1", 0, &a) == XCCL_OK);
    CHECK(xccl_sock_listen(&a, &lfd) == XCCL_OK);
    close(lfd);
    pid = fork();
    if (pid == 0) {
        xccl_sockaddr_t la = a;
        usleep(150000);
        if (xccl_sock_listen(&la, &lfd) != XCCL_OK) _exit(2);
        if (xccl_sock_accept(lfd, xccl_now_ms() + 5000, &s, &peer) != XCCL_OK) _exit(3);
        if (xccl_sock_send_all(s, "x", 1, xccl_now_ms() + 5000) != XCCL_OK) _exit(4);
        _exit(0);
    }
    CHECK(xccl_sock_connect(&a, xccl_now_ms() + 5000, &fd) == XCCL_OK);
    CHECK(xccl_sock_recv_all(fd, &b, 1, xccl_now_ms() + 5000) == XCCL_OK);
    CHECK(b == 'x');
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    close(fd);
}

int main(void)
{
    signal(SIGPIPE, SIG_DFL); /* a stray SIGPIPE would kill the test: MSG_NOSIGNAL must hold */
    test_default_addr();
    test_resolve();
    test_transfer(0);
    test_transfer(1);
    test_send_reset();
    test_connect_timeout();
    test_connect_retry();
    CTEST_MAIN_END("test_sock");
}
