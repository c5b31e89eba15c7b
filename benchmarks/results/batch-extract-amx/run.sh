#!/usr/bin/env bash
# batch-extract-amx: batch-extract on the Intel Xeon with AMX tiles (our kernel's amx-bf16 path,
# chosen by the calibration). batch-extract: batched speculation (forced + lookup drafts) and the batched masked baseline at batch sizes
# 1, 2, 4, 8, 16 on the same 16 extract requests (the committed sample); greedy rows checked
# against B = 1. About 4 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
python benchmarks/batch.py --workload extract --n 16 --out benchmarks/results/batch-extract-amx
