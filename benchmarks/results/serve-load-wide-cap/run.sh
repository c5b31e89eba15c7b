#!/usr/bin/env bash
# serve-load-wide-cap: serve-load-batched-final (1 and 16 clients) with the batcher's wide-batch
# draft cap (batch.WIDE_BATCH) and without it, at fd41e4b (the commit before it, from a git
# worktree). Rounds with fewer than 8 rows are unchanged, so the one-client run is a control.
# About 5 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/serve-load-wide-cap
BEFORE=$(mktemp -d)/before
git worktree add -q --detach "$BEFORE" fd41e4b
trap 'git worktree remove --force "$BEFORE"' EXIT
(cd "$BEFORE" && OUT="$OLDPWD/$OUT/before" bash benchmarks/results/serve-load-batched-final/run.sh)
OUT="$OUT/with-cap" bash benchmarks/results/serve-load-batched-final/run.sh
