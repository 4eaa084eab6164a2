"""The README's Python examples run as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {"__name__": "readme"})


def test_custom_algorithm_example_is_short():
    custom = next(b for b in BLOCKS if "_replace(" in b)
    replace_call = custom[custom.index("algo = ") : custom.index("batch = algo.advantages")]
    assert len([line for line in replace_call.splitlines() if line.strip()]) < 20
