"""``xccl-tune`` / ``python -m xccl.tune``: measure which algorithm wins on this machine.

    xccl-tune --np 8,16 --out tune.txt [--colls all_reduce,broadcast] [--sizes 8,64k,1m]
              [--transport shm|tcp] [--budget SECONDS]
    XCCL_TUNE_FILE=tune.txt python train.py      # the selector now uses the table

For each rank count of ``--np`` the tuner launches that many local ranks (:func:`xccl.launch`),
and for each collective and size it runs every algorithm that applies (forced with
``algo=``), a few timed repetitions each, the time of a repetition being the slowest rank's.
It then writes a tuning table (format: ``csrc/algo/tune.c``), which records

- the host signature (CPU model, online cores, transport): the table applies only there;
- for each (collective, np, size range) the algorithm that won, and every measured time
  behind it (``meas`` lines), so that a reader can audit each choice;
- an α-β-γ-δ cost model fitted to all measurements by non-negative least squares on the
  relative error, against each algorithm's cost terms (steps, bytes sent, bytes reduced,
  bytes copied, as :func:`xccl.explain` reports them): the selector prices with it the calls
  the table has no choice for (other sizes, other rank counts).

Ranges: a size measured at s_i covers the sizes from the geometric mean of s_(i-1) and s_i
up to that of s_i and s_(i+1); the smallest measured size covers everything below it, the
largest nothing above it (there the fitted model decides). Adjacent sizes with the same
winner make one range.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any, Optional, TextIO

__all__ = ["COLLECTIVES", "fit_model", "host_signature", "main", "make_table", "tune"]

TABLE_VERSION = 1
PROG = "xccl-tune"
# what the tuner can measure, in the order it measures them (all_to_all_v needs counts of
# its own and is left to the model)
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
               "reduce_scatter", "all_to_all", "barrier")
DEFAULT_SIZES = (8, 1024, 64 << 10, 1 << 20, 16 << 20)
COEFFS = ("alpha", "beta", "gamma", "delta")
TERMS = ("steps", "bytes", "reduce_bytes", "copy_bytes")  # the explain fields each prices


def host_signature() -> tuple[str, int]:
    """(CPU model, online cores) of this host, as the C loader computes them
    (csrc/algo/tune.c, xccl_tune_host): the first "model name" of /proc/cpuinfo, else
    "unknown"."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, val = line.partition(":")
                if sep and key.strip() == "model name" and key.startswith("model name"):
                    cpu = val.strip() or "unknown"
                    break
    except OSError:
        pass
    try:
        cores = int(os.sysconf("SC_NPROCESSORS_ONLN"))
    except (ValueError, OSError):
        cores = os.cpu_count() or 1
    return cpu, max(cores, 1)


def parse_size(text: str) -> int:
    """Bytes from "64", "64k", "1m", "2g" (powers of 1024)."""
    t = text.strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    if not digits.isdigit():
        raise ValueError(f"bad size {text!r} (expected e.g. 8, 64k, 1m)")
    return int(digits) * mult


def _positive_ints(text: str, what: str) -> list[int]:
    out = []
    for tok in text.split(","):
        tok = tok.strip()
        if not tok.isdigit() or int(tok) < 2:
            raise ValueError(f"{what}: {tok!r} is not a rank count >= 2")
        out.append(int(tok))
    return sorted(set(out))


def _canonical_coll(name: str) -> str:
    key = name.strip().lower().replace("_", "")
    for c in COLLECTIVES:
        if c.replace("_", "") == key:
            return c
    raise ValueError(f"unknown collective {name!r} (one of {', '.join(COLLECTIVES)})")


# ------------------------------------------------------------------------------------------
# The measurement, on every rank
# ------------------------------------------------------------------------------------------
def _one_call(coll: str, algo: str, bufs: dict[str, Any], nbytes: int, size: int) -> None:
    """One call of `coll` forced to `algo` on the buffers of `bufs` (inside the timed loops:
    nothing here but the call)."""
    import xccl

    if coll == "all_reduce":
        xccl.all_reduce(bufs["a"][:nbytes], algo=algo)
    elif coll == "broadcast":
        xccl.broadcast(bufs["a"][:nbytes], src=0, algo=algo)
    elif coll == "reduce":
        xccl.reduce(bufs["a"][:nbytes], dst=0, algo=algo)
    elif coll == "all_gather":
        xccl.all_gather_into_tensor(bufs["b"][:nbytes], bufs["a"][:nbytes // size], algo=algo)
    elif coll == "reduce_scatter":
        xccl.reduce_scatter_tensor(bufs["b"][:nbytes // size], bufs["a"][:nbytes], algo=algo)
    elif coll == "all_to_all":
        xccl.all_to_all_single(bufs["b"][:nbytes], bufs["a"][:nbytes], algo=algo)
    elif coll == "barrier":
        xccl.barrier(algo=algo)
    else:  # gather, scatter: the engine's calls (the Python API takes lists of tensors)
        from xccl import _group

        pg = _group.resolve(None)
        part = bufs["a"][:nbytes // size]
        whole = bufs["b"][:nbytes] if pg.rank() == 0 else None
        if coll == "gather":
            pg.comm.gather(part, whole, 0, algo, pg._timeout_arg).wait()
        else:
            pg.comm.scatter(whole, part, 0, algo, pg._timeout_arg).wait()


def _slowest(seconds: float) -> float:
    """The largest of every rank's `seconds` (an all-reduce the model chooses)."""
    import numpy as np

    import xccl

    v = np.array([seconds], dtype=np.float64)
    xccl.all_reduce(v, op=xccl.ReduceOp.MAX)
    return float(v[0])


def _measure_rank(plan: list[tuple[str, int]], target_s: float, reps: int,
                  progress_path: Optional[str]) -> dict[str, Any]:
    """Runs on each rank of one rank count: every applicable algorithm of every (collective,
    nbytes) of `plan`. Returns (rank 0's answer is used) {"times": [[coll, nbytes, algo,
    seconds]], "terms": [[coll, nbytes, algo, steps, bytes, reduce_bytes, copy_bytes]]}."""
    import numpy as np

    import xccl
    from xccl import _group

    size = xccl.get_world_size()
    rank = xccl.get_rank()
    comm = _group.resolve(None).comm
    biggest = max((n for _, n in plan), default=0)
    bufs = {"a": np.zeros(max(biggest, 1), np.uint8), "b": np.zeros(max(biggest, 1), np.uint8)}
    times: list[list[Any]] = []
    terms: list[list[Any]] = []
    done = 0
    prog = open(progress_path, "a", encoding="utf-8") if progress_path and rank == 0 else None
    try:
        for coll, nbytes in plan:
            # every rank computes the same candidates: the rows depend on the group only
            rows = [r for r in comm.explain(coll, nbytes) if r["applicable"]]
            for r in rows:
                algo = r["name"]
                _one_call(coll, algo, bufs, nbytes, size)  # warm-up (and connection set-up)
                t0 = time.perf_counter()
                _one_call(coll, algo, bufs, nbytes, size)
                one = _slowest(time.perf_counter() - t0)
                iters = int(min(max(target_s / max(one, 1e-7) / reps, 1), 2000))
                best = math.inf
                for _ in range(reps):
                    xccl.barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        _one_call(coll, algo, bufs, nbytes, size)
                    best = min(best, _slowest(time.perf_counter() - t0) / iters)
                times.append([coll, nbytes, algo, best])
                terms.append([coll, nbytes, algo] + [float(r[k]) for k in TERMS])
            done += 1
            if prog is not None:
                prog.write(f"{done} np={size} {coll} {nbytes}\n")
                prog.flush()
    finally:
        if prog is not None:
            prog.close()
    return {"times": times, "terms": terms, "model": list(comm.cost_model()[:3])}


# ------------------------------------------------------------------------------------------
# The fit and the table
# ------------------------------------------------------------------------------------------
def fit_model(samples: Sequence[tuple[Sequence[float], float]],
              default: Sequence[float]) -> tuple[list[float], list[bool]]:
    """Non-negative least squares of seconds ≈ α·steps + β·bytes + γ·reduce_bytes +
    δ·copy_bytes over `samples` ((terms, seconds) pairs), weighted by 1/seconds (so that a
    1 µs and a 10 ms time count alike). Returns the four coefficients and, for each, whether
    the samples determined it; a coefficient whose term is zero in every sample (no algorithm
    measured copies memory itself, say) keeps its `default`."""
    import numpy as np

    x = np.array([list(t) for t, _ in samples], dtype=np.float64).reshape(-1, 4)
    y = np.array([s for _, s in samples], dtype=np.float64)
    keep = y > 0
    x, y = x[keep], y[keep]
    known = [bool(len(y) and np.any(x[:, j] > 0)) for j in range(4)]
    coef = [float(d) for d in default]
    cols = [j for j in range(4) if known[j]]
    if not cols:
        return coef, known
    w = 1.0 / y
    a = x[:, cols] * w[:, None]
    b = np.ones_like(y)  # y * w
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)  # columns differ by 10^9 in magnitude
    a = a / scale
    best: Optional[tuple[float, np.ndarray, list[int]]] = None
    # exact NNLS for a handful of unknowns: the best unconstrained fit over every subset of
    # free coefficients whose solution is non-negative (the others held at zero)
    for mask in range(1, 1 << len(cols)):
        sub = [i for i in range(len(cols)) if mask >> i & 1]
        sol, *_ = np.linalg.lstsq(a[:, sub], b, rcond=None)
        if np.any(sol < 0):
            continue
        res = float(np.sum((a[:, sub] @ sol - b) ** 2))
        if best is None or res < best[0]:
            best = (res, sol, sub)
    if best is None:
        return coef, [False] * 4
    for i in range(len(cols)):
        coef[cols[i]] = 0.0
    for k, i in enumerate(best[2]):
        coef[cols[i]] = float(best[1][k] / scale[i])
    return coef, known


def _ranges(sizes: list[int]) -> list[tuple[int, int]]:
    """Byte ranges covered by each measured size (see the module's docstring)."""
    out = []
    for i, s in enumerate(sizes):
        lo = 0 if i == 0 else int(math.sqrt(sizes[i - 1] * s)) + 1
        hi = s if i == len(sizes) - 1 else int(math.sqrt(s * sizes[i + 1]))
        out.append((lo, hi))
    return out


def make_table(times: Sequence[Sequence[Any]], terms: Sequence[Sequence[Any]],
               transport: str, default_model: Sequence[float],
               host: Optional[tuple[str, int]] = None, note: str = "") -> str:
    """The tuning table (text) for measurements `times` (rows [coll, np, nbytes, algo,
    seconds]) and their cost terms `terms` (rows [coll, np, nbytes, algo, steps, bytes,
    reduce_bytes, copy_bytes])."""
    cpu, cores = host if host is not None else host_signature()
    term_of = {(c, int(p), int(n), a): [float(v) for v in rest] for c, p, n, a, *rest in terms}
    samples = [(term_of[(c, int(p), int(n), a)], float(s)) for c, p, n, a, s in times
               if (c, int(p), int(n), a) in term_of]
    coef, known = fit_model(samples, default_model)
    by_key: dict[tuple[str, int], dict[int, dict[str, float]]] = {}
    for c, p, n, a, s in times:
        by_key.setdefault((c, int(p)), {}).setdefault(int(n), {})[a] = float(s)
    lines = [
        f"xccl-tune {TABLE_VERSION}",
        f"# written by {PROG} {time.strftime('%Y-%m-%d %H:%M:%S %Z')}{note}",
        "# the table applies where the host line matches (CPU model, online cores, transport)",
        f"host transport={transport} cores={cores} cpu={cpu}",
        "# seconds ~ alpha*steps + beta*bytes + gamma*reduce_bytes + delta*copy_bytes, fitted "
        f"to {len(samples)} measurements"
        + "".join(f"; {k} not measured (default)"
                  for k, ok in zip(COEFFS, known, strict=True) if not ok),
        "model " + " ".join(f"{k}={v:.6g}" for k, v in zip(COEFFS, coef, strict=True)),
    ]
    order = {c: i for i, c in enumerate(COLLECTIVES)}
    for (coll, np_), per_size in sorted(by_key.items(), key=lambda kv: (order.get(kv[0][0], 99),
                                                                        kv[0][1])):
        sizes = sorted(per_size)
        winners = [min(per_size[s], key=lambda a, s=s: per_size[s][a]) for s in sizes]
        lines.append(f"# {coll}, {np_} ranks")
        spans = _ranges(sizes)
        i = 0
        while i < len(sizes):
            j = i
            while j + 1 < len(sizes) and winners[j + 1] == winners[i]:
                j += 1
            lines.append(f"choose {coll} np={np_} bytes={spans[i][0]}-{spans[j][1]} "
                         f"algo={winners[i]}")
            i = j + 1
        for s, w in zip(sizes, winners, strict=True):
            ts = " ".join(f"{a}={t:.4g}" for a, t in sorted(per_size[s].items(),
                                                              key=lambda kv: kv[1]))
            lines.append(f"meas {coll} np={np_} bytes={s} best={w} {ts}")
    return "\n".join(lines) + "\n"


class _Progress:
    """A plain-text progress bar on stderr, fed by rank 0's progress file."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.total, self.out, self.done = max(total, 1), out, 0
        self.tty = out.isatty()
        self.last_pct = -10

    def show(self, done: int, what: str) -> None:
        self.done = done
        pct = int(100 * done / self.total)
        bar = "#" * (pct * 30 // 100)
        line = f"{PROG} [{bar:<30}] {pct:3d}% {done}/{self.total} {what}"
        if self.tty:
            self.out.write("\r" + line[:110].ljust(110))
        elif pct >= self.last_pct + 10 or done == self.total:
            self.out.write(line + "\n")
            self.last_pct = pct
        self.out.flush()

    def end(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


def tune(nps: Sequence[int], colls: Sequence[str] = COLLECTIVES,
         sizes: Sequence[int] = DEFAULT_SIZES, transport: str = "shm", budget: float = 300.0,
         reps: int = 3, out: Optional[TextIO] = None, timeout: Optional[float] = None) -> str:
    """Measures and returns the tuning table text (see the module's docstring); progress on
    `out` (default stderr). `budget` seconds are spread evenly over the measurements (each
    algorithm at each point runs at least one call per repetition, so a tiny budget takes
    longer). Raises :class:`xccl.LaunchError` when a rank fails."""
    import xccl

    if transport not in ("shm", "tcp"):
        raise ValueError(f"transport must be shm or tcp, got {transport!r}")
    if budget <= 0:
        raise ValueError(f"budget must be > 0 seconds, got {budget}")
    colls = [_canonical_coll(c) for c in colls]
    sizes = sorted(set(int(s) for s in sizes))
    for n in nps:
        if n < 2:
            raise ValueError(f"np must be >= 2, got {n}")
    out = sys.stderr if out is None else out
    plans = {}
    for n in nps:
        plan = []
        for c in colls:
            if c == "barrier":
                plan.append((c, 0))
                continue
            for s in sizes:
                # gather-like sizes are the whole output: a multiple of the ranks
                s2 = s if c in ("all_reduce", "broadcast", "reduce") else max(s // n, 1) * n
                if (c, s2) not in plan:
                    plan.append((c, s2))
        plans[n] = plan
    total = sum(len(p) for p in plans.values())
    progress = _Progress(total, out)
    per_point = budget / total
    times: list[list[Any]] = []
    terms: list[list[Any]] = []
    # what the measurements cannot determine keeps the engine's own value: the transport's
    # α, β and γ as the ranks priced with them, δ the default (explain.c)
    default = [*xccl._C.default_model(), 1.0 / 8.0e9]
    base = 0
    for n in nps:
        fd, path = tempfile.mkstemp(prefix="xccl-tune-", suffix=".progress")
        os.close(fd)
        stop = threading.Event()

        def follow(path: str = path, base: int = base,
                   stop: threading.Event = stop) -> None:
            seen = 0
            while not stop.is_set():
                try:
                    with open(path, encoding="utf-8") as f:
                        lines = f.read().splitlines()
                except OSError:
                    lines = []
                if len(lines) > seen:
                    seen = len(lines)
                    d, _, what = lines[-1].partition(" ")
                    if d.isdigit():
                        progress.show(base + int(d), what)
                stop.wait(0.2)

        th = threading.Thread(target=follow, daemon=True)
        progress.show(base, f"np={n}: starting {n} ranks")
        th.start()
        try:
            res = xccl.launch(_measure_rank, n, plans[n], per_point, reps, path,
                              transport=transport, timeout=timeout,
                              env={"XCCL_TUNE_FILE": ""})
        finally:
            stop.set()
            th.join()
            os.unlink(path)
        base += len(plans[n])
        progress.show(base, f"np={n} done")
        default[:3] = res[0]["model"]
        times += [[c, n, nb, a, s] for c, nb, a, s in res[0]["times"]]
        terms += [[c, n, nb, a, *t] for c, nb, a, *t in res[0]["terms"]]
    progress.end()
    note = f", np={','.join(map(str, nps))}, budget {budget:g} s"
    return make_table(times, terms, transport, default, note=note)


def build_parser() -> argparse.ArgumentParser:
    """The command line of xccl-tune."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Measure every applicable algorithm of each collective on this machine "
        "and write a tuning table for XCCL_TUNE_FILE.")
    p.add_argument("--np", required=True, help="rank counts, comma-separated (e.g. 8,16)")
    p.add_argument("--out", required=True, help="the table to write")
    p.add_argument("--colls", default=",".join(COLLECTIVES),
                   help="collectives, comma-separated (default: all but all_to_all_v)")
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                   help="message sizes in bytes (nccl-tests sense: the whole vector or the "
                   "whole gathered output), e.g. 8,64k,1m (default: 8,1k,64k,1m,16m)")
    p.add_argument("--transport", default="shm", choices=("shm", "tcp"),
                   help="the transport the ranks use (the table applies to it only)")
    p.add_argument("--budget", type=float, default=300.0,
                   help="seconds of measuring to aim for, spread over every point (default 300)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per point (best kept)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds after which a rank count's run is stopped (default: none)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``xccl-tune`` and ``python -m xccl.tune``."""
    args = build_parser().parse_args(argv)
    try:
        nps = _positive_ints(args.np, "--np")
        colls = [_canonical_coll(c) for c in args.colls.split(",") if c.strip()]
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        if args.reps < 1:
            raise ValueError("--reps must be >= 1")
        if not colls or not sizes:
            raise ValueError("--colls and --sizes must name at least one")
        try:
            import numpy  # noqa: F401
        except ImportError as e:
            raise ValueError("xccl-tune needs numpy (pip install numpy)") from e
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    cpu, cores = host_signature()
    over = max(nps) > cores
    print(f"{PROG}: host '{cpu}', {cores} cores, transport {args.transport}"
          + (f" (np={max(nps)} oversubscribes the cores)" if over else ""), file=sys.stderr)
    import xccl

    try:
        table = tune(nps, colls, sizes, args.transport, args.budget, args.reps,
                     timeout=args.timeout)
    except xccl.LaunchError as e:
        print(f"\n{PROG}: a rank failed, no table written: {e}", file=sys.stderr)
        return 1
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(table)
    os.replace(tmp, args.out)
    nchoose = sum(1 for ln in table.splitlines() if ln.startswith("choose "))
    print(f"{PROG}: wrote {args.out} ({nchoose} choices); use it with "
          f"XCCL_TUNE_FILE={args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
