#!/usr/bin/env bash
# draft-caps: the draft cap per batch size, passes modelled on this machine's pass-cost curve
# (benchmarks/draft_caps.py). Tuning data (extract seed 1, the server's requests), not a report
# of a default: no default changed on it yet. About 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/draft-caps
for args in "--workload server" "--workload extract --seed 1 --requests 16"; do
  echo "\$ python benchmarks/draft_caps.py $args"
  python benchmarks/draft_caps.py $args
done > "$OUT/$(uname -m)-$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //; s/[^A-Za-z0-9]\+/-/g').txt"
