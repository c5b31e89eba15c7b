#!/usr/bin/env bash
# batch-extract: batched speculation (forced + lookup drafts) and the batched masked baseline at
# B = 1, 2, 4, 8, 16 on 16 extract requests (the committed sample), greedy rows checked against
# B = 1. About 4 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
python benchmarks/batch.py --workload extract --n 16 --out "${OUT:-benchmarks/results/batch-extract}"
