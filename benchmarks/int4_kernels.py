"""Each 4-bit kernel that runs here, alone and in the default model's layers:

    python benchmarks/int4_kernels.py

Prints, per kernel (kernels.INT4_KERNELS), the best of 50 calls of one 1536 × 576 linear (the
default model's gate/up shape; random Q4_1-style weights, one thread) at 1–64 input rows, then
what the model's calibration measures (llama.measure_layers: a one-token step plus a 5-token
verify pass after a 64-token context, the layers alone, best of 5) for each way of running the
layers. A kernel this machine lacks is named with the reason.
"""

from __future__ import annotations

import functools

import torch

from constrained_spec import Generator, kernels, llama

ROWS = (1, 4, 8, 16, 17, 32, 64)


def main() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    n, k = 1536, 576
    q, scale, zero = torch.randint(0, 16, (n, k)), torch.rand(n, k // 32), torch.rand(n, k // 32)
    runs = {}
    for kernel in kernels.INT4_KERNELS:
        if why := kernels.int4_kernel_missing(kernel):
            print(f"{kernel}: cannot run here ({why})")
            continue
        runs[kernel] = kernels.Int4Linear(q, scale * 0.01, zero * 0.01)
        runs[kernel].use_kernel(kernel)
    print(f"one {n} × {k} linear, one thread, ms (best of 50):")
    print("rows  " + "  ".join(f"{name:>12}" for name in runs))
    for m in ROWS:
        x = torch.randn(m, k)
        times = [kernels.best_ms(functools.partial(layer, x), 50) for layer in runs.values()]
        print(f"{m:>4}  " + "  ".join(f"{t:>12.3f}" for t in times))
    torch.set_num_threads(threads)
    model = Generator.from_pretrained(draft="lookup").target
    print(
        f"the default model's layers ({torch.get_num_threads()} threads), a step + a 5-token pass:"
    )
    for way, ms in llama.measure_layers(model).items():
        print(f"  {way:<20} {ms:.2f} ms")


if __name__ == "__main__":
    main()
