"""The reward stage decodes exactly the kept ids of each row (any mask, not only contiguous padding)."""

from __future__ import annotations

import concurrent.futures

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.train.stages import reward_stage


class _Pool:
    """A reward pool that records what it was asked to score and scores each response by its length."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def submit(self, prompts, responses, *, batch, answers):
        self.calls.append({"prompts": prompts, "responses": responses, "batch": batch, "answers": answers})
        done = concurrent.futures.Future()
        done.set_result(torch.tensor([float(len(r)) for r in responses]))
        return done


def _kept(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    # The loop reference: each row's ids where its mask is non-zero, in order.
    out = []
    for i in range(ids.shape[0]):
        out.append([int(ids[i, j]) for j in range(ids.shape[1]) if mask[i, j] != 0])
    return out


def _ids_and_mask(rows: int, width: int, mask_dtype: torch.dtype):
    return st.tuples(
        st.lists(st.integers(0, 30), min_size=rows * width, max_size=rows * width),
        st.lists(st.booleans(), min_size=rows * width, max_size=rows * width),
    ).map(
        lambda t: (
            torch.tensor(t[0], dtype=torch.int64).reshape(rows, width),
            torch.tensor(t[1]).reshape(rows, width).to(mask_dtype),
        )
    )


@st.composite
def _batches(draw):
    rows = draw(st.integers(1, 6))
    prompts = draw(_ids_and_mask(rows, draw(st.integers(0, 5)), torch.int64))
    responses = draw(_ids_and_mask(rows, draw(st.integers(0, 5)), draw(st.sampled_from([torch.float32, torch.bool]))))
    answers = draw(_ids_and_mask(rows, draw(st.integers(0, 3)), torch.bool))
    return {
        "prompts": prompts[0],
        "prompt_mask": prompts[1],
        "responses": responses[0],
        "mask": responses[1],
        "answers": answers[0],
        "answers_mask": answers[1],
        "iteration": torch.full((rows,), 7),
    }


@settings(max_examples=60, deadline=None)
@given(b=_batches())
def test_reward_stage_decodes_the_kept_ids_of_each_row(b) -> None:
    pool = _Pool()
    s = reward_stage(pool, lambda ids: ",".join(map(str, ids)))
    out = s.fn(b)
    (call,) = pool.calls
    as_text = lambda rows: [",".join(map(str, r)) for r in rows]  # noqa: E731
    assert call["prompts"] == as_text(_kept(b["prompts"], b["prompt_mask"]))
    assert call["responses"] == as_text(_kept(b["responses"], b["mask"]))
    assert call["answers"] == as_text(_kept(b["answers"], b["answers_mask"]))
    assert call["batch"] == 7
    assert out["scores"].tolist() == [float(len(r)) for r in call["responses"]]


def test_a_groups_shared_prompt_and_answer_are_decoded_once() -> None:
    decoded: list[list[int]] = []

    def decode(ids: list[int]) -> str:
        decoded.append(list(ids))
        return ",".join(map(str, ids))

    group = torch.tensor([[3, 4], [5, 6]]).repeat_interleave(4, 0)  # two prompts, four rows each
    b = {
        "prompts": group,
        "prompt_mask": torch.ones_like(group),
        "responses": torch.arange(16).reshape(8, 2),
        "mask": torch.ones(8, 2),
        "answers": group.flip(1),
        "answers_mask": torch.ones(8, 2, dtype=torch.bool),
        "iteration": torch.full((8,), 0),
    }
    pool = _Pool()
    reward_stage(pool, decode).fn(b)
    (call,) = pool.calls
    assert call["prompts"] == ["3,4"] * 4 + ["5,6"] * 4
    assert call["answers"] == ["4,3"] * 4 + ["6,5"] * 4
    assert len(call["responses"]) == 8
    assert sorted(map(tuple, decoded)) == sorted(
        [(3, 4), (5, 6), (4, 3), (6, 5), *(tuple(r) for r in b["responses"].tolist())]
    )
