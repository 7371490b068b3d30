"""Job script: init, one all_reduce checked against numpy, destroy; prints ``XH-OK <rank>``.
The smallest job, for the tests of what happens at initialisation (interfaces, job secret)."""

from __future__ import annotations

import numpy as np

import xccl


def main() -> None:
    xccl.init_process_group("auto", timeout=30)
    rank, world = xccl.get_rank(), xccl.get_world_size()
    x = np.arange(1000, dtype=np.float64) + rank
    xccl.all_reduce(x)
    np.testing.assert_array_equal(x, np.arange(1000) * world + world * (world - 1) / 2)
    print(f"XH-OK {rank}", flush=True)
    xccl.destroy_process_group()


if __name__ == "__main__":
    main()
