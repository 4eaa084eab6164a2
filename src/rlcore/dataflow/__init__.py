"""Data movement: sequence packing, the Transfer Dock, dispatch, resharding, pipelines."""

__all__: list[str] = []
