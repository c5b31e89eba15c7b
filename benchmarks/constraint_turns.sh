#!/usr/bin/env bash
# benchmarks/constraint_profile.py on an older commit (in a worktree with its own kernel build) and
# on this checkout, taking turns: OUT/before-N.txt and OUT/after-N.txt for N in $TURNS (1 2 3).
#   bash benchmarks/constraint_turns.sh COMMIT OUT
set -euo pipefail
cd "$(dirname "$0")/.."
COMMIT=$1 OUT=$(realpath "$2")
source benchmarks/old_checkout.sh
old_checkout "$COMMIT" "${OLD:-/tmp/constraint-turns-$COMMIT}"
for turn in ${TURNS:-1 2 3}; do
  in_old python benchmarks/constraint_profile.py > "$OUT/before-$turn.txt"
  python benchmarks/constraint_profile.py > "$OUT/after-$turn.txt"
done
