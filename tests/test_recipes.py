import functools
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import algos, ops
from rlcore.algos import Algorithm, outcome_advantages
from rlcore.testing import assert_close, assert_no_host_sync
from rlcore.testing import reference as ref
from rlcore.testing.loss_strategies import microbatch_splits, recipe_batches
from rlcore.testing.reference.filters import dynamic_sampling_mask_ref
from rlcore.testing.reference.kl import kl_in_reward_ref, kl_penalty_ref
from rlcore.testing.reference.shaping import overlong_penalty_ref, scores_to_token_rewards_ref

# Small DAPO lengths so the overlong ramp is hit by T <= 8.
RECIPES = {
    "ppo": algos.ppo,
    "grpo": algos.grpo,
    "dr_grpo": partial(algos.dr_grpo, horizon=10),
    "dapo": partial(algos.dapo, max_length=6, cache_length=3),
    "gspo": algos.gspo,
    "reinforce_pp": algos.reinforce_pp,
    "rloo": algos.rloo,
}


def _on(x, mask):
    return torch.where(mask, x.double(), 0.0)


def _tokens(adv, mask):
    return torch.where(mask, adv[:, None], 0.0)


def _reference_loss(name, b):
    """Each recipe's loss, composed from the loop references with the published formulas."""
    lp, old, refl, mask, scores, ids = b["logp"], b["old_logp"], b["ref_logp"], b["mask"], b["scores"], b["group_ids"]
    if name == "ppo":
        rewards, _ = kl_in_reward_ref(scores_to_token_rewards_ref(scores, mask), old, refl, mask, kl_coef=0.02)
        adv, ret = ref.gae_ref(rewards, b["old_values"], mask, gamma=1.0, lam=0.95)
        adv = ref.batch_normalize_ref(adv, mask)
        pg, _, _ = ref.ppo_clip_loss_ref(lp, old, adv, mask)
        vf, _, _ = ref.value_loss_ref(b["values"], b["old_values"], ret, mask, clip=0.2)
        return ref.aggregate_ref(pg, mask) + 0.1 * ref.aggregate_ref(vf, mask)
    if name == "grpo":
        adv = _tokens(ref.grpo_advantages_ref(scores, ids, scale="group", eps=1e-6), mask)
        pg, _, _ = ref.ppo_clip_loss_ref(lp, old, adv, mask)
        kl = _on(kl_penalty_ref(_on(lp, mask), _on(refl, mask), estimator="k3"), mask)
        return ref.aggregate_ref(pg + 0.04 * kl, mask, mode="seq-mean-token-mean")
    if name == "dr_grpo":
        adv = _tokens(ref.grpo_advantages_ref(scores, ids, scale="none"), mask)
        pg, _, _ = ref.ppo_clip_loss_ref(lp, old, adv, mask)
        return ref.aggregate_ref(pg, mask, mode="seq-mean-token-sum-norm", horizon=10)
    if name == "dapo":
        kept = mask & dynamic_sampling_mask_ref(scores, ids)[:, None]
        shaped = scores.double() + overlong_penalty_ref(kept.sum(-1), max_length=6, cache_length=3)
        adv = _tokens(ref.grpo_advantages_ref(shaped, ids, scale="group", eps=1e-6), kept)
        pg, _, _ = ref.ppo_clip_loss_ref(lp, old, adv, kept, clip_low=0.2, clip_high=0.28)
        return ref.aggregate_ref(pg, kept, mode="token-mean")
    if name == "gspo":
        adv = _tokens(ref.grpo_advantages_ref(scores, ids, scale="group", eps=1e-6), mask)
        pg, _, _ = ref.gspo_loss_ref(lp, old, adv, mask)
        return ref.aggregate_ref(pg, mask, mode="seq-mean-token-mean")
    if name == "reinforce_pp":
        rewards, _ = kl_in_reward_ref(scores_to_token_rewards_ref(scores, mask), old, refl, mask, kl_coef=0.01)
        adv = ref.reinforce_pp_advantages_ref(rewards, mask)
        pg, _, _ = ref.ppo_clip_loss_ref(lp, old, adv, mask)
        return ref.aggregate_ref(pg, mask)
    if name == "rloo":
        seq_kl = _on(kl_penalty_ref(_on(old, mask), _on(refl, mask), estimator="k1"), mask).sum(-1)
        adv = _tokens(ref.rloo_advantages_ref(scores.double() - 0.05 * seq_kl, ids), mask)
        pg, _, _ = ref.ppo_clip_loss_ref(lp, old, adv, mask)
        return ref.aggregate_ref(pg, mask)
    raise AssertionError(name)


@pytest.mark.parametrize("name", list(RECIPES))
@settings(max_examples=15)
@given(batch=recipe_batches())
def test_recipe_loss_matches_the_composed_references(name, batch):
    algo = RECIPES[name]()
    loss, metrics = algo.loss(algo.advantages(batch))
    want = _reference_loss(name, batch)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    # float32 group statistics of close scores lose a few digits against float64.
    torch.testing.assert_close(loss.double(), torch.tensor(want, dtype=torch.float64), rtol=2e-4, atol=2e-5)
    assert all(not v.requires_grad for v in metrics.values())
    if name in ("dr_grpo", "dapo", "gspo", "reinforce_pp", "rloo"):
        torch.testing.assert_close(metrics["pg_loss"], loss.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_gradient_matches_finite_differences(name):
    g = torch.Generator().manual_seed(11)
    b, t = 6, 5
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 3:] = False
    mask[4, 2] = False
    logp = torch.rand(b, t, generator=g, dtype=torch.float64).clamp(min=0.05).log()
    batch = {
        "old_logp": logp + 0.1 * torch.randn(b, t, generator=g, dtype=torch.float64),
        "ref_logp": logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64),
        "scores": torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 0.0], dtype=torch.float64),
        "group_ids": torch.tensor([0, 0, 1, 1, 2, 2]),
        "old_values": torch.randn(b, t, generator=g, dtype=torch.float64),
        "mask": mask,
    }
    algo = RECIPES[name]()
    prepared = algo.advantages(batch)

    def loss_of(lp, values):
        return algo.loss({**prepared, "logp": lp, "values": values})[0]

    values = batch["old_values"] + 0.1 * torch.randn(b, t, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(loss_of, (logp.requires_grad_(True), values.requires_grad_(True)))


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo", "ppo"])
@settings(max_examples=15)
@given(batch=recipe_batches(dtype=torch.float64), data=st.data())
def test_microbatch_losses_and_gradients_add_up_to_the_whole_batch(name, batch, data):
    algo = RECIPES[name]()
    prepared = algo.advantages(batch)
    counts = algos.global_counts(prepared["mask"])
    logp = prepared["logp"].clone().requires_grad_(True)
    whole, _ = algo.loss({**prepared, "logp": logp}, **counts)
    whole.backward()
    parts = data.draw(microbatch_splits(logp.shape[0]), label="split")
    logp_mb = prepared["logp"].clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for idx in parts:
        micro = {k: v[idx] for k, v in prepared.items()}
        micro["logp"] = logp_mb[idx]
        total = total + algo.loss(micro, **counts)[0]
    total.backward()
    torch.testing.assert_close(total, whole, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(logp_mb.grad, logp.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo", "ppo", "rloo"])
@settings(max_examples=15)
@given(batch=recipe_batches(dtype=torch.float64), data=st.data())
def test_sequence_sharded_losses_and_gradients_add_up_to_the_whole_batch(name, batch, data):
    """Context parallelism: each token scored on one of ``cp`` ranks; loss(seq_tokens=) summed over them is the whole."""
    algo = RECIPES[name]()
    prepared = algo.advantages(batch)
    mask = prepared["mask"]
    logp = prepared["logp"].clone().requires_grad_(True)
    whole, _ = algo.loss({**prepared, "logp": logp})
    whole.backward()
    cp = data.draw(st.integers(2, 3), label="cp")
    owner = torch.tensor(data.draw(st.lists(st.integers(0, cp - 1), min_size=mask.numel(), max_size=mask.numel())))
    owner = owner.reshape(mask.shape)
    # What rlcore.algos.sequence_sharded_counts returns on every rank (its all-reduces done by hand).
    counts = {**algos.global_counts(mask), "seq_tokens": (mask != 0).sum(-1)}
    logp_cp = prepared["logp"].clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for rank in range(cp):
        local = {**prepared, "logp": logp_cp, "mask": mask & (owner == rank)}
        total = total + algo.loss(local, **counts)[0]
    total.backward()
    torch.testing.assert_close(total, whole, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(logp_cp.grad, logp.grad, rtol=1e-10, atol=1e-12)


def test_seq_tokens_needs_the_global_counts():
    algo = algos.grpo()
    batch = algo.advantages(
        {
            "scores": torch.tensor([1.0, 0.0]),
            "group_ids": torch.tensor([0, 0]),
            "mask": torch.ones(2, 3, dtype=torch.bool),
            "logp": torch.zeros(2, 3),
            "old_logp": torch.zeros(2, 3),
            "ref_logp": torch.zeros(2, 3),
        }
    )
    with pytest.raises(ValueError, match="seq_tokens: given without num_tokens and num_seqs"):
        algo.loss(batch, seq_tokens=torch.tensor([3, 3]))


@settings(max_examples=10)
@given(batch=recipe_batches())
def test_bfloat16_batch_matches_float32(batch):
    algo = algos.grpo()
    low = {k: v.to(torch.bfloat16) if v.is_floating_point() and v.dim() == 2 else v for k, v in batch.items()}
    # The float32 run sees the same bf16-rounded inputs: only the arithmetic differs.
    want, _ = algo.loss(algo.advantages({k: v.float() if v.dtype == torch.bfloat16 else v for k, v in low.items()}))
    got, _ = algo.loss(algo.advantages(low))
    assert got.dtype == torch.bfloat16
    assert_close(got, want.double(), dtype=torch.bfloat16, scale=max(1.0, abs(float(want))))


def test_on_policy_grpo_gradient_is_the_length_normalised_policy_gradient():
    # logp == old_logp == ref_logp: the KL term and its gradient vanish and each token
    # gets -A_i / (|o_i| * number of sequences).
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.5, 0.5, 0.5]], dtype=torch.float64)).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    batch = {
        "logp": logp,
        "old_logp": logp.detach(),
        "ref_logp": logp.detach(),
        "scores": torch.tensor([1.0, 0.0], dtype=torch.float64),
        "group_ids": torch.tensor([0, 0]),
        "mask": mask,
    }
    loss, metrics = algos.grpo().loss(algos.grpo().advantages(batch))
    loss.backward()
    a = 0.5 / (0.5**0.5 + 1e-6)  # (1 - 0.5) / (unbiased std of {1, 0} + eps)
    want = torch.tensor([[-a / 4, -a / 4, 0.0], [a / 6, a / 6, a / 6]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, want)
    assert float(metrics["kl"]) == 0.0


def test_dapo_drops_groups_whose_scores_are_all_equal():
    batch = {
        "logp": torch.zeros(4, 2),
        "old_logp": torch.zeros(4, 2),
        "scores": torch.tensor([1.0, 1.0, 1.0, 0.0]),
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "mask": torch.ones(4, 2, dtype=torch.bool),
    }
    prepared = algos.dapo().advantages(batch)
    assert prepared["mask"].tolist() == [[False, False], [False, False], [True, True], [True, True]]
    counts = algos.global_counts(prepared["mask"])
    assert int(counts["num_tokens"]) == 4 and int(counts["num_seqs"]) == 2
    # On-policy PPO loss is -A; the kept group has advantages +-1/(std + eps), mean 0.
    loss, _ = algos.dapo().loss(prepared, **counts)
    assert abs(float(loss)) < 1e-6


def test_replacing_one_part_makes_a_new_algorithm():
    gspo_from_grpo = algos.grpo()._replace(policy_loss=partial(algos.gspo_loss), kl=None, kl_coef=0.0)
    assert gspo_from_grpo.agg_mode == algos.gspo().agg_mode
    g = torch.Generator().manual_seed(5)
    batch = {
        "logp": torch.randn(4, 3, generator=g) - 2,
        "old_logp": torch.randn(4, 3, generator=g) - 2,
        "scores": torch.tensor([1.0, 0.0, 0.3, 0.9]),
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "mask": torch.ones(4, 3, dtype=torch.bool),
    }
    torch.testing.assert_close(
        gspo_from_grpo.loss(gspo_from_grpo.advantages(batch))[0], algos.gspo().loss(algos.gspo().advantages(batch))[0]
    )
    assert algos.grpo().policy_loss.func is algos.ppo_clip_loss


def test_a_custom_algorithm_in_under_twenty_lines():
    # --- the user's code: CISPO on RLOO advantages with a length-capped REINFORCE bonus ---
    def capped_bonus_loss(logp, old_logp, advantages, mask):
        loss_t, metrics = algos.cispo_loss(logp, old_logp, advantages, mask, clip_high=1.0)
        return loss_t - 0.01 * torch.where(mask, logp, 0.0).clamp(min=-5.0), metrics

    my_algo = algos.grpo()._replace(
        advantage_estimator=partial(outcome_advantages, estimator=algos.rloo_advantages),
        policy_loss=capped_bonus_loss,
        kl_coef=0.0,
        agg_mode="token-mean",
    )
    # --- end of the user's code ---
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.5]])).requires_grad_(True)
    batch = {
        "logp": logp,
        "old_logp": logp.detach(),
        "scores": torch.tensor([1.0, 0.0]),
        "group_ids": torch.tensor([0, 0]),
        "mask": torch.tensor([[True, True], [True, False]]),
    }
    loss, _ = my_algo.loss(my_algo.advantages(batch))
    # RLOO advantages +1 / -1; per token -A logp - 0.01 logp over 3 counted tokens.
    l2, l4 = torch.log(torch.tensor(0.5)), torch.log(torch.tensor(0.25))
    want = ((-l2 - 0.01 * l2) * 2 + (l4 - 0.01 * l4)) / 3
    torch.testing.assert_close(loss, want)


def test_entropy_bonus_and_is_weights():
    g = torch.Generator().manual_seed(9)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    batch = {
        "logp": torch.randn(2, 3, generator=g) - 1,
        "old_logp": torch.randn(2, 3, generator=g) - 1,
        "advantages": torch.randn(2, 3, generator=g),
        "entropy": torch.where(mask, torch.rand(2, 3, generator=g), float("nan")),
        "is_weights": torch.rand(2, 3, generator=g),
        "mask": mask,
    }
    algo = Algorithm(advantage_estimator=None, policy_loss=algos.ppo_clip_loss, entropy_coef=0.1)
    loss, metrics = algo.loss(batch)
    pg, _ = algos.ppo_clip_loss(
        batch["logp"], batch["old_logp"], batch["advantages"], mask, is_weights=batch["is_weights"]
    )
    want = algos.aggregate(pg - 0.1 * torch.where(mask, batch["entropy"], 0.0), mask)
    torch.testing.assert_close(loss, want)
    assert_close(metrics["entropy"], batch["entropy"][mask].double().mean())


def test_bad_batches_raise_value_error():
    algo = algos.grpo()
    batch = {"logp": torch.zeros(2, 2), "old_logp": torch.zeros(2, 2), "mask": torch.ones(2, 2)}
    with pytest.raises(ValueError, match="'scores'"):
        algo.advantages(batch)
    with pytest.raises(ValueError, match="expected a 'advantages' entry \\(call algo.advantages\\(batch\\)"):
        algo.loss({**batch, "scores": torch.zeros(2), "group_ids": torch.zeros(2, dtype=torch.long)})
    full = {**batch, "advantages": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match="'ref_logp'"):
        algo.loss(full)
    with pytest.raises(ValueError, match="mode: got 'mean'.*'token-mean'"):
        algo._replace(agg_mode="mean", kl_coef=0.0).loss(full)
    with pytest.raises(ValueError, match="kl: got None"):
        algo._replace(kl=None).loss(full)


@pytest.mark.parametrize("name", ["grpo", "ppo", "dapo"])
def test_whole_recipe_loss_has_no_host_sync(name):
    g = torch.Generator().manual_seed(4)
    b, t = 8, 6
    mask = torch.rand(b, t, generator=g) > 0.2
    logp = torch.rand(b, t, generator=g).clamp(min=0.05).log()
    batch = {
        "logp": logp,
        "old_logp": logp + 0.1 * torch.randn(b, t, generator=g),
        "ref_logp": logp + 0.1 * torch.randn(b, t, generator=g),
        "scores": torch.randint(0, 2, (b,), generator=g).float(),
        "group_ids": torch.arange(b) // 4,
        "values": torch.randn(b, t, generator=g),
        "old_values": torch.randn(b, t, generator=g),
        "mask": mask,
    }
    algo = RECIPES[name]()
    assert_no_host_sync(lambda b: algo.loss(algo.advantages(b), **algo.global_counts(b)), batch)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_nan_padding_reaches_neither_loss_nor_gradient(estimator):
    mask = torch.tensor([[True, True, False], [True, False, False]])
    nan_pad = functools.partial(torch.where, mask, other=float("nan"))
    logp = nan_pad(torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])).requires_grad_(True)
    batch = {
        "logp": logp,
        "old_logp": nan_pad(torch.tensor([[-1.1, -1.9, 0.0], [-0.4, 0.0, 0.0]])),
        "ref_logp": nan_pad(torch.tensor([[-1.5, -1.0, 0.0], [-0.7, 0.0, 0.0]])),
        "advantages": nan_pad(torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])),
        "entropy": nan_pad(torch.tensor([[0.5, 0.7, 0.0], [0.2, 0.0, 0.0]])),
        "mask": mask,
    }
    algo = algos.grpo(kl_estimator=estimator)._replace(entropy_coef=0.01)
    loss, metrics = algo.loss(batch)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    assert torch.isfinite(logp.grad).all()
    assert torch.all(logp.grad[~mask] == 0)


def test_end_to_end_from_logits_with_the_ops_entropy_bonus():
    # logp and entropy come from one pass of rlcore.ops; the gradient reaching the
    # logits matches plain log_softmax autograd through the same recipe.
    g = torch.Generator().manual_seed(8)
    b, t, v = 4, 5, 7
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    base = {
        "old_logp": torch.randn(b, t, generator=g, dtype=torch.float64) * 0.1 - 2.0,
        "ref_logp": torch.randn(b, t, generator=g, dtype=torch.float64) * 0.1 - 2.0,
        "scores": torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64),
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "mask": mask,
    }
    algo = algos.grpo()._replace(entropy_coef=0.01)

    def grad_of(use_ops):
        x = logits.clone().requires_grad_(True)
        if use_ops:
            logp, entropy = ops.logprobs_from_logits(x, labels, with_entropy=True)
        else:
            logq = torch.log_softmax(x, dim=-1)
            logp = logq.gather(-1, labels[..., None]).squeeze(-1)
            entropy = -(logq.exp() * logq).sum(-1)
        loss, metrics = algo.loss(algo.advantages({**base, "logp": logp, "entropy": entropy}))
        loss.backward()
        return x.grad, metrics

    got, metrics = grad_of(True)
    want, _ = grad_of(False)
    torch.testing.assert_close(got, want)
    assert float(metrics["entropy"]) > 0
