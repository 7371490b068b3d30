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

from collections.abc import Callable, Sequence
from datetime import timedelta
from os import PathLike
from typing import Any, Optional, TypeAlias

__version__: str
DTYPES: dict[str, int]  # "float32" -> xccl_dtype_t value
# "sum" -> xccl_op_t value (sum, product, min, max, band, bor, bxor, avg, premul_sum)
OPS: dict[str, int]
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
    the operations do for unsupported dtypes (TypeError) and non-contiguous buffers
    (ValueError), but reports the device ("cpu", "cuda:0", "cuda_host:0") instead of
    rejecting it. read_only is only known from versioned capsules (False for legacy ones)."""

def explain(coll: str, nbytes: int, size: int,
            model: Optional[tuple[float, float, float]] = None) -> list[dict[str, Any]]:
    """Every algorithm of collective `coll` ("all_reduce", "broadcast", "reduce", "all_gather",
    "gather", "scatter", "reduce_scatter", "all_to_all", "all_to_all_v", "barrier") for
    `size` ranks and a message of `nbytes` (nccl-tests size), in selection order. One dict per
    algorithm: name, summary, steps (message rounds on the critical path), bytes (sent by one
    rank on it), reduce_bytes (combined locally), copy_bytes (copied through memory by the
    rank itself), predicted_s (alpha * steps + beta * bytes + gamma * reduce_bytes + delta *
    copy_bytes), applicable (bool), chosen (bool: what xccl would run, honouring $XCCL_ALGO)
    and source (on the chosen row: "env", "table", "rule" or "model", else ""). `model` is
    (alpha s, beta s/byte, gamma s/byte); None: default_model().
    ValueError for an unknown collective."""
def default_model() -> tuple[float, float, float]:
    """(alpha s, beta s/byte, gamma s/byte) of the built-in cost model."""

_Seconds: TypeAlias = float | timedelta  # every `timeout` also accepts a datetime.timedelta

def set_fast_default(comm: Optional[Comm], timeout: Any) -> None: ...
def cuda_info() -> dict[str, Any]:
    """built, loaded, why, archs (list), header_version, driver_version, ndevices, device,
    device_name, compute_capability ((major, minor) or None). Loads the driver once."""
def cuda_set_device(device: int, prefix: str = "cuda.set_device") -> None:
    """The process's GPU (once; another later: ValueError). NotImplementedError where CUDA is
    not usable. `prefix` starts the messages."""
def cuda_device() -> int:
    """The process's GPU; -1 while none is chosen."""

class Front:
    """The C front of a Python API function (csrc/pyext/py_front.c)."""
    def __init__(self, impl: Callable[..., Any], method: str, spec: str, timeout: bool,
                 sum: Any = None, c_sum: Any = None) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

class Store:
    """A key/value store. Not constructible directly: use the factory class methods.
    Every store call releases the GIL while it waits or talks to a server."""

    @classmethod
    def tcp(cls, host: Optional[str], port: int, is_master: bool, world_size: int,
            wait_for_workers: bool, timeout: _Seconds,
            auth_key: Optional[bytes] = None) -> Store: ...
    @classmethod
    def file(cls, path: str | PathLike[str], world_size: int, timeout: _Seconds) -> Store: ...
    @classmethod
    def hash(cls, timeout: _Seconds) -> Store: ...
    @classmethod
    def prefix(cls, prefix: str, base: Store) -> Store: ...
    @classmethod
    def custom(cls, obj: Any, timeout: _Seconds) -> Store:
        """Wraps any Python object with torch-Store-like methods: set(key, bytes),
        get(key) -> bytes, add(key, int) -> int, wait(list[str]) (optional second arg: a
        datetime.timedelta), check(list[str]) -> bool, compare_set(key, bytes, bytes) -> bytes,
        delete_key(key) -> bool, num_keys() -> int. Called with the GIL held, from whatever
        thread uses the store. A get with an explicit timeout first calls
        wait([key], timedelta) (retried as wait([key]) on TypeError). A missing method gives
        NotImplementedError; an exception that is a TimeoutError or whose message says
        "timeout"/"timed out" (torch's DistStoreError, FileStore's RuntimeError) gives
        XcclTimeoutError, anything else XcclError; the original is the __cause__, and a
        KeyboardInterrupt raised inside a method is re-raised as is."""

    @property
    def port(self) -> int: ...  # -1 for non-TCP stores
    timeout: float  # seconds; settable (a timedelta is accepted too)
    def set(self, key: str, value: bytes | str) -> None: ...
    def get(self, key: str, timeout: Optional[_Seconds] = None) -> bytes: ...
    def add(self, key: str, delta: int) -> int: ...
    def wait(self, keys: Sequence[str], timeout: Optional[_Seconds] = None) -> None: ...
    def check(self, keys: Sequence[str]) -> bool: ...
    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes: ...
    def delete_key(self, key: str) -> bool: ...
    def num_keys(self) -> int: ...

class Work:
    """One posted operation. Not constructible from Python.

    It owns its buffers (the DLPack managed tensors) and releases them (calls their deleters)
    once the operation is seen complete. A Work dropped while pending does not block: the
    buffers are released by the completion, whenever it happens."""

    @property
    def name(self) -> str: ...  # "all_reduce", "send", ...
    @property
    def algo(self) -> str: ...  # algorithm that ran ("p2p" for point-to-point)
    @property
    def seq(self) -> int: ...
    @property
    def nbytes(self) -> int: ...  # bytes received (receives)
    def wait(self, timeout: Optional[_Seconds] = None) -> bool:
        """Blocks (GIL released, Ctrl-C honoured) until completion. Returns True; raises the
        operation's error (XcclError subclass) on failure, XcclTimeoutError if `timeout`
        seconds pass first (the operation itself continues). None: no limit but the
        operation's own deadline. Several threads may wait on one Work."""
    def wait_stream(self, stream: int) -> bool:
        """CUDA operations: CUstream `stream` (0: the legacy default stream) waits for the
        operation on the GPU; the CPU does not wait. Raises the operation's error if it has
        failed by then; XcclError for an operation on host memory."""
    @property
    def cuda(self) -> bool: ...  # an operation on CUDA memory
    def is_completed(self) -> bool: ...
    def is_success(self) -> bool: ...
    def exception(self) -> Optional[BaseException]:
        """The error as an exception object (a new one per call) once failed, else None."""
    def source_rank(self) -> int:
        """The sender of a successfully completed receive; -1 before that."""
    def times(self) -> tuple[float, float, float]:
        """(enqueue, start, end) in seconds of time.monotonic(); 0.0 where not reached."""
    def add_done_callback(self, fn: Callable[[Work], None]) -> None:
        """fn(work) runs once when the operation completes, with the GIL, on the thread that
        completes it (the progress thread or a waiter); at once if already complete.
        Exceptions from fn are reported through sys.unraisablehook, never raised. Pending
        callbacks keep the Work alive. Callbacks do not run once the interpreter is
        shutting down (atexit has run)."""

class Comm:
    """A communicator (xccl_comm_t). Creation is collective over the store and runs with
    the GIL released. rank/size/id stay readable after destroy()."""

    def __init__(self, store: Store, rank: int, size: int, timeout: Optional[_Seconds],
                 transports: Optional[str] = None, auth_key: Optional[bytes] = None,
                 name: Optional[str] = None) -> None: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def id(self) -> int: ...
    def split(self, ranks: Sequence[int], name: Optional[str] = None) -> Comm: ...
    def global_rank(self, rank: int) -> int: ...
    def peer_transport(self, peer: int) -> str: ...
    def destroy(self) -> None:
        """Idempotent; pending operations fail with XcclError; later operations raise
        XcclError. Called (or the last reference dropped) inside a done-callback, the C
        destruction is deferred to the next Comm creation/destroy on an ordinary thread."""
    def abort(self) -> None: ...

    # `stream`: None for buffers in host memory; for CUDA buffers the CUstream handle (an
    # int; 0 and 1 the legacy default stream) the operation is ordered after: the producers
    # are asked with __dlpack__(stream=) and every buffer must be device memory of the
    # process's GPU (the first CUDA buffer chooses it when none was).
    def isend(self, buf: Any, peer: int, tag: int = 0, stream: Optional[int] = None) -> Work: ...
    def irecv(self, buf: Any, peer: int = -1, tag: int = 0,
              stream: Optional[int] = None) -> Work: ...
    # In every collective `algo` forces an algorithm by name and `timeout` (seconds)
    # overrides the communicator's. sendbuf is recvbuf means in place (the buffer must be
    # writable); element-wise reductions reject partially overlapping buffers. Posting does
    # not block; the returned Work owns the buffers until the operation completes.
    def allreduce(self, sendbuf: Any, recvbuf: Any, op: int, premul: float = 1.0,
                  algo: Optional[str] = None, timeout: Optional[float] = None,
                  stream: Optional[int] = None) -> Work: ...
    # One-call paths: posted and waited for; None (nothing done) where the general path
    # must handle the call.
    def allreduce_now(self, buf: Any, op: int, timeout: Optional[float]) -> Optional[bool]:
        """In-place all_reduce."""
        ...
    def broadcast_now(self, buf: Any, root: int, timeout: Optional[float]) -> Optional[bool]:
        """Broadcast from `root`."""
        ...
    def allgather_now(self, sendbuf: Any, recvbuf: Any,
                      timeout: Optional[float]) -> Optional[bool]:
        """all_gather into recvbuf (size x sendbuf's elements; not sendbuf itself)."""
        ...
    def reduce_scatter_now(self, sendbuf: Any, recvbuf: Any, op: int,
                           timeout: Optional[float]) -> Optional[bool]:
        """reduce_scatter of sendbuf (size x recvbuf's elements; not recvbuf itself)."""
        ...
    def alltoall_now(self, sendbuf: Any, recvbuf: Any,
                     timeout: Optional[float]) -> Optional[bool]:
        """all_to_all of equal splits of sendbuf's first dimension (not recvbuf itself)."""
        ...
    def send_now(self, buf: Any, peer: int, tag: int) -> Optional[bool]:
        """Blocking send to `peer` (not this rank)."""
        ...
    def recv_now(self, buf: Any, peer: int, tag: int) -> Optional[int]:
        """Blocking receive from `peer` (not this rank); the sender's rank."""
        ...
    def broadcast(self, buf: Any, root: int, algo: Optional[str] = None,
                  timeout: Optional[float] = None,
                  stream: Optional[int] = None) -> Work:
        """buf may be read-only at the root."""
    def reduce(self, sendbuf: Any, recvbuf: Any, op: int, root: int, premul: float = 1.0,
               algo: Optional[str] = None, timeout: Optional[float] = None,
                  stream: Optional[int] = None) -> Work:
        """recvbuf may be None on non-root ranks."""
    def allgather(self, sendbuf: Any, recvbuf: Any, algo: Optional[str] = None,
                  timeout: Optional[float] = None,
                  stream: Optional[int] = None) -> Work:
        """recvbuf holds size * len(sendbuf) elements, rank-major."""
    def gather(self, sendbuf: Any, recvbuf: Any, root: int, algo: Optional[str] = None,
               timeout: Optional[float] = None,
                  stream: Optional[int] = None) -> Work:
        """recvbuf (size * len(sendbuf)) is used at the root only; None elsewhere."""
    def scatter(self, sendbuf: Any, recvbuf: Any, root: int, algo: Optional[str] = None,
                timeout: Optional[float] = None,
                  stream: Optional[int] = None) -> Work:
        """sendbuf (size * len(recvbuf)) is used at the root only; None elsewhere."""
    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: int, premul: float = 1.0,
                       algo: Optional[str] = None, timeout: Optional[float] = None,
                  stream: Optional[int] = None) -> Work: ...
    def alltoall(self, sendbuf: Any, recvbuf: Any, algo: Optional[str] = None,
                 timeout: Optional[float] = None,
                  stream: Optional[int] = None) -> Work: ...
    def alltoallv(self, sendbuf: Any, scounts: Sequence[int], sdispls: Sequence[int],
                  recvbuf: Any, rcounts: Sequence[int], rdispls: Sequence[int],
                  algo: Optional[str] = None, timeout: Optional[float] = None,
                  stream: Optional[int] = None) -> Work: ...
    def barrier(self, algo: Optional[str] = None, timeout: Optional[float] = None) -> Work: ...

    # Introspection. Cheap, non-blocking; XcclError once destroyed.
    def trace(self, capacity: int) -> None:
        """Starts recording every primitive step (send, receive, local reduction) of every
        operation into a buffer of `capacity` events (the oldest are dropped when it is full);
        0 stops and frees it. Restarting discards what was not drained."""
    def trace_drain(self) -> list[dict[str, Any]]:
        """Removes and returns the recorded events, oldest first. Each: seq (operation number
        on the communicator), step (algorithm step; 0 for reductions), kind ("send", "recv",
        "reduce"), src and dst (ranks of this communicator; both this rank for a reduction),
        buf ("send", "recv", "scratch" or None: which buffer `offset` is in), offset and
        nbytes, start_ns and end_ns (CLOCK_MONOTONIC ns, the clock of time.monotonic_ns()),
        op ("all_reduce", "send", ...), algo and transport ("tcp", "shm", "local", ...)."""
    def trace_dropped(self) -> int:
        """Events lost to a full buffer since tracing started."""
    def choose(self, collective: str, nbytes: int) -> str:
        """The algorithm a call of `collective` with `nbytes` would run now (no algo=): the
        cost model with this communicator's models and topology, and the built-in rules."""
    def cost_model(self) -> tuple[float, float, float, int]:
        """(α s, β s/byte, γ s/byte, nodes): the model the engine chooses this communicator's
        one-level algorithms with (its transport's between hosts when it spans several)."""
    def flight_dump(self) -> str:
        """The flight recorder as a text table: the last operations of the communicator
        (seq, operation, algo, state, age_ms) and, for pending ones, whom they wait for
        ("send->2 recv<-1")."""
    def diag_table(self, wait_s: float) -> str:
        """Asks every member now where it stands (pending operations and whom they wait for,
        or its last finished one): one row per rank, as a timeout's error shows them. Waits
        up to `wait_s` for answers; nothing is needed from the other ranks' callers."""
