"""Jobs across "hosts" made of Linux namespaces on this machine (tests/hosts/run.sh).

Every host has its own network stack (veth0 on a bridge, 10.99.0.<i+1>), IPC namespace
(shared memory is not shared across hosts), host name and PID namespace, so ranks of one
host talk through shared memory and ranks of different hosts through TCP over the veth
links. The job scripts (job_*.py beside this file) check their results against numpy or a
one-process torch reference; these tests check what the scripts report, the errors of the
failure cases, and that every run leaves no namespace, process or file behind.

Needs root and network namespaces (CI runs as root); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
from job_collectives import host_of  # the job's own mapping of ranks to hosts

HERE = Path(__file__).resolve().parent
RUN = HERE / "run.sh"


def _unavailable() -> Optional[str]:
    """Why these tests cannot run here, or None."""
    if not sys.platform.startswith("linux"):
        return "network-namespace hosts need Linux"
    if os.geteuid() != 0:
        return "network-namespace hosts need root (CI runs as root)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"network-namespace hosts need {tool}(8), which is not installed"
    probe = f"xhprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    r = subprocess.run(["unshare", "--ipc", "--uts", "--mount", "--pid", "--fork", "true"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create IPC/UTS/mount/PID namespaces: {r.stderr.strip()}"
    return None


REASON = _unavailable()
if REASON is not None and os.environ.get("XH_REQUIRE_HOSTS") == "1":
    # CI sets this: there a missing capability is a failure, not a silent skip
    def test_hosts_are_available():
        pytest.fail(f"XH_REQUIRE_HOSTS=1 but {REASON}")

pytestmark = pytest.mark.skipif(
    REASON is not None and os.environ.get("XH_REQUIRE_HOSTS") != "1", reason=REASON or ""
)

# variables of an outer job or launcher that must not leak into the hosts' ranks
_SCRUB = ("XCCL_", "SLURM_", "OMPI_", "PMI_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
          "LOCAL_WORLD_SIZE", "MASTER_", "GROUP_RANK", "NODE_RANK", "ROLE_", "TORCHELASTIC_")


def job_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment for run.sh: this interpreter, and the xccl these tests import."""
    import xccl

    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB)}
    pkg_root = str(Path(xccl.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    env["PYTHON"] = sys.executable
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclass
class Result:
    rc: int
    out: str
    err: str

    @property
    def run_id(self) -> str:
        m = re.search(r"run\.sh: run ([0-9a-f]{6}):", self.err)
        assert m, self.err[-3000:]
        return m.group(1)

    @property
    def ctl(self) -> str:
        m = re.search(r"XH_CTL=(\S+)", self.err)
        assert m, self.err[-3000:]
        return m.group(1)

    def lines(self, tag: str) -> list[str]:
        """Payloads of lines '[hostH] [rank R] TAG payload' (stdout and stderr)."""
        pat = re.compile(rf"^\[host\d+\] \[rank \d+\] {re.escape(tag)} (.*)$")
        return [m.group(1) for line in (self.out + self.err).splitlines()
                if (m := pat.match(line))]

    def json(self, tag: str) -> list[dict]:
        return [json.loads(x) for x in self.lines(tag)]

    def rank_lines(self, rank: int) -> list[str]:
        return [line for line in (self.out + self.err).splitlines()
                if re.match(rf"^\[host\d+\] \[rank {rank}\] ", line)]

    def why(self) -> str:
        return f"exit {self.rc}\n--- stdout\n{self.out[-4000:]}\n--- stderr\n{self.err[-8000:]}"


def run_hosts(opts: list[str], script: str, args: tuple[str, ...] = (),
              env: Optional[dict[str, str]] = None, timeout: float = 280) -> Result:
    """Runs ``run.sh OPTS -- tests/hosts/SCRIPT ARGS`` and checks that it left nothing."""
    cmd = ["bash", str(RUN), *opts, "--", str(HERE / script), *args]
    p = subprocess.run(cmd, env=job_env(env), capture_output=True, text=True, timeout=timeout)
    res = Result(p.returncode, p.stdout, p.stderr)
    assert_clean(res.run_id, res.ctl)
    return res


def _procs_with(needle: bytes) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes():
                pids.append(int(d.name))
        except OSError:
            pass
    return pids


def assert_clean(run_id: str, ctl: str) -> None:
    """No namespace of the run, no process of its job, no control directory is left."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [line.split()[0] for line in ns.splitlines() if line.startswith(f"xh{run_id}")]
    assert not left, f"namespaces left behind: {left}"
    assert not os.path.exists(ctl), f"control directory {ctl} left behind"
    procs = _procs_with(f"XH_CTL={ctl}\0".encode())
    assert not procs, f"processes of the job left behind: {procs}"


# --------------------------------------------------------------------------- collectives


def check_results(res: Result, per_host: list[int]) -> list[dict]:
    assert res.rc == 0, res.why()
    results = sorted(res.json("XH-RESULT"), key=lambda r: r["rank"])
    world = sum(per_host)
    assert [r["rank"] for r in results] == list(range(world)), res.why()
    for r in results:
        me = r["rank"]
        assert r["host"] == f"host{host_of(me, per_host)}"
        want = {str(p): "self" if p == me else
                ("shm" if host_of(p, per_host) == host_of(me, per_host) else "tcp")
                for p in range(world)}
        assert r["transports"] == want, (me, r["transports"])
        assert set(r["transports_host_group"].values()) <= {"self", "shm"}
        assert r["checks"] >= 300, r["checks"]
        # every rank prices alike, so every rank picks the same algorithms
        assert r["selector_world"] == results[0]["selector_world"], (me, r["selector_world"])
        for v in r["selector_host_group"].values():
            assert not v["chosen"].startswith("hier"), r["selector_host_group"]
        # the group spanning hosts offers the two-level algorithms
        assert "hier" in r["algos_world"]["all_reduce"]
        assert "hier_rs" in r["algos_world"]["all_reduce"]
        assert "hier" in r["algos_world"]["broadcast"]
    return results


def test_collectives_two_hosts_of_two(tmp_path):
    """2 hosts x 2 ranks: every collective and P2P call (every algorithm) on the world, on
    each host's group and on a group spanning hosts; DeviceMesh with one row per host; each
    host also has a decoy interface listed before veth0, so the job only works because
    XCCL_SOCKET_IFNAME=veth picks the veth link."""
    res = run_hosts(["--hosts", "2", "--ranks-per-host", "2", "--decoy"], "job_collectives.py",
                    env={"XCCL_SOCKET_IFNAME": "veth", "XCCL_DEBUG": "INFO"})
    results = check_results(res, [2, 2])
    for r in results:
        # the two-level algorithms are what the selector picks across 2 x 2 hosts (explain's
        # chosen; the script checked that this is what ran)
        sel = r["selector_world"]
        assert sel["all_reduce:8"]["chosen"] == "hier", sel
        assert sel["all_reduce:1000"]["chosen"] == "hier", sel
        assert sel["all_reduce:262144"]["chosen"] == "hier_rs", sel
        assert sel["broadcast:262144"]["chosen"] == "hier", sel
        # a mesh row is a host (shared memory), a mesh column crosses hosts (TCP)
        me = r["rank"]
        assert r["mesh"] == {"local": [me // 2 * 2, me // 2 * 2 + 1], "host": [me % 2, me % 2 + 2]}
    for rank in range(4):
        log = "\n".join(res.rank_lines(rank))
        addr = f"10.99.0.{rank // 2 + 1}"
        assert f"socket: using interface veth0 address {addr}:0" in log, log[-2000:]
        assert "10.98." not in log  # the decoy is never used
        peers = re.findall(r"tcp: rank \d+ connected to rank (\d+) \((10\.99\.0\.\d+):", log)
        assert peers, log[-2000:]
        for peer, paddr in peers:
            assert paddr == f"10.99.0.{int(peer) // 2 + 1}", (rank, peer, paddr)
            assert int(peer) // 2 != rank // 2  # TCP only between hosts


def test_collectives_uneven_hosts():
    """3 ranks on one host and 1 on the other (started as srun would start them): the lone
    rank reaches everyone through TCP and picks the same algorithms as the others (it did
    not: see test_hier.py::test_lone_rank_on_its_host_chooses_like_the_others). The decoy
    interfaces are excluded by XCCL_SOCKET_IFNAME=^decoy (the exclusion form)."""
    res = run_hosts(["--hosts", "2", "--ranks-per-host", "3,1", "--decoy"],
                    "job_collectives.py", env={"XCCL_SOCKET_IFNAME": "^decoy"})
    results = check_results(res, [3, 1])
    assert set(results[3]["transports"].values()) == {"self", "tcp"}
    assert "mesh" not in results[0]
    assert "transports_span" in results[3] and "transports_span" not in results[2]


# --------------------------------------------------------------------------- initialisation


def test_socket_ifname_that_does_not_exist():
    res = run_hosts(["--hosts", "2", "--ranks-per-host", "1"], "job_init.py",
                    env={"XCCL_SOCKET_IFNAME": "nosuch0"})
    assert res.rc != 0, res.why()
    assert not res.lines("XH-OK")
    for rank in range(2):
        log = "\n".join(res.rank_lines(rank))
        assert ("no usable interface matches XCCL_SOCKET_IFNAME=nosuch0 "
                "(interfaces: lo, veth0)") in log, res.why()


def test_hosts_with_different_job_secrets_fail_at_init():
    res = run_hosts(["--hosts", "2", "--ranks-per-host", "1", "--mismatched-keys",
                     "--grace", "60"], "job_init.py", ("--timeout", "8"))
    assert res.rc != 0, res.why()
    assert not res.lines("XH-OK"), res.why()
    # host 1's rank is refused by the store on host 0, with a message that says why
    log = "\n".join(res.rank_lines(1))
    assert re.search(r"XcclAuthError: TCP store 10\.99\.0\.1:\d+: authentication failed: "
                     r".*failed authentication \(wrong key\?\)", log), res.why()
    # and host 0's rank, which waits for it at the store, says that a worker from host 1's
    # address was refused (not just that one is missing)
    log = "\n".join(res.rank_lines(0))
    assert re.search(r"XcclTimeoutError: TCP store .*only 1 of 2 workers connected within "
                     r"8000 ms; 1 connection\(s\) failed authentication \(the last from "
                     r"10\.99\.0\.2:\d+\): do all ranks have the same XCCL_AUTH_KEY\?", log), \
        res.why()


def test_two_runs_side_by_side():
    """Names carry a run id: two runs at once (each with its own store on its host 0, the
    same port and addresses in separate namespaces) both work."""
    cmd = ["bash", str(RUN), "--hosts", "2", "--ranks-per-host", "1", "--",
           str(HERE / "job_init.py")]
    procs = [subprocess.Popen(cmd, env=job_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        res = Result(p.returncode, out, err)
        assert res.rc == 0, res.why()
        assert sorted(res.lines("XH-OK")) == ["0", "1"]
        assert_clean(res.run_id, res.ctl)
    assert Result(0, "", outs[0][1]).run_id != Result(0, "", outs[1][1]).run_id


@pytest.mark.parametrize("per_host", ["1", "2,1"])
def test_exit_status_is_the_jobs(per_host):
    """Every rank exits 4 (job_linkdown.py with no fault and no time to loop): run.sh exits 4,
    through xccl-run (equal hosts) and through the srun-style start (unequal hosts)."""
    res = run_hosts(["--hosts", "2", "--ranks-per-host", per_host], "job_linkdown.py",
                    ("--max-seconds", "0"))
    assert res.rc == 4, res.why()
    world = sum(int(x) for x in per_host.split(",")) if "," in per_host else 2
    assert len(res.lines("XH-NOERROR")) == world, res.why()


def test_same_secret_job_starts():
    # the control for the test above: the same job with one key works, over the veth
    res = run_hosts(["--hosts", "2", "--ranks-per-host", "1"], "job_init.py")
    assert res.rc == 0, res.why()
    assert sorted(res.lines("XH-OK")) == ["0", "1"]


def test_rate_shapes_the_link():
    """--rate 40mbit (5 MB/s): 2 MB from host 0 to host 1 cannot arrive faster than the token
    bucket lets it (burst 256 KiB): a lower bound only, which no slowness can break."""
    nbytes = 2_000_000
    res = run_hosts(["--hosts", "2", "--ranks-per-host", "1", "--rate", "40mbit"],
                    "job_init.py", ("--p2p-bytes", str(nbytes)))
    assert res.rc == 0, res.why()
    (secs,) = [float(x) for x in res.lines("XH-P2P")]
    floor = (nbytes - 256 * 1024) / 5e6
    assert secs >= 0.9 * floor, (secs, floor)


# --------------------------------------------------------------------------- failures


def test_link_down_mid_collective_names_the_unreachable_peers():
    """Host 1's cable is pulled while all ranks loop over all_reduce: the ranks of host 0
    raise an error within the operation timeout (10 s) that names host 1's ranks."""
    timeout = 10.0
    res = run_hosts(["--hosts", "2", "--ranks-per-host", "2", "--link-down", "1:1",
                     "--grace", "60"], "job_linkdown.py", ("--timeout", str(timeout)))
    assert "host1's link is down" in res.err, res.why()
    assert res.rc == 3, res.why()
    assert not res.lines("XH-NOERROR"), res.why()
    errors = {e["rank"]: e for e in res.json("XH-ERROR")}
    assert {0, 1} <= set(errors), res.why()
    for rank in (0, 1):
        e = errors[rank]
        assert e["type"] in ("XcclTimeoutError", "XcclConnectionError"), e
        assert e["calls"] > 0, e  # collectives ran across the link before it went down
        # the time limit holds (plus the diagnosis round and a loaded machine's slack)
        assert e["call_s"] < timeout + 20, e
        assert re.search(r"rank [23]\b|ranks 2-3", e["msg"]), e
        assert "ranks 2-3: no answer" in e["msg"] or "from rank 2" in e["msg"] \
            or "from rank 3" in e["msg"], e


def test_link_down_at_init_fails_within_the_timeout():
    """Host 1 has no link while the job starts: its rank cannot reach the store on host 0,
    host 0's rank waits for a worker that never comes; both fail within the 10 s timeout
    (with slack for a loaded machine) with errors that say what they waited for."""
    res = run_hosts(["--hosts", "2", "--ranks-per-host", "1", "--link-down", "1:0",
                     "--grace", "60"], "job_linkdown.py", ("--timeout", "10", "--arm-before-init"))
    assert res.rc == 3, res.why()
    errors = {e["rank"]: e for e in res.json("XH-ERROR")}
    assert set(errors) == {0, 1}, res.why()
    for e in errors.values():
        assert e["call_s"] < 10 + 20, e
    assert errors[1]["type"] == "XcclTimeoutError", errors[1]
    assert re.search(r"connect to 10\.99\.0\.1:\d+ timed out", errors[1]["msg"]), errors[1]
    assert errors[0]["type"] == "XcclTimeoutError", errors[0]
    assert "only 1 of 2 workers connected" in errors[0]["msg"], errors[0]


def test_host_crash_mid_collective_names_the_dead_peer():
    """Every process of host 1 is SIGKILLed while all ranks loop over all_reduce: the kernel
    closes their sockets, so host 0's ranks fail at once (long before the 60 s timeout) with
    a connection error naming a rank of host 1 and its address."""
    res = run_hosts(["--hosts", "2", "--ranks-per-host", "2", "--kill-host", "1:1",
                     "--grace", "60"], "job_linkdown.py", ("--timeout", "60"))
    assert "host1's processes were killed" in res.err, res.why()
    # the first failure the harness sees: host 1's launcher, killed (128 + 9), or host 0's,
    # whose ranks exit 3 at once (both can end within one poll of the harness)
    assert res.rc in (137, 3), res.why()
    errors = {e["rank"]: e for e in res.json("XH-ERROR")}
    assert set(errors) == {0, 1}, res.why()
    for e in errors.values():
        assert e["type"] == "XcclConnectionError", e
        assert e["calls"] > 0, e
        assert e["call_s"] < 30, e
        assert re.search(r"rank [23] \(10\.99\.0\.2:\d+\)", e["msg"]), e


def test_harness_timeout_kills_a_hung_rank():
    """A rank that hangs (and ignores SIGTERM): --timeout ends the job with 124 and the
    harness leaves nothing behind (run_hosts checks)."""
    t0 = time.monotonic()
    res = run_hosts(["--hosts", "2", "--ranks-per-host", "1", "--timeout", "8",
                     "--grace", "2"], "job_hang.py")
    assert res.rc == 124, res.why()
    assert "timeout after 8 s" in res.err, res.why()
    assert time.monotonic() - t0 < 120


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_harness_signal_cleans_up(sig):
    """SIGTERM or Ctrl-C (SIGINT) to run.sh while a rank hangs: it exits 128 + signal and
    leaves nothing behind."""
    cmd = ["bash", str(RUN), "--hosts", "2", "--ranks-per-host", "1", "--grace", "2",
           "--timeout", "200", "--", str(HERE / "job_hang.py")]
    p = subprocess.Popen(cmd, env=job_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    err: list[str] = []
    ctl: list[str] = []

    def read() -> None:
        for line in p.stderr:  # type: ignore[union-attr]
            err.append(line)
            m = re.search(r"XH_CTL=(\S+)", line)
            if m:
                ctl.append(m.group(1))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and not (ctl and os.path.exists(f"{ctl[0]}/arm.1")):
        assert p.poll() is None, "".join(err)
        time.sleep(0.1)
    assert ctl and os.path.exists(f"{ctl[0]}/arm.1"), "".join(err)
    p.send_signal(sig)
    p.wait(timeout=120)
    t.join(timeout=30)
    text = "".join(err)
    assert p.returncode == 128 + sig, text
    assert f"received {signal.Signals(sig).name}" in text, text
    m = re.search(r"run\.sh: run ([0-9a-f]{6}):", text)
    assert m, text
    assert_clean(m.group(1), ctl[0])


def test_harness_killed_leaves_no_process_and_cleanup_removes_the_rest():
    """SIGKILL of run.sh itself: nothing can run its clean-up, yet no process of the job
    survives it (parent-death signal into unshare --kill-child); ``run.sh --cleanup`` then
    deletes its namespaces and control directory."""
    cmd = ["bash", str(RUN), "--hosts", "2", "--ranks-per-host", "1", "--",
           str(HERE / "job_hang.py")]
    p = subprocess.Popen(cmd, env=job_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    err: list[str] = []
    t = threading.Thread(target=lambda: err.extend(p.stderr or ()), daemon=True)
    t.start()
    deadline = time.monotonic() + 150
    ctl = None
    while time.monotonic() < deadline:
        m = re.search(r"run\.sh: run ([0-9a-f]{6}):.*XH_CTL=(\S+)", "".join(err))
        if m and os.path.exists(f"{m.group(2)}/arm.1"):
            run_id, ctl = m.group(1), m.group(2)
            break
        assert p.poll() is None, "".join(err)
        time.sleep(0.1)
    assert ctl is not None, "".join(err)
    p.kill()
    p.wait(timeout=30)
    needle = f"XH_CTL={ctl}\0".encode()
    deadline = time.monotonic() + 60
    while _procs_with(needle) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _procs_with(needle), "processes of the job outlived the killed harness"
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"xh{run_id}" in ns  # what only --cleanup removes
    c = subprocess.run(["bash", str(RUN), "--cleanup"], env=job_env(), capture_output=True,
                       text=True, timeout=120)
    assert c.returncode == 0, c.stderr
    assert_clean(run_id, ctl)


def test_usage_errors():
    cases = [
        (["--hosts", "3", "--ranks-per-host", "3,1"], "lists 2 counts for 3 hosts"),
        (["--hosts", "2", "--rate", "fast"], "rate must look like"),
        (["--hosts", "2", "--link-down", "5:1"], "--link-down host 5"),
    ]
    for opts, msg in cases:
        p = subprocess.run(["bash", str(RUN), *opts, "--", str(HERE / "job_init.py")],
                           env=job_env(), capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and msg in p.stderr, (opts, p.stderr)
    p = subprocess.run(["bash", str(RUN), "--hosts", "2"], env=job_env(), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "-- SCRIPT" in p.stderr, p.stderr


# --------------------------------------------------------------------------- torch


def test_ddp_across_hosts_matches_one_process():
    res = run_hosts(["--hosts", "2", "--ranks-per-host", "2"], "job_ddp.py")
    assert res.rc == 0, res.why()
    (info,) = res.json("XH-DDP")
    assert info["world"] == 4 and info["numel"] > 5000
    assert info["max_abs_diff"] < 1e-5, info
