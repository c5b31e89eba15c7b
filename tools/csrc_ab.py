"""The kernel library of another commit against this checkout's, in one process: the other
commit's ``constrained_spec/model/csrc/`` is built as this checkout's variant is (isa.py), and
the two libraries take turns, round after round, on the same loaded model — so both meet the
same minute of a noisy shared machine, which separate runs a few minutes apart do not (30–50%
swings here).

    python tools/csrc_ab.py 5d10e5f                  # layer forwards and a prompt, 10 rounds
    python tools/csrc_ab.py 5d10e5f --requests 16    # also 16 extract requests at B = 1, 8, 16
    python tools/csrc_ab.py --matmuls avx512-bf16 amx-bf16 --requests 16
                                                     # two 4-bit kernels of this checkout
    python tools/csrc_ab.py --prefills int4 amx-bf16 --requests 16
                                                     # two prefill kernels (prompts only)
    python tools/csrc_ab.py --pool --requests 16     # this checkout without its cache pool
                                                     # (llama.CachePool) and with it

The other commit must have the kernel library's C ABI (csrc/abi.h) at the version this checkout
reads (compiled.ABI_VERSION): the torch extension before it is called another way.

Prints per size the median ms of each and the median and range of the per-round ratios
(other / this); with ``--requests``, output tok/s at B = 1, 8 and 16 (speculative, greedy) the
same way. Both libraries must compute the same: the logits of a 17-token pass and every
request's tokens are compared, and a difference stops the run. Two 4-bit kernels (``--matmuls``:
"other" the first, "this" the second) sum in different orders, and two prefill kernels
(``--prefills``) read the prompts through different weights (the 4-bit ones or a bf16 copy), so
there each one's tokens are compared with its own from round to round only, and how many
requests' tokens the two share is printed. The prompt of ``--prompt`` tokens is fed as a prompt
(the prefill kernel).
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

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "benchmarks")]  # the package, run.py

import workloads  # noqa: E402
from run import forget_prompts  # noqa: E402

from constrained_spec import Generator  # noqa: E402
from constrained_spec.model import compiled, isa, kernels, kv, llama  # noqa: E402

CONTEXT = list(range(1000, 1400))  # a 400-token context before each timed pass
SIZES = (1, 4, 8, 17, 32)  # new tokens a pass: a step, a verify pass, batches' rows
ROWS = 16  # and a pass of 16 rows of 2 tokens each (a wide batch's round, one draft a row)


def build_other(commit: str, folder: Path, this: compiled.Kernels):
    """The other commit's kernel library, built for ``this`` one's variant, as compiled.load
    returns it."""
    csrc = folder / "csrc"
    csrc.mkdir()
    for path in [*isa.SOURCES, *isa.HEADERS]:
        name = path.relative_to(HERE.parent).as_posix()
        text = subprocess.run(
            ["git", "show", f"{commit}:{name}"], cwd=HERE.parent, capture_output=True, text=True
        )
        if text.returncode:
            raise SystemExit(f"cannot read {name} at {commit} (no C ABI there?): {text.stderr}")
        (csrc / path.name).write_text(text.stdout)
    known = {v.name: v for v in (*isa.variants(), isa.NATIVE)}
    library = folder / isa.library_name("other")
    if why := isa.build(known[this.variant], library, sources=[csrc / p.name for p in isa.SOURCES]):
        raise SystemExit(f"{commit}'s kernel library does not build: {why}")
    return compiled.Kernels(library, this.variant, f"built from {commit}"), None


def pass_ms(model, n: int, reps: int, rows: int = 1) -> tuple[float, torch.Tensor]:
    """Median ms of the layers over n new tokens after CONTEXT in each of ``rows`` caches (n ≥
    100: a prompt's tokens), and the features of the last pass."""
    caches = [kv.new_cache(model) for _ in range(rows)]
    for cache in caches:
        kv.prefill(model, cache, CONTEXT, "cpu")
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
        raise SystemExit(f"B = {batch}: {name}'s tokens differ from the other library's")
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
    parser.add_argument("commit", nargs="?", help="the other commit (its kernel library, csrc/)")
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
    this = kernels.fused_library()
    matmuls = dict(zip(("other", "this"), args.matmuls or ()))
    prefills = dict(zip(("other", "this"), args.prefills or ()))
    pools = {"other": llama.CachePool(0), "this": model.cache_pool} if args.pool else {}
    if args.commit:
        other = build_other(args.commit, Path(tempfile.mkdtemp(prefix="csrc-ab-")), this[0])
        modules = {"this": this, "other": other}
    else:
        modules = {"this": this, "other": this}

    def use(name: str) -> None:
        compiled.load = lambda: modules[name]  # the model's FusedModel serves either library
        compiled._loaded = modules[name][0]
        if name in matmuls:
            model.use_matmul(matmuls[name])
        if name in prefills:
            model.use_prefill(prefills[name])
        if name in pools:  # a cache gives its buffers back to the pool it came from
            model.cache_pool = pools[name]

    logits = {}
    for name in modules:
        use(name)
        logits[name] = model.head(pass_ms(model, 17, 1)[1])  # the logits of a 17-token pass
    if prefills:
        print(
            f"prefill {args.prefills[0]} against {args.prefills[1]} ({model.matmul} 4-bit kernel)"
        )
    elif matmuls:
        gap = (logits["this"] - logits["other"]).abs().max().item()
        print(f"{args.matmuls[0]} against {args.matmuls[1]}: logits at most {gap:.3g} apart")
    elif not torch.equal(logits["this"], logits["other"]):
        raise SystemExit("the two libraries' outputs differ on a 17-token pass")
    elif pools:
        print(f"without the cache pool against with it ({model.matmul} 4-bit kernel)")
    else:
        print(f"{args.commit} against this checkout ({model.matmul} 4-bit kernel): the same logits")

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
                    pass_ms(model, n, 3 if n >= 100 else 7)[0]
                )
            times.setdefault("rows", {}).setdefault(name, []).append(pass_ms(model, 2, 7, ROWS)[0])
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
