"""Large messages that arrive before their receive is posted (csrc/core/ctx.c, defer()).

Over transports that can hold a message back (tcp, shm) the core answers "not yet" for up to
XCCL_DEFER_MS instead of staging the payload in a fresh buffer, so the payload later lands
straight in the receive's buffer. What a test can see of that is the sender: its send
completes only once the receiver takes the payload (shm: the receiver's cross-memory read;
tcp: the socket buffers are far smaller than the message), and a staged message is taken at
once.

Signals between the ranks go from rank 1 to rank 0 only: anything rank 0 sends to rank 1
queues behind the message held back.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from harness import run_spmd

BIG = 8 << 20  # float32 elements (32 MiB): CMA over shm, far over the socket buffers over tcp
TRANSPORTS = ["shm", "tcp"]


def body_sender_waits(rank, world_size, transport, idle_s):
    """Rank 0 sends BIG to rank 1, which posts its receive only after `idle_s` seconds (and a
    small message to rank 0 that says so). Returns, on rank 0, whether the send had completed
    by then; on rank 1, whether the data arrived intact."""
    import xccl

    assert xccl.group.WORLD.comm.peer_transport(1 - rank) == transport
    data = np.arange(BIG, dtype=np.float32)
    note = np.zeros(1, np.int64)
    if rank == 0:
        work = xccl.isend(data, 1, tag=1)
        xccl.recv(note, 1, tag=2)  # rank 1 has idled; nothing posted for tag 1 yet
        done_before = work.is_completed()
        work.wait()
        return done_before
    time.sleep(idle_s)
    note[0] = 1
    xccl.send(note, 0, tag=2)
    out = np.zeros(BIG, np.float32)
    xccl.recv(out, 0, tag=1)
    return bool(np.array_equal(out, data))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_held_back_until_the_receive(transport):
    env = {"XCCL_TRANSPORTS": transport, "XCCL_DEFER_MS": "60000"}
    res = run_spmd(body_sender_waits, 2, transport, 0.5, env=env, timeout=60)
    assert res == [False, True]  # the send waited for the receive; the data is intact


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("defer_ms", ["0", "50"])
def test_staged_when_off_or_after_the_limit(transport, defer_ms):
    """XCCL_DEFER_MS=0 stages at once; 50 ms stages once the limit has passed (rank 1 idles
    1 s, during which its progress thread keeps asking)."""
    env = {"XCCL_TRANSPORTS": transport, "XCCL_DEFER_MS": defer_ms}
    res = run_spmd(body_sender_waits, 2, transport, 1.0, env=env, timeout=60)
    assert res == [True, True]


def body_later_tag_first(rank, world_size, transport):
    """Rank 0 sends BIG (tag 1), then a small message (tag 2); rank 1 receives tag 2 first. The
    small one is behind the big one held back, so it arrives once the limit makes the core
    stage the big one: no deadlock, both intact."""
    import xccl

    assert xccl.group.WORLD.comm.peer_transport(1 - rank) == transport
    big = np.arange(BIG, dtype=np.float32)
    small = np.array([7, 8, 9], np.int64)
    if rank == 0:
        w1 = xccl.isend(big, 1, tag=1)
        w2 = xccl.isend(small, 1, tag=2)
        w1.wait()
        w2.wait()
        return True
    got_small = np.zeros(3, np.int64)
    got_big = np.zeros(BIG, np.float32)
    xccl.recv(got_small, 0, tag=2)
    xccl.recv(got_big, 0, tag=1)
    return bool(np.array_equal(got_small, small) and np.array_equal(got_big, big))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_later_tag_first_does_not_deadlock(transport):
    env = {"XCCL_TRANSPORTS": transport, "XCCL_DEFER_MS": "100"}
    assert run_spmd(body_later_tag_first, 2, transport, env=env, timeout=60) == [True, True]
