"""xccl.cuda: where this process stands with CUDA, and its GPU.

    import xccl
    xccl.cuda.is_available()      # True where xccl was built with CUDA and a GPU is usable
    xccl.cuda.build_info()        # built, loaded, why, archs, driver_version, ...
    xccl.cuda.set_device(0)       # optional: the GPU of this process

A process uses one GPU. It is the one given to :func:`set_device` (or to
``init_process_group(device_id=torch.device("cuda", i))``); without either, the first CUDA
tensor the process passes to an operation chooses it. A tensor on another GPU afterwards is
refused (ValueError) before anything moves. xccl does not read ``LOCAL_RANK`` itself: as with
torch's NCCL backend, a script picks its GPU (``torch.cuda.set_device(local_rank)``) and
allocates its tensors there, and xccl follows the tensors.

Streams. An operation on CUDA tensors is ordered after the work queued before the call on the
caller's stream: ``stream=`` when given (an int CUstream handle, a ``torch.cuda.Stream`` or
``ExternalStream`` (``.cuda_stream``), a ``cupy.cuda.Stream`` (``.ptr``)), else the current
stream of the tensor's framework (torch's ``current_stream(device)``, CuPy's current stream;
the legacy default stream for other DLPack producers). With ``async_op=True`` the call returns
at once: the operation starts when that stream gets there and runs in the background (its
copies and reductions on a stream of the group's own), so GPU work queued meanwhile overlaps it.
``Work.wait()`` and a call with ``async_op=False`` behave as torch's NCCL backend: they make
the current stream (and, for a call, the call's stream) wait for the operation on the GPU, so
work queued there afterwards runs after it, and return without waiting for the GPU or for the
peers (see below). ``Work.synchronize()`` waits on the CPU until the operation has
finished on the GPU; ``Work.is_completed()`` polls; ``wait(timeout=...)`` waits on the CPU (the
timeout bounds it). An operation that fails after a stream started waiting for it releases that
stream; its error is raised by ``synchronize()``, ``is_completed()``/``exception()`` and the
next call on the group. ``stream=`` on host tensors is an error. The copy into list outputs
(all_gather, gather, all_to_all) is queued on the call's stream once the operation has finished
(the CPU waits for that), and ``wait()`` makes the current stream wait for the copy.
``XCCL_CUDA_WAIT=cpu`` makes every wait a CPU wait until the operation has finished on the GPU
(gloo's CUDA behaviour).

Why no stream wait deadlocks: the driver calls that map a peer's buffer or allocate and free
memory may wait for every stream of the process, a stream that waits for an xccl operation
included; if the operation itself still needed such a call, neither would ever go on. So xccl
makes those calls only while no stream waits for an unfinished operation, and no operation
waits for one: it allocates with the stream-ordered allocator, sends a message through host
memory, runs a one-host "devmap" collective through messages for that call, or defers a
release (the refused mapping is made when the next operation is posted).
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from typing import Any, Optional

from . import _C, _env

__all__ = ["build_info", "current_device", "is_available", "set_device"]

# DLPack device types (DLDeviceType)
_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13
_CUDA_TYPES = (_KDL_CUDA, _KDL_CUDA_MANAGED)
_U64 = 1 << 64


def build_info() -> dict[str, Any]:
    """What this build of xccl and this machine offer for CUDA, as a dict:

    ``built`` (bool: the CUDA support is compiled in), ``loaded`` (bool: the driver is loaded
    and initialised), ``why`` (str: why not built or not loaded, "" when usable), ``archs``
    (list of the compiled GPU codes, e.g. ``["sm_80", "sm_90", "compute_90"]``),
    ``header_version`` (CUDA_VERSION of the headers built with, 0 when not built),
    ``driver_version`` (e.g. 13000; 0 when not loaded), ``ndevices``, ``device`` (this
    process's GPU, -1 while none is chosen), ``device_name`` and ``compute_capability``
    ((major, minor) of that GPU, or None).

    Loads the driver on first use (never fails: ``why`` says what is missing)."""
    return dict(_C.cuda_info())


def is_available() -> bool:
    """True where operations on CUDA tensors can run: xccl was built with CUDA support, the
    driver loaded and it sees at least one GPU."""
    info = _C.cuda_info()
    return bool(info["built"] and info["loaded"] and info["ndevices"] > 0)


def _device_index(device: Any) -> int:
    """The index of `device`: an int, ``"cuda:1"``, or a ``torch.device("cuda", 1)``."""
    if isinstance(device, bool):
        raise TypeError(f"expected a CUDA device index, got {device!r}")
    if isinstance(device, int):
        return device
    kind = getattr(device, "type", None)
    if kind is not None:  # torch.device
        index = getattr(device, "index", None)
        if kind != "cuda" or index is None:
            raise ValueError(f"expected a CUDA device with an index (cuda:N), got {device!r}")
        return int(index)
    if isinstance(device, str):
        name, _, index = device.partition(":")
        if name == "cuda" and index.isdigit():
            return int(index)
        raise ValueError(f"expected a CUDA device with an index (cuda:N), got {device!r}")
    raise TypeError(f"expected a CUDA device index, got {type(device).__name__}")


def set_device(device: Any) -> None:
    """Chooses the GPU of this process: an index, ``"cuda:N"`` or ``torch.device("cuda", N)``.

    Once per process: the same GPU again does nothing, another one raises. Without a call,
    the first CUDA tensor the process passes to an operation chooses its GPU. Raises
    NotImplementedError (with :func:`build_info`'s ``why``) where CUDA is not usable and
    ValueError for an index the driver does not know."""
    _C.cuda_set_device(_device_index(device))


def current_device() -> int:
    """The GPU of this process, -1 while none is chosen (see :func:`set_device`)."""
    return int(_C.cuda_device())


# ---------------------------------------------------------------------------------------------
# Internal: devices and streams of a call
# ---------------------------------------------------------------------------------------------


def _device_of(t: Any) -> tuple[int, int]:
    """(DLPack device type, index) of a tensor, without exporting it."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        if t.is_cuda:
            return _KDL_CUDA, int(t.device.index)
        return _KDL_CPU, 0
    np = sys.modules.get("numpy")
    if np is not None and isinstance(t, np.ndarray):
        return _KDL_CPU, 0
    get = getattr(t, "__dlpack_device__", None)
    if get is None:
        return _KDL_CPU, 0  # the consumer in xccl._C names what it is not
    kind, index = get()
    return int(kind), int(index)


def _framework(t: Any) -> str:
    """"torch", "cupy" or "other": whose current stream orders a call on `t`."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        return "torch"
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(t, cupy.ndarray):
        return "cupy"
    return "other"


def _stream_value(stream: Any) -> int:
    """A ``stream=`` argument as a CUstream handle (0: the legacy default stream)."""
    if isinstance(stream, bool):
        raise TypeError(f"stream must be a CUDA stream or a CUstream handle (int), got {stream!r}")
    if isinstance(stream, int):
        value = stream
    elif hasattr(stream, "cuda_stream"):  # torch.cuda.Stream / ExternalStream
        value = stream.cuda_stream
    elif hasattr(stream, "ptr"):  # cupy.cuda.Stream / ExternalStream
        value = stream.ptr
    else:
        raise TypeError(
            "stream must be a CUDA stream (torch.cuda.Stream, cupy.cuda.Stream: an object with "
            f".cuda_stream or .ptr) or a CUstream handle (int), got {type(stream).__name__}"
        )
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"stream handle must be an int, got {type(value).__name__}")
    if not 0 <= value < _U64:
        raise ValueError(f"stream handle {value} is not a CUstream (an int in [0, 2**64))")
    return value


def _current_stream(framework: str, device: int) -> int:
    """The current stream of `framework` on GPU `device` as a CUstream handle."""
    if framework == "torch":
        torch = sys.modules["torch"]
        return int(torch.cuda.current_stream(device).cuda_stream)
    if framework == "cupy":
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(device):
            return int(cupy.cuda.get_current_stream().ptr)
    return 0


class CudaCall:
    """A call on CUDA tensors: the framework whose streams order it, the GPU, and the stream
    (a CUstream handle) the operation is ordered after."""

    __slots__ = ("device", "framework", "handle")

    def __init__(self, framework: str, device: int, handle: int) -> None:
        self.framework = framework
        self.device = device
        self.handle = handle

    def current(self) -> int:
        """The framework's current stream on the call's GPU, now."""
        return _current_stream(self.framework, self.device)

    def order(self, cwork: Any, *streams: int) -> None:
        """:func:`order` `cwork` before each of `streams`."""
        order(cwork, *streams)

    def stream_context(self) -> Any:
        """A context in which the temporaries and copies of a call on tensor lists run on the
        call's stream. They are torch's (tensors of other producers are viewed through torch
        there), so this is torch's stream context whenever torch can be imported."""
        torch = _import_torch()
        if torch is None:
            return nullcontext()
        return torch.cuda.stream(_torch_stream(torch, self.device, self.handle))

    def record_event(self) -> Any:
        """A torch event recorded on the call's stream (None without torch)."""
        torch = _import_torch()
        if torch is None:
            return None
        ev = torch.cuda.Event()
        ev.record(_torch_stream(torch, self.device, self.handle))
        return ev

    def __repr__(self) -> str:
        return f"CudaCall({self.framework}, cuda:{self.device}, stream={self.handle:#x})"


def order(cwork: Any, *streams: int) -> None:
    """Makes each of `streams` (CUstream handles; repeats are ordered once) wait for C Work
    `cwork` (Streams above): on the GPU, or with ``XCCL_CUDA_WAIT=cpu`` by waiting on the CPU
    until the operation has finished. Raises the operation's error when it has failed by
    then. The torch backend orders its operations with it too."""
    if not _env.cuda_stream_waits():
        cwork.wait()
        return
    for handle in dict.fromkeys(streams):
        cwork.wait_stream(handle)


def _import_torch() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return None
    return torch


def _torch_stream(torch: Any, device: int, handle: int) -> Any:
    if handle in (0, 1):  # the legacy default stream: torch's default stream
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(handle, device=torch.device("cuda", device))


def resolve(op: str, tensors: list[tuple[str, Any]], stream: Any = None) -> Optional[CudaCall]:
    """Whether the call `op` on `tensors` ((argument name, tensor) pairs) runs on CUDA memory:
    None for host tensors (``stream=`` is then an error), else the CudaCall with its stream.

    Tensors of one call must all be on the host or all on CUDA (ValueError naming two that
    differ). Managed memory and other GPUs are refused by the extension, which sees the
    exported tensors."""
    first: Optional[tuple[str, Any, tuple[int, int]]] = None
    host: Optional[tuple[str, tuple[int, int]]] = None
    on_cuda: list[tuple[str, tuple[int, int]]] = []
    for name, t in tensors:
        dev = _device_of(t)
        if dev[0] in _CUDA_TYPES:
            on_cuda.append((name, dev))
            if first is None:
                first = (name, t, dev)
        elif host is None:
            host = (name, dev)
    if first is None:
        if stream is not None:
            raise ValueError(
                f"{op}: stream= is for operations on CUDA tensors; these are host tensors"
            )
        return None
    if host is not None:
        raise ValueError(
            f"{op}: `{first[0]}` is on {_dev_str(first[2])} but `{host[0]}` is on "
            f"{_dev_str(host[1])}; the tensors of one call must all be CUDA tensors or all host "
            "tensors"
        )
    # The checks the extension repeats on the exported tensors, made here too so that they
    # come before any temporary or copy of a call on tensor lists.
    for name, dev in on_cuda:
        if dev[0] == _KDL_CUDA_MANAGED:
            raise ValueError(
                f"{op}: `{name}` is in managed (unified) memory ({_dev_str(dev)}), which is not "
                "supported; use device memory (torch.empty(..., device='cuda'), cupy.empty)"
            )
    process = int(_C.cuda_device())
    if process < 0:
        _C.cuda_set_device(first[2][1], f"{op}: `{first[0]}`")
        process = first[2][1]
    for name, dev in on_cuda:
        if dev[1] != process:
            raise ValueError(
                f"{op}: `{name}` is on cuda:{dev[1]} but this process uses cuda:{process} (one "
                "GPU per process, chosen by xccl.cuda.set_device or by the first CUDA tensor "
                "it passed)"
            )
    name, t, (_, index) = first
    framework = _framework(t)
    if stream is None:
        handle = _current_stream(framework, index)
    else:
        handle = _stream_value(stream)
        if framework == "torch" and handle != _current_stream(framework, index):
            # __dlpack__(stream=) orders the framework's current stream before `stream`; the
            # temporaries xccl makes on `stream` itself need the same order.
            torch = sys.modules["torch"]
            _torch_stream(torch, index, handle).wait_stream(torch.cuda.current_stream(index))
    return CudaCall(framework, index, handle)


def handle(call: Optional[CudaCall]) -> Optional[int]:
    """The ``stream=`` argument of the extension's operations: None for a host call."""
    return None if call is None else call.handle


def _dev_str(dev: tuple[int, int]) -> str:
    kind, index = dev
    names = {
        _KDL_CPU: "cpu",
        _KDL_CUDA: "cuda",
        _KDL_CUDA_HOST: "cuda_host",
        _KDL_CUDA_MANAGED: "cuda_managed",
    }
    if kind == _KDL_CPU:
        return "cpu"
    return f"{names.get(kind, f'device_type_{kind}')}:{index}"
