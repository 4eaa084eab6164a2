"""The update forwards of the supervised recipes: SFT's packed token log-probs, a reward model's pair rewards.

Both read a dataset's finished rows (no rollout, no scoring stage) and give the batch
their recipe reads (:class:`rlcore.algos.SFT`, :class:`rlcore.algos.RM`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from rlcore.models import from_hf, token_logprobs

__all__ = ["SFT_COLUMNS", "last_token_rewards", "reward_pair_forward", "sft_forward"]

Batch = dict[str, torch.Tensor]
#: The dock columns of one SFT row (whole sequences, prompt included; ``sft_mask`` on the response).
SFT_COLUMNS = ("sft_input_ids", "sft_attention_mask", "sft_mask")


def sft_forward(policy: torch.nn.Module) -> Callable[[Batch], Batch]:
    """The SFT update's forward: each row's token log-probs from one padding-free packed forward.

    The rows' real tokens are packed into one sequence (:func:`rlcore.models.token_logprobs`,
    attention kept within each row), so no compute goes to padding.

    Returns:
      ``forward(rows) -> {"logp", "mask"}``: ``[B, T]`` float32 log-probs, each on the token it
      scores, and the float32 response mask (``sft_mask``).
    """
    apply, params = from_hf(policy)

    def forward(b: Batch) -> Batch:
        seq = {"input_ids": b["sft_input_ids"], "attention_mask": b["sft_attention_mask"]}
        logp = token_logprobs(apply, params, seq)
        return {"logp": logp.float(), "mask": b["sft_mask"].float()}

    return forward


def last_token_rewards(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A scalar-head model's output at each right-padded row's last real token: ``[B]`` float32 rewards.

    ``model`` is a one-output token-classification model (a causal LM's body with a scalar
    head); the reward is its value after the whole sequence, as a sequence-classification
    model scores it.
    """
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits[..., 0]
    last = (attention_mask.sum(-1) - 1).clamp(min=0)
    return out.gather(1, last.unsqueeze(1)).squeeze(1).float()


def reward_pair_forward(model: torch.nn.Module) -> Callable[[Batch], Batch]:
    """The reward model's update forward: both sides of every pair in one padded forward.

    Returns:
      ``forward(rows) -> {"chosen_rewards", "rejected_rewards"}`` ``[P]`` float32, with gradient.
    """

    def forward(b: Batch) -> Batch:
        sides = [(b[f"{s}_input_ids"], b[f"{s}_attention_mask"]) for s in ("chosen", "rejected")]
        width = max(ids.shape[1] for ids, _ in sides)
        ids = torch.cat([F.pad(i, (0, width - i.shape[1])) for i, _ in sides])
        attention = torch.cat([F.pad(a, (0, width - a.shape[1])) for _, a in sides])
        rewards = last_token_rewards(model, ids, attention)
        p = sides[0][0].shape[0]
        return {"chosen_rewards": rewards[:p], "rejected_rewards": rewards[p:]}

    return forward
