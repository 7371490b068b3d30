"""xccl quick start: every primitive once, each result checked against numpy.

Run it with the launcher (4 ranks on this machine)::

    xccl-run --nproc-per-node 4 examples/quickstart.py

Every rank checks its own results; rank 0 prints one line per primitive with the algorithm
that ran. The exit status is non-zero when any check fails on any rank (xccl-run then
reports which).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import numpy as np
import torch

import xccl as dist

failures = 0


def report(name: str, ok: bool, work: Optional[Any] = None, detail: str = "") -> None:
    """Prints, on rank 0, whether `name` gave the expected result on every rank."""
    global failures
    if not ok:
        failures += 1
        print(f"rank {dist.get_rank()}: {name} FAILED: {detail}", file=sys.stderr, flush=True)
    flag = np.array([1 if ok else 0], dtype=np.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # 1 only if every rank saw the right result
    if dist.get_rank() == 0:
        algo = f"[algo {work.algo}]" if work is not None else ""
        line = f"{name:<28} {'ok' if flag[0] == 1 and ok else 'FAIL'}  {algo}"
        print(line.rstrip(), flush=True)


def same(got: Any, want: Any) -> bool:
    return bool(np.array_equal(np.asarray(got), np.asarray(want)))


def check(name: str, got: Any, want: Any, work: Optional[Any] = None) -> None:
    """report() for one array result compared with its expected value."""
    g, w = np.asarray(got).ravel(), np.asarray(want).ravel()
    report(name, same(g, w), work, f"got {g[:8]}, expected {w[:8]}")


def point_to_point(rank: int, size: int) -> None:
    nxt, prv = (rank + 1) % size, (rank - 1) % size

    # A ring of numpy arrays: isend to the next rank, blocking recv from the previous one.
    x = np.arange(5, dtype=np.float64) + 100 * rank
    y = np.empty_like(x)
    w = dist.isend(x, dst=nxt)
    dist.recv(y, src=prv)
    w.wait()
    check("send/recv ring (numpy)", y, np.arange(5) + 100 * prv, w)

    # The same ring with torch tensors and blocking calls on both sides: even ranks send
    # first, odd ranks receive first, so no rank waits for itself.
    t = torch.full((3, 2), float(rank))
    u = torch.empty(3, 2)
    if rank % 2 == 0:
        dist.send(t, dst=nxt)
        dist.recv(u, src=prv)
    else:
        dist.recv(u, src=prv)
        dist.send(t, dst=nxt)
    check("send/recv ring (torch)", u, np.full((3, 2), prv))

    # Any-source receive: every rank but 0 sends its rank; rank 0 takes them in any order.
    if rank == 0:
        seen = {}
        for _ in range(size - 1):
            buf = torch.zeros(1, dtype=torch.int64)
            src = dist.recv(buf, tag=7)  # src=None: from any rank; returns the sender
            seen[src] = int(buf[0])
        ok = seen == {r: r for r in range(1, size)}
    else:
        dist.send(torch.tensor([rank], dtype=torch.int64), dst=0, tag=7)
        ok = True
    report("recv from any source", ok)

    # Asynchronous isend/irecv: both posted, then waited on.
    out = torch.arange(4, dtype=torch.int32) * (rank + 1)
    inp = torch.empty(4, dtype=torch.int32)
    works = [dist.irecv(inp, src=prv), dist.isend(out, dst=nxt)]
    for w in works:
        w.wait()
    ok = all(w.is_completed() for w in works) and same(inp, np.arange(4) * (prv + 1))
    report("isend/irecv + Work.wait", ok, works[0])


def collectives(rank: int, size: int) -> None:
    n = 6
    idx = np.arange(n)

    x = torch.arange(n, dtype=torch.float32) + rank
    w = dist.all_reduce(x, async_op=True)
    w.wait()
    check("all_reduce (torch, sum)", x, size * idx + size * (size - 1) / 2, w)

    a = np.full(n, rank, dtype=np.int64) * idx
    w = dist.all_reduce(a, op=dist.ReduceOp.MAX, async_op=True)
    w.wait()
    check("all_reduce (numpy, max)", a, (size - 1) * idx, w)

    root = size - 1
    b = torch.arange(n, dtype=torch.float64) * (7 if rank == root else 0)
    w = dist.broadcast(b, src=root, async_op=True)
    w.wait()
    check("broadcast", b, idx * 7, w)

    r = torch.full((n,), rank + 1, dtype=torch.int64)
    w = dist.reduce(r, dst=0, async_op=True)
    w.wait()
    want = np.full(n, size * (size + 1) // 2) if rank == 0 else np.full(n, rank + 1)
    check("reduce", r, want, w)

    mine = torch.full((2,), rank + 0.5)
    outs = [torch.empty(2) for _ in range(size)]
    w = dist.all_gather(outs, mine, async_op=True)
    w.wait()
    report("all_gather", all(same(o, [i + 0.5] * 2) for i, o in enumerate(outs)), w)

    flat = torch.empty(size * 3, dtype=torch.int32)
    w = dist.all_gather_into_tensor(flat, torch.full((3,), rank, dtype=torch.int32), async_op=True)
    w.wait()
    check("all_gather_into_tensor", flat, np.repeat(np.arange(size), 3), w)

    dst = 1 % size
    gl = [torch.empty(2) for _ in range(size)] if rank == dst else None
    w = dist.gather(torch.full((2,), float(rank * rank)), gather_list=gl, dst=dst, async_op=True)
    w.wait()
    ok = rank != dst or all(same(g, [i * i] * 2) for i, g in enumerate(gl))
    report("gather", ok, w)

    sl = [torch.arange(3, dtype=torch.int64) + 10 * i for i in range(size)] if rank == 0 else None
    s = torch.empty(3, dtype=torch.int64)
    w = dist.scatter(s, scatter_list=sl, src=0, async_op=True)
    w.wait()
    check("scatter", s, np.arange(3) + 10 * rank, w)

    # Block j of rank q's input holds q + 10*j; rank r gets the sum over q of block r.
    k = 4
    rin = torch.cat([torch.full((k,), float(rank + 10 * j)) for j in range(size)])
    rout = torch.empty(k)
    w = dist.reduce_scatter_tensor(rout, rin, async_op=True)
    w.wait()
    check("reduce_scatter_tensor", rout, [size * (size - 1) / 2 + 10 * rank * size] * k, w)

    # Uneven all-to-all: rank q sends rows(q, j) = (q + j) % 3 rows to rank j (some empty);
    # each row names (sender, receiver, index).
    def rows(q: int, j: int) -> int:
        return (q + j) % 3

    send_splits = [rows(rank, j) for j in range(size)]
    recv_splits = [rows(q, rank) for q in range(size)]
    src = torch.cat(
        [
            torch.tensor(
                [1000 * rank + 100 * j + i for i in range(rows(rank, j))], dtype=torch.int64
            )
            for j in range(size)
        ]
    )
    got = torch.empty(sum(recv_splits), dtype=torch.int64)
    w = dist.all_to_all_single(
        got, src, output_split_sizes=recv_splits, input_split_sizes=send_splits, async_op=True
    )
    w.wait()
    want = [1000 * q + 100 * rank + i for q in range(size) for i in range(rows(q, rank))]
    check("all_to_all_single (uneven)", got, want, w)

    w = dist.barrier(async_op=True)
    w.wait()
    report("barrier", w.is_completed(), w)


def object_collectives(rank: int, size: int) -> None:
    objs: list[Any] = [None] * size
    dist.all_gather_object(objs, {"rank": rank, "word": "x" * rank})
    report("all_gather_object", objs == [{"rank": i, "word": "x" * i} for i in range(size)])

    lst: list[Any] = [("config", 3.5), [1, 2, 3]] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    report("broadcast_object_list", lst == [("config", 3.5), [1, 2, 3]])

    dst = size - 1
    gathered: Optional[list[Any]] = [None] * size if rank == dst else None
    dist.gather_object({rank}, gathered, dst=dst)
    report("gather_object", rank != dst or gathered == [{i} for i in range(size)])

    out: list[Any] = [None]
    dist.scatter_object_list(out, [f"for {i}" for i in range(size)] if rank == 0 else None, src=0)
    report("scatter_object_list", out == [f"for {rank}"])


def main() -> int:
    # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and XCCL_AUTH_KEY) from xccl-run.
    dist.init_process_group("auto")
    rank, size = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank} of {size} (pid {os.getpid()}) ready", flush=True)
    dist.barrier()
    if size > 1:
        point_to_point(rank, size)
    collectives(rank, size)
    object_collectives(rank, size)
    total = np.array([failures], dtype=np.int64)
    dist.all_reduce(total)
    dist.destroy_process_group()
    if rank == 0:
        print("all checks passed" if total[0] == 0 else f"{total[0]} check(s) FAILED", flush=True)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
