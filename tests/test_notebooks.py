"""The example notebooks: stored executed, with their outputs and plots, and each one runs top to bottom without an error.

After changing a notebook, store it executed again: ``python examples/execute_notebooks.py``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import ipykernel  # noqa: F401  (the kernel nbclient starts; the test extra installs it)
import matplotlib  # noqa: F401
import nbclient
import nbformat
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
# Seconds for a whole notebook; each takes well under a minute on one core.
TIMEOUT = 240

# Appended to the executed copy only: keep the figures open (the inline backend closes
# them once shown), then check that every plot says what it shows.
_KEEP_FIGURES = "%config InlineBackend.close_figures = False"
_CHECK_FIGURES = """
import matplotlib.pyplot as _plt
_problems = []
for _num in _plt.get_fignums():
    _fig = _plt.figure(_num)
    _axes = [a for a in _fig.axes if a.has_data()]
    if not _axes:
        _problems.append(f"figure {_num} plots nothing")
    if any(not a.get_title() for a in _axes) and not _fig.get_suptitle():
        _problems.append(f"figure {_num}: an axes without a title")
    if not any(a.get_xlabel() for a in _axes) or not any(a.get_ylabel() for a in _axes):
        _problems.append(f"figure {_num}: axes not labelled")
assert _plt.get_fignums(), "no figure"
assert not _problems, _problems
"""


def test_the_four_notebooks_exist() -> None:
    names = {p.name for p in NOTEBOOKS}
    assert {"01_custom_algorithm.ipynb", "02_preference.ipynb", "03_dataflow.ipynb", "04_memory.ipynb"} <= names


# What a stored output must not show: this machine's paths.
_MACHINE_PATHS = re.compile(r"(/home/|/root/|/tmp/|/work/|site-packages)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_stored_executed_with_outputs_and_plots(path: Path) -> None:
    # Issue 18, defect 15: the notebooks shipped without outputs, so a reader saw no result.
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    # One run, top to bottom, with nothing skipped or re-run out of order.
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), f"{path.name}: not one clean run"
    outputs = [out for cell in code for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"], f"{path.name}: stored with an error"
    assert any("image/png" in out.get("data", {}) for out in outputs), f"{path.name}: stored without its plots"
    for i, cell in enumerate(code):
        for out in cell.outputs:
            text = out.get("text", "") + str(out.get("data", {}).get("text/plain", ""))
            assert not _MACHINE_PATHS.search(text), f"{path.name}: code cell {i} shows a machine path: {text[:300]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(_KEEP_FIGURES))
    nb.cells.append(nbformat.v4.new_code_cell(_CHECK_FIGURES))
    deadline = time.monotonic() + TIMEOUT
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        resources={"metadata": {"path": str(EXAMPLES)}},
        # Each cell may use what is left of the notebook's budget.
        timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
    )
    # Raises CellExecutionError, with the failing cell and its traceback, on any error.
    client.execute()
