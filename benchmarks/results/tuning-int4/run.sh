#!/usr/bin/env bash
# tuning-int4: the draft-length cap and draft="auto" on the 4-bit target were chosen on these
# 10 extract requests (--seed 1), not on the requests of extract-int4 / generate-int4 (--seed 0).
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
python benchmarks/run.py --data "$DEV" --workload extract --n 10 --seed 1 --max-new-tokens 160 \
  --configs 'baseline,lookup,lookup/d3,lookup/d7,lookup/d11,head/k3,head+lookup/k4/c0.3/d3,head+lookup/k8/c0.3/d7' \
  --out benchmarks/results/tuning-int4
