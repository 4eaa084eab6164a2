"""Lint, format and type checks run with the suite, so CI fails on any of them."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_lint():
    proc = _run("ruff", "check", "src", "tests", "benchmarks", "docs")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format():
    proc = _run("ruff", "format", "--check", "src", "tests", "benchmarks", "docs")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_on_the_package():
    proc = _run("mypy", "--cache-dir", str(ROOT / ".mypy_cache"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_package_ships_py_typed():
    assert (ROOT / "src" / "rlcore" / "py.typed").exists()
