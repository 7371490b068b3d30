#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz harnesses (tests/fuzz/corpus/<harness>/) from valid
messages built here, so that every seed is a well-formed input the fuzzer then mutates.

Usage: python tests/fuzz/make_corpus.py   (rewrites corpus/; the output is deterministic)
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
SEEDS: dict[str, Callable[[], dict[str, bytes]]] = {}


def harness(name: str) -> Callable[[Callable[[], dict[str, bytes]]], Callable[[], dict[str, bytes]]]:
    """Registers a function returning {seed name: bytes} for harness `name`."""

    def reg(fn: Callable[[], dict[str, bytes]]) -> Callable[[], dict[str, bytes]]:
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


def main() -> None:
    """Rewrites corpus/<harness>/ for every registered harness."""
    for name, fn in SEEDS.items():
        d = os.path.join(HERE, "corpus", name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        for seed, data in fn().items():
            with open(os.path.join(d, seed), "wb") as f:
                f.write(data)
        print(f"corpus/{name}: {len(fn())} seeds")


if __name__ == "__main__":
    main()
