"""What the RDMA tests share: the transport under test, the devices present, the skips.

The suite runs in the soft-RoCE VM (tests/rdma/run-in-vm.sh). On a machine without an RDMA
device (``/sys/class/infiniband`` absent or empty: ``ibv_devices`` finds nothing) the tests
that need one skip, so the project's plain ``pytest tests`` passes there.

``XCCL_RDMA_TEST_TRANSPORT`` (default ``ibverbs``) is the transport the data-path tests put
between ranks. Set to ``tcp``, the same tests check the harness and the tests themselves
against the TCP transport, on any machine; the tests of the ibverbs transport's own features
(device choice, registration cache) skip then.
"""

from __future__ import annotations

import os
from typing import Optional

import pytest

TRANSPORT = os.environ.get("XCCL_RDMA_TEST_TRANSPORT", "ibverbs")
SYSFS = "/sys/class/infiniband"


def rdma_devices() -> list[str]:
    """The RDMA devices of this machine (what ``ibv_devices`` lists), sorted."""
    try:
        return sorted(os.listdir(SYSFS))
    except OSError:
        return []


def port_counter(device: str, name: str, port: int = 1) -> int:
    """A port counter of ``device`` (rxe: ``sent_pkts``, ``rcvd_pkts``), read from sysfs."""
    with open(f"{SYSFS}/{device}/ports/{port}/hw_counters/{name}") as f:
        return int(f.read())


def _no_device_reason() -> Optional[str]:
    if TRANSPORT != "ibverbs" or rdma_devices():
        return None
    return "no RDMA device here (ibv_devices finds none): run tests/rdma/run-in-vm.sh"


#: data-path tests: need a device unless another transport stands in for ibverbs
needs_transport = pytest.mark.skipif(_no_device_reason() is not None,
                                     reason=_no_device_reason() or "")

#: tests of the ibverbs transport itself: need a device and XCCL_RDMA_TEST_TRANSPORT=ibverbs
needs_ibverbs = pytest.mark.skipif(
    TRANSPORT != "ibverbs" or not rdma_devices(),
    reason=f"checks the ibverbs transport on a device (transport {TRANSPORT!r}, "
    f"devices {rdma_devices() or 'none'}): run tests/rdma/run-in-vm.sh",
)


def env(**extra: str) -> dict[str, str]:
    """The ranks' environment: every peer over the transport under test, plus ``extra``."""
    out = {"XCCL_TRANSPORTS": TRANSPORT}
    out.update(extra)
    return out
