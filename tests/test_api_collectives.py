"""The torch.distributed-style collectives of ``xccl`` (python/xccl/_collectives.py).

Each run spawns one process per rank (tests/harness.py) and checks every collective over a
list of (tensor kind, dtype, count) cases, in place and out of place, synchronously and with
``async_op=True``; expected values are computed independently with numpy from the same
rank-dependent formulas.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import run_spmd

try:
    import torch
except ImportError:  # pragma: no cover - torch is a test dependency
    torch = None

KINDS = ["numpy", "torch"] if torch is not None else ["numpy"]
INTS = {"uint8", "int8", "int32", "int64"}
LOW = {"bfloat16", "float16"}

# (kind, dtype) pairs; bfloat16 only exists in torch.
FULL_DTYPES = [
    ("numpy", "float32"),
    ("numpy", "float64"),
    ("numpy", "int64"),
    ("numpy", "uint8"),
    ("numpy", "complex64"),
    ("torch", "float32"),
    ("torch", "bfloat16"),
    ("torch", "float16"),
    ("torch", "int32"),
    ("torch", "int8"),
    ("torch", "complex128"),
]
SMALL_DTYPES = [("numpy", "float32"), ("numpy", "int64"), ("torch", "float32"), ("torch", "int32")]


def _cases(dtypes, counts):
    return [(k, d, c) for (k, d) in dtypes if k in KINDS for c in counts]


# ---------------------------------------------------------------------------------- helpers


def mk(kind, dtype, values):
    """A tensor of `kind`/`dtype` holding `values` (a numpy array)."""
    values = np.asarray(values)
    if kind == "numpy":
        return values.astype(dtype)
    t = torch.from_numpy(np.ascontiguousarray(values))
    return t.to(getattr(torch, dtype))


def as_np(t):
    """Values of a tensor as a float64/complex128/int64 numpy array."""
    if torch is not None and isinstance(t, torch.Tensor):
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.to(torch.float64)
        return t.numpy().copy()
    return np.asarray(t).copy()


def same(got, want, kind, dtype, what, tol=None):
    """Asserts `got` (a tensor) equals `want` (numpy, computed in float64) after casting
    `want` to the tensor's dtype (tol: relative tolerance instead of exact equality)."""
    g = as_np(got)
    w = as_np(mk(kind, dtype, want)).reshape(g.shape)
    if tol is None:
        assert np.array_equal(g, w), (
            f"{what} [{kind} {dtype}]: got {g.ravel()[:8]}, want {w.ravel()[:8]}"
        )
    else:
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"{what} [{kind} {dtype}]")


def val(r, count, dtype, salt=0):
    """Rank r's data: small integers, so that sums are exact in every dtype."""
    i = np.arange(count)
    v = (r + 1) + (i + salt) % 3
    if dtype.startswith("complex"):
        return v + 1j * ((r + i) % 2)
    return v.astype(np.float64) if dtype not in INTS else v.astype(np.int64)


def val_prod(r, count):
    """Factors for PRODUCT: 1 or 2, and 1 beyond rank 5, so products stay <= 64."""
    i = np.arange(count)
    return (1 + (r + i) % 2) if r < 6 else np.ones(count, np.int64)


def piece(src, dst, n):
    """What rank src sends rank dst in all_to_all: n values in [0, 100)."""
    return (src * 10 + dst) % 90 + np.arange(n) % 3


# ---------------------------------------------------------------------------------- bodies


def body_collectives(rank, size, cases):
    import xccl as dist

    checks = 0
    for kind, dtype, count in cases:
        checks += _check_case(dist, rank, size, kind, dtype, count)
    return checks


def _check_case(dist, rank, size, kind, dtype, count):
    R = range(size)
    is_int = dtype in INTS
    is_cplx = dtype.startswith("complex")
    tol = 1e-2 if dtype in LOW else 1e-6
    n = 0

    def t_of(values):
        return mk(kind, dtype, values)

    def zeros(c):
        return t_of(np.zeros(c))

    total = sum(val(r, count, dtype) for r in R)

    # all_reduce, in place, every operator that applies to the dtype
    t = t_of(val(rank, count, dtype))
    assert dist.all_reduce(t) is None
    same(t, total, kind, dtype, "all_reduce sum")
    n += 1
    t = t_of(val_prod(rank, count))
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    same(t, np.prod([val_prod(r, count) for r in R], axis=0), kind, dtype, "product")
    n += 1
    if not is_cplx:
        for op, fn in ((dist.ReduceOp.MIN, np.min), (dist.ReduceOp.MAX, np.max)):
            t = t_of(val(rank, count, dtype))
            dist.all_reduce(t, op=op)
            same(t, fn([val(r, count, dtype) for r in R], axis=0), kind, dtype, f"{op.name}")
            n += 1
    if is_int:
        for op, fn in (
            (dist.ReduceOp.BAND, np.bitwise_and),
            (dist.ReduceOp.BOR, np.bitwise_or),
            (dist.ReduceOp.BXOR, np.bitwise_xor),
        ):
            t = t_of(val(rank, count, dtype))
            dist.all_reduce(t, op=op)
            same(t, fn.reduce([val(r, count, dtype) for r in R]), kind, dtype, f"{op.name}")
            n += 1
    else:
        t = t_of(val(rank, count, dtype))
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        same(t, total / size, kind, dtype, "avg", tol)
        t = t_of(val(rank, count, dtype))
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
        same(t, 2 * total, kind, dtype, "premul_sum")
        n += 2

    # all_reduce, asynchronous, with the future
    t = t_of(val(rank, count, dtype))
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    assert work.wait() is True
    assert work.is_completed() and work.is_success() and work.exception() is None
    value = fut.wait() if hasattr(fut, "then") else fut.result(timeout=30)
    assert value[0] is t
    same(t, total, kind, dtype, "async all_reduce")
    n += 1

    # broadcast from the first and the last rank
    for root in sorted({0, size - 1}):
        t = t_of(val(rank, count, dtype))
        dist.broadcast(t, src=root)
        same(t, val(root, count, dtype), kind, dtype, f"broadcast from {root}")
        t = t_of(val(rank, count, dtype))
        dist.broadcast(t, group_src=root, async_op=True).wait()
        same(t, val(root, count, dtype), kind, dtype, f"async broadcast from {root}")
        n += 2

    # reduce: the root gets the sum, the others keep their input
    root = size - 1
    t = t_of(val(rank, count, dtype))
    dist.reduce(t, dst=root)
    same(t, total if rank == root else val(rank, count, dtype), kind, dtype, "reduce")
    n += 1

    # all_gather into a list (sync, then async + future), into a tensor (flat, stacked,
    # in place)
    outs = [zeros(count) for _ in R]
    dist.all_gather(outs, t_of(val(rank, count, dtype)))
    for r in R:
        same(outs[r], val(r, count, dtype), kind, dtype, f"all_gather[{r}]")
    outs = [zeros(count) for _ in R]
    work = dist.all_gather(outs, t_of(val(rank, count, dtype, 1)), async_op=True)
    got = work.get_future()
    got = got.wait() if hasattr(got, "then") else got.result(timeout=30)
    for r in R:
        same(got[r], val(r, count, dtype, 1), kind, dtype, f"async all_gather future[{r}]")
    work.wait()
    n += 2
    gathered = np.concatenate([val(r, count, dtype) for r in R])
    out = zeros(size * count)
    dist.all_gather_into_tensor(out, t_of(val(rank, count, dtype)))
    same(out, gathered, kind, dtype, "all_gather_into_tensor flat")
    out = t_of(np.zeros((size, count)))
    dist.all_gather_into_tensor(out, t_of(val(rank, count, dtype)), async_op=True).wait()
    same(out, gathered, kind, dtype, "all_gather_into_tensor stacked")
    n += 2
    if count:
        out = zeros(size * count)
        mine = out[rank * count : (rank + 1) * count]
        mine[:] = t_of(val(rank, count, dtype))
        dist.all_gather_into_tensor(out, mine)
        same(out, gathered, kind, dtype, "all_gather_into_tensor in place")
        n += 1

    # gather to the middle rank, scatter from rank 1 % size
    root = size // 2
    glist = [zeros(count) for _ in R] if rank == root else None
    dist.gather(t_of(val(rank, count, dtype)), glist, dst=root)
    if rank == root:
        for r in R:
            same(glist[r], val(r, count, dtype), kind, dtype, f"gather[{r}]")
    root = 1 % size
    slist = [t_of(val(r, count, dtype, 5)) for r in R] if rank == root else None
    out = zeros(count)
    dist.scatter(out, slist, src=root)
    same(out, val(rank, count, dtype, 5), kind, dtype, "scatter")
    out = zeros(count)
    dist.scatter(out, slist, src=root, async_op=True).wait()
    same(out, val(rank, count, dtype, 5), kind, dtype, "async scatter")
    n += 3

    # reduce_scatter from a list and from a tensor (out of place and in place)
    want = sum(val(r, count, dtype, rank) for r in R)
    out = zeros(count)
    dist.reduce_scatter(out, [t_of(val(rank, count, dtype, j)) for j in R])
    same(out, want, kind, dtype, "reduce_scatter")
    out = zeros(count)
    big = t_of(np.concatenate([val(rank, count, dtype, j) for j in R]))
    dist.reduce_scatter_tensor(out, big)
    same(out, want, kind, dtype, "reduce_scatter_tensor")
    n += 2
    if not is_int:
        out = zeros(count)
        dist.reduce_scatter_tensor(out, big, op=dist.ReduceOp.AVG)
        same(out, want / size, kind, dtype, "reduce_scatter_tensor avg", tol)
        n += 1
    if count:
        big = t_of(np.concatenate([val(rank, count, dtype, j) for j in R]))
        dist.reduce_scatter_tensor(big[rank * count : (rank + 1) * count], big)
        same(big[rank * count : (rank + 1) * count], want, kind, dtype, "reduce_scatter in place")
        n += 1

    # all_to_all with uneven pieces, all_to_all_single even and uneven
    def length(src, dst):
        return (src + 2 * dst) % 3 + min(count, 5)

    ins = [t_of(piece(rank, j, length(rank, j))) for j in R]
    outs = [zeros(length(i, rank)) for i in R]
    dist.all_to_all(outs, ins)
    for i in R:
        same(outs[i], piece(i, rank, length(i, rank)), kind, dtype, f"all_to_all[{i}]")
    outs = [zeros(length(i, rank)) for i in R]
    dist.all_to_all(outs, ins, async_op=True).wait()
    for i in R:
        same(outs[i], piece(i, rank, length(i, rank)), kind, dtype, f"async all_to_all[{i}]")
    n += 2
    rows = 2
    inp = t_of(np.concatenate([np.repeat(piece(rank, j, rows)[:, None], 3, 1) for j in R]))
    out = t_of(np.zeros((size * rows, 3)))
    dist.all_to_all_single(out, inp)
    want = np.concatenate([np.repeat(piece(i, rank, rows)[:, None], 3, 1) for i in R])
    same(out, want, kind, dtype, "all_to_all_single even")
    n += 1
    if size > 1:  # as many elements as an even split needs, rows the group cannot split
        odd = t_of(np.zeros((size + 1, size)))
        with pytest.raises(ValueError, match="does not divide"):
            dist.all_to_all_single(t_of(np.zeros((size + 1, size))), odd)

    def rows_of(src, dst):
        return (src + dst) % 3 + (1 if count else 0)

    in_splits = [rows_of(rank, j) for j in R]
    out_splits = [rows_of(i, rank) for i in R]
    inp = t_of(np.concatenate([np.repeat(piece(rank, j, in_splits[j])[:, None], 2, 1) for j in R]))
    out = t_of(np.zeros((sum(out_splits), 2)))
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    want = np.concatenate([np.repeat(piece(i, rank, out_splits[i])[:, None], 2, 1) for i in R])
    same(out, want, kind, dtype, "all_to_all_single uneven")
    n += 1

    assert dist.barrier() is None
    dist.barrier(async_op=True).wait()
    return n + 2


def body_algos(rank, size):
    """Forcing an algorithm with algo= gives the same results."""
    import xccl as dist

    count = 1003
    want = sum(val(r, count, "float32") for r in range(size))
    for algo in ("ring", "rd", "rabenseifner", "direct", "owner"):
        t = val(rank, count, "float32").astype(np.float32)
        work = dist.all_reduce(t, algo=algo, async_op=True)
        work.wait()
        assert work.algo == algo, (work.algo, algo)
        assert np.array_equal(t, want), algo
    for algo in ("ring", "rhd", "direct", "owner"):
        big = np.concatenate([val(rank, count, "float32", q) for q in range(size)])
        out = np.zeros(count, np.float32)
        work = dist.reduce_scatter_tensor(out, big.astype(np.float32), algo=algo, async_op=True)
        work.wait()
        assert work.algo == algo, (work.algo, algo)
        assert np.array_equal(out, sum(val(r, count, "float32", rank) for r in range(size))), algo
    for algo in ("ring", "rd", "bruck", "direct"):
        out = np.zeros(size * count, np.float32)
        dist.all_gather_into_tensor(out, val(rank, count, "float32").astype(np.float32), algo=algo)
        assert np.array_equal(
            out, np.concatenate([val(r, count, "float32") for r in range(size)])
        ), algo
    for algo in ("binomial", "linear"):
        t = np.full(10, rank, np.int64)
        dist.broadcast(t, src=size - 1, algo=algo)
        assert (t == size - 1).all(), algo
    dist.barrier(algo="linear")
    dist.barrier(algo="dissemination")
    with pytest.raises(ValueError):
        dist.all_reduce(np.zeros(3, np.float32), algo="no-such-algorithm")
    return True


def body_late_peer(rank, size):
    """Rank 0 waits in the one-call paths (all_reduce, recv, numpy and torch buffers) for rank
    1, which comes 0.3 s late: longer than the spin with the GIL held, so the wait moves into a
    Work object. Results must be right, and a thread of rank 0 must run meanwhile (the wait
    holds the GIL only briefly). Then a wait interrupted by KeyboardInterrupt: the operation
    goes on without the caller and still fills the buffer when the peer arrives."""
    import signal
    import threading
    import time

    import xccl as dist

    ticks, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1

    counter = threading.Thread(target=count)
    counter.start()
    try:
        ran = []
        for kind in KINDS:
            x = mk(kind, "int64", np.arange(4) + 10 * rank)
            if rank == 1:
                time.sleep(0.3)
            before = ticks[0]
            dist.all_reduce(x)
            ran.append(ticks[0] - before)
            assert as_np(x).tolist() == [10, 12, 14, 16], as_np(x)
            y = mk(kind, "float32", np.full(3, 7.5 if rank == 1 else 0.0))
            if rank == 1:
                time.sleep(0.3)
                dist.send(y, 0)
            else:
                before = ticks[0]
                assert dist.recv(y, 1) == 1
                ran.append(ticks[0] - before)
                assert as_np(y).tolist() == [7.5] * 3
    finally:
        stop.set()
        counter.join()
    if rank == 0:  # the other thread counted while rank 0 waited (~0.3 s each time)
        assert min(ran) > 1000, ran

    z = np.full(5, rank + 1, np.int64)
    if rank == 0:

        def interrupt(signum, frame):
            raise KeyboardInterrupt

        old = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            dist.all_reduce(z)
            raise AssertionError("the all_reduce was not interrupted")
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGALRM, old)
        assert z.tolist() == [1] * 5  # rank 1 has not joined yet
    else:
        time.sleep(1.0)
        dist.all_reduce(z)
    dist.barrier()
    deadline = time.monotonic() + 10
    while z.tolist() != [3] * 5 and time.monotonic() < deadline:
        time.sleep(0.01)  # rank 0's orphaned operation completes in the background
    assert z.tolist() == [3] * 5, z
    return True


def test_one_call_waits_for_a_late_peer():
    assert run_spmd(body_late_peer, 2, timeout=60) == [True] * 2


def body_large_post_without_gil(rank, size):
    """A large out-of-place all_reduce starts by copying sendbuf into recvbuf (64 MiB here);
    the post must not hold the GIL meanwhile. Rank 0 posts while a second thread counts. The
    switch interval is set longer than the test, so the interpreter never hands the GIL over
    on its own: the counter can only advance during a post that releases it (the counter
    gives it back at every step). Events are counted, not timed; of several posts, one
    suffices (a loaded machine may not schedule the counter within a given copy)."""
    import sys
    import threading
    import time

    import xccl as dist
    from xccl import _C

    comm = dist.group.WORLD.comm
    n = 16 << 20
    s = np.full(n, rank + 1, np.float32)
    r = np.zeros(n, np.float32)
    ticks, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0)  # releases the GIL

    ran = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    counter = threading.Thread(target=count)
    counter.start()
    try:
        for k in range(5):
            r[:] = -1.0
            before = ticks[0]
            w = comm.allreduce(s, r, _C.OPS["sum"])
            ran.append(ticks[0] - before)
            w.wait()
            assert (r == float(size * (size + 1) // 2)).all(), k
    finally:
        stop.set()
        counter.join()
        sys.setswitchinterval(old)
    return ran


def test_large_post_releases_the_gil():
    ran = run_spmd(body_large_post_without_gil, 2, timeout=120)
    assert max(ran[0]) > 0, ran


BITWISE_COUNT = 100_003  # chunks of unequal sizes for every group size below


def _bitwise_data(rank):
    """Rank `rank`'s input: float32 of magnitudes spread over six decades, so that sums taken
    in different orders round differently."""
    rng = np.random.default_rng(1234 + rank)
    mag = 10.0 ** rng.uniform(-3, 3, BITWISE_COUNT)
    return (rng.standard_normal(BITWISE_COUNT) * mag).astype(np.float32)


def body_bitwise(rank, size, store_path, hosts, algos):
    """all_reduce of random float32 with each algorithm that claims the same bits on every
    rank; returns every rank's result bits (gathered) and this rank's result."""
    import os

    os.environ["XCCL_HOST_ID"] = hosts[rank]
    import xccl as dist

    dist.init_process_group(
        "auto", init_method=f"file://{store_path}", rank=rank, world_size=size, timeout=60
    )
    out = {}
    for algo in algos:
        x = _bitwise_data(rank)
        w = dist.all_reduce(x, algo=algo, async_op=True)
        w.wait()
        assert w.algo == algo, (w.algo, algo)
        bits = [np.empty(BITWISE_COUNT, np.int32) for _ in range(size)]
        dist.all_gather(bits, x.view(np.int32))  # the result's bits, as integers
        out[algo] = (x, bits)
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize(
    "hosts,algos",
    [
        (["a"] * 3, ["ring", "rd", "rabenseifner", "direct", "owner"]),
        (["a"] * 4, ["ring", "rd", "rabenseifner", "direct", "owner"]),
        (["a", "b", "a", "b", "a"], ["hier", "hier_rs", "ring", "rabenseifner"]),
        (["a", "a", "b", "b"], ["hier", "hier_rs"]),
    ],
)
def test_all_reduce_same_bits_on_every_rank(tmp_path, hosts, algos):
    """Random float32 data, different per rank: every rank's result has the same bits, and
    it is the float64 sum within float32 rounding of the partial sums."""
    size = len(hosts)
    res = run_spmd(body_bitwise, size, str(tmp_path / "store"), hosts, algos, init=False)
    inputs = np.stack([_bitwise_data(r).astype(np.float64) for r in range(size)])
    want = inputs.sum(axis=0)
    # each of the size-1 additions rounds once, by at most half an ulp of its partial sum
    bound = (size - 1) * np.finfo(np.float32).eps * np.abs(inputs).sum(axis=0)
    for algo in algos:
        for rank, out in enumerate(res):
            x, bits = out[algo]
            for r in range(size):
                assert np.array_equal(bits[r], bits[0]), (algo, rank, r)
            assert np.array_equal(x.view(np.int32), bits[rank]), (algo, rank)
            err = np.abs(x.astype(np.float64) - want)
            assert (err <= bound).all(), (algo, rank, float((err / bound).max()))


def body_grad_and_futures(rank, size):
    """Tensors that require grad, torch future chaining (DDP comm-hook style), many
    outstanding async operations completed out of order."""
    import xccl as dist

    w = torch.ones(5, requires_grad=True)
    with torch.no_grad():
        w.mul_(rank + 1)
    dist.all_reduce(w)
    assert torch.equal(w.detach(), torch.full((5,), float(sum(range(1, size + 1)))))
    assert w.requires_grad

    g = torch.full((4,), float(rank))
    fut = dist.all_reduce(g, async_op=True).get_future()
    chained = fut.then(lambda f: f.value()[0].div_(size))
    out = chained.wait()
    assert torch.allclose(out, torch.full((4,), (size - 1) / 2))

    ts = [torch.full((100,), float(rank * 10 + k)) for k in range(16)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for work in reversed(works):
        work.wait()
    for k, t in enumerate(ts):
        assert torch.equal(t, torch.full((100,), float(sum(r * 10 + k for r in range(size)))))
    return True


# ---------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_collectives_full(world_size):
    cases = _cases(FULL_DTYPES, [0, 1, 7])
    cases += _cases([("numpy", "float32"), ("torch", "int32")], [70001])
    checks = run_spmd(body_collectives, world_size, cases, timeout=240)
    assert len(set(checks)) == 1 and checks[0] > 20 * len(cases)


@pytest.mark.parametrize("world_size", [5, 8])
def test_collectives_larger_worlds(world_size):
    cases = _cases(SMALL_DTYPES, [1, 1003])
    checks = run_spmd(body_collectives, world_size, cases, timeout=240)
    assert len(set(checks)) == 1


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_collectives_backends(backend):
    cases = _cases([("numpy", "float32"), ("torch", "int64")], [3, 20000])
    assert run_spmd(body_collectives, 3, cases, backend=backend, timeout=180)


@pytest.mark.parametrize("world_size", [3, 4])
def test_forced_algorithms(world_size):
    assert run_spmd(body_algos, world_size, timeout=120) == [True] * world_size


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_grad_and_futures():
    assert run_spmd(body_grad_and_futures, 3, timeout=120) == [True] * 3
