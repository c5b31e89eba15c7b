"""Load test of `constrained-spec serve`: C concurrent clients × N streamed requests each.

Per concurrency level: throughput (completion tokens/s, requests/s), latency and time to first
token (p50/p99), lost replies (an error or no final chunk), mixed-up replies (a reply carrying
another request's tag) and the share of stopped replies that validate.

Each request asks for JSON under a schema whose `request` field is a const tag (one of TAGS
values, compiled once in a warm-up): a reply delivered to the wrong client shows its tag.

    python benchmarks/load.py --clients 1,4,16 --requests 20 --out benchmarks/results/serve-load
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
from report import run_metadata  # benchmarks/report.py: the script's folder is on sys.path

from constrained_spec.testing import server_process

TAGS = 20  # distinct schemas: compiled during the warm-up, then served from the cache
PEOPLE = [("Alice", 30), ("Bob", 7), ("Chen", 45), ("Dana", 62), ("Emeka", 19)]


def schema(tag: int) -> dict:
    return {
        "type": "object",
        "properties": {
            "request": {"const": f"r{tag}"},
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
        },
        "required": ["request", "name", "age"],
        "additionalProperties": False,
    }


def one_request(client, i: int, max_tokens: int, temperature: float) -> dict:
    """Stream one request; returns its timings, text, finish_reason and checks."""
    tag, (name, age) = i % TAGS, PEOPLE[i % len(PEOPLE)]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema(tag)}}
    messages = [{"role": "user", "content": f"Extract the person as JSON: {name}, {age} years."}]
    start, first, pieces, finish, usage = time.perf_counter(), None, [], None, None
    try:
        stream = client.chat.completions.create(
            model="any",
            messages=messages,
            response_format=fmt,
            temperature=temperature,
            max_tokens=max_tokens,
            seed=i,
            stream=True,
        )
        for chunk in stream:
            delta = chunk.choices[0].delta.content
            if delta:
                first = first or time.perf_counter()
                pieces.append(delta)
            finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
    except openai.APIError as e:
        return {"i": i, "lost": True, "error": f"{type(e).__name__}: {e}"}
    end, text = time.perf_counter(), "".join(pieces)
    row = {"i": i, "lost": finish is None, "finish": finish, "text": text}
    row.update(latency_s=end - start, ttft_s=(first or end) - start)
    row["tokens"] = usage.completion_tokens if usage else 0
    expected = f'{{"request":"r{tag}"'  # a reply cut by max_tokens may hold less of it
    row["mixed_up"] = not (text.startswith(expected) or expected.startswith(text))
    if finish == "stop":
        try:
            jsonschema.validate(json.loads(text), schema(tag))
            row["valid"] = True
        except (ValueError, jsonschema.ValidationError):
            row["valid"] = False
    return row


def level(client, clients: int, requests: int, max_tokens: int, temperature: float) -> dict:
    """C clients, each sending its N requests one after another."""

    def client_loop(c: int) -> list[dict]:
        return [
            one_request(client, c * requests + j, max_tokens, temperature) for j in range(requests)
        ]

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        rows = [r for rs in pool.map(client_loop, range(clients)) for r in rs]
    wall = time.perf_counter() - start
    done = [r for r in rows if not r["lost"]]
    stopped = [r for r in done if r["finish"] == "stop"]

    def pct(key, q):
        values = sorted(r[key] for r in done)
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    return {
        "clients": clients,
        "requests": len(rows),
        "wall_s": wall,
        "tokens_per_s": sum(r["tokens"] for r in done) / wall,
        "requests_per_s": len(done) / wall,
        "latency_p50_s": pct("latency_s", 0.5),
        "latency_p99_s": pct("latency_s", 0.99),
        "ttft_p50_s": pct("ttft_s", 0.5),
        "ttft_p99_s": pct("ttft_s", 0.99),
        "lost": len(rows) - len(done),
        "mixed_up": sum(r["mixed_up"] for r in done),
        "stopped": len(stopped),
        "valid_of_stopped": sum(r["valid"] for r in stopped) / len(stopped) if stopped else None,
        "mean_tokens": statistics.mean(r["tokens"] for r in done) if done else 0,
        "rows": rows,
    }


def report(levels: list[dict], args, meta: dict) -> str:
    one = levels[0]["tokens_per_s"] if levels and levels[0]["clients"] == 1 else None
    lines = [
        "# Load benchmark: `constrained-spec serve`",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Run {meta['date']}, {meta['minutes']:.0f} min; {meta['machine']}; load average at "
        f"start {meta['load_start']}, at end {meta['load_end']}; git {meta['commit']}.",
        f"Streamed requests, JSON Schema with a per-request const tag, max_tokens "
        f"{args.max_tokens}, temperature {args.temperature}; server flags: "
        f"`{args.server_args or '(defaults)'}`.",
        "",
        "With `--batch-size 1` the server runs requests one at a time: more clients wait in "
        "the queue, so throughput stays about flat and latency grows with the clients. With "
        "`--batch-size B` it decodes up to B requests together (one target forward per round).",
        "",
        "| clients | requests | tok/s | req/s | vs 1 client | latency p50 / p99 s | "
        "TTFT p50 / p99 s | lost | mixed up | stopped | valid of stopped |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in levels:
        ratio = f"{lv['tokens_per_s'] / one:.2f}×" if one else "–"
        valid = (
            f"{100 * lv['valid_of_stopped']:.0f}%" if lv["valid_of_stopped"] is not None else "–"
        )
        lines.append(
            f"| {lv['clients']} | {lv['requests']} | {lv['tokens_per_s']:.1f} | "
            f"{lv['requests_per_s']:.2f} | {ratio} | {lv['latency_p50_s']:.2f} / "
            f"{lv['latency_p99_s']:.2f} | {lv['ttft_p50_s']:.2f} / {lv['ttft_p99_s']:.2f} | "
            f"{lv['lost']} | {lv['mixed_up']} | {lv['stopped']} | {valid} |"
        )
    top = levels[-1]
    if one and top["clients"] > 1:
        goal = top["tokens_per_s"] / one
        verdict = "met" if goal >= 3 else "not met"
        lines += [
            "",
            f"Goal: {top['clients']} clients ≥ 3× one client's throughput: "
            f"{goal:.2f}× — {verdict}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", default="1,4,16", help="concurrency levels (comma-separated)")
    p.add_argument("--requests", type=int, default=20, help="requests per client per level")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--server-args", default="", help="extra flags for constrained-spec serve")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    start, load_start = time.time(), f"{os.getloadavg()[0]:.2f}"
    levels = []
    with server_process("--max-queue", "256", *args.server_args.split()) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        for tag in range(TAGS):  # compile every schema before timing anything
            one_request(client, tag, 2, 0.0)
        for clients in [int(c) for c in args.clients.split(",")]:
            lv = level(client, clients, args.requests, args.max_tokens, args.temperature)
            levels.append(lv)
            print(
                f"{clients} clients: {lv['tokens_per_s']:.1f} tok/s, lost {lv['lost']}, "
                f"mixed up {lv['mixed_up']}",
                flush=True,
            )
    meta = {**run_metadata("benchmarks/load.py", argv, start), "load_start": load_start}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "levels": levels}, indent=1))
    (args.out / "report.md").write_text(report(levels, args, meta))
    print(report(levels, args, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
