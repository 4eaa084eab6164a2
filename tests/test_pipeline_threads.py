"""The pipeline's threads and OpenMP: per-resource intra-op counts, and one team per process while it runs."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from rlcore.dataflow import StageGraph, release_openmp_threads, run_pipeline, stage


def _graph(seen):
    def record(name, source, column):
        def fn(b):
            seen.setdefault(name, []).append(torch.get_num_threads())
            return {column: b[source] * 2}

        return fn

    return StageGraph(
        [
            stage(
                record("host", "prompts", "scores"), inputs=["prompts"], outputs=["scores"], name="host", resource="cpu"
            ),
            stage(
                record("model", "scores", "loss"), inputs=["scores"], outputs=["loss"], name="model", resource="device"
            ),
        ]
    )


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_limited_resource_runs_with_its_count_and_the_others_with_the_callers(two_threads):
    seen: dict[str, list[int]] = {}
    res = run_pipeline(
        _graph(seen), lambda j: {"prompts": torch.arange(4)}, num_prompts=4, num_iterations=3, threads={"cpu": 1}
    )
    assert seen == {"host": [1, 1, 1], "model": [2, 2, 2]}
    assert torch.get_num_threads() == 2  # the calling thread's count is put back
    assert len(res.tasks) == 6
    seen.clear()
    run_pipeline(_graph(seen), lambda j: {"prompts": torch.arange(4)}, num_prompts=4)
    assert seen == {"host": [2], "model": [2]}  # without threads= every worker takes the caller's count


@pytest.mark.parametrize(
    ("threads", "match"),
    [
        ({"gpu": 1}, r"threads: got resource 'gpu' no stage runs on, expected some of \['cpu', 'device'\]"),
        ({"cpu": 0}, r"threads\['cpu'\]: got 0, expected a positive int"),
        ({"cpu": True}, r"threads\['cpu'\]: got True, expected a positive int"),
        ({"cpu": "1"}, r"threads\['cpu'\]: got '1', expected a positive int"),
    ],
)
def test_bad_thread_counts_are_refused_before_anything_runs(threads, match):
    loaded = []
    with pytest.raises(ValueError, match=match):
        run_pipeline(
            _graph({}), lambda j: loaded.append(j) or {"prompts": torch.arange(2)}, num_prompts=2, threads=threads
        )
    assert loaded == []


# A fresh process: its OS threads are counted, which another test's pools would disturb.
_PROBE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from rlcore.dataflow import StageGraph, release_openmp_threads, run_pipeline, stage

    torch.set_num_threads(2)
    def tasks():
        return len(os.listdir("/proc/self/task"))
    def parallel():
        return float(torch.ones(1 << 22).mul(2).sum())  # big enough for a parallel region
    out = {"bare": tasks()}
    parallel()
    out["with_team"] = tasks()
    out["released"] = release_openmp_threads()
    out["after_release"] = tasks()
    out["value"] = parallel()  # a new team, and the right answer
    out["again"] = tasks()
    seen = {}
    def host(b):
        parallel()
        return {"scores": b["prompts"] * 2}
    def model(b):
        parallel()
        seen["during"] = tasks()
        return {"loss": b["scores"]}
    graph = StageGraph([
        stage(host, inputs=["prompts"], outputs=["scores"], name="host", resource="cpu"),
        stage(model, inputs=["scores"], outputs=["loss"], name="model", resource="device"),
    ])
    limited = {"cpu": 1} if sys.argv[1] == "limited" else None
    run_pipeline(graph, lambda j: {"prompts": torch.arange(4)}, num_prompts=4, num_iterations=2, threads=limited)
    out["during"] = seen["during"]
    print(json.dumps(out))
    """
)


def _probe(mode):
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_threads_team_is_given_back_and_the_pipeline_runs_with_one_team_per_busy_thread():
    unlimited, limited = _probe("unlimited"), _probe("limited")
    bare = unlimited["bare"]
    assert unlimited["with_team"] == bare + 1  # the main thread's parallel op made it a helper
    assert unlimited["released"] is True and unlimited["after_release"] == bare
    assert unlimited["value"] == 2.0 * (1 << 22) and unlimited["again"] == bare + 1
    # During the pipeline the main thread's team is given back: the device worker's helper is the only one,
    # beside the two workers (and the loader thread); an unlimited host worker brings a helper of its own.
    assert limited["during"] == unlimited["during"] - 1
    assert limited["during"] == bare + 4  # the two workers, the device worker's helper, the loader thread


def test_release_without_a_team_is_harmless():
    assert release_openmp_threads() in (True, False)
    assert float(torch.ones(1 << 20).sum()) == float(1 << 20)
