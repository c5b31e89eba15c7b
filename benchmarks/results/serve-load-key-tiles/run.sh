#!/usr/bin/env bash
# serve-load-key-tiles: serve-load-batched-final (1 and 16 clients) with the keys in tiles
# (bca5f6e) and at e0ad82d (the commit before, in a worktree with its own kernel build: its
# cache folder links the converted model), taking turns twice. About 6 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=$PWD/benchmarks/results/serve-load-key-tiles
OLD=${OLD:-/tmp/key-tiles-old}
[ -d "$OLD" ] || git worktree add -q --detach "$OLD" e0ad82d
CACHE=${CONSTRAINED_SPEC_CACHE:-$HOME/.cache/constrained_spec}
mkdir -p "$OLD/.cache"
for entry in "$CACHE"/*; do
  [ "$(basename "$entry")" = kernels ] || ln -sfn "$entry" "$OLD/.cache/$(basename "$entry")"
done
for turn in 1 2; do
  (cd "$OLD" && CONSTRAINED_SPEC_CACHE="$OLD/.cache" OUT="$OUT/before-$turn" \
    bash benchmarks/results/serve-load-batched-final/run.sh)
  OUT="$OUT/after-$turn" bash benchmarks/results/serve-load-batched-final/run.sh
done
