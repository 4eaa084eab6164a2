"""Advantage estimators: token-level (GAE, REINFORCE++, optimal token baseline), group outcome (GRPO, GDPO, RLOO, GPG, OPO, ReMax, pass@k), batch whitening."""

from rlcore.algos.advantages.normalize import batch_moments, batch_normalize
from rlcore.algos.advantages.outcome import (
    gdpo_advantages,
    gpg_advantages,
    grpo_advantages,
    opo_advantages,
    remax_advantages,
    rloo_advantages,
)
from rlcore.algos.advantages.passk import passk_advantages
from rlcore.algos.advantages.token import (
    gae,
    optimal_token_baseline_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)

__all__ = [
    "batch_moments",
    "batch_normalize",
    "gae",
    "gdpo_advantages",
    "gpg_advantages",
    "grpo_advantages",
    "opo_advantages",
    "optimal_token_baseline_advantages",
    "passk_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
]
