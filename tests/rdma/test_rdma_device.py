"""Which device the ibverbs transport uses, and what it says when it cannot.

- ``XCCL_IB_HCA`` (NCCL's syntax): with two devices (run-in-vm.sh's default: rxe0 and rxe1),
  naming rxe1, or excluding rxe0, puts the job's traffic on rxe1, as rxe1's packet counters
  (sysfs, outside xccl) show while rxe0's stand still; a spec that matches no device is an
  error that names the spec and the devices there are.
- ``XCCL_IB_GID_INDEX``: another valid index works (on rxe, index 0 is the RoCE v2 link-local
  GID, 1 the IPv4 one); one the port does not have is an error naming it.
- Without a device (the host): ``XCCL_TRANSPORTS=ibverbs`` is an error that says why ibverbs
  is not usable, and the default transports carry on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from harness import run_spmd
from rdma_common import TRANSPORT, needs_ibverbs, port_counter, rdma_devices

MiB = 1 << 20


def body_exchange(rank, world_size, store_path):
    """Joins (the error as a string, if any), then moves 2 MiB both ways and checks it."""
    import xccl

    try:
        xccl.init_process_group("auto", init_method=f"file://{store_path}", rank=rank,
                                world_size=world_size, timeout=60)
    # ValueError: a bad setting (INVALID_ARG); NotImplementedError: no usable transport
    except (xccl.XcclError, ValueError, NotImplementedError) as e:
        return "error", type(e).__name__, str(e)
    from xccl import _group

    transport = _group.resolve(None).comm.peer_transport(1 - rank)
    x = np.arange(MiB // 4, dtype=np.float32) % 1013 + rank
    xccl.all_reduce(x)
    np.testing.assert_array_equal(x, (np.arange(MiB // 4) % 1013) * 2 + 1)
    xccl.destroy_process_group()
    return "ok", transport, ""


def _run(tmp_path, **extra):
    return run_spmd(body_exchange, 2, str(tmp_path / "store"), init=False, timeout=180,
                    env={"XCCL_TRANSPORTS": "ibverbs", **extra})


def _sent(dev):
    return port_counter(dev, "sent_pkts")


two_devices = pytest.mark.skipif(
    len(rdma_devices()) < 2 or rdma_devices()[:2] != ["rxe0", "rxe1"],
    reason="needs the two soft-RoCE devices rxe0 and rxe1 (tests/rdma/run-in-vm.sh -d 2)",
)


@needs_ibverbs
@two_devices
@pytest.mark.parametrize("spec", ["rxe1:1", "=rxe1", "^rxe0"])
def test_hca_selects_the_device(tmp_path, spec):
    before = {d: _sent(d) for d in ("rxe0", "rxe1")}
    res = _run(tmp_path, XCCL_IB_HCA=spec)
    assert res == [("ok", "ibverbs", "")] * 2, res
    sent = {d: _sent(d) - before[d] for d in ("rxe0", "rxe1")}
    # 2 MiB each way at an MTU of at most 4 KiB: hundreds of packets
    assert sent["rxe1"] >= 2 * MiB // 4096, sent
    assert sent["rxe0"] == 0, sent


@needs_ibverbs
@two_devices
def test_default_device_is_the_first(tmp_path):
    before = {d: _sent(d) for d in ("rxe0", "rxe1")}
    assert _run(tmp_path) == [("ok", "ibverbs", "")] * 2
    sent = {d: _sent(d) - before[d] for d in ("rxe0", "rxe1")}
    assert sent["rxe0"] >= 2 * MiB // 4096 and sent["rxe1"] == 0, sent


@needs_ibverbs
@pytest.mark.parametrize("spec", ["mlx5_9", "rxe0:2", "^rxe", "=rxe"])
def test_hca_matching_nothing_is_an_error(tmp_path, spec):
    for status, kind, msg in _run(tmp_path, XCCL_IB_HCA=spec):
        assert status == "error", (spec, kind, msg)
        assert "XCCL_IB_HCA" in msg and spec in msg, msg
        assert "rxe0" in msg, msg  # names what there is


@needs_ibverbs
@pytest.mark.parametrize("index", ["0", "1"])
def test_gid_index_override(tmp_path, index):
    assert _run(tmp_path, XCCL_IB_GID_INDEX=index) == [("ok", "ibverbs", "")] * 2


@needs_ibverbs
@pytest.mark.parametrize("index", ["99", "-1", "x"])
def test_bad_gid_index_is_an_error(tmp_path, index):
    for status, kind, msg in _run(tmp_path, XCCL_IB_GID_INDEX=index):
        assert status == "error", (index, kind, msg)
        assert "XCCL_IB_GID_INDEX" in msg, msg


@pytest.mark.skipif(bool(rdma_devices()), reason="this machine has an RDMA device")
@pytest.mark.skipif(TRANSPORT != "ibverbs", reason=f"transport under test is {TRANSPORT!r}")
def test_not_usable_without_a_device(tmp_path):
    res = _run(tmp_path)
    status, kind, msg = res[0]
    if status == "error" and "no transport matches" in msg:
        pytest.skip("xccl was built without the ibverbs transport (no libibverbs-dev)")
    assert status == "error", res
    assert kind == "NotImplementedError", (kind, msg)
    assert "ibverbs not usable: no RDMA device" in msg, msg
    # the default transports are unaffected
    res = run_spmd(body_exchange, 2, str(tmp_path / "store2"), init=False, timeout=120)
    assert [r[0] for r in res] == ["ok", "ok"], res
    assert res[0][1] in ("shm", "tcp"), res


MEMLOCK_JOB = """
import numpy as np, xccl
try:
    xccl.init_process_group("auto", timeout=60)
    x = np.ones(4 << 20, np.uint8)  # 4 MiB: a rendezvous, its buffer registered
    xccl.all_reduce(x)
except Exception as e:  # noqa: BLE001 - what is raised is the point
    print("XCCL-ERR", type(e).__name__, str(e).replace(chr(10), " "), flush=True)
    raise SystemExit(3)
print("XCCL-OK", flush=True)
"""


@needs_ibverbs
def test_locked_memory_limit_is_named(tmp_path):
    """Ranks of an unprivileged user (root is exempt: CAP_IPC_LOCK) with a 64 KiB locked-memory
    limit cannot register their buffers: the error names RLIMIT_MEMLOCK and how to raise it,
    and no rank hangs."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("prlimit") is None:
        pytest.skip("needs root (to drop to an unprivileged user), setpriv and prlimit")
    work = tempfile.mkdtemp(prefix="xccl-memlock-")
    try:
        os.chmod(work, 0o755)
        script = os.path.join(work, "job.py")
        with open(script, "w") as f:
            f.write(MEMLOCK_JOB)
        os.chmod(script, 0o644)
        dev_modes = {}
        for d in os.listdir("/dev/infiniband"):  # rdma-core's udev rules make these 0666
            p = os.path.join("/dev/infiniband", d)
            dev_modes[p] = os.stat(p).st_mode & 0o777
            os.chmod(p, 0o666)
        import xccl

        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(xccl.__file__)))
        env = {**os.environ, "XCCL_TRANSPORTS": "ibverbs", "HOME": work, "PYTHONPATH": pkg_root}
        try:
            proc = subprocess.run(
                ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                 "prlimit", "--memlock=65536", sys.executable, "-m", "xccl.run",
                 "--nproc-per-node", "2", script],
                env=env, cwd=work, capture_output=True, text=True, timeout=170)
        finally:
            for p, mode in dev_modes.items():
                os.chmod(p, mode)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "XCCL-OK" not in out, out[-3000:]
    errs = [line for line in out.splitlines() if "XCCL-ERR" in line]
    assert errs, out[-3000:]
    for line in errs:
        assert "RLIMIT_MEMLOCK" in line and "ulimit -l" in line, line


def body_tight_protocol(rank, world_size):
    """Many messages in flight around a ring, of sizes on both sides of the eager limit and of
    the READ chunk, then an all_reduce of an odd size: every byte checked."""
    import xccl

    sizes = [0, 1, 63, 64, 65, 4095, 4096, 4097, MiB + 13] * 6
    right, left = (rank + 1) % world_size, (rank - 1) % world_size

    def payload(src, i, n):
        return ((np.arange(n, dtype=np.int64) * 7 + src * 131 + i) % 251).astype(np.uint8)

    sends = [payload(rank, i, n) for i, n in enumerate(sizes)]
    recvs = [np.full(n, 0xEE, np.uint8) for n in sizes]
    works = [xccl.isend(s, dst=right) for s in sends] + [xccl.irecv(r, src=left) for r in recvs]
    for w in works:
        w.wait()
    for i, (r, n) in enumerate(zip(recvs, sizes, strict=True)):
        np.testing.assert_array_equal(r, payload(left, i, n), err_msg=f"message {i} ({n} B)")
    n = 3 * MiB // 8 + 5
    x = np.arange(n, dtype=np.float64) + rank
    xccl.all_reduce(x)
    np.testing.assert_array_equal(x, np.arange(n) * world_size + world_size * (world_size - 1) / 2)
    return len(sizes)


@needs_ibverbs
def test_tight_protocol_limits():
    """Two credits per peer, a 64-byte eager limit, 4 KiB RDMA READs one at a time: flow
    control queues sends instead of overrunning the receiver, a rendezvous is read in many
    chunks (the path that splits messages of 2 GiB and more), and the data is exact."""
    tight = {"XCCL_TRANSPORTS": "ibverbs", "XCCL_IB_RECV_DEPTH": "2", "XCCL_IB_EAGER_BYTES": "64",
             "XCCL_IB_CHUNK_BYTES": "4096", "XCCL_IB_READS": "1"}
    assert run_spmd(body_tight_protocol, 3, env=tight, timeout=300) == [54] * 3


BIG = 2 * 1024 * MiB + 4097  # over 2 GiB: more than one work request may carry


def _big_pattern(off, n, period=65521):
    """Bytes [off, off + n) of a pattern whose period is prime: a piece landing at the wrong
    offset (any multiple of a page or a chunk) does not match."""
    base = (np.arange(period, dtype=np.int64) * 13 % 251).astype(np.uint8)
    return np.resize(np.roll(base, -(off % period)), n)


def body_big_message(rank, world_size):
    import xccl

    step = 64 * MiB
    buf = np.empty(BIG, np.uint8)
    if rank == 0:
        for off in range(0, BIG, step):
            n = min(step, BIG - off)
            buf[off:off + n] = _big_pattern(off, n)
        xccl.send(buf, dst=1)
        return 0
    buf[:] = 0xEE
    xccl.recv(buf, src=0)
    bad = 0
    for off in range(0, BIG, step):
        n = min(step, BIG - off)
        bad += int(np.count_nonzero(buf[off:off + n] != _big_pattern(off, n)))
    return bad


@needs_ibverbs
@pytest.mark.skipif(os.environ.get("XCCL_RDMA_BIG") != "1",
                    reason="on demand (XCCL_RDMA_BIG=1, a VM with 8 GiB: run-in-vm.sh -m 8192): "
                    "2 GiB through emulated RDMA takes minutes")
@pytest.mark.timeout(1500)
def test_message_over_2_gib():
    """One message of 2 GiB + 4097 bytes, sent from rank 0 to rank 1 in one call: split into
    RDMA READs below the port's max_msg_sz, every byte where it belongs."""
    assert run_spmd(body_big_message, 2, env={"XCCL_TRANSPORTS": "ibverbs"}, timeout=1400,
                    pg_timeout=1300) == [0, 0]
