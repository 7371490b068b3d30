"""The Python API on "CUDA" buffers end to end without a GPU: xccl loads the fake driver of
tests/c/fake_cuda.cc ($XCCL_CUDA_LIB; device memory is host memory from its cuMemAlloc, its
streams a simulator that runs the real kernels compiled for the host), and DLPack producers
export that memory as kDLCUDA tensors. Two ranks run collectives, P2P and the refusals through
xccl._C's CUDA paths (stream= handed to the producer, the checks, XCCL_MEM_CUDA, Work.wait
ordering a stream, synchronize), and with the node-shared segment the "devmap" algorithms,
whose kernels and copies work on peers' buffers mapped through the fake driver's IPC. Needs an
xccl built with CUDA support and a C++ compiler; skipped otherwise."""

from __future__ import annotations

import ctypes
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import run_spmd

from xccl import _C

HERE = Path(__file__).resolve().parent
FAKE_SRC = HERE / "c" / "fake_cuda.cc"
CUDA_INCLUDE = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
N = 257


def _skip_reason() -> str:
    if not _C.cuda_info()["built"]:
        return "xccl was built without CUDA support"
    if not FAKE_SRC.exists():
        return "tests/c/fake_cuda.cc is missing"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler for the fake driver"
    if not (CUDA_INCLUDE / "cuda.h").exists():
        return f"no {CUDA_INCLUDE}/cuda.h"
    return ""


pytestmark = pytest.mark.skipif(bool(_skip_reason()), reason=_skip_reason() or "-")


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("fakecuda") / "libfakecuda.so"
    cmd = [os.environ.get("CXX", "c++"), "-std=c++17", "-O1", "-fPIC", "-shared",
           "-ffp-contract=off", "-Wno-unknown-pragmas", f"-I{CUDA_INCLUDE}",
           f"-I{FAKE_SRC.parent}", str(FAKE_SRC), "-o", str(out), "-ldl"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return str(out)


def _driver() -> Any:
    """The fake driver with device 0's primary context current, as a framework (torch, CuPy)
    sets it up before it allocates."""
    lib = ctypes.CDLL(os.environ["XCCL_CUDA_LIB"])
    ctx = ctypes.c_void_p()
    assert lib.cuInit(0) == 0
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert lib.cuCtxSetCurrent(ctx) == 0
    return lib


def _env(fake_lib: str, **extra: str) -> dict[str, str]:
    """The ranks' environment: the fake driver, and no node-shared segment, so the operations
    go through the cuda_ipc transport rather than the one-host device algorithms ("devmap",
    test_devmap_on_fake_device)."""
    return {"XCCL_CUDA_LIB": fake_lib, "XCCL_SHARED": "0", **extra}


class _Dev:
    """`n` float32 of fake device memory, exported as a kDLCUDA tensor on device 0."""

    def __init__(self, lib: Any, n: int, values: list[float]) -> None:
        sys.path.insert(0, str(HERE))
        from dlpack_producer import Producer, kDLCUDA

        ptr = ctypes.c_uint64()
        assert lib.cuMemAlloc_v2(ctypes.byref(ptr), n * 4) == 0
        self.ptr, self.n = ptr.value, n
        self.set(values)
        self.tensor = Producer(n * 4, (n,), device=(kDLCUDA, 0), data=self.ptr)

    def set(self, values: list[float]) -> None:
        ctypes.memmove(self.ptr, struct.pack(f"={self.n}f", *values), self.n * 4)

    def get(self) -> list[float]:
        return list(struct.unpack(f"={self.n}f", ctypes.string_at(self.ptr, self.n * 4)))


def ops_body(rank: int, ws: int) -> dict[str, Any]:
    import xccl

    lib = _driver()
    res: dict[str, Any] = {}
    base = [float(i) for i in range(N)]
    x = _Dev(lib, N, [v + rank for v in base])
    # the first CUDA tensor chooses the device
    res["device_before"] = xccl.cuda.current_device()
    w = xccl.all_reduce(x.tensor, async_op=True)
    w.synchronize()
    res["device_after"] = xccl.cuda.current_device()
    res["all_reduce"] = x.get() == [ws * v + sum(range(ws)) for v in base]
    res["dlpack_stream"] = x.tensor.last_kwargs["stream"]  # the legacy default stream: 1
    res["completed"] = w.is_completed() and w.is_success()
    # wait() orders the current (legacy default) stream; synchronize() then blocks
    x.set([1.0] * N)
    w = xccl.all_reduce(x.tensor, op=xccl.ReduceOp.MAX, async_op=True)
    res["wait"] = w.wait()
    w.synchronize()
    res["max"] = x.get() == [1.0] * N
    # an explicit stream (a handle of the fake driver)
    s = ctypes.c_void_p()
    assert lib.cuStreamCreateWithPriority(ctypes.byref(s), 1, 0) == 0
    x.set([float(rank)] * N)
    w = xccl.broadcast(x.tensor, src=ws - 1, async_op=True, stream=s.value)
    res["explicit_stream"] = x.tensor.last_kwargs["stream"] == s.value
    w.synchronize()
    res["broadcast"] = x.get() == [float(ws - 1)] * N
    # out of place: reduce_scatter_tensor and all_gather_into_tensor
    big = _Dev(lib, ws * N, [float(r * N + i) for r in range(ws) for i in range(N)])
    out = _Dev(lib, N, [0.0] * N)
    xccl.reduce_scatter_tensor(out.tensor, big.tensor, async_op=True).synchronize()
    res["reduce_scatter"] = out.get() == [ws * float(rank * N + i) for i in range(N)]
    out.set([float(rank)] * N)
    big.set([-1.0] * (ws * N))
    xccl.all_gather_into_tensor(big.tensor, out.tensor, async_op=True).synchronize()
    res["all_gather"] = big.get() == [float(r) for r in range(ws) for _ in range(N)]
    # point to point, and a receive from any rank
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    snd = _Dev(lib, N, [float(100 + rank)] * N)
    rcv = _Dev(lib, N, [0.0] * N)
    works = [xccl.isend(snd.tensor, nxt), xccl.irecv(rcv.tensor)]
    for w in works:
        w.synchronize()
    res["p2p"] = rcv.get() == [float(100 + prv)] * N and works[1].source_rank() == prv
    # refusals before anything moves
    sys.path.insert(0, str(HERE))
    from dlpack_producer import Producer, kDLCUDA

    host = Producer.of_values("f", [1.0, 2.0], device=(kDLCUDA, 0))  # not cuMemAlloc'd
    try:
        xccl.all_reduce(host)
        res["host_pointer_refused"] = "no error"
    except ValueError as exc:
        res["host_pointer_refused"] = str(exc)
    res["host_pointer_untouched"] = host.values() == [1.0, 2.0] and host.live == 0
    other = Producer.of_values("f", [1.0], device=(kDLCUDA, 1))
    try:
        xccl.all_reduce(other)
        res["other_device_refused"] = "no error"
    except ValueError as exc:
        res["other_device_refused"] = str(exc)
    res["leaks"] = [d.tensor.live for d in (x, big, out, snd, rcv)]
    # the device was chosen after the communicator was created: cuda_ipc carried the data all
    # the same (it starts with a driver, not with a chosen device)
    res["transport"] = xccl.group.WORLD.comm.peer_transport(nxt)
    return res


def test_ops_on_fake_device(fake_lib):
    results = run_spmd(ops_body, 2, timeout=90.0, pg_timeout=30.0,
                       env=_env(fake_lib))
    for rank, res in enumerate(results):
        assert res["device_before"] == -1 and res["device_after"] == 0, (rank, res)
        for key in ("all_reduce", "completed", "wait", "max", "explicit_stream", "broadcast",
                    "reduce_scatter", "all_gather", "p2p", "host_pointer_untouched"):
            assert res[key] is True, (rank, key, res)
        assert res["dlpack_stream"] == 1, res
        assert "all_reduce" in res["host_pointer_refused"], res
        assert "this process uses cuda:0" in res["other_device_refused"], res
        assert res["leaks"] == [0] * 5, res
        assert res["transport"] == "cuda_ipc", res


def blocking_body(rank: int, ws: int) -> bool:
    """Two blocking calls in a row (the current stream waits for the first, the second is
    ordered after the current stream), then an asynchronous one waited for on the CPU."""
    import xccl

    lib = _driver()
    x = _Dev(lib, N, [1.0] * N)
    xccl.all_reduce(x.tensor)
    xccl.all_reduce(x.tensor)
    xccl.all_reduce(x.tensor, async_op=True).synchronize()
    ok = x.get() == [float(ws**3)] * N
    # blocking broadcast and send/recv (the receive's stream waits; no CPU wait), then a
    # waited-for asynchronous operation followed by another post
    y = _Dev(lib, N, [float(rank)] * N)
    xccl.broadcast(y.tensor, src=1)
    if rank == 0:
        xccl.send(y.tensor, 1)
    else:
        xccl.recv(x.tensor, 0)
    w = xccl.all_reduce(y.tensor, async_op=True)
    w.wait()
    xccl.all_reduce(y.tensor, async_op=True).synchronize()
    ok = ok and y.get() == [float(ws * ws)] * N
    return ok and (rank == 0 or x.get() == [1.0] * N)


def test_blocking_calls_in_a_row_on_fake_device(fake_lib):
    # a blocking call makes the caller's stream wait for it, then the next call is ordered
    # after that stream: the core starts it once the stream got there (polled), so the first
    # operation's remaining work is never queued behind the second's wait (which deadlocked
    # while xccl's stream itself waited for the caller's)
    assert run_spmd(blocking_body, 2, timeout=60.0, pg_timeout=20.0,
                    env=_env(fake_lib)) == [True, True]


def _rank_values(rank: int, n: int) -> Any:
    """Rank `rank`'s input: small integers as float32, so every sum is exact in any order."""
    import numpy as np

    return np.random.default_rng(1000 + rank).integers(-50, 50, n).astype(np.float32)


def devmap_body(rank: int, ws: int) -> dict[str, Any]:
    import numpy as np

    import xccl

    lib = _driver()
    res: dict[str, Any] = {}
    mine = _rank_values(rank, ws * N)
    every = [_rank_values(r, ws * N) for r in range(ws)]

    def run(name: str, work: Any, got: Any, want: Any) -> None:
        work.synchronize()
        res[name] = (work.algo, bool(np.array_equal(np.asarray(got(), np.float32), want)))

    x = _Dev(lib, N, mine[:N].tolist())
    run("all_reduce", xccl.all_reduce(x.tensor, async_op=True), x.get,
        np.sum([v[:N] for v in every], axis=0))
    x.set(mine[:N].tolist())
    run("broadcast", xccl.broadcast(x.tensor, src=ws - 1, async_op=True), x.get,
        every[ws - 1][:N])
    big = _Dev(lib, ws * N, [0.0] * (ws * N))
    out = _Dev(lib, N, mine[:N].tolist())
    run("all_gather", xccl.all_gather_into_tensor(big.tensor, out.tensor, async_op=True),
        big.get, np.concatenate([v[:N] for v in every]))
    big.set(mine.tolist())
    run("reduce_scatter", xccl.reduce_scatter_tensor(out.tensor, big.tensor, async_op=True),
        out.get, np.sum(every, axis=0)[rank * N:(rank + 1) * N])
    res["leaks"] = [d.tensor.live for d in (x, big, out)]
    return res


def test_devmap_on_fake_device(fake_lib):
    # with the node-shared segment, collectives on device memory of one host take "devmap":
    # each rank maps its peers' buffers (the fake driver's IPC maps the exporter's memfd) and
    # its kernels and copies read and write them directly
    env = {"XCCL_CUDA_LIB": fake_lib, "XCCL_SHARED": "1"}
    results = run_spmd(devmap_body, 2, timeout=90.0, pg_timeout=30.0, env=env)
    for rank, res in enumerate(results):
        for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter"):
            assert res[name] == ("devmap", True), (rank, name, res[name])
        assert res["leaks"] == [0] * 3, res


def stream_wait_body(rank: int, ws: int) -> dict[str, Any]:
    """devmap collectives whose wait() is a stream wait, on a device that takes a while (every
    copy and kernel runs FAKE_CUDA_OP_DELAY_US after it was queued): a copy queued on the
    waiting stream right after wait() must see the result, a fresh buffer every round makes
    the peers map new memory while a stream waits, and the test thread allocates and frees
    device memory meanwhile (calls the fake driver holds until the waiting stream can go on)."""
    import numpy as np

    import xccl

    lib = _driver()
    lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t,
                                     ctypes.c_void_p]
    lib.fake_cuda_stream_waits.restype = ctypes.c_ulong
    res: dict[str, Any] = {"rounds": []}
    every = [_rank_values(r, N) for r in range(ws)]
    want = np.sum(every, axis=0)
    for _ in range(4):
        x = _Dev(lib, N, _rank_values(rank, N).tolist())
        seen = _Dev(lib, N, [0.0] * N)
        w = xccl.all_reduce(x.tensor, async_op=True)
        w.wait()  # the legacy default stream waits; the CPU goes on
        assert lib.cuMemcpyAsync(seen.ptr, x.ptr, N * 4, None) == 0
        x2 = _Dev(lib, N, [1.0] * N)  # cuMemAlloc: held until the stream can go on
        assert lib.cuStreamSynchronize(None) == 0
        res["rounds"].append((w.algo, bool(np.array_equal(np.float32(seen.get()), want)),
                              x2.get() == [1.0] * N))
        assert lib.cuMemFree_v2(ctypes.c_uint64(x2.ptr)) == 0
    res["stream_waits"] = int(lib.fake_cuda_stream_waits())
    return res


def test_stream_waits_on_devmap_order_without_deadlock(fake_lib):
    # wait() queues a wait on the current stream at once, and no implicitly synchronising
    # driver call is made while it waits (the fake driver would fail it after 5 s, where a GPU
    # would hang): a fresh buffer whose mapping is refused makes that round fall back
    env = {"XCCL_CUDA_LIB": fake_lib, "XCCL_SHARED": "1", "FAKE_CUDA_OP_DELAY_US": "50000",
           "FAKE_CUDA_SYNC_TIMEOUT_MS": "5000"}
    results = run_spmd(stream_wait_body, 2, timeout=120.0, pg_timeout=30.0, env=env)
    for rank, res in enumerate(results):
        assert res["rounds"] == [("devmap", True, True)] * 4, (rank, res)
        # the device takes 50 ms per step, so at least one wait found the operation running
        assert res["stream_waits"] >= 1, (rank, res)


def early_wait_body(rank: int, ws: int, log_dir: str) -> dict[str, Any]:
    """Twice: rank 0 waits (wait(): on its stream) for a devmap all_reduce of the same buffer
    that rank 1 joins a second later; a copy queued on the stream after wait() must see the
    sum. Returns per round how long wait() took, whether the copy saw the sum, and how many
    of this rank's log lines said that devmap fell back."""
    import glob
    import time

    import numpy as np

    import xccl

    def fallbacks() -> int:
        return sum(open(f).read().count("falls back to messages")
                   for f in glob.glob(os.path.join(log_dir, f"{os.getpid()}.log")))

    lib = _driver()
    lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t,
                                     ctypes.c_void_p]
    want = np.sum([_rank_values(r, N) for r in range(ws)], axis=0)
    x = _Dev(lib, N, [0.0] * N)
    seen = _Dev(lib, N, [0.0] * N)
    rounds = []
    for _ in range(2):
        x.set(_rank_values(rank, N).tolist())
        xccl.barrier()
        if rank == 1:
            time.sleep(1.0)
        w = xccl.all_reduce(x.tensor, async_op=True)
        t0 = time.monotonic()
        w.wait()
        wait_s, running = time.monotonic() - t0, not w.is_completed()
        assert lib.cuMemcpyAsync(seen.ptr, x.ptr, N * 4, None) == 0
        assert lib.cuStreamSynchronize(None) == 0
        ok = w.algo == "devmap" and bool(np.array_equal(np.float32(seen.get()), want))
        rounds.append((wait_s, running, ok, fallbacks()))
    return {"rounds": rounds}


def test_wait_does_not_hold_the_cpu_until_peers_join(fake_lib, tmp_path):
    # a devmap collective may have its peers' buffers still to map when a stream is made to
    # wait for it: it never waits for a refused mapping (every rank falls back to messages for
    # that call instead), so wait() queues the stream's wait at once rather than holding the
    # CPU until the peers have joined; the refused buffer is mapped when the next operation is
    # posted, so the second round runs devmap itself
    env = {"XCCL_CUDA_LIB": fake_lib, "XCCL_SHARED": "1", "FAKE_CUDA_SYNC_TIMEOUT_MS": "5000",
           "XCCL_DEBUG": "INFO", "XCCL_DEBUG_FILE": str(tmp_path / "%p.log")}
    results = run_spmd(early_wait_body, 2, str(tmp_path), timeout=90.0, pg_timeout=30.0, env=env)
    for rank, res in enumerate(results):
        assert all(ok for _, _, ok, _ in res["rounds"]), (rank, res)
    first, second = results[0]["rounds"]
    assert first[0] < 0.5 and first[1], first  # queued at once, the peer still to come
    assert second[0] < 0.5 and second[1], second
    assert first[3] >= 1 and second[3] == first[3], results[0]  # fell back once, not twice
