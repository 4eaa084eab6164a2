"""Distillation (sampled-token reverse KL, GKD's generalised JSD) and reward-model losses
(Bradley-Terry with margin and centring, the process reward model's step loss): loop
references, reductions to the KLs, gradients and compilation."""

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rlcore import algos
from rlcore.testing import assert_close, assert_no_host_sync
from rlcore.testing import reference as ref
from rlcore.testing.loss_strategies import policy_batches
from rlcore.testing.strategies import masks


def _scale(x: torch.Tensor) -> float:
    return max(1.0, float(x.abs().max()) if x.numel() else 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=20, deadline=None)
@given(batch=policy_batches(drifts=("none", "small", "large")), stale=st.booleans())
def test_reverse_kl_matches_loop_reference(dtype, batch, stale):
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
    old = batch["old_logp"] if stale else None
    logp = batch["logp"].clone().requires_grad_(True)
    loss, metrics = algos.reverse_kl_distill_loss(logp, batch["ref_logp"], batch["mask"], old_logp=old)
    loss.sum().backward()
    want, want_grad, want_m = ref.reverse_kl_distill_loss_ref(
        batch["logp"], batch["ref_logp"], batch["mask"], old_logp=old
    )
    assert loss.dtype == dtype and logp.grad.dtype == dtype
    assert_close(loss, want, dtype=dtype, scale=_scale(want))
    assert_close(logp.grad, want_grad, dtype=dtype, scale=_scale(want_grad))
    assert_close(metrics["reverse_kl"], torch.tensor(want_m["reverse_kl"]), dtype=torch.float32, scale=10.0)


@settings(max_examples=15, deadline=None)
@given(batch=policy_batches(drifts=("none",), dtype=torch.float64))
def test_reverse_kl_is_k1_in_value_and_k2_in_gradient(batch):
    """On-policy the loss is the k1 estimate of KL(pi || teacher) and its gradient is k2's, the right one."""
    mask = batch["mask"]
    lp1 = batch["logp"].clone().requires_grad_(True)
    loss, _ = algos.reverse_kl_distill_loss(lp1, batch["ref_logp"], mask)
    loss.sum().backward()
    lp2 = torch.where(mask, batch["logp"], 0.0).requires_grad_(True)
    teacher = torch.where(mask, batch["ref_logp"], 0.0)
    k2 = torch.where(mask, algos.kl_penalty(lp2, teacher, estimator="k2"), 0.0)
    k2.sum().backward()
    k1 = torch.where(mask, algos.kl_penalty(lp2.detach(), teacher, estimator="k1"), 0.0)
    torch.testing.assert_close(loss.detach(), k1)
    torch.testing.assert_close(lp1.grad, lp2.grad)


def test_reverse_kl_expected_gradient_is_the_exact_kl_gradient():
    """Averaged over the token the student samples, the gradient is that of KL(pi || teacher)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, 1, 7, generator=g, dtype=torch.float64)
    teacher = torch.randn(1, 1, 7, generator=g, dtype=torch.float64).log_softmax(-1)
    probs = z.softmax(-1).flatten()
    expected = torch.zeros_like(z)
    for v in range(7):
        zv = z.clone().requires_grad_(True)
        logp = zv.log_softmax(-1)[..., v]
        loss, _ = algos.reverse_kl_distill_loss(logp, teacher[..., v], torch.ones(1, 1))
        loss.sum().backward()
        expected += probs[v] * zv.grad
    zx = z.clone().requires_grad_(True)
    lp = zx.log_softmax(-1)
    (lp.exp() * (lp - teacher)).sum().backward()
    torch.testing.assert_close(expected, zx.grad)


@st.composite
def logit_pairs(draw, *, dtype=torch.float32):
    b, t, v = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(2, 8))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([0.5, 3.0]))
    student = scale * torch.randn(b, t, v, generator=g, dtype=torch.float64)
    teacher = scale * torch.randn(b, t, v, generator=g, dtype=torch.float64)
    mask = draw(masks(b, t))
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    student, teacher = (torch.where(mask[..., None], x, nan).to(dtype) for x in (student, teacher))
    return student, teacher, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=15, deadline=None)
@given(
    data=st.data(),
    beta=st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]),
    temperature=st.sampled_from([1.0, 2.0]),
)
def test_generalized_jsd_matches_loop_reference(dtype, data, beta, temperature):
    student, teacher, mask = data.draw(logit_pairs(dtype=dtype))
    top_k = data.draw(st.sampled_from([None, 1, student.shape[-1] // 2 or 1]))
    if top_k is not None:
        # A tie at the k-th teacher logit (bfloat16 rounds many together) makes the support ambiguous.
        top = teacher.double().nan_to_num().sort(-1, descending=True).values
        assume(bool((top[..., top_k - 1] != top[..., top_k]).all()) if top_k < top.shape[-1] else True)
    kw = {"beta": beta, "temperature": temperature, "top_k": top_k}
    s = student.clone().requires_grad_(True)
    loss, metrics = algos.generalized_jsd_loss(s, teacher, mask, **kw)
    loss.sum().backward()
    want = ref.generalized_jsd_loss_ref(student, teacher, mask, **kw)
    assert loss.dtype == dtype and s.grad.dtype == dtype
    assert_close(loss, want, dtype=dtype, scale=_scale(want))
    assert torch.isfinite(s.grad).all() and torch.all(s.grad[~mask] == 0)
    n = int(mask.sum())
    assert_close(metrics["jsd"], want.sum() / max(n, 1), dtype=torch.float32, scale=10 * _scale(want))


@settings(max_examples=20, deadline=None)
@given(pair=logit_pairs(dtype=torch.float64))
def test_generalized_jsd_endpoints_are_the_kls_and_the_interior_tends_to_them_scaled(pair):
    student, teacher, mask = pair
    s, t = student.log_softmax(-1), teacher.log_softmax(-1)
    # TRL's endpoints, through F.kl_div: beta = 0 the forward KL(T || S), beta = 1 the reverse KL(S || T).
    forward = torch.where(mask, F.kl_div(s, t, reduction="none", log_target=True).sum(-1), 0.0)
    reverse = torch.where(mask, F.kl_div(t, s, reduction="none", log_target=True).sum(-1), 0.0)
    torch.testing.assert_close(algos.generalized_jsd_loss(student, teacher, mask, beta=0.0)[0], forward)
    torch.testing.assert_close(algos.generalized_jsd_loss(student, teacher, mask, beta=1.0)[0], reverse)
    small = 1e-8
    near0 = algos.generalized_jsd_loss(student, teacher, mask, beta=small)[0] / small
    near1 = algos.generalized_jsd_loss(student, teacher, mask, beta=1 - small)[0] / small
    torch.testing.assert_close(near0, forward, rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(near1, reverse, rtol=1e-3, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(pair=logit_pairs(dtype=torch.float64), beta=st.sampled_from([0.0, 0.2, 0.5, 1.0]), shift=st.floats(-5, 5))
def test_generalized_jsd_invariances(pair, beta, shift):
    """Swapping the roles swaps beta; shifting logits changes nothing; top-V is the full
    vocabulary; a student equal to its teacher has divergence 0; the divergence is >= 0."""
    student, teacher, mask = pair
    base, _ = algos.generalized_jsd_loss(student, teacher, mask, beta=beta)
    swapped, _ = algos.generalized_jsd_loss(teacher, student, mask, beta=1.0 - beta)
    torch.testing.assert_close(swapped, base)
    torch.testing.assert_close(algos.generalized_jsd_loss(student + shift, teacher, mask, beta=beta)[0], base)
    full_k = algos.generalized_jsd_loss(student, teacher, mask, beta=beta, top_k=student.shape[-1])[0]
    torch.testing.assert_close(full_k, base)
    same, _ = algos.generalized_jsd_loss(teacher, teacher, mask, beta=beta)
    assert torch.all(same.abs() < 1e-12) and torch.all(base >= -1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_generalized_jsd_a_masked_vocabulary_entry_adds_nothing(dtype, beta):
    """A logit of -inf on both sides (a masked vocabulary entry, p = 0) leaves the value and the
    gradient of the other entries as without it, and gets gradient 0 (not nan)."""
    g = torch.Generator().manual_seed(6)
    student = torch.randn(2, 3, 5, generator=g).to(dtype)
    teacher = torch.randn(2, 3, 5, generator=g).to(dtype)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    masked_s = torch.cat([student, torch.full((2, 3, 1), -torch.inf, dtype=dtype)], -1).requires_grad_(True)
    masked_t = torch.cat([teacher, torch.full((2, 3, 1), -torch.inf, dtype=dtype)], -1)
    plain_s = student.clone().requires_grad_(True)
    loss, _ = algos.generalized_jsd_loss(masked_s, masked_t, mask, beta=beta)
    want, _ = algos.generalized_jsd_loss(plain_s, teacher, mask, beta=beta)
    loss.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(masked_s.grad[..., :-1], plain_s.grad)
    assert torch.all(masked_s.grad[..., -1] == 0)


@pytest.mark.parametrize(("beta", "top_k"), [(0.0, None), (0.5, None), (1.0, None), (0.3, 2)])
def test_generalized_jsd_gradcheck_float64(beta, top_k):
    g = torch.Generator().manual_seed(5)
    student = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    teacher = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])

    def fn(s):
        return algos.generalized_jsd_loss(s, teacher, mask, beta=beta, top_k=top_k, temperature=1.5)[0]

    assert torch.autograd.gradcheck(fn, (student.requires_grad_(True),))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=15, deadline=None)
@given(
    b=st.integers(0, 6),
    seed=st.integers(0, 999),
    margin=st.sampled_from(["none", "float", "tensor"]),
    center=st.sampled_from([0.0, 0.01, 1.0]),
)
def test_bradley_terry_matches_loop_reference_and_trl(dtype, b, seed, margin, center):
    g = torch.Generator().manual_seed(seed)
    rw, rl = (4 * torch.randn(b, generator=g)).to(dtype), (4 * torch.randn(b, generator=g)).to(dtype)
    m = {"none": None, "float": 0.5, "tensor": torch.rand(b, generator=g).to(dtype)}[margin]
    rw_grad = rw.clone().requires_grad_(True)
    loss, metrics = algos.bradley_terry_loss(rw_grad, rl, margin=m, center_coef=center)
    want = ref.bradley_terry_loss_ref(rw, rl, margin=m, center_coef=center)
    assert loss.dtype == dtype and loss.shape == (b,)
    assert_close(loss, want, dtype=dtype, scale=_scale(want))
    if b:
        # TRL's RewardTrainer.compute_loss, in float64.
        rw64, rl64 = rw.double(), rl.double()
        mm = 0.0 if m is None else (m.double() if isinstance(m, torch.Tensor) else m)
        trl = -F.logsigmoid(rw64 - rl64 - mm).mean() + center * torch.mean((rw64 + rl64) ** 2)
        assert_close(loss.double().mean(), trl, dtype=dtype, scale=_scale(trl))
        loss.sum().backward()
        # d/d r_w = -sigmoid(-(r_w - r_l - m)) + 2 c (r_w + r_l)
        want_grad = -torch.sigmoid(-(rw64 - rl64 - mm)) + 2 * center * (rw64 + rl64)
        assert_close(rw_grad.grad, want_grad, dtype=dtype, scale=_scale(want_grad))
    torch.testing.assert_close(metrics["accuracies"], (rw > rl).to(dtype))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 999), shift=st.floats(-3, 3))
def test_bradley_terry_margin_and_shift(seed, shift):
    """A margin is a handicap on the chosen reward; without centring, a common shift changes nothing."""
    g = torch.Generator().manual_seed(seed)
    rw, rl, m = torch.randn(5, generator=g), torch.randn(5, generator=g), torch.rand(5, generator=g)
    torch.testing.assert_close(algos.bradley_terry_loss(rw, rl, margin=m)[0], algos.bradley_terry_loss(rw - m, rl)[0])
    torch.testing.assert_close(algos.bradley_terry_loss(rw + shift, rl + shift)[0], algos.bradley_terry_loss(rw, rl)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 4), s=st.integers(1, 6), seed=st.integers(0, 999), soft=st.booleans(), data=st.data())
def test_process_reward_loss_matches_loop_reference(dtype, b, s, seed, soft, data):
    g = torch.Generator().manual_seed(seed)
    mask = data.draw(masks(b, s))
    logits = torch.where(mask, 3 * torch.randn(b, s, generator=g), float("nan")).to(dtype)
    labels = torch.rand(b, s, generator=g) if soft else (torch.rand(b, s, generator=g) > 0.5).float()
    z = logits.clone().requires_grad_(True)
    loss, metrics = algos.process_reward_loss(z, labels.to(dtype), mask)
    loss.sum().backward()
    want = ref.process_reward_loss_ref(logits, labels.to(dtype), mask)
    assert_close(loss, want, dtype=dtype, scale=_scale(want))
    assert torch.all(z.grad[~mask] == 0) and torch.isfinite(z.grad).all()
    want_grad = torch.where(mask, torch.sigmoid(logits.double()) - labels.to(dtype).double(), 0.0)
    assert_close(z.grad, want_grad, dtype=dtype)
    right = ((logits.double() > 0) == (labels.to(dtype).double() > 0.5)) & mask
    assert_close(metrics["accuracy"], right.sum() / max(int(mask.sum()), 1), dtype=torch.float32)


def test_bad_inputs_raise_value_error_naming_the_argument():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="teacher_logp"):
        algos.reverse_kl_distill_loss(x, torch.zeros(2, 4), m)
    with pytest.raises(ValueError, match="old_logp"):
        algos.reverse_kl_distill_loss(x, x, m, old_logp=torch.zeros(3))
    logits = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="teacher_logits"):
        algos.generalized_jsd_loss(logits, torch.zeros(2, 3, 5), m)
    with pytest.raises(ValueError, match="mask"):
        algos.generalized_jsd_loss(logits, logits, torch.ones(3, 2))
    with pytest.raises(ValueError, match="beta"):
        algos.generalized_jsd_loss(logits, logits, m, beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        algos.generalized_jsd_loss(logits, logits, m, temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        algos.generalized_jsd_loss(logits, logits, m, top_k=5)
    r = torch.zeros(3)
    with pytest.raises(ValueError, match="rejected_rewards"):
        algos.bradley_terry_loss(r, torch.zeros(4))
    with pytest.raises(ValueError, match="margin"):
        algos.bradley_terry_loss(r, r, margin=torch.zeros(2))
    with pytest.raises(ValueError, match="center_coef"):
        algos.bradley_terry_loss(r, r, center_coef=-1.0)
    with pytest.raises(ValueError, match="labels"):
        algos.process_reward_loss(x, torch.zeros(2, 2), m)


def test_no_host_sync():
    g = torch.Generator().manual_seed(1)
    logp = torch.rand(3, 4, generator=g).log()
    mask = torch.rand(3, 4, generator=g) > 0.3
    assert_no_host_sync(algos.reverse_kl_distill_loss, logp, logp - 0.3, mask, old_logp=logp + 0.1)
    logits = torch.randn(3, 4, 6, generator=g)
    teacher = torch.randn(3, 4, 6, generator=g)
    for beta in (0.0, 0.5, 1.0):  # the endpoints take their own paths (1: a fused autograd function)
        fn = functools.partial(algos.generalized_jsd_loss, beta=beta, top_k=3 if beta == 0.5 else None)
        assert_no_host_sync(fn, logits, teacher, mask)
    r = torch.randn(5, generator=g)
    assert_no_host_sync(functools.partial(algos.bradley_terry_loss, center_coef=0.01), r, r.flip(0), margin=r.abs())
    assert_no_host_sync(algos.process_reward_loss, logits[..., 0], (logits[..., 1] > 0).float(), mask)
