"""Instant start: the prepared model file (a load maps it instead of converting), the tokenizer
on `tokenizers` alone, and imports that leave transformers (and torch, for the bare package) out
until needed."""

import base64
import json
import subprocess
import sys
from array import array

import pytest
import torch
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from constrained_spec import Generator, testing
from constrained_spec.constraints import token_vocabulary
from constrained_spec.constraints.vocabulary import (
    _UNICODE_TO_BYTE,
    _byte_level,
    _byte_level_all,
    _sentencepiece,
    _sentencepiece_all,
)
from constrained_spec.model import kernels, models, prepared, repack
from constrained_spec.model.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


@pytest.fixture
def gguf_file(tmp_path):
    return testing.write_gguf(tmp_path / "qwen2.gguf", "qwen2", "Q4_K", seed=3)


@pytest.fixture(params=["laid", "converted"])
def way(request, monkeypatch):
    """How a GGUF loads: "laid" from the file at every load (model/repack: the prepared entry
    holds no weights), or "converted" with torch ops where the repack library is missing (no
    compiler: the prepared entry holds the whole model)."""
    if request.param == "converted":
        monkeypatch.setattr(repack, "library", lambda: None)
    elif repack.library() is None or models.matmul_kernel() == "torch":
        pytest.skip("the repack library or our 4-bit kernels cannot run here")
    return request.param


def _logits(model, ids):
    cache = model.new_cache()
    return model(torch.tensor(ids), cache)[0]


def test_a_prepared_model_maps_to_the_model_it_was_converted_to(gguf_file, way):
    """The first load stores the prepared entry; the second reads no GGUF metadata (the reader
    is made to explode; converted: nor the file at all, mapping the stored model) and computes
    bit for bit the same logits, commits the same greedy tokens and the same kernels."""
    assert not prepared.path_for(gguf_file).exists()
    model, tokenizer = models.load_model(str(gguf_file), weights="int4")
    prepared.wait()  # stored in a thread
    assert prepared.path_for(gguf_file).is_file()
    ids = tokenizer.encode('Give a: {"a": "the same text again"}')
    first = _logits(model, ids)
    first_text = Generator(model, tokenizer).generate(ids, schema=SCHEMA, max_new_tokens=30)

    with pytest.MonkeyPatch.context() as patch:
        from constrained_spec.model import files, gguf_header

        def explode(*args, **kwargs):
            raise AssertionError("the GGUF file was read again")

        patch.setattr(files, "read_gguf", explode)
        patch.setattr(gguf_header.GGUFHeader, "_read", explode)  # its metadata, whoever asks
        if way == "converted":
            patch.setattr(files, "from_gguf", explode)
        mapped, mapped_tokenizer = models.load_model(str(gguf_file), weights="int4")
        assert models.auto_weights(str(gguf_file))[0] in ("int4", "float")
    assert isinstance(mapped_tokenizer, Tokenizer)
    assert models._kernel_choices(mapped) == models._kernel_choices(model)
    for ours, theirs in zip(
        [*mapped.linears, mapped.lm_head.blocks], [*model.linears, model.lm_head.blocks]
    ):
        left_out = ours.kernel != "torch"  # rebuilt from our kernel's tiles when read
        assert (ours.nibbles is None) == (theirs.nibbles is None) == left_out
        assert torch.equal(ours.stored_nibbles(), theirs.stored_nibbles())
        assert torch.equal(ours.dequantized(), theirs.dequantized())
    assert torch.equal(_logits(mapped, ids), first)
    again = Generator(mapped, mapped_tokenizer).generate(ids, schema=SCHEMA, max_new_tokens=30)
    assert again.token_ids == first_text.token_ids


@pytest.mark.parametrize("kind, scales", [("Q8_0", torch.float16), ("Q6_K", torch.float32)])
def test_a_tied_embedding_is_stored_once_as_its_blocks(kind, scales, tmp_path, way):
    """The file's Q8_0 or Q6_K token embedding, tied to the LM head, is held once as its
    blocks (int8 rows and fp16 or float32 scales: kernels.BlockRows), with no float32 (V, d)
    copy; converted, it is stored once that way; laid from the file, no table is stored at
    all. Loaded twice, the models compute bit for bit the first load's logits, their embedding
    and head rows one storage."""
    types = {"*": "Q4_K", "token_embd": kind}
    gguf_file = testing.write_gguf(tmp_path / "qwen2.gguf", "qwen2", types, seed=3)
    model, tokenizer = models.load_model(str(gguf_file), weights="int4")
    prepared.wait()
    assert model.lm_head.table is model.embed  # tied: one table
    vocab, width = model.embed.shape
    state = torch.load(prepared.path_for(gguf_file), mmap=True, weights_only=True)
    tables = [t for t in prepared._tensors(state) if t.shape[0] == vocab and t.dim() == 2]
    if way == "laid":
        assert not [t for t in tables if t.shape[1] > 4], "a table stored beside the file"
    else:
        assert {t.dtype for t in tables} >= {torch.int8, scales}, f"no {kind} blocks stored"
        assert not [t for t in tables if t.dtype == torch.float32 and t.shape[1] == width]
        q = {t.untyped_storage().data_ptr() for t in tables if t.dtype == torch.int8}
        assert len(q) == 1, "the embedding and the head's rows stored twice"
    ids = tokenizer.encode('Give a: {"a": "the same text again"}')
    first = _logits(model, ids)
    for _ in range(2):
        mapped, _ = models.load_model(str(gguf_file), weights="int4")
        embed, table = mapped.embed, mapped.lm_head.table
        assert isinstance(embed, kernels.BlockRows) and embed.q.data_ptr() == table.q.data_ptr()
        assert embed.scales.dtype == scales and embed.scales.data_ptr() == table.scales.data_ptr()
        assert torch.equal(_logits(mapped, ids), first)


def test_a_damaged_prepared_file_is_rebuilt(gguf_file, capsys, way):
    model, tokenizer = models.load_model(str(gguf_file), weights="int4")
    prepared.wait()
    ids = tokenizer.encode("hello there")
    path = prepared.path_for(gguf_file)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    rebuilt, _ = models.load_model(str(gguf_file), weights="int4")
    assert "does not load" in capsys.readouterr().err
    assert torch.equal(_logits(rebuilt, ids), _logits(model, ids))
    prepared.wait()
    assert prepared.load(gguf_file) is not None  # stored again, whole


def test_a_changed_model_file_is_prepared_again_and_the_old_one_removed(gguf_file):
    models.load_model(str(gguf_file), weights="int4")
    prepared.wait()
    old = prepared.path_for(gguf_file)
    testing.write_gguf(gguf_file, "qwen2", "Q4_K", seed=4)  # new weights, same path
    assert prepared.path_for(gguf_file) != old
    models.load_model(str(gguf_file), weights="int4")
    prepared.wait()
    assert prepared.path_for(gguf_file).is_file() and not old.exists()


MESSAGES = [
    [{"role": "user", "content": "Extract: Alice, 30"}],
    [
        {"role": "system", "content": "Answer in JSON. Ünïcödé ✓"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": '{"a": 1}'},
        {"role": "user", "content": "again <|im_end|> with a marker"},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.real_model
def test_the_light_tokenizer_is_transformers_tokenizer(tmp_path):
    """Same ids, text, special and added tokens, token bytes and chat text (tools too) as the
    transformers tokenizer it was taken from: the built-in model's and a GGUF file's."""
    spec = models.BUILTIN_MODELS[models.DEFAULT_MODEL]
    gguf = testing.write_gguf(tmp_path / "t.gguf", "qwen2", "Q4_K")
    for theirs in (
        AutoTokenizer.from_pretrained(models._converted_copy(models.DEFAULT_MODEL, spec)),
        models.load_tokenizer(str(gguf)),
    ):
        ours = Tokenizer.from_state(json.loads(json.dumps(Tokenizer.of(theirs).state())))
        assert len(ours) == len(theirs) and ours.eos_token_id == theirs.eos_token_id
        assert ours.all_special_ids == sorted(theirs.all_special_ids)
        for text in ["", "Alice, 30 ✓ ünï", "<|im_start|>user\nhi<|im_end|>", "  \n\t{}"]:
            for special in (True, False):
                assert ours.encode(text, special) == theirs.encode(text, add_special_tokens=special)
            ids = theirs.encode(text)
            assert ours.decode(ids) == theirs.decode(ids)
        assert token_vocabulary(ours).token_bytes == token_vocabulary(theirs).token_bytes
        for messages in MESSAGES:
            for tools in (None, TOOLS):
                for prompt in (True, False):
                    kwargs = dict(tools=tools, add_generation_prompt=prompt, tokenize=False)
                    assert ours.apply_chat_template(messages, **kwargs) == (
                        theirs.apply_chat_template(messages, **kwargs)
                    )


def test_the_byte_level_alphabet_is_gpt2s():
    """Our alphabet is transformers' (GPT-2's), and a piece's bytes are its characters' bytes
    one by one, or None where one is not in the alphabet."""
    alphabet = {c: b for b, c in bytes_to_unicode().items()}
    assert _UNICODE_TO_BYTE == alphabet
    pieces = ["", "Ġhello", "ĊĊ", "âĢľ", "a b", "é", "\u0100\u0143", "x\u0144", "\x00", "ÿ"]
    pieces += ["".join(chr(c) for c in range(n, n + 40)) for n in range(0, 400, 40)]
    for piece in pieces:
        expected = bytes(alphabet[c] for c in piece) if set(piece) <= set(alphabet) else None
        assert _byte_level(piece) == expected, piece


def _imports(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


def test_importing_the_package_loads_neither_torch_nor_transformers():
    loaded = _imports("import constrained_spec")
    assert "torch" not in loaded and "transformers" not in loaded
    assert "transformers" not in _imports("from constrained_spec import Generator")


@pytest.mark.real_model
def test_a_warm_start_of_the_default_model_never_imports_transformers():
    """The built-in model prepared once, a later process loads it, compiles a schema and
    generates without importing transformers (≈ 0.5 s) or parsing the GGUF's metadata (its
    header is stored; the model runs from the file's blocks, laid at load: where the repack
    library is missing, the converted model is mapped and the file not read at all)."""
    Generator.from_pretrained()  # prepared, if it was not yet
    prepared.wait()
    code = (
        "from constrained_spec import Generator\n"
        "from constrained_spec.model import gguf_header\n"
        "def explode(*a, **k): raise AssertionError('the GGUF metadata was parsed')\n"
        "gguf_header.GGUFHeader._read = explode\n"
        "gen = Generator.from_pretrained()\n"
        f"r = gen.generate('Extract: a', schema={SCHEMA!r}, max_new_tokens=8)\n"
    )
    loaded = _imports(code)
    assert "transformers" not in loaded


@pytest.mark.parametrize("kernel", ["avx512-bf16", "amx-bf16"])
def test_our_kernels_tiles_give_back_the_nibbles(kernel):
    """A prepared file leaves a linear's plain nibbles out where our kernel's tiles hold them:
    rebuilt from the tiles, they are the originals (a two-halves linear and a 4-bit one)."""
    if missing := kernels.int4_kernel_missing(kernel):
        pytest.skip(f"the {kernel} kernel cannot run here: {missing}")
    g = torch.Generator().manual_seed(0)
    for copies, (n, k) in [(1, (48, 96)), (2, (2064, 64))]:  # 2064 rows: more than one slice
        q = torch.randint(0, 16, (n, copies * k), generator=g)
        scale, zero = torch.rand(n, copies * k // 32, generator=g), torch.rand(n, copies * k // 32)
        linear = kernels.Int4Linear(q, scale, zero, copies=copies)
        original = linear.nibbles.clone()
        linear.use_kernel(kernel)
        linear.nibbles = None
        assert torch.equal(linear.stored_nibbles(), original)
        assert torch.equal(linear.dequantized_nibbles(), q.to(torch.uint8))


RUNNABLE_KERNELS = [k for k in kernels.INT4_KERNELS if kernels.int4_kernel_missing(k) is None]


def _held_bytes(value, seen=None) -> int:
    """The bytes of every storage a module's attributes reach (buffers, parameters, lists of
    tensors, submodules), each storage once."""
    seen = {} if seen is None else seen
    if isinstance(value, torch.Tensor):
        seen[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    elif isinstance(value, torch.nn.Module):
        for v in vars(value).values():
            _held_bytes(v, seen)
    elif isinstance(value, (dict, list, tuple)):
        for v in value.values() if isinstance(value, dict) else value:
            _held_bytes(v, seen)
    return sum(seen.values())


@pytest.mark.parametrize("kernel", RUNNABLE_KERNELS)
def test_a_linear_holds_its_weights_in_one_layout_laid_a_slice_at_a_time(kernel, monkeypatch):
    """Once its kernel is chosen a 4-bit linear holds its weights once, what a prepared file
    stores of it: our kernels' tiles alone (the nibbles dropped, rebuilt from the tiles when
    asked), torch's pack beside its nibbles (no inverse). Laid out PACK_ROWS rows at a time, the
    same tensors as laid out whole: a two-halves linear whose high halves are 0 or 1 in every
    slice but the last has 8-bit tiles (the whole weight's form), not 5-bit ones."""
    g = torch.Generator().manual_seed(0)
    n, k = 2 * kernels.PACK_ROWS + 32, 64
    for copies in (1, 2):
        q = torch.randint(0, 16, (n, copies * k), generator=g)
        if copies == 2:
            q[:-16, :k] = torch.randint(0, 2, (n - 16, k), generator=g)  # hi 0 or 1 but at the end
        scale = torch.rand(n, copies * k // 32, generator=g)
        if copies == 2:
            scale[:, : k // 32] = 16 * scale[:, k // 32 :]  # blocks.h's halves: 16s and s
        zero = torch.rand(n, copies * k // 32, generator=g)
        sliced = kernels.Int4Linear(q, scale, zero, copies=copies)
        original = sliced.nibbles.clone()
        sliced.use_kernel(kernel)
        with monkeypatch.context() as patch:
            patch.setattr(kernels, "PACK_ROWS", n)
            whole = kernels.Int4Linear(q, scale, zero, copies=copies)
            whole.use_kernel(kernel)
        assert torch.equal(sliced.packed, whole.packed), (kernel, copies)
        assert torch.equal(sliced.scale_zero, whole.scale_zero), (kernel, copies)
        assert (sliced.nibbles is None) == (kernel != "torch")
        assert _held_bytes(sliced) == prepared._stored_bytes(prepared._state(sliced))
        assert torch.equal(sliced.stored_nibbles(), original)
        for other in RUNNABLE_KERNELS:  # and back: the same weights whatever the way
            sliced.use_kernel(other)
            assert torch.equal(sliced.stored_nibbles(), original)
            assert _held_bytes(sliced) == prepared._stored_bytes(prepared._state(sliced))


def test_a_first_load_holds_what_its_prepared_file_stores(gguf_file, way):
    """A GGUF's first load ends holding its tensors once: no layout left from another kernel,
    no plain nibbles beside our kernel's tiles, no per-row scales beside them (laid from the
    file: its rows where they lie stand in for them). Converted, that is what the prepared file
    stores; laid, the prepared file stores none of it (the head's terms alone)."""
    model, _ = models.load_model(str(gguf_file), weights="int4")
    prepared.wait()
    held = prepared._stored_bytes(prepared._state(model))
    assert _held_bytes(model) == held
    stored = prepared.path_for(gguf_file).stat().st_size
    if way == "laid":
        assert all(m.scale_rows is None and m.offset_rows is None for m in model.linears)
        assert stored < model.lm_head.terms.nbytes + 64 * 1024 < held
    else:
        assert stored >= held


# a vocabulary of the 256 bytes and EOS: compiling over it needs no tokenizer (nor its imports)
_BYTES = (
    "from constrained_spec.constraints import compile_constraint\n"
    "from constrained_spec.constraints.vocabulary import TokenVocabulary\n"
    "vocab = TokenVocabulary(tuple(bytes([b]) for b in range(256)) + (None,), 256)\n"
)


def test_a_regex_or_a_grammar_imports_no_jsonschema():
    """jsonschema (and, with its format extras, rfc3987_syntax building lark parsers for a
    second) is imported on the first schema, not by a regex, a grammar or the CLI's module."""
    code = _BYTES + (
        "import constrained_spec.cli, constrained_spec.generator\n"
        "c = compile_constraint(vocab, 257, regex='(yes|no)')\n"
        "g = compile_constraint(vocab, 257, grammar='root ::= [0-9]+')\n"
        "assert c.accepts('yes') and g.accepts('42') and not c.accepts('maybe')\n"
    )
    loaded = _imports(code)
    assert "constrained_spec.constraints.engine" in loaded  # the subject was compiled
    assert not {"jsonschema", "referencing", "rfc3987_syntax", "lark"} & loaded


def test_a_schema_defers_rfc3987_syntax_until_an_iri_is_checked():
    """A schema imports jsonschema but not rfc3987_syntax (where it is installed); jsonschema's
    "iri" format checker still checks, through the real module, imported on that first call."""
    pytest.importorskip("rfc3987_syntax")
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "email"}}}
    code = _BYTES + (
        "import sys\n"
        f"c = compile_constraint(vocab, 257, schema={schema!r})\n"
        'assert c.accepts(\'{"a":"x@y.z"}\')\n'
        "print('compiled', 'jsonschema' in sys.modules, 'rfc3987_syntax' in sys.modules)\n"
        "import jsonschema\n"
        "check = jsonschema.Draft202012Validator.FORMAT_CHECKER\n"
        "assert check.conforms('http://example.com/ä', 'iri')\n"
        "assert not check.conforms('not an iri', 'iri')\n"
        "import rfc3987_syntax\n"
        "assert hasattr(rfc3987_syntax, 'parse')  # the real module, not the stand-in\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "compiled True False" in out.stdout


@pytest.mark.parametrize("vocabulary", ["bpe", "spm"])
def test_the_stored_tokenizer_form_gives_back_the_same_tokenizer(tmp_path, vocabulary):
    """A BPE tokenizer stored as its pieces and merges' ids (model.tokenizer's fast form),
    read back: the same JSON as transformers' backend, the same ids for a few strings, the same
    bytes per token."""
    gguf = testing.write_gguf(tmp_path / "t.gguf", "gemma3", "Q8_0", vocabulary=vocabulary)
    theirs = models.load_tokenizer(str(gguf))
    state = json.loads(json.dumps(Tokenizer.of(theirs).state()))
    assert "bpe" in state, "the fast form was not taken"
    assert len(state["backend"]) < len(theirs.backend_tokenizer.to_str())
    ours = Tokenizer.from_state(state)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    for text in ["", "the yes no", "  two  spaces\n\t{}", "Zoë 東京 <bos><eos>", "the▁the"]:
        for special in (True, False):
            assert ours.encode(text, special) == theirs.encode(text, add_special_tokens=special)
    assert token_vocabulary(ours).token_bytes == token_vocabulary(theirs).token_bytes


def test_a_damaged_stored_tokenizer_is_rebuilt(gguf_file, capsys):
    """Merges that are not base64, or name ids past the vocabulary: the prepared model is
    rebuilt, said in one line, and tokenizes as before."""
    _, tokenizer = models.load_model(str(gguf_file), weights="int4")
    prepared.wait()
    ids = tokenizer.encode("hello there")
    header = prepared.path_for(gguf_file).with_suffix(".json")
    good = json.loads(header.read_text())
    for merges in ["not base64!", base64.b64encode(array("i", [10**6, 0]).tobytes()).decode()]:
        bad = {**good, "tokenizer": {**good["tokenizer"]}}
        bad["tokenizer"]["bpe"] = {**bad["tokenizer"]["bpe"], "merges": merges}
        header.write_text(json.dumps(bad))
        capsys.readouterr()
        _, again = models.load_model(str(gguf_file), weights="int4")
        lines = [x for x in capsys.readouterr().err.splitlines() if "Stored" not in x]
        assert len(lines) == 1 and "does not load" in lines[0], lines
        assert again.encode("hello there") == ids
        prepared.wait()


def test_a_mapped_head_keeps_the_bound_terms_its_kernel_gives(gguf_file):
    """The stored Q8 head's bound terms are those computed for its kernel (kept, not computed
    again at each load): the same as a head built anew from the same rows for that kernel."""
    models.load_model(str(gguf_file), weights="int4")
    prepared.wait()
    mapped, _ = models.load_model(str(gguf_file), weights="int4")
    head = mapped.lm_head
    assert isinstance(head, kernels.Q8Head) and head.blocks.kernel == mapped.matmul
    fresh = kernels.Q8Head(head.table)
    fresh.use_kernel(mapped.matmul)
    assert torch.equal(head.terms, fresh.terms)
    if mapped.matmul != "torch":  # the terms follow another kernel
        head.use_kernel("torch")
        assert not torch.equal(head.terms, fresh.terms)


def test_the_token_bytes_of_all_pieces_at_once_are_each_ones():
    """_sentencepiece_all and _byte_level_all give each piece's bytes as the one-piece
    functions do: byte-fallback pieces, "<0x" inside a piece, NUL inside one, none at all."""
    pieces = ["▁the", "<0x41>", "<0x0A>", "a<0x41>", "<0x41>b", "<0x", "\x00", "", "▁▁", "東"]
    for some in (pieces, pieces[:6], [], ["<0x41>"]):
        assert _sentencepiece_all(list(some)) == [_sentencepiece(p) for p in some]
    levels = ["Ġhello", "Ā", "a b", "", "ĊĊ", "x\u0144"]
    assert _byte_level_all(levels) == [_byte_level(p) for p in levels]
