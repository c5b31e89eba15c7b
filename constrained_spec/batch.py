"""Batched speculative decoding: many requests in flight, one target forward per round for all.

Each row is one request with its own prompt, constraint, sampling settings, seed, drafter and KV
cache. A round drafts for every row, verifies every row's draft in ONE forward (the weights are
read once for the whole batch), then applies the exact acceptance rule row by row, with one host
sync for the batch. Rows accept different numbers of drafts: each keeps its own cache, cropped to
its own committed length, so rejected drafts leave no holes to mask. A finished row's slot is
refilled from the queue at once (continuous batching).

A row computes what it would alone (the compact forward's rows are independent of each other), so
each row's output is distributed exactly as plain masked sampling, and greedy rows commit what
their single runs commit (on the 4-bit target bit for bit; a float target's dense LM head only up to
its last bits: a near-tie).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from . import cache as kv
from .compile import FINISHED, Constraint
from .decode import Stats, commit, legal_states, verify
from .draft import EMPTY_DRAFT, CompositeDrafter, Draft, Drafter
from .sample import SamplingConfig, greedy_outcome


@dataclass
class Row:
    """One request in flight: what it decodes under, and what it has committed so far."""

    index: int  # its position in the caller's list of requests
    prompt: list[int]
    constraint: Constraint
    sampling: SamplingConfig
    generator: torch.Generator
    drafter: Drafter | None
    max_new_tokens: int
    parse_json: bool = False  # a schema's row: its Result carries the parsed value
    cache: object = None
    tokens: list[int] = field(default_factory=list)
    state: int = 0
    stats: Stats = field(default_factory=Stats)
    started: float = 0.0

    @property
    def room(self) -> int:
        return self.max_new_tokens - (len(self.tokens) - len(self.prompt))

    @property
    def finished(self) -> bool:
        return self.state == FINISHED or self.room <= 0

    @property
    def finish_reason(self) -> str:
        return "stop" if self.state == FINISHED else "length"


def row_drafter(drafter: Drafter | None) -> Drafter | None:
    """A drafter of this row's own: forced tokens and prompt lookup keep per-request state, so
    each row gets a fresh copy. A draft model or head drafts one request at a time, so a row
    keeps only its forced and lookup tokens."""
    if not isinstance(drafter, CompositeDrafter):
        return None
    return dataclasses.replace(drafter, model=None, target_tokens=set())


def decode_batch(target, rows: Iterable[Row], batch_size: int) -> Iterator[Row]:
    """Decode ``rows``, at most ``batch_size`` at a time; yields each row as it finishes."""
    pending, active = iter(rows), []
    while True:
        while len(active) < batch_size and (row := next(pending, None)) is not None:
            admit(target, row)
            active.append(row)
        if not active:
            return
        batch_round(target, active)
        for row in [row for row in active if row.finished]:
            active.remove(row)
            row.stats.total_s = time.perf_counter() - row.started
            yield row


def admit(target, row: Row) -> None:
    """Start a row: prefill its prompt (all but its last token, which opens its first round)."""
    row.started = time.perf_counter()
    row.cache = kv.new_cache(target)
    if len(row.prompt) > 1:
        device = next(target.parameters()).device
        row.stats.cached_prompt_tokens = kv.prefill(
            target, row.cache, row.prompt[:-1], device
        ).cached
    if row.drafter is not None:
        row.drafter.begin(row.prompt, None)
    row.tokens, row.state = list(row.prompt), row.constraint.initial_state
    row.stats.prefill_s = time.perf_counter() - row.started


def batch_round(target, rows: list[Row]) -> None:
    """One round for every row: draft, ONE target forward over all rows' [last] + draft, the
    exact acceptance rule per row, one host sync, commit and roll back per row."""
    start = time.perf_counter()
    cap = WIDE_MAX_DRAFT if len(rows) >= WIDE_BATCH else None
    drafts, states = zip(
        *(legal_states(row.constraint, row.state, _propose(row, cap)) for row in rows)
    )
    drafted = time.perf_counter()
    device = next(target.parameters()).device
    fed = [[row.tokens[-1]] + draft.tokens for row, draft in zip(rows, drafts)]
    legal = torch.cat([row.constraint.masks(at, device) for row, at in zip(rows, states)])
    logits = kv.forward_rows(target, [row.cache for row in rows], fed, device, legal)
    outcomes = _verify(logits, legal, [len(f) for f in fed], drafts, rows)
    verified = time.perf_counter()
    for row, draft, row_states, (n, token) in zip(rows, drafts, states, outcomes):
        _commit(row, draft, n, token, row.constraint.step(row_states[n], token))
        row.stats.draft_s += drafted - start
        row.stats.verify_s += verified - drafted
        if row.stats.target_calls == 1:
            row.stats.ttft_s = verified - row.started


def _verify(
    logits: torch.Tensor,
    legal: torch.Tensor,
    sizes: list[int],
    drafts: list[Draft],
    rows: list[Row],
) -> list[tuple[int, int]]:
    """The exact acceptance rule for every row, (accepted length, the target's token), from ONE
    host sync. A greedy row needs only its positions' masked argmax, taken for the whole pass in
    one call (after a forward, each small call costs more than its work); a sampled row runs the
    full rule on its own positions."""
    bounds = list(zip(itertools.accumulate([0] + sizes), itertools.accumulate(sizes)))
    greedy = [row.sampling.greedy for row in rows]
    best = (
        logits.masked_fill(~legal, float("-inf")).argmax(-1)
        if any(greedy)
        else logits.new_empty(0, dtype=torch.long)
    )
    sampled = [
        torch.stack(verify(logits[a:b], legal[a:b], draft, row.sampling, row.generator))
        for (a, b), draft, row, g in zip(bounds, drafts, rows, greedy)
        if not g
    ]
    host = torch.cat([best, *sampled]).tolist()  # the round's one host sync
    best, sampled = host[: len(best)], iter(zip(host[len(best) :: 2], host[len(best) + 1 :: 2]))
    return [
        greedy_outcome(best[a:b], draft.tokens) if g else next(sampled)
        for (a, b), draft, g in zip(bounds, drafts, greedy)
    ]


# A wide pass is bound by the CPU's dot products, so every drafted token costs about what a
# committed one does: from WIDE_BATCH rows on, each row drafts at most WIDE_MAX_DRAFT tokens
# (tuned and reported in docs/batching.md, benchmarks/results/draft-caps/). The cap depends on
# the batch's size only (never on timings), so a seeded row samples the same tokens on every run.
WIDE_BATCH = 8
WIDE_MAX_DRAFT = 1


def _propose(row: Row, cap: int | None = None) -> Draft:
    if row.drafter is None or row.room <= 1:
        return EMPTY_DRAFT
    draft = row.drafter.propose(
        row.tokens, row.state, row.constraint, 0, row.sampling, row.generator
    )
    return draft.truncate(row.room - 1 if cap is None else min(row.room - 1, cap))


def _commit(row: Row, draft: Draft, n: int, token: int, state: int) -> None:
    """Commit the accepted drafts and the target's token; crop the row's cache to them."""
    committed = commit(row.tokens, row.cache, draft.tokens[:n] + [token], row.constraint.eos_id)
    row.state = FINISHED if committed[-1] == row.constraint.eos_id else state
    row.stats.record(draft, n)
    if row.drafter is not None:
        row.drafter.observe(committed, None)
