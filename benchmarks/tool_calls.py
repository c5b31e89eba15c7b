"""tool_choice "auto" on the dev set's function-calling schemas (BFCL, Glaive): every call's
arguments checked against its tool's parameters, the share of replies that call a tool, and the
calls' values against the instance the question states (the function and its arguments exactly,
and the share of argument leaves right: numbers compared as numbers).

    python benchmarks/tool_calls.py --n 200 --data /path/to/jsonschemabench-dev
    python benchmarks/tool_calls.py --n 200 --data ... --temperature 1 --tool-choice required

Each file is one request: its tools (BFCL: one per function, the schema's {name: parameters};
Glaive: the file's function, named from the file, with the schema as its parameters) and a user
message asking for what the file's first valid instance does ("Please get historical GDP:
country: US, start_year: 2000."). Requests run as the server runs them: ``server.plan`` builds
the constraint and the tools' preamble a client gets, ``Generator.generate`` decodes (the
default model; request i is seeded i), ``server.message`` reads the calls back. A tool whose parameters the
compiler refuses is counted as refused (the server answers 400).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

from constrained_spec import Generator  # noqa: E402
from constrained_spec.server import (  # noqa: E402
    APIError,
    ChatRequest,
    ServerConfig,
    as_request,
    message,
    plan,
)
from constrained_spec.testing import schema_validator  # noqa: E402

SOURCES = ("BFCL_", "Glaiveai2K---")


def tools_of(path: Path, schema: dict) -> dict[str, dict]:
    """{tool name: parameters} of a file: BFCL's functions (one property each, or an anyOf of
    them), or the Glaive file's function."""
    if path.name.startswith("Glaiveai2K---"):
        return {re.sub(r"_[0-9a-f]{8}$", "", path.stem.split("---")[1]): schema}
    branches = schema.get("anyOf", [schema])
    return {name: params for b in branches for name, params in b["properties"].items()}


def expected_calls(tools: dict, instance) -> dict:
    """{function: arguments} the valid instance asks for."""
    if len(tools) == 1 and not set(instance) <= set(tools):  # Glaive: the arguments themselves
        (name,) = tools
        return {name: instance}
    return instance


def question(tools: dict, instance) -> str:
    """A user message asking for what the valid instance does."""
    instance = expected_calls(tools, instance)
    asks = []
    for name, arguments in instance.items():
        details = ", ".join(f"{k}: {json.dumps(v)}" for k, v in (arguments or {}).items())
        asks.append(f"{name.replace('_', ' ').replace('.', ' ')}: {details}")
    return "Please " + "; and ".join(asks) + "."


def requests(data: Path, n: int) -> list[tuple[str, dict, str, dict]]:
    """(file name, tools, question, the calls it asks for) of n seeded-random function-calling
    files with a valid instance."""
    files = sorted(p for p in data.glob("*.json") if p.name.startswith(SOURCES))
    random.Random(0).shuffle(files)
    out = []
    for path in files:
        item = json.loads(path.read_text())
        valid = [t["data"] for t in item.get("tests", []) if t.get("valid")]
        if valid and isinstance(valid[0], dict):
            tools = tools_of(path, item["schema"])
            expected = expected_calls(tools, valid[0])
            out.append((path.name, tools, question(tools, valid[0]), expected))
        if len(out) == n:
            break
    return out


def run(gen: Generator, chosen, args) -> tuple[Counter, list[dict]]:
    counts, invalid = Counter(), []
    config = ServerConfig()
    for i, (name, tools, text, expected) in enumerate(chosen):
        listed = [
            {"type": "function", "function": {"name": re.sub(r"[^\w.-]", "_", t), "parameters": p}}
            for t, p in tools.items()
        ]
        request = ChatRequest(
            messages=[{"role": "user", "content": text}],
            tools=listed,
            tool_choice=args.tool_choice,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            seed=i,
        )
        try:
            p = plan(request, config)
        except APIError as e:
            counts["refused"] += 1
            print(f"refused {name}: {e.message[:120]}", file=sys.stderr)
            continue
        result = gen.generate(as_request(p))
        msg, finish = message(p, result)
        counts[finish] += 1
        calls = len(msg.get("tool_calls") or [])
        print(json.dumps({"file": name, "finish": finish, "calls": calls}), file=sys.stderr)
        params = {t["function"]["name"]: t["function"]["parameters"] for t in listed}
        wanted = {re.sub(r"[^\w.-]", "_", t): a or {} for t, a in expected.items()}
        for call in msg.get("tool_calls") or []:
            counts["calls"] += 1
            arguments = json.loads(call["function"]["arguments"])
            want = wanted.get(call["function"]["name"])
            counts["right_calls"] += want is not None and _same(arguments, want)
            right, total = _leaves_right(arguments, want or {})
            counts["right_leaves"], counts["leaves"] = (
                counts["right_leaves"] + right,
                counts["leaves"] + total,
            )
            errors = list(schema_validator(params[call["function"]["name"]]).iter_errors(arguments))
            if errors:
                invalid.append({"file": name, "call": call["function"], "error": errors[0].message})
    return counts, invalid


def _same(a, b) -> bool:
    """JSON values equal, numbers compared as numbers."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b) and not isinstance(b, bool)
    return a == b


def _leaves_right(got, want) -> tuple[int, int]:
    """(leaves of ``want`` that ``got`` has equal at the same path, leaves of ``want``)."""
    if isinstance(want, dict) and want:
        pairs = [
            _leaves_right(got.get(k) if isinstance(got, dict) else None, v) for k, v in want.items()
        ]
        return sum(r for r, _ in pairs), sum(t for _, t in pairs)
    if isinstance(want, list) and want:
        got = got if isinstance(got, list) else []
        pairs = [_leaves_right(got[i] if i < len(got) else None, v) for i, v in enumerate(want)]
        return sum(r for r, _ in pairs), sum(t for _, t in pairs)
    return int(_same(got, want)), 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--data", type=Path, default=HERE / "data" / "sample")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tool-choice", default="auto", choices=["auto", "required"])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--model", default=None, help="default: the built-in default model")
    args = ap.parse_args()
    chosen = requests(args.data, args.n)
    gen = Generator.from_pretrained(args.model) if args.model else Generator.from_pretrained()
    start = time.perf_counter()
    counts, invalid = run(gen, chosen, args)
    replies = len(chosen) - counts["refused"]
    report = {
        "tool_choice": args.tool_choice,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "requests": len(chosen),
        "refused": counts["refused"],
        "replies": replies,
        "called_a_tool": counts["tool_calls"],
        "share_calling": round(counts["tool_calls"] / replies, 3) if replies else None,
        "text": counts["stop"],
        "cut_at_max_tokens": counts["length"],
        "calls": counts["calls"],
        "right_calls": counts["right_calls"],  # the function and its arguments as asked
        "right_leaves": round(counts["right_leaves"] / counts["leaves"], 3)
        if counts["leaves"]
        else None,
        "invalid_arguments": len(invalid),
        "invalid": invalid[:10],
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
