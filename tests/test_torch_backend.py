"""xccl as a torch.distributed backend (python/xccl/torch.py).

Every SPMD body joins torch's default group with ``init_process_group(xccl.torch.BACKEND)``
through a file store and checks results against values computed from the ranks alone.
Also here: DDP and FSDP2 parity with gloo (examples/ddp_train.py, examples/fsdp_train.py);
the bodies of tests/torch_parity.py (DDP with no_sync, find_unused_parameters and compression
hooks, FSDP2 on 1-D and 2-D meshes, DTensor redistributions, tensor parallelism) on xcclc and
gloo in the same processes, against a one-process reference; error types; futures that
complete without wait(); and the CI subset of PyTorch's own distributed suite (tests/torch_suite/).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from harness import run_spmd

torch = pytest.importorskip("torch")
import torch_parity  # noqa: E402 - needs torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _init(rank, size, path, timeout=30.0):
    import datetime

    import torch.distributed as dist

    import xccl.torch

    dist.init_process_group(
        xccl.torch.BACKEND,
        init_method=f"file://{path}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    return dist


def _store(tmp_path):
    return str(tmp_path / "store")


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------


def test_registration():
    import torch.distributed as dist

    import xccl.torch

    assert xccl.torch.BACKEND == "xcclc"
    assert xccl.torch.is_registered()
    xccl.torch.register()  # idempotent: spawned children import the module again
    assert dist.Backend.backend_list.count(xccl.torch.BACKEND) == 1
    assert dist.Backend(xccl.torch.BACKEND) == xccl.torch.BACKEND
    assert dist.Backend.backend_capability[xccl.torch.BACKEND] == ["cpu", "cuda"]
    assert dist.Backend._plugins[xccl.torch.BACKEND.upper()].extended_api
    # torch's own Intel-XPU backend keeps "xccl".
    assert getattr(dist.Backend, "XCCL", "xccl") == "xccl"


def test_error_classes():
    import torch.distributed as dist

    import xccl
    import xccl.torch as xt

    assert issubclass(xt.XcclDistBackendError, dist.DistBackendError)
    assert issubclass(xt.XcclDistBackendError, xccl.XcclError)
    assert issubclass(xt.XcclDistTimeoutError, TimeoutError)
    assert issubclass(xt.XcclDistNetworkError, dist.DistNetworkError)
    assert issubclass(xt.XcclDistNetworkError, ConnectionError)
    assert issubclass(xt.XcclDistStoreError, dist.DistStoreError)
    err = xt._translate(xccl.XcclTimeoutError("deadline passed"))
    assert isinstance(err, xt.XcclDistTimeoutError) and "deadline passed" in str(err)
    assert isinstance(
        xt._translate(xccl.XcclTimeoutError("x"), creating=True), xt.XcclDistStoreError
    )
    assert isinstance(xt._translate(xccl.XcclConnectionError("x")), xt.XcclDistNetworkError)
    plain = ValueError("not ours")
    assert xt._translate(plain) is plain


def test_reduce_op_factor():
    import torch.distributed as dist

    import xccl
    import xccl.torch as xt

    assert xt._reduce_op(dist.ReduceOp.SUM) == (xccl._C.OPS["sum"], 1.0)
    assert xt._reduce_op(dist.ReduceOp.AVG)[0] == xccl._C.OPS["avg"]
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist._make_nccl_premul_sum(2.5)
    assert xt._reduce_op(opts.reduceOp) == (xccl._C.OPS["premul_sum"], 2.5)
    op = dist._make_nccl_premul_sum(torch.tensor([0.25]))
    assert xt._reduce_op(op) == (xccl._C.OPS["premul_sum"], 0.25)


# ---------------------------------------------------------------------------------------------
# Collectives through torch.distributed
# ---------------------------------------------------------------------------------------------


def body_collectives(rank, size, path):
    dist = _init(rank, size, path)
    n, r = size, rank
    pg = dist.group.WORLD
    assert type(pg).__name__ == "XcclProcessGroup"
    assert dist.get_backend() == "xcclc" and pg.name() == "xcclc"
    assert pg.size() == n and pg.rank() == r

    ranks1 = torch.arange(1, n + 1, dtype=torch.float64)
    t = torch.full((5,), r + 1.0)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((5,), ranks1.sum().item()))
    for op, want in [
        (dist.ReduceOp.PRODUCT, ranks1.prod().item()),
        (dist.ReduceOp.MIN, 1.0),
        (dist.ReduceOp.MAX, float(n)),
        (dist.ReduceOp.AVG, ranks1.mean().item()),
        (dist._make_nccl_premul_sum(0.5), 0.5 * ranks1.sum().item()),
        (dist._make_nccl_premul_sum(torch.tensor([2.0])), 2.0 * ranks1.sum().item()),
    ]:
        t = torch.full((3,), r + 1.0, dtype=torch.float64)
        dist.all_reduce(t, op=op)
        assert torch.allclose(t, torch.full((3,), want, dtype=torch.float64)), (op, t)
    bits = torch.tensor([1 << r, 7], dtype=torch.int64)
    dist.all_reduce(bits, op=dist.ReduceOp.BOR)
    assert bits.tolist() == [(1 << n) - 1, 7]
    dist.all_reduce(bits, op=dist.ReduceOp.BAND)
    assert bits.tolist() == [(1 << n) - 1, 7]
    x = torch.tensor([r], dtype=torch.int32)
    dist.all_reduce(x, op=dist.ReduceOp.BXOR)
    want = 0
    for i in range(n):
        want ^= i
    assert x.item() == want

    # complex, requires_grad, non-contiguous
    c = torch.tensor([complex(r, 1)], dtype=torch.complex64)
    dist.all_reduce(c)
    assert c.item() == complex(n * (n - 1) / 2, n)
    g = torch.ones(4, requires_grad=True)
    dist.all_reduce(g)
    assert torch.equal(g.detach(), torch.full((4,), float(n)))
    m = torch.zeros(4, 6)
    col = m[:, 1]  # strided view
    col.fill_(r)
    dist.all_reduce(col)
    assert torch.equal(m[:, 1], torch.full((4,), n * (n - 1) / 2)) and m[:, 0].abs().sum() == 0

    # every dtype xccl has, through torch
    for dt in (
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.complex128,
    ):
        v = torch.full((7,), r + 1, dtype=dt)
        dist.all_reduce(v)
        assert torch.equal(v, torch.full((7,), n * (n + 1) // 2, dtype=dt)), dt
    flags = torch.tensor([r == 0, True])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    assert flags.tolist() == [True, True]

    # broadcast / reduce from every root
    for root in range(n):
        b = torch.arange(6.0) if r == root else torch.zeros(6)
        dist.broadcast(b, root)
        assert torch.equal(b, torch.arange(6.0))
        v = torch.full((2,), r + 1.0)
        dist.reduce(v, root, op=dist.ReduceOp.SUM)
        if r == root:
            assert torch.equal(v, torch.full((2,), ranks1.sum().item()))

    # all_gather family
    outs = [torch.zeros(2, 3) for _ in range(n)]
    dist.all_gather(outs, torch.full((2, 3), float(r)))
    assert all(torch.equal(o, torch.full((2, 3), float(i))) for i, o in enumerate(outs))
    flat = torch.zeros(n * 2)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(r)))
    assert flat.tolist() == [float(i) for i in range(n) for _ in range(2)]
    stacked = torch.zeros(n, 2)
    dist.all_gather_into_tensor(stacked, torch.full((2,), float(r)))
    assert torch.equal(stacked.reshape(-1), flat)
    lists = [[torch.zeros(1), torch.zeros(2, dtype=torch.float32)] for _ in range(n)]
    dist.all_gather_coalesced(lists, [torch.full((1,), float(r)), torch.full((2,), r + 0.5)])
    for i in range(n):
        assert lists[i][0].item() == i and lists[i][1].tolist() == [i + 0.5] * 2

    # reduce_scatter family
    out = torch.zeros(2)
    dist.reduce_scatter(out, [torch.full((2,), float(r + j)) for j in range(n)])
    assert out.tolist() == [float(sum(i + r for i in range(n)))] * 2
    out = torch.zeros(2)
    dist.reduce_scatter_tensor(out, torch.arange(2.0 * n) + r)
    base = torch.arange(2.0 * n).reshape(n, 2)[r]
    assert torch.equal(out, base * n + sum(range(n)))
    # blocks of different sizes: rank j's block has j + 1 elements
    out = torch.zeros(r + 1)
    dist.reduce_scatter(out, [torch.full((j + 1,), float(r)) for j in range(n)])
    assert out.tolist() == [float(sum(range(n)))] * (r + 1)

    # all_to_all
    inp = torch.arange(2.0 * n) + 100 * r
    out = torch.zeros(2 * n)
    dist.all_to_all_single(out, inp)
    assert out.tolist() == [100.0 * i + 2 * r + k for i in range(n) for k in range(2)]
    in_splits = [j + 1 for j in range(n)]  # rank r sends j+1 rows to rank j
    out_splits = [r + 1] * n
    inp = torch.full((sum(in_splits), 2), float(r))
    out = torch.zeros(sum(out_splits), 2)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    assert out[:, 0].tolist() == [float(i) for i in range(n) for _ in range(r + 1)]
    outs = [torch.zeros(i + 1) for i in range(n)]
    dist.all_to_all(outs, [torch.full((r + 1,), float(10 * r + j)) for j in range(n)])
    assert [o.tolist() for o in outs] == [[float(10 * i + r)] * (i + 1) for i in range(n)]

    # gather / scatter to and from the last rank
    root = n - 1
    gl = [torch.zeros(3) for _ in range(n)] if r == root else None
    dist.gather(torch.full((3,), float(r)), gl, dst=root)
    if r == root:
        assert [g_.tolist() for g_ in gl] == [[float(i)] * 3 for i in range(n)]
    sc = torch.zeros(3)
    dist.scatter(
        sc, [torch.full((3,), float(i * i)) for i in range(n)] if r == root else None, src=root
    )
    assert sc.tolist() == [float(r * r)] * 3

    dist.barrier()
    # objects go through broadcast / all_gather on CPU tensors
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r})
    assert objs == [{"rank": i} for i in range(n)]
    lst = [f"from {r}"]
    dist.broadcast_object_list(lst, src=0)
    assert lst == ["from 0"]

    # coalescing manager: one allreduce_coalesced
    a, b = torch.full((2,), 1.0 + r), torch.full((3,), 2.0)
    with dist._coalescing_manager():
        dist.all_reduce(a)
        dist.all_reduce(b)
    assert a.tolist() == [ranks1.sum().item()] * 2 and b.tolist() == [2.0 * n] * 3
    dist.destroy_process_group()
    return True


@pytest.mark.parametrize("size", [1, 2, 3])
def test_collectives(tmp_path, size):
    assert run_spmd(body_collectives, size, _store(tmp_path), init=False) == [True] * size


def body_p2p(rank, size, path):
    dist = _init(rank, size, path)
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    t = torch.full((4,), float(rank))
    r = torch.zeros(4)
    if rank % 2 == 0:
        dist.send(t, nxt)
        dist.recv(r, prv)
    else:
        dist.recv(r, prv)
        dist.send(t, nxt)
    assert r.tolist() == [float(prv)] * 4
    # tags keep messages apart; irecv from any source reports the sender
    if rank == 0:
        got = {}
        for _ in range(size - 1):
            buf = torch.zeros(1)
            w = dist.irecv(buf, tag=7)
            w.wait()
            got[w._source_rank()] = buf.item()
        assert got == {i: float(i) for i in range(1, size)}
        buf = torch.zeros(1)
        assert dist.recv(buf, tag=8) == size - 1 and buf.item() == -1.0
    else:
        dist.isend(torch.full((1,), float(rank)), 0, tag=7).wait()
        if rank == size - 1:
            dist.send(torch.full((1,), -1.0), 0, tag=8)
    # batch_isend_irecv: a ring in one call
    recv = torch.zeros(2)
    ops = [
        dist.P2POp(dist.irecv, recv, prv),
        dist.P2POp(dist.isend, torch.full((2,), rank * 1.0), nxt),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert recv.tolist() == [float(prv)] * 2
    dist.destroy_process_group()
    return True


def test_p2p(tmp_path):
    assert run_spmd(body_p2p, 3, _store(tmp_path), init=False) == [True] * 3


def body_env_init(rank, size, port):
    import torch.distributed as dist

    import xccl.torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size)
    )
    dist.init_process_group(f"cpu:{xccl.torch.BACKEND}")  # env://, torch's TCPStore
    assert isinstance(dist.group.WORLD, xccl.torch.XcclProcessGroup)
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [float(size)] * 3
    dist.destroy_process_group()
    if rank == 0:
        # "xccl" itself is torch's Intel-XPU backend, which torch handles before plugins.
        try:
            dist.init_process_group("xccl", store=dist.HashStore(), rank=0, world_size=1)
        except RuntimeError as exc:
            return str(exc)
        dist.destroy_process_group()
        return "init_process_group('xccl') worked"
    return None


def test_env_init_and_the_xccl_name(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = run_spmd(body_env_init, 2, port, init=False)
    assert "XCCL" in res[0], res[0]


def body_device_strings(rank, size, path):
    """Backend strings that name xccl for CUDA (torch's multi-device syntax), with CPU tensors:
    the group is xccl's (a Python backend replaces the group, see xccl.torch), and CPU tensors
    work on it."""
    import datetime

    import torch.distributed as dist

    import xccl.torch  # noqa: F401 - registers the backend

    out = []
    for i, backend in enumerate(["cuda:xcclc", "cpu:xcclc,cuda:xcclc", "cpu:gloo,cuda:xcclc"]):
        dist.init_process_group(
            backend,
            init_method=f"file://{path}-{i}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=30),
        )
        pg = dist.group.WORLD
        t = torch.full((5,), float(rank + 1))
        dist.all_reduce(t)
        view = pg._get_backend(torch.device("cuda"))
        try:
            pg._get_backend(torch.device("xpu"))
            xpu = "no error"
        except RuntimeError as exc:
            xpu = str(exc)
        out.append(
            (
                backend,
                type(pg).__name__,
                t.tolist() == [float(sum(range(1, size + 1)))] * 5,
                view.name(),
                view.supports_splitting,
                view.supports_tensor_alloc(torch.device("cuda")),
                "xpu" in xpu,
            )
        )
        dist.destroy_process_group()
    return out


def test_device_backend_strings(tmp_path):
    res = run_spmd(body_device_strings, 2, _store(tmp_path), init=False, timeout=90)
    for rank_res in res:
        for backend, kind, ok, name, splits, alloc, xpu in rank_res:
            assert (kind, ok, name, splits, alloc, xpu) == (
                "XcclProcessGroup", True, "xcclc", False, False, True), (backend, rank_res)


def test_tensor_checks_before_anything_moves(monkeypatch):
    import xccl.torch as xt

    meta = torch.empty(3, device="meta")
    with pytest.raises(NotImplementedError, match="CPU and CUDA tensors"):
        xt._call_of(("tensors", [torch.ones(2), meta]))
    # two devices the backend serves, in one call: refused, naming both arguments
    monkeypatch.setattr(xt, "DEVICES", ["cpu", "meta"])
    with pytest.raises(ValueError, match=r"input is on meta and output\[0\] on cpu"):
        xt._call_of(("output", [torch.ones(2)]), ("input", meta))
    assert xt._call_of(("t", torch.ones(2))) is xt._HOST and not xt._HOST.cuda


class _FakeCW:
    """Stands in for an xccl._C.Work of a CUDA operation: records what the backend asks."""

    name = "all_reduce"

    def __init__(self, log, error=None):
        self.log, self.error = log, error

    def wait_stream(self, stream):
        self.log.append(("wait_stream", stream))
        if self.error is not None:
            raise self.error
        return True

    def wait(self, timeout=None):
        self.log.append(("wait", timeout))
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self):
        return True

    def exception(self):
        return self.error

    def add_done_callback(self, fn):
        fn(self)


class _FakeStream:
    def __init__(self, log, handle):
        self.log, self.cuda_stream = log, handle

    def wait_event(self, ev):
        self.log.append(("wait_event", self.cuda_stream, ev.n))


def _fake_cuda(monkeypatch, log):
    """torch.cuda as the backend uses it, on a machine without a GPU: the current stream
    (handle 0x60), stream contexts and events, recorded in `log`."""
    import contextlib

    current = _FakeStream(log, 0x60)
    events = []

    class Event:
        def __init__(self):
            self.n = len(events)
            events.append(self)

        def record(self, stream):
            log.append(("record", stream.cuda_stream, self.n))

        def query(self):
            return True

        def synchronize(self):
            log.append(("event_sync", self.n))

    @contextlib.contextmanager
    def stream(s):
        log.append(("enter", s.cuda_stream))
        yield
        log.append(("exit", s.cuda_stream))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)


def test_cuda_work_orders_streams(monkeypatch):
    import xccl.torch as xt

    log = []
    _fake_cuda(monkeypatch, log)
    call = xt._Call(torch.device("cuda", 0), _FakeStream(log, 0x50))
    # dense outputs: nothing at the call; wait() orders the stream current then
    w = xt.XcclWork([_FakeCW(log), _FakeCW(log)], ["out"], None, None, call)
    assert log == []
    assert w.wait() is True
    assert log == [("wait_stream", 0x60), ("wait_stream", 0x60)]
    log.clear()
    assert w.wait(timeout=5) is True  # a timeout: the CPU waits, bounded
    assert [e[0] for e in log] == ["wait", "wait"] and all(0 < e[1] <= 5 for e in log)
    log.clear()
    w.synchronize()
    assert log == [("wait", None), ("wait", None)]
    log.clear()
    # outputs through a temporary: the call's stream waits for the operation, the copy is
    # queued there, an event after it; wait() orders the current stream after that event
    w = xt.XcclWork([_FakeCW(log)], ["out"], [lambda: log.append(("copy",))], None, call)
    assert log == [("wait_stream", 0x50), ("enter", 0x50), ("copy",), ("record", 0x50, 0),
                   ("exit", 0x50)]
    log.clear()
    assert w.wait() is True
    assert log == [("wait_event", 0x60, 0)]
    log.clear()
    w.synchronize()
    assert log == [("wait", None), ("event_sync", 0)]
    # XCCL_CUDA_WAIT=cpu: CPU waits
    log.clear()
    monkeypatch.setenv("XCCL_CUDA_WAIT", "cpu")
    w = xt.XcclWork([_FakeCW(log)], ["out"], None, None, call)
    assert w.wait() is True
    assert log == [("wait", None)]


def test_cuda_calls_are_posted_on_the_stream():
    import xccl._C as C
    import xccl.torch as xt

    calls = []

    class FakeComm:
        rank, size = 1, 2

        def allreduce(self, *args, **kwargs):
            calls.append(("allreduce", args, kwargs))

        def barrier(self, **kwargs):
            calls.append(("barrier", (), kwargs))

    on = xt._OnStream(FakeComm(), 0x50)
    on.allreduce("b", "b", 0, 1.0, timeout=3.0)
    on.barrier(timeout=1.0)
    assert calls == [("allreduce", ("b", "b", 0, 1.0), {"stream": 0x50, "timeout": 3.0}),
                     ("barrier", (), {"timeout": 1.0})]
    assert on.rank == 1 and on.size == 2
    # every operation named takes a stream in the extension (_C.pyi)
    assert all(callable(getattr(C.Comm, name)) for name in xt._STREAM_OPS)
    stub = open(os.path.join(ROOT, "python", "xccl", "_C.pyi")).read()
    for name in xt._STREAM_OPS:
        sig = stub.split(f"def {name}(", 1)[1].split(") ->", 1)[0]
        assert "stream: Optional[int]" in sig, name


def test_future_completer_survives_a_failing_job():
    import threading

    from xccl import _cudafut

    done = threading.Event()
    c = _cudafut.Completer()
    c.submit(lambda: 1 / 0)
    c.submit(done.set)
    assert done.wait(10), "the completer thread died with the first job"


def test_cuda_work_errors_are_torch_types(monkeypatch):
    import torch.distributed as dist

    import xccl
    import xccl.torch as xt

    log = []
    _fake_cuda(monkeypatch, log)
    call = xt._Call(torch.device("cuda", 0), _FakeStream(log, 0x50))
    err = xccl.XcclConnectionError("rank 1 closed its connection")
    w = xt.XcclWork([_FakeCW(log, err)], ["out"], None, None, call)
    with pytest.raises(dist.DistNetworkError, match="rank 1 closed"):
        w.wait()
    with pytest.raises(dist.DistNetworkError, match="rank 1 closed"):
        w.synchronize()
    # failed by the time a copy-out would be queued: raised by the call, nothing queued
    log.clear()
    with pytest.raises(dist.DistNetworkError):
        xt.XcclWork([_FakeCW(log, err)], ["out"], [lambda: log.append(("copy",))], None, call)
    assert ("copy",) not in log


# ---------------------------------------------------------------------------------------------
# Groups, DeviceMesh
# ---------------------------------------------------------------------------------------------


def body_groups(rank, size, path):
    dist = _init(rank, size, path)
    from torch.distributed.device_mesh import init_device_mesh

    import xccl.torch

    evens = [r for r in range(size) if r % 2 == 0]
    g = dist.new_group(evens)
    if rank in evens:
        assert isinstance(g, xccl.torch.XcclProcessGroup)
        assert g.global_ranks == evens and g.size() == len(evens)
        t = torch.full((1,), float(rank))
        dist.all_reduce(t, group=g)
        assert t.item() == float(sum(evens))
        assert dist.get_backend(g) == xccl.torch.BACKEND
    else:
        assert g == dist.GroupMember.NON_GROUP_MEMBER
    mesh = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    assert isinstance(tp, xccl.torch.XcclProcessGroup)
    assert isinstance(dp, xccl.torch.XcclProcessGroup)
    t = torch.full((1,), float(rank))
    dist.all_reduce(t, group=tp)
    row = rank // (size // 2)
    assert t.item() == float(sum(range(row * (size // 2), (row + 1) * (size // 2))))
    u = torch.full((1,), float(rank))
    dist.all_reduce(u, group=dp)
    assert u.item() == float(rank % (size // 2) * 2 + size // 2)
    dist.destroy_process_group(g) if rank in evens else None
    dist.destroy_process_group()
    return True


def test_groups_and_device_mesh(tmp_path):
    assert run_spmd(body_groups, 4, _store(tmp_path), init=False, timeout=90) == [True] * 4


def _engine_resources():
    """(threads, sockets, shared-memory files mapped) of the calling process."""
    threads = len(os.listdir("/proc/self/task"))
    sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # the fd listing itself, closed since
            pass
    with open("/proc/self/maps") as f:
        # the transports' files (a communicator's own node-shared segment, xcclseg-*, is
        # per communicator by design: task.h)
        shm = {line.split(None, 5)[5].strip() for line in f
               if "/dev/shm/" in line and "/xcclseg-" not in line}
    return threads, sockets, len(shm)


def _progress_threads():
    """The calling process's xccl progress threads (the engine names them)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == "xccl-progress"
        except OSError:  # the thread ended since the listing
            pass
    return n


def _member_groups(dist, size):
    """Creates groups (every process calls new_group alike) so that this process is a member
    of 21 torch groups, the default one and a 2-D DeviceMesh's two included; returns them."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mine = [(dist.group.WORLD, list(range(size)))]
    pairs = [[0, 1], [2, 3], [0, 3], [1, 2], [0, 2], [1, 3]]
    for ranks in [list(range(size)), [0, 2], [1, 3], *pairs, [3, 2, 1, 0]] * 3:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine.append((g, sorted(ranks)))
    mesh = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        g = mesh.get_group(dim)
        mine.append((g, dist.get_process_group_ranks(g)))
    return mine


def body_one_context(rank, size, path):
    torch.set_num_threads(1)  # no intra-op pool threads appearing among the counted ones
    dist = _init(rank, size, path)
    import xccl.torch

    t = torch.ones(4)
    dist.all_reduce(t, async_op=True).wait()  # the progress thread runs from here on
    before = _engine_resources()
    groups = _member_groups(dist, size)
    assert len(groups) == 21, len(groups)
    gen = torch.Generator().manual_seed(rank)
    for k, (g, ranks) in enumerate(groups):
        assert isinstance(g, xccl.torch.XcclProcessGroup), g
        assert g.size() == len(ranks)
        x = torch.randint(-1000, 1000, (257,), generator=gen, dtype=torch.int64)
        everyone = [torch.zeros_like(x) for _ in range(size)]
        dist.all_gather(everyone, x)  # the default group: each member's input, to check with
        want = sum(everyone[r] for r in ranks) + k * len(ranks)
        y = x + k
        dist.all_reduce(y, group=g, async_op=(k % 2 == 1))
        if k % 2 == 1:
            dist.barrier(group=g)
        assert torch.equal(y, want), (k, ranks)
    after = _engine_resources()
    # the 20 groups made after the default one opened no connection, mapped no segment and
    # started no thread; the one progress thread is the context's
    assert after == before, (before, after)
    assert _progress_threads() == 1, _progress_threads()
    # shutting the default group down first leaves the others working
    sub = groups[1][0]
    dist.group.WORLD.shutdown()
    u = torch.full((3,), float(rank))
    dist.all_reduce(u, group=sub)
    assert u.tolist() == [float(sum(range(size)))] * 3
    dist.destroy_process_group()
    return before, after


def body_groups_again(rank, size, path):
    torch.set_num_threads(1)
    import datetime

    import torch.distributed as dist

    import xccl.torch

    bare = _engine_resources()
    for round_no in range(2):  # groups made again after destroy_process_group + init
        dist.init_process_group(
            xccl.torch.BACKEND,
            init_method=f"file://{path}.{round_no}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=30),
        )
        groups = _member_groups(dist, size)
        for k, (g, ranks) in enumerate(groups):
            y = torch.full((5,), float(rank + k + round_no))
            dist.all_reduce(y, group=g)
            assert y.tolist() == [float(sum(ranks) + len(ranks) * (k + round_no))] * 5
        # some subgroups go first, in an order of their own
        for g, _ in groups[-1:0:-3]:
            dist.destroy_process_group(g)
        dist.destroy_process_group()
        threads, sockets, shm = _engine_resources()
        # everything the engine held is released (threads end asynchronously: not counted)
        assert (sockets, shm) == bare[1:], (bare, (threads, sockets, shm))
    return True


def body_contexts_agreed(rank, size, path):
    """xccl groups under a gloo default group: the first makes a context, a later group of
    its members splits it; after rank 0 alone shut that group down (and with it its use of
    the context), the members of a new group disagree and create a new context together."""
    torch.set_num_threads(1)
    import datetime

    import torch.distributed as dist

    import xccl.torch

    dist.init_process_group(
        "gloo",
        init_method=f"file://{path}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=30),
    )
    everyone = list(range(size))
    first = dist.new_group(everyone, backend=xccl.torch.BACKEND)
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=first, async_op=True).wait()
    before = _engine_resources()
    pair = dist.new_group([0, 1], backend=xccl.torch.BACKEND)
    if rank in (0, 1):
        assert pair._context is first._context
        u = torch.full((2,), float(rank + 1))
        dist.all_reduce(u, group=pair)
        assert u.tolist() == [3.0, 3.0]
    assert _engine_resources() == before  # a split: no connection, segment or thread
    if rank in (0, 1):
        dist.destroy_process_group(pair)
    if rank == 0:
        dist.destroy_process_group(first)  # rank 0's context is gone; the others keep theirs
    again = dist.new_group(everyone, backend=xccl.torch.BACKEND)
    assert again._context is not first._context
    v = torch.full((4,), float(rank))
    dist.all_reduce(v, group=again)
    assert v.tolist() == [float(sum(everyone))] * 4
    dist.destroy_process_group()
    return True


def test_groups_agree_on_their_context(tmp_path):
    res = run_spmd(body_contexts_agreed, 4, _store(tmp_path), init=False, timeout=120)
    assert res == [True] * 4


@pytest.mark.parametrize("transports", ["shm,tcp", "tcp"])
def test_groups_share_one_context(tmp_path, transports):
    env = {"XCCL_TRANSPORTS": transports}
    res = run_spmd(body_one_context, 4, _store(tmp_path), init=False, timeout=120, env=env)
    for before, _ in res:
        # the default group did connect: a socket per peer over tcp, else shared memory
        assert before[1] >= 3 if transports == "tcp" else before[1] > 0 or before[2] > 0
    res = run_spmd(body_groups_again, 4, _store(tmp_path), init=False, timeout=120, env=env)
    assert res == [True] * 4


# ---------------------------------------------------------------------------------------------
# Work and futures
# ---------------------------------------------------------------------------------------------


def body_futures(rank, size, path):
    dist = _init(rank, size, path)
    import threading

    t = torch.full((1000,), float(rank))
    w = dist.all_reduce(t, async_op=True)
    fut = w.get_future()
    seen = []
    chained = fut.then(lambda f: seen.append(threading.get_ident()) or f.value()[0] * 2)
    deadline = time.monotonic() + 20
    while not fut.done():  # completes without anyone calling wait()
        assert time.monotonic() < deadline, "the future did not complete on its own"
        time.sleep(0.001)
    assert w.is_completed() and w.is_success() and w.exception() is None
    assert fut.value()[0] is t
    assert torch.equal(chained.wait(), torch.full((1000,), float(sum(range(size)) * 2)))
    # a list output is copied into place before the future completes
    outs = [torch.zeros(3) for _ in range(size)]
    w = dist.all_gather(outs, torch.full((3,), float(rank)), async_op=True)
    values = w.get_future().wait()
    assert [o[0].item() for o in values] == [float(i) for i in range(size)]
    assert w.wait() is True and w.result() == outs
    # wait(timeout) gives up, the operation goes on
    import datetime

    if rank == 0:
        buf = torch.zeros(2)
        w = dist.irecv(buf, src=1, tag=99)
        try:
            w.wait(datetime.timedelta(seconds=0.3))
            raise AssertionError("wait(timeout) returned before the message was sent")
        except dist.DistBackendError as exc:
            assert isinstance(exc, TimeoutError), type(exc)
        dist.barrier()
        assert w.wait() is True and buf.tolist() == [5.0, 5.0]
    else:
        dist.barrier()
        dist.send(torch.full((2,), 5.0), 0, tag=99)
    dist.destroy_process_group()
    return True


def test_futures_complete_on_their_own(tmp_path):
    assert run_spmd(body_futures, 2, _store(tmp_path), init=False) == [True, True]


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def body_errors(rank, size, path):
    dist = _init(rank, size, path, timeout=5.0)
    import datetime

    import xccl
    import xccl.torch

    # different collectives on the two ranks: both raise, as torch's types
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(4))
        else:
            dist.broadcast(torch.ones(4), 0)
        raise AssertionError("mismatch not detected")
    except dist.DistBackendError as exc:
        assert isinstance(exc, xccl.XcclError), type(exc)
        assert "all_reduce" in str(exc) or "broadcast" in str(exc), str(exc)
        mismatch = type(exc).__name__
    dist.destroy_process_group()

    # a rank that never arrives: the other times out, as DistBackendError and TimeoutError
    dist = _init(rank, size, path + ".2", timeout=30.0)
    dist.barrier()
    if rank == 0:
        w = dist.all_reduce(torch.ones(2), async_op=True)
        opts = dist.BarrierOptions()
        opts.timeout = datetime.timedelta(seconds=1.0)
        t0 = time.monotonic()
        bw = dist.group.WORLD.barrier(opts)
        try:
            bw.wait()
            raise AssertionError("barrier without the peer returned")
        except dist.DistBackendError as exc:
            assert isinstance(exc, TimeoutError), type(exc)
            assert time.monotonic() - t0 < 20
        # C++ waiters (DDP) see the failure through the future
        try:
            bw.get_future().wait()
            raise AssertionError("future of a failed barrier succeeded")
        except RuntimeError as exc:
            assert "Timeout" in str(exc) or "timed out" in str(exc) or "deadline" in str(exc)
        dist.group.WORLD.abort()
        assert w.is_completed()
        dist.distributed_c10d._get_default_store().set("rank 0 done", b"1")
        return mismatch
    # rank 1 stays away until rank 0 is done, then leaves without a word
    dist.distributed_c10d._get_default_store().wait(["rank 0 done"], datetime.timedelta(60))
    os._exit(0)


def test_errors_are_torch_types(tmp_path):
    res = run_spmd(body_errors, 2, _store(tmp_path), init=False, timeout=90, expect_exit={1: 0})
    assert res[0] == "XcclDistMismatchError"


def body_creation_timeout(rank, size, path):
    import datetime

    import torch.distributed as dist

    import xccl.torch

    t0 = time.monotonic()
    try:
        # world_size 2 but only one process: the rendezvous through the store times out
        dist.init_process_group(
            xccl.torch.BACKEND,
            init_method=f"file://{path}",
            rank=0,
            world_size=2,
            timeout=datetime.timedelta(seconds=2),
        )
    except dist.DistError as exc:
        return type(exc).__name__, isinstance(exc, dist.DistStoreError), time.monotonic() - t0
    return None


def test_creation_timeout_is_store_error(tmp_path):
    [(name, is_store, took)] = run_spmd(
        body_creation_timeout, 1, _store(tmp_path), init=False, timeout=60
    )
    assert is_store, name
    assert took < 30


def body_monitored_barrier(rank, size, path):
    dist = _init(rank, size, path, timeout=20.0)
    import datetime

    pg = dist.group.WORLD
    pg.monitored_barrier(datetime.timedelta(seconds=10))
    if rank == 0:
        try:
            pg.monitored_barrier(datetime.timedelta(seconds=1))
            raise AssertionError("monitored_barrier without rank 1 returned")
        except dist.DistBackendError as exc:
            assert "1" in str(exc), str(exc)
        dist.distributed_c10d._get_default_store().set("rank 0 done", b"1")
        pg.abort()
        return True
    dist.distributed_c10d._get_default_store().wait(["rank 0 done"], datetime.timedelta(60))
    os._exit(0)


def test_monitored_barrier(tmp_path):
    res = run_spmd(
        body_monitored_barrier, 2, _store(tmp_path), init=False, timeout=60, expect_exit={1: 0}
    )
    assert res[0] is True


# ---------------------------------------------------------------------------------------------
# DDP, FSDP2, DTensor: results equal gloo's
# ---------------------------------------------------------------------------------------------


def body_ddp_peer_dies(rank, size, path):
    dist = _init(rank, size, path, timeout=20.0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    if rank == 1:
        os._exit(0)
    t0 = time.monotonic()
    try:
        for _ in range(2):  # DDP may report a failed reduction at the next iteration
            model(torch.randn(2, 4)).sum().backward()
    except RuntimeError as exc:
        # DDP's reducer waits on the future in C++: the type is RuntimeError, the message
        # is xccl's; a failure DDP's Python code meets first (its buffers' broadcast, which
        # a one-host algorithm sees at once) is raised as xccl's own class.
        assert "XcclDist" in str(exc) or type(exc).__name__.startswith("XcclDist"), str(exc)
        assert time.monotonic() - t0 < 15
        dist.group.WORLD.abort()
        return True
    return False


def test_ddp_peer_failure_raises(tmp_path):
    res = run_spmd(
        body_ddp_peer_dies, 2, _store(tmp_path), init=False, timeout=60, expect_exit={1: 0}
    )
    assert res[0] is True


def _run_example(tmp_path, name: str, steps: int):
    """Runs examples/<name>_train.py on 2 ranks (xcclc, then gloo); returns its stdout and the
    two backends' final parameters."""
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", f"{name}_train.py"), "--nproc", "2",
         "--steps", str(steps), "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return (out.stdout, torch.load(tmp_path / f"{name}_xcclc.pt"),
            torch.load(tmp_path / f"{name}_gloo.pt"))


def test_ddp_parity_with_gloo(tmp_path):
    """examples/ddp_train.py trains on xccl and on gloo; the parameters must be allclose."""
    stdout, a, b = _run_example(tmp_path, "ddp", 6)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6), k
    assert "allclose" in stdout


def test_fsdp_example_matches_gloo(tmp_path):
    """examples/fsdp_train.py (FSDP2, 1-D mesh) trains on xccl and on gloo; the parameters
    must be allclose (here: bit-identical, 2 ranks), and must have been trained."""
    stdout, a, b = _run_example(tmp_path, "fsdp", 3)
    assert a.keys() == b.keys() and len(a) == 6
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import fsdp_train
    finally:
        sys.path.pop(0)
    init = fsdp_train.make_model().state_dict()
    assert max((a[k] - init[k]).abs().max().item() for k in a) > 1e-3
    assert "-> allclose" in stdout
    assert fsdp_train.parse_mesh(None, 4) == (4,)
    assert fsdp_train.parse_mesh("2x2", 4) == (2, 2)
    for bad in ("2x3", "4", "ax2", "0x4"):
        with pytest.raises(ValueError):
            fsdp_train.parse_mesh(bad, 4)


def _parity(tmp_path, ws, kinds):
    """One launch of `ws` ranks running `kinds` (tests/torch_parity.py) on xcclc and on gloo
    on CPU tensors; every comparison torch_parity.compare makes must hold."""
    res = run_spmd(torch_parity.body, ws, _store(tmp_path), "cpu", kinds, init=False,
                   timeout=150)
    failures, notes = torch_parity.compare(res, kinds)
    print("\n".join(notes))
    assert not failures, "\n".join(failures[:30])


def test_parity_compare_can_fail():
    """torch_parity.compare on made-up results: one ulp off where bit-identity is required,
    a cast-sized difference beyond the hook's tolerance, a rank that disagrees, a missing
    gloo result, and a reference that did not move the parameters each fail; equal results
    and a difference within the hook's tolerance pass."""
    import numpy as np

    init = [np.zeros(3, np.float32)]
    ref = [np.array([0.5, -0.25, 0.125], np.float32)]

    def ranks(ours, gloo, reference=ref):
        kinds = ("ddp", "ddp_fp16")
        return [{"results": {"xcclc": {k: [a.copy() for a in o] for k in kinds},
                             "gloo": {k: [a.copy() for a in g] for k in kinds}},
                 "reference": {k: reference for k in kinds}, "initial": init, "errors": []}
                for o, g in zip(ours, gloo, strict=True)]

    def failures(rs, kind="ddp", need_gloo=True):
        return torch_parity.compare(rs, (kind,), need_gloo=need_gloo)[0]

    assert failures(ranks([ref, ref], [ref, ref])) == []
    ulp = [np.nextafter(ref[0], np.float32(1))]
    assert "not bit-identical" in failures(ranks([ref, ref], [ref, ulp]))[0]
    assert failures(ranks([ref, ref], [ref, ulp]), "ddp_fp16") == []
    far = [ref[0] + np.float32(5e-3)]
    assert "rtol" in failures(ranks([ref, ref], [ref, far]), "ddp_fp16")[0]
    assert "rank 1 against rank 0" in failures(ranks([ref, ulp], [ref, ulp]))[0]
    rs = ranks([ref, ref], [ref, ref])
    del rs[1]["results"]["gloo"]["ddp"]
    assert "no gloo result" in failures(rs)[0]
    assert failures(rs, need_gloo=False) == []
    assert "moved" in failures(ranks([init, init], [init, init], reference=init))[0]


def test_training_dtensor_tp_match_gloo(tmp_path):
    """DDP (buckets, no_sync, find_unused_parameters, fp16 and bf16 compression hooks), FSDP2
    on a 1-D mesh, DTensor redistributions and tensor parallelism, 2 ranks: xcclc against gloo
    (bit-identical where the reduction is the same) and against a one-process reference."""
    _parity(tmp_path, 2, torch_parity.KINDS_2)


def test_hsdp_on_a_2d_mesh_matches_gloo(tmp_path):
    """FSDP2 on init_device_mesh("cpu", (2, 2), ("replicate", "shard")), 4 ranks."""
    _parity(tmp_path, 4, torch_parity.KINDS_4)


# ---------------------------------------------------------------------------------------------
# PyTorch's own suite (CI subset)
# ---------------------------------------------------------------------------------------------


def test_torch_suite_subset(tmp_path):
    """The fixed subset of torch's DistributedTest through tests/torch_suite/run_suite.py:
    every test that passes on gloo passes on xccl too."""
    report = tmp_path / "suite.json"
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tests", "torch_suite", "run_suite.py"),
            "--subset",
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    import json

    data = json.loads(report.read_text())
    ours = data["results"]["xcclc"]
    gloo = data["results"]["gloo"]
    failed = {n: r for n, r in ours.items() if r["outcome"] == "failed"}
    assert not failed, failed
    behind = [
        n for n, r in gloo.items() if r["outcome"] == "passed" and ours[n]["outcome"] != "passed"
    ]
    assert not behind, {n: ours[n] for n in behind}
    passed = [n for n, r in ours.items() if r["outcome"] == "passed"]
    assert len(passed) >= 20, out.stdout[-4000:]
