"""rlcore in one screen: the core ops on a toy batch, printed.

Run: python examples/demo.py
"""

from __future__ import annotations

import torch

import rlcore
from rlcore import ops
from rlcore.device import collective_backend, get_device, memory_stats


def main() -> None:
    torch.manual_seed(0)
    dev = get_device()
    print(f"rlcore {rlcore.__version__} on {dev} (collectives: {collective_backend(dev)}; memory: {memory_stats(dev)})")

    # Eight responses to two prompts (four samples each, interleaved), with
    # verifiable 0/1 rewards. The second prompt's group is solved by every sample.
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0], device=dev)
    group_ids = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1], device=dev)
    mean, std = ops.segment_mean_std(scores, group_ids, num_segments=2)
    centred = scores - mean[group_ids]
    print(f"group means {mean.tolist()}, group stds {std.tolist()}  (an all-equal group has std exactly 0)")
    print(f"scores minus group mean: {centred.tolist()}")

    # Token-level: right-padded responses with an observation token inside row 1.
    rewards = torch.zeros(3, 6, device=dev)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0]], device=dev)
    rewards[0, 3], rewards[1, 5], rewards[2, 2] = 1.0, 0.5, -1.0
    returns = ops.discounted_cumsum(rewards, 0.99)
    print("discounted reward-to-go, gamma 0.99 (a parallel scan, no loop over time):")
    for row in returns.tolist():
        print("   ", " ".join(f"{v:6.3f}" for v in row))
    white = ops.masked_whiten(returns, mask)
    print(f"whitened over counted tokens: mean {ops.masked_mean(white, mask).item():+.2e}, "
          f"var {ops.masked_var(white, mask).item():.4f}")
    print(f"masked mean with an empty mask: {ops.masked_mean(returns, torch.zeros_like(mask)).item()} (0, not NaN)")


if __name__ == "__main__":
    main()
