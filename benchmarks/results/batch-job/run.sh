#!/usr/bin/env bash
# batch-job: `constrained-spec batch` over 1,000 rows, SIGINT 60 s in, rerun to the end; every id must
# be written exactly once as a whole line; then the same rows in-process (Generator.generate_batch).
# About 7 minutes on 2 cores. (input.jsonl / output.jsonl are written here too; not committed.)
set -euo pipefail
cd "$(dirname "$0")/../../.."
python benchmarks/batch_job.py --rows 1000 --interrupt-after 60 --out benchmarks/results/batch-job
