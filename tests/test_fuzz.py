"""Fuzzing the schema compiler, short enough for CI: random schemas and mutated dev schemas
either compile or raise a documented error (ConstraintError and its subclasses), and every text
the automaton accepts validates with jsonschema. The long run with its numbers is
benchmarks/coverage.py fuzz (docs/hardening.md)."""

import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException
from hypothesis_jsonschema import from_schema

from constrained_spec import testing
from constrained_spec.constraints import compile_constraint, token_vocabulary

SAMPLE = sorted((Path(__file__).resolve().parent.parent / "benchmarks/data/sample").glob("*.json"))
FUZZ = settings(
    max_examples=100,  # milliseconds a compile: many cases fit in seconds
    deadline=None,  # a compile takes milliseconds, far more on a loaded machine
    database=None,
    derandomize=True,  # the same cases on every CI run; benchmarks/coverage.py fuzz explores further
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,  # many random schemas are refused: that is a pass
    ],
)


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer):
    vocab = token_vocabulary(tiny_tokenizer)
    return lambda schema: _compile(schema, vocab, len(tiny_tokenizer))


def _compile(schema, vocab, vocab_size):
    """The constraint, or None after a documented error; anything else propagates."""
    try:
        return compile_constraint(vocab, vocab_size, schema=schema)
    except testing.SCHEMA_ERRORS:
        return None


def dev_schema(path: Path) -> dict:
    return json.loads(path.read_text())["schema"]


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), mutated=st.booleans())
def test_a_schema_compiles_or_raises_a_documented_error_and_accepts_only_valid_texts(
    compiler, seed, mutated
):
    rng = random.Random(seed)
    schema = (
        testing.mutate_schema(dev_schema(rng.choice(SAMPLE)), rng)
        if mutated
        else testing.random_schema(rng)
    )
    constraint = compiler(schema)
    assume(constraint is not None)
    texts = [testing.random_text(constraint, rng) for _ in range(6)]
    assume(any(texts))
    assert testing.accepted_but_invalid(constraint, schema, texts) == []


@FUZZ
@given(data=st.data())
def test_instances_of_the_original_accepted_by_a_mutant_are_valid_for_it(compiler, data):
    original = dev_schema(data.draw(st.sampled_from(SAMPLE)))
    mutant = testing.mutate_schema(original, random.Random(data.draw(st.integers(0, 2**32 - 1))))
    constraint = compiler(mutant)
    assume(constraint is not None)
    try:
        instance = data.draw(from_schema(original))
    except HypothesisException:  # a schema hypothesis-jsonschema cannot generate for
        assume(False)
    text = json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
    assert testing.accepted_but_invalid(constraint, mutant, [text]) == []


def test_the_soundness_check_sees_an_unsound_automaton(tiny_tokenizer):
    """A regex wider than its schema: accepted_but_invalid names the texts it lets in."""
    vocab = token_vocabulary(tiny_tokenizer)
    loose = compile_constraint(vocab, len(tiny_tokenizer), regex='"[a-z]{0,4}"')
    schema = {"type": "string", "minLength": 2}
    texts = ['""', '"a"', '"ab"', "not accepted"]
    assert testing.accepted_but_invalid(loose, schema, texts) == ['""', '"a"']
