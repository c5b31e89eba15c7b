#!/usr/bin/env bash
# extract-amx: extract-fast's configurations on a CPU with AMX tiles (an Intel Xeon with
# amx_bf16), where our 4-bit kernel runs its AMX path (amx-bf16, chosen by the calibration): the
# 4-bit target with the Q8_0 LM head, against the fp32 copy (baseline-float), torch's 4-bit
# kernel (`/torch-matmul`: this CPU's choice before the AMX path) and llama.cpp on the same GGUF
# (its JSON-schema grammar), greedy and T = 0.7, 16 extract requests. About 5 minutes.
# llama-cpp-python 0.3.36 built with -DGGML_NATIVE=ON crashed in its first decode on this CPU
# (a segfault in a process of its own, no torch loaded); it was rebuilt without its AMX code:
#   CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
#     -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
#     -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
#   pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/extract-amx bash benchmarks/results/extract-fast/run.sh  # its configurations
