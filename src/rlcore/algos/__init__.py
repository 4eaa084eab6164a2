"""RL algorithm maths: advantage estimators, policy/value/KL/preference losses, aggregation, recipes.

Pure functions over tensors and pytree batches: no modules, no process groups held,
no host syncs.
"""

__all__: list[str] = []
