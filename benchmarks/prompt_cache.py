"""Kept prompts (llama.PromptCache) on a corpus-style job: several records extracted under the
same schema, so consecutive prompts share the chat template, the instructions and the schema.

Each mode runs the same requests, greedy, on the default model:
    single, nothing kept   one request at a time, the prompt cache emptied before each
    single, kept           one request at a time, prompts kept from request to request
    batch B, nothing kept  generate_batch with the cache off
    batch B, kept          generate_batch with prompts kept (emptied once, before the run)
and reports prefill time, TTFT, output tok/s over the whole run, the share of prompt tokens
copied rather than computed, and whether every output equals the nothing-kept one.

    python benchmarks/prompt_cache.py --out benchmarks/results/prompt-cache
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import workloads
from run import machine_info

from constrained_spec import ConstraintError, Generator

WORDS = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jia"]


def corpus(gen, schemas: int, records: int, sel: workloads.Selection, data: Path) -> list[dict]:
    """``records`` extract requests for each of the first ``schemas`` usable schemas of ``data``,
    grouped by schema as a corpus job would send them. The dev set holds one or two short valid
    instances a schema, so the records are variants of the first: its leaves changed one at a
    time (another word, another number), each change kept only if the instance stays valid."""
    requests = []
    for path in sorted(Path(data).glob("*.json")):
        entry = json.loads(path.read_text())
        schema = entry.get("schema")
        if not isinstance(schema, dict) or len(workloads.compact(schema)) > sel.max_schema_chars:
            continue
        instance = workloads.short_instance(schema, entry.get("tests", []), sel)
        if instance is None:
            continue
        try:
            gen.compile(schema=schema)
        except ConstraintError:
            continue
        found = {workloads.compact(v): v for v in variants(schema, instance, records)}
        if len(found) < records:
            continue
        requests += [
            {
                "prompt": workloads.messages_for("extract", schema, instance),
                "schema": schema,
                "max_new_tokens": 160,
                "source": path.name,
            }
            for instance in list(found.values())[:records]
        ]
        if len(requests) == schemas * records:
            break
    return requests


def variants(schema: dict, instance, n: int) -> list:
    """``instance`` and n − 1 variants of it, each valid under ``schema``."""

    def leaves(value, path=()):
        if isinstance(value, dict):
            return [leaf for k, v in value.items() for leaf in leaves(v, (*path, k))]
        if isinstance(value, list):
            return [leaf for i, v in enumerate(value) for leaf in leaves(v, (*path, i))]
        return [(path, value)]

    def put(value, path, new):
        if not path:
            return new
        copy = dict(value) if isinstance(value, dict) else list(value)
        copy[path[0]] = put(value[path[0]], path[1:], new)
        return copy

    out = [instance]
    for i in range(1, n):
        variant = instance
        for path, leaf in leaves(instance):
            if isinstance(leaf, bool) or leaf is None:
                continue
            if isinstance(leaf, str):
                new = f"{WORDS[i % len(WORDS)]} {leaf}"[: max(len(leaf), 6)]
            else:
                new = leaf + 7 * i if isinstance(leaf, int) else round(leaf + 1.5 * i, 3)
            candidate = put(variant, path, new)
            if workloads.is_valid(schema, candidate):
                variant = candidate
        out.append(variant)
    return out


def forget(gen, keep: bool) -> None:
    cache = gen.target.prompt_cache
    cache.clear()
    cache.limit = gen.prompt_cache_limit if keep else 0


def run_single(gen, requests, keep: bool) -> dict:
    forget(gen, keep)
    results, start = [], time.perf_counter()
    for request in requests:
        if not keep:
            forget(gen, keep)
        args = {k: v for k, v in request.items() if k != "source"}
        results.append(gen.generate(**args))
    return summary(f"single, {'kept' if keep else 'nothing kept'}", results, start, requests, gen)


def run_batch(gen, requests, keep: bool, size: int) -> dict:
    forget(gen, keep)
    start = time.perf_counter()
    todo = [{k: v for k, v in r.items() if k != "source"} for r in requests]
    results = gen.generate_batch(todo, batch_size=size)
    mode = f"batch {size}, {'kept' if keep else 'nothing kept'}"
    return summary(mode, results, start, requests, gen)


def summary(mode: str, results, start: float, requests, gen) -> dict:
    wall = time.perf_counter() - start
    prompt = [len(gen.encode_prompt(r["prompt"])) - 1 for r in requests]  # prefilled tokens
    tokens = sum(len(r.token_ids) + (r.finish_reason != "length") for r in results)
    return {
        "mode": mode,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "prefill_ms": [1e3 * r.stats.prefill_s for r in results],
        "ttft_ms": [1e3 * r.stats.ttft_s for r in results],
        "cached": sum(r.stats.cached_prompt_tokens for r in results),
        "prompt_tokens": sum(prompt),
        "outputs": [r.token_ids for r in results],
        "valid": sum(r.finish_reason != "length" for r in results),
    }


def report(runs: list[dict], meta: dict) -> str:
    lines = [
        f"# Kept prompts: {meta['schemas']} schemas × {meta['records']} records, extract, greedy",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine'].get('cpu')}, torch {meta['machine']['torch']}, "
        f"{meta['machine']['torch_threads']} threads; target: {meta['weights']}; "
        f"drafts: {meta['draft']}.",
        "",
        "| mode | tok/s | wall s | prefill ms, mean | TTFT ms, p50 / max | prompt tokens copied "
        "| stopped | = nothing kept |",
        "|---|---|---|---|---|---|---|---|",
    ]
    reference = {}
    for run in runs:
        kind = run["mode"].split(",")[0]
        if run["mode"].endswith("nothing kept"):
            reference[kind] = run["outputs"]
        same = sum(a == b for a, b in zip(run["outputs"], reference.get(kind, [])))
        lines.append(
            f"| {run['mode']} | {run['tok_s']:.1f} | {run['wall_s']:.1f} | "
            f"{statistics.mean(run['prefill_ms']):.0f} | {statistics.median(run['ttft_ms']):.0f} / "
            f"{max(run['ttft_ms']):.0f} | {run['cached']} of {run['prompt_tokens']} "
            f"({100 * run['cached'] / run['prompt_tokens']:.0f}%) | {run['valid']}/"
            f"{len(run['outputs'])} | {same}/{len(run['outputs'])} |"
        )
    lines += [
        "",
        "Nothing kept: the prompt cache emptied before each request (single) or turned off "
        "(batch). Kept: emptied once, before the run, so the first request of each schema still "
        "computes its schema text. TTFT and prefill are per request; in a batch a row's TTFT "
        "includes the rounds it waits for while other rows are admitted.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemas", type=int, default=4)
    p.add_argument("--records", type=int, default=4, help="records per schema")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--data", default=str(workloads.DATA))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    gen = Generator.from_pretrained()
    if gen.target.prompt_cache is None:
        raise SystemExit("this target keeps no prompts (its layers are not fused here).")
    gen.prompt_cache_limit = gen.target.prompt_cache.limit
    requests = corpus(gen, args.schemas, args.records, workloads.Selection(), Path(args.data))
    gen.generate(**{k: v for k, v in requests[0].items() if k != "source"})  # warm-up
    runs = []
    for keep in (False, True):
        runs.append(run_single(gen, requests, keep))
        print(runs[-1]["mode"], f"{runs[-1]['tok_s']:.1f} tok/s", flush=True)
    for keep in (False, True):
        runs.append(run_batch(gen, requests, keep, args.batch_size))
        print(runs[-1]["mode"], f"{runs[-1]['tok_s']:.1f} tok/s", flush=True)
    meta = {
        "command": "python benchmarks/prompt_cache.py " + shlex.join(argv or sys.argv[1:]),
        "machine": machine_info(argparse.Namespace()),
        "weights": gen.weights_choice,
        "draft": "forced + lookup",
        "schemas": args.schemas,
        "records": args.records,
        "sources": [r["source"] for r in requests],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    (out / "report.md").write_text(report(runs, meta))
    print(report(runs, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
