"""Runs the soak test (tests/soak.py) for one minute: 4 ranks on 2 hosts (shared memory and
TCP), 4 threads per rank on groups of their own, every result checked against numpy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import soak

import xccl

SOAK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "soak.py")
XCCL_PATH = os.path.dirname(os.path.dirname(os.path.abspath(xccl.__file__)))
MIN_OPS = 10000  # checked operations a one-minute run must reach (this 2-vCPU VM: ~130000)


def _soak(*args: str, timeout: float) -> tuple[int, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (XCCL_PATH, env.get("PYTHONPATH")) if p)
    res = subprocess.run([sys.executable, SOAK, *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    return res.returncode, res.stdout + res.stderr


def test_rss_windows():
    flat = [(t * 0.5, 100.0 + (t % 7)) for t in range(240)]
    assert abs(soak.rss_windows(flat, 120.0)[2]) <= 6
    spike = [(t, r + (300.0 if 50 <= t < 52 else 0.0)) for t, r in flat]
    assert abs(soak.rss_windows(spike, 120.0)[2]) <= 6  # a transient peak is no leak
    climb = [(t, r + t) for t, r in flat]  # 1 MiB/s
    early, late, growth = soak.rss_windows(climb, 120.0)
    assert 60 < growth < 90 and late > early


def test_soak_fails_on_a_wrong_result():
    rc, out = _soak("--minutes", "0.2", "--np", "2", "--threads", "2", "--seed", "1",
                    "--timeout", "5", "--selftest", "wrong", timeout=200)
    assert rc == 1, out[-5000:]
    assert "soak FAILED: rank 0: thread 0: WrongResult" in out, out[-5000:]
    assert '"ok": false' in out, out[-5000:]


def test_soak_one_minute():
    rc, out = _soak("--minutes", "1", "--np", "4", "--threads", "4", "--seed", "1",
                    timeout=60 + 240)
    assert rc == 0, out[-20000:]
    last = [line for line in out.splitlines() if line.startswith("SOAK ")]
    assert last, out[-5000:]
    summary = json.loads(last[-1][5:])
    assert summary["ok"] and not summary["problems"], summary
    assert summary["ops"] >= MIN_OPS, summary
    assert summary["bytes"] > 0 and summary["seconds"] >= 55, summary
    print(last[-1])
