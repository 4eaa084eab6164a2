"""Rollout: batched sampling from a causal LM with a KV cache, and the protocol for an external engine.

The trainer only needs token ids back from a rollout (it recomputes the old-policy
log-probs with its own forward pass, as verl and OpenRLHF do, so a different kernel in
the inference engine cannot bias the importance ratio). An engine that returns a
:class:`Rollout` -- this module's :class:`TorchEngine`, or an adapter around vLLM /
vllm-ascend -- plugs into the trainer.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from rlcore._checks import check_integer, check_ndim, check_same_shape
from rlcore.models.decoding import CachedDecoder
from rlcore.models.sampling import filter_logits, left_pad, sample_tokens, uniform_table

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
      versions: ``[N, R]`` int64, the weights version that sampled each response token
        (an interruptible rollout's, see :func:`generate`'s ``refresh``), or None: every
        token was sampled by the version the call was made with.
    """

    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    responses: torch.Tensor
    logp: torch.Tensor
    mask: torch.Tensor
    versions: torch.Tensor | None = None


@runtime_checkable
class InferenceEngine(Protocol):
    """What the trainer needs from an inference engine.

    ``generate`` samples ``n`` responses per left-padded prompt; ``load_weights`` receives
    the trainer's parameters (name -> tensor) after each optimiser step, so a
    disaggregated engine (vLLM, vllm-ascend) can refresh its copy.

    The trainer passes a :class:`rlcore.seeding.RowStream` as ``generator``: a
    ``torch.Generator`` that also names the key ``(seed, purpose, step)`` and each
    output row's global index. An engine that samples each row from its own key
    (:class:`TorchEngine` does) gives responses that do not depend on how the batch
    is split over data-parallel ranks; an engine that only knows ``torch.Generator``
    draws from it as from any generator.
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
    refresh: Callable[[], int | None] | None = None,
    version: int = 0,
) -> Rollout:
    """Sample ``n`` responses per prompt from a Hugging Face causal LM, reusing its KV cache.

    The prompt goes through the model once and each later step feeds one token per row
    (:class:`rlcore.models.decoding.CachedDecoder`); each token is drawn by
    :func:`rlcore.models.sampling.sample_tokens`. A row stops at ``<eos>`` (kept, masked
    in); the loop stops when every row has stopped or after ``max_new_tokens``. Once a
    quarter of the batch has stopped, the finished rows leave the decoder's batch
    (:meth:`~rlcore.models.decoding.CachedDecoder.drop`), so a long tail of a few long
    responses costs the forwards of those rows only, as continuous batching does.
    ``temperature=0`` is greedy decoding.

    Interruptible (partial) rollouts (AReaL, Fu et al., 2025, arXiv:2505.24298): with
    ``refresh``, the loop asks ``refresh()`` at every token boundary whether new weights
    were loaded into ``model``. When it returns a version (not None), the rows in flight
    stop there, the KV cache of the old weights is dropped, and the prompt plus the
    tokens sampled so far go through the new weights once (a prefill): the next tokens
    continue from the same token ids under the new version. The random draws are keyed
    by row and position, so a row's later tokens are drawn with the same numbers as
    without the interruption. :attr:`Rollout.versions` records each token's version.

    Args:
      model: ``model(input_ids=, attention_mask=, position_ids=, past_key_values=, use_cache=True)``
        returning ``.logits`` and ``.past_key_values`` (any ``transformers`` causal LM; the
        field is ``cache`` from transformers 5 on).
      prompts: ``[B, P]`` int64 left-padded ids; prompt_mask: ``[B, P]``.
      eos_token_id, pad_token_id: special ids.
      max_new_tokens, n, temperature, top_p, top_k: sampling controls.
      generator: the random stream. A :class:`rlcore.seeding.RowStream` draws the token of
        output row ``i`` at response position ``t`` from the hash of its key, its global
        row index and ``t``: the response is the same in any batch. A plain
        ``torch.Generator`` (or None: torch's default) is drawn from in order.
      refresh: ``refresh() -> new version or None``, asked before each token after the
        first; it loads the new weights into ``model`` itself (None: never interrupted).
      version: the weights version the call starts with (``Rollout.versions``' first value).

    Returns:
      a :class:`Rollout` with ``B * n`` rows (``versions`` set when ``refresh`` is given).
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
    rows = ids.shape[0]
    decoder = CachedDecoder(model, ids, prompt_mask.repeat_interleave(n, 0))
    draws = uniform_table(generator, rows, torch.arange(max_new_tokens), device) if temperature > 0 else None
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    tokens: list[torch.Tensor] = []
    logps: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    versions: list[int] = []
    for position in range(max_new_tokens):
        if refresh is not None and position > 0:
            new = refresh()
            if new is not None:  # new weights: the live rows continue from the same token ids, re-encoded by them
                version = new
                seen = torch.cat([ids, *(t[:, None] for t in tokens)], 1).index_select(0, decoder.active)
                decoder = CachedDecoder(model, seen, decoder.attention, active=decoder.active)
        active = decoder.active
        sampled, sampled_logp = sample_tokens(
            decoder.logits,
            draws[active, position] if draws is not None else None,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )
        token = torch.full((rows,), pad_token_id, dtype=sampled.dtype, device=device).index_copy_(0, active, sampled)
        logp = torch.zeros(rows, dtype=sampled_logp.dtype, device=device).index_copy_(0, active, sampled_logp)
        alive = ~done
        token = torch.where(alive, token, pad_token_id)
        tokens.append(token)
        logps.append(torch.where(alive, logp, 0.0))
        masks.append(alive.to(torch.long))
        versions.append(version)
        done = done | (token == eos_token_id)
        if position + 1 == max_new_tokens:
            break  # the last token is drawn: no forward for a next one
        if decoder.drop(done) == 0:  # every row has stopped: stop early
            break
        decoder.feed(token)
    mask = torch.stack(masks, 1)
    per_token = None
    if refresh is not None:
        per_token = torch.tensor(versions, dtype=torch.int64, device=device).expand(rows, -1) * mask
    return Rollout(
        ids, prompt_mask.repeat_interleave(n, 0), torch.stack(tokens, 1), torch.stack(logps, 1), mask, per_token
    )


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
        self,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        n: int,
        generator: torch.Generator | None,
        refresh: Callable[[], int | None] | None = None,
        version: int = 0,
    ) -> Rollout:
        """:func:`generate` under ``eval()`` (restored after); ``generator``, ``refresh`` and ``version`` as there."""
        was_training = self.model.training
        self.model.eval()
        try:
            return generate(
                self.model,
                prompts,
                prompt_mask,
                n=n,
                generator=generator,
                refresh=refresh,
                version=version,
                **self.sampling,
            )
        finally:
            self.model.train(was_training)

    def load_weights(self, params: dict[str, torch.Tensor]) -> None:
        """Nothing to do: the engine samples from the training model's own parameters."""
