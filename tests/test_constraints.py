"""The constraint engine: its masks hold exactly the tokens whose bytes keep the text a prefix of
an accepted string (checked against llguidance's parser byte by byte), int states survive any
order of queries, schemas are never looser than jsonschema, grammars compile and report their
errors, and what cannot be said exactly is refused by name."""

import json
import random
from pathlib import Path

import llguidance as llg
import numpy as np
import pytest
import torch

from constrained_spec import ConstraintError, Generator, UnsupportedSchemaError, testing
from constrained_spec.constraints import FINISHED, engine, grammar_for, rewrite
from constrained_spec.constraints.vocabulary import token_vocabulary
from constrained_spec.decoding import loop
from constrained_spec.model import kernels
from constrained_spec.testing import PERSON

DRAFT4 = "http://json-schema.org/draft-04/schema#"
REGEXES = ["(ab|ba|yes|no){1,2}", "(yes|no)\\{\\}(ab|ba)", "[0-9]+(,[0-9]+)*", "Zoë|東京|(ab)*"]
ARITHMETIC = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /0|[1-9][0-9]{0,2}/
"""


def walks(constraint, n_walks: int, length: int, seed: int = 0):
    """States along random walks over legal tokens (EOS excluded), the initial state first."""
    rng = random.Random(seed)
    for _ in range(n_walks):
        state, path = constraint.initial_state, []
        for _ in range(length):
            yield state, path
            legal = [t for t in constraint.allowed(state) if t != constraint.eos_id]
            if not legal:
                break
            path = path + [rng.choice(legal)]
            state = constraint.step(state, path[-1])


def byte_oracle(grammar: str, vocab, path: list[int]) -> set[int]:
    """Legal ids after ``path``, from a fresh llguidance parser fed each token's bytes one
    single-byte token at a time (its validate path: no token trie, no mask code)."""
    byte_ids = {b[0]: i for i, b in enumerate(vocab.token_bytes) if b and len(b) == 1}
    m = llg.LLMatcher(engine._ll_tokenizer(vocab), grammar, log_level=0)
    assert m.consume_tokens(path), m.get_error()
    legal = set()
    for t, b in enumerate(vocab.token_bytes):
        if b and m.validate_tokens([byte_ids[x] for x in b]) == len(b):
            legal.add(t)
    return legal | ({vocab.eos_id} if m.is_accepting() else set())


@pytest.mark.parametrize(
    "kind, source", [("regex", r) for r in REGEXES[:2]] + [("schema", PERSON), ("lark", ARITHMETIC)]
)
def test_masks_are_exactly_the_byte_prefix_extensions(kind, source, tiny_tokenizer):
    vocab = token_vocabulary(tiny_tokenizer)
    grammar = {
        "regex": engine.regex_grammar,
        "schema": engine.schema_grammar,
        "lark": engine.lark_grammar,
    }[kind](source)
    c = engine.GuidanceConstraint(grammar, vocab, len(tiny_tokenizer) + 6, kind)
    checked = 0
    for state, path in walks(c, n_walks=10, length=12):
        assert set(c.allowed(state)) == byte_oracle(grammar, vocab, path), bytes(
            vocab.text_bytes(path)
        )
        assert c.accepts_tokens(path) == c.accepting(state)
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("width", [1, 7, 8, 13, 64, 1001])
def test_compiled_unpack_bits_reads_bit_t_of_byte_t_over_8(width):
    """csrc's unpack_bits against numpy's little-endian unpacking, every bit of random rows
    (widths not a multiple of 8 included: the last byte's bits below the width count)."""
    if missing := kernels.fused_missing():
        pytest.skip(f"the fused layers cannot be compiled here: {missing}")
    rng = random.Random(width)
    rows = [bytes(rng.randrange(256) for _ in range((width + 7) // 8)) for _ in range(3)]
    packed = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(3, -1)
    expected = np.unpackbits(packed, axis=1, count=width, bitorder="little").view(bool)
    got = kernels.fused_if_built().unpack_bits(rows, width)
    assert got.dtype == torch.bool and torch.equal(got, torch.from_numpy(expected))
    with pytest.raises(RuntimeError, match="row 0 is not a bytes object"):
        kernels.fused_if_built().unpack_bits([rows[0][:-1]], width)


@pytest.mark.parametrize("unpack", ["compiled", "numpy"])
def test_a_pass_of_masks_its_steps_and_forced_tokens_say_the_same_legal_ids(
    unpack, tiny_tokenizer, monkeypatch
):
    """A state's legal ids are kept as bits (``_legal_bits``); a pass's stacked masks (one
    conversion: csrc's unpack_bits where the fused layers are built, else numpy; loop.legal_masks),
    each state's own mask, its steps and its forced token must agree, EOS included iff
    accepting, over logits wider than the tokenizer (and not a multiple of 8 wide)."""
    if unpack == "compiled":
        if missing := kernels.fused_missing():
            pytest.skip(f"the fused layers cannot be compiled here: {missing}")
        assert kernels.fused_if_built() is not None
    else:
        monkeypatch.setattr(kernels, "fused_if_built", lambda: None)
    vocab, width = token_vocabulary(tiny_tokenizer), len(tiny_tokenizer) + 6
    assert width % 8
    grammar = engine.schema_grammar(PERSON)
    one, other = (engine.GuidanceConstraint(grammar, vocab, width, "schema") for _ in "ab")
    passes = 0
    for _, path in walks(one, n_walks=8, length=12, seed=1):
        states = [other.initial_state]  # the same path on a constraint with its own caches
        for t in path:
            states.append(other.step(states[-1], t))
        stacked = loop.legal_masks(other, states + [FINISHED], "cpu")
        assert stacked.shape == (len(states) + 1, width) and stacked.dtype == torch.bool
        assert stacked[-1].nonzero().flatten().tolist() == [vocab.eos_id]
        for state, row in zip(states, stacked):
            assert torch.equal(row, other.mask(state))
            legal = row.nonzero().flatten().tolist()
            assert [t for t in range(width) if other.step(state, t) is not None] == legal
            assert other.forced(state) == (legal[0] if len(legal) == 1 else None)
            assert row[vocab.eos_id] == other.accepting(state)
        passes += 1
    assert passes >= 40


def vocab_text(tokenizer, ids):
    return token_vocabulary(tokenizer).decode(ids)


def test_forced_bytes_leave_every_spelling_legal(tiny_tokenizer):
    """llguidance alone narrows a forced stretch to its tokenizer's spelling ("yes", not "y");
    the engine turns that off: masked sampling may spell forced text any way."""
    vocab = token_vocabulary(tiny_tokenizer)
    c = engine.GuidanceConstraint(engine.regex_grammar("yes"), vocab, len(vocab.token_bytes), "")
    legal = {vocab.token_bytes[t] for t in c.allowed(c.initial_state)}
    assert {b"y", b"yes"} <= legal
    assert c.forced_text(c.initial_state) == b"yes"
    assert c.forced(c.initial_state) is None  # two spellings: nothing is forced token-wise


@pytest.mark.parametrize("every", [1, 2, 3])
def test_states_survive_any_order_of_queries(every, tiny_tokenizer, monkeypatch):
    """Rollback lives in one place: a state's mask is the same whatever was asked before, with a
    matcher copy kept at every ``every``-th state (``_goto`` then consumes up to every - 1 more)."""
    monkeypatch.setattr(engine, "SNAPSHOT_EVERY", every)
    vocab = token_vocabulary(tiny_tokenizer)
    grammar = engine.schema_grammar(PERSON)
    fresh = lambda: engine.GuidanceConstraint(grammar, vocab, len(vocab.token_bytes), "")  # noqa: E731
    shuffled, rng = fresh(), random.Random(1)
    visits = [(s, p) for s, p in walks(shuffled, n_walks=4, length=25, seed=2)]
    shuffled.clear_caches()  # masks recomputed below, in a shuffled order: the matcher jumps
    rng.shuffle(visits)
    for state, path in visits:
        reference, ref_state = fresh(), None
        ref_state = reference.initial_state
        for t in path:
            ref_state = reference.step(ref_state, t)
        assert (shuffled.mask(state) == reference.mask(ref_state)).all()
        assert shuffled.accepting(state) == reference.accepting(ref_state)
    assert len(visits) >= 60
    state, token = visits[0][0], shuffled.allowed(visits[0][0])[0]
    if token != shuffled.eos_id:
        assert shuffled.step(state, token) == shuffled.step(state, token)  # one id per path


def test_eos_only_where_complete(tiny_tokenizer):
    vocab = token_vocabulary(tiny_tokenizer)
    c = engine.GuidanceConstraint(engine.regex_grammar("ab|abab"), vocab, 400, "")
    a, b = (vocab.ids_by_bytes[x] for x in (b"a", b"b"))
    s = c.step(c.step(c.initial_state, a), b)
    assert c.eos_id not in c.allowed(c.step(c.initial_state, a))
    assert c.accepting(s) and c.eos_id in c.allowed(s) and c.step(s, c.eos_id) == FINISHED
    assert c.mask(s).shape == (400,) and not c.mask(s)[len(vocab.token_bytes) :].any()


def test_a_special_token_named_in_a_grammar_is_never_legal():
    """llguidance lets a Lark grammar name a token by id (``<[5]>``), special ones included; the
    masks keep only ids with text (and EOS where complete), whatever the matcher allows."""
    from constrained_spec.model.models import load_tokenizer

    tokenizer = load_tokenizer()  # the default model's: 17 specials, in bitmask bytes 0-2
    vocab = token_vocabulary(tokenizer)
    grammar = engine.lark_grammar('start: "a" (<[5]> | "b")')
    c = engine.GuidanceConstraint(grammar, vocab, len(tokenizer), "grammar")
    a, b = vocab.ids_by_bytes[b"a"], vocab.ids_by_bytes[b"b"]
    matcher = c._root.deep_copy()
    assert matcher.consume_token(a) and matcher.compute_bitmask()[0] >> 5 & 1  # llguidance: yes
    after_a = c.step(c.initial_state, a)
    assert c.allowed(after_a) == [b] and c.step(after_a, 5) is None
    assert c.allowed(c.step(after_a, b)) == [c.eos_id]


@pytest.mark.parametrize("width_bytes", [6144, 6148, 6140])  # as wide as V, llguidance's, short
def test_a_bitmask_row_kept_as_llguidance_gave_it_equals_the_cleared_one(width_bytes):
    """``_ours`` keeps llguidance's row where it needs no change (no skipped pass over it): on
    rows with and without special ids, EOS right or wrong, a tail past V or none, the result is
    the row with only text ids (and EOS iff accepting), V bits wide."""
    from constrained_spec.model.models import load_tokenizer

    tokenizer = load_tokenizer()
    vocab = token_vocabulary(tokenizer)
    c = engine.GuidanceConstraint(engine.regex_grammar("a+"), vocab, len(tokenizer), "regex")
    rng, clean = random.Random(0), 0
    for _ in range(200):
        raw = bytearray(rng.randbytes(width_bytes))
        accepting = rng.random() < 0.5
        if rng.random() < 0.7:  # a clean row, as schemas and regexes give: specials and tail off
            raw[0:3] = bytes(3)
            raw[c.eos_id // 8] |= accepting << c.eos_id % 8
            raw[c._width :] = bytes(max(0, width_bytes - c._width))
            clean += 1
        row = bytes(raw)
        expected = (int.from_bytes(row, "little") & c._plain_bits) | accepting << c.eos_id
        got = c._ours(row, accepting)
        assert got == expected.to_bytes(c._width, "little")
        if width_bytes == c._width and got == row:
            assert got is row  # a clean row of V bits is the row itself
    assert clean > 100


def test_lark_grammar_generates_parsable_text(tiny_target, tiny_tokenizer):
    gen = Generator(tiny_target, tiny_tokenizer)
    stopped = 0
    for seed in range(4):
        res = gen.generate("hello", grammar=ARITHMETIC, temperature=1.0, seed=seed)
        if res.finish_reason == "stop":
            stopped += 1
            assert gen.compile(grammar=ARITHMETIC).accepts(res.text)
            eval(res.text, {"__builtins__": {}})  # an arithmetic expression Python parses too
    assert stopped >= 2


def test_gbnf_grammar_is_converted(tiny_target, tiny_tokenizer):
    gbnf = 'root ::= "yes" | "no" ws\nws ::= [ ]?\n'
    c = Generator(tiny_target, tiny_tokenizer).compile(grammar=gbnf)
    assert c.accepts("yes") and c.accepts("no ") and not c.accepts("maybe")


@pytest.mark.parametrize(
    "text, where",
    [
        ('start: x\nx: "a" x | "b" (\n', "line 2, column"),
        ("start: x\n\nx: /[a-/\n", "line 3, column"),
        ('root ::= "a" |\nws ::= [ \n', "line 2"),
    ],
)
def test_grammar_syntax_errors_name_line_and_column(text, where, tiny_target, tiny_tokenizer):
    gen = Generator(tiny_target, tiny_tokenizer)
    with pytest.raises(ConstraintError, match=where):
        gen.compile(grammar=text)


@pytest.mark.parametrize(
    "schema, accepted, rejected",
    [  # llguidance alone accepts the rejected texts (jsonschema does not): no longer
        (
            {"type": "string", "format": "date-time"},
            ['"2024-02-29T23:59:59Z"', '"1999-12-31T00:00:00.5+01:00"'],
            ['"2024-02-29T23:59:60Z"', '"2024-02-30T00:00:00Z"'],
        ),
        ({"type": "string", "format": "time"}, ['"23:59:59Z"'], ['"23:59:60Z"']),
        # llguidance's own date takes February 29 of any year (found by the coverage run's walks)
        ({"type": "string", "format": "date"}, ['"2024-02-29"'], ['"2023-02-29"', '"9382-02-29"']),
        ({"type": "string", "format": "topic"}, ['"anything"'], ["1"]),  # an annotation
        ({"enum": [{"format": "date-time"}]}, ['{"format":"date-time"}'], ['{"format":"x"}']),
        # regexes in llguidance's syntax with Python's meaning: its negated classes let `"` and
        # `\` through, a set of all 32 controls any escape, its \s lacks \x1c-\x1f, its \w is
        # ASCII, [[:alpha:]] is a POSIX class there (a set of 6 characters and a `]` in Python)
        ({"type": "string", "pattern": '^[^"]*$'}, ['"a b"', '"\\n"', '"\\\\"'], ['"a\\"b"']),
        ({"type": "string", "pattern": "^[^\\\\]+$"}, ['"a\\"b"'], ['"a\\\\b"']),
        ({"type": "string", "pattern": "^\\S+$"}, ['"ab"', '"é"'], ['"a\\u001c"', '"a b"']),
        ({"type": "string", "pattern": "^\\W+$"}, ['"!?"'], ['"é"', '"a"']),
        ({"type": "string", "pattern": "^[[:alpha:]]$"}, ['":]"', '"h]"'], ['"b"', '"h"']),
        (
            {"type": "object", "patternProperties": {'^[^"]+$': {}}, "additionalProperties": False},
            ['{"a":1}'],
            ['{"a\\"b":1}'],
        ),
        # exclusive bounds: llguidance compares exact decimals, jsonschema the parsed float
        ({"type": "number", "exclusiveMinimum": 0}, ["0.5", "1"], ["0", "0." + "0" * 400 + "1"]),
        ({"type": "number", "exclusiveMaximum": -2}, ["-3", "-2.01"], ["-2.0000000000000001"]),
        (
            {"$schema": DRAFT4, "type": "number", "minimum": 0, "exclusiveMinimum": True},
            ["0.5"],
            ["0", "1e-400", "0." + "0" * 400 + "1"],
        ),
        ({"type": "integer", "exclusiveMinimum": 0}, ["1"], ["0"]),  # integers stay exact
        # bounds moved inward to what llguidance reads exactly
        ({"type": "number", "minimum": -1.9999999999999998}, ["-1.5"], ["-2"]),
        ({"type": "integer", "maximum": 2**63}, ["9007199254740991"], [str(2**63 + 1)]),
    ],
)
def test_llguidance_is_never_looser_than_jsonschema(
    schema, accepted, rejected, tiny_target, tiny_tokenizer
):
    c = Generator(tiny_target, tiny_tokenizer).compile(schema=schema)
    assert isinstance(c, engine.GuidanceConstraint)
    assert [t for t in accepted if not c.accepts(t)] == []
    assert [t for t in rejected if c.accepts(t)] == []


@pytest.mark.parametrize(
    "schema, keyword",
    [  # llguidance reads bounds as floats, rounded
        ({"type": "integer", "minimum": 2**63}, "minimum"),  # no integer inside it is exact
        ({"type": "number", "maximum": 2**63}, "maximum"),  # nor a number with fractions
        ({"type": "string", "pattern": "(?<=a)b"}, "pattern"),  # lookarounds, backreferences
        ({"type": "string", "pattern": "(?i)abc"}, "pattern"),  # Python's case folding
        ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ],
)
def test_what_llguidance_cannot_be_told_exactly_is_refused_by_name(schema, keyword):
    with pytest.raises(UnsupportedSchemaError, match=keyword):
        engine.schema_grammar(schema)


def test_a_refusal_names_the_place_of_the_keyword():
    schema = {"properties": {"a/b": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}
    with pytest.raises(UnsupportedSchemaError, match="'oneOf' at /properties/a~1b:") as e:
        engine.schema_grammar(schema)
    assert e.value.pointer == "/properties/a~1b" and "docs/schemas.md" in str(e.value)


def test_fractional_multiple_of_is_refused_by_name(tiny_target, tiny_tokenizer):
    """llguidance checks multipleOf in exact decimals, jsonschema in floats: "8.62" is no
    multiple of 0.01 for jsonschema. Refused by name."""
    gen = Generator(tiny_target, tiny_tokenizer)
    with pytest.raises(UnsupportedSchemaError, match="multipleOf"):
        gen.compile(schema={"type": "number", "multipleOf": 0.01})


def test_objects_with_declared_properties_get_no_undeclared_ones(tiny_tokenizer):
    """Closed where that only narrows; not under allOf, where closing one branch would reject
    what another admits."""
    vocab = token_vocabulary(tiny_tokenizer)
    compiled = lambda s: engine.GuidanceConstraint(engine.schema_grammar(s), vocab, 400, "")  # noqa: E731
    person, extra = '{"name":"a","age":1,"ok":true}', '{"name":"a","age":1,"ok":true,"x":1}'
    assert compiled(PERSON).accepts(person) and not compiled(PERSON).accepts(extra)
    assert compiled({"allOf": [PERSON]}).accepts(extra)
    # under oneOf, closing a branch would let through what two branches accept (and oneOf not)
    either = {  # from the dev set (Github_trivial---o19070)
        "type": "object",
        "oneOf": [
            {"required": ["id", "win"], "properties": {"id": {"type": "string"}, "h": {}}},
            {"required": ["id", "lose"], "properties": {"id": {"type": "string"}, "lose": {}}},
        ],
    }
    # said as "one branch and not the other" (an allOf: not closed), never closed: closed, the
    # branches looked disjoint, and {"id","win","lose"} got through
    assert compiled(either).accepts('{"id":"a","win":1,"x":2}')
    assert not compiled(either).accepts('{"id":"a","win":1,"lose":2}')
    assert compiled(PERSON | {"additionalProperties": True}).accepts(extra)
    assert compiled({"type": "object"}).accepts('{"x":1}')  # none declared: free-form


def test_open_objects_have_undeclared_properties_where_the_schema_allows(
    tiny_target, tiny_tokenizer
):
    person, extra = '{"name":"a","age":1,"ok":true}', '{"name":"a","age":1,"ok":true,"x":1}'
    closed, opened = (
        Generator(tiny_target, tiny_tokenizer, open_objects=o).compile(schema=s)
        for o, s in ((False, PERSON), (True, PERSON))
    )
    assert closed.accepts(person) and not closed.accepts(extra)
    assert opened.accepts(person) and opened.accepts(extra)
    shut = Generator(tiny_target, tiny_tokenizer, open_objects=True)
    assert not shut.compile(schema=PERSON | {"additionalProperties": False}).accepts(extra)


KIND_A = {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}}
KIND_B = {"type": "object", "properties": {"kind": {"enum": ["b", "c"]}, "y": {"type": "string"}}}


@pytest.mark.parametrize(
    "schema, accepted, rejected",
    [
        (  # disjoint types
            {"oneOf": [{"type": "string", "maxLength": 2}, {"type": ["integer", "null"]}]},
            ['"ab"', "7", "null"],
            ['"abc"', "7.5", "true"],
        ),
        (  # a discriminator every branch requires, disjoint values
            {"oneOf": [KIND_A | {"required": ["kind"]}, KIND_B | {"required": ["kind", "y"]}]},
            ['{"kind":"a","x":1}', '{"kind":"c","y":"q"}', '{"kind":"a"}'],
            ['{"kind":"b"}', '{"kind":"d","x":1}', '"a"', '{"kind":"a","x":"1"}'],
        ),
        (  # through a local $ref (Github_easy---o25419: a JSON-RPC call or a batch of them)
            {
                "oneOf": [{"$ref": "#/definitions/call"}, {"type": "array", "minItems": 1}],
                "definitions": {"call": {"type": "object", "required": ["id"]}},
            },
            ['{"id":1}', '[{"id":1}]'],
            ["[]", "{}", '"x"'],
        ),
        (  # 2019-09's dependentRequired and dependentSchemas
            {
                "type": "object",
                "dependentRequired": {"card": ["addr"]},
                "dependentSchemas": {"addr": {"required": ["zip"]}},
            },
            ["{}", '{"addr":1,"zip":2}', '{"card":0,"addr":1,"zip":2}'],
            ['{"card":0}', '{"addr":1}', '{"card":0,"addr":1}'],
        ),
        (  # dependencies: a list of names, and a schema
            {
                "type": "object",
                "properties": {"card": {"type": "string"}, "addr": {"type": "string"}},
                "dependencies": {
                    "card": ["addr"],
                    "addr": {"required": ["zip"], "properties": {"zip": {"type": "integer"}}},
                },
            },
            ["{}", '{"addr":"a","zip":1}', '{"card":"c","addr":"a","zip":1}'],
            ['{"card":"c"}', '{"addr":"a"}', '{"addr":"a","zip":"1"}', "1"],
        ),
        (  # properties named like keywords are names
            {
                "type": "object",
                "properties": {
                    "dependencies": {"required": ["x"], "properties": {"x": {"type": "string"}}},
                    "oneOf": {"type": "array", "items": {"type": "integer"}},
                },
            },
            ['{"dependencies":{"x":"a"},"oneOf":[1]}'],
            ['{"dependencies":{}}', '{"dependencies":{"x":1}}', '{"oneOf":["a"]}'],
        ),
        (  # not required: an object missing one of them (`required` holds on a number)
            {"properties": {"a": {"type": "integer"}}, "not": {"required": ["a", "b"]}},
            ["{}", '{"a":1}', '{"b":2}'],
            ['{"a":1,"b":2}', "1", '{"a":"x"}'],
        ),
        (  # not type: the other types (integers are numbers)
            {"not": {"type": ["string", "null"]}},
            ["1", "1.5", "true", "[]", "{}"],
            ['"a"', "null"],
        ),
        (  # double and triple negations, and not {} (nothing)
            {
                "type": "object",
                "properties": {
                    "two": {"not": {"not": {"type": "string", "maxLength": 2}}},
                    "three": {"not": {"not": {"not": {"type": "string"}}}},
                    "none": {"not": {"description": "anything"}},
                },
            },
            ['{"two":"ab","three":1}', "{}"],
            ['{"two":"abc"}', '{"two":1}', '{"three":"a"}', '{"none":1}'],
        ),
        (  # through local $refs, and true is no 1
            {
                "type": "object",
                "oneOf": [{"$ref": "#/$defs/one"}, {"$ref": "#/$defs/yes"}],
                "$defs": {
                    "one": {"required": ["v"], "properties": {"v": {"const": 1}}},
                    "yes": {"required": ["v"], "properties": {"v": {"const": True}}},
                },
            },
            ['{"v":1}', '{"v":true}'],
            ['{"v":2}', '{"v":false}', "1"],
        ),
        (  # not enum under a known type: a string none of them (a walk off their trie)
            {"type": "string", "not": {"enum": ["a", "ab"]}},
            ['""', '"b"', '"abc"', '"a\\n"', '"\\""', '"aab"'],
            ['"a"', '"ab"', "1"],
        ),
        ({"type": "integer", "not": {"const": 6379}}, ["6378", "6380", "0"], ["6379"]),
        (  # not enum of any type: the other types, numbers between the values (1 == 1.0)
            {"not": {"enum": [1, "x", None, True]}},
            ["2", "1.5", "-7", '"y"', "false", "[]", "{}"],
            ["1", "1.0", '"x"', "null", "true"],
        ),
        ({"not": {"enum": [0, 1]}}, ["true", "false", "0.5"], ["0", "1"]),  # true is no 1
        (  # exactly one of these keys
            {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
            ['{"a":1}', '{"b":1}', '{"a":1,"c":2}'],
            ['{"a":1,"b":2}', "{}", "1"],
        ),
        (  # overlapping branches: one and not the other, through $refs
            {
                "oneOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}],
                "$defs": {
                    "a": {"type": "object", "required": ["a"]},
                    "b": {
                        "type": "object",
                        "required": ["b"],
                        "properties": {"b": {"type": "string"}},
                    },
                },
            },
            ['{"a":1}', '{"b":"x"}', '{"b":2,"a":1}'],  # (llguidance's property order)
            ['{"a":1,"b":"x"}', "{}", '"a"'],
        ),
        (  # no type object: a non-object satisfies both branches' `required`
            {
                "oneOf": [
                    {"required": ["k"], "properties": {"k": {"const": 1}}},
                    {"required": ["k"], "properties": {"k": {"const": 2}}},
                ]
            },
            ['{"k":1}', '{"k":2}'],
            ['"a"', "1", '{"k":3}', "{}"],
        ),
        (  # 1 and 1.0 are one JSON number: both branches take it
            {
                "type": "object",
                "oneOf": [
                    {"required": ["k"], "properties": {"k": {"const": 1}}},
                    {"required": ["k"], "properties": {"k": {"enum": [1.0, 2]}}},
                ],
            },
            ['{"k":2}'],
            ['{"k":1}', '{"k":1.0}', '{"k":3}'],
        ),
        ({"oneOf": [{"type": "string"}, {}]}, ["1", "null", "{}"], ['"a"']),  # {} takes all
        (  # a closed object admits no y: disjoint from what requires y (open: not)
            {
                "oneOf": [
                    {"type": "object", "properties": {"x": {}}, "additionalProperties": False},
                    {"type": "object", "required": ["y"]},
                ]
            },
            ['{"x":1}', "{}", '{"y":1}', '{"y":1,"x":1}'],  # required ones first
            ["1"],
        ),
        (
            {
                "oneOf": [
                    {"type": "object", "properties": {"x": {}}},
                    {"type": "object", "required": ["y"]},
                ]
            },
            ['{"x":1}', "{}"],
            ['{"y":1}', '{"y":1,"x":1}'],
        ),
        (  # if/then/else: (if and then) or (not if and else)
            {
                "if": {"properties": {"kind": {"const": "a"}}},
                "then": {"required": ["x"]},
                "else": {"required": ["y"]},
            },
            ['{"kind":"a","x":1}', '{"kind":"b","y":1}', '{"x":1}', '"s"'],
            ['{"kind":"a","y":1}', '{"kind":"b","x":1}', "{}"],
        ),
        (  # not properties, bounds, sizes
            {"not": {"type": "object", "properties": {"a": {"type": "string", "minLength": 2}}}},
            ["1", '{"a":"x"}', '{"a":1}'],
            ["{}", '{"a":"xy"}', '{"b":1}'],
        ),
        ({"type": "number", "not": {"minimum": 2}}, ["1.5", "-3"], ["2", "2.5"]),
        ({"type": "array", "not": {"maxItems": 1}}, ["[1,2]"], ["[]", "[1]"]),
        (  # not (if C then T else E) = (C and not T) or (not C and not E), E here true
            {"not": {"if": {"pattern": "^a"}, "then": {"minLength": 3}}},
            ['"a"', '"ab"'],
            ['"abc"', '"b"', "1"],
        ),
        (  # no else: (if and then) or not if
            {
                "if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
                "then": {"required": ["b"]},
            },
            ['{"a":2}', "{}", '{"a":1,"b":1}'],
            ['{"a":1}'],
        ),
        ({"oneOf": [{"enum": ["a", "b"]}, {"enum": ["b", "c"]}]}, ['"a"', '"c"'], ['"b"', '"d"']),
        (  # draft 4 has no const: the first branch takes everything
            {"$schema": DRAFT4, "oneOf": [{"const": "a"}, {"type": "number"}]},
            ['"x"', "null"],
            ["1"],
        ),
        ({"type": "string", "not": {"not": {"pattern": "^a"}}}, ['"ab"'], ['"b"']),  # not not
        (  # a branch negated partly (no "an item is not a string"): a subset, the ways said
            {
                "type": "object",
                "oneOf": [
                    {"required": ["ref"], "properties": {"ref": {"type": "string"}}},
                    {
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string"},
                            "urls": {"type": "array", "items": {"type": "string"}},
                        },
                    },
                ],
            },
            ['{"ref":"a"}', '{"name":"n"}', '{"name":"n","urls":["u"]}', '{"ref":"a","name":1}'],
            ['{"ref":"a","name":"n"}', "{}", '{"ref":"a","name":"n","urls":[1]}'],  # last: valid
        ),
        (  # a discriminator the node around the branches requires
            {
                "type": "object",
                "required": ["t"],
                "oneOf": [
                    {"properties": {"t": {"const": "a"}}},
                    {"properties": {"t": {"const": "b"}}},
                ],
            },
            ['{"t":"a"}', '{"t":"b"}'],
            ["{}", '{"t":"c"}'],
        ),
        (  # not required anywhere: {} satisfies both branches
            {
                "type": "object",
                "oneOf": [
                    {"properties": {"t": {"const": "a"}}},
                    {"properties": {"t": {"const": "b"}}},
                ],
            },
            ['{"t":"a"}', '{"t":"b"}'],
            ["{}", '{"x":1}', '{"t":"c"}'],
        ),
        (  # draft 7: beside a $ref, jsonschema reads nothing (so neither does the negation)
            {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "not": {"$ref": "#/definitions/s", "type": "number"},
                "definitions": {"s": {"type": "string"}},
            },
            ["1", "null"],
            ['"a"'],
        ),
    ],
)
def test_oneof_dependencies_and_not_compile_in_llguidance_terms(
    schema, accepted, rejected, tiny_target, tiny_tokenizer
):
    """Exclusive branches: oneOf and anyOf accept the same instances, and llguidance implements
    anyOf (in milliseconds; llguidance proves some of these itself, not through a $ref nor every discriminator). `dependencies` as
    "absent, or present with what it needs"; simple negations said positively."""
    c = Generator(tiny_target, tiny_tokenizer).compile(schema=schema)
    assert [t for t in accepted if not c.accepts(t)] == []
    assert [t for t in rejected if c.accepts(t)] == []


@pytest.mark.parametrize(
    "schema",
    [
        {"oneOf": [{"type": "integer"}, {"type": "number"}]},  # 3 is both: needs "not integer"
        {"not": {"type": "integer"}},  # 1.5 and "a": no type says "a fractional number"
        {"oneOf": [{"pattern": "a"}, {"pattern": "b"}]},  # no negated patterns
        {"not": {"multipleOf": 3}},
        {  # the partly negated oneOf above, negated: it is narrower, so never negated again
            "not": {
                "oneOf": [
                    {"required": ["a"]},
                    {"required": ["b"], "properties": {"b": {"items": {"type": "string"}}}},
                ]
            }
        },
        {  # 2020-12 does not know `dependencies`: said (narrower), never negated
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "not": {"dependencies": {"a": ["b"]}},
        },
    ],
)
def test_what_is_not_said_exactly_stays_refused_by_name(schema):
    with pytest.raises(UnsupportedSchemaError, match="oneOf|not"):
        engine.schema_grammar(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"$schema": DRAFT4, "not": {"const": 1}},  # draft 4 has no const: not {} (nothing)
        {  # [1] and [1.0] are one JSON array: every object with k satisfies both branches
            "type": "object",
            "oneOf": [
                {"required": ["k"], "properties": {"k": {"const": [1]}}},
                {"required": ["k"], "properties": {"k": {"const": [1.0]}}},
            ],
        },
        {  # nor const discriminators: both branches take every object with k
            "$schema": DRAFT4,
            "type": "object",
            "oneOf": [
                {"required": ["k"], "properties": {"k": {"const": 1}}},
                {"required": ["k"], "properties": {"k": {"const": 2}}},
            ],
        },
    ],
)
def test_schemas_nothing_satisfies_are_named_so(schema):
    with pytest.raises(ConstraintError, match="[Uu]nsatisfiable"):
        engine.schema_grammar(schema)


def test_a_keyword_not_negated_here_is_never_taken_as_vacuous():
    """(Under a negation, ignoring a keyword narrows; negating that again would loosen.)"""
    doc = rewrite._Document.of({})
    for kept in ({"oneOf": [{"pattern": "a"}, {"pattern": "b"}]}, {"$dynamicRef": "#x"}):
        assert rewrite._negated(kept, doc) is None
    assert rewrite._negated({"pattern": "a"}, doc, frozenset({"number"})) is False


def test_negations_that_would_grow_the_schema_past_the_bound_are_left_out(monkeypatch):
    """Each branch negated in each other's option: six branches of 30 properties grow ~6-fold
    (llguidance took minutes on a schema grown 13-fold). Left out, oneOf is refused by name."""
    fields = {f"p{i}": {"type": "string", "minLength": 2} for i in range(30)}
    schema = {
        "type": "object",
        "oneOf": [{"required": [f"r{k}"], "properties": fields} for k in range(6)],
    }
    with pytest.raises(UnsupportedSchemaError, match="oneOf"):
        engine.schema_grammar(schema)
    monkeypatch.setattr(rewrite, "MAX_GROWTH", 100)
    assert "oneOf" not in rewrite._in_llguidance_terms(schema)  # (llguidance: too large)


def test_local_refs_are_not_followed_below_a_nested_id():
    """A nested $id may move the base URI a "#/..." $ref resolves against."""
    schema = {
        "oneOf": [{"$ref": "#/definitions/call"}, {"type": "array"}],
        "definitions": {"call": {"type": "object"}},
    }
    moved = schema | {"properties": {"p": {"$id": "http://example.com/p"}}}
    named = schema | {"properties": {"$id": {"type": "string"}}}  # a property named $id
    for doc, follows in ((schema, True), (moved, False), (named, True)):
        rewritten = rewrite._in_llguidance_terms(doc)
        assert ("anyOf" in rewritten) == follows, doc


@pytest.mark.real_model
@pytest.mark.parametrize("every", [1, 2, 3])
def test_masks_after_rollbacks_equal_a_fresh_matchers(every, monkeypatch):
    """The masks a request sequence asked for (a baseline request, then a speculative one over
    the same schema, with lookup drafts rejected), replayed on the default model's vocabulary:
    each equals a fresh llguidance matcher's on the same path. With llguidance's own rollback
    (before the snapshots in engine._goto), the mask after `..."string"}` allowed `}}`, which
    closes an object whose required property is missing, and the next round crashed."""
    import json
    from pathlib import Path

    import numpy as np

    from constrained_spec.model.models import load_tokenizer

    monkeypatch.setattr(engine, "SNAPSHOT_EVERY", every)
    case = json.loads((Path(__file__).parent / "data" / "llg_rollback_case.json").read_text())
    tokenizer = load_tokenizer()
    vocab = token_vocabulary(tokenizer)
    c = engine.GuidanceConstraint(case["grammar"], vocab, len(tokenizer), "schema")
    n, path = len(vocab.token_bytes), []
    for drop, add in case["masks_at"]:
        del path[len(path) - drop :]
        path += add
        state = c.initial_state
        for token in path:
            state = c.step(state, token)
            assert state is not None, "the recorded path left the grammar"
        fresh = llg.LLMatcher(engine._ll_tokenizer(vocab), case["grammar"], log_level=0)
        assert fresh.consume_tokens(path)
        bits = np.frombuffer(fresh.compute_bitmask(), dtype=np.uint8)
        expected = np.unpackbits(bits, bitorder="little")[:n].astype(bool) & c._plain
        got = c.mask(state).numpy()[:n].copy()
        expected[vocab.eos_id] = got[vocab.eos_id] = False  # EOS: accepting(), checked elsewhere
        wrong = np.flatnonzero(got != expected)
        assert not len(wrong), f"at {vocab.decode(path)!r}: {[vocab.decode([t]) for t in wrong]}"


@pytest.mark.parametrize(
    "schema, error, words",
    [
        (
            {"type": "object", "properties": {"a": {"type": "strin"}}},
            ConstraintError,
            "/properties/a/type",
        ),
        (
            {"$schema": "http://json-schema.org/draft-03/schema#"},
            UnsupportedSchemaError,
            "draft-03",
        ),
        ({"$ref": "https://example.com/s.json"}, UnsupportedSchemaError, "never fetched"),
    ],
)
def test_schemas_are_checked_before_they_are_compiled(schema, error, words):
    """Invalid under the meta-schema (named by pointer), draft-03, a reference outside the
    document: refused by the front door, before llguidance sees them."""
    with pytest.raises(error, match=words):
        grammar_for(schema=schema)


@pytest.mark.parametrize(
    "schema, accepted, rejected",
    [
        (
            {"properties": {"a": {}, "b": {}}, "minProperties": 2},
            ['{"a":1,"b":2}'],
            ["{}", '{"a":1}', '{"b":2}'],
        ),
        (
            {"properties": {"a": {}, "b": {}, "c": {}}, "required": ["a"], "maxProperties": 2},
            ['{"a":1}', '{"a":1,"b":2}', '{"a":1,"c":3}'],
            ['{"a":1,"b":2,"c":3}', '{"b":2}'],
        ),
        (
            {"properties": {"a": {}, "b": {}, "c": {}}, "minProperties": 1, "maxProperties": 1},
            ['{"a":1}', '{"c":3}'],
            ["{}", '{"a":1,"b":2}'],
        ),
    ],
)
def test_property_counts_of_closed_objects_are_exact(schema, accepted, rejected, tiny_tokenizer):
    """llguidance takes min/maxProperties only where every property is required; on a closed
    object they are said as which optional properties are present (rewrite._property_counts)."""
    c = engine.compile_constraint(token_vocabulary(tiny_tokenizer), 400, schema=schema)
    assert [t for t in accepted if not c.accepts(t)] == []
    assert [t for t in rejected if c.accepts(t)] == []


def test_a_property_count_where_undeclared_keys_may_repeat_is_refused(tiny_tokenizer):
    """llguidance counts a repeated undeclared key toward minProperties ({"a":1,"a":2} is one
    property once parsed): refused by name on open objects where it asks for more than the
    required properties + 1 (one undeclared key, repeated or not, is one more); closed objects
    are said exactly (above)."""
    with pytest.raises(UnsupportedSchemaError, match="minProperties.*repeated"):
        grammar_for(schema={"type": "object", "minProperties": 2})
    c = engine.compile_constraint(
        token_vocabulary(tiny_tokenizer), 400, schema={"minProperties": 1}
    )
    assert c.accepts('{"a":1,"a":2}') and not c.accepts("{}")  # one property, parsed: valid
    c = engine.compile_constraint(  # a maximum alone only narrows: kept as it is
        token_vocabulary(tiny_tokenizer), 400, schema={"type": "object", "maxProperties": 1}
    )
    assert c.accepts('{"a":1}') and not c.accepts('{"a":1,"b":2}')
    with pytest.raises(UnsupportedSchemaError, match="minProperties"):
        grammar_for(schema={"patternProperties": {"^a": {}}, "minProperties": 2})
    grammar_for(  # two required properties: two keys at least, whatever else comes
        schema={
            "properties": {"a": {}, "b": {}},
            "required": ["a", "b"],
            "additionalProperties": True,
            "minProperties": 2,
        }
    )


REAL = sorted((Path(__file__).parent / "data" / "schemas").glob("*.json"))


@pytest.mark.parametrize("path", REAL, ids=[p.stem[:40] for p in REAL])
def test_real_schemas_compile_or_are_refused_by_name_and_accept_only_valid_texts(
    path, tiny_tokenizer
):
    """Dev-set schemas (tests/data/schemas): each compiles, or is refused naming the keyword
    and where it is (or llguidance's limit); compiled, no invalid instance is accepted (as the tokenizer would spell it,
    and byte by byte) and random texts of the automaton validate."""
    data = json.loads(path.read_text())
    valid = testing.schema_validator(data["schema"]).is_valid
    vocab = token_vocabulary(tiny_tokenizer)
    try:
        c = engine.compile_constraint(vocab, len(tiny_tokenizer) + 6, schema=data["schema"])
    except UnsupportedSchemaError as e:
        assert e.keyword and "refuses rather than loosen" in str(e)
        return
    except ConstraintError as e:  # llguidance's own limits: a documented error, said plainly
        assert str(e).startswith("cannot compile the schema: ")
        return
    for t in data["tests"]:
        text = json.dumps(t["data"], separators=(",", ":"), ensure_ascii=False)
        if not valid(t["data"]):
            ids = tiny_tokenizer.encode(text, add_special_tokens=False)
            assert not c.accepts(text) and not c.accepts_tokens(ids), text[:200]
    rng = random.Random(0)
    texts = [testing.random_text(c, rng) for _ in range(5)]
    assert testing.accepted_but_invalid(c, data["schema"], texts) == []


def test_closing_reads_property_names_as_names(tiny_tokenizer):
    """A property named like a keyword ("default", "properties") is a property: its own schema is
    closed like any other, and no phantom property is declared beside it."""
    vocab = token_vocabulary(tiny_tokenizer)
    schema = {
        "properties": {"default": {"properties": {"a": {}}}, "properties": {"type": "integer"}}
    }
    c = engine.compile_constraint(vocab, 400, schema=schema)
    assert c.accepts('{"default":{"a":1},"properties":2}')
    assert not c.accepts('{"default":{"a":1,"x":2}}')
    assert "additionalProperties" not in rewrite.for_llguidance(schema)["properties"]
