"""The fast target: the compact Llama forward, its KV cache, the GGUF block formats and the
int4 kernels, each against an independent reference (transformers' forward, the gguf package's
quantizer, a plain float matmul, llama.cpp's permutation written out here)."""

import copy
import time

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, GPT2Config, GPT2LMHeadModel

from constrained_spec import testing
from constrained_spec.errors import SettingError, WeightsError
from constrained_spec.generator import Generator
from constrained_spec.model import compiled, files, kernels, kv, llama, models

BF16 = 2.0**-8  # unit roundoff of bf16 (8 significant bits): relative error of one rounding
# The tiny tokenizer's corpus, each text alone and all joined: 94 teacher-forced positions
TEXTS = [*testing.CORPUS, " ".join(testing.CORPUS)]


needs_fused = pytest.mark.skipif(
    kernels.fused_missing() is not None,
    reason=f"the fused layers cannot run here: {kernels.fused_missing()}",
)
needs_ours = pytest.mark.skipif(
    kernels.int4_kernel_missing("avx512-bf16") is not None,
    reason=f"our 4-bit kernel cannot run here: {kernels.int4_kernel_missing('avx512-bf16')}",
)


def int4_kernel(name: str):
    """The parameter of a test run on each 4-bit kernel; one this machine lacks skips."""
    missing = kernels.int4_kernel_missing(name)
    return pytest.param(
        name, marks=pytest.mark.skipif(missing is not None, reason=f"{name}: {missing}")
    )


INT4_KERNELS = [int4_kernel(name) for name in kernels.INT4_KERNELS]
# the fused layers' (the kernel library's): every 4-bit kernel but torch's
OURS = [int4_kernel(name) for name in kernels.INT4_KERNELS if name != "torch"]
# our kernels on the bf16 copy: the same instructions as the 4-bit kernels of the same names
DENSE = [int4_kernel(name) for name in kernels.DENSE_KERNELS]


def logits_of(model, ids, cache=None):
    """(n, V) logits of ``ids`` after what ``cache`` holds (a fresh cache when None)."""
    return kv.forward(model, model.new_cache() if cache is None else cache, ids, "cpu")


@torch.no_grad()
def transformers_logits(model, ids):
    return model(torch.tensor([ids])).logits[0]


# --- the compact forward and its cache ----------------------------------------------------------


def test_float_compact_forward_equals_transformers(tiny_target, tiny_tokenizer):
    compact = llama.from_transformers(tiny_target, "float")
    ids = tiny_tokenizer.encode(TEXTS[-1])
    expected = transformers_logits(tiny_target, ids)  # (n, V)
    torch.testing.assert_close(logits_of(compact, ids), expected, atol=1e-4, rtol=0)
    cache, chunks = compact.new_cache(), (ids[:1], ids[1:20], ids[20:])  # one token, then many
    incremental = torch.cat([logits_of(compact, chunk, cache) for chunk in chunks])
    assert cache.get_seq_length() == len(ids)
    torch.testing.assert_close(incremental, expected, atol=1e-4, rtol=0)
    _, features = kv.forward(compact, compact.new_cache(), ids, "cpu", features=True)
    torch.testing.assert_close(
        compact.get_output_embeddings()(features), expected, atol=1e-4, rtol=0
    )


def test_crop_then_refeed_equals_a_fresh_forward_past_the_initial_capacity(tiny_tokenizer):
    """Rejected positions are overwritten after a crop, including after the cache grew (it
    starts at 256 positions and doubles, copying what it holds)."""
    model = testing.tiny_model(tiny_tokenizer, seed=0, max_positions=1024)
    compact = llama.from_transformers(model, "float")
    text = tiny_tokenizer.encode(TEXTS[-1])
    ids = (text * 8)[:300]
    other = tiny_tokenizer.encode("yes no yes no abba")  # the "rejected" draft
    cache = compact.new_cache()
    initial = cache.capacity
    logits_of(compact, ids[:200], cache)
    logits_of(compact, ids[200:260] + other, cache)  # grows past 256 with 200 positions held
    assert cache.capacity > initial == 256, "the cache never grew: nothing was checked"
    cache.crop(260)
    assert cache.get_seq_length() == 260
    via_cache = logits_of(compact, ids[260:], cache)
    expected = transformers_logits(model, ids)[260:]
    torch.testing.assert_close(via_cache, expected, atol=1e-4, rtol=0)
    cache.crop(-len(ids[250:]))  # transformers' form: drop the last n
    assert cache.get_seq_length() == 250
    torch.testing.assert_close(
        logits_of(compact, other, cache),
        transformers_logits(model, ids[:250] + other)[250:],
        atol=1e-4,
        rtol=0,
    )


@needs_fused
@pytest.mark.parametrize("matmul", OURS)
def test_fused_layers_crop_refeed_and_growth_compute_what_a_fresh_cache_does(
    tiny_tokenizer, matmul
):
    """The fused layers write the cache themselves: after a growth (copying what it holds), a
    rejected draft and a crop, refeeding gives bit for bit what a fresh cache fed the same
    tokens gives, whatever the chunks (each token's values depend on its own inputs only)."""
    model = testing.tiny_model(tiny_tokenizer, seed=0, max_positions=1024)
    compact = llama.from_transformers(model, "int4")
    compact.use_matmul(matmul)
    compact.use_layers("fused")
    ids = (tiny_tokenizer.encode(TEXTS[-1]) * 8)[:300]
    other = tiny_tokenizer.encode("yes no yes no abba")

    def feed(cache, tokens, chunk):  # chunks under kernels.PREFILL_ROWS: the fused layers
        return torch.cat(
            [logits_of(compact, tokens[i : i + chunk], cache) for i in range(0, len(tokens), chunk)]
        )

    cache = compact.new_cache()
    feed(cache, ids[:250], 25)
    feed(cache, ids[250:260] + other, 7)
    assert cache.capacity > 256, "the cache never grew: nothing was checked"
    cache.crop(260)
    refed = feed(cache, ids[260:], 9)
    fresh = feed(compact.new_cache(), ids, 1)[260:]
    assert torch.equal(refed, fresh)


@needs_fused
def test_a_dropped_caches_buffers_serve_the_next_cache_bit_for_bit(tiny_tokenizer):
    """A dropped cache's buffers go to its model's pool and the next new (or growing) cache
    takes them, old contents and all (here NaN, which no comparison survives): it computes bit
    for bit what fresh buffers give, since nothing past a cache's length is read. Buffers that
    someone still holds stay out of the pool."""
    model = fused_tiny(tiny_tokenizer, models.matmul_kernel())
    ids = (tiny_tokenizer.encode(TEXTS[-1]) * 8)[:300]

    def feed(cache):  # past the 256 positions a cache starts with: it grows
        return torch.cat([logits_of(model, ids[i : i + 20], cache) for i in range(0, 300, 20)])

    first = nan_cache(model)
    keys, values = first.keys.data_ptr(), first.values.data_ptr()
    del first
    second = model.new_cache()
    assert (second.keys.data_ptr(), second.values.data_ptr()) == (keys, values), "not reused"
    pooled = feed(second)
    assert second.capacity > 256 and model.cache_pool.nbytes > 0, "growth gave nothing back"
    s, dtype = model.shape, second.values.dtype
    unpooled = llama.CompactCache(s.layers, s.kv_heads, s.head_dim, 256, s.context, dtype)
    assert torch.equal(pooled, feed(unpooled))

    model.cache_pool = llama.CachePool(llama.CACHE_POOL_BYTES)
    third = model.new_cache()
    held = third.keys
    del third
    assert model.cache_pool.nbytes == 0, "buffers someone holds went to the pool"
    assert model.new_cache().keys.data_ptr() != held.data_ptr()


def test_the_cache_pool_hands_out_only_what_fits_up_to_its_limit():
    """A spare fits a cache of the same layers, heads, head size and values dtype, with room
    for at least the positions asked, made in the same torch mode (an inference tensor cannot
    be written outside inference mode); the smallest that fits goes first; past the limit a
    given buffer is let go."""
    dims = (2, 1, 4)

    def buffers(capacity, dtype=torch.bfloat16):
        keys = torch.empty(*dims[:2], capacity // llama.KEY_TILE, dims[2], llama.KEY_TILE)
        return keys, torch.empty(*dims[:2], capacity, dims[2], dtype=dtype)

    pool = llama.CachePool(limit=10_000)
    big, small = buffers(64), buffers(32)
    pool.give(*big)
    pool.give(*small)
    assert pool.take(dims, 16, torch.float32) is None, "another values dtype"
    assert pool.take((2, 1, 8), 16, torch.bfloat16) is None, "another head size"
    assert pool.take(dims, 128, torch.bfloat16) is None, "too few positions"
    with torch.inference_mode():
        assert pool.take(dims, 16, torch.bfloat16) is None, "made outside inference mode"
    assert pool.take(dims, 16, torch.bfloat16)[0] is small[0]
    assert pool.take(dims, 16, torch.bfloat16)[0] is big[0]
    assert pool.take(dims, 16, torch.bfloat16) is None
    pool.give(*buffers(1024))  # 48 kB: over the limit
    assert pool.nbytes == 0


@needs_fused
def test_fused_layers_compute_what_the_python_layers_do(tiny_tokenizer):
    """The same function up to float rounding, on a tiny model whose attention is peaked (its
    query and key weights scaled up: a random one attends almost uniformly, where rotary and
    attention bugs barely show). Measured: 0.0005 relative logit difference; a sign flipped in
    the rotary gives 0.15."""
    model = testing.tiny_model(tiny_tokenizer, seed=3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    compact = llama.from_transformers(model, "int4")
    ids = tiny_tokenizer.encode(TEXTS[-1])
    logits = {}
    for kernel in kernels.LAYER_KERNELS:  # fused first: both on our fastest 4-bit kernel here
        testing.run_layers(compact, kernel)
        cache = compact.new_cache()
        logits[kernel] = torch.cat(
            [logits_of(compact, ids[i : i + 16], cache) for i in range(0, len(ids), 16)]
        )
    fused, python = logits["fused"], logits["python"]
    rel = ((fused - python).norm(dim=-1) / python.norm(dim=-1)).max()
    print(f"fused vs python layers: {rel:.4f} relative")
    assert rel < 0.01, f"relative logit difference {rel:.4f}"


@needs_fused
def test_the_fused_and_python_layers_keep_keys_in_the_same_tiles(tiny_tokenizer):
    """Keys come in tiles of KEY_TILE positions whichever layers write them: the fused layers'
    keys read back by position are the Python layers' (the same function up to float rounding;
    a misplaced position or element is off by the keys' whole size), over 300 positions, a
    growth past the first 256 and a crop."""
    compact = llama.from_transformers(
        testing.tiny_model(tiny_tokenizer, seed=3, max_positions=512), "int4"
    )
    ids = (tiny_tokenizer.encode(TEXTS[-1]) * 8)[:300]
    keys = {}
    for kernel in kernels.LAYER_KERNELS:  # fused first: both on our fastest 4-bit kernel here
        testing.run_layers(compact, kernel)
        cache = compact.new_cache()
        for i in range(0, 250, 25):
            logits_of(compact, ids[i : i + 25], cache)
        logits_of(compact, ids[250:260] + [5, 6, 7], cache)
        cache.crop(260)
        logits_of(compact, ids[260:], cache)
        assert cache.capacity > 256 and cache.keys.shape[-1] == llama.KEY_TILE
        keys[kernel] = cache.positions_keys(300)
    assert keys["fused"].shape == (2, 2, 300, 8)
    torch.testing.assert_close(keys["fused"], keys["python"], rtol=0.02, atol=0.02)


def test_a_verify_pass_and_batch_rows_compute_what_one_token_steps_do(every_int4_target):
    """Greedy speculation commits the baseline's tokens because every token of a verify pass,
    and every row of a batch, gets bit for bit the logits a one-token step gives it: on every
    way of running the layers and their 4-bit matmuls (the fixture's parameter)."""
    model = every_int4_target
    context, new = list(range(5, 45)), [7, 3, 11, 2, 9, 30, 4]
    prefilled = model.new_cache()
    logits_of(model, context, prefilled)
    steps = copy.deepcopy(prefilled)
    one_by_one = torch.cat([logits_of(model, [t], steps) for t in new])
    verify = logits_of(model, new, copy.deepcopy(prefilled))
    assert torch.equal(verify, one_by_one)
    other = model.new_cache()
    logits_of(model, context[:9], other)
    alone = logits_of(model, new[:3], copy.deepcopy(other))
    rows, _ = model.forward_rows(
        [torch.tensor(new), torch.tensor(new[:3])], [copy.deepcopy(prefilled), other]
    )
    assert torch.equal(rows[: len(new)], one_by_one), "a row depends on its neighbour"
    assert torch.equal(rows[len(new) :], alone), "a row depends on its neighbour"


# --- kept prompts (llama.PromptCache) -------------------------------------------------------------


def fused_tiny(tokenizer, matmul: str):
    model = llama.from_transformers(
        testing.tiny_model(tokenizer, seed=0, max_positions=512), "int4"
    )
    model.use_matmul(matmul)
    model.use_layers("fused")
    return model


def held(cache, n: int):
    return cache.positions_keys(n), cache.values[:, :, :n]


def nan_cache(model):
    """A new cache whose every entry is NaN until written: an entry left out never compares equal."""
    cache = model.new_cache()
    cache.keys.fill_(float("nan"))
    cache.values.fill_(float("nan"))
    return cache


@needs_fused
@pytest.mark.parametrize("matmul", OURS)
def test_a_prompt_starting_with_a_kept_one_holds_what_its_steps_compute(tiny_tokenizer, matmul):
    """A prompt that shares 50 tokens with a kept one copies their keys, values and features and
    computes the rest: bit for bit what one-token steps over the whole prompt write, and what a
    prefill with nothing kept gives (prompts longer than kernels.PREFILL_ROWS, in one pass)."""
    model = fused_tiny(tiny_tokenizer, matmul)
    first = (tiny_tokenizer.encode(TEXTS[-1]) * 3)[:90]
    second = first[:50] + tiny_tokenizer.encode("yes no yes no abba yes no")
    assert len(second) > kernels.PREFILL_ROWS
    assert kv.prefill(model, model.new_cache(), first, "cpu").cached == 0
    reused = nan_cache(model)
    copied = kv.prefill(model, reused, second, "cpu")
    assert copied.cached == 50
    steps = nan_cache(model)
    stepped = torch.cat([model(torch.tensor([t]), steps, logits=False)[1] for t in second])
    model.prompt_cache.clear()
    fresh = nan_cache(model)
    computed = kv.prefill(model, fresh, second, "cpu")
    assert computed.cached == 0
    for cache in (steps, fresh):
        assert all(map(torch.equal, held(reused, len(second)), held(cache, len(second))))
    assert torch.equal(copied.features, computed.features)
    assert torch.equal(copied.features, stepped)
    again = kv.prefill(model, model.new_cache(), second, "cpu")  # all of it kept: nothing fed
    assert again.cached == len(second) and torch.equal(again.features, stepped)


@needs_fused
def test_the_prompt_cache_keeps_the_longest_prompts_up_to_its_limit(tiny_tokenizer, monkeypatch):
    """Longest shared prefix wins; a prompt extending a kept one replaces it, one a kept prompt
    extends is not kept twice; past the limit the least recently used go; 0 keeps none; a bad
    setting is named before any model work."""
    model = fused_tiny(tiny_tokenizer, models.matmul_kernel())
    base = list(range(5, 65))

    def prefill(ids):
        return kv.prefill(model, model.new_cache(), ids, "cpu").cached

    def kept():
        return sorted(len(k) for k in model.prompt_cache._kept)

    prefill(base[:40])
    assert prefill(base) == 40 and kept() == [60], "the extended prompt replaces the shorter"
    assert prefill(base[:30]) == 30 and kept() == [60], "a prefix of a kept prompt is kept once"
    assert prefill(base[:20] + [3] * 30) == 20 and kept() == [50, 60]
    assert prefill(base[:25] + [4] * 5) == 25 and kept() == [30, 50, 60], "the longest shared"
    model.prompt_cache.limit = int(model.prompt_cache.nbytes / 140 * 100)  # 100 tokens' worth
    prefill([9] * 40)  # over the limit: the least recently used go (the 50, then the 60)
    assert kept() == [30, 40] and model.prompt_cache.nbytes <= model.prompt_cache.limit
    assert prefill(base) == 25, "the 60 went: only what the 30 shares with it is left"
    monkeypatch.setenv("CONSTRAINED_SPEC_PROMPT_CACHE_MB", "0")
    model.use_layers("fused")
    assert model.prompt_cache is None and prefill(base) == 0
    monkeypatch.setenv("CONSTRAINED_SPEC_PROMPT_CACHE_MB", "lots")
    with pytest.raises(SettingError, match="CONSTRAINED_SPEC_PROMPT_CACHE_MB='lots'.*keep none"):
        model.use_layers("fused")


def test_generation_after_a_kept_prompt_equals_a_cold_one(tiny_int4_target, tiny_tokenizer):
    """Requests whose prompts share a prefix with earlier ones (the chat template, instructions)
    commit what they would with nothing kept, greedy and sampled; stats count the copied
    tokens. The Python layers keep nothing (a long prompt's prefill kernel is not row-exact)."""
    target = copy.deepcopy(tiny_int4_target)
    gen = Generator(target, tiny_tokenizer)
    shared = tiny_tokenizer.encode('{"name": "Alice", "age": 30} yes no yes ' * 3)
    prompts = [shared + tiny_tokenizer.encode(tail) for tail in (" abba", " yes yes", " no")]
    settings = [dict(), dict(temperature=0.9, seed=3)]

    def run():
        return [
            gen.generate(p, schema=testing.PERSON, max_new_tokens=40, **kw)
            for p in prompts
            for kw in settings
        ]

    warm = run()
    fused = target.layer_kernel == "fused"
    assert [r.stats.cached_prompt_tokens > 0 for r in warm] == [False] + [fused] * 5
    for r in warm[2:]:
        assert r.stats.cached_prompt_tokens >= fused * len(shared)
    if fused:
        target.prompt_cache.limit = 0  # keeps nothing from here on
        target.prompt_cache.clear()
    cold = run()
    assert all(r.stats.cached_prompt_tokens == 0 for r in cold)
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]


# --- block formats: the gguf package's quantizer as the reference ------------------------------


@pytest.fixture(scope="module")
def rows():
    return (np.random.default_rng(0).standard_normal((64, 128)) * 0.05).astype(np.float32)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_block_split_and_dequantize_equal_gguf(kind, rows):
    qtype = getattr(gguf.GGMLQuantizationType, kind.upper())
    raw = gguf.quants.quantize(rows, qtype)  # (64, bytes per row)
    parts = getattr(kernels, f"split_{kind}")(torch.from_numpy(raw.copy()))
    dequantized = getattr(kernels, f"dequantize_{kind}")(*parts)
    np.testing.assert_array_equal(dequantized.numpy(), gguf.quants.dequantize(raw, qtype))
    assert not np.array_equal(dequantized.numpy(), rows), "a lossless round trip checks nothing"


@pytest.mark.parametrize("kind, max_changed", [("q4_1", 0.003), ("q8_0", 0.012)])
def test_quantize_matches_gguf_up_to_nearest_rounding(kind, max_changed, rows):
    """The scales (d, and m for Q4_1) equal llama.cpp's bit for bit. The 4/8-bit values do in all
    but ~0.17% (Q4_1) / ~0.7% (Q8_0) of the weights, where they differ by one step: llama.cpp
    rounds w/d with d and m before their fp16 rounding, kernels.quantize_* with the stored fp16
    values, so its q is the nearest grid point of what is stored (never a worse one)."""
    qtype = getattr(gguf.GGMLQuantizationType, kind.upper())
    w = torch.from_numpy(rows)
    split, dequantize = getattr(kernels, f"split_{kind}"), getattr(kernels, f"dequantize_{kind}")
    ours = getattr(kernels, f"quantize_{kind}")(w)
    theirs = split(torch.from_numpy(gguf.quants.quantize(rows, qtype)))
    for a, b in zip(ours[1:], theirs[1:]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    step = ours[0].int() - theirs[0].int()
    assert step.abs().max() <= 1 and (step != 0).float().mean() <= max_changed, (
        f"{(step != 0).float().mean():.4f} of q changed, up to {step.abs().max()}"
    )
    error, gguf_error = (dequantize(*ours) - w).abs(), (dequantize(*theirs) - w).abs()
    assert (error <= gguf_error).all(), "a q that is not the nearest of the stored grid"
    # the nearest of the stored grid, checked directly: no neighbour of q is closer to w
    d = ours[1].repeat_interleave(kernels.GROUP, 1)
    for neighbour in (-1, 1):
        moved = ours[0].int() + neighbour
        legal = (moved >= 0) & (moved <= 15) if kind == "q4_1" else moved.abs() <= 127
        other = moved * d + (ours[2].repeat_interleave(kernels.GROUP, 1) if kind == "q4_1" else 0)
        assert ((other - w).abs() >= error)[legal].all()


# --- the int4 kernel ----------------------------------------------------------------------------


def kernel_cases():
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    q, d, m = kernels.quantize_q4_1(w)
    q8, d8 = kernels.quantize_q8_0(w)
    # per weight: the bound on its change from rounding scale and zero to bf16 (relative BF16 each)
    q4_bound = BF16 * (
        (q.float() - 8).abs() * d.repeat_interleave(32, 1)
        + (m + 8 * d).abs().repeat_interleave(32, 1)
    )
    q8_bound = BF16 * (q8.float().abs() * d8.repeat_interleave(32, 1))
    return {
        "q4_1": (kernels.Int4Linear.from_q4_1(q, d, m), kernels.dequantize_q4_1(q, d, m), q4_bound),
        "q8_0": (kernels.Int4Linear.from_q8_0(q8, d8), kernels.dequantize_q8_0(q8, d8), q8_bound),
    }


@pytest.mark.parametrize("matmul", INT4_KERNELS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_int4_linear_computes_x_times_the_dequantized_weights(kind, matmul):
    """x·Wᵀ up to the kernel's roundings: x to bf16, then for ours on int8 activations to int8
    groups (both done in the reference too), scales and zeros to bf16 (bounded per weight), the
    output to bf16 (relative BF16)."""
    layer, w, weight_bound = kernel_cases()[kind]
    layer.use_kernel(matmul)
    x = torch.randn(9, w.shape[1], generator=torch.Generator().manual_seed(1))
    xb = x.bfloat16().float()
    if matmul in kernels.BLOCK_KERNELS:
        q, d = kernels.quantize_int8(xb)
        xb = (q.float().view(9, -1, kernels.GROUP) * d[..., None]).view(xb.shape)
    expected = xb @ w.T  # (9, N)
    scales = xb.abs() @ weight_bound.T  # (9, N)
    bound = scales + BF16 * (expected.abs() + scales) + 1e-6
    error = (layer(x) - expected).abs()
    assert (error <= bound).all(), f"error {error.max():.2e}, bound there {bound[error > bound]}"
    assert bound.max() < 0.02 * expected.abs().max(), "a bound this loose checks little"


@pytest.mark.parametrize("matmul", INT4_KERNELS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_int4_linear_rows_do_not_depend_on_how_many_are_fed(kind, matmul):
    """A verify pass of M tokens must give each token, bit for bit, the logits a one-token
    step gives it: that is what keeps greedy speculative decoding identical to the baseline.
    (Our kernels take rows 8 (AVX-512) or 16 and 32 (AMX) at a time, then the rest: every
    remainder is fed; batches' passes are longer than a verify pass.)"""
    layer, w, _ = kernel_cases()[kind]
    layer.use_kernel(matmul)
    x = torch.randn(40, w.shape[1], generator=torch.Generator().manual_seed(2))
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    for m in [*range(1, 18), 25, 31, 32, 33, 40]:  # 25: the longest verify pass (24 drafts + 1)
        assert torch.equal(layer(x[:m]), alone[:m]), f"{m} rows"
        assert torch.equal(layer(x[m - 1 :]), alone[m - 1 :]), f"rows {m - 1}.."


@pytest.mark.parametrize("ours", [int4_kernel("avx512-bf16"), int4_kernel("amx-bf16")])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_our_4bit_kernel_multiplies_what_torchs_does(kind, ours):
    """The same bf16 inputs, weights, scales and zeros, summed in float32 in another order and
    rounded once to bf16: at most one bf16 unit apart from torch's kernel (on a few outputs),
    and switching back restores torch's pack exactly."""
    layer, w, _ = kernel_cases()[kind]
    layer.use_kernel("torch")
    packed, scale_zero = layer.packed.clone(), layer.scale_zero.clone()
    x = torch.randn(13, w.shape[1], generator=torch.Generator().manual_seed(3))
    theirs = layer(x)
    layer.use_kernel(ours)
    assert layer.packed.dtype == torch.int32, "still torch's pack"
    ours = layer(x)
    ulp = theirs.abs() * BF16 * 2 + 1e-30  # one bf16 unit (2⁻⁷ relative) at the output's size
    assert ((ours - theirs).abs() <= ulp).all(), (ours - theirs).abs().max()
    assert (ours != theirs).float().mean() < 0.05, "mostly different: not the same sums"
    layer.use_kernel("torch")
    assert torch.equal(layer.packed, packed) and torch.equal(layer.scale_zero, scale_zero)
    assert torch.equal(layer(x), theirs)


# --- loading helpers ------------------------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows (i, i + hd/2) interleaved."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


@pytest.mark.parametrize("heads", [2, 4])
def test_unpermute_inverts_llama_cpp_permutation(heads):
    rows = heads * 8
    for shape in [(rows, 32), (rows, 2)]:  # weights or q, and per-block scales
        w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        permuted = llama_cpp_permute(w, heads)
        hd = rows // heads
        assert (permuted[1] == w[hd // 2]).all(), "the reference permutation is not llama.cpp's"
        restored = files._unpermute(torch.from_numpy(permuted), heads)
        np.testing.assert_array_equal(restored.numpy(), w)


# --- quantized tiny targets: close to the float one -----------------------------------------------


@pytest.mark.parametrize(
    "weights, floor, rel_to_float", [("int4", 0.85, 0.15), ("int8", 0.95, 0.02)]
)
def test_quantized_tiny_target_agrees_with_float(
    weights, floor, rel_to_float, tiny_target, tiny_tokenizer
):
    """Measured on these 94 positions: top-1 agreement 0.904 (int4) and 0.989 (int8); the
    logits' relative error 0.10 / 0.010 at worst (hidden size 32: one block per row)."""
    compact = llama.from_transformers(tiny_target, weights)
    assert compact.weights == weights
    agree, worst = [], 0.0
    for text in TEXTS:
        ids = tiny_tokenizer.encode(text)
        ours, theirs = logits_of(compact, ids), transformers_logits(tiny_target, ids)
        agree += (ours.argmax(-1) == theirs.argmax(-1)).tolist()
        worst = max(worst, float(((ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)).max()))
    assert len(agree) == 94
    assert sum(agree) / len(agree) >= floor, f"top-1 agreement {sum(agree) / len(agree):.3f}"
    assert worst <= rel_to_float, f"relative logit error {worst:.4f}"


@pytest.mark.parametrize("layers", kernels.LAYER_KERNELS)
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_quantized_forward_equals_transformers_on_the_same_blocks(
    weights, layers, tiny_target, tiny_tokenizer
):
    """The compact int4/int8 forward against transformers' forward over the very weights it
    holds (linears and LM head dequantized): only the kernels' bf16 roundings differ (measured
    0.0034 relative, python layers; against the float weights 0.07 for int4). Fed in chunks
    of 16 tokens (steps and verify passes, never a prompt's prefill), so that either way of
    running the layers computes every position."""
    if layers == "fused" and (missing := kernels.fused_missing()):
        pytest.skip(f"the fused layers cannot run here: {missing}")
    quantize = {"int4": kernels.quantize_q4_1, "int8": kernels.quantize_q8_0}[weights]
    dequantize = {"int4": kernels.dequantize_q4_1, "int8": kernels.dequantize_q8_0}[weights]
    reference = copy.deepcopy(tiny_target)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("_proj.weight"):
                p.copy_(dequantize(*quantize(p)))
        reference.lm_head.weight.copy_(
            kernels.dequantize_q8_0(*kernels.quantize_q8_0(reference.lm_head.weight))
        )
    ids = tiny_tokenizer.encode(TEXTS[-1])
    compact = llama.from_transformers(tiny_target, weights)
    testing.run_layers(compact, layers)
    cache = compact.new_cache()
    ours = torch.cat([logits_of(compact, ids[i : i + 16], cache) for i in range(0, len(ids), 16)])
    theirs = transformers_logits(reference, ids)
    rel = ((ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)).max()
    assert rel < testing.logit_bound(compact, 0.006), f"relative logit error {rel:.4f}"


# --- errors before model work -------------------------------------------------------------------


def explode(*args, **kwargs):
    raise AssertionError("model work before the weights option was checked")


def test_unknown_weights_fail_before_loading(monkeypatch):
    for name in (
        "_load_float",
        "_load_gguf_int4",
        "_run_from_file",
        "_converted_copy",
        "use_kernels",
    ):
        monkeypatch.setattr(models, name, explode)
    start = time.perf_counter()
    with pytest.raises(WeightsError, match="int3.*auto, int4, int8, float"):
        models.load_model(models.DEFAULT_MODEL, weights="int3")
    assert time.perf_counter() - start < 1.0


def test_weights_of_a_non_llama_model_point_to_float():
    gpt2 = GPT2LMHeadModel(
        GPT2Config(
            n_layer=1,
            n_embd=32,
            n_head=2,
            vocab_size=50,
            n_positions=32,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    with pytest.raises(WeightsError, match="the 'gpt2' architecture.*weights='float'"):
        llama.from_transformers(gpt2, "int4")


@pytest.mark.parametrize("layers", kernels.LAYER_KERNELS)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_checkpoints_compute_their_biases_and_qk_norms(arch, layers):
    """Qwen2's q/k/v biases and Qwen3's per-head q/k norms are computed (once dropped silently:
    logits 0.71 off, another top token at 6 of 6 positions): the int8 compact forward against
    transformers' over the same blocks, and without them it is far off."""
    if layers == "fused" and (missing := kernels.fused_missing()):
        pytest.skip(f"the fused layers cannot run here: {missing}")
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    kind = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_class, model_class = kind[arch]
    torch.manual_seed(0)
    config = config_class(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    model = model_class(config).eval()
    with torch.no_grad():  # transformers initializes biases at 0 and norms at 1: make them count
        for name, p in model.named_parameters():
            if name.endswith(("proj.bias", "q_norm.weight", "k_norm.weight")):
                p.copy_(
                    torch.randn_like(p) * (0.5 if name.endswith("bias") else 0.3)
                    + (name.endswith("weight"))
                )
            if name.endswith("_proj.weight"):
                p.copy_(kernels.dequantize_q8_0(*kernels.quantize_q8_0(p)))
        model.lm_head.weight.copy_(
            kernels.dequantize_q8_0(*kernels.quantize_q8_0(model.lm_head.weight))
        )
    compact = llama.from_transformers(model, "int8")
    testing.run_layers(compact, layers)
    ids = list(range(1, 90, 2))
    theirs = transformers_logits(model, ids)
    ours = logits_of(compact, ids)
    bound = testing.logit_bound(compact, 0.01)
    assert ((ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)).max() < bound
    compact.biases, compact.qk_norms = [], []
    testing.run_layers(compact, layers)
    without = logits_of(compact, ids)
    assert ((without - theirs).norm(dim=-1) / theirs.norm(dim=-1)).max() > 0.1


def test_llama_variants_the_compact_forward_does_not_compute_point_to_float(tiny_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    base = dict(
        vocab_size=len(tiny_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    for extra, words in [
        (dict(attention_bias=True), "bias on the attention output"),
        (
            dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
            "'dynamic' rotary scaling",
        ),
    ]:
        model = LlamaForCausalLM(LlamaConfig(**base, **extra))
        with pytest.raises(WeightsError, match=f"{words}.*weights='float'"):
            llama.from_transformers(model, "int8")


def test_int8_draft_of_a_compact_target_is_refused(tiny_target, tiny_tokenizer, monkeypatch):
    """draft='int8' copies a transformers model; a compact target has none to copy. (Refused
    after loading today; the arguments alone decide it, so refusing before would pass too.)"""
    monkeypatch.setattr(
        models,
        "load_model",
        lambda name, dtype=torch.float32, weights="float": (
            llama.from_transformers(tiny_target, weights),
            tiny_tokenizer,
        ),
    )
    for draft in ("int8", "bf16"):
        with pytest.raises(WeightsError, match=f"draft='{draft}'.*weights='int4'.*weights='float'"):
            Generator.from_pretrained("tiny", draft=draft, weights="int4")


# --- the kernels: fixed by the CPU, never by a timing ----------------------------------------------


def test_the_kernels_follow_the_cpu_and_no_timing(monkeypatch, tiny_target):
    """Which kernels run is a function of what this CPU and build run: the first of
    MATMUL_ORDER, the fused layers where they load (never around torch's kernel), the prompts'
    bf16 copy on AMX or AVX-512 BF16 where they run, the Q8 head wherever 4-bit kernels run.
    weights="auto" reads no config and times nothing for the built-in model."""
    runs = set()
    monkeypatch.setattr(
        kernels, "int4_kernel_missing", lambda k: None if k in runs or k == "torch" else "no"
    )
    monkeypatch.setattr(kernels, "fused_missing", lambda: None)
    monkeypatch.setattr(kernels, "best_ms", explode)
    for ours, matmul, prefill in [
        ({"amx-bf16", "avx512-bf16", "avx2"}, "amx-bf16", "amx-bf16"),
        ({"avx512-bf16", "avx2"}, "avx512-bf16", "avx512-bf16"),
        ({"avx2"}, "avx2", "int4"),
        ({"neon"}, "neon", "int4"),
        ({"scalar"}, "scalar", "int4"),  # the kernel library's baseline variant
        (set(), "torch", "int4"),
    ]:
        runs.clear()
        runs.update(ours)
        assert models.matmul_kernel() == matmul
        layers = models.layer_kernel(matmul)
        assert layers == ("python" if matmul == "torch" else "fused")
        assert models.prefill_kernel(matmul, layers) == prefill
        assert models.head_kernel() == "q8"
    for name in ("load_config", "builtin_gguf", "_converted_copy"):
        monkeypatch.setattr(models, name, explode)
    assert models.auto_weights(models.DEFAULT_MODEL) == (
        "int4",
        "auto: the 4-bit kernels run on this CPU (torch)",
    )
    monkeypatch.setattr(kernels, "int4_missing", lambda: "NotImplementedError: no int4 op")
    assert models.head_kernel() == "float"
    assert models.auto_weights(models.DEFAULT_MODEL)[0] == "float"


# --- the real default model -----------------------------------------------------------------------

CHATS = [
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ],
    [
        {"role": "user", "content": "Give me a JSON object with a name and an age."},
        {"role": "assistant", "content": '{"name": "Alice", "age": 30}'},
    ],
    [
        {"role": "user", "content": "Write a haiku about the sea."},
        {
            "role": "assistant",
            "content": "Waves fold into foam,\nsalt wind carries gull voices,\n"
            "the tide keeps its time.",
        },
    ],
]


@pytest.mark.real_model
def test_real_default_model_int4_is_its_gguf_blocks():
    """load_model(weights="int4") runs the GGUF's own Q4_1 blocks: dequantized, they equal the
    float copy's weights exactly (q and k through the un-permutation); the loaded kernels hold
    them (up to bf16 scales); top-1 agreement with the float model stays high."""
    model, tokenizer = models.load_model(models.DEFAULT_MODEL, weights="int4")
    model.use_prefill("int4")  # the weights are read back below through 576-row inputs
    float_model, _ = models.load_model(models.DEFAULT_MODEL)
    assert isinstance(model, llama.CompactLlama) and model.weights == "int4"
    s, fm = model.shape, float_model.model
    path = (
        models.cache_dir()
        / models.DEFAULT_MODEL
        / models.BUILTIN_MODELS[models.DEFAULT_MODEL].gguf_member.split("/")[-1]
    )
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim
    cases = [
        ("blk.0.attn_q.weight", s.heads, fm.layers[0].self_attn.q_proj, 0, slice(0, q_rows)),
        (
            "blk.3.attn_k.weight",
            s.kv_heads,
            fm.layers[3].self_attn.k_proj,
            12,
            slice(q_rows, q_rows + kv_rows),
        ),
        ("blk.5.ffn_down.weight", None, fm.layers[5].mlp.down_proj, 23, slice(None)),
    ]
    for name, heads, float_linear, index, rows in cases:
        q, d, m = kernels.split_q4_1(torch.from_numpy(tensors[name].data.copy()))
        if heads is not None:
            q, d, m = (files._unpermute(t, heads) for t in (q, d, m))
        w = kernels.dequantize_q4_1(q, d, m)
        torch.testing.assert_close(w, float_linear.weight, atol=0, rtol=0, msg=name)
        eye = torch.eye(w.shape[1])
        loaded = model.linears[index](eye).T[rows]  # (N, K)
        scales = BF16 * (
            (q.float() - 8).abs() * d.repeat_interleave(32, 1)
            + (m + 8 * d).abs().repeat_interleave(32, 1)
        )
        bound = scales + BF16 * (w.abs() + scales)  # bf16 scale and zero, then a bf16 output
        assert ((loaded - w).abs() <= bound).all(), f"{name}: the kernel holds other weights"
    agree, head = [], model.lm_head
    for chat in CHATS:
        ids = tokenizer.apply_chat_template(chat, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        ours, theirs = logits_of(model, ids), transformers_logits(float_model, ids)
        agree += (ours.argmax(-1) == theirs.argmax(-1)).tolist()
        # the Q8_0 head on real features: within its bound, float32's top token
        _, features = kv.forward(model, model.new_cache(), ids, "cpu", features=True)
        exact = features @ head.dequantized().T
        for matmul in kernels.INT4_KERNELS:  # each kernel that runs here, with its own bound
            if kernels.int4_kernel_missing(matmul) is None:
                head.use_kernel(matmul)
                approx, bound = head.approximate(features)
                assert ((approx - exact).abs() <= bound).all(), f"{matmul}: left its bound"
                assert torch.equal(head(features).argmax(-1), exact.argmax(-1))
    rate = sum(agree) / len(agree)
    print(f"int4 vs float top-1 agreement: {rate:.3f} over {len(agree)} positions")
    assert len(agree) >= 90 and rate >= 0.9, f"top-1 agreement {rate:.3f} over {len(agree)}"


# --- the bf16 prefill kernel ----------------------------------------------------------------------


def test_the_prefill_kernel_runs_only_on_prompt_prefills():
    """Verify passes, steps and batches of rows (however many) keep the 4-bit kernel whatever the
    prefill kernel; a prefill on the bf16 kernel computes the same product, up to bf16."""
    torch.manual_seed(0)
    linear = kernels.Int4Linear.from_q4_1(*kernels.quantize_q4_1(torch.randn(96, 64) * 0.1))
    short, long = torch.randn(25, 64), torch.randn(kernels.PREFILL_ROWS, 64)
    four_bit = linear(short), linear(long)
    linear.use_prefill("bf16")
    assert torch.equal(linear(short), four_bit[0])
    assert torch.equal(linear(long), four_bit[1]), "a batch of rows took the prefill kernel"
    bf16 = linear(long, prefill=True)
    assert not torch.equal(bf16, four_bit[1]), "the bf16 kernel did not run"
    torch.testing.assert_close(bf16, four_bit[1], atol=0.05 * four_bit[1].abs().max(), rtol=0)


def test_greedy_speculation_equals_the_baseline_after_a_bf16_prefill(
    tiny_int4_target, tiny_draft, tiny_tokenizer
):
    """The bf16 copy through torch's matmul (Python layers) or ours (fused layers: AMX where
    the CPU has it, else AVX-512 BF16)."""
    target = copy.deepcopy(tiny_int4_target)
    ours = [k for k in kernels.DENSE_KERNELS if not kernels.int4_kernel_missing(k)]
    if target.layer_kernel == "fused" and not ours:
        why = "; ".join(f"{k}: {kernels.int4_kernel_missing(k)}" for k in kernels.DENSE_KERNELS)
        pytest.skip(f"the fused layers' prompts have no kernel on the bf16 copy here ({why})")
    target.use_prefill("bf16" if target.layer_kernel == "python" else ours[0])
    gen = Generator(target, tiny_tokenizer, draft=tiny_draft)
    prompt = tiny_tokenizer.encode('{"name": "Alice", "age": 30} yes no yes ' * 4)
    assert len(prompt) > kernels.PREFILL_ROWS, "the prompt must take the prefill kernel"
    base = gen.generate(prompt, schema=testing.PERSON, speculative=False, max_new_tokens=60)
    spec = gen.generate(prompt, schema=testing.PERSON, num_draft_tokens=4, max_new_tokens=60)
    assert spec.stats.drafted > 0
    assert spec.token_ids == base.token_ids


@pytest.mark.parametrize("dense", DENSE)
def test_the_dense_kernels_compute_each_row_from_its_own_input_alone(dense):
    """Ours on the bf16 copy: any slice of rows (within a tile, across tiles, padded or not)
    gives bit for bit those rows of the whole pass, torch's bf16 matmul does not promise this;
    the product is the copy's up to the output's bf16 rounding. 80 outputs: an odd number of
    tile columns (AVX-512 BF16 takes two at a time)."""
    torch.manual_seed(0)
    linear = kernels.Int4Linear.from_q4_1(*kernels.quantize_q4_1(torch.randn(80, 96) * 0.1))
    linear.use_prefill(dense)
    x = torch.randn(75, 96)
    whole = linear(x, prefill=True)
    for rows in (
        slice(0, 1),
        slice(3, 4),
        slice(0, 16),
        slice(5, 38),
        slice(16, 48),
        slice(60, 75),
    ):
        assert torch.equal(linear(x[rows], prefill=True), whole[rows]), rows
    copy_ = linear.dequantized_bf16().float()
    exact = x.bfloat16().float() @ copy_.T
    torch.testing.assert_close(whole, exact, atol=1e-5, rtol=kernels.BF16_ROUNDOFF)
    assert not torch.equal(whole, linear(x)), "the 4-bit kernel ran, not the copy"


@pytest.mark.parametrize("dense", DENSE)
def test_fused_prompts_on_the_dense_kernel_reuse_kept_ones_bit_for_bit(tiny_tokenizer, dense):
    """With a prefill on the copy, a prompt copying 50 tokens from a kept one and computing
    the rest (fewer than kernels.PREFILL_ROWS) holds what a fresh prefill gives; the copy ran
    (values differ from the 4-bit kernel's, within bf16); steps and verify passes stay 4-bit."""
    model = fused_tiny(tiny_tokenizer, dense)
    first = (tiny_tokenizer.encode(TEXTS[-1]) * 3)[:90]
    second = first[:50] + tiny_tokenizer.encode("yes no abba")
    assert len(second) - 50 < kernels.PREFILL_ROWS
    four_bit = kv.prefill(model, nan_cache(model), second, "cpu")
    model.use_prefill(dense)  # empties the kept prompts: they are the 4-bit kernel's
    assert kv.prefill(model, model.new_cache(), first, "cpu").cached == 0
    reused = nan_cache(model)
    copied = kv.prefill(model, reused, second, "cpu")
    assert copied.cached == 50
    model.prompt_cache.clear()
    fresh = nan_cache(model)
    computed = kv.prefill(model, fresh, second, "cpu")
    assert computed.cached == 0
    assert all(map(torch.equal, held(reused, len(second)), held(fresh, len(second))))
    assert torch.equal(copied.features, computed.features)
    assert not torch.equal(computed.features, four_bit.features), "the copy did not run"
    scale = four_bit.features.abs().max()
    torch.testing.assert_close(computed.features, four_bit.features, atol=0.1 * scale, rtol=0)
    steps = model.new_cache()
    stepped = torch.cat([model(torch.tensor([t]), steps, logits=False)[1] for t in second])
    assert torch.equal(stepped, four_bit.features), "a step took the prefill kernel"
    with pytest.raises(WeightsError, match="'int4', 'amx-bf16' or 'avx512-bf16'"):
        model.use_prefill("bf16")


def test_a_missing_int4_kernel_is_named_and_auto_falls_back(monkeypatch):
    """A torch build without the 4-bit CPU kernel: asking for it is a clear error before any
    loading; the measurement behind "auto" never picks it."""
    monkeypatch.setattr(kernels, "int4_missing", lambda: "NotImplementedError: no int4 op")
    for name in ("_load_float", "_load_gguf_int4", "_run_from_file", "_converted_copy"):
        monkeypatch.setattr(models, name, explode)
    for weights in ("int4", "int8"):
        with pytest.raises(WeightsError, match="no int4 op.*weights='float'"):
            models.load_model(models.DEFAULT_MODEL, weights=weights)
    assert models.auto_weights(models.DEFAULT_MODEL)[0] == "float"


def test_without_the_kernel_library_the_python_loop_runs_and_says_why(monkeypatch, tiny_target):
    """Where no kernel library loads, the model runs the Python loop on torch's kernel and the
    --stats line says why (asking for the fused layers anyway is a WeightsError naming the
    cause); where it loads, the fused layers run ours only (torch's runs the Python layers) and
    --stats names the library's variant."""
    compact = llama.from_transformers(tiny_target, "int4")
    if kernels.fused_missing() is None:
        assert models.use_kernels(compact) == f"fused/{models.matmul_kernel()}"
        described = models.describe_weights("tiny", "int4", "int4", compact)
        assert f"kernels {kernels.library_key()} (prebuilt" in described
        compact.use_matmul("torch")
        assert compact.layer_kernel == "python", "torch's 4-bit kernel ran the fused layers"
        with pytest.raises(WeightsError, match="our 4-bit kernels only.*torch's"):
            compact.use_layers("fused")
    monkeypatch.setattr(compiled, "load", lambda: (None, "no kernel library was built here"))
    assert models.use_kernels(compact) == "python/torch"
    described = models.describe_weights("other", "int4", "int4", compact)
    assert "fused: no kernel library was built here" in described
    assert (
        "4-bit matmuls torch's (ours: it is in the kernel library, which does not run" in described
    )
    with pytest.raises(WeightsError, match="fused layers cannot run here: no kernel library"):
        compact.use_layers("fused")
    with pytest.raises(WeightsError, match="'avx512-bf16' 4-bit kernel cannot run here"):
        compact.use_matmul("avx512-bf16")


@needs_ours
def test_use_kernels_puts_a_model_on_ours(tiny_target):
    """The choice left on the model: our kernel's tiles in place of torch's pack, fused layers."""
    compact = llama.from_transformers(tiny_target, "int4")
    assert compact.matmul == "torch" and compact.layer_kernel == "python"
    assert models.use_kernels(compact) == f"fused/{models.matmul_kernel()}"
    assert all(m.packed.dtype == torch.int32 for m in compact.linears)  # our tiles, not torch's


@needs_ours
def test_torch_kernel_and_back_restores_the_fused_layers(tiny_target):
    """A benchmark's torch-matmul configuration runs torch's kernel on the Python layers, then
    puts ours back: the fused layers come back with them (they stayed in the Python loop, 4x
    slower, for every configuration after it), and a step computes what it did before."""
    compact = llama.from_transformers(tiny_target, "int4")
    models.use_kernels(compact)
    if compact.layer_kernel != "fused":
        pytest.skip(f"the fused layers do not run here: {kernels.fused_missing()}")
    ours, ids = compact.matmul, torch.tensor([3, 17, 42, 9])

    def logits():
        return compact.forward_rows([ids], [compact.new_cache()])[0]

    before = logits()
    compact.use_matmul("torch")
    assert compact.layer_kernel == "python"
    compact.use_matmul(ours)
    assert (compact.matmul, compact.layer_kernel) == (ours, "fused")
    assert compact.prompt_cache is not None
    torch.testing.assert_close(logits(), before, rtol=0, atol=0)


# --- the mask-aware LM head -----------------------------------------------------------------------


@pytest.mark.parametrize("library", [pytest.param(True, marks=needs_fused), False])
def test_legal_counts_are_each_positions_legal_tokens(library, monkeypatch):
    """The head's narrow test counts each position's legal tokens: compiled or as bytes, on
    a vocabulary that is not a multiple of any vector width, and on a non-contiguous mask."""
    if library:
        kernels.fused_library()
    else:
        monkeypatch.setattr(compiled, "_loaded", None)
    torch.manual_seed(0)
    masks = torch.rand(7, 49_157) < torch.linspace(0, 1, 7)[:, None]
    masks[0], masks[-1] = False, True
    expected = masks.sum(1).tolist()
    assert llama.legal_counts(masks) == expected
    assert llama.legal_counts(masks.T.contiguous().T) == expected


def test_the_head_computes_only_the_legal_logits_of_narrow_positions(tiny_int4_target):
    """A position with at most V·NARROW legal tokens gets exactly those logits in float32 (its
    rows of the head, −inf elsewhere); a wider one gets the whole head; the largest legal logit
    is float32's everywhere; no position's logits depend on the other positions fed with it."""
    model = tiny_int4_target
    weight = model.lm_head.dequantized()  # (V, d) float32
    vocab = weight.shape[0]
    limit = int(llama.NARROW * vocab)
    torch.manual_seed(0)
    features = torch.randn(6, model.shape.hidden)
    masks = torch.zeros(6, vocab, dtype=torch.bool)
    for i, legal in enumerate([1, limit, limit + 1, vocab, 3, vocab // 2]):
        masks[i, torch.randperm(vocab)[:legal]] = True
    exact = features @ weight.T
    logits = model.head(features, masks)
    narrow, wide = [0, 1, 4], [2, 3, 5]
    torch.testing.assert_close(logits[narrow][masks[narrow]], exact[narrow][masks[narrow]])
    assert torch.isinf(logits[narrow][~masks[narrow]]).all(), "a narrow position got the head"
    assert torch.isfinite(logits[wide]).all(), "a wide position was cut to its legal tokens"
    best = exact.masked_fill(~masks, float("-inf")).argmax(1)
    assert torch.equal(logits.masked_fill(~masks, float("-inf")).argmax(1), best)
    for i in range(6):
        alone = model.head(features[i : i + 1], masks[i : i + 1])[0]
        assert torch.equal(alone, logits[i]), f"position {i} depends on the others"


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("matmul", INT4_KERNELS)
@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_fused), False])
def test_q8_head_is_float32_at_the_top_and_within_its_bound_elsewhere(seed, matmul, fused):
    """The Q8_0 head: every logit within its stated bound of the float32 product, the largest
    legal logit recomputed in float32 (greedy picks float32's token), whatever the mask, on
    each 4-bit kernel (each with its own bound), as one call of the kernel library (ours: torch's
    runs as torch ops either way) and as torch ops."""
    torch.manual_seed(seed)
    vocab, d = 1000, 128
    weight = kernels.dequantize_q8_0(*kernels.quantize_q8_0(torch.randn(vocab, d) * 0.05))
    head = kernels.Q8Head(weight)
    head.use_kernel(matmul)
    head.fused = fused
    x = torch.randn(64, d) * torch.logspace(-1, 1.5, 64)[:, None]  # flat to peaked logits
    x[::7, ::5] = torch.randn(10, 26) * 1e-40  # a few denormals: flushed by our kernel
    legal = torch.rand(64, vocab) < torch.linspace(0.01, 1, 64)[:, None]
    legal[:, 0] = True
    exact = x.double() @ weight.double().T  # (n, V): the float32 head up to its rounding
    logits = head(x, legal).double()
    approx, bound = (t.double() for t in head.approximate(x))
    assert ((approx - exact).abs() <= bound).all(), "the kernel's logits left their bound"
    assert ((logits - exact).abs() <= bound).all()
    top = exact.masked_fill(~legal, float("-inf")).argmax(1)
    assert torch.equal(logits.masked_fill(~legal, float("-inf")).argmax(1), top)
    at_top = logits.gather(1, top[:, None]), exact.gather(1, top[:, None])
    torch.testing.assert_close(*at_top, rtol=1e-6, atol=1e-5)  # float32 rounding only
    assert (logits != approx).any(1).all(), "no logit was recomputed in float32"
    recomputed = logits != approx
    assert (recomputed <= legal).all(), "an illegal logit was recomputed"
    head.fused = not fused  # the other way: the same logits but where float32 was recomputed
    other = head(x, legal).double()
    assert torch.equal(recomputed, other != approx)
    torch.testing.assert_close(logits, other, rtol=1e-6, atol=1e-5)
    for i in range(0, 64, 9):  # a position's logits do not depend on the others'
        assert torch.equal(head(x[i : i + 1], legal[i : i + 1])[0], head(x, legal)[i])


def test_q6_k_rows_are_ggufs_dequantization_bit_for_bit():
    """Q6_K blocks split into q (int8 in [−32, 31]) and float32 scales d·sc per sub-block of 16
    (kernels.BlockRows) dequantize to gguf's float32 values bit for bit: over every bit pattern
    of ql, qh and the int8 scales, and d of every size (subnormal fp16 ones, zeros, negatives)."""
    rng = np.random.default_rng(6)
    raw = rng.integers(0, 256, (300, 4, 210), dtype=np.uint8)
    d = rng.standard_normal((300, 4)) * 10.0 ** rng.uniform(-9, 3, (300, 4))
    raw[..., 208:210] = d.astype(np.float16)[..., None].view(np.uint8)
    raw = raw.reshape(300, -1)  # (rows, 4 blocks of 256 values)
    rows = kernels.BlockRows(*kernels.split_q6_k(torch.from_numpy(raw)))
    assert rows.group == 16 and rows.q.min() == -32 and rows.q.max() == 31
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K))
    assert torch.equal(rows(slice(None)), theirs)
    ids = torch.tensor([[299, 0], [7, 7]])
    assert torch.equal(rows(ids), theirs[ids])
    assert (rows.q.nbytes + rows.scales.nbytes) / rows.q.numel() == 1.25  # float32: 4


def _table(kind: str, vocab: int, width: int) -> kernels.BlockRows:
    """A random table of rows as a file's ``kind`` blocks (Q8_0, Q6_K)."""
    raw = testing.gguf_blocks(kind, vocab, width, np.random.default_rng(vocab))
    split = {"Q8_0": kernels.split_q8_0, "Q6_K": kernels.split_q6_k}[kind]
    q, scales = split(torch.from_numpy(raw))
    rows = (
        kernels.BlockRows.from_q8_0(q, scales) if kind == "Q8_0" else kernels.BlockRows(q, scales)
    )
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    assert torch.equal(rows(slice(None)), torch.from_numpy(theirs))  # the file's values
    return rows


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K"])
@pytest.mark.parametrize("vocab", [1024, 1000])  # Q8_0's blocks screen as they are, or padded
@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_fused), False])
def test_q8_head_rows_kept_as_blocks_give_the_float32_rows_logits(kind, vocab, fused):
    """A head keeps a file's Q8_0 or Q6_K rows as their blocks (kernels.BlockRows; Q6_K's screen
    runs on their Q8_0 rounding) and dequantizes the rows it recomputes: its logits are bit for
    bit those of the same head over a float32 copy of the rows, whole or masked, as one compiled
    call and as torch ops. Float32 rows that are Q8_0 values are kept as blocks; others stay
    float32."""
    torch.manual_seed(vocab)
    rows = _table(kind, vocab, 256)
    floats = rows(slice(None))
    ids = torch.tensor([[5, 0], [vocab - 1, 7]])
    assert torch.equal(rows(ids), floats[ids])  # any shape of ids, as nn.Embedding takes
    head = kernels.Q8Head(rows)
    assert head.table is rows  # not a float32 copy
    head.fused = fused
    reference = copy.deepcopy(head)
    reference.table = torch.nn.Embedding.from_pretrained(floats)  # a float32 copy
    x = torch.randn(16, 256) * torch.logspace(-1, 1.5, 16)[:, None] / floats.norm(dim=1).mean()
    legal = torch.rand(16, vocab) < torch.linspace(0.01, 1, 16)[:, None]
    legal[:, 0] = True
    for mask in (None, legal):
        logits = head(x, mask)
        assert (logits != head.approximate(x)[0]).any(1).all(), "no row was recomputed"
        assert torch.equal(logits, reference(x, mask))
    assert torch.equal(head.rows(ids[0]), floats[ids[0]])
    assert torch.equal(head.dequantized(), floats)
    if kind == "Q8_0":
        assert isinstance(kernels.Q8Head(floats).table, kernels.BlockRows)  # Q8_0 values: blocks
        other = floats + 1e-3  # not Q8_0 values: kept as float32 rows
        assert torch.equal(kernels.Q8Head(other).rows(ids[0]), other[ids[0]])
    else:  # its screen: the Q8_0 rounding of its values, as a float32 table's would be
        screen = kernels.Q8Head(floats).blocks
        assert torch.equal(head.blocks.dequantized(), screen.dequantized())


def test_speculation_takes_the_narrow_head_and_still_equals_the_baseline(
    tiny_int4_target, tiny_tokenizer, monkeypatch
):
    """A schema run on the int4 target passes narrow and wide positions to the head (so the
    greedy identity tests exercise both), and greedy speculation commits the baseline's tokens."""
    seen = {"narrow": 0, "wide": 0}
    head = llama.CompactLlama.head

    def counting(self, features, masks=None):
        if masks is not None:
            for c in masks.sum(1).tolist():
                seen["narrow" if c <= llama.NARROW * masks.shape[1] else "wide"] += 1
        return head(self, features, masks)

    monkeypatch.setattr(llama.CompactLlama, "head", counting)
    from constrained_spec.decoding.drafters import CompositeDrafter

    gen = Generator(tiny_int4_target, tiny_tokenizer, draft=CompositeDrafter())
    prompt = tiny_tokenizer.encode('{"name": "Alice", "age": 30} yes no yes')
    base = gen.generate(prompt, schema=testing.PERSON, speculative=False, max_new_tokens=40)
    spec = gen.generate(prompt, schema=testing.PERSON, num_draft_tokens=4, max_new_tokens=40)
    assert seen["narrow"] > 0 and seen["wide"] > 0, seen
    assert spec.stats.drafted > 0 and spec.token_ids == base.token_ids


def test_either_lm_head_kernel_gives_the_same_top_logit(tiny_int4_target):
    """The calibration picks the LM head's kernel per machine: the Q8_0 blocks or float32."""
    model = copy.deepcopy(tiny_int4_target)
    torch.manual_seed(0)
    features = torch.randn(8, model.shape.hidden) * 3
    masks = torch.ones(8, model.vocab_size, dtype=torch.bool)
    blocks = model.head(features, masks)
    model.use_head("float")
    assert isinstance(model.lm_head, kernels.DenseLinear)
    dense = model.head(features, masks)
    assert torch.equal(blocks.argmax(1), dense.argmax(1))
    torch.testing.assert_close(blocks.max(1).values, dense.max(1).values)
    model.use_head("q8")
    assert isinstance(model.lm_head, kernels.Q8Head)
    assert torch.equal(model.head(features, masks), blocks)


def test_auto_runs_a_local_checkpoint_in_8_bits(tmp_path, monkeypatch, tiny_target, tiny_tokenizer):
    """weights="auto" on a local checkpoint the compact forward runs: Q8_0 linears wherever the
    4-bit kernels run (the reason said); one it does not run (another activation) stays float,
    and says why."""
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    folder = tmp_path / "tiny"
    tiny_target.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    choice, why = models.auto_weights(str(folder))
    assert choice == "int8" and f"run on this CPU ({models.matmul_kernel()})" in why
    gen = Generator.from_pretrained(str(folder))
    assert gen.weights == "int8" and "run on this CPU" in gen.weights_choice
    config = AutoConfig.from_pretrained(folder)
    config.hidden_act = "relu"
    monkeypatch.setattr(models, "load_config", lambda path: config)
    choice, why = models.auto_weights(str(folder))
    assert choice == "float" and "the 'relu' activation" in why
