"""One step's record: the recipe's metrics accumulated over the updates, the rollout's, and each stage's busy time."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rlcore import algos
from rlcore.dataflow import Stage
from rlcore.ops import masked_sum
from rlcore.train.config import Config
from rlcore.train.tagged_metrics import Metric, as_tensors, maximum, mean, merge_into, total

__all__ = ["StepMetrics", "stale_weigher"]


def stale_weigher(cfg: Config) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``rl.stale_after`` / ``rl.stale_mode`` / ``rl.stale_decay`` as a lag -> row weight function (None: off)."""
    rl = cfg.rl
    if rl.stale_after is None:
        return None
    return functools.partial(algos.staleness_weights, max_lag=rl.stale_after, mode=rl.stale_mode, decay=rl.stale_decay)


def _mismatch(rollout_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, Metric]:
    """How far the sampler's log-probs are from the trainer's ``old_logp`` over the response tokens.

    The engine's numerics (another kernel, batch or precision) and, with
    ``deploy.async_infer``, the policy lag both show here: sums of ``|old - rollout|``
    and of the k3 estimate of ``KL(pi_rollout || pi_old)`` (samples are the sampler's),
    and the largest gap.
    """
    on = mask != 0
    gap = torch.where(on, (old_logp.float() - rollout_logp.float()).abs(), 0.0)
    kl = algos.kl_penalty(rollout_logp.float(), old_logp.float(), estimator="k3")  # masked_sum drops the padding
    return {
        "mismatch_abs": total(gap.sum()),
        "mismatch_max": maximum(gap.max() if gap.numel() else gap.new_zeros(())),
        "mismatch_kl": total(masked_sum(kl, mask)),
    }


def _token_lags(
    iteration: torch.Tensor, token_version: torch.Tensor, mask: torch.Tensor, top: int
) -> dict[str, Metric]:
    """Sums of each policy token's lag ``iteration - token_version``, its largest, and tokens per lag ``0..top``.

    A partial rollout's row holds tokens of several versions: the row's lag is its oldest
    token's, these are every token's (the histogram's last bin counts lags of ``top`` and more).
    """
    on = mask != 0
    lag = torch.where(on, iteration[:, None] - token_version, 0)
    out = {
        "token_lag": total(lag.float().sum()),
        "token_lag_max": maximum(lag.max().float() if lag.numel() else lag.new_zeros((), dtype=torch.float32)),
    }
    for k in range(top + 1):
        hit = on & ((lag == k) if k < top else (lag >= k))
        out[f"token_lag/{k}"] = total(hit.float().sum())
    return out


class StepMetrics:
    """Accumulates one step's metrics over its updates; at the step's end, the record (logged, checkpointed)."""

    def __init__(
        self,
        updates: int,
        start: int,
        ref_every: int = 1,
        token_lags: int = 0,
        stale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        # token_lags > 0 (deploy.async_infer: its staleness): the per-token lag and its histogram are logged;
        # stale (rl.stale_after): the rows' staleness weights, whose drops and mean are logged.
        self.updates, self.start, self.ref_every, self.token_lags = updates, start, ref_every, token_lags
        self.stale = stale
        self.lock = threading.Lock()
        # Per step: the logged metrics, and the counts the logged ratios are made of.
        self.sums: dict[int, tuple[dict[str, Metric], dict[str, Metric]]] = {}
        self.spans: list[tuple[str, str, float, float]] = []
        self.last_end = time.perf_counter()

    @classmethod
    def of_run(cls, cfg: Config, *, start: int, ref_every: int) -> StepMetrics:
        """The step metrics of a run of ``cfg`` starting at step ``start``."""
        rl, d = cfg.rl, cfg.deploy
        return cls(
            updates=rl.batch_size // rl.mini_batch_size * rl.epochs,
            start=start,
            ref_every=ref_every,
            token_lags=d.staleness if d.async_infer else 0,
            stale=stale_weigher(cfg),
        )

    def on_metrics(self, b: dict[str, torch.Tensor], loss: torch.Tensor, metrics: dict[str, Any]) -> None:
        step = int(b["iteration"][0])
        # The recipe's metrics are the whole batch's on every rank (DataParallelRecipe): averaged;
        # the update's own (e.g. the dispatch's balance) come tagged. The loss is this rank's share
        # of a loss normalised by global counts: the step's loss adds the shares' means over updates.
        stats = {
            "loss": total(loss.detach().float() / self.updates),
            **{k: v if isinstance(v, Metric) else mean(v) for k, v in metrics.items()},
        }
        counts = {
            "rows": total(float(b["iteration"].shape[0])),
            "prompt_tokens": total((b["prompt_mask"] != 0).sum()),
        }
        if "sft_mask" in b:  # SFT: the dataset's demonstrations
            counts["response_tokens"] = total((b["sft_mask"] != 0).sum())
        elif "scores" not in b:  # offline DPO: the dataset's pairs, no rollout (mean of both responses' lengths)
            counts["response_tokens"] = total(((b["chosen_mask"] != 0).sum() + (b["rejected_mask"] != 0).sum()) / 2)
        else:
            mask = b["mask"]
            lag = (b["iteration"] - self.start - b["version"]).float()  # versions counted from this run's first step
            if self.ref_every and step % self.ref_every == 0:  # the steps the reference forward ran
                counts["kl"] = total(masked_sum(algos.kl_penalty(b["old_logp"], b["ref_logp"], estimator="k3"), mask))
            if "rollout_logp" in b:  # the sampler's log-probs against the trainer's
                counts.update(_mismatch(b["rollout_logp"], b["old_logp"], mask))
            counts.update(
                reward=total(b["scores"].float().sum()),
                entropy=total(masked_sum(b["entropy"], mask)),
                tokens=total(mask.float().sum()),
                response_tokens=total((mask != 0).sum(-1).float().sum()),
                lag=total(lag.sum()),
                lag_max=maximum(lag.max()),
            )
            if self.stale is not None:  # rl.stale_after: rows dropped, and the mean row weight
                w = self.stale(b["iteration"] - self.start - b["version"]).float()
                counts.update(stale_dropped=total((w == 0).float().sum()), stale_weight=total(w.sum()))
            if self.token_lags:
                counts.update(_token_lags(b["iteration"] - self.start, b["token_version"], mask, self.token_lags))
        with self.lock:
            acc = self.sums.setdefault(step, ({}, {}))
            merge_into(acc[0], stats)
            merge_into(acc[1], counts)

    def timed(self, s: Stage) -> Stage:
        fn = s.fn

        def run(b: dict[str, torch.Tensor]) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(b)
            finally:
                with self.lock:
                    self.spans.append((s.name, s.resource, t0, time.perf_counter()))

        return dataclasses.replace(s, fn=run)

    def local(
        self, step: int, reduce: Callable[[dict[str, Metric]], dict[str, Metric]] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The step's metrics and its timing (busy seconds per stage, idle fraction per resource).

        ``reduce`` merges this rank's metrics with the other data-parallel ranks' before
        the ratios are taken (:meth:`rlcore.train.world.World.reduce`).
        """
        with self.lock:
            acc = self.sums.pop(step)
            now = time.perf_counter()
            window = max(now - self.last_end, 1e-9)
            spans = [(n, r, max(a, self.last_end), min(b, now)) for n, r, a, b in self.spans if b > self.last_end]
            self.spans = [sp for sp in self.spans if sp[3] > now]
            self.last_end = now
        stats, counts = acc
        if reduce is not None:
            stats, counts = reduce(stats), reduce(counts)
        out, c = as_tensors(stats), as_tensors(counts)
        rows = c["rows"]
        out.update(response_length=c["response_tokens"] / rows, prompt_length=c["prompt_tokens"] / rows)
        if "reward" in c:  # rollouts (not offline DPO)
            out.update(
                reward=c["reward"] / rows,  # the task reward, before any shaping
                entropy=c["entropy"] / c["tokens"],
                policy_lag=c["lag"] / rows,
                policy_lag_max=c["lag_max"],
            )
            if "stale_weight" in c:
                out.update({"stale/dropped": c["stale_dropped"] / rows, "stale/weight": c["stale_weight"] / rows})
            if "token_lag" in c:  # each policy token's lag: mean, largest, and the share of tokens at each lag
                out.update(token_lag=c["token_lag"] / c["tokens"], token_lag_max=c["token_lag_max"])
                out.update({f"token_lag/{k}": c[f"token_lag/{k}"] / c["tokens"] for k in range(self.token_lags + 1)})
            if "kl" in c:  # k3 estimate of KL(rollout policy || reference) per token: the curve in the plot
                out["kl"] = c["kl"] / c["tokens"]
            if "mismatch_abs" in c:
                out.update(
                    {
                        "mismatch/logp_abs_mean": c["mismatch_abs"] / c["tokens"],
                        "mismatch/logp_abs_max": c["mismatch_max"],
                        "mismatch/kl": c["mismatch_kl"] / c["tokens"],
                    }
                )
        timing: dict[str, float] = {"step_time_s": window}
        busy: dict[str, float] = {}
        for name, resource, a, b in spans:
            timing[f"busy_s/{name}"] = timing.get(f"busy_s/{name}", 0.0) + (b - a)
            busy[resource] = busy.get(resource, 0.0) + (b - a)
        for resource, seconds in busy.items():
            timing[f"bubble/{resource}"] = max(0.0, 1.0 - seconds / window)
        return out, timing
