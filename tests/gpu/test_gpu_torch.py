"""torch.distributed on xccl with CUDA tensors (the "xcclc" backend), 2 ranks sharing GPU 0:
every operation torch sends through a backend, checked against numpy; torch's NCCL stream
rules (a tensor written on the current stream just before the call, consumed on the current
stream after ``wait()`` with no other synchronisation); CUDA-aware futures; refusal inside a
CUDA graph capture; and the bodies of tests/torch_parity.py that the CPU tests run too (DDP
with no_sync, find_unused_parameters and the fp16/bf16 compression hooks, FSDP2 on a 1-D
and, with 4 ranks, a 2-D mesh, DTensor redistributions, tensor parallelism) on CUDA tensors,
compared with the same bodies on gloo (which stages CUDA tensors through the host) and with
a one-process reference. NCCL cannot be compared with here: it refuses two ranks on one GPU.

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
        # the coalesced forms: a coalescing manager (one allreduce_coalesced, and the
        # into_tensor/_tensor coalesced collectives FSDP2 issues), and batch_isend_irecv
        a = torch.from_numpy(mine).cuda()
        b = torch.from_numpy(mine[:7] * 2).cuda()
        with dist._coalescing_manager():
            dist.all_reduce(a)
            dist.all_reduce(b)
        equal("coalesced all_reduce, first", a, total)
        equal("coalesced all_reduce, second", b, total[:7] * 2)
        ag = [torch.empty(ws * N, device="cuda"), torch.empty(ws * 5, device="cuda")]
        rsc = [torch.empty(N, device="cuda"), torch.empty(5, device="cuda")]
        with dist._coalescing_manager():
            dist.all_gather_into_tensor(ag[0], torch.from_numpy(mine).cuda())
            dist.all_gather_into_tensor(ag[1], torch.from_numpy(mine[:5]).cuda())
        equal("coalesced all_gather_into_tensor", ag[0], np.concatenate(every))
        equal("coalesced all_gather_into_tensor, second", ag[1],
              np.concatenate([e[:5] for e in every]))
        with dist._coalescing_manager():
            dist.reduce_scatter_tensor(rsc[0], torch.from_numpy(np.tile(mine, ws)).cuda())
            dist.reduce_scatter_tensor(rsc[1], torch.from_numpy(np.tile(mine[:5], ws)).cuda())
        equal("coalesced reduce_scatter_tensor", rsc[0], total)
        equal("coalesced reduce_scatter_tensor, second", rsc[1], total[:5])
        nxt, prv = (rank + 1) % ws, (rank - 1) % ws
        ring = torch.zeros(N, device="cuda")
        ops = [dist.P2POp(dist.irecv, ring, prv),
               dist.P2POp(dist.isend, torch.from_numpy(mine).cuda(), nxt)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        equal("batch_isend_irecv ring", ring, every[prv])
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


def torch_body(rank: int, ws: int, store: str, kinds: tuple[str, ...],
               ops: bool) -> dict[str, Any]:
    """One launch (a process with torch and a CUDA context costs seconds) on xcclc's default
    group: the operation checks (`ops`), then `kinds` of tests/torch_parity.py on CUDA tensors,
    each on xcclc and on a gloo group in the same process, and their one-process references."""
    import torch_parity

    dist = _init("xcclc", rank, ws, store)
    res: dict[str, Any] = {"checks": 0, "failures": []}
    if ops:
        res.update(_ops(dist, rank, ws))
    res["parity"] = torch_parity.run_kinds(rank, ws, "cuda", kinds)
    dist.destroy_process_group()
    return res


def _check_parity(ranks: list[dict[str, Any]], kinds: tuple[str, ...]) -> list[str]:
    """torch_parity.compare on the ranks' results. A kind gloo cannot run on CUDA tensors is
    a warning (nothing to compare with there, said so), and is still checked against the
    one-process reference; its notes (the largest differences) are printed."""
    import warnings

    import torch_parity

    failures, notes = torch_parity.compare([r["parity"] for r in ranks], kinds, need_gloo=False)
    print("\n".join(notes))
    for note in notes:
        if "no gloo result" in note:
            warnings.warn(f"{note} (gloo on CUDA tensors)", stacklevel=1)
    return failures


def test_torch_on_cuda_matches_gloo(tmp_path):
    """The operation checks, then DDP (buckets, no_sync, find_unused_parameters, fp16 and bf16
    compression hooks), FSDP2 on a 1-D mesh, DTensor redistributions and tensor parallelism on
    CUDA: xcclc against gloo (bit-identical where tests/torch_parity.py says so) and against
    a one-process reference, 2 ranks on GPU 0."""
    import torch_parity

    kinds = torch_parity.KINDS_2
    ours = run_spmd(torch_body, 2, str(tmp_path / "a"), kinds, True, init=False, timeout=75)
    failures = [f for r in ours for f in r["failures"]]
    assert all(r["checks"] > 25 for r in ours), [r["checks"] for r in ours]
    failures += _check_parity(ours, kinds)
    assert not failures, "\n".join(failures[:20])


def test_hsdp_on_cuda_matches_gloo(tmp_path):
    """FSDP2 on init_device_mesh("cuda", (2, 2), ("replicate", "shard")): 4 ranks on GPU 0."""
    import torch_parity

    kinds = torch_parity.KINDS_4
    ours = run_spmd(torch_body, 4, str(tmp_path / "a"), kinds, False, init=False, timeout=45)
    failures = _check_parity(ours, kinds)
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
