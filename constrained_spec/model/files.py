"""GGUF files into the compact forward: what a file holds, checked before any weight is read,
then each tensor run from its own blocks.

A linear's tensor runs on the 4-bit kernel (kernels.Int4Linear: w = (q − 8)·scale + zero per
group of 32 inputs, bf16 scales) from the file's blocks where its type is an affine grid over
groups of 32 (AFFINE_BITS: w = d·q + m, Q4_K and Q5_K's d = d₀·sc and m = −dmin·mn per
sub-block of 32): 4-bit types as they are, 5-bit ones and Q8_0 as two 4-bit halves of q fed the
input twice (EIGHT_BITS). Their only change is the scales' rounding to bf16 (WEIGHT_BOUND). Types
that are not such a grid (REQUANTIZED: Q6_K's sub-blocks of 16, float tensors) are re-quantized
to Q8_0 blocks, the error stated there and measured by the tests; ``CompactLlama.tensor_types``
and ``describe`` say which ran how. The token embedding and the LM head's rows (those it
recomputes in float32) are the file's values exactly: Q8_0 and Q6_K ones kept as the file's
blocks and dequantized a row at a time (kernels.BlockRows), others as gguf dequantizes them, in
float32; norms, biases and rotary factors are float32.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from ..errors import WeightsError
from . import families, kernels, llama, machine, repack
from .gguf_header import GGUFHeader, HeaderError

__all__ = [
    "AFFINE_BITS",
    "ARCHITECTURES",
    "EIGHT_BITS",
    "REQUANTIZED",
    "check_gguf",
    "from_gguf",
    "gguf_family",
    "read_gguf",
    "unused_token_ids",
]

ARCHITECTURES = families.ARCHITECTURES
AFFINE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5}
EIGHT_BITS = ("Q8_0",)
# Re-quantized to Q8_0 (d = max|w|/127 per group of 32, fp16): each weight within d/2 of the file's
# value, d ≤ 1/127 of its group's largest magnitude (Q6_K's own step is 1/31 of its sub-block's).
REQUANTIZED = ("Q6_K", "F16", "BF16", "F32")
LINEAR_TYPES = (*AFFINE_BITS, *EIGHT_BITS, *REQUANTIZED)
# A kernel weight's distance from the file's (the scale and zero rounded to bf16, 8 significant
# bits: |x − x̃| ≤ u/(1 − u)·|x̃|, u = 2⁻⁸): |Δw| ≤ WEIGHT_BOUND·(|q − 8|·|scale| + |zero|) per
# 4-bit half, the kernel's scale and zero.
WEIGHT_BOUND = kernels.HEAD_ROUNDOFF


def _linears(family: families.Family) -> list[str]:
    """The GGUF tensors of a layer's linears (family.linears), in order."""
    return [name for group in family.linears for name, _ in group]


def read_gguf(path: str | Path) -> GGUFHeader:
    """The file's header (memory-mapped: metadata parsed, no weight read), or a WeightsError
    naming the file and what is wrong with it (the tensor where one is at fault: a truncated
    file's first tensor past its end). Parsed once per file version: a load reads it for the
    checks, the config and the weights."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise WeightsError(f"{path}: no such GGUF file.")
    stat = path.stat()
    return _reader(path, stat.st_size, stat.st_mtime_ns)


def restored_gguf(path: str | Path, state: dict) -> GGUFHeader:
    """The header a GGUFHeader.state() kept of the file at ``path`` (for the same size and
    modification time: the prepared entry's key), mapped again without reading its metadata;
    a WeightsError where the file no longer holds its tensors."""
    path = Path(path).expanduser().resolve()
    try:
        return GGUFHeader(path, state)
    except (ValueError, OSError, KeyError, TypeError) as err:
        raise WeightsError(f"{path}: {type(err).__name__}: {err}") from err


@functools.lru_cache(maxsize=4)
def _reader(path: Path, size: int, mtime_ns: int) -> GGUFHeader:
    try:
        return GGUFHeader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError, OverflowError) as err:
        size = path.stat().st_size
        what = f"tensor {err.tensor}: " if isinstance(err, HeaderError) and err.tensor else ""
        raise WeightsError(
            f"{path}: not a readable GGUF file ({size} bytes; {what}{type(err).__name__}: {err}). "
            "A truncated download reads like this: fetch it again."
        ) from err


@contextlib.contextmanager
def shared_reader(path: Path):
    """While it lasts, transformers' own readings of ``path`` get the header read_gguf read
    once: gguf's GGUFReader (10 s for a 150k vocabulary), its own metadata reader
    (``read_gguf_metadata``: 2 s, with the vocabulary) and its config parse
    (``load_gguf_checkpoint``: 2 s, each item of each array; the tokenizer's load asks for
    the config again: parsed once). Each patched where this transformers has it."""
    import gguf  # transformers imports GGUFReader from it when it reads a file

    path = Path(path).resolve()
    ours = lambda file: Path(file).resolve() == path  # noqa: E731
    patches = [(gguf, "GGUFReader", lambda original: _reading(ours, original))]
    with contextlib.suppress(ImportError):
        import transformers.integrations.gguf as package
        import transformers.integrations.gguf.reader as reader

        patch = lambda original: _metadata(ours, original)  # noqa: E731
        patches += [(reader, "read_gguf_metadata", patch), (package, "read_gguf_metadata", patch)]
    with contextlib.suppress(ImportError):
        import transformers.modeling_gguf_pytorch_utils as loading

        patches.append((loading, "load_gguf_checkpoint", lambda original: _once(ours, original)))
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for (owner, name, make), (_, _, original) in zip(patches, originals):
            setattr(owner, name, make(original))
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def _reading(ours, original):
    def reader(file, *args, **kwargs):
        if not args and not kwargs and ours(file):
            return read_gguf(file)
        return original(file, *args, **kwargs)

    return reader


def _metadata(ours, original):
    """transformers' read_gguf_metadata from our header: scalars as Python values, arrays of
    numbers as lists, arrays of strings as lists where asked for (``string_arrays``), else
    their count; the tensors' names."""

    def read(file, string_arrays=()):
        if not ours(file):
            return original(file, string_arrays)
        header, metadata = read_gguf(file), {}
        for key in header.fields:
            if key.startswith("GGUF."):
                continue
            value = header.value(key)
            if isinstance(value, np.ndarray):
                value = value.tolist()
            elif isinstance(value, list) and key not in string_arrays:
                value = len(value)
            metadata[key] = value
        return metadata, tuple(t.name for t in header.tensors)

    return read


def _once(ours, original):
    """load_gguf_checkpoint without tensors, parsed once per version of ``ours`` (a copy each
    call: the tokenizer's load and the config's ask for the same)."""

    def load(file, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs or not ours(file):
            return original(file, return_tensors, *args, **kwargs)
        stat = Path(file).stat()
        parsed = _checkpoint(Path(file).resolve(), stat.st_size, stat.st_mtime_ns, original)
        return copy.deepcopy(parsed)

    return load


@functools.lru_cache(maxsize=4)
def _checkpoint(path: Path, size: int, mtime_ns: int, load) -> dict:
    return load(str(path), False)


def forget_parsed() -> None:
    """Let the parses of files' metadata go, ours and transformers' (a 150k vocabulary's:
    tens of MB), once the config and the tokenizer that asked for them are built (a later
    reader parses again)."""
    _checkpoint.cache_clear()
    _reader.cache_clear()


def unused_token_ids(reader: GGUFHeader) -> frozenset[int]:
    """The ids of the file's UNUSED tokens (gguf TokenType 5: vocabulary padding), which
    llama.cpp never lets a grammar produce; transformers' reader keeps them as plain tokens."""
    types = np.asarray(reader.value("tokenizer.ggml.token_type", []))
    return frozenset(np.flatnonzero(types == 5).tolist())


def _field(reader: GGUFHeader, key: str, default=None):
    value = reader.value(key, default)
    return value.tolist() if isinstance(value, np.ndarray) else value


def check_gguf(reader: GGUFHeader, path: str | Path) -> families.Family:
    """The file's family, or a WeightsError naming what the file holds that the compact forward
    does not run (its architecture, a linear's tensor type) or what contradicts its family (a
    missing tensor, a metadata key out of range), before any weight is read."""
    name = Path(path).name
    arch = _field(reader, "general.architecture", "?")
    family = gguf_family(reader)
    if family is None:
        raise WeightsError(
            f"{name}: the {arch!r} architecture is not supported (GGUF files of "
            f"{', '.join(ARCHITECTURES)} run): use weights='float' (transformers' own forward)."
        )
    tensors = {t.name: t for t in reader.tensors}
    layers = _field(reader, f"{arch}.block_count", 0)
    parts = (*_linears(family), *(gguf for gguf, _ in family.norms))
    parts += ("attn_q_norm", "attn_k_norm") if family.qk_norms else ()
    needed = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{part}.weight" for i in range(layers) for part in parts
    ]
    if missing := [t for t in needed if t not in tensors]:
        raise WeightsError(
            f"{name}: tensor {missing[0]} is missing ({len(missing)} of {len(needed)} expected "
            f"ones): the file is incomplete or not a {arch} model."
        )
    stated_fields(reader, family, name)
    if family.window_period:
        _check_window(reader, name, arch)
    key = f"{arch}.rope.scaling.original_context_length"
    if "rope_factors_short.weight" in tensors and _field(reader, key) is None:
        raise WeightsError(f"{name}: {key} is missing: LongRoPE's factors need their context.")
    odd = sorted(
        {
            tensors[f"blk.{i}.{part}.weight"].tensor_type.name
            for i in range(layers)
            for part in _linears(family)
        }
        - set(LINEAR_TYPES)
    )
    if odd:
        raise WeightsError(
            f"{name}: tensor type(s) {', '.join(odd)} are not supported (the 4-bit path runs "
            f"{', '.join(LINEAR_TYPES)}): use weights='float' (dequantized by transformers)."
        )
    return family


def gguf_family(reader: GGUFHeader) -> families.Family | None:
    """The family of the file's general.architecture, or None where none is declared."""
    arch = _field(reader, "general.architecture")
    return next((f for f in families.FAMILIES if f.name == arch), None)


def stated_fields(reader: GGUFHeader, family: families.Family, name: str) -> dict[str, float]:
    """The family's config fields that only we read from the file (Family.gguf_fields: Granite's
    scales), or a WeightsError naming the first key the file lacks."""
    values = {}
    for key, field in family.gguf_fields:
        value = _field(reader, f"{family.name}.{key}")
        if value is None:
            raise WeightsError(
                f"{name}: {family.name}.{key} is missing: a {family.name} model needs it (its "
                f"config's {field}, which its converter writes)."
            )
        values[field] = float(value)
    return values


def _check_window(reader: GGUFHeader, name: str, arch: str) -> None:
    """A windowed family's window: stated, at least 1, no larger than the context."""
    key, context = f"{arch}.attention.sliding_window", _field(reader, f"{arch}.context_length")
    window = _field(reader, key)
    if window is None:
        raise WeightsError(f"{name}: {key} is missing: a {arch} model's layers need their window.")
    if not 1 <= window <= (context or window):
        raise WeightsError(
            f"{name}: {key} = {window} contradicts the file's {arch}.context_length = {context} "
            "(a window is at least 1 position and at most the context)."
        )


def gguf_config(path: str | Path):
    """The transformers config of a GGUF file (transformers reads its metadata; we do for the
    families it has no GGUF config for, _own_config), with the head size the file states
    (transformers' reading of qwen3 files keeps Qwen3's default of 128), the fields only we read
    (Family.gguf_fields) and, for a windowed family, each layer's kind, window, rotary base and
    scaling and the attention scale as llama.cpp reads them (_windows).
    Read once per file version (a 150k vocabulary's metadata: ~8 s a reading; a load asks for
    it to choose the weights, to describe them and to build the model): a copy each call."""
    path = Path(path).expanduser().resolve()
    stat = path.stat()
    return copy.deepcopy(_config(path, stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _config(path: Path, size: int, mtime_ns: int):
    from transformers import AutoConfig

    reader = read_gguf(path)
    arch, family = _field(reader, "general.architecture"), gguf_family(reader)
    if family is not None and family.gguf_config_as:
        config = _own_config(reader, family)
    else:
        with shared_reader(path):
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if (head_dim := _field(reader, f"{arch}.attention.key_length")) is not None:
        config.head_dim = int(head_dim)
    if family is not None:
        for field, value in stated_fields(reader, family, path.name).items():
            setattr(config, field, value)
    if family is not None and family.window_period:
        _windows(config, reader, arch, family)
    else:
        _rotary(config, reader, arch)
    if family is not None:  # as llama.cpp reads them (transformers' reader keeps its defaults)
        if family.attention_cap:
            key = f"{arch}.attn_logit_softcapping"
            config.attn_logit_softcapping = float(_field(reader, key, family.attention_cap))
        if family.logit_cap:
            key = f"{arch}.final_logit_softcapping"
            config.final_logit_softcapping = float(_field(reader, key, family.logit_cap))
    return config


def _own_config(reader: GGUFHeader, family: families.Family):
    """The config of a family whose GGUF files transformers' reader has no config for, as that
    reader builds one: the shape under the keys it maps for family.gguf_config_as, the
    vocabulary's size where the file states none, embeddings tied where the file has no
    output.weight; the special tokens' ids the file states (None for others, not the config
    class's defaults: SmolLM3's 128000...); the layers without rotary as llama.cpp decides them (every nope_period-th:
    the file does not say)."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    fields = {
        field: _field(reader, f"{family.name}.{key}")
        for key, field in GGUF_CONFIG_MAPPING[family.gguf_config_as].items()
        if field is not None and f"{family.name}.{key}" in reader.fields
    }
    fields.setdefault("vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data))
    for key, field in GGUF_CONFIG_MAPPING["tokenizer"].items():  # the file's, not the class's
        fields[field] = _field(reader, f"tokenizer.{key}")
    fields["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    config = AutoConfig.for_model(family.model_types[0], **fields)
    if period := family.nope_period:
        layers = config.num_hidden_layers
        config.no_rope_layers = [int((il + 1) % period != 0) for il in range(layers)]
    return config


def _rotary(config, reader: GGUFHeader, arch: str) -> None:
    """Partial rotary and LongRoPE as llama.cpp's converter states them, which transformers'
    GGUF reader drops: ``rope.dimension_count`` below the head size (Phi-4-mini: 96 of 128),
    and the ``rope_factors_short``/``rope_factors_long`` tensors with the original context and
    ``rope.scaling.attn_factor`` (llama.cpp scales cos and sin by it, 1 where the file has
    none)."""
    rope = families.rope_of(config, families.FULL)
    stated = dict(rope)
    dims, head_size = _field(reader, f"{arch}.rope.dimension_count"), families.head_size(config)
    if dims is not None and int(dims) != head_size:
        rope["partial_rotary_factor"] = int(dims) / head_size
    tensors = {t.name: t for t in reader.tensors}
    if "rope_factors_short.weight" in tensors:
        original = int(_field(reader, f"{arch}.rope.scaling.original_context_length"))
        rope |= {
            "rope_type": "longrope",
            "short_factor": _float(tensors["rope_factors_short.weight"]).tolist(),
            "long_factor": _float(tensors["rope_factors_long.weight"]).tolist(),
            "original_max_position_embeddings": original,
            "attention_factor": float(_field(reader, f"{arch}.rope.scaling.attn_factor", 1.0)),
        }
        rope.pop("type", None)
        config.original_max_position_embeddings = original
    if rope != stated:
        config.rope_parameters = rope


def _windows(config, reader: GGUFHeader, arch: str, family: families.Family) -> None:
    """A windowed family's layers as llama.cpp reads them (src/llama-model.cpp), where
    transformers' GGUF reader keeps its config's defaults: every window_period-th layer full,
    the others windowed; the full layers' rotary base ``rope.freq_base`` with the file's linear
    scaling, the windowed ones' ``rope.freq_base_swa`` (else the family's) unscaled, or the full
    ones' where the family has no local base (Gemma 2); scores
    scaled by 1/√key_length (transformers' query_pre_attn_scalar stays 256 whatever the head)."""
    period, layers = family.window_period, config.num_hidden_layers
    config.layer_types = [
        families.FULL if i % period == period - 1 else families.SLIDING for i in range(layers)
    ]
    full = {"rope_type": "default", "rope_theta": float(_field(reader, f"{arch}.rope.freq_base"))}
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor", 1.0)
    if scaling not in (None, "none") and not (scaling == "linear" and factor == 1.0):
        full |= {"rope_type": scaling, "factor": float(factor)}  # families.check names others
    if family.local_rope_base is None:  # the windowed layers rotate as the full ones
        local = dict(full)
    else:
        base = _field(reader, f"{arch}.rope.freq_base_swa", family.local_rope_base)
        local = {"rope_type": "default", "rope_theta": float(base)}
    config.rope_parameters = {families.FULL: full, families.SLIDING: local}
    if layers in family.query_scalar_hidden_at:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = config.head_dim


def from_gguf(
    path: str | Path,
    config,
    layout: str | None = None,
    terms: torch.Tensor | None = None,
    reader: GGUFHeader | None = None,
) -> llama.CompactLlama:
    """The compact model of a GGUF file of ARCHITECTURES (``config``: its transformers config,
    gguf_config). ``layout``: the 4-bit kernel (one of ours, kernels.INT4_KERNELS) whose layout
    the linears and the head's blocks are laid in straight from the file's blocks (model/repack),
    each tensor's file pages dropped once laid; the head's bound ``terms`` where they are known
    (stored for this file and kernel). None: the torch path (each tensor decoded to q, scale and
    zero, models.use_kernels then re-lays them). ``reader``: the file's header where it is
    at hand (restored_gguf's), else read_gguf's."""
    reader = reader or read_gguf(path)
    family = check_gguf(reader, path)
    families.check(config, "int4")
    tensors = {t.name: t for t in reader.tensors}
    s, types = llama._shape(config), Counter()
    _check_shapes(tensors, s, config, family, path)
    # llama's convert script interleaves each head's rotary halves in q and k: rows back to
    # transformers' order (qwen2/qwen3/gemma3/phi3 use the split halves already)
    heads = {"attn_q": s.heads, "attn_k": s.kv_heads} if family.permuted_qk else {}
    order = families.qkv_row_order(config)  # partial rotary: each q/k head's rotated dims first
    # the head first: its table's file pages (a 150k vocabulary's: 0.2 GB) are let go before the
    # layers' copies add up, so they never sit beside all of them
    head, embed = _head(tensors, layout, terms)
    reader.release([t for name, t in tensors.items() if name in _TABLES])
    norms, linears, biases, qk_norms = [], [], [], []
    for i in range(s.layers):
        for n, group in enumerate(family.linears):  # each linear's tensors stacked
            parts = [(tensors[f"blk.{i}.{part}.weight"], heads.get(part)) for part, _ in group]
            linears.append(_linear(parts, types, order if n == 0 else None, layout))
            reader.release([tensor for tensor, _ in parts])
        # as stored: llama.cpp's converter has added Gemma's 1 to its norms (x·w, as here)
        norms += [_float(tensors[f"blk.{i}.{part}.weight"]) for part, _ in family.norms]
        qkv = [f"blk.{i}.{part}.bias" for part, _ in family.linears[0]]
        if qkv[0] in tensors:
            bias = torch.cat([_float(tensors[b]) for b in qkv])
            biases.append(bias if order is None else bias[order])
        if family.qk_norms:
            qk_norms += [_float(tensors[f"blk.{i}.attn_{x}_norm.weight"]) for x in "qk"]
    norms.append(_float(tensors["output_norm.weight"]))
    reader.release(list(tensors.values()))
    machine.release_freed_memory()  # the conversion's temporaries
    rope = families.rotary_frequencies(config)  # (3, hd/2): families.ROTARY_ROWS
    if "rope_freqs.weight" in tensors:  # Llama 3's long-context factors: θ_i / factor_i
        rope = rope / _float(tensors["rope_freqs.weight"])  # (0 / factor: none stays none)
    model = llama.CompactLlama(
        config, embed, head, norms, linears, "int4",
        biases=biases or None, qk_norms=qk_norms or None, rope=rope,
    )  # fmt: skip
    model.tensor_types = dict(types)
    return model


_TABLES = ("token_embd.weight", "output.weight")


def _head(tensors: dict, layout: str | None, terms: torch.Tensor | None):
    """The LM head (a kernels.Q8Head over the output tensor, or the token embedding where tied)
    and the token embedding (the head's table where tied: one copy)."""
    output = tensors.get("output.weight")  # tied unless the file has its own
    table = tensors["token_embd.weight"] if output is None else output
    laid = layout is not None
    head = kernels.Q8Head(_rows(table)) if not laid else _laid_head(table, layout, terms)
    embed = head.table if output is None else _rows(tensors["token_embd.weight"], laid)
    return head, embed


def _laid_head(tensor, layout: str, terms: torch.Tensor | None) -> kernels.Q8Head:
    """kernels.Q8Head(_rows(tensor)) with its blocks laid from the file's rows: Q8_0 ones as they
    are where the vocabulary is a multiple of 16, else each row re-quantized from its float32
    values (as _padded_q8_0 quantizes them), with zero rows up to a multiple of 16. A table of
    float32 rows that are Q8_0 values is kept as those blocks, as Q8Head keeps it."""
    rows = repack.Rows.of(tensor.data, tensor.tensor_type.value, int(tensor.shape[0]))
    table, vocab = _rows(tensor, laid=True), len(rows)
    if tensor.tensor_type != GGMLQuantizationType.Q8_0 or vocab % 16:
        if isinstance(table, torch.Tensor):
            q, d = repack.q8_0_quantized(rows)
            exact = torch.equal(kernels.dequantize_q8_0(q, d), table)
            table = (
                kernels.BlockRows.from_q8_0(q, d)
                if exact
                else torch.nn.Embedding.from_pretrained(table)
            )
        rows = rows.requantized().padded(vocab + -vocab % 16)
    return kernels.Q8Head.from_rows(table, rows, layout, terms)


def _check_shapes(tensors: dict, s, config, family: families.Family, path) -> None:
    """A WeightsError naming the first tensor whose shape is not the one the metadata implies."""
    d = s.hidden
    expected = {"token_embd.weight": (d, config.vocab_size), "output_norm.weight": (d,)}
    layer = families.layer_tensors(
        family, d, config.intermediate_size, s.heads, s.kv_heads, s.head_dim
    )
    for n in range(s.layers):
        for name, dims, kind in layer:
            if kind == "linear":
                expected[f"blk.{n}.{name}"] = dims[::-1]  # numpy's (out, in) as GGUF's (in, out)
    for name, shape in expected.items():
        have = tuple(int(x) for x in tensors[name].shape)  # GGUF order: inputs first
        if have != shape:
            raise WeightsError(
                f"{Path(path).name}: tensor {name} is {have}, its metadata implies {shape} "
                "(a file whose metadata does not match its tensors)."
            )


def _linear(
    parts: list, types: Counter, order: torch.Tensor | None = None, layout: str | None = None
) -> kernels.Int4Linear:
    """One Int4Linear over tensors (each with the heads to un-interleave, or None) stacked
    along their outputs, its rows then taken in ``order`` (families.qkv_row_order; a row's
    blocks are whole: rows are independent): 4-bit blocks alone, or two 4-bit halves for all
    where one needs them (a 4-bit q's high half is 0, its zero cancels: w = 16d·(0 − 8) +
    128d + …). Laid in ``layout`` straight from the rows where given (from_gguf)."""
    copies = 1 if all(AFFINE_BITS.get(t.tensor_type.name) == 4 for t, _ in parts) else 2
    for tensor, _ in parts:
        kind = tensor.tensor_type.name
        types[
            kind if kind in AFFINE_BITS or kind in EIGHT_BITS else f"{kind} → Q8_0 (re-quantized)"
        ] += 1
    if layout is not None:
        return kernels.Int4Linear.from_rows(_stacked_rows(parts, order), copies, layout)
    blocks = []
    for tensor, heads in parts:
        q, scale, zero = _blocks(tensor, copies)
        if heads:
            q, scale, zero = (_unpermute(x, heads) for x in (q, scale, zero))
        blocks.append((q, scale, zero))
    q, scale, zero = (torch.cat(x) for x in zip(*blocks))
    if order is not None:
        q, scale, zero = q[order], scale[order], zero[order]
    return kernels.Int4Linear(q, scale, zero, copies=copies)


def _stacked_rows(parts: list, order: torch.Tensor | None) -> repack.Rows:
    """_linear's rows where they lie in the file: each tensor's, un-interleaved, stacked, then
    taken in ``order``."""
    stacked = None
    for tensor, heads in parts:
        index = np.arange(tensor.data.shape[0])
        if heads:
            index = _unpermute(torch.from_numpy(index), heads).numpy()
        rows = repack.Rows.of(tensor.data, tensor.tensor_type.value, int(tensor.shape[0]), index)
        stacked = rows if stacked is None else stacked + rows
    return stacked if order is None else stacked.take(order.numpy())


def _blocks(tensor, copies: int):
    """A tensor as the kernel's (q, scale, zero): (N, copies·K) q in 0..15, (N, copies·K/32)."""
    kind = tensor.tensor_type.name
    if kind in AFFINE_BITS:
        q, d, m = affine_groups(tensor)
        if copies == 1:
            return q, d, m + 8 * d
        return (
            torch.cat((q >> 4, q & 15), 1),
            torch.cat((16 * d, d), 1),
            torch.cat((128 * d, 8 * d + m), 1),
        )
    if kind in EIGHT_BITS:
        q, d = kernels.split_q8_0(torch.from_numpy(tensor.data.copy()))
    else:
        q, d = kernels.quantize_q8_0(_float(tensor))
    u = q.to(torch.int16).add_(128).to(torch.uint8)  # 0..255: w = d·(u − 128)
    return (
        torch.cat((u >> 4, u & 15), 1),
        torch.cat((16 * d, d), 1),
        torch.cat((torch.zeros_like(d), 8 * d), 1),
    )


def affine_groups(tensor):
    """An AFFINE_BITS tensor as q (N, K) uint8 and d, m (N, K/32) float32, w = d·q + m: q read
    from the blocks' nibbles (and high bits), the scales from their headers."""
    kind = tensor.tensor_type.name
    raw = np.ascontiguousarray(tensor.data)
    rows = raw.shape[0]
    d, m = (torch.from_numpy(x).reshape(rows, -1) for x in _group_scales(raw, kind))
    q = torch.from_numpy(_quants(raw, kind)).reshape(rows, -1)
    return q, d, m


def _quants(raw: np.ndarray, kind: str) -> np.ndarray:
    """q (blocks, elements) uint8 of an AFFINE_BITS tensor's raw blocks, as gguf lays them out
    (tests: every type's weights against gguf's dequantization)."""
    size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]
    b = raw.reshape(-1, size)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):  # 32 elements: j low nibble, j + 16 high
        nibbles = b[:, -16:]
        q = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=1)
        if kind in ("Q5_0", "Q5_1"):  # element j's fifth bit: bit j of a 32-bit word
            qh = np.ascontiguousarray(b[:, -20:-16]).view("<u4")
            q |= (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
        return q
    # Q4_K / Q5_K: 256 elements in 8 sub-blocks of 32; sub-blocks 2c and 2c + 1 are the low and
    # high nibbles of the c-th 32 bytes; Q5_K's fifth bit of sub-block i, element j: bit i of qh[j]
    qs = b[:, -128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(-1, 8, 32)
    if kind == "Q5_K":
        qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = q | ((qh & 1) << 4)
    return q.reshape(-1, 256)


def _group_scales(raw: np.ndarray, kind: str):
    """d and m (rows, K/32) float32 of an AFFINE_BITS tensor's raw blocks (rows, bytes)."""
    size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]  # bytes per block
    b = raw.reshape(raw.shape[0], -1, size)

    def f16(at: int) -> np.ndarray:
        return np.ascontiguousarray(b[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)

    d = f16(0)
    if kind in ("Q4_0", "Q5_0"):  # w = d·(q − 8) or d·(q − 16)
        return d, -(2 ** (AFFINE_BITS[kind] - 1)) * d
    if kind in ("Q4_1", "Q5_1"):
        return d, f16(2)
    # K-quants: super-blocks of 256, 8 sub-blocks of 32 with 6-bit scales and mins
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
    sc = sc.reshape(*b.shape[:2], 8).astype(np.float32)
    mn = mn.reshape(*b.shape[:2], 8).astype(np.float32)
    return d[..., None] * sc, -f16(2)[..., None] * mn


def _rows(tensor, laid: bool = False) -> torch.Tensor | kernels.BlockRows:
    """A table of rows (the token embedding, the LM head's): a Q8_0 or Q6_K tensor's blocks as
    they are (kernels.BlockRows; the head's 8-bit screen runs on Q8_0's too), else float32 rows
    (_float). ``laid``: read by model/repack, a row at a time (no temporaries the size of the
    table: a float32 table is then the only copy of its values)."""
    kind = tensor.tensor_type
    if laid:
        rows = repack.Rows.of(tensor.data, kind.value, int(tensor.shape[0]))
        if kind == GGMLQuantizationType.Q8_0:
            return kernels.BlockRows.from_q8_0(*repack.q8_0_rows(rows))
        if kind == GGMLQuantizationType.Q6_K:
            return kernels.BlockRows(*repack.q6_k_rows(rows))
        return repack.float_rows(rows)
    if kind not in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q6_K):
        return _float(tensor)
    raw = torch.from_numpy(np.array(tensor.data))
    if kind == GGMLQuantizationType.Q8_0:
        return kernels.BlockRows.from_q8_0(*kernels.split_q8_0(raw))
    return kernels.BlockRows(*kernels.split_q6_k(raw))


def _float(tensor) -> torch.Tensor:
    """A tensor's values in float32, exactly as gguf dequantizes them; (rows, K) or (K,)."""
    kind = tensor.tensor_type
    data = np.ascontiguousarray(tensor.data)
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return torch.from_numpy(data.astype(np.float32))
    return torch.from_numpy(dequantize(data, kind))


def _unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert script interleaves each head's rotary halves; rows back to HF order."""
    rows = t.shape[0]
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
