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
