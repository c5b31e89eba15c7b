"""Running a GGUF from the file (model/repack, csrc/repack.cpp; model/gguf_header): the repack
lays every tensor type into every kernel's layout bit for bit as the torch path does, a whole
model laid from the file computes the converted model's logits bit for bit, the file's header
reads as gguf's GGUFReader reads it, and a later load reads neither the file's metadata nor
transformers, and stores no weights."""

import json
import subprocess
import sys
import types as namespaces
from collections import Counter

import gguf
import numpy as np
import pytest
import torch

from constrained_spec import testing
from constrained_spec.errors import WeightsError
from constrained_spec.model import files, gguf_header, kernels, models, prepared, repack

pytestmark = pytest.mark.skipif(repack.library() is None, reason="the repack does not build here")

KINDS = list(files.LINEAR_TYPES)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits, for equality that NaNs and signed zeros cannot fool."""
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _tensor(kind: str, raw: np.ndarray):
    return namespaces.SimpleNamespace(tensor_type=gguf.GGMLQuantizationType[kind], data=raw)


def _rows(parts) -> repack.Rows:
    stacked = None
    for kind, raw, order in parts:
        raw = raw.view(np.uint8).reshape(raw.shape[0], -1)  # F16, F32 rows: their bytes
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        rows = repack.Rows.of(
            raw, gguf.GGMLQuantizationType[kind].value, raw.shape[1] // size * block, order
        )
        stacked = rows if stacked is None else stacked + rows
    return stacked


def _torch_path(parts, copies: int) -> kernels.Int4Linear:
    """files._blocks of each part (rows in its order), stacked: the torch path's linear."""
    decoded = []
    for kind, raw, order in parts:
        q, scale, zero = files._blocks(_tensor(kind, raw), copies)
        index = slice(None) if order is None else torch.from_numpy(order)
        decoded.append((q[index], scale[index], zero[index]))
    q, scale, zero = (torch.cat(x) for x in zip(*decoded))
    return kernels.Int4Linear(q, scale, zero, copies=copies)


def _layouts(linear: kernels.Int4Linear):
    """The torch path's tiles of our kernels and of csrc/blocks.h (as use_kernel lays them,
    whichever kernel this CPU runs)."""
    nibbles, (scale, zero), copies = linear.stored_nibbles(), linear.scale_and_zero(), linear.copies
    q = kernels._unpaired(nibbles)
    form = kernels._blocks_form(nibbles, zero, copies)
    return kernels._tile_pack(q, scale, zero), kernels._blocks_pack(q, scale, zero, copies, *form)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("beside", [None, *KINDS])
def test_every_type_lays_into_every_layout_as_the_torch_path_does(kind, beside):
    """A tensor of ``kind`` (rows reversed: any row order), alone and stacked with one of
    ``beside``: our kernels' tiles and scales, blocks.h's (its 4-, 5- or 8-bit form), the
    prompts' bf16 copy (plain and in AMX tiles) and the dequantized weights, bit for bit."""
    rng = np.random.default_rng(KINDS.index(kind) * 100 + (KINDS.index(beside) if beside else 99))
    combo = [kind] if beside is None else [kind, beside]
    parts = [(k, testing.gguf_blocks(k, 32, 512, rng), None) for k in combo]
    parts[0] = (*parts[0][:2], np.arange(31, -1, -1))
    copies = 1 if all(files.AFFINE_BITS.get(k) == 4 for k in combo) else 2
    rows, linear = _rows(parts), _torch_path(parts, copies)
    (tiles, tile_scales), (blocks, block_scales) = _layouts(linear)
    assert all(map(_equal, repack.tiles(rows, copies), (tiles, tile_scales)))
    assert all(map(_equal, repack.blocks(rows, copies), (blocks, block_scales)))
    dense = linear.dequantized_bf16()
    n, k = dense.shape
    amx = (
        dense.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(n // 16, -1, 16, 32)
    )
    assert _equal(repack.dense(rows, copies, tiled=False), dense)
    assert _equal(repack.dense(rows, copies, tiled=True), amx.contiguous())
    assert _equal(repack.dequantized(rows, copies), linear.dequantized())


def test_blocks_take_the_form_the_values_ask_for():
    """blocks.h's form follows the values, not only the types: Q8_0 rows whose bytes all lie
    below −96 (their high halves 0 or 1) lay as 5-bit tiles; affine rows of scale 0 beside Q8_0
    ones drop the high zeros; each as _blocks_form decides on the torch path's nibbles."""
    rng = np.random.default_rng(5)
    low = testing.gguf_blocks("Q8_0", 16, 256, rng).reshape(16, -1, 34)
    low[..., 2:] = rng.integers(-127, -96, low[..., 2:].shape).astype(np.int8).view(np.uint8)
    zero_scales = testing.gguf_blocks("Q4_0", 16, 256, rng).reshape(16, -1, 18)
    zero_scales[..., :2] = 0
    cases = {
        (5, True): [("Q8_0", low.reshape(16, -1), None)],
        (8, False): [("Q8_0", testing.gguf_blocks("Q8_0", 16, 256, rng), None)]
        + [("Q4_0", zero_scales.reshape(16, -1), None)],
        (8, True): [
            ("Q8_0", testing.gguf_blocks("Q8_0", 16, 256, rng), None),
            ("Q5_1", testing.gguf_blocks("Q5_1", 16, 256, rng), None),
        ],
    }
    for form, parts in cases.items():
        linear = _torch_path(parts, 2)
        assert kernels._blocks_form(linear.stored_nibbles(), linear.scale_and_zero()[1], 2) == form
        assert all(map(_equal, repack.blocks(_rows(parts), 2), _layouts(linear)[1]))


def test_re_quantizing_rounds_ties_to_even_as_quantize_q8_0():
    """Float rows whose values lie exactly halfway between two multiples of their group's
    scale (and zero groups, and a group of one value): kernels.quantize_q8_0's q and d."""
    rng = np.random.default_rng(7)
    d = rng.uniform(1e-3, 1e-1, (16, 8)).astype(np.float16).astype(np.float32)
    q = rng.integers(-126, 127, (16, 8, 32)).astype(np.float32)
    q[..., 0] = 127
    w = (q + rng.choice([-0.5, 0.0, 0.5], q.shape).astype(np.float32)) * d[..., None]
    w[3] = 0
    w[4, :, 1:] = 0
    w = w.reshape(16, 256).astype(np.float32)
    ours = repack.q8_0_quantized(repack.Rows.of(w.view(np.uint8).reshape(16, -1), 0, 256))
    theirs = kernels.quantize_q8_0(torch.from_numpy(w))
    assert all(map(_equal, ours, theirs))


@pytest.mark.parametrize("kind", [*KINDS, "Q6_K"])
def test_rows_read_as_gguf_dequantizes_them(kind):
    """Every type's float32 values as gguf's dequantization gives them; Q8_0 and Q6_K rows as
    kernels.BlockRows splits their blocks."""
    rng = np.random.default_rng(11)
    if kind in ("F16", "F32", "BF16"):
        w = (rng.standard_normal((16, 256)) * 0.05).astype(np.float32)
        raw = (
            gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind]).view(np.uint8).reshape(16, -1)
        )
    else:
        raw = testing.gguf_blocks(kind, 16, 256, rng)
    rows = _rows([(kind, raw, None)])
    exact = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(16, 256)
    assert _equal(repack.float_rows(rows), torch.from_numpy(exact.astype(np.float32)))
    if kind == "Q8_0":
        q, d = kernels.split_q8_0(torch.from_numpy(raw))
        assert all(map(_equal, repack.q8_0_rows(rows), (q, d.to(torch.float16))))
    if kind == "Q6_K":
        assert all(map(_equal, repack.q6_k_rows(rows), kernels.split_q6_k(torch.from_numpy(raw))))


# --- whole models ------------------------------------------------------------------------------

FAMILIES = [
    ("llama", {"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q5_0", "token_embd": "Q8_0"}, False),
    ("qwen2", {"*": "Q4_0", "attn_v": "Q8_0", "token_embd": "Q6_K"}, True),
    ("qwen3", {"*": "Q5_K", "token_embd": "Q4_K"}, False),
    ("gemma3", {"*": "Q4_1", "ffn_up": "F16", "token_embd": "Q8_0"}, True),
    ("phi3", {"*": "Q5_1", "attn_qkv": "BF16", "token_embd": "F32"}, True),
]


@pytest.mark.parametrize("arch, types, tied", FAMILIES)
def test_a_model_laid_from_the_file_is_the_converted_model(arch, types, tied, tmp_path):
    """Each family's file (llama's permuted q/k rows, phi3's partial rotary order and fused
    tensors, mixed types, tied and untied heads of every table type) laid from the file in this
    CPU's kernel: the converted model's tiles, scales, prompts' copy, head terms, tables and
    logits, bit for bit."""
    partial = {"phi3.rope.dimension_count": 48} if arch == "phi3" else {}  # of 64: qkv_row_order
    path = testing.write_gguf(tmp_path / f"{arch}.gguf", arch, types, tied=tied, metadata=partial)
    config = models.load_config(path)
    converted = files.from_gguf(path, config)
    models.use_kernels(converted)
    if converted.matmul == "torch":
        pytest.skip("none of our 4-bit kernels runs here")
    laid = files.from_gguf(path, config, converted.matmul)
    models.use_kernels(laid)
    assert laid.tensor_types == converted.tensor_types
    for ours, theirs in zip(laid.linears, converted.linears):
        assert ours.source is not None and ours.scale_rows is None  # no per-row copies held
        assert _equal(ours.packed, theirs.packed) and _equal(ours.scale_zero, theirs.scale_zero)
        assert (ours.dense is None) == (theirs.dense is None)
        assert ours.dense is None or _equal(ours.dense, theirs.dense)
    head, theirs = laid.lm_head, converted.lm_head
    assert _equal(head.terms, theirs.terms) and _equal(head.blocks.packed, theirs.blocks.packed)
    assert type(head.table) is type(theirs.table) and (head.table is laid.embed) == tied
    assert _equal(
        laid.embed(torch.arange(laid.vocab_size)), converted.embed(torch.arange(laid.vocab_size))
    )
    ids = torch.tensor([3, 17, 42, 99, 7, 7, 120])
    assert _equal(laid(ids, laid.new_cache())[0], converted(ids, converted.new_cache())[0])


# --- the header --------------------------------------------------------------------------------


def _same_as_gguf_reader(path) -> None:
    ours, theirs = gguf_header.GGUFHeader(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert (
            ours.fields[key].types == field.types
            and ours.fields[key].contents() == field.contents()
        ), key
    assert (ours.alignment, ours.data_offset) == (theirs.alignment, theirs.data_offset)
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.n_bytes, a.data_offset) == (
            b.name,
            b.tensor_type,
            b.n_bytes,
            b.data_offset,
        )
        assert np.array_equal(a.shape, b.shape) and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, b.data), a.name
    restored = gguf_header.GGUFHeader(path, json.loads(json.dumps(ours.state())))
    assert [t.name for t in restored.tensors] == [t.name for t in ours.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(restored.tensors, ours.tensors))
    scalars = [k for k, f in ours.fields.items() if len(f.types) == 1]
    assert {k: restored.value(k) for k in scalars} == {k: ours.value(k) for k in scalars}


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_the_header_reads_as_gguf_reader_reads_it(arch, tmp_path):
    """Every field's contents and types, every tensor's name, type, shape, bytes and offset as
    GGUFReader has them (files of three families, an SPM vocabulary); its stored state gives
    back the scalars and the tensors without reading the metadata."""
    vocabulary = "spm" if arch == "gemma3" else "bpe"
    path = testing.write_gguf(
        tmp_path / "h.gguf", arch, {"*": "Q4_K", "attn_v": "F16"}, vocabulary=vocabulary
    )
    _same_as_gguf_reader(path)


@pytest.mark.real_model
def test_the_header_of_the_built_in_model_reads_as_gguf_reader_reads_it():
    _same_as_gguf_reader(models.builtin_gguf(models.DEFAULT_MODEL))


def test_a_truncated_file_names_the_tensor_it_cuts(tmp_path):
    path = testing.write_gguf(tmp_path / "cut.gguf", "llama", "Q4_0")
    last = gguf.GGUFReader(str(path)).tensors[-1]
    path.write_bytes(path.read_bytes()[: last.data_offset + 10])
    with pytest.raises(WeightsError, match=rf"cut.gguf: .*tensor {last.name}.*truncated"):
        models.load_model(str(path), weights="int4")


# --- loads ------------------------------------------------------------------------------------


def test_a_load_runs_from_the_file_and_stores_no_weights(tmp_path):
    """A GGUF's first load lays the file (no weights stored: the prepared entry holds the
    header, tokenizer, config and head terms, a small share of the file); a second process
    loads it again reading neither the file's metadata nor importing transformers, and computes
    the same logits."""
    path = testing.write_gguf(tmp_path / "m.gguf", "qwen2", {"*": "Q4_K", "attn_v": "Q6_K"}, seed=2)
    model, tokenizer = models.load_model(str(path), weights="int4")
    prepared.wait()
    if not all(m.source is not None for m in model.linears):
        pytest.skip("none of our 4-bit kernels runs here: the converted path")
    stored = prepared.path_for(path)
    assert stored.stat().st_size + stored.with_suffix(".json").stat().st_size < path.stat().st_size
    state = torch.load(stored, weights_only=True)
    assert set(state) == {"layout", "terms"}  # no weights
    ids = tokenizer.encode("hello there")
    logits = model(torch.tensor(ids), model.new_cache())[0]
    code = (
        "import sys, json, torch\n"
        "from constrained_spec.model import gguf_header, models\n"
        "def explode(*a, **k): raise AssertionError('the metadata was read again')\n"
        "gguf_header.GGUFHeader._read = explode\n"
        f"model, tokenizer = models.load_model({str(path)!r}, weights='int4')\n"
        f"logits = model(torch.tensor({ids!r}), model.new_cache())[0]\n"
        "print(json.dumps([sorted(sys.modules), logits.tolist()]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    modules, again = json.loads(out.stdout.splitlines()[-1])
    assert "transformers" not in modules
    assert torch.equal(torch.tensor(again), logits)


def test_the_converted_path_still_stores_the_weights_where_the_repack_is_missing(
    tmp_path, monkeypatch
):
    """Without the repack library (no compiler) a GGUF converts with torch ops and stores the
    whole prepared model, which a later load maps: the laid model's logits either way."""
    path = testing.write_gguf(tmp_path / "m.gguf", "llama", "Q4_K", seed=4)
    laid, tokenizer = models.load_model(str(path), weights="int4")
    prepared.wait()
    ids = torch.tensor(tokenizer.encode("hello there"))
    prepared._remove(prepared.path_for(path))
    monkeypatch.setattr(repack, "library", lambda: None)
    converted, _ = models.load_model(str(path), weights="int4")
    prepared.wait()
    assert all(m.source is None for m in converted.linears)
    assert prepared.load(path).model is not None  # stored whole
    mapped, _ = models.load_model(str(path), weights="int4")
    for model in (converted, mapped):
        assert torch.equal(model(ids, model.new_cache())[0], laid(ids, laid.new_cache())[0])


def test_a_load_drops_the_file_pages_it_laid(tmp_path):
    """After a load, the file's pages are no longer resident in the process (its laid copy
    is): madvise gave them back, tensor by tensor."""
    path = testing.write_gguf(tmp_path / "m.gguf", "llama", "Q8_0", hidden=512, ffn=1024, layers=4)
    model, _ = models.load_model(str(path), weights="int4")
    if not all(m.source is not None for m in model.linears):
        pytest.skip("none of our 4-bit kernels runs here: the converted path")
    reader = files.read_gguf(path)
    if not hasattr(reader._map, "madvise"):
        pytest.skip("no madvise here")
    mapped = _resident_kb(path)
    assert mapped < path.stat().st_size / 1024 / 4, f"{mapped} kB of the file still resident"


def _resident_kb(path) -> int:
    """The resident kB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_stacked_rows_follow_the_torch_paths_order(tmp_path):
    """files._linear laid from the rows (llama's q and k un-permuted, stacked with v) and through
    the torch path: the same tiles."""
    path = testing.write_gguf(tmp_path / "m.gguf", "llama", {"*": "Q4_K", "attn_v": "Q8_0"})
    tensors = {t.name: t for t in files.read_gguf(path).tensors}
    parts = [(tensors[f"blk.0.attn_{x}.weight"], h) for x, h in (("q", 4), ("k", 2), ("v", None))]
    torch_path = files._linear(parts, Counter())
    torch_path.use_kernel("avx512-bf16") if not kernels.int4_kernel_missing("avx512-bf16") else None
    kernel = torch_path.kernel if torch_path.kernel != "torch" else None
    if kernel is None:
        pytest.skip("our AVX-512 BF16 kernel does not run here")
    laid = files._linear(parts, Counter(), None, kernel)
    assert _equal(laid.packed, torch_path.packed) and _equal(laid.scale_zero, torch_path.scale_zero)


def _lay_in_child(raw: np.ndarray) -> int:
    packed, _ = repack.tiles(repack.Rows.of(raw, 2, 256), 1)
    return int(packed.shape[0])


@pytest.mark.skipif(sys.platform != "linux", reason="fork: Linux")
def test_a_forked_process_lays_on_threads_of_its_own(monkeypatch):
    """A process that laid rows on its thread pool forks: the child lays rows too (the pool it
    would inherit has no threads in it; one that waited on them would hang)."""
    import multiprocessing

    raw = testing.gguf_blocks("Q4_0", 2048, 256, np.random.default_rng(3))  # ranges: the pool
    monkeypatch.setattr(repack, "_threads", lambda: 2)  # a pool of two (conftest: one thread)
    repack._pool_of.cache_clear()
    assert len(repack._ranges(2048, 16)) > 1
    assert _lay_in_child(raw) == 128  # the parent's pool, its threads started
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply_async(_lay_in_child, (raw,)).get(timeout=60) == 128
    repack._pool_of.cache_clear()
