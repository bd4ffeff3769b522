#!/usr/bin/env bash
# Ten loaded runs of the files this session added (0.19.2).
cd "$(git rev-parse --show-toplevel)"
for i in $(seq 1 10); do
  t0=$(date +%s)
  FORK_TEST_BASE=0.19.2 nice .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_sources.py tests/test_train_loop_hooks.py tests/test_warmup_observed.py \
    tests/test_first_five_table.py "tests/test_warmup.py::test_exact_restore" \
    tests/test_warmup_pp.py::test_moe_calibration_kept_only_where_no_router_can_withhold_a_grad \
    > /tmp/ten/run$i.log 2>&1
  rc=$?
  echo "run $i rc $rc $(( $(date +%s) - t0 )) s load $(cut -d' ' -f1 /proc/loadavg) $(tail -1 /tmp/ten/run$i.log)" >> /tmp/ten/summary.txt
done
