#!/usr/bin/env bash
# extract-head7: the current headline: the shipped head (run 5), 16 extract requests.
# Measured at commit ee379fe (report committed in 02aec95); the same command at that
# commit reproduces its numbers; this script measures the current code. DEV: the full JSONSchemaBench
# dev set (the run selected its requests from it; the committed sample gives other ones).
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
python benchmarks/run.py --data "$DEV" \
  --workload extract \
  --n 16 \
  --max-new-tokens 160 \
  --skinny-matmul \
  --configs baseline,lookup,head/k4,head+lookup/k8/c0.3,head+lookup/k8/c0.1,baseline@t0.7,lookup@t0.7,head+lookup/k8/c0.3@t0.7 \
  --out benchmarks/results/extract-head7
