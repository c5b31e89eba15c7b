"""One GGUF file, ours against llama.cpp on the same file: load time, greedy tok/s under each
request's JSON Schema, and how often the greedy outputs agree.

    python benchmarks/gguf_file.py --model /path/gemma-3-270m-q4_k_m.gguf --n 20 --out DIR

Requests: ``--n`` extract requests of the committed sample (workloads.py, seed 0), the prompt as
plain text where the file has no chat template (a base model), else through it. Each request
runs, interleaved: ours with speculation (the default drafts), our masked baseline (one target
call per token), llama.cpp with its JSON-Schema grammar, and llama.cpp again with prompts fed 8
tokens a call (another batch size: its kernels' rounding differs, which is what its greedy chain
agreeing with itself means). With ``--float-reference``, transformers' float32 forward on gguf's
dequantization of the same file writes greedy chains too: the exact model the file's weights
describe, which neither engine's rounded arithmetic computes. Timed from prompt ids in to output ids out (prefill included),
grammar compiles excluded on both sides; one untimed warm-up request first. Loads are timed in
fresh processes (ours: the prepared model, after one load prepared it; llama.cpp: the file).
Writes results.json and report.md under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import workloads  # noqa: E402
from run import forget_prompts  # noqa: E402

from constrained_spec import Generator  # noqa: E402

# (imports, the load): a fresh process times the load alone
LOAD_OURS = ("from constrained_spec import Generator", "Generator.from_pretrained({path!r})")
LOAD_LLAMA = ("from llama_cpp import Llama", "Llama({path!r}, n_ctx=4096, verbose=False)")


def load_seconds(code: tuple[str, str], path: str, repeats: int = 3) -> float:
    """The best of ``repeats`` fresh processes' time to run ``code``'s load (after its imports)."""
    imports, load = code
    timed = f"import time\n{imports}\nt = time.perf_counter()\n{load.format(path=path)}\n"
    timed += "print(time.perf_counter() - t)"
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", timed], capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"load failed: {out.stderr[-2000:]}")
        runs.append(float(out.stdout.strip().splitlines()[-1]))
    return min(runs)


def run_ours(gen, ids, schema, speculative: bool, max_new: int) -> dict:
    forget_prompts(gen.target)  # the other config ran this prompt: each computes its own
    t = time.perf_counter()
    r = gen.generate(ids, schema=schema, max_new_tokens=max_new, speculative=speculative)
    return {"ids": r.token_ids, "s": time.perf_counter() - t, "finish": r.finish_reason}


def run_llama(llm, grammar, ids, eos: int, max_new: int) -> dict:
    llm.reset()
    new, t = [], time.perf_counter()
    for token in llm.generate(ids, grammar=grammar, temp=0.0, repeat_penalty=1.0):
        if token == eos or len(new) >= max_new:
            break
        new.append(token)
    finish = "length" if len(new) >= max_new else "stop"
    return {"ids": new, "s": time.perf_counter() - t, "finish": finish}


@torch.inference_mode()
def ours_chain(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ``ids``, no grammar: the prompt in one call, then one-token steps."""
    cache = model.new_cache()
    logits, _ = model(torch.tensor(ids), cache)
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits, _ = model(torch.tensor(out[-1:]), cache)
    return out


def llama_chain(llm, ids: list[int], n: int) -> list[int]:
    llm.reset()
    out = []
    for token in llm.generate(ids, temp=0.0, repeat_penalty=1.0):
        out.append(token)
        if len(out) == n:
            return out


@torch.inference_mode()
def float_chain(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens of transformers' float32 forward after ``ids``, no grammar (the argmax
    at every step, end of text included, as the other chains)."""
    out, past, fed = [], None, torch.tensor([ids])
    for _ in range(n):
        step = model(input_ids=fed, past_key_values=past, use_cache=True)
        past = step.past_key_values
        out.append(int(step.logits[0, -1].argmax()))
        fed = torch.tensor([out[-1:]])
    return out


def float_model(path: str):
    """transformers' float32 model of a GGUF file (gguf's dequantization of every tensor)."""
    from transformers import AutoModelForCausalLM

    file = Path(path)
    model = AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32
    )
    return model.eval()


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(runs: list[dict], a: str, b: str) -> dict:
    same = [r[a]["ids"] == r[b]["ids"] for r in runs]
    prefix = [common_prefix(r[a]["ids"], r[b]["ids"]) for r in runs]
    longer = [max(len(r[a]["ids"]), len(r[b]["ids"]), 1) for r in runs]
    return {
        "identical": sum(same) / len(runs),
        "shared_prefix": sum(p / n for p, n in zip(prefix, longer)) / len(runs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--chain", type=int, default=32, help="tokens of each unconstrained chain")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--float-reference",
        action="store_true",
        help="greedy chains of transformers' float32 forward too (loads the file dequantized)",
    )
    args = p.parse_args()
    from llama_cpp import Llama, LlamaGrammar

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    gen = Generator.from_pretrained(args.model)  # prepares the model (a later load maps it)
    requests, _ = workloads.select_requests(gen, "extract", args.n, workloads.Selection())
    llama = {
        "llama.cpp": Llama(args.model, n_ctx=4096, n_threads=threads, verbose=False),
        "llama.cpp/batch8": Llama(
            args.model, n_ctx=4096, n_threads=threads, n_batch=8, verbose=False
        ),
    }
    reference = float_model(args.model) if args.float_reference else None
    eos = gen.vocab.eos_id
    configs = ["ours", "ours/baseline", *llama]
    runs, refused = [], []
    for i, request in enumerate(requests):
        ids = gen.encode_prompt(request.messages)  # plain text where it has no template
        gen.compile(schema=request.schema)  # compiled before the clock (cached)
        try:
            grammar = LlamaGrammar.from_json_schema(json.dumps(request.schema), verbose=False)
        except Exception as e:  # llama-cpp-python's converter refuses some schemas: not timed
            refused.append(f"{request.id}: {type(e).__name__}: {str(e)[:80]}")
            print(request.id, "skipped: llama.cpp's converter refuses the schema")
            continue
        run = {"id": request.id, "prompt_tokens": len(ids)}
        for name in configs[i % len(configs) :] + configs[: i % len(configs)]:
            if name.startswith("ours"):
                run[name] = run_ours(gen, ids, request.schema, name == "ours", args.max_new_tokens)
            else:
                run[name] = run_llama(llama[name], grammar, ids, eos, args.max_new_tokens)
        # greedy chains without a grammar: each side's grammar writes JSON its own way
        # (llama.cpp's allows spaces, ours compact JSON), so constrained outputs part at once
        run["chain"] = {"ours": {"ids": ours_chain(gen.target, ids, args.chain)}}
        for name, llm in llama.items():
            run["chain"][name] = {"ids": llama_chain(llm, ids, args.chain)}
        if reference is not None:
            run["chain"]["float32"] = {"ids": float_chain(reference, ids, args.chain)}
        if i - len(refused):  # the first timed is the warm-up
            runs.append(run)
        print(request.id, {c: (len(run[c]["ids"]), round(run[c]["s"], 3)) for c in configs})
    rate = {c: sum(len(r[c]["ids"]) for r in runs) / sum(r[c]["s"] for r in runs) for c in configs}
    chains = [r["chain"] for r in runs]
    against_float = {
        f"{args.chain}-token chains, no grammar: {side} vs float32": agreement(
            chains, side, "float32"
        )
        for side in ("ours", "llama.cpp")
        if reference is not None
    }
    results = {
        "command": " ".join(sys.argv),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": threads},
        "weights": gen.weights_choice,
        "load_s": {
            "ours (prepared)": load_seconds(LOAD_OURS, args.model),
            "llama.cpp": load_seconds(LOAD_LLAMA, args.model),
        },
        "tok_per_s": rate,
        "agreement": {
            f"{args.chain}-token chains, no grammar: ours vs llama.cpp": agreement(
                chains, "ours", "llama.cpp"
            ),
            f"{args.chain}-token chains, no grammar: llama.cpp vs llama.cpp/batch8": agreement(
                chains, "llama.cpp", "llama.cpp/batch8"
            ),
            **against_float,
            "under the schema: ours, speculation vs baseline": agreement(
                runs, "ours", "ours/baseline"
            ),
            "under the schema: llama.cpp vs llama.cpp/batch8": agreement(
                runs, "llama.cpp", "llama.cpp/batch8"
            ),
        },
        "refused_by_llama_cpp": refused,
        "runs": runs,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"# {Path(args.model).name}: ours against llama.cpp, {len(runs)} extract requests, greedy",
        "",
        f"Command: `{results['command']}` ({threads} threads)",
        "",
        f"Skipped (llama-cpp-python's JSON Schema converter refuses them): {len(refused)}"
        + "".join(f"\n- {r}" for r in refused),
        "",
        "| | tok/s | vs llama.cpp |",
        "|---|---|---|",
        *(f"| {c} | {v:.1f} | {v / rate['llama.cpp']:.2f}x |" for c, v in rate.items()),
        "",
        "| load (best of 3 fresh processes) | s |",
        "|---|---|",
        *(f"| {k} | {v:.2f} |" for k, v in results["load_s"].items()),
        "",
        "| greedy outputs | identical | shared prefix (mean share) |",
        "|---|---|---|",
        *(
            f"| {k} | {v['identical']:.0%} | {v['shared_prefix']:.0%} |"
            for k, v in results["agreement"].items()
        ),
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
