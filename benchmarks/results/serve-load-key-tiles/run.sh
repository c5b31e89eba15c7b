#!/usr/bin/env bash
# serve-load-key-tiles: serve-load-batched-final (1 and 16 clients) with the keys in tiles
# (bca5f6e) and at e0ad82d (the commit before, in a worktree with its own kernel build: its
# cache folder links the converted model), taking turns twice. About 6 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=$PWD/benchmarks/results/serve-load-key-tiles
source benchmarks/old_checkout.sh
old_checkout e0ad82d "${OLD:-/tmp/key-tiles-old}"
for turn in 1 2; do
  in_old env OUT="$OUT/before-$turn" bash benchmarks/results/serve-load-batched-final/run.sh
  OUT="$OUT/after-$turn" bash benchmarks/results/serve-load-batched-final/run.sh
done
