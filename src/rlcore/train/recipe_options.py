"""The config's recipe options: ``rl.policy_loss`` (and its ``rl.policy_loss_args``), ``rl.entropy_coef``,
``rl.advantage``, and on-policy distillation's ``rl.algo: opd``, checked and applied to the recipe ``rl.algo`` names.

* ``rl.policy_loss`` replaces the recipe's policy loss by one of :data:`POLICY_LOSSES`
  (``algo._replace(policy_loss=...)``), with that loss's published defaults;
  ``rl.policy_loss_args`` overrides its keyword hyperparameters (``{cov_fraction: 0.002}``).
* ``rl.entropy_coef`` is the recipe's entropy bonus (subtracted from the loss).
* ``rl.advantage: optimal_token_baseline`` replaces the recipe's advantage estimator by
  :func:`rlcore.algos.token_baseline_advantages` (its scores put on the last token): the
  old-policy forward then also gives ``sum_pi_squared`` (:func:`rlcore.algos.scoring_needs`).
  With ``rl.multi_turn`` it is verl's multi-turn variant (``multi_turn=True``): each turn's
  reward on its last policy token, the trajectories' policy tokens lined up by count and
  the tool / observation tokens (mask 0) left out of the baseline.
* ``rl.algo: opd`` is :func:`rlcore.algos.on_policy_distillation`: the teacher
  (``model.teacher``) is the run's reference model, so its log-probs fill ``ref_logp``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from rlcore import algos

__all__ = ["ADVANTAGES", "POLICY_LOSSES", "apply_recipe_options", "check_policy_loss", "policy_loss"]

POLICY_LOSSES: dict[str, Callable[..., Any]] = {
    "ppo_clip": algos.ppo_clip_loss,
    "dppo_tv": algos.dppo_tv_loss,
    "dppo_kl": algos.dppo_kl_loss,
    "dro": algos.dro_loss,
    "clip_cov": algos.clip_cov_loss,
    "kl_cov": algos.kl_cov_loss,
}
# rl.advantage: the estimators that replace a recipe's own (it keeps its shaping; scores go on the last token).
ADVANTAGES: dict[str, Callable[..., Any]] = {"optimal_token_baseline": algos.token_baseline_advantages}
# Keywords that are data, not hyperparameters (clip_cov's ranking draws).
_DATA_KEYWORDS = ("noise",)


def _hyperparameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    params = inspect.signature(fn).parameters.values()
    return {p.name: p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in _DATA_KEYWORDS}


def policy_loss(name: str, args: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """The policy loss ``name`` of :data:`POLICY_LOSSES` with ``args`` bound as its keyword hyperparameters.

    >>> policy_loss("clip_cov", {"cov_fraction": 0.01}).keywords
    {'cov_fraction': 0.01}
    """
    return partial(POLICY_LOSSES[name], **dict(args or {}))


def check_policy_loss(name: str | None, args: Mapping[str, Any] | None) -> None:
    """``rl.policy_loss`` and ``rl.policy_loss_args``: known hyperparameters with values the loss accepts.

    The loss is called once on a two-token batch, so a value out of its range is named now,
    not at the first step.
    """
    key = "config key 'rl.policy_loss_args'"
    if name is None:
        if args:
            raise ValueError(f"{key}: got {dict(args)!r} with rl.policy_loss null, expected null (they set its loss)")
        return
    known = _hyperparameters(POLICY_LOSSES[name])
    args = dict(args or {})
    for arg, value in args.items():
        if arg not in known:
            raise ValueError(f"{key}: got {arg!r} for rl.policy_loss {name!r}, expected some of {', '.join(known)}")
        nullable = known[arg].default is None
        if not (value is None and nullable) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(
                f"{key}: {arg}: got {type(value).__name__} {value!r}, expected a number{' or null' if nullable else ''}"
            )
    missing = [a for a, p in known.items() if p.default is inspect.Parameter.empty and a not in args]
    if missing:
        raise ValueError(
            f"{key}: got {args or None!r} for rl.policy_loss {name!r}, expected a value for {', '.join(missing)} "
            "(no published default)"
        )
    probe = torch.log(torch.tensor([[0.5, 0.25]]))
    try:
        policy_loss(name, args)(probe, probe, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    except ValueError as err:
        raise ValueError(f"{key}: got {args!r} for rl.policy_loss {name!r}: {err}") from err


def apply_recipe_options(algo: algos.Algorithm, rl: Any) -> algos.Algorithm:
    """``algo`` with ``rl.policy_loss`` (and its args), ``rl.entropy_coef`` and ``rl.advantage`` applied."""
    if rl.advantage is not None:
        shaping = (
            algos.token_rewards_shaping
            if algo.shaping is None
            else algos.chain(algo.shaping, algos.token_rewards_shaping)
        )
        estimator = ADVANTAGES[rl.advantage]
        if rl.multi_turn is not None:  # trajectories: the k-th policy tokens lined up, observations left out
            estimator = partial(estimator, multi_turn=True)
        algo = algo._replace(advantage_estimator=estimator, shaping=shaping)
    if rl.policy_loss is not None:
        algo = algo._replace(policy_loss=policy_loss(rl.policy_loss, rl.policy_loss_args))
    if rl.entropy_coef:
        algo = algo._replace(entropy_coef=rl.entropy_coef)
    return algo
