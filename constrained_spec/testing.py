"""Helpers for tests and benchmark checks: tiny models built on the spot, a plain reference of
the masked sampling policy and of the distribution it puts on a finite language, and where two
greedy outputs first differ; a server process on a free local port.

Imported by tests/ and benchmarks/ only; it needs ``tokenizers`` and ``transformers`` (both
dependencies of the package) and no network.
"""

from __future__ import annotations

import contextlib
import math
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from . import cache as kv
from .compile import FINISHED, Constraint
from .draft import logits_width
from .head import DraftHead

# A greedy output may differ from the masked baseline only where the baseline's top-2 masked
# logits are closer than this: the logits of a k-token verify pass and of k one-token steps
# differ in the last bits (fp32; more layers, larger differences: 1e-4 was too tight for the
# default model).
NEAR_TIE = 1e-3

SCALE = 8.0  # lm_head gain: distributions peaked enough to be distinct, flat enough to test
CORPUS = (
    '{"name": "Alice", "age": 30}',
    '{"name": "Bob", "age": 7, "ok": true}',
    "abba baab abab",
    "yes no yes no",
    "[1, 2, 3]",
    "Zoë 東京 null false",
)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", None]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok"],
}


def tiny_tokenizer(
    corpus: Sequence[str] = CORPUS,
    vocab_size: int = 320,
    special_tokens: Sequence[str] = ("<eos>",),
    eos_token: str = "<eos>",
    chat_template: str | None = None,
    **special,
):
    """A byte-level BPE tokenizer trained here on ``corpus`` (20 times over); ``special``:
    more special-token roles for PreTrainedTokenizerFast (bos_token=, pad_token=)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(corpus) * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, **special)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def tiny_model(tokenizer, seed: int, layers: int = 2, max_positions: int = 256):
    """A random Llama over ``tokenizer``'s vocabulary, logits padded 6 wide (as real models
    pad them), its LM head scaled by SCALE."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer) + 6,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger logits than the default init: peaked, distinct distributions
        model.lm_head.weight.mul_(SCALE)
    return model


def tiny_int4_generator():
    """A Generator over the tiny target quantized as the default model ships, drafting forced
    tokens and prompt lookup: importable by worker processes (a Ray actor builds its own)."""
    from . import llama
    from .decode import Generator
    from .draft import CompositeDrafter

    tokenizer = tiny_tokenizer()
    target = llama.from_transformers(tiny_model(tokenizer, seed=0), "int4")
    return Generator(target, tokenizer, draft=CompositeDrafter(), cache_dir=None)


def random_head(target, seed: int = 0) -> DraftHead:
    """A draft head with random weights, q = 0 on odd ids, the copy gate open (q mixes in the
    copy proposals)."""
    torch.manual_seed(seed)
    head = DraftHead.for_target(target, torch.arange(0, logits_width(target), 2)).eval()
    with torch.no_grad():
        head.copy_gate.weight.normal_(0, 0.3)
        head.copy_gate.bias.zero_()
    return head


def reference_policy(
    logits: Sequence[float],
    legal: Sequence[int],
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
) -> dict[int, float]:
    """{token: probability} of masked sampling, written out plainly in float64 as an
    independent reference for ``sample.policy``: the legal tokens' softmax at ``temperature``;
    with top_k, only tokens whose logit is at least the k-th largest; with top_p, the most
    likely tokens, in order, until their mass reaches top_p; renormalised."""
    scaled = {t: float(logits[t]) / temperature for t in legal}
    if top_k is not None:
        kth = sorted(scaled.values(), reverse=True)[min(top_k, len(scaled)) - 1]
        scaled = {t: v for t, v in scaled.items() if v >= kth}
    top = max(scaled.values())
    weights = {t: math.exp(v - top) for t, v in scaled.items()}
    total = sum(weights.values())
    probs = {t: w / total for t, w in weights.items()}
    if top_p is not None:
        kept, mass = {}, 0.0
        for t in sorted(probs, key=probs.get, reverse=True):
            if mass >= top_p:
                break
            kept[t], mass = probs[t], mass + probs[t]
        probs = {t: p / mass for t, p in kept.items()}
    return probs


@torch.no_grad()
def last_logits(target, ids: list[int]) -> torch.Tensor:
    """The target's next-token logits after ``ids``, from a fresh cache (a transformers model or
    the compact forward alike)."""
    return kv.forward(target, kv.new_cache(target), ids, next(target.parameters()).device)[-1]


def sequence_distribution(
    target,
    constraint: Constraint,
    prompt: list[int],
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    prune: float = 1e-6,
) -> dict[tuple[int, ...], float]:
    """{token sequence (EOS excluded): probability} under plain masked sampling from ``target``
    (fresh forwards, no cache, no speculation), by enumerating the constraint's language;
    branches below ``prune`` are dropped (their total must stay under 1e-3)."""
    dist: dict[tuple[int, ...], float] = {}
    pruned = 0.0

    def walk(seq: list[int], state: int, prob: float) -> None:
        nonlocal pruned
        logits = last_logits(target, prompt + seq).double().tolist()
        policy = reference_policy(logits, constraint.allowed(state), temperature, top_k, top_p)
        for token, p in policy.items():
            if prob * p < prune:
                pruned += prob * p
            elif token == constraint.eos_id:
                dist[tuple(seq)] = prob * p
            else:
                walk(seq + [token], constraint.step(state, token), prob * p)

    walk([], constraint.initial_state, 1.0)
    assert pruned < 1e-3, f"pruned mass {pruned:.2e}: raise prune or shorten the language"
    assert dist, "the enumeration reached no accepting state"
    return dist


def chi_square(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]):
    """(p-value, total variation) of ``samples`` (token sequences) against the enumerated
    distribution ``exact``; cells expected below 5 counts are merged into their neighbour (scipy
    is a test dependency: imported here, not by the package)."""
    from scipy.stats import chisquare

    counts = dict.fromkeys(exact, 0)
    for key in samples:
        assert key in counts, f"sampled a sequence of probability ~0: {key}"
        counts[key] += 1
    n, keys = len(samples), sorted(exact, key=exact.get, reverse=True)
    observed, expected = [], []
    for k in keys:  # merge the rare tail into one cell so every expected count is >= 5
        if exact[k] * n >= 5 or not observed:
            observed.append(counts[k]), expected.append(exact[k] * n)
        else:
            observed[-1] += counts[k]
            expected[-1] += exact[k] * n
    scale = sum(observed) / sum(expected)
    p_value = chisquare(observed, [e * scale for e in expected]).pvalue
    tv = 0.5 * sum(abs(counts[k] / n - exact[k]) for k in keys)
    return p_value, tv


@torch.no_grad()
def first_divergence(
    target, constraint: Constraint, prompt: list[int], reference: list[int], other: list[int]
) -> tuple[int | None, float | None]:
    """(first index where two greedy outputs differ, the reference's top-2 masked logit gap
    there): (None, None) if identical; (the shorter length, None) if one is a prefix of the
    other (a length cut, not a near-tie)."""
    if reference == other:
        return None, None
    state = constraint.initial_state
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            logits = last_logits(target, prompt + reference[:i])
            top2 = (
                logits[: constraint.vocab_size]
                .masked_fill(~constraint.mask(state), float("-inf"))
                .topk(2)
                .values
            )
            return i, float(top2[0] - top2[1])
        state = constraint.step(state, a)
        assert state is not None and state != FINISHED, "the reference left the constraint"
    return min(len(reference), len(other)), None


def assert_greedy_match(
    target, constraint: Constraint, prompt: list[int], reference: list[int], other: list[int]
) -> None:
    """Identical greedy outputs, or a first difference at a near-tie of the reference."""
    index, gap = first_divergence(target, constraint, prompt, reference, other)
    assert index is None or (gap is not None and gap < NEAR_TIE), (
        f"greedy outputs diverge at token {index}, a clear decision (top-2 gap {gap})"
    )


@contextlib.contextmanager
def server_process(*args: str, timeout_s: float = 900.0, on_loading=None) -> Iterator[str]:
    """Run ``constrained-spec serve *args`` on a free local port until the block ends; yields
    its base URL (``http://127.0.0.1:PORT``) once /health says the model is loaded.
    ``on_loading(base_url)`` is called once if /health answered 503 (loading) first.
    The child imports this checkout's package (cwd = the repository root, via ``-m``)."""
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "constrained_spec", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=root)
    url, deadline, loading_seen = f"http://127.0.0.1:{port}", time.monotonic() + timeout_s, False
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {proc.returncode}: {cmd}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not load within {timeout_s} s")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except urllib.error.HTTPError as e:  # 503 while loading
                if e.code == 503 and not loading_seen and on_loading is not None:
                    loading_seen = True
                    on_loading(url)
            except OSError:  # not listening yet
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
