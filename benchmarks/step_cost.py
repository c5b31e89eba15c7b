"""ms of one target forward over n new tokens after a 400-token context, eager or under
torch.compile (inductor, dynamic shapes) — the "cheaper target steps" probe of the speed issue.

    python benchmarks/step_cost.py eager-skinny
    python benchmarks/step_cost.py compile-skinny     # first call compiles (minutes on 2 cores)
    python benchmarks/step_cost.py phases              # the int4 compact forward, per phase

Modes: "eager" or "compile", with "-skinny" for models.skinny_matmul (the library default):
prints, for n = 1, 2, 5, 1, the median of 10 timed steps and the first (compiling) step.
"phases": the built-in model with weights="int4" and "float", n = 1, 4, 8, 9, 17 and prefills of
100, 300 and 1000 tokens: wall ms (median of 10), and for int4 the profiler's split into the
4-bit matmuls, the LM head, attention and everything else (op dispatch, norms, rotary, cache).
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from run import forward_ms  # noqa: E402

from constrained_spec import cache as kv  # noqa: E402
from constrained_spec.models import DEFAULT_MODEL, load_model, skinny_matmul  # noqa: E402

PHASES = {
    "aten::_weight_int4pack_mm_for_cpu": "4-bit matmuls",
    "aten::mm": "LM head",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
}


def phases() -> None:
    from torch.profiler import ProfilerActivity, profile

    context = list(range(1000, 1400))[:300]
    for weights in ("int4", "float"):
        model, _ = load_model(DEFAULT_MODEL, weights=weights)
        if weights == "float":
            skinny_matmul(model)
        for n in (1, 4, 8, 9, 17):
            median = statistics.median(forward_ms(model, context, n, reps=10)[1:])
            line = f"{weights} n={n}: {median:.1f} ms"
            if weights == "int4":
                cache = kv.new_cache(model)
                kv.forward(model, cache, context, "cpu")
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(10):  # the steps alone, not the context's prefill
                        kv.forward(model, cache, context[-n:], "cpu")
                        kv.crop(cache, len(context))
                split = {name: 0.0 for name in [*PHASES.values(), "other"]}
                for event in prof.key_averages():
                    split[PHASES.get(event.key, "other")] += event.self_cpu_time_total / 1e3
                total = sum(split.values())
                line += (
                    " (" + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in split.items()) + ")"
                )
            print(line, flush=True)
        for n in (100, 300, 1000):
            times = []
            for _ in range(3):
                t = time.perf_counter()
                kv.prefill(model, kv.new_cache(model), list(range(1000, 1000 + n)), "cpu")
                times.append(1e3 * (time.perf_counter() - t))
            print(f"{weights} prefill of {n} tokens: {min(times):.0f} ms", flush=True)


def main(mode: str) -> None:
    if mode == "phases":
        return phases()
    model, _ = load_model(DEFAULT_MODEL)
    model.eval()
    if "skinny" in mode:
        skinny_matmul(model)
    if mode.startswith("compile"):
        model.forward = torch.compile(model.forward, dynamic=True)
    context = list(range(1000, 1400))
    for n in (1, 2, 5, 1):
        t0 = time.perf_counter()
        first, *timed = forward_ms(model, context, n, reps=10)
        median = statistics.median(timed)
        print(
            f"{mode} n={n}: median {median:.1f} ms, first {first:.0f} ms, "
            f"{time.perf_counter() - t0:.0f} s in all",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "eager-skinny")
