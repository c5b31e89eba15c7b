#!/usr/bin/env bash
# extract-fast: the headline: the 4-bit target (weights="auto" → int4 here) with the Q8_0 LM head,
# against the fp32 copy (baseline-float) and llama.cpp on the same GGUF (llama-cpp-python 0.3.36,
# its JSON-schema grammar), greedy and T = 0.7, 16 extract requests of the dev set. `lookup/d3`
# is what draft="auto" runs on the 4-bit target; the `/torch-matmul` pair runs torch's 4-bit
# kernel in place of ours (the kernels side by side). About 5 minutes. DEV: the dev set's folder;
# OUT: another folder (extract-amx).
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
python benchmarks/run.py --data "$DEV" --workload extract --n 16 --max-new-tokens 160 \
  --configs 'baseline,baseline-float,lookup/d3,lookup/d7,baseline/torch-matmul,lookup/d3/torch-matmul,llama.cpp,baseline@t0.7,baseline-float@t0.7,lookup/d3@t0.7,lookup/d7@t0.7,llama.cpp@t0.7' \
  --out "${OUT:-benchmarks/results/extract-fast}"
