"""The MPI side of xccl's comparisons: xccl-bench's harness, run on MPI through mpi4py.

    mpirun -np 2 python benchmarks/mpi_bench.py -b 8 -e 128M -f 4 -o all
    mpirun --allow-run-as-root --oversubscribe -np 4 --mca pml ob1 --mca btl self,vader \\
        python benchmarks/mpi_bench.py -b 8 -e 128M -f 4 -o all_reduce --json mpi.json

It takes xccl-bench's flags (less the launcher ones: mpirun starts the ranks), prints the
same table with the same correctness check, and writes the same JSON, so that
``benchmarks/compare.py`` can set the two side by side. It needs mpi4py and an MPI library
(``pip install -r benchmarks/requirements.txt``; Debian/Ubuntu: ``apt-get install
openmpi-bin libopenmpi-dev``).

Buffers are numpy arrays, or with ``--tensor torch`` torch tensors handed over as numpy views
(memory from the allocator xccl and gloo get in a comparison), given to mpi4py's buffer
methods (``Allreduce``, ``Allgather``, ``Reduce_scatter_block``, ``Bcast``, ``Reduce``,
``Alltoall``, ``Sendrecv``, ``Send``/``Recv``);
in-place forms use ``MPI.IN_PLACE`` where MPI has one that matches nccl-tests' layout.
Open MPI picks its transport by MCA parameters: ``--mca btl self,vader`` (shared memory;
``self,sm`` in Open MPI 5) or ``--mca btl self,tcp``, with ``--mca pml ob1`` so that the btl
choice is what carries the messages.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any, Optional

# The module, not the package attribute: ``xccl.bench`` is the teaching function.
try:
    bench = importlib.import_module("xccl.bench")
except ImportError:  # not installed: use the source tree next to this file
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    bench = importlib.import_module("xccl.bench")

PROG = "mpi_bench.py"


class MpiRunner(bench.Runner):
    """MPI_COMM_WORLD through mpi4py, on numpy arrays or on torch tensors' memory."""

    name = "mpi"

    def __init__(self, kind: str = "numpy") -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.arrays = bench.Arrays(kind)

    def _redop(self, redop: str) -> Any:
        MPI = self.MPI
        if redop == "avg":
            raise ValueError("MPI has no average reduction: use --redop sum")
        return {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}[redop]

    def prepare(
        self, op: str, sbuf: Any, rbuf: Any, root: int, redop: str, inplace: bool
    ) -> Optional[Callable[[], None]]:
        c, IN_PLACE = self.comm, self.MPI.IN_PLACE
        if self.arrays.kind == "torch":  # mpi4py reads the tensors' memory through numpy views
            sbuf, rbuf = sbuf.numpy(), rbuf.numpy()
        if op == "all_reduce":
            rop = self._redop(redop)
            if inplace:
                return lambda: c.Allreduce(IN_PLACE, rbuf, rop)
            return lambda: c.Allreduce(sbuf, rbuf, rop)
        if op == "all_gather":
            if inplace:  # MPI's in-place all-gather reads this rank's block of rbuf
                return lambda: c.Allgather(IN_PLACE, rbuf)
            return lambda: c.Allgather(sbuf, rbuf)
        if op == "reduce_scatter":
            # MPI's in-place form leaves the result at offset 0, not at this rank's block.
            rop = self._redop(redop)
            return None if inplace else (lambda: c.Reduce_scatter_block(sbuf, rbuf, rop))
        if op == "broadcast":
            return (lambda: c.Bcast(rbuf, root)) if inplace else None
        if op == "reduce":
            rop = self._redop(redop)
            if not inplace:
                return lambda: c.Reduce(sbuf, rbuf, rop, root)
            if self.rank == root:
                return lambda: c.Reduce(IN_PLACE, rbuf, rop, root)
            return lambda: c.Reduce(rbuf, None, rop, root)
        if op == "all_to_all":
            return None if inplace else (lambda: c.Alltoall(sbuf, rbuf))
        if op == "sendrecv":
            if inplace:
                return None
            nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
            return lambda: c.Sendrecv(sbuf, nxt, 0, rbuf, prv, 0)
        if op == "pingpong":
            if inplace:
                return None
            peer = bench.pingpong_peer(self.rank, self.size)
            if peer is None:
                return lambda: None
            if self.rank % 2 == 0:

                def ping() -> None:
                    c.Send(sbuf, peer)
                    c.Recv(rbuf, peer)

                return ping

            def pong() -> None:
                c.Recv(rbuf, peer)
                c.Send(sbuf, peer)

            return pong
        raise ValueError(op)

    def barrier(self) -> None:
        self.comm.Barrier()

    def allreduce_floats(self, values: list[float], how: str) -> list[float]:
        import numpy as np

        src = np.array(values, dtype=np.float64)
        dst = np.empty_like(src)
        self.comm.Allreduce(src, dst, self.MPI.SUM if how == "sum" else self.MPI.MAX)
        return [float(v) for v in dst]

    def gather_strings(self, text: str) -> list[str]:
        return [str(s) for s in self.comm.allgather(text)]

    def describe(self) -> dict[str, Any]:
        import mpi4py

        version = self.MPI.Get_library_version().strip().splitlines()[0]
        version = version.split(",")[0]  # "Open MPI v4.1.4, package: ..." -> "Open MPI v4.1.4"
        btl = os.environ.get("OMPI_MCA_btl")
        pml = os.environ.get("OMPI_MCA_pml")
        info: dict[str, Any] = {"version": f"{version}, mpi4py {mpi4py.__version__}"}
        info["tensor"] = self.arrays.kind
        info["transports"] = [btl] if btl else ["default"]
        if pml:
            info["pml"] = pml
        return info

    def close(self, ok: bool = True) -> None:
        if ok:
            self.comm.Barrier()
        else:  # the other ranks may be blocked in a collective: end the whole job
            self.comm.Abort(1)


def main(argv: Optional[list[str]] = None) -> int:
    """Parses xccl-bench's flags (no launcher flags) and runs the harness on MPI."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = bench.build_parser(prog=PROG, launcher=False)
    args = parser.parse_args(argv)
    try:
        opts = bench.options_from_args(args, " ".join([PROG, *argv]), PROG)
        if opts.dtype.name in ("bfloat16", "float16"):
            raise ValueError(f"{opts.dtype.name}: MPI has no such type")
        kind = "torch" if args.tensor == "torch" else "numpy"
    except ValueError as e:
        parser.error(str(e))
    runner = MpiRunner(kind)
    try:
        status = bench.run_benchmarks(runner, opts)  # rank 0 prints, the others are silent
    except BaseException:
        import traceback

        traceback.print_exc()
        runner.close(ok=False)
        raise
    runner.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
