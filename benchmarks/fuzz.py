"""Fuzz the schema compiler: random schemas and mutated dev schemas, thousands of them.

Each case builds a schema from its seed (even seeds: testing.random_schema; odd seeds: one
testing.mutate_schema change to a file of the dev sample), compiles it against the tiny
byte-level test tokenizer and then checks, in a forked child (so that a hang is caught):
    the compile returns a constraint or raises a documented error (ConstraintError and its
      subclasses); any other exception is an "undocumented exception" (goal 0);
    every text the automaton accepts validates with jsonschema: random walks over the automaton,
      the dev file's own test instances (valid and invalid) and small random JSON values; an
      accepted text that jsonschema rejects is "invalid accepted" (goal 0);
    the case finishes within --hang-s (goal 0 "hangs");
    a case whose texts jsonschema itself cannot judge (it recurses without end) is "unjudged".

    python benchmarks/fuzz.py --cases 2000 --out benchmarks/results/fuzz
    python benchmarks/fuzz.py --summarize --out benchmarks/results/fuzz  # from results.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from constrained_spec import testing  # noqa: E402
from constrained_spec.constraints import compile_constraint, token_vocabulary  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "sample"
OUT = ROOT / "benchmarks" / "results" / "fuzz"


def make_case(seed: int, files: list[Path]) -> tuple[dict, list, str]:
    """(schema, candidate instances from its dev file, kind) for this seed."""
    rng = random.Random(seed)
    if seed % 2 == 0:
        return testing.random_schema(rng), [], "random"
    d = json.loads(rng.choice(files).read_text())
    return testing.mutate_schema(d["schema"], rng), [t["data"] for t in d["tests"]], "mutated"


def run_case(seed: int, files: list[Path], vocab, vocab_size: int, walks: int) -> dict:
    """One case, in the calling process; returns its record (an undocumented exception is
    caught here and recorded, so that the run goes on)."""
    schema, instances, kind = make_case(seed, files)
    record = {"seed": seed, "kind": kind}
    try:
        constraint = compile_constraint(vocab, vocab_size, schema=schema)
    except testing.SCHEMA_ERRORS as e:
        return record | {"outcome": "documented", "error": type(e).__name__}
    except Exception as e:  # the bug this script looks for
        return record | {"outcome": "undocumented", "error": f"{type(e).__name__}: {e}"[:300]}
    rng = random.Random(seed)
    texts = [testing.random_text(constraint, rng) for _ in range(walks)]
    values = instances + [testing.random_value(rng) for _ in range(4)]
    for ensure_ascii in (False, True):
        texts += [json.dumps(v, separators=(",", ":"), ensure_ascii=ensure_ascii) for v in values]
    accepted = [t for t in texts if t is not None and constraint.accepts(t)]
    try:
        bad = testing.accepted_but_invalid(constraint, schema, accepted)
    except RecursionError:  # jsonschema recursing without end (a $ref cycle under not): no oracle
        return record | {"outcome": "unjudged", "accepted": len(accepted)}
    constraint.clear_caches()
    return (
        record
        | {
            "outcome": "compiled",
            "accepted": len(accepted),
            "invalid_accepted": len(bad),
            "examples": bad[:2],
        }
        | ({"schema": schema} if bad else {})
    )


def bounded(fn, hang_s: float) -> dict:
    """``fn()`` (a JSON record) in a forked child, so that a hang anywhere (the compile, a
    jsonschema ``pattern`` that backtracks) is stopped and counted."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)

    def target():
        child.send_bytes(json.dumps(fn()).encode())
        os._exit(0)

    proc = ctx.Process(target=target)
    proc.start()
    child.close()
    try:
        if not parent.poll(hang_s):
            return {"outcome": "hang"}
        return json.loads(parent.recv_bytes())
    except EOFError:  # the child died without a record: a crash of native code, or memory
        return {"outcome": "undocumented", "error": f"child died (exit {proc.exitcode})"}
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        parent.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--walks", type=int, default=8, help="random automaton texts per schema")
    ap.add_argument("--hang-s", type=float, default=60.0, help="a case longer than this hangs")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--summarize", action="store_true", help="summary of results.jsonl only")
    args = ap.parse_args()
    if args.summarize:  # e.g. of a run stopped early: its first N seeds are `--cases N`
        records = [json.loads(x) for x in (args.out / "results.jsonl").read_text().splitlines()]
        return write_summary(records, None, f"--cases {len(records)} (summarized)", args.out)
    files = sorted(p for p in DATA.glob("*.json"))
    tokenizer = testing.tiny_tokenizer()
    vocab = token_vocabulary(tokenizer)
    args.out.mkdir(parents=True, exist_ok=True)
    records, t0 = [], time.perf_counter()
    with open(args.out / "results.jsonl", "w") as log:
        for seed in range(args.first_seed, args.first_seed + args.cases):
            record = bounded(
                lambda s=seed: run_case(s, files, vocab, len(tokenizer), args.walks), args.hang_s
            ) | {"seed": seed}
            records.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()
    write_summary(records, time.perf_counter() - t0, " ".join(sys.argv[1:]), args.out)


def write_summary(records: list[dict], wall_s: float | None, argv: str, out: Path) -> None:
    summary = summarize(records) | {"wall_s": wall_s and round(wall_s)}
    summary["command"] = f"python benchmarks/fuzz.py {argv}"
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


def summarize(records: list[dict]) -> dict:
    outcomes = collections.Counter(r["outcome"] for r in records)
    compiled = [r for r in records if r["outcome"] == "compiled"]
    return {
        "cases": len(records),
        "by_kind": dict(collections.Counter(r.get("kind", "?") for r in records)),
        "compiled": outcomes["compiled"],
        "documented_errors": dict(
            collections.Counter(r["error"] for r in records if r["outcome"] == "documented")
        ),
        "undocumented_exceptions": outcomes["undocumented"],
        "hangs": outcomes["hang"],
        "unjudged": outcomes["unjudged"],  # jsonschema itself could not decide (RecursionError)
        "texts_accepted": sum(r["accepted"] for r in compiled),
        "invalid_accepted": sum(r["invalid_accepted"] for r in compiled),
        "failing_seeds": [
            r["seed"]
            for r in records
            if r["outcome"] in ("undocumented", "hang") or r.get("invalid_accepted")
        ][:50],
    }


if __name__ == "__main__":
    main()
