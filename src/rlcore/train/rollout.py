"""Rollout: batched sampling from a causal LM with a KV cache, and the protocol for an external engine.

The trainer only needs token ids back from a rollout (it recomputes the old-policy
log-probs with its own forward pass, as verl and OpenRLHF do, so a different kernel in
the inference engine cannot bias the importance ratio). An engine that returns a
:class:`Rollout` -- this module's :class:`TorchEngine`, or an adapter around vLLM /
vllm-ascend -- plugs into the trainer.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from rlcore._checks import check_integer, check_ndim, check_same_shape
from rlcore.models.sampling import filter_logits, left_pad
from rlcore.models.shared_prefix import shares_prompts

__all__ = ["InferenceEngine", "Rollout", "TorchEngine", "filter_logits", "generate", "left_pad"]


class Rollout(NamedTuple):
    """Sampled responses. ``N = B * n`` rows, sample ``j`` of prompt ``i`` in row ``i * n + j``.

    Fields:
      prompts: ``[N, P]`` int64, left-padded prompt ids.
      prompt_mask: ``[N, P]``, 1 on real prompt tokens.
      responses: ``[N, R]`` int64, right-padded with the pad id after ``<eos>``.
      logp: ``[N, R]`` float32 log-probs of the sampled tokens under the
        temperature-scaled policy (before top-k / top-p truncation).
      mask: ``[N, R]``, 1 on response tokens up to and including ``<eos>``.
    """

    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    responses: torch.Tensor
    logp: torch.Tensor
    mask: torch.Tensor


@runtime_checkable
class InferenceEngine(Protocol):
    """What the trainer needs from an inference engine.

    ``generate`` samples ``n`` responses per left-padded prompt; ``load_weights`` receives
    the trainer's parameters (name -> tensor) after each optimiser step, so a
    disaggregated engine (vLLM, vllm-ascend) can refresh its copy.
    """

    def generate(
        self, prompts: torch.Tensor, prompt_mask: torch.Tensor, *, n: int, generator: torch.Generator | None
    ) -> Rollout: ...

    def load_weights(self, params: dict[str, torch.Tensor]) -> None: ...


@torch.no_grad()
def generate(
    model: Any,
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    eos_token_id: int,
    pad_token_id: int = 0,
    max_new_tokens: int = 16,
    n: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> Rollout:
    """Sample ``n`` responses per prompt from a Hugging Face causal LM, reusing its KV cache.

    The prompt goes through the model once; each later step feeds one token per row
    with the cache (``past_key_values``), position ids counted from each row's first
    real token, and the attention mask grown by one column. A row stops at ``<eos>``
    (kept, masked in); the loop stops when every row has stopped or after
    ``max_new_tokens``. ``temperature=0`` is greedy decoding.

    Args:
      model: ``model(input_ids=, attention_mask=, position_ids=, past_key_values=, use_cache=True)``
        returning ``.logits`` and ``.past_key_values`` (any ``transformers`` causal LM; the
        field is ``cache`` from transformers 5 on).
      prompts: ``[B, P]`` int64 left-padded ids; prompt_mask: ``[B, P]``.
      eos_token_id, pad_token_id: special ids.
      max_new_tokens, n, temperature, top_p, top_k: sampling controls.
      generator: the random stream (a seeded generator makes a rollout reproducible).

    Returns:
      a :class:`Rollout` with ``B * n`` rows.
    """
    check_ndim("prompts", prompts, 2)
    check_integer("prompts", prompts)
    check_same_shape("prompt_mask", prompt_mask, "prompts", prompts)
    for name, value, ok, want in [
        ("max_new_tokens", max_new_tokens, isinstance(max_new_tokens, int) and max_new_tokens >= 1, "an int >= 1"),
        ("n", n, isinstance(n, int) and n >= 1, "an int >= 1"),
        ("temperature", temperature, temperature >= 0, ">= 0"),
        ("top_p", top_p, 0 < top_p <= 1, "in (0, 1]"),
        ("top_k", top_k, isinstance(top_k, int) and top_k >= 0, "an int >= 0"),
    ]:
        if not ok:
            raise ValueError(f"{name}: got {value!r}, expected {want}")
    vocab = _vocab_size(model)
    _check_token_id("eos_token_id", eos_token_id, vocab)
    _check_token_id("pad_token_id", pad_token_id, vocab)
    device = prompts.device
    ids = prompts.repeat_interleave(n, 0)
    attention = prompt_mask.to(torch.long).repeat_interleave(n, 0)
    rows = ids.shape[0]
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    # transformers 5 renamed ``past_key_values`` to ``cache`` (argument and output field).
    cache = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = _prefill(model, ids, attention, positions, cache)
    next_position = positions[:, -1:] + 1
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    tokens, logps, masks = [], [], []
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1].float()
        scaled = logits / temperature if temperature > 0 else logits
        logp_all = torch.log_softmax(scaled, dim=-1)
        if temperature == 0:
            token = logits.argmax(-1)
        else:
            probs = torch.softmax(filter_logits(scaled, top_k=top_k, top_p=top_p), dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        alive = ~done
        token = torch.where(alive, token, pad_token_id)
        tokens.append(token)
        logps.append(torch.where(alive, logp_all.gather(-1, token[:, None]).squeeze(-1), 0.0))
        masks.append(alive.to(torch.long))
        done = done | (token == eos_token_id)
        if bool(done.all()):  # sync-ok: the trainer's decode loop, not a library op; stops early
            break
        attention = torch.cat([attention, torch.ones(rows, 1, dtype=attention.dtype, device=device)], dim=1)
        out = model(
            input_ids=token[:, None],
            attention_mask=attention,
            position_ids=next_position,
            use_cache=True,
            **{cache: getattr(out, cache)},
        )
        next_position = next_position + 1
    return Rollout(
        ids, prompt_mask.repeat_interleave(n, 0), torch.stack(tokens, 1), torch.stack(logps, 1), torch.stack(masks, 1)
    )


def _prefill(model: Any, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, cache: str) -> Any:
    """The prompt forward with a KV cache; rows with the same prompt (a GRPO group) share one.

    Each distinct left-padded prompt runs once and its cache entries and last logits are
    then given to every row that has it (``Cache.reorder_cache``, beam search's
    row gather), as vLLM's prefix cache does: the decode steps see exactly what a forward
    over all rows would give them.
    """
    inverse = shares_prompts(ids, attention)
    if inverse is None:
        return model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True)
    rows = ids.shape[0]
    distinct = int(inverse.max()) + 1  # sync-ok: the trainer's decode loop sizes the prefill
    first = torch.full((distinct,), rows, dtype=torch.long, device=ids.device)
    first.scatter_reduce_(0, inverse, torch.arange(rows, device=ids.device), reduce="amin")
    out = model(input_ids=ids[first], attention_mask=attention[first], position_ids=positions[first], use_cache=True)
    kv: Any = getattr(out, cache, None)
    if hasattr(kv, "reorder_cache"):
        kv.reorder_cache(inverse)
    elif isinstance(kv, (tuple, list)):  # a legacy per-layer (key, value) tuple
        kv = tuple(tuple(t.index_select(0, inverse) for t in layer) for layer in kv)
    return _Prefilled(out.logits[:, -1:].index_select(0, inverse), kv, cache)


class _Prefilled:
    """The prefill's result for every row: the last logits and the cache under the model output's field name."""

    def __init__(self, logits: torch.Tensor, kv: Any, field: str):
        self.logits = logits
        setattr(self, field, kv)


def _vocab_size(model: Any) -> int | None:
    """Rows of the model's output embedding (the ids it can emit), or its config's ``vocab_size``; ``None`` if neither."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _check_token_id(name: str, value: Any, vocab: int | None) -> None:
    """``ValueError`` unless ``value`` is an int token id (not a bool) in ``[0, vocab)`` (``vocab=None``: any id >= 0).

    >>> _check_token_id("eos_token_id", True, 10)
    Traceback (most recent call last):
    ...
    ValueError: eos_token_id: got True (bool), expected an int token id in [0, 10)
    """
    want = f"an int token id in [0, {vocab})" if vocab is not None else "an int token id >= 0"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}: got {value!r} ({type(value).__name__}), expected {want}")
    index = int(value)
    if index < 0 or (vocab is not None and index >= vocab):
        where = f" (the model's vocabulary has {vocab} ids)" if vocab is not None else ""
        raise ValueError(f"{name}: got {value!r}, expected {want}{where}")


class TorchEngine:
    """The in-process engine: :func:`generate` on the training model itself (co-located, shared weights).

    Args:
      model: the policy (a ``transformers`` causal LM).
      **sampling: keyword options of :func:`generate` (``eos_token_id``, ``max_new_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``pad_token_id``).
    """

    def __init__(self, model: Any, **sampling: Any):
        vocab = _vocab_size(model)
        for key in ("eos_token_id", "pad_token_id"):
            if key in sampling:
                _check_token_id(key, sampling[key], vocab)
        self.model, self.sampling = model, sampling

    def generate(
        self, prompts: torch.Tensor, prompt_mask: torch.Tensor, *, n: int, generator: torch.Generator | None
    ) -> Rollout:
        was_training = self.model.training
        self.model.eval()
        try:
            return generate(self.model, prompts, prompt_mask, n=n, generator=generator, **self.sampling)
        finally:
            self.model.train(was_training)

    def load_weights(self, params: dict[str, torch.Tensor]) -> None:
        """Nothing to do: the engine samples from the training model's own parameters."""
