"""``xccl-run``: start the ranks of an xccl (or torch.distributed) job.

Usage::

    xccl-run --nproc-per-node 4 train.py --lr 0.1        # 4 ranks on this host
    xccl-run --nproc-per-node 4 -m mypkg.train           # run a module
    xccl-run --nproc-per-node 2 --no-python ./a.out      # run any program
    python -m xccl.run --nproc-per-node 4 train.py       # the same without the script

The options follow ``torchrun`` (``--nproc-per-node``/``--nproc_per_node``, ``--nnodes``,
``--node-rank``, ``--master-addr``, ``--master-port``, ``-m``, ``--no-python``,
``--standalone``); everything after the script name is passed to the script untouched. Every
rank gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (what ``init_method="env://"`` reads) and, for
single-host jobs, a fresh random ``XCCL_AUTH_KEY`` that only the job's ranks know.

Two ways of running:

* **Spawning** (the default): this process starts ``--nproc-per-node`` ranks, waits for them,
  and, as soon as one fails (non-zero exit or a signal), stops the others (SIGTERM, then
  SIGKILL after ``--grace`` seconds), prints every rank's exit status to stderr and exits with
  the first failure's code (``128 + signal`` for a signal). Ctrl-C (SIGINT), SIGTERM and SIGHUP
  are passed on to the ranks, which are then stopped the same way.
* **Under srun or mpirun**: when the environment says this process is one task of a Slurm step
  (``SLURM_PROCID``, ``SLURM_NTASKS``, ...) or of an Open MPI job (``OMPI_COMM_WORLD_RANK``,
  ``OMPI_COMM_WORLD_SIZE``, ...) with more than one task, and ``--nproc-per-node`` is not
  given, the launcher that started us already made the ranks: ``xccl-run`` translates those
  variables into ``RANK`` etc. and replaces itself (exec) with the script, once.

This module uses only the standard library: it must work before the C extension is built.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, NoReturn, Optional

PROG = "xccl-run"
DEFAULT_PORT = 29500
DEFAULT_GRACE = 5.0
_POLL_S = 0.02
_PR_SET_PDEATHSIG = 1


class LaunchError(Exception):
    """A usage or environment problem found before any rank started."""


@dataclasses.dataclass
class LaunchConfig:
    """What to start, where, and how many times. Built by :func:`parse_args`."""

    cmd: list[str]  # the program and its arguments, exactly as each rank runs it
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None  # None: free port (one node) or DEFAULT_PORT
    prefix: bool = False
    grace: float = DEFAULT_GRACE


@dataclasses.dataclass
class _Rank:
    rank: int
    local_rank: int
    proc: subprocess.Popen
    signalled: Optional[int] = None  # the last signal xccl-run sent to it
    readers: list[threading.Thread] = dataclasses.field(default_factory=list)


def _note(msg: str) -> None:
    """Writes one line of the launcher's own output to stderr."""
    sys.stderr.write(f"{PROG}: {msg}\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------- arguments


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _nproc(text: str) -> int:
    if text in ("auto", "cpu"):
        return os.cpu_count() or 1
    return _positive_int(text)


def _nnodes(text: str) -> int:
    if ":" in text:  # torchrun's elastic "MIN:MAX" form
        lo, _, hi = text.partition(":")
        if lo != hi:
            raise argparse.ArgumentTypeError("elastic node ranges (MIN:MAX) are not supported")
        text = lo
    return _positive_int(text)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is out of range 0..65535")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of ``xccl-run`` (torchrun-compatible option names)."""
    p = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,
        description="Start the ranks of an xccl or torch.distributed job (torchrun-compatible).",
        epilog="Under srun or mpirun (more than one task, no --nproc-per-node) the ranks already "
        "exist: xccl-run sets RANK, WORLD_SIZE, ... from SLURM_* / OMPI_COMM_WORLD_* and execs "
        "the script once.",
    )
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=_nproc,
        default=None,
        metavar="N",
        help="ranks to start on this node (default 1; 'auto': one per CPU)",
    )
    p.add_argument(
        "--nnodes",
        type=_nnodes,
        default=None,
        metavar="N",
        help="number of nodes, each running one xccl-run (default 1)",
    )
    p.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        default=None,
        metavar="I",
        help="this node's index, 0..nnodes-1 (default 0)",
    )
    p.add_argument(
        "--master-addr",
        "--master_addr",
        default=None,
        metavar="HOST",
        help="address of rank 0's node, where the store listens (default 127.0.0.1)",
    )
    p.add_argument(
        "--master-port",
        "--master_port",
        type=_port,
        default=None,
        metavar="PORT",
        help="store port; 0 picks a free one (one node only). Default: a free port "
        f"for one node, {DEFAULT_PORT} for several",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="one node, free port (what torchrun --standalone means)",
    )
    p.add_argument(
        "-p",
        "--prefix",
        action="store_true",
        help="prefix every output line of rank N with '[rank N] '",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE,
        metavar="S",
        help=f"seconds between SIGTERM and SIGKILL when stopping ranks (default {DEFAULT_GRACE:g})",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="SCRIPT is a module name, run as 'python -m SCRIPT'",
    )
    mode.add_argument(
        "--no-python",
        "--no_python",
        action="store_true",
        help="SCRIPT is a program, run without the Python interpreter",
    )
    p.add_argument("script", metavar="SCRIPT", help="the Python script (or module, or program)")
    p.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        metavar="...",
        help="arguments for SCRIPT, passed through untouched",
    )
    return p


def _command(ns: argparse.Namespace) -> list[str]:
    if ns.no_python:
        return [ns.script, *ns.args]
    if ns.module:
        return [sys.executable, "-u", "-m", ns.script, *ns.args]
    return [sys.executable, "-u", ns.script, *ns.args]


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[argparse.Namespace, LaunchConfig]:
    """Parses ``argv`` into the raw namespace and a :class:`LaunchConfig` for spawning mode.

    Raises :class:`LaunchError` for combinations that cannot work.
    """
    ns = build_parser().parse_args(argv)
    if ns.grace < 0:
        raise LaunchError("--grace must be >= 0")
    cfg = LaunchConfig(cmd=_command(ns), prefix=ns.prefix, grace=ns.grace)
    cfg.nproc_per_node = ns.nproc_per_node or 1
    cfg.nnodes = ns.nnodes or 1
    cfg.node_rank = ns.node_rank if ns.node_rank is not None else 0
    cfg.master_addr = ns.master_addr or "127.0.0.1"
    cfg.master_port = ns.master_port
    if ns.standalone:
        if cfg.nnodes != 1 or cfg.node_rank != 0:
            raise LaunchError("--standalone means one node: drop --nnodes/--node-rank")
        cfg.master_port = 0 if cfg.master_port is None else cfg.master_port
    _check_config(cfg)
    return ns, cfg


def _check_config(cfg: LaunchConfig) -> None:
    if not 0 <= cfg.node_rank < cfg.nnodes:
        raise LaunchError(f"--node-rank {cfg.node_rank} is outside 0..{cfg.nnodes - 1}")
    if cfg.nnodes > 1 and cfg.master_port == 0:
        raise LaunchError(
            "--master-port 0 (pick a free port) only works with --nnodes 1: "
            "every node must be given the same port"
        )


# --------------------------------------------------------------------------- environment


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port that was free on ``host`` a moment ago.

    Binds a socket to port 0, reads the port the kernel chose and closes the socket. Another
    program may take the port before rank 0 binds it; on one host that is rare enough.
    """
    infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, stype, proto, _, addr = infos[0]
    with socket.socket(family, stype, proto) as s:
        s.bind(addr)
        return int(s.getsockname()[1])


def rank_env(
    cfg: LaunchConfig,
    local_rank: int,
    master_port: int,
    auth_key: Optional[str],
    base: Mapping[str, str],
) -> dict[str, str]:
    """The environment of one spawned rank: ``base`` plus the rendezvous variables."""
    env = dict(base)
    world = cfg.nnodes * cfg.nproc_per_node
    rank = cfg.node_rank * cfg.nproc_per_node + local_rank
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
            "GROUP_RANK": str(cfg.node_rank),
            "NODE_RANK": str(cfg.node_rank),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": cfg.master_addr,
            "MASTER_PORT": str(master_port),
        }
    )
    if auth_key is not None:
        env["XCCL_AUTH_KEY"] = auth_key
    else:
        env.pop("XCCL_AUTH_KEY", None)
    if cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in base:
        # N ranks with N OpenMP pools each would oversubscribe the cores (torchrun does this too).
        env["OMP_NUM_THREADS"] = "1"
    return env


def job_auth_key(cfg: LaunchConfig, environ: Mapping[str, str]) -> Optional[str]:
    """The job secret: fresh for a one-node job; for several nodes the one every node was
    given in ``XCCL_AUTH_KEY`` (None, with a note on stderr, if there is none)."""
    if cfg.nnodes == 1:
        return secrets.token_hex(32)
    key = environ.get("XCCL_AUTH_KEY")
    if not key and cfg.node_rank == 0:
        _note(
            "note: XCCL_AUTH_KEY is not set, so the job runs without a secret: anyone who can "
            f"reach {cfg.master_addr} and the ranks' ports can join it (see README, Security)"
        )
    return key or None


def first_slurm_host(nodelist: str) -> str:
    """The first host name of a Slurm node list such as ``node[007-010,12],gpu1``."""
    item = ""
    depth = 0
    for ch in nodelist.strip():
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        item += ch
    m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
    if not m:
        return item
    first = re.split(r"[,-]", m.group(2), maxsplit=1)[0]
    return m.group(1) + first + m.group(3)


def slurm_tasks_on_node(tasks_per_node: str, node: int) -> Optional[int]:
    """The task count of node ``node`` (0-based) in a Slurm tasks-per-node list such as
    ``3,1`` or ``2(x3),1`` (None if the list is malformed or has no such node)."""
    seen = 0
    for item in tasks_per_node.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            return None
        repeat = int(m.group(2) or "1")
        if node < seen + repeat:
            return int(m.group(1))
        seen += repeat
    return None


def _slurm_port(environ: Mapping[str, str]) -> int:
    job = environ.get("SLURM_JOB_ID", "")
    # A port derived from the job id: the same on every task, different for jobs sharing a node.
    return 20000 + int(job) % 10000 if job.isdigit() else DEFAULT_PORT


def _slurm_nnodes(environ: Mapping[str, str]) -> int:
    return int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES") or "1")


def _in_slurm_step(environ: Mapping[str, str]) -> bool:
    return "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ


def apply_slurm_node_defaults(
    ns: argparse.Namespace, cfg: LaunchConfig, environ: Mapping[str, str]
) -> None:
    """``srun --ntasks-per-node=1 xccl-run --nproc-per-node N ...``: one xccl-run per node of
    the step, each spawning N ranks. Fills --nnodes, --node-rank, --master-addr and
    --master-port from the step where they were not given."""
    if not _in_slurm_step(environ):
        return
    nnodes = _slurm_nnodes(environ)
    ntasks = int(environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "1")
    if nnodes <= 1 and ntasks <= 1:
        return
    if ntasks != nnodes:
        raise LaunchError(
            f"the Slurm step has {ntasks} tasks on {nnodes} nodes: either run one "
            "xccl-run per node (srun --ntasks-per-node=1) or drop --nproc-per-node "
            "and let srun start the ranks"
        )
    if ns.nnodes is None:
        cfg.nnodes = nnodes
    if ns.node_rank is None:
        cfg.node_rank = int(environ.get("SLURM_NODEID", "0"))
    if ns.master_addr is None:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
        cfg.master_addr = environ.get("MASTER_ADDR") or (
            first_slurm_host(nodelist) if nodelist else cfg.master_addr
        )
    if ns.master_port is None and cfg.nnodes > 1:
        cfg.master_port = int(environ.get("MASTER_PORT") or _slurm_port(environ))
    _check_config(cfg)


def external_env(
    environ: Mapping[str, str], master_addr: Optional[str] = None, master_port: Optional[int] = None
) -> Optional[dict[str, str]]:
    """The rendezvous variables for a process started by srun or mpirun, or None when the
    environment shows no such launcher (or a single task, which xccl-run spawns from instead).

    MASTER_ADDR: ``master_addr``, else the existing variable, else the first host of the Slurm
    step (127.0.0.1 for an Open MPI job on one host). MASTER_PORT: ``master_port``, else the
    existing variable, else a port derived from the Slurm job id (29500 for Open MPI).
    """
    if _in_slurm_step(environ):
        ntasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS", "1")
        world = int(ntasks)
        if world <= 1:
            return None
        rank = int(environ["SLURM_PROCID"])
        local_rank = int(environ.get("SLURM_LOCALID", "0"))
        node_rank = int(environ.get("SLURM_NODEID", "0"))
        nnodes = _slurm_nnodes(environ)
        tpn = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "")
        local_world = slurm_tasks_on_node(tpn, node_rank)
        if local_world is None:
            local_world = world // nnodes if world % nnodes == 0 else 0
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
        addr = environ.get("MASTER_ADDR") or (first_slurm_host(nodelist) if nodelist else "")
        port = environ.get("MASTER_PORT") or str(_slurm_port(environ))
    elif "OMPI_COMM_WORLD_RANK" in environ and "OMPI_COMM_WORLD_SIZE" in environ:
        world = int(environ["OMPI_COMM_WORLD_SIZE"])
        if world <= 1:
            return None
        rank = int(environ["OMPI_COMM_WORLD_RANK"])
        local_rank = int(environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
        local_world = int(environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "0"))
        node_rank = rank // local_world if local_world else 0
        addr = environ.get("MASTER_ADDR") or ("127.0.0.1" if local_world == world else "")
        port = environ.get("MASTER_PORT") or str(DEFAULT_PORT)
    else:
        return None
    if master_addr:
        addr = master_addr
    if master_port is not None:
        if master_port == 0:
            raise LaunchError(
                "--master-port 0 cannot work under srun/mpirun: every task must "
                "be given the same port"
            )
        port = str(master_port)
    if not addr:
        raise LaunchError(
            "started by srun/mpirun across hosts, but the address of rank 0's host "
            "is unknown: pass --master-addr or set MASTER_ADDR"
        )
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "GROUP_RANK": str(node_rank),
        "NODE_RANK": str(node_rank),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": addr,
        "MASTER_PORT": port,
    }
    if local_world:
        env["LOCAL_WORLD_SIZE"] = str(local_world)
    return env


def _exec_external(cmd: list[str], ext: dict[str, str]) -> NoReturn:
    env = dict(os.environ)
    env.update(ext)
    if not env.get("XCCL_AUTH_KEY") and env["RANK"] == "0":
        _note(
            "note: XCCL_AUTH_KEY is not set, so the job runs without a secret: anyone who can "
            f"reach {env['MASTER_ADDR']} and the ranks' ports can join it (see README, "
            "Security)"
        )
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as e:
        raise LaunchError(f"cannot run {cmd[0]!r}: {e.strerror}") from None


# --------------------------------------------------------------------------- spawning


def _death_signal_hook() -> Optional[Callable[[], None]]:
    """A preexec function asking Linux to SIGKILL the rank if xccl-run dies (even by SIGKILL),
    so no rank outlives its launcher. None where prctl is unavailable."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

    return hook


def _pump(src: IO[bytes], dst: IO[bytes], prefix: bytes, lock: threading.Lock) -> None:
    """Copies ``src`` to ``dst`` line by line with ``prefix`` in front (reader thread)."""
    with src:
        for line in iter(src.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            with lock:
                try:
                    dst.write(prefix + line)
                    dst.flush()
                except (OSError, ValueError):
                    pass  # our own output went away: keep draining so the rank never blocks


def _describe(code: int, signalled: Optional[int]) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if -code == signal.SIGINT:
            return "interrupted (SIGINT)"
        if signalled == -code:
            return f"terminated by {PROG} ({name})"
        return f"killed by {name}"
    if signalled is not None:
        return f"exited with code {code} after {PROG} sent {signal.Signals(signalled).name}"
    return f"exited with code {code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


class _Job:
    """The ranks of one node, their output pumps, and the stop sequence."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.ranks: list[_Rank] = []
        self.lock = threading.Lock()
        self.interrupts = 0
        self.stop_signal: Optional[int] = None  # a signal xccl-run itself received

    def start(self) -> None:
        cfg = self.cfg
        port = cfg.master_port
        if port is None:
            port = 0 if cfg.nnodes == 1 else DEFAULT_PORT
        if port == 0:
            port = free_port(cfg.master_addr)
        key = job_auth_key(cfg, os.environ)
        hook = _death_signal_hook()
        pipe = subprocess.PIPE if cfg.prefix else None
        for local in range(cfg.nproc_per_node):
            env = rank_env(cfg, local, port, key, os.environ)
            try:
                # preexec_fn is safe here: no thread of ours runs before every rank started.
                proc = subprocess.Popen(cfg.cmd, env=env, stdout=pipe, stderr=pipe, preexec_fn=hook)
            except OSError as e:
                self.stop(signal.SIGTERM)
                raise LaunchError(f"cannot run {cfg.cmd[0]!r}: {e.strerror}") from None
            self.ranks.append(_Rank(int(env["RANK"]), local, proc))
        if cfg.prefix:
            for r in self.ranks:
                tag = f"[rank {r.rank}] ".encode()
                for src, dst in (
                    (r.proc.stdout, sys.stdout.buffer),
                    (r.proc.stderr, sys.stderr.buffer),
                ):
                    t = threading.Thread(
                        target=_pump,
                        args=(src, dst, tag, self.lock),
                        daemon=True,
                        name=f"{PROG}-rank{r.rank}",
                    )
                    t.start()
                    r.readers.append(t)

    def _alive(self) -> list[_Rank]:
        return [r for r in self.ranks if r.proc.poll() is None]

    def _signal(self, ranks: list[_Rank], sig: int) -> None:
        for r in ranks:
            try:
                r.proc.send_signal(sig)
                r.signalled = sig
            except ProcessLookupError:
                pass

    def stop(self, first: int) -> None:
        """Sends ``first`` to the live ranks, then SIGTERM and SIGKILL, each after the grace
        period, until all have exited. Blocks at most about three grace periods."""
        ladder = [first] + [s for s in (signal.SIGTERM, signal.SIGKILL) if s != first]
        for sig in ladder:
            alive = self._alive()
            if not alive:
                return
            self._signal(alive, sig)
            deadline = time.monotonic() + (self.cfg.grace if sig != signal.SIGKILL else 30.0)
            while self._alive() and time.monotonic() < deadline:
                if self.interrupts > 1 and sig != signal.SIGKILL:
                    break  # a second Ctrl-C: do not wait politely any longer
                time.sleep(_POLL_S)

    def on_signal(self, signum: int, _frame: object) -> None:
        """Launcher signal handler: remembers the signal; the main loop forwards it."""
        if signum == signal.SIGINT:
            self.interrupts += 1
        if self.stop_signal is None:
            self.stop_signal = signum

    def wait(self) -> int:
        """Waits for every rank; returns the launcher's exit code."""
        first: Optional[_Rank] = None
        while True:
            if self.stop_signal is not None:
                return self._stop_on_signal(self.stop_signal)
            alive = 0
            for r in self.ranks:
                code = r.proc.poll()
                if code is None:
                    alive += 1
                elif code != 0 and first is None:
                    first = r
            if first is not None:
                break
            if alive == 0:
                self._join_readers()
                return 0
            time.sleep(_POLL_S)
        code = first.proc.returncode
        _note(
            f"rank {first.rank} (pid {first.proc.pid}) {_describe(code, None)}; "
            f"stopping the other ranks"
        )
        self.stop(signal.SIGTERM)
        self._join_readers()
        self._report("job failed", first)
        return _exit_code(code)

    def _stop_on_signal(self, signum: int) -> int:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and _tty_delivers_sigint():
            # Ctrl-C at the terminal reached every rank already (same process group).
            _note(f"{name}: waiting for the ranks to stop")
            if self._wait_grace():
                self.stop(signal.SIGTERM)
        else:
            _note(f"received {name}: passing it on to the ranks")
            self.stop(signum)
        self._join_readers()
        self._report(f"job stopped by {name}", None)
        return 128 + signum

    def _wait_grace(self) -> bool:
        """Waits up to the grace period for the ranks to exit; True if some are still alive."""
        deadline = time.monotonic() + self.cfg.grace
        while self._alive() and time.monotonic() < deadline and self.interrupts < 2:
            time.sleep(_POLL_S)
        return bool(self._alive())

    def _join_readers(self) -> None:
        for r in self.ranks:
            for t in r.readers:
                t.join(timeout=5.0)

    def _report(self, headline: str, first: Optional[_Rank]) -> None:
        lines = []
        for r in self.ranks:
            code = r.proc.returncode
            what = "still running" if code is None else _describe(code, r.signalled)
            mark = "   <- first failure" if r is first else ""
            lines.append(f"  rank {r.rank} (pid {r.proc.pid}): {what}{mark}")
        _note(f"{headline}; rank exit statuses:\n" + "\n".join(lines))


def _tty_delivers_sigint() -> bool:
    """True when we are the foreground process group of a terminal, so Ctrl-C was already
    delivered to the ranks, who share our process group."""
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return True
        except OSError:
            continue
    return False


def launch(cfg: LaunchConfig) -> int:
    """Starts ``cfg.nproc_per_node`` ranks of ``cfg.cmd`` and waits for them.

    Returns 0 if all exit with 0, else the first failure's exit code (``128 + signal`` for a
    rank killed by a signal, or for a signal xccl-run received). Called from the main thread,
    it handles SIGINT, SIGTERM and SIGHUP while it runs (passing them on to the ranks).
    """
    job = _Job(cfg)
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {}
    if threading.current_thread() is threading.main_thread():
        old = {s: signal.signal(s, job.on_signal) for s in handled}
    try:
        job.start()
        return job.wait()
    finally:
        if job._alive():  # an exception escaped: leave nothing behind
            job.stop(signal.SIGKILL)
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """Entry point of ``xccl-run`` and ``python -m xccl.run``."""
    try:
        ns, cfg = parse_args(argv)
        if ns.nproc_per_node is None:
            ext = external_env(os.environ, ns.master_addr, ns.master_port)
            if ext is not None:
                _exec_external(cfg.cmd, ext)
        else:
            apply_slurm_node_defaults(ns, cfg, os.environ)
        sys.exit(launch(cfg))
    except LaunchError as e:
        _note(f"error: {e}")
        sys.exit(2)


if __name__ == "__main__":
    main()
