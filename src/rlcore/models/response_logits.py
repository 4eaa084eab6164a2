"""The next-token logits at every response position: what a full-vocabulary distillation loss compares.

A per-token loss over the vocabulary (GKD's generalised JSD, :func:`rlcore.algos.generalized_jsd_loss`)
needs the whole distribution the model predicts each response token from, not only the
sampled token's log-prob. This forward gives it from the same padding-free layouts as
the log-prob forwards: one shared-prompt pack when the rows of a group share their
prompt (:func:`rlcore.models.shared_prefix_hidden`), else every row packed whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from rlcore._checks import check_positive
from rlcore.models.shared_prefix import shared_prefix_hidden, shares_prompts
from rlcore.models.token_logprobs import packed_hidden
from rlcore.ops.packing import pack, unpack

__all__ = ["response_logits"]


def response_logits(
    apply: Any,
    params: Mapping[str, torch.Tensor],
    batch: Mapping[str, torch.Tensor],
    *,
    temperature: float = 1.0,
    share_prompts: bool = True,
) -> torch.Tensor:
    """Logits ``[B, R, V]`` of the distribution each response token is sampled from, divided by the temperature.

        logits[b, t] = h[b, t - 1] @ W.T / T,   h[b, -1] = the prompt's last hidden state

    so that ``log_softmax(logits[b, t])[responses[b, t]]`` is the token's log-prob
    (:func:`rlcore.train.stages.response_logprobs`). Positions off the response mask hold 0.

    Args:
      apply: ``apply`` of :func:`rlcore.models.from_hf` (with ``output_weight``).
      params: its parameters.
      batch: ``prompts`` / ``prompt_mask`` ``[B, P]`` (left-padded, at least one prompt
        token each), ``responses`` / ``mask`` ``[B, R]`` (a token counts where ``mask != 0``).
      temperature: the sampling temperature ``T > 0``.
      share_prompts: run each distinct prompt once (False: every row packed whole).

    Returns:
      float32 ``[B, R, V]``, differentiable in ``params``.
    """
    check_positive("temperature", temperature)
    responses, mask = batch["responses"], batch["mask"]
    b, r = responses.shape
    group = shares_prompts(batch["prompts"], batch["prompt_mask"]) if share_prompts else None
    # The output weight is read after the forward: a sharded model holds it whole only then.
    if group is not None:
        hidden, dst = shared_prefix_hidden(apply, params, batch, group=group)
        logits = F.linear(hidden, apply.output_weight(params)).float()
        placed = logits.new_zeros(b * r, logits.shape[-1]).index_copy(0, dst, logits)
        return placed.view(b, r, -1) / temperature
    width = batch["prompts"].shape[1]
    packed = pack(
        {
            "input_ids": torch.cat([batch["prompts"], responses], 1),
            "attention_mask": torch.cat([batch["prompt_mask"].long(), (mask != 0).long()], 1),
        }
    )
    hidden = packed_hidden(apply, params, packed)
    # Response token t is predicted from padded position width + t - 1 (the last prompt token for t = 0).
    before = unpack(hidden, packed)[:, width - 1 : width - 1 + r]
    keep = (mask != 0)[..., None]
    return torch.where(keep, F.linear(before, apply.output_weight(params)).float(), 0.0) / temperature
