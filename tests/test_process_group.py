"""One conversion from a ``ProcessGroup`` or a 1-D ``DeviceMesh`` argument to the process group, used everywhere."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from rlcore import algos
from rlcore._process_group import as_process_group
from rlcore.dataflow import pack, shard_samples
from rlcore.models import shard_packed
from rlcore.train.context_parallel import ContextParallelRecipe

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "rlcore"


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_group_is_itself_and_a_1d_mesh_gives_its_group(one_rank):
    world = dist.group.WORLD
    assert as_process_group("group", world) is world
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    assert as_process_group("group", mesh) is mesh.get_group()
    assert as_process_group("group", mesh["dp"]) is mesh.get_group("dp")
    assert as_process_group("group", None, optional=True) is None


@pytest.mark.parametrize(
    ("group", "match"),
    [
        (None, r"process_group: got NoneType, expected a torch.distributed ProcessGroup or 1-D DeviceMesh$"),
        ([0, 1], r"process_group: got list, expected a torch.distributed ProcessGroup or 1-D DeviceMesh"),
        ("dp", r"process_group: got str, expected"),
    ],
)
def test_anything_else_is_refused_naming_the_argument(one_rank, group, match):
    with pytest.raises(ValueError, match=match):
        as_process_group("process_group", group)


def test_optional_accepts_none_only(one_rank):
    with pytest.raises(ValueError, match=r"dp_group: got int, expected .* or None"):
        as_process_group("dp_group", 3, optional=True)


def test_without_torch_distributed_a_group_argument_is_refused():
    assert not dist.is_initialized()
    assert as_process_group("group", None, optional=True) is None  # None needs no process group
    with pytest.raises(ValueError, match="group: got 'dp', expected a process group, but torch.distributed is not"):
        as_process_group("group", "dp")


def test_every_public_entry_refuses_a_2d_mesh_with_the_same_message(one_rank):
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "cp"))
    calls = {
        "group": [
            lambda: shard_samples(lambda b: b, mesh),
            lambda: shard_packed(pack([torch.tensor([1, 2, 3])]), mesh),
            lambda: ContextParallelRecipe(algos.grpo(), mesh),
        ],
        "process_group": [
            lambda: algos.resolve_process_group(mesh),
            lambda: algos.group_sum(torch.ones(2), process_group=mesh),
        ],
        "cp_group": [lambda: algos.sequence_sharded_counts(torch.ones(2, 3), cp_group=mesh)],
        "dp_group": [lambda: algos.sequence_sharded_counts(torch.ones(2, 3), cp_group=mesh["cp"], dp_group=mesh)],
    }
    for name, fns in calls.items():
        for fn in fns:
            with pytest.raises(ValueError, match=rf"^{name}: got a 2-D DeviceMesh, expected a 1-D mesh"):
                fn()


def _converts(fn: ast.AST) -> bool:
    """``fn`` tests for a ``DeviceMesh`` and takes its process group: the conversion, written out."""
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
    tests_mesh = any(
        isinstance(c.func, ast.Name)
        and c.func.id == "isinstance"
        and any(isinstance(n, ast.Name) and n.id == "DeviceMesh" for n in ast.walk(c.args[1]))
        for c in calls
    )
    takes_group = any(isinstance(c.func, ast.Attribute) and c.func.attr == "get_group" for c in calls)
    return tests_mesh and takes_group


def test_no_other_function_converts_a_mesh_by_itself():
    offenders = [
        f"{path.relative_to(SRC)}: {node.name}"
        for path in sorted(SRC.rglob("*.py"))
        if path.name != "_process_group.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and _converts(node)
    ]
    assert not offenders, offenders
