"""The spacing of llguidance's matcher copies (``guidance.SNAPSHOT_EVERY``) against the
constraint's per-state work, in one process taking turns: constraint_profile.py's requests and
meter (each constraint's caches and copies emptied before its request, the kept prompts and the
drafter's learned tokens forgotten before each run, so every run decodes the same tokens).

    python benchmarks/snapshot_spacing.py --workload extract --every 1 2 3 --turns 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from constraint_profile import load, profile  # noqa: E402

from constrained_spec import guidance  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="extract", choices=["extract", "generate"])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--every", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    args = parser.parse_args()
    gen, requests = load(args.workload, args.n)
    runs, first = {e: [] for e in args.every}, None
    for turn in range(args.turns):
        for every in args.every:
            guidance.SNAPSHOT_EVERY = every
            gen.drafter.target_tokens.clear()  # what it learned in the last run shapes its drafts
            meter, rounds_s, tokens, outputs = profile(
                gen, requests, args.max_new_tokens, args.temperature
            )
            us, share = 1e6 * meter.mask_s / tokens, meter.mask_s / rounds_s
            first = first or outputs
            assert outputs == first, "a spacing changed the output tokens"
            runs[every].append((us, share))
            print(
                f"turn {turn + 1}, every {every}: {us:.1f} µs per token, {share:.2%} of the rounds"
            )
    for every, got in runs.items():
        us, share = (sum(x) / len(got) for x in zip(*got))
        print(f"every {every}: mean {us:.1f} µs per output token, {share:.2%} of the rounds")


if __name__ == "__main__":
    main()
