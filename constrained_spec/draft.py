"""Drafters: cheap proposals of the next few tokens, every one legal under the automaton.

A drafter is any object with ``propose``. A sampled draft carries its proposal distribution q
(masked by the same policy as the target); a deterministic draft carries ``probs=None`` and is
verified as one-hot q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from . import cache as kv
from .compile import Constraint
from .sample import SamplingConfig, policy


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # (k, V) q rows, or None for a deterministic draft

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_DRAFT = Draft([])


class Drafter(Protocol):
    def propose(self, tokens: list[int], state: int, constraint: Constraint, k: int,
                sampling: SamplingConfig, generator: torch.Generator) -> Draft:
        """Up to ``k`` legal tokens following ``tokens`` (prompt + committed output) from ``state``."""
        ...


class ModelDrafter:
    """A small causal LM sharing the target's vocabulary, sampled from its own masked policy."""

    def __init__(self, model, width: int):
        self.model, self.width = model, width  # width: the target's logits width (mask width)
        self.device = next(model.parameters()).device
        self._cache = None
        self._cached_ids: list[int] = []  # the tokens whose KV the cache holds

    def propose(self, tokens, state, constraint, k, sampling, generator):
        feed = self._sync_cache(tokens)
        drafted, rows = [], []
        for _ in range(k):
            logits = self._fit(kv.forward(self.model, self._cache, feed, self.device)[-1])  # (V,)
            mask = constraint.mask(state, self.device)
            if sampling.greedy:
                token = int(logits.masked_fill(~mask, float("-inf")).argmax())
            else:
                q = policy(logits, mask, sampling)
                token = int(torch.multinomial(q, 1, generator=generator))
                rows.append(q)
            self._cached_ids += feed
            drafted.append(token)
            state = constraint.step(state, token)
            if token == constraint.eos_id:
                break  # nothing follows EOS
            feed = [token]
        return Draft(drafted, torch.stack(rows) if rows else None)

    def _sync_cache(self, tokens: list[int]) -> list[int]:
        """Crop the cache to its longest prefix still committed; return the tokens to feed."""
        if self._cache is None:
            self._cache, self._cached_ids = kv.new_cache(self.model), []
        keep = 0
        for cached, token in zip(self._cached_ids, tokens):
            if cached != token:
                break
            keep += 1
        keep = min(keep, len(tokens) - 1)  # the last committed token is always fed
        kv.crop(self._cache, keep)
        self._cached_ids = self._cached_ids[:keep]
        return tokens[keep:]

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits at the target's width (padding ids beyond the tokenizer are never legal)."""
        if logits.shape[-1] >= self.width:
            return logits[: self.width]
        return torch.cat([logits, logits.new_full((self.width - logits.shape[-1],), float("-inf"))])
