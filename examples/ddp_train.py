"""DDP on xccl's torch backend, checked against gloo: same model, same data, same result.

    python examples/ddp_train.py                          # 2 ranks, xcclc then gloo
    python examples/ddp_train.py --nproc 4 --steps 20 --out-dir /tmp/ddp
    python examples/ddp_train.py --device cuda            # on GPUs (ranks share them)

For each backend the script starts ``--nproc`` processes (torch.multiprocessing.spawn),
which train a small MLP on synthetic regression data with DistributedDataParallel: every
rank starts from different random weights (DDP broadcasts rank 0's), draws its own shard of
each global batch, and SGD with momentum runs on the averaged gradients (several small
gradient buckets, so that several all-reduces are in flight at once). Rank 0 saves the
final parameters to ``<out-dir>/ddp_<backend>.pt``. At the end the script compares the
backends' parameters and exits with status 1 if they are not allclose. With ``--device
cuda`` the model and the data live on GPU ``rank % torch.cuda.device_count()`` (several
ranks may share one GPU); gloo then stages the CUDA tensors through host memory.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import xccl.torch  # registers xccl's backend, here and in every spawned process

IN, HIDDEN, OUT = 16, 64, 4
BATCH = 32  # global batch, split over the ranks


def make_model(seed: int) -> torch.nn.Module:
    """The MLP, initialised from `seed`."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT),
    )


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of global batch `step` (the same data for any backend)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, IN, generator=g)
    w = torch.linspace(-1, 1, IN * OUT).reshape(IN, OUT)
    y = torch.sin(x @ w) + 0.01 * torch.randn(BATCH, OUT, generator=g)
    return x[rank::world_size], y[rank::world_size]


def train(
    rank: int, world_size: int, backend: str, init_file: str, steps: int, out: str, device: str
) -> None:
    """One rank: joins the group, trains, saves (rank 0) and checks the ranks agree."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # before the group, as NCCL
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    # ~2.5k floats per bucket
    model = DDP(make_model(seed=rank).to(dev), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = (t.to(dev) for t in batch(step, rank, world_size))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    everyone = [torch.empty_like(params) for _ in range(world_size)]
    dist.all_gather(everyone, params)
    if not all(torch.equal(params, p) for p in everyone):
        raise RuntimeError(f"{backend}: the ranks' parameters differ after training")
    if rank == 0:
        torch.save({k: v.cpu().clone() for k, v in model.module.state_dict().items()}, out)
        print(
            f"{backend}: {steps} steps on {world_size} ranks, final loss {loss.item():.6f}",
            flush=True,
        )
    # drop what holds the group (DDP's reducer) while the interpreter is alive: a gloo group that
    # outlives destroy_process_group until interpreter shutdown can abort the process there
    # ("terminate called without an active exception", about once in 20 runs)
    del model, opt
    gc.collect()
    dist.destroy_process_group()


def run(backend: str, nproc: int, steps: int, out_dir: str, device: str = "cpu") -> str:
    """Trains on `nproc` spawned processes with `backend`; returns the parameters' file."""
    out = os.path.join(out_dir, f"ddp_{backend}.pt")
    with tempfile.TemporaryDirectory(prefix="ddp-train-") as tmp:
        mp.spawn(
            train,
            args=(nproc, backend, os.path.join(tmp, "store"), steps, out, device),
            nprocs=nproc,
            join=True,
        )
    return out


def compare(files: dict[str, str], rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """Prints the largest difference of each backend's parameters from the first one's;
    True when all are allclose."""
    names = list(files)
    ref = torch.load(files[names[0]])
    ok = True
    for name in names[1:]:
        other = torch.load(files[name])
        if other.keys() != ref.keys():
            print(f"{names[0]} vs {name}: different parameters -> DIFFERENT")
            ok = False
            continue
        diff = max((ref[k] - other[k]).abs().max().item() for k in ref)
        same = all(torch.allclose(ref[k], other[k], rtol=rtol, atol=atol) for k in ref)
        print(
            f"{names[0]} vs {name}: max |difference| {diff:.3g} -> "
            f"{'allclose' if same else 'DIFFERENT'}"
        )
        ok = ok and same
    return ok


def main() -> int:
    """Command line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks per run (default 2)")
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument(
        "--backends",
        default=f"{xccl.torch.BACKEND},gloo",
        help=f"comma-separated (default {xccl.torch.BACKEND},gloo)",
    )
    p.add_argument(
        "--out-dir", default=None, help="where the parameters go (default: a temporary directory)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default cpu")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU")
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="ddp-train-")
    os.makedirs(out_dir, exist_ok=True)
    files = {
        b: run(b, args.nproc, args.steps, out_dir, args.device)
        for b in (b.strip() for b in args.backends.split(","))
        if b
    }
    print(f"parameters saved in {out_dir}")
    return 0 if len(files) < 2 or compare(files) else 1


if __name__ == "__main__":
    sys.exit(main())
