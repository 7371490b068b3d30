/* SPDX-License-Identifier: Apache-2.0
 *
 * u64map.c - see u64map.h.
 */
#include "core/u64map.h"

#include <stdlib.h>

static size_t slot_of(uint64_t key, size_t cap)
{
    key ^= key >> 33; /* sequence numbers and small ids are not mixed: finish a murmur round */
    key *= 0xff51afd7ed558ccdull;
    key ^= key >> 33;
    return (size_t)key & (cap - 1);
}

void *xccl_u64map_get(const xccl_u64map_t *m, uint64_t key)
{
    if (m->cap == 0) return NULL;
    for (size_t i = slot_of(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == key) return m->vals[i];
        if (m->keys[i] == 0) return NULL;
    }
}

static int grow(xccl_u64map_t *m)
{
    size_t    cap  = m->cap ? m->cap * 2 : 16;
    uint64_t *keys = calloc(cap, sizeof(*keys));
    void    **vals = calloc(cap, sizeof(*vals));

    if (keys == NULL || vals == NULL) {
        free(keys);
        free(vals);
        return -1;
    }
    for (size_t j = 0; j < m->cap; j++) {
        size_t i;
        if (m->keys[j] == 0) continue;
        for (i = slot_of(m->keys[j], cap); keys[i] != 0; i = (i + 1) & (cap - 1)) {
        }
        keys[i] = m->keys[j];
        vals[i] = m->vals[j];
    }
    free(m->keys);
    free(m->vals);
    m->keys = keys;
    m->vals = vals;
    m->cap  = cap;
    return 0;
}

int xccl_u64map_put(xccl_u64map_t *m, uint64_t key, void *val)
{
    size_t i;

    if (m->cap > 0) { /* replacing never allocates */
        for (i = slot_of(key, m->cap); m->keys[i] != 0; i = (i + 1) & (m->cap - 1)) {
            if (m->keys[i] == key) {
                m->vals[i] = val;
                return 0;
            }
        }
    }
    if ((m->n + 1) * 4 > m->cap * 3 && grow(m) < 0) return -1;
    for (i = slot_of(key, m->cap); m->keys[i] != 0; i = (i + 1) & (m->cap - 1)) {
    }
    m->keys[i] = key;
    m->vals[i] = val;
    m->n++;
    return 0;
}

void *xccl_u64map_del(xccl_u64map_t *m, uint64_t key)
{
    size_t i, j, mask = m->cap - 1;
    void  *val;

    if (m->cap == 0) return NULL;
    for (i = slot_of(key, m->cap); m->keys[i] != key; i = (i + 1) & mask) {
        if (m->keys[i] == 0) return NULL;
    }
    val = m->vals[i];
    /* shift back every later entry of the run whose home slot does not lie in (i, j] */
    for (j = (i + 1) & mask; m->keys[j] != 0; j = (j + 1) & mask) {
        size_t home = slot_of(m->keys[j], m->cap);
        if (((j - home) & mask) >= ((j - i) & mask)) {
            m->keys[i] = m->keys[j];
            m->vals[i] = m->vals[j];
            i          = j;
        }
    }
    m->keys[i] = 0;
    m->vals[i] = NULL;
    m->n--;
    return val;
}

void xccl_u64map_free(xccl_u64map_t *m)
{
    free(m->keys);
    free(m->vals);
    m->keys = NULL;
    m->vals = NULL;
    m->cap  = 0;
    m->n    = 0;
}
