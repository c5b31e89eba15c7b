#!/usr/bin/env bash
# serve-load: 1, 4 and 16 concurrent clients x 20 streamed JSON Schema requests each against
# `constrained-spec serve` (the default model, draft="auto"), one torch thread (a shared CPU).
# Requests run one at a time (no batched engine yet): throughput is expected to stay flat.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python benchmarks/load.py --clients 1,4,16 \
  --requests 20 --max-tokens 48 --server-args "--threads 1" --out benchmarks/results/serve-load
