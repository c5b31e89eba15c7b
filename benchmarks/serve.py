"""`constrained-spec serve` under traffic from concurrent clients: a load test and a soak test.

The script starts the server on loopback itself.

    python benchmarks/serve.py load --clients 1,4,16 --requests 20 --out benchmarks/results/serve-load
    python benchmarks/serve.py soak --requests 10000 --minutes 30 --out benchmarks/results/soak

load: C concurrent clients × N streamed requests each. Per concurrency level: throughput
(completion tokens/s, requests/s), latency and time to first token (p50/p99), lost replies (an
error or no final chunk), mixed-up replies (a reply carrying another request's tag) and the share
of stopped replies that validate. Each request asks for JSON under a schema whose `request` field
is a const tag (one of TAGS values, compiled once in a warm-up): a reply delivered to the wrong
client shows its tag.

soak: many short mixed requests, the server's resident memory sampled as they go. The mix, by
request number i (i % 10): 0-3 a JSON Schema reply (one of TAGS schemas, checked against it), 4-5
the same streamed (half of the streams dropped after their first chunk), 6 a malformed schema (a
400 expected), 7 tools with tool_choice "auto" (a tool call's arguments checked against its
parameters), 8 a client that gives up after CLIENT_TIMEOUT_S, 9 a schema seen once (a new compile
each: the compiled-schema cache's cap at work). Counts: invalid (a finished reply its schema
rejects), 5xx, lost (no reply, a connection error, a stream without its last chunk, a malformed
schema not answered 4xx); RSS every SAMPLE_EVERY requests. Goal: RSS after the first 1,000
requests flat within 10%, 0 invalid, 0 5xx, 0 lost.

Both write results.json and report.md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
from report import run_metadata  # benchmarks/report.py: the script's folder is on sys.path

from constrained_spec.testing import server_process

TAGS = 20  # distinct schemas: compiled during the warm-up, then served from the cache
PEOPLE = [("Alice", 30), ("Bob", 7), ("Chen", 45), ("Dana", 62), ("Emeka", 19)]
CLIENT_TIMEOUT_S = 0.05  # soak's giving-up clients' read timeout: before the reply's end
SAMPLE_EVERY = 250  # soak's requests between RSS samples
TOOL = {  # soak's tools requests
    "type": "function",
    "function": {
        "name": "record_person",
        "description": "Record a person's name and age.",
        "parameters": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    },
}


def schema(tag: str) -> dict:
    """A person under a const ``request`` tag: a reply sent to the wrong client shows it."""
    return {
        "type": "object",
        "properties": {
            "request": {"const": tag},
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
        },
        "required": ["request", "name", "age"],
        "additionalProperties": False,
    }


def valid(text: str, wanted: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), wanted)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


# --- load ---------------------------------------------------------------------------------------


def load_request(client, i: int, max_tokens: int, temperature: float) -> dict:
    """Stream one request; returns its timings, text, finish_reason and checks."""
    tag, (name, age) = i % TAGS, PEOPLE[i % len(PEOPLE)]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema(f"r{tag}")}}
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
        row["valid"] = valid(text, schema(f"r{tag}"))
    return row


def load_level(client, clients: int, requests: int, max_tokens: int, temperature: float) -> dict:
    """C clients, each sending its N requests one after another."""

    def client_loop(c: int) -> list[dict]:
        return [
            load_request(client, c * requests + j, max_tokens, temperature) for j in range(requests)
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


def load_report(levels: list[dict], args, meta: dict) -> str:
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


# --- soak ---------------------------------------------------------------------------------------


def body(i: int, max_tokens: int) -> tuple[str, dict, dict | None]:
    """Request i's kind, JSON body and the schema its reply must satisfy (None: not checked)."""
    kind = {6: "malformed", 7: "tools", 8: "timeout", 9: "new schema"}.get(i % 10)
    kind = kind or ("stream" if i % 10 >= 4 else "schema")
    name, age = PEOPLE[i % len(PEOPLE)]
    wanted = schema(f"once{i}" if kind == "new schema" else f"r{i % TAGS}")
    messages = [{"role": "user", "content": f"Extract the person as JSON: {name}, {age} years."}]
    sent = {"model": "any", "messages": messages, "max_tokens": max_tokens, "seed": i}
    sent["temperature"] = 0.0 if i % 3 else 0.7
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": wanted}}
    if kind == "malformed":
        bad = [{"type": "nonsense"}, {"properties": []}, {"minimum": "x", "type": "integer"}]
        fmt["json_schema"]["schema"] = bad[i % 3]
    if kind == "tools":
        return kind, {**sent, "tools": [TOOL], "tool_choice": "auto"}, TOOL["function"]
    return kind, {**sent, "response_format": fmt, "stream": kind == "stream"}, wanted


def soak_request(client: httpx.Client, i: int, max_tokens: int) -> dict:
    kind, sent, wanted = body(i, max_tokens)
    row = {"i": i, "kind": kind, "status": None, "lost": False, "invalid": False}
    try:
        if kind == "stream":
            return _stream(client, sent, wanted, row, drop=(i // 10) % 2 == 1)
        timeout = CLIENT_TIMEOUT_S if kind == "timeout" else 300.0
        r = client.post("/v1/chat/completions", json=sent, timeout=timeout)
    except httpx.TimeoutException:
        row["lost"] = kind != "timeout"  # the ones that gave up did so on purpose
        return row
    except httpx.HTTPError as e:
        return {**row, "lost": True, "error": f"{type(e).__name__}: {e}"}
    row["status"] = r.status_code
    if kind == "malformed":
        row["lost"] = not 400 <= r.status_code < 500
        return row
    if r.status_code != 200:
        return {**row, "lost": True, "error": r.text[:200]}
    choice = r.json()["choices"][0]
    row["finish"] = choice["finish_reason"]
    if kind == "tools":
        for call in choice["message"].get("tool_calls") or []:
            row["invalid"] |= not valid(call["function"]["arguments"], wanted["parameters"])
    elif choice["finish_reason"] == "stop":
        row["invalid"] = not valid(choice["message"]["content"], wanted)
    return row


def _stream(client, sent: dict, wanted: dict, row: dict, drop: bool) -> dict:
    pieces, finish = [], None
    with client.stream("POST", "/v1/chat/completions", json=sent, timeout=300.0) as r:
        row["status"] = r.status_code
        if r.status_code != 200:
            return {**row, "lost": True, "error": r.read()[:200].decode(errors="replace")}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if drop:  # the client goes away after the first chunk
                row["dropped"] = True
                return row
            choice = json.loads(line[6:])["choices"][0]
            pieces.append(choice["delta"].get("content") or "")
            finish = choice.get("finish_reason") or finish
    row.update(finish=finish, lost=finish is None)
    if finish == "stop":
        row["invalid"] = not valid("".join(pieces), wanted)
    return row


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def server_pid() -> int:
    """The serve child of this process."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"serve" in cmdline:
            return int(stat.parent.name)
    raise RuntimeError("no `constrained-spec serve` child found")


def soak(url: str, requests: int, clients: int, max_tokens: int, deadline: float) -> dict:
    pid, rows, samples = server_pid(), [], [(0, 0.0, rss_mb(server_pid()))]
    lock, start, issued = threading.Lock(), time.perf_counter(), iter(range(requests))

    def client_loop(_: int) -> None:
        with httpx.Client(base_url=url) as client:
            while time.perf_counter() < deadline:
                with lock:
                    i = next(issued, None)
                if i is None:
                    return
                row = soak_request(client, i, max_tokens)
                with lock:
                    rows.append(row)
                    if len(rows) % SAMPLE_EVERY == 0:
                        samples.append((len(rows), time.perf_counter() - start, rss_mb(pid)))
                        print(f"{len(rows)} requests, RSS {samples[-1][2]:.0f} MB", flush=True)

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client_loop, range(clients)))
    samples.append((len(rows), time.perf_counter() - start, rss_mb(pid)))
    return {"rows": rows, "samples": samples, "wall_s": time.perf_counter() - start}


def verdict(result: dict, requests: int) -> dict:
    rows, samples = result["rows"], result["samples"]
    after = [s for s in samples if s[0] >= 1000]
    base = after[0][2] if after else float("nan")
    top = max((s[2] for s in after), default=float("nan"))
    return {
        "done": len(rows),
        "asked": requests,
        "invalid": sum(r["invalid"] for r in rows),
        "5xx": sum(1 for r in rows if (r["status"] or 0) >= 500),
        "lost": sum(r["lost"] for r in rows),
        "rss_at_1000_mb": base,
        "rss_max_after_1000_mb": top,
        "rss_end_mb": samples[-1][2],
        "rss_growth": (top - base) / base if after else float("nan"),
        "by_kind": {
            k: sum(r["kind"] == k for r in rows) for k in sorted({r["kind"] for r in rows})
        },
        "dropped_streams": sum(bool(r.get("dropped")) for r in rows),
        "stopped": sum(r.get("finish") == "stop" for r in rows),
        "cut": sum(r.get("finish") == "length" for r in rows),
        "tool_calls_or_text": sum(r["kind"] == "tools" and r["status"] == 200 for r in rows),
    }


def soak_report(v: dict, result: dict, args, meta: dict) -> str:
    flat = v["rss_growth"] <= 0.10
    met = flat and v["invalid"] == v["5xx"] == v["lost"] == 0 and v["done"] == v["asked"]
    lines = [
        "# Soak: `constrained-spec serve` under mixed traffic",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Run {meta['date']}, {result['wall_s'] / 60:.1f} min; {meta['machine']}; git "
        f"{meta['commit']}; server flags `{args.server_args or '(defaults)'}`; {args.clients} "
        f"clients, max_tokens {args.max_tokens}.",
        "",
        f"Requests: {v['done']} of {v['asked']} ({', '.join(f'{k} {n}' for k, n in v['by_kind'].items())}); "
        f"{v['dropped_streams']} streams dropped after their first chunk; {v['stopped']} replies "
        f"finished (checked), {v['cut']} cut at max_tokens.",
        f"Invalid replies: {v['invalid']}. 5xx: {v['5xx']}. Lost: {v['lost']}.",
        f"RSS: {v['rss_at_1000_mb']:.0f} MB after 1,000 requests, at most "
        f"{v['rss_max_after_1000_mb']:.0f} MB after that ({100 * v['rss_growth']:+.1f}%), "
        f"{v['rss_end_mb']:.0f} MB at the end.",
        "",
        f"Goal (RSS within 10% after 1,000 requests, 0 invalid, 0 5xx, 0 lost, every request "
        f"sent): {'met' if met else 'not met'}.",
        "",
        "| requests | minutes | RSS MB |",
        "|---|---|---|",
    ]
    shown = result["samples"][::4]
    shown += result["samples"][-1:] if result["samples"][-1] not in shown else []
    lines += [f"| {n} | {t / 60:.1f} | {mb:.0f} |" for n, t, mb in shown]
    return "\n".join(lines) + "\n"


def measure_load(url: str, args) -> list[dict]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    for tag in range(TAGS):  # compile every schema before timing anything
        load_request(client, tag, 2, 0.0)
    levels = []
    for clients in [int(c) for c in args.clients.split(",")]:
        lv = load_level(client, clients, args.requests, args.max_tokens, args.temperature)
        levels.append(lv)
        print(
            f"{clients} clients: {lv['tokens_per_s']:.1f} tok/s, lost {lv['lost']}, "
            f"mixed up {lv['mixed_up']}",
            flush=True,
        )
    return levels


def load_results(levels: list[dict], args, meta: dict) -> tuple[dict, str]:
    return {"levels": levels}, load_report(levels, args, meta)


def measure_soak(url: str, args) -> dict:
    with httpx.Client(base_url=url) as client:  # the first request's one-off work
        soak_request(client, 0, 4)
    deadline = time.perf_counter() + 60 * args.minutes
    return soak(url, args.requests, args.clients, args.max_tokens, deadline)


def soak_results(result: dict, args, meta: dict) -> tuple[dict, str]:
    v = verdict(result, args.requests)
    return {"verdict": v, "samples": result["samples"]}, soak_report(v, result, args, meta)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    load = sub.add_parser("load", help="C concurrent clients × N streamed requests each")
    load.add_argument("--clients", default="1,4,16", help="concurrency levels (comma-separated)")
    load.add_argument("--requests", type=int, default=20, help="requests per client per level")
    load.add_argument("--max-tokens", type=int, default=48)
    load.add_argument("--temperature", type=float, default=0.0)
    load.set_defaults(measure=measure_load, results=load_results)
    soak = sub.add_parser("soak", help="many short mixed requests, the server's RSS sampled")
    soak.add_argument("--requests", type=int, default=10_000)
    soak.add_argument("--minutes", type=float, default=30.0, help="stop sending after this long")
    soak.add_argument("--clients", type=int, default=8)
    soak.add_argument("--max-tokens", type=int, default=24)
    soak.set_defaults(measure=measure_soak, results=soak_results)
    for command in (load, soak):
        command.add_argument(
            "--server-args", default="", help="extra flags for constrained-spec serve"
        )
        command.add_argument("--out", required=True, type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    start, load_start = time.time(), f"{os.getloadavg()[0]:.2f}"
    with server_process("--max-queue", "256", *args.server_args.split()) as url:
        measured = args.measure(url, args)
    meta = {**run_metadata("benchmarks/serve.py", argv, start), "load_start": load_start}
    results, text = args.results(measured, args, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, **results}, indent=1))
    (args.out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
