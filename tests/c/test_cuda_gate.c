/* SPDX-License-Identifier: Apache-2.0
 *
 * test_cuda_gate.c - the CUDA executor's parts that run without a GPU:
 *   - the completion gates' bookkeeping (csrc/cuda/gate.c): tickets and words, closed until
 *     opened, busy words skipped so a word's value only grows, the counter's wrap, exhaustion,
 *     opening a ticket not held, two threads taking and opening gates;
 *   - (CUDA builds) the paths without a driver: xccl_cuda_info says why, xccl_cuda_set_device
 *     fails with XCCL_ERR_NOT_SUPPORTED and that reason, xccl_cuda_check_ptr needs a device,
 *     and no executor serves XCCL_MEM_CUDA; a library that is not a CUDA driver is named.
 * The driver is chosen with $XCCL_CUDA_LIB (set before the first call), so the test does not
 * depend on whether this machine has a GPU.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/exec.h"
#include "ctest.h"
#include "xccl/xccl.h"
#ifdef XCCL_HAVE_CUDA
#include "cuda/gate.h"
#endif

#ifdef XCCL_HAVE_CUDA
/* the word's value, as the device reads it */
static uint32_t word_of(xccl_gates_t *g, uint32_t t)
{
    return atomic_load(&g->words[xccl_gates_word(g, t)]);
}

static int geq(uint32_t a, uint32_t b)
{
    return (int32_t)(a - b) >= 0;
}

static void test_basic(void)
{
    uint32_t     words[8];
    xccl_gates_t g;
    uint32_t     t[8], extra;

    CHECK(xccl_gates_init(&g, words, 6) == XCCL_ERR_INVALID_ARG); /* not a power of two */
    CHECK(xccl_gates_init(&g, NULL, 8) == XCCL_ERR_INVALID_ARG);
    CHECK(xccl_gates_init(&g, words, 8) == XCCL_OK);
    for (int i = 0; i < 8; i++) {
        CHECK(xccl_gates_new(&g, &t[i]) == XCCL_OK);
        CHECK(t[i] == 8u + (uint32_t)i); /* ticket t uses word t % 8 */
        CHECK(xccl_gates_word(&g, t[i]) == (uint32_t)i);
        CHECK(!xccl_gates_is_open(&g, t[i])); /* closed until opened */
        CHECK(!geq(word_of(&g, t[i]), t[i]));
    }
    /* all 8 closed: a 9th fails with a message, and does not disturb the others */
    CHECK(xccl_gates_new(&g, &extra) == XCCL_ERR_NO_MEMORY);
    CHECK(strstr(xccl_last_error(), "completion gates") != NULL);
    /* opening a ticket that is not held does nothing: one never given (a later round of word
     * 3) and one of an earlier round */
    xccl_gates_open(&g, t[3] + 8);
    xccl_gates_open(&g, t[3] - 8);
    CHECK(!xccl_gates_is_open(&g, t[3]));
    CHECK(word_of(&g, t[3]) == 3u);
    /* open 2 and 5: their words hold the tickets; the others stay closed */
    xccl_gates_open(&g, t[2]);
    xccl_gates_open(&g, t[5]);
    xccl_gates_open(&g, t[5]); /* twice: nothing more */
    CHECK(word_of(&g, t[2]) == t[2] && word_of(&g, t[5]) == t[5]);
    CHECK(xccl_gates_is_open(&g, t[2]) && xccl_gates_is_open(&g, t[5]));
    for (int i = 0; i < 8; i++)
        if (i != 2 && i != 5) CHECK(!xccl_gates_is_open(&g, t[i]));
    /* the next tickets skip the 6 busy words: 16 (word 0) busy, ... first free is word 2 of the
     * next round, ticket 18; then word 5: ticket 21 */
    CHECK(xccl_gates_new(&g, &extra) == XCCL_OK && extra == 18u);
    CHECK(!xccl_gates_is_open(&g, 18u));
    /* the older ticket of the word stays open: its word only grew */
    CHECK(xccl_gates_is_open(&g, t[2]));
    CHECK(xccl_gates_new(&g, &extra) == XCCL_OK && extra == 21u);
    CHECK(xccl_gates_new(&g, &extra) == XCCL_ERR_NO_MEMORY);
    xccl_gates_open(&g, 21u);
    CHECK(xccl_gates_is_open(&g, 21u) && xccl_gates_is_open(&g, t[5]));
    CHECK(!xccl_gates_is_open(&g, 18u));
    for (int i = 0; i < 8; i++)
        xccl_gates_open(&g, t[i]);
    xccl_gates_open(&g, 18u);
    for (int i = 0; i < 8; i++)
        CHECK(xccl_gates_is_open(&g, t[i]));
    CHECK(xccl_gates_is_open(&g, 18u) && xccl_gates_is_open(&g, 21u));
    xccl_gates_fini(&g);
}

/* The counter wraps past 2^32: tickets keep mapping to word t % n, and the cyclic comparison
 * keeps a new ticket closed while its word holds a value from before the wrap. */
static void test_wrap(void)
{
    uint32_t     words[4];
    xccl_gates_t g;
    uint32_t     t, prev[4];

    CHECK(xccl_gates_init(&g, words, 4) == XCCL_OK);
    g.next = UINT32_MAX - 9; /* 0xfffffff6: word 2 */
    for (int w = 0; w < 4; w++)
        atomic_store(&g.words[w], UINT32_MAX - 13 + (uint32_t)w);
    for (int w = 0; w < 4; w++)
        prev[w] = atomic_load(&g.words[w]);
    for (int i = 0; i < 24; i++) {
        CHECK(xccl_gates_new(&g, &t) == XCCL_OK);
        CHECK(t == UINT32_MAX - 9 + (uint32_t)i); /* no word busy: no skip, wraps to 0, 1, ... */
        CHECK(!xccl_gates_is_open(&g, t));
        CHECK(geq(t, prev[t & 3])); /* the word grows (cyclically) */
        xccl_gates_open(&g, t);
        CHECK(xccl_gates_is_open(&g, t));
        CHECK(word_of(&g, t) == t);
        prev[t & 3] = t;
    }
    CHECK(t == 13u); /* wrapped */
    xccl_gates_fini(&g);
}

/* Two threads take and open gates concurrently (make TSAN=1 checks the locking); every ticket
 * is closed when taken and open after its holder opened it. */
static xccl_gates_t shared_g;
static uint32_t     shared_words[64];

static void *churn(void *arg)
{
    int bad = 0;

    (void)arg;
    for (int i = 0; i < 20000; i++) {
        uint32_t t[3];
        int      n = 0;

        for (; n < 3; n++)
            if (xccl_gates_new(&shared_g, &t[n]) != XCCL_OK) break;
        for (int j = 0; j < n; j++)
            bad += xccl_gates_is_open(&shared_g, t[j]);
        for (int j = 0; j < n; j++) {
            xccl_gates_open(&shared_g, t[j]);
            bad += !xccl_gates_is_open(&shared_g, t[j]);
        }
        bad += n != 3; /* 64 words, at most 6 held at once */
    }
    return (void *)(intptr_t)bad;
}

static void test_threads(void)
{
    pthread_t th[2];
    void     *r[2];

    CHECK(xccl_gates_init(&shared_g, shared_words, 64) == XCCL_OK);
    for (int i = 0; i < 2; i++)
        CHECK(pthread_create(&th[i], NULL, churn, NULL) == 0);
    for (int i = 0; i < 2; i++) {
        CHECK(pthread_join(th[i], &r[i]) == 0);
        CHECK_MSG(r[i] == NULL, "thread %d: %ld wrong gate states", i, (long)(intptr_t)r[i]);
    }
    CHECK(shared_g.nbusy == 0);
    xccl_gates_fini(&shared_g);
}
#endif /* XCCL_HAVE_CUDA */

/* No driver: everything says why, nothing is installed for XCCL_MEM_CUDA. */
static void test_no_driver(void)
{
    xccl_cuda_info_t info;
    int              x = 0;

    xccl_cuda_info(&info);
    CHECK(!info.loaded && info.ndevices == 0 && info.device == -1);
    CHECK(info.driver_version == 0);
    CHECK(info.why[0] != '\0');
#ifdef XCCL_HAVE_CUDA
    CHECK(info.built == 1);
    CHECK(info.header_version > 0);
    CHECK_MSG(strstr(info.why, "cannot load the CUDA driver /nonexistent/libcuda.so.1") != NULL,
              "why: %s", info.why);
#else
    CHECK(info.built == 0 && info.header_version == 0);
    CHECK_MSG(strstr(info.why, "built without CUDA") != NULL, "why: %s", info.why);
#endif
    CHECK(xccl_cuda_set_device(0) == XCCL_ERR_NOT_SUPPORTED);
#ifdef XCCL_HAVE_CUDA
    CHECK_MSG(strstr(xccl_last_error(), "/nonexistent/libcuda.so.1") != NULL, "error: %s",
              xccl_last_error());
    CHECK(xccl_cuda_check_ptr(&x, sizeof x) == XCCL_ERR_INVALID_USAGE);
#else
    CHECK(strstr(xccl_last_error(), "built without CUDA") != NULL);
    CHECK(xccl_cuda_check_ptr(&x, sizeof x) == XCCL_ERR_NOT_SUPPORTED);
#endif
    CHECK(xccl_cuda_set_device(0) == XCCL_ERR_NOT_SUPPORTED); /* again: the same answer */
    CHECK(xccl_exec_for(XCCL_MEM_CUDA) == NULL);
    xccl_cuda_info(&info); /* unchanged */
    CHECK(!info.loaded && info.device == -1);
}

#if defined(XCCL_HAVE_CUDA) && defined(FAKE_CUDA_LIB)
/* With a driver (the fake one, fake_cuda.cc) and no GPU kernels linked (this test links no
 * fatbin): the device is chosen, copies work, reductions say why they cannot run;
 * xccl_cuda_check_ptr tells device memory from the rest. */
static void test_fake_driver(void)
{
    xccl_cuda_info_t       info;
    const xccl_exec_ops_t *ex;
    void                  *d = NULL, *ev = NULL;
    int                    host[4] = {1, 2, 3, 4}, back[4] = {0};
    xccl_status_t          st;

    CHECK(xccl_cuda_check_ptr(host, sizeof host) == XCCL_ERR_INVALID_USAGE); /* no device yet */
    CHECK(xccl_cuda_set_device(1) == XCCL_ERR_INVALID_ARG);
    CHECK(strstr(xccl_last_error(), "no device 1") != NULL);
    CHECK(xccl_cuda_set_device(0) == XCCL_OK);
    CHECK(xccl_cuda_set_device(0) == XCCL_OK); /* again: nothing */
    xccl_cuda_info(&info);
    CHECK(info.built && info.loaded && info.ndevices == 1 && info.device == 0);
    CHECK(info.driver_version == 13000 && info.cc_major == 9 && info.cc_minor == 0);
    CHECK(strcmp(info.device_name, "fake GPU") == 0);
    CHECK(info.archs[0] == '\0');
    CHECK_MSG(strstr(info.why, "without the GPU kernels") != NULL, "why: %s", info.why);
    ex = xccl_exec_for(XCCL_MEM_CUDA);
    CHECK(ex != NULL && strcmp(ex->name, "cuda") == 0);
    if (ex == NULL) return;
    d = ex->alloc(64);
    CHECK(d != NULL);
    if (d == NULL) return;
    CHECK(xccl_cuda_check_ptr(d, 64) == XCCL_OK);
    CHECK(xccl_cuda_check_ptr((char *)d + 16, 48) == XCCL_OK);
    CHECK(xccl_cuda_check_ptr((char *)d + 16, 49) == XCCL_ERR_INVALID_ARG);
    CHECK(strstr(xccl_last_error(), "not inside one allocation") != NULL);
    CHECK(xccl_cuda_check_ptr(host, sizeof host) == XCCL_ERR_INVALID_ARG);
    CHECK(strstr(xccl_last_error(), "not memory CUDA knows") != NULL);
    CHECK(xccl_cuda_check_ptr(NULL, 4) == XCCL_ERR_INVALID_ARG);
    /* copies: queued, completed by test */
    st = ex->copy(NULL, d, host, sizeof host, &ev);
    CHECK(st == XCCL_INPROGRESS && ev != NULL);
    if (st == XCCL_INPROGRESS) CHECK(ex->test(ev) == XCCL_OK);
    st = ex->copy(NULL, back, d, sizeof back, &ev);
    if (st == XCCL_INPROGRESS) CHECK(ex->test(ev) == XCCL_OK);
    CHECK(memcmp(host, back, sizeof host) == 0);
    CHECK(ex->host_register != NULL && ex->host_release != NULL);
    {
        void *pin = malloc(4096);
        CHECK(pin != NULL && ex->host_register(pin, 4096) == XCCL_OK);
        CHECK(ex->host_register(pin, 0) == XCCL_ERR_INVALID_ARG);
        ex->host_release(pin); /* unpins and frees (ASan: no leak, no double free) */
    }
    CHECK(ex->copy(NULL, d, d, 64, &ev) == XCCL_OK && ev == NULL); /* nothing to do: no event */
    CHECK(ex->copy(NULL, d, host, 0, &ev) == XCCL_OK && ev == NULL);
    /* no kernels: a reduction says so before anything is queued */
    CHECK(ex->reduce(NULL, d, d, d, 4, XCCL_INT32, XCCL_OP_SUM, &ev) == XCCL_ERR_NOT_SUPPORTED);
    CHECK(ev == NULL);
    CHECK_MSG(strstr(xccl_last_error(), "no GPU kernels") != NULL, "%s", xccl_last_error());
    CHECK(ex->reduce(NULL, d, d, d, 0, XCCL_INT32, XCCL_OP_SUM, &ev) == XCCL_OK && ev == NULL);
    /* bad arguments fail first */
    CHECK(ex->reduce(NULL, d, d, d, 4, XCCL_FLOAT32, XCCL_OP_BAND, &ev) == XCCL_ERR_INVALID_ARG);
    CHECK(ex->reduce(NULL, d, d, d, 4, XCCL_FLOAT32, XCCL_OP_AVG, &ev) == XCCL_ERR_INVALID_ARG);
    CHECK(ex->reduce(NULL, (char *)d + 2, d, d, 4, XCCL_INT32, XCCL_OP_SUM, &ev) ==
          XCCL_ERR_INVALID_ARG);
    CHECK(strstr(xccl_last_error(), "not aligned") != NULL);
    CHECK(ex->scale(NULL, d, d, 4, XCCL_BOOL, 2.0, &ev) == XCCL_ERR_NOT_SUPPORTED);
    CHECK(ex->divide(NULL, d, d, 4, XCCL_INT32, 0, &ev) == XCCL_ERR_INVALID_ARG);
    ex->free(d);
}
#endif

int main(int argc, char **argv)
{
#ifdef XCCL_HAVE_CUDA
    /* a child run with a library that exists but is no CUDA driver */
    if (argc == 2 && strcmp(argv[1], "--not-a-driver") == 0) {
        xccl_cuda_info_t info;

        setenv("XCCL_CUDA_LIB", "libm.so.6", 1);
        xccl_cuda_info(&info);
        CHECK_MSG(strstr(info.why, "the CUDA driver libm.so.6 lacks cuInit") != NULL, "why: %s",
                  info.why);
        CHECK(xccl_cuda_set_device(0) == XCCL_ERR_NOT_SUPPORTED);
        CTEST_MAIN_END("test_cuda_gate (not a driver)");
    }
#ifdef FAKE_CUDA_LIB
    if (argc == 2 && strcmp(argv[1], "--fake-driver") == 0) {
        setenv("XCCL_CUDA_LIB", FAKE_CUDA_LIB, 1);
        test_fake_driver();
        CTEST_MAIN_END("test_cuda_gate (fake driver)");
    }
#endif
    test_basic();
    test_wrap();
    test_threads();
    {
        char cmd[4096];

        snprintf(cmd, sizeof cmd, "%s --not-a-driver", argv[0]);
        CHECK(system(cmd) == 0);
#ifdef FAKE_CUDA_LIB
        snprintf(cmd, sizeof cmd, "%s --fake-driver", argv[0]);
        CHECK(system(cmd) == 0);
#endif
    }
#else
    (void)argc;
    (void)argv;
#endif
    setenv("XCCL_CUDA_LIB", "/nonexistent/libcuda.so.1", 1);
    test_no_driver();
    CTEST_MAIN_END("test_cuda_gate");
}
