"""Shared-prompt forward: the prompt of a GRPO group runs once, its samples' responses attend to it.

A group of ``n`` samples of one prompt repeats the prompt's tokens ``n`` times in a
padded or packed batch, and causal attention makes their hidden states identical in
every copy. Packing each distinct prompt once, followed by the responses of all the
rows that share it, with an attention mask that lets a response token see the prompt
and its own earlier tokens only, gives the same log-probs for ``P + sum(R_j)`` tokens
instead of ``sum(P + R_j)`` (the Prefix Grouper of Liu et al. 2025, arXiv:2506.05433).
Positions count from each prompt's first token, as in the per-sequence forward, so
rotary embeddings see the same positions.

Layout: group ``g`` is a contiguous run of the packed row: its prompt, then its member
rows' responses in row order. Attention runs on a ``[G, H, T, T]`` group-padded view
with a block mask (:class:`SharedPrefix`); the next-token log-prob of a response's
first token reads the hidden state of the group's last prompt token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from rlcore.models.attention import attend_masked
from rlcore.ops.linear_logprobs import linear_logprobs

__all__ = ["SharedPrefix", "shared_prefix_hidden", "shared_prefix_logprobs", "shares_prompts"]


@dataclasses.dataclass(frozen=True, eq=False)
class SharedPrefix:
    """The attention layout of a shared-prompt pack (made by :func:`shared_prefix_logprobs`).

    Attributes:
      gather: ``[G * T]`` packed-token index of each slot of the group-padded view
        (padding slots repeat a real token; no real query attends to them).
      scatter: ``[N]`` slot of each packed token.
      mask: ``[G, 1, T, T]`` bool, ``mask[g, 0, q, k]``: slot ``q`` attends to slot ``k``.
    """

    gather: torch.Tensor
    scatter: torch.Tensor
    mask: torch.Tensor

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
        """Attention of packed ``[N, heads, D]`` queries, keys and values under the layout's mask."""
        groups, _, width, _ = self.mask.shape

        def view(x: torch.Tensor) -> torch.Tensor:
            return x.index_select(0, self.gather).view(groups, width, *x.shape[1:]).transpose(1, 2)

        out = attend_masked(view(q), view(k), view(v), self.mask, scale=scale)
        return out.transpose(1, 2).reshape(groups * width, *q.shape[1:]).index_select(0, self.scatter)


def shares_prompts(prompts: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor | None:
    """Each row's group (rows of one group have the same prompt), or None when no two rows share one.

    ``prompts`` / ``prompt_mask`` are ``[B, P]`` left-padded; a host read (the layout is
    built on the host, like :func:`rlcore.ops.pack`'s token count). A run of consecutive
    rows with one prompt (a GRPO group as sampled) is one group, found by comparing each
    row with the one before, without the sort of ``torch.unique(dim=0)`` (about 20x its
    cost at 256 rows); only when no run is longer than one row are equal prompts looked
    for anywhere. Two runs of the same prompt may thus be two groups: the shared-prompt
    forward is exact either way.
    """
    rows = prompts.shape[0]
    if rows < 2 or bool((prompt_mask != 0).sum(1).min() == 0):  # sync-ok: host layout; an empty prompt
        return None
    keyed = torch.where(prompt_mask != 0, prompts, -1)
    starts = torch.ones(rows, dtype=torch.bool, device=prompts.device)
    starts[1:] = (keyed[1:] != keyed[:-1]).any(1)
    inverse = torch.cumsum(starts, 0) - 1
    groups = int(inverse[-1]) + 1  # sync-ok: the layout is built on the host
    if groups == rows:  # no two neighbours share a prompt: any two rows may
        _, inverse = torch.unique(keyed, dim=0, return_inverse=True)
        groups = int(inverse.max()) + 1  # sync-ok: as above
    return inverse if groups < rows else None


def _layout(
    prompts: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor, mask: torch.Tensor, group: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, SharedPrefix, torch.Tensor, torch.Tensor]:
    """Packed ids and positions, the attention layout, and per response token: its source token and its row slot.

    Vectorised over rows and tokens; the sizes (tokens, groups, the widest group) are
    read on the host once, as :func:`rlcore.ops.pack` reads its token count.
    """
    device = prompts.device
    b, width_r = responses.shape
    order = torch.argsort(group, stable=True)  # rows group by group, in row order within a group
    g_sorted = group[order]
    first = torch.ones(b, dtype=torch.bool, device=device)
    first[1:] = g_sorted[1:] != g_sorted[:-1]
    heads = order[first]  # one row per group: its prompt
    n_groups = heads.numel()
    gid = torch.cumsum(first.long(), 0) - 1  # group number of each sorted row
    p_keep = prompt_mask[heads] != 0
    r_keep = mask[order] != 0
    p_len = p_keep.sum(1)
    r_len = r_keep.sum(1)
    r_total = torch.zeros(n_groups, dtype=torch.long, device=device).index_add_(0, gid, r_len)
    g_len = p_len + r_total
    g_start = torch.cumsum(g_len, 0) - g_len
    # Each sorted row's response starts after its group's prompt and the earlier members' responses.
    r_before = torch.cumsum(r_len, 0) - r_len
    r_start = g_start[gid] + p_len[gid] + r_before - r_before[first][gid]
    n = int(g_len.sum())  # sync-ok: the packed length sizes the output
    ids = torch.empty(n, dtype=torch.long, device=device)
    pos = torch.empty(n, dtype=torch.long, device=device)
    slot_seg = torch.empty(n, dtype=torch.long, device=device)  # -1 on a prompt, the member's rank on a response
    # Prompt tokens.
    p_rank = torch.cumsum(p_keep.long(), 1) - 1
    p_rows, p_cols = p_keep.nonzero(as_tuple=True)  # sync-ok: host layout
    p_dest = g_start[p_rows] + p_rank[p_rows, p_cols]
    ids[p_dest] = prompts[heads][p_rows, p_cols]
    pos[p_dest] = p_rank[p_rows, p_cols]
    slot_seg[p_dest] = -1
    # Response tokens.
    r_rank = torch.cumsum(r_keep.long(), 1) - 1
    r_rows, r_cols = r_keep.nonzero(as_tuple=True)  # sync-ok: host layout
    t = r_rank[r_rows, r_cols]
    r_dest = r_start[r_rows] + t
    ids[r_dest] = responses[order][r_rows, r_cols]
    pos[r_dest] = p_len[gid[r_rows]] + t
    member = torch.arange(b, device=device) - torch.nonzero(first).squeeze(1)[gid]
    slot_seg[r_dest] = member[r_rows]
    last_prompt = g_start + p_len - 1
    src = torch.where(t == 0, last_prompt[gid[r_rows]], r_dest - 1)
    dst = order[r_rows] * width_r + r_cols
    # The group-padded view: group g's tokens in slots [g, 0 : g_len[g]].
    width = int(g_len.max())  # sync-ok: host layout
    tok_group = torch.repeat_interleave(torch.arange(n_groups, device=device), g_len)
    slot = tok_group * width + (torch.arange(n, device=device) - g_start[tok_group])
    seg = torch.full((n_groups * width,), -2, dtype=torch.long, device=device)  # -2: padding
    seg[slot] = slot_seg
    seg = seg.view(n_groups, width)
    real = seg != -2
    steps = torch.arange(width, device=device)
    causal = steps[None, :, None] >= steps[None, None, :]  # [1, T(q), T(k)]
    same = (seg[:, None, :] == -1) | (seg[:, None, :] == seg[:, :, None])
    allowed = causal & same & real[:, None, :] & real[:, :, None]
    allowed |= torch.eye(width, dtype=torch.bool, device=device)[None] & ~real[:, :, None]  # padding sees itself
    gather = torch.zeros(n_groups * width, dtype=torch.long, device=device)
    gather[slot] = torch.arange(n, device=device)
    return ids, pos, SharedPrefix(gather, slot, allowed[:, None]), src, dst


def shared_prefix_hidden(
    apply: Any, params: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor], *, group: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last hidden state that predicts each response token, from one shared-prompt forward.

    Args:
      apply, params, batch, group: as in :func:`shared_prefix_logprobs`.

    Returns:
      ``(hidden [M, H], dst [M])``: one row per response token (``mask != 0``), the state
      of the token before it (the group's last prompt token for a response's first), and
      its flat index ``row * R + column`` in the ``[B, R]`` response layout.
    """
    ids, positions, layout, src, dst = _layout(
        batch["prompts"], batch["prompt_mask"], batch["responses"], batch["mask"], group
    )
    hidden = apply(params, ids, position_ids=positions, shared_prefix=layout)
    return hidden.index_select(0, src), dst


def shared_prefix_logprobs(
    apply: Any,
    params: Mapping[str, torch.Tensor],
    batch: Mapping[str, torch.Tensor],
    *,
    group: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
) -> Any:
    """Response log-probs ``[B, R]`` (and entropies) from one shared-prompt forward; 0 off the response mask.

    Equal to :func:`rlcore.train.stages.response_logprobs`'s per-sequence forward up to
    floating-point rounding, in value and gradient.

    Args:
      apply: ``(apply, params)``'s ``apply`` from :func:`rlcore.models.from_hf`.
      params: its parameters.
      batch: ``prompts`` / ``prompt_mask`` ``[B, P]`` (left-padded), ``responses`` /
        ``mask`` ``[B, R]`` (a response token counts where ``mask != 0``).
      group: ``[B]`` rows with equal values have the same prompt (:func:`shares_prompts`).
      temperature: the sampling temperature.
      with_entropy: also return the per-token entropy.
      with_sum_pi_squared: also return each position's ``sum_v pi(v)^2`` (no gradient).
    """
    responses = batch["responses"]
    hidden, dst = shared_prefix_hidden(apply, params, batch, group=group)
    out = linear_logprobs(
        hidden,
        apply.output_weight(params),
        responses.reshape(-1).index_select(0, dst),
        temperature=temperature,
        with_entropy=with_entropy,
        with_sum_pi_squared=with_sum_pi_squared,
    )
    values = out if isinstance(out, tuple) else (out,)
    shape = responses.shape
    placed = [v.new_zeros(shape.numel()).index_copy(0, dst, v).view(shape).float() for v in values]
    return tuple(placed) if with_entropy or with_sum_pi_squared else placed[0]
