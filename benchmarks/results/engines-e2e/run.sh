#!/usr/bin/env bash
# engines-e2e: the same requests decoded with engine="auto" (llguidance here) and engine="regex",
# back to back: extract (8 requests) and generate (4), masked baseline and lookup/d7 (what
# draft="auto" runs on the 4-bit target), 1 torch thread (the 2 cores were shared by 4 sessions,
# load 2-4: 2 threads ran up to 50x slower). ~5 min. DEV: the full JSONSchemaBench dev set.
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
for w in "extract 8" "generate 4"; do
  set -- $w
  for engine in auto regex; do
    OMP_NUM_THREADS=1 python benchmarks/run.py --data "$DEV" --workload "$1" --n "$2" \
      --max-new-tokens 128 --engine "$engine" --threads 1 --configs 'baseline,lookup/d7' \
      --out "benchmarks/results/engines-e2e/$1-$engine"
  done
done
