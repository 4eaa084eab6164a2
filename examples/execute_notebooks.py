"""Execute the example notebooks top to bottom and store them with their outputs and plots.

Run from the repository root after changing a notebook or an API it uses:
``python examples/execute_notebooks.py`` (or name notebooks: ``... examples/04_memory.ipynb``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbclient
import nbformat

EXAMPLES = Path(__file__).resolve().parent


def execute(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(EXAMPLES)}}
    ).execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # timestamps: noise in every diff
    nbformat.validate(nb)
    nbformat.write(nb, path)
    print(f"executed {path.name}")


if __name__ == "__main__":
    for arg in sys.argv[1:] or sorted(str(p) for p in EXAMPLES.glob("*.ipynb")):
        execute(Path(arg).resolve())
