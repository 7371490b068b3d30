"""benchmarks/compare_gpu.py without a GPU: argument handling, the targets (met, missed, not
measured) and ratios on synthetic measurement records, the report's files, the deadline's
time shares, and one orchestration run in which xccl-bench runs on the CPU in place of the
GPU (the copy faked): quick."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "xccl_compare_gpu", ROOT / "benchmarks/compare_gpu.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


cg = _load()
cmp = cg.cmp
MiB = 1 << 20


def _row(op: str, n: int, size: int, time_us: float, busbw: float) -> dict[str, Any]:
    return {"op": op, "nranks": n, "size": size, "time_us": time_us, "busbw": busbw, "wrong": 0}


def _run(system: str, n: int, rows: list[dict[str, Any]]) -> Any:
    run = cmp.Run(system, n, 0, ["true"], {}, "/nonexistent.json", "/nonexistent.txt")
    run.rows, run.status = rows, "ok"
    return run


def _copy(**gbps: float) -> dict[int, dict[str, Any]]:
    sizes = {"s8": 8, "m1": MiB, "m256": 256 * MiB}
    return {
        sizes[k]: {"size": sizes[k], "gbps": v, "time_us": sizes[k] / v / 1e3}
        for k, v in gbps.items()
    }


def _rows(n: int, t_xccl: dict[tuple[str, int], float], busbw: dict[tuple[str, int], float]) -> Any:
    return [_row(op, n, size, t, busbw.get((op, size), 0.0)) for (op, size), t in t_xccl.items()]


def _good_np2() -> tuple[list[Any], dict[int, dict[str, Any]]]:
    """np=2: all_reduce 8 B in 12 µs, 256 MiB at 800 GB/s busbw (copy 1400: 57 %), every
    collective 25x gloo or more from 1 MiB (only 2x at 4 KiB, which the target ignores)."""
    xt: dict[tuple[str, int], float] = {}
    gt: dict[tuple[str, int], float] = {}
    for op in cg.COLLECTIVES:
        xt[(op, 4096)], gt[(op, 4096)] = 10.0, 20.0
        xt[(op, MiB)], gt[(op, MiB)] = 20.0, 500.0 if op != "broadcast" else 1000.0
        xt[(op, 256 * MiB)], gt[(op, 256 * MiB)] = 400.0, 40000.0
    xt[("all_reduce", 8)], gt[("all_reduce", 8)] = 12.0, 90.0
    xt[("pingpong", MiB)], gt[("pingpong", MiB)] = 20.0, 100.0  # p2p: not in the 20x target
    busbw = {("all_reduce", 256 * MiB): 800.0, ("all_gather", 256 * MiB): 700.0}
    runs = [_run("xccl", 2, _rows(2, xt, busbw)), _run("gloo", 2, _rows(2, gt, {}))]
    return runs, _copy(s8=0.004, m1=350.0, m256=1400.0)


# --- arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--np", "0"], "rank count"),
        (["--np", "2,x"], "rank count"),
        (["--systems", "xccl,nccl"], "unknown system"),
        (["--systems", ","], "no system"),
        (["--ops", "all_reduce,reduce"], "unknown op"),
        (["--sizes", "8,4Q"], "not a size"),
        (["--iters", "0"], "--iters"),
        (["--gloo-iters", "0"], "--gloo-iters"),
        (["--warmup", "-1"], "--warmup"),
        (["--mintime", "-1"], "--mintime"),
        (["--deadline", "-5"], "--deadline"),
        (["--op-timeout", "0"], "--op-timeout"),
    ],
)
def test_bad_arguments_rejected_before_anything_runs(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cg.main([*argv, "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing was started


def test_without_a_gpu_it_says_why_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if cg.gpu_problem() is None:
        pytest.skip("this machine has a GPU")
    assert cg.main(["--quick", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no usable GPU" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_plan_runs_np_by_np_xccl_first_with_capped_gloo(tmp_path: Path) -> None:
    loops = cg.default_loops(False)
    runs = cg.plan_runs(
        ["xccl", "gloo"],
        [2, 4],
        ["all_reduce", "pingpong"],
        "8,1024",
        loops,
        str(tmp_path),
        60.0,
        {},
    )
    assert [(r.system, r.nranks) for r in runs] == [
        ("xccl", 2),
        ("gloo", 2),
        ("xccl", 4),
        ("gloo", 4),
    ]
    for run in runs:
        cmd = run.cmd[len(cg.XCCL_BENCH) :]  # xccl-bench's arguments
        assert run.cmd[: len(cg.XCCL_BENCH)] == cg.XCCL_BENCH
        assert cmd[cmd.index("--device") + 1] == "cuda"
        assert cmd[cmd.index("--backend") + 1] == run.system
        assert cmd[cmd.index("--np") + 1] == str(run.nranks)
        assert cmd[cmd.index("-o") + 1] == "all_reduce,pingpong"
        assert cmd[cmd.index("--sizes") + 1] == "8,1024"
        assert cmd[cmd.index("-c") + 1] == "1"
        assert cmd[cmd.index("--placement") + 1] == "primary"
        assert cmd[cmd.index("-T") + 1] == "60"
        assert cmd[cmd.index("--json") + 1] == run.json_path
        assert run.json_path == str(tmp_path / f"{run.system}_np{run.nranks}.json")
    gloo = runs[1].cmd[len(cg.XCCL_BENCH) :]
    assert gloo[gloo.index("-n") + 1] == "2" and gloo[gloo.index("-w") + 1] == "1"
    xccl = runs[0].cmd[len(cg.XCCL_BENCH) :]
    assert xccl[xccl.index("-n") + 1] == "20" and xccl[xccl.index("-w") + 1] == "5"


def test_run_timeout_leaves_later_runs_their_reserve() -> None:
    # 200 s left, a gloo and an xccl run after this one: 200 - 20 - 30
    assert cg.run_timeout(200.0, ["gloo", "xccl"], 900.0) == 150.0
    assert cg.run_timeout(200.0, [], 900.0) == 200.0
    assert cg.run_timeout(200.0, [], 60.0) == 60.0  # --timeout caps it
    # little left: at least MIN_RUN_S, never more than what is left
    assert cg.run_timeout(40.0, ["gloo", "xccl", "gloo"], 900.0) == cg.MIN_RUN_S
    assert cg.run_timeout(cg.MIN_RUN_S - 1, [], 900.0) is None
    assert cg.run_timeout(float("inf"), ["xccl"], 900.0) == 900.0  # no deadline


# --- targets and ratios -----------------------------------------------------------------------


def test_targets_all_met_with_their_numbers() -> None:
    runs, copy = _good_np2()
    goals = cg.targets(cmp.index(runs), copy)
    assert [g.verdict for g in goals] == ["met", "met", "met"]
    assert goals[0].measured == "busbw 800.0 GB/s = 57.1% of copy 1400.0 GB/s"
    assert goals[1].measured == "12.0 µs"
    # the lowest ratios from 1 MiB: 25x (1 MiB, not broadcast's 50x), then 100x at 256 MiB
    assert goals[2].measured.startswith("lowest: ")
    assert "25.0x at 1 MiB" in goals[2].measured


def test_targets_missed_say_by_how_much() -> None:
    runs, copy = _good_np2()
    xccl = runs[0]
    for row in xccl.rows:
        if row["op"] == "all_reduce" and row["size"] == 256 * MiB:
            row["busbw"] = 600.0  # 42.9 % of 1400: needs 700
        if row["op"] == "all_reduce" and row["size"] == 8:
            row["time_us"] = 45.0  # 1.5x the 30 µs target
        if row["op"] == "all_gather" and row["size"] == MiB:
            row["time_us"] = 40.0  # gloo 500 / 40 = 12.5x
    goals = cg.targets(cmp.index(runs), copy)
    assert [g.verdict for g in goals] == ["missed", "missed", "missed"]
    assert goals[0].measured == (
        "busbw 600.0 GB/s = 42.9% of copy 1400.0 GB/s (needs 700.0 GB/s: 1.17x)"
    )
    assert goals[1].measured == "45.0 µs (1.50x the target)"
    assert goals[2].measured == "below: all_gather 12.5x at 1 MiB"


def test_targets_not_measured_and_only_at_np2() -> None:
    runs, copy = _good_np2()
    # gloo cut short before broadcast; np=4 rows, however bad, do not count
    runs[1].rows = [r for r in runs[1].rows if r["op"] != "broadcast"]
    runs.append(_run("xccl", 4, [_row("all_reduce", 4, 8, 500.0, 0.0)]))
    goals = cg.targets(cmp.index(runs), copy)
    assert [g.verdict for g in goals] == ["met", "met", "not measured"]
    assert "broadcast" in goals[2].measured
    # no copy at 256 MiB, no xccl rows at all
    goals = cg.targets(cmp.index(runs), _copy(m1=350.0))
    assert goals[0].verdict == "not measured" and "copy bandwidth" in goals[0].measured
    goals = cg.targets(cmp.index([]), copy)
    assert [g.verdict for g in goals] == ["not measured"] * 3


def test_op_table_and_summary_ratios() -> None:
    runs, copy = _good_np2()
    table = cmp.index(runs)
    rows = cg.op_table(table, copy, 2, "all_reduce")
    assert [r[0] for r in rows] == ["8 B", "4 KiB", "1 MiB", "256 MiB"]
    big = rows[-1]
    # xccl 400 µs (800 GB/s), gloo 40000 µs, copy 1400 GB/s, 100x gloo, 57.1 % of the copy
    assert big == ["256 MiB", "400.0 (800.000)", "40000 (0.000)", "1400.0", "100.00", "57.1%"]
    assert rows[1][3] == "-"  # no copy measured at 4 KiB
    assert rows[2][4] == "25.00"
    summary = {(r[0], r[1]): r for r in cg.summary_rows(table, copy, [2], list(cg.OPS))}
    ar = summary[("all_reduce", "2")]
    assert ar[2:] == ["8 B", "12.0", "90.0", "25.00", "256 MiB", "800.0", "57%"]
    assert summary[("broadcast", "2")][5] == "50.00"  # lowest from 1 MiB: 1000 / 20
    assert summary[("pingpong", "2")][5] == "5.00"


def test_report_files(tmp_path: Path) -> None:
    runs, copy = _good_np2()
    runs[0].meta = {"transports": ["cuda_ipc"]}
    settings = {"command": "compare_gpu.py", "date": "today", "elapsed": 12.0}
    info = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "cores": "16"}
    md, goals = cg.write_report(str(tmp_path), runs, copy, "ok", [2], list(cg.OPS), info, settings)
    text = Path(md).read_text()
    assert "| gpu | NVIDIA H100 80GB HBM3 |" in text and "| driver | 580.159.04 |" in text
    assert "| xccl np=2 | ok | 0 | cuda_ipc |" in text
    assert text.count("| **met** |") == 3
    assert "## all_reduce, np=2" in text and "## pingpong, np=2" in text
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert [t["verdict"] for t in data["targets"]] == ["met"] * 3
    assert data["meta"]["machine"]["driver"] == "580.159.04"
    assert [c["size"] for c in data["copy"]] == [8, MiB, 256 * MiB]
    assert data["runs"][0]["rows"] == runs[0].rows


# --- one orchestration run, the GPU replaced by the CPU ---------------------------------------


def test_orchestration_with_cpu_stand_ins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """compare_gpu's main end to end: xccl-bench runs with --device cuda removed (host
    memory, 2 ranks, two tiny sizes), the copy is faked; the report must hold the rows."""
    strip = (
        "import sys; from xccl.bench import main; a = sys.argv[1:]; "
        "i = a.index('--device'); del a[i:i + 2]; sys.exit(main(a))"
    )
    monkeypatch.setattr(cg, "XCCL_BENCH", [sys.executable, "-c", strip])
    monkeypatch.setattr(cg, "gpu_problem", lambda: None)
    monkeypatch.setattr(cg, "xccl_cuda_facts", lambda env: {"xccl.cuda.is_available()": "True"})

    def fake_copy(sizes: Any, mintime: float, raw: str, timeout: float, env: Any) -> Any:
        return {s: {"size": s, "gbps": 1.0, "time_us": s / 1e3} for s in sizes}, {}, "ok"

    monkeypatch.setattr(cg, "measure_copy", fake_copy)
    out = tmp_path / "out"
    argv = ["--np", "2", "--systems", "xccl", "--ops", "all_reduce,pingpong"]
    argv += ["--sizes", "8,1K", "-n", "2", "-w", "1", "--mintime", "0", "--out", str(out)]
    argv += ["--deadline", "100"]
    assert cg.main(argv) == 0
    printed = capsys.readouterr().out
    assert "# target: 8-byte all_reduce < 30 µs (np=2): " in printed
    data = json.loads((out / "gpu.json").read_text())
    [run] = data["runs"]
    assert run["status"] == "ok", run
    assert sorted((r["op"], r["size"]) for r in run["rows"]) == [
        ("all_reduce", 8),
        ("all_reduce", 1024),
        ("pingpong", 8),
        ("pingpong", 1024),
    ]
    assert all(r["wrong"] == 0 for r in run["rows"])
    assert (out / "gpu_raw" / "xccl_np2.txt").exists()
    text = (out / "gpu.md").read_text()
    assert "## all_reduce, np=2" in text and "| xccl np=2 | ok |" in text


def test_children_share_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cg.package_env()["CUDA_VISIBLE_DEVICES"] == "0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert cg.package_env()["CUDA_VISIBLE_DEVICES"] == "3"
    assert cg.package_env()["OMP_NUM_THREADS"] == "1"


def test_copy_measurement_arithmetic_on_a_stand_in() -> None:
    """The torch copy loop with torch's CUDA calls played by host tensors and a clock: rows
    per size, bytes copied per second, the copy checked, the GPU facts."""
    import time
    from types import SimpleNamespace

    torch = pytest.importorskip("torch")

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.t = 0.0

        def record(self) -> None:
            self.t = time.perf_counter()

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: Event) -> float:
            return (end.t - self.t) * 1e3  # ms, as torch.cuda.Event

    props = SimpleNamespace(
        name="Stand-in", major=9, minor=0, multi_processor_count=132, total_memory=80 << 30
    )
    fake = SimpleNamespace(
        __version__="2.11.0+cu130",
        version=SimpleNamespace(cuda="13.0"),
        device=lambda kind, index: torch.device("cpu"),
        randint=torch.randint,
        zeros_like=torch.zeros_like,
        equal=torch.equal,
        uint8=torch.uint8,
        cuda=SimpleNamespace(Event=Event, get_device_properties=lambda dev: props),
    )
    data = cg._copy_torch(fake, [8, 4096, MiB], 0.002)
    assert [r["size"] for r in data["rows"]] == [8, 4096, MiB]
    for row in data["rows"]:
        assert 5 <= row["iters"] <= 100_000
        assert row["gbps"] == pytest.approx(row["size"] / (row["time_us"] / 1e6) / 1e9)
    assert data["meta"]["gpu"] == "Stand-in" and data["meta"]["compute capability"] == "9.0"
    assert data["meta"]["multiprocessors"] == 132
    assert cg._iters_for(1e-3, 0.05) == 50 and cg._iters_for(0.0, 0.05) == 100_000
    assert cg._iters_for(10.0, 0.05) == 5


def test_deadline_cuts_a_hung_run_and_still_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that never ends (a stand-in printing one table row, then sleeping) is stopped at
    the deadline with its process group; the row its log shows is kept and the report is
    written; the run after it is skipped."""
    row = "8  2  float  sum  -1  N/A  N/A  N/A  N/A  12.50  0.001  0.001  0"  # in place
    hang = f"import sys, time; print('# all_reduce'); print({row!r}, flush=True); time.sleep(300)"
    monkeypatch.setattr(cg, "XCCL_BENCH", [sys.executable, "-c", hang])
    monkeypatch.setattr(cg, "MIN_RUN_S", 1.0)
    monkeypatch.setattr(cg, "RESERVE_S", {"xccl": 0.0, "gloo": 0.0})
    monkeypatch.setattr(cg, "gpu_problem", lambda: None)
    monkeypatch.setattr(cg, "xccl_cuda_facts", lambda env: {})
    monkeypatch.setattr(
        cg, "measure_copy", lambda sizes, mintime, raw, timeout, env: ({}, {}, "faked: none")
    )
    monkeypatch.setattr(cg.cmp, "machine_info", lambda: {"host": "test"})
    out = tmp_path / "out"
    argv = ["--np", "2", "--ops", "all_reduce", "--sizes", "8", "--out", str(out)]
    assert cg.main([*argv, "--deadline", "3"]) == 0
    data = json.loads((out / "gpu.json").read_text())
    xccl, gloo = data["runs"]
    assert xccl["status"].startswith("timed out") and "1 rows kept" in xccl["status"]
    assert xccl["rows"][0]["time_us"] == 12.5 and xccl["seconds"] < 10
    assert gloo["status"].startswith("skipped: deadline")
    goals = {t["name"].split(" (")[0]: t for t in data["targets"]}
    assert goals["8-byte all_reduce < 30 µs"]["verdict"] == "met"
    assert "| xccl np=2 | timed out" in (out / "gpu.md").read_text()
