"""xccl.launch: return values, streamed output, errors with the rank and its traceback,
hangs turned into a who-waits-for-whom table, timeouts, Ctrl-C, clean-up, and the
threads mode."""

from __future__ import annotations

import glob
import importlib
import os
import pickle
import signal
import tempfile
import threading
import time

import numpy as np
import pytest

import xccl
from xccl.launch import LaunchError, LaunchTimeoutError, launch

launch_mod = importlib.import_module("xccl.launch")  # xccl.launch is the function


def _waits_for(text: str, rank: int) -> bool:
    """Whether a diagnosis table says an operation waits for `rank`: a message from it, or
    (one-host algorithms) its writes to the node-shared segment."""
    return f"recv<-{rank}" in text or f"shm<-{rank}" in text


@pytest.fixture(autouse=True)
def private_tmp(tmp_path, monkeypatch):
    """Every launch of a test makes its directory under tmp_path, so that the clean-up
    checks see only this test's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    yield tmp_path
    assert glob.glob(str(tmp_path / "xccl-launch-*")) == [], "launch left its directory"


def _sum_of_ranks(n, scale=1):
    x = np.full(n, xccl.get_rank(), np.float32)
    xccl.all_reduce(x)
    print(f"rank sees {x[0]:g}")
    return float(x[0]) * scale


def _skip_collective(skipper):
    x = np.zeros(4, np.float32)
    if xccl.get_rank() != skipper:
        xccl.all_reduce(x)
    time.sleep(60)


def _raise_on(rank):
    if xccl.get_rank() == rank:
        time.sleep(0.5)  # the others are inside the all-reduce by then, even on a busy machine
        raise ValueError(f"boom from {rank}")
    x = np.zeros(4, np.float32)
    xccl.all_reduce(x)
    return xccl.get_rank()


# --------------------------------------------------------------------------------- processes


def test_values_in_rank_order_and_prefixed_output(capsys):
    assert launch(_sum_of_ranks, 4, 8, kwargs={"scale": 2}) == [12.0] * 4
    out = capsys.readouterr().out.splitlines()
    assert sorted(line for line in out if "rank sees" in line) == [
        f"[rank {r}] rank sees 6" for r in range(4)
    ]


def test_closures_lambdas_and_stderr(capsys):
    offset = 10

    def body():
        import sys

        print("to stderr", file=sys.stderr)
        return xccl.get_rank() + offset

    assert launch(body, 3) == [10, 11, 12]
    assert launch(lambda: xccl.get_world_size() * offset, 2) == [20, 20]
    err = capsys.readouterr().err
    assert "[rank 2] to stderr" in err


def test_one_rank_and_tcp():
    assert launch(_sum_of_ranks, 1, 4) == [0.0]
    assert launch(_sum_of_ranks, 2, 4, transport="tcp") == [1.0, 1.0]


def test_exception_names_rank_and_traceback():
    with pytest.raises(LaunchError) as info:
        launch(_raise_on, 3, 1, grace=0.5)
    e = info.value
    assert e.rank == 1 and e.exc_type == "ValueError"
    assert "rank 1 of 3 failed: ValueError: boom from 1" in str(e)
    assert "_raise_on" in e.remote_traceback and "raise ValueError" in e.remote_traceback
    assert "_child_main" not in e.remote_traceback  # starts in the user's code
    # The two others were stuck in the all-reduce, waiting for rank 1.
    lines = {line.split()[0]: line for line in e.table.splitlines()[1:]}
    assert "all_reduce" in lines["0"] and "pending" in lines["0"] and "<-1" in lines["0"]
    assert "failed" in lines["1"]
    assert "all_reduce" in lines["2"] and "pending" in lines["2"]


def test_operation_timeout_shows_who_waits_for_whom():
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_skip_collective, 3, 2, op_timeout=1.5, grace=0.5)
    assert time.monotonic() - t0 < 30
    e = info.value
    assert e.exc_type == "XcclTimeoutError" and e.rank in (0, 1)
    rows = {line.split()[0]: line for line in e.table.splitlines()[1:]}
    for r in ("0", "1"):
        assert "all_reduce" in rows[r] and "timed out" in rows[r] and _waits_for(rows[r], 2)
    assert "not in xccl" in rows["2"]


def test_launch_timeout():
    with pytest.raises(LaunchTimeoutError) as info:
        launch(_skip_collective, 2, 1, timeout=8)
    e = info.value
    assert isinstance(e, TimeoutError) and e.rank is None
    assert "did not finish within 8 s" in str(e)
    assert "pending" in e.table and _waits_for(e.table, 1)


def test_dead_rank_and_unpicklable_result():
    def die():
        if xccl.get_rank() == 1:
            os._exit(3)
        return 1

    with pytest.raises(LaunchError, match="rank 1 of 2 failed: process exited with status 3"):
        launch(die, 2)

    def lock():
        return threading.Lock()

    with pytest.raises(LaunchError, match="cannot be pickled"):
        launch(lock, 2)


def test_keyboard_interrupt_stops_every_rank(capsys):
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT))
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    t0 = time.monotonic()
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            launch(_skip_collective, 3, 0)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)
    assert time.monotonic() - t0 < 30
    assert "xccl.launch interrupted; where the ranks were" in capsys.readouterr().err
    # ... and it works again right away (the fixtures check that nothing was left behind)
    assert launch(_sum_of_ranks, 2, 1) == [1.0, 1.0]


def test_without_cloudpickle(monkeypatch):
    monkeypatch.setattr(launch_mod, "_pickler", lambda: pickle)
    assert launch(_sum_of_ranks, 2, 2) == [1.0, 1.0]  # importable: pickled by reference
    with pytest.raises(TypeError, match="install cloudpickle"):
        launch(lambda: 1, 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="nprocs"):
        launch(_sum_of_ranks, 0)
    with pytest.raises(ValueError, match="mode"):
        launch(_sum_of_ranks, 2, mode="fibers")
    with pytest.raises(ValueError):
        launch(_sum_of_ranks, 2, transport="carrier-pigeon")
    with pytest.raises(TypeError):
        launch(42, 2)


# ----------------------------------------------------------------------------------- threads


def test_threads_values_output_and_isolation(capsys):
    seen = []

    def body(n):
        seen.append(xccl.get_rank())  # the same list object in every rank
        return _sum_of_ranks(n)

    assert launch(body, 4, 3, mode="threads") == [6.0] * 4
    assert sorted(seen) == [0, 1, 2, 3]
    out = capsys.readouterr().out.splitlines()
    assert sorted(line for line in out if "rank sees" in line) == [
        f"[rank {r}] rank sees 6" for r in range(4)
    ]
    # The calling thread has no process group of its own, before or after.
    assert not xccl.is_initialized()
    assert launch(lambda: xccl.get_world_size(), 3, mode="threads") == [3, 3, 3]


def test_threads_exception_is_chained():
    with pytest.raises(LaunchError) as info:
        launch(_raise_on, 3, 2, mode="threads", grace=0.5)
    e = info.value
    assert e.rank == 2 and isinstance(e.__cause__, ValueError)
    assert str(e.__cause__) == "boom from 2"
    assert "pending" in e.table


def test_threads_operation_timeout():
    def body():
        x = np.zeros(4, np.float32)
        if xccl.get_rank() != 1:
            xccl.all_reduce(x)
        return xccl.get_rank()

    with pytest.raises(LaunchError) as info:
        launch(body, 2, mode="threads", op_timeout=1.0, grace=0.5)
    assert info.value.exc_type == "XcclTimeoutError"
    assert _waits_for(info.value.table, 1)


def test_package_names_stay_functions():
    import types

    import xccl.bench
    import xccl.launch  # noqa: F401 - modules of the same names as the functions
    import xccl.trace  # noqa: F401
    from xccl.teach.bench import bench

    assert xccl.launch is launch and callable(xccl.trace) and callable(xccl.explain)
    assert xccl.LaunchError is LaunchError and callable(xccl.debug.dump)
    # xccl.bench is the command line, a plain module; the teaching benchmark is xccl.teach.bench
    assert type(xccl.bench) is types.ModuleType and callable(xccl.bench.main)
    assert xccl.teach.bench is bench and "bench" not in xccl.__all__


def test_python_m_bench_runs_without_warnings():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-W", "error", "-m", "xccl.bench", "--help"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0 and "usage: xccl-bench" in out.stdout, out.stderr
    assert "Warning" not in out.stderr, out.stderr
