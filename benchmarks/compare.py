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

Any rank count runs (``--np 8,16,32,64``). A run with more ranks than the CPUs this process
may use (``os.sched_getaffinity``) is *oversubscribed*: its ranks time-share cores, so its
times measure the scheduler as much as the library. Such runs are marked in every output:
the report's headings and np columns, the plots' titles, the printed ratios, the raw log's
first line and the raw JSON's ``meta["compare"]``. Open MPI runs with ``--bind-to none``
(``--mpi-bind`` changes it): xccl's and gloo's ranks are not pinned either, so all systems
are placed alike by the OS, and binding to cores is refused when ranks outnumber them. It
also gets ``--use-hwthread-cpus`` (its slots are the CPUs the mark counts, so it runs in its
oversubscribed mode, yielding when idle, exactly in the marked runs) and ``--oversubscribe``.

The memory-system bound (``--bound``, on by default; ``benchmarks/membw.c``, compiled with
``cc``): for each rank count N, N processes each copy their own buffer of the bandwidth
table's size (64 MiB) at once; the aggregate copy bandwidth divided by N is what one rank can
copy per second while all do, which bounds the busbw of a broadcast or all_gather that copies
each byte once (see membw.c). The report puts broadcast and all_gather busbw beside it, with
the ratio. ``--deadline SEC`` stops starting runs that could not end in time and cuts the
last one short (its rows so far are read back from its log), so a fixed time limit still
ends with a report. ``--baseline DIR`` compares every row with an earlier run's raw JSON.
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
import signal
import subprocess
import sys
import tempfile
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
    oversubscribed: bool = False  # more ranks than the CPUs this process may use
    cpus: int = 0  # the CPUs this process may use when it planned the run
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


def cpus_available() -> int:
    """The CPUs this process may run on (its affinity mask, which a container's or a batch
    system's CPU set narrows), or os.cpu_count() where the mask cannot be read."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def is_oversubscribed(nranks: int, cpus: int) -> bool:
    """True when `nranks` ranks on one host outnumber the `cpus` they may run on."""
    return nranks > cpus


def np_label(nranks: int, cpus: int) -> str:
    """The rank count as the tables show it: "8", or "8 (oversubscribed)"."""
    return f"{nranks} (oversubscribed)" if is_oversubscribed(nranks, cpus) else str(nranks)


def oversub_note(cpus: int) -> str:
    """The sentence that explains the mark."""
    return (
        f"'oversubscribed': more ranks than the {cpus} CPUs this process may use "
        "(os.sched_getaffinity); the ranks time-share cores, so times include waiting for a "
        "CPU and say as much about the scheduler as about the library."
    )


def build_membw(out_dir: str) -> tuple[Optional[str], str]:
    """Compiles benchmarks/membw.c with $CC (default cc) into `out_dir`. Returns (the
    program's path, or None; the compiler's complaint)."""
    cc = os.environ.get("CC", "cc")
    exe = os.path.join(out_dir, "membw")
    cmd = [cc, "-O2", "-std=c11", "-o", exe, os.path.join(HERE, "membw.c"), "-lpthread"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)
    if out.returncode != 0:
        return None, (out.stderr or out.stdout).strip()[-300:]
    return exe, ""


def memory_bound(
    exe: str,
    nstreams: int,
    nbytes: int,
    shared_src: bool = False,
    thp: bool = False,
    mintime: float = 0.2,
    rounds: int = 3,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Runs membw: `nstreams` processes copying `nbytes` each at once. Returns its JSON
    (aggregate_gbps, per_stream_gbps, min/max_stream_gbps, copies, seconds, ...)."""
    if nstreams < 1 or nbytes < 1:
        raise ValueError(f"membw needs at least one stream and one byte, not {nstreams}, {nbytes}")
    cmd = [exe, "-p", str(nstreams), "-s", str(nbytes), "--mintime", str(mintime)]
    cmd += ["--rounds", str(rounds), "--json"]
    cmd += ["--shared-src"] if shared_src else []
    cmd += ["--thp"] if thp else []
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"membw failed (exit {out.returncode}): {out.stderr.strip()[-300:]}")
    result: dict[str, Any] = json.loads(out.stdout)
    return result


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
    cpus: Optional[int] = None,
    mpi_bind: str = "none",
) -> list[Run]:
    """The command of every (repetition, rank count, system), in the order they run. Runs
    with more ranks than `cpus` (default: this process's CPUs) are marked oversubscribed."""
    cpus = cpus_available() if cpus is None else cpus
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
            # Slots are hardware threads (as the mark counts CPUs), so that Open MPI thinks
            # itself oversubscribed (and yields when idle) exactly when the mark says so;
            # --oversubscribe lets it start more ranks than slots at all.
            cmd = ["mpirun", "-np", str(n), "--use-hwthread-cpus", "--oversubscribe"]
            cmd += ["--bind-to", mpi_bind]
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
        run = Run(system, n, rep, cmd, dict(env), stem + ".json", stem + ".txt")
        run.cpus, run.oversubscribed = cpus, is_oversubscribed(n, cpus)
        runs.append(run)
    return runs


def _mark(run: Run) -> dict[str, Any]:
    """What compare.py adds to a run's raw JSON (meta["compare"])."""
    return {
        "system": run.system,
        "nranks": run.nranks,
        "cpus": run.cpus,
        "oversubscribed": run.oversubscribed,
    }


class Stopped(Exception):
    """SIGTERM or SIGINT arrived: the run in progress was ended; write the report now."""


# The signal that asked compare.py to stop (set by _on_signal), and whether one may interrupt
# a run's wait right away (elsewhere the loop looks at _STOP before each run).
_STOP: list[str] = []
_WAITING = [False]


def _on_signal(signum: int, frame: Any) -> None:
    _STOP.append(signal.Signals(signum).name)
    if _WAITING[0]:
        raise Stopped(_STOP[0])


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Ends the process group that `proc` leads (the benchmark and the ranks it spawned):
    SIGTERM, then SIGKILL after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def execute(run: Run, timeout: float) -> None:
    """Runs one benchmark process, keeping its table in run.log_path and its JSON rows
    (marked with compare.py's view of the run). A run past `timeout` is stopped with every
    process it started, and keeps the rows its log had printed by then."""
    if os.path.exists(run.json_path):
        os.remove(run.json_path)
    env = dict(os.environ)
    env.update(run.env)
    t0 = time.monotonic()
    with open(run.log_path, "w", encoding="utf-8") as log:
        mark = "oversubscribed" if run.oversubscribed else "not oversubscribed"
        log.write(f"# compare: {run.system}, {run.nranks} ranks on {run.cpus} CPUs: {mark}\n")
        log.write("$ " + " ".join(run.cmd) + "\n")
        log.flush()
        # Its own process group, so that a timeout ends the ranks it spawned as well.
        proc = subprocess.Popen(
            run.cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
        stopped: Optional[BaseException] = None
        rc: Optional[int] = None
        try:
            _WAITING[0] = True
            if not _STOP:
                rc = proc.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            pass
        except (Stopped, KeyboardInterrupt) as e:
            stopped = e
        finally:
            _WAITING[0] = False
            if proc.poll() is None or rc is None:
                _stop_group(proc)
        if _STOP and stopped is None and rc is None:
            stopped = Stopped(_STOP[0])
    run.seconds = time.monotonic() - t0
    data: Optional[dict[str, Any]] = None
    if os.path.exists(run.json_path):
        with open(run.json_path, encoding="utf-8") as f:
            data = json.load(f)
    else:
        rows = rows_from_log(run.log_path, run.nranks)
        if rows:  # cut short: what its table shows
            data = {"meta": {"from_log": True, "nranks": run.nranks}, "rows": rows}
    if data is not None:
        data["meta"]["compare"] = _mark(run)
        run.meta, run.rows = data["meta"], data["rows"]
        with open(run.json_path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
    if stopped is not None:
        run.status = f"stopped after {run.seconds:.0f} s ({len(run.rows)} rows kept from its log)"
        raise stopped
    if rc is None:
        run.status = f"timed out after {timeout:.0f} s ({len(run.rows)} rows kept from its log)"
    elif any((row.get("wrong") or 0) > 0 for row in run.rows):
        run.status = "WRONG RESULTS (see the raw log)"
    elif rc != 0:
        run.status = f"failed (exit {rc}): {_last_error(run.log_path)}"
    else:
        run.status = "ok"


def rows_from_log(path: str, nranks: int) -> list[dict[str, Any]]:
    """The rows of a benchmark's printed tables (xccl-bench's and mpi_bench.py's format: a
    "# <op>" line, then per size: size, count, type, redop, root and an out-of-place and an
    in-place block of time, algbw, busbw, #wrong, N/A where not run). For runs that did not
    live to write their JSON."""
    rows: list[dict[str, Any]] = []
    op: Optional[str] = None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return rows
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[0] == "#" and parts[1] in OPS:
            op = parts[1]
            continue
        if op is None or len(parts) != 13 or not parts[0].isdigit():
            continue
        for where, block in (("out", parts[5:9]), ("in", parts[9:13])):
            if block[0] == "N/A":
                continue
            try:
                time_us, algbw, busbw = float(block[0]), float(block[1]), float(block[2])
            except ValueError:
                continue
            rows.append(
                {
                    "op": op,
                    "nranks": nranks,
                    "size": int(parts[0]),
                    "count": int(parts[1]),
                    "placement": where,
                    "time_us": time_us,
                    "algbw": algbw,
                    "busbw": busbw,
                    "wrong": None if block[3] == "N/A" else int(block[3]),
                }
            )
    return rows


def _last_error(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith(("$ ", "# compare:"))]
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


def checked_csv(p: argparse.ArgumentParser, text: str, valid: Sequence[str], what: str,
                flag: str) -> list[str]:
    """The names of a comma list, each one of `valid` (else the parser's usage error)."""
    names = _csv(text)
    for n in names:
        if n not in valid:
            p.error(f"unknown {what} {n!r}; valid: {', '.join(valid)}")
    if not names:
        p.error(f"{flag}: no {what} named")
    return names


def _md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return [*lines, ""]


Bounds = dict[int, dict[str, Any]]  # rank count -> membw's result ("shared": shared source)

BOUND_OPS = ("broadcast", "all_gather")  # the collectives the bound applies to


def bound_size(sizes: Sequence[int]) -> int:
    """The size the bound is measured at: the bandwidth table's (64 MiB) if measured, else
    the largest size."""
    return BIG if BIG in sizes else max(sizes)


def row_near(rows: dict[int, dict[str, Any]], size: int) -> Optional[dict[str, Any]]:
    """The row of `size`, or of the size nearest to it within 1 % (with np not a power of two,
    all_gather's and all_to_all's sizes are rounded down to whole shares)."""
    if size in rows:
        return rows[size]
    near = min(rows, key=lambda s: abs(s - size), default=None)
    return rows[near] if near is not None and abs(near - size) <= size // 100 else None


def bound_table(
    table: Table, systems: Sequence[str], nps: Sequence[int], bounds: Bounds, cpus: int
) -> list[str]:
    """Markdown: the memory-system bound at each rank count, and broadcast's and all_gather's
    busbw at its size beside it with the ratio busbw / bound."""
    if not bounds:
        return []
    lines = [
        "## Memory-system bound",
        "",
        "`benchmarks/membw.c`: N processes (N = np) each memcpy their own buffer of the size "
        "below at the same time; *aggregate* is the bytes copied per second by all of them "
        "(each byte read once and written once), *bound* = aggregate / N, what one rank can "
        "copy per second while every rank copies. A broadcast or all_gather that copies each "
        "byte once, all ranks copying their shares in parallel, has a busbw of at most about "
        "the bound (nccl-tests' factors turn both into bytes copied per rank). *shared src*: "
        "the same with one source buffer that all read (a broadcast's pattern; it can stay in "
        "a large cache). Ratio: busbw / bound.",
        "",
    ]
    rows = []
    for n in nps:
        b = bounds.get(n)
        if not b:
            continue
        shared = b.get("shared") or {}
        size = int(b["size"])
        cells = [np_label(n, cpus), human(size), f"{b['aggregate_gbps']:.2f}"]
        cells += [f"**{b['per_stream_gbps']:.2f}**"]
        cells += [f"{shared['per_stream_gbps']:.2f}" if shared else "-"]
        for op in BOUND_OPS:
            for system in systems:
                row = row_near(table.get((system, n, op), {}), size)
                if row is None:
                    cells.append("-")
                else:
                    ratio = row["busbw"] / b["per_stream_gbps"] if b["per_stream_gbps"] else 0
                    cells.append(f"{row['busbw']:.2f} ({ratio:.0%})")
        rows.append(cells)
    head = ["np", "size", "aggregate (GB/s)", "bound (GB/s)", "shared src bound"]
    head += [f"{op} {system}" for op in BOUND_OPS for system in systems]
    lines += _md_table(head, rows)
    return lines


def summary(
    table: Table,
    systems: Sequence[str],
    nps: Sequence[int],
    ops: Sequence[str],
    cpus: Optional[int] = None,
) -> list[str]:
    """Markdown: latency at the smallest size, busbw at 64 MiB (or the largest size), and the
    geometric mean of xccl's speed-up over all sizes. Rank counts above `cpus` (default:
    this process's CPUs) are marked oversubscribed."""
    cpus = cpus_available() if cpus is None else cpus
    groups = [(op, n, _sizes(table, systems, n, op)) for op in ops for n in nps]
    groups = [(op, n, sizes) for op, n, sizes in groups if sizes]
    lines = ["## Summary", ""]
    if any(is_oversubscribed(n, cpus) for _, n, _ in groups):
        lines += [f"np marked {oversub_note(cpus)}", ""]
    lines += ["Latency: time (µs) at the smallest size.", ""]
    lines += _md_table(
        ["op", "np", "size", *systems],
        [
            [op, np_label(n, cpus), human(sizes[0])]
            + [_cell(table, s, n, op, sizes[0], "time") for s in systems]
            for op, n, sizes in groups
        ],
    )
    lines += [f"Bandwidth: busbw (GB/s) at {human(BIG)} (or the largest size measured).", ""]
    rows = []
    for op, n, sizes in groups:
        size = BIG if BIG in sizes else sizes[-1]
        rows.append(
            [op, np_label(n, cpus), human(size)]
            + [_cell(table, s, n, op, size, "busbw") for s in systems]
        )
    lines += _md_table(["op", "np", "size", *systems], rows)
    lines += [
        "xccl's speed-up, t(other) / t(xccl), geometric mean over all sizes (> 1: xccl is faster).",
        "",
    ]
    rows = []
    for op, n, sizes in groups:
        cells = [op, np_label(n, cpus)]
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
    bounds: Optional[Bounds] = None,
    cpus: Optional[int] = None,
) -> None:
    """compare.md: conditions, summary, the memory-system bound, then one table per operation
    and rank count. Rank counts above `cpus` are marked oversubscribed everywhere."""
    cpus = cpus_available() if cpus is None else cpus
    table = index(runs)
    lines = ["# xccl vs gloo vs MPI on one host", ""]
    lines.append(f"Command: `{settings['command']}`  ")
    lines.append(f"Date: {settings['date']}; total time {settings['elapsed']:.0f} s")
    lines.append("")
    facts = [[k, v] for k, v in info.items()]
    facts.append(["CPUs this process may use (sched_getaffinity)", str(cpus)])
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
                f"{r.system} np={np_label(r.nranks, cpus)}"
                + (f" #{r.repeat + 1}" if settings["repeat"] > 1 else ""),
                r.status,
                f"{r.seconds:.0f}",
                ",".join(r.meta.get("transports") or []) or "-",
                str(r.meta.get("version", "-")),
            ]
            for r in runs
        ],
    )
    lines += summary(table, systems, nps, ops, cpus)
    lines += bound_table(table, systems, nps, bounds or {}, cpus)
    if "xccl-shm" in systems:
        lines += targets(table, nps, ops, bounds or {}, cpus)
    for op in ops:
        for n in nps:
            sizes = _sizes(table, systems, n, op)
            if not sizes:
                continue
            if is_oversubscribed(n, cpus):
                lines += [f"## {op}, np={n}: OVERSUBSCRIBED ({n} ranks on {cpus} CPUs)", ""]
            else:
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
    bounds: Optional[Bounds] = None,
    cpus: Optional[int] = None,
) -> list[str]:
    """One PNG per (op, np): busbw and time against size, one line per system, with the
    single-core memcpy and the memory-system bound at that np; an oversubscribed np says so
    in red in both titles."""
    cpus = cpus_available() if cpus is None else cpus
    bounds = bounds or {}
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
            bound = bounds.get(n)
            if bound:
                ax_bw.axhline(
                    bound["per_stream_gbps"],
                    color="black",
                    linewidth=0.8,
                    linestyle="-.",
                    label=f"memory bound, {n} streams ({bound['per_stream_gbps']:.1f} GB/s)",
                )
            over = is_oversubscribed(n, cpus)
            tag = f"\nOVERSUBSCRIBED: {n} ranks on {cpus} CPUs" if over else ""
            title = {"color": "red"} if over else {}
            ax_bw.set_ylabel("busbw (GB/s)")
            ax_bw.set_title(f"{op}, np={n}: bus bandwidth{tag}", fontsize=9, **title)
            ax_t.set_yscale("log")
            ax_t.set_ylabel("time per operation (µs)")
            ax_t.set_title(f"{op}, np={n}: time{tag}", fontsize=9, **title)
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


MIN_RUN_S = 20.0  # under --deadline, a run starts only with this much time left


def measure_bounds(
    nps: Sequence[int], nbytes: int, thp: bool, raw: str, mintime: float = 0.2
) -> Bounds:
    """The memory-system bound at each rank count (own sources, and one shared source), kept
    in raw/membw.json. A failure is reported and leaves the bound out."""
    bounds: Bounds = {}
    with tempfile.TemporaryDirectory(prefix="xccl-membw-") as tmp:
        exe, why = build_membw(tmp)
        if exe is None:
            _say(f"memory-system bound skipped: cannot compile benchmarks/membw.c: {why}")
            return bounds
        for n in nps:
            try:
                b = memory_bound(exe, n, nbytes, thp=thp, mintime=mintime)
                b["shared"] = memory_bound(exe, n, nbytes, True, thp, mintime)
            except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as e:
                _say(f"memory-system bound at np={n} skipped: {e}")
                continue
            bounds[n] = b
            _say(
                f"memory-system bound, {n} streams of {human(nbytes)}: aggregate "
                f"{b['aggregate_gbps']:.2f} GB/s, per stream {b['per_stream_gbps']:.2f} GB/s "
                f"(shared source {b['shared']['per_stream_gbps']:.2f})"
            )
    with open(os.path.join(raw, "membw.json"), "w", encoding="utf-8") as f:
        json.dump({str(n): b for n, b in bounds.items()}, f, indent=1)
        f.write("\n")
    return bounds


BOUND_TARGET = 0.70  # issue 19: broadcast and all_gather of 64 MiB within 70 % of the bound
LATENCY_TARGET_US = 3.0  # issue 19: 8-byte all_reduce at np=16


def targets(
    table: Table, nps: Sequence[int], ops: Sequence[str], bounds: Bounds, cpus: int
) -> list[str]:
    """Markdown: issue 19's targets as this run measured them. Per np: the rows where
    xccl-shm is slower than mpi-shm (time >), the 8-byte all_reduce time, and xccl-shm's
    broadcast and all_gather busbw against the memory bound."""
    lines = [
        "## Targets (issue 19)",
        "",
        "xccl-shm against mpi-shm at every op and size (time ≤ Open MPI's), 8-byte all_reduce "
        f"≤ {LATENCY_TARGET_US:g} µs (at np=16), broadcast and all_gather busbw at the bound's "
        f"size ≥ {BOUND_TARGET:.0%} of the bound.",
        "",
    ]
    rows = []
    for n in nps:
        slower: list[tuple[float, str]] = []
        compared = 0
        for op in ops:
            mine, theirs = table.get(("xccl-shm", n, op), {}), table.get(("mpi-shm", n, op), {})
            for size in sorted(set(mine) & set(theirs)):
                compared += 1
                t0, t1 = mine[size]["time_us"], theirs[size]["time_us"]
                if t0 > t1:
                    slower.append((t0 / t1, f"{op} {human(size)} {t0 / t1:.2f}x"))
        slower.sort(reverse=True)
        worst = ", ".join(text for _, text in slower[:4]) + (", ..." if len(slower) > 4 else "")
        ar = table.get(("xccl-shm", n, "all_reduce"), {}).get(8)
        cells = [np_label(n, cpus), f"{len(slower)} of {compared}" if compared else "-"]
        cells += [worst or "-"]
        cells += [f"{ar['time_us']:.2f}" if ar else "-"]
        b = bounds.get(n)
        for op in BOUND_OPS:
            row = row_near(table.get(("xccl-shm", n, op), {}), int(b["size"])) if b else None
            if row is None or not b or b["per_stream_gbps"] <= 0:
                cells.append("-")
                continue
            ratio = row["busbw"] / b["per_stream_gbps"]
            cells.append(f"{ratio:.0%}" + ("" if ratio >= BOUND_TARGET else " (missed)"))
        rows.append(cells)
    head = ["np", "xccl-shm slower than mpi-shm", "worst (t xccl / t mpi)"]
    head += ["all_reduce 8 B (µs)", "broadcast / bound", "all_gather / bound"]
    lines += _md_table(head, rows)
    return lines


def load_baseline(out_dir: str) -> Table:
    """The rows of an earlier run from its `raw/*.json` (`out_dir` or `out_dir/raw`), as
    index() keeps them: of repeated runs, each row's fastest. The system is the file name's
    part before `_np` (`xccl-shm_np2_r1.json`)."""
    raw = os.path.join(out_dir, "raw") if os.path.isdir(os.path.join(out_dir, "raw")) else out_dir
    runs: list[Run] = []
    for name in sorted(os.listdir(raw)):
        m = re.fullmatch(r"(.+)_np(\d+)(?:_r\d+)?\.json", name)
        if m is None or m.group(1) not in SYSTEMS:
            continue
        with open(os.path.join(raw, name), encoding="utf-8") as f:
            data = json.load(f)
        run = Run(m.group(1), int(m.group(2)), 0, [], {}, "", "")
        run.rows = data.get("rows") or []
        runs.append(run)
    if not runs:
        raise ValueError(f"no raw results (<system>_np<N>.json) in {raw}")
    return index(runs)


def baseline_rows(
    now: Table, base: Table, systems: Sequence[str], nps: Sequence[int], ops: Sequence[str]
) -> list[tuple[str, str, int, int, float, float]]:
    """(system, op, np, size, baseline time, time now) for every row measured in both."""
    out = []
    for system in systems:
        for n in nps:
            for op in ops:
                a, b = base.get((system, n, op), {}), now.get((system, n, op), {})
                for size in sorted(set(a) & set(b)):
                    out.append((system, op, n, size, a[size]["time_us"], b[size]["time_us"]))
    return out


def baseline_table(
    rows: Sequence[tuple[str, str, int, int, float, float]], tolerance: float, cpus: int
) -> list[str]:
    """Markdown: every row against the baseline, slower than it by more than `tolerance`
    marked SLOWER, and a count per system."""
    lines = [
        "## Against the baseline",
        "",
        f"time now / time in the baseline run, per row measured in both (> 1: slower now); "
        f"**SLOWER**: by more than {tolerance:.0%}. Single runs on a shared machine vary; "
        "the baseline keeps each row's fastest of its repetitions.",
        "",
    ]
    table = []
    for system, op, n, size, t0, t1 in rows:
        ratio = t1 / t0 if t0 > 0 else math.inf
        mark = "**SLOWER**" if ratio > 1 + tolerance else ""
        table.append(
            [
                system,
                op,
                np_label(n, cpus),
                human(size),
                _fmt_us(t0),
                _fmt_us(t1),
                f"{ratio:.2f}",
                mark,
            ]
        )
    lines += _md_table(
        ["system", "op", "np", "size", "baseline (µs)", "now (µs)", "now/base", ""], table
    )
    counts = []
    for system in dict.fromkeys(r[0] for r in rows):
        mine = [r for r in rows if r[0] == system]
        slower = sum(1 for r in mine if r[5] > r[4] * (1 + tolerance))
        geo = _geomean([r[5] / r[4] for r in mine if r[4] > 0])
        counts.append([system, str(len(mine)), str(slower), _fmt_ratio(geo)])
    lines += _md_table(["system", "rows", "slower", "geomean now/base"], counts)
    return lines


def print_ratios(
    runs: Sequence[Run], nps: Sequence[int], ops: Sequence[str], cpus: Optional[int] = None
) -> None:
    """xccl's speed-up over gloo and MPI per op, np and size, on stdout; an oversubscribed
    np is marked '!' (and explained)."""
    cpus = cpus_available() if cpus is None else cpus
    table = index(runs)
    labels = [f"{a}/{b}" for a, b in RATIOS]
    print("# xccl speed-up t(other) / t(xccl) (> 1: xccl is faster; '-': not measured)")
    if any(is_oversubscribed(n, cpus) for n in nps):
        print(f"# np marked '!': {oversub_note(cpus)}")
    print(f"{'op':>14s} {'np':>4s} {'size':>10s}  " + "  ".join(f"{x:>16s}" for x in labels))
    for op in ops:
        for n in nps:
            mark = f"{n}!" if is_oversubscribed(n, cpus) else f"{n} "
            for size in _sizes(table, SYSTEMS, n, op):
                cells = [_fmt_ratio(speedup(table, a, b, n, op, size)) for a, b in RATIOS]
                print(
                    f"{op:>14s} {mark:>4s} {human(size):>10s}  "
                    + "  ".join(f"{c:>16s}" for c in cells)
                )


def print_bounds(
    runs: Sequence[Run], systems: Sequence[str], nps: Sequence[int], bounds: Bounds, cpus: int
) -> None:
    """The memory-system bound per np and broadcast's and all_gather's busbw against it."""
    table = index(runs)
    for n in nps:
        b = bounds.get(n)
        if not b:
            continue
        mark = " (oversubscribed)" if is_oversubscribed(n, cpus) else ""
        size = int(b["size"])
        parts = []
        for op in BOUND_OPS:
            for system in systems:
                row = row_near(table.get((system, n, op), {}), size)
                if row is not None and b["per_stream_gbps"] > 0:
                    ratio = row["busbw"] / b["per_stream_gbps"]
                    parts.append(f"{op} {system} {row['busbw']:.2f} ({ratio:.0%})")
        print(
            f"# memory bound np={n}{mark}, {human(size)}: aggregate {b['aggregate_gbps']:.2f} "
            f"GB/s, per rank {b['per_stream_gbps']:.2f} GB/s; " + ("; ".join(parts) or "-")
        )


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


MAX_NP = 1024  # more ranks than this on one host is a typo


def parse_nps(text: str) -> list[int]:
    """--np: a comma list of rank counts (1..MAX_NP), duplicates dropped, order kept."""
    nps: list[int] = []
    for part in _csv(text):
        if not re.fullmatch(r"\d+", part) or not 1 <= int(part) <= MAX_NP:
            raise ValueError(f"--np: {part!r} is not a rank count from 1 to {MAX_NP}")
        if int(part) not in nps:
            nps.append(int(part))
    if not nps:
        raise ValueError(f"--np: no rank count in {text!r}")
    return nps


def parse_sizes(text: str) -> list[int]:
    """--sizes: a comma list of byte counts with optional K/M/G (powers of 1024)."""
    sizes = []
    for part in _csv(text):
        m = re.fullmatch(r"(\d+)([kKmMgG]?)[iI]?[bB]?", part)
        if m is None or int(m.group(1)) == 0:
            raise ValueError(f"--sizes: {part!r} is not a size (e.g. 8, 4K, 64M)")
        sizes.append(
            int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
        )
    if not sizes:
        raise ValueError(f"--sizes: no size in {text!r}")
    return sizes


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
    p.add_argument(
        "--mpi-bind",
        default="none",
        choices=("none", "core", "hwthread", "l3cache", "numa", "package"),
        help="Open MPI's --bind-to (default none: the other systems' ranks are not pinned)",
    )
    p.add_argument(
        "--bound",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the memory-system bound at every np (benchmarks/membw.c; default on)",
    )
    p.add_argument(
        "--baseline",
        metavar="DIR",
        help="an earlier run's output directory (its raw/*.json): every row's time against it",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.10,
        help="with --baseline, rows slower by more than this fraction are marked (default 0.10)",
    )
    p.add_argument(
        "--deadline",
        type=float,
        help="seconds from the start by which the runs must end: later runs are skipped, the "
        "last one cut short (its printed rows kept), and the report is still written",
    )
    args = p.parse_args(argv)

    systems = checked_csv(p, args.systems, SYSTEMS, "system", "--systems")
    ops = checked_csv(p, args.ops, OPS, "op", "--ops")
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    try:
        nps = parse_nps(args.np)
        size_values = parse_sizes(sizes)
    except ValueError as e:
        p.error(str(e))
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if args.timeout <= 0 or (args.deadline is not None and args.deadline <= 0):
        p.error("--timeout and --deadline must be positive")
    base: Optional[Table] = None
    if args.baseline:
        try:
            base = load_baseline(args.baseline)
        except (OSError, ValueError) as e:
            p.error(f"--baseline: {e}")
    t_begin = time.monotonic()
    cpus = cpus_available()
    over = [n for n in nps if is_oversubscribed(n, cpus)]
    if over:
        _say(f"np {','.join(map(str, over))} oversubscribed: more ranks than {cpus} CPUs")
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
    bounds = measure_bounds(nps, bound_size(size_values), args.thp, raw) if args.bound else {}

    t_start = time.monotonic()
    load_before = _loadavg()
    runs = plan_runs(
        systems, nps, bench_args, raw, mpi_version, args.repeat, args.thp, cpus, args.mpi_bind
    )
    # SIGTERM (a time limit's `timeout`) or Ctrl-C: end the run in progress, skip the rest and
    # still write the report.
    signal.signal(signal.SIGTERM, _on_signal)
    stopped = ""
    for i, run in enumerate(runs, 1):
        what = f"[{i}/{len(runs)}] {run.system} np={np_label(run.nranks, cpus)}"
        if _STOP and not stopped:
            stopped = f"stopped by {_STOP[0]}"
        if stopped:
            run.status = f"skipped: {stopped}"
            continue
        if run.system.startswith("mpi") and mpi_problem:
            run.status = f"skipped: {mpi_problem}"
            continue
        timeout = args.timeout
        if args.deadline is not None:
            left = args.deadline - (time.monotonic() - t_begin)
            if left < MIN_RUN_S:
                run.status = f"skipped: deadline ({max(left, 0):.0f} s left of {args.deadline:.0f})"
                _say(f"{what}: {run.status}")
                continue
            timeout = min(timeout, left)
        _say(f"{what} ...")
        try:
            execute(run, timeout)
        except (Stopped, KeyboardInterrupt) as e:
            stopped = f"stopped by {e or 'SIGINT'}"
        _say(f"{what}: {run.status} ({run.seconds:.0f} s, load {_loadavg()})")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
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
    write_markdown(md, runs, systems, nps, ops, info, memcpy, settings, bounds, cpus)
    if base is not None:
        against = baseline_rows(index(runs), base, systems, nps, ops)
        with open(md, "a", encoding="utf-8") as f:
            f.write("\n" + "\n".join(baseline_table(against, args.tolerance, cpus)))
        slower = [r for r in against if r[5] > r[4] * (1 + args.tolerance)]
        print(
            f"# against {args.baseline}: {len(slower)} of {len(against)} rows slower by more "
            f"than {args.tolerance:.0%}"
        )
        for system, op, n, size, t0, t1 in slower:
            print(
                f"#   {system} {op} np={n} {human(size)}: {_fmt_us(t0)} -> {_fmt_us(t1)} us "
                f"({t1 / t0:.2f}x)"
            )
    if have_plots:
        plot(args.out, runs, systems, nps, ops, memcpy, bounds, cpus)
    else:
        _say("matplotlib not available: no plots (pip install matplotlib)")
    print_ratios(runs, nps, ops, cpus)
    print_bounds(runs, systems, nps, bounds, cpus)
    print(
        f"# memcpy (one core, 64 MiB): {memcpy:.2f} GB/s; load average {load_before} -> "
        f"{settings['load_after']}; {elapsed:.0f} s"
    )
    print(f"# report: {md}")
    for run in runs:
        if run.status != "ok":
            print(f"# {run.system} np={np_label(run.nranks, cpus)}: {run.status}")
    return 1 if any(r.status.startswith("WRONG") for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
