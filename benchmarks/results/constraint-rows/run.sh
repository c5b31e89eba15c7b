#!/usr/bin/env bash
# The constraint's per-state work (benchmarks/constraint_profile.py: 8 extract requests, T = 0.7)
# before (c5f6ead) and after the clean-row path and the kept lookup text, taking turns three
# times; the old commit in a worktree with its own kernel build (its cache links the model).
set -euo pipefail
cd "$(dirname "$0")/../../.."
bash benchmarks/constraint_turns.sh c5f6ead benchmarks/results/constraint-rows
