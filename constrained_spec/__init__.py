"""constrained_spec: exact speculative decoding under JSON Schema / regex grammar masks."""

from .compile import Constraint
from .decode import Generator, Result, Round, Stats
from .draft import Draft, Drafter, model_drafter
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
from .head import DraftHead
from .sample import SamplingConfig

__all__ = [
    "Generator",
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
