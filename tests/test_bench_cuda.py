"""xccl-bench --device cuda without a GPU: the clear error, the choice of tensor library and
GPU, and the device timing logic of the xccl runner (calls posted with async_op=True and
waited for, loops timed until settled) on a
fake one-rank library whose "device" buffers are numpy arrays. Quick."""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import pytest

bench = importlib.import_module("xccl.bench")


def _gpu_usable() -> bool:
    for kind in ("torch", "cupy"):
        try:
            if bench.cuda_devices(kind) > 0:
                return True
        except ImportError:
            continue
    return False


# --- command line -----------------------------------------------------------------------------


def test_device_cuda_without_gpu_fails_clearly() -> None:
    if _gpu_usable():
        pytest.skip("this machine has a GPU")
    cmd = [sys.executable, "-m", "xccl.bench", "--np", "2", "--device", "cuda"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "xccl-bench: --device cuda: no usable GPU: " in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "cuda", "--tensor", "numpy"], "not numpy"),
        (["--device", "cuda", "--tensor", "cupy", "--backend", "gloo"], "torch tensors only"),
        (["--tensor", "cupy"], "add --device cuda"),
        (["--device", "tpu"], "invalid choice"),
    ],
)
def test_device_argument_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        bench.main(["--np", "2", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_tensor_kind_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    f32, bf16 = bench.DTYPES["float32"], bench.DTYPES["bfloat16"]
    kind = bench.tensor_kind
    assert kind("auto", "xccl", f32, "cpu") == "numpy"
    assert kind("auto", "gloo", f32, "cuda") == "torch"
    assert kind("cupy", "xccl", f32, "cuda") == "cupy"
    with pytest.raises(ValueError, match="CuPy has no bfloat16"):
        kind("cupy", "xccl", bf16, "cuda")
    # without torch, xccl's buffers come from CuPy when it is there
    monkeypatch.setattr(bench, "_importable", lambda m: m == "cupy")
    assert kind("auto", "xccl", f32, "cuda") == "cupy"
    assert kind("auto", "xccl", bf16, "cuda") == "torch"  # only torch has bfloat16
    monkeypatch.setattr(bench, "_importable", lambda m: m == "torch")
    assert kind("auto", "xccl", f32, "cuda") == "torch"


def test_rank_device_is_local_rank_modulo_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    for local, ndev, want in ((0, 1, 0), (3, 1, 0), (3, 2, 1), (5, 8, 5)):
        monkeypatch.setenv("LOCAL_RANK", str(local))
        assert bench.rank_device(ndev) == want
    monkeypatch.delenv("LOCAL_RANK")
    assert bench.rank_device(4) == 0
    with pytest.raises(ValueError):
        bench.rank_device(0)


def test_arrays_refuse_host_libraries_on_a_device() -> None:
    with pytest.raises(ValueError, match="host memory"):
        bench.Arrays("numpy", device=0)
    with pytest.raises(ValueError, match="CuPy arrays live on a GPU"):
        bench.Arrays("cupy")
    assert not bench.Arrays("numpy").on_device


# --- the xccl runner's device path on a fake library ------------------------------------------


class _Work:
    def __init__(self, log: list[tuple[str, str]], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> bool:
        self.log.append(("wait", self.name))
        return True

    def synchronize(self) -> None:
        self.log.append(("sync", self.name))


class _FakeXccl:
    """One rank of a library with xccl's API whose calls complete at once; a call made with
    async_op=True returns a Work that logs wait() and synchronize()."""

    ReduceOp = SimpleNamespace(SUM="sum", PRODUCT="prod", MIN="min", MAX="max", AVG="avg")

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.count = 0
        self.group = SimpleNamespace(WORLD=SimpleNamespace(comm=self))

    def _op(self, name: str, async_op: bool) -> Optional[_Work]:
        self.count += 1
        self.log.append(("post", f"{name}{self.count}"))
        return _Work(self.log, f"{name}{self.count}") if async_op else None

    def all_reduce(self, t: Any, op: Any = "sum", async_op: bool = False) -> Optional[_Work]:
        return self._op("all_reduce", async_op)  # one rank: the input is the result

    def broadcast(self, t: Any, src: int, async_op: bool = False) -> Optional[_Work]:
        return self._op("broadcast", async_op)

    def all_gather_into_tensor(self, out: Any, inp: Any, async_op: bool = False) -> Any:
        out[:] = inp
        return self._op("all_gather", async_op)

    def isend(self, t: Any, dst: int) -> _Work:
        work = self._op("isend", True)
        assert work is not None
        return work

    def irecv(self, t: Any, src: int) -> _Work:
        work = self._op("irecv", True)
        assert work is not None
        return work

    def barrier(self) -> None:
        self.log.append(("barrier", ""))

    def all_gather_object(self, out: list[Any], obj: Any) -> None:
        out[0] = obj

    def peer_transport(self, peer: int) -> str:
        return "fake"


class _DeviceArrays(bench.Arrays):
    """numpy arrays standing in for device buffers; synchronize() is logged."""

    def __init__(self, log: list[tuple[str, str]]) -> None:
        super().__init__("numpy")
        self.device = 0
        self.log = log

    def synchronize(self) -> None:
        self.log.append(("device sync", ""))

    def device_name(self) -> str:
        return "Fake GPU"


def _runner(rank: int = 0, size: int = 1) -> tuple[Any, _FakeXccl]:
    fake = _FakeXccl()
    runner = bench.TorchApiRunner("xccl", _DeviceArrays(fake.log), None)
    runner.dist = fake
    runner.rank, runner.size = rank, size
    return runner, fake


def _buf(n: int = 4) -> Any:
    return np.zeros(n, dtype=np.float32)


def test_device_calls_are_async_and_waited_on_the_stream() -> None:
    runner, fake = _runner()
    fn = runner.prepare("all_reduce", _buf(), _buf(), 0, "sum", True)
    assert fn is not None
    fn()
    assert fake.log == [("post", "all_reduce1"), ("wait", "all_reduce1")]  # no CPU block
    # forms the device path leaves out
    assert runner.prepare("all_reduce", _buf(), _buf(), 0, "sum", False) is None
    assert runner.prepare("broadcast", _buf(), _buf(), 0, "sum", False) is None
    assert runner.prepare("all_to_all", _buf(), _buf(), 0, "sum", True) is None


def test_sendrecv_posts_both_before_waiting() -> None:
    runner, fake = _runner(rank=1, size=3)
    fn = runner.prepare("sendrecv", _buf(), _buf(), 0, "sum", False)
    assert fn is not None
    fn()
    assert fake.log == [
        ("post", "isend1"),
        ("post", "irecv2"),
        ("wait", "isend1"),
        ("wait", "irecv2"),
    ]


@pytest.mark.parametrize("rank, first, second", [(0, "isend", "irecv"), (1, "irecv", "isend")])
def test_pingpong_chains_through_the_stream(rank: int, first: str, second: str) -> None:
    runner, fake = _runner(rank=rank, size=2)
    fn = runner.prepare("pingpong", _buf(), _buf(), 0, "sum", False)
    assert fn is not None
    fn()
    assert fake.log == [
        ("post", f"{first}1"),
        ("wait", f"{first}1"),
        ("post", f"{second}2"),
        ("wait", f"{second}2"),
    ]
    runner3, fake3 = _runner(rank=2, size=3)  # the odd rank out posts nothing
    idle = runner3.prepare("pingpong", _buf(), _buf(), 0, "sum", False)
    assert idle is not None
    idle()
    assert fake3.log == []


def test_every_loop_is_timed_until_settled() -> None:
    runner, fake = _runner()
    opts = bench.Options(
        ops=["all_reduce"],
        sizes=[16],
        dtype=bench.DTYPES["float32"],
        redop="sum",
        root=0,
        iters=2,
        warmup=1,
        check=0,
        average=1,
        mintime=0.0,
        placement="in",
        progress=False,
        json_path=None,
        command="test",
    )
    lay = bench.layout("all_reduce", 16, 4, 1)
    fn = runner.prepare("all_reduce", _buf(), _buf(), 0, "sum", True)
    fake.log.clear()
    res = bench._measure(runner, fn, "all_reduce", lay, opts, _buf(), _buf(), True)
    assert res.iters == 2 and res.wrong is None
    steps = [what for what, _ in fake.log if what in ("post", "device sync", "barrier")]
    # settled, barrier, warm-up, settled; settled, barrier, 2 timed calls, settled
    assert steps[:9] == [
        "device sync",
        "barrier",
        "post",
        "device sync",
        "device sync",
        "barrier",
        "post",
        "post",
        "device sync",
    ]


def test_whole_harness_on_fake_device(capsys: pytest.CaptureFixture[str]) -> None:
    """run_benchmarks end to end through the device path: checked, no element wrong, the
    header names the GPU."""
    runner, fake = _runner()
    opts = bench.Options(
        ops=["all_reduce", "all_gather", "broadcast"],
        sizes=[8, 1000],
        dtype=bench.DTYPES["float32"],
        redop="sum",
        root=0,
        iters=3,
        warmup=1,
        check=1,
        average=1,
        mintime=0.0,
        placement="primary",
        progress=False,
        json_path=None,
        command="test",
    )
    assert bench.run_benchmarks(runner, opts) == 0
    out = capsys.readouterr().out
    assert "device cuda:0" in out and "gpu Fake GPU" in out
    assert out.count("# Out of bounds values : 0 OK") == 3


# --- the device paths with the real libraries, host tensors standing in for device ones -------

_RANK_SCRIPT = """
import sys
import xccl.bench as bench

class HostAsDevice(bench.Arrays):
    def __init__(self):
        super().__init__("torch")
        self.device = 0  # the device code paths, on host tensors
    def empty(self, count, dtype):
        import torch
        return torch.zeros(count, dtype=getattr(torch, dtype.torch))
    def synchronize(self):
        pass
    def device_name(self):
        return "host standing in"

backend, rank, init = sys.argv[1], int(sys.argv[2]), sys.argv[3]
runner = bench.TorchApiRunner(backend, HostAsDevice(), None)
runner.init(init, rank, 2, 60.0)
opts = bench.Options(
    ops=list(bench.ALL_OPS), sizes=[8, 4096], dtype=bench.DTYPES["float32"], redop="sum",
    root=1, iters=12, warmup=1, check=1, average=1, mintime=0.0, placement="both",
    progress=False, json_path=None, command="test",
)
status = bench.run_benchmarks(runner, opts)
runner.close()
sys.exit(status)
"""


@pytest.mark.parametrize("backend", ["xccl", "gloo"])
def test_device_paths_with_the_real_library(backend: str, tmp_path: Any) -> None:
    """xccl's device path (async_op=True, Work.wait, synchronize) and gloo's
    staged send/recv against the real libraries, 2 ranks, every operation checked."""
    import os

    init = f"file://{tmp_path}/store"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT, backend, str(r), init],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    table = outs[0]
    assert "device cuda:0" in table
    assert table.count("# Out of bounds values : 0 OK") == len(bench.ALL_OPS), table
