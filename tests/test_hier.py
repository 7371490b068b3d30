"""Two-level algorithms over real transports: one machine split into "hosts" with
$XCCL_HOST_ID, so ranks of one host talk through shared memory and ranks of different hosts
through TCP. Results are compared with numpy; the algorithm the cost model picks is checked
(hier never runs on a group inside one host)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from harness import run_spmd


def _init(rank, world_size, store_path, hosts):
    os.environ["XCCL_HOST_ID"] = hosts[rank]
    import xccl

    xccl.init_process_group(
        "auto", init_method=f"file://{store_path}", rank=rank, world_size=world_size, timeout=30
    )
    return xccl


def body_hier(rank, world_size, store_path, hosts):
    xccl = _init(rank, world_size, store_path, hosts)
    out = {}
    # small all_reduce, algorithm left to the cost model (which one wins depends on the
    # transports' α and β; test_algo_hier.c checks the pricing with fixed models)
    x = np.arange(8, dtype=np.float64) + rank
    w = xccl.all_reduce(x, async_op=True)
    w.wait()
    out["auto_small"] = (w.algo, x.copy())
    for count in (1, 1000, 1 << 18):
        y = (np.arange(count) % 97 + rank).astype(np.float32)
        xccl.all_reduce(y, algo="hier")
        out[f"ar{count}"] = y[:50].copy(), float(y.sum(dtype=np.float64))
    # the bandwidth-optimal two-level all_reduce (hosts of unequal size fold their extra ranks
    # in); random floats must come out as the same bytes on every rank
    for count in (1, 1001, 1 << 18):
        y = np.random.default_rng(count + 7 * rank).standard_normal(count).astype(np.float32)
        xccl.all_reduce(y, algo="hier_rs")
        out[f"rs{count}"] = y.copy()
    # explain() for the group prices the two-level algorithms with both kinds of link and the
    # one-level ones with the group's model, as the selector does
    ex = xccl.explain("all_reduce", 1 << 26)
    flat = xccl.explain("all_reduce", 1 << 26, size=world_size, model=ex.model)
    out["explain"] = (
        {r["name"]: (r["predicted_s"], r["applicable"], r["chosen"]) for r in ex},
        {r["name"]: r["predicted_s"] for r in flat},
        ex.chosen["name"],
    )
    for root in range(world_size):
        z = np.full(513, -1.0) if rank != root else np.linspace(0, 1, 513) + root
        xccl.broadcast(z, src=root, algo="hier")
        out[f"bc{root}"] = z.copy()
    # a subgroup inside one host has one node: hier does not apply, a one-level algorithm runs
    same = [r for r in range(world_size) if hosts[r] == hosts[0]]
    g = xccl.new_group(same)
    if rank in same:
        v = np.ones(4)
        w = xccl.all_reduce(v, group=g, async_op=True)
        w.wait()
        out["one_host"] = (w.algo, v.copy())
    xccl.destroy_process_group()
    return out


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "b", "a", "b", "a"]])
def test_hier_over_shm_and_tcp(tmp_path, hosts):
    n = len(hosts)
    res = run_spmd(body_hier, n, str(tmp_path / "store"), hosts, init=False, timeout=90)
    ranks = np.arange(n)
    for rank, out in enumerate(res):
        algo, x = out["auto_small"]
        assert algo in ("hier", "direct", "rd", "ring", "rabenseifner", "owner"), (rank, algo)
        np.testing.assert_array_equal(x, np.arange(8) * n + ranks.sum())
        for count in (1, 1000, 1 << 18):
            head, total = out[f"ar{count}"]
            base = np.arange(count) % 97
            want = base * n + ranks.sum()
            np.testing.assert_array_equal(head, want[:50].astype(np.float32))
            assert total == float(want.sum()), (rank, count)
        for count in (1, 1001, 1 << 18):
            got = out[f"rs{count}"]
            want = sum(
                np.random.default_rng(count + 7 * r).standard_normal(count).astype(np.float64)
                for r in range(n)
            )
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * n)
            assert got.tobytes() == res[0][f"rs{count}"].tobytes(), (rank, count)
        grouped, flat, chosen = out["explain"]
        for name, (t, _, _) in grouped.items():
            if name in ("hier", "hier_rs"):
                assert t != flat[name], (name, t)  # inside and between hosts priced apart
            else:
                assert t == pytest.approx(flat[name], rel=1e-12), (name, t, flat[name])
        assert grouped["hier_rs"][1]
        assert [k for k, (_, _, c) in grouped.items() if c] == [chosen]
        for root in range(n):
            np.testing.assert_array_equal(out[f"bc{root}"], np.linspace(0, 1, 513) + root)
        if "one_host" in out:
            algo, v = out["one_host"]
            assert algo != "hier"
            np.testing.assert_array_equal(v, np.full(4, float(hosts.count(hosts[0]))))
