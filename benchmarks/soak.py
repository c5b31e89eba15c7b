"""Soak test of `constrained-spec serve`: many short mixed requests on loopback, the server's
resident memory sampled as they go.

The mix, by request number i (i % 10): 0-3 a JSON Schema reply (one of TAGS schemas, checked
against it), 4-5 the same streamed (half of the streams dropped after their first chunk), 6 a
malformed schema (a 400 expected), 7 tools with tool_choice "auto" (a tool call's arguments
checked against its parameters), 8 a client that gives up after CLIENT_TIMEOUT_S, 9 a schema
seen once (a new compile each: the compiled-schema cache's cap at work).

Counts: invalid (a finished reply its schema rejects), 5xx, lost (no reply, a connection error,
a stream without its last chunk, a malformed schema not answered 4xx); RSS every SAMPLE_EVERY
requests. Goal: RSS after the first 1,000 requests flat within 10%, 0 invalid, 0 5xx, 0 lost.

    python benchmarks/soak.py --requests 10000 --minutes 30 --out benchmarks/results/soak
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
from report import run_metadata  # benchmarks/report.py: the script's folder is on sys.path

from constrained_spec.testing import server_process

TAGS = 20
PEOPLE = [("Alice", 30), ("Bob", 7), ("Chen", 45), ("Dana", 62), ("Emeka", 19)]
CLIENT_TIMEOUT_S = 0.05  # the giving-up clients' read timeout: before the reply's end
SAMPLE_EVERY = 250  # requests between RSS samples
TOOL = {
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


def one_request(client: httpx.Client, i: int, max_tokens: int) -> dict:
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
            row["invalid"] |= not _valid(call["function"]["arguments"], wanted["parameters"])
    elif choice["finish_reason"] == "stop":
        row["invalid"] = not _valid(choice["message"]["content"], wanted)
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
        row["invalid"] = not _valid("".join(pieces), wanted)
    return row


def _valid(text: str, wanted: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), wanted)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


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
                row = one_request(client, i, max_tokens)
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


def report(v: dict, result: dict, args, meta: dict) -> str:
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--minutes", type=float, default=30.0, help="stop sending after this long")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--server-args", default="", help="extra flags for constrained-spec serve")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    start = time.time()
    with server_process("--max-queue", "256", *args.server_args.split()) as url:
        with httpx.Client(base_url=url) as client:  # the first request's one-off work
            one_request(client, 0, 4)
        deadline = time.perf_counter() + 60 * args.minutes
        result = soak(url, args.requests, args.clients, args.max_tokens, deadline)
    v, meta = verdict(result, args.requests), run_metadata("benchmarks/soak.py", argv, start)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps({"meta": meta, "verdict": v, "samples": result["samples"]}, indent=1)
    )
    (args.out / "report.md").write_text(report(v, result, args, meta))
    print(report(v, result, args, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
