"""The α-β(-γ) cost model: what each algorithm is predicted to cost, and where they cross.

A message of n bytes costs α + β·n (α: latency per message, β: seconds per byte, i.e.
1/bandwidth); combining n bytes locally costs γ·n. Each xccl algorithm states, for p ranks
and a buffer of N bytes, how many message rounds lie on its critical path (steps), how many
bytes one rank sends on it (bytes) and how many it reduces (reduce_bytes), so that

    predicted time = α·steps + β·bytes + γ·reduce_bytes

For example a ring all-reduce: 2(p-1) steps, 2(p-1)/p·N bytes; recursive doubling:
log2(p) steps, log2(p)·N bytes. Few steps win for small N (latency-bound), few bytes for
large N (bandwidth-bound); :func:`crossovers` finds the sizes where the cheapest changes.
The engine's selector uses exactly these formulas (``_C.explain``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any, Optional, Union

__all__ = ["Explanation", "Model", "canonical_collective", "crossovers", "explain", "predict"]

_ALIASES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reducescatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "alltoall": "all_to_all",
    "all_to_all_single": "all_to_all",
    "alltoallv": "all_to_all_v",
    "bcast": "broadcast",
}
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
               "reduce_scatter", "all_to_all", "all_to_all_v", "barrier")


def canonical_collective(name: str) -> str:
    """The engine's name of a collective: "allreduce", "all-reduce" -> "all_reduce", ..."""
    key = str(name).strip().lower().replace("-", "_")
    key = _ALIASES.get(key, _ALIASES.get(key.replace("_", ""), key))
    if key not in COLLECTIVES:
        raise ValueError(f"unknown collective {name!r}; one of {', '.join(COLLECTIVES)}")
    return key


@dataclasses.dataclass(frozen=True)
class Model:
    """α (s per message), β (s per byte) and γ (s per byte reduced), and what they describe."""

    alpha: float
    beta: float
    gamma: float
    transport: str = ""
    source: str = "default"  # "default", "group", "fit" or "user"
    rel_error: Optional[float] = None  # of a fit: median |measured - predicted| / measured

    @classmethod
    def default(cls) -> Model:
        """The engine's built-in model (what its selector uses)."""
        from .. import _C

        a, b, g = _C.default_model()
        return cls(a, b, g, source="default")

    def as_tuple(self) -> tuple[float, float, float]:
        return (self.alpha, self.beta, self.gamma)

    def predict(self, steps: float, nbytes: float, reduce_bytes: float = 0.0) -> float:
        """α·steps + β·nbytes + γ·reduce_bytes, in seconds."""
        return self.alpha * steps + self.beta * nbytes + self.gamma * reduce_bytes

    @property
    def bandwidth(self) -> float:
        """1/β in bytes per second (inf when β is 0)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def __str__(self) -> str:
        bw = "inf" if self.beta == 0 else f"{self.bandwidth / 1e9:.2f} GB/s"
        where = f" [{self.transport}]" if self.transport else ""
        return (f"α = {self.alpha * 1e6:.1f} µs, β = {self.beta * 1e9:.3f} ns/B ({bw}), "
                f"γ = {self.gamma * 1e9:.3f} ns/B{where}")


ModelLike = Union[None, Model, Sequence[float]]


def _as_model(model: ModelLike) -> Model:
    if model is None:
        return Model.default()
    if isinstance(model, Model):
        return model
    a, b, g = (float(v) for v in model)
    return Model(a, b, g, source="user")


def _group_size(group: Any, size: Optional[int]) -> int:
    if size is not None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        return int(size)
    from .. import _group

    if group is None and _group._world.default is None:
        raise ValueError("explain: pass size= (the number of ranks) or call it inside a "
                         "process group")
    pg = _group.resolve(group)
    if pg is None:
        raise ValueError("explain: this process is not a member of the group")
    return pg.size()


def _group_model(group: Any) -> Model:
    """The model the engine prices `group`'s one-level algorithms with."""
    from .. import _group

    pg = _group.resolve(group)
    a, b, g, nnodes = pg.comm.cost_model()
    hosts = f"{nnodes} hosts" if nnodes > 1 else "1 host"
    return Model(a, b, g, transport=f"this group's links, {hosts}", source="group")


def _fmt_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


class Explanation(list):  # type: ignore[type-arg]
    """The rows of :func:`explain` (one dict per algorithm: name, summary, steps, bytes,
    reduce_bytes, copy_bytes, predicted_s, applicable, chosen, source - where the choice came
    from, on the chosen row - and the time split into latency, bandwidth
    and reduce terms), shown as a table in a terminal or a notebook."""

    def __init__(self, rows: Iterable[dict[str, Any]], collective: str, nbytes: int,
                 size: int, model: Model) -> None:
        super().__init__(rows)
        self.collective = collective
        self.nbytes = nbytes
        self.size = size
        self.model = model

    @property
    def chosen(self) -> Optional[dict[str, Any]]:
        """The row of the algorithm xccl would run."""
        return next((r for r in self if r["chosen"]), None)

    @property
    def source(self) -> str:
        """Where the choice came from: "env" ($XCCL_ALGO), "table" (a tuning table,
        $XCCL_TUNE_FILE), "rule" (a built-in rule) or "model" (the cost model); "" if none
        was chosen."""
        row = self.chosen
        return str(row.get("source", "")) if row is not None else ""

    @property
    def fastest(self) -> Optional[dict[str, Any]]:
        """The applicable row with the smallest predicted time."""
        rows = [r for r in self if r["applicable"]]
        return min(rows, key=lambda r: r["predicted_s"]) if rows else None

    def to_dataframe(self) -> Any:
        import pandas as pd

        return pd.DataFrame.from_records(list(self))

    def _cells(self) -> tuple[list[str], list[list[str]]]:
        head = ["algorithm", "steps", "bytes sent", "reduced", "latency", "bandwidth",
                "reduce", "predicted", ""]
        body = []
        for r in self:
            src = f" ({r['source']})" if r.get("source") else ""
            mark = f"<- chosen{src}" if r["chosen"] else (
                "(not applicable)" if not r["applicable"] else "")
            body.append([r["name"], f"{r['steps']:g}", _fmt_bytes(r["bytes"]),
                         _fmt_bytes(r["reduce_bytes"]), _fmt_time(r["latency_s"]),
                         _fmt_time(r["bandwidth_s"]), _fmt_time(r["reduce_s"]),
                         _fmt_time(r["predicted_s"]), mark])
        return head, body

    def __str__(self) -> str:
        head, body = self._cells()
        widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
        lines = [f"{self.collective} of {_fmt_bytes(self.nbytes)} on {self.size} ranks; "
                 f"model: {self.model}"]
        lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip())
        for row in body:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        import html

        head, body = self._cells()
        th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
        trs = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
            for row in body
        )
        cap = html.escape(f"{self.collective} of {_fmt_bytes(self.nbytes)} on {self.size} "
                          f"ranks; model: {self.model}")
        return f"<table><caption>{cap}</caption><tr>{th}</tr>{trs}</table>"


def explain(
    collective: str,
    nbytes: int,
    group: Any = None,
    size: Optional[int] = None,
    model: ModelLike = None,
) -> Explanation:
    """Predicted cost of every algorithm of `collective` for a buffer of `nbytes` (the
    nccl-tests size: the whole vector of an all-reduce, the whole output of an all-gather)
    on the ranks of `group` (default: the default group) or on `size` ranks.

    `model` is a :class:`Model`, a tuple (α, β, γ), or None: the model the engine chooses
    with for `group` (its transport's α and β: shared memory inside a host, TCP between
    hosts), or the engine's default when only `size` is given. The result prints as a table
    and is a list of dicts (see :class:`Explanation`)."""
    from .. import _C

    coll = canonical_collective(collective)
    p = _group_size(group, size)
    in_group = model is None and size is None
    m = _group_model(group) if in_group else _as_model(model)
    if in_group:
        # priced as the engine prices this group's calls: two-level algorithms with the links
        # inside and between hosts apart; "chosen" is what it will run, which may be a
        # built-in rule's choice (measured, outside the model)
        from .. import _group

        comm = _group.resolve(group).comm
        rows = comm.explain(coll, int(nbytes))
        runs = comm.choose(coll, int(nbytes))
        source = next((r["source"] for r in rows if r["chosen"]), "")
        for r in rows:
            r["chosen"] = r["name"] == runs
            r["source"] = source if r["chosen"] else ""
    else:
        rows = _C.explain(coll, int(nbytes), p, m.as_tuple())
    for r in rows:
        # the split by one model; a two-level algorithm's predicted_s prices each link apart
        r["latency_s"] = m.alpha * r["steps"]
        r["bandwidth_s"] = m.beta * r["bytes"]
        r["reduce_s"] = m.gamma * r["reduce_bytes"]
        # the memory-traffic term (one-host algorithms: bytes a rank copies itself), priced
        # with the engine's δ: what remains of the prediction once the other terms are taken
        r["copy_s"] = max(r["predicted_s"] - r["latency_s"] - r["bandwidth_s"] - r["reduce_s"],
                          0.0) if r.get("copy_bytes") else 0.0
    return Explanation(rows, coll, int(nbytes), p, m)


def predict(
    collective: str,
    sizes: Iterable[int],
    size: int,
    model: ModelLike = None,
    algos: Optional[Sequence[str]] = None,
) -> list[dict[str, Any]]:
    """Tidy rows (size, algo, predicted_s, applicable, chosen) of :func:`explain` over
    `sizes` bytes, for `algos` (default: all)."""
    m = _as_model(model)
    rows = []
    for n in sizes:
        for r in explain(collective, int(n), size=size, model=m):
            if algos is None or r["name"] in algos:
                rows.append({"size": int(n), "algo": r["name"], "predicted_s": r["predicted_s"],
                             "applicable": r["applicable"], "chosen": r["chosen"]})
    return rows


def crossovers(
    collective: str,
    size: int,
    model: ModelLike = None,
    algos: Optional[Sequence[str]] = None,
    lo: int = 1,
    hi: int = 1 << 30,
) -> list[tuple[int, str, str]]:
    """The buffer sizes in [lo, hi] where the algorithm predicted fastest (among `algos`,
    default all applicable) changes: a list of (nbytes, faster below, faster from there on).
    Found on a grid of 8 points per doubling, then refined by bisection to the byte."""
    m = _as_model(model)

    def best(n: int) -> Optional[str]:
        rows = [r for r in explain(collective, n, size=size, model=m)
                if r["applicable"] and (algos is None or r["name"] in algos)]
        return min(rows, key=lambda r: r["predicted_s"])["name"] if rows else None

    grid = sorted({max(lo, int(round(2 ** (k / 8)))) for k in
                   range(int(8 * math.log2(max(lo, 1))), int(8 * math.log2(hi)) + 1)})
    out = []
    prev_n, prev = grid[0], best(grid[0])
    for n in grid[1:]:
        cur = best(n)
        if cur != prev:
            a, b = prev_n, n  # best(a) == prev, best(b) == cur
            while b - a > 1:
                mid = (a + b) // 2
                if best(mid) == prev:
                    a = mid
                else:
                    b = mid
            out.append((b, str(prev), str(best(b))))
        prev_n, prev = n, cur
    return out
