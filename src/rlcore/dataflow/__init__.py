"""Data movement: sequence packing, the Transfer Dock, dispatch, resharding, weight sync, pipelines."""

from rlcore.dataflow.deploy import RolloutWorker, colocate
from rlcore.dataflow.dispatch import PARTITION_METHODS, balanced_partition, shard_samples
from rlcore.dataflow.dock import BALANCE_MODES, DockController, TransferDock, Warehouse, flatten_rows, unflatten_rows
from rlcore.dataflow.layout import (
    MESH_DIMS,
    Layout,
    Placement,
    decoder_layout,
    decoder_param_meta,
    infer_dp,
    param_meta,
)
from rlcore.dataflow.packing import Packed, pack, pack_to_budget, shift_labels, unpack
from rlcore.dataflow.ray_dock import DockHost, RayTransferDock
from rlcore.dataflow.ray_rollout import RayRolloutWorker, RolloutActor
from rlcore.dataflow.reshard import (
    Bucket,
    Move,
    ParamMove,
    ReshardPlan,
    allocate_buckets,
    bucket_views,
    check_reshard_params,
    plan_fingerprint,
    plan_reshard,
    reshard,
    reshard_bucket,
)
from rlcore.dataflow.scheduler import PipelineResult, StageTimeout, TaskRecord, add_note, run_pipeline
from rlcore.dataflow.simulate import LinearCost, SimReport, critical_path_bound, fit_costs, simulate
from rlcore.dataflow.stages import PHASES, ROLES, Stage, StageGraph, stage
from rlcore.dataflow.weight_sync import SyncRecord, WeightPacket, WeightSync, load_into, unpack_weights

__all__: list[str] = [
    "BALANCE_MODES",
    "MESH_DIMS",
    "PARTITION_METHODS",
    "PHASES",
    "ROLES",
    "Bucket",
    "DockController",
    "DockHost",
    "Layout",
    "LinearCost",
    "Move",
    "Packed",
    "ParamMove",
    "PipelineResult",
    "Placement",
    "RayRolloutWorker",
    "RayTransferDock",
    "ReshardPlan",
    "RolloutActor",
    "RolloutWorker",
    "SimReport",
    "Stage",
    "StageGraph",
    "StageTimeout",
    "SyncRecord",
    "TaskRecord",
    "TransferDock",
    "Warehouse",
    "WeightPacket",
    "WeightSync",
    "add_note",
    "allocate_buckets",
    "balanced_partition",
    "bucket_views",
    "check_reshard_params",
    "colocate",
    "critical_path_bound",
    "decoder_layout",
    "decoder_param_meta",
    "fit_costs",
    "flatten_rows",
    "infer_dp",
    "load_into",
    "pack",
    "pack_to_budget",
    "param_meta",
    "plan_fingerprint",
    "plan_reshard",
    "reshard",
    "reshard_bucket",
    "run_pipeline",
    "shard_samples",
    "shift_labels",
    "simulate",
    "stage",
    "unflatten_rows",
    "unpack",
    "unpack_weights",
]
