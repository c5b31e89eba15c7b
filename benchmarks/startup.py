"""Start-up time: what a script, a shell pipeline or a test pays before and around its first
token, each measured in fresh processes from the moment the process is started.

    python benchmarks/startup.py --out /tmp/startup [--repeats 5] [--baseline-python PY]
                                 [--model NAME|FILE.gguf]
    python benchmarks/startup.py --first-load FILE.gguf [FILE.gguf ...]

- ``import constrained_spec`` and ``from constrained_spec import Generator``: process wall time
  (``python -c pass`` alone is reported beside them);
- one request through the API (import, ``Generator.from_pretrained()``, compile, generate at
  most 64 tokens): the time from the process's start to the import's end, the model's load, the
  first token and the end, on a short schema;
- the CLI call ``constrained-spec generate --schema examples/person.json "..."``: wall time.

Warm: the model prepared and its pass costs measured before (every run after the first); cold:
the prepared entry removed first (what a new model's first load pays; the one-time download is
not counted). ``--first-run``: first of all, the CLI call
once on an empty cache (``CONSTRAINED_SPEC_CACHE``: a new folder, kept for the runs after it):
what a new machine's first call pays (download, pass costs, preparing), with the
progress lines it printed. ``--baseline-python PY`` runs the same with
another Python whose constrained_spec is another version (e.g. a virtualenv with
``pip install -e`` of ``git worktree add /tmp/before <commit>``), for comparison.
Medians over ``--repeats`` processes; the machine should be otherwise idle.

``--first-load``: the time and memory of a GGUF file's first load, of the load after it, and the
disk the first one wrote beside the model: what a user's machine meets when it brings a model.
Each file loads in a fresh process with an empty cache of its own (the kernels, the GGUF repack
among them, ship prebuilt: nothing is compiled), under the default cap on
prepared models; then again in a second fresh process on the cache the first one left. Prints per
file and load: seconds from the process's start to the model loaded (imports included), the peak
resident memory (VmHWM: it counts the memory-mapped file's pages too, which the system can
reclaim), the anonymous memory after the load (the process's own: what cannot be reclaimed); and
the bytes the first load stored (model.prepared). Also the CPU time the process took to the
model loaded, all threads: on a machine shared with other work, where the seconds depend on
what else runs, it tells what the load costs. Linux only (it reads /proc/self/status).
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


# --first-load: one load of a GGUF file, timed from the process's start.
FIRST_LOAD = """
import time
start = time.perf_counter()
import json, resource
from constrained_spec.model import models, prepared
model, _ = models.load_model({path!r}, weights="int4")
loaded = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_SELF)
prepared.wait()
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
gb = lambda key: int(status[key].split()[0]) / 1e6
stored = prepared.path_for(models.model_file({path!r}))
written = sum(p.stat().st_size for p in (stored, stored.with_suffix(".json")) if p.exists())
print(json.dumps({{"load_s": loaded, "cpu_s": usage.ru_utime + usage.ru_stime,
                  "peak_gb": gb("VmHWM"), "anon_after_gb": gb("RssAnon"), "stored_gb": written / 1e9}}))
"""


def first_and_second_load(path: Path) -> list[dict]:
    """The first and the second load of ``path``, each in a fresh process, on one new cache."""
    with tempfile.TemporaryDirectory(prefix="first-load-") as cache:  # the kernels: prebuilt
        env = os.environ | {"CONSTRAINED_SPEC_CACHE": cache, "PYTHONPATH": str(ROOT)}
        env.pop("CONSTRAINED_SPEC_CACHE_GB", None)  # the default cap, as a user has it
        code = FIRST_LOAD.format(path=str(path.resolve()))
        results = []
        for _ in range(2):
            out = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
            )
            if out.returncode != 0:
                raise SystemExit(f"{path}: the load failed:\n{out.stderr[-3000:]}")
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        return results


def print_first_loads(paths: list[Path]) -> None:
    for path in paths:
        first, second = first_and_second_load(path)
        size = path.stat().st_size / 1e9
        for name, r in (("first", first), ("second", second)):
            print(
                f"{path.name}: {name} load {r['load_s']:.1f} s ({r['cpu_s']:.1f} s of CPU time), "
                f"peak {r['peak_gb']:.2f} GB "
                f"resident, {r['anon_after_gb']:.2f} GB anonymous after the load",
                flush=True,
            )
        stored = first["stored_gb"]
        print(f"{path.name}: stored {stored:.3f} GB beside the {size:.2f} GB file", flush=True)


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
    p.add_argument("--out", help="the folder of results.json and report.md (not --first-load)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline-python", help="a Python with another version of the package")
    p.add_argument("--model", default=None, help="a built-in name or a GGUF file (default model)")
    p.add_argument("--first-run", action="store_true", help="first, one call on an empty cache")
    p.add_argument(
        "--first-load",
        nargs="+",
        type=Path,
        metavar="FILE.gguf",
        help="first and second loads only",
    )
    args = p.parse_args(argv)
    if args.first_load:
        print_first_loads(args.first_load)
        return 0
    if not args.out:
        p.error("--out is needed (or --first-load FILE.gguf ...)")
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
