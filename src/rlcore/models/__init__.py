"""Model adapters: HF causal LMs as pure functions over packed tokens, packed and context-parallel attention,
and the forwards the losses need.

transformers is needed only by :mod:`rlcore.models.hf` (the ``hf`` extra), and is
imported on first use.
"""

from rlcore.models.attention import attend_masked, attend_packed, check_cu_seqlens, packed_causal_attention
from rlcore.models.build import DTYPES, attention_implementation, load_causal_lm, resolve_dtype
from rlcore.models.context_parallel import (
    CP_MODES,
    ContextParallelShard,
    ShardedLogprobs,
    shard_packed,
    sharded_token_logprobs,
)
from rlcore.models.decoding import CachedDecoder
from rlcore.models.export import export_hf, export_reward_model
from rlcore.models.hf import ATTENTION_NAME, HFCausalLM, from_hf
from rlcore.models.loading import TokenIds, load_policy, load_tokenizer, token_ids
from rlcore.models.lora import (
    AdaptersOff,
    MergedWeights,
    adapter_state_dict,
    adapters_disabled,
    apply_lora,
    base_view,
    is_lora,
    load_adapter_state_dict,
    merged_state_dict,
)
from rlcore.models.preference import PREFERENCE_SIDES, preference_logps
from rlcore.models.response_logits import response_logits
from rlcore.models.ring_attention import ring_attention
from rlcore.models.sampling import filter_logits, left_pad, sample_tokens, uniform_table
from rlcore.models.sequence_shards import SequenceShards, plan_sequence_shards
from rlcore.models.shared_prefix import SharedPrefix, shared_prefix_hidden, shared_prefix_logprobs, shares_prompts
from rlcore.models.static_cache import StaticDecodeStep, supports_static_decode
from rlcore.models.token_logprobs import token_logprobs
from rlcore.models.ulysses import ulysses_attention

__all__ = [
    "ATTENTION_NAME",
    "CP_MODES",
    "DTYPES",
    "PREFERENCE_SIDES",
    "AdaptersOff",
    "CachedDecoder",
    "ContextParallelShard",
    "HFCausalLM",
    "MergedWeights",
    "SequenceShards",
    "ShardedLogprobs",
    "SharedPrefix",
    "StaticDecodeStep",
    "TokenIds",
    "adapter_state_dict",
    "adapters_disabled",
    "apply_lora",
    "attend_masked",
    "attend_packed",
    "attention_implementation",
    "base_view",
    "check_cu_seqlens",
    "export_hf",
    "export_reward_model",
    "filter_logits",
    "from_hf",
    "is_lora",
    "left_pad",
    "load_adapter_state_dict",
    "load_causal_lm",
    "load_policy",
    "load_tokenizer",
    "merged_state_dict",
    "packed_causal_attention",
    "plan_sequence_shards",
    "preference_logps",
    "resolve_dtype",
    "response_logits",
    "ring_attention",
    "sample_tokens",
    "shard_packed",
    "sharded_token_logprobs",
    "shared_prefix_hidden",
    "shared_prefix_logprobs",
    "shares_prompts",
    "supports_static_decode",
    "token_ids",
    "token_logprobs",
    "ulysses_attention",
    "uniform_table",
]
