"""Drop-in check: one torch.distributed script, run with ``import torch.distributed as dist``
(the gloo backend) and with ``import xccl as dist``, must give the same results."""

from __future__ import annotations

import pytest
from harness import run_spmd

torch = pytest.importorskip("torch")


def script(rank, size, store_path, which):
    """A small data-parallel training step and a tour of the API, as a torch user writes it."""
    import torch

    if which == "torch":
        import torch.distributed as dist
    else:
        import xccl as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=size)
    out = {"rank": dist.get_rank(), "size": dist.get_world_size()}

    # replicate the model from rank 0, then one manually averaged gradient step
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    torch.manual_seed(rank + 1)
    loss = model(torch.randn(16, 8)).pow(2).mean()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= size
    out["grads"] = [p.grad.clone() for p in model.parameters()]

    # asynchronous all_reduce with a chained future (the DDP comm-hook pattern)
    t = torch.arange(6, dtype=torch.float64) * (rank + 1)
    fut = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True).get_future()
    out["max"] = fut.then(lambda f: f.value()[0] * 2).wait()

    # gathers and scatters
    parts = [torch.zeros(3, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(parts, torch.full((3,), rank * rank, dtype=torch.int64))
    out["all_gather"] = parts
    flat = torch.zeros(size * 2)
    dist.all_gather_into_tensor(flat, torch.tensor([rank, -rank], dtype=torch.float32))
    out["all_gather_into_tensor"] = flat
    rs = torch.zeros(2)
    dist.reduce_scatter_tensor(rs, torch.arange(size * 2, dtype=torch.float32) + rank)
    out["reduce_scatter_tensor"] = rs
    rsl = torch.zeros(2, dtype=torch.int32)
    dist.reduce_scatter(rsl, [torch.full((2,), rank + j, dtype=torch.int32) for j in range(size)])
    out["reduce_scatter"] = rsl
    in_splits = [(rank + j) % 2 + 1 for j in range(size)]
    out_splits = [(i + rank) % 2 + 1 for i in range(size)]
    inp = torch.cat([torch.full((n, 2), float(rank * 10 + j)) for j, n in enumerate(in_splits)])
    a2a = torch.zeros(sum(out_splits), 2)
    dist.all_to_all_single(a2a, inp, out_splits, in_splits)
    out["all_to_all_single"] = a2a
    outs = [torch.zeros(1) for _ in range(size)]
    dist.all_to_all(outs, [torch.tensor([rank * 100.0 + j]) for j in range(size)])
    out["all_to_all"] = outs
    root = size - 1
    glist = [torch.zeros(2) for _ in range(size)] if rank == root else None
    dist.gather(torch.tensor([rank, 1.0]), glist, dst=root)
    out["gather"] = glist
    sc = torch.zeros(2)
    slist = [torch.tensor([9.0, r]) for r in range(size)] if rank == 0 else None
    dist.scatter(sc, slist, src=0)
    out["scatter"] = sc
    red = torch.tensor([rank + 1.0, 2.0])
    dist.reduce(red, dst=0, op=dist.ReduceOp.PRODUCT)
    out["reduce"] = red if rank == 0 else None

    # point to point around a ring
    if size > 1:
        got = torch.zeros(4)
        reqs = [
            dist.isend(torch.full((4,), float(rank)), (rank + 1) % size),
            dist.irecv(got, (rank - 1) % size),
        ]
        for r in reqs:
            r.wait()
        out["ring"] = got

    # objects and groups
    objs = [None] * size
    dist.all_gather_object(objs, {"rank": rank, "loss": round(float(loss), 3)})
    out["objects"] = objs
    box = ["x", None] if rank == 0 else [None, None]
    dist.broadcast_object_list(box, src=0)
    out["broadcast_object_list"] = box
    grp = dist.new_group(sorted({0, size - 1}))
    if rank in (0, size - 1):
        v = torch.tensor([float(rank)])
        dist.all_reduce(v, group=grp)
        out["group"] = (v, dist.get_rank(grp), dist.get_world_size(grp))
    else:
        out["group"] = (grp == dist.GroupMember.NON_GROUP_MEMBER, dist.get_rank(grp))
    dist.barrier()
    dist.destroy_process_group()
    return out


def _same(a, b, where="result"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        if a.is_floating_point():
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (where, a, b)
        else:
            assert torch.equal(a, b), (where, a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_same_script_same_results(world_size, tmp_path):
    want = run_spmd(script, world_size, str(tmp_path / "torch"), "torch", init=False, timeout=120)
    got = run_spmd(script, world_size, str(tmp_path / "xccl"), "xccl", init=False, timeout=120)
    for rank in range(world_size):
        _same(want[rank], got[rank], f"rank {rank}")
