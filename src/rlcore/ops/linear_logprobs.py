"""Token log-probs and entropy straight from last hidden states and the output embedding.

The logits ``hidden @ weight.T`` are never built whole: the forward walks blocks of
``chunk_size`` tokens by ``vocab_chunk_size`` vocabulary entries with an online
(running) log-sum-exp, as in flash-attention's softmax (Milakov & Gimelshein,
arXiv:1805.02867), and keeps three numbers per token; the backward recomputes each
block's logits and accumulates the gradients of ``hidden`` and ``weight`` block by
block. Extra memory is O(chunk_size x vocab_chunk_size) plus the weight gradient;
blocking the vocabulary as well as the tokens keeps every matmul large, where token
chunks alone would have to hold (or re-read) the whole ``[chunk, V]`` logits.
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from rlcore._checks import check_floating, check_ndim, check_tensor
from rlcore.ops.logprobs import (
    check_chunk_size,
    check_labels,
    check_temperature,
    chunks,
    poison_invalid,
)
from rlcore.ops.numerics import acc_dtype

__all__ = ["linear_logprobs"]

DEFAULT_CHUNK_SIZE = 1024
DEFAULT_VOCAB_CHUNK_SIZE = 8192


def _operand(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """A matmul operand: upcast to ``acc`` except on CUDA, whose mm takes narrow operands with a float32 output."""
    return x if x.dtype == acc or x.device.type == "cuda" else x.to(acc)


def _mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``a @ b`` with an ``acc`` result, so the logits never carry bfloat16 rounding (~0.06 at 10)."""
    if a.dtype == b.dtype == acc:
        return a @ b
    # CUDA only (not exercised by the CPU test suite): bfloat16/float16 operands, float32 output.
    narrow = b.dtype if b.dtype != acc else a.dtype
    return torch.mm(a.to(narrow), b.to(narrow), out_dtype=acc)


def _add_mm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` in ``out.dtype``, in place when no cast is needed."""
    if a.dtype == b.dtype == out.dtype:
        out.addmm_(a, b)
    else:
        out += _mm(a, b, out.dtype)


def _label_in_block(labels: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index of the label inside vocabulary block [v0, v1), clamped; whether it is there)``."""
    local = labels.long() - v0
    inside = (local >= 0) & (local < v1 - v0)
    return local.clamp(0, v1 - v0 - 1).unsqueeze(-1), inside.unsqueeze(-1)


_State = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


def _forward_block(
    h: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    v0: int,
    state: _State | None,
    temperature: float,
    want_entropy: bool,
    want_sps: bool = False,
) -> _State:
    """Fold vocabulary block ``[v0, v0 + len(w))`` into the running ``(m, sum e^y, sum e^y y, z_label, sum e^2y)``.

    ``y = (z - m) / T`` is taken against the running max ``m`` of the raw logits. The
    block's ``[chunk, block]`` temporaries die on return.
    """
    z = _mm(h, w.T, acc_dtype(h.dtype))
    idx, inside = _label_in_block(labels, v0, v0 + w.shape[0])
    z_y = z.gather(-1, idx)
    block_max = z.amax(-1, keepdim=True)
    m = block_max if state is None else torch.maximum(state[0], block_max)
    y = z.sub_(m)
    if temperature != 1.0:
        y.div_(temperature)
    ey = torch.exp(y)
    total = ey.sum(-1, keepdim=True)
    pz = (ey.unsqueeze(-2) @ y.unsqueeze(-1)).squeeze(-1) if want_entropy else None
    sq = (ey.unsqueeze(-2) @ ey.unsqueeze(-1)).squeeze(-1) if want_sps else None
    if state is None:
        return m, total, pz, z_y, sq
    m_old, total_old, pz_old, z_label, sq_old = state
    # Move the running sums from the old pivot to the new one:
    # sum e^(y - d) = a sum e^y and sum e^(y - d) (y - d) = a (sum e^y y - d sum e^y),
    # with d = (m - m_old) / T >= 0 and a = e^-d.
    d = (m - m_old) / temperature
    a = torch.exp(-d)
    if want_entropy:
        assert pz is not None and pz_old is not None, "want_entropy: every block folds sum e^y y"
        pz = a * (pz_old - d * total_old) + pz
    if want_sps:  # sum e^(2(y - d)) = a^2 sum e^2y
        assert sq is not None and sq_old is not None, "want_sps: every block folds sum e^2y"
        sq = a * a * sq_old + sq
    return m, a * total_old + total, pz, torch.where(inside, z_y, z_label), sq


def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    chunk_size: int,
    vocab_chunk_size: int,
    want_entropy: bool,
    want_sps: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per token: the max ``m`` of the raw logits, ``lse = log sum exp((z - m) / T)``, logp, H, sum p^2."""
    n, vocab = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    rowmax = hidden.new_empty(n, 1, dtype=acc)
    lse = hidden.new_empty(n, 1, dtype=acc)
    logp = hidden.new_empty(n, dtype=acc)
    ent = hidden.new_empty(n, dtype=acc) if want_entropy else None
    sps = hidden.new_empty(n, dtype=acc) if want_sps else None
    for s, e in chunks(n, chunk_size):
        h = _operand(hidden[s:e], acc)
        state: _State | None = None
        for v0, v1 in chunks(vocab, vocab_chunk_size):
            state = _forward_block(
                h, _operand(weight[v0:v1], acc), labels[s:e], v0, state, temperature, want_entropy, want_sps
            )
        assert state is not None, "the vocabulary is checked non-empty"
        m, total, pz, z_label, sq = state
        lse_c = total.log()
        rowmax[s:e], lse[s:e] = m, lse_c
        logp[s:e] = ((z_label - m) / temperature - lse_c).squeeze(-1)
        if ent is not None:
            assert pz is not None, "want_entropy: the blocks folded sum e^y y"
            ent[s:e] = (lse_c - pz / total).squeeze(-1)
        if sps is not None:
            assert sq is not None, "want_sps: the blocks folded sum e^2y"
            sps[s:e] = (sq / (total * total)).squeeze(-1)
    return rowmax, lse, logp, ent, sps


class _LinearLogprobs(torch.autograd.Function):
    """Outputs ``(logp, entropy?, sum_pi_squared?, rowmax, lse)``; the last two are internal, for the backward.

    ``sum_pi_squared`` has no gradient (a statistic of the policy, read by an advantage estimator).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        chunk_size: int,
        vocab_chunk_size: int,
        want_entropy: bool,
        want_sps: bool,
    ) -> tuple[torch.Tensor, ...]:
        rowmax, lse, logp, ent, sps = _forward(
            hidden, weight, labels, temperature, chunk_size, vocab_chunk_size, want_entropy, want_sps
        )
        return tuple(t for t in (logp, ent, sps) if t is not None) + (rowmax, lse)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        hidden, weight, labels, temperature, chunk_size, vocab_chunk_size, want_entropy, want_sps = inputs
        ctx.opts = (temperature, chunk_size, vocab_chunk_size)
        ctx.want_entropy = want_entropy
        rowmax, lse = output[-2:]
        ctx.mark_non_differentiable(rowmax, lse, *output[-3:-2] if want_sps else ())
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, labels, rowmax, lse, output[1] if want_entropy else None)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[no-untyped-def,override]
        hidden, weight, labels, rowmax, lse, ent = ctx.saved_tensors
        g_logp = grads[0]
        g_ent = grads[1] if ctx.want_entropy else None
        need_h, need_w = ctx.needs_input_grad[:2]
        if (g_logp is None and g_ent is None) or not (need_h or need_w):
            return (None,) * 8
        temperature, chunk, vocab_chunk = ctx.opts
        gh, gw = _backward(
            hidden, weight, labels, rowmax, lse, ent, g_logp, g_ent, temperature, chunk, vocab_chunk, need_h, need_w
        )
        return (gh, gw) + (None,) * 6


def _backward_block(
    h: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    v0: int,
    stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    g1: torch.Tensor | None,
    g2: torch.Tensor | None,
    temperature: float,
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
) -> None:
    """Add one block's contribution to the gradient slices ``grad_h``, ``grad_w`` (in place)."""
    rowmax, lse, ent = stats
    lp = _mm(h, w.T, lse.dtype).sub_(rowmax)
    if temperature != 1.0:
        lp.div_(temperature)
    lp.sub_(lse)
    if g2 is None:
        assert g1 is not None, "the backward runs only with a gradient for logp or the entropy"
        dz = lp.exp_().mul_(-g1)
    else:
        assert ent is not None, "an entropy gradient implies the forward saved the entropy"
        p = torch.exp(lp)
        dz = lp.add_(ent).mul_(g2)
        if g1 is not None:
            dz.add_(g1)
        dz.mul_(p).neg_()
    if g1 is not None:
        idx, inside = _label_in_block(labels, v0, v0 + w.shape[0])
        dz.scatter_add_(-1, idx, torch.where(inside, g1, 0.0))
    if grad_h is not None:
        _add_mm_(grad_h, dz, w)
    if grad_w is not None:
        _add_mm_(grad_w, dz.T, h)


def _backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    rowmax: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    g_logp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    temperature: float,
    chunk_size: int,
    vocab_chunk_size: int,
    need_h: bool,
    need_w: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Recompute each block's logits; ``dz = (onehot(y) g1 - p (g1 + g2 (log p + H))) / T``.

    Then ``d hidden = dz @ weight`` and ``d weight = dz.T @ hidden``, accumulated over
    blocks in the accumulation dtype.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    acc = lse.dtype
    inv_t = 1.0 / temperature
    grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
    for s, e in chunks(n, chunk_size):
        h = _operand(hidden[s:e], acc)
        g1 = g_logp[s:e].to(acc).unsqueeze(-1) * inv_t if g_logp is not None else None
        g2 = g_ent[s:e].to(acc).unsqueeze(-1) * inv_t if g_ent is not None else None
        stats = (rowmax[s:e], lse[s:e], ent[s:e].unsqueeze(-1) if ent is not None else None)
        for v0, v1 in chunks(vocab, vocab_chunk_size):
            _backward_block(
                h,
                _operand(weight[v0:v1], acc),
                labels[s:e],
                v0,
                stats,
                g1,
                g2,
                temperature,
                grad_h[s:e] if grad_h is not None else None,
                grad_w[v0:v1] if grad_w is not None else None,
            )
    return (
        grad_h.to(hidden.dtype) if grad_h is not None else None,
        grad_w.to(weight.dtype) if grad_w is not None else None,
    )


@overload
def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = ...,
    chunk_size: int = ...,
    vocab_chunk_size: int = ...,
    with_entropy: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = ...,
    chunk_size: int = ...,
    vocab_chunk_size: int = ...,
    with_entropy: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = ...,
    chunk_size: int = ...,
    vocab_chunk_size: int = ...,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]: ...


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Log-probs (and entropy) of ``labels`` under ``softmax(hidden @ weight.T / T)``, never building the logits.

    The LM head of a causal LM (logits = last hidden state times the output-embedding
    matrix) fused with the softmax policy log-prob of PPO (Schulman et al.,
    arXiv:1707.06347); the log-normaliser is an online log-sum-exp over vocabulary
    blocks (Milakov & Gimelshein, arXiv:1805.02867), and the backward recomputes each
    block's logits rather than saving them (as in Liger's fused linear cross-entropy,
    arXiv:2410.10989, which reduces to a scalar loss; here the per-token values and
    their gradients stay per token):

        z_t = hidden_t @ weight.T / T,   logp_t = z_t[y_t] - logsumexp(z_t),
        H_t = -sum_v softmax(z_t)[v] log softmax(z_t)[v],
        S_t = sum_v softmax(z_t)[v]^2        (with_sum_pi_squared; no gradient).

    Extra memory is a few ``[chunk_size, vocab_chunk_size]`` float32 blocks plus the
    gradient buffers (float32 accumulators for narrower dtypes), never ``[N, V]``.
    Labels are range-checked as in :func:`rlcore.ops.logprobs_from_logits` (eager on
    CPU; elsewhere an out-of-range label gives NaN for its token).

    Args:
      hidden: ``[..., H]`` last hidden states (after the final norm).
      weight: ``[V, H]`` output-embedding (``lm_head``) weight, same dtype as ``hidden``.
      labels: ``[...]`` integer token ids in ``[0, V)``.
      temperature: sampling temperature ``T > 0``.
      chunk_size: tokens per block.
      vocab_chunk_size: vocabulary entries per block.
      with_entropy: also return the entropy.
      with_sum_pi_squared: also return ``S_t``, the squared norm of the token's
        distribution (the optimal token baseline reads it,
        :func:`rlcore.algos.optimal_token_baseline_advantages`): one more running sum
        per vocabulary block, folded online like the normaliser; nothing when not asked.

    Returns:
      ``logp [...]``, or a tuple ``(logp, entropy?, sum_pi_squared?)`` of ``[...]`` tensors
      when either option is on, in ``hidden.dtype``; ``logp`` and ``entropy``
      differentiable in ``hidden`` and ``weight``, ``sum_pi_squared`` not.

    >>> hidden = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    >>> weight = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    >>> linear_logprobs(hidden, weight, torch.tensor([1, 2]), vocab_chunk_size=2)
    tensor([-0.5514, -0.2395])
    """
    check_floating("hidden", hidden)
    check_ndim("weight", weight, 2)
    check_tensor("labels", labels)
    if hidden.dim() == 0 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight: got shape {tuple(weight.shape)}, expected (V, {hidden.shape[-1] if hidden.dim() else '?'}) "
            f"(the hidden size of hidden, shape {tuple(hidden.shape)})"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight: got dtype {weight.dtype}, expected {hidden.dtype} (the dtype of hidden)")
    if weight.shape[0] == 0:
        raise ValueError(f"weight: got shape {tuple(weight.shape)}, expected a non-empty vocabulary")
    vocab = weight.shape[0]
    check_labels(labels, vocab, lead=hidden.shape[:-1], lead_name="hidden")
    check_temperature(temperature)
    check_chunk_size(chunk_size)
    check_chunk_size(vocab_chunk_size, name="vocab_chunk_size")
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = _LinearLogprobs.apply(
        flat,
        weight,
        labels.reshape(-1),
        float(temperature),
        chunk_size,
        vocab_chunk_size,
        with_entropy,
        with_sum_pi_squared,
    )
    lead = hidden.shape[:-1]
    logp = poison_invalid(out[0].to(hidden.dtype).reshape(lead), labels, vocab)
    if not (with_entropy or with_sum_pi_squared):
        return logp
    extra = out[1 : 1 + with_entropy + with_sum_pi_squared]
    return (logp, *(t.to(hidden.dtype).reshape(lead) for t in extra))
