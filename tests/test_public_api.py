"""Every name a package lists in ``__all__`` exists, and public modules re-export their names."""

import importlib
import pkgutil

import pytest

import rlcore


def _modules():
    names = ["rlcore"]
    for info in pkgutil.walk_packages(rlcore.__path__, "rlcore."):
        if not info.name.rsplit(".", 1)[-1].startswith("_"):
            names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_all_names_exist(name):
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ lists missing names {missing}"


@pytest.mark.parametrize("package", ["rlcore.ops", "rlcore.algos", "rlcore.dataflow"])
def test_packages_reexport_their_modules(package):
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        sub = importlib.import_module(f"{package}.{info.name}")
        for n in getattr(sub, "__all__", []):
            assert n in pkg.__all__, f"{package}.{info.name}.{n} is public but not re-exported by {package}"
