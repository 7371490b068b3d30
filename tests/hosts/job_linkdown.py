"""Job script for ``run.sh --link-down HOST:SECONDS`` and ``--kill-host``: after init every
rank creates ``$XH_CTL/arm`` (which starts the harness's clock) and runs all_reduce calls,
each checked against numpy, until one fails. The failing call's exception is printed as one
line ``XH-ERROR <json>`` (rank, host, exception type, message, seconds the call took); the
rank then exits with status 3. A rank whose calls all succeed for ``--max-seconds`` exits 4.
With ``--arm-before-init`` the clock starts before init instead (a link that is down while
the job starts): an error of init_process_group is reported the same way.

Every rank ignores SIGTERM: the ranks of one host fail at about the same moment, and
xccl-run's SIGTERM after the first one's exit must not cut off the others' reports (its
SIGKILL after the grace period still ends a rank that hangs)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import time

import numpy as np

import xccl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=10.0, help="operation timeout (s)")
    ap.add_argument("--max-seconds", type=float, default=120.0)
    ap.add_argument("--count", type=int, default=1 << 16)
    ap.add_argument("--algo", default=None)
    ap.add_argument("--arm-before-init", action="store_true")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.arm_before_init:
        pathlib.Path(os.environ["XH_CTL"], "arm").touch()
        time.sleep(1.0)  # --link-down HOST:0 acts within the harness's 50 ms poll
        t0 = time.monotonic()
        try:
            xccl.init_process_group("auto", timeout=args.timeout)
            xccl.barrier()
        except Exception as e:  # noqa: BLE001
            info = {"rank": int(os.environ["RANK"]), "host": socket.gethostname(),
                    "type": type(e).__name__, "msg": str(e), "call_s": time.monotonic() - t0,
                    "calls": 0}
            print("XH-ERROR " + json.dumps(info), flush=True)
            os._exit(3)
        print(f"XH-NOERROR {xccl.get_rank()} at init", flush=True)
        os._exit(4)
    xccl.init_process_group("auto", timeout=args.timeout)
    rank, world = xccl.get_rank(), xccl.get_world_size()
    xccl.barrier()
    pathlib.Path(os.environ["XH_CTL"], "arm").touch()
    base = np.arange(args.count, dtype=np.float64)
    end = time.monotonic() + args.max_seconds
    calls = 0
    while time.monotonic() < end:
        x = base + rank
        t0 = time.monotonic()
        try:
            xccl.all_reduce(x, algo=args.algo)
        except Exception as e:  # noqa: BLE001 - the point is to report whatever is raised
            info = {"rank": rank, "host": socket.gethostname(), "type": type(e).__name__,
                    "msg": str(e), "call_s": time.monotonic() - t0, "calls": calls}
            print("XH-ERROR " + json.dumps(info), flush=True)
            os._exit(3)  # the communicator is broken: no orderly destroy
        np.testing.assert_array_equal(x, base * world + world * (world - 1) / 2)
        calls += 1
    print(f"XH-NOERROR {rank} after {calls} calls", flush=True)
    os._exit(4)


if __name__ == "__main__":
    main()
