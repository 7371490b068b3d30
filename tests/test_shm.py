"""The shared-memory transport as users meet it (backends/shm/shm.c through xccl's Python API):
concurrent jobs on one host, subgroups, more ranks than cores, a rank killed mid-collective or
mid-wire-up, and what is left in /dev/shm afterwards.

Every job checks ``comm.peer_transport(p) == "shm"`` for each peer, so a silent fall-back to
TCP fails the test. Results are compared with numpy on integer-valued data (exact sums).

Segment names are ``/dev/shm/xccl-<job id, 16 hex>-<rank>-<pid>``. A segment exists from the
transport's init until the end of wire-up, inside ``init_process_group``. ``_join`` watches
/dev/shm from a thread during init, while the last rank holds its address back for a moment,
so every rank sees its own segment appear: that proves the pattern the cleanup checks match
is the real one, and gives the job id, so that those checks look only at this job's names
(not at other test runs on the same host). The concurrent-jobs test joins through
``init_method="file://..."`` instead, as most users do; its check matches rank and pid.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
from harness import run_spmd

SHM_DIR = "/dev/shm"
SEG_RE = re.compile(r"xccl-([0-9a-f]{16})-(\d+)-(\d+)")
CMA_MIN = 64 << 10  # XCCL_SHM_CMA_MIN's default, pinned in ENV
ENV = {"XCCL_SHM_CMA_MIN": str(CMA_MIN)}
HOLD_S = 0.5  # how long the last rank holds its address back during wire-up

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")


# --------------------------------------------------------------------------- helpers (ranks)


def _own_segments(rank):
    """Names in /dev/shm of this process's segments as `rank` (any job)."""
    want = (str(rank), str(os.getpid()))
    out = []
    for name in os.listdir(SHM_DIR):
        m = SEG_RE.fullmatch(name)
        if m and m.group(2, 3) == want:
            out.append(name)
    return out


class _Watch:
    """Polls /dev/shm from a thread for this process's segment (as `rank`) while it runs."""

    def __init__(self, rank):
        self.rank = rank
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.seen.update(_own_segments(self.rank))
            time.sleep(0.001)

    def stop(self):
        self._stop.set()
        self._thread.join()
        return sorted(self.seen)


class _HoldingStore:
    """A store (torch's interface) over an xccl FileStore that can sleep, or run `hook`,
    when the transport addresses are published (keys ``.../addr/<rank>``)."""

    def __init__(self, inner, hold_s=0.0, hook=None):
        self.inner = inner
        self.hold_s = hold_s
        self.hook = hook  # hook(key, publish) publishes (or not) in its place

    def set(self, key, value):
        if "/addr/" in key:
            if self.hold_s:
                time.sleep(self.hold_s)
            if self.hook is not None:
                return self.hook(key, lambda: self.inner.set(key, value))
        return self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def add(self, key, amount):
        return self.inner.add(key, amount)

    def wait(self, keys, timeout=None):
        if timeout is None:
            return self.inner.wait(keys)
        return self.inner.wait(keys, timeout)

    def check(self, keys):
        return self.inner.check(keys)


def _check_shm(group=None):
    """Asserts that every peer of `group` (default: the world) is reached over shm."""
    import xccl

    pg = group if group is not None else xccl.group.WORLD
    me = pg.rank()
    got = [pg.comm.peer_transport(p) for p in range(pg.size())]
    want = ["self" if p == me else "shm" for p in range(pg.size())]
    assert got == want, f"rank {me}: peer transports {got}, expected {want}"


def _join(store_path, rank, world_size, timeout=30.0):
    """init_process_group("shm") through a FileStore at `store_path`, watching /dev/shm.

    Returns this rank's segment name. Asserts it appeared during init, is gone once init has
    returned, and that every peer is on shm."""
    import xccl

    watch = _Watch(rank)
    hold = HOLD_S if rank == world_size - 1 else 0.0
    store = _HoldingStore(xccl.FileStore(store_path, world_size), hold)
    try:
        xccl.init_process_group(
            "shm", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    finally:
        seen = watch.stop()
    assert len(seen) == 1, f"rank {rank}: segments seen during init: {seen}"
    left = _own_segments(rank)
    assert not left, f"rank {rank}: {left} still in /dev/shm after wire-up"
    _check_shm()
    return seen[0]


def _file_barrier(tmp, tag, rank, count):
    """Waits until `count` ranks have called this with the same directory and tag."""
    open(os.path.join(tmp, f"{tag}.{rank}"), "w").close()
    deadline = time.monotonic() + 30
    while sum(f.startswith(tag + ".") for f in os.listdir(tmp)) < count:
        assert time.monotonic() < deadline, f"{tag}: fewer than {count} ranks arrived"
        time.sleep(0.005)


def _job_of(name):
    return SEG_RE.fullmatch(name).group(1)


def _data(n, job, rank, step, dtype):
    """Integer-valued test data, different for every job, rank and step (sums stay exact)."""
    x = (np.arange(n, dtype=np.int64) * (3 + job) + 7 * rank + 11 * step + 1000 * job) % 4093
    return x.astype(dtype)


# --------------------------------------------------------------------------- helpers (parent)


def _leftovers(jobs=(), procs=()):
    """Names in /dev/shm of the given job ids, or of the given (rank, pid) pairs."""
    jobs = set(jobs)
    procs = {(str(r), str(p)) for r, p in procs}
    out = []
    for name in os.listdir(SHM_DIR):
        m = SEG_RE.fullmatch(name)
        if m and (m.group(1) in jobs or m.group(2, 3) in procs):
            out.append(name)
    return sorted(out)


# --------------------------------------------------------------------------- concurrent jobs

SIZES = [1 << 10, CMA_MIN - 4, CMA_MIN, 3 * CMA_MIN, 1 << 20]  # bytes


def body_concurrent(rank, world_size, tmp, rounds):
    import xccl

    per_job = world_size // 2
    job, lr = divmod(rank, per_job)
    dtype = (np.float32, np.int32)[job]
    # Separate jobs: separate stores (rank 0 of each hosts a TCP store on its own port).
    xccl.init_process_group(
        "shm",
        init_method=f"file://{tmp}/store{job}",
        rank=lr,
        world_size=per_job,
        timeout=60,
    )
    _check_shm()
    _file_barrier(tmp, "up", rank, world_size)  # both jobs are up: they overlap
    t0 = time.monotonic()
    for step in range(rounds):
        for nbytes in SIZES:
            n = nbytes // 4
            mine = [_data(n, job, r, step, dtype) for r in range(per_job)]

            x = mine[lr].copy()
            xccl.all_reduce(x)
            assert x.dtype == dtype
            np.testing.assert_array_equal(x, np.sum(mine, axis=0, dtype=np.int64).astype(dtype))

            outs = [np.zeros(n, dtype) for _ in range(per_job)]
            xccl.all_gather(outs, mine[lr])
            for r in range(per_job):
                np.testing.assert_array_equal(outs[r], mine[r])

            root = step % per_job
            b = mine[lr].copy()
            xccl.broadcast(b, src=root)
            np.testing.assert_array_equal(b, mine[root])
    t1 = time.monotonic()
    xccl.destroy_process_group()
    assert not _own_segments(lr)
    return job, lr, os.getpid(), t0, t1


def test_concurrent_jobs_no_crosstalk(tmp_path):
    """Two 3-rank jobs at once on one host; sizes on both sides of the CMA threshold."""
    res = run_spmd(
        body_concurrent, 6, str(tmp_path), 2, init=False, env=ENV, timeout=90, pg_timeout=60
    )
    assert sorted((job, lr) for job, lr, *_ in res) == [(j, r) for j in (0, 1) for r in range(3)]
    # they really ran at the same time
    spans = {job: (min(t0 for j, _, _, t0, _ in res if j == job),
                   max(t1 for j, _, _, _, t1 in res if j == job)) for job in (0, 1)}  # fmt: skip
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], spans
    assert _leftovers(procs=[(lr, pid) for _, lr, pid, _, _ in res]) == []


# --------------------------------------------------------------------------- subgroups


def body_subgroups(rank, world_size, store, rounds):
    import xccl

    seg = _join(store, rank, world_size)
    evens, odds = xccl.new_group([0, 2]), xccl.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    members = [0, 2] if rank % 2 == 0 else [1, 3]
    _check_shm(mine)
    n_sub, n_world = 3 * CMA_MIN // 4 + 5, 1000  # elements: a CMA-sized one, a small one
    for step in range(rounds):
        # the subgroup and the world in flight together; the two subgroups run at once
        a = _data(n_sub, 0, rank, step, np.float32)
        w = _data(n_world, 1, rank, step, np.int64)
        wa = xccl.all_reduce(a, group=mine, async_op=True)
        ww = xccl.all_reduce(w, async_op=True)
        wa.wait()
        ww.wait()
        want_a = sum(_data(n_sub, 0, r, step, np.int64) for r in members)
        np.testing.assert_array_equal(a, want_a.astype(np.float32))
        want_w = sum(_data(n_world, 1, r, step, np.int64) for r in range(world_size))
        np.testing.assert_array_equal(w, want_w)

        outs = [np.zeros(n_world, np.int64) for _ in members]
        xccl.all_gather(outs, _data(n_world, 2, rank, step, np.int64), group=mine)
        for i, r in enumerate(members):
            np.testing.assert_array_equal(outs[i], _data(n_world, 2, r, step, np.int64))

        root = step % world_size
        b = _data(n_sub, 3, rank, step, np.int32)
        xccl.broadcast(b, src=root)
        np.testing.assert_array_equal(b, _data(n_sub, 3, root, step, np.int32))

        sub_root = members[step % 2]
        c = _data(n_world, 4, rank, step, np.int32)
        xccl.broadcast(c, src=sub_root, group=mine)
        np.testing.assert_array_equal(c, _data(n_world, 4, sub_root, step, np.int32))
    xccl.destroy_process_group()
    assert not _own_segments(rank)
    return seg


def test_subgroups_and_world_interleaved(tmp_path):
    """4 ranks: [0, 2] and [1, 3] at the same time, with world operations in flight alongside
    (async) and interleaved."""
    segs = run_spmd(body_subgroups, 4, str(tmp_path / "store"), 10, init=False, env=ENV, timeout=60)
    jobs = {_job_of(s) for s in segs}
    assert len(jobs) == 1, segs
    assert _leftovers(jobs=jobs) == []


# --------------------------------------------------------------------------- oversubscription


def body_oversubscribed(rank, world_size, store, n_small, n_large):
    import xccl

    seg = _join(store, rank, world_size, timeout=90)
    for step in range(n_small):
        x = np.array([rank + 1, step, rank * step], np.int64)
        xccl.all_reduce(x)
        tri = world_size * (world_size + 1) // 2
        want = [tri, world_size * step, step * (tri - world_size)]
        assert x.tolist() == want, (step, x.tolist(), want)
    n = (4 << 20) // 4  # 4 MiB of float32
    for step in range(n_large):
        y = _data(n, 0, rank, step, np.float32)
        xccl.all_reduce(y)
        want = sum(_data(n, 0, r, step, np.int64) for r in range(world_size))
        np.testing.assert_array_equal(y, want.astype(np.float32))
    xccl.destroy_process_group()
    return seg


def test_oversubscribed_six_ranks(tmp_path):
    """6 ranks on a 2-core machine: correct results, no hang (speed is benchmarked elsewhere)."""
    segs = run_spmd(
        body_oversubscribed,
        6,
        str(tmp_path / "store"),
        300,
        4,
        init=False,
        env=ENV,
        timeout=150,
    )
    jobs = {_job_of(s) for s in segs}
    assert len(jobs) == 1, segs
    assert _leftovers(jobs=jobs) == []


def body_scarcity(rank, world_size, store, cpus):
    """Binds this rank to CPU cpus[rank], joins over shm, and returns the algorithm of a
    256 KiB all_reduce (its result checked against numpy)."""
    import xccl

    os.sched_setaffinity(0, {cpus[rank]})
    xccl.init_process_group(
        "shm", init_method=f"file://{store}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=30))
    x = np.full(65536, rank + 1, np.float32)
    w = xccl.all_reduce(x, async_op=True)
    w.wait()
    np.testing.assert_array_equal(x, np.full(65536, world_size * (world_size + 1) // 2))
    xccl.destroy_process_group()
    return w.algo


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_cpu_scarcity_is_a_fact_of_the_job(tmp_path):
    """Whether ranks outnumber their CPUs is computed from every rank's affinity mask, the
    same on every rank, and decides the measured rules (select.c): 2 ranks bound to one CPU
    run a 256 KiB all_reduce on shm with "owner"; bound to a CPU each, which a per-process
    count (2 local ranks, 1 CPU in my mask) would also call scarce, they do not."""
    # the message-based rules: without the node-shared segment (XCCL_SHARED=0)
    off = {"XCCL_SHARED": "0"}
    one_cpu = run_spmd(body_scarcity, 2, str(tmp_path / "a"), [0, 0], init=False, timeout=60,
                       env=off)
    assert one_cpu == ["owner", "owner"]
    two_cpus = run_spmd(body_scarcity, 2, str(tmp_path / "b"), [0, 1], init=False, timeout=60,
                        env=off)
    assert two_cpus[0] == two_cpus[1] != "owner"


# --------------------------------------------------------------------------- killed ranks


def body_killed_mid_all_reduce(rank, world_size, store, report):
    import xccl

    seg = _join(store, rank, world_size, timeout=20)
    victim = world_size - 1
    with open(report, "a") as f:  # the parent learns the job even though the victim dies
        f.write(seg + "\n")
    n = (4 << 20) // 4  # 4 MiB: CMA between every pair
    started = threading.Event()
    if rank == victim:

        def kill_soon():
            started.wait()
            time.sleep(0.003)  # inside step 3's all_reduce (4 MiB over 4 ranks: >10 ms here)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill_soon, daemon=True).start()
    done = 0
    t_fail = time.monotonic()
    try:
        for step in range(10_000):
            y = _data(n, 0, rank, step, np.float32)
            if step == 3:
                started.set()
            xccl.all_reduce(y)
            want = sum(_data(n, 0, r, step, np.int64) for r in range(world_size))
            np.testing.assert_array_equal(y, want.astype(np.float32))
            done += 1
            t_fail = time.monotonic()
        raise AssertionError("the victim never died")
    except xccl.XcclError as e:
        waited = time.monotonic() - t_fail
        # Stay until every survivor has its error: one that exits first would be a second
        # dead peer for those still waiting.
        _file_barrier(os.path.dirname(report), "failed", rank, world_size - 1)
        return done, str(e), type(e).__name__, waited


def test_killed_rank_mid_cma_all_reduce(tmp_path):
    """4 ranks; the last is SIGKILLed inside a 4 MiB all_reduce. Extends
    test_failures.py::test_killed_peer_is_named (3 ranks, os._exit between small ones)."""
    n = 4
    report = tmp_path / "segments"
    res = run_spmd(
        body_killed_mid_all_reduce,
        n,
        str(tmp_path / "store"),
        str(report),
        init=False,
        env=ENV,
        timeout=60,
        expect_exit={n - 1: -signal.SIGKILL},
    )
    for rank, (done, msg, kind, waited) in enumerate(res[:-1]):
        assert done >= 3, (rank, done)
        assert kind in ("XcclConnectionError", "XcclError"), (rank, kind, msg)
        assert waited < 10, (rank, waited, msg)
        # every survivor names the dead rank, also one whose own failure came from another
        # survivor giving up on the operation
        assert f"rank {n - 1}" in msg, (rank, msg)
    segs = report.read_text().split()
    assert len(segs) == n and len({_job_of(s) for s in segs}) == 1, segs
    assert _leftovers(jobs={_job_of(segs[0])}) == []


def body_killed_in_wire_up(rank, world_size, tmp, victim):
    """`victim` publishes its address, then dies before anyone maps its segment."""
    import xccl

    watch = _Watch(rank)

    def die_after_publishing(key, publish):
        publish()
        os.kill(os.getpid(), signal.SIGKILL)

    hold = HOLD_S if rank != victim else 0.0  # the others map late: the victim is gone by then
    store_obj = _HoldingStore(
        xccl.FileStore(os.path.join(tmp, "store"), world_size),
        hold,
        die_after_publishing if rank == victim else None,
    )
    t0 = time.monotonic()
    with pytest.raises(xccl.XcclError) as info:
        xccl.init_process_group(
            "shm", store=store_obj, rank=rank, world_size=world_size, timeout=20
        )
    waited = time.monotonic() - t0
    seen = watch.stop()
    assert len(seen) == 1, seen
    assert not _own_segments(rank)
    _file_barrier(tmp, "failed", rank, world_size - 1)  # as in body_killed_mid_all_reduce
    return seen[0], str(info.value), waited


def _run_with_victim(body, tmp_path, victim):
    """Runs `body(rank, 3, tmp, victim)` on 3 ranks without a process group; `victim` is
    expected to die of SIGKILL."""
    return run_spmd(
        body,
        3,
        str(tmp_path),
        victim,
        init=False,
        env=ENV,
        timeout=60,
        expect_exit={victim: -signal.SIGKILL},
    )


def test_killed_rank_in_wire_up_leaves_nothing(tmp_path):
    """A rank SIGKILLed while its segment is still linked: the others' init fails naming it,
    and its segment is unlinked by them."""
    victim = 1
    res = _run_with_victim(body_killed_in_wire_up, tmp_path, victim)
    for rank in (0, 2):
        seg, msg, waited = res[rank]
        assert f"rank {victim}" in msg and "shm" in msg, (rank, msg)
        assert waited < 10, (rank, waited, msg)
    assert _leftovers(jobs={_job_of(res[0][0])}) == []


def body_killed_before_publishing(rank, world_size, tmp, victim):
    """`victim` dies before its address reaches the store: nobody learns its segment's name."""
    import xccl

    watch = _Watch(rank)

    def die_before_publishing(key, publish):
        os.kill(os.getpid(), signal.SIGKILL)

    store_obj = _HoldingStore(
        xccl.FileStore(os.path.join(tmp, "store"), world_size),
        0.0,
        die_before_publishing if rank == victim else None,
    )
    with pytest.raises(xccl.XcclError):
        xccl.init_process_group("shm", store=store_obj, rank=rank, world_size=world_size, timeout=3)
    return watch.stop()


def body_next_job(rank, world_size, tmp):
    _join(os.path.join(tmp, "store2"), rank, world_size)
    import xccl

    xccl.destroy_process_group()


def test_segment_of_rank_killed_before_publishing_is_swept(tmp_path):
    """The victim's segment outlives the failed job (no one knew its name); the next shm
    init on the host removes it, since its owner's lock is gone."""
    victim = 1
    res = _run_with_victim(body_killed_before_publishing, tmp_path, victim)
    job = _job_of(res[0][0])
    left = _leftovers(jobs={job})
    assert len(left) == 1 and f"-{victim}-" in left[0], left
    time.sleep(2.5)  # older than SHM_ORPHAN_AGE_S: not one being created right now
    run_spmd(body_next_job, 2, str(tmp_path), init=False, env=ENV, timeout=60)
    assert _leftovers(jobs={job}) == []


# --------------------------------------------------------------------------- destroy and re-init


def body_destroy_reinit(rank, world_size, tmp):
    import xccl

    segs = []
    for job in range(2):
        segs.append(_join(os.path.join(tmp, f"store{job}"), rank, world_size))
        x = _data(CMA_MIN, job, rank, 0, np.int32)  # 256 KiB: CMA
        xccl.all_reduce(x)
        want = sum(_data(CMA_MIN, job, r, 0, np.int64) for r in range(world_size))
        np.testing.assert_array_equal(x, want.astype(np.int32))
        xccl.destroy_process_group()
        assert not xccl.is_initialized()
        assert not _own_segments(rank), _own_segments(rank)
    return segs


def test_destroy_and_reinit_leave_nothing(tmp_path):
    """Two jobs, one after the other, in the same processes: each gets its own segment, and
    destroy_process_group leaves none of either behind."""
    res = run_spmd(body_destroy_reinit, 3, str(tmp_path), init=False, env=ENV, timeout=60)
    jobs = [{_job_of(segs[j]) for segs in res} for j in range(2)]
    assert all(len(j) == 1 for j in jobs) and jobs[0] != jobs[1], res
    assert _leftovers(jobs=jobs[0] | jobs[1]) == []
