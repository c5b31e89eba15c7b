#!/usr/bin/env bash
# load-aware: batched speculation (the plan of decoding/loop.py) against the batched masked
# baseline at B = 1, 2, 4, 8, 16 on the dev set's --seed 0 selection (16 requests; the plan's
# priors were tuned on --seed 1), both workloads, greedy and T = 0.7, median of 3 runs a point.
# About 18 minutes on 2 cores; run it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=../shared/data/jsonschemabench-dev
R=${OUT:-benchmarks/results/load-aware}
for w in extract generate; do
  python benchmarks/batch.py --workload $w --data $D --seed 0 --repeats 3 --out $R/$w-greedy
  python benchmarks/batch.py --workload $w --temperature 0.7 --data $D --seed 0 --repeats 3 \
    --out $R/$w-t07
done
# the server, 1 and 16 clients (the reports here were written to /tmp/ls/load-final and
# /tmp/ls/load-final-default, then copied: the same commands)
python benchmarks/serve.py load --clients 1,16 --requests 20 --max-tokens 48 \
  --server-args "--threads 1 --batch-size 16" --out $R/serve-threads1
python benchmarks/serve.py load --clients 1,16 --requests 20 --max-tokens 48 --out $R/serve-default
