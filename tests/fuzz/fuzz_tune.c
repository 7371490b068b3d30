/* SPDX-License-Identifier: Apache-2.0
 *
 * fuzz_tune.c - the tuning-table parser (csrc/algo/tune.c, through xccl_algo_policy.tune_load,
 * as the core loads $XCCL_TUNE_FILE). Input: the file's bytes, written to a temporary file.
 *
 * Checked beyond "no crash, leak or hang": the load either succeeds with a table and a non-zero
 * hash, or fails with XCCL_ERR_INVALID_ARG, no table, hash 0 and a message naming the file;
 * the same bytes hash the same on a second load; a loaded table answers lookups (every
 * collective, a few sizes and rank counts) with one of that collective's algorithms, and
 * tune_applies answers 0 or 1 (with a reason when 0).
 */
#include "fuzz.h"

#include <fcntl.h>
#include <unistd.h>

#include "algo/algo.h"
#include "core/check.h"

static char path[64];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    int fd;

    (void)argc;
    (void)argv;
    snprintf(path, sizeof(path), "/tmp/xccl-fuzz-tune-%d", (int)getpid());
    fd = open(path, O_CREAT | O_WRONLY | O_TRUNC, 0600);
    FUZZ_CHECK(fd >= 0, "cannot create %s", path);
    close(fd);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const size_t sizes[] = {0, 1, 4096, (size_t)1 << 40, SIZE_MAX};
    xccl_tune_t        *t = NULL, *t2 = NULL;
    uint64_t            h = 0, h2 = 0;
    xccl_status_t       st;
    FILE               *f;

    if (path[0] == '\0') LLVMFuzzerInitialize(NULL, NULL);
    if (size > 1u << 16) return 0;
    f = fopen(path, "wb");
    FUZZ_CHECK(f != NULL, "cannot write %s", path);
    FUZZ_CHECK(fwrite(data, 1, size, f) == size, "short write");
    fclose(f);
    st = xccl_algo_policy.tune_load(path, &t, &h);
    if (st != XCCL_OK) {
        FUZZ_CHECK(st == XCCL_ERR_INVALID_ARG, "status %d", (int)st);
        FUZZ_CHECK(t == NULL && h == 0, "a failed load left a table");
        FUZZ_CHECK(strstr(xccl_last_error(), path) != NULL, "the error names no file: %s",
                   xccl_last_error());
        return 0;
    }
    FUZZ_CHECK(t != NULL && h != 0, "a loaded table without a table or hash");
    FUZZ_CHECK(xccl_algo_policy.tune_load(path, &t2, &h2) == XCCL_OK && h2 == h,
               "the same bytes hashed differently");
    xccl_algo_policy.tune_free(t2);
    for (int c = 0; c < XCCL_COLL_COUNT; c++) {
        for (int np = 1; np <= 64; np *= 4) {
            for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
                const char *name = xccl_tune_lookup(t, (xccl_coll_t)c, np, sizes[k]);
                FUZZ_CHECK(name == NULL || xccl_algo_find((xccl_coll_t)c, name) != NULL,
                           "the table chose '%s', no algorithm of %s", name,
                           xccl_coll_name((xccl_coll_t)c));
            }
        }
    }
    {
        xccl_cost_model_t m = {1, 1, 1, 1};
        char              why[512];
        int               ok = xccl_algo_policy.tune_applies(t, "shm", &m, why, sizeof(why));
        FUZZ_CHECK(ok == 0 || ok == 1, "applies %d", ok);
        FUZZ_CHECK(ok || why[0] != '\0', "ignored without a reason");
        FUZZ_CHECK(m.alpha >= 0 && m.beta >= 0 && m.gamma >= 0 && m.delta >= 0,
                   "a negative coefficient");
    }
    xccl_algo_policy.tune_free(t);
    return 0;
}
