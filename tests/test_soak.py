"""Runs the soak test (tests/soak.py) for one minute: 4 ranks on 2 hosts (shared memory and
TCP), 4 threads per rank on groups of their own, every result checked against numpy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import xccl

SOAK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "soak.py")
XCCL_PATH = os.path.dirname(os.path.dirname(os.path.abspath(xccl.__file__)))
MIN_OPS = 2000  # checked operations a one-minute run must reach (2-vCPU CI does > 10x this)


def test_soak_one_minute():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (XCCL_PATH, env.get("PYTHONPATH")) if p)
    res = subprocess.run(
        [sys.executable, SOAK, "--minutes", "1", "--np", "4", "--threads", "4", "--seed", "1"],
        env=env, capture_output=True, text=True, timeout=60 + 240,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-20000:]
    last = [line for line in out.splitlines() if line.startswith("SOAK ")]
    assert last, out[-5000:]
    summary = json.loads(last[-1][5:])
    assert summary["ok"] and not summary["problems"], summary
    assert summary["ops"] >= MIN_OPS, summary
    assert summary["bytes"] > 0 and summary["seconds"] >= 55, summary
    print(last[-1])
