"""Every collective and point-to-point operation with every peer over the RDMA transport
(``XCCL_TRANSPORTS=ibverbs``; see rdma_common), 2-4 ranks, 0 B to 64 MiB, integer and
floating types down to float16 and bfloat16, subgroups and a DeviceMesh; each result against
numpy. Sizes straddle the transport's eager/rendezvous boundary (8 KiB by default) and the
receive ring depth (many small messages in flight)."""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
import pytest
from harness import run_spmd
from rdma_common import env, needs_transport

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "hosts"))
from job_collectives import Checker, data, eq  # noqa: E402  (tests/hosts: one copy)

pytestmark = needs_transport

MiB = 1 << 20


def body_every_collective(rank, world_size):
    import xccl

    world = Checker(None, list(range(world_size)), "world")
    world.run_all()
    checks = world.checks
    # a subgroup of the first and the last rank (all ranks create it; two run it)
    ends = [0, world_size - 1]
    g = xccl.new_group(ends)
    if rank in ends:
        sub = Checker(g, ends, "subgroup")
        sub.run_all()
        checks += sub.checks
    return checks


@pytest.mark.timeout(900)  # pyproject's 180 s per test is short for emulation on a busy machine
@pytest.mark.parametrize("n", [2, 4])
def test_every_collective_and_algorithm(n):
    """Tests/hosts' checker: every collective with every algorithm that applies (and the
    selector's choice), all reduction operators, batch_isend_irecv, send/recv, receive from any
    source; on the world group and on a subgroup. (3 ranks: the other tests; this one is the
    suite's longest, about 30 s per size in the VM.)"""
    checks = run_spmd(body_every_collective, n, env=env(), timeout=900)
    assert min(checks) > 0


def body_all_reduce_sizes(rank, world_size, counts):
    import xccl

    for count in counts:
        x = data(rank, count, 1).astype(np.float32)  # integers below 2**24: exact sums
        xccl.all_reduce(x)
        eq(x, sum(data(r, count, 1) for r in range(world_size)).astype(np.float32),
           f"all_reduce of {count} float32")
    return True


@pytest.mark.parametrize(
    "n,counts",
    [
        # 0 B .. 64 MiB on 2 ranks, the eager limit's neighbours included
        (2, [0, 1, 2047, 2048, 2049, 1 << 16, (1 << 20) + 3, 16 * MiB]),
        (3, [0, 5, 4099, MiB + 1]),
        (4, [1, 2048, 65537, 2 * MiB]),
    ],
)
@pytest.mark.timeout(600)
def test_all_reduce_sizes(n, counts):
    assert run_spmd(body_all_reduce_sizes, n, counts, env=env(), timeout=600) == [True] * n


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values (exact in bfloat16) as bfloat16 bit patterns."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def body_dtypes(rank, world_size, count):
    from dlpack_producer import Producer, kDLBfloat

    import xccl

    everyone = range(world_size)
    out = {}
    for name in ("int8", "uint8", "int32", "int64", "float16", "float32", "float64"):
        dt = np.dtype(name)
        vals = [(data(r, count, 3) % 7).astype(dt) for r in everyone]  # small: exact sums
        for op, ref in ((xccl.ReduceOp.SUM, np.sum), (xccl.ReduceOp.MAX, np.max)):
            x = vals[rank].copy()
            xccl.all_reduce(x, op=op)
            eq(x, ref(np.stack(vals), axis=0).astype(dt), f"all_reduce {op} {name}")
        out[name] = True
    # bfloat16 (numpy has none): a DLPack tensor of bfloat16 bits
    vals = [(data(r, count, 4) % 7).astype(np.float32) for r in everyone]
    p = Producer(2 * count, (count,), (kDLBfloat, 16, 1))
    bits = _bf16_bits(vals[rank])
    ctypes.memmove(ctypes.addressof(p.buf), bits.ctypes.data, bits.nbytes)
    xccl.all_reduce(p)
    got = np.frombuffer(bytes(p.buf)[: 2 * count], np.uint16)
    eq(got, _bf16_bits(np.sum(np.stack(vals), axis=0)), "all_reduce bfloat16")
    out["bfloat16"] = True
    return out


@pytest.mark.parametrize("count", [3, 100003])
def test_dtypes(count):
    res = run_spmd(body_dtypes, 3, count, env=env(), timeout=600)
    assert all(len(r) == 8 for r in res), res


def body_p2p_sizes(rank, world_size, sizes):
    import xccl

    peer = 1 - rank
    for nbytes in sizes:
        mine = np.frombuffer(np.random.default_rng(nbytes + rank).bytes(nbytes), np.uint8)
        theirs = np.frombuffer(np.random.default_rng(nbytes + peer).bytes(nbytes), np.uint8)
        # blocking: 0 sends first, then 1 does
        got = np.zeros(nbytes, np.uint8)
        if rank == 0:
            xccl.send(mine, dst=1)
            assert xccl.recv(got, src=1) == 1
        else:
            assert xccl.recv(got, src=0) == 0
            xccl.send(mine, dst=0)
        eq(got, theirs, f"send/recv {nbytes} B")
        # both directions at once, the receive posted after the send
        got = np.zeros(nbytes, np.uint8)
        s = xccl.isend(mine, dst=peer, tag=7)
        r = xccl.irecv(got, src=peer, tag=7)
        s.wait()
        r.wait()
        eq(got, theirs, f"isend/irecv {nbytes} B")
        assert r.source_rank() == peer
        # receive from any source
        got = np.zeros(nbytes, np.uint8)
        if rank == 0:
            w = xccl.irecv(got, tag=9)
            w.wait()
            assert w.source_rank() == 1
            eq(got, theirs, f"irecv(any source) {nbytes} B")
        else:
            xccl.send(mine, dst=0, tag=9)
    return True


@pytest.mark.timeout(600)
def test_p2p_sizes():
    sizes = [0, 1, 8191, 8192, 8193, 65536 + 5, 4 * MiB + 1, 64 * MiB]
    assert run_spmd(body_p2p_sizes, 2, sizes, env=env(), timeout=600) == [True, True]


def body_many_in_flight(rank, world_size, count, nbytes):
    import xccl

    # rank 0 posts `count` sends before rank 1 posts a receive (more than the receive ring
    # holds: flow control must queue, not drop or overrun), then rank 1 takes them in reverse
    # tag order, so the matching has to hold every early message
    if rank == 0:
        bufs = [np.full(nbytes, i % 251, np.uint8) for i in range(count)]
        works = [xccl.isend(b, dst=1, tag=i) for i, b in enumerate(bufs)]
        xccl.barrier()
        for w in works:
            w.wait()
    else:
        xccl.barrier()
        for i in reversed(range(count)):
            got = np.zeros(nbytes, np.uint8)
            xccl.recv(got, src=0, tag=i)
            eq(got, np.full(nbytes, i % 251, np.uint8), f"message {i}")
    xccl.barrier()
    return True


@pytest.mark.parametrize("nbytes", [64, 100000])
def test_many_messages_in_flight(nbytes):
    assert run_spmd(body_many_in_flight, 2, 200, nbytes, env=env(), timeout=600) == [True] * 2


def body_large_collectives(rank, world_size, count):
    import xccl

    everyone = list(range(world_size))
    n = world_size
    x = data(rank, count, 5) if rank == 1 else np.zeros(count)
    xccl.broadcast(x, src=1)
    eq(x, data(1, count, 5), "broadcast")
    outs = [np.zeros(count) for _ in everyone]
    xccl.all_gather(outs, data(rank, count, 6))
    eq(np.stack(outs), np.stack([data(r, count, 6) for r in everyone]), "all_gather")
    out = np.zeros(count)
    xccl.reduce_scatter_tensor(out, np.concatenate([data(rank * n + j, count, 7)
                                                    for j in everyone]))
    eq(out, sum(data(r * n + rank, count, 7) for r in everyone), "reduce_scatter")
    out = np.zeros(count * n)
    xccl.all_to_all_single(out, np.concatenate([data(rank * n + j, count, 8) for j in everyone]))
    eq(out, np.concatenate([data(r * n + rank, count, 8) for r in everyone]), "all_to_all")
    # a DeviceMesh of 1 x n rows and its one dimension
    mesh = xccl.init_device_mesh("cpu", (1, n), mesh_dim_names=("a", "b"))
    g = mesh.get_group("b")
    y = data(rank, count, 9)
    xccl.all_reduce(y, group=g)
    eq(y, sum(data(r, count, 9) for r in everyone), "mesh all_reduce")
    return True


def test_large_collectives():
    """1 MiB of float64 per rank per collective, 3 ranks (rendezvous path for every step)."""
    assert run_spmd(body_large_collectives, 3, 1 << 17, env=env(), timeout=600) == [True] * 3
