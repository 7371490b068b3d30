/* SPDX-License-Identifier: Apache-2.0
 *
 * loopback_stream.c - the ceiling for any library's one-way TCP transfer on this host: two
 * processes (pinned to CPUs 0 and 1 when there are two), one loopback connection with
 * TCP_NODELAY and the kernel's buffer autotuning, the sender writing whole messages, the
 * receiver polling with non-blocking reads straight into its buffer. No library, no framing.
 *
 *   cc -O2 -Wall -Wextra -o /tmp/loopback_stream benchmarks/loopback_stream.c
 *   /tmp/loopback_stream [bytes per message] [messages]     (default 64 MiB, 40)
 *
 * Prints the receiver's time per message and its bandwidth, after one message of warm-up.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void pin(int cpu)
{
    cpu_set_t set;

    if (sysconf(_SC_NPROCESSORS_ONLN) < 2) return;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    (void)sched_setaffinity(0, sizeof(set), &set);
}

static void die(const char *what)
{
    perror(what);
    exit(1);
}

static void nodelay(int fd)
{
    int one = 1;

    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) die("setsockopt");
}

static void receiver(int lfd, size_t n, int count)
{
    char  *buf = malloc(n);
    int    fd  = accept(lfd, NULL, NULL);
    double t0  = 0.0, t;

    if (buf == NULL || fd < 0) die("receiver");
    nodelay(fd);
    memset(buf, 0, n); /* fault the pages in before timing */
    for (int i = 0; i < count + 1; i++) {
        size_t got = 0;

        if (i == 1) t0 = now_s();
        while (got < n) {
            ssize_t r = recv(fd, buf + got, n - got, MSG_DONTWAIT);
            if (r > 0)
                got += (size_t)r;
            else if (r == 0)
                die("receiver: peer closed");
            else if (errno != EAGAIN && errno != EINTR)
                die("recv");
        }
    }
    t = now_s() - t0;
    printf("%zu bytes x %d: %.1f us per message, %.2f GB/s\n", n, count, t / count * 1e6,
           (double)n * count / t / 1e9);
    fflush(stdout); /* the child leaves through _exit */
    if (write(fd, "k", 1) != 1) die("write");
    close(fd);
    free(buf);
}

static void sender(const struct sockaddr_in *addr, size_t n, int count)
{
    char *buf = malloc(n);
    char  ack;
    int   fd = socket(AF_INET, SOCK_STREAM, 0);

    if (buf == NULL || fd < 0) die("sender");
    if (connect(fd, (const struct sockaddr *)addr, sizeof(*addr)) != 0) die("connect");
    nodelay(fd);
    memset(buf, 1, n);
    for (int i = 0; i < count + 1; i++) {
        size_t off = 0;
        while (off < n) {
            ssize_t w = send(fd, buf + off, n - off, MSG_NOSIGNAL);
            if (w < 0 && errno != EINTR) die("send");
            if (w > 0) off += (size_t)w;
        }
    }
    if (read(fd, &ack, 1) != 1) die("read"); /* the receiver has timed everything */
    close(fd);
    free(buf);
}

int main(int argc, char **argv)
{
    size_t             n     = argc > 1 ? strtoull(argv[1], NULL, 0) : (size_t)64 << 20;
    int                count = argc > 2 ? atoi(argv[2]) : 40;
    struct sockaddr_in addr;
    socklen_t          len = sizeof(addr);
    int                lfd = socket(AF_INET, SOCK_STREAM, 0);
    pid_t              pid;
    int                status = 0;

    if (n == 0 || count < 1) {
        fprintf(stderr, "usage: %s [bytes per message] [messages]\n", argv[0]);
        return 2;
    }
    memset(&addr, 0, sizeof(addr));
    addr.sin_family      = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&addr, sizeof(addr)) != 0 ||
        getsockname(lfd, (struct sockaddr *)&addr, &len) != 0 || listen(lfd, 1) != 0)
        die("listen");
    pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        pin(1);
        receiver(lfd, n, count);
        _exit(0);
    }
    pin(0);
    close(lfd);
    sender(&addr, n, count);
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return 1;
    return 0;
}
