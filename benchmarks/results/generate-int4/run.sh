#!/usr/bin/env bash
# generate-int4: the 4-bit target on 8 generate requests (the prompt gives only the schema),
# against the fp32 copy and llama.cpp. DEV: the full JSONSchemaBench dev set.
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
python benchmarks/run.py --data "$DEV" --workload generate --n 8 --max-new-tokens 128 \
  --configs 'baseline,baseline-float,lookup/d7,head+lookup/k8/c0.3,llama.cpp' \
  --out benchmarks/results/generate-int4
