"""rlcore.train.metrics: the JSONL log survives a run killed mid-line; other damage is a one-line error."""

import json

import pytest

from rlcore.train import MetricsLog, headline, plot_curves, read_metrics


def _write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_partial_last_metrics_line_is_dropped_with_a_warning_on_resume(tmp_path):
    # Issue 18, defect 7: a cut last line raised JSONDecodeError and blocked resume.
    path = tmp_path / "metrics.jsonl"
    _write(path, [{"step": 0, "reward": 0.5}, {"step": 1, "reward": 0.7}], tail='{"step": 2, "rewa')
    with pytest.warns(RuntimeWarning, match=r"metrics file '.*metrics.jsonl': dropped its last line 3, cut short"):
        assert [r["step"] for r in read_metrics(path)] == [0, 1]
    with pytest.warns(RuntimeWarning, match="cut short"):
        log = MetricsLog(path, total=4, start=2, progress=False, resume_step=1)
    log.write({"step": 2, "reward": 0.9})
    log.close()
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]  # the file is whole again


def test_damaged_metrics_lines_name_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [{"step": 0}], tail='{"step": 1, "rew\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics file '.*metrics.jsonl': line 2 is not a metrics record"):
        read_metrics(path)
    _write(path, [{"step": 0}, [1, 2], {"step": 2}])
    with pytest.raises(ValueError, match=r"line 2 is not a metrics record \(not a record with an integer 'step'\)"):
        read_metrics(path)
    path.write_bytes(b'{"step": 0}\n\xff\xfe\x00garbage\n')
    with pytest.raises(ValueError, match=r"metrics file '.*metrics.jsonl': not UTF-8 text"):
        read_metrics(path)
    # A fresh run (no resume) overwrites whatever is there without reading it.
    MetricsLog(path, total=1, start=0, progress=False).close()
    assert read_metrics(path) == []


def _panels(monkeypatch, records, tmp_path):
    """The y labels of the panels plot_curves draws."""
    import matplotlib.figure

    seen = []
    save = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        seen.append([ax.get_ylabel() for ax in fig.axes])
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    assert plot_curves(records, tmp_path / "curves.png").is_file()
    return seen[-1]


def test_reprobe30_offline_dpo_curves_plot_its_loss_margins_and_accuracies(tmp_path, monkeypatch):
    dpo = [{"step": s, "loss": 0.69 - s / 100, "margins": s / 10, "accuracies": s / 4} for s in range(4)]
    assert _panels(monkeypatch, dpo, tmp_path) == ["loss", "margins", "accuracies"]
    rl = [{"step": s, "reward": s / 4, "kl": 0.0, "loss": 1e-8} for s in range(4)]
    assert _panels(monkeypatch, rl, tmp_path) == ["reward", "kl"]


def test_reprobe30_headline_and_bar_name_the_dpo_metrics_when_there_is_no_reward(tmp_path, capsys):
    dpo = [{"step": s + 5, "loss": 0.7 - s / 10, "margins": s / 2, "accuracies": s / 19} for s in range(20)]
    # first 10% = steps 5-6 (margins 0, 0.5), last 10% = steps 23-24 (margins 9, 9.5)
    assert headline(dpo).startswith("margins of steps 5-6 0.250, of steps 23-24 9.250; accuracies of steps 5-6 0.026")
    assert "loss of steps 5-6 0.650, of steps 23-24 -1.150" in headline(dpo)
    assert headline([{"step": 0, "reward": 0.25}]) == "mean reward of steps 0-0 0.250, of steps 0-0 0.250"
    bars = []
    for record in (dpo[-1], {"step": 1, "reward": 0.5, "loss": 1e-8}):
        log = MetricsLog(tmp_path / "m.jsonl", total=2, start=0, progress=True)
        log.write(record)
        log.close()
        bars.append(capsys.readouterr().err)
    assert "loss=-1.2" in bars[0] and "margin=9.5" in bars[0] and "acc=1" in bars[0], bars
    assert "reward=0.5" in bars[1] and "loss=" not in bars[1], bars  # an RL run's headline is its reward
