"""A peer killed (SIGKILL) in the middle of a training-style loop and in the middle of a large
transfer over the RDMA transport, and a port going down under a running loop: every other rank
raises a named xccl error that names the dead rank (or the device), within the operation
timeout; nothing hangs; every process of the job ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from harness import run_spmd
from rdma_common import env, needs_ibverbs, needs_transport, rdma_devices

pytestmark = needs_transport

PG_TIMEOUT = 15.0  # s; generous for an emulated VM (no healthy operation here takes 2 s)
NAMED = ("XcclConnectionError", "XcclTimeoutError", "XcclError")


def body_killed_in_loop(rank, world_size, nbytes):
    import xccl

    def fault(step):
        if rank == world_size - 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    return _all_reduce_until_error(xccl, world_size, nbytes, fault)


def _all_reduce_until_error(xccl, world_size, nbytes, fault):
    """all_reduce of nbytes, checked, until one raises; fault(step) runs before each step.
    Returns the error's message and type, how long the failing call took, and its step."""
    x = np.ones(nbytes // 4, np.float32)
    t0 = time.monotonic()
    try:
        for step in range(100000):
            fault(step)
            t0 = time.monotonic()
            x[:] = 1
            xccl.all_reduce(x)
            assert x[0] == world_size, (step, x[0])
    except xccl.XcclError as e:
        return str(e), type(e).__name__, time.monotonic() - t0, step
    raise AssertionError("the loop ended without an error")


@pytest.mark.parametrize("nbytes", [4096, 4 << 20])
def test_peer_killed_in_loop(nbytes):
    n = 3
    res = run_spmd(body_killed_in_loop, n, nbytes, env=env(), timeout=180,
                   pg_timeout=PG_TIMEOUT, expect_exit={n - 1: -signal.SIGKILL})
    for rank, (msg, kind, waited, step) in enumerate(res[:-1]):
        assert kind in NAMED, (rank, kind, msg)
        assert f"rank {n - 1}" in msg, (rank, msg)
        assert step >= 3, (rank, step)
        assert waited < PG_TIMEOUT + 10, (rank, waited, msg)


def body_killed_mid_transfer(rank, world_size, nbytes):
    import xccl

    if rank == 1:
        buf = np.ones(nbytes, np.uint8)
        xccl.barrier()
        xccl.isend(buf, dst=0)
        time.sleep(0.3)  # the receiver is reading (or about to): die now
        os.kill(os.getpid(), signal.SIGKILL)
    got = np.zeros(nbytes, np.uint8)
    xccl.barrier()
    t0 = time.monotonic()
    try:
        xccl.recv(got, src=1)
        # it may all have arrived in 0.3 s; then the next operation must fail
        xccl.all_reduce(np.ones(4))
    except xccl.XcclError as e:
        return str(e), type(e).__name__, time.monotonic() - t0
    raise AssertionError("no error after the peer died")


def test_peer_killed_mid_transfer():
    msg, kind, waited = run_spmd(body_killed_mid_transfer, 2, 64 << 20, env=env(), timeout=180,
                                 pg_timeout=PG_TIMEOUT, expect_exit={1: -signal.SIGKILL})[0]
    assert kind in NAMED, (kind, msg)
    assert "rank 1" in msg, msg
    assert waited < PG_TIMEOUT + 10, (waited, msg)


JOB = """
import os, signal, numpy as np, xccl
xccl.init_process_group("auto", timeout=30)
x = np.ones(1 << 18, np.float32)
for step in range(100000):
    if xccl.get_rank() == 1 and step == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    xccl.all_reduce(x)
"""


def test_launcher_job_with_a_killed_rank_ends(tmp_path):
    """xccl-run with 3 ranks, one killed: the launcher exits with 128 + SIGKILL, naming the
    rank, well within the timeout; the conftest's leak check sees no rank left behind."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "xccl.run", "--nproc-per-node", "3", str(script)],
        env={**os.environ, **env()}, capture_output=True, text=True, timeout=170,
    )
    assert proc.returncode == 128 + signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])
    assert "rank 1" in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 150


def _port_state(device: str) -> str:
    with open(f"/sys/class/infiniband/{device}/ports/1/state") as f:
        return f.read().strip()  # e.g. "4: ACTIVE"


def body_port_down(rank, world_size, netdev):
    import xccl

    def fault(step):
        if rank == 0 and step == 5:
            subprocess.run(["ip", "link", "set", netdev, "down"], check=True)

    return _all_reduce_until_error(xccl, world_size, 1 << 18, fault)


@needs_ibverbs
def test_port_going_down_mid_loop():
    """The link under rxe1 goes down while 2 ranks on rxe1 loop over all_reduce: the port
    leaves ACTIVE (an asynchronous port event on one rank, a failed send naming the port's
    state on the other): every rank raises a named error within the operation timeout; the
    link comes back up afterwards."""
    device, netdev = "rxe1", "dummy1"
    if device not in rdma_devices():
        pytest.skip("needs a second soft-RoCE device (run-in-vm.sh -d 2, the default)")
    assert "ACTIVE" in _port_state(device)
    try:
        res = run_spmd(body_port_down, 2, netdev, env=env(XCCL_IB_HCA=f"={device}"),
                       timeout=180, pg_timeout=PG_TIMEOUT)
    finally:
        subprocess.run(["ip", "link", "set", netdev, "up"], check=True)
        for _ in range(100):
            if "ACTIVE" in _port_state(device):
                break
            time.sleep(0.1)
    for rank, (msg, kind, waited, step) in enumerate(res):
        assert kind == "XcclConnectionError", (rank, kind, msg)
        assert step >= 4, (rank, step)  # collectives ran before the link went down
        assert waited < PG_TIMEOUT + 10, (rank, waited, msg)
        # the error names the device and the peer the connection to which broke
        assert f"ibverbs ({device} port 1)" in msg and f"rank {1 - rank}" in msg, (rank, msg)
        assert "port error" in msg or "is DOWN" in msg, (rank, msg)
    assert "ACTIVE" in _port_state(device)


def test_mismatch_and_stall_named_over_rdma():
    """The core's mismatch detection and hang diagnosis work over RDMA as over TCP (the bodies
    of tests/test_failures.py): a collective mismatch is named on every rank, one that moves no
    data is found at once, and a peer that stops taking part is named at the timeout."""
    from test_failures import body_mismatch, body_silent_mismatch, body_stalled_peer

    for m in run_spmd(body_mismatch, 3, env=env(), timeout=120, pg_timeout=30):
        assert "mismatch" in m and "all_reduce" in m and "broadcast" in m, m
    for msg, waited in run_spmd(body_silent_mismatch, 2, env=env(), timeout=120, pg_timeout=30):
        assert "mismatch" in msg and "reduce" in msg and "broadcast" in msg, msg
        assert waited < 20, waited  # found by the check message, not by the 30 s timeout
    msg, waited = run_spmd(body_stalled_peer, 2, env=env(), timeout=120, pg_timeout=3)[0]
    assert "all_reduce" in msg and "timed out after 3.0 s" in msg and "rank 1" in msg, msg
    assert 2.5 < waited < 20, waited
