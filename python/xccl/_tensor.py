"""Helpers over the two tensor kinds the Python layer manipulates itself: torch tensors and
numpy arrays. Any other DLPack producer is viewed as one of them (torch when torch is loaded
or the tensor is in CUDA memory, else numpy) where the layer needs temporaries or copies;
single-buffer operations hand the user's object to the C extension untouched. Temporaries are
made on the device of the tensor they are made like.

Neither torch nor numpy is imported here unless the caller's objects come from them.
"""

from __future__ import annotations

import sys
from typing import Any

from . import _C

_INTEGER_DTYPES = frozenset({"bool", "uint8", "int8", "int16", "int32", "int64"})


def _torch() -> Any:
    return sys.modules.get("torch")


def is_torch(t: Any) -> bool:
    """True for a torch.Tensor (torch is necessarily imported already)."""
    torch = _torch()
    return torch is not None and isinstance(t, torch.Tensor)


def is_numpy(t: Any) -> bool:
    """True for a numpy.ndarray."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(t, np.ndarray)


def prep(t: Any) -> Any:
    """The object to hand to the C extension: torch tensors that require grad are detached
    (the data is shared, autograd is not involved in communication)."""
    if getattr(t, "requires_grad", False) and is_torch(t):
        return t.detach()
    return t


def native(t: Any, what: str = "tensor") -> Any:
    """`t` as a torch tensor or numpy array (a view of the same memory)."""
    if is_torch(t):
        return t.detach() if t.requires_grad else t
    if is_numpy(t):
        return t
    if not hasattr(t, "__dlpack__"):
        raise TypeError(
            f"Invalid function argument: expected `{what}` to be a tensor (torch.Tensor, "
            f"numpy.ndarray or another DLPack producer), got {type(t).__name__}"
        )
    torch = _torch()
    if torch is None and _on_cuda(t):
        # numpy cannot view device memory: CUDA tensors of other producers go through torch
        try:
            import torch
        except ImportError:
            raise NotImplementedError(
                f"`{what}`: operations that copy CUDA tensors given in lists need torch to "
                f"view {type(t).__name__} (torch is not installed)"
            ) from None
    if torch is not None:
        return torch.from_dlpack(t)
    import numpy as np

    return np.from_dlpack(t)


def _on_cuda(t: Any) -> bool:
    """True for a DLPack producer whose tensor lives in CUDA device (or managed) memory."""
    from . import cuda

    return cuda._device_of(t)[0] in cuda._CUDA_TYPES


def check_tensor(t: Any, what: str) -> None:
    """TypeError unless `t` looks like a tensor (has ``__dlpack__``)."""
    if not hasattr(t, "__dlpack__"):
        raise TypeError(
            f"Invalid function argument: expected `{what}` to be a tensor (torch.Tensor, "
            f"numpy.ndarray or another DLPack producer), got {type(t).__name__}"
        )


def check_tensor_list(ts: Any, what: str) -> list[Any]:
    """TypeError unless `ts` is a list (or tuple) of tensors; returns it as a list."""
    if not isinstance(ts, (list, tuple)):
        raise TypeError(
            f"Invalid function argument: expected `{what}` to be a list of tensors, "
            f"got {type(ts).__name__}"
        )
    for i, t in enumerate(ts):
        check_tensor(t, f"{what}[{i}]")
    return list(ts)


def numel(t: Any) -> int:
    """Number of elements."""
    if is_torch(t):
        return t.numel()
    if is_numpy(t):
        return int(t.size)
    return _C.buffer_info(t)[1]


def dtype_name(t: Any) -> str:
    """Element type as xccl names it ("float32", "bfloat16", "int64", ...)."""
    if is_torch(t):
        return str(t.dtype).replace("torch.", "")
    if is_numpy(t) and t.dtype.kind in "biufc":
        return t.dtype.name
    return _C.buffer_info(t)[0]


def is_integer(t: Any) -> bool:
    """True for integer and bool element types."""
    return dtype_name(t) in _INTEGER_DTYPES


def shape(t: Any) -> tuple[int, ...]:
    """The shape as a tuple of ints."""
    return tuple(int(d) for d in t.shape)


def is_contiguous(t: Any) -> bool:
    """True if the elements are dense in row-major order."""
    if is_torch(t):
        return t.is_contiguous()
    if is_numpy(t):
        return bool(t.flags.c_contiguous)
    return True


def check_writable(t: Any, what: str) -> None:
    """ValueError if `t` is a read-only array (outputs must be writable)."""
    if is_numpy(t) and not t.flags.writeable:
        raise ValueError(f"`{what}` is read-only; an output buffer must be writable")


def check_same_dtype(tensors: list[Any]) -> None:
    """ValueError naming both types if the tensors do not all have the same element type."""
    first = None
    for t in tensors:
        name = dtype_name(t)
        if first is None:
            first = name
        elif name != first:
            raise ValueError(
                f"Invalid usage of tensors with different dtypes: found {first} and {name}"
            )


def empty_flat(like: Any, count: int) -> Any:
    """A new contiguous 1-D buffer of `count` elements of `like`'s kind and element type."""
    if is_torch(like):
        return _torch().empty(count, dtype=like.dtype, device=like.device)
    import numpy as np

    return np.empty(count, dtype=like.dtype)


def flat(t: Any) -> Any:
    """A 1-D view of a contiguous tensor."""
    return t.reshape(-1)


def copy_into(dst: Any, src: Any) -> None:
    """Copies `src` (a flat buffer with as many elements) into `dst`, which may have any
    shape and strides; the kinds may differ (torch <-> numpy)."""
    if is_torch(dst):
        if not is_torch(src):
            src = _torch().from_numpy(src) if is_numpy(src) else _torch().from_dlpack(src)
        if dst.requires_grad:
            dst = dst.detach()
        dst.copy_(src.reshape(dst.shape))
        return
    import numpy as np

    if is_torch(src):
        src = src.numpy()
    np.copyto(dst, np.asarray(src).reshape(dst.shape), casting="no")


def pack(tensors: list[Any], like: Any) -> tuple[Any, list[int]]:
    """Concatenates `tensors` (flattened) into one new flat buffer of `like`'s kind; returns
    it and the element count of each piece."""
    counts = [numel(t) for t in tensors]
    buf = empty_flat(like, sum(counts))
    offset = 0
    for t, n in zip(tensors, counts, strict=True):
        copy_into(buf[offset : offset + n], flat_of(t))
        offset += n
    return buf, counts


def flat_of(t: Any) -> Any:
    """A 1-D view (or copy, when not contiguous) of `t`, in the same kind."""
    if is_torch(t):
        return t.detach().reshape(-1)
    return t.reshape(-1)
