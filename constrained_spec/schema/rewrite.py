"""Rewriting a schema node into parts the emitters can read: ``allOf`` and ``$ref`` flattened,
``anyOf``/``oneOf``, dependencies and ``if``/``then``/``else`` distributed into unions, ``not``
turned into conjuncts under which its schema fails, ``enum``/``const`` checked by jsonschema."""

from __future__ import annotations

import json
from typing import NamedTuple

from ..errors import ConstraintError, SchemaTooComplex, UnsupportedSchemaError
from . import emit, limits
from .context import (
    ADDED_VALIDATOR,
    DEPENDENCIES,
    HANDLED,
    TYPE_KEYWORDS,
    TYPES,
    VALIDATION,
    Context,
    Part,
    escape_pointer,
    extra_part,
    resolve,
    rest_of,
    without,
)
from .regex import alternation


def node(subs: list, ctx: Context) -> str | None:
    """Regex of the JSON texts valid under all of ``subs`` ((schema, ptr, refs) triples);
    None if we can emit none."""
    parts: list[Part] = []
    for schema, ptr, refs in subs:
        flat = flatten(schema, ptr, ctx, refs, ctx.new_group())
        if flat is None:
            return None
        parts += flat
    if not parts:
        ctx.nested |= ctx.any_depth > 0
    regex = _from_parts(parts, ctx) if parts else emit.any_value(ctx.any_depth, ctx.ws)
    if regex is not None and len(regex) > limits.MAX_REGEX_CHARS:
        raise SchemaTooComplex(
            f"the regex for {subs[0][1] or '/'} exceeds {limits.MAX_REGEX_CHARS:,} "
            "characters: simplify the schema (fewer optional properties, "
            "shallower nesting, smaller enums)."
        )
    return regex


def flatten(schema, ptr, ctx, refs, group, head=True) -> list[Part] | None:
    """The conjunction ``schema`` means, as parts; None if it is (or became) false."""
    if schema is False:
        return None
    if schema is True:
        return []
    if not isinstance(schema, dict):
        raise ConstraintError(f"not a schema at {ptr or '/'}: {schema!r}")
    parts = [
        Part(
            {k: v for k, v in schema.items() if k not in ("allOf", "$ref")}, ptr, refs, group, head
        )
    ]
    if "$ref" in schema:
        ref = schema["$ref"]
        if refs.count(ref) >= ctx.ref_depth:
            ctx.truncated = True
            return None
        ctx.nested |= ref in refs
        target, target_ptr = resolve(ref, ptr, ctx)
        sub = flatten(target, target_ptr, ctx, refs + (ref,), group, False)
        if sub is None:
            return None
        parts += sub
    for i, member in enumerate(schema.get("allOf", [])):
        sub = flatten(member, f"{ptr}/allOf/{i}", ctx, refs, group, False)
        if sub is None:
            return None
        parts += sub
    return parts


def _from_parts(parts: list[Part], ctx: Context) -> str | None:
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
    alts = [r for r in (emit.EMITTERS[t](parts, ctx) for t in _types(parts)) if r is not None]
    if not alts:  # e.g. a recursion cut short: the types inference left out may still fit
        alts = [
            r
            for r in (
                emit.EMITTERS[t](parts, ctx)
                for t in _types(parts, infer=False)
                if t not in _types(parts)
            )
            if r is not None
        ]
    return alternation(alts) if alts else None


def _distribute(parts, i, key, ctx) -> str | None:
    """anyOf: the union of the branches. oneOf: the union over branches of "this branch and
    none of the others", each other branch excluded as a ``not`` would be (refused where no
    exclusion can be expressed)."""
    part = parts[i]
    branches = part.schema[key]
    if len(branches) > limits.MAX_BRANCHES:
        raise SchemaTooComplex(f"{key} at {part.ptr or '/'} has {len(branches)} branches.")
    rest = rest_of(parts, i, key)

    def branch_parts(j: int, branch) -> list[Part] | None:
        sub = flatten(branch, f"{part.ptr}/{key}/{j}", ctx, part.refs, part.group, False)
        mine = None if sub is None else rest + sub
        for m, other in enumerate(branches if key == "oneOf" else []):
            if m != j and mine is not None:
                mine = _exclude(
                    mine, (other, f"{part.ptr}/oneOf/{m}", part.refs), ctx, part.ptr, "oneOf"
                )
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
    rest = rest_of(parts, i, key)
    if deps:
        rest[i].schema[key] = deps
    absent = rest + [extra_part(part, {"properties": {trigger: False}})]
    present = rest + [extra_part(part, {"required": [trigger]})]
    if isinstance(need, list):
        present.append(extra_part(part, {"required": need}))
    else:
        sub = flatten(
            need, f"{part.ptr}/{key}/{escape_pointer(trigger)}", ctx, part.refs, part.group, False
        )
        present = None if sub is None else present + sub
    return _union([absent, present], ctx)


def _split_conditional(parts, i, ctx) -> str | None:
    """if/then/else, exactly: (if and then) or (else, with the ``if`` failing as a ``not``)."""
    part = parts[i]
    s = part.schema
    rest = rest_of(parts, i, "if", "then", "else")
    cond, then, other = (
        flatten(s.get(key, True), f"{part.ptr}/{key}", ctx, part.refs, part.group, False)
        for key in ("if", "then", "else")
    )
    branches = [
        None if cond is None or then is None else rest + cond + then,
        None
        if other is None
        else _exclude(
            rest + other, (s["if"], f"{part.ptr}/if", part.refs), ctx, f"{part.ptr}/if", "if"
        ),
    ]
    return _union(branches, ctx)


def _apply_nots(parts, ctx) -> list[Part] | None:
    """Replace each ``not`` by conjuncts that make the negated schema fail (None: nothing is
    left). Those conjuncts may be stricter than the ``not`` (sound), never looser."""
    positive = [p if p.added else without(p, "not") for p in parts]
    for p in parts:
        if "not" in p.schema and not p.added and positive is not None:
            positive = _exclude(
                positive, (p.schema["not"], p.ptr + "/not", p.refs), ctx, p.ptr + "/not", "not"
            )
    return positive


class _Facts(NamedTuple):
    """What a conjunction of parts says through its simple keywords (combinators ignored, so
    every fact is implied by the parts)."""

    types: set  # JSON types it allows (integer listed with number)
    required: set
    forbidden: set  # property names it rejects outright (false subschema, closed object)
    closed: list  # declared-name sets of parts with additionalProperties: false
    values: dict  # property -> canonical JSON of the const/enum values it allows


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
    flat = flatten(schema, nptr, ctx, refs, ctx.new_group(), False)
    if flat is None:
        return parts  # not false: no constraint
    neg = _Negation.of(parts, flat)
    # Both shortcuts below hold for the types emitted *now*; a later double negation may add
    # parts that widen them (an enum brings its own types), so they pin those types.
    pinned = parts + [extra_part(anchor, {"type": sorted(neg.emitted)})]
    if neg.outside == neg.emitted:
        return pinned  # it rejects every type we emit
    if _holds_for_all(neg):
        return None
    if _contradicts(neg):
        return pinned
    inner = next((q for q in flat if "not" in q.schema), None)
    if inner is not None:  # not (X and not Y): require Y
        sub = flatten(inner.schema["not"], inner.ptr + "/not", ctx, inner.refs, anchor.group, False)
        return None if sub is None else parts + sub
    conjunct = _by_type(neg) or _by_property(neg) or _by_string_value(neg) or _by_bound(neg)
    if conjunct is not None:
        return parts + [extra_part(anchor, conjunct)]
    branches = [
        (b, f"{q.ptr}/anyOf/{j}", q.refs)
        for q in flat
        for j, b in enumerate(q.schema.get("anyOf", []))
    ]
    if branches:  # not (X and anyOf B): every branch of B fails
        for branch in branches:
            parts = _exclude(parts, branch, ctx, ptr, keyword)
            if parts is None:
                return None
        return parts
    hint = (
        "its branches may overlap, and no type, property, const value or bound tells them "
        "apart; use anyOf if they are exclusive, or give each branch a distinct type or "
        "const discriminator property."
        if keyword == "oneOf"
        else "the automaton can exclude JSON types, properties, const/enum values and bounds, "
        "not this schema; rewrite the 'not' in those terms."
    )
    raise UnsupportedSchemaError(keyword, ptr, hint)


class _Negation(NamedTuple):
    """A negated schema (flattened) against the parts it is excluded from."""

    parts: list  # the positive parts
    flat: list  # the negated schema's parts
    keys: set  # the validation keywords the negated schema uses
    emitted: set  # the JSON types the positive parts emit
    outside: set  # the emitted types the negated schema rejects
    pos: _Facts
    neg: _Facts

    @classmethod
    def of(cls, parts, flat) -> _Negation:
        keys = {k for q in flat for k in q.schema if k in VALIDATION}
        emitted = set(_types(parts))
        pos, neg = _facts(parts), _facts(flat)
        outside = {
            t
            for t in emitted
            if t not in neg.types and not (t == "number" and "integer" in neg.types)
        }
        return cls(parts, flat, keys, emitted, outside, pos, neg)

    def conjunct(self, kind: str, schema: dict) -> dict:
        """``schema`` for the emitted types of ``kind``; the types the negation rejects stay."""
        keep = sorted(self.outside | {t for t in self.emitted if _kind(t) == kind})
        return {"type": keep, **schema}


def _contradicts(n: _Negation) -> bool:
    """The parts and the negated schema disagree on a required property: no object we would
    emit satisfies the negated schema."""
    pos, neg = n.pos, n.neg
    return n.emitted == {"object"} and (
        any(_rejects(neg, k) for k in pos.required)
        or any(_rejects(pos, k) for k in neg.required)
        or any(
            k in neg.values and not (pos.values[k] & neg.values[k])
            for k in pos.required & set(pos.values)
        )
    )


def _holds_for_all(n: _Negation) -> bool:
    """The negated schema accepts every instance we would emit: it only constrains types we do
    not emit, or it only requires properties every object we emit has."""
    other_kinds = [
        TYPE_KEYWORDS.get(_kind(t), set())
        for t in TYPES
        if t not in n.emitted and _kind(t) not in {_kind(e) for e in n.emitted}
    ]
    if n.keys <= set().union(*other_kinds or [set()]):
        return True
    return (
        n.emitted == {"object"}
        and n.keys <= {"required", "type"}
        and n.neg.required <= n.pos.required
        and "object" in n.neg.types
    )


def _by_type(n: _Negation) -> dict | None:
    """A JSON type the negated schema rejects: emit only such types."""
    return {"type": sorted(n.outside)} if n.outside else None


def _by_property(n: _Negation) -> dict | None:
    """A property the negated schema requires (left out), forbids (required), or limits to
    const/enum values (required, with another value)."""
    if "object" not in n.emitted:
        return None
    pos, neg = n.pos, n.neg
    declared = {k for q in n.parts for k in q.schema.get("properties", {})}
    for k in sorted(neg.required - pos.required):
        return n.conjunct("object", {"properties": {k: False}})
    for k in sorted(declared - pos.required):
        if _rejects(neg, k) and not _rejects(pos, k):
            return n.conjunct("object", {"required": [k]})
    for k in sorted(set(neg.values) & set(pos.values)):
        if pos.values[k] - neg.values[k]:
            values = [json.loads(v) for v in sorted(neg.values[k])]
            return n.conjunct(
                "object", {"required": [k], "properties": {k: {"not": {"enum": values}}}}
            )
    return None


def _by_string_value(n: _Negation) -> dict | None:
    """A plain string (no string keywords) outside the negated schema's const/enum values."""
    values = [
        q.schema["enum"] if "enum" in q.schema else [q.schema["const"]]
        for q in n.flat
        if "enum" in q.schema or "const" in q.schema
    ]
    plain = not any(k in q.schema for q in n.parts for k in TYPE_KEYWORDS["string"])
    if values and n.emitted - n.outside == {"string"} and plain:
        return n.conjunct(
            "string", {"not": {"enum": sorted(v for v in values[0] if isinstance(v, str))}}
        )
    return None


def _by_bound(n: _Negation) -> dict | None:
    """The complement of a numeric, length or item-count bound of the negated schema."""
    complement = _complement_bound(n.flat, n.emitted)
    return n.conjunct(*complement) if complement else None


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
        lower, upper = emit.bounds(flat)
        if lower is not None:
            return "number", (
                {"exclusiveMaximum": lower[0]} if not lower[1] else {"maximum": lower[0]}
            )
        if upper is not None:
            return "number", (
                {"exclusiveMinimum": upper[0]} if not upper[1] else {"minimum": upper[0]}
            )
    for key, kind, complement in _BOUND_COMPLEMENTS:
        for q in flat:
            if kind in kinds and isinstance(q.schema.get(key), int) and complement(q.schema[key]):
                return kind, dict([complement(q.schema[key])])
    return None


def _json_type(v) -> str:
    return {
        bool: "boolean",
        int: "number",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
        type(None): "null",
    }[type(v)]


def _refuse_unhandled(parts, ctx) -> None:
    for part in parts:
        for key, value in part.schema.items():
            if key in VALIDATION and key not in HANDLED:
                raise UnsupportedSchemaError(key, part.ptr)
            if (
                key in ("$id", "id")
                and part.ptr
                and isinstance(value, str)
                and ctx.has_refs
                and not value.startswith("#")
                and (key == "$id" or ctx.draft4)
            ):
                raise UnsupportedSchemaError(
                    key,
                    part.ptr,
                    "a nested base URI changes how "
                    "$ref resolves; remove it or inline the references.",
                )


def _candidates(parts, ctx) -> str | None:
    alts = list(dict.fromkeys(emit.literal_value(v, ctx.ws) for v in candidate_values(parts, ctx)))
    return alternation(alts) if alts else None


def candidate_values(parts, ctx) -> list:
    """The first const/enum's values that every part accepts."""
    first = next(p.schema for p in parts if "enum" in p.schema or "const" in p.schema)
    values = first["enum"] if "enum" in first else [first["const"]]
    # each value is in `first`'s enum by construction: checking it there again would scan the
    # whole enum per value (quadratic: a 100k-value enum took 6 minutes)
    source = "enum" if "enum" in first else "const"
    rest = {k: v for k, v in first.items() if k != source}
    schemas = [(rest if p.schema is first else p.schema, p.added) for p in parts]
    return [
        v
        for v in values
        if ctx.valid(v, [s for s, added in schemas if not added])
        and all(ADDED_VALIDATOR.evolve(schema=s).is_valid(v) for s, added in schemas if added)
    ]


def _types(parts, infer: bool = True) -> list[str]:
    """The JSON types we emit: those ``type`` allows or, where no part says, those the parts'
    keywords are about (a schema with only ``properties`` is generated as an object; its other
    instances, like ``null``, are valid but never generated)."""
    for part in parts:
        t = part.schema.get("type")
        if t is not None and not all(
            isinstance(x, str) for x in ([t] if isinstance(t, str) else t)
        ):
            raise UnsupportedSchemaError("type", part.ptr, "schemas inside 'type' (draft 3).")
    allowed = _facts(parts).types
    if infer and not any("type" in p.schema for p in parts):
        hinted = {
            t for t, keys in TYPE_KEYWORDS.items() if any(keys & p.schema.keys() for p in parts)
        }
        allowed &= hinted | ({"integer"} if "number" in hinted else set()) or allowed
    if "number" in allowed:
        allowed.discard("integer")  # the number regex covers integers
    return [t for t in TYPES if t in allowed]
