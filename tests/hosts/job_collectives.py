"""Job script (run by tests/hosts/run.sh in every rank): every collective and the P2P calls
across network-namespace hosts, each result compared with numpy.

Checks, on the world group and on subgroups that span hosts and that do not:
* the transport to every peer: shared memory inside a host, TCP between hosts;
* every collective with every algorithm the group can run (the engine's own list, from
  xccl.explain), and with the one the selector picks; all reduction operators;
* P2P: a ring through batch_isend_irecv, blocking pairs, receive from any source;
* the selector: a group spanning hosts gets a two-level (hier) algorithm where explain says
  so and runs what explain calls chosen; the selector never picks hier inside one host;
* DeviceMesh (equal hosts): one mesh row per host, dimension "local" inside a host (shared
  memory only), dimension "host" across hosts (TCP only).

Every rank prints one line ``XH-RESULT <json>`` that tests/hosts/test_hosts.py reads, and
raises (exit status 1) on the first wrong value.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import numpy as np

import xccl
from xccl import _group

COUNTS = (1, 1000, 1 << 16)  # elements per rank (float64)


def host_of(rank: int, per_host: list[int]) -> int:
    """The host index of global rank ``rank``."""
    acc = 0
    for h, n in enumerate(per_host):
        acc += n
        if rank < acc:
            return h
    raise ValueError(rank)


def data(rank: int, count: int, salt: int) -> np.ndarray:
    """Integer-valued float64 data, so that sums in any order are exact."""
    return ((np.arange(count, dtype=np.int64) * 7 + rank * 13 + salt) % 1009).astype(np.float64)


def eq(got: Any, want: Any, what: str) -> None:
    """Raises AssertionError naming ``what`` unless the arrays are equal."""
    g, w = np.asarray(got), np.asarray(want)
    if g.shape != w.shape or not np.array_equal(g, w):
        bad = np.flatnonzero(g.ravel() != w.ravel())[:3] if g.shape == w.shape else "shape"
        raise AssertionError(f"rank {xccl.get_rank()}: {what}: wrong result (at {bad})")


class Checker:
    """Runs and checks collectives on one group; counts the checks."""

    def __init__(self, group: Any, ranks: list[int], label: str) -> None:
        self.g = group
        self.ranks = ranks
        self.n = len(ranks)
        self.me = xccl.get_rank()
        self.label = label
        self.checks = 0
        self.algos: dict[str, list[str]] = {}

    def algorithms(self, coll: str, nbytes: int) -> list[Any]:
        """None (the selector's choice) plus every algorithm that applies to this group."""
        rows = xccl.explain(coll, nbytes, group=self.g)
        names = [r["name"] for r in rows if r["applicable"]]
        self.algos.setdefault(coll, sorted(set(self.algos.get(coll, [])) | set(names)))
        return [None, *names]

    def ok(self) -> None:
        self.checks += 1

    def run_all(self) -> None:
        for count in COUNTS:
            nb = count * 8
            for algo in self.algorithms("all_reduce", nb):
                self.all_reduce(count, algo)
            for algo in self.algorithms("broadcast", nb):
                self.broadcast(count, algo)
            for algo in self.algorithms("reduce", nb):
                self.reduce(count, algo)
            for algo in self.algorithms("all_gather", nb * self.n):
                self.all_gather(count, algo)
            for algo in self.algorithms("gather", nb * self.n):
                self.gather(count, algo)
            for algo in self.algorithms("scatter", nb * self.n):
                self.scatter(count, algo)
            for algo in self.algorithms("reduce_scatter", nb * self.n):
                self.reduce_scatter(count, algo)
            for algo in self.algorithms("all_to_all", nb * self.n):
                self.all_to_all(count, algo)
            # the list form and uneven splits run all_to_all_v (its own algorithms)
            for algo in self.algorithms("all_to_all_v", nb * self.n):
                self.all_to_all_list(count, algo)
                self.all_to_all_uneven(count, algo)
            self.p2p(count)
        for algo in self.algorithms("barrier", 0):
            xccl.barrier(group=self.g, algo=algo)
            self.ok()
        self.ops()

    def _w(self, algo: Any) -> dict[str, Any]:
        return {"group": self.g} if algo is None else {"group": self.g, "algo": algo}

    def all_reduce(self, count: int, algo: Any) -> None:
        x = data(self.me, count, 1)
        xccl.all_reduce(x, **self._w(algo))
        eq(x, sum(data(r, count, 1) for r in self.ranks), f"{self.label} all_reduce/{algo}")
        self.ok()

    def broadcast(self, count: int, algo: Any) -> None:
        for root in self.ranks:
            x = data(root, count, 2) if self.me == root else np.full(count, -1.0)
            xccl.broadcast(x, src=root, **self._w(algo))
            eq(x, data(root, count, 2), f"{self.label} broadcast/{algo} root {root}")
            self.ok()

    def reduce(self, count: int, algo: Any) -> None:
        for root in self.ranks:
            x = data(self.me, count, 3)
            xccl.reduce(x, dst=root, **self._w(algo))
            if self.me == root:
                eq(x, sum(data(r, count, 3) for r in self.ranks), f"{self.label} reduce/{algo}")
            self.ok()

    def all_gather(self, count: int, algo: Any) -> None:
        out = [np.zeros(count) for _ in self.ranks]
        xccl.all_gather(out, data(self.me, count, 4), **self._w(algo))
        eq(np.stack(out), np.stack([data(r, count, 4) for r in self.ranks]),
           f"{self.label} all_gather/{algo}")
        flat = np.zeros(count * self.n)
        xccl.all_gather_into_tensor(flat, data(self.me, count, 5), **self._w(algo))
        eq(flat, np.concatenate([data(r, count, 5) for r in self.ranks]),
           f"{self.label} all_gather_into_tensor/{algo}")
        self.ok()

    def gather(self, count: int, algo: Any) -> None:
        root = self.ranks[-1]
        out = [np.zeros(count) for _ in self.ranks] if self.me == root else None
        xccl.gather(data(self.me, count, 6), out, dst=root, **self._w(algo))
        if self.me == root:
            eq(np.stack(out), np.stack([data(r, count, 6) for r in self.ranks]),
               f"{self.label} gather/{algo}")
        self.ok()

    def scatter(self, count: int, algo: Any) -> None:
        root = self.ranks[0]
        chunks = [data(100 + i, count, 7) for i in range(self.n)] if self.me == root else None
        out = np.zeros(count)
        xccl.scatter(out, chunks, src=root, **self._w(algo))
        eq(out, data(100 + self.ranks.index(self.me), count, 7), f"{self.label} scatter/{algo}")
        self.ok()

    def reduce_scatter(self, count: int, algo: Any) -> None:
        gr = self.ranks.index(self.me)
        inputs = [data(self.me * 31 + i, count, 8) for i in range(self.n)]
        out = np.zeros(count)
        xccl.reduce_scatter(out, inputs, **self._w(algo))
        eq(out, sum(data(r * 31 + gr, count, 8) for r in self.ranks),
           f"{self.label} reduce_scatter/{algo}")
        flat = np.concatenate(inputs)
        out2 = np.zeros(count)
        xccl.reduce_scatter_tensor(out2, flat, **self._w(algo))
        eq(out2, out, f"{self.label} reduce_scatter_tensor/{algo}")
        self.ok()

    def all_to_all(self, count: int, algo: Any) -> None:
        gr = self.ranks.index(self.me)
        ins = [data(self.me * 37 + j, count, 9) for j in range(self.n)]
        out = np.zeros(count * self.n)
        xccl.all_to_all_single(out, np.concatenate(ins), **self._w(algo))
        eq(out, np.concatenate([data(r * 37 + gr, count, 9) for r in self.ranks]),
           f"{self.label} all_to_all_single/{algo}")
        self.ok()

    def all_to_all_list(self, count: int, algo: Any) -> None:
        gr = self.ranks.index(self.me)
        ins = [data(self.me * 43 + j, count, 14) for j in range(self.n)]
        outs = [np.zeros(count) for _ in range(self.n)]
        xccl.all_to_all(outs, ins, **self._w(algo))
        eq(np.stack(outs), np.stack([data(r * 43 + gr, count, 14) for r in self.ranks]),
           f"{self.label} all_to_all/{algo}")
        self.ok()

    def all_to_all_uneven(self, count: int, algo: Any) -> None:
        # rank i sends (i + j) % 3 * count + 1 elements to group rank j
        gr = self.ranks.index(self.me)

        def split(i: int, j: int) -> int:
            return (i + j) % 3 * count + 1

        ins = [data(self.me * 41 + j, split(gr, j), 10) for j in range(self.n)]
        rsplit = [split(i, gr) for i in range(self.n)]
        out = np.zeros(sum(rsplit))
        xccl.all_to_all_single(out, np.concatenate(ins), output_split_sizes=rsplit,
                               input_split_sizes=[len(a) for a in ins], **self._w(algo))
        want = np.concatenate([data(r * 41 + gr, split(i, gr), 10)
                               for i, r in enumerate(self.ranks)])
        eq(out, want, f"{self.label} all_to_all_single uneven/{algo}")
        self.ok()

    def p2p(self, count: int) -> None:
        gr = self.ranks.index(self.me)
        nxt, prv = self.ranks[(gr + 1) % self.n], self.ranks[(gr - 1) % self.n]
        if self.n > 1:
            send = data(self.me, count, 11)
            recv = np.zeros(count)
            ops = [xccl.P2POp(xccl.isend, send, nxt, group=self.g),
                   xccl.P2POp(xccl.irecv, recv, prv, group=self.g)]
            for w in xccl.batch_isend_irecv(ops):
                w.wait()
            eq(recv, data(prv, count, 11), f"{self.label} batch_isend_irecv ring")
            # blocking pairs (an odd last rank sits out), then a receive from any source
            pair = gr ^ 1
            if pair < self.n:
                peer = self.ranks[pair]
                buf = data(self.me, count, 12) if gr % 2 == 0 else np.zeros(count)
                if gr % 2 == 0:
                    xccl.send(buf, dst=peer, group=self.g)
                else:
                    xccl.recv(buf, src=peer, group=self.g)
                    eq(buf, data(peer, count, 12), f"{self.label} send/recv")
            if gr == 0:
                got = set()
                for _ in range(self.n - 1):
                    buf = np.zeros(count)
                    src = xccl.recv(buf, group=self.g)
                    eq(buf, data(src, count, 13), f"{self.label} recv(any) from {src}")
                    got.add(src)
                assert got == set(self.ranks[1:]), got
            else:
                xccl.send(data(self.me, count, 13), dst=self.ranks[0], group=self.g)
        self.ok()

    def ops(self) -> None:
        count = 257
        vals = [np.random.default_rng(r).integers(1, 5, count).astype(np.float64)
                for r in self.ranks]
        mine = vals[self.ranks.index(self.me)]
        for op, ref in ((xccl.ReduceOp.SUM, np.sum), (xccl.ReduceOp.PRODUCT, np.prod),
                        (xccl.ReduceOp.MIN, np.min), (xccl.ReduceOp.MAX, np.max)):
            x = mine.copy()
            xccl.all_reduce(x, op=op, group=self.g)
            eq(x, ref(np.stack(vals), axis=0), f"{self.label} all_reduce {op}")
        x = mine.copy()
        xccl.all_reduce(x, op=xccl.ReduceOp.AVG, group=self.g)
        if not np.allclose(x, np.mean(np.stack(vals), axis=0), rtol=1e-12):
            raise AssertionError(f"{self.label} all_reduce AVG")
        ints = [np.random.default_rng(50 + r).integers(0, 1 << 30, count) for r in self.ranks]
        for op, ref in ((xccl.ReduceOp.BAND, np.bitwise_and), (xccl.ReduceOp.BOR, np.bitwise_or),
                        (xccl.ReduceOp.BXOR, np.bitwise_xor)):
            x = ints[self.ranks.index(self.me)].copy()
            xccl.all_reduce(x, op=op, group=self.g)
            eq(x, ref.reduce(np.stack(ints), axis=0), f"{self.label} all_reduce {op}")
        f32 = [np.random.default_rng(70 + r).standard_normal(4099).astype(np.float32)
               for r in self.ranks]
        x = f32[self.ranks.index(self.me)].copy()
        xccl.all_reduce(x, group=self.g)
        if not np.allclose(x, np.sum(np.stack(f32).astype(np.float64), axis=0), atol=1e-4):
            raise AssertionError(f"{self.label} all_reduce float32")
        self.ok()


def transports(group: Any, ranks: list[int], per_host: list[int]) -> dict[str, str]:
    """Asserts shm inside a host and tcp between hosts; returns {peer: transport}."""
    comm = _group.resolve(group).comm
    me = xccl.get_rank()
    out = {}
    for gr, r in enumerate(ranks):
        tp = comm.peer_transport(gr)
        out[str(r)] = tp
        want = "self" if r == me else ("shm" if host_of(r, per_host) == host_of(me, per_host)
                                       else "tcp")
        if tp != want:
            raise AssertionError(f"rank {me}: transport to rank {r} is {tp}, expected {want}")
    return out


def selector(group: Any) -> dict[str, Any]:
    """explain's chosen algorithm for all_reduce and broadcast, checked against what runs."""
    out: dict[str, Any] = {}
    for coll, count in (("all_reduce", 8), ("all_reduce", 1000), ("all_reduce", 1 << 18),
                        ("broadcast", 1 << 18)):
        ex = xccl.explain(coll, count * 8, group=group)
        chosen = ex.chosen["name"]
        hier = sorted(r["name"] for r in ex if r["name"].startswith("hier") and r["applicable"])
        x = np.ones(count)
        fn = xccl.all_reduce if coll == "all_reduce" else xccl.broadcast
        kw = {"src": xccl.get_process_group_ranks(group)[0]} if coll == "broadcast" else {}
        w = fn(x, group=group, async_op=True, **kw)
        w.wait()
        if w.algo != chosen:
            raise AssertionError(f"{coll} {count}: ran {w.algo}, explain chose {chosen}")
        out[f"{coll}:{count}"] = {"chosen": chosen, "hier_applicable": hier}
    return out


def main() -> None:
    per_host = [int(x) for x in os.environ["XH_RANKS_PER_HOST"].split(",")]
    xccl.init_process_group("auto", timeout=120)
    me, world = xccl.get_rank(), xccl.get_world_size()
    assert world == sum(per_host), (world, per_host)
    assert int(os.environ["LOCAL_WORLD_SIZE"]) == per_host[host_of(me, per_host)]
    assert socket.gethostname() == f"host{host_of(me, per_host)}"
    result: dict[str, Any] = {"rank": me, "host": socket.gethostname()}
    everyone = list(range(world))
    result["transports"] = transports(None, everyone, per_host)
    result["selector_world"] = selector(None)

    world_chk = Checker(None, everyone, "world")
    world_chk.run_all()
    result["algos_world"] = world_chk.algos
    checks = world_chk.checks

    # subgroups: every host alone (inside one host), and one spanning hosts (first two ranks of
    # host 0 with the last rank of the last host); new_group is collective over the world
    starts = [sum(per_host[:h]) for h in range(len(per_host))]
    host_groups = [
        xccl.new_group(list(range(s, s + n))) for s, n in zip(starts, per_host, strict=True)
    ]
    span_ranks = sorted({0, min(1, per_host[0] - 1), world - 1})
    span = xccl.new_group(span_ranks)
    mine = host_of(me, per_host)
    hg_ranks = list(range(starts[mine], starts[mine] + per_host[mine]))
    hg = host_groups[mine]
    result["transports_host_group"] = transports(hg, hg_ranks, per_host)
    chk = Checker(hg, hg_ranks, f"host{mine} group")
    chk.run_all()
    checks += chk.checks
    # inside one host the two-level schedules degenerate to their in-node phases: the
    # selector never picks them there (selector() checks that what runs is what it picks)
    result["selector_host_group"] = sel = selector(hg)
    if any(v["chosen"].startswith("hier") for v in sel.values()):
        raise AssertionError(f"a two-level algorithm chosen inside one host: {sel}")
    if me in span_ranks:
        result["transports_span"] = transports(span, span_ranks, per_host)
        chk = Checker(span, span_ranks, "spanning group")
        chk.run_all()
        checks += chk.checks
        result["selector_span"] = selector(span)
        result["algos_span"] = chk.algos

    # DeviceMesh: one row per host (equal hosts only)
    if len(set(per_host)) == 1 and len(per_host) > 1:
        mesh = xccl.init_device_mesh("cpu", (len(per_host), per_host[0]),
                                     mesh_dim_names=("host", "local"))
        assert mesh.get_coordinate() == [mine, me - starts[mine]], mesh.get_coordinate()
        local, across = mesh.get_group("local"), mesh.get_group("host")
        local_ranks = xccl.get_process_group_ranks(local)
        across_ranks = xccl.get_process_group_ranks(across)
        assert local_ranks == hg_ranks, local_ranks
        assert across_ranks == [s + me - starts[mine] for s in starts], across_ranks
        tl = transports(local, local_ranks, per_host)
        ta = transports(across, across_ranks, per_host)
        assert set(tl.values()) <= {"self", "shm"} and set(ta.values()) <= {"self", "tcp"}
        for g, rk in ((local, local_ranks), (across, across_ranks)):
            x = data(me, 4097, 20)
            xccl.all_reduce(x, group=g)
            eq(x, sum(data(r, 4097, 20) for r in rk), "mesh all_reduce")
            checks += 1
        result["mesh"] = {"local": local_ranks, "host": across_ranks}
    result["checks"] = checks
    xccl.barrier()
    print("XH-RESULT " + json.dumps(result, sort_keys=True), flush=True)
    xccl.destroy_process_group()


if __name__ == "__main__":
    main()
