"""Schema coverage and soundness on JSONSchemaBench (its development half): every file compiled
as a user compiles it, every test instance walked through the automaton, random texts the
automaton accepts checked against jsonschema.

Per file: the cold compile end to end (``compile_constraint``: the schema checked, rewritten in
llguidance's terms, compiled, its first mask; the per-tokenizer tables built once beforehand),
every test instance walked one byte token at a time (invalid ones also as the tokenizer's tokens
and ASCII-escaped, so that no spelling can hide an accept), the mask time at each state of the
first valid instance's tokenization (new states: nothing cached), a few random walks over the
byte tokens whose texts must validate (fuzz), and the instances again with open_objects=True
where that changes the grammar. Instances are judged by jsonschema with its format checker. The
held-out half: the files whose name's sha256 ends in an odd byte (the rewriting rules were chosen
looking at the other half only).

``fuzz``: the schema compiler on random schemas and mutated dev schemas, thousands of them. Each
case builds a schema from its seed (even seeds: testing.random_schema; odd seeds: one
testing.mutate_schema change to a file of --data, the committed sample by default), compiles it
against the tiny byte-level test tokenizer and then checks, in a forked child (so that a hang is
caught):
    the compile returns a constraint or raises a documented error (ConstraintError and its
      subclasses); any other exception is an "undocumented exception" (goal 0);
    every text the automaton accepts validates with jsonschema: random walks over the automaton,
      the dev file's own test instances (valid and invalid) and small random JSON values; an
      accepted text that jsonschema rejects is "invalid accepted" (goal 0);
    the case finishes within --hang-s (goal 0 "hangs");
    a case whose texts jsonschema itself cannot judge (it recurses without end) is "unjudged".

    python benchmarks/coverage.py --data ../shared/data/jsonschemabench-dev --out OUT
    python benchmarks/coverage.py --report-only --out OUT
    python benchmarks/coverage.py fuzz --cases 2000 --out benchmarks/results/fuzz
    python benchmarks/coverage.py fuzz --report-only --out benchmarks/results/fuzz  # results.jsonl
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from constrained_spec import testing  # noqa: E402
from constrained_spec.constraints import compile_constraint, engine, patterns, token_vocabulary  # noqa: E402
from constrained_spec.errors import SchemaTooComplex, UnsupportedSchemaError  # noqa: E402
from constrained_spec.model import load_tokenizer  # noqa: E402


def source_of(name: str) -> str:
    return name.split("---")[0] if "---" in name else name.rsplit("_", 1)[0]


def half(name: str) -> str:
    """ "held-out" or "tuned": a split of the dev set by a hash of the file name."""
    return "held-out" if hashlib.sha256(name.encode()).digest()[-1] % 2 else "tuned"


def make_oracle(schema: dict):
    """jsonschema's verdict on an instance (no $ref fetched), or None if it cannot judge."""
    try:
        validator = testing.schema_validator(schema)
    except Exception:
        return None

    def oracle(x) -> bool:
        try:
            return validator.is_valid(x)
        except Exception:  # e.g. an unresolvable reference
            return False

    return oracle


def run_file(schema: dict, tests: list, oracle, tok, vocab, walks: int) -> dict:
    t0 = time.perf_counter()
    try:
        constraint = compile_constraint(vocab, len(tok), schema=schema)
    except UnsupportedSchemaError as e:
        return {"status": "refused", "keyword": e.keyword, "s": time.perf_counter() - t0}
    except SchemaTooComplex as e:
        return {"status": "too_complex", "message": str(e)[:300], "s": time.perf_counter() - t0}
    except Exception as e:  # invalid schemas, unsatisfiable ones: named errors, not compiles
        message = f"{type(e).__name__}: {e}"[:300]
        return {"status": "error", "message": message, "s": time.perf_counter() - t0}
    out = {"status": "compiled", "s": time.perf_counter() - t0}
    try:
        out["mask_ms"] = mask_times(constraint, tests, tok)  # first: no state cached yet
        out |= check_instances(constraint, tests, oracle, tok)
        out |= random_walks(constraint, oracle, walks)
        out |= with_open_objects(schema, tests, oracle, tok, vocab)
    except Exception as e:  # a limit hit while stepping: reported, counted as an error
        out |= {"status": "error", "message": f"walk: {type(e).__name__}: {e}"[:300]}
    return out


def check_instances(c, tests, oracle, tok) -> dict:
    r, examples = collections.Counter(), []
    for t in tests:
        text = json.dumps(t["data"], separators=(",", ":"), ensure_ascii=False)
        if oracle(t["data"]):
            r["valid_accepted" if c.accepts(text) else "valid_rejected"] += 1
            continue
        ascii_text = json.dumps(t["data"], separators=(",", ":"))
        ids = tok.encode(text, add_special_tokens=False)
        if c.accepts(text) or c.accepts(ascii_text) or c.accepts_tokens(ids):
            r["invalid_accepted"] += 1
            examples.append(text[:200])
        else:
            r["invalid_rejected"] += 1
    return dict(r) | ({"invalid_examples": examples[:3]} if examples else {})


def random_walks(c, oracle, n: int) -> dict:
    """Texts of random walks over the automaton's byte tokens: every one must validate."""
    rng, bad, done = random.Random(0), [], 0
    for _ in range(n):
        text = testing.random_text(c, rng)
        if text is None:
            continue
        done += 1
        try:
            ok = oracle(json.loads(text))
        except ValueError:
            ok = False
        if not ok:
            bad.append(text[:200])
    return {"fuzz_texts": done, "fuzz_invalid": len(bad)} | ({"fuzz_examples": bad} if bad else {})


def with_open_objects(schema: dict, tests: list, oracle, tok, vocab) -> dict:
    """The instances again under open_objects=True where that changes the grammar."""
    try:
        if engine.grammar_for(open_objects=True, schema=schema) == engine.grammar_for(
            schema=schema
        ):
            return {"open": "same"}
        c = compile_constraint(vocab, len(tok), open_objects=True, schema=schema)
        counts = check_instances(c, tests, oracle, tok)
    except Exception as e:
        return {"open": "error", "open_message": f"{type(e).__name__}: {e}"[:200]}
    return {"open": "walked"} | {f"{k}_open": v for k, v in counts.items() if "examples" not in k}


def mask_times(c, tests, tok, max_states: int = 32) -> list[float]:
    valid = [t for t in tests if t["valid"]]
    if not valid:
        return []
    text = json.dumps(valid[0]["data"], separators=(",", ":"), ensure_ascii=False)
    times, state = [], c.initial_state
    for token in tok.encode(text, add_special_tokens=False)[:max_states]:
        t0 = time.perf_counter()
        c.mask(state)
        times.append(round((time.perf_counter() - t0) * 1000, 4))
        state = c.step(state, token)
        if state is None:
            break
    return times


# --- report ------------------------------------------------------------------------------------


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.floor(q * len(xs)))] if xs else float("nan")


def summarize(rs: list[dict]) -> dict:
    status = collections.Counter(r["status"] for r in rs)
    total = lambda k: sum(r.get(k, 0) for r in rs)  # noqa: E731
    opened = [r for r in rs if "open" in r]
    open_total = lambda k: sum(  # noqa: E731
        r.get(f"{k}_open", 0) if r["open"] == "walked" else r.get(k, 0) * (r["open"] == "same")
        for r in opened
    )
    ctime = [r["s"] for r in rs if r["status"] == "compiled"]
    masks = [m for r in rs for m in r.get("mask_ms", [])]
    refused = collections.Counter(r["keyword"] for r in rs if r["status"] == "refused")
    return {
        "files": len(rs),
        "status": dict(status),
        "refused_by_keyword": dict(refused.most_common()),
        "invalid_accepted": total("invalid_accepted"),
        "invalid_rejected": total("invalid_rejected"),
        "valid_accepted": total("valid_accepted"),
        "valid_rejected": total("valid_rejected"),
        "open": {
            "errors": sum(r["open"] == "error" for r in opened),
            "invalid_accepted": open_total("invalid_accepted"),
            "valid_accepted": open_total("valid_accepted"),
            "valid": sum(r.get("valid_accepted", 0) + r.get("valid_rejected", 0) for r in opened),
        },
        "fuzz_texts": total("fuzz_texts"),
        "fuzz_invalid": total("fuzz_invalid"),
        "compile_ms": {
            "p50": round(1000 * pct(ctime, 0.5), 2),
            "p99": round(1000 * pct(ctime, 0.99), 2),
            "max": round(1000 * max(ctime, default=math.nan), 1),
        },
        "mask_ms": {"p50": pct(masks, 0.5), "p99": pct(masks, 0.99), "n": len(masks)},
    }


def report(records: list[dict], out_dir: Path, command: str) -> None:
    usable = [r for r in records if "result" in r]
    columns = {
        f"all {len(usable)}": summarize([r["result"] for r in usable]),
        "held-out half": summarize([r["result"] for r in usable if half(r["file"]) == "held-out"]),
    }
    (out_dir / "summary.json").write_text(json.dumps({"command": command} | columns, indent=1))
    lines = [
        f"# Schema coverage on jsonschemabench-dev ({len(records)} files)",
        "",
        f"Command: `{command}`",
        "",
        f"{len(records) - len(usable)} files left out: jsonschema itself cannot judge their "
        "instances. Instances judged by jsonschema with its format checker; texts are compact "
        "JSON walked one byte token at a time. Compile: `compile_constraint` end to end, cold.",
        "",
        "| | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    rows = [
        ("compiled", lambda s: _rate(s, "compiled")),
        ("refused (named keyword)", lambda s: _rate(s, "refused")),
        ("too complex for llguidance", lambda s: _rate(s, "too_complex")),
        ("other errors (invalid or unsatisfiable schemas)", lambda s: _rate(s, "error")),
        ("**invalid instances accepted**", lambda s: str(s["invalid_accepted"])),
        ("invalid instances rejected", lambda s: str(s["invalid_rejected"])),
        ("valid instances accepted", _share),
        ("valid accepted, open_objects=True", _open_share),
        ("invalid accepted, open_objects=True", lambda s: str(s["open"]["invalid_accepted"])),
        ("fuzz texts / invalid among them", lambda s: f"{s['fuzz_texts']} / {s['fuzz_invalid']}"),
        ("compile ms p50 / p99 / max", lambda s: " / ".join(map(str, s["compile_ms"].values()))),
        ("mask ms p50 / p99", lambda s: f"{s['mask_ms']['p50']:.3g} / {s['mask_ms']['p99']:.3g}"),
    ]
    for label, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(fmt(s) for s in columns.values()) + " |")
    for name, s in columns.items():
        refused = ", ".join(f"`{k}` {v}" for k, v in s["refused_by_keyword"].items())
        lines += ["", f"Refused by keyword ({name}): {refused or 'none'}"]
    slow = sorted(usable, key=lambda r: -r["result"]["s"])[:5]
    lines += [
        "",
        "Slowest compiles: "
        + ", ".join(
            f"{r['file']} {r['result']['s']:.2f} s ({r['result']['status']})" for r in slow
        ),
    ]
    errors = collections.Counter(
        r["result"]["message"].split(": ", 1)[-1][:90]
        for r in usable
        if r["result"]["status"] in ("error", "too_complex")
    )
    lines += ["", "Errors, by message:", ""] + [f"- {n} × {m}" for m, n in errors.most_common()]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")


def _rate(s, key):
    n = s["status"].get(key, 0)
    return f"{n} ({100 * n / max(s['files'], 1):.1f}%)"


def _share(s):
    n = s["valid_accepted"] + s["valid_rejected"]
    return f"{s['valid_accepted']}/{n} ({100 * s['valid_accepted'] / max(n, 1):.1f}%)"


def _open_share(s):
    o = s["open"]
    errors = f" ({o['errors']} files cannot compile open)" if o["errors"] else ""
    return f"{o['valid_accepted']}/{o['valid']} ({100 * o['valid_accepted'] / max(o['valid'], 1):.1f}%){errors}"


# --- fuzz ---------------------------------------------------------------------------------------


def make_fuzz_case(seed: int, files: list[Path]) -> tuple[dict, list, str]:
    """(schema, candidate instances from its dev file, kind) for this seed."""
    rng = random.Random(seed)
    if seed % 2 == 0:
        return testing.random_schema(rng), [], "random"
    d = json.loads(rng.choice(files).read_text())
    return testing.mutate_schema(d["schema"], rng), [t["data"] for t in d["tests"]], "mutated"


def fuzz_case(seed: int, files: list[Path], vocab, vocab_size: int, walks: int) -> dict:
    """One case, in the calling process; returns its record (an undocumented exception is
    caught here and recorded, so that the run goes on)."""
    schema, instances, kind = make_fuzz_case(seed, files)
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


def write_fuzz_summary(records: list[dict], wall_s: float | None, command: str, out: Path) -> None:
    summary = fuzz_summary(records) | {"wall_s": wall_s and round(wall_s)}
    summary["command"] = command
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


def fuzz_summary(records: list[dict]) -> dict:
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


def run_dev(args, command: str) -> None:
    """Every file of --data (results.jsonl), then report.md and summary.json."""
    results = args.out / "results.jsonl"
    if not args.report_only:
        files = sorted(args.data.glob("*.json"))[: args.limit]
        tok = load_tokenizer()
        vocab = token_vocabulary(tok)
        t0 = time.perf_counter()  # what a process builds once per tokenizer, not per compile
        engine.compile_constraint(vocab, len(tok), regex="a")
        patterns.rust_pattern("\\s", "")
        print(f"per-tokenizer tables built in {time.perf_counter() - t0:.2f} s", flush=True)
        with results.open("w") as out:
            for i, path in enumerate(files):
                d = json.loads(path.read_text())
                record = {"file": path.name, "source": source_of(path.name)}
                oracle = make_oracle(d["schema"])
                if oracle is not None:
                    record["result"] = run_file(
                        d["schema"], d["tests"], oracle, tok, vocab, args.walks
                    )
                out.write(json.dumps(record, separators=(",", ":")) + "\n")
                if i % 250 == 0:
                    print(f"[{i}/{len(files)}] {path.name}", flush=True)
    records = [json.loads(x) for x in results.read_text().splitlines()]
    report(records, args.out, command)
    print((args.out / "report.md").read_text())


def run_fuzz(args, command: str) -> None:
    """--cases seeded cases (results.jsonl, one record per case), then summary.json."""
    if args.report_only:  # e.g. of a run stopped early: its first N seeds are `--cases N`
        records = [json.loads(x) for x in (args.out / "results.jsonl").read_text().splitlines()]
        return write_fuzz_summary(
            records, None, f"{command} ({len(records)} cases summarized)", args.out
        )
    files = sorted(p for p in args.data.glob("*.json"))
    tokenizer = testing.tiny_tokenizer()
    vocab = token_vocabulary(tokenizer)
    records, t0 = [], time.perf_counter()
    with open(args.out / "results.jsonl", "w") as log:
        for seed in range(args.first_seed, args.first_seed + args.cases):
            record = bounded(
                lambda s=seed: fuzz_case(s, files, vocab, len(tokenizer), args.walks), args.hang_s
            ) | {"seed": seed}
            records.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()
    write_fuzz_summary(records, time.perf_counter() - t0, command, args.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = "dev: every file of --data (the default); fuzz: seeded random and mutated schemas"
    ap.add_argument("mode", nargs="?", choices=("dev", "fuzz"), default="dev", help=modes)
    ap.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data" / "sample")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--walks", type=int, help="random automaton texts per schema (2; fuzz: 8)")
    ap.add_argument("--report-only", action="store_true", help="from the results.jsonl there")
    ap.add_argument("--limit", type=int, help="at most N files")
    fuzz = ap.add_argument_group("fuzz")
    fuzz.add_argument("--cases", type=int, default=2000)
    fuzz.add_argument("--first-seed", type=int, default=0)
    fuzz.add_argument("--hang-s", type=float, default=60.0, help="a case longer than this hangs")
    args = ap.parse_args()
    if args.walks is None:  # fuzz's schemas are small: more walks each
        args.walks = 8 if args.mode == "fuzz" else 2
    command = "python benchmarks/coverage.py " + " ".join(sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (run_fuzz if args.mode == "fuzz" else run_dev)(args, command)


if __name__ == "__main__":
    main()
