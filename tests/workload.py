"""The seeded random workload shared by the fault driver (tests/faults/driver.py) and the soak
test (tests/soak.py): a reproducible stream of collectives and point-to-point operations over
a fixed set of process groups, each result checked against numpy.

Every rank builds the same :class:`Workload` (same seed, same world size, same groups) and so
draws the same sequence of :class:`Op`; a rank runs the ops whose participants include it
(:func:`run_op`), in sequence order. Because all ranks agree on one total order and every
blocking operation only waits for its own participants, no op sequence can deadlock.

Every input is a pure function of ``(seed, op index, global rank)`` (:func:`make_input`), so
each rank computes the expected result of an op from the inputs of the other participants
with numpy alone, independently of xccl. The values are small integers (also in floating
types), so that sums and products are exact in every dtype and in any reduction order.

    wl = Workload(seed=1, world_size=4, groups=[[0, 1, 2, 3], [0, 2], [1, 2, 3]])
    handles = make_groups(xccl, wl.groups)             # same calls on every rank
    for op in wl.ops(100):
        nbytes = run_op(xccl, op, handles[op.group], rank, wl.groups[op.group])

A wrong result raises :class:`WrongResult`; xccl's own errors propagate unchanged.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import numpy as np

DTYPES = ("float32", "float64", "float16", "int32", "int64", "int8", "uint8", "int16")
FLOAT_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM")
INT_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
PREMUL_FACTOR = 2.0

# name -> relative weight
KINDS = {
    "all_reduce": 6,
    "all_reduce_async": 2,
    "broadcast": 3,
    "reduce": 3,
    "all_gather": 2,
    "all_gather_into_tensor": 2,
    "gather": 2,
    "scatter": 2,
    "reduce_scatter": 2,
    "reduce_scatter_tensor": 2,
    "all_to_all": 2,
    "all_to_all_single": 2,
    "barrier": 1,
    "send_recv": 3,
    "isend_irecv_ring": 2,
    "batch_isend_irecv": 2,
}
REDUCING = {"all_reduce", "all_reduce_async", "reduce", "reduce_scatter", "reduce_scatter_tensor"}


class WrongResult(AssertionError):
    """An operation returned data that differs from the numpy expectation."""


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation of the sequence. Ranks are global; ``root`` and ``pair`` are group ranks."""

    index: int
    kind: str
    group: int  # index into Workload.groups
    dtype: str
    count: int  # elements per rank (per peer block for the gathering and scattering kinds)
    redop: str = "SUM"
    root: int = 0
    pair: tuple[int, int] = (0, 0)  # send_recv: (sender, receiver), group ranks

    def participants(self, members: Sequence[int]) -> list[int]:
        """Global ranks that take part (the whole group, or the pair of a send_recv)."""
        if self.kind == "send_recv":
            return [members[self.pair[0]], members[self.pair[1]]]
        return list(members)

    def describe(self, members: Sequence[int]) -> str:
        extra = ""
        if self.kind in REDUCING:
            extra += f" op={self.redop}"
        if self.kind in ("broadcast", "reduce", "gather", "scatter"):
            extra += f" root(group rank)={self.root}"
        if self.kind == "send_recv":
            extra += f" pair(group ranks)={self.pair}"
        return (
            f"op #{self.index} {self.kind} on group {self.group} {list(members)} "
            f"dtype={self.dtype} count={self.count}{extra}"
        )


def random_groups(rng: random.Random, world_size: int, n: int) -> list[list[int]]:
    """``n`` random groups of 2..world_size ranks (the world first), overlapping freely."""
    groups = [list(range(world_size))]
    while len(groups) < n:
        k = rng.randint(2, world_size)
        groups.append(sorted(rng.sample(range(world_size), k)))
    return groups


class Workload:
    """A reproducible op stream: the same on every rank for the same arguments."""

    def __init__(
        self,
        seed: int,
        world_size: int,
        groups: Sequence[Sequence[int]],
        max_count: int = 4096,
        kinds: Optional[dict[str, int]] = None,
    ) -> None:
        if not groups:
            raise ValueError("a workload needs at least one group")
        for g in groups:
            if len(g) < 1 or any(not 0 <= r < world_size for r in g):
                raise ValueError(f"group {list(g)} is not a set of ranks of {world_size}")
        self.seed = seed
        self.world_size = world_size
        self.groups = [list(g) for g in groups]
        self.max_count = max_count
        self.kinds = dict(kinds or KINDS)
        self._rng = random.Random(seed)
        self._next = 0

    def _count(self) -> int:
        r = self._rng.random()
        if r < 0.3:
            return self._rng.randint(1, 16)
        if r < 0.9:
            return self._rng.randint(17, 1024)
        return self._rng.randint(1025, self.max_count)

    def next_op(self) -> Op:
        rng = self._rng
        names = list(self.kinds)
        kind = rng.choices(names, weights=[self.kinds[k] for k in names])[0]
        gi = rng.randrange(len(self.groups))
        members = self.groups[gi]
        if kind in ("send_recv", "isend_irecv_ring", "batch_isend_irecv") and len(members) < 2:
            kind = "all_reduce"
        dtype = rng.choice(DTYPES)
        floating = dtype.startswith("float")
        redop = rng.choice(FLOAT_OPS if floating else INT_OPS)
        count = self._count()
        if dtype == "float16" and redop in ("SUM", "AVG", "PREMUL_SUM"):
            count = min(count, 1024)
        root = rng.randrange(len(members))
        pair = (0, 0)
        if kind == "send_recv":
            a, b = rng.sample(range(len(members)), 2)
            pair = (a, b)
        op = Op(self._next, kind, gi, dtype, count, redop, root, pair)
        self._next += 1
        return op

    def ops(self, n: Optional[int] = None) -> Iterator[Op]:
        """The next ``n`` ops (forever when None)."""
        i = 0
        while n is None or i < n:
            yield self.next_op()
            i += 1


# --------------------------------------------------------------------------- data


def make_input(seed: int, op: Op, rank: int, n: Optional[int] = None, redop: str = "") -> Any:
    """The input of global rank ``rank`` for ``op``: ``n`` (default ``op.count``) small
    integers in ``op.dtype``, a pure function of the arguments."""
    n = op.count if n is None else n
    rng = np.random.default_rng([seed & 0xFFFFFFFF, op.index, rank])
    if redop == "PRODUCT":
        v = rng.integers(1, 3, n)  # 2**6 fits int8; exact in float16
    elif redop in ("BAND", "BOR", "BXOR"):
        v = rng.integers(0, 64, n)
    else:
        v = rng.integers(0, 8, n)
    return v.astype(op.dtype)


def reduce_np(redop: str, xs: Sequence[Any], dtype: str) -> Any:
    """The expected reduction of the arrays ``xs`` (exact for make_input's values)."""
    stack = np.stack([np.asarray(x, np.float64 if dtype.startswith("float") else np.int64)
                      for x in xs])
    if redop in ("SUM", "AVG", "PREMUL_SUM"):
        r = stack.sum(axis=0)
        if redop == "AVG":
            r = r / len(xs)
        elif redop == "PREMUL_SUM":
            r = r * PREMUL_FACTOR
    elif redop == "PRODUCT":
        r = stack.prod(axis=0)
    elif redop == "MIN":
        r = stack.min(axis=0)
    elif redop == "MAX":
        r = stack.max(axis=0)
    elif redop == "BAND":
        r = np.bitwise_and.reduce(stack, axis=0)
    elif redop == "BOR":
        r = np.bitwise_or.reduce(stack, axis=0)
    elif redop == "BXOR":
        r = np.bitwise_xor.reduce(stack, axis=0)
    else:
        raise ValueError(f"unknown reduction {redop}")
    return r.astype(dtype)


def _check(op: Op, members: Sequence[int], what: str, got: Any, want: Any) -> None:
    got = np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape:
        raise WrongResult(
            f"{op.describe(members)}: {what} has shape {got.shape}, expected {want.shape}"
        )
    if op.redop == "AVG" and op.kind in REDUCING:
        tol = 1e-2 if op.dtype == "float16" else 1e-6
        ok = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
        bad = ~np.isclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    else:
        bad = got != want
        ok = not bad.any()
    if not ok:
        i = int(np.flatnonzero(bad.ravel())[0])
        raise WrongResult(
            f"{op.describe(members)}: {what} is wrong at {int(bad.sum())} of {bad.size} "
            f"elements; first at [{i}]: got {got.ravel()[i]!r}, expected {want.ravel()[i]!r}"
        )


def _redop(xccl: Any, name: str) -> Any:
    if name == "PREMUL_SUM":
        return xccl._make_nccl_premul_sum(PREMUL_FACTOR)
    return getattr(xccl.ReduceOp, name)


def _split_sizes(seed: int, op: Op, n: int) -> list[list[int]]:
    """all_to_all_single's uneven split: sizes[i][j] = elements rank i sends to rank j."""
    rng = random.Random((seed, op.index).__hash__())
    return [[rng.randint(0, op.count) for _ in range(n)] for _ in range(n)]


# --------------------------------------------------------------------------- running


def make_groups(xccl: Any, groups: Sequence[Sequence[int]]) -> list[Any]:
    """Creates the workload's groups (index 0 must be the world, which maps to the default
    group); every rank calls this with the same groups in the same order."""
    handles: list[Any] = [None]
    for g in groups[1:]:
        handles.append(xccl.new_group(list(g)))
    return handles


def run_op(xccl: Any, seed: int, op: Op, group: Any, rank: int, members: Sequence[int]) -> int:
    """Runs ``op`` on this rank (``rank`` global; ``group`` the handle of ``members``, None
    for the default group) and checks its result. Returns the bytes this rank contributed
    (0 when it does not take part). Raises :class:`WrongResult` on a wrong result."""
    if rank not in op.participants(members):
        return 0
    n = len(members)
    me = members.index(rank)
    kind, dtype, count = op.kind, op.dtype, op.count
    ins = [make_input(seed, op, r, redop=op.redop if kind in REDUCING else "") for r in members]
    x = ins[me].copy()
    nbytes = x.nbytes
    if kind in ("all_reduce", "all_reduce_async"):
        w = xccl.all_reduce(x, op=_redop(xccl, op.redop), group=group,
                            async_op=kind == "all_reduce_async")
        if w is not None:
            w.wait()
        _check(op, members, "result", x, reduce_np(op.redop, ins, dtype))
    elif kind == "broadcast":
        xccl.broadcast(x, src=members[op.root], group=group)
        _check(op, members, "result", x, ins[op.root])
    elif kind == "reduce":
        xccl.reduce(x, dst=members[op.root], op=_redop(xccl, op.redop), group=group)
        want = reduce_np(op.redop, ins, dtype) if me == op.root else ins[me]
        if me == op.root:
            _check(op, members, "result at the root", x, want)
    elif kind == "all_gather":
        outs = [np.full(count, 99, dtype) for _ in range(n)]
        xccl.all_gather(outs, x, group=group)
        for j in range(n):
            _check(op, members, f"block from group rank {j}", outs[j], ins[j])
        _check(op, members, "input (must be unchanged)", x, ins[me])
    elif kind == "all_gather_into_tensor":
        out = np.full(n * count, 99, dtype)
        xccl.all_gather_into_tensor(out, x, group=group)
        _check(op, members, "result", out, np.concatenate(ins))
    elif kind == "gather":
        outs = [np.full(count, 99, dtype) for _ in range(n)] if me == op.root else None
        xccl.gather(x, gather_list=outs, dst=members[op.root], group=group)
        if outs is not None:
            for j in range(n):
                _check(op, members, f"block from group rank {j}", outs[j], ins[j])
    elif kind == "scatter":
        blocks = [make_input(seed, op, members[op.root] * 1000 + j) for j in range(n)]
        out = np.full(count, 99, dtype)
        xccl.scatter(out, scatter_list=blocks if me == op.root else None,
                     src=members[op.root], group=group)
        nbytes = out.nbytes
        _check(op, members, "block", out, blocks[me])
    elif kind in ("reduce_scatter", "reduce_scatter_tensor"):
        full = [make_input(seed, op, r, n * count, op.redop) for r in members]
        out = np.full(count, 99, dtype)
        if kind == "reduce_scatter":
            xccl.reduce_scatter(out, [full[me][j * count:(j + 1) * count] for j in range(n)],
                                op=_redop(xccl, op.redop), group=group)
        else:
            xccl.reduce_scatter_tensor(out, full[me].copy(), op=_redop(xccl, op.redop),
                                       group=group)
        nbytes = full[me].nbytes
        want = reduce_np(op.redop, [f[me * count:(me + 1) * count] for f in full], dtype)
        _check(op, members, "block", out, want)
    elif kind == "all_to_all":
        send = [make_input(seed, op, members[me] * 1000 + j) for j in range(n)]
        outs = [np.full(count, 99, dtype) for _ in range(n)]
        xccl.all_to_all(outs, send, group=group)
        nbytes = n * x.nbytes
        for j in range(n):
            _check(op, members, f"block from group rank {j}", outs[j],
                   make_input(seed, op, members[j] * 1000 + me))
    elif kind == "all_to_all_single":
        sizes = _split_sizes(seed, op, n)
        send = make_input(seed, op, rank, sum(sizes[me]))
        recv_sizes = [sizes[j][me] for j in range(n)]
        out = np.full(sum(recv_sizes), 99, dtype)
        xccl.all_to_all_single(out, send, output_split_sizes=recv_sizes,
                               input_split_sizes=sizes[me], group=group)
        nbytes = send.nbytes
        want = []
        for j in range(n):
            theirs = make_input(seed, op, members[j], sum(sizes[j]))
            off = sum(sizes[j][:me])
            want.append(theirs[off:off + sizes[j][me]])
        _check(op, members, "result", out, np.concatenate(want).astype(dtype))
    elif kind == "barrier":
        xccl.barrier(group=group)
        nbytes = 0
    elif kind == "send_recv":
        src, dst = members[op.pair[0]], members[op.pair[1]]
        if rank == src:
            xccl.send(x, dst=dst, group=group, tag=op.index % 1000)
        else:
            out = np.full(count, 99, dtype)
            got = xccl.recv(out, src=src, group=group, tag=op.index % 1000)
            if got != src:
                raise WrongResult(f"{op.describe(members)}: recv says source {got}, not {src}")
            _check(op, members, "received", out, ins[op.pair[0]])
    elif kind in ("isend_irecv_ring", "batch_isend_irecv"):
        nxt, prv = members[(me + 1) % n], members[(me - 1) % n]
        out = np.full(count, 99, dtype)
        if kind == "isend_irecv_ring":
            works = [xccl.irecv(out, src=prv, group=group), xccl.isend(x, dst=nxt, group=group)]
        else:
            works = xccl.batch_isend_irecv([
                xccl.P2POp(xccl.irecv, out, prv, group),
                xccl.P2POp(xccl.isend, x, nxt, group),
            ])
        for w in works:
            w.wait()
        _check(op, members, f"received from rank {prv}", out, ins[(me - 1) % n])
    else:
        raise ValueError(f"unknown op kind {kind}")
    return nbytes
