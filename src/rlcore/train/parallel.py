"""Training on torch's own distributed engines: a ("dp", "cp", "tp") DeviceMesh, FSDP2 and DTensor tensor parallelism.

Data parallelism is FSDP2 (``torch.distributed.fsdp.fully_shard``): each decoder layer is
one unit, and the whole model (embeddings, final norm, output embedding) the root unit, sharded over the
mesh's ``"dp"`` dimension, flattened with ``"cp"`` when context parallelism is on (the
ranks of a context-parallel group hold the same weights and score disjoint tokens of the
same sequences, so their gradients are summed like data-parallel ones). A LoRA model
(``peft``) is sharded the same way, its frozen base weights and trainable adapters in the
same units. Tensor parallelism is DTensor ``parallelize_module`` over
``"tp"`` (Megatron-LM's split, Shoeybi et al., arXiv:1909.08053): the q/k/v and gate/up
projections column-wise, the o and down projections row-wise, so each rank holds
``heads / tp`` attention heads and one all-reduce ends each block. Gradients reach the
sharded parameters through FSDP's reduce-scatter (summed over ``dp``: rlcore's losses
are normalised by global counts) and DTensor's own collectives: no hand-written
collective touches the model. The collective backend is the device's (hccl on Ascend,
nccl on CUDA, gloo on the CPU).

>>> from rlcore.train.parallel import check_parallel_sizes
>>> check_parallel_sizes(data_parallel=2, tensor_parallel=2, world_size=4)
>>> check_parallel_sizes(data_parallel=1, tensor_parallel=1, context_parallel=2, world_size=2)
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from rlcore.device import collective_backend, device_kind, get_device
from rlcore.models import is_lora, merged_state_dict

__all__ = [
    "MESH_DIMS",
    "check_parallel_sizes",
    "clip_grad_norm",
    "device_mesh",
    "full_state_dict",
    "parallelize",
    "shard_mesh",
]

MESH_DIMS = ("dp", "cp", "tp")  # the order of rlcore.dataflow.Layout's dimensions

# Megatron's split of a decoder layer: column-wise in, row-wise out.
_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def check_parallel_sizes(
    *,
    data_parallel: int,
    tensor_parallel: int,
    world_size: int,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
) -> None:
    """``ValueError`` unless ``data_parallel x context_parallel x tensor_parallel`` is the world size and ``pipeline_parallel`` is 1.

    Args:
      data_parallel, context_parallel, tensor_parallel, pipeline_parallel: the ``parallel.*`` config values.
      world_size: the number of processes launched (``torchrun --nproc-per-node``).

    >>> check_parallel_sizes(data_parallel=3, tensor_parallel=2, world_size=2)
    Traceback (most recent call last):
    ...
    ValueError: config keys 'parallel.data_parallel' (3) x 'parallel.tensor_parallel' (2) = 6, expected the launched world size 2 (torchrun --nproc-per-node 6, or change the keys so that their product is 2)
    """
    for key, value in (
        ("data_parallel", data_parallel),
        ("tensor_parallel", tensor_parallel),
        ("pipeline_parallel", pipeline_parallel),
        ("context_parallel", context_parallel),
        ("world_size", world_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            name = key if key == "world_size" else f"config key 'parallel.{key}'"
            raise ValueError(f"{name}: got {value!r}, expected an int >= 1")
    if pipeline_parallel != 1:
        raise ValueError(
            f"config key 'parallel.pipeline_parallel': got {pipeline_parallel}, expected 1 (supported: data "
            "parallelism through FSDP2, parallel.data_parallel, context parallelism, parallel.context_parallel, "
            "and tensor parallelism through DTensor, parallel.tensor_parallel; pipeline parallelism is not)"
        )
    product = data_parallel * context_parallel * tensor_parallel
    if product == world_size:
        return
    if tensor_parallel == 1 and context_parallel == 1:
        raise ValueError(
            f"config key 'parallel.data_parallel': got {data_parallel}, expected the launched world size "
            f"{world_size} (torchrun --nproc-per-node {data_parallel}, or override parallel.data_parallel={world_size})"
        )
    sizes = [("data_parallel", data_parallel)]
    sizes += [("context_parallel", context_parallel)] if context_parallel != 1 else []
    sizes += [("tensor_parallel", tensor_parallel)] if tensor_parallel != 1 else []
    keys = " x ".join(f"'parallel.{k}' ({v})" for k, v in sizes)
    raise ValueError(
        f"config keys {keys} = {product}, expected the launched world size {world_size} "
        f"(torchrun --nproc-per-node {product}, or change the keys so that their product is {world_size})"
    )


def _launched_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def device_mesh(
    data_parallel: int = 1,
    tensor_parallel: int = 1,
    *,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    device: torch.device | str | None = None,
) -> DeviceMesh:
    """The ``("dp", "cp", "tp")`` :class:`DeviceMesh` of this launch, initialising the process group if needed.

    Ranks are laid out ``tp``-fastest, then ``cp``, so the ranks of one tensor-parallel
    group are neighbours (one node's fast links), as in :class:`rlcore.dataflow.Layout`. The process group is initialised from the
    ``torchrun`` environment with the device's collective backend
    (:func:`rlcore.device.collective_backend`), or as a one-process group when nothing was
    launched; on an accelerator each process takes the device ``LOCAL_RANK``.

    Args:
      data_parallel: size of the ``"dp"`` dimension (``parallel.data_parallel``).
      tensor_parallel: size of the ``"tp"`` dimension (``parallel.tensor_parallel``).
      pipeline_parallel: must be 1 (``parallel.pipeline_parallel``).
      context_parallel: size of the ``"cp"`` dimension (``parallel.context_parallel``).
      device: the device kind (default: the best available, :func:`rlcore.device.device_kind`).

    Returns:
      a 3-D ``DeviceMesh`` with ``mesh_dim_names == ("dp", "cp", "tp")``.
    """
    check_parallel_sizes(
        data_parallel=data_parallel,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        context_parallel=context_parallel,
        world_size=_launched_world_size(),
    )
    kind = device_kind() if device is None else get_device(str(device).split(":")[0]).type
    if kind != "cpu":
        # One accelerator per process: the mesh and the collectives use the current one.
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(collective_backend(kind))
        else:
            dist.init_process_group(collective_backend(kind), store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh(kind, (data_parallel, context_parallel, tensor_parallel), mesh_dim_names=MESH_DIMS)


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh FSDP2 shards over: ``mesh["dp"]``, or ``"dp"`` and ``"cp"`` flattened into ``"dp_cp"``.

    Context-parallel ranks hold the same weights and each computes its share of the
    gradient, so FSDP's reduce-scatter over the flattened dimension sums them with the
    data-parallel ones.

    Args:
      mesh: the ``("dp", "cp", "tp")`` mesh from :func:`device_mesh`.

    Returns:
      a 1-D ``DeviceMesh`` of ``dp x cp`` ranks.
    """
    if mesh["cp"].size() == 1:
        return mesh["dp"]
    return mesh["dp", "cp"]._flatten("dp_cp")


def _decoder_layers(model: nn.Module, *, adapted: bool = False) -> nn.ModuleList:
    """The decoder layers of an HF causal LM, or a ``ValueError`` naming what is missing.

    With ``adapted`` a projection may be a peft LoRA layer around its ``nn.Linear``
    (its ``base_layer``), which FSDP2 shards like any module and tensor parallelism does not.
    """
    prefix = getattr(model, "base_model_prefix", "")
    backbone = getattr(model, prefix, None) if prefix else None
    layers = getattr(backbone, "layers", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(backbone, nn.Module) or not isinstance(layers, nn.ModuleList) or not isinstance(head, nn.Module):
        raise ValueError(
            f"model: got {type(model).__name__}, expected a transformers decoder (Qwen2 / Llama family) with a "
            "base_model_prefix backbone holding .layers and an output embedding"
        )
    for i, layer in enumerate(layers):
        for name in _COLWISE + _ROWWISE:
            try:
                sub = layer.get_submodule(name)
            except AttributeError:
                sub = None
            if adapted and not isinstance(sub, nn.Linear):
                sub = getattr(sub, "base_layer", None)
            if not isinstance(sub, nn.Linear):
                raise ValueError(
                    f"model: decoder layer {i} has no nn.Linear '{name}' (expected the Qwen2 / Llama layout)"
                )
    inside = {id(p) for m in (backbone, head) for p in m.parameters()}
    stray = [n for n, p in model.named_parameters() if id(p) not in inside]
    if stray:
        raise ValueError(f"model: parameters {stray} lie outside the backbone and the output embedding")
    return layers


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    grad_reduce: Literal["sum", "mean"] = "sum",
) -> nn.Module:
    """Shard an HF decoder in place: tensor parallel over ``mesh["tp"]``, then FSDP2 over ``mesh["dp"]`` (x ``"cp"``).

    Tensor parallelism (``tp > 1``) splits each decoder layer Megatron-style (Shoeybi et
    al., arXiv:1909.08053): q/k/v and gate/up ``ColwiseParallel``, o and down
    ``RowwiseParallel``; embeddings, norms and the output embedding stay replicated.
    Data parallelism (``dp > 1``) is FSDP2 (Zhao et al., arXiv:2304.11277): each decoder
    layer a unit and the whole model the root unit (embeddings, final norm, output
    embedding), so :func:`rlcore.models.from_hf` runs the packed forward through the
    sharded modules.
    With context parallelism (``cp > 1``) FSDP2 shards over ``dp x cp`` flattened
    (:func:`shard_mesh`). With ``grad_reduce="sum"`` the gradients are summed over ``dp`` (the right thing for
    losses normalised by global counts, :func:`rlcore.algos.global_counts`); ``"mean"``
    averages them. A 1 x 1 mesh leaves the model as it is. The model must already be
    on the mesh's device, identical on every rank.

    A LoRA model (``peft.PeftModel``, :func:`rlcore.models.apply_lora`) is sharded with
    FSDP2 (its base model the root unit, each decoder layer a unit holding the frozen base
    weights and the trainable adapters); tensor parallelism of peft's adapted layers is
    not supported (``tp`` must be 1).

    Args:
      model: a transformers ``*ForCausalLM`` of the Qwen2 / Llama family, or a ``peft.PeftModel`` around one.
      mesh: the ``("dp", "cp", "tp")`` mesh from :func:`device_mesh`.
      reshard_after_forward: free the gathered layer weights after each forward (FSDP's
        ZeRO-3); ``False`` keeps them until the backward (ZeRO-2, more memory, fewer gathers).
      grad_reduce: ``"sum"`` or ``"mean"`` over the data-parallel ranks (context-parallel shares are always summed).

    Returns:
      ``model`` itself, sharded.
    """
    if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names != MESH_DIMS:
        raise ValueError(f"mesh: got {mesh!r}, expected a DeviceMesh with mesh_dim_names {MESH_DIMS} (device_mesh)")
    if grad_reduce not in ("sum", "mean"):
        raise ValueError(f"grad_reduce: got {grad_reduce!r}, expected 'sum' or 'mean'")
    dp, tp = mesh["dp"].size() * mesh["cp"].size(), mesh["tp"].size()
    lora = is_lora(model)
    if lora and tp > 1:
        raise ValueError(
            f"config key 'parallel.tensor_parallel': got {tp} with a LoRA model, expected 1 (peft's adapted "
            "layers are sharded with FSDP2 over parallel.data_parallel only)"
        )
    outer, model = model, (cast(nn.Module, cast(Any, model).get_base_model()) if lora else model)
    layers = _decoder_layers(model, adapted=lora)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("model: already sharded (it holds DTensor parameters); parallelize a fresh model")
    if tp > 1:
        config: Any = getattr(model, "config", None)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        inter = config.intermediate_size
        if heads % tp or kv_heads % tp or inter % tp:
            raise ValueError(
                f"config key 'parallel.tensor_parallel': got {tp}, expected a divisor of the model's "
                f"num_attention_heads ({heads}), num_key_value_heads ({kv_heads}) and intermediate_size ({inter})"
            )
        plan: dict[str, ParallelStyle] = {name: ColwiseParallel() for name in _COLWISE}
        plan |= {name: RowwiseParallel() for name in _ROWWISE}
        for layer in layers:
            parallelize_module(layer, mesh["tp"], plan)
    if dp > 1:
        units: list[FSDPModule] = []
        shards = shard_mesh(mesh)
        for layer in layers:
            units.append(fully_shard(layer, mesh=shards, reshard_after_forward=reshard_after_forward))
        units.append(fully_shard(model, mesh=shards))
        for unit in units:
            # Plain SUM collectives (gloo has neither AVG nor PREMUL_SUM); "mean" divides after.
            unit.set_force_sum_reduction_for_comms(True)
            if grad_reduce == "sum":
                unit.set_gradient_divide_factor(1.0)
            elif mesh["cp"].size() > 1:  # a mean over dp; the cp shares of one gradient are summed
                unit.set_gradient_divide_factor(float(mesh["dp"].size()))
    return outer


def _grad_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of the whole gradients, each DTensor counted once over its mesh."""
    parts = []
    for g in grads:
        n = torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32)
        parts.append(n.full_tensor() if isinstance(n, DTensor) else n)
    if not parts:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([p.to(parts[0].device) for p in parts]), norm_type)


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, *, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for sharded and replicated parameters alike.

    FSDP2 and tensor-parallel gradients are DTensors on different meshes (the
    layers' ``dp x tp``, the root's ``dp``), and the replicated ones plain tensors, which
    the stock function cannot stack. Each gradient's norm is taken over its whole
    (global) tensor, the total is their ``norm_type``-norm, and every gradient is scaled
    by ``min(1, max_norm / (total + 1e-6))``. Every rank gets the same total.

    Args:
      parameters: the parameters whose ``.grad`` to clip (those without one are skipped).
      max_norm: the largest total norm kept (``math.inf``: measure only).
      norm_type: the p of the p-norm (``math.inf`` for the max-norm).

    Returns:
      the total norm before clipping, a 0-d float32 tensor.

    >>> w = torch.nn.Parameter(torch.ones(4))
    >>> w.grad = torch.full((4,), 2.0)
    >>> clip_grad_norm([w], 1.0)
    tensor(4.)
    >>> w.grad
    tensor([0.5000, 0.5000, 0.5000, 0.5000])
    """
    if not isinstance(max_norm, (int, float)) or math.isnan(max_norm) or max_norm <= 0:
        raise ValueError(f"max_norm: got {max_norm!r}, expected a number > 0")
    grads = [p.grad for p in parameters if p.grad is not None]
    total = _grad_norm(grads, float(norm_type))
    if math.isinf(max_norm):
        return total
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    with torch.no_grad():
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            local.mul_(coef.to(local.device, local.dtype))
    return total


def full_state_dict(model: nn.Module, *, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """The model's whole (unsharded) state dict, for weight sync to an inference engine or export.

    Collective on a sharded model: every rank of the mesh calls it. FSDP shards and
    tensor-parallel slices are gathered through ``torch.distributed.checkpoint.state_dict``
    (``full_state_dict=True``); the keys are those of an unsharded ``model.state_dict()``,
    so an unsharded replica loads them with ``load_state_dict``. An unsharded model
    gives its own tensors, detached. A LoRA model gives the merged weights ``W + B A *
    alpha / r`` under the base model's names (:func:`rlcore.models.merged_state_dict` of
    the gathered tensors): what a rollout engine or an export of the base architecture loads.

    Args:
      model: a model (or a ``peft.PeftModel``), sharded by :func:`parallelize` or not.
      cpu_offload: gather to the CPU of rank 0 only (the other ranks get ``{}``), for export.

    Returns:
      name -> full tensor.

    >>> sd = full_state_dict(torch.nn.Linear(2, 3))
    >>> sorted(sd), tuple(sd["weight"].shape)
    (['bias', 'weight'], (3, 2))
    """
    if is_lora(model):
        gathered = full_state_dict(cast(Any, model).get_base_model(), cpu_offload=cpu_offload)
        with torch.no_grad():
            return merged_state_dict(model, state=gathered)
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return {k: v.detach() for k, v in model.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))
