"""The torch.distributed-compatible API of xccl (CPU and CUDA tensors): ``import xccl as
dist`` (or ``from xccl import distributed as dist``) and keep the rest of a torch.distributed
script.

The implementation lives in private modules: ``_group`` (process groups), ``_collectives``
(point-to-point and collectives), ``_objects`` (object collectives), ``_store`` (key/value
stores), ``_work`` (Work handles) and ``_types`` (ReduceOp, Backend, errors).
"""

from __future__ import annotations

from ._collectives import (
    P2POp,
    _all_gather_base,
    _reduce_scatter_base,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    gather,
    irecv,
    isend,
    monitored_barrier,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
)
from ._group import (
    GroupMember,
    ProcessGroup,
    _get_default_store,
    default_group,
    destroy_process_group,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_node_local_rank,
    get_pg_count,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    init_process_group,
    is_available,
    is_initialized,
    is_torchelastic_launched,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    split_group,
)
from ._objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from ._store import FileStore, HashStore, PrefixStore, Store, TCPStore
from ._types import (
    Backend,
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    ReduceOp,
    XcclAuthError,
    XcclConnectionError,
    XcclError,
    XcclMismatchError,
    XcclTimeoutError,
    _make_nccl_premul_sum,
)
from ._work import Work
from .device_mesh import DeviceMesh, init_device_mesh


def is_gloo_available() -> bool:
    """True: the torch backend names are accepted (as aliases of xccl's transports)."""
    return True


def is_nccl_available() -> bool:
    """False: xccl does not use NCCL (it moves CUDA tensors itself, see :mod:`xccl.cuda`)."""
    return False


def is_mpi_available() -> bool:
    """False: xccl does not use MPI."""
    return False


def is_ucc_available() -> bool:
    """False: xccl does not use UCC."""
    return False


def is_backend_available(backend: str) -> bool:
    """True if `backend` is a name init_process_group accepts."""
    try:
        Backend(backend)
    except ValueError:
        return False
    return True


__all__ = [
    "Backend",
    "DeviceMesh",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "FileStore",
    "GroupMember",
    "HashStore",
    "P2POp",
    "PrefixStore",
    "ProcessGroup",
    "ReduceOp",
    "Store",
    "TCPStore",
    "Work",
    "XcclAuthError",
    "XcclConnectionError",
    "XcclError",
    "XcclMismatchError",
    "XcclTimeoutError",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_device_mesh",
    "init_process_group",
    "irecv",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "isend",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "split_group",
]

_get_default_group = default_group

# Private torch names some scripts use; importable, not advertised in __all__.
_private = (_all_gather_base, _reduce_scatter_base, _get_default_store, _make_nccl_premul_sum)
