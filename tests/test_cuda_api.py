"""The CUDA side of the Python API that runs without a GPU: xccl.cuda's answers on a machine
where CUDA is not usable, the refusals of CUDA tensors (fake DLPack producers exporting
kDLCUDA / kDLCUDAManaged capsules) before anything moves, mixed host/CUDA calls, and the
parsing of stream= arguments. The GPU side is tests/gpu."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dlpack_producer import Producer, kDLCUDA, kDLCUDAHost

import xccl
from xccl import _C
from xccl import cuda as xcuda

kDLCUDAManaged = 13

pytestmark = pytest.mark.skipif(
    xcuda.is_available(), reason="these tests assume a machine where CUDA is not usable"
)


@pytest.fixture
def world():
    xccl.init_process_group(store=xccl.HashStore(), rank=0, world_size=1)
    yield
    xccl.destroy_process_group()


def _cuda(values=(1.0, 2.0, 3.0, 4.0), device=0, kind=kDLCUDA) -> Producer:
    return Producer.of_values("f", list(values), device=(kind, device))


# ------------------------------------------------------------------------------ xccl.cuda


def test_not_available_here():
    assert xcuda.is_available() is False
    info = xcuda.build_info()
    for key, kind in (
        ("built", bool),
        ("loaded", bool),
        ("why", str),
        ("archs", list),
        ("header_version", int),
        ("driver_version", int),
        ("ndevices", int),
        ("device", int),
        ("device_name", str),
    ):
        assert isinstance(info[key], kind), key
    assert info["loaded"] is False and info["ndevices"] == 0 and info["driver_version"] == 0
    assert info["why"]  # what is missing: the CUDA support, or the driver
    assert info["device"] == -1 and info["compute_capability"] is None
    assert all(isinstance(a, str) and a for a in info["archs"])
    assert xcuda.current_device() == -1


def test_set_device_not_usable():
    why = xcuda.build_info()["why"]
    with pytest.raises(NotImplementedError, match="CUDA is not usable") as ei:
        xcuda.set_device(0)
    assert why in str(ei.value)
    with pytest.raises(NotImplementedError):
        xcuda.set_device("cuda:0")
    assert xcuda.current_device() == -1


@pytest.mark.parametrize(
    "bad, exc",
    [(True, TypeError), (1.0, TypeError), ("cpu", ValueError), ("cuda", ValueError),
     ("cuda:x", ValueError), (-1, ValueError)],
)
def test_set_device_bad_arguments(bad, exc):
    with pytest.raises(exc):
        xcuda.set_device(bad)


def test_device_index_of_torch_device():
    torch = pytest.importorskip("torch")
    assert xcuda._device_index(torch.device("cuda", 3)) == 3
    with pytest.raises(ValueError, match="with an index"):
        xcuda._device_index(torch.device("cuda"))
    with pytest.raises(ValueError):
        xcuda._device_index(torch.device("cpu"))


# ------------------------------------------------------------------------- stream arguments


class _TorchLike:
    def __init__(self, value):
        self.cuda_stream = value


class _CupyLike:
    def __init__(self, value):
        self.ptr = value


@pytest.mark.parametrize(
    "stream, value",
    [(0, 0), (1, 1), (2, 2), (0x7F00DEAD0000, 0x7F00DEAD0000), ((1 << 64) - 1, (1 << 64) - 1),
     (_TorchLike(0), 0), (_TorchLike(0x5000), 0x5000), (_CupyLike(0x6000), 0x6000)],
)
def test_stream_values(stream, value):
    assert xcuda._stream_value(stream) == value


@pytest.mark.parametrize(
    "stream, exc",
    [(-1, ValueError), (1 << 64, ValueError), (True, TypeError), (1.5, TypeError),
     ("0", TypeError), (object(), TypeError), (_TorchLike(None), TypeError),
     (_TorchLike(-5), ValueError), (_CupyLike(True), TypeError)],
)
def test_stream_values_refused(stream, exc):
    with pytest.raises(exc):
        xcuda._stream_value(stream)


def test_resolve_host_and_cuda():
    host = np.zeros(4, np.float32)
    assert xcuda.resolve("all_reduce", [("tensor", host)]) is None
    with pytest.raises(ValueError, match="stream= is for operations on CUDA tensors"):
        xcuda.resolve("all_reduce", [("tensor", host)], stream=0)
    pinned = Producer.of_values("f", [1.0], device=(kDLCUDAHost, 0))
    assert xcuda.resolve("all_reduce", [("tensor", pinned)]) is None  # host memory
    p = _cuda()
    with pytest.raises(ValueError, match=r"`output` is on cuda:0 but `input` is on cpu"):
        xcuda.resolve("all_gather_into_tensor", [("output", p), ("input", host)])
    with pytest.raises(ValueError, match=r"`t\[1\]` is in managed \(unified\) memory"):
        xcuda.resolve("op", [("t[0]", p), ("t[1]", _cuda(kind=kDLCUDAManaged))])
    assert p.exported == 0  # nothing was exported to decide


# ------------------------------------------------------- refusals before anything moves


def test_cuda_tensor_without_cuda(world):
    p = _cuda()
    with pytest.raises(NotImplementedError, match="all_reduce: `tensor`: cuda:0: CUDA is not"):
        xccl.all_reduce(p)
    assert p.exported == 0 and p.values() == [1.0, 2.0, 3.0, 4.0]


def test_extension_refuses_without_cuda():
    comm = _C.Comm(_C.Store.hash(10), 0, 1, 10)
    p = _cuda()
    for stream, dlpack_stream in ((0, 1), (1, 1), (0x7000, 0x7000)):
        with pytest.raises(NotImplementedError, match="all_reduce sendbuf/recvbuf: cuda:0"):
            comm.allreduce(p, p, 0, stream=stream)
        # the producer was asked with the stream (DLPack: 1 is the legacy default stream)
        assert p.last_kwargs["stream"] == dlpack_stream
    assert p.live == 0 and p.values() == [1.0, 2.0, 3.0, 4.0]
    comm.destroy()


def test_managed_refused(world):
    p = _cuda(kind=kDLCUDAManaged)
    with pytest.raises(ValueError, match=r"managed \(unified\) memory"):
        xccl.all_reduce(p)
    with pytest.raises(ValueError, match=r"managed \(unified\) memory"):
        xccl.broadcast(p, src=0, stream=0)
    assert p.exported == 0
    # the extension itself refuses it too (its check runs on the exported tensor)
    comm = _C.Comm(_C.Store.hash(10), 0, 1, 10)
    with pytest.raises(ValueError, match=r"broadcast buf: managed \(unified\) memory"):
        comm.broadcast(p, 0, stream=0)
    assert p.live == 0 and p.values() == [1.0, 2.0, 3.0, 4.0]
    comm.destroy()


def test_mixed_host_and_cuda_refused(world):
    cuda_in = _cuda()
    host_out = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="`output_tensor` is on cpu but `input_tensor`|"
                       "`input_tensor` is on cuda:0 but `output_tensor` is on cpu"):
        xccl.all_gather_into_tensor(host_out, cuda_in)
    with pytest.raises(ValueError, match=r"`tensor_list\[1\]` is on cpu"):
        xccl.all_gather([_cuda(), np.zeros(4, np.float32)], _cuda())
    with pytest.raises(ValueError, match="must all be CUDA tensors or all host tensors"):
        xccl.all_to_all_single(_cuda(), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="must all be CUDA tensors or all host tensors"):
        xccl.batch_isend_irecv(
            [xccl.P2POp(xccl.isend, _cuda(), 0), xccl.P2POp(xccl.irecv, host_out, 0)]
        )
    assert cuda_in.exported == 0 and not host_out.any()
    # the extension refuses a host buffer in a CUDA call (it checks buffers in order: the
    # CUDA one first, which cannot be used here; a host buffer first is refused as such)
    comm = _C.Comm(_C.Store.hash(10), 0, 1, 10)
    with pytest.raises(ValueError, match="all_gather sendbuf: host memory .cpu. in an operation "
                       "on CUDA memory"):
        comm.allgather(np.zeros(4, np.float32), cuda_in, stream=0)
    comm.destroy()


def test_stream_on_host_operations_refused(world):
    t = np.ones(4, np.float32)
    for call in (
        lambda: xccl.all_reduce(t, stream=0),
        lambda: xccl.broadcast(t, src=0, stream=0),
        lambda: xccl.reduce(t, dst=0, stream=0),
        lambda: xccl.all_gather_into_tensor(np.zeros(4, np.float32), t, stream=0),
        lambda: xccl.reduce_scatter_tensor(np.zeros(4, np.float32), t, stream=0),
        lambda: xccl.all_to_all_single(np.zeros(4, np.float32), t, stream=0),
        lambda: xccl.all_gather([np.zeros(4, np.float32)], t, stream=0),
        lambda: xccl.isend(t, 0, stream=0),
        lambda: xccl.irecv(t, 0, stream=0),
    ):
        with pytest.raises(ValueError, match="stream= is for operations on CUDA tensors"):
            call()
    assert (t == 1).all()
    comm = _C.Comm(_C.Store.hash(10), 0, 1, 10)
    with pytest.raises(TypeError, match="stream must be None or a CUstream handle"):
        comm.allreduce(t, t, 0, stream="0")
    with pytest.raises(ValueError, match="is not a CUstream handle"):
        comm.allreduce(t, t, 0, stream=-1)
    work = comm.allreduce(t, t, 0)
    work.wait()
    assert work.cuda is False
    comm.destroy()


def test_host_calls_unchanged(world):
    t = np.arange(4, dtype=np.float32)
    xccl.all_reduce(t)  # the one-call path
    work = xccl.all_reduce(t, async_op=True)
    assert work.wait() is True
    work.synchronize()
    assert (t == np.arange(4)).all()


def test_object_collectives_accept_cuda_device(world):
    objs = [{"a": 1}, None]
    xccl.broadcast_object_list(objs, src=0, device="cuda")
    assert objs == [{"a": 1}, None]
    with pytest.raises(ValueError, match="neither cpu nor cuda"):
        xccl.broadcast_object_list(objs, src=0, device="tpu:0")


def test_init_device_id():
    store = xccl.HashStore()
    with pytest.raises(ValueError, match="with an index"):
        xccl.init_process_group(store=store, rank=0, world_size=1, device_id="cuda")
    with pytest.raises(ValueError, match="expected a CPU device or a CUDA device"):
        xccl.init_process_group(store=store, rank=0, world_size=1, device_id="tpu:0")
    with pytest.raises(NotImplementedError, match="CUDA is not usable"):
        xccl.init_process_group(store=store, rank=0, world_size=1, device_id="cuda:0")
    assert not xccl.is_initialized()
    xccl.init_process_group(store=store, rank=0, world_size=1, device_id="cpu")
    xccl.destroy_process_group()


# ------------------------------------------------- the GPU suite's own logic, on CPU tensors

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from harness import run_spmd  # noqa: E402
from test_gpu_ops import suite as gpu_suite  # noqa: E402


def test_gpu_suite_logic_on_cpu():
    # tests/gpu/test_gpu_ops.py runs only where there is a GPU: its inputs, references and
    # expectations are checked here on CPU tensors (the sections that need no GPU)
    pytest.importorskip("torch")
    results = run_spmd(gpu_suite, 2, "cpu", timeout=120.0)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:20])
    assert all(r["checks"] > 100 for r in results), [r["checks"] for r in results]


# ------------------------------------------------- Work and completion bookkeeping (fakes)


class _FakeCWork:
    """Stands in for _C.Work of a CUDA operation: records what the Python layer asks."""

    cuda = True
    name, seq = "all_reduce", 1

    def __init__(self, log, error=None):
        self.log, self.error = log, error

    def wait(self, timeout=None):
        self.log.append(("wait", timeout))
        if self.error is not None:
            raise self.error
        return True

    def wait_stream(self, stream):
        self.log.append(("wait_stream", stream))
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return self.error is None

    def exception(self):
        return self.error

    def add_done_callback(self, fn):
        fn(self)


class _FakeCall(xcuda.CudaCall):
    """A CudaCall whose current stream, stream context and events are recorded."""

    __slots__ = ("log", "now")

    def __init__(self, log, handle=0x50, now=0x60):
        super().__init__("other", 0, handle)
        self.log, self.now = log, now

    def current(self):
        return self.now

    def stream_context(self):
        log = self.log

        class _Ctx:
            def __enter__(self):
                log.append(("enter", "call stream"))

            def __exit__(self, *exc):
                log.append(("exit", "call stream"))

        return _Ctx()

    def record_event(self):
        self.log.append(("event",))
        return None


def test_blocking_cuda_call_orders_the_call_and_current_streams(monkeypatch):
    from xccl import _collectives

    log = []
    assert _collectives._done(_FakeCWork(log), [], False, None, _FakeCall(log)) is None
    # torch's NCCL semantics: the streams wait on the GPU (xccl.cuda, Streams)
    assert log == [("wait_stream", 0x50), ("wait_stream", 0x60)]
    log.clear()
    assert _collectives._done(_FakeCWork(log), [], False, None, _FakeCall(log, 0x50, 0x50)) is None
    assert log == [("wait_stream", 0x50)]  # one stream: ordered once
    log.clear()
    monkeypatch.setenv("XCCL_CUDA_WAIT", "cpu")
    assert _collectives._done(_FakeCWork(log), [], False, None, _FakeCall(log)) is None
    assert log == [("wait", None)]  # the CPU waits for the device work
    monkeypatch.setenv("XCCL_CUDA_WAIT", "device")
    with pytest.raises(ValueError, match="XCCL_CUDA_WAIT"):
        _collectives._done(_FakeCWork(log), [], False, None, _FakeCall(log))


def test_async_cuda_work_wait_orders_the_current_stream():
    from xccl import _collectives

    log = []
    work = _collectives._done(_FakeCWork(log), [], True, None, _FakeCall(log))
    assert log == []  # posted: nothing waits
    assert work.wait() is True
    assert log == [("wait_stream", 0x60)]  # the stream current at wait(), not the call's
    log.clear()
    assert work.wait(timeout=5) is True
    assert log == [("wait", 5)]  # a timeout: the CPU waits, bounded
    log.clear()
    work.synchronize()
    assert log == [("wait", None)]  # synchronize: the CPU waits for the end


def test_list_outputs_copied_on_the_call_stream_after_the_op():
    from xccl import _collectives

    log = []

    def finish():
        log.append(("finish",))

    work = _collectives._done(_FakeCWork(log), ["out"], True, finish, _FakeCall(log))
    assert log == [("wait", None), ("enter", "call stream"), ("finish",),
                   ("exit", "call stream"), ("event",)]
    log.clear()
    assert work.wait() is True
    assert log == [("wait_stream", 0x60)]  # finished already: nothing is queued (C side)
    log.clear()
    assert work.wait(timeout=5) is True
    assert log == [("wait", 5)]  # a timeout bounds the wait
    log.clear()
    work.synchronize()
    assert log == [("wait", None)]
    assert work.result() == ["out"] and work.is_completed()


def test_failed_cuda_op_raises_at_wait():
    from xccl import _collectives

    log = []
    err = xccl.XcclConnectionError("peer 1 closed its connection")
    work = _collectives._done(_FakeCWork(log, err), [], True, None, _FakeCall(log))
    with pytest.raises(xccl.XcclConnectionError):
        work.wait()
    with pytest.raises(xccl.XcclConnectionError):
        work.synchronize()


def test_cuda_futures_complete_off_the_progress_thread_on_an_idle_stream():
    """xccl._cudafut with a stand-in for torch (the logic, without a GPU): the future is made
    CUDA-aware for the operation's GPU, completed on the completer thread, inside the idle
    stream of that GPU, after that stream waits for the copy-out event; an error is set at
    once; a failing completion fails the future instead of leaving it pending."""
    import contextlib
    import threading
    import types

    from xccl import _cudafut

    log = []
    current = threading.local()

    class Stream:
        def __init__(self, device):
            self.device = device
            log.append(("stream", device, threading.current_thread().name))

        def wait_event(self, ev):
            log.append(("wait_event", ev))

    class Future:
        def __init__(self, devices=None):
            self.devices, self.value, self.error = devices, None, None
            self.ready = threading.Event()

        def set_result(self, v):
            log.append(("set_result", v, getattr(current, "stream", None),
                        threading.current_thread().name))
            self.value = v
            self.ready.set()

        def set_exception(self, e):
            self.error = e
            self.ready.set()

        def done(self):
            return self.ready.is_set()

    @contextlib.contextmanager
    def stream(s):
        current.stream = s
        yield
        current.stream = None

    fake = types.SimpleNamespace(
        device=lambda kind, i: (kind, i),
        futures=types.SimpleNamespace(Future=Future),
        cuda=types.SimpleNamespace(Stream=Stream, stream=stream, current_device=lambda: 0,
                                   device=lambda d: contextlib.nullcontext()))
    _cudafut._side_streams.pop(7, None)
    fut = _cudafut.new_future(fake, 7)
    assert fut.devices == [("cuda", 7)]
    side = _cudafut._side_streams[7]
    assert log == [("stream", 7, threading.current_thread().name)]  # made on this thread
    _cudafut.complete(fake, fut, 7, ["out"], None, "copy-event")
    assert fut.ready.wait(10)
    assert log[1:] == [("wait_event", "copy-event"), ("set_result", ["out"], side,
                                                      "xccl-cuda-futures")]
    err = ValueError("failed")
    fut2 = Future()
    _cudafut.complete(fake, fut2, 7, ["out"], err)
    assert fut2.done() and fut2.error is err  # at once, on the caller's thread
    broken = types.SimpleNamespace(**{**vars(fake), "cuda": types.SimpleNamespace(
        Stream=Stream, current_device=lambda: 0, device=lambda d: 1 / 0, stream=stream)})
    fut3 = Future()
    _cudafut.complete(broken, fut3, 7, ["out"], None)
    assert fut3.ready.wait(10) and isinstance(fut3.error, ZeroDivisionError)
