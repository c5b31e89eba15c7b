#!/usr/bin/env bash
# batch-extract-amx: batch-extract's run (batched speculation and the batched masked baseline at
# B = 1, 2, 4, 8, 16 on 16 extract requests, greedy rows checked against B = 1) on the Intel Xeon
# with AMX tiles, where our kernel runs its amx-bf16 path (chosen by the calibration). About 4
# minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/batch-extract-amx bash benchmarks/results/batch-extract/run.sh
