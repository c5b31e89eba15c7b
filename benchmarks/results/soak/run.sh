#!/usr/bin/env bash
# soak: 10,000 mixed requests (JSON Schema replies, streams half dropped after the first chunk,
# malformed schemas, tool_choice auto, clients timing out, schemas seen once) from 8 clients
# against `constrained-spec serve` (defaults), max_tokens 24; RSS sampled every 250 requests.
# About 15 minutes on 2 cores; holds /tmp/quiet.lock for the whole run.
set -euo pipefail
cd "$(dirname "$0")/../../.."
flock /tmp/quiet.lock python benchmarks/serve.py soak --requests 10000 --minutes 30 --clients 8 \
  --max-tokens 24 --out "${OUT:-benchmarks/results/soak}"
