"""Load objects named in a config: ``"path/to/file.py:Name"`` or ``"package.module:Name"``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

__all__ = ["load_reference"]


def load_reference(ref: str, *, what: str = "reference", base_dir: str | os.PathLike | None = None) -> Any:
    """The object a ``"file.py:Name"`` or ``"package.module:Name"`` reference names (``Name`` may be dotted).

    A relative file path is taken from ``base_dir`` (e.g. the config file's folder),
    else from the working directory. Errors raise ``ValueError`` naming ``what``.

    >>> load_reference("rlcore.agent.calc:calculator").name
    'calculator'
    >>> load_reference("rlcore.agent:Nope", what="rl.multi_turn.env")
    Traceback (most recent call last):
    ...
    ValueError: rl.multi_turn.env: got 'rlcore.agent:Nope', but rlcore.agent has no attribute 'Nope'
    """
    if not isinstance(ref, str) or ref.count(":") != 1 or not all(ref.split(":")):
        raise ValueError(f"{what}: got {ref!r}, expected 'file.py:Name' or 'package.module:Name'")
    source, name = ref.split(":")
    if source.endswith(".py"):
        path = source if os.path.isabs(source) or base_dir is None else os.path.join(base_dir, source)
        if not os.path.isfile(path):
            raise ValueError(f"{what}: got {ref!r}, but {path!r} is not a file")
        module_name = f"rlcore_ref_{abs(hash(os.path.abspath(path)))}"
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, path)
            if spec is None or spec.loader is None:
                raise ValueError(f"{what}: got {ref!r}, but {path!r} cannot be imported")
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
            try:
                spec.loader.exec_module(module)
            except Exception as err:
                del sys.modules[module_name]
                raise ValueError(f"{what}: importing {path!r} raised {type(err).__name__}: {err}") from err
    else:
        try:
            module = importlib.import_module(source)
        except ImportError as err:
            raise ValueError(f"{what}: got {ref!r}, but module {source!r} cannot be imported: {err}") from err
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}: got {ref!r}, but {source} has no attribute {name!r}")
        obj = getattr(obj, part)
    return obj
