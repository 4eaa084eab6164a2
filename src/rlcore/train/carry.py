"""Carry-over of unfinished rows across steps (AReaL's continuous generation): batches of finished groups.

AReaL (Fu et al., 2025, arXiv:2505.24298) keeps its rollout workers generating all the
time: a batch goes to the trainer as soon as enough trajectories have *finished*, and the
unfinished ones stay in flight (taking new weights at token boundaries) and finish into
later batches. A step then waits for ``B`` finished rows, not for its longest row.

``deploy.carry_over`` (with ``deploy.partial_rollouts``) does this in the disaggregated
torch-engine worker (at ``deploy.staleness`` 1 nothing can be carried: use 2 or more):

* :class:`ContinuousRollout` (in the worker) holds every row in flight. Each call admits
  one step's prompts, decodes all live rows together (the prompt and the tokens so far
  re-encoded at each call and at each new version, as an interrupted rollout is) and
  returns as many finished *groups* as it admitted: a GRPO group is handed over only
  when all its ``n`` samples have finished, since its advantages need the whole group.
* The staleness bound holds per token: the call for pipeline iteration ``j`` returns no
  row with a token older than ``j - staleness`` (``floor``). A group that would break it
  at the next call is *due*: the call decodes until every due group has finished and
  returns due groups first; a due group that still does not fit is drawn again from its
  first token (the same random numbers, newer weights), never trained stale.
* :func:`carried` (in the trainer) gives the pipeline a loader of slots (``iteration``
  only) and a rollout stage that sends each step's prompts and writes, with the
  responses, the prompt columns of the rows that came back (``prompt_step``: the step
  whose prompts a row answers). Every row is keyed by ``(prompt_step, row)``, drawn
  from its own random stream, and trained once; the rows in flight when the run ends
  are not trained.
* :class:`CarryBook` (in the trainer) keeps the rows sent and not yet trained: a checkpoint
  saves them, and a resumed run, or a call after the worker was replaced
  (``trainer.max_worker_restarts``), sends them again, redone from their first token.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from rlcore.dataflow import HandBack, Stage, stage
from rlcore.models.decoding import CachedDecoder
from rlcore.models.sampling import left_pad, sample_tokens, uniform_table
from rlcore.seeding import Purpose, RowStream
from rlcore.train.stages import ROLLOUT_OUTPUTS

__all__ = ["CARRY_OUTPUTS", "CarriedPrompts", "Carry", "CarryBook", "ContinuousRollout", "carried", "with_carry_over"]

Batch = dict[str, torch.Tensor]
# What the worker returns for each row: its key (prompt step, row) and the rollout's columns.
CARRY_OUTPUTS = ("prompt_step", "row", *ROLLOUT_OUTPUTS)


@dataclasses.dataclass
class _Row:
    """One response in flight: its key, prompt, draws and what it has sampled so far (with each token's version)."""

    key: tuple[int, int]
    group: tuple[int, int]
    prompt: list[int]
    draws: torch.Tensor | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    done: bool = False
    hold: int = 0  # decode steps the row stays in the batch after it ends (a modelled tail; 0: none)

    @property
    def live(self) -> bool:
        return not self.done or len(self.tokens) < self.hold

    def restart(self) -> None:
        self.tokens, self.logps, self.versions, self.done = [], [], [], False


class ContinuousRollout:
    """The worker's rows in flight: each call admits a step's prompts and returns as many finished groups.

    Args:
      model: the worker's causal LM (its weights replaced by ``refresh``).
      seed: the run's seed: row ``r`` of step ``s`` draws from ``RowStream(seed, SAMPLING, s, r)``,
        so a row's tokens do not depend on the rows it decodes beside.
      eos_token_id, pad_token_id, max_new_tokens, temperature, top_p, top_k: as in
        :func:`rlcore.train.generate`.

    Attributes:
      restarts: rows drawn again because their group could not be handed over within the bound.
    """

    def __init__(
        self,
        model: Any,
        *,
        seed: int,
        eos_token_id: int,
        pad_token_id: int = 0,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
    ):
        self.model, self.seed = model, seed
        self.eos, self.pad, self.max_new = eos_token_id, pad_token_id, max_new_tokens
        self.sampling: dict[str, Any] = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
        self.rows: list[_Row] = []
        self.restarts = 0

    def hold(self, step: int, rows: torch.Tensor) -> torch.Tensor | None:
        """Decode steps each admitted row stays in the batch at least (past its end, fed padding); None: none.

        A hook for benchmarks that model a long tail of response lengths; rlcore's rows leave at ``<eos>``.
        """
        return None

    @property
    def in_flight(self) -> list[tuple[int, int]]:
        """The keys of the rows admitted and not yet returned."""
        return [r.key for r in self.rows]

    @torch.no_grad()
    def __call__(self, batch: Mapping[str, torch.Tensor], refresh: Callable[[], int | None], version: int) -> Batch:
        """Admit ``batch``'s rows, decode until ``want`` groups have finished (and every due one), return them.

        Args:
          batch: ``prompts``, ``prompt_mask`` ``[N, P]``; ``iteration`` (each prompt's step), ``row``,
            ``group`` ``[N]`` (N may be 0); ``floor`` ``[1]``: the oldest version a returned token may
            have; ``want`` ``[1]``: the groups to return.
          refresh: asked between two decode steps: a newer version loaded into the model, or None.
          version: the version the model holds now.

        Returns:
          :data:`CARRY_OUTPUTS` of ``want`` whole groups, one after the other.
        """
        floor, want = int(batch["floor"][0]), int(batch["want"][0])
        if batch["row"].numel():
            self._admit(batch)
        for r in self.rows:  # cannot be returned any more (a call was skipped): drawn again
            if r.versions and r.versions[0] < floor:
                self._restart(r)
        was_training = self.model.training
        self.model.eval()
        try:
            self._decode(refresh, version, want, floor)
        finally:
            self.model.train(was_training)
        return self._hand_over(want, floor)

    def _admit(self, batch: Mapping[str, torch.Tensor]) -> None:
        """Each row of ``batch`` joins the rows in flight, with the draws of its (step, row) stream."""
        steps = batch["iteration"]
        for step in dict.fromkeys(steps.tolist()):
            at = (steps == step).nonzero().flatten()
            rows = batch["row"][at]
            draws = None
            if self.sampling["temperature"] > 0:
                stream = RowStream(self.seed, Purpose.SAMPLING, step, rows)
                draws = uniform_table(stream, rows.numel(), torch.arange(self.max_new), batch["prompts"].device)
            holds = self.hold(step, rows)
            ids, on, groups = batch["prompts"][at].tolist(), batch["prompt_mask"][at].tolist(), batch["group"][at]
            for i, (row, group) in enumerate(zip(rows.tolist(), groups.tolist())):
                prompt = [t for t, m in zip(ids[i], on[i]) if m]
                hold = 0 if holds is None else int(holds[i])
                d = None if draws is None else draws[i]
                self.rows.append(_Row((step, row), (step, group), prompt, d, hold=hold))

    def _restart(self, r: _Row) -> None:
        r.restart()
        self.restarts += 1

    def _groups(self) -> dict[tuple[int, int], list[_Row]]:
        groups: dict[tuple[int, int], list[_Row]] = {}
        for r in self.rows:  # in admission order
            groups.setdefault(r.group, []).append(r)
        return groups

    def _state(self, floor: int) -> tuple[int, bool]:
        """Groups finished, and whether a due group (a token older than the next call's floor) is unfinished."""
        finished, due_open = 0, False
        for rows in self._groups().values():
            ended = all(not r.live for r in rows)
            finished += ended
            due_open |= not ended and any(r.versions and r.versions[0] <= floor for r in rows)
        return finished, due_open

    def _decode(self, refresh: Callable[[], int | None], version: int, want: int, floor: int) -> None:
        """Decode every live row until ``want`` groups have finished and no due group is unfinished."""
        live = [r for r in self.rows if r.live]
        decoder = self._encode(live)
        while live:
            finished, due_open = self._state(floor)
            if finished >= want and not due_open:
                return
            new = refresh()
            if new is not None:  # new weights: the live rows re-encoded by them, as an interrupted rollout
                version = new
                live = [r for r in live if r.live]
                decoder = self._encode(live)
            active = decoder.active.tolist()
            rows = [live[i] for i in active]
            sampling = [r for r in rows if not r.done]
            token = torch.full((len(live),), self.pad, dtype=torch.int64)
            if sampling:
                pick = torch.tensor([k for k, r in enumerate(rows) if not r.done])
                logits = decoder.logits.index_select(0, pick)
                draws = None
                if self.sampling["temperature"] > 0:
                    draws = torch.stack([r.draws[len(r.tokens)] for r in sampling])  # type: ignore[index]
                sampled, logp = sample_tokens(logits, draws, **self.sampling)
                for r, t, lp in zip(sampling, sampled.tolist(), logp.tolist()):
                    r.tokens.append(t)
                    r.logps.append(lp)
                    r.versions.append(version)
                    r.done = t == self.eos or len(r.tokens) == self.max_new
                token.index_copy_(0, torch.tensor([active[k] for k in pick.tolist()]), sampled)
            for r in rows:  # a held row past its end: one more step of its modelled tail
                if r.done and len(r.tokens) < r.hold:
                    r.tokens.append(self.pad)
                    r.logps.append(0.0)
                    r.versions.append(-1)
            ended = torch.tensor([not r.live for r in live])
            if decoder.drop(ended) == 0:
                return
            decoder.feed(token)

    def _encode(self, live: list[_Row]) -> CachedDecoder:
        """A decoder over ``live``: each row's prompt and tokens so far, left-padded, through the model once."""
        ids, attention = left_pad([r.prompt + r.tokens for r in live] or [[self.pad]], self.pad)
        return CachedDecoder(self.model, ids, attention)

    def _hand_over(self, want: int, floor: int) -> Batch:
        """``want`` finished groups, due ones first, oldest first; due ones that do not fit are drawn again."""
        ready = [(g, rows) for g, rows in self._groups().items() if all(not r.live for r in rows)]
        due = [gr for gr in ready if any(r.versions[0] <= floor for r in gr[1])]
        rest = [gr for gr in ready if gr not in due]
        chosen = (due + rest)[:want]
        for _, rows in due[want:]:  # past the bound at the next call: drawn again with newer weights
            for r in rows:
                self._restart(r)
        taken = {g for g, _ in chosen}
        out = [r for g, rows in chosen for r in rows]
        self.rows = [r for r in self.rows if r.group not in taken]
        return self._columns(out)

    def _columns(self, rows: list[_Row]) -> Batch:
        lengths = [sum(v >= 0 for v in r.versions) for r in rows]  # the tail's padding steps are not the response's
        width = max(lengths, default=1)
        responses = torch.full((len(rows), width), self.pad, dtype=torch.int64)
        logp = torch.zeros(len(rows), width)
        tokens = torch.zeros(len(rows), width, dtype=torch.int64)
        mask = torch.zeros(len(rows), width)
        for i, (r, k) in enumerate(zip(rows, lengths)):
            responses[i, :k] = torch.tensor(r.tokens[:k], dtype=torch.int64)
            logp[i, :k] = torch.tensor(r.logps[:k])
            tokens[i, :k] = torch.tensor(r.versions[:k], dtype=torch.int64)
            mask[i, :k] = 1.0
        return {
            "prompt_step": torch.tensor([r.key[0] for r in rows], dtype=torch.int64),
            "row": torch.tensor([r.key[1] for r in rows], dtype=torch.int64),
            "responses": responses,
            "mask": mask,
            "rollout_logp": logp,
            "version": tokens[:, 0].clone(),
            "token_version": tokens,
        }


class CarriedPrompts:
    """A prompt source seen through carry-over: the pipeline's loader gives slots, the rollout writes the prompts.

    Everything but :attr:`columns` and :meth:`loader` is the wrapped source's (its
    tokenizer, reward stage, validation set ...).
    """

    columns = ("iteration",)

    def __init__(self, task: Any, book: CarryBook):
        self.task, self.book = task, book

    def __getattr__(self, name: str) -> Any:
        if name in ("task", "book"):  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.task, name)

    def loader(self, rank: int, start: int, n: int) -> Callable[[int], dict[str, Any]]:
        """Iteration ``i`` -> ``iteration`` of its ``rl.batch_size * n`` slots (the step they are trained at)."""
        size = self.task.batch_size * n

        def slots(i: int) -> dict[str, Any]:
            return {"iteration": torch.full((size,), start + i, dtype=torch.int64)}

        return slots


def _real(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's real tokens (its left padding dropped)."""
    return [[t for t, m in zip(row, on) if m] for row, on in zip(ids.tolist(), mask.tolist())]


Key = tuple[int, int]  # (prompt step, row)


@dataclasses.dataclass
class _Sent:
    """A row sent to the worker and not handed over yet: what the trainer needs to send it again and to train it."""

    prompt: list[int]
    group: int
    kept: dict[str, Any]


class CarryBook:
    """The trainer's account of carried rows: those sent and not yet trained, and how far the prompt steps were sent.

    With ``deploy.carry_over`` it is one of the run's stateful parts
    (:func:`rlcore.train.run_state.run_extras`, key ``"carry"``): a checkpoint saves
    :meth:`checkpoint_state` beside the models. After the update of step ``k`` the rows not
    trained by then are those still in the worker and those handed over for a later
    iteration (the rollout runs ahead of the update). A run resumed from it
    (:meth:`restore_state`) sends those rows again first, to be
    redone from their first token with the same random streams ``(seed, sampling, step,
    row)`` and the resumed run's weights, and goes on sending prompt steps from the same
    frontier: no row is lost and none is trained twice. A worker replaced after its death
    (``trainer.max_worker_restarts``) lost its rows in flight: the next call sends every
    row not handed over again (:meth:`lost`).

    Args:
      frontier: the first prompt step not sent yet.
      ranks: the data-parallel size (a resumed run must have the same: each rank's rows are its own).

    Attributes:
      resent: rows sent again so far (a resume's or a replaced worker's).
    """

    def __init__(self, *, frontier: int = 0, ranks: int = 1):
        self.lock = threading.Lock()
        self.frontier, self.ranks = frontier, ranks
        self.sent: dict[Key, _Sent] = {}
        self.handed: dict[int, list[Key]] = {}  # pipeline step -> the rows handed over for it
        self.redo: list[Key] = []  # rows to send again before anything else (a resumed run's)
        self.resend = False
        self.resent = 0

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """What a checkpoint after the update of pipeline step ``step`` saves: the rows it has not trained, the frontier.

        A checkpoint holds it per data-parallel rank (its plain data is written per rank): each rank's rows are its own.
        """
        with self.lock:
            later = [k for s, keys in self.handed.items() if s > step for k in keys]
            for s in [s for s in self.handed if s <= step]:
                del self.handed[s]
            keys = sorted({*self.sent, *later, *self.redo})
            rows = torch.tensor(keys, dtype=torch.int64).reshape(-1, 2)
            return {"frontier": self.frontier, "rows": rows, "ranks": self.ranks}

    def restore_state(self, data: Mapping[str, Any]) -> None:
        """Continue from ``data`` (:meth:`checkpoint_state`'s): its rows are sent again first, then its frontier on.

        Raises:
          ValueError: ``data`` was saved at another data-parallel size (the book is left unchanged).
        """
        if int(data["ranks"]) != self.ranks:
            raise ValueError(
                f"resume: the checkpoint's carried rows (deploy.carry_over) were saved at data-parallel size "
                f"{int(data['ranks'])}, got {self.ranks}; expected the same size (each rank redoes its own rows)"
            )
        with self.lock:
            self.frontier = int(data["frontier"])
            self.redo = [(int(s), int(r)) for s, r in data["rows"].tolist()]

    def lost(self) -> None:
        """The worker was replaced (its rows in flight are gone): the next call sends every row not handed over."""
        with self.lock:
            self.resend = True


def carried(
    rollout: Stage,
    task: Any,
    *,
    rank: int,
    start: int,
    n: int,
    staleness: int,
    ahead: int | None = None,
    book: CarryBook | None = None,
) -> tuple[Stage, CarriedPrompts]:
    """The pipeline's rollout stage and prompt source with carry-over: each call trains whichever groups finished.

    Args:
      rollout: the worker's proxy stage (its ``fn`` sends a batch to the worker, which
        runs :class:`ContinuousRollout`).
      task: the prompt source (its ``loader(rank, start, n)`` and ``columns``).
      rank, start, n: as the loader takes them.
      staleness: ``deploy.staleness``: the call of iteration ``i`` returns no token older
        than version ``i - staleness``.
      ahead: how many later steps' prompts are in flight beside the current one's (default
        ``staleness - 1``): the call of iteration ``i`` sends the prompts up to step ``i + ahead``,
        so the worker decodes more groups than a batch and hands over those that finish first.
        A row starts at once, at about version ``i - 1``, so it is due by iteration
        ``i - 1 + staleness``: more ahead than that would only draw rows again.
      book: the rows sent and not trained (:class:`CarryBook`; a resumed run's, with the rows to
        redo); default: a new one. Prompt steps are sent from ``start`` at the earliest.

    Returns:
      ``(stage, source)``: the stage reads ``iteration`` (the slots' step) and writes the
      source's columns (but ``iteration``), ``prompt_step`` and the rollout's columns;
      the source's loader gives the slots (:class:`CarriedPrompts`, its ``book`` the one given).
      A call whose worker died (:class:`rlcore.dataflow.HandBack`) marks the book's rows lost.
    """
    ahead = max(0, staleness - 1) if ahead is None else ahead
    book = CarryBook() if book is None else book
    book.frontier = max(book.frontier, start)  # a book restored from no checkpoint starts at the run's start
    load = task.loader(rank, 0, n)  # by prompt step: a resumed run redoes rows of steps before its start
    kept = [c for c in task.columns if c not in ("iteration", "row", "prompts", "prompt_mask", "group")]
    ragged = {}  # the kept columns the loader gives as lists of rows

    def admit(step: int, only: set[int] | None = None) -> list[Key]:
        """Prompt step ``step``'s rows (those in ``only``) into the book; their keys."""
        src = load(step)
        for c in kept:
            ragged[c] = not isinstance(src[c], torch.Tensor)
        steps, rows, groups = src["iteration"].tolist(), src["row"].tolist(), src["group"].tolist()
        ids, on = src["prompts"].tolist(), src["prompt_mask"].tolist()
        keys = []
        for k, (s, r) in enumerate(zip(steps, rows)):
            if only is None or r in only:
                prompt = [t for t, m in zip(ids[k], on[k]) if m]
                book.sent[s, r] = _Sent(prompt, groups[k], {c: src[c][k] for c in kept})
                keys.append((s, r))
        return keys

    def to_send(i: int) -> list[Key]:
        """The rows call ``i`` sends: rows to redo or resend first, then the prompt steps up to ``i + ahead``."""
        keys: list[Key] = []
        if book.resend:  # a replaced worker: every row it held, again
            keys, book.resend = list(book.sent), False
            book.resent += len(keys)
        if book.redo:  # a resumed run: the rows the checkpoint's step had not trained
            redo: dict[int, set[int]] = {}
            for s, r in book.redo:
                redo.setdefault(s, set()).add(r)
            keys += [k for s in sorted(redo) for k in admit(s, redo[s])]
            book.resent += len(book.redo)
            book.redo = []
        for s in range(book.frontier, i + ahead + 1):
            keys += admit(s)
        book.frontier = max(book.frontier, i + ahead + 1)
        return keys

    def call(b: Batch) -> dict[str, Any]:
        i = int(b["iteration"][0])
        pad = task.tokenizer.pad_token_id
        with book.lock:
            for s in [s for s in book.handed if s < i - staleness - 1]:  # trained: the bound put their update first
                del book.handed[s]
            keys = to_send(i)
            if keys:
                prompts, prompt_mask = left_pad([book.sent[k].prompt for k in keys], pad)
            else:
                prompts = prompt_mask = torch.zeros(0, 1, dtype=torch.int64)
            send = {
                "prompts": prompts,
                "prompt_mask": prompt_mask,
                "iteration": torch.tensor([s for s, _ in keys], dtype=torch.int64),
                "row": torch.tensor([r for _, r in keys], dtype=torch.int64),
                "group": torch.tensor([book.sent[k].group for k in keys], dtype=torch.int64),
            }
        send["floor"] = torch.tensor([i - start - staleness])
        send["want"] = torch.tensor([b["iteration"].numel() // n])
        send["policy_version"] = b["policy_version"]
        try:
            out = dict(rollout.fn(send))
        except HandBack:
            book.lost()
            raise
        got = list(zip(out["prompt_step"].tolist(), out["row"].tolist()))
        with book.lock:
            back = [book.sent.pop(k) for k in got]
            book.handed.setdefault(i, []).extend(got)
        prompts, prompt_mask = left_pad([p.prompt for p in back], pad)
        columns: dict[str, Any] = {"prompts": prompts, "prompt_mask": prompt_mask}
        for c in kept:
            values = [p.kept[c] for p in back]
            columns[c] = values if ragged[c] else torch.stack(values)
        if "group" in task.columns:  # groups numbered in the order they came back (n rows each)
            columns["group"] = torch.arange(len(back) // n).repeat_interleave(n)
        return {**columns, **out}

    outputs = [*(c for c in task.columns if c != "iteration"), "prompt_step", *ROLLOUT_OUTPUTS]
    carry = stage(
        call,
        inputs=["iteration"],
        outputs=list(dict.fromkeys(outputs)),
        name=rollout.name,
        resource=rollout.resource,
        role="rollout",
        timeout=rollout.timeout,
    )
    return carry, CarriedPrompts(task, book)


class Carry(NamedTuple):
    """What :func:`with_carry_over` gives the trainer: the rollout stage and the prompt source."""

    rollout: Stage | None
    source: Any


def with_carry_over(
    cfg: Any, rollout: Stage | None, task: Any, world: Any, start: int, extras: Mapping[str, Any]
) -> Carry:
    """The run's rollout stage and prompt source: with ``deploy.carry_over`` the :func:`carried` pair, else as given.

    Args:
      cfg: the run's config.
      rollout, task: the deployment's rollout stage and the prompt source.
      world: the run's :class:`rlcore.train.World` (its data-parallel rank).
      start: the run's first step.
      extras: the run's stateful parts (:func:`rlcore.train.run_state.run_extras`): with carry-over,
        ``"carry"`` is the run's :class:`CarryBook` (a resumed run's restored, with the rows it had in flight).
    """
    if not cfg.deploy.carry_over:
        return Carry(rollout, task)
    assert rollout is not None  # carry-over is a disaggregated worker's (the config says so)
    stage_, source = carried(
        rollout,
        task,
        rank=world.dp_rank,
        start=start,
        n=cfg.rl.n_samples,
        staleness=cfg.deploy.staleness,
        book=extras["carry"],
    )
    return Carry(stage_, source)
