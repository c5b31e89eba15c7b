#!/usr/bin/env bash
# serve-load-amx: serve-load-batched-final on the Intel Xeon with AMX tiles (our kernel's
# amx-bf16 path, chosen by the calibration): 1 and 16 clients. About 2 minutes.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python benchmarks/load.py --clients 1,16 \
  --requests 20 --max-tokens 48 --server-args "--threads 1 --batch-size 16" \
  --out benchmarks/results/serve-load-amx
