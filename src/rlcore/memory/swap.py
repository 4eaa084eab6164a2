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
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rlcore.pytree import tree_leaves

__all__ = ["SwapHandle", "offload", "reload"]


@dataclasses.dataclass(eq=False)
class _Entry:
    storage: torch.UntypedStorage
    dtype: torch.dtype
    offset: int
    numel: int


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

    def __repr__(self) -> str:
        # Never print the tree: reading an offloaded tensor touches an empty storage.
        sizes = ", ".join(f"{dt}: {b.numel()}" for dt, b in self.buckets.items())
        return f"SwapHandle(nbytes={self.nbytes}, buckets={{{sizes}}}, reloaded={self.reloaded})"


def _flat_view(storage: torch.UntypedStorage, dtype: torch.dtype, numel: int) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, (numel,), (1,))


def _pin() -> bool:
    return torch.accelerator.is_available()


def offload(tree: Any, *, non_blocking: bool = True) -> SwapHandle:
    """Copy the tensors of ``tree`` into per-dtype host buckets and free their storage.

    Every tensor leaf keeps its identity, shape and strides; its storage shrinks to
    zero bytes until :func:`reload`, so reading it in between (printing included) is
    an error of the caller's, as with FSDP's freed parameters. Storages shared by several leaves move once.
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
    for i, leaf in enumerate(tree_leaves(tree)):
        if not isinstance(leaf, torch.Tensor):
            continue
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
    for e in entries:
        e.storage.resize_(0)
    return SwapHandle(tree=tree, buckets=buckets, entries=entries, nbytes=nbytes)


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
    handle.reloaded = True
    return handle.tree
