#!/bin/bash
# Recorded as run on 2026-12-03 (paths of that session: /tmp/devtrees2, /work/wt-unit); see ../README.md.
# CPU runs of the upstream-layout tests: native (no plugin) and gloo (plugin, worlds 1, 2, 4), pristine vs fork.
D=/tmp/devtrees2; R=$D/results; mkdir -p $R
export FORK_CPU_REDIRECT=/work/wt-unit/tests/harness/cpu_redirect.py
PY=/work/main/.venv/bin/python
ALL=$(cut -d' ' -f2 $D/tests.txt | tr '\n' ' ')
MULTI="tests/unit_tests/optimizer/test_expert_grad_stats_tp_groups.py tests/unit_tests/training/test_param_norm_expert_tp.py tests/unit_tests/optimizer/test_layer_wise_expert_grad_stats.py tests/unit_tests/tensor_parallel/test_expert_linear_uses_expert_pgs.py"
OPTS="-o addopts= -p no:cacheprovider -p no:warnings -rA --continue-on-collection-errors"
for tree in pristine fork; do
  cd $D/$tree
  PYTHONPATH=/tmp/devtrees/site timeout 600 $PY -m pytest $OPTS tests/unit_tests/data/test_compile_helpers_installed.py tests/unit_tests/training/test_warmup_train_steps.py -k "not TestRunWarmup" > $R/cpu-native-$tree.log 2>&1
  echo "cpu-native-$tree rc=$?"
  PYTHONPATH=/work/wt-unit/results/dev-unit-tests:/tmp/devtrees/site MASTER_PORT=29541 timeout 900 $PY -m pytest -p cpu_gloo_plugin $OPTS $ALL > $R/cpu-gloo-w1-$tree.log 2>&1
  echo "cpu-gloo-w1-$tree rc=$?"
  PYTHONPATH=/work/wt-unit/results/dev-unit-tests:/tmp/devtrees/site timeout 900 /work/main/.venv/bin/torchrun --nproc_per_node 2 --master_port 29543 --log-dir $R/w2-$tree --redirects 3 --tee 0 -m pytest -p cpu_gloo_plugin $OPTS $MULTI > $R/cpu-gloo-w2-$tree.log 2>&1
  echo "cpu-gloo-w2-$tree rc=$?"
  PYTHONPATH=/work/wt-unit/results/dev-unit-tests:/tmp/devtrees/site timeout 900 /work/main/.venv/bin/torchrun --nproc_per_node 4 --master_port 29545 --log-dir $R/w4-$tree --redirects 3 --tee 0 -m pytest -p cpu_gloo_plugin $OPTS $MULTI > $R/cpu-gloo-w4-$tree.log 2>&1
  echo "cpu-gloo-w4-$tree rc=$?"
done
