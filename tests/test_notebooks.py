"""Executes every notebook of notebooks/ top to bottom in a fresh Jupyter kernel (nbclient);
any cell that raises fails the test. The kernel inherits this process's environment, so it
imports the same xccl.

Without nbclient, nbformat, ipykernel or matplotlib the tests are skipped, except under CI
(``CI`` set), where the [test] extras install them and a missing one is a failure."""

from __future__ import annotations

import os
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300


def _need(module: str):
    if os.environ.get("CI"):
        return __import__(module)
    return pytest.importorskip(module)


def test_there_are_five_notebooks():
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    nbformat = _need("nbformat")
    nbclient = _need("nbclient")
    _need("ipykernel")
    _need("matplotlib")
    nb = nbformat.read(str(path), as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    client.execute()  # raises CellExecutionError, naming the cell, on the first error
    errors = [o for cell in nb.cells if cell.cell_type == "code"
              for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert errors == []
