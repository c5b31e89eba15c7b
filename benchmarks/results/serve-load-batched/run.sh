#!/usr/bin/env bash
# serve-load-batched: as serve-load, the server decoding up to 16 requests together
# (--batch-size 16: one target forward per round for all of them), one torch thread.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python benchmarks/load.py --clients 1,4,16 \
  --requests 20 --max-tokens 48 --server-args "--threads 1 --batch-size 16" \
  --out benchmarks/results/serve-load-batched
