#!/usr/bin/env bash
# serve-load-batched-final: serve-load-batched again (1 and 16 clients only) on the current code
# (the fast target's second round; first run at git 68a8256). About 2 minutes.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python benchmarks/load.py --clients 1,16 \
  --requests 20 --max-tokens 48 --server-args "--threads 1 --batch-size 16" \
  --out "${OUT:-benchmarks/results/serve-load-batched-final}"
