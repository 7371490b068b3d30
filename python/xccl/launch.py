"""``xccl.launch``: run a function on N local ranks from a notebook cell (or any Python code).

    import xccl, numpy as np

    def body(n):
        x = np.full(n, xccl.get_rank(), np.float32)
        xccl.all_reduce(x)
        print("sum:", x[0])                    # shows up as "[rank 2] sum: 6.0"
        return x[0]

    xccl.launch(body, 4, 8)                    # -> [6.0, 6.0, 6.0, 6.0]

Each rank runs ``fn(*args, **kwargs)`` with the default process group already initialized
(``xccl.get_rank()``, ``xccl.get_world_size()``, every collective), and ``launch`` returns the
ranks' return values in rank order.

``mode="processes"`` (the default) starts one fresh Python process per rank. The function is
shipped with cloudpickle, so functions defined in a notebook, closures and lambdas work
(without cloudpickle only importable functions do). The ranks meet through a file store in a
private temporary directory: no port to choose. Every line a rank prints (file descriptors 1
and 2, so C-level output too) appears in the caller's ``sys.stdout``/``sys.stderr`` prefixed
with ``[rank N] ``, printed by the calling thread (in Jupyter: into the running cell).

If a rank raises, :class:`LaunchError` is raised with that rank, its exception type and its
traceback; ranks still running are given ``grace`` seconds to finish, then the ones still
stuck are asked for their flight recorder and stopped, and the error shows a table of which
rank was waiting in which operation for whom (see :mod:`xccl.debug`). ``timeout`` bounds the
whole run the same way (:class:`LaunchTimeoutError`). Ctrl-C or a Jupyter kernel interrupt
prints that table, stops every rank and re-raises KeyboardInterrupt. Whatever happens, every
rank process is gone (SIGTERM, then SIGKILL) and the temporary directory and any
shared-memory segment left by a killed rank are removed before ``launch`` returns; it can be
called again at once. Ranks also die with their parent (Linux ``PR_SET_PDEATHSIG``), and exit
when it closes their standard input.

``mode="threads"`` runs the ranks as threads of the calling process, over an in-process
store: no start-up cost, the same objects in every rank (no pickling), breakpoints work, and
a failing rank's exception is chained (``raise LaunchError(...) from exc``) with its real
traceback. Each rank thread has its own default process group (see ``_group._set_thread_world``).
Ranks are stopped at their next xccl call (their communicators are aborted); a thread stuck
in pure Python code cannot be stopped and is left running as a daemon thread.
"""

from __future__ import annotations

import collections
import glob
import os
import pickle
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional, Union

__all__ = ["LaunchError", "LaunchTimeoutError", "launch"]

_POLL_S = 0.02  # how often the parent looks at results, exits and the deadline
_DUMP_WAIT_S = 1.5  # how long stuck ranks get to write their flight recorder
_TERM_GRACE_S = 2.0  # SIGTERM -> SIGKILL
_EXIT_WAIT_S = 10.0  # after "exit", how long ranks get to destroy their groups and leave
_TAIL_LINES = 20  # lines of a dead rank's stderr quoted in the error
# Errors that are usually the consequence of another rank's failure, not its cause.
_CONSEQUENCES = ("XcclConnectionError", "LaunchAborted")

Seconds = Union[None, float, int, timedelta]


class LaunchError(RuntimeError):
    """A rank of :func:`launch` failed (raised, died, or could not send its result back).

    Attributes: ``rank`` (the failing rank reported first, None for a timeout with no
    failure), ``exc_type`` (its exception's class name, or "" when it died), ``remote_traceback``
    (the rank's traceback text), ``failures`` (rank -> one-line summary of every failed rank)
    and ``table`` (where every rank was when the run was stopped; "" if all had finished).
    With ``mode="threads"`` the rank's own exception is also the ``__cause__``."""

    def __init__(
        self,
        message: str,
        rank: Optional[int] = None,
        exc_type: str = "",
        remote_traceback: str = "",
        failures: Optional[dict[int, str]] = None,
        table: str = "",
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.failures = dict(failures or {})
        self.table = table


class LaunchTimeoutError(LaunchError, TimeoutError):
    """:func:`launch` ran past its ``timeout``."""


def launch(
    fn: Callable[..., Any],
    nprocs: int = 4,
    *args: Any,
    transport: Optional[str] = None,
    timeout: Seconds = None,
    mode: str = "processes",
    kwargs: Optional[dict[str, Any]] = None,
    op_timeout: Seconds = None,
    grace: float = 2.0,
    init: bool = True,
    env: Optional[dict[str, str]] = None,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on `nprocs` local ranks; returns their return values.

    `transport` picks the process group's transports ("auto" or None, "tcp", "shm");
    `timeout` (seconds or timedelta, None: no limit) bounds the whole run; `op_timeout`
    bounds each collective (default: ``XCCL_TIMEOUT`` or 600 s), so that a hang turns into an
    error naming what each rank waits for; `grace` is how long the other ranks may go on
    after one failed. `mode` is "processes" or "threads". With ``init=False`` no process group
    is made (the function makes its own). `env` adds environment variables to the rank
    processes. Raises :class:`LaunchError` (or :class:`LaunchTimeoutError`) when a rank
    fails, and KeyboardInterrupt after stopping every rank when interrupted.
    """
    if not callable(fn):
        raise TypeError(f"launch: fn must be callable, got {type(fn).__name__}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"launch: nprocs must be a positive int, got {nprocs!r}")
    from ._types import Backend

    backend = str(Backend(transport if transport else "auto"))
    limit = None if timeout is None else _seconds(timeout, "timeout")
    op_limit = None if op_timeout is None else _seconds(op_timeout, "op_timeout")
    call = (fn, tuple(args), dict(kwargs or {}))
    if mode == "processes":
        return _ProcessRun(call, nprocs, backend, limit, op_limit, grace, init, env).run()
    if mode == "threads":
        if env:
            raise ValueError("launch: env= needs mode='processes' (threads share one environment)")
        return _ThreadRun(call, nprocs, backend, limit, op_limit, grace, init).run()
    raise ValueError(f"launch: mode must be 'processes' or 'threads', got {mode!r}")


def _seconds(value: Seconds, what: str) -> float:
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"launch: {what} must be a positive number of seconds, got {value!r}")
    return float(value)


# ---------------------------------------------------------------------------------------------
# Results and errors, shared by both modes
# ---------------------------------------------------------------------------------------------


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__


def _primary(failures: dict[int, dict[str, Any]]) -> int:
    """The failed rank to report: the earliest failure that is not a likely consequence of
    another rank's (a lost connection), else the earliest."""

    def key(r: int) -> tuple[int, float, int]:
        f = failures[r]
        return (int(f.get("type", "") in _CONSEQUENCES), f.get("time", 0.0), r)

    return min(failures, key=key)


def _error(
    failures: dict[int, dict[str, Any]],
    table: str,
    timed_out: Optional[float],
    nranks: int,
) -> LaunchError:
    summary = {r: f["summary"] for r, f in sorted(failures.items())}
    if failures:
        r = _primary(failures)
        f = failures[r]
        lines = [f"rank {r} of {nranks} failed: {f['summary']}"]
        others = [f"  rank {q}: {s}" for q, s in summary.items() if q != r]
        if others:
            lines += ["other failed ranks:", *others]
        if f.get("traceback"):
            lines += ["", f"traceback of rank {r}:", f["traceback"].rstrip()]
        rank, exc_type, tb = r, f.get("type", ""), f.get("traceback", "")
    else:
        lines = [f"xccl.launch: the ranks did not finish within {timed_out:g} s"]
        rank, exc_type, tb = None, "", ""
    if timed_out is not None and failures:
        lines.insert(1, f"(and the run reached its timeout of {timed_out:g} s)")
    if table:
        lines += ["", "where the ranks were when the run was stopped:", table.rstrip()]
    cls = LaunchTimeoutError if timed_out is not None and not failures else LaunchError
    return cls("\n".join(lines), rank, exc_type, tb, summary, table)


# ---------------------------------------------------------------------------------------------
# Processes: parent side
# ---------------------------------------------------------------------------------------------


def _unsaved_sources(limit: int = 4 << 20) -> dict[str, tuple[Any, ...]]:
    """The source lines Python knows of code that is in no file (Jupyter cells, IPython
    input), so that a rank's traceback can quote the lines of a function defined there."""
    import linecache

    out: dict[str, tuple[Any, ...]] = {}
    total = 0
    for name, entry in list(linecache.cache.items()):
        if len(entry) != 4 or not entry[2] or os.path.exists(name):
            continue
        total += entry[0] or 0
        if total > limit:
            break
        out[name] = (entry[0], None, list(entry[2]), entry[3])  # mtime None: never checked
    return out


def _pickler() -> Any:
    try:
        import cloudpickle

        return cloudpickle
    except ImportError:
        return pickle


class _ProcessRun:
    """One launch in processes: owns the temporary directory, the ranks and their pipes."""

    def __init__(
        self,
        call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]],
        nranks: int,
        backend: str,
        limit: Optional[float],
        op_limit: Optional[float],
        grace: float,
        init: bool,
        env: Optional[dict[str, str]],
    ) -> None:
        self.call = call
        self.n = nranks
        self.backend = backend
        self.limit = limit
        self.op_limit = op_limit
        self.grace = max(0.0, float(grace))
        self.init = init
        self.extra_env = dict(env or {})
        self.tmp = ""
        self.procs: list[subprocess.Popen[bytes]] = []
        self.readers: list[threading.Thread] = []
        self.lines: queue.Queue[tuple[int, int, Optional[str]]] = queue.Queue()
        self.tails: list[collections.deque[str]] = [
            collections.deque(maxlen=_TAIL_LINES) for _ in range(nranks)
        ]
        self.results: dict[int, dict[str, Any]] = {}

    # -- set-up --------------------------------------------------------------------------------

    def _payload(self) -> bytes:
        fn = self.call[0]
        pickler = _pickler()
        try:
            inner = pickler.dumps(self.call, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            hint = (
                "" if pickler is not pickle
                else " (install cloudpickle to ship functions defined in a notebook, closures "
                "and lambdas)"
            )
            raise TypeError(
                f"launch: cannot send {getattr(fn, '__qualname__', fn)!r} and its arguments to "
                f"the ranks: {exc}{hint}"
            ) from exc
        config = {
            "call": inner,
            "source": _unsaved_sources(),
            "sys_path": [p if p else os.getcwd() for p in sys.path],
            "backend": self.backend,
            "op_timeout": self.op_limit,
            "init": self.init,
        }
        return pickle.dumps(config, protocol=pickle.HIGHEST_PROTOCOL)

    def _env(self, rank: int, key: str) -> dict[str, str]:
        env = dict(os.environ)
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(
            [pkg_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        env.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.n),
                "LOCAL_WORLD_SIZE": str(self.n),
                "GROUP_RANK": "0",
                "PYTHONUNBUFFERED": "1",
                "XCCL_AUTH_KEY": key,
                # Ranks have no screen; Jupyter's inline backend would import IPython there.
                "MPLBACKEND": "Agg",
            }
        )
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, "1")  # N ranks on a few cores: no nested thread pools
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)
        env.update(self.extra_env)
        return env

    def _start(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="xccl-launch-")
        with open(os.path.join(self.tmp, "payload.pkl"), "wb") as f:
            f.write(self._payload())
        key = secrets.token_hex(16)
        cmd = [sys.executable, "-c", "from xccl.launch import _child_main; _child_main()"]
        for rank in range(self.n):
            proc = subprocess.Popen(
                [*cmd, self.tmp, str(rank), str(self.n)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self._env(rank, key),
                cwd=os.getcwd(),
                start_new_session=True,  # a terminal's Ctrl-C reaches us; we stop the ranks
            )
            self.procs.append(proc)
            for fd, pipe in ((1, proc.stdout), (2, proc.stderr)):
                t = threading.Thread(
                    target=self._read, args=(rank, fd, pipe), name=f"xccl-launch-r{rank}-{fd}",
                    daemon=True,
                )
                t.start()
                self.readers.append(t)

    def _read(self, rank: int, fd: int, pipe: Any) -> None:
        """Reader thread: queues every line of one pipe; None at the end."""
        try:
            for raw in iter(pipe.readline, b""):
                self.lines.put((rank, fd, raw.decode("utf-8", "replace").rstrip("\r\n")))
        except (OSError, ValueError):
            pass
        self.lines.put((rank, fd, None))

    # -- output ----------------------------------------------------------------------------------

    def _print_lines(self, wait: float) -> None:
        """Prints queued lines from the calling thread, waiting up to `wait` for the first."""
        try:
            item: Optional[tuple[int, int, Optional[str]]] = self.lines.get(timeout=wait)
        except queue.Empty:
            return
        while item is not None:
            rank, fd, text = item
            if text is not None:
                if fd == 2:
                    self.tails[rank].append(text)
                print(f"[rank {rank}] {text}", file=sys.stderr if fd == 2 else sys.stdout,
                      flush=True)
            try:
                item = self.lines.get_nowait()
            except queue.Empty:
                item = None

    # -- results ---------------------------------------------------------------------------------

    def _collect(self) -> None:
        for rank, proc in enumerate(self.procs):
            if rank in self.results:
                continue
            path = os.path.join(self.tmp, f"result-{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    self.results[rank] = pickle.load(f)
            elif proc.poll() is not None:
                # Gone without a result: look once more (it may have written it and exited).
                if os.path.exists(path):
                    continue
                self.results[rank] = self._death(rank, proc.returncode)

    def _death(self, rank: int, code: int) -> dict[str, Any]:
        if code < 0:
            try:
                how = f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with status {code} before returning"
        tail = "\n".join(self.tails[rank])
        return {
            "ok": False,
            "type": "",
            "summary": f"process {how}",
            "traceback": f"last lines of its stderr:\n{tail}" if tail else "",
            "time": time.monotonic(),
        }

    def _failures(self) -> dict[int, dict[str, Any]]:
        return {r: res for r, res in self.results.items() if not res["ok"]}

    # -- stopping --------------------------------------------------------------------------------

    def _tell(self, proc: subprocess.Popen[bytes], word: bytes) -> None:
        if proc.poll() is None and proc.stdin is not None:
            try:
                proc.stdin.write(word + b"\n")
                proc.stdin.flush()
            except (OSError, ValueError):
                pass

    def _dumps(self, wait: float) -> dict[int, str]:
        """Asks every rank still running for its flight recorder; collects what arrives."""
        running = [r for r, p in enumerate(self.procs) if p.poll() is None]
        for r in running:
            self._tell(self.procs[r], b"dump")
        deadline = time.monotonic() + wait
        dumps: dict[int, str] = {}
        while True:
            for r in running:
                path = os.path.join(self.tmp, f"dump-{r}.txt")
                if r not in dumps and os.path.exists(path):
                    with open(path, encoding="utf-8", errors="replace") as f:
                        dumps[r] = f.read()
            if len(dumps) == len(running) or time.monotonic() >= deadline:
                break
            self._print_lines(_POLL_S)
        for r, res in self.results.items():
            if res.get("flight"):
                dumps.setdefault(r, res["flight"])
        return dumps

    def _table(self, dumps: dict[int, str]) -> str:
        from .debug import waits_table

        errors = {r: res.get("message", res["summary"]) for r, res in self._failures().items()}
        finished = {r for r, res in self.results.items() if res["ok"]}
        return waits_table(dumps, errors, finished, self.n)

    def _kill_all(self) -> None:
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            try:
                p.terminate()
            except OSError:
                pass
        deadline = time.monotonic() + _TERM_GRACE_S
        for p in alive:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        for p in alive:
            try:
                p.wait(_TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                pass

    def _finish(self) -> None:
        """Lets the ranks leave (they destroy their groups), then makes sure they are gone."""
        for p in self.procs:
            self._tell(p, b"exit")
        deadline = time.monotonic() + _EXIT_WAIT_S
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            self._print_lines(_POLL_S)

    def _cleanup(self) -> None:
        self._kill_all()
        for p in self.procs:
            if p.stdin is not None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        for t in self.readers:
            t.join(timeout=2.0)
        self._print_lines(0.0)
        for p in self.procs:
            for pipe in (p.stdout, p.stderr):
                if pipe is not None:
                    pipe.close()
            # A rank killed during shared-memory wire-up may leave its segment behind
            # (named /dev/shm/xccl-<job>-<rank>-<pid>, see backends/shm).
            for path in glob.glob(f"/dev/shm/xccl-*-{p.pid}"):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> list[Any]:
        try:
            self._start()
            deadline = None if self.limit is None else time.monotonic() + self.limit
            first_failure: Optional[float] = None
            timed_out: Optional[float] = None
            while True:
                self._print_lines(_POLL_S)
                self._collect()
                if len(self.results) == self.n:
                    break
                now = time.monotonic()
                if self._failures():
                    first_failure = first_failure or now
                    if now - first_failure >= self.grace:
                        break
                if deadline is not None and now >= deadline:
                    timed_out = self.limit
                    break
            failures = self._failures()
            if not failures and timed_out is None:
                self._finish()
                return self._values()
            table = self._table(self._dumps(_DUMP_WAIT_S))
            raise _error(failures, table, timed_out, self.n)
        except KeyboardInterrupt:
            if self.procs:
                try:
                    table = self._table(self._dumps(0.5))
                    print(f"xccl.launch interrupted; where the ranks were:\n{table}",
                          file=sys.stderr, flush=True)
                except BaseException:
                    pass
            raise
        finally:
            self._cleanup()

    def _values(self) -> list[Any]:
        values = []
        for rank in range(self.n):
            try:
                values.append(pickle.loads(self.results[rank]["value"]))
            except Exception as exc:
                raise LaunchError(
                    f"the return value of rank {rank} cannot be unpickled here: {_describe(exc)}",
                    rank, type(exc).__name__,
                ) from exc
        return values


# ---------------------------------------------------------------------------------------------
# Processes: rank side
# ---------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank when the process that started it dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PDEATHSIG
    except (OSError, AttributeError):
        pass


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.part"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _control(tmp: str, rank: int, release: threading.Event) -> None:
    """Rank-side thread: obeys the parent's words on stdin ("dump", "exit"). End of input
    means the parent is gone or gave up on us: leave at once."""
    from .debug import local_dump

    buf = b""
    while True:
        try:
            chunk = os.read(0, 4096)
        except OSError:
            chunk = b""
        if not chunk:
            if not release.is_set():
                os._exit(70)
            return
        buf += chunk
        while b"\n" in buf:
            word, buf = buf.split(b"\n", 1)
            if word == b"dump":
                try:
                    text = local_dump()
                except Exception as exc:
                    text = f"flight recorder unavailable: {exc}\n"
                _write_atomic(os.path.join(tmp, f"dump-{rank}.txt"), text.encode())
            elif word == b"exit":
                release.set()


def _user_traceback(exc: BaseException) -> str:
    """The traceback of `exc` from the user's code on: the frame of xccl.launch's function
    that called it is left out."""
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _failure_record(exc: BaseException, tb: str) -> dict[str, Any]:
    from .debug import local_dump

    rec: dict[str, Any] = {
        "ok": False,
        "type": type(exc).__name__,
        "summary": _describe(exc),
        "message": str(exc),
        "traceback": tb,
        "time": time.monotonic(),
    }
    try:
        rec["flight"] = local_dump()
    except Exception:
        pass
    return rec


def _child_main() -> None:
    """Entry point of a rank process: ``python -c ... <tmp> <rank> <nranks>``."""
    tmp, rank, nranks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    _die_with_parent()
    with open(os.path.join(tmp, "payload.pkl"), "rb") as f:
        config = pickle.load(f)
    for p in reversed(config["sys_path"]):
        if p not in sys.path:
            sys.path.insert(0, p)
    import linecache

    linecache.cache.update(config.get("source", {}))
    release = threading.Event()
    threading.Thread(target=_control, args=(tmp, rank, release), daemon=True,
                     name="xccl-launch-control").start()
    import xccl

    record: dict[str, Any]
    try:
        fn, args, kwargs = pickle.loads(config["call"])
        if config["init"]:
            xccl.init_process_group(
                config["backend"], init_method=f"file://{tmp}/store", rank=rank,
                world_size=nranks, timeout=config["op_timeout"],
            )
        value = fn(*args, **kwargs)
        try:
            record = {"ok": True, "value": _pickler().dumps(value, protocol=5)}
        except Exception as exc:
            raise TypeError(
                f"the return value ({type(value).__name__}) cannot be pickled: {exc}"
            ) from exc
    except BaseException as exc:  # KeyboardInterrupt and SystemExit are reported too
        record = _failure_record(exc, _user_traceback(exc))
    sys.stdout.flush()
    sys.stderr.flush()
    _write_atomic(os.path.join(tmp, f"result-{rank}.pkl"), pickle.dumps(record, protocol=5))
    # Stay until every rank has returned (so no rank tears down connections that others still
    # use), or until the parent stops us.
    release.wait()
    try:
        xccl.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


# ---------------------------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------------------------

_rank_of_thread = threading.local()


class _RankStream:
    """Stands in for sys.stdout / sys.stderr during a threads launch: what a rank thread
    writes is cut into lines and queued with the rank; other threads write through."""

    def __init__(self, target: Any, fd: int, out: queue.Queue[tuple[int, int, str]]) -> None:
        self._target = target
        self._fd = fd
        self._out = out
        self._partial: dict[int, str] = {}
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        rank = getattr(_rank_of_thread, "rank", None)
        if rank is None:
            return self._target.write(s)
        with self._lock:
            text = self._partial.pop(rank, "") + s
            *lines, rest = text.split("\n")
            if rest:
                self._partial[rank] = rest
        for line in lines:
            self._out.put((rank, self._fd, line))
        return len(s)

    def flush_rank(self, rank: int) -> None:
        with self._lock:
            rest = self._partial.pop(rank, "")
        if rest:
            self._out.put((rank, self._fd, rest))

    def flush(self) -> None:
        rank = getattr(_rank_of_thread, "rank", None)
        if rank is None:
            self._target.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


class _ThreadRun:
    def __init__(
        self,
        call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]],
        nranks: int,
        backend: str,
        limit: Optional[float],
        op_limit: Optional[float],
        grace: float,
        init: bool,
    ) -> None:
        from . import _group

        self.call = call
        self.n = nranks
        self.backend = backend
        self.limit = limit
        self.op_limit = op_limit
        self.grace = max(0.0, float(grace))
        self.init = init
        self.worlds = [_group._World() for _ in range(nranks)]
        self.values: list[Any] = [None] * nranks
        self.failures: dict[int, dict[str, Any]] = {}
        self.exceptions: dict[int, BaseException] = {}
        self.done: set[int] = set()
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.lines: queue.Queue[tuple[int, int, str]] = queue.Queue()

    def _rank_main(self, rank: int, store: Any) -> None:
        from . import _group

        _group._set_thread_world(self.worlds[rank])
        _rank_of_thread.rank = rank
        fn, args, kwargs = self.call
        try:
            if self.init:
                _group.init_process_group(
                    self.backend, store=store, rank=rank, world_size=self.n,
                    timeout=self.op_limit,
                )
            value = fn(*args, **kwargs)
            with self.lock:
                self.values[rank] = value
        except BaseException as exc:
            rec = _failure_record(exc, _user_traceback(exc))
            with self.lock:
                self.failures[rank] = rec
                self.exceptions[rank] = exc
        finally:
            for stream in (sys.stdout, sys.stderr):
                if isinstance(stream, _RankStream):
                    stream.flush_rank(rank)
            with self.lock:
                self.done.add(rank)
            self.release.wait()
            try:
                _group.destroy_process_group()
            finally:
                _group._set_thread_world(None)
                _rank_of_thread.rank = None

    def _print_lines(self, wait: float, out: Any, err: Any) -> None:
        try:
            item: Optional[tuple[int, int, str]] = self.lines.get(timeout=wait)
        except queue.Empty:
            return
        while item is not None:
            rank, fd, text = item
            print(f"[rank {rank}] {text}", file=err if fd == 2 else out, flush=True)
            try:
                item = self.lines.get_nowait()
            except queue.Empty:
                item = None

    def _dumps(self) -> dict[int, str]:
        from .debug import local_dump

        dumps = {}
        for rank, world in enumerate(self.worlds):
            if rank in self.done and rank not in self.failures:
                continue
            groups = [pg for pg in list(world.groups) if pg._comm is not None]
            dumps[rank] = local_dump(groups) if groups else ""
        for rank, rec in self.failures.items():
            if rec.get("flight"):
                dumps[rank] = rec["flight"]
        return dumps

    def _abort_all(self) -> None:
        for world in self.worlds:
            for pg in list(world.groups):
                comm = pg._comm
                if comm is not None:
                    try:
                        comm.abort()
                    except Exception:
                        pass

    def run(self) -> list[Any]:
        from . import _store
        from .debug import waits_table

        store = _store.HashStore()
        out, err = sys.stdout, sys.stderr
        sys.stdout = _RankStream(out, 1, self.lines)
        sys.stderr = _RankStream(err, 2, self.lines)
        threads = [
            threading.Thread(target=self._rank_main, args=(r, store), name=f"xccl-rank-{r}",
                             daemon=True)
            for r in range(self.n)
        ]
        stopped = False
        try:
            for t in threads:
                t.start()
            deadline = None if self.limit is None else time.monotonic() + self.limit
            first_failure: Optional[float] = None
            timed_out: Optional[float] = None
            while True:
                self._print_lines(_POLL_S, out, err)
                with self.lock:
                    ndone, failed = len(self.done), bool(self.failures)
                if ndone == self.n:
                    break
                now = time.monotonic()
                if failed:
                    first_failure = first_failure or now
                    if now - first_failure >= self.grace:
                        break
                if deadline is not None and now >= deadline:
                    timed_out = self.limit
                    break
            if not self.failures and timed_out is None:
                return list(self.values)
            with self.lock:
                finished = {r for r in self.done if r not in self.failures}
                errors = {r: f.get("message", f["summary"]) for r, f in self.failures.items()}
            table = waits_table(self._dumps(), errors, finished, self.n)
            stopped = True
            exc = _error(dict(self.failures), table, timed_out, self.n)
            cause = self.exceptions.get(exc.rank) if exc.rank is not None else None
            raise exc from cause
        except KeyboardInterrupt:
            try:
                table = waits_table(self._dumps(), nranks=self.n)
                print(f"xccl.launch interrupted; where the ranks were:\n{table}", file=err,
                      flush=True)
            except BaseException:
                pass
            stopped = True
            raise
        finally:
            if stopped:
                self._abort_all()
            self.release.set()
            for t in threads:
                t.join(timeout=_EXIT_WAIT_S if not stopped else _TERM_GRACE_S)
            sys.stdout, sys.stderr = out, err
            self._print_lines(0.0, out, err)

