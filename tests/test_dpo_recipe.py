"""The DPO family: the model half (``rlcore.models.preference_logps``, padded or packed, one stacked
forward, label shift) and the tensor-in recipe (``rlcore.algos.DPO``: loss, global counts, reduction)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import algos
from rlcore.algos import DPO, DPO_LOSS_TYPES, dpo, dpo_loss
from rlcore.models import from_hf, load_causal_lm, preference_logps
from rlcore.testing import assert_close, assert_no_host_sync
from rlcore.testing.reference import dpo_step_ref, pair_logps_ref
from tiny_runs import tiny_qwen2

VOCAB = 40
SIDES = ("chosen", "rejected")


class CausalBag(torch.nn.Module):
    """A tiny causal LM: each position sees the running mean of the embeddings up to it."""

    def __init__(self, seed=0, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, 16, generator=g, dtype=dtype))
        self.out = torch.nn.Parameter(torch.randn(16, VOCAB, generator=g, dtype=dtype) / 2)

    def forward(self, ids, attention_mask):
        h = self.emb[ids.clamp(min=0)] * attention_mask.unsqueeze(-1).to(self.emb.dtype)
        steps = torch.arange(1, ids.shape[1] + 1, dtype=h.dtype, device=h.device)
        return torch.tanh(h.cumsum(1) / steps.unsqueeze(-1)) @ self.out


def _side(g, b, length, pad_id):
    lengths = torch.randint(2, length + 1, (b,), generator=g)
    prompts = torch.randint(1, 3, (b,), generator=g).minimum(lengths - 1)
    pos = torch.arange(length)
    attention = (pos < lengths[:, None]).long()
    mask = (pos >= prompts[:, None]) & attention.bool()
    ids = torch.randint(0, VOCAB, (b, length), generator=g)
    return torch.where(attention.bool(), ids, pad_id), attention, mask


def make_batch(seed, b=3, chosen_len=7, rejected_len=5, pad_id=0):
    g = torch.Generator().manual_seed(seed)
    batch = {}
    for side, length in (("chosen", chosen_len), ("rejected", rejected_len)):
        ids, attention, mask = _side(g, b, length, pad_id)
        batch.update({f"{side}_input_ids": ids, f"{side}_attention_mask": attention, f"{side}_mask": mask})
    return batch


def concatenated_logps(model, batch, *, reduce="sum", temperature=1.0):
    """The padded path with a ``model(ids, attention_mask)`` callable, reduced like ``sequence_logps``."""
    out = preference_logps(lambda _, ids, am: model(ids, am), None, batch, packed=False, temperature=temperature)
    return _reduced(out, reduce)


def packed_logps(apply, params, batch, *, reduce="sum", temperature=1.0):
    return _reduced(preference_logps(apply, params, batch, temperature=temperature), reduce)


def _reduced(out, reduce):
    sides = []
    for side in SIDES:
        logps, n = out[f"{side}_logps"], out[f"{side}_lengths"]
        sides.append(logps / n.clamp(min=1) if reduce == "mean" else logps)
    return sides[0], sides[1]


def _columns(policy, batch, reference=None, *, packed=False):
    """The recipe's batch: the policy's forward, plus reference columns from the batch or a no-grad forward."""
    if packed:
        out = preference_logps(*policy, batch)
    else:
        out = preference_logps(lambda _, ids, am: policy(ids, am), None, batch, packed=False)
    columns = dict(batch, **out)
    if reference is not None:
        with torch.no_grad():
            if packed:
                ref = preference_logps(*reference, batch)
            else:
                ref = preference_logps(lambda _, ids, am: reference(ids, am), None, batch, packed=False)
        columns.update(ref_chosen_logps=ref["chosen_logps"], ref_rejected_logps=ref["rejected_logps"])
    return columns


def step(recipe, policy, batch, reference=None, *, num_pairs=None, packed=False):
    """What an update stage does for a DPO recipe: forward, then ``recipe.loss``."""
    return recipe.loss(_columns(policy, batch, reference, packed=packed), num_pairs=num_pairs)


batches = st.builds(
    make_batch,
    seed=st.integers(0, 10_000),
    b=st.integers(1, 4),
    chosen_len=st.integers(2, 9),
    rejected_len=st.integers(2, 9),
)


@settings(max_examples=20)
@given(batch=batches, reduce=st.sampled_from(["sum", "mean"]), temperature=st.sampled_from([1.0, 0.7]))
def test_concatenated_logps_match_one_sequence_at_a_time(batch, reduce, temperature):
    model = CausalBag()
    chosen, rejected = concatenated_logps(model, batch, reduce=reduce, temperature=temperature)
    want_c, want_r = pair_logps_ref(model, batch, reduce=reduce, temperature=temperature)
    assert chosen.dtype == torch.float32 and chosen.shape == want_c.shape
    assert_close(chosen, want_c.detach(), dtype=torch.float32, scale=20.0)
    assert_close(rejected, want_r.detach(), dtype=torch.float32, scale=20.0)


def test_bfloat16_model_sums_in_float32():
    model = CausalBag(dtype=torch.bfloat16)
    batch = make_batch(3, b=4, chosen_len=9, rejected_len=6)
    chosen, rejected = concatenated_logps(model, batch)
    want_c, want_r = pair_logps_ref(model, batch)
    assert chosen.dtype == torch.float32
    assert_close(chosen, want_c.detach(), dtype=torch.bfloat16, scale=10.0)
    assert_close(rejected, want_r.detach(), dtype=torch.bfloat16, scale=10.0)


def test_padding_ids_need_not_be_tokens():
    model = CausalBag()
    clean = concatenated_logps(model, make_batch(5, pad_id=0))
    odd = concatenated_logps(model, make_batch(5, pad_id=-1))
    assert torch.equal(clean[0], odd[0]) and torch.equal(clean[1], odd[1])


def test_one_forward_sees_chosen_then_rejected_padded_to_one_length():
    seen = {}

    def model(ids, attention_mask):
        seen.update(input_ids=ids, attention_mask=attention_mask)
        return torch.zeros(*ids.shape, VOCAB)

    batch = make_batch(2, b=2, chosen_len=4, rejected_len=6)
    concatenated_logps(model, batch)
    for key in ("input_ids", "attention_mask"):
        want = torch.cat([torch.nn.functional.pad(batch[f"chosen_{key}"], (0, 2)), batch[f"rejected_{key}"]])
        assert torch.equal(seen[key], want)


def test_label_shift_by_hand():
    # Logits at position t put all mass on token t + 1, so the scored tokens that equal
    # their position get log-prob 0 and the others -inf-ish (here -20 below).
    def model(ids, attention_mask):
        t = torch.arange(ids.shape[1])
        return torch.nn.functional.one_hot((t + 1) % 4, 4).float().expand(ids.shape[0], -1, -1) * 20.0

    ids = torch.tensor([[0, 1, 2, 3]])
    wrong = torch.tensor([[0, 1, 0, 3]])
    one = torch.ones_like(ids)
    scored = torch.tensor([[0, 1, 1, 1]])
    batch = {
        "chosen_input_ids": ids,
        "chosen_attention_mask": one,
        "chosen_mask": scored,
        "rejected_input_ids": wrong,
        "rejected_attention_mask": one,
        "rejected_mask": scored,
    }
    chosen, rejected = concatenated_logps(model, batch)
    expected_miss = -20.0 - math.log(1 + 3 * math.exp(-20.0))
    assert_close(chosen, torch.tensor([-3 * math.log(1 + 3 * math.exp(-20.0))]), dtype=torch.float32)
    assert_close(
        rejected, torch.tensor([expected_miss - 2 * math.log(1 + 3 * math.exp(-20.0))]), dtype=torch.float32, scale=20.0
    )


@pytest.mark.parametrize(
    ("loss_type", "reduce"), [("sigmoid", "sum"), ("ipo", "mean"), ("hinge", "sum"), ("apo_zero", "sum")]
)
@settings(max_examples=8)
@given(batch=batches, seed=st.integers(1, 100))
def test_step_matches_reference_with_model_or_columns(loss_type, reduce, batch, seed):
    policy, reference = CausalBag(0), CausalBag(seed)
    recipe = dpo(beta=0.5, loss_type=loss_type, reduce=reduce)
    loss, metrics = step(recipe, policy, batch, reference)
    want = dpo_step_ref(policy, batch, reference, beta=0.5, loss_type=loss_type, reduce=reduce)
    assert loss.shape == () and loss.requires_grad
    assert_close(
        loss.detach(), torch.tensor(want, dtype=torch.float64), dtype=torch.float32, scale=10 * max(1, abs(want))
    )
    ref_c, ref_r = concatenated_logps(reference, batch)  # summed: the recipe applies reduce
    columns = dict(batch, ref_chosen_logps=ref_c, ref_rejected_logps=ref_r)
    from_columns, m2 = step(recipe, policy, columns)
    assert torch.equal(from_columns, loss)
    assert all(torch.equal(metrics[k], m2[k]) for k in metrics)


def test_policy_equal_to_reference_gives_log2_and_only_the_policy_gets_gradients():
    policy, reference = CausalBag(0), CausalBag(0)
    loss, metrics = step(dpo(), policy, make_batch(1, b=4), reference)
    assert_close(loss.detach(), torch.tensor(math.log(2.0)), dtype=torch.float32)
    assert float(metrics["margins"]) == 0.0 and float(metrics["accuracies"]) == 0.0
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in policy.parameters())
    assert any(p.grad.abs().sum() > 0 for p in policy.parameters())
    assert all(p.grad is None for p in reference.parameters())
    assert all(not v.requires_grad for v in metrics.values())


@settings(max_examples=5)
@given(batch=batches)
def test_gradients_match_per_sequence_forwards(batch):
    policy, reference = CausalBag(0, torch.float64), CausalBag(7, torch.float64)
    loss, _ = step(dpo(beta=0.3), policy, batch, reference)
    got = torch.autograd.grad(loss, list(policy.parameters()))
    pc, pr = pair_logps_ref(policy, batch)
    with torch.no_grad():
        rc, rr = pair_logps_ref(reference, batch)
    want_loss = dpo_loss(pc, pr, rc, rr, beta=0.3)[0].mean()
    want = torch.autograd.grad(want_loss, list(policy.parameters()))
    for g, w in zip(got, want):
        assert_close(g, w, dtype=torch.float32)


def test_num_pairs_sets_the_denominator():
    policy, reference = CausalBag(0), CausalBag(1)
    batch = make_batch(2, b=3)
    local, _ = step(dpo(), policy, batch, reference)
    global_, _ = step(dpo(), policy, batch, reference, num_pairs=12)
    as_tensor, _ = step(dpo(), policy, batch, reference, num_pairs=torch.tensor(12))
    assert torch.equal(as_tensor, global_)
    assert_close(global_.detach(), local.detach() * 3 / 12, dtype=torch.float32)


def test_replacing_the_loss_composes():
    def squared_margin(pc, pr, rc, rr):
        h = (pc - rc) - (pr - rr)
        return h**2, {"h": h.detach()}

    policy, reference = CausalBag(0), CausalBag(1)
    batch = make_batch(4)
    loss, metrics = step(DPO()._replace(pair_loss=squared_margin), policy, batch, reference)
    pc, pr = concatenated_logps(policy, batch)
    rc, rr = concatenated_logps(reference, batch)
    assert_close(loss.detach(), (((pc - rc) - (pr - rr)) ** 2).mean().detach(), dtype=torch.float32, scale=10.0)
    assert set(metrics) == {"h", "logps_chosen", "logps_rejected"}


def test_step_has_no_host_sync():
    policy, reference = CausalBag(0), CausalBag(1)
    recipe = dpo(loss_type="ipo", reduce="mean")
    assert_no_host_sync(lambda *args: step(recipe, *args), policy, make_batch(6), reference)
    columns = _columns(policy, make_batch(6), reference)
    assert_no_host_sync(lambda b: recipe.loss(b, **recipe.global_counts(b)), columns)


def test_tiny_qwen2_one_forward_matches_separate_sequences():
    import transformers  # in the test extra: missing is a failure, not a skip

    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    lm = transformers.Qwen2ForCausalLM(config).eval()

    def model(ids, attention_mask):
        return lm(input_ids=ids, attention_mask=attention_mask).logits

    batch = make_batch(9, b=3, chosen_len=8, rejected_len=5)
    chosen, rejected = concatenated_logps(model, batch)
    want_c, want_r = pair_logps_ref(model, batch)
    assert_close(chosen.detach(), want_c.detach(), dtype=torch.float32, scale=30.0)
    assert_close(rejected.detach(), want_r.detach(), dtype=torch.float32, scale=30.0)


def test_bad_input():
    policy = CausalBag()
    batch = make_batch(0)
    with pytest.raises(ValueError) as err:
        dpo(loss_type="dpo")
    assert all(repr(t) in str(err.value) for t in DPO_LOSS_TYPES)
    with pytest.raises(ValueError, match="reduce"):
        dpo(reduce="max")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo(loss_type="exo_pair")
    with pytest.raises(ValueError, match="expected 'ref_chosen_logps', 'ref_rejected_logps'"):
        step(dpo(), policy, batch)
    with pytest.raises(ValueError, match="expected 'ref_rejected_logps'"):
        step(dpo(), policy, dict(batch, ref_chosen_logps=torch.zeros(3)))
    with pytest.raises(ValueError, match="ref_rejected_logps: got shape \\(2\\), expected \\(3\\)"):
        step(dpo(), policy, dict(batch, ref_chosen_logps=torch.zeros(3), ref_rejected_logps=torch.zeros(2)))
    with pytest.raises(ValueError, match="expected 'chosen_lengths', 'rejected_lengths'"):
        columns = {k: torch.zeros(3) for k in algos.PAIR_LOGP_COLUMNS}
        dpo(reduce="mean").loss(columns)
    with pytest.raises(ValueError, match="to count the pairs"):
        dpo().global_counts({"mask": torch.ones(2, 2)})
    with pytest.raises(ValueError, match="batch: missing rejected_mask"):
        concatenated_logps(policy, {k: v for k, v in batch.items() if k != "rejected_mask"})
    with pytest.raises(ValueError, match="rejected_input_ids: got shape \\(2, 5\\), expected \\(3, \\*\\)"):
        concatenated_logps(
            policy,
            dict(
                batch,
                rejected_input_ids=batch["rejected_input_ids"][:2],
                rejected_attention_mask=batch["rejected_attention_mask"][:2],
                rejected_mask=batch["rejected_mask"][:2],
            ),
        )
    with pytest.raises(ValueError, match="chosen_mask: got shape"):
        concatenated_logps(policy, dict(batch, chosen_mask=batch["chosen_mask"][:, :3]))
    with pytest.raises(ValueError, match="chosen_input_ids.*integer"):
        concatenated_logps(policy, dict(batch, chosen_input_ids=batch["chosen_input_ids"].float()))
    with pytest.raises(ValueError, match="logits: got shape"):
        concatenated_logps(lambda ids, am: torch.zeros(ids.shape[0], 3, 4), batch)
    for bad in (-1, float("nan"), True, torch.tensor(-2), torch.ones(2)):
        with pytest.raises(ValueError, match="num_pairs"):
            step(dpo(), policy, batch, policy, num_pairs=bad)


TINY_QWEN2 = tiny_qwen2(VOCAB)


def _qwen2(seed, dtype=torch.float32):
    # Eager attention: the padded path shares no attention code with the packed one.
    lm = load_causal_lm(TINY_QWEN2, dtype=dtype, seed=seed)
    lm.set_attn_implementation("eager")
    return lm.eval()


def _padded(lm):
    return lambda ids, am: lm(input_ids=ids, attention_mask=am).logits


@pytest.fixture(scope="module")
def qwen2_pair():
    return _qwen2(0), _qwen2(1)


@settings(max_examples=8, deadline=None)
@given(batch=batches, reduce=st.sampled_from(["sum", "mean"]), temperature=st.sampled_from([1.0, 0.7]))
def test_packed_logps_match_one_sequence_at_a_time(qwen2_pair, batch, reduce, temperature):
    lm = qwen2_pair[0]
    apply, params = from_hf(lm)
    with torch.no_grad():
        chosen, rejected = packed_logps(apply, params, batch, reduce=reduce, temperature=temperature)
        want_c, want_r = pair_logps_ref(_padded(lm), batch, reduce=reduce, temperature=temperature)
    assert chosen.dtype == torch.float32 and chosen.shape == want_c.shape
    assert_close(chosen, want_c, dtype=torch.float32, scale=20.0)
    assert_close(rejected, want_r, dtype=torch.float32, scale=20.0)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_packed_step_equals_padded_step_values_and_gradients(dtype, tol):
    policy, reference = _qwen2(0, dtype), _qwen2(1, dtype)
    # Unequal sides (the padded pass pads rejected to 9) and ragged lengths within each.
    batch = make_batch(11, b=4, chosen_len=9, rejected_len=4)
    recipe = dpo(beta=0.5)
    loss, metrics = step(recipe, from_hf(policy), batch, from_hf(reference), packed=True)
    loss.backward()
    got = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad(set_to_none=True)
    want, want_metrics = step(recipe, _padded(policy), batch, _padded(reference))
    want.backward()
    assert loss.dtype == want.dtype == torch.float32
    torch.testing.assert_close(loss, want, rtol=tol, atol=tol)
    assert set(metrics) == set(want_metrics)
    for k in metrics:
        torch.testing.assert_close(metrics[k], want_metrics[k], rtol=tol, atol=tol * 10, msg=k)
    assert all(p.grad is None for p in reference.parameters())
    for name, p in policy.named_parameters():
        scale = max(1.0, float(p.grad.abs().max()))
        torch.testing.assert_close(got[name].float(), p.grad.float(), rtol=tol, atol=tol * scale, msg=name)
    assert any(g.abs().sum() > 0 for g in got.values())


def test_packed_step_runs_one_row_of_the_real_tokens(qwen2_pair):
    apply, params = from_hf(qwen2_pair[0])
    rows = []

    class Recording:
        output_weight = staticmethod(apply.output_weight)

        def __call__(self, params, input_ids, **kwargs):
            rows.append((input_ids, kwargs["cu_seqlens"]))
            return apply(params, input_ids, **kwargs)

    batch = make_batch(4, b=3, chosen_len=8, rejected_len=3)
    ref_c, ref_r = concatenated_logps(_padded(qwen2_pair[1]), batch)
    columns = dict(batch, ref_chosen_logps=ref_c.detach(), ref_rejected_logps=ref_r.detach())
    loss, _ = step(dpo(), (Recording(), params), columns, packed=True)
    want, _ = step(dpo(), _padded(qwen2_pair[0]), columns)
    assert_close(loss.detach(), want.detach(), dtype=torch.float32)
    (ids, cu), *more = rows
    assert not more
    sides = [(batch[f"{s}_input_ids"], batch[f"{s}_attention_mask"].bool()) for s in SIDES]
    assert torch.equal(ids, torch.cat([side_ids[real] for side_ids, real in sides]))
    lengths = torch.cat([real.sum(1) for _, real in sides])
    assert torch.equal(cu.long(), torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))


def test_packed_padding_ids_need_not_be_tokens(qwen2_pair):
    apply, params = from_hf(qwen2_pair[0])
    with torch.no_grad():
        clean = packed_logps(apply, params, make_batch(5, pad_id=0))
        odd = packed_logps(apply, params, make_batch(5, pad_id=-1))
    assert torch.equal(clean[0], odd[0]) and torch.equal(clean[1], odd[1])


def test_packed_bad_input(qwen2_pair):
    pair = from_hf(qwen2_pair[0])
    batch = make_batch(0)
    with pytest.raises(ValueError, match="packed: got 'yes', expected True or False"):
        preference_logps(*pair, batch, packed="yes")
    with pytest.raises(ValueError, match="apply: got function without an output_weight.*packed=False"):
        preference_logps(lambda p, ids, am: None, None, batch)
    with pytest.raises(ValueError, match="apply: got tuple, expected apply\\(params, input_ids, attention_mask\\)"):
        preference_logps(pair, None, batch, packed=False)
    with pytest.raises(ValueError, match="batch: missing rejected_mask"):
        preference_logps(*pair, {k: v for k, v in batch.items() if k != "rejected_mask"})


def test_reprobe_negative_pair_lengths_are_refused_naming_the_column():
    # reduce="mean" clamped a negative count to 1 and scored the pair as if it were one token long.
    columns = {k: torch.zeros(2) for k in algos.PAIR_LOGP_COLUMNS}
    columns |= {"chosen_lengths": torch.tensor([3, 4]), "rejected_lengths": torch.tensor([2, -1])}
    with pytest.raises(ValueError, match=r"rejected_lengths: got values in \[-1, 2\], expected counts >= 0"):
        dpo(reduce="mean").loss(columns)
