/* SPDX-License-Identifier: Apache-2.0
 *
 * util.c - status strings, the thread-local last-error buffer, logging, clocks, env knobs.
 */
#include "core/check.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>
#include <pthread.h>

#define XCCL_ERRBUF_LEN 2048

static _Thread_local char last_error[XCCL_ERRBUF_LEN];

const char *xccl_status_string(xccl_status_t st)
{
    switch (st) {
    case XCCL_OK: return "XCCL_OK";
    case XCCL_INPROGRESS: return "XCCL_INPROGRESS";
    case XCCL_ERR_INVALID_ARG: return "XCCL_ERR_INVALID_ARG";
    case XCCL_ERR_INVALID_USAGE: return "XCCL_ERR_INVALID_USAGE";
    case XCCL_ERR_NOT_SUPPORTED: return "XCCL_ERR_NOT_SUPPORTED";
    case XCCL_ERR_NO_MEMORY: return "XCCL_ERR_NO_MEMORY";
    case XCCL_ERR_SYSTEM: return "XCCL_ERR_SYSTEM";
    case XCCL_ERR_REMOTE: return "XCCL_ERR_REMOTE";
    case XCCL_ERR_TIMEOUT: return "XCCL_ERR_TIMEOUT";
    case XCCL_ERR_CUDA: return "XCCL_ERR_CUDA";
    case XCCL_ERR_ABORTED: return "XCCL_ERR_ABORTED";
    case XCCL_ERR_INTERNAL: return "XCCL_ERR_INTERNAL";
    case XCCL_ERR_MISMATCH: return "XCCL_ERR_MISMATCH";
    case XCCL_ERR_AUTH: return "XCCL_ERR_AUTH";
    }
    return "XCCL_ERR_UNKNOWN";
}

const char *xccl_last_error(void) { return last_error; }

void xccl_free(void *p) { free(p); }

uint64_t xccl_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int64_t xccl_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t xccl_env_int(const char *name, int64_t def)
{
    const char *v = getenv(name);
    char       *end;
    long long   x;

    if (v == NULL || *v == '\0') return def;
    errno = 0;
    x     = strtoll(v, &end, 0);
    if (errno != 0 || *end != '\0') return def;
    return (int64_t)x;
}

static pthread_once_t   log_once = PTHREAD_ONCE_INIT;
static xccl_log_level_t log_lvl  = XCCL_LOG_NONE;
static FILE            *log_file;

static void log_init(void)
{
    const char *v = getenv("XCCL_DEBUG");
    const char *f = getenv("XCCL_DEBUG_FILE");

    if (v != NULL) {
        if (strcasecmp(v, "WARN") == 0) log_lvl = XCCL_LOG_WARN;
        else if (strcasecmp(v, "INFO") == 0) log_lvl = XCCL_LOG_INFO;
        else if (strcasecmp(v, "TRACE") == 0) log_lvl = XCCL_LOG_TRACE;
    }
    if (f != NULL && *f != '\0') {
        char path[1024];
        /* %p in the file name becomes the pid, so ranks do not interleave */
        const char *p = strstr(f, "%p");
        if (p != NULL)
            snprintf(path, sizeof(path), "%.*s%d%s", (int)(p - f), f, (int)getpid(), p + 2);
        else
            snprintf(path, sizeof(path), "%s", f);
        log_file = fopen(path, "a");
    }
}

xccl_log_level_t xccl_log_level(void)
{
    pthread_once(&log_once, log_init);
    return log_lvl;
}

static void log_vwrite(xccl_log_level_t lvl, const char *file, int line, const char *fmt,
                       va_list ap)
{
    static const char *names[] = {"NONE", "WARN", "INFO", "TRACE"};
    char               host[64];
    char               msg[XCCL_ERRBUF_LEN];
    FILE              *out = log_file ? log_file : stderr;
    const char        *base = strrchr(file, '/');

    if (gethostname(host, sizeof(host)) != 0) snprintf(host, sizeof(host), "?");
    host[sizeof(host) - 1] = '\0';
    vsnprintf(msg, sizeof(msg), fmt, ap);
    fprintf(out, "%s:%d xccl %s %s:%d %s\n", host, (int)getpid(), names[lvl],
            base ? base + 1 : file, line, msg);
    fflush(out);
}

void xccl_log(xccl_log_level_t lvl, const char *file, int line, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    log_vwrite(lvl, file, line, fmt, ap);
    va_end(ap);
}

xccl_status_t xccl_error_report(xccl_status_t st, const char *file, int line, const char *fmt,
                                ...)
{
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(last_error, sizeof(last_error), fmt, ap);
    va_end(ap);
    if (xccl_log_level() >= XCCL_LOG_WARN)
        xccl_log(XCCL_LOG_WARN, file, line, "%s (%s)", last_error, xccl_status_string(st));
    return st;
}

xccl_status_t xccl_error_set(xccl_status_t st, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(last_error, sizeof(last_error), fmt, ap);
    va_end(ap);
    return st;
}

int xccl_pidfd_open(int pid)
{
#ifdef SYS_pidfd_open
    return (int)syscall(SYS_pidfd_open, (pid_t)pid, 0);
#else
    (void)pid;
    errno = ENOSYS;
    return -1;
#endif
}
