"""Every notebook runs from top to bottom, at the small settings it takes for tests.

The notebooks a test worker runs share one IPython kernel (nbclient), started
with ``LINATTN_NOTEBOOK_SMALL=1`` (tiny sizes, same code) and the suite's
``XLA_FLAGS``: starting a kernel and importing JAX cost seconds per notebook.
Before each notebook the kernel forgets every name (``%reset -f``), so a
notebook that uses a name it does not define or import still fails, and it
writes what it produces under a temporary ``LINATTN_NOTEBOOK_OUT``. A notebook
that sets up JAX's backend (its CPU device count) gets a kernel of its own: that
must happen before JAX first starts the backend. A cell that raises fails the
test with its traceback.
"""

from __future__ import annotations

import os
import pathlib

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

# From the repository root, wherever pytest runs from.
NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_the_six_notebooks_are_here():
  assert [p.stem.split("_", 1)[0] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06"]


def _start_kernel() -> KernelManager:
  manager = KernelManager(kernel_name="python3")
  manager.start_kernel(cwd=str(NOTEBOOK_DIR), env=dict(os.environ, LINATTN_NOTEBOOK_SMALL="1"))
  return manager


@pytest.fixture(scope="module")
def shared_kernel():
  manager = _start_kernel()
  yield manager
  manager.shutdown_kernel(now=True)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, shared_kernel):
  notebook = nbformat.read(path, as_version=4)
  own = any("jax_num_cpu_devices" in cell.source for cell in notebook.cells)
  kernel = _start_kernel() if own else shared_kernel
  fresh = f"%reset -f\nimport os\nos.environ['LINATTN_NOTEBOOK_OUT'] = {str(tmp_path)!r}\ndel os"
  notebook.cells.insert(0, nbformat.v4.new_code_cell(fresh))
  try:
    NotebookClient(notebook, km=kernel, timeout=600).execute()
  finally:
    if own:
      kernel.shutdown_kernel(now=True)
  code = [cell for cell in notebook.cells[1:] if cell.cell_type == "code"]
  assert code and all(cell.execution_count for cell in code)
  assert not [o for cell in code for o in cell.outputs if o.output_type == "error"]
