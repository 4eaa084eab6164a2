import subprocess
import sys
import textwrap

import pytest
import torch

from rlcore import device


def test_cpu_fallback_here():
    if torch.cuda.is_available() or device.npu_available():
        pytest.skip("this machine has an accelerator; the fallback order is checked on CPU-only hosts")
    assert device.device_kind() == "cpu"
    assert device.get_device() == torch.device("cpu")


def test_collective_backend_table():
    assert device.collective_backend("cpu") == "gloo"
    assert device.collective_backend("cuda:0") == "nccl"
    assert device.collective_backend("npu:3") == "hccl"
    with pytest.raises(ValueError, match="device: got 'meta'"):
        device.collective_backend("meta")


def test_cpu_memory_is_not_tracked_rather_than_zero():
    stats = device.memory_stats("cpu")
    assert stats.tracked is False
    assert stats.allocated is None and stats.peak_allocated is None
    assert str(stats) == "cpu: not tracked"
    device.reset_peak_memory_stats("cpu")
    device.synchronize("cpu")


def test_unknown_kind_rejected():
    with pytest.raises(ValueError, match="kind: got 'tpu', expected one of 'npu', 'cuda', 'cpu'"):
        device.get_device("tpu")


def test_cuda_request_without_gpu_says_what_is_missing():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="'cuda' requested but unavailable"):
        device.get_device("cuda")


def _run(code: str, tmp_path, fake_torch_npu: str | None) -> subprocess.CompletedProcess:
    env_path = ""
    if fake_torch_npu is not None:
        pkg = tmp_path / "torch_npu"
        pkg.mkdir()
        (pkg / "__init__.py").write_text(fake_torch_npu)
        env_path = str(tmp_path)
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [env_path, os.environ.get("PYTHONPATH", "")] if p))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env)


def test_import_survives_broken_torch_npu(tmp_path):
    # torch-npu installed without the Ascend toolkit raises on import; rlcore must still
    # import, fall back to the CPU, and explain the failure when the NPU is asked for.
    broken = "raise ImportError('libhccl.so: cannot open shared object file: No such file or directory')\n"
    code = """
        import rlcore
        from rlcore import device
        assert device.npu_available() is False
        print(device.device_kind())
        try:
            device.get_device("npu")
        except RuntimeError as err:
            print("ERR", err)
    """
    proc = _run(code, tmp_path, broken)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "ERR device 'npu' requested but unavailable" in out
    assert "libhccl.so" in out and "Ascend toolkit (CANN)" in out


def test_npu_request_without_torch_npu(tmp_path):
    code = """
        from rlcore import device
        try:
            device.get_device("npu")
        except RuntimeError as err:
            print("ERR", err)
    """
    proc = _run(code, tmp_path, None)
    assert proc.returncode == 0, proc.stderr
    assert "torch-npu is not installed" in proc.stdout
