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
import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rlcore.agent.decode import sample_turn
from rlcore.agent.observation import observation_encoder
from rlcore.agent.protocols import Environment, TurnSampler
from rlcore.agent.runner import StepRunner
from rlcore.models.sampling import left_pad
from rlcore.seeding import RowStream

__all__ = ["TRAJECTORY_KEYS", "multi_turn_rollout"]

TRAJECTORY_KEYS = (
    "prompts",
    "prompt_mask",
    "responses",
    "mask",
    "trajectory_mask",
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
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


# Characters per token that no tokenizer is expected to exceed on average: text longer than
# max(room + 1, 128) * this is tokenized by its head first, so a flood is not tokenized whole.


_CHARS_PER_TOKEN = 32
# The counts of a step's info are summed into int64 tensors; rewards into float32 ones.
_MAX_COUNT = 2**40
_MAX_REWARD = float(torch.finfo(torch.float32).max)


def _observation_ids(
    obs: Any, encode: Callable[[str], list[int]], *, room: int | None, vocab: int | None
) -> list[int] | None:
    """An observation's token ids, or None when it has more than ``room`` tokens (it cannot fit).

    Raises ValueError for what is not text or token ids in ``[0, vocab)``.
    """
    if isinstance(obs, str):
        if not obs:
            return []
        if room is not None:
            head = max(room + 1, 128) * _CHARS_PER_TOKEN
            if len(obs) > head and _encodes_longer(encode, obs[:head], room):
                return None
        ids = list(encode(obs))
    elif isinstance(obs, torch.Tensor):
        if obs.dtype == torch.bool or obs.is_floating_point() or obs.is_complex() or obs.dim() > 1:
            raise ValueError(
                f"observation: got a {obs.dtype} tensor of shape {tuple(obs.shape)}, expected a 1-D integer tensor of token ids"
            )
        if room is not None and obs.numel() > room:
            return None
        ids = obs.tolist()
    elif isinstance(obs, (bytes, bytearray, memoryview)):
        raise ValueError(f"observation: got {type(obs).__name__}, expected text (str) or a list of token ids")
    elif isinstance(obs, Sequence):
        if room is not None and len(obs) > room:
            return None
        ids = list(obs)
        bad = next((t for t in ids if not _is_int(t)), None)
        if bad is not None:
            raise ValueError(f"observation: got {type(bad).__name__} {bad!r} among the token ids, expected ints")
        ids = [int(t) for t in ids]
    else:
        raise ValueError(f"observation: got {type(obs).__name__}, expected text or a list of token ids")
    bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise ValueError(f"observation: token id {bad} is outside the model's vocabulary [0, {vocab})")
    if room is not None and len(ids) > room:
        return None
    return ids


def _encodes_longer(encode: Callable[[str], list[int]], head: str, room: int) -> bool:
    """``head`` (a cut of the text) has more than ``room`` tokens; False when the cut cannot be encoded alone."""
    try:
        return len(encode(head)) > room
    except ValueError:  # the cut split a token the tokenizer spells whole: decide on the whole text
        return False


def _info_counts(info: Any) -> tuple[int, int, float]:
    """``tool_calls``, ``tool_errors`` and ``tool_latency`` of a step's ``info`` (absent: 0); ValueError naming a bad key."""
    if info is None:
        return 0, 0, 0.0
    if not isinstance(info, Mapping):
        raise ValueError(f"info: got {type(info).__name__}, expected a mapping (or None)")
    counts = []
    for key in ("tool_calls", "tool_errors"):
        value = info.get(key, 0)
        if not _is_int(value) or not 0 <= value <= _MAX_COUNT:
            raise ValueError(f"info[{key!r}]: got {value!r}, expected an int in [0, {_MAX_COUNT}]")
        counts.append(int(value))
    if counts[1] > counts[0]:
        raise ValueError(f"info['tool_errors']: got {counts[1]}, expected at most info['tool_calls'] ({counts[0]})")
    latency = info.get("tool_latency", 0.0)
    if not isinstance(latency, numbers.Real) or isinstance(latency, bool) or not 0 <= float(latency) < math.inf:
        raise ValueError(f"info['tool_latency']: got {latency!r}, expected a number of seconds >= 0")
    return counts[0], counts[1], float(latency)


def _as_done(done: Any) -> bool:
    """A step's ``done``: a bool (Python's, numpy's, a one-element bool tensor, or the int 0 / 1); ValueError else."""
    if isinstance(done, torch.Tensor) and done.numel() == 1 and done.dtype == torch.bool:
        return bool(done.item())
    if getattr(getattr(done, "dtype", None), "kind", None) == "b" and getattr(done, "shape", None) == ():
        return bool(done)  # numpy.bool_
    if isinstance(done, bool) or (_is_int(done) and done in (0, 1)):
        return bool(done)
    raise ValueError(f"done: got {done!r}, expected a bool")


def _model_limits(model: Any) -> tuple[int | None, int | None]:
    """The model's vocabulary (rows of its input embedding) and position limit, where it tells them."""
    vocab = None
    embeddings = getattr(model, "get_input_embeddings", None)
    if callable(embeddings):
        weight = getattr(embeddings(), "weight", None)
        vocab = int(weight.shape[0]) if isinstance(weight, torch.Tensor) else None
    config = getattr(model, "config", None)
    if vocab is None:
        vocab = getattr(config, "vocab_size", None)
    positions = getattr(config, "max_position_embeddings", None)
    return (vocab if _is_int(vocab) else None), (positions if _is_int(positions) else None)


def _where(env: Any, method: str) -> str:
    return f"{type(env).__name__}.{method}"


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
      model: a ``transformers`` causal LM (call it under ``model.eval()``), or an engine
        (:class:`rlcore.agent.TurnSampler`, e.g. :class:`rlcore.train.VLLMEngine`) that
        continues each trajectory from its token ids.
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
      temperature, top_p, top_k, generator: sampling, as :func:`rlcore.train.rollout.generate`;
        a :class:`rlcore.seeding.RowStream` keys trajectory ``i`` by its global row and
        draws its ``t``-th response token (observation tokens counted) at position ``t``,
        so a trajectory's samples do not depend on the others in the batch.
      runner: a :class:`rlcore.agent.StepRunner` (default: a new one for this call).
      step_timeout: seconds per environment call when the runner is made here.

    Returns:
      A dict of tensors (:data:`TRAJECTORY_KEYS`): ``prompts`` / ``prompt_mask`` ``[B, P]``
      left-padded; ``responses`` ``[B, R]`` right-padded policy and observation ids,
      ``mask`` (float32, 1.0 on policy tokens only: the recipes' mask),
      ``trajectory_mask`` (float32, 1.0 on every real response token), ``rollout_logp`` (float32 log-probs of the policy tokens, 0 elsewhere),
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
    # An engine (TurnSampler) hands back host tensors; a model's own device otherwise.
    device = torch.device("cpu") if isinstance(model, TurnSampler) else next(model.parameters()).device
    own_runner = runner is None
    run = runner if runner is not None else StepRunner(max_concurrency=max(1, min(batch, 64)), timeout=step_timeout)
    stops = (eos_token_id, *stop_token_ids)
    vocab, positions = _model_limits(model)
    failures: list[str] = []

    def fail(traj: _Trajectory, err: BaseException, where: str) -> None:
        """A failing environment ends its own trajectory, never the batch."""
        failures.append(f"{where}: {type(err).__name__}: {err}")
        traj.env_errors += 1
        traj.done = True
        traj.final = 0.0

    try:
        trajs = [_Trajectory(list(p)) for p in prompts]
        resets: list[concurrent.futures.Future | None] = []
        for traj, env, sample in zip(trajs, envs, samples):
            try:
                resets.append(run.submit(env.reset, sample))
            except Exception as err:  # no reset method: this trajectory's failure
                resets.append(None)
                fail(traj, err, _where(env, "reset"))
        for traj, env, fut in zip(trajs, envs, resets):
            if fut is None:
                continue
            room = None if positions is None else positions - max_total_tokens - len(traj.prompt)
            try:
                obs_ids = _observation_ids(run.wait(fut), encode_observation, room=room, vocab=vocab)
                if obs_ids is None:
                    raise ValueError(
                        f"observation: more than {room} tokens after a prompt of {len(traj.prompt)}, "
                        f"with max_total_tokens {max_total_tokens} past the model's max_position_embeddings {positions}"
                    )
                traj.prompt += obs_ids
            except Exception as err:  # the environment failed to start: the trajectory ends before its first turn
                fail(traj, err, _where(env, "reset"))
        for turn in range(max_turns):
            active = [i for i, t in enumerate(trajs) if not t.done]
            if not active:
                break
            budgets = [min(max_new_tokens, max_total_tokens - len(trajs[i].tokens)) for i in active]
            contexts = [trajs[i].prompt + trajs[i].tokens for i in active]
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

            stream = generator.select(active) if isinstance(generator, RowStream) else generator
            starts = [len(trajs[i].tokens) for i in active]
            if isinstance(model, TurnSampler):  # an engine continues each trajectory from its ids
                sampled = model.sample_turn(
                    contexts,
                    budgets,
                    stop_token_ids=stops,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    generator=stream,
                    positions=starts,
                    on_stop=hand_over,
                )
            else:
                ids, attention = left_pad(contexts, pad_token_id)
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
                    generator=stream,
                    positions=torch.tensor(starts, device=device),
                    on_stop=hand_over,
                )
            lengths = sampled.lengths.tolist()
            tokens, logps = sampled.tokens.tolist(), sampled.logp.tolist()
            for row, i in enumerate(active):
                traj, n = trajs[i], lengths[row]
                traj.append(tokens[row][:n], logps[row][:n], 1)
                traj.turns += 1
                future = futures[row]
                try:
                    result = run.wait(future)
                    if not isinstance(result, tuple) or len(result) != 4:
                        raise ValueError(
                            f"got {type(result).__name__}, expected a StepResult (observation, reward, done, info)"
                        )
                    obs, reward, done, info = result
                    if isinstance(reward, torch.Tensor) and reward.numel() == 1 and not reward.is_complex():
                        reward = reward.item()
                    if not isinstance(reward, numbers.Real):
                        raise ValueError(f"reward: got {reward!r}, expected a real number")
                    reward = float(reward)
                    if not math.isfinite(reward) or abs(reward) > _MAX_REWARD:
                        raise ValueError(f"reward: got {reward}, expected a finite number (in float32)")
                    if abs(traj.score + reward) > _MAX_REWARD:
                        raise ValueError(
                            f"reward: got {reward}, which makes the trajectory's score {traj.score + reward}, "
                            "past float32's range"
                        )
                    done = _as_done(done)
                    calls, errors, latency = _info_counts(info)
                    # An observation is appended only if a policy turn can follow it.
                    last = done or turn + 1 == max_turns
                    room = max_total_tokens - len(traj.tokens) - 1
                    obs_ids = [] if last else _observation_ids(obs, encode_observation, room=room, vocab=vocab)
                except Exception as err:
                    fail(traj, err, _where(envs[i], "step"))
                    continue
                traj.rewards[-1] += reward
                traj.score += reward
                traj.final = reward
                traj.calls += calls
                traj.errors += errors
                traj.latency += latency
                if done:
                    traj.done = True
                elif obs_ids is None or turn + 1 == max_turns:
                    traj.done = traj.truncated = True
                else:
                    traj.append(obs_ids, [0.0] * len(obs_ids), 0)
    finally:
        if own_runner:
            run.close()
    if failures:
        warnings.warn(
            f"multi_turn_rollout: an environment error ended its trajectory (counted in num_env_errors): {failures[0]}",
            RuntimeWarning,
            stacklevel=2,
        )
    return _collate(trajs, pad_token_id, device)


def _collate(trajs: list[_Trajectory], pad_token_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    prompts, prompt_mask = left_pad([t.prompt for t in trajs], pad_token_id)
    batch, width = len(trajs), max((len(t.tokens) for t in trajs), default=0)
    responses = torch.full((batch, width), pad_token_id, dtype=torch.long)
    # The dtypes of rlcore.train.COLUMNS: the masks are float32 token weights.
    valid = torch.zeros((batch, width), dtype=torch.float32)
    mask = torch.zeros((batch, width), dtype=torch.float32)
    logp = torch.zeros((batch, width), dtype=torch.float32)
    rewards = torch.zeros((batch, width), dtype=torch.float32)
    for i, t in enumerate(trajs):
        n = len(t.tokens)
        if n:
            responses[i, :n] = torch.tensor(t.tokens)
            valid[i, :n] = 1
            mask[i, :n] = torch.tensor(t.policy, dtype=torch.float32)
            logp[i, :n] = torch.tensor(t.logp)
            rewards[i, :n] = torch.tensor(t.rewards)

    def per_traj(attr: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([getattr(t, attr) for t in trajs], dtype=dtype)

    out = {
        "prompts": prompts,
        "prompt_mask": prompt_mask,
        "responses": responses,
        "mask": mask,
        "trajectory_mask": valid,
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
