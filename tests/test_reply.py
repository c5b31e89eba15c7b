"""What a reply carries beyond its text, on tiny models: stop strings (matched on committed text
only, and only where the constraint lets the text end) and log-probabilities (those of the
masked distribution each token was drawn from, drafts included)."""

import math
import re

import pytest

from constrained_spec import GenerationInputError, Generator
from constrained_spec.decoding.drafters import CompositeDrafter, Draft
from constrained_spec.testing import last_logits, reference_policy

FREE = "[a-z ]{0,40}"
WORDS = "(yes|no)( (yes|no)){2,}"  # complete from the third word on
SMALL = {
    "type": "object",
    "properties": {"a": {"enum": ["yes", "no"]}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
}


@pytest.fixture
def gen(tiny_target, tiny_draft, tiny_tokenizer):
    return Generator(tiny_target, tiny_tokenizer, draft=tiny_draft)


# ---------------------------------------------------------------- stop


def test_the_reply_ends_before_the_first_stop_string(gen):
    base = gen.generate("hello", regex=FREE, max_new_tokens=30, speculative=False)
    stop = base.text[9:11]
    assert len(stop) == 2 and base.text.index(stop) > 0
    expected = base.text[: base.text.index(stop)]
    for speculative in (False, True):
        rounds = []
        r = gen.generate(
            "hello", regex=FREE, max_new_tokens=30, stop=["zzz", stop],
            speculative=speculative, on_round=rounds.append,
        )  # fmt: skip
        assert r.text == expected and r.finish_reason == "stop"
        assert gen.vocab.decode(r.token_ids).startswith(expected + stop)
    assert any(len(x.drafted) for x in rounds), "nothing was drafted: speculation unused"


class StopDrafter:
    """Drafts the tokens of ``text`` every round (legal under FREE), as deterministic drafts:
    the target rejects them, so they are rolled back."""

    uses_features = False

    def __init__(self, text: str):
        self.text = text.encode()

    def begin(self, prompt, features):
        pass

    def propose(self, tokens, state, constraint, k, sampling, generator):
        ids = constraint.tokenize(state, self.text, k)
        return Draft(ids, None, ("lookup",) * len(ids))

    def observe(self, committed, features):
        pass


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_stop_string_in_a_rolled_back_draft_never_ends_the_reply(gen, temperature):
    settings = dict(regex=FREE, max_new_tokens=30, temperature=temperature, seed=0)
    base = gen.generate("hello", speculative=False, **settings)
    stop = "ab ab"
    assert stop not in base.text
    rounds, pieces = [], []
    for item in gen.stream(
        "hello", stop=stop, drafter=StopDrafter(stop), on_round=rounds.append, **settings
    ):
        pieces.append(item)
    *pieces, r = pieces
    spelled = [gen.vocab.decode(x.drafted) for x in rounds]
    assert sum(stop in s for s in spelled) >= 3, "the drafter never proposed the stop string"
    assert r.text == "".join(pieces) and stop not in r.text
    if temperature == 0.0:  # greedy: the same text as the baseline, drafts or not
        assert r.text == base.text and r.finish_reason == base.finish_reason


def test_under_a_constraint_a_stop_ends_the_reply_only_where_the_text_is_complete(gen):
    base = gen.generate("hello", regex=WORDS, max_new_tokens=30)
    spaces = [m.start() for m in re.finditer(" ", base.text)]
    assert len(spaces) >= 3, base.text
    r = gen.generate("hello", regex=WORDS, max_new_tokens=30, stop=" ")
    assert r.text == base.text[: spaces[2]] and r.finish_reason == "stop"  # not at the 1st, 2nd
    assert re.fullmatch(WORDS, r.text)
    # inside JSON no prefix before '"' or ',' is a complete object: the stops never apply
    whole = gen.generate("hello", schema=SMALL, max_new_tokens=40)
    assert whole.finish_reason == "stop" and '"' in whole.text and "," in whole.text
    cut = gen.generate("hello", schema=SMALL, max_new_tokens=40, stop=['"', ","])
    assert cut.text == whole.text and cut.value == whole.value


def test_a_stream_never_shows_the_stop_string_or_text_after_it(gen):
    base = gen.generate("hello", regex=FREE, max_new_tokens=30)
    stop = base.text[12:15]
    *pieces, r = list(gen.stream("hello", regex=FREE, max_new_tokens=30, stop=stop))
    assert "".join(pieces) == r.text == base.text[: base.text.index(stop)]


@pytest.mark.parametrize(
    "stop, words",
    [(["a", "b", "c", "d", "e"], "at most 4"), ([""], "non-empty"), ("", "non-empty"), ([1], "")],
)
def test_bad_stop_strings_are_refused_before_any_model_work(gen, stop, words):
    with pytest.raises(GenerationInputError, match=f"stop=.*{words}"):
        gen.generate("hello", regex=FREE, stop=stop)


# ---------------------------------------------------------------- logprobs


def masked_logprobs(gen, prompt: str, constraint, tokens, temperature, top_p=None):
    """Each token's log-probability under plain masked sampling (fresh forwards, the policy
    written out in testing.reference_policy; greedy: the masked distribution at T = 1)."""
    ids, state, out = gen.tokenizer.encode(prompt), constraint.initial_state, []
    for token in tokens:
        logits = last_logits(gen.target, ids, constraint.mask(state)).double().tolist()
        policy = reference_policy(
            logits, constraint.allowed(state), temperature or 1.0, None, top_p
        )
        out.append(math.log(policy[token]))
        ids, state = ids + [token], constraint.step(state, token)
    return out


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9, seed=1),
        dict(temperature=1.0, seed=2, speculative=False),
    ],
)
def test_logprobs_sum_to_the_masked_baselines_logprob_of_the_reply(gen, settings):
    r = gen.generate(
        "hello", schema=SMALL, max_new_tokens=40, logprobs=True, top_logprobs=3, **settings
    )
    if settings.get("speculative", True):
        assert r.stats.accepted > 0, "no draft was accepted: drafts' log-probs unchecked"
    assert [s.token for s in r.logprobs] == r.token_ids
    reference = masked_logprobs(
        gen, "hello", gen.compile(schema=SMALL), r.token_ids, settings["temperature"],
        settings.get("top_p"),
    )  # fmt: skip
    assert sum(s.logprob for s in r.logprobs) == pytest.approx(sum(reference), abs=1e-4)
    for s, ref in zip(r.logprobs, reference):
        assert s.logprob == pytest.approx(ref, abs=1e-5)
        values = [v for _, v in s.top]
        assert 1 <= len(s.top) <= 3 and values == sorted(values, reverse=True)
        assert s.logprob <= values[0] + 1e-6
    if settings["temperature"] == 0.0:  # greedy: every token is its position's most likely
        assert all(s.top[0][0] == s.token for s in r.logprobs)


def test_logprobs_on_the_4bit_target(tiny_int4_target, tiny_tokenizer):
    """The compact forward computes only the legal tokens' logits: the log-probs are still
    those of the masked distribution, forced and lookup drafts included."""
    gen = Generator(tiny_int4_target, tiny_tokenizer, draft=CompositeDrafter())
    r = gen.generate("hello", schema=SMALL, max_new_tokens=40, logprobs=True, top_logprobs=2)
    assert r.stats.accepted > 0, "no draft was accepted: drafts' log-probs unchecked"
    reference = masked_logprobs(gen, "hello", gen.compile(schema=SMALL), r.token_ids, 0.0)
    assert [s.logprob for s in r.logprobs] == pytest.approx(reference, abs=1e-4)


def test_no_logprobs_unless_asked(gen):
    assert gen.generate("hello", regex=FREE, max_new_tokens=8).logprobs is None
    with pytest.raises(GenerationInputError, match="top_logprobs needs logprobs"):
        gen.generate("hello", regex=FREE, top_logprobs=2)
    with pytest.raises(GenerationInputError, match="top_logprobs=21"):
        gen.generate("hello", regex=FREE, logprobs=True, top_logprobs=21)
