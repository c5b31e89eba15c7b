#!/usr/bin/env bash
# head-training: the five runs that produced the shipped draft head (docs/draft-head.md).
# Each run starts from the previous run's weights (--init). The cards (*.json) and logs (*.log)
# here were written by these commands; the weights of every run are in git:
#   run 1: commit 253508f   run 2: 0384178   run 3: c78d8e7   run 4: 2baf454   run 5: 5b05587 (shipped)
# Runs 1-3 ran before the copy gate existed (run 1 at commit 2fc64a3); at HEAD the same commands
# train today's head architecture.
# Data collection (self-distilled answers + teacher-forced dataset answers) is cached in
# $FEATURES; the first run spends about 27 + 26 min on it (2 cores), later runs reuse it.
# DEV: the full JSONSchemaBench dev set (train_head.py's default).
set -euo pipefail
cd "$(dirname "$0")/../../.."
FEATURES="${FEATURES:-/tmp/head-features.pt}"
W=/tmp/head-runs
mkdir -p "$W"
common=(--features "$FEATURES" --answers target --train-steps 3 --train-tokens 150000)
# run 1 (shipped-mixed-60min): 60 min, self-distilled + 800k-token dataset budget
python benchmarks/train_head.py --out "$W/run1.safetensors" "${common[@]}" \
  --dataset-tokens 800000 --minutes 60
# run 2 (shipped-copy-finetune): the copy proposals and the prompt's tokens, 25 min
python benchmarks/train_head.py --out "$W/run2.safetensors" --init "$W/run1.safetensors" \
  "${common[@]}" --dataset-tokens 680000 --prompt-vocab --lr 3e-4 --minutes 25
# run 3 (shipped-copy-answers): answer positions weighted 3x, 32 min
python benchmarks/train_head.py --out "$W/run3.safetensors" --init "$W/run2.safetensors" \
  "${common[@]}" --dataset-tokens 680000 --prompt-vocab --lr 2e-4 --minutes 32 --answer-weight 3
# run 4 (shipped-copy-gate): the copy gate alone, 8 min
python benchmarks/train_head.py --out "$W/run4.safetensors" --init "$W/run3.safetensors" \
  "${common[@]}" --dataset-tokens 680000 --prompt-vocab --lr 3e-3 --minutes 8 --answer-weight 3 \
  --copy-gate --gate-only
# run 5 (shipped-copy-gate-joint, shipped): head and gate together, 30 min
python benchmarks/train_head.py --out "$W/run5.safetensors" --init "$W/run4.safetensors" \
  "${common[@]}" --dataset-tokens 680000 --prompt-vocab --lr 2e-4 --minutes 30 --answer-weight 3 \
  --copy-gate
# score a head without training (the same validation set):
python benchmarks/train_head.py --evaluate constrained_spec/heads/smollm2-135m-instruct.safetensors \
  --features "$FEATURES" --answers target
