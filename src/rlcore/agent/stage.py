"""The multi-turn rollout as a pipeline stage over the Transfer Dock's columns."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rlcore.agent.config import MultiTurnConfig, stop_token_ids
from rlcore.agent.protocols import Environment
from rlcore.agent.rollout import multi_turn_rollout
from rlcore.agent.runner import StepRunner
from rlcore.dataflow.stages import Stage, stage
from rlcore.seeding import Purpose, RowStream

__all__ = ["STAGE_OUTPUTS", "multi_turn_stage", "trajectory_rows"]

# Dock columns the stage writes: per-row token tensors (unpadded) and per-row scalars; names and dtypes
# as the trainer's schema (rlcore.train.COLUMNS) declares them.
STAGE_OUTPUTS = (
    "responses",
    "mask",
    "trajectory_mask",
    "rollout_logp",
    "rewards",
    "scores",
    "num_turns",
    "num_tool_calls",
    "num_tool_errors",
    "tool_latency",
    "num_env_errors",
    "truncated",
)


def trajectory_rows(traj: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Trajectories (from :func:`rlcore.agent.multi_turn_rollout`) as dock columns: unpadded rows per token column.

    ``responses`` (ids), ``mask`` (1.0 on policy tokens), ``trajectory_mask`` (1.0 on
    every response token), ``rollout_logp`` and ``rewards`` (each turn's reward on its
    last token) become lists of 1-D tensors cut to each row's length (the dock pads
    them again on read, with ``<column>_mask``); the per-trajectory counts stay ``[B]``
    tensors.

    >>> rows = trajectory_rows({"responses": torch.tensor([[5, 6], [7, 0]]), "trajectory_mask": torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
    ...     "mask": torch.tensor([[1.0, 0.0], [1.0, 0.0]]), "rollout_logp": torch.zeros(2, 2), "rewards": torch.zeros(2, 2),
    ...     "scores": torch.ones(2), "num_turns": torch.ones(2), "num_tool_calls": torch.zeros(2),
    ...     "num_tool_errors": torch.zeros(2), "tool_latency": torch.zeros(2), "num_env_errors": torch.zeros(2),
    ...     "truncated": torch.zeros(2, dtype=torch.bool)})
    >>> [r.tolist() for r in rows["responses"]], [r.tolist() for r in rows["mask"]]
    ([[5, 6], [7]], [[1.0, 0.0], [1.0]])
    """
    lengths = (traj["trajectory_mask"] != 0).sum(-1).tolist()

    def cut(x: torch.Tensor) -> list[torch.Tensor]:
        return [row[:n] for row, n in zip(x, lengths)]

    return {
        **{k: cut(traj[k]) for k in STAGE_OUTPUTS[:5]},
        **{k: traj[k] for k in STAGE_OUTPUTS[5:]},
    }


def _rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m != 0].tolist() for row, m in zip(ids, mask)]


class _FailedEnvironment:
    """Stands for an environment whose factory raised: its reset raises that error, so only its trajectory ends."""

    def __init__(self, error: Exception):
        self.error = error

    def reset(self, sample: Mapping[str, Any]) -> str:
        raise RuntimeError(f"the environment factory raised {type(self.error).__name__}: {self.error}") from self.error

    def step(self, action: str) -> Any:
        raise RuntimeError("the environment was never made")


def _make_or_fail(make_env: Callable[[], Environment]) -> Any:
    try:
        return make_env()
    except Exception as err:  # a factory failing for one trajectory ends that trajectory only
        return _FailedEnvironment(err)


def multi_turn_stage(
    model: Any,
    tokenizer: Any,
    make_env: Callable[[], Environment],
    cfg: MultiTurnConfig | None = None,
    *,
    inputs: Sequence[str] = ("prompts",),
    to_sample: Callable[[dict[str, Any], int], Mapping[str, Any]] | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    name: str = "rollout",
    micro_batch: int | None = None,
    resource: str = "device",
    timeout: float | None = None,
) -> Stage:
    """A ``role="rollout"`` stage running :func:`rlcore.agent.multi_turn_rollout` on the dock's prompts.

    The stage reads ``inputs`` (the first is the prompt ids, whose mask is the
    ``prompt_mask`` column when the stage reads it, else the dock's padding mask
    ``<column>_mask`` of a ragged prompt column), builds one environment per row with ``make_env`` and
    ``env.reset(to_sample(batch, row))``, and writes :data:`STAGE_OUTPUTS` (see
    :func:`trajectory_rows`). The default ``to_sample`` gives, per input column, the
    row's decoded text for token columns (``tokenizer.decode``) and the row's tensor
    otherwise. ``model`` samples under ``eval()`` and ``no_grad`` and is restored to
    its previous mode. The random stream is :class:`rlcore.seeding.RowStream`
    ``(seed, Purpose.SAMPLING, step, row)``: ``step`` is the batch's ``iteration`` column
    (else its ``policy_version``) and ``row`` its ``row`` column (else the row's running
    index over this stage's calls), so a trajectory's samples do not depend on the
    other rows of its call.

    Args:
      model: the policy (a ``transformers`` causal LM), or an engine that samples turns
        from token ids (:class:`rlcore.agent.TurnSampler`, e.g. :class:`rlcore.train.VLLMEngine`).
      tokenizer: decodes actions, encodes observations, gives the special ids.
      make_env: builds a fresh environment (:func:`rlcore.agent.build_env_factory`).
      cfg: budgets and stop tokens (default :class:`MultiTurnConfig`).
      inputs: dock columns read.
      to_sample: ``(batch, row) -> sample`` for ``env.reset``.
      temperature, top_p, top_k: sampling controls.
      seed: the seed of the sampling stream.
      name, micro_batch, resource, timeout: as :func:`rlcore.dataflow.stage`.

    Returns:
      A :class:`rlcore.dataflow.Stage`.

    >>> from rlcore.agent.calc import Multiplication
    >>> task = Multiplication()
    >>> s = multi_turn_stage(None, task.tokenizer, task.make_env)
    >>> s.role, s.inputs, s.outputs[:3]
    ('rollout', ('prompts',), ('responses', 'mask', 'trajectory_mask'))
    """
    cfg = cfg if cfg is not None else MultiTurnConfig()
    inputs = tuple(inputs)
    if not inputs:
        raise ValueError("inputs: got no columns, expected the prompt column first")
    stops = stop_token_ids(cfg, tokenizer)
    drawn = [0]  # rows sampled by earlier calls: the running row index when the batch has no ``row``

    def default_sample(batch: dict[str, Any], row: int) -> dict[str, Any]:
        sample: dict[str, Any] = {}
        for col in inputs:
            value = batch[col][row]
            mask = batch.get(f"{col}_mask")
            if mask is not None and isinstance(value, torch.Tensor) and value.dim() == 1:
                sample[col] = tokenizer.decode(value[mask[row] != 0].tolist())
            else:
                sample[col] = value
        return sample

    sample_of = to_sample if to_sample is not None else default_sample

    def rollout(batch: dict[str, Any]) -> dict[str, Any]:
        ids = batch[inputs[0]]
        mask = batch.get("prompt_mask", batch.get(f"{inputs[0]}_mask", torch.ones_like(ids)))
        prompts = _rows(ids, mask)
        step = batch.get("iteration", batch.get("policy_version"))
        step = int(step.reshape(-1)[0]) if isinstance(step, torch.Tensor) and step.numel() else 0
        rows = batch.get("row")
        if not isinstance(rows, torch.Tensor):
            rows = torch.arange(len(prompts)) + drawn[0]
        drawn[0] += len(prompts)
        generator = RowStream(seed, Purpose.SAMPLING, step, rows.reshape(-1))
        samples = [sample_of(batch, row) for row in range(len(prompts))]
        # A torch model samples under eval(); an engine (rlcore.agent.TurnSampler) has no mode.
        was_training = getattr(model, "training", None)
        if was_training is not None:
            model.eval()
        # A runner per call: its threads end with the call, nothing outlives the pipeline.
        runner = StepRunner(max_concurrency=min(cfg.max_concurrency, max(1, len(prompts))), timeout=cfg.step_timeout)
        try:
            traj = multi_turn_rollout(
                model,
                prompts,
                [_make_or_fail(make_env) for _ in prompts],
                samples,
                tokenizer=tokenizer,
                stop_token_ids=stops,
                max_turns=cfg.max_turns,
                max_new_tokens=cfg.max_new_tokens,
                max_total_tokens=cfg.max_total_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                generator=generator,
                runner=runner,
            )
        finally:
            runner.close()
            if was_training is not None:
                model.train(was_training)
        return trajectory_rows(traj)

    rollout.__name__ = name
    return stage(
        rollout,
        inputs=inputs,
        outputs=STAGE_OUTPUTS,
        name=name,
        micro_batch=micro_batch,
        resource=resource,
        role="rollout",
        timeout=timeout,
    )
