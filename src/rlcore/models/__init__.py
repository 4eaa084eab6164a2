"""Model adapters: HF causal LMs as pure functions over packed tokens, packed attention, and the forwards the losses need.

transformers is needed only by :mod:`rlcore.models.hf` (the ``hf`` extra), and is
imported on first use.
"""

from rlcore.models.attention import check_cu_seqlens, packed_causal_attention
from rlcore.models.hf import ATTENTION_NAME, HFCausalLM, from_hf, load_causal_lm
from rlcore.models.loading import (
    TokenIds,
    attention_implementation,
    load_policy,
    load_tokenizer,
    resolve_dtype,
    token_ids,
)
from rlcore.models.preference import PREFERENCE_SIDES, preference_logps
from rlcore.models.token_logprobs import token_logprobs

__all__ = [
    "ATTENTION_NAME",
    "PREFERENCE_SIDES",
    "HFCausalLM",
    "TokenIds",
    "attention_implementation",
    "check_cu_seqlens",
    "from_hf",
    "load_causal_lm",
    "load_policy",
    "load_tokenizer",
    "packed_causal_attention",
    "preference_logps",
    "resolve_dtype",
    "token_ids",
    "token_logprobs",
]
