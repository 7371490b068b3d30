"""One rank of a fault-injection job (started by tests/faults/driver.py, not by hand).

Joins the process group described by the environment (RANK, WORLD_SIZE, FAULT_INIT,
FAULT_TIMEOUT, FAULT_SEED, FAULT_GROUPS, FAULT_MAX_COUNT), then runs the shared random
workload (tests/workload.py) until an xccl operation fails (or, with FAULT_OPS=N, for N
operations: a fault-free control round), checking every result against numpy. It reports to
the driver, one JSON object per line, on the file descriptor FAULT_FD:

    {"ev": "ready", "rank": r, "t": monotonic, "comms": {...}}    after init and new_group
    {"ev": "end", "rank": r, "status": S, "type": ..., "msg": ..., "ops": n, "t": monotonic}

with S "done" (FAULT_OPS operations ran), "error" (an xccl error: the expected outcome once a
peer died or stopped), "wrong" (a result differed from numpy: always a failure), or "crash"
(any other exception). Then it destroys the process group and exits 0. time.monotonic() is
CLOCK_MONOTONIC, the same clock in every process of the machine, so the driver can compare
the times. "comms" maps communicator names to workload groups (for mapping the ranks an error
message names).

FAULT_SELFTEST=wrong|leak makes ranks misbehave on purpose (rank 0 reports wrong data; every
rank leaves a file and a process in a session of its own behind), to show that the driver's
checks can fail.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import workload as W  # noqa: E402


def _emit(fd: int, **msg: object) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _leak() -> None:
    """FAULT_SELFTEST=leak: leaves a file in TMPDIR and a process in the job's session, which
    the driver must report (tests/faults/test_faults.py checks that it does)."""
    import subprocess
    import tempfile

    fd, _ = tempfile.mkstemp(prefix="selftest-")
    os.close(fd)
    subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)


def main() -> int:
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    fd = int(os.environ["FAULT_FD"])
    seed = int(os.environ["FAULT_SEED"])
    groups = json.loads(os.environ["FAULT_GROUPS"])
    timeout = float(os.environ["FAULT_TIMEOUT"])
    max_count = int(os.environ["FAULT_MAX_COUNT"])
    max_ops = int(os.environ.get("FAULT_OPS", "0")) or None  # a fault-free round: then "done"

    import xccl

    ops = 0
    status, kind, msg = "crash", "", ""
    try:
        xccl.init_process_group(
            "auto",
            init_method=os.environ["FAULT_INIT"],
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        handles = W.make_groups(xccl, groups)
        # communicator names as error messages quote them ("on comm 'X'"): the default
        # group's communicator is named by its description ("default_pg"), the others by
        # their group name
        world = xccl.group.WORLD
        comms = {world.group_desc: 0, world.group_name: 0}
        for gi, h in enumerate(handles[1:], 1):
            if isinstance(h, xccl.ProcessGroup):
                comms[h.group_name] = gi
        _emit(fd, ev="ready", rank=rank, t=time.monotonic(), comms=comms)
        wl = W.Workload(seed, world_size, groups, max_count=max_count)
        selftest = os.environ.get("FAULT_SELFTEST", "")
        if selftest == "leak":
            _leak()
        for op in wl.ops(max_ops):
            if selftest == "wrong" and rank == 0 and ops == 5:
                raise W.WrongResult(f"self-test: rank {rank} pretends op #{op.index} was wrong")
            W.run_op(xccl, seed, op, handles[op.group], rank, groups[op.group])
            ops += 1
        status = "done"
    except W.WrongResult as e:
        status, kind, msg = "wrong", type(e).__name__, str(e)
    except xccl.XcclError as e:
        status, kind, msg = "error", type(e).__name__, str(e)
    except BaseException as e:  # noqa: BLE001 - reported to the driver as a crash
        status, kind, msg = "crash", type(e).__name__, traceback.format_exc()
    t = time.monotonic()
    print(f"rank {rank}: {status} after {ops} ops: {kind}: {msg}", file=sys.stderr, flush=True)
    _emit(fd, ev="end", rank=rank, status=status, type=kind, msg=msg, ops=ops, t=t)
    try:
        if xccl.is_initialized():
            xccl.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        _emit(fd, ev="destroy_failed", rank=rank, msg=f"{type(e).__name__}: {e}")
        return 3
    _emit(fd, ev="exit", rank=rank, t=time.monotonic())
    return 0


if __name__ == "__main__":
    sys.exit(main())
