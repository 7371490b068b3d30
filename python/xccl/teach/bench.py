"""``xccl.teach.bench``: measure collectives per algorithm and size, fit α and β, compare with
the model. (``xccl.bench`` is the nccl-tests-like command line, ``python -m xccl.bench``.)

    r = xccl.teach.bench("all_reduce", [2**k for k in range(4, 23, 2)], ["ring", "rd"], nprocs=4)
    r                     # a table; r is also a list of tidy rows (dicts)
    r.fit()               # {"shm": Model(alpha=..., beta=..., gamma=...)}
    r.plot()              # measured (points) against the fitted model (lines), crossover marked

Called outside a process group, ``bench`` starts `nprocs` ranks with :func:`xccl.launch`
(once per transport when given several). Called by every rank of a running job, it measures
on the default group (or `group`) and every rank gets the same rows.

Each row: op, size (bytes, as nccl-tests counts it: the whole vector of an all-reduce or a
broadcast, the whole output of an all-gather, the whole input of a reduce-scatter or an
all-to-all), count (elements per rank's send buffer), dtype, algo, transport, nranks, iters,
time (seconds per operation: each rank's median over its iterations, or their mean, then the
mean over ranks as nccl-tests does), algbw and busbw
(GB/s; busbw = algbw times nccl-tests' factor: 2(p-1)/p for all-reduce, (p-1)/p for
all-gather, reduce-scatter and all-to-all, 1 for broadcast and reduce).

The fit: every algorithm states its cost as steps·α + bytes·β + reduce_bytes·γ
(:func:`xccl.explain`), so the measured times of all algorithms and sizes over one transport
give a linear least-squares problem in α and β (γ, the local reduction speed, is held at the
engine's default: it is hard to separate from β on a few ranks). The fit weighs every point by
1/time², i.e. it minimises relative errors, so small and large messages count alike.
``op="p2p"`` measures a ping-pong between ranks 0 and 1 instead (one message: t = α + β·n),
the textbook way to measure α and β.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Sequence
from typing import Any, Optional, Union

from .model import Model, _fmt_bytes, _fmt_time, canonical_collective, explain

__all__ = ["BenchResult", "bench", "busbw_factor", "fit_model"]

DEFAULT_SIZES = tuple(1 << k for k in range(6, 23, 2))  # 64 B .. 4 MiB
_MAX_ITERS = 1000


def busbw_factor(op: str, nranks: int) -> float:
    """nccl-tests' bus-bandwidth factor of `op` on `nranks` ranks."""
    p = nranks
    if op == "all_reduce":
        return 2 * (p - 1) / p
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (p - 1) / p
    return 1.0


def _cost_terms(op: str, algo: str, nbytes: int, nranks: int) -> tuple[float, float, float]:
    """(steps, bytes, reduce_bytes) of `algo` for `op` (a ping-pong: one message)."""
    if op == "p2p":
        return (1.0, float(nbytes), 0.0)
    for r in explain(op, nbytes, size=nranks):
        if r["name"] == algo:
            return (r["steps"], r["bytes"], r["reduce_bytes"])
    raise ValueError(f"{op} has no algorithm {algo!r}")


def fit_model(rows: Sequence[dict[str, Any]], gamma: Optional[float] = None) -> Model:
    """Least-squares α and β (γ fixed, default the engine's) from measured rows of one
    transport (any algorithms and sizes); see the module documentation."""
    if not rows:
        raise ValueError("fit_model: no rows")
    g = Model.default().gamma if gamma is None else float(gamma)
    pts = []
    for r in rows:
        s, b, red = _cost_terms(r["op"], r["algo"], r["size"], r["nranks"])
        if r["time"] > 0:
            pts.append((s, b, r["time"] - g * red, r["time"], red))
    if not pts:
        raise ValueError("fit_model: no positive times")
    w = [1.0 / (t * t) for _, _, _, t, _ in pts]
    sss = sum(wi * s * s for wi, (s, _, _, _, _) in zip(w, pts, strict=True))
    ssb = sum(wi * s * b for wi, (s, b, _, _, _) in zip(w, pts, strict=True))
    sbb = sum(wi * b * b for wi, (_, b, _, _, _) in zip(w, pts, strict=True))
    ssy = sum(wi * s * y for wi, (s, _, y, _, _) in zip(w, pts, strict=True))
    sby = sum(wi * b * y for wi, (_, b, y, _, _) in zip(w, pts, strict=True))
    det = sss * sbb - ssb * ssb
    alpha = beta = -1.0
    if det > 1e-12 * max(sss * sbb, 1e-300):
        alpha = (ssy * sbb - sby * ssb) / det
        beta = (sss * sby - ssb * ssy) / det
    if alpha < 0 or beta < 0:  # the constrained optimum lies on an axis
        a_only = (max(0.0, ssy / sss) if sss > 0 else 0.0, 0.0)
        b_only = (0.0, max(0.0, sby / sbb) if sbb > 0 else 0.0)

        def cost(ab: tuple[float, float]) -> float:
            return sum(wi * (y - ab[0] * s - ab[1] * b) ** 2
                       for wi, (s, b, y, _, _) in zip(w, pts, strict=True))

        alpha, beta = min((a_only, b_only), key=cost)
    errs = [abs(t - (alpha * s + beta * b + g * red)) / t for s, b, _, t, red in pts]
    transports = {r.get("transport", "") for r in rows}
    return Model(alpha, beta, g, transport=",".join(sorted(transports)), source="fit",
                 rel_error=statistics.median(errs))


class BenchResult(list):  # type: ignore[type-arg]
    """The rows of :func:`bench` (a list of dicts) with the fit and the plot."""

    def __init__(self, rows: Sequence[dict[str, Any]] = ()) -> None:
        super().__init__(rows)

    @property
    def transports(self) -> list[str]:
        return sorted({r["transport"] for r in self})

    def fit(self, gamma: Optional[float] = None) -> dict[str, Model]:
        """α and β per transport: {transport: Model}."""
        return {t: fit_model([r for r in self if r["transport"] == t], gamma)
                for t in self.transports}

    def predicted(self, model: Optional[Model] = None, transport: Optional[str] = None,
                  sizes: Optional[Sequence[int]] = None) -> list[dict[str, Any]]:
        """Tidy rows (size, algo, predicted_s) of the model (default: the fit) for the
        measured algorithms, at `sizes` (default: the measured sizes)."""
        rows = self._select(transport)
        m = model or fit_model(rows)
        if sizes is None:
            sizes = sorted({r["size"] for r in rows})
        out = []
        for algo in _unique(r["algo"] for r in rows):
            op, p = rows[0]["op"], rows[0]["nranks"]
            for n in sizes:
                s, b, red = _cost_terms(op, algo, int(n), p)
                out.append({"size": int(n), "algo": algo, "predicted_s": m.predict(s, b, red)})
        return out

    def crossovers(self, model: Optional[Model] = None,
                   transport: Optional[str] = None) -> dict[str, list[tuple[int, str, str]]]:
        """Where the fastest measured algorithm changes: {"predicted": [(nbytes, below,
        above), ...] from the model (default: the fit), "measured": [...] between measured
        sizes (at their geometric mean)}."""
        rows = self._select(transport)
        m = model or fit_model(rows)
        algos = _unique(r["algo"] for r in rows)
        op, p = rows[0]["op"], rows[0]["nranks"]
        out: dict[str, list[tuple[int, str, str]]] = {"predicted": [], "measured": []}
        if len(algos) < 2 or op == "p2p":
            return out
        lo = min(r["size"] for r in rows)
        hi = max(r["size"] for r in rows)
        from .model import crossovers

        out["predicted"] = crossovers(op, p, m, algos, lo=lo, hi=hi)
        by_size: dict[int, dict[str, float]] = {}
        for r in rows:
            by_size.setdefault(r["size"], {})[r["algo"]] = r["time"]
        prev: Optional[tuple[int, str]] = None
        for n in sorted(by_size):
            best = min(by_size[n], key=by_size[n].__getitem__)
            if prev is not None and best != prev[1]:
                out["measured"].append((int(math.sqrt(prev[0] * n)), prev[1], best))
            prev = (n, best)
        return out

    def plot(self, ax: Any = None, transport: Optional[str] = None,
             model: Optional[Model] = None, title: Optional[str] = None,
             measured_crossovers: Optional[bool] = None) -> Any:
        """Measured times (points) against the model (lines; default: the fit) per
        algorithm, log-log, with the predicted crossover sizes marked (and the measured
        ones, see :func:`xccl.teach.plots.plot_bench`). Returns the Axes."""
        from .plots import plot_bench

        return plot_bench(self, ax=ax, transport=transport, model=model, title=title,
                          measured_crossovers=measured_crossovers)

    def to_dataframe(self) -> Any:
        import pandas as pd

        return pd.DataFrame.from_records(list(self))

    def _select(self, transport: Optional[str]) -> list[dict[str, Any]]:
        if not self:
            raise ValueError("no measurements")
        t = transport or self.transports[0]
        rows = [r for r in self if r["transport"] == t]
        if not rows:
            raise ValueError(f"no measurements over {t!r}; have {self.transports}")
        return rows

    def __str__(self) -> str:
        if not self:
            return "BenchResult([])"
        head = f"{'size':>10}  {'algo':<14} {'transport':<9} {'time':>10} {'algbw GB/s':>10} " \
               f"{'busbw GB/s':>10}"
        lines = [f"# {self[0]['op']} on {self[0]['nranks']} ranks ({self[0]['dtype']})", head]
        for r in self:
            lines.append(f"{_fmt_bytes(r['size']):>10}  {r['algo']:<14} {r['transport']:<9} "
                         f"{_fmt_time(r['time']):>10} {r['algbw']:>10.3f} {r['busbw']:>10.3f}")
        return "\n".join(lines)

    __repr__ = __str__


def _unique(items: Any) -> list[Any]:
    out: list[Any] = []
    for x in items:
        if x not in out:
            out.append(x)
    return out


# ---------------------------------------------------------------------------------------------
# Measuring (on every rank)
# ---------------------------------------------------------------------------------------------


def _buffers(op: str, nbytes: int, p: int, rank: int, np: Any, dtype: Any) -> tuple[Any, Any, int]:
    """(send, recv, count) for an operation of nccl-tests size `nbytes`."""
    es = np.dtype(dtype).itemsize
    total = max(nbytes // es, 1)
    if op in ("all_gather", "gather"):
        count = max(total // p, 1)
        return np.ones(count, dtype), np.empty(count * p, dtype), count
    if op in ("reduce_scatter", "scatter", "all_to_all"):
        count = max(total // p, 1)
        return np.ones(count * p, dtype), np.empty(count if op != "all_to_all" else count * p,
                                                   dtype), count * p
    return np.ones(total, dtype), np.empty(total, dtype), total


def _poster(op: str, comm: Any, sbuf: Any, rbuf: Any, algo: Optional[str]) -> Any:
    from .. import _C

    SUM = _C.OPS["sum"]
    r = comm.rank
    if op == "all_reduce":
        return lambda: comm.allreduce(sbuf, sbuf, SUM, algo=algo)  # in place, as usual
    if op == "broadcast":
        return lambda: comm.broadcast(sbuf, 0, algo=algo)
    if op == "reduce":
        return lambda: comm.reduce(sbuf, rbuf if r == 0 else None, SUM, 0, algo=algo)
    if op == "all_gather":
        return lambda: comm.allgather(sbuf, rbuf, algo=algo)
    if op == "gather":
        return lambda: comm.gather(sbuf, rbuf if r == 0 else None, 0, algo=algo)
    if op == "scatter":
        return lambda: comm.scatter(sbuf if r == 0 else None, rbuf, 0, algo=algo)
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(sbuf, rbuf, SUM, algo=algo)
    if op == "all_to_all":
        return lambda: comm.alltoall(sbuf, rbuf, algo=algo)
    if op == "barrier":
        return lambda: comm.barrier(algo=algo)
    raise ValueError(f"bench: unsupported operation {op!r}")


def _pingpong(comm: Any, buf: Any) -> Any:
    r = comm.rank

    def once() -> None:
        if r == 0:
            comm.isend(buf, 1, 7).wait()
            comm.irecv(buf, 1, 7).wait()
        elif r == 1:
            comm.irecv(buf, 0, 7).wait()
            comm.isend(buf, 0, 7).wait()

    return once


def _run_here(
    op: str,
    sizes: Sequence[int],
    algos: Optional[Sequence[str]],
    group: Any,
    iters: Optional[int],
    warmup: int,
    min_time: float,
    dtype: str,
    repeats: int = 3,
    stat: str = "median",
) -> BenchResult:
    """Measures on the ranks of `group` (every rank calls it); every rank returns the rows."""
    import numpy as np

    from .. import _C, _group

    pg = _group.resolve(group)
    if pg is None:
        raise ValueError("bench: this process is not a member of the group")
    comm, p, rank = pg.comm, pg.size(), pg.rank()
    if op == "p2p" and p < 2:
        raise ValueError("bench: op='p2p' needs at least 2 ranks")
    transport = comm.peer_transport((rank + 1) % p) if p > 1 else "self"
    if op == "p2p":
        use = ["p2p"]
    else:
        known = explain(op, max(sizes), size=p)
        names = [r["name"] for r in known]
        use = list(algos) if algos else [r["name"] for r in known if r["applicable"]]
        for a in use:
            if a not in names:
                raise ValueError(f"bench: {op} has no algorithm {a!r}; it has {names}")
    MAX = _C.OPS["max"]
    SUM = _C.OPS["sum"]
    dt = np.dtype(dtype)
    step = dt.itemsize * (p if op in ("all_gather", "gather", "reduce_scatter", "scatter",
                                      "all_to_all") else 1)

    def agree(value: float, reduce_op: int) -> float:
        a = np.array([value], np.float64)
        comm.allreduce(a, a, reduce_op).wait()
        return float(a[0])

    rows = []
    for want in sizes:
        nbytes = max(step, int(want) // step * step) if op != "barrier" else 0
        runs = {}  # algo -> (operation, iterations)
        for algo in use:
            if op not in ("p2p", "barrier"):
                info = {r["name"]: r for r in explain(op, nbytes, size=p)}
                if not info[algo]["applicable"]:
                    if rank == 0:
                        warnings.warn(f"bench: {algo} does not apply to {op} of {nbytes} bytes "
                                      f"on {p} ranks; skipped", stacklevel=2)
                    continue
            sbuf, rbuf, count = _buffers(op if op != "p2p" else "broadcast", nbytes, p, rank,
                                         np, dt)
            once = (_pingpong(comm, sbuf) if op == "p2p"
                    else _wait(_poster(op, comm, sbuf, rbuf, algo)))
            for _ in range(max(1, warmup)):
                once()
            probe = agree(_timed(once, 1), MAX)
            n = iters or int(min(_MAX_ITERS, max(2, min_time / max(probe, 1e-7))))
            runs[algo] = (once, int(agree(n, MAX)), count)  # every rank runs as many
        # Algorithms take turns, `repeats` times: a slow spell of the machine then hurts
        # them alike. Every iteration is timed on its own.
        durations: dict[str, list[float]] = {algo: [] for algo in runs}
        for _ in range(max(1, repeats)):
            for algo, (once, n, _count) in runs.items():
                comm.barrier().wait()
                durations[algo] += _timed_each(once, n)
        for algo, (_once, n, count) in runs.items():
            local = (statistics.median(durations[algo]) if stat == "median"
                     else statistics.fmean(durations[algo]))
            if op == "p2p":  # only ranks 0 and 1 take part
                seconds = agree(local if rank < 2 else 0.0, SUM) / 2
            else:
                seconds = agree(local, SUM) / p  # the mean over ranks, as nccl-tests reports
            if op == "p2p":
                seconds /= 2  # one way
            algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
            rows.append({
                "op": op, "size": nbytes, "count": count, "dtype": dt.name, "algo": algo,
                "transport": transport, "nranks": p, "iters": n, "time": seconds,
                "algbw": algbw, "busbw": algbw * busbw_factor(op, p),
            })
    rows.sort(key=lambda r: (use.index(r["algo"]), r["size"]))
    return BenchResult(rows)


def _wait(post: Any) -> Any:
    return lambda: post().wait()


def _timed_each(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _timed(fn: Any, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def _bench_rank(op: str, sizes: Sequence[int], algos: Optional[Sequence[str]],
                iters: Optional[int], warmup: int, min_time: float, dtype: str,
                repeats: int, stat: str) -> list[Any]:
    """What each launched rank runs (module level, so it ships by reference)."""
    return list(_run_here(op, sizes, algos, None, iters, warmup, min_time, dtype, repeats,
                          stat))


def bench(
    op: str = "all_reduce",
    sizes: Optional[Sequence[int]] = None,
    algos: Optional[Sequence[str]] = None,
    *,
    nprocs: int = 4,
    transport: Union[None, str, Sequence[str]] = None,
    group: Any = None,
    iters: Optional[int] = None,
    warmup: int = 2,
    min_time: float = 0.02,
    repeats: int = 3,
    stat: str = "median",
    dtype: str = "float32",
    timeout: Optional[float] = 600.0,
) -> BenchResult:
    """Times `op` ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
    "gather", "scatter", "all_to_all", "barrier" or "p2p") for every algorithm of `algos`
    (default: all that apply) and every size of `sizes` (bytes, nccl-tests' meaning; default
    64 B to 4 MiB by factors of 4). Returns a :class:`BenchResult`: tidy rows, ``.fit()``,
    ``.plot()``.

    Outside a process group it launches `nprocs` ranks (:func:`xccl.launch`) once per
    `transport` ("auto"/None, "tcp", "shm", or a list of them); inside one, every rank of
    `group` must call it. `iters` fixes the iterations per measurement (default: enough for
    `min_time` seconds, at least 2), after `warmup` runs; the algorithms of one size take
    turns `repeats` times, so that a slow spell of a shared machine does not favour one of
    them. Each rank times every iteration and keeps their median (``stat="median"``, robust
    to a machine that is also busy with other work) or their mean (``stat="mean"``, what
    nccl-tests reports); the row's time is the mean of that over the ranks."""
    if stat not in ("median", "mean"):
        raise ValueError(f"bench: stat must be 'median' or 'mean', got {stat!r}")
    from .. import _group

    coll = "p2p" if op in ("p2p", "sendrecv", "pingpong") else canonical_collective(op)
    sizes = list(DEFAULT_SIZES if sizes is None else sizes)
    if not sizes or any(int(s) < 0 for s in sizes):
        raise ValueError("bench: sizes must be a non-empty list of byte counts >= 0")
    if group is not None or _group._world.default is not None:
        return _run_here(coll, sizes, algos, group, iters, warmup, min_time, dtype, repeats,
                         stat)
    from ..launch import launch

    transports = [transport] if transport is None or isinstance(transport, str) else list(
        transport)
    rows: list[Any] = []
    for t in transports:
        out = launch(_bench_rank, nprocs, coll, sizes, algos, iters, warmup, min_time, dtype,
                     repeats, stat, transport=t, timeout=timeout)
        rows += out[0]
    return BenchResult(rows)
