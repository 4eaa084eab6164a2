"""rlcore.algos against the loop implementations popular frameworks ship, measured in the same run.

Claims (issue 3):
  * GRPO and RLOO advantages at B = 16384 in groups of 16 are >= 100x faster than the
    per-sample / per-group Python loop (the shape of verl's ``compute_grpo_outcome_advantage``
    and ``compute_rloo_outcome_advantage``);
  * GAE at [64, 4096] is >= 10x faster than the per-time-step loop (verl's / TRL's
    ``compute_gae_advantage_return``);
  * one full GRPO loss + backward on [256, 1024] tokens (``rlcore.algos.grpo().loss``,
    advantages included) against the same maths composed as verl does it: the
    per-sample advantage loop, ``compute_policy_loss``, ``low_var_kl`` and
    ``seq-mean-token-mean`` ``agg_loss``.

Claims (issue 17), against verl's own vectorised implementations written out below:
  * ``grpo_advantages`` at B = 16384 in groups of 16 against verl's vectorised GRPO
    estimator (target >= 2x), on the same scores: the headline with the layout declared
    (``group_size``, contiguous groups as rollouts are stored), then with the ids also
    passed and checked, then with shuffled ids (general segment path) and compiled;
  * ``ppo_clip_loss`` + token-mean ``aggregate``, forward and backward at [256, 1024],
    against ``compute_policy_loss_vanilla`` + ``agg_loss(token-mean)`` (target >= 1.5x
    eager): the headline asks for a metric set like verl's (``ratio_stats=False``: clip
    fractions and a KL estimate), the default metric set is printed beside it, then
    each side's whole composition ``torch.compile``'d.

Claims (issue 28), against the peers' own code, imported when present (``_peers.py``):
  * DPPO (TV and binary KL), DRO, Clip-Cov and KL-Cov, each + token-mean ``aggregate``,
    forward and backward at [256, 1024], against verl 0.9.1's ``compute_policy_loss_*``;
  * GDPO (3 components, B = 2048 in groups of 16, T = 512) and the optimal token baseline
    (single- and multi-turn, [512, 1024]) against verl's estimators;
  * GKD's generalised JSD (beta 0.5 and 1) forward and backward on [8, 256, 4096] logits,
    and the reward-model loss on 8192 pairs, against TRL 1.16;
  target for each: not slower than the peer (>= 1x).

Eager rows are timed before any compiled call (a compiled function's worker threads slow
the eager calls that follow on a busy machine).

Each benchmark checks that both sides agree, then prints the median time of each over
``--repeats`` runs and the ratio. Run: ``python benchmarks/bench_algos.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

from rlcore import algos, ops
from rlcore.algos import aggregate, gae, grpo, grpo_advantages, ppo_clip_loss, rloo_advantages

sys.path.insert(0, os.path.dirname(__file__))
from _peers import PeerConfig, actor_config, peer
from _timing import alternated_medians, median_time, report


def _report(name: str, ours: float, baseline: float) -> None:
    print(f"{name:<44} rlcore {ours * 1e3:10.3f} ms   loop {baseline * 1e3:10.1f} ms   ratio {baseline / ours:8.1f}x")


# ------------------------------------------------------------ loop baselines (as peers)


def grpo_loop(scores: torch.Tensor, index: np.ndarray, eps: float = 1e-6) -> torch.Tensor:
    """Per-sample bucketing, per-group torch.mean/torch.std, per-sample write-back."""
    id2score = defaultdict(list)
    out = scores.clone()
    with torch.no_grad():
        for i in range(scores.shape[0]):
            id2score[index[i]].append(scores[i])
        id2mean, id2std = {}, {}
        for idx, vals in id2score.items():
            stacked = torch.stack(vals)
            id2mean[idx] = torch.mean(stacked)
            id2std[idx] = torch.std(stacked)
        for i in range(scores.shape[0]):
            out[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + eps)
    return out


def rloo_loop(scores: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    id2score = defaultdict(list)
    out = scores.clone()
    with torch.no_grad():
        for i in range(scores.shape[0]):
            id2score[index[i]].append(scores[i])
        id2mean = {idx: torch.mean(torch.stack(vals)) for idx, vals in id2score.items()}
        for i in range(scores.shape[0]):
            n = len(id2score[index[i]])
            out[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
    return out


def gae_loop(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):  # type: ignore[no-untyped-def]
    """One vectorised step per time step, with observation-token carry-through."""
    with torch.no_grad():
        next_values = torch.zeros(rewards.shape[0])
        running = torch.zeros(rewards.shape[0])
        m = mask.to(rewards.dtype)
        out = []
        for t in reversed(range(rewards.shape[1])):
            delta = rewards[:, t] + gamma * next_values - values[:, t]
            step = delta + gamma * lam * running
            next_values = values[:, t] * m[:, t] + (1 - m[:, t]) * next_values
            running = step * m[:, t] + (1 - m[:, t]) * running
            out.append(running)
        adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


# ------------------------------------------------- vectorised baselines (verl's own code)


def grpo_vectorised_verl(scores: torch.Tensor, index: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """verl's ``compute_grpo_vectorized_outcome_advantage`` (verl/trainer/ppo/core_algos.py), on sequence scores.

    Group statistics by ``torch.bincount`` (count, sum, sum of squares), the unbiased
    variance as ``(sum2 - sum * mean) / (n - 1)``, then ``(s - mean[g]) / (std[g] + eps)``;
    the score sum over tokens and the broadcast to the response mask are left out on
    both sides (``grpo_advantages`` also takes ``[B]`` scores).
    """
    with torch.no_grad():
        counts = torch.bincount(index)
        sums = torch.bincount(index, weights=scores)
        sums2 = torch.bincount(index, weights=scores * scores)
        mean = sums / counts
        var = (sums2 - sums * mean) / (counts - 1).clamp(min=1)
        std = var.clamp(min=0).sqrt()
        return ((scores - mean[index]) / (std[index] + eps)).to(scores.dtype)


def policy_loss_vanilla_verl(old_logp, logp, advantages, mask, clip_low=0.2, clip_high=0.2, clip_c=3.0):  # type: ignore[no-untyped-def]
    """verl's ``compute_policy_loss_vanilla`` with ``agg_loss(loss_agg_mode="token-mean")`` (core_algos.py).

    Dual-clip PPO with the clip ratio ``c = 3``, verl's metrics ``pg_clipfrac``,
    ``ppo_kl`` and ``pg_clipfrac_lower`` (masked means), and the token-mean
    aggregation ``masked_mean(loss, mask)``.
    """

    def masked_mean(x, m):  # type: ignore[no-untyped-def]
        return (x * m).sum() / (m.sum() + 1e-8)

    negative_approx_kl = torch.clamp(logp - old_logp, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), mask)
    pg_losses3 = -advantages * clip_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = masked_mean(pg_losses, mask)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


# ------------------------------------------------------------------------ benchmarks


def _grouped_scores(batch: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 2, (batch,), generator=g).float() + 0.1 * torch.randn(batch, generator=g)
    ids = torch.arange(batch) // group
    return scores, ids[torch.randperm(batch, generator=g)]  # shuffled, non-contiguous groups


def bench_grpo(repeats: int) -> None:
    scores, ids = _grouped_scores(16384, 16)
    index = ids.numpy()
    torch.testing.assert_close(grpo_advantages(scores, ids), grpo_loop(scores, index), rtol=1e-4, atol=1e-4)
    ours = median_time(lambda: grpo_advantages(scores, ids), repeats=repeats * 20)
    base = median_time(lambda: grpo_loop(scores, index), repeats=repeats)
    _report("grpo_advantages  B=16384 groups of 16", ours, base)


def bench_rloo(repeats: int) -> None:
    scores, ids = _grouped_scores(16384, 16, seed=1)
    index = ids.numpy()
    torch.testing.assert_close(rloo_advantages(scores, ids), rloo_loop(scores, index), rtol=1e-4, atol=1e-4)
    ours = median_time(lambda: rloo_advantages(scores, ids), repeats=repeats * 20)
    base = median_time(lambda: rloo_loop(scores, index), repeats=repeats)
    _report("rloo_advantages  B=16384 groups of 16", ours, base)


def bench_gae(repeats: int) -> None:
    g = torch.Generator().manual_seed(2)
    b, t = 64, 4096
    rewards, values = torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)
    lengths = torch.randint(t // 2, t + 1, (b, 1), generator=g)
    mask = (torch.arange(t) < lengths) & (torch.rand(b, t, generator=g) > 0.05)  # interior observation tokens
    adv, _ = gae(rewards, values, mask, gamma=0.99, lam=0.95)
    adv_loop, _ = gae_loop(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(adv, torch.where(mask, adv_loop, 0.0), rtol=1e-4, atol=1e-4)
    ours = median_time(lambda: gae(rewards, values, mask, gamma=0.99, lam=0.95), repeats=repeats * 4)
    base = median_time(lambda: gae_loop(rewards, values, mask, 0.99, 0.95), repeats=repeats)
    _report("gae              [64, 4096]", ours, base)


def grpo_loss_peer(logp, old_logp, ref_logp, scores, index, mask, clip=0.2, kl_coef=0.04):  # type: ignore[no-untyped-def]
    """GRPO loss as verl composes it: loop advantages, vanilla PPO loss, low_var_kl, seq-mean-token-mean."""
    m = mask.to(logp.dtype)
    adv = grpo_loop(scores, index)[:, None] * m

    def seq_mean_token_mean(x):  # type: ignore[no-untyped-def]
        return ((x * m).sum(-1) / m.sum(-1)).mean()

    neg_kl = torch.clamp(logp - old_logp, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip, 1 + clip)
    pg = torch.maximum(pg1, pg2)
    with torch.no_grad():
        metrics = {
            "ppo_kl": (-neg_kl * m).sum() / m.sum(),
            "clipfrac": (torch.gt(pg2, pg1).float() * m).sum() / m.sum(),
        }
    kl = torch.clamp(ref_logp - logp, min=-20.0, max=20.0)
    kld = torch.clamp(torch.exp(kl) - kl - 1, min=-10.0, max=10.0)
    return seq_mean_token_mean(pg) + kl_coef * seq_mean_token_mean(kld), metrics


def bench_grpo_loss(repeats: int) -> None:
    g = torch.Generator().manual_seed(3)
    b, t = 256, 1024
    lengths = torch.randint(t // 4, t + 1, (b, 1), generator=g)
    mask = torch.arange(t) < lengths
    logp = torch.rand(b, t, generator=g).clamp(min=1e-3).log()
    old_logp = logp + 0.05 * torch.randn(b, t, generator=g)
    ref_logp = logp + 0.1 * torch.randn(b, t, generator=g)
    scores = torch.randint(0, 2, (b,), generator=g).float()
    ids = (torch.arange(b) // 16)[torch.randperm(b, generator=g)]
    index = ids.numpy()
    algo = grpo()
    batch = {"old_logp": old_logp, "ref_logp": ref_logp, "scores": scores, "group_ids": ids, "mask": mask}

    def ours() -> torch.Tensor:
        lp = logp.clone().requires_grad_(True)
        loss, _ = algo.loss(algo.advantages({**batch, "logp": lp}))
        loss.backward()
        return lp.grad

    def peer() -> torch.Tensor:
        lp = logp.clone().requires_grad_(True)
        loss, _ = grpo_loss_peer(lp, old_logp, ref_logp, scores, index, mask)
        loss.backward()
        return lp.grad

    torch.testing.assert_close(ours(), peer(), rtol=1e-4, atol=1e-9)
    # Alternate the two so that load from other processes hits both alike.
    times: dict[str, list[float]] = {"ours": [], "peer": []}
    for _ in range(repeats * 4):
        for name, fn in (("ours", ours), ("peer", peer)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    _report("grpo loss + backward  [256, 1024]", statistics.median(times["ours"]), statistics.median(times["peer"]))


def bench_grpo_vs_vectorised(repeats: int) -> None:
    """Both sides on the same scores: first as rollouts are stored (the ``n_samples`` responses to a
    prompt side by side), which rlcore is told with ``group_size`` and verl reads from its index;
    then with the ids also passed to rlcore, which checks them against the layout on a CPU tensor
    (a full read of the ids); then shuffled (general ids, both sides given the same index)."""
    batch, size = 16384, 16
    groups = batch // size
    scores, shuffled = _grouped_scores(batch, size)
    contiguous = torch.arange(batch) // size
    for ids in (contiguous, shuffled):
        torch.testing.assert_close(
            grpo_advantages(scores, ids), grpo_vectorised_verl(scores, ids), rtol=1e-4, atol=1e-4
        )
    torch.testing.assert_close(
        grpo_advantages(scores, contiguous, group_size=size),
        grpo_vectorised_verl(scores, contiguous),
        rtol=1e-4,
        atol=1e-4,
    )
    compiled = torch.compile(lambda s, i: grpo_advantages(s, i, num_groups=groups))
    torch.testing.assert_close(
        grpo_advantages(scores, None, group_size=size), grpo_vectorised_verl(scores, contiguous), rtol=1e-4, atol=1e-4
    )
    fns = {
        "layout": lambda: grpo_advantages(scores, contiguous, group_size=size),
        "layout_no_ids": lambda: grpo_advantages(scores, None, group_size=size),
        "verl_layout": lambda: grpo_vectorised_verl(scores, contiguous),
        "ours": lambda: grpo_advantages(scores, shuffled, num_groups=groups),
        "ours_default": lambda: grpo_advantages(scores, shuffled),
        "verl": lambda: grpo_vectorised_verl(scores, shuffled),
    }
    t = alternated_medians(fns, repeats=repeats * 40, warmup=1)
    # The compiled function is first called only now: its worker threads, once started, slow
    # every eager call that follows on a busy machine, so the eager rows are timed before it.
    t.update(
        alternated_medians(
            {"ours_compiled": lambda: compiled(scores, shuffled), "verl": fns["verl"]}, repeats=repeats * 40, warmup=1
        )
    )
    report("grpo_advantages vs verl vectorised (group_size)", t["layout_no_ids"], t["verl_layout"], target=2.0)
    report("  same, ids also passed and checked on the CPU", t["layout"], t["verl_layout"])
    report("  shuffled ids, num_groups=G", t["ours"], t["verl"])
    report("  shuffled ids, num_groups=None (B segments)", t["ours_default"], t["verl"])
    report("  shuffled ids, torch.compile'd rlcore", t["ours_compiled"], t["verl"])


def bench_ppo_loss_vs_vanilla(repeats: int) -> None:
    """The headline row asks rlcore for a metric set like verl's (clip fractions and a KL estimate:
    ``ratio_stats=False``); the default, which adds the ratio mean, min and max, is printed beside it."""
    g = torch.Generator().manual_seed(4)
    b, t = 256, 1024
    mask = torch.arange(t) < torch.randint(t // 4, t + 1, (b, 1), generator=g)
    logp = torch.rand(b, t, generator=g).clamp(min=1e-3).log()
    old_logp = logp + 0.05 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    maskf = mask.float()

    def ours(loss_fn=ppo_clip_loss, ratio_stats=False):  # type: ignore[no-untyped-def]
        lp = logp.clone().requires_grad_(True)
        loss_t, _ = loss_fn(lp, old_logp, adv, mask, dual_clip=3.0, ratio_stats=ratio_stats)
        aggregate(loss_t, mask, mode="token-mean").backward()
        return lp.grad

    def verl(loss_fn=policy_loss_vanilla_verl):  # type: ignore[no-untyped-def]
        lp = logp.clone().requires_grad_(True)
        loss_fn(old_logp, lp, adv, maskf)[0].backward()
        return lp.grad

    def ours_loss(lp, old, a, m):  # type: ignore[no-untyped-def]
        """The same composition as verl's function: loss, metrics and the token-mean in one call."""
        loss_t, metrics = ppo_clip_loss(lp, old, a, m, dual_clip=3.0, ratio_stats=False)
        return aggregate(loss_t, m, mode="token-mean"), metrics

    # Compiled: each side's whole composition (loss, metrics, aggregation) is one compiled function.
    ours_c, verl_c = torch.compile(ours_loss), torch.compile(policy_loss_vanilla_verl)

    def ours_compiled() -> torch.Tensor:
        lp = logp.clone().requires_grad_(True)
        ours_c(lp, old_logp, adv, mask)[0].backward()
        return lp.grad

    torch.testing.assert_close(ours(), verl(), rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(ours(ratio_stats=True), verl(), rtol=1e-4, atol=1e-9)
    tm = alternated_medians(
        {"ours": ours, "ours_all": lambda: ours(ratio_stats=True), "verl": verl}, repeats=repeats * 4, warmup=1
    )
    # Compiled last (see bench_grpo_vs_vectorised): the eager rows are timed before any compiled call.
    torch.testing.assert_close(ours_compiled(), verl(verl_c), rtol=1e-4, atol=1e-9)
    tm.update(
        alternated_medians({"ours_c": ours_compiled, "verl_c": lambda: verl(verl_c)}, repeats=repeats * 4, warmup=1)
    )
    report("ppo_clip_loss+aggregate fwd+bwd vs verl vanilla", tm["ours"], tm["verl"], target=1.5)
    report("  same, with ratio mean/min/max (the default)", tm["ours_all"], tm["verl"])
    report("  same, both torch.compile'd", tm["ours_c"], tm["verl_c"])


# ------------------------------------------ issue 28: against the peers' own code (imported)


def _token_batch(b: int, t: int, seed: int) -> dict[str, torch.Tensor]:
    """A policy batch as both sides need it: padding zeros, log-probs < 0, one advantage per sequence."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(t) < torch.randint(t // 4, t + 1, (b, 1), generator=g)
    logp = torch.rand(b, t, generator=g).clamp(min=1e-3).log()
    old_logp = (logp + 0.05 * torch.randn(b, t, generator=g)).clamp(max=-1e-6)
    adv = torch.randn(b, 1, generator=g).expand(b, t)
    zero = torch.zeros(())
    return {
        "logp": torch.where(mask, logp, zero),
        "old_logp": torch.where(mask, old_logp, zero),
        "advantages": torch.where(mask, adv, zero),
        "mask": mask,
    }


# name -> (verl's function, rlcore's loss, rlcore keywords, verl's actor config); the same maths on
# both sides (the clip range, verl's ratio cap, the coefficients), each at its published default
# where the two share one.
POLICY_PEERS = {
    "dppo_tv": ("compute_policy_loss_dppo_tv", algos.dppo_tv_loss, {}, lambda: actor_config(0.15)),
    "dppo_kl": ("compute_policy_loss_dppo_kl", algos.dppo_kl_loss, {}, lambda: actor_config(0.05)),
    "dro": ("compute_policy_loss_dro", algos.dro_loss, {"beta": 0.05}, lambda: actor_config(0.2, dro_beta=0.05)),
    "clip_cov": (
        "compute_policy_loss_clip_cov",
        algos.clip_cov_loss,
        {"clip_low": 0.2, "clip_high": 0.2},
        lambda: actor_config(0.2, clip_cov_ratio=2e-4, clip_cov_lb=1.0, clip_cov_ub=5.0),
    ),
    "kl_cov": (
        "compute_policy_loss_kl_cov",
        algos.kl_cov_loss,
        {},
        lambda: actor_config(0.2, kl_cov_ratio=2e-4, ppo_kl_coef=1.0),
    ),
}


def bench_policy_losses_vs_verl(repeats: int) -> None:
    """Each loss + token-mean aggregation, forward and backward at [256, 1024], against verl's function
    with ``loss_agg_mode="token-mean"`` (its metrics read to the host, as verl returns them). The
    headline asks rlcore for a metric set like verl's (``ratio_stats=False``: the KL estimate and
    the loss's own fractions); the default, which adds the ratio's mean, min and max, is printed
    beside it. Clip-Cov draws the tokens it cuts at random on both sides, so its agreement is
    checked where every eligible token is cut (``cov_fraction=1``) and timed at the default."""
    verl = peer("verl.trainer.ppo.core_algos")
    if verl is None:
        return
    batch = _token_batch(256, 1024, seed=5)
    mask, maskf = batch["mask"], batch["mask"].float()

    def ours(fn, kw):  # type: ignore[no-untyped-def]
        def run() -> torch.Tensor:
            lp = batch["logp"].clone().requires_grad_(True)
            loss_t, _ = fn(lp, batch["old_logp"], batch["advantages"], mask, **kw)
            aggregate(loss_t, mask, mode="token-mean").backward()
            return lp.grad

        return run

    def theirs(fn, config):  # type: ignore[no-untyped-def]
        def run() -> torch.Tensor:
            lp = batch["logp"].clone().requires_grad_(True)
            fn(batch["old_logp"], lp, batch["advantages"], maskf, loss_agg_mode="token-mean", config=config)[
                0
            ].backward()
            return lp.grad

        return run

    fns: dict[str, Callable[[], object]] = {}
    for name, (peer_name, loss, kw, config) in POLICY_PEERS.items():
        peer_fn = getattr(verl, peer_name)
        if name == "clip_cov":
            all_cut = actor_config(0.2, clip_cov_ratio=1.0, clip_cov_lb=1.0, clip_cov_ub=5.0)
            want, got = theirs(peer_fn, all_cut)(), ours(loss, {**kw, "cov_fraction": 1.0})()
        else:
            want, got = theirs(peer_fn, config())(), ours(loss, kw)()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-9)
        fns[name], fns[f"{name}_verl"] = ours(loss, {**kw, "ratio_stats": False}), theirs(peer_fn, config())
        fns[f"{name}_all"] = ours(loss, kw)
    t = alternated_medians(fns, repeats=repeats * 4, warmup=1)
    for name in POLICY_PEERS:
        report(f"{name} loss+aggregate fwd+bwd vs verl [256,1024]", t[name], t[f"{name}_verl"], target=1.0)
        report("  same, with ratio mean/min/max (the default)", t[f"{name}_all"], t[f"{name}_verl"])
        # The same pair alternated on its own: the allocator's state then depends on these two calls only.
        alone = alternated_medians({"ours": fns[name], "verl": fns[f"{name}_verl"]}, repeats=repeats * 4, warmup=1)
        report("  same pair alternated on its own", alone["ours"], alone["verl"])


def bench_gdpo_vs_verl(repeats: int) -> None:
    """GDPO on 3 reward components, B = 2048 in groups of 16, T = 512: rlcore's estimator (per-sample
    advantages, then broadcast to the tokens and whitened over them as verl does, so both give the
    same [B, T]) against verl's ``compute_gdpo_outcome_advantage`` (one GRPO per component)."""
    verl = peer("verl.trainer.ppo.core_algos")
    if verl is None:
        return
    b, t, size = 2048, 512, 16
    g = torch.Generator().manual_seed(6)
    scores = torch.stack(
        [torch.randint(0, 2, (b,), generator=g).float(), torch.rand(b, generator=g), torch.randn(b, generator=g)], 1
    )
    ids = torch.arange(b) // size
    mask = torch.arange(t) < torch.randint(1, t + 1, (b, 1), generator=g)
    weights = [1.0, 0.5, 0.25]
    keys = ["acc", "fmt", "len"]
    non_tensor = {k: scores[:, i].numpy() for i, k in enumerate(keys)}
    peer_batch = {
        "prompts": torch.zeros(b, 1, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(b, 1, dtype=torch.long), mask.long()], 1),
    }
    config = PeerConfig(gdpo_reward_keys=keys, gdpo_reward_weights=weights)
    index = ids.numpy()
    maskf = mask.float()

    def ours() -> torch.Tensor:
        summed = algos.gdpo_advantages(scores, ids, weights=weights, batch_norm=False, group_size=size)
        return ops.masked_whiten(torch.where(mask, summed[:, None], 0.0), mask) * mask

    def ours_samples() -> torch.Tensor:
        return algos.gdpo_advantages(scores, ids, weights=weights, group_size=size)

    def theirs() -> torch.Tensor:
        adv, _ = verl.compute_gdpo_outcome_advantage(
            torch.zeros(b, t), maskf, index, config=config, non_tensor_batch=non_tensor, batch=peer_batch
        )
        return adv

    torch.testing.assert_close(ours(), theirs(), rtol=1e-4, atol=1e-4)
    tm = alternated_medians({"ours": ours, "ours_samples": ours_samples, "verl": theirs}, repeats=repeats, warmup=1)
    report("gdpo_advantages vs verl gdpo [2048x3, T=512]", tm["ours"], tm["verl"], target=1.0)
    report("  rlcore whitening samples (its default)", tm["ours_samples"], tm["verl"])


def bench_otb_vs_verl(repeats: int) -> None:
    """The optimal token baseline at [512, 1024] in groups of 16, single-turn and multi-turn (holes
    in the mask), against verl's ``compute_optimal_token_baseline_advantage`` and its ``tir_`` variant."""
    verl = peer("verl.trainer.ppo.core_algos")
    if verl is None:
        return
    b, t, size = 512, 1024, 16
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(t // 4, t + 1, (b, 1), generator=g)
    plain = torch.arange(t) < lengths
    holes = plain & (torch.rand(b, t, generator=g) > 0.1)
    probs = torch.rand(b, t, generator=g).clamp(min=1e-3)
    old_logp = probs.log()
    sum_sq = probs.square() + 0.1 * torch.rand(b, t, generator=g) * (1 - probs).square()
    ids = torch.arange(b) // size
    index = ids.numpy()
    fns: dict[str, Callable[[], object]] = {}
    for multi, mask in ((False, plain), (True, holes)):
        rewards = torch.zeros(b, t)
        last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask
        rewards[last] = torch.randint(0, 2, (int(last.sum()),), generator=g).float()
        maskf = mask.float()
        peer_fn = (
            verl.compute_multi_turn_optimal_token_baseline_advantage
            if multi
            else verl.compute_optimal_token_baseline_advantage
        )

        def ours(r=rewards, m=mask, multi=multi):  # type: ignore[no-untyped-def]
            return algos.optimal_token_baseline_advantages(
                r, old_logp, sum_sq, m, ids, multi_turn=multi, num_groups=b // size
            )[0]

        def theirs(r=rewards, m=maskf, fn=peer_fn):  # type: ignore[no-untyped-def]
            return fn(r, m, index, old_logp, sum_sq)[0]

        torch.testing.assert_close(ours(), theirs(), rtol=1e-4, atol=1e-4)
        key = "multi" if multi else "single"
        fns[key], fns[f"{key}_verl"] = ours, theirs
    tm = alternated_medians(fns, repeats=repeats, warmup=1)
    report("optimal token baseline vs verl [512, 1024]", tm["single"], tm["single_verl"], target=1.0)
    report("  multi-turn (tir_), 10% holes in the mask", tm["multi"], tm["multi_verl"], target=1.0)


def bench_jsd_vs_trl(repeats: int) -> None:
    """GKD's generalised JSD (beta 0.5, and the reverse KL at beta 1) + token mean, forward and backward
    on [8, 256, 4096] logits, against TRL's ``GKDTrainer.generalized_jsd_loss`` (``batchmean`` over labels)."""
    gkd = peer("trl.experimental.gkd.gkd_trainer")
    if gkd is None:
        return
    b, t, v = 8, 256, 4096
    g = torch.Generator().manual_seed(8)
    student, teacher = 2 * torch.randn(b, t, v, generator=g), 2 * torch.randn(b, t, v, generator=g)
    mask = torch.arange(t) < torch.randint(t // 4, t + 1, (b, 1), generator=g)
    labels = torch.where(mask, 1, -100)
    trl_loss = gkd.GKDTrainer.generalized_jsd_loss
    fns: dict[str, Callable[[], object]] = {}
    for beta in (0.5, 1.0):

        def ours(beta=beta):  # type: ignore[no-untyped-def]
            s = student.clone().requires_grad_(True)
            loss_t, _ = algos.generalized_jsd_loss(s, teacher, mask, beta=beta)
            aggregate(loss_t, mask, mode="token-mean").backward()
            return s.grad

        def theirs(beta=beta):  # type: ignore[no-untyped-def]
            s = student.clone().requires_grad_(True)
            trl_loss(s, teacher, labels=labels, beta=beta).backward()
            return s.grad

        torch.testing.assert_close(ours(), theirs(), rtol=1e-4, atol=1e-9)
        fns[f"ours{beta}"], fns[f"trl{beta}"] = ours, theirs
    tm = alternated_medians(fns, repeats=repeats, warmup=1)
    report("generalized_jsd_loss fwd+bwd vs TRL [8,256,4096]", tm["ours0.5"], tm["trl0.5"], target=1.0)
    report("  beta = 1 (reverse KL)", tm["ours1.0"], tm["trl1.0"], target=1.0)


def bench_reward_loss_vs_trl(repeats: int) -> None:
    """The reward-model loss (Bradley-Terry with margins and centring, and its metrics), forward and
    backward on 8192 pairs, against TRL's ``RewardTrainer.compute_loss`` (its model a lookup of the
    same rewards, its metrics read to the host as TRL logs them)."""
    reward = peer("trl.trainer.reward_trainer")
    if reward is None:
        return
    pairs = 8192
    g = torch.Generator().manual_seed(9)
    chosen, rejected = 3 * torch.randn(pairs, generator=g), 3 * torch.randn(pairs, generator=g)
    margin = torch.rand(pairs, generator=g)
    recipe = algos.rm(center_coef=0.01)
    fake = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        args=types.SimpleNamespace(center_rewards_coefficient=0.01),
        accelerator=types.SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
    )

    def ours() -> torch.Tensor:
        c, r = chosen.clone().requires_grad_(True), rejected.clone().requires_grad_(True)
        batch = {"chosen_rewards": c, "rejected_rewards": r, "margins": margin}
        recipe.loss(batch, **recipe.global_counts(batch))[0].backward()
        return c.grad

    def theirs() -> torch.Tensor:
        c, r = chosen.clone().requires_grad_(True), rejected.clone().requires_grad_(True)
        fake._metrics.clear()

        def model(**_):  # type: ignore[no-untyped-def]
            return types.SimpleNamespace(logits=torch.cat([c, r])[:, None])

        inputs = {"attention_mask": torch.ones(2 * pairs, 1, dtype=torch.long), "margin": margin}
        reward.RewardTrainer.compute_loss(fake, model, inputs).backward()
        return c.grad

    torch.testing.assert_close(ours(), theirs(), rtol=1e-4, atol=1e-9)
    tm = alternated_medians({"ours": ours, "trl": theirs}, repeats=repeats * 20, warmup=1)
    report("reward-model loss fwd+bwd vs TRL RewardTrainer (8192)", tm["ours"], tm["trl"], target=1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each loop baseline")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both sides)")
    parser.add_argument("--only", default="", help="run only the benchmarks whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), medians over timed runs")

    benchmarks: list[Callable[[int], None]] = [
        # advantage estimators (rlcore.algos.advantages)
        bench_grpo,
        bench_rloo,
        bench_gae,
        # losses and recipes: one full GRPO loss + backward on [256, 1024] tokens
        bench_grpo_loss,
        # against verl's vectorised implementations (issue 17)
        bench_grpo_vs_vectorised,
        bench_ppo_loss_vs_vanilla,
        # issue 28: newer estimators and losses against the peers' own code (skipped when absent)
        bench_policy_losses_vs_verl,
        bench_gdpo_vs_verl,
        bench_otb_vs_verl,
        bench_jsd_vs_trl,
        bench_reward_loss_vs_trl,
    ]
    for bench in benchmarks:
        if args.only in bench.__name__:
            bench(args.repeats)


if __name__ == "__main__":
    main()
