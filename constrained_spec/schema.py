"""JSON Schema front end: load a schema from what the user has, check it, turn it into a regex.

The regex comes from outlines-core's ``build_regex_from_schema``. That builder silently ignores
some keywords (``minimum`` for one), which would loosen the schema; so every keyword is checked
here first and anything not honoured exactly is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
from outlines_core.json_schema import build_regex_from_schema

from .errors import ConstraintError, UnsupportedSchemaError

# Keywords that only describe; they never change which instances are valid.
ANNOTATIONS = {"title", "description", "examples", "default", "$schema", "$id", "$comment",
               "deprecated", "readOnly", "writeOnly"}
# Keywords outlines-core honours exactly (or more strictly, which is sound: fewer outputs).
SUPPORTED = {"type", "properties", "required", "additionalProperties", "items", "prefixItems",
             "minItems", "maxItems", "minLength", "maxLength", "pattern", "enum", "const",
             "anyOf", "allOf", "$ref", "$defs", "definitions", "format"}
FORMATS = {"date-time", "date", "time", "uuid", "email", "uri"}


def load_schema(schema: Any) -> dict:
    """A schema given as a dict, a JSON string, a path to a ``.json`` file or a Pydantic model."""
    if hasattr(schema, "model_json_schema"):
        return schema.model_json_schema()
    if isinstance(schema, dict):
        return schema
    if isinstance(schema, Path) or (isinstance(schema, str) and schema.strip()[:1] not in "{["):
        path = Path(schema)
        if not path.is_file():
            raise ConstraintError(f"schema file {str(path)!r} does not exist: pass a path to a "
                                  ".json file, a JSON string, a dict or a Pydantic model.")
        text, origin = path.read_text(), str(path)
    elif isinstance(schema, str):
        text, origin = schema, "the schema string"
    else:
        raise ConstraintError(f"cannot use a {type(schema).__name__} as a schema: pass a dict, "
                              "a JSON string, a path to a .json file or a Pydantic model class.")
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConstraintError(f"{origin} is not valid JSON ({e}): fix the syntax.") from None
    if not isinstance(loaded, dict):
        raise ConstraintError(f"{origin} is not a JSON object: a schema is an object like "
                              '{"type": "object", ...}.')
    return loaded


def check_schema(schema: dict) -> None:
    """Refuse a schema that is not valid JSON Schema, or that uses a keyword we cannot honour."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        pointer = "/" + "/".join(str(p) for p in e.path)
        raise ConstraintError(f"not a valid JSON Schema at {pointer}: {e.message}") from None
    _check_keywords(schema, "")


def _check_keywords(node: Any, pointer: str) -> None:
    if isinstance(node, bool):
        return
    for key, value in node.items():
        here = f"{pointer}/{key}"
        if key in ANNOTATIONS:
            continue
        if key not in SUPPORTED:
            raise UnsupportedSchemaError(key, pointer)
        if key == "format" and value not in FORMATS:
            raise UnsupportedSchemaError(f"format: {value}", pointer,
                                         f"Supported formats: {', '.join(sorted(FORMATS))}.")
        if key in ("properties", "$defs", "definitions"):
            for name, sub in value.items():
                _check_keywords(sub, f"{here}/{name}")
        elif key in ("anyOf", "allOf", "prefixItems"):
            for i, sub in enumerate(value):
                _check_keywords(sub, f"{here}/{i}")
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            _check_keywords(value, here)


def schema_to_regex(schema: dict, whitespace: str = "") -> str:
    """The regex of the JSON texts the schema accepts; ``whitespace`` is allowed between tokens."""
    check_schema(schema)
    try:
        return build_regex_from_schema(json.dumps(schema), whitespace)
    except Exception as e:  # outlines-core raises plain errors with a useful message
        raise ConstraintError(f"cannot compile the schema: {e}") from None
