"""Loading a schema from what a user passes: a dict, a JSON string, a file path or a Pydantic
model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ConstraintError


def load_schema(schema: Any) -> dict:
    """A schema given as a dict, a JSON string, a path to a ``.json`` file or a Pydantic model."""
    if hasattr(schema, "model_json_schema"):
        return schema.model_json_schema()
    if isinstance(schema, dict):
        return schema
    if isinstance(schema, Path) or (isinstance(schema, str) and schema.strip()[:1] not in "{["):
        path = Path(schema)
        if not path.is_file():
            raise ConstraintError(
                f"schema file {str(path)!r} does not exist: pass a path to a "
                ".json file, a JSON string, a dict or a Pydantic model."
            )
        text, origin = path.read_text(), str(path)
    elif isinstance(schema, str):
        text, origin = schema, "the schema string"
    else:
        raise ConstraintError(
            f"cannot use a {type(schema).__name__} as a schema: pass a dict, "
            "a JSON string, a path to a .json file or a Pydantic model class."
        )
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConstraintError(f"{origin} is not valid JSON ({e}): fix the syntax.") from None
    if not isinstance(loaded, dict):
        raise ConstraintError(
            f'{origin} is not a JSON object: a schema is an object like {{"type": "object", ...}}.'
        )
    return loaded
