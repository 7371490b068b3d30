"""A DLPack producer in pure ctypes, for testing the consumer in xccl._C without numpy/torch.

It exports any memory with any dtype, shape, strides, byte offset, device and flags, as a
versioned ("dltensor_versioned") or legacy ("dltensor") capsule, and counts how often its
deleter runs, so tests can check that the consumer calls it exactly once.

    p = Producer.of_values("f", [1.0, 2.0, 3.0])        # float32, shape (3,)
    xccl._C.buffer_info(p)                             # ('float32', 3, 'cpu', False)
    p.deleted                                          # 1: buffer_info released it
    p.values()                                         # [1.0, 2.0, 3.0]

The structures follow the DLPack specification (ABI 1.x and the pre-1.0 legacy layout).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import Any, Optional

# --------------------------------------------------------------------------- ABI structures

kDLCPU, kDLCUDA, kDLCUDAHost = 1, 2, 3
kDLInt, kDLUInt, kDLFloat, kDLBfloat, kDLComplex, kDLBool = 0, 1, 2, 4, 5, 6
READ_ONLY, IS_COPIED = 1 << 0, 1 << 1

# struct format letter -> (DLPack code, bits)
FORMATS = {
    "?": (kDLBool, 8),
    "B": (kDLUInt, 8),
    "b": (kDLInt, 8),
    "h": (kDLInt, 16),
    "i": (kDLInt, 32),
    "q": (kDLInt, 64),
    "e": (kDLFloat, 16),
    "f": (kDLFloat, 32),
    "d": (kDLFloat, 64),
}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


# Both managed-tensor kinds get the same deleter type: it only needs the address.
DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", DELETER),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


# --------------------------------------------------------------------------- capsules

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_GetName.restype = ctypes.c_char_p
_api.PyCapsule_GetName.argtypes = [ctypes.c_void_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

# Capsule names must outlive the capsules: module-level bytes objects never go away.
LEGACY_NAME = b"dltensor"
VERSIONED_NAME = b"dltensor_versioned"
_NAMES = {LEGACY_NAME, VERSIONED_NAME}

# address of a managed tensor -> (producer, keep-alive objects)
_live: dict[int, tuple[Producer, tuple[Any, ...]]] = {}


@DELETER
def _deleter(addr: int) -> None:
    owner, _ = _live.pop(addr)
    owner.deleted += 1


_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@_CAPSULE_DESTRUCTOR
def _capsule_destructor(capsule: int) -> None:
    # Called with the capsule at refcount zero: only plain addresses are handled here. A
    # consumer that took the tensor renamed the capsule ("used_..."): nothing to do then.
    name = _api.PyCapsule_GetName(capsule)
    if name not in _NAMES:
        return
    addr = _api.PyCapsule_GetPointer(capsule, name)
    owner, _ = _live[addr]
    owner.unconsumed += 1
    _deleter(addr)


_DESTRUCTOR_ADDR = ctypes.cast(_capsule_destructor, ctypes.c_void_p).value


# --------------------------------------------------------------------------- the producer


class Producer:
    """Exports `nbytes` bytes of its own memory as a DLPack tensor.

    mode: "versioned" (honours max_version, gives a versioned capsule when asked for one),
    "legacy" (a pre-1.0 producer: __dlpack__ has no max_version keyword) or "versioned-only"
    (always versioned). major/minor: the version written into versioned capsules.
    """

    def __init__(
        self,
        nbytes: int,
        shape: Sequence[int],
        dtype: tuple[int, int, int] = (kDLFloat, 32, 1),
        strides: Optional[Sequence[int]] = None,
        device: tuple[int, int] = (kDLCPU, 0),
        byte_offset: int = 0,
        mode: str = "versioned",
        flags: int = 0,
        version: tuple[int, int] = (1, 1),
        capsule_name: Optional[bytes] = None,
        data: Optional[int] = None,
    ) -> None:
        self.buf = (ctypes.c_char * max(nbytes, 1))()
        self.data = data  # exported instead of the own buffer's address (memory it does not own)
        self.shape = tuple(shape)
        self.dtype = dtype
        self.strides = None if strides is None else tuple(strides)
        self.device = device
        self.byte_offset = byte_offset
        self.mode = mode
        self.flags = flags
        self.version = version
        self.capsule_name = capsule_name
        self.exported = 0  # capsules handed out
        self.deleted = 0  # deleter calls (by the consumer or the capsule destructor)
        self.unconsumed = 0  # capsules freed without a consumer taking them
        self.last_kwargs: dict[str, Any] = {}

    @classmethod
    def of_values(cls, fmt: str, values: Sequence[Any], **kw: Any) -> Producer:
        """A 1-D tensor holding `values` packed with struct format letter `fmt`."""
        code, bits = FORMATS[fmt]
        p = cls(len(values) * bits // 8, (len(values),), (code, bits, 1), **kw)
        p.set_values(fmt, values)
        return p

    def set_values(self, fmt: str, values: Sequence[Any], offset: int = 0) -> None:
        data = struct.pack(f"={len(values)}{fmt}", *values)
        ctypes.memmove(ctypes.addressof(self.buf) + offset, data, len(data))

    def values(self, fmt: str = "f", offset: int = 0, count: Optional[int] = None) -> list[Any]:
        size = struct.calcsize(fmt)
        if count is None:
            count = (len(self.buf) - offset) // size
        raw = bytes(self.buf)[offset : offset + count * size]
        return list(struct.unpack(f"={count}{fmt}", raw))

    @property
    def live(self) -> int:
        """Exported tensors whose deleter has not run yet."""
        return self.exported - self.deleted

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Optional[tuple[int, int]] = None,
        dl_device: Any = None,
        copy: Optional[bool] = None,
    ) -> Any:
        self.last_kwargs = {"stream": stream, "max_version": max_version}
        if self.mode == "legacy" and max_version is not None:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        versioned = self.mode == "versioned-only" or (
            self.mode == "versioned" and max_version is not None and max_version[0] >= 1
        )
        return self._export(versioned)

    def _export(self, versioned: bool) -> Any:
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * max(ndim, 1))(*self.shape)
        strides = None
        if self.strides is not None:
            strides = (ctypes.c_int64 * max(ndim, 1))(*self.strides)
        if versioned:
            m = DLManagedTensorVersioned()
            m.version.major, m.version.minor = self.version
            m.flags = self.flags
            name = VERSIONED_NAME
        else:
            m = DLManagedTensor()
            name = LEGACY_NAME
        t = m.dl_tensor
        t.data = ctypes.addressof(self.buf) if self.data is None else self.data
        t.device.device_type, t.device.device_id = self.device
        t.ndim = ndim
        t.dtype.code, t.dtype.bits, t.dtype.lanes = self.dtype
        t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        if strides is not None:
            t.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = self.byte_offset
        m.deleter = _deleter
        addr = ctypes.addressof(m)
        _live[addr] = (self, (m, shape, strides))
        self.exported += 1
        if self.capsule_name is not None:
            name = self.capsule_name
            _NAMES.add(name)
        return _api.PyCapsule_New(addr, name, _DESTRUCTOR_ADDR)
