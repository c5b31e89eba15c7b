"""Top-1 agreement of each weights path with the float32 copy, on a fixed set of positions.

    python benchmarks/agreement.py --n 24 --out benchmarks/results/agreement

Positions: every answer position of ``--n`` extract requests (the first of the seeded selection
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
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import workloads  # noqa: E402

from constrained_spec import Generator  # noqa: E402
from constrained_spec.model import kv  # noqa: E402
from constrained_spec.model.llama import from_transformers  # noqa: E402
from constrained_spec.model.machine import cache_dir  # noqa: E402
from constrained_spec.model.models import BUILTIN_MODELS, DEFAULT_MODEL, load_model  # noqa: E402


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--data", default=str(workloads.DATA))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    float_model, tokenizer = load_model(DEFAULT_MODEL, weights="float")
    gen = Generator(float_model, tokenizer)
    seqs = sequences(gen, args.n, Path(args.data))
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "agreement.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Top-1 agreement with the float32 copy: {total} answer positions of "
        f"{len(seqs)} extract requests (teacher-forced)",
        "",
        f"Command: `python benchmarks/agreement.py {' '.join(argv or sys.argv[1:])}`",
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
    raise SystemExit(main())
