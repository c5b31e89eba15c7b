"""The corpus job end to end: `constrained-spec batch` over N rows, interrupted (SIGINT) midway and
rerun; checks every id is written exactly once as a whole line, and compares the job's tok/s with
the same rows run in-process through Generator.generate_batch.

    python benchmarks/batch_job.py --rows 1000 --out benchmarks/results/batch-job
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from constrained_spec import Generator

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
NAMES = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jia"]


def make_rows(n: int) -> list[dict]:
    return [
        {
            "id": i,
            "prompt": f"Extract name and age as JSON: {NAMES[i % 10]} {i % 7}, aged {20 + i % 50}.",
        }
        for i in range(n)
    ]


def run_cli(args, input_path: Path, output: Path, stop_after: float | None) -> float:
    command = [
        sys.executable,
        "-m",
        "constrained_spec",
        "batch",
        "--input",
        str(input_path),
        "--output",
        str(output),
        "--schema",
        json.dumps(SCHEMA),
        "--batch-size",
        str(args.batch_size),
        "--max-new-tokens",
        str(args.max_new_tokens),
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    if stop_after is not None:
        time.sleep(stop_after)
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate()
    if stop_after is None and proc.returncode != 0:
        raise SystemExit(f"the job failed ({proc.returncode}): {err[-2000:]}")
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--interrupt-after", type=float, default=60.0, help="seconds into run 1")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = make_rows(args.rows)
    input_path, output = out / "input.jsonl", out / "output.jsonl"
    input_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output.unlink(missing_ok=True)

    first = run_cli(args, input_path, output, args.interrupt_after)
    after_interrupt = len(output.read_text().splitlines())
    second = run_cli(args, input_path, output, None)
    lines = [json.loads(line) for line in output.read_text().splitlines()]  # all whole JSON
    ids = [line["id"] for line in lines]
    tokens = sum(line["stats"]["tokens"] + (line["finish_reason"] == "stop") for line in lines)

    gen = Generator.from_pretrained(draft="lookup")
    requests = [
        dict(
            prompt=[{"role": "user", "content": row["prompt"]}],
            schema=SCHEMA,
            max_new_tokens=args.max_new_tokens,
        )
        for row in rows
    ]
    start = time.perf_counter()
    results = gen.generate_batch(requests, batch_size=args.batch_size)
    in_process = time.perf_counter() - start
    in_tokens = sum(len(r.token_ids) + (r.finish_reason == "stop") for r in results)
    same = sum(line["text"] == results[line["id"]].text for line in lines if "text" in line)
    summary = {
        "command": shlex.join(["python", *sys.argv]),
        "rows": args.rows,
        "lines_after_interrupt": after_interrupt,
        "lines": len(lines),
        "ids_once": sorted(ids) == list(range(args.rows)),
        "stopped": sum(line.get("finish_reason") == "stop" for line in lines),
        "errors": sum("error" in line for line in lines),
        "job_s": first + second,
        "in_process_s": in_process,
        "in_process_tok_s": in_tokens / in_process,
        "same_text_as_in_process": same,
    }
    rerun_tokens = sum(
        line["stats"]["tokens"] + (line["finish_reason"] == "stop")
        for line in lines[after_interrupt:]
    )
    summary["job_tok_s_resumed_run"] = rerun_tokens / second
    summary["job_tok_s_overall"] = tokens / (first + second)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if summary["ids_once"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
