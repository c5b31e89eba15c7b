#!/usr/bin/env bash
# coverage: every JSONSchemaBench dev schema compiled as a user compiles it, every test instance
# walked through its automaton, two random texts of each automaton checked against jsonschema,
# the instances again with open objects. About 17 minutes on 2 cores. DEV: the dev set's folder.
# results.jsonl (one line per file) is written beside the report and not committed.
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
python benchmarks/coverage.py --data "$DEV" --out benchmarks/results/coverage
