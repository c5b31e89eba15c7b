#!/usr/bin/env bash
# Keys in tiles (bca5f6e) against the commit before (e0ad82d), end to end: 16 extract requests at
# B = 1, 8 and 16 (benchmarks/batch.py), the two taking turns four times, the old one in a worktree
# with its own kernel build (its cache folder links the converted model). The passes alone, in
# one process: passes.txt (python benchmarks/csrc_ab.py e0ad82d --rounds 10 --prompt 0).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=$PWD/benchmarks/results/key-tiles
source benchmarks/old_checkout.sh
old_checkout e0ad82d "${OLD:-/tmp/key-tiles-old}"
for turn in ${TURNS:-1 2 3 4}; do
  in_old python benchmarks/batch.py \
    --workload extract --n 16 --sizes 1,8,16 --out "$OUT/before-$turn" > /dev/null
  python benchmarks/batch.py --workload extract --n 16 --sizes 1,8,16 --out "$OUT/after-$turn" > /dev/null
done
