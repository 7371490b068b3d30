/* SPDX-License-Identifier: Apache-2.0
 *
 * test_tune.c - tuning tables (csrc/algo/tune.c) through the selection policy the core calls:
 * loading and its errors (file and line), the hash that ranks compare, whether a table applies
 * to this host and transport (and its fitted model then), and where select_source says each
 * choice came from (forced, env, table, rule, model).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "algo/algo.h"
#include "ctest.h"

void xccl_algo_reset_env(void); /* select.c, for tests */

static char path[64];

static void write_table(const char *text)
{
    FILE *f = fopen(path, "w");

    fputs(text, f);
    fclose(f);
}

/* The table text with this host's signature in place of HOST. */
static void write_host_table(const char *transport, const char *rest)
{
    char cpu[128], buf[4096];
    int  cores;

    xccl_tune_host(cpu, sizeof(cpu), &cores);
    snprintf(buf, sizeof(buf), "xccl-tune 1\n# comment\nhost transport=%s cores=%d cpu=%s\n%s",
             transport, cores, cpu, rest);
    write_table(buf);
}

static xccl_coll_args_t args_of(xccl_coll_t coll, size_t nbytes, int size, const xccl_topo_t *topo)
{
    xccl_coll_args_t a = {0};

    a.coll   = coll;
    a.dtype  = XCCL_UINT8;
    a.elsize = 1;
    a.op     = XCCL_OP_SUM;
    a.count =
        coll == XCCL_COLL_ALLREDUCE || coll == XCCL_COLL_BROADCAST ? nbytes : nbytes / (size_t)size;
    a.topo = topo;
    return a;
}

/* The choice for (coll, nbytes, size) under topo and m: its name, its source in *source. */
static const char *choose(xccl_coll_t coll, size_t nbytes, int size, const xccl_topo_t *topo,
                          const xccl_cost_model_t *m, const char *forced, const char **source)
{
    xccl_coll_args_t   a   = args_of(coll, nbytes, size, topo);
    const xccl_algo_t *out = NULL;

    *source = "?";
    if (xccl_algo_policy.select_source(&a, size, nbytes, m, forced, &out, source) != XCCL_OK)
        return "error";
    return out->name;
}

static void expect_bad(const char *text, int line, const char *words)
{
    xccl_tune_t *t    = (xccl_tune_t *)1;
    uint64_t     hash = 7;
    char         want[96];

    write_table(text);
    CHECK(xccl_algo_policy.tune_load(path, &t, &hash) == XCCL_ERR_INVALID_ARG);
    CHECK(t == NULL && hash == 0);
    snprintf(want, sizeof(want), "%s:%d: ", path, line);
    CHECK_MSG(line == 0 || strstr(xccl_last_error(), want) != NULL, "%s", xccl_last_error());
    CHECK_MSG(strstr(xccl_last_error(), words) != NULL, "%s", xccl_last_error());
}

int main(void)
{
    xccl_tune_t      *t = NULL, *t2 = NULL;
    uint64_t          h1 = 0, h2 = 0;
    xccl_cost_model_t m = {1, 1, 1, 1};
    const char       *src;
    char              why[512];
    int               fd;
    int               node_of[8] = {0}, node_two[8] = {0, 0, 1, 1, 1, 1, 1, 1};

    snprintf(path, sizeof(path), "/tmp/xccl-test-tune-XXXXXX");
    fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    unsetenv("XCCL_ALGO");
    xccl_algo_reset_env();

    /* none */
    CHECK(xccl_algo_policy.tune_load(NULL, &t, &h1) == XCCL_OK && t == NULL && h1 == 0);
    CHECK(xccl_algo_policy.tune_load("", &t, &h1) == XCCL_OK && t == NULL && h1 == 0);

    /* malformed: the file and the line */
    expect_bad("", 0, "empty");
    expect_bad("\n\nxccl-tune 9\n", 3, "version 9");
    expect_bad("xccl-tune 1 extra\n", 1, "unexpected 'extra'");
    expect_bad("xccl-tune 1\nhost transport=shm cores=2 cpu=x\nhost transport=shm cores=2 "
               "cpu=x\n",
               3, "a second host line");
    expect_bad("xccl-tune 1\nhost transport=shm cores=zero cpu=x\n", 2, "bad value");
    expect_bad("xccl-tune 1\nhost transport=shm cores=2 cpu=x\nchoose all_reduce np=2 "
               "bytes=0-1k algo=rd\n",
               3, "bad value in 'bytes=0-1k'");
    expect_bad("xccl-tune 1\nhost transport=shm cores=2 cpu=x\nchoose all_reduce np=2 "
               "algo=rd\n",
               3, "choose needs np=, bytes=lo-hi and algo=");
    expect_bad("xccl-tune 1\nhost transport=shm cores=2 cpu=x\nchoose broadcast np=2 "
               "bytes=0-8 algo=rd\n",
               3, "broadcast has no algorithm 'rd'");
    expect_bad("xccl-tune 1\nhost transport=shm cores=2 cpu=x\nmodel alpha=1 beta=1 gamma=1 "
               "delta=1 epsilon=1\n",
               3, "unknown field 'epsilon=1'");
    {
        static const char nul[] = "xccl-tune 1\nhost transport=shm cores=2 cpu=x\n\0\n";
        FILE             *f     = fopen(path, "w");
        fwrite(nul, 1, sizeof(nul) - 1, f);
        fclose(f);
        CHECK(xccl_algo_policy.tune_load(path, &t, &h1) == XCCL_ERR_INVALID_ARG);
        CHECK(strstr(xccl_last_error(), ":3: not a text line") != NULL);
    }

    /* a good table; the hash depends on the content only */
    write_host_table("shm", "model alpha=1e-6 beta=2e-10 gamma=3e-10 delta=4e-10\n"
                            "choose all_reduce np=4 bytes=0-100 algo=ring   # trailing\n"
                            "choose all_reduce np=4 bytes=50-4096 algo=direct\n"
                            "choose all_reduce np=2 bytes=0-4096 algo=owner\n"
                            "choose broadcast np=4 bytes=1000-1000 algo=chain\n"
                            "meas broadcast np=4 bytes=1000 best=chain chain=1e-6 linear=2e-6\n");
    CHECK(xccl_algo_policy.tune_load(path, &t, &h1) == XCCL_OK && t != NULL && h1 != 0);
    CHECK(xccl_algo_policy.tune_load(path, &t2, &h2) == XCCL_OK && h2 == h1);
    xccl_algo_policy.tune_free(t2);
    write_host_table("shm", "choose all_reduce np=4 bytes=0-100 algo=rd\n");
    CHECK(xccl_algo_policy.tune_load(path, &t2, &h2) == XCCL_OK && h2 != h1);

    /* applies: this host, the transport it was measured with; the fitted model then */
    CHECK(xccl_algo_policy.tune_applies(t, "shm", &m, why, sizeof(why)) == 1);
    CHECK(m.alpha == 1e-6 && m.beta == 2e-10 && m.gamma == 3e-10 && m.delta == 4e-10);
    m = (xccl_cost_model_t){1, 1, 1, 1};
    CHECK(xccl_algo_policy.tune_applies(t, "tcp", &m, why, sizeof(why)) == 0);
    CHECK(m.alpha == 1 && strstr(why, "measured with transport shm, ranks here use tcp"));
    CHECK(xccl_algo_policy.tune_applies(t2, "shm", &m, why, sizeof(why)) == 1 && m.alpha == 1);
    xccl_algo_policy.tune_free(t2);
    write_table("xccl-tune 1\nhost transport=shm cores=3 cpu=Elsewhere 1\n");
    CHECK(xccl_algo_policy.tune_load(path, &t2, &h2) == XCCL_OK);
    CHECK(xccl_algo_policy.tune_applies(t2, "shm", &m, why, sizeof(why)) == 0);
    CHECK_MSG(strstr(why, "measured on 'Elsewhere 1' with 3 cores") != NULL, "%s", why);
    xccl_algo_policy.tune_free(t2);

    /* select_source */
    {
        xccl_cost_model_t dm    = {2e-6, 1.0 / 6e9, 1.0 / 4e9, 1.0 / 8e9};
        xccl_topo_t       tuned = {.nnodes = 1, .node_of = node_of, .pull = 1, .scarce = 1};
        xccl_topo_t       plain = tuned, two = tuned;
        const char       *name;
        tuned.tune  = t;
        two.nnodes  = 2;
        two.node_of = node_two;
        two.tune    = t;
        /* the first matching choose line wins; np must match */
        name = choose(XCCL_COLL_ALLREDUCE, 64, 4, &tuned, &dm, NULL, &src);
        CHECK(strcmp(name, "ring") == 0 && strcmp(src, "table") == 0);
        name = choose(XCCL_COLL_ALLREDUCE, 101, 4, &tuned, &dm, NULL, &src);
        CHECK(strcmp(name, "direct") == 0 && strcmp(src, "table") == 0);
        name = choose(XCCL_COLL_ALLREDUCE, 100, 2, &tuned, &dm, NULL, &src);
        CHECK(strcmp(name, "owner") == 0 && strcmp(src, "table") == 0);
        name = choose(XCCL_COLL_BROADCAST, 1000, 4, &tuned, &dm, NULL, &src);
        CHECK(strcmp(name, "chain") == 0 && strcmp(src, "table") == 0);
        /* outside the table: the model, not the built-in rules */
        name = choose(XCCL_COLL_BROADCAST, 1001, 4, &tuned, &dm, NULL, &src);
        CHECK(strcmp(src, "model") == 0);
        name = choose(XCCL_COLL_ALLREDUCE, 64 << 20, 8, &tuned, &dm, NULL, &src);
        CHECK(strcmp(src, "model") == 0);
        /* without a table the built-in rules (owner from 16 MiB on 2 to 4 ranks; not on 8) */
        name = choose(XCCL_COLL_ALLREDUCE, 64 << 20, 2, &plain, &dm, NULL, &src);
        CHECK(strcmp(name, "owner") == 0 && strcmp(src, "rule") == 0);
        name = choose(XCCL_COLL_ALLREDUCE, 64 << 20, 8, &plain, &dm, NULL, &src);
        CHECK(strcmp(src, "model") == 0);
        name = choose(XCCL_COLL_BROADCAST, 4 << 20, 4, &plain, &dm, NULL, &src);
        CHECK(strcmp(name, "linear") == 0 && strcmp(src, "rule") == 0);
        name = choose(XCCL_COLL_BROADCAST, 4 << 20, 2, &plain, &dm, NULL, &src);
        CHECK(strcmp(src, "model") == 0);
        /* a table never applies to several nodes (the core gives it only to one-node
         * communicators; the selector checks again) */
        name = choose(XCCL_COLL_ALLREDUCE, 64, 4, &two, &dm, NULL, &src);
        CHECK(strcmp(src, "table") != 0);
        /* forced and $XCCL_ALGO come first */
        name = choose(XCCL_COLL_ALLREDUCE, 64, 4, &tuned, &dm, "rd", &src);
        CHECK(strcmp(name, "rd") == 0 && strcmp(src, "forced") == 0);
        setenv("XCCL_ALGO", "allreduce:0-1k=bruck_nope;broadcast=linear", 1);
        xccl_algo_reset_env();
        name = choose(XCCL_COLL_BROADCAST, 1000, 4, &tuned, &dm, NULL, &src);
        CHECK(strcmp(name, "linear") == 0 && strcmp(src, "env") == 0);
        setenv("XCCL_ALGO", "allreduce=auto", 1);
        xccl_algo_reset_env();
        name = choose(XCCL_COLL_ALLREDUCE, 64, 4, &tuned, &dm, NULL, &src);
        CHECK(strcmp(src, "model") == 0); /* "auto": the model itself */
        unsetenv("XCCL_ALGO");
        xccl_algo_reset_env();
        (void)name;
    }
    xccl_algo_policy.tune_free(t);
    unlink(path);
    CTEST_MAIN_END("test_tune");
}
