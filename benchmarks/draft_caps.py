"""The draft cap (``CompositeDrafter.max_draft``) per batch size, measured without the machine's
noise: greedy rows decoded in-process (as the server's batcher does) under each cap, every pass's
width (the tokens it feeds, all rows together) recorded, and the rounds' cost modelled from this
machine's pass-cost curve (the layers over W tokens, best of 5), measured once at the start.

    python benchmarks/draft_caps.py --workload server --batches 1,8,16 --caps 3,2,1
    python benchmarks/draft_caps.py --workload extract --seed 1 --requests 16

Greedy outputs do not depend on the drafts, so every cap must commit the same tokens (checked);
only the passes differ. A wide pass costs its tokens' compute, so a draft token pays only where
it is accepted often enough: the modelled tok/s says which cap does, the wall tok/s (noisy,
prefills included) is printed beside it. ``--seed`` picks the extract requests: tune on one
seed, report on another (the headline reports use seed 0). ``--repeat N`` runs the caps N times
taking turns, so their wall clocks meet the same stretch of the machine and warm kept prompts
(the first run of all reads the prompts cold).
The batcher's own cap for wide batches (``batch.WIDE_BATCH``) is turned off here.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402
from cache_pool import request  # noqa: E402

from constrained_spec import Generator  # noqa: E402
from constrained_spec import batch as batching  # noqa: E402
from constrained_spec import cache as kv  # noqa: E402

WIDTHS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]


def cost_curve(model) -> list[float]:
    """Milliseconds of the layers over each of WIDTHS new tokens after a 200-token context."""
    context = torch.arange(200) % 1000
    cache = model.new_cache()
    model(context, cache, logits=False)
    curve = []
    for width in WIDTHS:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            model(context[:width], cache, logits=False)
            best = min(best, time.perf_counter() - start)
            cache.crop(200)
        curve.append(best * 1e3)
    return curve


def modelled_ms(curve: list[float], width: int) -> float:
    """The curve at ``width``, linear between its points (and beyond its last)."""
    i = bisect.bisect_left(WIDTHS, width)
    if i == len(WIDTHS):
        return curve[-1] * width / WIDTHS[-1]
    if WIDTHS[i] == width:
        return curve[i]
    w0, w1, c0, c1 = WIDTHS[i - 1], WIDTHS[i], curve[i - 1], curve[i]
    return c0 + (c1 - c0) * (width - w0) / (w1 - w0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="server", choices=["server", "extract", "generate"])
    parser.add_argument("--seed", type=int, default=1, help="which extract/generate requests")
    parser.add_argument("--requests", type=int, default=16, help="(server: always 64)")
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--caps", default="3,2,1")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of the caps, taking turns (wall clocks)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # the server's setting
    gen = Generator.from_pretrained()
    curve = cost_curve(gen.target)
    print("pass cost (ms):", ", ".join(f"{w}: {c:.1f}" for w, c in zip(WIDTHS, curve)))
    if args.workload == "server":
        requests = [request(i, 48) for i in range(64)]
    else:
        selected, _ = workloads.select_requests(
            gen, args.workload, args.requests, workloads.Selection(args.seed), log=lambda *a: 0
        )
        requests = [
            dict(prompt=r.messages, schema=r.schema, max_new_tokens=160, temperature=0.0, seed=i)
            for i, r in enumerate(selected[1:])
        ]
    widths, forward_rows = [], kv.forward_rows

    def recorded(model, caches, rows, device, masks=None):
        widths.append(sum(map(len, rows)))
        return forward_rows(model, caches, rows, device, masks)

    kv.forward_rows = recorded
    batching.WIDE_BATCH = sys.maxsize  # each cap as given: the batcher's own rule off
    base, outputs = gen.drafter, {}
    for batch in map(int, args.batches.split(",")):
        for cap in [int(c) for _ in range(args.repeat) for c in args.caps.split(",")]:
            gen.drafter = dataclasses.replace(base, max_draft=cap)
            rows = [gen.prepare_row(i, r) for i, r in enumerate(requests)]
            widths.clear()
            start = time.perf_counter()
            for row in batching.decode_batch(gen.target, rows, batch):
                row.cache = None
            wall = time.perf_counter() - start
            tokens = [row.tokens for row in rows]
            if outputs.setdefault(batch, tokens) != tokens:
                raise SystemExit(f"B = {batch}, cap {cap}: greedy tokens differ from cap's before")
            n = sum(len(row.tokens) - len(row.prompt) for row in rows)
            rounds_s = sum(modelled_ms(curve, w) for w in widths) / 1e3
            print(
                f"{args.workload} B = {batch:2d} cap {cap}: {n} tokens, {len(widths)} passes "
                f"feeding {sum(widths)}; modelled rounds {rounds_s:.2f} s = {n / rounds_s:.1f} "
                f"tok/s; wall {n / wall:.1f} tok/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
