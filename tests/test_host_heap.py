"""rlcore.memory.retain_host_memory: a step's freed tensors are reused instead of faulting in again."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest

from rlcore.memory import retain_host_memory

# A training-step-like loop on a worker thread (the pipeline's device thread): several
# live activation-sized tensors, a backward, all freed at the end of each step; the
# minor page faults of the last 10 steps.
_STEPS = textwrap.dedent(
    """
    import json, resource, sys, threading, torch
    from rlcore.memory import retain_host_memory
    if sys.argv[1] == "retain":
        assert retain_host_memory()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = torch.nn.Sequential(*[torch.nn.Linear(256, 1024), torch.nn.SiLU(), torch.nn.Linear(1024, 256)] * 2)
    faults = []
    def steps():
        for i in range(20):
            if i == 10:
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
            x = torch.randn(800 + 37 * (i % 3), 256)
            net(x).square().mean().backward()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
    t = threading.Thread(target=steps)
    t.start(); t.join()
    print(json.dumps((faults[1] - faults[0]) / 10))
    """
)


def _faults_per_step(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning is glibc malloc's")
def test_retained_heap_stops_the_per_step_page_faults() -> None:
    default, retained = _faults_per_step("default"), _faults_per_step("retain")
    assert default > 100, default  # the loop does fault without the tuning (else this test shows nothing)
    assert retained < 0.1 * default, (retained, default)


def test_bad_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match=r"trim_threshold: got -1, expected an int >= 0"):
        retain_host_memory(-1)
    with pytest.raises(ValueError, match=r"trim_threshold: got True"):
        retain_host_memory(True)
