"""rlcore.train.metrics: the JSONL log survives a run killed mid-line; other damage is a one-line error."""

import json

import pytest

from rlcore.train import MetricsLog, read_metrics


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
