"""The C extension's buffer door (DLPack consumer) and its plumbing, on one process.

- buffer_info over numpy arrays and torch tensors of every dtype, versioned and legacy
  capsules, and the ctypes producer of dlpack_producer.py for everything numpy/torch cannot
  express (foreign devices, narrow floats, vector lanes, strides, byte offsets, flags);
- the deleter of every exported tensor runs exactly once: after buffer_info, after an
  operation completes, after a rejected call, and after a Work dropped while pending;
- in-place writes really reach torch/numpy memory (size-1 communicators need no network);
- Work waiting, timeouts, callbacks; Comm.destroy; the exception mapping; Store.custom over
  torch.distributed stores.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import sys
import threading
import time

import numpy as np
import pytest
import torch
from dlpack_producer import IS_COPIED, READ_ONLY, Producer, kDLCUDA, kDLCUDAHost

from xccl import _C

SUM, PREMUL, BXOR = _C.OPS["sum"], _C.OPS["premul_sum"], _C.OPS["bxor"]

NUMPY_DTYPES = [
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]
TORCH_DTYPES = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}


class LegacyOnly:
    """Wraps a producer behind a pre-1.0 __dlpack__ (no max_version keyword)."""

    def __init__(self, t):
        self.t = t
        self.calls = 0

    def __dlpack__(self, stream=None):
        self.calls += 1
        return self.t.__dlpack__()

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


@pytest.fixture
def comm():
    c = _C.Comm(_C.Store.hash(10.0), 0, 1, 10.0)
    yield c
    c.destroy()


# --------------------------------------------------------------------------- buffer_info


@pytest.mark.parametrize("name", NUMPY_DTYPES)
def test_buffer_info_numpy(name):
    a = np.zeros((2, 3), dtype=name)
    assert _C.buffer_info(a) == (name, 6, "cpu", False)
    assert _C.buffer_info(LegacyOnly(a)) == (name, 6, "cpu", False)


@pytest.mark.parametrize("name", sorted(TORCH_DTYPES))
def test_buffer_info_torch(name):
    t = torch.zeros(4, 5, dtype=TORCH_DTYPES[name])
    assert _C.buffer_info(t) == (name, 20, "cpu", False)
    assert _C.buffer_info(LegacyOnly(t)) == (name, 20, "cpu", False)


def test_buffer_info_shapes():
    assert _C.buffer_info(np.array(3.0)) == ("float64", 1, "cpu", False)
    assert _C.buffer_info(np.zeros((0, 7), np.int32))[1] == 0
    assert _C.buffer_info(torch.zeros(3, 4)[1:])[1] == 8  # offset view, compact
    # a dimension of extent 1 may carry any stride
    assert _C.buffer_info(torch.zeros(3, 4)[1:2])[1] == 4
    assert _C.buffer_info(torch.zeros(5).expand(1, 5))[1] == 5


def test_buffer_info_read_only_numpy():
    a = np.arange(4.0)
    a.flags.writeable = False
    assert _C.buffer_info(a) == ("float64", 4, "cpu", True)  # versioned capsule: READ_ONLY
    with pytest.raises(BufferError):  # numpy cannot say "read-only" through a legacy capsule
        _C.buffer_info(LegacyOnly(a))


class CountingArray(np.ndarray):
    """A numpy subclass that counts its __dlpack__ calls."""

    calls = 0

    def __dlpack__(self, *args, **kwargs):
        CountingArray.calls += 1
        return super().__dlpack__(*args, **kwargs)


def test_numpy_buffer_route_matches_dlpack():
    """Exact numpy arrays are read through the buffer protocol: the same answers as their
    DLPack export, views included; subclasses and anything the buffer route does not vet go
    through __dlpack__ as before."""
    base = np.arange(24, dtype=np.float32)
    for a in [base, base[3:], base.reshape(2, 3, 4)[1], np.array(3.0), np.zeros((0, 7), np.int32)]:
        assert _C.buffer_info(a) == _C.buffer_info(LegacyOnly(a))
    sub = np.zeros(5, np.int16).view(CountingArray)
    CountingArray.calls = 0
    assert _C.buffer_info(sub) == ("int16", 5, "cpu", False)
    assert CountingArray.calls == 1
    # non-native byte order: numpy refuses to export it, and it is not taken as native
    with pytest.raises(BufferError):
        _C.buffer_info(np.zeros(3, dtype=">f4"))
    with pytest.raises(TypeError, match="unsupported dtype"):
        _C.buffer_info(np.zeros(3, dtype=np.uint16))


def test_numpy_buffer_route_data_and_lifetime(comm):
    """The view starts at the array's first element (an offset view included), and the
    operation holds the array until it completes."""
    src = np.arange(10, dtype=np.int64)[4:]
    out = np.zeros(6, dtype=np.int64)[::1]
    before = sys.getrefcount(out)
    work = comm.allreduce(src, out, SUM)
    work.wait()
    assert out.tolist() == [4, 5, 6, 7, 8, 9]
    del work
    gc.collect()
    assert sys.getrefcount(out) == before
    pending = comm.irecv(out, 0)  # nothing is sent: stays pending and holds `out`
    assert sys.getrefcount(out) == before + 1
    comm.isend(np.full(6, 7, np.int64), 0).wait()
    pending.wait()
    assert out.tolist() == [7] * 6
    del pending
    gc.collect()
    assert sys.getrefcount(out) == before


@pytest.mark.parametrize("mode", ["versioned", "legacy", "versioned-only"])
def test_capsule_kinds_and_single_delete(mode):
    p = Producer.of_values("i", [1, 2, 3], mode=mode)
    assert _C.buffer_info(p) == ("int32", 3, "cpu", False)
    gc.collect()
    assert (p.exported, p.deleted, p.unconsumed) == (1, 1, 0)
    assert p.last_kwargs["max_version"] == (None if mode == "legacy" else (1, 1))


def test_versioned_asks_for_1_1_and_falls_back_on_type_error():
    wrapped = LegacyOnly(Producer.of_values("f", [1.0]))
    assert _C.buffer_info(wrapped)[0] == "float32"
    assert wrapped.calls == 1


def test_torch_goes_through_the_c_exchange_table(monkeypatch):
    # torch publishes DLPack's C exchange table: the consumer must use it (no Python-level
    # __dlpack__ call) and still get the same answer, and the writes must reach the tensor.
    if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        pytest.skip("this torch has no DLPack C exchange table")

    def refuse(*args, **kwargs):
        raise AssertionError("__dlpack__ called although the exchange table exists")

    t = torch.zeros(3, 4)
    monkeypatch.setattr(torch.Tensor, "__dlpack__", refuse)
    assert _C.buffer_info(t) == ("float32", 12, "cpu", False)
    assert _C.buffer_info(t[1:]) == ("float32", 8, "cpu", False)


def test_exchange_table_leaves_vetting_to_the_producer():
    # What DLPack cannot describe takes the capsule route, so torch's own checks still apply.
    if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        pytest.skip("this torch has no DLPack C exchange table")
    with pytest.raises(BufferError, match="conjugate"):
        _C.buffer_info(torch.ones(2, dtype=torch.complex64).conj())
    with pytest.raises(BufferError, match="layout"):
        _C.buffer_info(torch.ones(2).to_sparse())
    assert _C.buffer_info(torch.ones(2, dtype=torch.complex64)) == ("complex64", 2, "cpu", False)


class _Header(ctypes.Structure):
    pass


_Header._fields_ = [
    ("major", ctypes.c_uint32),
    ("minor", ctypes.c_uint32),
    ("prev_api", ctypes.POINTER(_Header)),
]


_FROM_PY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_future_calls: list[int] = []


@_FROM_PY
def _future_from_py(obj: int, out: int) -> int:
    _future_calls.append(obj)
    return -1


class _FutureTable(ctypes.Structure):
    # a DLPack 99.x table with no older version chained: unusable, so __dlpack__ is used
    _fields_ = [
        ("header", _Header),
        ("allocator", ctypes.c_void_p),
        ("from_py", _FROM_PY),
        ("rest", ctypes.c_void_p * 3),
    ]


_FUTURE = _FutureTable(from_py=_future_from_py)
_FUTURE.header.major = 99


class FutureProducer(Producer):
    pass


# A capsule keeps a pointer to its name: the name must outlive it. A literal passed in place
# would be a constant of this module's top-level code, freed once the import is done (found
# by AddressSanitizer, tests/san/run-python.sh: heap-use-after-free in PyCapsule_IsValid).
_EXCHANGE_NAME = b"dlpack_exchange_api"
FutureProducer.__dlpack_c_exchange_api__ = ctypes.pythonapi.PyCapsule_New(
    ctypes.addressof(_FUTURE), _EXCHANGE_NAME, None
)


def test_exchange_table_of_unknown_major_version_is_ignored():
    p = FutureProducer.of_values("i", [4, 5])
    assert _C.buffer_info(p) == ("int32", 2, "cpu", False)
    gc.collect()
    assert (p.exported, p.deleted, _future_calls) == (1, 1, [])


def test_unconsumed_capsule_is_freed_by_its_producer():
    p = Producer.of_values("f", [1.0])
    cap = p.__dlpack__(max_version=(1, 1))
    del cap
    gc.collect()
    assert (p.deleted, p.unconsumed) == (1, 1)


def test_version_mismatch():
    p = Producer.of_values("f", [1.0, 2.0], version=(2, 0))
    with pytest.raises(ValueError, match=r"DLPack version 2\.0 is not supported"):
        _C.buffer_info(p)
    assert p.deleted == 1
    # a newer minor version of ABI 1 is fine
    p = Producer.of_values("f", [1.0, 2.0], version=(1, 7))
    assert _C.buffer_info(p)[1] == 2 and p.deleted == 1


@pytest.mark.parametrize(
    "dtype, code",
    [
        ((10, 8, 1), 10),
        ((7, 8, 1), 7),
        ((2, 32, 2), 2),
        ((2, 8, 1), 2),
        ((0, 128, 1), 0),
        ((3, 64, 1), 3),
        ((4, 32, 1), 4),
    ],
)
def test_unsupported_dtype(dtype, code):
    p = Producer(64, (4,), dtype=dtype)
    with pytest.raises(TypeError, match=rf"unsupported dtype \(DLPack code {code} "):
        _C.buffer_info(p)
    assert p.deleted == 1


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"])
def test_unsupported_torch_dtypes(name):
    with pytest.raises(TypeError, match="unsupported dtype"):
        _C.buffer_info(torch.zeros(3, dtype=getattr(torch, name)))
    if name.startswith("float8"):
        with pytest.raises(TypeError, match=f"\\({name}\\)"):
            _C.buffer_info(torch.zeros(3, dtype=getattr(torch, name)))


def test_lanes_named_in_message():
    p = Producer(64, (4,), dtype=(2, 32, 4))
    with pytest.raises(TypeError, match="bits 32, lanes 4"):
        _C.buffer_info(p)


def test_not_a_tensor():
    with pytest.raises(TypeError, match="expected a tensor or array supporting DLPack"):
        _C.buffer_info([1, 2, 3])
    p = Producer.of_values("f", [1.0], capsule_name=b"something_else")
    with pytest.raises(TypeError, match="not an unused DLPack capsule"):
        _C.buffer_info(p)
    gc.collect()
    assert p.deleted == 1  # the producer's own capsule destructor


def test_devices_reported():
    assert _C.buffer_info(Producer(16, (4,), device=(kDLCUDA, 1)))[2] == "cuda:1"
    assert _C.buffer_info(Producer(16, (4,), device=(kDLCUDAHost, 0)))[2] == "cuda_host:0"
    assert _C.buffer_info(Producer(16, (4,), device=(99, 2)))[2] == "device_type_99:2"


# --------------------------------------------------------------------------- rejection


def test_non_cpu_device_rejected(comm):
    # a CUDA buffer in a host operation (no stream=): refused, named, before anything moves
    p = Producer(16, (4,), device=(kDLCUDA, 0))
    with pytest.raises(ValueError, match="cuda:0 memory in an operation on host memory") as ei:
        comm.allreduce(p, p, SUM)
    assert ei.value.status_name == "XCCL_ERR_INVALID_ARG"
    assert p.deleted == p.exported == 1
    # a device xccl does not move at all
    q = Producer(16, (4,), device=(10, 0))
    with pytest.raises(NotImplementedError, match="device rocm:0 is not supported") as ei:
        comm.allreduce(q, q, SUM)
    assert ei.value.status_name == "XCCL_ERR_NOT_SUPPORTED"
    assert q.deleted == q.exported == 1


def test_cuda_host_memory_accepted(comm):
    p = Producer.of_values("f", [1.0, 2.0], device=(kDLCUDAHost, 0))
    comm.allreduce(p, p, PREMUL, premul=3.0).wait()
    assert p.values("f") == [3.0, 6.0]
    assert p.deleted == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(12.0).reshape(3, 4)[:, ::2],
        lambda: np.arange(12.0).reshape(3, 4).T,
        lambda: torch.arange(12.0).reshape(3, 4).t(),
        lambda: torch.zeros(3).expand(2, 3),
        lambda: Producer(64, (2, 4), strides=(1, 2)),
    ],
)
def test_non_contiguous_rejected(comm, make):
    buf = make()
    with pytest.raises(ValueError, match=r"non-contiguous buffer \(strides .*\.contiguous\(\)"):
        comm.allreduce(buf, buf, SUM)


def test_read_only_output_rejected(comm):
    a = np.arange(4.0)
    a.flags.writeable = False
    out = np.zeros(4)
    comm.allreduce(a, out, SUM).wait()  # read-only input is fine
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="read-only buffer cannot receive data"):
        comm.allreduce(out, a, SUM)
    with pytest.raises(ValueError, match="read-only buffer cannot receive data"):
        comm.allreduce(a, a, SUM)  # in place writes
    p = Producer.of_values("d", [1.0], flags=READ_ONLY)
    with pytest.raises(ValueError, match="recv buf: read-only"):
        comm.irecv(p, 0)
    assert p.deleted == 1
    q = Producer.of_values("d", [1.0], flags=IS_COPIED)
    with pytest.raises(ValueError, match="exported a copy"):
        comm.irecv(q, 0)
    assert q.deleted == 1


def test_broadcast_root_may_be_read_only(comm):
    a = np.arange(3, dtype=np.int64)
    a.flags.writeable = False
    comm.broadcast(a, 0).wait()


def test_byte_offset_applied(comm):
    p = Producer(24, (4,), byte_offset=8)  # float32[4] starting 8 bytes in
    p.set_values("f", [9.0, 9.0, 1.0, 2.0, 3.0, 4.0])
    out = np.zeros(4, np.float32)
    comm.allreduce(p, out, SUM).wait()
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_sizes_and_dtypes_validated(comm):
    f4, f8 = np.zeros(4, np.float32), np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="the dtypes must match"):
        comm.allreduce(f4, np.zeros(4, np.float64), SUM)
    with pytest.raises(ValueError, match="sendbuf has 4 elements and recvbuf 8"):
        comm.allreduce(f4, f8, SUM)
    with pytest.raises(ValueError, match="recvbuf = size \\* sendbuf"):
        comm.allgather(f4, f8)
    with pytest.raises(ValueError, match="sendbuf = size \\* recvbuf"):
        comm.reduce_scatter(f8, f4, SUM)
    with pytest.raises(ValueError, match="root 1 is not in \\[0, 1\\)"):
        comm.broadcast(f4, 1)
    with pytest.raises(ValueError, match="peer 3 is not in"):
        comm.isend(f4, 3)
    with pytest.raises(ValueError, match="tag -1 is not in"):
        comm.isend(f4, 0, -1)
    with pytest.raises(ValueError, match="tag 2147483648 is not in"):
        comm.irecv(f4, 0, 2**31)
    with pytest.raises(ValueError, match="unknown reduction op 42"):
        comm.allreduce(f4, f4, 42)
    with pytest.raises(ValueError, match="bxor"):
        comm.allreduce(f4, f4, BXOR)  # xccl_op_check: bitwise op on a float
    with pytest.raises(ValueError, match="overlap partially"):
        big = np.zeros(8, np.float32)
        comm.allreduce(big[:6], big[2:], SUM)
    with pytest.raises(ValueError, match="scounts has 2 entries"):
        comm.alltoallv(f4, [1, 2], [0, 1], f4, [4], [0])
    with pytest.raises(ValueError, match="block 0 of recvbuf .* ends past"):
        comm.alltoallv(f4, [4], [0], f4, [3], [2])
    with pytest.raises(ValueError, match="recvbuf is required at the root"):
        comm.reduce(f4, None, SUM, 0)


def test_deleters_after_rejected_call(comm):
    s = Producer.of_values("f", [1.0, 2.0])
    r = Producer.of_values("d", [0.0, 0.0])
    with pytest.raises(ValueError):
        comm.allreduce(s, r, SUM)
    assert (s.deleted, r.deleted) == (1, 1)


# --------------------------------------------------------------------------- data really moves


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_in_place_writes_reach_the_tensor(comm, kind):
    if kind == "torch":
        x = torch.arange(6, dtype=torch.float32)
        before = x.data_ptr()
    else:
        x = np.arange(6, dtype=np.float32)
        before = x.ctypes.data
    comm.allreduce(x, x, PREMUL, premul=2.0).wait()  # size 1: x <- 2 * x, in place
    assert list(map(float, x)) == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert (x.data_ptr() if kind == "torch" else x.ctypes.data) == before
    comm.broadcast(x, 0).wait()
    assert list(map(float, x)) == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


def test_out_of_place_into_torch_and_numpy(comm):
    src = torch.arange(4, dtype=torch.int64)
    dst = np.zeros(4, np.int64)
    comm.allreduce(src, dst, SUM).wait()
    assert dst.tolist() == [0, 1, 2, 3]
    big = torch.zeros(4, dtype=torch.bfloat16)
    comm.allgather(torch.full((4,), 1.5, dtype=torch.bfloat16), big).wait()
    assert big.tolist() == [1.5] * 4
    out = torch.zeros(2, 3)
    comm.alltoall(torch.ones(2, 3), out).wait()
    assert out.sum().item() == 6.0


def test_deleters_run_once_after_completion(comm):
    s = Producer.of_values("f", [1.0, 2.0])
    r = Producer.of_values("f", [0.0, 0.0])
    w = comm.allreduce(s, r, SUM)
    assert w.wait() is True
    assert (s.deleted, r.deleted) == (1, 1)
    assert w.wait() and w.is_completed() and w.is_success() and w.exception() is None
    del w
    gc.collect()
    assert (s.deleted, r.deleted) == (1, 1)
    assert r.values("f") == [1.0, 2.0]


def test_in_place_exports_once(comm):
    p = Producer.of_values("f", [1.0])
    comm.allreduce(p, p, SUM).wait()
    assert (p.exported, p.deleted) == (1, 1)


# --------------------------------------------------------------------------- Work


def test_pending_work_keeps_buffers_then_wait_timeout(comm):
    r = Producer.of_values("f", [0.0, 0.0])
    w = comm.irecv(r, 0, 5)
    assert not w.is_completed() and not w.is_success() and w.exception() is None
    t0 = time.monotonic()
    with pytest.raises(_C.XcclTimeoutError, match="did not complete within") as ei:
        w.wait(0.2)
    assert 0.15 < time.monotonic() - t0 < 5
    assert isinstance(ei.value, TimeoutError) and ei.value.status_name == "XCCL_ERR_TIMEOUT"
    assert r.deleted == 0  # the receive is still posted
    comm.isend(np.array([7.0, 8.0], np.float32), 0, 5).wait()
    assert w.wait(datetime.timedelta(seconds=5)) is True
    assert r.values("f") == [7.0, 8.0] and r.deleted == 1
    assert w.name == "recv" and w.nbytes == 8 and w.source_rank() == 0


def test_dropped_pending_work_releases_after_completion(comm):
    r = Producer.of_values("f", [0.0])
    w = comm.irecv(r, 0, 9)
    del w
    gc.collect()
    assert r.deleted == 0  # must not be freed while the receive may still write
    comm.isend(np.array([5.0], np.float32), 0, 9).wait()
    for _ in range(200):
        if r.deleted:
            break
        time.sleep(0.01)
    assert r.deleted == 1 and r.values("f") == [5.0]


def test_work_properties(comm):
    w = comm.allreduce(np.ones(3), np.zeros(3), SUM)
    w.wait()
    assert w.name == "all_reduce" and isinstance(w.algo, str) and w.seq >= 0
    enq, start, end = w.times()
    now = time.monotonic()
    assert 0 < enq <= start <= end <= now and now - enq < 60
    assert "all_reduce" in repr(w)
    with pytest.raises(TypeError):
        _C.Work()


def test_done_callbacks(comm):
    seen = []
    r = np.zeros(1, np.float32)
    w = comm.irecv(r, 0, 3)
    w.add_done_callback(lambda work: seen.append(("a", work is w, work.is_success())))
    w.add_done_callback(lambda work: seen.append(("b", r[0])))
    assert seen == []
    comm.isend(np.array([4.0], np.float32), 0, 3).wait()
    w.wait()
    for _ in range(200):
        if len(seen) == 2:
            break
        time.sleep(0.01)
    assert seen == [("a", True, True), ("b", 4.0)]
    w.add_done_callback(lambda work: seen.append("late"))  # already complete: runs at once
    assert seen[-1] == "late"
    with pytest.raises(TypeError):
        w.add_done_callback(42)


def test_callback_from_another_thread(comm):
    done = threading.Event()
    names = []
    r = np.zeros(2, np.int32)
    w = comm.irecv(r, 0, 11)
    w.add_done_callback(lambda work: (names.append(threading.current_thread().name), done.set()))
    del w  # the callback keeps the Work alive
    threading.Thread(
        target=lambda: comm.isend(np.array([1, 2], np.int32), 0, 11).wait(), name="sender"
    ).start()
    assert done.wait(10)
    assert r.tolist() == [1, 2]


def test_concurrent_waiters(comm):
    r = np.zeros(1)
    w = comm.irecv(r, 0, 21)
    results = []
    threads = [threading.Thread(target=lambda: results.append(w.wait(10))) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    comm.isend(np.array([1.0]), 0, 21).wait()
    for t in threads:
        t.join(10)
    assert results == [True, True, True] and r[0] == 1.0


# --------------------------------------------------------------------------- Comm lifetime


def test_destroy_is_idempotent_and_fails_pending(comm):
    r = Producer.of_values("f", [0.0])
    w = comm.irecv(r, 0, 1)
    comm.destroy()
    comm.destroy()
    with pytest.raises(_C.XcclError) as ei:
        w.wait(10)
    assert ei.value.status < 0 and r.deleted == 1
    assert isinstance(w.exception(), _C.XcclError)
    with pytest.raises(_C.XcclError, match="communicator was destroyed"):
        comm.allreduce(np.zeros(1), np.zeros(1), SUM)
    with pytest.raises(_C.XcclError, match="communicator was destroyed"):
        comm.barrier()
    assert comm.rank == 0 and comm.size == 1 and "destroyed" in repr(comm)


def test_comm_basics():
    store = _C.Store.hash(5.0)
    c = _C.Comm(store, 0, 1, 5.0, name="solo")
    assert (c.rank, c.size) == (0, 1) and isinstance(c.id, int)
    assert c.global_rank(0) == 0 and isinstance(c.peer_transport(0), str)
    sub = c.split([0], name="sub")
    assert (sub.rank, sub.size) == (0, 1)
    x = np.ones(2)
    sub.allreduce(x, x, SUM).wait()
    with pytest.raises(ValueError):
        c.split([0, 0])
    with pytest.raises(ValueError):
        _C.Comm(store, 1, 1, 5.0)
    c.barrier().wait()
    del c  # dealloc destroys; the split communicator stays valid
    sub.barrier().wait()
    sub.destroy()


def test_abort_fails_pending():
    c = _C.Comm(_C.Store.hash(5.0), 0, 1, 5.0)
    w = c.irecv(np.zeros(1), 0, 0)
    c.abort()
    with pytest.raises(_C.XcclError):
        w.wait(10)
    c.destroy()


# --------------------------------------------------------------------------- errors


def test_exception_hierarchy():
    assert issubclass(_C.XcclError, RuntimeError)
    assert issubclass(_C.XcclTimeoutError, _C.XcclError)
    assert issubclass(_C.XcclTimeoutError, TimeoutError)
    assert issubclass(_C.XcclConnectionError, ConnectionError)
    assert issubclass(_C.XcclMismatchError, _C.XcclError)
    assert issubclass(_C.XcclAuthError, _C.XcclError)
    assert _C.XcclTimeoutError.status_name == "XCCL_ERR_TIMEOUT"
    assert _C.status_string(-7) == "XCCL_ERR_TIMEOUT"
    assert _C.reduce_isa() in ("avx512", "avx2", "generic")
    assert _C.ANY_SOURCE == -1 and _C.DTYPES["float32"] >= 0 and "premul_sum" in _C.OPS


# --------------------------------------------------------------------------- stores


def test_hash_store():
    s = _C.Store.hash(2.0)
    s.set("a", b"1")
    s.set("b", "two")
    assert s.get("a") == b"1" and s.get("b") == b"two"
    assert s.add("n", 5) == 5 and s.add("n", -2) == 3
    assert s.check(["a", "b"]) and not s.check(["a", "zz"])
    s.wait(["a"])
    assert s.compare_set("c", b"", b"x") == b"x"
    assert s.compare_set("c", b"x", b"y") == b"y"
    assert s.delete_key("c") and not s.delete_key("c")
    assert s.num_keys() >= 3
    assert s.port == -1 and s.timeout == pytest.approx(2.0)
    s.timeout = 0.3
    with pytest.raises(_C.XcclTimeoutError):
        s.get("missing")
    with pytest.raises(_C.XcclTimeoutError):
        s.wait(["missing"], timeout=0.1)
    with pytest.raises(TypeError):
        s.check("ab")
    with pytest.raises(TypeError):
        _C.Store()


def _torch_stores(tmp_path):
    import torch.distributed as td

    yield "hash", td.HashStore()
    yield "file", td.FileStore(str(tmp_path / "fs"), 1)
    tcp = td.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5))
    yield "tcp", tcp
    yield "prefix", td.PrefixStore("pre", td.HashStore())


def test_custom_store_over_torch_stores(tmp_path):
    for kind, ts in _torch_stores(tmp_path):
        ts.set_timeout(datetime.timedelta(seconds=1))
        s = _C.Store.custom(ts, 1.0)
        s.set("k", b"v")
        s.set("t", "text")
        assert s.get("k") == b"v" and s.get("t") == b"text", kind
        assert ts.get("k") == b"v"
        assert s.add("cnt", 2) == 2 and s.add("cnt", 3) == 5
        s.wait(["k", "t"])
        s.wait(["k"], timeout=0.5)
        assert s.check(["k"]) and not s.check(["nope"])
        assert s.compare_set("cs", b"", b"first") == b"first"
        assert s.compare_set("cs", b"first", b"second") == b"second"
        if kind != "file":  # torch's FileStore has no delete/num_keys semantics we rely on
            assert s.delete_key("k")
            assert isinstance(s.num_keys(), int)
        with pytest.raises(_C.XcclTimeoutError) as ei:
            s.get("never", timeout=0.2)
        assert "Store.custom" in str(ei.value), kind
        # a communicator bootstraps through the custom store with the GIL released
        c = _C.Comm(s, 0, 1, 5.0)
        x = torch.ones(3)
        c.allreduce(x, x, SUM).wait()
        c.destroy()


class FlakyStore:
    def __init__(self):
        self.d = {}

    def set(self, key, value):
        self.d[key] = bytes(value)

    def get(self, key):
        if key not in self.d:
            raise KeyError(key)
        return self.d[key]

    def add(self, key, delta):
        raise RuntimeError("add is broken")

    def wait(self, keys):  # no timeout parameter
        for k in keys:
            if k not in self.d:
                raise TimeoutError(f"no {k}")

    def check(self, keys):
        return all(k in self.d for k in keys)


def test_custom_store_errors_are_mapped_and_chained():
    s = _C.Store.custom(FlakyStore(), 1.0)
    s.set("a", b"1")
    assert s.get("a", timeout=1.0) == b"1"  # wait(keys, timedelta) -> retried as wait(keys)
    with pytest.raises(_C.XcclError, match="add is broken") as ei:
        s.add("x", 1)
    assert isinstance(ei.value.__cause__, RuntimeError)
    with pytest.raises(_C.XcclTimeoutError, match="no zz") as ei:
        s.wait(["zz"])
    assert isinstance(ei.value.__cause__, TimeoutError)
    with pytest.raises(NotImplementedError, match="delete_key"):
        s.delete_key("a")
    with pytest.raises(NotImplementedError):
        s.num_keys()


def test_store_custom_keyboard_interrupt_passes_through():
    class Interrupting(FlakyStore):
        def set(self, key, value):
            raise KeyboardInterrupt

    s = _C.Store.custom(Interrupting(), 1.0)
    with pytest.raises(KeyboardInterrupt):
        s.set("a", b"x")


def test_custom_store_object_released():
    import weakref

    obj = FlakyStore()
    ref = weakref.ref(obj)
    s = _C.Store.custom(obj, 1.0)
    p = _C.Store.prefix("p", s)
    del obj, s
    gc.collect()
    assert ref() is not None  # the prefix store still uses it
    p.set("k", b"v")
    del p
    gc.collect()
    assert ref() is None


# --------------------------------------------------------------------------- signals, shutdown


def test_destroy_during_a_large_post(comm):
    """A post of a large buffer runs with the GIL released (its start copies sendbuf into
    recvbuf), so another thread may destroy the communicator meanwhile: the post returns or
    raises cleanly, the communicator is freed once, and later calls fail."""
    import threading

    s = np.ones(32 << 20, np.float32)  # 128 MiB
    r = np.zeros_like(s)
    go = threading.Event()

    def destroy():
        go.wait()
        comm.destroy()

    t = threading.Thread(target=destroy)
    t.start()
    for _ in range(2):
        go.set()
        try:
            w = comm.allreduce(s, r, SUM)
        except _C.XcclError as exc:  # destroyed before this post
            assert "destroyed" in str(exc)
            continue
        try:
            w.wait()
            assert (r == 1.0).all()
        except _C.XcclError:  # failed by the destruction
            pass
    t.join()
    with pytest.raises(_C.XcclError, match="destroyed"):
        comm.allreduce(s, r, SUM)


def test_wait_is_interruptible(comm):
    import signal

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    old = signal.signal(signal.SIGALRM, handler)
    try:
        w = comm.irecv(np.zeros(1), 0, 77)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        t0 = time.monotonic()
        with pytest.raises(Interrupted):
            w.wait()
        assert time.monotonic() - t0 < 8.0  # the signal, not the communicator's 10 s timeout
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not w.is_completed()  # the operation goes on
    comm.isend(np.ones(1), 0, 77).wait()
    assert w.wait(5)


def test_comm_dropped_inside_callback():
    c = _C.Comm(_C.Store.hash(5.0), 0, 1, 5.0)
    holder = [c]
    ran = []
    w = c.irecv(np.zeros(1), 0, 1)
    w.add_done_callback(lambda work: (holder.clear(), ran.append(True)))
    s = c.isend(np.ones(1), 0, 1)
    del c  # the callback's closure now holds the last reference
    s.wait(5)
    w.wait(5)
    for _ in range(200):
        if ran:
            break
        time.sleep(0.01)
    assert ran == [True] and holder == []
    _C.Comm(_C.Store.hash(5.0), 0, 1, 5.0).destroy()  # destroys the parked communicator


def test_exit_with_pending_work_is_clean(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "pending.py"
    script.write_text(
        "import numpy as np\n"
        "from xccl import _C\n"
        "c = _C.Comm(_C.Store.hash(5.0), 0, 1, 600.0)\n"
        "kept = c.irecv(np.zeros(4), 0, 1)\n"
        "kept.add_done_callback(lambda w: print('callback', flush=True))\n"
        "c.irecv(np.zeros(4), 0, 2)  # dropped while pending\n"
        "print('done', flush=True)\n"
    )
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("done") and time.monotonic() - t0 < 30


def test_source_rank_survives_destroy():
    c = _C.Comm(_C.Store.hash(5.0), 0, 1, 5.0)
    r = c.irecv(np.zeros(1), _C.ANY_SOURCE, 0)
    assert r.source_rank() == -1
    c.isend(np.ones(1), 0, 0).wait()
    r.wait()
    c.destroy()
    assert r.source_rank() == 0 and r.nbytes == 8


def test_byte_offset_past_the_address_space_refused():
    """Found by tests/fuzz (fuzz_dlpack, UBSan): data + byte_offset wrapped around the address
    space and the wrapped pointer was accepted as the buffer."""
    p = Producer(16, (4,), byte_offset=2**64 - 8)
    with pytest.raises(ValueError, match="runs past the end of the address space"):
        _C.buffer_info(p)
    assert p.deleted == 1
    ok = Producer(24, (4,), byte_offset=8)  # an offset inside the buffer still works
    assert _C.buffer_info(ok) == ("float32", 4, "cpu", False)
