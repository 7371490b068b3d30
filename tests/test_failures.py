"""Failure behaviour through the Python API: a killed peer, a stalled peer, a collective
mismatch, and messages of 2 GiB and more, on both transports.

A dead or slow peer must give every waiting rank an error that names the peer, the operation
and the time waited, within the timeout: never a hang, never wrong data.
"""

import os
import time
from datetime import timedelta

import numpy as np
import pytest
from harness import run_spmd

TRANSPORTS = ["tcp", "shm"]


def body_killed_peer(rank, world_size):
    import xccl

    x = np.ones(1 << 16, np.float32)
    xccl.all_reduce(x)  # everyone is connected and healthy
    if rank == world_size - 1:
        os._exit(9)  # dies without a word while the others enter the next collective
    t0 = time.monotonic()
    with pytest.raises(xccl.XcclError) as info:
        xccl.all_reduce(x, algo="ring")
        xccl.barrier()  # a rank the dead one did not feed still fails here
    return str(info.value), type(info.value).__name__, time.monotonic() - t0


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_killed_peer_is_named(backend):
    n = 3
    res = run_spmd(
        body_killed_peer, n, backend=backend, timeout=60, pg_timeout=20, expect_exit={n - 1: 9}
    )
    for rank, out in enumerate(res[:-1]):
        msg, kind, waited = out
        assert f"rank {n - 1}" in msg, (rank, msg)
        assert kind in ("XcclConnectionError", "XcclTimeoutError", "XcclError"), kind
        assert waited < 20, (rank, waited)


def body_stalled_peer(rank, world_size):
    import xccl

    x = np.ones(16, np.float32)
    xccl.all_reduce(x)
    store = xccl._get_default_store()
    if rank == 1:
        # alive, connected, but does not take part: waits in Python until rank 0 gave up
        store.wait(["timed out"], timedelta(seconds=60))
        return None
    t0 = time.monotonic()
    with pytest.raises(xccl.XcclTimeoutError) as info:
        xccl.all_reduce(x, algo="ring")
    waited = time.monotonic() - t0
    store.set("timed out", b"1")
    return str(info.value), waited


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_stalled_peer_times_out_naming_it(backend):
    res = run_spmd(body_stalled_peer, 2, backend=backend, timeout=60, pg_timeout=2)
    msg, waited = res[0]
    assert "all_reduce" in msg and "timed out after 2.0 s" in msg, msg
    assert "rank 1" in msg, msg
    assert 1.5 < waited < 12, waited  # the 2 s timeout, with slack for a loaded machine


def body_mismatch(rank, world_size):
    import xccl

    x = np.zeros(4, np.float32)
    with pytest.raises(xccl.XcclMismatchError) as info:
        if rank == 0:
            xccl.all_reduce(x)
        else:
            xccl.broadcast(x, src=0)
    xccl.barrier()  # everyone saw its error before anyone leaves
    return str(info.value)


def test_mismatch_named_on_every_rank():
    msgs = run_spmd(body_mismatch, 4, timeout=60, pg_timeout=20)
    for m in msgs:
        assert "mismatch" in m and "all_reduce" in m and "broadcast" in m, m


def body_silent_mismatch(rank, world_size):
    import xccl

    # neither call sends anything before it waits (a reduce root and a broadcast leaf only
    # receive from each other): only the fingerprint check message can reveal the mismatch
    x = np.zeros(4, np.float32)
    t0 = time.monotonic()
    with pytest.raises(xccl.XcclMismatchError) as info:
        if rank == 0:
            xccl.reduce(x, dst=0, algo="linear")
        else:
            xccl.broadcast(x, src=0, algo="linear")
    return str(info.value), time.monotonic() - t0


def test_mismatch_found_when_no_data_moves():
    for msg, waited in run_spmd(body_silent_mismatch, 2, timeout=60, pg_timeout=20):
        assert "mismatch" in msg and "reduce" in msg and "broadcast" in msg, msg
        assert waited < 10, waited  # found at once, not by the 20 s timeout


BIG = (1 << 31) + 4099  # more than 2 GiB, not a multiple of anything convenient


def body_big_p2p(rank, world_size):
    import xccl

    buf = np.empty(BIG, np.uint8)
    if rank == 0:
        buf[:] = 0
        buf[::4096] = 7
        buf[-1] = 9
        xccl.send(buf, dst=1)
        return None
    buf[:] = 1
    src = xccl.recv(buf, src=0)
    # independent expectation: only the marked positions are non-zero
    marks = np.zeros(BIG, bool)
    marks[::4096] = True
    marks[-1] = True
    ok = bool(np.all(buf[marks] != 0) and not np.any(buf[~marks]))
    return src, ok, int(buf[-1]), int(buf[4096])


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_message_over_2gib(backend):
    res = run_spmd(body_big_p2p, 2, backend=backend, timeout=240, pg_timeout=200)
    assert res[1] == (0, True, 9, 7)


def body_p2p_failure_names_its_comm(rank, world_size):
    import xccl

    g = xccl.new_group([1, 2, 3])  # group ranks 0, 1, 2 are global ranks 1, 2, 3
    xccl.barrier()
    if rank == 3:
        os._exit(9)
    if rank != 1:
        return None
    buf = np.zeros(8, np.float32)
    with pytest.raises(xccl.XcclError) as info:
        xccl.recv(buf, src=3, group=g, tag=5)
    return str(info.value), g.group_name


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_p2p_failure_names_operation_comm_and_rank(backend):
    # a failed send or receive said only "receive from rank 2 failed: ...", with no word of
    # the operation or the communicator whose rank 2 that is (here global rank 3)
    res = run_spmd(body_p2p_failure_names_its_comm, 4, backend=backend, timeout=60,
                   pg_timeout=20, expect_exit={3: 9})
    msg, name = res[1]
    assert msg.startswith(f"recv (p2p, tag 5) on comm '{name}' failed on rank 0: "), msg
    assert "receive from rank 2" in msg, msg


def body_queued_send_to_dead_peer(rank, world_size):
    import xccl

    xccl.barrier()
    if rank == 1:
        time.sleep(0.5)  # rank 0's send is queued (the socket full), never received
        os._exit(9)
    big = np.ones(64 << 20, np.uint8)
    with pytest.raises(xccl.XcclError) as info:
        xccl.send(big, dst=1)
    return str(info.value)


def test_queued_tcp_send_to_dead_peer_says_why():
    # TCP failed the sends queued to a dead peer before telling the core why, so their
    # error read "send to rank 1 failed: XCCL_ERR_REMOTE" (found by tests/faults/driver.py,
    # seed 4 round 154); shm already set the reason first
    res = run_spmd(body_queued_send_to_dead_peer, 2, backend="tcp", timeout=60, pg_timeout=20,
                   expect_exit={1: 9})
    msg = res[0]
    assert "send to rank 1 failed: " in msg, msg
    assert "XCCL_ERR_REMOTE" not in msg and "connection to rank 1" in msg, msg


def body_stopped_rank_named_in_first_line(rank, world_size):
    import signal

    import xccl

    store = xccl._get_default_store()
    store.set(f"pid{rank}", str(os.getpid()).encode())
    x = np.ones(1 << 12, np.float32)
    xccl.all_reduce(x, algo="ring")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # stays stopped: rank 0 kills it at the end
        os._exit(3)  # not reached
    with pytest.raises(xccl.XcclTimeoutError) as info:
        xccl.all_reduce(x, algo="ring")  # rank r waits for rank r - 1: 2 for 1, 3 for 2, ...
    store.add("reported", 1)
    if rank == 0:
        store.wait(["reported"], timedelta(seconds=30))
        while int(store.add("reported", 0)) < world_size - 1:
            time.sleep(0.05)
        os.kill(int(store.get("pid1")), signal.SIGKILL)
    return str(info.value).split("\n")[0]


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_timeout_names_the_stopped_rank_first(backend):
    # In a ring with rank 1 stopped, rank 3 waits for rank 2, which waits for rank 1: rank 3's
    # timeout named only rank 2 in its first line (rank 1 only in the table under it). Found
    # by tests/faults/driver.py (seed 9, round 68: no survivor's error named the stopped rank).
    res = run_spmd(body_stopped_rank_named_in_first_line, 4, backend=backend, timeout=90,
                   pg_timeout=3, expect_exit={1: -9})
    for rank in (0, 2, 3):
        first = res[rank]
        assert "timed out after 3.0 s" in first, (rank, first)
        assert "no answer from rank 1 (stopped, dead, or not driving progress?)" in first, (
            rank, first)
    assert "waiting for a message from rank 2" in res[3], res[3]


def body_finished_op_failed_elsewhere(rank, world_size):
    import xccl

    store = xccl._get_default_store()
    xccl.barrier()  # everyone connected
    if rank == 2:
        os._exit(9)
    piece = np.full(4, rank + 1, np.float32)

    def refused():
        t1 = time.monotonic()
        with pytest.raises(xccl.XcclError) as later:
            xccl.all_reduce(piece)  # the communicator is broken: refused at once
        return str(later.value), type(later.value).__name__, time.monotonic() - t1

    if rank == 1:
        xccl.gather(piece, dst=0)  # its piece goes out eagerly: its part is done
        store.set("gathered", b"1")
        x = np.zeros(4, np.float32)
        t0 = time.monotonic()
        with pytest.raises(xccl.XcclError) as info:
            xccl.broadcast(x, src=0)  # rank 0 never posts it: its gather failed
        waited = time.monotonic() - t0
        later = refused()
        store.set("rank1 done", b"1")
    else:
        store.wait(["gathered"], timedelta(seconds=30))
        out = [np.zeros(4, np.float32) for _ in range(world_size)]
        t0 = time.monotonic()
        with pytest.raises(xccl.XcclError) as info:
            xccl.gather(piece, gather_list=out, dst=0)  # rank 2 is dead
        waited = time.monotonic() - t0
        # posts nothing until rank 1 has its errors (a later failure of rank 0's would
        # notify rank 1 under another sequence number)
        store.wait(["rank1 done"], timedelta(seconds=60))
        later = refused()
    return (str(info.value), waited) + later


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_failure_of_an_operation_a_rank_finished_breaks_its_next(backend):
    # Rank 1 finished a gather (its piece sent) that failed on rank 0 (rank 2 dead), then
    # waited in a broadcast that rank 0 never posts: the failure notice for the finished
    # gather was dropped, so rank 1 only timed out (20 s here). Now a member's failed
    # collective breaks the communicator on every member: operations posted after it fail
    # with the member's report, later posts are refused. Seen as a rare failure of
    # test_shm.py::test_killed_rank_mid_cma_all_reduce under load.
    res = run_spmd(body_finished_op_failed_elsewhere, 3, backend=backend, timeout=90,
                   pg_timeout=20, expect_exit={2: 9})
    msg0, waited0, later0, kind0, refused0 = res[0]
    msg1, waited1, later1, kind1, refused1 = res[1]
    assert "rank 2" in msg0 and waited0 < 10, (msg0, waited0)
    assert "broadcast" in msg1 and "rank 0 reported: " in msg1, msg1
    assert "rank 2" in msg1 and waited1 < 10, (msg1, waited1)
    for later, kind, refused in ((later0, kind0, refused0), (later1, kind1, refused1)):
        assert kind == "XcclConnectionError", (kind, later)
        assert "all_reduce on comm" in later and "refused, operation #" in later, later
        assert "rank 2" in later and refused < 5, (later, refused)
