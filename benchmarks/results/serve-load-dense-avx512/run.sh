#!/usr/bin/env bash
# serve-load-dense-avx512: serve-load-batched-final (1 and 16 clients) with prompts on the bf16
# copy with AVX-512 BF16 (649a43c) and at 493d120 (the commit before, in a worktree with its own
# kernel build: its cache folder links the converted model), taking turns twice. About 6 minutes
# on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=$PWD/benchmarks/results/serve-load-dense-avx512
source benchmarks/old_checkout.sh
old_checkout 493d120 "${OLD:-/tmp/dense-avx512-old}"
for turn in 1 2; do
  in_old env OUT="$OUT/before-$turn" bash benchmarks/results/serve-load-batched-final/run.sh
  OUT="$OUT/after-$turn" bash benchmarks/results/serve-load-batched-final/run.sh
done
