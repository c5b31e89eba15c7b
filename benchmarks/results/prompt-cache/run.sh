#!/usr/bin/env bash
# prompt-cache: kept prompts (llama.PromptCache) on a corpus-style job: 4 schemas of the committed
# sample × 4 records each (variants of one valid instance), extract, greedy; single requests and
# generate_batch at B = 8, each with nothing kept and with prompts kept; outputs compared. About a
# minute on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
python benchmarks/prompt_cache.py --out benchmarks/results/prompt-cache
