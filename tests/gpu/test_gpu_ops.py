"""Every operation of xccl's Python API on CUDA tensors, checked against numpy references (and,
for float16/bfloat16, bit for bit against xccl's CPU path on the same inputs), with 2, 3 and
4 ranks sharing GPU 0. One launch per rank count runs the whole list of checks (a process
start with torch and a CUDA context costs seconds); a launch returns every failed check.

A check computes and compares without raising: a wrong value on one rank must not leave the
others waiting in the next collective. An exception from xccl itself ends the rank's list
(its state is unknown) and is reported with its traceback.

Stream rules checked: a tensor written by a kernel on a side stream (behind a sleep kernel)
just before the call, with stream= that side stream, is read after the kernel; results are
consumed on the current stream after Work.wait() (which makes that stream wait for the
operation on the GPU) with no other synchronisation in between; stream waits next to torch
freeing and allocating device memory (the calls that may synchronise the device) do not hang.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import run_spmd

pytestmark = pytest.mark.gpu

TESTS_DIR = str(Path(__file__).resolve().parent.parent)
N = 1031  # elements of most checks: odd, not a multiple of any group size
LARGE = (1 << 22) + 3  # a large all_reduce (16 MiB of float32): chunked, pipelined paths
SLEEP_CYCLES = 50_000_000  # torch.cuda._sleep: some tens of milliseconds on an H100
FLOATS = ("float32", "float64", "float16", "bfloat16")
INTS = ("int8", "uint8", "int32", "int64")
FLOAT_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM")
INT_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
BOOL_OPS = ("MIN", "MAX", "BAND", "BOR", "BXOR")
PREMUL = 0.5
# relative tolerance of a float result against the float64 reference
RTOL = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 1e-6, "float64": 1e-12, "complex64": 1e-6}


class Checks:
    """The failures of one rank's checks (compare without raising)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures: list[str] = []
        self.count = 0

    def equal(self, name: str, got: np.ndarray, want: np.ndarray) -> None:
        self.count += 1
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape or not np.array_equal(got, want):
            self.failures.append(f"rank {self.rank} {name}: {_diff(got, want)}")

    def close(self, name: str, got: np.ndarray, want: np.ndarray, rtol: float) -> None:
        self.count += 1
        got = np.asarray(got, dtype=np.complex128 if np.iscomplexobj(want) else np.float64)
        if got.shape != want.shape or not np.allclose(got, want, rtol=rtol, atol=rtol):
            self.failures.append(f"rank {self.rank} {name}: {_diff(got, want)}")

    def true(self, name: str, cond: bool, detail: str = "") -> None:
        self.count += 1
        if not cond:
            self.failures.append(f"rank {self.rank} {name}: {detail or 'false'}")


def _diff(got: np.ndarray, want: np.ndarray) -> str:
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    i = int(bad[0]) if bad.size else 0
    return (f"{bad.size} of {want.size} elements differ; first at {i}: got "
            f"{got.reshape(-1)[i]!r}, expected {want.reshape(-1)[i]!r}")


# ---------------------------------------------------------------------------------------------
# inputs and references
# ---------------------------------------------------------------------------------------------


def _inputs(dtype: str, op: str, rank: int, case: int, n: int = N) -> np.ndarray:
    """Rank `rank`'s input of a reduction case, as float64/int64/bool/complex128 values that
    every dtype of the case holds exactly, and whose partial results (at most 4 ranks) are
    exact too, so that any order of reduction gives the same bits."""
    rng = np.random.default_rng(1000 * case + rank)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if dtype == "complex64":
        return (rng.integers(-4, 5, n) + 1j * rng.integers(-4, 5, n)).astype(np.complex128)
    if op == "PRODUCT":
        if dtype in ("uint8", "int8"):
            vals = rng.integers(1, 4, n)
        else:
            vals = rng.choice([-2, -1, 1, 2], n)
        if dtype == "uint8":
            vals = np.abs(vals)
        return vals.astype(np.float64 if dtype in FLOATS else np.int64)
    if op in ("BAND", "BOR", "BXOR"):
        return rng.integers(0, 128, n).astype(np.int64)
    lo = 0 if dtype == "uint8" else -8
    vals = rng.integers(lo, 9, n)
    return vals.astype(np.float64 if dtype in FLOATS else np.int64)


def _reference(op: str, arrays: list[np.ndarray]) -> np.ndarray:
    a = np.stack(arrays)
    if op in ("SUM", "AVG", "PREMUL_SUM"):
        s = a.sum(axis=0)
        if op == "AVG":
            return s / len(arrays)
        return s * PREMUL if op == "PREMUL_SUM" else s
    if op == "PRODUCT":
        return a.prod(axis=0)
    if op == "MIN":
        return a.min(axis=0)
    if op == "MAX":
        return a.max(axis=0)
    fn = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
    return fn.reduce(a, axis=0)


def _op(xccl: Any, name: str) -> Any:
    if name == "PREMUL_SUM":
        return xccl._make_nccl_premul_sum(PREMUL)
    return getattr(xccl.ReduceOp, name)


def _np(t: Any) -> np.ndarray:
    """A CPU copy of a torch tensor as numpy (bfloat16 as float32, exactly)."""
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


def _bits(t: Any) -> np.ndarray:
    """The raw bits of a 16-bit float tensor."""
    import torch

    return t.detach().cpu().contiguous().view(torch.int16).numpy()


# ---------------------------------------------------------------------------------------------
# the checks (each rank runs them all, in the same order)
# ---------------------------------------------------------------------------------------------


def _reductions(c: Checks, xccl: Any, torch: Any, rank: int, ws: int, dev: str) -> None:
    """all_reduce with every ReduceOp on every dtype; float16/bfloat16 also bit for bit
    against xccl's CPU path on the same inputs."""
    case = 0
    matrix = [(d, o) for d in FLOATS for o in FLOAT_OPS]
    matrix += [(d, o) for d in INTS for o in INT_OPS]
    matrix += [("bool", o) for o in BOOL_OPS]
    matrix += [("complex64", o) for o in ("SUM", "PRODUCT", "AVG")]
    for dtype, op in matrix:
        case += 1
        tdt = getattr(torch, dtype)
        mine = _inputs(dtype, op, rank, case)
        x = torch.from_numpy(mine).to(tdt).to(dev)
        xccl.all_reduce(x, op=_op(xccl, op))
        want = _reference(op, [_inputs(dtype, op, r, case) for r in range(ws)])
        name = f"all_reduce {op} {dtype}"
        if dtype in RTOL:
            c.close(name, _np(x), want, RTOL[dtype])
        else:
            c.equal(name, _np(x), want.astype(_np(x).dtype))
        if dtype in ("float16", "bfloat16"):
            h = torch.from_numpy(mine).to(tdt)  # the same inputs through the CPU path
            xccl.all_reduce(h, op=_op(xccl, op))
            c.equal(f"{name} bits vs the CPU path", _bits(x), _bits(h))
    # reduce_scatter_tensor and reduce with AVG / PREMUL_SUM / bitwise on the GPU too
    for dtype, op in (("float32", "AVG"), ("bfloat16", "PREMUL_SUM"), ("int32", "BXOR"),
                      ("float16", "MAX")):
        case += 1
        tdt = getattr(torch, dtype)
        full = [_inputs(dtype, op, r, case, ws * 64) for r in range(ws)]
        out = torch.empty(64, dtype=tdt, device=dev)
        xccl.reduce_scatter_tensor(out, torch.from_numpy(full[rank]).to(tdt).to(dev),
                                   op=_op(xccl, op))
        want = _reference(op, full)[rank * 64:(rank + 1) * 64]
        c.close(f"reduce_scatter_tensor {op} {dtype}", _np(out), want, RTOL.get(dtype, 0.0))
        x = torch.from_numpy(full[rank]).to(tdt).to(dev)
        root = ws - 1
        xccl.reduce(x, dst=root, op=_op(xccl, op))
        if rank == root:
            c.close(f"reduce {op} {dtype}", _np(x), _reference(op, full), RTOL.get(dtype, 0.0))
        else:
            c.close(f"reduce {op} {dtype} (non-root unchanged)", _np(x), full[rank],
                    RTOL.get(dtype, 0.0))
    # large: chunked and pipelined paths
    x = torch.full((LARGE,), float(rank + 1), device=dev)
    x[-1] = rank * 0.5
    xccl.all_reduce(x)
    got = _np(x)
    c.true("all_reduce large float32", bool((got[:-1] == ws * (ws + 1) / 2).all())
           and got[-1] == sum(r * 0.5 for r in range(ws)), f"{got[:2]} ... {got[-2:]}")
    y = torch.arange(LARGE, device=dev, dtype=torch.float32).to(torch.bfloat16)
    out = torch.empty(ws * LARGE, dtype=torch.bfloat16, device=dev)
    xccl.all_gather_into_tensor(out, y)
    c.equal("all_gather_into_tensor large bfloat16", _bits(out), np.tile(_bits(y), ws))


def _data_movement(c: Checks, xccl: Any, torch: Any, rank: int, ws: int, dev: str) -> None:
    """broadcast, all_gather(_into_tensor), gather, scatter, reduce_scatter (lists),
    all_to_all(_single) even and uneven, barrier."""
    ar = torch.arange(N, device=dev, dtype=torch.float32)
    base = np.arange(N, dtype=np.float32)
    for root in range(ws):
        x = ar * (rank + 1)
        xccl.broadcast(x, src=root)
        c.equal(f"broadcast root {root}", _np(x), base * (root + 1))
    # all_gather_into_tensor, both output shapes
    out = torch.empty(ws * N, device=dev)
    xccl.all_gather_into_tensor(out, ar + rank)
    c.equal("all_gather_into_tensor", _np(out), np.concatenate([base + r for r in range(ws)]))
    out2 = torch.empty(ws, N, dtype=torch.int64, device=dev)
    xccl.all_gather_into_tensor(out2, (ar + 10 * rank).long())
    c.equal("all_gather_into_tensor [size, n] int64", _np(out2),
            np.stack([(base + 10 * r).astype(np.int64) for r in range(ws)]))
    # list outputs: copy-out on the call's stream
    outs = [torch.full((N,), -1.0, device=dev) for _ in range(ws)]
    xccl.all_gather(outs, ar * rank)
    for r in range(ws):
        c.equal(f"all_gather[{r}]", _np(outs[r]), base * r)
    root = ws - 1
    glist = [torch.empty(N, device=dev) for _ in range(ws)] if rank == root else None
    xccl.gather(ar - rank, glist, dst=root)
    if rank == root:
        for r in range(ws):
            c.equal(f"gather[{r}]", _np(glist[r]), base - r)
    slist = [ar * 2 + r for r in range(ws)] if rank == 0 else None
    x = torch.empty(N, device=dev)
    xccl.scatter(x, slist, src=0)
    c.equal("scatter", _np(x), base * 2 + rank)
    ins = [ar + 100 * r + rank for r in range(ws)]
    x = torch.empty(N, device=dev)
    xccl.reduce_scatter(x, ins)
    c.equal("reduce_scatter list", _np(x), ws * (base + 100 * rank) + sum(range(ws)))
    # all_to_all_single, even: block j of rank r is 1000 r + 10 j + i
    k = 5
    inp = torch.cat([torch.arange(k, device=dev) + 1000 * rank + 10 * j for j in range(ws)])
    out = torch.empty_like(inp)
    xccl.all_to_all_single(out, inp)
    want = np.concatenate([np.arange(k) + 1000 * r + 10 * rank for r in range(ws)])
    c.equal("all_to_all_single even", _np(out), want)
    # uneven: rank r sends r + j + 1 rows to rank j
    in_splits = [rank + j + 1 for j in range(ws)]
    out_splits = [r + rank + 1 for r in range(ws)]
    inp = torch.cat([torch.full((in_splits[j], 3), float(1000 * rank + j), device=dev)
                     for j in range(ws)])
    out = torch.empty(sum(out_splits), 3, device=dev)
    xccl.all_to_all_single(out, inp, out_splits, in_splits)
    want = np.concatenate([np.full((out_splits[r], 3), 1000 * r + rank, np.float32)
                           for r in range(ws)])
    c.equal("all_to_all_single uneven", _np(out), want)
    ins = [torch.full((j + 1,), float(100 * rank + j), device=dev) for j in range(ws)]
    outs = [torch.empty(rank + 1, device=dev) for _ in range(ws)]
    xccl.all_to_all(outs, ins)
    for r in range(ws):
        c.equal(f"all_to_all[{r}]", _np(outs[r]), np.full(rank + 1, 100 * r + rank, np.float32))
    xccl.barrier()


def _p2p(c: Checks, xccl: Any, torch: Any, rank: int, ws: int, dev: str) -> None:
    """send/recv, isend/irecv, batch_isend_irecv, receives from any rank."""
    base = np.arange(N, dtype=np.float32)
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    x = torch.arange(N, device=dev, dtype=torch.float32) + rank
    y = torch.empty(N, device=dev)
    works = [xccl.isend(x, nxt, tag=3), xccl.irecv(y, prv, tag=3)]
    for w in works:
        w.wait()
    c.equal("isend/irecv ring", _np(y), base + prv)
    ops = [xccl.P2POp(xccl.isend, x * 2, nxt), xccl.P2POp(xccl.irecv, y, prv)]
    for w in xccl.batch_isend_irecv(ops):
        w.wait()
    c.equal("batch_isend_irecv ring", _np(y), 2 * (base + prv))
    # blocking pair exchange between ranks 0 and 1
    if rank in (0, 1):
        other = 1 - rank
        z = torch.empty(N, device=dev)
        if rank == 0:
            xccl.send(x, other)
            src = xccl.recv(z, other)
        else:
            src = xccl.recv(z, other)
            xccl.send(x, other)
        c.equal("send/recv pair", _np(z), base + other)
        c.true("recv returns the sender", src == other, f"{src}")
    # any source: everyone sends its rank to rank 0
    if rank == 0:
        seen = []
        for _ in range(ws - 1):
            z = torch.empty(N, device=dev)
            src = xccl.recv(z, tag=9)
            seen.append(src)
            c.equal(f"recv any source (from {src})", _np(z), base * 0 + src)
        c.true("recv any source: every sender once", sorted(seen) == list(range(1, ws)),
               f"{seen}")
        z = torch.empty(N, device=dev)
        if ws > 1:
            w = xccl.irecv(z, tag=10)
            w.wait()
            w.synchronize()
            c.equal("irecv any source", _np(z), base * 0 + w.source_rank())
    else:
        xccl.send(torch.full((N,), float(rank), device=dev), 0, tag=9)
        if rank == ws - 1:
            xccl.send(torch.full((N,), float(rank), device=dev), 0, tag=10)


def _groups(c: Checks, xccl: Any, torch: Any, rank: int, ws: int, dev: str) -> None:
    """Subgroups, DeviceMesh and object collectives with CUDA tensors."""
    evens = list(range(0, ws, 2))
    g = xccl.new_group(evens)
    if rank in evens:
        x = torch.full((N,), float(rank + 1), device=dev)
        xccl.all_reduce(x, group=g)
        c.equal("all_reduce on a subgroup", _np(x), np.full(N, sum(r + 1 for r in evens),
                                                            np.float32))
    shape = (2, ws // 2) if ws % 2 == 0 and ws > 2 else (ws,)
    names = ("dp", "tp") if len(shape) == 2 else ("dp",)
    mesh = xccl.init_device_mesh(dev, shape, mesh_dim_names=names)
    grp = mesh.get_group(names[-1])
    members = xccl.get_process_group_ranks(grp)
    x = torch.full((N,), float(rank), device=dev)
    xccl.all_reduce(x, group=grp)
    c.equal("DeviceMesh all_reduce", _np(x), np.full(N, float(sum(members)), np.float32))
    objs: list[Any] = [None] * ws
    xccl.all_gather_object(objs, {"rank": rank})
    c.true("all_gather_object", objs == [{"rank": r} for r in range(ws)], f"{objs}")
    lst = [rank, "x"] if rank == 0 else [None, None]
    xccl.broadcast_object_list(lst, src=0, device=torch.device(dev, 0) if dev == "cuda" else "cpu")
    c.true("broadcast_object_list device=cuda", lst == [0, "x"], f"{lst}")


def _streams(c: Checks, xccl: Any, torch: Any, rank: int, ws: int, dev: str) -> None:
    """Stream ordering and the Work methods: no synchronisation but xccl's own between writing
    a tensor on a stream, the call, wait() and reading the result on a stream."""
    total = float(sum(r + 1 for r in range(ws)))
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    # written on a side stream behind a sleep kernel, posted with stream=side, consumed on the
    # current stream after wait()
    x = torch.zeros(N, device=dev)
    side.wait_stream(cur)  # x's zeros first
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(rank + 1)
    w = xccl.all_reduce(x, async_op=True, stream=side)
    w.wait()
    y = x * 2
    c.equal("stream=side, wait() on the current stream", _np(y), np.full(N, 2 * total,
                                                                         np.float32))
    # the same with a torch.cuda.Stream object's handle as an int, and cupy-style objects
    x = torch.zeros(N, device=dev)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(rank + 1)
    xccl.all_reduce(x, stream=side.cuda_stream)  # the call's stream (side) waits for it
    cur.wait_stream(side)
    c.equal("stream=<int handle>, blocking call", _np(x), np.full(N, total, np.float32))
    # the current stream by default; a blocking call returns once the operation finished
    x = torch.empty(N, device=dev)
    torch.cuda._sleep(SLEEP_CYCLES)
    x.fill_(rank + 1)
    xccl.all_reduce(x)
    c.equal("current stream, blocking call", _np(x + 0), np.full(N, total, np.float32))
    # wait() on another stream than the call's
    x = torch.empty(N, device=dev)
    torch.cuda._sleep(SLEEP_CYCLES)
    x.fill_(rank + 1)
    w = xccl.all_reduce(x, async_op=True)
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        w.wait()
        z = x * 3
    other.synchronize()
    c.equal("wait() on another stream", _np(z), np.full(N, 3 * total, np.float32))
    # list outputs: the copy-out is ordered too
    x = torch.empty(N, device=dev)
    torch.cuda._sleep(SLEEP_CYCLES)
    x.fill_(rank + 1)
    outs = [torch.empty(N, device=dev) for _ in range(ws)]
    w = xccl.all_gather(outs, x, async_op=True)
    w.wait()
    got = torch.stack(outs) * 1
    c.equal("all_gather list, async, wait()", _np(got),
            np.stack([np.full(N, r + 1, np.float32) for r in range(ws)]))
    # synchronize / is_completed / wait(timeout)
    x = torch.full((N,), float(rank + 1), device=dev)
    w = xccl.all_reduce(x, async_op=True)
    w.synchronize()
    c.true("is_completed after synchronize", w.is_completed() and w.is_success())
    c.equal("synchronize: result visible to the CPU", x.cpu().numpy(), np.full(N, total,
                                                                              np.float32))
    w = xccl.all_reduce(x, async_op=True)
    c.true("wait(timeout) returns True", w.wait(timeout=60) is True)
    c.true("completed after wait(timeout)", w.is_completed())
    deadline = time.monotonic() + 60
    x = torch.full((N,), float(rank + 7), device=dev)
    w = xccl.broadcast(x, src=0, async_op=True)
    while not w.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    c.true("is_completed polls to True", w.is_completed())
    w.wait()
    c.equal("after polling", _np(x), np.full(N, 7.0, np.float32))
    # stream waits next to the driver calls that may synchronise the device (xccl.cuda,
    # Streams): every round a fresh buffer (peers map new memory), wait() on the current
    # stream, then torch frees its cached blocks (cudaFree) and allocates while the stream may
    # still wait - a deadlock would hang here (the launch's timeout reports it)
    for i in range(6):
        x = torch.full((N + 64 * i,), float(rank + 1), device=dev)
        w = xccl.all_reduce(x, async_op=True)
        w.wait()
        torch.cuda.empty_cache()
        y = x * 2 + torch.zeros_like(x)
        c.equal(f"stream wait, then free and allocate (round {i})", _np(y),
                np.full(N + 64 * i, 2 * total, np.float32))
    # a Work dropped without waiting: its buffers stay alive until it ends
    x = torch.full((N,), float(rank + 1), device=dev)
    xccl.all_reduce(x, async_op=True)
    torch.cuda.synchronize()
    xccl.barrier()
    info = xccl.cuda.build_info()
    c.true("xccl.cuda.current_device", xccl.cuda.current_device() == 0,
           f"{xccl.cuda.current_device()}")
    c.true("build_info of the GPU", info["loaded"] and info["device"] == 0
           and info["compute_capability"] == tuple(torch.cuda.get_device_capability(0))
           and bool(info["device_name"]), f"{info}")


def _cupy(c: Checks, xccl: Any, torch: Any, rank: int, ws: int, dev: str) -> None:
    """CuPy arrays: all_reduce and broadcast, with CuPy's current stream and with stream=."""
    try:
        import cupy
    except ImportError:
        return
    total = float(sum(r + 1 for r in range(ws)))
    a = cupy.full(N, rank + 1, dtype=cupy.float32)
    xccl.all_reduce(a)
    c.equal("cupy all_reduce", cupy.asnumpy(a), np.full(N, total, np.float32))
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        b = cupy.arange(N, dtype=cupy.float64) * (rank + 1)
    xccl.broadcast(b, src=ws - 1, stream=s)
    s.synchronize()
    c.equal("cupy broadcast stream=cupy stream", cupy.asnumpy(b),
            np.arange(N, dtype=np.float64) * ws)
    # managed memory: refused on every rank before anything moves
    m = cupy.ndarray((N,), cupy.float32, cupy.cuda.malloc_managed(N * 4))
    m.fill(rank)
    try:
        xccl.all_reduce(m)
        c.true("managed memory refused", False, "no error")
    except ValueError as exc:
        c.true("managed memory refused", "managed" in str(exc), str(exc))
    c.equal("managed memory untouched", cupy.asnumpy(m), np.full(N, rank, np.float32))


def _refusals(c: Checks, xccl: Any, torch: Any, rank: int, ws: int, dev: str) -> None:
    """Errors before anything moves (the same on every rank: no collective starts)."""
    sys.path.insert(0, TESTS_DIR)
    from dlpack_producer import Producer

    x = torch.full((N,), float(rank), device=dev)
    host = torch.zeros(ws * N)

    def refused(name: str, call: Callable[[], Any], text: str) -> None:
        try:
            call()
            c.true(name, False, "no error")
        except (ValueError, TypeError) as exc:
            c.true(name, text in str(exc), str(exc))

    refused("mixed host/CUDA", lambda: xccl.all_gather_into_tensor(host, x),
            "must all be CUDA tensors or all host tensors")
    other = Producer.of_values("f", [1.0, 2.0], device=(2, 1))  # claims cuda:1
    refused("another GPU", lambda: xccl.all_reduce(other), "this process uses cuda:0")
    refused("another GPU, stream=0", lambda: xccl.all_reduce(other, async_op=True, stream=0),
            "this process uses cuda:0")
    refused("stream= on host tensors", lambda: xccl.all_reduce(torch.ones(3), stream=0),
            "stream= is for operations on CUDA tensors")
    refused("bad stream", lambda: xccl.all_reduce(x, stream=-3), "CUstream")
    refused("bad stream type", lambda: xccl.all_reduce(x, stream="s"), "stream")
    if torch.cuda.device_count() > 1:
        y = torch.ones(4, device="cuda:1")
        refused("a tensor on cuda:1", lambda: xccl.all_reduce(y), "this process uses cuda:0")
    c.equal("refused calls left x alone", _np(x), np.full(N, rank, np.float32))
    # and the group still works after them
    xccl.all_reduce(x)
    c.equal("all_reduce after refusals", _np(x), np.full(N, sum(range(ws)), np.float32))


SECTIONS = (_reductions, _data_movement, _p2p, _groups, _streams, _cupy, _refusals)
# the sections that also run on CPU tensors (tests/test_cuda_api.py checks this file's
# references and expectations that way on machines without a GPU)
HOST_SECTIONS = (_reductions, _data_movement, _p2p, _groups)


def suite(rank: int, world_size: int, dev: str = "cuda") -> dict[str, Any]:
    """One rank's run of every check: {"checks": n, "failures": [...], "seconds": s}. With
    dev="cpu", the checks that need no GPU run on CPU tensors."""
    import torch

    import xccl

    if dev == "cuda":
        torch.cuda.set_device(0)  # every rank on GPU 0
    c = Checks(rank)
    t0 = time.monotonic()
    for section in SECTIONS if dev == "cuda" else HOST_SECTIONS:
        try:
            section(c, xccl, torch, rank, world_size, dev)
        except Exception:
            c.failures.append(f"rank {rank} {section.__name__} raised:\n{traceback.format_exc()}")
            break  # the group's state is unknown from here
    if dev == "cuda":
        torch.cuda.synchronize()
    return {"checks": c.count, "failures": c.failures, "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_operations(world_size):
    # a hung operation fails its rank after 20 s (every operation here takes milliseconds)
    results = run_spmd(suite, world_size, timeout=120.0, pg_timeout=20.0)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:40])
    assert all(r["checks"] > 100 for r in results), [r["checks"] for r in results]


# ---------------------------------------------------------------------------------------------
# a peer dies during a GPU operation
# ---------------------------------------------------------------------------------------------

KILL_PG_TIMEOUT = 20.0


def killed_peer(rank: int, world_size: int) -> dict[str, Any]:
    """The last rank posts a large all_reduce and exits at once; the others must get a named
    error within the group's timeout and leave no GPU work running."""
    import torch

    import xccl

    torch.cuda.set_device(0)
    x = torch.ones(1 << 24, device="cuda")  # 64 MiB
    xccl.all_reduce(x)  # every connection up
    torch.cuda.synchronize()
    xccl.barrier()
    if rank == world_size - 1:
        xccl.all_reduce(x, async_op=True)
        os._exit(7)
    t0 = time.monotonic()
    error = None
    for _ in range(2):  # the second never has the dead rank's part
        try:
            xccl.all_reduce(x, async_op=True).synchronize()
        except Exception as exc:
            error = exc
            break
    elapsed = time.monotonic() - t0
    torch.cuda.synchronize()  # hangs (the harness's timeout) if a kernel still spins
    return {
        "error": None if error is None else type(error).__name__,
        "message": str(error),
        "status": getattr(error, "status_name", None),
        "seconds": elapsed,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_peer_killed_during_gpu_op(world_size):
    results = run_spmd(killed_peer, world_size, timeout=90.0, pg_timeout=KILL_PG_TIMEOUT,
                       expect_exit={world_size - 1: 7})
    for rank, res in enumerate(results[:-1]):
        assert res["error"] in ("XcclConnectionError", "XcclTimeoutError", "XcclError"), (
            rank, res)
        assert res["status"] and res["status"] != "XCCL_ERR_INTERNAL", (rank, res)
        assert res["seconds"] < KILL_PG_TIMEOUT + 10, (rank, res)
