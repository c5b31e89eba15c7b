"""The constraint's per-state work inside real decoding, as a user's first request of a schema
meets it: ``Generator.from_pretrained()`` (auto's drafter), the first ``--n`` requests of a
headline run, seeded, each constraint's caches and matcher snapshots emptied before its request
and the kept prompts forgotten; run.py's meter times every per-state method (outermost calls).
Prints µs per output token by method and the share of the decode rounds (after the prefill).
Run it on two commits in turn to compare them: the output tokens must be the same.

    python benchmarks/constraint_profile.py > benchmarks/results/constraint-profile/COMMIT.txt
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import Meter, forget_prompts  # noqa: E402

from constrained_spec import Generator  # noqa: E402


def profile(gen, requests, max_new_tokens: int, temperature: float):
    """(meter, seconds in the decode rounds, output tokens, output ids) of one seeded run of
    ``requests``, each constraint's caches and matcher copies emptied and the kept prompts
    forgotten before its request."""
    meter, rounds_s, tokens, outputs = Meter(gen.target), 0.0, 0, []
    for i, request in enumerate(requests):
        gen.compile(schema=request["schema"]).clear_caches()  # llguidance's: its copies too
        forget_prompts(gen.target)
        result = gen.generate(
            request["messages"],
            schema=request["schema"],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=i,
        )
        rounds_s += result.stats.total_s - result.stats.prefill_s
        tokens += len(result.token_ids) + (result.finish_reason == "stop")
        outputs.append(result.token_ids)
    meter.close()
    return meter, rounds_s, tokens, outputs


def load(workload: str, n: int):
    """The default generator and the first ``n`` requests of a headline run."""
    requests = json.loads((HERE / f"results/{workload}-fast/requests.json").read_text())
    gen = Generator.from_pretrained()
    for table in ("ids_by_bytes", "longest_by_start"):  # built once per process, not per request
        getattr(gen.vocab, table)
    return gen, requests["requests"][:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="extract", choices=["extract", "generate"])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    args = parser.parse_args()
    gen, requests = load(args.workload, args.n)
    meter, rounds_s, tokens, _ = profile(gen, requests, args.max_new_tokens, args.temperature)
    print(
        f"{args.workload}, {args.n} requests, T = {args.temperature:g}: {tokens} output tokens, "
        f"rounds {1e3 * rounds_s / tokens:.2f} ms per token; constraint "
        f"{1e6 * meter.mask_s / tokens:.1f} µs per token, {meter.mask_s / rounds_s:.2%} of the rounds"
    )
    for name, seconds in sorted(meter.mask_by.items(), key=lambda kv: -kv[1]):
        print(f"  {name:12s} {1e6 * seconds / tokens:6.1f} µs per token")


if __name__ == "__main__":
    main()
