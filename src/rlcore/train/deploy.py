"""Where the rollout runs and how weights reach it: the trainer's ``Deployment`` seam, one class per mode.

A deployment gives the pipeline its rollout stage, the phase-switch hook and the weight
sync after each update, and logs what the sync cost (``sync_s``, ``sync_bytes``; the
co-located swap's predicted peaks, the measured peak). :func:`make_deployment` picks
the class from the config, in this order:

* :class:`NoRollout`: offline DPO on a preference dataset; nothing to place or sync.
* :class:`ReplicaDeployment` with a user's :class:`~rlcore.train.InferenceEngine`.
* :class:`WorkerDeployment` (``deploy.mode: disaggregated``): the rollout in a
  :class:`rlcore.dataflow.RolloutWorker` process; :class:`RayDeployment` with
  ``deploy.backend: ray``: in a :class:`rlcore.dataflow.RayRolloutWorker` actor. The
  worker's engine (:class:`RolloutServer`) is ``deploy.engine``'s: torch or vLLM.
* :class:`VLLMDeployment` (``deploy.engine: vllm``, co-located): vLLM in the trainer's process.
* :class:`SnapshotDeployment` with ``deploy.async_infer`` when the policy is sharded: the
  rollout on a snapshot of the replica, on its own thread, loading the version its rows record.
* :class:`ReplicaDeployment` of the trainer's unsharded replica, when the policy is
  sharded or LoRA (the replica takes the merged weights).
* :class:`ColocatedDeployment`: one process, one device, the memory plan's
  AllGather-Swap at every switch to the rollout phase.

The rollout never runs on the sharded training module (ranks would run different
numbers of forwards in its collectives): every sync sends
:func:`rlcore.train.parallel.full_state_dict` of the policy through one
:class:`rlcore.dataflow.WeightSync` (collective: every rank publishes).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from rlcore.dataflow import (
    LatestWeights,
    RayRolloutWorker,
    RolloutWorker,
    Stage,
    WeightPacket,
    WeightSync,
    decoder_layout,
    load_into,
    param_meta,
    plan_reshard,
    unpack_weights,
)
from rlcore.device import memory_stats
from rlcore.memory import ColocatedSwitch, EngineSwitch, RolloutState, TrainState, allgather_swap_plan
from rlcore.models import is_lora
from rlcore.pytree import tree_leaves
from rlcore.seeding import Purpose, RowStream
from rlcore.train.agent_stages import ROLLOUT_COLUMNS as AGENT_COLUMNS
from rlcore.train.agent_stages import ROLLOUT_INPUTS as AGENT_INPUTS
from rlcore.train.agent_stages import MultiTurnRollout, multi_turn_rollout_stage
from rlcore.train.carry import ContinuousRollout
from rlcore.train.config import Config, parse_config
from rlcore.train.parallel import full_state_dict
from rlcore.train.prompts import make_prompt_source, source_tokenizer, task_options
from rlcore.train.rollout import InferenceEngine, TorchEngine
from rlcore.train.stages import ROLLOUT_OUTPUTS, rollout_columns, rollout_stage
from rlcore.train.swap_staging import SwapStaging
from rlcore.train.vllm_engine import VLLMEngine, parse_vllm_options, sleep_mode_available

__all__ = [
    "ColocatedDeployment",
    "Deployment",
    "NoRollout",
    "PendingVersions",
    "RayDeployment",
    "ReplicaDeployment",
    "RolloutServer",
    "SnapshotDeployment",
    "VLLMDeployment",
    "WorkerDeployment",
    "in_place_rollout",
    "make_deployment",
]

Batch = dict[str, torch.Tensor]
# The scheduler's phase-switch hook: (resource, phase left or None, phase entered).
Switch = Callable[[str, str | None, str], None]
# (config, vocabulary size) -> a model of the config: the worker builds its own copy of the policy.
ModelBuilder = Callable[[Config, int], torch.nn.Module]


@runtime_checkable
class Deployment(Protocol):
    """Where the rollout runs and how the weights reach it, as the trainer's pipeline uses it.

    Attributes:
      rollout: the pipeline's rollout stage (``prompts, prompt_mask, iteration ->
        responses, mask, version``), or None without rollouts.
      switch: the scheduler's phase-switch hook, or None when no phase switch moves memory.
      staging: where a background save takes its copy of the state that ``switch`` moves
        (:class:`rlcore.train.swap_staging.SwapStaging`: the switch's own host copies), or None.
    """

    @property
    def rollout(self) -> Stage | None: ...

    @property
    def switch(self) -> Switch | None: ...

    @property
    def staging(self) -> SwapStaging | None: ...

    def publish(self, version: int) -> None:
        """Send the policy's weights as ``version`` (after each update: collective when sharded)."""

    def rollout_metrics(self, step: int) -> dict[str, torch.Tensor]:
        """The rollout's own sums of ``step`` (multi-turn: tool calls, turns), to be reduced over ranks."""

    def step_metrics(self) -> dict[str, float]:
        """The last sync's seconds and bytes and the memory figures, for the step's record."""

    def close(self) -> None:
        """Stop what the deployment started (a worker process or actor)."""


class _Models(Protocol):
    @property
    def policy(self) -> torch.nn.Module: ...


class _Optimisers(Protocol):
    @property
    def opts(self) -> Sequence[torch.optim.Optimizer]: ...


class _World(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def sharded(self) -> bool: ...


def in_place_rollout(cfg: Config, device: torch.device) -> bool:
    """Whether a one-process co-located run samples from the training weights in place, without the swap.

    The AllGather-Swap frees device memory for the rollout by offloading the training
    state to the host and building the engine's weights in buckets. When the device *is*
    the host (the CPU), offloading moves bytes from RAM to RAM and frees nothing: the
    engine then reads the policy's own parameters (shared storage), which is exact in
    the blocking pipeline, where a rollout never overlaps an update. With
    ``deploy.async_infer`` the swap's snapshot keeps each rollout on one weights version.
    """
    return device.type == "cpu" and not cfg.deploy.async_infer


def _sampling(cfg: Config, tok: Any) -> dict[str, Any]:
    """The rollout's sampling settings from ``rl`` and the tokenizer's special tokens (a sampler's keyword arguments)."""
    rl = cfg.rl
    return {
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "max_new_tokens": rl.max_new_tokens,
        "temperature": rl.temperature,
        "top_p": rl.top_p,
        "top_k": rl.top_k,
    }


def _torch_engine(cfg: Config, model: torch.nn.Module, tok: Any) -> TorchEngine:
    return TorchEngine(model, **_sampling(cfg, tok))


def _loader(engine: InferenceEngine) -> Callable[[WeightPacket], None]:
    """The sync's receiver for a user's engine: each packet's weights, by name, into ``load_weights``."""

    def receive(packet: WeightPacket) -> None:
        engine.load_weights(unpack_weights(packet))

    return receive


def _vllm_engine(cfg: Config, model: torch.nn.Module, tok: Any, *, sleep_mode: bool = False) -> VLLMEngine:
    """A :class:`~rlcore.train.VLLMEngine` of ``model``'s architecture (its weights loaded; later ones come by sync)."""
    rl = cfg.rl
    return VLLMEngine.from_module(
        model,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=rl.max_new_tokens,
        temperature=rl.temperature,
        top_p=rl.top_p,
        top_k=rl.top_k,
        options=parse_vllm_options(cfg.deploy.vllm),
        seed=cfg.trainer.seed,
        sleep_mode=sleep_mode,
    )


class RolloutServer:
    """The rollout worker's ``generate``: an engine of ``deploy.engine`` on a model of the config, fed each version.

    Built in the worker process (:class:`rlcore.dataflow.RolloutWorker` or
    :class:`rlcore.dataflow.RayRolloutWorker` call it with ``args``). With the torch engine
    each new version's weights are copied into the worker's model; with vLLM they stream
    into the engine's in-place reload (:meth:`VLLMEngine.load_weights
    <rlcore.train.VLLMEngine.load_weights>`), bucket by bucket, as co-located. With vLLM and
    ``rl.multi_turn`` the worker runs the agent rollout (its environments beside the
    engine) and returns the step's trajectory metrics with the rows (one extra key).

    Args:
      cfg_dict: the run's config (:meth:`Config.to_dict`).
      vocab_size: the task tokenizer's vocabulary.
      build_model: ``(config, vocab_size) -> model`` (picklable).

    ``deploy.partial_rollouts``: a version published while the engine generates is
    loaded between two tokens (the torch engine: two decode steps; vLLM: two engine
    steps, its unfinished requests aborted and resubmitted from their token ids) and each
    token records the version that sampled it. With ``deploy.carry_over`` the torch
    engine's rows stay in flight across calls
    (:class:`rlcore.train.carry.ContinuousRollout`): each call returns finished groups.

    Attributes:
      engine: the worker's :class:`~rlcore.train.InferenceEngine`.
      carry: the rows in flight with ``deploy.carry_over``, else None.
    """

    # The rows-in-flight class of deploy.carry_over (a benchmark may model a tail with a subclass).
    continuous: type[ContinuousRollout] = ContinuousRollout

    def __init__(self, cfg_dict: dict[str, Any], vocab_size: int, build_model: ModelBuilder):
        cfg = parse_config(cfg_dict)
        self.seed = cfg.trainer.seed
        model = build_model(cfg, vocab_size).eval()
        tok = source_tokenizer(cfg, task_options(cfg))
        self.engine: InferenceEngine
        self.agent: MultiTurnRollout | None = None
        if cfg.deploy.engine == "vllm":
            vllm_engine = _vllm_engine(cfg, model, tok)
            self.engine = vllm_engine
            self._load: Callable[[dict[str, torch.Tensor]], None] = vllm_engine.load_weights
            if cfg.rl.multi_turn is not None:  # the environments run here, beside the engine
                self.agent = multi_turn_rollout_stage(cfg, vllm_engine, make_prompt_source(cfg, task_options(cfg)))
        else:
            self.engine = _torch_engine(cfg, model, tok)
            self._load = partial(_copy_into, dict(model.named_parameters()))
        self.carry: ContinuousRollout | None = None
        if cfg.deploy.carry_over:
            self.carry = self.continuous(model, seed=self.seed, **_sampling(cfg, tok))
        self._loaded: Any = None

    def __call__(self, batch: Batch, weights: dict[str, torch.Tensor], latest: LatestWeights | None = None) -> Batch:
        # The row-keyed streams of rlcore.seeding: the same responses as any in-process rollout.
        stream = RowStream(self.seed, Purpose.SAMPLING, int(batch["iteration"][0]), batch["row"])
        if latest is None:
            self._take(weights)
            if self.agent is not None:  # trajectories, and their step's metrics under _AGENT_METRICS
                out = dict(self.agent.stage.fn(batch))
                return {**out, _AGENT_METRICS: self.agent.pop_metrics(int(batch["iteration"][0]))}
            r = self.engine.generate(batch["prompts"], batch["prompt_mask"], n=1, generator=stream)
            return rollout_columns(r, batch)

        # deploy.partial_rollouts: start on the newest weights, and take each newer version between two tokens.
        def refresh() -> int | None:
            if not latest():
                return None
            self._take(latest.params)
            return latest.version

        refresh()
        self._take(latest.params)
        if self.carry is not None:  # deploy.carry_over: the rows in flight, and finished groups back
            return self.carry(batch, refresh, latest.version)
        # Both engines stop at a token boundary and continue from the token ids (vLLM: abort, resubmit).
        assert isinstance(self.engine, (TorchEngine, VLLMEngine))
        r = self.engine.generate(
            batch["prompts"], batch["prompt_mask"], n=1, generator=stream, refresh=refresh, version=latest.version
        )
        return rollout_columns(r, batch)

    def _take(self, weights: Any) -> None:
        if self._loaded is not weights:
            self._load(weights)
            self._loaded = weights


# The key of a multi-turn worker's result that carries its step's trajectory metrics (not a dock column).
_AGENT_METRICS = "agent_metrics"


@torch.no_grad()
def _copy_into(params: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    for name, p in params.items():
        p.copy_(weights[name])


class NoRollout:
    """The deployment of a run without rollouts (offline DPO on a preference dataset): nothing to place or sync."""

    switch = None
    staging = None
    rollout = None

    def publish(self, version: int) -> None:
        pass

    def rollout_metrics(self, step: int) -> dict[str, torch.Tensor]:
        return {}

    def step_metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class _Placed:
    """What every deployment with a rollout shares: the log of weight syncs and the step's memory figures."""

    switch: Switch | None = None
    staging: SwapStaging | None = None

    def __init__(self, device: torch.device):
        self.device = device
        self.syncs: list[tuple[float, int]] = []
        self.memory: dict[str, float] = {}

    def _record_sync(self, seconds: float, nbytes: int) -> None:
        self.syncs.append((seconds, nbytes))

    def rollout_metrics(self, step: int) -> dict[str, torch.Tensor]:
        return {}

    def step_metrics(self) -> dict[str, float]:
        out = dict(self.memory)
        if self.syncs:
            seconds, nbytes = self.syncs[-1]
            out.update({"sync_s": seconds, "sync_bytes": float(nbytes)})
        stats = memory_stats(self.device)
        if stats.tracked and stats.peak_allocated is not None:
            out["memory/measured_peak_bytes"] = float(stats.peak_allocated)
        return out

    def close(self) -> None:
        pass


class _Synced(_Placed):
    """A rollout fed through one :class:`rlcore.dataflow.WeightSync` of the policy's full weights."""

    sync: WeightSync

    def __init__(self, policy: torch.nn.Module, replica: torch.nn.Module):
        super().__init__(next(replica.parameters()).device)
        self.policy = policy
        self.names = [name for name, _ in replica.named_parameters()]

    def _full_weights(self) -> dict[str, torch.Tensor]:
        weights = full_state_dict(self.policy)  # LoRA: the merged weights, under the base names
        return {name: weights[name] for name in self.names}

    def _send(self, version: int, receiver: Callable[[WeightPacket], Any]) -> None:
        self.sync.params = self._full_weights()  # gathered anew after each update (collective when sharded)
        record = self.sync.sync(version, receiver)
        self.sync.params = {}  # no view of the weights held between publishes: a phase switch may move their storage
        self._record_sync(record.seconds, record.nbytes)


class ReplicaDeployment(_Synced):
    """An engine in this process that receives the weights after every update through the sync path.

    Either a user's engine (``receiver`` calls its ``load_weights``) or a
    :class:`~rlcore.train.TorchEngine` on the trainer's unsharded replica of a sharded or
    LoRA policy (``receiver`` is :func:`rlcore.dataflow.load_into` of the replica).
    Version 0 is published at construction.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        replica: torch.nn.Module,
        engine: InferenceEngine,
        receiver: Callable[[WeightPacket], Any],
        *,
        seed: int,
        timeout: float | None,
    ):
        super().__init__(policy, replica)
        self.receiver = receiver
        self.sync = WeightSync(self._full_weights())
        self.publish(0)
        self.rollout: Stage = rollout_stage(engine, seed=seed, timeout=timeout)

    def publish(self, version: int) -> None:
        self._send(version, self.receiver)


class SnapshotDeployment(_Synced):
    """Co-located ``deploy.async_infer`` over data-parallel ranks: each rank samples on its own snapshot of the policy.

    The policy is sharded (FSDP2) or tensor parallel, so no rollout may run its forwards
    (the ranks' collectives would interleave differently). Each rank keeps a second
    unsharded copy of the replica, the snapshot, that only the rollout touches, on a
    resource and thread of its own (``"rollout"``), overlapping the update. :meth:`publish`
    (the update's thread, where every collective runs: the full weights gathered once)
    loads the trainer's replica, which validation and the export read, and keeps the
    version's packet (:class:`PendingVersions`); each rollout call first loads into the
    snapshot the version the scheduler stamped its rows with, so every row is sampled by
    exactly the version it records and ``deploy.staleness`` bounds its lag.
    """

    def __init__(self, cfg: Config, policy: torch.nn.Module, replica: torch.nn.Module, task: Any):
        super().__init__(policy, replica)
        self.snapshot = copy.deepcopy(replica)
        self.pending = PendingVersions(load_into(self.snapshot), copy=True)
        self.receiver = load_into(replica)
        self.sync = WeightSync(self._full_weights())
        self.publish(0)
        timeout = cfg.deploy.rollout_timeout or None
        sample = rollout_stage(
            _torch_engine(cfg, self.snapshot, task.tokenizer), seed=cfg.trainer.seed, timeout=timeout
        )
        self.rollout: Stage = dataclasses.replace(
            sample, fn=partial(_at_version, sample.fn, self.pending), resource="rollout"
        )

    def publish(self, version: int) -> None:
        self._send(version, self._receive)

    def _receive(self, packet: WeightPacket) -> None:
        self.receiver(packet)
        self.pending(packet)


class VLLMDeployment(_Synced):
    """``deploy.engine: vllm``: a :class:`~rlcore.train.VLLMEngine` in the trainer's process, fed through the one sync.

    The engine is built from the replica's config alone (no weights on disk); version 0 and
    every later version of the policy's weights stream through one
    :class:`rlcore.dataflow.WeightSync` into the engine's in-place reload, bucket by bucket
    (``sync_s``, ``sync_bytes``). With ``rl.multi_turn`` the agent rollout
    (:func:`rlcore.agent.multi_turn_rollout`) samples its turns on the engine
    (:meth:`VLLMEngine.sample_turn <rlcore.train.VLLMEngine.sample_turn>`).

    With ``deploy.async_infer`` the rollout runs on a resource of its own (``"rollout"``),
    so the scheduler overlaps the next iterations' rollouts with the update, on their own
    thread. The engine is then touched by that thread alone: :meth:`publish` keeps a copy
    of each version's packet (:class:`PendingVersions`, ``sync_s`` is the copy's time) and
    each rollout call loads, before it samples, the version the scheduler stamped its rows
    with (``policy_version``), so every row is sampled by exactly the version it records
    and ``deploy.staleness`` bounds its lag as with any rollout.

    vLLM's sleep mode (``deploy.vllm.sleep_level``, on a platform that has one: CUDA,
    ROCm, XPU): the deployment's :attr:`switch`, the scheduler's phase-switch hook, is the
    memory plan's :class:`rlcore.memory.EngineSwitch`. Entering ``"rollout"`` it offloads
    the policy's parameters, gradients and ``optimiser`` state to host memory, then
    wakes the engine; entering ``"train"`` the engine sleeps, then the training state comes
    back into its own tensors. A background save takes its copy from that offload
    (:attr:`staging`). Versions published meanwhile wait as packets and are loaded by the
    rollout after the wake-up (at level 2 the last one is loaded again). Elsewhere (the
    CPU) the engine's memory stays resident and the log says so once.
    """

    def __init__(
        self,
        cfg: Config,
        policy: torch.nn.Module,
        replica: torch.nn.Module,
        task: Any,
        *,
        optimiser: torch.optim.Optimizer | None = None,
    ):
        super().__init__(policy, replica)
        opts = parse_vllm_options(cfg.deploy.vllm)
        overlap = cfg.deploy.async_infer
        # Overlapped, the engine samples while the trainer updates: it never sleeps.
        level = opts.sleep_level if opts.sleep_level is not None and not overlap and sleep_mode_available() else None
        self.engine = _vllm_engine(cfg, replica, task.tokenizer, sleep_mode=level is not None)
        if level is None:
            _note_resident_engine(opts.sleep_level, overlap)
        self.sync = WeightSync(self._full_weights())
        # Loaded when a rollout starts (async: the rollout's own thread; asleep: after the wake-up), else at once.
        self.pending = (
            PendingVersions(self.engine.receiver(), copy=overlap, keep_last=level == 2)
            if overlap or level is not None
            else None
        )
        self.publish(0)
        timeout = cfg.deploy.rollout_timeout or None
        self.rollout: Stage = rollout_stage(self.engine, seed=cfg.trainer.seed, timeout=timeout)
        self.agent: MultiTurnRollout | None = None
        if cfg.rl.multi_turn is not None:  # the engine continues each trajectory from its token ids
            self.agent = multi_turn_rollout_stage(cfg, self.engine, task, timeout=timeout)
            self.rollout = self.agent.stage
        if self.pending is not None:
            self.rollout = dataclasses.replace(
                self.rollout,
                fn=partial(_at_version, self.rollout.fn, self.pending),
                resource="rollout" if overlap else self.rollout.resource,
            )
        if level is not None:
            self.switch = self._sleep_switch(policy, optimiser, level)

    def publish(self, version: int) -> None:
        self._send(version, self.engine.receiver() if self.pending is None else self.pending)

    def rollout_metrics(self, step: int) -> dict[str, torch.Tensor]:
        return {} if self.agent is None else self.agent.pop_metrics(step)

    def _sleep_switch(
        self, policy: torch.nn.Module, optimiser: torch.optim.Optimizer | None, level: int
    ) -> EngineSwitch:
        """vLLM's sleep mode at the phase switch, in the memory plan's order, with the trainer's state on the host."""
        current, self.staging = _moved_state(dict(policy.named_parameters()), optimiser)

        def sleep() -> None:
            self.engine.sleep(level)
            if level == 2:  # the weights are gone: the next rollout loads its version again
                assert self.pending is not None
                self.pending.forget()

        return EngineSwitch(
            current, wake=self.engine.wake_up, sleep=sleep, on_offload=self.staging.offloaded, awake=True
        )

    def close(self) -> None:
        self.engine.close()


class PendingVersions:
    """Weights versions published ahead of the engine: each kept as its packet until a rollout loads it.

    The :class:`rlcore.dataflow.WeightSync` receiver of a co-located engine that must not
    be loaded when the trainer publishes (a rollout of an older version may be running on
    another thread, or the engine is asleep). :meth:`load` loads the version a rollout's
    rows were stamped with and forgets the older ones (the scheduler stamps rows with
    versions that never go down).

    Args:
      receiver: the engine's receiver (:meth:`VLLMEngine.receiver <rlcore.train.VLLMEngine.receiver>`).
      copy: keep a copy of each packet's buffers (the sync refills its buffers at the next
        version, which may come before the rollout loads this one).
      keep_last: keep the loaded packet, so :meth:`forget` can have it loaded again (an
        engine whose weights a level-2 sleep dropped).

    Attributes:
      loaded: the version in the engine, or None (none yet, or forgotten).
    """

    def __init__(self, receiver: Callable[[WeightPacket], Any], *, copy: bool, keep_last: bool = False):
        self.receiver, self.copy, self.keep_last = receiver, copy, keep_last
        self.lock = threading.Lock()
        self.packets: dict[int, WeightPacket] = {}
        self.loaded: int | None = None
        self.last: WeightPacket | None = None

    def __call__(self, packet: WeightPacket) -> None:
        if self.copy:
            packet = packet._replace(buffers=tuple(b.clone() for b in packet.buffers))
        with self.lock:
            self.packets[packet.version] = packet

    def load(self, version: int) -> None:
        """Put ``version`` into the engine unless it is there; older packets are dropped."""
        with self.lock:
            if version == self.loaded:
                return
            packet = self.packets.pop(version, None)
            if packet is None and self.last is not None and self.last.version == version:
                packet = self.last
            if packet is None:
                raise ValueError(
                    f"version: got {version}, expected one of the published versions {sorted(self.packets)} "
                    f"(loaded: {self.loaded})"
                )
            for v in [v for v in self.packets if v < version]:
                del self.packets[v]
        self.receiver(packet)
        self.loaded = version
        if self.keep_last:
            self.last = packet

    def forget(self) -> None:
        """The engine lost its weights (a level-2 sleep): the next :meth:`load` loads its version again."""
        self.loaded = None


def _at_version(call: Callable[[Batch], Any], pending: PendingVersions, b: Batch) -> Any:
    """A rollout call that first loads the weights version its rows were stamped with."""
    pending.load(int(b["policy_version"][0]))
    return call(b)


def _moved_state(
    named: Mapping[str, torch.Tensor], optimiser: torch.optim.Optimizer | None
) -> tuple[Callable[[], TrainState], SwapStaging]:
    """What a co-located phase switch moves off the device, and the background save's staging served by that move.

    Returns ``(current, staging)``: ``current()`` is the training state as it is now (the
    optimiser creates the grads and its state lazily, at the first step); a background
    save's copy of the moved tensors is the offload's (the optimiser's state as of the save).
    """

    def optimiser_state() -> list[Any]:
        return [] if optimiser is None else list(optimiser.state.values())

    def current() -> TrainState:
        return TrainState(named, [p.grad for p in named.values()], optimiser_state())

    return current, SwapStaging(lambda: [*named.values(), *tree_leaves(optimiser_state())])


_NOTED: list[bool] = []


def _note_resident_engine(level: int | None, overlap: bool) -> None:
    """Say once per process that the vLLM engine's memory stays resident through training, and why."""
    if _NOTED:
        return
    _NOTED.append(True)
    if not sleep_mode_available():
        why = "vLLM's platform here has no sleep mode"
    elif level is None:
        why = "deploy.vllm.sleep_level null"
    else:
        why = "deploy.async_infer (the rollout overlaps the update)"
    print(
        f"rlcore: deploy.engine vllm: {why}; the engine's weights and KV cache stay in memory while the trainer updates",
        file=sys.stderr,
        flush=True,
    )


class WorkerDeployment(_Synced):
    """``deploy.mode: disaggregated``: the rollout in a :class:`rlcore.dataflow.RolloutWorker` process.

    The worker builds its own model of the config (``build_model``) and engine
    (:class:`RolloutServer`: ``deploy.engine`` torch or vllm) and samples with the run's
    row-keyed streams (``build_model`` must pickle: a module-level function); each
    version's weight packet reaches it as shared-memory buckets; with ``rl.multi_turn`` (vLLM)
    its rows are trajectories and their metrics come back to :meth:`rollout_metrics`. Start-up (spawn,
    imports, model build, the vLLM engine's start) happens here, before the first step,
    not inside it. ``deploy.partial_rollouts``: the worker takes a version published
    while it generates between two tokens (:class:`rlcore.dataflow.LatestWeights`);
    ``deploy.stale_refills``: the rows the update would drop as stale are drawn again
    (:func:`refilled`).
    """

    def __init__(
        self,
        cfg: Config,
        policy: torch.nn.Module,
        replica: torch.nn.Module,
        *,
        vocab_size: int,
        build_model: ModelBuilder,
    ):
        super().__init__(policy, replica)
        self.max_restarts = cfg.trainer.max_worker_restarts
        self.partial = cfg.deploy.partial_rollouts
        # A replacement's start-up is bounded as the first one's (a loaded machine imports slowly).
        self.ready_timeout = max(120.0, cfg.deploy.rollout_timeout)
        self.worker = self._start((cfg.to_dict(), vocab_size, build_model), max(1, cfg.trainer.threads))
        try:  # a worker that fails to start (e.g. a model its engine cannot serve) is stopped, not left behind
            self.worker.wait_ready(timeout=self.ready_timeout)
            self.sync = WeightSync(self._full_weights())
            self.publish(0)
        except BaseException:
            self.worker.close()
            raise
        timeout = cfg.deploy.rollout_timeout or None
        self._agent_metrics: dict[int, dict[str, torch.Tensor]] | None = None
        if cfg.rl.multi_turn is None:
            self.rollout: Stage = self.worker.stage(
                inputs=["prompts", "prompt_mask", "iteration", "row"],
                outputs=list(ROLLOUT_OUTPUTS),
                resource="rollout",
                timeout=timeout,
            )
        else:  # the worker rolls out trajectories (its environments beside its engine) and sends their metrics
            proxy = self.worker.stage(
                inputs=list(AGENT_INPUTS), outputs=list(AGENT_COLUMNS), resource="rollout", timeout=timeout
            )
            self._agent_metrics = {}
            self.rollout = dataclasses.replace(proxy, fn=partial(_keep_metrics, proxy.fn, self._agent_metrics))
        if cfg.deploy.stale_refills:
            assert cfg.rl.stale_after is not None  # the config asks for it with deploy.stale_refills
            refill = refilled(self.rollout.fn, self.worker, after=cfg.rl.stale_after, draws=cfg.deploy.stale_refills)
            self.rollout = dataclasses.replace(self.rollout, fn=refill)

    # The worker's generate function: built in the worker from (config, vocabulary size, build_model).
    server: Callable[..., Callable[[Batch, dict[str, torch.Tensor]], Batch]] = RolloutServer

    def _start(self, args: tuple, threads: int) -> RolloutWorker | RayRolloutWorker:
        return RolloutWorker(
            self.server,
            args=args,
            threads=threads,
            join_timeout=5.0,
            max_restarts=self.max_restarts,
            ready_timeout=self.ready_timeout,
            interruptible=self.partial,
        )

    def publish(self, version: int) -> None:
        self._send(version, partial(self.worker.publish, version))

    def rollout_metrics(self, step: int) -> dict[str, torch.Tensor]:
        return {} if self._agent_metrics is None else self._agent_metrics.pop(step, {})

    def step_metrics(self) -> dict[str, float]:
        out = super().step_metrics()
        if self.max_restarts:  # replacements of a dead worker process so far, of trainer.max_worker_restarts
            out["worker_restarts"] = float(getattr(self.worker, "restarts", 0))
        return out

    def close(self) -> None:
        self.worker.close()


def _keep_metrics(call: Callable[[Batch], Any], pending: dict[int, dict[str, torch.Tensor]], batch: Batch) -> Any:
    """The worker's trajectories as dock columns; their step's metrics kept for :meth:`WorkerDeployment.rollout_metrics`."""
    out = dict(call(batch))
    pending[int(batch["iteration"][0])] = out.pop(_AGENT_METRICS)
    return out


def refilled(
    call: Callable[[Batch], Mapping[str, Any]], worker: Any, *, after: int, draws: int
) -> Callable[[Batch], Batch]:
    """A rollout call whose stale rows are drawn again with the newest weights, at most ``draws`` times.

    Filter-and-refill for staleness-aware data: when the call returns, a row whose oldest
    token is more than ``after`` versions behind the newest version published to the
    ``worker`` would be dropped (or discounted) by the update (``rl.stale_after``); it is
    sampled again, stamped with that newest version, so the batch keeps its size with
    fresh rows. A row is redrawn only while the worker holds a newer version than the
    row's (each draw is bounded; rows still stale after ``draws`` go to the update as they are).
    """

    def run(b: Batch) -> Batch:
        out = dict(call(b))
        for _ in range(draws):
            newest = int(worker.published)
            stale = (newest - out["version"] > after).nonzero().flatten()
            if stale.numel() == 0:
                break
            redo = call({**{k: v[stale] for k, v in b.items()}, "policy_version": torch.full_like(stale, newest)})
            out = {k: _put_rows(out[k], stale, redo[k]) for k in out}
        return out

    return run


def _put_rows(column: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``column`` with ``rows`` replaced by ``values``; a token column padded with 0 to the wider of the two."""
    if column.dim() == 2 and column.shape[1] != values.shape[1]:
        width = max(column.shape[1], values.shape[1])
        column = torch.nn.functional.pad(column, (0, width - column.shape[1]))
        values = torch.nn.functional.pad(values, (0, width - values.shape[1]))
    column = column.clone()
    column[rows] = values.to(column.dtype)
    return column


class RayDeployment(WorkerDeployment):
    """``deploy.backend: ray``: the worker is a Ray actor; the weight packets travel through Ray's object store.

    A dead actor is replaced up to ``trainer.max_worker_restarts`` times; the rows of the
    call it was serving go back to the dock (``nack``) and are redone by the replacement.
    """

    def _start(self, args: tuple, threads: int) -> RolloutWorker | RayRolloutWorker:
        return RayRolloutWorker(
            self.server, args=args, threads=threads, max_restarts=self.max_restarts, ready_timeout=self.ready_timeout
        )


class ColocatedDeployment(_Placed):
    """One process, one device: the engine samples the policy's current weights on the trainer's replica.

    At every switch to the rollout phase the memory plan's AllGather-Swap
    (:class:`rlcore.memory.ColocatedSwitch`) offloads the optimiser state, gradients and
    training weights and builds the replica's weights bucket by bucket; its seconds and
    bytes are the step's sync, and the predicted peak of each phase is logged. With
    ``in_place`` (:func:`in_place_rollout`) the replica's parameters share the policy's
    storage instead: each optimiser step is seen by the next rollout, nothing is swapped.
    ``rl.multi_turn`` samples with :mod:`rlcore.agent`'s rollout on the same weights.
    """

    def __init__(
        self,
        cfg: Config,
        policy: torch.nn.Module,
        replica: torch.nn.Module,
        optimiser: torch.optim.Optimizer,
        task: Any,
        *,
        in_place: bool,
    ):
        super().__init__(next(replica.parameters()).device)
        if in_place:
            named = dict(policy.named_parameters())
            for name, p in replica.named_parameters():
                p.data = named[name].data
        else:
            self.switch = self._swap(policy, replica, optimiser)
        timeout = cfg.deploy.rollout_timeout or None
        self.rollout: Stage = rollout_stage(
            _torch_engine(cfg, replica, task.tokenizer), seed=cfg.trainer.seed, timeout=timeout
        )
        self.agent: MultiTurnRollout | None = None
        if cfg.rl.multi_turn is not None:
            self.agent = multi_turn_rollout_stage(cfg, replica, task, timeout=timeout)
            self.rollout = self.agent.stage

    def publish(self, version: int) -> None:
        pass  # the engine reads the policy's weights (swapped in, or shared): nothing to send

    def rollout_metrics(self, step: int) -> dict[str, torch.Tensor]:
        return {} if self.agent is None else self.agent.pop_metrics(step)

    def _swap(self, policy: torch.nn.Module, infer: torch.nn.Module, optimiser: torch.optim.Optimizer) -> Switch:
        """The co-located phase switch: the memory plan's AllGather-Swap builds ``infer``'s weights for each rollout."""
        engine_params = dict(infer.named_parameters())
        for p in engine_params.values():
            p.data = p.data.new_empty(0)  # bound to the inference buckets at each switch
        named = dict(policy.named_parameters())
        layout = decoder_layout(param_meta(named), dp=dist.get_world_size())
        plan = allgather_swap_plan(
            plan_reshard(param_meta(named), layout, layout),
            mesh=None,
            device=next(policy.parameters()).device,
            rank=dist.get_rank(),
        )
        current, staging = _moved_state(named, optimiser)
        self.staging = staging
        state = TrainState(named)

        def bind(weights: dict[str, torch.Tensor]) -> None:
            for name, p in engine_params.items():
                p.data = weights[name]

        swap = ColocatedSwitch(state, plan, on_rollout=bind)
        peak = {
            "rollout": plan.memory.transition("train", "rollout").peak_bytes,
            "train": plan.memory.transition("rollout", "train").peak_bytes,
        }
        self.memory = {f"memory/predicted_peak_{k}_bytes": float(v) for k, v in peak.items()}

        def switch(resource: str, src: str | None, dst: str) -> None:
            if dst == "rollout":
                now = current()
                state.grads, state.optimizer = now.grads, now.optimizer
                t0 = time.perf_counter()
                swap(resource, src, dst)
                self._record_sync(time.perf_counter() - t0, sum(b.nbytes for b in plan.reshard.buckets))
                assert isinstance(swap.state, RolloutState)
                staging.offloaded([h for group in swap.state.handles.values() for h in group])
            else:
                swap(resource, src, dst)

        return switch


def make_deployment(
    cfg: Config,
    models: _Models,
    opt: _Optimisers,
    world: _World,
    task: Any,
    engine: InferenceEngine | None,
    replica: torch.nn.Module,
    *,
    build_model: ModelBuilder,
) -> Deployment:
    """The deployment the run needs: the one place the deployment mode is chosen.

    Args:
      cfg: the run's config (``deploy.*``, ``rl.multi_turn``, the engine's sampling options).
      models: the trainer's models (the ``policy`` is the one whose weights are published).
      opt: the trainer's optimisers (``opts[0]``, the policy's, is swapped out co-located).
      world: this process's place (``rank``; ``sharded``: the policy is split over ranks).
      task: the prompt source (its tokenizer; ``task.sampled`` false: finished rows, no rollout).
      engine: a user's engine to sample with, or None.
      replica: an unsharded copy of the policy's architecture (eval mode, no grads) the
        in-process engines sample on.
      build_model: ``(cfg, vocab_size) -> model``: a worker's own copy of the policy (picklable).

    Returns:
      A :class:`Deployment`; version 0 of the weights is already published.
    """
    if not task.sampled:  # a dataset's finished rows (offline preference pairs)
        return NoRollout()
    policy = models.policy
    timeout = cfg.deploy.rollout_timeout or None
    if engine is not None:
        return ReplicaDeployment(policy, replica, engine, _loader(engine), seed=cfg.trainer.seed, timeout=timeout)
    if cfg.deploy.mode == "disaggregated":  # the worker's engine is deploy.engine's (RolloutServer)
        kind = RayDeployment if cfg.deploy.backend == "ray" else WorkerDeployment
        return kind(cfg, policy, replica, vocab_size=task.tokenizer.vocab_size, build_model=build_model)
    if cfg.deploy.engine == "vllm":
        return VLLMDeployment(cfg, policy, replica, task, optimiser=opt.opts[0])
    if world.sharded and cfg.deploy.async_infer:  # the rollout overlaps the update: a snapshot of its own
        return SnapshotDeployment(cfg, policy, replica, task)
    if world.sharded or is_lora(policy):
        own = _torch_engine(cfg, replica, task.tokenizer)
        return ReplicaDeployment(policy, replica, own, load_into(replica), seed=cfg.trainer.seed, timeout=timeout)
    in_place = in_place_rollout(cfg, next(replica.parameters()).device)
    return ColocatedDeployment(cfg, policy, replica, opt.opts[0], task, in_place=in_place)
