"""Drop-in checks and large messages.

1. A torch.distributed CPU script written the usual way (``torch.multiprocessing.spawn``,
   ``tcp://`` or ``env://`` init, gloo-style calls) prints the same results after changing only
   its import line to ``import xccl as dist``.
2. Collectives on 64 MiB buffers, checked against values computed with numpy.
"""

import socket
import subprocess
import sys

import numpy as np
import pytest
from harness import run_spmd

pytest.importorskip("torch")

SCRIPT = r"""
import os, sys
import torch
import torch.multiprocessing as mp
import torch.distributed as dist

def worker(rank, size, init):
    if init == "env":
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=size)
    else:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    t = torch.arange(6, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    g = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(g, torch.tensor([rank, rank * rank]))
    b = torch.tensor([float(rank)] * 3)
    dist.broadcast(b, src=size - 1)
    out = torch.zeros(size, dtype=torch.float64)
    dist.all_to_all_single(out, torch.arange(size, dtype=torch.float64) + 10 * rank)
    rs = torch.zeros(1)
    dist.reduce_scatter_tensor(rs, torch.arange(size, dtype=torch.float32) + rank)
    objs = [None] * size
    dist.all_gather_object(objs, {"rank": rank})
    if rank == 0:
        dist.send(torch.tensor([42.0]), dst=1)
    elif rank == 1:
        x = torch.zeros(1)
        dist.recv(x, src=0)
        os.write(1, f"recv {x.tolist()}\n".encode())  # one write: ranks share the pipe
    dist.barrier()
    line = f"{rank} {t.tolist()} {[x.tolist() for x in g]} {b.tolist()} {out.tolist()} "
    line += f"{rs.tolist()} {objs}\n"
    os.write(1, line.encode())
    dist.destroy_process_group()

if __name__ == "__main__":
    size, init = int(sys.argv[1]), sys.argv[2]
    if init == "env":
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = sys.argv[3]
    mp.spawn(worker, args=(size, init), nprocs=size, join=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, source: str, size: int, init: str) -> list[str]:
    path = tmp_path / "script.py"
    path.write_text(source)
    port = str(_free_port())
    if init == "tcp":
        init = f"tcp://127.0.0.1:{port}"
    proc = subprocess.run(
        [sys.executable, str(path), str(size), init, port],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return sorted(proc.stdout.splitlines())


@pytest.mark.parametrize("init", ["env", "tcp"])
def test_torch_script_runs_unchanged(tmp_path, init):
    size = 3
    with_torch = _run(tmp_path, SCRIPT, size, init)
    with_xccl = _run(
        tmp_path,
        SCRIPT.replace("import torch.distributed as dist", "import xccl as dist"),
        size,
        init,
    )
    assert len(with_torch) == size + 1  # one line per rank and the received value
    assert with_xccl == with_torch


BIG = 16 << 20  # float32 elements: 64 MiB


def body_large(rank, size):
    import xccl

    i = np.arange(BIG, dtype=np.float32) % 1024  # exact in float32 sums
    x = i + rank
    want = size * i + size * (size - 1) / 2
    out = {}
    for algo in ("ring", "rabenseifner"):
        y = x.copy()
        w = xccl.all_reduce(y, algo=algo, async_op=True)
        w.wait()
        out[algo] = bool(np.array_equal(y, want))
    blk = BIG // size
    rs = np.empty(blk, np.float32)
    xccl.reduce_scatter_tensor(rs, x[: blk * size].copy())
    out["reduce_scatter"] = bool(np.array_equal(rs, want[rank * blk : (rank + 1) * blk]))
    ag = np.empty(blk * size, np.float32)
    xccl.all_gather_into_tensor(ag, x[:blk].copy())
    exp = np.concatenate([i[:blk] + r for r in range(size)])
    out["all_gather"] = bool(np.array_equal(ag, exp))
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_collectives_on_64mib(size):
    for res in run_spmd(body_large, size, timeout=240, pg_timeout=200):
        assert all(res.values()), res
