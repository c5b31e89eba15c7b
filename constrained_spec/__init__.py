"""constrained_spec: exact speculative decoding under JSON Schema, regex and grammar masks.

Layers, arrows pointing down: ``constraints`` (schema/regex/grammar → token automaton) and
``target`` (the model, its kernels and caches) know nothing of each other; ``decoding`` (the
exact rule, drafters, the one loop) uses both; ``generator`` (Generator, Request, Result) and the
CLI, server and corpus jobs sit on top.
"""

from .constraints import Constraint
from .decoding import Draft, Drafter, DraftHead, Round, SamplingConfig, Stats, model_drafter
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
from .generator import Generator, Request, Result

__all__ = [
    "Generator",
    "Request",
    "Result",
    "Round",
    "Stats",
    "Constraint",
    "Draft",
    "Drafter",
    "model_drafter",
    "DraftHead",
    "SamplingConfig",
    "ConstraintError",
    "GenerationInputError",
    "SchemaTooComplex",
    "SettingError",
    "UnsupportedSchemaError",
    "VocabularyMismatch",
    "DraftHeadError",
    "WeightsError",
]
