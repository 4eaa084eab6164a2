"""Memory phases as transforms: run a function with the state placed for its phase, switch co-located stages.

MindSpeed-RL (Feng et al., arXiv:2507.19017) co-locates training and rollout on the
same devices and moves state between them with AllGather-Swap. Two wrappers make that
a transform of the caller's functions, with the same calling convention:

* :func:`in_phase` ``(fn, plan, phase)``: ``fn`` runs with the training state placed as
  the plan says for ``phase`` (``"rollout"``: grads and optimiser state offloaded,
  inference weights gathered bucket by bucket), and placed back for training after.
* :class:`ColocatedSwitch`: the ``switch`` hook of :func:`rlcore.dataflow.run_pipeline`
  for co-located stages: it runs the transition only when the phase changes.
* :class:`EngineSwitch`: the same hook for an engine that holds its own weights and KV
  cache and can release them (vLLM's sleep mode): the plan's order with the engine's
  memory in place of the inference buckets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from rlcore.memory.allgather_swap import AllGatherSwapPlan, RolloutState, TrainState, enter_rollout, enter_train
from rlcore.memory.swap import SwapHandle, offload, reload

__all__ = ["ColocatedSwitch", "EngineSwitch", "in_phase"]

R = TypeVar("R")


class ColocatedSwitch:
    """The ``switch`` hook of a co-located pipeline: AllGather-Swap between training and rollout.

    ``switch(resource, src, dst)`` moving to ``"rollout"`` calls
    :func:`~rlcore.memory.enter_rollout` (training state swapped out, inference weights
    built bucket by bucket); moving to ``"train"`` calls
    :func:`~rlcore.memory.enter_train` (inference weights freed, training state reloaded
    into its own tensors). Rollout stages read :attr:`weights`.

    Args:
      state: the rank's :class:`~rlcore.memory.TrainState`, resident (phase ``"train"``).
      plan: the :class:`~rlcore.memory.AllGatherSwapPlan`.
      on_rollout: optional ``on_rollout(weights)``, called after each switch to
        ``"rollout"`` with the freshly built inference weights (an engine loads them).

    Attributes:
      phase: the current phase.
      transitions: ``(src, dst)`` of every transition run.
    """

    def __init__(
        self,
        state: TrainState,
        plan: AllGatherSwapPlan,
        *,
        on_rollout: Callable[[dict[str, torch.Tensor]], Any] | None = None,
    ) -> None:
        self.state: TrainState | RolloutState = state
        self.plan = plan
        self.on_rollout = on_rollout
        self.phase = "train"
        self.transitions: list[tuple[str, str]] = []

    def __call__(self, resource: str, src: str | None, dst: str) -> None:
        if dst == self.phase:
            return
        if dst == "rollout":
            assert isinstance(self.state, TrainState)
            self.state = enter_rollout(self.state, self.plan)
            if self.on_rollout is not None:
                self.on_rollout(self.state.weights)
        elif dst == "train":
            assert isinstance(self.state, RolloutState)
            self.state = enter_train(self.state, self.plan)
        else:
            raise ValueError(f"switch: got phase {dst!r} on resource {resource!r}, expected 'rollout' or 'train'")
        self.transitions.append((self.phase, dst))
        self.phase = dst

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The inference weights (name -> this rank's shard), in the rollout phase."""
        if self.phase != "rollout":
            raise ValueError(f"weights: the switch is in phase {self.phase!r}, expected 'rollout'")
        assert isinstance(self.state, RolloutState)
        return self.state.weights


class EngineSwitch:
    """The ``switch`` hook of a co-located engine that frees and restores its own memory (vLLM's sleep mode).

    The engine keeps its weights and KV cache in memory it allocates itself, so the
    AllGather-Swap's inference buckets have no part here; the rest of the plan's
    transitions stays, in the same lowest-peak order (every release before any
    allocation):

    * to ``"rollout"``: the training state (params, grads, optimizer state) is offloaded
      to host buckets (:func:`~rlcore.memory.offload`), then ``wake()`` gives the engine
      its memory back;
    * to ``"train"``: ``sleep()`` frees the engine's memory, then the training state is
      reloaded into its own tensors (:func:`~rlcore.memory.reload`), so the optimizer
      and the module carry on unchanged.

    Args:
      state: called at each switch to ``"rollout"`` for the :class:`~rlcore.memory.TrainState`
        to move (an optimizer creates its grads and state lazily: the current tensors).
      wake: restores the engine's memory.
      sleep: frees the engine's memory.
      on_offload: optional, called with the offload's handles after each switch to
        ``"rollout"`` (a background save takes its copy from them).
      awake: whether the engine holds its memory now (an engine is built awake); an
        awake engine is not woken again, an asleep one is not put to sleep again.

    Attributes:
      phase: the current phase; None until the first switch (the training state in place).
      transitions: ``(src, dst)`` of every transition run (``src`` None: the first).
      offloaded_bytes: host bytes the last switch to ``"rollout"`` moved.

    >>> w, log = torch.ones(4), []
    >>> switch = EngineSwitch(lambda: TrainState({"w": w}), wake=lambda: log.append(w.untyped_storage().nbytes()),
    ...                       sleep=lambda: log.append("sleep"))
    >>> switch("device", None, "rollout"); switch("device", "rollout", "train")
    >>> log, w.sum().item(), switch.offloaded_bytes
    ([0, 'sleep'], 4.0, 16)
    """

    def __init__(
        self,
        state: Callable[[], TrainState],
        *,
        wake: Callable[[], Any],
        sleep: Callable[[], Any],
        on_offload: Callable[[list[SwapHandle]], Any] | None = None,
        awake: bool = False,
    ) -> None:
        self.state, self.wake, self.sleep, self.on_offload = state, wake, sleep, on_offload
        self.awake = awake
        self.phase: str | None = None
        self.transitions: list[tuple[str | None, str]] = []
        self.offloaded_bytes = 0
        self._handle: SwapHandle | None = None

    def __call__(self, resource: str, src: str | None, dst: str) -> None:
        if dst not in ("rollout", "train"):
            raise ValueError(f"switch: got phase {dst!r} on resource {resource!r}, expected 'rollout' or 'train'")
        if dst == self.phase:
            return
        if dst == "rollout":
            state = self.state()
            if not isinstance(state, TrainState):
                raise ValueError(f"state: returned {type(state).__name__}, expected a TrainState")
            self._handle = offload((dict(state.params), state.grads, state.optimizer))
            self.offloaded_bytes = self._handle.nbytes
            if not self.awake:
                try:
                    self.wake()
                except BaseException:
                    self._reload()  # the engine stays asleep: training goes on with its state in place
                    raise
                self.awake = True
            if self.on_offload is not None:
                self.on_offload([self._handle])
        else:
            if self.awake:
                self.sleep()
                self.awake = False
            self._reload()
        self.transitions.append((self.phase, dst))
        self.phase = dst

    def _reload(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            reload(handle)


def in_phase(fn: Callable[..., R], plan: AllGatherSwapPlan, phase: str, *, state: TrainState) -> Callable[..., R]:
    """``fn`` wrapped to run with ``state`` placed as ``plan`` says for ``phase``, and restored after.

    AllGather-Swap (arXiv:2507.19017). For ``phase="rollout"`` the wrapped function
    calls :func:`~rlcore.memory.enter_rollout` first and passes the inference weights
    as the keyword ``weights``; :func:`~rlcore.memory.enter_train` runs afterwards, also
    when ``fn`` raises, so the training tensors hold their data again on return.
    ``phase="train"`` is the resident placement: ``fn`` runs unchanged.

    Args:
      fn: the function to wrap; for ``"rollout"`` it takes ``weights=`` (name -> tensor).
      plan: from :func:`~rlcore.memory.allgather_swap_plan`.
      phase: ``"rollout"`` or ``"train"``.
      state: this rank's resident :class:`~rlcore.memory.TrainState`.

    Returns:
      A function with ``fn``'s calling convention (less ``weights``).

    >>> import torch.distributed as dist
    >>> from rlcore.dataflow import decoder_layout, plan_reshard
    >>> from rlcore.memory import allgather_swap_plan
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> w = torch.nn.Parameter(torch.ones(4, 2))
    >>> lay = decoder_layout({"lm_head.weight": w})
    >>> plan = allgather_swap_plan(plan_reshard({"lm_head.weight": w}, lay, lay), mesh=None, device="cpu", rank=0)
    >>> def generate(x, *, weights):
    ...     return w.untyped_storage().nbytes(), (x @ weights["lm_head.weight"].T).sum().item()
    >>> in_phase(generate, plan, "rollout", state=TrainState({"lm_head.weight": w}))(torch.ones(1, 2))
    (0, 8.0)
    >>> w.untyped_storage().nbytes()
    32
    >>> dist.destroy_process_group()
    """
    if phase not in ("rollout", "train"):
        raise ValueError(f"phase: got {phase!r}, expected 'rollout' or 'train'")
    if not isinstance(state, TrainState):
        raise ValueError(f"state: got {type(state).__name__}, expected a resident TrainState")
    if phase == "train":
        return fn

    @functools.wraps(fn)
    def placed(*args: Any, **kwargs: Any) -> R:
        rollout = enter_rollout(state, plan)
        try:
            return fn(*args, weights=rollout.weights, **kwargs)
        finally:
            enter_train(rollout, plan)

    return placed
