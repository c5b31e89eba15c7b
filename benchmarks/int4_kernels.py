"""Each 4-bit kernel that runs here, alone and in the default model's layers:

    python benchmarks/int4_kernels.py

Prints, per kernel (kernels.INT4_KERNELS), the best of 50 calls of one 1536 × 576 linear (the
default model's gate/up shape; random Q4_1-style weights, one thread) at 1–64 input rows, then
what the model's calibration measures (llama.measure_layers: a one-token step plus a 5-token
verify pass after a 64-token context, the layers alone, best of 5) for each way of running the
layers, and a 300-token prompt (nothing kept) through each prefill kernel the model's layers can
take (kernels.PREFILL_KERNELS), the kernels taking turns for 5 rounds: the median ms. A kernel
this machine lacks is named with the reason.
"""

from __future__ import annotations

import functools
import statistics
import time

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
    prompts(model)


def prompts(model, rounds: int = 5) -> None:
    """A 300-token prompt per prefill kernel, in turns; the model is left as it was."""
    chosen, kept, ids = model.prefill, model.prompt_cache, list(range(1000, 1300))
    model.prompt_cache = None  # every prefill computes the whole prompt
    usable = [k for k in kernels.PREFILL_KERNELS if not (k == "bf16" and model._fused)]
    usable = [k for k in usable if not (k == "amx-bf16" and kernels.int4_kernel_missing(k))]
    times = {k: [] for k in usable}
    for _ in range(rounds):
        for kernel in usable:
            model.use_prefill(kernel)
            start = time.perf_counter()
            model.feed_prompt(ids, model.new_cache())
            times[kernel].append((time.perf_counter() - start) * 1e3)
    model.use_prefill(chosen)
    model.prompt_cache = kept
    print(f"a 300-token prompt ({model.layer_kernel} layers; the model's choice: {chosen}):")
    for kernel, ms in times.items():
        print(f"  {kernel:<10} {statistics.median(ms):7.1f} ms (range {min(ms):.1f}–{max(ms):.1f})")


if __name__ == "__main__":
    main()
