#!/usr/bin/env bash
# generate-head3: the llama.cpp peer (the head rows are superseded; needs llama-cpp-python).
# Measured at commit 4a12c6b (report committed in d6cab5a); the same command at that
# commit reproduces its numbers; this script measures the current code. DEV: the full JSONSchemaBench
# dev set (the run selected its requests from it; the committed sample gives other ones).
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
python benchmarks/run.py --data "$DEV" \
  --workload generate \
  --n 8 \
  --max-new-tokens 128 \
  --skinny-matmul \
  --configs baseline,lookup,head/k4,head+lookup/adaptive,head+lookup/k8/c0.3,head+lookup/k8/c0.5,head+lookup/k8/c0.7,llama.cpp \
  --out benchmarks/results/generate-head3
