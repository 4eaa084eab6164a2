"""Run metrics: JSONL lines, a tqdm progress bar, and a PNG of the reward and KL curves."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "plot_curves", "read_metrics"]

_BAR_KEYS = {
    "reward": "reward",
    "kl": "kl",
    "entropy": "ent",
    "response_length": "len",
    "tokens_per_s_device": "tok/s/dev",
}


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a metrics JSONL file (empty if it does not exist)."""
    path = Path(path)
    if not path.is_file():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsLog:
    """Append one JSON line per step, and show the headline numbers on a progress bar.

    On resume, records after the checkpoint's step are dropped first, so the file holds
    one curve with no repeated or orphaned steps.
    """

    def __init__(
        self, path: str | os.PathLike, *, total: int, start: int, progress: bool, resume_step: int | None = None
    ):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if resume_step is not None and r["step"] <= resume_step]
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        self._bar = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=start, desc="rl", dynamic_ncols=True)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._bar is not None:
            self._bar.set_postfix(
                {short: f"{record[k]:.3g}" for k, short in _BAR_KEYS.items() if k in record}, refresh=False
            )
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def plot_curves(records: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Save a two-panel PNG of reward and KL against the step (matplotlib's Agg backend, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, key in zip(axes, ("reward", "kl")):
        ax.plot(steps, [r.get(key, float("nan")) for r in records], lw=1.5)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[0].set_title("mean reward")
    axes[1].set_title("KL to the reference policy")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
