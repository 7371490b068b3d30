"""Hang diagnosis in jobs started the ordinary way (a store, not xccl.launch): an operation
that times out asks every member of its communicator where it stands, and its
XcclTimeoutError carries one row per rank (csrc/core/diag.c).

A rank that is alive but busy in Python answers from the progress thread; a dead rank is
named as such. Neither makes the error late: it arrives within the timeout plus the bounded
collection time (min(1 s, timeout / 4), here 500 ms); the tests allow generous slack for a
loaded machine. Ranks that must stay alive (and idle for xccl) until others are done wait for
store keys in Python instead of sleeping for a guessed time.
"""

import os
import re
import signal
import time

import numpy as np
import pytest
from harness import run_spmd

TRANSPORTS = ["tcp", "shm"]
PG_TIMEOUT = 2.0
SLACK = 10.0  # on top of the timeout and the collection time, for a loaded machine


def _done(key):
    import xccl

    xccl._get_default_store().set(key, b"1")


def _wait_for(*keys):
    """Waits in Python (alive and idle for xccl, answering from the progress thread)."""
    from datetime import timedelta

    import xccl

    xccl._get_default_store().wait(list(keys), timedelta(seconds=60))


def body_idle_peer(rank, world_size):
    import xccl

    x = np.ones(16, np.float32)
    xccl.all_reduce(x)  # everyone connected; the last operation rank 2 finishes
    if rank == 2:
        _wait_for("timed out 0", "timed out 1")
        return None
    if rank == 1:
        time.sleep(1.0)  # enters later, so it still waits when rank 0 times out and asks
    t0 = time.monotonic()
    with pytest.raises(xccl.XcclTimeoutError) as info:
        xccl.all_reduce(x, algo="ring")
    waited = time.monotonic() - t0
    _done(f"timed out {rank}")
    if rank == 0:
        _wait_for("timed out 1")  # stays (connected) until rank 1 has timed out too
    return str(info.value), waited


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_timeout_shows_every_rank(backend):
    res = run_spmd(body_idle_peer, 3, backend=backend, timeout=30, pg_timeout=PG_TIMEOUT)
    msg, waited = res[0]
    # the local part is unchanged: operation, time, and what rank 0 itself waits for
    assert msg.startswith("all_reduce (algo ring, seq "), msg
    assert "timed out after 2.0 s on rank 0" in msg, msg
    assert "where the 3 ranks of comm" in msg, msg
    mine = re.search(r"\n  rank 0: all_reduce #(\d+) \(ring\) waiting for", msg)
    busy = re.search(r"\n  rank 1: all_reduce #(\d+) \(ring\) waiting for (send to|recv from)",
                     msg)
    idle = re.search(r"\n  rank 2: idle, last finished #(\d+) all_reduce\n?", msg)
    assert mine and busy and idle, msg
    assert int(mine[1]) == int(busy[1]) == int(idle[1]) + 1, msg
    assert PG_TIMEOUT - 0.1 < waited < PG_TIMEOUT + 0.5 + SLACK, waited  # + collection
    # rank 1 timed out a second later: rank 0 has given up by then, rank 2 is still idle
    msg1, _ = res[1]
    assert re.search(r"\n  rank 0: idle, last finished #\d+ all_reduce \(timed out\)", msg1), msg1
    assert re.search(r"\n  rank 2: idle, last finished #\d+ all_reduce", msg1), msg1


def body_killed_peer(rank, world_size):
    import xccl

    x = np.ones(16, np.float32)
    xccl.all_reduce(x)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:
        _wait_for("timed out 0")  # alive and idle: never sends what rank 0 waits for
        return None
    buf = np.zeros(4, np.float32)
    t0 = time.monotonic()
    with pytest.raises(xccl.XcclTimeoutError) as info:
        xccl.recv(buf, src=1)
    waited = time.monotonic() - t0
    _done("timed out 0")
    return str(info.value), waited


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_timeout_names_dead_peer(backend):
    res = run_spmd(
        body_killed_peer,
        3,
        backend=backend,
        timeout=30,
        pg_timeout=PG_TIMEOUT,
        expect_exit={2: -signal.SIGKILL},
    )
    msg, waited = res[0]
    assert "timed out after 2.0 s on rank 0" in msg, msg
    assert re.search(r"\n  rank 0: recv \(p2p, tag \d+\) waiting for recv from rank 1", msg), msg
    assert re.search(r"\n  rank 1: idle, last finished #\d+ all_reduce\n", msg), msg
    assert re.search(r"\n  rank 2: no answer(, dead| within)", msg), msg
    assert waited < PG_TIMEOUT + 0.5 + SLACK, waited


def body_ask(rank, world_size):
    import xccl

    xccl.barrier()
    if rank == 1:
        buf = np.zeros(4, np.float32)
        work = xccl.irecv(buf, src=0, tag=3)  # pending until rank 0 has asked
        _done("posted")
        work.wait()
        return float(buf[0])
    if rank == 2:
        _done("idle")  # past its barrier (rank 0 may finish its part of it first)
        _wait_for("asked")  # in Python: answers from the progress thread
        return None
    _wait_for("posted", "idle")
    t0 = time.monotonic()
    table = xccl.debug.ask_ranks(wait=30.0)
    waited = time.monotonic() - t0
    _done("asked")
    xccl.send(np.full(4, 7, np.float32), dst=1, tag=3)
    return table, waited


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_ask_ranks_from_one_rank(backend):
    res = run_spmd(body_ask, 3, backend=backend, timeout=90, pg_timeout=60)
    table, waited = res[0]
    assert table.startswith("where the 3 ranks of comm"), table
    assert re.search(r"\n  rank 0: idle, last finished #\d+ barrier\n", table), table
    assert "\n  rank 1: recv (p2p, tag 3) waiting for recv from rank 0 (" in table, table
    assert re.search(r"\n  rank 2: idle, last finished #\d+ barrier\n", table), table
    assert waited < 20.0, waited  # everyone answered: it did not wait its full 30 s
    assert res[1] == 7.0
