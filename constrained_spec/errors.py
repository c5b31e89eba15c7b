"""Errors raised at the boundary, before any model work. Each message names the fix."""


class ConstraintError(ValueError):
    """The schema, regex or grammar cannot be compiled as given."""


class UnsupportedSchemaError(ConstraintError):
    """The schema uses a keyword the compiler cannot honour exactly (refused, never loosened)."""

    def __init__(self, keyword: str, pointer: str, hint: str = ""):
        self.keyword, self.pointer = keyword, pointer
        where = pointer or "/"
        super().__init__(
            f"unsupported JSON Schema keyword {keyword!r} at {where}: the compiler cannot honour it "
            f"exactly and refuses rather than loosen the schema. {hint or 'Remove or rewrite it.'}"
        )
        self.hint = hint


class SchemaTooComplex(ConstraintError):
    """The constraint is past what llguidance builds (its size and depth limits)."""


class SettingError(ValueError):
    """A ``CONSTRAINED_SPEC_*`` environment setting has an unusable value."""


class GenerationInputError(ValueError):
    """A generate() argument is unusable: empty prompt, prompt too long, bad sampling settings."""


class BudgetTooSmall(GenerationInputError):
    """max_new_tokens is below the shortest reply the constraint allows (the budget mask)."""

    def __init__(self, message: str, given: int, shortest: int, text: str):
        super().__init__(message)
        self.given, self.shortest, self.text = given, shortest, text


class VocabularyMismatch(ValueError):
    """The draft model does not share the target's vocabulary."""


class DraftHeadError(ValueError):
    """The trained draft head's weight file is missing, corrupt or does not fit the target."""


class WeightsError(ValueError):
    """The requested weights option cannot run this model on this machine."""


class BudgetMaskWarning(UserWarning):
    """The budget mask is off for a request: no way to finish its reply was found."""
