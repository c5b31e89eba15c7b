#!/usr/bin/env bash
# coverage-sample400: a stratified sample of 405 dev schemas, compiled and walked instance by instance; 22 min.
# Report committed in 9df452f; the schema front end has changed since. To reproduce the report,
# run the same command at that commit without --data (its coverage.py read the dev set only).
# DEV: the full JSONSchemaBench dev set (coverage.py's default is the committed sample).
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
python benchmarks/coverage.py --data "$DEV" --sample 400 --timeout 10 --memory-gb 6 --out benchmarks/results/coverage-sample400 --results sample400.jsonl
