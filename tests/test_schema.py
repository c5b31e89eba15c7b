"""Schema front end: each feature accepts what the schema accepts and never more; refusals are
named. Automata are compiled over the tiny byte-level tokenizer and walked byte by byte."""

import json
import random
import time
from pathlib import Path

import jsonschema
import pytest

from constrained_spec.compile import compile_regex, run_bounded
from constrained_spec.errors import ConstraintError, SchemaTooComplex, UnsupportedSchemaError
from constrained_spec.schema import schema_to_regex
from constrained_spec.vocab import token_vocabulary

SCHEMAS = sorted((Path(__file__).parent / "data" / "schemas").glob("*.json"))
# The real schemas the compiler refuses, and the keyword and pointer it names; every other one
# must compile (a refusal cannot stand in for the checks).
REFUSED = {"Github_medium---o82570": ("pattern", "/properties/message_ref/properties/curie")}


def dumps(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@pytest.fixture(scope="module")
def build(tiny_tokenizer):
    vocab = token_vocabulary(tiny_tokenizer)
    return lambda schema: compile_regex(schema_to_regex(schema), vocab, len(tiny_tokenizer), None)


def oracle(schema):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid


def check(build, schema, accepted=(), rejected=(), wrap=True):
    """Values must be accepted / rejected, and agree with jsonschema. Scalars are checked inside
    a one-item array (outlines-core's Index cannot extend a top-level match that is already
    complete, e.g. "1" -> "1.5"; inside brackets it can)."""
    if wrap:
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
        accepted, rejected = [[v] for v in accepted], [[v] for v in rejected]
    c, valid = build(schema), oracle(schema)
    for v in accepted:
        assert valid(v), f"test bug: {v!r} is not valid"
        assert c.accepts(dumps(v)), f"valid {dumps(v)} rejected"
    for v in rejected:
        assert not c.accepts(dumps(v)) and not c.accepts(json.dumps(v, separators=(",", ":"))), (
            f"{dumps(v)} accepted (valid per jsonschema: {valid(v)})"
        )
    assert_sound(c, valid)
    return c


def assert_sound(c, valid, n: int = 30, seed: int = 0):
    """Random walks over the automaton: every complete text must be JSON the schema accepts."""
    rng, complete = random.Random(seed), 0
    for _ in range(n):
        state, out = c.initial_state, bytearray()
        for step in range(2000):
            if c.accepting(state) and rng.random() < 0.25:
                break
            options = [
                (b, s)
                for b, tid in c._byte_ids.items()  # the terminator ends a match:
                if tid != c.terminator  # past it nothing is accepting
                and (s := c.index.get_next_state(state, tid)) is not None
            ]
            if step > 60:
                options = [o for o in options if o[0] in b'"]},0123456789el'] or options
            if not options:
                break
            b, state = rng.choice(options)
            out.append(b)
        if c.accepting(state):
            complete += 1
            text = out.decode()
            assert valid(json.loads(text)), f"automaton accepts invalid {text!r}"
    assert complete, f"none of {n} walks reached an accepting state: nothing was checked"


def refused(schema, keyword):
    with pytest.raises(UnsupportedSchemaError) as e:
        schema_to_regex(schema)
    assert e.value.keyword == keyword, str(e.value)
    return e.value


# --- references -----------------------------------------------------------------------------


def test_local_refs_and_defs(build):
    schema = {
        "$defs": {"name": {"type": "string", "maxLength": 3}},
        "definitions": {"age": {"type": "integer", "minimum": 0}},
        "type": "object",
        "properties": {"n": {"$ref": "#/$defs/name"}, "a": {"$ref": "#/definitions/age"}},
        "required": ["n", "a"],
        "additionalProperties": False,
    }
    check(
        build,
        schema,
        [{"n": "abc", "a": 3}],
        [{"n": "abcd", "a": 3}, {"n": "a", "a": -1}, {"a": 1}],
        wrap=False,
    )


def test_recursive_ref_is_bounded(build):
    tree = {
        "$defs": {
            "t": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/t",
    }
    deep = {"kids": [{"kids": [{"kids": [{"kids": [{"kids": []}]}]}]}]}
    check(build, tree, [{}, {"kids": [{"kids": []}]}], [deep, {"kids": [1]}], wrap=False)


def test_recursion_is_shallower_when_the_regex_would_be_too_big(build, monkeypatch):
    import constrained_spec.schema.limits as schema_mod

    tree = {
        "$defs": {
            "t": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/t",
    }
    sizes = {}
    for depth in (1, 3):
        monkeypatch.setattr(schema_mod, "NESTING", ((depth, 0),))
        sizes[depth] = len(schema_to_regex(tree))
    monkeypatch.setattr(schema_mod, "NESTING", ((3, 0), (2, 0), (1, 0)))
    monkeypatch.setattr(schema_mod, "MAX_REGEX_CHARS", sizes[1] + 1)
    check(build, tree, [{}, {"kids": []}], [{"kids": [{}]}], wrap=False)
    monkeypatch.setattr(schema_mod, "MAX_REGEX_CHARS", sizes[1] - 1)
    with pytest.raises(SchemaTooComplex):
        schema_to_regex(tree)
    monkeypatch.setattr(schema_mod, "MAX_REGEX_CHARS", 10**6)
    monkeypatch.setattr(schema_mod, "NESTING_BUDGET", sizes[1])  # past the budget: shallower
    assert len(schema_to_regex(tree)) == sizes[1]
    monkeypatch.setattr(schema_mod, "NESTING_BUDGET", sizes[3])
    assert len(schema_to_regex(tree)) == sizes[3]


def test_required_recursion_is_refused_by_name():
    schema = {
        "$defs": {
            "a": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}
        },
        "$ref": "#/$defs/a",
    }
    assert "recursion" in str(refused(schema, "$ref"))


def test_a_schema_without_instances_is_an_error():
    with pytest.raises(ConstraintError, match="no instance can be generated"):
        schema_to_regex({"type": "object", "required": ["a"], "properties": {"a": False}})
    # every branch is excluded by the other: an object with a and b matches both
    with pytest.raises(ConstraintError, match="no instance can be generated"):
        schema_to_regex(
            {
                "type": "object",
                "required": ["a", "b"],
                "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
            }
        )


def test_draft3_is_refused():
    refused({"$schema": "http://json-schema.org/draft-03/schema#", "type": "string"}, "$schema")


def test_remote_ref_is_refused():
    refused({"$ref": "https://example.com/schema.json"}, "$ref")


# --- combinators ----------------------------------------------------------------------------


def test_allof_merges_properties_and_required(build):
    schema = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"a": {"maximum": 5}, "b": {"type": "string"}}, "required": ["b"]},
        ]
    }
    check(
        build, schema, [{"a": 5, "b": "x"}], [{"a": 6, "b": "x"}, {"a": 1}, {"b": "x"}], wrap=False
    )


def test_allof_additional_properties_false_applies_per_member(build):
    # the first member forbids "b" although the second declares it: nothing with b is valid
    schema = {
        "allOf": [
            {"properties": {"a": {"type": "integer"}}, "additionalProperties": False},
            {"properties": {"b": {"type": "integer"}}},
        ],
        "type": "object",
    }
    check(build, schema, [{"a": 1}, {}], [{"a": 1, "b": 2}, {"b": 2}], wrap=False)


def test_anyof_and_disjoint_oneof(build):
    check(
        build,
        {"anyOf": [{"type": "integer", "maximum": 3}, {"type": "string"}]},
        [2, "x"],
        [4, None],
    )
    check(build, {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, [1, True], ["1"])


def test_overlapping_oneof_is_refused():
    refused({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf")


def test_oneof_with_const_discriminator(build):
    schema = {
        "oneOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
                "required": ["kind"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "b"}},
                "required": ["kind"],
                "additionalProperties": False,
            },
        ]
    }
    check(
        build, schema, [{"kind": "a", "x": 1}, {"kind": "b"}], [{"kind": "b", "x": 1}], wrap=False
    )


def test_overlapping_oneof_branches_exclude_each_other(build):
    """Branch i is generated with every other branch made to fail: here by leaving out the
    property the other branch requires, or by a closed object that forbids it."""
    props = {p: {"type": "string"} for p in ("name", "url", "file")}
    check(
        build,
        {
            "type": "object",
            "properties": props,
            "additionalProperties": False,
            "oneOf": [{"required": ["url"]}, {"required": ["file"]}],
        },
        [{"url": "x"}, {"name": "n", "file": "y"}],
        [{"url": "x", "file": "y"}, {}],
        wrap=False,
    )
    closed = {
        "oneOf": [
            {
                "additionalProperties": False,
                "required": ["kind", "path"],
                "properties": {"kind": {"enum": ["asset", "file"]}, "path": {"type": "string"}},
            },
            {
                "additionalProperties": False,
                "required": ["style"],
                "properties": {"style": {"type": "string"}, "family": {"type": "string"}},
            },
        ],
        "type": "object",
    }
    check(
        build,
        closed,
        [{"kind": "file", "path": "p"}, {"style": "s"}],
        [{"kind": "file", "path": "p", "style": "s"}],
        wrap=False,
    )


def test_oneof_exclusions_by_bounds_values_and_negation(build):
    check(build, {"oneOf": [{"maximum": 2}, {"maximum": 5}]}, [3, 5, 2.5], [1, 2, 6])
    check(build, {"type": "string", "oneOf": [{"maxLength": 0}, {"minLength": 1}]}, ["", "a"])
    choices = {
        "type": "object",
        "oneOf": [
            {"additionalProperties": False, "properties": {"foo": {"type": "string"}}},
            {"additionalProperties": False, "properties": {"bar": {"type": "string"}}},
        ],
    }
    check(build, choices, [{"foo": "x"}, {"bar": "y"}], [{}], wrap=False)
    kinds = {
        "type": "object",
        "oneOf": [
            {"properties": {"kind": {"enum": ["cb"]}}},
            {"properties": {"kind": {"enum": ["field", "value"]}}},
        ],
    }
    check(build, kinds, [{"kind": "cb"}, {"kind": "field"}], [{}], wrap=False)
    car = {
        "type": "object",
        "properties": {"kind": {"const": "car"}, "wheels": {"type": "integer"}},
        "oneOf": [{"not": {"required": ["kind"]}}, {"required": ["kind", "wheels"]}],
    }
    check(
        build, car, [{}, {"wheels": 1}, {"kind": "car", "wheels": 4}], [{"kind": "car"}], wrap=False
    )
    check(
        build,
        {"oneOf": [{"type": "string"}, {"enum": ["auto", "none"]}]},
        ["x", "autos"],
        ["auto", "none"],
    )
    check(
        build,
        {"type": "string", "oneOf": [{"enum": ["all", "some"]}, {"enum": ["none"]}]},
        ["all", "none"],
        ["x"],
    )
    # every string matches both branches (the first has only object keywords): none is valid
    union = {"oneOf": [{"properties": {"a": {"type": "integer"}}}, {"type": "string"}]}
    check(build, union, [{"a": 1}], ["x"], wrap=False)


def test_oneof_over_enum_candidates_is_exact(build):
    # 2 matches both branches; "x" matches only the second (minimum ignores strings)
    check(
        build, {"enum": [1, 2, "x"], "oneOf": [{"type": "integer"}, {"minimum": 2}]}, [1, "x"], [2]
    )


def test_not(build):
    check(build, {"type": ["string", "null"], "not": {"type": "null"}}, ["x"], [None])
    check(
        build,
        {
            "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
            "not": {"type": "object"},
        },
        ["x", ["y"]],
        [{}],
    )
    kinds = {
        "type": "object",
        "properties": {"kind": {"enum": ["a", "b", "c"]}},
        "required": ["kind"],
        "not": {"properties": {"kind": {"const": "b"}}},
    }
    check(build, kinds, [{"kind": "a"}, {"kind": "c"}], [{"kind": "b"}], wrap=False)
    # not (a and b): generated without a (sound, stricter than the schema)
    both = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "not": {"required": ["a", "b"]},
    }
    check(build, both, [{"b": 1}, {}], [{"a": 1, "b": 2}], wrap=False)
    check(build, {"type": "object", "properties": {"a": {"not": {}}}}, [{}], [{"a": 1}], wrap=False)
    check(build, {"not": {"anyOf": [{"type": "string"}, {"type": "object"}]}}, [1, None], ["x", {}])
    # excluded values, then a length bound from a second not: no string is generated (sound)
    check(
        build,
        {
            "anyOf": [
                {"type": "null"},
                {"type": "string", "allOf": [{"not": {"enum": ["a"]}}, {"not": {"maxLength": 3}}]},
            ]
        },
        [None],
        ["a", "b", "abcd"],
    )
    # a double negation requires its operand, combinators included
    check(build, {"type": "string", "not": {"not": {"enum": ["x", "y"]}}}, ["x", "y"], ["z"])
    check(
        build,
        {"type": "string", "not": {"not": {"anyOf": [{"pattern": "^a"}, {"pattern": "^b"}]}}},
        ["ab", "b"],
        ["c", "ca"],
    )
    names = {"type": "string", "not": {"enum": ["", "a", "ab", "x/y", "\n", 'q"']}}
    check(
        build,
        names,
        ["b", "abc", "aa", "x/", "x/yz", "q", 'q""', "\t"],
        ["", "a", "ab", "x/y", "\n", 'q"'],
    )
    c = build({"type": "array", "items": names})
    assert not c.accepts('["x\\/y"]') and not c.accepts('["\\u000a"]')  # other spellings


def test_dependencies_are_split_exactly(build):
    props = {"card": {"type": "string"}, "billing": {"type": "string"}}
    check(
        build,
        {"type": "object", "properties": props, "dependencies": {"card": ["billing"]}},
        [{}, {"billing": "b"}, {"card": "1", "billing": "b"}],
        [{"card": "1"}],
        wrap=False,
    )
    check(
        build,
        {"type": "object", "dependencies": {}, "not": {"required": ["a"]}},
        [{}],
        [{"a": 1}],
        wrap=False,
    )
    check(
        build,
        {
            "type": "object",
            "properties": {"foo": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0}},
            "dependentSchemas": {"foo": {"required": ["n"], "properties": {"n": {"minimum": 7}}}},
        },
        [{"n": 1}, {"foo": True, "n": 7}],
        [{"foo": True}, {"foo": True, "n": 1}],
        wrap=False,
    )


def test_if_then_else_is_split_exactly(build):
    schema = {
        "type": "object",
        "required": ["country"],
        "properties": {"country": {"enum": ["US", "CA"]}, "postal": {"type": "string"}},
        "if": {"properties": {"country": {"const": "US"}}},
        "then": {"required": ["postal"]},
        "else": {"properties": {"postal": {"maxLength": 3}}},
    }
    check(
        build,
        schema,
        [
            {"country": "US", "postal": "12345"},
            {"country": "CA"},
            {"country": "CA", "postal": "abc"},
        ],
        [{"country": "US"}, {"country": "CA", "postal": "abcd"}],
        wrap=False,
    )


def test_unique_items_from_an_enum(build):
    # each value at most once, in the enum's order (["b", "a"] is valid but not generated)
    check(
        build,
        {
            "type": "array",
            "items": {"enum": ["a", "b", "c", 1, 1.0]},
            "uniqueItems": True,
            "minItems": 1,
        },
        [["a"], ["a", "c"], ["a", "b", "c", 1]],
        [["a", "a"], [], ["b", "a"], [1, 1.0]],
        wrap=False,
    )


def test_missing_type_is_inferred_from_keywords(build):
    # null and [] are valid instances too, but a schema made of object keywords means an object
    check(
        build,
        {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
        [{"a": 1}],
        [None, [], "a"],
        wrap=False,
    )
    check(build, {"maxLength": 2}, ["ab"], [1, None])
    check(build, {"minimum": 2}, [2, 2.5], ["x"])
    check(build, {"description": "free"}, [1, "x", None, [1], {"a": 1}])


@pytest.mark.parametrize(
    "keyword, schema",
    [
        ("not", {"type": "string", "not": {"pattern": "^a"}}),
        ("if", {"type": "string", "if": {"pattern": "^a"}, "else": {"minLength": 2}}),
        ("contains", {"type": "array", "contains": {"type": "integer"}}),
        ("uniqueItems", {"type": "array", "uniqueItems": True}),
        ("multipleOf", {"type": "integer", "multipleOf": 3}),
        ("minProperties", {"type": "object", "required": ["a"], "minProperties": 2}),
    ],
)
def test_unsupported_keywords_are_refused_by_name(keyword, schema):
    e = refused(schema, keyword)
    assert "refuses rather than loosen" in str(e)


# --- values ---------------------------------------------------------------------------------


def test_const_and_enum_of_any_type(build):
    check(build, {"const": {"a": [1, None]}}, [{"a": [1, None]}], [{"a": [1]}, {"a": [1, 0]}])
    check(
        build,
        {"enum": ["x", 2, True, None, [1], {"k": "v"}]},
        ["x", 2, True, None, [1], {"k": "v"}],
        ["y", 3, False, [2]],
    )
    # enum values the sibling keywords reject are dropped
    check(build, {"type": "string", "enum": ["ab", "abc", 1], "maxLength": 2}, ["ab"], ["abc", 1])


def test_type_arrays_and_nullable(build):
    check(build, {"type": ["string", "null"]}, ["x", None], [1, True])
    # JSON Schema ignores the OpenAPI keyword: null stays invalid, and is never generated
    check(build, {"type": "string", "nullable": True}, ["x"], [None])


def test_string_lengths_count_code_points(build):
    check(
        build,
        {"type": "string", "minLength": 2, "maxLength": 3},
        ["ab", "abc", "Zoë", "東京"],
        ["a", "abcd", ""],
    )
    c = build({"type": "array", "items": {"type": "string", "minLength": 2}})
    assert not c.accepts('["😀"]') and c.accepts('["😀x"]')  # one code point, four bytes
    assert c.accepts('["\\u0001x"]') and not c.accepts('["\\ud83d\\ude00x"]')  # see STRING_CHAR


@pytest.mark.parametrize(
    "fmt, good, bad",
    [
        (
            "date",
            ["2024-02-29", "1999-12-31"],
            ["2023-02-29", "2024-13-01", "0000-01-01", "2024-1-01"],
        ),
        (
            "date-time",
            ["2024-02-29T23:59:59Z", "2020-01-01T00:00:00.5+01:00"],
            ["2024-02-29T24:00:00Z", "2024-02-29 10:00:00Z", "2024-02-29T10:00:00"],
        ),
        ("time", ["10:20:30Z", "23:59:59.123-05:00"], ["24:00:00Z", "10:20:30"]),
        ("email", ["a.b@example.com"], ["example.com", "a@"]),
        ("uuid", ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000"]),
        ("ipv4", ["192.168.0.1", "0.0.0.0"], ["256.1.1.1", "01.1.1.1", "1.1.1"]),
        ("uri", ["https://example.com/a/b?x=1"], ["not a uri"]),
        ("hostname", ["example.com"], ["-bad.com"]),
    ],
)
def test_formats(build, fmt, good, bad):
    check(build, {"type": "string", "format": fmt}, good, bad)


def test_unknown_formats_are_annotations_and_known_unsupported_are_refused(build):
    check(build, {"type": "string", "format": "int64"}, ["x"], [1])
    refused({"type": "string", "format": "regex"}, "format: regex")


def test_integer_bounds_are_exact(build):
    schema = {"type": "integer", "minimum": -12, "exclusiveMaximum": 105}
    c = build({"type": "array", "items": schema})
    for x in range(-200, 300):
        assert c.accepts(f"[{x}]") == (-12 <= x < 105), x


def test_number_bounds(build):
    check(
        build,
        {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
        [0.5, 10, 3],
        [0, -1, 10.5, 11],
    )
    refused({"type": "number", "minimum": 1e10}, "minimum")  # past float precision


def test_fractional_number_bounds_are_exact(build):
    check(build, {"type": "number", "minimum": 0.5}, [0.5, 0.75, 1, 12.5], [0.49, 0, -1])
    check(
        build,
        {"type": "number", "exclusiveMaximum": 2.25},
        [2.249, 2.2, -5, 0],
        [2.25, 2.2500001, 2.3, 3],
    )
    check(
        build,
        {"type": "number", "minimum": 0.25, "maximum": 0.75},
        [0.25, 0.5, 0.75],
        [0.2, 0.8, 1, 0],
    )
    check(
        build,
        {"type": "number", "minimum": -1.5, "exclusiveMaximum": -0.5},
        [-1.5, -1, -0.51],
        [-0.5, -0.4, -1.6, 0],
    )
    check(build, {"type": "number", "exclusiveMinimum": 0.1}, [0.100001, 0.2, 5], [0.1, 0.05])


def test_draft4_exclusive_minimum(build):
    schema = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "array",
        "items": {"type": "integer", "minimum": 3, "exclusiveMinimum": True},
    }
    c = build(schema)
    assert c.accepts("[4]") and not c.accepts("[3]")


def test_array_lengths_and_prefix_items(build):
    check(
        build,
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
        [[1, 2], [1, 2, 3]],
        [[1], [1, 2, 3, 4], ["a", 1]],
        wrap=False,
    )
    check(
        build,
        {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
        [["a", 1], ["a"], []],
        [["a", "b"], ["a", 1, 2]],
        wrap=False,
    )


def test_additional_properties(build):
    props = {"a": {"type": "integer"}}
    check(
        build,
        {"type": "object", "properties": props, "additionalProperties": False},
        [{"a": 1}, {}],
        [{"a": 1, "b": 2}, {"a": "x"}],
        wrap=False,
    )
    check(
        build,
        {"type": "object", "additionalProperties": {"type": "integer"}},
        [{"x": 1, "y": 2}, {}],
        [{"x": "s"}],
        wrap=False,
    )
    check(
        build,
        {"type": "object", "additionalProperties": True, "maxProperties": 1},
        [{"x": [1, "a"]}],
        [{"x": 1, "y": 2}],
        wrap=False,
    )


def test_pattern_properties_give_the_undeclared_keys(build):
    schema = {
        "type": "object",
        "minProperties": 1,
        "patternProperties": {"^x-": {"type": "integer"}},
    }
    check(
        build, schema, [{"x-a": 1}, {"x-a": 1, "x-b": 2}], [{}, {"x-a": "s"}, {"y": 1}], wrap=False
    )


def test_min_and_max_properties(build):
    three = {k: {"type": "integer"} for k in "abc"}
    check(
        build,
        {"type": "object", "properties": three, "minProperties": 1},
        [{"a": 1}, {"b": 1, "c": 2}],
        [{}],
        wrap=False,
    )
    check(
        build,
        {"type": "object", "properties": three, "required": ["b"], "minProperties": 2},
        [{"a": 1, "b": 2}, {"b": 1, "c": 1}],
        [{"b": 1}],
        wrap=False,
    )
    four = {k: {"type": "integer"} for k in "abcd"}  # a, b become required; then c or d
    check(
        build,
        {"type": "object", "properties": four, "minProperties": 3},
        [{"a": 1, "b": 1, "c": 1}, {"a": 1, "b": 1, "d": 1}],
        [{"a": 1, "b": 1}, {"b": 1, "c": 1, "d": 1}],
        wrap=False,
    )
    check(
        build,
        {"type": "object", "properties": three, "maxProperties": 1},  # only a is kept
        [{"a": 1}, {}],
        [{"a": 1, "b": 2}, {"b": 1}],
        wrap=False,
    )
    check(
        build,
        {"type": "object", "minProperties": 1, "additionalProperties": {"type": "integer"}},
        [{"x": 1}, {"x": 1, "y": 2}],
        [{}],
        wrap=False,
    )
    check(
        build,
        {"type": "object", "required": ["a"], "maxProperties": 2},
        [{"a": 1, "x": 2}, {"a": 1}],
        [{"a": 1, "x": 2, "y": 3}],
        wrap=False,
    )


def test_required_and_optional_properties(build):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}},
        "required": ["b"],
        "additionalProperties": False,
    }
    check(
        build,
        schema,
        [{"b": "x"}, {"a": 1, "b": "x"}, {"a": 1, "b": "x", "c": True}, {"b": "x", "c": False}],
        [{"a": 1}, {}, {"a": 1, "c": True}],
        wrap=False,
    )
    check(
        build,
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        [{}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2}],
        [{"a": "x"}],
        wrap=False,
    )


def test_pattern_is_unanchored_and_escaped(build):
    check(build, {"type": "string", "pattern": "a"}, ["a", "xay", 'q"a'], ["", "xyz"])
    check(
        build,
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
        ["ab", "abc"],
        ["abcd", "Ab", ""],
    )
    check(build, {"type": "string", "pattern": '^"\\d+$'}, ['"12'], ["12", '"1a', '"١'])
    check(build, {"type": "string", "pattern": "^(?:ab|cd)$"}, ["ab", "cd"], ["abcd", "a"])
    check(build, {"type": "string", "pattern": "^ab$|^cd$"}, ["ab", "cd"], ["abcd", "xab"])


def test_pattern_with_lengths_narrows_its_repeats(build):
    email = {
        "type": "string",
        "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,}$",
        "minLength": 8,
        "maxLength": 12,
    }  # repeats narrowed to 3..3, 1..3, 2..4 characters
    check(build, email, ["abc@d.ef", "abc@def.ghij"], ["abc@d.e", "abcdefgh@x.yz", "ab@cd.ef"])
    # unanchored: the string starts with the match and is padded to the lengths
    check(
        build,
        {"type": "string", "pattern": "id", "minLength": 4, "maxLength": 6},
        ["idab", "idxyzw"],
        ["id", "idabcde", "xid"],
    )
    check(
        build,
        {"type": "string", "pattern": "^a+$|^b+$", "maxLength": 2},
        ["aa", "b"],
        ["aaa", "ab", ""],
    )


@pytest.mark.parametrize(
    "pattern, feature",
    [
        ("^(?=a)a$", "lookarounds"),
        ("^(a)\\1$", "backreferences"),
        ("(?i)^a$", "flags"),
        ("^a$|b^", "anchors"),
    ],
)
def test_pattern_features_the_engine_lacks_are_refused(pattern, feature):
    e = refused({"type": "string", "pattern": pattern}, "pattern")
    assert feature in str(e)


def test_invalid_schema_names_the_pointer():
    with pytest.raises(ConstraintError, match="/properties/a/type"):
        schema_to_regex({"type": "object", "properties": {"a": {"type": "strin"}}})


# --- compile bound --------------------------------------------------------------------------


def test_compile_time_bound():
    t0 = time.time()
    with pytest.raises(SchemaTooComplex, match="longer than 0.5 s"):
        run_bounded(lambda: time.sleep(30), "sleeping", timeout_s=0.5, memory_gb=1)
    assert time.time() - t0 < 5


def test_compile_memory_bound():
    with pytest.raises(SchemaTooComplex, match="memory limit"):
        run_bounded(lambda: len(bytearray(3 * 2**30)), "allocating", timeout_s=30, memory_gb=0.5)


def test_bounded_child_returns_results_and_errors():
    assert run_bounded(lambda: [1, 2], "listing", timeout_s=10, memory_gb=1) == [1, 2]
    with pytest.raises(ZeroDivisionError):
        run_bounded(lambda: 1 / 0, "dividing", timeout_s=10, memory_gb=1)


# --- real schemas ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", SCHEMAS, ids=[p.stem[:40] for p in SCHEMAS])
def test_real_schema(build, path):
    data = json.loads(path.read_text())
    if path.stem in REFUSED:  # refusals are named and point into the schema
        e = refused(data["schema"], REFUSED[path.stem][0])
        assert e.pointer == REFUSED[path.stem][1] and "refuses rather than loosen" in str(e)
        return
    c = build(data["schema"])
    valid = oracle(data["schema"])
    for t in data["tests"]:
        text = dumps(t["data"])
        if not valid(t["data"]):
            assert not c.accepts(text), f"invalid instance accepted: {text[:200]}"
    assert_sound(c, valid, n=5)
