"""Regression tests for the maths defects found by adversarial probing (one test per defect, named after it)."""

import math

import pytest
import torch

from rlcore import algos, ops
from rlcore.testing import reference as ref

POLICY_LOSSES = ["ppo_clip_loss", "gspo_loss", "cispo_loss", "gpg_loss", "sapo_loss", "gmpo_loss", "reinforce_loss"]


# Defect 4 -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_defect_04_non_finite_score_stays_in_its_own_group(bad, scale):
    scores = torch.tensor([1.0, 0.0, 0.5, bad, 2.0, 5.0, 3.0, 3.0])
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    adv = algos.grpo_advantages(scores, ids, scale=scale)
    clean = torch.tensor([True, True, False, False, True, True, True, True])
    # The poisoned group is non-finite, never a silent number; every other group is
    # what it would be without the non-finite score in the batch statistics.
    assert not torch.isfinite(adv[~clean]).any()
    want = algos.grpo_advantages(scores[clean], ids[clean], scale="none" if scale == "batch" else scale)
    if scale == "batch":
        want = want / (scores[torch.isfinite(scores)].std() + 1e-6)
    torch.testing.assert_close(adv[clean], want)
    assert adv[clean].abs().max() < 10  # not inflated ~1e6-fold by eps alone


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_defect_04_segment_std_of_a_non_finite_group_is_nan_not_zero(bad):
    x = torch.tensor([1.0, 3.0, bad, 2.0, 7.0, 7.0])
    ids = torch.tensor([0, 0, 1, 1, 2, 2])
    std = ops.segment_std(x, ids)
    assert torch.isnan(std[1])
    torch.testing.assert_close(std[[0, 2]], torch.tensor([math.sqrt(2.0), 0.0]))
    mean, std2 = ops.segment_mean_std(x, ids)
    assert torch.isnan(std2[1]) and torch.isfinite(mean[[0, 2]]).all()


# Defect 5 -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", POLICY_LOSSES)
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_defect_05_policy_losses_on_an_empty_batch_give_zero(name, shape):
    empty = torch.zeros(shape)
    logp = empty.clone().requires_grad_(True)
    loss_t, metrics = getattr(algos, name)(logp, empty, empty, torch.zeros(shape, dtype=torch.bool))
    for mode in algos.AGGREGATION_MODES:
        loss = algos.aggregate(loss_t, torch.zeros(shape, dtype=torch.bool), mode=mode)
        assert loss.item() == 0.0, mode
    loss.backward()
    assert logp.grad is not None and logp.grad.shape == shape
    assert all(v.item() == 0.0 for v in metrics.values())


def test_defect_05_aggregate_over_zero_tokens_is_zero_in_every_mode():
    for mode in algos.AGGREGATION_MODES:
        assert algos.aggregate(torch.zeros(2, 0), torch.zeros(2, 0), mode=mode).item() == 0.0, mode


@pytest.mark.parametrize("recipe", ["dapo", "grpo", "ppo"])
def test_defect_05_recipe_loss_on_the_empty_batch_dynamic_sampling_leaves(recipe):
    # Every group has equal scores: DAPO's dynamic sampling keeps no sample.
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0])
    ids = torch.tensor([0, 0, 1, 1])
    keep = algos.dynamic_sampling_indices(scores, ids)
    batch = {
        "scores": scores,
        "group_ids": ids,
        "mask": torch.ones(4, 3, dtype=torch.bool),
        "old_logp": -torch.ones(4, 3),
        "ref_logp": -torch.ones(4, 3),
        "old_values": torch.zeros(4, 3),
        "values": torch.zeros(4, 3),
    }
    empty = {k: v[keep] for k, v in batch.items()}
    assert empty["scores"].shape == (0,)
    algo = getattr(algos, recipe)()
    prepared = algo.advantages(empty)
    logp = prepared["old_logp"].clone().requires_grad_(True)
    loss, metrics = algo.loss({**prepared, "logp": logp}, **algo.global_counts(prepared))
    loss.backward()
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())


def test_defect_05_dpo_recipe_on_zero_pairs_is_zero():
    recipe = algos.dpo()
    batch = {k: torch.zeros(0) for k in algos.PAIR_LOGP_COLUMNS}
    loss, metrics = recipe.loss(batch, **recipe.global_counts(batch))
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())


# Defect 6 -------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [1e10, 1e20, 1e30])
def test_defect_06_large_score_spread_keeps_its_advantages(factor):
    base = torch.tensor([1.0, 0.0, 0.25, 0.5, 3.0, 3.0])
    ids = torch.tensor([0, 0, 1, 1, 2, 2])
    scores = base * factor
    for scale in ("group", "batch"):
        got = algos.grpo_advantages(scores, ids, scale=scale)
        # Scale-invariant up to eps: the advantages of scores * factor are those of scores.
        want = algos.grpo_advantages(base.double(), ids, scale=scale, eps=1e-6 / factor).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert got.abs().max() > 0.05  # not silently zeroed
    torch.testing.assert_close(ops.segment_std(scores, ids)[:2], torch.stack([scores[:2].std(), scores[2:4].std()]))
    # Token-level whitening (REINFORCE++-baseline, batch_normalize) and the masked statistics.
    mask = torch.ones(6, 2, dtype=torch.bool)
    tokens = algos.reinforce_pp_baseline_advantages(scores, ids, mask)
    torch.testing.assert_close(tokens, algos.reinforce_pp_baseline_advantages(base, ids, mask), rtol=1e-5, atol=1e-5)
    x = torch.tensor([0.0, 1.0, 2.0]) * factor
    torch.testing.assert_close(ops.masked_var(x, torch.ones(3)), x.var())
    torch.testing.assert_close(ops.masked_whiten(x, torch.ones(3)), torch.tensor([-1.0, 0.0, 1.0]))


def test_defect_06_matches_torch_std_where_finite():
    g = torch.Generator().manual_seed(0)
    for exponent in (0, 15, 19, 20, 25, 30, 35):
        x = torch.randn(12, generator=g) * 10.0**exponent
        ids = torch.arange(12) // 4
        want = torch.stack([x[ids == k].std() for k in range(3)])
        if torch.isfinite(want).all():
            torch.testing.assert_close(ops.segment_std(x, ids), want, rtol=1e-5, atol=0)


# Defect 11 ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", POLICY_LOSSES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_defect_11_policy_losses_stay_finite_in_half_precision_over_the_clamp_range(name, dtype):
    log_ratio = torch.linspace(-20.0, 20.0, 41)[None, :].expand(4, -1)
    advantages = torch.tensor([-5.0, -1.0, 1.0, 5.0])[:, None].expand(-1, 41)
    old = torch.full((4, 41), -1.0, dtype=dtype)
    logp = (old.float() + log_ratio).to(dtype).requires_grad_(True)
    mask = torch.ones(4, 41, dtype=torch.bool)
    loss_t, metrics = getattr(algos, name)(logp, old, advantages.to(dtype), mask)
    assert loss_t.dtype == dtype and torch.isfinite(loss_t).all()
    for mode in algos.AGGREGATION_MODES:
        loss = algos.aggregate(loss_t, mask, mode=mode)
        assert torch.isfinite(loss), mode
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())


# Defect 12 ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_defect_12_non_finite_kl_never_poisons_the_adaptive_controller(bad):
    ctrl = algos.adaptive_kl_controller(init_kl_coef=0.1, target=1.0, horizon=100)
    state = ctrl.init()
    state = ctrl.update(torch.tensor(bad), state, n_steps=10)
    assert state.kl_coef.item() == pytest.approx(0.1)
    state = ctrl.update(bad, state, n_steps=10)
    state = ctrl.update(torch.tensor(2.0), state, n_steps=50)
    want = ref.adaptive_kl_coefs_ref([2.0], [50], init_kl_coef=0.1, target=1.0, horizon=100)[-1]
    assert state.kl_coef.item() == pytest.approx(want)
    with pytest.raises(ValueError, match="n_steps"):
        ctrl.update(torch.tensor(1.0), state, n_steps=-1)


# Defect 13 ------------------------------------------------------------------------------


@pytest.mark.parametrize("ids", [[0, 0, 1, -1], [0, 0, 1, 4], [0, 0, 1, 2**40]])
def test_defect_13_bad_group_ids_name_group_ids(ids):
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    group_ids = torch.tensor(ids)
    for fn in (
        algos.grpo_advantages,
        algos.rloo_advantages,
        algos.gpg_advantages,
        algos.dynamic_sampling_mask,
    ):
        with pytest.raises(ValueError, match="group_ids"):
            fn(scores, group_ids)
    with pytest.raises(ValueError, match="group_ids"):
        algos.reinforce_pp_baseline_advantages(scores, group_ids, torch.ones(4, 2))
    with pytest.raises(ValueError, match="group_ids"):
        ops.segment_mean(scores, group_ids, num_segments=3)
    if min(ids) < 0:
        with pytest.raises(ValueError, match="group_ids"):
            ops.segment_std(scores, group_ids)


@pytest.mark.parametrize("bad", [math.nan, -1.0])
def test_defect_13_nan_and_negative_hyperparameters_are_rejected(bad):
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    s = torch.tensor([1.0, 0.0])
    ids = torch.tensor([0, 0])
    cases = {
        "eps": lambda: algos.grpo_advantages(s, ids, eps=bad),
        "lam": lambda: algos.gae(x, x, m, lam=bad),
        "gamma": lambda: algos.gae(x, x, m, gamma=bad),
        "clip_high": lambda: algos.ppo_clip_loss(x, x, x, m, clip_high=bad),
        "clip_low": lambda: algos.ppo_clip_loss(x, x, x, m, clip_low=bad),
        "beta": lambda: algos.dpo_loss(s, s, s, s, beta=bad),
        "num_tokens": lambda: algos.aggregate(x, m, num_tokens=bad),
        "num_seqs": lambda: algos.aggregate(x, m, num_seqs=torch.tensor(bad)),
        "horizon": lambda: algos.aggregate(x, m, mode="seq-mean-token-sum-norm", horizon=bad),
        "kl_coef": lambda: algos.fixed_kl_controller(kl_coef=bad),
        "num_pairs": lambda: algos.dpo().loss(dict.fromkeys(algos.PAIR_LOGP_COLUMNS, s), num_pairs=bad),
    }
    for name, call in cases.items():
        with pytest.raises(ValueError, match=name):
            call()


def test_defect_13_integer_losses_are_rejected():
    with pytest.raises(ValueError, match="loss_t: got dtype torch.int64"):
        algos.aggregate(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3))


# Re-probe ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_reprobe_saturating_cast_refuses_an_integer_target(dtype):
    # 1e20 "saturated" to int32 came back as -2147483648: the cast wrapped, contrary to its name.
    with pytest.raises(ValueError, match="dtype: got torch"):
        ops.saturating_cast(torch.tensor([1e20]), dtype)


@pytest.mark.parametrize("bad", ["0.2", None, [0.2], algos.KLControllerState(torch.tensor(0.2))])
def test_reprobe_hyperparameters_of_the_wrong_type_name_the_argument(bad):
    # A string from a YAML file, or a controller state, gave "'>' not supported between ..." TypeErrors.
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_low: got"):
        algos.ppo_clip_loss(x, x, x, torch.ones(2, 3), clip_low=bad)
    with pytest.raises(ValueError, match="beta: got"):
        algos.dpo_loss(x[0], x[0], x[0], x[0], beta=bad)


# Issue 30: silently accepted inputs -------------------------------------------------------


@pytest.mark.parametrize("side", ["pi_chosen", "pi_rejected"])
def test_reprobe30_orpo_refuses_positive_log_probs(side):
    good = {"pi_chosen": torch.tensor([-0.5, -1.0]), "pi_rejected": torch.tensor([-2.0, -1.5])}
    bad = {**good, side: torch.tensor([-0.5, 0.25])}
    with pytest.raises(ValueError, match=rf"{side}: got log-probs up to 0.25, expected average log-probabilities <= 0"):
        algos.orpo_loss(bad["pi_chosen"], bad["pi_rejected"], torch.ones(2))
    # 0 itself (a certain token) and rounding within the dtype's epsilon stay accepted.
    edge = torch.tensor([0.0, torch.finfo(torch.float32).eps])
    loss, _ = algos.orpo_loss(edge, good["pi_rejected"], torch.ones(2))
    assert torch.isfinite(loss).all()


@pytest.mark.parametrize("label", [0.5, -1.0, 2.0, math.nan])
def test_reprobe30_kto_refuses_labels_other_than_zero_and_one(label):
    logp = torch.tensor([-4.0, -9.0])
    kl = torch.tensor([-3.0])
    with pytest.raises(ValueError, match=r"desirable: got .*, expected bool labels or 0/1"):
        algos.kto_loss(logp, logp - 1, torch.tensor([1.0, label]), kl, kl)
    # 0/1 floats and ints mean the same as bools.
    want, _ = algos.kto_loss(logp, logp - 1, torch.tensor([True, False]), kl, kl)
    for labels in (torch.tensor([1.0, 0.0]), torch.tensor([1, 0])):
        torch.testing.assert_close(algos.kto_loss(logp, logp - 1, labels, kl, kl)[0], want)


def test_reprobe30_batch_moments_refuses_negative_weights():
    x = torch.tensor([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"weights: got values in \[-1.0, 1.0\], expected counts >= 0"):
        algos.batch_moments(x, torch.tensor([1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match=r"weights: got shape \(2\), expected \(3\)"):
        algos.batch_moments(x, torch.ones(2))
    _, count, mean, m2 = algos.batch_moments(x, torch.tensor([1.0, 0.0, 1.0]))
    assert (float(count), float(mean), float(m2)) == (2.0, 2.0, 2.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_reprobe30_dynamic_sampling_drops_groups_with_a_non_finite_score(bad):
    # Group 1 has different scores only because of the non-finite one: its advantages are NaN.
    scores = torch.tensor([1.0, 0.0, 0.5, bad, 2.0, 2.0, 3.0, 1.0])
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    keep = algos.dynamic_sampling_mask(scores, ids)
    assert keep.tolist() == [True, True, False, False, False, False, True, True]
    assert algos.dynamic_sampling_indices(scores, ids).tolist() == [0, 1, 6, 7]
    batch = {"scores": scores, "group_ids": ids, "mask": torch.ones(8, 3)}
    filtered = algos.dynamic_sampling_filter(batch)
    assert filtered["mask"].sum(-1).tolist() == [3, 3, 0, 0, 0, 0, 3, 3]


def test_reprobe30_dynamic_sampling_with_nan_compiles_fullgraph():
    fn = torch.compile(algos.dynamic_sampling_mask, fullgraph=True, backend="eager")
    scores = torch.tensor([1.0, math.nan, 0.0, 1.0])
    ids = torch.tensor([0, 0, 1, 1])
    assert fn(scores, ids).tolist() == [False, False, True, True]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_reprobe30_running_reward_normalizer_skips_non_finite_rewards(bad):
    norm = algos.running_reward_normalizer()
    batches = [torch.tensor([1.0, 3.0, bad, 4.0]), torch.tensor([2.0, bad]), torch.tensor([7.0, -1.0, 0.5])]
    state = norm.init()
    seen: list[float] = []
    for rewards in batches:
        out, state = norm.update(rewards, torch.ones_like(rewards, dtype=torch.bool), state)
        seen += [float(r) for r in rewards if math.isfinite(r)]
        finite = torch.tensor(seen, dtype=torch.float64)
        # The statistics are those of the finite rewards alone, and stay finite.
        assert float(state.count) == len(seen)
        torch.testing.assert_close(state.mean, finite.mean())
        torch.testing.assert_close(state.m2, ((finite - finite.mean()) ** 2).sum())
        ok = torch.isfinite(rewards)
        want = (rewards[ok].double() - finite.mean()) / torch.sqrt(finite.var() + 1e-8)
        torch.testing.assert_close(out[ok], want.float())
        assert not torch.isfinite(out[~ok]).any()  # the bad reward stays visible


# Issue 30 re-probe: new cases ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("fn", "kwargs", "name"),
    [
        ("ppo_clip_loss", {"dual_clip": math.inf}, "dual_clip"),
        ("sapo_loss", {"tau_pos": math.inf}, "tau_pos"),
        ("sapo_loss", {"tau_neg": math.inf}, "tau_neg"),
    ],
)
def test_reprobe30_infinite_policy_loss_hyperparameters_are_refused(fn, kwargs, name):
    # Each gave a NaN per-token loss (inf * 0) instead of an error.
    lp = torch.tensor([[-1.0, -2.0]])
    with pytest.raises(ValueError, match=rf"{name}: got inf, expected .*finite"):
        getattr(algos, fn)(lp, lp, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), **kwargs)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda x: algos.dpo_loss(*x[:4], beta=math.inf, loss_type="robust"), "beta"),
        (lambda x: algos.dpo_loss(*x[:4], beta=0.1, loss_type="bco_pair", alpha=math.inf), "alpha"),
        (lambda x: algos.simpo_loss(x[0], x[1], gamma=math.inf), "gamma"),
        (lambda x: algos.simpo_loss(x[0], x[1], beta=math.inf), "beta"),
        (lambda x: algos.cpo_loss(x[0], x[1], -x[0], beta=math.inf), "beta"),
        (lambda x: algos.orpo_loss(x[0], x[1], -x[0], lam=math.inf), "lam"),
        (lambda x: algos.kto_loss(x[0], x[2], torch.tensor([True]), x[2], x[3], beta=math.inf), "beta"),
        (
            lambda x: algos.kto_loss(x[0], x[2], torch.tensor([True]), x[2], x[3], desirable_weight=math.inf),
            "desirable_weight",
        ),
        (
            lambda x: algos.kl_in_reward(x[0][None], x[0][None], x[2][None], torch.ones(1, 1), kl_coef=math.inf),
            "kl_coef",
        ),
        (lambda x: algos.running_reward_normalizer(eps=math.inf), "eps"),
        (lambda x: algos.gpg_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), f_norm=math.inf), "f_norm"),
    ],
)
def test_reprobe30_infinite_loss_coefficients_are_refused(call, name):
    # Each gave a NaN or infinite loss, reward or advantage instead of an error.
    x = (torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.2]))
    with pytest.raises(ValueError, match=rf"{name}: got inf, expected .*finite"):
        call(x)


@pytest.mark.parametrize(
    "call",
    [
        lambda loss, mask: algos.aggregate(loss, mask),
        lambda loss, mask: algos.aggregate(loss, mask, mode="seq-mean-token-mean"),
        lambda loss, mask: algos.batch_normalize(loss, mask),
        lambda loss, mask: algos.ppo_clip_loss(loss, loss, loss, mask),
        lambda loss, mask: algos.cispo_loss(loss, loss, loss, mask),
    ],
)
def test_reprobe30_negative_mask_weights_are_refused(call):
    # aggregate gave -1 for a loss of ones (count 0 replaced, sum -1); batch_normalize 1e4-fold values.
    loss = torch.tensor([[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match=r"mask: got values in \[-1.0, 1.0\], expected counts >= 0"):
        call(-loss.abs(), torch.tensor([[1.0, -1.0, 1.0]]))


def test_reprobe30_reduce_metrics_refuses_bad_weights_and_kinds():
    m = {"approx_kl": torch.tensor(0.5)}
    for bad in (-1.0, math.nan, math.inf, True, torch.tensor(-2.0)):
        with pytest.raises(ValueError, match=r"weight: got"):
            algos.reduce_metrics(m, bad, process_groups=[None])
    with pytest.raises(ValueError, match=r"reductions\['approx_kl'\]: got 'median', expected one of"):
        algos.reduce_metrics(m, 1.0, process_groups=[None], reductions={"approx_kl": "median"})
    with pytest.raises(ValueError, match=r"metrics\['approx_kl'\]: got shape \(2,\), expected a scalar metric"):
        algos.reduce_metrics({"approx_kl": torch.zeros(2)}, 1.0, process_groups=[None])
    # One process: the values come back; a rank without weight gives 0, not its empty-mask extremes.
    got = algos.reduce_metrics(
        {"approx_kl": torch.tensor(0.5), "ratio_min": torch.tensor(0.9)},
        0.0,
        process_groups=[None],
        reductions=algos.RL_METRIC_REDUCTIONS,
    )
    assert got == {"approx_kl": torch.tensor(0.0), "ratio_min": torch.tensor(0.0)}
