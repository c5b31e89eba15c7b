#!/usr/bin/env bash
# extract-int4: the headline: the 4-bit target (weights="auto" → int4 here) against the fp32 copy
# (baseline-float) and llama.cpp on the same GGUF, greedy and T = 0.7, 16 extract requests.
# `lookup/d7` is what draft="auto" runs on the 4-bit target. DEV: the full JSONSchemaBench dev set.
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
python benchmarks/run.py --data "$DEV" --workload extract --n 16 --max-new-tokens 160 \
  --configs 'baseline,baseline-float,lookup/d7,lookup,head/k3,head+lookup/k8/c0.3,llama.cpp,baseline@t0.7,baseline-float@t0.7,lookup/d7@t0.7,head+lookup/k8/c0.3@t0.7,llama.cpp@t0.7' \
  --out benchmarks/results/extract-int4
