"""Device memory staged through registered host memory over RDMA: tests/c/test_stage (the core's
staging, with the fake asynchronous device executor of tests/c/fake_dev.h standing in for CUDA,
whose memory the CPU cannot touch) run with ibverbs as the transport between its ranks. The
binary comes from ``make -C tests/c`` on the host (the README's test command builds it)."""

from __future__ import annotations

import os
import subprocess

import pytest
from rdma_common import needs_ibverbs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BINARY = os.path.join(ROOT, "build", "ctest", "test_stage")


@needs_ibverbs
def test_device_memory_staged_over_ibverbs():
    if not os.access(BINARY, os.X_OK):
        pytest.skip(f"{BINARY} is not built: run make -C tests/c on the host first")
    proc = subprocess.run([BINARY], env={**os.environ, "XCCL_TEST_STAGE_TRANSPORT": "ibverbs"},
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "0 failed" in out, out[-4000:]
