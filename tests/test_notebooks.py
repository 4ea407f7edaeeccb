"""The notebooks in notebooks/ run top to bottom without an error (their assert cells included).

Each notebook is executed in a fresh ``python3`` kernel (this interpreter's ipykernel) with
nbclient, in the notebooks folder, with the loopback gloo environment that tests/conftest.py sets.
A failing assert cell, an exception or a cell running past its timeout fails the test, and the
kernel with the DDP workers it forked is shut down. The notebooks are stored without outputs.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = (
    "01_quickstart.ipynb",
    "02_syncbn.ipynb",
    "03_accumulation.ipynb",
    "04_sequential_evaluation.ipynb",
    "05_seeding.ipynb",
    "06_where_time_goes.ipynb",
    "07_reproducible.ipynb",
)
CELL_TIMEOUT_S = 180  # generous: a loaded machine is slow, a hang is not


def test_every_notebook_is_listed_and_stored_without_outputs():
    assert sorted(p.name for p in NOTEBOOKS_DIR.glob("*.ipynb")) == sorted(NOTEBOOKS)
    for name in NOTEBOOKS:
        nb = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
        nbformat.validate(nb)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        assert all(not cell.outputs and cell.execution_count is None for cell in code), f"{name} has outputs"
        assert any("assert " in cell.source for cell in code), f"{name} asserts none of its claims"
        assert nb.cells[0].cell_type == "markdown", f"{name} should start by saying what it shows"


@pytest.mark.slow
@pytest.mark.timeout(360)
# the quickstart in make test, every other notebook (20 to 60 s each here) in make test-e2e
@pytest.mark.parametrize("name", [NOTEBOOKS[0], *(pytest.param(n, marks=pytest.mark.e2e) for n in NOTEBOOKS[1:])])
def test_notebook_runs_without_error(name):
    nb = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
        shutdown_kernel="immediate",
    )
    client.execute()  # raises CellExecutionError (with the cell and its traceback) on any error
    errors = [out for cell in nb.cells for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors, errors
