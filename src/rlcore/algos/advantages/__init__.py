"""Advantage estimators: token-level (GAE, REINFORCE++), group outcome (GRPO, RLOO, GPG, OPO, ReMax, pass@k), batch whitening."""

from rlcore.algos.advantages.normalize import batch_moments, batch_normalize
from rlcore.algos.advantages.outcome import (
    gpg_advantages,
    grpo_advantages,
    opo_advantages,
    remax_advantages,
    rloo_advantages,
)
from rlcore.algos.advantages.passk import passk_advantages
from rlcore.algos.advantages.token import gae, reinforce_pp_advantages, reinforce_pp_baseline_advantages

__all__ = [
    "batch_moments",
    "batch_normalize",
    "gae",
    "gpg_advantages",
    "grpo_advantages",
    "opo_advantages",
    "passk_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
]
