"""benchmarks/compare.py's argument handling, oversubscription mark, deadline and log fallback,
and the memory-system bound tool (benchmarks/membw.c). No benchmark is run: fast."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("xccl_compare", ROOT / "benchmarks/compare.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


compare = _load()


def _row(op: str, n: int, size: int, time_us: float, busbw: float) -> dict[str, Any]:
    return {"op": op, "nranks": n, "size": size, "time_us": time_us, "busbw": busbw, "wrong": 0}


def _run(system: str, n: int, rows: list[dict[str, Any]], cpus: int) -> Any:
    run = compare.Run(system, n, 0, ["true"], {}, "/nonexistent.json", "/nonexistent.txt")
    run.rows, run.status, run.cpus = rows, "ok", cpus
    run.oversubscribed = compare.is_oversubscribed(n, cpus)
    return run


# --- arguments --------------------------------------------------------------------------------


def test_parse_nps_any_count_in_order_without_duplicates() -> None:
    assert compare.parse_nps("8,16,32,64") == [8, 16, 32, 64]
    assert compare.parse_nps(" 4, 2,4 ,2") == [4, 2]
    for bad in ("0", "-1", "x", "2,,y", "", "1025", "2.5"):
        with pytest.raises(ValueError, match="--np"):
            compare.parse_nps(bad)


def test_parse_sizes() -> None:
    assert compare.parse_sizes("8,4K,64M,1G") == [8, 4096, 64 << 20, 1 << 30]
    for bad in ("0", "4X", "", "-8"):
        with pytest.raises(ValueError, match="--sizes"):
            compare.parse_sizes(bad)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--np", "0"], "rank count"),
        (["--np", "two"], "rank count"),
        (["--systems", "xccl-shm,nccl"], "unknown system"),
        (["--ops", "all_reduce,allreduce2"], "unknown op"),
        (["--sizes", "8,4Q"], "not a size"),
        (["--repeat", "0"], "--repeat"),
        (["--deadline", "-5"], "--deadline"),
        (["--mpi-bind", "socket2"], "invalid choice"),
    ],
)
def test_bad_arguments_rejected_before_anything_runs(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        compare.main([*argv, "--out", str(tmp_path), "--no-install"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "raw").exists()  # nothing was started


# --- the oversubscription mark ----------------------------------------------------------------


def test_oversubscribed_is_more_ranks_than_cpus() -> None:
    assert not compare.is_oversubscribed(2, 2)
    assert compare.is_oversubscribed(3, 2)
    assert compare.np_label(2, 2) == "2"
    assert compare.np_label(8, 2) == "8 (oversubscribed)"
    assert compare.cpus_available() == len(os.sched_getaffinity(0))


def test_plan_marks_runs_and_mpi_runs_unbound(tmp_path: Path) -> None:
    runs = compare.plan_runs(
        ["xccl-shm", "mpi-shm"],
        [2, 8],
        ["-o", "all_reduce"],
        str(tmp_path),
        "Open MPI 5.0.11",
        cpus=4,
    )
    assert [(r.system, r.nranks, r.oversubscribed) for r in runs] == [
        ("xccl-shm", 2, False),
        ("mpi-shm", 2, False),
        ("xccl-shm", 8, True),
        ("mpi-shm", 8, True),
    ]
    mpi = runs[3].cmd
    assert mpi[:3] == ["mpirun", "-np", "8"]
    assert "--oversubscribe" in mpi and "--use-hwthread-cpus" in mpi
    assert mpi[mpi.index("--bind-to") + 1] == "none"
    assert mpi[mpi.index("btl") + 1] == "self,sm"  # Open MPI 5 renamed vader


def test_tables_mark_oversubscribed_rows_only(tmp_path: Path) -> None:
    big = compare.BIG
    runs = [
        _run(
            "xccl-shm",
            2,
            [_row("broadcast", 2, 8, 1.0, 0.01), _row("broadcast", 2, big, 1e4, 6.0)],
            2,
        ),
        _run(
            "mpi-shm",
            2,
            [_row("broadcast", 2, 8, 2.0, 0.0), _row("broadcast", 2, big, 2e4, 3.0)],
            2,
        ),
        _run(
            "xccl-shm",
            8,
            [_row("broadcast", 8, 8, 4.0, 0.0), _row("broadcast", 8, big, 4e4, 1.5)],
            2,
        ),
    ]
    systems, nps, ops = ["xccl-shm", "mpi-shm"], [2, 8], ["broadcast"]
    table = compare.index(runs)
    lines = compare.summary(table, systems, nps, ops, cpus=2)
    rows = [ln for ln in lines if ln.startswith("| broadcast |")]
    np_cells = {r.split("|")[2].strip() for r in rows}
    assert np_cells == {"2", "8 (oversubscribed)"}
    assert any("oversubscribed" in ln and "2 CPUs" in ln for ln in lines)
    # Speed-up geomean at np=2: sqrt(2/1 * 2e4/1e4) = 2.
    assert any(r.startswith("| broadcast | 2 |") and "| 2.00 |" in r for r in rows)

    bounds = {2: {"size": big, "aggregate_gbps": 16.0, "per_stream_gbps": 8.0}}
    bound = compare.bound_table(table, systems, nps, bounds, cpus=2)
    row = next(ln for ln in bound if ln.startswith("| 2 |"))
    assert "**8.00**" in row and "6.00 (75%)" in row and "3.00 (38%)" in row

    md = tmp_path / "compare.md"
    settings = {
        "command": "compare.py --np 2,8",
        "date": "today",
        "elapsed": 1.0,
        "load_before": "0",
        "load_after": "0",
        "bench": "-o broadcast",
        "repeat": 1,
        "thp": False,
    }
    compare.write_markdown(str(md), runs, systems, nps, ops, {}, 10.0, settings, bounds, 2)
    text = md.read_text()
    assert "## broadcast, np=8: OVERSUBSCRIBED (8 ranks on 2 CPUs)" in text
    assert "## broadcast, np=2\n" in text
    assert "| xccl-shm np=8 (oversubscribed) | ok |" in text
    assert "| xccl-shm np=2 | ok |" in text


def test_targets_count_rows_slower_than_mpi() -> None:
    big = compare.BIG
    mine = [_row("all_reduce", 16, 8, 2.5, 0), _row("all_reduce", 16, 64, 9.0, 0)]
    mine += [_row("broadcast", 16, big, 1e4, 7.5), _row("all_gather", 16, big, 1e4, 6.0)]
    theirs = [_row("all_reduce", 16, 8, 3.0, 0), _row("all_reduce", 16, 64, 4.5, 0)]
    theirs += [_row("broadcast", 16, big, 2e4, 1.0)]
    table = compare.index([_run("xccl-shm", 16, mine, 16), _run("mpi-shm", 16, theirs, 16)])
    bounds = {16: {"size": big, "aggregate_gbps": 160.0, "per_stream_gbps": 10.0}}
    lines = compare.targets(table, [16], ["all_reduce", "broadcast", "all_gather"], bounds, 16)
    row = next(ln for ln in lines if ln.startswith("| 16 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["16", "1 of 3", "all_reduce 64 B 2.00x", "2.50", "75%", "60% (missed)"]


def test_row_near_takes_rounded_sizes_only() -> None:
    rows = {8: {"size": 8}, (64 << 20) - 12: {"size": (64 << 20) - 12}}
    assert compare.row_near(rows, 64 << 20) == {"size": (64 << 20) - 12}  # np=3: whole shares
    assert compare.row_near(rows, 16 << 20) is None
    assert compare.row_near({}, 8) is None


def test_printed_ratios_mark_oversubscribed(capsys: pytest.CaptureFixture[str]) -> None:
    runs = [
        _run("xccl-shm", 2, [_row("all_reduce", 2, 8, 1.0, 0.0)], 2),
        _run("gloo", 2, [_row("all_reduce", 2, 8, 3.0, 0.0)], 2),
        _run("xccl-shm", 4, [_row("all_reduce", 4, 8, 2.0, 0.0)], 2),
        _run("gloo", 4, [_row("all_reduce", 4, 8, 8.0, 0.0)], 2),
    ]
    compare.print_ratios(runs, [2, 4], ["all_reduce"], cpus=2)
    out = capsys.readouterr().out.splitlines()
    assert any("'!'" in ln and "2 CPUs" in ln for ln in out)
    two = next(ln for ln in out if ln.split()[:2] == ["all_reduce", "2"])
    four = next(ln for ln in out if ln.split()[:2] == ["all_reduce", "4!"])
    assert two.split()[4] == "3.00" and four.split()[4] == "4.00"


# --- a run cut short --------------------------------------------------------------------------

# The format of xccl-bench's and mpi_bench.py's tables (columns padded there, split here).
_LOG = """\
# compare: xccl-shm, 2 ranks on 2 CPUs: not oversubscribed
$ xccl-bench ...
# all_reduce
#  size  count  type  redop  root  time  algbw  busbw  #wrong  time  algbw  busbw  #wrong
     8      2  float   sum   -1   N/A   N/A    N/A    N/A      1.63  0.005  0.005   0
 1048576  262144  float  sum  -1  N/A  N/A    N/A    N/A    613.79  1.708  1.708   0
# Out of bounds values : 0 OK
# all_gather
    16      2  float  none   -1   7.45  0.002  0.001    3     N/A    N/A    N/A    N/A
"""


def test_rows_from_log(tmp_path: Path) -> None:
    path = tmp_path / "run.txt"
    path.write_text(_LOG)
    rows = compare.rows_from_log(str(path), 2)
    got = [(r["op"], r["size"], r["placement"], r["time_us"], r["busbw"], r["wrong"]) for r in rows]
    assert got == [
        ("all_reduce", 8, "in", 1.63, 0.005, 0),
        ("all_reduce", 1048576, "in", 613.79, 1.708, 0),
        ("all_gather", 16, "out", 7.45, 0.001, 3),
    ]


_SLOW = """\
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(sys.argv[1], "w") as f:
    f.write(str(child.pid))
print("# all_reduce")
print("           8             2     float     sum      -1       N/A      N/A      N/A     N/A"
      "      2.50    0.003    0.003       0", flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_timeout_stops_the_whole_run_and_keeps_its_rows(tmp_path: Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text(_SLOW)
    pidfile = tmp_path / "child.pid"
    run = compare.Run(
        "xccl-shm",
        8,
        0,
        [sys.executable, str(script), str(pidfile)],
        {},
        str(tmp_path / "r.json"),
        str(tmp_path / "r.txt"),
    )
    run.cpus, run.oversubscribed = 2, True
    t0 = time.monotonic()
    compare.execute(run, timeout=5.0)  # the script prints its row at once, then sleeps
    assert time.monotonic() - t0 < 60
    assert run.status.startswith("timed out after 5 s (1 rows")
    assert [(r["op"], r["size"], r["time_us"]) for r in run.rows] == [("all_reduce", 8, 2.5)]
    assert run.meta["compare"] == {
        "system": "xccl-shm",
        "nranks": 8,
        "cpus": 2,
        "oversubscribed": True,
    }
    assert "8 ranks on 2 CPUs: oversubscribed" in (tmp_path / "r.txt").read_text().splitlines()[0]
    assert (tmp_path / "r.json").exists()
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 20
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child), "the run's own child outlived its timeout"


# --- the memory-system bound ------------------------------------------------------------------


@pytest.fixture(scope="module")
def membw(tmp_path_factory: pytest.TempPathFactory) -> str:
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    exe, why = compare.build_membw(str(tmp_path_factory.mktemp("membw")))
    assert exe is not None, why
    return exe


def test_membw_two_streams(membw: str) -> None:
    for shared in (False, True):
        b = compare.memory_bound(membw, 2, 1 << 20, shared_src=shared, mintime=0.01, rounds=2)
        assert b["procs"] == 2 and b["size"] == 1 << 20 and b["shared_src"] is shared
        assert b["aggregate_gbps"] > 0 and b["copies"] >= 1 and b["seconds"] > 0
        # aggregate = streams x bytes x copies / round time; per stream = aggregate / streams.
        expect = 2 * (1 << 20) * b["copies"] / b["seconds"] / 1e9
        assert b["aggregate_gbps"] == pytest.approx(expect, rel=1e-3)
        assert b["per_stream_gbps"] == pytest.approx(b["aggregate_gbps"] / 2, rel=1e-3)
        # The round lasts at least as long as each stream, so no stream beats the mean by more
        # than the aggregate allows.
        assert 0 < b["min_stream_gbps"] <= b["max_stream_gbps"]
        assert b["per_stream_gbps"] <= b["max_stream_gbps"] * (1 + 1e-3)


def test_membw_rejects_bad_arguments(membw: str) -> None:
    with pytest.raises(ValueError):
        compare.memory_bound(membw, 0, 1 << 20)
    for args in (["-p", "0"], ["-s", "0"], ["-s", "12Q"], ["--rounds", "65"], ["--bogus"]):
        out = compare.subprocess.run([membw, *args], capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and "membw:" in out.stderr, (args, out.stderr)


def test_measure_bounds_writes_raw(tmp_path: Path) -> None:
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    bounds = compare.measure_bounds([1, 2], 256 << 10, False, str(tmp_path), mintime=0.01)
    assert set(bounds) == {1, 2}
    assert all(b["per_stream_gbps"] > 0 and b["shared"]["shared_src"] for b in bounds.values())
    raw = (tmp_path / "membw.json").read_text()
    assert '"1"' in raw and '"2"' in raw


def test_module_docstring_names_the_mark() -> None:
    doc = textwrap.dedent(compare.__doc__ or "")
    assert "oversubscribed" in doc and "--bind-to none" in doc and "membw" in doc


def test_sigterm_stops_the_run_and_keeps_its_rows(tmp_path: Path) -> None:
    """A time limit's SIGTERM ends the run in progress (its processes too) and lets compare.py
    write its report: execute raises Stopped after keeping the rows."""
    import signal
    import threading

    script = tmp_path / "slow.py"
    script.write_text(_SLOW)
    pidfile = tmp_path / "child.pid"
    run = compare.Run(
        "gloo", 2, 0, [sys.executable, str(script), str(pidfile)], {},
        str(tmp_path / "r.json"), str(tmp_path / "r.txt"),
    )  # fmt: skip
    old = signal.signal(signal.SIGTERM, compare._on_signal)

    def term_once_printed() -> None:  # SIGTERM once the run has printed its row
        log = tmp_path / "r.txt"
        for _ in range(1200):
            if log.exists() and "all_reduce" in log.read_text() and pidfile.exists():
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    timer = threading.Thread(target=term_once_printed, daemon=True)
    try:
        timer.start()
        with pytest.raises(compare.Stopped, match="SIGTERM"):
            compare.execute(run, timeout=100.0)
    finally:
        timer.join()
        signal.signal(signal.SIGTERM, old)
        compare._STOP.clear()
    assert run.status.startswith("stopped after") and "(1 rows" in run.status
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 20
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child)


def test_baseline_marks_slower_rows(tmp_path: Path) -> None:
    import json

    raw = tmp_path / "raw"
    raw.mkdir()
    rows = {
        "xccl-shm_np2_r1.json": [
            _row("all_reduce", 2, 8, 2.0, 0),
            _row("all_reduce", 2, 64, 5.0, 0),
        ],
        "xccl-shm_np2_r2.json": [_row("all_reduce", 2, 8, 1.0, 0)],  # the fastest counts
        "gloo_np4.json": [_row("broadcast", 4, 8, 100.0, 0)],
        "notes.json": [_row("broadcast", 4, 8, 1.0, 0)],  # not a run: ignored
    }
    for name, rs in rows.items():
        (raw / name).write_text(json.dumps({"meta": {}, "rows": rs}))
    base = compare.load_baseline(str(tmp_path))
    assert base[("xccl-shm", 2, "all_reduce")][8]["time_us"] == 1.0
    assert set(base) == {("xccl-shm", 2, "all_reduce"), ("gloo", 4, "broadcast")}

    xccl = [_row("all_reduce", 2, 8, 1.05, 0), _row("all_reduce", 2, 64, 6.0, 0)]
    gloo = [_row("broadcast", 4, 8, 50.0, 0), _row("broadcast", 4, 4096, 9.0, 0)]
    now = compare.index([_run("xccl-shm", 2, xccl, 2), _run("gloo", 4, gloo, 2)])
    got = compare.baseline_rows(
        now, base, ["xccl-shm", "gloo"], [2, 4], ["all_reduce", "broadcast"]
    )
    assert got == [
        ("xccl-shm", "all_reduce", 2, 8, 1.0, 1.05),
        ("xccl-shm", "all_reduce", 2, 64, 5.0, 6.0),
        ("gloo", "broadcast", 4, 8, 100.0, 50.0),
    ]
    lines = compare.baseline_table(got, 0.10, cpus=2)
    marked = [ln for ln in lines if "**SLOWER**" in ln and ln.startswith("| ")]
    assert len(marked) == 1 and "| 64 B |" in marked[0] and "| 1.20 |" in marked[0]
    assert any(ln.startswith("| gloo | 1 | 0 | 0.50 |") for ln in lines)
    assert any(ln.startswith("| gloo | broadcast | 4 (oversubscribed) |") for ln in lines)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no raw results"):
        compare.load_baseline(str(empty))
