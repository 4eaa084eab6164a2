"""Validation during training: mean reward, pass@1 (greedy) and pass@k (``k`` samples) on the validation prompts.

Every ``trainer.eval_every`` steps (and after the last step) the policy answers each
validation prompt once greedily and ``k = trainer.eval_samples`` times by sampling at
the rollout's temperature. A response is correct when its reward exceeds
``trainer.eval_threshold``; pass@k is the unbiased estimator of Chen et al.
(arXiv:2107.03374, :func:`rlcore.algos.pass_at_k`). The prompts are split over the
data-parallel ranks and the sums reduced, so every rank gets the same figures.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlcore import algos
from rlcore.data import PromptSet
from rlcore.rewards import evaluate
from rlcore.seeding import Purpose, RowStream
from rlcore.train.config import Config
from rlcore.train.rollout import generate, left_pad

__all__ = ["Validator", "validation_keys"]


def validation_keys(k: int) -> tuple[str, str, str]:
    """The metric names a validation writes: ``val/reward``, ``val/pass@1``, ``val/pass@k``.

    >>> validation_keys(4)
    ('val/reward', 'val/pass@1', 'val/pass@4')
    """
    return "val/reward", "val/pass@1", f"val/pass@{k}"


class Validator:
    """Scores the policy on a validation :class:`rlcore.data.PromptSet` every ``trainer.eval_every`` steps.

    Args:
      cfg: the run's config (``trainer.eval_*``, ``rl`` sampling controls, ``trainer.seed``).
      data: the validation prompts (with ``prompt_ids``).
      tokenizer: the source's tokenizer (``decode``, ``eos_token_id``, ``pad_token_id``).
      reward: the run's reward, called in this process.
      rank, world_size, group: this rank's place in the data-parallel group.
      chunk: prompts per generation call.
    """

    def __init__(
        self,
        cfg: Config,
        data: PromptSet,
        tokenizer: Any,
        reward: Any,
        *,
        rank: int = 0,
        world_size: int = 1,
        group: Any = None,
        chunk: int = 64,
    ):
        if data.prompt_ids is None:
            raise ValueError("data: the validation prompts have no token ids (load them with a tokenizer)")
        self.cfg, self.data, self.tok, self.reward = cfg, data, tokenizer, reward
        self.rank, self.world_size, self.group, self.chunk = rank, world_size, group, chunk
        self.k = cfg.trainer.eval_samples

    def due(self, step: int) -> bool:
        """Whether validation runs after step ``step`` (every ``eval_every`` steps, and after the last)."""
        every = self.cfg.trainer.eval_every
        return bool(every) and ((step + 1) % every == 0 or step + 1 == self.cfg.trainer.steps)

    def _scores(self, policy: Any, rows: list[int], *, n: int, temperature: float, step: int) -> torch.Tensor:
        rl = self.cfg.rl
        device = next(policy.parameters()).device
        ids = self.data.prompt_ids
        assert ids is not None
        prompts, mask = left_pad([list(ids[i]) for i in rows], self.tok.pad_token_id)
        # Row j of prompt i is global row i * n + j: the samples do not depend on the ranks' share.
        global_rows = (torch.tensor(rows)[:, None] * n + torch.arange(n)).reshape(-1)
        g = RowStream(self.cfg.trainer.seed, Purpose.VALIDATION, step, global_rows)
        out = generate(
            policy,
            prompts.to(device),
            mask.to(device),
            eos_token_id=self.tok.eos_token_id,
            pad_token_id=self.tok.pad_token_id,
            max_new_tokens=rl.max_new_tokens,
            n=n,
            temperature=temperature,
            top_p=rl.top_p if temperature > 0 else 1.0,
            top_k=rl.top_k if temperature > 0 else 0,
            generator=g,
        )
        texts = [self.tok.decode(r[m != 0].tolist()) for r, m in zip(out.responses.cpu(), out.mask.cpu())]
        repeated = [i for i in rows for _ in range(n)]
        columns = self.data.reward_columns(repeated)
        return evaluate(
            self.reward, [self.data.prompts[i] for i in repeated], texts, batch=f"validation {step}", **columns
        )

    @torch.no_grad()
    def __call__(self, policy: torch.nn.Module, step: int) -> dict[str, float]:
        """The validation metrics after step ``step`` (identical on every rank)."""
        mine = list(range(self.rank, len(self.data), self.world_size))
        threshold, k = self.cfg.trainer.eval_threshold, self.k
        sums = torch.zeros(4, dtype=torch.float64)  # reward sum, samples, pass@1 sum, pass@k sum
        was_training = policy.training
        policy.eval()
        try:
            for lo in range(0, len(mine), self.chunk):
                rows = mine[lo : lo + self.chunk]
                greedy = self._scores(policy, rows, n=1, temperature=0.0, step=step)
                sampled = self._scores(policy, rows, n=k, temperature=self.cfg.rl.temperature, step=step)
                groups = torch.arange(len(rows)).repeat_interleave(k)
                passk = algos.pass_at_k(sampled, groups, k=k, threshold=threshold, num_groups=len(rows))
                sums += torch.stack(
                    [
                        sampled.double().sum(),
                        torch.tensor(float(sampled.numel()), dtype=torch.float64),
                        (greedy > threshold).double().sum(),
                        passk.double().sum(),
                    ]
                )
        finally:
            policy.train(was_training)
        if self.group is not None:
            dist.all_reduce(sums, group=self.group)
        reward, samples, pass1, passk_sum = sums.tolist()
        prompts = float(len(self.data))
        names = validation_keys(k)
        return {names[0]: reward / max(samples, 1.0), names[1]: pass1 / prompts, names[2]: passk_sum / prompts}
