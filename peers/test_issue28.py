"""Peer agreement for issue 28's maths: verl 0.9.1 (DPPO, DRO, Clip-Cov, KL-Cov, GDPO, the
optimal token baseline) and TRL 1.16 (GKD's generalised JSD, the reward trainer's loss).

Not part of the test suite (``tests/``): the peers are not dependencies of rlcore. Run
``python -m pytest peers/`` after ``pip install --target PEERS --no-deps verl==0.9.1
trl==1.16.0`` (plus the few light modules their imports name) with ``PEERS`` on
``PYTHONPATH``; a test whose peer is absent is skipped. Where rlcore differs from a peer on
purpose, the test pins the difference.
"""

import types
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rlcore import algos, ops
from rlcore.testing.loss_strategies import policy_batches
from rlcore.testing.strategies import group_ids, masks


@pytest.fixture(scope="module")
def verl():
    return pytest.importorskip("verl.trainer.ppo.core_algos")


@pytest.fixture(scope="module")
def trl_gkd():
    return pytest.importorskip("trl.experimental.gkd.gkd_trainer")


@pytest.fixture(scope="module")
def trl_reward():
    return pytest.importorskip("trl.trainer.reward_trainer")


class _Config(dict):
    """The attribute-and-``get`` access verl's losses make of their actor config."""

    def __getattr__(self, key):
        return self[key]

    def get(self, key, default=None):
        return dict.get(self, key, default)


def _actor(clip, **policy_loss):
    return _Config(
        clip_ratio=clip,
        clip_ratio_low=None,
        clip_ratio_high=None,
        clip_ratio_c=20.0,
        global_batch_info={},
        policy_loss=_Config(policy_loss),
    )


def _clean(batch):
    """Padding as zeros and log-probs <= 0, as a peer needs them (it multiplies by the mask)."""
    mask = batch["mask"]
    out = {k: torch.where(mask, v, 0.0) for k, v in batch.items() if k != "mask"}
    for k in ("logp", "old_logp"):
        out[k] = out[k].clamp(max=-1e-6)
    return {**out, "mask": mask}


def _peer_loss(fn, b, config):
    """verl's token-sum loss and its gradient per token."""
    lp = b["logp"].clone().requires_grad_(True)
    loss, _ = fn(b["old_logp"], lp, b["advantages"], b["mask"].double(), loss_agg_mode="token-sum", config=config)
    loss.backward()
    return loss.detach(), lp.grad


def _our_loss(fn, b, **kw):
    lp = b["logp"].clone().requires_grad_(True)
    loss_t, _ = fn(lp, b["old_logp"], b["advantages"], b["mask"], **kw)
    loss = loss_t.sum()
    loss.backward()
    return loss.detach(), lp.grad


def _clear_cut(b, fraction):
    keep = b["mask"]
    adv, lp = b["advantages"][keep], b["logp"][keep]
    cov = ((adv - adv.mean()) * (lp - lp.mean())).sort(descending=True).values
    k = max(int(fraction * cov.numel()), 1)
    return k >= cov.numel() or float(cov[k - 1] - cov[k]) > 1e-9 * max(1.0, float(cov.abs().max()))


POLICY = {
    "dppo_tv": ("compute_policy_loss_dppo_tv", algos.dppo_tv_loss),
    "dppo_kl": ("compute_policy_loss_dppo_kl", algos.dppo_kl_loss),
    "dro": ("compute_policy_loss_dro", algos.dro_loss),
    "kl_cov": ("compute_policy_loss_kl_cov", algos.kl_cov_loss),
    "clip_cov": ("compute_policy_loss_clip_cov", algos.clip_cov_loss),
}


@pytest.mark.parametrize("name", list(POLICY))
@settings(max_examples=10, deadline=None)
@given(batch=policy_batches(dtype=torch.float64, drifts=("small", "large")), data=st.data())
def test_policy_losses_match_verl(verl, name, batch, data):
    b = _clean(batch)
    assume(bool(b["mask"].any()))
    peer_name, ours = POLICY[name]
    if name.startswith("dppo"):
        clip = data.draw(st.sampled_from([0.05, 0.15, 0.3]))
        config, kw = _actor(clip), {"clip_low": clip, "clip_high": clip, "ratio_cap": 20.0}
    elif name == "dro":
        beta = data.draw(st.sampled_from([0.05, 1.0]))
        config, kw = _actor(0.2, dro_beta=beta), {"beta": beta}
    elif name == "kl_cov":
        frac = data.draw(st.sampled_from([2e-4, 0.1, 0.5]))
        assume(_clear_cut(b, frac))
        config, kw = _actor(0.2, kl_cov_ratio=frac, ppo_kl_coef=0.5), {"cov_fraction": frac, "kl_coef": 0.5}
    else:
        # Every eligible token is cut (fraction 1): the peer's random draw then picks them all.
        # No band edge at 0: verl's masked mean adds 1e-8 to the count, so a covariance
        # that is exactly 0 (a lone token, equal advantages) comes out just above it.
        low, high = data.draw(st.sampled_from([(0.01, 5.0), (0.5, 2.0), (-1.0, 1.0)]))
        config = _actor(0.2, clip_cov_ratio=1.0, clip_cov_lb=low, clip_cov_ub=high)
        kw = {"cov_fraction": 1.0, "cov_low": low, "cov_high": high, "clip_low": 0.2, "clip_high": 0.2}
    want, want_grad = _peer_loss(getattr(verl, peer_name), b, config)
    got, grad = _our_loss(ours, b, **kw)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-9)


def test_verl_dppo_truncates_at_its_actor_default_not_at_20(verl):
    """verl's DPPO reads ``config.get("clip_ratio_c", 20.0)``, but its ActorConfig sets
    clip_ratio_c = 3.0, so a default run truncates the weight at 3 (rlcore: ``ratio_cap=20``)."""
    from verl.workers.config.actor import ActorConfig

    assert ActorConfig.__dataclass_fields__["clip_ratio_c"].default == 3.0
    lp = torch.tensor([[-0.1]], dtype=torch.float64)
    old = torch.tensor([[-1.6]], dtype=torch.float64)  # ratio e^1.5 = 4.5, p - p_old = 0.70
    b = {"logp": lp, "old_logp": old, "advantages": -torch.ones(1, 1, dtype=torch.float64), "mask": torch.ones(1, 1)}
    config = _actor(1.0)
    config["clip_ratio_c"] = 3.0
    _, peer_grad = _peer_loss(verl.compute_policy_loss_dppo_tv, b, config)
    _, grad20 = _our_loss(algos.dppo_tv_loss, {**b, "mask": b["mask"].bool()}, clip_low=1.0, clip_high=1.0)
    assert float(peer_grad) == pytest.approx(3.0) and float(grad20) == pytest.approx(np.exp(1.5))


@st.composite
def grouped_components(draw):
    ids = draw(group_ids(max_groups=4, max_size=4))
    counts = torch.bincount(ids)
    assume(bool((counts >= 2).all()))  # verl passes a group of one's raw score through; rlcore gives 0
    b, t = ids.shape[0], draw(st.integers(1, 6))
    mask = draw(masks(b, t, interior_zeros=False, allow_empty=False))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scores = torch.randint(0, 2, (b, 2), generator=g).double()
    scores[:, 1] = torch.randn(b, generator=g, dtype=torch.float64)
    return scores, ids, mask


@settings(max_examples=10, deadline=None)
@given(data=grouped_components())
def test_gdpo_matches_verl_up_to_where_the_batch_is_whitened(verl, data):
    """Both normalise each component in its group and sum; verl then whitens the [B, T]
    tokens (length-weighted), rlcore the [B] samples. The same per-sample sum, whitened
    over the tokens, is verl's result."""
    scores, ids, mask = data
    b, t = mask.shape
    prompts = torch.zeros(b, 2, dtype=torch.long)
    batch = {"prompts": prompts, "attention_mask": torch.cat([torch.ones(b, 2, dtype=torch.long), mask.long()], 1)}
    non_tensor = {"acc": scores[:, 0].numpy(), "fmt": scores[:, 1].numpy()}
    config = _Config(gdpo_reward_keys=["acc", "fmt"], gdpo_reward_weights=[1.0, 0.5])
    rewards = torch.zeros(b, t, dtype=torch.float32)
    peer, _ = verl.compute_gdpo_outcome_advantage(
        rewards, mask.float(), np.asarray(ids), config=config, non_tensor_batch=non_tensor, batch=batch
    )
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    summed = algos.gdpo_advantages(scores, ids, weights=weights, batch_norm=False)
    tokens = torch.where(mask, summed[:, None], 0.0)
    torch.testing.assert_close(peer.double(), ops.masked_whiten(tokens, mask) * mask, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("multi", [False, True])
@settings(max_examples=10, deadline=None)
@given(data=st.data(), tail=st.booleans(), use_rho=st.booleans())
def test_optimal_token_baseline_matches_verl(verl, multi, data, tail, use_rho):
    ids = data.draw(group_ids(max_groups=4, max_size=4))
    b, t = ids.shape[0], data.draw(st.integers(1, 7))
    mask = data.draw(masks(b, t, interior_zeros=multi, allow_empty=multi))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    probs = torch.randn(b, t, 5, generator=g, dtype=torch.float64).softmax(-1)
    old_logp = probs[..., 0].log()
    sum_sq = probs.square().sum(-1)
    rewards = torch.where(mask, torch.randn(b, t, generator=g, dtype=torch.float64), 0.0)
    rho = torch.rand(b, t, generator=g, dtype=torch.float64) + 0.5 if use_rho else None
    fn = (
        verl.compute_multi_turn_optimal_token_baseline_advantage
        if multi
        else verl.compute_optimal_token_baseline_advantage
    )
    peer, _ = fn(
        rewards, mask.double(), np.asarray(ids), old_logp, sum_sq, rollout_is_weights=rho, handle_zero_tail=tail
    )
    ours, _ = algos.optimal_token_baseline_advantages(
        rewards, old_logp, sum_sq, mask, ids, is_weights=rho, handle_zero_tail=tail, multi_turn=multi
    )
    torch.testing.assert_close(ours, peer, rtol=1e-9, atol=1e-9)


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 999),
    beta=st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]),
    temperature=st.sampled_from([1.0, 2.0]),
    data=st.data(),
)
def test_generalized_jsd_matches_trl(trl_gkd, seed, beta, temperature, data):
    g = torch.Generator().manual_seed(seed)
    b, t, v = 2, 4, 9
    student = 2 * torch.randn(b, t, v, generator=g, dtype=torch.float64)
    teacher = 2 * torch.randn(b, t, v, generator=g, dtype=torch.float64)
    mask = data.draw(masks(b, t))
    labels = torch.where(mask, 1, -100)
    trl_fn = trl_gkd.GKDTrainer.generalized_jsd_loss
    per_token = trl_fn(student, teacher, beta=beta, temperature=temperature, reduction="none").sum(-1)
    ours, _ = algos.generalized_jsd_loss(student, teacher, mask, beta=beta, temperature=temperature)
    torch.testing.assert_close(ours, torch.where(mask, per_token, 0.0), rtol=1e-9, atol=1e-12)
    batchmean = trl_fn(student, teacher, labels=labels, beta=beta, temperature=temperature)
    torch.testing.assert_close(algos.aggregate(ours, mask, mode="token-mean"), batchmean, rtol=1e-9, atol=1e-12)


def test_trl_jsd_is_nan_at_a_masked_vocabulary_entry(trl_gkd):
    """TRL's ``F.kl_div`` forms ``exp(t) * (t - s)``, which is ``0 * nan`` where both logits are
    -inf (a masked vocabulary entry): its loss is nan at every beta. rlcore drops the entry
    (p = 0 adds 0) and agrees with TRL on the vocabulary without it."""
    student = torch.tensor([[[0.0, 1.0, -torch.inf]]])
    teacher = torch.tensor([[[0.5, 0.0, -torch.inf]]])
    trl_fn = trl_gkd.GKDTrainer.generalized_jsd_loss
    for beta in (0.0, 0.5, 1.0):
        assert torch.isnan(trl_fn(student, teacher, beta=beta, reduction="none").sum(-1)).all()
        ours, _ = algos.generalized_jsd_loss(student, teacher, torch.ones(1, 1), beta=beta)
        want = trl_fn(student[..., :2], teacher[..., :2], beta=beta, reduction="none").sum(-1)
        torch.testing.assert_close(ours, want)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 999), margin=st.booleans(), center=st.sampled_from([None, 0.01, 1.0]))
def test_bradley_terry_matches_trl_reward_trainer(trl_reward, seed, margin, center):
    g = torch.Generator().manual_seed(seed)
    chosen, rejected = 3 * torch.randn(6, generator=g), 3 * torch.randn(6, generator=g)
    inputs = {"attention_mask": torch.ones(12, 3)}
    if margin:
        inputs["margin"] = torch.rand(6, generator=g)
    model = types.SimpleNamespace(training=False)
    fake = types.SimpleNamespace(
        model=model,
        args=types.SimpleNamespace(center_rewards_coefficient=center),
        accelerator=types.SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
    )

    def forward(**_):
        return types.SimpleNamespace(logits=torch.cat([chosen, rejected])[:, None])

    want = trl_reward.RewardTrainer.compute_loss(fake, forward, dict(inputs))
    loss, _ = algos.bradley_terry_loss(chosen, rejected, margin=inputs.get("margin"), center_coef=center or 0.0)
    torch.testing.assert_close(loss.mean(), want)
