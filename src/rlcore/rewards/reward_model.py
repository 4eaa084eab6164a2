"""A reward model as a reward: a local ``AutoModelForSequenceClassification`` directory scoring (prompt, response)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from rlcore.models.build import resolve_dtype
from rlcore.models.loading import load_tokenizer

__all__ = ["RewardModel", "ranking_accuracy"]


class RewardModel:
    """The scalar head of a sequence-classification model on each (prompt, response) pair, in batches.

    The pair is written as a user turn and an assistant turn through the reward model's
    chat template when its tokenizer has one (``apply_chat_template=None``), else as
    ``prompt + response``; long pairs keep their end (left truncation). The model loads
    on first use, so the object is cheap to build and pickles without its weights.

    Args:
      path: a local directory written by ``save_pretrained`` (model and tokenizer).
      device: where the model runs (the trainer's device).
      batch_size: pairs per forward pass.
      max_length: the longest pair in tokens.
      torch_dtype: the model's dtype (see :func:`rlcore.models.resolve_dtype`).
      apply_chat_template: use the tokenizer's chat template; ``None``: when it has one.
      label: which output of the head is the score (a one-label head has only ``0``).
      append_eos: end each scored text with the tokenizer's EOS token (a reward model trained
        by ``rl.algo: rm`` scores its responses after their EOS, as TRL's reward trainer does).
      what: the setting that gave ``path``, named in errors.

    Returns (call): float32 ``[B]`` scores on the CPU.
    """

    name = "reward_model"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        device: str | torch.device = "cpu",
        batch_size: int = 8,
        max_length: int = 2048,
        torch_dtype: str | torch.dtype | None = "float32",
        apply_chat_template: bool | None = None,
        label: int = 0,
        append_eos: bool = False,
        what: str = "reward_model.path",
    ):
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"{what}: got {path!r}, expected a local reward-model directory (rlcore never downloads)")
        for arg, value in (("batch_size", batch_size), ("max_length", max_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg}: got {value!r}, expected a positive int")
        self.path, self.device, self.batch_size, self.max_length = path, str(device), batch_size, max_length
        self.dtype = resolve_dtype(torch_dtype, path=path)
        self.apply_chat_template, self.label, self.what = apply_chat_template, label, what
        self.append_eos = bool(append_eos)
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._loaded: tuple[Any, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def _load(self) -> tuple[Any, Any]:
        if self._loaded is None:
            from transformers import AutoModelForSequenceClassification

            tokenizer = load_tokenizer(self.path, what=self.what)
            tokenizer.truncation_side = "left"
            try:
                model = AutoModelForSequenceClassification.from_pretrained(
                    self.path, dtype=self.dtype, local_files_only=True
                )
            except Exception as err:
                first = (str(err).strip().splitlines() or [""])[0]
                raise ValueError(
                    f"{self.what}: {self.path!r} does not load as a sequence-classification model: "
                    f"{type(err).__name__}: {first}"
                ) from err
            if not 0 <= self.label < model.config.num_labels:
                raise ValueError(f"label: got {self.label}, expected 0 <= label < {model.config.num_labels}")
            if model.config.pad_token_id is None:
                model.config.pad_token_id = tokenizer.pad_token_id
            self._loaded = (model.to(self.device).eval(), tokenizer)
        return self._loaded

    def _templated(self, tokenizer: Any) -> bool:
        if self.apply_chat_template is None:
            return bool(getattr(tokenizer, "chat_template", None))
        return bool(self.apply_chat_template)

    def texts(self, prompts: Sequence[Any], responses: Sequence[str]) -> list[str]:
        """The text scored for each pair."""
        _, tokenizer = self._load()
        eos = tokenizer.eos_token if self.append_eos and tokenizer.eos_token else ""
        if not self._templated(tokenizer):
            return [f"{p}{r}{eos}" for p, r in zip(prompts, responses)]
        out = []
        for prompt, response in zip(prompts, responses):
            turns = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            out.append(
                tokenizer.apply_chat_template([*turns, {"role": "assistant", "content": response}], tokenize=False)
            )
            out[-1] += "" if out[-1].endswith(eos) else eos
        return out

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Any], responses: Sequence[str], **_: Any) -> torch.Tensor:
        if len(prompts) != len(responses):
            raise ValueError(f"responses: got {len(responses)}, expected {len(prompts)} (one per prompt)")
        with self._lock:
            model, tokenizer = self._load()
            texts = self.texts(prompts, responses)
            scores = []
            for start in range(0, len(texts), self.batch_size):
                batch = tokenizer(
                    texts[start : start + self.batch_size],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    add_special_tokens=not self._templated(tokenizer),
                    return_tensors="pt",
                ).to(self.device)
                logits = model(**batch).logits
                scores.append(logits[:, self.label].float().cpu())
        return torch.cat(scores) if scores else torch.zeros(0)


def ranking_accuracy(reward: Any, prompts: Sequence[Any], chosen: Sequence[str], rejected: Sequence[str]) -> float:
    """The fraction of preference pairs that ``reward`` ranks right: the chosen response scored above the rejected one.

    Args:
      reward: a ``(prompts, responses) -> [B]`` reward (e.g. :class:`RewardModel`).
      prompts, chosen, rejected: the pairs, one of each per pair.

    Returns:
      The accuracy in ``[0, 1]`` (ties count as wrong).

    >>> ranking_accuracy(lambda p, r: torch.tensor([float(len(x)) for x in r]), ["q", "q"], ["aa", "a"], ["a", "aa"])
    0.5
    """
    if not len(prompts) == len(chosen) == len(rejected) or not prompts:
        raise ValueError(
            f"prompts, chosen, rejected: got {len(prompts)}, {len(chosen)}, {len(rejected)} rows, expected as many "
            "of each, at least one"
        )
    scores = torch.as_tensor(reward([*prompts, *prompts], [*chosen, *rejected]), dtype=torch.float64)
    n = len(prompts)
    return float((scores[:n] > scores[n:]).double().mean())
