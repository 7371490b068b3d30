"""What tracing costs: all_reduce time with tracing off and on, in interleaved blocks.

    python benchmarks/trace_overhead.py [--np 2] [--sizes 8,65536,1048576] [--reps 7]

Each rank alternates blocks of calls with tracing off and on (``with xccl.trace()``, records
kept on each rank, not gathered), `reps` blocks of each, so drifts of a shared machine hit
both alike. Printed per size: the median time per call of the off and on blocks, the spread
of the off blocks (max/min - 1: what "measurable" means on this machine), and the cost of
tracing on. With tracing off the engine's only extra work is one test of the communicator's
trace capacity per message and per reduction, so off is the baseline: the table shows how
far "on" is from it, and how noisy the baseline is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any


def _body(sizes: list[int], reps: int, min_block_s: float) -> list[dict[str, Any]]:
    import time

    import numpy as np

    import xccl

    rows = []
    for nbytes in sizes:
        x = np.ones(max(1, nbytes // 4), np.float32)
        # calibrate the block length on rank 0's timing, shared so every rank runs alike
        iters = 10
        while True:
            xccl.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                xccl.all_reduce(x)
            dt = time.perf_counter() - t0
            flag = np.array([1.0 if dt >= min_block_s else 0.0])
            xccl.broadcast(flag, src=0)
            if flag[0] or iters >= 1 << 20:
                break
            iters *= 2
        off, on = [], []
        for _ in range(reps):
            for mode in ("off", "on"):
                xccl.barrier()
                if mode == "on":
                    with xccl.trace(gather=False, capacity=8 * iters + 64):
                        t0 = time.perf_counter()
                        for _ in range(iters):
                            xccl.all_reduce(x)
                        dt = time.perf_counter() - t0
                else:
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        xccl.all_reduce(x)
                    dt = time.perf_counter() - t0
                (on if mode == "on" else off).append(dt / iters)
        rows.append({"bytes": nbytes, "iters": iters, "off": off, "on": on})
    return rows


def main(argv: Any = None) -> int:
    """Runs the comparison on local ranks and prints a markdown table (and JSON if asked)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--sizes", default="8,65536,1048576", help="bytes, comma-separated")
    ap.add_argument("--reps", type=int, default=7, help="blocks of each mode (default 7)")
    ap.add_argument("--block", type=float, default=0.2, help="seconds per block (default 0.2)")
    ap.add_argument("--transport", default="shm", help="xccl transport (default shm)")
    ap.add_argument("--json", help="also write the raw block times here")
    args = ap.parse_args(argv)

    import xccl

    sizes = [int(s) for s in args.sizes.split(",") if s]
    results = xccl.launch(
        _body, args.np, sizes, args.reps, args.block, transport=args.transport, timeout=600
    )
    rows = results[0]
    print(f"all_reduce float32, np={args.np}, transport={args.transport}, {args.reps} blocks each")
    print()
    print("| size (B) | calls/block | off (µs) | off spread | on (µs) | on vs off |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        off = statistics.median(r["off"]) * 1e6
        on = statistics.median(r["on"]) * 1e6
        spread = max(r["off"]) / min(r["off"]) - 1
        print(
            f"| {r['bytes']} | {r['iters']} | {off:.2f} | {spread * 100:.1f} % | {on:.2f} "
            f"| {(on / off - 1) * 100:+.1f} % |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
