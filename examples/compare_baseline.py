"""The same prompt, greedy, with plain masked decoding (baseline) and with speculation.

    python examples/compare_baseline.py [--max-new-tokens N] ["prompt"]

Prints tokens per second, target calls and whether the two outputs are identical. Greedy outputs
are identical up to floating point: a k-token verify pass and k one-token steps may differ in
the last bits, so at an exact near-tie of the top two logits the outputs could legitimately part.
"""

import argparse

from constrained_spec import Generator

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "email", "languages"],
}

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "prompt",
    nargs="?",
    default=(
        "Extract the person as JSON: Alice Martin, 30, alice@example.com, speaks French and "
        "English."
    ),
)
parser.add_argument("--max-new-tokens", type=int, default=80)
parser.add_argument("--num-draft-tokens", type=int, default=4)
args = parser.parse_args()

gen = Generator.from_pretrained()  # the default model with its draft head (draft="auto")
messages = [{"role": "user", "content": args.prompt}]
gen.generate(messages, schema=SCHEMA, max_new_tokens=2)  # warm-up: compile, first forwards

runs = {}
for name, speculative in (("baseline", False), ("speculative", True)):
    result = gen.generate(
        messages,
        schema=SCHEMA,
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.num_draft_tokens,
        speculative=speculative,
    )
    s, n = result.stats, len(result.token_ids)
    runs[name] = result
    print(
        f"{name:12s} {n / s.total_s:6.1f} tok/s  {n:4d} tokens  {s.target_calls:4d} target "
        f"calls  {s.total_s:6.2f} s  acceptance {s.acceptance_rate:.0%}"
    )

base, spec = runs["baseline"], runs["speculative"]
print(
    f"speed-up {base.stats.total_s / spec.stats.total_s:.2f}x;",
    "outputs identical"
    if base.token_ids == spec.token_ids
    else "outputs DIFFER (see the docstring: only a near-tie may explain it)",
)
print(spec.text)
