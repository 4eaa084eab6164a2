"""The GDPO and on-policy-distillation recipes against their composed loop references, and the
new policy losses plugged into an existing recipe with ``_replace``."""

from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import algos
from rlcore.testing import assert_no_host_sync
from rlcore.testing import reference as ref
from rlcore.testing.loss_strategies import microbatch_splits, recipe_batches
from rlcore.testing.reference.kl import kl_in_reward_ref
from rlcore.testing.reference.shaping import scores_to_token_rewards_ref


def _with_components(batch, k):
    g = torch.Generator().manual_seed(int(batch["group_ids"].sum()))
    extra = torch.randint(0, 2, (batch["scores"].shape[0], k - 1), generator=g).float()
    return {**batch, "scores": torch.cat([batch["scores"][:, None], extra], -1)}


@settings(max_examples=15, deadline=None)
@given(batch=recipe_batches(dtype=torch.float64), k=st.integers(1, 3))
def test_gdpo_recipe_matches_composed_references(batch, k):
    batch = _with_components(batch, k)
    algo = algos.gdpo()
    prepared = algo.advantages(batch)
    mask = batch["mask"]
    adv = torch.where(mask, ref.gdpo_advantages_ref(batch["scores"], batch["group_ids"])[:, None], 0.0)
    torch.testing.assert_close(prepared["advantages"], adv.to(prepared["advantages"].dtype), rtol=1e-5, atol=1e-6)
    loss, _ = algo.loss(prepared, **algo.global_counts(prepared))
    pg, _, _ = ref.ppo_clip_loss_ref(batch["logp"], batch["old_logp"], prepared["advantages"], mask)
    # The advantages are float32 (the scores' dtype): the loss carries their rounding.
    torch.testing.assert_close(loss, torch.tensor(ref.aggregate_ref(pg, mask), dtype=loss.dtype), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gamma", [0.0, 1.0])
@settings(max_examples=15, deadline=None)
@given(batch=recipe_batches(dtype=torch.float64), coef=st.sampled_from([0.5, 1.0]), task=st.booleans())
def test_on_policy_distillation_matches_composed_references(gamma, batch, coef, task):
    """The teacher (in ``ref_logp``) rewards each token by minus its reverse-KL estimate."""
    if not task:
        batch = {**batch, "scores": torch.zeros_like(batch["scores"])}
    algo = algos.on_policy_distillation(teacher_coef=coef, gamma=gamma)
    assert algos.scoring_needs(algo) == algos.ScoringNeeds(old_logp=True, ref_logp=True)
    prepared = algo.advantages(batch)
    mask = batch["mask"]
    rewards, _ = kl_in_reward_ref(
        scores_to_token_rewards_ref(batch["scores"], mask), batch["old_logp"], batch["ref_logp"], mask, kl_coef=coef
    )
    adv = ref.reinforce_pp_advantages_ref(rewards, mask, gamma=gamma)
    torch.testing.assert_close(prepared["advantages"], adv.to(prepared["advantages"].dtype), rtol=1e-5, atol=1e-6)
    loss, _ = algo.loss(prepared, **algo.global_counts(prepared))
    pg, _, _ = ref.ppo_clip_loss_ref(batch["logp"], batch["old_logp"], adv, mask)
    # The advantages are float32 (the scores' dtype): the loss carries their rounding.
    torch.testing.assert_close(loss, torch.tensor(ref.aggregate_ref(pg, mask), dtype=loss.dtype), rtol=1e-5, atol=1e-6)


LOSSES = {
    "dppo_tv": algos.dppo_tv_loss,
    "dppo_kl": algos.dppo_kl_loss,
    "dro": partial(algos.dro_loss, beta=0.1),
    "kl_cov": partial(algos.kl_cov_loss, cov_fraction=0.2),
}


@pytest.mark.parametrize("name", list(LOSSES))
@settings(max_examples=10, deadline=None)
@given(batch=recipe_batches(dtype=torch.float64), data=st.data())
def test_new_losses_in_grpo_add_up_over_micro_batches(name, batch, data):
    """Token-local losses keep the recipe's micro-batch invariance (KL-Cov's selection is
    batch-wide, so it is checked on a whole-batch call only)."""
    algo = algos.grpo()._replace(policy_loss=LOSSES[name])
    prepared = algo.advantages(batch)
    counts = algo.global_counts(prepared)
    logp = prepared["logp"].clone().requires_grad_(True)
    whole, _ = algo.loss({**prepared, "logp": logp}, **counts)
    whole.backward()
    assert torch.isfinite(whole) and torch.isfinite(logp.grad).all()
    if name == "kl_cov":
        return
    logp_mb = prepared["logp"].clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for idx in data.draw(microbatch_splits(logp.shape[0]), label="split"):
        total = total + algo.loss({**{k: v[idx] for k, v in prepared.items()}, "logp": logp_mb[idx]}, **counts)[0]
    total.backward()
    torch.testing.assert_close(total, whole, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(logp_mb.grad, logp.grad, rtol=1e-10, atol=1e-12)


def test_new_recipes_have_no_host_sync():
    g = torch.Generator().manual_seed(0)
    b, t = 8, 5
    batch = {
        "scores": torch.rand(b, 2, generator=g),
        "group_ids": torch.arange(b) // 4,
        "mask": torch.rand(b, t, generator=g) > 0.2,
        "old_logp": -torch.rand(b, t, generator=g),
        "ref_logp": -torch.rand(b, t, generator=g),
    }
    batch["logp"] = batch["old_logp"] + 0.1

    def step(algo, batch):
        prepared = algo.advantages(batch)
        return algo.loss(prepared, **algo.global_counts(prepared))

    gdpo = algos.gdpo()._replace(
        advantage_estimator=partial(algos.outcome_advantages, estimator=partial(algos.gdpo_advantages, group_size=4))
    )
    assert_no_host_sync(partial(step, gdpo), batch)
    distill = {**batch, "scores": batch["scores"][:, 0]}
    assert_no_host_sync(partial(step, algos.on_policy_distillation()), distill)
    logits = {"logits": torch.randn(b, t, 6, generator=g), "teacher_logits": torch.randn(b, t, 6, generator=g)}
    for beta, top_k in ((0.0, None), (0.5, 3)):
        jsd = algos.on_policy_distillation(loss="jsd", beta=beta, top_k=top_k)
        assert_no_host_sync(partial(step, jsd), {**distill, **logits})


@settings(max_examples=15, deadline=None)
@given(batch=recipe_batches(dtype=torch.float64), coef=st.sampled_from([0.5, 1.0]), task=st.sampled_from([0.0, 1.0]))
def test_on_policy_distillation_reverse_kl_matches_the_distillation_loss(batch, coef, task):
    """``loss="reverse_kl"``: GRPO on ``task * scores`` plus ``coef`` times the sampled-token reverse KL, whose
    value and gradient are :func:`rlcore.algos.reverse_kl_distill_loss`'s (on-policy: no ratio weight)."""
    algo = algos.on_policy_distillation(teacher_coef=coef, task_coef=task, loss="reverse_kl")
    assert algos.scoring_needs(algo) == algos.ScoringNeeds(old_logp=False, ref_logp=True)
    prepared = algo.advantages(batch)
    mask = batch["mask"]
    adv = ref.grpo_advantages_ref(task * batch["scores"], batch["group_ids"])[:, None].expand_as(mask)
    torch.testing.assert_close(prepared["advantages"], torch.where(mask, adv, 0.0).to(prepared["advantages"].dtype))
    logp = batch["logp"].clone().requires_grad_(True)
    loss, _ = algo.loss({**prepared, "logp": logp}, **algo.global_counts(prepared))
    loss.backward()
    pg, pg_grad, _ = ref.ppo_clip_loss_ref(batch["logp"], batch["old_logp"], prepared["advantages"], mask)
    kl, kl_grad, _ = ref.reverse_kl_distill_loss_ref(batch["logp"], batch["ref_logp"], mask)
    n = max(float(mask.sum()), 1.0)
    expected = ref.aggregate_ref(pg, mask) + coef * ref.aggregate_ref(kl, mask)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=loss.dtype), rtol=1e-5, atol=1e-6)
    grad = torch.where(mask, (pg_grad + coef * kl_grad) / n, 0.0)
    torch.testing.assert_close(logp.grad, grad.to(logp.grad.dtype), rtol=1e-5, atol=1e-6)


@settings(max_examples=15, deadline=None)
@given(
    batch=recipe_batches(dtype=torch.float64),
    coef=st.sampled_from([0.5, 1.0]),
    task=st.sampled_from([0.0, 1.0]),
    beta=st.sampled_from([0.0, 0.5, 1.0]),
    vocab=st.integers(2, 6),
)
def test_on_policy_distillation_jsd_adds_the_full_vocabulary_loss(batch, coef, task, beta, vocab):
    """``loss="jsd"``: GRPO on ``task * scores`` plus ``coef`` times the token mean of GKD's JSD at ``beta`` between
    the student's and the teacher's logits, in value and in the logits' gradient."""
    algo = algos.on_policy_distillation(teacher_coef=coef, task_coef=task, loss="jsd", beta=beta)
    assert algos.scoring_needs(algo) == algos.ScoringNeeds(old_logp=False, ref_logp=False, logits=True)
    mask = batch["mask"]
    g = torch.Generator().manual_seed(int(batch["group_ids"].sum()) + vocab)
    logits = torch.randn(*mask.shape, vocab, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(*mask.shape, vocab, generator=g, dtype=torch.float64)
    prepared = algo.advantages(batch)
    loss, metrics = algo.loss({**prepared, "logits": logits, "teacher_logits": teacher}, **algo.global_counts(prepared))
    loss.backward()
    pg, _, _ = ref.ppo_clip_loss_ref(batch["logp"], batch["old_logp"], prepared["advantages"], mask)
    jsd = ref.generalized_jsd_loss_ref(logits.detach(), teacher, mask, beta=beta)
    expected = ref.aggregate_ref(pg, mask) + coef * ref.aggregate_ref(jsd, mask)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=loss.dtype), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["distill"], torch.tensor(ref.aggregate_ref(jsd, mask), dtype=loss.dtype))
    # The logits' gradient is the JSD's alone, scaled by coef over the counted tokens.
    copy = logits.detach().clone().requires_grad_(True)
    jsd_t, _ = algos.generalized_jsd_loss(copy, teacher, mask, beta=beta)
    (coef * algos.aggregate(jsd_t, mask, mode="token-mean")).backward()
    torch.testing.assert_close(logits.grad, copy.grad)


def test_the_distillation_term_needs_the_teachers_logits():
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 3, dtype=torch.bool)
    algo = algos.on_policy_distillation(loss="jsd", task_coef=0.0)
    rows = {
        "scores": torch.zeros(4),
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "mask": mask,
        "logp": torch.zeros(4, 3),
        "old_logp": torch.zeros(4, 3),
        "logits": torch.randn(4, 3, 5, generator=g),
    }
    prepared = algo.advantages(rows)
    with pytest.raises(ValueError, match="teacher_logits"):
        algo.loss(prepared)
    with pytest.raises(ValueError, match="beta: got 1.5"):
        algos.on_policy_distillation(loss="jsd", beta=1.5)
    with pytest.raises(ValueError, match="top_k: got 0"):
        algos.on_policy_distillation(loss="jsd", top_k=0)


@settings(max_examples=20, deadline=None)
@given(batch=recipe_batches(), coef=st.floats(0.0, 4.0))
def test_score_scaling_scales_the_scores_only(batch, coef):
    out = algos.score_scaling(batch, coef=coef)
    expected = torch.tensor([coef * s for s in batch["scores"].double().tolist()], dtype=torch.float64)
    torch.testing.assert_close(out["scores"], expected.to(batch["scores"].dtype))
    assert all(out[k] is v for k, v in batch.items() if k != "scores")
    assert algos.score_scaling(batch, coef=1.0) is batch


def test_on_policy_distillation_options_are_checked():
    with pytest.raises(ValueError, match="loss: got 'kl'"):
        algos.on_policy_distillation(loss="kl")
    with pytest.raises(ValueError, match="task_coef: got -1"):
        algos.on_policy_distillation(task_coef=-1.0)


def test_reverse_kl_distillation_has_no_host_sync():
    g = torch.Generator().manual_seed(0)
    b, t = 8, 5
    batch = {
        "scores": torch.rand(b, generator=g),
        "group_ids": torch.arange(b) // 4,
        "mask": torch.rand(b, t, generator=g) > 0.2,
        "old_logp": -torch.rand(b, t, generator=g),
        "ref_logp": -torch.rand(b, t, generator=g),
    }
    batch["logp"] = batch["old_logp"] + 0.1
    algo = algos.on_policy_distillation(loss="reverse_kl", task_coef=0.5)

    def step(batch):
        prepared = algo.advantages(batch)
        return algo.loss(prepared, **algo.global_counts(prepared))

    assert_no_host_sync(step, batch)
