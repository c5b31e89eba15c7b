"""Replay a draft head's greedy rounds offline on a benchmark run's baseline outputs.

    python benchmarks/replay_head.py benchmarks/results/generate-head8 [--head PATH] [--k 4]

Greedy decoding commits the baseline's tokens whatever the drafter, so the rounds of `head/k{k}`
depend on the head alone: one target pass per request gives every feature, and the replay runs
the drafter's own code (CompositeDrafter over HeadDraft, as `head/k{k}`) round by round. It
reproduces the benchmark's tokens per call (generate-head8: 3.62) in seconds
instead of minutes and times nothing, so it compares heads, not speed.

Printed per run: tokens per call, α solved from them (as the benchmark report does), acceptance
by draft position given the earlier ones; and, teacher-forced at every non-forced position, how
often the head's first draft is the target's token, how often the bigram copy proposal is, and
how often the head takes a right proposal.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from constrained_spec import Generator  # noqa: E402
from constrained_spec import cache as kv  # noqa: E402
from constrained_spec.draft import CompositeDrafter  # noqa: E402
from constrained_spec.head import HeadDraft, copy_proposals, load_head, shipped_head  # noqa: E402
from constrained_spec.models import DEFAULT_MODEL  # noqa: E402
from constrained_spec.sample import SamplingConfig  # noqa: E402

GREEDY = SamplingConfig(temperature=0.0)


def requests_with_outputs(gen, run: Path):
    """Each request of ``run`` with a baseline output, ready for ``replay``; max_new_tokens."""
    max_new_tokens = json.loads((run / "results.json").read_text())["meta"]["args"][
        "max_new_tokens"
    ]
    requests = json.loads((run / "requests.json").read_text())["requests"]
    results = {
        r["request"]: r
        for r in map(json.loads, open(run / "results.jsonl"))
        if r["config"] == "baseline" and r["status"] == "ok"
    }
    items = []
    for r in requests:
        if r["id"] in results:
            eos = [gen.vocab.eos_id] if results[r["id"]]["finish_reason"] == "stop" else []
            items.append(
                prepared(
                    gen,
                    gen.encode_prompt(r["messages"]),
                    results[r["id"]]["token_ids"] + eos,
                    gen.compile(schema=r["schema"]),
                )
            )
    return items, max_new_tokens


def prepared(gen, prompt: list[int], output: list[int], constraint):
    """(prompt, committed output, constraint, the target's features over both)."""
    _, features = kv.forward(
        gen.target, kv.new_cache(gen.target), prompt + output, "cpu", features=True
    )
    return prompt, output, constraint, features.float()


def first_draft(drafter, context, state, constraint) -> int | None:
    """The head's masked greedy token after ``context`` (None: nothing legal to propose)."""
    out = drafter.scores(context, state, constraint)
    if out is None or not out[1].any():
        return None
    logits, legal, ids = out
    return int(ids[logits.masked_fill(~legal, -float("inf")).argmax()])


@torch.inference_mode()
def replay(head, gen, items, k: int, max_new_tokens: int) -> dict:
    calls = committed = 0
    accepted, drafted = [0] * k, [0] * k
    positions = head_right = copy_right = head_takes_copy = 0
    for prompt, output, constraint, features in items:
        n = len(prompt)
        states = [constraint.initial_state]
        for token in output:
            states.append(constraint.step(states[-1], token))
        drafter = CompositeDrafter(HeadDraft(head, gen.target), use_forced=False, use_lookup=False)
        drafter.begin(prompt, features[: n - 1])
        done = 0
        while done < len(output):  # one round, drafted as the decode loop drafts it
            room = max_new_tokens - done  # the loop cuts drafts to fit max_new_tokens
            draft = (
                drafter.propose(prompt + output[:done], states[done], constraint, k, GREEDY, None)
                .truncate(room - 1)
                .tokens
                if room > 1
                else []
            )
            match = 0
            while match < len(draft) and draft[match] == output[done + match]:
                match += 1
            for i in range(len(draft)):
                drafted[i] += 1
                accepted[i] += i < match
            step = min(match + 1, len(output) - done)
            drafter.observe(output[done : done + step], features[n - 1 + done : n + done + match])
            calls, committed, done = calls + 1, committed + step, done + step
        drafter = HeadDraft(head, gen.target)  # teacher-forced first drafts
        drafter.begin(prompt, features[: n - 1])
        proposals = copy_proposals(prompt + output)
        for j, token in enumerate(output):
            if j:  # the feature of the token before output[j] is known now
                drafter.observe([], features[n - 2 + j : n - 1 + j])
            if len(constraint.allowed(states[j])) > 1:
                guess = first_draft(drafter, prompt + output[:j], states[j], constraint)
                copy = proposals[n + j - 1][0]
                positions += 1
                head_right += guess == token
                copy_right += copy == token
                head_takes_copy += copy == token and guess == token
    per_call = committed / calls
    lo, hi = 0.0, 1.0
    for _ in range(50):  # α with 1 + α + … + α^k = tokens per call
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(k + 1)) < per_call else (lo, mid)
    given_earlier = [
        round(accepted[i] / max(accepted[i - 1] if i else drafted[0], 1), 3) for i in range(k)
    ]
    return {
        "tokens_per_call": round(per_call, 3),
        "alpha": round(lo, 3),
        "accepted_by_position": accepted,
        "drafted_by_position": drafted,
        "acceptance_by_position_given_earlier": given_earlier,
        "non_forced_positions": positions,
        "head_first_draft_right": round(head_right / positions, 3),
        "bigram_proposal_right": round(copy_right / positions, 3),
        "head_takes_a_right_proposal": round(head_takes_copy / max(copy_right, 1), 3),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="benchmark result folders (with a baseline)")
    p.add_argument("--head", type=Path, default=None, help="default: the shipped head")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--weights", default="float", help="the target's (models.WEIGHTS)")
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    gen = Generator.from_pretrained(draft="none", weights=args.weights, skinny_matmul=False)
    head = load_head(gen.target, gen.vocab, args.head or shipped_head(DEFAULT_MODEL))
    for run in args.runs:
        items, max_new_tokens = requests_with_outputs(gen, run)
        result = replay(head, gen, items, args.k, max_new_tokens)
        print(
            json.dumps(
                {
                    "run": str(run),
                    "head": str(args.head or "shipped"),
                    "k": args.k,
                    "weights": args.weights,
                    **result,
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
