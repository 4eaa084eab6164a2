"""One recipe shape: the policy-gradient recipes and the DPO family run through the same update function."""

import pytest
import torch

from rlcore import algos
from rlcore.models import preference_logps

VOCAB = 11


class TinyLM(torch.nn.Module):
    """A causal LM small enough to differentiate in float64: running mean of embeddings, then a head."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, 6, generator=g, dtype=torch.float64))
        self.out = torch.nn.Parameter(torch.randn(6, VOCAB, generator=g, dtype=torch.float64))

    def forward(self, ids, attention_mask):
        h = self.emb[ids] * attention_mask.unsqueeze(-1)
        steps = torch.arange(1, ids.shape[1] + 1, dtype=h.dtype)
        return torch.tanh(h.cumsum(1) / steps.unsqueeze(-1)) @ self.out


def update(recipe, forward, batch, micro_batches, process_group=None):
    """The trainer's update stage, written once: global counts, then forward + loss + backward per micro-batch."""
    counts = recipe.global_counts(batch, process_group=process_group)
    total = 0.0
    for idx in micro_batches:
        micro = forward({k: v[idx] for k, v in batch.items()})
        loss, metrics = recipe.loss(micro, **counts)
        assert loss.dim() == 0 and all(not v.requires_grad for v in metrics.values())
        loss.backward()
        total = total + loss.detach()
    return total


def _token_logp(lm, ids, attention):
    logp = torch.log_softmax(lm(ids, attention)[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0))


def _rl_case(lm):
    g = torch.Generator().manual_seed(0)
    b, t = 8, 6
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    mask = torch.arange(t) < torch.randint(2, t + 1, (b, 1), generator=g)
    mask[:, 0] = False
    with torch.no_grad():
        old = _token_logp(lm, ids, torch.ones_like(ids))
    batch = {
        "ids": ids,
        "mask": mask,
        "old_logp": old,
        "ref_logp": old + 0.1,
        "scores": torch.randint(0, 2, (b,), generator=g).double(),
        "group_ids": torch.arange(b) // 4,
    }
    recipe = algos.grpo()
    batch = recipe.advantages(batch)  # on the whole batch, before the update stage splits it

    def forward(micro):
        return {**micro, "logp": _token_logp(lm, micro["ids"], torch.ones_like(micro["ids"]))}

    return recipe, forward, batch


def _dpo_case(lm):
    g = torch.Generator().manual_seed(1)
    p, t = 6, 7
    batch = {}
    for side in ("chosen", "rejected"):
        lengths = torch.randint(3, t + 1, (p, 1), generator=g)
        attention = (torch.arange(t) < lengths).long()
        batch[f"{side}_input_ids"] = torch.randint(0, VOCAB, (p, t), generator=g) * attention
        batch[f"{side}_attention_mask"] = attention
        batch[f"{side}_mask"] = attention.bool() & (torch.arange(t) >= 2)
    padded = lambda _, ids, am: lm(ids, am)  # noqa: E731
    with torch.no_grad():
        ref = preference_logps(padded, None, batch, packed=False)
    batch.update(ref_chosen_logps=ref["chosen_logps"] - 0.3, ref_rejected_logps=ref["rejected_logps"] + 0.2)
    recipe = algos.dpo(beta=0.5, loss_type="ipo", reduce="mean")

    def forward(micro):
        return {**micro, **preference_logps(padded, None, micro, packed=False)}

    return recipe, forward, batch


@pytest.mark.parametrize("case", [_rl_case, _dpo_case])
def test_dpo_and_policy_gradient_recipes_share_one_update_function(case):
    lm = TinyLM(3)
    recipe, forward, batch = case(lm)
    rows = next(iter(batch.values())).shape[0]
    whole = update(recipe, forward, batch, [slice(0, rows)])
    want = [p.grad.clone() for p in lm.parameters()]
    lm.zero_grad(set_to_none=True)
    split = update(recipe, forward, batch, [slice(0, 1), slice(1, rows // 2), slice(rows // 2, rows)])
    # Global counts make the micro-batch losses and gradients add up to the whole batch's.
    torch.testing.assert_close(split, whole, rtol=1e-10, atol=1e-12)
    for p, w in zip(lm.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=1e-10, atol=1e-12)
    assert any(w.abs().sum() > 0 for w in want)


def test_every_recipe_has_loss_and_global_counts():
    for recipe in (algos.grpo(), algos.ppo(), algos.dapo(), algos.dpo(), algos.DPO()):
        assert callable(recipe.loss) and callable(recipe.global_counts)
    counts = algos.dpo().global_counts({"chosen_input_ids": torch.zeros(5, 3, dtype=torch.long)})
    assert counts == {"num_pairs": torch.tensor(5)} and counts["num_pairs"].dtype == torch.int64
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert algos.grpo().global_counts({"mask": mask}) == algos.global_counts(mask)
