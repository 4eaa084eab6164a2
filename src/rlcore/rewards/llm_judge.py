"""An LLM judge as a reward: a local generative model reads a prompt template, writes a verdict, a score is parsed.

The judge samples through an inference engine (by default the trainer's rollout engine,
:class:`rlcore.train.TorchEngine`, greedy), in batches, with a wall-clock timeout per
call; the parsed score is normalised to ``[0, 1]`` from ``[min_score, max_score]``. It
combines with rule rewards in a config's ``rewards:`` list::

    rewards:
      - {reward: answer_match, weight: 1.0}
      - {reward: llm_judge, weight: 0.5, kwargs: {path: judge_model/, template: "...{prompt}...{response}..."}}
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from rlcore.models import left_pad, load_causal_lm, load_tokenizer
from rlcore.references import load_reference

__all__ = ["DEFAULT_JUDGE_TEMPLATE", "LLMJudge", "parse_score"]

DEFAULT_JUDGE_TEMPLATE = "Rate the response to the prompt from 0 to 10.\nPrompt: {prompt}\nResponse: {response}\nScore:"
_NUMBER = r"(-?\d+(?:\.\d+)?)"


def parse_score(text: str, *, pattern: str = _NUMBER, min_score: float = 0.0, max_score: float = 10.0) -> float | None:
    """The first score ``pattern`` finds in ``text``, clamped to ``[min_score, max_score]`` and scaled to ``[0, 1]``.

    Args:
      text: the judge's output.
      pattern: a regular expression; its first group (or the whole match) is the number.
      min_score, max_score: the judge's scale.

    Returns:
      The normalised score, or ``None`` when ``text`` holds no number.

    >>> parse_score("I would give it 7/10."), parse_score("Score: 12"), parse_score("no idea")
    (0.7, 1.0, None)
    """
    if not max_score > min_score:
        raise ValueError(f"max_score: got {max_score!r}, expected more than min_score={min_score!r}")
    match = re.search(pattern, text)
    if match is None:
        return None
    try:
        value = float(match.group(1) if match.groups() else match.group(0))
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    return (min(max(value, min_score), max_score) - min_score) / (max_score - min_score)


class LLMJudge:
    """A generative reward model: ``template`` filled with each (prompt, response), a verdict generated, a score parsed.

    The judge model loads on first use (the object pickles without its weights, for a
    reward worker). Each call generates in batches of ``batch_size`` through the engine;
    a call that takes longer than ``timeout`` seconds returns ``default`` for every row
    (the generation under way finishes in the background; the next call waits for it).

    Args:
      path: a local causal-LM directory with its tokenizer (rlcore never downloads).
      template: a ``str.format`` template with ``{prompt}`` and ``{response}``, sent as a user
        turn through the judge's chat template when its tokenizer has one.
      pattern: the score's regular expression (:func:`parse_score`).
      min_score, max_score: the judge's scale, mapped to ``[0, 1]``.
      default: the score of a row whose verdict holds no number, or of a timed-out call.
      max_new_tokens: the verdict's length bound.
      batch_size: rows per generate call.
      timeout: seconds a call may take (``None``: no limit).
      engine: an :class:`rlcore.train.InferenceEngine` class, or its ``"package.module:Name"``
        reference (what a config gives), built as ``Engine(model, eos_token_id=, pad_token_id=, max_new_tokens=, temperature=0.0)``.
      device: where the judge runs.
      torch_dtype: the judge's dtype.

    Returns (call): float32 ``[B]`` scores on the CPU; :attr:`last_texts` holds the verdicts of
    the last call, :attr:`timeouts` counts timed-out calls.
    """

    name = "llm_judge"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        template: str = DEFAULT_JUDGE_TEMPLATE,
        pattern: str = _NUMBER,
        min_score: float = 0.0,
        max_score: float = 10.0,
        default: float = 0.0,
        max_new_tokens: int = 16,
        batch_size: int = 16,
        timeout: float | None = 60.0,
        engine: str | Callable[..., Any] = "rlcore.train:TorchEngine",
        device: str | torch.device = "cpu",
        torch_dtype: str = "float32",
    ):
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"path: got {path!r}, expected a local judge-model directory (rlcore never downloads)")
        try:
            template.format(prompt="", response="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"template: got {template!r}, expected a format string with only {{prompt}} and {{response}} ({err})"
            ) from err
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(f"pattern: got {pattern!r}, not a regular expression ({err})") from err
        parse_score("0", pattern=_NUMBER, min_score=min_score, max_score=max_score)  # checks the scale
        for arg, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg}: got {value!r}, expected a positive int")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout: got {timeout!r}, expected seconds > 0 or None")
        self.path, self.template, self.pattern = path, template, pattern
        self.min_score, self.max_score, self.default = float(min_score), float(max_score), float(default)
        self.max_new_tokens, self.batch_size, self.timeout = max_new_tokens, batch_size, timeout
        self.engine_ref, self.device, self.torch_dtype = engine, str(device), torch_dtype
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._loaded: tuple[Any, Any] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.timeouts = 0
        self.last_texts: list[str] = []

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_") and k not in ("timeouts", "last_texts")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def _load(self) -> tuple[Any, Any]:
        """``(engine, tokenizer)``, built on first use."""
        if self._loaded is None:
            tokenizer = load_tokenizer(self.path, what="llm_judge.path")
            model = load_causal_lm(self.path, dtype=self.torch_dtype, what="llm_judge.path").to(self.device).eval()
            factory = self.engine_ref
            if isinstance(factory, str):
                factory = load_reference(factory, what="llm_judge.engine")
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            engine = factory(
                model,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=pad,
                max_new_tokens=self.max_new_tokens,
                temperature=0.0,
            )
            self._loaded = (engine, tokenizer)
        return self._loaded

    def texts(self, prompts: Sequence[Any], responses: Sequence[str], tokenizer: Any) -> list[str]:
        """The judge's input for each pair: the template filled, through the chat template when there is one."""
        out = []
        for prompt, response in zip(prompts, responses):
            shown = prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)
            text = self.template.format(prompt=shown, response=response)
            if getattr(tokenizer, "chat_template", None):
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
                )
            out.append(text)
        return out

    def _judge(self, prompts: Sequence[Any], responses: Sequence[str]) -> tuple[list[float], list[str]]:
        with self._lock:
            engine, tokenizer = self._load()
            texts = self.texts(prompts, responses, tokenizer)
            templated = bool(getattr(tokenizer, "chat_template", None))
            scores, verdicts = [], []
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            for start in range(0, len(texts), self.batch_size):
                chunk = texts[start : start + self.batch_size]
                ids = [tokenizer(t, add_special_tokens=not templated)["input_ids"] for t in chunk]
                prompt_ids, prompt_mask = left_pad(ids, pad)
                rollout = engine.generate(prompt_ids.to(self.device), prompt_mask.to(self.device), n=1, generator=None)
                for row, mask in zip(rollout.responses, rollout.mask):
                    verdict = tokenizer.decode(row[mask != 0].tolist(), skip_special_tokens=True)
                    score = parse_score(
                        verdict, pattern=self.pattern, min_score=self.min_score, max_score=self.max_score
                    )
                    verdicts.append(verdict)
                    scores.append(self.default if score is None else score)
            return scores, verdicts

    def __call__(self, prompts: Sequence[Any], responses: Sequence[str], **_: Any) -> torch.Tensor:
        if len(prompts) != len(responses):
            raise ValueError(f"responses: got {len(responses)}, expected {len(prompts)} (one per prompt)")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="llm-judge")
        future = self._pool.submit(self._judge, list(prompts), list(responses))
        try:
            scores, self.last_texts = future.result(timeout=self.timeout)
        except FutureTimeout:
            self.timeouts += 1
            self.last_texts = []
            scores = [self.default] * len(prompts)
        return torch.tensor(scores, dtype=torch.float32)
