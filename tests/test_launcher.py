"""Tests of the launcher ``xccl-run`` (python/xccl/run.py).

The launcher is standard-library Python and must work before the C engine is built, so these
tests run it by path (``python python/xccl/run.py``) on tiny scripts that never import xccl.
The entry points (``python -m xccl.run``, the ``xccl-run`` console script) are checked
separately; they import the xccl package (conftest.py stops the session when it does not).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_PY = ROOT / "python" / "xccl" / "run.py"
LAUNCHER = [sys.executable, str(RUN_PY)]

_spec = importlib.util.spec_from_file_location("xccl_run_under_test", RUN_PY)
assert _spec is not None and _spec.loader is not None
run_mod = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = run_mod  # dataclasses look their module up there
_spec.loader.exec_module(run_mod)

# Writes the rank's view of the world to <dir>/rank<RANK>.json, then acts on argv:
# "fail:R:CODE" exits rank R with CODE; "kill:R" kills rank R with SIGKILL; "sleep" sleeps.
ENV_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
            "MASTER_ADDR", "MASTER_PORT", "XCCL_AUTH_KEY", "OMP_NUM_THREADS"]
    out = os.environ["TEST_OUT"]
    rank = os.environ.get("RANK", "none")
    info = {k: os.environ.get(k) for k in KEYS}
    info["argv"] = sys.argv[1:]
    info["pid"] = os.getpid()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(info, f)
    # One write each: lines from several ranks sharing a pipe must not interleave.
    sys.stdout.write(f"hello from rank {rank}\\n")
    sys.stderr.write(f"stderr of rank {rank}\\n")
    for arg in sys.argv[1:]:
        if arg.startswith("fail:") and arg.split(":")[1] == rank:
            time.sleep(0.2)
            sys.exit(int(arg.split(":")[2]))
        if arg == f"kill:{rank}":
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        if arg == "sleep":
            try:
                time.sleep(60)
            except KeyboardInterrupt:
                sys.stdout.write(f"rank {rank} interrupted\\n")
                sys.exit(9)
        if arg == "ignore-term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
""")

CLEAN_ENV_PREFIXES = ("SLURM_", "OMPI_", "PMI_")
CLEAN_ENV_NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "XCCL_AUTH_KEY",
    "OMP_NUM_THREADS",
    "GROUP_RANK",
)


@pytest.fixture
def job(tmp_path: Path):
    """Runs the launcher on ENV_SCRIPT; returns (CompletedProcess, {rank: info})."""
    script = tmp_path / "show_env.py"
    script.write_text(ENV_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()

    def run(
        *launcher_args: str,
        script_args: tuple[str, ...] = (),
        env: dict | None = None,
        timeout: float = 60,
        cmd: list[str] | None = None,
    ):
        for f in out.iterdir():
            f.unlink()
        full_env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(CLEAN_ENV_PREFIXES) and k not in CLEAN_ENV_NAMES
        }
        full_env["TEST_OUT"] = str(out)
        full_env.update(env or {})
        argv = (cmd or LAUNCHER) + list(launcher_args) + [str(script), *script_args]
        proc = subprocess.run(
            argv,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        infos = {}
        for f in out.glob("rank*.json"):
            info = json.loads(f.read_text())
            infos[int(info["RANK"]) if info["RANK"] is not None else -1] = info
        return proc, infos

    return run


def test_env_of_three_ranks(job):
    proc, infos = job("--nproc-per-node", "3")
    assert proc.returncode == 0, proc.stderr
    assert sorted(infos) == [0, 1, 2]
    for rank, info in infos.items():
        assert info["LOCAL_RANK"] == str(rank)
        assert info["WORLD_SIZE"] == "3"
        assert info["LOCAL_WORLD_SIZE"] == "3"
        assert info["GROUP_RANK"] == info["NODE_RANK"] == "0"
        assert info["MASTER_ADDR"] == "127.0.0.1"
        assert info["OMP_NUM_THREADS"] == "1"
    ports = {info["MASTER_PORT"] for info in infos.values()}
    keys = {info["XCCL_AUTH_KEY"] for info in infos.values()}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    assert len(keys) == 1
    key = keys.pop()
    assert len(key) == 64 and int(key, 16) >= 0
    assert sorted(proc.stdout.splitlines()) == [f"hello from rank {r}" for r in range(3)]
    assert proc.stderr.count("stderr of rank") == 3


def test_fresh_secret_and_port_per_job(job):
    _, a = job("--nproc-per-node", "1", env={"XCCL_AUTH_KEY": "inherited"})
    _, b = job("--nproc_per_node=1")
    assert a[0]["XCCL_AUTH_KEY"] not in (None, "inherited")
    assert a[0]["XCCL_AUTH_KEY"] != b[0]["XCCL_AUTH_KEY"]


def test_underscore_and_equals_spellings(job):
    proc, infos = job("--nproc_per_node=2", "--master_addr=localhost", "--master_port=0")
    assert proc.returncode == 0, proc.stderr
    assert sorted(infos) == [0, 1]
    assert infos[1]["MASTER_ADDR"] == "localhost"


def test_master_port(job):
    proc, infos = job("--nproc-per-node", "2", "--master-port", "0")
    assert proc.returncode == 0, proc.stderr
    port = int(infos[0]["MASTER_PORT"])
    assert 0 < port < 65536 and infos[1]["MASTER_PORT"] == str(port)
    proc, infos = job("--nproc-per-node", "2", "--master-port", "29123")
    assert {i["MASTER_PORT"] for i in infos.values()} == {"29123"}


def test_free_port_is_bindable():
    import socket

    port = run_mod.free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_script_args_pass_through(job):
    args = ("--nproc-per-node", "5", "-m", "--", "a b", "", "-p", "--prefix", "x=1")
    proc, infos = job("--nproc-per-node", "2", script_args=args)
    assert proc.returncode == 0, proc.stderr
    for info in infos.values():
        assert info["argv"] == list(args)


def test_double_dash_before_script(job, tmp_path):
    proc, infos = job("--nproc-per-node", "2", "--", script_args=("z",))
    assert proc.returncode == 0, proc.stderr
    assert infos[0]["argv"] == ["z"]


def test_failing_rank_stops_the_job(job):
    start = time.monotonic()
    proc, infos = job("--nproc-per-node", "4", script_args=("fail:2:3", "sleep"))
    assert time.monotonic() - start < 20, "the other ranks were not stopped"
    assert proc.returncode == 3
    err = proc.stderr
    assert "rank 2 (pid" in err and "exited with code 3" in err
    for r in (0, 1, 3):
        assert f"rank {r} (pid {infos[r]['pid']}): terminated by xccl-run (SIGTERM)" in err
    assert "<- first failure" in err


def test_rank_killed_by_signal(job):
    proc, _ = job("--nproc-per-node", "3", script_args=("kill:1", "sleep"))
    assert proc.returncode == 128 + signal.SIGKILL
    assert "killed by SIGKILL" in proc.stderr


def test_sigterm_ignored_then_killed(job):
    start = time.monotonic()
    proc, _ = job(
        "--nproc-per-node", "3", "--grace", "0.5", script_args=("ignore-term", "fail:0:5", "sleep")
    )
    assert proc.returncode == 5
    assert time.monotonic() - start < 20
    assert proc.stderr.count("terminated by xccl-run (SIGKILL)") == 2


def _start_launcher(tmp_path: Path, *args: str) -> subprocess.Popen:
    script = tmp_path / "show_env.py"
    script.write_text(ENV_SCRIPT)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN_ENV_PREFIXES)}
    env["TEST_OUT"] = str(out)
    return subprocess.Popen(
        LAUNCHER + list(args) + [str(script), "sleep"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_ranks(tmp_path: Path, n: int) -> None:
    deadline = time.monotonic() + 30
    while len(list((tmp_path / "out").glob("rank*.json"))) < n:
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    time.sleep(0.2)  # let them reach their sleep


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_is_forwarded(tmp_path, sig):
    proc = _start_launcher(tmp_path, "--nproc-per-node", "3")
    try:
        _wait_for_ranks(tmp_path, 3)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + sig
    assert f"received {signal.Signals(sig).name}" in err
    if sig == signal.SIGINT:
        assert sorted(out.splitlines())[-3:] == [f"rank {r} interrupted" for r in range(3)]
        assert err.count("exited with code 9 after xccl-run sent SIGINT") == 3
    else:
        assert err.count("terminated by xccl-run (SIGTERM)") == 3


def test_prefix_output(job):
    proc, _ = job("-p", "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [
        "[rank 0] hello from rank 0",
        "[rank 1] hello from rank 1",
    ]
    assert "[rank 1] stderr of rank 1" in proc.stderr.splitlines()


def test_module_mode(tmp_path):
    pkg = tmp_path / "modpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "show.py").write_text(ENV_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN_ENV_PREFIXES)}
    env.update(PYTHONPATH=str(tmp_path), TEST_OUT=str(out))
    proc = subprocess.run(
        LAUNCHER + ["--nproc-per-node", "2", "-m", "modpkg.show", "a", "--b"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    infos = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    assert [i["RANK"] for i in infos] == ["0", "1"]
    assert infos[1]["argv"] == ["a", "--b"]


def test_no_python(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN_ENV_PREFIXES)}
    proc = subprocess.run(
        LAUNCHER + ["--nproc-per-node", "3", "--no-python", "sh", "-c", 'echo "$RANK/$WORLD_SIZE"'],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == ["0/3", "1/3", "2/3"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nnodes", "2", "--master-port", "0"], "only works with --nnodes 1"),
        (["--nnodes", "2", "--node-rank", "2"], "outside 0..1"),
        (["--nproc-per-node", "0"], "positive integer"),
        (["--nnodes", "1:4"], "not supported"),
    ],
)
def test_usage_errors(job, args, message):
    proc, infos = job(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert infos == {}


def test_missing_program(tmp_path):
    proc = subprocess.run(
        LAUNCHER + ["--no-python", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "cannot run" in proc.stderr


def test_multinode_uses_given_secret_or_warns(job):
    base = (
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--nproc-per-node",
        "2",
        "--master-port",
        "29400",
        "--master-addr",
        "10.1.2.3",
    )
    proc, infos = job(*base, env={"XCCL_AUTH_KEY": "s3cret"})
    assert proc.returncode == 0, proc.stderr
    assert sorted(infos) == [2, 3]
    assert {i["XCCL_AUTH_KEY"] for i in infos.values()} == {"s3cret"}
    assert {i["WORLD_SIZE"] for i in infos.values()} == {"4"}
    assert infos[3]["LOCAL_RANK"] == "1" and infos[3]["GROUP_RANK"] == "1"
    assert infos[2]["MASTER_ADDR"] == "10.1.2.3" and infos[2]["MASTER_PORT"] == "29400"
    proc, infos = job("--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1")
    assert proc.returncode == 0, proc.stderr
    assert infos[0]["XCCL_AUTH_KEY"] is None
    assert infos[0]["MASTER_PORT"] == "29500"
    assert "XCCL_AUTH_KEY is not set" in proc.stderr


def test_omp_num_threads_kept(job):
    proc, infos = job("--nproc-per-node", "2", env={"OMP_NUM_THREADS": "3"})
    assert {i["OMP_NUM_THREADS"] for i in infos.values()} == {"3"}


SLURM_TASK = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "2",
    "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_TASKS_PER_NODE": "2(x2)",
}


def test_srun_task_is_exec_once(job):
    proc, infos = job(env=SLURM_TASK, script_args=("x",))
    assert proc.returncode == 0, proc.stderr
    assert sorted(infos) == [3]
    info = infos[3]
    assert info["WORLD_SIZE"] == "4" and info["LOCAL_RANK"] == "1"
    assert info["LOCAL_WORLD_SIZE"] == "2" and info["GROUP_RANK"] == "1"
    assert info["MASTER_ADDR"] == "node07" and info["MASTER_PORT"] == str(20000 + 4242)
    assert info["XCCL_AUTH_KEY"] is None and info["argv"] == ["x"]


def test_srun_uneven_nodes_local_world_size(job):
    # 3 tasks on node 0 and 1 on node 1 (SLURM_STEP_TASKS_PER_NODE="3,1"): each task's
    # LOCAL_WORLD_SIZE is its own node's count, not WORLD_SIZE / nodes (found by the
    # tests/hosts harness, which starts unequal hosts this way)
    for procid, localid, nodeid, local_world in (("2", "2", "0", "3"), ("3", "0", "1", "1")):
        env = dict(SLURM_TASK, SLURM_PROCID=procid, SLURM_LOCALID=localid, SLURM_NODEID=nodeid,
                   SLURM_STEP_TASKS_PER_NODE="3,1")
        proc, infos = job(env=env)
        assert proc.returncode == 0, proc.stderr
        assert infos[int(procid)]["LOCAL_WORLD_SIZE"] == local_world
        assert infos[int(procid)]["LOCAL_RANK"] == localid


def test_slurm_tasks_on_node():
    from xccl.run import slurm_tasks_on_node

    assert [slurm_tasks_on_node("2(x3),1", n) for n in range(5)] == [2, 2, 2, 1, None]
    assert slurm_tasks_on_node("3,1", 1) == 1 and slurm_tasks_on_node("4", 0) == 4
    assert slurm_tasks_on_node("2(x", 0) is None and slurm_tasks_on_node("", 0) is None


def test_srun_exec_replaces_the_launcher(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "s.py").write_text(ENV_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN_ENV_PREFIXES)}
    env.update(SLURM_TASK, TEST_OUT=str(out), MASTER_ADDR="head", MASTER_PORT="1234")
    proc = subprocess.Popen(
        LAUNCHER + [str(tmp_path / "s.py")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.communicate(timeout=60)
    info = json.loads((out / "rank3.json").read_text())
    assert proc.returncode == 0
    assert info["pid"] == proc.pid  # exec, not a child
    assert info["MASTER_ADDR"] == "head" and info["MASTER_PORT"] == "1234"


def test_srun_single_task_spawns(job):
    env = dict(
        SLURM_TASK,
        SLURM_PROCID="0",
        SLURM_NTASKS="1",
        SLURM_NNODES="1",
        SLURM_NODEID="0",
        SLURM_LOCALID="0",
        SLURM_TASKS_PER_NODE="1",
    )
    proc, infos = job("--nproc-per-node", "2", env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(infos) == [0, 1]
    assert infos[0]["MASTER_ADDR"] == "127.0.0.1"


def test_srun_one_launcher_per_node(job):
    env = dict(
        SLURM_TASK,
        SLURM_PROCID="1",
        SLURM_NTASKS="2",
        SLURM_LOCALID="0",
        SLURM_TASKS_PER_NODE="1(x2)",
        XCCL_AUTH_KEY="k",
    )
    proc, infos = job("--nproc-per-node", "3", env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(infos) == [3, 4, 5]
    assert {i["WORLD_SIZE"] for i in infos.values()} == {"6"}
    assert {i["MASTER_ADDR"] for i in infos.values()} == {"node07"}
    assert {i["MASTER_PORT"] for i in infos.values()} == {str(20000 + 4242)}
    proc, infos = job("--nproc-per-node", "3", env=SLURM_TASK)  # 4 tasks on 2 nodes
    assert proc.returncode == 2 and "--ntasks-per-node=1" in proc.stderr


def test_mpirun_task_is_exec_once(job):
    env = {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_SIZE": "6",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
        "MASTER_ADDR": "host0",
    }
    proc, infos = job(env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(infos) == [5]
    info = infos[5]
    assert info["WORLD_SIZE"] == "6" and info["LOCAL_RANK"] == "2"
    assert info["LOCAL_WORLD_SIZE"] == "3" and info["GROUP_RANK"] == "1"
    assert info["MASTER_ADDR"] == "host0" and info["MASTER_PORT"] == "29500"


def test_mpirun_needs_master_addr_across_hosts(job):
    env = {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    proc, _ = job(env=env)
    assert proc.returncode == 2 and "--master-addr" in proc.stderr
    proc, infos = job("--master-addr", "h0", "--master-port", "4000", env=env)
    assert proc.returncode == 0, proc.stderr
    assert infos[0]["MASTER_ADDR"] == "h0" and infos[0]["MASTER_PORT"] == "4000"
    assert "XCCL_AUTH_KEY is not set" in proc.stderr


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("node[007-010,12],gpu1", "node007"),
        ("a1,b2", "a1"),
        ("gpu[3]", "gpu3"),
        ("x[1-2]-ib,y", "x1-ib"),
        ("single", "single"),
        ("c[5,1-3]", "c5"),
    ],
)
def test_first_slurm_host(nodelist, first):
    assert run_mod.first_slurm_host(nodelist) == first


def test_entry_points(job):
    proc, infos = job("--nproc-per-node", "2", cmd=[sys.executable, "-m", "xccl.run"])
    assert proc.returncode == 0, proc.stderr
    assert sorted(infos) == [0, 1]
    exe = shutil.which("xccl-run")
    if exe is None:
        pytest.skip("xccl-run is not on PATH (package not installed)")
    proc, infos = job("--nproc-per-node", "2", cmd=[exe])
    assert proc.returncode == 0, proc.stderr
    assert sorted(infos) == [0, 1]


CLEAN_END_SCRIPT = """
import numpy as np
import xccl

xccl.init_process_group(backend="xccl")
x = np.ones(4, np.float32)
xccl.all_reduce(x)
assert x[0] == xccl.get_world_size()
xccl.destroy_process_group()
"""


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_clean_end_logs_no_warning(tmp_path, transport):
    """Ranks that finish and leave in any order are a normal end of job: with XCCL_DEBUG=WARN
    nothing is logged (a peer that leaves warns only when something pending on it fails)."""
    script = tmp_path / "clean_end.py"
    script.write_text(CLEAN_END_SCRIPT)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(CLEAN_ENV_PREFIXES) and k not in CLEAN_ENV_NAMES
    }
    env.update(XCCL_DEBUG="WARN", XCCL_TRANSPORTS=transport)
    proc = subprocess.run(
        [*LAUNCHER, "--nproc-per-node", "3", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    assert "WARN" not in proc.stderr, proc.stderr
