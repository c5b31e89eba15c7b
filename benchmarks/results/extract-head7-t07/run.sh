#!/usr/bin/env bash
# extract-head7-t07: the current headline at T = 0.7: 32 sampled extract requests.
# Measured at commit 0662234 (report committed in b90a667); the same command at that
# commit reproduces its numbers; this script measures the current code. DEV: the full JSONSchemaBench
# dev set (the run selected its requests from it; the committed sample gives other ones).
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
python benchmarks/run.py --data "$DEV" \
  --workload extract \
  --n 32 \
  --max-new-tokens 160 \
  --skinny-matmul \
  --configs baseline@t0.7,lookup@t0.7,head+lookup/k8/c0.3@t0.7,head/k4@t0.7 \
  --out benchmarks/results/extract-head7-t07
