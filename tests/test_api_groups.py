"""Process groups and DeviceMesh (python/xccl/_group.py, python/xccl/device_mesh.py)."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
from harness import run_spmd


def _sum_over(ranks):
    return float(sum(r + 1 for r in ranks))


def _allreduce_rank(dist, group):
    t = np.full(6, dist.get_rank() + 1, np.float64)
    dist.all_reduce(t, group=group)
    return float(t[0])


def body_new_group(rank, size):
    import xccl as dist

    members = [size - 1, 0]  # unsorted on purpose: new_group sorts by default
    g = dist.new_group(members)
    if rank in members:
        assert isinstance(g, dist.ProcessGroup)
        assert dist.get_process_group_ranks(g) == sorted(members)
        assert g.size() == 2 and dist.get_world_size(g) == 2
        assert dist.get_rank(g) == sorted(members).index(rank) == g.rank()
        assert dist.get_group_rank(g, rank) == g.rank()
        assert dist.get_global_rank(g, g.rank()) == rank
        with pytest.raises(ValueError):
            dist.get_group_rank(g, 1 if size > 2 else 99)
        assert _allreduce_rank(dist, g) == _sum_over(members)
        assert dist.get_backend(g) == dist.get_backend()
    else:
        assert g == dist.GroupMember.NON_GROUP_MEMBER
        assert dist.get_rank(g) == -1 and dist.get_world_size(g) == -1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert dist.all_reduce(np.zeros(2), group=g) is None
        assert any("does not belong to the given group" in str(w.message) for w in caught)

    # groups made in the same order by everyone; a second group with the same ranks is a
    # distinct group, and ranks=None gives a group of everyone.
    everyone = dist.new_group()
    assert everyone.size() == size and everyone is not dist.group.WORLD
    assert _allreduce_rank(dist, everyone) == _sum_over(range(size))
    again = dist.new_group(members)
    if rank in members:
        assert again is not g
        assert _allreduce_rank(dist, again) == _sum_over(members)

    # unsorted groups keep their order with sort_ranks=False
    order = list(reversed(range(size)))
    rev = dist.new_group(order, sort_ranks=False)
    assert rev.rank() == size - 1 - rank
    assert dist.get_global_rank(rev, 0) == size - 1
    t = np.full(3, rank, np.int64)
    dist.broadcast(t, group_src=0, group=rev)
    assert (t == size - 1).all()

    # use_local_synchronization: only members call it
    if rank % 2 == 0:
        local = dist.new_group(list(range(0, size, 2)), use_local_synchronization=True)
        assert _allreduce_rank(dist, local) == _sum_over(range(0, size, 2))

    # subgroups: consecutive blocks, then an enumeration
    if size % 2 == 0:
        cur, subs = dist.new_subgroups(group_size=2)
        assert len(subs) == size // 2
        block = [rank - rank % 2, rank - rank % 2 + 1]
        assert dist.get_process_group_ranks(cur) == block
        assert _allreduce_rank(dist, cur) == _sum_over(block)
    enum = [[r for r in range(size) if r % 3 == k] for k in range(min(size, 3))]
    cur, subs = dist.new_subgroups_by_enumeration(enum)
    mine = enum[rank % 3]
    assert dist.get_process_group_ranks(cur) == mine
    assert _allreduce_rank(dist, cur) == _sum_over(mine)
    with pytest.raises(ValueError):
        dist.new_subgroups_by_enumeration([[0, 1], [1, 2]])

    # split_group: ranks of the parent; processes in no split get None
    splits = [list(range(0, size // 2)), list(range(size // 2, size - 1))]
    splits = [s for s in splits if s]
    sg = dist.split_group(split_ranks=splits)
    mine = next((s for s in splits if rank in s), None)
    if mine is None:
        assert sg is None
    else:
        assert dist.get_process_group_ranks(sg) == mine
        assert _allreduce_rank(dist, sg) == _sum_over(mine)
        # split of a subgroup: parent ranks are subgroup ranks
        if len(mine) >= 2:
            inner = dist.split_group(sg, [[0, 1]])
            if sg.rank() in (0, 1):
                assert dist.get_process_group_ranks(inner) == mine[:2]
                assert _allreduce_rank(dist, inner) == _sum_over(mine[:2])
            else:
                assert inner is None

    # errors
    with pytest.raises(ValueError):
        dist.new_group([0, 0])
    with pytest.raises(ValueError):
        dist.new_group([size])
    with pytest.raises(ValueError):
        dist.new_subgroups(group_size=size + 1)
    with pytest.raises(ValueError):
        dist.split_group(split_ranks=[])

    # destroying a subgroup leaves the others usable; using it afterwards raises
    if rank in members:
        dist.destroy_process_group(g)
        dist.destroy_process_group(g)  # idempotent
        with pytest.raises(ValueError):
            dist.all_reduce(np.zeros(2), group=g)
        assert _allreduce_rank(dist, again) == _sum_over(members)
    dist.barrier()
    return dist.get_pg_count()


def body_concurrent_groups(rank, size):
    """Two overlapping groups per rank driven by two threads at the same time."""
    import xccl as dist

    halves = [list(range(size // 2)), list(range(size // 2, size))]
    parity = [list(range(0, size, 2)), list(range(1, size, 2))]
    h_cur, _ = dist.new_subgroups_by_enumeration(halves)
    p_cur, _ = dist.new_subgroups_by_enumeration(parity)
    results: dict[str, list[float]] = {"h": [], "p": []}
    errors: list[BaseException] = []

    def loop(key, grp, n):
        try:
            for k in range(n):
                t = np.full(257, float(rank + k), np.float64)
                if k % 3 == 0:
                    dist.all_reduce(t, group=grp, async_op=True).wait()
                else:
                    dist.all_reduce(t, group=grp)
                results[key].append(float(t[0]))
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [
        threading.Thread(target=loop, args=("h", h_cur, 40)),
        threading.Thread(target=loop, args=("p", p_cur, 40)),
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    h_ranks = halves[0] if rank in halves[0] else halves[1]
    p_ranks = parity[rank % 2]
    assert results["h"] == [float(sum(r + k for r in h_ranks)) for k in range(40)]
    assert results["p"] == [float(sum(r + k for r in p_ranks)) for k in range(40)]
    return True


def body_mesh_2x3(rank, size):
    import xccl as dist
    from xccl.device_mesh import DeviceMesh, init_device_mesh

    assert dist.init_device_mesh is init_device_mesh
    mesh = init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "tp"))
    assert isinstance(mesh, DeviceMesh)
    assert mesh.ndim == 2 and mesh.shape == (2, 3) and mesh.size() == 6
    assert mesh.size(0) == 2 and mesh.size("tp") == 3
    assert mesh.mesh_dim_names == ("dp", "tp") and mesh.device_type == "cpu"
    assert mesh.mesh.tolist() == [[0, 1, 2], [3, 4, 5]]
    row, col = divmod(rank, 3)
    assert mesh.get_coordinate() == [row, col]
    assert mesh.get_local_rank("dp") == row and mesh.get_local_rank(1) == col
    tp = mesh.get_group("tp")
    dp = mesh.get_group(0)
    assert dist.get_process_group_ranks(tp) == [3 * row + c for c in range(3)]
    assert dist.get_process_group_ranks(dp) == [col, 3 + col]
    assert mesh.get_all_groups() == [dp, tp]
    assert _allreduce_rank(dist, tp) == _sum_over(range(3 * row, 3 * row + 3))
    assert _allreduce_rank(dist, dp) == _sum_over([col, col + 3])
    sub = mesh["tp"]
    assert sub.ndim == 1 and sub.mesh.tolist() == [3 * row + c for c in range(3)]
    assert sub.get_group() is tp and sub.get_local_rank() == col
    both = mesh["dp", "tp"]
    assert both.shape == (2, 3) and both.get_group("dp") is dp
    with pytest.raises(RuntimeError):
        mesh.get_group()
    with pytest.raises(KeyError):
        mesh["pp"]
    assert "DeviceMesh('cpu'" in repr(mesh)
    return True


def body_mesh_2x2x2(rank, size):
    import xccl as dist

    mesh = dist.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    coord = [rank >> 2 & 1, rank >> 1 & 1, rank & 1]
    assert mesh.get_coordinate() == coord
    for dim, name in enumerate(("pp", "dp", "tp")):
        ranks = dist.get_process_group_ranks(mesh.get_group(name))
        stride = 4 >> dim
        base = rank - coord[dim] * stride
        assert ranks == [base, base + stride], (name, ranks)
        assert _allreduce_rank(dist, mesh.get_group(name)) == _sum_over(ranks)
    sub = mesh["pp", "tp"]
    assert sub.shape == (2, 2)
    want = [[(rank & 2) + 4 * i + j for j in range(2)] for i in range(2)]
    assert sub.mesh.tolist() == want
    assert sub.get_coordinate() == [coord[0], coord[2]]
    assert [dist.get_process_group_ranks(g) for g in sub.get_all_groups()] == [
        dist.get_process_group_ranks(mesh.get_group("pp")),
        dist.get_process_group_ranks(mesh.get_group("tp")),
    ]
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4, 6])
def test_new_group_and_friends(world_size):
    counts = run_spmd(body_new_group, world_size, timeout=120)
    assert all(c >= 2 for c in counts)


def test_concurrent_subgroups():
    assert run_spmd(body_concurrent_groups, 4, timeout=120) == [True] * 4


def test_device_mesh_2x3():
    assert run_spmd(body_mesh_2x3, 6, timeout=120) == [True] * 6


def test_device_mesh_2x2x2():
    assert run_spmd(body_mesh_2x2x2, 8, timeout=120) == [True] * 8
