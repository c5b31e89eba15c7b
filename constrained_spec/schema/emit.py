"""The regex of one JSON type under a node's parts: null, boolean, string, number, integer,
array, object, and free-form values. Subschemas (items, property values) go back through
``rewrite.node``."""

from __future__ import annotations

import json
import math
import re

from ..errors import UnsupportedSchemaError
from . import limits, rewrite
from .context import ADDED_VALIDATOR, TYPE_KEYWORDS, Part, subschema, values_of
from .regex import (
    FORMATS,
    KNOWN_FORMATS,
    STRING_CHAR,
    PatternError,
    alternation,
    format_body,
    integer_range,
    json_string,
    json_string_except,
    literal,
    number_range,
    pattern_body,
    repeat,
)

NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"


_ANY_CACHE: dict[tuple[int, str], str] = {}


def any_value(depth: int, ws: str) -> str:
    if (depth, ws) not in _ANY_CACHE:
        string = f'"{STRING_CHAR}*"'
        alts = [string, NUMBER, "true", "false", "null"]
        if depth > 0:
            v = any_value(depth - 1, ws)
            alts.append(rf"\[{ws}(?:{v}(?:{ws},{ws}{v})*)?{ws}\]")
            kv = f"{string}{ws}:{ws}{v}"
            alts.append(rf"\{{{ws}(?:{kv}(?:{ws},{ws}{kv})*)?{ws}\}}")
        _ANY_CACHE[(depth, ws)] = alternation(alts)
    return _ANY_CACHE[(depth, ws)]


def _string(parts, ctx) -> str | None:
    excluded = {v for p in parts if p.added and "not" in p.schema for v in p.schema["not"]["enum"]}
    if excluded:  # added on plain strings only (see rewrite._exclude); a later bound cannot join it
        plain = not any(k in p.schema for p in parts for k in TYPE_KEYWORDS["string"])
        return json_string_except(excluded) if plain else None
    lo = max([v for v, _ in values_of(parts, "minLength")], default=0)
    his = [v for v, _ in values_of(parts, "maxLength")]
    hi = min(his) if his else None
    if hi is not None and lo > hi:
        return None
    patterns = values_of(parts, "pattern")
    formats = [(f, p) for f, p in values_of(parts, "format") if f in KNOWN_FORMATS]
    for f, ptr in formats:
        if f not in FORMATS:
            raise UnsupportedSchemaError(
                f"format: {f}", ptr, f"supported formats: {', '.join(sorted(FORMATS))}."
            )
    if len({p for p, _ in patterns}) + len({f for f, _ in formats}) > 1:
        ptr = (patterns or formats)[-1][1]
        raise UnsupportedSchemaError(
            "pattern",
            ptr,
            "several patterns/formats on one string "
            "cannot be intersected; merge them into one pattern.",
        )
    try:
        if patterns:
            return '"' + pattern_body(patterns[0][0], lo, hi) + '"'
        if formats:
            return '"' + format_body(formats[0][0], lo, hi) + '"'
    except PatternError as e:
        key, ptr = ("pattern", patterns[0][1]) if patterns else ("format", formats[0][1])
        raise UnsupportedSchemaError(key, ptr, f"{e}.") from None
    return '"' + (repeat(STRING_CHAR, lo, hi) if (lo, hi) != (0, None) else STRING_CHAR + "*") + '"'


def bounds(parts) -> tuple:
    """Tightest (value, exclusive, pointer, keyword) lower and upper bounds, or None."""
    lower = upper = None
    for p in parts:
        s = p.schema
        for key, ex_key, is_lower in (
            ("minimum", "exclusiveMinimum", True),
            ("maximum", "exclusiveMaximum", False),
        ):
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
    for m, ptr in values_of(parts, "multipleOf"):
        if m != 1:
            raise UnsupportedSchemaError("multipleOf", ptr, "only multipleOf: 1 is supported.")
    lower, upper = bounds(parts)
    lo = None if lower is None else (math.floor(lower[0]) + 1 if lower[1] else math.ceil(lower[0]))
    hi = None if upper is None else (math.ceil(upper[0]) - 1 if upper[1] else math.floor(upper[0]))
    return integer_range(lo, hi)


def _number(parts, ctx) -> str | None:
    if values_of(parts, "multipleOf"):
        return _integer(parts, ctx)  # multipleOf 1: the integers (refused otherwise)
    lower, upper = bounds(parts)
    if lower is None and upper is None:
        return NUMBER
    for bound in (lower, upper):
        if bound is not None and abs(bound[0]) > limits.MAX_NUMBER_BOUND:
            raise UnsupportedSchemaError(
                bound[3],
                bound[2],
                "a bound on a non-integer number "
                "must lie within ±1e9 (beyond, float rounding could let "
                "in values past it); use type: integer.",
            )
    return number_range(
        None if lower is None else lower[0],
        bool(lower and lower[1]),
        None if upper is None else upper[0],
        bool(upper and upper[1]),
    )


def _array(parts, ctx) -> str | None:
    lo = max([v for v, _ in values_of(parts, "minItems")], default=0)
    his = [v for v, _ in values_of(parts, "maxItems")]
    hi = min(his) if his else None
    layouts = [_item_layout(p) for p in parts]
    for unique, ptr in values_of(parts, "uniqueItems"):
        if unique and (hi is None or hi > 1):
            return _distinct_items(parts, layouts, lo, hi, ptr, ctx)
    n_prefix = max([len(prefix) for prefix, _ in layouts], default=0)
    if hi is not None:
        n_prefix = min(n_prefix, hi)

    def element(i: int | None) -> str | None:  # None: the items after the prefix
        picked = [
            prefix[i] if i is not None and i < len(prefix) else rest for prefix, rest in layouts
        ]
        subs = [subschema(p, schema, *path) for p, (schema, path) in zip(parts, picked)]
        return rewrite.node(subs, ctx)

    elements = [element(i) for i in range(n_prefix)]
    rest = element(None) if hi is None or hi > n_prefix else None
    body = _items_from(0, elements, rest, lo, None if hi is None else hi - n_prefix, ctx.ws)
    return None if body is None else rf"\[{ctx.ws}{body}{ctx.ws}\]"


def _distinct_items(parts, layouts, lo, hi, ptr, ctx) -> str | None:
    """uniqueItems over items from a finite set of values: each value at most once, in the
    enum's order (fewer arrays than the schema allows, all valid). Refused otherwise."""
    subs = [subschema(p, schema, *path) for p, (prefix, (schema, path)) in zip(parts, layouts)]
    flat = (
        []
        if any(prefix for prefix, _ in layouts)
        else [
            q
            for schema, sptr, refs in subs
            for q in rewrite.flatten(schema, sptr, ctx, refs, 0) or []
        ]
    )
    if not any("enum" in q.schema or "const" in q.schema for q in flat):
        raise UnsupportedSchemaError(
            "uniqueItems",
            ptr,
            "an automaton cannot check that items "
            "differ unless they come from an enum; drop it or set "
            "maxItems: 1.",
        )
    distinct = []
    for v in rewrite.candidate_values(flat, ctx):
        if all(
            ADDED_VALIDATOR.evolve(schema={"uniqueItems": True}).is_valid([u, v]) for u in distinct
        ):
            distinct.append(v)
    if len(distinct) < lo:
        return None
    entries = [(literal_value(v, ctx.ws), False) for v in distinct]
    return rf"\[{ctx.ws}{_members(entries, None, lo, hi, ctx.ws)}{ctx.ws}\]"


def _item_layout(part: Part) -> tuple[list, tuple]:
    """(prefix item (schema, path) pairs, (schema, path) for the items after the prefix)."""
    s = part.schema
    if "prefixItems" in s:
        return (
            [(x, ("prefixItems", i)) for i, x in enumerate(s["prefixItems"])],
            (s.get("items", True), ("items",)),
        )
    if isinstance(s.get("items"), list):
        return (
            [(x, ("items", i)) for i, x in enumerate(s["items"])],
            (s.get("additionalItems", True), ("additionalItems",)),
        )
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
        more = repeat(
            f"{ws},{ws}{rest}", max(need - 1, 0), None if rest_hi is None else rest_hi - 1
        )
        return f"{rest}{more}" if need else f"(?:{rest}{more})?"
    nxt = _items_from(i + 1, elements, rest, lo, rest_hi, ws)
    present = None if elements[i] is None or nxt is None else sep + elements[i] + nxt
    if i >= lo:  # the array may end before item i
        return f"(?:{present})?" if present else ""
    return present


def _object(parts, ctx) -> str | None:
    required = _required(parts)
    declared = {n for p in parts for n in p.schema.get("properties", {})}
    names = list(
        dict.fromkeys([n for p in parts for n in p.schema.get("properties", {})] + sorted(required))
    )
    entries = []
    for name in names:
        value = (
            rewrite.node(_property_subs(name, parts, declared), ctx)
            if _name_allowed(name, parts, ctx)
            else None
        )
        if value is None and name in required:
            return None
        if value is not None:
            entries.append((f"{json_string(name)}{ctx.ws}:{ctx.ws}{value}", name in required))
    extra = _extra_member(parts, ctx)
    n_req = sum(r for _, r in entries)
    least = max([m for m, _ in values_of(parts, "minProperties")], default=0)
    most = min([m for m, _ in values_of(parts, "maxProperties")], default=None)
    if (most is not None and max(n_req, least) > most) or (extra is None and least > len(entries)):
        return None
    if extra is not None and least > max(n_req, 1 if not entries else 0):
        raise UnsupportedSchemaError(
            "minProperties",
            values_of(parts, "minProperties")[0][1],
            "more properties than are required, on an object with "
            "undeclared properties (a repeated key would count once); "
            "list them in 'required' instead.",
        )
    return rf"\{{{ctx.ws}{_members(entries, extra, least, most, ctx.ws)}{ctx.ws}\}}"


def _required(parts) -> set:
    out = set()
    for names, ptr in values_of(parts, "required"):
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
            subs.append(subschema(p, props[name], "properties", name))
        matched = [pat for pat in pattern_props if _search(pat, name, p.ptr)]
        subs += [subschema(p, pattern_props[pat], "patternProperties", pat) for pat in matched]
        if name not in props and not matched and "additionalProperties" in s:
            subs.append(subschema(p, s["additionalProperties"], "additionalProperties"))
        elif name not in props and not matched and "unevaluatedProperties" in s:
            if not p.head:
                raise UnsupportedSchemaError(
                    "unevaluatedProperties",
                    p.ptr,
                    "inside allOf/$ref targets; move it to the top of the schema.",
                )
            group_declared = {
                n for q in parts if q.group == p.group for n in q.schema.get("properties", {})
            }
            if name not in group_declared:
                subs.append(subschema(p, s["unevaluatedProperties"], "unevaluatedProperties"))
    return subs


def _search(pattern: str, name: str, ptr: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        raise UnsupportedSchemaError(
            "patternProperties", ptr, f"{pattern!r} is not a valid regular expression."
        ) from None


def _name_allowed(name: str, parts, ctx) -> bool:
    return ctx.valid(name, [s for s, _ in values_of(parts, "propertyNames")])


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
    values = [
        subschema(p, p.schema["additionalProperties"], "additionalProperties")
        for p in parts
        if "additionalProperties" in p.schema and not (patterned and p is patterned[0][0])
    ]
    if patterned:
        owner, pat = patterned[0]
        values.append(
            subschema(owner, owner.schema["patternProperties"][pat], "patternProperties", pat)
        )
        try:
            key = f'"{pattern_body(pat)}"'
        except PatternError:
            return None
    else:
        keys = [
            subschema(p, p.schema["propertyNames"], "propertyNames")
            for p in parts
            if "propertyNames" in p.schema
        ]
        key = rewrite.node(keys + [({"type": "string"}, "", ())], ctx)
    value = rewrite.node(values, ctx)
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
    if (
        len(_sequence(kept, sep)) * len(optional) > limits.MAX_REGEX_CHARS // 20
    ):  # big members: linear
        return _sequence([(kv, req or i == optional[0]) for i, (kv, req) in enumerate(kept)], sep)
    return alternation(
        [
            _sequence(
                [(kv, req or i == j) for i, (kv, req) in enumerate(kept) if req or i <= j], sep
            )
            for j in optional
        ]
    )


def _sequence(entries, sep) -> str:
    """Members in order, the optional ones possibly absent, commas only between members."""
    first_req = next((i for i, (_, req) in enumerate(entries) if req), None)
    if first_req is not None:  # linear: optional members before the first required one
        before = "".join(f"(?:{kv}{sep})?" for kv, _ in entries[:first_req])
        after = "".join(
            f"(?:{sep}{kv})" + ("" if req else "?") for kv, req in entries[first_req + 1 :]
        )
        return before + entries[first_req][0] + after
    # which member comes last: alternatives that differ only at their end determinize into
    # one chain of automaton states ("which comes first" needs a chain per member), but repeat
    # the early members; where those are big, the shorter text wins
    last = "|".join(
        "".join(f"(?:{kv2}{sep})?" for kv2, _ in entries[:i]) + kv
        for i, (kv, _) in enumerate(entries)
    )
    if len(last) > limits.MAX_REGEX_CHARS // 20:
        first = "|".join(
            kv + "".join(f"(?:{sep}{kv2})?" for kv2, _ in entries[i + 1 :])
            for i, (kv, _) in enumerate(entries)
        )
        last = min(last, first, key=len)
    return f"(?:{last})?" if entries else ""


def literal_value(v, ws: str) -> str:
    if isinstance(v, dict):
        items = [json_string(k) + f"{ws}:{ws}" + literal_value(x, ws) for k, x in v.items()]
        return rf"\{{{ws}" + f"{ws},{ws}".join(items) + rf"{ws}\}}"
    if isinstance(v, list):
        return rf"\[{ws}" + f"{ws},{ws}".join(literal_value(x, ws) for x in v) + rf"{ws}\]"
    return json_string(v) if isinstance(v, str) else literal(json.dumps(v))


EMITTERS = {
    "null": lambda parts, ctx: "null",
    "boolean": lambda parts, ctx: "(?:true|false)",
    "object": _object,
    "array": _array,
    "string": _string,
    "number": _number,
    "integer": _integer,
}
