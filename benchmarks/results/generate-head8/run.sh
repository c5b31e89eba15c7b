#!/usr/bin/env bash
# generate-head8: the current headline: the shipped head (run 5), 8 generate requests.
# Measured at commit 5b05587 (report committed in ee379fe); the same command at that
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
  --configs baseline,lookup,head/k4,head+lookup/k8/c0.3,head+lookup/k8/c0.1 \
  --out benchmarks/results/generate-head8
