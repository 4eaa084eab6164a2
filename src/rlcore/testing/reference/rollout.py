"""Loop references for the rollout: no KV cache, no padding, one row at a time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["filter_logits_ref", "greedy_ref", "partial_greedy_ref", "response_logprobs_ref"]


def filter_logits_ref(logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then top-p filtering of each row of a 2-D tensor by sorting Python lists."""
    out = logits.clone()
    for i, row in enumerate(logits.tolist()):
        order = sorted(range(len(row)), key=lambda j: -row[j])
        keep = set(range(len(row)))
        if top_k > 0:
            kth = row[order[min(top_k, len(row)) - 1]]
            keep = {j for j in keep if row[j] >= kth}
        if top_p < 1.0:
            alive = [j for j in order if j in keep]
            z = sum(torch.tensor(row[j]).exp().item() for j in alive)
            mass, nucleus = 0.0, set()
            for j in alive:
                if mass >= top_p:
                    break
                nucleus.add(j)
                mass += torch.tensor(row[j]).exp().item() / z
            keep = nucleus
        for j in range(len(row)):
            if j not in keep:
                out[i, j] = float("-inf")
    return out


@torch.no_grad()
def greedy_ref(
    model: Callable[..., Any], prompts: Sequence[Sequence[int]], *, eos_token_id: int, max_new_tokens: int
) -> list[list[int]]:
    """Greedy decoding of each prompt (a list of ids) alone, re-running the whole sequence every step."""
    responses = []
    for prompt in prompts:
        ids = list(prompt)
        out = []
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if token == eos_token_id:
                break
        responses.append(out)
    return responses


@torch.no_grad()
def partial_greedy_ref(
    models: Sequence[Callable[..., Any]],
    switches: Sequence[int],
    prompts: Sequence[Sequence[int]],
    *,
    eos_token_id: int,
    max_new_tokens: int,
) -> list[tuple[list[int], list[int]]]:
    """Greedy decoding of each prompt alone where response position ``t`` is taken by ``models[v]``.

    ``v`` counts the ``switches`` (response positions, increasing) at or before ``t``:
    an interruptible rollout whose weights change to the next version at each switch.
    Returns, per prompt, the response and each token's version.
    """
    out = []
    for prompt in prompts:
        ids, tokens, versions = list(prompt), [], []
        for t in range(max_new_tokens):
            v = sum(1 for s in switches if s <= t)
            token = int(models[v](input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            tokens.append(token)
            versions.append(v)
            ids.append(token)
            if token == eos_token_id:
                break
        out.append((tokens, versions))
    return out


@torch.no_grad()
def response_logprobs_ref(
    model: Callable[..., Any], prompt: Sequence[int], response: Sequence[int], *, temperature: float = 1.0
) -> list[float]:
    """``log softmax(logits / T)`` of each response token, from one unpadded forward of prompt + response."""
    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(input_ids=ids).logits[0].double() / temperature
    out = []
    for t, token in enumerate(response):
        out.append(float(torch.log_softmax(logits[len(prompt) - 1 + t], -1)[token]))
    return out


@torch.no_grad()
def response_logits_ref(
    model: Callable[..., Any], prompt: Sequence[int], response: Sequence[int], *, temperature: float = 1.0
) -> list[torch.Tensor]:
    """``logits / T`` ``[V]`` each response token is sampled from, one unpadded forward of prompt + response, token by token."""
    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(input_ids=ids).logits[0].double() / temperature
    return [logits[len(prompt) - 1 + t] for t in range(len(response))]
