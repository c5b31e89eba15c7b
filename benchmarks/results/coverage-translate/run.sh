#!/usr/bin/env bash
# coverage-translate: every dev schema (5,197), translation only; about 10 min on 2 cores.
# Report committed in 9df452f; the schema front end has changed since. To reproduce the report,
# run the same command at that commit without --data (its coverage.py read the dev set only).
# DEV: the full JSONSchemaBench dev set (coverage.py's default is the committed sample).
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
python benchmarks/coverage.py --data "$DEV" --translate-only --timeout 20 --memory-gb 6 --out benchmarks/results/coverage-translate --results all.jsonl
