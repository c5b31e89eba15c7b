"""Closed objects (the default) against open_objects=True on the same requests (two run.py
folders): exact matches with the prompt's instance (extract), valid outputs, outputs with an
invented key (one no `properties` anywhere in the schema declares), output tokens.

    python benchmarks/compare_objects.py --out DIR CLOSED_DIR OPEN_DIR [CLOSED_DIR OPEN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def declared(node, names: set) -> set:
    """Every property name some `properties` in the schema declares."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "properties" and isinstance(v, dict):
                names |= set(v)
                for sub in v.values():
                    declared(sub, names)
            elif k not in ("enum", "const", "default", "examples"):
                declared(v, names)
    elif isinstance(node, list):
        for v in node:
            declared(v, names)
    return names


def keys(value) -> set:
    if isinstance(value, dict):
        return set(value).union(*(keys(v) for v in value.values()))
    return set().union(*(keys(v) for v in value)) if isinstance(value, list) else set()


def tally(folder: Path) -> dict:
    run = json.loads((folder / "results.json").read_text())
    schemas = {r["id"]: r["schema"] for r in run["requests"]}
    rows = [r for r in run["results"] if r.get("status") == "ok"]
    invented = 0
    for r in rows:
        try:
            value = json.loads(r["text"])
        except ValueError:
            continue
        invented += bool(keys(value) - declared(schemas[r["request"]], set()))
    return {
        "requests": len(rows),
        "exact": sum(r.get("exact_match") is True for r in rows),
        "valid": sum(r.get("valid") is True for r in rows),
        "invented": invented,
        "tokens": sum(r["output_tokens"] for r in rows),
        "length": sum(r.get("finish_reason") == "length" for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path, help="closed, open, closed, open, ...")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    lines = [
        "# Closed objects against open_objects=True, the same requests",
        "",
        "Command: `bash benchmarks/results/open-objects/run.sh` (greedy masked baseline, the "
        "default model; an invented key: one no `properties` in the schema declares).",
        "",
        "| workload | objects | requests | exact match | valid | with an invented key | "
        "output tokens | cut at max_new_tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for closed, opened in zip(args.folders[::2], args.folders[1::2]):
        for name, folder in (("closed (default)", closed), ("open_objects=True", opened)):
            t = tally(folder)
            workload = folder.name.split("-")[0]
            lines.append(
                f"| {workload} | {name} | {t['requests']} | {t['exact']} | {t['valid']} | "
                f"{t['invented']} | {t['tokens']} | {t['length']} |"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "comparison.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
