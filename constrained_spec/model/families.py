"""The model families the compact forward computes, each declared once (as llama.cpp keeps one
small file per architecture over one graph builder: ``src/models/<arch>.cpp``): a block's norms
and where they sit, per-head q/k norms, q/k/v biases, the MLP's activation, the embedding's
scale, the rotary layout of its GGUF files, which layers attend through a sliding window,
Granite's residual and logit scales, Gemma 2's soft-caps on attention scores and logits, and
how its GGUF files' config is read where transformers reads none (Granite, SmolLM3).

``block_of(config)`` is a family's declaration with one model's numbers (``Block``): the Python
layers (llama.py) and the fused C++ layers (csrc/fused_layers.cpp) both run from it, so adding
a family is a declaration here and a test, not a branch in either forward. A config that asks
for something its family does not declare is refused by name (``check``), before any weight is
read: computing a model without it would be silently wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import WeightsError

__all__ = [
    "FAMILIES",
    "GRANITE_FIELDS",
    "Block",
    "Family",
    "block_of",
    "check",
    "context_of",
    "family_of",
    "head_size",
    "layer_tensors",
    "qkv_row_order",
    "rotary_frequencies",
]

# A block's RMSNorms in the order the forward applies them, each as (the GGUF tensor of layer i:
# blk.i.<name>.weight, transformers' module on the layer). Two: before attention and before the
# MLP (Llama); four: each branch's output normed too, before its residual add (Gemma 2/3).
PRE_NORMS = (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"))
SANDWICH_NORMS = (
    ("attn_norm", "input_layernorm"),
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
)
# A block's four linears (q/k/v, the attention's output, gate/up, down), each as the GGUF tensors
# of layer i (blk.i.<name>.weight) and transformers' modules on the layer whose rows it stacks, in
# that order: separate tensors (Llama, Qwen, Gemma), or tensors the checkpoint already fused (Phi-3:
# qkv_proj's rows are [q | k | v], gate_up_proj's [gate | up], and llama.cpp's converter keeps
# them as attn_qkv and ffn_up, whose first half is the gate: ggml_swiglu's and Phi3MLP's chunk).
SEPARATE_LINEARS = (
    (
        ("attn_q", "self_attn.q_proj"),
        ("attn_k", "self_attn.k_proj"),
        ("attn_v", "self_attn.v_proj"),
    ),
    (("attn_output", "self_attn.o_proj"),),
    (("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj")),
    (("ffn_down", "mlp.down_proj"),),
)
FUSED_LINEARS = (
    (("attn_qkv", "self_attn.qkv_proj"),),
    (("attn_output", "self_attn.o_proj"),),
    (("ffn_up", "mlp.gate_up_proj"),),
    (("ffn_down", "mlp.down_proj"),),
)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # the MLP's gate: act(gate)·up; the C++ layers' codes
# transformers' names of each activation (config.hidden_act / hidden_activation)
_TRANSFORMERS_ACTIVATIONS = {"silu": ("silu", "swish"), "gelu_tanh": ("gelu_pytorch_tanh",)}


@dataclass(frozen=True)
class Family:
    """What a family's block computes beyond Llama's (RMSNorm, rotary attention, a gated MLP)."""

    name: str  # general.architecture of its GGUF files
    model_types: tuple[str, ...]  # transformers' config.model_type of its checkpoints
    norms: tuple[tuple[str, str], ...] = PRE_NORMS
    linears: tuple = SEPARATE_LINEARS
    permuted_qk: bool = False  # GGUF q/k rows in llama.cpp's interleaved rotary order
    qkv_bias: bool = False  # q/k/v matmul biases, where the file has them
    qk_norms: bool = False  # each head's RMSNorm on q and k, before rotary
    activation: str = "silu"
    embed_scale: bool = False  # embeddings × sqrt(hidden)
    # transformers keeps its norms as w − offset and multiplies by (offset + w) (Gemma: 1 + w);
    # llama.cpp's converter stores offset + w in the GGUF, multiplied as it is
    norm_offset: float = 0.0
    # sliding windows: every layer but each window_period-th (il % period == period − 1) attends
    # to the last ``{arch}.attention.sliding_window`` positions only, with its own rotary base
    # (``{arch}.rope.freq_base_swa``, else local_rope_base; None: the full layers' base and
    # scaling, as llama.cpp rotates them unless a family says otherwise); 0: no windows
    window_period: int = 0
    local_rope_base: float | None = 10000.0
    # no rotary on layers where (il + 1) % nope_period == 0 (SmolLM3: 4; the GGUF does not say it,
    # llama.cpp hard-codes it; a checkpoint's config.no_rope_layers says it per layer); 0: none
    nope_period: int = 0
    # transformers reads no config of the family from a GGUF file (Granite, SmolLM3): we read it,
    # its shape under the keys transformers maps for this architecture (llama.cpp's converters
    # for these families are Llama's, which names them alike); None: transformers reads it
    gguf_config_as: str | None = None
    # config fields transformers' GGUF reader has no key for, each as (llama.cpp's key under
    # ``{arch}.``, transformers' config field): read by us, each required (a file without one is
    # not what the family's converter writes)
    gguf_fields: tuple[tuple[str, str], ...] = ()
    # layer counts whose scores are scaled by 1/√(hidden/heads), not 1/√head_dim (llama.cpp:
    # Gemma 3 27B, whose query_pre_attn_scalar is 168 with heads of 128)
    query_scalar_hidden_at: tuple[int, ...] = ()
    # Granite's four scalars, from its config (transformers' names; llama.cpp's GGUF keys:
    # granite.embedding_scale, .attention.scale, .residual_scale, .logit_scale): embeddings ×
    # embedding_multiplier, scores × attention_multiplier (in place of 1/√head_dim), each
    # branch's output × residual_multiplier before its residual add, logits ÷ logits_scaling
    multipliers: bool = False
    # soft-capping, x → cap·tanh(x / cap): of the attention scores (after their scale, before the
    # mask) and of the logits; each the value llama.cpp takes where a GGUF file does not state
    # ``{arch}.attn_logit_softcapping`` / ``{arch}.final_logit_softcapping`` (a checkpoint's
    # config states its own); 0: the family has none (a config asking for one is refused)
    attention_cap: float = 0.0
    logit_cap: float = 0.0
    # rotary scalings beyond ROPE_TYPES ("longrope": Phi-3.5/Phi-4-mini, short factors only)
    more_rope_types: tuple[str, ...] = ()
    # rotary on the first partial_rotary_factor of each head only (Phi-4-mini: 0.75)
    partial_rotary: bool = False


# Granite's four scalars (Family.multipliers) as llama.cpp's converter writes them (its
# _multiplier fields renamed _scale): (the GGUF key under ``granite.``, transformers' field)
GRANITE_FIELDS = (
    ("embedding_scale", "embedding_multiplier"),
    ("attention.scale", "attention_multiplier"),
    ("residual_scale", "residual_multiplier"),
    ("logit_scale", "logits_scaling"),
)

FAMILIES = (
    Family("llama", ("llama", "mistral"), permuted_qk=True),  # Llama 2/3.x, Mistral, SmolLM
    Family("qwen2", ("qwen2",), qkv_bias=True),
    Family("qwen3", ("qwen3",), qk_norms=True),
    # SmolLM3-3B (llama.cpp's src/models/smollm3.cpp: Llama's converter and rotary pairs, no
    # rotary on every 4th layer)
    Family("smollm3", ("smollm3",), permuted_qk=True, nope_period=4, gguf_config_as="llama"),
    # Granite 3.x dense (llama.cpp's src/models/granite.cpp: Llama's converter and rotary pairs)
    Family(
        "granite",
        ("granite",),
        permuted_qk=True,
        multipliers=True,
        gguf_config_as="llama",
        gguf_fields=GRANITE_FIELDS,
    ),
    # Gemma 3 (270M, 1B text; FunctionGemma): llama.cpp's src/models/gemma3.cpp
    Family(
        "gemma3",
        ("gemma3_text",),
        norms=SANDWICH_NORMS,
        qk_norms=True,
        activation="gelu_tanh",
        embed_scale=True,
        norm_offset=1.0,
        window_period=6,
        query_scalar_hidden_at=(62,),
    ),
    # Gemma 2 (2B, 9B, 27B): llama.cpp's src/models/gemma2-iswa.cpp; no q/k norms, a window on
    # even layers, one rotary base, scores × 1/√(hidden/heads) on 27B (query_pre_attn_scalar 144)
    Family(
        "gemma2",
        ("gemma2",),
        norms=SANDWICH_NORMS,
        activation="gelu_tanh",
        embed_scale=True,
        norm_offset=1.0,
        window_period=2,
        local_rope_base=None,
        query_scalar_hidden_at=(46,),
        attention_cap=50.0,
        logit_cap=30.0,
    ),
    # Phi-3/3.5-mini, Phi-4-mini: llama.cpp's src/models/phi3.cpp (NEOX rotary: q/k unpermuted)
    Family(
        "phi3",
        ("phi3",),
        linears=FUSED_LINEARS,
        more_rope_types=("longrope",),
        partial_rotary=True,
    ),
)
ARCHITECTURES = tuple(f.name for f in FAMILIES)  # of GGUF files
MODEL_TYPES = tuple(t for f in FAMILIES for t in f.model_types)


def layer_tensors(
    family: Family, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int
) -> list[tuple[str, tuple[int, ...], str]]:
    """The tensors of one layer of a ``family`` GGUF file, in the order llama.cpp's converters
    write them: (the name after ``blk.i.``, numpy shape (outputs, inputs), kind: "linear",
    "bias" or "norm"). Each branch's first norm comes before it, Gemma's second after it; a
    tensor that fuses a linear's parts (Phi-3's attn_qkv, ffn_up: [gate | up]) holds all its
    outputs, a separate one its own."""
    q, kv = heads * head_dim, kv_heads * head_dim
    norms = [name for name, _ in family.norms]
    attention_norms, mlp_norms = norms[: len(norms) // 2], norms[len(norms) // 2 :]
    parts = {"attn_q": q, "attn_k": kv, "attn_v": kv, "ffn_gate": ffn, "ffn_up": ffn}
    # each linear's (inputs, outputs), in family.linears' order
    sizes = ((hidden, q + 2 * kv), (q, hidden), (hidden, 2 * ffn), (ffn, hidden))
    qkv, output, gate_up, down = (
        [
            (f"{part}.weight", (outputs if len(group) == 1 else parts[part], inputs), "linear")
            for part, _ in group
        ]
        for group, (inputs, outputs) in zip(family.linears, sizes)
    )
    norm = lambda name, width: (f"{name}.weight", (width,), "norm")
    specs = [norm(attention_norms[0], hidden), *qkv]
    if family.qkv_bias:
        specs += [
            (f"{name.removesuffix('.weight')}.bias", dims[:1], "bias") for name, dims, _ in qkv
        ]
    if family.qk_norms:
        specs += [norm("attn_q_norm", head_dim), norm("attn_k_norm", head_dim)]
    specs += output + [norm(n, hidden) for n in attention_norms[1:]]
    specs += [norm(mlp_norms[0], hidden), *gate_up, *down]
    return specs + [norm(n, hidden) for n in mlp_norms[1:]]


def family_of(config) -> Family:
    """The family of a transformers config (its model_type), or a WeightsError naming it."""
    kind = getattr(config, "model_type", "?")
    for family in FAMILIES:
        if kind in family.model_types:
            return family
    raise WeightsError(
        f"the {kind!r} architecture is not one the compact forward computes (it runs "
        f"{', '.join(MODEL_TYPES)}): use weights='float' (transformers' own forward)."
    )


@dataclass(frozen=True)
class Block:
    """What every layer of one model computes: its family's declaration with its numbers."""

    family: str
    norms: int  # RMSNorms a layer: 2 (PRE_NORMS) or 4 (SANDWICH_NORMS), in that order
    activation: str  # of ACTIVATIONS
    embed_scale: float  # embeddings × this (1.0: none)
    attention_scale: float  # scores = q·k × this
    windows: tuple[int, ...]  # per layer: a key at distance ≥ window is masked; 0: no window
    rotary: tuple[int, ...]  # per layer: its row of rotary_frequencies (ROTARY_ROWS)
    residual_scale: float = 1.0  # each branch's output × this before its residual add
    logit_scale: float = 1.0  # logits ÷ this
    # soft-caps (Family.attention_cap, logit_cap): scores = cap·tanh(scores / cap) after the
    # scale, before the mask and softmax; logits = cap·tanh(logits / cap); 0: none (the scores
    # and logits exactly as without the step)
    attention_cap: float = 0.0
    logit_cap: float = 0.0
    # cos and sin of the pairs that rotate × this (LongRoPE's attention factor; 1.0: none)
    rotary_scale: float = 1.0

    @property
    def activation_code(self) -> int:
        return ACTIVATIONS[self.activation]


# Rotary scalings computed here: those that only rescale the frequencies, the same at every length
# (dynamic and yarn change with the length or scale attention; LongRoPE's short factors, up to
# its original context, with its attention factor: a family's more_rope_types).
ROPE_TYPES = ("default", "linear", "llama3")
# transformers' names of a layer's kind (config.layer_types): its window and its rotary parameters
FULL, SLIDING = "full_attention", "sliding_attention"
# rotary_frequencies' rows: full layers', windowed layers', and none (frequencies 0: cos 1, sin 0,
# a rotation that leaves q and k exactly as they are)
ROTARY_ROWS = (FULL, SLIDING, "none")


def block_of(config) -> Block:
    """The Block of a transformers config (as its JSON has it: a prepared model's too)."""
    family = family_of(config)
    hidden = config.hidden_size
    kinds = layer_kinds(config)
    window = getattr(config, "sliding_window", None) or 0
    head_dim = head_size(config)
    # Gemma's query_pre_attn_scalar (the head size on 270M/1B; llama.cpp: key_length, or
    # hidden/heads on 27B), else the head size
    scalar = getattr(config, "query_pre_attn_scalar", None) or head_dim
    # transformers multiplies by torch.tensor(sqrt(hidden)) in the weights' dtype: float32 here
    # (llama.cpp: sqrtf(n_embd), the same number)
    embed_scale = float(torch.tensor(math.sqrt(hidden))) if family.embed_scale else 1.0
    attention_scale, residual_scale, logit_scale = float(scalar) ** -0.5, 1.0, 1.0
    if family.multipliers:
        embed_scale = float(config.embedding_multiplier)
        attention_scale = float(config.attention_multiplier)
        residual_scale = float(config.residual_multiplier)
        logit_scale = float(config.logits_scaling)
    return Block(
        family=family.name,
        norms=len(family.norms),
        activation=family.activation,
        embed_scale=embed_scale,
        attention_scale=attention_scale,
        windows=tuple(window if kind == SLIDING else 0 for kind in kinds),
        rotary=tuple(
            ROTARY_ROWS.index(kind) if rotates else ROTARY_ROWS.index("none")
            for kind, rotates in zip(kinds, _rotates(config, family))
        ),
        residual_scale=residual_scale,
        logit_scale=logit_scale,
        attention_cap=_cap(config, "attn_logit_softcapping") if family.attention_cap else 0.0,
        logit_cap=_cap(config, "final_logit_softcapping") if family.logit_cap else 0.0,
        rotary_scale=_attention_factor(config),
    )


def _cap(config, name: str) -> float:
    return float(getattr(config, name, None) or 0.0)  # transformers' None: no cap


def _rotates(config, family: Family) -> list[bool]:
    """Whether each layer rotates q and k: config.no_rope_layers (1: rotary) where the config
    has them, else all but the family's NoPE layers."""
    if (flags := getattr(config, "no_rope_layers", None)) is not None:
        return [bool(f) for f in flags]
    period = family.nope_period
    return [not period or (il + 1) % period != 0 for il in range(config.num_hidden_layers)]


def layer_kinds(config) -> list[str]:
    """Each layer's kind, FULL or SLIDING: config.layer_types where the config has them, else
    a window on every layer where it has one (Mistral's sliding_window)."""
    layers = config.num_hidden_layers
    if kinds := getattr(config, "layer_types", None):
        assert len(kinds) == layers, (len(kinds), layers)
        return list(kinds)
    windowed = getattr(config, "sliding_window", None) and getattr(
        config, "use_sliding_window", True
    )
    return [SLIDING if windowed else FULL] * layers


def _rope_parameters(config) -> dict:
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def _per_kind(rope: dict) -> bool:
    """Whether the config's rotary parameters are per layer kind (Gemma 3: {FULL: ..., SLIDING:
    ...}) rather than one set for all layers."""
    return FULL in rope or SLIDING in rope


def rope_of(config, kind: str) -> dict:
    """The rotary parameters of layers of ``kind``: rope_type, rope_theta,
    partial_rotary_factor and the type's own."""
    rope = _rope_parameters(config)
    rope = dict(rope.get(kind) or {}) if _per_kind(rope) else dict(rope)
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return rope


def head_size(config) -> int:
    """Each attention head's size: config.head_dim, else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_dims(config, kind: str = FULL) -> int:
    """How many of a head's dimensions rotate (the first ones, in pairs (i, i + dims/2) as
    transformers pairs them): all, or partial_rotary_factor of them (Phi-4-mini: 96 of 128)."""
    return int(head_size(config) * float(rope_of(config, kind)["partial_rotary_factor"]))


def _original_context(config, rope: dict) -> int:
    """LongRoPE's original_max_position_embeddings (the pretraining context)."""
    original = rope.get("original_max_position_embeddings")
    return int(original or getattr(config, "original_max_position_embeddings", None) or 0)


def _attention_factor(config) -> float:
    """LongRoPE's factor on cos and sin, as transformers and llama.cpp's converter compute it:
    √(1 + ln(s)/ln(original)), s = max/original context (1 where s ≤ 1), unless stated."""
    rope = rope_of(config, FULL)
    if rope["rope_type"] != "longrope":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    original = _original_context(config, rope)
    scale = rope.get("factor") or config.max_position_embeddings / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0


def context_of(config) -> int:
    """The positions the compact forward runs: max_position_embeddings, but with LongRoPE its
    original_max_position_embeddings, the context its short factors are for (past it
    transformers and llama.cpp rotate every position by the long factors instead: not
    computed here)."""
    rope = rope_of(config, FULL)
    if rope["rope_type"] == "longrope":
        return min(config.max_position_embeddings, _original_context(config, rope))
    return config.max_position_embeddings


def rotary_frequencies(config) -> torch.Tensor:
    """The rotary inverse frequencies (3, hd/2) of ROTARY_ROWS (Block.rotary picks a layer's
    row), as transformers computes them. With partial rotary (rotary_dims < hd) the pairs that
    rotate are the first rotary_dims/2 of each half, the others have frequency 0 (cos 1,
    sin 0): the order qkv_row_order puts each q and k head's dimensions in."""
    head_dim = head_size(config)
    rows = []
    for kind in (FULL, SLIDING):
        rope = rope_of(config, kind)
        dims = rotary_dims(config, kind)
        exponent = torch.arange(0, dims, 2, dtype=torch.float32) / dims
        base = 1.0 / float(rope["rope_theta"]) ** exponent
        if rope["rope_type"] == "linear":
            base = base / float(rope["factor"])
        elif rope["rope_type"] == "llama3":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # ≈ 0.5 s to import

            base, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
            assert attention_factor == 1.0, attention_factor
        elif rope["rope_type"] == "longrope":  # the short factors (context_of: no further)
            short = torch.tensor(rope["short_factor"], dtype=torch.float32)
            base = 1.0 / (short * float(rope["rope_theta"]) ** exponent)
        rows.append(torch.cat((base.float(), torch.zeros(head_dim // 2 - dims // 2))))
    return torch.stack((*rows, torch.zeros_like(rows[0])))


def qkv_row_order(config) -> torch.Tensor | None:
    """Where the forward takes each row of the q/k/v matmul from (an index into the [q | k | v]
    rows as transformers orders them), or None where all of a head rotates. With partial
    rotary, each q and k head's rotated halves move to the front of the head's two halves and
    the dimensions that pass through behind them, so that the forward's pairs (i, i + hd/2)
    are transformers' (i, i + rotary_dims/2) and the rest rotate by frequency 0
    (rotary_frequencies). Scores are unchanged: q and k heads are permuted alike; values are
    not permuted."""
    hd, dims = head_size(config), rotary_dims(config)
    if dims == hd:
        return None
    assert dims % 2 == 0 and (hd - dims) % 2 == 0, (hd, dims)
    rotated, passed = dims // 2, (hd - dims) // 2
    order = torch.cat(
        (
            torch.arange(rotated),  # first half: the rotated pairs' first elements, then
            torch.arange(dims, dims + passed),  # half of the dimensions passed through
            torch.arange(rotated, dims),  # second half: the pairs' second elements, then
            torch.arange(dims + passed, hd),  # the other half passed through
        )
    )
    qk = config.num_attention_heads + config.num_key_value_heads
    heads = torch.arange(qk)[:, None] * hd + order  # (q and k heads, hd)
    values = torch.arange(qk * hd, (qk + config.num_key_value_heads) * hd)
    return torch.cat((heads.flatten(), values))


def check(config, weights: str) -> Family:
    """The config's family, or a WeightsError naming all it asks for that the compact forward
    does not compute (its architecture, a bias, an activation, a rotary scaling, a soft-cap)."""
    problems = []
    try:
        family = family_of(config)
    except WeightsError:
        family = None
        problems.append(
            f"the {getattr(config, 'model_type', '?')!r} architecture (it runs "
            f"{', '.join(MODEL_TYPES)})"
        )
    if getattr(config, "attention_bias", False) and not (family and family.qkv_bias):
        problems.append("a bias on the attention output (attention_bias)")
    if getattr(config, "mlp_bias", False):
        problems.append("biases on the MLP (mlp_bias)")
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if family and act not in _TRANSFORMERS_ACTIVATIONS[family.activation]:
        problems.append(f"the {act!r} activation")
    if getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None):
        problems.append("mixture-of-experts layers")
    types = ROPE_TYPES + (family.more_rope_types if family else ())
    for kind in (FULL, SLIDING):
        if (rope := rope_of(config, kind)["rope_type"]) not in types:
            problems.append(f"the {rope!r} rotary scaling (it runs {', '.join(types)})")
            break
    partial = float(rope_of(config, FULL)["partial_rotary_factor"])
    if partial != 1.0 and not (family and family.partial_rotary):
        problems.append(f"partial rotary (partial_rotary_factor = {partial})")
    for cap, declared in (
        ("attn_logit_softcapping", family and family.attention_cap),
        ("final_logit_softcapping", family and family.logit_cap),
    ):
        if getattr(config, cap, None) and not declared:
            problems.append(f"soft-capping ({cap})")
    if family and family.multipliers and not float(config.logits_scaling) > 0:
        # the head picks the logits it recomputes in float32 by their order: a divisor ≤ 0
        # would not keep it
        problems.append(f"logits_scaling = {config.logits_scaling} (not positive)")
    if getattr(config, "use_bidirectional_attention", False):
        problems.append("bidirectional attention (use_bidirectional_attention)")
    if SLIDING in layer_kinds(config) and not (getattr(config, "sliding_window", 0) or 0) > 0:
        problems.append("sliding-window layers without a window (sliding_window)")
    if problems:
        raise WeightsError(
            f"weights={weights!r} runs the compact forward, which does not compute "
            f"{'; '.join(problems)}: use weights='float' (transformers' own forward)."
        )
    return family
