"""What the replies are worth: extraction requests from JSONSchemaBench's held-out half (the files
whose name's sha256 ends in an odd byte, as benchmarks/coverage.py splits them), each prompt
stating one valid instance as ``field: value`` lines (workloads' "extract"), answered by the
built-in model, greedy, at each --max-new-tokens with and without the budget mask, one after the
other on each request (the order alternating).

Scores per budget and mode: valid (the reply finished, parses, and jsonschema with its format
checker accepts it), exact (the reply equals the instance), leaf accuracy (every leaf path of the
instance, the reply's value there equal to it, numbers compared as numbers; a reply that is not
valid gets none right), tok/s (output tokens over decode seconds), and how many greedy replies
that finished without the mask are the same tokens with it.

    flock /tmp/quiet.lock python benchmarks/quality.py --out /tmp/quality
    python benchmarks/quality.py agreement --n 24 --out benchmarks/results/agreement

``agreement``: top-1 agreement of each weights path with the float32 copy, on a fixed set of
positions: every answer position of ``--n`` extract requests (the first of the seeded selection
from the committed sample), teacher-forced: the chat prompt, then the request's valid instance as
compact JSON. At each position the unmasked next-token argmax of a path is compared with the
float32 copy's (transformers' forward over the dequantized GGUF). Paths: the built-in model's own
Q4_1 blocks in the compact forward (``weights="int4"``), the float copy requantized as any other
transformers model would be (``from_transformers(..., "int4"/"int8")``), the compact forward in
float32 (a check of the forward itself), and llama.cpp on the same GGUF where it is installed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import report  # noqa: E402
import workloads  # noqa: E402
from coverage import half  # noqa: E402

from constrained_spec import Generator  # noqa: E402
from constrained_spec.errors import BudgetTooSmall  # noqa: E402
from constrained_spec.model import kv  # noqa: E402
from constrained_spec.model.llama import from_transformers  # noqa: E402
from constrained_spec.model.machine import cache_dir  # noqa: E402
from constrained_spec.model.models import BUILTIN_MODELS, DEFAULT_MODEL, load_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = "replies: scored replies (the default); agreement: top-1 agreement of weights paths"
    ap.add_argument(
        "mode", nargs="?", choices=("replies", "agreement"), default="replies", help=modes
    )
    ap.add_argument("--data", type=Path, help="default: the dev set (agreement: the sample)")
    ap.add_argument(
        "--n", type=int, help="requests, default 40, one more first warms up (agreement: 24)"
    )
    ap.add_argument("--out", type=Path, required=True)
    replies = ap.add_argument_group("replies")
    replies.add_argument("--half", choices=("held-out", "tuned"), default="held-out")
    replies.add_argument("--seed", type=int, default=0, help="shuffles the files: the selection")
    replies.add_argument("--budgets", type=int, nargs="+", default=[256, 64], metavar="N")
    replies.add_argument("--model", default=None, help="default: the built-in model")
    replies.add_argument(
        "--loop-guard", action="store_true", help="every reply with loop_guard=True"
    )
    args = ap.parse_args(argv)
    if args.mode == "agreement":
        return agreement(args.data or workloads.DATA, args.n or 24, args.out, argv)
    args.data, args.n = args.data or workloads.DEV_SET, args.n or 40
    start = time.time()
    gen = Generator.from_pretrained(*([args.model] if args.model else []))
    requests = select(gen, args)
    warmup, requests = requests[0], requests[1:]
    answer(gen, warmup, min(args.budgets), True, args.loop_guard)
    rows = []
    for i, request in enumerate(requests):
        for budget in args.budgets:
            for mask in (i % 2 == 0, i % 2 == 1):  # alternating which mode runs first
                rows.append(answer(gen, request, budget, mask, args.loop_guard))
        print(f"[{i + 1}/{len(requests)}] {request.file}", flush=True)
    summary = summarize(rows, args.budgets)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = report.run_metadata("benchmarks/quality.py", argv or sys.argv[1:], start)
    meta |= {
        "half": args.half,
        "loop_guard": args.loop_guard,
        "requests": [r.file for r in requests],
    }
    results = {"meta": meta, "summary": summary, "rows": rows}
    (args.out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    (args.out / "report.md").write_text(table(summary, meta))
    print(table(summary, meta))
    return 0


def select(gen, args) -> list[workloads.Request]:
    """n + 1 extract requests from the files of one half (shuffled by --seed), as workloads
    selects them (compiles, a short valid instance the automaton accepts, a prompt that fits)."""
    files = sorted(p for p in args.data.glob("*.json") if half(p.name) == args.half)
    random.Random(args.seed).shuffle(files)
    chosen = []
    for path in files:
        if len(chosen) == args.n + 1:
            break
        _, request = workloads._try_file(gen, path, "extract", workloads.Selection(), len(chosen))
        if request is not None:
            chosen.append(request)
    return chosen


def answer(gen, request, budget: int, mask: bool, loop_guard: bool = False) -> dict:
    row = {"file": request.file, "budget": budget, "mask": mask}
    if getattr(gen.target, "prompt_cache", None) is not None:
        gen.target.prompt_cache.clear()  # each run computes its whole prompt
    try:
        result = gen.generate(
            request.messages,  # plain text where the model has no chat template
            schema=request.schema,
            max_new_tokens=budget,
            temperature=0.0,
            budget_mask=mask,
            loop_guard=loop_guard,
        )
    except BudgetTooSmall as e:  # the schema's shortest reply does not fit: none valid
        _, total = workloads.leaves_right(request.expected, workloads.MISSING)
        return row | {"finish_reason": "refused", "error": str(e), "valid": False,
                      "exact": False, "leaves_right": 0, "leaves": total, "output_tokens": 0,
                      "decode_s": 0.0, "budget_removed": 0, "token_ids": []}  # fmt: skip
    value, valid = None, False
    if result.finish_reason != "length":
        value = json.loads(result.text)
        valid = workloads.is_valid(request.schema, value)
    right, total = workloads.leaves_right(request.expected, value if valid else workloads.MISSING)
    return row | {
        "finish_reason": result.finish_reason,
        "text": result.text,
        "token_ids": result.token_ids,
        "valid": valid,
        "exact": valid and workloads.same(value, request.expected),
        "leaves_right": right,
        "leaves": total,
        "output_tokens": len(result.token_ids),
        "decode_s": result.stats.total_s,
        "budget_removed": result.stats.budget_removed,
        "repeats_removed": result.stats.repeats_removed,
    }


def summarize(rows: list[dict], budgets: list[int]) -> dict:
    out = {}
    for budget in budgets:
        for mask in (False, True):
            got = [r for r in rows if r["budget"] == budget and r["mask"] == mask]
            out[f"{budget}/{'mask' if mask else 'no mask'}"] = {
                "requests": len(got),
                "valid": sum(r["valid"] for r in got),
                "exact": sum(r["exact"] for r in got),
                "leaf_accuracy": sum(r["leaves_right"] for r in got)
                / sum(r["leaves"] for r in got),
                "cut": sum(r["finish_reason"] == "length" for r in got),
                "refused": sum(r["finish_reason"] == "refused" for r in got),
                "budget_shaped": sum(r["finish_reason"] == "budget" for r in got),
                "tok_s": sum(r["output_tokens"] for r in got) / sum(r["decode_s"] for r in got),
            }
        pairs = {
            r["file"]: r for r in rows if r["budget"] == budget and not r["mask"]
        }  # the replies without the mask that finished, against theirs with it
        with_mask = [r for r in rows if r["budget"] == budget and r["mask"]]
        finished = [r for r in with_mask if pairs[r["file"]]["finish_reason"] == "stop"]
        out[f"{budget}/unchanged"] = {
            "finished_without_mask": len(finished),
            "same_tokens_with_mask": sum(
                r["token_ids"] == pairs[r["file"]]["token_ids"] for r in finished
            ),
        }
    return out


def table(summary: dict, meta: dict) -> str:
    lines = [
        f"# Reply quality: {len(meta['requests'])} extract requests, {meta['half']} half",
        "",
        f"`{meta['command']}` — {meta['date']}, {meta['machine']}, commit {meta['commit']}",
        "",
        "| max_new_tokens / mode | valid | exact | leaf accuracy | cut | refused | budget-shaped "
        "| tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, s in summary.items():
        if key.endswith("unchanged"):
            continue
        n = s["requests"]
        lines.append(
            f"| {key} | {s['valid']}/{n} | {s['exact']}/{n} | {s['leaf_accuracy']:.1%} | "
            f"{s['cut']} | {s['refused']} | {s['budget_shaped']} | {s['tok_s']:.1f} |"
        )
    lines.append("")
    for key, s in summary.items():
        if key.endswith("unchanged"):
            lines.append(
                f"- {key.split('/')[0]}: {s['same_tokens_with_mask']} of the "
                f"{s['finished_without_mask']} greedy replies that finished without the mask "
                "are the same tokens with it"
            )
    return "\n".join(lines) + "\n"


# --- agreement ----------------------------------------------------------------------------------


def sequences(gen, n: int, data: Path) -> list[tuple[list[int], int]]:
    """(token ids, answer start) of n teacher-forced extract requests."""
    requests, _ = workloads.select_requests(gen, "extract", n, workloads.Selection(), data)
    out = []
    for r in requests[:n]:
        prompt = gen.encode_prompt(r.messages)
        answer = gen.tokenizer.encode(workloads.compact(r.expected), add_special_tokens=False)
        out.append((prompt + answer + [gen.vocab.eos_id], len(prompt)))
    return out


@torch.inference_mode()
def top1(model, ids: list[int], start: int) -> torch.Tensor:
    """Argmax at the positions predicting ids[start:] (the answer and its EOS), fed as decoding
    feeds them: the prompt in one call (its prefill), then the answer one token at a time (the
    4-bit target's steps may run another kernel than its prefill: its fused layers)."""
    cache = kv.new_cache(model)
    logits = [kv.forward(model, cache, ids[:start], "cpu")[-1:]]
    logits += [kv.forward(model, cache, [t], "cpu") for t in ids[start:-1]]
    return torch.cat(logits).argmax(-1)


def llama_cpp_top1(ids: list[int], start: int):
    gguf = cache_dir() / DEFAULT_MODEL / Path(BUILTIN_MODELS[DEFAULT_MODEL].gguf_member).name
    try:
        llm = _llama(str(gguf))
    except ImportError:  # llama-cpp-python is optional (it builds from source)
        return None
    llm.reset()
    llm.eval(ids[:-1])
    return torch.tensor(llm.scores[start - 1 : len(ids) - 1]).argmax(-1)


_LLM = {}


def _llama(path: str):
    if path not in _LLM:
        from llama_cpp import Llama

        _LLM[path] = Llama(
            path, n_ctx=2048, logits_all=True, verbose=False, n_threads=torch.get_num_threads()
        )
    return _LLM[path]


def agreement(data: Path, n: int, out: Path, argv: list[str] | None) -> int:
    """The agreement mode: agreement.json and report.md under ``out``."""
    float_model, tokenizer = load_model(DEFAULT_MODEL, weights="float")
    gen = Generator(float_model, tokenizer)
    seqs = sequences(gen, n, data)
    paths = {
        "int4 (the GGUF's Q4_1 blocks)": load_model(DEFAULT_MODEL, weights="int4")[0],
        "int4 (requantized, any Llama)": from_transformers(float_model, "int4"),
        "int8 (requantized, any Llama)": from_transformers(float_model, "int8"),
        "float32, compact forward": from_transformers(float_model, "float"),
    }
    agree = {name: 0 for name in [*paths, "llama.cpp (same GGUF)"]}
    total = 0
    for ids, start in seqs:
        reference = top1(float_model, ids, start)
        total += len(reference)
        for name, model in paths.items():
            agree[name] += int((top1(model, ids, start) == reference).sum())
        theirs = llama_cpp_top1(ids, start)
        agree["llama.cpp (same GGUF)"] = (
            None
            if theirs is None
            else agree["llama.cpp (same GGUF)"] + int((theirs == reference).sum())
        )
    result = {
        "positions": total,
        "requests": len(seqs),
        "agreement": {k: (v / total if v is not None else None) for k, v in agree.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "agreement.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Top-1 agreement with the float32 copy: {total} answer positions of "
        f"{len(seqs)} extract requests (teacher-forced)",
        "",
        f"Command: `python benchmarks/quality.py {' '.join(argv or sys.argv[1:])}`",
        "",
        "| path | top-1 agreement |",
        "|---|---|",
    ]
    lines += [
        f"| {k} | {v:.2%} |" if v is not None else f"| {k} | not installed |"
        for k, v in result["agreement"].items()
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
