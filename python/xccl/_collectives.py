"""Point-to-point operations and collectives with torch.distributed's signatures.

Tensors are any DLPack producers on the CPU (torch tensors, numpy arrays, ...). Every
operation returns a :class:`Work` with ``async_op=True`` (``isend``/``irecv`` always) and
None otherwise. Single-tensor arguments must be contiguous; tensors given in lists may have
any layout (they are gathered into, or scattered from, one temporary buffer). Every
collective also takes the keyword ``algo=`` (an xccl extension) to force an algorithm.

Ranks: ``src``/``dst``/``peer`` are global ranks, ``group_src``/``group_dst``/``group_peer``
ranks within ``group``; give one of the two.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional, TypeVar, Union

from . import _C, _env, _group
from . import _tensor as T
from . import cuda as _cuda
from ._group import (
    GroupLike,
    ProcessGroup,
    _current_world,
    canonical_rank,
    ctl_comm,
    get_global_rank,
    resolve,
    warn_not_in_group,
)
from ._types import ReduceOp, XcclError, XcclTimeoutError, resolve_op
from ._work import Work

_AVG = _C.OPS["avg"]


def _member(group: GroupLike, op: str) -> Optional[ProcessGroup]:
    if group is None:  # the common case, without resolve's checks
        pg = _current_world().default
        if pg is not None:
            return pg
    pg = resolve(group)
    if pg is None:
        warn_not_in_group(op)
    return pg


def _done(
    cwork: _C.Work,
    outputs: list[Any],
    async_op: bool,
    finish: Optional[Callable[[], None]] = None,
    cuda: Optional[_cuda.CudaCall] = None,
) -> Optional[Work]:
    """Returns a Work for async_op; otherwise waits (and copies out) and returns None."""
    if cuda is not None:
        return _done_cuda(cwork, outputs, async_op, finish, cuda)
    if async_op:
        return Work(cwork, outputs, finish)
    cwork.wait()
    if finish is not None:
        finish()
    return None


def _done_cuda(
    cwork: _C.Work,
    outputs: list[Any],
    async_op: bool,
    finish: Optional[Callable[[], None]],
    cuda: _cuda.CudaCall,
) -> Optional[Work]:
    """_done for an operation on CUDA tensors (xccl.cuda, Streams). A call without async_op
    orders the call's stream and the current one after the operation. List outputs: the CPU
    waits for the operation, then their copy is queued on the call's stream (so such a call
    waits even with async_op), and the stream that is current afterwards (at wait() for
    async_op) is ordered after that copy."""
    if finish is None:
        if async_op:
            return Work(cwork, outputs, None, None, cuda)
        cuda.order(cwork, cuda.handle, cuda.current())
        return None
    cwork.wait()
    with cuda.stream_context():
        finish()
    event = cuda.record_event()
    if async_op:
        return Work(cwork, outputs, None, event, cuda)
    if event is not None:
        event.wait()  # torch: the current stream waits for the copy on the call's stream
    return None


def _named(name: str, ts: list[Any]) -> list[tuple[str, Any]]:
    return [(f"{name}[{i}]", t) for i, t in enumerate(ts)]


def _ctx(cu: Optional[_cuda.CudaCall]) -> Any:
    """Where the temporaries and copies of a call run: the call's stream for CUDA tensors."""
    return contextlib.nullcontext() if cu is None else cu.stream_context()


def _on(op: str, stream: Any, *named: tuple[str, Any]) -> Optional[_cuda.CudaCall]:
    """The CudaCall of a call on CUDA tensors, None for host tensors (see cuda.resolve)."""
    return _cuda.resolve(op, list(named), stream)


# The operators most calls pass, RedOpType members without a factor or a dtype rule, keyed by
# id(): members live as long as their class, so an id cannot be reused, and the lookup skips
# resolve_op's type tests and the enum's Python-level __hash__ on every collective.
_PLAIN_OPS = {
    id(m): resolve_op(m)
    for m in ReduceOp.RedOpType
    if m not in (ReduceOp.RedOpType.AVG, ReduceOp.RedOpType.PREMUL_SUM)
}
_SUM, _C_SUM = ReduceOp.SUM, _C.OPS["sum"]  # the default operator, tested by identity first


def _reduce_op(op: Any, tensor: Any, what: str) -> tuple[int, float]:
    plain = _PLAIN_OPS.get(id(op))
    if plain is not None:
        return plain
    c_op, factor = resolve_op(op)
    if c_op == _AVG and T.is_integer(tensor):
        raise TypeError(
            f"{what}: ReduceOp.AVG needs a floating-point or complex tensor, got "
            f"{T.dtype_name(tensor)} (as in torch.distributed); use SUM and divide"
        )
    return c_op, factor


def _check_numel(t: Any, want: int, what: str, why: str) -> None:
    n = T.numel(t)
    if n != want:
        raise ValueError(f"{what} has {n} elements, expected {want} ({why})")


def _check_count(ts: list[Any], n: int, what: str) -> None:
    if len(ts) != n:
        raise ValueError(f"{what} has {len(ts)} tensors, expected one per rank of the group ({n})")


def _copy_out(outputs: list[Any], buf: Any, counts: list[int]) -> Callable[[], None]:
    def finish() -> None:
        offset = 0
        for out, n in zip(outputs, counts, strict=True):
            T.copy_into(out, buf[offset : offset + n])
            offset += n

    return finish


def _natives_out(ts: list[Any], what: str) -> list[Any]:
    outs = []
    for i, t in enumerate(ts):
        t = T.native(t, f"{what}[{i}]")
        T.check_writable(t, f"{what}[{i}]")
        outs.append(t)
    return outs


# ---------------------------------------------------------------------------------------------
# Point to point
# ---------------------------------------------------------------------------------------------


def isend(
    tensor: Any,
    dst: Optional[int] = None,
    group: GroupLike = None,
    tag: int = 0,
    group_dst: Optional[int] = None,
    *,
    stream: Any = None,
) -> Optional[Work]:
    """Sends `tensor` to `dst` without blocking; returns a Work (None for non-members).
    Messages between two ranks with the same tag arrive in posting order."""
    T.check_tensor(tensor, "tensor")
    pg = _member(group, "isend")
    if pg is None:
        return None
    peer = canonical_rank(pg, dst, group_dst, "dst")
    cu = _on("isend", stream, ("tensor", tensor))
    cwork = pg.comm.isend(T.prep(tensor), peer, tag, _cuda.handle(cu))
    return Work(cwork, [tensor], cuda=cu)


def irecv(
    tensor: Any,
    src: Optional[int] = None,
    group: GroupLike = None,
    tag: int = 0,
    group_src: Optional[int] = None,
    *,
    stream: Any = None,
) -> Optional[Work]:
    """Receives into `tensor` from `src` (None: from any rank) without blocking; returns a
    Work whose ``source_rank()`` names the sender (None for non-members)."""
    T.check_tensor(tensor, "tensor")
    T.check_writable(tensor, "tensor")
    pg = _member(group, "irecv")
    if pg is None:
        return None
    if src is None and group_src is None:
        peer = _C.ANY_SOURCE
    else:
        peer = canonical_rank(pg, src, group_src, "src")
    cu = _on("irecv", stream, ("tensor", tensor))
    cwork = pg.comm.irecv(T.prep(tensor), peer, tag, _cuda.handle(cu))
    return Work(cwork, [tensor], cuda=cu)


def _other_rank(
    pg: ProcessGroup, rank: Optional[int], group_rank: Optional[int], arg: str, role: str
) -> int:
    """The group rank a blocking send (`arg` "dst", `role` "destination") or receive ("src",
    "source") is with; never this rank, as torch checks, in torch's words."""
    peer = canonical_rank(pg, rank, group_rank, arg)
    if peer == pg.rank():
        raise ValueError(
            f"Invalid {role} rank: {role} rank should not be the same as the rank of the "
            "current process."
        )
    return peer


def _send_peer(pg: ProcessGroup, dst: Optional[int], group_dst: Optional[int]) -> int:
    """The group rank a blocking send goes to."""
    return _other_rank(pg, dst, group_dst, "dst", "destination")


def _recv_peer(pg: ProcessGroup, src: Optional[int], group_src: Optional[int]) -> int:
    """The group rank a blocking receive takes from (ANY_SOURCE when neither is given)."""
    if src is None and group_src is None:
        return _C.ANY_SOURCE
    return _other_rank(pg, src, group_src, "src", "source")


def send(
    tensor: Any,
    dst: Optional[int] = None,
    group: GroupLike = None,
    tag: int = 0,
    group_dst: Optional[int] = None,
    *,
    stream: Any = None,
) -> None:
    """Sends `tensor` to `dst` and waits until the send completed (CUDA tensors: on the GPU
    too; xccl.cuda, Streams)."""
    if group is None and group_dst is None and dst is not None and stream is None:
        # the common call in one C call (see all_reduce)
        pg = _group._fast_default or _current_world().default
        if pg is not None and pg._comm.send_now(tensor, dst, tag) is not None:
            return
    T.check_tensor(tensor, "tensor")
    pg = _member(group, "send")
    if pg is None:
        return
    peer = _send_peer(pg, dst, group_dst)
    cu = _on("send", stream, ("tensor", tensor))
    cwork = pg.comm.isend(T.prep(tensor), peer, tag, _cuda.handle(cu))
    _done(cwork, [tensor], False, None, cu)


def recv(
    tensor: Any,
    src: Optional[int] = None,
    group: GroupLike = None,
    tag: int = 0,
    group_src: Optional[int] = None,
    *,
    stream: Any = None,
) -> int:
    """Receives into `tensor` from `src` (None: from any rank) and waits; returns the
    sender's global rank (-1 for non-members). CUDA tensors: it returns once the data is on
    the GPU (xccl.cuda, Streams)."""
    if group is None and group_src is None and src is not None and stream is None:
        # the common call in one C call (see all_reduce); on the default group the sender's
        # rank is its global rank
        pg = _group._fast_default or _current_world().default
        if pg is not None:
            source = pg._comm.recv_now(tensor, src, tag)
            if source is not None:
                return int(source)
    T.check_tensor(tensor, "tensor")
    T.check_writable(tensor, "tensor")
    pg = _member(group, "recv")
    if pg is None:
        return -1
    peer = _recv_peer(pg, src, group_src)
    cu = _on("recv", stream, ("tensor", tensor))
    work = pg.comm.irecv(T.prep(tensor), peer, tag, _cuda.handle(cu))
    work.wait()
    if peer == _C.ANY_SOURCE:
        peer = work.source_rank()
    return get_global_rank(pg, peer)


class P2POp:
    """One operation of :func:`batch_isend_irecv`: `op` is ``isend`` or ``irecv``, `peer` a
    global rank (or `group_peer` a rank of `group`; for irecv both may be omitted: any
    source)."""

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: Any,
        peer: Optional[int] = None,
        group: GroupLike = None,
        tag: int = 0,
        group_peer: Optional[int] = None,
    ) -> None:
        kind = getattr(op, "__name__", None)
        if kind not in ("isend", "irecv"):
            raise ValueError(
                "Invalid ``op``. Expected ``op`` to be of type ``xccl.isend`` or ``xccl.irecv``."
            )
        T.check_tensor(tensor, "tensor")
        self.op = op
        self.tensor = tensor
        self.tag = tag
        self.group = group
        pg = resolve(group)
        self._pg = pg
        if pg is None or (kind == "irecv" and peer is None and group_peer is None):
            self.group_peer: Optional[int] = None
            self.peer: Optional[int] = None
        else:
            self.group_peer = canonical_rank(pg, peer, group_peer, "peer")
            self.peer = get_global_rank(pg, self.group_peer)

    def __repr__(self) -> str:
        return (
            f"P2POp({self.op.__name__}, peer={self.peer}, tag={self.tag}, "
            f"shape={tuple(getattr(self.tensor, 'shape', ()))})"
        )


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Posts every send and receive of the list at once (none blocks, so the order inside
    the list cannot deadlock) and returns their Works in the same order."""
    if not isinstance(p2p_op_list, list) or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError(
            "Invalid ``p2p_op_list``. Each op is expected to be of type ``xccl.P2POp``."
        )
    if not p2p_op_list:
        return []
    first = p2p_op_list[0]._pg
    if not all(p._pg is first for p in p2p_op_list):
        raise ValueError("All ops need to use the same group.")
    if first is None:
        warn_not_in_group("batch_isend_irecv")
        return []
    # every op checked (devices, then each one's stream) before the first is posted
    _on("batch_isend_irecv", None, *[(f"p2p_op_list[{i}].tensor", p.tensor)
                                     for i, p in enumerate(p2p_op_list)])
    calls = [_on("batch_isend_irecv", None, (f"p2p_op_list[{i}].tensor", p.tensor))
             for i, p in enumerate(p2p_op_list)]
    for p in p2p_op_list:
        if p.op.__name__ != "isend":
            T.check_writable(p.tensor, "tensor")
    works = []
    for p, cu in zip(p2p_op_list, calls, strict=True):
        if p.op.__name__ == "isend":
            cwork = first.comm.isend(T.prep(p.tensor), p.group_peer, p.tag, _cuda.handle(cu))
        else:
            peer = _C.ANY_SOURCE if p.group_peer is None else p.group_peer
            cwork = first.comm.irecv(T.prep(p.tensor), peer, p.tag, _cuda.handle(cu))
        works.append(Work(cwork, [p.tensor], cuda=cu))
    return works


# ---------------------------------------------------------------------------------------------
# Collectives on one buffer
# ---------------------------------------------------------------------------------------------


def broadcast(
    tensor: Any,
    src: Optional[int] = None,
    group: GroupLike = None,
    async_op: bool = False,
    group_src: Optional[int] = None,
    *,
    algo: Optional[str] = None,
    stream: Any = None,
) -> Optional[Work]:
    """Copies `tensor` of rank `src` into `tensor` of every rank."""
    if (
        group is None
        and group_src is None
        and src is not None
        and not async_op
        and algo is None
        and stream is None
    ):
        # the common call in one C call (see all_reduce)
        pg = _group._fast_default or _current_world().default
        if pg is not None and pg._comm.broadcast_now(tensor, src, pg._timeout_arg) is not None:
            return None
    T.check_tensor(tensor, "tensor")
    pg = _member(group, "broadcast")
    if pg is None:
        return None
    root = canonical_rank(pg, src, group_src, "src")
    cu = _on("broadcast", stream, ("tensor", tensor))
    cwork = pg.comm.broadcast(T.prep(tensor), root, algo, pg._timeout_arg, _cuda.handle(cu))
    return _done(cwork, [tensor], async_op, None, cu)


def all_reduce(
    tensor: Any,
    op: Any = ReduceOp.SUM,
    group: GroupLike = None,
    async_op: bool = False,
    *,
    algo: Optional[str] = None,
    stream: Any = None,
) -> Optional[Work]:
    """Reduces `tensor` across the group with `op`; every rank gets the result in place."""
    if group is None and not async_op and algo is None and stream is None:
        # the common call in one C call; it declines (None, nothing done) whatever needs
        # the general path below, which then also raises the messages. The default group
        # (never a destroyed one) comes from _group._fast_default where it can.
        pg = _group._fast_default or _current_world().default
        c_op = _C_SUM if op is _SUM else _PLAIN_OPS.get(id(op), (None,))[0]
        if c_op is not None and pg is not None:
            if pg._comm.allreduce_now(tensor, c_op, pg._timeout_arg) is not None:
                return None
    T.check_tensor(tensor, "tensor")
    pg = _member(group, "all_reduce")
    if pg is None:
        return None
    c_op, factor = _reduce_op(op, tensor, "all_reduce")
    cu = _on("all_reduce", stream, ("tensor", tensor))
    t = T.prep(tensor)
    cwork = pg.comm.allreduce(t, t, c_op, factor, algo, pg._timeout_arg, _cuda.handle(cu))
    return _done(cwork, [tensor], async_op, None, cu)


def reduce(
    tensor: Any,
    dst: Optional[int] = None,
    op: Any = ReduceOp.SUM,
    group: GroupLike = None,
    async_op: bool = False,
    group_dst: Optional[int] = None,
    *,
    algo: Optional[str] = None,
    stream: Any = None,
) -> Optional[Work]:
    """Reduces `tensor` across the group with `op` into `tensor` of rank `dst` (the other
    ranks' tensors are left unchanged)."""
    T.check_tensor(tensor, "tensor")
    pg = _member(group, "reduce")
    if pg is None:
        return None
    root = canonical_rank(pg, dst, group_dst, "dst")
    c_op, factor = _reduce_op(op, tensor, "reduce")
    cu = _on("reduce", stream, ("tensor", tensor))
    t = T.prep(tensor)
    rbuf = t if pg.rank() == root else None
    cwork = pg.comm.reduce(t, rbuf, c_op, root, factor, algo, pg._timeout_arg, _cuda.handle(cu))
    return _done(cwork, [tensor], async_op, None, cu)


def all_gather_into_tensor(
    output_tensor: Any,
    input_tensor: Any,
    group: GroupLike = None,
    async_op: bool = False,
    *,
    algo: Optional[str] = None,
    stream: Any = None,
) -> Optional[Work]:
    """Concatenates every rank's `input_tensor` in rank order into `output_tensor`, whose
    shape is either ``[size * d0, ...]`` or ``[size, d0, ...]``."""
    if group is None and not async_op and algo is None and stream is None:
        pg = _group._fast_default or _current_world().default  # one C call (see all_reduce)
        if pg is not None:
            if pg._comm.allgather_now(input_tensor, output_tensor, pg._timeout_arg) is not None:
                return None
    T.check_tensor(output_tensor, "output_tensor")
    T.check_tensor(input_tensor, "input_tensor")
    pg = _member(group, "all_gather_into_tensor")
    if pg is None:
        return None
    cu = _on(
        "all_gather_into_tensor",
        stream,
        ("output_tensor", output_tensor),
        ("input_tensor", input_tensor),
    )
    _check_numel(
        output_tensor,
        pg.size() * T.numel(input_tensor),
        "all_gather_into_tensor: output_tensor",
        "group size x input elements",
    )
    cwork = pg.comm.allgather(
        T.prep(input_tensor), T.prep(output_tensor), algo, pg._timeout_arg, _cuda.handle(cu)
    )
    return _done(cwork, [output_tensor], async_op, None, cu)


def _all_gather_base(
    output_tensor: Any, input_tensor: Any, group: GroupLike = None, async_op: bool = False
) -> Optional[Work]:
    """Old name of :func:`all_gather_into_tensor`."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def reduce_scatter_tensor(
    output: Any,
    input: Any,  # noqa: A002 - torch's name
    op: Any = ReduceOp.SUM,
    group: GroupLike = None,
    async_op: bool = False,
    *,
    algo: Optional[str] = None,
    stream: Any = None,
) -> Optional[Work]:
    """Reduces `input` (``size`` blocks of ``output.numel()`` elements) across the group;
    rank r receives the reduction of block r in `output`."""
    if group is None and not async_op and algo is None and stream is None:
        pg = _group._fast_default or _current_world().default  # one C call (see all_reduce)
        c_op = _C_SUM if op is _SUM else _PLAIN_OPS.get(id(op), (None,))[0]
        if c_op is not None and pg is not None:
            if pg._comm.reduce_scatter_now(input, output, c_op, pg._timeout_arg) is not None:
                return None
    T.check_tensor(output, "output")
    T.check_tensor(input, "input")
    pg = _member(group, "reduce_scatter_tensor")
    if pg is None:
        return None
    cu = _on("reduce_scatter_tensor", stream, ("output", output), ("input", input))
    _check_numel(
        input,
        pg.size() * T.numel(output),
        "reduce_scatter_tensor: input",
        "group size x output elements",
    )
    c_op, factor = _reduce_op(op, input, "reduce_scatter_tensor")
    cwork = pg.comm.reduce_scatter(
        T.prep(input), T.prep(output), c_op, factor, algo, pg._timeout_arg, _cuda.handle(cu)
    )
    return _done(cwork, [output], async_op, None, cu)


def _reduce_scatter_base(
    output: Any,
    input: Any,  # noqa: A002
    op: Any = ReduceOp.SUM,
    group: GroupLike = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Old name of :func:`reduce_scatter_tensor`."""
    return reduce_scatter_tensor(output, input, op, group, async_op)


def _split_counts(
    splits: Optional[list[int]], t: Any, n: int, what: str
) -> tuple[list[int], list[int]]:
    """Element counts and displacements of dim-0 splits of `t` (even split when None)."""
    dims = T.shape(t)
    if not dims:
        raise ValueError(f"all_to_all_single: {what} must have at least one dimension")
    rows = dims[0]
    row = math.prod(dims[1:])
    if splits is None:
        if rows % n:
            raise ValueError(
                f"all_to_all_single: {what} has {rows} rows, which the group size {n} does "
                "not divide (pass split sizes)"
            )
        splits = [rows // n] * n
    else:
        splits = [int(s) for s in splits]
        if len(splits) != n:
            raise ValueError(
                f"all_to_all_single: {len(splits)} {what} split sizes for a group of {n}"
            )
        if any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(
                f"all_to_all_single: {what} split sizes {splits} do not add up to its {rows} rows"
            )
    counts = [s * row for s in splits]
    displs = [0, *itertools.accumulate(counts)][:-1]
    return counts, displs


def all_to_all_single(
    output: Any,
    input: Any,  # noqa: A002 - torch's name
    output_split_sizes: Optional[list[int]] = None,
    input_split_sizes: Optional[list[int]] = None,
    group: GroupLike = None,
    async_op: bool = False,
    *,
    algo: Optional[str] = None,
    stream: Any = None,
) -> Optional[Work]:
    """Splits `input` along dim 0 (evenly, or by `input_split_sizes` rows), sends piece j to
    rank j and concatenates the pieces received, in rank order, into `output` (whose pieces
    are `output_split_sizes` rows, or even). None or an empty list means an even split."""
    if group is None and not async_op and algo is None and stream is None:
        pg = _group._fast_default or _current_world().default  # one C call (see all_reduce)
        if pg is not None and not output_split_sizes and not input_split_sizes:
            if pg._comm.alltoall_now(input, output, pg._timeout_arg) is not None:
                return None
    T.check_tensor(output, "output")
    T.check_tensor(input, "input")
    pg = _member(group, "all_to_all_single")
    if pg is None:
        return None
    n = pg.size()
    cu = _on("all_to_all_single", stream, ("output", output), ("input", input))
    # As in torch, an empty list of split sizes means an even split.
    output_split_sizes = output_split_sizes or None
    input_split_sizes = input_split_sizes or None
    if output_split_sizes is None and input_split_sizes is None:
        _check_numel(output, T.numel(input), "all_to_all_single: output", "same as input")
        _split_counts(None, input, n, "input")
        cwork = pg.comm.alltoall(
            T.prep(input), T.prep(output), algo, pg._timeout_arg, _cuda.handle(cu)
        )
    else:
        scounts, sdispls = _split_counts(input_split_sizes, input, n, "input")
        rcounts, rdispls = _split_counts(output_split_sizes, output, n, "output")
        cwork = pg.comm.alltoallv(
            T.prep(input),
            scounts,
            sdispls,
            T.prep(output),
            rcounts,
            rdispls,
            algo,
            pg._timeout_arg,
            _cuda.handle(cu),
        )
    return _done(cwork, [output], async_op, None, cu)


def barrier(
    group: GroupLike = None,
    async_op: bool = False,
    device_ids: Optional[list[int]] = None,
    timeout: Union[None, timedelta, float] = None,
    *,
    algo: Optional[str] = None,
) -> Optional[Work]:
    """Returns (or completes the Work) once every rank of the group has entered it."""
    pg = _member(group, "barrier")
    if pg is None:
        return None
    seconds = pg._timeout_arg if timeout is None else _env.timeout_seconds(timeout, 0.0)
    cwork = pg.comm.barrier(algo=algo, timeout=seconds)
    return _done(cwork, [], async_op)


# ---------------------------------------------------------------------------------------------
# Collectives on lists of tensors (through one temporary buffer)
# ---------------------------------------------------------------------------------------------


def _gather_buffer(
    pg: ProcessGroup, tensor: Any, outs: list[Any], op: str, name: str
) -> tuple[Any, Any, Callable[[], None]]:
    """For gathering `tensor` of every rank into the list `outs` (argument `name`, checked:
    one tensor per rank, each with tensor's element count and dtype): the input as a native
    tensor, one flat buffer for all blocks, and the function copying it out into `outs`."""
    n = pg.size()
    _check_count(outs, n, f"{op}: {name}")
    src = T.native(tensor, "tensor")
    count = T.numel(src)
    outs = _natives_out(outs, name)
    for i, o in enumerate(outs):
        _check_numel(o, count, f"{op}: {name}[{i}]", "same as the input tensor")
    T.check_same_dtype([src, *outs])
    buf = T.empty_flat(src, n * count)
    return src, buf, _copy_out(outs, buf, [count] * n)


def all_gather(
    tensor_list: list[Any],
    tensor: Any,
    group: GroupLike = None,
    async_op: bool = False,
    *,
    algo: Optional[str] = None,
    stream: Any = None,
) -> Optional[Work]:
    """Gathers every rank's `tensor` into `tensor_list` (one tensor per rank, rank order)."""
    outs = T.check_tensor_list(tensor_list, "tensor_list")
    T.check_tensor(tensor, "tensor")
    pg = _member(group, "all_gather")
    if pg is None:
        return None
    cu = _on("all_gather", stream, ("tensor", tensor), *_named("tensor_list", outs))
    with _ctx(cu):
        src, buf, finish = _gather_buffer(pg, tensor, outs, "all_gather", "tensor_list")
    cwork = pg.comm.allgather(src, buf, algo, pg._timeout_arg, _cuda.handle(cu))
    return _done(cwork, tensor_list, async_op, finish, cu)


def gather(
    tensor: Any,
    gather_list: Optional[list[Any]] = None,
    dst: Optional[int] = None,
    group: GroupLike = None,
    async_op: bool = False,
    group_dst: Optional[int] = None,
    *,
    algo: Optional[str] = None,
    stream: Any = None,
) -> Optional[Work]:
    """Gathers every rank's `tensor` into `gather_list` of rank `dst` (default rank 0);
    the other ranks pass no gather_list."""
    T.check_tensor(tensor, "tensor")
    pg = _member(group, "gather")
    if pg is None:
        return None
    if dst is None and group_dst is None:
        group_dst = 0
    root = canonical_rank(pg, dst, group_dst, "dst")
    if pg.rank() != root:
        if gather_list:
            raise ValueError(
                "Argument ``gather_list`` must NOT be specified on non-destination ranks."
            )
        cu = _on("gather", stream, ("tensor", tensor))
        cwork = pg.comm.gather(T.prep(tensor), None, root, algo, pg._timeout_arg, _cuda.handle(cu))
        return _done(cwork, [], async_op, None, cu)
    if not gather_list:
        raise ValueError("Argument ``gather_list`` must be specified on destination rank.")
    outs = T.check_tensor_list(gather_list, "gather_list")
    cu = _on("gather", stream, ("tensor", tensor), *_named("gather_list", outs))
    with _ctx(cu):
        src, buf, finish = _gather_buffer(pg, tensor, outs, "gather", "gather_list")
    cwork = pg.comm.gather(src, buf, root, algo, pg._timeout_arg, _cuda.handle(cu))
    return _done(cwork, gather_list, async_op, finish, cu)


def scatter(
    tensor: Any,
    scatter_list: Optional[list[Any]] = None,
    src: Optional[int] = None,
    group: GroupLike = None,
    async_op: bool = False,
    group_src: Optional[int] = None,
    *,
    algo: Optional[str] = None,
    stream: Any = None,
) -> Optional[Work]:
    """Sends ``scatter_list[r]`` of rank `src` (default rank 0) into `tensor` of rank r;
    the other ranks pass no scatter_list."""
    T.check_tensor(tensor, "tensor")
    T.check_writable(tensor, "tensor")
    pg = _member(group, "scatter")
    if pg is None:
        return None
    if src is None and group_src is None:
        group_src = 0
    root = canonical_rank(pg, src, group_src, "src")
    if pg.rank() != root:
        if scatter_list:
            raise ValueError("Argument ``scatter_list`` must NOT be specified on non-source ranks.")
        cu = _on("scatter", stream, ("tensor", tensor))
        cwork = pg.comm.scatter(None, T.prep(tensor), root, algo, pg._timeout_arg, _cuda.handle(cu))
        return _done(cwork, [tensor], async_op, None, cu)
    if not scatter_list:
        raise ValueError("Argument ``scatter_list`` must be specified on source rank.")
    ins = T.check_tensor_list(scatter_list, "scatter_list")
    n = pg.size()
    _check_count(ins, n, "scatter: scatter_list")
    cu = _on("scatter", stream, ("tensor", tensor), *_named("scatter_list", ins))
    out = T.native(tensor, "tensor")
    count = T.numel(out)
    ins = [T.native(t, f"scatter_list[{i}]") for i, t in enumerate(ins)]
    for i, t in enumerate(ins):
        _check_numel(t, count, f"scatter: scatter_list[{i}]", "same as the output tensor")
    T.check_same_dtype([out, *ins])
    with _ctx(cu):
        buf, _ = T.pack(ins, out)
    cwork = pg.comm.scatter(buf, T.prep(tensor), root, algo, pg._timeout_arg, _cuda.handle(cu))
    return _done(cwork, [tensor], async_op, None, cu)


def reduce_scatter(
    output: Any,
    input_list: list[Any],
    op: Any = ReduceOp.SUM,
    group: GroupLike = None,
    async_op: bool = False,
    *,
    algo: Optional[str] = None,
    stream: Any = None,
) -> Optional[Work]:
    """Reduces ``input_list[r]`` across the group into `output` of rank r."""
    T.check_tensor(output, "output")
    ins = T.check_tensor_list(input_list, "input_list")
    pg = _member(group, "reduce_scatter")
    if pg is None:
        return None
    n = pg.size()
    _check_count(ins, n, "reduce_scatter: input_list")
    cu = _on("reduce_scatter", stream, ("output", output), *_named("input_list", ins))
    out = T.native(output, "output")
    count = T.numel(out)
    ins = [T.native(t, f"input_list[{i}]") for i, t in enumerate(ins)]
    for i, t in enumerate(ins):
        _check_numel(t, count, f"reduce_scatter: input_list[{i}]", "same as the output")
    T.check_same_dtype([out, *ins])
    c_op, factor = _reduce_op(op, out, "reduce_scatter")
    with _ctx(cu):
        buf, _ = T.pack(ins, out)
    cwork = pg.comm.reduce_scatter(
        buf, T.prep(output), c_op, factor, algo, pg._timeout_arg, _cuda.handle(cu)
    )
    return _done(cwork, [output], async_op, None, cu)


def all_to_all(
    output_tensor_list: list[Any],
    input_tensor_list: list[Any],
    group: GroupLike = None,
    async_op: bool = False,
    *,
    algo: Optional[str] = None,
    stream: Any = None,
) -> Optional[Work]:
    """Sends ``input_tensor_list[j]`` to rank j and receives rank i's piece into
    ``output_tensor_list[i]``; pieces may have different sizes."""
    outs = T.check_tensor_list(output_tensor_list, "output_tensor_list")
    ins = T.check_tensor_list(input_tensor_list, "input_tensor_list")
    pg = _member(group, "all_to_all")
    if pg is None:
        return None
    n = pg.size()
    _check_count(outs, n, "all_to_all: output_tensor_list")
    _check_count(ins, n, "all_to_all: input_tensor_list")
    cu = _on(
        "all_to_all",
        stream,
        *_named("output_tensor_list", outs),
        *_named("input_tensor_list", ins),
    )
    outs = _natives_out(outs, "output_tensor_list")
    ins = [T.native(t, f"input_tensor_list[{i}]") for i, t in enumerate(ins)]
    T.check_same_dtype([*outs, *ins])
    with _ctx(cu):
        sbuf, scounts = T.pack(ins, outs[0])
        rcounts = [T.numel(o) for o in outs]
        rbuf = T.empty_flat(outs[0], sum(rcounts))
    sdispls = [0, *itertools.accumulate(scounts)][:-1]
    rdispls = [0, *itertools.accumulate(rcounts)][:-1]
    cwork = pg.comm.alltoallv(
        sbuf, scounts, sdispls, rbuf, rcounts, rdispls, algo, pg._timeout_arg, _cuda.handle(cu)
    )
    return _done(cwork, output_tensor_list, async_op, _copy_out(outs, rbuf, rcounts), cu)


# ---------------------------------------------------------------------------------------------
# monitored_barrier
# ---------------------------------------------------------------------------------------------

_MB_OK = 0
_MB_FAILED = 1


def monitored_barrier(
    group: GroupLike = None,
    timeout: Union[None, timedelta, float] = None,
    wait_all_ranks: bool = False,
) -> None:
    """A barrier that names the ranks that did not arrive.

    Every rank reports to rank 0, which waits for each up to `timeout` (default: the
    group's) and then releases everyone. If some rank does not arrive in time, rank 0 raises
    naming it (with `wait_all_ranks`, every late rank) and tells the ranks that did arrive,
    which raise too; the other ranks give up after twice `timeout` without an answer."""
    pg = _member(group, "monitored_barrier")
    if pg is None:
        return
    seconds = _env.timeout_seconds(timeout, pg._timeout)
    n, me = pg.size(), pg.rank()
    if n == 1:
        return
    import numpy as np

    ctl, seq = ctl_comm(pg)
    tag = seq % (1 << 31)
    deadline = time.monotonic() + seconds
    ms = int(seconds * 1000)

    def left() -> float:
        return max(deadline - time.monotonic(), 1e-3)

    if me != 0:
        # Rank 0 answers at most `timeout` after it arrives, so wait twice that (plus a
        # margin) for its verdict before declaring rank 0 itself late.
        deadline += seconds + 1.0
        reply = np.zeros(n + 1, np.int64)
        rwork = ctl.irecv(reply, 0, tag)
        swork = ctl.isend(np.array([seq], np.int64), 0, tag)
        try:
            swork.wait(left())
            rwork.wait(left())
        except XcclTimeoutError:
            raise _error(
                XcclTimeoutError,
                f"Rank {me} timed out in monitoredBarrier: no answer from rank 0 within "
                f"{2 * ms + 1000} ms",
            ) from None
        if reply[0] != _MB_OK:
            late = ", ".join(str(r) for r in reply[2 : 2 + int(reply[1])])
            raise _error(
                XcclError,
                f"Rank {me}: rank 0 reported that rank(s) {late} failed to pass "
                f"monitoredBarrier in {ms} ms",
            )
        return

    arrivals = {r: np.zeros(1, np.int64) for r in range(1, n)}
    works = {r: ctl.irecv(arrivals[r], r, tag) for r in range(1, n)}
    late: list[int] = []
    arrived: list[int] = []
    errors: list[str] = []
    for r in range(1, n):
        if late and not wait_all_ranks:
            if works[r].is_completed() and works[r].is_success():
                arrived.append(r)
            continue
        try:
            works[r].wait(left())
            arrived.append(r)
        except XcclTimeoutError:
            late.append(r)
        except XcclError as exc:
            late.append(r)
            errors.append(f"rank {r}: {exc}")
    reply = np.zeros(n + 1, np.int64)
    if late:
        reply[0] = _MB_FAILED
        reply[1] = len(late)
        reply[2 : 2 + len(late)] = late
    sends = [ctl.isend(reply, r, tag) for r in arrived]
    for w in sends:
        try:
            w.wait(left())
        except XcclError:
            pass
    if late:
        if len(late) == 1:
            msg = f"Rank {late[0]} failed to pass monitoredBarrier in {ms} ms"
        else:
            msg = f"Ranks {', '.join(map(str, late))} failed to pass monitoredBarrier in {ms} ms"
        if errors:
            msg += " (" + "; ".join(errors) + ")"
        raise _error(XcclTimeoutError, msg)


def _error(cls: type[BaseException], msg: str) -> BaseException:
    """An instance of one of the extension's exception classes carrying `msg`."""
    try:
        return cls(msg)
    except Exception:
        return RuntimeError(msg)


_F = TypeVar("_F", bound=Callable[..., Any])


def _front(fn: _F, method: str, spec: str, timeout: bool = True) -> _F:
    """`fn` behind a C front (csrc/pyext/py_front.c): the common call (default group,
    defaults where `spec` asks for them, SUM) goes straight to the default group's one-call
    method `method`, 160 ns sooner than through `fn`; every other call, and one the method
    declines, runs `fn` itself. `spec` has one letter per parameter of `fn` (see py_front.c)."""
    front = _C.Front(fn, method, spec, timeout, _SUM, _C_SUM)
    functools.update_wrapper(front, fn)
    return front  # type: ignore[no-any-return]


send = _front(send, "send_now", "01n2nn", timeout=False)
recv = _front(recv, "recv_now", "01n2nn", timeout=False)
broadcast = _front(broadcast, "broadcast_now", "01nfnnn")
all_reduce = _front(all_reduce, "allreduce_now", "0bnfnn")
all_gather_into_tensor = _front(all_gather_into_tensor, "allgather_now", "10nfnn")
reduce_scatter_tensor = _front(reduce_scatter_tensor, "reduce_scatter_now", "10cnfnn")
all_to_all_single = _front(all_to_all_single, "alltoall_now", "10eenfnn")


__all__ = [
    "P2POp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "gather",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]
