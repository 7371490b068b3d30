"""Work: the handle of an asynchronous operation, with torch.distributed's methods."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional, Union

from . import _C, _cudafut


class Work:
    """One posted operation (returned by ``async_op=True`` calls, ``isend``, ``irecv`` and
    ``batch_isend_irecv``).

    ``wait()`` blocks until the operation completes and returns True, or raises its error
    (an :class:`XcclError` subclass). Operations whose outputs are lists of tensors run on a
    temporary buffer; the copy into the user's tensors happens exactly once, before
    ``wait()``, ``is_completed()``, ``result()`` or the future report completion.

    On CUDA tensors ``wait()`` makes the current stream wait for the operation on the GPU
    (:mod:`xccl.cuda`, Streams) and ``synchronize()`` waits on the CPU until it has finished.
    There, the copy into list outputs is queued on the call's stream when the call returns, and
    ``wait()`` makes the current stream wait for it.
    """

    __slots__ = (
        "_work",
        "_outputs",
        "_finish",
        "_lock",
        "_done",
        "_error",
        "_futures",
        "_hooked",
        "_cuda",
        "_event",
        "__weakref__",
    )

    def __init__(
        self,
        work: _C.Work,
        outputs: Optional[list[Any]] = None,
        finish: Optional[Callable[[], None]] = None,
        event: Any = None,
        cuda: Any = None,
    ) -> None:
        self._work = work
        # the CudaCall of an operation on CUDA tensors whose wait() orders a stream
        self._cuda = cuda
        # CUDA list outputs: a torch event recorded after their copy on the call's stream
        self._event = event
        self._outputs = [] if outputs is None else outputs
        self._finish = finish
        self._lock = threading.RLock()
        self._done = False
        self._error: Optional[BaseException] = None
        self._futures: list[Any] = []
        self._hooked = False
        if finish is not None:
            # Copy out as soon as the engine completes the operation, so that futures and
            # callbacks chained on them see the final data.
            self._hook()

    # -- completion -----------------------------------------------------------------------------

    def _hook(self) -> None:
        with self._lock:
            if self._hooked:
                return
            self._hooked = True
        # Outside the lock: the callback runs at once when the operation is already complete.
        self._work.add_done_callback(self._on_done)

    def _on_done(self, _work: Any = None) -> None:
        """Runs once the engine reports completion (any thread, GIL held); idempotent."""
        with self._lock:
            if self._done:
                return
            error = self._work.exception()
            if error is None and self._finish is not None:
                try:
                    self._finish()
                except BaseException as exc:  # reported by wait() / the future
                    error = exc
                    self._error = exc
            self._finish = None
            self._done = True
            futures, self._futures = self._futures, []
        for fut in futures:
            _complete_future(fut, self._outputs, error, self._cuda, self._event)

    # -- torch.distributed.Work API -------------------------------------------------------------

    def wait(self, timeout: Union[None, float, timedelta] = None) -> bool:
        """Blocks until the operation completes; returns True or raises its error.

        `timeout` (seconds or timedelta; None or 0 = the operation's own deadline) raises
        :class:`XcclTimeoutError` when it passes first; the operation itself continues. On
        CUDA tensors without a timeout: makes the current stream wait for the operation on the
        GPU instead (:mod:`xccl.cuda`, Streams)."""
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        if timeout is not None and timeout <= 0:
            timeout = None
        if self._cuda is not None and timeout is None:
            self._cuda.order(self._work, self._cuda.current())
            done = self._work.is_completed()
        else:
            self._work.wait(timeout)
            done = True
        if done:
            self._on_done()
            if self._error is not None:
                raise self._error
        if self._event is not None:
            self._event.wait()  # the current stream waits for the copy into list outputs
        return True

    def is_completed(self) -> bool:
        """True once the operation finished (successfully or not). Does not block."""
        if not self._work.is_completed():
            return False
        self._on_done()
        return True

    def is_success(self) -> bool:
        """True if the operation completed without error."""
        return self.is_completed() and self._work.is_success() and self._error is None

    def exception(self) -> Optional[BaseException]:
        """The error of a failed operation, else None."""
        exc = self._work.exception()
        return exc if exc is not None else self._error

    def source_rank(self) -> int:
        """For a completed receive: the rank (in the group) that sent the message."""
        return self._work.source_rank()

    def _source_rank(self) -> int:
        return self.source_rank()

    def result(self) -> list[Any]:
        """Waits, then returns the output tensors."""
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        """Blocks the CPU until the operation has completed; raises its error. The same as
        :meth:`wait` for host operations; for CUDA operations the GPU work has finished when
        it returns (list outputs: their copy too)."""
        self._work.wait()
        self._on_done()
        if self._error is not None:
            raise self._error
        if self._event is not None:
            self._event.synchronize()

    def get_future(self) -> Any:
        """A future completed with the list of output tensors (or the error) when the
        operation completes: a ``torch.futures.Future`` when torch is importable, else a
        ``concurrent.futures.Future``."""
        fut = _new_future(self._cuda)
        with self._lock:
            done = self._done
            if not done:
                self._futures.append(fut)
        if done:
            _complete_future(fut, self._outputs, self.exception(), self._cuda, self._event)
        else:
            self._hook()
        return fut

    # -- xccl extensions ------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """Operation name ("all_reduce", "send", ...)."""
        return self._work.name

    @property
    def algo(self) -> str:
        """The algorithm that ran ("p2p" for point-to-point)."""
        return self._work.algo

    @property
    def seq(self) -> int:
        """Sequence number of the operation in its communicator."""
        return self._work.seq

    def times(self) -> tuple[float, float, float]:
        """(enqueue, start, end) in seconds of ``time.monotonic()``; 0.0 where not reached."""
        return self._work.times()

    def __repr__(self) -> str:
        state = "completed" if self._work.is_completed() else "pending"
        return f"<xccl.Work {self._work.name} seq={self._work.seq} {state}>"


def _torch() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return None
    return torch


def _new_future(cuda: Any = None) -> Any:
    """A torch future (CUDA-aware for an operation on CUDA tensors: xccl._cudafut), else a
    ``concurrent.futures.Future``."""
    torch = _torch()
    if torch is not None and cuda is not None:
        return _cudafut.new_future(torch, cuda.device)
    if torch is not None:
        return torch.futures.Future()
    import concurrent.futures

    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
    fut.set_running_or_notify_cancel()
    return fut


def _complete_future(
    fut: Any,
    outputs: list[Any],
    error: Optional[BaseException],
    cuda: Any = None,
    event: Any = None,
) -> None:
    if cuda is not None and _torch() is not None:
        _cudafut.complete(_torch(), fut, cuda.device, outputs, error, event)
    elif error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(outputs)
