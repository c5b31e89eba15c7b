"""What the translation works on: the keyword tables, a schema node's parts (its conjuncts,
each with its JSON pointer), and the context of one translation (the root schema, its
jsonschema validator, the nesting depths in force)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import unquote

import jsonschema
from referencing import Registry

from ..errors import ConstraintError, UnsupportedSchemaError
from . import limits

TYPES = ("null", "boolean", "object", "array", "string", "number", "integer")


# Keywords that constrain instances; any of these not handled below is refused by name.
VALIDATION = {
    "type",
    "enum",
    "const",
    "multipleOf",
    "maximum",
    "exclusiveMaximum",
    "minimum",
    "exclusiveMinimum",
    "maxLength",
    "minLength",
    "pattern",
    "format",
    "items",
    "prefixItems",
    "additionalItems",
    "maxItems",
    "minItems",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "maxProperties",
    "minProperties",
    "required",
    "properties",
    "patternProperties",
    "additionalProperties",
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "propertyNames",
    "if",
    "then",
    "else",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "$ref",
    "$dynamicRef",
    "$recursiveRef",
    "unevaluatedItems",
    "unevaluatedProperties",
    "disallow",
    "extends",
    "divisibleBy",
}


HANDLED = {
    "type",
    "enum",
    "const",
    "maximum",
    "exclusiveMaximum",
    "minimum",
    "exclusiveMinimum",
    "maxLength",
    "minLength",
    "pattern",
    "format",
    "items",
    "prefixItems",
    "additionalItems",
    "maxItems",
    "minItems",
    "uniqueItems",
    "maxProperties",
    "minProperties",
    "required",
    "properties",
    "patternProperties",
    "additionalProperties",
    "dependencies",
    "dependentRequired",
    "propertyNames",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "$ref",
    "unevaluatedProperties",
    "multipleOf",
    "dependentSchemas",
    "if",
    "then",
    "else",
}


DEPENDENCIES = ("dependencies", "dependentRequired", "dependentSchemas")


# Keywords that only constrain one JSON type: where a schema has no ``type``, they say which
# types it is about (see _types).
TYPE_KEYWORDS = {
    "object": {
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "minProperties",
        "maxProperties",
        "propertyNames",
        "unevaluatedProperties",
        *DEPENDENCIES,
    },
    "array": {
        "items",
        "prefixItems",
        "additionalItems",
        "minItems",
        "maxItems",
        "uniqueItems",
        "contains",
        "unevaluatedItems",
    },
    "string": {"minLength", "maxLength", "pattern", "format"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
}


class Part(NamedTuple):
    """One conjunct of a node: a schema dict, where it is, which $refs led to it, and which
    flattened schema it belongs to (``unevaluatedProperties`` sees its group's declarations)."""

    schema: dict
    ptr: str
    refs: tuple
    group: int
    head: bool
    added: bool = False  # written by the translation (in 2020-12 terms), not by the user


@dataclass
class Context:
    root: dict
    ws: str
    validator: Any  # jsonschema validator over root, with the format checker
    draft4: bool
    has_refs: bool
    truncated: bool = False  # a recursive $ref was cut at ref_depth
    nested: bool = False  # a recursive $ref or a nested free-form value was expanded
    ref_depth: int = limits.NESTING[0][0]
    any_depth: int = limits.NESTING[0][1]
    groups: int = 0

    @classmethod
    def for_schema(cls, schema: dict, ws: str) -> Context:
        if not isinstance(schema, dict):
            raise ConstraintError('a schema is a JSON object like {"type": "object", ...}.')
        if not isinstance(schema.get("$schema", ""), str):  # jsonschema would crash on it
            raise ConstraintError(
                f"$schema is {schema['$schema']!r}: it must be a meta-schema URI string such "
                'as "https://json-schema.org/draft/2020-12/schema", or left out.'
            )
        vcls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            vcls.check_schema(schema)
        except jsonschema.SchemaError as e:
            pointer = "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in e.path)
            raise ConstraintError(
                f"not a valid JSON Schema at {pointer or '/'}: {e.message}"
                " (checked against its meta-schema)."
            ) from None
        if vcls is jsonschema.Draft3Validator:  # required/not/enum checks mean other things
            raise UnsupportedSchemaError(
                "$schema",
                "",
                "draft-03 schemas are not supported; "
                "declare draft-04 or later (required as a list).",
            )
        draft4 = vcls is jsonschema.Draft4Validator
        refuse_remote_refs(schema, draft4)
        has_refs = '"$ref"' in json.dumps(schema)
        validator = vcls(schema, format_checker=vcls.FORMAT_CHECKER, registry=NO_RETRIEVAL)
        return cls(schema, ws, validator, draft4, has_refs)

    def valid(self, value: Any, schemas: list) -> bool:
        try:
            return all(self.validator.evolve(schema=s).is_valid(value) for s in schemas)
        except Exception:  # unresolvable or runaway references: not provably valid
            return False

    def new_group(self) -> int:
        self.groups += 1
        return self.groups


def _refuse_retrieval(uri: str):
    raise UnsupportedSchemaError("$ref", "", f"{uri!r} is not in the schema: nothing is fetched.")


# jsonschema's default registry fetches unknown URIs over the network (deprecated, still on):
# every validator here gets this one, which knows the meta-schemas and refuses anything else.
NO_RETRIEVAL = Registry(retrieve=_refuse_retrieval)
DATA_KEYWORDS = ("const", "enum", "default", "examples")  # their values are instances, not schemas


def refuse_remote_refs(schema: dict, draft4: bool) -> None:
    """Refuse, by name and before any validation, every reference outside this document."""
    base = schema.get("$id") or (schema.get("id") if draft4 else "") or ""
    base = base.rstrip("#") if isinstance(base, str) else ""
    todo = [(schema, "")]
    while todo:  # iterative: a deep document must not overflow the stack here
        value, ptr = todo.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, sub in items:
            here = f"{ptr}/{escape_pointer(str(key))}"
            if key in ("$ref", "$dynamicRef", "$recursiveRef") and isinstance(sub, str):
                local = sub[len(base) :] if base and sub.startswith(base) else sub
                if local and not local.startswith("#"):
                    raise UnsupportedSchemaError(
                        key,
                        ptr,
                        f"{sub!r} refers outside the schema, and references are never "
                        "fetched: inline the referenced schema under $defs and point to it "
                        "with #/$defs/....",
                    )
            elif isinstance(sub, (dict, list)) and not (
                isinstance(value, dict) and key in DATA_KEYWORDS
            ):
                todo.append((sub, here))


def resolve(ref: str, ptr: str, ctx: Context) -> tuple[Any, str]:
    base = ctx.root.get("$id") or (ctx.root.get("id") if ctx.draft4 else "") or ""
    if isinstance(base, str) and base.rstrip("#") and ref.startswith(base.rstrip("#")):
        ref = ref[len(base.rstrip("#")) :] or "#"
    if ref != "#" and not ref.startswith("#/"):
        raise UnsupportedSchemaError(
            "$ref",
            ptr,
            f"only local references (#/...) are supported, "
            f"not {ref!r}: inline the referenced schema.",
        )
    node: Any = ctx.root
    for token in ref[2:].split("/") if ref != "#" else []:
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        elif isinstance(node, dict) and token in node:
            node = node[token]
        else:
            raise ConstraintError(f"$ref {ref!r} at {ptr or '/'} points to nothing in the schema.")
    return node, ref[1:]


def without(part: Part, *keys: str) -> Part:
    return part._replace(schema={k: v for k, v in part.schema.items() if k not in keys})


def rest_of(parts: list[Part], i: int, *keys: str) -> list[Part]:
    """``parts`` with ``keys`` taken out of part i (the keyword being resolved)."""
    return parts[:i] + [without(parts[i], *keys)] + parts[i + 1 :]


def extra_part(part: Part, schema: dict) -> Part:
    """A conjunct the translation adds on behalf of ``part`` (same place, refs and group)."""
    return Part(schema, part.ptr, part.refs, part.group, False, True)


def values_of(parts, key) -> list:
    return [(p.schema[key], p.ptr) for p in parts if key in p.schema]


def subschema(part: Part, schema, *path) -> tuple:
    return schema, part.ptr + "".join(f"/{escape_pointer(str(x))}" for x in path), part.refs


def escape_pointer(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


ADDED_VALIDATOR = jsonschema.Draft202012Validator({}, registry=NO_RETRIEVAL)
