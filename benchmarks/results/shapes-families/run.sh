#!/usr/bin/env bash
# shapes-families: the Qwen3-0.6B, Gemma 3 1B, Gemma 2 2B, Phi-4-mini, Granite 3.1 2B and SmolLM3-3B
# shapes (random weights, Q4_K_M by llama.cpp's quantizer) on a 2-core first-generation Zen EPYC
# (AVX2 and FMA), llama.cpp (llama-cpp-python 0.3.36) and ours on the same files and requests. The
# files (F16 and Q4_K_M: 29.6 GB; delete a shape's F16 once its Q4_K_M is written) stay outside the
# repository. Phi-4-mini's prepared model (6.1 GB stored; a first load counted 8.6 GB against a cap
# of 8 and kept none) is over the default 4 GB cap on prepared models: stored under a higher one,
# else every load converts it again. Each command ran alone under this shared machine's lock
# (flock /tmp/quiet.lock), one shape at a time; about an hour and a half in all, most of it the
# measurements (Phi-4-mini: write 6 min, llama.cpp 5.5, ours 14; SmolLM3-3B: write 4 min, ours
# 16.5, 5 of them its first load's conversion at 14.9 GB resident at the peak). Granite 3.1 2B's
# rows in the report were measured again at 7dade11 (the AVX2 tiles' prefetch), the others before.
set -euo pipefail
cd "$(dirname "$0")/../../.."
dir=${SHAPES_DIR:-/work/shapes}
out=${SHAPES_OUT:-/work/shape-results}
for shape in qwen3-0.6b gemma3-1b gemma2-2b phi4-mini granite-3.1-2b smollm3-3b; do
  python benchmarks/shapes.py write --dir "$dir" --only "$shape"
done
for shape in qwen3-0.6b gemma3-1b gemma2-2b phi4-mini granite-3.1-2b smollm3-3b; do
  python benchmarks/shapes.py llama-cpp --dir "$dir" --out "$out" --only "$shape" --requests 3 --reps 10
  CONSTRAINED_SPEC_CACHE_GB=${CONSTRAINED_SPEC_CACHE_GB:-10} \
    python benchmarks/shapes.py ours --dir "$dir" --out "$out" --only "$shape" --requests 3 --reps 10
done
cp "$out/report.md" benchmarks/results/shapes-families/report.md
