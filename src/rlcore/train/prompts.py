"""Where a run's prompts come from: a built-in task or a prompt dataset, behind one interface.

The trainer asks a prompt source for its tokenizer (``encode`` / ``decode`` / EOS and
padding ids / ``vocab_size``), its reward, warm-up samples (``sample(n, generator)``:
prompt text and reference answer), the pipeline's loader and its reward stage:

* :class:`TaskPrompts` serves a generated task of :mod:`rlcore.train.tasks` (the
  default when no dataset is given), with the task's rule reward;
* :class:`DatasetPrompts` serves ``data.path`` through :func:`rlcore.data.load_prompts`
  with the model directory's tokenizer (its chat template applied), in the seeded,
  resumable order of :func:`rlcore.data.sample_indices` (one more column, ``index``,
  says which prompt each row is, so the rewards receive the prompt as written and
  every keyword column of the dataset);
* :class:`PreferencePrompts` serves a preference dataset (``data.path`` with ``rl.algo:
  dpo``) as ready DPO pairs through :func:`rlcore.data.load_preferences`: offline DPO,
  no rollout (and so does ``rl.algo: rm``, a reward model trained on the pairs);
* :class:`SupervisedPrompts` serves an SFT dataset (``data.path`` with ``rl.algo: sft``)
  as demonstrations through :func:`rlcore.data.load_supervised`: no rollout.

Each source's ``columns`` names what its loader gives a row (the pipeline's sources).

The rewards come from the config's ``rewards`` list (:func:`rlcore.rewards.build_reward`)
when it has one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlcore import seeding
from rlcore.agent import parse_multi_turn
from rlcore.data import PromptSet, load_preferences, load_prompts, load_supervised, parse_curriculum, sample_indices
from rlcore.dataflow import Stage, stage
from rlcore.models import load_tokenizer, token_ids
from rlcore.rewards import build_reward
from rlcore.train.agent_stages import check_multi_turn
from rlcore.train.columns import COLUMNS
from rlcore.train.config import Config, max_positions
from rlcore.train.curriculum import CurriculumPrompts
from rlcore.train.refill import RefillPrompts
from rlcore.train.rollout import left_pad
from rlcore.train.stages import PAIR_TOKEN_COLUMNS, reward_columns, reward_outputs, reward_stage
from rlcore.train.tasks import make_task

__all__ = [
    "PROMPT_COLUMNS",
    "DatasetPrompts",
    "HFTokenizer",
    "PreferencePrompts",
    "SupervisedPrompts",
    "TaskPrompts",
    "make_prompt_source",
    "refill_rows",
    "run_prompt_source",
    "source_tokenizer",
    "task_options",
    "task_validation_set",
]


class HFTokenizer:
    """A Hugging Face tokenizer with the small interface the trainer uses (that of :class:`rlcore.train.CharTokenizer`).

    ``encode`` adds no special tokens (prompts carry their chat template already);
    ``decode`` stops at the first EOS and drops special tokens; EOS and padding ids
    come from the tokenizer (:func:`rlcore.models.token_ids`).

    Args:
      tokenizer: a transformers tokenizer.
      generation_config: the model's generation config (may name more stop ids), or None.
    """

    def __init__(self, tokenizer: Any, generation_config: Any = None):
        self.hf = tokenizer
        ids = token_ids(tokenizer, generation_config=generation_config)
        self.eos_token_id, self.pad_token_id, self.stop_ids = ids.eos, ids.pad, ids.stop

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        cut = next((i for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
        return self.hf.decode(ids[:cut], skip_special_tokens=True)


def _load_tokenizer(cfg: Config) -> Any:
    """``data.tokenizer`` when set, else the model directory's tokenizer; an inline config has none."""
    if cfg.data.tokenizer is not None:
        return load_tokenizer(cfg.data.tokenizer, what="data.tokenizer")
    path = cfg.model.model_name_or_path
    if not isinstance(path, str):
        raise ValueError(
            "model.model_name_or_path: a prompt dataset (data.path) needs a tokenizer: got an inline config, "
            "expected a model directory with a tokenizer, or data.tokenizer set to a tokenizer directory"
        )
    return load_tokenizer(path)


def _model_tokenizer(cfg: Config) -> tuple[Any, HFTokenizer]:
    """The run's Hugging Face tokenizer (:func:`_load_tokenizer`), and its trainer interface."""
    hf = _load_tokenizer(cfg)
    return hf, HFTokenizer(hf)


def _prompt_options(cfg: Config, tokenizer: Any) -> dict[str, Any]:
    d = cfg.data
    return {
        "tokenizer": tokenizer,
        "prompt_key": d.prompt_key,
        "answer_key": d.answer_key,
        "apply_chat_template": d.apply_chat_template,
        "system_prompt": d.system_prompt,
        "max_prompt_length": d.max_prompt_length,
        "overlong": d.overlong,
    }


def _check_positions(cfg: Config, lengths: Sequence[int], what: str, source: str, budget: str) -> None:
    """The longest sequence of a dataset against the model's positions: the config's check, which knows only
    ``data.max_prompt_length``, done on the data. ``lengths``: tokens per row; ``budget``: what they hold, in words."""
    positions = max_positions(cfg)
    if positions is None or not lengths:
        return
    row = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[row] > positions:
        raise ValueError(
            f"{what}: row {row} of {source!r} needs {lengths[row]} positions ({budget}), more than the model's "
            f"max_position_embeddings={positions}; data.max_prompt_length drops or truncates longer prompts"
        )


def _check_prompt_positions(cfg: Config, data: PromptSet, what: str) -> None:
    """Prompts and the tokens a rollout adds after them (``rl.max_new_tokens``, or a multi-turn trajectory's)."""
    key, extra = "rl.max_new_tokens", cfg.rl.max_new_tokens
    if cfg.rl.multi_turn is not None:
        key, extra = "rl.multi_turn.max_total_tokens", parse_multi_turn(cfg.rl.multi_turn).max_total_tokens
    if data.prompt_ids is not None:
        lengths = [len(x) + extra for x in data.prompt_ids]
        _check_positions(cfg, lengths, what, data.source, f"its prompt and {key}={extra}")


def refill_rows(count: int, *, rank: int, attempt: int, world_size: int, rows: int) -> torch.Tensor:
    """Global row indices of ``count`` rows of rank ``rank``'s draw ``attempt`` (each rank holds ``rows`` a step).

    Attempt 0 is the step's batch: ``rank * rows + i``; attempt ``a`` of filter-and-refill
    starts past every rank's rows of the attempts before it, so no two rows of a step share
    a random stream (:mod:`rlcore.seeding`).

    >>> refill_rows(2, rank=1, attempt=0, world_size=2, rows=4).tolist(), refill_rows(2, rank=0, attempt=1, world_size=2, rows=4).tolist()
    ([4, 5], [8, 9])
    """
    return torch.arange(count) + (attempt * world_size + rank) * rows


def _config_reward(cfg: Config, default: Any) -> Any:
    return default if cfg.rewards is None else build_reward(cfg.rewards, what="rewards")


# What a prompt loader gives each row: the left-padded prompt, its reference answer, its group and step.
PROMPT_COLUMNS = COLUMNS.select("prompts", "prompt_mask", "answers", "group", "iteration", "row")


def task_validation_set(task: Any, *, size: int, seed: int, name: str = "task") -> PromptSet:
    """``size`` prompts of a built-in task, drawn from the stream ``(seed, Purpose.EVAL_PROMPTS, 0)``, as a validation set.

    The stream is not the training prompts' (``Purpose.DATA``), so the set is the same
    whatever the run's length, batch size or number of ranks; a small task's prompts may
    also occur in training (reversal of 2-4 letters over 6 has 1548 distinct prompts).

    >>> from rlcore.train.tasks import Reversal
    >>> val = task_validation_set(Reversal(length=3, letters="ab"), size=2, seed=0)
    >>> [a == p[:-1][::-1] for p, a in zip(val.prompts, val.columns["answers"])]
    [True, True]
    """
    samples = task.sample(size, seeding.generator(seed, seeding.Purpose.EVAL_PROMPTS, 0))
    prompts = tuple(s["prompt"] for s in samples)
    ids = tuple(tuple(task.tokenizer.encode(p)) for p in prompts)
    return PromptSet(prompts, prompts, ids, {"answers": tuple(s["answer"] for s in samples)}, f"data.task {name}")


class TaskPrompts:
    """A built-in generated task (``data.task``) as a prompt source; its rule reward unless ``rewards`` is set.

    With ``trainer.eval_every`` (and single-turn rollouts) ``val`` holds ``data.val_size``
    prompts of the task drawn once from their own stream (:func:`task_validation_set`), so
    a run's ``val/pass@1`` is its greedy accuracy on a fixed set. ``warmup_batch`` is the task's own supervised traces (``samples -> {"input_ids",
    "attention_mask", "mask"}``, e.g. the tool-using traces of
    :class:`rlcore.agent.Multiplication`) that the trainer's warm-up trains on, or None
    when the task has none (the warm-up then trains prompt + reference answer).
    """

    dataset = None
    hf_tokenizer: Any = None
    # The loader's columns (the trainer's prompt loader serves a built-in task).
    columns = PROMPT_COLUMNS
    # Prompts: the rollout samples their responses and the rewards score them.
    sampled = True

    def __init__(self, cfg: Config, options: dict[str, Any], world_size: int = 1):
        self.seed, self.batch_size, self.world_size = cfg.trainer.seed, cfg.rl.batch_size, world_size
        self.task = make_task(cfg.data.task, **options)
        self.tokenizer = self.task.tokenizer
        self.reward = _config_reward(cfg, self.task.reward)
        validates = cfg.trainer.eval_every and cfg.rl.multi_turn is None  # multi-turn: its own greedy evaluation
        self.val: PromptSet | None = (
            task_validation_set(self.task, size=cfg.data.val_size, seed=self.seed, name=cfg.data.task)
            if validates
            else None
        )
        traces = getattr(self.task, "warmup_batch", None)
        self.warmup_batch: Callable[[Sequence[Any]], dict[str, torch.Tensor]] | None = (
            traces if callable(traces) else None
        )

    def sample(self, n: int, generator: torch.Generator) -> list[dict[str, Any]]:
        return self.task.sample(n, generator)

    def loader(self, rank: int, start: int, n: int) -> Callable[[int], dict[str, Any]]:
        """Pipeline iteration ``i`` -> the source columns of step ``start + i``: each prompt repeated ``n`` times.

        The step's global batch (``rl.batch_size`` prompts per data-parallel rank) is drawn
        from one stream and data-parallel rank ``rank`` takes its share; ``row`` is each
        row's index in the global batch (``rank * rows + local row``), which keys its
        sampling stream.
        """

        def load(i: int) -> dict[str, Any]:
            return self.draw(start + i, rank, self.batch_size, n)

        return load

    def draw(self, step: int, rank: int, count: int, n: int, *, attempt: int = 0) -> dict[str, Any]:
        """The source columns of ``count`` prompts of step ``step`` on rank ``rank``, each repeated ``n`` times.

        Attempt 0 is the loader's batch (``count`` is ``rl.batch_size``); a later attempt
        (filter-and-refill, :mod:`rlcore.train.refill`) draws ``count`` other prompts from
        the stream ``(seed, Purpose.REFILL, step, rank, attempt)``, its rows keyed past
        every earlier attempt's (:func:`refill_rows`).
        """
        if attempt == 0:
            size = self.batch_size
            drawn = self.sample(size * self.world_size, seeding.generator(self.seed, seeding.Purpose.DATA, step))
            samples = drawn[rank * size : rank * size + count]
        else:
            samples = self.sample(count, seeding.generator(self.seed, seeding.Purpose.REFILL, step, rank, attempt))
        tok = self.tokenizer
        prompts, pmask = left_pad([tok.encode(s["prompt"]) for s in samples], tok.pad_token_id)
        rows = len(samples) * n
        return {
            "prompts": prompts.repeat_interleave(n, 0),
            "prompt_mask": pmask.repeat_interleave(n, 0),
            "answers": [a for a in (torch.tensor(tok.encode(s["answer"])) for s in samples) for _ in range(n)],
            "group": torch.arange(len(samples)).repeat_interleave(n),
            "iteration": torch.full((rows,), step, dtype=torch.int64),
            "row": refill_rows(rows, rank=rank, attempt=attempt, world_size=self.world_size, rows=self.batch_size * n),
        }

    def sampling(self, rollout: Stage, reward: Stage) -> list[Stage]:
        """The stages that sample and score an iteration's rows: the rollout, then the reward."""
        return [rollout, reward]

    def reward_stage(self, pool: Any) -> Stage:
        return reward_stage(pool, self.tokenizer.decode)

    def step_metrics(self, step: int) -> dict[str, float]:
        return {}


class _SeededDataset:
    """What both dataset sources share: the model directory's tokenizer, ``data.val_path``
    and the seeded, resumable order in which rank ``r`` of step ``s`` takes the rows at
    positions ``(s * world_size + r) * batch_size ...`` (:func:`rlcore.data.sample_indices`)."""

    # Prompts (a preference dataset's pairs come finished: False there).
    sampled = True

    def __init__(self, cfg: Config, world_size: int):
        d = cfg.data
        assert d.path is not None
        self.hf_tokenizer, self.tokenizer = _model_tokenizer(cfg)
        self.options = _prompt_options(cfg, self.hf_tokenizer)
        self.val = None if d.val_path is None else load_prompts(d.val_path, what="data.val_path", **self.options)
        if self.val is not None:
            _check_prompt_positions(cfg, self.val, "data.val_path")
        self.seed, self.shuffle, self.world_size = cfg.trainer.seed, d.shuffle, world_size
        self.batch_size = cfg.rl.batch_size

    def _position(self, step: int, rank: int) -> int:
        return (step * self.world_size + rank) * self.batch_size

    def _draw(self, step: int, rank: int, num_rows: int) -> list[int]:
        """The dataset rows rank ``rank`` takes at step ``step``, of ``num_rows``."""
        return sample_indices(
            num_rows, self.batch_size, seed=self.seed, position=self._position(step, rank), shuffle=self.shuffle
        ).indices

    def _summary(self, parts: list[str]) -> str:
        if self.val is not None:
            parts.append(f"data.val_path: {len(self.val)} prompts ({self.val.num_dropped} dropped)")
        return "; ".join(parts)

    def _epoch(self, step: int, num_rows: int) -> float:
        """Epochs completed over the whole data-parallel group after step ``step``."""
        return self._position(step + 1, 0) / num_rows


class DatasetPrompts(_SeededDataset):
    """A prompt dataset (``data.path``, ``data.val_path``) with the model directory's tokenizer.

    Args:
      cfg: the run's config (``data.*``, ``trainer.seed``, ``rl.batch_size``).
      world_size: data-parallel ranks; rank ``r`` of step ``s`` draws the prompts at
        positions ``(s * world_size + r) * batch_size ...`` of the seeded order.
    """

    columns = (*PROMPT_COLUMNS, *COLUMNS.select("index"))

    def __init__(self, cfg: Config, world_size: int = 1):
        super().__init__(cfg, world_size)
        d = cfg.data
        assert d.path is not None
        self.dataset = load_prompts(d.path, what="data.path", **self.options)
        _check_prompt_positions(cfg, self.dataset, "data.path")
        if cfg.rewards is not None:
            self.reward = build_reward(cfg.rewards, what="rewards")
        elif d.answer_key is not None:
            self.reward = build_reward(["math"], what="rewards")  # verified maths against the answer column
        else:
            raise ValueError("rewards: got none, and data.answer_key is null; list the rewards in the config")
        answers = self.dataset.columns.get("answers")
        self.answers = [str(a) for a in answers] if answers is not None else [""] * len(self.dataset)

    @property
    def num_dropped(self) -> int:
        return self.dataset.num_dropped + (self.val.num_dropped if self.val is not None else 0)

    def summary(self) -> str:
        """One line for the log: prompts kept, dropped and truncated as longer than ``data.max_prompt_length``."""
        parts = [f"data.path: {len(self.dataset)} prompts from {self.dataset.source!r}"]
        parts.append(f"{self.dataset.num_dropped} dropped and {self.dataset.num_truncated} truncated as overlong")
        return self._summary(parts)

    def sample(self, n: int, generator: torch.Generator) -> list[dict[str, Any]]:
        """Warm-up samples: ``n`` random prompts (as the policy sees them) with their answers."""
        rows = torch.randint(0, len(self.dataset), (n,), generator=generator).tolist()
        return [{"prompt": self.dataset.texts[i], "answer": self.answers[i]} for i in rows]

    def loader(self, rank: int, start: int, n: int) -> Callable[[int], dict[str, Any]]:
        """Pipeline iteration ``i`` -> the source columns of step ``start + i``, each prompt repeated ``n`` times."""

        def load(i: int) -> dict[str, Any]:
            return self.draw(start + i, rank, self.batch_size, n)

        return load

    def pick(self, step: int, rank: int, count: int, *, attempt: int = 0) -> list[int]:
        """The dataset rows of :meth:`draw`: the seeded order's at attempt 0, else uniform draws from
        ``(seed, Purpose.REFILL, step, rank, attempt)``."""
        if attempt == 0:
            return self._draw(step, rank, len(self.dataset))[:count]
        g = seeding.generator(self.seed, seeding.Purpose.REFILL, step, rank, attempt)
        return torch.randint(0, len(self.dataset), (count,), generator=g).tolist()

    def draw(self, step: int, rank: int, count: int, n: int, *, attempt: int = 0) -> dict[str, Any]:
        """The source columns of ``count`` prompts of step ``step`` on rank ``rank`` (:meth:`pick`), each ``n`` times."""
        return self.columns_of(self.pick(step, rank, count, attempt=attempt), step, rank, n, attempt=attempt)

    def columns_of(self, draw: Sequence[int], step: int, rank: int, n: int, *, attempt: int = 0) -> dict[str, Any]:
        """The source columns of the dataset rows ``draw``, each repeated ``n`` times, keyed as ``attempt``'s rows."""
        ids = self.dataset.prompt_ids
        assert ids is not None
        tok = self.tokenizer
        prompts, pmask = left_pad([list(ids[j]) for j in draw], tok.pad_token_id)
        rows = len(draw) * n
        return {
            "prompts": prompts.repeat_interleave(n, 0),
            "prompt_mask": pmask.repeat_interleave(n, 0),
            "answers": [
                torch.tensor(tok.encode(self.answers[j]) or [tok.eos_token_id]) for j in draw for _ in range(n)
            ],
            "group": torch.arange(len(draw)).repeat_interleave(n),
            "iteration": torch.full((rows,), step, dtype=torch.int64),
            # The row's index in the step's global batch (past every earlier attempt's rows).
            "row": refill_rows(rows, rank=rank, attempt=attempt, world_size=self.world_size, rows=self.batch_size * n),
            "index": torch.tensor(list(draw), dtype=torch.int64).repeat_interleave(n),
        }

    def sampling(self, rollout: Stage, reward: Stage) -> list[Stage]:
        """The stages that sample and score an iteration's rows: the rollout, then the reward."""
        return [rollout, reward]

    def reward_stage(self, pool: Any, *, resource: str = "cpu") -> Stage:
        """Score the decoded responses with the prompts as written and every keyword column of the dataset."""
        data, decode = self.dataset, self.tokenizer.decode

        def reward(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            rows = b["index"].tolist()
            texts = [decode(r[m != 0].tolist()) for r, m in zip(b["responses"], b["mask"])]
            prompts = [data.prompts[i] for i in rows]
            columns = data.reward_columns(rows)
            return reward_columns(pool.submit(prompts, texts, batch=int(b["iteration"][0]), **columns).result())

        return stage(
            reward,
            inputs=["responses", "mask", "index", "iteration"],
            outputs=reward_outputs(pool),
            name="reward",
            resource=resource,
        )

    def step_metrics(self, step: int) -> dict[str, float]:
        """The epoch counter after step ``step`` (epochs completed over the whole data-parallel group)."""
        return {"epoch": self._epoch(step, len(self.dataset)), "data/dropped": float(self.dataset.num_dropped)}


class PreferencePrompts(_SeededDataset):
    """A preference dataset (``data.path`` with ``rl.algo: dpo``) for offline DPO: its pairs, no rollout.

    The pairs come from the columns ``data.prompt_key``, ``data.chosen_key`` and
    ``data.rejected_key`` (:func:`rlcore.data.load_preferences`, with the model
    directory's tokenizer, its chat template and EOS). The warm-up trains on the chosen
    responses. ``data.val_path`` is a prompt dataset as for RL (``data.answer_key``),
    scored by ``rewards`` (default: verified maths against the answer column) when
    ``trainer.eval_every`` is set.

    Args:
      cfg: the run's config (``data.*``, ``trainer.seed``, ``rl.batch_size``).
      world_size: data-parallel ranks; rank ``r`` of step ``s`` takes the pairs at
        positions ``(s * world_size + r) * batch_size ...`` of the seeded order.
    """

    columns = (*PAIR_TOKEN_COLUMNS, *COLUMNS.select("prompt_mask", "iteration", "index"))
    # The rows come finished (pairs): nothing is sampled or scored during training.
    sampled = False

    def __init__(self, cfg: Config, world_size: int = 1):
        super().__init__(cfg, world_size)
        d = cfg.data
        assert d.path is not None
        self.pairs = load_preferences(
            d.path,
            tokenizer=self.hf_tokenizer,
            prompt_key=d.prompt_key,
            chosen_key=d.chosen_key,
            rejected_key=d.rejected_key,
            eos_token_id=self.tokenizer.eos_token_id,
            apply_chat_template=d.apply_chat_template,
            system_prompt=d.system_prompt,
            max_prompt_length=d.max_prompt_length,
            max_response_length=d.max_response_length,
            overlong=d.overlong,
            what="data.path",
        )
        self.dataset = self.pairs.prompts
        assert self.dataset.prompt_ids is not None
        lengths = [
            len(p) + max(len(c), len(r))
            for p, c, r in zip(self.dataset.prompt_ids, self.pairs.chosen_ids, self.pairs.rejected_ids)
        ]
        _check_positions(cfg, lengths, "data.path", self.dataset.source, "its prompt and its longer response")
        self.reward = _validation_reward(cfg, self.val)  # offline DPO scores nothing

    def summary(self) -> str:
        """One line for the log: pairs kept, dropped and truncated as longer than the length limits."""
        p = self.pairs
        parts = [f"data.path: {len(p)} preference pairs from {p.prompts.source!r}"]
        parts.append(f"{p.prompts.num_dropped} dropped and {p.prompts.num_truncated} truncated as overlong prompts")
        parts.append(f"{p.num_dropped} dropped and {p.num_truncated} truncated as overlong responses")
        return self._summary(parts)

    def sample(self, n: int, generator: torch.Generator) -> list[dict[str, Any]]:
        """Warm-up samples: ``n`` random prompts (as the policy sees them) with their chosen responses."""
        rows = torch.randint(0, len(self.pairs), (n,), generator=generator).tolist()
        return [{"prompt": self.dataset.texts[i], "answer": self.pairs.chosen[i]} for i in rows]

    def loader(self, rank: int, start: int, n: int = 1) -> Callable[[int], dict[str, Any]]:
        """Pipeline iteration ``i`` -> the pair columns of step ``start + i`` (``PAIR_TOKEN_COLUMNS``, ``prompt_mask``, ``index``)."""
        if n != 1:
            raise ValueError(f"n: got {n}, expected 1 (one pair per prompt)")
        ids = self.dataset.prompt_ids
        assert ids is not None
        pad = self.tokenizer.pad_token_id

        def load(i: int) -> dict[str, Any]:
            step = start + i
            draw = self._draw(step, rank, len(self.pairs))
            out: dict[str, Any] = {}
            for side, responses in (("chosen", self.pairs.chosen_ids), ("rejected", self.pairs.rejected_ids)):
                rows = [(ids[j], responses[j]) for j in draw]
                out[f"{side}_input_ids"] = [torch.tensor([*p, *r]) for p, r in rows]
                out[f"{side}_attention_mask"] = [torch.ones(len(p) + len(r), dtype=torch.long) for p, r in rows]
                out[f"{side}_mask"] = [
                    torch.cat([torch.zeros(len(p), dtype=torch.long), torch.ones(len(r), dtype=torch.long)])
                    for p, r in rows
                ]
            _, pmask = left_pad([list(ids[j]) for j in draw], pad)
            out["prompt_mask"] = pmask
            out["iteration"] = torch.full((len(draw),), step, dtype=torch.int64)
            out["index"] = torch.tensor(draw)
            return out

        return load

    def step_metrics(self, step: int) -> dict[str, float]:
        """The epoch counter after step ``step`` (epochs completed over the whole data-parallel group)."""
        return {
            "epoch": self._epoch(step, len(self.pairs)),
            "data/dropped": float(self.dataset.num_dropped + self.pairs.num_dropped),
        }


class SupervisedPrompts(_SeededDataset):
    """An SFT dataset (``data.path`` with ``rl.algo: sft``): demonstrations, no rollout.

    Rows are ``data.prompt_key`` / ``data.response_key`` columns, or one
    ``data.messages_key`` column of conversations whose last message is the reply
    (:func:`rlcore.data.load_supervised`, with the model directory's tokenizer, its chat
    template and EOS). Each row is the whole sequence ``prompt + response + EOS`` with
    ``sft_mask`` on the response and its EOS: the prompt is never trained on.

    Args:
      cfg: the run's config (``data.*``, ``trainer.seed``, ``rl.batch_size``).
      world_size: data-parallel ranks, as for :class:`PreferencePrompts`.
    """

    columns = COLUMNS.select("sft_input_ids", "sft_attention_mask", "sft_mask", "prompt_mask", "iteration", "index")
    sampled = False

    def __init__(self, cfg: Config, world_size: int = 1):
        super().__init__(cfg, world_size)
        d = cfg.data
        assert d.path is not None
        self.rows = load_supervised(
            d.path,
            tokenizer=self.hf_tokenizer,
            prompt_key=d.prompt_key,
            response_key=d.response_key,
            messages_key=d.messages_key,
            eos_token_id=self.tokenizer.eos_token_id,
            apply_chat_template=d.apply_chat_template,
            system_prompt=d.system_prompt,
            max_prompt_length=d.max_prompt_length,
            max_response_length=d.max_response_length,
            overlong=d.overlong,
            what="data.path",
        )
        self.dataset = self.rows.prompts
        assert self.dataset.prompt_ids is not None
        lengths = [len(p) + len(r) for p, r in zip(self.dataset.prompt_ids, self.rows.response_ids)]
        _check_positions(cfg, lengths, "data.path", self.dataset.source, "its prompt and its response")
        self.reward = _validation_reward(cfg, self.val)  # SFT scores nothing

    def summary(self) -> str:
        """One line for the log: rows kept, dropped and truncated as longer than the length limits."""
        r = self.rows
        parts = [f"data.path: {len(r)} SFT rows from {r.prompts.source!r}"]
        parts.append(f"{r.prompts.num_dropped} dropped and {r.prompts.num_truncated} truncated as overlong prompts")
        parts.append(f"{r.num_dropped} dropped and {r.num_truncated} truncated as overlong responses")
        return self._summary(parts)

    def sample(self, n: int, generator: torch.Generator) -> list[dict[str, Any]]:
        """Warm-up samples: ``n`` random prompts (as the policy sees them) with their responses."""
        rows = torch.randint(0, len(self.rows), (n,), generator=generator).tolist()
        return [{"prompt": self.dataset.texts[i], "answer": self.rows.responses[i]} for i in rows]

    def loader(self, rank: int, start: int, n: int = 1) -> Callable[[int], dict[str, Any]]:
        """Pipeline iteration ``i`` -> the SFT columns of step ``start + i`` (``sft_*``, ``prompt_mask``, ``index``)."""
        if n != 1:
            raise ValueError(f"n: got {n}, expected 1 (one demonstration per prompt)")
        ids = self.dataset.prompt_ids
        assert ids is not None
        pad = self.tokenizer.pad_token_id

        def load(i: int) -> dict[str, Any]:
            step = start + i
            draw = self._draw(step, rank, len(self.rows))
            rows = [(ids[j], self.rows.response_ids[j]) for j in draw]
            _, pmask = left_pad([list(ids[j]) for j in draw], pad)
            return {
                "sft_input_ids": [torch.tensor([*p, *r]) for p, r in rows],
                "sft_attention_mask": [torch.ones(len(p) + len(r), dtype=torch.long) for p, r in rows],
                "sft_mask": [
                    torch.cat([torch.zeros(len(p), dtype=torch.long), torch.ones(len(r), dtype=torch.long)])
                    for p, r in rows
                ],
                "prompt_mask": pmask,
                "iteration": torch.full((len(draw),), step, dtype=torch.int64),
                "index": torch.tensor(draw),
            }

        return load

    def step_metrics(self, step: int) -> dict[str, float]:
        """The epoch counter after step ``step`` (epochs completed over the whole data-parallel group)."""
        return {
            "epoch": self._epoch(step, len(self.rows)),
            "data/dropped": float(self.dataset.num_dropped + self.rows.num_dropped),
        }


def make_prompt_source(
    cfg: Config, task_options: dict[str, Any], *, world_size: int = 1
) -> TaskPrompts | DatasetPrompts | PreferencePrompts | SupervisedPrompts:
    """The run's prompt source: the dataset at ``data.path`` when set (preference pairs for ``rl.algo: dpo`` and
    ``rm``, demonstrations for ``sft``), else the built-in task."""
    if cfg.data.path is not None:
        if cfg.rl.algo == "sft":
            return SupervisedPrompts(cfg, world_size)
        return PreferencePrompts(cfg, world_size) if cfg.rl.algo in ("dpo", "rm") else DatasetPrompts(cfg, world_size)
    return TaskPrompts(cfg, task_options, world_size)


def _validation_reward(cfg: Config, val: Any) -> Any:
    """The reward of a recipe that scores nothing while it trains (offline DPO, SFT): validation's, if it has one.

    ``rewards`` as listed; else, with a validation set and ``data.answer_key``, the math reward;
    None when nothing validates.
    """
    if cfg.rewards is not None:
        return build_reward(cfg.rewards, what="rewards")
    if val is not None and cfg.trainer.eval_every and cfg.data.answer_key is not None:
        return build_reward(["math"], what="rewards")
    if val is not None and cfg.trainer.eval_every:
        raise ValueError("rewards: got none, and data.answer_key is null; list the rewards validation scores with")
    return None


def run_prompt_source(cfg: Config, *, world_size: int = 1, leader: bool = True) -> Any:
    """The trainer's prompt source (:func:`make_prompt_source`), checked for the run before any model is built.

    With ``rl.multi_turn`` its tools, environment and stop tokens are refused now, not after
    the warm-up; a dataset's summary is printed by the ``leader`` rank. With
    ``data.curriculum`` it is drawn by :class:`rlcore.train.curriculum.CurriculumPrompts`; with
    ``rl.max_refill_draws`` it is wrapped in :class:`rlcore.train.refill.RefillPrompts`.
    """
    task: Any = make_prompt_source(cfg, task_options(cfg), world_size=world_size)
    if cfg.rl.multi_turn is not None:
        check_multi_turn(cfg, task)
    if task.dataset is not None and leader:
        print(task.summary(), flush=True)
    if cfg.data.curriculum is not None:  # the steps' prompts drawn by pass-rate band (the loader runs up to lag ahead)
        lag = 2 + (cfg.deploy.staleness if cfg.deploy.async_infer else 0)
        task = CurriculumPrompts(task, parse_curriculum(cfg.data.curriculum), lag=lag)
    if cfg.rl.max_refill_draws:  # filter-and-refill: one sampling stage fills the slots with informative groups
        task = RefillPrompts(task, max_draws=cfg.rl.max_refill_draws, n_samples=cfg.rl.n_samples)
    return task


def source_tokenizer(cfg: Config, task_options: dict[str, Any]) -> Any:
    """The run's tokenizer alone (what a rollout worker needs): with a dataset, ``data.tokenizer`` or the model
    directory's; else the task's."""
    if cfg.data.path is not None:
        return HFTokenizer(_load_tokenizer(cfg))
    return make_task(cfg.data.task, **task_options).tokenizer


def task_options(cfg: Config) -> dict[str, Any]:
    """The built-in task's options from ``data.*`` (digits for addition and multiplication; length, letters for reversal)."""
    d = cfg.data
    if d.task in ("addition", "multiplication"):
        return {"digits": d.digits}
    return {"length": d.length, "min_length": d.min_length, "letters": d.letters}
