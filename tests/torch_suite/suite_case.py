"""The test class of torch's distributed suite, bound to the backend ``$BACKEND``.

Imported by a worker of ``run_suite.py`` and by every test process it starts (a fork server
imports it once, with torch, so that test processes start quickly). It does not import xccl:
``run_suite.py`` registers xccl's backend in each process itself.

Every backend gets the feature flags torch's test file gives gloo ("ddp", "subgroup", "gpu",
"cuda"; tests that need a GPU still skip themselves at run time, and ``run_suite.py --device
cuda`` runs them on a GPU) plus "plugin". The flags
must be set before the test file is imported, because its decorators read them. With
``$XCCL_TORCH_SUITE_GATES=gloo`` the decorators also see the name "gloo", so that the tests
torch's file reserves for gloo by name run too (on ``$BACKEND``).
"""

from __future__ import annotations

import os
from typing import Any

import torch.multiprocessing as tmp
from torch.testing._internal.common_distributed import DistTestCases

# gloo's flags (gloo is in every one of these sets, on CPU and CUDA builds alike: torch's
# common_distributed.py), plus "plugin".
FEATURES = ("ddp", "subgroup", "gpu", "cuda", "plugin")
BACKEND = os.environ["BACKEND"]
GATES = os.environ.get("XCCL_TORCH_SUITE_GATES", "own")  # "own" or "gloo"

for _feature in FEATURES:
    DistTestCases.backend_feature[_feature].add(BACKEND)

if GATES == "gloo":
    # Let the decorators (evaluated at import) see "gloo", then run on BACKEND: the module's
    # BACKEND is read again when a test process joins the group and inside the tests.
    os.environ["BACKEND"] = "gloo"
    from torch.testing._internal.distributed import distributed_test as _dt

    _dt.BACKEND = BACKEND
    os.environ["BACKEND"] = BACKEND

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402 - after the flags
    DistributedTest,
    TestDistBackend,
)


class TorchSuite(TestDistBackend, DistributedTest._DistTestBase):
    """torch's ``DistributedTest._DistTestBase`` tests on ``$BACKEND``, one process per rank
    started with ``$XCCL_TORCH_SUITE_START`` ("forkserver", the default, or torch's
    "spawn")."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    def _spawn_processes(self) -> None:
        method = os.environ.get("XCCL_TORCH_SUITE_START", "forkserver")
        if method == "spawn":
            super()._spawn_processes()
            return
        ctx = tmp.get_context(method)
        if method == "forkserver":
            # The server imports torch's test file once for all test processes. It does not
            # apply the parent's sys.path (Python < 3.12), hence PYTHONPATH.
            here = os.path.dirname(os.path.abspath(__file__))
            path = os.environ.get("PYTHONPATH", "")
            if here not in path.split(os.pathsep):
                os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, path) if p)
            ctx.set_forkserver_preload(["torch", __name__])
        self._start_processes(ctx.Process)

    def _start_processes(self, proc: Any) -> None:
        # TEMP_DIR changes with every test (setUp makes a new one): pass it explicitly.
        env = {"TEMP_DIR": os.environ["TEMP_DIR"]}

        def process(
            *, target: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Any:
            return proc(target=_run_with_env, name=name, args=(target, env, *args), kwargs=kwargs)

        super()._start_processes(process)


def _run_with_env(target: Any, env: dict[str, str], *args: Any, **kwargs: Any) -> None:
    """Runs `target` after updating the environment (test processes from the fork server
    inherit the server's environment, not the current one)."""
    os.environ.update(env)
    target(*args, **kwargs)


def all_tests() -> list[str]:
    """Names of every test method of the class."""
    return sorted(n for n in dir(TorchSuite) if n.startswith("test_"))
