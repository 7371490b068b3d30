"""Job script: init, one all_reduce checked against numpy, destroy; prints ``XH-OK <rank>``.
The smallest job, for the tests of what happens at initialisation (interfaces, job secret).
With ``--p2p-bytes N`` rank 0 also sends N bytes to the last rank, which checks them and
prints ``XH-P2P <seconds>`` (the link shaping test). A rank whose init fails prints the
traceback and exits 1; rank 0 first waits 3 s, since it hosts the store: the other ranks must
reach their own error, not a store closed under them."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import numpy as np

import xccl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--p2p-bytes", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    try:
        xccl.init_process_group("auto", timeout=args.timeout)
    except Exception:  # noqa: BLE001 - reported as is
        traceback.print_exc()
        sys.stderr.flush()
        if os.environ.get("RANK") == "0":
            time.sleep(3.0)
        raise SystemExit(1) from None
    rank, world = xccl.get_rank(), xccl.get_world_size()
    x = np.arange(1000, dtype=np.float64) + rank
    xccl.all_reduce(x)
    np.testing.assert_array_equal(x, np.arange(1000) * world + world * (world - 1) / 2)
    if args.p2p_bytes:
        want = np.random.default_rng(5).integers(0, 255, args.p2p_bytes, dtype=np.uint8)
        xccl.barrier()
        if rank == 0:
            xccl.send(want, dst=world - 1)
        elif rank == world - 1:
            got = np.zeros_like(want)
            t0 = time.monotonic()
            xccl.recv(got, src=0)
            dt = time.monotonic() - t0
            np.testing.assert_array_equal(got, want)
            print(f"XH-P2P {dt:.6f}", flush=True)
    print(f"XH-OK {rank}", flush=True)
    xccl.destroy_process_group()


if __name__ == "__main__":
    main()
