"""Flat versus two-level all_reduce and broadcast on 2 hosts x 2 ranks with shaped links.

    sudo tests/hosts/flat_vs_two_level.py                     # 200mbit links, docs/img/
    sudo tests/hosts/flat_vs_two_level.py --rate 1gbit --reps 7 --out-dir /tmp/fig

The driver runs itself as a job through ``tests/hosts/run.sh --hosts 2 --ranks-per-host 2
--rate RATE`` (network-namespace hosts: shared memory inside a host, TCP over a token-bucket
shaped veth link between them). In the job every rank times each algorithm of all_reduce
(flat: ring, rd, rabenseifner, direct; two-level: hier, hier_rs) and of broadcast (flat:
binomial, chain, scatter_allgather; two-level: hier) over a range of sizes: the median of
``--reps`` timed calls (4x as many below 256 KiB) after one warm-up, each call bracketed
by barriers, the time being the slowest rank's. Every result is checked against numpy. It
also records what the selector picks (xccl.explain's chosen) at each size. The driver then writes
``hosts_flat_vs_two_level.md`` (the table) and ``hosts_flat_vs_two_level.png`` (the figure)
into ``--out-dir`` (default docs/img) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SIZES = [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22]  # bytes (float32)
ALGOS = {
    "all_reduce": (["ring", "rd", "rabenseifner", "direct"], ["hier", "hier_rs"]),
    "broadcast": (["binomial", "chain", "scatter_allgather"], ["hier"]),
}


# --------------------------------------------------------------------------- the job


def _time_call(xccl: Any, coll: str, algo: str, buf: Any, reps: int) -> float:
    """Median over ``reps`` of the slowest rank's time for one call (after a warm-up)."""
    import numpy as np

    times = []
    for i in range(reps + 1):
        xccl.barrier()
        t0 = time.perf_counter()
        if coll == "all_reduce":
            xccl.all_reduce(buf, algo=algo)
        else:
            xccl.broadcast(buf, src=0, algo=algo)
        dt = np.array([time.perf_counter() - t0])
        xccl.all_reduce(dt, op=xccl.ReduceOp.MAX)
        if i > 0:
            times.append(float(dt[0]))
    return statistics.median(times)


def job(out: str, reps: int) -> None:
    """One rank of the measurement job; rank 0 writes the rows to ``out`` (JSON)."""
    import numpy as np

    import xccl

    xccl.init_process_group("auto", timeout=300)
    rank, world = xccl.get_rank(), xccl.get_world_size()
    rows = []
    for coll, (flat, two) in ALGOS.items():
        for nbytes in SIZES:
            n = nbytes // 4
            chosen = xccl.explain(coll, nbytes).chosen["name"]
            for algo in flat + two:
                buf = np.full(n, float(rank + 1), np.float32)
                if coll == "broadcast" and rank != 0:
                    buf[:] = -1
                # small calls are short and noisy on a shared machine: more of them
                t = _time_call(xccl, coll, algo, buf, reps if nbytes >= 1 << 18 else 4 * reps)
                # broadcast leaves rank 0's 1.0 everywhere; the timed all_reduces compound, so
                # one more call from fresh data is checked
                s = world * (world + 1) / 2
                if coll == "broadcast":
                    np.testing.assert_array_equal(buf, np.ones(n, np.float32))
                else:
                    check = np.full(n, float(rank + 1), np.float32)
                    xccl.all_reduce(check, algo=algo)
                    np.testing.assert_array_equal(check, np.full(n, s, np.float32))
                rows.append({"coll": coll, "bytes": nbytes, "algo": algo, "seconds": t,
                             "two_level": algo in two, "chosen": algo == chosen})
    if rank == 0:
        Path(out).write_text(json.dumps(rows, indent=1))
    xccl.destroy_process_group()


# --------------------------------------------------------------------------- the driver


def _fmt_bytes(n: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n // k} {unit}"
    return f"{n} B"


def table(rows: list[dict[str, Any]], rate: str) -> str:
    """The rows as a markdown table: one line per collective and size, ms per algorithm."""
    lines = [f"Time per call (ms, median, slowest rank) on 2 hosts x 2 ranks, links shaped to "
             f"{rate}; `*` marks the selector's choice, **bold** the fastest.", ""]
    for coll, (flat, two) in ALGOS.items():
        algos = flat + two
        lines.append(f"| {coll} | " + " | ".join(
            f"{a} (two-level)" if a in two else a for a in algos) + " |")
        lines.append("|---" * (len(algos) + 1) + "|")
        for nbytes in SIZES:
            cell = {r["algo"]: r for r in rows if r["coll"] == coll and r["bytes"] == nbytes}
            best = min(cell.values(), key=lambda r: r["seconds"])["algo"]
            out = []
            for a in algos:
                txt = f"{cell[a]['seconds'] * 1e3:.2f}" + ("*" if cell[a]["chosen"] else "")
                out.append(f"**{txt}**" if a == best else txt)
            lines.append(f"| {_fmt_bytes(nbytes)} | " + " | ".join(out) + " |")
        lines.append("")
    return "\n".join(lines)


def figure(rows: list[dict[str, Any]], rate: str, path: Path) -> None:
    """Two panels (all_reduce, broadcast): time against size, flat dashed, two-level solid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (coll, (flat, two)) in zip(axes, ALGOS.items(), strict=True):
        for algo in flat + two:
            pts = sorted((r["bytes"], r["seconds"]) for r in rows
                         if r["coll"] == coll and r["algo"] == algo)
            ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts],
                    "-o" if algo in two else "--.", lw=2 if algo in two else 1,
                    label=f"{algo} (two-level)" if algo in two else algo)
        picks = sorted((r["bytes"], r["seconds"]) for r in rows
                       if r["coll"] == coll and r["chosen"])
        ax.scatter([p[0] for p in picks], [p[1] * 1e3 for p in picks], s=160,
                   facecolors="none", edgecolors="k", label="selector's choice", zorder=5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("time per call (ms)")
        ax.set_title(f"{coll}: 2 hosts x 2 ranks, {rate} links")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", default="200mbit", help="tc rate of every host's link")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per point (median)")
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "img"))
    ap.add_argument("--job", metavar="JSON", help=argparse.SUPPRESS)  # inside run.sh
    args = ap.parse_args()
    if args.job:
        job(args.job, args.reps)
        return 0
    with tempfile.TemporaryDirectory(prefix="xh-fig-") as tmp:
        os.chmod(tmp, 0o777)
        out = Path(tmp) / "rows.json"
        env = dict(os.environ, PYTHON=sys.executable)
        cmd = ["bash", str(HERE / "run.sh"), "--hosts", "2", "--ranks-per-host", "2",
               "--rate", args.rate, "--timeout", "900", "--", str(Path(__file__).resolve()),
               "--job", str(out), "--reps", str(args.reps)]
        rc = subprocess.run(cmd, env=env).returncode
        if rc != 0 or not out.exists():
            print(f"flat_vs_two_level: the job failed (exit {rc})", file=sys.stderr)
            return rc or 1
        rows = json.loads(out.read_text())
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = table(rows, args.rate)
    (out_dir / "hosts_flat_vs_two_level.md").write_text(text + "\n")
    figure(rows, args.rate, out_dir / "hosts_flat_vs_two_level.png")
    print(text)
    print(f"wrote {out_dir / 'hosts_flat_vs_two_level.md'} and "
          f"{out_dir / 'hosts_flat_vs_two_level.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
