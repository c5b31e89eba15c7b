"""Batched speculative decoding on tiny models: each row as if alone (greedy identity, exact
sampling, its own cache after ragged rollbacks), continuous refills, bad rows."""

import copy

import pytest
import torch

from constrained_spec import GenerationInputError, Generator
from constrained_spec.decoding import cost, loop
from constrained_spec.decoding.cost import PassCost
from constrained_spec.decoding.drafters import EMPTY_DRAFT, CompositeDrafter, Draft
from constrained_spec.decoding.sample import SamplingConfig
from constrained_spec.model import kv, machine
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
        finished = got.finish_reason in ("stop", "budget")  # "budget": made to finish in time
        assert (got.value is not None) == (finished and "schema" in request)
        drafted += got.stats.drafted
    assert drafted > 0, "no row drafted: the batch ran the baseline"


# Pass costs that make the plan vary: every token fed costs 1 ms (a row's step about what its
# rows' host share adds), so forced tokens (gain 1) are always drafted and lookup tokens only
# where the row's own acceptance has risen above ~0.9.
LINEAR_COST = PassCost({1: [(1, 1.0), (64, 64.0)], 64: [(64, 64.0), (512, 512.0)]})
# A drafted token at half a row's step: lookup tokens are drafted while the row's own record
# keeps their chance above ~0.45, then dropped.
MID_COST = PassCost({1: [(1, 1.0), (64, 32.5)], 64: [(64, 64.0), (512, 288.0)]})
# Cheap drafted tokens (a tenth of a row's step): every row drafts its whole draft.
CHEAP_COST = PassCost({1: [(1, 1.0), (64, 7.3)], 64: [(64, 64.0), (512, 108.8)]})


@pytest.fixture
def planned(tiny_int4_target, monkeypatch):
    """Decode on the tiny target under a given pass-cost table; returns the list of each round's
    (full draft lengths, planned lengths)."""
    plans, plan = [], loop.plan

    def recorded(costs, rows, drafts):
        lengths = plan(costs, rows, drafts)
        plans.append(([len(d) for d in drafts], lengths))
        return lengths

    monkeypatch.setattr(loop, "plan", recorded)

    def use(table):
        cost.use(tiny_int4_target, table)
        return plans

    yield use
    cost._used.pop(tiny_int4_target)  # measured where a later test decodes


def test_rows_of_a_round_draft_what_the_plan_gives_and_commit_what_they_commit_alone(
    tiny_int4_target, tiny_tokenizer, planned
):
    """Under pass costs that price a drafted token like a committed one, a round verifies some
    rows' whole drafts (forced tokens), cuts others to 0 (the baseline step) and some between;
    every greedy row still commits what it commits alone."""
    gen = lookup_generator(tiny_int4_target, tiny_tokenizer)
    plans = planned(LINEAR_COST)
    requests = REQUESTS * 2  # 12 rows, 8 at a time: full rounds, then the tail
    batch = gen.generate_batch(requests, batch_size=8)
    rows = [(full, k) for fulls, ks in plans for full, k in zip(fulls, ks) if full]
    assert any(k == 0 for _, k in rows), "no row was cut to the baseline step"
    assert any(k == full for full, k in rows), "no row kept its whole draft"
    assert any(0 < k < full for full, k in rows), "no draft was cut short"
    assert any(len(set(ks)) > 1 for _, ks in plans), "the rows of a round drafted alike"
    for request, got in zip(requests, batch):
        alone = gen.generate(**request)
        constraint = gen.compile(schema=request.get("schema"), regex=request.get("regex"))
        prompt = gen.encode_prompt(request["prompt"])
        assert_greedy_match(tiny_int4_target, constraint, prompt, alone.token_ids, got.token_ids)


def test_the_plan():
    """Forced tokens always pay; a lookup token pays where a drafted token is cheap, or where the
    row's own record says it is accepted; a sampled draft is kept whole; no table keeps all."""
    vocab = 8
    forced = Draft([1, 2], None, ("forced", "forced"))
    lookup = Draft([3, 4, 5], None, ("lookup",) * 3)
    sampled = Draft([6], torch.full((1, vocab), 1 / vocab), ("model",))

    def rows(n):
        return [loop.Row([0], None, SamplingConfig(), None, None, 10) for _ in range(n)]

    three = rows(3)
    assert loop.plan(LINEAR_COST, three, [forced, lookup, sampled]) == [2, 0, 1]
    assert loop.plan(CHEAP_COST, three, [forced, lookup, sampled]) == [2, 3, 1]
    assert loop.plan(None, three, [forced, lookup, EMPTY_DRAFT]) == [2, 3, 0]
    reliable = rows(1)[0]
    for _ in range(30):  # its lookups accepted round after round
        reliable.acceptance.update(lookup, 3)
    assert loop.plan(LINEAR_COST, [reliable, three[1]], [lookup, lookup]) == [3, 0]


def test_pass_costs_are_measured_once_a_row_count_and_interpolated(
    tiny_int4_target, tmp_path, monkeypatch
):
    """A table covers the row counts asked for (those below and the first at or above), each
    measured once and stored on its own: one request's rows (1, 2) measure no batch rows."""
    monkeypatch.setenv(machine.CACHE_ENV, str(tmp_path))
    measured, real = [], cost.measure_rows
    monkeypatch.setattr(
        cost, "measure_rows", lambda t, rows: measured.append(rows) or real(t, rows)
    )
    cost._known.pop(tiny_int4_target, None)
    one = cost.pass_cost(tiny_int4_target)
    assert sorted(one.grid) == [1, 2] and measured == [1, 2]
    assert all(ms > 0 for points in one.grid.values() for _, ms in points)
    assert cost.pass_cost(tiny_int4_target, 2) is one and measured == [1, 2]
    five = cost.pass_cost(tiny_int4_target, 5)
    assert sorted(five.grid) == [1, 2, 4, 8] and measured == [1, 2, 4, 8]
    assert five.grid[1] == one.grid[1]  # read back, not measured again
    assert cost.row_counts(16) == list(cost.GRID_ROWS) == cost.row_counts(40)
    whole = cost.measure(tiny_int4_target)
    assert sorted(whole.grid) == list(cost.GRID_ROWS)
    table = PassCost({1: [(1, 2.0), (3, 4.0)], 4: [(4, 6.0), (12, 14.0)]})
    assert table.ms(1, 2) == 3.0 and table.ms(4, 8) == 10.0
    assert table.ms(2, 2) == pytest.approx(2.0 + (6.0 - 2.0) / 3)  # between the row counts
    assert table.ms(8, 8) == pytest.approx(6.0 + (6.0 - 2.0) / 3 * 4)  # on past the grid
    assert cost.pass_cost(tiny_int4_target) is cost.pass_cost(tiny_int4_target)


def test_a_seeded_row_samples_the_same_tokens_however_much_it_drafts(
    tiny_int4_target, tiny_tokenizer, planned
):
    """A sampled row's deterministic drafts are checked against the target's own draws, the
    generator rewound to one uniform per committed token: the same seeded batch gives the same
    tokens on every run, and each row the tokens of its own masked baseline run (the 4-bit
    target's pass computes a row's step bit for bit), whatever the plan drafts for it."""
    gen = lookup_generator(tiny_int4_target, tiny_tokenizer)
    requests = [
        {**r, "temperature": t, "seed": s} for s, t in ((1, 1.0), (2, 0.7)) for r in REQUESTS
    ]
    runs = []
    for table, batch_size in ((LINEAR_COST, 4), (LINEAR_COST, 4), (CHEAP_COST, 3), (None, 1)):
        planned(table)
        runs.append([r.token_ids for r in gen.generate_batch(requests, batch_size)])
    baseline = [
        r.token_ids for r in gen.generate_batch([{**r, "speculative": False} for r in requests], 5)
    ]
    assert runs[0] == runs[1] == runs[2] == runs[3] == baseline


@pytest.mark.parametrize("table", ["mid", "cheap"])
def test_a_row_samples_exactly_inside_a_batch_of_other_schemas(
    table, tiny_int4_target, tiny_tokenizer, planned
):
    """The chi-square test on one constraint's rows, each decoded beside rows of another
    constraint and temperature (lookup drafts rejected and accepted in the same rounds), with
    the plan cutting drafts (mid: some rows' drafts to 0, others whole) or keeping nearly all."""
    gen = lookup_generator(tiny_int4_target, tiny_tokenizer)
    plans = planned(MID_COST if table == "mid" else CHEAP_COST)
    prompt = tiny_tokenizer.encode(LOOKUP_PROMPT)
    exact = sequence_distribution(tiny_int4_target, gen.compile(regex=FORCED_REGEX), prompt, 1.0)
    tested = dict(prompt=prompt, regex=FORCED_REGEX, temperature=1.0, max_new_tokens=12)
    other = dict(prompt="hello", schema=PERSON, temperature=0.7, max_new_tokens=20)
    mixed = [{**r, "seed": s} for s in range(2000) for r in (tested, other)]
    rows = gen.generate_batch(mixed, batch_size=4)[::2]
    assert all(r.finish_reason == "stop" for r in rows)
    p_value, tv = chi_square([tuple(r.token_ids) for r in rows], exact)
    print(f"batched row chi-square p={p_value:.3f}, TV={tv:.3f}")
    assert p_value > 1e-3, f"chi-square p={p_value:.2e}, TV={tv:.3f}"
    drafted = sum(r.stats.drafted for r in rows)
    accepted = sum(r.stats.accepted for r in rows)
    assert 0 < accepted < drafted, "drafts were not both accepted and rejected"
    rows = [(full, k) for fulls, ks in plans for full, k in zip(fulls, ks) if full]
    if table == "mid":
        assert any(k == 0 for _, k in rows) and any(k == full for full, k in rows)
    else:
        assert sum(k for _, k in rows) > 0.9 * sum(full for full, _ in rows)


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
