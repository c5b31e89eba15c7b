"""Start-up time: what a script, a shell pipeline or a test pays before and around its first
token, each measured in fresh processes from the moment the process is started.

    python benchmarks/startup.py --out /tmp/startup [--repeats 5] [--baseline-python PY]
                                 [--model NAME|FILE.gguf]

- ``import constrained_spec`` and ``from constrained_spec import Generator``: process wall time
  (``python -c pass`` alone is reported beside them);
- one request through the API (import, ``Generator.from_pretrained()``, compile, generate at
  most 64 tokens): the time from the process's start to the import's end, the model's load, the
  first token and the end, on a short schema;
- the CLI call ``constrained-spec generate --schema examples/person.json "..."``: wall time.

Warm: the model prepared and the kernels built and calibrated before (every run after the first);
cold: the prepared model file removed first (the conversion a new model's first load pays; the
one-time download and kernel build are not counted). ``--first-run``: first of all, the CLI call
once on an empty cache (``CONSTRAINED_SPEC_CACHE``: a new folder, kept for the runs after it):
what a new machine's first call pays (download, kernel build, calibration, preparing), with the
progress lines it printed. ``--baseline-python PY`` runs the same with
another Python whose constrained_spec is another version (e.g. a virtualenv with
``pip install -e`` of ``git worktree add /tmp/before <commit>``), for comparison.
Medians over ``--repeats`` processes; the machine should be otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "examples" / "person.json"
PROMPT = "Extract: Alice is 30 years old and her email is alice@example.com."  # the README's

# One request through the API, timed from the process's start (the parent's clock at spawn).
CHILD = """
import json, os, sys, time
start = float(os.environ["STARTUP_T0"])
marks = {}
from constrained_spec import Generator
marks["import"] = time.time() - start
gen = Generator.from_pretrained(sys.argv[3])
marks["load"] = time.time() - start
def first(round):
    marks.setdefault("first_token", time.time() - start)
schema = json.load(open(sys.argv[1]))
messages = [{"role": "user", "content": sys.argv[2]}]
result = gen.generate(messages, schema=schema, on_round=first, max_new_tokens=64)
marks["end"] = time.time() - start
marks["text"] = result.text
print(json.dumps(marks))
"""


def timed(argv: list[str], env: dict) -> tuple[float, str]:
    start = time.time()
    out = subprocess.run(  # run outside the checkout: `python -c` puts its folder on sys.path
        argv, env={**env, "STARTUP_T0": repr(start)}, capture_output=True, text=True, cwd="/"
    )
    wall = time.time() - start
    if out.returncode not in (0, 3):  # 3: stopped at --max-new-tokens (random-weight models)
        raise SystemExit(f"{shlex.join(argv)} failed:\n{out.stderr[-2000:]}")
    return wall, out.stdout


def prepared_files(model: str) -> list[Path]:
    from constrained_spec.model import models, prepared

    source = models.model_file(model)
    return [prepared.path_for(source)] if source else []


def measure(python: str, env: dict, model: str, repeats: int, cold: bool, say) -> dict:
    cli = [python, "-m", "constrained_spec", "generate", "--model", model]
    cli += ["--schema", str(SCHEMA), "--max-new-tokens", "64", PROMPT]
    api = [python, "-c", CHILD, str(SCHEMA), PROMPT, model]
    runs: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        runs.setdefault(name, []).append(value)

    timed(api, env)  # prepares the model where it is not yet, warms the page cache
    for _ in range(repeats):
        for name, code in [
            ("python -c pass", "pass"),
            ("import constrained_spec", "import constrained_spec"),
            ("from constrained_spec import Generator", "from constrained_spec import Generator"),
        ]:
            add(name, timed([python, "-c", code], env)[0])
        if cold:
            for path in prepared_files(model):
                path.unlink(missing_ok=True)
        marks = json.loads(timed(api, env)[1].splitlines()[-1])
        for k in ("import", "load", "first_token", "end"):
            add(f"api: {k}", marks[k])
        if cold:
            for path in prepared_files(model):
                path.unlink(missing_ok=True)
        add("cli: whole call", timed(cli, env)[0])
        say("  " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items()))
    return {k: statistics.median(v) for k, v in runs.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline-python", help="a Python with another version of the package")
    p.add_argument("--model", default=None, help="a built-in name or a GGUF file (default model)")
    p.add_argument("--first-run", action="store_true", help="first, one call on an empty cache")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    say = lambda *a, **k: print(*a, flush=True, **k)
    from constrained_spec.model.models import DEFAULT_MODEL

    model = args.model or DEFAULT_MODEL
    versions = {"this checkout": sys.executable}
    if args.baseline_python:
        versions[args.baseline_python] = args.baseline_python  # another install
    env, first = dict(os.environ), None
    if args.first_run:  # a new machine: nothing cached (the package's own install aside)
        env["CONSTRAINED_SPEC_CACHE"] = tempfile.mkdtemp(prefix="constrained-spec-cache-")
        os.environ["CONSTRAINED_SPEC_CACHE"] = env["CONSTRAINED_SPEC_CACHE"]  # cold: its files
        cli = [sys.executable, "-m", "constrained_spec", "generate", "--model", model]
        start = time.time()
        call = subprocess.run(
            [*cli, "--schema", str(SCHEMA), PROMPT], env=env, capture_output=True, text=True
        )
        first = {"seconds": time.time() - start, "returncode": call.returncode}
        first |= {
            "stdout": call.stdout.strip(),
            "stderr": [
                line
                for line in call.stderr.strip().splitlines()
                if "it/s]" not in line and line.strip()
            ],
        }
        say(f"first run: {first['seconds']:.1f} s", *first["stderr"], sep="\n  ")
    results = {}
    for label, python in versions.items():
        for cold in (False, True):
            say(f"{label}, {'cold' if cold else 'warm'}:")
            results[f"{label}, {'cold' if cold else 'warm'}"] = measure(
                python, env, model, args.repeats, cold, say
            )
    meta = {
        "command": shlex.join(["python", *sys.argv]),
        "model": model,
        "python": sys.executable,
        "baseline_python": args.baseline_python,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "repeats": args.repeats,
    }
    everything = {"meta": meta, "first_run": first, "results": results}
    (out / "results.json").write_text(json.dumps(everything, indent=1))
    names = list(next(iter(results.values())))
    lines = [
        "# Start-up time (seconds from the process's start; medians of "
        f"{args.repeats} fresh processes)",
        "",
        f"Command: `{meta['command']}` (python: `{meta['python']}`); model {model}; "
        f"{meta['machine']}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| | " + " | ".join(results) + " |",
        "|---|" + "---|" * len(results),
    ]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{r[name]:.2f}" for r in results.values()) + " |")
    if first:
        lines += [
            "",
            f"First run on an empty cache: **{first['seconds']:.1f} s** (exit {first['returncode']},"
            f" printed `{first['stdout']}`); its progress lines on stderr:",
            "",
            "```",
            *first["stderr"],
            "```",
        ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    say(f"report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
