#!/usr/bin/env bash
# shapes-avx2: the Llama-3.2-1B shape (random weights, Q4_K_M by llama.cpp's quantizer) on a CPU
# without AVX-512 (this run: a 2-core first-generation Zen EPYC, AVX2 and FMA), llama.cpp built for
# it and ours on the same file and requests. The files (3.3 GB) stay outside the repository.
# About 15 minutes, most of it writing and quantizing the file.
set -euo pipefail
cd "$(dirname "$0")/../../.."
dir=${SHAPES_DIR:-/work/shapes}
out=benchmarks/results/shapes-avx2
python benchmarks/shapes.py write --dir "$dir" --only llama-3.2-1b
python benchmarks/shapes.py llama-cpp --dir "$dir" --out "$out" --only llama-3.2-1b --requests 3 --reps 10
python benchmarks/shapes.py ours --dir "$dir" --out "$out" --only llama-3.2-1b --requests 3 --reps 10
