"""Rebuild benchmarks/data/sample/ from the full JSONSchemaBench dev set (a fixed, seeded rule).

    python benchmarks/data/make_sample.py /path/to/jsonschemabench-dev

The rule: shuffle the sorted file names with random.Random(0) (the order benchmarks/workloads.py
and train_head.py use), keep the first 400 (train_head.py reserves them: the shipped draft head
never trained on them), and take the first 48 of those whose compact schema is at most 1,500
characters and which hold a valid instance of 20-300 characters (workloads.Selection's defaults).
"""

import json
import random
import shutil
import sys
from pathlib import Path

N, RESERVED, MAX_SCHEMA, INSTANCE = 48, 400, 1500, (20, 300)


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def usable(path: Path) -> bool:
    doc = json.loads(path.read_text())
    if len(compact(doc.get("schema"))) > MAX_SCHEMA:
        return False
    return any(
        t.get("valid") and INSTANCE[0] <= len(compact(t.get("data"))) <= INSTANCE[1]
        for t in doc.get("tests", [])
    )


def main(src: Path, out: Path) -> None:
    order = sorted(src.glob("*.json"))
    random.Random(0).shuffle(order)
    picked = [p for p in order[:RESERVED] if usable(p)][:N]
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.json"):
        old.unlink()
    for p in picked:
        shutil.copy(p, out / p.name)
    print(f"{len(picked)} files -> {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(__file__).resolve().parent / "sample")
