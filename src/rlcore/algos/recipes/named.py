"""Named recipes: PPO, GRPO, Dr. GRPO, DAPO, GSPO, GDPO, REINFORCE++, RLOO and on-policy distillation as compositions, with published defaults."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from rlcore.algos.advantages import gdpo_advantages, grpo_advantages, reinforce_pp_advantages, rloo_advantages
from rlcore.algos.distillation import check_jsd_options, generalized_jsd_loss
from rlcore.algos.kl import kl_penalty
from rlcore.algos.policy_losses import gspo_loss, ppo_clip_loss
from rlcore.algos.recipes.adapters import (
    dynamic_sampling_filter,
    gae_advantages,
    kl_reward_shaping,
    kl_score_shaping,
    outcome_advantages,
    overlong_shaping,
    score_scaling,
    token_advantages,
    token_rewards_shaping,
)
from rlcore.algos.recipes.algorithm import Algorithm, chain
from rlcore.algos.value_loss import value_loss

__all__ = ["dapo", "dr_grpo", "gdpo", "grpo", "gspo", "on_policy_distillation", "ppo", "reinforce_pp", "rloo"]


def ppo(
    *,
    clip: float = 0.2,
    gamma: float = 1.0,
    lam: float = 0.95,
    kl_coef: float = 0.02,
    value_clip: float = 0.2,
    vf_coef: float = 0.1,
) -> Algorithm:
    """PPO for RLHF: GAE on token rewards with a per-token KL reward, clipped policy and value losses.

    Schulman et al. 2017, arXiv:1707.06347 (clip 0.2); the RLHF setting of Ouyang et al.
    2022, arXiv:2203.02155 (KL reward coefficient 0.02, gamma 1, lambda 0.95); value clip
    0.2 and value coefficient 0.1 are TRL's ``PPOConfig`` defaults. Advantages are
    whitened over the batch; the loss is a token mean.

    Batch: ``scores`` ``[B]`` (placed on the last token) or ``rewards`` ``[B, T]``,
    ``old_values``, ``values``, ``old_logp``, ``ref_logp``, ``logp``, ``mask``.

    >>> ppo().policy_loss.keywords
    {'clip_low': 0.2, 'clip_high': 0.2}
    """
    return Algorithm(
        advantage_estimator=partial(gae_advantages, gamma=gamma, lam=lam, whiten=True),
        policy_loss=partial(ppo_clip_loss, clip_low=clip, clip_high=clip),
        agg_mode="token-mean",
        shaping=chain(token_rewards_shaping, partial(kl_reward_shaping, kl_coef=kl_coef, estimator="k1")),
        value_loss=partial(value_loss, clip=value_clip),
        vf_coef=vf_coef,
    )


def grpo(*, clip: float = 0.2, kl_coef: float = 0.04, kl_estimator: str = "k3", eps: float = 1e-6) -> Algorithm:
    """GRPO: group-normalised outcome advantages, PPO clip, k3 KL loss, per-sequence token mean.

    Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, eq. 3-4: clip 0.2, beta 0.04,
    the k3 estimator as a loss term, ``1/G sum_i 1/|o_i| sum_t`` (``"seq-mean-token-mean"``).
    As a loss, k3's gradient estimates the forward KL's (see
    :func:`rlcore.algos.kl_penalty`); ``kl_estimator="k2"`` gives the reverse KL's.

    Batch: ``scores``, ``group_ids``, ``logp``, ``old_logp``, ``ref_logp``, ``mask``.

    >>> grpo().agg_mode
    'seq-mean-token-mean'
    """
    return Algorithm(
        advantage_estimator=partial(outcome_advantages, estimator=partial(grpo_advantages, scale="group", eps=eps)),
        policy_loss=partial(ppo_clip_loss, clip_low=clip, clip_high=clip),
        kl=partial(kl_penalty, estimator=kl_estimator),
        kl_coef=kl_coef,
        agg_mode="seq-mean-token-mean",
    )


def dr_grpo(*, clip: float = 0.2, horizon: int | None = None) -> Algorithm:
    """Dr. GRPO: GRPO without the std division and without length normalisation.

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
    arXiv:2503.20783: advantages are group-centred scores (``scale="none"``), the loss is
    ``1/G sum_i sum_t`` divided by a constant, the generation budget (``horizon``; set it
    to the maximum response length, it defaults to the padded ``T``), and no KL term.

    >>> dr_grpo(horizon=4096).horizon
    4096
    """
    return Algorithm(
        advantage_estimator=partial(outcome_advantages, estimator=partial(grpo_advantages, scale="none")),
        policy_loss=partial(ppo_clip_loss, clip_low=clip, clip_high=clip),
        agg_mode="seq-mean-token-sum-norm",
        horizon=horizon,
    )


def dapo(
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    max_length: int = 20480,
    cache_length: int = 4096,
    dynamic_sampling: bool = True,
) -> Algorithm:
    """DAPO: clip-higher, dynamic sampling, token-level loss, overlong reward shaping, no KL.

    Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    arXiv:2503.14476: eps_low 0.2, eps_high 0.28, ``"token-mean"`` over all tokens of the
    batch, soft overlong punishment with ``L_max`` 20480 and ``L_cache`` 4096.

    Dynamic sampling keeps a group only if its scores are not all equal (on the raw
    scores, before the overlong penalty). The paper over-samples until the batch is
    full; here the dropped groups' masks are zeroed on the device, so nothing syncs and
    the counts (:func:`rlcore.algos.global_counts` of the shaped mask) exclude them.

    Batch: ``scores``, ``group_ids``, optional ``lengths``, ``logp``, ``old_logp``, ``mask``.

    >>> dapo().policy_loss.keywords
    {'clip_low': 0.2, 'clip_high': 0.28}
    """
    overlong = partial(overlong_shaping, max_length=max_length, cache_length=cache_length)
    shaping = chain(dynamic_sampling_filter, overlong) if dynamic_sampling else overlong
    return Algorithm(
        advantage_estimator=partial(outcome_advantages, estimator=partial(grpo_advantages, scale="group")),
        policy_loss=partial(ppo_clip_loss, clip_low=clip_low, clip_high=clip_high),
        agg_mode="token-mean",
        shaping=shaping,
    )


def gspo(*, clip_low: float = 3e-4, clip_high: float = 4e-4) -> Algorithm:
    """GSPO: group-normalised advantages with a clipped, length-normalised sequence ratio.

    Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071: clip
    ranges 3e-4 / 4e-4, no KL term, ``"seq-mean-token-mean"`` (the sequence objective).

    >>> gspo().policy_loss.func.__name__
    'gspo_loss'
    """
    return Algorithm(
        advantage_estimator=partial(outcome_advantages, estimator=partial(grpo_advantages, scale="group")),
        policy_loss=partial(gspo_loss, clip_low=clip_low, clip_high=clip_high),
        agg_mode="seq-mean-token-mean",
    )


def reinforce_pp(*, clip: float = 0.2, kl_coef: float = 0.01, gamma: float = 1.0) -> Algorithm:
    """REINFORCE++: per-token k1 KL reward, discounted reward-to-go whitened over the batch, PPO clip.

    Hu 2025, "REINFORCE++", arXiv:2501.03262: ``r_t = [t = last] r(x, y) - beta KL_t``
    with ``KL_t = log pi_old / pi_ref``, gamma 1, global advantage normalisation, clip
    0.2; beta 0.01 is OpenRLHF's ``init_kl_coef`` default (the paper tunes it per task).

    Batch: ``scores`` (or ``rewards``), ``old_logp``, ``ref_logp``, ``logp``, ``mask``.

    >>> reinforce_pp().kl is None
    True
    """
    return Algorithm(
        advantage_estimator=partial(token_advantages, estimator=partial(reinforce_pp_advantages, gamma=gamma)),
        policy_loss=partial(ppo_clip_loss, clip_low=clip, clip_high=clip),
        agg_mode="token-mean",
        shaping=chain(token_rewards_shaping, partial(kl_reward_shaping, kl_coef=kl_coef, estimator="k1")),
    )


def rloo(*, clip: float = 0.2, kl_coef: float = 0.05) -> Algorithm:
    """RLOO: leave-one-out baselines on KL-penalised sequence rewards.

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs", arXiv:2402.14740: the whole completion is
    one action, rewarded ``r(x, y) - beta * sum_t log(pi_old / pi_ref)``; beta 0.05 is
    TRL's ``RLOOConfig`` default. The PPO-clip surrogate (0.2, as TRL and verl use)
    equals the paper's REINFORCE gradient on the first, on-policy step.

    Batch: ``scores``, ``group_ids``, ``old_logp``, ``ref_logp``, ``logp``, ``mask``.

    >>> rloo().shaping.keywords
    {'kl_coef': 0.05, 'estimator': 'k1'}
    """
    return Algorithm(
        advantage_estimator=partial(outcome_advantages, estimator=rloo_advantages),
        policy_loss=partial(ppo_clip_loss, clip_low=clip, clip_high=clip),
        agg_mode="token-mean",
        shaping=partial(kl_score_shaping, kl_coef=kl_coef, estimator="k1"),
    )


def gdpo(
    *, clip: float = 0.2, eps: float = 1e-6, weights: Sequence[float] | None = None, batch_norm: bool = True
) -> Algorithm:
    """GDPO: each reward component normalised within its group, summed, whitened over the batch; PPO clip.

    Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization for
    Multi-reward RL Optimization", arXiv:2601.05242 (:func:`rlcore.algos.gdpo_advantages`):
    clip 0.2, no KL loss and a token mean, as verl's GDPO example. The batch's
    ``scores`` are ``[B, K]``, one column per reward component (``[B]`` is one component).
    ``weights`` are the components' weights ``w_k`` (1 each when ``None``), applied after
    each component's group normalisation; ``batch_norm=False`` skips the last whitening
    (with one component GDPO is then exactly GRPO's group z-score).

    Batch: ``scores`` ``[B, K]``, ``group_ids``, ``logp``, ``old_logp``, ``mask``.

    >>> gdpo().advantage_estimator.keywords["estimator"].func.__name__
    'gdpo_advantages'
    """
    return Algorithm(
        advantage_estimator=partial(
            outcome_advantages,
            estimator=partial(
                gdpo_advantages, eps=eps, weights=None if weights is None else list(weights), batch_norm=batch_norm
            ),
        ),
        policy_loss=partial(ppo_clip_loss, clip_low=clip, clip_high=clip),
        agg_mode="token-mean",
    )


def on_policy_distillation(
    *,
    teacher_coef: float = 1.0,
    gamma: float = 0.0,
    clip: float = 0.2,
    loss: str = "reward",
    task_coef: float = 1.0,
    beta: float = 0.0,
    top_k: int | None = None,
) -> Algorithm:
    """On-policy distillation: the student's sampled tokens scored by the teacher, as a dense reward or a loss.

    Agarwal et al. 2024, "On-Policy Distillation of Language Models" (GKD),
    arXiv:2306.13649, with the sampled-token reverse KL of Qwen3 (arXiv:2505.09388) and
    Thinking Machines' "On-Policy Distillation" (2025). The teacher is this recipe's
    reference model: its log-probs of the student's tokens fill ``ref_logp``.

    ``loss="reward"``: each token of the student's sample is rewarded
    ``-teacher_coef * (old_logp - ref_logp)``, the negative one-sample reverse KL to the
    teacher; the task score ``task_coef * scores`` adds on the last token. The discount
    ``gamma = 0`` credits each token with its own KL only (Thinking Machines' choice;
    ``gamma = 1`` gives the sequence's reverse KL to go); the advantages are whitened over
    the batch and the update is PPO-clipped.

    ``loss="reverse_kl"``: the reverse KL is a loss term, ``teacher_coef * k1`` with k2's
    gradient (``(logp - ref_logp) * grad logp``, the score-function gradient of the
    token-level reverse KL, as :func:`rlcore.algos.reverse_kl_distill_loss`; its value, the
    ``kl`` metric, is the reverse-KL estimate), beside GRPO's group advantages of
    ``task_coef * scores`` under the PPO clip. No old-policy forward is needed.

    ``loss="jsd"``: the full-vocabulary loss, ``teacher_coef *`` GKD's generalised JSD
    (:func:`rlcore.algos.generalized_jsd_loss` at ``beta`` and ``top_k``) between the
    student's and the teacher's next-token distributions at every response position,
    beside the same GRPO term. ``beta = 0`` is the forward KL ``KL(teacher || student)``,
    whose gradient ``pi - pi_T`` does not fade where the student is sure of a wrong token
    (the reverse KL's, ``beta = 1``, does); ``beta`` in between mixes them. The batch then
    needs ``logits`` and ``teacher_logits`` (``[B, T, V]``, divided by the temperature).

    ``task_coef = 0`` is pure distillation.

    Batch: ``scores`` or ``rewards``, ``group_ids`` (``reverse_kl``), ``old_logp``,
    ``ref_logp`` (the teacher's), ``logp``, ``mask``.

    >>> on_policy_distillation().shaping.steps[2].keywords
    {'kl_coef': 1.0, 'estimator': 'k1'}
    >>> on_policy_distillation(loss="reverse_kl").kl.keywords
    {'estimator': 'k1', 'straight_through': True}
    """
    if loss not in ("reward", "reverse_kl", "jsd"):
        raise ValueError(f"loss: got {loss!r}, expected 'reward', 'reverse_kl' or 'jsd'")
    check_jsd_options(beta, top_k)
    for name, value in (("teacher_coef", teacher_coef), ("task_coef", task_coef)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise ValueError(f"{name}: got {value!r}, expected a finite number >= 0")
    scale = partial(score_scaling, coef=task_coef)
    clipped = partial(ppo_clip_loss, clip_low=clip, clip_high=clip)
    if loss == "reward":
        return Algorithm(
            advantage_estimator=partial(token_advantages, estimator=partial(reinforce_pp_advantages, gamma=gamma)),
            policy_loss=clipped,
            agg_mode="token-mean",
            shaping=chain(
                scale, token_rewards_shaping, partial(kl_reward_shaping, kl_coef=teacher_coef, estimator="k1")
            ),
        )
    # A distillation loss term beside GRPO's group advantages of the (scaled) task score.
    grpo_term = Algorithm(
        advantage_estimator=partial(outcome_advantages, estimator=partial(grpo_advantages, scale="group")),
        policy_loss=clipped,
        agg_mode="token-mean",
        shaping=scale,
    )
    if loss == "jsd":
        return grpo_term._replace(
            distill=partial(generalized_jsd_loss, beta=float(beta), top_k=top_k), distill_coef=teacher_coef
        )
    return grpo_term._replace(kl=partial(kl_penalty, estimator="k1", straight_through=True), kl_coef=teacher_coef)
