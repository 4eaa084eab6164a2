"""load_reference: files and modules, relative paths, one-line errors naming the setting, the reference and the cause."""

from __future__ import annotations

import pytest

from rlcore.references import load_reference


def test_file_and_module_references(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "mine.py").write_text("class A:\n    class B:\n        x = 3\n\ndef f():\n    return 7\n")
    assert load_reference("sub/mine.py:f", base_dir=tmp_path)() == 7
    assert load_reference(f"{tmp_path}/sub/mine.py:A.B").x == 3
    # the same file is imported once: its classes are the same objects
    assert load_reference("sub/mine.py:A", base_dir=tmp_path) is load_reference(f"{tmp_path}/sub/mine.py:A")
    from rlcore.rewards import LengthReward

    assert load_reference("rlcore.rewards:LengthReward") is LengthReward


def test_errors(tmp_path):
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    (tmp_path / "syntax.py").write_text("def (:\n")
    cases = [
        ("no_colon", "expected 'file.py:Name' or 'package.module:Name'"),
        ("mod:", "expected 'file.py:Name'"),
        ("missing.py:X", r"but '.*missing\.py' is not a file"),
        (
            "broken.py:X",
            r"importing '.*broken\.py' raised ModuleNotFoundError: No module named 'not_a_module_anywhere'",
        ),
        ("syntax.py:X", r"importing '.*syntax\.py' raised SyntaxError"),
        ("not_a_package_xyz.mod:X", r"importing 'not_a_package_xyz\.mod' raised ModuleNotFoundError"),
        ("rlcore.rewards:Nope", "rlcore.rewards has no attribute 'Nope'"),
    ]
    for ref, pattern in cases:
        with pytest.raises(ValueError, match=rf"^rewards\[2\]\.reward: got '{ref}'.*{pattern}") as info:
            load_reference(ref, what="rewards[2].reward", base_dir=tmp_path)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="got 3"):
        load_reference(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("code", ["import sys\nsys.exit(3)\n", "raise SystemExit('bye')\n"])
def test_reprobe30_a_file_calling_exit_at_import_is_a_named_error(tmp_path, code):
    # Tools and environments are loaded through here too: a bare SystemExit ended the CLI with the file's status.
    (tmp_path / "my_env.py").write_text(code)
    with pytest.raises(
        ValueError, match=r"rl\.multi_turn\.env: got 'my_env\.py:Env', but importing .* raised SystemExit"
    ):
        load_reference("my_env.py:Env", what="rl.multi_turn.env", base_dir=tmp_path)
    (tmp_path / "pkg_exit.py").write_text(code)
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ValueError, match=r"importing 'pkg_exit' raised SystemExit"):
            load_reference("pkg_exit:Tool", what="rl.multi_turn.tools[0]")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("pkg_exit", None)
