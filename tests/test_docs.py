"""The API reference: ``mkdocs build --strict`` passes and every public name is in it."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect
import pkgutil
import subprocess
import sys
import zlib
from pathlib import Path

import mkdocstrings_handlers.python  # noqa: F401  (the test extra installs the reference's handler)
import pytest

import rlcore

ROOT = Path(__file__).resolve().parents[1]
# Every public package of rlcore, plus the reference implementations users import.
PACKAGES = sorted(m.name for m in pkgutil.iter_modules(rlcore.__path__) if not m.name.startswith("_"))
CHECKED = [*PACKAGES, "testing.reference"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert "WARNING" not in proc.stderr, proc.stderr
    return out


def _inventory(site: Path) -> set[str]:
    """Object names in the built Sphinx-format inventory (four header lines, then zlib)."""
    raw = (site / "objects.inv").read_bytes()
    header, body = raw.split(b"\n", 4)[:4], raw.split(b"\n", 4)[4]
    assert header[0] == b"# Sphinx inventory version 2", header
    return {line.split(" ", 1)[0] for line in zlib.decompress(body).decode().splitlines() if line}


def test_every_package_has_a_page() -> None:
    assert {"ops", "algos", "dataflow", "memory", "pytree", "device", "testing"} <= set(PACKAGES)
    for name in PACKAGES:
        page = ROOT / "docs" / f"{name}.md"
        assert page.is_file(), f"docs/{name}.md is missing"
        assert f"::: rlcore.{name}\n" in page.read_text(), f"docs/{name}.md does not render rlcore.{name}"


@pytest.mark.parametrize("package", CHECKED)
def test_every_public_name_is_in_the_reference(site: Path, package: str) -> None:
    names = _inventory(site)
    module = importlib.import_module(f"rlcore.{package}")
    assert module.__all__, f"rlcore.{package} has an empty __all__"
    missing = []
    for name in module.__all__:
        obj = getattr(module, name)
        # A function that shares its name with its submodule is documented under its
        # defining module's path (docs/<package>.md renders it explicitly).
        canonical = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
        if f"rlcore.{package}.{name}" not in names and canonical not in names:
            missing.append(name)
    assert not missing, f"rlcore.{package}: names in __all__ missing from the API reference: {missing}"


@pytest.mark.parametrize("package", CHECKED)
def test_every_public_function_and_class_has_a_docstring(package: str) -> None:
    module = importlib.import_module(f"rlcore.{package}")
    undocumented = [
        name
        for name in module.__all__
        if (inspect.isfunction(obj := getattr(module, name)) or inspect.isclass(obj)) and not inspect.getdoc(obj)
    ]
    assert not undocumented, f"rlcore.{package}: public names without a docstring: {undocumented}"


def test_doctests_render_as_highlighted_code(site: Path) -> None:
    html = (site / "algos" / "index.html").read_text()
    assert "arXiv:2402.03300" in html  # grpo's docstring text
    # Fenced by docs/doctest_blocks.py: a pycon prompt span, not a markdown block quote.
    assert '<span class="gp">&gt;&gt;&gt; </span>' in html
    assert "<blockquote" not in html


def test_doctest_fencing_extension() -> None:
    spec = importlib.util.spec_from_file_location("doctest_blocks", ROOT / "docs" / "doctest_blocks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = doctest.testmod(mod)
    assert result.attempted > 0 and result.failed == 0
    text = "Summary.\n\n>>> f([1])\n[(1, 0), (0, 1)]\n\nMore text.\n\n```\n>>> fenced already\n```"
    out = mod.fence_doctests(text).splitlines()
    assert out == [
        "Summary.",
        "",
        "```pycon",
        ">>> f([1])",
        "[(1, 0), (0, 1)]",
        "```",
        "",
        "More text.",
        "",
        "```",
        ">>> fenced already",
        "```",
    ]
