"""The multi-turn rollout of :mod:`rlcore.agent` as the trainer's rollout stage, and the step's stages adapted to trajectories.

With ``rl.multi_turn`` one RL step is the same pipeline over the Transfer Dock, with
the rollout and reward stages replaced by one stage::

    loader(step)   -> prompts, prompt_mask, answers, group, iteration
    rollout        -> responses, mask, trajectory_mask, rewards, scores, rollout_logp, version, counts
                      (rlcore.agent.multi_turn_stage: the environments step and score)
    old_logp, ref_logp (old_values)   attend the whole trajectory: trajectory_mask
    advantages     -> advantages, loss_mask (+ returns)       rewards: each turn's reward (PPO / GAE)
    update         -> loss     the forward attends trajectory_mask; the recipe's mask is loss_mask

Token columns are ``[N, R]`` over the response positions, padded to the iteration's
longest trajectory: ``responses`` (policy and observation ids in the order they were
produced), ``mask`` (1.0 on the policy's tokens: the recipes' mask, so observation and
prompt tokens get no gradient), ``trajectory_mask`` (1.0 on every response token, the
attention of the forwards), ``rewards`` (each turn's reward on its last token) and
``rollout_logp``. ``scores`` is the environment's outcome reward.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from rlcore import algos, seeding
from rlcore.agent import build_env_factory, multi_turn_stage, parse_multi_turn, stop_token_ids, trajectory_metrics
from rlcore.dataflow import Stage, stage
from rlcore.train.columns import COLUMNS
from rlcore.train.config import Config
from rlcore.train.rollout import left_pad
from rlcore.train.stages import advantages_stage

__all__ = [
    "ROLLOUT_COLUMNS",
    "ROLLOUT_INPUTS",
    "MultiTurnRollout",
    "check_multi_turn",
    "multi_turn_graph",
    "multi_turn_rollout_stage",
]

Batch = dict[str, Any]

# Dock columns the trainer's multi-turn rollout stage writes.
ROLLOUT_COLUMNS = COLUMNS.select(
    "responses",
    "mask",
    "trajectory_mask",
    "rewards",
    "scores",
    "rollout_logp",
    "version",
    "token_version",
    "num_turns",
    "num_tool_calls",
    "num_tool_errors",
    "tool_latency",
)


# Dock columns it reads (with the dock's answers_mask and policy_version).
ROLLOUT_INPUTS = ("prompts", "prompt_mask", "answers", "iteration", "row")


class MultiTurnRollout(NamedTuple):
    """What :func:`multi_turn_rollout_stage` builds: the stage and ``pop_metrics(step)``, that step's trajectory metrics."""

    stage: Stage
    pop_metrics: Callable[[int], dict[str, torch.Tensor]]


def _pad(rows: Sequence[torch.Tensor], value: float = 0) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True, padding_value=value)


def check_multi_turn(cfg: Config, task: Any) -> None:
    """Build what ``rl.multi_turn`` names once, so that its errors come before any training step or warm-up.

    Loads the tools and the environment factory (:func:`rlcore.agent.build_env_factory`:
    references, ``env_options`` against the factory's parameters) and resolves the stop
    tokens with the task's tokenizer (:func:`rlcore.agent.stop_token_ids`: each one token).
    Raises ``ValueError`` naming the config key.
    """
    mt = parse_multi_turn(cfg.rl.multi_turn)
    build_env_factory(mt, reward=task.reward)
    stop_token_ids(mt, task.tokenizer)


def multi_turn_rollout_stage(cfg: Config, model: Any, task: Any, *, timeout: float | None = None) -> MultiTurnRollout:
    """The trainer's rollout stage for ``rl.multi_turn``: :func:`rlcore.agent.multi_turn_stage` on the dock's prompts.

    ``model`` is the rollout's model (the co-located engine's, whose weights the
    AllGather-Swap binds at each switch to the rollout phase), or the vLLM engine
    (:class:`rlcore.agent.TurnSampler`) with ``deploy.engine: vllm``. The environments come
    from ``rl.multi_turn`` (:func:`rlcore.agent.build_env_factory`, scored by
    ``task.reward``; relative ``file.py`` references are taken from the working
    directory); each gets ``{"prompt", "answer"}`` decoded from the dock's row. The
    sampling stream is keyed by ``trainer.seed``, the step and each row's ``row``
    (:mod:`rlcore.seeding`), so a resumed run samples what the uninterrupted one would,
    at any data-parallel size. Every
    ``rl.multi_turn.eval_every`` steps (and at the last step) a greedy rollout on a fixed
    set of ``eval_size`` prompts is scored too (``greedy_reward``).

    Args:
      cfg: the run's config (``rl.multi_turn`` set).
      model: the policy the rollout samples from (a module or a turn-sampling engine).
      task: the task (``tokenizer``, ``reward``, ``sample``).
      timeout: seconds one call may take.

    Returns:
      A :class:`MultiTurnRollout`: a rollout-role stage
      ``prompts, prompt_mask, answers, iteration, row ->`` :data:`ROLLOUT_COLUMNS`, and the
      per-step metrics of :func:`rlcore.agent.trajectory_metrics` (with ``greedy_reward``
      on evaluation steps), averaged over the step's trajectories.
    """
    mt = parse_multi_turn(cfg.rl.multi_turn)
    rl, tok = cfg.rl, task.tokenizer
    make_env = build_env_factory(mt, reward=task.reward)
    lock = threading.Lock()
    pending: dict[int, dict[str, torch.Tensor]] = {}
    # The fixed greedy-evaluation prompts, drawn only when there is an evaluation (eval_size may be large).
    eval_seed = seeding.generator(cfg.trainer.seed, seeding.Purpose.EVAL_PROMPTS, 0)
    eval_samples = task.sample(mt.eval_size, eval_seed) if mt.eval_every else []

    def to_sample(b: Batch, row: int) -> dict[str, str]:
        prompt = b["prompts"][row][b["prompt_mask"][row] != 0]
        answer = b["answers"][row][b["answers_mask"][row] != 0]
        return {"prompt": tok.decode(prompt.tolist()), "answer": tok.decode(answer.tolist())}

    def run(b: Batch, temperature: float, seed: int) -> dict[str, Any]:
        inner = multi_turn_stage(
            model,
            tok,
            make_env,
            mt,
            inputs=("prompts", "answers"),
            to_sample=to_sample,
            temperature=temperature,
            top_p=rl.top_p,
            top_k=rl.top_k,
            seed=seed,
        )
        return dict(inner.fn(b))

    def rollout(b: Batch) -> dict[str, Any]:
        step = int(b["iteration"][0])
        seed = cfg.trainer.seed
        inner = {
            "prompts": b["prompts"],
            "prompt_mask": b["prompt_mask"],
            "answers": b["answers"],
            "answers_mask": b["answers_mask"],
            "policy_version": b["policy_version"],
            "iteration": b["iteration"],
            "row": b["row"],
        }
        rows = run(inner, rl.temperature, seed)
        traj = {
            "responses": _pad(rows["responses"], tok.pad_token_id),
            "mask": _pad(rows["mask"]),
            "trajectory_mask": _pad(rows["trajectory_mask"]),
            "rewards": _pad([r.float() for r in rows["rewards"]]),
            "rollout_logp": _pad([r.float() for r in rows["rollout_logp"]]),
            "scores": rows["scores"].float(),
        }
        counts = {k: rows[k] for k in ("num_turns", "num_tool_calls", "num_tool_errors", "tool_latency")}
        metrics = trajectory_metrics(
            {
                **counts,
                "num_env_errors": rows["num_env_errors"],
                "truncated": rows["truncated"],
                "mask": traj["mask"],
                "trajectory_mask": traj["trajectory_mask"],
            }
        )
        if mt.eval_every and (step % mt.eval_every == 0 or step == cfg.trainer.steps - 1):
            ids, pmask = left_pad([tok.encode(s["prompt"]) for s in eval_samples], tok.pad_token_id)
            answers = [torch.tensor(tok.encode(s["answer"])) for s in eval_samples]
            greedy = run(
                {
                    "prompts": ids,
                    "prompt_mask": pmask,
                    "answers": _pad(answers),
                    "answers_mask": _pad([torch.ones(len(a)) for a in answers]),
                    "policy_version": b["policy_version"][:1].expand(len(eval_samples)),
                },
                0.0,
                seed,
            )
            metrics["greedy_reward"] = greedy["scores"].float().mean()
        with lock:
            pending[step] = metrics
        version = b["policy_version"].clone()
        tokens = torch.where(traj["mask"] != 0, version[:, None], 0)  # one version per trajectory: no interruption
        return {**traj, **counts, "version": version, "token_version": tokens}

    def pop_metrics(step: int) -> dict[str, torch.Tensor]:
        with lock:
            return pending.pop(step, {})

    s = stage(
        rollout,
        inputs=list(ROLLOUT_INPUTS),
        outputs=ROLLOUT_COLUMNS,
        name="rollout",
        role="rollout",
        timeout=timeout,
    )
    return MultiTurnRollout(s, pop_metrics)


def _attend_trajectory(fn: Callable[[Batch], Any]) -> Callable[[Batch], Any]:
    def run(b: Batch) -> Any:
        return fn({**b, "mask": b["trajectory_mask"]})

    return run


def multi_turn_graph(
    stages: Sequence[Stage],
    forward: Callable[[Batch], Batch],
    inputs: Sequence[str],
    algo: algos.Algorithm,
    *,
    process_group: Any = None,
) -> tuple[list[Stage], Callable[[Batch], Batch], list[str]]:
    """The single-turn step's stages, forward and update inputs adapted to the rollout of :func:`multi_turn_rollout_stage`.

    The reward stage goes (the environments scored the trajectories); every scoring
    stage that reads ``responses`` (old-policy and reference log-probs, critic values)
    and the update's ``forward`` attend the whole trajectory (``trajectory_mask`` in
    place of the attention ``mask``: the policy reads the observations it answered);
    the advantages stage also gets ``rewards`` (each turn's reward on its last token,
    for GAE and the token-level estimators; the outcome recipes use ``scores``). The
    recipes' mask stays ``mask`` / ``loss_mask``: 1 on the policy's tokens only.

    Args:
      stages: the step's stages up to the advantages (rollout first).
      forward: the update's forward (:func:`rlcore.train.stages.rl_forward`).
      inputs: the update stage's input columns.
      algo: the recipe the advantages stage runs.
      process_group: the data-parallel group its batch whitening spans (as in
        :func:`rlcore.train.stages.advantages_stage`).

    Returns:
      ``(stages, forward, inputs)`` for the multi-turn step.
    """
    out: list[Stage] = []
    for s in stages:
        if s.role == "rollout":
            out.append(s)
        elif "scores" in s.outputs:
            continue
        elif "advantages" in s.outputs:
            out.append(
                advantages_stage(
                    algo,
                    inputs=[*s.inputs, "rewards"],
                    outputs=s.outputs,
                    resource=s.resource,
                    process_group=process_group,
                )
            )
        elif "responses" in s.inputs:
            out.append(dataclasses.replace(s, fn=_attend_trajectory(s.fn), inputs=(*s.inputs, "trajectory_mask")))
        else:
            out.append(s)
    return out, _attend_trajectory(forward), [*inputs, "trajectory_mask"]
