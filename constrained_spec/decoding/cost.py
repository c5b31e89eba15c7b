"""What a target pass costs by its size: the table load-aware speculation (``loop.plan``) weighs
each row's drafts against.

A pass of R rows feeding N tokens in all (each row its last committed token and its draft) is
timed once per machine and model shape, on a grid of R and tokens per row, and cached in the
measurement cache (``machine.remembered``), each row count on its own: a load measures the rows
one request needs (1 and 2: about a second for the default model, where the whole grid took 7 s
inside the first request), a server or a batch the rows it will run, before its first request.
Decoding reads the table back and never times itself, so a seeded row samples the same tokens on
every run.
"""

from __future__ import annotations

import bisect
import math
import time
import weakref
from dataclasses import dataclass, field

import torch

from ..model import kernels, machine
from ..model.llama import CompactLlama
from ..model.models import shape_key
from .sample import SamplingConfig, policy, verify_deterministic

# The grid: rows per pass, and tokens each row feeds (1: the baseline step, 1 + k: k drafts).
GRID_ROWS = (1, 2, 4, 8, 16)
GRID_FED = (1, 2, 4, 6)
CONTEXT = 256  # positions each row's cache holds while timed (a short prompt and some output)
CHAIN = 31  # tokens of the model's own greedy text that the timed context repeats
REPEATS = 5  # each point: the fastest of these, taken in turns over the points
# Part of the cache key: a new method invalidates the cached tables.
METHOD = (
    "pass cost v5: a row count at a time, 1-6 tokens each, 256 cached of the model's own greedy "
    "text, whole head, best of 5 taken in turns"
)


@dataclass(frozen=True)
class PassCost:
    """Milliseconds of one pass by (rows, tokens fed in all), interpolated from a measured grid
    (linear in the tokens at each measured row count, then linear in the rows; beyond the grid
    it goes on along the last segment)."""

    grid: dict[int, list[tuple[int, float]]]  # rows → [(tokens fed in all, ms)], tokens rising
    # what one more verified position adds to the rule on the host: a sampled row's (its policy
    # over the vocabulary and its draw), a greedy row's (its share of the masked argmax)
    sampled_ms: float = 0.0
    greedy_ms: float = 0.0
    _known: dict = field(default_factory=dict, compare=False, repr=False)  # (rows, tokens) → ms

    def ms(self, rows: int, tokens: int) -> float:
        if (known := self._known.get((rows, tokens))) is not None:
            return known
        self._known[rows, tokens] = ms = self._interpolate(rows, tokens)
        return ms

    def _interpolate(self, rows: int, tokens: int) -> float:
        counts = sorted(self.grid)
        i = min(max(bisect.bisect_left(counts, rows), 1), len(counts) - 1)
        if len(counts) == 1:
            return _along(self.grid[counts[0]], tokens)
        lo, hi = counts[i - 1], counts[i]
        per_row = tokens / rows  # the same mix of drafts at the neighbouring row counts
        a, b = _along(self.grid[lo], per_row * lo), _along(self.grid[hi], per_row * hi)
        return a + (b - a) * (rows - lo) / (hi - lo)


def _along(points: list[tuple[int, float]], x: float) -> float:
    """Linear interpolation through ``points`` (x rising), extended along the end segments."""
    if len(points) == 1:
        return points[0][1]
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


_known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target → PassCost | None
_used: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target → the table ``use`` set


def row_counts(rows: int) -> list[int]:
    """The grid's row counts a pass of ``rows`` rows is interpolated from: those below it and
    the first at or above it (the last beyond the grid), two at least."""
    counts = [r for r in GRID_ROWS if r < rows] + [r for r in GRID_ROWS if r >= rows][:1]
    return counts if len(counts) > 1 else list(GRID_ROWS[:2])


def pass_cost(target, rows: int = 1) -> PassCost | None:
    """The target's pass costs for passes of up to ``rows`` rows: set by ``use``, else measured
    once per machine, model shape and row count (row_counts; a second for the default model's
    1 and 2 rows) and cached; None for a target whose rows do not share a pass (transformers'
    forward runs them one after another: a row's drafts cost it alone, so it keeps them)."""
    if target in _used:
        return _used[target]
    known = _known.get(target, False)
    if known is None or (known and set(row_counts(rows)) <= set(known.grid)):
        return known
    if not isinstance(target, CompactLlama):
        _known[target] = None
        return None
    way = f"{target.weights} {target.layer_kernel}/{target.matmul} {type(target.lm_head).__name__}"
    key = f"pass costs | {METHOD} | {shape_key(target.config)} | {way}"
    said = []

    def announced(measure):  # one line for all that this call measures
        def run():
            if not said:
                said.append(True)
                machine.say("measuring this model's pass costs on this CPU, once ...")
            return measure()

        return run

    grid = {}
    for count in row_counts(rows):
        measure = announced(lambda count=count: {"points": measure_rows(target, count)})
        entry = machine.remembered(f"{key} | {count} rows", measure, valid=_whole)
        grid[count] = [tuple(point) for point in entry["points"]]
    measure = announced(lambda: dict(zip(RULE, rule_ms(target))))
    rule = machine.remembered(f"{key} | the rule", measure, valid=_rule)
    _known[target] = cost = PassCost(grid, rule["sampled_ms"], rule["greedy_ms"])
    return cost


RULE = ("sampled_ms", "greedy_ms")


def _whole(entry: dict) -> bool:
    """A stored row count this version reads: every grid point a finite time."""
    points = entry["points"]
    return len(points) == len(GRID_FED) and all(
        len(p) == 2 and all(isinstance(v, (int, float)) and math.isfinite(v) for v in p)
        for p in points
    )


def _rule(entry: dict) -> bool:
    return all(isinstance(entry[k], (int, float)) and math.isfinite(entry[k]) for k in RULE)


def use(target, cost: PassCost | None) -> None:
    """Decode on ``target`` with these pass costs (tests; None: each row keeps its whole draft)
    until ``_used.pop(target)``."""
    _used[target] = cost


@torch.inference_mode()
def measure(target: CompactLlama) -> PassCost:
    """The whole grid, measured now (``constrained-spec calibrate``'s table, tests)."""
    grid = {rows: measure_rows(target, rows) for rows in GRID_ROWS}
    return PassCost(grid, *rule_ms(target))


@torch.inference_mode()
def measure_rows(target: CompactLlama, rows: int) -> list[tuple[int, float]]:
    """Time passes of ``rows`` rows, each after CONTEXT cached positions, each feeding n tokens
    of GRID_FED, the caches cut back after each pass: [(tokens fed in all, ms)], the fastest of
    REPEATS per point. The points take turns (1, 2, 4, 6, 1, 2, ...): a burst of other work on
    a shared machine then slows one pass of several points, not every pass of one (a Gemma 3
    table timed a point at a time read 4-fed passes 24% slow: 26.4 ms, its real ones 21.3)."""
    cached = min(CONTEXT, target.shape.context - max(GRID_FED))  # a tiny test model's is short
    text = natural_text(target, cached + max(GRID_FED))
    context = text[:cached]
    caches = []
    for _ in range(rows):  # through forward_rows: the kept prompts stay untouched
        caches.append(target.new_cache())
        target.forward_rows([context], caches[-1:], logits=False)
    best = dict.fromkeys(GRID_FED, float("inf"))
    for _ in range(REPEATS):
        for fed in GRID_FED:
            ids = [text[cached : cached + fed]] * rows
            start = time.perf_counter()
            target.forward_rows(ids, caches)
            best[fed] = min(best[fed], time.perf_counter() - start)
            for cache in caches:
                cache.crop(cached)
    return [(rows * fed, round(1e3 * best[fed], 4)) for fed in GRID_FED]


def natural_text(target: CompactLlama, length: int) -> torch.Tensor:
    """``_natural_text``, computed once per target and length."""
    texts = _texts.setdefault(target, {})
    if length not in texts:
        texts[length] = _natural_text(target, length)
    return texts[length]


_texts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target → {length: ids}


def _natural_text(target: CompactLlama, length: int) -> torch.Tensor:
    """``length`` ids of text the model finds natural: BOS, then its own greedy continuation of
    CHAIN tokens, repeated. What a pass costs depends on the text: the Q8 head recomputes the
    rows its bound cannot rule out, a few on real text, tens of thousands a position on a run of
    unused tokens (Gemma 3's ids 7..262, whose features are 4x a real token's)."""
    device = target.device
    bos = getattr(target.config, "bos_token_id", None)
    ids = [bos if isinstance(bos, int) and 0 <= bos < target.vocab_size else 0]
    cache = target.new_cache()
    for _ in range(min(CHAIN, length - 1)):
        logits, _ = target.forward_rows([torch.tensor(ids[-1:], device=device)], [cache])
        ids.append(int(logits[-1].argmax()))
    chain = torch.tensor(ids[1:] or ids, device=device)
    repeats = chain.repeat(-(-length // chain.numel()))
    return torch.cat([torch.tensor(ids[:1], device=device), repeats])[:length]


def rule_ms(target) -> tuple[float, float]:
    """What one more position adds to the acceptance rule's host work, (sampled, greedy) ms: a
    sampled row's policy and draw at 4 positions against 1 (a deterministic draft), a greedy
    row's masked argmax over 32 positions against 16; logits and masks at random."""
    vocab, device = target.vocab_size, target.device
    generator = torch.Generator(device=device)
    generator.manual_seed(0)
    logits = torch.randn(32, vocab, generator=generator, device=device)
    legal = torch.rand(32, vocab, generator=generator, device=device) < 0.75
    sampling = SamplingConfig(temperature=0.7)

    def rule(n):
        drafted = torch.zeros(n - 1, dtype=torch.long, device=device)
        probs = policy(logits[:n], legal[:n], sampling)
        verify_deterministic(probs, drafted, generator)[0].item()

    def argmax(n):
        logits[:n].masked_fill(~legal[:n], float("-inf")).argmax(-1).tolist()

    sampled = (
        kernels.best_ms(lambda: rule(4), REPEATS) - kernels.best_ms(lambda: rule(1), REPEATS)
    ) / 3
    greedy = (
        kernels.best_ms(lambda: argmax(32), REPEATS) - kernels.best_ms(lambda: argmax(16), REPEATS)
    ) / 16
    return round(max(sampled, 0.0), 4), round(max(greedy, 0.0), 4)
