"""Small public types shared by the API: reduction operators, backend names, errors."""

from __future__ import annotations

import enum
from typing import Any, Optional, Union

from . import _C

# Exceptions: the C extension's hierarchy, under torch.distributed's names as well.
XcclError = _C.XcclError
XcclTimeoutError = _C.XcclTimeoutError
XcclConnectionError = _C.XcclConnectionError
XcclMismatchError = _C.XcclMismatchError
XcclAuthError = _C.XcclAuthError

DistError = XcclError
DistBackendError = XcclError
DistStoreError = XcclError
DistNetworkError = XcclConnectionError


class ReduceOp:
    """A reduction operator: ``ReduceOp.SUM``, ``PRODUCT``, ``MIN``, ``MAX``, ``BAND``,
    ``BOR``, ``BXOR``, ``AVG`` and ``PREMUL_SUM`` (made by :func:`_make_nccl_premul_sum`).

    As in torch, the class attributes are members of the enum ``ReduceOp.RedOpType`` (with
    torch's numbering) and ``ReduceOp(op)`` wraps one; both forms are accepted everywhere,
    and so are torch.distributed's own ``ReduceOp`` values and the lower-case names
    ("sum", "max", ...).
    """

    class RedOpType(enum.IntEnum):
        """The operator kinds, numbered as in torch.distributed."""

        SUM = 0
        AVG = 1
        PRODUCT = 2
        MIN = 3
        MAX = 4
        BAND = 5
        BOR = 6
        BXOR = 7
        PREMUL_SUM = 8

    SUM = RedOpType.SUM
    AVG = RedOpType.AVG
    PRODUCT = RedOpType.PRODUCT
    MIN = RedOpType.MIN
    MAX = RedOpType.MAX
    BAND = RedOpType.BAND
    BOR = RedOpType.BOR
    BXOR = RedOpType.BXOR
    PREMUL_SUM = RedOpType.PREMUL_SUM

    __slots__ = ("op", "factor")

    def __init__(self, op: Any = RedOpType.SUM, factor: Optional[float] = None) -> None:
        self.op = _op_type(op)
        if self.op == ReduceOp.PREMUL_SUM and factor is None:
            factor = getattr(op, "factor", None)
        self.factor = None if factor is None else _factor_value(factor)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ReduceOp):
            return self.op == other.op and self.factor == other.factor
        if isinstance(other, ReduceOp.RedOpType):
            return self.op == other and self.factor is None
        return NotImplemented

    def __hash__(self) -> int:
        return hash((int(self.op), self.factor))

    def __repr__(self) -> str:
        if self.factor is not None:
            return f"ReduceOp({self.op.name}, factor={self.factor})"
        return f"ReduceOp({self.op.name})"


# Names as the C extension spells them (keys of _C.OPS).
_C_NAMES = {
    ReduceOp.SUM: "sum",
    ReduceOp.AVG: "avg",
    ReduceOp.PRODUCT: "product",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
    ReduceOp.BAND: "band",
    ReduceOp.BOR: "bor",
    ReduceOp.BXOR: "bxor",
    ReduceOp.PREMUL_SUM: "premul_sum",
}
_ALIASES = {"prod": "PRODUCT", "mean": "AVG", "average": "AVG"}


def _factor_value(factor: Any) -> float:
    """A premul factor given as a number or a 1-element tensor/array, as a float."""
    if hasattr(factor, "item"):
        if hasattr(factor, "numel") and factor.numel() != 1:
            raise ValueError("premul_sum factor tensor must have exactly one element")
        if hasattr(factor, "detach"):
            factor = factor.detach()
        return float(factor.item())
    return float(factor)


def _op_type(op: Any) -> ReduceOp.RedOpType:
    """Maps any accepted spelling of an operator to a RedOpType (ValueError otherwise)."""
    if isinstance(op, ReduceOp.RedOpType):
        return op
    if isinstance(op, ReduceOp):
        return op.op
    if isinstance(op, str):
        name = _ALIASES.get(op.lower(), op.upper())
    else:
        inner = getattr(op, "op", None)  # torch.distributed.ReduceOp instance
        if inner is not None and inner is not op:
            return _op_type(inner)
        name = getattr(op, "name", None)  # torch's RedOpType or another enum
    if isinstance(name, str) and name in ReduceOp.RedOpType.__members__:
        return ReduceOp.RedOpType[name]
    valid = ", ".join(ReduceOp.RedOpType.__members__)
    raise ValueError(f"unknown reduce op {op!r}; valid ops: {valid}")


def resolve_op(op: Any) -> tuple[int, float]:
    """(xccl_op_t value, premul factor) for an operator given in any accepted form."""
    kind = _op_type(op)
    factor = 1.0
    if kind == ReduceOp.PREMUL_SUM:
        raw = op.factor if isinstance(op, ReduceOp) else getattr(op, "factor", None)
        if raw is None:
            raise ValueError(
                "ReduceOp.PREMUL_SUM needs a factor: use _make_nccl_premul_sum(factor)"
            )
        factor = _factor_value(raw)
    return _C.OPS[_C_NAMES[kind]], factor


def _make_nccl_premul_sum(factor: Any) -> ReduceOp:
    """A PREMUL_SUM operator: every input is multiplied by `factor` (a number or a
    one-element tensor, whose value is read here) and the products are summed."""
    return ReduceOp(ReduceOp.PREMUL_SUM, _factor_value(factor))


class Backend(str):
    """Backend names. ``Backend(name)`` validates a name and returns it in lower case.

    xccl's own names choose the transports: ``"auto"`` (every transport: shared memory
    between processes of one host, TCP otherwise), ``"tcp"`` (TCP only) and ``"shm"``
    (shared memory where possible, then TCP). torch.distributed's names (``"gloo"``,
    ``"nccl"``, ``"mpi"``, ``"ucc"``, ``"xccl"``, ``"undefined"`` and device maps such as
    ``"cpu:gloo,cuda:nccl"``) are accepted as aliases of ``"auto"``; in a device map the
    ``cpu`` entry decides.
    """

    UNDEFINED = "undefined"
    AUTO = "auto"
    TCP = "tcp"
    SHM = "shm"
    GLOO = "gloo"
    NCCL = "nccl"
    UCC = "ucc"
    MPI = "mpi"
    XCCL = "xccl"

    backend_list = [AUTO, TCP, SHM, GLOO, NCCL, UCC, MPI, XCCL, UNDEFINED]

    def __new__(cls, name: Union[str, Backend]) -> Backend:
        """Validates `name` (case-insensitive) and returns it as a Backend."""
        if not isinstance(name, str):
            raise ValueError("Backend constructor parameter must be string-ish")
        value = name.strip().lower()
        backend_transports(value)  # raises ValueError for unknown names
        return super().__new__(cls, value)


_TRANSPORTS: dict[str, Optional[str]] = {
    "auto": None,
    "tcp": "tcp",
    "shm": "shm,tcp",
    "gloo": None,
    "nccl": None,
    "ucc": None,
    "mpi": None,
    "xccl": None,
    "undefined": None,
}


def backend_transports(name: Optional[str]) -> Optional[str]:
    """The transport list ("shm,tcp", ...) for a backend string; None means every transport
    (or $XCCL_TRANSPORTS when set). Raises ValueError naming the valid names otherwise."""
    if name is None:
        return None
    value = str(name).strip().lower()
    if ":" in value:
        devices: dict[str, str] = {}
        for part in value.split(","):
            device, sep, backend = part.partition(":")
            if not sep or not device.strip() or not backend.strip():
                raise ValueError(f"invalid backend string {name!r}: expected 'device:backend'")
            devices[device.strip()] = backend.strip()
        for backend in devices.values():
            backend_transports(backend)
        return backend_transports(devices.get("cpu", "auto"))
    if value not in _TRANSPORTS:
        valid = ", ".join(repr(b) for b in _TRANSPORTS)
        raise ValueError(f"unknown backend {name!r}; valid backends: {valid}")
    return _TRANSPORTS[value]
