"""Runs PyTorch's own distributed test suite against xccl's torch backend and against gloo.

The suite is ``DistributedTest._DistTestBase`` from
``torch.testing._internal.distributed.distributed_test``, which ships in the torch wheel and
runs against whatever backend ``$BACKEND`` names. This driver runs the same selection of its
CPU tests once per backend (xccl's ``xccl.torch.BACKEND``, "xcclc", and "gloo"), each in
its own worker process, then prints pass/fail/skip counts for both, the failures, and every
test that passes on gloo but not on xccl, with the reason::

    python tests/torch_suite/run_suite.py                  # every CPU test (~8 min, 2 cores)
    python tests/torch_suite/run_suite.py --subset         # the fixed subset CI runs
    python tests/torch_suite/run_suite.py -k all_reduce -k barrier --backends xcclc
    python tests/torch_suite/run_suite.py --gates gloo     # also the tests torch keeps for gloo

"CPU tests" are all tests of the class except those whose names mention cuda, gpu, nccl,
xpu or hpu (the others still skip themselves when they need a GPU). Every backend gets the
feature flags torch's test file gives gloo (see suite_case.py). Tests that torch's file
reserves for gloo by name (``BACKEND == "gloo"``, ``{"gloo"}``) are skips on xccl, unless
``--gates gloo``: then the xccl run evaluates the file's decorators as if the backend were
called "gloo" and runs those tests on xccl too (the tests' bodies see xccl's name).

Each test starts ``--world-size`` processes (default 3, as torch's CI for gloo on CPU; the
file needs 4 for a few tests and 8 for its subgroup tests). With ``--start-method
forkserver`` (the default) they fork from a server that has imported torch and the test
file once, which makes a test take about a second instead of ten on a small machine;
``--start-method spawn`` is torch's own setting. A test that runs longer than ``--timeout``
seconds is killed and fails.

Exit status: 0 when no selected test passes on gloo and fails on xccl (tests that torch's
file skips for a non-gloo backend do not count), 1 otherwise, 2 on a usage or setup error.
``--json PATH`` writes every outcome. When a test failed, the test processes' output is
kept in a directory the summary names.

The same file is the worker (``--worker``, internal); in a worker and in the test
processes (which import it as their main module) it registers xccl's backend.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import unittest
from typing import Any, Optional

WORKER_ENV = "XCCL_TORCH_SUITE_WORKER"  # set in a worker and inherited by its test processes
GPU_NAMES = re.compile(r"cuda|gpu|nccl|xpu|hpu", re.IGNORECASE)
XCCL_BACKEND = "xcclc"  # xccl.torch.BACKEND; not imported here so the parent stays light

# The CI subset: tests that run (not skip) on a CPU machine at world size 3, one or two per
# area: identity, groups, every collective (async, complex, error checks), p2p with tags and
# any-source receives, objects, DDP. About a second each.
SUBSET = [
    "test_get_rank",
    "test_get_backend",
    "test_Backend_enum_class",
    "test_get_rank_size_full_group",
    "test_destroy_group",
    "test_barrier",
    "test_broadcast",
    "test_all_reduce_sum",
    "test_all_reduce_max",
    "test_all_reduce_product",
    "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex",
    "test_all_reduce_complex_unsupported_ops",
    "test_reduce_sum",
    "test_reduce_min",
    "test_all_gather",
    "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_with_empty",
    "test_all_gather_object_default_pg",
    "test_gather",
    "test_gather_checks",
    "test_scatter",
    "test_send_recv",
    "test_send_recv_any_source",
    "test_send_recv_with_tag",
    "test_isend",
    "test_irecv",
    "test_DistributedDataParallel_requires_grad",
    "test_DistributedDataParallelCPU",
    "test_static_graph_api_cpu",
]


# ---------------------------------------------------------------------------------------------
# Worker side. In a worker and in every test process it starts (which import this file as
# their main module), xccl's backend is registered before anything else happens.
# ---------------------------------------------------------------------------------------------

if os.environ.get(WORKER_ENV) and os.environ.get("BACKEND") == XCCL_BACKEND:
    import xccl.torch  # noqa: F401 - registers the backend


# An exception line, possibly behind torch's log prefix "[rank0]:E1122 10:37:11.431 pid file]".
_EXC_LINE = re.compile(
    r"^(\[rank\d+\]:\S*\s+\S+\s+\S+\]\s+)?([\w.]+(Error|Exception|Exit|Failure))(:|$)"
)


def _reason(text: str) -> str:
    """A one-line reason from a traceback (the last exception line, which for a failure in
    a test process is that process's own exception) or a skip message."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        m = _EXC_LINE.match(ln)
        if m:
            return ln[len(m.group(1) or "") :][:300]
    return lines[-1][:300] if lines else ""


class _Result(unittest.TextTestResult):
    """Records each test's outcome, reason and duration; prints a progress line."""

    def __init__(
        self, stream: Any, descriptions: bool, verbosity: int, total: int, label: str
    ) -> None:
        super().__init__(stream, descriptions, verbosity)
        self.outcomes: dict[str, dict[str, Any]] = {}
        self.total = total
        self.label = label
        self._t0 = 0.0

    def startTest(self, test: unittest.TestCase) -> None:  # noqa: N802 - unittest's name
        self._t0 = time.monotonic()
        unittest.TestResult.startTest(self, test)

    def _record(self, test: unittest.TestCase, outcome: str, reason: str = "") -> None:
        name = test.id().split(".")[-1]
        took = time.monotonic() - self._t0
        self.outcomes[name] = {"outcome": outcome, "reason": reason, "seconds": round(took, 2)}
        print(
            f"[{self.label} {len(self.outcomes)}/{self.total}] {name} ... {outcome} "
            f"({took:.1f} s){': ' + reason if reason and outcome != 'passed' else ''}",
            flush=True,
        )

    def addSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        self._record(test, "passed")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        self._record(test, "failed", _reason("".join(traceback.format_exception(*err))))

    def addError(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        self._record(test, "failed", _reason("".join(traceback.format_exception(*err))))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:  # noqa: N802
        self._record(test, "skipped", _reason(reason))

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        self._record(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        self._record(test, "failed", "unexpected success")


def worker_main(names: list[str], out: str, label: str) -> int:
    """Runs `names` in this process (a worker) and writes their outcomes as JSON to `out`."""
    from suite_case import TorchSuite, all_tests

    known = set(all_tests())
    missing = [n for n in names if n not in known]
    suite = unittest.TestSuite(TorchSuite(n) for n in names if n in known)
    with open(os.devnull, "w") as devnull:
        runner = unittest.TextTestRunner(
            stream=devnull,
            verbosity=0,
            resultclass=lambda s, d, v: _Result(s, d, v, suite.countTestCases(), label),
        )
        result = runner.run(suite)
    outcomes = result.outcomes  # type: ignore[attr-defined]
    for n in missing:
        outcomes[n] = {
            "outcome": "missing",
            "reason": "not in this torch's test file",
            "seconds": 0.0,
        }
    with open(out, "w") as f:
        json.dump(outcomes, f, indent=1, sort_keys=True)
    return 0


# ---------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------


def select(names: list[str], subset: bool, patterns: list[str], tests: list[str]) -> list[str]:
    """The tests to run: `tests` if given, else the subset or every CPU test, filtered by
    the -k substrings (any matches)."""
    if tests:
        return tests
    chosen = SUBSET if subset else [n for n in names if not GPU_NAMES.search(n)]
    if patterns:
        chosen = [n for n in chosen if any(p in n for p in patterns)]
    return chosen


def _worker_env(backend: str, args: argparse.Namespace, temp: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            WORKER_ENV: "1",
            "BACKEND": backend,
            "WORLD_SIZE": str(args.world_size),
            "TEMP_DIR": temp,
            "CUDA_VISIBLE_DEVICES": "",
            "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(args.timeout),
            "XCCL_TORCH_SUITE_START": args.start_method,
            "XCCL_TORCH_SUITE_GATES": "own" if backend == "gloo" else args.gates,
            "PYTHONUNBUFFERED": "1",
            "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
        }
    )
    env.pop("INIT_METHOD", None)
    return env


def _list_tests(args: argparse.Namespace) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="xccl-suite-") as temp:
        env = _worker_env("gloo", args, temp)
        out = subprocess.run(
            [sys.executable, __file__, "--list-worker"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    if out.returncode != 0:
        raise RuntimeError(f"could not list torch's tests:\n{out.stderr[-3000:]}")
    return out.stdout.split()


def run_backend(
    backend: str, names: list[str], args: argparse.Namespace, log_dir: str
) -> dict[str, dict[str, Any]]:
    """Runs `names` against `backend` in a worker process; returns name -> outcome."""
    with tempfile.TemporaryDirectory(prefix=f"xccl-suite-{backend}-") as temp:
        os.mkdir(os.path.join(temp, "barrier"))
        out = os.path.join(temp, "result.json")
        log = os.path.join(log_dir, f"{backend}.log")
        cmd = [sys.executable, __file__, "--worker", "--out", out, "--tests", *names]
        gates = "" if backend == "gloo" or args.gates == "own" else ", gloo's gates"
        print(
            f"== {backend}: {len(names)} tests, world size {args.world_size}, "
            f"{args.start_method}{gates}",
            flush=True,
        )
        with open(log, "w") as logf:
            proc = subprocess.run(
                cmd,
                env=_worker_env(backend, args, temp),
                stderr=logf,
                stdout=subprocess.DEVNULL if args.quiet else None,
                check=False,
            )
        if not os.path.exists(out):
            raise RuntimeError(
                f"the {backend} worker exited with {proc.returncode} without results; see {log}"
            )
        with open(out) as f:
            return json.load(f)


def _counts(results: dict[str, dict[str, Any]]) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for r in results.values():
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return counts


def report(
    names: list[str], results: dict[str, dict[str, dict[str, Any]]], seconds: dict[str, float]
) -> list[str]:
    """Prints the counts table and the gloo-vs-xccl differences; returns the names of tests
    that pass on gloo and fail on xccl."""
    print()
    print(f"{'backend':<10} {'tests':>6} {'passed':>7} {'failed':>7} {'skipped':>8} {'time':>8}")
    for backend, res in results.items():
        c = _counts(res)
        print(
            f"{backend:<10} {len(res):>6} {c['passed']:>7} {c['failed']:>7} "
            f"{c['skipped']:>8} {seconds[backend]:>7.0f}s"
        )
    for backend, res in results.items():
        failed = [n for n in names if res.get(n, {}).get("outcome") == "failed"]
        if failed:
            print(f"\nfailed on {backend}: {len(failed)}")
            for n in failed:
                print(f"  {n}: {res[n]['reason']}")
    regressions: list[str] = []
    if "gloo" in results and XCCL_BACKEND in results:
        gloo, ours = results["gloo"], results[XCCL_BACKEND]
        diff = [
            n
            for n in names
            if gloo.get(n, {}).get("outcome") == "passed"
            and ours.get(n, {}).get("outcome") != "passed"
        ]
        print()
        print(f"passed on gloo but not on {XCCL_BACKEND}: {len(diff)}")
        for n in diff:
            r = ours.get(n, {"outcome": "missing", "reason": ""})
            print(f"  {n}: {r['outcome']}: {r['reason']}")
            if r["outcome"] == "failed":
                regressions.append(n)
        extra = [
            n
            for n in names
            if ours.get(n, {}).get("outcome") == "passed"
            and gloo.get(n, {}).get("outcome") != "passed"
        ]
        if extra:
            print(f"passed on {XCCL_BACKEND} but not on gloo: {len(extra)}")
            for n in extra:
                r = gloo.get(n, {"outcome": "missing", "reason": ""})
                print(f"  {n}: {r['outcome']}: {r['reason']}")
    return regressions


def main(argv: Optional[list[str]] = None) -> int:
    """Command line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--subset", action="store_true", help="run the fixed CI subset")
    p.add_argument(
        "-k",
        action="append",
        default=[],
        metavar="SUBSTRING",
        help="only tests whose name contains SUBSTRING (repeatable: any)",
    )
    p.add_argument("--tests", nargs="+", default=[], help="exact test names to run")
    p.add_argument(
        "--backends",
        default=f"{XCCL_BACKEND},gloo",
        help=f"comma-separated (default: {XCCL_BACKEND},gloo)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=3,
        help="processes per test (default 3, as torch's CI runs gloo on CPU)",
    )
    p.add_argument(
        "--timeout",
        type=int,
        default=120,
        help="seconds before one test's processes are killed (default 120)",
    )
    p.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver")
    p.add_argument(
        "--gates",
        choices=("own", "gloo"),
        default="own",
        help="which name the test file's decorators see for xccl: its own "
        "(default) or 'gloo', to run the tests torch reserves for gloo",
    )
    p.add_argument("--json", help="write every outcome to this file")
    p.add_argument("--list", action="store_true", help="print the selected tests and exit")
    p.add_argument("--quiet", action="store_true", help="no progress line per test")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--list-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.list_worker:
        from suite_case import all_tests

        print("\n".join(all_tests()))
        return 0
    if args.worker:
        return worker_main(args.tests, args.out, os.environ["BACKEND"])

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    try:
        names = select(_list_tests(args), args.subset, args.k, args.tests)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(names))
        return 0
    if not names:
        print("no test selected", file=sys.stderr)
        return 2
    log_dir = tempfile.mkdtemp(prefix="xccl-suite-logs-")
    results: dict[str, dict[str, dict[str, Any]]] = {}
    seconds: dict[str, float] = {}
    for backend in backends:
        t0 = time.monotonic()
        try:
            results[backend] = run_backend(backend, names, args, log_dir)
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 2
        seconds[backend] = time.monotonic() - t0
    regressions = report(names, results, seconds)
    if any(r["outcome"] == "failed" for res in results.values() for r in res.values()):
        print(f"\nthe test processes' output is in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "world_size": args.world_size,
                    "start_method": args.start_method,
                    "gates": args.gates,
                    "tests": names,
                    "seconds": seconds,
                    "results": results,
                },
                f,
                indent=1,
            )
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
