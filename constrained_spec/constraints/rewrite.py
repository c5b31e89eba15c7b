"""A JSON Schema said in the terms llguidance implements, accepting nothing jsonschema rejects
(engine.schema_grammar compiles the result)."""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, ROUND_FLOOR, Context, Decimal
from itertools import combinations
from math import comb

from ..errors import UnsupportedSchemaError
from .patterns import FORMATS, KNOWN_FORMATS, rust_pattern
from .schemas import jsonschema_module

# Where llguidance accepts texts that jsonschema (with its format checker) rejects, found by
# benchmarks/coverage.py and a fuzz of every format (docs/schemas.md): a leap second
# "23:59:60" and some offsets in date-time / time, a February 29 of any year in date (found by
# benchmarks/coverage.py's random walks: "9382-02-29"); multipleOf with a fraction, which llguidance
# checks in exact decimals and jsonschema in floats ("9356.55" is no multiple of 0.01 there).
# Formats llguidance checks soundly stay its own; the others in patterns.FORMATS become that
# pattern; format names jsonschema does not check are annotations (dropped); the rest llguidance
# implements or refuses by name.
NATIVE_FORMATS = {"duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"}
VALUES = {"enum", "const", "default", "examples"}  # JSON values, not schemas: never rewritten


# Keywords whose values map names (of properties, definitions) to schemas: the names are no
# keywords, whatever they spell.
NAME_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
DEPENDENCIES = ("dependencies", "dependentRequired", "dependentSchemas")


def for_llguidance(schema, open_objects: bool = False):
    """The schema as llguidance gets it: keywords it refuses said exactly in ones it implements
    (``_in_llguidance_terms``), narrowed where it reads a keyword more loosely than jsonschema
    (``_sound_for_llguidance``), then objects with declared properties closed to undeclared
    ones where that only narrows, unless ``open_objects`` (``_close_objects``); last, the
    property counts of closed objects said by which properties are present
    (``_property_counts``)."""
    schema = _sound_for_llguidance(_in_llguidance_terms(schema))
    schema = _close_objects(schema) if not open_objects and _closable(schema) else schema
    return _rewrite(schema, _property_counts)


def pointer_of(schema, keyword: str, sent=None) -> str:
    """The JSON pointer of the first subschema of ``schema`` using ``keyword`` ("format: x"
    for a format), "" if none: the first in ``sent`` (what llguidance got), where ``schema``
    has it at that place too, else the first in ``schema``."""
    name, _, value = keyword.partition(": ")
    has = lambda node: isinstance(node, dict) and name in node and value in ("", node[name])  # noqa: E731
    for tree in (sent, schema) if sent is not None else (schema,):
        for pointer in _pointers(tree, has):
            if has(_pointed(schema, "#" + pointer)):
                return pointer
    return ""


def _pointers(node, has, pointer: str = ""):
    """The JSON pointers of the subschemas ``has`` holds for, in document order."""
    if has(node):
        yield pointer
    items = (
        enumerate(node)
        if isinstance(node, list)
        else node.items()
        if isinstance(node, dict)
        else ()
    )
    for k, v in items:
        if k in VALUES and isinstance(node, dict):
            continue
        here = f"{pointer}/{_escape(str(k))}"
        if k in (*NAME_MAPS, *DEPENDENCIES) and isinstance(v, dict):
            for n, sub in v.items():
                yield from _pointers(sub, has, f"{here}/{_escape(n)}")
        else:
            yield from _pointers(v, has, here)


def _rewrite(node, change, pointer: str = ""):
    """``change(node, copy, pointer)`` applied bottom up to every subschema, where ``copy`` is
    the node with its subschemas already changed and ``pointer`` its JSON pointer; JSON values
    and property names are left alone."""
    if isinstance(node, list):
        return [_rewrite(v, change, f"{pointer}/{i}") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        here = f"{pointer}/{_escape(str(k))}"
        if k in VALUES:
            out[k] = v
        elif k in (*NAME_MAPS, *DEPENDENCIES) and isinstance(v, dict):
            out[k] = {n: _rewrite(s, change, f"{here}/{_escape(n)}") for n, s in v.items()}
        else:
            out[k] = _rewrite(v, change, here)
    return change(node, out, pointer)


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _in_llguidance_terms(schema):
    """The schema with the keywords llguidance refuses said in ones it implements, accepting
    the same instances under jsonschema's meaning (its draft's keywords; exact, so that what is
    rewritten can be negated again):
    - ``not S``: S negated keyword by keyword (``_negated``), e.g. not {required: [a, b]} = an
      object without a or without b, not {enum: [1]} = the other types, or numbers below or
      above 1;
    - ``oneOf``: branch i and not any other (``_one_of``; branches no instance can satisfy
      together need no negation);
    - ``if``/``then``/``else``: (if and then) or (not if and else);
    - ``dependencies`` (``dependentRequired``/``dependentSchemas`` since 2019-09): an allOf
      of "the name is absent, or present with what it needs".
    Forms left unsaid stay, and llguidance refuses them by name. Where the negations would
    grow the schema past ``MAX_GROWTH`` times (llguidance took minutes on one grown 13-fold),
    they are left out."""
    schema = _rewrite(schema, _without_double_negation)  # before the inner one is rewritten
    size = len(json.dumps(schema))
    rewritten = _rewritten(schema, negate=True)
    if len(json.dumps(rewritten)) > MAX_GROWTH * size + 10_000:
        rewritten = _rewritten(schema, negate=False)
    return rewritten


def _rewritten(schema, negate: bool):
    doc = _Document.of(schema)
    doc.negate = negate

    def change(node, out, pointer=""):
        if isinstance(out.get("oneOf"), list):
            _one_of(out, doc)
        _dependencies(out, doc)
        positive = _negation(out["not"], out, doc, _kinds(out, doc)) if "not" in out else None
        if positive is not None:
            del out["not"]
            _also(out, positive)
        if "if" in out and "if" in doc.keywords:
            _if_then_else(out, doc)
        return out

    doc.change = change
    return _rewrite(schema, change)


TYPES = frozenset({"null", "boolean", "object", "array", "number", "string"})  # integer: number
MAX_BRANCHES = 16  # a oneOf's branches said as "this one and no other" (k * (k - 1) negations)
MAX_NEGATION_DEPTH = 16  # nested subschemas (and $refs followed) a negation goes through
MAX_GROWTH = 4  # times (plus 10k characters) the negations may grow a schema
MAX_NEGATED_REFS = 4_000  # characters of $ref targets one negation may copy


@dataclass
class _Document:
    """What rewriting needs to know of the whole schema: the keywords its draft validates
    (jsonschema's), and local $ref targets in llguidance terms (rewritten on first use)."""

    root: object
    keywords: frozenset
    ref_siblings: bool  # 2019-09 on: keywords beside a $ref count; drafts 4-7 ignore them
    local_refs: bool  # "#/..." resolves against the root: no nested $id moves the base
    change: object = None
    targets: dict = field(default_factory=dict)  # ref -> rewritten target, None while rewriting
    narrowed: set = field(default_factory=set)  # ids of rewritten nodes narrower than the schema
    negate: bool = True  # whether rewrites may negate (else only what needs no negation)
    partial: bool = False  # negating with the parts not said here left out (``_negation``)
    budget: int = 0  # characters of $ref targets the current negation may still copy

    @classmethod
    def of(cls, schema) -> _Document:
        jsonschema = jsonschema_module()
        with warnings.catch_warnings():  # an unknown $schema: the latest draft, as the oracle
            warnings.simplefilter("ignore", DeprecationWarning)
            draft = jsonschema.validators.validator_for(
                schema, default=jsonschema.Draft202012Validator
            )
        keywords = frozenset(draft.VALIDATORS)
        return cls(schema, keywords, "dependentRequired" in keywords, not _nested_ids(schema))

    def target(self, ref):
        """The local $ref's target in llguidance terms; None if not local or being rewritten
        (a recursive reference is not followed)."""
        if not (self.local_refs and isinstance(ref, str) and ref.startswith("#")):
            return None
        if ref not in self.targets:
            self.targets[ref] = None
            raw = _pointed(self.root, ref)
            self.targets[ref] = None if raw is None else _rewrite(raw, self.change)
        return self.targets[ref]

    def resolved(self, node):
        """``node``, or the target of its local $ref (followed up to 8 times)."""
        for _ in range(8):
            ref = node.get("$ref") if isinstance(node, dict) else None
            if ref is None or not self.local_refs or (target := _pointed(self.root, ref)) is None:
                break
            node = target
        return node


def _without_double_negation(node, out, pointer):
    inner = out.get("not")
    if isinstance(inner, dict) and set(inner) - {"title", "description", "$comment"} == {"not"}:
        del out["not"]
        _also(out, inner["not"])
    return out


def _pointed(root, ref):
    """The subschema a "#..." JSON pointer names, None if there is none."""
    if not isinstance(ref, str) or not ref.startswith("#") or (ref[1:] and ref[1] != "/"):
        return None
    node = root
    for part in ref[2:].split("/") if ref[1:] else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def _also(out: dict, schema) -> None:
    if schema is not True:
        out["allOf"] = [*out.get("allOf", []), schema]


def _all(parts):
    parts = [p for p in parts if p is not True]
    if any(p is False for p in parts):
        return False
    return True if not parts else parts[0] if len(parts) == 1 else {"allOf": parts}


def _any(parts):
    parts = [p for p in parts if p is not False]
    if any(p is True for p in parts):
        return True
    return False if not parts else parts[0] if len(parts) == 1 else {"anyOf": parts}


def _one_of(out: dict, doc: _Document) -> None:
    """oneOf [B1, ..., Bk] as anyOf [B1 and no other, ..., Bk and no other], where "no other"
    negates each other branch on the types where its instances may be Bi's too (``_overlap``)."""
    branches = out["oneOf"]
    if not branches or len(branches) > MAX_BRANCHES:
        return
    within = _kinds(out, doc)
    resolved = [doc.resolved(b) for b in branches]
    required = out.get("required") if isinstance(out.get("required"), list) else []
    options = []
    for i, branch in enumerate(branches):
        kinds, parts = within & _kinds(resolved[i], doc), [branch]
        for j, other in enumerate(resolved):
            shared = frozenset() if j == i else _overlap(resolved[i], other, kinds, doc, required)
            if not shared:
                continue
            if (negated := _negation(branches[j], out, doc, shared)) is None:
                return
            if shared != kinds:  # instances of the other types satisfy Bi alone
                negated = _any(
                    [{"type": sorted(kinds - shared)}, _all([{"type": sorted(shared)}, negated])]
                )
            parts.append(negated)
        options.append(_all(parts))
    del out["oneOf"]
    if "anyOf" in out:
        _also(out, _any(options))
    else:
        out["anyOf"] = options


def _if_then_else(out: dict, doc: _Document) -> None:
    cond, then, other = out["if"], out.get("then", True), out.get("else", True)
    unless = _negation(cond, out, doc, _kinds(out, doc)) if other is not False else False
    if unless is None:
        return
    for key in ("if", "then", "else"):
        out.pop(key, None)
    _also(out, _any([_all([cond, then]), _all([unless, other])]))


def _dependencies(out: dict, doc: _Document) -> None:
    """A dependency as "absent, or present with what it needs"; where the draft does not
    validate the keyword (jsonschema ignores it) the same, marked narrower: not negated."""
    for keyword in DEPENDENCIES:
        deps = out.get(keyword)
        if not isinstance(deps, dict) or not all(_dependency(d) for d in deps.values()):
            continue
        del out[keyword]
        needs = [_if_present(n, d) for n, d in deps.items()]
        if keyword not in doc.keywords:
            doc.narrowed.update(id(n) for n in needs)
        out["allOf"] = [*out.get("allOf", []), *needs]


def _dependency(dep) -> bool:
    return isinstance(dep, dict | bool) or (
        isinstance(dep, list) and all(isinstance(n, str) for n in dep)
    )


def _if_present(name: str, dep) -> dict:
    needs = {"required": [name, *dep]} if isinstance(dep, list) else {"required": [name]}
    if not isinstance(dep, list):
        needs["allOf"] = [dep]
    return {"anyOf": [{"properties": {name: False}}, needs]}


# --- negation ----------------------------------------------------------------------------------


def _negation(node, out: dict, doc: _Document, within):
    """``node`` negated exactly, else with the parts not said here left out (a subset: the
    instances that fail ``node`` the ways that can be said, such as missing a required
    property); then ``out`` is marked narrower, never to be
    negated itself (that would loosen it). None where nothing is left."""
    if not doc.negate:
        return None
    saved = doc.partial, doc.budget
    try:
        doc.partial, doc.budget = False, MAX_NEGATED_REFS
        exact = _negated(node, doc, within)
        if exact is not None:
            return exact
        doc.partial, doc.budget = True, MAX_NEGATED_REFS
        if (part := _negated(node, doc, within)) is False:
            return None
        doc.narrowed.add(id(out))
        return part
    finally:
        doc.partial, doc.budget = saved


def _negated(node, doc: _Document, within=TYPES, depth: int = 0):
    """A schema in llguidance's keywords that accepts, of the instances whose JSON types are
    in ``within``, exactly those ``node`` rejects (jsonschema's meaning); None where it is not
    said here. ``node`` is in llguidance terms already (rewritten bottom up), and exact."""
    if node is True:
        return False
    if node is False:
        return True
    if not isinstance(node, dict) or depth > MAX_NEGATION_DEPTH or id(node) in doc.narrowed:
        return False if doc.partial else None
    keys = node.keys() & doc.keywords  # what the draft does not know asserts nothing
    if "$ref" in keys and not doc.ref_siblings:
        keys = {"$ref"}
    parts = []
    for key in sorted(keys):
        if key in _NEGATIONS:
            part = _NEGATIONS[key](node, doc, within, depth + 1)
        else:  # vacuous on the types it is not about; else not said here
            kind = _TYPE_OF.get(key)
            part = None if kind is None or kind in within else []
        if part is None and not doc.partial:
            return None
        parts += part or []  # (partial: what is not said here is left out)
    return _any(parts)


def _of_type(kind: str, within, schema: dict) -> list:
    """[schema] for the instances of ``kind``; [] where none can be in ``within``."""
    return [{"type": kind} | schema] if kind in within else []


def _not_type(node, doc, within, depth):
    kinds = node["type"]
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list) or not all(k in TYPES or k == "integer" for k in kinds):
        return None
    if "integer" in kinds and "number" not in kinds and "number" in within:
        return None  # the fractional numbers are no type of their own
    rest = within - {"number" if k == "integer" else k for k in kinds}
    return [{"type": sorted(rest)}] if rest else []


def _other_values(values, within):
    """The instances of the types ``within`` JSON-equal to none of ``values`` (1 == 1.0, 1 is
    no true), or None for arrays and objects among the values."""
    if not isinstance(values, list):
        return None
    parts = [{"type": "null"}] if "null" in within and None not in values else []
    booleans = [b for b in (False, True) if not any(v is b for v in values)]
    if "boolean" in within and booleans:
        parts.append({"enum": booleans})
    if "number" in within:  # the open intervals between the values
        edges = [None, *sorted({v for v in values if _is_number(v)}), None]
        for lo, hi in zip(edges, edges[1:]):
            bounds = {"exclusiveMinimum": lo, "exclusiveMaximum": hi}
            parts.append({"type": "number"} | {k: v for k, v in bounds.items() if v is not None})
    if "string" in within:
        strings = sorted({v for v in values if isinstance(v, str)})
        if strings and (pattern := _none_of(strings)) is None:
            return None
        parts.append({"type": "string"} | ({"pattern": pattern} if strings else {}))
    for kind, python in (("array", list), ("object", dict)):
        if kind in within:
            if any(isinstance(v, python) for v in values):
                return None
            parts.append({"type": kind})
    return parts


def _none_of(strings: list) -> str | None:
    """A Python regex matching exactly the strings not among ``strings`` (a walk down their
    trie that leaves it somewhere); None past 64 characters a string."""
    if max(map(len, strings)) > 64 or len(strings) > 256:
        return None
    trie: dict = {}
    for text in strings:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}  # a string ends here ("" is no character)
    return r"\A" + _leaving(trie) + r"\Z"


def _leaving(node: dict) -> str:
    chars = sorted(c for c in node if c)
    options = [] if "" in node else [""]  # the text may end here
    escaped = "".join(map(re.escape, chars))
    options.append(f"[^{escaped}](?s:.)*" if chars else "(?s:.)+")  # or go elsewhere
    options += [re.escape(c) + _leaving(node[c]) for c in chars]  # or go on down
    return "(?:" + "|".join(options) + ")"


def _not_required(node, doc, within, depth):
    names = node["required"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return [p for n in names for p in _of_type("object", within, {"properties": {n: False}})]


def _not_properties(node, doc, within, depth):
    declared = node["properties"]
    if not isinstance(declared, dict):
        return None
    parts = []
    for name, sub in declared.items() if "object" in within else ():
        negated = _negated(sub, doc, TYPES, depth)
        if negated is None:
            return None
        if negated is not False:  # present, and what its schema rejects
            parts.append({"type": "object", "required": [name], "properties": {name: negated}})
    return parts


def _not_additional(node, doc, within, depth):
    extra = node["additionalProperties"]
    if extra is True or (isinstance(extra, dict) and not (extra.keys() & doc.keywords)):
        return []
    if extra is False and not node.get("properties") and not node.get("patternProperties"):
        return _of_type("object", within, {"minProperties": 1})  # any property at all
    return None if "object" in within else []


# size keyword: (the type it is about, its opposite, the step from one to the other)
SIZES = {
    "minLength": ("string", "maxLength", -1),
    "maxLength": ("string", "minLength", 1),
    "minItems": ("array", "maxItems", -1),
    "maxItems": ("array", "minItems", 1),
    "minProperties": ("object", "maxProperties", -1),
    "maxProperties": ("object", "minProperties", 1),
}


def _not_size(key):
    kind, opposite, step = SIZES[key]

    def negate(node, doc, within, depth):
        n = node[key]
        if not _is_number(n) or n != int(n) or n < 0:
            return None
        if step < 0 and n == 0:
            return []  # every size is >= 0
        return _of_type(kind, within, {opposite: int(n) + step})

    return negate


def _not_bound(key):
    """not (x >= b) is x < b, and so on; draft 4's boolean exclusive flags read with them."""
    lower = key in ("minimum", "exclusiveMinimum")

    def negate(node, doc, within, depth):
        b = node[key]
        if not _is_number(b):
            return None
        flag = "exclusive" + key[:1].upper() + key[1:]  # draft 4: a flag beside the bound
        exclusive = key.startswith("exclusive") or (
            flag not in doc.keywords and node.get(flag) is True
        )
        opposite = (
            ("maximum" if exclusive else "exclusiveMaximum")
            if lower
            else ("minimum" if exclusive else "exclusiveMinimum")
        )
        return _of_type("number", within, {opposite: b})

    return negate


def _not_all(node, doc, within, depth):
    subs = node["allOf"]
    if not isinstance(subs, list):
        return None
    parts = [_negated(s, doc, within, depth) for s in subs]
    return None if None in parts else parts


def _not_any(node, doc, within, depth):
    subs = node["anyOf"]
    if not isinstance(subs, list):
        return None
    parts = [_negated(s, doc, within, depth) for s in subs]
    return None if None in parts else [_all(parts)]


def _not_ref(node, doc, within, depth):
    """The target negated, within a budget of copied targets per negation: llguidance took
    minutes intersecting big copies (Github_hard---o91595)."""
    target = doc.target(node["$ref"])
    size = len(json.dumps(target))
    if target is None or size > doc.budget:
        return None
    doc.budget -= size
    negated = _negated(target, doc, within, depth)
    return None if negated is None else [negated]


def _not_if(node, doc, within, depth):
    """not (if C then T else E) = (C and not T) or (not C and not E)."""
    cond, then, other = node["if"], node.get("then", True), node.get("else", True)
    parts = []
    for guard, branch in ((cond, then), (None, other)):
        negated = _negated(branch, doc, within, depth)
        if negated is None:
            return None
        if negated is not False:
            guard = _negated(cond, doc, within, depth) if guard is None else guard
            if guard is None:
                return None
            parts.append(_all([guard, negated]))
    return parts


_NEGATIONS = {
    "type": _not_type,
    "enum": lambda node, doc, within, depth: _other_values(node["enum"], within),
    "const": lambda node, doc, within, depth: _other_values([node["const"]], within),
    "required": _not_required,
    "properties": _not_properties,
    "additionalProperties": _not_additional,
    **{key: _not_size(key) for key in SIZES},
    **{k: _not_bound(k) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")},
    "allOf": _not_all,
    "anyOf": _not_any,
    "not": lambda node, doc, within, depth: [node["not"]],  # not not S = S
    "$ref": _not_ref,
    "if": _not_if,
    "uniqueItems": lambda node, doc, within, depth: (
        [] if node["uniqueItems"] is False or "array" not in within else None
    ),
}
# the type the other keywords are about: vacuous on instances of other types
_TYPE_OF = {
    **dict.fromkeys(("pattern", "format", "contentMediaType", "contentEncoding"), "string"),
    **dict.fromkeys(("multipleOf",), "number"),
    **dict.fromkeys(
        ("items", "prefixItems", "additionalItems", "contains", "unevaluatedItems"), "array"
    ),
    **dict.fromkeys(
        (
            "patternProperties",
            "propertyNames",
            "unevaluatedProperties",
            *DEPENDENCIES,
        ),
        "object",
    ),
}


def _kinds(node, doc: _Document, depth: int = 0) -> frozenset:
    """The JSON types ``node``'s instances may have (or more), as far as its type, const,
    enum, combinators and local $ref say."""
    if node is False:
        return frozenset()
    if not isinstance(node, dict) or depth > MAX_NEGATION_DEPTH:
        return TYPES
    kinds = TYPES
    if "$ref" in node:
        target = doc.resolved(node)
        kinds = TYPES if target is node else _kinds(target, doc, depth + 1)
        if not doc.ref_siblings:
            return kinds
    named = node.get("type")
    named = [named] if isinstance(named, str) else named
    if isinstance(named, list) and all(isinstance(k, str) for k in named):
        kinds &= {"number" if k == "integer" else k for k in named}
    if "const" in node and "const" in doc.keywords:
        kinds &= {_kind(node["const"])}
    if isinstance(node.get("enum"), list):
        kinds &= {_kind(v) for v in node["enum"]}
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            kinds &= frozenset().union(*(_kinds(b, doc, depth + 1) for b in node[key]))
    for sub in node.get("allOf", []) if isinstance(node.get("allOf"), list) else []:
        kinds &= _kinds(sub, doc, depth + 1)
    return kinds


def _kind(value) -> str:
    if value is None or isinstance(value, bool):
        return "null" if value is None else "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "object")


def _overlap(a, b, within, doc: _Document, required=()) -> frozenset:
    """The types ``within`` of which an instance may satisfy both branches (resolved), as far
    as their types, their values, a discriminating property (required by both, or by the
    node around them: ``required``) or a closed object show (the last two tell objects
    apart: a non-object satisfies every `required`)."""
    common = within & _kinds(a, doc) & _kinds(b, doc)
    if (
        not common
        or not (isinstance(a, dict) and isinstance(b, dict))
        or "$ref" in a
        or "$ref" in b
    ):
        return common
    values = _values(a, doc), _values(b, doc)
    if None not in values and not values[0] & values[1]:
        return frozenset()
    tags = _tags(a, doc, required), _tags(b, doc, required)
    if (
        any(not tags[0][n] & tags[1][n] for n in tags[0].keys() & tags[1].keys())
        or _closed_to(a, b)
        or _closed_to(b, a)
    ):
        return common - {"object"}
    return common


def _values(node, doc: _Document, depth: int = 0) -> set | None:
    """The JSON values ``node`` allows (as _json_key; or more), where its const, enum,
    combinators and local $ref say; None where they do not."""
    if not isinstance(node, dict) or depth > MAX_NEGATION_DEPTH:
        return None
    found = []
    if "$ref" in node:
        target = doc.resolved(node)
        found.append(None if target is node else _values(target, doc, depth + 1))
        if not doc.ref_siblings:
            return found[0]
    if "const" in node and "const" in doc.keywords:
        found.append({_json_key(node["const"])})
    if isinstance(node.get("enum"), list):
        found.append({_json_key(v) for v in node["enum"]})
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            each = [_values(b, doc, depth + 1) for b in node[key]]
            found.append(None if None in each else set().union(*each))
    for sub in node.get("allOf", []) if isinstance(node.get("allOf"), list) else []:
        found.append(_values(sub, doc, depth + 1))
    known = [v for v in found if v is not None]
    return set.intersection(*known) if known else None


def _tags(branch: dict, doc: _Document, also=()) -> dict:
    """Required property (by the branch, or ``also``) -> the values its schema allows, where
    const or enum says."""
    required, declared = branch.get("required", []), branch.get("properties")
    if not isinstance(required, list) or not isinstance(declared, dict):
        return {}
    required = [*required, *also]
    found = {n: _values(doc.resolved(declared.get(n)), doc) for n in required if isinstance(n, str)}
    return {n: v for n, v in found.items() if v is not None}


def _closed_to(a: dict, b: dict) -> bool:
    """Whether ``a`` admits no object with all the properties ``b`` requires."""
    declared, required = a.get("properties", {}), b.get("required")
    if not isinstance(declared, dict) or not isinstance(required, list):
        return False
    closed = a.get("additionalProperties") is False and not a.get("patternProperties")
    return any(
        isinstance(n, str) and (declared.get(n) is False or (closed and n not in declared))
        for n in required
    )


def _json_key(value):
    """Equal keys for JSON-equal scalars; one key for all arrays and objects (their members'
    numbers compare as numbers too: never told apart here)."""
    if isinstance(value, bool) or value is None:
        return ("literal", value)
    if isinstance(value, int | float):
        return ("number", float(value))
    return ("string", value) if isinstance(value, str) else ("composite",)


def _nested_ids(node, root: bool = True) -> bool:
    """Whether a subschema below the root sets $id (or draft 4's id): local refs resolve
    against the root only where none does."""
    if isinstance(node, list):
        return any(_nested_ids(v, False) for v in node)
    if not isinstance(node, dict):
        return False
    if not root and (isinstance(node.get("$id"), str) or isinstance(node.get("id"), str)):
        return True
    for k, v in node.items():
        if k in VALUES:
            continue
        if k in NAME_MAPS:
            if isinstance(v, dict) and any(_nested_ids(s, False) for s in v.values()):
                return True
        elif _nested_ids(v, False):
            return True
    return False


def _sound_for_llguidance(node):
    """A copy of the schema in which llguidance accepts nothing jsonschema rejects."""
    return _rewrite(node, _sound_node)


def _sound_node(node, out: dict, pointer: str) -> dict:
    _sound_strings(out, pointer)
    _sound_numbers(out, pointer)
    return out


def _sound_strings(out: dict, pointer: str) -> None:
    """Formats as patterns.FORMATS writes them, and every regex in llguidance's own syntax with
    Python's meaning (``patterns.rust_pattern``)."""
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt not in NATIVE_FORMATS:
        if fmt not in KNOWN_FORMATS:
            del out["format"]  # an annotation: jsonschema checks nothing
        elif fmt in FORMATS and "pattern" not in out:
            del out["format"]
            out["pattern"] = f"^{FORMATS[fmt]}$"
    if isinstance(out.get("pattern"), str):
        out["pattern"] = rust_pattern(out["pattern"], f"{pointer}/pattern")
    names = out.get("patternProperties")
    if isinstance(names, dict):
        where = f"{pointer}/patternProperties"
        out["patternProperties"] = {rust_pattern(k, f"{where}/{k}"): v for k, v in names.items()}


# llguidance reads bounds as 64-bit floats, fractional ones printed to ~15 digits (minimum
# -1.9999999999999998 let -2 through, maximum 2**63 let 2**63 + 1 through), and compares texts
# with them in exact decimals, where jsonschema compares the float json.loads parses: 1e-401
# written out is > 0 for llguidance and 0.0 for jsonschema. So bounds are moved inward to what
# it reads exactly (integers below 2**53, 15 significant digits; an integer bound past 2**53 on
# integers to 2**53 - 1, on other numbers refused), and an exclusive bound on numbers that may
# have fractions becomes an inclusive one a relative 1e-13 inside it, past which the parsed
# float lies beyond the bound too. Subsets all: a few valid numbers next to a bound are lost.
BOUNDS = {"minimum": 1, "exclusiveMinimum": 1, "maximum": -1, "exclusiveMaximum": -1}  # inward
EXACT_DIGITS = 15
LARGEST = 2**53 - 1  # the largest integer from which all smaller ones are exact floats


def _sound_numbers(out: dict, pointer: str) -> None:
    step = out.get("multipleOf")
    if _is_number(step) and not float(step).is_integer():
        raise UnsupportedSchemaError("multipleOf", pointer, _LOOSER)  # decimals vs floats
    kinds = out.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    integers = "integer" in kinds and "number" not in kinds
    for key, inward in BOUNDS.items():
        b = out.get(key)
        if not _is_number(b):
            continue
        if abs(b) > LARGEST:
            if not integers or (b > 0) == (inward > 0):
                raise UnsupportedSchemaError(key, pointer, _ROUNDED)
            out[key] = -inward * LARGEST  # the bound's side of 0, within 2**53
        elif isinstance(b, float) and _digits(b) > EXACT_DIGITS:
            rounding = ROUND_CEILING if inward > 0 else ROUND_FLOOR
            out[key] = float(Context(EXACT_DIGITS, rounding).create_decimal(repr(b)))
    if integers:
        return  # integers parse exactly, and llguidance's integer bounds are exact
    for exclusive, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        b = out.get(exclusive)
        if b is True:  # draft 4: a flag on the inclusive bound
            b = out.pop(inclusive, None)
        if not _is_number(b):
            continue
        del out[exclusive]
        m = _inside(b, BOUNDS[inclusive])
        tighter = max if BOUNDS[inclusive] > 0 else min
        out[inclusive] = tighter(out[inclusive], m) if _is_number(out.get(inclusive)) else m


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _digits(x: float) -> int:
    return len(Decimal(repr(x)).normalize().as_tuple().digits)


def _inside(bound, inward: int) -> float:
    """A number of at most 15 significant digits a relative 1e-13 inside ``bound``."""
    d = Decimal(repr(bound) if isinstance(bound, float) else bound)
    step = Decimal(1).scaleb(d.adjusted() - 13) if d else Decimal("1e-15")
    return float(d + inward * step)


_ROUNDED = (
    "llguidance reads this bound rounded and would accept texts jsonschema rejects: "
    "use a bound within 2**53."
)


_LOOSER = "llguidance would accept texts jsonschema rejects here."

# Objects with declared properties get no undeclared ones where the schema says nothing about
# them (additionalProperties: false): allowed, the small default
# model filled objects with invented keys or echoed the schema itself (git show 8fe3c79:docs/measurements.md).
# Sound because it only happens in schemas without negation (`not`, `oneOf`'s "exactly one",
# `if`): there every subschema counts positively, so narrowing one narrows the whole (under
# oneOf, closing a branch lets instances valid under two branches through: the coverage run
# caught it). Nor with allOf, or a $ref or anyOf beside properties, where closing one schema
# would reject the properties another declares (closed beside an anyOf, an object with the
# properties of a branch had none left: "unsatisfiable").
OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
NOT_CLOSABLE = ("not", "oneOf", "if", "allOf")


def _close_objects(node):
    return _rewrite(node, _closed)


def _closed(node, out: dict, pointer: str) -> dict:
    declared, required = node.get("properties"), node.get("required")
    if (
        isinstance(declared, dict)
        and not any(k in node for k in OPEN_KEYS)
        and (not isinstance(required, list) or {str(r) for r in required} <= set(declared))
    ):  # a required name not declared stays possible
        out["additionalProperties"] = False
    return out


def _closable(node) -> bool:
    """No negation, no allOf, no $ref or anyOf beside properties (JSON values aside)."""
    if isinstance(node, list):
        return all(_closable(v) for v in node)
    if not isinstance(node, dict):
        return True
    if any(k in node for k in NOT_CLOSABLE) or (
        "properties" in node and any(k in node for k in ("$ref", "anyOf"))
    ):
        return False
    return all(_closable(v) for k, v in node.items() if k not in VALUES)


# llguidance takes minProperties/maxProperties only where every declared property is required.
# On a closed object (no undeclared properties) a count bound is a statement about which of the
# optional properties are present, which it does implement: "at least a of them" is anyOf over
# the a-subsets, each required; "at most b" is anyOf over the subsets of those left out, each
# absent (a property whose schema is false). Exact; where the subsets would be many, left as it
# is, and llguidance refuses it. Where undeclared keys may come, llguidance counts a repeated
# one (`{"a":1,"a":2}`, one property once parsed) toward minProperties (it never repeats a
# declared one, nor gives an undeclared key a declared name): the parsed object holds at least
# the declared properties present plus one, if any undeclared key came, so a bound up to the
# required properties + 1 holds; a higher one is refused by name (maxProperties only narrows).
MAX_COUNT_BRANCHES = 32
_REPEATED = (
    'llguidance would count a repeated undeclared key toward it (`{"a":1,"a":2}` has '
    "one property): declare the properties, or close the object (additionalProperties: false)."
)


def _property_counts(node, out, pointer):
    declared, required = out.get("properties", {}), out.get("required", [])
    if not (
        isinstance(declared, dict)
        and isinstance(required, list)
        and any(k in out for k in ("minProperties", "maxProperties"))
    ):
        return out
    if out.get("additionalProperties") is not False or out.get("patternProperties"):
        least, present = out.get("minProperties", 0), len({r for r in required if r in declared})
        if _is_number(least) and least > present + 1:
            raise UnsupportedSchemaError("minProperties", "", _REPEATED)
        if _is_number(least) and least <= present:
            out.pop("minProperties", None)  # the declared required properties alone reach it
        return out
    if not set(required) <= set(declared):
        return out
    lo, hi = out.get("minProperties", 0), out.get("maxProperties", len(declared))
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (lo, hi)):
        return out
    optional = [name for name in declared if name not in required]
    least, most = max(lo - len(set(required)), 0), min(hi - len(set(required)), len(optional))
    if least > most:
        return out  # no instance has such a count: llguidance names it unsatisfiable
    if comb(len(optional), least) + comb(len(optional), len(optional) - most) > MAX_COUNT_BRANCHES:
        return out
    out.pop("minProperties", None)
    out.pop("maxProperties", None)
    parts = []
    if least > 0:
        parts.append({"anyOf": [{"required": list(s)} for s in combinations(optional, least)]})
    if most < len(optional):
        gone = combinations(optional, len(optional) - most)
        parts.append({"anyOf": [{"properties": dict.fromkeys(s, False)} for s in gone]})
    if parts:
        out["allOf"] = [*out.get("allOf", []), *parts]
    return out
