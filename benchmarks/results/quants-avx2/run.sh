#!/usr/bin/env bash
# quants-avx2: the GGUF types people download, on a CPU without AVX-512. The built-in model's real
# weights requantized by llama.cpp's own quantizer (benchmarks/shapes.py quants: Q4_K_M is mostly Q5_0
# here, its rows being 576 wide, with Q6_K and Q8_0 tensors; Q5_K_M mostly Q5_1), then our engine
# and llama.cpp on each file, greedy, 8 extract requests of the dev set. About 10 minutes.
# DEV: the dev set's folder; QUANTS: where the files go (outside the repository).
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
QUANTS="${QUANTS:-/work/quants}"
python benchmarks/shapes.py quants --dir "$QUANTS" --types Q4_K_M Q5_K_M Q8_0
for kind in Q4_K_M Q5_K_M Q8_0; do
  python benchmarks/run.py --isa "${ISA:-native}" --model "$QUANTS/smollm2-135m-instruct.$kind.gguf" \
    --data "$DEV" --workload extract --n 8 --max-new-tokens 160 \
    --configs 'baseline,lookup/d3,llama.cpp' --out "${OUT:-benchmarks/results/quants-avx2}/$kind"
done
