"""A replaced rollout worker gets the same start-up bound as the first, local process and Ray actor alike."""

from __future__ import annotations

import types

import pytest

import rlcore.train.deploy as deploy_module


@pytest.mark.parametrize("cls, worker", [("RayDeployment", "RayRolloutWorker"), ("WorkerDeployment", "RolloutWorker")])
def test_a_replacement_is_bounded_as_the_first_start(monkeypatch, cls, worker):
    made = {}
    monkeypatch.setattr(deploy_module, worker, lambda *args, **kw: made.update(kw))
    # The deployment's own bound (deploy.rollout_timeout, at least 120 s), not the worker's default.
    placed = types.SimpleNamespace(server=object(), max_restarts=3, ready_timeout=600.0, partial=False)
    getattr(deploy_module, cls)._start(placed, (), 1)
    assert made["ready_timeout"] == 600.0 and made["max_restarts"] == 3
