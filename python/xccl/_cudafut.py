"""torch futures of operations on CUDA tensors (xccl's own Work and the torch backend's).

A future made without devices takes CUDA tensors but orders no stream; a CUDA-aware one
(``torch.futures.Future(devices=[gpu])``) records an event on the completing thread's current
stream when it completes, which its consumers then wait for. xccl completes such futures:

- on a thread of its own, never on xccl's progress thread: their callbacks (``then``, DDP's comm
  hooks) may allocate or free device memory, calls that may wait for every stream - one that
  waits for an xccl operation included, whose gate the progress thread opens;
- on an idle stream of the GPU (made on the caller's thread), behind `event` when the outputs
  were copied on another stream, so that consumers wait for nothing but the operation.

The operation's device work has finished when its future is completed (xccl completes a Work
once the device is done).
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, Optional


class Completer:
    """Runs jobs one after the other on a daemon thread started on first use; a job that
    raises is reported on stderr and the thread goes on."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="xccl-cuda-futures", daemon=True
                )
                self._thread.start()
        self._queue.put(fn)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                job()
            except BaseException as exc:  # the job failed its own future
                print(f"xccl: completing a future failed: {exc!r}", file=sys.stderr)


completer = Completer()
_side_streams: dict[int, Any] = {}


def side_stream(torch: Any, device: Any) -> Any:
    """The idle stream of GPU `device` (a torch.device or an index); call it first on a
    caller's thread (stream creation is kept off the completer)."""
    index = device if isinstance(device, int) else device.index
    if index is None:
        index = torch.cuda.current_device()
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams.setdefault(index, torch.cuda.Stream(device=index))
    return stream


def new_future(torch: Any, device: Any) -> Any:
    """A CUDA-aware torch future of GPU `device`; makes its idle stream now."""
    side_stream(torch, device)
    dev = torch.device("cuda", device) if isinstance(device, int) else device
    return torch.futures.Future(devices=[dev])


def complete(
    torch: Any, fut: Any, device: Any, value: Any, error: Optional[BaseException], event: Any = None
) -> None:
    """Completes `fut` (from new_future) with `value` or `error`, on the completer thread."""
    if error is not None:
        fut.set_exception(error)
        return
    completer.submit(lambda: _set(torch, fut, device, value, event))


def _set(torch: Any, fut: Any, device: Any, value: Any, event: Any) -> None:
    try:
        side = side_stream(torch, device)
        with torch.cuda.device(side.device), torch.cuda.stream(side):
            if event is not None:
                side.wait_event(event)
            fut.set_result(value)
    except BaseException as exc:
        if not fut.done():
            fut.set_exception(exc)
        raise
