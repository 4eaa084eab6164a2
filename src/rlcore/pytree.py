"""The one pytree layer of rlcore: optree under the namespace ``"rlcore"``.

A batch is a pytree (a dict by default) of tensors sharing a leading sample
dimension. Everything here works on any nesting of dicts, lists, tuples, named
tuples and rlcore containers (frozen dataclasses made with :func:`dataclass`).
rlcore binds its own optree namespace and never touches optree's global registry;
its containers are registered with torch's pytree as well, so ``torch.func.vmap``
and ``torch.compile`` see through them.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar, cast

import optree
import torch
import torch.utils._pytree as torch_pytree

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # torch depends on typing_extensions, so it is always installed
    from typing_extensions import dataclass_transform

__all__ = [
    "NAMESPACE",
    "batch_size",
    "dataclass",
    "static_field",
    "tree_cat",
    "tree_flatten",
    "tree_index",
    "tree_leaves",
    "tree_map",
    "tree_nbytes",
    "tree_split",
    "tree_stack",
    "tree_structure",
    "tree_to",
    "tree_unflatten",
]

NAMESPACE = "rlcore"

T = TypeVar("T")
PyTree = Any


def tree_map(
    fn: Callable[..., Any], tree: PyTree, *rest: PyTree, is_leaf: Callable[[Any], bool] | None = None
) -> PyTree:
    """Apply ``fn`` to every leaf (and the matching leaves of ``rest``).

    >>> tree_map(lambda x: x * 2, {"a": 1, "b": (2, 3)})
    {'a': 2, 'b': (4, 6)}
    """
    return optree.tree_map(fn, tree, *rest, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_leaves(tree: PyTree) -> list[Any]:
    """The leaves of ``tree`` in a deterministic order (dict keys sorted).

    >>> tree_leaves({"b": 2, "a": [1, 3]})
    [1, 3, 2]
    """
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def tree_flatten(tree: PyTree) -> tuple[list[Any], Any]:
    """``(leaves, treespec)``; :func:`tree_unflatten` inverts it."""
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def tree_unflatten(treespec: Any, leaves: Sequence[Any]) -> PyTree:
    """Rebuild a tree from the ``treespec`` of :func:`tree_flatten` and new leaves."""
    return optree.tree_unflatten(treespec, leaves)


def tree_structure(tree: PyTree) -> Any:
    """The treespec of ``tree``."""
    return optree.tree_structure(tree, namespace=NAMESPACE)


def _path_str(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path) or "<root>"


def _tensor_leaves_with_path(tree: PyTree, what: str) -> tuple[list[str], list[torch.Tensor], Any]:
    paths, leaves, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    names = [_path_str(p) for p in paths]
    for name, leaf in zip(names, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(f"{what}: leaf {name} is a {type(leaf).__name__}, expected a torch.Tensor")
    return names, leaves, spec


def batch_size(tree: PyTree) -> int:
    """The leading (sample) dimension shared by every tensor leaf.

    Raises ``ValueError`` naming the first leaf whose leading dimension disagrees,
    a 0-d leaf, or a tree without tensor leaves.

    >>> batch_size({"x": torch.zeros(4, 3), "mask": torch.ones(4, 3)})
    4
    """
    paths, leaves, _ = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    size: int | None = None
    first = ""
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        name = _path_str(path)
        if leaf.dim() == 0:
            raise ValueError(f"tree: leaf {name} is 0-d, expected a leading batch dimension")
        if size is None:
            size, first = leaf.shape[0], name
        elif leaf.shape[0] != size:
            raise ValueError(
                f"tree: leaf {name} has leading dimension {leaf.shape[0]}, expected {size} (that of leaf {first})"
            )
    if size is None:
        raise ValueError("tree: got no tensor leaves, expected at least one")
    return size


def tree_stack(trees: Sequence[PyTree], dim: int = 0) -> PyTree:
    """Stack same-structured trees leaf by leaf along a new dimension ``dim``.

    >>> tree_stack([{"a": torch.tensor(1)}, {"a": torch.tensor(2)}])["a"]
    tensor([1, 2])
    """
    if len(trees) == 0:
        raise ValueError("trees: got an empty sequence, expected at least one tree")
    return optree.tree_map(lambda *xs: torch.stack(xs, dim), *trees, namespace=NAMESPACE)


def tree_cat(trees: Sequence[PyTree], dim: int = 0) -> PyTree:
    """Concatenate same-structured trees leaf by leaf along ``dim``.

    >>> tree_cat([{"a": torch.arange(2)}, {"a": torch.arange(3)}])["a"]
    tensor([0, 1, 0, 1, 2])
    """
    if len(trees) == 0:
        raise ValueError("trees: got an empty sequence, expected at least one tree")
    return optree.tree_map(lambda *xs: torch.cat(xs, dim), *trees, namespace=NAMESPACE)


def tree_split(tree: PyTree, sizes: int | Sequence[int]) -> list[PyTree]:
    """Split every leaf along the batch dimension into pieces of ``sizes``.

    ``sizes`` is a list of piece sizes summing to the batch size, or an int piece size
    (the last piece may be smaller), as in ``torch.split``.

    >>> [t["a"].tolist() for t in tree_split({"a": torch.arange(5)}, [2, 3])]
    [[0, 1], [2, 3, 4]]
    """
    n = batch_size(tree)
    if isinstance(sizes, int):
        if sizes <= 0:
            raise ValueError(f"sizes: got {sizes}, expected a positive piece size")
    else:
        sizes = [int(s) for s in sizes]
        if any(s < 0 for s in sizes) or sum(sizes) != n:
            raise ValueError(f"sizes: got {sizes} (sum {sum(sizes)}), expected non-negative sizes summing to {n}")
    _, leaves, spec = _tensor_leaves_with_path(tree, "tree")
    pieces = [torch.split(leaf, sizes, dim=0) for leaf in leaves]
    return [optree.tree_unflatten(spec, [p[i] for p in pieces]) for i in range(len(pieces[0]))]


def tree_index(tree: PyTree, idx: Any) -> PyTree:
    """Index every leaf's batch dimension with ``idx`` (int, slice, bool mask or index tensor).

    >>> tree_index({"a": torch.arange(5)}, torch.tensor([4, 0]))["a"]
    tensor([4, 0])
    """
    _, leaves, spec = _tensor_leaves_with_path(tree, "tree")
    return optree.tree_unflatten(spec, [leaf[idx] for leaf in leaves])


def tree_to(
    tree: PyTree,
    device: torch.device | str | None = None,
    *,
    dtype: torch.dtype | None = None,
    non_blocking: bool = False,
) -> PyTree:
    """Move tensor leaves to ``device`` (and floating leaves to ``dtype``); other leaves pass through.

    >>> tree_to({"a": torch.zeros(2), "n": 3}, "cpu", dtype=torch.float64)["a"].dtype
    torch.float64
    """

    def move(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        target = dtype if (dtype is not None and x.dtype.is_floating_point) else None
        return x.to(device=device, dtype=target, non_blocking=non_blocking)

    return optree.tree_map(move, tree, namespace=NAMESPACE)


def tree_nbytes(tree: PyTree) -> int:
    """Bytes held by the tensor leaves of ``tree`` (non-tensor leaves count 0).

    >>> tree_nbytes({"a": torch.zeros(4, dtype=torch.float32), "b": torch.zeros(2, dtype=torch.bfloat16)})
    20
    """
    return sum(x.numel() * x.element_size() for x in tree_leaves(tree) if isinstance(x, torch.Tensor))


# --------------------------------------------------------------------------- containers


def static_field(**kwargs: Any) -> Any:
    """A dataclass field that is metadata, not a pytree child (kept in the treespec)."""
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata["static"] = True
    return dataclasses.field(metadata=metadata, **kwargs)


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, static_field))
def dataclass(cls: type[T] | None = None, /, **kwargs: Any) -> Any:
    """Make ``cls`` a frozen dataclass registered with rlcore's optree namespace and torch's pytree.

    Fields made with :func:`static_field` are metadata; all others are children.

    >>> @dataclass
    ... class Pair:
    ...     x: torch.Tensor
    ...     tag: str = static_field(default="p")
    >>> tree_map(lambda t: t + 1, Pair(torch.tensor(1))).x
    tensor(2)
    """

    def wrap(c: type[T]) -> type[T]:
        dc = dataclasses.dataclass(frozen=True, **kwargs)(c)
        _register(dc)
        return dc

    return wrap if cls is None else wrap(cls)


def _register(cls: type) -> None:
    fields = [f for f in dataclasses.fields(cls) if f.init]
    children = tuple(f.name for f in fields if not f.metadata.get("static", False))
    statics = tuple(f.name for f in fields if f.metadata.get("static", False))

    def flatten(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        return tuple(getattr(obj, n) for n in children), tuple(getattr(obj, n) for n in statics), children

    def unflatten(meta: Hashable | None, values: Any) -> Any:
        # optree types metadata as Hashable | None; it is the statics tuple flatten returned.
        return cls(**dict(zip(children, values)), **dict(zip(statics, cast(tuple[Any, ...], meta))))

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)

    def torch_flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
        return [getattr(obj, n) for n in children], tuple(getattr(obj, n) for n in statics)

    def torch_flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
        return (
            [(torch_pytree.GetAttrKey(n), getattr(obj, n)) for n in children],
            tuple(getattr(obj, n) for n in statics),
        )

    def torch_unflatten(values: Any, context: tuple[Any, ...]) -> Any:
        return cls(**dict(zip(children, values)), **dict(zip(statics, context)))

    torch_pytree.register_pytree_node(
        cls,
        torch_flatten,
        torch_unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=torch_flatten_with_keys,
    )
