"""What a target pass costs by its size: the table load-aware speculation (``loop.plan``) weighs
each row's drafts against.

A pass of R rows feeding N tokens in all (each row its last committed token and its draft) is
timed once per machine and model shape, on a grid of R and tokens per row, and cached in the
calibration cache beside the layers' kernel choices (``machine.remembered``); decoding reads it
back and never times itself, so a seeded row samples the same tokens on every run.
"""

from __future__ import annotations

import bisect
import math
import weakref
from dataclasses import dataclass, field

import torch

from ..target import kernels, machine
from ..target.llama import CompactLlama
from ..target.models import shape_key
from .sample import SamplingConfig, policy, verify_deterministic

# The grid: rows per pass, and tokens each row feeds (1: the baseline step, 1 + k: k drafts).
GRID_ROWS = (1, 2, 4, 8, 16)
GRID_FED = (1, 2, 4, 6)
CONTEXT = 256  # positions each row's cache holds while timed (a short prompt and some output)
CHAIN = 31  # tokens of the model's own greedy text that the timed context repeats
REPEATS = 5  # each point: the fastest of these
# Part of the cache key: a new method invalidates the cached tables.
METHOD = (
    "pass cost v3: rows 1-16 x 1-6 tokens each, 256 cached of the model's own greedy text, "
    "whole head, best of 5; the rule's host cost per position"
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

    def to_json(self) -> dict:
        return {
            "method": METHOD,
            "grid": {str(r): points for r, points in self.grid.items()},
            "sampled_ms": self.sampled_ms,
            "greedy_ms": self.greedy_ms,
        }

    @classmethod
    def from_json(cls, data: dict) -> PassCost:
        grid = {int(r): [tuple(p) for p in points] for r, points in data["grid"].items()}
        return cls(grid, data.get("sampled_ms", 0.0), data.get("greedy_ms", 0.0))


def _along(points: list[tuple[int, float]], x: float) -> float:
    """Linear interpolation through ``points`` (x rising), extended along the end segments."""
    if len(points) == 1:
        return points[0][1]
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


_known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target → PassCost | None


def pass_cost(target) -> PassCost | None:
    """The target's pass costs: set by ``use``, else measured once per machine and model shape
    (a few seconds) and cached; None for a target whose rows do not share a pass (transformers'
    forward runs them one after another: a row's drafts cost it alone, so it keeps them)."""
    if target in _known:
        return _known[target]
    if not isinstance(target, CompactLlama):
        _known[target] = None
        return None
    way = f"{target.weights} {target.layer_kernel}/{target.matmul} {type(target.lm_head).__name__}"
    key = f"{METHOD} | {shape_key(target.config)} | {way}"
    _known[target] = cost = PassCost.from_json(
        machine.remembered(key, lambda: measure(target).to_json(), valid=_whole)
    )
    return cost


def _whole(table: dict) -> bool:
    """A stored table this version reads: this method's, every grid point a finite time."""
    cost = PassCost.from_json(table)
    values = [v for points in cost.grid.values() for x, ms in points for v in (x, ms)]
    values += [cost.sampled_ms, cost.greedy_ms]
    whole = table.get("method") == METHOD and cost.grid and all(cost.grid.values())
    return whole and all(math.isfinite(v) for v in values)


def use(target, cost: PassCost | None) -> None:
    """Decode on ``target`` with these pass costs (tests; None: each row keeps its whole draft)."""
    _known[target] = cost


@torch.inference_mode()
def measure(target: CompactLlama) -> PassCost:
    """Time passes of every grid size: R rows each after CONTEXT cached positions, each feeding
    n tokens, the caches cut back after each pass; the fastest of REPEATS per point."""
    device, vocab = target.device, target.vocab_size
    cached = min(CONTEXT, target.shape.context - max(GRID_FED))  # a tiny test model's is short
    text = natural_text(target, cached + max(GRID_FED))
    context = text[:cached]
    caches = []
    for _ in range(max(GRID_ROWS)):  # through forward_rows: the kept prompts stay untouched
        caches.append(target.new_cache())
        target.forward_rows([context], caches[-1:], logits=False)
    grid = {}
    for rows in GRID_ROWS:
        points = []
        for fed in GRID_FED:
            ids = [text[cached : cached + fed]] * rows

            def one_pass(ids=ids, used=caches[:rows]):
                target.forward_rows(ids, used)
                for cache in used:
                    cache.crop(cached)

            points.append((rows * fed, round(kernels.best_ms(one_pass, REPEATS), 4)))
        grid[rows] = points
    return PassCost(grid, *rule_ms(vocab, device))


def natural_text(target: CompactLlama, length: int) -> torch.Tensor:
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


def rule_ms(vocab: int, device) -> tuple[float, float]:
    """What one more position adds to the acceptance rule's host work, (sampled, greedy) ms: a
    sampled row's policy and draw at 4 positions against 1 (a deterministic draft), a greedy
    row's masked argmax over 32 positions against 16; logits and masks at random."""
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
