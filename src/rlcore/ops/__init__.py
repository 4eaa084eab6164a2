"""Tensor primitives: masked and segment reductions, small-head masked attention, linear scans, token and sequence log-probs, packing.

Pure tensor-in, tensor-out functions with float32 accumulation and no host syncs.
"""

from rlcore.ops.attention import masked_attention
from rlcore.ops.linear_logprobs import linear_logprobs
from rlcore.ops.logprobs import entropy_from_logits, logprobs_from_logits
from rlcore.ops.masked import masked_mean, masked_sum, masked_var, masked_whiten, pivot_shift
from rlcore.ops.numerics import acc_dtype, pow2_scale, safe_div, saturating_cast
from rlcore.ops.packing import Packed, pack, shift_labels, unpack
from rlcore.ops.scan import discounted_cumsum, reverse_linear_scan
from rlcore.ops.segment import (
    segment_centred,
    segment_count,
    segment_mean,
    segment_mean_std,
    segment_std,
    segment_sum,
    segment_zscore,
)
from rlcore.ops.select import keep_bits, masked_zero, masked_zero_
from rlcore.ops.sequence import SEQUENCE_REDUCTIONS, sequence_logps

__all__ = [
    "SEQUENCE_REDUCTIONS",
    "Packed",
    "acc_dtype",
    "discounted_cumsum",
    "entropy_from_logits",
    "keep_bits",
    "linear_logprobs",
    "logprobs_from_logits",
    "masked_attention",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "masked_zero",
    "masked_zero_",
    "pack",
    "pivot_shift",
    "pow2_scale",
    "reverse_linear_scan",
    "safe_div",
    "saturating_cast",
    "segment_centred",
    "segment_count",
    "segment_mean",
    "segment_mean_std",
    "segment_std",
    "segment_sum",
    "segment_zscore",
    "sequence_logps",
    "shift_labels",
    "unpack",
]
