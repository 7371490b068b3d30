"""DDP and FSDP2 training on one GPU shared by 2 ranks: torch.distributed on xccl ("xcclc")
against gloo with the same CUDA tensors (gloo stages them through host memory), same script,
same run. NCCL refuses two ranks on one GPU, so it is not measured here.

    python benchmarks/ddp_gpu.py                    # both backends, DDP and FSDP2
    python benchmarks/ddp_gpu.py --steps 5 --out gpu-out/ddp

The model: 12 linear layers of 2048 x 2048 (50.4 M parameters, fp32), a batch of 64. Per
backend and mode: 3 warm-up steps, then ``--steps`` timed steps (forward, backward, SGD step;
the device synchronised before and after). "steps/s" is the timed steps over their time.
"exposed communication" is the time per step that communication adds to the critical path:
the step time minus that of the same steps without communication (DDP's ``no_sync()``; for
FSDP2 the same model unsharded on one rank, which runs no collective).

Writes ``ddp_gpu.json`` and ``ddp_gpu.md`` under ``--out`` (default ./gpu-out/ddp) and prints
the table. Each run has a timeout (``--timeout``); a run that fails or times out is reported
as such. Exit status: 0 all runs finished, 1 one did not, 2 no GPU.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from typing import Any

LAYERS, WIDTH, BATCH, WARMUP = 12, 2048, 64, 3


def _model(torch: Any) -> Any:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).cuda()


def _timed(torch: Any, model: Any, opt: Any, x: Any, steps: int, ctx: Any = None) -> float:
    """Seconds per step over `steps` steps after the warm-up; `ctx` wraps each step."""
    import contextlib

    def step() -> None:
        with ctx() if ctx is not None else contextlib.nullcontext():
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=False)
            loss.backward()
        opt.step()

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def _rank(rank: int, size: int, store: str, backend: str, mode: str, steps: int, q: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        import xccl.torch  # noqa: F401 - registers "xcclc"

        torch.cuda.set_device(0)
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=120),
        )
        model = _model(torch)
        x = torch.randn(BATCH, WIDTH, device="cuda", generator=None)
        if mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model)
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            t = _timed(torch, model, opt, x, steps)
            t_local = _timed(torch, model, opt, x, steps, model.no_sync)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            local = _model(torch)
            opt_local = torch.optim.SGD(local.parameters(), lr=1e-4)
            t_local = _timed(torch, local, opt_local, x, steps)
            del local, opt_local
            mesh = init_device_mesh("cuda", (size,))
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            t = _timed(torch, model, opt, x, steps)
            del mesh
        # nothing may hold the group at interpreter shutdown (examples/ddp_train.py says why)
        del model, opt
        gc.collect()
        dist.destroy_process_group()
        q.put((rank, {"step_s": t, "local_step_s": t_local}))
    except BaseException as exc:  # reported by the parent
        q.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def run(backend: str, mode: str, steps: int, timeout: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank, args=(r, 2, store, backend, mode, steps, q)) for r in range(2)
        ]
        for p in procs:
            p.start()
        results: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(results) < 2 and time.monotonic() < deadline:
            try:
                r, res = q.get(timeout=1.0)
                results[r] = res
            except Exception:
                if all(not p.is_alive() for p in procs) and q.empty():
                    break
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if len(results) < 2:
        return {
            "error": f"did not finish within {timeout:.0f} s"
            if time.monotonic() >= deadline
            else "a rank died"
        }
    errors = [res["error"] for res in results.values() if "error" in res]
    if errors:
        return {"error": errors[0]}
    step = max(res["step_s"] for res in results.values())
    local = max(res["local_step_s"] for res in results.values())
    return {
        "steps_per_s": 1.0 / step,
        "step_ms": step * 1e3,
        "local_step_ms": local * 1e3,
        "exposed_comm_ms": max(step - local, 0.0) * 1e3,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    ap.add_argument("--modes", default="ddp,fsdp2")
    ap.add_argument("--out", default=os.path.join("gpu-out", "ddp"))
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("ddp_gpu.py: no GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    facts = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "params": LAYERS * (WIDTH * WIDTH + WIDTH),
        "batch": BATCH,
        "steps": args.steps,
    }
    rows = []
    for mode in args.modes.split(","):
        for backend in ("xcclc", "gloo"):
            res = run(backend, mode, args.steps, args.timeout)
            rows.append({"mode": mode, "backend": backend, **res})
            print(json.dumps(rows[-1]), flush=True)
    lines = [
        f"# DDP / FSDP2 on one GPU, 2 ranks: {facts['gpu']}, torch {facts['torch']}, "
        f"{facts['params'] / 1e6:.1f} M parameters, batch {BATCH}, {args.steps} steps",
        "",
        "| mode | backend | steps/s | step (ms) | without communication (ms) | "
        "exposed communication (ms/step) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['backend']} | failed: {r['error']} | | | |")
        else:
            lines.append(
                f"| {r['mode']} | {r['backend']} | {r['steps_per_s']:.2f} | "
                f"{r['step_ms']:.1f} | {r['local_step_ms']:.1f} | "
                f"{r['exposed_comm_ms']:.1f} |"
            )
    for mode in args.modes.split(","):
        a = next((r for r in rows if r["mode"] == mode and r["backend"] == "xcclc"), {})
        b = next((r for r in rows if r["mode"] == mode and r["backend"] == "gloo"), {})
        if "steps_per_s" in a and "steps_per_s" in b:
            lines.append("")
            lines.append(
                f"# target {mode}: xcclc {a['steps_per_s'] / b['steps_per_s']:.1f}x "
                "gloo's steps/s (issue 17: at least 3x for DDP)"
            )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ddp_gpu.json"), "w") as f:
        json.dump({"facts": facts, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "ddp_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
