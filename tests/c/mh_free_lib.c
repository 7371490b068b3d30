/* SPDX-License-Identifier: Apache-2.0
 *
 * mh_free_lib.c - a shared object test_memhook loads after the memory hooks are installed (built
 * twice: with PLT calls, JUMP_SLOT relocations, and with -fno-plt, GLOB_DAT ones): it frees and
 * unmaps memory on the test's behalf, through its own GOT.
 */
#include <stddef.h>
#include <stdlib.h>
#include <sys/mman.h>

void mh_lib_free(void *p);
int  mh_lib_munmap(void *p, size_t n);

void mh_lib_free(void *p) { free(p); }
int  mh_lib_munmap(void *p, size_t n) { return munmap(p, n); }
