/* SPDX-License-Identifier: Apache-2.0
 *
 * test_cuda_sync.c - the CUDA layer's rule against implicit synchronisation (cuda_lib.h), on
 * the fake driver (tests/c/fake_cuda.cc), whose allocation, free, registration and IPC calls
 * wait, as a driver may, until every stream has run what was queued before them, and fail
 * after $FAKE_CUDA_SYNC_TIMEOUT_MS (so a call that would hang on a GPU fails here instead).
 * While a stream waits for a closed completion gate:
 *   - xccl_cuda_sync_begin refuses; executor allocations come from the stream-ordered
 *     allocator; frees and unpinning are deferred, made by the first guarded call or device
 *     operation posted once no gate is waited for;
 *     pinning is declined; mapping a peer's buffer answers XCCL_INPROGRESS; none of them waits;
 *   - two waited gates: the rule holds until both are open;
 *   - a gate opened before the stream's wait is queued costs no wait and no refusal.
 * Afterwards everything works as before (the import maps the peer's memory, the deferred free
 * is gone). The peer is a forked child that exports a buffer with a known pattern.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ctest.h"
#include "xccl/xccl.h"

#if defined(XCCL_HAVE_CUDA) && defined(FAKE_CUDA_LIB)
#include "core/exec.h"
#include "cuda/cuda_lib.h"

#define N 4096

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The peer: exports a buffer of bytes i * 7 + 3, sends the blob, waits until told to go. */
static void child(int to_parent, int from_parent)
{
    const xccl_exec_ops_t *ex;
    unsigned char          host[N], blob[XCCL_EXEC_BLOB_MAX], go;
    void                  *d, *ev = NULL;
    size_t                 len = 0;

    if (xccl_cuda_set_device(0) != XCCL_OK) _exit(10);
    ex = xccl_exec_for(XCCL_MEM_CUDA);
    d  = ex != NULL ? ex->alloc(N) : NULL;
    if (d == NULL) _exit(11);
    for (int i = 0; i < N; i++)
        host[i] = (unsigned char)(i * 7 + 3);
    if (ex->copy(NULL, d, host, N, &ev) == XCCL_INPROGRESS && ex->test(ev) != XCCL_OK) _exit(12);
    if (ex->export_mem(d, N, blob, &len) != XCCL_OK) _exit(13);
    if (write(to_parent, &len, sizeof len) != (ssize_t)sizeof len ||
        write(to_parent, blob, len) != (ssize_t)len)
        _exit(14);
    if (read(from_parent, &go, 1) != 1) _exit(15);
    _exit(0);
}

static void test_rule(void)
{
    const xccl_exec_ops_t *ex;
    unsigned char          blob[XCCL_EXEC_BLOB_MAX], back[N];
    size_t                 len = 0;
    int                    up[2], down[2], status = 0;
    pid_t                  pid;
    uint64_t               g1, g2, g3;
    void                  *before, *during, *mapped = NULL, *ev = NULL, *pin, *pin2;
    double                 t0;

    CHECK(pipe(up) == 0 && pipe(down) == 0);
    pid = fork();
    if (pid == 0) child(up[1], down[0]);
    CHECK(read(up[0], &len, sizeof len) == (ssize_t)sizeof len && len <= sizeof blob);
    CHECK(read(up[0], blob, len) == (ssize_t)len);

    CHECK(xccl_cuda_set_device(0) == XCCL_OK);
    ex = xccl_exec_for(XCCL_MEM_CUDA);
    CHECK(ex != NULL);
    if (ex == NULL) return;
    /* nothing waits: the calls go ahead */
    CHECK(xccl_cuda_sync_begin() == 1);
    xccl_cuda_sync_end();
    before = ex->alloc(N);
    pin    = malloc(N);
    CHECK(before != NULL && pin != NULL && ex->host_register(pin, N) == XCCL_OK);

    /* a gate opened before any stream waits: no wait, no refusal */
    CHECK(ex->gate_new(&g3) == XCCL_OK);
    ex->gate_open(g3);
    CHECK(ex->gate_wait(g3, NULL) == XCCL_OK && xccl_cuda_sync_begin() == 1);
    xccl_cuda_sync_end();

    /* the legacy default stream waits for two closed gates */
    CHECK(ex->gate_new(&g1) == XCCL_OK && ex->gate_new(&g2) == XCCL_OK);
    CHECK(ex->gate_wait(g1, NULL) == XCCL_OK && ex->gate_wait(g2, NULL) == XCCL_OK);
    CHECK(xccl_cuda_sync_begin() == 0);
    t0 = now_s();
    during = ex->alloc(N); /* the stream-ordered allocator */
    CHECK(during != NULL && xccl_cuda_check_ptr(during, N) == XCCL_OK);
    ex->free(before); /* deferred: still the driver's */
    CHECK(xccl_cuda_check_ptr(before, N) == XCCL_OK);
    pin2 = malloc(N);
    CHECK(pin2 != NULL && ex->host_register(pin2, N) == XCCL_INPROGRESS); /* stays pageable */
    ex->host_release(pin);                                              /* deferred */
    CHECK(ex->import_mem(blob, len, &mapped) == XCCL_INPROGRESS && mapped == NULL);
    /* none of it waited for the blocked stream (the fake fails such a wait after 5 s) */
    CHECK_MSG(now_s() - t0 < 2.0, "%.2f s", now_s() - t0);

    ex->gate_open(g1); /* one still waited */
    CHECK(xccl_cuda_sync_begin() == 0);
    CHECK(xccl_cuda_check_ptr(before, N) == XCCL_OK);
    ex->gate_open(g2); /* the last: not here (where a Work finishes, under its lock) ... */
    CHECK(xccl_cuda_check_ptr(before, N) == XCCL_OK);
    CHECK(xccl_cuda_sync_begin() == 1); /* ... but by the next guarded call */
    xccl_cuda_sync_end();
    CHECK(xccl_cuda_check_ptr(before, N) != XCCL_OK);
    /* or by the next device operation posted (order_after calls xccl_cuda_release_deferred) */
    before = ex->alloc(N);
    CHECK(before != NULL && ex->gate_new(&g1) == XCCL_OK && ex->gate_wait(g1, NULL) == XCCL_OK);
    ex->free(before);
    ex->gate_open(g1);
    CHECK(xccl_cuda_check_ptr(before, N) == XCCL_OK);
    {
        void *mark = NULL;
        if (ex->order_after(NULL, &mark) == XCCL_INPROGRESS) ex->drop_event(mark);
    }
    CHECK(xccl_cuda_check_ptr(before, N) != XCCL_OK);

    /* and everything works again: the peer's buffer maps and reads back its pattern */
    CHECK(ex->import_mem(blob, len, &mapped) == XCCL_OK && mapped != NULL);
    if (mapped != NULL) {
        memset(back, 0, sizeof back);
        if (ex->copy(NULL, back, mapped, N, &ev) == XCCL_INPROGRESS) CHECK(ex->test(ev) == XCCL_OK);
        for (int i = 0; i < N; i++)
            if (back[i] != (unsigned char)(i * 7 + 3)) {
                CHECK_MSG(0, "mapped byte %d: %u", i, back[i]);
                break;
            }
    }
    CHECK(ex->host_register(pin2, N) == XCCL_OK);
    ex->host_release(pin2);
    ex->free(during); /* cuMemFreeAsync */
    CHECK(write(down[1], "g", 1) == 1);
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    close(up[0]), close(up[1]), close(down[0]), close(down[1]);
}

int main(void)
{
    setenv("XCCL_CUDA_LIB", FAKE_CUDA_LIB, 1);
    setenv("FAKE_CUDA_SYNC_TIMEOUT_MS", "5000", 1);
    test_rule();
    CTEST_MAIN_END("test_cuda_sync");
}
#else
int main(void)
{
    printf("test_cuda_sync: skipped (no CUDA headers or fake driver)\n");
    return 0;
}
#endif
