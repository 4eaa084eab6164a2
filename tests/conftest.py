import os

import torch
from hypothesis import HealthCheck, settings

# Tests are CPU-only and must fit 2 cores: keep torch to one intra-op thread per
# process (pytest-xdist runs one process per core).
torch.set_num_threads(1)

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile(
    "dev",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The test files that take longest on 2 cores (multi-process runs, vLLM engines, Ray clusters),
# longest first. pyproject's addopts send whole files to the xdist workers (--dist loadfile), in
# collection order (--no-loadscope-reorder): these start first and the many short files fill in
# behind them, so no long file is left to run alone at the end. A file's module-scoped set-up
# (a process group, an engine, a cluster) also runs once, on one worker.
LONGEST_FIRST = (
    "test_reshard.py",
    "test_vllm_ranks.py",
    "test_ray_rollout.py",
    "test_vllm_deploy.py",
    "test_chaos.py",
    "test_chaos_ranks.py",
    "test_async_ranks.py",
    "test_vllm_engine.py",
    "test_vllm_partial.py",
    "test_vllm_agent.py",
    "test_vllm_async.py",
    "test_worker_restart.py",
    "test_dock.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
