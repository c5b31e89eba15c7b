"""JSON Schema front end: load a schema, check it, translate it into a *sound* regex.

Sound means: every text the regex matches is JSON that jsonschema (with its format checker)
accepts. The translation honours a keyword exactly, or emits a subset of its instances (a fixed
property order, no exponents in bounded numbers, ASCII-only ``\\d``, bounded nesting of free-form
values and of recursive ``$ref``s), or refuses the schema with ``UnsupportedSchemaError`` naming
the keyword and its JSON pointer. It never lets in an instance the schema rejects.

How: a schema node is the conjunction of its *parts* (the node, its ``allOf`` members and ``$ref``
targets, flattened). ``anyOf`` (and ``oneOf`` whose branches are provably disjoint) is
distributed over the parts. ``enum``/``const`` candidates are kept iff jsonschema validates them
against all parts. Otherwise the regex is the union, over the types the parts allow, of that
type's regex under the parts' keywords for it. Keywords JSON Schema does not define are
annotations (jsonschema ignores them), and so are ``nullable`` (OpenAPI) and unknown formats.
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
                           format_body, integer_range, json_string, literal, number_range,
                           pattern_body, repeat)

MAX_REF_DEPTH = 3        # a recursive $ref is expanded this many times, then treated as empty
ANY_DEPTH = 2            # nesting allowed inside free-form values ({} / true schemas)
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
           "allOf", "anyOf", "oneOf", "$ref", "unevaluatedProperties", "multipleOf"}


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
    """The regex of JSON texts the schema accepts; ``whitespace`` is allowed between tokens."""
    ctx = _Context.for_schema(schema, whitespace)
    regex = _node([(schema, "", ())], ctx)
    if regex is None:
        raise UnsupportedSchemaError("$ref" if ctx.truncated else "type", "", (
            f"no instance fits within {MAX_REF_DEPTH} levels of recursion; raise "
            "constrained_spec.schema.MAX_REF_DEPTH." if ctx.truncated else
            "the schema accepts no instance at all (contradictory keywords)."))
    return regex


class Part(NamedTuple):
    """One conjunct of a node: a schema dict, where it is, which $refs led to it, and which
    flattened schema it belongs to (``unevaluatedProperties`` sees its group's declarations)."""
    schema: dict
    ptr: str
    refs: tuple
    group: int
    head: bool


@dataclass
class _Context:
    root: dict
    ws: str
    validator: Any  # jsonschema validator over root, with the format checker
    draft4: bool
    has_refs: bool
    truncated: bool = False
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
        draft4 = vcls in (jsonschema.Draft3Validator, jsonschema.Draft4Validator)
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
    regex = _from_parts(parts, ctx) if parts else _any(ANY_DEPTH, ctx.ws)
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
        if refs.count(ref) >= MAX_REF_DEPTH:
            ctx.truncated = True
            return None
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
    for i, part in enumerate(parts):
        for key in ("anyOf", "oneOf"):
            if key in part.schema:
                return _distribute(parts, i, key, ctx)
    _refuse_unhandled(parts, ctx)
    if any("enum" in p.schema or "const" in p.schema for p in parts):
        return _candidates(parts, ctx)
    alts = [r for r in (_EMITTERS[t](parts, ctx) for t in _types(parts)) if r is not None]
    return alternation(alts) if alts else None


def _distribute(parts, i, key, ctx) -> str | None:
    part = parts[i]
    branches = part.schema[key]
    if key == "oneOf" and not _disjoint(branches, part.ptr, ctx):
        raise UnsupportedSchemaError("oneOf", part.ptr, "its branches may overlap, so 'exactly "
                                     "one' cannot be checked by the automaton; use anyOf if the "
                                     "branches are exclusive, or give them distinct types or "
                                     "const discriminator properties.")
    if len(branches) > MAX_BRANCHES:
        raise SchemaTooComplex(f"{key} at {part.ptr or '/'} has {len(branches)} branches.")
    rest = list(parts)
    rest[i] = part._replace(schema={k: v for k, v in part.schema.items() if k != key})
    alts = []
    for j, branch in enumerate(branches):
        sub = _flatten(branch, f"{part.ptr}/{key}/{j}", ctx, part.refs, part.group, False)
        regex = None if sub is None else _from_parts(rest + sub, ctx)
        if regex is not None and regex not in alts:
            alts.append(regex)
    return alternation(alts) if alts else None


def _disjoint(branches, ptr, ctx) -> bool:
    """oneOf branches are pairwise exclusive: distinct types, or a required property whose
    const/enum values differ between every two branches."""
    flats = [_flatten(b, ptr, ctx, (), 0) or [] for b in branches]
    types = [_branch_types(f) for f in flats]
    if all(not (a & b) for i, a in enumerate(types) for b in types[i + 1:]):
        return True
    keys = [_discriminators(f) for f in flats]
    for name in set.intersection(*[set(k) for k in keys]):
        vals = [k[name] for k in keys]
        if all(not (a & b) for i, a in enumerate(vals) for b in vals[i + 1:]):
            return True
    return False


def _branch_types(parts: list[Part]) -> set:
    if any("anyOf" in p.schema or "oneOf" in p.schema for p in parts):
        return set(TYPES)
    for p in parts:
        if "enum" in p.schema or "const" in p.schema:
            values = p.schema.get("enum", [p.schema.get("const")])
            return {_json_type(v) for v in values}
    types = set(_types(parts))
    return types | {"number", "integer"} if types & {"number", "integer"} else types


def _discriminators(parts: list[Part]) -> dict:
    """Required properties with const/enum values: name -> set of canonical JSON values."""
    required = {n for p in parts for n in p.schema.get("required", []) if isinstance(n, str)}
    out = {}
    for p in parts:
        for name, sub in p.schema.get("properties", {}).items():
            if name in required and isinstance(sub, dict) and ("const" in sub or "enum" in sub):
                values = sub.get("enum", [sub.get("const")])
                out[name] = {json.dumps(v, sort_keys=True) for v in values}
    return out


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


def _candidates(parts, ctx) -> str | None:
    first = next(p.schema for p in parts if "enum" in p.schema or "const" in p.schema)
    values = first["enum"] if "enum" in first else [first["const"]]
    kept = [v for v in values if ctx.valid(v, [p.schema for p in parts])]
    alts = list(dict.fromkeys(_literal_value(v, ctx.ws) for v in kept))
    return alternation(alts) if alts else None


def _literal_value(v, ws: str) -> str:
    if isinstance(v, dict):
        items = [json_string(k) + f"{ws}:{ws}" + _literal_value(x, ws) for k, x in v.items()]
        return rf"\{{{ws}" + f"{ws},{ws}".join(items) + rf"{ws}\}}"
    if isinstance(v, list):
        return rf"\[{ws}" + f"{ws},{ws}".join(_literal_value(x, ws) for x in v) + rf"{ws}\]"
    return json_string(v) if isinstance(v, str) else literal(json.dumps(v))


def _types(parts) -> list[str]:
    allowed = set(TYPES)
    for part in parts:
        t = part.schema.get("type")
        if t is None:
            continue
        ts = {t} if isinstance(t, str) else set(t)
        if not all(isinstance(x, str) for x in ts):
            raise UnsupportedSchemaError("type", part.ptr, "schemas inside 'type' (draft 3).")
        if "any" not in ts:
            allowed &= ts | ({"integer"} if "number" in ts else set())
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
        if bound is not None and (bound[0] != int(bound[0]) or abs(bound[0]) > MAX_NUMBER_BOUND):
            raise UnsupportedSchemaError(bound[3], bound[2], "a bound on a non-integer number "
                                         "must be a whole number within ±1e9; use type: integer "
                                         "or round the bound.")
    return number_range(None if lower is None else int(lower[0]), bool(lower and lower[1]),
                        None if upper is None else int(upper[0]), bool(upper and upper[1]))


# --- arrays ---------------------------------------------------------------------------------

def _array(parts, ctx) -> str | None:
    lo = max([v for v, _ in _get(parts, "minItems")], default=0)
    his = [v for v, _ in _get(parts, "maxItems")]
    hi = min(his) if his else None
    for unique, ptr in _get(parts, "uniqueItems"):
        if unique and (hi is None or hi > 1):
            raise UnsupportedSchemaError("uniqueItems", ptr, "an automaton cannot check that "
                                         "items differ; drop it or set maxItems: 1.")
    layouts = [_item_layout(p) for p in parts]
    n_prefix = max([len(prefix) for prefix, _ in layouts], default=0)
    if hi is not None:
        n_prefix = min(n_prefix, hi)

    def element(i: int | None) -> str | None:  # None: the items after the prefix
        subs = [_sub(p, *(prefix[i] if i is not None and i < len(prefix) else rest))
                for p, (prefix, rest) in zip(parts, layouts)]
        return _node(subs, ctx)

    elements = [element(i) for i in range(n_prefix)]
    rest = element(None) if hi is None or hi > n_prefix else None
    body = _items_from(0, elements, rest, lo, None if hi is None else hi - n_prefix, ctx.ws)
    return None if body is None else rf"\[{ctx.ws}{body}{ctx.ws}\]"


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
    _check_dependencies(parts, names, required)
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
    for m, ptr in _get(parts, "minProperties"):
        if m > n_req and (extra is not None or m <= len(entries)):
            raise UnsupportedSchemaError("minProperties", ptr, "more properties than are "
                                         "required: list them in 'required' instead.")
        if m > len(entries) and extra is None:
            return None
    max_extra = None
    for m, ptr in _get(parts, "maxProperties"):
        if n_req > m:
            return None
        if len(entries) > m or (extra is not None and entries):
            raise UnsupportedSchemaError("maxProperties", ptr, "fewer properties than are "
                                         "declared: remove the optional ones instead.")
        max_extra = m if max_extra is None else min(max_extra, m)
    return rf"\{{{ctx.ws}{_members(entries, extra, max_extra, ctx.ws)}{ctx.ws}\}}"


def _required(parts) -> set:
    out = set()
    for names, ptr in _get(parts, "required"):
        if not isinstance(names, list):
            raise UnsupportedSchemaError("required", ptr, "a boolean 'required' (draft 3).")
        out |= set(names)
    return out


def _check_dependencies(parts, names, required) -> None:
    for p in parts:
        deps = dict(p.schema.get("dependentRequired", {}))
        for trigger, dep in p.schema.get("dependencies", {}).items():
            if not isinstance(dep, list) and trigger in names:
                raise UnsupportedSchemaError("dependencies", p.ptr, "schema dependencies of an "
                                             f"emittable property ({trigger!r}).")
            deps[trigger] = dep if isinstance(dep, list) else []
        for trigger, dep in deps.items():
            if trigger in required:
                required |= set(dep)  # exact: the trigger is always present
            elif trigger in names and not set(dep) <= required:
                key = "dependentRequired" if "dependentRequired" in p.schema else "dependencies"
                raise UnsupportedSchemaError(key, p.ptr, f"{trigger!r} is optional and requires "
                                             f"{sorted(set(dep) - required)}; make them required.")


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
    part declares properties (a key regex cannot exclude the declared names)."""
    if any(p.schema.get("properties") or p.schema.get("patternProperties")
           or "unevaluatedProperties" in p.schema for p in parts):
        return None
    values = [_sub(p, p.schema["additionalProperties"], "additionalProperties")
              for p in parts if "additionalProperties" in p.schema]
    keys = [_sub(p, p.schema["propertyNames"], "propertyNames")
            for p in parts if "propertyNames" in p.schema]
    value = _node(values, ctx)
    key = _node(keys + [({"type": "string"}, "", ())], ctx)
    return None if value is None or key is None else f"{key}{ctx.ws}:{ctx.ws}{value}"


def _members(entries, extra, max_extra, ws) -> str:
    """Members in declared order; optional ones may be absent; commas only between members."""
    sep = f"{ws},{ws}"
    if extra is not None:  # entries are all required here
        head = sep.join(kv for kv, _ in entries)
        if not head:
            more = repeat(sep + extra, 0, None if max_extra is None else max_extra - 1)
            return f"(?:{extra}{more})?" if max_extra != 0 else ""
        return head + f"(?:{sep}{extra})*"
    first_req = next((i for i, (_, req) in enumerate(entries) if req), None)
    if first_req is not None:  # linear: optional members before the first required one
        before = "".join(f"(?:{kv}{sep})?" for kv, _ in entries[:first_req])
        after = "".join(f"(?:{sep}{kv})" + ("" if req else "?")
                        for kv, req in entries[first_req + 1:])
        return before + entries[first_req][0] + after
    alts = [kv + "".join(f"(?:{sep}{kv2})?" for kv2, _ in entries[i + 1:])
            for i, (kv, _) in enumerate(entries)]  # which member comes first
    return f"(?:{'|'.join(alts)})?" if alts else ""


_EMITTERS = {"null": lambda parts, ctx: "null", "boolean": lambda parts, ctx: "(?:true|false)",
             "object": _object, "array": _array, "string": _string, "number": _number,
             "integer": _integer}
