#!/usr/bin/env bash
# coverage-engines: llguidance on all 5,197 dev schemas (compile, every instance, 2 fuzz walks,
# mask times), beside the regex engine's committed coverage-sample400 results; ~8 min on 2 shared
# cores. DEV: the full JSONSchemaBench dev set.
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
python benchmarks/coverage_engines.py --data "$DEV" --out benchmarks/results/coverage-engines
