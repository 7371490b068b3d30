"""pytest configuration for the xccl test suite.

- the session stops at once, as a usage error, when the extension ``xccl._C`` does not import:
  a broken build fails the suite instead of skipping the modules that need it;
- the ``spmd`` fixture: :func:`harness.run_spmd`, for tests that prefer fixtures to imports;
- a process-leak check: after every test, no process started during the test may still run
  (a test that leaves one fails in teardown, and the process is killed); at the end of the
  session the same check covers everything the session started.
"""

from __future__ import annotations

import importlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from harness import helper_pids, run_spmd, warm_up

LEAK_GRACE_S = 3.0


def pytest_configure(config: pytest.Config) -> None:
    try:
        importlib.import_module("xccl._C")
    except Exception as exc:  # ImportError, or whatever a broken module raises on import
        raise pytest.UsageError(
            f"the xccl extension does not import ({type(exc).__name__}: {exc}); build it "
            "(python setup.py build_ext --inplace) and put python/ on PYTHONPATH"
        ) from exc


def pytest_collection_finish(session: pytest.Session) -> None:
    """Starts the SPMD fork server before the first test that will need it."""
    for item in session.items:
        module = getattr(item, "module", None)
        if "spmd" in getattr(item, "fixturenames", ()) or (
            module is not None and getattr(module, "run_spmd", None) is run_spmd
        ):
            warm_up()
            return


@pytest.fixture
def spmd() -> Callable[..., list[Any]]:
    """:func:`harness.run_spmd`: ``spmd(fn, world_size, *args, timeout=..., ...)``."""
    return run_spmd


# --------------------------------------------------------------------------- process leaks


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) for every process in /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # the command name may hold spaces
        table[int(entry)] = (int(fields[1]), fields[0])
    return table


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "?"


def live_descendants() -> dict[int, str]:
    """Running (not zombie) descendants of this process, less the multiprocessing helpers
    (whose children, the ranks, do count): pid -> command line."""
    if not os.path.isdir("/proc"):
        return {}
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    helpers = helper_pids()
    out = {}
    todo = list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        if pid not in helpers and table[pid][1] != "Z":
            out[pid] = _cmdline(pid)
    return out


def _reap_leftovers(before: set[int]) -> dict[int, str]:
    """Waits up to LEAK_GRACE_S for processes not in ``before`` to end; kills and returns the
    ones that do not."""
    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        left = {p: c for p, c in live_descendants().items() if p not in before}
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    before = set(live_descendants())
    yield
    left = _reap_leftovers(before)
    if left:
        listing = "\n".join(f"  pid {p}: {c}" for p, c in sorted(left.items()))
        pytest.fail(
            f"the test left {len(left)} process(es) running (now killed):\n{listing}", pytrace=False
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    left = _reap_leftovers(set())
    if left:
        listing = "\n".join(f"  pid {p}: {c}" for p, c in sorted(left.items()))
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        text = f"xccl tests: {len(left)} process(es) were still running at the end (killed):"
        if reporter is not None:
            reporter.write_line(f"{text}\n{listing}", red=True)
        if session.exitstatus == 0:
            session.exitstatus = 1
