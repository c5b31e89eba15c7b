#!/usr/bin/env bash
# The constraint's per-state work (benchmarks/constraint_profile.py: 8 extract requests, T = 0.7)
# before (d6a0067) and after round 7 (a matcher copy at every second state, a step to a made child
# without its mask test), taking turns three times; the old commit in a worktree with its own
# kernel build (its cache links the model). Then the copies' spacing in one process, taking
# turns: tuned on the extract requests, reported on the generate ones.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/constraint-round7
bash benchmarks/constraint_turns.sh d6a0067 "$OUT"
python benchmarks/snapshot_spacing.py --workload extract --every 1 2 3 --turns 3 > "$OUT/spacing-extract.txt"
python benchmarks/snapshot_spacing.py --workload generate --every 1 2 --turns 2 > "$OUT/spacing-generate.txt"
