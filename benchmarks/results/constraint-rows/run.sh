#!/usr/bin/env bash
# The constraint's per-state work (benchmarks/constraint_profile.py: 8 extract requests, T = 0.7)
# before (c5f6ead) and after the clean-row path and the kept lookup text, taking turns three
# times; the old commit in a worktree with its own kernel build (its cache links the model).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=$PWD/benchmarks/results/constraint-rows
OLD=${OLD:-/tmp/constraint-rows-old}
[ -d "$OLD" ] || git worktree add -q "$OLD" c5f6ead
CACHE=${CONSTRAINED_SPEC_CACHE:-$HOME/.cache/constrained_spec}
mkdir -p "$OLD/.cache"
for entry in "$CACHE"/*; do
  [ "$(basename "$entry")" = kernels ] || ln -sfn "$entry" "$OLD/.cache/$(basename "$entry")"
done
for turn in ${TURNS:-1 2 3}; do
  (cd "$OLD" && CONSTRAINED_SPEC_CACHE="$OLD/.cache" PYTHONPATH="$OLD" \
    python benchmarks/constraint_profile.py) > "$OUT/before-$turn.txt"
  python benchmarks/constraint_profile.py > "$OUT/after-$turn.txt"
done
