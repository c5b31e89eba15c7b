"""Exactness of the speculative sampler on tiny models: the committed sequences are distributed
exactly as plain masked sampling from the target, whatever the draft.

The reference distribution is enumerated: every token sequence of a small finite language, with
its probability under the masked target policy (fresh forwards, no cache, no speculation), the
policy written out plainly in constrained_spec.testing rather than the library's own."""

import copy

import pytest
import torch

from constrained_spec import Generator, SamplingConfig
from constrained_spec.decoding.drafters import CompositeDrafter, logits_width, model_drafter
from constrained_spec.model import kernels
from constrained_spec.testing import chi_square, random_head, sequence_distribution

REGEX = "(ab|ba|yes|no){1,2}"
FORCED_REGEX = "(yes|no)\\{\\}(ab|ba)"  # "{" and "}" are single-token (forced) states
LOOKUP_PROMPT = "hello yes{}ab no{}ba"  # continuations for prompt lookup to copy
N_SAMPLES = 1500
# min_confidence of the early-stop cases. The tiny target's first choice under REGEX is spread
# (top probability 0.30, then 0.19): a first draft is made, a second one mostly not, and a stop
# that looked at the drawn token would keep only the most likely one (a large bias).
CONFIDENCE = 0.25
P_VALUE_FLOOR = 1e-3  # fixed seeds: each run draws the same samples, so this is deterministic


def masked_sequence_distribution(target, constraint, prompt, cfg):
    """{token sequence (EOS excluded): probability} under plain masked sampling from the target."""
    return sequence_distribution(target, constraint, prompt, cfg.temperature, cfg.top_k, cfg.top_p)


def assert_same_distribution(gen, exact, samples_kwargs, expect_match=True):
    prompt, regex = samples_kwargs.pop("prompt"), samples_kwargs.pop("regex", REGEX)
    samples = []
    for seed in range(N_SAMPLES):
        res = gen.generate(prompt, regex=regex, seed=seed, max_new_tokens=12, **samples_kwargs)
        assert res.finish_reason == "stop"
        samples.append(tuple(res.token_ids))
    p_value, tv = chi_square(samples, exact)
    if expect_match:
        assert p_value > P_VALUE_FLOOR, f"chi-square p={p_value:.2e}, TV={tv:.3f}"
    else:
        assert p_value < 1e-6, f"the test cannot tell these apart: p={p_value:.2e}, TV={tv:.3f}"
    return p_value, tv


def drafter_for(kind, target, draft):
    if kind == "anti":  # a draft that disagrees strongly: the target with its output negated
        anti = copy.deepcopy(target)
        with torch.no_grad():
            if isinstance(anti.lm_head, kernels.Q8Head):  # Q8_0 blocks: negated, still Q8_0
                anti.lm_head = kernels.Q8Head(-anti.lm_head.dequantized())
                if anti.matmul:
                    anti.lm_head.use_kernel(anti.matmul)
            else:
                anti.lm_head.weight.neg_()
        return anti
    if kind == "lookup+forced":  # deterministic drafts only (one-hot q)
        return CompositeDrafter(model=None)
    if kind == "confident":  # model drafts stop once the chain's estimated chance drops
        return model_drafter(draft, logits_width(target), min_confidence=CONFIDENCE)
    if kind == "head":  # a random draft head: q = 0 on odd ids, copy proposals mixed in
        return random_head(target)
    return draft


@pytest.mark.parametrize(
    "case",
    [
        dict(temperature=1.0, num_draft_tokens=3),
        dict(temperature=0.7, top_p=0.9, num_draft_tokens=4),
        dict(temperature=1.0, num_draft_tokens=4, drafter="anti"),
        dict(temperature=1.0, num_draft_tokens=2, regex=FORCED_REGEX, prompt=LOOKUP_PROMPT),
        dict(
            temperature=0.8,
            top_k=5,
            num_draft_tokens=2,
            regex=FORCED_REGEX,
            prompt=LOOKUP_PROMPT,
            drafter="lookup+forced",
        ),
        dict(
            temperature=1.0,
            num_draft_tokens=4,
            adaptive_k=True,
            regex=FORCED_REGEX,
            prompt=LOOKUP_PROMPT,
            drafter="anti",
        ),
        dict(
            temperature=1.0,
            num_draft_tokens=3,
            regex=FORCED_REGEX,
            prompt=LOOKUP_PROMPT,
            drafter="head",
        ),
        # a prompt whose tokens come back: about a third of the head's drafts there carry a copy
        # proposal, which the open gate mixes into q (28 of 81 with 20 seeds, counted once)
        dict(temperature=1.0, num_draft_tokens=3, prompt="yesab", drafter="head"),
        dict(temperature=1.0, num_draft_tokens=4, drafter="confident"),
    ],
    ids=[
        "T1",
        "T0.7-top_p",
        "anti-draft",
        "model+lookup+forced",
        "lookup+forced-top_k",
        "adaptive-k-anti",
        "head+lookup+forced",
        "head-copy-gate",
        "model-min-confidence",
    ],
)
def test_speculative_sampling_is_exact(case, tiny_target, tiny_draft, tiny_tokenizer):
    case = dict(case)
    draft = drafter_for(case.pop("drafter", None), tiny_target, tiny_draft)
    case["prompt"] = tiny_tokenizer.encode(case.get("prompt", "hello"))
    gen = Generator(tiny_target, tiny_tokenizer, draft=draft)
    cfg = SamplingConfig(case["temperature"], case.get("top_k"), case.get("top_p"))
    constraint = gen.compile(regex=case.get("regex", REGEX))
    exact = masked_sequence_distribution(tiny_target, constraint, case["prompt"], cfg)
    sources = {}
    case["on_round"] = lambda rnd: sources.update(dict.fromkeys(rnd.sources))
    assert_same_distribution(gen, exact, case)
    if case.get("regex") == FORCED_REGEX:
        assert {"forced", "lookup"} <= set(sources), f"sources exercised: {set(sources)}"
    if draft is not None and not isinstance(draft, CompositeDrafter):
        assert "model" in sources, f"the draft model never drafted: {set(sources)}"


@pytest.mark.parametrize(
    "case",
    [
        dict(temperature=1.0, num_draft_tokens=3),
        dict(temperature=0.7, top_p=0.9, num_draft_tokens=4),
        dict(temperature=1.0, num_draft_tokens=4, drafter="anti"),
        dict(
            temperature=1.0,
            num_draft_tokens=3,
            regex=FORCED_REGEX,
            prompt=LOOKUP_PROMPT,
            drafter="head",
        ),
    ],
    ids=["T1", "T0.7-top_p", "anti-draft", "head+lookup+forced"],
)
def test_speculative_sampling_is_exact_on_int4_weights(
    case, tiny_int4_target, tiny_draft, tiny_tokenizer
):
    """The same test on the compact int4 target (Q4_1 blocks, bf16 activations): the reference
    enumerates its own policy, so exactness holds whatever the quantization costs in accuracy."""
    case = dict(case)
    draft = drafter_for(case.pop("drafter", None), tiny_int4_target, tiny_draft)
    case["prompt"] = tiny_tokenizer.encode(case.get("prompt", "hello"))
    gen = Generator(tiny_int4_target, tiny_tokenizer, draft=draft)
    assert gen.weights == "int4"
    cfg = SamplingConfig(case["temperature"], case.get("top_k"), case.get("top_p"))
    constraint = gen.compile(regex=case.get("regex", REGEX))
    exact = masked_sequence_distribution(tiny_int4_target, constraint, case["prompt"], cfg)
    sources = {}
    case["on_round"] = lambda rnd: sources.update(dict.fromkeys(rnd.sources))
    p_value, tv = assert_same_distribution(gen, exact, case)
    print(f"int4 chi-square p={p_value:.3f}, TV={tv:.3f}")
    assert "model" in sources, f"the draft never drafted: {set(sources)}"
    if case.get("regex") == FORCED_REGEX:
        assert {"forced", "lookup"} <= set(sources), f"sources exercised: {set(sources)}"


def test_the_statistical_test_has_power(tiny_target, tiny_draft, tiny_tokenizer):
    prompt = tiny_tokenizer.encode("hello")
    """Negative control: samples from the draft's own masked policy must fail the same test."""
    gen = Generator(tiny_draft, tiny_tokenizer)
    exact = masked_sequence_distribution(
        tiny_target, gen.compile(regex=REGEX), prompt, SamplingConfig(1.0)
    )
    exact_draft = masked_sequence_distribution(
        tiny_draft, gen.compile(regex=REGEX), prompt, SamplingConfig(1.0)
    )
    support = {k: exact.get(k, 0.0) + 1e-9 for k in set(exact) | set(exact_draft)}
    assert_same_distribution(
        gen, support, dict(prompt=prompt, temperature=1.0, speculative=False), expect_match=False
    )


class SwappedTarget:
    """A draft model that is the target with its two most likely legal tokens swapped: q close
    to p but not equal, with top probabilities either side of a stopping threshold — where a
    stop that looks at the drawn token shows its bias."""

    def __init__(self, target):
        self.target = target

    @torch.no_grad()
    def scores(self, context, state, constraint):
        logits = self.target(torch.tensor([context])).logits[0, -1].float()
        mask = constraint.mask(state)
        if mask.sum() >= 2:
            top2 = logits.masked_fill(~mask, float("-inf")).topk(2).indices
            logits[top2] = logits[top2.flip(0)]
        return logits, mask, None


class StopOnDrawnToken(CompositeDrafter):
    """The wrong early stop: drop a drawn token when its own probability makes the chain
    unlikely. Which tokens survive then depends on their value, so q no longer describes them."""

    def _model_token(self, context, state, constraint, sampling, generator, chance):
        threshold, self.min_confidence = self.min_confidence, 0.0
        try:
            drawn = super()._model_token(context, state, constraint, sampling, generator, chance)
        finally:
            self.min_confidence = threshold
        if drawn is None:
            return None
        token, q, _ = drawn
        chance *= float(q[token])
        return None if chance < threshold else (token, q, chance)


@pytest.mark.parametrize(
    "rule", [CompositeDrafter, StopOnDrawnToken], ids=["before-draw", "on-drawn-token"]
)
def test_early_stop_is_exact_only_when_decided_before_drawing(rule, tiny_target, tiny_tokenizer):
    """min_confidence stops on the policy's top probability, known before the draw: exact.
    Negative control: stopping on the drawn token's own probability must fail the same test."""
    prompt = tiny_tokenizer.encode("hello")
    drafter = rule(SwappedTarget(tiny_target), use_lookup=False, min_confidence=CONFIDENCE)
    gen = Generator(tiny_target, tiny_tokenizer, draft=drafter)
    exact = masked_sequence_distribution(
        tiny_target, gen.compile(regex=REGEX), prompt, SamplingConfig(1.0)
    )
    assert_same_distribution(
        gen,
        exact,
        dict(prompt=prompt, temperature=1.0, num_draft_tokens=4),
        expect_match=rule is CompositeDrafter,
    )


def test_min_confidence_bounds_model_drafts(tiny_target, tiny_draft, tiny_tokenizer):
    gen = Generator(tiny_target, tiny_tokenizer)
    constraint, prompt = gen.compile(regex=REGEX), tiny_tokenizer.encode("hello")
    args = (
        prompt,
        constraint.initial_state,
        constraint,
        4,
        SamplingConfig(),
        torch.Generator().manual_seed(0),
    )
    width = logits_width(tiny_target)
    assert len(model_drafter(tiny_draft, width, use_lookup=False).propose(*args)) >= 2
    assert (
        len(model_drafter(tiny_draft, width, use_lookup=False, min_confidence=1.0).propose(*args))
        == 0
    )


class UniformModel:
    """A draft model with no preference: every legal token equally likely."""

    def scores(self, context, state, constraint):
        mask = constraint.mask(state)
        return torch.zeros(len(mask)), mask, None


def test_no_model_drafts_after_a_lookup_copy(tiny_target, tiny_tokenizer):
    """By default the model stops once a lookup copy is in the draft (a deterministic rule on
    the draft so far, so exact); with model_after_lookup it continues after the copy."""
    gen = Generator(tiny_target, tiny_tokenizer)
    constraint = gen.compile(regex=REGEX)
    prompt = tiny_tokenizer.encode("say yes no. say ")  # the lookup copies "yes" / "no"

    def draft(**options):
        return (
            CompositeDrafter(UniformModel(), **options)
            .propose(
                prompt,
                constraint.initial_state,
                constraint,
                4,
                SamplingConfig(),
                torch.Generator().manual_seed(0),
            )
            .sources
        )

    assert draft()[0] == "lookup" and "model" not in draft(), draft()
    after = draft(model_after_lookup=True)
    assert after[0] == "lookup" and "model" in after, after
