"""xccl as a torch.distributed backend (CPU tensors), with no code compiled against libtorch.

    import torch.distributed as dist
    import xccl.torch                                   # registers the backend (idempotent)

    dist.init_process_group(xccl.torch.BACKEND)         # "xcclc"; env:// by default
    model = torch.nn.parallel.DistributedDataParallel(model)

The backend is registered under the name :data:`BACKEND` (``"xcclc"``), not ``"xccl"``:
torch >= 2.7 owns ``"xccl"`` for Intel's XPU backend and handles that name before it looks at
third-party backends, so ``init_process_group("xccl")`` can never reach this module.
``new_group``, ``init_device_mesh`` and DeviceMesh subgroups made under this backend run on
xccl too: each group is an xccl communicator split from the one xccl context the default
group created, so a process has one progress thread and one connection per peer however
many groups it makes.

How it plugs in: :func:`torch.distributed.Backend.register_backend` (extended API) calls
:func:`_create` once per group on its members; it returns a :class:`XcclProcessGroup`, a
Python subclass of ``torch.distributed.ProcessGroup`` (the pybind trampoline), which then
*is* the group torch uses. Every collective posts the matching ``xccl._C.Comm`` operation on
tensors exported through DLPack and returns an :class:`XcclWork`; nothing blocks in the
posting call. A Work completes on its own: xccl's progress thread runs the completion
callback (with the GIL), which copies list outputs into place and completes the Work's
torch future, which is what DDP's reducer waits on.

Errors from xccl are raised as torch's exception types (``DistBackendError``,
``DistNetworkError``, ``DistStoreError``) that are also xccl's (``XcclError`` and its
subclasses), so both ``except dist.DistBackendError`` and ``except xccl.XcclError`` work.
C++ callers waiting on a future (DDP) see a ``RuntimeError`` whose message carries the
xccl message: torch's futures do not keep Python exception types.

DTensor, tensor parallelism and FSDP2 run their collectives through torch's functional
collectives, which reach a Python process group through the ``ProcessGroup`` trampoline; on
torch 2.13 it forwards every method they use (``all_gather_single``,
``reduce_scatter_single``, their ``_coalesced`` forms, ``allreduce``, ...). Older torch
releases forward fewer methods (not verified here). Sparse tensors are not supported.

CUDA tensors (the backend is registered for ``"cpu"`` and ``"cuda"``), with the stream rules
of torch's NCCL backend: an operation runs after the work queued on the current stream of
its tensors' GPU when it is called; ``Work.wait()`` makes the current stream wait for it
without waiting on the CPU (:mod:`xccl.cuda`, Streams; ``XCCL_CUDA_WAIT=cpu`` makes it a CPU
wait); ``get_future()`` gives a CUDA-aware future that completes once the device work has
finished. Outputs that go
through a temporary (non-contiguous tensors, tensor lists) are copied on the call's stream
after the operation, so such a call waits like ``wait()`` before it returns. Collectives are
refused inside a CUDA graph capture. A Python backend cannot be one device's backend of a
group (torch's ``Backend`` has no Python constructor), so with ``"cpu:gloo,cuda:xcclc"`` the
group is xccl's for CPU tensors too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from . import _C, _cudafut, _env
from . import cuda as xcuda
from ._collectives import _split_counts

__all__ = [
    "BACKEND",
    "XcclDistBackendError",
    "XcclDistMismatchError",
    "XcclDistNetworkError",
    "XcclDistStoreError",
    "XcclDistTimeoutError",
    "XcclProcessGroup",
    "XcclWork",
    "is_registered",
    "register",
]

BACKEND = "xcclc"
"""The name to pass to ``torch.distributed.init_process_group`` (and ``new_group``)."""

DEVICES = ["cpu", "cuda"]
"""Device types the backend is registered for and takes tensors of."""


# ---------------------------------------------------------------------------------------------
# Errors: torch's types, also xccl's
# ---------------------------------------------------------------------------------------------


# DistNetworkError and DistStoreError appeared after DistBackendError (torch 2.2 era).
_DistBackendError = dist.DistBackendError
_DistNetworkError = getattr(dist, "DistNetworkError", _DistBackendError)
_DistStoreError = getattr(dist, "DistStoreError", _DistBackendError)


class XcclDistBackendError(_DistBackendError, _C.XcclError):
    """An xccl operation failed (torch's DistBackendError and xccl's XcclError)."""


class XcclDistTimeoutError(_DistBackendError, _C.XcclTimeoutError):
    """An xccl operation or wait ran past its deadline (also a TimeoutError)."""


class XcclDistNetworkError(_DistNetworkError, _C.XcclConnectionError):
    """A peer vanished or a connection failed (also a ConnectionError)."""


class XcclDistMismatchError(_DistBackendError, _C.XcclMismatchError):
    """The ranks called different collectives (or the same one with different arguments)."""


class XcclDistStoreError(_DistStoreError, _C.XcclError):
    """The rendezvous through torch's store failed while a group was being created."""


# Most specific first: the first class the error is an instance of decides.
_ERROR_MAP: list[tuple[type[BaseException], type[BaseException]]] = [
    (_C.XcclTimeoutError, XcclDistTimeoutError),
    (_C.XcclConnectionError, XcclDistNetworkError),
    (_C.XcclMismatchError, XcclDistMismatchError),
    (_C.XcclError, XcclDistBackendError),
]


def _translate(exc: BaseException, creating: bool = False) -> BaseException:
    """torch's exception type for an xccl error (other exceptions are returned unchanged).

    While a group is created, a store failure (a timeout, or an error whose cause is the
    store's) becomes DistStoreError. The result carries the message and the status
    attributes, and has the original as ``__cause__``."""
    if isinstance(exc, dist.DistError) or not isinstance(exc, _C.XcclError):
        return exc
    cls: type[BaseException] = XcclDistBackendError
    if creating and (
        isinstance(exc, _C.XcclTimeoutError) or isinstance(exc.__cause__, _DistStoreError)
    ):
        cls = XcclDistStoreError
    else:
        for xccl_cls, torch_cls in _ERROR_MAP:
            if isinstance(exc, xccl_cls):
                cls = torch_cls
                break
    out = cls(str(exc))
    out.status = getattr(exc, "status", _C.XcclError.status)  # type: ignore[attr-defined]
    out.status_name = getattr(exc, "status_name", "")  # type: ignore[attr-defined]
    out.__cause__ = exc
    return out


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------

_OP_NAMES = {
    "SUM": "sum",
    "AVG": "avg",
    "PRODUCT": "product",
    "MIN": "min",
    "MAX": "max",
    "BAND": "band",
    "BOR": "bor",
    "BXOR": "bxor",
    "PREMUL_SUM": "premul_sum",
}


def _reduce_op(op: Any) -> tuple[int, float]:
    """(xccl op code, premul factor) of an ``opts.reduceOp``: a ``dist.ReduceOp`` (whose
    ``.op`` is the kind) or a bare ``ReduceOp.RedOpType``.

    The factor of a PREMUL_SUM (``dist._make_nccl_premul_sum(f)``) is ``op.factor`` on
    recent torch and the second item of ``op.__getstate__()`` on older ones; a one-element
    tensor factor is read at call time."""
    kind = getattr(op, "op", op)
    name = getattr(kind, "name", None)
    if name not in _OP_NAMES:
        raise ValueError(f"xccl backend: unsupported reduce op {op!r}")
    factor: Any = 1.0
    if name == "PREMUL_SUM":
        factor = getattr(op, "factor", None)
        if factor is None and hasattr(op, "__getstate__"):
            state = op.__getstate__()
            factor = state[1] if isinstance(state, tuple) and len(state) > 1 else None
        if factor is None:
            raise ValueError("PREMUL_SUM needs a factor: use dist._make_nccl_premul_sum(factor)")
        if isinstance(factor, torch.Tensor):
            if factor.numel() != 1:
                raise ValueError("PREMUL_SUM factor tensor must have exactly one element")
            factor = factor.detach().item()
    return _C.OPS[_OP_NAMES[name]], float(factor)


def _seconds(timeout: Optional[timedelta]) -> Optional[float]:
    """An options timeout in seconds; None when unset (torch's unset value is negative),
    which leaves the group's timeout in force."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return seconds if seconds > 0 else None


# ---------------------------------------------------------------------------------------------
# Buffers
# ---------------------------------------------------------------------------------------------

Finish = Callable[[], None]


def _check_tensor(t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"xccl backend: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse or t.layout != torch.strided:
        raise NotImplementedError(
            f"xccl backend: {what} has layout {t.layout}; only dense "
            "(strided) tensors are supported"
        )
    if t.device.type not in DEVICES:
        raise NotImplementedError(
            f"xccl backend: {what} is on {t.device}; the backend takes CPU and CUDA tensors"
        )


class _Call:
    """Where one operation's tensors live: the host, or a GPU and the stream (current there
    when the operation was called) it is ordered after."""

    __slots__ = ("device", "stream")

    def __init__(self, device: torch.device, stream: Any = None) -> None:
        self.device = device
        self.stream = stream

    @property
    def cuda(self) -> bool:
        return self.stream is not None

    @property
    def handle(self) -> Optional[int]:
        """The CUstream handle xccl orders the operation after (None on the host)."""
        return None if self.stream is None else int(self.stream.cuda_stream)


_HOST = _Call(torch.device("cpu"))

# the communicator methods that take a `stream`
_STREAM_OPS = frozenset(
    {
        "isend",
        "irecv",
        "allreduce",
        "broadcast",
        "reduce",
        "allgather",
        "gather",
        "scatter",
        "reduce_scatter",
        "alltoall",
        "alltoallv",
    }
)


class _OnStream:
    """A communicator whose operations are posted with ``stream=`` (CUDA tensors)."""

    __slots__ = ("_comm", "_stream")

    def __init__(self, comm: _C.Comm, stream: Optional[int]) -> None:
        self._comm = comm
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._comm, name)
        if name not in _STREAM_OPS:
            return attr
        stream = self._stream

        def post(*args: Any, **kwargs: Any) -> Any:
            return attr(*args, stream=stream, **kwargs)

        return post


def _call_of(*named: tuple[str, Any]) -> _Call:
    """The _Call of an operation on the (name, tensor) pairs `named` (tensors or lists of
    them), which must all be on one device; checked before anything is allocated or moves."""
    device: Optional[torch.device] = None
    first = ""
    for what, item in named:
        items = item if isinstance(item, (list, tuple)) else [item]
        for i, t in enumerate(items):
            name = what if items is not item else f"{what}[{i}]"
            _check_tensor(t, name)
            if device is None:
                device, first = t.device, name
            elif t.device != device:
                raise ValueError(
                    f"xccl backend: {name} is on {t.device} and {first} on {device}: the "
                    "tensors of one operation must be on one device"
                )
    if device is None or device.type == "cpu":
        return _HOST
    with torch.cuda.device(device):
        capturing = torch.cuda.is_current_stream_capturing()
    if capturing:
        raise RuntimeError(
            "xccl backend: operations cannot be captured in a CUDA graph (xccl runs them on "
            "its own stream, driven from the host); call them outside the capture"
        )
    _cudafut.side_stream(torch, device)  # made here, on the caller's thread
    return _Call(device, torch.cuda.current_stream(device))


def _src(t: torch.Tensor, what: str = "tensor") -> torch.Tensor:
    """A contiguous view (or copy) of input `t` that DLPack can export."""
    _check_tensor(t, what)
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def _dst(t: torch.Tensor, finishes: list[Finish], what: str = "tensor") -> torch.Tensor:
    """A contiguous buffer to receive into for output `t`; when `t` is not contiguous it is
    a temporary that a finish step (appended to `finishes`) copies back."""
    _check_tensor(t, what)
    t = t.detach()
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return t
    tmp = torch.empty(t.shape, dtype=t.dtype, device=t.device)

    def copy_back() -> None:
        t.copy_(tmp)

    finishes.append(copy_back)
    return tmp


def _inplace(t: torch.Tensor, finishes: list[Finish], what: str = "tensor") -> torch.Tensor:
    """A contiguous buffer holding `t`'s data, whose result ends up in `t` (in place)."""
    _check_tensor(t, what)
    t = t.detach()
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return t
    tmp = t.resolve_conj().resolve_neg().contiguous()

    def copy_back() -> None:
        t.copy_(tmp)

    finishes.append(copy_back)
    return tmp


def _cat(ts: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """The elements of `ts`, flattened and concatenated into one new 1-D tensor."""
    for i, t in enumerate(ts):
        _check_tensor(t, f"{what}[{i}]")
    _same_dtype(ts, what)
    if not ts:
        return torch.empty(0)
    return torch.cat([t.detach().reshape(-1) for t in ts])


def _scatter_back(
    buf: torch.Tensor, outs: Sequence[torch.Tensor], finishes: list[Finish], offset: int = 0
) -> None:
    """Appends a finish step copying consecutive pieces of flat `buf` (from `offset`) into
    the tensors `outs`."""
    pieces = []
    for t in outs:
        n = t.numel()
        pieces.append((t.detach(), offset, n))
        offset += n

    def copy_out() -> None:
        for t, start, n in pieces:
            t.copy_(buf[start : start + n].view(t.shape))

    finishes.append(copy_out)


def _same_dtype(ts: Sequence[torch.Tensor], what: str) -> None:
    if any(t.dtype != ts[0].dtype for t in ts):
        kinds = sorted({str(t.dtype) for t in ts})
        raise ValueError(f"xccl backend: {what} mixes dtypes {', '.join(kinds)}")


def _check_numel(t: torch.Tensor, want: int, what: str) -> None:
    if t.numel() != want:
        raise ValueError(f"xccl backend: {what} has {t.numel()} elements, expected {want}")


# ---------------------------------------------------------------------------------------------
# Work
# ---------------------------------------------------------------------------------------------


def _unwrap(fut: torch.futures.Future) -> Any:
    """then()-callback that turns a Python-level exception of the inner future into a C++
    error of the outer one (so that C++ waiters such as DDP's reducer see it)."""
    return fut.value()


class XcclWork(dist.Work):
    """The ``torch.distributed.Work`` of one operation on an :class:`XcclProcessGroup`.

    It may stand for several xccl operations (one per tensor of a list); it completes when
    all of them have, after the outputs that went through temporaries are copied into
    place. ``wait()`` raises the operation's error as one of torch's types;
    ``get_future()`` gives a future completed (by xccl's progress thread) with the output
    tensors, or failed with the error's message.

    On CUDA tensors (``call``): ``wait()`` makes the current stream wait for the operation on
    the GPU; copies into outputs that went through temporaries are queued on the call's
    stream at the call, behind a wait of that stream for the operation, and an event after
    them is what later waits and the future wait for; ``synchronize()`` waits on the CPU.
    """

    def __init__(
        self,
        cworks: Sequence[_C.Work],
        result: list[Any],
        finishes: Optional[list[Finish]] = None,
        source_rank: Optional[Callable[[], int]] = None,
        call: _Call = _HOST,
    ) -> None:
        super().__init__()
        self._cworks = list(cworks)
        self._result = result
        self._finishes = finishes or []
        self._source = source_rank
        self._call = call if call.cuda else None
        self._event: Any = None  # CUDA: recorded on the call's stream after the copy-outs
        self._lock = threading.RLock()
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._inner: Optional[torch.futures.Future] = None  # completed from Python
        self._outer: Optional[torch.futures.Future] = None  # what get_future() hands out
        if self._call is not None and self._finishes and self._cworks:
            self._queue_finishes(self._call)
        for cw in self._cworks:
            cw.add_done_callback(self._on_done)
        if not self._cworks:
            self._on_done(None)

    def _queue_finishes(self, call: _Call) -> None:
        """CUDA: the call's stream waits for the operations, then copies the outputs."""
        try:
            for cw in self._cworks:
                xcuda.order(cw, int(call.handle or 0))
        except _C.XcclError as exc:
            raise _translate(exc) from None
        with torch.cuda.stream(call.stream):
            for finish in self._finishes:
                finish()
            self._event = torch.cuda.Event()
            self._event.record(call.stream)
        self._finishes = []

    # Completion runs once, on whichever thread sees the last xccl operation complete (xccl's
    # progress thread or a waiter); the GIL is held there.
    def _on_done(self, _cw: Optional[_C.Work]) -> None:
        with self._lock:
            if self._done.is_set() or not all(cw.is_completed() for cw in self._cworks):
                return
            error = None
            for cw in self._cworks:
                exc = cw.exception()
                if exc is not None:
                    error = _translate(exc)
                    break
            if error is None:
                try:
                    for finish in self._finishes:
                        finish()
                except BaseException as exc:  # reported by wait() and the future
                    error = exc
            self._finishes = []
            self._error = error
            self._done.set()
            inner = self._inner
        if inner is not None:
            self._complete(inner)

    def _complete(self, fut: torch.futures.Future) -> None:
        if self._call is not None:  # a CUDA-aware future (xccl._cudafut)
            _cudafut.complete(torch, fut, self._call.device, self._result, self._error, self._event)
        elif self._error is not None:
            fut.set_exception(self._error)
        else:
            fut.set_result(self._result)

    def wait(self, timeout: Union[None, timedelta, float] = None) -> bool:
        """Blocks (GIL released) until the operation completes; returns True or raises its
        error. `timeout` (timedelta or seconds; None or 0: the operation's own deadline)
        raises :class:`XcclDistTimeoutError` when it passes first (the operation goes on).
        CUDA tensors without a timeout: the current stream waits for the operation on the
        GPU instead (the class's text)."""
        seconds = _seconds(timeout) if timeout is not None else None
        if self._call is not None and seconds is None:
            return self._wait_stream(self._call)
        deadline = None if seconds is None else time.monotonic() + seconds
        try:
            for cw in self._cworks:
                cw.wait(None if deadline is None else max(deadline - time.monotonic(), 1e-6))
        except _C.XcclError as exc:
            if not all(cw.is_completed() for cw in self._cworks):
                raise _translate(exc) from None  # the wait timed out, not the operation
        self._on_done(None)
        # The callback may still be running on the progress thread (copying outputs).
        self._done.wait()
        if self._error is not None:
            raise self._error
        if self._event is not None:
            torch.cuda.current_stream(self._call.device).wait_event(self._event)
        return True

    def _wait_stream(self, call: _Call) -> bool:
        current = torch.cuda.current_stream(call.device)
        try:
            if self._event is not None:  # the operations were waited for at the call
                current.wait_event(self._event)
            else:
                for cw in self._cworks:
                    xcuda.order(cw, int(current.cuda_stream))
        except _C.XcclError as exc:
            raise _translate(exc) from None
        if self.is_completed() and self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        """A future completed with the output tensors when the operation completes (for
        CUDA tensors a CUDA-aware one: its consumers' streams wait for the outputs)."""
        with self._lock:
            if self._outer is None:
                if self._call is not None:
                    self._inner = _cudafut.new_future(torch, self._call.device)
                else:
                    self._inner = torch.futures.Future()
                self._outer = self._inner.then(_unwrap)
                ready = self._done.is_set()
            else:
                ready = False
        if ready:
            self._complete(self._inner)
        return self._outer

    def is_completed(self) -> bool:
        """True once the operation finished (successfully or not); does not block."""
        if not self._done.is_set():
            self._on_done(None)
        if self._done.is_set() and self._event is not None and self._error is None:
            return bool(self._event.query())  # and the copy-outs behind it
        return self._done.is_set()

    def is_success(self) -> bool:
        """True when the operation completed without error."""
        return self.is_completed() and self._error is None

    def exception(self) -> Optional[BaseException]:
        """The error of a failed operation, else None."""
        return self._error if self.is_completed() else None

    def source_rank(self) -> int:
        """For a completed receive from any source: the sender's rank in the group."""
        if self._source is None:
            raise ValueError("source_rank() is only available for receives")
        return self._source()

    def _source_rank(self) -> int:
        return self.source_rank()

    def result(self) -> list[Any]:
        """Waits, then returns the output tensors."""
        self.wait()
        return self._result

    def synchronize(self) -> None:
        """Waits on the CPU until the operation has completed (on CUDA tensors: its device
        work and the copy-outs too); raises its error."""
        for cw in self._cworks:
            try:
                cw.wait()  # returns once it has ended, either way
            except _C.XcclError:
                pass  # reported below, as torch's type
        self._on_done(None)
        self._done.wait()
        if self._error is not None:
            raise self._error
        if self._event is not None:
            self._event.synchronize()

    def __repr__(self) -> str:
        names = ",".join(sorted({cw.name for cw in self._cworks})) or "noop"
        state = "completed" if self._done.is_set() else "pending"
        return f"<XcclWork {names} {state}>"


# ---------------------------------------------------------------------------------------------
# ProcessGroup
# ---------------------------------------------------------------------------------------------


class _BackendView:
    """Answers torch's Python code where it asks a group for its per-device C++ backend
    (``pg._get_backend(device)``: FSDP2's buffer allocation, ``init_process_group(device_id=)``,
    DeviceMesh, ``split_group``). A Python group has no such backend - torch's ``Backend``
    cannot be subclassed in Python - so this one says what xccl does not offer there:
    communicator splitting through torch, coalescing managers, tensor allocation and time
    estimates. Anything else torch asks is an AttributeError naming it."""

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False

    def __init__(self, group_id: str, device: torch.device) -> None:
        self._group_id = group_id
        self._device = device

    def name(self) -> str:
        return BACKEND

    def supports_tensor_alloc(self, device: Any) -> bool:
        del device
        return False

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"xccl backend: torch asked the {self._device.type} backend of group "
            f"{self._group_id!r} for {name!r}, which xccl's Python process group does not provide"
        )

    def __repr__(self) -> str:
        return f"<xccl backend view of group {self._group_id!r} on {self._device.type}>"


class XcclProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose operations run on one xccl communicator.

    Made by torch (``init_process_group(BACKEND)``, ``new_group``, DeviceMesh) through
    the registered creator; not meant to be constructed directly. Method names and option
    objects are those of ``torch._C._distributed_c10d.ProcessGroup``; where torch renamed a
    method (2.13) both spellings are provided."""

    def __init__(
        self,
        comm: _C.Comm,
        global_ranks: Sequence[int],
        group_id: str,
        timeout: float,
        context: Optional[_Context] = None,
    ) -> None:
        super().__init__(comm.rank, comm.size)
        self._comm: Optional[_C.Comm] = comm
        self._context = context  # holds a use of the shared xccl context; dropped by shutdown
        self._global_ranks = list(global_ranks)
        self._group_id = group_id
        self._group_name = group_id
        self._group_desc = "undefined"
        self._timeout_s = timeout
        self._mb_group: Any = None  # xccl._group.ProcessGroup view for monitored_barrier

    # -- identity ---------------------------------------------------------------------------

    def _get_backend(self, device: Any) -> _BackendView:  # torch's name
        """What torch's Python code finds as the group's backend for `device` (see
        :class:`_BackendView`); RuntimeError, as torch's, for a device type xccl does not
        serve."""
        dev = torch.device(device)
        if dev.type not in DEVICES:
            raise RuntimeError(f"No backend type associated with device type {dev.type}")
        return _BackendView(self._group_id, dev)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """The backend's name, :data:`BACKEND`."""
        return BACKEND

    # torch keeps a group's name and description in its per-device C++ backends, which a
    # Python group does not have: these overrides hold them (``pg.group_name``, functional
    # collectives and DeviceMesh look groups up by name).
    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        """The group's name in torch's registry (set by torch after creation)."""
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
        """Records the name torch gives the group."""
        self._group_name = str(name)

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
        """The group's description ("default_pg", "undefined", ...)."""
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's name
        """Records the description torch gives the group."""
        self._group_desc = str(desc)

    @property
    def comm(self) -> _C.Comm:
        """The xccl communicator behind the group."""
        if self._comm is None:
            raise XcclDistBackendError(
                f"xccl backend: process group {self._group_id!r} has been shut down"
            )
        return self._comm

    @property
    def global_ranks(self) -> list[int]:
        """Global ranks of the members, in group-rank order."""
        return list(self._global_ranks)

    def __repr__(self) -> str:
        state = "" if self._comm is not None else ", shut down"
        return (
            f"<XcclProcessGroup {self._group_id!r} rank={super().rank()} "
            f"size={super().size()}{state}>"
        )

    def _op_seconds(self, opts: Any) -> float:
        """The deadline of an operation: ``opts.timeout`` when set, else the group's (the
        communicator's own default is the context's, which may differ)."""
        seconds = _seconds(opts.timeout) if opts is not None else None
        return self._timeout_s if seconds is None else seconds

    def _post(self, fn: Callable[[], _C.Work]) -> _C.Work:
        try:
            return fn()
        except _C.XcclError as exc:
            raise _translate(exc) from None

    def _work(
        self,
        posts: Sequence[Callable[[], _C.Work]],
        result: list[Any],
        finishes: Optional[list[Finish]] = None,
        call: _Call = _HOST,
    ) -> XcclWork:
        return XcclWork([self._post(p) for p in posts], result, finishes, None, call)

    def _comm_on(self, call: _Call) -> Any:
        """The communicator, its operations ordered after `call`'s stream (CUDA tensors)."""
        comm = self.comm
        return comm if not call.cuda else _OnStream(comm, call.handle)

    # -- point to point ---------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> XcclWork:  # noqa: N803
        """Sends each tensor to group rank `dstRank` with `tag`."""
        call = _call_of(("tensors", tensors))
        comm = self._comm_on(call)
        bufs = [_src(t) for t in tensors]
        return self._work(
            [lambda b=b: comm.isend(b, dstRank, tag) for b in bufs], tensors, call=call
        )

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> XcclWork:  # noqa: N803
        """Receives into each tensor from group rank `srcRank` with `tag`."""
        return self._recv(tensors, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> XcclWork:
        """Receives into each tensor from whichever rank sends with `tag` first; the Work's
        ``_source_rank()`` names the sender."""
        return self._recv(tensors, _C.ANY_SOURCE, tag)

    def _recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> XcclWork:
        call = _call_of(("tensors", tensors))
        comm = self._comm_on(call)
        finishes: list[Finish] = []
        bufs = [_dst(t, finishes) for t in tensors]
        cworks = [self._post(lambda b=b: comm.irecv(b, src, tag)) for b in bufs]

        def source() -> int:
            return cworks[0].source_rank() if cworks else -1

        return XcclWork(cworks, tensors, finishes, source, call)

    # -- collectives on one buffer per tensor -----------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> XcclWork:
        """Reduces each tensor across the group in place (``opts.reduceOp``)."""
        opts = opts if opts is not None else dist.AllreduceOptions()
        call = _call_of(("tensors", tensors))
        comm, seconds = self._comm_on(call), self._op_seconds(opts)
        op, premul = _reduce_op(opts.reduceOp)
        finishes: list[Finish] = []
        bufs = [_inplace(t, finishes) for t in tensors]
        posts = [lambda b=b: comm.allreduce(b, b, op, premul, timeout=seconds) for b in bufs]
        return self._work(posts, tensors, finishes, call=call)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> XcclWork:
        """Reduces all `tensors` (one dtype) as one flat buffer: a single xccl operation."""
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        call = _call_of(("tensors", tensors))
        comm, seconds = self._comm_on(call), self._op_seconds(opts)
        op, premul = _reduce_op(opts.reduceOp)
        finishes: list[Finish] = []
        if not tensors:
            return XcclWork([], tensors)
        flat = _cat(tensors, "tensors")
        _scatter_back(flat, tensors, finishes)
        return self._work(
            [lambda: comm.allreduce(flat, flat, op, premul, timeout=seconds)],
            tensors,
            finishes,
            call=call,
        )

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> XcclWork:
        """Copies each tensor of group rank ``opts.rootRank`` into the others' tensors."""
        opts = opts if opts is not None else dist.BroadcastOptions()
        call = _call_of(("tensors", tensors))
        comm, seconds, root = self._comm_on(call), self._op_seconds(opts), opts.rootRank
        finishes: list[Finish] = []
        if comm.rank == root:
            bufs = [_src(t) for t in tensors]
        else:
            bufs = [_dst(t, finishes) for t in tensors]
        posts = [lambda b=b: comm.broadcast(b, root, timeout=seconds) for b in bufs]
        return self._work(posts, tensors, finishes, call=call)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> XcclWork:
        """Reduces each tensor into the tensor of group rank ``opts.rootRank``."""
        opts = opts if opts is not None else dist.ReduceOptions()
        call = _call_of(("tensors", tensors))
        comm, seconds, root = self._comm_on(call), self._op_seconds(opts), opts.rootRank
        op, premul = _reduce_op(opts.reduceOp)
        finishes: list[Finish] = []
        if comm.rank == root:
            bufs = [_inplace(t, finishes) for t in tensors]
            posts = [lambda b=b: comm.reduce(b, b, op, root, premul, timeout=seconds) for b in bufs]
        else:
            bufs = [_src(t) for t in tensors]
            posts = [
                lambda b=b: comm.reduce(b, None, op, root, premul, timeout=seconds) for b in bufs
            ]
        return self._work(posts, tensors, finishes, call=call)

    def all_gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        opts: Any = None,
    ) -> XcclWork:
        """Concatenates every rank's `input` in rank order into `output`."""
        seconds = self._op_seconds(opts)
        call = _call_of(("output", output), ("input", input))
        comm = self._comm_on(call)
        _check_numel(output, comm.size * input.numel(), "all_gather output")
        finishes: list[Finish] = []
        src, dst = _src(input, "input"), _dst(output, finishes, "output")
        return self._work(
            [lambda: comm.allgather(src, dst, timeout=seconds)], [output], finishes, call=call
        )

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> XcclWork:
        """``all_gather_single`` of each (output, input) pair."""
        seconds = self._op_seconds(opts)
        call = _call_of(("outputs", outputs), ("inputs", inputs))
        comm = self._comm_on(call)
        if len(outputs) != len(inputs):
            raise ValueError("xccl backend: as many outputs as inputs expected")
        finishes: list[Finish] = []
        posts = []
        for i, (out, inp) in enumerate(zip(outputs, inputs, strict=True)):
            _check_numel(out, comm.size * inp.numel(), f"outputs[{i}]")
            src, dst = _src(inp, f"inputs[{i}]"), _dst(out, finishes, f"outputs[{i}]")
            posts.append(lambda s=src, d=dst: comm.allgather(s, d, timeout=seconds))
        return self._work(posts, outputs, finishes, call=call)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        opts: Any = None,
    ) -> XcclWork:
        """Reduces `input` (``size`` blocks of ``output.numel()``) across the group; rank r
        receives the reduction of block r."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        call = _call_of(("output", output), ("input", input))
        comm, seconds = self._comm_on(call), self._op_seconds(opts)
        op, premul = _reduce_op(opts.reduceOp)
        _check_numel(input, comm.size * output.numel(), "reduce_scatter input")
        finishes: list[Finish] = []
        src, dst = _src(input, "input"), _dst(output, finishes, "output")
        return self._work(
            [lambda: comm.reduce_scatter(src, dst, op, premul, timeout=seconds)],
            [output],
            finishes,
            call=call,
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> XcclWork:
        """``reduce_scatter_single`` of each (output, input) pair."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        call = _call_of(("outputs", outputs), ("inputs", inputs))
        comm, seconds = self._comm_on(call), self._op_seconds(opts)
        op, premul = _reduce_op(opts.reduceOp)
        if len(outputs) != len(inputs):
            raise ValueError("xccl backend: as many outputs as inputs expected")
        finishes: list[Finish] = []
        posts = []
        for i, (out, inp) in enumerate(zip(outputs, inputs, strict=True)):
            _check_numel(inp, comm.size * out.numel(), f"inputs[{i}]")
            src, dst = _src(inp, f"inputs[{i}]"), _dst(out, finishes, f"outputs[{i}]")
            posts.append(
                lambda s=src, d=dst: comm.reduce_scatter(s, d, op, premul, timeout=seconds)
            )
        return self._work(posts, outputs, finishes, call=call)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> XcclWork:
        """Splits `input` along dim 0 (evenly when the split lists are empty), sends piece j
        to rank j, and concatenates the received pieces in rank order into `output`."""
        seconds = self._op_seconds(opts)
        call = _call_of(("output", output), ("input", input))
        comm = self._comm_on(call)
        n = comm.size
        finishes: list[Finish] = []
        src, dst = _src(input, "input"), _dst(output, finishes, "output")
        if not output_split_sizes and not input_split_sizes:
            _check_numel(output, input.numel(), "all_to_all output")
            _split_counts(None, input, n, "input")
            post = lambda: comm.alltoall(src, dst, timeout=seconds)  # noqa: E731
        else:
            scounts, sdispls = _split_counts(input_split_sizes or None, input, n, "input")
            rcounts, rdispls = _split_counts(output_split_sizes or None, output, n, "output")
            post = lambda: comm.alltoallv(  # noqa: E731
                src, scounts, sdispls, dst, rcounts, rdispls, timeout=seconds
            )
        return self._work([post], [output], finishes, call=call)

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> XcclWork:
        """Completes once every rank of the group has entered it (``opts.timeout``)."""
        seconds = self._op_seconds(opts)
        comm = self.comm
        return self._work([lambda: comm.barrier(timeout=seconds)], [])

    # -- collectives on lists (through one temporary buffer) --------------------------------

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> XcclWork:
        """Gathers every rank's ``input_tensors[i]`` into ``output_tensors[i]`` (one tensor
        per rank, in rank order)."""
        seconds = self._op_seconds(opts)
        call = _call_of(
            ("output_tensors", [t for lst in output_tensors for t in lst]),
            ("input_tensors", input_tensors),
        )
        comm = self._comm_on(call)
        n = comm.size
        if len(output_tensors) != len(input_tensors):
            raise ValueError("xccl backend: one output list per input tensor expected")
        finishes: list[Finish] = []
        posts = []
        for i, (outs, inp) in enumerate(zip(output_tensors, input_tensors, strict=True)):
            if len(outs) != n:
                raise ValueError(
                    f"xccl backend: output_tensors[{i}] has {len(outs)} tensors, expected one "
                    f"per rank ({n})"
                )
            src = _src(inp, f"input_tensors[{i}]")
            for r, o in enumerate(outs):
                _check_tensor(o, f"output_tensors[{i}][{r}]")
                _check_numel(o, src.numel(), f"output_tensors[{i}][{r}]")
            _same_dtype([src, *outs], f"output_tensors[{i}]")
            buf = torch.empty(n * src.numel(), dtype=src.dtype, device=src.device)
            _scatter_back(buf, outs, finishes)
            posts.append(lambda s=src, b=buf: comm.allgather(s, b, timeout=seconds))
        result = output_tensors[0] if len(output_tensors) == 1 else output_tensors
        return self._work(posts, result, finishes, call=call)

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_list: list[torch.Tensor],
        opts: Any = None,
    ) -> XcclWork:
        """Gathers every rank's `input_list` at once: ``output_lists[r][i]`` receives rank
        r's ``input_list[i]``. One xccl operation when all tensors share a dtype."""
        seconds = self._op_seconds(opts)
        call = _call_of(
            ("output_lists", [t for lst in output_lists for t in lst]), ("input_list", input_list)
        )
        comm = self._comm_on(call)
        n = comm.size
        if len(output_lists) != n:
            raise ValueError(
                f"xccl backend: output_lists has {len(output_lists)} lists, expected one per "
                f"rank ({n})"
            )
        for r, outs in enumerate(output_lists):
            if len(outs) != len(input_list):
                raise ValueError(
                    f"xccl backend: output_lists[{r}] has {len(outs)} tensors, expected "
                    f"{len(input_list)}"
                )
            for i, (o, t) in enumerate(zip(outs, input_list, strict=True)):
                _check_numel(o, t.numel(), f"output_lists[{r}][{i}]")
        if not input_list:
            return XcclWork([], output_lists)
        finishes: list[Finish] = []
        flat = _cat(input_list, "input_list")
        _same_dtype([flat, *(o for outs in output_lists for o in outs)], "output_lists")
        total = flat.numel()
        buf = torch.empty(n * total, dtype=flat.dtype, device=flat.device)
        for r, outs in enumerate(output_lists):
            _scatter_back(buf, outs, finishes, r * total)
        return self._work(
            [lambda: comm.allgather(flat, buf, timeout=seconds)], output_lists, finishes, call=call
        )

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> XcclWork:
        """Gathers every rank's ``input_tensors[0]`` into ``output_tensors[0]`` (one tensor
        per rank) of group rank ``opts.rootRank``; other ranks pass no outputs."""
        opts = opts if opts is not None else dist.GatherOptions()
        call = _call_of(
            ("input_tensors", input_tensors),
            ("output_tensors", [t for lst in output_tensors for t in lst]),
        )
        comm, seconds, root = self._comm_on(call), self._op_seconds(opts), opts.rootRank
        if len(input_tensors) != 1:
            raise ValueError("xccl backend: gather takes exactly one input tensor")
        src = _src(input_tensors[0], "input")
        if comm.rank != root:
            if output_tensors and any(len(lst) for lst in output_tensors):
                raise ValueError("xccl backend: gather outputs given on a non-root rank")
            return self._work(
                [lambda: comm.gather(src, None, root, timeout=seconds)], [], call=call
            )
        if len(output_tensors) != 1 or len(output_tensors[0]) != comm.size:
            raise ValueError(
                f"xccl backend: gather needs one list of {comm.size} output tensors at the root"
            )
        outs = output_tensors[0]
        for r, o in enumerate(outs):
            _check_tensor(o, f"output[{r}]")
            _check_numel(o, src.numel(), f"gather output[{r}]")
        _same_dtype([src, *outs], "gather tensors")
        finishes: list[Finish] = []
        buf = torch.empty(comm.size * src.numel(), dtype=src.dtype, device=src.device)
        _scatter_back(buf, outs, finishes)
        return self._work(
            [lambda: comm.gather(src, buf, root, timeout=seconds)], outs, finishes, call=call
        )

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> XcclWork:
        """Sends ``input_tensors[0][r]`` of group rank ``opts.rootRank`` into
        ``output_tensors[0]`` of rank r; other ranks pass no inputs."""
        opts = opts if opts is not None else dist.ScatterOptions()
        call = _call_of(
            ("output_tensors", output_tensors),
            ("input_tensors", [t for lst in input_tensors for t in lst]),
        )
        comm, seconds, root = self._comm_on(call), self._op_seconds(opts), opts.rootRank
        if len(output_tensors) != 1:
            raise ValueError("xccl backend: scatter takes exactly one output tensor")
        out = output_tensors[0]
        finishes: list[Finish] = []
        dst = _dst(out, finishes, "output")
        if comm.rank != root:
            if input_tensors and any(len(lst) for lst in input_tensors):
                raise ValueError("xccl backend: scatter inputs given on a non-root rank")
            return self._work(
                [lambda: comm.scatter(None, dst, root, timeout=seconds)], [out], finishes, call=call
            )
        if len(input_tensors) != 1 or len(input_tensors[0]) != comm.size:
            raise ValueError(
                f"xccl backend: scatter needs one list of {comm.size} input tensors at the root"
            )
        ins = input_tensors[0]
        for r, t in enumerate(ins):
            _check_numel(t, out.numel(), f"scatter input[{r}]")
        flat = _cat(ins, "scatter inputs")
        _same_dtype([flat, out], "scatter tensors")
        return self._work(
            [lambda: comm.scatter(flat, dst, root, timeout=seconds)], [out], finishes, call=call
        )

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> XcclWork:
        """Reduces ``input_tensors[i][r]`` across the group into ``output_tensors[i]`` of
        rank r. Blocks of different sizes (a "reduce_scatter_v") run as an all-reduce of
        the whole list, of which each rank keeps its block."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        call = _call_of(
            ("output_tensors", output_tensors),
            ("input_tensors", [t for lst in input_tensors for t in lst]),
        )
        comm, seconds = self._comm_on(call), self._op_seconds(opts)
        op, premul = _reduce_op(opts.reduceOp)
        n, me = comm.size, comm.rank
        if len(output_tensors) != len(input_tensors):
            raise ValueError("xccl backend: one input list per output tensor expected")
        finishes: list[Finish] = []
        posts = []
        for i, (out, ins) in enumerate(zip(output_tensors, input_tensors, strict=True)):
            if len(ins) != n:
                raise ValueError(
                    f"xccl backend: input_tensors[{i}] has {len(ins)} tensors, expected one "
                    f"per rank ({n})"
                )
            _check_numel(out, ins[me].numel(), f"output_tensors[{i}]")
            flat = _cat(ins, f"input_tensors[{i}]")
            _same_dtype([flat, out], f"reduce_scatter tensors[{i}]")
            if all(t.numel() == out.numel() for t in ins):
                dst = _dst(out, finishes, f"output_tensors[{i}]")
                posts.append(
                    lambda f=flat, d=dst: comm.reduce_scatter(f, d, op, premul, timeout=seconds)
                )
            else:
                offset = sum(t.numel() for t in ins[:me])
                _scatter_back(flat, [out], finishes, offset)
                posts.append(lambda f=flat: comm.allreduce(f, f, op, premul, timeout=seconds))
        return self._work(posts, output_tensors, finishes, call=call)

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> XcclWork:
        """Sends ``input_tensors[j]`` to rank j and receives rank i's piece into
        ``output_tensors[i]``; pieces may differ in size."""
        seconds = self._op_seconds(opts)
        call = _call_of(("output_tensors", output_tensors), ("input_tensors", input_tensors))
        comm = self._comm_on(call)
        n = comm.size
        if len(output_tensors) != n or len(input_tensors) != n:
            raise ValueError(f"xccl backend: alltoall needs {n} input and {n} output tensors")
        sbuf = _cat(input_tensors, "input_tensors")
        for i, o in enumerate(output_tensors):
            _check_tensor(o, f"output_tensors[{i}]")
        _same_dtype([sbuf, *output_tensors], "alltoall tensors")
        scounts = [t.numel() for t in input_tensors]
        rcounts = [t.numel() for t in output_tensors]
        sdispls = [sum(scounts[:j]) for j in range(n)]
        rdispls = [sum(rcounts[:j]) for j in range(n)]
        rbuf = torch.empty(sum(rcounts), dtype=sbuf.dtype, device=sbuf.device)
        finishes: list[Finish] = []
        _scatter_back(rbuf, output_tensors, finishes)
        return self._work(
            [
                lambda: comm.alltoallv(
                    sbuf, scounts, sdispls, rbuf, rcounts, rdispls, timeout=seconds
                )
            ],
            output_tensors,
            finishes,
            call=call,
        )

    # -- monitored barrier and lifetime -------------------------------------------------------

    def monitored_barrier(
        self, timeout: Optional[timedelta] = None, wait_all_ranks: bool = False
    ) -> None:
        """A barrier that names the ranks that did not arrive within `timeout` (default:
        the group's). Only callable on the group object: torch's
        ``dist.monitored_barrier`` accepts the gloo backend only."""
        from . import _collectives, _group

        if self._mb_group is None:
            self._mb_group = _group.ProcessGroup(
                self.comm,
                self._global_ranks,
                "auto",
                f"{self._group_id}/monitored",
                "monitored_barrier",
                self._timeout_s,
                None,
            )
        if timeout is None:
            seconds = self._timeout_s
        else:  # as gloo: a zero timeout times out at once
            seconds = max(
                timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout), 1e-3
            )
        try:
            _collectives.monitored_barrier(self._mb_group, seconds, wait_all_ranks)
        except _C.XcclError as exc:
            raise _translate(exc) from None

    def shutdown(self) -> None:
        """Destroys the communicator (torch's destroy_process_group calls this); pending
        operations fail. Idempotent."""
        comm, self._comm = self._comm, None
        mb, self._mb_group = self._mb_group, None
        context, self._context = self._context, None
        if mb is not None and mb._ctl is not None:
            mb._ctl.destroy()
        if comm is not None:
            comm.destroy()
        if context is not None:
            context.release()

    def abort(self) -> None:
        """Aborts the communicator: pending operations fail at once. Idempotent."""
        comm = self._comm
        if comm is not None:
            comm.abort()
        self.shutdown()


# ---------------------------------------------------------------------------------------------
# Creation and registration
# ---------------------------------------------------------------------------------------------


class _Context:
    """One xccl context (connections, shared-memory segments, progress thread) shared by the
    torch groups of this process that run on it.

    `root` is the communicator the context was created with, over the global ranks `ranks`
    (in root-rank order). No group uses it directly: every group, the one that created the
    context included, is a split of it, and a split keeps the context alive after its
    parent is destroyed, so torch may shut groups down in any order. `uses` counts the
    groups not yet shut down; the root is destroyed when it drops to zero or when a new
    default group supersedes the context, and the context goes with its last split.
    Everything here is guarded by ``_contexts_lock``.
    """

    def __init__(self, root: _C.Comm, ranks: Sequence[int]) -> None:
        self.root: Optional[_C.Comm] = root
        self.index = {g: i for i, g in enumerate(ranks)}
        self.token = f"{root.id:016x}"  # the same on every member, unique per context
        self.uses = 0

    def covers(self, ranks: Sequence[int]) -> bool:
        return all(g in self.index for g in ranks)

    def split(self, ranks: Sequence[int], name: str) -> _C.Comm:
        assert self.root is not None
        comm = self.root.split([self.index[g] for g in ranks], name)
        self.uses += 1
        return comm

    def retire(self) -> None:
        """Takes no more groups: the root goes, the groups made so far stay valid."""
        if self in _contexts:
            _contexts.remove(self)
        root, self.root = self.root, None
        if root is not None:
            root.destroy()

    def release(self) -> None:
        """A group of this context was shut down."""
        with _contexts_lock:
            self.uses -= 1
            if self.uses == 0:
                self.retire()


# Contexts that new subgroups may be split from, oldest first.
_contexts: list[_Context] = []
_contexts_lock = threading.Lock()


def _agreed_context(store: Any, rank: int, size: int, ranks: Sequence[int]) -> Optional[_Context]:
    """The newest context covering `ranks` if every member of the new group has that same
    context, else None (then the members create a new one together).

    Members can differ, e.g. when one process shut a group down and its peers did not, so
    each publishes its candidate under the group's store prefix and all decide alike. The
    round number comes from a counter, as the engine's bootstrap does, so that a store
    reused after destroy_process_group holds no stale answers."""
    candidate = next((c for c in reversed(_contexts) if c.covers(ranks)), None)
    token = candidate.token if candidate is not None else "-"
    if size == 1:
        return candidate
    round_no = (int(store.add("xccl_torch/round", 1)) - 1) // size
    keys = [f"xccl_torch/r{round_no}/{r}" for r in range(size)]
    store.set(keys[rank], token)
    multi_get = getattr(store, "multi_get", None)
    values = multi_get(keys) if multi_get is not None else [store.get(k) for k in keys]
    tokens = [bytes(v).decode() for v in values]
    if candidate is None or any(t != token for t in tokens):
        return None
    return candidate


def _bind_gpu() -> None:
    """Chooses xccl's GPU at group creation when the script has chosen torch's already
    (``torch.cuda.set_device(local_rank)`` before ``init_process_group``, as with NCCL; a
    machine with one GPU, or the current device is ``LOCAL_RANK``'s), so that a tensor on
    another GPU is refused from the first call. Otherwise the first CUDA tensor chooses it
    (:mod:`xccl.cuda`); a process that never touched CUDA gets no CUDA context from here."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return

    device, count = torch.cuda.current_device(), torch.cuda.device_count()
    local = _env.env_local_rank()
    # only where that is the script's choice: one GPU, or the one LOCAL_RANK points at (a
    # current device set by earlier use could differ from the group's device_id, which the
    # creator does not see; then the first CUDA tensor chooses)
    if count != 1 and (local is None or device != local % count):
        return
    if xcuda.current_device() < 0 and xcuda.is_available():
        xcuda.set_device(device)


def _create(backend_opts: Any, pg_options: Any = None) -> XcclProcessGroup:
    """The creator torch calls (extended API) once per group, on the group's members.

    `backend_opts` is a ``_DistributedBackendOptions``: ``store`` (torch's PrefixStore,
    unique per group and device), ``group_rank``, ``group_size``, ``timeout``
    (timedelta), ``group_id`` and ``global_ranks_in_group`` (empty for the default
    group). `pg_options` (``init_process_group(pg_options=)``) is not used.

    The default group creates a new xccl context (connecting to every peer); later groups
    are splits of it, which exchange nothing and open no connection. A group whose
    members do not all share a context covering them (the default group runs on another
    backend, or members disagree) creates a context of its own, over its members."""
    del pg_options
    _bind_gpu()
    rank, size = int(backend_opts.group_rank), int(backend_opts.group_size)
    seconds = _seconds(backend_opts.timeout) or _env.default_timeout()
    group_id = str(backend_opts.group_id)
    given = [int(g) for g in backend_opts.global_ranks_in_group]
    ranks = given or list(range(size))
    name = f"torch:{group_id}"
    try:
        with _contexts_lock:
            context = None
            if not given:  # a new default group: earlier contexts take no more groups
                for old in list(_contexts):
                    old.retire()
            else:
                context = _agreed_context(backend_opts.store, rank, size, ranks)
            if context is None:
                store = _C.Store.custom(backend_opts.store, seconds)
                root = _C.Comm(store, rank, size, seconds, None, _env.auth_key(), name)
                context = _Context(root, ranks)
                _contexts.append(context)
            try:
                comm = context.split(ranks, name)
            except BaseException:
                if context.uses == 0:  # made for this group: nothing else will release it
                    context.retire()
                raise
    except _C.XcclError as exc:
        raise _translate(exc, creating=True) from None
    return XcclProcessGroup(comm, ranks, group_id, seconds, context)


def is_registered() -> bool:
    """True when :data:`BACKEND` is registered with torch.distributed in this process."""
    return BACKEND.upper() in dist.Backend._plugins


def register() -> None:
    """Registers :data:`BACKEND` with torch.distributed; a no-op when already registered
    (importing this module calls it, and spawned children import it again)."""
    if is_registered():
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=list(DEVICES))


register()
