"""A JSON Schema said in the terms llguidance implements, accepting nothing jsonschema rejects
(guidance.schema_grammar compiles the result)."""

from __future__ import annotations

import itertools

from .errors import UnsupportedSchemaError

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
    from .schema.regex import FORMATS, KNOWN_FORMATS

    if isinstance(node, list):
        return [_sound_for_llguidance(v, f"{pointer}/{i}") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out = {
        k: v if k in VALUES else _sound_for_llguidance(v, f"{pointer}/{k}") for k, v in node.items()
    }
    step = node.get("multipleOf")
    if isinstance(step, (int, float)) and not float(step).is_integer():
        raise UnsupportedSchemaError("multipleOf", pointer, _LOOSER)
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in NATIVE_FORMATS:
        if fmt not in KNOWN_FORMATS:
            del out["format"]  # an annotation: jsonschema checks nothing
        elif fmt in FORMATS and "pattern" not in node:
            del out["format"]
            out["pattern"] = f"^{FORMATS[fmt]}$"
    return out


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
