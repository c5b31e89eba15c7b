"""The kernel library (csrc/, compiled.py, isa.py): the variant a CPU runs, chosen from its
features (a table of flag sets); the override and its error; no AVX-512 register in a library
built for less (the SIGILL trap); a failed native build said once and remembered; and every
variant this CPU runs, loaded in turn, against the references: blocks.h's scalar kernels bit for
bit, the fused layers against the Python layers, a verify pass and a batch row against steps and
a row alone, the threads' split changing no bit, a build without OpenMP (std::threads) computing
what OpenMP's does."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from constrained_spec import testing
from constrained_spec.errors import SettingError
from constrained_spec.model import compiled, isa, kernels, llama, models

V3 = isa.VARIANTS["x86_64"][1].needs
V4 = isa.VARIANTS["x86_64"][2].needs
BF16 = V4 | {"avx512_bf16", "avx512_vnni"}
AMX = BF16 | {"amx_tile", "amx_bf16"}
DOTPROD = frozenset({"asimd", "asimddp", "asimdrdm", "atomics"})
X86 = {v.name for v in isa.variants("x86_64")}
ARM = {v.name for v in isa.variants("aarch64")}


@pytest.mark.parametrize(
    "arch, features, built, expected",
    [
        ("x86_64", frozenset(), X86, "x86-64"),
        ("x86_64", frozenset({"sse2", "avx", "avx2", "fma"}), X86, "x86-64"),  # not all of v3
        ("x86_64", V3, X86, "x86-64-v3"),
        ("x86_64", V3 - {"movbe"}, X86, "x86-64"),  # the compiler may use any v3 instruction
        ("x86_64", V4 - {"avx512vl"}, X86, "x86-64-v3"),
        ("x86_64", V4, X86, "x86-64-v4"),
        ("x86_64", V4 | {"avx512_bf16"}, X86, "x86-64-v4"),  # VNNI too
        ("x86_64", BF16, X86, "x86-64-v4-bf16"),
        ("x86_64", AMX, X86, "x86-64-v4-amx"),
        ("x86_64", AMX, X86 - {"x86-64-v4-amx"}, "x86-64-v4-bf16"),  # not built: the next down
        ("x86_64", AMX, {"x86-64"}, "x86-64"),
        ("x86_64", AMX, set(), None),
        ("aarch64", frozenset({"asimd"}), ARM, "armv8-a"),
        ("aarch64", DOTPROD, ARM, "armv8.2-a-dotprod"),
        ("aarch64", DOTPROD - {"atomics"}, ARM, "armv8-a"),
        ("riscv64", frozenset(), X86, None),
    ],
)
def test_the_variant_is_the_best_the_cpus_features_run(arch, features, built, expected):
    chosen = isa.choose(arch, features, built)
    assert (chosen.name if chosen else None) == expected
    paths = {name: f"/lib/{name}.so" for name in built}
    choice = compiled.choose("", arch, features, paths)
    assert choice.variant == (expected or "none") and choice.path == paths.get(expected)


def test_cpuinfo_names_the_features_of_this_cpu():
    """Linux: /proc/cpuinfo's flags; the x86 baseline runs on any x86-64 CPU."""
    features = isa.cpu_features()
    if isa.architecture() == "x86_64" and os.path.exists("/proc/cpuinfo"):
        assert "sse2" in features
        assert isa.choose("x86_64", features, X86) is not None


def test_an_override_runs_that_variant_or_names_the_ones_this_cpu_runs():
    built = {name: f"/lib/{name}.so" for name in X86}
    choice = compiled.choose("x86-64-v3", "x86_64", V4, built)
    assert choice.variant == "x86-64-v3" and "CONSTRAINED_SPEC_KERNELS=x86-64-v3" in choice.how
    assert compiled.choose("native", "x86_64", V4, built).variant == "native"
    with pytest.raises(
        SettingError, match="'x86-64-v4-amx': this CPU lacks amx_bf16, amx_tile"
    ) as e:
        compiled.choose("x86-64-v4-amx", "x86_64", BF16, built)
    assert "This CPU runs x86-64, x86-64-v3, x86-64-v4, x86-64-v4-bf16 (or 'native'" in str(e.value)
    with pytest.raises(SettingError, match="'haswell': not a variant of x86_64"):
        compiled.choose("haswell", "x86_64", V4, built)
    del built["x86-64-v4"]
    with pytest.raises(SettingError, match="not built with this install"):
        compiled.choose("x86-64-v4", "x86_64", V4, built)


def test_a_bad_override_stops_the_load_with_its_error(monkeypatch):
    monkeypatch.setenv(compiled.ENV, "pentium")
    with pytest.raises(SettingError, match="CONSTRAINED_SPEC_KERNELS='pentium'"):
        compiled.load.__wrapped__()


def test_without_a_library_the_layers_run_as_torch_ops_and_say_why_once(monkeypatch, capfd):
    monkeypatch.delenv(compiled.ENV, raising=False)
    monkeypatch.setattr(compiled, "prebuilt", lambda: {})
    monkeypatch.setattr(compiled, "_loaded", compiled._loaded)
    library, why = compiled.load.__wrapped__()
    assert library is None and "no kernel library was built with this install" in why
    said = [line for line in capfd.readouterr().err.splitlines() if "constrained_spec:" in line]
    assert len(said) == 1 and "the layers run as torch ops" in said[0]


# --- the libraries built here ---------------------------------------------------------------------

BUILT = compiled.prebuilt()
RUNS = [
    v.name for v in isa.variants() if v.name in BUILT and v.needs <= isa.cpu_features()
]  # fmt: skip


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump here")
@pytest.mark.parametrize("name", sorted(BUILT))
def test_a_library_built_for_less_than_avx512_holds_no_avx512_register(name):
    """Wider instructions leaking into a narrower variant (an inline header, a global set up at
    load) would kill a process on an older CPU (SIGILL): no zmm register outside the AVX-512
    variants, and no AVX register at all in the x86 baseline."""
    listing = subprocess.run(
        ["objdump", "-d", str(BUILT[name])], capture_output=True, text=True, check=True
    ).stdout
    assert "vdpbf16ps" in listing or "bf16" not in name and "amx" not in name
    if not name.startswith("x86-64-v4"):
        assert not re.search(r"%zmm\d", listing), f"{name} holds AVX-512 registers"
    if name == "x86-64":
        assert not re.search(r"%ymm\d", listing), "the baseline holds AVX registers"


FAKE_COMPILER = """#!/bin/sh
echo run >> "{count}"
echo "fused_layers.cpp:1:10: fatal error: nothing.h: No such file or directory" >&2
exit 1
"""


def test_a_failed_native_build_is_said_once_and_remembered(tmp_path, monkeypatch, capfd):
    """CONSTRAINED_SPEC_KERNELS=native where the compiler fails: one line naming its first
    error, the best prebuilt variant runs, and a later process does not try again."""
    if not RUNS:
        pytest.skip("no prebuilt variant runs here to fall back on")
    count, compiler = tmp_path / "count", tmp_path / "fake-c++"
    compiler.write_text(FAKE_COMPILER.format(count=count))
    compiler.chmod(0o755)
    env = {compiled.ENV: "native", "CXX": str(compiler), "CONSTRAINED_SPEC_CACHE": str(tmp_path)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(compiled, "_loaded", compiled._loaded)
    library, why = compiled.load.__wrapped__()
    assert why is None and library.variant == RUNS[-1] and "nothing.h" in library.how
    said = [line for line in capfd.readouterr().err.splitlines() if "constrained_spec:" in line]
    assert len(said) == 2 and "compiling" in said[0] and "fatal error: nothing.h" in said[1]
    assert count.read_text().count("run") == 1
    code = "from constrained_spec.model import compiled; print(compiled.describe())"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(RUNS[-1]) and "remembered" in done.stdout
    assert count.read_text().count("run") == 1, "a later process compiled again"
    assert len([x for x in done.stderr.splitlines() if "constrained_spec:" in x]) == 1


# --- every variant this CPU runs, against the references -------------------------------------------


@pytest.fixture(params=RUNS)
def variant(request, monkeypatch):
    """The library of one variant this CPU runs, loaded as CONSTRAINED_SPEC_KERNELS would."""
    library = compiled.Kernels(BUILT[request.param], request.param, "a test's")
    monkeypatch.setattr(compiled, "load", lambda: (library, None))
    monkeypatch.setattr(compiled, "_loaded", library)
    return library


def test_each_variant_runs_its_own_kernels(variant):
    name = variant.variant
    assert variant.blocks_isa() == ("scalar" if name in ("x86-64", "armv8-a") else
                                    "neon" if "dotprod" in name else "avx2")  # fmt: skip
    assert variant.avx512_bf16() == ("bf16" in name or "amx" in name)
    assert models.matmul_kernel() != "torch"


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_each_variants_int8_kernels_give_the_scalar_references_bits(variant, bits):
    """blocks.h's kernels against its scalar reference, and against the baseline library's
    (which is that reference), on 1 to 9 rows."""
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(48, 96, generator=g) * 0.1
    linear = {
        4: lambda: kernels.Int4Linear.from_q4_1(*kernels.quantize_q4_1(w)),
        8: lambda: kernels.Int4Linear.from_q8_0(*kernels.quantize_q8_0(w)),
        5: lambda: _five_bit(w),
    }[bits]()
    linear.use_kernel(variant.blocks_isa())
    assert linear.packed.shape[1] * 32 // 96 == bits
    baseline = compiled.Kernels(BUILT[isa.variants()[0].name], "baseline", "a test's")
    for rows in (1, 2, 3, 4, 5, 8, 9):
        for x in (
            torch.randn(rows, 96, generator=g),
            torch.randn(rows, 96, generator=g).bfloat16(),
        ):
            ours = variant.blocks_mm(x, linear.packed, linear.scale_zero)
            assert torch.equal(ours, variant.blocks_mm(x, linear.packed, linear.scale_zero, True))
            assert torch.equal(ours, baseline.blocks_mm(x, linear.packed, linear.scale_zero))


def _five_bit(w):
    """Q5-like weights: q + 16 in two 4-bit halves, each high half 0 or 1 (5-bit tiles)."""
    q, d = kernels.quantize_q8_0(w)
    q = q.clamp(-16, 15)
    return kernels.Int4Linear(
        torch.cat(((q + 16) >> 4, (q + 16) & 15), 1).to(torch.uint8),
        torch.cat((16 * d, d), 1),
        torch.cat((torch.zeros_like(d), 120 * d), 1),  # d·(16·hi + lo − 136) + 120d = d·q
        copies=2,
    )


def test_each_variants_fused_layers_compute_the_python_layers_and_steps_bits(
    variant, tiny_tokenizer
):
    """On the variant's fastest 4-bit kernel: the fused layers against the Python loop (up to
    float rounding), a verify pass and a batch row bit for bit what steps and a row alone give,
    and two threads bit for bit what one gives; the Q8_0 head's top logit float32's."""
    model = llama.from_transformers(testing.tiny_model(tiny_tokenizer, seed=3), "int4")
    model.use_matmul(models.matmul_kernel())
    ids = tiny_tokenizer.encode(" ".join(testing.CORPUS))[:40]
    logits = {}
    for layers in kernels.LAYER_KERNELS:
        model.use_layers(layers)
        cache = model.new_cache()
        logits[layers] = torch.cat([_logits(model, ids[i : i + 8], cache) for i in range(0, 40, 8)])
    fused, python = logits["fused"], logits["python"]
    assert ((fused - python).norm(dim=-1) / python.norm(dim=-1)).max() < 0.01
    model.use_layers("fused")
    cache = model.new_cache()
    steps = torch.cat([_logits(model, [t], cache) for t in ids[:20]])
    cache.crop(12)
    assert torch.equal(_logits(model, ids[12:20], cache), steps[12:20]), "a verify pass"
    other = model.new_cache()
    _logits(model, ids[:5], other)
    rows, _ = model.forward_rows(
        [torch.tensor(ids[20:23]), torch.tensor(ids[5:9])], [cache, other]
    )  # fmt: skip
    assert torch.equal(rows[3:], fused[5:9]) and torch.equal(rows[:3], fused[20:23]), "a batch"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(_logits(model, ids, None), fused), "two threads"
    finally:
        torch.set_num_threads(threads)
    head = model.lm_head
    head.fused = False
    features = model(torch.tensor(ids[:6]), model.new_cache(), logits=False)[1]
    assert torch.equal(fused[:6].argmax(1), head(features).argmax(1))


def test_a_check_inside_the_library_is_a_python_error_naming_it(variant, tiny_tokenizer):
    """The library's checks (TORCH_CHECKs in the torch extension) come back as a status and a
    message, raised by the binding; nothing of the call's output is used."""
    model = llama.from_transformers(testing.tiny_model(tiny_tokenizer, seed=3), "int4")
    model.use_matmul(models.matmul_kernel())
    model.use_layers("fused")
    with pytest.raises(RuntimeError, match="fused_layers: a token id beyond the embedding"):
        model(torch.tensor([model.vocab_size + 5]), model.new_cache())


def _logits(model, ids, cache):
    return model(torch.tensor(ids), model.new_cache() if cache is None else cache)[0]


def test_a_build_without_openmp_computes_what_openmps_does(tmp_path, tiny_tokenizer, monkeypatch):
    """The std::thread pool (compilers without OpenMP: Apple's clang) splits the work as
    OpenMP does and changes no bit: the same variant built both ways, on two threads."""
    name = next((v for v in ("x86-64-v3", "armv8.2-a-dotprod") if v in RUNS), None)
    if name is None or isa.compiler() is None:
        pytest.skip("no compiler, or no AVX2 / dot-product variant runs here")
    chosen = next(v for v in isa.variants() if v.name == name)
    library = tmp_path / isa.library_name("threads")
    command = isa.command(isa.compiler(), chosen, library, openmp=False)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    outputs = {}
    for path in (BUILT[name], library):
        loaded = compiled.Kernels(path, name, "a test's")
        monkeypatch.setattr(compiled, "load", lambda loaded=loaded: (loaded, None))
        monkeypatch.setattr(compiled, "_loaded", loaded)
        model = llama.from_transformers(testing.tiny_model(tiny_tokenizer, seed=3), "int4")
        model.use_matmul(models.matmul_kernel())
        model.use_layers("fused")
        ids = tiny_tokenizer.encode(" ".join(testing.CORPUS))[:40]
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            outputs[loaded.openmp()] = torch.cat(
                [_logits(model, ids, None), *(_logits(model, [t], None) for t in ids[:3])]
            )
        finally:
            torch.set_num_threads(threads)
    assert set(outputs) == {True, False}, "one of them was not the build asked for"
    assert torch.equal(outputs[True], outputs[False])
