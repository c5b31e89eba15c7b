"""The loop guard (issue 66, decoding/repeats.py): no token that completes an immediate repeat of
a stretch of the reply of MIN_BYTES or more. The rule itself; greedy speculation equal to the
baseline under it, the replies it never touched unchanged and the ones it touched free of
repeats wherever another token was open; sampling under it exactly masked sampling under the
grammar, budget and guard masks (chi-square against the enumeration)."""

import pytest

from constrained_spec import Generator, testing
from constrained_spec.decoding import repeats
from constrained_spec.decoding.budget import fits
from constrained_spec.decoding.drafters import CompositeDrafter
from constrained_spec.testing import PERSON, assert_greedy_match, chi_square, random_head

LOOPING = "(ab|ba|yes|no)+"


def test_the_rule():
    four, one = [4] * 10, [1] * 10
    assert repeats.repeats([1, 2, 3, 1, 2], 3, four)  # 123 123: 12 bytes
    assert not repeats.repeats([1, 2, 3, 1, 2], 4, four)
    assert not repeats.repeats([1, 2, 3, 1, 2], 3, one)  # 3 bytes: shorter than MIN_BYTES
    assert not repeats.repeats([1, 2, 3, 9, 1, 2], 3, four)  # not right after the first copy
    assert repeats.repeats([7, 5], 5, [0, 0, 0, 0, 0, 8, 0, 0])  # one 8-byte token twice
    assert not repeats.repeats([], 5, four)
    assert repeats.repeats([6, 1, 2, 3, 1, 2], 3, [0, 1, 1, 6, 0, 0, 9])  # 8: 1 + 1 + 6
    assert not repeats.repeats([6, 1, 2, 3, 1, 2], 3, [0, 1, 1, 5, 0, 0, 9])  # 7: 6 not in it
    long = list(range(repeats.MAX_PERIOD + 1))  # a stretch longer than compared
    assert not repeats.repeats(long + long[:-1], long[-1], four * 10)


def open_repeats(gen, constraint, reply: list[int], room: int) -> int:
    """Positions of ``reply`` whose token completes an immediate repeat although a legal token
    that fits the budget and repeats nothing was open there."""
    lengths, state, found = gen.vocab.token_lengths, constraint.initial_state, 0
    for j, token in enumerate(reply):
        if repeats.repeats(reply[:j], token, lengths) and any(
            fits(constraint, state, t, room - j) and not repeats.repeats(reply[:j], t, lengths)
            for t in constraint.allowed(state)
        ):
            found += 1
        state = constraint.step(state, token)
    return found


@pytest.mark.parametrize("drafter", ["lookup", "model", "head"])
def test_greedy_speculation_equals_the_baseline_under_the_guard(
    drafter, tiny_target, tiny_draft, tiny_tokenizer
):
    """The tiny target loops in digits and strings: with the guard, speculation commits the
    baseline's tokens (up to a near-tie); a reply the guard never touched is the reply without
    it; one it touched holds no repeat where another token was open."""
    draft = {"lookup": CompositeDrafter(), "model": tiny_draft, "head": random_head(tiny_target)}
    gen = Generator(tiny_target, tiny_tokenizer, draft=draft[drafter])
    touched = untouched = 0
    for given in ({"schema": PERSON}, {"regex": LOOPING}, {"regex": "[a-z ]{1,60}"}):
        c = gen.compile(**given)
        for prompt in ("hello", "yes no yes", "Alice is 30"):
            args = dict(max_new_tokens=48, **given)
            base = gen.generate(prompt, speculative=False, loop_guard=True, **args)
            spec = gen.generate(prompt, loop_guard=True, **args)
            ids = tiny_tokenizer.encode(prompt)
            assert_greedy_match(tiny_target, c, ids, base.token_ids, spec.token_ids)
            assert open_repeats(gen, c, base.token_ids, 48) == 0
            if base.stats.repeats_removed:
                touched += 1
            else:
                free = gen.generate(prompt, speculative=False, **args)
                assert free.token_ids == base.token_ids
                untouched += 1
    assert touched >= 2 and untouched >= 1, (touched, untouched)


@pytest.mark.parametrize(
    "case",
    [dict(speculative=False), dict(drafter="lookup+forced"), dict(drafter="model", top_k=3)],
    ids=["baseline", "lookup+forced", "model-top_k"],
)
def test_sampling_under_the_guard_is_exact(
    case, tiny_target, tiny_draft, tiny_tokenizer, monkeypatch
):
    """Samples of an unbounded language (5 tokens of budget, the guard at 2 bytes so that it
    bites in so few) against the enumerated distribution of masked sampling under the grammar,
    budget and guard masks (testing.guard_policy). The guard must remove much of the policy's
    mass at several states, else the test would check little."""
    monkeypatch.setattr(repeats, "MIN_BYTES", 2)
    case = dict(case)
    kind = case.pop("drafter", None)
    draft = testing.drafter_named(kind, tiny_target, tiny_draft)
    gen = Generator(tiny_target, tiny_tokenizer, draft=draft)
    settings = {"temperature": 1.0, "num_draft_tokens": 3, **case}
    prompt = tiny_tokenizer.encode("yes no yes ab ba")
    c = gen.compile(regex=LOOPING)
    removed, real = [], testing.guard_policy

    def counted(policy, *args):
        kept = real(policy, *args)
        removed.append(sum(p for t, p in policy.items() if t not in kept))
        return kept

    monkeypatch.setattr(testing, "guard_policy", counted)
    policy = (settings["temperature"], settings.get("top_k"), None)
    lengths = gen.vocab.token_lengths
    exact = testing.sequence_distribution(tiny_target, c, prompt, *policy, budget=5, guard=lengths)
    assert sum(m > 0.2 for m in removed) >= 5, f"the masks removed little: {removed}"
    samples, guarded = [], 0
    for seed in range(1500):
        res = gen.generate(prompt, regex=LOOPING, seed=seed, max_new_tokens=5, loop_guard=True,
                           **settings)  # fmt: skip
        assert res.finish_reason in ("stop", "budget") and c.accepts(res.text)
        samples.append(tuple(res.token_ids))
        guarded += res.stats.repeats_removed > 0
    p_value, tv = chi_square(samples, exact)
    assert p_value > 1e-3, f"chi-square p={p_value:.2e}, TV={tv:.3f}"
    assert guarded > 150, f"the guard changed only {guarded} replies"
