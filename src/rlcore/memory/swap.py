"""Host<->device swap of pytrees into contiguous per-dtype host buckets, in place.

:func:`offload` copies every tensor storage of a pytree into one contiguous host
buffer per dtype (pinned when an accelerator is present, so the copies can run
asynchronously) and then shrinks the device storage to zero bytes. The tensor
objects, their shapes, strides and views survive; only their storage is empty.
:func:`reload` grows each storage back and copies the bytes home, so every
reference a caller holds -- an ``nn.Parameter`` in a module, the same tensor keyed
in ``torch.optim`` state -- sees its data again without being rebound. This is the
storage-resize technique FSDP uses to free unsharded parameters.

Tensors that share a storage (tied weights, views) are moved once. On the CPU the
"device" and the host are the same memory, so the path is a plain copy out and
back: correct, and freeing the original storage all the same.

Touching an offloaded tensor raises, never reads freed memory. While offloaded, each
tensor leaf of the tree

* changes class to a guard subclass of its own class (``isinstance`` checks still
  hold) whose ``__torch_function__`` raises ``RuntimeError`` naming the offloaded
  state for anything that reads or writes data -- ``.data``, arithmetic, indexing,
  ``.numpy()``, ``.tolist()``, a module's forward, ``torch.save``, an optimiser
  step -- and answers metadata (shape, dtype, device, strides, ``requires_grad``,
  the now empty ``untyped_storage()``) as before; ``repr`` says it is offloaded;
* points, for the C++ paths that never reach Python (the autograd engine
  accumulating into a ``.grad``, a graph recorded before the offload), at one
  valid element with zero strides: such a write raises torch's internal-overlap
  error and back-propagating an older graph raises autograd's in-place
  modification error (the leaf's version counter moved), instead of touching a
  freed pointer. A one-element tensor has no overlap to detect: a C++-only write
  into it while offloaded is lost at reload.

:func:`reload` restores each leaf's own class, storage and strides, so the hot path
after a reload runs on plain tensors and pays nothing for the guard. A tensor
outside the tree on the same storage (a view or alias the tree does not list) would
read freed memory, so :func:`offload` refuses the tree (``ValueError``, nothing
moved); the one exception is a listed view's own ``._base``, which is not guarded:
offload every tensor you will touch, or none of its views.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Any

import torch

from rlcore.pytree import tree_leaves

__all__ = ["SwapHandle", "host_copies", "offload", "reload"]


@dataclasses.dataclass(eq=False)
class _Entry:
    storage: torch.UntypedStorage
    dtype: torch.dtype
    offset: int
    numel: int


@dataclasses.dataclass(eq=False)
class _Guarded:
    """A leaf while offloaded: its own class, storage and strides, restored by :func:`reload`."""

    tensor: torch.Tensor
    cls: type
    storage: torch.UntypedStorage
    offset: int
    stride: tuple[int, ...]
    twin: torch.Tensor  # a meta tensor with the leaf's metadata, answering stride / contiguity queries


# Calls that read only metadata: answered on an offloaded tensor as on any other.
_METADATA: tuple[Any, ...] = (
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.element_size,
    torch.Tensor.get_device,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.is_inference,
    torch.Tensor.__len__,
    torch.Tensor.__hash__,
    torch.Tensor.requires_grad_,
    *(
        getattr(torch.Tensor, name).__get__
        for name in (
            "shape",
            "dtype",
            "device",
            "ndim",
            "layout",
            "requires_grad",
            "is_leaf",
            "grad",
            "grad_fn",
            "is_cuda",
            "is_cpu",
            "is_meta",
            "is_sparse",
            "is_quantized",
            "is_nested",
            "_version",
            "_base",
        )
    ),
    *(getattr(torch.Tensor, name).__set__ for name in ("requires_grad", "grad")),
)
# Metadata the leaf's poisoned placement would misreport: answered from the recorded layout.
_LAYOUT: tuple[Any, ...] = (torch.Tensor.stride, torch.Tensor.storage_offset, torch.Tensor.is_contiguous)
_GUARD_CLASSES: dict[type, type] = {}
_POISON: dict[tuple[torch.dtype, str], torch.UntypedStorage] = {}


def _func_name(func: Any) -> str:
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__"):  # a property of the tensor: name the property
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _offloaded_torch_function(
    cls: type, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
) -> Any:
    kwargs = kwargs or {}
    me: Any = args[0] if args else None
    record = getattr(me, "_rlcore_offloaded", None)
    with torch._C.DisableTorchFunctionSubclass():
        if func in _METADATA:
            return func(*args, **kwargs)
        if record is not None and func in _LAYOUT:
            return func(record.twin, *args[1:], **kwargs)
        if record is not None and func == torch.Tensor.untyped_storage:
            return record.storage
        if record is not None and func == torch.Tensor.__repr__:
            return (
                f"tensor(<offloaded by rlcore.memory.offload: shape {tuple(record.twin.shape)}, "
                f"{record.twin.dtype}, {me.device}; rlcore.memory.reload(handle) brings it back>)"
            )
    guarded = [a for a in (*args, *kwargs.values()) if hasattr(a, "_rlcore_offloaded")]
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            guarded += [t for t in a if hasattr(t, "_rlcore_offloaded")]
    what = guarded[0]._rlcore_offloaded.twin if guarded else None
    desc = f"a tensor of shape {tuple(what.shape)} {what.dtype}" if what is not None else "a tensor"
    raise RuntimeError(
        f"{_func_name(func)}: {desc} is offloaded (rlcore.memory.offload freed its storage); "
        "call rlcore.memory.reload(handle) before using it"
    )


def _guard_class(cls: type) -> type:
    """The guard subclass of ``cls``: same layout (no new slots), so ``__class__`` can switch both ways."""
    guard = _GUARD_CLASSES.get(cls)
    if guard is None:
        guard = type(
            f"Offloaded{cls.__name__}",
            (cls,),
            {
                "__slots__": (),
                "__module__": __name__,
                "__torch_function__": classmethod(_offloaded_torch_function),
                "__doc__": f"A {cls.__name__} offloaded by rlcore.memory.offload: touching its data raises.",
            },
        )
        _GUARD_CLASSES[cls] = guard
    return guard


def _poison(dtype: torch.dtype, device: torch.device) -> torch.UntypedStorage:
    # One valid element per dtype and device that every offloaded leaf points at with zero strides.
    key = (dtype, str(device))
    if key not in _POISON:
        _POISON[key] = torch.zeros(1, dtype=dtype, device=device).untyped_storage()
    return _POISON[key]


def _plain_dispatch(leaf: torch.Tensor) -> bool:
    # Subclasses that re-dispatch (DTensor, FakeTensor) are guarded but keep their own storage handling.
    return type(leaf).__torch_dispatch__ is torch.Tensor.__torch_dispatch__  # type: ignore[comparison-overlap]


def _place(leaf: torch.Tensor, storage: torch.UntypedStorage, offset: int, stride: tuple[int, ...]) -> None:
    if leaf.is_inference():  # an inference tensor changes in place only in inference mode
        with torch.inference_mode():
            leaf.set_(storage, offset, leaf.shape, stride)
        return
    with torch.no_grad():
        leaf.set_(storage, offset, leaf.shape, stride)


def _guard(leaf: torch.Tensor, storage: torch.UntypedStorage) -> _Guarded:
    twin = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device="meta")
    record = _Guarded(leaf, type(leaf), storage, int(leaf.storage_offset()), tuple(leaf.stride()), twin)
    if _plain_dispatch(leaf):
        _place(leaf, _poison(leaf.dtype, leaf.device), 0, (0,) * leaf.dim())
    leaf.__dict__["_rlcore_offloaded"] = record
    leaf.__class__ = _guard_class(record.cls)
    return record


def _unguard(record: _Guarded) -> None:
    leaf = record.tensor
    leaf.__class__ = record.cls
    del leaf.__dict__["_rlcore_offloaded"]
    if _plain_dispatch(leaf):
        _place(leaf, record.storage, record.offset, record.stride)


@dataclasses.dataclass(eq=False, repr=False)
class SwapHandle:
    """What :func:`offload` returns: the tree, its host buckets and where each storage went.

    ``buckets`` maps each dtype to one contiguous host tensor; ``nbytes`` is the
    device memory the offload released. A handle is reloaded once.
    """

    tree: Any
    buckets: dict[torch.dtype, torch.Tensor]
    entries: list[_Entry]
    nbytes: int
    reloaded: bool = False
    guarded: list[_Guarded] = dataclasses.field(default_factory=list)

    def __repr__(self) -> str:
        # Never print the tree: reading an offloaded tensor touches an empty storage.
        sizes = ", ".join(f"{dt}: {b.numel()}" for dt, b in self.buckets.items())
        return f"SwapHandle(nbytes={self.nbytes}, buckets={{{sizes}}}, reloaded={self.reloaded})"


def _flat_view(storage: torch.UntypedStorage, dtype: torch.dtype, numel: int) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, (numel,), (1,))


def _pin() -> bool:
    return torch.accelerator.is_available()


# How long offload waits for holds that end by themselves before it refuses a storage.
_SETTLE_SECONDS = 2.0


def _held_outside(
    storages: dict[tuple[str, int], tuple[torch.UntypedStorage, torch.dtype]], kept: dict[tuple[str, int], int]
) -> tuple[torch.UntypedStorage, int] | None:
    """The first storage that a tensor outside the tree still holds, and how many; None when there is none.

    Two kinds of hold end by themselves and are no reader: unreachable garbage (a
    reference cycle, e.g. of a collective's temporaries), collected here; and a
    collective's input or output that a backend thread (gloo's worker, NCCL's watchdog)
    drops a moment after the call returned. Those get up to two seconds.
    """

    def first() -> tuple[torch.UntypedStorage, int] | None:
        for key, (st, _) in storages.items():
            count = torch._C._storage_Use_Count(st._cdata) - 1 - kept[key]  # - 1: our own handle on it
            if count > 0:
                return st, count
        return None

    held = first()
    if held is None:
        return None
    gc.collect()
    deadline, pause = time.monotonic() + _SETTLE_SECONDS, 1e-4
    while (held := first()) is not None and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    return held


def offload(tree: Any, *, non_blocking: bool = True) -> SwapHandle:
    """Copy the tensors of ``tree`` into per-dtype host buckets and free their storage.

    Every tensor leaf keeps its identity, shape and strides; its storage shrinks to
    zero bytes until :func:`reload`. A storage that a tensor outside the tree also
    views (other than a listed view's base) is refused with ``ValueError``, before
    anything moves. Touching its data in between raises
    ``RuntimeError`` naming the offloaded state (module docstring), and printing it
    says it is offloaded. Storages shared by several leaves move once.
    On an accelerator the device-to-host copies are queued ``non_blocking`` into
    pinned buckets; freeing the device blocks right after is safe because the
    caching allocator hands them out again only in stream order, and
    :func:`reload`'s copies queue behind the offload's on the same stream.

    Args:
      tree: a pytree whose tensor leaves are to be swapped out (non-tensor leaves
        are ignored). Leaves may live on any device, including the CPU.
      non_blocking: queue the copies asynchronously where the device allows it.

    Returns:
      A :class:`SwapHandle` for :func:`reload`.

    >>> w = torch.arange(4.0)
    >>> h = offload({"w": w})
    >>> w.untyped_storage().nbytes(), h.nbytes
    (0, 16)
    >>> _ = reload(h); w
    tensor([0., 1., 2., 3.])
    """
    storages: dict[tuple[str, int], tuple[torch.UntypedStorage, torch.dtype]] = {}
    leaves: dict[int, tuple[torch.Tensor, tuple[str, int]]] = {}
    for i, leaf in enumerate(tree_leaves(tree)):
        if not isinstance(leaf, torch.Tensor):
            continue
        if leaf.layout != torch.strided or leaf.is_quantized or leaf.is_nested:
            kind = "quantized" if leaf.is_quantized else "nested" if leaf.is_nested else str(leaf.layout)
            raise ValueError(f"tree: leaf {i} is a {kind} tensor, expected dense strided tensors only")
        if hasattr(leaf, "_rlcore_offloaded"):
            raise ValueError(
                f"tree: leaf {i} (shape {tuple(leaf.shape)}) has an empty storage (offloaded already), "
                "expected a tensor that is not offloaded already"
            )
        st = leaf.untyped_storage()
        if st.nbytes() == 0:
            if leaf.numel() > 0:
                raise ValueError(
                    f"tree: leaf {i} (shape {tuple(leaf.shape)}) has an empty storage, "
                    "expected a tensor that is not offloaded already"
                )
            continue
        if not st.resizable():
            raise ValueError(
                f"tree: leaf {i} has a storage that cannot be resized (e.g. from numpy), "
                "expected a torch-allocated tensor"
            )
        key = (str(st.device), st.data_ptr())
        if key in storages and storages[key][1] != leaf.dtype:
            raise ValueError(
                f"tree: leaf {i} views a storage also viewed as {storages[key][1]}, expected one dtype per storage"
            )
        storages.setdefault(key, (st, leaf.dtype))
        leaves.setdefault(id(leaf), (leaf, key))
    sizes: dict[torch.dtype, int] = {}
    entries: list[_Entry] = []
    for st, dtype in storages.values():
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if st.nbytes() % itemsize:
            raise ValueError(f"tree: a storage of {st.nbytes()} bytes is not a whole number of {dtype} elements")
        numel = st.nbytes() // itemsize
        entries.append(_Entry(st, dtype, sizes.get(dtype, 0), numel))
        sizes[dtype] = sizes.get(dtype, 0) + numel
    buckets = {dt: torch.empty(n, dtype=dt, pin_memory=_pin()) for dt, n in sizes.items()}
    for e in entries:
        host = buckets[e.dtype][e.offset : e.offset + e.numel]
        host.copy_(_flat_view(e.storage, e.dtype, e.numel), non_blocking=non_blocking)
    nbytes = sum(e.storage.nbytes() for e in entries)
    # Guard every leaf before any storage shrinks: no moment where a leaf points at freed memory.
    guarded: list[_Guarded] = []
    try:
        for leaf, key in leaves.values():
            guarded.append(_guard(leaf, storages[key][0]))
    except BaseException:
        for record in reversed(guarded):  # all or nothing: the tree is left as it was
            _unguard(record)
        raise
    # Every tree leaf now points elsewhere: a tensor still on a storage, other than a listed
    # view's base, is outside the tree (a view or alias it does not list). Reading it after the
    # resize would read freed memory (a segfault on the CPU), so the offload is refused.
    kept = {key: sum(1 for leaf, k in leaves.values() if k == key and not _plain_dispatch(leaf)) for key in storages}
    bases = {
        id(leaf._base): k for leaf, k in leaves.values() if leaf._base is not None and id(leaf._base) not in leaves
    }
    for k in bases.values():  # the documented exception: a listed view's own base stays unguarded
        kept[k] += 1
    outside = _held_outside(storages, kept)
    if outside:
        for record in reversed(guarded):
            _unguard(record)
        st, count = outside
        raise ValueError(
            f"tree: a storage of {st.nbytes()} bytes is also held by {count} tensor(s) outside the tree "
            "(a view or alias it does not list), expected every tensor on it in the tree: "
            "reading one after the offload would read freed memory"
        )
    for e in entries:
        e.storage.resize_(0)
    return SwapHandle(tree=tree, buckets=buckets, entries=entries, nbytes=nbytes, guarded=guarded)


def reload(handle: SwapHandle, *, non_blocking: bool = True) -> Any:
    """Bring an offloaded tree back into the same tensor objects and return the tree.

    Args:
      handle: what :func:`offload` returned; each handle is reloaded once.
      non_blocking: queue the host-to-device copies asynchronously (pinned buckets).

    Returns:
      ``handle.tree``, whose tensors hold their data again.

    >>> t = torch.ones(2, dtype=torch.bfloat16)
    >>> reload(offload([t]))[0] is t
    True
    """
    if not isinstance(handle, SwapHandle):
        raise ValueError(f"handle: got {type(handle).__name__}, expected a SwapHandle from offload")
    if handle.reloaded:
        raise ValueError("handle: got a handle that was reloaded already, expected one offloaded and not yet reloaded")
    for e in handle.entries:
        if e.storage.nbytes() != 0:
            raise ValueError("handle: a storage was regrown since the offload, expected it still empty")
    for e in handle.entries:
        itemsize = handle.buckets[e.dtype].element_size()
        e.storage.resize_(e.numel * itemsize)
        host = handle.buckets[e.dtype][e.offset : e.offset + e.numel]
        _flat_view(e.storage, e.dtype, e.numel).copy_(host, non_blocking=non_blocking)
    for record in handle.guarded:
        _unguard(record)
    handle.reloaded = True
    return handle.tree


def host_copies(handle: SwapHandle) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each offloaded tensor leaf of ``handle``'s tree with its host copy: views into the host buckets, no copy made.

    A copy has the leaf's shape, strides and dtype and holds the leaf's data as it was
    offloaded. Nothing writes the buckets after the offload (:func:`reload` only reads
    them, the next offload fills buckets of its own), so a copy kept after the reload is
    a snapshot of the tree at the offload, e.g. for a checkpoint written in the background
    while training changes the tree. On an accelerator the offload's copies are queued on
    the current stream: synchronise it (or an event recorded after the offload) before
    reading them. Each leaf comes once (a tensor listed twice, tied weights); views of one
    storage are views of one host range.

    Args:
      handle: what :func:`offload` returned, before or after its reload.

    Returns:
      ``(leaf, copy)`` per distinct leaf, in the tree's order.

    >>> w = torch.arange(4.0)
    >>> h = offload({"w": w})
    >>> (leaf, copy), = host_copies(h)
    >>> _ = reload(h); _ = w.zero_()
    >>> leaf is w, copy
    (True, tensor([0., 1., 2., 3.]))
    """
    if not isinstance(handle, SwapHandle):
        raise ValueError(f"handle: got {type(handle).__name__}, expected a SwapHandle from offload")
    where = {id(e.storage): e for e in handle.entries}
    out = []
    for record in handle.guarded:
        e = where[id(record.storage)]
        bucket = handle.buckets[e.dtype]
        out.append((record.tensor, bucket.as_strided(record.twin.shape, record.stride, e.offset + record.offset)))
    return out
