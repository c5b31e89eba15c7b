"""GGUF files on the fast path (model/files.py): every architecture and tensor type we run,
against gguf's own dequantization with transformers' float32 forward, on files written here
(testing.write_gguf); exactness and greedy identity on quantized Qwen2 and Qwen3 files; a GGUF
draft model; bad files refused by name before any weight is read."""

from collections import Counter

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from constrained_spec import Generator, SamplingConfig, testing
from constrained_spec.errors import WeightsError
from constrained_spec.model import files, kernels, kv, models

needs_fused = pytest.mark.skipif(
    kernels.fused_missing() is not None, reason=f"no fused layers: {kernels.fused_missing()}"
)
LAYERS = ["python", pytest.param("fused", marks=needs_fused)]
# Q4_K_M as llama.cpp mixes it: Q4_K, with Q6_K for v and down (and the 256-indivisible rows'
# fallback, Q5_0, for some of them)
Q4_K_M = {"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q5_0", "token_embd": "Q6_K"}
IDS = list(range(3, 200, 3))  # 66 teacher-forced positions


def reference(path):
    """transformers' float32 model of the file: gguf's dequantization, its own un-permuting."""
    return AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True),
    ).eval()


compact = testing.compact_gguf


def relative_error(ours, theirs) -> float:
    return float(((ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)).max())


# --- each tensor type: the kernel's weights against the file's -----------------------------------


def kernel_parts(linear):
    """An Int4Linear's (q − 8, scale, zero) per weight, (N, copies·K) float32: what the kernel
    multiplies is (q − 8)·scale + zero, its copies' halves summed."""
    q = linear.dequantized_nibbles().float() - 8
    scale, zero = (x.float().repeat_interleave(kernels.GROUP, 1) for x in linear.scale_and_zero())
    return q, scale, zero


def halves_summed(x: torch.Tensor, copies: int) -> torch.Tensor:
    return sum(x.chunk(copies, dim=1))


@pytest.mark.parametrize("kind", files.LINEAR_TYPES)
def test_every_tensor_type_runs_within_its_stated_bound(kind, tmp_path):
    """Affine grids (Q4_0 … Q5_K) and Q8_0 run from the file's blocks, their scales rounded to
    bf16: each weight within WEIGHT_BOUND·(|q − 8|·|scale| + |zero|) per half. The others are
    re-quantized to Q8_0: within max|w|/254 of their group of 32, plus that rounding."""
    path = testing.write_gguf(tmp_path / "m.gguf", types=kind, layers=1)
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_up.weight")
    exact = torch.from_numpy(gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type))
    types = Counter()
    linear = files._linear([(tensor, None)], types)
    q, scale, zero = kernel_parts(linear)
    ours = halves_summed(q * scale + zero, linear.copies)
    bound = halves_summed(q.abs() * scale.abs() + zero.abs(), linear.copies) * files.WEIGHT_BOUND
    if kind in files.REQUANTIZED:
        groups = exact.abs().view(exact.shape[0], -1, kernels.GROUP).amax(-1)
        bound = bound + (groups / 254 * 1.001).repeat_interleave(kernels.GROUP, 1)
        assert list(types) == [f"{kind} → Q8_0 (re-quantized)"]
    else:
        assert list(types) == [kind] and linear.copies == (
            1 if files.AFFINE_BITS.get(kind) == 4 else 2
        )
    error = (ours - exact).abs()
    assert (error <= bound).all(), f"{kind}: {float((error / bound).max()):.3f} of the bound"
    assert float(error.max()) > 0 or kind == "F32", "nothing rounded: the test checks nothing"
    print(
        f"{kind}: max |Δw| {float(error.max()):.2e}, relative {float(error.max() / exact.abs().max()):.2e}"
    )


# --- whole files against transformers ----------------------------------------------------------


@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize(
    "arch, types, shape, bound",
    [
        ("llama", "Q4_K", {}, 0.05),
        ("llama", "Q8_0", {}, 0.02),
        ("qwen2", Q4_K_M, {}, 0.05),
        ("qwen3", "Q4_0", dict(heads=2, kv_heads=1), 0.03),  # transformers reads head_dim 128 only
    ],
    ids=["llama-Q4_K", "llama-Q8_0", "qwen2-Q4_K_M", "qwen3-Q4_0"],
)
def test_a_gguf_file_computes_what_transformers_does_on_its_dequantized_weights(
    arch, types, shape, bound, layers, tmp_path
):
    """Our forward over the file's blocks against transformers' float32 forward over gguf's
    dequantization of the same file: the logits within ``bound`` of theirs (relative, at the worst
    position; measured 0.012-0.043, median 0.009-0.017 over files and seeds: the activations' bf16
    rounding into every matmul, and for Q4_K_M the Q6_K re-quantization) and within 0.025 at the
    median position; the same top token at ≥ 95% of positions (random weights: near-ties)."""
    path = testing.write_gguf(tmp_path / f"{arch}.gguf", arch, types, **shape)
    model = compact(path, layers)
    ours = kv.forward(model, model.new_cache(), IDS, "cpu")
    with torch.no_grad():
        theirs = reference(path)(torch.tensor([IDS])).logits[0]
    assert relative_error(ours, theirs) < testing.logit_bound(model, bound), relative_error(
        ours, theirs
    )
    median = float(((ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)).median())
    assert median < testing.logit_bound(model, 0.025), median
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    assert agree >= 0.95, f"top-1 agreement {agree:.3f}"
    if arch == "qwen2":
        assert len(model.biases) == 2 and model.biases[0].abs().max() > 0
    if arch == "qwen3":
        assert len(model.qk_norms) == 4


@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize(
    "arch, tied, types",
    [
        ("llama", True, "Q4_K"),  # the built-in model's layout: one Q8_0 table, tied
        ("gemma3", False, {"*": "Q4_K", "output": "Q8_0"}),  # two Q8_0 tables (× √d: Gemma's)
        ("qwen2", False, "Q4_K"),  # a Q8_0 embedding, a Q6_K head
        ("gemma2", True, {"*": "Q4_K", "token_embd": "Q6_K"}),  # a Q4_K_M file of a tied model
    ],
    ids=["tied", "untied-Q8_0", "untied-Q6_K", "tied-Q6_K"],
)
def test_tables_as_blocks_compute_what_their_float32_rows_do(arch, tied, types, layers, tmp_path):
    """The token embedding and the LM head's rows, where the file holds them in Q8_0 or Q6_K,
    stay its blocks (kernels.BlockRows, once where tied: 1.06 and 1.25 bytes a value), their
    rows gguf's dequantization exactly; a prompt, a verify pass (narrow and wide masks) and a
    step give bit for bit the logits and features of the same model over float32 copies of those
    rows."""
    path = testing.write_gguf(tmp_path / "m.gguf", arch, types, tied=tied, hidden=256, ffn=256)
    model = compact(path, layers)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    embed, head = (
        tensors["token_embd.weight"],
        tensors["token_embd.weight" if tied else "output.weight"],
    )
    assert torch.equal(model.embed(slice(None)), files._float(embed))
    assert torch.equal(model.lm_head.dequantized(), files._float(head))
    assert (model.lm_head.table is model.embed) == tied
    for table, tensor in [(model.embed, embed), (model.lm_head.table, head)]:
        assert isinstance(table, kernels.BlockRows)
        group, size = {"Q8_0": (32, 34 / 32), "Q6_K": (16, 1.25)}[tensor.tensor_type.name]
        assert table.group == group
        assert (table.q.nbytes + table.scales.nbytes) / table.q.numel() == size

    reference = compact(path, "python")  # the same, its tables as float32 rows
    floats = {}
    for owner, name in [(reference, "embed"), (reference.lm_head, "table")]:
        table = getattr(owner, name)
        if isinstance(table, kernels.BlockRows):
            rows = floats.setdefault(
                id(table), torch.nn.Embedding.from_pretrained(table(slice(None)))
            )
            setattr(owner, name, rows)
    assert len(floats) == 2 - tied, "a table left out of the comparison"
    testing.run_layers(reference, layers)  # the fused layers' arguments: the float32 embedding
    vocab, ids = model.vocab_size, torch.tensor(IDS)
    masks = torch.ones(5, vocab, dtype=torch.bool)
    masks[1] = masks[3] = False
    masks[1, [3, 5, 7]] = masks[3, :9] = True  # narrow: their rows only (CompactLlama.head)
    masks[2, ::2] = False
    caches = [model.new_cache(), reference.new_cache()]
    for fed, mask in [(ids[:40], None), (ids[40:45], masks), (ids[45:46], None)]:
        (ours, our_features), (theirs, their_features) = (
            m(fed, cache, masks=mask) for m, cache in zip((model, reference), caches)
        )
        assert torch.equal(our_features, their_features)
        assert torch.equal(ours, theirs), f"{len(fed)} tokens"
        assert torch.isfinite(ours[mask if mask is not None else slice(None)]).all()


def test_dropping_qwen2s_biases_or_qwen3s_norms_would_be_caught(tmp_path):
    """The comparison above has the power to see what a silently dropped bias or norm costs."""
    for arch, part, shape in [
        ("qwen2", "biases", {}),
        ("qwen3", "qk_norms", dict(heads=2, kv_heads=1)),
    ]:
        path = testing.write_gguf(tmp_path / f"{arch}.gguf", arch, "Q8_0", **shape)
        model = compact(path)
        setattr(model, part, [])
        ours = kv.forward(model, model.new_cache(), IDS, "cpu")
        with torch.no_grad():
            theirs = reference(path)(torch.tensor([IDS])).logits[0]
        assert relative_error(ours, theirs) > 0.1, (arch, relative_error(ours, theirs))


@pytest.mark.parametrize("layers", LAYERS)
def test_llama_3_rotary_factors_from_the_file(layers, tmp_path):
    """Llama 3's rope_freqs tensor divides the rotary frequencies (as llama.cpp applies it);
    the reference: transformers' own llama3 frequencies (which its GGUF reader drops)."""
    rope = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)
    config = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=4, rope_theta=10000.0, max_position_embeddings=65536,
        rope_scaling={**rope, "original_max_position_embeddings": 8},
    )  # fmt: skip
    llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    factors = (plain / llama3).numpy()
    assert factors.max() > 2, "factors this small would test little"
    path = testing.write_gguf(tmp_path / "l3.gguf", "llama", "Q8_0", rope_factors=factors)
    model = compact(path, layers)
    ref = reference(path)
    ref.model.rotary_emb.inv_freq.copy_(llama3)
    ours = kv.forward(model, model.new_cache(), IDS, "cpu")
    with torch.no_grad():
        theirs = ref(torch.tensor([IDS])).logits[0]
    assert relative_error(ours, theirs) < testing.logit_bound(model, 0.02)


# --- the generator on a file -------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {
        "qwen2": testing.write_gguf(folder / "qwen2.gguf", "qwen2", Q4_K_M, seed=1),
        "qwen3": testing.write_gguf(
            folder / "qwen3.gguf", "qwen3", "Q4_K", heads=2, kv_heads=1, layers=1, seed=2
        ),
    }


def test_from_pretrained_runs_a_gguf_file_on_its_own_blocks(qwen_files):
    """weights="auto" on a GGUF file: its blocks in the compact forward, the tokenizer and chat
    template from the file, what ran said tensor type by tensor type; JSON out; greedy
    speculation commits the baseline's tokens."""
    gen = Generator.from_pretrained(str(qwen_files["qwen2"]))
    assert gen.weights == "int4"
    assert "GGUF tensors: 10 Q4_K, 2 Q6_K → Q8_0 (re-quantized), 2 Q5_0" in gen.weights_choice
    pad = len(gen.tokenizer) - 1  # the file's UNUSED token: never text, as in llama.cpp
    assert (
        gen.tokenizer.convert_ids_to_tokens(pad) == "[PAD0]" and gen.vocab.token_bytes[pad] is None
    )
    assert "<|im_start|>assistant" in gen.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    ids = gen.tokenizer.encode('Give a: {"a": "the same text again"}')
    base = Generator(gen.target, gen.tokenizer, draft=None).generate(
        ids, schema=schema, max_new_tokens=40
    )
    rounds = []
    spec = gen.generate(ids, schema=schema, max_new_tokens=40, on_round=rounds.append)
    assert sum(len(r.drafted) for r in rounds) > 0, "nothing drafted: speculation unused"
    constraint = gen.compile(schema=schema)
    testing.assert_greedy_match(gen.target, constraint, ids, base.token_ids, spec.token_ids)


@pytest.mark.parametrize(
    "target, draft, case",
    [
        ("qwen2", "qwen3", dict(temperature=1.0, num_draft_tokens=3)),
        ("qwen3", "qwen2", dict(temperature=0.7, top_p=0.9, num_draft_tokens=2)),
    ],
    ids=["qwen2-target-T1", "qwen3-target-T0.7"],
)
def test_speculation_on_gguf_files_with_a_gguf_draft_is_exact(target, draft, case, qwen_files):
    """The exactness suite's chi-square test on quantized Qwen2 and Qwen3 files, each drafted
    by the other (draft="path.gguf": a draft model on the fast path too)."""
    from constrained_spec.testing import chi_square, sequence_distribution

    gen = Generator.from_pretrained(str(qwen_files[target]), draft=str(qwen_files[draft]))
    assert gen.weights == "int4" and gen.drafter.model.model.weights == "int4"
    # prompts on the 4-bit kernel too, as the reference's fresh forwards run them (the baseline
    # and speculation share whichever prompt kernel runs: a bf16 copy's prompts differ slightly)
    gen.target.use_prefill("int4")
    cfg = SamplingConfig(case["temperature"], None, case.get("top_p"))
    regex, prompt = "(ab|ba|yes|no){1,2}", gen.tokenizer.encode("hello")
    exact = sequence_distribution(
        gen.target, gen.compile(regex=regex), prompt, cfg.temperature, None, cfg.top_p
    )
    sources, samples = set(), []
    for seed in range(1500):
        res = gen.generate(
            prompt,
            regex=regex,
            seed=seed,
            max_new_tokens=12,
            on_round=lambda r: sources.update(r.sources),
            **case,
        )
        samples.append(tuple(res.token_ids))
    p_value, tv = chi_square(samples, exact)
    assert p_value > 1e-3, f"chi-square p={p_value:.2e}, TV={tv:.3f}"
    assert "model" in sources, f"the draft model never drafted: {sources}"


# --- bad files, refused before any weight is read ----------------------------------------------


def explode(*args, **kwargs):
    raise AssertionError("weights read before the file was checked")


def test_an_unsupported_architecture_or_type_is_named_before_any_weight_is_read(
    tmp_path, monkeypatch
):
    phi = testing.write_gguf(tmp_path / "phi.gguf", "llama", "Q4_0")
    data = phi.read_bytes().replace(b"llama", b"phi3\x00", 1)  # general.architecture's value
    phi.write_bytes(data)
    odd = testing.write_gguf(tmp_path / "q2.gguf", "llama", {"*": "Q4_0", "ffn_up": "Q2_K"})
    monkeypatch.setattr(files, "dequantize", explode)
    monkeypatch.setattr(files, "_float", explode)
    with pytest.raises(WeightsError, match="phi3.*llama, qwen2, qwen3"):
        models.load_model(str(phi), weights="int4")
    with pytest.raises(WeightsError, match="Q2_K.*Q4_0, Q4_1"):
        models.load_model(str(odd), weights="int4")
    assert models.auto_weights(str(odd))[0] == "float"  # auto: the float path, and why
    assert "Q2_K" in models.auto_weights(str(odd))[1]


def test_a_truncated_file_is_named_with_what_is_wrong(tmp_path):
    path = testing.write_gguf(tmp_path / "cut.gguf", "llama", "Q4_0")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    for weights in ("int4", "auto"):  # auto too: a broken file is not a reason to run float
        with pytest.raises(WeightsError, match="cut.gguf: not a readable GGUF.*truncated"):
            models.load_model(str(path), weights=weights)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(WeightsError, match="garbage.gguf: not a readable GGUF"):
        models.load_model(str(garbage), weights="int4")


@pytest.mark.parametrize(
    "arch, tensor, have, implied", [("llama", "ffn_gate", 512, 768), ("phi3", "ffn_up", 1024, 1536)]
)
def test_a_linear_whose_shape_contradicts_the_metadata_is_named(
    arch, tensor, have, implied, tmp_path, monkeypatch
):
    # tensors of an MLP 512 wide under metadata that says 768: the first linear whose shape is
    # not the family's (families.layer_tensors; phi3's fused [gate | up] twice as wide) named
    odd = {f"{arch}.feed_forward_length": 768}
    path = testing.write_gguf(tmp_path / "odd.gguf", arch, "Q4_0", metadata=odd)
    monkeypatch.setattr(files, "dequantize", explode)
    monkeypatch.setattr(files, "_float", explode)
    message = (
        rf"odd.gguf: tensor blk.0.{tensor}.weight is \(256, {have}\), "
        rf"its metadata implies \(256, {implied}\)"
    )
    with pytest.raises(WeightsError, match=message):
        models.load_model(str(path), weights="int4")


@pytest.mark.skipif(
    all(kernels.int4_kernel_missing(k) for k in kernels.DENSE_KERNELS),
    reason="no dense prompt kernel runs here",
)
def test_prompts_skip_the_dense_copy_where_it_would_not_fit(qwen_files, monkeypatch):
    """The prompts' dense kernels need a bf16 copy of every linear (an 8B model's: 16 GB): where
    it exceeds DENSE_COPY_SHARE of the machine's memory, prompts run on the 4-bit kernel."""
    dense = next(k for k in kernels.DENSE_KERNELS if not kernels.int4_kernel_missing(k))
    monkeypatch.setattr(models, "prefill_kernel", lambda *a, **k: dense)  # as if fastest
    model, _ = models.load_model(str(qwen_files["qwen3"]), weights="int4")
    assert model.prefill == dense and model.linears[0].dense is not None
    monkeypatch.setattr(models, "DENSE_COPY_SHARE", 1e-9)
    model, _ = models.load_model(str(qwen_files["qwen3"]), weights="int4")
    assert model.prefill == "int4" and all(m.dense is None for m in model.linears)
