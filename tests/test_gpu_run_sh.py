"""tests/gpu/run.sh without a GPU: its syntax, its plan (--dry-run: every phase's command and
timeout within the budget), and that without a GPU it runs nothing and exits 3 with the
reason. Quick: nothing is built."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_SH = ROOT / "tests" / "gpu" / "run.sh"
BASH = shutil.which("bash")

pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")


def _run(args: list[str], out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "OUT": str(out), **env}
    return subprocess.run(
        [str(BASH), str(RUN_SH), *args], capture_output=True, text=True, env=full, timeout=120
    )


def _gpu_here() -> bool:
    if shutil.which("nvidia-smi"):
        got = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        if got.returncode == 0 and "GPU " in got.stdout:
            return True
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def test_syntax_and_executable() -> None:
    got = subprocess.run([str(BASH), "-n", str(RUN_SH)], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert os.access(RUN_SH, os.X_OK)


def test_dry_run_plan(tmp_path: Path) -> None:
    got = _run(["--dry-run", "--quick"], tmp_path / "out")
    assert got.returncode == 0, got.stdout + got.stderr
    plan = got.stdout
    build = re.search(r"build \(timeout (\d+)s\): (.*)", plan)
    assert build is not None, plan
    assert "setup.py build_ext --inplace --parallel 16" in build.group(2)
    if "XCCL_CUDA_ARCHS" in (ROOT / "setup.py").read_text():
        assert "XCCL_CUDA_ARCHS=" in build.group(2)
    assert "cuda_info (timeout" in plan
    if list((ROOT / "tests" / "gpu").glob("test_*.py")):
        assert re.search(r"gpu_tests \(timeout \d+s\): \S+ -m pytest -m gpu tests/gpu ", plan)
    else:
        assert "gpu_tests: skipped" in plan
    compare = re.search(r"compare \(timeout (\d+)s\): (.*)", plan)
    assert compare is not None, plan
    cmd = compare.group(2).split()
    assert cmd[1:5] == ["benchmarks/compare_gpu.py", "--np", "2,4", "--out"]
    assert cmd[5] == str(tmp_path / "out" / "compare") and "--quick" in cmd
    deadline = int(cmd[cmd.index("--deadline") + 1])
    # the benchmark's deadline ends within the budget; its timeout is only a backstop
    assert 45 <= deadline <= 345 - 30 and int(compare.group(1)) == deadline + 25
    assert int(build.group(1)) <= 150
    summary = (tmp_path / "out" / "summary.txt").read_text()
    # the phases in their order; torch's suite on CUDA comes after every other phase
    order = [ln.split()[0] for ln in summary.splitlines()[2:] if ln.strip()]
    first = ["build", "cuda_info", "gpu_tests"]
    assert order[:3] == first and order[-2:] == ["compare", "torch_suite"], order
    suite = re.search(r"torch_suite \(timeout (\d+)s\): (.*)", plan)
    assert suite is not None, plan
    cmd = suite.group(2).split()
    assert cmd[1:4] == ["tests/torch_suite/run_suite.py", "--device", "cuda"]
    assert cmd[cmd.index("--gates") + 1] == "gloo" and cmd[cmd.index("--gpus") + 1] == "1"
    assert cmd[cmd.index("--json") + 1] == str(tmp_path / "out" / "torch_suite.json")
    # no test starts in the phase's last 40 s: room for the last one (--timeout) and the report
    budget, timeout = int(cmd[cmd.index("--budget") + 1]), int(suite.group(1))
    assert int(cmd[cmd.index("--timeout") + 1]) + 10 <= timeout - budget == 40
    assert timeout <= 345


def test_torch_suite_phase_needs_time_left(tmp_path: Path) -> None:
    """With under 60 s of the budget left after compare, the CUDA suite phase is skipped with
    the reason, and the earlier phases keep their plan."""
    got = _run(["--dry-run"], tmp_path / "out", XCCL_GPU_BUDGET_S="50")
    assert got.returncode == 0, got.stdout + got.stderr
    assert "torch_suite: skipped: 50s of the budget left, it needs 60s" in got.stdout
    assert "run_suite.py" not in got.stdout
    assert re.search(r"compare \(timeout 50s\): .* --deadline 45\n", got.stdout), got.stdout
    got = _run(["--dry-run"], tmp_path / "out2", XCCL_GPU_BUDGET_S="100")
    suite = re.search(r"torch_suite \(timeout (\d+)s\): .* --budget (\d+) ", got.stdout)
    assert suite is not None and (suite.group(1), suite.group(2)) == ("100", "60"), got.stdout


def test_without_a_gpu_nothing_runs_and_it_exits_3(tmp_path: Path) -> None:
    if _gpu_here():
        pytest.skip("this machine has a GPU")
    got = _run([], tmp_path / "out", PATH=os.environ.get("PATH", ""))
    assert got.returncode == 3, got.stdout + got.stderr
    assert "no CUDA GPU on this machine" in got.stderr and "nothing was run" in got.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--bogus"], {}, "unknown argument"),
        (["--dry-run"], {"XCCL_GPU_BUDGET_S": "ten"}, "XCCL_GPU_BUDGET_S"),
    ],
)
def test_bad_usage_exits_2(
    args: list[str], env: dict[str, str], message: str, tmp_path: Path
) -> None:
    got = _run(args, tmp_path / "out", **env)
    assert got.returncode == 2
    assert message in got.stderr
