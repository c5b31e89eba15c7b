"""The budget mask (issue 66): with r tokens left, only tokens after which the reply can still
finish within r - 1 tokens. Completions are real (llguidance accepted them) and shrink by one
along their first token; the mask leaves a greedy reply that fits unchanged, keeps speculation
exact (chi-square against the enumerated grammar-and-budget distribution) and greedy speculation
equal to the baseline; every reply finishes valid; a budget below the shortest reply is refused
before any model work."""

import random

import jsonschema
import pytest
import torch

from constrained_spec import GenerationInputError, Generator, testing
from constrained_spec.constraints import (
    FINISHED,
    Completion,
    TokenVocabulary,
    compile_constraint,
    engine,
    token_vocabulary,
)
from constrained_spec.decoding import budget
from constrained_spec.decoding.drafters import CompositeDrafter
from constrained_spec.errors import BudgetMaskWarning
from constrained_spec.testing import (
    PERSON,
    assert_greedy_match,
    chi_square,
    random_head,
    sequence_distribution,
)

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2},
        "email": {"type": "string", "format": "email"},
        "when": {"type": "string", "format": "date-time"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number", "minimum": 10}},
            "required": ["lat", "lon"],
        },
        "ok": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    },
    "required": ["name", "email", "when", "code", "tags", "where"],
}
SCHEMAS = [PERSON, NESTED, {"type": "array", "items": {"type": "integer"}, "minItems": 3}]
REGEXES = ["(ab|ba|yes|no)+", r"\d{4}-\d{2}-\d{2}", "[a-z]+@[a-z]+\\.(com|org)"]
LOOPING = "(ab|ba|yes|no)+"  # an unbounded language: only the budget ends a reply in time
N_SAMPLES = 1500


def constraints(vocab, width):
    for schema in SCHEMAS:
        yield compile_constraint(vocab, width, schema=schema)
    for regex in REGEXES:
        yield compile_constraint(vocab, width, regex=regex)


def test_a_completion_is_accepted_and_shrinks_by_one_along_its_first_token(tiny_tokenizer):
    """From random states of each constraint (the prefix of a random accepted text): the state's
    completion finishes the text, and its greedy spelling's first token leads to a state whose
    completion takes one token fewer, down to EOS. The mask rests on both."""
    gen = Generator(testing.tiny_model(tiny_tokenizer, seed=0), tiny_tokenizer)
    vocab, rng, walked = gen.vocab, random.Random(0), 0
    for c in constraints(vocab, gen.width):
        for _ in range(6):
            text = testing.random_text(c, rng, max_len=60) or ""
            state = c.initial_state
            for token in c.tokenize(state, text.encode()[: rng.randrange(len(text) + 1)], 999):
                state = c.step(state, token)
            done = c.completion(state)
            assert done is not None, f"no completion after {text!r}"
            prefix = vocab.text_bytes([*path_of(c, state)])
            assert c.accepts((prefix + done.text).decode()), (prefix, done)
            while state != FINISHED:
                token = c.tokenize(state, done.text, 1)[0] if done.text else c.eos_id
                state, before = c.step(state, token), done.tokens
                done = c.completion(state)
                assert state is not None and done.tokens == before - 1
                walked += 1
    assert walked > 100


def path_of(constraint, state):
    path = []
    while state != constraint.initial_state:
        path.append(constraint._token[state])
        state = constraint._parent[state]
    return reversed(path)


def test_a_completion_is_a_function_of_the_state(tiny_tokenizer):
    """The same state gets the same completion whatever was asked before (caches dropped, or
    another order): the budget mask is a function of (state, tokens left)."""
    vocab, width = token_vocabulary(tiny_tokenizer), len(tiny_tokenizer) + 6
    c = compile_constraint(vocab, width, schema=NESTED)
    states, state = [], c.initial_state
    text = '{"name":"Al","email":"al@x.io","when":"2024-01-02T03:04:05Z","code":"AB-1'
    for token in c.tokenize(state, text.encode(), 999):
        state = c.step(state, token)
        states.append(state)
    first = [c.completion(s) for s in states]
    c.clear_caches()
    assert [c.completion(s) for s in reversed(states)][::-1] == first
    assert len({f.text for f in first}) > 3, "the completions did not change along the text"


@pytest.mark.parametrize("missing", [(), (1, 200), tuple(range(128, 256))])
def test_a_vocabulary_says_which_bytes_it_cannot_spell(missing):
    """SmolLM2's byte-level BPE lacks 21 bytes (the real-model test below), a SentencePiece
    vocabulary with byte fallback none (tests/test_families.py); completions use only bytes a
    token spells (here the walk's first choice, byte 1, where there is a token for it)."""
    pieces = [bytes([b]) for b in range(256) if b not in missing] + [b"ab", None]
    vocab = TokenVocabulary(tuple(pieces), len(pieces) - 1)
    assert vocab.missing_bytes == missing
    assert vocab.spelled_length(b"abab") == 2
    assert vocab.spelled_length("é".encode()) == (None if 0xC3 in missing else 2)
    grammar = engine.lark_grammar('start: ("\\x01" | "b") "x"')  # no hints: the lowest byte
    c = engine.GuidanceConstraint(grammar, vocab, len(pieces), "grammar")
    assert c.completion(0) == Completion(b"bx" if 1 in missing else b"\x01x", 3)


@pytest.mark.real_model
def test_the_default_models_vocabulary_spells_every_byte_json_text_holds():
    """SmolLM2's vocabulary has no token for 21 bytes: 6 control characters (JSON escapes them)
    and bytes that never begin a character below U+40000 in UTF-8; no reply can hold them."""
    from constrained_spec.model.models import load_tokenizer

    vocab = token_vocabulary(load_tokenizer())
    printable = set(range(0x20, 0x7F)) | set(range(0x80, 0xC0)) | set(range(0xC2, 0xF1))
    assert not printable & set(vocab.missing_bytes), vocab.missing_bytes
    assert set(vocab.missing_bytes) <= set(range(0x20)) | {0xC0, 0xC1} | set(range(0xF1, 0x100))


def test_fits_is_the_rule(tiny_tokenizer):
    """A token fits iff its state's completion takes at most the room left after it; EOS fits
    iff the text is complete; an illegal token never."""
    vocab = token_vocabulary(tiny_tokenizer)
    c = compile_constraint(vocab, len(tiny_tokenizer) + 6, regex="(ab|ba)+")
    start = c.initial_state
    a = c.tokenize(start, b"a", 1)[0]
    after_a = c.step(start, a)
    assert c.completion(after_a).tokens == 2  # "b", then EOS
    assert budget.fits(c, start, a, 3) and not budget.fits(c, start, a, 2)
    after_ab = c.step(after_a, c.tokenize(after_a, b"b", 1)[0])
    assert c.accepting(after_ab) and budget.fits(c, after_ab, c.eos_id, 1)
    assert not budget.fits(c, start, c.eos_id, 5)
    assert not budget.fits(c, start, a, 1)
    assert not budget.fits(c, start, vocab.ids_by_bytes[b"x"], 99)


def test_a_byte_level_matcher_that_stops_leaves_no_completion(tiny_tokenizer):
    """llguidance's parser limits may stop the byte-level matcher on a path the model's tokens
    took (a large schema's rows grow a byte at a time): that state then has no completion, so
    its token does not fit; never an error in the middle of a reply."""
    vocab = token_vocabulary(tiny_tokenizer)
    c = compile_constraint(vocab, len(tiny_tokenizer) + 6, regex="(ab|ba)+")
    assert c.completion(c.initial_state).text == b"ab"

    class Stopped:
        def deep_copy(self):
            return self

        def consume_token(self, token):
            return False

    c._byte_matchers[0] = Stopped()  # the root's: every other state's starts from it
    b = c.tokenize(c.initial_state, b"b", 1)[0]  # not the completion's first byte: walked
    assert c.step(c.initial_state, b) is not None
    assert c.completion(c.step(c.initial_state, b)) is None
    assert not budget.fits(c, c.initial_state, b, 99)


def test_redrawn_tokens_are_draws_from_the_rest():
    """budget.redrawn: after the token that a uniform u drew is removed, the draw from the
    rescaled uniform is one from the renormalised rest; integrated over a fine grid of u, the
    joint distribution of (first, second) is p(a) p(b) / (1 - p(a))."""
    p = torch.tensor([0.1, 0.4, 0.0, 0.3, 0.2])
    cdf = torch.cumsum(p.double(), 0)
    grid, joint = 20000, {}
    for i in range(grid):
        u = (i + 0.5) / grid
        first = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True))
        second = next(budget.redrawn(p, first, u))
        joint[first, second] = joint.get((first, second), 0) + 1 / grid
    for (a, b), mass in joint.items():
        assert a != b and p[b] > 0
        assert mass == pytest.approx(float(p[a] * p[b] / (1 - p[a])), abs=2e-3)
    assert len(joint) == 12


@pytest.mark.parametrize("prompt", ["yes no yes", "Alice is 30", '{"name": "Alice", "age": 30}'])
def test_a_greedy_reply_that_fits_is_unchanged_bit_for_bit(prompt, tiny_target, tiny_tokenizer):
    """The reply the masked baseline gives without the budget mask, given the budget it needs
    (at each position, room for the completion after the token taken): the same tokens, the mask
    tight at one position at least; one token less and the mask removes an argmax."""
    gen = Generator(tiny_target, tiny_tokenizer)
    c = gen.compile(schema=PERSON)
    free = gen.generate(prompt, schema=PERSON, max_new_tokens=200, budget_mask=False)
    assert free.finish_reason == "stop"
    tokens, state, needed = free.token_ids + [c.eos_id], c.initial_state, []
    for j, token in enumerate(tokens):
        after = c.step(state, token)
        needed.append(j + 1 + c.completion(after).tokens)
        state = after
    budget_ = max(needed)
    fitted = gen.generate(prompt, schema=PERSON, max_new_tokens=budget_)
    assert fitted.token_ids == free.token_ids and fitted.finish_reason == "stop"
    assert fitted.stats.budget_removed == 0
    tight = gen.generate(prompt, schema=PERSON, max_new_tokens=budget_ - 1)
    assert tight.token_ids != free.token_ids and tight.finish_reason == "budget"
    wide = gen.generate(prompt, schema=PERSON, max_new_tokens=256)
    assert wide.token_ids == free.token_ids


@pytest.mark.parametrize("drafter", ["lookup", "model", "head"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculation_equals_the_baseline_under_a_tight_budget(
    drafter, k, tiny_target, tiny_draft, tiny_tokenizer
):
    """Replies the budget shapes (the tiny target loops in digits and strings): speculation
    commits the baseline's tokens (up to a near-tie), both finish valid."""
    draft = {
        "lookup": CompositeDrafter(),
        "model": tiny_draft,
        "head": random_head(tiny_target),
    }[drafter]
    gen = Generator(tiny_target, tiny_tokenizer, draft=draft)
    shaped = 0
    for schema in (PERSON, NESTED):
        c = gen.compile(schema=schema)
        shortest = c.completion(c.initial_state).tokens
        for extra in (0, 3, 11):
            for prompt in ("hello", "yes no yes"):
                args = dict(schema=schema, max_new_tokens=shortest + extra)
                base = gen.generate(prompt, speculative=False, **args)
                spec = gen.generate(prompt, num_draft_tokens=k, **args)
                ids = tiny_tokenizer.encode(prompt)
                assert_greedy_match(tiny_target, c, ids, base.token_ids, spec.token_ids)
                for r in (base, spec):
                    assert (
                        r.finish_reason in ("stop", "budget")
                        and len(r.token_ids) < shortest + extra
                    )
                    jsonschema.validate(r.value, schema)
                shaped += base.finish_reason == "budget"
                assert spec.stats.drafted > 0
    assert shaped >= 4, f"the budget shaped {shaped} replies: the test checked little"


@pytest.mark.parametrize(
    "case",
    [
        dict(speculative=False),
        dict(drafter="lookup+forced"),
        dict(drafter="model"),
        dict(drafter="model", temperature=0.8, top_k=3),
        dict(drafter="head", top_p=0.8),
    ],
    ids=["baseline", "lookup+forced", "model", "model-top_k", "head-top_p"],
)
def test_sampling_under_the_budget_is_exact(
    case, tiny_target, tiny_draft, tiny_tokenizer, monkeypatch
):
    """Samples of an unbounded language with a budget of 5 tokens against the enumerated
    distribution of masked sampling under the grammar and budget masks (top-k / top-p taken over
    the grammar-masked policy, then the budget: testing.budget_policy). The budget must remove
    much of the policy's mass at several states (else the test would check little) and end
    every reply in time."""
    case = dict(case)
    kind = case.pop("drafter", None)
    draft = testing.drafter_named(kind, tiny_target, tiny_draft)
    gen = Generator(tiny_target, tiny_tokenizer, draft=draft)
    settings = {"temperature": 1.0, "num_draft_tokens": 3, **case}
    prompt = tiny_tokenizer.encode("yes no yes ab ba")
    c = gen.compile(regex=LOOPING)
    policy = (settings["temperature"], settings.get("top_k"), settings.get("top_p"))
    removed = []  # at each enumerated state, the policy's mass the budget mask removed
    real = testing.budget_policy

    def counted(policy, *args):
        kept = real(policy, *args)
        removed.append(sum(p for t, p in policy.items() if t not in kept))
        return kept

    monkeypatch.setattr(testing, "budget_policy", counted)
    exact = sequence_distribution(tiny_target, c, prompt, *policy, budget=5)
    assert sum(m > 0.2 for m in removed) >= 5, f"the budget removed little: {removed}"
    samples, shaped, sources = [], 0, set()
    for seed in range(N_SAMPLES):
        res = gen.generate(
            prompt,
            regex=LOOPING,
            seed=seed,
            max_new_tokens=5,
            on_round=lambda r: sources.update(r.sources),
            **settings,
        )
        assert res.finish_reason in ("stop", "budget") and c.accepts(res.text)
        samples.append(tuple(res.token_ids))
        shaped += res.finish_reason == "budget"
    p_value, tv = chi_square(samples, exact)
    assert p_value > 1e-3, f"chi-square p={p_value:.2e}, TV={tv:.3f}"
    assert shaped > N_SAMPLES // 10, f"only {shaped} replies were shaped by the budget"
    if kind is not None:
        assert sources - {"forced"}, f"nothing was drafted: {sources}"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_tight_budget_always_gives_a_valid_reply(temperature, tiny_target, tiny_tokenizer):
    """Every schema and regex here, every budget from its shortest reply up: the reply finishes
    in time and the constraint (and jsonschema) accepts it."""
    gen = Generator(tiny_target, tiny_tokenizer, draft=CompositeDrafter())
    checked = shaped = 0
    for given in [{"schema": s} for s in SCHEMAS] + [{"regex": r} for r in REGEXES]:
        c = gen.compile(**given)
        shortest = c.completion(c.initial_state).tokens
        for extra in range(0, 14, 2):
            for seed in range(3 if temperature else 1):
                res = gen.generate(
                    "hello", max_new_tokens=shortest + extra, temperature=temperature, seed=seed,
                    **given,
                )  # fmt: skip
                assert res.finish_reason in ("stop", "budget"), res
                assert len(res.token_ids) < shortest + extra + 1 and c.accepts(res.text)
                if "schema" in given:
                    jsonschema.validate(res.value, given["schema"])
                checked += 1
                shaped += res.finish_reason == "budget"
    assert checked > 40 and shaped > checked // 4, (checked, shaped)


def test_a_budget_below_the_shortest_reply_is_refused_before_any_model_work(tiny_tokenizer):
    """Named with both numbers, and the way out; raised by the request's checks (no forward)."""
    gen = Generator(NoForward(), tiny_tokenizer)
    shortest = gen.compile(schema=PERSON).completion(0)
    with pytest.raises(GenerationInputError) as e:
        gen.row(dict(prompt="hello", schema=PERSON, max_new_tokens=shortest.tokens - 1))
    message = str(e.value)
    assert f"max_new_tokens={shortest.tokens - 1}" in message
    assert f"{shortest.tokens} tokens" in message and "budget_mask=False" in message
    gen.row(dict(prompt="hello", schema=PERSON, max_new_tokens=shortest.tokens))
    gen.row(dict(prompt="hello", schema=PERSON, max_new_tokens=3, budget_mask=False))


def test_without_a_completion_the_mask_is_off_and_says_so(tiny_target, tiny_tokenizer):
    """A constraint whose shortest text is longer than a walk goes (closing.MAX_BYTES): no
    completion is known, so the budget mask cannot vouch for a reply: a BudgetMaskWarning, and
    the reply is cut at max_new_tokens as without the mask."""
    gen = Generator(tiny_target, tiny_tokenizer)
    with pytest.warns(BudgetMaskWarning, match="budget mask is off"):
        res = gen.generate("hello", regex="a{5000}", max_new_tokens=4)
    assert res.finish_reason == "length" and len(res.token_ids) == 4


class NoForward(torch.nn.Module):
    """A target that fails if it is ever run: the checks must not need it."""

    def __init__(self):
        super().__init__()
        self.config = testing.tiny_model(testing.tiny_tokenizer(), seed=0).config
        self.lm_head = torch.nn.Linear(2, self.config.vocab_size, bias=False)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, *args, **kwargs):
        raise AssertionError("the model ran")
