#!/usr/bin/env bash
# agreement: top-1 agreement of each weights path with the fp32 copy on 997 teacher-forced answer
# positions of 24 extract requests from the committed sample (no timing: any thread count).
set -euo pipefail
cd "$(dirname "$0")/../../.."
python benchmarks/agreement.py --n 24 --out benchmarks/results/agreement
# head-replay.jsonl: the shipped head's greedy acceptance replayed (head/k4) on the int4 reports'
# baseline outputs, on the fp32 target and on the int4 one (about a minute each)
for w in float int4; do
  python benchmarks/replay_head.py benchmarks/results/extract-fast benchmarks/results/generate-fast \
    --weights "$w"
done | grep '^{' > benchmarks/results/agreement/head-replay.jsonl
