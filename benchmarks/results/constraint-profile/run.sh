#!/usr/bin/env bash
# constraint-profile: the constraint's per-state work in real decoding, cold (each constraint's
# caches emptied before its request), 8 extract requests at T = 0.7, three runs per commit. The
# older commit ran from a worktree (`git worktree add /tmp/old 55e0af7`, this script and the
# current csrc/fused_layers.cpp copied in, so the extension is not rebuilt), the runs alternating.
# About 40 s a run.
set -euo pipefail
cd "$(dirname "$0")/../../.."
commit="$(git rev-parse --short HEAD)"
for _ in 1 2 3; do python benchmarks/constraint_profile.py; done \
  > "benchmarks/results/constraint-profile/$commit.txt"
