#!/usr/bin/env bash
# engine-rewrites-e2e: end-to-end tok/s and mask share before the round-3 rewrites into
# llguidance's keywords (main at bb736c3: "before") and after them (this tree: "after"), the same
# 16 extract and 8 generate requests, greedy and T = 0.7, the masked baseline and auto's
# lookup/d3 on the 4-bit target. Run "after" here; for "before", check out bb736c3 into another
# worktree and run the same command there. ~3 min each.
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
OUT="${OUT:-benchmarks/results/engine-rewrites-e2e}"
TAG="${TAG:-after}"
for w in "extract 16" "generate 8"; do
  set -- $w
  python benchmarks/run.py --data "$DEV" --workload "$1" --n "$2" --max-new-tokens 160 \
    --configs 'baseline,lookup/d3,baseline@t0.7,lookup/d3@t0.7' --out "$OUT/$1-$TAG"
done
