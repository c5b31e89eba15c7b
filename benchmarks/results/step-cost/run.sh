#!/usr/bin/env bash
# step-cost: torch.compile on the target, measured and not adopted (torch-compile.md); the 4-bit
# compact forward per phase (phases.txt) and against the bandwidth limit (bandwidth.txt).
# Measured at commit 5261f21; about 7 minutes (the compiled run is killed while recompiling).
set -euo pipefail
cd "$(dirname "$0")/../../.."
python benchmarks/step_cost.py eager-skinny
timeout 400 python benchmarks/step_cost.py compile-skinny || true
# phases.txt: the 4-bit compact forward per phase (the LM head at wide and narrow positions) and the
# prefill costs (about 3 minutes)
python benchmarks/step_cost.py phases | grep -v -i "profiler\|loading weights" > benchmarks/results/step-cost/phases.txt
# bandwidth.txt: the one-token step against the bandwidth limit, 41 paired rounds per 4-bit kernel
# (about 2 minutes)
python benchmarks/step_cost.py bandwidth | grep -v -i "loading weights" > benchmarks/results/step-cost/bandwidth.txt
