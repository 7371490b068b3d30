/* SPDX-License-Identifier: Apache-2.0
 *
 * xccl_tp_support.h - what the library offers a transport besides the ABI itself (error
 * reporting, logging, clocks, environment knobs, sockets and the authentication handshake), so
 * that a transport builds against the public headers alone (xccl.h, xccl_transport.h and this
 * one), in the tree or out of it. The built-in transports use nothing else from the core.
 *
 * Errors: report an error once, where it is found, with XCCL_ERROR(status, fmt, ...): it formats
 * the message into the calling thread's last-error buffer (xccl_last_error), logs it at WARN and
 * evaluates to the status. Pass errors up with XCCL_CHECK / XCCL_CHECK_GOTO, which only add a
 * TRACE line. A transport reports an error this way before it returns it from an ABI entry, so
 * the core's message to the user names the transport's cause.
 *
 * Every function here may be called from any thread, with or without the core's lock.
 */
#ifndef XCCL_TP_SUPPORT_H
#define XCCL_TP_SUPPORT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "xccl/xccl.h"

#ifdef __cplusplus
extern "C" {
#endif

#define XCCL_LIKELY(x)   __builtin_expect(!!(x), 1)
#define XCCL_UNLIKELY(x) __builtin_expect(!!(x), 0)

/* ---- logging and errors ------------------------------------------------------------------- */

typedef enum xccl_log_level {
    XCCL_LOG_NONE  = 0,
    XCCL_LOG_WARN  = 1,
    XCCL_LOG_INFO  = 2,
    XCCL_LOG_TRACE = 3,
} xccl_log_level_t;

/* Level from $XCCL_DEBUG (NONE by default: the library is silent unless asked). */
xccl_log_level_t xccl_log_level(void);
/* Writes one line to stderr (or $XCCL_DEBUG_FILE), prefixed with host, pid and level. */
void xccl_log(xccl_log_level_t lvl, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Records the message as the thread's last error, logs it at WARN, returns st. */
xccl_status_t xccl_error_report(xccl_status_t st, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Records a message as the thread's last error without logging (for errors that are part of
 * normal operation, such as a store key that is not there yet). */
xccl_status_t xccl_error_set(xccl_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#define XCCL_WARN(...)                                                                     \
    do {                                                                                   \
        if (xccl_log_level() >= XCCL_LOG_WARN) xccl_log(XCCL_LOG_WARN, __FILE__, __LINE__, \
                                                        __VA_ARGS__);                      \
    } while (0)
#define XCCL_INFO(...)                                                                     \
    do {                                                                                   \
        if (xccl_log_level() >= XCCL_LOG_INFO) xccl_log(XCCL_LOG_INFO, __FILE__, __LINE__, \
                                                        __VA_ARGS__);                      \
    } while (0)
#define XCCL_TRACE(...)                                                                      \
    do {                                                                                     \
        if (xccl_log_level() >= XCCL_LOG_TRACE) xccl_log(XCCL_LOG_TRACE, __FILE__, __LINE__, \
                                                         __VA_ARGS__);                       \
    } while (0)

#define XCCL_ERROR(st, ...) xccl_error_report((st), __FILE__, __LINE__, __VA_ARGS__)

#define XCCL_CHECK(call)                                                     \
    do {                                                                     \
        xccl_status_t st_ = (call);                                          \
        if (XCCL_UNLIKELY(st_ < 0)) {                                        \
            XCCL_TRACE("%s -> %s", #call, xccl_status_string(st_));          \
            return st_;                                                      \
        }                                                                    \
    } while (0)

#define XCCL_CHECK_GOTO(call, st, label)                                     \
    do {                                                                     \
        (st) = (call);                                                       \
        if (XCCL_UNLIKELY((st) < 0)) {                                       \
            XCCL_TRACE("%s -> %s", #call, xccl_status_string(st));           \
            goto label;                                                      \
        }                                                                    \
    } while (0)

/* ---- clocks and knobs --------------------------------------------------------------------- */

/* Monotonic clock in nanoseconds (precise: timings, traces) and in milliseconds (deadlines).
 * The millisecond clock is the coarse one, which lags the precise one by up to a scheduler tick
 * (1-4 ms) and costs a few ns instead of ~25 in a VM: progress passes read it every time. */
uint64_t xccl_now_ns(void);
int64_t  xccl_now_ms(void);

/* Integer environment knob: $name parsed as int64, or `def` when unset/invalid. */
int64_t xccl_env_int(const char *name, int64_t def);

/* Fills buf with cryptographically random bytes (getrandom). */
xccl_status_t xccl_random_bytes(void *buf, size_t len);

/* A pidfd for process `pid` (readable once it has exited), or -1 with errno set (ENOSYS where
 * the kernel or libc lacks pidfd_open: callers fall back to kill(pid, 0)). */
int xccl_pidfd_open(int pid);

/* Removes POSIX shared-memory objects that a dead process left in /dev/shm: names starting with
 * `prefix`, owned by our user, on which no process holds an OFD lock (their creators lock them
 * right after creating them and keep the lock while they may be opened), and either older than
 * min_age_s (a younger unlocked one may be one being created now) or, when creator_dead is
 * given, whose creator it says is dead (it gets the name without the leading '/'). `who` starts
 * the INFO line logged for each removal. Never blocks on a lock; errors are skipped. */
void xccl_shm_sweep(const char *prefix, int min_age_s, int (*creator_dead)(const char *name),
                    const char *who);

/* ---- sockets ------------------------------------------------------------------------------ */

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

/* ---- authentication ----------------------------------------------------------------------- */

/* Runs the library's challenge-response (HMAC-SHA-256 over fresh nonces from both sides; the
 * key never crosses the wire) on a connected blocking-mode socket, up to deadline_ms
 * (xccl_now_ms() clock). The accepting side passes is_server = 1, the connecting side 0.
 * `context` binds the proof to the purpose (e.g. "<transport name>/<job id>"), so a proof made
 * for one purpose is refused for another. Returns XCCL_ERR_AUTH if the peer's proof is wrong,
 * XCCL_ERR_TIMEOUT / XCCL_ERR_REMOTE on I/O trouble. */
xccl_status_t xccl_auth_handshake(int fd, const void *key, size_t keylen, int is_server,
                                  const char *context, int64_t deadline_ms);

#ifdef __cplusplus
}
#endif
#endif /* XCCL_TP_SUPPORT_H */
