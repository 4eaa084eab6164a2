"""keep_freed_host_memory: freed blocks stay mapped (no page faults on reuse); the config key that sets it."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from rlcore.memory import MAX_MIB, keep_freed_host_memory, set_malloc_thresholds
from rlcore.train import parse_config

# A step's pattern: several 1 MiB temporaries allocated, written and freed together. With
# glibc's start-up thresholds (128 KiB, set explicitly: its adaptive rise depends on the
# heap's layout) each is mapped and unmapped on its own, so every cycle faults its pages in.
_FAULTS = """
import resource, sys, torch
from rlcore.memory import START_THRESHOLD, keep_freed_host_memory, set_malloc_thresholds

assert set_malloc_thresholds(START_THRESHOLD, START_THRESHOLD)

def faults_per_cycle():
    for _ in range(3):
        xs = [torch.ones(1 << 18) for _ in range(8)]
        del xs
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        xs = [torch.ones(1 << 18) for _ in range(8)]
        del xs
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20

default = faults_per_cycle()
applied = keep_freed_host_memory(int(sys.argv[1]))
print(default, applied, faults_per_cycle())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's: this platform's C library differs")
def test_freed_memory_is_reused_without_page_faults():
    out = subprocess.run([sys.executable, "-c", _FAULTS, "64"], capture_output=True, text=True, check=True)
    default, applied, kept = out.stdout.split()
    assert applied == "True"
    # 8 MiB written per cycle is 2048 pages of 4 KiB: unmapped and faulted in again at 128 KiB.
    assert float(default) > 500, out.stdout
    assert float(kept) < 10, out.stdout


def test_zero_leaves_malloc_alone():
    assert keep_freed_host_memory(0) is False


@pytest.mark.parametrize(("trim", "mmap"), [(-1, 0), (0, 2**31), (1.5, 0), (0, True)])
def test_bad_thresholds_are_refused(trim, mmap):
    with pytest.raises(ValueError, match=r"(trim|mmap): got .*, expected an int number of bytes in \[0, 2\*\*31\)"):
        set_malloc_thresholds(trim, mmap)


@pytest.mark.parametrize("bad", [-1, MAX_MIB + 1, 1.5, True, "256"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match=rf"mib: got {bad!r}, expected an int in \[0, {MAX_MIB}\]"):
        keep_freed_host_memory(bad)


def test_the_config_key_is_checked(tmp_path):
    raw = {"model": {"model_name_or_path": {"model_type": "qwen2"}}, "trainer": {"output_dir": str(tmp_path)}}
    assert parse_config(raw).trainer.malloc_keep_mib == 256
    with pytest.raises(ValueError, match=r"config key 'trainer.malloc_keep_mib': got 4096, expected an int in"):
        parse_config({**raw, "trainer": {**raw["trainer"], "malloc_keep_mib": 4096}})
    assert parse_config({**raw, "trainer": {**raw["trainer"], "malloc_keep_mib": 0}}).trainer.malloc_keep_mib == 0
