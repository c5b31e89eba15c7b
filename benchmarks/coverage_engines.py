"""Both constraint engines side by side on JSONSchemaBench (development half): llguidance on every
file, the regex engine read from coverage.py's committed per-file results (it takes ~1.5 s a
schema; rerunning it on 5,197 files takes hours on 2 shared cores).

Per file, for llguidance: cold compile (translate + grammar build, the tokenizer built once
beforehand), every test instance walked one byte token at a time (invalid ones also as the
tokenizer's tokens and ASCII-escaped, as coverage.py does), mask time at each state of the first
valid instance's tokenization (new states: nothing cached), and a few random walks over its byte
tokens whose texts must validate (fuzz); then the instances again with open_objects=True where
that changes the grammar. "auto" = llguidance, and where llguidance refuses a keyword, the regex
engine within its fallback budget (constrained_spec.guidance.compile_constraint; --time-auto
runs that path on every file). The held-out half: the files whose name's sha256 ends in an odd
byte (rules were chosen looking at the other half only; the dev set itself is the files whose
sha256 starts with an even byte, so the first byte cannot split it).

    python benchmarks/coverage_engines.py --data DEV --out benchmarks/results/coverage-engines
    python benchmarks/coverage_engines.py --report-only --out benchmarks/results/coverage-engines
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coverage import check_instances, make_oracle, pct, source_of  # noqa: E402

from constrained_spec import compile as compile_mod  # noqa: E402
from constrained_spec import guidance, guidance_schema  # noqa: E402
from constrained_spec.errors import UnsupportedSchemaError  # noqa: E402
from constrained_spec.models import load_tokenizer  # noqa: E402
from constrained_spec.vocab import token_vocabulary  # noqa: E402

REGEX_RESULTS = ROOT / "benchmarks/results/coverage-sample400/sample400.jsonl"


def half(name: str) -> str:
    """ "held-out" or "tuned": a split of the dev set by a hash of the file name."""
    return "held-out" if hashlib.sha256(name.encode()).digest()[-1] % 2 else "tuned"


def run_llguidance(schema: dict, tests: list, oracle, tok, vocab, fuzz_n: int) -> dict:
    t0 = time.perf_counter()
    try:
        grammar = guidance.schema_grammar(schema)
        constraint = guidance.GuidanceConstraint(grammar, vocab, len(tok), "schema")
    except UnsupportedSchemaError as e:
        return {"status": "refused", "keyword": e.keyword, "message": str(e)[:300]}
    except Exception as e:
        return {"status": "error", "message": f"{type(e).__name__}: {e}"[:300]}
    out = {"status": "compiled", "compile_s": round(time.perf_counter() - t0, 5)}
    try:
        out["mask_ms"] = mask_times(constraint, tests, tok)  # first: no state cached yet
        out |= check_instances(constraint, tests, oracle, tok)
        out |= fuzz(constraint, oracle, fuzz_n)
        out |= with_open_objects(schema, grammar, tests, oracle, tok, vocab)
    except Exception as e:  # a limit hit while stepping: reported, counted as an error
        out |= {"status": "error", "message": f"walk: {type(e).__name__}: {e}"[:300]}
    return out


def with_open_objects(schema: dict, closed: str, tests: list, oracle, tok, vocab) -> dict:
    """The instances walked again under open_objects=True where that changes the grammar
    ("open": "same" where it does not, "error" where llguidance cannot compile it so)."""
    try:
        grammar = guidance.schema_grammar(schema, open_objects=True)
        if grammar == closed:
            return {"open": "same"}
        c = guidance.GuidanceConstraint(grammar, vocab, len(tok), "schema")
        counts = check_instances(c, tests, oracle, tok)
    except Exception as e:
        return {"open": "error", "open_message": f"{type(e).__name__}: {e}"[:200]}
    return {"open": "walked"} | {f"{k}_open": v for k, v in counts.items() if "examples" not in k}


def fuzz(c, oracle, n: int, max_len: int = 200) -> dict:
    rng, bad, done = random.Random(0), [], 0
    byte_ids = sorted(c._byte_ids.items())
    for _ in range(n):
        state, text = c.initial_state, bytearray()
        for _ in range(max_len):
            if c.accepting(state) and rng.random() < 0.25:
                break
            legal = c._unpack([c._legal_bits(state)])[0]
            options = [(b, t) for b, t in byte_ids if legal[t]]
            if not options:
                break
            b, t = rng.choice(options)
            text.append(b)
            state = c.step(state, t)
        if not c.accepting(state):
            continue
        done += 1
        try:
            ok = oracle(json.loads(text.decode()))
        except ValueError:
            ok = False
        if not ok:
            bad.append(text.decode(errors="replace")[:200])
    return {"fuzz_texts": done, "fuzz_invalid": len(bad)} | (
        {"fuzz_examples": bad[:3]} if bad else {}
    )


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


def summarize(rs: list[dict]) -> dict:
    status = collections.Counter(r["status"] for r in rs)
    total = lambda k: sum(r.get(k, 0) for r in rs)  # noqa: E731
    opened = [r for r in rs if "open" in r]
    open_total = lambda k: sum(  # noqa: E731
        r.get(f"{k}_open", 0) if r["open"] == "walked" else r.get(k, 0) * (r["open"] == "same")
        for r in opened
    )
    ctime = [r["compile_s"] for r in rs if r["status"] == "compiled"]
    masks = [m for r in rs for m in r.get("mask_ms", [])]
    refused = collections.Counter(r.get("keyword", "?") for r in rs if r["status"] == "refused")
    return {
        "files": len(rs),
        "status": dict(status),
        "refused_by_keyword": dict(refused.most_common()),
        "invalid_accepted": total("invalid_accepted"),
        "invalid_rejected": total("invalid_rejected"),
        "valid_accepted": total("valid_accepted"),
        "valid_rejected": total("valid_rejected"),
        "open": {
            "files": len(opened),
            "errors": sum(r["open"] == "error" for r in opened),
            "invalid_accepted": open_total("invalid_accepted"),
            "valid_accepted": open_total("valid_accepted"),
            "valid": sum(r.get("valid_accepted", 0) + r.get("valid_rejected", 0) for r in opened),
        },
        "fuzz_texts": total("fuzz_texts"),
        "fuzz_invalid": total("fuzz_invalid"),
        "compile_ms": {q: round(1000 * pct(ctime, v), 2) for q, v in (("p50", 0.5), ("p99", 0.99))},
        "mask_ms": {"p50": pct(masks, 0.5), "p99": pct(masks, 0.99), "n": len(masks)},
    }


def auto_record(llg: dict, regex: dict | None, timed: dict | None) -> dict | None:
    """What "auto" does with a file: llguidance's result; where llguidance refused or failed to
    compile (guidance.compile_constraint), the regex engine's, as the --time-auto run found it
    (refused, or past the fallback budget) or, where that compiled, the committed regex run's
    walk; None where no result is at hand. A limit hit while walking (message "walk: ...")
    happens mid-generation."""
    if llg["status"] == "compiled" or llg.get("message", "").startswith("walk"):
        return llg
    if timed is not None and timed["status"] != "compiled":
        return {"status": FAILED.get(timed["status"], "error"), "keyword": timed.get("keyword")}
    return None if regex is None else regex | {"compile_s": regex.get("compile_s", 0)}


FAILED = {"UnsupportedSchemaError": "refused", "SchemaTooComplex": "too_complex"}


def report(records: list[dict], out_dir: Path, command: str) -> None:
    regex_by_file = {}
    if REGEX_RESULTS.exists():
        for line in REGEX_RESULTS.read_text().splitlines():
            r = json.loads(line)
            if "ours" in r:
                regex_by_file[r["file"]] = r["ours"] | {
                    "compile_s": r["ours"].get("translate_s", 0) + r["ours"].get("compile_s", 0)
                }
    timed_path = out_dir / AUTO_TIMES
    timed = (
        [json.loads(x) for x in timed_path.read_text().splitlines()] if timed_path.exists() else []
    )
    timed_by_file = {r["file"]: r for r in timed}
    usable = [r for r in records if "llguidance" in r]
    held_out = [r for r in usable if half(r["file"]) == "held-out"]
    sample = [r for r in usable if r["file"] in regex_by_file]
    auto = lambda r: auto_record(
        r["llguidance"], regex_by_file[r["file"]], timed_by_file.get(r["file"])
    )  # noqa: E731
    columns = {
        f"llguidance, all {len(usable)}": summarize([r["llguidance"] for r in usable]),
        f"llguidance, held-out half {len(held_out)}": summarize(
            [r["llguidance"] for r in held_out]
        ),
        f"llguidance, sample {len(sample)}": summarize([r["llguidance"] for r in sample]),
        f"regex engine, sample {len(sample)}": summarize(
            [regex_by_file[r["file"]] for r in sample]
        ),
        f"auto, sample {len(sample)}": summarize([a for r in sample if (a := auto(r))]),
    }
    (out_dir / "summary.json").write_text(json.dumps({"command": command} | columns, indent=1))
    lines = [
        f"# Constraint engines on jsonschemabench-dev ({len(records)} files)",
        "",
        f"Command: `{command}`",
        "",
        "llguidance: run here on every file (the held-out half: files whose name's sha256 ends "
        "in an odd byte, not looked at while choosing rules). Regex engine: the committed "
        f"per-file results of `{REGEX_RESULTS.relative_to(ROOT)}` (coverage.py, 10 s / 6 GB "
        "bound per schema; its compile = translate + index build). Auto: llguidance, else the "
        f"regex engine as `--time-auto` ran it (`{AUTO_TIMES}`: refused, past the fallback "
        "budget, or compiled, then counted with the committed walk). Instances judged by "
        "jsonschema with its format checker; texts are compact JSON walked one byte token at "
        "a time. Open objects: the same walk with `open_objects=True`, where that changes the "
        "grammar.",
        "",
        "| | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    rows = [
        ("compiled", lambda s: _rate(s, "compiled")),
        ("refused (named keyword)", lambda s: _rate(s, "refused")),
        ("too complex (bound hit)", lambda s: _rate(s, "too_complex")),
        ("other errors", lambda s: _rate(s, "error") + " / " + _rate(s, "invalid_schema")),
        ("**invalid instances accepted**", lambda s: str(s["invalid_accepted"])),
        ("invalid instances rejected", lambda s: str(s["invalid_rejected"])),
        ("valid instances accepted", lambda s: _share(s)),
        ("valid accepted, open_objects=True", _open_share),
        ("invalid accepted, open_objects=True", lambda s: _open(s, "invalid_accepted")),
        ("fuzz texts / invalid among them", lambda s: f"{s['fuzz_texts']} / {s['fuzz_invalid']}"),
        (
            "cold compile ms p50 / p99",
            lambda s: f"{s['compile_ms']['p50']} / {s['compile_ms']['p99']}",
        ),
        ("mask ms p50 / p99", lambda s: f"{s['mask_ms']['p50']:.3g} / {s['mask_ms']['p99']:.3g}"),
    ]
    for label, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(fmt(s) for s in columns.values()) + " |")
    for name, s in columns.items():
        refused = ", ".join(f"`{k}` {v}" for k, v in s["refused_by_keyword"].items())
        lines += ["", f"Refused by keyword ({name}): {refused or 'none'}"]
    if timed:
        lines += [
            "",
            f"Auto's cold compile end to end (`{AUTO_TIMES}`, `--time-auto`: "
            "guidance.compile_constraint as a user calls it, current code, each file cold, the "
            "per-tokenizer tables built beforehand; compiled files only, as in the table):",
            "",
            "| files | compiled | ms p50 | ms p99 | max s | slowest |",
            "|---|---|---|---|---|---|",
        ]
        sets = {
            f"all {len(timed)}": timed,
            "held-out half": [r for r in timed if half(r["file"]) == "held-out"],
            f"sample {len(sample)}": [r for r in timed if r["file"] in regex_by_file],
        }
        for name, rows_ in sets.items():
            ok = [r["s"] for r in rows_ if r["status"] == "compiled"]
            slow = sorted(rows_, key=lambda r: -r["s"])[:3]
            lines.append(
                f"| {name} | {len(ok)} of {len(rows_)} | {1000 * pct(ok, 0.5):.1f} | "
                f"{1000 * pct(ok, 0.99):.1f} | {max(ok):.2f} | "
                + ", ".join(f"{r['file']} {r['s']:.2f} s ({r['status']})" for r in slow)
                + " |"
            )
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")


def _open(s, key):
    return str(s["open"][key]) if s["open"]["files"] else "–"


def _open_share(s):
    o = s["open"]
    if not o["files"]:
        return "–"
    errors = f" ({o['errors']} files llguidance cannot compile open)" if o["errors"] else ""
    return f"{o['valid_accepted']}/{o['valid']} ({100 * o['valid_accepted'] / max(o['valid'], 1):.1f}%){errors}"


def _rate(s, key):
    n = s["status"].get(key, 0)
    return f"{n} ({100 * n / max(s['files'], 1):.1f}%)"


def _share(s):
    n = s["valid_accepted"] + s["valid_rejected"]
    return f"{s['valid_accepted']}/{n} ({100 * s['valid_accepted'] / max(n, 1):.1f}%)"


AUTO_TIMES = "auto-times.jsonl"


def warm_up(vocab) -> None:
    """What a process builds once per tokenizer (cached), not per compile: llguidance's
    tokenizer, outlines-core's vocabulary, Python's \\s as code point ranges."""
    t0 = time.perf_counter()
    guidance._ll_tokenizer(vocab)
    compile_mod._outlines_vocabulary(vocab)
    guidance_schema._category("\\s")
    print(f"per-tokenizer tables built in {time.perf_counter() - t0:.2f} s", flush=True)


def time_auto(paths: list[Path], out: Path, tok, vocab) -> None:
    """Cold compile through the path a user takes (guidance.compile_constraint with
    engine="auto": llguidance, else the regex engine in its bounded child within the fallback
    budget; no disk cache), per file, on the current code."""
    with out.open("w") as f:
        for path in paths:  # each file once: the in-process memos never hit
            schema = json.loads(path.read_text())["schema"]
            t0 = time.perf_counter()
            row = {"file": path.name, "status": "compiled"}
            try:
                guidance.compile_constraint("auto", vocab, len(tok), None, schema=schema)
            except Exception as e:  # refused, too complex, or broken: not a compile time
                row |= {"status": type(e).__name__, "keyword": getattr(e, "keyword", None)}
            row["s"] = time.perf_counter() - t0
            f.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data" / "sample")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/coverage-engines")
    ap.add_argument("--limit", type=int, help="at most N files")
    ap.add_argument("--fuzz", type=int, default=2, help="random walks per schema")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument(
        "--time-auto",
        action="store_true",
        help=f"only time engine='auto' compiles of every file ({AUTO_TIMES})",
    )
    args = ap.parse_args()
    command = "python benchmarks/coverage_engines.py " + " ".join(sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    if args.time_auto:
        tok = load_tokenizer()
        vocab = token_vocabulary(tok)
        warm_up(vocab)
        time_auto(sorted(args.data.glob("*.json"))[: args.limit], args.out / AUTO_TIMES, tok, vocab)
    elif not args.report_only:
        files = sorted(args.data.glob("*.json"))[: args.limit]
        tok = load_tokenizer()
        vocab = token_vocabulary(tok)
        warm_up(vocab)
        with results.open("w") as out:
            for i, path in enumerate(files):
                d = json.loads(path.read_text())
                rec = {"file": path.name, "source": source_of(path.name)}
                oracle = make_oracle(d["schema"])
                if oracle is not None:
                    rec["llguidance"] = run_llguidance(
                        d["schema"], d["tests"], oracle, tok, vocab, args.fuzz
                    )
                out.write(json.dumps(rec, separators=(",", ":")) + "\n")
                if i % 100 == 0:
                    print(f"[{i}/{len(files)}] {path.name}", flush=True)
    records = [json.loads(x) for x in results.read_text().splitlines()]
    report(records, args.out, command)
    print((args.out / "report.md").read_text())


if __name__ == "__main__":
    main()
