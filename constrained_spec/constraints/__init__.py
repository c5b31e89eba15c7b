"""Constraints: a schema, regex or grammar compiled into a token automaton over a model's exact
token bytes. Nothing here knows a model: the decoding layer asks an automaton which tokens are
legal, steps it over committed tokens and keeps old int states to roll back.

Along the data flow: ``vocabulary`` (token id → exact bytes) → ``schemas`` (what a user passes,
checked) → ``rewrite`` (a schema in llguidance's terms, never looser than jsonschema, with
``patterns`` for regexes and formats) → ``engine`` (llguidance compiles; int states, masks).
``grammars`` loads the shipped grammar files.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .closing import Completion
from .engine import FINISHED, GuidanceConstraint, compile_constraint, grammar_for
from .grammars import grammar_kind, grammar_names, load_grammar
from .schemas import load_schema
from .vocabulary import TokenVocabulary, token_vocabulary

__all__ = [
    "FINISHED",
    "Completion",
    "Constraint",
    "GuidanceConstraint",
    "TokenVocabulary",
    "compile_constraint",
    "grammar_for",
    "grammar_kind",
    "grammar_names",
    "load_grammar",
    "load_schema",
    "token_vocabulary",
]


class Constraint(Protocol):
    """What decoding asks of a compiled constraint. States are ints (``initial_state``, then
    what ``step`` returns; ``FINISHED`` after EOS), so a request's cursor is an int and rolling
    back is keeping the old one. Masks are ``vocab_size`` wide (the model's logits width)."""

    vocab: TokenVocabulary
    vocab_size: int
    eos_id: int
    initial_state: int

    def step(self, state: int, token: int) -> int | None:
        """The state after ``token``; ``FINISHED`` after a legal EOS; None if it is illegal."""
        ...

    def accepting(self, state: int) -> bool:
        """True iff the text so far is complete (EOS is legal here)."""
        ...

    def forced(self, state: int) -> int | None:
        """The only legal token, if exactly one."""
        ...

    def forced_text(self, state: int, limit: int = 64) -> bytes:
        """The bytes every continuation from ``state`` starts with."""
        ...

    def tokenize(self, state: int, data: bytes, limit: int, prefer=frozenset()) -> list[int]:
        """Legal tokens spelling a prefix of ``data`` from ``state``."""
        ...

    def mask(self, state: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """(V,) bool: the legal tokens at ``state``."""
        ...

    def masks(self, states: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """(len(states), V) bool: a pass's legal tokens."""
        ...

    def bitmasks(self, states: list[int]) -> list[bytes]:
        """The same as bitmasks (bit t of byte t // 8), for unpacking elsewhere."""
        ...

    def accepts(self, text: str) -> bool:
        """True iff ``text`` is a complete accepted text."""
        ...

    def completion(self, state: int) -> Completion | None:
        """A text that finishes the output from ``state`` (then EOS) and the tokens it takes,
        EOS included; a function of the state, one token fewer after its first token (the
        budget mask relies on both); None if none was found."""
        ...
