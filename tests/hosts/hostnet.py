"""Test hosts on one machine: the engine behind ``tests/hosts/run.sh`` (see its usage).

Each "host" is a network namespace (its own loopback, a veth link ``veth0`` to a bridge that
lives in a namespace of its own, an address 10.99.0.<i+1>/24, optional ``tc`` token-bucket
shaping of its egress) plus, for the processes started in it, their own IPC, UTS (host name
``host<i>``), mount (a private tmpfs on /dev/shm) and PID namespaces. The root network
namespace is never touched. Names carry a random run id, so two runs can coexist.

In every host one process runs, as PID 1 of the host's PID namespace:

* equal hosts (``--ranks-per-host R``): ``python -m xccl.run --nnodes H --nproc-per-node R
  --node-rank i --master-addr 10.99.0.1 --master-port P SCRIPT ARGS``;
* unequal hosts (``--ranks-per-host 3,1``): xccl-run cannot spawn different counts per node,
  so the host's ranks are started the way ``srun`` starts them (one ``python -m xccl.run
  SCRIPT`` per rank with ``SLURM_PROCID`` ... ``SLURM_STEP_TASKS_PER_NODE=3,1``), which
  xccl-run turns into ``RANK`` etc. before it execs the script.

All ranks get one random ``XCCL_AUTH_KEY`` (``--mismatched-keys``: one per host, to test the
refusal), ``XH_HOST``/``XH_HOSTS``/``XH_RANKS_PER_HOST`` and ``XH_CTL`` (a directory shared by
all hosts: a script creates ``$XH_CTL/arm`` to start the clock of ``--link-down`` and
``--kill-host``). PYTHONPATH
and the rest of the environment pass through.

The exit status is the job's: 0 when every host's launcher exited 0, else the first failing
host's status; 124 when ``--timeout`` expired. Whatever happens (success, failure, Ctrl-C,
SIGTERM, SIGHUP, timeout, an exception here), every process in the hosts is killed and every
namespace (and with it every veth, the bridge and the qdiscs) is deleted before exit.
Only SIGKILL of this process itself leaves something behind: its processes still die (the
parent-death signal), but the namespaces stay until ``run.sh --cleanup`` removes those of
runs whose harness is gone (runs in progress are left alone).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Optional

from xccl.run import _pump  # the launcher's own line copier: prefix, flush, never block

PROG = "run.sh"
PREFIX = "xh"  # namespace names: xh<run id>b (bridge), xh<run id>h<i> (host i)
SUBNET = "10.99.0"
DECOY_SUBNET = "10.98"
PORT = 29500
IFNAME = "veth0"


def note(msg: str) -> None:
    """One line of the harness's own output on stderr."""
    sys.stderr.write(f"{PROG}: {msg}\n")
    sys.stderr.flush()


class HarnessError(Exception):
    """A usage or set-up problem (exit status 2)."""


# --------------------------------------------------------------------------- arguments


def _ranks(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected R or R0,R1,..., got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"rank counts must be >= 1, got {text!r}")
    return out


_RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", re.IGNORECASE)
_RATE_SCALE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(text: str) -> float:
    """Bits per second of a tc rate such as ``200mbit`` or ``1gbit``."""
    m = _RATE.fullmatch(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"rate must look like 200mbit or 1gbit, got {text!r}")
    bits = float(m.group(1)) * _RATE_SCALE[m.group(2).lower()]
    if bits < 1e5:
        raise argparse.ArgumentTypeError(f"rate {text!r} is below 100kbit")
    return bits


def _link_down(text: str) -> tuple[int, float]:
    host, sep, secs = text.partition(":")
    try:
        if not sep:
            raise ValueError
        h, s = int(host), float(secs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOST:SECONDS, got {text!r}") from None
    if h < 0 or s < 0:
        raise argparse.ArgumentTypeError(f"expected HOST >= 0 and SECONDS >= 0, got {text!r}")
    return h, s


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``tests/hosts/run.sh``."""
    p = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,
        description="Run SCRIPT as one xccl job over H network-namespace hosts on this machine.",
    )
    p.add_argument("--hosts", type=int, required=True, metavar="H", help="number of hosts (>= 1)")
    p.add_argument(
        "--ranks-per-host",
        type=_ranks,
        default=[1],
        metavar="R",
        help="ranks in every host (R), or per host (R0,R1,...: one count per host)",
    )
    p.add_argument(
        "--rate", default=None, metavar="RATE", help="tc tbf rate of every host's link (1gbit)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="stop the whole job after S seconds (exit 124); default 300",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=5.0,
        metavar="S",
        help="after a host fails, seconds the other hosts get to finish before they are "
        "stopped (default 5); also xccl-run's --grace",
    )
    p.add_argument(
        "--link-down",
        type=_link_down,
        default=None,
        metavar="HOST:SECONDS",
        help="take HOST's link down SECONDS after the job creates $XH_CTL/arm",
    )
    p.add_argument(
        "--kill-host",
        type=_link_down,
        default=None,
        metavar="HOST:SECONDS",
        help="SIGKILL every process of HOST SECONDS after the job creates $XH_CTL/arm "
        "(a host that crashes)",
    )
    p.add_argument(
        "--mismatched-keys",
        action="store_true",
        help="give every host a different XCCL_AUTH_KEY (the job must fail at init)",
    )
    p.add_argument(
        "--decoy",
        action="store_true",
        help="give every host a second, isolated interface (decoy0, 10.98.<i>.1) listed before "
        "veth0, so only XCCL_SOCKET_IFNAME=veth makes the job work",
    )
    p.add_argument("--port", type=int, default=PORT, help=f"store port on host 0 (default {PORT})")
    p.usage = f"{PROG} --hosts H [OPTIONS] -- SCRIPT [ARGS...]"
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parses and checks the command line (argparse errors exit with status 2)."""
    p = build_parser()
    argv = list(argv)
    if "--" not in argv and ("-h" in argv or "--help" in argv):
        p.parse_args(["--help"])
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        p.error("expected '-- SCRIPT [ARGS...]' after the options")
    cut = argv.index("--")
    ns = p.parse_args(argv[:cut])
    ns.script, ns.args = argv[cut + 1], argv[cut + 2 :]
    if ns.hosts < 1:
        p.error("--hosts must be >= 1")
    if len(ns.ranks_per_host) == 1:
        ns.ranks_per_host = ns.ranks_per_host * ns.hosts
    elif len(ns.ranks_per_host) != ns.hosts:
        p.error(f"--ranks-per-host lists {len(ns.ranks_per_host)} counts for {ns.hosts} hosts")
    if ns.rate is not None:
        try:
            ns.rate_bits = rate_bits(ns.rate)
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
    for opt, val in (("--link-down", ns.link_down), ("--kill-host", ns.kill_host)):
        if val is not None and val[0] >= ns.hosts:
            p.error(f"{opt} host {val[0]} is not one of 0..{ns.hosts - 1}")
    if ns.timeout <= 0 or ns.grace < 0:
        p.error("--timeout must be > 0 and --grace >= 0")
    if ns.hosts > 200:
        p.error("--hosts must be <= 200")
    return ns


# --------------------------------------------------------------------------- namespaces


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise HarnessError(f"'ip {' '.join(args)}' failed: {r.stderr.strip()}")


def _tc(*args: str) -> None:
    r = subprocess.run(["tc", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise HarnessError(f"'tc {' '.join(args)}' failed: {r.stderr.strip()}")


def ns_pids(ns: str) -> list[int]:
    """Processes whose network namespace is ``ns``."""
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(x) for x in r.stdout.split()] if r.returncode == 0 else []


class Hosts:
    """The namespaces of one run: created by :meth:`create`, removed by :meth:`destroy`."""

    def __init__(self, nhosts: int, rate_bits: Optional[float], decoy: bool) -> None:
        self.run_id = secrets.token_hex(3)
        self.bridge_ns = f"{PREFIX}{self.run_id}b"
        self.host_ns = [f"{PREFIX}{self.run_id}h{i}" for i in range(nhosts)]
        self.rate_bits = rate_bits
        self.decoy = decoy
        self.created: list[str] = []

    @staticmethod
    def addr(i: int) -> str:
        """Address of host ``i`` on the shared link."""
        return f"{SUBNET}.{i + 1}"

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def create(self) -> None:
        """Bridge namespace with bridge br0; per host a namespace with veth0 on the bridge."""
        self._add_ns(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, ns in enumerate(self.host_ns):
            self._add_ns(ns)
            if self.decoy:
                # an up, running interface with an address nobody can reach, listed first
                _ip("-n", ns, "link", "add", "decoy0", "type", "veth", "peer", "name", "decoy1")
                _ip("-n", ns, "addr", "add", f"{DECOY_SUBNET}.{i}.1/24", "dev", "decoy0")
                _ip("-n", ns, "link", "set", "decoy1", "up")
                _ip("-n", ns, "link", "set", "decoy0", "up")
            port = f"h{i}"
            _ip("-n", self.bridge_ns, "link", "add", port, "type", "veth",
                "peer", "name", IFNAME, "netns", ns)
            _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
            _ip("-n", self.bridge_ns, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            if self.rate_bits is not None:
                rate_bytes = self.rate_bits / 8
                # a burst of at least 10 ms of traffic and of a few 64 KiB GSO segments
                burst = max(256 * 1024, int(rate_bytes / 100))
                _tc("-n", ns, "qdisc", "add", "dev", IFNAME, "root", "tbf",
                    "rate", f"{int(self.rate_bits)}bit", "burst", str(burst), "latency", "100ms")

    def link_down(self, i: int) -> None:
        """Cuts host ``i``'s cable: its bridge port goes down (no RST, packets are dropped)."""
        _ip("-n", self.bridge_ns, "link", "set", f"h{i}", "down")

    def kill_host(self, i: int) -> None:
        """SIGKILLs every process of host ``i`` (its sockets close: peers see the crash)."""
        for p in ns_pids(self.host_ns[i]):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill_all(self) -> None:
        """SIGKILLs every process left in the hosts' network namespaces until none is left."""
        for _ in range(50):
            pids = [p for ns in self.created for p in ns_pids(ns)]
            if not pids:
                return
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        note("warning: processes survived SIGKILL in the hosts' namespaces")

    def destroy(self) -> list[str]:
        """Kills what is left and deletes every namespace (their links go with them).
        Returns the namespaces that could not be deleted."""
        self.kill_all()
        failed = []
        for ns in reversed(self.created):
            r = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
            if r.returncode != 0:
                failed.append(f"{ns}: {r.stderr.strip()}")
        self.created = []
        return failed


REGISTRY = "/run/xccl-hosts"  # <run id>: the pid of the harness that owns those namespaces


def _owner_alive(run_id: str) -> bool:
    try:
        pid = int(open(os.path.join(REGISTRY, run_id)).read())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"hostnet.py" in f.read()
    except (OSError, ValueError):
        return False


def stale_cleanup() -> int:
    """Deletes the namespaces (and kills the processes) of runs whose harness is gone (it was
    SIGKILLed); runs in progress are left alone. Returns how many namespaces it deleted."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    n = 0
    dead: set[str] = set()
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}([0-9a-f]{{6}})(b|h\d+)", name)
        if not m or _owner_alive(m.group(1)):
            continue
        dead.add(m.group(1))
        for p in ns_pids(name):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", name], check=False)
        n += 1
    if os.path.isdir(REGISTRY):
        for run_id in os.listdir(REGISTRY):
            if not _owner_alive(run_id):
                dead.add(run_id)
                try:
                    os.unlink(os.path.join(REGISTRY, run_id))
                except OSError:
                    pass
    for run_id in dead:  # their control directories
        for d in glob.glob(os.path.join(tempfile.gettempdir(), f"{PREFIX}{run_id}-*")):
            shutil.rmtree(d, ignore_errors=True)
    return n


# --------------------------------------------------------------------------- inside a host

# Runs as the command of `unshare --pid --fork`: the shell is PID 1 of the host's PID namespace
# until it execs the launcher, which then is. The host name and a private /dev/shm first.
# /etc/hosts of the run (every host's name and address) is bind-mounted over the machine's.
_HOST_SHELL = (
    'hostname "$1" && mount -t tmpfs -o mode=1777 xhshm /dev/shm && '
    'mount --bind "$XH_CTL/hosts" /etc/hosts && shift && exec "$@"'
)


def agent(argv: Sequence[str]) -> int:
    """``hostnet.py agent OFFSET COUNT PER_HOST_LIST NODE SCRIPT ARGS``: PID 1 of an unequal
    host. Starts COUNT ranks as srun would (xccl-run maps the Slurm variables), waits, stops
    the others when one fails, and exits with the first failure's status."""
    offset, count, per_host, node = int(argv[0]), int(argv[1]), argv[2], int(argv[3])
    cmd = [sys.executable, "-u", "-m", "xccl.run", *argv[4:]]
    counts = [int(x) for x in per_host.split(",")]
    world = sum(counts)
    grace = float(os.environ.get("XH_GRACE", "5"))
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    stop: list[int] = []
    lock = threading.Lock()

    def done(status: int) -> int:
        # the ranks' last lines are still in the pipes when they exit: copy them out before
        # this process (PID 1 of the host) exits and takes the pump threads with it
        for t in pumps:
            t.join(timeout=5)
        return status

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda signum, _f: stop.append(signum))
    for local in range(count):
        env = dict(os.environ)
        env.update(
            {
                "SLURM_JOB_ID": "1",
                "SLURM_STEP_ID": "0",
                "SLURM_PROCID": str(offset + local),
                "SLURM_LOCALID": str(local),
                "SLURM_NODEID": str(node),
                "SLURM_NTASKS": str(world),
                "SLURM_STEP_NUM_TASKS": str(world),
                "SLURM_NNODES": str(len(counts)),
                "SLURM_STEP_NUM_NODES": str(len(counts)),
                "SLURM_STEP_TASKS_PER_NODE": per_host,
                "SLURM_TASKS_PER_NODE": per_host,
            }
        )
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(proc)
        tag = f"[rank {offset + local}] ".encode()
        for src, dst in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            pumps.append(threading.Thread(target=_pump, args=(src, dst, tag, lock), daemon=True))
            pumps[-1].start()
    first: Optional[int] = None
    while first is None and not stop:
        codes = [p.poll() for p in procs]
        bad = [c for c in codes if c not in (None, 0)]
        if bad:
            first = bad[0]
        elif all(c == 0 for c in codes):
            return done(0)
        else:
            # (no waitpid(-1) for orphans here: it could reap a rank before Popen reads its
            # status; orphans' zombies go with the PID namespace)
            time.sleep(0.02)
    for sig, wait in ((stop[0] if stop else signal.SIGTERM, grace), (signal.SIGKILL, 30.0)):
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)
        deadline = time.monotonic() + wait
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.02)
    if first is None:
        return done(128 + stop[0])
    return done(128 - first if first < 0 else first)


# --------------------------------------------------------------------------- the job


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the harness dies, even by SIGKILL. It is inherited
    through ``ip netns exec`` into ``unshare``, whose --kill-child then takes the host's PID 1
    and with it the whole PID namespace: no rank outlives a killed harness (only the empty
    namespaces do, until ``run.sh --cleanup``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


class Job:
    """The launcher processes of one run, one per host, and their stop sequence."""

    def __init__(self, ns: argparse.Namespace, hosts: Hosts, signals: list[int]) -> None:
        self.ns = ns
        self.hosts = hosts
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []
        self.signals = signals  # filled by the harness's signal handler
        self.ctl = tempfile.mkdtemp(prefix=f"{PREFIX}{hosts.run_id}-")
        self.lock = threading.Lock()

    def host_cmd(self, i: int) -> list[str]:
        """The command that runs as host ``i``'s launcher."""
        ns = self.ns
        counts = ns.ranks_per_host
        py = sys.executable
        if len(set(counts)) == 1:
            launcher = [py, "-u", "-m", "xccl.run", "--nnodes", str(ns.hosts),
                        "--nproc-per-node", str(counts[0]), "--node-rank", str(i),
                        "--master-addr", Hosts.addr(0), "--master-port", str(ns.port),
                        "--grace", str(ns.grace), "-p", ns.script, *ns.args]
        else:
            launcher = [py, "-u", os.path.abspath(__file__), "agent", str(sum(counts[:i])),
                        str(counts[i]), ",".join(map(str, counts)), str(i), ns.script, *ns.args]
        return ["ip", "netns", "exec", self.hosts.host_ns[i],
                "unshare", "--ipc", "--uts", "--mount", "--pid", "--fork", "--kill-child",
                "--mount-proc", "sh", "-c", _HOST_SHELL, "sh", f"host{i}", *launcher]

    def start(self) -> None:
        """Starts every host's launcher (each in a session of its own)."""
        ns = self.ns
        shared_key = secrets.token_hex(32)
        with open(os.path.join(self.ctl, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n::1 localhost\n")
            f.writelines(f"{Hosts.addr(i)} host{i}\n" for i in range(ns.hosts))
        os.chmod(self.ctl, 0o755)
        note(f"run {self.hosts.run_id}: {ns.hosts} host(s), ranks {ns.ranks_per_host}, "
             f"XH_CTL={self.ctl}")
        for i in range(ns.hosts):
            env = dict(os.environ)
            env["XCCL_AUTH_KEY"] = secrets.token_hex(32) if ns.mismatched_keys else shared_key
            env.update(
                {
                    "XH_HOST": str(i),
                    "XH_HOSTS": str(ns.hosts),
                    "XH_RANKS_PER_HOST": ",".join(map(str, ns.ranks_per_host)),
                    "XH_CTL": self.ctl,
                    "XH_GRACE": str(ns.grace),
                    "MASTER_ADDR": Hosts.addr(0),
                    "MASTER_PORT": str(ns.port),
                }
            )
            p = subprocess.Popen(self.host_cmd(i), env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True,
                                 preexec_fn=_die_with_parent)
            self.procs.append(p)
            for src, dst in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
                t = threading.Thread(target=_pump, args=(src, dst, f"[host{i}] ".encode(),
                                                         self.lock), daemon=True)
                t.start()
                self.readers.append(t)

    def _signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def stop(self, first: int) -> None:
        """``first`` to every live host's processes, then SIGKILL after the grace period."""
        self._signal_all(first)
        deadline = time.monotonic() + self.ns.grace + 2 * (first != signal.SIGKILL)
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._signal_all(signal.SIGKILL)

    def wait(self) -> int:
        """Runs the job to its end; returns the exit status."""
        ns = self.ns
        start = time.monotonic()
        deadline = start + ns.timeout
        armed_at: Optional[float] = None
        # (what, host, seconds after arm) still to do
        events = [(what, *val) for what, val in (("link-down", ns.link_down),
                                                 ("kill-host", ns.kill_host)) if val]
        failed_at: Optional[float] = None
        first: Optional[int] = None
        while True:
            now = time.monotonic()
            if self.signals:
                name = signal.Signals(self.signals[0]).name
                note(f"received {name}: stopping the hosts")
                self.stop(signal.SIGTERM)
                return 128 + self.signals[0]
            codes = [p.poll() for p in self.procs]
            for i, c in enumerate(codes):
                if c not in (None, 0) and first is None:
                    first = c
                    failed_at = now
                    what = f"status {c}" if c > 0 else f"killed by {signal.Signals(-c).name}"
                    note(f"host{i} failed ({what}); the other hosts get {ns.grace:g} s")
            if all(c is not None for c in codes):
                return 0 if first is None else (128 - first if first < 0 else first)
            if failed_at is not None and now - failed_at > ns.grace:
                note("stopping the hosts still running after the grace period")
                self.stop(signal.SIGTERM)
                return 128 - first if first < 0 else first  # type: ignore[operator]
            if now > deadline:
                alive = [f"host{i}" for i, c in enumerate(codes) if c is None]
                note(f"timeout after {ns.timeout:g} s: stopping {', '.join(alive)}")
                self.stop(signal.SIGTERM)
                return 124
            if events and armed_at is None and os.path.exists(os.path.join(self.ctl, "arm")):
                armed_at = now
            for ev in list(events) if armed_at is not None else []:
                what, host, secs = ev
                if now - armed_at >= secs:  # type: ignore[operator]
                    events.remove(ev)
                    if what == "link-down":
                        self.hosts.link_down(host)
                        note(f"host{host}'s link is down")
                    else:
                        self.hosts.kill_host(host)
                        note(f"host{host}'s processes were killed (SIGKILL)")
            time.sleep(0.05)

    def close(self) -> None:
        """Kills every host process and joins the output pumps."""
        self._signal_all(signal.SIGKILL)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for t in self.readers:
            t.join(timeout=5)
        shutil.rmtree(self.ctl, ignore_errors=True)


def main(argv: Sequence[str]) -> int:
    """Entry point: ``hostnet.py [OPTIONS] SCRIPT ARGS``, ``hostnet.py agent ...`` or
    ``hostnet.py --cleanup``."""
    if argv[:1] == ["agent"]:
        return agent(argv[1:])
    if argv[:1] == ["--cleanup"]:
        note(f"deleted {stale_cleanup()} stale namespace(s)")
        return 0
    ns = parse(argv)
    if os.geteuid() != 0:
        note("error: needs root (network namespaces)")
        return 2
    hosts = Hosts(ns.hosts, getattr(ns, "rate_bits", None), ns.decoy)
    job: Optional[Job] = None
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    status = 2
    os.makedirs(REGISTRY, exist_ok=True)
    mark = os.path.join(REGISTRY, hosts.run_id)
    with open(mark, "w") as f:
        f.write(str(os.getpid()))
    try:
        hosts.create()
        if received:
            return 128 + received[0]
        job = Job(ns, hosts, received)
        job.start()
        status = job.wait()
    except HarnessError as e:
        note(f"error: {e}")
        status = 2
    finally:
        # every exit path: the processes, then the namespaces (and their links) go
        if job is not None:
            job.close()
        left = hosts.destroy()
        for s, h in old.items():
            signal.signal(s, h)
        if not left:
            os.unlink(mark)
        if left:
            note("error: could not delete " + "; ".join(left))
            status = status or 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
