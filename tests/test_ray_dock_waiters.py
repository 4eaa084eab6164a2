"""Defect 2 of the reliability issue: a Ray dock with more waiting clients than any thread pool.

Gets with explicit indexes wait inside the controller's host actor. Waiting must not
occupy what writers need: 200 clients wait at once, then one put makes their rows
ready and every one of them returns.
"""

from __future__ import annotations

import threading
import time

import torch

from rlcore.dataflow import RayTransferDock

WAITERS = 200


def test_defect2_ray_dock_200_waiters_do_not_deadlock():
    import ray  # the test extra installs Ray: a missing Ray is a failure, not a skip

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    dock = None
    threads: list[threading.Thread] = []
    try:
        dock = RayTransferDock(WAITERS, 1, columns=["x"], consumers=["c"], num_warehouses=1)
        got: dict[int, list[int]] = {}
        errors: list[BaseException] = []

        def wait_for(row: int) -> None:
            try:
                batch, idx = dock.get("c", ["x"], indexes=[row], timeout=60)
                got[row] = [idx.tolist(), batch["x"].tolist()]
            except BaseException as err:  # surfaced below
                errors.append(err)

        threads = [threading.Thread(target=wait_for, args=(r,), daemon=True) for r in range(WAITERS)]
        for thread in threads:
            thread.start()
        time.sleep(2.0)  # every client is now waiting in the host
        put = threading.Thread(target=lambda: dock.put({"x": torch.arange(float(WAITERS))}, range(WAITERS)))
        put.start()
        put.join(15)
        assert not put.is_alive(), "the put never got through: the waiting clients hold the host"
        deadline = time.monotonic() + 15
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not errors, errors[:3]
        assert sorted(got) == list(range(WAITERS))
        assert all(got[r] == [[r], [float(r)]] for r in range(WAITERS))
    finally:
        if dock is not None and not any(t.is_alive() for t in threads):
            dock.close()
        ray.shutdown()
