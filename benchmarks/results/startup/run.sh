#!/usr/bin/env bash
# Start-up time, this checkout against the commit before the work (bffc19d), each in a fresh
# virtualenv without the test extras (what `pip install constrained_spec` gives a user: the
# test extras' jsonschema[format-nongpl] alone adds 0.7 s to jsonschema's import). Run on an
# otherwise idle machine.
set -euo pipefail
python3.11 -m venv /tmp/userenv && /tmp/userenv/bin/pip install -q torch==2.13.0 && /tmp/userenv/bin/pip install -q -e .
git worktree add /tmp/before bffc19d
python3.11 -m venv /tmp/beforeenv && /tmp/beforeenv/bin/pip install -q torch==2.13.0 && /tmp/beforeenv/bin/pip install -q -e /tmp/before
/tmp/userenv/bin/python benchmarks/startup.py --out benchmarks/results/startup/default --repeats 5 \
  --baseline-python /tmp/beforeenv/bin/python
# random weights at Qwen2.5-1.5B's shape, Q4_K_M (python benchmarks/shapes.py write --dir /work/shapes)
/tmp/userenv/bin/python benchmarks/startup.py --out benchmarks/results/startup/qwen2.5-1.5b --repeats 1 \
  --model /work/shapes/qwen2.5-1.5b.Q4_K_M.gguf --baseline-python /tmp/beforeenv/bin/python
