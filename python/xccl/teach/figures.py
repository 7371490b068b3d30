"""Draws the README's pictures from a real run on this machine.

    python -m xccl.teach.figures --out docs/img

- ``ring_allreduce_schedule.png``: a traced ring all-reduce of 16 floats on 4 ranks, one
  panel per step (who sends which chunk to whom; filled ranks reduced in that step);
- ``allreduce_predicted_vs_measured.png``: all-reduce times of ring, recursive doubling and
  recursive halving-doubling (Rabenseifner) on 4 ranks from 64 B to 4 MiB, against the α-β
  model fitted to those measurements, with the predicted crossover marked.

Needs matplotlib and numpy; takes about half a minute on two cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

SCHEDULE_PNG = "ring_allreduce_schedule.png"
BENCH_PNG = "allreduce_predicted_vs_measured.png"


def _traced_ring(count: int) -> Any:
    """Rank body: one traced ring all-reduce; rank 0 returns every rank's records."""
    import numpy as np

    import xccl
    from xccl.trace import trace

    x = np.arange(count, dtype=np.float32) + xccl.get_rank()
    with trace() as t:
        xccl.all_reduce(x, algo="ring")
    return t.to_records() if xccl.get_rank() == 0 else None


def schedule_figure(out: str, nprocs: int = 4, count: int = 16, transport: Optional[str] = None
                    ) -> str:
    """Runs and draws the ring all-reduce schedule; returns the file written."""
    from xccl.launch import launch
    from xccl.trace import Trace

    records = launch(_traced_ring, nprocs, count, transport=transport, timeout=120)[0]
    fig = Trace.from_records(records).plot_schedule(
        title=f"ring all-reduce of {count} float32 on {nprocs} ranks, traced: reduce-scatter "
              f"(steps 0-{nprocs - 2}, filled = reduced) then all-gather")
    path = os.path.join(out, SCHEDULE_PNG)
    fig.savefig(path, dpi=110)
    return path


def bench_figure(out: str, nprocs: int = 4, sizes: Optional[Sequence[int]] = None,
                 transport: Optional[str] = None) -> tuple[str, Any]:
    """Measures, fits and draws measured against predicted; returns (file, BenchResult)."""
    from xccl.teach.bench import bench

    sizes = list(sizes or [1 << k for k in range(6, 23, 2)])
    result = bench("all_reduce", sizes, ["ring", "rd", "rabenseifner"], nprocs=nprocs,
                   transport=transport)
    ax = result.plot()
    path = os.path.join(out, BENCH_PNG)
    ax.figure.savefig(path, dpi=110)
    return path, result


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xccl.teach.figures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/img", help="directory for the PNG files")
    parser.add_argument("--nprocs", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--transport", default=None, help="auto (default), tcp or shm")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()
    path = schedule_figure(args.out, args.nprocs, transport=args.transport)
    print(f"wrote {path}")
    path, result = bench_figure(args.out, args.nprocs, transport=args.transport)
    print(result)
    for transport, model in result.fit().items():
        print(f"fit over {transport}: {model}")
    print(f"wrote {path} ({time.monotonic() - t0:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
