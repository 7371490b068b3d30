"""The memory hooks (csrc/core/memhook.c) inside a Python process: the registration cache must
not hand out a registration of memory that Python or numpy freed and allocated again.

No transport that registers memory reaches Python on a host without RDMA (the RDMA transport's
own test of this runs in the VM, tests/rdma). So the cache and the hooks are compiled on their
own with a fake registering transport (tests/c/mh_pyshim.c) into a shared object, loaded with
ctypes into a fresh interpreter: the hooks then patch that interpreter (its binary, libpython
when it is separate, numpy's and mmap's modules, ctypes' dlsym) as they patch it under xccl.
The fake's registrations record a fingerprint of their pages; a registration used after its
memory was reused at the same address with other contents has a stale fingerprint. Each case
runs in its own subprocess (the hooks stay in a process once installed), and checks what it
saw against what it wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CC = os.environ.get("CC", "cc")

pytestmark = pytest.mark.skipif(
    shutil.which(CC) is None or not sys.platform.startswith("linux"),
    reason="needs a C compiler and Linux (ELF GOT patching)",
)


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cache, the hooks and the fake transport, built into one shared object."""
    out = tmp_path_factory.mktemp("memhook") / "libmh_pyshim.so"
    cmd = [
        CC, "-std=c11", "-D_GNU_SOURCE", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra",
        "-Werror", "-pthread", f"-I{ROOT / 'csrc/include'}", f"-I{ROOT / 'csrc'}",
        str(ROOT / "csrc/core/memhook.c"), str(ROOT / "csrc/core/rcache.c"),
        str(ROOT / "tests/c/mh_pyshim.c"), "-o", str(out), "-ldl",
    ]
    subprocess.run(cmd, check=True, timeout=300)
    return out


# The body each subprocess runs: prints one JSON line of what it saw.
PRELUDE = textwrap.dedent(
    """
    import ctypes, json, mmap, sys
    try:
        import numpy as np
    except ImportError:  # the system interpreter may have none: its cases need none
        np = None

    lib = ctypes.CDLL(sys.argv[1])
    lib.mh_cache_new.restype = ctypes.c_void_p
    lib.mh_use.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.mh_use.restype = ctypes.c_long
    lib.mh_live.argtypes = [ctypes.c_long]
    lib.mh_fresh.argtypes = [ctypes.c_long]
    lib.mh_cache_free.argtypes = [ctypes.c_void_p]
    rc = lib.mh_cache_new()

    def use(addr, n):
        rid = lib.mh_use(rc, addr, n)
        assert rid >= 0, "registration failed"
        return rid

    # the hooks start at the cache's first lookup (a context starts them at wire-up)
    first = ctypes.create_string_buffer(64)
    use(ctypes.addressof(first), 64)
    slots, objects, events = ctypes.c_int(), ctypes.c_int(), ctypes.c_ulonglong()
    active = lib.mh_stats(ctypes.byref(slots), ctypes.byref(objects), ctypes.byref(events))
    out = {"active": active, "slots": slots.value}

    def again(make, addr_of, old_addr, tries=32):
        \"\"\"make() until an object at old_addr comes back: (it, True), else (last, False).\"\"\"
        held = []
        for _ in range(tries):
            obj = make()
            if addr_of(obj) == old_addr:
                return obj, True
            held.append(obj)
        return held.pop(), False
    """
)

CASES = {
    # a buffer reused step after step: registered once
    "reuse": """
        a = np.full(1 << 20, 1.0)
        ids = {use(a.ctypes.data, a.nbytes) for _ in range(10)}
        out["ids"] = len(ids)
        out["fresh"] = all(lib.mh_fresh(i) for i in ids)
    """,
    # numpy arrays freed (by numpy's module) and allocated again at the same address
    "numpy": """
        res = []
        for nbytes in (8 << 20, 24000):  # past malloc's mmap threshold, and on the heap
            n = nbytes // 8
            a = np.full(n, 1.0)
            addr = a.ctypes.data
            old = use(addr, a.nbytes)
            del a
            b, same = again(lambda: np.full(n, 2.0), lambda x: x.ctypes.data, addr)
            new = use(b.ctypes.data, b.nbytes)  # applies the events
            res.append({"nbytes": nbytes, "same": same, "new_reg": new != old,
                        "old_live": lib.mh_live(old), "fresh": lib.mh_fresh(new)})
        out["res"] = res
    """,
    # a bytearray (the interpreter's allocator: its own binary or libpython)
    "bytearray": """
        n = 4 << 20
        a = bytearray(b"\\x01") * n
        addr = ctypes.addressof(ctypes.c_char.from_buffer(a))
        old = use(addr, n)
        del a
        def make():
            return bytearray(b"\\x02") * n
        def addr_of(x):
            return ctypes.addressof(ctypes.c_char.from_buffer(x))
        b, out["same"] = again(make, addr_of, addr)
        new = use(addr_of(b), n)  # applies the events
        out["new_reg"] = new != old
        out["fresh"] = lib.mh_fresh(new)
        out["old_live"] = lib.mh_live(old)
    """,
    # the mmap module: munmap at close, mmap again
    "mmap": """
        n = 2 << 20
        m = mmap.mmap(-1, n)
        m.write(b"\\x01" * n)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        old = use(addr, n)
        m.close()
        def make():
            x = mmap.mmap(-1, n)
            x.write(b"\\x02" * n)
            return x
        def addr_of(x):
            return ctypes.addressof(ctypes.c_char.from_buffer(x))
        b, out["same"] = again(make, addr_of, addr)
        new = use(addr_of(b), n)  # applies the events
        out["new_reg"] = new != old
        out["fresh"] = lib.mh_fresh(new)
        out["old_live"] = lib.mh_live(old)
    """,
    # ctypes calling libc's malloc/free directly (pointers from dlsym, not through a GOT)
    "ctypes": """
        import ctypes.util
        c = ctypes.CDLL(ctypes.util.find_library("c"))
        c.malloc.restype = ctypes.c_void_p
        c.malloc.argtypes = [ctypes.c_size_t]
        c.free.argtypes = [ctypes.c_void_p]
        n = 4 << 20
        addr = c.malloc(n)
        ctypes.memset(addr, 1, n)
        old = use(addr, n)
        c.free(addr)
        def make():
            p = c.malloc(n)
            ctypes.memset(p, 2, n)
            return p
        b, out["same"] = again(make, lambda x: x, addr)
        new = use(b, n)
        out["new_reg"] = new != old
        out["fresh"] = lib.mh_fresh(new)
        out["old_live"] = lib.mh_live(old)
    """,
    # XCCL_MEM_HOOKS=0: nothing patched, a registration lives for one use only
    "off": """
        a = np.full(1 << 20, 1.0)
        first = use(a.ctypes.data, a.nbytes)
        out["first_live"] = lib.mh_live(first)
        out["second_new"] = use(a.ctypes.data, a.nbytes) != first
    """,
}


def _run(
    shim: Path, case: str, env_extra: dict[str, str] | None = None, python: str = sys.executable
) -> dict:
    src = PRELUDE + textwrap.dedent(CASES[case]) + "\nprint(json.dumps(out))\n"
    env = dict(os.environ)
    env.pop("XCCL_MEM_HOOKS", None)
    # a fixed mmap threshold: glibc's free of a large chunk unmaps it and the next allocation of
    # that size maps the same address again (the dynamic threshold would move it to the heap)
    env["MALLOC_MMAP_THRESHOLD_"] = str(256 << 10)
    env.update(env_extra or {})
    proc = subprocess.run(
        [python, "-c", src, str(shim)], capture_output=True, text=True, timeout=300,
        env=env,
    )
    assert proc.returncode == 0, f"{case}: exit {proc.returncode}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_hooks_installed_and_reuse_hits(shim: Path) -> None:
    out = _run(shim, "reuse")
    assert out["active"] == 1 and out["slots"] > 0
    assert out["ids"] == 1, "a buffer reused 10 times was registered more than once"
    assert out["fresh"]


def test_numpy_free_and_reallocate(shim: Path) -> None:
    out = _run(shim, "numpy")
    assert out["active"] == 1
    for r in out["res"]:
        assert not r["old_live"], f"{r['nbytes']} B: registration of a freed array still live"
        if r["same"]:
            assert r["new_reg"] and r["fresh"], f"{r['nbytes']} B: stale registration used"
    assert any(r["same"] for r in out["res"]), "numpy never reused an address: nothing tested"


@pytest.mark.parametrize("case", ["bytearray", "mmap", "ctypes"])
def test_interpreter_memory(shim: Path, case: str) -> None:
    out = _run(shim, case)
    assert out["active"] == 1
    assert not out["old_live"], f"{case}: registration of freed memory still live"
    if out["same"]:
        assert out["new_reg"] and out["fresh"], f"{case}: stale registration used"


def _system_python() -> str | None:
    """Debian's /usr/bin/python3 when it is another interpreter than this one: a program built
    without -fpie, libpython linked in, that takes free's address (its canonical PLT entry is
    what dlsym returns for free: the hooks must not call that)."""
    exe = shutil.which("python3", path="/usr/bin")
    if exe is None or os.path.realpath(exe) == os.path.realpath(sys.executable):
        return None
    return exe


@pytest.mark.skipif(_system_python() is None, reason="no other system python3")
@pytest.mark.parametrize("case", ["bytearray", "mmap", "ctypes"])
def test_system_interpreter(shim: Path, case: str) -> None:
    python = _system_python()
    assert python is not None
    out = _run(shim, case, python=python)
    assert out["active"] == 1 and out["slots"] > 0
    assert not out["old_live"], f"{case}: registration of freed memory still live"
    if out["same"]:
        assert out["new_reg"] and out["fresh"], f"{case}: stale registration used"


def test_hooks_off(shim: Path) -> None:
    out = _run(shim, "off", {"XCCL_MEM_HOOKS": "0"})
    assert out["active"] == 0 and out["slots"] == 0
    assert not out["first_live"], "XCCL_MEM_HOOKS=0: a registration outlived its use"
    assert out["second_new"]
