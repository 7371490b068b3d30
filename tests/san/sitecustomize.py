"""Started by every Python process of tests/san/run-python.sh (it puts tests/san first on
PYTHONPATH); does nothing unless ``XCCL_TEST_LSAN=1`` and the ASan runtime is preloaded.

- The imports of numpy and torch run with LeakSanitizer off for this thread
  (``__lsan_disable``): what third-party modules allocate while they load (and never free:
  interned objects, frames kept by torch's bindings) is not xccl's, and no xccl code runs then.
  Everything allocated after, by the same libraries included, is checked.
- The leak check runs at the interpreter's exit from an ``atexit`` handler, while every module
  is still alive, instead of after the interpreter's finalisation (which leaves objects
  unreachable without freeing them: LeakSanitizer would report CPython's own shutdown). The
  rank processes of tests/harness.py end with ``os._exit`` and run their check themselves.
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import os
import sys
from typing import Any

_QUIET_IMPORTS = ("numpy", "torch")
_PINNED: list[Any] = []


def pin_running_frames() -> None:
    """Keeps every thread's running frames and their locals reachable from here (a module
    global). CPython keeps running frames in mmap'd chunks that LeakSanitizer does not scan,
    so an object held only by, e.g., a daemon thread's local variable would look leaked."""
    _PINNED.clear()
    for top in sys._current_frames().values():
        f: Any = top
        while f is not None:
            _PINNED.append((f, f.f_locals))
            f = f.f_back


def _install() -> None:
    try:
        rt = ctypes.CDLL(None)
        disable, enable, check = rt.__lsan_disable, rt.__lsan_enable, rt.__lsan_do_leak_check
    except (OSError, AttributeError):
        print("sitecustomize: XCCL_TEST_LSAN=1 but no LeakSanitizer runtime", file=sys.stderr)
        return
    real_import = builtins.__import__

    def quiet_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (),
                     level: int = 0) -> Any:
        top = name.partition(".")[0]
        if level != 0 or top not in _QUIET_IMPORTS or top in sys.modules:
            return real_import(name, globals, locals, fromlist, level)
        disable()
        try:
            return real_import(name, globals, locals, fromlist, level)
        finally:
            enable()

    def check_at_exit() -> None:
        pin_running_frames()
        check()

    builtins.__import__ = quiet_import
    atexit.register(check_at_exit)  # registered first, so it runs last of the atexit handlers


if os.environ.get("XCCL_TEST_LSAN") == "1":
    _install()
