#!/usr/bin/env bash
# serve-load-amx: 1 and 16 clients against `constrained-spec serve --threads 1 --batch-size 16`
# on an Intel Xeon with AMX tiles (our kernel's amx-bf16 path, chosen by the calibration), 20
# requests of 48 tokens per client count. About 2 minutes.
set -euo pipefail
cd "$(dirname "$0")/../../.."
python benchmarks/serve.py load --clients 1,16 --requests 20 --max-tokens 48 \
  --server-args "--threads 1 --batch-size 16" --out "${OUT:-benchmarks/results/serve-load-amx}"
