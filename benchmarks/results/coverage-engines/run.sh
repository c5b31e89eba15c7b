#!/usr/bin/env bash
# coverage-engines: llguidance on all 5,197 dev schemas (compile, every instance, 2 fuzz walks,
# mask times, the instances again with open objects), beside the regex engine's committed coverage-sample400 results; ~8 min on 2 shared
# cores. DEV: the full JSONSchemaBench dev set.
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
python benchmarks/coverage_engines.py --data "$DEV" --out benchmarks/results/coverage-engines
# auto's cold compile end to end on every file (guidance.compile_constraint; the regex engine's
# fallbacks within auto's default 2 s budget), then the report again with it: ~6 min
python benchmarks/coverage_engines.py --data "$DEV" --out benchmarks/results/coverage-engines --time-auto
# The regex engine's committed sample results rechecked on the current code, on the sample's
# first 80 files (alphabetical: BFCL_*, Github_easy), ~5 min:
python benchmarks/coverage.py --data "$DEV" --sample 400 --limit 80 --timeout 10 --memory-gb 6 \
  --fuzz 0 --out benchmarks/results/coverage-engines/regex-recheck80 --results recheck.jsonl
