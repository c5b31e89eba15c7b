"""Every KV-cache operation in one place: transformers 5's DynamicCache (its API quirks stay
here) and the compact forward's cache (``llama.CompactCache``, with the same two methods).

Invariant, asserted after each round: a cache holds exactly the committed tokens minus the last
one, which is fed at the start of the next verify (or draft) pass.
"""

from __future__ import annotations

import inspect
from functools import cache as memoize
from typing import TYPE_CHECKING, NamedTuple

import torch

from .llama import CompactLlama

if TYPE_CHECKING:  # transformers loads only for a float target (≈ 0.5 s to import)
    from transformers import DynamicCache


def new_cache(model):
    if isinstance(model, CompactLlama):
        return model.new_cache()
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cached_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions. transformers 5: ``crop(-n)`` drops the last n."""
    drop = cached_length(cache) - length
    assert drop >= 0, f"cannot crop a cache of {cached_length(cache)} positions to {length}"
    if drop:
        cache.crop(-drop)


class Prefilled(NamedTuple):
    features: torch.Tensor | None  # the LM head's inputs over the prompt (n, d), where asked for
    cached: int  # how many of its tokens came from a kept prompt (llama.PromptCache)


@torch.inference_mode()
def prefill(model, cache, input_ids: list[int], device, features: bool = False) -> Prefilled:
    """Feed a prompt into an empty ``cache``. No logits: the decode loop never reads the
    prompt's (the LM head over every prompt position cost a fifth of a 300-token prefill). The
    compact forward copies what it can from a kept prompt (``CompactLlama.feed_prompt``)."""
    if isinstance(model, CompactLlama):
        return Prefilled(*model.feed_prompt(input_ids, cache))
    if features:
        return Prefilled(forward(model, cache, input_ids, device, features)[1], 0)
    ids = torch.tensor([input_ids], dtype=torch.long, device=device)  # (1, n)
    model(input_ids=ids, use_cache=True, logits_to_keep=1, **{_cache_argument(type(model)): cache})
    return Prefilled(None, 0)


@torch.inference_mode()
def forward(
    model, cache: DynamicCache, input_ids: list[int], device, features: bool = False, masks=None
):
    """Feed ``input_ids`` after what the cache holds; returns their logits, (n, V) float32, and
    with ``features`` also the LM head's inputs, (n, d): what a trained draft head reads.
    ``masks`` (n, V) bool, the legal tokens at each position, lets the compact forward skip the
    logits of illegal ones (they come back as −inf or as computed: callers mask them)."""
    if isinstance(model, CompactLlama):
        ids = torch.tensor(input_ids, dtype=torch.long, device=device)
        logits, hidden = model(ids, cache, masks=masks)
        return (logits, hidden) if features else logits
    ids = torch.tensor([input_ids], dtype=torch.long, device=device)  # (1, n)
    kwargs = {_cache_argument(type(model)): cache}
    seen = []
    hook = (
        model.get_output_embeddings().register_forward_pre_hook(
            lambda module, args: seen.append(args[0])
        )
        if features
        else None
    )
    try:
        logits = model(input_ids=ids, use_cache=True, **kwargs).logits  # (1, n, V)
    finally:
        if hook is not None:
            hook.remove()
    return (logits[0].float(), seen[-1][0]) if features else logits[0].float()


def context_of(model) -> int:
    """The positions ``model`` runs: a compact model's (with LongRoPE its original context:
    families.context_of), a transformers model's max_position_embeddings (unbounded if none)."""
    if isinstance(model, CompactLlama):
        return model.shape.context
    return getattr(model.config, "max_position_embeddings", None) or 2**31


def head_rows(model, ids: torch.Tensor) -> torch.Tensor:
    """The LM head's rows ``ids`` (n, d) in float32, ÷ the model's logit divisor (Granite's
    logits_scaling), so that features · rows are the logits its forward gives: a compact model's
    head dequantizes only those where it keeps blocks (kernels.BlockRows); a transformers
    model's are its weight's."""
    if isinstance(model, CompactLlama):
        rows, divisor = model.lm_head.rows(ids), model.block.logit_scale
    else:
        rows = model.get_output_embeddings().weight.detach()[ids].float()
        divisor = getattr(model.config, "logits_scaling", 1.0)  # transformers' Granite divides
    return rows / divisor if divisor != 1.0 else rows


def forward_rows(
    model, caches: list, rows: list[list[int]], device, masks=None, features: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's ids fed after its own cache: the logits of every row's positions, one row after
    another, (Σ n_i, V) (``masks``: their legal tokens in the same order, as in ``forward``),
    and with ``features`` the LM head's inputs there, (Σ n_i, d). The compact forward takes
    every row in one pass (the weights read once); transformers' forward takes them one after
    another (its caches would need padding and position bookkeeping to share a pass)."""
    if isinstance(model, CompactLlama):
        ids = [torch.tensor(row, dtype=torch.long, device=device) for row in rows]
        logits, hidden = model.forward_rows(ids, caches, masks=masks)
        return logits, hidden if features else None
    outs = [forward(model, cache, row, device, features) for cache, row in zip(caches, rows)]
    if not features:
        return torch.cat(outs), None
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


@memoize
def _cache_argument(model_class) -> str:
    """transformers 5.2x renamed ``past_key_values`` to ``cache`` (the old name warns)."""
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
