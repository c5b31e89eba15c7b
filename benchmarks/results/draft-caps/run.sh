#!/usr/bin/env bash
# draft-caps: the draft cap per batch size, passes modelled on this machine's pass-cost curve
# (benchmarks/draft_caps.py, the batcher's own wide-batch cap off). The tuning data (the server's
# requests, extract --seed 1) set batch.WIDE_BATCH and WIDE_MAX_DRAFT; the report is on
# requests nobody tuned on (extract and generate --seed 0). The wall clocks, caps taking turns,
# in $MACHINE-wall.txt. About 25 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/draft-caps
MACHINE="$(uname -m)-$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //; s/[^A-Za-z0-9]\+/-/g')"
run() { echo "\$ python benchmarks/draft_caps.py $*"; python benchmarks/draft_caps.py "$@"; }
{ run --workload server; run --workload extract --seed 1 --requests 16; } > "$OUT/$MACHINE.txt"
{ run --workload extract --seed 0 --requests 16; run --workload generate --seed 0 --requests 16; } \
  > "$OUT/$MACHINE-report.txt"
run --workload extract --seed 0 --requests 16 --batches 8,16 --caps 3,1 --repeat 3 > "$OUT/$MACHINE-wall.txt"
