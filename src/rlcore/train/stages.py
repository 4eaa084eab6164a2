"""The stages of an RL step as library functions: each returns a :func:`rlcore.dataflow.stage` over the dock.

MindSpeed-RL (Feng et al., 2025, arXiv:2507.19017) runs one RL iteration as stages
that read and write columns of the Transfer Dock. Each function here builds one such
stage from the objects it needs (an engine, a reward pool, a model, a recipe), so a
notebook assembles its own pipeline and :mod:`rlcore.train.trainer` is nothing but
that assembly::

    rollout_stage(engine)                -> responses, mask, rollout_logp, version
    reward_stage(pool, decode)           -> scores
    logprob_stage(policy)                -> old_logp, entropy     (eval mode, no grad)
    logprob_stage(reference, outputs=("ref_logp",))
    values_stage(critic)                 -> old_values
    advantages_stage(algo)               -> advantages, loss_mask (+ returns)
    pairs_stage(tok, seed)               -> chosen_* / rejected_* token rows   (online DPO)
    preference_logps_stage(reference)    -> ref_chosen_logps, ref_rejected_logps
    update_stage(forward, algo, step)    -> loss

**The mask convention at the dock / recipe seam.** The prompt loader puts
``prompts`` / ``prompt_mask`` (left-padded ids, ``[N, P]``), ``answers`` (token ids of
the reference answer, one 1-D row each), ``group`` (the prompt's index, ``[N]``),
``iteration`` (``[N]``) and ``row`` (``[N]``, the row's index in the step's global
batch, which keys its random stream: :mod:`rlcore.seeding`). Token columns (``responses``, ``mask``, ``old_logp``,
``ref_logp``, ``old_values``, ``advantages``, ``loss_mask``, ``returns``) hold one row
per sample over the response positions; ``mask`` is the response mask (1.0 on the
sampled tokens up to and including ``<eos>``). When the dock hands out rows of
different widths it right-pads them with zeros, so a padded ``mask`` is still the
recipe's ``mask``; the dock's own ``<column>_mask`` companions are never given to a
recipe. A recipe's shaping may zero samples (DAPO's dynamic sampling): the mask it
returns is written as ``loss_mask`` (a column has one writer), and the update trains
on ``loss_mask``; metrics of the rollout (KL, entropy, lengths) use ``mask``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from rlcore import algos, seeding
from rlcore.dataflow import Stage, batch_to, deal_rows, stage
from rlcore.models import (
    from_hf,
    preference_logps,
    response_logits,
    shared_prefix_logprobs,
    shares_prompts,
    token_logprobs,
)
from rlcore.ops import logprobs_from_logits
from rlcore.seeding import Purpose, RowStream
from rlcore.train.columns import COLUMNS
from rlcore.train.tagged_metrics import maximum

__all__ = [
    "PAIR_TOKEN_COLUMNS",
    "ROLLOUT_OUTPUTS",
    "advantages_stage",
    "balanced_rows",
    "eval_mode",
    "forward_ahead",
    "logprob_stage",
    "masked_logprobs",
    "old_policy_interpolated",
    "old_policy_is_updated",
    "pairs_stage",
    "preference_forward",
    "preference_logps_stage",
    "response_logprobs",
    "response_sequences",
    "response_values",
    "reward_columns",
    "reward_outputs",
    "reward_stage",
    "rl_batch",
    "rl_forward",
    "rl_outputs",
    "rollout_columns",
    "rollout_stage",
    "staleness_weighted",
    "update_forward",
    "update_stage",
    "values_stage",
    "with_logged_reference",
    "with_teacher_logits",
]

Batch = dict[str, torch.Tensor]


@contextlib.contextmanager
def eval_mode(*models: torch.nn.Module | None) -> Iterator[None]:
    """Run the block with ``models`` in eval mode (dropout off) and no grad; restore their modes after.

    Models used for scoring (old-policy and reference log-probs, critic values) must
    not draw dropout noise: it would bias the values and make a resumed run differ.
    """
    present = [m for m in models if m is not None]
    modes = [m.training for m in present]
    for m in present:
        m.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, mode in zip(present, modes):
            m.train(mode)


def response_logprobs(
    model: Any,
    batch: Mapping[str, torch.Tensor],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prompts: bool = True,
    with_sum_pi_squared: bool = False,
) -> Any:
    """Log-probs (and entropies) ``[N, R]`` of the response tokens: one padding-free packed forward.

    Rows with the same prompt (a GRPO group) share one copy of it
    (:func:`rlcore.models.shared_prefix_logprobs`: the same values up to rounding, for
    fewer tokens); otherwise each sequence is packed whole.

    Args:
      model: ``(apply, params)`` from :func:`rlcore.models.from_hf`.
      batch: ``prompts`` / ``prompt_mask`` ``[N, P]`` (left-padded), ``responses`` /
        ``mask`` ``[N, R]``.
      temperature: the sampling temperature.
      with_entropy: also return the per-token entropy.
      share_prompts: run each distinct prompt once (False: every row packed whole).
      with_sum_pi_squared: also return each position's ``sum_v pi(v)^2`` (no gradient; the
        optimal token baseline reads it).

    Returns:
      ``logp [N, R]`` float32 (``(logp, entropy?, sum_pi_squared?)`` when an option is on); 0 on padding.
    """
    options = {"with_entropy": with_entropy, "with_sum_pi_squared": with_sum_pi_squared}
    apply, params = model
    if share_prompts:
        group = shares_prompts(batch["prompts"], batch["prompt_mask"])
        if group is not None:  # a GRPO group's prompt runs once (rlcore.models.shared_prefix)
            return shared_prefix_logprobs(apply, params, batch, group=group, temperature=temperature, **options)
    width = batch["prompts"].shape[1]
    seq = {
        "input_ids": torch.cat([batch["prompts"], batch["responses"]], 1),
        "attention_mask": torch.cat([batch["prompt_mask"].long(), (batch["mask"] != 0).long()], 1),
    }
    # token_logprobs puts each value on the token it scores: the responses are the last R columns.
    if with_entropy or with_sum_pi_squared:
        out = token_logprobs(apply, params, seq, temperature=temperature, **options)
        return tuple(v[:, width:].float() for v in out)
    return token_logprobs(apply, params, seq, temperature=temperature)[:, width:].float()


def masked_logprobs(logits: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` ``[B, R]`` float32 of the responses under ``logits`` (:func:`rlcore.models.response_logits`); 0 off the mask."""
    keep = batch["mask"] != 0
    logp, entropy = logprobs_from_logits(logits, batch["responses"], with_entropy=True)
    return torch.where(keep, logp, 0.0).float(), torch.where(keep, entropy, 0.0).float()


def response_values(critic: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Critic values ``[N, R]`` of the states before each response token (a one-output token-classification head)."""
    ids = torch.cat([batch["prompts"], batch["responses"]], 1)
    attention = torch.cat([batch["prompt_mask"].long(), (batch["mask"] != 0).long()], 1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    out = critic(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    return out[:, batch["prompts"].shape[1] - 1 : -1, 0].float()


ROLLOUT_OUTPUTS = ("responses", "mask", "rollout_logp", "version", "token_version")


def rollout_columns(r: Any, b: Batch) -> dict[str, torch.Tensor]:
    """A :class:`rlcore.train.Rollout` of ``b``'s rows as the dock's columns (:data:`ROLLOUT_OUTPUTS`).

    ``mask`` as float32; ``rollout_logp`` the sampler's log-probs (0 off the mask), which
    the decoupled objective and the mismatch metrics read; ``token_version`` the weights
    version that sampled each policy token (0 off the mask): ``Rollout.versions`` of an
    interruptible rollout, else the call's version on every token; ``version`` the
    row's oldest token's version (without interruptions, the rows' ``policy_version``).
    """
    mask = r.mask.float()
    logp = torch.where(mask != 0, r.logp.float(), 0.0)
    on = r.mask != 0
    if getattr(r, "versions", None) is None:
        version = b["policy_version"].clone()
        tokens = torch.where(on, version[:, None], 0)
    else:  # the first token is always sampled: the oldest version of the row
        tokens = torch.where(on, r.versions.to(torch.int64), 0)
        version = r.versions[:, 0].to(torch.int64).clone()
    return {"responses": r.responses, "mask": mask, "rollout_logp": logp, "version": version, "token_version": tokens}


def rollout_stage(
    engine: Any,
    *,
    seed: int | None = None,
    generator: Callable[[Batch], torch.Generator | None] | None = None,
    micro_batch: int | None = None,
    resource: str = "device",
    timeout: float | None = None,
) -> Stage:
    """Sample one response per row with ``engine`` (rows are already repeated ``n`` times per prompt).

    With ``seed``, the stage also reads ``row`` (each row's index in the step's global
    batch) and gives the engine :class:`rlcore.seeding.RowStream`
    ``(seed, Purpose.SAMPLING, iteration, row)``: a row's response is then the same
    however the batch is split over ranks or micro-batches.

    Args:
      engine: an :class:`rlcore.train.InferenceEngine` (``generate(prompts, prompt_mask, n=, generator=)``).
      seed: the run's seed, for the row-keyed stream (the trainer's default).
      generator: instead of ``seed``, ``generator(batch)`` -> the random stream of a call, or None.
      micro_batch, resource, timeout: as in :func:`rlcore.dataflow.stage`.

    Returns:
      A rollout-role stage ``prompts, prompt_mask, iteration (, row) -> responses, mask,
      rollout_logp, version`` (:func:`rollout_columns`).
    """
    if seed is not None and generator is not None:
        raise ValueError("generator: got a generator and a seed, expected one source of randomness")

    def stream(b: Batch) -> torch.Generator | None:
        if seed is not None:
            return RowStream(seed, Purpose.SAMPLING, int(b["iteration"][0]), b["row"])
        return generator(b) if generator is not None else None

    def rollout(b: Batch) -> dict[str, torch.Tensor]:
        return rollout_columns(engine.generate(b["prompts"], b["prompt_mask"], n=1, generator=stream(b)), b)

    return stage(
        rollout,
        inputs=["prompts", "prompt_mask", "iteration", *(["row"] if seed is not None else [])],
        outputs=list(ROLLOUT_OUTPUTS),
        micro_batch=micro_batch,
        resource=resource,
        role="rollout",
        timeout=timeout,
    )


def _rows(x: torch.Tensor, keep: torch.Tensor) -> list[list[int]]:
    """The kept ids of each row, as host lists: the kept ids read once, then cut at the rows' ends.

    No Python loop over the ids: this runs on a host thread beside the device's stages,
    and every Python step it takes holds the GIL those stages' ops wait for.
    """
    kept = (keep != 0).cpu().numpy()
    ids = x.cpu().numpy()[kept].tolist()
    ends = kept.sum(1).cumsum().tolist()
    return [ids[a:b] for a, b in zip([0, *ends], ends)]


def _texts(rows: list[list[int]], decode: Callable[[list[int]], str]) -> list[str]:
    """Each row decoded, every distinct row once: a group's rows share their prompt and answer."""
    seen: dict[tuple[int, ...], str] = {}
    out = []
    for row in rows:
        key = tuple(row)
        text = seen.get(key)
        if text is None:
            text = seen[key] = decode(row)
        out.append(text)
    return out


def reward_outputs(pool: Any) -> list[str]:
    """The columns a reward stage over ``pool`` writes: ``scores``, and ``score_parts`` when the pool gives components."""
    return ["scores", "score_parts"] if getattr(pool, "components", False) else ["scores"]


def reward_columns(scored: Any) -> dict[str, torch.Tensor]:
    """A :class:`rlcore.rewards.RewardPool` result as the dock's columns: ``scores`` (and ``score_parts``)."""
    if isinstance(scored, tuple):
        scores, parts = scored
        return {"scores": scores.float(), "score_parts": parts.float()}
    return {"scores": scored.float()}


def reward_stage(
    pool: Any, decode: Callable[[list[int]], str], *, resource: str = "cpu", timeout: float | None = None
) -> Stage:
    """Score the decoded responses with a :class:`rlcore.rewards.RewardPool` (answers passed as ``answers=``).

    Takes the whole iteration per call, so a reward error names the iteration as its batch.

    Args:
      pool: ``pool.submit(prompts, responses, batch=, answers=)`` -> a future of ``[N]`` scores.
      decode: token ids -> text (the tokenizer's ``decode``).
      resource, timeout: as in :func:`rlcore.dataflow.stage`.

    Returns:
      A stage ``prompts, prompt_mask, responses, mask, answers, iteration -> scores`` (and
      ``score_parts``, each reward component's scores, when the pool gives them: GDPO).
    """

    def reward(b: Batch) -> dict[str, torch.Tensor]:
        prompts = _texts(_rows(b["prompts"], b["prompt_mask"]), decode)
        texts = [decode(r) for r in _rows(b["responses"], b["mask"])]
        answers = _texts(_rows(b["answers"], b["answers_mask"]), decode)
        return reward_columns(pool.submit(prompts, texts, batch=int(b["iteration"][0]), answers=answers).result())

    return stage(
        reward,
        inputs=["prompts", "prompt_mask", "responses", "mask", "answers", "iteration"],
        outputs=reward_outputs(pool),
        resource=resource,
        timeout=timeout,
    )


def logprob_stage(
    model: torch.nn.Module,
    *,
    outputs: Sequence[str] = ("old_logp", "entropy"),
    name: str | None = None,
    temperature: float = 1.0,
    micro_batch: int | None = None,
    resource: str = "device",
) -> Stage:
    """Response log-probs under ``model`` in eval mode (the old policy, or the reference with ``("ref_logp",)``).

    Args:
      model: a ``transformers`` causal LM.
      outputs: ``(logp column,)``, ``(logp column, entropy column)`` or ``(logp column,
        entropy column, sum_pi_squared column)`` (each position's ``sum_v pi(v)^2``, which
        the optimal token baseline reads; computed only when named).
      name: the stage name (default ``outputs[0]``).
      temperature: the sampling temperature.
      micro_batch, resource: as in :func:`rlcore.dataflow.stage`.

    Returns:
      A stage in the ``"train"`` memory phase (it reads the training weights).
    """
    lm = from_hf(model)
    outputs = tuple(outputs)
    if len(outputs) not in (1, 2, 3):
        raise ValueError(
            f"outputs: got {outputs!r}, expected (logp,), (logp, entropy) or (logp, entropy, sum_pi_squared) "
            "column names"
        )

    def logprobs(b: Batch) -> dict[str, torch.Tensor]:
        with eval_mode(model):
            if len(outputs) == 1:
                return {outputs[0]: response_logprobs(lm, b, temperature=temperature)}
            out = response_logprobs(
                lm, b, temperature=temperature, with_entropy=True, with_sum_pi_squared=len(outputs) == 3
            )
        return dict(zip(outputs, out))

    return stage(
        logprobs,
        inputs=["prompts", "prompt_mask", "responses", "mask"],
        outputs=outputs,
        name=name or outputs[0],
        micro_batch=micro_batch,
        resource=resource,
        phase="train",
    )


def values_stage(
    critic: torch.nn.Module, *, output: str = "old_values", micro_batch: int | None = None, resource: str = "device"
) -> Stage:
    """Critic values of the responses in eval mode (dropout off: GAE's ``old_values`` carry no noise)."""

    def values(b: Batch) -> dict[str, torch.Tensor]:
        with eval_mode(critic):
            return {output: response_values(critic, b)}

    return stage(
        values,
        inputs=["prompts", "prompt_mask", "responses", "mask"],
        outputs=[output],
        name=output,
        micro_batch=micro_batch,
        resource=resource,
        phase="train",
    )


def advantages_stage(
    algo: algos.Algorithm,
    *,
    inputs: Sequence[str] = ("scores", "mask", "group", "old_logp", "ref_logp"),
    outputs: Sequence[str] = ("advantages", "loss_mask"),
    resource: str = "device",
    process_group: Any = None,
) -> Stage:
    """The recipe's shaping and advantage estimator over whole groups, adapted to the dock.

    The stage takes whole groups (``by_group``), renumbers the dock's ``group`` column
    to ``group_ids`` 0..G-1, calls ``algo.advantages`` and writes only its declared
    columns: ``advantages``, ``loss_mask`` (the mask after shaping) and, for GAE,
    ``returns``. When it reads ``score_parts`` (each reward component's scores, GDPO),
    those are the recipe's ``scores`` ``[B, K]``.

    Args:
      algo: an :class:`rlcore.algos.Algorithm`.
      inputs: dock columns the recipe reads (``group`` becomes ``group_ids``).
      outputs: a subset of ``advantages``, ``loss_mask``, ``returns``.
      resource: as in :func:`rlcore.dataflow.stage`; on ``"cpu"`` the rows are moved to host memory first.
      process_group: the data-parallel group: batch whitening (GAE's) takes its moments
        over every rank's rows, so the advantages do not depend on the world size. The
        stage takes the whole local batch once per iteration on every rank.

    >>> s = advantages_stage(algos.grpo(), inputs=("scores", "mask", "group"))
    >>> out = s.fn({"scores": torch.tensor([1.0, 0.0, 1.0, 1.0]), "mask": torch.ones(4, 2),
    ...             "group": torch.tensor([7, 7, 9, 9])})
    >>> out["advantages"][:, 0]
    tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
    """
    known = {"advantages": "advantages", "loss_mask": "mask", "returns": "returns"}
    bad = [c for c in outputs if c not in known]
    if bad:
        raise ValueError(f"outputs: got {bad}, expected some of {list(known)}")

    def advantages(b: Batch) -> dict[str, torch.Tensor]:
        if resource == "cpu":  # a device stage's columns (the rollout's mask) may be in device memory
            b = batch_to(b, "cpu")
        batch = {c: b[c] for c in inputs if c not in ("group", "score_parts")}
        if "score_parts" in inputs:
            batch["scores"] = b["score_parts"]
        if "group" in inputs:
            batch["group_ids"] = torch.unique(b["group"], return_inverse=True)[1]
        out = algo.advantages(batch, process_group=process_group)
        return {c: out[known[c]] for c in outputs}

    return stage(advantages, inputs=inputs, outputs=outputs, by_group=True, resource=resource)


def rl_outputs(
    policy: torch.nn.Module,
    *,
    critic: torch.nn.Module | None = None,
    temperature: float = 1.0,
    with_logits: bool = False,
) -> Callable[[Batch], Batch]:
    """The model half of the update's forward: rows -> ``logp`` and ``entropy`` (and PPO's ``values``), gradient on.

    It reads the prompts and responses only (not the rewards), so it can run before the
    rows are scored (:func:`forward_ahead`). With ``with_logits`` it also gives ``logits``
    ``[B, R, V]`` (:func:`rlcore.models.response_logits`, for a full-vocabulary
    distillation loss), from which ``logp`` and ``entropy`` are read: still one forward.
    """
    lm = from_hf(policy)

    def outputs(b: Batch) -> Batch:
        out: Batch = {}
        if with_logits:
            out["logits"] = response_logits(*lm, b, temperature=temperature)
            out["logp"], out["entropy"] = masked_logprobs(out["logits"], b)
        else:
            out["logp"], out["entropy"] = response_logprobs(lm, b, temperature=temperature, with_entropy=True)
        if critic is not None:
            out["values"] = response_values(critic, b)
        return out

    return outputs


_CARRIED = ("old_logp", "ref_logp", "rollout_logp", "advantages", "returns", "old_values", "entropy")


def rl_batch(b: Batch, outputs: Batch) -> Batch:
    """The recipe's batch: the rows' scored columns, ``mask`` = the dock's ``loss_mask``, and the model ``outputs``."""
    batch = {k: b[k] for k in _CARRIED if k in b}
    batch["mask"] = b["loss_mask"]
    batch.update(outputs)
    return batch


def rl_forward(
    policy: torch.nn.Module, *, critic: torch.nn.Module | None = None, temperature: float = 1.0
) -> Callable[[Batch], Batch]:
    """The update's forward for policy-gradient recipes: dock rows -> the recipe's batch, with ``logp`` (and ``values``).

    The recipe's ``mask`` is the dock's ``loss_mask``; the other columns keep their names
    (:func:`rl_batch` of :func:`rl_outputs`).

    Args:
      policy: the policy (a ``transformers`` causal LM).
      critic: PPO's critic, whose ``values`` are added, or None.
      temperature: the sampling temperature.
    """
    return update_forward(rl_outputs(policy, critic=critic, temperature=temperature))


def update_forward(outputs: Callable[[Batch], Batch]) -> Callable[[Batch], Batch]:
    """The update's forward from a model half ``outputs`` (:func:`rl_outputs`): rows -> :func:`rl_batch` of them."""
    return functools.partial(_update_forward, outputs)


def _update_forward(outputs: Callable[[Batch], Batch], b: Batch) -> Batch:
    return rl_batch(b, outputs(b))


def staleness_weighted(
    forward: Callable[[Batch], Batch], weigh: Callable[[torch.Tensor], torch.Tensor], *, start: int = 0
) -> Callable[[Batch], Batch]:
    """The update's ``forward`` with each row's loss mask scaled by ``weigh(lag)`` (staleness-aware data).

    A row's lag is the version being trained (its iteration, counted from this run's
    first step ``start``) minus its ``version`` (its oldest token's): ``weigh`` is
    :func:`rlcore.algos.staleness_weights` bound to the run's ``rl.stale_*`` keys. A
    dropped row weighs 0: it stays in the batch (the batch size holds) but trains nothing.
    """

    def run(b: Batch) -> Batch:
        batch = forward(b)
        w = weigh(b["iteration"] - start - b["version"]).to(batch["mask"].dtype)
        return {**batch, "mask": batch["mask"] * w[:, None]}

    return run


def old_policy_is_updated(outputs: Callable[[Batch], Batch]) -> Callable[[Batch], Batch]:
    """``outputs`` with ``old_logp``: its own ``logp``, detached (one optimiser update per batch, on-policy)."""

    def run(b: Batch) -> Batch:
        out = outputs(b)
        return {**out, "old_logp": out["logp"].detach()}

    return run


def old_policy_interpolated(
    outputs: Callable[[Batch], Batch], *, updates: int, start: int = 0
) -> Callable[[Batch], Batch]:
    """``outputs`` with ``old_logp`` interpolated between the sampler's and the update's log-probs (no forward).

    AReaL's prox-approx (:func:`rlcore.algos.interpolated_prox_logp`) with per-token
    versions: a token sampled by version ``v_b`` (``token_version``), the proximal policy
    at the step's version ``j`` (its iteration, counted from this run's first step
    ``start``) and the policy being trained after ``u`` of the step's ``updates``
    optimiser updates at ``j + u / updates``. The first update trains the proximal
    weights themselves (``old_logp`` = its ``logp``, detached); a token of the step's own
    version is anchored at the sampler's log-prob.

    The update stage runs an iteration's updates in order, one at a time: the count of
    calls per iteration is the update's index.
    """
    done: dict[int, int] = {}

    def run(b: Batch) -> Batch:
        out = outputs(b)
        step = int(b["iteration"][0])
        u = done.pop(step, 0)
        done[step] = u + 1
        for earlier in [k for k in done if k < step]:
            del done[earlier]
        prox = (b["iteration"] - start)[:, None]
        old = algos.interpolated_prox_logp(
            b["rollout_logp"],
            out["logp"],
            behav_version=b["token_version"],
            prox_version=prox,
            version=prox + u / updates,
        )
        return {**out, "old_logp": old}

    return run


def forward_ahead(
    outputs: Callable[[Batch], Batch], *, name: str = "policy_forward", resource: str = "device"
) -> tuple[Stage, Callable[[Batch], Batch]]:
    """The update's model forward as a stage of its own, run while the host scores the rows.

    In the blocking pipeline the device would otherwise wait for the reward: the policy's
    forward over an iteration's responses does not read the scores, so this stage runs
    it as soon as the rollout is done, keeps its outputs (with their autograd graph) for
    the update, and writes ``old_logp`` (its ``logp``, detached) and ``entropy`` to the
    dock. It is what the old-policy forward becomes when the update's own log-probs are
    the old policy's (one optimiser update per batch, on-policy: :func:`rlcore.train.scoring_plan`).

    Args:
      outputs: rows -> the model outputs with ``logp`` and ``entropy`` (:func:`rl_outputs`,
        possibly wrapped by :func:`with_logged_reference`).
      name, resource: as in :func:`rlcore.dataflow.stage`.

    Returns:
      ``(stage, forward)``: the stage (reads ``prompts``, ``prompt_mask``, ``responses``,
      ``mask``, ``iteration``), and the update's forward, which takes the kept outputs of
      its rows' iteration (:func:`rl_batch`). The update must take each iteration's rows
      in one call, in the order this stage took them (the blocking pipeline's update with
      one optimiser step per batch does; not one whose rows are dealt over the ranks
      first, :func:`balanced_rows`), or it raises.
    """
    kept: dict[int, tuple[Batch, torch.Tensor]] = {}
    lock = threading.Lock()

    def run(b: Batch) -> dict[str, torch.Tensor]:
        out = outputs(b)
        with lock:
            kept[int(b["iteration"][0])] = (out, b["responses"])
        return {"old_logp": out["logp"].detach(), "entropy": out["entropy"].detach()}

    def forward(b: Batch) -> Batch:
        iteration = int(b["iteration"][0])
        with lock:
            entry = kept.pop(iteration, None)
        rows = b["loss_mask"].shape[0]
        if (
            entry is None
            or entry[0]["logp"].shape[0] != rows
            or not torch.equal(b.get("responses", entry[1]), entry[1])
        ):
            got = "nothing" if entry is None else f"{entry[0]['logp'].shape[0]} other rows"
            raise RuntimeError(
                f"stage {name!r}: the update of iteration {iteration} takes {rows} rows, but the forward kept "
                f"{got}: the update must take each iteration's rows in one call, as the forward took them"
            )
        return rl_batch(b, entry[0])

    return (
        stage(
            run,
            inputs=["prompts", "prompt_mask", "responses", "mask", "iteration"],
            outputs=["old_logp", "entropy"],
            name=name,
            resource=resource,
            phase="train",
        ),
        forward,
    )


def with_logged_reference(
    forward: Callable[[Batch], Batch], reference: torch.nn.Module, *, every: int, temperature: float = 1.0
) -> Callable[[Batch], Batch]:
    """``forward`` that also scores the rows under ``reference`` (eval mode, no grad) at steps ``0, every, 2 * every, ...``.

    For a reference whose log-probs only feed the logged KL (no KL term, ``rl.beta`` 0):
    on its steps the rows get ``ref_logp`` before ``forward`` sees them (and its output
    carries it, also when ``forward`` is the model half, :func:`rl_outputs`), and the other
    steps pay nothing (no stage, no dock columns). The rows must carry ``iteration``.
    """
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"every: got {every!r}, expected an int >= 1")
    lm = from_hf(reference)

    def run(b: Batch) -> Batch:
        if int(b["iteration"][0]) % every != 0:
            return forward(b)
        with eval_mode(reference):
            ref = response_logprobs(lm, b, temperature=temperature)
        return {**forward({**b, "ref_logp": ref}), "ref_logp": ref}

    return run


def with_teacher_logits(
    forward: Callable[[Batch], Batch], teacher: torch.nn.Module, *, temperature: float = 1.0
) -> Callable[[Batch], Batch]:
    """``forward`` whose output also carries the teacher's ``teacher_logits`` ``[B, R, V]`` and ``ref_logp`` (eval mode, no grad).

    The teacher of a full-vocabulary distillation loss (:attr:`rlcore.algos.Algorithm.distill`)
    runs inside the update's forward, on the rows being trained: its logits never enter
    the dock (``[B, R, V]`` per row would dwarf the rest of it). Its log-probs of the
    sampled tokens, read from the same logits, are ``ref_logp`` (the logged KL to it).
    """
    lm = from_hf(teacher)

    def run(b: Batch) -> Batch:
        with eval_mode(teacher):
            logits = response_logits(*lm, b, temperature=temperature)
            ref, _ = masked_logprobs(logits, b)
        return {**forward(b), "teacher_logits": logits, "ref_logp": ref}

    return run


def update_stage(
    forward: Callable[[Batch], Batch],
    recipe: Any,
    step: Callable[[torch.Tensor, Batch], Any],
    *,
    inputs: Sequence[str],
    micro_batch: int | None = None,
    process_group: Any = None,
    on_metrics: Callable[[Batch, torch.Tensor, dict[str, torch.Tensor]], Any] | None = None,
    on_iteration_end: Callable[[int], Any] | None = None,
    name: str = "update",
    resource: str = "device",
    epochs: int = 1,
    dispatch: Callable[[Batch], tuple[Batch, dict[str, Any]]] | None = None,
    prepare: Callable[[Batch], Batch] | None = None,
) -> Stage:
    """The one update shape for every recipe: forward -> ``loss, metrics = recipe.loss(batch, **counts)`` -> step.

    Each call is one optimiser update on ``micro_batch`` rows (PPO's mini-batch; with
    ``micro_batch=None`` one update per iteration). With ``epochs > 1`` each call takes
    the whole iteration and makes ``epochs`` passes over it, one update per
    ``micro_batch`` rows in row order (PPO's epochs; the loss column is the last pass's).

    Args:
      forward: dock rows -> the recipe's batch with the model outputs (gradient on).
      recipe: anything with ``global_counts(batch, *, process_group)`` and
        ``loss(batch, **counts) -> (loss, metrics)`` (an :class:`rlcore.algos.Algorithm`,
        an :class:`rlcore.algos.DPO`).
      step: ``step(loss, rows)``: backward, gradient reduction, clipping, optimiser step.
      inputs: dock columns read.
      micro_batch: rows per update.
      process_group: the data-parallel group the counts are summed over.
      on_metrics: ``on_metrics(rows, loss, metrics)`` after each update (logging).
      on_iteration_end: as in :func:`rlcore.dataflow.stage`.
      name, resource: as in :func:`rlcore.dataflow.stage`.
      epochs: passes over each iteration's rows.
      dispatch: ``dispatch(rows) -> (rows, metrics)`` before each update's forward: the
        rows this rank trains on (:func:`balanced_rows`: a token-balanced deal over the
        data-parallel ranks) and metrics of the deal, passed to ``on_metrics``.
      prepare: ``prepare(rows) -> columns`` run once over each whole iteration before its
        first update, its columns added to the rows (the old-policy forward of
        :func:`logprob_stage` with the weights the updates start from); the stage then
        takes whole iterations and makes one update per ``micro_batch`` rows.

    Returns:
      An update-role stage writing the per-row ``loss`` (the update's scalar loss).
    """

    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise ValueError(f"epochs: got {epochs!r}, expected an int >= 1")
    if epochs > 1 and (micro_batch is None or micro_batch < 1):
        raise ValueError(
            f"micro_batch: got {micro_batch!r} with epochs={epochs}, expected rows per update (an int >= 1)"
        )

    def one_update(b: Batch) -> torch.Tensor:
        dealt: dict[str, Any] = {}
        if dispatch is not None:
            b, dealt = dispatch(b)
        batch = forward(b)
        loss, metrics = recipe.loss(batch, **recipe.global_counts(batch, process_group=process_group))
        step(loss, b)
        if on_metrics is not None:
            # The forward's own outputs (e.g. the entropy, or old_logp taken from the update) beside the rows.
            seen = {**{k: v.detach() for k, v in batch.items() if k not in b and isinstance(v, torch.Tensor)}, **b}
            on_metrics(seen, loss.detach(), {**metrics, **dealt})
        return loss.detach().float()

    whole = epochs > 1 or prepare is not None  # each call takes an iteration and loops over its mini-batches

    def update(b: Batch) -> dict[str, torch.Tensor]:
        rows = next(iter(b.values())).shape[0]
        if prepare is not None:
            b = {**b, **prepare(b)}
        # One update on the rows the scheduler gave; PPO's epochs: each pass visits the mini-batches in row order.
        size = rows if not whole or micro_batch is None else micro_batch
        out = torch.zeros(rows)
        for _ in range(epochs):
            for start in range(0, rows, size):
                part = {k: v[start : start + size] for k, v in b.items()}
                out[start : start + size] = one_update(part)
        return {"loss": out}

    return stage(
        update,
        inputs=inputs,
        outputs=["loss"],
        name=name,
        micro_batch=None if whole else micro_batch,
        resource=resource,
        role="update",
        on_iteration_end=on_iteration_end,
    )


def balanced_rows(group: Any, *, method: str = "kk") -> Callable[[Batch], tuple[Batch, dict[str, Any]]]:
    """An RL update's rows dealt over the data-parallel ``group`` by their tokens (prompt + response).

    The sample-flow dispatch of MindSpeed-RL (arXiv:2507.19017) at the update:
    :func:`rlcore.dataflow.deal_rows` with :func:`rlcore.dataflow.balanced_partition`.
    The advantages are computed before the update, so rows move freely (a GRPO group
    may split); the losses are normalised by global counts, so the update equals the
    contiguous split's up to rounding. The metric ``dispatch/tokens_max_over_mean`` is
    the heaviest rank's tokens over the mean (1 is perfect balance; the step logs its
    largest over the updates). For :func:`update_stage`'s ``dispatch``.
    """

    def deal(b: Batch) -> tuple[Batch, dict[str, Any]]:
        lengths = (b["prompt_mask"] != 0).sum(-1) + (b["mask"] != 0).sum(-1)
        rows, loads = deal_rows(b, group, lengths=lengths, left_padded=("prompts", "prompt_mask"), method=method)
        loads = loads.float()
        return rows, {"dispatch/tokens_max_over_mean": maximum(loads.max() / loads.mean())}

    return deal


# --- preference (DPO) ---------------------------------------------------------------------------
# The preference recipe (rlcore.algos.dpo) is tensor-in like every Algorithm; its model half is
# rlcore.models.preference_logps, so DPO runs the same update stage as the RL recipes.

_PREF_SIDES = ("chosen", "rejected")


def _pair_columns() -> list[str]:
    return list(
        COLUMNS.select(*(f"{side}_{k}" for side in _PREF_SIDES for k in ("input_ids", "attention_mask", "mask")))
    )


def response_sequences(
    tok: Any, prompts: Sequence[str], responses: Sequence[str], device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Right-padded ``prompt + response + <eos>`` ids with the response tokens marked, for SFT and DPO.

    Args:
      tok: a tokenizer with ``encode``, ``eos_token_id`` and ``pad_token_id``.
      prompts, responses: texts, one response per prompt.
      device: where the tensors go.

    Returns:
      ``{"input_ids", "attention_mask", "mask"}``, each ``[N, W]`` int64; ``mask`` is 1 on
      the response and its ``<eos>``.
    """
    rows = [(tok.encode(p), tok.encode(r) + [tok.eos_token_id]) for p, r in zip(prompts, responses)]
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    attention, scored = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention[i, : len(p) + len(r)] = 1
        scored[i, len(p) : len(p) + len(r)] = 1
    return {"input_ids": ids.to(device), "attention_mask": attention.to(device), "mask": scored.to(device)}


def pairs_stage(tok: Any, seed: int, *, resource: str = "cpu") -> Stage:
    """Online DPO pairs of the sampled rows: the reference answer is chosen, the sampled answer rejected.

    A correct sample (score >= 1) would make a pair of two right answers, so its
    rejected side is the reference answer plus a random letter of ``tok.alphabet``.

    Args:
      tok: the task's tokenizer (``encode``, ``decode``, ``alphabet``, EOS and padding ids).
      seed: keys each row's random letter by ``(seed, Purpose.PERTURB, iteration, row)``
        (:mod:`rlcore.seeding`): the same at any data-parallel size and on a resume.
      resource: as in :func:`rlcore.dataflow.stage`.

    Returns:
      A stage writing :data:`PAIR_TOKEN_COLUMNS` (one unpadded row per pair).
    """

    def pairs(b: Batch) -> dict[str, Any]:
        step = int(b["iteration"][0])
        keep = [(row, m != 0) for row, m in zip(b["prompts"], b["prompt_mask"])]
        prompts = [tok.decode(row[k].tolist()) for row, k in keep]
        answers = [tok.decode(row[k].tolist()) for row, k in zip(b["answers"], b["answers_mask"])]
        texts = [tok.decode(row[m != 0].tolist()) for row, m in zip(b["responses"], b["mask"])]
        key = seeding.mix(seed, Purpose.PERTURB, step)
        letters = (seeding.row_uniforms(seeding.row_keys(key, b["row"]), 0) * len(tok.alphabet)).long().tolist()
        rejected = [
            t if s < 1 else a + tok.alphabet[k] for t, s, a, k in zip(texts, b["scores"].tolist(), answers, letters)
        ]
        out: dict[str, Any] = {}
        for side, responses in zip(_PREF_SIDES, (answers, rejected)):
            seq = response_sequences(tok, prompts, responses)
            lengths = seq["attention_mask"].sum(-1).tolist()
            for k, v in seq.items():
                out[f"{side}_{k}"] = [row[:n] for row, n in zip(v, lengths)]
        return out

    return stage(
        pairs,
        inputs=["prompts", "prompt_mask", "answers", "responses", "mask", "scores", "iteration", "row"],
        outputs=list(PAIR_TOKEN_COLUMNS),
        name="pairs",
        resource=resource,
    )


def preference_logps_stage(reference: torch.nn.Module, *, temperature: float = 1.0, resource: str = "device") -> Stage:
    """Reference log-probs of the chosen / rejected pairs (eval mode): ``ref_chosen_logps``, ``ref_rejected_logps``.

    One packed forward of both sides (:func:`rlcore.models.preference_logps`).
    """
    apply, params = from_hf(reference)

    def ref(b: Batch) -> dict[str, torch.Tensor]:
        with eval_mode(reference):
            out = preference_logps(apply, params, b, temperature=temperature)
        return {"ref_chosen_logps": out["chosen_logps"], "ref_rejected_logps": out["rejected_logps"]}

    return stage(
        ref,
        inputs=_pair_columns(),
        outputs=["ref_chosen_logps", "ref_rejected_logps"],
        name="ref_pair_logps",
        resource=resource,
    )


def preference_forward(policy: torch.nn.Module, *, temperature: float = 1.0) -> Callable[[Batch], Batch]:
    """The update's forward for preference recipes: the policy's pair log-probs and lengths beside the reference columns.

    The result is the batch :class:`rlcore.algos.DPO` reads.
    """
    apply, params = from_hf(policy)

    def forward(b: Batch) -> Batch:
        out = preference_logps(apply, params, b, temperature=temperature)
        return {**out, "ref_chosen_logps": b["ref_chosen_logps"], "ref_rejected_logps": b["ref_rejected_logps"]}

    return forward


# The token rows of each pair's chosen and rejected sequences (ids, attention mask, response mask); the summed
# log-probs the DPO loss reads are rlcore.algos.PAIR_LOGP_COLUMNS.
PAIR_TOKEN_COLUMNS = tuple(_pair_columns())
