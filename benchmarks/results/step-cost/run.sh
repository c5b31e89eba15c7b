#!/usr/bin/env bash
# step-cost: the 4-bit target's one-token step against the bandwidth limit (bandwidth.txt), 41
# paired rounds per 4-bit kernel (a 1 GiB sum, then 10 steps). About 2 minutes.
set -euo pipefail
cd "$(dirname "$0")/../../.."
python tools/step_cost.py bandwidth | grep -v -i "loading weights" > benchmarks/results/step-cost/bandwidth.txt
