"""`constrained-spec cache`: what the cache dir holds (sizes, last use), clearing all of it or an
entry, and the cap on prepared models (CONSTRAINED_SPEC_CACHE_GB: the least recently used go
first, one larger than the cap is not stored, each store says what it wrote)."""

import json
import os

import pytest
import torch

from constrained_spec import cli, testing
from constrained_spec.errors import SettingError
from constrained_spec.model import disk, machine, models, prepared, repack


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(machine.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(prepared.CAP_ENV, raising=False)
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """Two model files, prepared each in 1.3 MB."""
    folder = tmp_path_factory.mktemp("ggufs")
    return [testing.write_gguf(folder / f"m{i}.gguf", "qwen2", "Q4_K", seed=i) for i in (1, 2)]


def _prepare(gguf):
    models.load_model(str(gguf), weights="int4")
    prepared.wait()
    return prepared.path_for(gguf)


def _cache_cli(capsys, *args):
    code = cli.main(["cache", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_listing_names_every_entry_with_its_size(cache, capsys, ggufs, tmp_path, monkeypatch):
    builtin = testing.write_gguf(tmp_path / "tiny.gguf", "llama", {"*": "F32"}, layers=1)
    spec, _ = testing.fake_builtin(monkeypatch, "tiny-test", builtin)
    (cache / "tiny-test").mkdir(parents=True)
    models.verified_gguf(spec, cache / "tiny-test")  # the built-in model's download
    stored = _prepare(ggufs[0])
    machine.remembered("a pass-cost table", lambda: {"ms": 1.0})  # the measurements
    (cache / "kernels" / "Some-CPU-torch-2.0").mkdir(parents=True)
    (cache / "kernels" / "Some-CPU-torch-2.0" / "constrained_spec_fused.so").write_bytes(
        b"x" * 3000
    )
    (cache / "notes.txt").write_text("mine")
    code, out, _ = _cache_cli(capsys)
    assert code == 0
    lines = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert set(lines) == {
        "tiny-test",
        f"prepared/{stored.stem}",
        "kernels/Some-CPU-torch-2.0",
        "measurements",
        "notes.txt",
    }
    assert lines["tiny-test"][1] == "model" and lines["notes.txt"][1] == "other"
    assert lines["kernels/Some-CPU-torch-2.0"][2:4] == ["3.0", "KB"]
    size = stored.stat().st_size + stored.with_suffix(".json").stat().st_size
    assert lines[f"prepared/{stored.stem}"][2:4] == cli._size(size).split()  # KB: no weights
    assert str(ggufs[0]) in out  # what the prepared model prepares
    assert out.splitlines()[0].startswith(f"{cache}: ") and "of 4 GB" in out.splitlines()[0]
    assert {e.name for e in disk.entries()} == set(lines)


def test_clearing_an_entry_a_kind_or_everything(cache, capsys, ggufs):
    first, second = _prepare(ggufs[0]), _prepare(ggufs[1])
    (cache / "kernels" / "cpu").mkdir(parents=True)
    code, out, _ = _cache_cli(capsys, "--clear", f"prepared/{first.stem}")
    assert code == 0 and f"removed prepared/{first.stem}" in out
    assert not first.exists() and not first.with_suffix(".json").exists() and second.exists()
    assert prepared.load(ggufs[1]) is not None  # the other still loads
    assert _cache_cli(capsys, "--clear", "kernels")[0] == 0
    assert not (cache / "kernels" / "cpu").exists() and second.exists()
    code, out, err = _cache_cli(capsys, "--clear", "nothing-such")
    assert code == cli.EXIT_USAGE and "nothing in the cache is named 'nothing-such'" in err
    assert "measurements" in err and second.exists()  # the choices named; nothing removed
    code, out, _ = _cache_cli(capsys, "--clear")
    assert code == 0 and "freed" in out
    assert list(cache.iterdir()) == []
    assert "(empty)" in _cache_cli(capsys)[1]


def test_prepared_models_keep_within_the_cap(cache, capfd, ggufs, monkeypatch):
    """Room for one: the second store removes the first (used least recently); each store says
    how much it wrote; a cap below one model stores nothing, and says how to keep it."""
    first = _prepare(ggufs[0])
    size = first.stat().st_size + first.with_suffix(".json").stat().st_size
    (stored,) = [x for x in capfd.readouterr().err.splitlines() if "Stored" in x]
    assert f"({prepared._mb(size)})" in stored and prepared.CAP_ENV in stored
    monkeypatch.setenv(prepared.CAP_ENV, str(1.5 * size / 1e9))
    second = _prepare(ggufs[1])
    said = capfd.readouterr().err
    assert second.exists() and not first.exists() and not first.with_suffix(".json").exists()
    assert f"Removed the prepared model {first.name}" in said and "Stored" in said
    assert json.loads((second.parent / "index.json").read_text()) == {second.name: str(ggufs[1])}
    monkeypatch.setenv(prepared.CAP_ENV, str(0.5 * size / 1e9))
    _prepare(ggufs[0])
    said = capfd.readouterr().err
    assert "Not storing the prepared model" in said and prepared.CAP_ENV in said
    assert not first.exists() and second.exists()  # nothing removed for a file not stored


def test_a_tied_table_counts_once_against_the_cap(cache, capfd, ggufs, monkeypatch):
    """The tied embedding is in the model's state twice (the embedding, the head's rows) and in
    the file once: a cap between the file's size and that double count still stores it. (The
    converted model's store, where the repack library is missing: laid from the file, no table
    is stored.)"""
    monkeypatch.setattr(repack, "library", lambda: None)
    first = _prepare(ggufs[0])
    state = torch.load(first, mmap=True, weights_only=True)
    assert prepared._stored_bytes(state) <= first.stat().st_size  # at most what the file holds
    model, _ = models.load_model(str(ggufs[0]), weights="int4")
    assert model.lm_head.table.q.data_ptr() == model.embed.q.data_ptr()  # tied: one storage
    table = model.embed.q.nbytes + model.embed.scales.nbytes
    cap = prepared._stored_bytes(state) + table // 2
    assert sum(t.nbytes for t in prepared._tensors(state)) > cap  # each tensor counted: refused
    first.unlink()  # prepared again
    monkeypatch.setenv(prepared.CAP_ENV, str(cap / 1e9))
    assert _prepare(ggufs[0]).exists()
    assert "Stored" in capfd.readouterr().err


def test_the_least_recently_used_goes_first(cache, capfd, ggufs, monkeypatch):
    first, second = _prepare(ggufs[0]), _prepare(ggufs[1])
    os.utime(second, (1, 1))  # long unused; the first was mapped since
    size = first.stat().st_size + first.with_suffix(".json").stat().st_size
    monkeypatch.setenv(prepared.CAP_ENV, str(2.5 * size / 1e9))
    third = testing.write_gguf(ggufs[0].parent / "m3.gguf", "qwen2", "Q4_K", seed=3)
    _prepare(third)
    assert first.exists() and not second.exists() and prepared.path_for(third).exists()


def test_a_bad_cap_is_named(cache, capsys, monkeypatch):
    monkeypatch.setenv(prepared.CAP_ENV, "lots")
    with pytest.raises(SettingError, match=f"{prepared.CAP_ENV}='lots' is not a limit"):
        prepared.cap_bytes()
    code, _, err = _cache_cli(capsys)
    assert code == cli.EXIT_USAGE and prepared.CAP_ENV in err
