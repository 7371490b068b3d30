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
file skips for a non-gloo backend do not count, nor the known failures of ``KNOWN_FAILURES``,
which are printed with their reason), 1 otherwise, 2 on a usage or setup error.
A CUDA selection that the prefilter sets aside entirely is no error (0). ``--json PATH``
writes every outcome, the tests set aside with their reasons and those not run. When a test
failed, the test processes' output is kept in a directory the summary names.

CUDA (``--device cuda``): the CUDA selection of the same class, run on CUDA tensors on the
GPUs the machine shows (see cuda_select.py): the tests whose names mention cuda or gpu or
that carry one of torch's GPU-count decorators (``skip_if_no_gpu``, ``skip_if_lt_x_gpu``,
``require_world_size``), less those named for nccl, xpu or hpu. Before anything starts, a
static prefilter (``ast`` over the installed torch's test file, no process) sets aside, with
the reason, the tests torch would skip for want of GPUs on ``--gpus`` GPUs (default 1) at the
world size, so that the time goes to tests that can run; the others run on both backends and
torch's own skips at run time count as skips. The world size defaults to the number of GPUs:
torch's ``TestDistBackend._run`` skips every test when CUDA is visible and there are fewer
GPUs than ranks (and ``init_multigpu_helper`` gives a rank no GPU then), so on one GPU only
world size 1 runs anything::

    python tests/torch_suite/run_suite.py --device cuda --gates gloo --budget 120
    python tests/torch_suite/run_suite.py --device cuda --world-size 2 --list  # all set aside

``--gates gloo`` matters more here: torch reserves several CUDA tests for gloo and nccl by
name. The test processes see the GPU (CPU mode hides it with ``CUDA_VISIBLE_DEVICES=""``);
torch's availability check is made NVML-based (``PYTORCH_NVML_BASED_CUDA_CHECK=1``) so that
importing torch's test file in the fork server does not initialise the CUDA driver, and a
worker that finds the driver initialised after those imports uses spawn instead of the fork
server (the JSON says which was used).

``--budget SECONDS`` (either mode): no test starts once the budget is spent. The first backend
gets an even share of it, the next ones run only the tests the first one reached (so the
comparison stays like for like); the tests never started are reported "not run".

The same file is the worker (``--worker``, internal); in a worker and in the test
processes (which import it as their main module) it registers xccl's backend.
"""

from __future__ import annotations

import argparse
import ctypes
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

import cuda_select

WORKER_ENV = "XCCL_TORCH_SUITE_WORKER"  # set in a worker and inherited by its test processes
XCCL_BACKEND = "xcclc"  # xccl.torch.BACKEND; not imported here so the parent stays light

# Tests that pass on gloo and fail on xcclc for a known reason (only reachable with
# `--gates gloo`: torch's file reserves them for gloo). They are listed with the reason and do
# not count as regressions; a failure of any other test does.
KNOWN_FAILURES: list[tuple[str, str]] = [
    (r"test_sparse_all_reduce_sum", "sparse tensors: xccl raises NotImplementedError"),
    (
        r"test_monitored_barrier",
        "torch's dist.monitored_barrier accepts only gloo (xccl: "
        "pg.monitored_barrier); one test also matches gloo's wording",
    ),
    (r"test_accumulate_gradients_no_sync", "the test builds its model only for mpi, gloo and nccl"),
    (
        r"test_barrier_timeout_",
        "xccl times out when asked, but its message does not match gloo's regular expression",
    ),
]


def known_failure(name: str) -> Optional[str]:
    """The reason `name` is a known failure on xcclc (KNOWN_FAILURES), or None."""
    return next((why for pat, why in KNOWN_FAILURES if re.match(pat, name)), None)


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
    """Records each test's outcome, reason and duration; prints a progress line. Once
    `deadline` (time.time(), 0: none) has passed, asks the suite to start no more tests."""

    def __init__(
        self,
        stream: Any,
        descriptions: bool,
        verbosity: int,
        total: int,
        label: str,
        deadline: float = 0.0,
    ) -> None:
        super().__init__(stream, descriptions, verbosity)
        self.outcomes: dict[str, dict[str, Any]] = {}
        self.total = total
        self.label = label
        self.deadline = deadline
        self._t0 = 0.0
        self._check_deadline()

    def _check_deadline(self) -> None:
        if self.deadline and time.time() >= self.deadline:
            self.shouldStop = True

    def stopTest(self, test: unittest.TestCase) -> None:  # noqa: N802 - unittest's name
        super().stopTest(test)
        self._check_deadline()

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


CUDA_ERROR_NOT_INITIALIZED = 3


def cuda_driver_initialised() -> bool:
    """Whether this process has initialised the CUDA driver (cuInit), asked without
    initialising it: before cuInit, cuDeviceGetCount fails with CUDA_ERROR_NOT_INITIALIZED.
    False where there is no driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return int(lib.cuDeviceGetCount(ctypes.byref(count))) != CUDA_ERROR_NOT_INITIALIZED


def worker_main(names: list[str], out: str, label: str, deadline: float = 0.0) -> int:
    """Runs `names` in this process (a worker), starting none after `deadline` (time.time(),
    0: none), and writes as JSON to `out` their outcomes and the start method used."""
    from suite_case import TorchSuite, all_tests

    method = os.environ.get("XCCL_TORCH_SUITE_START", "forkserver")
    if (
        os.environ.get("XCCL_TORCH_SUITE_DEVICE") == "cuda"
        and method == "forkserver"
        and cuda_driver_initialised()
    ):
        # The fork server imports what this worker imported: its children would inherit an
        # initialised driver, which CUDA does not support after fork.
        print(
            f"[{label}] importing torch's test file initialised the CUDA driver: "
            "using spawn instead of the fork server",
            flush=True,
        )
        method = "spawn"
        os.environ["XCCL_TORCH_SUITE_START"] = method
    known = set(all_tests())
    missing = [n for n in names if n not in known]
    suite = unittest.TestSuite(TorchSuite(n) for n in names if n in known)
    with open(os.devnull, "w") as devnull:
        runner = unittest.TextTestRunner(
            stream=devnull,
            verbosity=0,
            resultclass=lambda s, d, v: _Result(s, d, v, suite.countTestCases(), label, deadline),
        )
        result = runner.run(suite)
    outcomes = result.outcomes  # type: ignore[attr-defined]
    for n in missing:  # the parent says "not run" of the names no outcome mentions
        outcomes[n] = {
            "outcome": "missing",
            "reason": "not in this torch's test file",
            "seconds": 0.0,
        }
    with open(out, "w") as f:
        json.dump({"start_method": method, "outcomes": outcomes}, f, indent=1, sort_keys=True)
    return 0


# ---------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------


def _device_named(name: str) -> bool:
    """Whether a test's name names a device (cuda, gpu, nccl, xpu, hpu): not a CPU test."""
    return bool(cuda_select.CUDA_NAMES.search(name) or cuda_select.OTHER_DEVICE_NAMES.search(name))


def select(
    names: list[str], subset: bool, patterns: list[str], tests: list[str], device: str = "cpu"
) -> list[str]:
    """The tests to run: `tests` if given, else the subset or every CPU test (`names` is the
    class's tests) or, for device "cuda", `names` itself (the CUDA selection), filtered by the
    -k substrings (any matches)."""
    if tests:
        return tests
    if device == "cuda":
        chosen = list(names)
    else:
        chosen = SUBSET if subset else [n for n in names if not _device_named(n)]
    if patterns:
        chosen = [n for n in chosen if any(p in n for p in patterns)]
    return chosen


def _worker_env(backend: str, args: argparse.Namespace, temp: str) -> dict[str, str]:
    """The environment of a worker (and of its test processes) for `backend`."""
    env = dict(os.environ)
    env.update(
        {
            WORKER_ENV: "1",
            "BACKEND": backend,
            "WORLD_SIZE": str(args.world_size),
            "TEMP_DIR": temp,
            "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(args.timeout),
            "XCCL_TORCH_SUITE_START": args.start_method,
            "XCCL_TORCH_SUITE_GATES": "own" if backend == "gloo" else args.gates,
            "XCCL_TORCH_SUITE_DEVICE": args.device,
            "PYTHONUNBUFFERED": "1",
            "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
        }
    )
    if args.device == "cuda":
        # torch.cuda.is_available() (read when torch's test file is imported, by the fork
        # server too) through NVML, which leaves the CUDA driver uninitialised for the forks.
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU tests: torch skips every test with too few GPUs
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
    backend: str,
    names: list[str],
    args: argparse.Namespace,
    log_dir: str,
    deadline: float = 0.0,
) -> tuple[dict[str, dict[str, Any]], str]:
    """Runs `names` against `backend` in a worker process, starting none after `deadline`
    (time.time(), 0: none); returns name -> outcome and the start method the worker used."""
    with tempfile.TemporaryDirectory(prefix=f"xccl-suite-{backend}-") as temp:
        os.mkdir(os.path.join(temp, "barrier"))
        out = os.path.join(temp, "result.json")
        log = os.path.join(log_dir, f"{backend}.log")
        cmd = [sys.executable, __file__, "--worker", "--out", out]
        if deadline:
            cmd += ["--deadline", repr(deadline)]
        cmd += ["--tests", *names]
        gates = "" if backend == "gloo" or args.gates == "own" else ", gloo's gates"
        left = f", {deadline - time.time():.0f} s of the budget" if deadline else ""
        print(
            f"== {backend}: {len(names)} tests on {args.device}, world size "
            f"{args.world_size}, {args.start_method}{gates}{left}",
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
            got = json.load(f)
        return got["outcomes"], got["start_method"]


def _counts(results: dict[str, dict[str, Any]]) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "not run": 0}
    for r in results.values():
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return counts


def report_excluded(excluded: dict[str, str]) -> None:
    """Prints the tests the static prefilter set aside, by reason."""
    if not excluded:
        return
    print(f"\nset aside before running (torch would skip them for want of GPUs): {len(excluded)}")
    for reason, count in cuda_select.reason_counts(excluded).items():
        print(f"  {count:>3}  {reason}")
        for n in sorted(n for n, r in excluded.items() if r == reason):
            print(f"         {n}")


def report(
    names: list[str], results: dict[str, dict[str, dict[str, Any]]], seconds: dict[str, float]
) -> list[str]:
    """Prints the counts table and the gloo-vs-xccl differences; returns the names of tests
    that pass on gloo and fail on xccl."""
    print()
    print(
        f"{'backend':<10} {'tests':>6} {'passed':>7} {'failed':>7} {'skipped':>8} "
        f"{'not run':>8} {'time':>8}"
    )
    for backend, res in results.items():
        c = _counts(res)
        print(
            f"{backend:<10} {len(res):>6} {c['passed']:>7} {c['failed']:>7} "
            f"{c['skipped']:>8} {c['not run']:>8} {seconds[backend]:>7.0f}s"
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
                why = known_failure(n)
                if why is None:
                    regressions.append(n)
                else:
                    print(f"    known: {why}")
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
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: the CPU tests (default); cuda: the CUDA selection on this machine's GPUs",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="GPUs the CUDA prefilter counts on (default 1)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="processes per test (default: 3 on cpu, as torch's CI runs gloo on CPU; "
        "the number of GPUs on cuda)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="start no test after this many seconds (default 0: no limit)",
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
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.list_worker:
        from suite_case import all_tests

        print("\n".join(all_tests()))
        return 0
    if args.worker:
        return worker_main(args.tests, args.out, os.environ["BACKEND"], args.deadline)

    start = time.time()
    if args.world_size is None:
        args.world_size = args.gpus if args.device == "cuda" else 3
    if args.device == "cuda" and args.subset:
        print("--subset is the CPU subset; with --device cuda use -k or --tests", file=sys.stderr)
        return 2
    if args.world_size < 1 or args.gpus < 0 or args.budget < 0:
        print("--world-size must be >= 1, --gpus and --budget >= 0", file=sys.stderr)
        return 2
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    excluded: dict[str, str] = {}
    try:
        if args.device == "cuda":
            with open(cuda_select.test_file()) as f:
                source = f.read()
            found = cuda_select.cuda_tests(cuda_select.scan(source))
            chosen = select(found, False, args.k, args.tests, "cuda")
            names, excluded = cuda_select.prefilter(source, chosen, args.gpus, args.world_size)
        else:
            chosen = names = select(_list_tests(args), args.subset, args.k, args.tests)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(names))
        for n, why in excluded.items():
            print(f"set aside: {n}: {why}", file=sys.stderr)
        return 0
    if not chosen:
        print("no test selected", file=sys.stderr)
        return 2
    log_dir = tempfile.mkdtemp(prefix="xccl-suite-logs-")
    results: dict[str, dict[str, dict[str, Any]]] = {}
    seconds: dict[str, float] = {}
    methods: dict[str, str] = {}
    deadline = start + args.budget if args.budget else 0.0
    reached = list(names)  # the first backend's tests that started: the later ones run those
    for i, backend in enumerate(backends):
        t0 = time.monotonic()
        share = 0.0
        if deadline:
            share = time.time() + max(0.0, deadline - time.time()) / (len(backends) - i)
        run = reached if i else names
        got: dict[str, dict[str, Any]] = {}
        if run:
            try:
                got, methods[backend] = run_backend(backend, run, args, log_dir, share)
            except RuntimeError as exc:
                print(exc, file=sys.stderr)
                return 2
        for n in names:
            got.setdefault(n, {"outcome": "not run", "reason": "budget spent", "seconds": 0.0})
        results[backend] = got
        if i == 0:
            reached = [n for n in names if got[n]["outcome"] != "not run"]
        seconds[backend] = time.monotonic() - t0
    regressions = report(names, results, seconds) if names else []
    report_excluded(excluded)
    if not names:
        print(
            f"\nnothing left to run: every selected test needs more GPUs than {args.gpus} "
            f"at world size {args.world_size}"
        )
    not_run = {
        b: [n for n in names if res[n]["outcome"] == "not run"] for b, res in results.items()
    }
    if any(not_run.values()):
        print(
            "\nnot run (the budget of "
            f"{args.budget:.0f} s was spent): "
            + ", ".join(f"{b} {len(v)}" for b, v in not_run.items())
        )
    if any(r["outcome"] == "failed" for res in results.values() for r in res.values()):
        print(f"\nthe test processes' output is in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": args.device,
                    "gpus": args.gpus if args.device == "cuda" else None,
                    "world_size": args.world_size,
                    "start_method": args.start_method,
                    "start_methods": methods,
                    "gates": args.gates,
                    "budget": args.budget,
                    "tests": names,
                    "excluded": excluded,
                    "excluded_reasons": cuda_select.reason_counts(excluded),
                    "not_run": not_run,
                    "regressions": regressions,
                    "seconds": seconds,
                    "results": results,
                },
                f,
                indent=1,
            )
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
