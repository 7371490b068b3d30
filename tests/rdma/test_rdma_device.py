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
