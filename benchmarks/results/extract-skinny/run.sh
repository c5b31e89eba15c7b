#!/usr/bin/env bash
# extract-skinny: skinny_matmul's verify cost (the first head's rows are superseded).
# Measured at commit 4705f33 (report committed in 8999598); the same command at that
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
  --configs baseline,lookup,head/k4,head+lookup/adaptive \
  --out benchmarks/results/extract-skinny
