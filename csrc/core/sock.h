/* SPDX-License-Identifier: Apache-2.0
 *
 * sock.h - small socket helpers shared by the TCP store and the TCP transport: interface
 * selection, listening, connecting with a deadline, and full reads/writes with a deadline on
 * sockets in blocking or non-blocking mode (poll-based).
 */
#ifndef XCCL_CORE_SOCK_H
#define XCCL_CORE_SOCK_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "xccl/xccl.h"

typedef struct xccl_sockaddr {
    struct sockaddr_storage ss;
    socklen_t               len;
} xccl_sockaddr_t;

/* The address ranks listen on: the first IPv4 (then IPv6) address of $XCCL_SOCKET_IFNAME
 * (a comma-separated list of interface names or prefixes; "^lo" excludes), else the first
 * non-loopback interface that is up, else loopback. The port is 0. */
xccl_status_t xccl_sock_default_addr(xccl_sockaddr_t *out);
/* Resolves host (name or literal; NULL or "" = wildcard) and port. */
xccl_status_t xccl_sock_resolve(const char *host, int port, xccl_sockaddr_t *out);
/* "1.2.3.4:5678" / "[::1]:5678" into buf. */
const char *xccl_sock_str(const xccl_sockaddr_t *a, char *buf, size_t len);
int         xccl_sock_port(const xccl_sockaddr_t *a);

/* Creates a listening socket bound to addr (SO_REUSEADDR, CLOEXEC, backlog 1024) and writes
 * the bound address (with the picked port) back into addr. Blocking mode. */
xccl_status_t xccl_sock_listen(xccl_sockaddr_t *addr, int *fd);
/* Connects with retries (ECONNREFUSED etc. retried until the deadline). TCP_NODELAY, CLOEXEC,
 * blocking mode. */
xccl_status_t xccl_sock_connect(const xccl_sockaddr_t *addr, int64_t deadline_ms, int *fd);
/* Accepts one connection (waits up to the deadline). TCP_NODELAY, CLOEXEC, blocking mode. */
xccl_status_t xccl_sock_accept(int lfd, int64_t deadline_ms, int *fd, xccl_sockaddr_t *peer);

/* Sends/receives exactly len bytes before deadline_ms (xccl_now_ms() clock; < 0: none).
 * XCCL_ERR_REMOTE on EOF or reset, XCCL_ERR_TIMEOUT on deadline. */
xccl_status_t xccl_sock_send_all(int fd, const void *buf, size_t len, int64_t deadline_ms);
xccl_status_t xccl_sock_recv_all(int fd, void *buf, size_t len, int64_t deadline_ms);

int xccl_sock_set_nonblock(int fd, int on);

#endif /* XCCL_CORE_SOCK_H */
