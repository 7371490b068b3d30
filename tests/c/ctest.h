/* SPDX-License-Identifier: Apache-2.0
 *
 * ctest.h - a minimal assertion harness for the C tests: CHECK(cond) records a failure with
 * file:line and the expression; CTEST_MAIN_END returns nonzero if anything failed.
 */
#ifndef XCCL_TESTS_CTEST_H
#define XCCL_TESTS_CTEST_H

#include <stdatomic.h>
#include <stdio.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "xccl/xccl.h"

/* Atomic: tests CHECK from their own threads too (ThreadSanitizer, make TSAN=1, sees a plain
 * counter bumped by two threads as the data race it is). */
static _Atomic int ctest_failures;
static _Atomic int ctest_checks;

#define CHECK(cond)                                                                      \
    do {                                                                                 \
        ctest_checks++;                                                                  \
        if (!(cond)) {                                                                   \
            ctest_failures++;                                                            \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);     \
        }                                                                                \
    } while (0)

#define CHECK_MSG(cond, ...)                                                             \
    do {                                                                                 \
        ctest_checks++;                                                                  \
        if (!(cond)) {                                                                   \
            ctest_failures++;                                                            \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);     \
            fprintf(stderr, __VA_ARGS__);                                                \
            fputc('\n', stderr);                                                         \
        }                                                                                \
    } while (0)

#define CTEST_MAIN_END(name)                                                             \
    do {                                                                                 \
        printf("%s: %d checks, %d failed\n", (name), ctest_checks, ctest_failures);      \
        return ctest_failures != 0;                                                      \
    } while (0)

/* A communicator of `size` ranks meeting through the file store at `path` (NULL when creation
 * failed, the reason printed). `transports` NULL: the default choice. */
static inline xccl_comm_t *ctest_file_comm(const char *path, int rank, int size,
                                           int64_t timeout_ms, const char *name,
                                           const char *transports)
{
    xccl_store_t      *store = NULL;
    xccl_comm_t       *comm  = NULL;
    xccl_comm_config_t cfg   = {0};

    if (xccl_store_file_create(path, size, 20000, &store) != XCCL_OK) return NULL;
    cfg.rank       = rank;
    cfg.size       = size;
    cfg.store      = store;
    cfg.timeout_ms = timeout_ms;
    cfg.name       = name;
    cfg.transports = transports;
    if (xccl_comm_create(&cfg, &comm) != XCCL_OK)
        fprintf(stderr, "rank %d: comm create: %s\n", rank, xccl_last_error());
    xccl_store_release(store);
    return comm;
}

/* Runs child(rank, size, arg) in `size` forked processes (at most 64) and waits for them all;
 * each one that does not exit with status 0 is reported, labelled `what`, and counted.
 * Returns the number of ranks that failed. */
static inline int ctest_fork_ranks(const char *what, int size, int (*child)(int, int, void *),
                                   void *arg)
{
    pid_t pids[64];
    int   failed = 0;

    if (size < 1 || size > 64) return size;
    fflush(NULL);
    for (int r = 0; r < size; r++) {
        pids[r] = fork();
        if (pids[r] == 0) _exit(child(r, size, arg));
        if (pids[r] < 0) {
            perror("fork");
            failed++;
        }
    }
    for (int r = 0; r < size; r++) {
        int status = 0;
        if (pids[r] < 0) continue;
        waitpid(pids[r], &status, 0);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "%s: rank %d of %d failed (status 0x%x)\n", what, r, size, status);
            failed++;
        }
    }
    return failed;
}

#endif /* XCCL_TESTS_CTEST_H */
