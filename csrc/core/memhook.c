/* SPDX-License-Identifier: Apache-2.0
 *
 * memhook.c - memory-event hooks (memhook.h).
 *
 * Patching
 *   Every loaded object (dl_iterate_phdr: the main program, libpython when it is separate,
 *   numpy's and torch's modules, ours) calls free, munmap, ... through a GOT slot: a
 *   JUMP_SLOT relocation (PLT calls) or a GLOB_DAT one (-fno-plt calls, and address-taken
 *   functions). Each slot of a hooked name (and of dlsym: see xccl_mh_dlsym) gets the hook's
 *   address; the hook calls the function the slots were bound to, resolved before any slot
 *   was written (resolve_real: glibc's, or an interposed allocator's or sanitizer's; not a
 *   non-PIE program's canonical PLT entry, which jumps through its patched slot). Slots in
 *   RELRO pages (read-only after relocation) are written between two mprotect calls that
 *   restore the page's protection as /proc/self/maps gives it: an object still being
 *   relocated by a concurrent dlopen has its pages writable and is left so. Passes run inside
 *   dl_iterate_phdr, whose lock serialises them with each other and with dlopen's list
 *   updates. Not patched: the dynamic loader, the vDSO, the sanitizer runtimes (they call
 *   the allocator they implement) and libc itself: most of its calls are internal anyway, and
 *   the few through its PLT (realloc in pthread_getattr_np, getline) run, among others, inside
 *   a sanitizer's thread start, where instrumented code (a hook built with -fsanitize=thread)
 *   must not run yet. So libc's own frees and reallocs are not seen (its internal memory; a
 *   user buffer grown by getline), nor malloc's trimming of its heap: the hooks of free and
 *   realloc cover that, by reporting the chunk being released. Objects loaded later are
 *   patched by the next xccl_memhook_drain (it checks dlpi_adds), which reports "lost" to
 *   every reader once, since what they freed before is unknown. dlopen itself is not hooked:
 *   calling it from a hook would change the caller whose RPATH/RUNPATH it searches.
 *
 * What a hook reports (before the real call, so that no reuse of the memory can precede it)
 *   free(p), realloc(p, n), reallocarray(p, ...): [p - 2 words, p + malloc_usable_size(p)),
 *     the chunk and its header: the pages malloc may give back to the system after this call
 *     are free chunks, each reported when it was freed (conservative: a registration sharing a
 *     page with a freed chunk is invalidated although malloc may keep that page).
 *   munmap, madvise with MADV_DONTNEED / _FREE / _REMOVE / _DONTNEED_LOCKED, mmap with
 *     MAP_FIXED, mremap (the old range, and the new one with MREMAP_FIXED): the range.
 *   shmdt(p): [p, end of the address space) (the segment's size is not known at detach).
 *
 * Filter (the hook's fast path)
 *   A reported range is kept only if it may overlap a watched (registered) range: first
 *   [lo, hi), the bounds of all watched ranges (hi = 0 when none: one load and a compare for
 *   every free of the process), then a counting filter of 2^16 counters over 256 KiB granules
 *   (a granule's counter is shared by the granules hashed to it: false positives, never false
 *   negatives). A false positive costs a log entry and the readers a lookup.
 *
 * Event log
 *   A ring of 4096 entries written by any thread without locks: a writer takes a ticket t
 *   (fetch_add on head), marks entry t % N odd (2t + 1), writes the range, publishes 2t + 2.
 *   Readers (one cursor per cache) read their tickets in order: an entry with 2t + 2 whose
 *   sequence is unchanged after the range was read is valid; a larger sequence means the ring
 *   wrapped (lost); a smaller one a writer between its ticket and its publication, waited for
 *   a bounded time (a writer that never finishes, e.g. in a child forked meanwhile, makes the
 *   readers report "lost" once). Lost events are never silent: the reader invalidates all.
 *
 * Threads, fork, re-entrancy: the hooks use atomics only (no lock, no allocation, no errno
 * change) and call only the real functions and malloc_usable_size; a fork's child inherits the
 * patched slots, the log and the filter as they were, which stay correct (the filter's lock,
 * taken by registrations only, is held across fork so that the child gets it free).
 */
#include "core/memhook.h"

#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <malloc.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <unistd.h>

#include "core/check.h"

#if defined(__x86_64__)
#define MH_R_JUMP_SLOT R_X86_64_JUMP_SLOT
#define MH_R_GLOB_DAT  R_X86_64_GLOB_DAT
#define MH_SUPPORTED   1
#elif defined(__aarch64__)
#define MH_R_JUMP_SLOT R_AARCH64_JUMP_SLOT
#define MH_R_GLOB_DAT  R_AARCH64_GLOB_DAT
#define MH_SUPPORTED   1
#else
#define MH_SUPPORTED 0
#endif

#ifndef MADV_FREE
#define MADV_FREE 8
#endif
#ifndef MADV_REMOVE
#define MADV_REMOVE 9
#endif
#ifndef MADV_DONTNEED_LOCKED
#define MADV_DONTNEED_LOCKED 24
#endif
#ifndef MREMAP_FIXED
#define MREMAP_FIXED 2
#endif

/* ---- the filter ------------------------------------------------------------------------------ */

enum { GRAN_SHIFT = 18, NCNT_BITS = 16, NCNT = 1 << NCNT_BITS };

static atomic_uint      cnt[NCNT];
static atomic_uintptr_t w_lo = UINTPTR_MAX, w_hi = 0;
static pthread_mutex_t  w_lock = PTHREAD_MUTEX_INITIALIZER;
static long             w_n; /* watched ranges; under w_lock */

static inline size_t gran_slot(uintptr_t g)
{
    return (size_t)(((uint64_t)g * 0x9E3779B97F4A7C15ull) >> (64 - NCNT_BITS));
}

static void gran_add(uintptr_t start, uintptr_t end, int d)
{
    uintptr_t g0 = start >> GRAN_SHIFT, g1 = (end - 1) >> GRAN_SHIFT;

    for (uintptr_t g = g0; g <= g1; g++) {
        if (d > 0) atomic_fetch_add_explicit(&cnt[gran_slot(g)], 1, memory_order_relaxed);
        else atomic_fetch_sub_explicit(&cnt[gran_slot(g)], 1, memory_order_relaxed);
    }
}

void xccl_memhook_watch(uintptr_t start, uintptr_t end)
{
    if (end <= start) return;
    pthread_mutex_lock(&w_lock);
    gran_add(start, end, 1);
    if (start < atomic_load_explicit(&w_lo, memory_order_relaxed))
        atomic_store_explicit(&w_lo, start, memory_order_relaxed);
    if (end > atomic_load_explicit(&w_hi, memory_order_relaxed))
        atomic_store_explicit(&w_hi, end, memory_order_relaxed);
    w_n++;
    pthread_mutex_unlock(&w_lock);
}

void xccl_memhook_unwatch(uintptr_t start, uintptr_t end)
{
    if (end <= start) return;
    pthread_mutex_lock(&w_lock);
    gran_add(start, end, -1);
    if (--w_n == 0) { /* the bounds only grow while something is watched */
        atomic_store_explicit(&w_hi, 0, memory_order_relaxed);
        atomic_store_explicit(&w_lo, UINTPTR_MAX, memory_order_relaxed);
    }
    pthread_mutex_unlock(&w_lock);
}

/* A fork's child must not inherit w_lock held by a thread it does not have. */
static void w_prepare(void) { pthread_mutex_lock(&w_lock); }
static void w_release(void) { pthread_mutex_unlock(&w_lock); }

/* May [start, end) overlap a watched range? */
static inline int watched(uintptr_t start, uintptr_t end)
{
    uintptr_t g0, g1;

    if (start >= atomic_load_explicit(&w_hi, memory_order_relaxed) ||
        end <= atomic_load_explicit(&w_lo, memory_order_relaxed))
        return 0;
    g0 = start >> GRAN_SHIFT;
    g1 = (end - 1) >> GRAN_SHIFT;
    if (g1 - g0 >= NCNT) return 1;
    for (uintptr_t g = g0; g <= g1; g++) {
        if (atomic_load_explicit(&cnt[gran_slot(g)], memory_order_relaxed) != 0) return 1;
    }
    return 0;
}

/* ---- the event log --------------------------------------------------------------------------- */

enum { LOG_BITS = 12, LOG_N = 1 << LOG_BITS, SPIN_MAX = 20000 };

typedef struct ev {
    _Atomic uint64_t seq; /* 2t + 1 while ticket t writes it, 2t + 2 once published */
    atomic_uintptr_t start, end;
} ev_t;

static ev_t             ev_log[LOG_N];
static _Atomic uint64_t ev_head; /* tickets taken */

static void report(uintptr_t start, uintptr_t end)
{
    uint64_t t;
    ev_t    *v;

    if (end <= start || !watched(start, end)) return;
    t = atomic_fetch_add_explicit(&ev_head, 1, memory_order_acq_rel);
    v = &ev_log[t & (LOG_N - 1)];
    atomic_store_explicit(&v->seq, 2 * t + 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&v->start, start, memory_order_relaxed);
    atomic_store_explicit(&v->end, end, memory_order_relaxed);
    atomic_store_explicit(&v->seq, 2 * t + 2, memory_order_release);
}

/* ---- the hooks ------------------------------------------------------------------------------- */

static void (*real_free)(void *);
static void *(*real_realloc)(void *, size_t);
static void *(*real_reallocarray)(void *, size_t, size_t);
static size_t (*real_usable)(void *);
static int (*real_munmap)(void *, size_t);
static void *(*real_mremap)(void *, size_t, size_t, int, ...);
static int (*real_madvise)(void *, size_t, int);
static void *(*real_mmap)(void *, size_t, int, int, int, off_t);
static void *(*real_mmap64)(void *, size_t, int, int, int, off_t);
static int (*real_shmdt)(const void *);
__attribute__((used, visibility("hidden"))) void *(*xccl_mh_real_dlsym)(void *, const char *);

/* A malloc chunk about to be released: its header and usable bytes. */
static inline void report_chunk(void *p)
{
    uintptr_t a = (uintptr_t)p;

    if (p == NULL || a >= atomic_load_explicit(&w_hi, memory_order_relaxed)) return;
    report(a - 2 * sizeof(size_t), a + real_usable(p));
}

static void mh_free(void *p)
{
    report_chunk(p);
    real_free(p);
}

static void *mh_realloc(void *p, size_t n)
{
    report_chunk(p);
    return real_realloc(p, n);
}

static void *mh_reallocarray(void *p, size_t n, size_t m)
{
    report_chunk(p);
    return real_reallocarray(p, n, m);
}

static int mh_munmap(void *p, size_t n)
{
    report((uintptr_t)p, (uintptr_t)p + n);
    return real_munmap(p, n);
}

static void *mh_mremap(void *p, size_t n, size_t nn, int flags, ...)
{
    void   *to = NULL;
    va_list ap;

    if (flags & MREMAP_FIXED) {
        va_start(ap, flags);
        to = va_arg(ap, void *);
        va_end(ap);
        report((uintptr_t)to, (uintptr_t)to + nn);
    }
    report((uintptr_t)p, (uintptr_t)p + n);
    return real_mremap(p, n, nn, flags, to);
}

static int mh_madvise(void *p, size_t n, int advice)
{
    if (advice == MADV_DONTNEED || advice == MADV_FREE || advice == MADV_REMOVE ||
        advice == MADV_DONTNEED_LOCKED)
        report((uintptr_t)p, (uintptr_t)p + n);
    return real_madvise(p, n, advice);
}

static void *mh_mmap(void *p, size_t n, int prot, int flags, int fd, off_t off)
{
    if (flags & MAP_FIXED) report((uintptr_t)p, (uintptr_t)p + n);
    return real_mmap(p, n, prot, flags, fd, off);
}

static void *mh_mmap64(void *p, size_t n, int prot, int flags, int fd, off_t off)
{
    if (flags & MAP_FIXED) report((uintptr_t)p, (uintptr_t)p + n);
    return real_mmap64(p, n, prot, flags, fd, off);
}

static int mh_shmdt(const void *p)
{
    report((uintptr_t)p, UINTPTR_MAX);
    return real_shmdt(p);
}

/* dlsym: code that calls the functions above through pointers it got from dlsym (ctypes and
 * cffi calling libc, a library binding its allocator lazily) would bypass the GOT. With an
 * explicit handle (the lookup does not depend on the caller) the hook's address is returned
 * for a hooked function. RTLD_DEFAULT and RTLD_NEXT lookups depend on the caller's object
 * (its scope, the objects after it): for them xccl_mh_dlsym jumps to dlsym with the caller's
 * return address still on the stack, untouched (so such pointers bypass the hooks). */
static void *mh_dlsym_c(void *h, const char *name);
__attribute__((visibility("hidden"))) void *xccl_mh_dlsym(void *h, const char *name);
#if defined(__x86_64__)
__asm__(".text\n"
        ".globl xccl_mh_dlsym\n"
        ".hidden xccl_mh_dlsym\n"
        ".type xccl_mh_dlsym, @function\n"
        "xccl_mh_dlsym:\n"
        "    test %rdi, %rdi\n"
        "    je 1f\n"
        "    cmp $-1, %rdi\n"
        "    je 1f\n"
        "    jmp mh_dlsym_c\n"
        "1:  jmp *xccl_mh_real_dlsym(%rip)\n"
        ".size xccl_mh_dlsym, .-xccl_mh_dlsym\n");
#elif defined(__aarch64__)
__asm__(".text\n"
        ".globl xccl_mh_dlsym\n"
        ".hidden xccl_mh_dlsym\n"
        ".type xccl_mh_dlsym, %function\n"
        "xccl_mh_dlsym:\n"
        "    cbz x0, 1f\n"
        "    cmn x0, #1\n"
        "    b.eq 1f\n"
        "    b mh_dlsym_c\n"
        "1:  adrp x16, xccl_mh_real_dlsym\n"
        "    ldr x16, [x16, :lo12:xccl_mh_real_dlsym]\n"
        "    br x16\n"
        ".size xccl_mh_dlsym, .-xccl_mh_dlsym\n");
#endif

typedef struct hook {
    const char *name;
    void       *hook; /* the hook's address */
    void       *real; /* what to store in *real_fn */
    void       *real_fn;
} hook_t;

#define HOOK(n) {#n, NULL, NULL, &real_##n}
static hook_t hooks[] = {
    HOOK(free),    HOOK(realloc), HOOK(reallocarray), HOOK(munmap), HOOK(mremap),
    HOOK(madvise), HOOK(mmap),    HOOK(mmap64),       HOOK(shmdt),
    {"dlsym", NULL, NULL, &xccl_mh_real_dlsym}, /* last: not substituted in dlsym's answers */
};
#undef HOOK
enum { NHOOKS = sizeof(hooks) / sizeof(hooks[0]) };

static void hooks_fill_addrs(void)
{
    /* the conversions between function and object pointers POSIX guarantees for dlsym */
    void *h[NHOOKS];
    void (*fns[NHOOKS])(void);
    fns[0] = (void (*)(void))mh_free;
    fns[1] = (void (*)(void))mh_realloc;
    fns[2] = (void (*)(void))mh_reallocarray;
    fns[3] = (void (*)(void))mh_munmap;
    fns[4] = (void (*)(void))mh_mremap;
    fns[5] = (void (*)(void))mh_madvise;
    fns[6] = (void (*)(void))mh_mmap;
    fns[7] = (void (*)(void))mh_mmap64;
    fns[8] = (void (*)(void))mh_shmdt;
#if MH_SUPPORTED
    fns[9] = (void (*)(void))xccl_mh_dlsym;
#else
    fns[9] = NULL;
#endif
    memcpy(h, fns, sizeof(h));
    for (int i = 0; i < NHOOKS; i++) hooks[i].hook = h[i];
}

__attribute__((used)) static void *mh_dlsym_c(void *h, const char *name)
{
    void *r = xccl_mh_real_dlsym(h, name);

    for (int i = 0; r != NULL && i < NHOOKS - 1; i++) {
        if (r == hooks[i].real) return hooks[i].hook;
    }
    return r;
}

/* ---- patching -------------------------------------------------------------------------------- */

typedef struct map_range {
    uintptr_t start, end;
    int       prot;
} map_range_t;

typedef struct pass {
    map_range_t   *maps;
    size_t         nmaps;
    long           page;
    int            slots, objects, failed, retry;
    unsigned long  adds;
} pass_t;

static atomic_int  st_objects, st_slots, st_failed;
static atomic_int  active;
static atomic_ulong patched_adds; /* dlpi_adds at the last pass */

/* Reads /proc/self/maps into p->maps (malloc'd). 0 on success. */
static int maps_read(pass_t *p)
{
    int    fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    char   buf[8192];
    size_t have = 0, cap = 0;
    int    at_line = 1;
    char   line[256];
    size_t ll = 0;

    p->maps  = NULL;
    p->nmaps = 0;
    if (fd < 0) return -1;
    for (;;) {
        ssize_t got = read(fd, buf, sizeof(buf));
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) break;
        for (ssize_t i = 0; i < got; i++) {
            char c = buf[i];
            if (c != '\n') {
                if (at_line && ll < sizeof(line) - 1) line[ll++] = c;
                continue;
            }
            line[ll] = '\0';
            ll       = 0;
            {
                char              *e;
                unsigned long long s = strtoull(line, &e, 16), t;
                if (*e != '-') continue;
                t = strtoull(e + 1, &e, 16);
                if (*e != ' ' || e[1] == '\0' || e[2] == '\0' || e[3] == '\0') continue;
                if (have == cap) {
                    size_t       nc = cap ? cap * 2 : 256;
                    map_range_t *m  = realloc(p->maps, nc * sizeof(*m));
                    if (m == NULL) {
                        close(fd);
                        return -1;
                    }
                    p->maps = m;
                    cap     = nc;
                }
                p->maps[have].start = (uintptr_t)s;
                p->maps[have].end   = (uintptr_t)t;
                p->maps[have].prot  = (e[1] == 'r' ? PROT_READ : 0) |
                                     (e[2] == 'w' ? PROT_WRITE : 0) |
                                     (e[3] == 'x' ? PROT_EXEC : 0);
                have++;
            }
        }
    }
    close(fd);
    p->nmaps = have;
    return have > 0 ? 0 : -1;
}

static int prot_of(const pass_t *p, uintptr_t addr)
{
    size_t lo = 0, hi = p->nmaps;

    while (lo < hi) { /* the lines are sorted by address */
        size_t mid = lo + (hi - lo) / 2;
        if (p->maps[mid].end <= addr) lo = mid + 1;
        else hi = mid;
    }
    if (lo < p->nmaps && p->maps[lo].start <= addr) return p->maps[lo].prot;
    return -1;
}

/* Writes hook into *slot. 1: written, 0: already there, -1: failed. */
static int patch_slot(pass_t *p, void **slot, void *hook)
{
    uintptr_t page = (uintptr_t)slot & ~((uintptr_t)p->page - 1);
    int       prot;

    if (__atomic_load_n(slot, __ATOMIC_RELAXED) == hook) return 0;
    prot = prot_of(p, (uintptr_t)slot);
    if (prot < 0) { /* mapped after /proc/self/maps was read: the next pass */
        p->retry++;
        return 0;
    }
    if (!(prot & PROT_WRITE) && mprotect((void *)page, (size_t)p->page, prot | PROT_WRITE) != 0)
        return -1;
    __atomic_store_n(slot, hook, __ATOMIC_RELEASE);
    if (!(prot & PROT_WRITE)) (void)mprotect((void *)page, (size_t)p->page, prot);
    return 1;
}

static int skip_object(const char *name)
{
    static const char *const skip[] = {"linux-vdso", "linux-gate", "/ld-linux", "/ld64.so",
                                       "/libc.so",   "libasan.so", "libtsan.so", "liblsan.so",
                                       "libubsan.so", "libhwasan.so", "vgpreload"};

    if (name == NULL) return 0;
    for (size_t i = 0; i < sizeof(skip) / sizeof(skip[0]); i++) {
        if (strstr(name, skip[i]) != NULL) return 1;
    }
    return 0;
}

static void patch_relocs(pass_t *p, uintptr_t base, const ElfW(Rela) * rel, size_t nrel,
                         const ElfW(Sym) * sym, const char *str, int *nhit)
{
    for (size_t i = 0; i < nrel; i++) {
        unsigned long type = ELF64_R_TYPE(rel[i].r_info);
        const char   *name;
        if (type != MH_R_JUMP_SLOT && type != MH_R_GLOB_DAT) continue;
        name = str + sym[ELF64_R_SYM(rel[i].r_info)].st_name;
        for (int h = 0; h < NHOOKS; h++) {
            int r;
            if (strcmp(name, hooks[h].name) != 0) continue;
            r = patch_slot(p, (void **)(base + rel[i].r_offset), hooks[h].hook);
            if (r < 0) p->failed++;
            if (r > 0) {
                p->slots++;
                (*nhit)++;
            }
            break;
        }
    }
}

static int patch_object(struct dl_phdr_info *info, size_t size, void *arg)
{
    pass_t          *p    = arg;
    uintptr_t        base = (uintptr_t)info->dlpi_addr;
    const ElfW(Dyn) *dyn  = NULL;
    const ElfW(Sym) *sym  = NULL;
    const char      *str  = NULL;
    const ElfW(Rela) *jmprel = NULL, *rela = NULL;
    size_t           jmpsz = 0, relasz = 0, relaent = sizeof(ElfW(Rela));
    int              nhit = 0;

    if (size >= offsetof(struct dl_phdr_info, dlpi_subs) && info->dlpi_adds > p->adds)
        p->adds = info->dlpi_adds;
    if (skip_object(info->dlpi_name)) return 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(base + info->dlpi_phdr[i].p_vaddr);
    }
    if (dyn == NULL) return 0;
    for (const ElfW(Dyn) *d = dyn; d->d_tag != DT_NULL; d++) {
        /* the loader has made most of these absolute; the vDSO's and some others are not */
        uintptr_t v = (uintptr_t)d->d_un.d_ptr;
        uintptr_t a = v < base ? v + base : v;
        switch (d->d_tag) {
        case DT_SYMTAB: sym = (const ElfW(Sym) *)a; break;
        case DT_STRTAB: str = (const char *)a; break;
        case DT_JMPREL: jmprel = (const ElfW(Rela) *)a; break;
        case DT_PLTRELSZ: jmpsz = (size_t)d->d_un.d_val; break;
        case DT_RELA: rela = (const ElfW(Rela) *)a; break;
        case DT_RELASZ: relasz = (size_t)d->d_un.d_val; break;
        case DT_RELAENT: relaent = (size_t)d->d_un.d_val; break;
        case DT_PLTREL:
            if (d->d_un.d_val != DT_RELA) return 0; /* not the RELA form this code reads */
            break;
        default: break;
        }
    }
    if (sym == NULL || str == NULL || relaent != sizeof(ElfW(Rela))) return 0;
    if (jmprel != NULL) patch_relocs(p, base, jmprel, jmpsz / sizeof(ElfW(Rela)), sym, str, &nhit);
    if (rela != NULL) patch_relocs(p, base, rela, relasz / sizeof(ElfW(Rela)), sym, str, &nhit);
    p->objects += nhit > 0;
    return 0;
}

/* Passes over every loaded object until one finds every mapping it patches in its snapshot of
 * /proc/self/maps (an object loaded meanwhile is not). Returns the number of slots that could
 * not be written (mprotect refused), -1 if the maps cannot be read. */
static int patch_all(void)
{
    long page = sysconf(_SC_PAGESIZE);
    int  failed = 0;

    for (int tries = 0; tries < 4; tries++) {
        pass_t p = {0};
        p.page   = page > 0 ? page : 4096;
        if (maps_read(&p) != 0) {
            free(p.maps);
            XCCL_WARN("memory hooks: cannot read /proc/self/maps");
            return -1;
        }
        dl_iterate_phdr(patch_object, &p);
        free(p.maps);
        atomic_fetch_add(&st_objects, p.objects);
        atomic_fetch_add(&st_slots, p.slots);
        atomic_fetch_add(&st_failed, p.failed);
        failed += p.failed;
        if (p.retry == 0) {
            atomic_store(&patched_adds, p.adds);
            return failed;
        }
    }
    atomic_store(&patched_adds, 0); /* the next drain tries again */
    return failed;
}

static int adds_of(struct dl_phdr_info *info, size_t size, void *arg)
{
    *(unsigned long *)arg =
        size >= offsetof(struct dl_phdr_info, dlpi_subs) ? info->dlpi_adds : 0;
    return 1; /* the first object carries the counters */
}

static unsigned long adds_now(void)
{
    unsigned long adds = 0;

    dl_iterate_phdr(adds_of, &adds);
    return adds;
}

/* ---- what the hooks call ------------------------------------------------------------------- */

/* The main program's loaded segments (the first object dl_iterate_phdr reports). */
typedef struct main_prog {
    uintptr_t lo, hi;
} main_prog_t;

static int main_of(struct dl_phdr_info *info, size_t size, void *arg)
{
    main_prog_t *m = arg;

    (void)size;
    m->lo = UINTPTR_MAX;
    m->hi = 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_LOAD) continue;
        if (info->dlpi_addr + ph->p_vaddr < m->lo) m->lo = info->dlpi_addr + ph->p_vaddr;
        if (info->dlpi_addr + ph->p_vaddr + ph->p_memsz > m->hi)
            m->hi = info->dlpi_addr + ph->p_vaddr + ph->p_memsz;
    }
    return 1;
}

typedef struct obj_list {
    const char *name[512];
    int         n;
} obj_list_t;

static int list_of(struct dl_phdr_info *info, size_t size, void *arg)
{
    obj_list_t *l = arg;

    (void)size;
    if (l->n == 512) return 1;
    l->name[l->n++] = info->dlpi_name;
    return 0;
}

/* The function `name` that calls through a PLT bind to. dlsym(RTLD_DEFAULT) gives it, except in
 * a main program built without -fpie that takes the function's address: that program defines
 * the symbol as its own PLT entry (the "canonical PLT", for pointer equality), which jumps
 * through the program's GOT slot, the one the hook is written to: calling it from the hook
 * would call the hook. The real one is then the first definition in the objects after the
 * program, in the order symbol lookup takes (dl_iterate_phdr's): each object's own. */
static void *resolve_real(const char *name)
{
    void       *r = dlsym(RTLD_DEFAULT, name);
    main_prog_t m = {0};
    obj_list_t *l;

    if (r == NULL) return NULL;
    dl_iterate_phdr(main_of, &m);
    if ((uintptr_t)r < m.lo || (uintptr_t)r >= m.hi) return r;
    l = calloc(1, sizeof(*l));
    if (l == NULL) return NULL;
    dl_iterate_phdr(list_of, l);
    r = NULL;
    for (int i = 1; i < l->n && r == NULL; i++) {
        void   *h, *v;
        Dl_info info;
        if (l->name[i] == NULL || l->name[i][0] == '\0' ||
            strstr(l->name[i], "linux-vdso") != NULL || strstr(l->name[i], "linux-gate") != NULL)
            continue; /* the program, the vDSO */
        h = dlopen(l->name[i], RTLD_LAZY | RTLD_NOLOAD);
        if (h == NULL) continue;
        v = dlsym(h, name);
        if (v != NULL && dladdr(v, &info) != 0 && info.dli_fname != NULL &&
            strcmp(info.dli_fname, l->name[i]) == 0)
            r = v;
        dlclose(h);
    }
    free(l);
    return r;
}

static pthread_once_t start_once = PTHREAD_ONCE_INIT;

static void start(void)
{
    const char *env = getenv("XCCL_MEM_HOOKS");
    int         missing = 0, failed;

    if (env != NULL && strcmp(env, "0") == 0) {
        XCCL_INFO("memory hooks off (XCCL_MEM_HOOKS=0): registrations are not kept beyond "
                  "their use");
        return;
    }
    if (!MH_SUPPORTED) {
        XCCL_INFO("memory hooks: not supported on this architecture; registrations are not "
                  "kept beyond their use");
        return;
    }
    hooks_fill_addrs();
    {
        void *u = resolve_real("malloc_usable_size");
        memcpy(&real_usable, &u, sizeof(u));
        missing += u == NULL;
    }
    for (int i = 0; i < NHOOKS; i++) {
        void *r       = resolve_real(hooks[i].name);
        hooks[i].real = r;
        if (r == NULL || r == hooks[i].hook) {
            XCCL_WARN("memory hooks: %s not found; registrations are not kept beyond their use",
                      hooks[i].name);
            missing++;
            continue;
        }
        memcpy(hooks[i].real_fn, &r, sizeof(r)); /* real_<name> = r */
    }
    if (missing) return;
    if (pthread_atfork(w_prepare, w_release, w_release) != 0) {
        XCCL_WARN("memory hooks: pthread_atfork failed; registrations are not kept beyond their "
                  "use");
        return;
    }
    failed = patch_all();
    if (failed != 0 || atomic_load(&st_slots) == 0) {
        /* the slots written stay (their hooks are correct); the caches do not rely on them */
        XCCL_WARN("memory hooks: %d GOT slot(s) could not be patched (%d were); registrations "
                  "are not kept beyond their use",
                  failed, atomic_load(&st_slots));
        return;
    }
    XCCL_INFO("memory hooks: %d slot(s) patched in %d object(s)", atomic_load(&st_slots),
              atomic_load(&st_objects));
    atomic_store(&active, 1);
}

int xccl_memhook_start(void)
{
    pthread_once(&start_once, start);
    return atomic_load(&active);
}

void xccl_memhook_cursor_init(xccl_memhook_cursor_t *cur)
{
    cur->ev   = atomic_load_explicit(&ev_head, memory_order_acquire);
    cur->adds = atomic_load(&active) ? adds_now() : 0;
}

int xccl_memhook_drain(xccl_memhook_cursor_t *cur,
                       void (*fn)(void *arg, uintptr_t start, uintptr_t end), void *arg)
{
    uint64_t      h = atomic_load_explicit(&ev_head, memory_order_acquire), t = cur->ev;
    unsigned long adds;
    int           lost = 0;

    if (!atomic_load_explicit(&active, memory_order_relaxed)) return 0;
    adds = adds_now();
    if (adds != cur->adds) { /* objects loaded: patch them, and what they freed is unknown */
        if (adds != atomic_load(&patched_adds) && patch_all() != 0)
            XCCL_WARN("memory hooks: some GOT slots of a newly loaded object could not be "
                      "patched: frees through them are not seen");
        cur->adds = adds;
        lost      = 1;
        h         = atomic_load_explicit(&ev_head, memory_order_acquire);
    }
    if (h - t > LOG_N) lost = 1;
    for (; !lost && t != h; t++) {
        ev_t    *v    = &ev_log[t & (LOG_N - 1)];
        uint64_t want = 2 * t + 2;
        for (int spins = 0;; spins++) {
            uint64_t  s1 = atomic_load_explicit(&v->seq, memory_order_acquire), s2;
            uintptr_t a, b;
            if (s1 == want) {
                a = atomic_load_explicit(&v->start, memory_order_relaxed);
                b = atomic_load_explicit(&v->end, memory_order_relaxed);
                atomic_thread_fence(memory_order_acquire);
                s2 = atomic_load_explicit(&v->seq, memory_order_relaxed);
                if (s2 != want) lost = 1;
                else fn(arg, a, b);
                break;
            }
            if (s1 > want || spins >= SPIN_MAX) { /* wrapped, or a writer that does not finish */
                lost = 1;
                break;
            }
            if (spins > 64) sched_yield();
        }
    }
    cur->ev = h;
    return lost ? -1 : 0;
}

void xccl_memhook_stats(xccl_memhook_stats_t *out)
{
    out->active  = atomic_load(&active);
    out->objects = atomic_load(&st_objects);
    out->slots   = atomic_load(&st_slots);
    out->failed  = atomic_load(&st_failed);
    out->events  = atomic_load(&ev_head);
}
