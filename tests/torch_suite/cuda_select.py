"""The CUDA selection of torch's distributed suite, and which of it can run with few GPUs.

Read statically (``ast``) from the installed torch's
``torch/testing/_internal/distributed/distributed_test.py``, without importing torch or the
test file and without starting a process, so that it follows whatever torch is installed and
costs nothing on a machine whose GPU time is short.

The CUDA selection: the tests of ``DistributedTest._DistTestBase`` whose names mention cuda
or gpu, or that carry one of torch's decorators that count GPUs (``skip_if_no_gpu``,
``skip_if_lt_x_gpu``, ``require_world_size``), except those whose names mention nccl, xpu or
hpu (those are for other backends and devices).

The prefilter: given the GPUs of the machine and the world size, the tests that torch itself
would skip for want of GPUs, each with its reason, so that a run spends its time on tests that
can run. What counts (read from torch's common_distributed.py):

* ``TestDistBackend._run`` (every test of the class) exits with the skip code ``multi-gpu-W``
  when CUDA is visible and ``torch.cuda.device_count() < WORLD_SIZE``: with fewer GPUs than
  ranks every test skips. It is looked for in the file; when present it excludes everything.
* ``skip_if_no_gpu``: one GPU per rank (``device_count() < WORLD_SIZE`` skips).
* ``skip_if_lt_x_gpu(n)``: n GPUs; ``n`` is a number or ``int(os.environ["WORLD_SIZE"])``
  (one per rank). Another expression is left to the run.
* ``require_world_size(n)``: n GPUs (a unittest skip unless ``device_count() >= n``).

Not counted: ``require_n_gpus_for_nccl_backend`` and ``nccl_skip_if_lt_x_gpu`` apply to
the nccl backend only; gates on the backend's name and other runtime skips are left to the
run, where they count as skips.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
from dataclasses import dataclass, field
from typing import Optional

CUDA_NAMES = re.compile(r"cuda|gpu", re.IGNORECASE)
OTHER_DEVICE_NAMES = re.compile(r"nccl|xpu|hpu", re.IGNORECASE)
GPU_DECORATORS = ("skip_if_no_gpu", "skip_if_lt_x_gpu", "require_world_size")
TEST_FILE = ("testing", "_internal", "distributed", "distributed_test.py")
PER_RANK = "needs one GPU per rank"


def test_file() -> str:
    """Path of the installed torch's distributed_test.py, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("torch is not installed")
    for root in spec.submodule_search_locations:
        path = os.path.join(root, *TEST_FILE)
        if os.path.exists(path):
            return path
    raise RuntimeError(f"no {'/'.join(TEST_FILE)} in torch ({spec.origin})")


@dataclass
class Need:
    """A GPU requirement: `gpus` GPUs, or one per rank when `gpus` is None."""

    what: str  # the decorator (or gate) as written, for the reason
    gpus: Optional[int] = None

    def unmet(self, gpus: int, world_size: int) -> Optional[str]:
        """The reason this need excludes a test on `gpus` GPUs at `world_size`, or None."""
        need = world_size if self.gpus is None else self.gpus
        if gpus >= need:
            return None
        if self.gpus is None:
            return f"{PER_RANK} ({need} GPUs at world size {world_size}): {self.what}"
        return f"needs {need} GPUs: {self.what}"


@dataclass
class TestInfo:
    """A test method of ``_DistTestBase`` and the GPU needs its decorators state."""

    name: str
    needs: list[Need] = field(default_factory=list)
    gpu_decorated: bool = False


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Attribute):
        return target.attr
    if isinstance(target, ast.Name):
        return target.id
    return ""


def _count(arg: ast.expr) -> tuple[bool, Optional[int]]:
    """(known, n) for a GPU count argument: a number, or None for "one per rank" when it
    reads WORLD_SIZE; known is False for any other expression."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, int):
        return True, int(arg.value)
    if "WORLD_SIZE" in ast.unparse(arg):
        return True, None
    return False, None


def _needs(decorator: ast.expr) -> Optional[Need]:
    name = _decorator_name(decorator)
    what = ast.unparse(decorator)
    if name == "skip_if_no_gpu":
        return Need(what)
    if name in ("skip_if_lt_x_gpu", "require_world_size") and isinstance(decorator, ast.Call):
        if decorator.args:
            known, n = _count(decorator.args[0])
            if known:
                return Need(what, n)
    return None


@functools.lru_cache(maxsize=2)
def _parse(source: str) -> ast.Module:
    return ast.parse(source)


def _class(tree: ast.Module, name: str) -> Optional[ast.ClassDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def scan(source: str) -> list[TestInfo]:
    """Every ``test_*`` method of ``_DistTestBase`` in `source`, in file order."""
    base = _class(_parse(source), "_DistTestBase")
    if base is None:
        raise RuntimeError("no class _DistTestBase in torch's distributed_test.py")
    tests = []
    for node in base.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith(
            "test_"
        ):
            info = TestInfo(node.name)
            for dec in node.decorator_list:
                if _decorator_name(dec) in GPU_DECORATORS:
                    info.gpu_decorated = True
                need = _needs(dec)
                if need is not None:
                    info.needs.append(need)
            tests.append(info)
    return tests


def class_gate(source: str) -> Optional[Need]:
    """The per-rank GPU check of ``TestDistBackend._run`` (every test), when the file has
    one: a comparison ``torch.cuda.device_count() < ...world_size...``."""
    cls = _class(_parse(source), "TestDistBackend")
    if cls is None:
        return None
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "_run":
            for cmp in ast.walk(node):
                if not (isinstance(cmp, ast.Compare) and len(cmp.ops) == 1):
                    continue
                left = cmp.left
                if (
                    isinstance(cmp.ops[0], ast.Lt)
                    and isinstance(left, ast.Call)
                    and _decorator_name(left) == "device_count"
                    and "world_size" in ast.unparse(cmp.comparators[0])
                ):
                    return Need(
                        "TestDistBackend._run skips every test (multi-gpu-WORLD_SIZE) when "
                        "CUDA is visible and torch.cuda.device_count() < world size"
                    )
    return None


def cuda_tests(tests: list[TestInfo]) -> list[str]:
    """The CUDA selection (see the module docstring), sorted."""
    return sorted(
        t.name
        for t in tests
        if (CUDA_NAMES.search(t.name) or t.gpu_decorated) and not OTHER_DEVICE_NAMES.search(t.name)
    )


def prefilter(
    source: str, names: list[str], gpus: int, world_size: int
) -> tuple[list[str], dict[str, str]]:
    """Splits `names` into those that can run on `gpus` GPUs at `world_size` (in order) and
    those torch would skip for want of GPUs (name -> reason). A name the file lacks is kept
    (the run reports it missing)."""
    infos = {t.name: t for t in scan(source)}
    gate = class_gate(source)
    kept: list[str] = []
    excluded: dict[str, str] = {}
    for name in names:
        needs = (infos[name].needs if name in infos else []) + ([gate] if gate else [])
        reasons = [r for r in (n.unmet(gpus, world_size) for n in needs) if r]
        if reasons:
            excluded[name] = reasons[0]
        else:
            kept.append(name)
    return kept, excluded


def reason_counts(excluded: dict[str, str]) -> dict[str, int]:
    """How many tests each reason excludes, most first."""
    counts: dict[str, int] = {}
    for reason in excluded.values():
        counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
