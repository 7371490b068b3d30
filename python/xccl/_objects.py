"""Collectives on picklable Python objects, with torch.distributed's signatures.

Objects travel as pickles in numpy uint8 buffers (torch is not needed); sizes travel as
int64, so one object may exceed 2 GiB. Data is unpickled only when it was received from a
member of the group through the operation itself.

.. warning:: unpickling runs arbitrary code: use these functions only among processes you
   trust (set ``XCCL_AUTH_KEY`` so that no outsider can join the job).
"""

from __future__ import annotations

import itertools
import pickle
from typing import Any, Optional

from . import _C
from ._collectives import _member, _recv_peer, _send_peer
from ._group import GroupLike, canonical_rank, get_global_rank

_PROTOCOL = pickle.HIGHEST_PROTOCOL


def _np() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is a test dependency
        raise ImportError("xccl's object collectives need numpy") from None
    return numpy


def _check_device(device: Any) -> None:
    """torch's `device` argument: where the pickles would be staged. Objects travel through
    host memory here whatever it says; a device other than cpu or cuda is refused."""
    if device is None:
        return
    kind = str(getattr(device, "type", device)).split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"object collectives: device {device!r} is neither cpu nor cuda")


def _dumps(obj: Any) -> Any:
    """The pickle of `obj` as a read-only uint8 array (no copy)."""
    return _np().frombuffer(pickle.dumps(obj, protocol=_PROTOCOL), dtype="uint8")


def _loads(buf: Any) -> Any:
    return pickle.loads(memoryview(buf))


def _displs(counts: list[int]) -> list[int]:
    return [0, *itertools.accumulate(counts)][:-1]


def all_gather_object(object_list: list[Any], obj: Any, group: GroupLike = None) -> None:
    """Gathers every rank's `obj` into `object_list` (one entry per rank, rank order)."""
    pg = _member(group, "all_gather_object")
    if pg is None:
        return
    np = _np()
    n = pg.size()
    data = _dumps(obj)
    sizes = np.zeros(n, np.int64)
    pg.comm.allgather(np.array([data.size], np.int64), sizes).wait()
    longest = int(sizes.max())
    padded = np.zeros(longest, np.uint8)
    padded[: data.size] = data
    out = np.empty(n * longest, np.uint8)
    pg.comm.allgather(padded, out).wait()
    for i in range(n):
        object_list[i] = _loads(out[i * longest : i * longest + int(sizes[i])])


def gather_object(
    obj: Any,
    object_gather_list: Optional[list[Any]] = None,
    dst: Optional[int] = None,
    group: GroupLike = None,
    group_dst: Optional[int] = None,
) -> None:
    """Gathers every rank's `obj` into `object_gather_list` of rank `dst` (default rank 0);
    the other ranks pass None."""
    pg = _member(group, "gather_object")
    if pg is None:
        return
    if dst is None and group_dst is None:
        group_dst = 0
    root = canonical_rank(pg, dst, group_dst, "dst")
    me, n = pg.rank(), pg.size()
    if me == root and object_gather_list is None:
        raise ValueError("Argument ``object_gather_list`` must be specified on destination rank.")
    if me != root and object_gather_list:
        raise ValueError(
            "Argument ``object_gather_list`` must NOT be specified on non-destination ranks."
        )
    np = _np()
    data = _dumps(obj)
    sizes = np.zeros(n, np.int64)
    rbuf = sizes if me == root else None
    pg.comm.gather(np.array([data.size], np.int64), rbuf, root).wait()
    # Every rank sends its pickle to the root only: an all-to-all with one non-empty column.
    scounts = [0] * n
    scounts[root] = int(data.size)
    sdispls = [0] * n
    if me == root:
        rcounts = [int(s) for s in sizes]
    else:
        rcounts = [0] * n
    rdispls = _displs(rcounts)
    out = np.empty(sum(rcounts), np.uint8)
    pg.comm.alltoallv(data, scounts, sdispls, out, rcounts, rdispls).wait()
    if me == root:
        assert object_gather_list is not None
        for i in range(n):
            object_gather_list[i] = _loads(out[rdispls[i] : rdispls[i] + rcounts[i]])


def broadcast_object_list(
    object_list: list[Any],
    src: Optional[int] = None,
    group: GroupLike = None,
    device: Any = None,
    group_src: Optional[int] = None,
) -> None:
    """Replaces the entries of `object_list` on every rank by those of rank `src` (default
    rank 0); every rank passes a list of the same length."""
    pg = _member(group, "broadcast_object_list")
    if pg is None:
        return
    _check_device(device)
    if src is None and group_src is None:
        group_src = 0
    root = canonical_rank(pg, src, group_src, "src")
    np = _np()
    me = pg.rank()
    sizes = np.zeros(len(object_list), np.int64)
    if me == root:
        pieces = [_dumps(obj) for obj in object_list]
        sizes[:] = [p.size for p in pieces]
    pg.comm.broadcast(sizes, root).wait()
    if me == root:
        data = np.concatenate(pieces) if pieces else np.empty(0, np.uint8)
        pg.comm.broadcast(data, root).wait()
        return
    data = np.empty(int(sizes.sum()), np.uint8)
    pg.comm.broadcast(data, root).wait()
    offset = 0
    for i, size in enumerate(int(s) for s in sizes):
        object_list[i] = _loads(data[offset : offset + size])
        offset += size


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: Optional[list[Any]] = None,
    src: Optional[int] = None,
    group: GroupLike = None,
    group_src: Optional[int] = None,
) -> None:
    """Sends ``scatter_object_input_list[r]`` of rank `src` (default rank 0) to rank r,
    which finds it in ``scatter_object_output_list[0]``."""
    pg = _member(group, "scatter_object_list")
    if pg is None:
        return
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError(
            "Expected argument scatter_object_output_list to be a list of size at least 1."
        )
    if src is None and group_src is None:
        group_src = 0
    root = canonical_rank(pg, src, group_src, "src")
    np = _np()
    me, n = pg.rank(), pg.size()
    sizes = np.zeros(n, np.int64)
    if me == root:
        if scatter_object_input_list is None:
            raise ValueError("source rank must provide non-None scatter_object_input_list")
        if len(scatter_object_input_list) != n:
            raise ValueError(
                f"scatter_object_input_list has {len(scatter_object_input_list)} objects, "
                f"expected one per rank of the group ({n})"
            )
        pieces = [_dumps(obj) for obj in scatter_object_input_list]
        sizes[:] = [p.size for p in pieces]
        data = np.concatenate(pieces)
        scounts = [int(s) for s in sizes]
    else:
        data = np.empty(0, np.uint8)
        scounts = [0] * n
    pg.comm.broadcast(sizes, root).wait()
    rcounts = [0] * n
    rcounts[root] = int(sizes[me])
    out = np.empty(rcounts[root], np.uint8)
    pg.comm.alltoallv(data, scounts, _displs(scounts), out, rcounts, [0] * n).wait()
    scatter_object_output_list[0] = _loads(out)


def send_object_list(
    object_list: list[Any],
    dst: Optional[int] = None,
    group: GroupLike = None,
    device: Any = None,
    group_dst: Optional[int] = None,
    use_batch: bool = False,
) -> None:
    """Sends the objects of `object_list` to `dst` (which calls recv_object_list with a
    list of the same length)."""
    pg = _member(group, "send_object_list")
    if pg is None:
        return
    _check_device(device)
    peer = _send_peer(pg, dst, group_dst)
    np = _np()
    pieces = [_dumps(obj) for obj in object_list]
    sizes = np.array([p.size for p in pieces], np.int64)
    data = np.concatenate(pieces) if pieces else np.empty(0, np.uint8)
    first = pg.comm.isend(sizes, peer, 0)
    second = pg.comm.isend(data, peer, 0)
    first.wait()
    second.wait()


def recv_object_list(
    object_list: list[Any],
    src: Optional[int] = None,
    group: GroupLike = None,
    device: Any = None,
    group_src: Optional[int] = None,
    use_batch: bool = False,
) -> int:
    """Receives as many objects as `object_list` holds from `src` (None: any rank) into
    it; returns the sender's global rank."""
    pg = _member(group, "recv_object_list")
    if pg is None:
        return -1
    _check_device(device)
    peer = _recv_peer(pg, src, group_src)
    np = _np()
    sizes = np.zeros(len(object_list), np.int64)
    work = pg.comm.irecv(sizes, peer, 0)
    work.wait()
    sender = work.source_rank() if peer == _C.ANY_SOURCE else peer
    data = np.empty(int(sizes.sum()), np.uint8)
    pg.comm.irecv(data, sender, 0).wait()
    offset = 0
    for i, size in enumerate(int(s) for s in sizes):
        object_list[i] = _loads(data[offset : offset + size])
        offset += size
    return get_global_rank(pg, sender)
