"""Two "hosts" in one machine ($XCCL_HOST_ID): shared memory between the ranks of a host, the
RDMA transport between hosts (``XCCL_TRANSPORTS=shm,ibverbs``). Checks which transport each
peer gets, that the two-level (hier) algorithms run over that mix and give numpy's results,
and every collective with every algorithm that applies, on the world group, a subgroup that
spans the hosts, and a DeviceMesh with one row per host."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from harness import run_spmd
from rdma_common import TRANSPORT, needs_transport

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "hosts"))
from job_collectives import Checker, data, eq  # noqa: E402  (tests/hosts: one copy)

pytestmark = needs_transport


def _transports(group, ranks, hosts):
    """Asserts shm to a peer of the same host and TRANSPORT to the others."""
    import xccl
    from xccl import _group

    comm = _group.resolve(group).comm
    me = xccl.get_rank()
    for gr, r in enumerate(ranks):
        want = "self" if r == me else "shm" if hosts[r] == hosts[me] else TRANSPORT
        got = comm.peer_transport(gr)
        assert got == want, f"rank {me}: transport to rank {r} is {got}, expected {want}"


def body_two_hosts(rank, world_size, store_path, hosts):
    os.environ["XCCL_HOST_ID"] = hosts[rank]
    import xccl

    xccl.init_process_group("auto", init_method=f"file://{store_path}", rank=rank,
                            world_size=world_size, timeout=120)
    everyone = list(range(world_size))
    _transports(None, everyone, hosts)
    algos = {}
    # the two-level algorithms asked for by name, then the selector's choice (explain's)
    for count in (1, 1000, 1 << 18):
        for algo in ("hier", "hier_rs"):
            x = data(rank, count, 1)
            w = xccl.all_reduce(x, algo=algo, async_op=True)
            w.wait()
            assert w.algo == algo, (w.algo, algo)
            eq(x, sum(data(r, count, 1) for r in everyone), f"all_reduce/{algo} {count}")
        for root in everyone:
            y = data(root, count, 2) if rank == root else np.zeros(count)
            w = xccl.broadcast(y, src=root, algo="hier", async_op=True)
            w.wait()
            assert w.algo == "hier", w.algo
            eq(y, data(root, count, 2), f"broadcast/hier root {root}")
        chosen = xccl.explain("all_reduce", count * 8).chosen["name"]
        x = data(rank, count, 3)
        w = xccl.all_reduce(x, async_op=True)
        w.wait()
        assert w.algo == chosen, (count, w.algo, chosen)
        eq(x, sum(data(r, count, 3) for r in everyone), f"all_reduce/{chosen} {count}")
        algos[count] = chosen
    # every collective, every algorithm, on the world group; a group spanning the hosts
    chk = Checker(None, everyone, "world")
    chk.run_all()
    span = [0, world_size - 1]
    g = xccl.new_group(span)
    if rank in span:
        _transports(g, span, hosts)
        z = data(rank, 70001, 5)
        xccl.all_reduce(z, group=g)
        eq(z, sum(data(r, 70001, 5) for r in span), "spanning group all_reduce")
    # a DeviceMesh: one row per host ("local": shared memory only; "host": RDMA only)
    per_host = world_size // 2
    mesh = xccl.init_device_mesh("cpu", (2, per_host), mesh_dim_names=("host", "local"))
    local = rank % per_host
    want = {"local": [r for r in everyone if hosts[r] == hosts[rank]],
            "host": [r for r in everyone if r % per_host == local]}
    for dim in ("local", "host"):
        grp = mesh.get_group(dim)
        ranks = xccl.get_process_group_ranks(grp)
        assert ranks == want[dim], (dim, ranks, want[dim])
        _transports(grp, ranks, hosts)
        z = data(rank, 4097, 4)
        xccl.all_reduce(z, group=grp)
        eq(z, sum(data(r, 4097, 4) for r in ranks), f"mesh {dim} all_reduce")
    xccl.destroy_process_group()
    return algos, chk.algos


@pytest.mark.timeout(900)
def test_two_hosts(tmp_path):
    hosts = ["a", "a", "b", "b"]
    res = run_spmd(body_two_hosts, 4, str(tmp_path / "store"), hosts, init=False, timeout=900,
                   env={"XCCL_TRANSPORTS": f"shm,{TRANSPORT}"})
    chosen, checked = res[0]
    assert all(r == res[0] for r in res), res  # every rank chose and ran the same
    assert {"hier", "hier_rs"} <= set(checked["all_reduce"]), checked
