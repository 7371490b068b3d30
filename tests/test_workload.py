"""The shared random workload (tests/workload.py) of the fault driver and the soak test: the
op stream is reproducible and covers every kind, the numpy expectations are right, and a
wrong result is caught (run against a fake one-rank xccl that corrupts its outputs)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import workload as W

import xccl


def test_same_seed_same_ops_and_every_kind_drawn():
    groups = W.random_groups(random.Random(3), 5, 4)
    a = list(W.Workload(9, 5, groups).ops(2000))
    b = list(W.Workload(9, 5, groups).ops(2000))
    assert a == b
    assert {op.kind for op in a} == set(W.KINDS)
    assert {op.dtype for op in a} == set(W.DTYPES)
    assert {op.redop for op in a if op.dtype == "float32"} == set(W.FLOAT_OPS)
    assert {op.redop for op in a if op.dtype == "int32"} == set(W.INT_OPS)
    assert list(W.Workload(10, 5, groups).ops(50)) != a[:50]


def test_reduce_np_by_hand():
    xs = [np.array([1, 2, 6], np.int8), np.array([3, 2, 5], np.int8)]
    assert W.reduce_np("SUM", xs, "int8").tolist() == [4, 4, 11]
    assert W.reduce_np("PRODUCT", xs, "int8").tolist() == [3, 4, 30]
    assert W.reduce_np("MIN", xs, "int8").tolist() == [1, 2, 5]
    assert W.reduce_np("MAX", xs, "int8").tolist() == [3, 2, 6]
    assert W.reduce_np("BAND", xs, "int8").tolist() == [1, 2, 4]
    assert W.reduce_np("BOR", xs, "int8").tolist() == [3, 2, 7]
    assert W.reduce_np("BXOR", xs, "int8").tolist() == [2, 0, 3]
    fs = [x.astype("float32") for x in xs]
    assert W.reduce_np("AVG", fs, "float32").tolist() == [2.0, 2.0, 5.5]
    assert W.reduce_np("PREMUL_SUM", fs, "float32").tolist() == [8.0, 8.0, 22.0]


class _OneRankXccl:
    """A fake xccl for a world of one rank: collectives are identities; ``corrupt`` adds 1 to
    the first element of every output instead."""

    ReduceOp = xccl.ReduceOp
    _make_nccl_premul_sum = staticmethod(xccl._make_nccl_premul_sum)

    def __init__(self, corrupt: bool) -> None:
        self.corrupt = corrupt

    def _touch(self, a):
        if self.corrupt and a.size:
            a.ravel()[0] += 1

    def all_reduce(self, x, op, group, async_op=False):
        self._touch(x)  # one rank: every reduction but PREMUL_SUM is the identity

    def broadcast(self, x, src, group):
        self._touch(x)

    def all_gather_into_tensor(self, out, x, group):
        out[:] = x
        self._touch(out)


@pytest.mark.parametrize("kind", ["all_reduce", "broadcast", "all_gather_into_tensor"])
def test_wrong_result_is_caught(kind):
    wl = W.Workload(1, 1, [[0]], kinds={kind: 1})
    ops = [op for op in wl.ops(40) if op.redop != "PREMUL_SUM"]
    for op in ops:
        assert W.run_op(_OneRankXccl(False), 1, op, None, 0, [0]) == op.count * np.dtype(
            op.dtype).itemsize
    with pytest.raises(W.WrongResult, match=kind):
        W.run_op(_OneRankXccl(True), 1, ops[0], None, 0, [0])
