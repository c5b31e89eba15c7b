"""Batched speculative decoding on tiny models: each row as if alone (greedy identity, exact
sampling, its own cache after ragged rollbacks), continuous refills, bad rows."""

import copy

import pytest
import torch

from constrained_spec import GenerationInputError, Generator
from constrained_spec.decoding import loop
from constrained_spec.decoding.drafters import CompositeDrafter
from constrained_spec.target import kv
from constrained_spec.testing import (
    PERSON,
    assert_greedy_match,
    chi_square,
    last_logits,
    sequence_distribution,
)

FORCED_REGEX = "(yes|no)\\{\\}(ab|ba)"  # "{" and "}" are forced states
LOOKUP_PROMPT = "hello yes{}ab no{}ba"  # continuations for prompt lookup to copy

# Rows of different constraints, prompts and lengths: a batch of 3 runs them with refills.
REQUESTS = [
    dict(prompt='{"name": "Alice", "age": 30}', schema=PERSON, max_new_tokens=60),
    dict(prompt=LOOKUP_PROMPT, regex=FORCED_REGEX, max_new_tokens=12),
    dict(prompt="hello", schema=PERSON, max_new_tokens=25),
    dict(prompt="yes no yes", regex="(ab|ba|yes|no){1,6}", max_new_tokens=20),
    dict(prompt="hello yes", regex="[a-z ]{3,40}", max_new_tokens=9),
    dict(prompt='{"name": "Bob"}', schema=PERSON, max_new_tokens=80),
]


def lookup_generator(target, tokenizer) -> Generator:
    return Generator(target, tokenizer, draft=CompositeDrafter())


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("which", ["int4", "float"])
def test_greedy_rows_equal_their_single_runs(
    which, batch_size, tiny_int4_target, tiny_target, tiny_tokenizer
):
    """Every row of a batch commits what it commits alone, whatever its neighbours accept; the
    int4 target runs all rows in one forward, the transformers one row after row."""
    target = tiny_int4_target if which == "int4" else tiny_target
    gen = lookup_generator(target, tiny_tokenizer)
    batch = gen.generate_batch(REQUESTS, batch_size=batch_size)
    drafted = 0
    for request, got in zip(REQUESTS, batch):
        alone = gen.generate(**request)
        constraint = gen.compile(schema=request.get("schema"), regex=request.get("regex"))
        prompt = gen.encode_prompt(request["prompt"])
        assert_greedy_match(target, constraint, prompt, alone.token_ids, got.token_ids)
        assert got.finish_reason == alone.finish_reason
        assert (got.value is not None) == (got.finish_reason == "stop" and "schema" in request)
        drafted += got.stats.drafted
    assert drafted > 0, "no row drafted: the batch ran the baseline"


def test_a_wide_batch_drafts_at_most_its_cap_and_each_row_commits_what_it_commits_alone(
    tiny_int4_target, tiny_tokenizer, monkeypatch
):
    """From loop.WIDE_BATCH rows on, each row drafts at most WIDE_MAX_DRAFT tokens; the
    rows that are left once the queue runs dry draft longer again. Greedy rows are unchanged."""
    gen = lookup_generator(tiny_int4_target, tiny_tokenizer)
    requests = REQUESTS * 2  # 12 rows, 8 at a time: full rounds, then the tail
    passes, forward_rows = [], kv.forward_rows

    def recorded(model, caches, rows, device, masks=None, features=False):
        passes.append([len(fed) for fed in rows])
        return forward_rows(model, caches, rows, device, masks, features)

    monkeypatch.setattr(kv, "forward_rows", recorded)
    batch = gen.generate_batch(requests, batch_size=loop.WIDE_BATCH)
    wide = [fed for fed in passes if len(fed) >= loop.WIDE_BATCH]
    narrow = [fed for fed in passes if len(fed) < loop.WIDE_BATCH]
    assert wide and max(max(fed) for fed in wide) == 1 + loop.WIDE_MAX_DRAFT
    assert max(max(fed) for fed in narrow) > 1 + loop.WIDE_MAX_DRAFT
    for request, got in zip(requests, batch):
        assert got.token_ids == gen.generate(**request).token_ids


def test_a_row_samples_exactly_inside_a_batch_of_other_schemas(tiny_int4_target, tiny_tokenizer):
    """The chi-square test on one constraint's rows, each decoded beside rows of another
    constraint and temperature (lookup drafts rejected and accepted in the same rounds)."""
    gen = lookup_generator(tiny_int4_target, tiny_tokenizer)
    prompt = tiny_tokenizer.encode(LOOKUP_PROMPT)
    exact = sequence_distribution(tiny_int4_target, gen.compile(regex=FORCED_REGEX), prompt, 1.0)
    tested = dict(prompt=prompt, regex=FORCED_REGEX, temperature=1.0, max_new_tokens=12)
    other = dict(prompt="hello", schema=PERSON, temperature=0.7, max_new_tokens=15)
    mixed = [{**r, "seed": s} for s in range(2000) for r in (tested, other)]
    rows = gen.generate_batch(mixed, batch_size=4)[::2]
    assert all(r.finish_reason == "stop" for r in rows)
    p_value, tv = chi_square([tuple(r.token_ids) for r in rows], exact)
    print(f"batched row chi-square p={p_value:.3f}, TV={tv:.3f}")
    assert p_value > 1e-3, f"chi-square p={p_value:.2e}, TV={tv:.3f}"
    drafted = sum(r.stats.drafted for r in rows)
    accepted = sum(r.stats.accepted for r in rows)
    assert 0 < accepted < drafted, "drafts were not both accepted and rejected"


def test_each_rows_cache_after_ragged_rollbacks_equals_a_fresh_forward(
    tiny_int4_target, tiny_tokenizer
):
    gen = lookup_generator(tiny_int4_target, tiny_tokenizer)
    rows = [
        gen.row({**r, "temperature": 1.0, "seed": i}, i, batched=True)
        for i, r in enumerate(REQUESTS)
    ]
    finished = [row for row, _ in loop.decode(tiny_int4_target, rows, 4) if row.finished]
    assert sorted(row.index for row in finished) == list(range(len(REQUESTS)))
    assert sum(row.stats.drafted - row.stats.accepted for row in rows) > 0, "nothing rolled back"
    for row in rows:
        assert kv.cached_length(row.cache) == len(row.tokens) - 1
        via_cache = kv.forward(tiny_int4_target, copy.deepcopy(row.cache), row.tokens[-1:], "cpu")
        torch.testing.assert_close(
            via_cache[-1], last_logits(tiny_int4_target, row.tokens), atol=1e-4, rtol=1e-4
        )


def test_rows_keep_their_own_sampling_settings(tiny_int4_target, tiny_tokenizer):
    """A greedy row and a sampled row of the same request differ only by their settings: the
    greedy one is deterministic across seeds, each sampled one reproducible by its seed."""
    gen = lookup_generator(tiny_int4_target, tiny_tokenizer)
    base = dict(prompt="hello", regex="[a-z ]{3,40}", max_new_tokens=10)
    requests = [{**base, "seed": s, "temperature": t} for s in (1, 2) for t in (0.0, 1.5)]
    first, second = gen.generate_batch(requests, 4), gen.generate_batch(requests[::-1], 2)[::-1]
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    assert first[0].token_ids == first[2].token_ids  # greedy: the seed does not matter
    alone = gen.generate(**requests[1])
    assert first[1].token_ids == alone.token_ids  # a sampled row: its seed, not its neighbours


def test_bad_rows(tiny_int4_target, tiny_tokenizer):
    """generate_batch checks every request before any model work; batch() reports a bad row in
    its own result and decodes the others."""
    gen = lookup_generator(tiny_int4_target, tiny_tokenizer)
    good = dict(prompt="hello", regex="[a-z]{2,5}", max_new_tokens=6)
    bad = [
        (dict(prompt=""), "prompt is empty"),
        (dict(prompt="hi", regex="[a-z", max_new_tokens=3), "regex"),
        (dict(prompt="hi", temperature=-1), "temperature"),
        (dict(prompt="hi", colour="red"), "unknown field"),
        ("hi", "a dict with at least a 'prompt'"),
    ]
    for request, words in bad:
        with pytest.raises(ValueError, match=words):
            gen.generate_batch([good, request])
    with pytest.raises(GenerationInputError, match="batch_size"):
        gen.generate_batch([good], batch_size=0)
    results = dict(gen.batch([good, bad[0][0], good, bad[3][0]], batch_size=2))
    assert sorted(results) == [0, 1, 2, 3]
    assert results[0].token_ids == results[2].token_ids and results[0].finish_reason
    assert isinstance(results[1], GenerationInputError) and "empty" in str(results[1])
    assert isinstance(results[3], GenerationInputError) and "colour" in str(results[3])
