"""Drafters: cheap proposals of the next few tokens, every one legal under the automaton.

A drafter implements the ``Drafter`` protocol (``begin``, ``propose``, ``observe``,
``uses_features``). Each draft token comes from one source:
- "forced": the state has exactly one legal token, so p = 1 on it (free and exact);
- "grammar": text the grammar forces (e.g. `","age":`) where several tokenizations are legal,
  spelled by greedy longest match;
- "lookup": the continuation of an earlier occurrence of the text's last bytes (prompt lookup),
  cut at the first token the automaton rejects;
- "model": sampled from a draft model's (or trained head's) masked policy q (greedy: its
  masked argmax).
Forced, grammar and lookup tokens are deterministic: verified as one-hot q. Choosing the source per
position from the prefix alone keeps the rule exact, since each position is verified against
the q it was actually drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..constraints import FINISHED, Constraint
from ..model import kv
from ..model.llama import common_prefix
from .sample import SamplingConfig, draw, one_hot, policy

UNTEMPERED = SamplingConfig(temperature=1.0)  # a greedy draft's confidence: its softmax at T = 1


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # (k, V) q rows; None when every token is deterministic
    sources: tuple[str, ...] = ()  # "forced" | "grammar" | "lookup" | "model", per token

    def __len__(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int) -> Draft:
        """The first n tokens (cutting a draft by position or legality keeps the rule exact)."""
        if n >= len(self.tokens):
            return self
        return Draft(
            self.tokens[:n], None if self.probs is None else self.probs[:n], self.sources[:n]
        )


EMPTY_DRAFT = Draft([])


class Drafter(Protocol):
    """What the decode loop calls on a drafter, in this order: ``begin`` once per request,
    then each round ``propose`` and ``observe``. Implement every member (no-ops where there is
    nothing to do); ``Generator`` refuses an object that lacks one."""

    @property
    def uses_features(self) -> bool:
        """Whether the loop must pass the target's features to ``begin``/``observe`` (a trained
        draft head reads them); without it they get None."""
        ...

    def begin(self, prompt: list[int], features: torch.Tensor | None) -> None:
        """A new request: ``prompt``'s ids, and the target's features over ``prompt[:-1]``."""
        ...

    def propose(
        self,
        tokens: list[int],
        state: int,
        constraint: Constraint,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Draft:
        """Up to ``k`` legal tokens following ``tokens`` (prompt + committed output) from ``state``
        (plus any free forced tokens)."""
        ...

    def observe(self, committed: list[int], features: torch.Tensor | None) -> None:
        """The round committed ``committed`` (and the target's features at those positions)."""
        ...


DRAFTER_MEMBERS = ("uses_features", "begin", "propose", "observe")


def logits_width(model) -> int:
    """How many logits the model emits (quantized heads have no plain ``weight``)."""
    head = model.get_output_embeddings()
    return getattr(head, "out_features", None) or head.weight.shape[0]


class DraftModel:
    """A small causal LM sharing the target's vocabulary, with its own KV cache kept in step."""

    def __init__(self, model, width: int):
        self.model, self.width = model, width  # width: the target's logits width (mask width)
        self.device = next(model.parameters()).device
        self.cache = kv.new_cache(model)
        self.cached_ids: list[int] = []  # the tokens whose KV the cache holds
        self.context = kv.context_of(model)  # positions it runs (a LongRoPE model's: fewer)

    def scores(self, context: list[int], state: int, constraint: Constraint):
        """(logits, legal mask, None) for the token after ``context``: the whole vocabulary; None
        past the positions the model runs (a draft model with a shorter context than the
        target's: the target goes on without its drafts; a length decides it, never a draw)."""
        if len(context) >= self.context:
            return None
        logits = self._fit(kv.forward(self.model, self.cache, self._feed(context), self.device)[-1])
        return logits, constraint.mask(state, self.device), None

    def _feed(self, context: list[int]) -> list[int]:
        """Crop the cache to its longest prefix still in ``context``; return what to feed."""
        keep = min(
            common_prefix(self.cached_ids, context), len(context) - 1
        )  # the last token is always fed: its logits are needed
        kv.crop(self.cache, keep)
        self.cached_ids = context[:]
        return context[keep:]

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits at the target's width (padding ids beyond the tokenizer are never legal)."""
        if logits.shape[-1] >= self.width:
            return logits[: self.width]
        return torch.cat([logits, logits.new_full((self.width - logits.shape[-1],), float("-inf"))])


def lookup(text: bytes, min_match: int = 4, max_match: int = 32, max_bytes: int = 64) -> bytes:
    """Prompt lookup on text: the bytes that followed the latest earlier occurrence of the
    longest suffix of ``text`` (max_match … min_match bytes). Matching bytes rather than token
    ids finds copies whose tokenization differs (" Alice" in a prompt, "Alice" after a quote).
    Where the shortest suffix occurs nowhere earlier, no longer one does: one search, not 29."""
    if len(text) <= min_match or text.rfind(text[-min_match:], 0, len(text) - 1) < 0:
        return b""
    for n in range(min(max_match, len(text) - 1), min_match - 1, -1):
        start = text.rfind(text[-n:], 0, len(text) - 1)
        if start >= 0:
            return text[start + n : start + n + max_bytes]
    return b""


@dataclass
class CompositeDrafter:
    """Per position: the text the grammar forces, else prompt lookup when it matches, else the
    draft model. ``k`` bounds the draft-model tokens; forced and lookup tokens cost no draft step
    (forced and copied text is spelled in tokens by the greedy longest match the automaton
    accepts: a deterministic draft, verified by the target like any other)."""

    model: DraftModel | None = None
    use_forced: bool = True
    use_lookup: bool = True
    min_match: int = 4  # shortest text suffix that may trigger a lookup, in bytes
    max_lookup: int = 10  # tokens copied per match
    max_draft: int = 24  # longest draft of any mix (the verify pass widens with it)
    # Stop model drafting once the chain's chance of being accepted whole, estimated as the
    # product of the model's top probabilities, would fall below this (0: only k stops it). A
    # verify pass widens with every drafted token; unlikely tokens cost more than they return.
    min_confidence: float = 0.0
    # Whether the model may draft after a lookup copy in the same draft. Off: those positions
    # are hardly ever reached, and to reach them a trained head first reads through the copy,
    # one head step per copied token (measured: git show 8fe3c79:docs/measurements.md).
    model_after_lookup: bool = False
    # Tokens the target has committed: forced text is spelled with them where possible, since
    # a model keeps its habits (SmolLM2 writes `{` `"` rather than `{"`).
    target_tokens: set[int] = field(default_factory=set)
    # The last round's vocabulary, context ids and their bytes: the lookup's text grows by the
    # tokens committed since, rather than being joined anew from the whole prompt each round.
    _context: tuple = field(default=(None, [], b""), init=False, repr=False)

    @property
    def uses_features(self) -> bool:
        """Whether the decode loop must pass the target's features (a trained draft head)."""
        return getattr(self.model, "uses_features", False)

    def begin(self, prompt: list[int], features: torch.Tensor | None) -> None:
        if self.uses_features:
            self.model.begin(prompt, features)

    def observe(self, committed: list[int], features: torch.Tensor | None) -> None:
        """Learn from the tokens the target committed this round (and its features there)."""
        self.target_tokens.update(committed)
        if self.uses_features:
            self.model.observe(committed, features)

    def propose(self, tokens, state, constraint, k, sampling, generator):
        context, rows, sources, model_steps, chance = list(tokens), [], [], 0, 1.0
        text = self._text(tokens, constraint.vocab)
        while len(sources) < self.max_draft and state != FINISHED:
            room = min(self.max_lookup, self.max_draft - len(sources))
            forced_text = constraint.forced_text(state) if self.use_forced else b""
            if ids := constraint.tokenize(state, forced_text, room, self.target_tokens):
                step = [(t, None, "grammar") for t in ids]
            elif self.use_lookup and (
                ids := constraint.tokenize(state, lookup(text, self.min_match), room)
            ):
                step = [(t, None, "lookup") for t in ids]
            elif (
                self.model is not None
                and model_steps < k
                and (self.model_after_lookup or "lookup" not in sources)
            ):
                drawn = self._model_token(context, state, constraint, sampling, generator, chance)
                if drawn is None:  # no legal proposal, or too unlikely to be accepted
                    break
                token, q, chance = drawn
                step, model_steps = [(token, q, "model")], model_steps + 1
            else:
                break
            for token, q, source in step:
                forced = source == "grammar" and constraint.forced(state) == token
                sources.append("forced" if forced else source)  # forced: p = 1, never rejected
                context.append(token)
                rows.append(q)
                text += constraint.vocab.token_bytes[token] or b""
                state = constraint.step(state, token)
        drafted = context[len(tokens) :]
        return Draft(
            drafted, _stack_rows(rows, drafted, constraint.vocab_size, sampling), tuple(sources)
        )

    def _text(self, tokens: list[int], vocab) -> bytes:
        known, seen, text = self._context
        if known is not vocab or tokens[: len(seen)] != seen:  # another request: anew
            seen, text = [], b""
        text += vocab.text_bytes(tokens[len(seen) :])
        self._context = (vocab, list(tokens), text)
        return text

    def _model_token(self, context, state, constraint, sampling, generator, chance: float):
        """(token, q row | None, chance × its top probability) from the model's masked policy, or
        None. Whether to draw is decided from the policy before drawing (its top probability
        depends on the prefix only), so stopping keeps the rule exact; stopping on the drawn
        token's own probability would not."""
        scored = self.model.scores(context, state, constraint)
        if scored is None:
            return None
        logits, mask, ids = scored  # ids: the candidates' token ids (None: the whole vocabulary)
        if not mask.any():
            return None
        probs = policy(logits, mask, UNTEMPERED if sampling.greedy else sampling)
        top = float(probs.max())  # host sync: so is the draw, which the automaton needs next
        if chance * top < self.min_confidence:
            return None
        pick = int(probs.argmax() if sampling.greedy else draw(probs, generator))
        token = pick if ids is None else int(ids[pick])
        if sampling.greedy:
            return token, None, chance * top
        q = (
            probs
            if ids is None
            else torch.zeros(constraint.vocab_size, device=probs.device).index_put_((ids,), probs)
        )
        return token, q, chance * top


def _stack_rows(rows, tokens, width, sampling) -> torch.Tensor | None:
    """(k, V) q: the model's rows where it sampled, one-hot rows for deterministic tokens."""
    if sampling.greedy or all(q is None for q in rows):
        return None
    device = next(q for q in rows if q is not None).device
    hot = one_hot(tokens, width, device)
    return torch.stack([q if q is not None else hot[i] for i, q in enumerate(rows)])


def model_drafter(model, width: int, **options) -> CompositeDrafter:
    """A draft model with forced tokens and prompt lookup in the mix (options: CompositeDrafter)."""
    return CompositeDrafter(DraftModel(model, width), **options)
