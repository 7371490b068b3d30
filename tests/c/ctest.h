/* SPDX-License-Identifier: Apache-2.0
 *
 * ctest.h - a minimal assertion harness for the C tests: CHECK(cond) records a failure with
 * file:line and the expression; CTEST_MAIN_END returns nonzero if anything failed.
 */
#ifndef XCCL_TESTS_CTEST_H
#define XCCL_TESTS_CTEST_H

#include <stdio.h>

static int ctest_failures;
static int ctest_checks;

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

#endif /* XCCL_TESTS_CTEST_H */
