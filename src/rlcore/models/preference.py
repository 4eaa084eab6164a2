"""The model half of preference optimisation: chosen and rejected responses scored in one forward pass.

The DPO family's losses (:mod:`rlcore.algos`) take per-pair sequence log-probs and
never see a model; this module runs the model. Chosen and rejected responses go
through the causal LM together, as one stacked padded batch (``packed=False``) or as
one padding-free packed row (``packed=True``), and the scored tokens' log-probs are
summed per response.

Batch layout (a dict; ``P`` pairs, right-padded, lengths may differ between sides)::

    chosen_input_ids       [P, Tc] int    prompt + chosen response
    chosen_attention_mask  [P, Tc]        1 on real tokens
    chosen_mask            [P, Tc]        1 on the response tokens that are scored
    rejected_input_ids / rejected_attention_mask / rejected_mask   [P, Tr]

Masks follow the library's convention: explicit tensors aligned with the tokens they
mark (``mask[b, t]`` says whether token ``t`` is scored); the first token of a
sequence has no prefix and is never scored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from rlcore._checks import check_integer, check_ndim, check_same_shape, check_shape
from rlcore.models.token_logprobs import token_logprobs
from rlcore.ops import logprobs_from_logits, masked_sum

__all__ = ["PREFERENCE_SIDES", "preference_logps"]

PREFERENCE_SIDES = ("chosen", "rejected")


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


def _stacked(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids, attention_mask, mask`` of both sides, right-padded to one length: ``[2P, T]``."""
    sides = [_side(batch, s) for s in PREFERENCE_SIDES]
    p = sides[0][0].shape[0]
    check_shape("rejected_input_ids", sides[1][0], (p, None), what="as many pairs as chosen_input_ids")
    length = max(sides[0][0].shape[1], sides[1][0].shape[1])
    ids, attention, mask = (
        torch.cat([F.pad(side[i], (0, length - side[i].shape[1])) for side in sides]) for i in range(3)
    )
    return ids, attention, mask


def _padded_token_logps(
    apply: Callable[..., torch.Tensor],
    params: Any,
    ids: torch.Tensor,
    attention: torch.Tensor,
    scored: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """``[2P, T - 1]`` log-probs of tokens ``1..T-1`` from one padded forward (label shift by one)."""
    logits = apply(params, ids, attention)
    check_shape(
        "logits", logits, (*ids.shape, None), what="apply(params, input_ids, attention_mask) for the stacked pairs"
    )
    # Padding ids need not be valid tokens: unscored labels are replaced by token 0.
    labels = torch.where(scored, ids[:, 1:], 0)
    return logprobs_from_logits(logits[:, :-1], labels, temperature=temperature)


def preference_logps(
    apply: Callable[..., torch.Tensor],
    params: Any,
    batch: Mapping[str, Any],
    *,
    packed: bool = True,
    temperature: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Summed log-probs and token counts of the chosen and rejected responses, from one forward pass.

    The forward half of DPO (Rafailov et al., 2023, arXiv:2305.18290) and its family:
    ``log pi(y|x) = sum_t log pi(y_t | x, y_<t)`` over the scored tokens of each
    response, for both sides of every pair in *one* pass::

        logp[b, t] = log softmax(logits[b, t - 1] / T)[input_ids[b, t]],  summed where mask[b, t], t >= 1

    ``packed=True`` (the default) concatenates the real tokens of all ``2P`` sequences
    into one row (:func:`rlcore.ops.pack`) and scores it with
    :func:`rlcore.models.token_logprobs`: no compute is spent on padding, and packed
    attention keeps the sequences apart. Packing reads the packed length back to the
    host once, so this path cannot run inside a ``fullgraph`` compiled region.
    ``packed=False`` right-pads both sides to one length and runs one ``[2P, T]``
    forward, as the DPO reference code and TRL's ``concatenated_forward`` do (so that
    FSDP gathers each layer's weights once per step); it has no host sync.

    Args:
      apply: with ``packed=True``, ``apply(params, input_ids, *, position_ids,
        cu_seqlens, max_seqlen) -> hidden [N, H]`` with an ``output_weight(params)``
        method, e.g. from :func:`rlcore.models.from_hf`; with ``packed=False``,
        ``apply(params, input_ids [2P, T], attention_mask [2P, T]) -> logits [2P, T, V]``
        (e.g. ``lambda params, ids, am: model(input_ids=ids, attention_mask=am).logits``).
      params: the parameters ``apply`` takes.
      batch: the pair batch described in the module docstring; other keys are ignored.
      packed: padding-free packed forward (True) or one padded forward (False).
      temperature: logits are divided by it (as in sampling).

    Returns:
      ``{"chosen_logps", "rejected_logps"}`` ``[P]`` summed response log-probs in
      float32 (float64 for a float64 model; token log-probs are upcast before the
      sum, since a bfloat16 sum of a few hundred log-probs would erase the margins DPO
      compares), differentiable in ``params``; and ``{"chosen_lengths",
      "rejected_lengths"}`` ``[P]`` int64 counts of the scored tokens, for the
      length-normalised loss types. This is the batch :class:`rlcore.algos.DPO` reads.

    >>> apply = lambda params, ids, am: torch.zeros(*ids.shape, 4)  # uniform over 4 tokens
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> batch = {"chosen_input_ids": ids, "chosen_attention_mask": torch.ones_like(ids),
    ...          "chosen_mask": torch.tensor([[0, 1, 1]]), "rejected_input_ids": ids[:, :2],
    ...          "rejected_attention_mask": torch.ones(1, 2), "rejected_mask": torch.tensor([[0, 1]])}
    >>> out = preference_logps(apply, None, batch, packed=False)  # 2 and 1 tokens at log(1/4)
    >>> out["chosen_logps"], out["rejected_logps"], out["chosen_lengths"], out["rejected_lengths"]
    (tensor([-2.7726]), tensor([-1.3863]), tensor([2]), tensor([1]))
    """
    if not isinstance(packed, bool):
        raise ValueError(f"packed: got {packed!r}, expected True or False")
    ids, attention, mask = _stacked(batch)
    scored = mask[:, 1:] != 0
    if packed:
        if not callable(getattr(apply, "output_weight", None)):
            raise ValueError(
                f"apply: got {type(apply).__name__} without an output_weight(params) method, expected a packed "
                "model function such as rlcore.models.from_hf(model)[0] (or pass packed=False with "
                "apply(params, input_ids, attention_mask) -> logits)"
            )
        # token_logprobs aligns each log-prob with the token it scores (0 at a
        # sequence's first token), so column t pairs with mask[:, t] directly.
        logp = token_logprobs(apply, params, {"input_ids": ids, "attention_mask": attention}, temperature=temperature)
        logp = logp[:, 1:]
    else:
        if not callable(apply):
            raise ValueError(
                f"apply: got {type(apply).__name__}, expected apply(params, input_ids, attention_mask) -> logits"
            )
        logp = _padded_token_logps(apply, params, ids, attention, scored, temperature)
    logp = logp.to(torch.promote_types(logp.dtype, torch.float32))
    sums = masked_sum(logp, scored, dim=-1)
    lengths = scored.sum(-1)
    p = sums.shape[0] // 2
    return {
        "chosen_logps": sums[:p],
        "rejected_logps": sums[p:],
        "chosen_lengths": lengths[:p],
        "rejected_lengths": lengths[p:],
    }
