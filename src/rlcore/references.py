"""Objects named in a config: ``"path/to/file.py:Name"`` or ``"package.module:Name"``.

One loader for every setting that names user code (rewards, environments, tools), so
they all resolve paths and report failures the same way.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Any

__all__ = ["load_reference"]


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def _import_file(ref: str, path: str, what: str) -> Any:
    # A stable name per file: importing the same file twice gives the same classes.
    module_name = "rlcore_ref_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{what}: got {ref!r}, but {path!r} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[module_name]
        if not isinstance(err, (Exception, SystemExit)):  # Ctrl-C stays Ctrl-C; sys.exit() is the file's error
            raise
        raise ValueError(f"{what}: got {ref!r}, but importing {path!r} raised {_one_line(err)}") from err
    return module


def load_reference(ref: str, *, what: str = "reference", base_dir: str | os.PathLike | None = None) -> Any:
    """The object a ``"file.py:Name"`` or ``"package.module:Name"`` reference names (``Name`` may be dotted).

    A relative file path is taken from ``base_dir`` (e.g. the config file's folder),
    else from the working directory. The file is imported once per process (a second
    reference to it returns objects of the same module).

    Args:
      ref: the reference.
      what: the setting that holds it, named in errors (e.g. ``"rewards[1].reward"``).
      base_dir: the folder relative file paths start from.

    Returns:
      The named object (a class, a function, a module attribute).

    Raises:
      ValueError: one line naming ``what``, the reference and what went wrong (a
        missing file, the import error or a ``sys.exit`` at import, a missing attribute).

    >>> load_reference("rlcore.rewards:LengthReward").__name__
    'LengthReward'
    >>> load_reference("rlcore.rewards:Nope", what="rewards[0].reward")
    Traceback (most recent call last):
    ...
    ValueError: rewards[0].reward: got 'rlcore.rewards:Nope', but rlcore.rewards has no attribute 'Nope'
    """
    source, _, name = ref.rpartition(":") if isinstance(ref, str) else ("", "", "")
    if not source or not name or not all(name.split(".")):
        raise ValueError(f"{what}: got {ref!r}, expected 'file.py:Name' or 'package.module:Name'")
    if source.endswith(".py"):
        path = source if os.path.isabs(source) or base_dir is None else os.path.join(base_dir, source)
        if not os.path.isfile(path):
            raise ValueError(f"{what}: got {ref!r}, but {path!r} is not a file")
        module = _import_file(ref, path, what)
    else:
        try:
            module = importlib.import_module(source)
        except (Exception, SystemExit) as err:
            raise ValueError(f"{what}: got {ref!r}, but importing {source!r} raised {_one_line(err)}") from err
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}: got {ref!r}, but {source} has no attribute {name!r}")
        obj = getattr(obj, part)
    return obj
