"""LoRA through ``peft``: adapters from ``{r, alpha, dropout, target_modules}``, the base model as the reference policy.

Only the adapters are trainable. The reference policy is the same module with its
adapters switched off (:func:`adapters_disabled`, :class:`AdaptersOff`), never a second
copy of the weights.
:func:`merged_state_dict` gives the weights the rollout engine needs (``W + B A *
alpha / r`` under the base model's own names; differentiable, so the packed
:func:`rlcore.models.from_hf` forward can run on it too), and
:func:`adapter_state_dict` the small state a checkpoint keeps. peft is imported on first use.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "AdaptersOff",
    "MergedWeights",
    "adapter_state_dict",
    "adapters_disabled",
    "apply_lora",
    "base_view",
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
    """Whether ``model`` is a ``peft.PeftModel`` (peft is not imported: without it no such model exists)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


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


def _delta(layer: Any, adapter: str, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """``B A * alpha / r`` of one adapter from given tensors, as peft's ``lora.Linear.get_delta_weight`` computes it."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.utils.other import transpose

    if not isinstance(layer, LoraLinear):
        raise ValueError(
            f"model: got a {type(layer).__name__} adapter, expected LoRA on linear layers only when merging "
            "gathered weights (target_modules among the decoder's linear layers)"
        )
    dtype = lora_b.dtype
    # peft merges half-precision CPU weights in float32, then casts back.
    cast = lora_b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    a, b = (lora_a.float(), lora_b.float()) if cast else (lora_a, lora_b)
    out = transpose(b @ a, layer.fan_in_fan_out) * layer.scaling[adapter]
    return out.to(dtype) if cast else out


def _merged(
    base: nn.Module, key: str, value: torch.Tensor, state: Mapping[str, torch.Tensor] | None = None
) -> tuple[str, torch.Tensor]:
    """One entry of the base model's state, under its un-adapted name, with the active adapters merged in.

    The adapters are the modules' own tensors, or those of ``state`` (a gathered state dict
    with the base model's keys) when given.
    """
    if _BASE + "." not in key:
        return key, value
    owner, leaf = key.split(_BASE + ".", 1)
    layer: Any = base.get_submodule(owner)
    if leaf == "weight" and not layer.disable_adapters and not layer.merged:
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A:
                continue
            if state is None:
                delta = layer.get_delta_weight(adapter)
            else:
                pair = [state.get(f"{owner}.lora_{ab}.{adapter}.weight") for ab in "AB"]
                if pair[0] is None or pair[1] is None:
                    raise ValueError(f"state: holds {key!r} but not its adapter {adapter!r}'s lora_A / lora_B weights")
                delta = _delta(layer, adapter, pair[0], pair[1])
            value = value + delta.to(value.dtype)
    return f"{owner}.{leaf}", value


def merged_state_dict(model: Any, *, state: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The base model's state with the active adapters merged in (``W + B A * alpha / r``), under the base names.

    Nothing is modified. Under autograd the merged tensors are differentiable in the
    adapters; wrap the call in ``torch.no_grad()`` to hand the weights to a rollout
    engine. Inside :func:`adapters_disabled` the base weights come back unmerged.

    Args:
      model: a ``peft.PeftModel`` from :func:`apply_lora`.
      state: merge these tensors instead of the model's own: a state dict with the keys of
        ``model.get_base_model().state_dict()`` (e.g. the full tensors gathered from a
        model sharded with FSDP2, :func:`rlcore.train.full_state_dict`); only its entries
        are returned (an empty ``state`` gives ``{}``). The merge is peft's formula.

    Returns:
      name -> tensor, with the keys of the un-adapted model's ``state_dict()``.
    """
    _check_lora(model)
    base = model.get_base_model()
    source = base.state_dict(keep_vars=True) if state is None else state
    return dict(_merged(base, k, v, state) for k, v in source.items() if ".lora_" not in k)


class MergedWeights(Mapping[str, torch.Tensor]):
    """A live :func:`merged_state_dict`: every read merges the adapters' current values (differentiable in them).

    :func:`rlcore.models.from_hf` of a LoRA model hands this out as its ``params``, so
    each packed forward runs on ``W + B A * alpha / r`` as the adapters are now, and its
    backward reaches the adapters; nothing is stored but the names.

    Args:
      model: a ``peft.PeftModel`` from :func:`apply_lora`.

    >>> MergedWeights.__mro__[1].__name__
    'Mapping'
    """

    def __init__(self, model: Any):
        _check_lora(model)
        self.model = model
        base = model.get_base_model()
        # un-adapted name -> the key in the base model's state
        self._keys = {k.replace(_BASE + ".", ".", 1): k for k in base.state_dict() if ".lora_" not in k}

    def __getitem__(self, name: str) -> torch.Tensor:
        key = self._keys[name]
        base = self.model.get_base_model()
        owner, _, leaf = key.rpartition(".")
        module = base.get_submodule(owner) if owner else base
        value = getattr(module, leaf)
        return _merged(base, key, value)[1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, name: object) -> bool:
        return name in self._keys


def base_view(model: Any) -> nn.Module:
    """The base architecture holding the base model's own tensors (no copy): the reference policy of a LoRA run.

    A plain transformers model (no adapter modules) whose parameters and buffers *are*
    the ``peft`` model's base tensors, so it computes what ``model`` computes inside
    :func:`adapters_disabled` without a second copy of the weights. Its parameters are
    frozen like the base ones.

    Args:
      model: a ``peft.PeftModel`` from :func:`apply_lora`.

    Returns:
      An ``nn.Module`` of the base model's class.
    """
    _check_lora(model)
    base = model.get_base_model()
    with torch.device("meta"):
        view = type(base)(base.config)
    # assign=True gives a loaded Parameter the requires_grad of the one it replaces
    view.requires_grad_(False)
    with adapters_disabled(model):
        view.load_state_dict(merged_state_dict(model), strict=True, assign=True)
    for name, buffer in base.named_buffers():
        if ".lora_" in name or _BASE + "." in name:
            continue
        owner, _, leaf = name.rpartition(".")
        setattr(view.get_submodule(owner) if owner else view, leaf, buffer)
    meta = [n for n, t in [*view.named_parameters(), *view.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(f"model: its base model lacks {meta[:3]}, which the base architecture needs")
    view.train(base.training)
    return view


class AdaptersOff(nn.Module):
    """The base model of a LoRA model, as a module of its own: the same module run with its adapters switched off.

    The reference policy of a LoRA run when the policy is sharded (FSDP2): a
    :func:`base_view` would re-register the base tensors, which FSDP's hooks would never
    gather, so the forward runs on the policy's own sharded modules inside
    :func:`adapters_disabled` instead. :func:`rlcore.models.from_hf` of it runs the
    packed forward the same way (unsharded: on :func:`base_view`). No weight is copied;
    ``eval()`` / ``train()`` reach the wrapped model.

    Args:
      model: a ``peft.PeftModel`` from :func:`apply_lora`.

    >>> AdaptersOff.__mro__[1].__name__
    'Module'
    """

    def __init__(self, model: Any):
        _check_lora(model)
        super().__init__()
        self.lora = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward with its adapters off."""
        with adapters_disabled(self.lora):
            return self.lora(*args, **kwargs)


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
