"""xccl-bench: a fast smoke run of the CLI (2 spawned ranks, tiny sizes) whose table must
parse and report no wrong element, plus in-process checks of the harness (nccl-tests
formulas, size sweeps, and that the #wrong column does catch wrong results)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from typing import Any, Optional

import pytest

bench = importlib.import_module("xccl.bench")  # the command line (xccl-bench)


def parse_tables(text: str) -> dict[str, list[dict[str, Any]]]:
    """Rows of every table in xccl-bench's output, by operation. A row is a dict of size,
    count, type, redop, root and, for "out" and "in", None (N/A) or (time, algbw, busbw,
    wrong)."""
    tables: dict[str, list[dict[str, Any]]] = {}
    current: Optional[str] = None
    for line in text.splitlines():
        if line.startswith("# ") and line[2:].strip() in bench.OPS:
            current = line[2:].strip()
            tables[current] = []
            continue
        if not line.strip() or line.startswith("#"):
            continue
        cols = line.split()
        assert len(cols) == 13, f"row with {len(cols)} columns: {line!r}"
        assert current is not None, f"row before any table title: {line!r}"

        def block(cells: list[str]) -> Optional[tuple[float, float, float, Optional[int]]]:
            if cells[0] == "N/A":
                return None
            wrong = None if cells[3] == "N/A" else int(cells[3])
            return float(cells[0]), float(cells[1]), float(cells[2]), wrong

        tables[current].append(
            {
                "size": int(cols[0]),
                "count": int(cols[1]),
                "type": cols[2],
                "redop": cols[3],
                "root": int(cols[4]),
                "out": block(cols[5:9]),
                "in": block(cols[9:13]),
            }
        )
    return tables


@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
def test_cli_smoke(op: str, tmp_path: Any) -> None:
    out_json = tmp_path / "rows.json"
    cmd = [
        sys.executable,
        "-m",
        "xccl.bench",
        "-b",
        "8",
        "-e",
        "4K",
        "-f",
        "4",
        "-n",
        "3",
        "-w",
        "1",
        "-c",
        "1",
        "--np",
        "2",
        "-o",
        op,
        "--json",
        str(out_json),
    ]
    # the installed package (the source tree has no built extension after `pip install .`)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    tables = parse_tables(proc.stdout)
    assert list(tables) == [op]
    rows = tables[op]
    if op == "all_reduce":
        assert [r["size"] for r in rows] == [8, 32, 128, 512, 2048, 4096]
        assert [r["count"] for r in rows] == [2, 8, 32, 128, 512, 1024]
    else:  # 2 ranks: the size is the gathered output, the count one rank's share
        assert [r["size"] for r in rows] == [8, 32, 128, 512, 2048, 4096]
        assert [r["count"] for r in rows] == [1, 4, 16, 64, 256, 512]
    for row in rows:
        assert row["type"] == "float"
        assert row["redop"] == ("sum" if op == "all_reduce" else "none")
        for where in ("out", "in"):
            cells = row[where]
            assert cells is not None, f"{op} {where}-of-place missing at {row['size']} B"
            time_us, algbw, busbw, wrong = cells
            assert wrong == 0, f"{op} {where}-place, {row['size']} B: {wrong} wrong"
            assert time_us > 0 and algbw >= 0
            # 2 ranks: all_reduce busbw = algbw, all_gather busbw = algbw / 2
            factor = 1.0 if op == "all_reduce" else 0.5
            assert busbw == pytest.approx(algbw * factor, abs=2e-3)
    assert "# Out of bounds values : 0 OK" in proc.stdout
    assert "# Avg bus bandwidth" in proc.stdout

    data = json.loads(out_json.read_text())
    assert data["meta"]["nranks"] == 2 and data["meta"]["backend"] == "xccl"
    assert len(data["rows"]) == 2 * len(rows)
    assert all(r["wrong"] == 0 for r in data["rows"])


# --------------------------------------------------------------------------- harness units


def test_bus_factors_are_nccl_tests() -> None:
    assert bench.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bench.bus_factor(op, 4) == pytest.approx(0.75)
    for op in ("broadcast", "reduce", "sendrecv", "pingpong"):
        assert bench.bus_factor(op, 4) == 1.0


def test_names_sizes_layouts() -> None:
    assert bench.parse_size("4K") == 4096 and bench.parse_size("32M") == 32 << 20
    assert bench.size_list(8, 4096, 4, 0) == [8, 32, 128, 512, 2048, 4096]
    assert bench.size_list(8, 100, 4, 0) == [8, 32, 100]  # maxbytes always last
    assert bench.parse_ops("allreduce,alltoall,reducescatter,allgather,sendrecv") == [
        "all_reduce",
        "all_to_all",
        "reduce_scatter",
        "all_gather",
        "sendrecv",
    ]
    assert bench.parse_ops("all") == list(bench.ALL_OPS)
    assert bench.parse_dtype("half").name == "float16"
    assert bench.parse_dtype("float").label == "float"
    with pytest.raises(ValueError):
        bench.parse_ops("allfoo")
    # 3 ranks, 64 B of float32: 16 elements, 5 per rank for the rooted-less splits
    assert bench.layout("all_gather", 64, 4, 3) == bench.Layout(5, 5, 15, 60)
    assert bench.layout("reduce_scatter", 64, 4, 3) == bench.Layout(5, 15, 5, 60)
    assert bench.layout("all_to_all", 64, 4, 3) == bench.Layout(5, 15, 15, 60)
    assert bench.layout("all_reduce", 64, 4, 3) == bench.Layout(16, 16, 16, 64)


class _OneRank(bench.Runner):
    """A one-rank library in this process; `broken` makes out-of-place all_reduce a no-op."""

    name = "fake"

    def __init__(self, broken: bool) -> None:
        self.arrays = bench.Arrays("numpy")
        self.broken = broken

    def prepare(self, op, sbuf, rbuf, root, redop, inplace):
        if op != "all_reduce":
            return None
        if inplace or self.broken:
            return lambda: None  # one rank: in place, the input is the result

        def copy() -> None:
            rbuf[:] = sbuf

        return copy

    def barrier(self) -> None:
        pass

    def allreduce_floats(self, values, how):
        return list(values)

    def gather_strings(self, text):
        return [text]


def _options(**kw: Any) -> bench.Options:
    base = dict(
        ops=["all_reduce"],
        sizes=[8, 1000],
        dtype=bench.DTYPES["float32"],
        redop="sum",
        root=0,
        iters=2,
        warmup=1,
        check=1,
        average=1,
        mintime=0.0,
        placement="both",
        progress=False,
        json_path=None,
        command="test",
    )
    base.update(kw)
    return bench.Options(**base)


@pytest.mark.parametrize("broken", [False, True])
def test_wrong_column_catches_errors(broken: bool, capsys: Any) -> None:
    status = bench.run_benchmarks(_OneRank(broken), _options())
    tables = parse_tables(capsys.readouterr().out)
    rows = tables["all_reduce"]
    assert [r["size"] for r in rows] == [8, 1000]
    for row in rows:
        assert row["in"][3] == 0
        # a no-op leaves the zeroed output: every element is wrong
        assert row["out"][3] == (row["count"] if broken else 0)
    assert status == (1 if broken else 0)
