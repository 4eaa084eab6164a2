"""The DPO recipe: one step from a batch of preference pairs to ``(loss, metrics)``.

A composition of rlcore primitives, not a trainer: chosen and rejected responses go
through the causal LM in *one* forward pass, token log-probs come from
:func:`rlcore.ops.logprobs_from_logits` with the one-token label shift,
:func:`sequence_logps` reduces them, and any DPO-family loss scores the pairs.
By default the pass is padded and the model is a callable the user binds,
``model(input_ids, attention_mask) -> logits``, e.g.
``lambda ids, am: hf_model(input_ids=ids, attention_mask=am).logits``. With
``dpo(packed=True)`` the model is an ``(apply, params)`` pair from
:func:`rlcore.models.from_hf` and the pass is padding-free (:func:`packed_logps`).

Batch layout (a dict; ``B`` pairs, right-padded, lengths may differ between sides)::

    chosen_input_ids       [B, Tc] int    prompt + chosen response
    chosen_attention_mask  [B, Tc]        1 on real tokens
    chosen_mask            [B, Tc]        1 on the response tokens that are scored
    rejected_input_ids / rejected_attention_mask / rejected_mask   [B, Tr]
    ref_chosen_logps, ref_rejected_logps   [B] float   optional precomputed reference
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from rlcore._checks import check_choice, check_integer, check_ndim, check_same_shape, check_shape, check_tensor
from rlcore.algos.preference import REDUCTIONS, sequence_logps
from rlcore.algos.preference_pairwise import dpo_loss
from rlcore.models import token_logprobs
from rlcore.ops import logprobs_from_logits

__all__ = ["DPO", "concatenated_logps", "dpo", "packed_logps"]

Model = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# A packed step's model: ``(apply, params)`` as returned by rlcore.models.from_hf.
PackedModel = tuple[Callable[..., torch.Tensor], Any]
SIDES = ("chosen", "rejected")
REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def _side(batch: Mapping[str, Any], side: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    keys = [f"{side}_input_ids", f"{side}_attention_mask", f"{side}_mask"]
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"batch: missing {', '.join(missing)}; expected the keys {', '.join(keys)}")
    ids, attention, mask = (batch[k] for k in keys)
    check_ndim(keys[0], ids, 2)
    check_integer(keys[0], ids)
    check_same_shape(keys[1], attention, keys[0], ids)
    check_same_shape(keys[2], mask, keys[0], ids)
    return ids, attention, mask


def _pad_to(x: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(x, (0, length - x.shape[1]))


def _stacked(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids, attention_mask, mask`` of both sides, right-padded to one length: ``[2B, T]``."""
    sides = [_side(batch, s) for s in SIDES]
    b = sides[0][0].shape[0]
    check_shape("rejected_input_ids", sides[1][0], (b, None), what="as many pairs as chosen_input_ids")
    length = max(sides[0][0].shape[1], sides[1][0].shape[1])
    ids, attention, mask = (torch.cat([_pad_to(side[i], length) for side in sides]) for i in range(3))
    return ids, attention, mask


def _sequence_logps(logp: torch.Tensor, scored: torch.Tensor, reduce: str) -> tuple[torch.Tensor, torch.Tensor]:
    seq = sequence_logps(logp.to(torch.promote_types(logp.dtype, torch.float32)), scored, reduce=reduce)
    b = seq.shape[0] // 2
    return seq[:b], seq[b:]


def concatenated_logps(
    model: Model, batch: Mapping[str, Any], *, reduce: str = "sum", temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence log-probs of the chosen and rejected responses from one forward pass.

    Both sides are right-padded to a common length and stacked into one ``[2B, T]``
    batch, as in the DPO reference code (Rafailov et al., 2023, arXiv:2305.18290) and
    TRL's ``concatenated_forward``, which do it so that FSDP gathers each layer's
    weights once per step instead of twice. On a CPU there is nothing to gain:
    ``benchmarks/bench_preference.py`` measures the same time at equal lengths, and
    the padded tokens' cost when one side is shorter, which :func:`packed_logps`
    avoids. Logits at position ``t`` score
    token ``t + 1``::

        logp[b, t] = log softmax(logits[b, t] / T)[input_ids[b, t + 1]],  counted where mask[b, t + 1]

    Args:
      model: ``model(input_ids [N, T], attention_mask [N, T]) -> logits [N, T, V]``.
      batch: the pair batch described in the module docstring (the ``ref_*`` columns
        are not read).
      reduce: ``"sum"`` or ``"mean"``, as in :func:`sequence_logps`.
      temperature: logits are divided by it (as in sampling).

    Returns:
      ``(chosen [B], rejected [B])`` in float32 (float64 for float64 logits): token
      log-probs are upcast before the sum, since a bfloat16 sum of a few hundred
      log-probs would erase the margins DPO compares.

    >>> model = lambda ids, am: torch.zeros(*ids.shape, 4)  # uniform over 4 tokens
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> batch = {"chosen_input_ids": ids, "chosen_attention_mask": torch.ones_like(ids),
    ...          "chosen_mask": torch.tensor([[0, 1, 1]]), "rejected_input_ids": ids[:, :2],
    ...          "rejected_attention_mask": torch.ones(1, 2), "rejected_mask": torch.tensor([[0, 1]])}
    >>> concatenated_logps(model, batch)  # 2 and 1 scored tokens at log(1/4) each
    (tensor([-2.7726]), tensor([-1.3863]))
    """
    check_choice("reduce", reduce, REDUCTIONS)
    ids, attention, mask = _stacked(batch)
    logits = model(ids, attention)
    check_shape("logits", logits, (*ids.shape, None), what="model(input_ids, attention_mask) for the stacked pairs")
    scored = mask[:, 1:] != 0
    # Padding ids need not be valid tokens: unscored labels are replaced by token 0.
    labels = torch.where(scored, ids[:, 1:], 0)
    logp = logprobs_from_logits(logits[:, :-1], labels, temperature=temperature)
    return _sequence_logps(logp, scored, reduce)


def packed_logps(
    apply: Callable[..., torch.Tensor],
    params: Any,
    batch: Mapping[str, Any],
    *,
    reduce: str = "sum",
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence log-probs of the chosen and rejected responses from one padding-free forward pass.

    The padding-free counterpart of :func:`concatenated_logps` (DPO: Rafailov et al.,
    2023, arXiv:2305.18290): the real tokens of all ``2B`` chosen and rejected
    sequences are concatenated into one packed row of ``N`` tokens
    (:func:`rlcore.dataflow.pack`) and scored by :func:`rlcore.models.token_logprobs`,
    whose packed attention keeps the sequences apart, so no compute is spent on the
    padding of the shorter side or of the shorter sequences within a side. The
    formula and the scored tokens are those of :func:`concatenated_logps`::

        logp[b, t] = log softmax(h[b, t - 1] @ W.T / T)[input_ids[b, t]],  counted where mask[b, t], t >= 1

    Packing reads the packed length ``N`` back to the host once (the documented sync
    of :func:`rlcore.dataflow.pack`), so unlike the padded path this one cannot run
    inside a ``fullgraph`` compiled region.

    Args:
      apply: ``apply(params, input_ids, *, position_ids, cu_seqlens, max_seqlen) ->
        hidden [N, H]`` with an ``output_weight(params)`` method, e.g. from
        :func:`rlcore.models.from_hf`.
      params: the parameters ``apply`` takes.
      batch: the pair batch described in the module docstring (right-padded; the
        ``ref_*`` columns are not read).
      reduce: ``"sum"`` or ``"mean"``, as in :func:`sequence_logps`.
      temperature: logits are divided by it (as in sampling).

    Returns:
      ``(chosen [B], rejected [B])`` in float32 (float64 for a float64 model),
      differentiable in ``params``.

    >>> from rlcore.models import from_hf, load_causal_lm
    >>> lm = load_causal_lm({"model_type": "qwen2", "vocab_size": 16, "hidden_size": 8,
    ...     "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
    ...     "num_key_value_heads": 1})
    >>> apply, params = from_hf(lm)
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> batch = {"chosen_input_ids": ids, "chosen_attention_mask": torch.ones_like(ids),
    ...          "chosen_mask": torch.tensor([[0, 1, 1]]), "rejected_input_ids": ids[:, :2],
    ...          "rejected_attention_mask": torch.ones(1, 2), "rejected_mask": torch.tensor([[0, 1]])}
    >>> chosen, rejected = packed_logps(apply, params, batch)
    >>> chosen.shape, rejected.shape
    (torch.Size([1]), torch.Size([1]))
    """
    check_choice("reduce", reduce, REDUCTIONS)
    ids, attention, mask = _stacked(batch)
    # token_logprobs aligns each log-prob with the token it scores (0 at a sequence's
    # first token), so column t pairs with mask[:, t] directly.
    logp = token_logprobs(apply, params, {"input_ids": ids, "attention_mask": attention}, temperature=temperature)
    return _sequence_logps(logp[:, 1:], mask[:, 1:] != 0, reduce)


class DPO(NamedTuple):
    """A DPO step: ``loss, metrics = step(policy, batch, reference=None, *, num_pairs=None)``.

    Fields (replace any with ``step._replace(...)``):
      loss: ``(pi_chosen, pi_rejected, ref_chosen, ref_rejected) -> (loss [B], metrics)``,
        e.g. :func:`dpo_loss` with its options bound.
      reduce: sequence reduction, ``"sum"`` or ``"mean"``.
      temperature: logits temperature.
      packed: run the padding-free path (:func:`packed_logps`): ``policy`` and
        ``reference`` are then ``(apply, params)`` pairs from
        :func:`rlcore.models.from_hf` instead of ``model(input_ids, attention_mask)``
        callables.

    Calling it runs the policy once on the stacked pairs; reference log-probs come
    from the batch's ``ref_chosen_logps`` / ``ref_rejected_logps`` columns or, when
    ``reference`` is given, from one no-grad forward of that model (exactly one of
    the two). The loss is the sum of the per-pair losses over ``num_pairs`` (the
    global pair count under micro-batching or data parallelism; default ``B``).
    Metrics are detached 0-d means over the local pairs: the loss's metrics
    (``chosen_rewards``, ``rejected_rewards``, ``margins``, ``accuracies``) plus
    ``logps_chosen`` and ``logps_rejected`` of the policy.
    """

    loss: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] = dpo_loss
    reduce: str = "sum"
    temperature: float = 1.0
    packed: bool = False

    def _logps(
        self, name: str, model: Model | PackedModel, batch: Mapping[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.packed:
            if not callable(model):
                raise ValueError(
                    f"{name}: got {type(model).__name__}, expected a model(input_ids, attention_mask) -> logits "
                    "callable (build the step with packed=True for an (apply, params) pair)"
                )
            return concatenated_logps(model, batch, reduce=self.reduce, temperature=self.temperature)
        if not (isinstance(model, tuple) and len(model) == 2):
            raise ValueError(
                f"{name}: got {type(model).__name__}, expected an (apply, params) pair such as "
                "rlcore.models.from_hf(model) (the step was built with packed=True)"
            )
        apply, params = model
        return packed_logps(apply, params, batch, reduce=self.reduce, temperature=self.temperature)

    def __call__(
        self,
        policy: Model | PackedModel,
        batch: Mapping[str, Any],
        reference: Model | PackedModel | None = None,
        *,
        num_pairs: int | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if num_pairs is not None and (isinstance(num_pairs, bool) or not isinstance(num_pairs, int) or num_pairs <= 0):
            raise ValueError(f"num_pairs: got {num_pairs!r}, expected a positive int")
        columns = [k for k in REF_KEYS if k in batch]
        if len(columns) != (0 if reference is not None else len(REF_KEYS)):
            raise ValueError(
                f"reference: got {'a model' if reference is not None else 'None'} with batch columns "
                f"{columns}, expected exactly one source of reference "
                f"log-probs: a reference model, or both columns {', '.join(REF_KEYS)}"
            )
        pi_chosen, pi_rejected = self._logps("policy", policy, batch)
        if reference is None:
            ref_chosen, ref_rejected = (check_tensor(k, batch[k]) for k in REF_KEYS)
        else:
            with torch.no_grad():
                ref_chosen, ref_rejected = self._logps("reference", reference, batch)
        dtype = pi_chosen.dtype
        per_pair, loss_metrics = self.loss(pi_chosen, pi_rejected, ref_chosen.to(dtype), ref_rejected.to(dtype))
        loss = per_pair.sum() / (num_pairs or per_pair.shape[0])
        metrics = {k: v.float().mean() for k, v in loss_metrics.items()}
        metrics["logps_chosen"] = pi_chosen.detach().mean()
        metrics["logps_rejected"] = pi_rejected.detach().mean()
        return loss, metrics


def dpo(
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    reduce: str = "sum",
    temperature: float = 1.0,
    packed: bool = False,
    **loss_options: Any,
) -> DPO:
    """Build a DPO step with :func:`dpo_loss` and its options bound.

    DPO: Rafailov et al., 2023, arXiv:2305.18290, ``-log sigmoid(beta h)`` with ``h``
    the policy-minus-reference log-ratio margin of each pair; any ``loss_type`` of
    :func:`dpo_loss` (IPO is usually run with ``reduce="mean"``). Options are
    validated here, before any model runs.

    Args:
      beta, loss_type, label_smoothing, **loss_options: passed to :func:`dpo_loss`.
      reduce: ``"sum"`` (DPO) or ``"mean"`` (length-normalised) sequence log-probs.
      temperature: logits temperature.
      packed: score chosen and rejected in one padding-free packed row
        (:func:`packed_logps`); the step then takes ``(apply, params)`` pairs from
        :func:`rlcore.models.from_hf` as ``policy`` and ``reference``.

    Returns:
      A :class:`DPO` step.

    >>> step = dpo(beta=0.1)
    >>> policy = lambda ids, am: torch.zeros(*ids.shape, 4)
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> batch = {"chosen_input_ids": ids, "chosen_attention_mask": torch.ones_like(ids),
    ...          "chosen_mask": torch.tensor([[0, 1, 1]]), "rejected_input_ids": ids,
    ...          "rejected_attention_mask": torch.ones_like(ids), "rejected_mask": torch.tensor([[0, 1, 1]])}
    >>> loss, metrics = step(policy, batch, reference=policy)
    >>> loss  # policy == reference: log 2
    tensor(0.6931)
    """
    check_choice("reduce", reduce, REDUCTIONS)
    if not isinstance(packed, bool):
        raise ValueError(f"packed: got {packed!r}, expected True or False")
    loss = functools.partial(dpo_loss, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, **loss_options)
    # A one-pair dry run raises any bad option now rather than after a forward pass.
    loss(*[torch.zeros(1)] * 4)
    return DPO(loss=loss, reduce=reduce, temperature=temperature, packed=packed)
