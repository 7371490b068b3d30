"""xccl: collective communication with a C engine and torch.distributed's Python API.

    import xccl as dist                       # instead of: import torch.distributed as dist
    dist.init_process_group("auto")           # env:// by default
    dist.all_reduce(x)                        # x: a CPU torch tensor, numpy array, ...

Everything of :mod:`xccl.distributed` is re-exported here; :mod:`xccl.device_mesh` holds
DeviceMesh, :mod:`xccl.cuda` what the process has of CUDA (its GPU, the build) and
``xccl._C`` the C extension.
"""

from __future__ import annotations

from . import _C, cuda, device_mesh, distributed
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

__all__ = [*_api, "cuda", "device_mesh", "distributed"]


_private = (
    _C,
    _all_gather_base,
    _get_default_group,
    _get_default_store,
    _make_nccl_premul_sum,
    _reduce_scatter_base,
)


# --- teaching and observability (xccl.launch, trace, debug, explain, teach) ----------------
# xccl.launch and xccl.trace are functions named like modules of this package (xccl/launch.py,
# xccl/trace.py). Both are imported before their names are bound to the functions: Python sets
# a package attribute only when it first loads a submodule, so no later import can put the
# module back in the function's place. xccl.bench is the command-line module (xccl-bench,
# `python -m xccl.bench`), not imported here; the teaching benchmark is xccl.teach.bench.
from . import debug, teach  # noqa: E402
from .launch import LaunchError, LaunchTimeoutError, launch  # noqa: E402
from .teach import Model, explain  # noqa: E402
from .trace import Trace, trace  # noqa: E402

__all__ += ["LaunchError", "LaunchTimeoutError", "Model", "Trace", "debug", "explain", "launch",
            "teach", "trace"]
