"""DeviceMesh: ranks arranged in an n-dimensional grid, with one process group per line
of the grid along each dimension (torch.distributed.device_mesh's API).

    mesh = xccl.init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "tp"))
    xccl.all_reduce(x, group=mesh.get_group("tp"))   # the 3 ranks of my row
    mesh["dp"].get_local_rank()                       # my row index

Every process builds every group of every dimension in the same order (new_group
semantics; building a group is local to its members, so this costs nothing for the others).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Optional, Union

from . import _group

__all__ = ["DeviceMesh", "init_device_mesh"]

DimKey = Union[int, str]


def _flatten(mesh: Any) -> tuple[list[int], tuple[int, ...]]:
    """(row-major list of ranks, shape) of a nested list, numpy array or torch tensor."""
    if hasattr(mesh, "tolist"):
        mesh = mesh.tolist()
    if isinstance(mesh, int):
        return [mesh], ()
    shape: list[int] = []
    level: Any = mesh
    while isinstance(level, (list, tuple)):
        shape.append(len(level))
        if not level:
            break
        level = level[0]
    flat: list[int] = []

    def walk(node: Any, depth: int) -> None:
        if depth == len(shape):
            if not isinstance(node, int):
                raise ValueError("DeviceMesh: mesh must be a rectangular array of integer ranks")
            flat.append(int(node))
            return
        if not isinstance(node, (list, tuple)) or len(node) != shape[depth]:
            raise ValueError("DeviceMesh: mesh must be a rectangular array of integer ranks")
        for child in node:
            walk(child, depth + 1)

    walk(mesh, 0)
    return flat, tuple(shape)


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return strides


class DeviceMesh:
    """A grid of global ranks (`mesh`: nested lists, numpy array or torch tensor) of
    `device_type`, optionally with a name per dimension.

    Constructing it creates the process groups of every dimension; every process of the
    job must construct the same meshes in the same order."""

    def __init__(
        self,
        device_type: str,
        mesh: Any,
        *,
        mesh_dim_names: Optional[tuple[str, ...]] = None,
        _init_backend: bool = True,
    ) -> None:
        ranks, shape = _flatten(mesh)
        if not shape:
            raise ValueError("DeviceMesh: mesh must have at least one dimension")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"DeviceMesh: mesh has duplicate ranks: {ranks}")
        names = None if mesh_dim_names is None else tuple(mesh_dim_names)
        if names is not None:
            if len(names) != len(shape):
                raise ValueError(
                    f"mesh_dim_names {names} must have one name per mesh dimension ({len(shape)})"
                )
            if len(set(names)) != len(names):
                raise RuntimeError(f"mesh_dim_names {names} must be unique")
        self._device_type = str(device_type)
        self._ranks = ranks
        self._shape = shape
        self._names = names
        self._groups: list[Any] = []
        if _init_backend:
            if not _group.is_initialized():
                _group.init_process_group()
            self._groups = self._init_groups()

    # -- construction --------------------------------------------------------------------------

    def _lines(self, dim: int) -> list[list[int]]:
        """The rank lists along `dim`, other coordinates in row-major order."""
        others = [range(n) for d, n in enumerate(self._shape) if d != dim]
        strides = _strides(self._shape)
        lines = []
        for coord in itertools.product(*others):
            base = 0
            k = 0
            for d in range(len(self._shape)):
                if d == dim:
                    continue
                base += coord[k] * strides[d]
                k += 1
            lines.append([self._ranks[base + i * strides[dim]] for i in range(self._shape[dim])])
        return lines

    def _init_groups(self) -> list[Any]:
        world = _group.default_group()
        me = world.rank()
        groups = []
        for dim in range(len(self._shape)):
            mine: Any = _group.GroupMember.NON_GROUP_MEMBER
            for line in self._lines(dim):
                if line == list(range(world.size())):
                    pg: Any = world  # a line over the whole world in order is the world
                else:
                    pg = _group.new_group(ranks=line, sort_ranks=False)
                if me in line:
                    mine = pg
            groups.append(mine)
        return groups

    @classmethod
    def _sub(cls, parent: DeviceMesh, dims: list[int]) -> DeviceMesh:
        coord = parent.get_coordinate()
        if coord is None:
            raise RuntimeError("Cannot slice a DeviceMesh that does not contain this rank")
        strides = _strides(parent._shape)
        base = sum(coord[d] * strides[d] for d in range(parent.ndim) if d not in dims)
        ranks = []
        for sub in itertools.product(*(range(parent._shape[d]) for d in dims)):
            offset = sum(c * strides[d] for c, d in zip(sub, dims, strict=True))
            ranks.append(parent._ranks[base + offset])
        mesh = object.__new__(cls)
        mesh._device_type = parent._device_type
        mesh._ranks = ranks
        mesh._shape = tuple(parent._shape[d] for d in dims)
        mesh._names = None if parent._names is None else tuple(parent._names[d] for d in dims)
        mesh._groups = [parent._groups[d] for d in dims]
        return mesh

    @staticmethod
    def from_group(
        group: Any,
        device_type: str,
        mesh: Any = None,
        *,
        mesh_dim_names: Optional[tuple[str, ...]] = None,
    ) -> DeviceMesh:
        """A 1-D mesh over an existing process group (no new group is created)."""
        pg = _group.resolve(group)
        if pg is None:
            raise ValueError("DeviceMesh.from_group: this process is not a member of the group")
        ranks = pg.ranks if mesh is None else _flatten(mesh)[0]
        if ranks != pg.ranks:
            raise ValueError("DeviceMesh.from_group: mesh must list the group's ranks in order")
        dm = DeviceMesh(device_type, ranks, mesh_dim_names=mesh_dim_names, _init_backend=False)
        dm._groups = [pg]
        return dm

    # -- queries -------------------------------------------------------------------------------

    @property
    def device_type(self) -> str:
        """Device type given at construction ("cpu", ...)."""
        return self._device_type

    @property
    def mesh_dim_names(self) -> Optional[tuple[str, ...]]:
        """Names of the dimensions, or None."""
        return self._names

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self._shape)

    @property
    def shape(self) -> tuple[int, ...]:
        """Size of each dimension."""
        return self._shape

    @property
    def mesh(self) -> Any:
        """The grid of global ranks: a torch tensor when torch is importable, else a numpy
        array, else nested lists."""
        try:
            import torch

            return torch.tensor(self._ranks, dtype=torch.int64).reshape(self._shape)
        except ImportError:
            pass
        try:
            import numpy as np

            return np.array(self._ranks, dtype=np.int64).reshape(self._shape)
        except ImportError:
            return self._nested()

    def _nested(self) -> Any:
        out: Any = list(self._ranks)
        for n in reversed(self._shape[1:]):
            out = [out[i : i + n] for i in range(0, len(out), n)]
        return out

    def _dim(self, mesh_dim: DimKey) -> int:
        if isinstance(mesh_dim, str):
            if self._names is None or mesh_dim not in self._names:
                raise KeyError(
                    f"Mesh dimension '{mesh_dim}' does not exist. Available mesh dimensions "
                    f"are: mesh_dim_names={self._names}"
                )
            return self._names.index(mesh_dim)
        dim = int(mesh_dim)
        if not -self.ndim <= dim < self.ndim:
            raise IndexError(f"mesh_dim {mesh_dim} is out of range for a {self.ndim}-D mesh")
        return dim % self.ndim

    def size(self, mesh_dim: Optional[DimKey] = None) -> int:
        """Number of ranks in the mesh, or along `mesh_dim`."""
        if mesh_dim is None:
            return math.prod(self._shape)
        return self._shape[self._dim(mesh_dim)]

    def get_rank(self) -> int:
        """Global rank of this process."""
        return _group.get_rank()

    def get_coordinate(self) -> Optional[list[int]]:
        """This process's index along each dimension, or None if it is not in the mesh."""
        me = _group.get_rank()
        if me not in self._ranks:
            return None
        flat = self._ranks.index(me)
        coord = []
        for stride in _strides(self._shape):
            coord.append(flat // stride)
            flat %= stride
        return coord

    def get_group(self, mesh_dim: Optional[DimKey] = None) -> Any:
        """The process group of this process's line along `mesh_dim` (which may be omitted
        for a 1-D mesh)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise RuntimeError(
                    f"Found the DeviceMesh have {self.ndim} dimensions. Optional kwarg "
                    "`mesh_dim` needs to be specified when device_mesh.ndim > 1."
                )
            mesh_dim = 0
        return self._groups[self._dim(mesh_dim)]

    def get_all_groups(self) -> list[Any]:
        """The process groups of this process, one per dimension."""
        return list(self._groups)

    def get_local_rank(self, mesh_dim: Optional[DimKey] = None) -> int:
        """This process's index along `mesh_dim` (may be omitted for a 1-D mesh)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise RuntimeError(
                    f"Found the DeviceMesh have {self.ndim} dimensions. Optional kwarg "
                    "`mesh_dim` needs to be specified when device_mesh.ndim > 1."
                )
            mesh_dim = 0
        coord = self.get_coordinate()
        if coord is None:
            raise RuntimeError("this process is not part of the DeviceMesh")
        return coord[self._dim(mesh_dim)]

    def __getitem__(self, mesh_dim_names: Union[str, tuple[str, ...]]) -> DeviceMesh:
        """The sub-mesh of the named dimensions that contains this process
        (``mesh["dp"]``, ``mesh["dp", "tp"]``); it reuses this mesh's groups."""
        keys = (mesh_dim_names,) if isinstance(mesh_dim_names, (str, int)) else mesh_dim_names
        if self._names is None:
            raise RuntimeError("Cannot slice a DeviceMesh without mesh_dim_names")
        dims = [self._dim(k) for k in keys]
        if len(set(dims)) != len(dims):
            raise KeyError(f"DeviceMesh slice {mesh_dim_names!r} repeats a dimension")
        return DeviceMesh._sub(self, dims)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return (self._ranks, self._shape, self._names, self._device_type) == (
            other._ranks,
            other._shape,
            other._names,
            other._device_type,
        )

    def __hash__(self) -> int:
        return hash((tuple(self._ranks), self._shape, self._names, self._device_type))

    def __repr__(self) -> str:
        names = "" if self._names is None else f", mesh_dim_names={self._names}"
        return f"DeviceMesh('{self._device_type}', {self._nested()}{names})"


def init_device_mesh(
    device_type: str,
    mesh_shape: tuple[int, ...],
    *,
    mesh_dim_names: Optional[tuple[str, ...]] = None,
) -> DeviceMesh:
    """A mesh of shape `mesh_shape` over all ranks in order (initializing the default
    process group from the environment first if needed); the product of `mesh_shape` must
    equal the world size."""
    shape = tuple(int(n) for n in mesh_shape)
    if mesh_dim_names is not None and len(mesh_dim_names) != len(shape):
        raise RuntimeError(
            "mesh_shape and mesh_dim_names should have same length! "
            f"Found len(mesh_dim_names): {len(mesh_dim_names)} and len(mesh_shape):{len(shape)}."
        )
    if not _group.is_initialized():
        _group.init_process_group()
    world = _group.get_world_size()
    if math.prod(shape) != world:
        raise RuntimeError(
            f"mesh_shape {shape} has {math.prod(shape)} ranks but the world has {world}"
        )
    ranks: Any = list(range(world))
    for n in reversed(shape[1:]):
        ranks = [ranks[i : i + n] for i in range(0, len(ranks), n)]
    return DeviceMesh(device_type, ranks, mesh_dim_names=mesh_dim_names)
