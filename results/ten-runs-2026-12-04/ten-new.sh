#!/usr/bin/env bash
# Ten runs of the files added for issue 22 on the default base, on a loaded machine (the full
# suite or another run going on beside them). One log per run in $OUT (default /tmp/ten-new).
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/ten-new}; mkdir -p "$out"
files=(tests/test_variable_microbatches.py tests/test_distopt_checkpoint.py
  tests/test_expert_bias_grads.py tests/test_clip_grads_empty.py tests/test_mtp_per_token_loss.py
  tests/test_layer_wise_param_norm.py tests/test_expert_gtp_grads.py tests/test_log_accounting.py)
for i in $(seq 1 "${RUNS:-10}"); do
  t0=$(date +%s)
  .venv/bin/python -m pytest -q -p no:cacheprovider "${files[@]}" > "$out/run$i.log" 2>&1
  rc=$?
  echo "run $i: rc $rc, $(tail -1 "$out/run$i.log"), $(( $(date +%s) - t0 )) s, load $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$out/summary.txt"
done
