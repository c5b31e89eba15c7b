"""Sampling math: the policy and the exact acceptance rule, as small pure functions.

Notation follows Leviathan et al. 2023 (Alg. 1): ``target_probs`` is p, ``draft_probs`` is q.
Both are produced by the same ``policy`` from masked logits, so p is the masked, renormalised
target distribution and the committed tokens are distributed exactly as plain masked sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 → greedy: argmax of the masked target logits
    top_k: int | None = None  # keep the k most likely legal tokens
    top_p: float | None = None  # keep the smallest set whose mass reaches top_p

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def policy(logits: torch.Tensor, mask: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """renormalise(top_p(top_k(softmax((logits + mask) / T)))) row-wise; (..., V) → (..., V)."""
    logits = logits.masked_fill(~mask, float("-inf")) / cfg.temperature
    if cfg.top_k is not None:
        kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p is not None:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= cfg.top_p  # keep tokens until the mass reaches top_p
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def one_hot(tokens: list[int], width: int, device) -> torch.Tensor:
    """q of a deterministic draft (lookup, forced tokens): all mass on the proposed token."""
    q = torch.zeros(len(tokens), width, device=device)  # (k, V)
    q[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long, device=device)] = 1.0
    return q


def acceptance_probs(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, draft: torch.Tensor
) -> torch.Tensor:
    """min(1, p(x)/q(x)) for each draft token x; (k, V), (k, V), (k,) → (k,)."""
    p = target_probs.gather(-1, draft[:, None])[:, 0]
    q = draft_probs.gather(-1, draft[:, None])[:, 0]
    return torch.clamp(p / q, max=1.0)  # q(x) > 0: x was drawn from q


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)): where to sample after a rejection; (..., V) → (..., V).

    A rejection has probability Σ max(0, p − q) > 0 whenever it happens, so the sum is positive
    (up to rounding: fall back to p, which rejection only reaches when p ≈ q)."""
    r = torch.clamp(target_probs - draft_probs, min=0.0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 1e-12, r / total.clamp(min=1e-30), target_probs)


def verify_sampled(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft: torch.Tensor,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan Alg. 1 on device: (k+1, V) p rows, (k, V) q rows, (k,) draft tokens.

    Returns (n_accepted, next_token) as 0-d tensors, with no host sync: the first rejection at
    position n draws from the residual there; if all k are accepted the bonus comes from p[k]."""
    k = draft.shape[0]
    u = torch.rand(k, generator=generator, device=draft.device)
    accepted = u < acceptance_probs(target_probs[:k], draft_probs, draft)  # (k,)
    n = torch.cumprod(accepted.int(), dim=0).sum()  # length of the accepted prefix
    padded_q = torch.cat([draft_probs, torch.zeros_like(target_probs[:1])])  # (k+1, V), q_k = 0
    row = residual(target_probs[n], padded_q[n])  # the residual of q = 0 is p: the bonus row
    return n, draw(row, generator)


def verify_deterministic(
    target_probs: torch.Tensor, draft: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact rule for a deterministic draft (one-hot q: forced, grammar, lookup tokens or
    none), drawing the target's own token at every position: (k+1, V) p rows, (k,) draft tokens
    → (n_accepted, next_token, the k+1 drawn tokens) as tensors, with no host sync.

    Position j draws t_j ~ p_j by inverting its CDF at the stream's j-th uniform (as ``draw``);
    the draft is accepted up to the first j with t_j ≠ d_j, and t_j is committed there (after
    all k, t_k is the bonus). Each committed token is thus a draw from p at its prefix: for a
    one-hot q this is Leviathan's rule (accept x with p(x), else a draw from p without x), with
    the coupling that the committed tokens are the draws a row without drafts would make from
    the same uniforms. The caller then rewinds the generator to n + 1 uniforms used (``rewind``):
    a seeded row commits the same tokens whatever it drafts (the baseline's, where the pass's
    logits are the step's)."""
    k = draft.shape[0]
    cdf = torch.cumsum(target_probs.double(), dim=-1)  # (k+1, V)
    u = torch.rand(k + 1, generator=generator, dtype=torch.float64, device=draft.device)
    total = cdf[:, -1]
    u = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, u[:, None], right=True)[:, 0]  # (k+1,)
    n = torch.cumprod((drawn[:k] == draft).int(), dim=0).sum()
    return n, drawn[n], drawn


def rewind(generator: torch.Generator, state: torch.Tensor, used: int) -> None:
    """Set ``generator`` to ``state`` advanced by ``used`` float64 uniforms (one per committed
    token of ``verify_deterministic``)."""
    generator.set_state(state)
    torch.rand(used, generator=generator, dtype=torch.float64, device=generator.device)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index from a probability row (V,) as a 0-d tensor, by inverting its CDF at a uniform
    draw (in float64): on a CPU a twentieth of torch.multinomial's cost on a 49k-token row
    (`python benchmarks/step_cost.py draw`)."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device)
    return first_above(cdf, u * cdf[-1])


def first_above(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index whose cumulative mass exceeds ``u`` (1,): a token of positive mass, since
    the mass rises there. ``u`` is held below the total, which u·total may round up to."""
    u = torch.minimum(u, torch.nextafter(cdf[-1:], torch.zeros_like(u)))
    return torch.searchsorted(cdf, u, right=True)[0]


def greedy_outcome(best: list[int], draft: list[int]) -> tuple[int, int]:
    """Greedy verification, on the host, from each position's masked argmax ``best`` (k+1): a
    draft token is accepted iff it is the argmax at its position; then the argmax after the
    accepted ones (the correction, or the bonus when all are accepted)."""
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return n, best[n]
