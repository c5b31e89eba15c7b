#!/usr/bin/env bash
# extract-bf16-draft: the int8 and bf16 copies of the target as drafters.
# Measured at commit c4c69b5 (report committed in c646975); the same command at that
# commit reproduces its numbers; this script measures the current code. DEV: the full JSONSchemaBench
# dev set (the run selected its requests from it; the committed sample gives other ones).
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
python benchmarks/run.py --data "$DEV" \
  --workload extract \
  --n 8 \
  --max-new-tokens 160 \
  --configs baseline,lookup,int8+lookup/k4,bf16+lookup/k4 \
  --out benchmarks/results/extract-bf16-draft
