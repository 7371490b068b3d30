"""xccl on CUDA tensors against torch.distributed's gloo and the GPU's own copy, in one run.

    python benchmarks/compare_gpu.py                    # np 2 and 4, 8 B .. 256 MiB (~2 min)
    python benchmarks/compare_gpu.py --quick            # fewer sizes, shorter loops (~1 min)
    python benchmarks/compare_gpu.py --deadline 150     # always ends, with a report, in 150 s

Systems, each run one after the other on this machine, all ranks sharing one GPU (the first
of CUDA_VISIBLE_DEVICES, else GPU 0: the issue's setting, 2 and 4 processes on one H100):

========  ==================================================================================
xccl      ``xccl-bench --device cuda``: xccl's torch.distributed API on CUDA tensors
gloo      ``xccl-bench --device cuda --backend gloo``: torch.distributed's gloo on the same
          CUDA tensors (gloo copies them to pinned host memory, runs on the CPU and copies
          back; it has no CUDA send/recv, so its ping-pong is staged the same way by the
          harness)
copy      the GPU's device-to-device copy (torch ``copy_``, a cudaMemcpyAsync, or CuPy's
          memcpyAsync) of every size, one process, timed with CUDA events: the bandwidth
          reported is bytes copied per second (each byte read once and written once)
========  ==================================================================================

Both libraries run the same harness (xccl.bench: same loop, same correctness check of every
size, nccl-tests' formulas): time is the mean per-call time over ranks, calls posted back
to back and timed until the device has finished the last one; busbw uses nccl-tests'
factors. Each operation is timed in the form a torch.distributed program uses (all_reduce
and broadcast in place, the others out of place). gloo is slow at large sizes: its loops are
capped (``--gloo-iters``, default 2 timed calls after one warm-up).

Output (``--out``, default ./gpu-out/compare): ``gpu.md`` (machine, targets met or missed
with the measured numbers, summary, one table per operation and rank count with the ratios
xccl/gloo = t(gloo) / t(xccl) and xccl busbw / copy bandwidth), ``gpu.json`` (the same,
machine-readable) and ``gpu_raw/`` (each run's table and JSON, the copy's; a name of its own,
so that ``--out benchmarks/results`` sits beside compare.py's files). The issue's targets,
evaluated at np=2: 256 MiB all_reduce busbw at least half the copy bandwidth at 256 MiB;
8-byte all_reduce under 30 µs; every collective at least 20x gloo from 1 MiB.

``--deadline SEC`` stops starting runs that could not end in time and cuts the last one short
(its rows so far are read back from its log), so a fixed time limit still ends with a
report; each run gets a share of the time left that leaves the later runs their minimum.
Without a usable GPU it stops at once with the reason (exit status 2). Exit status 1: a run
reported wrong results or xccl failed; a missed target is reported, not an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import compare as cmp  # noqa: E402  (benchmarks/compare.py: runs, logs, tables)

SYSTEMS = ("xccl", "gloo")
OPS = cmp.OPS  # all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, pingpong
COLLECTIVES = tuple(op for op in OPS if op != "pingpong")

FULL_SIZES = cmp.FULL_SIZES  # 8 B .. 256 MiB
QUICK_SIZES = "8,4K,1M,16M,256M"  # still every size a target is measured at

# The targets (2 ranks sharing the GPU, one run).
TARGET_NP = 2
BW_SIZE = 256 << 20
BW_TARGET = 0.5  # all_reduce busbw / copy bandwidth at BW_SIZE
LAT_SIZE = 8
LAT_TARGET_US = 30.0  # all_reduce time at LAT_SIZE, strictly less
GLOO_TARGET = 20.0  # t(gloo) / t(xccl) of every collective ...
GLOO_FROM = 1 << 20  # ... at every size from this one

MIN_RUN_S = 20.0  # under --deadline, a run starts only with this much time left
# Under --deadline, the least time each later run is left when a run's timeout is set.
RESERVE_S = {"xccl": 30.0, "gloo": 20.0}
COPY_TIMEOUT_S = 90.0

XCCL_BENCH = cmp.XCCL_BENCH


@dataclasses.dataclass(frozen=True)
class Loops:
    """Iteration settings of one system (xccl-bench's -n, -w, --mintime)."""

    iters: int
    warmup: int
    mintime: float

    def args(self) -> list[str]:
        return ["-n", str(self.iters), "-w", str(self.warmup), "--mintime", f"{self.mintime:g}"]


def default_loops(quick: bool) -> dict[str, Loops]:
    """xccl: nccl-tests-like loops; gloo: capped (its large sizes take a second a call)."""
    if quick:
        return {"xccl": Loops(10, 3, 0.02), "gloo": Loops(1, 1, 0.01)}
    return {"xccl": Loops(20, 5, 0.1), "gloo": Loops(2, 1, 0.05)}


def _say(msg: str) -> None:
    print(f"compare_gpu: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# The device copy (run in a child process: --copy-worker)
# --------------------------------------------------------------------------------------------


def copy_bandwidth(sizes: Sequence[int], mintime: float) -> dict[str, Any]:
    """Times a device-to-device copy of every size on GPU 0 with CUDA events (torch, else
    CuPy): a warm-up, then enough back-to-back copies to last `mintime`. Returns
    ``{"meta": {...}, "rows": [{"size", "time_us", "gbps", "iters"}]}``, gbps = bytes copied
    per second / 1e9. The largest copy is compared with its source."""
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
        return _copy_torch(torch, sizes, mintime)
    except ImportError:
        pass
    import cupy

    return _copy_cupy(cupy, sizes, mintime)


def _iters_for(one_s: float, mintime: float) -> int:
    """Copies in a timed loop: enough to last `mintime` at `one_s` a copy, 5 .. 100000."""
    return int(min(100_000, max(5, math.ceil(mintime / max(one_s, 1e-7)))))


def _copy_torch(torch: Any, sizes: Sequence[int], mintime: float) -> dict[str, Any]:
    dev = torch.device("cuda", 0)
    big = max(sizes)
    src = torch.randint(0, 256, (big,), dtype=torch.uint8, device=dev)
    dst = torch.zeros_like(src)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    rows = []
    for size in sizes:
        s, d = src[:size], dst[:size]
        for _ in range(3):
            d.copy_(s)
        start.record()
        d.copy_(s)
        end.record()
        end.synchronize()
        iters = _iters_for(start.elapsed_time(end) / 1e3, mintime)
        start.record()
        for _ in range(iters):
            d.copy_(s)
        end.record()
        end.synchronize()
        sec = start.elapsed_time(end) / 1e3 / iters
        rows.append({"size": size, "time_us": sec * 1e6, "gbps": size / sec / 1e9, "iters": iters})
    if not bool(torch.equal(dst, src)):
        raise RuntimeError("the device copy is wrong: destination differs from source")
    props = torch.cuda.get_device_properties(dev)
    meta = {
        "library": f"torch {torch.__version__}",
        "gpu": props.name,
        "compute capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "gpu memory": f"{props.total_memory / (1 << 30):.1f} GiB",
        "cuda runtime (torch)": str(torch.version.cuda),
    }
    return {"meta": meta, "rows": rows}


def _copy_cupy(cupy: Any, sizes: Sequence[int], mintime: float) -> dict[str, Any]:
    rt = cupy.cuda.runtime
    big = max(sizes)
    with cupy.cuda.Device(0):
        src = (cupy.arange(big, dtype=cupy.int32) % 251).astype(cupy.uint8)
        dst = cupy.zeros_like(src)
        stream = cupy.cuda.get_current_stream()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()

        def copy(n: int) -> None:
            rt.memcpyAsync(dst.data.ptr, src.data.ptr, n, rt.memcpyDeviceToDevice, stream.ptr)

        rows = []
        for size in sizes:
            for _ in range(3):
                copy(size)
            start.record(stream)
            copy(size)
            end.record(stream)
            end.synchronize()
            iters = _iters_for(cupy.cuda.get_elapsed_time(start, end) / 1e3, mintime)
            start.record(stream)
            for _ in range(iters):
                copy(size)
            end.record(stream)
            end.synchronize()
            sec = cupy.cuda.get_elapsed_time(start, end) / 1e3 / iters
            rows.append(
                {"size": size, "time_us": sec * 1e6, "gbps": size / sec / 1e9, "iters": iters}
            )
        if not bool((dst == src).all()):
            raise RuntimeError("the device copy is wrong: destination differs from source")
        props = rt.getDeviceProperties(0)
    name = props["name"]
    meta = {
        "library": f"cupy {cupy.__version__}",
        "gpu": name.decode() if isinstance(name, bytes) else str(name),
        "compute capability": f"{props['major']}.{props['minor']}",
        "cuda runtime (cupy)": str(rt.runtimeGetVersion()),
    }
    return {"meta": meta, "rows": rows}


def measure_copy(
    sizes: Sequence[int], mintime: float, raw: str, timeout: float, env: dict[str, str]
) -> tuple[dict[int, dict[str, Any]], dict[str, Any], str]:
    """Runs the copy measurement in a child process. Returns (size -> row, the GPU facts it
    read, "ok" or why there is no copy bandwidth)."""
    path = os.path.join(raw, "copy.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--copy-worker", "--json", path]
    cmd += ["--sizes", ",".join(str(s) for s in sizes), "--mintime", f"{mintime:g}"]
    try:
        out = subprocess.run(
            cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {}, {}, f"timed out after {timeout:.0f} s"
    with open(os.path.join(raw, "copy.txt"), "w", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n" + out.stdout + out.stderr)
    if out.returncode != 0 or not os.path.exists(path):
        last = (out.stderr.strip() or out.stdout.strip() or "no output").splitlines()[-1]
        return {}, {}, f"failed (exit {out.returncode}): {last[:200]}"
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return {int(r["size"]): r for r in data["rows"]}, data.get("meta", {}), "ok"


# --------------------------------------------------------------------------------------------
# Facts and runs
# --------------------------------------------------------------------------------------------


def gpu_problem() -> Optional[str]:
    """Why no GPU run can happen here (no torch/CuPy with a CUDA device), or None. Counts
    devices without creating a CUDA context in this process."""
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return None
        if torch.version.cuda is None:
            return f"torch {torch.__version__} was built without CUDA"
        return f"torch {torch.__version__} sees no CUDA device (no GPU or no driver)"
    if importlib.util.find_spec("cupy") is not None:
        import cupy

        try:
            if cupy.cuda.runtime.getDeviceCount() > 0:
                return None
        except Exception as e:  # cupy's CUDARuntimeError
            return f"CuPy sees no CUDA device: {e}"
        return "CuPy sees no CUDA device"
    return "neither torch nor CuPy is installed"


def nvidia_smi() -> dict[str, str]:
    """GPU name, driver and memory as nvidia-smi reports them (GPU 0; {} without it)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    query = "name,driver_version,memory.total"  # fields every driver knows (one unknown: none)
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={query}", "--format=csv,noheader", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if out.returncode != 0 or not out.stdout.strip():
        return {}
    cells = [c.strip() for c in out.stdout.strip().splitlines()[0].split(",")]
    keys = ["gpu (nvidia-smi)", "driver", "gpu memory (nvidia-smi)"]
    return dict(zip(keys, cells, strict=False))


def xccl_cuda_facts(env: dict[str, str]) -> dict[str, str]:
    """xccl.cuda.is_available() and build_info(), read in a child process."""
    code = (
        "import json, xccl.cuda as c\n"
        "info = c.build_info() if hasattr(c, 'build_info') else None\n"
        "print(json.dumps({'available': c.is_available(), 'build_info': info}, default=str))\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        return {"xccl.cuda": "timed out"}
    if out.returncode != 0:
        last = (out.stderr.strip() or "no output").splitlines()[-1]
        return {"xccl.cuda": f"cannot be imported: {last[:200]}"}
    try:
        data = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"xccl.cuda": out.stdout.strip()[:200]}
    facts = {"xccl.cuda.is_available()": str(data.get("available"))}
    info = data.get("build_info")
    if isinstance(info, dict):
        for key, value in info.items():
            facts[f"xccl cuda {key}"] = str(value)
    elif info is not None:
        facts["xccl.cuda.build_info()"] = str(info)
    return facts


def package_env() -> dict[str, str]:
    """The environment every child gets: one GPU only (the first of CUDA_VISIBLE_DEVICES, or
    GPU 0), so that every rank and the copy use the same one, as the issue's setting has it;
    the source tree's python/ when xccl is not installed (built in place); one OpenMP
    thread."""
    visible = cmp._csv(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": visible[0] if visible else "0"}
    if importlib.util.find_spec("xccl") is None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.path.join(ROOT, "python"), os.environ.get("PYTHONPATH", "")) if p
        )
    return env


def plan_runs(
    systems: Sequence[str],
    nps: Sequence[int],
    ops: Sequence[str],
    sizes: str,
    loops: dict[str, Loops],
    raw: str,
    op_timeout: float,
    env: dict[str, str],
) -> list[cmp.Run]:
    """The command of every (rank count, system), in the order they run: np by np, xccl
    first, so that a deadline cuts the largest rank count's gloo run first."""
    runs = []
    for n in nps:
        for system in systems:
            stem = os.path.join(raw, f"{system}_np{n}")
            cmd = [*XCCL_BENCH, "--device", "cuda", "--np", str(n), "--backend", system]
            cmd += ["-o", ",".join(ops), "--sizes", sizes, *loops[system].args()]
            cmd += ["-c", "1", "--placement", "primary", "-T", f"{op_timeout:g}"]
            cmd += ["--json", stem + ".json", "--no-progress"]
            run = cmp.Run(system, n, 0, cmd, dict(env), stem + ".json", stem + ".txt")
            run.cpus = cmp.cpus_available()
            runs.append(run)
    return runs


def run_timeout(
    left: float, later: Sequence[str], cap: float, min_run: Optional[float] = None
) -> Optional[float]:
    """The timeout of the next run with `left` seconds to the deadline and the systems of the
    runs after it in `later`: what leaves each of those its reserve, at least `min_run`
    (default MIN_RUN_S), never more than `left` or `cap`. None: too little time left to
    start it."""
    min_run = MIN_RUN_S if min_run is None else min_run
    if left < min_run:
        return None
    reserve = sum(RESERVE_S.get(s, min_run) for s in later)
    return min(cap, left, max(min_run, left - reserve))


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------

Copy = dict[int, dict[str, Any]]  # size -> copy row (gbps: bytes copied per second / 1e9)


def copy_gbps(copy: Copy, size: int) -> Optional[float]:
    """The copy bandwidth at `size` (or at the measured size within 1 % of it)."""
    row = cmp.row_near(copy, size)
    return None if row is None else float(row["gbps"])


@dataclasses.dataclass
class Target:
    """One of the issue's targets as this run measured it."""

    name: str
    verdict: str  # "met", "missed" or "not measured"
    measured: str  # the numbers behind the verdict


def targets(table: cmp.Table, copy: Copy, n: int = TARGET_NP) -> list[Target]:
    """The issue's three targets at `n` ranks from the measured rows."""
    out = []
    ar = table.get(("xccl", n, "all_reduce"), {})

    name = (
        f"{cmp.human(BW_SIZE)} all_reduce busbw ≥ {BW_TARGET:.0%} of the device copy "
        f"bandwidth (np={n})"
    )
    row, bw = ar.get(BW_SIZE), copy_gbps(copy, BW_SIZE)
    if row is None or bw is None or bw <= 0:
        missing = "xccl's all_reduce" if row is None else "the copy bandwidth"
        out.append(Target(name, "not measured", f"{missing} at {cmp.human(BW_SIZE)} is missing"))
    else:
        ratio = row["busbw"] / bw
        verdict = "met" if ratio >= BW_TARGET else "missed"
        text = f"busbw {row['busbw']:.1f} GB/s = {ratio:.1%} of copy {bw:.1f} GB/s"
        if verdict == "missed":
            text += f" (needs {BW_TARGET * bw:.1f} GB/s: {BW_TARGET * bw / row['busbw']:.2f}x)"
        out.append(Target(name, verdict, text))

    name = f"{LAT_SIZE}-byte all_reduce < {LAT_TARGET_US:g} µs (np={n})"
    row = ar.get(LAT_SIZE)
    if row is None:
        out.append(Target(name, "not measured", f"xccl's {LAT_SIZE} B all_reduce is missing"))
    else:
        t = row["time_us"]
        verdict = "met" if t < LAT_TARGET_US else "missed"
        text = f"{cmp._fmt_us(t)} µs"
        if verdict == "missed":
            text += f" ({t / LAT_TARGET_US:.2f}x the target)"
        out.append(Target(name, verdict, text))

    name = f"every collective ≥ {GLOO_TARGET:g}x gloo from {cmp.human(GLOO_FROM)} (np={n})"
    worst: list[tuple[float, str]] = []
    unmeasured = []
    for op in COLLECTIVES:
        ratios = [
            (r, size)
            for size in sorted(table.get(("xccl", n, op), {}))
            if size >= GLOO_FROM
            for r in [cmp.speedup(table, "xccl", "gloo", n, op, size)]
            if r is not None
        ]
        if not ratios:
            unmeasured.append(op)
            continue
        r, size = min(ratios)
        worst.append((r, f"{op} {r:.1f}x at {cmp.human(size)}"))
    below = [text for r, text in sorted(worst) if r < GLOO_TARGET]
    if below:
        verdict, text = "missed", "below: " + "; ".join(below)
    elif unmeasured:
        verdict, text = "not measured", "no rows of both at these sizes: " + ", ".join(unmeasured)
    else:
        verdict, text = "met", "lowest: " + "; ".join(t for _, t in sorted(worst)[:2])
    if unmeasured and below:
        text += "; not measured: " + ", ".join(unmeasured)
    out.append(Target(name, verdict, text))
    return out


def _verdict_md(verdict: str) -> str:
    return {"met": "**met**", "missed": "**MISSED**"}.get(verdict, verdict)


def summary_rows(
    table: cmp.Table, copy: Copy, nps: Sequence[int], ops: Sequence[str]
) -> list[list[str]]:
    """Per (op, np): the smallest size's time of xccl and gloo, the lowest xccl/gloo ratio
    from GLOO_FROM, and the largest size's xccl busbw and its share of the copy bandwidth."""
    rows = []
    for op in ops:
        for n in nps:
            sizes = cmp._sizes(table, SYSTEMS, n, op)
            if not sizes:
                continue
            small, big = sizes[0], sizes[-1]
            ratios = [
                r
                for s in sizes
                if s >= GLOO_FROM
                for r in [cmp.speedup(table, "xccl", "gloo", n, op, s)]
                if r is not None
            ]
            x = table.get(("xccl", n, op), {}).get(big)
            bw = copy_gbps(copy, big)
            rows.append(
                [
                    op,
                    str(n),
                    cmp.human(small),
                    cmp._cell(table, "xccl", n, op, small, "time"),
                    cmp._cell(table, "gloo", n, op, small, "time"),
                    cmp._fmt_ratio(min(ratios) if ratios else None),
                    cmp.human(big),
                    "-" if x is None else f"{x['busbw']:.1f}",
                    "-" if x is None or not bw else f"{x['busbw'] / bw:.0%}",
                ]
            )
    return rows


def op_table(table: cmp.Table, copy: Copy, n: int, op: str) -> list[list[str]]:
    """Per size: xccl's and gloo's time (busbw), the copy bandwidth, xccl/gloo and xccl's
    busbw / copy bandwidth."""
    rows = []
    for size in cmp._sizes(table, SYSTEMS, n, op):
        x = table.get(("xccl", n, op), {}).get(size)
        bw = copy_gbps(copy, size)
        rows.append(
            [
                cmp.human(size),
                cmp._cell(table, "xccl", n, op, size, "both"),
                cmp._cell(table, "gloo", n, op, size, "both"),
                "-" if bw is None else f"{bw:.1f}",
                cmp._fmt_ratio(cmp.speedup(table, "xccl", "gloo", n, op, size)),
                "-" if x is None or not bw else f"{x['busbw'] / bw:.1%}",
            ]
        )
    return rows


def write_report(
    out_dir: str,
    runs: Sequence[cmp.Run],
    copy: Copy,
    copy_status: str,
    nps: Sequence[int],
    ops: Sequence[str],
    info: dict[str, str],
    settings: dict[str, Any],
) -> tuple[str, list[Target]]:
    """Writes gpu.md and gpu.json into `out_dir`. Returns (gpu.md's path, the targets)."""
    table = cmp.index(runs)
    goals = targets(table, copy)
    lines = ["# xccl on CUDA tensors: against gloo and the device copy", ""]
    lines.append(f"Command: `{settings['command']}`  ")
    lines.append(f"Date: {settings['date']}; total time {settings['elapsed']:.0f} s")
    lines.append("")
    lines += cmp._md_table(["machine", ""], [[k, v] for k, v in info.items()])
    lines.append(
        "Every rank uses GPU 0 (one process per rank, no MPS). Time: mean per-call time over "
        "ranks, calls posted back to back and timed until the device finished the last one "
        "(nccl-tests); busbw: nccl-tests' factors (all_reduce 2(n-1)/n; all_gather, "
        "reduce_scatter, all_to_all (n-1)/n; broadcast, pingpong 1); pingpong time is one "
        "way. Every size was checked against analytically known results (`-c 1`). *copy*: "
        "the same GPU's device-to-device copy of the same size in this run, bytes copied per "
        "second (one process). *xccl/gloo*: t(gloo) / t(xccl) (> 1: xccl is faster). gloo "
        "copies CUDA tensors through pinned host memory and reduces on the CPU; it has no "
        "CUDA send/recv, so its pingpong copies through pinned host buffers in the harness."
    )
    lines.append("")
    run_rows = [["copy", copy_status, "-", "-"]]
    run_rows += [
        [
            f"{r.system} np={r.nranks}",
            r.status,
            f"{r.seconds:.0f}",
            ",".join(r.meta.get("transports") or []) or "-",
        ]
        for r in runs
    ]
    lines += cmp._md_table(["run", "status", "seconds", "transports"], run_rows)
    lines += ["## Targets", ""]
    lines += cmp._md_table(
        ["target", "verdict", "measured"],
        [[g.name, _verdict_md(g.verdict), g.measured] for g in goals],
    )
    lines += ["## Summary", ""]
    lines += cmp._md_table(
        [
            "op",
            "np",
            "small",
            "xccl (µs)",
            "gloo (µs)",
            f"min xccl/gloo from {cmp.human(GLOO_FROM)}",
            "large",
            "xccl busbw (GB/s)",
            "busbw/copy",
        ],
        summary_rows(table, copy, nps, ops),
    )
    for op in ops:
        for n in nps:
            rows = op_table(table, copy, n, op)
            if not rows:
                continue
            lines += [f"## {op}, np={n}", "", "time in µs (busbw in GB/s)", ""]
            head = ["size", "xccl", "gloo", "copy (GB/s)", "xccl/gloo", "xccl busbw/copy"]
            lines += cmp._md_table(head, rows)
    md = os.path.join(out_dir, "gpu.md")
    with open(md, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    data = {
        "meta": {**settings, "machine": info, "copy_status": copy_status},
        "targets": [dataclasses.asdict(g) for g in goals],
        "copy": [copy[s] for s in sorted(copy)],
        "runs": [
            {
                "system": r.system,
                "nranks": r.nranks,
                "status": r.status,
                "seconds": r.seconds,
                "rows": r.rows,
            }
            for r in runs
        ],
    }
    with open(os.path.join(out_dir, "gpu.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    return md, goals


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="compare_gpu.py",
        description="xccl on CUDA tensors vs torch.distributed gloo vs the device copy.",
    )
    p.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, shorter loops")
    p.add_argument("--np", default="2,4", help="rank counts, all on GPU 0 (default 2,4)")
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="xccl, gloo or both (default); the copy is always measured",
    )
    p.add_argument("--ops", default=",".join(OPS), help=f"default {','.join(OPS)}")
    p.add_argument("--sizes", help=f"comma list of sizes (default {FULL_SIZES})")
    p.add_argument("-n", "--iters", type=int, help="xccl's timed iterations, at least")
    p.add_argument("-w", "--warmup", type=int, help="xccl's warm-up iterations")
    p.add_argument("--mintime", type=float, help="seconds each xccl timed loop lasts at least")
    p.add_argument(
        "--gloo-iters", type=int, help="gloo's timed iterations, at most (default 2; quick 1)"
    )
    p.add_argument(
        "--out",
        default=os.path.join(os.getcwd(), "gpu-out", "compare"),
        help="output directory (default ./gpu-out/compare)",
    )
    p.add_argument(
        "--timeout", type=float, default=900.0, help="seconds one run may take (default 900)"
    )
    p.add_argument(
        "--op-timeout",
        type=float,
        default=60.0,
        help="seconds before one operation fails in a run (xccl-bench -T; default 60)",
    )
    p.add_argument(
        "--deadline",
        type=float,
        help="seconds from the start by which everything must end: later runs are skipped, "
        "the last one cut short (its printed rows kept), and the report is still written",
    )
    p.add_argument("--copy-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    return p


def _copy_worker(args: argparse.Namespace, sizes: list[int]) -> int:
    mintime = args.mintime if args.mintime is not None else 0.05
    data = copy_bandwidth(sizes, mintime)
    text = json.dumps(data, indent=1)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Measures the copy, then every system at every rank count, then writes the report."""
    p = build_parser()
    args = p.parse_args(argv)
    systems = cmp.checked_csv(p, args.systems, SYSTEMS, "system", "--systems")
    ops = cmp.checked_csv(p, args.ops, OPS, "op", "--ops")
    sizes_text = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    try:
        nps = cmp.parse_nps(args.np)
        sizes = sorted(set(cmp.parse_sizes(sizes_text)))
    except ValueError as e:
        p.error(str(e))
    for name in ("iters", "warmup", "gloo_iters"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')} must be at least {0 if name == 'warmup' else 1}")
    if args.mintime is not None and args.mintime < 0:
        p.error("--mintime must not be negative")
    for name in ("timeout", "op_timeout", "deadline"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.copy_worker:
        return _copy_worker(args, sizes)

    t_begin = time.monotonic()
    why = gpu_problem()
    if why is not None:
        print(f"compare_gpu.py: no usable GPU: {why}", file=sys.stderr)
        return 2
    loops = default_loops(args.quick)
    x = loops["xccl"]
    loops["xccl"] = Loops(
        args.iters if args.iters is not None else x.iters,
        args.warmup if args.warmup is not None else x.warmup,
        args.mintime if args.mintime is not None else x.mintime,
    )
    if args.gloo_iters is not None:
        loops["gloo"] = dataclasses.replace(loops["gloo"], iters=args.gloo_iters)
    sizes_arg = ",".join(str(s) for s in sizes)

    raw = os.path.join(args.out, "gpu_raw")
    os.makedirs(raw, exist_ok=True)
    # SIGTERM (a time limit's `timeout`): end the run in progress, skip the rest, still report.
    signal.signal(signal.SIGTERM, cmp._on_signal)
    env = package_env()
    info = cmp.machine_info()
    info.update(nvidia_smi())
    if "xccl" in systems:
        info.update(xccl_cuda_facts(env))

    def left() -> float:
        return math.inf if args.deadline is None else args.deadline - (time.monotonic() - t_begin)

    _say(f"device copy of {len(sizes)} sizes ...")
    copy, gpu_facts, copy_status = measure_copy(
        sizes, 0.02 if args.quick else 0.05, raw, min(COPY_TIMEOUT_S, max(left(), 1.0)), env
    )
    info.update(gpu_facts)
    for size in (BW_SIZE, max(sizes)):
        bw = copy_gbps(copy, size)
        if bw is not None:
            _say(f"device copy, {cmp.human(size)}: {bw:.1f} GB/s")
            break
    else:
        _say(f"device copy: {copy_status}")

    runs = plan_runs(systems, nps, ops, sizes_arg, loops, raw, args.op_timeout, env)
    stopped = ""
    for i, run in enumerate(runs, 1):
        what = f"[{i}/{len(runs)}] {run.system} np={run.nranks}"
        if cmp._STOP and not stopped:
            stopped = f"stopped by {cmp._STOP[0]}"
        if stopped:
            run.status = f"skipped: {stopped}"
            continue
        timeout = run_timeout(left(), [r.system for r in runs[i:]], args.timeout)
        if timeout is None:
            run.status = f"skipped: deadline ({max(left(), 0):.0f} s left)"
            _say(f"{what}: {run.status}")
            continue
        _say(f"{what} (up to {timeout:.0f} s) ...")
        try:
            cmp.execute(run, timeout)
        except (cmp.Stopped, KeyboardInterrupt) as e:
            stopped = f"stopped by {e or 'SIGINT'}"
        _say(f"{what}: {run.status} ({run.seconds:.0f} s)")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    settings = {
        "command": " ".join(["python benchmarks/compare_gpu.py", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "elapsed": time.monotonic() - t_begin,
        "sizes": sizes,
        "loops": {k: dataclasses.asdict(v) for k, v in loops.items()},
    }
    md, goals = write_report(args.out, runs, copy, copy_status, nps, ops, info, settings)
    for g in goals:
        print(f"# target: {g.name}: {g.verdict.upper()}: {g.measured}")
    for run in runs:
        if run.status != "ok":
            print(f"# {run.system} np={run.nranks}: {run.status}")
    print(f"# report: {md}")
    bad = [r for r in runs if r.status.startswith("WRONG")]
    bad += [r for r in runs if r.system == "xccl" and r.status.startswith("failed")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
