/* SPDX-License-Identifier: Apache-2.0
 *
 * replay_main.c - a main() for a fuzz harness without libFuzzer: runs every file named on the
 * command line (directories: every file in them, sorted) through LLVMFuzzerTestOneInput once.
 * A crash or a failed FUZZ_CHECK aborts the program, naming the file on stderr first.
 * The address space is limited to 768 MiB, so that an allocation of a size a peer announced
 * fails here (and the harness sees XCCL_ERR_NO_MEMORY) as libFuzzer's -malloc_limit_mb makes
 * it fail under run.sh.
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "fuzz.h"

/* Harnesses without an initialiser get this one. */
__attribute__((weak)) int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    return 0;
}

static int run_file(const char *path)
{
    FILE    *f = fopen(path, "rb");
    uint8_t *buf;
    long     n;

    if (f == NULL || fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 ||
        fseek(f, 0, SEEK_SET) != 0) {
        fprintf(stderr, "replay: cannot read %s\n", path);
        if (f) fclose(f);
        return -1;
    }
    buf = malloc((size_t)n + 1); /* +1: a zero-length input still gets a valid pointer */
    if (buf == NULL || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "replay: cannot read %s\n", path);
        free(buf);
        fclose(f);
        return -1;
    }
    fclose(f);
    fprintf(stderr, "replay: %s (%ld bytes)\n", path, n);
    LLVMFuzzerTestOneInput(buf, (size_t)n);
    free(buf);
    return 0;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv)
{
    int           nfiles = 0, bad = 0;
    struct rlimit as = {768ul << 20, 768ul << 20};

    if (setrlimit(RLIMIT_AS, &as) != 0) perror("replay: setrlimit");
    LLVMFuzzerInitialize(&argc, &argv);
    for (int i = 1; i < argc; i++) {
        struct stat    sb;
        DIR           *d;
        struct dirent *e;
        char         **names = NULL;
        size_t         n = 0, cap = 0;

        if (stat(argv[i], &sb) != 0) continue; /* an absent directory has nothing to replay */
        if (!S_ISDIR(sb.st_mode)) {
            bad |= run_file(argv[i]) != 0;
            nfiles++;
            continue;
        }
        d = opendir(argv[i]);
        if (d == NULL) {
            fprintf(stderr, "replay: cannot open %s\n", argv[i]);
            bad = 1;
            continue;
        }
        while ((e = readdir(d)) != NULL) {
            if (e->d_name[0] == '.') continue;
            if (n == cap) {
                cap   = cap ? 2 * cap : 64;
                names = realloc(names, cap * sizeof(*names));
                if (names == NULL) abort();
            }
            names[n] = malloc(strlen(argv[i]) + strlen(e->d_name) + 2);
            if (names[n] == NULL) abort();
            sprintf(names[n], "%s/%s", argv[i], e->d_name);
            n++;
        }
        closedir(d);
        qsort(names, n, sizeof(*names), by_name);
        for (size_t j = 0; j < n; j++) {
            bad |= run_file(names[j]) != 0;
            nfiles++;
            free(names[j]);
        }
        free(names);
    }
    printf("replay: %d inputs%s\n", nfiles, bad ? ", some unreadable" : "");
    return bad;
}
