"""Why a fresh llguidance mask costs more inside decoding than back to back: the masks along
each request's expected answer (the engine-rewrites-e2e requests), cold (caches cleared), once
with nothing between them and once after a 100 MB read between masks, as a 4-bit forward
streams its weights between two masks; then the same states again (masks met before).
``--calls``: each part of a fresh state's work alone after the same read (llguidance's calls,
the numpy and torch calls that turned its bitmask into a mask before round 4, the integer
operations and the one conversion per pass that do it since).
``--draft-call``: a 3-token draft's 4 masks after the same read, the way the engine computes them
(a mask, a snapshot copy and a consumed token per position) against llguidance's one call for a
draft (``fill_next_token_bitmask_par_with_draft_tokens``), checked equal.

    python benchmarks/mask_eviction.py > benchmarks/results/engine-rewrites-e2e/mask-eviction.txt
    python benchmarks/mask_eviction.py --calls > benchmarks/results/mask-bits/calls.txt
    python benchmarks/mask_eviction.py --draft-call > benchmarks/results/mask-bits/draft-call.txt
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from constrained_spec import guidance  # noqa: E402
from constrained_spec.models import load_tokenizer  # noqa: E402
from constrained_spec.vocab import token_vocabulary  # noqa: E402

REQUESTS = ROOT / "benchmarks/results/engine-rewrites-e2e/extract-after/requests.json"


def fresh_masks(requests, tok, vocab, between, fresh: bool = True) -> list[float]:
    """Seconds per mask at each state along each expected answer, nothing cached (``fresh``)
    or as the previous call left the caches."""
    times = []
    for q in requests:
        c = guidance.compile_constraint("auto", vocab, len(tok), schema=q["schema"])
        if fresh:
            c.clear_caches()  # masks and matcher copies
        state = c.initial_state
        for token in tok.encode(json.dumps(q["expected"], separators=(",", ":"))):
            between()
            t = time.perf_counter()
            c.mask(state)
            times.append(time.perf_counter() - t)
            state = c.step(state, token)
            if state is None:
                break
    return times


def calls(requests, tok, vocab, between) -> dict[str, list[float]]:
    """Seconds of each part of a fresh state's work, each timed alone after ``between()``."""
    import torch

    times: dict[str, list[float]] = {}

    def timed(name, call):
        between()
        t = time.perf_counter()
        out = call()
        times.setdefault(name, []).append(time.perf_counter() - t)
        return out

    for q in requests:
        c = guidance.compile_constraint("auto", vocab, len(tok), schema=q["schema"])
        n, width, matcher = len(vocab.token_bytes), c.vocab_size, c._root.deep_copy()
        for token in tok.encode(json.dumps(q["expected"], separators=(",", ":"))):
            raw = timed("llguidance compute_bitmask", matcher.compute_bitmask)
            timed("llguidance deep_copy (a snapshot)", matcher.deep_copy)
            bits = np.frombuffer(raw, dtype=np.uint8)
            m = timed("before: np.zeros", lambda: np.zeros(width, dtype=bool))
            u = timed("before: np.unpackbits", lambda: np.unpackbits(bits, bitorder="little"))
            u = timed("before: astype(bool)", lambda: u[:n].astype(bool))
            m[:n] = timed("before: & the text tokens", lambda: u & c._plain)
            timed("before: torch.from_numpy", lambda: torch.from_numpy(m))
            row = timed(
                "now: the int operations of a state",
                lambda: (int.from_bytes(raw, "little") & c._plain_bits).to_bytes(
                    c._width, "little"
                ),
            )
            timed("now: a 4-state pass's conversion", lambda: c._tensor([0] * 4, "cpu"))
            timed("now: a step's bit test", lambda: row[token >> 3] >> (token & 7) & 1)
            if not timed("llguidance consume_token", lambda: matcher.consume_token(token)):
                break
    return times


def draft_call(requests, tok, vocab, between) -> dict[str, list[float]]:
    """Seconds for the 4 masks of a 3-token draft from every 4th position of each expected
    answer, after ``between()``: one position at a time as ``GuidanceConstraint`` does, and in
    llguidance's one call for a draft; asserts both give the same legal tokens."""
    import llguidance as llg
    from llguidance.torch import (
        allocate_token_bitmask,
        fill_next_token_bitmask_par_with_draft_tokens,
    )

    executor, times = llg.LLExecutor(1), {"one position at a time": [], "one call": []}
    legal_ids = (1 << len(vocab.token_bytes)) - 1  # the bits of tokenizer ids (rows are padded)
    for q in requests:
        c = guidance.compile_constraint("auto", vocab, len(tok), schema=q["schema"])
        answer = tok.encode(json.dumps(q["expected"], separators=(",", ":")))
        target = allocate_token_bitmask(4, len(vocab.token_bytes))
        for start in range(0, len(answer) - 3, 4):
            base = c._root.deep_copy()
            assert base.consume_tokens(answer[:start])
            draft, matcher = answer[start : start + 3], base.deep_copy()
            between()
            t = time.perf_counter()
            rows = [matcher.compute_bitmask()]
            for token in draft:
                matcher.deep_copy()  # the snapshot the engine keeps of every state
                matcher.consume_token(token)
                rows.append(matcher.compute_bitmask())
            times["one position at a time"].append(time.perf_counter() - t)
            matcher = base.deep_copy()
            between()
            t = time.perf_counter()
            fill_next_token_bitmask_par_with_draft_tokens(executor, [(matcher, 0, draft)], target)
            times["one call"].append(time.perf_counter() - t)
            for row, got in zip(rows, target.numpy()):
                one = int.from_bytes(row, "little") & legal_ids
                assert one == int.from_bytes(got.tobytes(), "little") & legal_ids
    return times


def main() -> None:
    tok = load_tokenizer()
    vocab = token_vocabulary(tok)
    requests = json.loads(REQUESTS.read_text())["requests"][:8]
    weights = np.ones(100_000_000 // 4, dtype=np.float32)  # as much as a step's weights
    modes = {  # flag: (what it times, its title, a row's name width, what a row counts)
        "--calls": (calls, "each call alone, after a 100 MB read", 40, "calls"),
        "--draft-call": (
            draft_call,
            "a 3-token draft's 4 masks after a 100 MB read, the same legal tokens both ways",
            25,
            "drafts",
        ),
    }
    for flag, (timing, title, width, unit) in modes.items():
        if flag in sys.argv:
            print(
                f"{len(requests)} extract requests of {REQUESTS.parent.name}: {title} (median µs)"
            )
            for name, t in timing(requests, tok, vocab, weights.sum).items():
                print(f"{name:>{width}}: {1e6 * np.median(t):6.1f}  ({len(t)} {unit})")
            return
    print(f"{len(requests)} extract requests of {REQUESTS.parent.name}, the default tokenizer")
    for name, between in [
        ("back to back", lambda: None),
        ("after a 100 MB read", weights.sum),
    ] * 2:
        t = fresh_masks(requests, tok, vocab, between)
        print(
            f"{name:>20}: {len(t)} fresh masks, mean {1e6 * np.mean(t):.1f} µs, "
            f"median {1e6 * np.median(t):.1f} µs"
        )
    t = fresh_masks(requests, tok, vocab, weights.sum, fresh=False)
    print(
        f"{'met before':>20}: {len(t)} masks after a 100 MB read, mean {1e6 * np.mean(t):.1f} "
        f"µs, median {1e6 * np.median(t):.1f} µs"
    )


if __name__ == "__main__":
    main()
