#!/usr/bin/env bash
# mask-bits: the constraint's per-state work before (main at 026a062: a bool array per state,
# one torch mask per state stacked per pass) and after (a bitmask per state as bytes, a pass's
# masks in one conversion), the same 16 extract and 8 generate requests, greedy and T = 0.7, the
# masked baseline and auto's lookup/d3 on the 4-bit target, alternating old and new. Both trees
# run this tree's benchmarks/run.py, so one meter (every per-state method of either engine,
# nested calls counted once, seconds per method in "mask_by") times both. ~12 min.
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
OUT="${OUT:-benchmarks/results/mask-bits}"
BASE="${BASE:-026a062}"
OLD="${OLD:-/tmp/mask-bits-old}"
[ -d "$OLD" ] || git worktree add -q --detach "$OLD" "$BASE"
cp benchmarks/run.py "$OLD/benchmarks/run.py"
DEV="$(realpath "$DEV")"
OUT="$(realpath -m "$OUT")"
for w in "extract 16" "generate 8"; do
  set -- $w
  for tree in old new; do
    dir=.; [ "$tree" = old ] && dir="$OLD"
    (cd "$dir" && python benchmarks/run.py --data "$DEV" --workload "$1" --n "$2" \
      --max-new-tokens 160 --configs 'baseline,lookup/d3,baseline@t0.7,lookup/d3@t0.7' \
      --out "$OUT/$1-$tree")
  done
done
python benchmarks/compare_meter.py "$OUT"/{extract,generate}-{old,new} > "$OUT/comparison.md"
