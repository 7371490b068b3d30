"""Runs a test body as an SPMD job: one fresh process per rank.

    from harness import run_spmd

    def body(rank, world_size, count):          # module level, so a child can import it
        x = np.full(count, rank, np.float32)
        xccl.all_reduce(x)
        return float(x[0])

    def test_sum():
        assert run_spmd(body, 4, 10) == [6.0] * 4

Each rank runs in its own process (multiprocessing "forkserver" by default: numpy and torch are
imported once in the fork server, xccl never is, so every rank imports xccl fresh). With
``init=True`` the rank joins a process group through a file store in a private temporary
directory before the body, and destroys it after. The parent collects each rank's return
value or traceback. The test fails, with every failing rank's traceback, when a rank raises,
dies, returns something that cannot be pickled, exits non-zero after returning, or has not
finished within ``timeout`` seconds: then the stragglers' Python stacks are dumped
(faulthandler, SIGUSR1) and they are killed.

Every rank's stdout and stderr (file descriptors 1 and 2, so C-level output too) go to a log
file; the parent prints all of it, each line prefixed with ``[rank N]``, to its own stdout
after the run (pytest shows it for failing tests), and quotes the end of it in the failure
message of a rank that died or hung.

``XCCL_TEST_START_METHOD=spawn`` runs the children with "spawn" instead (slower: each child
imports torch itself; it also runs the interpreter's full shutdown, which forked children
skip).

``XCCL_TEST_LSAN=1`` (set by tests/san/run-python.sh, whose processes run with the ASan runtime
preloaded): a rank that forked from the fork server ends with ``os._exit``, which skips
LeakSanitizer's check at exit, so each rank runs the check itself after its body (and the
process group's destroy): a leak fails the rank, with LeakSanitizer's report in its log.
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Optional

START_METHOD = os.environ.get("XCCL_TEST_START_METHOD", "forkserver")
PRELOAD = ("numpy", "torch", "pytest")  # imported once in the fork server; never xccl
FAIL_GRACE_S = 5.0  # after an unexpected failure, how long the other ranks get to finish
DUMP_WAIT_S = 0.5  # after SIGUSR1, how long a hung rank gets to write its stacks
LOG_TAIL_LINES = 40
LOG_PRINT_LIMIT = 256 * 1024  # bytes of one rank's log echoed to the parent's stdout

_ctx: Optional[multiprocessing.context.BaseContext] = None


class SpmdError(AssertionError):
    """An SPMD run failed; the message holds every failing rank's report."""


def _context() -> multiprocessing.context.BaseContext:
    global _ctx
    if _ctx is None:
        ctx = multiprocessing.get_context(START_METHOD)
        if START_METHOD == "forkserver":
            ctx.set_forkserver_preload(
                [m for m in PRELOAD if importlib.util.find_spec(m) is not None]
            )
        _ctx = ctx
    return _ctx


def warm_up() -> None:
    """Starts the fork server now (it imports numpy and torch, seconds on a busy machine), so
    that this cost does not land inside the first test's timeout."""
    _context()  # sets the preload list, which must precede the server's start
    if START_METHOD == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def helper_pids() -> set[int]:
    """Pids of the long-lived multiprocessing helpers (fork server, resource tracker) that
    this process may own; they are not leftovers."""
    pids = set()
    try:
        from multiprocessing import forkserver, resource_tracker

        pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
        if pid:
            pids.add(pid)
        pid = getattr(resource_tracker._resource_tracker, "_pid", None)
        if pid:
            pids.add(pid)
    except (ImportError, AttributeError):
        pass
    return pids


# --------------------------------------------------------------------------- child side


class _LeakCheck:
    """With ``XCCL_TEST_LSAN=1``: LeakSanitizer's check, run at the rank's start and end.

    A forked rank starts with blocks LeakSanitizer calls leaked: CPython's after-fork reset
    drops the old locks and thread states, the fork server's own leftovers. What matters is
    what the rank's own run adds, so the first check is the baseline and :meth:`new_leaks`
    reports only the stacks that are new or leak more bytes than at the start. Each check's
    report goes to a private file (``__sanitizer_set_report_path``), not to the job's report
    directory."""

    def __init__(self) -> None:
        self.rt: Any = None
        self.base: dict[str, tuple[int, str]] = {}
        if os.environ.get("XCCL_TEST_LSAN") != "1":
            return
        import ctypes

        rt = ctypes.CDLL(None)  # getattr: a "__name" in a class body would be mangled
        if not hasattr(rt, "__lsan_do_recoverable_leak_check"):
            raise RuntimeError("XCCL_TEST_LSAN=1 but no LeakSanitizer runtime (LD_PRELOAD?)")
        # tests/san/sitecustomize.py, which tests/san/run-python.sh loads into every process
        self.pin_frames = getattr(sys.modules.get("sitecustomize"), "pin_running_frames", None)
        if self.pin_frames is None:
            raise RuntimeError("XCCL_TEST_LSAN=1 without tests/san/sitecustomize.py on PYTHONPATH")
        self.rt = rt
        self.check = getattr(rt, "__lsan_do_recoverable_leak_check")
        self.set_path = getattr(rt, "__sanitizer_set_report_path")
        self.restore = b"stderr"
        for opt in os.environ.get("ASAN_OPTIONS", "").split(":"):
            key, _, value = opt.partition("=")
            if key == "log_path" and value:
                self.restore = value.encode()

    def start(self) -> None:
        """The baseline. Call it with this object stored where the check can see it."""
        if self.rt is None:
            return
        # CPython creates a running frame's frame object only when asked (warnings, tracebacks
        # do) and keeps it in its mmap'd frame stack, which LeakSanitizer does not scan:
        # create those of the frames running now, so that they are part of the baseline.
        f = sys._getframe()
        while f is not None:
            f = f.f_back
        # The symbolizer reads the list of loaded libraries once, at the first check: load
        # xccl's extension before it, or the frames in it go unnamed in the reports.
        importlib.import_module("xccl")
        self.base = self._records(self._run())

    def _run(self) -> str:
        import gc

        gc.collect()
        self.pin_frames()
        where = tempfile.mkdtemp(prefix="xccl-lsan-")
        try:
            self.set_path(os.path.join(where, "lsan").encode())
            try:
                self.check()
            finally:
                self.set_path(self.restore)
            text = ""
            for name in sorted(os.listdir(where)):
                with open(os.path.join(where, name), errors="replace") as f:
                    text += f.read()
            return text
        finally:
            shutil.rmtree(where, ignore_errors=True)

    @staticmethod
    def _records(text: str) -> dict[str, tuple[int, str]]:
        """The report's leak records ("Direct leak of N byte(s) in K object(s) allocated
        from:" and a stack): stack (kind and frames, less frame numbers and addresses) ->
        (bytes, the record's text)."""
        out: dict[str, tuple[int, str]] = {}
        for chunk in text.split("\n\n"):
            chunk = chunk.strip("\n")
            if not chunk.startswith(("Direct leak of", "Indirect leak of")):
                continue
            head, *frames = chunk.splitlines()
            kind, _, rest = head.partition(" leak of ")
            key = kind + "\n" + "\n".join(f.split(" in ", 1)[-1] for f in frames)
            size = out.get(key, (0, ""))[0] + int(rest.split(" ", 1)[0])
            out[key] = (size, chunk)
        return out

    def new_leaks(self) -> Optional[str]:
        """None, or a message; the new records are printed to stderr (the rank's log)."""
        if self.rt is None:
            return None
        now = self._records(self._run())
        new = [rec for key, (size, rec) in now.items() if size > self.base.get(key, (0, ""))[0]]
        if not new:
            return None
        print(
            f"LeakSanitizer: {len(new)} leak record(s) new since the rank started:\n\n"
            + "\n\n".join(new),
            file=sys.stderr,
            flush=True,
        )
        return f"LeakSanitizer found {len(new)} new leak(s) in this rank (report in its output)"


def _set_death_signal() -> None:
    """Asks Linux to SIGKILL this rank when its parent (the fork server, which exits with the
    test process) dies, so that an interrupted test run leaves no rank behind."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _redirect_output(log_path: str) -> None:
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:
        os._exit(70)  # the run this rank belonged to is over (its directory is gone)
    for std in (1, 2):
        os.dup2(fd, std)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        except (AttributeError, ValueError):
            pass


def _resolve(module: str, qualname: str) -> Callable[..., Any]:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _send(conn: multiprocessing.connection.Connection, msg: tuple[str, Any]) -> None:
    try:
        conn.send_bytes(pickle.dumps(msg))
    except Exception:
        conn.send_bytes(
            pickle.dumps(
                ("err", "could not send the result to the parent:\n" + traceback.format_exc())
            )
        )


def _child_main(
    conn: multiprocessing.connection.Connection,
    rank: int,
    world_size: int,
    fn_ref: tuple[str, str],
    payload: bytes,
    environ: dict[str, str],
    init: Optional[dict[str, Any]],
    log_path: str,
) -> None:
    """Body of one rank (runs in the child). Sends ("ok", pickled value) or ("err", text)."""
    _redirect_output(log_path)
    _set_death_signal()
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    # The parent's environment as it is now (the fork server's is from when it started),
    # applied before the test module or xccl is imported.
    os.environ.clear()
    os.environ.update(environ)
    # What the leak check must see as reachable lives in this module's globals: LeakSanitizer
    # does not scan the running Python frames (CPython keeps them in mmap'd chunks), so an
    # object held by a local of this frame alone would look leaked.
    preloaded = "xccl" in sys.modules
    _KEEP["leaks"] = _LeakCheck()
    _KEEP["leaks"].start()
    _KEEP["msg"] = _run_rank(rank, world_size, fn_ref, payload, init, preloaded)
    leaked = _KEEP["leaks"].new_leaks()
    msg = _KEEP.pop("msg")
    if leaked is not None:
        msg = ("err", leaked if msg[0] == "ok" else f"{leaked}; and before that:\n{msg[1]}")
    sys.stdout.flush()
    sys.stderr.flush()
    _send(conn, msg)
    conn.close()


_KEEP: dict[str, Any] = {}


def _run_rank(
    rank: int,
    world_size: int,
    fn_ref: tuple[str, str],
    payload: bytes,
    init: Optional[dict[str, Any]],
    preloaded: bool,
) -> tuple[str, Any]:
    """Joins the group (with `init`), runs the test's function, leaves the group: ("ok",
    pickled value) or ("err", text). `preloaded`: xccl was imported before the rank began."""
    try:
        if preloaded:
            raise RuntimeError(
                "xccl was imported before the rank started (fork server "
                "preload?): ranks must import it fresh"
            )
        fn = _resolve(*fn_ref)
        args = pickle.loads(payload)
        if init is not None:
            import xccl

            xccl.init_process_group(
                init["backend"],
                init_method=init["init_method"],
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=init["timeout"]),
            )
        value = fn(rank, world_size, *args)
        if init is not None:
            xccl.destroy_process_group()
        try:
            return ("ok", pickle.dumps(value))
        except Exception as e:
            return ("err", f"the return value {value!r:.200} cannot be pickled: {e!r}")
    except BaseException as e:
        tb = e.__traceback__
        if tb is not None and tb.tb_frame.f_code is _run_rank.__code__:
            tb = tb.tb_next  # start the report at the test's own code
        return ("err", "".join(traceback.format_exception(type(e), e, tb)))


# --------------------------------------------------------------------------- parent side


class _Rank:
    def __init__(
        self,
        rank: int,
        proc: multiprocessing.process.BaseProcess,
        conn: multiprocessing.connection.Connection,
        log_path: str,
    ) -> None:
        self.rank = rank
        self.proc = proc
        self.conn: Optional[multiprocessing.connection.Connection] = conn
        self.log_path = log_path
        self.result: Optional[tuple[str, Any]] = None
        self.exited = False
        self.killed = False  # by the harness, after a timeout or another rank's failure

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""


def _exit_text(code: Optional[int]) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _prefixed(rank: int, text: str, limit_lines: Optional[int] = None) -> str:
    lines = text.splitlines()
    if limit_lines is not None and len(lines) > limit_lines:
        lines = [f"... ({len(lines) - limit_lines} earlier lines)"] + lines[-limit_lines:]
    return "\n".join(f"[rank {rank}] {line}" for line in lines)


def _check_fn(fn: Callable[..., Any]) -> tuple[str, str]:
    module, qualname = fn.__module__, fn.__qualname__
    if "<locals>" in qualname or module == "__main__":
        raise TypeError(f"run_spmd needs a module-level function, got {module}.{qualname}")
    try:
        found = _resolve(module, qualname)
    except (ImportError, AttributeError):
        found = None
    if found is not fn:
        raise TypeError(f"{module}.{qualname} cannot be imported by name from a child process")
    return module, qualname


def run_spmd(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    backend: str = "auto",
    env: Optional[Mapping[str, str]] = None,
    init: bool = True,
    expect_exit: Optional[Mapping[int, Optional[int]]] = None,
    pg_timeout: Optional[float] = None,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` new processes.

    Returns the ranks' return values, in rank order (None for ranks in ``expect_exit``).

    - ``init``: join a process group first (``xccl.init_process_group(backend,
      init_method="file://<tmp>/store", rank, world_size, timeout=pg_timeout)``) and destroy
      it after ``fn``. ``pg_timeout`` defaults to 3/4 of ``timeout``, so that an operation
      that hangs raises in the rank (with xccl's own diagnosis) before the harness kills it.
    - ``env``: variables set in every rank, on top of the current environment, before it
      imports anything.
    - ``expect_exit``: ``{rank: code}`` for ranks that are meant to die (``os._exit``, a
      signal): ``None`` accepts any abnormal end, an int only that exit code (negative for a
      signal, as in ``Popen.returncode``). Such a rank returning normally is a failure.
    - ``timeout``: seconds for the whole run; ranks still running then are a failure.

    Raises :class:`SpmdError` (an AssertionError) describing every rank that failed.
    """
    __tracebackhide__ = True  # pytest: show the test's line, not the harness's internals
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    expect = dict(expect_exit or {})
    bad = [r for r in expect if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"expect_exit names ranks {bad} outside 0..{world_size - 1}")
    fn_ref = _check_fn(fn)
    payload = pickle.dumps(args)
    environ = dict(os.environ)
    environ.update(env or {})
    ctx = _context()
    tmp = tempfile.mkdtemp(prefix="xccl-spmd-")
    init_args = None
    if init:
        init_args = {
            "backend": backend,
            "init_method": f"file://{tmp}/store",
            "timeout": pg_timeout if pg_timeout is not None else 0.75 * timeout,
        }
    ranks: list[_Rank] = []
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            log_path = os.path.join(tmp, f"rank{rank}.log")
            proc = ctx.Process(
                target=_child_main,
                name=f"spmd-rank{rank}",
                args=(send, rank, world_size, fn_ref, payload, environ, init_args, log_path),
            )
            proc.start()
            send.close()
            ranks.append(_Rank(rank, proc, recv, log_path))
        timed_out = _collect(ranks, expect, time.monotonic() + timeout)
        logs = {r.rank: r.log() for r in ranks}
    except BaseException:
        # The parent was interrupted (Ctrl-C, pytest-timeout): show where the ranks were.
        live = [r for r in ranks if r.proc.is_alive()]
        _kill_stragglers(live)
        print(
            f"run_spmd interrupted; ranks {[r.rank for r in live]} were still running "
            "(their Python stacks were dumped below)",
            flush=True,
        )
        _echo_logs({r.rank: r.log() for r in ranks})
        raise
    finally:
        for r in ranks:
            if r.proc.is_alive():
                r.proc.kill()
            r.proc.join(5.0)
            if r.conn is not None:
                r.conn.close()
        shutil.rmtree(tmp, ignore_errors=True)
    _echo_logs(logs)
    return _verdict(fn_ref, world_size, ranks, expect, timed_out, timeout, logs)


def _failed(r: _Rank, expect: Mapping[int, Optional[int]]) -> bool:
    """True when rank ``r`` has already done something that fails the run."""
    if r.rank in expect:
        return r.result is not None
    if r.result is not None and r.result[0] == "err":
        return True
    return r.exited and r.result is None


def _collect(ranks: list[_Rank], expect: Mapping[int, Optional[int]], deadline: float) -> bool:
    """Gathers results and exits until every rank has exited. Kills the stragglers at
    ``deadline`` (returns True), or ``FAIL_GRACE_S`` after a rank failed unexpectedly."""
    waiting: dict[Any, _Rank] = {}
    for r in ranks:
        waiting[r.conn] = r
        waiting[r.proc.sentinel] = r
    stop_at = deadline
    while waiting:
        left = stop_at - time.monotonic()
        ready = multiprocessing.connection.wait(list(waiting), timeout=max(0.0, left))
        for obj in ready:
            r = waiting.pop(obj)
            if obj is r.conn:
                try:
                    r.result = pickle.loads(r.conn.recv_bytes())
                except (EOFError, OSError):
                    pass  # died without a word
                except Exception:
                    r.result = (
                        "err",
                        "the parent could not read the rank's message:\n" + traceback.format_exc(),
                    )
            else:
                r.proc.join()
                r.exited = True
        if any(_failed(r, expect) for r in ranks):
            stop_at = min(stop_at, time.monotonic() + FAIL_GRACE_S)
        if not ready and time.monotonic() >= stop_at:
            _kill_stragglers([r for r in ranks if not r.exited])
            return stop_at >= deadline
    return False


def _kill_stragglers(stragglers: list[_Rank]) -> None:
    for r in stragglers:
        try:
            os.kill(r.proc.pid, signal.SIGUSR1)  # faulthandler: Python stacks into the log
        except ProcessLookupError:
            pass
    end = time.monotonic() + DUMP_WAIT_S
    while time.monotonic() < end and any(r.proc.is_alive() for r in stragglers):
        time.sleep(0.02)
    for r in stragglers:
        r.killed = True
        r.proc.kill()
        r.proc.join(10.0)


def _echo_logs(logs: Mapping[int, str]) -> None:
    for rank, text in sorted(logs.items()):
        if not text:
            continue
        if len(text) > LOG_PRINT_LIMIT:
            text = (
                f"... (first {len(text) - LOG_PRINT_LIMIT} characters cut)\n"
                + text[-LOG_PRINT_LIMIT:]
            )
        print(_prefixed(rank, text), flush=True)


def _verdict(
    fn_ref: tuple[str, str],
    world_size: int,
    ranks: Sequence[_Rank],
    expect: Mapping[int, Optional[int]],
    timed_out: bool,
    timeout: float,
    logs: Mapping[int, str],
) -> list[Any]:
    __tracebackhide__ = True
    problems: list[str] = []
    values: list[Any] = []
    hung = [r.rank for r in ranks if r.killed]
    for r in ranks:
        code = r.proc.exitcode
        tail = _prefixed(r.rank, logs.get(r.rank, ""), LOG_TAIL_LINES)
        where = f"rank {r.rank} (pid {r.proc.pid})"
        values.append(None)
        if r.killed:
            continue  # reported together below
        if r.rank in expect:
            want = expect[r.rank]
            if r.result is not None and r.result[0] == "err":
                problems.append(
                    f"{where} was expected to exit but raised:\n" + _prefixed(r.rank, r.result[1])
                )
            elif r.result is not None:
                problems.append(f"{where} was expected to exit but returned")
            elif want is None and code == 0:
                problems.append(f"{where} was expected to die but exited with code 0")
            elif want is not None and code != want:
                problems.append(f"{where} {_exit_text(code)}, expected {_exit_text(want)}")
            continue
        if r.result is None:
            problems.append(
                f"{where} {_exit_text(code)} without a result; its output ends:\n"
                + (tail or "(no output)")
            )
        elif r.result[0] == "err":
            problems.append(f"{where} raised:\n" + _prefixed(r.rank, r.result[1]))
        elif code != 0:
            problems.append(
                f"{where} returned, then {_exit_text(code)}; its output ends:\n"
                + (tail or "(no output)")
            )
        else:
            values[-1] = pickle.loads(r.result[1])
    if hung:
        why = (
            f"did not finish within {timeout:g} s"
            if timed_out
            else f"had not finished {FAIL_GRACE_S:g} s after another rank failed"
        )
        stacks = "\n".join(
            _prefixed(r.rank, logs.get(r.rank, ""), LOG_TAIL_LINES)
            or f"[rank {r.rank}] (no output)"
            for r in ranks
            if r.killed
        )
        problems.append(
            f"rank(s) {', '.join(map(str, hung))} {why}; killed them. Their "
            f"output ends (Python stacks dumped at the kill):\n{stacks}"
        )
    if problems:
        name = ".".join(fn_ref)
        raise SpmdError(
            f"run_spmd({name}, world_size={world_size}) failed:\n\n" + "\n\n".join(problems)
        )
    return values
