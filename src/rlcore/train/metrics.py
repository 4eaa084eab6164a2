"""Run metrics: JSONL lines, a tqdm progress bar, a PNG of the learning curves, and a Gantt timeline PNG.

An RL run's headline is its reward (and KL); an offline DPO run scores nothing, so its
headline is the DPO loss, the implicit reward margins and the preference accuracies.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "headline", "plot_curves", "plot_run", "plot_timeline", "read_metrics"]

_BAR_KEYS = {
    "reward": "reward",
    "kl": "kl",
    "entropy": "ent",
    "response_length": "len",
    "tokens_per_s_device": "tok/s/dev",
    "policy_lag": "lag",
}
# Offline DPO (no reward in its records): what says whether it learns.
_PREFERENCE_KEYS = {"loss": "loss", "margins": "margin", "accuracies": "acc"}


def _bar_keys(record: dict[str, Any]) -> dict[str, str]:
    return _BAR_KEYS if "reward" in record else {**_PREFERENCE_KEYS, **_BAR_KEYS}


def headline(records: Sequence[dict[str, Any]]) -> str:
    """The run's learning in one phrase: the first and the last 10% of its steps (at least one step each).

    An RL run's mean reward; an offline DPO run's (no ``reward`` in its records) mean
    margins, accuracies and loss. Steps are named, as a resumed run starts at its checkpoint.

    >>> headline([{"step": s, "reward": s / 10} for s in range(10)])
    'mean reward of steps 0-0 0.000, of steps 9-9 0.900'
    >>> headline([{"step": 0, "loss": 0.7, "margins": 0.0, "accuracies": 0.0}])
    'margins of steps 0-0 0.000, of steps 0-0 0.000; accuracies of steps 0-0 0.000, of steps 0-0 0.000; loss of steps 0-0 0.700, of steps 0-0 0.700'
    """
    if not records:
        return "no steps"
    k = max(1, len(records) // 10)
    head, tail = records[:k], records[-k:]

    def span(part: Sequence[dict[str, Any]]) -> str:
        return f"steps {part[0]['step']}-{part[-1]['step']}"

    # Without a reward: the pair metrics of DPO and reward-model runs where logged, and the loss (SFT: the loss alone).
    offline = [m for m in ("margins", "accuracies") if m in records[-1]] + ["loss"]
    keys = {"reward": "mean reward"} if "reward" in records[-1] else {m: m for m in offline}
    phrases = []
    for key, name in keys.items():
        first, last = (sum(float(r.get(key, math.nan)) for r in part) / len(part) for part in (head, tail))
        phrases.append(f"{name} of {span(head)} {first:.3f}, of {span(tail)} {last:.3f}")
    return "; ".join(phrases)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a metrics JSONL file (empty if it does not exist).

    A last line cut short (a run killed while appending) is dropped with a warning;
    any other unreadable line is a ``ValueError`` naming the file and the line.
    """
    path = Path(path)
    if not path.is_file():
        return []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"metrics file {str(path)!r}: not UTF-8 text ({err.reason} at byte {err.start})") from err
    numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    records = []
    for k, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a record with an integer 'step'")
        except ValueError as err:
            if k == len(numbered) - 1:
                warnings.warn(
                    f"metrics file {str(path)!r}: dropped its last line {number}, cut short "
                    f"({len(line)} characters: {line[:40]!r}...)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                break
            raise ValueError(f"metrics file {str(path)!r}: line {number} is not a metrics record ({err})") from err
        records.append(record)
    return records


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
        # A fresh run overwrites whatever an earlier run left, readable or not.
        kept = [] if resume_step is None else [r for r in read_metrics(self.path) if r["step"] <= resume_step]
        # Kept open, line-buffered: each record reaches the file as it is written, without an
        # open and a close per step on the path between two steps.
        self._file = open(self.path, "w", buffering=1, encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._file.writelines(json.dumps(r) + "\n" for r in kept)
        self._bar = None
        self._shown: dict[str, str] = {}
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=start, desc="rl", dynamic_ncols=True)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        if self._bar is not None:
            # A metric logged on some steps only (kl, with trainer.log_ref_kl_every) keeps its last value.
            self._shown.update({short: f"{record[k]:.3g}" for k, short in _bar_keys(record).items() if k in record})
            self._bar.set_postfix(self._shown, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        self._file.close()
        if self._bar is not None:
            self._bar.close()


def plot_curves(records: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Save a PNG of the learning curves against the step (Agg backend).

    An RL run: two panels, reward (with validation reward, pass@1, pass@k) and KL. An
    offline DPO run (no ``reward`` in its records): three panels, the DPO loss, the
    implicit reward margins and the preference accuracies.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    if records and not any("reward" in r for r in records):
        return _plot_preference_curves(records, steps, Path(path), plt)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    # The KL to the reference where it was logged (trainer.log_ref_kl_every with rl.beta 0), else the entropy.
    second = "kl" if any("kl" in r for r in records) else "entropy"
    for ax, key in zip(axes, ("reward", second)):
        logged = [r for r in records if key in r]  # kl: only the steps the reference forward ran
        ax.plot([r["step"] for r in logged], [r[key] for r in logged], lw=1.5)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    # Validation (mean reward, pass@1, pass@k) beside the training reward, where it ran.
    for key in sorted({k for r in records for k in r if k.startswith("val/")}):
        points = [(r["step"], r[key]) for r in records if key in r]
        axes[0].plot(*zip(*points), marker="o", ms=3, lw=1, label=key)
    if any(k.startswith("val/") for r in records for k in r):
        axes[0].legend(fontsize=7)
    axes[0].set_title("mean reward")
    # Multi-turn runs: the tool-call rate and the greedy evaluations beside the reward.
    if any("tool_call_rate" in r for r in records):
        axes[0].plot(steps, [r.get("tool_call_rate", float("nan")) for r in records], lw=1.2, label="tool-call rate")
        evals = [r for r in records if "greedy_reward" in r]
        axes[0].plot([r["step"] for r in evals], [r["greedy_reward"] for r in evals], "o-", ms=3, label="greedy reward")
        axes[0].lines[0].set_label("reward (T-sampled)")
        axes[0].legend(loc="lower right", fontsize=8)
    axes[1].set_title("KL to the reference policy" if second == "kl" else "policy entropy per token")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_preference_curves(records: list[dict[str, Any]], steps: list[int], path: Path, plt: Any) -> Path:
    fig, axes = plt.subplots(1, len(_PREFERENCE_KEYS), figsize=(13, 3.5))
    titles = {"loss": "loss", "margins": "implicit reward margin", "accuracies": "preference accuracy"}
    for ax, key in zip(axes, _PREFERENCE_KEYS):
        ax.plot(steps, [r.get(key, float("nan")) for r in records], lw=1.5)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(titles[key])
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeline(tasks: Sequence[Any], path: str | os.PathLike, *, last: int = 4, offset: int = 0) -> Path:
    """Save a Gantt chart of the last ``last`` iterations: one row per stage, one bar per call, coloured by iteration.

    Args:
      tasks: the pipeline's :class:`rlcore.dataflow.TaskRecord` s (``stage``, ``resource``,
        ``iteration``, ``start``, ``end``).
      path: the PNG to write.
      last: how many of the final iterations to show.
      offset: added to iteration numbers in the legend (the first step of a resumed run).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    shown = sorted({t.iteration for t in tasks})[-max(1, last) :]
    keep = [t for t in tasks if t.iteration in shown]
    rows = list(dict.fromkeys(f"{t.resource}: {t.stage}" for t in sorted(keep, key=lambda t: t.start)))
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    colours = plt.get_cmap("tab10")
    t0 = min((t.start for t in keep), default=0.0)
    for t in keep:
        y = rows.index(f"{t.resource}: {t.stage}")
        c = colours(shown.index(t.iteration) % 10)
        ax.barh(y, t.end - t.start, left=t.start - t0, color=c, edgecolor="black", linewidth=0.3)
    for k, it in enumerate(shown):
        ax.barh(0, 0, color=colours(k % 10), label=f"step {it + offset}")
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title("pipeline timeline (bars: stage calls; gaps: idle)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(out: str | os.PathLike, tasks: Sequence[Any] | None, *, last: int = 4, offset: int = 0) -> None:
    """A run's plots in ``out``: ``curves.png`` from its ``metrics.jsonl``, ``timeline.png`` from its stage ``tasks``.

    Args:
      out: the run directory.
      tasks: the pipeline's scheduled calls (:func:`rlcore.dataflow.run_pipeline`), or None (no step ran).
      last, offset: as in :func:`plot_timeline`.
    """
    out = Path(out)
    plot_curves(read_metrics(out / "metrics.jsonl"), out / "curves.png")
    if tasks is not None:
        plot_timeline(tasks, out / "timeline.png", last=last, offset=offset)
