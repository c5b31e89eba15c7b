#!/usr/bin/env bash
# batch-extract-amx: batched speculation (forced + lookup drafts) and the batched masked baseline
# at B = 1, 2, 4, 8, 16 on 16 extract requests (the committed sample), greedy rows checked
# against B = 1, on an Intel Xeon with AMX tiles (our kernel's amx-bf16 path, chosen by the
# calibration). About 4 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
python benchmarks/batch.py --workload extract --n 16 --out "${OUT:-benchmarks/results/batch-extract-amx}"
