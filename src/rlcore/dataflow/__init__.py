"""Data movement: sequence packing, the Transfer Dock, dispatch, resharding, pipelines."""

from rlcore.dataflow.dispatch import PARTITION_METHODS, balanced_partition, shard_samples
from rlcore.dataflow.packing import Packed, pack, pack_to_budget, shift_labels, unpack
from rlcore.dataflow.dock import BALANCE_MODES, DockController, TransferDock, Warehouse
from rlcore.dataflow.ray_dock import DockHost, RayTransferDock
from rlcore.dataflow.layout import MESH_DIMS, Layout, Placement, decoder_layout, param_meta
from rlcore.dataflow.reshard import (
    Bucket,
    Move,
    ParamMove,
    ReshardPlan,
    allocate_buckets,
    bucket_views,
    plan_reshard,
    reshard,
    reshard_bucket,
)
from rlcore.dataflow.stages import PHASES, ROLES, Stage, StageGraph, stage
from rlcore.dataflow.scheduler import PipelineResult, StageTimeout, TaskRecord, run_pipeline
from rlcore.dataflow.simulate import LinearCost, SimReport, critical_path_bound, fit_costs, simulate
from rlcore.dataflow.deploy import ColocatedSwitch, RolloutWorker, colocate

__all__: list[str] = [
    "PARTITION_METHODS",
    "balanced_partition",
    "shard_samples",
    "Packed",
    "pack",
    "pack_to_budget",
    "shift_labels",
    "unpack",
    "BALANCE_MODES",
    "DockController",
    "DockHost",
    "RayTransferDock",
    "TransferDock",
    "Warehouse",
    "MESH_DIMS",
    "Bucket",
    "Layout",
    "Move",
    "ParamMove",
    "Placement",
    "ReshardPlan",
    "allocate_buckets",
    "bucket_views",
    "decoder_layout",
    "param_meta",
    "plan_reshard",
    "reshard",
    "reshard_bucket",
    "PHASES",
    "ROLES",
    "PipelineResult",
    "SimReport",
    "Stage",
    "StageGraph",
    "StageTimeout",
    "TaskRecord",
    "critical_path_bound",
    "fit_costs",
    "LinearCost",
    "run_pipeline",
    "simulate",
    "stage",
    "ColocatedSwitch",
    "RolloutWorker",
    "colocate",
]
