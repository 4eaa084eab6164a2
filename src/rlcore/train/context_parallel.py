"""Context parallelism in the trainer: the scoring and update stages on sequence shards over ``mesh["cp"]``.

The ranks of one context-parallel group hold the same rows (the same prompts, and the
responses their rank 0 sampled, :func:`replicate_stage`) and the same weights (FSDP2
shards them over ``dp x cp``, :func:`rlcore.train.parallel.shard_mesh`). Every forward
splits the packed rows over the group (:func:`rlcore.models.sharded_token_logprobs`,
ring attention or Ulysses), so each rank holds the activations and the log-prob work of
its share of the tokens only:

* the old-policy and reference log-probs (:func:`cp_logprob_stage`) are summed over
  the group into whole columns (the shares partition the tokens), so the advantages,
  the metrics and the dock see exactly the columns of an unsharded run;
* the update's forward (:func:`cp_rl_forward`) gives the recipe this rank's share of
  the mask, and :class:`ContextParallelRecipe` its global counts
  (:func:`rlcore.algos.sequence_sharded_counts`: per-sequence token counts over ``cp``,
  totals over ``dp``), which :meth:`rlcore.algos.Algorithm.loss` aggregates with
  :func:`rlcore.algos.sequence_sharded_aggregate`; so the losses of the ``dp x cp`` ranks
  add up to the loss of the whole batch and FSDP2's gradient sum is its gradient.

>>> from rlcore.train.context_parallel import check_context_parallel_model
>>> class Heads:
...     num_attention_heads, num_key_value_heads = 4, 2
>>> check_context_parallel_model(Heads(), context_parallel=2, mode="ulysses")
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rlcore import algos
from rlcore._process_group import as_process_group
from rlcore.dataflow import Stage, stage
from rlcore.models import ShardedLogprobs, from_hf, sharded_token_logprobs
from rlcore.train.stages import eval_mode

__all__ = [
    "ContextParallelRecipe",
    "DataParallelRecipe",
    "check_context_parallel_model",
    "cp_logprob_stage",
    "cp_response_logprobs",
    "cp_rl_forward",
    "replica_groups",
    "replicate_stage",
]

Batch = dict[str, torch.Tensor]

# Policy losses whose per-token value depends on the whole sequence (a length-normalised sequence ratio).
_SEQUENCE_COUPLED = (algos.gspo_loss, algos.gmpo_loss)


def check_context_parallel_model(config: Any, *, context_parallel: int, mode: str) -> None:
    """``ValueError`` unless Ulysses can split the model's heads over ``context_parallel`` ranks (ring: any heads).

    Args:
      config: the model's config (``num_attention_heads``, ``num_key_value_heads``).
      context_parallel: ``parallel.context_parallel``.
      mode: ``parallel.cp_mode``, ``"ring"`` or ``"ulysses"``.

    >>> class Heads:
    ...     num_attention_heads, num_key_value_heads = 4, 2
    >>> check_context_parallel_model(Heads(), context_parallel=4, mode="ulysses")
    Traceback (most recent call last):
    ...
    ValueError: config key 'parallel.context_parallel': got 4 with parallel.cp_mode 'ulysses', expected a divisor of the model's num_attention_heads (4) and num_key_value_heads (2) (Ulysses splits the heads over the ranks; parallel.cp_mode=ring takes any head count)
    """
    if mode != "ulysses" or context_parallel == 1:
        return
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % context_parallel or kv_heads % context_parallel:
        raise ValueError(
            f"config key 'parallel.context_parallel': got {context_parallel} with parallel.cp_mode 'ulysses', "
            f"expected a divisor of the model's num_attention_heads ({heads}) and num_key_value_heads ({kv_heads}) "
            "(Ulysses splits the heads over the ranks; parallel.cp_mode=ring takes any head count)"
        )


def replica_groups(mesh: DeviceMesh) -> Any:
    """A new process group over this rank's ``cp`` ranks (collective: every rank of the mesh calls it).

    The stages that replicate their rows over the context-parallel group
    (:func:`replicate_stage`) each take a group of their own, so their broadcasts never
    interleave with the model's collectives on ``mesh["cp"]``.

    Args:
      mesh: the ``("dp", "cp", "tp")`` mesh.

    Returns:
      this rank's new ``ProcessGroup``.
    """
    grid = mesh.mesh
    mine = None
    me = dist.get_rank()
    for i in range(grid.shape[0]):
        for k in range(grid.shape[2]):
            ranks = [int(r) for r in grid[i, :, k]]
            group = dist.new_group(ranks)
            if me in ranks:
                mine = group
    return mine


def _portable(err: Exception) -> Exception:
    """``err`` itself when it pickles (the peers raise the same error), else a ``RuntimeError`` with its message."""
    try:
        pickle.dumps(err)
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


def replicate_stage(s: Stage, group: Any) -> Stage:
    """``s`` run on rank 0 of ``group`` only, its outputs broadcast to the group's other ranks.

    The context-parallel ranks must score the same responses: sampling (and rewards
    that may time out or draw noise) runs once, on the group's first rank. When it
    raises there, the error is broadcast too and every rank of the group raises it, so
    no peer waits in the broadcast until the process-group timeout.

    Args:
      s: a stage (the rollout, the reward).
      group: a ``ProcessGroup`` of the context-parallel ranks (:func:`replica_groups`).

    Returns:
      the stage with the same columns and options.
    """
    fn = s.fn
    root = dist.get_global_rank(group, 0)
    first = dist.get_rank(group) == 0

    def replicated(b: Batch) -> Any:
        box: list[Any] = [None]
        failure: BaseException | None = None
        if first:
            try:
                box = [(True, fn(b))]
            except Exception as err:
                # The peers wait in the broadcast: they get the error instead of waiting for a timeout.
                failure = err
                box = [(False, _portable(err))]
        dist.broadcast_object_list(box, src=root, group=group)
        if failure is not None:
            raise failure
        ok, value = box[0]
        if not ok:
            raise value
        return value

    return dataclasses.replace(s, fn=replicated)


def cp_response_logprobs(
    model: Any,
    batch: Mapping[str, torch.Tensor],
    *,
    group: Any,
    mode: str,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> ShardedLogprobs:
    """This rank's share of the response log-probs ``[N, R]``: :func:`rlcore.train.stages.response_logprobs` split over ``cp``.

    Args:
      model: ``(apply, params)`` from :func:`rlcore.models.from_hf`.
      batch: ``prompts`` / ``prompt_mask`` ``[N, P]`` (left-padded), ``responses`` / ``mask`` ``[N, R]``.
      group: the context-parallel ``ProcessGroup`` or 1-D ``DeviceMesh``.
      mode: ``"ring"`` or ``"ulysses"``.
      temperature: the sampling temperature.
      with_entropy: also return the entropies.

    Returns:
      :class:`rlcore.models.ShardedLogprobs` over the response columns: ``logp`` (and
      ``entropy``) float32, 0 off this rank's tokens, and ``mask`` the tokens it scores.
    """
    apply, params = model
    width = batch["prompts"].shape[1]
    seq = {
        "input_ids": torch.cat([batch["prompts"], batch["responses"]], 1),
        "attention_mask": torch.cat([batch["prompt_mask"].long(), (batch["mask"] != 0).long()], 1),
    }
    out = sharded_token_logprobs(
        apply, params, seq, group=group, mode=mode, temperature=temperature, with_entropy=with_entropy
    )
    entropy = out.entropy[:, width:].float() if out.entropy is not None else None
    return ShardedLogprobs(out.logp[:, width:].float(), entropy, out.mask[:, width:])


def cp_logprob_stage(
    model: torch.nn.Module,
    *,
    group: Any,
    mode: str,
    outputs: tuple[str, ...] = ("old_logp", "entropy"),
    temperature: float = 1.0,
) -> Stage:
    """:func:`rlcore.train.stages.logprob_stage` on sequence shards: each rank scores its share, one all-reduce joins them.

    Args:
      model: a ``transformers`` causal LM (sharded by :func:`rlcore.train.parallelize` or not).
      group: the context-parallel ``ProcessGroup`` or 1-D ``DeviceMesh``.
      mode: ``"ring"`` or ``"ulysses"``.
      outputs: ``(logp column,)`` or ``(logp column, entropy column)``.
      temperature: the sampling temperature.

    Returns:
      A stage writing whole ``[N, R]`` columns on every rank of the group.
    """
    lm = from_hf(model)
    if len(outputs) not in (1, 2):
        raise ValueError(f"outputs: got {outputs!r}, expected (logp,) or (logp, entropy) column names")
    pg = as_process_group("group", group, optional=True)

    def logprobs(b: Batch) -> dict[str, torch.Tensor]:
        with eval_mode(model):
            out = cp_response_logprobs(
                lm, b, group=group, mode=mode, temperature=temperature, with_entropy=len(outputs) == 2
            )
        parts = [out.logp] if out.entropy is None else [out.logp, out.entropy]
        whole = torch.stack(parts)
        dist.all_reduce(whole, group=pg)  # the shares partition the tokens: their sum is the column
        return dict(zip(outputs, whole.unbind(0)))

    return stage(
        logprobs,
        inputs=["prompts", "prompt_mask", "responses", "mask"],
        outputs=outputs,
        name=outputs[0],
        phase="train",
    )


def cp_rl_forward(
    policy: torch.nn.Module, *, group: Any, mode: str, temperature: float = 1.0
) -> Callable[[Batch], Batch]:
    """:func:`rlcore.train.stages.rl_forward` on sequence shards: the recipe's ``mask`` is this rank's share of ``loss_mask``.

    Off this rank's tokens ``logp`` holds ``old_logp`` (ratio 1, no gradient), so the
    masked positions stay finite in every policy loss.
    """
    lm = from_hf(policy)
    carried = ("old_logp", "ref_logp", "rollout_logp", "advantages", "returns", "old_values", "entropy")

    def forward(b: Batch) -> Batch:
        batch = {k: b[k] for k in carried if k in b}
        out = cp_response_logprobs(lm, b, group=group, mode=mode, temperature=temperature, with_entropy=True)
        batch["mask"] = torch.where(out.mask, b["loss_mask"], torch.zeros_like(b["loss_mask"]))
        old = b.get("old_logp")
        batch["logp"] = out.logp if old is None else torch.where(out.mask, out.logp, old.to(out.logp.dtype))
        assert out.entropy is not None
        batch["entropy"] = out.entropy
        return batch

    return forward


def _metric_terms(recipe: Any, batch: Batch) -> tuple[Any, Any]:
    """The recipe's metric weight for ``batch`` and its non-mean reductions (every metric a mean without them)."""
    weight = recipe.metric_weight(batch) if hasattr(recipe, "metric_weight") else 1.0
    reductions = recipe.metric_reductions() if hasattr(recipe, "metric_reductions") else {}
    return weight, reductions


class DataParallelRecipe:
    """A recipe whose metrics are those of the whole batch over the data-parallel ranks (each holding other rows).

    The loss is unchanged (each rank's share of the global-count normalised loss; the
    gradients are summed by FSDP2). The metrics are combined with
    :func:`rlcore.algos.reduce_metrics` after every update: the means weighted by the
    recipe's ``metric_weight(batch)`` (counted tokens, or pairs), ``ratio_max`` /
    ``ratio_min`` the true extremes, the loss terms (``pg_loss``, ``kl``, ``entropy``, ``distill``,
    ``vf_loss``) summed, as the recipe's ``metric_reductions()`` says; so every rank
    logs the metrics a single process would log for the same global batch.

    Args:
      recipe: an :class:`rlcore.algos.Algorithm`, an :class:`rlcore.algos.DPO`, or any
        object with ``global_counts`` and ``loss``.
      group: the data-parallel ``ProcessGroup`` or 1-D ``DeviceMesh``.
    """

    def __init__(self, recipe: Any, group: Any):
        self.recipe, self.group = recipe, group

    def global_counts(self, batch: Batch, *, process_group: Any = None) -> dict[str, torch.Tensor]:
        """The recipe's own global counts (summed over ``process_group``)."""
        out: dict[str, torch.Tensor] = self.recipe.global_counts(batch, process_group=process_group)
        return out

    def loss(self, batch: Batch, **counts: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``recipe.loss(batch, **counts)`` with its metrics combined over the group."""
        loss, metrics = self.recipe.loss(batch, **counts)
        weight, reductions = _metric_terms(self.recipe, batch)
        return loss, algos.reduce_metrics(metrics, weight, process_groups=[self.group], reductions=reductions)


class ContextParallelRecipe:
    """A recipe whose batches hold one rank's share of each sequence's tokens: global counts over ``cp`` (and ``dp``).

    ``global_counts`` is :func:`rlcore.algos.sequence_sharded_counts` (``num_tokens``,
    ``num_seqs``, ``seq_tokens``), which :meth:`rlcore.algos.Algorithm.loss` aggregates
    exactly. ``loss`` returns the loss of the whole (micro-)batch over the group as its
    value (what is logged and checked for finiteness on every rank) with the gradient of
    this rank's share (FSDP2 sums the shares). The metrics are those of the whole batch
    (:func:`rlcore.algos.reduce_metrics` over ``cp``, then ``dp_group``): the additive
    ones (``pg_loss``, ``kl``, ``entropy``, ``vf_loss``) summed, ``ratio_max`` /
    ``ratio_min`` the true extremes, the others (``approx_kl``, ``ratio_mean``, the clip
    fractions) token-weighted means, so they equal the single-process run's.

    Args:
      recipe: an :class:`rlcore.algos.Algorithm`.
      group: the context-parallel ``ProcessGroup`` or 1-D ``DeviceMesh``.
      dp_group: the data-parallel one, if any (the metrics are combined over it too).
    """

    def __init__(self, recipe: algos.Algorithm, group: Any, *, dp_group: Any = None):
        loss = recipe.policy_loss
        while isinstance(loss, functools.partial):
            loss = loss.func
        if loss in _SEQUENCE_COUPLED:
            raise ValueError(
                f"recipe.policy_loss: got {loss.__name__}, expected a token-local policy loss (ppo_clip_loss, "
                "cispo_loss, sapo_loss, reinforce_loss, ...): its sequence ratio needs every token of a sequence, "
                "which context parallelism splits over the ranks"
            )
        self.recipe, self.group, self.dp_group = recipe, group, dp_group
        self.pg = as_process_group("group", group, optional=True)
        self.size = dist.get_world_size(self.pg)

    def global_counts(self, batch: Batch, *, process_group: Any = None) -> dict[str, torch.Tensor]:
        """:func:`rlcore.algos.sequence_sharded_counts` of ``batch["mask"]`` over ``cp`` and ``process_group`` (dp)."""
        return algos.sequence_sharded_counts(batch["mask"], cp_group=self.group, dp_group=process_group)

    def loss(self, batch: Batch, **counts: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``recipe.loss(batch, **counts)``: valued as the group's total, differentiated as this rank's share."""
        loss, metrics = self.recipe.loss(batch, **counts)
        whole = loss.detach().float().reshape(1).clone()
        dist.all_reduce(whole, group=self.pg)
        total = loss + (whole[0].to(loss.dtype) - loss.detach())
        weight, reductions = _metric_terms(self.recipe, batch)
        out = algos.reduce_metrics(metrics, weight, process_groups=[self.pg, self.dp_group], reductions=reductions)
        return total, out
