#!/usr/bin/env bash
# generate-fast: the fast target on the generate workload (the prompt gives only the schema), 8
# requests, greedy and T = 0.7, against the fp32 copy, torch's 4-bit kernel (`/torch-matmul`) and
# llama.cpp. About 4 minutes.
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
python benchmarks/run.py --data "$DEV" --workload generate --n 8 --max-new-tokens 128 \
  --configs 'baseline,baseline-float,lookup/d3,baseline/torch-matmul,lookup/d3/torch-matmul,llama.cpp,baseline@t0.7,lookup/d3@t0.7,llama.cpp@t0.7' \
  --out benchmarks/results/generate-fast
