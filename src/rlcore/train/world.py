"""This process's place in the run's device mesh, and the critic's sharding over it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from rlcore.device import get_device
from rlcore.memory.host_malloc import keep_freed_host_memory
from rlcore.train.config import Config, check_launch
from rlcore.train.lora import check_lora_launch
from rlcore.train.parallel import device_mesh
from rlcore.train.preemption import Preempted
from rlcore.train.tagged_metrics import Metric, all_reduce_metrics
from rlcore.train.vllm_engine import require_vllm

__all__ = ["World", "check_run", "local_device", "process_settings", "shard_critic"]


class World:
    """This process's place in the ``("dp", "cp", "tp")`` device mesh (one process when not launched by torchrun).

    Every sum over data (global counts, metric means, the data split of the prompts) uses
    the data-parallel group; the models' gradients cross ranks only inside FSDP2 and
    DTensor (:func:`rlcore.train.parallel.parallelize`). The ranks of a context-parallel
    group hold the same rows and split each sequence (:mod:`rlcore.train.context_parallel`).
    """

    def __init__(self, cfg: Config, device: torch.device):
        par = cfg.parallel
        self.device = device
        self.owns_group = not dist.is_initialized()
        self.mesh = device_mesh(
            par.data_parallel,
            par.tensor_parallel,
            pipeline_parallel=par.pipeline_parallel,
            context_parallel=par.context_parallel,
            device=device,
        )
        self.size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.dp_size = self.mesh["dp"].size()
        self.dp_rank = self.mesh.get_local_rank("dp")
        # The data-parallel group the counts and metrics are summed over (None: nothing to sum).
        self.group = self.mesh.get_group("dp") if self.dp_size > 1 else None
        self.sharded = self.size > 1
        # The context-parallel group and mode the forwards split sequences over (None: cp = 1).
        self.cp: tuple[Any, str] | None = None
        if self.mesh["cp"].size() > 1:
            self.cp = (self.mesh.get_group("cp"), par.cp_mode)

    def close(self, *, ok: bool = True) -> None:
        """Destroy the process group this trainer started: after a barrier when the run succeeded.

        After an error no barrier is entered (a peer may never reach it); the group is
        destroyed all the same so that the process can exit.
        """
        if self.owns_group and dist.is_initialized():
            if ok:
                dist.barrier()
            dist.destroy_process_group()
            self.owns_group = False

    @contextlib.contextmanager
    def session(self) -> Iterator[World]:
        """The world for one run, closed at the end: cleanly when the run succeeded or stopped on a signal.

        :class:`rlcore.train.preemption.Preempted` is a success here: every rank stopped at
        the same step with its checkpoint committed, so the ranks meet at the barrier.
        """
        ok = False
        try:
            yield self
            ok = True
        except Preempted:
            ok = True
            raise
        finally:
            self.close(ok=ok)

    def any(self, flag: torch.Tensor) -> bool:
        """True on every rank when ``flag`` (a 0-d float) is non-zero on any rank."""
        if self.sharded:
            dist.all_reduce(flag)
        return bool(flag.item() > 0)  # sync-ok: the trainer's stop decision

    def reduce(self, metrics: dict[str, Metric]) -> dict[str, Metric]:
        """One step's metrics merged over the data-parallel ranks, each as it declares (:mod:`rlcore.train.tagged_metrics`)."""
        return all_reduce_metrics(metrics, self.group)


def process_settings(cfg: Config) -> None:
    """This process's settings from ``trainer``: torch's intra-op threads, the freed host memory malloc keeps."""
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    keep_freed_host_memory(cfg.trainer.malloc_keep_mib)


def local_device() -> torch.device:
    """This process's device: the accelerator of its ``LOCAL_RANK`` (torchrun), or the CPU."""
    device = get_device()
    if device.type != "cpu":
        device = get_device(index=int(os.environ.get("LOCAL_RANK", "0")))
    return device


def check_run(cfg: Config, *, engine: bool = False) -> None:
    """Refuse, before any process group starts, a run this launch cannot serve.

    The world size (torchrun's, or 1) against the parallel sizes and what asynchronous rollout needs beyond one
    rank (:func:`rlcore.train.config.check_launch`), a user's engine with multi-turn rollouts, LoRA's limits,
    ``deploy.engine: vllm`` without vLLM installed (``ImportError`` naming the install), a ``model.teacher``
    directory that does not exist (yet: an earlier run makes it).

    Args:
      cfg: the run's config.
      engine: a user's :class:`rlcore.train.InferenceEngine` samples (the rollout is then in-process).
    """
    launched = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    check_launch(cfg if not engine else replace(cfg, deploy=replace(cfg.deploy, mode="co-located")), launched)
    if cfg.deploy.engine == "vllm" and not engine:
        require_vllm()
    if engine and cfg.rl.multi_turn is not None:
        raise ValueError(
            "engine: got an InferenceEngine with rl.multi_turn set, expected None (that rollout samples itself)"
        )
    check_lora_launch(cfg, launched)
    teacher = cfg.model.teacher
    if teacher is not None and not os.path.isdir(teacher):
        raise ValueError(
            f"config key 'model.teacher': got {teacher!r}, which is not a directory; expected a local causal LM "
            "directory (a run's output_dir/hf with trainer.export; configs/opd_tiny.yaml's is made by "
            "configs/opd_teacher_tiny.yaml)"
        )


def shard_critic(critic: torch.nn.Module, world: World) -> None:
    """FSDP2 over ``dp`` for the critic (a token-classification head: one unit per decoder layer and the root)."""
    if world.mesh["tp"].size() > 1:
        raise ValueError(
            "config key 'parallel.tensor_parallel': got "
            f"{world.mesh['tp'].size()} with a critic (rl.algo ppo or rm), expected 1 (it is not tensor parallel; "
            "use data parallelism)"
        )
    if world.dp_size == 1:
        return
    backbone: Any = getattr(critic, str(critic.base_model_prefix))
    layers = backbone.layers
    units = [fully_shard(layer, mesh=world.mesh["dp"]) for layer in layers]
    units.append(fully_shard(critic, mesh=world.mesh["dp"]))
    for unit in units:
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(1.0)
