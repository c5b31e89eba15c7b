"""JSON Schema front end: load a schema, check it, translate it into a *sound* regex.

Sound means: every text the regex matches is JSON that jsonschema (with its format checker)
accepts. The translation honours a keyword exactly, or emits a subset of its instances (a fixed
property order, no exponents in bounded numbers, no \\uXXXX escapes beyond control characters,
bounded nesting of free-form values and of recursive ``$ref``s, only the types a type-less
schema's keywords are about, one chosen way of failing a ``not``), or refuses the schema with
``UnsupportedSchemaError`` naming the keyword and its JSON pointer. It never lets in an instance
the schema rejects.

How: a schema node is the conjunction of its *parts* (the node, its ``allOf`` members and ``$ref``
targets, flattened). ``enum``/``const`` candidates are kept iff jsonschema validates them against
all parts. Otherwise ``anyOf`` is distributed over the parts; ``oneOf`` too, each branch with
the others negated; a dependency splits into "trigger absent" and "trigger present with what it
needs"; a ``not`` becomes conjuncts under which its schema fails. What is left is the union, over
the types the parts allow, of that type's regex under the parts' keywords for it. Keywords JSON
Schema does not define are annotations (jsonschema ignores them), and so are ``nullable``
(OpenAPI) and unknown formats.

Modules, along the data flow: ``load`` (what a user passes → a dict), ``context`` (keyword
tables, parts, the validator), ``rewrite`` (combinators, ``$ref``, ``not`` → parts), ``emit``
(one JSON type's regex under the parts), ``regex`` (regex building blocks), ``limits``
(nesting depths and sizes, read at call time).
"""

from __future__ import annotations

from ..errors import ConstraintError, SchemaTooComplex, UnsupportedSchemaError
from . import limits
from .context import Context
from .load import check_depth, load_schema
from .rewrite import node

__all__ = ["load_schema", "check_schema", "schema_to_regex"]


def check_schema(schema: dict) -> None:
    """Refuse a schema that is not valid JSON Schema, or that we cannot honour exactly."""
    schema_to_regex(schema)


def schema_to_regex(schema: dict, whitespace: str = "") -> str:
    """The regex of JSON texts the schema accepts; ``whitespace`` is allowed between tokens.
    Recursive ``$ref``s and free-form values are nested as deeply as ``limits.NESTING`` allows
    while the regex stays within ``limits.NESTING_BUDGET`` characters (shallower: fewer
    instances, all still valid; a smaller automaton, built in seconds rather than minutes)."""
    if isinstance(schema, dict):
        check_depth(schema, "the schema")
    try:
        return _translate(schema, whitespace)
    except RecursionError:  # $ref chains and combinators can nest deeper than the document
        raise SchemaTooComplex(
            "the schema nests too deeply to translate (through $ref or combinators): flatten it."
        ) from None


def _translate(schema: dict, whitespace: str) -> str:
    ctx = Context.for_schema(schema, whitespace)
    best = None
    for ref_depth, any_depth in limits.NESTING:
        ctx.ref_depth, ctx.any_depth, ctx.truncated, ctx.nested = ref_depth, any_depth, False, False
        try:
            regex = node([(schema, "", ())], ctx)
        except SchemaTooComplex:
            if not ctx.nested or (ref_depth, any_depth) == limits.NESTING[-1]:
                if best is None:
                    raise
                break
            continue
        if regex is None:
            break
        best = regex
        if len(regex) <= limits.NESTING_BUDGET or not ctx.nested:
            break
    if best is None and ctx.truncated:
        raise UnsupportedSchemaError(
            "$ref",
            "",
            f"no instance fits within {ctx.ref_depth} "
            "levels of recursion; raise constrained_spec.schema.limits.NESTING.",
        )
    if best is None:
        raise ConstraintError(
            "no instance can be generated: the schema's keywords contradict "
            "each other (e.g. a required property whose schema is false, or "
            "oneOf branches that all match or all fail), or they leave nothing "
            "in the subset this compiler generates (see constrained_spec."
            "schema); fix or simplify the schema."
        )
    return best
