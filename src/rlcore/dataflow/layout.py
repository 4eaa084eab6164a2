"""Weight layouts as values: a named device mesh plus one placement per parameter.

A :class:`Layout` is plain data (no process group): the sizes of the mesh dimensions
``pp`` (pipeline stages), ``dp`` (data-parallel replicas), ``ep`` (expert parallel),
``cp`` (context parallel: ranks splitting one packed row of tokens, with replicated
weights) and ``tp`` (tensor parallel), outermost to innermost, and for every parameter a
:class:`Placement`: the tensor dimension split over ``tp`` (0 = column-parallel,
1 = row-parallel, ``None`` = replicated), the one split over ``ep`` (the stacked
expert dimension), and the pipeline stage holding it. A placement on a mesh
dimension of size 1 is a no-op, so one placement table serves every size.

``tp`` is innermost and ``cp`` next, as in Megatron-LM's ``tp-cp-ep-dp-pp`` order, so
tensor- and context-parallel peers, which talk inside every layer, are adjacent ranks
(one node). :meth:`Layout.device_mesh` builds the matching
``torch.distributed.DeviceMesh`` when a process group exists.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlcore._checks import check_positive

__all__ = [
    "MESH_DIMS",
    "Layout",
    "Placement",
    "decoder_layout",
    "decoder_param_meta",
    "infer_dp",
    "param_meta",
]

MESH_DIMS = ("pp", "dp", "ep", "cp", "tp")

_COLUMN = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj|qkv_proj|gate_up_proj)\.(weight|bias)$")
_ROW = re.compile(r"(o_proj|down_proj)\.weight$")
_VOCAB = re.compile(r"(embed_tokens|lm_head)\.weight$")
_EXPERTS = re.compile(r"\.experts\.[a-z_]+$")
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one parameter lives: the tensor dims split over ``tp`` and ``ep``, and its stage.

    ``Placement(tp=0)`` is column-parallel (``Shard(0)`` over ``tp``), ``Placement(tp=1)``
    row-parallel, ``Placement()`` replicated, ``Placement(ep=0)`` expert-sharded on the
    stacked expert dimension. ``stage`` is the pipeline stage holding the parameter
    (``None`` when the layout has no pipeline).

    >>> Placement(tp=0, stage=1)
    Placement(tp=0, ep=None, stage=1)
    """

    tp: int | None = None
    ep: int | None = None
    stage: int | None = None

    def __post_init__(self) -> None:
        for dim in ("tp", "ep", "stage"):
            v = getattr(self, dim)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ValueError(f"{dim}: got {v!r}, expected None or a non-negative int")
        if self.tp is not None and self.ep is not None:
            raise ValueError(
                f"placement: got tp={self.tp} and ep={self.ep}, expected at most one "
                "(expert weights are split over ep only)"
            )


def param_meta(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Shape-and-dtype stand-ins (``meta`` tensors) for ``params``; no storage is allocated.

    >>> param_meta({"w": torch.zeros(2, 3)})["w"]
    tensor(..., device='meta', size=(2, 3))
    """
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in params.items()}


def decoder_param_meta(
    *,
    layers: int,
    hidden: int,
    intermediate: int,
    vocab: int,
    kv_hidden: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """``meta`` stand-ins for a Llama/Qwen-style decoder's parameters, under Hugging Face names.

    For planning layouts and memory of models too large to allocate. ``kv_hidden`` is
    the width of the k/v projections (``num_key_value_heads * head_dim``; ``hidden``
    when ``None``). TinyLlama-1.1B is ``layers=22, hidden=2048, intermediate=5632,
    vocab=32000, kv_hidden=256``.

    >>> meta = decoder_param_meta(layers=2, hidden=8, intermediate=16, vocab=32, kv_hidden=4)
    >>> meta["model.layers.1.self_attn.k_proj.weight"].shape, len(meta)
    (torch.Size([4, 8]), 21)
    """
    kv = hidden if kv_hidden is None else kv_hidden
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (intermediate, hidden),
                p + "mlp.up_proj.weight": (intermediate, hidden),
                p + "mlp.down_proj.weight": (hidden, intermediate),
            }
        )
    return {n: torch.empty(s, dtype=dtype, device="meta") for n, s in shapes.items()}


def _shape(meta: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in meta.shape)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh (``pp × dp × ep × cp × tp`` ranks) and a :class:`Placement` per parameter name.

    Weights are replicated over ``cp`` (as over ``dp``); a placement never splits them there.

    >>> lay = Layout(placements={"w": Placement(tp=0)}, tp=2, dp=2)
    >>> lay.world_size, lay.coords(3)
    (4, {'pp': 0, 'dp': 1, 'ep': 0, 'cp': 0, 'tp': 1})
    >>> lay.local_shape("w", (8, 4))
    (4, 4)
    """

    placements: Mapping[str, Placement]
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for dim in MESH_DIMS:
            v = getattr(self, dim)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{dim}: got {v!r}, expected a positive int (a mesh dimension size)")
        for name, p in self.placements.items():
            if not isinstance(p, Placement):
                raise ValueError(f"placements[{name!r}]: got {type(p).__name__}, expected a Placement")
            bad_stage = (self.pp > 1 and p.stage is None) or (p.stage is not None and p.stage >= self.pp)
            if bad_stage:
                raise ValueError(
                    f"placements[{name!r}]: got stage {p.stage}, expected a stage in [0, {self.pp}) as pp={self.pp}"
                )

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in MESH_DIMS)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    def describe(self) -> str:
        """``"pp=2 × dp=1 × ep=1 × cp=1 × tp=2"``."""
        return " × ".join(f"{d}={getattr(self, d)}" for d in MESH_DIMS)

    def coords(self, rank: int) -> dict[str, int]:
        """The mesh coordinates of global ``rank`` (row-major over ``pp, dp, ep, tp``)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank: got {rank}, expected a rank in [0, {self.world_size})")
        out = {}
        for dim, size in zip(reversed(MESH_DIMS), reversed(self.mesh_shape)):
            out[dim] = rank % size
            rank //= size
        return {d: out[d] for d in MESH_DIMS}

    def holds(self, name: str, rank: int) -> bool:
        """Whether ``rank`` holds (a shard of) parameter ``name``: it sits on the parameter's stage."""
        stage = self.placements[name].stage
        return stage is None or self.coords(rank)["pp"] == stage

    def local_shape(self, name: str, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of a rank's shard of parameter ``name`` whose full shape is ``shape``."""
        out = list(shape)
        p = self.placements[name]
        for dim in ("tp", "ep"):
            tdim = getattr(p, dim)
            if tdim is not None:
                out[tdim] //= getattr(self, dim)
        return tuple(out)

    def local_index(self, name: str, rank: int) -> dict[int, tuple[int, int]]:
        """Per split tensor dim, ``(chunk index, number of chunks)`` of ``rank``'s shard."""
        p, c = self.placements[name], self.coords(rank)
        return {getattr(p, d): (c[d], getattr(self, d)) for d in ("tp", "ep") if getattr(p, d) is not None}

    def validate(self, param_meta: Mapping[str, Any], *, what: str = "layout") -> None:
        """Check the layout against parameter shapes; ``ValueError`` naming the parameter and sizes.

        Every parameter needs a placement, a split dim the tensor has, and a size there
        divisible by the mesh dimension.
        """
        missing = [n for n in param_meta if n not in self.placements]
        if missing:
            raise ValueError(f"{what}: got no placement for {missing[:3]}, expected one for every parameter")
        extra = [n for n in self.placements if n not in param_meta]
        if extra:
            raise ValueError(f"{what}: got placements for unknown parameters {extra[:3]}, expected names of param_meta")
        for name, meta in param_meta.items():
            shape = _shape(meta)
            p = self.placements[name]
            for dim in ("tp", "ep"):
                tdim = getattr(p, dim)
                if tdim is None:
                    continue
                if tdim >= len(shape):
                    raise ValueError(
                        f"{what}: parameter {name!r} of shape {shape} is split over {dim} on dim {tdim}, "
                        f"expected a dim < {len(shape)}"
                    )
                size = getattr(self, dim)
                if shape[tdim] % size:
                    raise ValueError(
                        f"{what}: parameter {name!r} of shape {shape} has {shape[tdim]} on dim {tdim}, "
                        f"expected a multiple of {dim}={size}"
                    )

    def device_mesh(self, device_type: str) -> Any:
        """The ``DeviceMesh`` of this layout (dims named ``pp, dp, ep, cp, tp``); needs an initialised process group.

        ``mesh["cp"]`` is the context-parallel group, ``mesh["dp"]`` the data-parallel one.
        A launched world size other than :attr:`world_size` is a ``ValueError``.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        if world != self.world_size:
            raise ValueError(
                f"world size: got {world} launched processes, expected {self.world_size} ({self.describe()}); "
                "see rlcore.dataflow.infer_dp for the data-parallel size a world size allows"
            )
        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=MESH_DIMS)


def infer_dp(world_size: int, *, pp: int = 1, ep: int = 1, cp: int = 1, tp: int = 1) -> int:
    """The data-parallel size ``world_size / (pp × ep × cp × tp)``; ``ValueError`` when it does not divide.

    >>> infer_dp(8, cp=2, tp=2)
    2
    """
    for dim, v in (("world_size", world_size), ("pp", pp), ("ep", ep), ("cp", cp), ("tp", tp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{dim}: got {v!r}, expected a positive int")
    inner = pp * ep * cp * tp
    if world_size % inner:
        raise ValueError(
            f"world_size: got {world_size}, expected a multiple of pp × ep × cp × tp = {pp} × {ep} × {cp} × {tp} = "
            f"{inner} (the world does not factor into the mesh)"
        )
    return world_size // inner


def _decoder_placement(name: str, shape: tuple[int, ...], stage: int | None) -> Placement:
    if _EXPERTS.search(name) and len(shape) == 3:
        return Placement(ep=0, stage=stage)
    if _VOCAB.search(name) or _COLUMN.search(name):
        return Placement(tp=0, stage=stage)
    if _ROW.search(name):
        return Placement(tp=1, stage=stage)
    return Placement(stage=stage)


def decoder_layout(
    param_meta: Mapping[str, Any], *, tp: int = 1, pp: int = 1, ep: int = 1, dp: int = 1, cp: int = 1
) -> Layout:
    """The usual Megatron-style layout of a decoder-only model (HF Llama/Qwen/Mixtral names).

    Column-parallel (``Shard(0)`` over tp): ``q/k/v/gate/up_proj`` weights and biases,
    ``embed_tokens`` and ``lm_head`` (vocab-parallel). Row-parallel (``Shard(1)``):
    ``o_proj`` and ``down_proj`` weights. Stacked expert weights ``…experts.<name>`` of
    shape ``[E, …]``: split over ep on dim 0. Everything else (norms, routers, biases
    of row-parallel layers) is replicated. With ``pp > 1`` the ``layers.<i>`` are
    cut into ``pp`` equal contiguous stages, the embedding on the first and the final
    norm and ``lm_head`` on the last. A training layout is ``decoder_layout(meta, tp=4,
    pp=2, dp=…)``, the inference one on the same ranks ``decoder_layout(meta, tp=2,
    dp=…)``.

    Args:
      param_meta: parameter name -> anything with ``.shape`` (a tensor, or a ``meta``
        tensor from :func:`param_meta`).
      tp, pp, ep, dp, cp: mesh dimension sizes (weights are replicated over ``cp``).

    Returns:
      A validated :class:`Layout`.

    >>> meta = {"model.layers.0.self_attn.o_proj.weight": torch.empty(8, 8, device="meta"),
    ...         "model.layers.1.self_attn.q_proj.weight": torch.empty(8, 8, device="meta")}
    >>> lay = decoder_layout(meta, tp=2, pp=2)
    >>> [(p.tp, p.stage) for p in lay.placements.values()]
    [(1, 0), (0, 1)]
    """
    for dim, v in (("tp", tp), ("pp", pp), ("ep", ep), ("dp", dp), ("cp", cp)):
        check_positive(dim, v)
    layers = {int(m.group(1)) for n in param_meta if (m := _LAYER.search(n))}
    num_layers = max(layers) + 1 if layers else 0
    if pp > 1 and (num_layers == 0 or num_layers % pp):
        raise ValueError(f"pp: got {pp}, expected a divisor of the number of layers ({num_layers})")
    per_stage = num_layers // pp if pp > 1 else 0
    placements = {}
    for name, meta in param_meta.items():
        stage = None
        if pp > 1:
            m = _LAYER.search(name)
            if m:
                stage = int(m.group(1)) // per_stage
            elif "embed_tokens" in name:
                stage = 0
            else:
                stage = pp - 1
        placements[name] = _decoder_placement(name, _shape(meta), stage)
    layout = Layout(placements=placements, pp=pp, dp=dp, ep=ep, cp=cp, tp=tp)
    layout.validate(param_meta)
    return layout
