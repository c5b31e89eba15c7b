"""The loop guard (``loop_guard=True``; off by default): no token that completes a second copy,
right after the first, of a stretch of the reply at least MIN_BYTES long. A small model that
starts repeating an array item (``"soccer","soccer",...``), a phrase or a pair of coordinates
goes on until the budget runs out; with the guard the copy cannot close, so the model takes its
next choice there: most often it ends the array or the string.

It changes the distribution, so it is off unless asked for. Replies are then distributed as
masked sampling under the grammar, the budget and this mask, which is a function of the reply
so far; where it would leave no legal token that fits the budget, it stands aside at that
position (a grammar that forces the repeated token). Applied where a token is drawn, as the
budget mask is (budget.settle): drafts and target alike.

Identical consecutive items of at least MIN_BYTES each are what it removes: an array that should
hold two equal long items cannot (two equal short ones can, "[0,0]").
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_BYTES = 8  # the shortest stretch whose immediate repeat is refused
MAX_PERIOD = 64  # tokens: a longer stretch is never compared


def repeats(reply: Sequence[int], token: int, lengths: Sequence[int]) -> bool:
    """Whether ``reply + [token]`` ends with two equal stretches of p tokens each, one right
    after the other, the stretch at least MIN_BYTES long (``lengths``: bytes per token id)."""
    n = len(reply) + 1
    for p in range(1, min(MAX_PERIOD, n // 2) + 1):
        if reply[-p] != token:  # the copy's last token: its twin one stretch back
            continue
        if any(reply[-i] != reply[-i - p] for i in range(1, p)):
            continue
        if lengths[token] + sum(lengths[t] for t in reply[n - p :]) >= MIN_BYTES:
            return True
    return False
