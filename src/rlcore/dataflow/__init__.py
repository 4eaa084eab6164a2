"""Data movement: sequence packing, the Transfer Dock, dispatch, resharding, pipelines."""

from rlcore.dataflow.dock import BALANCE_MODES, DockController, TransferDock, Warehouse
from rlcore.dataflow.ray_dock import DockHost, RayTransferDock

__all__: list[str] = [
    "BALANCE_MODES",
    "DockController",
    "DockHost",
    "RayTransferDock",
    "TransferDock",
    "Warehouse",
]
