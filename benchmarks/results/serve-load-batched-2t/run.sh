#!/usr/bin/env bash
# serve-load-batched-2t: as serve-load-batched, with torch's default threads (2 here): the
# batch's wider forwards have more to share between cores (fine only while the CPU is idle).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python benchmarks/load.py --clients 1,4,16 \
  --requests 20 --max-tokens 48 --server-args "--batch-size 16" \
  --out benchmarks/results/serve-load-batched-2t
