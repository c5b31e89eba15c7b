#!/usr/bin/env bash
# open-objects: the default (objects that declare properties get no undeclared ones) against
# Generator(open_objects=True), on the same requests (the closed run selects them; run.py's
# verdict cache carries its choices to the open run): greedy masked baseline, the default model,
# 1 torch thread, max_new_tokens 128; then compare_objects.py (exact matches, valid outputs,
# invented keys, tokens). ~10 min on 2 shared cores. DEV: the full JSONSchemaBench dev set.
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
OUT=benchmarks/results/open-objects
for w in "extract 24" "generate 12"; do
  set -- $w
  for objects in closed open; do
    flag=""
    if [ "$objects" = open ]; then flag="--open-objects"; fi
    OMP_NUM_THREADS=1 python benchmarks/run.py --data "$DEV" --workload "$1" --n "$2" \
      --max-new-tokens 128 --threads 1 --configs baseline --no-calibrate $flag \
      --out "$OUT/$1-$objects"
  done
done
python benchmarks/compare_objects.py --out "$OUT" "$OUT/extract-closed" "$OUT/extract-open" \
  "$OUT/generate-closed" "$OUT/generate-open"
