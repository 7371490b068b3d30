"""xccl: collective communication with a C engine and torch.distributed's Python API.

    import xccl as dist                       # instead of: import torch.distributed as dist
    dist.init_process_group("auto")           # env:// by default
    dist.all_reduce(x)                        # x: a CPU torch tensor, numpy array, ...

Everything of :mod:`xccl.distributed` is re-exported here; :mod:`xccl.device_mesh` holds
DeviceMesh and ``xccl._C`` the C extension.
"""

from __future__ import annotations

from . import _C, device_mesh, distributed
from .distributed import *  # noqa: F403 - the public API is distributed.__all__
from .distributed import (
    __all__ as _api,
)
from .distributed import (  # private torch names, importable but not in __all__
    _all_gather_base,
    _get_default_group,
    _get_default_store,
    _make_nccl_premul_sum,
    _reduce_scatter_base,
)

__version__ = "0.1.0"

# torch.distributed.distributed_c10d, for scripts that reach into it
# (``dist.distributed_c10d._get_default_group()``).
distributed_c10d = distributed

__all__ = [*_api, "device_mesh", "distributed"]


def __getattr__(name: str) -> object:
    # xccl.explain(...) without importing the teaching helpers with every `import xccl`.
    if name == "explain":
        from .teach import explain

        return explain
    raise AttributeError(f"module 'xccl' has no attribute {name!r}")


_private = (
    _C,
    _all_gather_base,
    _get_default_group,
    _get_default_store,
    _make_nccl_premul_sum,
    _reduce_scatter_base,
)
