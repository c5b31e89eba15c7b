"""ms of one target forward over n new tokens after a 400-token context, eager or under
torch.compile (inductor, dynamic shapes) — the "cheaper target steps" probe of the speed issue.

    python benchmarks/step_cost.py eager-skinny
    python benchmarks/step_cost.py compile-skinny     # first call compiles (minutes on 2 cores)
    python benchmarks/step_cost.py phases              # the int4 compact forward, per phase
    python benchmarks/step_cost.py bandwidth           # its one-token step against the bandwidth
    python benchmarks/step_cost.py draw                # one sampled draw from a vocabulary's row
    python benchmarks/step_cost.py parts               # a one-token step: layers, head, the rest

Modes: "eager" or "compile", with "-skinny" for models.skinny_matmul (the library default):
prints, for n = 1, 2, 5, 1, the median of 10 timed steps and the first (compiling) step.
"phases": the built-in model with weights="int4" (its layers fused and in Python) and "float",
n = 1, 4, 8, 9, 17 (per way of running its layers and 4-bit kernel) and prefills of 100, 300 and 1000 tokens: wall ms (median of 10); for int4
also the forward without logits, with the LM head at wide or narrow positions, the head alone
against a float32 one, and for the Python layers the profiler's split of the forward without the
head into the 4-bit matmuls, attention and everything else (op dispatch, norms, rotary, cache).
"""

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the package, run.py
from run import forward_ms  # noqa: E402

from constrained_spec.model import kernels, kv  # noqa: E402
from constrained_spec.model.models import DEFAULT_MODEL, load_model, skinny_matmul  # noqa: E402

PHASES = {
    "aten::_weight_int4pack_mm_for_cpu": "4-bit matmuls",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
}


def phases() -> None:
    from torch.profiler import ProfilerActivity, profile

    context = list(range(1000, 1400))[:300]
    for weights in ("int4", "float"):
        model, _ = load_model(DEFAULT_MODEL, weights=weights)
        if weights == "float":
            skinny_matmul(model)
        for layers, n in [(k, n) for k in layer_kernels(model) for n in (1, 4, 8, 9, 17)]:
            if layers:
                way, matmul = layers.split("/")
                model.use_matmul(matmul)
                model.use_layers(way)
            median = statistics.median(forward_ms(model, context, n, reps=10)[1:])
            line = f"{weights}{f' {layers} layers' if layers else ''} n={n}: {median:.1f} ms"
            if weights == "int4":
                line += head_split(model, context, n)
            if layers == "python/torch":  # the profiler splits torch's ops, not ours
                cache = kv.new_cache(model)
                kv.forward(model, cache, context, "cpu")
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(10):  # the steps alone, not the context's prefill
                        model(torch.tensor(context[-n:]), cache, logits=False)
                        kv.crop(cache, len(context))
                split = {name: 0.0 for name in [*PHASES.values(), "other"]}
                for event in prof.key_averages():
                    split[PHASES.get(event.key, "other")] += event.self_cpu_time_total / 1e3
                total = sum(split.values())
                line += "; without the head: " + ", ".join(
                    f"{k} {100 * v / total:.0f}%" for k, v in split.items()
                )
            print(line + (")" if weights == "int4" else ""), flush=True)
        for n in (100, 300, 1000):
            times = []
            for _ in range(3):
                if getattr(model, "prompt_cache", None) is not None:
                    model.prompt_cache.clear()  # the whole prompt computed, every time
                t = time.perf_counter()
                kv.prefill(model, kv.new_cache(model), list(range(1000, 1000 + n)), "cpu")
                times.append(1e3 * (time.perf_counter() - t))
            print(f"{weights} prefill of {n} tokens: {min(times):.0f} ms", flush=True)


def layer_kernels(model) -> list:
    """The ways this model can run its layers (kernels.LAYER_KERNELS) with each 4-bit kernel
    (kernels.INT4_KERNELS), "fused/avx512-bf16" and so on; [None] for a float one."""
    if getattr(model, "weights", "float") == "float":
        return [None]
    ways = [k for k in kernels.LAYER_KERNELS if k == "python" or not kernels.fused_missing()]
    matmuls = [k for k in kernels.INT4_KERNELS if not kernels.int4_kernel_missing(k)]
    return [f"{way}/{matmul}" for way in ways for matmul in matmuls]


def head_split(model, context: list[int], n: int, reps: int = 20) -> str:
    """The compact forward without logits, and with the LM head at wide positions (every token
    legal: the Q8_0 head) or narrow ones (50 legal: their rows only); the float32 head alone."""
    vocab = model.vocab_size
    wide = torch.ones(n, vocab, dtype=torch.bool)
    narrow = torch.zeros(n, vocab, dtype=torch.bool)
    narrow[:, 1000:1050] = True
    cache = kv.new_cache(model)
    kv.prefill(model, cache, context, "cpu")
    ids = torch.tensor(context[-n:])

    def ms(call) -> float:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            call()
            times.append(1e3 * (time.perf_counter() - t))
            kv.crop(cache, len(context))
        return statistics.median(times)

    features = model(ids, cache, logits=False)[1]
    kv.crop(cache, len(context))
    dense = kernels.DenseLinear(model.lm_head.dequantized())
    return (
        f" (no logits {ms(lambda: model(ids, cache, logits=False)):.1f}, "
        f"wide {ms(lambda: model(ids, cache, masks=wide)):.1f}, "
        f"narrow {ms(lambda: model(ids, cache, masks=narrow)):.1f}; "
        f"the head alone {ms(lambda: model.head(features, wide)):.2f}, "
        f"a float32 head {ms(lambda: dense(features)):.2f}"
    )


def bandwidth(rounds: int = 41) -> None:
    """The one-token step against the bandwidth limit (run.bandwidth_limit) over ``rounds``
    rounds of one 1 GiB sum and 10 steps each, for each 4-bit kernel that runs here, the kernels
    alternating: the per-round ratios' median and quartiles (a shared machine's bandwidth and
    compute move from minute to minute, so one short measurement says little)."""
    from run import bandwidth_limit

    model, _ = load_model(DEFAULT_MODEL, weights="int4")
    chosen, context = model.matmul, list(range(1000, 1300))
    matmuls = [k for k in kernels.INT4_KERNELS if not kernels.int4_kernel_missing(k)]
    ratios = {k: [] for k in matmuls}
    for _ in range(rounds):
        for matmul in matmuls:
            model.use_matmul(matmul)
            step = lambda: statistics.median(forward_ms(model, context, 1, reps=10)[1:])
            ratios[matmul].append(bandwidth_limit(model, step, rounds=1)["step_over_limit"])
    model.use_matmul(chosen)
    measured = bandwidth_limit(model, lambda: statistics.median(forward_ms(model, context, 1, 10)))
    print(f"the chosen kernel: {chosen}; a step reads {measured['weight_bytes'] / 1e6:.0f} MB")
    for matmul, values in ratios.items():
        q1, q2, q3 = statistics.quantiles(values, n=4)
        print(
            f"{matmul}: one-token step / bandwidth limit over {rounds} rounds: median {q2:.2f}×, "
            f"quartiles {q1:.2f}–{q3:.2f}×, range {min(values):.2f}–{max(values):.2f}×",
            flush=True,
        )


def draw(reps: int = 200) -> None:
    """µs of one sampled draw from a softmax row as wide as the default model's vocabulary:
    torch.multinomial against sample.draw (CDF inversion), best of 5 runs of ``reps``."""
    import timeit

    from constrained_spec.decoding.sample import draw as inverted

    gen = torch.Generator().manual_seed(0)
    row = torch.softmax(torch.randn(49_152, generator=gen) * 3, 0)
    for name, fn in [
        ("torch.multinomial", lambda: torch.multinomial(row, 1, generator=gen)),
        ("sample.draw", lambda: inverted(row, gen)),
    ]:
        best = min(timeit.repeat(fn, number=reps, repeat=5)) / reps
        print(f"{name}: {1e6 * best:.0f} µs a draw ({torch.get_num_threads()} threads)")


@torch.inference_mode()
def parts(reps: int = 60, runs: int = 3) -> None:
    """A one-token step of the built-in int4 model as loaded (after a 300-token context) split
    into the fused layers' call, the LM head's call and the rest, medians of ``reps`` steps,
    ``runs`` times: what round 6 of the fast target moved into the compiled calls."""
    model, _ = load_model(DEFAULT_MODEL, weights="int4")
    compiled, spent = kernels.fused_library()[0], {"layers": [], "head": []}

    def timed(name, call):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = call(*args, **kwargs)
            spent[name][-1] += time.perf_counter() - start
            return out

        return wrapper

    if compiled is not None and getattr(model, "layer_kernel", None) == "fused":
        compiled.fused_layers = timed("layers", compiled.fused_layers)
    head = model.lm_head
    head.forward = timed("head", head.forward)
    context = list(range(1000, 1300))
    for _ in range(runs):
        cache, steps = kv.new_cache(model), []
        for times in spent.values():
            times.append(0.0)  # the prefill's calls, not counted
        kv.forward(model, cache, context, "cpu")
        for _ in range(reps + 1):
            for times in spent.values():
                times.append(0.0)
            start = time.perf_counter()
            kv.forward(model, cache, context[-1:], "cpu")
            steps.append(time.perf_counter() - start)
            kv.crop(cache, len(context))
        step = statistics.median(steps[1:])
        layers, head_s = (statistics.median(spent[k][-reps:]) for k in ("layers", "head"))
        print(
            f"{model.layer_kernel}/{model.matmul}: step {1e3 * step:.2f} ms, layers' call "
            f"{1e3 * layers:.2f}, head {1e3 * head_s:.2f}, the rest "
            f"{1e3 * (step - layers - head_s):.2f} (medians of {reps} steps)"
        )


def main(mode: str) -> None:
    if mode == "parts":
        return parts()
    if mode == "phases":
        return phases()
    if mode == "bandwidth":
        return bandwidth()
    if mode == "draw":
        return draw()
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
