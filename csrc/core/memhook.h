/* SPDX-License-Identifier: Apache-2.0
 *
 * memhook.h - memory-event hooks: the registration caches (rcache.h) learn that user memory was
 * freed, unmapped or remapped, so that no registration outlives the pages it pinned.
 *
 * Installed once per process, lazily, by the first registration cache (xccl_memhook_start), by
 * rewriting the GOT slots (JUMP_SLOT and GLOB_DAT relocations) of every loaded object for
 * free, realloc, reallocarray, munmap, mremap, madvise, mmap (MAP_FIXED) and shmdt (and dlsym,
 * so that pointers looked up in a library handle, as ctypes does, are the hooks). A hook
 * reports the affected range, if it may overlap a registration (xccl_memhook_watch), into a
 * bounded lock-free event log before it calls the real function; the caches read the log
 * (xccl_memhook_drain) under their own locks before every lookup. A hook takes no lock and
 * allocates nothing: it may run in any thread, also one that holds a context lock.
 * Objects loaded later are patched by the next drain, which then reports "events lost" (the
 * cache invalidates everything): what such an object freed before it was patched is unknown.
 *
 * XCCL_MEM_HOOKS=0 (or a failure to install) leaves the process untouched: xccl_memhook_start
 * returns 0 and the caches keep no registration beyond its use.
 */
#ifndef XCCL_CORE_MEMHOOK_H
#define XCCL_CORE_MEMHOOK_H

#include <stddef.h>
#include <stdint.h>

/* Installs the hooks once (thread-safe; later calls return the first answer). 1: active. */
int xccl_memhook_start(void);

/* [start, end) is registered / no longer registered (balanced calls; any thread). Frees that
 * may overlap a watched range are reported; others cost the hook a few loads. */
void xccl_memhook_watch(uintptr_t start, uintptr_t end);
void xccl_memhook_unwatch(uintptr_t start, uintptr_t end);

/* A reader's position in the event log; each reader (cache) has its own. */
typedef struct xccl_memhook_cursor {
    uint64_t      ev;   /* next event to read */
    unsigned long adds; /* objects loaded when last read (dl_iterate_phdr's dlpi_adds) */
} xccl_memhook_cursor_t;

/* A cursor at the present: later events only. */
void xccl_memhook_cursor_init(xccl_memhook_cursor_t *cur);
/* Calls fn(arg, start, end) for every range reported since *cur, and moves *cur to the present.
 * Returns 0, or -1 when events may have been lost (the log overflowed, a writer never
 * finished, or objects were loaded since: they are patched first): the caller must then treat
 * all its memory as invalidated. Cheap when nothing happened (a load and a compare, and one
 * dl_iterate_phdr step to notice new objects). */
int xccl_memhook_drain(xccl_memhook_cursor_t *cur,
                       void (*fn)(void *arg, uintptr_t start, uintptr_t end), void *arg);

/* What the hooks did (tests, diagnostics). */
typedef struct xccl_memhook_stats {
    int      active;  /* hooks installed */
    int      objects; /* objects with at least one slot patched */
    int      slots;   /* GOT slots patched */
    int      failed;  /* slots that could not be patched */
    uint64_t events;  /* ranges reported so far */
} xccl_memhook_stats_t;
void xccl_memhook_stats(xccl_memhook_stats_t *out);

#endif /* XCCL_CORE_MEMHOOK_H */
