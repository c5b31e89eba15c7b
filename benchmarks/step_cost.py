"""ms of one target forward over n new tokens after a 400-token context, eager or under
torch.compile (inductor, dynamic shapes) — the "cheaper target steps" probe of the speed issue.

    python benchmarks/step_cost.py eager-skinny
    python benchmarks/step_cost.py compile-skinny     # first call compiles (minutes on 2 cores)

Modes: "eager" or "compile", with "-skinny" for models.skinny_matmul (the library default).
Prints, for n = 1, 2, 5, 1: the median of 10 timed steps and the first (compiling) step.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from constrained_spec.models import DEFAULT_MODEL, load_model, skinny_matmul  # noqa: E402
from run import forward_ms  # noqa: E402



def main(mode: str) -> None:
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
        print(f"{mode} n={n}: median {median:.1f} ms, first {first:.0f} ms, "
              f"{time.perf_counter() - t0:.0f} s in all", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "eager-skinny")
