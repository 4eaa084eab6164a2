"""Loop references for sequence packing and token-budget bin packing.

Packing is written token by token over the padded rows; bin counts are checked
against exhaustive search (small inputs only) and the textbook first-fit-decreasing.
"""

from __future__ import annotations

import torch

__all__ = ["first_fit_decreasing_ref", "min_bins_ref", "pack_ref", "shift_labels_ref", "unpack_ref"]


def pack_ref(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, list[int]]:
    """Packed ``input_ids``, ``position_ids``, ``cu_seqlens`` and flat ``indices`` as Python lists."""
    ids, mask = input_ids.tolist(), attention_mask.tolist()
    width = input_ids.shape[1]
    out: dict[str, list[int]] = {"input_ids": [], "position_ids": [], "cu_seqlens": [0], "indices": []}
    for b, (row, mrow) in enumerate(zip(ids, mask)):
        pos = 0
        for t, (tok, m) in enumerate(zip(row, mrow)):
            if m:
                out["input_ids"].append(tok)
                out["position_ids"].append(pos)
                out["indices"].append(b * width + t)
                pos += 1
        out["cu_seqlens"].append(out["cu_seqlens"][-1] + pos)
    return out


def unpack_ref(values: list[float], attention_mask: torch.Tensor, fill: float = 0.0) -> list[list[float]]:
    """Padded rows: the packed values in order at the mask's real positions, ``fill`` elsewhere."""
    it = iter(values)
    return [[next(it) if m else fill for m in row] for row in attention_mask.tolist()]


def shift_labels_ref(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[list[int], list[bool]]:
    """For each real token in packed order: the next real token of the same row, or (0, False) at a row's end."""
    labels: list[int] = []
    valid: list[bool] = []
    for row, mrow in zip(input_ids.tolist(), attention_mask.tolist()):
        real = [tok for tok, m in zip(row, mrow) if m]
        for j in range(len(real)):
            has_next = j + 1 < len(real)
            labels.append(real[j + 1] if has_next else 0)
            valid.append(has_next)
    return labels, valid


def first_fit_decreasing_ref(lengths: list[int], capacity: int) -> int:
    """Bins used by first-fit-decreasing (ties broken by index)."""
    loads: list[int] = []
    for x in sorted(lengths, reverse=True):
        for b in range(len(loads)):
            if loads[b] + x <= capacity:
                loads[b] += x
                break
        else:
            loads.append(x)
    return len(loads)


def min_bins_ref(lengths: list[int], capacity: int) -> int:
    """The optimal number of bins, by exhaustive search (keep inputs to ~8 items)."""
    items = sorted(lengths, reverse=True)
    if not items:
        return 0

    def fits(k: int) -> bool:
        loads = [0] * k

        def place(i: int) -> bool:
            if i == len(items):
                return True
            tried = set()
            for b in range(k):
                if loads[b] in tried or loads[b] + items[i] > capacity:
                    continue
                tried.add(loads[b])
                loads[b] += items[i]
                if place(i + 1):
                    return True
                loads[b] -= items[i]
            return False

        return place(0)

    k = 1
    while not fits(k):
        k += 1
    return k
