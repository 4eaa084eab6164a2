"""What happens when a step's last update is done: the weights published, the record logged, the run saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rlcore.models import export_hf
from rlcore.rewards import RewardPool, reward_log_values
from rlcore.train.config import Config
from rlcore.train.deploy import Deployment
from rlcore.train.metrics import MetricsLog
from rlcore.train.optim import Models, Optimiser
from rlcore.train.parallel import full_state_dict
from rlcore.train.run_state import save_run
from rlcore.train.step_metrics import StepMetrics
from rlcore.train.tagged_metrics import as_tensors, mean, total
from rlcore.train.validation import Validator
from rlcore.train.world import World

__all__ = ["StepEnd"]


class StepEnd:
    """The update stage's ``on_iteration_end``: one call per step, on every rank.

    It publishes weights version ``i + 1``, reduces the step's metrics over the
    data-parallel ranks, logs the record (rank 0: ``metrics.jsonl`` and, every
    ``trainer.log_samples`` steps, ``samples.jsonl``), runs the validation when due, and
    saves the checkpoint (and the Hugging Face export) every ``trainer.save_every`` steps
    and at the last. ``records`` holds every step's record; :meth:`close` closes the logs.
    """

    def __init__(
        self,
        cfg: Config,
        world: World,
        task: Any,
        models: Models,
        opt: Optimiser,
        replica: torch.nn.Module,
        *,
        deployment: Deployment,
        rewards: RewardPool,
        steps: StepMetrics,
        start: int,
        resume: bool,
        shapes: dict[str, list[int]],
        validator: Validator | None,
    ):
        tr = cfg.trainer
        self.cfg, self.world, self.task, self.models, self.opt, self.replica = cfg, world, task, models, opt, replica
        self.deployment, self.rewards, self.steps, self.start, self.shapes = deployment, rewards, steps, start, shapes
        self.validator = validator
        self.out = Path(tr.output_dir)
        self.records: list[dict[str, Any]] = []
        leader, last = world.rank == 0, start - 1 if resume else None
        self.log = (
            MetricsLog(self.out / "metrics.jsonl", total=tr.steps, start=start, progress=tr.progress, resume_step=last)
            if leader
            else None
        )
        self.sample_log = (
            MetricsLog(self.out / "samples.jsonl", total=tr.steps, start=start, progress=False, resume_step=last)
            if leader and tr.log_samples
            else None
        )

    def __call__(self, i: int) -> None:
        step, tr, world = self.start + i, self.cfg.trainer, self.world
        self.deployment.publish(i + 1)  # weights version i + 1 for the rows the scheduler stamps next
        record = {"step": step, **self._metrics(step), **self.deployment.step_metrics(), **self.task.step_metrics(step)}
        if self.validator is not None and self.validator.due(step):
            record.update(self.validator(self.models.policy if world.size == 1 else self.replica, step))
        self.records.append(record)
        if self.log is not None:
            self.log.write(record)
        if (tr.save_every and (step + 1) % tr.save_every == 0) or step + 1 == tr.steps:
            self._save(step)

    def _metrics(self, step: int) -> dict[str, float]:
        world, rl = self.world, self.cfg.rl
        local, timing = self.steps.local(step, world.reduce)
        extra = self.deployment.rollout_metrics(step)
        if extra:  # the rollout's per-trajectory means, averaged over the ranks
            local.update(as_tensors(world.reduce({k: mean(v) for k, v in extra.items()})))
        metrics = {k: float(v) for k, v in local.items()}
        # The reward's counters (verified-maths timeouts, ...), summed over the data-parallel ranks.
        # Each weighted reward's mean raw score (reward/<name>) from the summed counters.
        counts = self.rewards.pop_metrics(step)
        if counts:
            summed = as_tensors(world.reduce({k: total(v) for k, v in counts.items()}))
            logged = reward_log_values({k: float(v) for k, v in summed.items()})
            metrics.update({f"reward/{k}": v for k, v in logged.items()})
        rows = self.rewards.pop_samples(step)
        if self.sample_log is not None and step % self.cfg.trainer.log_samples == 0:
            for row in rows:
                self.sample_log.write({"step": step, **row})
        samples = world.dp_size * rl.batch_size * rl.n_samples
        # As the seed system defines it: (prompt + response tokens) x samples / devices / step time.
        metrics["tokens_per_s_device"] = (
            (metrics["prompt_length"] + metrics["response_length"]) * samples / world.size / timing["step_time_s"]
        )
        return {**metrics, **timing}

    def _save(self, step: int) -> None:
        save_run(self.out, step, self.models, self.opt, self.cfg, self.shapes)  # every rank: DCP writes its shards
        if not self.cfg.trainer.export:
            return
        # The policy as a Hugging Face directory beside the checkpoint; a built-in task's
        # character tokenizer is written as a transformers one.
        tok = self.task.tokenizer if self.task.hf_tokenizer is None else self.task.hf_tokenizer
        if self.world.size == 1:
            export_hf(self.models.policy, self.out / "hf", tokenizer=tok)
        else:  # gathered (collective), written into the unsharded architecture by rank 0
            weights = full_state_dict(self.models.policy)
            if self.world.rank == 0:
                export_hf(self.replica, self.out / "hf", tokenizer=tok, params=weights)

    def close(self) -> None:
        for log in (self.log, self.sample_log):
            if log is not None:
                log.close()
