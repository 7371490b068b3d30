"""Point-to-point operations and object collectives (python/xccl/_collectives.py,
python/xccl/_objects.py)."""

from __future__ import annotations

import numpy as np
import pytest
from harness import run_spmd

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


def body_p2p(rank, size):
    import xccl as dist

    nxt, prv = (rank + 1) % size, (rank - 1) % size

    # ring with isend/irecv
    out = np.full(100, rank, np.int64)
    got = np.zeros(100, np.int64)
    rw = dist.irecv(got, src=prv)
    sw = dist.isend(out, dst=nxt)
    sw.wait()
    rw.wait()
    assert (got == prv).all()
    assert rw.source_rank() == prv and rw.is_completed() and rw.is_success()

    # ring with blocking send/recv (even ranks send first)
    got = np.zeros(10, np.float32)
    if size > 1:
        if rank % 2 == 0:
            dist.send(np.full(10, rank, np.float32), dst=nxt)
            assert dist.recv(got, src=prv) == prv
        else:
            assert dist.recv(got, src=prv) == prv
            dist.send(np.full(10, rank, np.float32), dst=nxt)
        assert (got == prv).all()

    # blocking send/recv with a tag and ranks given as numpy integers (the one-call path
    # reads them as integers, as the general path does): rank 1 sends tag 3 then tag 4,
    # rank 0 receives tag 4 first
    if size > 1 and rank in (0, 1):
        if rank == 1:
            dist.send(np.full(2, 3, np.int64), dst=np.int64(0), tag=np.int64(3))
            dist.send(np.full(2, 4, np.int64), dst=np.int64(0), tag=np.int64(4))
        else:
            a, b = np.zeros(2, np.int64), np.zeros(2, np.int64)
            w = dist.irecv(a, src=1, tag=3)
            assert dist.recv(b, src=np.int64(1), tag=np.int64(4)) == 1
            w.wait()
            assert a.tolist() == [3, 3] and b.tolist() == [4, 4]

    # any-source receive (on its own tag, so that faster ranks' later messages do not
    # match): rank 0 hears from everyone (rank 1 twice), in whatever order
    if rank == 0 and size > 1:
        senders = []
        for _ in range(size - 1):
            buf = np.zeros(4, np.int64)
            src = dist.recv(buf, tag=5)
            assert (buf == src * 7).all()
            senders.append(src)
        buf = np.zeros(4, np.int64)
        work = dist.irecv(buf, tag=5)
        work.wait()
        assert (buf == work.source_rank() * 7).all()
        senders.append(work.source_rank())
        assert sorted(senders) == sorted([1, *range(1, size)])
    elif rank > 0:
        dist.send(np.full(4, rank * 7, np.int64), dst=0, tag=5)
        if rank == 1:
            dist.send(np.full(4, rank * 7, np.int64), dst=0, tag=5)

    # tags: the receiver posts tag 2 before tag 1; the sender sends 1 then 2
    if size > 1 and rank in (0, 1):
        if rank == 0:
            a = dist.isend(np.full(3, 1.0), dst=1, tag=1)
            b = dist.isend(np.full(3, 2.0), dst=1, tag=2)
            a.wait()
            b.wait()
        else:
            x2, x1 = np.zeros(3), np.zeros(3)
            w2 = dist.irecv(x2, src=0, tag=2)
            w1 = dist.irecv(x1, src=0, tag=1)
            w1.wait()
            w2.wait()
            assert (x1 == 1.0).all() and (x2 == 2.0).all()

    # to and from oneself with isend/irecv
    mine = np.zeros(5, np.int32)
    rw = dist.irecv(mine, src=rank, tag=9)
    dist.isend(np.full(5, 42, np.int32), dst=rank, tag=9).wait()
    rw.wait()
    assert (mine == 42).all()
    with pytest.raises(ValueError):
        dist.send(np.zeros(1), dst=rank)

    # batch_isend_irecv: both directions of the ring at once
    left, right = np.zeros(8), np.zeros(8)
    ops = [
        dist.P2POp(dist.isend, np.full(8, float(rank)), nxt),
        dist.P2POp(dist.isend, np.full(8, float(rank)), prv),
        dist.P2POp(dist.irecv, left, prv),
        dist.P2POp(dist.irecv, right, nxt),
    ]
    works = dist.batch_isend_irecv(ops)
    assert len(works) == 4
    for w in works:
        w.wait()
    assert (left == prv).all() and (right == nxt).all()
    with pytest.raises(ValueError):
        dist.P2POp(dist.all_reduce, np.zeros(1), 0)

    # torch tensors, a future on a receive, a subgroup with group ranks
    if torch is not None and size > 1:
        t = torch.zeros(6)
        w = dist.irecv(t, src=prv)
        fut = w.get_future()
        dist.isend(torch.arange(6.0) + rank, dst=nxt).wait()
        assert torch.equal(fut.wait()[0], torch.arange(6.0) + prv)
        w.wait()
        sub = dist.new_group([0, size - 1])
        if rank in (0, size - 1):
            me = sub.rank()
            t = torch.zeros(3)
            if me == 0:
                dist.send(torch.ones(3) * 5, group=sub, group_dst=1)
            else:
                assert dist.recv(t, group=sub, group_src=0) == 0
                assert torch.equal(t, torch.ones(3) * 5)
    dist.barrier()
    return True


def body_objects(rank, size, big_mb):
    import xccl as dist

    # broadcast_object_list from the last rank
    objs = [None, None, None]
    if rank == size - 1:
        objs = [{"a": 1, "rank": rank}, [1, 2, 3], "x" * 1000]
    dist.broadcast_object_list(objs, src=size - 1)
    assert objs == [{"a": 1, "rank": size - 1}, [1, 2, 3], "x" * 1000]

    # all_gather_object with very uneven sizes
    gathered = [None] * size
    dist.all_gather_object(gathered, ("r", rank, "y" * (rank * 3000)))
    assert gathered == [("r", r, "y" * (r * 3000)) for r in range(size)]

    # gather_object to rank 0 and to the middle rank
    for dst in sorted({0, size // 2}):
        out = [None] * size if rank == dst else None
        dist.gather_object({"from": rank, "pad": b"z" * rank}, out, dst=dst)
        if rank == dst:
            assert out == [{"from": r, "pad": b"z" * r} for r in range(size)]

    # scatter_object_list from rank 1 % size
    root = 1 % size
    out = [None]
    inputs = [{"to": r, "data": list(range(r))} for r in range(size)] if rank == root else None
    dist.scatter_object_list(out, inputs, src=root)
    assert out[0] == {"to": rank, "data": list(range(rank))}

    # send_object_list / recv_object_list around the ring, then to rank 0 from anyone
    if size > 1:
        nxt, prv = (rank + 1) % size, (rank - 1) % size
        box = [None, None]
        if rank % 2 == 0:
            dist.send_object_list([rank, {"k": rank}], dst=nxt)
            assert dist.recv_object_list(box, src=prv) == prv
        else:
            assert dist.recv_object_list(box, src=prv) == prv
            dist.send_object_list([rank, {"k": rank}], dst=nxt)
        assert box == [prv, {"k": prv}]
        if rank == 0:
            seen = set()
            for _ in range(size - 1):
                box = [None]
                src = dist.recv_object_list(box)
                assert box == [f"hello from {src}"]
                seen.add(src)
            assert seen == set(range(1, size))
        else:
            dist.send_object_list([f"hello from {rank}"], dst=0)

    # a big object through broadcast and all_gather
    big = np.arange(big_mb * (1 << 20) // 8, dtype=np.int64) + rank if big_mb else None
    holder = [big if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    if big_mb:
        assert np.array_equal(holder[0], np.arange(big_mb * (1 << 20) // 8) + 0)
        everything = [None] * size
        part = big.size // size  # rank r contributes (r + 1) / size of its array
        dist.all_gather_object(everything, big[: part * (rank + 1)])
        for r in range(size):
            assert np.array_equal(everything[r], np.arange(part * (r + 1)) + r)
    if torch is not None:
        holder = [torch.full((3,), float(rank))]
        dist.broadcast_object_list(holder, src=size - 1)
        assert torch.equal(holder[0], torch.full((3,), float(size - 1)))
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_p2p(world_size):
    assert run_spmd(body_p2p, world_size, timeout=120) == [True] * world_size


def test_p2p_five_ranks():
    assert run_spmd(body_p2p, 5, timeout=120) == [True] * 5


@pytest.mark.parametrize("world_size,big_mb", [(1, 1), (2, 24), (3, 4), (4, 0)])
def test_object_collectives(world_size, big_mb):
    assert run_spmd(body_objects, world_size, big_mb, timeout=120) == [True] * world_size
