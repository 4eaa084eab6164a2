import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore import pytree as pt


@pt.dataclass
class Rollout:
    tokens: torch.Tensor
    logp: torch.Tensor
    name: str = pt.static_field(default="r")


def _batch(b=4, t=3):
    return {"x": torch.arange(b * t, dtype=torch.float32).reshape(b, t), "meta": {"ids": torch.arange(b)}}


def test_tree_map_and_leaves_use_rlcore_namespace():
    r = Rollout(torch.ones(2, 3), torch.zeros(2, 3))
    leaves = pt.tree_leaves({"r": r, "n": torch.tensor([1])})
    assert len(leaves) == 3
    doubled = pt.tree_map(lambda x: x * 2, r)
    assert isinstance(doubled, Rollout) and doubled.name == "r"
    assert torch.equal(doubled.tokens, torch.full((2, 3), 2.0))


def test_static_field_is_metadata_not_leaf():
    r = Rollout(torch.ones(2), torch.ones(2), name="policy")
    leaves, spec = pt.tree_flatten(r)
    assert len(leaves) == 2
    rebuilt = pt.tree_unflatten(spec, [leaf + 1 for leaf in leaves])
    assert rebuilt.name == "policy" and torch.equal(rebuilt.logp, torch.full((2,), 2.0))


def test_containers_are_frozen():
    r = Rollout(torch.ones(1), torch.ones(1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.tokens = torch.zeros(1)  # type: ignore[misc]


@given(st.lists(st.integers(0, 5), min_size=1, max_size=5))
def test_split_then_cat_roundtrips(sizes):
    n = sum(sizes)
    tree = _batch(n) if n > 0 else {"x": torch.zeros(0, 3), "meta": {"ids": torch.zeros(0)}}
    parts = pt.tree_split(tree, sizes)
    assert [pt.batch_size(p) for p in parts] == sizes
    back = pt.tree_cat(parts)
    assert torch.equal(back["x"], tree["x"]) and torch.equal(back["meta"]["ids"], tree["meta"]["ids"])


def test_split_by_int_piece_size():
    parts = pt.tree_split(_batch(5), 2)
    assert [pt.batch_size(p) for p in parts] == [2, 2, 1]


def test_split_rejects_wrong_sizes():
    with pytest.raises(ValueError, match=r"sizes: got \[1, 1\] \(sum 2\), expected .* summing to 4"):
        pt.tree_split(_batch(4), [1, 1])


def test_stack_and_index():
    trees = [_batch(2), _batch(2)]
    stacked = pt.tree_stack(trees)
    assert stacked["x"].shape == (2, 2, 3)
    picked = pt.tree_index(_batch(4), torch.tensor([3, 1]))
    assert torch.equal(picked["meta"]["ids"], torch.tensor([3, 1]))
    assert torch.equal(picked["x"][0], torch.tensor([9.0, 10.0, 11.0]))


def test_empty_sequences_rejected():
    with pytest.raises(ValueError, match="trees: got an empty sequence"):
        pt.tree_stack([])
    with pytest.raises(ValueError, match="trees: got an empty sequence"):
        pt.tree_cat([])


def test_batch_size_names_the_bad_leaf():
    bad = {"a": torch.zeros(4, 2), "meta": {"ids": torch.zeros(3)}}
    with pytest.raises(
        ValueError, match=r"leaf \['meta'\]\['ids'\] has leading dimension 3, expected 4 \(that of leaf \['a'\]\)"
    ):
        pt.batch_size(bad)
    with pytest.raises(ValueError, match="0-d"):
        pt.batch_size({"s": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="no tensor leaves"):
        pt.batch_size({"s": "text"})


def test_index_rejects_non_tensor_leaves():
    with pytest.raises(ValueError, match=r"leaf \['name'\] is a str"):
        pt.tree_index({"x": torch.zeros(2), "name": "a"}, 0)


def test_tree_to_and_nbytes():
    tree = {"f": torch.zeros(3, dtype=torch.float32), "i": torch.zeros(3, dtype=torch.int64), "s": "keep"}
    moved = pt.tree_to(tree, "cpu", dtype=torch.bfloat16)
    assert moved["f"].dtype == torch.bfloat16 and moved["i"].dtype == torch.int64 and moved["s"] == "keep"
    assert pt.tree_nbytes(tree) == 3 * 4 + 3 * 8
    assert pt.tree_nbytes(moved) == 3 * 2 + 3 * 8


def test_vmap_sees_through_containers():
    r = Rollout(torch.randn(5, 3), torch.randn(5, 3), name="v")

    def score(ro: Rollout) -> Rollout:
        return Rollout(ro.tokens.sum(), (ro.logp * 2).sum(), name=ro.name)

    out = torch.func.vmap(score)(r)
    assert isinstance(out, Rollout) and out.name == "v"
    torch.testing.assert_close(out.tokens, r.tokens.sum(-1))
    torch.testing.assert_close(out.logp, 2 * r.logp.sum(-1))


def test_compile_sees_through_containers():
    r = Rollout(torch.randn(4, 3), torch.randn(4, 3))

    def f(ro: Rollout) -> Rollout:
        return pt.tree_map(lambda x: x.exp() - 1, ro)

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="eager")(r)
    assert isinstance(out, Rollout)
    torch.testing.assert_close(out.tokens, r.tokens.exp() - 1)


def test_torch_pytree_roundtrip():
    import torch.utils._pytree as tp

    r = Rollout(torch.ones(2), torch.zeros(2), name="t")
    leaves, spec = tp.tree_flatten(r)
    assert len(leaves) == 2
    back = tp.tree_unflatten([leaf + 3 for leaf in leaves], spec)
    assert back.name == "t" and torch.equal(back.tokens, torch.full((2,), 4.0))
