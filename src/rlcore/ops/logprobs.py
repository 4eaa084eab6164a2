"""Token log-probabilities and entropy from logits, chunked over tokens with a recomputing backward.

``[tokens, vocab]`` logits are the largest tensors of an LLM training step. The
plain path (``log_softmax`` then ``gather``, and ``softmax`` for the entropy) keeps
several full-size float32 copies alive for the backward pass. Here one custom
autograd function walks the tokens in chunks: the forward keeps only the per-token
log-normaliser (and entropy), and the backward recomputes each chunk's softmax and
writes that chunk of the one gradient buffer. Log-probs and entropy requested
together cost one forward, one backward and one gradient buffer.

Numerics: chunks are upcast to float32 (float64 stays float64), so bfloat16 logits
are normalised in float32; results come back in the logits' dtype. ``-inf`` logits
(a masked vocabulary) are allowed: they get probability 0 and add nothing to the
entropy, where ``sum(p * logits)`` would give ``0 * -inf = nan``.
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from rlcore._checks import check_floating, check_integer, check_positive, check_tensor, value_bounds
from rlcore.ops.numerics import acc_dtype

__all__ = ["entropy_from_logits", "logprobs_from_logits"]

# 512 tokens of a 152k vocabulary is ~0.3 GB per float32 temporary: small next to
# the gradient buffer at training batch sizes, large enough to run at memory speed.
DEFAULT_CHUNK_SIZE = 512


def check_chunk_size(chunk_size: int, name: str = "chunk_size") -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"{name}: got {chunk_size!r}, expected a positive int")


def check_temperature(temperature: float) -> None:
    if isinstance(temperature, torch.Tensor) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature: got {type(temperature).__name__}, expected a Python float > 0")
    check_positive("temperature", temperature)


def check_labels(labels: torch.Tensor, vocab: int, *, lead: torch.Size, lead_name: str) -> None:
    """Shape/dtype checks for ``labels``, plus the range check where it costs no device read.

    The range check reads the labels' values, so it runs only in eager mode on CPU
    tensors, where reading them stalls nothing. On an accelerator (or under
    ``torch.compile``) an out-of-range label is not checked: its log-prob comes back
    NaN instead, so the error shows in the loss without a host sync in the hot path.
    """
    check_integer("labels", labels)
    if labels.shape != lead:
        raise ValueError(
            f"labels: got shape {tuple(labels.shape)}, expected {tuple(lead)} (the leading dimensions of {lead_name})"
        )
    bounds = value_bounds(labels)
    if bounds is not None:
        lo, hi = bounds
        if lo < 0 or hi >= vocab:
            raise ValueError(
                f"labels: got values in [{lo}, {hi}], expected token ids in [0, {vocab - 1}] (vocabulary {vocab})"
            )


def _label_index(labels: torch.Tensor, vocab: int) -> torch.Tensor:
    """Labels clamped into the vocabulary (int64), safe to gather with whatever their values."""
    return labels.long().clamp(0, vocab - 1)


def poison_invalid(logp: torch.Tensor, labels: torch.Tensor, vocab: int) -> torch.Tensor:
    """NaN where a label lies outside the vocabulary (its gradient is then 0)."""
    return torch.where((labels >= 0) & (labels < vocab), logp, float("nan"))


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def _finite_or_zero_(x: torch.Tensor) -> torch.Tensor:
    """Replace ``-inf`` by 0 in place; used where the matching probability is exactly 0."""
    return x.nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=0.0)


def _shifted(chunk: torch.Tensor, m: torch.Tensor, temperature: float, out: torch.Tensor) -> torch.Tensor:
    """``(chunk - m) / T`` written into the fresh buffer ``out``.

    Shifting by the row max before scaling keeps the arithmetic near 0, so the log-prob
    of a dominant token (about -sum of the others' probabilities) is accurate to
    relative precision, not to the rounding of logits of size ~30-100.
    """
    out.copy_(chunk)
    out.sub_(m)
    return out.div_(temperature) if temperature != 1.0 else out


def _forward_chunk(
    chunk: torch.Tensor, labels: torch.Tensor | None, temperature: float, want_entropy: bool, want_sps: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(rowmax, lse, logp, entropy, sum p^2)`` of one chunk; its ``[chunk, V]`` temporaries die on return."""
    acc = acc_dtype(chunk.dtype)
    m = chunk.amax(-1, keepdim=True).to(acc)
    z = _shifted(chunk, m, temperature, torch.empty(chunk.shape, dtype=acc, device=chunk.device))
    z_y = z.gather(-1, _label_index(labels, chunk.shape[-1]).unsqueeze(-1)) if labels is not None else None
    ez = torch.exp(z) if want_entropy else z.exp_()
    total = ez.sum(-1, keepdim=True)
    lse = total.log()
    logp = (z_y - lse).squeeze(-1) if z_y is not None else None
    sps = ((ez.unsqueeze(-2) @ ez.unsqueeze(-1)).squeeze(-1) / (total * total)).squeeze(-1) if want_sps else None
    if not want_entropy:
        return m, lse, logp, None, sps
    # H = lse - sum(p * z), with p * z taken as 0 where p == 0 (z == -inf).
    pz = (ez.unsqueeze(-2) @ _finite_or_zero_(z).unsqueeze(-1)).squeeze(-1) / total
    return m, lse, logp, (lse - pz).squeeze(-1), sps


def _forward(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    temperature: float,
    chunk_size: int,
    want_entropy: bool,
    want_sps: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Per token: the row max ``m``, ``lse = logsumexp((x - m) / T)``, and the requested outputs."""
    n = logits.shape[0]
    acc = acc_dtype(logits.dtype)
    rowmax = logits.new_empty(n, 1, dtype=acc)
    lse = logits.new_empty(n, 1, dtype=acc)
    logp = logits.new_empty(n, dtype=acc) if labels is not None else None
    ent = logits.new_empty(n, dtype=acc) if want_entropy else None
    sps = logits.new_empty(n, dtype=acc) if want_sps else None
    for s, e in chunks(n, chunk_size):
        lab = labels[s:e] if labels is not None else None
        m_c, lse_c, logp_c, ent_c, sps_c = _forward_chunk(logits[s:e], lab, temperature, want_entropy, want_sps)
        rowmax[s:e], lse[s:e] = m_c, lse_c
        if logp is not None:
            assert logp_c is not None, "labels given: the chunk computed logp"
            logp[s:e] = logp_c
        if ent is not None:
            assert ent_c is not None, "want_entropy: the chunk computed the entropy"
            ent[s:e] = ent_c
        if sps is not None:
            assert sps_c is not None, "want_sps: the chunk computed sum p^2"
            sps[s:e] = sps_c
    return rowmax, lse, logp, ent, sps


class _TokenLogprobs(torch.autograd.Function):
    """Outputs ``(logp?, entropy?, sum_pi_squared?, rowmax, lse)`` in the accumulation dtype; the last two are
    internal, and ``sum_pi_squared`` has no gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        temperature: float,
        chunk_size: int,
        want_entropy: bool,
        want_sps: bool,
    ) -> tuple[torch.Tensor, ...]:
        rowmax, lse, logp, ent, sps = _forward(logits, labels, temperature, chunk_size, want_entropy, want_sps)
        return tuple(t for t in (logp, ent, sps) if t is not None) + (rowmax, lse)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        logits, labels, temperature, chunk_size, want_entropy, want_sps = inputs
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.has_logp, ctx.want_entropy = labels is not None, want_entropy
        rowmax, lse = output[-2:]
        ent = output[int(labels is not None)] if want_entropy else None
        ctx.mark_non_differentiable(rowmax, lse, *output[-3:-2] if want_sps else ())
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, labels, rowmax, lse, ent)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[no-untyped-def,override]
        logits, labels, rowmax, lse, ent = ctx.saved_tensors
        g_logp = grads[0] if ctx.has_logp else None
        g_ent = grads[int(ctx.has_logp)] if ctx.want_entropy else None
        if g_logp is None and g_ent is None:
            return None, None, None, None, None, None
        grad = _backward(logits, labels, rowmax, lse, ent, g_logp, g_ent, ctx.temperature, ctx.chunk_size)
        return grad, None, None, None, None, None


def _backward_chunk(
    chunk: torch.Tensor,
    labels: torch.Tensor | None,
    rowmax: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    g1: torch.Tensor | None,
    g2: torch.Tensor | None,
    temperature: float,
    buf: torch.Tensor,
) -> torch.Tensor:
    """One chunk's gradient, built in ``buf`` (``g1``, ``g2`` already divided by ``T``)."""
    lp = _shifted(chunk, rowmax, temperature, buf).sub_(lse)
    if g2 is None:
        assert g1 is not None, "the backward runs only with a gradient for logp or the entropy"
        out = lp.exp_().mul_(-g1)
    else:
        assert ent is not None, "an entropy gradient implies the forward saved the entropy"
        p = torch.exp(lp)
        out = _finite_or_zero_(lp).add_(ent.unsqueeze(-1)).mul_(g2)
        if g1 is not None:
            out.add_(g1)
        out.mul_(p).neg_()
    if g1 is not None:
        assert labels is not None, "a logp gradient implies labels"
        out.scatter_add_(-1, _label_index(labels, chunk.shape[-1]).unsqueeze(-1), g1)
    return out


def _backward(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    rowmax: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    g_logp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    temperature: float,
    chunk_size: int,
) -> torch.Tensor:
    """d/dx of ``g1 * logp + g2 * H`` with ``x = logits / T``, chunk by chunk.

    ``d logp_y / dx = onehot(y) - p`` and ``dH / dx = -p * (log p + H)``, so the chunk's
    gradient is ``(onehot(y) * g1 - p * (g1 + g2 * (log p + H))) / T``.
    """
    n = logits.shape[0]
    acc = lse.dtype
    grad = torch.empty_like(logits)
    inv_t = 1.0 / temperature
    for s, e in chunks(n, chunk_size):
        chunk = logits[s:e]
        g1 = g_logp[s:e].to(acc).unsqueeze(-1) * inv_t if g_logp is not None else None
        g2 = g_ent[s:e].to(acc).unsqueeze(-1) * inv_t if g_ent is not None else None
        lab = labels[s:e] if labels is not None else None
        ent_c = ent[s:e] if ent is not None else None
        if logits.dtype == acc:
            # The chunk's gradient is built in place in the output buffer.
            _backward_chunk(chunk, lab, rowmax[s:e], lse[s:e], ent_c, g1, g2, temperature, grad[s:e])
        else:
            buf = torch.empty(chunk.shape, dtype=acc, device=chunk.device)
            grad[s:e] = _backward_chunk(chunk, lab, rowmax[s:e], lse[s:e], ent_c, g1, g2, temperature, buf)
            del buf  # not alive while the next chunk allocates its own
    return grad


def _flatten_logits(logits: torch.Tensor) -> torch.Tensor:
    check_floating("logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits: got shape {tuple(logits.shape)}, expected [..., V] with V >= 1")
    return logits.reshape(-1, logits.shape[-1])


@overload
def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = ...,
    chunk_size: int = ...,
    with_entropy: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = ...,
    chunk_size: int = ...,
    with_entropy: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = ...,
    chunk_size: int = ...,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]: ...


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Log-probability of each label token (and the entropy of each token's distribution).

    The softmax policy of an autoregressive LM, as used by every policy-gradient loss
    since REINFORCE (Williams, 1992) and by PPO (Schulman et al., arXiv:1707.06347);
    sampling temperature as in vLLM and verl (logits divided by ``T``):

        logp_t = x_t[y_t] - logsumexp(x_t),      H_t = -sum_v p_t[v] log p_t[v],
        S_t = sum_v p_t[v]^2   (with_sum_pi_squared),
        with x_t = logits_t / T and p_t = softmax(x_t).

    Computed in chunks of ``chunk_size`` tokens with float32 accumulation; the
    backward recomputes each chunk's softmax instead of saving it, so the extra
    memory is one gradient buffer plus a few chunk-sized temporaries. The caller's
    ``logits`` are never modified.

    Labels are checked against the vocabulary in eager mode on CPU tensors (reading
    them there stalls nothing). On an accelerator or under ``torch.compile`` they are
    not read back: an out-of-range label gives a NaN log-prob for that token instead
    of a host sync or a device-side assertion.

    Args:
      logits: ``[..., V]`` floating point.
      labels: ``[...]`` integer token ids in ``[0, V)``.
      temperature: sampling temperature ``T > 0``.
      chunk_size: tokens per chunk.
      with_entropy: also return the entropy (one pass and one gradient buffer for both).
      with_sum_pi_squared: also return ``S_t`` (no gradient), which the optimal token
        baseline reads (:func:`rlcore.algos.optimal_token_baseline_advantages`); computed
        only when asked.

    Returns:
      ``logp [...]``, or a tuple ``(logp, entropy?, sum_pi_squared?)`` when either option
      is on, in ``logits.dtype``. ``logp`` and ``entropy`` are differentiable in ``logits``.

    >>> logits = torch.tensor([[0.0, 0.0], [0.0, 2.0]])
    >>> logprobs_from_logits(logits, torch.tensor([0, 1]))
    tensor([-0.6931, -0.1269])
    >>> logprobs_from_logits(logits, torch.tensor([0, 1]), with_entropy=True)[1]
    tensor([0.6931, 0.3653])
    """
    flat = _flatten_logits(logits)
    check_tensor("labels", labels)
    check_labels(labels, logits.shape[-1], lead=logits.shape[:-1], lead_name="logits")
    check_temperature(temperature)
    check_chunk_size(chunk_size)
    out = _TokenLogprobs.apply(
        flat, labels.reshape(-1), float(temperature), chunk_size, with_entropy, with_sum_pi_squared
    )
    lead = logits.shape[:-1]
    logp = poison_invalid(out[0].to(logits.dtype).reshape(lead), labels, logits.shape[-1])
    if not (with_entropy or with_sum_pi_squared):
        return logp
    extra = out[1 : 1 + with_entropy + with_sum_pi_squared]
    return (logp, *(t.to(logits.dtype).reshape(lead) for t in extra))


def entropy_from_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """Entropy of each token's softmax distribution, chunked over tokens.

    The policy entropy of entropy-regularised policy gradients (Williams & Peng, 1991;
    A3C, Mnih et al., arXiv:1602.01783), as logged and bonused by PPO-style trainers:

        H_t = logsumexp(x_t) - sum_v softmax(x_t)[v] x_t[v],   x_t = logits_t / T.

    ``-inf`` logits (a masked vocabulary) contribute 0; the same formula written as
    ``logsumexp(x) - (softmax(x) * x).sum()`` (``entropy_from_logits`` in TRL and verl) returns
    NaN there, from ``0 * -inf``. The backward recomputes each chunk's softmax.

    Args:
      logits: ``[..., V]`` floating point.
      temperature: sampling temperature ``T > 0``.
      chunk_size: tokens per chunk.

    Returns:
      ``[...]`` entropies in ``logits.dtype``, differentiable in ``logits``.

    >>> entropy_from_logits(torch.tensor([[0.0, 0.0], [0.0, float("-inf")]]))
    tensor([0.6931, 0.0000])
    """
    flat = _flatten_logits(logits)
    check_temperature(temperature)
    check_chunk_size(chunk_size)
    out = _TokenLogprobs.apply(flat, None, float(temperature), chunk_size, True, False)
    return out[0].to(logits.dtype).reshape(logits.shape[:-1])
