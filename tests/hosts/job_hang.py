"""Job script: a hung rank. After init every rank creates ``$XH_CTL/arm``; the last rank then
ignores SIGTERM and sleeps, the others wait for it in a barrier with a long timeout. Only the
harness (``--timeout``, or a signal to run.sh) ends this job: it must escalate to SIGKILL and
leave nothing behind."""

from __future__ import annotations

import os
import pathlib
import signal
import time

import xccl


def main() -> None:
    xccl.init_process_group("auto", timeout=600)
    rank, world = xccl.get_rank(), xccl.get_world_size()
    xccl.barrier()
    pathlib.Path(os.environ["XH_CTL"], f"arm.{rank}").touch()
    pathlib.Path(os.environ["XH_CTL"], "arm").touch()
    if rank == world - 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
    xccl.barrier()


if __name__ == "__main__":
    main()
