#!/usr/bin/env bash
# extract-avx2: the headline on a CPU without AVX-512 (this run: a 2-core AMD EPYC of the first
# Zen generation, AVX2 and FMA only): the 4-bit target on our AVX2 kernels (int8 activations)
# against llama.cpp (llama-cpp-python 0.3.36 built for this CPU: AVX2, no AVX-512) on the same
# GGUF with its JSON-schema grammar, greedy and T = 0.7, 16 extract requests of the dev set.
# `lookup/d3` is what draft="auto" runs on the 4-bit target. On a CPU with AVX-512, ISA=avx2
# builds and runs our side as an AVX2-only CPU would (llama.cpp needs its own AVX2 build:
# CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
# -DGGML_AVX512=OFF" pip install --no-cache-dir llama-cpp-python==0.3.36). About 10 minutes.
# DEV: the dev set's folder.
set -euo pipefail
cd "$(dirname "$0")/../../.."
DEV="${DEV:-../shared/data/jsonschemabench-dev}"
python benchmarks/run.py --isa "${ISA:-native}" --data "$DEV" --workload extract --n 16 --max-new-tokens 160 \
  --configs 'baseline,lookup/d3,llama.cpp,baseline@t0.7,lookup/d3@t0.7,llama.cpp@t0.7' \
  --out "${OUT:-benchmarks/results/extract-avx2}"
