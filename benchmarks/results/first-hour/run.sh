#!/usr/bin/env bash
# The first hour of a new user (issue 58), on this machine: a virtualenv made by the README's own
# command (test extras included) and one made by a plain `pip install .`; in the first, one call
# on an empty cache (download, kernel build, calibration, preparing), then warm and cold calls.
# Holds the quiet lock: nothing else may run while it times.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/first-hour
exec 9>/tmp/quiet.lock && flock 9
if [ "${REINSTALL:-1}" = 1 ]; then  # REINSTALL=0: the virtualenvs of a previous run
  rm -rf /tmp/readmeenv /tmp/plainenv
  python3.11 -m venv /tmp/readmeenv && /tmp/readmeenv/bin/pip install -q torch==2.13.0 -e ".[test]"
  python3.11 -m venv /tmp/plainenv && /tmp/plainenv/bin/pip install -q torch==2.13.0 .
fi
/tmp/readmeenv/bin/python benchmarks/startup.py --first-run --repeats 5 --out "$OUT/readme-install" \
  --baseline-python /tmp/plainenv/bin/python
