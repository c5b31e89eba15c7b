#!/usr/bin/env bash
# agreement: top-1 agreement of each weights path with the fp32 copy on teacher-forced answer
# positions of 24 extract requests from the committed sample (no timing: any thread count).
set -euo pipefail
cd "$(dirname "$0")/../../.."
python benchmarks/quality.py agreement --n 24 --out benchmarks/results/agreement
