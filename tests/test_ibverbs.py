"""The ibverbs (RDMA) transport where there is no RDMA: it must say why it cannot run, and
leave tcp/shm to carry the job. (Its data path is tested on a real soft-RoCE device in a VM:
tests/rdma/.)

On a machine with an RDMA device these tests skip: there the transport is usable.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from harness import run_spmd


def _has_rdma_device() -> bool:
    try:
        return len(os.listdir("/sys/class/infiniband")) > 0
    except OSError:
        return False


pytestmark = pytest.mark.skipif(_has_rdma_device(), reason="this machine has an RDMA device")


def body_create_error(rank, world_size, tmp):
    """Creates a process group with the environment given; returns the error text (or '')."""
    import xccl

    try:
        xccl.init_process_group("auto", init_method=f"file://{tmp}/store", rank=rank,
                                world_size=world_size)
    except Exception as e:  # noqa: BLE001 - the text and class are what is checked
        return f"{type(e).__name__}: {e}"
    xccl.destroy_process_group()
    return ""


def _create_error(tmp_path, env) -> str:
    res = run_spmd(body_create_error, 1, str(tmp_path), env=env, init=False, timeout=60)
    return res[0]


def _skip_if_not_built(msg: str) -> None:
    if "no transport matches" in msg:
        pytest.skip("xccl was built without the ibverbs transport (no <infiniband/verbs.h>)")


def test_only_ibverbs_names_the_reason(tmp_path):
    """XCCL_TRANSPORTS=ibverbs on a machine without RDMA: the creation error says which
    transport was asked for and why it is not usable."""
    msg = _create_error(tmp_path, {"XCCL_TRANSPORTS": "ibverbs"})
    _skip_if_not_built(msg)
    assert msg.startswith("NotImplementedError"), msg
    assert "XCCL_TRANSPORTS='ibverbs'" in msg, msg
    assert "ibverbs not usable: " in msg, msg
    # no device (the kernel has no RDMA), or libibverbs not installed at all
    assert "no RDMA device" in msg or "cannot load libibverbs" in msg, msg


def test_library_missing_is_named(tmp_path):
    env = {"XCCL_TRANSPORTS": "ibverbs", "XCCL_IB_LIBRARY": "libxccl-no-such-verbs.so.1"}
    msg = _create_error(tmp_path, env)
    _skip_if_not_built(msg)
    assert "ibverbs not usable: cannot load libxccl-no-such-verbs.so.1" in msg, msg


def test_bad_hca_spec_is_an_error(tmp_path):
    """A malformed XCCL_IB_HCA is a user error, reported as such even without a device."""
    env = {"XCCL_TRANSPORTS": "ibverbs,tcp", "XCCL_IB_HCA": "mlx5_0:x"}
    msg = _create_error(tmp_path, env)
    _skip_if_not_built(msg)
    assert msg.startswith("ValueError"), msg
    assert "XCCL_IB_HCA='mlx5_0:x'" in msg and "port must be a number" in msg, msg


def body_fallback(rank, world_size):
    import xccl

    comm = xccl.group.WORLD.comm
    peers = [comm.peer_transport(p) for p in range(world_size) if p != rank]
    x = np.arange(1000, dtype=np.float64) * (rank + 1)
    xccl.all_reduce(x)
    ok = np.array_equal(x, np.arange(1000, dtype=np.float64) * 3)
    return peers, bool(ok)


def test_tcp_carries_on(tmp_path):
    """ibverbs first in the list but unusable: tcp carries the job."""
    env = {"XCCL_TRANSPORTS": "ibverbs,tcp"}
    res = run_spmd(body_fallback, 2, env=env, timeout=60)
    assert res == [(["tcp"], True), (["tcp"], True)]
