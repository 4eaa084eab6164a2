"""What happens when a step's last update is done: the weights published, the record logged, the run saved."""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlcore.models import export_hf, export_reward_model
from rlcore.rewards import RewardPool, reward_log_values
from rlcore.train.config import Config
from rlcore.train.deploy import Deployment
from rlcore.train.metrics import MetricsLog
from rlcore.train.optim import Models, Optimiser
from rlcore.train.parallel import full_state_dict
from rlcore.train.preemption import Preempted, StopRequest
from rlcore.train.run_state import save_run, save_run_async
from rlcore.train.step_metrics import StepMetrics
from rlcore.train.tagged_metrics import as_tensors, mean, total
from rlcore.train.validation import Validator
from rlcore.train.world import World

__all__ = ["StepEnd"]


class StepEnd:
    """The update stage's ``on_iteration_end``: one call per step, on every rank.

    It publishes weights version ``i + 1``, reduces the step's metrics over the
    data-parallel ranks, runs the validation when due, saves the checkpoint (and the
    Hugging Face export) every ``trainer.save_every`` steps and at the last, and logs the
    record (rank 0: ``metrics.jsonl`` and, every ``trainer.log_samples`` steps,
    ``samples.jsonl``) with the seconds the save held the step up (``checkpoint_stall_s``).
    With ``trainer.async_save`` the checkpoint is written in the background while the next
    steps train; a save first waits for the one before it. When no phase switch moves the
    training state (``deployment.switch`` is None), even the copy of the state to host
    memory runs in the background, through the next step's rollout, scoring and forwards:
    only the optimiser step changes the state, and the first one after the save waits for
    the copy (a step pre-hook). ``checkpoint_stall_s`` counts that wait in the step it
    held up, beside the step's own save call. When the switch moves the state (the
    co-located swap), the save copies nothing either: its copy is the one the next switch
    to the rollout phase makes anyway (``deployment.staging``,
    :class:`rlcore.train.swap_staging.SwapStaging`), or, should an optimiser step or the
    end of the run come first, one taken then.

    When ``stop`` is set on any rank (a signal of ``trainer.stop_signals``), the ranks agree
    to stop at this step: it is saved, the save is waited for, and :class:`Preempted` is
    raised. ``records`` holds every step's record; :meth:`close` waits for the last save and
    closes the logs.
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
        stop: StopRequest | None = None,
        extras: Mapping[str, Any] | None = None,
    ):
        tr = cfg.trainer
        self.stop = stop
        self.pending: Future[Path] | None = None
        self.staged: Future[None] | None = None  # the copy the next optimiser step waits for
        self.staging_wait = 0.0
        self.stage_in_background = tr.async_save and deployment.switch is None
        # A switch that moves the state gives a background save its copy (the swap's), fenced like the background copy.
        self.staging = deployment.staging if tr.async_save else None
        fenced = self.stage_in_background or self.staging is not None
        self.hooks = [o.register_step_pre_hook(self._before_update) for o in opt.opts] if fenced else []
        # The background saves synchronise over a group of their own (gloo: DCP's async save needs a CPU
        # backend), so that their collectives never interleave with the training's.
        self.save_group = dist.new_group(backend="gloo") if tr.async_save and dist.is_initialized() else None
        self.cfg, self.world, self.task, self.models, self.opt, self.replica = cfg, world, task, models, opt, replica
        self.deployment, self.rewards, self.steps, self.start, self.shapes = deployment, rewards, steps, start, shapes
        self.validator = validator
        self.extras = dict(extras or {})  # saved with every checkpoint (rlcore.train.run_state.run_extras)
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
        if tr.max_worker_restarts and self.rewards.num_workers:  # reward worker processes replaced so far
            record["reward_worker_restarts"] = float(self.rewards.restarts)
        if "entropy_target" in self.extras:  # rl.entropy_target: the step's entropy sets the next step's bonus
            record.update(self.extras["entropy_target"].end_step(record["entropy"]))
        if self.validator is not None and self.validator.due(step):
            record.update(self.validator(self.models.policy if world.size == 1 else self.replica, step))
        # Every rank reads the same answer (a signal may reach the ranks at different steps).
        stop = bool(tr.stop_signals) and world.any(
            torch.tensor(float(self.stop is not None and self.stop.is_set()), device=world.device)
        )
        due = (tr.save_every and (step + 1) % tr.save_every == 0) or step + 1 == tr.steps
        stall, self.staging_wait = self.staging_wait, 0.0
        record["checkpoint_stall_s"] = stall + (self._save(step) if due or stop else 0.0)
        self.records.append(record)
        if self.log is not None:
            self.log.write(record)
        if stop:
            self.wait_saved()
            if self.stop is not None:
                self.stop.disarm()  # saved: closing the workers must not be cut short by trainer.stop_timeout
            if step + 1 < tr.steps:
                by = self.stop.signal_name if self.stop is not None and self.stop.is_set() else "a peer"
                raise Preempted(step, by)

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

    def _save(self, step: int) -> float:
        """Save the run after ``step`` (every rank: DCP writes its shards); the seconds it held the step up."""
        t0 = time.perf_counter()
        self.wait_saved()
        if self.cfg.trainer.async_save:
            self.pending = save_run_async(
                self.out,
                step,
                self.models,
                self.opt,
                self.cfg,
                self.shapes,
                self.extras,
                process_group=self.save_group,
                stage_in_background=self.stage_in_background,
                staging=self.staging,
            )
            self.staged = self.pending.staged
        else:
            save_run(self.out, step, self.models, self.opt, self.cfg, self.shapes, self.extras)
        self._export()
        return time.perf_counter() - t0

    def _before_update(self, *_: Any) -> None:
        """Every optimiser step's pre-hook: the state must not change before the save in flight has copied it."""
        staged, self.staged = self.staged, None
        if staged is not None:
            t0 = time.perf_counter()
            if self.staging is not None:
                self.staging.fence()  # no switch has moved the state since the save: its copy is taken now
            staged.result()  # a failed copy also fails the save: wait_saved raises it
            self.staging_wait += time.perf_counter() - t0

    def wait_saved(self) -> None:
        """Wait until the background save in flight (if any) is committed; its error is raised here."""
        pending, self.pending, self.staged = self.pending, None, None
        if pending is not None:
            if self.staging is not None:
                self.staging.fence()  # the copy may still wait for a switch that will not come
            pending.result()

    def _export(self) -> None:
        if not self.cfg.trainer.export:
            return
        # The policy as a Hugging Face directory beside the checkpoint; a built-in task's
        # character tokenizer is written as a transformers one.
        tok = self.task.tokenizer if self.task.hf_tokenizer is None else self.task.hf_tokenizer
        if self.cfg.rl.algo == "rm":  # the trained reward model, as the reward_model reward loads it
            self._export_reward_model(tok)
            return
        if self.world.size == 1:
            export_hf(self.models.policy, self.out / "hf", tokenizer=tok)
        else:  # gathered (collective), written into the unsharded architecture by rank 0
            weights = full_state_dict(self.models.policy)
            if self.world.rank == 0:
                export_hf(self.replica, self.out / "hf", tokenizer=tok, params=weights)

    def _export_reward_model(self, tok: Any) -> None:
        critic = self.models.critic
        assert critic is not None
        if self.world.size == 1:
            export_reward_model(critic, self.out / "reward_model", tokenizer=tok)
        else:  # gathered (collective), written by rank 0
            weights = full_state_dict(critic)
            if self.world.rank == 0:
                export_reward_model(critic, self.out / "reward_model", tokenizer=tok, params=weights)

    def close(self) -> None:
        try:
            self.wait_saved()  # also after an error: the state it holds was whole at its step's end
        finally:
            for hook in self.hooks:
                hook.remove()
            for log in (self.log, self.sample_log):
                if log is not None:
                    log.close()
