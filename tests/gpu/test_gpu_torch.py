"""torch.distributed on xccl with CUDA tensors (the "xcclc" backend), 2 ranks sharing GPU 0:
every operation torch sends through a backend, checked against numpy; torch's NCCL stream
rules (a tensor written on the current stream just before the call, consumed on the current
stream after ``wait()`` with no other synchronisation); CUDA-aware futures; refusal inside a
CUDA graph capture; and DDP (with a compression hook) and FSDP2 training compared with the
same script on gloo (which stages CUDA tensors through the host), which NCCL cannot be
compared with here: it refuses two ranks on one GPU.

A check compares without raising (a wrong value on one rank must not leave the other waiting
in the next collective); an exception ends the rank's list and is reported with its traceback.
"""

from __future__ import annotations

import datetime
import os
import traceback
from typing import Any

import numpy as np
import pytest
from harness import run_spmd

pytestmark = pytest.mark.gpu

N = 1031
SLEEP_CYCLES = 50_000_000  # torch.cuda._sleep: some tens of milliseconds on an H100


def _init(backend: str, rank: int, size: int, store: str) -> Any:
    import torch
    import torch.distributed as dist

    import xccl.torch  # noqa: F401 - registers "xcclc"

    torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=30))
    return dist


def _np(t: Any) -> np.ndarray:
    import torch

    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def _ops(dist: Any, rank: int, ws: int) -> dict[str, Any]:
    """Every operation on CUDA tensors through torch.distributed, checked."""
    import torch

    failures: list[str] = []
    count = 0

    def equal(name: str, got: Any, want: np.ndarray) -> None:
        nonlocal count
        count += 1
        got = _np(got) if isinstance(got, torch.Tensor) else np.asarray(got)
        if got.shape != want.shape or not np.array_equal(got, want):
            failures.append(f"rank {rank} {name}: got {got.reshape(-1)[:4]}..., expected "
                            f"{want.reshape(-1)[:4]}...")

    def vals(r: int, n: int = N) -> np.ndarray:
        return np.random.default_rng(100 + r).integers(-50, 50, n).astype(np.float32)

    mine, every = vals(rank), [vals(r) for r in range(ws)]
    total = np.sum(every, axis=0)
    try:
        pg = dist.group.WORLD
        count += 1
        if type(pg).__name__ != "XcclProcessGroup":
            failures.append(f"rank {rank}: the group is {type(pg).__name__}")
        # written on the current stream behind a sleep, consumed there after wait()
        x = torch.empty(N, device="cuda")
        torch.cuda._sleep(SLEEP_CYCLES)
        x.copy_(torch.from_numpy(mine))
        w = dist.all_reduce(x, async_op=True)
        w.wait()
        equal("all_reduce async, wait(), consumed on the stream", x * 1, total)
        x.copy_(torch.from_numpy(mine))
        dist.all_reduce(x)
        equal("all_reduce blocking", x + 0, total)
        for dt in (torch.float16, torch.bfloat16, torch.float64, torch.int32):
            y = torch.from_numpy(mine).to("cuda", dt)
            dist.all_reduce(y)
            equal(f"all_reduce {dt}", y.to(torch.float64), total.astype(np.float64))
        y = torch.from_numpy(mine).cuda()
        dist.all_reduce(y, op=dist.ReduceOp.AVG)
        count += 1
        if not np.allclose(_np(y), total / ws, rtol=1e-6):
            failures.append(f"rank {rank} all_reduce AVG")
        # tensor collectives FSDP2 and DTensor use
        out = torch.empty(ws * N, device="cuda")
        dist.all_gather_into_tensor(out, torch.from_numpy(mine).cuda())
        equal("all_gather_into_tensor", out, np.concatenate(every))
        big = torch.from_numpy(np.concatenate([vals(rank, N) + r for r in range(ws)])).cuda()
        part = torch.empty(N, device="cuda")
        dist.reduce_scatter_tensor(part, big)
        equal("reduce_scatter_tensor", part, np.sum([vals(q) + rank for q in range(ws)], axis=0))
        # a non-contiguous output: gathered into a temporary, copied on the call's stream
        outt = torch.empty(N, ws, device="cuda").t()
        w = dist.all_gather_into_tensor(outt, torch.from_numpy(mine).cuda(), async_op=True)
        w.wait()
        equal("all_gather_into_tensor, non-contiguous output", outt * 1,
              np.stack(every).reshape(ws, N))
        # uneven all_to_all_single
        splits_in = [r + 1 for r in range(ws)]
        src = torch.arange(sum(splits_in), device="cuda", dtype=torch.float32) + 100 * rank
        splits_out = [rank + 1] * ws
        dst = torch.empty(sum(splits_out), device="cuda")
        dist.all_to_all_single(dst, src, splits_out, splits_in)
        want = np.concatenate([np.arange(sum(splits_in), dtype=np.float32)[
            sum(splits_in[:rank]):sum(splits_in[:rank + 1])] + 100 * q for q in range(ws)])
        equal("all_to_all_single uneven", dst, want)
        # lists
        outs = [torch.empty(N, device="cuda") for _ in range(ws)]
        dist.all_gather(outs, torch.from_numpy(mine).cuda())
        equal("all_gather list", torch.stack(outs), np.stack(every))
        b = torch.from_numpy(mine).cuda()
        dist.broadcast(b, src=ws - 1)
        equal("broadcast", b, every[ws - 1])
        # point to point (pipeline parallelism)
        p = torch.from_numpy(mine).cuda()
        if rank == 0:
            dist.send(p, 1)
        elif rank == 1:
            dist.recv(p, 0)
            equal("send/recv", p, every[0])
        if rank == 1:  # from any source, into a non-contiguous tensor
            q = torch.zeros(2, N, device="cuda").t()
            dist.recv(q, None)
            equal("recv from any source, non-contiguous", q, np.stack([every[0], every[0]], 1))
        elif rank == 0:
            dist.send(torch.from_numpy(np.stack([mine, mine], 1)).cuda(), 1)
        # rooted and list collectives
        r = torch.from_numpy(mine).cuda()
        dist.reduce(r, dst=0)
        if rank == 0:
            equal("reduce", r, total)
        g = [torch.empty(N, device="cuda") for _ in range(ws)] if rank == 0 else None
        dist.gather(torch.from_numpy(mine).cuda(), g, dst=0)
        if rank == 0:
            equal("gather", torch.stack(g), np.stack(every))
        sc = torch.empty(N, device="cuda")
        pieces = [torch.from_numpy(vals(q)).cuda() for q in range(ws)] if rank == 0 else None
        dist.scatter(sc, pieces, src=0)
        equal("scatter", sc, vals(rank))
        outs = [torch.empty(rank + 1, device="cuda") for _ in range(ws)]
        ins = [torch.full((q + 1,), float(10 * rank + q), device="cuda") for q in range(ws)]
        dist.all_to_all(outs, ins)
        equal("all_to_all lists", torch.cat(outs),
              np.concatenate([np.full(rank + 1, 10 * q + rank, np.float32) for q in range(ws)]))
        rs = torch.empty(N, device="cuda")
        dist.reduce_scatter(rs, [torch.from_numpy(vals(rank) + q).cuda() for q in range(ws)])
        equal("reduce_scatter lists", rs, np.sum([vals(q) + rank for q in range(ws)], axis=0))
        # synchronize() and wait(timeout) wait on the CPU
        y = torch.from_numpy(mine).cuda()
        w = dist.all_reduce(y, async_op=True)
        w.synchronize()
        count += 1
        if not w.is_completed():
            failures.append(f"rank {rank}: not completed after synchronize()")
        equal("synchronize", y, total)
        y.copy_(torch.from_numpy(mine))
        count += 1
        w = dist.all_reduce(y, async_op=True)
        if w.wait(timeout=datetime.timedelta(seconds=30)) is not True:
            failures.append(f"rank {rank}: wait(timeout) did not return True")
        equal("wait(timeout)", y, total)
        dist.barrier(device_ids=[0])
        # the future: CUDA-aware, completes with the outputs
        f = torch.from_numpy(mine).cuda()
        fut = dist.all_reduce(f, async_op=True).get_future()
        got = fut.then(lambda fu: fu.value()[0] * 2).wait()
        equal("get_future().then()", got, total * 2)
        # inside a CUDA graph capture: refused before anything moves
        g = torch.cuda.CUDAGraph()
        z = torch.from_numpy(mine).cuda()
        s = torch.cuda.Stream()
        refused = ""
        with torch.cuda.stream(s):
            try:
                with torch.cuda.graph(g, stream=s):
                    dist.all_reduce(z)
            except RuntimeError as exc:
                refused = str(exc)
        count += 1
        if "CUDA graph" not in refused:
            failures.append(f"rank {rank} graph capture: {refused!r}")
        torch.cuda.synchronize()
        equal("untouched by the refused call", z, mine)
    except Exception:
        failures.append(f"rank {rank} raised:\n{traceback.format_exc()}")
    torch.cuda.synchronize()
    return {"checks": count, "failures": failures}


KINDS = ("ddp", "ddp_fp16", "fsdp2")


def _train(dist: Any, ws: int, rank: int, kind: str) -> list[Any]:
    """A few steps of a small model on CUDA with DDP (kind "ddp" or "ddp_fp16": the fp16
    compression hook) or FSDP2 ("fsdp2"); the final parameters as numpy arrays."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 8)).cuda()
    if kind.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, bucket_cap_mb=0.01)
        if kind == "ddp_fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda", (ws,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(10 + rank)
    for _ in range(4):
        x = torch.randn(16, 64, generator=gen).cuda()
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params.append(full.detach().cpu().numpy())
    torch.cuda.synchronize()
    return params


def torch_body(rank: int, ws: int, store: str, backend: str, ops: bool) -> dict[str, Any]:
    """One launch (a process with torch and a CUDA context costs seconds): the operation
    checks (`ops`), then each kind of training; an exception ends the list."""
    dist = _init(backend, rank, ws, store)
    res: dict[str, Any] = {"checks": 0, "failures": [], "params": {}, "errors": {}}
    if ops:
        res.update(_ops(dist, rank, ws))
    for kind in KINDS:  # each kind on its own: one failing does not hide the others
        try:
            res["params"][kind] = _train(dist, ws, rank, kind)
        except Exception:
            res["errors"][kind] = f"rank {rank} {kind} raised:\n{traceback.format_exc()}"
            break  # the group's state is unknown from here
    dist.destroy_process_group()
    return res


def test_torch_on_cuda_matches_gloo(tmp_path):
    import warnings

    ours = run_spmd(torch_body, 2, str(tmp_path / "a"), "xcclc", True, init=False, timeout=100)
    ref = run_spmd(torch_body, 2, str(tmp_path / "b"), "gloo", False, init=False, timeout=100)
    failures = [f for r in ours for f in r["failures"]]
    failures += [e for r in ours for e in r["errors"].values()]
    assert all(r["checks"] > 25 for r in ours), [r["checks"] for r in ours]
    for kind in KINDS:
        if kind not in ours[0]["params"] or kind not in ours[1]["params"]:
            continue  # reported above
        for i, (a, b) in enumerate(zip(ours[0]["params"][kind], ours[1]["params"][kind],
                                       strict=True)):
            if not np.array_equal(a, b):
                failures.append(f"{kind}: the ranks' parameters differ (tensor {i})")
        if any(kind not in r["params"] for r in ref):
            # gloo could not run it on CUDA tensors: nothing to compare with, said so
            why = next(iter(r["errors"].get(kind, "") for r in ref if kind in r["errors"]), "")
            warnings.warn(f"{kind}: no gloo reference on CUDA ({why.splitlines()[-1:]})",
                          stacklevel=1)
            continue
        # 2 ranks: every sum is a + b on both backends, so the results agree up to the order
        # of AVG's division and the compression hook's casts
        rtol = 1e-3 if kind == "ddp_fp16" else 1e-6
        for rank in range(2):
            mine, theirs = ours[rank]["params"][kind], ref[rank]["params"][kind]
            for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                if not np.allclose(a, b, rtol=rtol, atol=rtol):
                    failures.append(f"{kind} rank {rank} tensor {i}: max |xcclc - gloo| "
                                    f"{float(np.abs(a - b).max()):.3g}")
    assert not failures, "\n".join(failures[:20])


def strings_body(rank: int, ws: int, store: str, backend: str) -> list[Any]:
    import torch

    dist = _init(backend, rank, ws, store)
    out = []
    for device in ("cuda", "cpu"):
        t = torch.full((7,), float(rank + 1), device=device)
        dist.all_reduce(t)
        out.append(t.cpu().tolist() == [float(sum(range(1, ws + 1)))] * 7)
    out.append(type(dist.group.WORLD).__name__)
    dist.destroy_process_group()
    return out


def test_backend_string_with_gloo_for_cpu(tmp_path):
    res = run_spmd(strings_body, 2, str(tmp_path / "s"), "cpu:gloo,cuda:xcclc", init=False,
                   timeout=60)
    assert res == [[True, True, "XcclProcessGroup"]] * 2, res


def killed_body(rank: int, ws: int, store: str) -> dict[str, Any]:
    """The last rank dies during DDP training on the GPU; the other gets torch's DistError
    with xccl's message naming it, and no GPU work keeps running."""
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist = _init("xcclc", rank, ws, store)
    model = DDP(torch.nn.Linear(1024, 1024).cuda())
    x = torch.randn(32, 1024, device="cuda")
    model(x).sum().backward()
    torch.cuda.synchronize()
    dist.barrier()
    if rank == ws - 1:
        os._exit(7)
    t0 = time.monotonic()
    error = None
    try:
        for _ in range(3):
            model(x).sum().backward()
            torch.cuda.synchronize()
    except Exception as exc:
        error = exc
    elapsed = time.monotonic() - t0
    torch.cuda.synchronize()  # hangs (the harness's timeout) if GPU work still waits
    return {"error": type(error).__name__ if error else None, "message": str(error),
            "seconds": elapsed}


def test_killed_rank_during_gpu_training(tmp_path):
    res = run_spmd(killed_body, 2, str(tmp_path / "store"), init=False, timeout=90,
                   expect_exit={1: 7})
    r0 = res[0]
    assert r0["error"] is not None and "rank 1" in r0["message"], r0
    assert r0["seconds"] < 60, r0
