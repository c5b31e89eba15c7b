"""The budget mask: with ``room`` tokens left at a position, a token is legal only if the grammar
allows it and the output can still finish after it within ``room - 1`` tokens, EOS included.

"Can still finish" is the state's completion (``Constraint.completion``): a text llguidance has
accepted to the end, and the tokens that spell it. Every reply that starts with room for its
state's completion keeps it: the completion's first token leads to a state whose completion
takes one token fewer, so some token always fits, and the last one is EOS. The mask is a function
of (state, tokens left), so replies are distributed as masked sampling under the grammar and
budget masks together, with speculation or without (docs/exactness.md).

It is applied where a token is drawn, not as a row of the pass's masks: which tokens fit is
known per token (each needs its child's completion), and a row would need one for each of the
tens of thousands of tokens legal inside a string. A draw from the grammar-masked policy that
does not fit is drawn again without it, until one fits: that is a draw from the policy
restricted to the tokens that fit (a greedy row takes the next most likely). Deterministic
drafts are cut at their first token that does not fit (it could only be rejected); a draft
model's sampled tokens stay as drawn, since the acceptance rule gives a token distributed as the
grammar-masked policy whatever q was, and the redraw then restricts it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from ..constraints import FINISHED, Constraint
from .drafters import Draft
from .sample import draw

RANK_CHUNK = 64  # tokens taken from a sorted row at a time by ``ranked``


def fits(constraint: Constraint, state: int, token: int, room: int) -> bool:
    """Whether ``token`` is legal at ``state`` with ``room`` tokens left (it included)."""
    after = constraint.step(state, token)
    if after is None:
        return False
    if after == FINISHED:
        return room >= 1
    completion = constraint.completion(after)
    return completion is not None and completion.tokens <= room - 1


Allows = Callable[[int, int, int, list[int]], bool]  # (j, state, token, tokens before j)


def cut(allows: Allows, draft: Draft, states: list[int]):
    """A deterministic draft cut before its first token that ``allows`` refuses (it could
    only be rejected), and its states; a draft with sampled tokens unchanged."""
    if draft.probs is not None:
        return draft, states
    for j, token in enumerate(draft.tokens):
        if not allows(j, states[j], token, draft.tokens[:j]):
            return draft.truncate(j), states[: j + 1]
    return draft, states


def settle(
    allows: Allows,
    relaxed: Allows,
    states: list[int],
    drawn: list[int],
    redraws: Callable[[int], Iterator[int]],
) -> tuple[int, int] | None:
    """The first position whose drawn token ``allows`` refuses, and the token drawn there
    instead: ``redraws(j)`` yields the policy's draws at position j with each earlier one
    removed, the first it allows is taken. Where it allows none, ``relaxed`` (the budget alone,
    without the loop guard) rules that position. None if every drawn token is allowed.
    ``drawn``: the tokens the target drew, in order from ``states[0]`` (accepted drafts, then
    its own)."""
    for j, token in enumerate(drawn):
        if states[j] == FINISHED:  # after a drafted EOS: nothing more is committed
            return None
        before = drawn[:j]
        if allows(j, states[j], token, before):
            continue
        for rule in (allows, relaxed):
            if rule is relaxed and relaxed(j, states[j], token, before):
                break  # the guard stands aside here: the drawn token stays
            for other in redraws(j):
                if other != token and rule(j, states[j], other, before):
                    return j, other
        else:
            raise AssertionError("no token fits: the state was reached without room to finish")
    return None


def ranked(scores: torch.Tensor) -> Iterator[int]:
    """Token ids by descending score (V,), ties by id, those at -inf left out."""
    order = torch.argsort(scores, descending=True, stable=True)
    finite = int(torch.isfinite(scores).sum())
    for start in range(0, finite, RANK_CHUNK):
        yield from order[start : min(finite, start + RANK_CHUNK)].tolist()


def redrawn(probs: torch.Tensor, first: int, uniform: float) -> Iterator[int]:
    """Draws from ``probs`` (V,) with ``first`` removed, then each drawn one, by inverting the CDF
    at the uniform that drew ``first`` (``sample.verify_deterministic``), rescaled to where it
    fell within the removed token's mass: a fresh uniform on [0, 1), so each draw is one from
    the renormalised rest, and a row without drafts draws the same at this position."""
    p = probs.double().cpu().numpy().copy()
    cdf = np.cumsum(p)
    x = min(uniform * cdf[-1], np.nextafter(cdf[-1], 0.0))
    token = first
    while True:
        below = cdf[token] - p[token]
        u = min(max((x - below) / p[token], 0.0), np.nextafter(1.0, 0.0)) if p[token] > 0 else 0.0
        p[token] = 0.0
        cdf = np.cumsum(p)
        if cdf[-1] <= 0:
            return
        x = min(u * cdf[-1], np.nextafter(cdf[-1], 0.0))
        token = int(np.searchsorted(cdf, x, side="right"))
        yield token


def fresh_draws(probs: torch.Tensor, first: int, generator: torch.Generator) -> Iterator[int]:
    """Draws from ``probs`` (V,) with ``first`` and each drawn one removed, each with a new
    uniform from ``generator``."""
    p, token = probs.clone(), first
    while True:
        p[token] = 0.0
        if float(p.sum()) <= 0:
            return
        token = int(draw(p, generator))
        yield token
