"""Every notebook runs from top to bottom, at the small settings it takes for tests.

Each runs on its own IPython kernel (nbclient) with ``LINATTN_NOTEBOOK_SMALL=1``
(tiny sizes, same code) and writes what it produces under a temporary
``LINATTN_NOTEBOOK_OUT``; the kernel inherits the suite's ``XLA_FLAGS``. A
cell that raises fails the test with its traceback.
"""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

# From the repository root, wherever pytest runs from.
NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_the_six_notebooks_are_here():
  assert [p.stem.split("_", 1)[0] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
  monkeypatch.setenv("LINATTN_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("LINATTN_NOTEBOOK_OUT", str(tmp_path))
  notebook = nbformat.read(path, as_version=4)
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(path.parent)}}).execute()
  code = [cell for cell in notebook.cells if cell.cell_type == "code"]
  assert code and all(cell.execution_count for cell in code)
  assert not [o for cell in code for o in cell.outputs if o.output_type == "error"]
