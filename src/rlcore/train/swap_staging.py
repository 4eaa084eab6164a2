"""A background save's copy of the training state, taken from the host copies the co-located phase switch makes anyway.

When a phase switch moves the training state (the memory plan's AllGather-Swap offloads
the parameters and the optimiser state to host memory for each rollout), a checkpoint
written in the background cannot copy that state beside the next step: the switch frees
the tensors' storage right after the save. Copying it inside the save call instead stalls
training for the time of a copy of the whole state. :class:`SwapStaging` takes neither
path: the save's call records which of its tensors the switch moves and copies nothing;
the switch's offload, which copies every moved tensor into host buckets that nothing
writes afterwards, hands those copies over (:meth:`SwapStaging.offloaded`), and the write
reads them. The tensors the switch does not move (the reference model, buffers, a
critic) are copied by a background thread meanwhile.

Whatever comes first after the save, the state changes only behind a fence: the next
optimiser step (or the end of the run) calls :meth:`SwapStaging.fence`, which copies the
moved tensors from the live state if no offload has served the save yet, and waits for
the background copy. The version written is the state at the save, bit for bit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import torch

from rlcore.memory import SwapHandle, host_copies
from rlcore.pytree import tree_flatten, tree_unflatten

__all__ = ["SwapStaging"]


def _plain(t: torch.Tensor) -> bool:
    # A tensor whose storage is its own (not a wrapper subclass such as DTensor, which keeps it in its local shard).
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


class _Moved:
    """A saved tensor on a storage the switch moves: the moved leaf it views, and where in that leaf's storage."""

    def __init__(self, leaf: torch.Tensor, t: torch.Tensor):
        # The leaf itself, never ``t``: a second tensor on the storage would make the offload refuse it.
        self.leaf = leaf
        self.shape, self.stride = tuple(t.shape), tuple(t.stride())
        self.delta = t.storage_offset() - leaf.storage_offset()

    def view(self, copy: torch.Tensor) -> torch.Tensor:
        """This tensor within ``copy``, the leaf's copy (same storage layout)."""
        return copy.as_strided(self.shape, self.stride, copy.storage_offset() + self.delta)


class _Snapshot:
    """One save's copy: the moved tensors (from the offload or the fence) and the rest (a background thread)."""

    def __init__(self, leaves: list[Any], spec: Any, moved: dict[int, _Moved], rest: dict[int, torch.Tensor]):
        self.leaves, self.spec, self.moved = leaves, spec, moved
        self.future: Future[dict[str, Any]] = Future()
        self.served = threading.Event()  # the moved tensors' copies are in ``leaves`` (or ``error`` says why not)
        self.error: BaseException | None = None
        self.rest_copied = threading.Event()
        self.ready: Any = None  # an accelerator event after the offload's copies, synchronised before the write
        self.thread = threading.Thread(target=self._assemble, args=(rest,), name="rlcore-swap-staging", daemon=True)
        self.thread.start()

    def _assemble(self, rest: dict[int, torch.Tensor]) -> None:
        try:
            try:
                for i, t in rest.items():
                    self.leaves[i] = _copy(t)
                rest.clear()
            finally:
                self.rest_copied.set()
            self.served.wait()
            if self.error is not None:
                raise self.error
            if self.ready is not None:
                self.ready.synchronize()
            self.future.set_result(tree_unflatten(self.spec, self.leaves))
        except BaseException as err:
            self.future.set_exception(err)

    def serve(self, copies: dict[int, torch.Tensor]) -> None:
        """The moved tensors from the offload's host copies (leaf id -> copy)."""
        try:
            for i, m in self.moved.items():
                if id(m.leaf) not in copies:
                    raise ValueError(
                        f"offloaded: a saved tensor of shape {m.shape} is on a storage the offload did not move"
                    )
                self.leaves[i] = m.view(copies[id(m.leaf)])
        except BaseException as err:
            self.error = err
        finally:
            self.moved.clear()
            self.served.set()

    def take_live(self) -> None:
        """The moved tensors copied from the live state (no offload served the save before it changes)."""
        for i, m in self.moved.items():
            self.leaves[i] = _copy(m.view(m.leaf.detach()))
        self.moved.clear()
        self.served.set()


class SwapStaging:
    """The ``staging`` of :func:`rlcore.train.checkpoint.save_checkpoint_async` where a phase switch moves the state.

    Args:
      moved: returns the tensors the phase switch moves (the parameters and the optimiser
        state), called at each save: their storages are the ones served by the offload.

    One save at a time: the previous save must be fenced (or served by an offload) before
    the next one starts. The co-located deployment calls :meth:`offloaded` right after each
    switch to the rollout phase; the trainer calls :meth:`fence` before each optimiser step
    and before it waits for a save.

    >>> import tempfile
    >>> from rlcore.memory import offload, reload
    >>> from rlcore.train.checkpoint import load_checkpoint, save_checkpoint_async
    >>> model = torch.nn.Linear(2, 2)
    >>> staging = SwapStaging(lambda: list(model.parameters()))
    >>> d = tempfile.mkdtemp()
    >>> pending = save_checkpoint_async(d, {"model": model}, step=1, staging=staging)
    >>> handle = offload(dict(model.named_parameters()))  # the switch to the rollout phase
    >>> staging.offloaded([handle])
    >>> _ = reload(handle); _ = model.weight.data.zero_()  # training goes on
    >>> pending.result().name, bool(load_checkpoint(d)["model"]["weight"].any())
    ('step000001', True)
    """

    def __init__(self, moved: Callable[[], Iterable[torch.Tensor]]):
        self._moved = moved
        self._lock = threading.Lock()
        self._open: _Snapshot | None = None  # the save whose moved tensors wait for an offload or the fence
        self._last: _Snapshot | None = None  # the latest save, whose background copy the fence waits for

    def __call__(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]]:
        """Start the copy of ``state_dict`` (the save's tensors, live): its future, done once every tensor is copied.

        Tensors on storages the switch moves wait for the offload or the fence; a moved
        storage viewed in a way the copy cannot serve (a wrapper subclass, another dtype)
        is copied here, in the call; every other tensor by a background thread.
        """
        with self._lock:
            if self._open is not None:
                raise ValueError(
                    "staging: got a save while the previous one is not yet staged, expected fence() (or an offload) "
                    "between two saves"
                )
            moved_leaves = [t for t in self._moved() if isinstance(t, torch.Tensor)]
            storages = {_storage_key(t): t for t in moved_leaves if _plain(t) and t.untyped_storage().nbytes()}
            wrapped = any(not _plain(t) for t in moved_leaves)
            leaves, spec = tree_flatten(state_dict)
            moved: dict[int, _Moved] = {}
            rest: dict[int, torch.Tensor] = {}
            for i, t in enumerate(leaves):
                if not isinstance(t, torch.Tensor):
                    continue
                leaf = storages.get(_storage_key(t)) if _plain(t) and t.untyped_storage().nbytes() else None
                if leaf is not None and leaf.dtype == t.dtype:
                    moved[i] = _Moved(leaf, t)
                    leaves[i] = None  # no second tensor on a moved storage
                elif leaf is not None or (wrapped and not _plain(t)):
                    leaves[i] = _copy(t)  # on a moved storage, but not servable: copied before the switch moves it
                else:
                    rest[i] = t
                    leaves[i] = None
            t = leaf = None  # no reference to a saved tensor outlives the call
            snap = _Snapshot(leaves, spec, moved, rest)
            if not moved:
                snap.take_live()
            else:
                self._open = snap
            self._last = snap
            return snap.future

    def offloaded(self, handles: Iterable[SwapHandle]) -> None:
        """After a switch's offload: the open save (if any) takes its moved tensors from ``handles``' host copies."""
        with self._lock:
            snap, self._open = self._open, None
            if snap is None:
                return
            copies = {id(leaf): copy for h in handles for leaf, copy in host_copies(h)}
            if torch.accelerator.is_available():  # the offload's copies are queued: the write waits for them
                snap.ready = torch.accelerator.current_stream().record_event()
            snap.serve(copies)

    def fence(self) -> None:
        """Before the state changes: the open save's copy is taken from the live state, and the background copy done."""
        with self._lock:
            snap, self._open = self._open, None
            if snap is not None:
                snap.take_live()
            last = self._last
        if last is not None:
            last.rest_copied.wait()
