"""Draws the README's pictures from a real run on this machine.

    python -m xccl.teach.figures --out docs/img

- ``ring_allreduce_schedule.png``: a traced ring all-reduce of 16 floats on 4 ranks, one
  panel per step (who sends which chunk to whom; filled ranks reduced in that step);
- ``schedule_<collective>_<algorithm>.png`` (see ``ALGO_FIGURES``): the same picture for
  every other algorithm of docs/algorithms.md, each traced on 4 ranks; the ``hier``
  algorithms and ``hier_rs`` on one machine split into two "hosts" of two ranks with
  ``$XCCL_HOST_ID``;
- ``allreduce_predicted_vs_measured.png``: all-reduce times of ring, recursive doubling and
  recursive halving-doubling (Rabenseifner) on 4 ranks from 64 B to 4 MiB, against the α-β
  model fitted to those measurements, with the predicted crossover marked.

``--schedules`` draws only the schedule figures (no benchmark, so the files do not depend on
the machine's speed). Needs matplotlib and numpy; takes about half a minute on two cores.
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

# (collective, algorithm) of every schedule figure besides SCHEDULE_PNG, drawn into
# schedule_<collective>_<algorithm>.png; the ones in SPLIT_HOSTS run on ranks split into two
# "hosts" (ranks 0-1 and 2-3), as a two-level algorithm needs.
ALGO_FIGURES: tuple[tuple[str, str], ...] = (
    ("all_reduce", "rd"),
    ("all_reduce", "rabenseifner"),
    ("all_reduce", "direct"),
    ("all_reduce", "owner"),
    ("all_reduce", "hier"),
    ("all_reduce", "hier_rs"),
    ("broadcast", "binomial"),
    ("broadcast", "linear"),
    ("broadcast", "scatter_allgather"),
    ("broadcast", "chain"),
    ("broadcast", "hier"),
    ("reduce", "binomial"),
    ("reduce", "linear"),
    ("all_gather", "ring"),
    ("all_gather", "rd"),
    ("all_gather", "bruck"),
    ("all_gather", "direct"),
    ("gather", "binomial"),
    ("gather", "linear"),
    ("scatter", "binomial"),
    ("scatter", "linear"),
    ("reduce_scatter", "ring"),
    ("reduce_scatter", "rhd"),
    ("reduce_scatter", "direct"),
    ("reduce_scatter", "owner"),
    ("all_to_all", "pairwise"),
    ("all_to_all", "bruck"),
    ("all_to_all", "linear"),
    ("all_to_all_v", "pairwise"),
    ("all_to_all_v", "linear"),
    ("barrier", "dissemination"),
    ("barrier", "linear"),
)
SPLIT_HOSTS = {("all_reduce", "hier"), ("all_reduce", "hier_rs"), ("broadcast", "hier")}
# the pipelined chain in chunks of 16 B (4 float32), so that 16 floats make 4 chunks
SMALL_CHUNKS = {("broadcast", "chain")}
ALGO_DPI = 72


def _traced_ring(count: int) -> Any:
    """Rank body: one traced ring all-reduce; rank 0 returns every rank's records."""
    import numpy as np

    import xccl
    from xccl.trace import trace

    x = np.arange(count, dtype=np.float32) + xccl.get_rank()
    with trace() as t:
        xccl.all_reduce(x, algo="ring")
    return t.to_records() if xccl.get_rank() == 0 else None


def algo_png(coll: str, algo: str) -> str:
    """The file name of the schedule figure of `algo` for `coll`."""
    return f"schedule_{coll}_{algo}.png"


def _run_one(coll: str, algo: str, count: int) -> None:
    """One collective of `count` float32 (the whole vector, or the whole gathered buffer)."""
    import numpy as np

    import xccl

    n, rank = xccl.get_world_size(), xccl.get_rank()
    x = np.arange(count, dtype=np.float32) + rank
    if coll == "all_reduce":
        xccl.all_reduce(x, algo=algo)
    elif coll == "broadcast":
        xccl.broadcast(x, src=0, algo=algo)
    elif coll == "all_gather":
        xccl.all_gather([np.empty(count // n, np.float32) for _ in range(n)], x[:count // n],
                        algo=algo)
    elif coll == "reduce_scatter":
        xccl.reduce_scatter(np.empty(count // n, np.float32), list(x.reshape(n, -1)), algo=algo)
    elif coll == "all_to_all":
        xccl.all_to_all_single(np.empty_like(x), x, algo=algo)
    elif coll == "reduce":
        xccl.reduce(x, dst=0, algo=algo)
    elif coll == "gather":
        blocks = [np.empty(count // n, np.float32) for _ in range(n)] if rank == 0 else None
        xccl.gather(x[:count // n], blocks, dst=0, algo=algo)
    elif coll == "scatter":
        blocks = list(x.reshape(n, -1)) if rank == 0 else None
        xccl.scatter(np.empty(count // n, np.float32), blocks, src=0, algo=algo)
    elif coll == "all_to_all_v":  # rank r sends r + 1 elements to every rank
        ins, outs = [rank + 1] * n, [q + 1 for q in range(n)]
        xccl.all_to_all_single(np.empty(sum(outs), np.float32), x[:sum(ins)], outs, ins,
                               algo=algo)
    elif coll == "barrier":
        xccl.barrier(algo=algo)
    else:
        raise ValueError(f"no schedule figure for {coll}")


def _traced_algos(pairs: Sequence[tuple[str, str]], count: int, store: Optional[str] = None,
                  ) -> Any:
    """Rank body: each (collective, algorithm) traced on its own; rank 0 returns every rank's
    records per pair. With `store`, the rank first names its "host" (two ranks a host) and
    makes its own process group."""
    import xccl
    from xccl.trace import trace

    if store is not None:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        os.environ["XCCL_HOST_ID"] = f"host{rank // 2}"
        xccl.init_process_group("auto", init_method=f"file://{store}", rank=rank,
                                world_size=size, timeout=60)
    me = xccl.get_rank()
    out = {}
    for coll, algo in pairs:
        with trace() as t:
            _run_one(coll, algo, count)
        out[(coll, algo)] = t.to_records()
    if store is not None:
        xccl.destroy_process_group()
    return out if me == 0 else None


def algorithm_figures(out: str, nprocs: int = 4, count: int = 16,
                      transport: Optional[str] = None) -> list[str]:
    """Runs and draws every algorithm of ALGO_FIGURES; returns the files written."""
    import tempfile

    import matplotlib.pyplot as plt

    from xccl.launch import launch
    from xccl.teach import plots
    from xccl.trace import chunk_unit

    flat = [p for p in ALGO_FIGURES if p not in SPLIT_HOSTS | SMALL_CHUNKS]
    split = [p for p in ALGO_FIGURES if p in SPLIT_HOSTS]
    chunked = [p for p in ALGO_FIGURES if p in SMALL_CHUNKS]
    records = dict(launch(_traced_algos, nprocs, flat, count, transport=transport,
                          timeout=120)[0])
    if chunked:
        records.update(launch(_traced_algos, nprocs, chunked, count, transport=transport,
                              timeout=120, env={"XCCL_RING_CHUNK_BYTES": "16"})[0])
    if split:
        with tempfile.TemporaryDirectory() as tmp:
            records.update(launch(_traced_algos, nprocs, split, count,
                                  os.path.join(tmp, "store"), init=False, timeout=120)[0])
    paths = []
    for coll, algo in ALGO_FIGURES:
        how = ", 2 hosts" if (coll, algo) in SPLIT_HOSTS else ""
        # in a fixed order (Trace.plot_schedule would sort them by time), so that overlapping
        # arrows are drawn alike and the file is the same from run to run
        recs = sorted(records[(coll, algo)], key=lambda r: tuple(
            str(r.get(k)) for k in ("kind", "rank", "step", "src", "dst", "offset", "nbytes")))
        how += f"; chunk c = {chunk_unit([r for r in recs if r['kind'] == 'send'])} B"
        fig = plots.plot_schedule(
            recs, title=f"{coll} {algo}: {count} float32, {nprocs} ranks{how} (traced)")
        width, height = fig.get_size_inches()
        if width < 5:  # one or two panels: room for the title
            fig.set_size_inches(5, height)
            fig.tight_layout()
        path = os.path.join(out, algo_png(coll, algo))
        fig.savefig(path, dpi=ALGO_DPI)
        plt.close(fig)
        paths.append(path)
    return paths


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
    parser.add_argument("--schedules", action="store_true",
                        help="only the schedule figures (no benchmark)")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()
    path = schedule_figure(args.out, args.nprocs, transport=args.transport)
    print(f"wrote {path}")
    for path in algorithm_figures(args.out, args.nprocs, transport=args.transport):
        print(f"wrote {path}")
    if args.schedules:
        print(f"{time.monotonic() - t0:.0f} s in all")
        return 0
    path, result = bench_figure(args.out, args.nprocs, transport=args.transport)
    print(result)
    for transport, model in result.fit().items():
        print(f"fit over {transport}: {model}")
    print(f"wrote {path} ({time.monotonic() - t0:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
