"""benchmarks/shapes.py's files: each shape's numbers give the real model's parameter count, its
tensors carry the names llama.cpp's converter gives its architecture, and a small file of each
family (written as the real shapes are) is read by our loader and by llama.cpp as that family."""

import dataclasses
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from constrained_spec import testing
from constrained_spec.model import families, files, models

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import shapes  # noqa: E402


@pytest.mark.parametrize("name", sorted(shapes.SHAPES))
def test_each_shape_has_its_models_parameter_count(name):
    shape = shapes.SHAPES[name]
    assert shape.params == shape.published_params


@pytest.mark.parametrize("name", sorted(shapes.SHAPES))
def test_tensor_names_are_the_converters(name):
    """Every tensor is one gguf-py (the converter's constants) lists for the architecture, and
    every tensor our loader needs of its family is there."""
    shape = shapes.SHAPES[name]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == shape.arch)
    allowed = {
        gguf.TENSOR_NAMES[t].format(bid=i) + suffix
        for t in gguf.MODEL_TENSORS[arch]
        for i in range(shape.layers)
        for suffix in (".weight", ".bias")
    }
    names = [name for name, _, _ in shapes.tensor_specs(shape)]
    assert len(set(names)) == len(names)
    assert set(names) <= allowed, sorted(set(names) - allowed)
    needed = [gguf for gguf, _ in shape.family.norms]
    needed += [gguf for stacked in shape.family.linears for gguf, _ in stacked]
    needed += ["attn_q_norm", "attn_k_norm"] if shape.family.qk_norms else []
    for i in range(shape.layers):
        assert {f"blk.{i}.{part}.weight" for part in needed} <= set(names)


def small(name: str, **dims):
    """The shape ``name`` at a few MB: its family, metadata and head size, fewer and narrower
    layers (six: one window period)."""
    return dataclasses.replace(
        shapes.SHAPES[name], layers=6, hidden=256, ffn=512, vocab=512, **dims
    )


@pytest.fixture
def small_tokenizer(tmp_path, monkeypatch):
    """write_f16 copies the tokenizer of a small GGUF (write_gguf's), not the built-in model's."""
    source = testing.write_gguf(tmp_path / "source.gguf", types="F16")
    monkeypatch.setattr(shapes, "builtin_gguf", lambda: source)


@pytest.mark.parametrize(
    "shape",
    [
        small("gemma3-1b", heads=2, kv_heads=1, head_dim=128, window=16),
        small("gemma2-2b", heads=2, kv_heads=1, head_dim=128, window=16),
        small("qwen3-0.6b", heads=4, kv_heads=2, head_dim=128),
        small("qwen2.5-0.5b", heads=4, kv_heads=2),
        small("llama-3.2-1b", heads=4, kv_heads=2),
        # llama.cpp's phi3 wants q as wide as the hidden state: 4 heads of 64, 48 of them rotating
        small("phi4-mini", heads=4, kv_heads=2, head_dim=64, rotary_dims=48),
        small("granite-3.1-2b", heads=4, kv_heads=2),
        small("smollm3-3b", heads=2, kv_heads=1),
    ],
    ids=lambda s: s.arch,
)
def test_a_small_file_loads_as_its_family(tmp_path, small_tokenizer, shape):
    path = shapes.write_f16(shape, tmp_path / "small.gguf")
    reader = files.read_gguf(path)
    assert files.check_gguf(reader, path) == shape.family
    config = files.gguf_config(path)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert head_dim == shape.head_dim and config.num_key_value_heads == shape.kv_heads
    assert config.rms_norm_eps == pytest.approx(shape.rms_eps)
    block = families.block_of(config)
    assert len(models.load_tokenizer(str(path))) == shape.vocab  # the logits' width
    if shape.window:  # every period-th layer full, the others windowed (Gemma 3: own base)
        period = shape.family.window_period
        assert block.windows == tuple(0 if i % period == period - 1 else 16 for i in range(6))
        local = config.rope_parameters[families.SLIDING]["rope_theta"]
        assert local == (shape.rope_theta_swa or shape.rope_theta)
        assert config.rope_parameters[families.FULL]["rope_theta"] == shape.rope_theta
        assert (config.attn_logit_softcapping or 0.0) == shape.attention_cap
        assert (config.final_logit_softcapping or 0.0) == shape.logit_cap
    else:
        assert set(block.windows) == {0}
    # the rotating dimensions, and LongRoPE's factors, attention factor and context as written
    assert families.rotary_dims(config) == (shape.rotary_dims or shape.head_dim)
    rope = families.rope_of(config, families.FULL)
    longrope = rope["rope_type"] == "longrope"
    assert longrope == bool(shape.longrope_context)
    if longrope:
        assert families.context_of(config) == shape.longrope_context < shape.context
        assert block.rotary_scale == pytest.approx(shapes.longrope_attention_factor(shape))
        assert block.rotary_scale > 1
        for kind, top in shapes.LONGROPE.items():
            factors = rope[f"{kind}_factor"]
            assert len(factors) == shape.rotary_dims // 2 and factors[-1] == pytest.approx(top)
    for field, value in shape.fields:  # Granite's scales, read by us
        assert getattr(config, field) == pytest.approx(value)
    if period := shape.family.nope_period:  # SmolLM3's every 4th layer unrotated: llama.cpp's rule
        assert block.rotary == tuple(2 * ((i + 1) % period == 0) for i in range(6))
    llama_cpp = pytest.importorskip("llama_cpp")
    # refuses a missing tensor or key; every row's logits (with the last only, llama-cpp-python
    # 0.3.36 leaves granite's and smollm3's row unwritten)
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False)
    every = sum(np.prod(dims) for _, dims, _ in shapes.tensor_specs(shape))
    assert llama_cpp.llama_model_n_params(llm.model) == every
    llm.eval([1, 5, 9])
    assert np.isfinite(llm.scores[:3]).all() and llm.scores[:3].any()
