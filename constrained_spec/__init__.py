"""constrained_spec: exact speculative decoding under JSON Schema, regex and grammar masks.

Layers, arrows pointing down: ``constraints`` (schema/regex/grammar → token automaton) and
``model`` (the target model, its kernels and caches) know nothing of each other; ``decoding`` (the
exact rule, drafters, the one loop) uses both; ``generator`` (Generator, Request, Result) and the
CLI, server and corpus jobs sit on top.

The names below load on first use (PEP 562): ``import constrained_spec`` costs nothing, and
torch (≈ 0.7 s to import) comes in with the first name that needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import (
    ConstraintError,
    DraftHeadError,
    GenerationInputError,
    SchemaTooComplex,
    SettingError,
    UnsupportedSchemaError,
    VocabularyMismatch,
    WeightsError,
)

# name → the module that defines it
_LAZY = {
    "Generator": ".generator",
    "Request": ".generator",
    "Result": ".generator",
    "Constraint": ".constraints",
    "Draft": ".decoding",
    "Drafter": ".decoding",
    "DraftHead": ".decoding",
    "Round": ".decoding",
    "SamplingConfig": ".decoding",
    "Stats": ".decoding",
    "model_drafter": ".decoding",
}

__all__ = [
    "Generator",
    "Request",
    "Result",
    "Constraint",
    "Draft",
    "Drafter",
    "DraftHead",
    "Round",
    "SamplingConfig",
    "Stats",
    "model_drafter",
    "ConstraintError",
    "GenerationInputError",
    "SchemaTooComplex",
    "SettingError",
    "UnsupportedSchemaError",
    "VocabularyMismatch",
    "DraftHeadError",
    "WeightsError",
]

if TYPE_CHECKING:
    from .constraints import Constraint
    from .decoding import Draft, Drafter, DraftHead, Round, SamplingConfig, Stats, model_drafter
    from .generator import Generator, Request, Result


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'constrained_spec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
