"""Loop-based reference implementations, written for clarity, not speed.

Each mirrors one rlcore function with plain Python loops and exact or float64
arithmetic, so differential tests compare the vectorised code with an obviously
correct one.
"""

from rlcore.testing.reference.logprobs import entropy_ref, linear_logprobs_ref, logprobs_ref
from rlcore.testing.reference.ops import (
    discounted_cumsum_ref,
    masked_mean_ref,
    masked_sum_ref,
    masked_var_ref,
    masked_whiten_ref,
    reverse_linear_scan_ref,
    segment_mean_ref,
    segment_std_ref,
    segment_sum_ref,
)

__all__ = [
    "discounted_cumsum_ref",
    "entropy_ref",
    "linear_logprobs_ref",
    "logprobs_ref",
    "masked_mean_ref",
    "masked_sum_ref",
    "masked_var_ref",
    "masked_whiten_ref",
    "reverse_linear_scan_ref",
    "segment_mean_ref",
    "segment_std_ref",
    "segment_sum_ref",
]
