"""``xccl-bench``: measure collectives the way nccl-tests does, on xccl or on torch's gloo.

Usage::

    xccl-bench --np 2 -b 8 -e 128M -f 4 -o all_reduce          # spawns 2 local ranks
    xccl-bench --np 4 -b 8 -e 128M -f 4 -o all                  # every collective, one run
    xccl-bench --np 2 -o allgather --transport tcp              # TCP only (XCCL_TRANSPORTS)
    xccl-bench --np 2 -o allreduce --algo ring                  # force an xccl algorithm
    xccl-bench --np 2 -o allreduce --backend gloo               # the same loop on gloo
    xccl-bench --np 2 -o all --device cuda                      # CUDA tensors (GPU 0 shared)
    xccl-run --nproc-per-node 4 -m xccl.bench -o all_gather      # under a launcher (env://)
    python -m xccl.bench ...                                    # the same as xccl-bench

Flags follow nccl-tests: ``-b/--minbytes``, ``-e/--maxbytes`` (K/M/G suffixes, powers of
1024), ``-f/--stepfactor`` or ``-i/--stepbytes``, ``-n/--iters``, ``-w/--warmup_iters``,
``-c/--check``, ``-d/--datatype``, ``-r/--root``, ``-a/--average``, ``-T/--timeout``. Two
differ: ``-o/--op`` names the collective (a comma list, or ``all``) and ``--redop`` the
reduction, because one program here runs every collective. The last size is always
``maxbytes``, even when the steps do not land on it.

Output, on rank 0's stdout, is nccl-tests' table, one per collective::

    size(B) count(elements) type redop root | time(us) algbw(GB/s) busbw(GB/s) #wrong | in-place

- *size* is the largest buffer of the operation (all_gather: the gathered output;
  reduce_scatter and all_to_all: the input), *count* the count argument of the call
  (all_gather, reduce_scatter: one rank's share; all_to_all: what goes to one peer).
- *time* is the mean time of one iteration over ``-n`` timed iterations that follow ``-w``
  warm-up iterations, combined across ranks by ``-a`` (default: the mean over ranks; JSON
  also has the min and max over ranks). Iterations run back to back and each call blocks,
  as a CPU program calls them; a barrier precedes each timed loop.
- *algbw* = size / time; *busbw* = algbw times nccl-tests' factor: all_reduce 2(n-1)/n;
  all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce, sendrecv, pingpong 1.
- *#wrong* counts elements that differ from the analytically known result after ``-c``
  checked calls (rank-dependent inputs; reductions compared exactly for integers and within
  n rounding steps for floating point); ``N/A`` without ``-c``.
- out-of-place and in-place blocks: ``N/A`` where the API has no such form (torch.distributed
  has only in-place all_reduce, broadcast and reduce; xccl's out-of-place all_reduce and
  reduce call the communicator directly).

Two point-to-point tests: ``sendrecv`` (nccl-tests: every rank sends to rank+1 and receives
from rank-1 at once) and ``pingpong`` (ranks 2k and 2k+1 bounce a message; time is half a
round trip, the one-way latency of the OSU benchmarks).

GPUs (``--device cuda``): the buffers are CUDA tensors (torch, or CuPy arrays where torch is
missing) on the rank's GPU, ``LOCAL_RANK`` modulo the GPUs it sees (ranks share GPU 0 when
there is one). Times are nccl-tests': calls are posted back to back and a loop's time runs
until the device has finished its last call (xccl: ``async_op=True`` and ``Work.wait()``,
which returns once the operation finished on the GPU - see ``xccl.cuda``, Streams; gloo: its
usual blocking calls, which copy through host memory). Fills and checks run on the current
stream. gloo has no CUDA send/recv, so its
sendrecv and pingpong copy through pinned host buffers in the harness. xccl's out-of-place
all_reduce and reduce are N/A there. Without a usable GPU the command stops at once with the
reason (exit status 2).

Ranks: with ``RANK`` in the environment (xccl-run, torchrun) this process is one rank and
meets the others through ``--init-method`` (default ``env://``); otherwise it starts
``--np`` local ranks itself, which meet through a file store in a temporary directory.
``--json PATH`` writes every row, machine-readable (see :func:`write_json`).

The harness is independent of the library measured: :class:`Runner` is the adapter, and
``benchmarks/mpi_bench.py`` runs the same harness on MPI through mpi4py.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import json
import math
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, TextIO

PROG = "xccl-bench"
VERSION = "0.1.0"
_COMMAND_VAR = "_XCCL_BENCH_COMMAND"  # private: the spawning command, for the header
# What spawned ranks run (the same as ``python -m xccl.bench``).
_RANK_MAIN = "import sys; from xccl.bench import main; sys.exit(main())"

# --------------------------------------------------------------------------------------------
# Collectives, data types, reductions
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One benchmarked operation: its names and nccl-tests' conventions for it."""

    name: str  # canonical name, as in the table title and JSON
    aliases: tuple[str, ...]  # other accepted spellings (nccl-tests' binary names included)
    reduces: bool  # takes a reduction (redop column)
    rooted: bool  # takes a root (root column)
    min_ranks: int  # fewer ranks: skipped


OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec("all_reduce", ("allreduce",), True, False, 1),
        OpSpec("all_gather", ("allgather", "all_gather_into_tensor"), False, False, 1),
        OpSpec("reduce_scatter", ("reducescatter", "reduce_scatter_tensor"), True, False, 1),
        OpSpec("broadcast", ("bcast",), False, True, 1),
        OpSpec("reduce", (), True, True, 1),
        OpSpec("all_to_all", ("alltoall", "all_to_all_single"), False, False, 1),
        OpSpec("sendrecv", ("send_recv",), False, False, 2),
        OpSpec("pingpong", ("ping_pong", "latency"), False, False, 2),
    )
}

# The order of ``-o all``.
ALL_OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "sendrecv",
    "pingpong",
)

# The placement a torch.distributed program uses, for comparisons that keep one column.
PRIMARY_PLACEMENT = {
    "all_reduce": "in",
    "broadcast": "in",
    "reduce": "in",
    "all_gather": "out",
    "reduce_scatter": "out",
    "all_to_all": "out",
    "sendrecv": "out",
    "pingpong": "out",
}


def bus_factor(op: str, nranks: int) -> float:
    """nccl-tests' busbw / algbw ratio for `op` on `nranks` ranks."""
    n = nranks
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def canonical_op(name: str) -> str:
    """The canonical name of an operation given by any accepted spelling."""
    key = name.strip().lower().replace("-", "_")
    for spec in OPS.values():
        if (
            key == spec.name
            or key in spec.aliases
            or key.replace("_", "") == spec.name.replace("_", "")
        ):
            return spec.name
    valid = ", ".join(OPS)
    raise ValueError(f"unknown operation {name!r}; valid: {valid}, all")


def parse_ops(text: str) -> list[str]:
    """``-o`` argument: one name, a comma list, or ``all``."""
    out: list[str] = []
    for part in text.split(","):
        if not part.strip():
            continue
        names = ALL_OPS if part.strip().lower() == "all" else (canonical_op(part),)
        for name in names:
            if name not in out:
                out.append(name)
    if not out:
        raise ValueError("no operation given")
    return out


@dataclasses.dataclass(frozen=True)
class DType:
    """A buffer element type: xccl's name, its numpy and torch names, its nccl-tests name."""

    name: str  # "float32"
    numpy: Optional[str]  # None: numpy has no such type (bfloat16)
    torch: str
    itemsize: int
    floating: bool
    label: str  # the type column, as nccl-tests prints it


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("int8", "int8", "int8", 1, False, "int8"),
        DType("uint8", "uint8", "uint8", 1, False, "uint8"),
        DType("int32", "int32", "int32", 4, False, "int32"),
        DType("int64", "int64", "int64", 8, False, "int64"),
        DType("float16", "float16", "float16", 2, True, "half"),
        DType("bfloat16", None, "bfloat16", 2, True, "bfloat16"),
        DType("float32", "float32", "float32", 4, True, "float"),
        DType("float64", "float64", "float64", 8, True, "double"),
    )
}

_DTYPE_ALIASES = {
    "char": "int8",
    "int": "int32",
    "long": "int64",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "float": "float32",
    "fp32": "float32",
    "double": "float64",
    "fp64": "float64",
}

# Relative precision (one rounding step) of each floating type.
_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}

REDOPS = ("sum", "prod", "min", "max", "avg")


def parse_dtype(name: str) -> DType:
    """``-d`` argument: an xccl, numpy, torch or nccl-tests type name."""
    key = name.strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        valid = ", ".join(list(DTYPES) + list(_DTYPE_ALIASES))
        raise ValueError(f"unknown data type {name!r}; valid: {valid}")
    return DTYPES[key]


def parse_size(text: str) -> int:
    """A byte count with an optional K/M/G suffix (powers of 1024), as nccl-tests reads it."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)[iI]?[bB]?\s*", text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (e.g. 8, 4K, 32M, 1G)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    return int(m.group(1)) * scale


def human_size(nbytes: int) -> str:
    """8 B, 4 KiB, 32 MiB (exact multiples only get a unit)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def size_list(minbytes: int, maxbytes: int, stepfactor: float, stepbytes: int) -> list[int]:
    """The sizes of a sweep: geometric with `stepfactor` > 1, else arithmetic with `stepbytes`;
    `maxbytes` is always the last one."""
    if minbytes > maxbytes:
        raise ValueError(f"minbytes ({minbytes}) is larger than maxbytes ({maxbytes})")
    sizes: list[int] = []
    size = minbytes
    while size <= maxbytes:
        sizes.append(size)
        if stepfactor > 1:
            nxt = int(size * stepfactor)
            size = nxt if nxt > size else size + 1
        elif stepbytes > 0:
            size += stepbytes
        else:
            break
    if not sizes or sizes[-1] != maxbytes:
        sizes.append(maxbytes)
    return sizes


# --------------------------------------------------------------------------------------------
# Buffer layouts and reference values
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """Element counts of one operation at one size (nccl-tests' conventions)."""

    count: int  # the call's count argument (the table's count column)
    send: int  # elements of the input buffer
    recv: int  # elements of the output buffer
    nbytes: int  # the table's size column: the larger buffer, in bytes


def layout(op: str, nbytes: int, itemsize: int, nranks: int) -> Layout:
    """The buffers of `op` for a requested size of `nbytes`. Per-rank shares are rounded down,
    to at least one element, so the size column may differ slightly from the request."""
    total = max(1, nbytes // itemsize)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        share = max(1, total // nranks)
        whole = share * nranks
        if op == "all_gather":
            return Layout(share, share, whole, whole * itemsize)
        if op == "reduce_scatter":
            return Layout(share, whole, share, whole * itemsize)
        return Layout(share, whole, whole, whole * itemsize)
    return Layout(total, total, total, total * itemsize)


# Inputs are small positive integers, exact in every type: rank r's input element i is
#     value(r, i) = (i + 3 r) mod PERIOD + 1
# so every expected output is periodic in i, and a check is PERIOD strided comparisons.
PERIOD = 11


def _value(rank: int, index: int) -> int:
    return (index + 3 * rank) % PERIOD + 1


def _reduce_ints(values: list[int], redop: str, dtype: DType) -> float:
    """The reduction of small integers as the type computes it (integers wrap around)."""
    if redop == "sum" or redop == "avg":
        acc = sum(values)
    elif redop == "prod":
        acc = math.prod(values)
    elif redop == "min":
        acc = min(values)
    else:
        acc = max(values)
    if not dtype.floating:
        bits = 8 * dtype.itemsize
        acc %= 1 << bits
        if dtype.name != "uint8" and acc >= 1 << (bits - 1):
            acc -= 1 << bits
        return float(acc)
    if redop == "avg":
        return acc / len(values)
    return float(acc)


class Arrays:
    """The few array operations the harness needs, on numpy arrays or torch tensors in host
    memory, or on torch tensors or CuPy arrays on CUDA device `device`.

    Device buffers are used on the current stream of their library (torch's or CuPy's):
    fills and checks are queued there, so they are ordered with the operations that the
    runners order after that stream and make that stream wait for."""

    KINDS = ("numpy", "torch", "cupy")

    def __init__(self, kind: str, device: Optional[int] = None) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"unknown tensor library {kind!r}: numpy, torch or cupy")
        if kind == "numpy" and device is not None:
            raise ValueError("numpy arrays live in host memory: use torch or cupy on a GPU")
        if kind == "cupy" and device is None:
            raise ValueError("CuPy arrays live on a GPU: give the CUDA device")
        self.kind = kind
        self.device = device
        if kind == "torch":
            import torch

            self._mod: Any = torch
        elif kind == "cupy":
            import cupy

            self._mod = cupy
        else:
            import numpy

            self._mod = numpy

    @property
    def on_device(self) -> bool:
        """True when the buffers are in CUDA device memory."""
        return self.device is not None

    def empty(self, count: int, dtype: DType) -> Any:
        """A new 1-D buffer of `count` zeroed elements (every page touched)."""
        if self.kind == "torch":
            where = "cpu" if self.device is None else f"cuda:{self.device}"
            return self._mod.zeros(count, dtype=getattr(self._mod, dtype.torch), device=where)
        if dtype.numpy is None:
            raise ValueError(f"{self.kind} has no {dtype.name}: use --tensor torch")
        if self.kind == "cupy":
            with self._mod.cuda.Device(self.device):
                return self._mod.zeros(count, dtype=dtype.numpy)
        return self._mod.zeros(count, dtype=dtype.numpy)

    def scalar_in(self, value: float, dtype: DType) -> float:
        """`value` rounded to `dtype`, as a Python float (computed on the host)."""
        if self.kind == "torch":
            t = self._mod.tensor([value], dtype=getattr(self._mod, dtype.torch))
            return float(t.to(self._mod.float64)[0])
        import numpy

        return float(numpy.array([value]).astype(dtype.numpy)[0])

    def host_floats(self, values: list[float]) -> Any:
        """`values` as a float64 buffer in host memory (for the harness's own collectives)."""
        if self.kind == "torch":
            return self._mod.tensor(values, dtype=self._mod.float64)
        import numpy

        return numpy.array(values, dtype=numpy.float64)

    def synchronize(self) -> None:
        """Blocks until the device has finished everything queued on it by this process (the
        buffers' device; nothing for host memory)."""
        if self.device is None:
            return
        if self.kind == "torch":
            self._mod.cuda.synchronize(self.device)
        else:
            self._mod.cuda.Device(self.device).synchronize()

    def device_name(self) -> str:
        """The name of the buffers' GPU ("" for host memory)."""
        if self.device is None:
            return ""
        if self.kind == "torch":
            return str(self._mod.cuda.get_device_name(self.device))
        name = self._mod.cuda.runtime.getDeviceProperties(self.device)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

    @staticmethod
    def fill(buf: Any, value: float) -> None:
        """Sets every element of `buf` (a view) to `value`."""
        buf[:] = value

    @staticmethod
    def count_wrong(buf: Any, expected: float, tol: float) -> int:
        """Elements of `buf` (a view) that differ from `expected` by more than `tol` (for a
        device buffer: counted on the device, after the work queued on the current stream)."""
        if buf.shape[0] == 0:
            return 0
        if tol == 0.0 or math.isinf(expected):
            return int((buf != expected).sum())
        return int((~(abs(buf - expected) <= tol)).sum())


def fill_input(arrays: Arrays, buf: Any, rank: int, start: int = 0) -> None:
    """Writes rank `rank`'s input elements start .. start+len(buf) into `buf`."""
    for k in range(min(PERIOD, buf.shape[0])):
        arrays.fill(buf[k::PERIOD], _value(rank, start + k))


def _expected_blocks(
    op: str, lay: Layout, rank: int, nranks: int, root: int, redop: str, dtype: DType
) -> list[tuple[int, int, list[float]]]:
    """Where the output buffer of `op` on `rank` is checked, and against which values."""
    ranks = range(nranks)

    def reduced(start: int) -> list[float]:
        return [
            _reduce_ints([_value(r, start + k) for r in ranks], redop, dtype) for k in range(PERIOD)
        ]

    def inputs(src: int, start: int) -> list[float]:
        return [float(_value(src, start + k)) for k in range(PERIOD)]

    if op == "all_reduce":
        return [(0, lay.recv, reduced(0))]
    if op == "reduce":
        return [(0, lay.recv, reduced(0))] if rank == root else []
    if op == "reduce_scatter":
        return [(0, lay.recv, reduced(rank * lay.count))]
    if op == "all_gather":
        return [(j * lay.count, lay.count, inputs(j, 0)) for j in ranks]
    if op == "all_to_all":
        return [(j * lay.count, lay.count, inputs(j, rank * lay.count)) for j in ranks]
    if op == "broadcast":
        return [(0, lay.recv, inputs(root, 0))]
    if op == "sendrecv":
        return [(0, lay.recv, inputs((rank - 1) % nranks, 0))]
    if op == "pingpong":
        peer = pingpong_peer(rank, nranks)
        return [] if peer is None else [(0, lay.recv, inputs(peer, 0))]
    raise ValueError(op)


def pingpong_peer(rank: int, nranks: int) -> Optional[int]:
    """The partner of `rank` in the pingpong test (pairs 0-1, 2-3, ...); None: idle."""
    peer = rank ^ 1
    return peer if peer < nranks else None


# --------------------------------------------------------------------------------------------
# Runners: the adapter between the harness and a library
# --------------------------------------------------------------------------------------------


class Runner:
    """A library under test. Subclasses bind buffers to one blocking call (:meth:`prepare`)
    and give the harness the small collectives it needs for itself."""

    name = "?"  # "xccl", "gloo", "mpi": the backend column of JSON rows
    rank = 0
    size = 1
    arrays: Arrays

    def prepare(
        self, op: str, sbuf: Any, rbuf: Any, root: int, redop: str, inplace: bool
    ) -> Optional[Callable[[], None]]:
        """A function that runs `op` once, blocking, on these buffers (for in-place forms
        `sbuf` is a view into `rbuf`, or `rbuf` itself); None if the library has no such
        form."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Blocks until every rank called it."""
        raise NotImplementedError

    def allreduce_floats(self, values: list[float], how: str) -> list[float]:
        """Element-wise ``sum`` or ``max`` of `values` over the ranks."""
        raise NotImplementedError

    def gather_strings(self, text: str) -> list[str]:
        """Every rank's `text`, in rank order (on every rank)."""
        raise NotImplementedError

    def settle(self) -> None:
        """Returns once every operation posted so far has completed, device work included
        (nothing to do where each call blocks until its operation is complete)."""

    def describe(self) -> dict[str, Any]:
        """Facts for the header and JSON (transport, versions)."""
        return {}

    def close(self, ok: bool = True) -> None:
        """Leaves the job: after a final barrier if `ok`, at once after an error (the other
        ranks may never get there)."""


class TorchApiRunner(Runner):
    """xccl or torch.distributed (gloo) through the torch.distributed API; both take the
    same calls, except the ``algo=`` keyword and out-of-place all_reduce/reduce (xccl's
    communicator).

    On CUDA buffers (``arrays.on_device``) the loop measures what nccl-tests measures: calls
    are posted back to back and the time runs until the device has finished the last one.
    xccl's calls are posted with ``async_op=True`` and ``Work.wait()``, which returns once the
    operation finished on the GPU (the next call is ordered after it). gloo's calls block the
    CPU while gloo copies through host memory, and make the current stream wait for the copy
    back. gloo has no CUDA send/recv (it would hand the device pointer to its TCP transport):
    its point-to-point tests copy through pinned host buffers here, as its collectives do."""

    def __init__(self, backend: str, arrays: Arrays, algo: Optional[str]) -> None:
        self.name = backend
        self.arrays = arrays
        self.algo = algo
        if backend == "xccl":
            import xccl as dist

            self.dist: Any = dist
        else:
            import torch.distributed as tdist

            self.dist = tdist
        self._kw: dict[str, Any] = {} if algo is None else {"algo": algo}

    def init(self, init_method: str, rank: int, world_size: int, timeout_s: float) -> None:
        """Joins the job (init_process_group)."""
        from datetime import timedelta

        backend = "auto" if self.name == "xccl" else "gloo"
        self.dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        self.rank = self.dist.get_rank()
        self.size = self.dist.get_world_size()

    def _redop(self, redop: str) -> Any:
        return {
            "sum": self.dist.ReduceOp.SUM,
            "prod": self.dist.ReduceOp.PRODUCT,
            "min": self.dist.ReduceOp.MIN,
            "max": self.dist.ReduceOp.MAX,
            "avg": self.dist.ReduceOp.AVG,
        }[redop]

    def prepare(
        self, op: str, sbuf: Any, rbuf: Any, root: int, redop: str, inplace: bool
    ) -> Optional[Callable[[], None]]:
        if self.arrays.on_device:
            if self.name == "xccl":
                return self._prepare_device(op, sbuf, rbuf, root, redop, inplace)
            if op in ("sendrecv", "pingpong"):
                return self._prepare_staged_p2p(op, sbuf, rbuf, inplace)
        d = self.dist
        rop = self._redop(redop)

        def api(fn: Callable[..., Any]) -> Callable[..., Any]:
            # algo= bound once: a call with **kwargs costs ~60 ns more, which the MPI
            # harness's calls do not pay
            return functools.partial(fn, **self._kw) if self._kw else fn

        if op == "all_reduce":
            if inplace:
                fn = api(d.all_reduce)
                return lambda: fn(rbuf, rop)
            return self._xccl_direct("allreduce", sbuf, rbuf, redop, None)
        if op == "reduce":
            if inplace:
                fn = api(d.reduce)
                return lambda: fn(rbuf, root, rop)
            return self._xccl_direct("reduce", sbuf, rbuf, redop, root)
        if op == "broadcast":
            fn = api(d.broadcast)
            return (lambda: fn(rbuf, root)) if inplace else None
        if op == "all_gather":
            # torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single.
            fn = api(getattr(d, "all_gather_single", None) or d.all_gather_into_tensor)
            return lambda: fn(rbuf, sbuf)
        if op == "reduce_scatter":
            fn = api(getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor)
            return lambda: fn(rbuf, sbuf, rop)
        if op == "all_to_all":
            fn = api(d.all_to_all_single)
            return None if inplace else (lambda: fn(rbuf, sbuf))
        if op == "sendrecv":
            if inplace:
                return None
            nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size

            def sendrecv() -> None:
                s = d.isend(sbuf, nxt)
                r = d.irecv(rbuf, prv)
                s.wait()
                r.wait()

            return sendrecv
        if op == "pingpong":
            if inplace:
                return None
            peer = pingpong_peer(self.rank, self.size)
            if peer is None:
                return lambda: None
            if self.rank % 2 == 0:

                def ping() -> None:
                    d.send(sbuf, peer)
                    d.recv(rbuf, peer)

                return ping

            def pong() -> None:
                d.recv(rbuf, peer)
                d.send(sbuf, peer)

            return pong
        raise ValueError(op)

    # -- device memory --------------------------------------------------------------------------

    def _post(self, work: Any) -> None:
        """Waits for xccl's `work` (until it finished on the GPU)."""
        work.wait()

    def settle(self) -> None:
        self.arrays.synchronize()

    def _prepare_device(
        self, op: str, sbuf: Any, rbuf: Any, root: int, redop: str, inplace: bool
    ) -> Optional[Callable[[], None]]:
        """xccl on CUDA buffers: each call posted with async_op=True and waited for on the
        current stream (see the class). Out-of-place all_reduce and reduce are the
        communicator's, which these measurements leave out (N/A)."""
        d, post = self.dist, self._post
        rop = self._redop(redop)

        def api(fn: Callable[..., Any]) -> Callable[..., Any]:
            return functools.partial(fn, async_op=True, **self._kw)

        if op == "all_reduce":
            if not inplace:
                return None
            fn = api(d.all_reduce)
            return lambda: post(fn(rbuf, rop))
        if op == "reduce":
            if not inplace:
                return None
            fn = api(d.reduce)
            return lambda: post(fn(rbuf, root, rop))
        if op == "broadcast":
            if not inplace:
                return None
            fn = api(d.broadcast)
            return lambda: post(fn(rbuf, root))
        if op == "all_gather":
            fn = api(getattr(d, "all_gather_single", None) or d.all_gather_into_tensor)
            return lambda: post(fn(rbuf, sbuf))
        if op == "reduce_scatter":
            fn = api(getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor)
            return lambda: post(fn(rbuf, sbuf, rop))
        if op == "all_to_all":
            if inplace:
                return None
            fn = api(d.all_to_all_single)
            return lambda: post(fn(rbuf, sbuf))
        if inplace:
            return None
        if op == "sendrecv":
            nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size

            def sendrecv() -> None:
                # Both posted before the stream waits for either: in a ring, a receive
                # ordered after this rank's send would wait for itself.
                s = d.isend(sbuf, nxt)
                r = d.irecv(rbuf, prv)
                post(s)
                post(r)

            return sendrecv
        if op == "pingpong":
            peer = pingpong_peer(self.rank, self.size)
            if peer is None:
                return lambda: None
            if self.rank % 2 == 0:

                def ping() -> None:
                    post(d.isend(sbuf, peer))
                    post(d.irecv(rbuf, peer))

                return ping

            def pong() -> None:
                post(d.irecv(rbuf, peer))
                post(d.isend(sbuf, peer))

            return pong
        raise ValueError(op)

    def _prepare_staged_p2p(
        self, op: str, sbuf: Any, rbuf: Any, inplace: bool
    ) -> Optional[Callable[[], None]]:
        """gloo's point-to-point tests on CUDA buffers, through pinned host buffers: copy to
        the host, send, receive, copy to the device (each copy blocks until done)."""
        if inplace:
            return None
        import torch

        d = self.dist
        pin = torch.cuda.is_available()  # (the tests stage host "device" buffers without it)
        hs = torch.empty(sbuf.shape[0], dtype=sbuf.dtype, pin_memory=pin)
        hr = torch.empty(rbuf.shape[0], dtype=rbuf.dtype, pin_memory=pin)
        if op == "sendrecv":
            nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size

            def sendrecv() -> None:
                hs.copy_(sbuf)
                s = d.isend(hs, nxt)
                r = d.irecv(hr, prv)
                s.wait()
                r.wait()
                rbuf.copy_(hr)

            return sendrecv
        peer = pingpong_peer(self.rank, self.size)
        if peer is None:
            return lambda: None
        if self.rank % 2 == 0:

            def ping() -> None:
                hs.copy_(sbuf)
                d.send(hs, peer)
                d.recv(hr, peer)
                rbuf.copy_(hr)

            return ping

        def pong() -> None:
            d.recv(hr, peer)
            rbuf.copy_(hr)
            hs.copy_(sbuf)
            d.send(hs, peer)

        return pong

    def _xccl_direct(
        self, which: str, sbuf: Any, rbuf: Any, redop: str, root: Optional[int]
    ) -> Optional[Callable[[], None]]:
        """Out-of-place all_reduce/reduce through xccl's communicator (torch has none)."""
        if self.name != "xccl":
            return None
        from xccl import _C

        comm = self.dist.group.WORLD.comm
        c_op = _C.OPS["product" if redop == "prod" else redop]
        algo = self.algo
        if which == "allreduce":
            return lambda: comm.allreduce(sbuf, rbuf, c_op, 1.0, algo=algo).wait()
        return lambda: comm.reduce(sbuf, rbuf, c_op, root, 1.0, algo=algo).wait()

    def barrier(self) -> None:
        self.dist.barrier()

    def allreduce_floats(self, values: list[float], how: str) -> list[float]:
        buf = self.arrays.host_floats(values)
        op = self.dist.ReduceOp.SUM if how == "sum" else self.dist.ReduceOp.MAX
        self.dist.all_reduce(buf, op)
        return [float(v) for v in buf.tolist()]

    def gather_strings(self, text: str) -> list[str]:
        out: list[Any] = [None] * self.size
        self.dist.all_gather_object(out, text)
        return [str(s) for s in out]

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"tensor": self.arrays.kind}
        if self.name == "xccl":
            import xccl

            comm = self.dist.group.WORLD.comm
            peers = [comm.peer_transport(p) for p in range(self.size) if p != self.rank]
            info["version"] = xccl.__version__
            info["transports"] = sorted(set(peers)) if peers else ["self"]
            if os.environ.get("XCCL_TRANSPORTS"):
                info["XCCL_TRANSPORTS"] = os.environ["XCCL_TRANSPORTS"]
            if self.algo:
                info["algo"] = self.algo
        else:
            import torch

            info["version"] = f"torch {torch.__version__}"
            info["transports"] = ["tcp"]
        if self.arrays.on_device:
            info["device"] = f"cuda:{self.arrays.device}"
            info["gpu"] = self.arrays.device_name()
        return info

    def close(self, ok: bool = True) -> None:
        if ok:
            self.settle()
            self.dist.barrier()
        self.dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# The harness
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    """One measured (size, placement): what a table cell block and a JSON row hold."""

    time_us: float  # combined across ranks by -a
    time_us_mean: float
    time_us_min: float
    time_us_max: float
    algbw: float
    busbw: float
    wrong: Optional[int]  # None: not checked
    iters: int


@dataclasses.dataclass
class Options:
    """Harness settings (parsed from the command line)."""

    ops: list[str]
    sizes: list[int]
    dtype: DType
    redop: str
    root: int
    iters: int
    warmup: int
    check: int
    average: int
    mintime: float
    placement: str  # "both", "out", "in" or "primary"
    progress: bool
    json_path: Optional[str]
    command: str
    tool: str = PROG  # the program name in the header


class Progress:
    """A one-line progress bar on stderr (rank 0 only)."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled = enabled
        self.total = max(1, total)
        self.done = 0
        self._width = 0

    def show(self, text: str) -> None:
        """Redraws the bar with `text` beside it."""
        if not self.enabled:
            return
        filled = int(24 * self.done / self.total)
        line = f"[{'#' * filled}{'.' * (24 - filled)}] {self.done}/{self.total} {text}"
        pad = max(0, self._width - len(line))
        sys.stderr.write("\r" + line + " " * pad)
        sys.stderr.flush()
        self._width = len(line)

    def step(self) -> None:
        """Counts one finished unit of work."""
        self.done += 1

    def clear(self) -> None:
        """Erases the bar."""
        if self.enabled and self._width:
            sys.stderr.write("\r" + " " * self._width + "\r")
            sys.stderr.flush()
            self._width = 0


def _placements(op: str, choice: str) -> list[str]:
    if choice == "both":
        return ["out", "in"]
    if choice == "primary":
        return [PRIMARY_PLACEMENT[op]]
    return [choice]


def _views(sbig: Any, rbig: Any, op: str, lay: Layout, rank: int, inplace: bool) -> tuple[Any, Any]:
    """The input and output buffers of one call, as views of the two preallocated ones. In
    place, the input lies where the output keeps this rank's part (nccl-tests' offsets)."""
    rbuf = rbig[: lay.recv]
    if not inplace:
        return sbig[: lay.send], rbuf
    if op == "all_gather":
        return rbuf[rank * lay.count : (rank + 1) * lay.count], rbuf
    if op == "reduce_scatter":
        whole = rbig[: lay.send]
        return whole, whole[rank * lay.count : (rank + 1) * lay.count]
    return rbuf, rbuf


def _check_once(
    runner: Runner,
    fn: Callable[[], None],
    op: str,
    lay: Layout,
    sbuf: Any,
    rbuf: Any,
    opts: Options,
    inplace: bool,
) -> int:
    """Fills the inputs, runs `op` once, and counts this rank's wrong output elements."""
    arrays, rank, n = runner.arrays, runner.rank, runner.size
    if inplace and op == "reduce_scatter":
        fill_input(arrays, sbuf, rank)  # the whole input; the output is a part of it
    else:
        arrays.fill(rbuf, 0)
        if not (op == "broadcast" and rank != opts.root):
            fill_input(arrays, sbuf, rank)  # in place, sbuf is (a part of) rbuf
    fn()
    out = rbuf
    tol_scale = 0.0
    if opts.dtype.floating:
        tol_scale = _EPS[opts.dtype.name] * max(2, n)
    wrong = 0
    for offset, length, period in _expected_blocks(
        op, lay, rank, n, opts.root, opts.redop, opts.dtype
    ):
        block = out[offset : offset + length]
        for k in range(min(PERIOD, length)):
            want = arrays.scalar_in(period[k], opts.dtype)
            tol = tol_scale * abs(want)
            wrong += arrays.count_wrong(block[k::PERIOD], want, tol)
    return wrong


def _measure(
    runner: Runner,
    fn: Callable[[], None],
    op: str,
    lay: Layout,
    opts: Options,
    sbuf: Any,
    rbuf: Any,
    inplace: bool,
) -> Result:
    """Check, warm-up and timed loop of one (size, placement). Every loop's time runs until
    its last operation has completed (runner.settle: on a device, until the device has
    finished it, as nccl-tests times its loops), and every loop starts with nothing in
    flight."""
    wrong: Optional[int] = None
    if opts.check > 0:
        mine = sum(
            _check_once(runner, fn, op, lay, sbuf, rbuf, opts, inplace) for _ in range(opts.check)
        )
        wrong = int(runner.allreduce_floats([float(mine)], "sum")[0])

    runner.settle()
    runner.barrier()
    t0 = time.perf_counter()
    for _ in range(opts.warmup):
        fn()
    runner.settle()
    warm = (time.perf_counter() - t0) / opts.warmup if opts.warmup > 0 else 0.0

    iters = opts.iters
    if opts.mintime > 0 and warm > 0:
        # Enough iterations to last about mintime; every rank must run the same number. A
        # warm-up call or two misjudges a microsecond operation (one slow call made an 8-byte
        # loop last 15 ms instead of 250), so a loop of about mintime/20 at that estimate
        # times it again first.
        def agreed(calls: float) -> int:
            want = float(min(1_000_000, math.ceil(calls)))
            return int(runner.allreduce_floats([want], "max")[0])

        cal = agreed(opts.mintime / 20 / warm)
        t0 = time.perf_counter()
        for _ in range(cal):
            fn()
        runner.settle()
        per_call = max((time.perf_counter() - t0) / cal, 1e-9)
        iters = max(iters, agreed(opts.mintime / per_call))

    runner.settle()
    runner.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    runner.settle()
    sec = (time.perf_counter() - t0) / max(1, iters)
    active = 1.0
    if op == "pingpong":
        sec /= 2.0  # one iteration is a round trip
        if pingpong_peer(runner.rank, runner.size) is None:
            active = 0.0  # the odd rank out sits idle: its time is not counted

    total, nactive = runner.allreduce_floats([sec * active, active], "sum")
    high, neg_low = runner.allreduce_floats([sec * active, -sec if active else -1e300], "max")
    mean, low = total / nactive, -neg_low
    combined = {0: sec, 1: mean, 2: low, 3: high}[opts.average]
    algbw = lay.nbytes / combined / 1e9 if combined > 0 else 0.0
    return Result(
        time_us=combined * 1e6,
        time_us_mean=mean * 1e6,
        time_us_min=low * 1e6,
        time_us_max=high * 1e6,
        algbw=algbw,
        busbw=algbw * bus_factor(op, runner.size),
        wrong=wrong,
        iters=iters,
    )


_HEAD = (
    "#{:>11s}  {:>12s}  {:>8s}  {:>6s}  {:>6s}  {:>8s}  {:>7s}  {:>7s}  {:>6s}  "
    "{:>8s}  {:>7s}  {:>7s}  {:>6s}"
)


_TITLES = ("size", "count", "type", "redop", "root", *("time", "algbw", "busbw", "#wrong") * 2)
_UNITS = ("(B)", "(elements)", "", "", "", *("(us)", "(GB/s)", "(GB/s)", "") * 2)


def _table_header(out: TextIO) -> None:
    out.write(f"#{' ' * 51}  {'out-of-place':^34s}  {'in-place':^34s}".rstrip() + "\n")
    out.write(_HEAD.format(*_TITLES).rstrip() + "\n")
    out.write(_HEAD.format(*_UNITS).rstrip() + "\n")


def _fmt_time(us: float) -> str:
    if us >= 1e7:
        return f"{us:8.3g}"
    if us >= 1e4:
        return f"{us:8.0f}"
    return f"{us:8.2f}"


def _cells(res: Optional[Result]) -> str:
    if res is None:
        return f"{'N/A':>8s}  {'N/A':>7s}  {'N/A':>7s}  {'N/A':>6s}"
    wrong = "N/A" if res.wrong is None else str(res.wrong)
    return f"{_fmt_time(res.time_us)}  {res.algbw:7.3f}  {res.busbw:7.3f}  {wrong:>6s}"


def run_benchmarks(runner: Runner, opts: Options, out: Optional[TextIO] = None) -> int:
    """Runs every operation and size of `opts` on `runner`; rank 0 prints the tables and
    writes JSON. Returns the process exit status (1 if any element was wrong)."""
    out = sys.stdout if out is None else out
    rank, n = runner.rank, runner.size
    lead = rank == 0
    dtype = opts.dtype
    if not 0 <= opts.root < n:
        raise ValueError(f"root {opts.root} is not a rank of the {n}-rank job")

    # Two buffers big enough for every operation's largest input and output.
    cap = max(
        max(lay.send, lay.recv)
        for op in opts.ops
        for lay in (layout(op, s, dtype.itemsize, n) for s in opts.sizes)
    )
    sbig = runner.arrays.empty(cap, dtype)
    rbig = runner.arrays.empty(cap, dtype)

    hosts = runner.gather_strings(f"{socket.gethostname()} pid {os.getpid()}")
    info = runner.describe()
    if lead:
        _print_preamble(out, runner, opts, info, hosts)

    rows: list[dict[str, Any]] = []
    bad = 0
    progress = Progress(lead and opts.progress, len(opts.ops) * len(opts.sizes))
    for op in opts.ops:
        spec = OPS[op]
        if n < spec.min_ranks:
            if lead:
                out.write(f"# {op}: skipped (needs at least {spec.min_ranks} ranks)\n#\n")
            progress.done += len(opts.sizes)
            continue
        if lead:
            out.write(f"# {op}\n")
            _table_header(out)
            out.flush()
        seen: set[Layout] = set()
        busbws: list[float] = []
        op_wrong = 0
        for size in opts.sizes:
            lay = layout(op, size, dtype.itemsize, n)
            progress.show(f"{op} {human_size(lay.nbytes)}")
            if lay in seen:
                progress.step()
                continue
            seen.add(lay)
            cells: dict[str, Optional[Result]] = {"out": None, "in": None}
            for where in _placements(op, opts.placement):
                sbuf, rbuf = _views(sbig, rbig, op, lay, rank, where == "in")
                fn = runner.prepare(op, sbuf, rbuf, opts.root, opts.redop, where == "in")
                if fn is None:
                    continue
                res = _measure(runner, fn, op, lay, opts, sbuf, rbuf, where == "in")
                cells[where] = res
                busbws.append(res.busbw)
                op_wrong += res.wrong or 0
                rows.append(_json_row(runner, op, lay, opts, where, res, info))
            progress.step()
            if lead:
                redop = opts.redop if spec.reduces else "none"
                root = opts.root if spec.rooted else -1
                progress.clear()
                out.write(
                    f"{lay.nbytes:12d}  {lay.count:12d}  {dtype.label:>8s}  {redop:>6s}  "
                    f"{root:6d}  {_cells(cells['out'])}  {_cells(cells['in'])}\n"
                )
                out.flush()
        if lead:
            progress.clear()
            avg = sum(busbws) / len(busbws) if busbws else 0.0
            verdict = "OK" if op_wrong == 0 else "FAILED"
            out.write(f"# Out of bounds values : {op_wrong} {verdict}\n")
            out.write(f"# Avg bus bandwidth    : {avg:.6g}\n#\n")
            out.flush()
        bad += op_wrong
    progress.clear()
    if lead and opts.json_path:
        write_json(opts.json_path, runner, opts, info, hosts, rows)
    return 1 if bad else 0


def _print_preamble(
    out: TextIO, runner: Runner, opts: Options, info: dict[str, Any], hosts: list[str]
) -> None:
    avg = {0: "rank 0", 1: "mean over ranks", 2: "min over ranks", 3: "max over ranks"}
    out.write(
        f"# {opts.tool} {VERSION}: {runner.name} ({info.get('version', '?')}), "
        f"{runner.size} ranks, {opts.dtype.name}, redop {opts.redop}\n"
    )
    out.write(f"#  command: {opts.command}\n")
    out.write(
        f"#  minBytes {opts.sizes[0]} maxBytes {opts.sizes[-1]} sizes {len(opts.sizes)} "
        f"warmup iters: {opts.warmup} iters: {opts.iters} "
        f"mintime: {opts.mintime:g} s validation: {opts.check}\n"
    )
    extra = ", ".join(
        f"{k} {','.join(v) if isinstance(v, list) else v}"
        for k, v in info.items()
        if k != "version"
    )
    out.write(f"#  time: {avg[opts.average]}; {extra}\n#\n")
    for r, host in enumerate(hosts):
        out.write(f"#  Rank {r:3d} on {host}\n")
    out.write("#\n")
    out.flush()


def _json_row(
    runner: Runner,
    op: str,
    lay: Layout,
    opts: Options,
    where: str,
    res: Result,
    info: dict[str, Any],
) -> dict[str, Any]:
    spec = OPS[op]
    return {
        "backend": runner.name,
        "op": op,
        "nranks": runner.size,
        "size": lay.nbytes,
        "count": lay.count,
        "type": opts.dtype.name,
        "redop": opts.redop if spec.reduces else "none",
        "root": opts.root if spec.rooted else -1,
        "placement": where,
        "time_us": res.time_us,
        "time_us_mean": res.time_us_mean,
        "time_us_min": res.time_us_min,
        "time_us_max": res.time_us_max,
        "algbw": res.algbw,
        "busbw": res.busbw,
        "wrong": res.wrong,
        "iters": res.iters,
        "transports": info.get("transports"),
    }


def write_json(
    path: str,
    runner: Runner,
    opts: Options,
    info: dict[str, Any],
    hosts: list[str],
    rows: list[dict[str, Any]],
) -> None:
    """Writes ``{"meta": {...}, "rows": [...]}``: one row per (op, size, placement) with
    size, count, time_us (combined by -a), time_us_mean/min/max over ranks, algbw, busbw
    (GB/s), wrong (null if unchecked) and iters."""
    meta = {
        "tool": opts.tool,
        "version": VERSION,
        "backend": runner.name,
        "nranks": runner.size,
        "dtype": opts.dtype.name,
        "redop": opts.redop,
        "iters": opts.iters,
        "warmup": opts.warmup,
        "check": opts.check,
        "mintime": opts.mintime,
        "average": opts.average,
        "hosts": hosts,
        "command": opts.command,
        "python": platform.python_version(),
        "loadavg": _loadavg(),
        **info,
    }
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
        f.write("\n")


def _loadavg() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser(prog: str = PROG, launcher: bool = True) -> argparse.ArgumentParser:
    """The nccl-tests flags; with `launcher`, also xccl-bench's own (--np, --backend, ...)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Collective benchmarks with nccl-tests' flags and table.",
        epilog="Sizes take K/M/G suffixes (powers of 1024). See the module docstring "
        "(python -m pydoc xccl.bench) for the column definitions.",
    )
    g = p.add_argument_group("nccl-tests flags")
    g.add_argument(
        "-b",
        "--minbytes",
        type=_size_arg,
        default=32 << 20,
        metavar="SIZE",
        help="smallest size (default 32M)",
    )
    g.add_argument(
        "-e",
        "--maxbytes",
        type=_size_arg,
        default=32 << 20,
        metavar="SIZE",
        help="largest size, always measured (default 32M)",
    )
    g.add_argument(
        "-f",
        "--stepfactor",
        type=float,
        default=0.0,
        metavar="F",
        help="multiply the size by F between steps",
    )
    g.add_argument(
        "-i",
        "--stepbytes",
        type=_size_arg,
        default=1 << 20,
        metavar="SIZE",
        help="add SIZE between steps when no -f is given (default 1M)",
    )
    g.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (default 20)")
    g.add_argument(
        "-w",
        "--warmup_iters",
        type=int,
        default=1,
        help="warm-up iterations before each timed loop (default 1)",
    )
    g.add_argument(
        "-c",
        "--check",
        type=int,
        default=1,
        help="checked iterations per size; 0 disables the #wrong column (default 1)",
    )
    g.add_argument(
        "-o",
        "--op",
        default="all_reduce",
        help="collective(s): all_reduce, all_gather, reduce_scatter, broadcast, "
        "reduce, all_to_all, sendrecv, pingpong (nccl names such as allreduce "
        "work too), a comma list, or 'all' (default all_reduce)",
    )
    g.add_argument(
        "--redop",
        default="sum",
        choices=REDOPS,
        help="reduction of all_reduce, reduce_scatter, reduce (default sum)",
    )
    g.add_argument(
        "-d",
        "--datatype",
        default="float32",
        help="element type: float/float32, half/float16, bfloat16, double/float64, "
        "int8, uint8, int32, int64 (default float)",
    )
    g.add_argument("-r", "--root", type=int, default=0, help="root of broadcast/reduce")
    g.add_argument(
        "-a",
        "--average",
        type=int,
        default=1,
        choices=(0, 1, 2, 3),
        help="time across ranks: 0 rank 0, 1 mean (default), 2 min, 3 max",
    )
    g.add_argument(
        "-T",
        "--timeout",
        type=float,
        default=300.0,
        help="seconds before an operation fails (default 300)",
    )
    x = p.add_argument_group("more")
    x.add_argument(
        "--sizes",
        metavar="LIST",
        help="explicit comma list of sizes (e.g. 8,4K,64M); replaces -b/-e/-f/-i",
    )
    x.add_argument(
        "--placement",
        default="both",
        choices=("both", "out", "in", "primary"),
        help="out-of-place, in-place, both (default), or the torch API's usual "
        "form per op ('primary')",
    )
    x.add_argument(
        "--mintime",
        type=float,
        default=0.0,
        metavar="SEC",
        help="run more than -n timed iterations where needed to last SEC seconds "
        "(estimated from the warm-up)",
    )
    x.add_argument("--json", metavar="PATH", help="write every row as JSON to PATH")
    x.add_argument(
        "--progress",
        action="store_true",
        help="progress bar on stderr even when it is not a terminal",
    )
    x.add_argument("--no-progress", action="store_true", help="no progress bar")
    x.add_argument(
        "--tensor",
        choices=("auto", "numpy", "torch", "cupy"),
        default="auto",
        help="buffer library: torch for gloo and bfloat16, else numpy (auto); on "
        "--device cuda torch, or CuPy where torch is missing",
    )
    x.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the buffers live: host memory (cpu, default) or the rank's GPU "
        "(cuda: LOCAL_RANK modulo the GPUs this process sees; ranks share GPU 0 when "
        "there is one)",
    )
    if launcher:
        x.add_argument(
            "--backend",
            choices=("xccl", "gloo"),
            default="xccl",
            help="xccl (default) or torch.distributed's gloo, same loop",
        )
        x.add_argument(
            "--transport",
            default="auto",
            help="xccl transports: tcp, shm, or a list such as shm,tcp; sets "
            "XCCL_TRANSPORTS (default auto: leave it as it is)",
        )
        x.add_argument("--algo", help="force this xccl algorithm (the algo= keyword)")
        x.add_argument(
            "--np",
            type=int,
            default=1,
            help="ranks to start on this host when RANK is not set (default 1)",
        )
        x.add_argument(
            "--init-method",
            default="env://",
            help="rendezvous of ranks started by a launcher (default env://)",
        )
    return p


def options_from_args(args: argparse.Namespace, command: str, tool: str = PROG) -> Options:
    """Validated :class:`Options` from parsed arguments; ValueError on bad values."""
    dtype = parse_dtype(args.datatype)
    if args.redop == "avg" and not dtype.floating:
        raise ValueError("--redop avg needs a floating-point type")
    for name in ("iters", "warmup_iters", "check"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must not be negative")
    if args.iters == 0:
        raise ValueError("--iters must be at least 1")
    if args.sizes:
        sizes = sorted({parse_size(s) for s in args.sizes.split(",") if s.strip()})
    else:
        sizes = size_list(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    isatty = sys.stderr.isatty()
    return Options(
        ops=parse_ops(args.op),
        sizes=sizes,
        dtype=dtype,
        redop=args.redop,
        root=args.root,
        iters=args.iters,
        warmup=args.warmup_iters,
        check=args.check,
        average=args.average,
        mintime=args.mintime,
        placement=args.placement,
        progress=(args.progress or isatty) and not args.no_progress,
        json_path=args.json,
        command=command,
        tool=tool,
    )


def tensor_kind(choice: str, backend: str, dtype: DType, device: str = "cpu") -> str:
    """The buffer library: torch for gloo (it takes nothing else) and for bfloat16; on a GPU
    torch, or CuPy where torch cannot be imported. ValueError for a library that cannot hold
    the buffers asked for."""
    if device == "cuda":
        if choice == "numpy":
            raise ValueError("--device cuda needs GPU buffers: --tensor torch or cupy, not numpy")
        if choice == "cupy" and backend == "gloo":
            raise ValueError("--backend gloo takes torch tensors only (--tensor torch)")
        if choice == "cupy" and dtype.numpy is None:
            raise ValueError(f"CuPy has no {dtype.name}: use --tensor torch")
        if choice != "auto":
            return choice
        if backend == "gloo" or dtype.numpy is None or _importable("torch"):
            return "torch"
        return "cupy" if _importable("cupy") else "torch"
    if choice == "cupy":
        raise ValueError("--tensor cupy holds GPU buffers: add --device cuda")
    if choice != "auto":
        return choice
    return "torch" if backend == "gloo" or dtype.numpy is None else "numpy"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def cuda_devices(kind: str) -> int:
    """The CUDA devices `kind` (torch or cupy) sees; 0 without a driver or a device. Raises
    ImportError when the library is missing."""
    if kind == "torch":
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    import cupy

    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # cupy's CUDARuntimeError: no driver, no device
        return 0


def cuda_problem(backend: str, kind: str) -> Optional[str]:
    """Why this process cannot run `backend` on CUDA buffers of `kind`, or None if it can."""
    try:
        ndev = cuda_devices(kind)
    except ImportError as e:
        return f"the tensor library {kind!r} cannot be imported ({e})"
    if ndev == 0:
        if kind == "torch":
            import torch

            if torch.version.cuda is None:
                return f"torch {torch.__version__} was built without CUDA"
            return f"torch {torch.__version__} sees no CUDA device (no GPU or no driver)"
        return "CuPy sees no CUDA device (no GPU or no driver)"
    if backend == "xccl":
        try:
            xcuda = importlib.import_module("xccl.cuda")
        except ImportError as e:
            return f"this xccl has no CUDA support (xccl.cuda: {e})"
        if not xcuda.is_available():
            why = ""
            info = getattr(xcuda, "build_info", None)
            if info is not None:
                try:
                    got = info()
                    why = str(got.get("why", "") if isinstance(got, dict) else got)
                except Exception as e:  # the reason is only for the message
                    why = str(e)
            return "xccl.cuda.is_available() is False" + (f": {why}" if why else "")
    return None


def rank_device(ndev: int) -> int:
    """The GPU of this rank: LOCAL_RANK modulo the `ndev` GPUs (ranks share GPU 0 when
    there is one)."""
    if ndev < 1:
        raise ValueError("no CUDA device")
    return int(os.environ.get("LOCAL_RANK", "0") or 0) % ndev


def _spawn(nranks: int, argv: Sequence[str], env_extra: dict[str, str]) -> int:
    """Starts `nranks` copies of this program as ranks of one job and waits for them; when
    one fails, stops the rest. Returns the first failure's exit status (0 if none)."""
    if nranks < 1:
        print(f"{PROG}: --np must be at least 1", file=sys.stderr)
        return 2
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="xccl-bench-") as tmp:
        init = f"file://{tmp}/store"
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for r in range(nranks):
                env = dict(os.environ)
                env.update(env_extra)
                env.update(
                    RANK=str(r),
                    WORLD_SIZE=str(nranks),
                    LOCAL_RANK=str(r),
                    LOCAL_WORLD_SIZE=str(nranks),
                )
                env["PYTHONPATH"] = os.pathsep.join(
                    p for p in (pkg_root, env.get("PYTHONPATH", "")) if p
                )
                cmd = [sys.executable, "-c", _RANK_MAIN, *argv, "--init-method", init]
                procs.append(subprocess.Popen(cmd, env=env))
            status = 0
            while procs and status == 0:
                for p in list(procs):
                    rc = p.poll()
                    if rc is None:
                        continue
                    procs.remove(p)
                    if rc != 0:
                        status = rc if rc > 0 else 128 - rc
                        break
                if procs and status == 0:
                    time.sleep(0.02)
            return status
        except KeyboardInterrupt:
            return 130
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``xccl-bench`` and ``python -m xccl.bench``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    # Spawned ranks show the command that spawned them, not their own.
    command = os.environ.get(_COMMAND_VAR) or " ".join([PROG, *argv])
    try:
        opts = options_from_args(args, command)
        if args.algo and args.backend != "xccl":
            raise ValueError("--algo applies to --backend xccl only")
        if args.transport != "auto" and args.backend != "xccl":
            raise ValueError("--transport applies to --backend xccl only")
        if args.tensor == "numpy" and args.backend == "gloo":
            raise ValueError("--backend gloo takes torch tensors only (--tensor torch)")
        kind = tensor_kind(args.tensor, args.backend, opts.dtype, args.device)
    except ValueError as e:
        parser.error(str(e))
    if args.device == "cuda":
        why = cuda_problem(args.backend, kind)
        if why is not None:
            print(f"{PROG}: --device cuda: no usable GPU: {why}", file=sys.stderr)
            return 2

    env_extra: dict[str, str] = {}
    if args.transport != "auto":
        env_extra["XCCL_TRANSPORTS"] = args.transport
    if "RANK" not in os.environ:
        if args.backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
            env_extra["GLOO_SOCKET_IFNAME"] = "lo"  # every rank is on this host
        env_extra[_COMMAND_VAR] = command
        return _spawn(args.np, argv, env_extra)

    os.environ.update(env_extra)
    rank = int(os.environ["RANK"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device: Optional[int] = None
    if args.device == "cuda":
        device = rank_device(cuda_devices(kind))
        _use_device(kind, device, args.backend)
    runner = TorchApiRunner(args.backend, Arrays(kind, device), args.algo)
    runner.init(args.init_method, rank, world, args.timeout)
    try:
        status = run_benchmarks(runner, opts)
    except BaseException:
        runner.close(ok=False)
        raise
    runner.close()
    return status


def _use_device(kind: str, device: int, backend: str) -> None:
    """Makes `device` this process's GPU for the tensor library (and xccl)."""
    if kind == "torch":
        import torch

        torch.cuda.set_device(device)
    else:
        import cupy

        cupy.cuda.Device(device).use()
    if backend == "xccl":
        xcuda = importlib.import_module("xccl.cuda")
        set_device = getattr(xcuda, "set_device", None)
        if set_device is not None:
            set_device(device)


if __name__ == "__main__":
    sys.exit(main())
