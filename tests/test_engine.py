"""The decode loop on tiny models: greedy identity, KV rollback, legality, validity, bad input."""

import copy

import jsonschema
import pytest
import torch

from constrained_spec import (
    ConstraintError,
    Draft,
    GenerationInputError,
    Generator,
    UnsupportedSchemaError,
    VocabularyMismatch,
    testing,
)
from constrained_spec.constraints import FINISHED
from constrained_spec.decoding import loop
from constrained_spec.model import kv
from constrained_spec.model.llama import CompactCache
from constrained_spec.testing import PERSON, assert_greedy_match, last_logits, random_head

# PERSON with a bounded age: a finite language whose longest text (~110 bytes) fits in 200 tokens
BOUNDED = {
    **PERSON,
    "properties": {
        **PERSON["properties"],
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
}
PROMPTS = ["hello", '{"name": "Alice", "age": 30}', "yes no yes"]


def greedy_runs(target, draft, tokenizer, prompt: str, k: int):
    """The masked baseline and greedy speculation on one prompt, checked to agree (up to a
    near-tie); returns the speculative run's stats."""
    gen = Generator(target, tokenizer, draft=draft)
    base = gen.generate(prompt, schema=PERSON, speculative=False, max_new_tokens=80)
    spec = gen.generate(prompt, schema=PERSON, num_draft_tokens=k, max_new_tokens=80)
    assert base.stats.target_calls == len(base.token_ids) + (base.finish_reason != "length")
    constraint = gen.compile(schema=PERSON)
    prompt_ids = tokenizer.encode(prompt)
    assert_greedy_match(target, constraint, prompt_ids, base.token_ids, spec.token_ids)
    assert spec.finish_reason == base.finish_reason
    return spec.stats


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculative_equals_the_masked_baseline(
    prompt, k, tiny_target, tiny_draft, tiny_tokenizer
):
    assert greedy_runs(tiny_target, tiny_draft, tiny_tokenizer, prompt, k).drafted > 0


@pytest.mark.parametrize("drafter", ["model", "head"])
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("k", [1, 3, 4, 8])
def test_greedy_speculative_equals_the_masked_baseline_on_int4(
    prompt, k, drafter, tiny_int4_target, tiny_draft, tiny_tokenizer
):
    """The compact int4 target: its verify pass of k+1 tokens must pick what its one-token
    steps pick (int4 kernel rows are independent of how many are fed)."""
    draft = tiny_draft if drafter == "model" else random_head(tiny_int4_target)
    stats = greedy_runs(tiny_int4_target, draft, tiny_tokenizer, prompt, k)
    assert stats.drafted_by_source.get("model", 0) > 0, stats.drafted_by_source


class IllegalDrafter:
    """Deterministic drafts that start legal and then propose a token the grammar forbids."""

    uses_features = False

    def __init__(self, tokenizer):
        self.bad = tokenizer.convert_tokens_to_ids("Zo")

    def begin(self, prompt, features):
        pass

    def observe(self, committed, features):
        pass

    def propose(self, tokens, state, constraint, k, sampling, generator):
        legal = constraint.allowed(state)
        return Draft(([legal[0]] + [self.bad] * k)[:k])


def test_forbidden_draft_tokens_are_never_committed(tiny_target, tiny_tokenizer):
    drafter = IllegalDrafter(tiny_tokenizer)
    gen = Generator(tiny_target, tiny_tokenizer, draft=drafter)
    constraint = gen.compile(schema=BOUNDED)
    for temperature in (0.0, 1.0):
        rounds = []
        res = gen.generate(
            "hello",
            schema=BOUNDED,
            temperature=temperature,
            seed=3,
            max_new_tokens=200,
            on_round=rounds.append,
        )
        state, cut = constraint.initial_state, 0
        for r in rounds:  # drafts with a token the grammar forbids where it stands
            cut += constraint.legal_prefix(state, r.drafted) < len(r.drafted)
            for t in r.committed:
                state = constraint.step(state, t)
        assert cut > 0, "no draft held a forbidden token: the test checked nothing"
        assert res.finish_reason == "stop", f"a finite language, yet: {res.text!r}"
        assert constraint.accepts_tokens(res.token_ids + [tiny_tokenizer.eos_token_id])
        jsonschema.validate(res.value, BOUNDED)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kv_caches_after_rollback_equal_a_fresh_forward(
    temperature, tiny_target, tiny_draft, tiny_tokenizer, monkeypatch
):
    """After every round (rejections included), the target's cache + the last committed token
    gives the same logits as a fresh forward over all committed tokens; the draft's likewise."""
    gen = Generator(tiny_target, tiny_tokenizer, draft=tiny_draft)
    caches, committed, checked = [], tiny_tokenizer.encode("hello"), []
    real_new_cache = kv.new_cache
    monkeypatch.setattr(
        kv,
        "new_cache",
        lambda model: caches.append(real_new_cache(model)) or caches[-1],
    )

    @torch.no_grad()
    def check(rnd):
        committed.extend(rnd.committed)
        for model, cache, ids in (
            (tiny_target, caches[0], committed),
            (tiny_draft, gen.drafter.model.cache, gen.drafter.model.cached_ids + [0]),
        ):
            assert cache.get_seq_length() == len(ids) - 1
            via_cache = model(torch.tensor([ids[-1:]]), cache=copy.deepcopy(cache)).logits[0, -1]
            fresh = model(torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(via_cache, fresh, atol=1e-4, rtol=1e-4)
        checked.append(rnd.accepted < len(rnd.drafted))

    gen.generate(
        "hello", schema=PERSON, temperature=temperature, seed=1, max_new_tokens=60, on_round=check
    )
    assert any(checked), "no round rejected a draft: the rollback was not exercised"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compact_cache_after_rollback_equals_a_fresh_forward(
    temperature, every_int4_target, tiny_draft, tiny_tokenizer, monkeypatch
):
    """The same on the compact int4 target, on every way of running it: its cache (cropped by
    setting a length, rejected entries left to be overwritten) + the last committed token gives
    a fresh forward's logits (a fresh forward of 33+ tokens is a prompt's prefill: the Python
    loop, on the same 4-bit kernel)."""
    tiny_int4_target = every_int4_target
    gen = Generator(tiny_int4_target, tiny_tokenizer, draft=tiny_draft)
    caches, committed, checked = [], tiny_tokenizer.encode("hello"), []
    real_new_cache = kv.new_cache
    monkeypatch.setattr(
        kv,
        "new_cache",
        lambda model: caches.append(real_new_cache(model)) or caches[-1],
    )

    def check(rnd):
        committed.extend(rnd.committed)
        cache = caches[0]
        assert isinstance(cache, CompactCache) and cache.get_seq_length() == len(committed) - 1
        via_cache = kv.forward(tiny_int4_target, copy.deepcopy(cache), committed[-1:], "cpu")[-1]
        torch.testing.assert_close(
            via_cache, last_logits(tiny_int4_target, committed), atol=1e-4, rtol=1e-4
        )
        checked.append(rnd.accepted < len(rnd.drafted))

    gen.generate(
        "hello", schema=PERSON, temperature=temperature, seed=1, max_new_tokens=60, on_round=check
    )
    assert any(checked), "no round rejected a draft: the rollback was not exercised"


def test_every_stopped_output_validates(tiny_target, tiny_draft, tiny_tokenizer):
    gen = Generator(tiny_target, tiny_tokenizer, draft=tiny_draft)
    stopped = 0
    for seed in range(8):
        res = gen.generate("hello", schema=PERSON, temperature=1.0, seed=seed, max_new_tokens=120)
        if res.finish_reason != "length":  # "budget": made to finish within max_new_tokens
            stopped += 1
            jsonschema.validate(res.value, PERSON)
            assert gen.compile(schema=PERSON).accepts(res.text)
    assert stopped >= 6, f"only {stopped} of 8 outputs stopped: too few were validated"


def test_max_new_tokens_stops_with_length(tiny_target, tiny_draft, tiny_tokenizer):
    gen = Generator(tiny_target, tiny_tokenizer, draft=tiny_draft)
    res = gen.generate(
        "hello", regex="[a-z]{20}", max_new_tokens=5, temperature=1.0, seed=0, budget_mask=False
    )
    assert res.finish_reason == "length" and len(res.token_ids) == 5 and res.value is None


def test_a_draft_model_with_a_shorter_context_stops_drafting_where_it_ends(
    tiny_target, tiny_tokenizer
):
    """A draft model running fewer positions than the target (a LongRoPE draft's original
    context) drafts up to its last position; past it the target goes on alone, to the tokens
    the masked baseline commits."""
    from constrained_spec.model import llama

    tiny = testing.tiny_model(tiny_tokenizer, seed=1, layers=1, max_positions=24)
    short = llama.from_transformers(tiny, "int8")  # a compact cache holds 24 positions at most
    gen = Generator(tiny_target, tiny_tokenizer, draft=short)
    base = gen.generate("hello", schema=PERSON, speculative=False, max_new_tokens=60)
    spec = gen.generate("hello", schema=PERSON, num_draft_tokens=4, max_new_tokens=60)
    assert len(spec.token_ids) == len(base.token_ids) > 24 and spec.stats.drafted > 0
    prompt = tiny_tokenizer.encode("hello")
    constraint = gen.compile(schema=PERSON)
    assert_greedy_match(tiny_target, constraint, prompt, base.token_ids, spec.token_ids)


def test_prompt_forms(tiny_target, tiny_tokenizer):
    gen = Generator(tiny_target, tiny_tokenizer)
    ids = tiny_tokenizer.encode("hello")
    a = gen.generate("hello", regex="(yes|no)", max_new_tokens=4)
    b = gen.generate(ids, regex="(yes|no)", max_new_tokens=4)
    assert a.token_ids == b.token_ids and a.text in ("yes", "no")


def test_constraint_queries(tiny_target, tiny_tokenizer):
    gen = Generator(tiny_target, tiny_tokenizer)
    c = gen.compile(regex='\\{"a":(1|22)\\}')
    assert c.accepts('{"a":22}') and not c.accepts('{"a":2}') and not c.accepts('{"a":1')
    brace, brace_quote, quote = tiny_tokenizer.convert_tokens_to_ids(["{", '{"', '"'])
    assert sorted(c.allowed(c.initial_state)) == sorted([brace, brace_quote])
    assert c.forced(c.initial_state) is None  # two legal tokens
    assert c.allowed(c.step(c.initial_state, brace)) == [quote]
    assert c.forced(c.step(c.initial_state, brace)) == quote  # one legal token: forced
    ids = [tiny_tokenizer.convert_tokens_to_ids(t) for t in ["{", '"', "a", '"', ":", "1", "}"]]
    assert c.legal_prefix(c.initial_state, ids + ids) == len(ids)  # the second "{" is illegal
    state = c.initial_state
    for t in ids:
        state = c.step(state, t)
    assert c.accepting(state) and c.step(state, c.eos_id) == FINISHED
    assert c.mask(state).shape == (tiny_target.lm_head.weight.shape[0],)
    assert c.mask(state)[c.eos_id] and c.mask(state).sum() == 1


def test_tokenize_spells_with_the_longest_legal_token_preferring_the_given_ones(
    tiny_target, tiny_tokenizer
):
    """Against every legal candidate at each position (what ``tokenize`` chooses among): the
    longest one in ``prefer``, else the longest; the spelling stops where none is legal."""
    import random

    c = Generator(tiny_target, tiny_tokenizer).compile(regex='\\{"(name|nap|no)":"[a-z ]{0,12}"\\}')
    vocab, rng = c.vocab, random.Random(0)

    def reference(state, data, limit, prefer):
        tokens, pos = [], 0
        while pos < len(data) and len(tokens) < limit:
            spelled = [
                (t, e)
                for e in range(len(data), pos, -1)
                if (t := vocab.ids_by_bytes.get(data[pos:e])) is not None
            ]
            legal = [(t, e) for t, e in spelled if c.step(state, t) is not None]
            if not legal:
                return tokens
            t, pos = next(((t, e) for t, e in legal if t in prefer), legal[0])
            tokens.append(t)
            state = c.step(state, t)
        return tokens

    texts = [b'{"name":"ada lovelace"}', b'{"nap":"a b"}', b'{"no":"x"}X', b'{"na', b"nope"]
    checked = 0
    for text in texts:
        ids = sorted({t for t, b in enumerate(vocab.token_bytes) if b and b in text})
        for _ in range(6):
            prefer = frozenset(rng.sample(ids, k=rng.randint(0, len(ids))))
            for limit in (1, 3, 40):
                got = c.tokenize(c.initial_state, text, limit, prefer)
                assert got == reference(c.initial_state, text, limit, prefer), (text, limit)
                checked += len(got)
    assert checked > 200


def test_non_ascii_values_are_generatable(tiny_target, tiny_tokenizer):
    gen = Generator(tiny_target, tiny_tokenizer)
    res = gen.generate("hello", regex="(Zoë|東京)", max_new_tokens=12)
    assert res.text in ("Zoë", "東京") and res.finish_reason == "stop"


# --- bad input: a clear error before any model work -------------------------------------------


class ExplodingModel(torch.nn.Module):
    def forward(self, *args, **kwargs):
        raise AssertionError("the model ran before the input was checked")


@pytest.fixture
def guarded_gen(tiny_target, tiny_tokenizer, monkeypatch):
    gen = Generator(tiny_target, tiny_tokenizer)
    monkeypatch.setattr(loop, "decode", lambda *a, **k: ExplodingModel()())
    return gen


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(schema='{"type": "object",'), ConstraintError, "not valid JSON"),
        (dict(schema={"type": "objekt"}), ConstraintError, "/type"),
        (
            dict(schema={"type": "array", "uniqueItems": True}),
            UnsupportedSchemaError,
            "uniqueItems",
        ),
        (dict(schema="/no/such/schema.json"), ConstraintError, "does not exist"),
        (dict(schema={"type": "integer"}, regex="[0-9]"), ConstraintError, "exactly one"),
        (dict(regex="(yes|no"), ConstraintError, "regex"),
        (dict(regex="yes", temperature=-1.0), GenerationInputError, "temperature"),
        (dict(regex="yes", top_p=1.5), GenerationInputError, "top_p"),
        (dict(regex="yes", max_new_tokens=0), GenerationInputError, "max_new_tokens"),
    ],
)
def test_bad_constraint_or_settings_fail_before_model_work(guarded_gen, kwargs, error, words):
    with pytest.raises(error, match=words):
        guarded_gen.generate("hello", **kwargs)


@pytest.mark.parametrize(
    "prompt, words",
    [("", "empty"), ([], "prompt"), ("x " * 300, "context holds"), ([10**6], "token ids")],
)
def test_bad_prompts_fail_before_model_work(guarded_gen, prompt, words):
    with pytest.raises(GenerationInputError, match=words):
        guarded_gen.generate(prompt, regex="yes")


def test_draft_with_another_vocabulary_is_refused(tiny_target, tiny_tokenizer):
    small = copy.deepcopy(tiny_target)
    small.resize_token_embeddings(100)
    with pytest.raises(VocabularyMismatch, match="share the target's vocabulary"):
        Generator(tiny_target, tiny_tokenizer, draft=small)


@pytest.mark.parametrize(
    "regex, accepted, rejected",
    [
        ("(ab)*", ["", "ab", "abab"], ["a", "aba"]),
        ("[0-9]+(,[0-9]+)*", ["1", "1,2", "12,345"], ["1,", ","]),
        ("1(\\.0)?", ["1", "1.0"], ["1."]),
    ],
)
def test_matches_continue_past_an_accepting_prefix(
    regex, accepted, rejected, tiny_target, tiny_tokenizer
):
    """A complete match may go on ("1" becomes "1,2"): EOS is legal there, and so is more."""
    c = Generator(tiny_target, tiny_tokenizer).compile(regex=regex)
    assert [t for t in accepted if not c.accepts(t)] == []
    assert [t for t in rejected if c.accepts(t)] == []


def test_greedy_identity_with_skinny_matmul(tiny_target, tiny_draft, tiny_tokenizer):
    """Verify passes through models.SkinnyLinear (from_pretrained's CPU default) keep the
    baseline's greedy tokens (up to near-ties)."""
    from constrained_spec.model.models import skinny_matmul

    target = skinny_matmul(copy.deepcopy(tiny_target))
    gen = Generator(target, tiny_tokenizer, draft=tiny_draft)
    base = gen.generate(PROMPTS[1], schema=PERSON, speculative=False, max_new_tokens=80)
    spec = gen.generate(PROMPTS[1], schema=PERSON, num_draft_tokens=4, max_new_tokens=80)
    assert_greedy_match(
        target,
        gen.compile(schema=PERSON),
        tiny_tokenizer.encode(PROMPTS[1]),
        base.token_ids,
        spec.token_ids,
    )
    assert spec.stats.accepted > 0


def test_a_drafter_must_implement_the_whole_protocol(tiny_target, tiny_tokenizer):
    class ProposeOnly:
        def propose(self, tokens, state, constraint, k, sampling, generator):
            return Draft([])

    with pytest.raises(TypeError, match="uses_features, begin, observe of the Drafter protocol"):
        Generator(tiny_target, tiny_tokenizer, draft=ProposeOnly())
    gen = Generator(tiny_target, tiny_tokenizer)
    with pytest.raises(TypeError, match="Drafter protocol"):
        gen.generate("hello", regex="yes", drafter=ProposeOnly())


def test_a_drafter_reused_round_after_round_proposes_what_a_fresh_one_would(
    tiny_target, tiny_tokenizer
):
    """The lookup's text grows with each round's tokens instead of being rebuilt: every draft
    of a request, and of the next request, equals a fresh drafter's from the same context."""
    from constrained_spec.decoding.drafters import CompositeDrafter

    class Recording(CompositeDrafter):
        def propose(self, tokens, state, constraint, k, sampling, generator):
            draft = super().propose(tokens, state, constraint, k, sampling, generator)
            calls.append((list(tokens), state, constraint, k, sampling, draft))
            return draft

    calls = []
    gen = Generator(tiny_target, tiny_tokenizer, draft=Recording())
    for prompt in ("hello yes{}ab no{}ba yes{}", "no{}ba yes"):
        gen.generate(
            prompt, regex="(yes|no)\\{\\}(ab|ba)( (yes|no)\\{\\}(ab|ba))*", max_new_tokens=30
        )
    assert sum("lookup" in draft.sources for *_, draft in calls) >= 2
    for tokens, state, constraint, k, sampling, draft in calls:
        fresh = CompositeDrafter().propose(tokens, state, constraint, k, sampling, None)
        assert fresh.tokens == draft.tokens and fresh.sources == draft.sources
