"""Training and DTensor bodies shared by tests/test_torch_backend.py (CPU tensors) and
tests/gpu/test_gpu_torch.py (CUDA tensors, every rank on GPU 0): the same code runs on xccl's
torch backend ("xcclc") and on gloo, and its results are compared with each other and with a
reference computed in one process without any communication.

Inside one rank both backends run: the default group is xcclc; gloo gets its own groups
(``init_device_mesh(..., backend_override=...)``), so one launch yields both results. Every
result is a list of numpy arrays (parameters after training, or the local tensor of a
redistribution); :func:`compare` turns the ranks' results into a list of failures.

What runs (``KINDS_2`` on 2 ranks, ``KINDS_4`` on 4):

- ``ddp``: DistributedDataParallel, small buckets (3 all-reduces per step)
- ``ddp_no_sync``: gradient accumulation, 2 micro-batches per step, the first in ``no_sync()``
- ``ddp_unused``: ``find_unused_parameters=True``; a branch that one rank skips on some steps
  and every rank skips on another
- ``ddp_fp16``, ``ddp_bf16``: the fp16 and bf16 compression hooks (torch's default_hooks)
- ``fsdp2``: ``fully_shard`` on a 1-D mesh of every rank
- ``hsdp``: ``fully_shard`` on a 2-D mesh ``(replicate, shard) = (2, 2)`` (4 ranks)
- ``dtensor``: redistributions Shard(0)->Replicate (also uneven), Replicate->Shard(0),
  Shard(0)->Shard(1), Partial->Replicate, Partial->Shard(0)
- ``tp``: tensor parallelism (``parallelize_module``: column-wise then row-wise Linear), trained

Tolerances (:data:`TOLERANCES`), and why:

- xcclc against gloo, 2 ranks, no cast: every reduction is ``a + b`` (and an average of two
  is that sum halved, which is exact), so the results must be bit-identical. The same holds
  for the 2-D mesh: its reductions run over groups of 2.
- the compression hooks: each rank casts its gradients to fp16/bf16, halves them and the
  backend sums them in that type. Two correct roundings of a + b agree (on CPU they are
  bit-identical), but a backend may sum in fp32 and round, or sum in the type, or flush fp16
  subnormals (small gradients are subnormal in fp16), so a gradient may differ by an ulp of
  the half type: 2^-11 (fp16) or 2^-8 (bf16) of it. The gradients here are below 1, so
  after 4 steps of lr 0.05 a parameter may differ by up to 1e-4 (fp16) or 8e-4 (bf16):
  ``rtol = atol = 1e-4`` and ``1e-3``.
- against the one-process reference (per-rank gradients summed in rank order, then
  divided by the world size): on 2 ranks ``(a + b) / 2 == a / 2 + b / 2`` exactly and the
  gradients are computed by the same kernels (on CPU the results are bit-identical), but the
  reference takes another path through autograd (one model, gradients accumulated rank after
  rank) and on 4 ranks the sums are grouped differently, so ``rtol = 1e-5, atol = 1e-6``.
  With a compression hook the reference keeps fp32 where the hook rounds every gradient to
  the half type: ``2e-4`` (fp16) and ``2e-3`` (bf16). Tensor parallelism splits the matmuls'
  inner sums over the ranks, so its reference tolerance is the fp32 one.

Each training reference is checked to have moved some parameter by at least 10 times its
tolerance (and 1e-3), so that a run whose reductions did nothing (each rank's own gradients)
could not pass.
"""

from __future__ import annotations

import datetime
import traceback
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

IN, HIDDEN, OUT = 16, 64, 4
LOCAL_BATCH = 8  # samples per rank and micro-batch
STEPS = 4
LR = 0.05

DDP_KINDS = ("ddp", "ddp_no_sync", "ddp_unused", "ddp_fp16", "ddp_bf16")
KINDS_2 = DDP_KINDS + ("fsdp2", "dtensor", "tp")
KINDS_4 = ("hsdp",)
BACKENDS = ("xcclc", "gloo")
GROUP_TIMEOUT = datetime.timedelta(seconds=60)  # the default group's, and gloo's groups'

EXACT = (0.0, 0.0)
FP32 = (1e-5, 1e-6)
# kind -> ((rtol, atol) xcclc against gloo, (rtol, atol) against the one-process reference)
TOLERANCES: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    "ddp": (EXACT, FP32),
    "ddp_no_sync": (EXACT, FP32),
    "ddp_unused": (EXACT, FP32),
    "ddp_fp16": ((1e-4, 1e-4), (2e-4, 2e-4)),
    "ddp_bf16": ((1e-3, 1e-3), (2e-3, 2e-3)),
    "fsdp2": (EXACT, FP32),
    "hsdp": (EXACT, FP32),
    "dtensor": (EXACT, EXACT),  # data movement and sums of two: exact everywhere
    "tp": (EXACT, FP32),
}
MOVED = 1e-3  # the least a reference training must change some parameter by


def init(rank: int, ws: int, store: str, dev: str) -> None:
    """Joins torch's default group on xcclc (a file store); on CUDA every rank uses GPU 0."""
    import xccl.torch  # noqa: F401 - registers "xcclc"

    if dev == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("xcclc", init_method=f"file://{store}", rank=rank, world_size=ws,
                            timeout=GROUP_TIMEOUT)


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().cpu().float().numpy().copy()


# ---------------------------------------------------------------------------------- models


class Branchy(torch.nn.Module):
    """An MLP with an extra head that ``forward`` may skip (for ``find_unused_parameters``)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(IN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUT)
        self.extra = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        """The head's output, plus the extra head's when `use_extra`."""
        h = torch.relu(self.trunk(x))
        y = self.head(h)
        return y + self.extra(h) if use_extra else y


def make_model(dev: str) -> Branchy:
    """The same initial weights on every rank and backend."""
    torch.manual_seed(0)
    return Branchy().to(dev)


def micro_batches(kind: str) -> int:
    """Micro-batches per step: 2 with gradient accumulation (``no_sync``), else 1."""
    return 2 if kind == "ddp_no_sync" else 1


def uses_extra(kind: str, step: int, rank: int) -> bool:
    """Whether `rank` uses the extra head at `step`: for ``ddp_unused`` on 2 ranks, step 0
    rank 0 only, step 1 neither (unused everywhere), step 2 rank 1 only, step 3 rank 0."""
    return kind != "ddp_unused" or (step + rank) % 3 == 0


def data(step: int, micro: int, rank: int, dev: str) -> torch.Tensor:
    """Rank `rank`'s input for micro-batch `micro` of step `step` (any backend, any device)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(LOCAL_BATCH, IN, generator=g).to(dev)


def loss_of(model: Any, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
    """The training loss of one micro-batch."""
    return model(x, use_extra).square().mean()


def reference_train(kind: str, dev: str, ws: int) -> list[np.ndarray]:
    """Data-parallel SGD in one process, no communication: each step, every rank's gradient
    (its micro-batches accumulated) is computed in turn, summed in rank order (a parameter a
    rank did not use adds nothing) and divided by `ws`. The compression hooks' casts are not
    modelled (their tolerance covers them)."""
    model = make_model(dev)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    params = list(model.parameters())
    for step in range(STEPS):
        total = [torch.zeros_like(p) for p in params]
        for r in range(ws):
            model.zero_grad(set_to_none=True)
            for m in range(micro_batches(kind)):
                loss_of(model, data(step, m, r, dev), uses_extra(kind, step, r)).backward()
            for t, p in zip(total, params, strict=True):
                if p.grad is not None:
                    t += p.grad
        for t, p in zip(total, params, strict=True):
            p.grad = t / ws
        opt.step()
    return [_np(p) for p in params]


def initial_params(dev: str) -> list[np.ndarray]:
    """The parameters before training."""
    return [_np(p) for p in make_model(dev).parameters()]


# ---------------------------------------------------------------------------------- DDP


def bf16_compress(process_group, bucket):  # noqa: ANN001, ANN201 - see below
    """torch's ``default_hooks.bf16_compress_hook``, under another name: DDP refuses that
    hook by name where torch was built without CUDA and NCCL (CPU builds), whatever the
    backend; this is the same hook for DDP to call. No annotations: DDP checks a hook's
    against ``dist.GradBucket`` and ``Future``, and this module's are strings."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)


def _bf16_hook() -> Any:
    """torch's bf16 compression hook itself where DDP accepts it (torch with CUDA and NCCL,
    as on the GPU machine), else :func:`bf16_compress`."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    cuda_nccl = (torch.version.cuda is not None and dist.is_nccl_available()
                 and torch.cuda.nccl.version() >= (2, 10))
    return default_hooks.bf16_compress_hook if cuda_nccl else bf16_compress


def ddp_train(kind: str, group: Any, dev: str, rank: int) -> list[np.ndarray]:
    """`kind` (one of DDP_KINDS) on `group`; the final parameters."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    # 524-byte buckets: one bucket at the first step, 3 (3 all-reduces a step) once DDP has
    # rebuilt them in the order the gradients came
    model = DDP(make_model(dev), process_group=group, bucket_cap_mb=0.0005,
                find_unused_parameters=kind == "ddp_unused")
    if kind == "ddp_fp16":
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif kind == "ddp_bf16":
        model.register_comm_hook(group, _bf16_hook())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        n = micro_batches(kind)
        for m in range(n - 1):
            with model.no_sync():  # accumulated locally, reduced with the last micro-batch
                loss_of(model, data(step, m, rank, dev)).backward()
        loss_of(model, data(step, n - 1, rank, dev), uses_extra(kind, step, rank)).backward()
        opt.step()
    return [_np(p) for p in model.module.parameters()]


# ---------------------------------------------------------------------------------- FSDP2


def fsdp_train(mesh: Any, dev: str, rank: int) -> list[np.ndarray]:
    """FSDP2 (``fully_shard`` per Linear, then the root) on `mesh` (1-D: sharded over it;
    2-D ``(replicate, shard)``: HSDP); the final full parameters."""
    from torch.distributed.fsdp import fully_shard

    model = make_model(dev)
    for layer in (model.trunk, model.head, model.extra):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss_of(model, data(step, 0, rank, dev)).backward()
        opt.step()
    return [_np(p) for p in model.parameters()]


# ---------------------------------------------------------------------------------- DTensor


def _dtensor_inputs(ws: int, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A (2ws, 2ws) tensor and an uneven (2ws + 1, 3) one, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    return (torch.randn(2 * ws, 2 * ws, generator=g).to(dev),
            torch.randn(2 * ws + 1, 3, generator=g).to(dev))


def _partial_part(rank: int, ws: int, dev: str) -> torch.Tensor:
    return torch.randn(2 * ws, 3, generator=torch.Generator().manual_seed(50 + rank)).to(dev)


def dtensor_run(mesh: Any, dev: str, rank: int, ws: int) -> list[np.ndarray]:
    """The redistributions, each result's local tensor (see :func:`dtensor_expected`)."""
    from torch.distributed.tensor import (
        DTensor,
        Partial,
        Replicate,
        Shard,
        distribute_tensor,
    )

    x, uneven = _dtensor_inputs(ws, dev)
    s0 = distribute_tensor(x, mesh, [Shard(0)])
    out = [
        s0.to_local(),
        s0.redistribute(mesh, [Replicate()]).to_local(),  # all-gather
        DTensor.from_local(x, mesh, [Replicate()]).redistribute(mesh, [Shard(0)]).to_local(),
        s0.redistribute(mesh, [Shard(1)]).to_local(),  # all-to-all
        distribute_tensor(uneven, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local(),
    ]
    part = _partial_part(rank, ws, dev)
    out.append(DTensor.from_local(part, mesh, [Partial()])
               .redistribute(mesh, [Replicate()]).to_local())  # all-reduce
    out.append(DTensor.from_local(part, mesh, [Partial()])
               .redistribute(mesh, [Shard(0)]).to_local())  # reduce-scatter
    return [_np(t) for t in out]


def dtensor_expected(rank: int, ws: int) -> list[np.ndarray]:
    """What :func:`dtensor_run` must give on `rank`, computed here from the inputs alone
    (the partial sums in rank order: exact for 2 ranks in any order)."""
    x, uneven = (t.numpy() for t in _dtensor_inputs(ws, "cpu"))
    total = _partial_part(0, ws, "cpu").numpy().copy()
    for r in range(1, ws):
        total = total + _partial_part(r, ws, "cpu").numpy()
    return [np.array_split(x, ws, 0)[rank], x, np.array_split(x, ws, 0)[rank],
            np.array_split(x, ws, 1)[rank], uneven, total, np.array_split(total, ws, 0)[rank]]


# ---------------------------------------------------------------------------------- TP


def _tp_model(dev: str) -> torch.nn.Sequential:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, OUT)).to(dev)


def tp_train(mesh: Optional[Any], dev: str) -> list[np.ndarray]:
    """Column-wise then row-wise parallel Linear layers on `mesh` (None: the plain model in
    one process, the reference), trained on the same input everywhere; the final full
    parameters and the last output."""
    model = _tp_model(dev)
    if mesh is not None:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    y = torch.empty(0)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        y = model(data(step, 0, 0, dev))
        y.square().mean().backward()
        opt.step()
    return [_np(p) for p in model.parameters()] + [_np(y)]


# ---------------------------------------------------------------------------------- driver


def meshes(dev: str, ws: int, two_d: bool) -> dict[str, Any]:
    """backend -> device mesh: 1-D over every rank, or ``(replicate, shard) = (2, ws // 2)``.
    xcclc's is made from the default group, gloo's with ``backend_override``; each mesh's
    groups are checked to be of the backend it is named after."""
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = ((2, ws // 2), ("replicate", "shard")) if two_d else ((ws,), None)
    gloo = dist.ProcessGroupGloo._Options()
    gloo._timeout = GROUP_TIMEOUT  # new groups' default: 30 minutes
    out = {}
    for backend in BACKENDS:
        override = None if backend == "xcclc" else {i: ("gloo", gloo) for i in range(len(shape))}
        mesh = init_device_mesh(dev, shape, mesh_dim_names=names, backend_override=override)
        for d in range(len(shape)):
            got = dist.get_backend(mesh.get_group(d))
            if got != backend:
                raise RuntimeError(f"the {backend} mesh's dimension {d} runs on {got}")
        out[backend] = mesh
    return out


def run_kinds(rank: int, ws: int, dev: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    """Runs each of `kinds` on xcclc and on gloo in this rank (the default group must be
    xcclc's); rank 0 also computes the references. Returns ``{"results": {backend: {kind:
    arrays}}, "reference": {kind: arrays}, "initial": arrays, "errors": [text]}``. An error on
    xcclc ends the run (the group's state is unknown); one on gloo skips that kind there."""
    res: dict[str, Any] = {"results": {b: {} for b in BACKENDS}, "reference": {},
                           "initial": initial_params(dev), "errors": []}
    try:
        # each mesh makes groups on both backends: only those a kind here uses
        mesh = meshes(dev, ws, two_d=False) if any(k != "hsdp" for k in kinds) else None
        mesh2 = meshes(dev, ws, two_d=True) if "hsdp" in kinds else None
    except Exception:
        res["errors"].append(f"rank {rank} meshes:\n{traceback.format_exc()}")
        return res
    for kind in kinds:
        for backend in BACKENDS:
            try:
                if kind in DDP_KINDS:
                    got = ddp_train(kind, mesh[backend].get_group(), dev, rank)
                elif kind == "fsdp2":
                    got = fsdp_train(mesh[backend], dev, rank)
                elif kind == "hsdp":
                    got = fsdp_train(mesh2[backend], dev, rank)
                elif kind == "dtensor":
                    got = dtensor_run(mesh[backend], dev, rank, ws)
                elif kind == "tp":
                    got = tp_train(mesh[backend], dev)
                else:
                    raise ValueError(f"unknown kind {kind!r}")
                res["results"][backend][kind] = got
            except Exception:
                res["errors"].append(f"rank {rank} {kind} on {backend}:\n"
                                     f"{traceback.format_exc()}")
                if backend == "xcclc":
                    return res
        if rank == 0:
            if kind == "dtensor":
                res["reference"][kind] = None  # per rank: dtensor_expected
            elif kind == "tp":
                res["reference"][kind] = tp_train(None, dev)
            else:
                res["reference"][kind] = reference_train(kind, dev, ws)
    if dev == "cuda":
        torch.cuda.synchronize()
    return res


def body(rank: int, ws: int, store: str, dev: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    """One rank of a launch: joins xcclc's default group, runs `kinds` (see run_kinds)."""
    init(rank, ws, store, dev)
    res = run_kinds(rank, ws, dev, kinds)
    dist.destroy_process_group()
    return res


def _differs(a: np.ndarray, b: np.ndarray, tol: tuple[float, float]) -> Optional[str]:
    """None when `a` and `b` agree within `tol` (``(0, 0)``: bit-identical), else why not."""
    if a.shape != b.shape:
        return f"shapes {a.shape} and {b.shape}"
    rtol, atol = tol
    same = np.array_equal(a, b) if tol == EXACT else np.allclose(a, b, rtol=rtol, atol=atol)
    if same:
        return None
    return (f"max |difference| {float(np.abs(a - b).max()):.3g} "
            f"({'not bit-identical' if tol == EXACT else f'rtol {rtol:g}, atol {atol:g}'})")


def _compare_lists(what: str, a: list[np.ndarray], b: list[np.ndarray],
                   tol: tuple[float, float]) -> list[str]:
    if len(a) != len(b):
        return [f"{what}: {len(a)} tensors against {len(b)}"]
    out = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        why = _differs(x, y, tol)
        if why:
            out.append(f"{what}, tensor {i}: {why}")
    return out


def compare(ranks: list[dict[str, Any]], kinds: tuple[str, ...],
            need_gloo: bool = True) -> tuple[list[str], list[str]]:
    """The ranks' results (from run_kinds) -> (failures, notes). For each kind: every rank's
    xcclc result equals gloo's within TOLERANCES (bit-identical where that says so); the
    ranks agree with each other (replicated results: bit-identical); the result equals the
    one-process reference within its tolerance, and that reference moved the parameters.
    `need_gloo` False: a kind gloo could not run is a note, not a failure (gloo on CUDA
    tensors lacks some operations), and is still checked against the reference."""
    failures = [e for r in ranks for e in r["errors"]]
    notes: list[str] = []
    ws = len(ranks)
    init0 = ranks[0]["initial"]
    for kind in kinds:
        to_gloo, to_ref = TOLERANCES[kind]
        ours = [r["results"]["xcclc"].get(kind) for r in ranks]
        if any(o is None for o in ours):
            failures.append(f"{kind}: no xcclc result (see the errors)")
            continue
        theirs = [r["results"]["gloo"].get(kind) for r in ranks]
        if any(t is None for t in theirs):
            (failures if need_gloo else notes).append(f"{kind}: no gloo result to compare with")
        else:
            for rank in range(ws):
                failures += _compare_lists(f"{kind} rank {rank} xcclc against gloo", ours[rank],
                                           theirs[rank], to_gloo)
            diff = max(float(np.abs(a - b).max()) for a, b in zip(ours[0], theirs[0],
                                                                  strict=True))
            notes.append(f"{kind}: max |xcclc - gloo| on rank 0: {diff:.3g}")
        if kind == "dtensor":
            for rank in range(ws):
                failures += _compare_lists(f"{kind} rank {rank} against the expected values",
                                           ours[rank], dtensor_expected(rank, ws), to_ref)
            continue
        for rank in range(1, ws):  # replicated results
            failures += _compare_lists(f"{kind} xcclc rank {rank} against rank 0", ours[rank],
                                       ours[0], EXACT)
        ref = ranks[0]["reference"].get(kind)
        if ref is None:
            failures.append(f"{kind}: no reference")
            continue
        failures += _compare_lists(f"{kind} xcclc against the one-process reference", ours[0],
                                   ref, to_ref)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(ours[0], ref, strict=True))
        notes.append(f"{kind}: max |xcclc - reference|: {diff:.3g}")
        if kind != "tp":
            moved = max(float(np.abs(a - b).max()) for a, b in zip(ref, init0, strict=True))
            if moved < max(MOVED, 10 * to_ref[1]):
                failures.append(f"{kind}: the reference moved the parameters by {moved:.3g} "
                                "only: the check could not tell training from none")
    return failures, notes
