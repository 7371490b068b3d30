#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz harnesses (tests/fuzz/corpus/<harness>/) from valid
messages built here, so that every seed is a well-formed input the fuzzer then mutates.

Usage: python tests/fuzz/make_corpus.py [--out DIR]   (default: rewrites tests/fuzz/corpus/;
the output is deterministic, and tests/test_fuzz.py checks that the committed corpus is it)
"""

from __future__ import annotations

import argparse
import os
import shutil
import struct
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
SeedFn = Callable[[], dict[str, bytes]]
SEEDS: dict[str, SeedFn] = {}


def harness(name: str) -> Callable[[SeedFn], SeedFn]:
    """Registers a function returning {seed name: bytes} for harness `name`."""

    def reg(fn: SeedFn) -> SeedFn:
        SEEDS[name] = fn
        return fn

    return reg


# ---- dlpack: see fuzz_dlpack.c for the layout (big-endian integers) ----------------------------
def dl_tensor(mode: int, dev: int, devid: int, code: int, bits: int, lanes: int, offset: int,
              flags: int, shape: list[int], strides: list[int] | None) -> bytes:
    """One fuzz_dlpack input."""
    if strides is not None:
        mode |= 4
    b = struct.pack(">BBiBBHQQb", mode, dev, devid, code, bits, lanes, offset, flags, len(shape))
    b += b"".join(struct.pack(">q", s) for s in shape)
    if strides is not None:
        b += b"".join(struct.pack(">q", s) for s in strides)
    return b


@harness("dlpack")
def dlpack_seeds() -> dict[str, bytes]:
    """Tensors torch and numpy export: contiguous, 0-d, empty, strided, GPU, read-only."""
    data = 8
    return {
        "f32_2x3": dl_tensor(data, 1, 0, 2, 32, 1, 0, 0, [2, 3], [3, 1]),
        "f32_2x3_nostrides": dl_tensor(data, 1, 0, 2, 32, 1, 0, 0, [2, 3], None),
        "i64_scalar": dl_tensor(data, 1, 0, 0, 64, 1, 0, 0, [], None),
        "empty": dl_tensor(0, 1, 0, 2, 32, 1, 0, 0, [0, 5], [5, 1]),
        "transposed": dl_tensor(data, 1, 0, 2, 32, 1, 0, 0, [3, 2], [1, 3]),
        "cuda_any": dl_tensor(data | 2, 2, 1, 2, 16, 1, 0, 0, [4], [1]),
        "cuda_refused": dl_tensor(data, 2, 0, 2, 16, 1, 0, 0, [4], [1]),
        "readonly_output": dl_tensor(data | 1, 1, 0, 1, 8, 1, 0, 1, [16], [1]),
        "copy_output": dl_tensor(data | 1, 1, 0, 1, 8, 1, 0, 2, [16], [1]),
        "offset": dl_tensor(data, 3, 0, 5, 128, 1, 64, 0, [2, 1, 4], [4, 99, 1]),
        "bf16_lanes": dl_tensor(data, 1, 0, 4, 16, 4, 0, 0, [8], [1]),
    }


# ---- algo: [u8 ranks][u64 size a][u64 size b][u8 shift][XCCL_ALGO spec] ------------------------
@harness("algo")
def algo_seeds() -> dict[str, bytes]:
    """Specs from docs/selection.md and the tests: ranges, units, inf, auto, case, blanks."""
    specs = {
        "one_rule": "all_reduce=ring",
        "ranges": "all_reduce:0-64k=rd;all_reduce:64k-inf=ring",
        "units": "broadcast:1M-2G=binomial; allgather : 1k - 16m = ring",
        "auto": "allreduce=auto;reduce_scatter:0-1=owner",
        "mixed_case": "All_Reduce:0-INF=Rabenseifner;;  ;barrier=dissemination",
        "every_coll": ";".join(f"{c}=linear" for c in (
            "all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
            "reduce_scatter", "all_to_all", "all_to_all_v", "barrier")),
        "bad_range": "all_reduce:64k-1k=ring",
        "bad_coll": "allreduse=ring",
    }
    return {name: struct.pack(">BQQB", 7, 1 << 16, 1 << 20, 0) + spec.encode()
            for name, spec in specs.items()}


# ---- tune: tuning tables as xccl-tune writes them (csrc/algo/tune.c) ---------------------------
@harness("tune")
def tune_seeds() -> dict[str, bytes]:
    """A table as written, its parts, and the errors the tests name."""
    head = "xccl-tune 1\nhost transport=shm cores=2 cpu=AMD EPYC 7B13\n"
    tables = {
        "written": head + "# fitted\nmodel alpha=2.1e-06 beta=1.4e-10 gamma=9e-11 "
        "delta=1.2e-10\n# all_reduce, 2 ranks\nchoose all_reduce np=2 bytes=0-2896 algo=rd\n"
        "choose all_reduce np=2 bytes=2897-1048576 algo=ring\nmeas all_reduce np=2 bytes=8 "
        "best=rd rd=2.7e-06 ring=5.3e-06\nchoose barrier np=8 bytes=0-0 algo=dissemination\n",
        "every_coll": head + "".join(
            f"choose {c} np=4 bytes=0-inf algo=linear\n"
            for c in ("broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_v",
                      "barrier")),
        "other_host": "xccl-tune 1\nhost transport=tcp cores=128 cpu=Other\n",
        "bad_version": "xccl-tune 2\n",
        "bad_algo": head + "choose all_reduce np=2 bytes=0-64 algo=nosuch\n",
        "bad_range": head + "choose all_reduce np=2 bytes=64-8 algo=rd\n",
        "no_host": "xccl-tune 1\nchoose all_reduce np=2 bytes=0-64 algo=rd\n",
        "empty": "",
    }
    return {name: text.encode() for name, text in tables.items()}


# ---- TCP store: request/response layout of csrc/core/store_tcp.c (big-endian) -----------------
STORE_MAGIC = 0x58435331
CMD = {"join": 1, "set": 2, "get": 3, "add": 4, "wait": 5, "check": 6, "compare_set": 7,
       "delete": 8, "num_keys": 9}


def st_field(b: bytes) -> bytes:
    """[u32 n][n bytes]."""
    return struct.pack(">I", len(b)) + b


def st_i64(v: int) -> bytes:
    """An integer field."""
    return st_field(struct.pack(">q", v))


def st_msg(code: int, *fields: bytes) -> bytes:
    """[u32 magic][u32 total][u8 code][fields]."""
    body = b"".join(fields)
    return struct.pack(">IIB", STORE_MAGIC, 9 + len(body), code & 0xFF) + body


def store_requests() -> dict[str, bytes]:
    """One request stream per kind of exchange the clients make."""
    k, v = st_field(b"rank/0"), st_field(b"value")
    return {
        "join": st_msg(CMD["join"]),
        "set_get": st_msg(CMD["set"], k, v) + st_msg(CMD["get"], st_i64(0), k),
        "add": st_msg(CMD["add"], st_field(b"ctr"), st_i64(5)) * 2,
        "wait_present": st_msg(CMD["set"], k, v) + st_msg(CMD["wait"], st_i64(1000), k),
        "wait_missing": st_msg(CMD["wait"], st_i64(0), k, st_field(b"other")),
        "get_missing": st_msg(CMD["get"], st_i64(0), st_field(b"nokey")),
        "get_parked": st_msg(CMD["get"], st_i64(60000), st_field(b"nokey")),
        "check": st_msg(CMD["set"], k, v) + st_msg(CMD["check"], k, st_field(b"x")),
        "compare_set": st_msg(CMD["compare_set"], k, st_field(b""), v)
        + st_msg(CMD["compare_set"], k, v, st_field(b"new")),
        "delete": st_msg(CMD["set"], k, v) + st_msg(CMD["delete"], k) + st_msg(CMD["delete"], k),
        "num_keys": st_msg(CMD["set"], k, v) + st_msg(CMD["num_keys"]),
        "all": b"".join(st_msg(c) for c in range(1, 10)),
    }


@harness("store_server")
def store_server_seeds() -> dict[str, bytes]:
    """[u8 mode: bit 0 = auth][client stream]."""
    seeds = {name: b"\x00" + req for name, req in store_requests().items()}
    hello = struct.pack(">I", 0x58415531) + bytes(range(32))
    seeds["auth_hello_proof"] = b"\x01" + hello + bytes(32) + b"\x01" + st_msg(CMD["join"])
    return seeds


@harness("store_client")
def store_client_seeds() -> dict[str, bytes]:
    """[u8 mode: bit 0 = auth][server stream]: the replies to join, set, get, add, wait, check,
    compare_set, delete_key, num_keys in that order."""
    ok = st_msg(0)
    err = st_msg(-1, st_field(b"server says no"))
    timeout = -7
    yes = st_msg(0, st_field(b"\x01"))
    replies = [ok, ok, st_msg(0, st_field(b"value")), st_msg(0, st_i64(42)), ok, yes,
               st_msg(0, st_field(b"w")), yes, st_msg(0, st_i64(3))]
    seeds = {"all_ok": b"\x00" + b"".join(replies)}
    seeds["timeouts"] = b"\x00" + b"".join(replies[:2] + [st_msg(timeout)] + replies[3:4] + [
        st_msg(timeout, st_field(b"b"), st_field(b"a"))] + replies[5:])
    seeds["errors"] = b"\x00" + ok + err * 8
    seeds["join_only"] = b"\x00" + ok
    hello = struct.pack(">I", 0x58415531) + bytes(range(32))
    seeds["auth"] = b"\x01" + hello + bytes(32) + b"\x01" + b"".join(replies)
    return seeds


@harness("auth")
def auth_seeds() -> dict[str, bytes]:
    """[u8 role: bit 0 = we are the server][peer stream: hello, proof, verdict]."""
    hello = struct.pack(">I", 0x58415531) + bytes(range(32))
    full = hello + bytes(range(100, 132)) + b"\x01"
    return {"server_full": b"\x01" + full, "client_full": b"\x00" + full,
            "hello_only": b"\x00" + hello, "bad_magic": b"\x01" + b"XXXX" + bytes(32),
            "short": b"\x00" + hello[:10]}


# ---- address records (csrc/core/ctx.c) and transport blobs: host byte order (little-endian) ----
def tcp_blob(port: int, v6: bool = False) -> bytes:
    """backends/tcp/tcp_wire.h address blob."""
    if v6:
        return b"XTCA" + bytes([6, 0]) + struct.pack(">HI", port, 2) + bytes(15) + b"\x01"
    return b"XTCA" + bytes([4, 0]) + struct.pack(">HI", port, 0) + bytes([127, 0, 0, 1]) + bytes(12)


def shm_blob(rank: int) -> bytes:
    """backends/shm/shm_layout.h shm_addr_t."""
    name = f"/xccl-00000000deadbeef-{rank}-4242".encode()
    return (b"XSHA" + struct.pack("<HHQiiQQ", 3, 0, 0xDEADBEEF, rank, 4242, 1 << 20, 7)
            + name + bytes(64 - len(name)))


def addr_record(entries: list[tuple[bytes, bytes]]) -> bytes:
    """[u32 ntp][name 16][u32 len][blob]..."""
    out = struct.pack("<I", len(entries))
    for name, blob in entries:
        out += name + bytes(16 - len(name)) + struct.pack("<I", len(blob)) + blob
    return out


@harness("addr")
def addr_seeds() -> dict[str, bytes]:
    """Records as ranks publish them: tcp only, shm and tcp, IPv6, none."""
    return {"tcp": addr_record([(b"tcp", tcp_blob(29500))]),
            "shm_tcp": addr_record([(b"shm", shm_blob(1)), (b"tcp", tcp_blob(40000))]),
            "tcp6": addr_record([(b"tcp", tcp_blob(1234, v6=True))]),
            "empty": addr_record([])}


# ---- tcp handshake: [u8 size][u8 rank][u64 job][u8 key][u64 busy][u64 use][hello][ack] -------
def tcp_hello(job: int, src: int, dst: int, auth: bool) -> bytes:
    """tcp_hello_t, little-endian host order."""
    return b"XTCP" + struct.pack("<HHQiiII", 1, 0x0102, job, src, dst, 1 if auth else 0, 0)


def tcp_ack(job: int, rank: int, status: int = 0) -> bytes:
    """tcp_ack_t."""
    return b"XTCP" + struct.pack("<HHQiI", 1, status, job, rank, 0)


@harness("tcp_hello")
def tcp_hello_seeds() -> dict[str, bytes]:
    """An accepted exchange, and each refusal once."""
    job = 0x1122334455667788

    def seed(rank: int, key: int, busy: int, use: int, hello: bytes, ack: bytes) -> bytes:
        return struct.pack(">BBQBQQ", 3, rank, job, key, busy, use) + hello + ack

    return {
        "ok": seed(0, 0, 0, 0b1110, tcp_hello(job, 2, 0, False), tcp_ack(job, 2)),
        "auth": seed(1, 1, 0, 0b1100, tcp_hello(job, 3, 1, True), tcp_ack(job, 0)),
        "wrong_job": seed(0, 0, 0, 0b1110, tcp_hello(job + 1, 2, 0, False), tcp_ack(job + 1, 2)),
        "duplicate": seed(0, 0, 0b100, 0b1110, tcp_hello(job, 2, 0, False), tcp_ack(job, 2, 6)),
        "auth_mode": seed(0, 1, 0, 0b1110, tcp_hello(job, 1, 0, False), tcp_ack(job, 1, 7)),
    }


# ---- shm segment header: [u8 size][u8 rank][u8 peer][u64 seg][i32 pid][u64 job][header] ------
def shm_header(size: int, rank: int, pid: int, job: int, seg: int, ring: int, nrings: int,
               ring_of: list[int]) -> bytes:
    """shm_seg_hdr_t (offsets checked against shm_layout.h) + ring_of."""
    h = bytearray(256)
    struct.pack_into("<QIiiiQQQ", h, 0, 0x324D48534C434358, 3, rank, size, pid, job, seg, ring)
    struct.pack_into("<i", h, 192, nrings)
    return bytes(h) + b"".join(struct.pack("<i", r) for r in ring_of)


@harness("shm_seg")
def shm_seg_seeds() -> dict[str, bytes]:
    """Segments as shm.c makes them (2 and 4 ranks), and a few near misses."""
    job, pid, ring = 0xABCDEF, 4242, 1 << 18
    hdr = 4096

    def seed(size: int, rank: int, peer: int, nrings: int, ring_of: list[int],
             seg: int | None = None, ring_bytes: int = ring) -> bytes:
        seg = seg if seg is not None else hdr + nrings * (512 + ring_bytes)
        return struct.pack(">BBBQiQ", size - 1, rank, peer, seg, pid, job) + shm_header(
            size, peer, pid, job, seg, ring_bytes, nrings, ring_of)

    return {
        "two": seed(2, 0, 1, 1, [0, -1]),
        "four": seed(4, 2, 0, 3, [-1, 0, 1, 2]),
        "too_small": seed(4, 2, 0, 3, [-1, 0, 1, 2], seg=hdr + 512),
        "not_pow2": seed(2, 0, 1, 1, [0, -1], ring_bytes=ring + 64),
    }


# ---- shm ring: [u16 start] then operations (see fuzz_shm_ring.c) -------------------------------
@harness("shm_ring")
def shm_ring_seeds() -> dict[str, bytes]:
    """Correct traffic of every kind, then each kind of corruption once."""
    inline = bytes([0, 4, 24, 0, 8, 0])
    stream = bytes([1, 16]) + struct.pack(">H", 3000) + b"\x00" + bytes([1, 20]) + struct.pack(
        ">H", 40000) + b"\x03"
    cma = bytes([2, 32]) + struct.pack(">H", 5000)
    held = bytes([0, 5, 10, 1, 9]) + struct.pack(">H", 100) + b"\x00"
    dropped = bytes([0, 6, 10, 1, 14]) + struct.pack(">H", 700) + b"\x00"
    run = bytes([6, 7])
    bad_slot = bytes([3]) + struct.pack("<IIQQQQ", 9, 0, 7, 1, 0, 10) + bytes(24)
    big_inline = bytes([3]) + struct.pack("<IIQQQQ", 1, 0, 7, 1, 0, 4000) + bytes(24)
    huge_stream = bytes([3]) + struct.pack("<IIQQQQ", 2, 0, 7, 1, 0, 1 << 40) + bytes(24)
    return {
        "inline": b"\x00\x10" + inline + run,
        "stream": b"\x00\x3f" + stream + run,
        "cma": b"\x00\x00" + cma + run,
        "mixed": b"\x00\x3e" + inline + stream + cma + held + dropped + run,
        "bad_kind": b"\x00\x00" + inline + bad_slot + run,
        "big_inline": b"\x00\x00" + big_inline + run,
        "huge_stream": b"\x00\x00" + huge_stream + run,
        "misaligned": b"\x00\x00" + bytes([4, 3, 1, 2, 3]) + inline + run,
        "head_behind": b"\x00\x00" + inline + bytes([5, 0xFF, 0x00]) + run,
        "closed": b"\x00\x00" + inline + bytes([7, 2, 0x41]) + run,
    }


# ---- tcp stream: [xccl_msg_hdr_t: comm_id, tag, fp, nbytes (u64, host order)][payload]... ----
def tcp_msg(tag: int, payload: bytes, comm: int = 7, fp: int = 0) -> bytes:
    """One message as tcp.c sends it."""
    return struct.pack("<QQQQ", comm, tag, fp, len(payload)) + payload


@harness("tcp_stream")
def tcp_stream_seeds() -> dict[str, bytes]:
    """Message streams as ranks send them, and cut or oversized ones."""
    pay = bytes((i * 7) & 0xFF for i in range(3000))
    return {
        "one": tcp_msg(4, pay[:100]),
        "many": b"".join(tcp_msg(4 * i, pay[: i * 97]) for i in range(12)),
        "empty_msgs": tcp_msg(0, b"") * 5,
        "held_dropped": tcp_msg(1, pay[:50]) + tcp_msg(2, pay[:2000]) + tcp_msg(3, pay[:9]),
        "cut": tcp_msg(4, pay[:100]) + tcp_msg(8, pay)[:1500],
        "huge": tcp_msg(4, pay[:10]) + struct.pack("<QQQQ", 7, 8, 0, 1 << 40),
    }


@harness("tcp_accept")
def tcp_accept_seeds() -> dict[str, bytes]:
    """[u8 patch job id: bit 0][a stranger's first bytes]: the harness's job id is patched into
    hellos with bit 0 set, so correct ones are reachable."""
    return {
        "correct_hello": b"\x01" + tcp_hello(0, 1, 0, False),
        "wrong_job": b"\x00" + tcp_hello(5, 1, 0, False),
        "auth_flag": b"\x01" + tcp_hello(0, 1, 0, True),
        "wrong_rank": b"\x01" + tcp_hello(0, 3, 0, False),
        "partial": b"\x01" + tcp_hello(0, 1, 0, False)[:20],
        "garbage": b"\x00" + b"GET / HTTP/1.1\r\n\r\n",
        "hello_then_data": b"\x01" + tcp_hello(0, 1, 0, False) + tcp_msg(4, b"abc"),
        "empty": b"",
    }


def main() -> None:
    """Rewrites <out>/<harness>/ for every registered harness."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "corpus"), help="corpus root")
    args = ap.parse_args()
    for name, fn in SEEDS.items():
        d = os.path.join(args.out, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        for seed, data in fn().items():
            with open(os.path.join(d, seed), "wb") as f:
                f.write(data)
        print(f"{d}: {len(fn())} seeds")


if __name__ == "__main__":
    main()
