"""The KV-cache pool (``llama.CachePool``) on and off, taking turns in one process, on the
server's workload (load.py's requests, decoded in-process as the server's batcher does, no HTTP).

    python benchmarks/cache_pool.py --requests 64 --batches 1,16 --rounds 3

A fresh cache is a few MB of new pages; the kernel faults each page in on first touch. With
many caches alive at once (a batch of rows) the allocator returns freed ones to the system and
the next row faults them in again; the pool keeps dropped caches' buffers for the next row.
Prints per batch size and round the output tok/s, the page faults and the system CPU seconds of
each, then the median ratio (pool / none). Both must give every request the same tokens.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import PEOPLE, TAGS, schema  # noqa: E402

from constrained_spec import Generator, llama  # noqa: E402
from constrained_spec import batch as batching  # noqa: E402


def request(i: int, max_tokens: int) -> dict:
    tag, (name, age) = i % TAGS, PEOPLE[i % len(PEOPLE)]
    content = f"Extract the person as JSON: {name}, {age} years."
    return dict(
        prompt=[{"role": "user", "content": content}],
        schema=schema(tag),
        max_new_tokens=max_tokens,
        temperature=0.0,
        seed=i,
    )


def run(gen: Generator, requests: list[dict], batch: int) -> tuple[float, int, float, list]:
    """Decode ``requests`` ``batch`` at a time: tok/s, page faults, system seconds, tokens."""
    rows = [gen.prepare_row(i, r) for i, r in enumerate(requests)]
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for row in batching.decode_batch(gen.target, rows, batch):
        row.cache = None  # as the server does: a finished row's cache is dropped at once
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    tokens = [r.tokens[len(r.prompt) :] for r in rows]
    faults, system = after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime
    return sum(map(len, tokens)) / wall, faults, system, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batches", default="1,16", help="batch sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the server's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = Generator.from_pretrained()
    requests = [request(i, args.max_tokens) for i in range(args.requests)]
    run(gen, requests[:TAGS], 1)  # warm-up: every tag's schema compiled, the kernels loaded
    pools = {"none": llama.CachePool(0), "pool": gen.target.cache_pool}
    speeds, outputs = {}, {}
    print(f"{args.requests} requests, max {args.max_tokens} tokens, {args.threads} thread(s)")
    for round_ in range(args.rounds):
        for batch in map(int, args.batches.split(",")):
            names = ("none", "pool") if round_ % 2 == 0 else ("pool", "none")
            for name in names:
                gen.target.cache_pool = pools[name]
                tok_s, faults, system, tokens = run(gen, requests, batch)
                if outputs.setdefault(batch, tokens) != tokens:
                    raise SystemExit(f"B = {batch}: the tokens differ with the pool {name}")
                speeds.setdefault(batch, {}).setdefault(name, []).append(tok_s)
                print(
                    f"round {round_} B = {batch:2d} {name:4s}: {tok_s:6.1f} tok/s, "
                    f"{faults:6d} page faults, {system:.2f} s system",
                    flush=True,
                )
    for batch, values in speeds.items():
        ratios = [p / n for p, n in zip(values["pool"], values["none"])]
        print(
            f"B = {batch}: none {statistics.median(values['none']):.1f} tok/s, pool "
            f"{statistics.median(values['pool']):.1f} tok/s; pool faster by "
            f"{statistics.median(ratios):.2f}× (rounds {min(ratios):.2f}–{max(ratios):.2f}×)"
        )


if __name__ == "__main__":
    main()
