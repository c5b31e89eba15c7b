"""Compile a constraint (JSON Schema or regex) into a token automaton over a model's vocabulary.

Vocabulary → Index (outlines-core, over exact token bytes) → Constraint (int states, cached masks).
The compiled ``Constraint`` is immutable in meaning and shared between requests; a request's
cursor is just an int state, so rollback is keeping the old int.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from functools import cache
from pathlib import Path

import torch
from outlines_core import Index, Vocabulary

from .errors import ConstraintError
from .vocab import TokenVocabulary

FINISHED = -1  # the state after EOS: nothing is legal any more


class Constraint:
    """A token automaton: ``step``, ``legal_prefix``, ``mask``, ``forced``, ``accepting``."""

    def __init__(self, index: Index, vocab: TokenVocabulary, vocab_size: int, regex: str):
        self.index, self.vocab, self.vocab_size, self.regex = index, vocab, vocab_size, regex
        self.eos_id = vocab.eos_id
        self.initial_state: int = index.get_initial_state()
        self._allowed: dict[int, list[int]] = {}
        self._masks: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._byte_ids = {b[0]: i for i, b in enumerate(vocab.token_bytes) if b and len(b) == 1}

    def allowed(self, state: int) -> list[int]:
        """Legal token ids in ``state`` (EOS included iff accepting); computed once per state."""
        if state not in self._allowed:
            # After EOS only EOS "continues": a harmless row for drafts that end in EOS.
            ids = [self.eos_id] if state == FINISHED else self.index.get_allowed_tokens(state)
            self._allowed[state] = [i for i in ids if i < self.vocab_size]
        return self._allowed[state]

    def step(self, state: int, token: int) -> int | None:
        """The state after ``token``, ``FINISHED`` after a legal EOS, ``None`` if illegal."""
        if state == FINISHED:
            return None
        if token == self.eos_id:
            return FINISHED if self.accepting(state) else None
        return self.index.get_next_state(state, token)

    def legal_prefix(self, state: int, tokens: list[int]) -> int:
        """How many leading ``tokens`` the automaton accepts from ``state``."""
        for n, token in enumerate(tokens):
            state = self.step(state, token)
            if state is None:
                return n
        return len(tokens)

    def accepting(self, state: int) -> bool:
        return state != FINISHED and self.index.is_final_state(state)

    def forced(self, state: int) -> int | None:
        """The only legal token, if exactly one (its probability is 1 under any policy)."""
        allowed = self.allowed(state)
        return allowed[0] if len(allowed) == 1 else None

    def mask(self, state: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Boolean mask of legal ids, (V,) with V the model's logits width; cached per state."""
        device = torch.device(device)
        key = (state, device)
        if key not in self._masks:
            allowed = self.allowed(state)
            if not allowed:
                raise ConstraintError(f"state {state} has no legal token: the constraint cannot "
                                      "be completed with this vocabulary.")
            m = torch.zeros(self.vocab_size, dtype=torch.bool)
            m[torch.tensor(allowed)] = True
            self._masks[key] = m.to(device)
        return self._masks[key]

    def accepts_tokens(self, tokens: list[int]) -> bool:
        """True iff the tokens (optionally ending in EOS) form a complete accepted text."""
        state = self.initial_state
        for token in tokens:
            state = self.step(state, token)
            if state is None:
                return False
        return state == FINISHED or self.accepting(state)

    def accepts(self, text: str) -> bool:
        """True iff the automaton accepts this complete text (walked one byte token at a time,
        so no tokenization choice can hide an accept or a reject)."""
        data = text.encode()
        missing = {b for b in data if b not in self._byte_ids}
        if missing:
            raise ValueError(f"the vocabulary has no single-byte token for bytes {sorted(missing)}")
        return self.accepts_tokens([self._byte_ids[b] for b in data])


@cache
def _outlines_vocabulary(vocab: TokenVocabulary) -> Vocabulary:
    return Vocabulary(vocab.eos_id, vocab.outlines_map())


_compiled: dict[tuple[str, str, int], Constraint] = {}


def compile_regex(regex: str, vocab: TokenVocabulary, vocab_size: int,
                  cache_dir: Path | None = None) -> Constraint:
    """Compile ``regex`` for this vocabulary; cached in memory and (if ``cache_dir``) on disk."""
    key = (regex, vocab.fingerprint, vocab_size)
    if key not in _compiled:
        _compiled[key] = Constraint(_load_or_build_index(regex, vocab, cache_dir), vocab,
                                    vocab_size, regex)
    return _compiled[key]


def _load_or_build_index(regex: str, vocab: TokenVocabulary, cache_dir: Path | None) -> Index:
    path = None
    if cache_dir is not None:
        digest = hashlib.sha256(f"{vocab.fingerprint}\0{regex}".encode()).hexdigest()[:24]
        path = Path(cache_dir) / "constraints" / f"{digest}.index"
        if path.is_file():
            try:
                return pickle.loads(path.read_bytes())
            except Exception:
                path.unlink(missing_ok=True)  # corrupt entry: rebuild below
    try:
        index = Index(regex, _outlines_vocabulary(vocab))
    except Exception as e:
        raise ConstraintError(f"cannot compile the regex {regex[:200]!r}: {e}") from None
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(pickle.dumps(index))
        os.replace(tmp, path)  # atomic: a crash never leaves a half-written entry
    return index


def default_cache_dir() -> Path:
    return Path(os.environ.get("CONSTRAINED_SPEC_CACHE", Path.home() / ".cache" / "constrained_spec"))
