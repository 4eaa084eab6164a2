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
LONGEST_FIRST = (  # seconds per file in one -n 2 run of these files on a loaded machine
    "test_vllm_ranks.py",  # 346
    "test_reshard.py",  # 306
    "test_vllm_deploy.py",  # 228
    "test_chaos.py",  # 145
    "test_ray_rollout.py",  # 123
    "test_chaos_ranks.py",  # 119
    "test_vllm_agent.py",  # 74
    "test_worker_restart.py",  # 55
    "test_async_ranks.py",  # 48
    "test_dock.py",  # 44
    "test_vllm_async.py",  # 35
    "test_vllm_partial.py",  # 30
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
