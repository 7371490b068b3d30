#!/usr/bin/env python3
"""Seeded fault injection: random jobs, random collectives, one rank killed or stopped.

    PYTHONPATH=python python tests/faults/driver.py --seed 1 --rounds 20
    PYTHONPATH=python python tests/faults/driver.py --seed 7 --budget 600   # rounds that fit
    PYTHONPATH=python python tests/faults/driver.py --seed 7 --first-round 12 --rounds 1

The ranks import the xccl their environment finds (an installed one, or python/ of a built
tree on PYTHONPATH, as above).

Each round starts a job of 3-6 ranks (tests/faults/worker.py, one process each, in its own
session) spread over one to three "hosts" (``XCCL_HOST_ID``), so that ranks of one host talk
through shared memory and the others over TCP; the ranks meet through a file store or a TCP
store (rank 0 serving it) in a private directory. Every rank runs the same seeded random
stream of collectives and point-to-point operations (tests/workload.py: every collective,
every reduction op, several dtypes and sizes, on random overlapping subgroups) and checks
each result against numpy. At a random moment after all ranks are up (or, in one round in
ten, while they are still starting) the driver SIGKILLs or SIGSTOPs one random rank. About
one round in seven is a control round without a fault: every rank runs a fixed number of
operations and must finish them all (a fault can mask a hang of the library's own: the first
bug this driver found, an algorithm choice that differed between ranks, hung with no fault).

A round passes when:
  * every other rank raised an xccl error (XcclError or a subclass) within ``2 x timeout +
    20`` seconds of the fault, whose first line names a rank (after start-up), and at least
    one of them names the dead or stopped rank (its rank in the failed operation's
    communicator, its global rank in a transport's words, or its pid). A rank whose error
    comes from a survivor that gave up and left before it (a "messenger") names that
    survivor: xccl forwards a failure to the members of the same operation ("rank 0
    reported: ..."), not to later operations or other communicators. During start-up the
    store cannot tell which rank is missing, so no name is required there;
  * no rank ever returned wrong data, crashed, or failed to destroy its process group;
  * nothing is still running at the hard deadline (else their Python stacks are dumped and
    the round fails as a hang);
  * afterwards (stopped ranks are killed at the end) no process of the job is left, no
    /dev/shm segment of the job's processes, no socket the job's processes had open (by inode,
    in /proc/net/{tcp,tcp6,udp,udp6,unix}), and no file in the ranks' TMPDIR.

A failing round prints its violations, every rank's log, the seed and the exact command that
replays it; the driver exits 1 if any round failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
REPO = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)

import workload as W  # noqa: E402

WORKER = os.path.join(HERE, "worker.py")
XCCL_ERRORS = {
    "XcclError",
    "XcclConnectionError",
    "XcclTimeoutError",
    "XcclMismatchError",
    "XcclAuthError",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "DistError",
}
NO_FAULT_SHARE = 0.15  # rounds without a fault: any error there is a bug of its own
CONTROL_OPS = 150  # operations per rank of such a round
READY_DEADLINE_S = 120.0  # a rank that has not started by then fails the round (busy CI)


@dataclass
class Plan:
    """Everything random about one round, drawn from (seed, round)."""

    seed: int
    round: int
    np: int
    hosts: list[int]
    store: str  # "file" or "tcp"
    groups: list[list[int]]
    max_count: int
    fault: str  # "kill", "stop" or "none" (a control round: every rank must finish its ops)
    victim: int
    early: bool  # fault while the ranks start (before every rank is ready)
    delay: float  # seconds after the reference moment

    def describe(self) -> str:
        if self.fault == "none":
            return (f"np={self.np} hosts={self.hosts} store={self.store} groups={self.groups} "
                    f"max_count={self.max_count} no fault: {CONTROL_OPS} ops per rank")
        return (
            f"np={self.np} hosts={self.hosts} store={self.store} groups={self.groups} "
            f"max_count={self.max_count} fault={self.fault} victim=rank {self.victim} "
            f"{'during start-up' if self.early else 'after start-up'} "
            f"at {self.delay * (2 if self.early else 1):.2f}s"
        )


def make_plan(seed: int, rnd: int, np_fixed: Optional[int], early_share: float = 0.1) -> Plan:
    rng = random.Random(f"xccl-faults/{seed}/{rnd}")
    n = np_fixed or rng.randint(3, 6)
    nhosts = rng.choice([1, 2, 2, 3]) if n > 1 else 1
    hosts = [rng.randrange(nhosts) for _ in range(n)]
    groups = W.random_groups(rng, n, rng.randint(1, 5))
    plan = Plan(
        seed=seed,
        round=rnd,
        np=n,
        hosts=hosts,
        store=rng.choice(["file", "file", "tcp"]),
        groups=groups,
        max_count=rng.choice([4096, 4096, 4096, 1 << 18]),
        fault=rng.choice(["kill", "stop"]),
        victim=rng.randrange(n),
        early=rng.random() < early_share,
        delay=rng.uniform(0.0, 1.5),
    )
    if rng.random() < NO_FAULT_SHARE:  # drawn last: the other draws stay those of older runs
        plan.fault, plan.early = "none", False
    return plan


@dataclass
class RankProc:
    rank: int
    proc: subprocess.Popen
    log: str
    ready: Optional[float] = None
    end: Optional[dict] = None
    exited_clean: bool = False
    destroy_failed: Optional[str] = None
    buf: bytes = b""
    sockets: set[str] = field(default_factory=set)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            m = re.fullmatch(r"socket:\[(\d+)\]", link)
            if m:
                out.add(m.group(1))
    except OSError:
        pass
    return out


def _live_socket_inodes() -> set[str]:
    """Inodes of every socket the kernel lists (0 for ones no process holds, e.g. TIME_WAIT)."""
    inodes = set()
    for name, col in (("tcp", 9), ("tcp6", 9), ("udp", 9), ("udp6", 9), ("unix", 6)):
        try:
            with open(f"/proc/net/{name}") as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if len(parts) > col and parts[col] != "0":
                        inodes.add(parts[col])
        except OSError:
            continue
    return inodes


def _job_processes(sids: set[int], token: str, kill: bool) -> list[str]:
    """Processes of the sessions ``sids`` (each rank leads one) or with ``token`` in their
    environment (inherited by anything a rank started, even in a new session); with ``kill``,
    SIGKILLs them (they are reported, not left for the next round)."""
    left = []
    needle = token.encode()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            fields = stat[stat.rfind(")") + 2:].split()
            mine = int(fields[3]) in sids  # field 6 of stat: session id
            if not mine:
                with open(f"/proc/{d}/environ", "rb") as f:
                    mine = needle in f.read()
        except (OSError, IndexError, ValueError):
            continue
        if mine:
            left.append(f"pid {d} ({stat[stat.find('(') + 1:stat.rfind(')')]}, state {fields[0]})")
            if kill:
                try:
                    os.kill(int(d), signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return left


def _shm_segments(pids: set[int]) -> list[str]:
    left = []
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return left
    for name in names:
        # the shm transport's per-rank segments (.../<rank>-<pid>) and the node-shared
        # segments of communicators (xcclseg-<job>-<comm>-<pid of its rank 0>)
        m = re.fullmatch(r"xccl-[0-9a-f]+-\d+-(\d+)", name) or re.fullmatch(
            r"xcclseg-[0-9a-f]{16}-[0-9a-f]{16}-(\d+)", name
        )
        if m and int(m.group(1)) in pids:
            left.append("/dev/shm/" + name)
    return left


def replay_command(args: argparse.Namespace, rnd: int) -> str:
    cmd = [sys.executable, os.path.relpath(__file__, REPO), "--seed", str(args.seed),
           "--first-round", str(rnd), "--rounds", "1", "--timeout", str(args.timeout)]
    if args.np:
        cmd += ["--np", str(args.np)]
    if args.early_share != 0.1:
        cmd += ["--early-share", str(args.early_share)]
    pp = os.environ.get("PYTHONPATH")
    return ("cd " + shlex.quote(REPO) + " && " + (f"PYTHONPATH={shlex.quote(pp)} " if pp else "")
            + shlex.join(cmd))


class Round:
    def __init__(self, plan: Plan, timeout: float, verbose: bool, selftest: str = "") -> None:
        self.plan = plan
        self.selftest = selftest
        self.timeout = timeout
        self.verbose = verbose
        self.problems: list[str] = []
        self.ranks: list[RankProc] = []
        self.fault_t: Optional[float] = None
        self.comms: dict[str, int] = {}  # communicator name -> index of the workload group
        self.named = 0  # survivors whose error names the victim
        self.tmp = tempfile.mkdtemp(prefix="xccl-faults-")
        self.token = "FAULT_JOB_TOKEN=" + os.path.basename(self.tmp)
        self.rank_tmp = os.path.join(self.tmp, "tmp")
        os.mkdir(self.rank_tmp)

    # ---------------------------------------------------------------- start
    def start(self) -> None:
        p = self.plan
        if p.store == "file":
            init = f"file://{self.tmp}/store"
        else:
            init = f"tcp://127.0.0.1:{_free_port()}"
        self.sel = selectors.DefaultSelector()
        base = dict(os.environ)
        for k in ("XCCL_HOST_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            base.pop(k, None)
        for r in range(p.np):
            rfd, wfd = os.pipe()
            env = dict(base)
            env.update(
                RANK=str(r),
                WORLD_SIZE=str(p.np),
                XCCL_HOST_ID=f"fault-host-{p.hosts[r]}",
                FAULT_FD=str(wfd),
                FAULT_SEED=str(p.seed * 1000003 + p.round),
                FAULT_GROUPS=json.dumps(p.groups),
                FAULT_TIMEOUT=str(self.timeout),
                FAULT_MAX_COUNT=str(p.max_count),
                FAULT_INIT=init,
                TMPDIR=self.rank_tmp,
                PYTHONFAULTHANDLER="1",
                FAULT_JOB_TOKEN=os.path.basename(self.tmp),
            )
            if self.selftest:
                env["FAULT_SELFTEST"] = self.selftest
            if p.fault == "none":
                env["FAULT_OPS"] = str(CONTROL_OPS)
            log = os.path.join(self.tmp, f"rank{r}.log")
            with open(log, "wb") as lf:
                proc = subprocess.Popen(
                    [sys.executable, WORKER],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=lf,
                    stderr=subprocess.STDOUT,
                    pass_fds=[wfd],
                    start_new_session=True,
                    cwd=REPO,
                )
            os.close(wfd)
            os.set_blocking(rfd, False)
            rp = RankProc(r, proc, log)
            self.sel.register(rfd, selectors.EVENT_READ, rp)
            self.ranks.append(rp)

    def _pump(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            rp: RankProc = key.data
            try:
                data = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not data:
                self.sel.unregister(key.fd)
                os.close(key.fd)
                continue
            rp.buf += data
            while b"\n" in rp.buf:
                line, rp.buf = rp.buf.split(b"\n", 1)
                msg = json.loads(line)
                if msg["ev"] == "ready":
                    rp.ready = msg["t"]
                    self.comms.update(msg["comms"])
                elif msg["ev"] == "end":
                    rp.end = msg
                    if msg["status"] not in ("error", "done") and self.fault_t is None:
                        # wrong data or a crash before the fault: nothing to wait for
                        self.problems.append(self._end_problem(rp))
                elif msg["ev"] == "exit":
                    rp.exited_clean = True
                elif msg["ev"] == "destroy_failed":
                    rp.destroy_failed = msg["msg"]

    # ---------------------------------------------------------------- fault
    def _inject(self) -> None:
        p = self.plan
        victim = self.ranks[p.victim]
        for rp in self.ranks:
            rp.sockets |= _socket_inodes(rp.proc.pid)
        sig = signal.SIGKILL if p.fault == "kill" else signal.SIGSTOP
        try:
            os.kill(victim.proc.pid, sig)
        except ProcessLookupError:
            pass
        self.fault_t = time.monotonic()
        if self.verbose:
            print(f"    {p.fault} rank {p.victim} (pid {victim.proc.pid})", flush=True)

    def _end_problem(self, rp: RankProc) -> str:
        e = rp.end or {}
        what = {"wrong": "returned WRONG DATA", "crash": "crashed"}.get(e.get("status", ""), "?")
        return f"rank {rp.rank} {what} after {e.get('ops')} ops: {e.get('type')}: {e.get('msg')}"

    def run(self) -> None:
        p = self.plan
        t0 = time.monotonic()
        try:
            self.start()
            # --- wait for start-up (or inject during it)
            fault_at = t0 + 2 * p.delay if p.early else None  # 0-3 s: imports, init, wire-up
            while self.fault_t is None and not self.problems:
                now = time.monotonic()
                if fault_at is not None and now >= fault_at:
                    self._inject()
                    break
                # (selftest "wrong": no fault; the round ends on the wrong result)
                up = all(rp.ready is not None for rp in self.ranks)
                if p.fault == "none" and up:
                    break
                if fault_at is None and self.selftest != "wrong" and up:
                    fault_at = now + p.delay
                    continue
                if now - t0 > READY_DEADLINE_S:
                    self.problems.append(
                        f"ranks {[rp.rank for rp in self.ranks if rp.ready is None]} not up "
                        f"within {READY_DEADLINE_S:g} s"
                    )
                    break
                if any(rp.proc.poll() is not None and rp.end is None for rp in self.ranks):
                    self.problems.append("a rank exited before the fault: " + ", ".join(
                        f"rank {rp.rank} code {rp.proc.returncode}"
                        for rp in self.ranks if rp.proc.poll() is not None))
                    break
                wait = 0.05 if fault_at is None else max(0.0, min(0.05, fault_at - now))
                self._pump(wait)
            if p.fault == "none" and not self.problems:
                self._await_control()
            elif self.fault_t is not None:
                self._await_survivors()
        finally:
            self._teardown()
        if self.fault_t is not None and not self.problems:
            self._judge()
        self._check_leftovers()

    def _await_control(self) -> None:
        """A round without a fault: every rank must run its operations and exit cleanly."""
        for rp in self.ranks:  # the sockets they hold now must be gone after the round
            rp.sockets |= _socket_inodes(rp.proc.pid)
        hard = time.monotonic() + 2 * self.timeout + 60.0 + CONTROL_OPS * 0.2
        while time.monotonic() < hard and any(rp.proc.poll() is None for rp in self.ranks):
            self._pump(0.05)
        self._pump(0.0)
        hung = [rp for rp in self.ranks if rp.proc.poll() is None]
        for rp in hung:
            try:
                os.kill(rp.proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        if hung:
            time.sleep(1.0)
            self.problems.append(f"HANG without a fault: ranks {[rp.rank for rp in hung]}")
        for rp in self.ranks:
            e = rp.end or {}
            if e.get("status") == "done" and rp.exited_clean:
                continue
            if rp in hung:
                continue
            self.problems.append(
                f"rank {rp.rank} failed WITHOUT A FAULT (exit {rp.proc.returncode}): "
                f"{e.get('status')} {e.get('type')}: {e.get('msg') or rp.destroy_failed}")

    def _await_survivors(self) -> None:
        p = self.plan
        survivors = [rp for rp in self.ranks if rp.rank != p.victim]
        # named error within 2 timeouts (the stopped rank's peers time out, their peers then
        # see them leave) + slack for a loaded 2-core machine; a hang is declared later
        hard = self.fault_t + 3 * self.timeout + 60.0
        while time.monotonic() < hard:
            if all(rp.proc.poll() is not None for rp in survivors):
                break
            self._pump(0.05)
        self._pump(0.0)
        hung = [rp for rp in survivors if rp.proc.poll() is None]
        if hung:
            for rp in hung:
                try:
                    os.kill(rp.proc.pid, signal.SIGUSR1)  # faulthandler: stacks into its log
                except ProcessLookupError:
                    pass
            time.sleep(1.0)
            self.problems.append(
                f"HANG: ranks {[rp.rank for rp in hung]} still running {hard - self.fault_t:.0f}"
                f" s after the fault (stacks dumped into their logs below)"
            )

    def _teardown(self) -> None:
        if not hasattr(self, "sel"):
            return  # start() failed before any rank started
        for rp in self.ranks:
            if rp.proc.poll() is None:
                try:
                    os.killpg(rp.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for rp in self.ranks:
            try:
                rp.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.problems.append(f"rank {rp.rank} (pid {rp.proc.pid}) survives SIGKILL")
        while self.sel.get_map():
            before = len(self.sel.get_map())
            self._pump(0.2)
            if len(self.sel.get_map()) == before:
                break
        for key in list(self.sel.get_map().values()):
            self.sel.unregister(key.fd)
            os.close(key.fd)
        self.sel.close()

    # ---------------------------------------------------------------- verdict
    def _judge(self) -> None:
        p = self.plan
        limit = 2 * self.timeout + 20.0
        for rp in self.ranks:
            if rp.rank == p.victim:
                continue
            e = rp.end
            code = rp.proc.returncode
            if e is None:
                self.problems.append(
                    f"rank {rp.rank} ended (exit {code}) without reporting an error")
                continue
            if e["status"] != "error":
                self.problems.append(self._end_problem(rp))
                continue
            waited = e["t"] - self.fault_t
            if e["type"] not in XCCL_ERRORS:
                self.problems.append(f"rank {rp.rank} raised {e['type']}, not an xccl error: "
                                     f"{e['msg']}")
            first = e["msg"].split("\n", 1)[0]
            if not p.early and not re.search(r"\brank \d+", first.split(" on rank ", 1)[-1]):
                self.problems.append(
                    f"rank {rp.rank}'s error names no rank: {e['type']}: {first}")
            if self.names_victim(first, rp):
                self.named += 1
            if waited > limit:
                self.problems.append(
                    f"rank {rp.rank} raised {waited:.1f} s after the fault (limit {limit:g} s)")
            if rp.destroy_failed:
                self.problems.append(
                    f"rank {rp.rank}: destroy_process_group failed: {rp.destroy_failed}")
            elif code != 0 or not rp.exited_clean:
                self.problems.append(f"rank {rp.rank} exited with {code} after its error")
        if self.named == 0 and not p.early:
            self.problems.append(f"no survivor's error names rank {p.victim}, the "
                                 f"{'killed' if p.fault == 'kill' else 'stopped'} one")
        self.waits = {rp.rank: rp.end["t"] - self.fault_t for rp in self.ranks
                      if rp.end is not None and rp.rank != p.victim}

    def names_victim(self, first: str, rp: RankProc) -> bool:
        """Whether an error's first line names the victim: its pid, its rank in the
        communicator the operation ran on (``on comm 'K'``), or its global rank in a
        transport's words ("connection to rank V", "rank V (pid P)")."""
        p = self.plan
        victim = self.ranks[p.victim]
        if re.search(rf"\bpid {victim.proc.pid}\b", first):
            return True
        if re.search(rf"connection to rank {p.victim}\b|rank {p.victim} \(", first):
            return True
        m = re.search(r"on comm '([^']*)'", first)
        gi = self.comms.get(m.group(1)) if m else 0
        if gi is None:
            return False
        members = p.groups[gi]
        if p.victim not in members:
            return False
        own = rf"on rank {members.index(rp.rank)}\b" if rp.rank in members else None
        text = re.sub(own, "", first) if own else first
        v = members.index(p.victim)
        silent = re.search(r"no answer from ranks ([\d, ]+)", text)  # "ranks 1, 4" (timeouts)
        if silent and v in [int(x) for x in silent.group(1).split(", ") if x]:
            return True
        return re.search(rf"\brank {v}\b", text) is not None

    def _check_leftovers(self) -> None:
        pids = {rp.proc.pid for rp in self.ranks}
        left = _job_processes(pids, self.token, kill=False)
        end = time.monotonic() + 2.0  # a process killed with its rank may still be exiting
        while left and time.monotonic() < end:
            time.sleep(0.1)
            left = _job_processes(pids, self.token, kill=False)
        left = _job_processes(pids, self.token, kill=True)
        if left:
            self.problems.append("LEFT processes: " + ", ".join(left))
        segs = _shm_segments(pids)
        if segs:
            self.problems.append("LEFT shared memory: " + ", ".join(segs))
        socks = sorted(set().union(*(rp.sockets for rp in self.ranks)) & _live_socket_inodes())
        if socks:
            self.problems.append(f"LEFT sockets (inodes): {socks}")
        files = []
        for d, _, fs in os.walk(self.rank_tmp):
            files += [os.path.join(d, f) for f in fs]
        files += [os.path.join(self.rank_tmp, d) for d in os.listdir(self.rank_tmp)
                  if os.path.isdir(os.path.join(self.rank_tmp, d))]
        if files:
            self.problems.append(f"LEFT temporary files: {sorted(files)}")

    def logs(self) -> str:
        out = []
        for rp in self.ranks:
            try:
                with open(rp.log, "rb") as f:
                    text = f.read().decode("utf-8", "replace")
            except OSError:
                text = ""
            lines = text.splitlines()[-60:]
            out += [f"[rank {rp.rank}] {line}" for line in lines]
        return "\n".join(out)

    def cleanup(self) -> None:
        import shutil

        shutil.rmtree(self.tmp, ignore_errors=True)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--rounds", type=int, help="number of rounds")
    g.add_argument("--budget", type=float, help="seconds: start rounds until this is spent")
    ap.add_argument("--first-round", type=int, default=0, help="round number to start at")
    ap.add_argument("--np", type=int, default=None, help="ranks per job (default: 3-6)")
    ap.add_argument("--timeout", type=float, default=4.0, help="xccl timeout of the ranks (s)")
    ap.add_argument("--early-share", type=float, default=0.1,
                    help="share of faults injected while the ranks start (default 0.1)")
    ap.add_argument("--json", default=None, help="write a summary of the rounds here")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--selftest", choices=["wrong", "leak"], default="",
                    help="make rank 0 misbehave, to see the checks fail")
    args = ap.parse_args(argv)
    if args.rounds is None and args.budget is None:
        args.rounds = 10
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    if args.np is not None and not 2 <= args.np <= 64:
        ap.error("--np must be between 2 and 64")
    print(f"fault driver: seed {args.seed}", flush=True)
    t_start = time.monotonic()
    rnd = args.first_round
    summary = {"seed": args.seed, "rounds": 0, "failed": [], "kill": 0, "stop": 0, "none": 0,
               "early": 0, "ops": 0, "max_wait_s": 0.0}
    while True:
        if args.rounds is not None and rnd - args.first_round >= args.rounds:
            break
        if args.budget is not None and time.monotonic() - t_start >= args.budget:
            break
        plan = make_plan(args.seed, rnd, args.np, args.early_share)
        print(f"round {rnd}: {plan.describe()}", flush=True)
        r = Round(plan, args.timeout, args.verbose, args.selftest)
        t0 = time.monotonic()
        r.run()
        summary["rounds"] += 1
        summary[plan.fault] += 1
        summary["early"] += int(plan.early)
        summary["ops"] += sum((rp.end or {}).get("ops", 0) for rp in r.ranks)
        waits = getattr(r, "waits", {})
        if waits:
            summary["max_wait_s"] = max(summary["max_wait_s"], max(waits.values()))
        if r.problems:
            summary["failed"].append(rnd)
            print(f"round {rnd} FAILED ({time.monotonic() - t0:.1f} s):", flush=True)
            for prob in r.problems:
                print("  - " + prob, flush=True)
            print(r.logs(), flush=True)
            print(f"replay: {replay_command(args, rnd)}", flush=True)
        else:
            w = ", ".join(f"{k}:{v:.1f}s" for k, v in sorted(waits.items()))
            if plan.fault == "none":
                print(f"round {rnd} ok ({time.monotonic() - t0:.1f} s; no fault, every rank "
                      "finished)", flush=True)
            else:
                print(f"round {rnd} ok ({time.monotonic() - t0:.1f} s; {r.named} of "
                      f"{plan.np - 1} errors name rank {plan.victim}; errors after: {w})",
                      flush=True)
        r.cleanup()
        rnd += 1
    print(
        f"fault driver: {summary['rounds']} rounds ({summary['kill']} kill, {summary['stop']} "
        f"stop, {summary['none']} without a fault, {summary['early']} faults during start-up), "
        f"{summary['ops']} checked ops, "
        f"{len(summary['failed'])} failed, slowest error {summary['max_wait_s']:.1f} s after "
        f"the fault; seed {args.seed}",
        flush=True,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
