"""A schema from what a user passes (a dict, a JSON string, a file path or a Pydantic model,
``load_schema``), and the checks every schema passes before it is compiled (``check_schema``,
run by the engine): valid under its meta-schema, draft-04 or later, nested at most MAX_DEPTH
deep, no reference outside the document (nothing is ever fetched). jsonschema is imported on the
first schema (``jsonschema_module``): a regex or grammar never pays for it."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

from ..errors import ConstraintError, UnsupportedSchemaError

MAX_DEPTH = 64  # nested objects/arrays in a schema document (the checks recurse per level)


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
    """Refuse documents nested deeper than ``MAX_DEPTH`` (the checker and the translation
    recurse per level); measured iteratively so that the check itself cannot overflow."""
    todo = [(schema, 1)]
    while todo:
        value, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise ConstraintError(_too_deep(origin))
        children = value.values() if isinstance(value, dict) else value
        todo.extend((v, depth + 1) for v in children if isinstance(v, (dict, list)))


def _too_deep(origin: str) -> str:
    return (
        f"{origin} is nested more than {MAX_DEPTH} objects/arrays deep: flatten it "
        "(name repeated parts under $defs and point to them with $ref)."
    )


def check_schema(schema: dict, origin: str = "the schema") -> dict:
    """``schema`` if it is one we may compile, else a ConstraintError naming the problem and
    its JSON pointer: too deep, an invalid ``$schema``, invalid under its meta-schema, draft-03
    (whose ``required`` and ``enum`` mean other things), or a reference outside the document."""
    check_depth(schema, origin)
    if not isinstance(schema.get("$schema", ""), str):  # jsonschema would crash on it
        raise ConstraintError(
            f"$schema is {schema['$schema']!r}: it must be a meta-schema URI string such "
            'as "https://json-schema.org/draft/2020-12/schema", or left out.'
        )
    jsonschema = jsonschema_module()
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ConstraintError(
            f"not a valid JSON Schema at {_pointer(e.path) or '/'}: {e.message}"
            " (checked against its meta-schema)."
        ) from None
    if validator is jsonschema.Draft3Validator:
        raise UnsupportedSchemaError(
            "$schema", "", "draft-03 schemas are not supported; declare draft-04 or later."
        )
    refuse_remote_refs(schema, draft4=validator is jsonschema.Draft4Validator)
    return schema


@functools.cache
def jsonschema_module() -> types.ModuleType:
    """jsonschema, imported on first use. Its format checkers import every optional checker
    installed (``jsonschema[format-nongpl]``, as ``.[test]`` installs), and rfc3987_syntax builds
    its lark parsers on import: 1-3 s on a 2-core CPU, more than the rest of a warm call. Its
    one function is bound here to a stand-in that imports it on its first call: only an "iri" or
    "iri-reference" format being checked pays for it (no meta-schema uses either)."""
    if "jsonschema" not in sys.modules and "rfc3987_syntax" not in sys.modules:
        if importlib.util.find_spec("rfc3987_syntax") is not None:
            stand_in = types.ModuleType("rfc3987_syntax")
            stand_in.is_valid_syntax = _is_valid_iri_syntax
            sys.modules["rfc3987_syntax"] = stand_in
            try:
                importlib.import_module("jsonschema")
            finally:  # later imports get the real module
                if sys.modules.get("rfc3987_syntax") is stand_in:
                    del sys.modules["rfc3987_syntax"]
    return importlib.import_module("jsonschema")


def _is_valid_iri_syntax(term: str, value: str) -> bool:
    return importlib.import_module("rfc3987_syntax").is_valid_syntax(term, value)


VALUE_KEYWORDS = ("const", "enum", "default", "examples")  # their values are instances, not schemas


def refuse_remote_refs(schema: dict, draft4: bool) -> None:
    """Refuse, by name and before any validation, every reference outside this document."""
    base = schema.get("$id") or (schema.get("id") if draft4 else "") or ""
    base = base.rstrip("#") if isinstance(base, str) else ""
    todo = [(schema, "")]
    while todo:  # iterative: a deep document must not overflow the stack here
        value, pointer = todo.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, sub in items:
            if key in ("$ref", "$dynamicRef", "$recursiveRef") and isinstance(sub, str):
                local = sub[len(base) :] if base and sub.startswith(base) else sub
                if local and not local.startswith("#"):
                    raise UnsupportedSchemaError(
                        key,
                        pointer,
                        f"{sub!r} refers outside the schema, and references are never "
                        "fetched: inline the referenced schema under $defs and point to it "
                        "with #/$defs/....",
                    )
            elif isinstance(sub, (dict, list)) and not (
                isinstance(value, dict) and key in VALUE_KEYWORDS
            ):
                todo.append((sub, f"{pointer}/{_escape(str(key))}"))


def _pointer(path) -> str:
    return "".join("/" + _escape(str(p)) for p in path)


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")
