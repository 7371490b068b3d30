/* SPDX-License-Identifier: Apache-2.0
 *
 * check.h - error reporting and propagation, logging, clocks. Shared by the core, the
 * algorithms and the backends.
 *
 * Report an error once, where it is found, with XCCL_ERROR(status, fmt, ...): it formats the
 * message into the calling thread's last-error buffer, logs it at WARN and evaluates to the
 * status. Pass errors up with XCCL_CHECK / XCCL_CHECK_GOTO, which only add a TRACE line.
 */
#ifndef XCCL_CORE_CHECK_H
#define XCCL_CORE_CHECK_H

#include <errno.h>
#include <stdint.h>

#include "xccl/xccl.h"

#define XCCL_LIKELY(x)   __builtin_expect(!!(x), 1)
#define XCCL_UNLIKELY(x) __builtin_expect(!!(x), 0)

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

/* Monotonic clock in nanoseconds (precise: timings, traces) and in milliseconds (deadlines).
 * The millisecond clock is the coarse one, which lags the precise one by up to a scheduler tick
 * (1-4 ms) and costs a few ns instead of ~25 in a VM: progress passes read it every time. */
uint64_t xccl_now_ns(void);
int64_t  xccl_now_ms(void);

/* Integer environment knob: $name parsed as int64, or `def` when unset/invalid. */
int64_t xccl_env_int(const char *name, int64_t def);

#endif /* XCCL_CORE_CHECK_H */
