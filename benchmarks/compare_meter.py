"""The constraint's cost in benchmark runs side by side: per configuration, tok/s, its share of
the decode loop (wall minus setup and prefill), µs per committed token, the µs by metered method
(``mask_by``), and whether the runs wrote the same texts. Pairs of run folders, old then new:

    python benchmarks/compare_meter.py OLD_RUN NEW_RUN [OLD_RUN NEW_RUN ...] > comparison.md
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path


def rows(run: Path) -> list[dict]:
    lines = (run / "results.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("status") == "ok"]


def by_config(run: Path) -> dict[str, dict]:
    groups = defaultdict(list)
    for r in rows(run):
        groups[r["config"]].append(r)
    out = {}
    for config, rs in groups.items():
        committed = sum(r["committed_tokens"] for r in rs)
        decode = sum(r["decode_s"] - r["prefill_s"] for r in rs)
        spent, methods = sum(r["mask_s"] for r in rs), Counter()
        for r in rs:
            methods.update({k: 1e6 * v / committed for k, v in r.get("mask_by", {}).items()})
        out[config] = {
            "tok/s": sum(r["output_tokens"] for r in rs) / sum(r["wall_s"] for r in rs),
            "share": spent / decode,
            "us": 1e6 * spent / committed,
            "methods": ", ".join(f"{k} {v:.0f}" for k, v in methods.most_common()),
        }
    return out


def main(runs: list[str]) -> None:
    print(
        "| run | config | tok/s old → new | share of decode | µs per token | µs by method, old"
        " | new |"
    )
    print("|---|---|---|---|---|---|---|")
    for old, new in zip(runs[::2], runs[1::2]):
        a, b = by_config(Path(old)), by_config(Path(new))
        for config in a:
            x, y = a[config], b[config]
            print(
                f"| {Path(new).name} | {config} | {x['tok/s']:.1f} → {y['tok/s']:.1f} | "
                f"{x['share']:.1%} → {y['share']:.1%} | {x['us']:.0f} → {y['us']:.0f} | "
                f"{x['methods']} | {y['methods']} |"
            )
        same = sum(p["text"] == q["text"] for p, q in zip(rows(Path(old)), rows(Path(new))))
        print(f"| {Path(new).name} | same text | {same} of {len(rows(Path(old)))} | | | | |")


if __name__ == "__main__":
    main(sys.argv[1:])
