"""The kernel library's instruction-set variants (csrc/): how each is compiled, what a CPU must
have to run it, and which one a CPU runs, as ggml's per-variant scores and ATen's DispatchStub
choose: the last variant of its architecture's list whose features the CPU has, the baseline
when none fits (never an illegal instruction).

Standard library only: setup.py loads this file by its path to build the variants when the
package is built (no torch in the build), and compiled.py to choose and load one."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("csrc") / "fused_layers.cpp"
# the library's translation units: the fused layers and kernels, and the GGUF repack (model/repack)
SOURCES = (SOURCE, SOURCE.with_name("repack.cpp"))
HEADERS = [SOURCE.with_name(name) for name in ("abi.h", "blocks.h", "parallel.h", "vec.h")]
LIBRARIES = Path(__file__).with_name("libs")  # where the build puts the variants
PREFIX = "libcskernels-"


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]  # the compiler's target flags
    needs: frozenset[str]  # CPU features, by Linux's /proc/cpuinfo names (cleared where the OS
    # does not enable their state: AVX-512's registers, AMX's tiles)


# x86-64 psABI levels: what -march=x86-64-v2/v3/v4 let the compiler use anywhere in the library
_V2 = {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"}
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_BF16 = _V4 | {"avx512_bf16", "avx512_vnni"}
_BF16_FLAGS = ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni")

# Per architecture, in order of preference (the last that fits runs). What each runs: the
# baseline ATen's generic vectors and blocks.h's scalar reference; x86-64-v3 AVX2 vectors and
# blocks.h's AVX2 kernels; x86-64-v4 AVX-512 vectors; -bf16 our int4_mm and dense_mm (AVX-512
# BF16); -amx the same on AMX tiles; armv8.2-a+dotprod blocks.h's NEON kernels.
VARIANTS = {
    "x86_64": (
        Variant("x86-64", ("-march=x86-64",), frozenset()),
        Variant("x86-64-v3", ("-march=x86-64-v3",), frozenset(_V3)),
        Variant("x86-64-v4", ("-march=x86-64-v4",), frozenset(_V4)),
        Variant("x86-64-v4-bf16", _BF16_FLAGS, frozenset(_BF16)),
        Variant(
            "x86-64-v4-amx",
            (*_BF16_FLAGS, "-mamx-tile", "-mamx-bf16"),
            frozenset(_BF16 | {"amx_tile", "amx_bf16"}),
        ),
    ),
    "aarch64": (
        Variant("armv8-a", ("-march=armv8-a",), frozenset()),
        Variant(
            "armv8.2-a-dotprod",
            ("-march=armv8.2-a+dotprod",),
            frozenset({"asimddp", "asimdrdm", "atomics"}),
        ),
    ),
}
NATIVE = Variant("native", ("-march=native",), frozenset())  # this CPU's, built on demand


def architecture(machine: str | None = None) -> str:
    """This machine's architecture as VARIANTS names it ("x86_64", "aarch64"), else its own name."""
    machine = (machine or platform.machine()).lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def variants(arch: str | None = None) -> tuple[Variant, ...]:
    return VARIANTS.get(architecture(arch), ())


def choose(arch: str, features: frozenset[str], built: set[str]) -> Variant | None:
    """The best variant of ``arch`` that a CPU with ``features`` runs, among those ``built``:
    the last in VARIANTS' order whose needs it has; None where none is built."""
    fits = [v for v in VARIANTS.get(arch, ()) if v.needs <= features and v.name in built]
    return fits[-1] if fits else None


# --- the CPU's features ---------------------------------------------------------------------------

# macOS's sysctl names for the features VARIANTS reads (Intel: machdep.cpu.*, their upper-case
# names; Apple silicon: hw.optional.arm.FEAT_*)
_MACOS = {
    "SSE3": "pni", "SSSE3": "ssse3", "SSE4.1": "sse4_1", "SSE4.2": "sse4_2", "POPCNT": "popcnt",
    "CX16": "cx16", "LAHF": "lahf_lm", "AVX1.0": "avx", "AVX2": "avx2", "BMI1": "bmi1",
    "BMI2": "bmi2", "F16C": "f16c", "FMA": "fma", "LZCNT": "abm", "MOVBE": "movbe",
    "XSAVE": "xsave", "AVX512F": "avx512f", "AVX512BW": "avx512bw", "AVX512CD": "avx512cd",
    "AVX512DQ": "avx512dq", "AVX512VL": "avx512vl", "AVX512VNNI": "avx512_vnni",
    "FEAT_DotProd": "asimddp", "FEAT_RDM": "asimdrdm", "FEAT_LSE": "atomics",
}  # fmt: skip


def cpu_features() -> frozenset[str]:
    """This CPU's features as Linux names them: /proc/cpuinfo's flags (x86) or Features (ARM),
    macOS's sysctl; none elsewhere (the baseline runs)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = None
    if text is not None:
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
        return frozenset()
    if platform.system() == "Darwin":
        return _sysctl_features()
    return frozenset()


def _sysctl_features() -> frozenset[str]:
    names = ["machdep.cpu.features", "machdep.cpu.leaf7_features", "machdep.cpu.extfeatures"]
    names += [f"hw.optional.arm.{k}" for k in _MACOS if k.startswith("FEAT_")]
    found = set()
    for name in names:  # one at a time: sysctl stops at the first name a machine lacks
        try:
            done = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return frozenset()
        value = done.stdout.strip()
        if name.startswith("hw.optional."):
            found |= {_MACOS[name.rsplit(".", 1)[1]]} if value == "1" else set()
        else:
            found |= {_MACOS[word] for word in value.split() if word in _MACOS}
    return frozenset(found)


# --- building ---------------------------------------------------------------------------------------


def library_name(variant: str) -> str:
    return f"{PREFIX}{variant}{'.dll' if os.name == 'nt' else '.so'}"


def compiler() -> str | None:
    """The C++ compiler: $CXX, else the first of c++, g++, clang++ on PATH."""
    if os.environ.get("CXX"):
        return os.environ["CXX"]
    return next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)


def command(
    cxx: str, variant: Variant, output: Path, openmp: bool = True, sources=SOURCES
) -> list[str]:
    """The one compile-and-link command of a variant. -ffp-contract is GCC's default spelled
        out (clang's differs), so that every compiler fuses the same multiply-adds the torch build
        did (repack.cpp asks for none in its own pragmas: its results are the same bits on any CPU);
    hidden symbols but the ABI's (two variants loaded in one process share nothing)."""
    return [
        cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=fast",
        "-fvisibility=hidden", "-fvisibility-inlines-hidden", *variant.flags,
        f'-DCS_VARIANT="{variant.name}"', *(["-fopenmp"] if openmp else []),
        *map(str, sources), "-o", str(output),
    ]  # fmt: skip


def stamp(cxx: str, variant: Variant) -> str:
    """What a variant's library is built from: the sources, the compiler and its command."""
    sources = b"".join(p.read_bytes() for p in [*SOURCES, *HEADERS])
    line = " ".join(command(cxx, variant, Path("out")))
    return hashlib.sha256(sources + line.encode()).hexdigest()


def build(variant: Variant, output: Path, cxx: str | None = None, sources=SOURCES) -> str | None:
    """Compile ``variant`` into ``output``: None, or the compiler's first error in one line.
    Where the error names OpenMP (Apple's clang has none) it is built again without: its
    threads are then std::threads (csrc/parallel.h)."""
    cxx = cxx or compiler()
    if cxx is None:
        return "no C++ compiler found (set CXX, or install g++ or clang++)"
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.{os.getpid()}")  # renamed once whole
    why = None
    for openmp in (True, False):
        try:
            done = subprocess.run(
                command(cxx, variant, partial, openmp, sources),
                capture_output=True,
                text=True,
                timeout=600,
            )
        except (OSError, subprocess.SubprocessError) as err:
            return f"{type(err).__name__}: {err}"
        if done.returncode == 0:
            os.replace(partial, output)
            return None
        why = first_error(done.stdout + done.stderr)
        if not (openmp and re.search(r"openmp|omp\.h|-lgomp|-fopenmp", why, re.IGNORECASE)):
            break
    partial.unlink(missing_ok=True)
    return why


def first_error(output: str) -> str:
    """One line of a compiler's output: its first error where it has one."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\berror\b", line, re.IGNORECASE)]
    return (errors or lines or ["the compiler failed and said nothing"])[0][:300]
