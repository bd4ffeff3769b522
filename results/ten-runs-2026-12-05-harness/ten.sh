#!/usr/bin/env bash
# The tests this session added or changed, ten times in a row, with a CPU hog beside them.
# Usage: results/ten-runs-2026-12-05-harness/ten.sh > results/ten-runs-2026-12-05-harness/summary.txt
cd "$(dirname "$0")/../.."
( while :; do :; done ) & hog=$!
trap 'kill $hog' EXIT
for i in $(seq 1 10); do
  t0=$(date +%s)
  FORK_TEST_BASE=0.19.2 .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_harness.py tests/test_first_five_table.py > /tmp/ten-run.log 2>&1
  rc=$?
  echo "run $i rc $rc $(( $(date +%s) - t0 ))s: $(tail -1 /tmp/ten-run.log)"
done
