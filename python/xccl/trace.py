"""Step tracing: every send, receive and local reduction of every collective, on every rank.

    with xccl.trace() as t:                    # every rank enters it (an SPMD block)
        xccl.all_reduce(x)
    t.plot_schedule()                          # on rank 0: who sent which chunk to whom
    t.plot()                                   # a per-rank timeline
    t.to_perfetto("trace.json")                # open in https://ui.perfetto.dev
    t.to_dataframe()                           # or t.to_records(), a list of dicts

Entering the block starts the engine's recorder on every live process group of this process
(or on `group`); leaving it drains and stops them, then sends every rank's records to rank 0
through the default group's store (never through the communicators, which may be broken or
busy). Rank 0's Trace then holds every rank's records; the other ranks' hold their own. The
exchange is skipped with ``gather=False``, for a single rank, and, on rank 0, when the block
is left by an exception (the others may never arrive).

One record per primitive step: rank (global rank of the recording process), group (the
group's name, "0" for the default group), op, algo, seq (the operation's number in its
group), step (the algorithm's step; reductions get the step of the receive they follow),
kind ("send", "recv", "reduce"), src and dst (global ranks), buf ("send", "recv",
"scratch" or None) and offset (bytes into it), nbytes, transport ("tcp", "shm", "local"),
start and end (seconds since the trace began) and start_ns/end_ns (the raw clock).
:meth:`Trace.span` and :meth:`Trace.record_work` add records of kind "span" (a stretch of the
caller's own work, e.g. computation) and "work" (an async operation's enqueue, start and
end), so a timeline shows computation overlapping communication.

Clocks: the engine stamps events with CLOCK_MONOTONIC (``time.monotonic_ns()``), which is one
clock for every process of a host, so ranks on one host line up exactly. Ranks on several
hosts are put on the wall clock instead (each rank's monotonic time shifted by its own
wall-minus-monotonic offset), which is only as good as the hosts' clock synchronisation.

Cost: tracing off costs the engine one branch per message; inside the block each event is a
slot in a ring buffer of `capacity` events per communicator (the oldest are dropped when it
is full, and a warning says how many).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import socket
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, Optional

__all__ = ["Trace", "trace"]

DEFAULT_CAPACITY = 1 << 16
_KIND_COLOR = {
    "send": "#1f77b4",
    "recv": "#ff7f0e",
    "reduce": "#2ca02c",
    "span": "#7f7f7f",
    "work": "#9467bd",
}
_STEP_KINDS = ("send", "recv", "reduce")


def trace(
    group: Any = None, capacity: int = DEFAULT_CAPACITY, gather: bool = True
) -> Trace:
    """A :class:`Trace` to use as ``with xccl.trace() as t:`` on every rank.

    `group`: a ProcessGroup or a list of them (default: every group of this process alive
    when the block starts; groups made inside the block are not traced);
    `capacity`: events kept per communicator; `gather`: send every rank's records to rank 0
    at the end of the block."""
    return Trace(group=group, capacity=capacity, gather=gather)


class Trace:
    """Records of one traced block; see the module documentation. Also built from records
    with :meth:`from_records` (to plot saved or synthetic traces)."""

    def __init__(
        self, group: Any = None, capacity: int = DEFAULT_CAPACITY, gather: bool = True
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"trace: capacity must be a positive int, got {capacity!r}")
        self._group_arg = group
        self._capacity = capacity
        self._gather = gather
        self._pgs: list[Any] = []
        self._t_enter_ns = 0
        self._wall_enter_ns = 0
        self._local: list[dict[str, Any]] = []  # spans, raw times in ns
        self._works: list[tuple[Any, Optional[str]]] = []
        self._records: list[dict[str, Any]] = []
        self._active = False
        self.dropped = 0  # events lost to full buffers (this rank, or every rank on rank 0)
        self.clock = "monotonic"
        self.ranks: list[int] = []

    @classmethod
    def from_records(cls, records: list[dict[str, Any]]) -> Trace:
        """A Trace holding `records` (dicts as :meth:`to_records` returns; ``start``/``end``
        in seconds are required, the other fields default sensibly)."""
        t = cls.__new__(cls)
        cls.__init__(t)
        recs = []
        for r in records:
            rec = {
                "rank": 0, "group": "0", "op": "", "algo": "", "seq": 0, "step": 0,
                "kind": "send", "src": None, "dst": None, "buf": None, "offset": 0,
                "nbytes": 0, "transport": "", "name": None,
            }
            rec.update(r)
            rec.setdefault("start_ns", int(rec["start"] * 1e9))
            rec.setdefault("end_ns", int(rec["end"] * 1e9))
            recs.append(rec)
        t._records = sorted(recs, key=lambda r: (r["start"], r["rank"]))
        t.ranks = sorted({r["rank"] for r in recs})
        return t

    # -- the block -------------------------------------------------------------------------------

    def __enter__(self) -> Trace:
        from .debug import _groups

        if self._active:
            raise RuntimeError("this Trace is already active")
        self._pgs = _groups(self._group_arg)
        for pg in self._pgs:
            pg.comm.trace(self._capacity)
        self._local, self._works, self._records = [], [], []
        self.dropped = 0
        self._active = True
        self._wall_enter_ns = time.time_ns()
        self._t_enter_ns = time.monotonic_ns()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        t_exit_ns = time.monotonic_ns()
        self._active = False
        records: list[dict[str, Any]] = []
        for pg in self._pgs:
            comm = pg._comm
            if comm is None:
                continue
            try:
                events = comm.trace_drain()
                self.dropped += comm.trace_dropped()
                comm.trace(0)
            except Exception:  # destroyed meanwhile (by an error path): nothing to drain
                continue
            records += _convert(pg, events)
        records += self._local
        for work, name in self._works:
            records += _work_records(work, name, self._me())
        local = {
            "rank": self._me(),
            "host": socket.gethostname(),
            "enter_ns": self._t_enter_ns,
            "exit_ns": t_exit_ns,
            "wall_minus_mono": self._wall_enter_ns - self._t_enter_ns,
            "dropped": self.dropped,
            "records": records,
        }
        parts = self._exchange(local, failed=exc_type is not None)
        self._finish(parts)

    def _me(self) -> int:
        from . import _group

        pg = _group._world.default
        return pg.rank() if pg is not None else 0

    def _exchange(self, local: dict[str, Any], failed: bool) -> list[dict[str, Any]]:
        from . import _C, _group
        from ._store import as_c_store
        from .debug import _next_exchange

        pg = _group._world.default
        if not self._gather or pg is None or pg.size() == 1 or pg._store is None:
            return [local]
        store = as_c_store(pg._store)
        key = f"xccl/trace/{_next_exchange(pg, 'trace')}"
        store.set(f"{key}/{pg.rank()}", pickle.dumps(local, protocol=pickle.HIGHEST_PROTOCOL))
        if pg.rank() != 0 or failed:
            return [local]
        parts = [local]
        for r in range(1, pg.size()):
            try:
                parts.append(pickle.loads(store.get(f"{key}/{r}", pg._timeout)))
            except _C.XcclError as exc:
                warnings.warn(f"xccl.trace: rank {r}'s records did not arrive ({exc})",
                              stacklevel=3)
        for r in range(pg.size()):
            with contextlib.suppress(Exception):
                store.delete_key(f"{key}/{r}")
        return parts

    def _finish(self, parts: list[dict[str, Any]]) -> None:
        hosts = {p["host"] for p in parts}
        self.clock = "monotonic" if len(hosts) <= 1 else "wall"
        shift = {p["rank"]: (p["wall_minus_mono"] if self.clock == "wall" else 0) for p in parts}
        t0 = min(p["enter_ns"] + shift[p["rank"]] for p in parts)
        records = []
        for p in parts:
            s = shift[p["rank"]]
            for r in p["records"]:
                r = dict(r)
                r["start_ns"] += s
                r["end_ns"] += s
                if r.get("enqueue_ns"):
                    r["enqueue_ns"] += s
                    r["enqueue"] = (r["enqueue_ns"] - t0) / 1e9
                r["start"] = (r["start_ns"] - t0) / 1e9
                r["end"] = (r["end_ns"] - t0) / 1e9
                records.append(r)
        records.sort(key=lambda r: (r["start_ns"], r["rank"]))
        self._records = records
        self.ranks = sorted(p["rank"] for p in parts)
        self.dropped = sum(p["dropped"] for p in parts)
        if self.dropped:
            warnings.warn(
                f"xccl.trace: {self.dropped} events were dropped (buffers full); pass a "
                f"larger capacity than {self._capacity}", stacklevel=3,
            )

    # -- what the caller adds ----------------------------------------------------------------------

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Marks the code inside as a span called `name` on this rank's timeline."""
        start = time.monotonic_ns()
        try:
            yield
        finally:
            end = time.monotonic_ns()
            self._local.append(
                {"rank": self._me(), "group": "", "op": name, "algo": "", "seq": -1,
                 "step": -1, "kind": "span", "src": None, "dst": None, "buf": None,
                 "offset": 0, "nbytes": 0, "transport": "", "name": name,
                 "start_ns": start, "end_ns": end}
            )

    def record_work(self, work: Any, name: Optional[str] = None) -> Any:
        """Adds an async operation's Work (from ``async_op=True``, isend, irecv) to the
        timeline: a bar from its start to its end, with its enqueue time, read when the
        block ends. Returns `work`, so ``w = t.record_work(xccl.all_reduce(x, async_op=True))``
        reads well."""
        if not self._active:
            raise RuntimeError("record_work must be called inside the `with` block")
        self._works.append((work, name))
        return work

    # -- data --------------------------------------------------------------------------------------

    def to_records(self) -> list[dict[str, Any]]:
        """Every record (a list of new dicts), ordered by start time."""
        return [dict(r) for r in self._records]

    def to_dataframe(self) -> Any:
        """The records as a pandas DataFrame (pandas must be installed)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("Trace.to_dataframe needs pandas (pip install pandas); "
                              "Trace.to_records() gives the same rows as dicts") from None
        return pd.DataFrame.from_records(self.to_records())

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.to_records())

    def __repr__(self) -> str:
        ops = len({(r["group"], r["seq"]) for r in self._records if r["kind"] in _STEP_KINDS})
        return (f"<xccl.Trace {len(self._records)} records, {ops} operations, "
                f"ranks {self.ranks}>")

    def operations(self) -> list[dict[str, Any]]:
        """One row per traced operation: group, seq, op, algo, ranks (that recorded steps),
        start, end (seconds), messages and bytes (sent, summed over ranks)."""
        ops: dict[tuple[str, int], dict[str, Any]] = {}
        for r in self._records:
            if r["kind"] not in _STEP_KINDS:
                continue
            o = ops.setdefault((r["group"], r["seq"]), {
                "group": r["group"], "seq": r["seq"], "op": r["op"], "algo": r["algo"],
                "ranks": set(), "start": r["start"], "end": r["end"], "messages": 0,
                "bytes": 0,
            })
            o["ranks"].add(r["rank"])
            o["start"] = min(o["start"], r["start"])
            o["end"] = max(o["end"], r["end"])
            if r["kind"] == "send":
                o["messages"] += 1
                o["bytes"] += r["nbytes"]
        rows = sorted(ops.values(), key=lambda o: o["start"])
        for o in rows:
            o["ranks"] = sorted(o["ranks"])
        return rows

    # -- export ------------------------------------------------------------------------------------

    def to_perfetto(self, path: str | os.PathLike[str]) -> str:
        """Writes the trace in the Chrome trace-event JSON format, which ui.perfetto.dev and
        chrome://tracing open: one process per rank, one track per kind (operations, sends,
        receives, reductions, user spans), and an arrow from each send to its receive.
        Returns the path."""
        tids = {"op": 0, "send": 1, "recv": 2, "reduce": 3, "span": 4, "work": 4}
        track_names = {0: "operations", 1: "sends", 2: "receives", 3: "reductions", 4: "user"}
        events: list[dict[str, Any]] = []
        for rank in self.ranks or sorted({r["rank"] for r in self._records}):
            events.append({"ph": "M", "name": "process_name", "pid": rank,
                           "args": {"name": f"rank {rank}"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": rank,
                           "args": {"sort_index": rank}})
            for tid, tname in track_names.items():
                events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                               "args": {"name": tname}})
        per_op: dict[tuple[int, str, int], list[dict[str, Any]]] = defaultdict(list)
        for r in self._records:
            us, dur = r["start"] * 1e6, max(0.0, (r["end"] - r["start"]) * 1e6)
            if r["kind"] in _STEP_KINDS:
                per_op[(r["rank"], r["group"], r["seq"])].append(r)
                arrow = "" if r["kind"] == "reduce" else f" {r['src']}->{r['dst']}"
                name = f"{r['kind']}{arrow} step {r['step']}"
            else:
                name = r.get("name") or r["op"]
            args = {k: v for k, v in r.items() if k not in ("start_ns", "end_ns")}
            events.append({"ph": "X", "name": name, "cat": r["kind"], "pid": r["rank"],
                           "tid": tids[r["kind"]], "ts": us, "dur": dur, "args": args})
        for (rank, group, seq), recs in per_op.items():
            start = min(r["start"] for r in recs)
            end = max(r["end"] for r in recs)
            events.append({"ph": "X", "name": f"{recs[0]['op']} ({recs[0]['algo']}) #{seq}",
                           "cat": "op", "pid": rank, "tid": 0, "ts": start * 1e6,
                           "dur": (end - start) * 1e6,
                           "args": {"group": group, "seq": seq, "algo": recs[0]["algo"]}})
        for n, (send, recv) in enumerate(_matched_messages(self._records)):
            common = {"name": "message", "cat": "flow", "id": n}
            events.append({**common, "ph": "s", "pid": send["src"], "tid": 1,
                           "ts": send["start"] * 1e6})
            end_us = recv["end"] * 1e6
            events.append({**common, "ph": "f", "bp": "e", "pid": recv["dst"], "tid": 2,
                           "ts": max(recv["start"] * 1e6, end_us - 1e-3)})
        doc = {"traceEvents": events, "displayTimeUnit": "ms",
               "otherData": {"producer": "xccl.trace", "clock": self.clock}}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        return os.fspath(path)

    # -- pictures ----------------------------------------------------------------------------------

    def plot(self, ax: Any = None, group: Optional[str] = None, title: Optional[str] = None) -> Any:
        """A per-rank timeline (matplotlib): one row per rank with its sends, receives,
        reductions, user spans and async operations as bars. Returns the Axes."""
        from .teach import plots

        return plots.plot_timeline(self._records, ax=ax, group=group, title=title)

    def plot_schedule(
        self,
        seq: Optional[int] = None,
        group: Optional[str] = None,
        op: Optional[str] = None,
        max_steps: int = 16,
        title: Optional[str] = None,
    ) -> Any:
        """The schedule of one operation (default: the first collective traced; pick one by
        `seq`, `group` and/or `op` name): one panel per algorithm step with the ranks on a
        circle and an arrow for every message, labelled with the chunk it carries (``c2``: the
        third chunk-sized block of the buffer) and coloured by chunk. Ranks that reduced data
        in a step are drawn filled. Returns the Figure."""
        from .teach import plots

        return plots.plot_schedule(self._records, seq=seq, group=group, op=op,
                                   max_steps=max_steps, title=title)


# ---------------------------------------------------------------------------------------------
# Converting engine events
# ---------------------------------------------------------------------------------------------


def _convert(pg: Any, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Engine events of group `pg` -> records with global ranks; gives every reduction the
    step of the last receive of the same operation that finished before it started."""
    ranks = pg._ranks
    me = ranks[pg.rank()]
    out = []
    last_recv_step: dict[int, int] = {}
    for e in sorted(events, key=lambda e: (e["start_ns"], e["end_ns"])):
        rec = dict(e)
        rec["rank"] = me
        rec["group"] = pg.group_name
        rec["name"] = None
        rec["src"] = ranks[e["src"]] if 0 <= e["src"] < len(ranks) else e["src"]
        rec["dst"] = ranks[e["dst"]] if 0 <= e["dst"] < len(ranks) else e["dst"]
        out.append(rec)
    # Steps of reductions: in end order, a receive sets the step of the reductions after it.
    for rec in sorted(out, key=lambda r: (r["end_ns"], r["kind"] != "recv")):
        if rec["kind"] == "recv":
            last_recv_step[rec["seq"]] = rec["step"]
        elif rec["kind"] == "reduce":
            rec["step"] = last_recv_step.get(rec["seq"], rec["step"])
    return out


def _work_records(work: Any, name: Optional[str], rank: int) -> list[dict[str, Any]]:
    try:
        enq, start, end = work.times()
    except Exception:
        return []
    if not end:
        return []
    label = name or f"{getattr(work, 'name', 'work')} (async)"
    start = start or enq
    return [{
        "rank": rank, "group": "", "op": getattr(work, "name", ""),
        "algo": getattr(work, "algo", ""), "seq": getattr(work, "seq", -1), "step": -1,
        "kind": "work", "src": None, "dst": None, "buf": None, "offset": 0, "nbytes": 0,
        "transport": "", "name": label, "enqueue_ns": int(enq * 1e9),
        "start_ns": int(start * 1e9), "end_ns": int(end * 1e9),
    }]


def _matched_messages(records: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(send, recv) pairs: the k-th send from src to dst in (group, seq, step) with the k-th
    receive there."""
    sends: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    recvs: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["kind"] == "send":
            sends[(r["group"], r["seq"], r["step"], r["src"], r["dst"])].append(r)
        elif r["kind"] == "recv":
            recvs[(r["group"], r["seq"], r["step"], r["src"], r["dst"])].append(r)
    pairs = []
    for key, ss in sends.items():
        for s, r in zip(ss, recvs.get(key, []), strict=False):
            pairs.append((s, r))
    return pairs


def chunk_unit(records: list[dict[str, Any]]) -> int:
    """The largest byte count that divides every offset and size of the messages in
    `records`: the chunk size the labels of plot_schedule count in (0 if none)."""
    unit = 0
    for r in records:
        if r["kind"] == "send":
            unit = math.gcd(unit, int(r["offset"]), int(r["nbytes"]))
    return unit
