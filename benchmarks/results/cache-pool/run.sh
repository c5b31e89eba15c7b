#!/usr/bin/env bash
# cache-pool: the KV-cache pool (llama.CachePool) off and on, taking turns in one process: the
# server's rows (load.py's requests, in-process) at B = 1 and 16, then 16 extract requests at
# B = 1 and 8 with the layers timed. About 8 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/cache-pool
{ echo '$ python benchmarks/cache_pool.py --requests 64 --batches 1,16 --rounds 3'
  python benchmarks/cache_pool.py --requests 64 --batches 1,16 --rounds 3; } > "$OUT/server-rows.txt"
{ echo '$ python benchmarks/csrc_ab.py --pool --requests 16 --rounds 4'
  python benchmarks/csrc_ab.py --pool --requests 16 --rounds 4; } > "$OUT/extract-ab.txt"
