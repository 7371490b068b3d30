"""Type stubs for the C extension ``xccl._C`` (csrc/pyext).

Buffers ("tensors") are any objects implementing ``__dlpack__`` / ``__dlpack_device__``
(torch tensors, numpy arrays, ...). The extension asks for a versioned capsule
(``max_version=(1, 1)``) and falls back to the legacy protocol. Torch tensors that require
grad must be passed detached by the caller (the Python layer does this).

Validation happens before anything is posted: a non-CPU device raises NotImplementedError
("device cuda:0 is not supported by this transport yet"), an unsupported dtype TypeError,
a non-contiguous buffer ValueError, a read-only output ValueError, inconsistent sizes or
dtypes between buffers ValueError, a rank out of range ValueError, a destroyed communicator
XcclError.
"""

from typing import Any, Callable, Optional, Sequence

__version__: str
DTYPES: dict[str, int]  # "float32" -> xccl_dtype_t value
OPS: dict[str, int]  # "sum" -> xccl_op_t value (sum, product, min, max, band, bor, bxor, avg, premul_sum)
ANY_SOURCE: int  # -1

class XcclError(RuntimeError):
    status: int
    status_name: str

class XcclTimeoutError(XcclError, TimeoutError): ...
class XcclConnectionError(XcclError, ConnectionError): ...  # XCCL_ERR_REMOTE
class XcclMismatchError(XcclError): ...  # XCCL_ERR_MISMATCH
class XcclAuthError(XcclError): ...  # XCCL_ERR_AUTH

def status_string(status: int) -> str: ...
def reduce_isa() -> str: ...
def buffer_info(obj: Any) -> tuple[str, int, str, bool]:
    """(dtype name, element count, device string, read_only) of a DLPack object; raises like
    the operations do for unsupported dtypes."""

class Store:
    """A key/value store. Not constructible directly: use the factory class methods."""

    @staticmethod
    def tcp(host: Optional[str], port: int, is_master: bool, world_size: int,
            wait_for_workers: bool, timeout: float, auth_key: Optional[bytes]) -> "Store": ...
    @staticmethod
    def file(path: str, world_size: int, timeout: float) -> "Store": ...
    @staticmethod
    def hash(timeout: float) -> "Store": ...
    @staticmethod
    def prefix(prefix: str, base: "Store") -> "Store": ...
    @staticmethod
    def custom(obj: Any, timeout: float) -> "Store":
        """Wraps any Python object with torch-Store-like methods: set(key, bytes),
        get(key) -> bytes, add(key, int) -> int, wait(list[str]) (optional second arg: a
        datetime.timedelta), check(list[str]) -> bool, compare_set(key, bytes, bytes) -> bytes,
        delete_key(key) -> bool, num_keys() -> int. Called with the GIL held, from whatever
        thread uses the store."""

    port: int  # -1 for non-TCP stores
    timeout: float  # seconds; settable
    def set(self, key: str, value: bytes | str) -> None: ...
    def get(self, key: str, timeout: Optional[float] = None) -> bytes: ...
    def add(self, key: str, delta: int) -> int: ...
    def wait(self, keys: Sequence[str], timeout: Optional[float] = None) -> None: ...
    def check(self, keys: Sequence[str]) -> bool: ...
    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes: ...
    def delete_key(self, key: str) -> bool: ...
    def num_keys(self) -> int: ...

class Work:
    """One posted operation. Keeps its buffers alive until it completes."""

    name: str  # "all_reduce", "send", ...
    algo: str  # algorithm that ran ("p2p" for point-to-point)
    seq: int
    nbytes: int  # bytes received (receives)
    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks (GIL released, Ctrl-C honoured) until completion. Returns True; raises the
        operation's error (XcclError subclass) on failure, XcclTimeoutError if `timeout`
        seconds pass first (the operation itself continues)."""
    def is_completed(self) -> bool: ...
    def is_success(self) -> bool: ...
    def exception(self) -> Optional[BaseException]: ...
    def source_rank(self) -> int: ...
    def times(self) -> tuple[float, float, float]:
        """(enqueue, start, end) in seconds of time.monotonic(); 0.0 where not reached."""
    def add_done_callback(self, fn: Callable[["Work"], None]) -> None:
        """fn(work) runs once when the operation completes, with the GIL, on the thread that
        completes it (the progress thread or a waiter); at once if already complete."""

class Comm:
    """A communicator (xccl_comm_t)."""

    def __init__(self, store: Store, rank: int, size: int, timeout: float,
                 transports: Optional[str] = None, auth_key: Optional[bytes] = None,
                 name: Optional[str] = None) -> None: ...
    rank: int
    size: int
    id: int
    def split(self, ranks: Sequence[int], name: Optional[str] = None) -> "Comm": ...
    def global_rank(self, rank: int) -> int: ...
    def peer_transport(self, peer: int) -> str: ...
    def destroy(self) -> None:
        """Idempotent; pending operations fail with XcclError; later calls raise XcclError."""
    def abort(self) -> None: ...

    def isend(self, buf: Any, peer: int, tag: int = 0) -> Work: ...
    def irecv(self, buf: Any, peer: int = -1, tag: int = 0) -> Work: ...
    # In every collective `algo` forces an algorithm by name and `timeout` (seconds)
    # overrides the communicator's. sendbuf is recvbuf means in place.
    def allreduce(self, sendbuf: Any, recvbuf: Any, op: int, premul: float = 1.0,
                  algo: Optional[str] = None, timeout: Optional[float] = None) -> Work: ...
    def broadcast(self, buf: Any, root: int, algo: Optional[str] = None,
                  timeout: Optional[float] = None) -> Work: ...
    def reduce(self, sendbuf: Any, recvbuf: Any, op: int, root: int, premul: float = 1.0,
               algo: Optional[str] = None, timeout: Optional[float] = None) -> Work:
        """recvbuf may be None on non-root ranks."""
    def allgather(self, sendbuf: Any, recvbuf: Any, algo: Optional[str] = None,
                  timeout: Optional[float] = None) -> Work:
        """recvbuf holds size * len(sendbuf) elements, rank-major."""
    def gather(self, sendbuf: Any, recvbuf: Any, root: int, algo: Optional[str] = None,
               timeout: Optional[float] = None) -> Work: ...
    def scatter(self, sendbuf: Any, recvbuf: Any, root: int, algo: Optional[str] = None,
                timeout: Optional[float] = None) -> Work: ...
    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: int, premul: float = 1.0,
                       algo: Optional[str] = None, timeout: Optional[float] = None) -> Work: ...
    def alltoall(self, sendbuf: Any, recvbuf: Any, algo: Optional[str] = None,
                 timeout: Optional[float] = None) -> Work: ...
    def alltoallv(self, sendbuf: Any, scounts: Sequence[int], sdispls: Sequence[int],
                  recvbuf: Any, rcounts: Sequence[int], rdispls: Sequence[int],
                  algo: Optional[str] = None, timeout: Optional[float] = None) -> Work: ...
    def barrier(self, algo: Optional[str] = None, timeout: Optional[float] = None) -> Work: ...
