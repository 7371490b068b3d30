"""The sanitizer run's own checks: that a rank's leak and a rank's memory error fail the test
that started it. Skipped outside tests/san/run-python.sh (``XCCL_TEST_LSAN=1``)."""

from __future__ import annotations

import ctypes
import os

import pytest
from harness import SpmdError, run_spmd

pytestmark = pytest.mark.skipif(
    os.environ.get("XCCL_TEST_LSAN") != "1", reason="only under tests/san/run-python.sh"
)


def body_leak(rank: int, world_size: int) -> int:
    """Allocates blocks and drops every pointer to them (no xccl involved)."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = None  # the address is never kept, not even in a Python int
    libc.malloc.argtypes = [ctypes.c_size_t]
    for _ in range(32):
        libc.malloc(4000 + rank)
    return rank


def body_overflow(rank: int, world_size: int, report_dir: str) -> int:
    """Writes past the end of a heap buffer (AddressSanitizer aborts the rank); its report goes
    to `report_dir` instead of the run's report directory."""
    rt = ctypes.CDLL(None)
    rt.__sanitizer_set_report_path(os.path.join(report_dir, "asan").encode())
    buf = ctypes.create_string_buffer(8)
    ctypes.memset(ctypes.addressof(buf), 0, 64)
    return rank


def test_a_leak_in_a_rank_fails_the_test():
    with pytest.raises(SpmdError) as info:
        run_spmd(body_leak, 2, init=False, timeout=120)
    text = str(info.value)
    assert text.count("LeakSanitizer found") == 2, text


def test_a_memory_error_in_a_rank_fails_the_test(tmp_path):
    with pytest.raises(SpmdError) as info:
        run_spmd(body_overflow, 1, str(tmp_path), init=False, timeout=120)
    assert "exited with code 1 without a result" in str(info.value), str(info.value)
    reports = [p.read_text() for p in tmp_path.iterdir()]
    assert len(reports) == 1 and "heap-buffer-overflow" in reports[0], reports
