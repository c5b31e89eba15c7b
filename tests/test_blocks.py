"""csrc/blocks.h on its own (no torch): each instruction set's kernels against the scalar
reference, bit for bit, natively and, for ARM, cross-compiled and run under qemu; every build
prints the checksum of the same outputs, which must agree across instruction sets."""

import platform
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import gguf
import pytest
import torch

from constrained_spec import testing
from constrained_spec.model import files, isa, kernels

SOURCE = Path(__file__).with_name("csrc") / "blocks_test.cpp"


def build_and_run(tmp_path: Path, compiler: str, flags: list[str], runner: list[str] = ()):
    """(isa, cases, checksum) printed by the test program built with ``compiler`` and ``flags``."""
    binary = tmp_path / f"blocks-{len(list(tmp_path.iterdir()))}"
    subprocess.run(
        [compiler, "-O2", "-std=c++17", *flags, str(SOURCE), "-o", str(binary)], check=True
    )
    done = subprocess.run([*runner, str(binary)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    isa, cases, checksum = done.stdout.split()
    return isa, int(cases), checksum


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no g++ here")
    tmp = tmp_path_factory.mktemp("native")
    return build_and_run(tmp, "g++", ["-march=native"]), build_and_run(tmp, "g++", [])


def test_this_cpus_kernels_match_the_scalar_reference(native):
    (isa, cases, checksum), (plain_isa, _, plain_checksum) = native
    assert cases == 216, "not every case ran"
    if platform.machine() in ("x86_64", "AMD64"):
        avx2 = (
            "avx2" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
        )
        assert isa == ("avx2" if avx2 else "scalar")
        assert plain_isa == "scalar", "a build for any x86-64 must not need AVX2"
    assert checksum == plain_checksum, "the vector kernels and the scalar build disagree"


ARM = ("aarch64-linux-gnu-g++", "qemu-aarch64")


@pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in ARM),
    reason="no ARM cross-compiler or qemu here (Debian: g++-aarch64-linux-gnu, qemu-user)",
)
def test_arm_kernels_match_the_reference_and_x86_under_qemu(native, tmp_path):
    """NEON with dot products (ARMv8.2) and a plain ARMv8 build (the scalar reference): the same
    outputs as each other and as this machine's build, bit for bit."""
    compiler, qemu = ARM
    dotprod = build_and_run(tmp_path, compiler, ["-march=armv8.2-a+dotprod", "-static"], [qemu])
    plain = build_and_run(tmp_path, compiler, ["-march=armv8-a", "-static"], [qemu])
    assert dotprod[0] == "neon" and plain[0] == "scalar"
    assert dotprod[1] == plain[1] == 216
    assert dotprod[2] == plain[2] == native[0][2], "ARM and x86 computed different outputs"


ARM_VARIANTS = [pytest.param(v, id=v.name) for v in isa.variants("aarch64")]


@pytest.mark.parametrize("variant", ARM_VARIANTS)
def test_the_arm_variants_of_the_kernel_library_compile(variant, tmp_path):
    """The kernel library as the package build compiles it for ARM (NEON dot products in
    blocks.h; a build without OpenMP, as Apple's clang makes, with std::threads): every
    instruction set's code must stay valid where no test can run it."""
    compiler = ARM[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no {compiler} here (Debian: g++-aarch64-linux-gnu)")
    for openmp, check in ((True, []), (False, ["-fsyntax-only"])):  # (a full build takes 10 s)
        command = isa.command(compiler, variant, tmp_path / "lib.so", openmp) + check
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]


# --- every GGUF tensor type on our int8-activation kernels -----------------------------------------

BLOCK_KERNELS = [
    pytest.param(k, marks=pytest.mark.skipif(bool(why), reason=f"{k}: {why}"))
    for k in kernels.BLOCK_KERNELS
    for why in [kernels.int4_kernel_missing(k)]
]
BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5}  # else 8


@pytest.mark.parametrize("kind", files.LINEAR_TYPES)
@pytest.mark.parametrize("kernel", BLOCK_KERNELS)
def test_every_tensor_type_runs_on_the_int8_kernels_at_about_its_own_bytes(kind, kernel, tmp_path):
    """A linear of each type laid out for blocks.h: 4-bit types in 4-bit tiles, 5-bit ones in
    5-bit tiles (not two 4-bit halves), the rest in 8-bit ones; the weights exactly the ones the
    other kernels multiply (nibbles and scales read back unchanged), about the file's bytes per
    weight, and x·Wᵀ within the kernel's roundings: x to bf16 then int8 groups (done in the
    reference too), float32 sums, the output to bf16."""
    path = testing.write_gguf(tmp_path / "m.gguf", types=kind, layers=1)
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_up.weight")
    linear = files._linear([(tensor, None)], Counter())
    nibbles, scale_zero = linear.stored_nibbles().clone(), linear.scale_and_zero()
    scale, zero = (t.float().repeat_interleave(kernels.GROUP, 1) for t in scale_zero)
    w = (linear.dequantized_nibbles().float() - 8) * scale + zero  # what every kernel multiplies
    w = sum(w.chunk(linear.copies, dim=1))  # (N, K): the halves summed
    linear.use_kernel(kernel)
    n, k = w.shape
    assert linear.packed.shape[1] * kernels.GROUP // k == BITS.get(kind, 8)
    file_bytes = 34 / 32 if kind in files.REQUANTIZED else tensor.n_bytes / (n * k)  # Q8_0's
    ours = (linear.packed.nbytes + linear.scale_zero.nbytes) / (n * k)
    assert ours <= max(1.3 * file_bytes, 0.65), (
        f"{ours:.3f} bytes a weight, the file {file_bytes:.3f}"
    )
    linear.nibbles = None  # read back from the tiles
    assert torch.equal(linear.stored_nibbles(), nibbles)
    assert all(torch.equal(a, b) for a, b in zip(linear.scale_and_zero(), scale_zero))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0)).bfloat16().float()
    q, d = kernels.quantize_int8(x)
    reference = (q.float().view(5, -1, kernels.GROUP) * d[..., None]).view(x.shape) @ w.T
    error = (linear(x) - reference).abs()
    bound = 2.0**-8 * reference.abs() + 1e-5 * (x.abs() @ w.abs().T)
    assert (error <= bound).all(), f"{float((error / bound).max()):.2f} of the bound"
