"""The decode loop: draft → verify (ONE target forward) → commit → roll back the rest.

A request in flight is a ``Row``: its prompt, constraint, sampling settings, seed, drafter and
KV cache. ``step`` runs one round for every row of a batch: each row drafts, one forward of the
target verifies every row's draft (the weights are read once for all of them), the exact
acceptance rule runs per row, with one host sync for the batch, and each row commits and rolls
back on its own. A single request is a batch of one: the same rows, the same step, so
exactness lives in one place.

Rows accept different numbers of drafts: each keeps its own cache, cropped to its own committed
length, so rejected drafts leave no holes to mask. A row computes what it would alone (the
compact forward's rows do not depend on each other), so each row's output is distributed exactly
as plain masked sampling, and greedy rows commit what their single runs commit (on the 4-bit
target bit for bit; a float target's dense LM head only up to its last bits: a near-tie).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..constraints import FINISHED, Constraint
from ..model import kernels, kv, machine
from . import budget, cost, repeats
from .drafters import EMPTY_DRAFT, Draft, Drafter
from .sample import (
    SamplingConfig,
    greedy_outcome,
    policy,
    rewind,
    verify_deterministic,
    verify_sampled,
)
from .text import ReplyText


@dataclass(frozen=True)
class Round:
    """What one round committed for one row (only committed tokens, never drafts that were
    rolled back, except as ``drafted`` for display)."""

    drafted: list[int]  # the draft proposed this round (verified up to its first illegal token)
    accepted: int  # how many of its tokens the target accepted
    token: int  # the target's own token: correction (accepted < drafted) or bonus
    committed: list[int]  # drafted[:accepted] + [token], cut after EOS
    sources: tuple[str, ...] = ()  # each drafted token's source: forced/grammar/lookup/model


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the distribution it was drawn from: the
    masked, renormalised policy distribution (for a greedy row, the masked distribution at
    temperature 1), with the most likely alternatives there."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first; legal only


@dataclass
class Stats:
    target_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # histogram: rounds by accepted n
    accepted_by_position: list[int] = field(default_factory=list)  # drafts accepted at index i
    drafted_by_position: list[int] = field(default_factory=list)
    drafted_by_source: dict[str, int] = field(default_factory=dict)  # forced/grammar/lookup/model
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    cached_prompt_tokens: int = 0  # prompt tokens copied from a kept prompt (llama.PromptCache)
    budget_removed: int = 0  # positions where the budget mask removed the token drawn first
    repeats_removed: int = 0  # and where the loop guard did (decoding/repeats.py)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    ttft_s: float = 0.0  # prompt in → first committed token
    total_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def record(self, draft: Draft, accepted: int) -> None:
        drafted = len(draft)
        self.target_calls += 1
        self.drafted += drafted
        self.accepted += accepted
        for i, source in enumerate(draft.sources):
            self.drafted_by_source[source] = self.drafted_by_source.get(source, 0) + 1
            self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + (
                i < accepted
            )
        for hist, n in (
            (self.accepted_lengths, accepted + 1),
            (self.drafted_by_position, drafted),
            (self.accepted_by_position, accepted),
        ):
            hist.extend([0] * (n - len(hist)))
        self.accepted_lengths[accepted] += 1
        for i in range(drafted):
            self.drafted_by_position[i] += 1
        for i in range(accepted):
            self.accepted_by_position[i] += 1


@dataclass
class AdaptiveK:
    """Draft-model tokens per round, chosen to maximise the expected tokens per unit of cost
    (1 − α^(k+1)) / ((1 − α)(k·c + 1)) (Leviathan et al. 2023, §3.4), from running estimates of
    α (acceptance of a model-drafted token) and c (draft step cost / target verify cost)."""

    k_max: int
    alpha: float = 0.7  # prior until the first rounds are seen
    cost: float = 0.4  # prior: an int8 copy of the target costs ≈ 0.4 of a target step
    decay: float = 0.8  # weight of the past in the running estimates

    def choose(self) -> int:
        a, c = min(self.alpha, 0.99), self.cost
        gain = lambda k: (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))
        return max(range(1, self.k_max + 1), key=gain)  # k ≥ 1 keeps α observable

    def update(self, draft: Draft, accepted: int, draft_s: float, verify_s: float) -> None:
        model_positions = [i for i, s in enumerate(draft.sources) if s == "model"]
        for i in model_positions:
            if i <= accepted:  # reached: every token before it was accepted
                self.alpha = self.decay * self.alpha + (1 - self.decay) * (i < accepted)
        if model_positions and verify_s > 0:
            step_cost = draft_s / len(model_positions) / verify_s
            self.cost = self.decay * self.cost + (1 - self.decay) * step_cost


@dataclass
class Row:
    """One request in flight: what it decodes under, and what it has committed so far."""

    prompt: list[int]
    constraint: Constraint
    sampling: SamplingConfig
    generator: torch.Generator
    drafter: Drafter | None  # None: the masked baseline
    max_new_tokens: int
    num_draft_tokens: int = 4  # draft-model tokens per round (AdaptiveK's bound where adaptive)
    adaptive: AdaptiveK | None = None
    index: int = 0  # its position in the caller's list of requests
    reply: ReplyText | None = None  # its text and stop strings; None: ended by EOS alone
    logprobs: int | None = None  # None: none kept; k: each token's log-prob and k alternatives
    budget_mask: bool = True  # only tokens after which the reply can finish in time (budget.py)
    loop_guard: bool = False  # no immediate repeat of a stretch of the reply (repeats.py)
    cache: object = None
    tokens: list[int] = field(default_factory=list)  # prompt + committed
    state: int = 0
    stats: Stats = field(default_factory=Stats)
    started: float = 0.0
    scores: list[TokenLogprob] = field(default_factory=list)  # per committed token, if kept
    acceptance: Acceptance = field(default_factory=lambda: Acceptance())

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def room(self) -> int:
        return self.max_new_tokens - len(self.output)

    @property
    def per_token(self) -> bool:
        """Whether a mask applies where tokens are drawn: the budget mask or the loop guard."""
        return self.budget_mask or self.loop_guard

    def fits(self, j: int, state: int, token: int, before: list[int]) -> bool:
        """Whether the budget mask (where the row has one) lets ``token`` follow ``state``, j
        tokens into this round."""
        return not self.budget_mask or budget.fits(self.constraint, state, token, self.room - j)

    def allows(self, j: int, state: int, token: int, before: list[int]) -> bool:
        """``fits``, and the loop guard (where the row has one) lets ``token`` follow the
        reply and ``before`` (this round's tokens before it)."""
        if not self.fits(j, state, token, before):
            return False
        lengths = self.reply.vocab.token_lengths
        return not (self.loop_guard and repeats.repeats(self.output + before, token, lengths))

    @property
    def finished(self) -> bool:
        return self.state == FINISHED or self.room <= 0

    @property
    def finish_reason(self) -> str:
        """ "stop" iff EOS or a stop string ended it (either only where the text is complete);
        "budget" if so after the budget mask removed a token the target drew (the reply is
        complete, made to finish within ``max_new_tokens``); else "length" (``max_new_tokens``
        or the context)."""
        if self.state != FINISHED:
            return "length"
        return "budget" if self.stats.budget_removed else "stop"

    @property
    def reads_features(self) -> bool:
        """Whether its drafter reads the target's features (a trained draft head)."""
        return self.drafter is not None and self.drafter.uses_features


def decode(target, rows: Iterable[Row], batch_size: int) -> Iterator[tuple[Row, Round]]:
    """Decode ``rows``, at most ``batch_size`` at a time, a finished row's slot refilled at once
    (continuous batching); yields (row, round) for every row each round, so a caller sees each
    row's committed tokens as they come and ``row.finished`` once it is done. Decoding runs only
    while the caller iterates: closing the iterator stops it."""
    pending, active = iter(rows), []
    while True:
        while len(active) < batch_size and (row := next(pending, None)) is not None:
            admit(target, row)
            active.append(row)
        if not active:
            return
        for row, r in zip(active, step(target, active)):
            if row.finished:
                row.stats.total_s = time.perf_counter() - row.started
            yield row, r
        active = [row for row in active if not row.finished]


def admit(target, row: Row) -> None:
    """Start a row: prefill its prompt (all but its last token, which opens its first round)."""
    row.started = time.perf_counter()
    row.cache = kv.new_cache(target)
    device = next(target.parameters()).device
    features = torch.empty(0, 0, device=device) if row.reads_features else None
    if len(row.prompt) > 1:
        features, row.stats.cached_prompt_tokens = kv.prefill(
            target, row.cache, row.prompt[:-1], device, row.reads_features
        )
    if row.drafter is not None:
        row.drafter.begin(row.prompt, features)
    row.tokens, row.state = list(row.prompt), row.constraint.initial_state
    row.stats.prefill_s = time.perf_counter() - row.started


def step(target, rows: list[Row]) -> list[Round]:
    """One round for every row: draft, choose how much of each draft the pass verifies
    (``plan``), ONE target forward over all rows' [last committed] + draft, the exact acceptance
    rule per row (one host sync), commit and roll back per row."""
    start = time.perf_counter()
    machine.follow_free_cores()  # the same reply on any count: fewer where others keep cores
    proposed = [propose(row) for row in rows]
    drafts, states = zip(*(legal_states(r.constraint, r.state, d) for r, d in zip(rows, proposed)))
    drafts, states = zip(*(fitting(r, d, at) for r, d, at in zip(rows, drafts, states)))
    lengths = plan(cost.pass_cost(target, len(rows)), rows, drafts)
    proposed = [p if k == len(d) else p.truncate(k) for p, d, k in zip(proposed, drafts, lengths)]
    drafts = [d.truncate(k) for d, k in zip(drafts, lengths)]
    states = [at[: k + 1] for at, k in zip(states, lengths)]
    drafted = time.perf_counter()
    device = next(target.parameters()).device
    fed = [[row.tokens[-1]] + draft.tokens for row, draft in zip(rows, drafts)]  # n_i = k_i + 1
    legal = torch.cat([legal_masks(row.constraint, at, device) for row, at in zip(rows, states)])
    features = any(row.reads_features for row in rows)
    logits, hidden = kv.forward_rows(  # (Σ n_i, V), (Σ n_i, d) or None
        target, [row.cache for row in rows], fed, device, legal, features
    )
    outcomes = verify(logits, legal, [len(f) for f in fed], drafts, rows, states)  # host sync
    times = (drafted - start, time.perf_counter() - drafted)
    rounds, at = [], 0
    for row, draft, row_states, (n, token, scores), shown in zip(
        rows, drafts, states, outcomes, proposed
    ):
        committed = commit(
            row, draft.tokens[:n] + [token], row.constraint.step(row_states[n], token)
        )
        row.scores += scores[: len(committed)]
        seen = hidden[at : at + len(committed)] if row.reads_features else None  # (n + 1, d)
        learn(row, draft, n, committed, seen, times)
        at += len(draft) + 1
        rounds.append(Round(shown.tokens, n, token, committed, shown.sources))
    return rounds


def learn(row: Row, draft: Draft, n: int, committed: list[int], features, times) -> None:
    """After a row's round: its stats, its adaptive k's estimates, what its drafter sees."""
    draft_s, verify_s = times
    row.stats.record(draft, n)
    row.stats.draft_s += draft_s
    row.stats.verify_s += verify_s
    if row.stats.target_calls == 1:
        row.stats.ttft_s = time.perf_counter() - row.started
    row.acceptance.update(draft, n)
    if row.adaptive is not None:
        row.adaptive.update(draft, n, draft_s, verify_s)
    if row.drafter is not None:
        row.drafter.observe(committed, features)


def propose(row: Row) -> Draft:
    """The row's draft for this round, leaving room for the target's own token."""
    if row.drafter is None or row.room <= 1:
        return EMPTY_DRAFT
    k = row.adaptive.choose() if row.adaptive is not None else row.num_draft_tokens
    draft = row.drafter.propose(
        row.tokens, row.state, row.constraint, k, row.sampling, row.generator
    )
    return draft.truncate(row.room - 1)


# --- load-aware speculation: how much of each row's draft a round verifies ----------------------

# Each draft token's chance of acceptance, by source, before a row has seen its own: a prior of
# PRIOR_WEIGHT observations. "forced" tokens have p = 1 and are never rejected. Measured on the
# tuning split (the dev set's --seed 1 selection, 16 requests, B = 4 with every draft verified):
# grammar 0.77 / 0.82 (extract, T = 0 / 0.7), 0.70 / 0.72 (generate); lookup 0.84 / 0.80,
# 0.88 / 0.72.
PRIOR = {"grammar": 0.75, "lookup": 0.8, "model": 0.7}
PRIOR_WEIGHT = 2.0
HOST_MS_PER_ROW = 0.1  # a row's share of a round outside the pass (masks, rule, commit)


@dataclass
class Acceptance:
    """A row's running estimate of each draft source's acceptance: of the draft tokens the
    verification reached (every token before them accepted), how many were accepted."""

    hits: dict[str, float] = field(default_factory=dict)
    reached: dict[str, float] = field(default_factory=dict)

    def alpha(self, source: str) -> float:
        if source == "forced":
            return 1.0
        prior = PRIOR.get(source, 0.5)
        hits, reached = self.hits.get(source, 0.0), self.reached.get(source, 0.0)
        return (hits + PRIOR_WEIGHT * prior) / (reached + PRIOR_WEIGHT)

    def update(self, draft: Draft, accepted: int) -> None:
        for i, source in enumerate(draft.sources[: accepted + 1]):  # reached: i <= accepted
            self.reached[source] = self.reached.get(source, 0.0) + 1
            self.hits[source] = self.hits.get(source, 0.0) + (i < accepted)


def plan(costs: cost.PassCost | None, rows: list[Row], drafts: list[Draft]) -> list[int]:
    """How many of each row's draft tokens this round verifies (0: the row takes a baseline
    step), for the most expected committed tokens per millisecond of the round.

    A row's j-th draft token is committed with the chance that it and every token before it
    are accepted (the product of the row's acceptance estimates by source); the round costs
    the measured pass of its rows and tokens (``cost.PassCost``), plus HOST_MS_PER_ROW a row
    and the rule's measured host work per verified position (a sampled row's policy and draw
    cost more than a greedy row's argmax). Greedy marginal allocation: every row starts at 0
    drafts, and draft tokens are added in order of expected gain per cost (a row's fall along
    its draft, so each row gets a prefix); the count with the best ratio wins (the fewest
    tokens on a tie).

    Exact: the drafts are deterministic (forced, grammar and lookup tokens, or a greedy
    model's argmax): functions of the rows' committed tokens, drawn before no random number,
    so cutting them by position keeps the rule exact. A draft that holds sampled tokens (q
    rows: a draft model at T > 0) was drawn already: it is kept whole, as its length was
    chosen before drawing. The choice reads no clock: a seeded batch samples the same tokens
    on every run."""
    lengths = [len(d) for d in drafts]
    if costs is None or not any(lengths):
        return lengths
    rows_n = len(rows)
    expected, fed, extra, candidates = float(rows_n), rows_n, 0.0, []
    marginal = (costs.ms(rows_n, 2 * rows_n) - costs.ms(rows_n, rows_n)) / rows_n  # a token's
    for i, (row, draft) in enumerate(zip(rows, drafts)):
        chance, sampled = 1.0, draft.probs is not None
        host = costs.greedy_ms if row.sampling.greedy else costs.sampled_ms  # a position's rule
        for source in draft.sources:
            chance *= row.acceptance.alpha(source)
            if sampled:  # kept whole: its tokens are in every plan
                expected, fed, extra = expected + chance, fed + 1, extra + host
            else:  # by gain per cost: a row's ratios fall along its draft, so it gets a prefix
                candidates.append((-chance / (marginal + host), chance, host, i))
    candidates.sort()
    fixed = HOST_MS_PER_ROW * rows_n
    best, best_ratio = 0, expected / (costs.ms(rows_n, fed) + fixed + extra)
    for m, (_, chance, host, _) in enumerate(candidates, 1):
        expected, extra = expected + chance, extra + host
        ratio = expected / (costs.ms(rows_n, fed + m) + fixed + extra)
        if ratio > best_ratio:
            best, best_ratio = m, ratio
    lengths = [len(d) if d.probs is not None else 0 for d in drafts]
    for *_, i in candidates[:best]:
        lengths[i] += 1
    return lengths


def legal_states(constraint: Constraint, state: int, draft: Draft) -> tuple[Draft, list[int]]:
    """The draft cut at its first illegal token, and the automaton states before each of its
    tokens and after the last (state_i = the state after draft[:i]). Drafters should not propose
    an illegal token; sampled drafts must come from a masked q, since cutting an unmasked
    sampled draft would bias the output."""
    states = [state]
    for token in draft.tokens:
        after = constraint.step(states[-1], token)
        if after is None:  # p(token) = 0: it could only be rejected, so the draft ends here
            return draft.truncate(len(states) - 1), states
        states.append(after)
    return draft, states


def fitting(row: Row, draft: Draft, states: list[int]) -> tuple[Draft, list[int]]:
    """The draft and its states, a deterministic draft cut before its first token that the
    budget mask or the loop guard removes (budget.cut) where the row has one."""
    return budget.cut(row.allows, draft, states) if row.per_token else (draft, states)


def legal_masks(constraint: Constraint, states: list[int], device) -> torch.Tensor:
    """The legal tokens at ``states``, (len(states), V) bool: the constraint's bitmasks unpacked
    by the target's compiled code where it is built (one call), else by the constraint."""
    compiled = kernels.fused_if_built()
    if compiled is None or len(states) == 1:  # one state: the constraint's cached mask
        return constraint.masks(states, device)
    masks = compiled.unpack_bits(constraint.bitmasks(states), constraint.vocab_size)
    return masks if masks.device == torch.device(device) else masks.to(device)


def verify(
    logits: torch.Tensor,
    legal: torch.Tensor,
    sizes: list[int],
    drafts: list[Draft],
    rows: list[Row],
    states: list[list[int]],
) -> list[tuple[int, int, list[TokenLogprob]]]:
    """The exact acceptance rule for every row, (accepted length, the target's token, the
    log-probs of draft[:accepted] + [token] where the row keeps them), from ONE host sync.
    ``logits``, ``legal``: (Σ sizes, V), each row's [last committed] + draft in turn; ``states``:
    each row's automaton states along its draft. A greedy row needs only its positions' masked
    argmax, taken for the whole pass in one call (after a forward, each small call costs more
    than its work); a sampled row with a deterministic draft (or none) draws the target's own
    token at each of its positions and keeps the draft up to the first that differs
    (``sample.verify_deterministic``: a seeded row then commits the same tokens however much it
    drafts); one with sampled draft tokens runs Leviathan's rule against the q they were drawn
    from. Then each row's budget mask (``within_budget``)."""
    bounds = list(zip(itertools.accumulate([0] + sizes), itertools.accumulate(sizes)))
    greedy = [row.sampling.greedy for row in rows]
    masked = logits.masked_fill(~legal, float("-inf")) if any(greedy) else None
    best = masked.argmax(-1) if any(greedy) else logits.new_empty(0, dtype=torch.long)
    sent = []  # per row: (n, token) of a sampled row, then its scores if it keeps them
    rewinds = {}  # row index → its generator's state before a deterministic draft's draws
    probs = {}  # row index → a sampled row's p rows (k+1, V)
    for i, ((a, b), draft, row, g) in enumerate(zip(bounds, drafts, rows, greedy)):
        if g:
            if row.logprobs is not None:  # the committed tokens are the argmaxes
                sent.append(scored(masked[a:b].log_softmax(-1), best[a:b], row.logprobs))
            continue
        target_probs = probs[i] = policy(logits[a:b], legal[a:b], row.sampling)  # (k+1, V)
        draft_ids = torch.tensor(draft.tokens, dtype=torch.long, device=logits.device)  # (k,)
        if draft.probs is None:  # deterministic: the target's own draws (the same tokens
            if len(draft) or row.per_token:  # whatever the row drafts), its generator
                rewinds[i] = row.generator.get_state()  # rewound after the sync
            n, token, tokens = verify_deterministic(target_probs, draft_ids, row.generator)
        else:
            n, token = verify_sampled(target_probs, draft.probs, draft_ids, row.generator)
            tokens = torch.cat([draft_ids, token[None]])  # (k+1,): draft[:n] + [token] at ≤ n
            tokens[n] = token
        sent.append(torch.stack([n, token]))
        if row.logprobs is not None:
            sent.append(scored(target_probs.log(), tokens, row.logprobs))
    best, *host = to_host([best, *sent])  # the round's one host sync
    best, host, outcomes = [int(t) for t in best], iter(host), []
    for i, ((a, b), draft, row, g) in enumerate(zip(bounds, drafts, rows, greedy)):
        n, token = greedy_outcome(best[a:b], draft.tokens) if g else map(int, next(host))
        keeps = row.logprobs is not None
        kept = (
            read_scores(next(host), b - a, [*draft.tokens[:n], token], row.logprobs)
            if keeps
            else []
        )
        if row.per_token:
            position = Position(logits[a:b], legal[a:b], probs.get(i), rewinds.get(i))
            n, token, kept = within_budget(row, draft, states[i], (n, token), position, kept)
        if i in rewinds and n < len(draft):  # k + 1 uniforms drawn, n + 1 used
            rewind(row.generator, rewinds[i], n + 1)
        outcomes.append((n, token, kept[: n + 1]))
    return outcomes


@dataclass(frozen=True)
class Position:
    """What a row's pass gave at its positions, for the budget mask's redraws: logits and
    legal masks (k+1, V), a sampled row's p rows and its generator's state before its draws
    (a deterministic draft's; None: its draws are fresh)."""

    logits: torch.Tensor
    legal: torch.Tensor
    probs: torch.Tensor | None
    before: torch.Tensor | None


def within_budget(row: Row, draft: Draft, states, outcome, position: Position, kept: list):
    """(n, token, log-probs) once the budget mask and the loop guard are applied: the target's
    drawn tokens are checked in order, and the first that one of them removes is drawn again
    from the same policy without it (budget.settle); the round then commits up to that
    position. A log-prob kept for the new token is its policy's (the grammar-masked policy's,
    not renormalised)."""
    n, token = outcome
    drawn = draft.tokens[:n] + [token]
    redraws = lambda j: redraws_at(row, position, drawn[j], j)  # noqa: E731
    settled = budget.settle(row.allows, row.fits, states, drawn, redraws)
    if settled is None:
        return n, token, kept
    n, token = settled
    if row.fits(n, states[n], drawn[n], drawn[:n]):
        row.stats.repeats_removed += 1
    else:
        row.stats.budget_removed += 1
    if kept:
        rows = position.logits[n].masked_fill(~position.legal[n], float("-inf")).log_softmax(-1)
        if position.probs is not None:
            rows = position.probs[n].log()
        kept = kept[:n] + [dataclasses.replace(kept[n], token=token, logprob=float(rows[token]))]
    return n, token, kept


def redraws_at(row: Row, position: Position, first: int, j: int) -> Iterator[int]:
    """The tokens the row's policy draws at its position j once ``first`` and each later one
    are removed; then, where the policy's support runs out (top-k, top-p) or for a greedy row,
    the legal tokens by descending logit."""
    if position.probs is not None and position.before is not None:  # a deterministic draft:
        replay = torch.Generator(device=position.probs.device)  # the uniform that drew first
        replay.set_state(position.before)
        drawn = position.probs.shape[0]  # as many as verify_deterministic drew: k + 1
        uniform = torch.rand(drawn, generator=replay, dtype=torch.float64, device=replay.device)
        yield from budget.redrawn(position.probs[j], first, float(uniform[j]))
    elif position.probs is not None:  # Leviathan's rule drew it: fresh draws
        yield from budget.fresh_draws(position.probs[j], first, row.generator)
    yield from budget.ranked(position.logits[j].masked_fill(~position.legal[j], float("-inf")))


def scored(logprobs: torch.Tensor, tokens: torch.Tensor, top: int) -> torch.Tensor:
    """Each position's token's log-prob and its ``top`` most likely tokens, flat for the
    transfer: (m, V) log-probs, (m,) tokens → (m + 2·m·top,)."""
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]  # (m,)
    alternatives = logprobs.topk(top, dim=-1)  # (m, top) values and ids
    return torch.cat([chosen, alternatives.values.flatten(), alternatives.indices.flatten()])


def read_scores(flat: list[float], m: int, committed: list[int], top: int) -> list[TokenLogprob]:
    """``scored``'s values back on the host (``m`` positions), for the committed tokens."""
    chosen, values, ids = flat[:m], flat[m : m + m * top], flat[m + m * top :]
    return [
        TokenLogprob(
            token,
            chosen[i],
            tuple(
                (int(ids[i * top + j]), values[i * top + j])
                for j in range(top)
                if values[i * top + j] > float("-inf")  # illegal tokens are no alternative
            ),
        )
        for i, token in enumerate(committed)
    ]


def to_host(tensors: list[torch.Tensor]) -> list[list[float]]:
    """Each tensor's values as a flat list, from ONE device-to-host copy (float64 holds token
    ids exactly, and the log-probs of the float32 rows)."""
    flat = torch.cat([t.reshape(-1).double() for t in tensors]).tolist()
    bounds = itertools.accumulate([0] + [t.numel() for t in tensors])
    return [flat[a:b] for a, b in itertools.pairwise(bounds)]


def commit(row: Row, committed: list[int], state: int) -> list[int]:
    """Append a round's accepted drafts + the target's token to the row, cut after an EOS (a
    draft may end in one: nothing after it counts), and crop its cache to them (the rejected
    drafts' entries go). Returns what was committed."""
    eos = row.constraint.eos_id
    if eos in committed:
        committed = committed[: committed.index(eos) + 1]
    if row.reply is not None:  # then cut after a stop string that ends the reply
        committed = row.reply.extend(committed)
    row.tokens += committed
    stopped = row.reply is not None and row.reply.end is not None
    row.state = FINISHED if committed[-1] == eos or stopped else state
    kv.crop(row.cache, len(row.tokens) - 1)
    assert kv.cached_length(row.cache) == len(row.tokens) - 1, "target cache out of step"
    return committed
