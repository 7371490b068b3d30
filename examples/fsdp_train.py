"""FSDP2 on xccl's torch backend, checked against gloo: same model, same data, same result.

    python examples/fsdp_train.py                         # 2 ranks, xcclc then gloo
    python examples/fsdp_train.py --nproc 4 --mesh 2x2    # HSDP: 2 replicas of 2 shards
    python examples/fsdp_train.py --device cuda           # on GPUs (ranks share them)

For each backend the script starts ``--nproc`` processes (torch.multiprocessing.spawn),
which train a small MLP on synthetic regression data with FSDP2: every Linear layer, then
the whole model, is ``fully_shard``-ed over a device mesh made by ``init_device_mesh`` -
1-D over all ranks by default, or 2-D with ``--mesh RxS`` (R replicas of S shards,
dimensions ("replicate", "shard"): hybrid sharding, HSDP). FSDP2 does not broadcast the
initial weights, so every rank builds the model from the same seed; each rank draws its own
shard of each global batch, and SGD with momentum runs on the sharded parameters with the
averaged gradients (parameters all-gathered before each layer's forward and backward,
gradients reduce-scattered, and all-reduced across replicas on a 2-D mesh). Rank 0 saves
the final full parameters to ``<out-dir>/fsdp_<backend>.pt``. At the end the script
compares the backends' parameters and exits with status 1 if they are not allclose. With
``--device cuda`` the model and the data live on GPU ``rank % torch.cuda.device_count()``
(several ranks may share one GPU); gloo then stages the CUDA tensors through host memory.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import xccl.torch  # registers xccl's backend, here and in every spawned process

IN, HIDDEN, OUT = 16, 64, 4
BATCH = 32  # global batch, split over the ranks


def make_model() -> torch.nn.Sequential:
    """The MLP, the same on every rank (FSDP2 shards what each rank built)."""
    torch.manual_seed(0)
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


def parse_mesh(text: Optional[str], nproc: int) -> tuple[int, ...]:
    """``None`` -> ``(nproc,)``; ``"RxS"`` -> ``(R, S)``, which must multiply to `nproc`."""
    if not text:
        return (nproc,)
    try:
        shape = tuple(int(n) for n in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"--mesh {text!r}: expected RxS, e.g. 2x2")
    if shape[0] * shape[1] != nproc:
        raise ValueError(f"--mesh {text}: {shape[0] * shape[1]} ranks, but --nproc is {nproc}")
    return shape


def train(
    rank: int,
    world_size: int,
    backend: str,
    init_file: str,
    steps: int,
    out: str,
    device: str,
    shape: tuple[int, ...],
) -> None:
    """One rank: joins the group, shards and trains, saves (rank 0), checks the ranks agree."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh(dev.type, shape, mesh_dim_names=names)
    model = make_model().to(dev)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = (t.to(dev) for t in batch(step, rank, world_size))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    full = {k: v.full_tensor().detach() for k, v in model.state_dict().items()}  # collective
    params = torch.cat([v.reshape(-1) for v in full.values()])
    everyone = [torch.empty_like(params) for _ in range(world_size)]
    dist.all_gather(everyone, params)
    if not all(torch.equal(params, p) for p in everyone):
        raise RuntimeError(f"{backend}: the ranks' parameters differ after training")
    if rank == 0:
        torch.save({k: v.cpu().clone() for k, v in full.items()}, out)
        print(
            f"{backend}: {steps} steps on {world_size} ranks, mesh {shape}, "
            f"final loss {loss.item():.6f}",
            flush=True,
        )
    # drop what holds the group (FSDP's parameters and mesh) while the interpreter is alive: a
    # gloo group that outlives destroy_process_group until interpreter shutdown can abort the
    # process there ("terminate called without an active exception", about once in 20 runs)
    del model, opt, mesh
    gc.collect()
    dist.destroy_process_group()


def run(
    backend: str,
    nproc: int,
    steps: int,
    out_dir: str,
    device: str,
    shape: tuple[int, ...],
) -> str:
    """Trains on `nproc` spawned processes with `backend` on a mesh of `shape` (parse_mesh);
    returns the parameters' file."""
    out = os.path.join(out_dir, f"fsdp_{backend}.pt")
    with tempfile.TemporaryDirectory(prefix="fsdp-train-") as tmp:
        mp.spawn(
            train,
            args=(
                nproc,
                backend,
                os.path.join(tmp, "store"),
                steps,
                out,
                device,
                shape,
            ),
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
        "--mesh",
        default=None,
        help="RxS: a 2-D mesh of R replicas of S shards (HSDP), R*S = --nproc "
        "(default: 1-D, every rank a shard)",
    )
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
    try:
        shape = parse_mesh(args.mesh, args.nproc)
    except ValueError as exc:
        p.error(str(exc))
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="fsdp-train-")
    os.makedirs(out_dir, exist_ok=True)
    files = {
        b: run(b, args.nproc, args.steps, out_dir, args.device, shape)
        for b in (b.strip() for b in args.backends.split(","))
        if b
    }
    print(f"parameters saved in {out_dir}")
    return 0 if len(files) < 2 or compare(files) else 1


if __name__ == "__main__":
    sys.exit(main())
