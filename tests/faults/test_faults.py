"""Runs the fault-injection driver (tests/faults/driver.py) for a fixed budget, and checks
that its checks can fail (self-test rounds with wrong data and leftovers).

``XCCL_FAULT_SEED`` (default 20) and ``XCCL_FAULT_BUDGET`` (seconds, default 70) change the
run; a failure quotes the driver's report, with the command that replays the failing round.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import xccl

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "driver.py")
XCCL_PATH = os.path.dirname(os.path.dirname(os.path.abspath(xccl.__file__)))

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and os.path.isdir("/dev/shm")
         and os.path.exists("/proc/net/unix")),
    reason="the driver needs Linux's /proc and /dev/shm",
)


def _driver(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # the ranks import the xccl this suite tests (installed, or the tree's python/)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (XCCL_PATH, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, DRIVER, *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_fault_rounds_within_budget():
    seed = os.environ.get("XCCL_FAULT_SEED", "20")
    budget = float(os.environ.get("XCCL_FAULT_BUDGET", "70"))
    # the last round may start just before the budget ends: 3 timeouts + 60 s + start-up
    res = _driver("--seed", seed, "--budget", str(budget), timeout=budget + 240)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-20000:]
    last = [line for line in out.splitlines() if line.startswith("fault driver: ")][-1]
    rounds = int(last.split("fault driver: ")[1].split()[0])
    assert rounds >= 3, last  # the budget ran rounds, not one slow start-up
    assert " 0 failed" in last, last
    print(last)


@pytest.mark.parametrize(
    "mode,want",
    [("wrong", "returned WRONG DATA"), ("leak", "LEFT processes")],
)
def test_driver_reports_violations(mode, want):
    res = _driver("--seed", "5", "--rounds", "1", "--selftest", mode, timeout=180)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-5000:]
    assert want in out and "replay: " in out and "--first-round 0" in out, out[-5000:]
    if mode == "leak":
        assert "LEFT temporary files" in out, out[-5000:]
