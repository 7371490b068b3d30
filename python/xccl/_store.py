"""Key/value stores with torch.distributed's classes and methods, backed by ``_C.Store``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

from . import _C, _env

_DEFAULT_STORE_TIMEOUT = timedelta(seconds=300)


def _bytes(value: Union[str, bytes, bytearray, memoryview]) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    return bytes(value)


class Store:
    """Base class of the stores: a key/value map shared by the processes of a job.

    Values are bytes (str values are stored UTF-8 encoded). Every call that waits does so up
    to the store's timeout (or the `timeout` given to the call) and then raises
    :class:`XcclTimeoutError` naming the missing keys. Thread-safe.
    """

    _store: _C.Store

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Store is abstract: use TCPStore, FileStore, HashStore or PrefixStore")

    @classmethod
    def _wrap(cls, cstore: _C.Store) -> Store:
        self = object.__new__(cls)
        self._store = cstore
        return self

    def set(self, key: str, value: Union[str, bytes]) -> None:
        """Stores `value` under `key`, replacing any previous value."""
        self._store.set(key, _bytes(value))

    def get(self, key: str) -> bytes:
        """The value of `key`, waiting for it to be set up to the store's timeout."""
        return self._store.get(key)

    def add(self, key: str, amount: int) -> int:
        """Atomically adds `amount` to the integer under `key` (missing = 0); returns the sum."""
        return self._store.add(key, int(amount))

    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        """Waits until every key of `keys` is set (up to `timeout`, default the store's)."""
        if isinstance(keys, str):
            keys = [keys]
        if timeout is None:
            self._store.wait(list(keys))
        else:
            self._store.wait(list(keys), _env.timeout_seconds(timeout, 0.0))

    def check(self, keys: list[str]) -> bool:
        """True if every key of `keys` is set (does not wait)."""
        if isinstance(keys, str):
            keys = [keys]
        return self._store.check(list(keys))

    def compare_set(
        self, key: str, expected_value: Union[str, bytes], desired_value: Union[str, bytes]
    ) -> bytes:
        """Sets `key` to `desired_value` if it holds `expected_value` (or is missing and
        `expected_value` is empty); returns the value now stored, as torch does."""
        return self._store.compare_set(key, _bytes(expected_value), _bytes(desired_value))

    def delete_key(self, key: str) -> bool:
        """Removes `key`; True if it existed."""
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        """Number of keys in the store (for TCP and file stores, including internal ones)."""
        return self._store.num_keys()

    def multi_set(self, keys: list[str], values: list[Union[str, bytes]]) -> None:
        """Sets several keys (one after the other)."""
        if len(keys) != len(values):
            raise ValueError("multi_set: keys and values must have the same length")
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of several keys, waiting for each."""
        return [self.get(key) for key in keys]

    def set_timeout(self, timeout: timedelta) -> None:
        """Sets the default timeout of the waiting calls."""
        self._store.timeout = _env.timeout_seconds(timeout, 0.0)

    @property
    def timeout(self) -> timedelta:
        """The default timeout of the waiting calls."""
        return timedelta(seconds=self._store.timeout)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(timeout={self.timeout})"


class TCPStore(Store):
    """A store served over TCP by one process (``is_master=True``) to the others.

    The master starts a server thread listening on `host_name`:`port` (port 0 picks a free
    one, see :attr:`port`) and, with `wait_for_workers`, waits until `world_size` clients
    have connected. When ``XCCL_AUTH_KEY`` is set, server and clients authenticate each other
    with it (challenge-response; the key never crosses the wire). `multi_tenant`,
    `master_listen_fd` and `use_libuv` are accepted for torch compatibility and ignored.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: Optional[int] = None,
        is_master: bool = False,
        timeout: timedelta = _DEFAULT_STORE_TIMEOUT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: Optional[int] = None,
        use_libuv: bool = True,
    ) -> None:
        if master_listen_fd is not None:
            raise NotImplementedError("TCPStore: master_listen_fd is not supported by xccl")
        self._store = _C.Store.tcp(
            host_name,
            int(port),
            bool(is_master),
            -1 if world_size is None else int(world_size),
            bool(wait_for_workers) and world_size is not None,
            _env.timeout_seconds(timeout, 300.0),
            _env.auth_key(),
        )
        self._host = host_name

    @property
    def port(self) -> int:
        """The port the server listens on (the one actually bound when 0 was asked)."""
        return self._store.port

    @property
    def host(self) -> str:
        """The host name given at construction."""
        return self._host

    def __repr__(self) -> str:
        return f"TCPStore(host={self._host!r}, port={self.port}, timeout={self.timeout})"


class FileStore(Store):
    """A store kept in a file that every process can open (a shared file system or one host).

    `world_size` is accepted for torch compatibility (-1: unknown)."""

    def __init__(self, file_name: str, world_size: int = -1) -> None:
        self._store = _C.Store.file(str(file_name), int(world_size), 300.0)
        self._path = str(file_name)

    @property
    def path(self) -> str:
        """The file backing the store."""
        return self._path


class HashStore(Store):
    """An in-memory store shared by the threads of one process."""

    def __init__(self) -> None:
        self._store = _C.Store.hash(300.0)


class PrefixStore(Store):
    """A view of `store` in which every key is prefixed with ``prefix + "/"``.

    `store` may be any xccl store or a torch.distributed store (or any object with the same
    methods)."""

    def __init__(self, prefix: str, store: Any) -> None:
        self._store = _C.Store.prefix(str(prefix), as_c_store(store))
        self._prefix = str(prefix)
        self._base = store

    @property
    def underlying_store(self) -> Any:
        """The store wrapped by this one."""
        return self._base


def as_c_store(store: Any, timeout: Optional[float] = None) -> _C.Store:
    """The ``_C.Store`` behind an xccl store, or a ``_C.Store`` that calls the methods of any
    other object with torch's Store interface (e.g. a ``torch.distributed.TCPStore``)."""
    if isinstance(store, Store):
        return store._store
    if isinstance(store, _C.Store):
        return store
    for method in ("set", "get", "add", "wait"):
        if not callable(getattr(store, method, None)):
            raise TypeError(
                f"expected a store (xccl or torch.distributed), got {type(store).__name__} "
                f"without a {method}() method"
            )
    if timeout is None:
        tmo = getattr(store, "timeout", None)
        timeout = tmo.total_seconds() if isinstance(tmo, timedelta) else 300.0
    return _C.Store.custom(store, float(timeout))
