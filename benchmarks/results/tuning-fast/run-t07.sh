#!/usr/bin/env bash
# tuning-fast at T = 0.7 with sample.draw (CDF inversion): the cap of draft="auto"'s lookup
# (2 or 3) and the head alone, on 10 generate and 10 extract requests each of --seed 1 and
# --seed 2 (not the seed-0 requests of extract-fast / generate-fast). About 2 minutes a run.
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
for w in generate extract; do
  for seed in 1 2; do
    python benchmarks/run.py --data "$DEV" --workload "$w" --n 10 --seed "$seed" --max-new-tokens 160 \
      --configs 'baseline@t0.7,lookup/d2@t0.7,lookup/d3@t0.7,head/k4@t0.7' \
      --out "benchmarks/results/tuning-fast/t07-$w-seed$seed"
  done
done
