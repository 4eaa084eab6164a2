"""The multi-turn rollout: generate, pause at a tool call or end of turn, step the environment, append, continue.

Token in, token out: a trajectory is the prompt ids, then the ids the policy sampled
and the ids of each observation, concatenated as they were produced. The policy's ids
are never decoded and re-encoded into the trajectory (decoding happens only to hand
the environment its action text), so the training forward scores exactly the tokens
that were sampled; only observations are tokenized.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rlcore.agent.decode import sample_turn
from rlcore.agent.observation import observation_encoder
from rlcore.agent.protocols import Environment
from rlcore.agent.runner import StepRunner
from rlcore.models.sampling import left_pad

__all__ = ["TRAJECTORY_KEYS", "multi_turn_rollout"]

TRAJECTORY_KEYS = (
    "prompts",
    "prompt_mask",
    "responses",
    "responses_mask",
    "mask",
    "rollout_logp",
    "rewards",
    "scores",
    "final_reward",
    "num_turns",
    "num_tool_calls",
    "num_tool_errors",
    "tool_latency",
    "num_env_errors",
    "truncated",
)


class _Trajectory:
    """One trajectory's growing token lists and counters (host side)."""

    def __init__(self, prompt: list[int]):
        self.prompt = prompt
        self.tokens: list[int] = []
        self.policy: list[int] = []
        self.logp: list[float] = []
        self.rewards: list[float] = []
        self.turns = self.calls = self.errors = self.env_errors = 0
        self.latency = self.score = self.final = 0.0
        self.done = self.truncated = False

    def append(self, tokens: Sequence[int], logp: Sequence[float], policy: int) -> None:
        self.tokens += tokens
        self.logp += logp
        self.policy += [policy] * len(tokens)
        self.rewards += [0.0] * len(tokens)


def _check(name: str, value: Any, ok: bool, want: str) -> None:
    if not ok:
        raise ValueError(f"{name}: got {value!r}, expected {want}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _observation_ids(obs: Any, encode: Callable[[str], list[int]]) -> list[int]:
    if isinstance(obs, str):
        return list(encode(obs)) if obs else []
    if isinstance(obs, torch.Tensor):
        return [int(t) for t in obs.reshape(-1).tolist()]
    if isinstance(obs, Sequence) and all(_is_int(t) for t in obs):
        return list(obs)
    raise ValueError(f"observation: got {type(obs).__name__}, expected text or a list of token ids")


def multi_turn_rollout(
    model: Any,
    prompts: Sequence[Sequence[int]],
    envs: Sequence[Environment],
    samples: Sequence[Mapping[str, Any]] | None = None,
    *,
    tokenizer: Any = None,
    decode: Callable[[list[int]], str] | None = None,
    encode_observation: Callable[[str], list[int]] | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    stop_token_ids: Sequence[int] = (),
    max_turns: int = 4,
    max_new_tokens: int = 64,
    max_total_tokens: int = 512,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    runner: StepRunner | None = None,
    step_timeout: float | None = 60.0,
) -> dict[str, torch.Tensor]:
    """Roll out a batch of multi-turn trajectories with a causal LM and one environment per trajectory.

    Each turn samples (KV-cached within the turn) for every unfinished trajectory until
    it emits ``<eos>`` or a ``stop_token_ids`` id, or spends its budget. The moment a
    row stops, its turn's text goes to ``env.step`` on the ``runner`` (concurrently,
    off this thread) while the other rows keep decoding; after the turn the
    observations are tokenized and appended, and the unfinished trajectories continue.
    An environment call that raises or passes ``step_timeout`` ends its trajectory with
    reward 0 and counts in ``num_env_errors``; tool failures are the environment's to
    report (:class:`rlcore.agent.ToolEnv` turns them into error observations).

    Budgets: at most ``max_turns`` policy turns, ``max_new_tokens`` tokens per turn and
    ``max_total_tokens`` response tokens (policy and observation tokens after the
    prompt). An observation is appended only if a policy turn can follow it; a
    trajectory stopped by a budget rather than by its environment is ``truncated``.

    Args:
      model: a ``transformers`` causal LM (call it under ``model.eval()``).
      prompts: ``B`` prompt id lists.
      envs: ``B`` environments (:class:`rlcore.agent.Environment`), one per trajectory.
      samples: ``B`` data samples for ``env.reset`` (default: ``{}`` each); a non-empty
        initial observation is appended to the prompt.
      tokenizer: supplies ``decode`` (``tokenizer.decode(ids)``), ``encode_observation``
        (:func:`rlcore.agent.observation_encoder`) and the special ids unless given.
      decode: ``ids -> text`` for the environment's action.
      encode_observation: ``text -> ids`` for observations.
      eos_token_id, pad_token_id: special ids; stop_token_ids: more ids that end a turn
        (e.g. ``</tool_call>``), kept in the trajectory.
      max_turns, max_new_tokens, max_total_tokens: the budgets.
      temperature, top_p, top_k, generator: sampling, as :func:`rlcore.train.rollout.generate`.
      runner: a :class:`rlcore.agent.StepRunner` (default: a new one for this call).
      step_timeout: seconds per environment call when the runner is made here.

    Returns:
      A dict of tensors (:data:`TRAJECTORY_KEYS`): ``prompts`` / ``prompt_mask`` ``[B, P]``
      left-padded; ``responses`` ``[B, R]`` right-padded policy and observation ids,
      ``responses_mask`` (1 on every real response token), ``mask`` (1 on policy tokens
      only), ``rollout_logp`` (float32 log-probs of the policy tokens, 0 elsewhere),
      ``rewards`` (float32, each turn's reward on its last policy token); per
      trajectory ``[B]``: ``scores`` (sum of turn rewards), ``final_reward``,
      ``num_turns``, ``num_tool_calls``, ``num_tool_errors``, ``tool_latency`` (seconds),
      ``num_env_errors``, ``truncated`` (bool).
    """
    batch = len(prompts)
    _check("envs", f"{len(envs)} environments", len(envs) == batch, f"{batch} (one per prompt)")
    if samples is None:
        samples = [{} for _ in range(batch)]
    _check("samples", f"{len(samples)} samples", len(samples) == batch, f"{batch} (one per prompt)")
    _check("max_turns", max_turns, _is_int(max_turns) and max_turns >= 1, "an int >= 1")
    _check("max_new_tokens", max_new_tokens, _is_int(max_new_tokens) and max_new_tokens >= 1, "an int >= 1")
    _check("max_total_tokens", max_total_tokens, _is_int(max_total_tokens) and max_total_tokens >= 1, "an int >= 1")
    _check("temperature", temperature, temperature >= 0, ">= 0")
    for i, p in enumerate(prompts):
        _check(f"prompts[{i}]", p, len(p) >= 1 and all(_is_int(t) for t in p), "a non-empty list of token ids")
    if eos_token_id is None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(tokenizer, "pad_token_id", None)
        pad_token_id = eos_token_id if pad_token_id is None else pad_token_id
    _check("eos_token_id", eos_token_id, _is_int(eos_token_id), "a token id (or a tokenizer that has one)")
    assert eos_token_id is not None and pad_token_id is not None
    if decode is None:
        _check("tokenizer", tokenizer, callable(getattr(tokenizer, "decode", None)), "a tokenizer, or decode=")
        decode = tokenizer.decode
    if encode_observation is None:
        _check(
            "tokenizer", tokenizer, callable(getattr(tokenizer, "encode", None)), "a tokenizer, or encode_observation="
        )
        encode_observation = observation_encoder(tokenizer)
    device = next(model.parameters()).device
    own_runner = runner is None
    run = runner if runner is not None else StepRunner(max_concurrency=max(1, min(batch, 64)), timeout=step_timeout)
    stops = (eos_token_id, *stop_token_ids)
    try:
        trajs = [_Trajectory(list(p)) for p in prompts]
        resets = [run.submit(env.reset, sample) for env, sample in zip(envs, samples)]
        for traj, fut in zip(trajs, resets):
            try:
                traj.prompt += _observation_ids(fut.result(), encode_observation)
            except Exception:  # the environment failed to start: the trajectory ends before its first turn
                traj.env_errors += 1
                traj.done = True
        for turn in range(max_turns):
            active = [i for i, t in enumerate(trajs) if not t.done]
            if not active:
                break
            budgets = [min(max_new_tokens, max_total_tokens - len(trajs[i].tokens)) for i in active]
            ids, attention = left_pad([trajs[i].prompt + trajs[i].tokens for i in active], pad_token_id)
            futures: dict[int, concurrent.futures.Future] = {}

            def hand_over(
                row: int,
                tokens: list[int],
                active: list[int] = active,
                futures: dict[int, concurrent.futures.Future] = futures,
            ) -> None:
                try:
                    futures[row] = run.submit(envs[active[row]].step, decode(tokens))
                except Exception as err:  # a decode that raises fails this trajectory's step only
                    futures[row] = concurrent.futures.Future()
                    futures[row].set_exception(err)

            sampled = sample_turn(
                model,
                ids.to(device),
                attention.to(device),
                budgets,
                stop_token_ids=stops,
                pad_token_id=pad_token_id,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                generator=generator,
                on_stop=hand_over,
            )
            lengths = sampled.lengths.tolist()
            tokens, logps = sampled.tokens.tolist(), sampled.logp.tolist()
            for row, i in enumerate(active):
                traj, n = trajs[i], lengths[row]
                traj.append(tokens[row][:n], logps[row][:n], 1)
                traj.turns += 1
                try:
                    result = futures[row].result()
                    obs, reward, done, info = result
                    reward = float(reward)
                    if not math.isfinite(reward):
                        raise ValueError(f"reward {reward} is not finite")
                    obs_ids = [] if done else _observation_ids(obs, encode_observation)
                except Exception:  # a failing environment ends its own trajectory, never the batch
                    traj.env_errors += 1
                    traj.done = True
                    traj.final = 0.0
                    continue
                traj.rewards[-1] += reward
                traj.score += reward
                traj.final = reward
                info = info if isinstance(info, Mapping) else {}
                traj.calls += int(info.get("tool_calls", 0))
                traj.errors += int(info.get("tool_errors", 0))
                traj.latency += float(info.get("tool_latency", 0.0))
                if done:
                    traj.done = True
                elif turn + 1 == max_turns or len(traj.tokens) + len(obs_ids) >= max_total_tokens:
                    traj.done = traj.truncated = True
                else:
                    traj.append(obs_ids, [0.0] * len(obs_ids), 0)
    finally:
        if own_runner:
            run.close()
    return _collate(trajs, pad_token_id, device)


def _collate(trajs: list[_Trajectory], pad_token_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    prompts, prompt_mask = left_pad([t.prompt for t in trajs], pad_token_id)
    batch, width = len(trajs), max((len(t.tokens) for t in trajs), default=0)
    responses = torch.full((batch, width), pad_token_id, dtype=torch.long)
    valid = torch.zeros((batch, width), dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    logp = torch.zeros((batch, width), dtype=torch.float32)
    rewards = torch.zeros((batch, width), dtype=torch.float32)
    for i, t in enumerate(trajs):
        n = len(t.tokens)
        if n:
            responses[i, :n] = torch.tensor(t.tokens)
            valid[i, :n] = 1
            mask[i, :n] = torch.tensor(t.policy)
            logp[i, :n] = torch.tensor(t.logp)
            rewards[i, :n] = torch.tensor(t.rewards)

    def per_traj(attr: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([getattr(t, attr) for t in trajs], dtype=dtype)

    out = {
        "prompts": prompts,
        "prompt_mask": prompt_mask,
        "responses": responses,
        "responses_mask": valid,
        "mask": mask,
        "rollout_logp": logp,
        "rewards": rewards,
        "scores": per_traj("score", torch.float32),
        "final_reward": per_traj("final", torch.float32),
        "num_turns": per_traj("turns", torch.long),
        "num_tool_calls": per_traj("calls", torch.long),
        "num_tool_errors": per_traj("errors", torch.long),
        "tool_latency": per_traj("latency", torch.float32),
        "num_env_errors": per_traj("env_errors", torch.long),
        "truncated": per_traj("truncated", torch.bool),
    }
    return {k: v.to(device) for k, v in out.items()}
