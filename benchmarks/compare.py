"""Same-host comparison of xccl with torch.distributed's gloo and with MPI, in one run.

    pip install -r benchmarks/requirements.txt      # mpi4py, matplotlib (+ an MPI, see below)
    python benchmarks/compare.py                    # np 2 and 4, 8 B .. 256 MiB (~10-15 min)
    python benchmarks/compare.py --quick            # fewer sizes, shorter loops (~2 min)

Systems, each run by the same harness (xccl.bench: same loop, same correctness check, same
nccl-tests formulas), one after the other on this machine:

=========  ===================================================================================
xccl-shm   ``xccl-bench --transport shm`` (XCCL_TRANSPORTS=shm: the shared-memory transport)
xccl-tcp   ``xccl-bench --transport tcp`` (loopback TCP only)
gloo       ``xccl-bench --backend gloo``: torch.distributed with gloo (TCP over loopback)
mpi-shm    ``mpirun --mca pml ob1 --mca btl self,vader benchmarks/mpi_bench.py`` (Open MPI)
mpi-tcp    ``mpirun --mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include lo ...``
=========  ===================================================================================

xccl and gloo get torch CPU tensors through the torch.distributed API (the same calls);
MPI gets the same kind of torch tensors, as numpy views, through mpi4py's buffer methods, so
that every system moves memory from one allocator. That matters: numpy backs arrays of
4 MiB and more with transparent huge pages (it madvises them), torch does not unless
``THP_MEM_ALLOC_ENABLE=1``, and with 4 KiB pages the kernel pins and walks 512 times as many
pages per cross-memory-attach copy; Open MPI's np=4 shared-memory times at 1-64 MiB moved
by 1.2-1.9x between the two kinds of memory. ``--thp`` sets ``THP_MEM_ALLOC_ENABLE=1`` for
every system (huge pages for all). Each operation is timed in the form
a torch.distributed program uses (``--placement primary``: all_reduce, broadcast in place;
the others out of place). Point to point is ``pingpong`` (one-way time = half a round
trip). Open MPI needs ``--allow-run-as-root`` as root (added then) and ``--oversubscribe``
when there are more ranks than cores (always added). When ``mpirun`` is missing and this
runs as root, ``apt-get install -y openmpi-bin libopenmpi-dev`` is run first, and mpi4py and
matplotlib are pip-installed when missing (``--no-install``: never). A system that cannot
run is reported as such, and the others still run. ``--repeat R`` runs everything R times,
interleaved, and keeps each row's fastest time (less sensitive to a busy machine).

Output (``--out``, default benchmarks/results): ``compare.md`` (machine, versions, load,
single-core memcpy bandwidth, summary, one table per operation and rank count),
``<op>_np<N>.png`` (busbw and time against size, one line per system) and ``raw/`` (each
run's table and JSON). The ratios, printed at the end and in the report, are xccl's speed-up
over the other system: ``xccl-shm/gloo = t(gloo) / t(xccl-shm)`` (= the busbw ratio;
> 1: xccl is faster).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "benchmarks")

SYSTEMS = ("xccl-shm", "xccl-tcp", "gloo", "mpi-shm", "mpi-tcp")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "pingpong")
COLORS = {
    "xccl-shm": "#1f77b4",
    "xccl-tcp": "#17becf",
    "gloo": "#ff7f0e",
    "mpi-shm": "#2ca02c",
    "mpi-tcp": "#d62728",
}

# xccl's speed-up is reported over these pairs: (xccl system, other system).
RATIOS = (
    ("xccl-shm", "gloo"),
    ("xccl-tcp", "gloo"),
    ("xccl-shm", "mpi-shm"),
    ("xccl-tcp", "mpi-tcp"),
)

# Full run: 8 B to 256 MiB; every 8x while latency dominates, then every 4x.
FULL_SIZES = "8,64,512,4K,32K,256K,1M,4M,16M,64M,256M"
QUICK_SIZES = "8,4K,256K,4M,16M"
BIG = 64 << 20  # the size of the summary's bandwidth table

# xccl-bench without its console script (the same as python -m xccl.bench).
XCCL_BENCH = [sys.executable, "-c", "import sys; from xccl.bench import main; sys.exit(main())"]


@dataclasses.dataclass
class Run:
    """One benchmark process: a system at one rank count."""

    system: str
    nranks: int
    repeat: int
    cmd: list[str]
    env: dict[str, str]
    json_path: str
    log_path: str
    status: str = "not run"  # "ok", or why there are no (good) results
    seconds: float = 0.0
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------


def _say(msg: str) -> None:
    print(f"compare: {msg}", file=sys.stderr, flush=True)


def _have_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def ensure_mpi(install: bool) -> tuple[Optional[str], str]:
    """Makes Open MPI and mpi4py available if allowed to. Returns (why MPI cannot run, or
    None; mpirun's version line)."""
    if shutil.which("mpirun") is None:
        if not (install and _is_root() and shutil.which("apt-get")):
            return "mpirun not found (apt-get install -y openmpi-bin libopenmpi-dev)", ""
        _say("mpirun not found: apt-get install -y openmpi-bin libopenmpi-dev")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (
            ["apt-get", "update"],
            ["apt-get", "install", "-y", "openmpi-bin", "libopenmpi-dev"],
        ):
            if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode != 0:
                return f"{' '.join(cmd)} failed", ""
    if not _have_module("mpi4py"):
        if not install:
            return "mpi4py not installed (pip install -r benchmarks/requirements.txt)", ""
        _say("mpi4py not installed: pip install mpi4py")
        rc = subprocess.run([sys.executable, "-m", "pip", "install", "mpi4py"]).returncode
        importlib.invalidate_caches()
        if rc != 0 or not _have_module("mpi4py"):
            return "pip install mpi4py failed", ""
    out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True)
    lines = (out.stdout or out.stderr).strip().splitlines()
    return None, lines[0] if lines else ""


def ensure_matplotlib(install: bool) -> bool:
    """True if matplotlib can be imported (pip-installing it first if allowed)."""
    if not _have_module("matplotlib") and install:
        _say("matplotlib not installed: pip install matplotlib")
        subprocess.run([sys.executable, "-m", "pip", "install", "matplotlib"])
        importlib.invalidate_caches()
    return _have_module("matplotlib")


def memcpy_bandwidth(nbytes: int = 64 << 20, reps: int = 20) -> float:
    """Single-core copy bandwidth in GB/s: bytes copied per second by numpy.copyto of
    `nbytes` (best of `reps`, after a first copy that touches every page). Each byte is read
    once and written once."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    np.copyto(dst, src)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def machine_info() -> dict[str, str]:
    """CPU, cores, memory, kernel and the versions of what is compared."""
    info = {"host": platform.node(), "kernel": platform.release()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info["cores"] = str(os.cpu_count())
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            kib = int(f.readline().split()[1])
        info["memory"] = f"{kib / (1 << 20):.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    try:  # "always [madvise] never": whether memory nobody madvises gets huge pages
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="utf-8") as f:
            info["transparent huge pages"] = f.read().strip()
    except OSError:
        pass
    info["python"] = platform.python_version()
    for mod in ("numpy", "torch", "mpi4py"):
        if _have_module(mod):
            out = subprocess.run(
                [sys.executable, "-c", f"import {mod}; print({mod}.__version__)"],
                capture_output=True,
                text=True,
            )
            info[mod] = out.stdout.strip() or "?"
    return info


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def plan_runs(
    systems: Sequence[str],
    nps: Sequence[int],
    bench_args: list[str],
    raw: str,
    mpi_version: str,
    repeat: int = 1,
    thp: bool = False,
) -> list[Run]:
    """The command of every (repetition, rank count, system), in the order they run."""
    env = {"OMP_NUM_THREADS": "1"}
    if thp:  # torch's CPU allocator madvises allocations of 2 MiB and more as huge pages
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    if not _have_module("xccl"):  # not installed: the source tree (built in place)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.path.join(ROOT, "python"), os.environ.get("PYTHONPATH", "")) if p
        )
    m = re.search(r"(\d+)\.\d+", mpi_version)
    shm_btl = "sm" if m and int(m.group(1)) >= 5 else "vader"  # renamed in Open MPI 5
    runs: list[Run] = []
    for rep, n, system in ((r, n, s) for r in range(repeat) for n in nps for s in systems):
        stem = os.path.join(raw, f"{system}_np{n}" + (f"_r{rep + 1}" if repeat > 1 else ""))
        if system == "gloo":
            cmd = [*XCCL_BENCH, "--np", str(n), "--backend", "gloo"]
        elif system.startswith("xccl"):
            cmd = [*XCCL_BENCH, "--np", str(n), "--backend", "xccl"]
            cmd += ["--transport", system.split("-")[1]]
        else:
            cmd = ["mpirun", "-np", str(n), "--oversubscribe"]
            cmd += ["--allow-run-as-root"] if _is_root() else []
            cmd += ["--mca", "pml", "ob1"]
            if system == "mpi-shm":
                cmd += ["--mca", "btl", f"self,{shm_btl}"]
            else:
                cmd += ["--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo"]
            for key, value in env.items():
                cmd += ["-x", f"{key}={value}"]
            cmd += [sys.executable, os.path.join(HERE, "mpi_bench.py")]
        cmd += ["--tensor", "torch"]  # every system: memory from torch's allocator
        cmd += [*bench_args, "--json", stem + ".json", "--no-progress"]
        runs.append(Run(system, n, rep, cmd, dict(env), stem + ".json", stem + ".txt"))
    return runs


def execute(run: Run, timeout: float) -> None:
    """Runs one benchmark process, keeping its table in run.log_path and its JSON rows."""
    if os.path.exists(run.json_path):
        os.remove(run.json_path)
    env = dict(os.environ)
    env.update(run.env)
    t0 = time.monotonic()
    with open(run.log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(run.cmd) + "\n")
        log.flush()
        try:
            proc = subprocess.run(
                run.cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT
            )
            rc: Optional[int] = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    run.seconds = time.monotonic() - t0
    if os.path.exists(run.json_path):
        with open(run.json_path, encoding="utf-8") as f:
            data = json.load(f)
        run.meta, run.rows = data["meta"], data["rows"]
    if rc is None:
        run.status = f"timed out after {timeout:.0f} s"
    elif any((row.get("wrong") or 0) > 0 for row in run.rows):
        run.status = "WRONG RESULTS (see the raw log)"
    elif rc != 0:
        run.status = f"failed (exit {rc}): {_last_error(run.log_path)}"
    else:
        run.status = "ok"


def _last_error(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith("$ ")]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line[:200]
    return lines[-1][:200] if lines else "no output"


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------

Table = dict[tuple[str, int, str], dict[int, dict[str, Any]]]


def index(runs: Sequence[Run]) -> Table:
    """(system, nranks, op) -> size -> row; of repeated runs, the fastest row."""
    out: Table = {}
    for run in runs:
        for row in run.rows:
            rows = out.setdefault((run.system, run.nranks, row["op"]), {})
            best = rows.get(row["size"])
            if best is None or row["time_us"] < best["time_us"]:
                rows[row["size"]] = row
    return out


def _sizes(table: Table, systems: Sequence[str], n: int, op: str) -> list[int]:
    return sorted({s for system in systems for s in table.get((system, n, op), {})})


def speedup(table: Table, xccl: str, other: str, n: int, op: str, size: int) -> Optional[float]:
    """t(other) / t(xccl) at one size; None where either is missing."""
    a = table.get((xccl, n, op), {}).get(size)
    b = table.get((other, n, op), {}).get(size)
    if a is None or b is None or a["time_us"] <= 0:
        return None
    return b["time_us"] / a["time_us"]


def _geomean(values: list[float]) -> Optional[float]:
    vals = [v for v in values if v > 0]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def _fmt_ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def _fmt_us(us: float) -> str:
    """Microseconds, with fewer decimals as they grow (always µs, as nccl-tests prints)."""
    if us >= 1000:
        return f"{us:.0f}"
    return f"{us:.1f}" if us >= 10 else f"{us:.2f}"


def human(nbytes: int) -> str:
    """8 B, 4 KiB, 64 MiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _short(nbytes: int) -> str:
    return human(nbytes).replace(" B", "").replace(" KiB", "K").replace(" MiB", "M")


def _cell(table: Table, system: str, n: int, op: str, size: int, what: str) -> str:
    row = table.get((system, n, op), {}).get(size)
    if row is None:
        return "-"
    if what == "time":
        return _fmt_us(row["time_us"])
    if what == "busbw":
        return f"{row['busbw']:.3f}"
    return f"{_fmt_us(row['time_us'])} ({row['busbw']:.3f})"


def _md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return [*lines, ""]


def summary(
    table: Table, systems: Sequence[str], nps: Sequence[int], ops: Sequence[str]
) -> list[str]:
    """Markdown: latency at the smallest size, busbw at 64 MiB (or the largest size), and the
    geometric mean of xccl's speed-up over all sizes."""
    groups = [(op, n, _sizes(table, systems, n, op)) for op in ops for n in nps]
    groups = [(op, n, sizes) for op, n, sizes in groups if sizes]
    lines = ["## Summary", "", "Latency: time (µs) at the smallest size.", ""]
    lines += _md_table(
        ["op", "np", "size", *systems],
        [
            [op, str(n), human(sizes[0])]
            + [_cell(table, s, n, op, sizes[0], "time") for s in systems]
            for op, n, sizes in groups
        ],
    )
    lines += [f"Bandwidth: busbw (GB/s) at {human(BIG)} (or the largest size measured).", ""]
    rows = []
    for op, n, sizes in groups:
        size = BIG if BIG in sizes else sizes[-1]
        rows.append(
            [op, str(n), human(size)] + [_cell(table, s, n, op, size, "busbw") for s in systems]
        )
    lines += _md_table(["op", "np", "size", *systems], rows)
    lines += [
        "xccl's speed-up, t(other) / t(xccl), geometric mean over all sizes (> 1: xccl is faster).",
        "",
    ]
    rows = []
    for op, n, sizes in groups:
        cells = [op, str(n)]
        for a, b in RATIOS:
            found = [speedup(table, a, b, n, op, s) for s in sizes]
            cells.append(_fmt_ratio(_geomean([r for r in found if r is not None])))
        rows.append(cells)
    lines += _md_table(["op", "np", *(f"{a}/{b}" for a, b in RATIOS)], rows)
    return lines


def write_markdown(
    path: str,
    runs: Sequence[Run],
    systems: Sequence[str],
    nps: Sequence[int],
    ops: Sequence[str],
    info: dict[str, str],
    memcpy: float,
    settings: dict[str, Any],
) -> None:
    """compare.md: conditions, summary, then one table per operation and rank count."""
    table = index(runs)
    lines = ["# xccl vs gloo vs MPI on one host", ""]
    lines.append(f"Command: `{settings['command']}`  ")
    lines.append(f"Date: {settings['date']}; total time {settings['elapsed']:.0f} s")
    lines.append("")
    facts = [[k, v] for k, v in info.items()]
    facts.append(["load average (1, 5, 15 min) before", settings["load_before"]])
    facts.append(["load average (1, 5, 15 min) after", settings["load_after"]])
    thp = "requested (THP_MEM_ALLOC_ENABLE=1)" if settings["thp"] else "not requested"
    facts.append(["buffers (every system)", f"torch CPU tensors; huge pages {thp}"])
    facts.append(["single-core memcpy (numpy, 64 MiB)", f"**{memcpy:.2f} GB/s**"])
    lines += _md_table(["machine", ""], facts)
    lines.append(
        "The memcpy figure bounds intra-node bandwidth for buffers larger than the caches: "
        "a transport that copies through a shared buffer moves each byte twice (sender in, "
        "receiver out), one that copies straight from the sender's memory (cross-memory "
        "attach) once, so with one core per rank its one-way bandwidth is at most about that "
        "figure, and less once it reduces. The harness reuses its buffers, so messages of up "
        "to a few MiB come from the caches and can go faster."
    )
    lines.append("")
    lines.append(
        f"Harness flags: `{settings['bench']}`. Time: mean per-iteration time over ranks "
        "(nccl-tests `-a 1`); busbw: nccl-tests' factors (all_reduce 2(n-1)/n; all_gather, "
        "reduce_scatter, all_to_all (n-1)/n; broadcast, pingpong 1); pingpong time is one "
        "way (half a round trip). Every row was checked (`-c 1`) against analytically known "
        "results. Where runs were repeated, each row keeps its fastest repetition."
    )
    lines.append("")
    lines += _md_table(
        ["run", "status", "seconds", "transports", "version"],
        [
            [
                f"{r.system} np={r.nranks}"
                + (f" #{r.repeat + 1}" if settings["repeat"] > 1 else ""),
                r.status,
                f"{r.seconds:.0f}",
                ",".join(r.meta.get("transports") or []) or "-",
                str(r.meta.get("version", "-")),
            ]
            for r in runs
        ],
    )
    lines += summary(table, systems, nps, ops)
    for op in ops:
        for n in nps:
            sizes = _sizes(table, systems, n, op)
            if not sizes:
                continue
            lines += [f"## {op}, np={n}", ""]
            lines += ["time in µs (busbw in GB/s); speed-ups are t(other) / t(xccl)", ""]
            head = ["size", *systems, *(f"{a}/{b}" for a, b in RATIOS)]
            rows = []
            for size in sizes:
                cells = [human(size)] + [_cell(table, s, n, op, size, "both") for s in systems]
                cells += [_fmt_ratio(speedup(table, a, b, n, op, size)) for a, b in RATIOS]
                rows.append(cells)
            lines += _md_table(head, rows)
            lines += [f"![{op} np={n}]({op}_np{n}.png)", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def plot(
    out_dir: str,
    runs: Sequence[Run],
    systems: Sequence[str],
    nps: Sequence[int],
    ops: Sequence[str],
    memcpy: float,
) -> list[str]:
    """One PNG per (op, np): busbw and time against size, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = index(runs)
    written = []
    for op in ops:
        for n in nps:
            sizes = _sizes(table, systems, n, op)
            if not sizes:
                continue
            fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
            for system in systems:
                rows = table.get((system, n, op), {})
                if not rows:
                    continue
                xs = sorted(rows)
                style = dict(
                    color=COLORS.get(system),
                    marker="o",
                    markersize=3,
                    label=system,
                    linestyle="-" if system.startswith("xccl") else "--",
                )
                ax_bw.plot(xs, [rows[s]["busbw"] for s in xs], **style)
                ax_t.plot(xs, [rows[s]["time_us"] for s in xs], **style)
            ax_bw.axhline(
                memcpy,
                color="grey",
                linewidth=0.8,
                linestyle=":",
                label=f"memcpy, 1 core ({memcpy:.1f} GB/s)",
            )
            ax_bw.set_ylabel("busbw (GB/s)")
            ax_bw.set_title(f"{op}, np={n}: bus bandwidth")
            ax_t.set_yscale("log")
            ax_t.set_ylabel("time per operation (µs)")
            ax_t.set_title(f"{op}, np={n}: time")
            for ax in (ax_bw, ax_t):
                ax.set_xscale("log")
                ax.set_xticks(sizes)
                ax.set_xticklabels([_short(s) for s in sizes], fontsize=8)
                ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
                ax.set_xlabel("size (bytes)")
                ax.grid(True, which="major", alpha=0.3)
                ax.legend(fontsize=8)
            fig.tight_layout()
            path = os.path.join(out_dir, f"{op}_np{n}.png")
            fig.savefig(path, dpi=90)
            plt.close(fig)
            written.append(path)
    return written


def print_ratios(runs: Sequence[Run], nps: Sequence[int], ops: Sequence[str]) -> None:
    """xccl's speed-up over gloo and MPI per op, np and size, on stdout."""
    table = index(runs)
    labels = [f"{a}/{b}" for a, b in RATIOS]
    print("# xccl speed-up t(other) / t(xccl) (> 1: xccl is faster; '-': not measured)")
    print(f"{'op':>14s} {'np':>3s} {'size':>10s}  " + "  ".join(f"{x:>16s}" for x in labels))
    for op in ops:
        for n in nps:
            for size in _sizes(table, SYSTEMS, n, op):
                cells = [_fmt_ratio(speedup(table, a, b, n, op, size)) for a, b in RATIOS]
                print(
                    f"{op:>14s} {n:3d} {human(size):>10s}  " + "  ".join(f"{c:>16s}" for c in cells)
                )


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _loadavg() -> str:
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs every system at every rank count, then writes the report."""
    p = argparse.ArgumentParser(
        prog="compare.py",
        description="xccl vs torch.distributed gloo vs Open MPI on this host, in one run.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"sizes {QUICK_SIZES} and shorter loops (about 2 minutes)",
    )
    p.add_argument("--np", default="2,4", help="rank counts (default 2,4)")
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma list of {', '.join(SYSTEMS)} (default: all)",
    )
    p.add_argument("--ops", default=",".join(OPS), help=f"default {','.join(OPS)}")
    p.add_argument("--sizes", help=f"comma list of sizes (default {FULL_SIZES})")
    p.add_argument("-n", "--iters", type=int, help="timed iterations, at least (default 5)")
    p.add_argument("-w", "--warmup", type=int, help="warm-up iterations (default 1)")
    p.add_argument(
        "--mintime", type=float, help="seconds each timed loop lasts at least (default 0.25)"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run everything R times, keep each row's fastest (default 1)",
    )
    p.add_argument(
        "--thp",
        action="store_true",
        help="transparent huge pages for every system's buffers (THP_MEM_ALLOC_ENABLE=1)",
    )
    p.add_argument(
        "--out",
        default=os.path.join(HERE, "results"),
        help="output directory (default benchmarks/results)",
    )
    p.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds one run may take (default 1800)"
    )
    p.add_argument(
        "--no-install", action="store_true", help="never install Open MPI, mpi4py or matplotlib"
    )
    args = p.parse_args(argv)

    systems = _csv(args.systems)
    for s in systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; valid: {', '.join(SYSTEMS)}")
    nps = [int(x) for x in _csv(args.np)]
    ops = _csv(args.ops)
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    iters = args.iters if args.iters is not None else (3 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else 1
    mintime = args.mintime if args.mintime is not None else (0.05 if args.quick else 0.25)
    bench_args = [
        "-o",
        ",".join(ops),
        "--sizes",
        sizes,
        "-n",
        str(iters),
        "-w",
        str(warmup),
        "-c",
        "1",
        "--mintime",
        str(mintime),
        "--placement",
        "primary",
    ]

    raw = os.path.join(args.out, "raw")
    os.makedirs(raw, exist_ok=True)
    install = not args.no_install
    mpi_problem, mpi_version = None, ""
    if any(s.startswith("mpi") for s in systems):
        mpi_problem, mpi_version = ensure_mpi(install)
        if mpi_problem:
            _say(f"MPI systems skipped: {mpi_problem}")
    have_plots = ensure_matplotlib(install)

    info = machine_info()
    if mpi_version:
        info["mpi"] = mpi_version
    memcpy = memcpy_bandwidth()
    _say(f"single-core memcpy bandwidth (numpy, 64 MiB): {memcpy:.2f} GB/s")

    t_start = time.monotonic()
    load_before = _loadavg()
    runs = plan_runs(systems, nps, bench_args, raw, mpi_version, args.repeat, args.thp)
    for i, run in enumerate(runs, 1):
        what = f"[{i}/{len(runs)}] {run.system} np={run.nranks}"
        if run.system.startswith("mpi") and mpi_problem:
            run.status = f"skipped: {mpi_problem}"
            continue
        _say(f"{what} ...")
        execute(run, args.timeout)
        _say(f"{what}: {run.status} ({run.seconds:.0f} s, load {_loadavg()})")
    elapsed = time.monotonic() - t_start

    settings = {
        "command": " ".join(["python benchmarks/compare.py", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "elapsed": elapsed,
        "load_before": load_before,
        "load_after": _loadavg(),
        "bench": " ".join(bench_args),
        "repeat": args.repeat,
        "thp": args.thp,
    }
    md = os.path.join(args.out, "compare.md")
    write_markdown(md, runs, systems, nps, ops, info, memcpy, settings)
    if have_plots:
        plot(args.out, runs, systems, nps, ops, memcpy)
    else:
        _say("matplotlib not available: no plots (pip install matplotlib)")
    print_ratios(runs, nps, ops)
    print(
        f"# memcpy (one core, 64 MiB): {memcpy:.2f} GB/s; load average {load_before} -> "
        f"{settings['load_after']}; {elapsed:.0f} s"
    )
    print(f"# report: {md}")
    for run in runs:
        if run.status != "ok":
            print(f"# {run.system} np={run.nranks}: {run.status}")
    return 1 if any(r.status.startswith("WRONG") for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
