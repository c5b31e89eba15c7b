"""Probe: our own AVX-512 BF16 4-bit matrix-vector product (int4_gemv_probe.cpp) against torch's
int4 weight-only kernel, over the default model's 120 linear shapes (30 layers of random Q4_1
weights, each read from memory once per pass), one input row. Prints each kernel's relative
error against a float32 matmul over the same 4-bit weights (the input rounded to bf16 for both)
and the median ms of 20 passes, twice.

    python benchmarks/int4_gemv_probe.py     # needs a CPU with avx512_bf16 and a C++ compiler
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from constrained_spec import kernels

if "avx512_bf16" not in Path("/proc/cpuinfo").read_text():
    sys.exit("this CPU has no avx512_bf16: the probe's kernel cannot run here")
mod = cpp_extension.load(
    "int4_gemv_probe",
    [str(Path(__file__).with_name("int4_gemv_probe.cpp"))],
    extra_cflags=["-O3", "-march=native", "-fopenmp"],
    extra_ldflags=["-fopenmp"],
    build_directory=tempfile.mkdtemp(),
)
torch.manual_seed(0)


def make(n, k):
    q, d, m = kernels.quantize_q4_1(torch.randn(n, k) * 0.02)
    lin = kernels.Int4Linear.from_q4_1(q, d, m)
    scale, zero = d, m + 8 * d
    qq = q.to(torch.int32).view(n // 16, 16, k // 2, 2)
    packed = (qq[..., 0] | (qq[..., 1] << 4)).permute(0, 2, 1).contiguous().to(torch.uint8)
    sz = (
        torch.stack((scale.view(n // 16, 16, k // 32), zero.view(n // 16, 16, k // 32)), 2)
        .permute(0, 3, 2, 1)
        .contiguous()
    )  # (N/16, K/32, 2, 16)
    w = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    return lin, packed, sz, w


shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
layers = [make(n, k) for _ in range(30) for n, k in shapes]
for (lin, packed, sz, w), (n, k) in zip(layers[:4], shapes):
    x = torch.randn(k).to(torch.bfloat16)
    ref = w @ x.float()
    ours = mod.gemv(x, packed, sz)
    theirs = lin(x.float()[None])[0]
    print(
        (n, k),
        "ours err",
        ((ours - ref).norm() / ref.norm()).item(),
        "torch err",
        ((theirs - ref).norm() / ref.norm()).item(),
    )
xs = {k: torch.randn(k).to(torch.bfloat16) for _, k in shapes}


def run_ours():
    for (_, packed, sz, _), (_, k) in zip(layers, shapes * 30):
        mod.gemv(xs[k], packed, sz)


def run_torch():
    for (lin, *_), (_, k) in zip(layers, shapes * 30):
        torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k][None], lin.packed, 32, lin.scale_zero)


for name, f in (("ours", run_ours), ("torch", run_torch), ("ours", run_ours), ("torch", run_torch)):
    ts = []
    for _ in range(20):
        t = time.perf_counter()
        f()
        ts.append(1e3 * (time.perf_counter() - t))
    print(name, "120 linears (30 layers, cold):", round(statistics.median(ts), 2), "ms")
