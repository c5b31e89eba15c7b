"""Why a fresh llguidance mask costs more inside decoding than back to back: the masks along
each request's expected answer (the engine-rewrites-e2e requests), cold (caches cleared), once
with nothing between them and once after a 100 MB read between masks, as a 4-bit forward
streams its weights between two masks; then the same states again (masks met before).

    python benchmarks/mask_eviction.py > benchmarks/results/engine-rewrites-e2e/mask-eviction.txt
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
            c.clear_caches()
            c._snapshots.clear()
            c._matcher, c._at = c._root.deep_copy(), 0
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


def main() -> None:
    tok = load_tokenizer()
    vocab = token_vocabulary(tok)
    requests = json.loads(REQUESTS.read_text())["requests"][:8]
    weights = np.ones(100_000_000 // 4, dtype=np.float32)  # as much as a step's weights
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
