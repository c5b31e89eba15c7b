#!/usr/bin/env bash
# serve-load-amx: serve-load-batched-final on the Intel Xeon with AMX tiles (our kernel's
# amx-bf16 path, chosen by the calibration): 1 and 16 clients. About 2 minutes.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/serve-load-amx bash benchmarks/results/serve-load-batched-final/run.sh
