#!/usr/bin/env bash
# Ten runs in a row of the tests issue 29 and issue 32 added or changed, beside a CPU hog (one
# `yes` process) on the shared 2-core machine. Usage: from the repository root, with .venv built
# (tools/install.sh --test-deps): bash results/ten-runs-2026-12-05-issue29/ten.sh OUT_DIR
# With pytest arguments after OUT_DIR it runs those instead (the later ten-run records use it).
set -u
out=${1:?OUT_DIR}
shift
mkdir -p "$out"
yes > /dev/null &
hog=$!
trap 'kill $hog' EXIT
K='tiny_gpt or adds_the_other or overcount_counterfactual or naive_warmup or wide_group'
K="$K or initialized_offsets or qk_clip_after or two_instances or reset_before_the_first_call"
K="$K or reset_between_two_calls or test_records or test_docs or test_install_verify"
args=("$@")
[ ${#args[@]} = 0 ] && args=(-k "$K"
  tests/test_pretrain.py tests/test_log_accounting.py tests/test_expert_bias_grads.py
  tests/test_ddp_calibration.py tests/test_grad_ready_diagnostics.py
  tests/test_attention_sink_grad_stats.py tests/test_layer_wise_param_norm.py
  tests/test_variable_microbatches.py tests/tooling/test_records.py tests/tooling/test_docs.py
  tests/tooling/test_install_verify.py)
for i in $(seq 1 10); do
  t0=$(date +%s)
  .venv/bin/python -m pytest -q -p no:cacheprovider "${args[@]}" > "$out/run$i.log" 2>&1
  rc=$?
  echo "run $i rc $rc $(( $(date +%s) - t0 )) s $(tail -1 "$out/run$i.log")" | tee -a "$out/summary.txt"
done
