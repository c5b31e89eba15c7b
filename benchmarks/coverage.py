"""JSON Schema coverage and soundness on real schemas (JSONSchemaBench, development half).

For every schema file: translate it (constrained_spec.schema) and compile it against the default
tokenizer with a time and memory bound; then walk every test instance through the automaton:
    invalid instance accepted  -> invalidation error (must be 0: the compiler is unsound)
    valid instance rejected    -> validation error (a completeness gap, reported)
"valid" is decided by jsonschema with its format checker (the dataset labels are reported where
they disagree). An instance is serialised as the compiler emits JSON, ``json.dumps`` with
``separators=(",", ":")``; invalid ones are also tried with ``ensure_ascii=True`` and as the
tokenizer's own tokenization, and every text is walked one byte token at a time, so no
tokenization choice can hide an accept. A few texts sampled at random from each automaton are
parsed and validated as well (fuzz). The same is done for raw outlines-core
``build_regex_from_schema``. One schema at a time (one worker), each step in a bounded child.

    python benchmarks/coverage.py --out /tmp/coverage     # the 48 committed sample files
    python benchmarks/coverage.py --data DEV --sample 400 # stratified sample of the dev set
    python benchmarks/coverage.py --data DEV              # all 5,197 files (hours on 2 cores)
    python benchmarks/coverage.py --data DEV --translate-only --results all.jsonl \
        --out benchmarks/results/coverage-translate       # every file, translation only (~10 min)
    python benchmarks/coverage.py --report-only           # rebuild report.md from results
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from constrained_spec import compile as compile_mod  # noqa: E402
from constrained_spec import testing  # noqa: E402
from constrained_spec.compile import compile_regex, run_bounded  # noqa: E402
from constrained_spec.errors import SchemaTooComplex, UnsupportedSchemaError  # noqa: E402
from constrained_spec.models import load_tokenizer  # noqa: E402
from constrained_spec.schema import schema_to_regex  # noqa: E402
from constrained_spec.vocab import token_vocabulary  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "sample"  # the committed sample; the dev set via --data
OUT = ROOT / "benchmarks" / "results" / "coverage"


def source_of(name: str) -> str:
    return name.split("---")[0] if "---" in name else name.rsplit("_", 1)[0]


def select_files(args) -> list[Path]:
    files = sorted(Path(args.data).glob("*.json"))
    if not files:
        raise SystemExit(
            f"no schema files in {args.data}: pass --data DIR (JSONSchemaBench layout)."
        )
    if args.sources:
        wanted = set(args.sources.split(","))
        files = [f for f in files if source_of(f.name) in wanted]
    if args.sample:  # stratified: every source in proportion, at least 3 files each
        by_source = collections.defaultdict(list)
        for f in files:
            by_source[source_of(f.name)].append(f)
        rng = random.Random(0)
        picked = []
        for group in by_source.values():
            k = max(3, round(args.sample * len(group) / len(files)))
            picked += rng.sample(group, min(k, len(group)))
        files = sorted(picked)
    return files[: args.limit] if args.limit else files


# --- one schema -----------------------------------------------------------------------------


def translate(schema: dict, which: str) -> dict:
    """Runs in a bounded child: the regex, or why there is none."""
    try:
        if which == "ours":
            return {"regex": schema_to_regex(schema)}
        from outlines_core.json_schema import build_regex_from_schema

        return {"regex": build_regex_from_schema(json.dumps(schema), "")}
    except UnsupportedSchemaError as e:
        return {"status": "refused", "keyword": e.keyword, "pointer": e.pointer, "message": str(e)}
    except SchemaTooComplex as e:
        return {"status": "too_complex", "keyword": "regex size", "message": str(e)}
    except Exception as e:
        status = "invalid_schema" if "not a valid JSON Schema" in str(e) else "error"
        return {"status": status, "message": f"{type(e).__name__}: {e}"}


def run_one(which: str, schema: dict, tests: list, oracle, tok, vocab, args) -> dict:
    t0 = time.perf_counter()
    try:
        out = run_bounded(
            lambda: translate(schema, which), "translating the schema", args.timeout, args.memory_gb
        )
    except SchemaTooComplex as e:
        out = {"status": "too_complex", "keyword": "translate", "message": str(e)}
    out["translate_s"] = round(time.perf_counter() - t0, 4)
    if "regex" not in out:
        out["message"] = out.get("message", "")[:300]
        return out
    regex = out.pop("regex")
    out["regex_chars"] = len(regex)
    if args.translate_only:
        return out | {"status": "translated"}
    t1 = time.perf_counter()
    try:
        constraint = compile_regex(regex, vocab, len(tok), None)
    except SchemaTooComplex as e:
        kind = "time" if "longer than" in str(e) else "memory"
        return out | {
            "status": "too_complex",
            "keyword": f"compile {kind}",
            "message": str(e)[:300],
        }
    except Exception as e:
        return out | {"status": "error", "message": f"compile: {type(e).__name__}: {e}"[:300]}
    out["compile_s"] = round(time.perf_counter() - t1, 4)
    out["status"] = "compiled"
    out |= check_instances(constraint, tests, oracle, tok)
    if which == "ours" and not args.quick:
        out |= fuzz(constraint, oracle, args.fuzz)
    out["mask_ms"] = mask_times(constraint, tests, tok)
    compile_mod._compiled.clear()  # keep memory flat over thousands of schemas
    return out


def check_instances(c, tests, oracle, tok) -> dict:
    r = collections.Counter()
    examples = []
    for t in tests:
        text = json.dumps(t["data"], separators=(",", ":"), ensure_ascii=False)
        if oracle(t["data"]):
            ok = c.accepts(text)
            r["valid_accepted" if ok else "valid_rejected"] += 1
            continue
        ascii_text = json.dumps(t["data"], separators=(",", ":"))
        ids = tok.encode(text, add_special_tokens=False)
        if c.accepts(text) or c.accepts(ascii_text) or c.accepts_tokens(ids):
            r["invalid_accepted"] += 1
            examples.append(text[:200])
        else:
            r["invalid_rejected"] += 1
    return dict(r) | ({"invalid_examples": examples[:3]} if examples else {})


def fuzz(c, oracle, n: int) -> dict:
    """Texts sampled by a random walk over the automaton's byte tokens must all be valid."""
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
    return {"fuzz_texts": done, "fuzz_invalid": len(bad)} | (
        {"fuzz_examples": bad[:3]} if bad else {}
    )


def mask_times(c, tests, tok, max_states: int = 8) -> list[float]:
    valid = [t for t in tests if t["valid"]]
    if not valid:
        return []
    ids = tok.encode(
        json.dumps(valid[0]["data"], separators=(",", ":"), ensure_ascii=False),
        add_special_tokens=False,
    )
    times, state = [], c.initial_state
    for token in ids[:max_states]:
        t0 = time.perf_counter()
        c.mask(state)
        times.append(round((time.perf_counter() - t0) * 1000, 3))
        state = c.step(state, token)
        if state is None:
            break
    return times


def make_oracle(schema: dict):
    try:
        v = testing.schema_validator(schema)  # no $ref is fetched
    except Exception:
        return None

    def oracle(x) -> bool:
        try:
            return v.is_valid(x)
        except Exception:  # e.g. unresolvable remote $ref
            return False

    return oracle


def run_file(path: Path, tok, vocab, args) -> dict:
    d = json.loads(path.read_text())
    schema, tests = d["schema"], d["tests"]
    rec = {"file": path.name, "source": source_of(path.name), "tests": len(tests)}
    oracle = make_oracle(schema)
    if oracle is None:
        return rec | {"oracle": "schema unusable by jsonschema"}
    rec["label_disagreements"] = sum(oracle(t["data"]) != t["valid"] for t in tests)
    for which in ("ours", "raw"):
        rec[which] = run_one(which, schema, tests, oracle, tok, vocab, args)
    return rec


# --- report ---------------------------------------------------------------------------------


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.floor(q * len(xs)))] if xs else float("nan")


def summarize(records: list[dict], which: str) -> dict:
    rs = [r[which] for r in records if which in r]
    status = collections.Counter(r["status"] for r in rs)
    refused = collections.Counter(r["keyword"] for r in rs if r["status"] in ("refused",))
    complex_ = collections.Counter(
        r.get("keyword", "?") for r in rs if r["status"] == "too_complex"
    )
    total = lambda k: sum(r.get(k, 0) for r in rs)  # noqa: E731
    ctime = [r["translate_s"] + r["compile_s"] for r in rs if r["status"] == "compiled"]
    masks = [m for r in rs for m in r.get("mask_ms", [])]
    return {
        "files": len(rs),
        "status": dict(status),
        "refused_by_keyword": dict(refused.most_common()),
        "too_complex_by_cause": dict(complex_),
        "invalidation_errors": total("invalid_accepted"),
        "schemas_with_invalidation_errors": sum(bool(r.get("invalid_accepted")) for r in rs),
        "invalid_rejected": total("invalid_rejected"),
        "validation_errors": total("valid_rejected"),
        "valid_accepted": total("valid_accepted"),
        "fuzz_texts": total("fuzz_texts"),
        "fuzz_invalid": total("fuzz_invalid"),
        "compile_s": {"p50": pct(ctime, 0.5), "p90": pct(ctime, 0.9), "max": max(ctime, default=0)},
        "mask_ms": {"p50": pct(masks, 0.5), "p99": pct(masks, 0.99), "n": len(masks)},
    }


def write_report(records: list[dict], command: str, out_dir: Path = OUT) -> None:
    ours, raw = summarize(records, "ours"), summarize(records, "raw")
    (out_dir / "summary.json").write_text(
        json.dumps({"command": command, "ours": ours, "raw": raw}, indent=1)
    )
    lines = [
        f"# JSON Schema coverage on jsonschemabench-dev ({len(records)} files)",
        "",
        f"Command: `{command}`",
        "",
        "Instances are judged by jsonschema with its format checker; ours = "
        "constrained_spec.schema, raw = outlines-core `build_regex_from_schema` as is. "
        "Compile = translate + index build against the SmolLM2-135M tokenizer, bounded per "
        "schema (see the command's --timeout / --memory-gb).",
        "",
        "| | ours | raw outlines-core |",
        "|---|---|---|",
    ]
    translated = (
        [("translated (regex only, --translate-only)", "translated")]
        if ours["status"].get("translated") or raw["status"].get("translated")
        else []
    )
    for label, key in (
        translated
        + [("compiled", "compiled")] * (not translated)
        + [
            ("refused (named keyword)", "refused"),
            ("too complex (bound hit)", "too_complex"),
            ("invalid schema (meta-schema)", "invalid_schema"),
            ("other errors", "error"),
        ]
    ):
        lines.append(f"| {label} | {_rate(ours, key)} | {_rate(raw, key)} |")
    checked = (
        []
        if translated
        else [
            ("**invalidation errors** (invalid accepted)", "invalidation_errors"),
            ("schemas with invalidation errors", "schemas_with_invalidation_errors"),
            ("invalid instances rejected", "invalid_rejected"),
            ("validation errors (valid rejected)", "validation_errors"),
            ("valid instances accepted", "valid_accepted"),
            ("fuzz texts / invalid among them", None),
        ]
    )
    for label, key in checked:
        val = (
            (lambda s: f"{s['fuzz_texts']} / {s['fuzz_invalid']}")
            if key is None
            else (lambda s: str(s[key]))
        )
        lines.append(f"| {label} | {val(ours)} | {val(raw)} |")
    for label, key, sub in (
        []
        if translated
        else [
            ("compile s p50 / p90 / max", "compile_s", ("p50", "p90", "max")),
            ("mask build ms p50 / p99", "mask_ms", ("p50", "p99")),
        ]
    ):
        fmt = lambda s: " / ".join(f"{s[key][k]:.3g}" for k in sub)  # noqa: E731
        lines.append(f"| {label} | {fmt(ours)} | {fmt(raw)} |")
    lines += [
        "",
        "Refusals by keyword (ours): "
        + ", ".join(f"`{k}` {v}" for k, v in ours["refused_by_keyword"].items()),
        "",
        "Too complex by cause (ours): "
        + ", ".join(f"{k} {v}" for k, v in ours["too_complex_by_cause"].items()),
        "",
        "Too complex by cause (raw): "
        + ", ".join(f"{k} {v}" for k, v in raw["too_complex_by_cause"].items()),
        "",
    ]
    lines += source_table(records, bool(translated))
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")


def _rate(s, key):
    n = s["status"].get(key, 0)
    return f"{n} ({100 * n / max(s['files'], 1):.1f}%)"


def source_table(records, translated: bool = False) -> list[str]:
    if translated:
        lines = ["| source | files | ours translated | raw translated |", "|---|---|---|---|"]
    else:
        lines = [
            "| source | files | ours compiled | raw compiled | ours inval. err | raw inval. "
            "err | ours valid. err | raw valid. err |",
            "|---|---|---|---|---|---|---|---|",
        ]
    by = collections.defaultdict(list)
    for r in records:
        by[r["source"].split("---")[0] if r["source"].startswith("Glaive") else r["source"]].append(
            r
        )
    for src in sorted(by):
        rs = [r for r in by[src] if "ours" in r]
        c = lambda w: sum(r[w]["status"] in ("compiled", "translated") for r in rs)  # noqa: E731
        e = lambda w, k: sum(r[w].get(k, 0) for r in rs)  # noqa: E731
        counts = f"| {src} | {len(rs)} | {c('ours')} | {c('raw')} |"
        lines.append(
            counts
            if translated
            else counts
            + (
                f" {e('ours', 'invalid_accepted')} | {e('raw', 'invalid_accepted')} | "
                f"{e('ours', 'valid_rejected')} | {e('raw', 'valid_rejected')} |"
            )
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data",
        type=Path,
        default=DATA,
        help="JSONSchemaBench-style folder (default: the committed 48-file sample)",
    )
    ap.add_argument("--limit", type=int, help="at most N files (after other filters)")
    ap.add_argument("--sample", type=int, help="stratified sample of about N files")
    ap.add_argument("--sources", help="comma-separated sources, e.g. Github_easy,Kubernetes")
    ap.add_argument("--quick", action="store_true", help="no fuzzing; 15 s / 4 GB bounds")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per step per schema")
    ap.add_argument("--memory-gb", type=float, default=6.0, help="memory per step per schema")
    ap.add_argument("--fuzz", type=int, default=4, help="random automaton texts per schema")
    ap.add_argument("--results", default="results.jsonl", help="file name under the output dir")
    ap.add_argument("--resume", action="store_true", help="skip files already in the results")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument(
        "--translate-only",
        action="store_true",
        help="only translate each schema (no index build, no instances): fast enough "
        "for all 5,197 files",
    )
    ap.add_argument("--out", type=Path, default=OUT, help="output directory")
    args = ap.parse_args()
    if args.quick:
        args.timeout, args.memory_gb = min(args.timeout, 15.0), min(args.memory_gb, 4.0)
    command = "python benchmarks/coverage.py " + " ".join(sys.argv[1:])
    os.environ["CONSTRAINED_SPEC_COMPILE_TIMEOUT"] = str(args.timeout)  # the Index build bound
    os.environ["CONSTRAINED_SPEC_COMPILE_MEMORY_GB"] = str(args.memory_gb)
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / args.results
    if args.report_only:
        records = [json.loads(x) for x in results.read_text().splitlines()]
        summary = out_dir / "summary.json"
        return write_report(
            records,
            summary.exists() and json.loads(summary.read_text())["command"] or command,
            out_dir,
        )
    files = select_files(args)
    done = (
        {json.loads(x)["file"] for x in results.read_text().splitlines()}
        if args.resume and results.exists()
        else set()
    )
    if not args.resume:
        results.write_text("")
    tok = load_tokenizer()  # the default model's tokenizer, without its weights
    vocab = token_vocabulary(tok)
    t0 = time.time()
    with results.open("a") as out:
        for i, path in enumerate(files):
            if path.name in done:
                continue
            rec = run_file(path, tok, vocab, args)
            out.write(json.dumps(rec, separators=(",", ":")) + "\n")
            out.flush()
            print(
                f"[{i + 1}/{len(files)} {time.time() - t0:.0f}s] {path.name}: "
                f"ours={rec.get('ours', {}).get('status')} raw={rec.get('raw', {}).get('status')}"
                f" inval={rec.get('ours', {}).get('invalid_accepted', 0)}",
                flush=True,
            )
    records = [json.loads(x) for x in results.read_text().splitlines()]
    write_report(records, command, out_dir)
    print((out_dir / "report.md").read_text())


if __name__ == "__main__":
    main()
