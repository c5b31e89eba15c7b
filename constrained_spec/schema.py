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
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import unquote

import jsonschema

from .errors import ConstraintError, SchemaTooComplex, UnsupportedSchemaError
from .schema_regex import (FORMATS, KNOWN_FORMATS, STRING_CHAR, PatternError, alternation,
                           format_body, integer_range, json_string, json_string_except, literal,
                           number_range, pattern_body, repeat)

# (times a recursive $ref is expanded before it counts as false, nesting allowed inside
# free-form values ({} / true schemas)), tried in order until the regex fits MAX_REGEX_CHARS
NESTING = ((3, 2), (2, 1), (1, 0))
NESTING_BUDGET = 50_000  # regex characters; ~1-5 s of index build with a 49k-token vocabulary
MAX_BRANCHES = 256       # anyOf combinations distributed over one node
MAX_REGEX_CHARS = 2_000_000
MAX_NUMBER_BOUND = 10**9  # |minimum|, |maximum| for non-integer numbers (float rounding)
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
TYPES = ("null", "boolean", "object", "array", "string", "number", "integer")
# Keywords that constrain instances; any of these not handled below is refused by name.
VALIDATION = {"type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
              "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "items",
              "prefixItems", "additionalItems", "maxItems", "minItems", "uniqueItems",
              "contains", "minContains", "maxContains", "maxProperties", "minProperties",
              "required", "properties", "patternProperties", "additionalProperties",
              "dependencies", "dependentRequired", "dependentSchemas", "propertyNames", "if",
              "then", "else", "allOf", "anyOf", "oneOf", "not", "$ref", "$dynamicRef",
              "$recursiveRef", "unevaluatedItems", "unevaluatedProperties", "disallow",
              "extends", "divisibleBy"}
HANDLED = {"type", "enum", "const", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
           "maxLength", "minLength", "pattern", "format", "items", "prefixItems",
           "additionalItems", "maxItems", "minItems", "uniqueItems", "maxProperties",
           "minProperties", "required", "properties", "patternProperties",
           "additionalProperties", "dependencies", "dependentRequired", "propertyNames",
           "allOf", "anyOf", "oneOf", "not", "$ref", "unevaluatedProperties", "multipleOf",
           "dependentSchemas", "if", "then", "else"}
DEPENDENCIES = ("dependencies", "dependentRequired", "dependentSchemas")
# Keywords that only constrain one JSON type: where a schema has no ``type``, they say which
# types it is about (see _types).
TYPE_KEYWORDS = {
    "object": {"properties", "required", "additionalProperties", "patternProperties",
               "minProperties", "maxProperties", "propertyNames", "unevaluatedProperties",
               *DEPENDENCIES},
    "array": {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
              "contains", "unevaluatedItems"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
}


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
    """Refuse a schema that is not valid JSON Schema, or that we cannot honour exactly."""
    schema_to_regex(schema)


def schema_to_regex(schema: dict, whitespace: str = "") -> str:
    """The regex of JSON texts the schema accepts; ``whitespace`` is allowed between tokens.
    Recursive ``$ref``s and free-form values are nested as deeply as NESTING allows while the
    regex stays within NESTING_BUDGET characters (shallower: fewer instances, all still valid;
    a smaller automaton, built in seconds rather than minutes)."""
    ctx = _Context.for_schema(schema, whitespace)
    best = None
    for ref_depth, any_depth in NESTING:
        ctx.ref_depth, ctx.any_depth, ctx.truncated, ctx.nested = ref_depth, any_depth, False, False
        try:
            regex = _node([(schema, "", ())], ctx)
        except SchemaTooComplex:
            if not ctx.nested or (ref_depth, any_depth) == NESTING[-1]:
                if best is None:
                    raise
                break
            continue
        if regex is None:
            break
        best = regex
        if len(regex) <= NESTING_BUDGET or not ctx.nested:
            break
    if best is None and ctx.truncated:
        raise UnsupportedSchemaError("$ref", "", f"no instance fits within {ctx.ref_depth} "
                                     "levels of recursion; raise constrained_spec.schema.NESTING.")
    if best is None:
        raise ConstraintError("no instance can be generated: the schema's keywords contradict "
                              "each other (e.g. a required property whose schema is false, or "
                              "oneOf branches that all match or all fail), or they leave nothing "
                              "in the subset this compiler generates (see constrained_spec."
                              "schema); fix or simplify the schema.")
    return best


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
class _Context:
    root: dict
    ws: str
    validator: Any  # jsonschema validator over root, with the format checker
    draft4: bool
    has_refs: bool
    truncated: bool = False  # a recursive $ref was cut at ref_depth
    nested: bool = False     # a recursive $ref or a nested free-form value was expanded
    ref_depth: int = NESTING[0][0]
    any_depth: int = NESTING[0][1]
    groups: int = 0

    @classmethod
    def for_schema(cls, schema: dict, ws: str) -> "_Context":
        if not isinstance(schema, dict):
            raise ConstraintError('a schema is a JSON object like {"type": "object", ...}.')
        vcls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            vcls.check_schema(schema)
        except jsonschema.SchemaError as e:
            pointer = "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in e.path)
            raise ConstraintError(f"not a valid JSON Schema at {pointer or '/'}: {e.message}"
                                  " (checked against its meta-schema).") from None
        if vcls is jsonschema.Draft3Validator:  # required/not/enum checks mean other things
            raise UnsupportedSchemaError("$schema", "", "draft-03 schemas are not supported; "
                                         "declare draft-04 or later (required as a list).")
        draft4 = vcls is jsonschema.Draft4Validator
        has_refs = '"$ref"' in json.dumps(schema)
        return cls(schema, ws, vcls(schema, format_checker=vcls.FORMAT_CHECKER), draft4, has_refs)

    def valid(self, value: Any, schemas: list) -> bool:
        try:
            return all(self.validator.evolve(schema=s).is_valid(value) for s in schemas)
        except Exception:  # unresolvable or runaway references: not provably valid
            return False

    def new_group(self) -> int:
        self.groups += 1
        return self.groups


# --- nodes, parts, distribution -------------------------------------------------------------

def _node(subs: list, ctx: _Context) -> str | None:
    """Regex of the JSON texts valid under all of ``subs`` ((schema, ptr, refs) triples);
    None if we can emit none."""
    parts: list[Part] = []
    for schema, ptr, refs in subs:
        flat = _flatten(schema, ptr, ctx, refs, ctx.new_group())
        if flat is None:
            return None
        parts += flat
    if not parts:
        ctx.nested |= ctx.any_depth > 0
    regex = _from_parts(parts, ctx) if parts else _any(ctx.any_depth, ctx.ws)
    if regex is not None and len(regex) > MAX_REGEX_CHARS:
        raise SchemaTooComplex(f"the regex for {subs[0][1] or '/'} exceeds {MAX_REGEX_CHARS:,} "
                               "characters: simplify the schema (fewer optional properties, "
                               "shallower nesting, smaller enums).")
    return regex


def _flatten(schema, ptr, ctx, refs, group, head=True) -> list[Part] | None:
    """The conjunction ``schema`` means, as parts; None if it is (or became) false."""
    if schema is False:
        return None
    if schema is True:
        return []
    if not isinstance(schema, dict):
        raise ConstraintError(f"not a schema at {ptr or '/'}: {schema!r}")
    parts = [Part({k: v for k, v in schema.items() if k not in ("allOf", "$ref")}, ptr, refs,
                  group, head)]
    if "$ref" in schema:
        ref = schema["$ref"]
        if refs.count(ref) >= ctx.ref_depth:
            ctx.truncated = True
            return None
        ctx.nested |= ref in refs
        target, target_ptr = _resolve(ref, ptr, ctx)
        sub = _flatten(target, target_ptr, ctx, refs + (ref,), group, False)
        if sub is None:
            return None
        parts += sub
    for i, member in enumerate(schema.get("allOf", [])):
        sub = _flatten(member, f"{ptr}/allOf/{i}", ctx, refs, group, False)
        if sub is None:
            return None
        parts += sub
    return parts


def _resolve(ref: str, ptr: str, ctx: _Context) -> tuple[Any, str]:
    base = ctx.root.get("$id") or (ctx.root.get("id") if ctx.draft4 else "") or ""
    if isinstance(base, str) and base.rstrip("#") and ref.startswith(base.rstrip("#")):
        ref = ref[len(base.rstrip("#")):] or "#"
    if ref != "#" and not ref.startswith("#/"):
        raise UnsupportedSchemaError("$ref", ptr, f"only local references (#/...) are supported, "
                                     f"not {ref!r}: inline the referenced schema.")
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


def _from_parts(parts: list[Part], ctx: _Context) -> str | None:
    if any("enum" in p.schema or "const" in p.schema for p in parts):
        return _candidates(parts, ctx)  # jsonschema checks each candidate against every keyword
    for i, part in enumerate(parts):
        for key in ("anyOf", "oneOf"):
            if key in part.schema:
                return _distribute(parts, i, key, ctx)
        for key in DEPENDENCIES:
            if part.schema.get(key):
                return _split_dependency(parts, i, key, ctx)
        if "if" in part.schema:
            return _split_conditional(parts, i, ctx)
    if any("not" in p.schema and not p.added for p in parts):
        parts = _apply_nots(parts, ctx)  # may bring in combinators (a double negation's operand)
        return None if parts is None else _from_parts(parts, ctx)
    _refuse_unhandled(parts, ctx)
    alts = [r for r in (_EMITTERS[t](parts, ctx) for t in _types(parts)) if r is not None]
    if not alts:  # e.g. a recursion cut short: the types inference left out may still fit
        alts = [r for r in (_EMITTERS[t](parts, ctx) for t in _types(parts, infer=False)
                            if t not in _types(parts)) if r is not None]
    return alternation(alts) if alts else None


def _without(part: Part, *keys: str) -> Part:
    return part._replace(schema={k: v for k, v in part.schema.items() if k not in keys})


def _rest(parts: list[Part], i: int, *keys: str) -> list[Part]:
    """``parts`` with ``keys`` taken out of part i (the keyword being resolved)."""
    return parts[:i] + [_without(parts[i], *keys)] + parts[i + 1:]


def _extra_part(part: Part, schema: dict) -> Part:
    """A conjunct the translation adds on behalf of ``part`` (same place, refs and group)."""
    return Part(schema, part.ptr, part.refs, part.group, False, True)


def _distribute(parts, i, key, ctx) -> str | None:
    """anyOf: the union of the branches. oneOf: the union over branches of "this branch and
    none of the others", each other branch excluded as a ``not`` would be (refused where no
    exclusion can be expressed)."""
    part = parts[i]
    branches = part.schema[key]
    if len(branches) > MAX_BRANCHES:
        raise SchemaTooComplex(f"{key} at {part.ptr or '/'} has {len(branches)} branches.")
    rest = _rest(parts, i, key)

    def branch_parts(j: int, branch) -> list[Part] | None:
        sub = _flatten(branch, f"{part.ptr}/{key}/{j}", ctx, part.refs, part.group, False)
        mine = None if sub is None else rest + sub
        for m, other in enumerate(branches if key == "oneOf" else []):
            if m != j and mine is not None:
                mine = _exclude(mine, (other, f"{part.ptr}/oneOf/{m}", part.refs), ctx,
                                part.ptr, "oneOf")
        return mine

    return _union([branch_parts(j, b) for j, b in enumerate(branches)], ctx)


def _union(branches: list, ctx) -> str | None:
    """The alternation of the branches' regexes (part lists; None adds nothing)."""
    alts = []
    for branch in branches:
        regex = None if branch is None else _from_parts(branch, ctx)
        if regex is not None and regex not in alts:
            alts.append(regex)
    return alternation(alts) if alts else None


def _split_dependency(parts, i, key, ctx) -> str | None:
    """One dependency, exactly: the trigger property is absent, or present with what it needs
    (required names, or a schema the whole object must satisfy)."""
    part = parts[i]
    deps = dict(part.schema[key])
    trigger, need = deps.popitem()
    rest = _rest(parts, i, key)
    if deps:
        rest[i].schema[key] = deps
    absent = rest + [_extra_part(part, {"properties": {trigger: False}})]
    present = rest + [_extra_part(part, {"required": [trigger]})]
    if isinstance(need, list):
        present.append(_extra_part(part, {"required": need}))
    else:
        sub = _flatten(need, f"{part.ptr}/{key}/{_escape(trigger)}", ctx, part.refs, part.group,
                       False)
        present = None if sub is None else present + sub
    return _union([absent, present], ctx)


def _split_conditional(parts, i, ctx) -> str | None:
    """if/then/else, exactly: (if and then) or (else, with the ``if`` failing as a ``not``)."""
    part = parts[i]
    s = part.schema
    rest = _rest(parts, i, "if", "then", "else")
    cond, then, other = (_flatten(s.get(key, True), f"{part.ptr}/{key}", ctx, part.refs,
                                  part.group, False) for key in ("if", "then", "else"))
    branches = [None if cond is None or then is None else rest + cond + then,
                None if other is None else
                _exclude(rest + other, (s["if"], f"{part.ptr}/if", part.refs), ctx,
                         f"{part.ptr}/if", "if")]
    return _union(branches, ctx)


def _apply_nots(parts, ctx) -> list[Part] | None:
    """Replace each ``not`` by conjuncts that make the negated schema fail (None: nothing is
    left). Those conjuncts may be stricter than the ``not`` (sound), never looser."""
    positive = [p if p.added else _without(p, "not") for p in parts]
    for p in parts:
        if "not" in p.schema and not p.added and positive is not None:
            positive = _exclude(positive, (p.schema["not"], p.ptr + "/not", p.refs), ctx,
                                p.ptr + "/not", "not")
    return positive


class _Facts(NamedTuple):
    """What a conjunction of parts says through its simple keywords (combinators ignored, so
    every fact is implied by the parts)."""
    types: set      # JSON types it allows (integer listed with number)
    required: set
    forbidden: set  # property names it rejects outright (false subschema, closed object)
    closed: list    # declared-name sets of parts with additionalProperties: false
    values: dict    # property -> canonical JSON of the const/enum values it allows


def _facts(parts: list[Part]) -> _Facts:
    types, required, forbidden, closed, values = set(TYPES), set(), set(), [], {}
    for p in parts:
        s = p.schema
        if "type" in s:
            ts = {s["type"]} if isinstance(s["type"], str) else set(s["type"])
            if "any" not in ts:
                types &= ts | ({"integer"} if "number" in ts else set())
        if "enum" in s or "const" in s:
            vals = s["enum"] if "enum" in s else [s["const"]]
            kinds = {_json_type(v) for v in vals}
            types &= kinds | ({"integer"} if "number" in kinds else set())
        if isinstance(s.get("required"), list):
            required |= set(s["required"])
        props = s.get("properties", {})
        forbidden |= {k for k, v in props.items() if v is False}
        if s.get("additionalProperties") is False and not s.get("patternProperties"):
            closed.append(set(props))
        for k, v in props.items():
            if isinstance(v, dict) and ("enum" in v or "const" in v):
                vals = {json.dumps(x, sort_keys=True) for x in v.get("enum", [v.get("const")])}
                values[k] = values[k] & vals if k in values else vals
    return _Facts(types, required, forbidden, closed, values)


def _rejects(facts: _Facts, name: str) -> bool:
    return name in facts.forbidden or any(name not in declared for declared in facts.closed)


def _exclude(parts, negated, ctx, ptr, keyword) -> list[Part] | None:
    """``parts`` plus conjuncts under which the ``negated`` (schema, ptr, refs) fails; None when
    nothing can satisfy both. Failing any one conjunct of the negated schema is enough, so the
    first that applies is taken (sound; it may leave out instances that fail it another way):
    the parts already exclude it; it only constrains types we do not emit (then it holds);
    a ``not`` inside it (then its operand is required); a JSON type it rejects; a property it
    requires (left out), forbids (required), or limits to const/enum values (others required);
    a numeric, length or item-count bound (the complement); each of its anyOf branches.
    Refused by ``keyword`` when none applies."""
    schema, nptr, refs = negated
    anchor = parts[0]
    if any("enum" in p.schema or "const" in p.schema for p in parts):  # jsonschema decides
        return parts + [Part({"not": schema}, nptr, refs, anchor.group, False)]
    flat = _flatten(schema, nptr, ctx, refs, ctx.new_group(), False)
    if flat is None:
        return parts  # not false: no constraint
    keys = {k for q in flat for k in q.schema if k in VALIDATION}
    emitted = set(_types(parts))
    pos, neg = _facts(parts), _facts(flat)
    outside = {t for t in emitted if t not in neg.types
               and not (t == "number" and "integer" in neg.types)}
    if outside == emitted:
        return parts
    if keys <= set().union(*[TYPE_KEYWORDS.get(_kind(t), set()) for t in TYPES if t not in emitted
                             and _kind(t) not in {_kind(e) for e in emitted}] or [set()]):
        return None  # the negated schema accepts every instance we would emit
    if emitted == {"object"} and keys <= {"required", "type"} and neg.required <= pos.required \
            and "object" in neg.types:
        return None  # the negated schema holds for every object we would emit
    if emitted == {"object"} and (
            any(_rejects(neg, k) for k in pos.required)
            or any(_rejects(pos, k) for k in neg.required)
            or any(k in neg.values and not (pos.values[k] & neg.values[k])
                   for k in pos.required & set(pos.values))):
        return parts

    def add(kind: str, schema: dict) -> list[Part]:
        keep = sorted(outside | {t for t in emitted if _kind(t) == kind})
        return parts + [_extra_part(anchor, {"type": keep, **schema})]

    for q in flat:
        if "not" in q.schema:  # not (X and not Y): require Y
            sub = _flatten(q.schema["not"], q.ptr + "/not", ctx, q.refs, anchor.group, False)
            return None if sub is None else parts + sub
    if outside:
        return parts + [_extra_part(anchor, {"type": sorted(outside)})]
    if "object" in emitted:
        declared = {k for q in parts for k in q.schema.get("properties", {})}
        for k in sorted(neg.required - pos.required):
            return add("object", {"properties": {k: False}})
        for k in sorted(declared - pos.required):
            if _rejects(neg, k) and not _rejects(pos, k):
                return add("object", {"required": [k]})
        for k in sorted(set(neg.values) & set(pos.values)):
            if pos.values[k] - neg.values[k]:
                values = [json.loads(v) for v in sorted(neg.values[k])]
                return add("object", {"required": [k],
                                      "properties": {k: {"not": {"enum": values}}}})
    values = [q.schema["enum"] if "enum" in q.schema else [q.schema["const"]] for q in flat
              if "enum" in q.schema or "const" in q.schema]
    plain = not any(k in q.schema for q in parts for k in TYPE_KEYWORDS["string"])
    if values and emitted - outside == {"string"} and plain:  # a string outside the values
        return add("string", {"not": {"enum": sorted(v for v in values[0] if isinstance(v, str))}})
    complement = _complement_bound(flat, emitted)
    if complement:
        return add(*complement)
    branches = [(b, f"{q.ptr}/anyOf/{j}", q.refs) for q in flat
                for j, b in enumerate(q.schema.get("anyOf", []))]
    if branches:  # not (X and anyOf B): every branch of B fails
        for branch in branches:
            parts = _exclude(parts, branch, ctx, ptr, keyword)
            if parts is None:
                return None
        return parts
    hint = ("its branches may overlap, and no type, property, const value or bound tells them "
            "apart; use anyOf if they are exclusive, or give each branch a distinct type or "
            "const discriminator property." if keyword == "oneOf" else
            "the automaton can exclude JSON types, properties, const/enum values and bounds, "
            "not this schema; rewrite the 'not' in those terms.")
    raise UnsupportedSchemaError(keyword, ptr, hint)


def _kind(t: str) -> str:
    return "number" if t == "integer" else t


_BOUND_COMPLEMENTS = (  # keyword -> (kind, the keyword and value an instance needs to fail it)
    ("minLength", "string", lambda n: ("maxLength", n - 1) if n > 0 else None),
    ("maxLength", "string", lambda n: ("minLength", n + 1)),
    ("minItems", "array", lambda n: ("maxItems", n - 1) if n > 0 else None),
    ("maxItems", "array", lambda n: ("minItems", n + 1)),
)


def _complement_bound(flat, emitted) -> tuple | None:
    """(kind, keywords) under which an instance of that kind fails one of the bounds in
    ``flat``; None if it has none we can complement for a kind we emit."""
    kinds = {_kind(t) for t in emitted}
    if "number" in kinds:
        lower, upper = _bounds(flat)
        if lower is not None:
            return "number", ({"exclusiveMaximum": lower[0]} if not lower[1] else
                              {"maximum": lower[0]})
        if upper is not None:
            return "number", ({"exclusiveMinimum": upper[0]} if not upper[1] else
                              {"minimum": upper[0]})
    for key, kind, complement in _BOUND_COMPLEMENTS:
        for q in flat:
            if kind in kinds and isinstance(q.schema.get(key), int) and complement(q.schema[key]):
                return kind, dict([complement(q.schema[key])])
    return None


def _json_type(v) -> str:
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}[type(v)]


def _refuse_unhandled(parts, ctx) -> None:
    for part in parts:
        for key, value in part.schema.items():
            if key in VALIDATION and key not in HANDLED:
                raise UnsupportedSchemaError(key, part.ptr)
            if key in ("$id", "id") and part.ptr and isinstance(value, str) and ctx.has_refs \
                    and not value.startswith("#") and (key == "$id" or ctx.draft4):
                raise UnsupportedSchemaError(key, part.ptr, "a nested base URI changes how "
                                             "$ref resolves; remove it or inline the references.")


_ADDED_VALIDATOR = jsonschema.Draft202012Validator({})


def _candidates(parts, ctx) -> str | None:
    alts = list(dict.fromkeys(_literal_value(v, ctx.ws) for v in _candidate_values(parts, ctx)))
    return alternation(alts) if alts else None


def _candidate_values(parts, ctx) -> list:
    """The first const/enum's values that every part accepts."""
    first = next(p.schema for p in parts if "enum" in p.schema or "const" in p.schema)
    values = first["enum"] if "enum" in first else [first["const"]]
    return [v for v in values if ctx.valid(v, [p.schema for p in parts if not p.added])
            and all(_ADDED_VALIDATOR.evolve(schema=p.schema).is_valid(v) for p in parts if p.added)]


def _literal_value(v, ws: str) -> str:
    if isinstance(v, dict):
        items = [json_string(k) + f"{ws}:{ws}" + _literal_value(x, ws) for k, x in v.items()]
        return rf"\{{{ws}" + f"{ws},{ws}".join(items) + rf"{ws}\}}"
    if isinstance(v, list):
        return rf"\[{ws}" + f"{ws},{ws}".join(_literal_value(x, ws) for x in v) + rf"{ws}\]"
    return json_string(v) if isinstance(v, str) else literal(json.dumps(v))


def _types(parts, infer: bool = True) -> list[str]:
    """The JSON types we emit: those ``type`` allows or, where no part says, those the parts'
    keywords are about (a schema with only ``properties`` is generated as an object; its other
    instances, like ``null``, are valid but never generated)."""
    for part in parts:
        t = part.schema.get("type")
        if t is not None and not all(isinstance(x, str) for x in ([t] if isinstance(t, str)
                                                                  else t)):
            raise UnsupportedSchemaError("type", part.ptr, "schemas inside 'type' (draft 3).")
    allowed = _facts(parts).types
    if infer and not any("type" in p.schema for p in parts):
        hinted = {t for t, keys in TYPE_KEYWORDS.items()
                  if any(keys & p.schema.keys() for p in parts)}
        allowed &= hinted | ({"integer"} if "number" in hinted else set()) or allowed
    if "number" in allowed:
        allowed.discard("integer")  # the number regex covers integers
    return [t for t in TYPES if t in allowed]


def _get(parts, key) -> list:
    return [(p.schema[key], p.ptr) for p in parts if key in p.schema]


def _sub(part: Part, schema, *path) -> tuple:
    return schema, part.ptr + "".join(f"/{_escape(str(x))}" for x in path), part.refs


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


# --- free-form values -----------------------------------------------------------------------

_ANY_CACHE: dict[tuple[int, str], str] = {}


def _any(depth: int, ws: str) -> str:
    if (depth, ws) not in _ANY_CACHE:
        string = f'"{STRING_CHAR}*"'
        alts = [string, NUMBER, "true", "false", "null"]
        if depth > 0:
            v = _any(depth - 1, ws)
            alts.append(rf"\[{ws}(?:{v}(?:{ws},{ws}{v})*)?{ws}\]")
            kv = f"{string}{ws}:{ws}{v}"
            alts.append(rf"\{{{ws}(?:{kv}(?:{ws},{ws}{kv})*)?{ws}\}}")
        _ANY_CACHE[(depth, ws)] = alternation(alts)
    return _ANY_CACHE[(depth, ws)]


# --- strings --------------------------------------------------------------------------------

def _string(parts, ctx) -> str | None:
    excluded = {v for p in parts if p.added and "not" in p.schema for v in p.schema["not"]["enum"]}
    if excluded:  # added on plain strings only (see _exclude); a later bound cannot join it
        plain = not any(k in p.schema for p in parts for k in TYPE_KEYWORDS["string"])
        return json_string_except(excluded) if plain else None
    lo = max([v for v, _ in _get(parts, "minLength")], default=0)
    his = [v for v, _ in _get(parts, "maxLength")]
    hi = min(his) if his else None
    if hi is not None and lo > hi:
        return None
    patterns = _get(parts, "pattern")
    formats = [(f, p) for f, p in _get(parts, "format") if f in KNOWN_FORMATS]
    for f, ptr in formats:
        if f not in FORMATS:
            raise UnsupportedSchemaError(f"format: {f}", ptr, "supported formats: "
                                         f"{', '.join(sorted(FORMATS))}.")
    if len({p for p, _ in patterns}) + len({f for f, _ in formats}) > 1:
        ptr = (patterns or formats)[-1][1]
        raise UnsupportedSchemaError("pattern", ptr, "several patterns/formats on one string "
                                     "cannot be intersected; merge them into one pattern.")
    try:
        if patterns:
            return '"' + pattern_body(patterns[0][0], lo, hi) + '"'
        if formats:
            return '"' + format_body(formats[0][0], lo, hi) + '"'
    except PatternError as e:
        key, ptr = ("pattern", patterns[0][1]) if patterns else ("format", formats[0][1])
        raise UnsupportedSchemaError(key, ptr, f"{e}.") from None
    return '"' + (repeat(STRING_CHAR, lo, hi) if (lo, hi) != (0, None) else STRING_CHAR + "*") + '"'


# --- numbers --------------------------------------------------------------------------------

def _bounds(parts) -> tuple:
    """Tightest (value, exclusive, pointer, keyword) lower and upper bounds, or None."""
    lower = upper = None
    for p in parts:
        s = p.schema
        for key, ex_key, is_lower in (("minimum", "exclusiveMinimum", True),
                                      ("maximum", "exclusiveMaximum", False)):
            cands = []
            if key in s:  # draft 4: exclusiveMinimum is a boolean modifier of minimum
                cands.append((s[key], s.get(ex_key) is True, key))
            if ex_key in s and not isinstance(s[ex_key], bool):
                cands.append((s[ex_key], True, ex_key))
            for v, ex, k in cands:
                cur = lower if is_lower else upper
                sign = 1 if is_lower else -1
                if cur is None or sign * v > sign * cur[0] or (v == cur[0] and ex):
                    if is_lower:
                        lower = (v, ex, p.ptr, k)
                    else:
                        upper = (v, ex, p.ptr, k)
    return lower, upper


def _integer(parts, ctx) -> str | None:
    for m, ptr in _get(parts, "multipleOf"):
        if m != 1:
            raise UnsupportedSchemaError("multipleOf", ptr, "only multipleOf: 1 is supported.")
    lower, upper = _bounds(parts)
    lo = None if lower is None else (math.floor(lower[0]) + 1 if lower[1] else math.ceil(lower[0]))
    hi = None if upper is None else (math.ceil(upper[0]) - 1 if upper[1] else math.floor(upper[0]))
    return integer_range(lo, hi)


def _number(parts, ctx) -> str | None:
    if _get(parts, "multipleOf"):
        return _integer(parts, ctx)  # multipleOf 1: the integers (refused otherwise)
    lower, upper = _bounds(parts)
    if lower is None and upper is None:
        return NUMBER
    for bound in (lower, upper):
        if bound is not None and abs(bound[0]) > MAX_NUMBER_BOUND:
            raise UnsupportedSchemaError(bound[3], bound[2], "a bound on a non-integer number "
                                         "must lie within ±1e9 (beyond, float rounding could let "
                                         "in values past it); use type: integer.")
    return number_range(None if lower is None else lower[0], bool(lower and lower[1]),
                        None if upper is None else upper[0], bool(upper and upper[1]))


# --- arrays ---------------------------------------------------------------------------------

def _array(parts, ctx) -> str | None:
    lo = max([v for v, _ in _get(parts, "minItems")], default=0)
    his = [v for v, _ in _get(parts, "maxItems")]
    hi = min(his) if his else None
    layouts = [_item_layout(p) for p in parts]
    for unique, ptr in _get(parts, "uniqueItems"):
        if unique and (hi is None or hi > 1):
            return _distinct_items(parts, layouts, lo, hi, ptr, ctx)
    n_prefix = max([len(prefix) for prefix, _ in layouts], default=0)
    if hi is not None:
        n_prefix = min(n_prefix, hi)

    def element(i: int | None) -> str | None:  # None: the items after the prefix
        picked = [prefix[i] if i is not None and i < len(prefix) else rest
                  for prefix, rest in layouts]
        subs = [_sub(p, schema, *path) for p, (schema, path) in zip(parts, picked)]
        return _node(subs, ctx)

    elements = [element(i) for i in range(n_prefix)]
    rest = element(None) if hi is None or hi > n_prefix else None
    body = _items_from(0, elements, rest, lo, None if hi is None else hi - n_prefix, ctx.ws)
    return None if body is None else rf"\[{ctx.ws}{body}{ctx.ws}\]"


def _distinct_items(parts, layouts, lo, hi, ptr, ctx) -> str | None:
    """uniqueItems over items from a finite set of values: each value at most once, in the
    enum's order (fewer arrays than the schema allows, all valid). Refused otherwise."""
    subs = [_sub(p, schema, *path) for p, (prefix, (schema, path)) in zip(parts, layouts)]
    flat = [] if any(prefix for prefix, _ in layouts) else [
        q for schema, sptr, refs in subs for q in _flatten(schema, sptr, ctx, refs, 0) or []]
    if not any("enum" in q.schema or "const" in q.schema for q in flat):
        raise UnsupportedSchemaError("uniqueItems", ptr, "an automaton cannot check that items "
                                     "differ unless they come from an enum; drop it or set "
                                     "maxItems: 1.")
    distinct = []
    for v in _candidate_values(flat, ctx):
        if all(_ADDED_VALIDATOR.evolve(schema={"uniqueItems": True}).is_valid([u, v])
               for u in distinct):
            distinct.append(v)
    if len(distinct) < lo:
        return None
    entries = [(_literal_value(v, ctx.ws), False) for v in distinct]
    return rf"\[{ctx.ws}{_members(entries, None, lo, hi, ctx.ws)}{ctx.ws}\]"


def _item_layout(part: Part) -> tuple[list, tuple]:
    """(prefix item (schema, path) pairs, (schema, path) for the items after the prefix)."""
    s = part.schema
    if "prefixItems" in s:
        return ([(x, ("prefixItems", i)) for i, x in enumerate(s["prefixItems"])],
                (s.get("items", True), ("items",)))
    if isinstance(s.get("items"), list):
        return ([(x, ("items", i)) for i, x in enumerate(s["items"])],
                (s.get("additionalItems", True), ("additionalItems",)))
    return [], (s.get("items", True), ("items",))


def _items_from(i, elements, rest, lo, rest_hi, ws) -> str | None:
    """Items at positions >= i (each after a comma unless i == 0); at least ``lo`` in all."""
    sep = "" if i == 0 else f"{ws},{ws}"
    if i == len(elements):
        need = max(lo - i, 0)
        if rest is None or rest_hi == 0:
            return "" if need == 0 else None
        if i > 0:
            return repeat(sep + rest, need, rest_hi)
        more = repeat(f"{ws},{ws}{rest}", max(need - 1, 0), None if rest_hi is None else rest_hi - 1)
        return f"{rest}{more}" if need else f"(?:{rest}{more})?"
    nxt = _items_from(i + 1, elements, rest, lo, rest_hi, ws)
    present = None if elements[i] is None or nxt is None else sep + elements[i] + nxt
    if i >= lo:  # the array may end before item i
        return f"(?:{present})?" if present else ""
    return present


# --- objects --------------------------------------------------------------------------------

def _object(parts, ctx) -> str | None:
    required = _required(parts)
    declared = {n for p in parts for n in p.schema.get("properties", {})}
    names = list(dict.fromkeys([n for p in parts for n in p.schema.get("properties", {})]
                               + sorted(required)))
    entries = []
    for name in names:
        value = _node(_property_subs(name, parts, declared), ctx) \
            if _name_allowed(name, parts, ctx) else None
        if value is None and name in required:
            return None
        if value is not None:
            entries.append((f"{json_string(name)}{ctx.ws}:{ctx.ws}{value}", name in required))
    extra = _extra_member(parts, ctx)
    n_req = sum(r for _, r in entries)
    least = max([m for m, _ in _get(parts, "minProperties")], default=0)
    most = min([m for m, _ in _get(parts, "maxProperties")], default=None)
    if (most is not None and max(n_req, least) > most) or (extra is None and least > len(entries)):
        return None
    if extra is not None and least > max(n_req, 1 if not entries else 0):
        raise UnsupportedSchemaError("minProperties", _get(parts, "minProperties")[0][1],
                                     "more properties than are required, on an object with "
                                     "undeclared properties (a repeated key would count once); "
                                     "list them in 'required' instead.")
    return rf"\{{{ctx.ws}{_members(entries, extra, least, most, ctx.ws)}{ctx.ws}\}}"


def _required(parts) -> set:
    out = set()
    for names, ptr in _get(parts, "required"):
        if not isinstance(names, list):
            raise UnsupportedSchemaError("required", ptr, "a boolean 'required' (draft 3).")
        out |= set(names)
    return out


def _property_subs(name: str, parts, declared: set) -> list:
    """Every schema the value of property ``name`` must satisfy, one per applicable keyword."""
    subs = []
    for p in parts:
        s = p.schema
        props, pattern_props = s.get("properties", {}), s.get("patternProperties", {})
        if name in props:
            subs.append(_sub(p, props[name], "properties", name))
        matched = [pat for pat in pattern_props if _search(pat, name, p.ptr)]
        subs += [_sub(p, pattern_props[pat], "patternProperties", pat) for pat in matched]
        if name not in props and not matched and "additionalProperties" in s:
            subs.append(_sub(p, s["additionalProperties"], "additionalProperties"))
        elif name not in props and not matched and "unevaluatedProperties" in s:
            if not p.head:
                raise UnsupportedSchemaError("unevaluatedProperties", p.ptr, "inside allOf/$ref "
                                             "targets; move it to the top of the schema.")
            group_declared = {n for q in parts if q.group == p.group
                              for n in q.schema.get("properties", {})}
            if name not in group_declared:
                subs.append(_sub(p, s["unevaluatedProperties"], "unevaluatedProperties"))
    return subs


def _search(pattern: str, name: str, ptr: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        raise UnsupportedSchemaError("patternProperties", ptr, f"{pattern!r} is not a valid "
                                     "regular expression.") from None


def _name_allowed(name: str, parts, ctx) -> bool:
    return ctx.valid(name, [s for s, _ in _get(parts, "propertyNames")])


def _extra_member(parts, ctx) -> str | None:
    """Regex of one undeclared ``"key":value`` member, or None if we emit none: only where no
    part declares properties (a key regex cannot exclude the declared names). Under one
    ``patternProperties`` pattern, keys are drawn from that pattern (a subset of the keys
    allowed, whose values are all checked by its schema)."""
    if any(p.schema.get("properties") or "unevaluatedProperties" in p.schema for p in parts):
        return None
    patterned = [(p, pat) for p in parts for pat in p.schema.get("patternProperties", {})]
    if len(patterned) > 1 or (patterned and any("propertyNames" in p.schema for p in parts)):
        return None
    values = [_sub(p, p.schema["additionalProperties"], "additionalProperties")
              for p in parts if "additionalProperties" in p.schema
              and not (patterned and p is patterned[0][0])]
    if patterned:
        owner, pat = patterned[0]
        values.append(_sub(owner, owner.schema["patternProperties"][pat], "patternProperties", pat))
        try:
            key = f'"{pattern_body(pat)}"'
        except PatternError:
            return None
    else:
        keys = [_sub(p, p.schema["propertyNames"], "propertyNames")
                for p in parts if "propertyNames" in p.schema]
        key = _node(keys + [({"type": "string"}, "", ())], ctx)
    value = _node(values, ctx)
    return None if value is None or key is None else f"{key}{ctx.ws}:{ctx.ws}{value}"


def _members(entries, extra, least, most, ws) -> str:
    """Members in declared order, optional ones possibly absent, then undeclared ones (only
    where all declared ones are required); ``least`` to ``most`` members in all. Past ``most``,
    the later optional members are left out; for ``least``, the first optional ones become
    required but one, then at least one of the others is present (fewer instances, sound)."""
    sep = f"{ws},{ws}"
    if extra is not None:  # entries are all required here
        head = sep.join(kv for kv, _ in entries)
        spare = None if most is None else most - len(entries)
        if head:
            return head + repeat(sep + extra, 0, spare)
        if spare == 0:
            return ""
        body = extra + repeat(sep + extra, 0, None if spare is None else spare - 1)
        return body if least else f"(?:{body})?"
    n_req = sum(req for _, req in entries)
    spare = None if most is None else most - n_req
    promote = max(least - n_req - 1, 0)
    kept = []
    for kv, req in entries:
        if not req and spare is not None:
            if spare == 0:
                continue
            spare -= 1
        if not req and promote:
            req, promote = True, promote - 1
        kept.append((kv, req))
    if least <= sum(req for _, req in kept):
        return _sequence(kept, sep)
    optional = [i for i, (_, req) in enumerate(kept) if not req]  # which one is the last present
    if len(_sequence(kept, sep)) * len(optional) > MAX_REGEX_CHARS // 20:  # big members: linear
        return _sequence([(kv, req or i == optional[0]) for i, (kv, req) in enumerate(kept)], sep)
    return alternation([_sequence([(kv, req or i == j) for i, (kv, req) in enumerate(kept)
                                   if req or i <= j], sep) for j in optional])


def _sequence(entries, sep) -> str:
    """Members in order, the optional ones possibly absent, commas only between members."""
    first_req = next((i for i, (_, req) in enumerate(entries) if req), None)
    if first_req is not None:  # linear: optional members before the first required one
        before = "".join(f"(?:{kv}{sep})?" for kv, _ in entries[:first_req])
        after = "".join(f"(?:{sep}{kv})" + ("" if req else "?")
                        for kv, req in entries[first_req + 1:])
        return before + entries[first_req][0] + after
    # which member comes last: alternatives that differ only at their end determinize into
    # one chain of automaton states ("which comes first" needs a chain per member), but repeat
    # the early members; where those are big, the shorter text wins
    last = "|".join("".join(f"(?:{kv2}{sep})?" for kv2, _ in entries[:i]) + kv
                    for i, (kv, _) in enumerate(entries))
    if len(last) > MAX_REGEX_CHARS // 20:
        first = "|".join(kv + "".join(f"(?:{sep}{kv2})?" for kv2, _ in entries[i + 1:])
                         for i, (kv, _) in enumerate(entries))
        last = min(last, first, key=len)
    return f"(?:{last})?" if entries else ""


_EMITTERS = {"null": lambda parts, ctx: "null", "boolean": lambda parts, ctx: "(?:true|false)",
             "object": _object, "array": _array, "string": _string, "number": _number,
             "integer": _integer}
