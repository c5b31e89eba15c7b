"""The fused layers of another commit against this checkout's, in one process: the other
commit's ``constrained_spec/csrc/fused_layers.cpp`` is compiled as a second module, and the two
take turns, round after round, on the same loaded model — so both meet the same minute of a
noisy shared machine, which separate runs a few minutes apart do not (30–50% swings here).

    python benchmarks/csrc_ab.py 5d10e5f                  # layer forwards and a prompt, 10 rounds
    python benchmarks/csrc_ab.py 5d10e5f --requests 16    # also 16 extract requests at B = 1, 8, 16
    python benchmarks/csrc_ab.py --matmuls avx512-bf16 amx-bf16 --requests 16
                                                          # two 4-bit kernels of this checkout
    python benchmarks/csrc_ab.py --prefills int4 amx-bf16 --requests 16
                                                          # two prefill kernels (prompts only)
    python benchmarks/csrc_ab.py --pool --requests 16     # this checkout without its cache pool
                                                          # (llama.CachePool) and with it

The other commit must be 5d10e5f or later: fused_layers took one argument fewer before (the
prompts' dense weights), and the model calls it as this checkout does (a commit before the
dense copy ran on AVX-512 BF16 too gets its call without the ``dense_amx`` flag, and where this
checkout's prompts run that copy, both take 4-bit prompts). A commit before the keys
came in tiles (llama.KEY_TILE) gets caches with its keys position-last, fed its context through
its own layers; its passes are timed (and their features compared), not its requests or prompts.

Prints per size the median ms of each and the median and range of the per-round ratios
(other / this); with ``--requests``, output tok/s at B = 1, 8 and 16 (speculative, greedy) the
same way. Both modules must compute the same: the logits of a 17-token pass and every request's
tokens are compared, and a difference stops the run. Two 4-bit kernels (``--matmuls``: "other"
the first, "this" the second) sum in different orders, and two prefill kernels (``--prefills``)
read the prompts through different weights (the 4-bit ones or a bf16 copy), so there each one's
tokens are compared with its own from round to round only, and how many requests' tokens the
two share is printed. The prompt of ``--prompt`` tokens is fed as a prompt (the prefill kernel).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "benchmarks")]  # the package, run.py

import workloads  # noqa: E402
from run import forget_prompts  # noqa: E402

from constrained_spec import Generator  # noqa: E402
from constrained_spec.target import (  # noqa: E402
    kernels,
    kv,  # noqa: E402
    llama,
)

SOURCE = "constrained_spec/csrc/fused_layers.cpp"
CONTEXT = list(range(1000, 1400))  # a 400-token context before each timed pass
SIZES = (1, 4, 8, 17, 32)  # new tokens a pass: a step, a verify pass, batches' rows
ROWS = 16  # and a pass of 16 rows of 2 tokens each (a wide batch's round, one draft a row)


def build_other(commit: str, folder: Path):
    """The other commit's fused layers, compiled under another name, as fused_build returns,
    and whether its keys come in tiles."""
    text = subprocess.run(
        ["git", "show", f"{commit}:{SOURCE}"], cwd=HERE.parent, capture_output=True, text=True
    )
    if text.returncode:
        raise SystemExit(f"cannot read {SOURCE} at {commit}: {text.stderr.strip()}")
    source = folder / "fused_other.cpp"
    source.write_text(text.stdout)
    module = cpp_extension.load(
        "fused_other", [str(source)], build_directory=str(folder), **kernels.fused_flags()
    )
    if "bool dense_amx" not in text.stdout:  # before the dense copy on AVX-512 BF16 too
        module = WithoutDenseFlag(module)
    if "attention_cap" not in text.stdout:  # before soft-capped scores (Gemma 2)
        module = WithoutAttentionCap(module)
    return (module, None), "KEY_TILE" in text.stdout  # the build flags are the library's own


class WithoutDenseFlag:
    """An older module, called as this checkout calls it: its fused_layers has no ``dense_amx``
    argument (the 9th: its dense copies were AMX tiles only) and its dense_mm no ``amx``."""

    def __init__(self, module):
        self.module = module

    def __getattr__(self, name):
        return getattr(self.module, name)

    def fused_layers(self, *args):
        return self.module.fused_layers(*args[:8], *args[9:])

    def dense_mm(self, x, tiles, amx):
        return self.module.dense_mm(x, tiles)


class WithoutAttentionCap:
    """An older module, called as this checkout calls it: its fused_layers has no
    ``attention_cap`` (the last argument; 0 for every family it ran)."""

    def __init__(self, module):
        self.module = module

    def __getattr__(self, name):
        return getattr(self.module, name)

    def fused_layers(self, *args):
        assert args[-1] == 0, "the older layers compute no soft-cap"
        return self.module.fused_layers(*args[:-1])


def pass_ms(
    model, n: int, reps: int, rows: int = 1, tiled: bool = True
) -> tuple[float, torch.Tensor]:
    """Median ms of the layers over n new tokens after CONTEXT in each of ``rows`` caches (n ≥
    100: a prompt's tokens), and the features of the last pass. ``tiled=False``: caches with
    keys position-last (an older commit's), the context fed through the layers, not as a prompt."""
    caches = [kv.new_cache(model) for _ in range(rows)]
    for cache in caches:
        if tiled:
            kv.prefill(model, cache, CONTEXT, "cpu")
        else:  # room for CONTEXT and a pass, so that nothing grows (the growth copies tiles)
            L, KV, _, hd = cache.values.shape
            cache.keys, cache.values = (
                torch.empty(L, KV, hd, 512),
                torch.empty(L, KV, 512, hd, dtype=cache.values.dtype),
            )
            cache._pool = None
            model(torch.tensor(CONTEXT), cache, logits=False)
    ids = torch.tensor(CONTEXT[-n:] if n < 100 else range(2000, 2000 + n))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        features = model.forward_rows([ids] * rows, caches, logits=False, prompt=n >= 100)[1]
        times.append(1e3 * (time.perf_counter() - start))
        for cache in caches:
            kv.crop(cache, len(CONTEXT))
    return statistics.median(times), features


def tok_s(gen: Generator, requests: list[dict], batch: int, outputs: dict, name: str) -> float:
    forget_prompts(gen.target)
    start = time.perf_counter()
    results = gen.generate_batch(requests, batch_size=batch)
    wall = time.perf_counter() - start
    tokens = [r.token_ids for r in results]
    if outputs.setdefault((batch, name), tokens) != tokens:
        raise SystemExit(f"B = {batch}: {name}'s tokens differ from the other module's")
    return sum(len(t) for t in tokens) / wall


def report(label: str, times: dict, unit: str, higher_is_better: bool = False) -> None:
    other, this = times["other"], times["this"]
    ratios = [(b / a if higher_is_better else a / b) for a, b in zip(other, this)]
    print(
        f"{label}: other {statistics.median(other):.2f} {unit}, this {statistics.median(this):.2f}"
        f" {unit}; this faster by {statistics.median(ratios):.2f}× (rounds "
        f"{min(ratios):.2f}–{max(ratios):.2f}×)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commit", nargs="?", help="the other commit (its csrc/fused_layers.cpp)")
    for flag, choices, what in (
        ("--matmuls", kernels.INT4_KERNELS, "4-bit"),
        ("--prefills", kernels.PREFILL_KERNELS, "prefill"),
    ):
        parser.add_argument(
            flag,
            nargs=2,
            metavar=("OTHER", "THIS"),
            choices=choices,
            help=f"instead of a commit: two {what} kernels of this checkout's build",
        )
    parser.add_argument(
        "--pool",
        action="store_true",
        help="instead of a commit: this checkout without its cache pool (other) and with it",
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--prompt", type=int, default=300, help="prompt tokens timed (0: none)")
    parser.add_argument("--requests", type=int, default=0, help="extract requests (0: none)")
    args = parser.parse_args()
    if sum(bool(x) for x in (args.commit, args.matmuls, args.prefills, args.pool)) != 1:
        parser.error("give the other commit, --matmuls OTHER THIS, --prefills OTHER THIS or --pool")
    gen = Generator.from_pretrained(draft="lookup")
    model = gen.target
    if getattr(model, "layer_kernel", None) != "fused":
        raise SystemExit("the target does not run the fused layers here: nothing to compare")
    this = kernels.fused_build()
    matmuls = dict(zip(("other", "this"), args.matmuls or ()))
    prefills = dict(zip(("other", "this"), args.prefills or ()))
    pools = {"other": llama.CachePool(0), "this": model.cache_pool} if args.pool else {}
    tiled = {"this": True, "other": True}
    if args.commit:
        folder = Path(tempfile.mkdtemp(prefix="csrc-ab-"))
        other, tiled["other"] = build_other(args.commit, folder)
        modules = {"this": this, "other": other}
        if not tiled["other"] and (args.requests or args.prompt):
            parser.error(f"{args.commit}'s keys are position-last: passes only (--prompt 0)")
        if isinstance(other[0], WithoutDenseFlag) and model.prefill == "avx512-bf16":
            model.use_prefill("int4")  # its dense copies run on AMX only: prompts 4-bit for both
            print(f"{args.commit} has no AVX-512 BF16 prompts: both take 4-bit prompts here")
    else:
        modules = {"this": this, "other": this}

    def use(name: str) -> None:
        kernels.fused_build = lambda: modules[name]
        if name in matmuls:
            model.use_matmul(matmuls[name])
        if name in prefills:
            model.use_prefill(prefills[name])
        if name in pools:  # a cache gives its buffers back to the pool it came from
            model.cache_pool = pools[name]

    logits = {}
    for name in modules:
        use(name)
        try:  # the features of a 17-token pass (both layouts), or with the same caches its logits
            logits[name] = pass_ms(model, 17, 1, tiled=tiled[name])[1]
            if all(tiled.values()):
                logits[name] = model.head(logits[name])
        except TypeError as err:  # an older call signature (see above)
            raise SystemExit(f"{name}'s fused_layers takes other arguments: {err}") from err
    if prefills:
        print(
            f"prefill {args.prefills[0]} against {args.prefills[1]} ({model.matmul} 4-bit kernel)"
        )
    elif matmuls:
        gap = (logits["this"] - logits["other"]).abs().max().item()
        print(f"{args.matmuls[0]} against {args.matmuls[1]}: logits at most {gap:.3g} apart")
    elif not torch.equal(logits["this"], logits["other"]):
        raise SystemExit("the two modules' outputs differ on a 17-token pass")
    elif pools:
        print(f"without the cache pool against with it ({model.matmul} 4-bit kernel)")
    else:
        same = "logits" if all(tiled.values()) else "features"
        print(f"{args.commit} against this checkout ({model.matmul} 4-bit kernel): the same {same}")

    requests = []
    if args.requests:
        selected, _ = workloads.select_requests(
            gen, "extract", args.requests, workloads.Selection(0), workloads.DATA, log=lambda *a: 0
        )
        requests = [
            dict(prompt=r.messages, schema=r.schema, max_new_tokens=160) for r in selected[1:]
        ]
        gen.generate_batch(requests[:1])  # warm-up: compiled masks
    sizes = SIZES + ((args.prompt,) if args.prompt else ())
    times, speeds, outputs = {}, {}, {}
    for _ in range(args.rounds):
        for name in modules:
            use(name)
            for n in sizes:
                times.setdefault(n, {}).setdefault(name, []).append(
                    pass_ms(model, n, 3 if n >= 100 else 7, tiled=tiled[name])[0]
                )
            times.setdefault("rows", {}).setdefault(name, []).append(
                pass_ms(model, 2, 7, ROWS, tiled[name])[0]
            )
            for batch in (1, 8, 16) if requests else ():
                speeds.setdefault(batch, {}).setdefault(name, []).append(
                    tok_s(gen, requests, batch, outputs, name)
                )
    for n in sizes:
        report(f"{'prompt' if n >= 100 else 'pass'} of {n} tokens", times[n], "ms")
    report(f"pass of {ROWS} rows of 2 tokens", times["rows"], "ms")
    for batch, values in speeds.items():
        report(f"{len(requests)} extract requests, B = {batch}", values, "tok/s", True)
        if matmuls or prefills:
            shared = sum(a == b for a, b in zip(outputs[batch, "other"], outputs[batch, "this"]))
            print(f"  the same tokens on {shared} of {len(requests)} requests")


if __name__ == "__main__":
    main()
