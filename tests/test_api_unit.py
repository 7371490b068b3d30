"""The Python layer of xccl in one process: types, environment parsing, stores, and a
world of size 1 (init/destroy, argument checking, errors, Work handles). Nothing is spawned.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from datetime import timedelta

import numpy as np
import pytest

import xccl as dist
from xccl import _env, _types
from xccl.device_mesh import _flatten

try:
    import torch
    import torch.distributed as tdist
except ImportError:  # pragma: no cover
    torch = None
    tdist = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")


@pytest.fixture
def world():
    """A process group of one rank (in-memory store); destroyed afterwards."""
    dist.init_process_group(
        "auto", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_leftover_group():
    yield
    dist.destroy_process_group()


# ------------------------------------------------------------------------------- types


def test_reduce_op_values_and_forms():
    assert [
        int(getattr(dist.ReduceOp, n))
        for n in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
    ] == list(range(9))
    assert dist.ReduceOp(dist.ReduceOp.MAX) == dist.ReduceOp.MAX
    assert dist.ReduceOp.SUM == dist.ReduceOp.RedOpType.SUM
    assert _types.resolve_op("max")[0] == dist._C.OPS["max"]
    assert _types.resolve_op("PRODUCT")[0] == dist._C.OPS["product"]
    premul = dist._make_nccl_premul_sum(0.5)
    assert _types.resolve_op(premul) == (dist._C.OPS["premul_sum"], 0.5)
    assert premul != dist.ReduceOp.PREMUL_SUM and "factor=0.5" in repr(premul)
    for bad in ("median", 42, None, object()):
        with pytest.raises(ValueError, match="valid ops"):
            _types.resolve_op(bad)
    with pytest.raises(ValueError, match="factor"):
        _types.resolve_op(dist.ReduceOp.PREMUL_SUM)


@needs_torch
def test_reduce_op_accepts_torch_values():
    assert _types.resolve_op(tdist.ReduceOp.MAX)[0] == dist._C.OPS["max"]
    assert _types.resolve_op(tdist.ReduceOp.BXOR)[0] == dist._C.OPS["bxor"]
    op, factor = _types.resolve_op(tdist._make_nccl_premul_sum(3.0))
    assert (op, factor) == (dist._C.OPS["premul_sum"], 3.0)
    assert _types.resolve_op(dist._make_nccl_premul_sum(torch.tensor([2.5])))[1] == 2.5


def test_backend_names():
    assert dist.Backend("GLOO") == "gloo" and isinstance(dist.Backend("tcp"), str)
    assert _types.backend_transports("auto") is None
    assert _types.backend_transports("tcp") == "tcp"
    assert _types.backend_transports("SHM") == "shm,tcp"
    for alias in ("gloo", "nccl", "mpi", "ucc", "xccl", "undefined", "cpu:gloo,cuda:nccl"):
        assert _types.backend_transports(alias) is None, alias
    assert _types.backend_transports("cpu:tcp,cuda:nccl") == "tcp"
    with pytest.raises(ValueError, match="valid backends: 'auto'"):
        dist.Backend("carrier-pigeon")
    with pytest.raises(ValueError):
        dist.Backend("cpu:gloo,cuda:bogus")
    assert dist.is_backend_available("shm") and not dist.is_backend_available("bogus")


def test_public_names():
    for name in dist.__all__:
        assert hasattr(dist, name), name
    for name in (
        "init_process_group",
        "all_reduce",
        "all_to_all_single",
        "new_group",
        "init_device_mesh",
        "DeviceMesh",
        "XcclError",
        "DistBackendError",
        "monitored_barrier",
        "batch_isend_irecv",
        "P2POp",
        "Work",
        "TCPStore",
    ):
        assert name in dist.__all__, name
    assert dist.distributed.all_reduce is dist.all_reduce
    assert dist.device_mesh.init_device_mesh is dist.init_device_mesh
    assert issubclass(dist.XcclTimeoutError, TimeoutError)
    assert issubclass(dist.DistNetworkError, ConnectionError)
    assert issubclass(dist.DistError, RuntimeError)
    assert dist.GroupMember.NON_GROUP_MEMBER == -100
    assert dist.is_available()


# ------------------------------------------------------------------------------- env


def test_env_timeout_and_auth(monkeypatch):
    monkeypatch.delenv("XCCL_TIMEOUT", raising=False)
    monkeypatch.delenv("XCCL_TIMEOUT_MS", raising=False)
    assert _env.default_timeout() == 600.0
    monkeypatch.setenv("XCCL_TIMEOUT_MS", "2500")
    assert _env.default_timeout() == 2.5
    monkeypatch.setenv("XCCL_TIMEOUT", "12.5")
    assert _env.default_timeout() == 12.5
    monkeypatch.setenv("XCCL_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="XCCL_TIMEOUT"):
        _env.default_timeout()
    assert _env.timeout_seconds(None, 7.0) == 7.0
    assert _env.timeout_seconds(timedelta(minutes=2), 7.0) == 120.0
    assert _env.timeout_seconds(3, 7.0) == 3.0
    with pytest.raises(TypeError):
        _env.timeout_seconds("3", 7.0)
    with pytest.raises(ValueError):
        _env.timeout_seconds(-1, 7.0)
    monkeypatch.delenv("XCCL_AUTH_KEY", raising=False)
    assert _env.auth_key() is None
    monkeypatch.setenv("XCCL_AUTH_KEY", "s3cret")
    assert _env.auth_key() == b"s3cret"


def test_env_rank_fallbacks(monkeypatch):
    for name in (
        "RANK",
        "WORLD_SIZE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
        "LOCAL_WORLD_SIZE",
        "SLURM_NTASKS_PER_NODE",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    assert _env.env_rank() is None and _env.env_world_size() is None
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    assert (_env.env_rank(), _env.env_world_size()) == (3, 8)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    assert (_env.env_rank(), _env.env_world_size()) == (5, 16)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (_env.env_rank(), _env.env_world_size()) == (1, 2)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    assert _env.env_local_world_size() == 4
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK"):
        _env.env_rank()


# ------------------------------------------------------------------------------- stores


def _exercise_store(store):
    store.set("a", "1")
    store.set("b", b"\x00\xff")
    assert store.get("a") == b"1" and store.get("b") == b"\x00\xff"
    assert store.add("n", 5) == 5 and store.add("n", -2) == 3
    assert store.check(["a", "b"]) and not store.check(["a", "missing"])
    store.wait(["a", "n"])
    assert store.compare_set("a", "1", "2") == b"2"
    assert store.compare_set("a", "1", "3") == b"2"
    assert store.compare_set("fresh", "", "new") == b"new"
    assert store.compare_set("absent", "x", "y") == b"x"
    assert store.delete_key("fresh") and not store.delete_key("fresh")
    store.multi_set(["m1", "m2"], ["x", b"y"])
    assert store.multi_get(["m1", "m2"]) == [b"x", b"y"]
    store.set_timeout(timedelta(seconds=0.3))
    assert store.timeout == timedelta(seconds=0.3)
    t0 = time.monotonic()
    with pytest.raises(dist.XcclTimeoutError):
        store.wait(["never"])
    with pytest.raises(TimeoutError):
        store.get("never")
    with pytest.raises(dist.XcclTimeoutError):
        store.wait(["never"], timedelta(seconds=0.1))
    assert time.monotonic() - t0 < 5


def test_hash_and_prefix_store():
    base = dist.HashStore()
    _exercise_store(base)
    assert base.num_keys() == 5  # a, b, n, m1, m2
    pre = dist.PrefixStore("job", base)
    _exercise_store(pre)
    pre.set("k", "v")
    assert base.get("job/k") == b"v"
    assert pre.underlying_store is base


def test_hash_store_threads():
    store = dist.HashStore()
    got = []
    waiter = threading.Thread(target=lambda: got.append(store.get("late")))
    waiter.start()
    time.sleep(0.05)
    store.set("late", "here")
    waiter.join(5)
    assert got == [b"here"]


def test_file_store(tmp_path):
    path = str(tmp_path / "fs")
    a = dist.FileStore(path, 2)
    b = dist.FileStore(path, 2)
    _exercise_store(a)
    b.set("from_b", "1")
    assert a.get("from_b") == b"1" and a.path == path


def test_tcp_store():
    master = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=10), wait_for_workers=False)
    assert master.port > 0
    client = dist.TCPStore("127.0.0.1", master.port, 2, False, timedelta(seconds=10))
    _exercise_store(client)
    master.set("x", "y")
    assert client.get("x") == b"y" and "TCPStore" in repr(client)
    with pytest.raises(NotImplementedError):
        dist.TCPStore("127.0.0.1", 0, 1, True, master_listen_fd=3)


@needs_torch
def test_torch_store_wrapped():
    tstore = tdist.HashStore()
    pre = dist.PrefixStore("p", tstore)
    pre.set("k", "v")
    assert tstore.get("p/k") == b"v" and pre.get("k") == b"v"
    assert pre.add("c", 2) == 2
    dist.init_process_group(store=tdist.HashStore(), rank=0, world_size=1)
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.ones(3))


# ------------------------------------------------------------------------------- lifecycle


def test_errors_before_init_and_after_destroy():
    for _ in range(2):
        assert not dist.is_initialized() and dist.group.WORLD is None
        for call in (
            dist.get_rank,
            dist.get_world_size,
            dist.get_backend,
            dist.barrier,
            lambda: dist.all_reduce(np.zeros(1)),
            lambda: dist.new_group([0]),
            lambda: dist.get_process_group_ranks(None),
        ):
            with pytest.raises(RuntimeError, match="has not been initialized"):
                call()
            with pytest.raises(ValueError):  # torch raises ValueError here
                call()
        dist.destroy_process_group()  # forgiving when there is nothing to destroy
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)
        assert dist.is_initialized()
        old = dist.group.WORLD
        dist.destroy_process_group()
        with pytest.raises(RuntimeError):
            dist.all_reduce(np.zeros(1), group=old)


def test_init_arguments(tmp_path):
    with pytest.raises(ValueError, match="valid backends"):
        dist.init_process_group("bogus", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="world_size"):
        dist.init_process_group(store=dist.HashStore(), rank=0)
    with pytest.raises(ValueError, match="rank"):
        dist.init_process_group(store=dist.HashStore(), world_size=1)
    with pytest.raises(ValueError, match="both"):
        dist.init_process_group(init_method="env://", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="unsupported init_method"):
        dist.init_process_group(init_method="carrier://x", rank=0, world_size=1)
    with pytest.raises(NotImplementedError):
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, device_id="cuda:0")
    with pytest.raises(TypeError):
        dist.init_process_group(store=object(), rank=0, world_size=1)
    assert not dist.is_initialized()
    dist.init_process_group(
        "tcp", init_method=f"file://{tmp_path}/s?rank=0&world_size=1", timeout=20
    )
    assert dist.get_backend() == "tcp" and dist.group.WORLD.timeout == timedelta(seconds=20)
    with pytest.raises(ValueError, match="twice"):
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)


def test_init_env_method(monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="rank"):
        dist.init_process_group()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        dist.init_process_group()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo")
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "gloo")
    assert isinstance(dist._get_default_store(), dist.TCPStore)


# ------------------------------------------------------------------------------- world of 1


def test_world_of_one(world):
    assert world is dist.GroupMember.WORLD and world.rank() == 0 and world.size() == 1
    assert dist.get_process_group_ranks(None) == [0] and dist.get_pg_count() == 1
    assert world.name() == "auto" and world.group_name == "0"
    x = np.arange(6, dtype=np.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    assert np.array_equal(x, np.arange(6))
    outs = [np.zeros(6)]
    dist.all_gather(outs, x)
    assert np.array_equal(outs[0], x)
    out = np.zeros(6)
    dist.reduce_scatter(out, [x])
    assert np.array_equal(out, x)
    got = [None]
    dist.gather_object({"k": 1}, got)
    assert got == [{"k": 1}]
    dist.monitored_barrier(timeout=timedelta(seconds=5))
    mesh = dist.init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    assert mesh.get_coordinate() == [0, 0] and mesh["b"].size() == 1
    sub = dist.new_group([0])
    assert dist.get_process_group_ranks(sub) == [0]
    cur, subs = dist.new_subgroups(group_size=1)
    assert cur is subs[0] and dist.get_world_size(cur) == 1
    out = np.zeros((2, 3))
    dist.all_to_all_single(out, np.ones((2, 3)), [], [])  # empty split lists: even, as torch
    assert (out == 1).all()
    assert dist.distributed_c10d._get_default_group() is world
    assert dist.get_node_local_rank(fallback_rank=7) in (7, int(os.environ.get("LOCAL_RANK", 7)))


def test_bad_arguments(world):
    f32 = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="different dtypes"):
        dist.all_gather([np.zeros(4, np.int64)], f32)
    with pytest.raises(ValueError, match="one per rank"):
        dist.all_gather([f32, f32], f32)
    with pytest.raises(ValueError, match="elements"):
        dist.all_gather([np.zeros(5, np.float32)], f32)
    with pytest.raises(ValueError, match="elements"):
        dist.all_gather_into_tensor(np.zeros(3, np.float32), f32)
    with pytest.raises(ValueError, match="elements"):
        dist.reduce_scatter_tensor(f32, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="split sizes"):
        dist.all_to_all_single(f32, f32, [3], [5])
    with pytest.raises(ValueError):
        dist.all_to_all_single(f32, f32, [1, 3], None)
    with pytest.raises(ValueError, match="contiguous"):
        dist.all_reduce(np.zeros(8, np.float32)[::2])
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    for call in (
        lambda: dist.all_reduce(ro),
        lambda: dist.irecv(ro, src=0),
        lambda: dist.all_gather([ro], f32),
        lambda: dist.scatter(ro, [f32], src=0),
    ):
        with pytest.raises(ValueError, match="read-only"):
            call()
    with pytest.raises(ValueError, match="src"):
        dist.broadcast(f32, src=3)
    with pytest.raises(ValueError):
        dist.broadcast(f32, src=0, group_src=0)
    with pytest.raises(ValueError):
        dist.reduce(f32, dst=-1)
    with pytest.raises(ValueError):
        dist.isend(f32, dst=1)
    with pytest.raises(ValueError, match="valid ops"):
        dist.all_reduce(f32, op="median")
    with pytest.raises(TypeError, match="AVG"):
        dist.all_reduce(np.zeros(4, np.int32), op=dist.ReduceOp.AVG)
    with pytest.raises(TypeError):
        dist.all_reduce(np.zeros(4, np.uint16))
    with pytest.raises(TypeError, match="tensor"):
        dist.all_reduce([1.0, 2.0])
    with pytest.raises(TypeError, match="list"):
        dist.all_gather(f32, f32)
    with pytest.raises(ValueError, match="gather_list"):
        dist.gather(f32, None, dst=0)
    with pytest.raises(ValueError, match="scatter_list"):
        dist.scatter(f32, None, src=0)
    with pytest.raises(ValueError, match="op"):
        dist.P2POp(dist.all_reduce, f32, 0)
    with pytest.raises(ValueError):
        dist.batch_isend_irecv([object()])
    with pytest.raises(TypeError, match="ProcessGroup"):
        dist.all_reduce(f32, group="world")
    with pytest.raises(ValueError, match="mesh_dim_names"):
        dist.DeviceMesh("cpu", [[0]], mesh_dim_names=("a",))
    with pytest.raises(RuntimeError, match="mesh_shape"):
        dist.init_device_mesh("cpu", (2,))


def test_fast_default_is_the_process_default_group(world):
    """The one-call paths read the default group from _group._fast_default: the process's
    default group, cleared when it is destroyed and for good once a thread has a world of its
    own (xccl.launch's threads mode), where each thread's default differs."""
    from xccl import _group

    assert _group._fast_default is dist.group.WORLD is not None
    saved = _group._thread_worlds
    try:
        _group._set_thread_world(_group._World())
        assert _group._fast_default is None and dist.group.WORLD is None
        _group._set_thread_world(None)
        assert dist.group.WORLD is not None and _group._fast_default is None
    finally:
        _group._thread_worlds = saved
        _group._set_default(_group._process_world.default)
    assert _group._fast_default is dist.group.WORLD
    dist.destroy_process_group()
    assert _group._fast_default is None


def test_fronts_take_the_common_call_and_pass_the_rest_on(world):
    """The API functions with a one-call path are C fronts (py_front.c) of the Python
    functions: same signature and docstring; the common call goes to the Comm's one-call
    method without running the Python function, any other call runs it with the arguments as
    given."""
    import inspect

    from xccl import _C, _collectives

    fronted = ("send", "recv", "broadcast", "all_reduce", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_to_all_single")
    for name in fronted:
        f = getattr(dist, name)
        assert isinstance(f, _C.Front) and f.__name__ == name
        assert inspect.isfunction(f.__wrapped__) and f.__doc__ == f.__wrapped__.__doc__
        assert inspect.signature(f) == inspect.signature(f.__wrapped__)

    calls = []

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False, *, algo=None):
        calls.append((tensor, op, group, async_op, algo))
        return "python"

    front = _C.Front(all_reduce, "allreduce_now", "0bnfn", True, dist.ReduceOp.SUM,
                     _C.OPS["sum"])
    a = np.arange(4, dtype=np.float32)
    # common calls: the engine (one rank: the values stay), the function never runs
    for args, kw in (((a,), {}), ((a, dist.ReduceOp.SUM), {}), ((), {"tensor": a}),
                     ((a,), {"group": None, "async_op": False, "algo": None})):
        assert front(*args, **kw) is None
    assert calls == [] and a.tolist() == [0, 1, 2, 3]
    # anything else runs the Python function with what was given
    pg = dist.group.WORLD
    for args, kw in (((a, dist.ReduceOp.MAX), {}), ((a,), {"group": pg}),
                     ((a,), {"async_op": True}), ((a,), {"algo": "ring"}),
                     ((a,), {"bogus": 1}), ((a, dist.ReduceOp.SUM, None, False, 5), {})):
        if "bogus" in kw or len(args) > 4:
            with pytest.raises(TypeError):
                front(*args, **kw)
            continue
        assert front(*args, **kw) == "python"
    assert [c[1:] for c in calls] == [
        (dist.ReduceOp.MAX, None, False, None), (dist.ReduceOp.SUM, pg, False, None),
        (dist.ReduceOp.SUM, None, True, None), (dist.ReduceOp.SUM, None, False, "ring")]
    assert front("not a buffer") == "python"  # the method declines it
    # without a published default group (threads with their own worlds, after destroy)
    calls.clear()
    _C.set_fast_default(None, None)
    try:
        assert front(a) == "python" and len(calls) == 1
    finally:
        _collectives._group._publish_fast_default(pg)
    sum_args = (dist.ReduceOp.SUM, _C.OPS["sum"])
    with pytest.raises(ValueError, match="one-call method"):
        _C.Front(all_reduce, "allreduce", "0bnfn", True, *sum_args)
    with pytest.raises(ValueError, match="5 parameters"):
        _C.Front(all_reduce, "allreduce_now", "0bnf", True, *sum_args)
    with pytest.raises(ValueError, match="role 'x'"):
        _C.Front(all_reduce, "allreduce_now", "0bnfx", True, *sum_args)
    with pytest.raises(ValueError, match="argument 0 2 times"):
        _C.Front(all_reduce, "allreduce_now", "0b0fn", True, dist.ReduceOp.SUM, 0)
    with pytest.raises(ValueError, match="no sum"):
        _C.Front(all_reduce, "allreduce_now", "0bnfn", True)
    import copy
    import pickle

    assert pickle.loads(pickle.dumps(dist.all_reduce)) is dist.all_reduce
    assert copy.deepcopy(dist.recv) is dist.recv
    dist.destroy_process_group()
    with pytest.raises(ValueError, match="has not been initialized"):
        dist.all_reduce(a)


def test_one_call_paths_leave_the_rest_to_the_general_one(world):
    """The one-call paths of all_reduce, broadcast, all_gather_into_tensor,
    reduce_scatter_tensor, all_to_all_single, send and recv (numpy arrays, tensors with a DLPack
    exchange table; the default group) give the general path's results, leave any other
    producer to it untouched (exported as often as the general path does, released as often),
    and leave it the messages."""
    from dlpack_producer import Producer

    a = np.arange(6, dtype=np.int64)
    dist.all_reduce(a)  # the one-call path
    dist.all_reduce(a, op=dist.ReduceOp.MAX)
    dist.all_reduce(a, op="sum")  # a spelling it does not take: the general path
    dist.broadcast(a, src=0)
    assert a.tolist() == list(range(6))
    out = np.zeros(6, dtype=np.int64)
    dist.all_gather_into_tensor(out, a)
    assert out.tolist() == list(range(6))
    out[:] = 0
    dist.reduce_scatter_tensor(out, a, op=dist.ReduceOp.MIN)
    assert out.tolist() == list(range(6))
    out[:] = 0
    dist.all_to_all_single(out, a)
    assert out.tolist() == list(range(6))
    # (the general all_gather, reduce_scatter and all_to_all paths export a producer once more,
    # to read its size)
    for exports, call in (
        (1, dist.all_reduce),
        (1, lambda t: dist.broadcast(t, src=0)),
        (2, lambda t: dist.all_gather_into_tensor(np.zeros(2, np.float32), t)),
        (2, lambda t: dist.reduce_scatter_tensor(np.zeros(2, np.float32), t)),
        (2, lambda t: dist.all_to_all_single(np.zeros(2, np.float32), t)),
    ):
        p = Producer.of_values("f", [1.0, 2.0])
        call(p)
        gc.collect()
        assert (p.exported, p.deleted, p.unconsumed) == (exports, exports, 0)
    with pytest.raises(ValueError, match="all_gather_into_tensor: output_tensor"):
        dist.all_gather_into_tensor(np.zeros(5, np.int64), a)
    with pytest.raises(ValueError, match="reduce_scatter_tensor: input"):
        dist.reduce_scatter_tensor(np.zeros(5, np.int64), a)
    with pytest.raises(ValueError, match="dtypes must match"):
        dist.all_gather_into_tensor(np.zeros(6, np.float64), a)
    with pytest.raises(ValueError, match="at least one dimension"):
        dist.all_to_all_single(np.zeros((), np.int64), np.ones((), np.int64))
    with pytest.raises(ValueError, match="all_to_all_single: output"):
        dist.all_to_all_single(np.zeros(5, np.int64), a)
    ro = np.zeros(6, np.int64)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        dist.all_gather_into_tensor(ro, a)
    with pytest.raises(ValueError, match="destination rank should not be the same"):
        dist.send(a, dst=0)
    with pytest.raises(ValueError, match="source rank should not be the same"):
        dist.recv(a, src=0)
    with pytest.raises(ValueError, match="src"):
        dist.broadcast(a, src=5)
    if torch is not None:
        w = torch.ones(3, requires_grad=True)  # declined (no export of grad tensors), detached
        dist.all_reduce(w)
        assert torch.equal(w.detach(), torch.ones(3)) and w.requires_grad


@needs_torch
def test_torch_tensors_and_work_api(world):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with pytest.raises(ValueError, match="contiguous"):
        dist.all_reduce(t.t())
    work = dist.all_reduce(t, async_op=True)
    assert isinstance(work, dist.Work)
    assert work.wait(timeout=timedelta(seconds=5)) is True
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert work.result() == [t] and work.name == "all_reduce" and work.algo
    assert isinstance(work.get_future(), torch.futures.Future)
    assert work.get_future().wait()[0] is t
    start, begin, end = work.times()
    assert 0 < start <= end
    outs = [torch.zeros(3, 4)]
    work = dist.all_gather(outs, t, async_op=True)
    assert work.get_future().wait()[0] is outs[0]
    work.wait()
    assert torch.equal(outs[0], t)
    # requires_grad inputs are detached, results land in the original tensor
    w = torch.ones(4, requires_grad=True)
    dist.all_reduce(w)
    outs = [torch.zeros(4, requires_grad=True)]
    dist.all_gather(outs, w)
    assert torch.equal(outs[0].detach(), torch.ones(4))
    # complex and bfloat16 travel natively
    c = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    dist.all_reduce(c)
    assert torch.equal(c, torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64))
    with pytest.raises(ValueError):
        dist.all_reduce(c, op=dist.ReduceOp.MAX)
    b = torch.full((5,), 1.5, dtype=torch.bfloat16)
    dist.all_reduce(b, op=dist._make_nccl_premul_sum(2.0))
    assert torch.equal(b, torch.full((5,), 3.0, dtype=torch.bfloat16))
    # torch ReduceOp values and the keyword forms
    x = torch.tensor([3.0, 1.0])
    dist.all_reduce(x, op=tdist.ReduceOp.MIN)
    dist.broadcast(x, group_src=0, group=dist.group.WORLD)
    assert torch.equal(x, torch.tensor([3.0, 1.0]))


def test_self_p2p_and_batch(world):
    got = np.zeros(3)
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.irecv, got, 0, tag=4), dist.P2POp(dist.isend, np.full(3, 9.0), 0, tag=4)]
    )
    for w in works:
        w.wait()
    assert (got == 9.0).all() and works[0].source_rank() == 0
    with pytest.raises(ValueError, match="destination rank"):
        dist.send(got, dst=0)
    assert dist.batch_isend_irecv([]) == []


def test_mesh_arithmetic():
    assert _flatten([[0, 1, 2], [3, 4, 5]]) == ([0, 1, 2, 3, 4, 5], (2, 3))
    assert _flatten(np.arange(8).reshape(2, 2, 2))[1] == (2, 2, 2)
    with pytest.raises(ValueError, match="rectangular"):
        _flatten([[0, 1], [2]])
    mesh = dist.DeviceMesh("cpu", [[0, 1, 2], [3, 4, 5]], _init_backend=False)
    assert mesh._lines(0) == [[0, 3], [1, 4], [2, 5]]
    assert mesh._lines(1) == [[0, 1, 2], [3, 4, 5]]
    cube = dist.DeviceMesh("cpu", np.arange(8).reshape(2, 2, 2), _init_backend=False)
    assert cube._lines(1) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert repr(mesh) == "DeviceMesh('cpu', [[0, 1, 2], [3, 4, 5]])"


def test_thread_worlds():
    """Ranks as threads of one process, each with its own default group (what
    xccl.launch(mode="threads") relies on): state never leaks between threads."""
    from xccl import _group

    store = dist.HashStore()
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def rank_main(rank):
        _group._set_thread_world(_group._World())
        try:
            dist.init_process_group("auto", store=store, rank=rank, world_size=3, timeout=30)
            assert dist.group.WORLD is dist.GroupMember.WORLD is _group.default_group()
            x = np.full(4, rank + 1.0)
            dist.all_reduce(x)
            sub = dist.new_group([0, 2])
            y = np.full(2, float(rank))
            if sub != dist.GroupMember.NON_GROUP_MEMBER:
                dist.all_reduce(y, group=sub)
            objs = [None] * 3
            dist.all_gather_object(objs, rank)
            results[rank] = (dist.get_rank(), float(x[0]), float(y[0]), dist.get_rank(sub), objs)
            dist.destroy_process_group()
            assert not dist.is_initialized()
        except BaseException as exc:
            errors.append(exc)
        finally:
            _group._set_thread_world(None)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert results == {
        0: (0, 6.0, 2.0, 0, [0, 1, 2]),
        1: (1, 6.0, 1.0, -1, [0, 1, 2]),
        2: (2, 6.0, 2.0, 1, [0, 1, 2]),
    }
    assert not dist.is_initialized() and dist.group.WORLD is None
