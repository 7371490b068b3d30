"""Environment variables read by the Python layer.

Every variable is ``XCCL_*`` except the launcher conventions that torch.distributed scripts
already rely on (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) and the fallbacks set by Slurm and Open MPI launchers.

=====================  ======================================================================
``XCCL_TIMEOUT``       default operation timeout in seconds (float); else ``XCCL_TIMEOUT_MS``
                       in milliseconds; else 600 s
``XCCL_AUTH_KEY``      job secret: its UTF-8 bytes authenticate the TCP store and the TCP
                       transport (the C engine reads the same variable the same way)
``RANK``               rank of this process; else ``SLURM_PROCID``, ``OMPI_COMM_WORLD_RANK``,
                       ``PMI_RANK``
``WORLD_SIZE``         number of processes; else ``SLURM_NTASKS``, ``OMPI_COMM_WORLD_SIZE``,
                       ``PMI_SIZE``
``LOCAL_WORLD_SIZE``   processes on this host; else ``SLURM_NTASKS_PER_NODE``,
                       ``OMPI_COMM_WORLD_LOCAL_SIZE``
``XCCL_CUDA_WAIT``     ``stream`` (default): ``Work.wait()`` and blocking calls on CUDA
                       tensors make the current stream wait on the GPU; ``cpu``: the CPU
                       waits until the operation has finished on the GPU
=====================  ======================================================================
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional, Union

DEFAULT_TIMEOUT_S = 600.0

_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_SIZE_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def _first_int(names: tuple[str, ...]) -> Optional[int]:
    """The integer value of the first variable of `names` that is set (None if none is)."""
    for name in names:
        value = os.environ.get(name)
        if value is None or value.strip() == "":
            continue
        try:
            # Slurm writes "4(x2)" for heterogeneous task counts: the leading number is ours.
            return int(value.strip().split("(")[0])
        except ValueError:
            raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return None


def env_rank() -> Optional[int]:
    """Rank from ``RANK`` or the Slurm / Open MPI / PMI fallbacks; None if none is set."""
    return _first_int(_RANK_VARS)


def env_world_size() -> Optional[int]:
    """World size from ``WORLD_SIZE`` or the Slurm / Open MPI / PMI fallbacks."""
    return _first_int(_SIZE_VARS)


def env_local_rank() -> Optional[int]:
    """``LOCAL_RANK`` (None if unset; ValueError if it is not an integer)."""
    return _first_int(("LOCAL_RANK",))


def env_local_world_size() -> Optional[int]:
    """Processes per host from ``LOCAL_WORLD_SIZE`` or the Slurm / Open MPI fallbacks."""
    return _first_int(_LOCAL_SIZE_VARS)


def default_timeout() -> float:
    """The default operation timeout in seconds (``XCCL_TIMEOUT``, ``XCCL_TIMEOUT_MS``, 600)."""
    value = os.environ.get("XCCL_TIMEOUT")
    if value:
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"XCCL_TIMEOUT={value!r} is not a number of seconds") from None
        if seconds <= 0:
            raise ValueError(f"XCCL_TIMEOUT={value!r} must be positive")
        return seconds
    value = os.environ.get("XCCL_TIMEOUT_MS")
    if value:
        try:
            millis = float(value)
        except ValueError:
            raise ValueError(f"XCCL_TIMEOUT_MS={value!r} is not a number") from None
        if millis > 0:
            return millis / 1000.0
    return DEFAULT_TIMEOUT_S


def timeout_seconds(timeout: Union[None, float, int, timedelta], default: float) -> float:
    """Normalises a timeout given as a timedelta, a number of seconds or None (= `default`)."""
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"Expected timeout argument to be of type datetime.timedelta or a number of "
            f"seconds, got {timeout!r}"
        )
    if seconds <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return seconds


def cuda_stream_waits() -> bool:
    """Whether waits on CUDA operations are stream waits (``XCCL_CUDA_WAIT``)."""
    value = os.environ.get("XCCL_CUDA_WAIT", "stream").strip().lower() or "stream"
    if value not in ("stream", "cpu"):
        raise ValueError(f"XCCL_CUDA_WAIT={value!r}: expected 'stream' or 'cpu'")
    return value == "stream"


def auth_key() -> Optional[bytes]:
    """The job secret from ``XCCL_AUTH_KEY`` as bytes (its UTF-8 encoding), or None."""
    value = os.environ.get("XCCL_AUTH_KEY")
    if not value:
        return None
    return value.encode("utf-8")
