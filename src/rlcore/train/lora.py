"""LoRA in the trainer (``model.lora: {r, alpha, dropout, target_modules}``): the config seam and the checkpoint's part.

The trainer wraps its policy with :func:`rlcore.models.apply_lora` (Hu et al.,
arXiv:2106.09685) and otherwise runs unchanged: :func:`rlcore.models.from_hf` of the
``peft`` model forwards on its merged weights, so the gradients reach the adapters and
only they are trainable and held by the optimiser; the reference policy is
:class:`rlcore.models.AdaptersOff` (the same module with its adapters off, no second
copy of the weights); the rollout engine receives the merged weights
(:func:`rlcore.train.full_state_dict`) through the weight sync; the checkpoint keeps the
adapters alone (:func:`adapter_modules`), the base weights being the model directory's;
the export writes merged weights.

At world size > 1 the peft model is sharded with FSDP2 over ``parallel.data_parallel``
(:func:`rlcore.train.parallelize`): the packed forward runs through its own modules, the
adapters' gradients are summed over the ranks by FSDP's reduce-scatter, the merged
weights are gathered (a collective) before the sync and the export, and the adapter
checkpoint is DCP shards that resume at any world size. LoRA with tensor or context
parallelism is refused (:func:`check_lora_launch`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from rlcore.models import apply_lora, is_lora

__all__ = ["LORA_KEYS", "adapter_modules", "attach_lora", "check_lora_launch", "lora_options"]

LORA_KEYS = ("r", "alpha", "dropout", "target_modules")


def lora_options(lora: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`rlcore.models.apply_lora` from the config's ``model.lora`` mapping.

    Args:
      lora: ``model.lora``: a mapping with some of ``r``, ``alpha``, ``dropout``, ``target_modules``.

    Returns:
      ``{key: value}`` for the keys given (the others take ``apply_lora``'s defaults).

    >>> lora_options({"r": 4, "alpha": 8})
    {'r': 4, 'alpha': 8}
    """
    if not isinstance(lora, Mapping):
        raise ValueError(f"model.lora: got {lora!r}, expected a mapping with keys among {list(LORA_KEYS)}")
    unknown = sorted(set(lora) - set(LORA_KEYS))
    if unknown:
        raise ValueError(f"model.lora: got the keys {unknown}, expected keys among {list(LORA_KEYS)}")
    dropout = lora.get("dropout", 0.0)
    if dropout != 0:
        raise ValueError(
            f"model.lora.dropout: got {dropout!r}, expected 0 (the trainer's packed forward runs on the merged "
            "weights W + B A * alpha / r, where dropout on the adapters' input cannot apply)"
        )
    return dict(lora)


def check_lora_launch(cfg: Any, world_size: int) -> None:
    """Refuse, before anything starts, a LoRA run the trainer cannot serve; check the ``model.lora`` keys.

    LoRA runs at any world size with data parallelism (FSDP2); with
    ``parallel.tensor_parallel`` or ``parallel.context_parallel`` above 1 it is refused.

    Args:
      cfg: the run's :class:`rlcore.train.config.Config`.
      world_size: the number of processes launched.
    """
    if cfg.model.lora is None:
        return
    lora_options(cfg.model.lora)
    for key in ("tensor_parallel", "context_parallel"):
        size = getattr(cfg.parallel, key)
        if size != 1:
            raise ValueError(
                f"model.lora: got LoRA with parallel.{key}={size} (world size {world_size}), expected "
                f"parallel.{key}=1 (LoRA shards over data parallelism only, parallel.data_parallel with FSDP2)"
            )
    if cfg.rl.multi_turn is not None:
        raise ValueError("model.lora: got LoRA with rl.multi_turn set, expected one of them (not wired together yet)")


def attach_lora(policy: nn.Module, cfg: Any) -> Any:
    """The policy wrapped with the config's LoRA adapters (``peft.PeftModel``; its base weights frozen, shared).

    Args:
      policy: the transformers causal LM built from ``model.model_name_or_path``.
      cfg: the run's config (``model.lora``).

    Returns:
      The ``peft.PeftModel``.
    """
    return apply_lora(policy, **lora_options(cfg.model.lora))


def adapter_modules(model: Any) -> nn.Module:
    """A module holding only the adapters of ``model`` (the same tensors): what a LoRA checkpoint saves.

    Its parameters are the trainable ``lora_A`` / ``lora_B`` weights, under names derived
    from their place in ``model``, so a checkpoint of it (with the optimiser that holds
    them) is a small fraction of the full weights and loads back into the same adapters.

    Args:
      model: a ``peft.PeftModel`` from :func:`rlcore.models.apply_lora`.

    Returns:
      An ``nn.ModuleDict`` whose parameters are exactly ``model``'s trainable ones.
    """
    if not is_lora(model):
        raise ValueError(f"model: got {type(model).__name__}, expected a peft.PeftModel (see attach_lora)")
    holder = nn.ModuleDict()
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            holder[name.replace(".", "/")] = module
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    held = {id(p) for p in holder.parameters()}
    if held != trainable:
        raise ValueError(
            f"model: {len(trainable)} trainable tensors but {len(held)} adapter tensors; a LoRA checkpoint "
            "expects only the adapters to be trainable"
        )
    return holder
