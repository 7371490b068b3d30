"""The one-host algorithms (csrc/algo/shm.c "shm", shm_cma.c "cma") on real ranks: every
collective forced with ``algo=`` on 2, 3, 4 and 8 ranks (oversubscribed on small machines: sizes
stay small), checked against numpy; a subgroup; asynchronous collectives back to back; the
default selection on one host; ``XCCL_SHARED=0`` giving the message-based algorithms back."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from harness import run_spmd

# many chunks in the cma pipelines even for small vectors (every rank must see the same value)
ENV = {"XCCL_SHM_CHUNK_BYTES": "4096"}


def _vals(rank: int, count: int, dtype: Any, salt: int = 0) -> np.ndarray:
    """Rank `rank`'s input: random floats (rounding depends on the order) or small ints."""
    rng = np.random.default_rng(1000 * rank + salt)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(count).astype(dtype)
    return rng.integers(-50, 50, count).astype(dtype)


def _rank_order_sum(arrays: list[np.ndarray]) -> np.ndarray:
    """x0 + x1 + ... in rank order, element by element, in the arrays' dtype."""
    acc = arrays[0].copy()
    for a in arrays[1:]:
        acc = acc + a
    return acc


def _check_all(xccl: Any, rank: int, n: int, algo: str, count: int, group: Any = None,
               ranks: list[int] | None = None) -> list[str]:
    """Runs every collective with `algo` on `group` (the world when None) and returns the
    names of those that ran (raising AssertionError on a wrong result)."""
    ranks = list(range(n)) if ranks is None else ranks
    g = len(ranks)
    me = ranks.index(rank)
    ran = []
    kw = {"group": group, "algo": algo}

    # all_reduce: float64 sums in rank order are the same bits on every rank
    x = _vals(me, count, np.float64)
    w = xccl.all_reduce(x, async_op=True, **kw)
    w.wait()
    assert w.algo == algo, (w.algo, algo)
    want = _rank_order_sum([_vals(q, count, np.float64) for q in range(g)])
    assert np.array_equal(x, want), f"all_reduce/{algo} count={count}"
    y = _vals(me, count, np.int32)
    xccl.all_reduce(y, op=xccl.ReduceOp.MAX, **kw)
    assert np.array_equal(y, np.max([_vals(q, count, np.int32) for q in range(g)], axis=0))
    ran.append("all_reduce")

    # broadcast from the last member
    src = ranks[-1]
    b = _vals(me, count, np.float32, 1) if me == g - 1 else np.zeros(count, np.float32)
    xccl.broadcast(b, src=src, **kw)
    assert np.array_equal(b, _vals(g - 1, count, np.float32, 1)), f"broadcast/{algo}"
    ran.append("broadcast")

    # reduce to the second member
    dst = ranks[1 % g]
    r = _vals(me, count, np.float64, 2)
    xccl.reduce(r, dst=dst, **kw)
    if rank == dst:
        want = _rank_order_sum([_vals(q, count, np.float64, 2) for q in range(g)])
        assert np.array_equal(r, want), f"reduce/{algo}"
    ran.append("reduce")

    # all_gather and gather
    mine = _vals(me, count, np.int32, 3)
    out = np.zeros(g * count, np.int32)
    xccl.all_gather_into_tensor(out, mine, **kw)
    assert np.array_equal(out, np.concatenate([_vals(q, count, np.int32, 3) for q in range(g)]))
    ran.append("all_gather")
    glist = [np.zeros(count, np.int32) for _ in range(g)] if rank == ranks[0] else None
    xccl.gather(mine, glist, dst=ranks[0], **kw)
    if glist is not None:
        for q in range(g):
            assert np.array_equal(glist[q], _vals(q, count, np.int32, 3)), f"gather/{algo} {q}"
    ran.append("gather")

    # scatter from the last member
    slist = [_vals(q, count, np.float32, 4) for q in range(g)] if rank == src else None
    s = np.zeros(count, np.float32)
    xccl.scatter(s, slist, src=src, **kw)
    assert np.array_equal(s, _vals(me, count, np.float32, 4)), f"scatter/{algo}"
    ran.append("scatter")

    # reduce_scatter: block `me` of everybody's input, summed in rank order
    big = [_vals(q, g * count, np.float32, 5) for q in range(g)]
    rs = np.zeros(count, np.float32)
    xccl.reduce_scatter_tensor(rs, big[me].copy(), **kw)
    want = _rank_order_sum([b_[me * count:(me + 1) * count] for b_ in big])
    assert np.array_equal(rs, want), f"reduce_scatter/{algo}"
    ran.append("reduce_scatter")

    # all_to_all (equal blocks)
    a_in = _vals(me, g * count, np.int64, 6)
    a_out = np.zeros(g * count, np.int64)
    xccl.all_to_all_single(a_out, a_in, **kw)
    want = np.concatenate([_vals(q, g * count, np.int64, 6)[me * count:(me + 1) * count]
                           for q in range(g)])
    assert np.array_equal(a_out, want), f"all_to_all/{algo}"
    ran.append("all_to_all")

    # all_to_all_v (only "shm" exists): member q sends (q + p) % 3 * count // 2 + 1 to p
    if algo == "shm":
        def sz(q: int, p: int) -> int:
            return (q + p) % 3 * count // 2 + 1
        sin = [sz(me, p) for p in range(g)]
        sout = [sz(q, me) for q in range(g)]
        v_in = _vals(me, sum(sin), np.float32, 7)
        v_out = np.zeros(sum(sout), np.float32)
        xccl.all_to_all_single(v_out, v_in, sout, sin, **kw)
        parts = []
        for q in range(g):
            qin = _vals(q, sum(sz(q, p) for p in range(g)), np.float32, 7)
            off = sum(sz(q, p) for p in range(me))
            parts.append(qin[off:off + sz(q, me)])
        assert np.array_equal(v_out, np.concatenate(parts)), f"all_to_all_v/{algo}"
        ran.append("all_to_all_v")
        xccl.barrier(**kw)
        ran.append("barrier")
    return ran


def body_forced(rank: int, world_size: int) -> dict[str, list[str]]:
    import xccl

    out = {}
    for algo, counts in (("shm", (1, 7, 100)), ("cma", (0, 1, 1001, 20000))):
        for count in counts:
            out[f"{algo}{count}"] = _check_all(xccl, rank, world_size, algo, count)
    return out


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_forced_every_collective(n: int) -> None:
    """Every one-host algorithm forced, against numpy, on n ranks."""
    res = run_spmd(body_forced, n, env=ENV, timeout=240)
    for r in res:
        assert r["shm7"] == ["all_reduce", "broadcast", "reduce", "all_gather", "gather",
                             "scatter", "reduce_scatter", "all_to_all", "all_to_all_v", "barrier"]
        assert len(r["cma20000"]) == 8


def body_subgroup_async(rank: int, world_size: int) -> dict[str, Any]:
    import xccl

    out: dict[str, Any] = {}
    odd = [r for r in range(world_size) if r % 2 == 1]
    g = xccl.new_group(odd)
    if rank in odd:
        out["sub"] = _check_all(xccl, rank, world_size, "shm", 5, group=g, ranks=odd)
        out["sub_cma"] = _check_all(xccl, rank, world_size, "cma", 3000, group=g, ranks=odd)
    # async back to back, alternating algorithms (epochs reuse the slots), waited at the end
    works, bufs = [], []
    for k in range(12):
        algo = ("shm", "cma")[k % 2]
        count = 9 if algo == "shm" else 5000
        x = _vals(rank, count, np.float64, 100 + k)
        works.append(xccl.all_reduce(x, algo=algo, async_op=True))
        bufs.append((x, count, k))
        b = np.full(count, float(rank))
        works.append(xccl.broadcast(b, src=k % world_size, algo=algo, async_op=True))
        bufs.append((b, count, -1 - k))
    for w in works:
        w.wait()
    for x, count, k in bufs:
        if k >= 0:
            ins = [_vals(q, count, np.float64, 100 + k) for q in range(world_size)]
            want = _rank_order_sum(ins)
        else:
            want = np.full(count, float((-1 - k) % world_size))
        assert np.array_equal(x, want), f"async #{k}"
    # the default choice on one host from 8 ranks: slots for small calls, cross-memory reads
    # for large ones (all_reduce: the message-based rules); below 8 the message-based rules
    w1 = xccl.all_reduce(np.ones(4, np.float32), async_op=True)
    w1.wait()
    big = np.ones(1 << 16, np.float32)
    w2 = xccl.all_gather_into_tensor(np.zeros(world_size * (1 << 16), np.float32), big,
                                     async_op=True)
    w2.wait()
    w3 = xccl.all_reduce(big, async_op=True)
    w3.wait()
    out["default"] = (w1.algo, w2.algo, w3.algo)
    return out


@pytest.mark.parametrize("n", [4, 8])
def test_subgroup_async_default(n: int) -> None:
    """A subgroup, async collectives back to back, and the default selection."""
    for r in run_spmd(body_subgroup_async, n, env=ENV, timeout=240):
        if n >= 8:
            assert r["default"][:2] == ("shm", "cma"), r["default"]
        else:
            assert not set(r["default"]) & {"shm", "cma"}, r["default"]
        assert r["default"][2] not in ("shm", "cma")


def body_off(rank: int, world_size: int) -> tuple[str, str]:
    import xccl

    x = np.full(4, float(rank))
    w = xccl.all_reduce(x, async_op=True)
    w.wait()
    assert np.array_equal(x, np.full(4, float(sum(range(world_size)))))
    try:
        xccl.all_reduce(x, algo="shm")
    except Exception as e:  # noqa: BLE001 - the error's class is checked by its message
        return w.algo, str(e)
    return w.algo, ""


def test_shared_off() -> None:
    """XCCL_SHARED=0: the message-based algorithms, and forcing a one-host one is refused
    before any byte moves."""
    for algo, err in run_spmd(body_off, 3, env={"XCCL_SHARED": "0"}, timeout=120):
        assert algo not in ("shm", "cma")
        assert "'shm'" in err and "cannot run" in err, err
