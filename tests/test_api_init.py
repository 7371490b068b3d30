"""Rendezvous methods, backends, monitored_barrier and failure behaviour, with real ranks."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import numpy as np
import pytest
from harness import run_spmd


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def body_init(rank, size, method, port, backend):
    import xccl as dist

    kwargs = {"timeout": timedelta(seconds=30)}
    if method == "env":
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
        dist.init_process_group(backend, **kwargs)
    elif method == "slurm":
        os.environ.update(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS=str(size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        dist.init_process_group(backend, init_method="env://", **kwargs)
    elif method == "ompi":
        os.environ.update(
            OMPI_COMM_WORLD_RANK=str(rank),
            OMPI_COMM_WORLD_SIZE=str(size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        dist.init_process_group(backend, **kwargs)
    elif method == "tcp":
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}?rank={rank}&world_size={size}", **kwargs
        )
    elif method == "tcp-args":
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, **kwargs
        )
    elif method == "store":
        store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timedelta(seconds=30))
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, **kwargs)
    elif method == "torch-store":
        import torch.distributed as tdist

        store = tdist.TCPStore("127.0.0.1", port, size, rank == 0, timedelta(seconds=30))
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, **kwargs)
    else:
        raise AssertionError(method)
    assert (dist.get_rank(), dist.get_world_size()) == (rank, size)
    assert dist.get_backend() == backend.lower()
    t = np.full(33, rank + 1.0)
    dist.all_reduce(t)
    assert (t == size * (size + 1) / 2).all()
    objs = [None] * size
    dist.all_gather_object(objs, method)
    assert objs == [method] * size
    dist.destroy_process_group()
    assert not dist.is_initialized()
    return True


@pytest.mark.parametrize(
    "method,backend",
    [
        ("env", "gloo"),
        ("slurm", "auto"),
        ("ompi", "tcp"),
        ("tcp", "shm"),
        ("tcp-args", "cpu:gloo,cuda:nccl"),
        ("store", "TCP"),
        ("torch-store", "nccl"),
    ],
)
def test_init_methods(method, backend):
    if method == "torch-store":
        pytest.importorskip("torch")
    size = 3
    env = {
        k: ""
        for k in (
            "RANK",
            "WORLD_SIZE",
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
        )
    }
    got = run_spmd(body_init, size, method, _free_port(), backend, init=False, env=env, timeout=90)
    assert got == [True] * size


def test_init_with_auth_key():
    env = {"XCCL_AUTH_KEY": "job-secret-42"}
    assert run_spmd(body_init, 2, "env", _free_port(), "tcp", init=False, env=env, timeout=90) == [
        True,
        True,
    ]


def body_monitored(rank, size, late, wait_all):
    import xccl as dist

    dist.monitored_barrier(timeout=timedelta(seconds=20))  # everyone arrives
    dist.monitored_barrier(timeout=5.0, wait_all_ranks=True)
    store = dist._get_default_store()
    if rank in late:  # arrives once the others have given up on it
        store.wait([f"gave up {r}" for r in range(size) if r not in late], timedelta(seconds=60))
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=1), wait_all_ranks=wait_all)
    except dist.XcclError as exc:
        return type(exc).__name__, str(exc)
    finally:
        store.set(f"gave up {rank}", b"1")
    return None


def test_monitored_barrier_names_late_ranks():
    got = run_spmd(body_monitored, 3, [2], False, timeout=90)
    kind, msg = got[0]
    assert kind == "XcclTimeoutError" and "Rank 2 failed to pass monitoredBarrier" in msg
    assert "rank 0 reported that rank(s) 2 failed" in got[1][1]
    # the late rank fails too: no answer from rank 0, or rank 0 already gone
    assert got[2][0] in ("XcclTimeoutError", "XcclConnectionError"), got[2]


def test_monitored_barrier_wait_all_ranks():
    got = run_spmd(body_monitored, 4, [1, 3], True, timeout=90)
    assert "Ranks 1, 3 failed to pass monitoredBarrier" in got[0][1]
    assert "rank(s) 1, 3" in got[2][1]
    assert got[1] is not None and got[3] is not None


def body_destroy_does_not_block(rank, size):
    import xccl as dist

    if rank == 0:
        dist.barrier()
        t0 = time.monotonic()
        dist.destroy_process_group()  # rank 1 still has a receive from us pending
        assert time.monotonic() - t0 < 15.0  # not waiting for rank 1 (the timeout is 30 s)
        return "destroyed"
    work = dist.irecv(np.zeros(4), src=0)
    dist.barrier()
    t0 = time.monotonic()
    with pytest.raises(dist.XcclError):
        work.wait()
    assert time.monotonic() - t0 < 20.0
    assert work.is_completed() and not work.is_success()
    assert isinstance(work.exception(), dist.XcclError)
    dist.destroy_process_group()
    return "peer failure seen"


def test_destroy_does_not_block_and_peers_see_it():
    got = run_spmd(body_destroy_does_not_block, 2, timeout=60, pg_timeout=30)
    assert got == ["destroyed", "peer failure seen"]


def body_mismatch(rank, size):
    import xccl as dist

    t = np.zeros(4 + rank, np.float32)  # different sizes on each rank
    try:
        dist.all_reduce(t)
    except dist.XcclError as exc:
        return type(exc).__name__
    return "no error"


def test_mismatched_collectives_raise():
    got = run_spmd(body_mismatch, 2, timeout=60, pg_timeout=20)
    assert all(g != "no error" for g in got), got
