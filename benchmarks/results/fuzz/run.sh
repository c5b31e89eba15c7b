#!/usr/bin/env bash
# fuzz: 2,000 seeded cases (1,000 random schemas, 1,000 mutated dev-sample schemas) compiled
# against the tiny test tokenizer; every text an automaton accepts is validated (summary.json;
# results.jsonl, one record per case, is not committed). A few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
python benchmarks/coverage.py fuzz --cases 2000 --out benchmarks/results/fuzz
