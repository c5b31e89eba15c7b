"""A JSON Schema said in the terms llguidance implements, accepting nothing jsonschema rejects
(guidance.schema_grammar compiles the result)."""

from __future__ import annotations

import itertools
import re
import warnings
from decimal import ROUND_CEILING, ROUND_FLOOR, Context, Decimal
from functools import cache

from .errors import UnsupportedSchemaError
from .schema.regex import (
    MAX_CODEPOINT,
    C,
    PatternError,
    _complement,
    _intersect,
    _normalise,
    sre_parse,
)

# Where llguidance accepts texts that jsonschema (with its format checker) rejects, found by
# benchmarks/coverage_engines.py and a fuzz of every format (docs/schemas.md): a leap second
# "23:59:60" and some offsets in date-time / time; multipleOf with a fraction, which llguidance
# checks in exact decimals and jsonschema in floats ("9356.55" is no multiple of 0.01 there).
# Formats llguidance checks soundly stay its own; the other formats the regex engine writes as a
# regex become that regex as a pattern; format names jsonschema does not check are annotations
# (dropped, as the regex engine does); the rest llguidance implements or refuses by name.
NATIVE_FORMATS = {"date", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"}
VALUES = {"enum", "const", "default", "examples"}  # JSON values, not schemas: never rewritten


# Keywords whose values map names (of properties, definitions) to schemas: the names are no
# keywords, whatever they spell.
NAME_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
DEPENDENCIES = ("dependencies", "dependentRequired", "dependentSchemas")


def _rewrite(node, change):
    """``change(node, copy)`` applied bottom up to every subschema, where ``copy`` is the node
    with its subschemas already changed; JSON values and property names are left alone."""
    if isinstance(node, list):
        return [_rewrite(v, change) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in VALUES:
            out[k] = v
        elif k in (*NAME_MAPS, *DEPENDENCIES) and isinstance(v, dict):
            out[k] = {name: _rewrite(schema, change) for name, schema in v.items()}
        else:
            out[k] = _rewrite(v, change)
    return change(node, out)


def _in_llguidance_terms(schema):
    """The schema with keywords llguidance refuses said in ones it implements, accepting the
    same instances:
    - a oneOf no instance can satisfy twice becomes an anyOf (``_exclusive``);
    - ``dependencies`` (draft 4–7; ``dependentRequired``/``dependentSchemas`` since 2019-09)
      becomes an allOf of "the name is absent, or present with what it needs": anyOf [{properties: {name: false}}, {required: [name, ...]}] for a list
      of names, anyOf [{properties: {name: false}}, {required: [name], allOf: [schema]}] for a
      schema (both vacuous on non-objects, as dependencies is);
    - ``not``: a double negation is what it negates; a negated ``required``, ``type``, empty or
      boolean schema is said positively (``_affirmed``); any other ``not`` stays, refused."""
    schema = _rewrite(schema, _without_double_negation)
    local_refs = not _nested_ids(schema)

    def change(node, out):
        if isinstance(node.get("oneOf"), list) and "anyOf" not in node:
            if _exclusive(node, schema, local_refs):
                out["anyOf"] = out.pop("oneOf")
        for keyword in DEPENDENCIES:
            deps = out.get(keyword)
            if isinstance(deps, dict) and all(_dependency(d) for d in deps.values()):
                del out[keyword]
                needs = [_if_present(n, d) for n, d in deps.items()]
                out["allOf"] = [*out.get("allOf", []), *needs]
        if "not" in out and (affirmed := _affirmed(out["not"])) is not None:
            del out["not"]
            out["allOf"] = [*out.get("allOf", []), affirmed]
        return out

    return _rewrite(schema, change)


ANNOTATIONS = {"title", "description", "$comment", "examples", "default", "deprecated"}
TYPES = {"null", "boolean", "object", "array", "number", "string"}  # integer: within number


def _keywords(node: dict) -> set:
    return set(node) - ANNOTATIONS


def _without_double_negation(node, out):
    inner = out.get("not")
    if isinstance(inner, dict) and _keywords(inner) == {"not"}:
        del out["not"]
        out["allOf"] = [*out.get("allOf", []), inner["not"]]
    return out


def _affirmed(negated):
    """A schema accepting exactly what {"not": negated} accepts, where llguidance needs it said
    positively; None for the forms left to refuse."""
    if negated is True or (isinstance(negated, dict) and not _keywords(negated)):
        return False
    if negated is False:
        return True
    if not isinstance(negated, dict):
        return None
    keys, names, kinds = _keywords(negated), negated.get("required"), negated.get("type")
    if keys == {"allOf"} and isinstance(negated["allOf"], list) and len(negated["allOf"]) == 1:
        return _affirmed(negated["allOf"][0])  # as a triple negation leaves it
    if keys == {"required"} and isinstance(names, list) and names:
        if all(isinstance(n, str) for n in names):  # an object missing one of them (`required`
            missing = [{"properties": {n: False}} for n in names]  # holds on non-objects)
            return {"type": "object", "anyOf": missing}
    kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else None
    if keys == {"type"} and kinds is not None and kinds <= TYPES | {"integer"}:
        if "integer" in kinds and "number" not in kinds:
            return None  # the fractional numbers are no type of their own
        rest = sorted(TYPES - kinds)
        return {"type": rest} if rest else False
    return None


def _dependency(dep) -> bool:
    return isinstance(dep, dict | bool) or (
        isinstance(dep, list) and all(isinstance(n, str) for n in dep)
    )


def _if_present(name: str, dep) -> dict:
    needs = {"required": [name, *dep]} if isinstance(dep, list) else {"required": [name]}
    if not isinstance(dep, list):
        needs["allOf"] = [dep]
    return {"anyOf": [{"properties": {name: False}}, needs]}


def _exclusive(node: dict, root, local_refs: bool) -> bool:
    resolve = (lambda b: _resolve(b, root)) if local_refs else (lambda b: b)
    branches = [resolve(b) for b in node["oneOf"]]
    if len(branches) < 2 or not all(isinstance(b, dict) and "$ref" not in b for b in branches):
        return False
    types = [_types(b) for b in branches]
    pairs = list(itertools.combinations(range(len(branches)), 2))
    if all(t is not None for t in types) and all(not types[i] & types[j] for i, j in pairs):
        return True
    if node.get("type") != "object" and any(t != {"object"} for t in types):
        return False  # a non-object instance satisfies every branch's `required`
    tags = [_tags(b, resolve) for b in branches]
    for name in set.intersection(*(set(t) for t in tags)):
        if all(not tags[i][name] & tags[j][name] for i, j in pairs):
            return True
    return False


def _resolve(node, root, depth: int = 0):
    """A local "#/..." $ref's target (followed up to 8 times), else the node itself."""
    ref = node.get("$ref") if isinstance(node, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#/") or depth > 8:
        return node
    target = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return node
        target = target[part]
    return _resolve(target, root, depth + 1)


def _types(branch: dict) -> set | None:
    kind = branch.get("type")
    kinds = {kind} if isinstance(kind, str) else kind
    if not isinstance(kinds, list | set) or not all(isinstance(k, str) for k in kinds):
        return None
    kinds = set(kinds)
    return kinds | {"integer", "number"} if kinds & {"integer", "number"} else kinds


def _tags(branch: dict, resolve) -> dict:
    """Required property → the set of its const/enum values (JSON equality: 1 == 1.0, not True)."""
    required, declared = branch.get("required"), branch.get("properties")
    if not isinstance(required, list) or not isinstance(declared, dict):
        return {}
    tags = {}
    for name in required:
        spec = resolve(declared.get(name)) if isinstance(name, str) else None
        if isinstance(spec, dict) and "const" in spec:
            tags[name] = {_json_key(spec["const"])}
        elif isinstance(spec, dict) and isinstance(spec.get("enum"), list):
            tags[name] = {_json_key(v) for v in spec["enum"]}
    return tags


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


def _sound_for_llguidance(node, pointer: str = ""):
    """A copy of the schema in which llguidance accepts nothing jsonschema rejects."""
    if isinstance(node, list):
        return [_sound_for_llguidance(v, f"{pointer}/{i}") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in VALUES:
            out[k] = v
        elif k in NAME_MAPS and isinstance(v, dict):
            out[k] = {n: _sound_for_llguidance(s, f"{pointer}/{k}/{n}") for n, s in v.items()}
        else:
            out[k] = _sound_for_llguidance(v, f"{pointer}/{k}")
    _sound_strings(out, pointer)
    _sound_numbers(out, pointer)
    return out


def _sound_strings(out: dict, pointer: str) -> None:
    """Formats as the regex engine writes them, and every regex in llguidance's own syntax with
    Python's meaning (``_llg_pattern``)."""
    from .schema.regex import FORMATS, KNOWN_FORMATS

    fmt = out.get("format")
    if isinstance(fmt, str) and fmt not in NATIVE_FORMATS:
        if fmt not in KNOWN_FORMATS:
            del out["format"]  # an annotation: jsonschema checks nothing
        elif fmt in FORMATS and "pattern" not in out:
            del out["format"]
            out["pattern"] = f"^{FORMATS[fmt]}$"
    if isinstance(out.get("pattern"), str):
        out["pattern"] = _llg_pattern(out["pattern"], f"{pointer}/pattern")
    names = out.get("patternProperties")
    if isinstance(names, dict):
        where = f"{pointer}/patternProperties"
        out["patternProperties"] = {_llg_pattern(k, f"{where}/{k}"): v for k, v in names.items()}


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
    "use a bound within 2**53, or engine='regex'."
)


def _llg_pattern(pattern: str, pointer: str) -> str:
    """``pattern`` in llguidance's (Rust) regex syntax, matching what Python's ``re.search``
    (jsonschema's) matches, or less: written from Python's own parse, every character class as
    explicit ranges, since llguidance's differ from Python's: its negated classes let ``"`` and
    ``\\`` through (``[^"]`` matched ``a"b``), its ``\\s`` lacks \\x1c-\\x1f (so ``\\S`` has
    them), its ``\\w`` and ``\\d`` are ASCII (so ``\\W`` had ``é``), ``[[:alpha:]]`` is a
    POSIX class there and literal characters in Python."""
    try:
        with warnings.catch_warnings():  # "possible nested set": Python reads [[ literally
            warnings.simplefilter("ignore", FutureWarning)
            parsed = sre_parse.parse(pattern)
        if parsed.state.flags & (re.I | re.M | re.L):
            raise PatternError("the flags (?i), (?m) and (?L)")
        return _rust(list(parsed))
    except (re.error, PatternError, RecursionError) as e:
        raise UnsupportedSchemaError(
            "pattern", pointer, f"{pattern[:200]!r}: {e} (not said in llguidance's terms)."
        ) from None


def _rust(items: list) -> str:
    return "".join(_rust_item(op, av) for op, av in items)


def _rust_item(op, av) -> str:
    if op is C.LITERAL:
        return _rust_class([(av, av)])
    if op is C.NOT_LITERAL:
        return _rust_class(_complement([(av, av)]))
    if op is C.ANY:  # without (?s): all but a newline; with it Python's is wider (fewer strings)
        return _rust_class(_complement([(10, 10)]))
    if op is C.IN:
        return _rust_class(_class_ranges(av))
    if op is C.BRANCH:
        return "(?:" + "|".join(_rust(list(b)) for b in av[1]) + ")"
    if op is C.SUBPATTERN:
        if (av[1] | av[2]) & (re.I | re.M | re.L):
            raise PatternError("the flags (?i), (?m) and (?L)")
        return "(?:" + _rust(list(av[3])) + ")"
    if op in (C.MAX_REPEAT, C.MIN_REPEAT):  # laziness does not change what re.search finds
        lo, hi, sub = av
        return "(?:" + _rust(list(sub)) + f"){{{lo},{'' if hi >= C.MAXREPEAT else hi}}}"
    if op is C.AT and av in (C.AT_BEGINNING, C.AT_BEGINNING_STRING):
        return "^"
    if op is C.AT and av in (C.AT_END, C.AT_END_STRING):  # Python's $ also before a last \n
        return "$"
    raise PatternError(f"{_UNSAID.get(op, 'anchors other than ^ and $')} cannot be said there")


_UNSAID = {
    C.ASSERT: "lookarounds",
    C.ASSERT_NOT: "lookarounds",
    C.GROUPREF: "backreferences",
    C.GROUPREF_EXISTS: "conditional groups",
    C.POSSESSIVE_REPEAT: "possessive repeats",
    C.ATOMIC_GROUP: "atomic groups",
}


def _class_ranges(items) -> list[tuple[int, int]]:
    """Code point ranges of a Python character class, its categories (\\d, \\s, \\w) as
    Python's own (Unicode)."""
    negate = bool(items) and items[0][0] is C.NEGATE
    ranges = []
    for op, av in items[int(negate) :]:
        if op is C.LITERAL:
            ranges.append((av, av))
        elif op is C.RANGE:
            ranges.append(av)
        elif op is C.CATEGORY and av in _CATEGORIES:
            name, inverted = _CATEGORIES[av]
            members = _category(name)
            ranges += _complement(members) if inverted else members
        else:
            raise PatternError(f"the class item {str(op).lower()}")
    return _complement(ranges) if negate else _normalise(ranges)


_CATEGORIES = {
    C.CATEGORY_DIGIT: ("\\d", False),
    C.CATEGORY_NOT_DIGIT: ("\\d", True),
    C.CATEGORY_SPACE: ("\\s", False),
    C.CATEGORY_NOT_SPACE: ("\\s", True),
    C.CATEGORY_WORD: ("\\w", False),
    C.CATEGORY_NOT_WORD: ("\\w", True),
}


@cache
def _category(name: str) -> list[tuple[int, int]]:
    """The code points Python's ``name`` (\\d, \\s, \\w) matches, as ranges (~0.1 s, once)."""
    everything = "".join(map(chr, range(MAX_CODEPOINT + 1)))
    return [(m.start(), m.end() - 1) for m in re.finditer(name + "+", everything)]


def _rust_class(ranges) -> str:
    """One character of ``ranges``, every code point written as \\x{...}, in a positive
    class (llguidance's negated ones let ``"`` and ``\\\\`` through), without surrogates (no
    text holds them) and without NUL: a set with all 32 control characters made llguidance
    accept any JSON escape, ``\\"`` and ``\\\\`` too, whether they were members or not."""
    ranges = _intersect(ranges, _complement([(0, 0), (0xD800, 0xDFFF)]))
    if not ranges:
        raise PatternError("a character class that matches no character")
    if ranges == [(ranges[0][0], ranges[0][0])]:
        c = ranges[0][0]
        return chr(c) if chr(c).isascii() and chr(c).isalnum() else f"\\x{{{c:X}}}"
    body = "".join(f"\\x{{{lo:X}}}" + (f"-\\x{{{hi:X}}}" if hi > lo else "") for lo, hi in ranges)
    return f"[{body}]"


_LOOSER = "llguidance would accept texts jsonschema rejects here."

# Objects with declared properties get no undeclared ones where the schema says nothing about
# them (additionalProperties: false), the regex engine's subset too: allowed, the small default
# model filled objects with invented keys or echoed the schema itself (docs/measurements.md).
# Sound because it only happens in schemas without negation (`not`, `oneOf`'s "exactly one",
# `if`): there every subschema counts positively, so narrowing one narrows the whole (under
# oneOf, closing a branch lets instances valid under two branches through: the coverage run
# caught it). Nor with allOf or a $ref beside properties, where closing one schema would reject
# the properties another declares.
OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
NOT_CLOSABLE = ("not", "oneOf", "if", "allOf")


def _close_objects(node):
    if isinstance(node, list):
        return [_close_objects(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in VALUES else _close_objects(v) for k, v in node.items()}
    declared, required = node.get("properties"), node.get("required")
    if (
        isinstance(declared, dict)
        and not any(k in node for k in OPEN_KEYS)
        and (not isinstance(required, list) or {str(r) for r in required} <= set(declared))
    ):  # a required name not declared stays possible
        out["additionalProperties"] = False
    return out


def _closable(node) -> bool:
    """No negation, no allOf and no $ref beside properties anywhere (JSON values aside)."""
    if isinstance(node, list):
        return all(_closable(v) for v in node)
    if not isinstance(node, dict):
        return True
    if any(k in node for k in NOT_CLOSABLE) or ("$ref" in node and "properties" in node):
        return False
    return all(_closable(v) for k, v in node.items() if k not in VALUES)
