"""The registration cache of the RDMA transport, seen from outside xccl.

Reuse: a training loop sends and receives from the same buffers every step; the transport
must register them once. xccl has no counter of registrations, so the kernel's count of
pinned pages (``VmPin`` in /proc/self/status, what ``ibv_reg_mr`` pins) stands in: after the
first step it holds the buffer (the registration is kept), and it does not grow with the steps
(no second registration of the same memory). With ``XCCL_MEM_HOOKS=0`` the cache keeps no user
registration beyond its operation, so the count falls back.

Invalidation: a buffer is freed (munmap, free, or madvise(MADV_DONTNEED), which drops its
pages), memory comes back at the same address with new pages and new contents, and the next
transfer must carry the new contents on the sender and land in the new pages on the receiver;
a stale registration would read and write the old pages."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import numpy as np
import pytest
from harness import run_spmd
from rdma_common import env, needs_ibverbs

pytestmark = needs_ibverbs

NBYTES = 4 << 20  # far above the eager limit: sent by rendezvous, from and into user memory
MAP_FIXED_NOREPLACE = 0x100000
MADV_DONTNEED = 4
M_MMAP_THRESHOLD = -3


def vm_pin_bytes() -> int:
    """This process's pinned memory, from /proc/self/status (VmPin, kB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmPin:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmPin in /proc/self/status")


def body_reuse(rank, world_size, steps):
    import xccl

    buf = np.zeros(NBYTES, np.uint8)
    buf[:] = 1  # touch the pages before the baseline
    xccl.barrier()
    base = vm_pin_bytes()
    pins = []
    for step in range(steps):
        if rank == 0:
            buf[:] = step
            xccl.send(buf, dst=1)
        else:
            xccl.recv(buf, src=0)
            assert (buf == step).all(), step
        xccl.barrier()
        pins.append(vm_pin_bytes() - base)
    return pins


@pytest.mark.parametrize("hooks", ["1", "0"])
def test_reuse_registers_once(hooks):
    res = run_spmd(body_reuse, 2, 10, env=env(XCCL_MEM_HOOKS=hooks), timeout=300)
    for rank, pins in enumerate(res):
        if hooks == "1":
            # kept after the first step (cached), and never a second registration
            assert pins[0] >= NBYTES, (rank, pins)
            assert len(set(pins)) == 1, (rank, pins)
        else:
            # registered per operation: nothing of the user buffer stays pinned
            assert max(pins) < NBYTES, (rank, pins)


_libc = None


def libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.malloc.restype = ctypes.c_void_p
        _libc.malloc.argtypes = [ctypes.c_size_t]
        _libc.free.argtypes = [ctypes.c_void_p]
        _libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return _libc


def _array(addr: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_uint8 * NBYTES).from_address(addr), np.uint8)


def _map(at: int = 0) -> int:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (MAP_FIXED_NOREPLACE if at else 0)
    addr = libc().mmap(at or None, NBYTES, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return addr


def _reuse(how: str, addr: int) -> int:
    """Frees the buffer at ``addr`` the way ``how`` says and gets memory at the same address
    again (new pages); returns that address."""
    c = libc()
    if how == "munmap":
        assert c.munmap(addr, NBYTES) == 0
        new = _map(addr)  # MAP_FIXED_NOREPLACE: exactly there, or an error
    elif how == "madvise":
        assert c.madvise(addr, NBYTES, MADV_DONTNEED) == 0  # same mapping, new zero pages
        new = addr
    else:  # free: glibc returns a chunk this large to the kernel (munmap) and maps it again
        c.free(addr)
        new = c.malloc(NBYTES)
    return new


def body_invalidation(rank, world_size, how):
    import xccl

    c = libc()
    # a fixed mmap threshold (mallopt M_MMAP_THRESHOLD): glibc would otherwise raise it on the
    # first free and serve the next malloc from the heap, at another address
    assert c.mallopt(M_MMAP_THRESHOLD, 128 << 10) == 1
    addr = c.malloc(NBYTES) if how == "free" else _map()
    results = []
    for round_, value in enumerate((0x11, 0x22, 0x33)):
        if round_:
            addr = _reuse(how, addr)
        buf = _array(addr)
        if rank == 0:
            buf[:] = value
            buf[::4096] = np.arange(0, NBYTES, 4096) // 4096 % 251  # page-distinct contents
            xccl.send(buf, dst=1)
        else:
            buf[:] = 0xEE
            xccl.recv(buf, src=0)
            want = np.full(NBYTES, value, np.uint8)
            want[::4096] = np.arange(0, NBYTES, 4096) // 4096 % 251
            bad = np.flatnonzero(buf != want)
            assert bad.size == 0, (
                f"round {round_} after {how}: {bad.size} wrong bytes, first at {bad[0]} "
                f"= {buf[bad[0]]:#x}, expected {want[bad[0]]:#x}")
        results.append(addr)
        del buf
        xccl.barrier()
    if how == "free":
        c.free(addr)
    else:
        c.munmap(addr, NBYTES)
    return results


@pytest.mark.parametrize(
    "how,hooks", [("munmap", "1"), ("madvise", "1"), ("free", "1"), ("munmap", "0")]
)
def test_freed_and_reused_memory_carries_new_contents(how, hooks):
    res = run_spmd(body_invalidation, 2, how, env=env(XCCL_MEM_HOOKS=hooks), timeout=300)
    if how != "free":
        for addrs in res:
            assert len(set(addrs)) == 1, addrs  # the same address every round
    elif not any(len(set(addrs)) == 1 for addrs in res):
        pytest.fail(f"malloc never returned the freed address (rounds: {res}): case untested")
