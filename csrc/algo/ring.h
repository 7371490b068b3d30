/* SPDX-License-Identifier: Apache-2.0
 *
 * ring.h - the pipelined ring reduce-scatter (reduce_scatter.c), the one schedule behind
 * reduce_scatter "ring" and the first n-1 steps of all_reduce "ring".
 *
 * The input is n blocks, each cut into the pipe's C chunks; the partial sums of block b travel
 * around the ring and end reduced at rank b. Chunk c of step s (s < n-1) is message s*C + c,
 * posted in the rounds of xccl_pat_pipe:
 *
 *   step s      send to r+1                         receive from r-1 -> stage, then
 *   0           input block r-1                     block r-2: partial = stage op input
 *   1 .. n-2    the partial of step s-1 (block      block r-s-2: partial = stage op input
 *               r-s-1)
 *
 * The partial of step n-2 is block r, complete. Where partials live:
 *   in_place  in the input blocks themselves (the input is writable, and block r ends there);
 *             the stage is C chunk slots.
 *   otherwise in the stage, two sets of C slots used by even and odd steps (a chunk can arrive
 *             while the previous step's partial of the same chunk is still being sent); the
 *             last step writes `out`. The input is only read, block r only by that last step,
 *             so `out` may even be block r.
 * Every element is combined once per step as (received partial) op (own input), so the result
 * is the same bits wherever it is copied to.
 */
#ifndef XCCL_ALGO_RING_H
#define XCCL_ALGO_RING_H

#include "algo/algo.h"
#include "algo/patterns.h"

typedef struct xccl_ring_rs {
    xccl_task_t    *t;
    char           *in;    /* the n input blocks (written only when in_place)              */
    char           *out;   /* block r's result (not in_place)                               */
    char           *stage; /* xccl_ring_rs_stage_bytes                                       */
    size_t          count; /* equal: elements per block; else elements of the whole vector  */
    size_t          es;
    int             equal; /* blocks of `count` elements; else the n blocks of xccl_pat_block */
    int             in_place;
    int             rank, size;
    xccl_pat_pipe_t pipe; /* its first n-1 steps are the reduce-scatter's                 */
} xccl_ring_rs_t;

/* Element count of chunk c of block b, and its offset (*off, elements) in the input. */
size_t        xccl_ring_rs_chunk(const xccl_ring_rs_t *x, int b, int c, size_t *off);
/* Bytes of stage the reduce-scatter needs. */
size_t        xccl_ring_rs_stage_bytes(const xccl_ring_rs_t *x);
/* Posts chunk c of step s (s < n-1). */
xccl_status_t xccl_ring_rs_post(const xccl_ring_rs_t *x, int s, int c);
/* Reduces the chunks received in pipe round j: those whose next step is posted in round j+1
 * when `urgent`, the others otherwise (the `reduce` of xccl_pat_pipe_run). */
xccl_status_t xccl_ring_rs_reduce(const xccl_ring_rs_t *x, int j, int urgent);

#endif /* XCCL_ALGO_RING_H */
