/* SPDX-License-Identifier: Apache-2.0
 *
 * sock.c - socket helpers (see sock.h): interface selection from $XCCL_SOCKET_IFNAME, name
 * resolution, listen/connect/accept with deadlines, and poll-based full reads and writes.
 */
#include "core/sock.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include "core/check.h"

/* One send()/recv() moves at most this much, so lengths stay far from SSIZE_MAX. */
#define SOCK_IO_CHUNK ((size_t)1 << 30)

/* Connect retry backoff: starts small (peers usually appear within milliseconds), doubles,
 * and is capped so a peer that starts late is still found quickly. */
#define SOCK_BACKOFF_FIRST_MS 1
#define SOCK_BACKOFF_MAX_MS   100

/* ---------------------------------------------------------------------------------------------
 * Interface selection
 *
 * $XCCL_SOCKET_IFNAME is a comma-separated list of interface-name prefixes ("eth,ib"); a
 * leading '^' turns the whole list into exclusions ("^docker,lo"); an entry starting with '='
 * must match the name exactly ("=eth0"). Without the variable every interface is a candidate.
 * Among candidates that are up the preference is:
 *   1. IPv4 on a non-loopback interface    3. IPv4 loopback
 *   2. IPv6 (not link-local), non-loopback 4. IPv6 loopback
 * in getifaddrs order within each class. Without the variable, non-loopback interfaces must
 * also be running (carrier), so an idle bridge with no link is not picked.
 * ------------------------------------------------------------------------------------------- */

typedef struct ifname_filter {
    const char *spec; /* the list, without a leading '^'; NULL: no filter */
    int         exclude;
} ifname_filter_t;

static int ifname_in_list(const char *list, const char *name)
{
    const char *p = list;

    while (*p != '\0') {
        const char *end = strchr(p, ',');
        size_t      n   = end ? (size_t)(end - p) : strlen(p);
        int         exact = 0;

        if (n > 0 && *p == '=') {
            exact = 1;
            p++;
            n--;
        }
        if (n > 0) {
            if (exact ? (strlen(name) == n && strncmp(name, p, n) == 0)
                      : strncmp(name, p, n) == 0)
                return 1;
        }
        if (end == NULL) break;
        p = end + 1;
    }
    return 0;
}

static int ifname_ok(const ifname_filter_t *f, const char *name)
{
    if (f->spec == NULL) return 1;
    return ifname_in_list(f->spec, name) ? !f->exclude : f->exclude;
}

/* 1..4 as in the table above, 0 if the address is not a candidate. */
static int addr_class(const struct ifaddrs *ifa, int filtered)
{
    int loop = (ifa->ifa_flags & IFF_LOOPBACK) != 0;

    if (ifa->ifa_addr == NULL || !(ifa->ifa_flags & IFF_UP)) return 0;
    if (!filtered && !loop && !(ifa->ifa_flags & IFF_RUNNING)) return 0;
    if (ifa->ifa_addr->sa_family == AF_INET) return loop ? 3 : 1;
    if (ifa->ifa_addr->sa_family == AF_INET6) {
        const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)ifa->ifa_addr;
        if (IN6_IS_ADDR_LINKLOCAL(&s6->sin6_addr)) return 0;
        return (loop || IN6_IS_ADDR_LOOPBACK(&s6->sin6_addr)) ? 4 : 2;
    }
    return 0;
}

xccl_status_t xccl_sock_default_addr(xccl_sockaddr_t *out)
{
    const char     *env = getenv("XCCL_SOCKET_IFNAME");
    ifname_filter_t f   = {NULL, 0};
    struct ifaddrs *ifs, *ifa;
    int             cls;

    if (env != NULL && *env != '\0') {
        f.exclude = env[0] == '^';
        f.spec    = env + f.exclude;
    }
    if (getifaddrs(&ifs) != 0)
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "socket: getifaddrs failed: %s", strerror(errno));
    for (cls = 1; cls <= 4; cls++) {
        for (ifa = ifs; ifa != NULL; ifa = ifa->ifa_next) {
            if (addr_class(ifa, f.spec != NULL) != cls || !ifname_ok(&f, ifa->ifa_name)) continue;
            memset(out, 0, sizeof(*out));
            out->len = ifa->ifa_addr->sa_family == AF_INET ? sizeof(struct sockaddr_in)
                                                            : sizeof(struct sockaddr_in6);
            memcpy(&out->ss, ifa->ifa_addr, out->len);
            if (out->ss.ss_family == AF_INET)
                ((struct sockaddr_in *)&out->ss)->sin_port = 0;
            else
                ((struct sockaddr_in6 *)&out->ss)->sin6_port = 0;
            {
                char buf[INET6_ADDRSTRLEN + 16];
                XCCL_INFO("socket: using interface %s address %s", ifa->ifa_name,
                          xccl_sock_str(out, buf, sizeof(buf)));
            }
            freeifaddrs(ifs);
            return XCCL_OK;
        }
    }
    {
        char   names[512];
        size_t used = 0;

        names[0] = '\0';
        for (ifa = ifs; ifa != NULL; ifa = ifa->ifa_next) {
            if (ifa->ifa_addr == NULL || strstr(names, ifa->ifa_name) != NULL) continue;
            if (used + strlen(ifa->ifa_name) + 3 >= sizeof(names)) break;
            used += (size_t)snprintf(names + used, sizeof(names) - used, "%s%s",
                                     used ? ", " : "", ifa->ifa_name);
        }
        freeifaddrs(ifs);
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG,
                          "socket: no usable interface matches XCCL_SOCKET_IFNAME=%s "
                          "(interfaces: %s)",
                          env ? env : "(unset)", names);
    }
}

xccl_status_t xccl_sock_resolve(const char *host, int port, xccl_sockaddr_t *out)
{
    struct addrinfo  hints, *res = NULL;
    char             portstr[16];
    char             name[NI_MAXHOST];
    const char      *node = NULL;
    int              rc;

    if (port < 0 || port > 65535)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "socket: port %d out of range", port);
    if (host != NULL && *host != '\0') {
        size_t n = strlen(host);
        /* "[::1]" as written in URLs */
        if (host[0] == '[' && n >= 2 && host[n - 1] == ']' && n - 2 < sizeof(name)) {
            memcpy(name, host + 1, n - 2);
            name[n - 2] = '\0';
            node        = name;
        } else {
            node = host;
        }
    }
    memset(&hints, 0, sizeof(hints));
    hints.ai_family   = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags    = AI_NUMERICSERV | (node == NULL ? AI_PASSIVE : AI_ADDRCONFIG);
    snprintf(portstr, sizeof(portstr), "%d", port);
    rc = getaddrinfo(node, portstr, &hints, &res);
    if (rc == EAI_NONAME && node != NULL) {
        /* AI_ADDRCONFIG hides loopback names on hosts with only loopback configured */
        hints.ai_flags = AI_NUMERICSERV;
        rc             = getaddrinfo(node, portstr, &hints, &res);
    }
    if (rc != 0)
        return XCCL_ERROR(XCCL_ERR_INVALID_ARG, "socket: cannot resolve '%s': %s",
                          node ? node : "(wildcard)",
                          rc == EAI_SYSTEM ? strerror(errno) : gai_strerror(rc));
    memset(out, 0, sizeof(*out));
    memcpy(&out->ss, res->ai_addr, res->ai_addrlen);
    out->len = res->ai_addrlen;
    freeaddrinfo(res);
    return XCCL_OK;
}

const char *xccl_sock_str(const xccl_sockaddr_t *a, char *buf, size_t len)
{
    char host[INET6_ADDRSTRLEN];

    if (len == 0) return buf;
    if (a->ss.ss_family == AF_INET) {
        const struct sockaddr_in *s4 = (const struct sockaddr_in *)&a->ss;
        inet_ntop(AF_INET, &s4->sin_addr, host, sizeof(host));
        snprintf(buf, len, "%s:%d", host, ntohs(s4->sin_port));
    } else if (a->ss.ss_family == AF_INET6) {
        const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)&a->ss;
        inet_ntop(AF_INET6, &s6->sin6_addr, host, sizeof(host));
        snprintf(buf, len, "[%s]:%d", host, ntohs(s6->sin6_port));
    } else {
        snprintf(buf, len, "(family %d)", (int)a->ss.ss_family);
    }
    return buf;
}

int xccl_sock_port(const xccl_sockaddr_t *a)
{
    if (a->ss.ss_family == AF_INET) return ntohs(((const struct sockaddr_in *)&a->ss)->sin_port);
    if (a->ss.ss_family == AF_INET6)
        return ntohs(((const struct sockaddr_in6 *)&a->ss)->sin6_port);
    return -1;
}

int xccl_sock_set_nonblock(int fd, int on)
{
    int fl = fcntl(fd, F_GETFL);

    if (fl < 0) return -1;
    fl = on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK);
    return fcntl(fd, F_SETFL, fl);
}

/* "1.2.3.4:5" of the remote end of fd, for messages. */
static const char *peer_str(int fd, char *buf, size_t len)
{
    xccl_sockaddr_t a;

    memset(&a, 0, sizeof(a));
    a.len = sizeof(a.ss);
    if (getpeername(fd, (struct sockaddr *)&a.ss, &a.len) != 0) {
        snprintf(buf, len, "fd %d", fd);
        return buf;
    }
    return xccl_sock_str(&a, buf, len);
}

/* Milliseconds left until the deadline for poll(): -1 without one, 0 once it has passed. */
static int poll_timeout(int64_t deadline_ms)
{
    int64_t left;

    if (deadline_ms < 0) return -1;
    left = deadline_ms - xccl_now_ms();
    if (left <= 0) return 0;
    return left > INT_MAX ? INT_MAX : (int)left;
}

static void set_nodelay(int fd)
{
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

xccl_status_t xccl_sock_listen(xccl_sockaddr_t *addr, int *fd)
{
    char buf[INET6_ADDRSTRLEN + 16];
    int  one = 1;
    int  s   = socket(addr->ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);

    if (s < 0)
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "socket: socket() for %s failed: %s",
                          xccl_sock_str(addr, buf, sizeof(buf)), strerror(errno));
    (void)setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(s, (const struct sockaddr *)&addr->ss, addr->len) != 0) {
        int e = errno;
        close(s);
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "socket: bind to %s failed: %s",
                          xccl_sock_str(addr, buf, sizeof(buf)), strerror(e));
    }
    if (listen(s, 1024) != 0) {
        int e = errno;
        close(s);
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "socket: listen on %s failed: %s",
                          xccl_sock_str(addr, buf, sizeof(buf)), strerror(e));
    }
    addr->len = sizeof(addr->ss);
    if (getsockname(s, (struct sockaddr *)&addr->ss, &addr->len) != 0) {
        int e = errno;
        close(s);
        return XCCL_ERROR(XCCL_ERR_SYSTEM, "socket: getsockname failed: %s", strerror(e));
    }
    *fd = s;
    return XCCL_OK;
}

/* Errors after which a connect is worth retrying: the listener may not exist yet, its
 * backlog may be full, or the network may still be coming up. */
static int connect_retryable(int e)
{
    switch (e) {
    case ECONNREFUSED:
    case ETIMEDOUT:
    case ECONNRESET:
    case ECONNABORTED:
    case EAGAIN:
    case EINTR:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case EADDRNOTAVAIL:
        return 1;
    default:
        return 0;
    }
}

/* True when a socket connected to itself: connecting to a free local port from the ephemeral
 * range can pick that very port as the source and complete a "simultaneous open". */
static int self_connected(int fd)
{
    struct sockaddr_storage a, b;
    socklen_t               la = sizeof(a), lb = sizeof(b);

    if (getsockname(fd, (struct sockaddr *)&a, &la) != 0) return 0;
    if (getpeername(fd, (struct sockaddr *)&b, &lb) != 0) return 0;
    return la == lb && memcmp(&a, &b, la) == 0;
}

/* One connect attempt, bounded by the deadline. Returns 0 with *fd set, or an errno. */
static int connect_once(const xccl_sockaddr_t *addr, int64_t deadline_ms, int *fd)
{
    struct pollfd pfd;
    socklen_t     elen = sizeof(int);
    int           err  = 0;
    int           s    = socket(addr->ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);

    if (s < 0) return errno;
    if (connect(s, (const struct sockaddr *)&addr->ss, addr->len) != 0) {
        if (errno != EINPROGRESS) {
            err = errno;
            close(s);
            return err;
        }
        pfd.fd     = s;
        pfd.events = POLLOUT;
        for (;;) {
            int n = poll(&pfd, 1, poll_timeout(deadline_ms));
            if (n > 0) break;
            if (n == 0 || errno != EINTR) {
                err = n == 0 ? ETIMEDOUT : errno;
                close(s);
                return err;
            }
        }
        if (getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &elen) != 0) err = errno;
        if (err != 0) {
            close(s);
            return err;
        }
    }
    if (self_connected(s)) {
        close(s);
        return ECONNREFUSED;
    }
    if (xccl_sock_set_nonblock(s, 0) != 0) {
        err = errno;
        close(s);
        return err;
    }
    set_nodelay(s);
    *fd = s;
    return 0;
}

xccl_status_t xccl_sock_connect(const xccl_sockaddr_t *addr, int64_t deadline_ms, int *fd)
{
    char    buf[INET6_ADDRSTRLEN + 16];
    int64_t start   = xccl_now_ms();
    int     backoff = SOCK_BACKOFF_FIRST_MS;
    int     attempts = 0;

    for (;;) {
        int err = connect_once(addr, deadline_ms, fd);
        int wait;

        attempts++;
        if (err == 0) return XCCL_OK;
        if (!connect_retryable(err))
            return XCCL_ERROR(XCCL_ERR_SYSTEM, "socket: connect to %s failed: %s",
                              xccl_sock_str(addr, buf, sizeof(buf)), strerror(err));
        wait = poll_timeout(deadline_ms);
        if (wait == 0)
            return XCCL_ERROR(XCCL_ERR_TIMEOUT,
                              "socket: connect to %s timed out after %lld ms and %d attempts "
                              "(last error: %s)",
                              xccl_sock_str(addr, buf, sizeof(buf)),
                              (long long)(xccl_now_ms() - start), attempts, strerror(err));
        if (wait < 0 || wait > backoff) wait = backoff;
        usleep((useconds_t)wait * 1000u);
        backoff = backoff * 2 > SOCK_BACKOFF_MAX_MS ? SOCK_BACKOFF_MAX_MS : backoff * 2;
    }
}

xccl_status_t xccl_sock_accept(int lfd, int64_t deadline_ms, int *fd, xccl_sockaddr_t *peer)
{
    struct pollfd   pfd = {.fd = lfd, .events = POLLIN};
    xccl_sockaddr_t tmp;
    xccl_sockaddr_t *a = peer ? peer : &tmp;

    for (;;) {
        int n = poll(&pfd, 1, poll_timeout(deadline_ms));
        int s;

        if (n < 0 && errno != EINTR)
            return XCCL_ERROR(XCCL_ERR_SYSTEM, "socket: poll on listening socket failed: %s",
                              strerror(errno));
        if (n == 0)
            return XCCL_ERROR(XCCL_ERR_TIMEOUT, "socket: no connection arrived before the "
                                                "deadline");
        if (n < 0) continue;
        memset(a, 0, sizeof(*a));
        a->len = sizeof(a->ss);
        s      = accept4(lfd, (struct sockaddr *)&a->ss, &a->len, SOCK_CLOEXEC);
        if (s < 0) {
            /* the connection went away before we took it, or a non-blocking listener raced */
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ||
                errno == ECONNABORTED || errno == EPROTO)
                continue;
            return XCCL_ERROR(XCCL_ERR_SYSTEM, "socket: accept failed: %s", strerror(errno));
        }
        set_nodelay(s);
        *fd = s;
        return XCCL_OK;
    }
}

/* Waits until fd is ready for `events` or the deadline passes. */
static xccl_status_t wait_ready(int fd, short events, int64_t deadline_ms, const char *what,
                                size_t done, size_t len)
{
    struct pollfd pfd = {.fd = fd, .events = events};

    for (;;) {
        int n = poll(&pfd, 1, poll_timeout(deadline_ms));
        if (n > 0) return XCCL_OK;
        if (n == 0) {
            char buf[INET6_ADDRSTRLEN + 16];
            return XCCL_ERROR(XCCL_ERR_TIMEOUT, "socket: %s %s timed out after %zu of %zu bytes",
                              what, peer_str(fd, buf, sizeof(buf)), done, len);
        }
        if (errno != EINTR)
            return XCCL_ERROR(XCCL_ERR_SYSTEM, "socket: poll failed: %s", strerror(errno));
    }
}

static xccl_status_t io_error(int fd, const char *what, int e, size_t done, size_t len)
{
    char buf[INET6_ADDRSTRLEN + 16];

    if (e == 0)
        return XCCL_ERROR(XCCL_ERR_REMOTE, "socket: %s %s: connection closed by peer after "
                                           "%zu of %zu bytes",
                          what, peer_str(fd, buf, sizeof(buf)), done, len);
    return XCCL_ERROR(e == ECONNRESET || e == EPIPE || e == ETIMEDOUT || e == ENOTCONN ||
                              e == EHOSTUNREACH || e == ENETUNREACH
                          ? XCCL_ERR_REMOTE
                          : XCCL_ERR_SYSTEM,
                      "socket: %s %s failed after %zu of %zu bytes: %s", what,
                      peer_str(fd, buf, sizeof(buf)), done, len, strerror(e));
}

/* Both loops try the I/O first with MSG_DONTWAIT (so a blocking socket never blocks past the
 * deadline) and poll only when the socket is not ready. */
xccl_status_t xccl_sock_send_all(int fd, const void *buf, size_t len, int64_t deadline_ms)
{
    const char *p    = buf;
    size_t      done = 0;

    while (done < len) {
        size_t  n = len - done < SOCK_IO_CHUNK ? len - done : SOCK_IO_CHUNK;
        ssize_t w = send(fd, p + done, n, MSG_NOSIGNAL | MSG_DONTWAIT);

        if (w >= 0) {
            done += (size_t)w;
            continue;
        }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return io_error(fd, "send to", errno, done, len);
        XCCL_CHECK(wait_ready(fd, POLLOUT, deadline_ms, "send to", done, len));
    }
    return XCCL_OK;
}

xccl_status_t xccl_sock_recv_all(int fd, void *buf, size_t len, int64_t deadline_ms)
{
    char  *p    = buf;
    size_t done = 0;

    while (done < len) {
        size_t  n = len - done < SOCK_IO_CHUNK ? len - done : SOCK_IO_CHUNK;
        ssize_t r = recv(fd, p + done, n, MSG_DONTWAIT);

        if (r > 0) {
            done += (size_t)r;
            continue;
        }
        if (r == 0) return io_error(fd, "recv from", 0, done, len);
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return io_error(fd, "recv from", errno, done, len);
        XCCL_CHECK(wait_ready(fd, POLLIN, deadline_ms, "recv from", done, len));
    }
    return XCCL_OK;
}
