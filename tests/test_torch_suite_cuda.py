"""tests/torch_suite's CUDA mode without a GPU: the static selection and prefilter over the
installed torch's distributed_test.py (expectations read from the file's text, not from its
syntax tree), on a small made-up file, and one run of a few CUDA tests on both backends,
which skip here for want of CUDA (reported as skipped, not failed), and one whose budget is
spent before any test starts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "tests" / "torch_suite"
sys.path.insert(0, str(SUITE))

import cuda_select  # noqa: E402 - after the path

SOURCE = Path(cuda_select.test_file()).read_text()
LINES = SOURCE.splitlines()


def decorators(name: str) -> str:
    """The text above ``def name(`` up to the previous blank line: the decorators."""
    index = next(i for i, ln in enumerate(LINES) if re.match(rf"\s+def {name}\(", ln))
    above = []
    for ln in reversed(LINES[:index]):
        if not ln.strip():
            break
        above.append(ln.strip())
    return " ".join(reversed(above))


@pytest.fixture(scope="module")
def runtime_tests(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The test class's tests as the imported file has them (run_suite.py --list-worker)."""
    env = {
        **os.environ,
        "BACKEND": "gloo",
        "WORLD_SIZE": "1",
        "TEMP_DIR": str(tmp_path_factory.mktemp("list")),
        "CUDA_VISIBLE_DEVICES": "",
    }
    got = subprocess.run(
        [sys.executable, str(SUITE / "run_suite.py"), "--list-worker"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    return sorted(got.stdout.split())


def cuda_names() -> list[str]:
    return cuda_select.cuda_tests(cuda_select.scan(SOURCE))


def needing_two() -> list[str]:
    """The CUDA tests whose only GPU-count decorator is skip_if_lt_x_gpu(2), from the text."""
    return [
        n
        for n in cuda_names()
        if "@skip_if_lt_x_gpu(2)" in decorators(n)
        and len(re.findall(r"@(skip_if_no_gpu|skip_if_lt_x_gpu|require_world_size)", decorators(n)))
        == 1
    ]


def test_scan_finds_the_files_tests(runtime_tests: list[str]) -> None:
    assert sorted(t.name for t in cuda_select.scan(SOURCE)) == runtime_tests


def test_cuda_selection(runtime_tests: list[str]) -> None:
    names = set(cuda_names())
    for n in runtime_tests:
        text = decorators(n)
        gpu_decorated = re.search(
            r"@(skip_if_no_gpu|skip_if_lt_x_gpu\(|require_world_size\()", text
        )
        wanted = bool(re.search("cuda|gpu", n, re.I) or gpu_decorated)
        if re.search("nccl|xpu|hpu", n, re.I):
            wanted = False
        assert (n in names) == wanted, (n, text)
    assert "test_broadcast_cuda" in names and "test_broadcast" not in names
    assert not any("nccl" in n for n in names)


def _expected(name: str, gpus: int, world_size: int, gate: bool) -> bool:
    """Whether torch would run `name` as far as its GPU counts go, from the text."""
    text = decorators(name)
    if gate and gpus < world_size:
        return False
    if "@skip_if_no_gpu" in text and gpus < world_size:
        return False
    for n in re.findall(r"@(?:skip_if_lt_x_gpu|require_world_size)\((\d+)", text):
        if gpus < int(n):
            return False
    if re.search(r"@skip_if_lt_x_gpu\(int\(os\.environ\[\"WORLD_SIZE\"\]\)\)", text):
        return gpus >= world_size
    return True


def test_the_installed_file_has_the_per_rank_gate() -> None:
    start = SOURCE.index("class TestDistBackend")
    run = SOURCE[SOURCE.index("def _run(", start) :]
    run = run[: run.index("\n    def ", 10)]
    gate = "torch.cuda.device_count() < int(" in run and "self.world_size" in run
    assert (cuda_select.class_gate(SOURCE) is not None) == gate


@pytest.mark.parametrize("gpus, world_size", [(1, 1), (1, 2), (1, 3), (2, 2), (4, 4)])
def test_prefilter_matches_the_decorators(gpus: int, world_size: int) -> None:
    names = cuda_names()
    gate = cuda_select.class_gate(SOURCE) is not None
    kept, excluded = cuda_select.prefilter(SOURCE, names, gpus, world_size)
    assert sorted(kept + list(excluded)) == sorted(names)
    for n in names:
        assert (n in kept) == _expected(n, gpus, world_size, gate), (n, decorators(n))
    if gpus < world_size and gate:
        assert not kept
    if world_size == 1:
        assert len(kept) >= 10 and "test_barrier_cuda" in kept


def test_prefilter_reasons() -> None:
    _, excluded = cuda_select.prefilter(SOURCE, cuda_names(), 1, 2)
    assert "@skip_if_no_gpu" in decorators("test_barrier_cuda")
    assert excluded["test_barrier_cuda"] == (
        "needs one GPU per rank (2 GPUs at world size 2): skip_if_no_gpu"
    )
    two = needing_two()
    assert two and all(excluded[n] == "needs 2 GPUs: skip_if_lt_x_gpu(2)" for n in two)
    plain = [n for n in cuda_names() if "gpu" not in decorators(n)]
    kept, _ = cuda_select.prefilter(SOURCE, plain, 1, 1)
    assert plain and kept == plain  # no GPU decorator: kept where the gate allows
    counts = cuda_select.reason_counts(excluded)
    assert sum(counts.values()) == len(excluded) and list(counts.values()) == sorted(
        counts.values(), reverse=True
    )


FAKE = """
class TestDistBackend:
    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        self = cls(test_name)
        {gate}

class DistributedTest:
    class _DistTestBase:
        def test_plain_cuda(self):
            pass

        @skip_if_no_gpu
        def test_each_rank_cuda(self):
            pass

        @skip_if_lt_x_gpu(int(os.environ["WORLD_SIZE"]))
        def test_world(self):
            pass

        @skip_if_lt_x_gpu(3)
        def test_three(self):
            pass

        @skip_if_lt_x_gpu(some_count())
        def test_unknown_gpu(self):
            pass

        @require_n_gpus_for_nccl_backend(8, "nccl")
        def test_gated_gpu_count(self):
            pass

        def test_cpu(self):
            pass
"""
GATE = (
    "if torch.cuda.is_available() and torch.cuda.device_count() < int(self.world_size):\n"
    "            sys.exit(1)"
)


def test_prefilter_on_a_made_up_file() -> None:
    without = FAKE.format(gate="pass")
    names = cuda_select.cuda_tests(cuda_select.scan(without))
    assert names == [
        "test_each_rank_cuda",
        "test_gated_gpu_count",
        "test_plain_cuda",
        "test_three",
        "test_unknown_gpu",
        "test_world",
    ]
    kept, excluded = cuda_select.prefilter(without, names, 2, 2)
    assert kept == ["test_each_rank_cuda", "test_gated_gpu_count", "test_plain_cuda"] + [
        "test_unknown_gpu",
        "test_world",
    ]
    assert excluded == {"test_three": "needs 3 GPUs: skip_if_lt_x_gpu(3)"}
    kept, excluded = cuda_select.prefilter(without, names, 1, 2)
    assert kept == ["test_gated_gpu_count", "test_plain_cuda", "test_unknown_gpu"]
    assert excluded["test_world"].startswith("needs one GPU per rank (2 GPUs at world size 2)")
    assert cuda_select.class_gate(without) is None
    gated = FAKE.format(gate=GATE)
    assert cuda_select.class_gate(gated) is not None
    kept, excluded = cuda_select.prefilter(gated, names, 1, 2)
    assert kept == [] and "TestDistBackend._run" in excluded["test_plain_cuda"]
    assert excluded["test_each_rank_cuda"].endswith(": skip_if_no_gpu")
    kept, _ = cuda_select.prefilter(gated, names, 1, 1)
    assert kept == ["test_each_rank_cuda", "test_gated_gpu_count", "test_plain_cuda"] + [
        "test_unknown_gpu",
        "test_world",
    ]


def _suite(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    report = tmp_path / "suite.json"
    got = subprocess.run(
        [sys.executable, str(SUITE / "run_suite.py"), "--device", "cuda", "--json", str(report)]
        + list(args),
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert report.exists(), got.stdout[-3000:] + got.stderr[-3000:]
    return got, json.loads(report.read_text())


def test_cuda_run_without_a_gpu_skips(tmp_path: Path) -> None:
    """On this machine (no usable GPU) the kept CUDA tests are skips on both backends, by
    torch at run time (gloo's gates, so that xcclc starts them too); the exit status is 0."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the tests would run")
    two = needing_two()[0]
    kept = ["test_all_reduce_sum_cuda", "test_barrier_cuda"]
    got, data = _suite(tmp_path, "--gates", "gloo", "--tests", *kept, two)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert data["device"] == "cuda" and data["world_size"] == 1 and data["gpus"] == 1
    assert data["tests"] == kept
    assert data["excluded"] == {two: "needs 2 GPUs: skip_if_lt_x_gpu(2)"}
    assert data["regressions"] == [] and data["not_run"] == {"xcclc": [], "gloo": []}
    for backend in ("xcclc", "gloo"):
        res = data["results"][backend]
        assert set(res) == set(kept), res
        for n in kept:
            assert res[n]["outcome"] == "skipped", (backend, n, res[n])
            assert "CUDA is not available" in res[n]["reason"], res[n]
    assert data["start_methods"] == {"xcclc": "forkserver", "gloo": "forkserver"}
    assert "set aside before running" in got.stdout and two in got.stdout


def test_cuda_run_budget_spent(tmp_path: Path) -> None:
    """A budget spent before the first test starts (the worker's imports alone take longer):
    every test is reported not run, on both backends, and that is no failure."""
    kept = ["test_all_reduce_sum_cuda", "test_barrier_cuda"]
    got, data = _suite(tmp_path, "--budget", "0.2", "--tests", *kept)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert data["not_run"] == {"xcclc": kept, "gloo": kept}
    assert all(r["outcome"] == "not run" for res in data["results"].values() for r in res.values())
    assert "not run (the budget of 0 s was spent): xcclc 2, gloo 2" in got.stdout


def test_known_failures_are_listed_not_counted(capsys: pytest.CaptureFixture[str]) -> None:
    """report(): a test that passes on gloo and fails on xcclc is a regression unless it is
    one of KNOWN_FAILURES, which is printed with its reason instead."""
    import run_suite

    ok = {"outcome": "passed", "reason": "", "seconds": 0.1}
    bad = {"outcome": "failed", "reason": "boom", "seconds": 0.1}
    names = ["test_sparse_all_reduce_sum_cuda", "test_all_reduce_sum_cuda", "test_barrier"]
    results = {
        "gloo": {n: ok for n in names},
        "xcclc": {names[0]: bad, names[1]: bad, names[2]: ok},
    }
    got = run_suite.report(names, results, {"gloo": 1.0, "xcclc": 1.0})
    out = capsys.readouterr().out
    assert got == ["test_all_reduce_sum_cuda"], got
    assert "known: sparse tensors" in out, out
    assert run_suite.known_failure("test_monitored_barrier_gloo_subgroup") is not None
    assert run_suite.known_failure("test_all_gather") is None
