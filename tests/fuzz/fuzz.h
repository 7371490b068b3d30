/* SPDX-License-Identifier: Apache-2.0
 *
 * fuzz.h - what the harnesses in tests/fuzz share. Each fuzz_<name>.c defines
 * LLVMFuzzerTestOneInput (and may define LLVMFuzzerInitialize); it is linked either with
 * libFuzzer (clang, run.sh) or with replay_main.c (any C compiler: replays the committed corpus
 * and regressions, see Makefile).
 */
#ifndef XCCL_TESTS_FUZZ_H
#define XCCL_TESTS_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* A property the code under test must keep: abort (libFuzzer saves the input) with a message. */
#define FUZZ_CHECK(cond, ...)                                                                 \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "fuzz check failed at %s:%d: %s: ", __FILE__, __LINE__, #cond);   \
            fprintf(stderr, __VA_ARGS__);                                                     \
            fputc('\n', stderr);                                                              \
            abort();                                                                          \
        }                                                                                     \
    } while (0)

/* Consumes fuzz input from the front: fixed-size integers (zero past the end), then the rest. */
typedef struct fuzz_in {
    const uint8_t *p;
    size_t         n;
} fuzz_in_t;

static inline uint64_t fuzz_take(fuzz_in_t *in, size_t bytes)
{
    uint64_t v = 0;

    for (size_t i = 0; i < bytes; i++) {
        v <<= 8;
        if (in->n > 0) {
            v |= *in->p++;
            in->n--;
        }
    }
    return v;
}

#endif /* XCCL_TESTS_FUZZ_H */
