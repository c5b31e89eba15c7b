"""The sampling math on its own: the worked examples of docs/exactness.md and the policy."""

import pytest
import torch

from constrained_spec.decoding.sample import (
    SamplingConfig,
    acceptance_probs,
    draw,
    first_above,
    greedy_outcome,
    one_hot,
    policy,
    residual,
    verify_sampled,
)


def output_distribution(p, q):
    """Exact distribution of the committed token after one draft from q: Σ_x q(x)·accept(x)·δ_x
    + P(reject)·residual, computed from the library's own acceptance and residual."""
    v = len(p)
    accept = acceptance_probs(p.expand(v, -1), q.expand(v, -1), torch.arange(v)).nan_to_num(1.0)
    rejected = (q * (1 - accept)).sum()
    return q * accept + rejected * residual(p, q)


def test_worked_example_one():
    p, q = (
        torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64),
        torch.tensor([0.5, 0.4, 0.1], dtype=torch.float64),
    )
    accept = acceptance_probs(p.expand(3, -1), q.expand(3, -1), torch.arange(3))
    assert accept.tolist() == pytest.approx([1.0, 0.75, 1.0])
    assert (q * accept).sum().item() == pytest.approx(0.9)
    assert residual(p, q).tolist() == pytest.approx([1.0, 0.0, 0.0])
    assert output_distribution(p, q).tolist() == pytest.approx(p.tolist())


def test_worked_example_two_cat_dog_fish():
    p, q = (
        torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64),
        torch.tensor([0.6, 0.2, 0.2], dtype=torch.float64),
    )
    accept = acceptance_probs(p.expand(3, -1), q.expand(3, -1), torch.arange(3))
    assert accept[0].item() == pytest.approx(0.8333, abs=1e-4)
    assert residual(p, q).tolist() == pytest.approx([0.0, 1.0, 0.0])
    assert output_distribution(p, q).tolist() == pytest.approx(p.tolist())


def test_one_hot_draft_accepts_with_p_and_resamples_without_it():
    p = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    q = one_hot([1], 3, "cpu").double()[0]
    assert acceptance_probs(p[None], q[None], torch.tensor([1])).item() == pytest.approx(0.5)
    assert residual(p, q).tolist() == pytest.approx([0.4, 0.0, 0.6])
    assert output_distribution(p, q).tolist() == pytest.approx(p.tolist())


def test_policy_masks_then_tempers_then_truncates():
    logits = torch.tensor([[2.0, 1.0, 0.0, 5.0]])
    mask = torch.tensor([[True, True, True, False]])  # the best token is illegal
    assert policy(logits, mask, SamplingConfig(1.0))[0, 3] == 0
    full = torch.softmax(torch.tensor([2.0, 1.0, 0.0]) / 0.5, -1)
    assert policy(logits, mask, SamplingConfig(0.5))[0, :3].tolist() == pytest.approx(full.tolist())
    top1 = policy(logits, mask, SamplingConfig(1.0, top_k=1))[0]
    assert top1.tolist() == [1.0, 0.0, 0.0, 0.0]
    top_p = policy(logits, mask, SamplingConfig(1.0, top_p=0.8))[0]  # 0.665 < 0.8 → keep 2
    kept = torch.softmax(torch.tensor([2.0, 1.0]), -1)
    assert top_p.tolist() == pytest.approx(kept.tolist() + [0.0, 0.0])


def test_verify_sampled_matches_the_exact_output_distribution():
    """One verify round, many times: the first committed token is distributed as p[0]."""
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    q = torch.tensor([[0.5, 0.4, 0.1]])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(20000):
        draft = torch.multinomial(q[0], 1, generator=gen)
        n, token = verify_sampled(p, q, draft, gen)
        counts[draft[0] if n == 1 else token] += 1
    assert (counts / counts.sum() - p[0]).abs().max() < 0.015  # 4+ standard errors at n=20000


def test_draw_follows_the_distribution_and_never_draws_a_zero():
    """Chi-square against the row (zeros first, between and last, where an off-by-one in the
    CDF inversion would land), and the rounding edge: a uniform draw times the total that
    rounds up to the total still picks the last token of positive mass."""
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0, 0.0])
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.stack([draw(probs, gen) for _ in range(20000)]), minlength=7)
    assert counts[probs == 0].sum() == 0
    expected = 20000 * probs[probs > 0]
    chi2 = float(((counts[probs > 0] - expected) ** 2 / expected).sum())
    assert chi2 < 13.8  # 2 degrees of freedom, p = 0.001
    cdf = torch.cumsum(probs.double(), 0)
    assert first_above(cdf, cdf[-1:].clone()) == 4
    assert first_above(cdf, torch.zeros(1, dtype=torch.float64)) == 1


def test_greedy_verification_accepts_the_masked_argmax_prefix_and_corrects():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    masks = torch.tensor([[True, True, True], [False, True, True], [True, True, True]])
    best = logits.masked_fill(~masks, float("-inf")).argmax(-1).tolist()  # as loop.verify takes it
    assert greedy_outcome(best, [1, 0]) == (1, 2)  # token 0 is masked at row 1
    assert greedy_outcome(best, [1, 2]) == (2, 2)  # all accepted: bonus from the last row
