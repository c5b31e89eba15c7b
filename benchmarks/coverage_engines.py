"""Both constraint engines side by side on JSONSchemaBench (development half): llguidance on every
file, the regex engine read from coverage.py's committed per-file results (it takes ~1.5 s a
schema; rerunning it on 5,197 files takes hours on 2 shared cores).

Per file, for llguidance: cold compile (translate + grammar build, the tokenizer built once
beforehand), every test instance walked one byte token at a time (invalid ones also as the
tokenizer's tokens and ASCII-escaped, as coverage.py does), mask time at each state of the first
valid instance's tokenization (new states: nothing cached), and a few random walks over its byte
tokens whose texts must validate (fuzz). "auto" = llguidance, and where llguidance refuses a
keyword, the regex engine (constrained_spec.guidance.translate).

    python benchmarks/coverage_engines.py --data DEV --out benchmarks/results/coverage-engines
    python benchmarks/coverage_engines.py --report-only --out benchmarks/results/coverage-engines
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coverage import check_instances, make_oracle, pct, source_of  # noqa: E402

from constrained_spec import guidance  # noqa: E402
from constrained_spec.errors import UnsupportedSchemaError  # noqa: E402
from constrained_spec.models import load_tokenizer  # noqa: E402
from constrained_spec.vocab import token_vocabulary  # noqa: E402

REGEX_RESULTS = ROOT / "benchmarks/results/coverage-sample400/sample400.jsonl"


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
    except Exception as e:  # a limit hit while stepping: reported, counted as an error
        out |= {"status": "error", "message": f"walk: {type(e).__name__}: {e}"[:300]}
    return out


def fuzz(c, oracle, n: int, max_len: int = 200) -> dict:
    rng, bad, done = random.Random(0), [], 0
    byte_ids = sorted(c._byte_ids.items())
    for _ in range(n):
        state, text = c.initial_state, bytearray()
        for _ in range(max_len):
            if c.accepting(state) and rng.random() < 0.25:
                break
            legal = c._legal_mask(state)
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
        "fuzz_texts": total("fuzz_texts"),
        "fuzz_invalid": total("fuzz_invalid"),
        "compile_ms": {q: round(1000 * pct(ctime, v), 2) for q, v in (("p50", 0.5), ("p99", 0.99))},
        "mask_ms": {"p50": pct(masks, 0.5), "p99": pct(masks, 0.99), "n": len(masks)},
    }


def auto_record(llg: dict, regex: dict | None) -> dict | None:
    """What "auto" does with a file: llguidance's result, or the regex engine's where
    llguidance refused or failed to compile (guidance.compile_constraint); None where that result
    is not at hand. A limit hit while walking (message "walk: ...") happens mid-generation."""
    if llg["status"] == "compiled" or llg.get("message", "").startswith("walk"):
        return llg
    return None if regex is None else regex | {"compile_s": regex.get("compile_s", 0)}


def report(records: list[dict], out_dir: Path, command: str) -> None:
    regex_by_file = {}
    if REGEX_RESULTS.exists():
        for line in REGEX_RESULTS.read_text().splitlines():
            r = json.loads(line)
            if "ours" in r:
                regex_by_file[r["file"]] = r["ours"] | {
                    "compile_s": r["ours"].get("translate_s", 0) + r["ours"].get("compile_s", 0)
                }
    usable = [r for r in records if "llguidance" in r]
    sample = [r for r in usable if r["file"] in regex_by_file]
    columns = {
        f"llguidance, all {len(usable)}": summarize([r["llguidance"] for r in usable]),
        f"llguidance, sample {len(sample)}": summarize([r["llguidance"] for r in sample]),
        f"regex engine, sample {len(sample)}": summarize(
            [regex_by_file[r["file"]] for r in sample]
        ),
        f"auto, sample {len(sample)}": summarize(
            [a for r in sample if (a := auto_record(r["llguidance"], regex_by_file[r["file"]]))]
        ),
    }
    (out_dir / "summary.json").write_text(json.dumps({"command": command} | columns, indent=1))
    lines = [
        f"# Constraint engines on jsonschemabench-dev ({len(records)} files)",
        "",
        f"Command: `{command}`",
        "",
        "llguidance: run here on every file. Regex engine: the committed per-file results of "
        f"`{REGEX_RESULTS.relative_to(ROOT)}` (coverage.py, 10 s / 6 GB bound per schema; its "
        "compile = translate + index build). Instances judged by jsonschema with its format "
        "checker; texts are compact JSON walked one byte token at a time.",
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
    timed = out_dir / AUTO_TIMES
    if timed.exists():
        rows = [json.loads(x) for x in timed.read_text().splitlines()]
        ok = [r["s"] for r in rows if r["status"] == "compiled"]
        slow = sorted(rows, key=lambda r: -r["s"])[:5]
        lines += [
            "",
            f"Auto's cold compile measured end to end (`{AUTO_TIMES}`, `--time-auto`: "
            "guidance.compile_constraint, current code, each file cold): "
            f"{len(ok)} of {len(rows)} compiled, p50 {1000 * pct(ok, 0.5):.1f} ms, "
            f"p99 {1000 * pct(ok, 0.99):.1f} ms; slowest: "
            + ", ".join(f"{r['file']} {r['s']:.2f} s ({r['status']})" for r in slow),
        ]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")


def _rate(s, key):
    n = s["status"].get(key, 0)
    return f"{n} ({100 * n / max(s['files'], 1):.1f}%)"


def _share(s):
    n = s["valid_accepted"] + s["valid_rejected"]
    return f"{s['valid_accepted']}/{n} ({100 * s['valid_accepted'] / max(n, 1):.1f}%)"


AUTO_TIMES = "auto-times.jsonl"


def time_auto(paths: list[Path], out: Path, tok, vocab) -> None:
    """Cold compile through the path a user takes (guidance.compile_constraint with
    engine="auto": llguidance, else the regex engine in its bounded child; no disk cache), per
    file, on the current code: the auto column's compile times, where the combined column reads
    the regex engine's from its committed (older, busier) run."""
    with out.open("w") as f:
        for path in paths:  # each file once: the in-process memos never hit
            schema = json.loads(path.read_text())["schema"]
            t0 = time.perf_counter()
            try:
                guidance.compile_constraint("auto", vocab, len(tok), None, schema=schema)
                status = "compiled"
            except Exception as e:  # refused, too complex, or broken: not a compile time
                status = type(e).__name__
            row = {"file": path.name, "status": status, "s": time.perf_counter() - t0}
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
        help=f"only time engine='auto' compiles of the regex sample's files ({AUTO_TIMES})",
    )
    args = ap.parse_args()
    command = "python benchmarks/coverage_engines.py " + " ".join(sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    if args.time_auto:
        names = {json.loads(x)["file"] for x in REGEX_RESULTS.read_text().splitlines()}
        tok = load_tokenizer()
        vocab = token_vocabulary(tok)
        guidance._ll_tokenizer(vocab)
        paths = [p for p in sorted(args.data.glob("*.json")) if p.name in names]
        time_auto(paths, args.out / AUTO_TIMES, tok, vocab)
    elif not args.report_only:
        files = sorted(args.data.glob("*.json"))[: args.limit]
        tok = load_tokenizer()
        vocab = token_vocabulary(tok)
        t0 = time.perf_counter()
        guidance._ll_tokenizer(vocab)  # once per tokenizer, cached: not part of a compile
        print(f"llguidance tokenizer built in {time.perf_counter() - t0:.2f} s", flush=True)
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
