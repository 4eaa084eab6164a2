import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.dataflow.layout import MESH_DIMS, Layout, Placement, decoder_layout, param_meta
from rlcore.testing.reference.resharding import local_shard_ref

H = 8
SHAPES = {
    "model.embed_tokens.weight": (32, H),
    "model.layers.0.input_layernorm.weight": (H,),
    "model.layers.0.self_attn.q_proj.weight": (H, H),
    "model.layers.0.self_attn.q_proj.bias": (H,),
    "model.layers.0.self_attn.o_proj.weight": (H, H),
    "model.layers.1.mlp.up_proj.weight": (2 * H, H),
    "model.layers.1.mlp.down_proj.weight": (H, 2 * H),
    "model.layers.1.mlp.gate.weight": (4, H),
    "model.layers.1.mlp.experts.gate_up_proj": (4, H, 4 * H),
    "model.norm.weight": (H,),
    "lm_head.weight": (32, H),
}
META = {n: torch.empty(s, device="meta") for n, s in SHAPES.items()}


def test_decoder_layout_places_each_kind_of_weight():
    lay = decoder_layout(META, tp=2, ep=2)
    got = {n: (p.tp, p.ep) for n, p in lay.placements.items()}
    assert got == {
        "model.embed_tokens.weight": (0, None),
        "model.layers.0.input_layernorm.weight": (None, None),
        "model.layers.0.self_attn.q_proj.weight": (0, None),
        "model.layers.0.self_attn.q_proj.bias": (0, None),
        "model.layers.0.self_attn.o_proj.weight": (1, None),
        "model.layers.1.mlp.up_proj.weight": (0, None),
        "model.layers.1.mlp.down_proj.weight": (1, None),
        "model.layers.1.mlp.gate.weight": (None, None),
        "model.layers.1.mlp.experts.gate_up_proj": (None, 0),
        "model.norm.weight": (None, None),
        "lm_head.weight": (0, None),
    }
    assert all(p.stage is None for p in lay.placements.values())


def test_pipeline_stages_cut_layers_contiguously():
    lay = decoder_layout(META, pp=2)
    stages = {n: p.stage for n, p in lay.placements.items()}
    assert stages["model.embed_tokens.weight"] == 0
    assert stages["model.layers.0.self_attn.o_proj.weight"] == 0
    assert stages["model.layers.1.mlp.up_proj.weight"] == 1
    assert stages["model.norm.weight"] == 1 and stages["lm_head.weight"] == 1
    assert lay.holds("lm_head.weight", 1) and not lay.holds("lm_head.weight", 0)


@given(st.sampled_from([1, 2]), st.sampled_from([1, 2, 3]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]))
def test_coords_are_a_bijection_with_tp_innermost(pp, dp, ep, tp):
    lay = Layout({}, pp=pp, dp=dp, ep=ep, tp=tp)
    seen = set()
    for r in range(lay.world_size):
        c = lay.coords(r)
        assert c["tp"] == r % tp
        assert r == ((c["pp"] * dp + c["dp"]) * ep + c["ep"]) * tp + c["tp"]
        seen.add(tuple(c[d] for d in MESH_DIMS))
    assert len(seen) == lay.world_size == pp * dp * ep * tp


@settings(max_examples=20)
@given(st.sampled_from([dict(tp=2), dict(tp=4), dict(ep=2, dp=2), dict(ep=4), dict(tp=2, ep=2)]))
def test_shards_of_one_group_tile_the_full_tensor(sizes):
    full = {n: torch.arange(math.prod(s), dtype=torch.float32).reshape(s) for n, s in SHAPES.items()}
    lay = decoder_layout(param_meta(full), **sizes)
    for name, t in full.items():
        shards = [local_shard_ref(t, lay, name, r) for r in range(lay.world_size)]
        assert all(s.shape == lay.local_shape(name, t.shape) for s in shards)
        index = lay.local_index(name, 0)
        if not index:
            assert all(torch.equal(s, t) for s in shards)
            continue
        ((tdim, (_, n)),) = index.items()
        mesh_dim = "tp" if lay.placements[name].tp is not None else "ep"
        pieces = {lay.coords(r)[mesh_dim]: s for r, s in enumerate(shards)}
        assert torch.equal(torch.cat([pieces[c] for c in range(n)], dim=tdim), t)


def test_param_meta_allocates_nothing():
    meta = param_meta({"w": torch.zeros(3, 2, dtype=torch.bfloat16)})
    assert meta["w"].device.type == "meta" and meta["w"].shape == (3, 2) and meta["w"].dtype == torch.bfloat16


def test_placement_rejects_tp_and_ep_together():
    with pytest.raises(ValueError, match="placement: got tp=0 and ep=0, expected at most one"):
        Placement(tp=0, ep=0)


def test_placement_rejects_negative_dims():
    with pytest.raises(ValueError, match="tp: got -1, expected None or a non-negative int"):
        Placement(tp=-1)


def test_layout_rejects_bad_sizes_and_stages():
    with pytest.raises(ValueError, match="tp: got 0, expected a positive int"):
        Layout({}, tp=0)
    with pytest.raises(ValueError, match=r"placements\['w'\]: got stage None, expected a stage in \[0, 2\) as pp=2"):
        Layout({"w": Placement()}, pp=2)
    with pytest.raises(ValueError, match=r"placements\['w'\]: got stage 2, expected a stage in \[0, 2\)"):
        Layout({"w": Placement(stage=2)}, pp=2)
    with pytest.raises(ValueError, match=r"rank: got 4, expected a rank in \[0, 4\)"):
        Layout({}, tp=4).coords(4)


def test_validate_names_parameter_and_sizes():
    with pytest.raises(
        ValueError,
        match=r"layout: parameter 'model.embed_tokens.weight' of shape \(32, 8\) "
        r"has 32 on dim 0, expected a multiple of tp=3",
    ):
        decoder_layout(META, tp=3)
    with pytest.raises(ValueError, match=r"layout: got no placement for \['b'\]"):
        Layout({"a": Placement()}).validate({"a": META["model.norm.weight"], "b": META["model.norm.weight"]})
    with pytest.raises(ValueError, match=r"layout: got placements for unknown parameters \['z'\]"):
        Layout({"z": Placement()}).validate({})


def test_pipeline_must_divide_the_layers():
    with pytest.raises(ValueError, match=r"pp: got 3, expected a divisor of the number of layers \(2\)"):
        decoder_layout(META, pp=3)
