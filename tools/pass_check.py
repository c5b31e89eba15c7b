"""The pass-cost table (decoding/cost.py) against the passes decoding really runs: each target
pass of one row timed as greedy speculation runs extract requests of the dev set, by tokens
fed, its median beside what the table says a pass of that size costs (and the ratio).

    python tools/pass_check.py                       # the built-in model
    python tools/pass_check.py --model FILE.gguf     # any GGUF (plain-text prompts without a
                                                     # chat template)

Load-aware speculation (loop.plan) weighs drafts by the table; a table far from the real
passes drafts too much or too little. Real passes differ from the table's by their context
length and their masks (a narrow position reads only its legal rows of the LM head): the
"wide" column keeps passes whose every position was wide, the like-for-like check.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import workloads  # noqa: E402

from constrained_spec import Generator  # noqa: E402
from constrained_spec.decoding import cost, loop  # noqa: E402
from constrained_spec.model import llama  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the built-in model)")
    p.add_argument("--data", default=str(workloads.DEV_SET))
    p.add_argument("--n", type=int, default=12, help="extract requests")
    p.add_argument("--seed", type=int, default=0, help="selects the requests")
    args = p.parse_args()
    gen = Generator.from_pretrained(*([args.model] if args.model else []))
    requests, _ = workloads.select_requests(
        gen, "extract", args.n, workloads.Selection(args.seed), Path(args.data)
    )
    target, forward = gen.target, loop.kv.forward_rows
    limit = llama.NARROW * target.vocab_size
    passes: dict[tuple[int, bool], list[float]] = {}  # (tokens fed, every position wide) → ms

    def timed(model, caches, fed, device, legal, *rest):
        start = time.perf_counter()
        out = forward(model, caches, fed, device, legal, *rest)
        out[0][-1, 0].item()  # the pass is done
        ms = 1e3 * (time.perf_counter() - start)
        if len(caches) == 1:
            wide = legal is None or min(llama.legal_counts(legal)) > limit
            passes.setdefault((len(fed[0]), wide), []).append(ms)
        return out

    loop.kv.forward_rows = timed
    try:
        for request in requests[1:]:  # the first warms up
            gen.generate(request.messages, schema=request.schema, max_new_tokens=160)
    finally:
        loop.kv.forward_rows = forward
    table = cost.pass_cost(target, 1)
    print(f"{args.model or 'the built-in model'}: one row's passes, ms (median; count)")
    print("tokens fed | all passes | wide passes | table | table ÷ wide")
    for fed in sorted({f for f, _ in passes}):
        every = passes.get((fed, True), []) + passes.get((fed, False), [])
        wide = passes.get((fed, True), [])
        says = table.ms(1, fed)
        wide_ms = statistics.median(wide) if wide else None
        print(
            f"{fed} | {statistics.median(every):.2f} ({len(every)}) | "
            + (f"{wide_ms:.2f} ({len(wide)})" if wide else "–")
            + f" | {says:.2f} | "
            + (f"{says / wide_ms:.2f}" if wide else "–")
        )


if __name__ == "__main__":
    main()
