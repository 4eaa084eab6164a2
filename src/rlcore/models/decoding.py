"""The KV-cache shim every decode loop uses: a ``transformers`` causal LM fed the prompt once, then one token per row."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from rlcore.models.shared_prefix import shares_prompts
from rlcore.models.static_cache import StaticDecodeStep, supports_static_decode

__all__ = ["CachedDecoder"]

# :meth:`CachedDecoder.drop` shrinks the batch once at most this share of it is live.
_DROP_AT = 0.75


class CachedDecoder:
    """A batch of rows decoding with a KV cache: :attr:`logits` of the next token, :meth:`feed` one token per row.

    The prompt goes through the model once (rows with the same left-padded prompt, a
    GRPO group, share one prefill, as vLLM's prefix cache does); each :meth:`feed`
    runs one cached forward with position ids counted from each row's first real
    token and the attention mask grown by one column. transformers 5 renamed
    ``past_key_values`` to ``cache`` (argument and output field): the model's own
    name is used. For a Llama-family model (:func:`rlcore.models.static_cache.supports_static_decode`)
    the prompt and every step run :class:`rlcore.models.static_cache.StaticDecodeStep`
    instead of the model's forward: the same arithmetic through the same sub-modules, over
    a preallocated cache, without the forward's per-call set-up.

    Args:
      model: ``model(input_ids=, attention_mask=, position_ids=, <cache>=, use_cache=True)``
        returning ``.logits`` and the cache (any ``transformers`` causal LM).
      ids: ``[B, L]`` left-padded ids; attention: ``[B, L]`` (1 on real tokens).
      active: which rows of a larger starting batch ``ids`` holds (the :attr:`active` of a
        decoder this one replaces), default all.
      static: run the prompt and the steps with :class:`~rlcore.models.static_cache.StaticDecodeStep` (None:
        where the model supports it; False: always the model's own forward).
    """

    def __init__(
        self,
        model: Any,
        ids: torch.Tensor,
        attention: torch.Tensor,
        *,
        active: torch.Tensor | None = None,
        static: bool | None = None,
    ):
        use_static = static is not False and supports_static_decode(model)
        if static and not use_static:
            raise ValueError(f"static: got True for {type(model).__name__}, expected a supports_static_decode model")
        self.model = model
        self.field = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.attention = attention.to(torch.long)
        positions = (self.attention.cumsum(-1) - 1).clamp(min=0)
        self.next_position = positions[:, -1:] + 1
        self._step: StaticDecodeStep | None = None
        self._cache: Any = None
        if use_static:
            shared = self._prompt_groups(ids)
            if shared is None:
                self._step, self._logits = StaticDecodeStep.prefill(model, ids, self.attention, positions)
            else:
                groups, first = shared
                self._step, self._logits = StaticDecodeStep.prefill(
                    model, ids[first], self.attention[first], positions[first], groups
                )
        else:
            self._logits, self._cache = self._prefill(ids, positions)
        # The starting rows still in the batch, in order (a decoder rebuilt for rows that are left names them).
        self.active = torch.arange(ids.shape[0], device=ids.device) if active is None else active

    @property
    def logits(self) -> torch.Tensor:
        """``[len(active), V]`` float32 logits of each active row's next token."""
        return self._logits.float()

    def feed(self, token: torch.Tensor) -> None:
        """Append ``token`` (``[B]``, one per starting row; those of the :attr:`active` rows are read) and run
        the cached forward for the next logits."""
        token = token.index_select(0, self.active)
        rows = token.shape[0]
        ones = torch.ones(rows, 1, dtype=self.attention.dtype, device=self.attention.device)
        self.attention = torch.cat([self.attention, ones], dim=1)
        if self._step is not None:
            self._logits = self._step(token, self.next_position)
        else:
            out = self.model(
                input_ids=token[:, None],
                attention_mask=self.attention,
                position_ids=self.next_position,
                use_cache=True,
                **{self.field: self._cache},
            )
            self._logits, self._cache = out.logits[:, -1], getattr(out, self.field)
        self.next_position = self.next_position + 1

    def drop(self, done: torch.Tensor) -> int:
        """Let the finished rows leave the batch, once at most 3/4 of it is still live; the number still live.

        ``done``: ``[B]`` bool over the rows the decoder started with. The kept rows' cache
        entries, attention mask, positions and pending logits are gathered
        (``Cache.reorder_cache``, beam search's row gather, which takes any index list);
        :attr:`active` then names them. Each gather copies the cache, so a few finished rows
        ride along until a quarter of the batch has ended; the later forwards run over the
        live rows only, as continuous batching does with a long tail. With none live the
        batch is left as it is (the caller stops).
        """
        live = ~done.index_select(0, self.active)
        left = int(live.sum())  # sync-ok: the decode loop sizes its batch on the host
        if left == 0 or left > self.active.numel() * _DROP_AT:
            return left
        rows = live.nonzero().squeeze(1)  # sync-ok: as above
        self.active = self.active.index_select(0, rows)
        self.attention = self.attention.index_select(0, rows)
        self.next_position = self.next_position.index_select(0, rows)
        self._logits = self._logits.index_select(0, rows)
        if self._step is not None:
            self._step.select(rows)
        else:
            self._cache = _gather_cache(self._cache, rows)
        return left

    def _prompt_groups(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(group of each row, first row of each group)``, or None when no two rows share a prompt."""
        inverse = shares_prompts(ids, self.attention)
        if inverse is None:
            return None
        rows = ids.shape[0]
        distinct = int(inverse.max()) + 1  # sync-ok: the decode loop sizes the prefill on the host
        first = torch.full((distinct,), rows, dtype=torch.long, device=ids.device)
        first.scatter_reduce_(0, inverse, torch.arange(rows, device=ids.device), reduce="amin")
        return inverse, first

    def _prefill(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The prompt forward: each distinct prompt once, its cache entries and last logits then given to its rows.

        ``Cache.reorder_cache`` (beam search's row gather) copies the entries, so the
        decode steps see exactly what a forward over all rows would give them.
        """
        shared = self._prompt_groups(ids)
        if shared is None:
            out = self.model(input_ids=ids, attention_mask=self.attention, position_ids=positions, use_cache=True)
            return out.logits[:, -1], getattr(out, self.field)
        inverse, first = shared
        out = self.model(
            input_ids=ids[first], attention_mask=self.attention[first], position_ids=positions[first], use_cache=True
        )
        return out.logits[:, -1].index_select(0, inverse), _gather_cache(getattr(out, self.field, None), inverse)


def _gather_cache(kv: Any, rows: torch.Tensor) -> Any:
    """The cache of batch rows ``rows`` (a transformers ``Cache`` in place, a legacy per-layer tuple copied)."""
    if hasattr(kv, "reorder_cache"):
        kv.reorder_cache(rows)
    elif isinstance(kv, (tuple, list)):  # a legacy per-layer (key, value) tuple
        kv = tuple(tuple(t.index_select(0, rows) for t in layer) for layer in kv)
    return kv
