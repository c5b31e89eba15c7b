#!/usr/bin/env bash
# Prompts on the bf16 copy with AVX-512 BF16 (649a43c) against the commit before (493d120), end
# to end: 16 extract requests at B = 1, 8 and 16 (benchmarks/batch.py), the two taking turns three
# times, the old one in a worktree with its own kernel build (its cache folder links the converted
# model; its calibration is its own, v7). The same kernels in one process, taking turns round
# after round: prefill-ab.txt (python benchmarks/csrc_ab.py --prefills int4 avx512-bf16
# --requests 16 --rounds 5).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=$PWD/benchmarks/results/dense-avx512
source benchmarks/old_checkout.sh
old_checkout 493d120 "${OLD:-/tmp/dense-avx512-old}"
for turn in ${TURNS:-1 2 3}; do
  in_old python benchmarks/batch.py \
    --workload extract --n 16 --sizes 1,8,16 --out "$OUT/before-$turn" > /dev/null
  python benchmarks/batch.py --workload extract --n 16 --sizes 1,8,16 --out "$OUT/after-$turn" > /dev/null
done
