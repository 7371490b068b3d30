"""Process groups: the default group (init_process_group) and subgroups (new_group,
new_subgroups, split_group), with torch.distributed's names and semantics.

Every group wraps one ``_C.Comm``. Subgroups are made with ``Comm.split`` by their members
only: a split is purely local (no communication), so creating groups can never deadlock,
and non-members simply get ``GroupMember.NON_GROUP_MEMBER``.

Thread-safety: creating and destroying groups takes a module lock; using groups from
several threads at once is safe (the engine serialises per communicator).
"""

from __future__ import annotations

import atexit
import os
import threading
import warnings
from datetime import timedelta
from typing import Any, Optional, Union, cast
from urllib.parse import parse_qs, urlparse

from . import _C, _env
from ._store import FileStore, Store, TCPStore, as_c_store
from ._types import Backend, backend_transports

GroupLike = Union["ProcessGroup", int, None]


class _NotInitializedError(RuntimeError, ValueError):
    """The default process group is missing. A RuntimeError, and a ValueError as torch raises."""


_NOT_INITIALIZED = (
    "Default process group has not been initialized, please make sure to call init_process_group."
)


class ProcessGroup:
    """A group of processes that run collectives together.

    Made by :func:`init_process_group` (the default group, ``GroupMember.WORLD``),
    :func:`new_group`, :func:`new_subgroups` and :func:`split_group`; pass it as ``group=``
    to any operation. Ranks given to operations are global ranks unless the argument is
    named ``group_*``.
    """

    def __init__(
        self,
        comm: _C.Comm,
        ranks: list[int],
        backend: str,
        group_name: str,
        group_desc: str,
        timeout: float,
        timeout_arg: Optional[float],
        store: Optional[Store] = None,
    ) -> None:
        self._comm: Optional[_C.Comm] = comm
        self._ranks = list(ranks)
        self._group_rank = {g: i for i, g in enumerate(self._ranks)}
        self._rank = comm.rank
        self._size = comm.size
        self._backend = Backend(backend)
        self._name = group_name
        self._desc = group_desc
        self._timeout = timeout
        self._timeout_arg = timeout_arg  # per-operation override passed to the engine
        self._store = store
        self._ctl: Optional[_C.Comm] = None  # private comm for monitored_barrier
        self._ctl_seq = 0
        self._lock = threading.Lock()

    def rank(self) -> int:
        """Rank of this process in the group."""
        return self._rank

    def size(self) -> int:
        """Number of processes in the group."""
        return self._size

    def name(self) -> str:
        """Name of the backend the group was made with ("auto", "tcp", "gloo", ...)."""
        return str(self._backend)

    @property
    def group_name(self) -> str:
        """Name of the group ("0" for the default group)."""
        return self._name

    @property
    def group_desc(self) -> str:
        """Description given at creation ("default_pg", "undefined", ...)."""
        return self._desc

    @property
    def ranks(self) -> list[int]:
        """Global ranks of the members, in group-rank order."""
        return list(self._ranks)

    @property
    def comm(self) -> _C.Comm:
        """The xccl communicator behind the group (for the ``xccl._C`` API)."""
        if self._comm is None:
            raise ValueError(f"process group {self._name!r} has been destroyed")
        return self._comm

    @property
    def timeout(self) -> timedelta:
        """Default timeout of the group's operations."""
        return timedelta(seconds=self._timeout)

    def _destroy(self) -> None:
        if _fast_default is self:
            _publish_fast_default(None)
        comm, ctl = self._comm, self._ctl
        self._comm = None
        self._ctl = None
        if ctl is not None:
            ctl.destroy()
        if comm is not None:
            comm.destroy()

    def __repr__(self) -> str:
        state = "" if self._comm is not None else ", destroyed"
        return (
            f"<xccl.ProcessGroup {self._name!r} rank={self._rank} size={self._size} "
            f"backend={str(self._backend)!r}{state}>"
        )


class _World:
    """Module state: the default group and every live subgroup."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.default: Optional[ProcessGroup] = None
        self.groups: list[ProcessGroup] = []
        self.group_count = 0
        self.init_method: Optional[str] = None


# One _World per process, except in threads given their own with _set_thread_world
# (xccl.launch(mode="threads") runs every rank as a thread of one process).
_process_world = _World()


class _ThreadWorld(threading.local):
    """The calling thread's own _World, or None. A class attribute gives threads that never
    set one a plain None: getattr(local, name, None) on a missing name costs an exception,
    about 0.7 µs on every collective."""

    world: Optional[_World] = None


_tls = _ThreadWorld()


# The default group as the one-call paths of _collectives read it: one module attribute
# instead of _current_world()'s thread-local lookup (about 75 ns of a 1 us collective). It is
# the process's default group until some thread gets a world of its own, and None from then
# on (callers then ask _current_world()). Never a destroyed group: _set_default and
# ProcessGroup._destroy clear it.
_fast_default: Optional[ProcessGroup] = None
_thread_worlds = False


def _publish_fast_default(pg: Optional[ProcessGroup]) -> None:
    """Sets _fast_default, and the Comm the C fronts of the API functions call (py_front.c)."""
    global _fast_default
    _fast_default = pg
    if pg is None:
        _C.set_fast_default(None, None)
    else:
        _C.set_fast_default(pg._comm, pg._timeout_arg)


def _current_world() -> _World:
    world = _tls.world
    return _process_world if world is None else world


def _set_thread_world(world: Optional[_World]) -> None:
    """Gives the calling thread its own default group and subgroups (`world`), or (None)
    returns it to the process's."""
    global _thread_worlds
    if world is not None:
        _thread_worlds = True
        _publish_fast_default(None)
    _tls.world = world


class _WorldView:
    """``_world``: the calling thread's _World, attribute by attribute."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_current_world(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(_current_world(), name, value)


_world = cast(_World, _WorldView())


class _WorldAttribute(type):
    """Metaclass giving a class a ``WORLD`` attribute that is always the current default
    group (None before init_process_group and after destroy_process_group)."""

    @property
    def WORLD(cls) -> Optional[ProcessGroup]:  # noqa: N802 - torch.distributed's name
        return _current_world().default


class GroupMember(metaclass=_WorldAttribute):
    """``GroupMember.WORLD`` is the default group (None before init_process_group);
    ``GroupMember.NON_GROUP_MEMBER`` is what group constructors return to processes that
    are not members."""

    NON_GROUP_MEMBER = -100


class group(metaclass=_WorldAttribute):  # noqa: N801 - torch.distributed's name
    """``group.WORLD`` is the default group, as in torch.distributed."""


def _set_default(pg: Optional[ProcessGroup]) -> None:
    _world.default = pg
    _publish_fast_default(None if _thread_worlds else _process_world.default)


# ---------------------------------------------------------------------------------------------
# Looking groups up
# ---------------------------------------------------------------------------------------------


def is_available() -> bool:
    """True: xccl's distributed package is always available."""
    return True


def is_initialized() -> bool:
    """True if the default process group has been initialized (and not destroyed)."""
    return _world.default is not None


def is_torchelastic_launched() -> bool:
    """True when launched by torchrun (``TORCHELASTIC_RUN_ID`` is set)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


def default_group() -> ProcessGroup:
    """The default group; raises if init_process_group was not called (or was undone)."""
    pg = _current_world().default
    if pg is None:
        raise _NotInitializedError(_NOT_INITIALIZED)
    return pg


def is_non_member(grp: Any) -> bool:
    """True for ``GroupMember.NON_GROUP_MEMBER``."""
    return type(grp) is int and grp == GroupMember.NON_GROUP_MEMBER


def resolve(grp: GroupLike) -> Optional[ProcessGroup]:
    """The ProcessGroup meant by a ``group=`` argument; None for NON_GROUP_MEMBER."""
    if grp is None:
        return default_group()
    if isinstance(grp, ProcessGroup):
        if grp._comm is None:
            if _world.default is None:
                raise _NotInitializedError(_NOT_INITIALIZED)
            raise ValueError(f"Invalid process group specified: {grp!r} was destroyed")
        return grp
    if is_non_member(grp):
        return None
    raise TypeError(f"Expecting a ProcessGroup, but got a {type(grp).__name__}.")


def warn_not_in_group(op_name: str) -> None:
    """The warning torch emits when a non-member calls an operation on a group."""
    pg = _world.default
    global_rank = -1 if pg is None else pg.rank()
    warnings.warn(
        f"Running {op_name} on global rank {global_rank} which does not belong to the given group.",
        stacklevel=3,
    )


def get_rank(group: GroupLike = None) -> int:
    """Rank of this process in `group` (default: the default group); -1 if not a member."""
    pg = resolve(group)
    return -1 if pg is None else pg.rank()


def get_world_size(group: GroupLike = None) -> int:
    """Number of processes in `group` (default: the default group); -1 if not a member."""
    pg = resolve(group)
    return -1 if pg is None else pg.size()


def get_backend(group: GroupLike = None) -> Backend:
    """The backend name `group` was created with (lower case)."""
    pg = resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified")
    return pg._backend


def get_process_group_ranks(group: GroupLike) -> list[int]:
    """Global ranks of the members of `group`, in group-rank order."""
    pg = resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified: this process is not a member")
    return list(pg._ranks)


def get_group_rank(group: GroupLike, global_rank: int) -> int:
    """The rank in `group` of the process with global rank `global_rank`."""
    pg = resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified: this process is not a member")
    if pg is _world.default:
        return int(global_rank)
    try:
        return pg._group_rank[int(global_rank)]
    except KeyError:
        raise ValueError(f"Global rank {global_rank} is not part of group {pg!r}") from None


def get_global_rank(group: GroupLike, group_rank: int) -> int:
    """The global rank of the process with rank `group_rank` in `group`."""
    pg = resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified: this process is not a member")
    if pg is _current_world().default:
        return int(group_rank)
    if not 0 <= int(group_rank) < pg.size():
        raise ValueError(f"Group rank {group_rank} is not part of group {pg!r}")
    return pg._ranks[int(group_rank)]


def canonical_rank(
    pg: ProcessGroup,
    global_rank: Optional[int],
    group_rank: Optional[int],
    what: str,
) -> int:
    """The group rank meant by a (global rank, group rank) argument pair; exactly one of the
    two must be given. Raises ValueError for ranks outside the group."""
    if group_rank is not None:
        if global_rank is not None:
            raise ValueError(f"Can't specify both {what} and group_{what}")
        rank = int(group_rank)
    elif global_rank is None:
        raise ValueError(f"Must specify {what} or group_{what}")
    elif pg is _current_world().default:
        rank = int(global_rank)
    else:
        rank = get_group_rank(pg, global_rank)
    if not 0 <= rank < pg.size():
        raise ValueError(
            f"Invalid {what} rank {rank}: the group has {pg.size()} ranks (0 to {pg.size() - 1})"
        )
    return rank


# ---------------------------------------------------------------------------------------------
# init / destroy
# ---------------------------------------------------------------------------------------------


def _rendezvous(
    init_method: str, rank: int, world_size: int, timeout: float
) -> tuple[Store, int, int]:
    """Parses an init_method URL; returns (store, rank, world_size)."""
    url = urlparse(init_method)
    query = {k: v[-1] for k, v in parse_qs(url.query).items()}

    def pick(arg: int, key: str, env_value: Optional[int]) -> int:
        if arg is not None and arg >= 0:
            return int(arg)
        if key in query:
            return int(query[key])
        if env_value is not None:
            return env_value
        raise ValueError(
            f"Error initializing xccl using {url.scheme}:// rendezvous: {key} is not given "
            f"(pass {key}=, add ?{key}= to the URL"
            + (", or set the environment variable)" if url.scheme == "env" else ")")
        )

    scheme = url.scheme
    if scheme == "env":
        rank = pick(rank, "rank", _env.env_rank())
        world_size = pick(world_size, "world_size", _env.env_world_size())
        host = os.environ.get("MASTER_ADDR")
        port = os.environ.get("MASTER_PORT")
        for name, value in (("MASTER_ADDR", host), ("MASTER_PORT", port)):
            if not value:
                raise ValueError(
                    "Error initializing xccl using env:// rendezvous: environment variable "
                    f"{name} expected, but not set"
                )
        assert host is not None and port is not None
        store: Store = TCPStore(host, int(port), world_size, rank == 0, timedelta(seconds=timeout))
    elif scheme == "tcp":
        rank = pick(rank, "rank", None)
        world_size = pick(world_size, "world_size", None)
        if not url.hostname or url.port is None:
            raise ValueError(f"tcp:// init_method needs a host and a port: {init_method!r}")
        store = TCPStore(url.hostname, url.port, world_size, rank == 0, timedelta(seconds=timeout))
    elif scheme == "file":
        rank = pick(rank, "rank", None)
        world_size = pick(world_size, "world_size", None)
        path = url.path if not url.netloc else url.netloc + url.path
        if not path:
            raise ValueError(f"file:// init_method needs a path: {init_method!r}")
        store = FileStore(path, world_size)
        store.set_timeout(timedelta(seconds=timeout))
    else:
        raise ValueError(
            f"unsupported init_method {init_method!r}: use env://, tcp://host:port or file:///path"
        )
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
    return store, rank, world_size


def init_process_group(
    backend: Optional[str] = None,
    init_method: Optional[str] = None,
    timeout: Union[None, timedelta, float] = None,
    world_size: int = -1,
    rank: int = -1,
    store: Optional[Any] = None,
    group_name: str = "",
    pg_options: Optional[Any] = None,
    device_id: Optional[Any] = None,
) -> None:
    """Initializes the default process group; every process of the job calls it.

    Processes meet through `store` (an xccl store or a torch.distributed store; then
    `rank` and `world_size` are required) or through `init_method` (default ``env://``):

    - ``env://``: ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` (RANK and
      WORLD_SIZE fall back to Slurm's ``SLURM_PROCID``/``SLURM_NTASKS`` and Open MPI's
      ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE``);
    - ``tcp://host:port`` with `rank`/`world_size` or ``?rank=&world_size=``;
    - ``file:///path`` likewise.

    With the URL forms rank 0 hosts a TCP store. `backend` picks the transports
    (``"auto"``, ``"tcp"``, ``"shm"``; torch names such as ``"gloo"`` mean ``"auto"``).
    `timeout` (timedelta or seconds; default ``XCCL_TIMEOUT`` or 600 s) bounds every
    operation of the group. `device_id` (``torch.device("cuda", i)`` or ``"cuda:i"``) makes GPU
    i the process's GPU (:func:`xccl.cuda.set_device`); `group_name` and `pg_options` are
    accepted for torch compatibility.
    """
    with _world.lock:
        if _world.default is not None:
            raise ValueError("trying to initialize the default process group twice!")
        if store is not None and init_method is not None:
            raise ValueError("Cannot specify both init_method and store.")
        _check_device(device_id, bind=True)
        name = Backend(backend if backend is not None else "auto")
        transports = backend_transports(name)
        seconds = _env.timeout_seconds(timeout, _env.default_timeout())
        if store is not None:
            if world_size is None or world_size <= 0:
                raise ValueError("world_size must be positive if using store")
            if rank is None or rank < 0:
                raise ValueError("rank must be non-negative if using store")
            if rank >= world_size:
                raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
            base = store
        else:
            init_method = init_method or "env://"
            base, rank, world_size = _rendezvous(init_method, rank, world_size, seconds)
        # Keys of xccl's bootstrap live under a prefix, so the store can be shared.
        cstore = _C.Store.prefix("default_pg", as_c_store(base, seconds))
        comm = _C.Comm(
            cstore,
            int(rank),
            int(world_size),
            seconds,
            transports,
            _env.auth_key(),
            "default_pg",
        )
        pg = ProcessGroup(
            comm,
            list(range(world_size)),
            name,
            "0",
            "default_pg",
            seconds,
            None,
            base if isinstance(base, Store) else None,
        )
        _world.groups = [pg]
        _world.group_count = 0
        _world.init_method = init_method
        _set_default(pg)


def _check_device(device_id: Any, bind: bool = False) -> None:
    """device_id of init_process_group / new_group: None, a CPU device, or a CUDA device with
    an index (torch.device("cuda", i), "cuda:i"), which (`bind`) becomes the process's GPU
    (xccl.cuda.set_device) as torch's device_id binds the process to it."""
    if device_id is None:
        return
    kind = getattr(device_id, "type", device_id)
    if isinstance(kind, str) and kind.split(":")[0] == "cpu":
        return
    if isinstance(kind, str) and kind.split(":")[0] == "cuda":
        from . import cuda

        index = cuda._device_index(device_id)  # ValueError without an index
        if bind:
            cuda.set_device(index)
        return
    raise ValueError(
        f"device_id {device_id!r}: expected a CPU device or a CUDA device with an index "
        "(torch.device('cuda', i) or 'cuda:i')"
    )


def destroy_process_group(group: GroupLike = None) -> None:
    """Destroys `group`, or (default) every group and the default group.

    Never waits for other processes: pending operations of the group fail with
    :class:`XcclError`. Calling it again, or before init_process_group, does nothing."""
    with _world.lock:
        if is_non_member(group):
            return
        if group is None or group is _world.default:
            groups, _world.groups = _world.groups, []
            for pg in reversed(groups):
                pg._destroy()
            _world.group_count = 0
            _world.init_method = None
            _set_default(None)
            return
        if not isinstance(group, ProcessGroup):
            raise TypeError(f"Expecting a ProcessGroup, but got a {type(group).__name__}.")
        group._destroy()
        if group in _world.groups:
            _world.groups.remove(group)


def _destroy_at_exit() -> None:
    # Leaves no engine thread calling back into a finalizing interpreter.
    _set_thread_world(None)
    try:
        destroy_process_group()
    except Exception:
        pass


atexit.register(_destroy_at_exit)


# ---------------------------------------------------------------------------------------------
# Subgroups
# ---------------------------------------------------------------------------------------------


def _hashed_name(ranks: list[int]) -> str:
    import hashlib  # here: it is slow to import and only subgroups need it

    return hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()


def _make_subgroup(
    parent: ProcessGroup,
    parent_ranks: list[int],
    global_ranks: list[int],
    backend: Optional[str],
    name: str,
    desc: Optional[str],
    timeout: Union[None, timedelta, float],
) -> ProcessGroup:
    """Splits `parent` over `parent_ranks` (ranks of parent) and registers the result."""
    world = default_group()
    seconds = _env.timeout_seconds(timeout, parent._timeout)
    comm = parent.comm.split(parent_ranks, name)
    pg = ProcessGroup(
        comm,
        global_ranks,
        Backend(backend) if backend else parent._backend,
        name,
        desc or "undefined",
        seconds,
        None if seconds == world._timeout else seconds,
    )
    _world.groups.append(pg)
    return pg


def new_group(
    ranks: Optional[list[int]] = None,
    timeout: Union[None, timedelta, float] = None,
    backend: Optional[str] = None,
    pg_options: Optional[Any] = None,
    use_local_synchronization: bool = False,
    group_desc: Optional[str] = None,
    device_id: Optional[Any] = None,
    sort_ranks: bool = True,
) -> Any:
    """Creates a group of the processes with global ranks `ranks` (default: all).

    As in torch, every process of the job calls it with the same arguments, in the same
    order relative to other group creations; members get the new ProcessGroup, the others
    ``GroupMember.NON_GROUP_MEMBER`` (None with `use_local_synchronization`, where only
    members need to call). Creation is local to each process: nothing is exchanged.
    `timeout` applies to the group's collectives (point-to-point operations keep the default
    group's timeout); `pg_options` and `device_id` are accepted and ignored.
    """
    with _world.lock:
        world = default_group()
        if backend:
            Backend(backend)
        _check_device(device_id)
        size = world.size()
        if ranks is None or len(ranks) == 0:  # torch treats [] as "every rank" too
            members = list(range(size))
        else:
            members = [int(r) for r in ranks]
            if sort_ranks:
                members.sort()
            if len(set(members)) != len(members):
                raise ValueError(f"ranks list must not contain duplicate entries, got {ranks}")
            for r in members:
                if not 0 <= r < size:
                    raise ValueError(
                        f"Rank {r} is out of range. Valid ranks are 0 to {size - 1} "
                        f"(world_size={size})"
                    )
        if use_local_synchronization:
            name = _hashed_name(members)
        else:
            _world.group_count += 1
            name = str(_world.group_count)
        if world.rank() not in members:
            return None if use_local_synchronization else GroupMember.NON_GROUP_MEMBER
        return _make_subgroup(world, members, members, backend, name, group_desc, timeout)


def new_subgroups(
    group_size: Optional[int] = None,
    group: GroupLike = None,
    timeout: Union[None, timedelta, float] = None,
    backend: Optional[str] = None,
    pg_options: Optional[Any] = None,
    group_desc: Optional[str] = None,
) -> tuple[Any, list[Any]]:
    """Splits `group` (default: all processes) into consecutive subgroups of `group_size`
    ranks; returns (this process's subgroup, every subgroup) as torch does. Without
    `group_size`, the number of processes per host (``LOCAL_WORLD_SIZE``) is used."""
    if group_size is None:
        group_size = _env.env_local_world_size()
        if group_size is None:
            raise ValueError(
                "new_subgroups: pass group_size (the default, the number of processes per "
                "host, needs LOCAL_WORLD_SIZE to be set)"
            )
    if group_size <= 0:
        raise ValueError(f"The arg 'group_size' ({group_size}) must be positive")
    ranks = get_process_group_ranks(group)
    world_size = len(ranks)
    if world_size < group_size:
        raise ValueError(
            f"The arg 'group_size' ({group_size}) must not exceed the world size ({world_size})"
        )
    if world_size % group_size != 0:
        raise ValueError(
            f"The world size ({world_size}) must be divisible by 'group_size={group_size}'"
        )
    chunks = [ranks[i : i + group_size] for i in range(0, world_size, group_size)]
    return new_subgroups_by_enumeration(
        chunks, timeout=timeout, backend=backend, pg_options=pg_options, group_desc=group_desc
    )


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: list[list[int]],
    timeout: Union[None, timedelta, float] = None,
    backend: Optional[str] = None,
    pg_options: Optional[Any] = None,
    group_desc: Optional[str] = None,
) -> tuple[Any, list[Any]]:
    """Creates one subgroup per list of global ranks (the lists must not overlap; some ranks
    may be in none); returns (this process's subgroup or None, every subgroup)."""
    if not ranks_per_subgroup_list:
        raise ValueError("The arg 'ranks_per_subgroup_list' cannot be empty")
    seen: dict[int, list[int]] = {}
    for ranks in ranks_per_subgroup_list:
        for r in ranks:
            if r in seen:
                raise ValueError(
                    f"Rank {r} has appeared in both subgroup {seen[r]} and {list(ranks)}"
                )
            seen[r] = list(ranks)
    me = get_rank()
    subgroups = []
    current = None
    for ranks in ranks_per_subgroup_list:
        sub = new_group(
            ranks=ranks,
            timeout=timeout,
            backend=backend,
            pg_options=pg_options,
            group_desc=group_desc,
        )
        subgroups.append(sub)
        if me in ranks:
            current = sub
    return current, subgroups


def split_group(
    parent_pg: Optional[ProcessGroup] = None,
    split_ranks: Optional[list[list[int]]] = None,
    timeout: Union[None, timedelta, float] = None,
    pg_options: Optional[Any] = None,
    group_desc: Optional[str] = None,
    backend: Optional[str] = None,
) -> Optional[ProcessGroup]:
    """Splits `parent_pg` (default: the default group) into disjoint groups given as lists
    of ranks *of the parent*; returns this process's group, or None if it is in none.

    Every member of the parent calls it with the same `split_ranks`; as with new_group,
    nothing is exchanged."""
    if not split_ranks:
        raise ValueError("split_ranks cannot be None or empty")
    with _world.lock:
        parent = resolve(parent_pg)
        if parent is None:
            raise ValueError("split_group: this process is not a member of the parent group")
        if backend:
            Backend(backend)
        mine: Optional[list[int]] = None
        seen: set[int] = set()
        for split in split_ranks:
            ranks = [int(r) for r in split]
            if not ranks:
                raise ValueError("the split group cannot be empty")
            if len(set(ranks)) != len(ranks):
                raise ValueError("the split group cannot have duplicate ranks")
            for r in ranks:
                if not 0 <= r < parent.size():
                    raise ValueError(
                        f"split_group: rank {r} is not a rank of the parent group "
                        f"(size {parent.size()})"
                    )
                if r in seen:
                    raise ValueError(f"split_group: rank {r} appears in more than one split")
                seen.add(r)
            if parent.rank() in ranks:
                mine = sorted(ranks)
        if mine is None:
            return None
        global_ranks = [parent._ranks[r] for r in mine]
        name = _hashed_name(global_ranks)
        return _make_subgroup(parent, mine, global_ranks, backend, name, group_desc, timeout)


def get_node_local_rank(fallback_rank: Optional[int] = None) -> int:
    """Rank of this process among the processes of its host: ``LOCAL_RANK`` (set by xccl-run
    and torchrun), else `fallback_rank`; RuntimeError when neither is available."""
    value = os.environ.get("LOCAL_RANK")
    if value:
        return int(value)
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "LOCAL_RANK is not in the environment. Consider passing fallback_rank to allow "
        "`get_node_local_rank` to work, assuming you are not running in a multi-device "
        "context and want the code to run locally instead."
    )


def get_pg_count() -> int:
    """Number of live process groups of this process (the default group included)."""
    return len(_world.groups)


def _get_default_store() -> Store:
    """The store the default group was initialized with (raises if none is known)."""
    pg = default_group()
    if pg._store is None:
        raise ValueError("the default group was initialized with a foreign store object")
    return pg._store


def ctl_comm(pg: ProcessGroup) -> tuple[_C.Comm, int]:
    """A private communicator of `pg`'s members (separate from user traffic) and the next
    sequence number on it; made on first use, by every member in the same call."""
    with pg._lock:
        if pg._ctl is None:
            pg._ctl = pg.comm.split(list(range(pg.size())), f"{pg._name}/ctl")
        pg._ctl_seq += 1
        return pg._ctl, pg._ctl_seq
