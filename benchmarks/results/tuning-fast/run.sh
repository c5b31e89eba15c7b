#!/usr/bin/env bash
# tuning-fast: the draft-length cap of draft="auto" on the 4-bit target (decode.QUANTIZED_MAX_DRAFT)
# was chosen on these 2 × 10 extract requests (--seed 1 and --seed 2), not on the requests of
# extract-fast / generate-fast (--seed 0). About 3 minutes per seed.
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
for seed in 1 2; do
  python benchmarks/run.py --data "$DEV" --workload extract --n 10 --seed "$seed" --max-new-tokens 160 \
    --configs 'baseline,lookup/d2,lookup/d3,lookup/d4,lookup/d5,lookup/d7,baseline@t0.7,lookup/d3@t0.7,lookup/d5@t0.7,lookup/d7@t0.7' \
    --out "benchmarks/results/tuning-fast/seed$seed"
done
