"""Hang and mismatch diagnosis: the flight recorder of every communicator, as text and tables.

Every xccl communicator keeps a flight recorder: the last operations it ran (sequence number,
operation, algorithm, final state, age) and, for the ones still pending, what they wait for
(``send->2``: a send to rank 2 not finished; ``recv<-1``: a message from rank 1 not received;
``shm<-1``: a one-host algorithm waiting for rank 1's writes to the node-shared segment).

- :func:`dump` prints it, for every process group of this process (of this rank's thread in
  ``xccl.launch(mode="threads")``); with ``all_ranks=True``, called by every rank, rank 0
  prints one table of every rank.
- :func:`ask_ranks` (``dump(ask=True)``): from one rank alone, asks every member of each
  group over its communicator where it stands, the table a timeout's error carries; works in
  any job (the other ranks answer from their progress thread, whatever they are doing).
- :func:`waits_table` turns the dumps of several ranks (and their errors) into one table of
  who is waiting in which operation for whom; :func:`xccl.launch` puts it into the error it
  raises when a run times out, fails while others are stuck, or is interrupted.

Ranks in ``waiting for`` are ranks of the communicator named in the row (for the default
group, the global ranks).
"""

from __future__ import annotations

import io
import re
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Optional, TextIO

__all__ = ["ask_ranks", "dump", "flight_records", "local_dump", "parse_flight", "waits_table"]

_HEADER = re.compile(r"^comm '(?P<comm>.*)' rank (?P<rank>\d+)/(?P<size>\d+)\s*$")
_ROW = re.compile(
    r"^\s*(?P<seq>\d+)\s+(?P<op>\S+)\s+(?P<algo>\S+)\s+(?P<state>\S+)\s+(?P<age>[-\d.]+)"
    r"(?:\s+(?P<waiting>.*?))?\s*$"
)
# What the engine's timeout message says the operation was waiting for.
_WAIT_PHRASE = re.compile(r"(a send to|a message from) (?:rank (\d+)|any rank)")
# ... or, for one-host algorithms, for a rank's writes to the node-shared segment.
_SHM_WAIT_PHRASE = re.compile(
    r"waiting for (?:rank (\d+) \(pid \d+\) to (?:write|create) the node-shared segment|"
    r"writes of several ranks to the node-shared segment)"
)
_TIMEOUT_OP = re.compile(
    r"^(?P<op>\S+) \(algo (?P<algo>\S+), seq (?P<seq>\d+)\) on comm '(?P<comm>[^']*)' timed out"
)
# Per default group and purpose, how many store exchanges it made: every rank counts the same,
# so the count names the store keys of one exchange (weak: groups come and go).
_counts: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
_counts_lock = threading.Lock()


def _next_exchange(pg: Any, purpose: str) -> int:
    """1, 2, ... for successive calls with the same group and purpose (shared with trace)."""
    with _counts_lock:
        per = _counts.setdefault(pg, {})
        per[purpose] = per.get(purpose, 0) + 1
        return per[purpose]


def _groups(group: Any = None) -> list[Any]:
    """The live process groups meant by `group` (None: every group of this process)."""
    from . import _group

    if group is not None:
        pgs = group if isinstance(group, (list, tuple)) else [group]
        return [pg for pg in pgs if pg is not None and not isinstance(pg, int)]
    return [pg for pg in list(_group._world.groups) if pg._comm is not None]


def _per_comm(group: Any, text: Callable[[Any], str], failed: str) -> str:
    """text(comm) of every live process group of this process (or of `group`), one block
    each; `failed` names what could not be had from a communicator destroyed meanwhile."""
    blocks = []
    for pg in _groups(group):
        comm = pg._comm
        if comm is None:
            continue
        try:
            block = text(comm).strip("\n")
        except Exception as exc:  # a communicator destroyed meanwhile
            block = f"comm {pg.group_name!r}: {failed} ({exc})"
        if block:
            blocks.append(block)
    return "\n".join(blocks) + ("\n" if blocks else "")


def local_dump(group: Any = None) -> str:
    """The flight recorder of every live process group of this process (or of `group`: one
    ProcessGroup or a list), as the engine prints it: one block per communicator."""
    return _per_comm(group, lambda comm: comm.flight_dump(), "flight recorder unavailable")


def parse_flight(text: str) -> list[dict[str, Any]]:
    """The rows of one or more flight-recorder dumps as dicts: comm, rank, size, seq, op,
    algo, state ("done", "pending", "ERR_TIMEOUT", ...), age_ms and waiting (a list such as
    ``["recv<-1", "send->2"]``, empty for finished operations)."""
    rows: list[dict[str, Any]] = []
    comm, rank, size = "?", -1, 0
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            comm, rank, size = m["comm"], int(m["rank"]), int(m["size"])
            continue
        m = _ROW.match(line)
        if m is None or line.lstrip().startswith("seq"):
            continue
        rows.append(
            {
                "comm": comm,
                "rank": rank,
                "size": size,
                "seq": int(m["seq"]),
                "op": m["op"],
                "algo": m["algo"],
                "state": m["state"],
                "age_ms": float(m["age"]),
                "waiting": (m["waiting"] or "").split(),
            }
        )
    return rows


def flight_records(group: Any = None) -> list[dict[str, Any]]:
    """:func:`parse_flight` of :func:`local_dump`: this process's recorder as dicts."""
    return parse_flight(local_dump(group))


def _waits_from_message(message: str) -> list[str]:
    waits = []
    for kind, peer in _WAIT_PHRASE.findall(message):
        arrow = "send->" if kind == "a send to" else "recv<-"
        waits.append(arrow + (peer if peer else "any"))
    for peer in _SHM_WAIT_PHRASE.findall(message):
        waits.append("shm<-" + (peer if peer else "any"))
    return waits


def waits_table(
    dumps: dict[int, str],
    errors: Optional[dict[int, str]] = None,
    finished: Optional[set[int]] = None,
    nranks: Optional[int] = None,
) -> str:
    """One table, one or more rows per rank, of where every rank is.

    `dumps` maps a rank to its flight-recorder text (:func:`local_dump`); `errors` maps a rank
    to the message of the error it failed with (an operation that timed out is shown with
    what it was waiting for); `finished` holds ranks that returned normally. Ranks in none of
    them (up to `nranks`) are shown as unknown."""
    errors = errors or {}
    finished = finished or set()
    ranks = set(dumps) | set(errors) | finished
    if nranks is not None:
        ranks |= set(range(nranks))
    header = ("rank", "comm", "seq", "operation", "algo", "state", "age_ms", "waiting for")
    lines: list[tuple[str, ...]] = []
    for r in sorted(ranks):
        rows = [row for row in parse_flight(dumps.get(r, "")) if row["state"] == "pending"]
        for row in rows:
            lines.append((str(r), row["comm"], str(row["seq"]), row["op"], row["algo"],
                          "pending", f"{row['age_ms']:.0f}", " ".join(row["waiting"]) or "-"))
        if rows:
            continue
        msg = errors.get(r)
        if msg is not None:
            m = _TIMEOUT_OP.match(msg.strip())
            if m:
                lines.append((str(r), m["comm"], m["seq"], m["op"], m["algo"], "timed out", "",
                              " ".join(_waits_from_message(msg)) or "-"))
            else:
                first = msg.strip().splitlines()[0] if msg.strip() else "error"
                lines.append((str(r), "", "", "", "", "failed", "", first[:60]))
        elif r in finished:
            lines.append((str(r), "", "", "", "", "returned", "", ""))
        elif r in dumps:
            lines.append((str(r), "", "", "", "", "not in xccl", "", ""))
        else:
            lines.append((str(r), "", "", "", "", "unknown", "", ""))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
              for i, h in enumerate(header)]
    out = io.StringIO()
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out.write(fmt.format(*header).rstrip() + "\n")
    for line in lines:
        out.write(fmt.format(*line).rstrip() + "\n")
    return out.getvalue()


def ask_ranks(group: Any = None, wait: float = 0.5) -> str:
    """Asks, from this rank alone, every member of every live process group of this process
    (or of `group`) where it stands, over the group's communicator, and returns one block per
    group: "rank N: all_reduce #12 (ring) waiting for recv from rank 1", "rank N: idle, last
    finished #11 barrier", or "rank N: no answer ...". Waits up to `wait` seconds per group
    (less once everyone answered). Ranks are those of the group."""
    return _per_comm(group, lambda comm: comm.diag_table(float(wait)), "cannot ask its ranks")


def dump(
    group: Any = None, file: Optional[TextIO] = None, all_ranks: bool = False, ask: bool = False
) -> str:
    """Prints (to `file`, default stdout) and returns the flight recorder of this process's
    process groups (or of `group`).

    With ``all_ranks=True`` every rank of the default group must call it: the dumps travel
    through the default group's store (not through the communicators, which may be stuck),
    and rank 0 prints one :func:`waits_table` of every rank followed by each rank's recorder;
    the other ranks print nothing and return their own dump.

    With ``ask=True`` (and ``all_ranks=False``) this rank alone also asks every member of
    each group where it stands (:func:`ask_ranks`) and appends that table: no other rank
    needs to call anything, in any job."""
    text = local_dump(group)
    if ask and not all_ranks:
        text += ask_ranks(group)
    if not all_ranks:
        print(text if text else "xccl: no process group in this process", end="" if text else
              "\n", file=file or sys.stdout)
        return text
    from . import _group

    pg = _group.default_group()
    store = _group._get_default_store()
    key = f"xccl/debug/dump/{_next_exchange(pg, 'dump')}"
    rank, size = pg.rank(), pg.size()
    store.set(f"{key}/{rank}", text.encode())
    if rank != 0:
        return text
    dumps = {r: store.get(f"{key}/{r}").decode(errors="replace") for r in range(size)}
    for r in range(size):
        store.delete_key(f"{key}/{r}")
    full = waits_table(dumps, nranks=size) + "\n" + "".join(
        f"--- rank {r}\n{dumps[r]}" for r in range(size)
    )
    print(full, end="", file=file or sys.stdout)
    return full
