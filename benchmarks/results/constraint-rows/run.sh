#!/usr/bin/env bash
# The constraint's per-state work (benchmarks/constraint_profile.py: 8 extract requests, T = 0.7)
# before (c5f6ead) and after the clean-row path and the kept lookup text, taking turns three
# times; the old commit in a worktree with its own kernel build (its cache links the model).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=$PWD/benchmarks/results/constraint-rows
source benchmarks/old_checkout.sh
old_checkout c5f6ead "${OLD:-/tmp/constraint-rows-old}"
for turn in ${TURNS:-1 2 3}; do
  in_old python benchmarks/constraint_profile.py > "$OUT/before-$turn.txt"
  python benchmarks/constraint_profile.py > "$OUT/after-$turn.txt"
done
