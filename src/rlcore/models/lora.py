"""LoRA through ``peft``: adapters from ``{r, alpha, dropout, target_modules}``, the base model as the reference policy.

Only the adapters are trainable. The reference policy is the same module with its
adapters switched off (:func:`adapters_disabled`), never a second copy of the weights.
:func:`merged_state_dict` gives the weights the rollout engine needs (``W + B A *
alpha / r`` under the base model's own names; differentiable, so the packed
:func:`rlcore.models.from_hf` forward can run on it too), and
:func:`adapter_state_dict` the small state a checkpoint keeps. peft is imported on first use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "adapter_state_dict",
    "adapters_disabled",
    "apply_lora",
    "is_lora",
    "load_adapter_state_dict",
    "merged_state_dict",
]

_BASE = ".base_layer"


def apply_lora(
    model: nn.Module,
    *,
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    target_modules: Sequence[str] | str = ("q_proj", "k_proj", "v_proj", "o_proj"),
) -> Any:
    """Wrap a causal LM with LoRA adapters (Hu et al., arXiv:2106.09685); only the adapters stay trainable.

    The base weights are shared with ``model`` (peft injects the adapters in place), and
    the adapters start at zero (``B = 0``), so the wrapped model computes exactly what
    ``model`` did.

    Args:
      model: a transformers causal LM.
      r: the adapters' rank.
      alpha: the scale numerator (the update is ``B A * alpha / r``).
      dropout: dropout on the adapters' input.
      target_modules: names of the linear layers to adapt (``"all-linear"`` for all).

    Returns:
      The ``peft.PeftModel``.
    """
    from peft import LoraConfig, get_peft_model

    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"model.lora.r: got {r!r}, expected a positive int")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"model.lora.alpha: got {alpha!r}, expected a positive number")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"model.lora.dropout: got {dropout!r}, expected 0 <= dropout < 1")
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,  # type: ignore[arg-type]  # peft scales by alpha / r; a float alpha works
        lora_dropout=dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(f"model.lora.target_modules: got {targets!r}, but peft says: {first}") from err


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel``."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _check_lora(model: Any) -> None:
    if not is_lora(model):
        raise ValueError(f"model: got {type(model).__name__}, expected a peft.PeftModel (see apply_lora)")


@contextlib.contextmanager
def adapters_disabled(model: Any) -> Iterator[Any]:
    """Inside the block ``model`` is the base model: the reference policy of a LoRA run, without a second copy.

    >>> import contextlib
    >>> isinstance(adapters_disabled, type(contextlib.contextmanager(lambda: iter(()))))
    True
    """
    _check_lora(model)
    with model.disable_adapter():
        yield model


def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The base model's state with the active adapters merged in (``W + B A * alpha / r``), under the base names.

    Nothing is modified. Under autograd the merged tensors are differentiable in the
    adapters; wrap the call in ``torch.no_grad()`` to hand the weights to a rollout
    engine. Inside :func:`adapters_disabled` the base weights come back unmerged.

    Args:
      model: a ``peft.PeftModel`` from :func:`apply_lora`.

    Returns:
      name -> tensor, with the keys of the un-adapted model's ``state_dict()``.
    """
    _check_lora(model)
    base = model.get_base_model()
    out: dict[str, torch.Tensor] = {}
    for key, value in base.state_dict(keep_vars=True).items():
        if ".lora_" in key:
            continue
        if _BASE + "." not in key:
            out[key] = value
            continue
        owner, leaf = key.split(_BASE + ".", 1)
        name = f"{owner}.{leaf}"
        layer = base.get_submodule(owner)
        if leaf == "weight" and not layer.disable_adapters and not layer.merged:
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    value = value + layer.get_delta_weight(adapter).to(value.dtype)
        out[name] = value
    return out


def adapter_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The adapters' weights alone (what a LoRA checkpoint keeps), through ``peft.get_peft_model_state_dict``."""
    from peft import get_peft_model_state_dict

    _check_lora(model)
    return dict(get_peft_model_state_dict(model))


def load_adapter_state_dict(model: Any, state: Mapping[str, torch.Tensor]) -> None:
    """Load adapter weights saved by :func:`adapter_state_dict` into a model with the same adapters."""
    from peft import set_peft_model_state_dict

    _check_lora(model)
    result = set_peft_model_state_dict(model, dict(state))
    missing = [k for k in getattr(result, "unexpected_keys", []) if ".lora_" in k]
    if missing:
        raise ValueError(f"state: holds adapter keys the model does not have, e.g. {missing[:3]}")
