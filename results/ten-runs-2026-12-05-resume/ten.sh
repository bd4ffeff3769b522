#!/usr/bin/env bash
# Ten runs in a row of tests/test_resume_candidates.py (issue 30: pristine on every candidate,
# the fork arms of 0022 and 0023) beside a CPU hog, on the shared 2-core machine, base 0.19.2.
# Usage: from the repository root with .venv built: bash results/ten-runs-2026-12-05-resume/ten.sh OUT
set -u
out=${1:?OUT_DIR}
mkdir -p "$out"
yes > /dev/null &
hog=$!
trap 'kill $hog' EXIT
for i in $(seq 1 10); do
  t0=$(date +%s)
  .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_resume_candidates.py > "$out/run$i.log" 2>&1
  rc=$?
  echo "run $i rc $rc $(( $(date +%s) - t0 )) s $(tail -1 "$out/run$i.log")" | tee -a "$out/summary.txt"
done
