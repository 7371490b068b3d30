"""Job script: DistributedDataParallel on xccl's torch backend ("xcclc") across hosts.

Every rank starts from different random weights (DDP broadcasts rank 0's), trains a small
MLP on its shard of each global batch (SGD with momentum, small gradient buckets so several
all-reduces are in flight), and all ranks must end with identical parameters. Rank 0 then
trains the same model in one process on the whole batches and compares: the averaged
gradient of equal shards is the whole batch's gradient, so the parameters must agree to
rounding. Prints ``XH-DDP <json>`` on rank 0; raises on any mismatch."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import xccl.torch

IN, HIDDEN, OUT = 16, 64, 4
BATCH = 48  # global batch; divisible by the world sizes used (2, 4, 6, 8)
STEPS = 12


def make_model(seed: int) -> torch.nn.Module:
    """The MLP, initialised from ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT),
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, IN, generator=g)
    w = torch.linspace(-1, 1, IN * OUT).reshape(IN, OUT)
    return x, torch.sin(x @ w) + 0.01 * torch.randn(BATCH, OUT, generator=g)


def train(model: torch.nn.Module, rank: int, world: int) -> torch.Tensor:
    """STEPS of SGD on this rank's shards; returns the flat parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rank::world]), y[rank::world]).backward()
        opt.step()
    params = model.module.parameters() if isinstance(model, DDP) else model.parameters()
    return torch.cat([p.detach().reshape(-1) for p in params])


def main() -> None:
    dist.init_process_group(xccl.torch.BACKEND)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert BATCH % world == 0
    assert dist.get_backend() == xccl.torch.BACKEND, dist.get_backend()
    ddp = DDP(make_model(seed=rank), bucket_cap_mb=0.01)
    params = train(ddp, rank, world)
    everyone = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(everyone, params)
    for r, p in enumerate(everyone):
        if not torch.equal(p, params):
            raise AssertionError(f"rank {rank}: rank {r}'s parameters differ from mine")
    if rank == 0:
        ref = train(make_model(seed=0), 0, 1)
        err = (params - ref).abs().max().item()
        if not torch.allclose(params, ref, rtol=1e-5, atol=1e-6):
            raise AssertionError(f"DDP across hosts differs from one process: max |diff| {err}")
        print("XH-DDP " + json.dumps({"world": world, "steps": STEPS, "numel": params.numel(),
                                      "max_abs_diff": err}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
