"""Loading a schema from what a user passes: a dict, a JSON string, a file path or a Pydantic
model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ConstraintError
from . import limits


def load_schema(schema: Any) -> dict:
    """A schema given as a dict, a JSON string, a path to a ``.json`` file or a Pydantic model;
    the boolean schemas too (``true`` takes any JSON value, as ``{}``; ``false`` none)."""
    if hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, bool):
        return _boolean(schema, "the schema")
    if isinstance(schema, dict):
        check_depth(schema, "the schema")
        return schema
    if isinstance(schema, str):
        schema = schema.lstrip("\ufeff")  # a byte-order mark pasted along with the JSON
        if (word := schema.strip()) in ("true", "false"):  # JSON text, not a file name
            return _boolean(word == "true", "the schema string")
    if isinstance(schema, Path) or (isinstance(schema, str) and schema.strip()[:1] not in "{["):
        text, origin = _read_file(Path(schema)), str(schema)
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
    except RecursionError:
        raise ConstraintError(_too_deep(origin)) from None
    if isinstance(loaded, bool):
        return _boolean(loaded, origin)
    if not isinstance(loaded, dict):
        raise ConstraintError(
            f'{origin} is not a JSON object: a schema is an object like {{"type": "object", ...}}.'
        )
    check_depth(loaded, origin)
    return loaded


def _boolean(schema: bool, origin: str) -> dict:
    if not schema:
        raise ConstraintError(
            f"{origin} is false, which no JSON value satisfies (unsatisfiable): nothing can be "
            "generated; pass true or {} for any JSON value."
        )
    return {}


def _read_file(path: Path) -> str:
    try:
        exists = path.is_file()
    except (OSError, ValueError):  # a name too long, or with a NUL: no file has it
        exists = False
    if not exists:
        raise ConstraintError(
            f"schema file {str(path)[:200]!r} does not exist: pass a path to a "
            ".json file, a JSON string, a dict or a Pydantic model."
        )
    try:
        return path.read_bytes().decode("utf-8-sig")  # JSON is UTF-8; a BOM is tolerated
    except UnicodeDecodeError as e:
        raise ConstraintError(
            f"schema file {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason}): "
            "save it as UTF-8."
        ) from None
    except OSError as e:
        raise ConstraintError(f"cannot read schema file {str(path)!r}: {e.strerror}.") from None


def check_depth(schema: dict, origin: str) -> None:
    """Refuse documents nested deeper than ``limits.MAX_DEPTH`` (the checker and the translation
    recurse per level); measured iteratively so that the check itself cannot overflow."""
    todo = [(schema, 1)]
    while todo:
        value, depth = todo.pop()
        if depth > limits.MAX_DEPTH:
            raise ConstraintError(_too_deep(origin))
        children = value.values() if isinstance(value, dict) else value
        todo.extend((v, depth + 1) for v in children if isinstance(v, (dict, list)))


def _too_deep(origin: str) -> str:
    return (
        f"{origin} is nested more than {limits.MAX_DEPTH} objects/arrays deep: flatten it "
        "(name repeated parts under $defs and point to them with $ref)."
    )
