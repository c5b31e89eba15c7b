#!/usr/bin/env bash
# Random-weight GGUFs at the shapes of SmolLM2-360M, Qwen2.5-0.5B, Llama-3.2-1B and Qwen2.5-1.5B
# (Q4_K_M by llama.cpp's quantizer), llama.cpp and our engine on the same files and requests.
# The files (about 9.5 GB) stay outside the repository. Needs llama-cpp-python (builds ~8 min).
set -euo pipefail
cd "$(dirname "$0")/../../.."
dir=${SHAPES_DIR:-/work/shapes}
out=benchmarks/results/shapes
python benchmarks/shapes.py write --dir "$dir"
python benchmarks/shapes.py llama-cpp --dir "$dir" --out "$out" --requests 3 --reps 10
python benchmarks/shapes.py ours --dir "$dir" --out "$out" --requests 3 --reps 10
